#include "benchmarks/compare.hpp"

#include <cstdio>
#include <memory>

#include <CLI/CLI.hpp>

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
  try {
    app.parse(argc, argv);
    if (o.workload && app.count("--model"))
      throw CLI::ValidationError("--model", "'" + o.model + "' is not used: this program trains " +
                                                o.workload->name + "; leave --model out");
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
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
  if (!workload.make_model || !workload.make_dataset || workload.name.empty()) {
    std::fprintf(stderr, "compare: the workload needs a name, make_model and make_dataset\n");
    return 2;
  }
  return parse_and_run(std::make_shared<const Workload>(std::move(workload)), argc, argv);
}

int dp_bench_main(int argc, char** argv) {
  return parse_and_run(nullptr, argc, argv);
}

}  // namespace bench
