#include "benchmarks/compare.hpp"

#include <cstdio>
#include <memory>

#include <CLI/CLI.hpp>

#include "benchmarks/gpt_workload.hpp"
#include "dp/cli/cli.hpp"
#include "nn/gpt.hpp"
#include "nn/llama.hpp"

namespace bench {

namespace {

int parse_and_run(std::shared_ptr<const Workload> workload, int argc, char** argv) {
  Options o;
  o.workload = std::move(workload);
  CLI::App app{o.workload ? "compare DP (threads) and DDP (processes) on " + o.workload->name
                          : "dp_bench: DP (threads) and DDP (processes) on the same model, "
                            "side by side"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  add_flags(app, o);
  // A workload of the user's own: the built-in models' flags stay out of --help (given, they
  // are refused by name below).
  if (o.workload)
    for (const char* flag : {"--model", "--gpt-config", "--seq", "--dropout", "--loss-chunk",
                             "--recompute", "--peak-tflops", "--max-staleness", "--staleness-lr"})
      app.get_option(flag)->group("");
  // ... and with its own optimizer, --optim.
  if (o.workload && o.workload->make_optimizer) app.get_option("--optim")->group("");
  try {
    app.parse(argc, argv);
    if (o.workload && app.count("--model"))
      throw CLI::ValidationError("--model", "'" + o.model + "' is not used: this program trains " +
                                                o.workload->name + "; leave --model out");
    if (o.workload && o.workload->make_optimizer && app.count("--optim"))
      throw CLI::ValidationError("--optim", "'" + o.optim + "' is not used: " + o.workload->name +
                                                " trains with its own optimizer (" +
                                                o.workload->optimizer_name + ")");
    if (o.workload && o.workload->make_optimizer) o.optim = o.workload->optimizer_name;
    for (const char* flag : {"--max-staleness", "--staleness-lr"})
      if (o.workload && app.count(flag))
        throw CLI::ValidationError(flag,
                                   "is the parameter server's (--mode ps), which runs "
                                   "dp_bench's built-in models only; " +
                                       o.workload->name +
                                       " trains with dp, ddp, both or "
                                       "hybrid");
    const bool lm = !o.workload && (o.model == "gpt" || o.model == "llama");
    for (const char* flag : {"--gpt-config", "--dropout"})
      if (app.count(flag) && (o.workload || o.model != "gpt"))
        throw CLI::ValidationError(flag, std::string("is for --model gpt; this run trains ") +
                                             (o.workload ? o.workload->name : o.model));
    for (const char* flag : {"--seq", "--recompute", "--loss-chunk", "--peak-tflops"})
      if (app.count(flag) && !lm)
        throw CLI::ValidationError(flag, std::string("is for --model gpt or llama; this run "
                                                     "trains ") +
                                             (o.workload ? o.workload->name : o.model));
    if (lm) {
      // A language model's defaults: 8 sequences per batch and AdamW, unless given.
      if (!app.count("--batch") && !app.count("--batch-per-device")) o.batch = 8;
      if (!app.count("--optim")) o.optim = "adamw";
      const bool llama = o.model == "llama";
      const int64_t context = llama ? nn::LlamaConfig::preset("tiny").context
                                    : nn::GptConfig::preset(o.gpt_config).context;
      const int64_t seq = o.seq ? *o.seq : context;
      if (seq > context)
        throw CLI::ValidationError(
            "--seq", std::to_string(seq) + " is longer than " +
                         (llama ? std::string("llama-tiny") : "--gpt-config " + o.gpt_config) +
                         "'s context " + std::to_string(context) + ": give at most that");
      const Blocks blocks = o.recompute ? Blocks::recomputed : Blocks::kept;
      o.workload = std::make_shared<const Workload>(
          llama ? llama_workload(seq, o.seed, blocks, o.loss_chunk)
                : gpt_workload(o.gpt_config, seq, o.dropout, o.seed, blocks, o.loss_chunk));
    }
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  const char* program = o.workload ? o.workload->name.c_str() : "dp_bench";
  try {
    return run(o, argc, argv);
  } catch (const RunFailed& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return e.exit_code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace

int compare(Workload workload, int argc, char** argv) {
  if (!workload.make_model || (!workload.make_dataset && !workload.make_batch) ||
      workload.name.empty()) {
    std::fprintf(
        stderr, "compare: the workload needs a name, make_model, and make_dataset or make_batch\n");
    return 2;
  }
  return parse_and_run(std::make_shared<const Workload>(std::move(workload)), argc, argv);
}

int dp_bench_main(int argc, char** argv) {
  return parse_and_run(nullptr, argc, argv);
}

}  // namespace bench
