// train_text: trains a byte-level GPT on English text (Debian's fortunes-min), on one device,
// through DP (threads) or DDP (processes), and prints train and validation loss, tokens/s and a
// short greedy or top-k sample.
//
//   bin/train_text --gpt-config tiny --steps 200
//   bin/train_text --mode dp --gpus 2 --steps 200 --save run.safetensors
//   bin/train_text --mode ddp --gpus 2 --steps 100 --resume run.safetensors --top-k 5
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
#include "dp/data/text.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/ddp_trainer.hpp"
#include "kernels/runtime/memory_info.hpp"
#include "nn/nn.hpp"
#include "nn/train_state.hpp"

using kernels::Device;
using kernels::Tensor;

namespace {

struct Flags {
  std::string model = "gpt", gpt_config = "tiny", device = "auto", mode = "single";
  std::string data = dp::data::kDefaultTextDir, save, resume, log;
  int gpus = 1;
  int micro_batches = 1;  // per device or rank and step: gradient accumulation
  int64_t steps = 200, batch = 16, seq = 64, eval_every = 50, val_batches = 8;
  // lr 3e-3: the tiny preset beats a bigram byte model in 200 steps of 8 x 64; at 6e-3 and
  // above it stalls near 3 nats (docs/programs.md, "train_text").
  float lr = 3e-3f, weight_decay = 0.1f, clip_grad = 1.f, dropout = 0.f;
  int64_t warmup = 20;  // linear warm-up steps, then cosine decay to lr / 10 at --steps
  uint64_t seed = 1;
  int64_t sample_bytes = 120, top_k = 1;  // top_k 1: greedy
  int64_t save_every = 0;                 // 0: --save at the end only
  double timeout_s = 0;  // ddp rendezvous and collectives; 0: DP_TIMEOUT or the defaults
  std::string backend = "auto";
  bool profile_layers = false;
  bool recompute = false;  // every block checkpointed (Module::set_recompute)
  dp::dist::LaunchOptions launch;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Mean token cross-entropy of `m` over the first val_batches batches of validation windows.
double val_loss(nn::Module& m, const std::vector<uint8_t>& val, const Flags& f) {
  nn::TokenCrossEntropyLoss loss_fn;
  const Device dev = m.device();
  m.eval();
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t b = 0; b < f.val_batches; ++b) {
    auto [x, y] = dp::data::text_windows(val, b * f.batch, f.batch, f.seq);
    if (x.numel() == 0) break;
    Tensor out = m.forward(x.to(dev));
    Tensor loss = Tensor::empty({1}, kernels::DType::f32, dev);
    Tensor none;
    loss_fn.compute(loss, none, out, y.to(dev));
    sum += static_cast<double>(loss.item()) * static_cast<double>(y.numel());
    tokens += y.numel();
  }
  m.train();
  return tokens > 0 ? sum / static_cast<double>(tokens) : NAN;
}

// `n` bytes continuing `prompt`: the argmax (top_k 1) or a draw from the k most likely bytes.
std::string sample_text(nn::Module& m, const std::string& prompt, int64_t n, int64_t top_k,
                        int64_t context, uint64_t seed) {
  const Device dev = m.device();
  m.eval();
  std::vector<int32_t> ids(prompt.begin(), prompt.end());
  for (int64_t s = 0; s < n; ++s) {
    const auto len = std::min<int64_t>(static_cast<int64_t>(ids.size()), context);
    std::vector<int32_t> window(ids.end() - len, ids.end());
    Tensor out = m.forward(Tensor::from_ints(window, {1, len}).to(dev));
    std::vector<float> logits = out.to_host_f32();
    const int64_t v = out.dim(2);
    std::vector<std::pair<float, int32_t>> last;
    for (int64_t c = 0; c < v; ++c) last.emplace_back(logits[(len - 1) * v + c], c);
    const auto k = std::min<int64_t>(std::max<int64_t>(top_k, 1), v);
    std::partial_sort(last.begin(), last.begin() + k, last.end(),
                      [](auto& a, auto& b) { return a.first > b.first; });
    double z = 0;
    for (int64_t i = 0; i < k; ++i) z += std::exp(last[i].first - last[0].first);
    double u = kernels::philox::uniform(seed, static_cast<uint64_t>(s)) * z;
    int64_t pick = 0;
    for (; pick + 1 < k; ++pick) {
      u -= std::exp(last[pick].first - last[0].first);
      if (u <= 0) break;
    }
    ids.push_back(last[pick].second);
  }
  m.train();
  std::string out;
  for (size_t i = prompt.size(); i < ids.size(); ++i) {
    const auto c = static_cast<unsigned char>(ids[i]);
    out += (c == '\n' || c == '\t' || (c >= 32 && c < 127)) ? static_cast<char>(c) : '?';
  }
  return out;
}

// The signal that asked a single or DP run to stop (0: none), set by on_stop_signal.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "set in a signal handler");

extern "C" void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
}

// SIGINT (Ctrl-C) and SIGTERM end the step in progress, not the run's process: the loop then
// saves --save at that step and exits 128 + the signal. SA_RESETHAND: a second signal ends the
// process at once, as before. Restored to the defaults when the object goes (before sampling).
// Not for DDP's ranks: they would stop at different steps, with their peers in collectives (the
// launcher stops the job, as train_mnist's).
class StopOnSignal {
 public:
  StopOnSignal() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESETHAND | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &sa, nullptr);
  }
  ~StopOnSignal() {
    for (int sig : {SIGINT, SIGTERM}) ::signal(sig, SIG_DFL);
  }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  int signal() const { return g_stop_signal.load(); }
};

// What a training state records of the text, checked again at a resume: each split's size and
// FNV-1a hash.
std::string corpus_identity(const dp::data::TextCorpus& c) {
  char text[128];
  std::snprintf(text, sizeof text,
                "%zu train bytes fnv1a64 %016llx, %zu validation bytes "
                "fnv1a64 %016llx",
                c.train.size(),
                static_cast<unsigned long long>(nn::detail::fnv1a(c.train.data(), c.train.size())),
                c.val.size(),
                static_cast<unsigned long long>(nn::detail::fnv1a(c.val.data(), c.val.size())));
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"train_text: a byte-level GPT or Llama on English text, single, DP or DDP"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.add_option("--model", f.model,
                 "gpt (GPT-2: LayerNorm, GELU, learned positions, tied head) or llama (RMSNorm, "
                 "SwiGLU, rotary attention, untied head; its tiny preset)")
      ->check(CLI::IsMember({"gpt", "llama"}));
  auto* gpt_config = app.add_option("--gpt-config", f.gpt_config, "GPT preset (--model gpt)")
                         ->check(CLI::IsMember({"tiny", "124m", "350m"}));
  app.add_option("--mode", f.mode, "single, dp or ddp")
      ->check(CLI::IsMember({"single", "dp", "ddp"}));
  app.add_option("--device", f.device, "auto, cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--gpus", f.gpus, "devices (dp) or ranks (ddp)")->check(CLI::Range(1, 64));
  app.add_option("--data", f.data, "a text file or a directory of them")->check(CLI::ExistingPath);
  app.add_option("--steps", f.steps, "optimizer steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--batch", f.batch, "sequences per global batch")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  dp::cli::add_micro_batches_flag(app, f.micro_batches, "single, dp and ddp");
  app.add_option("--seq", f.seq, "tokens per sequence (at most the model's context)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--lr", f.lr, "AdamW learning rate")->check(dp::cli::positive_number(10));
  app.add_option(
         "--weight-decay", f.weight_decay,
         "AdamW weight decay (parameters of 2 or more dimensions: matrices and embeddings, as "
         "nanoGPT; not biases or LayerNorm)")
      ->check(dp::cli::number_in(0, 1));
  app.add_option("--warmup", f.warmup, "linear warm-up steps before the cosine decay")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--dropout", f.dropout,
                 "dropout p on embeddings, attention probabilities and residuals (GPT-2: 0.1)")
      ->check(dp::cli::number_in(0, 0.99));
  app.add_option("--clip-grad", f.clip_grad, "clip the gradient to this global norm (0: off)")
      ->check(dp::cli::number_in(0, 1e6));
  app.add_option("--eval-every", f.eval_every, "steps between validation losses")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app.add_option("--val-batches", f.val_batches, "validation batches per evaluation")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--seed", f.seed, "seed of the weights and the batches");
  app.add_option("--log", f.log,
                 "write one JSON object per step here (step, loss, lr, grad_norm, tokens_per_s, "
                 "loss_scale; rank 0 in DDP)")
      ->check(dp::cli::output_file(dp::cli::Output::step_log));
  app.add_option("--save", f.save, "training state written at the end (safetensors)")
      ->check(dp::cli::replaceable_file());
  app.add_option("--save-every", f.save_every,
                 "also write --save every this many steps, so that a run stopped midway (Ctrl-C, "
                 "a killed job) goes on from there (0: at the end only)")
      ->check(dp::cli::whole_number(0, int64_t{1} << 40));
  app.add_option("--resume", f.resume, "training state to go on from")->check(CLI::ExistingFile);
  app.add_option("--sample-bytes", f.sample_bytes, "bytes generated at the end (0: none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 16));
  app.add_option("--top-k", f.top_k, "sample among the k most likely bytes (1: greedy)")
      ->check(CLI::Range(int64_t{1}, int64_t{256}));
  app.add_flag("--recompute", f.recompute,
               "activation checkpointing of every transformer block: each keeps its input alone "
               "and backward runs its forward again (less memory, one more forward a step, the "
               "same losses)");
  app.add_flag("--profile-layers", f.profile_layers,
               "time each layer's forward and backward (device 0 or rank 0; graphs off) and "
               "print the table at the end");
  app.add_option("--backend", f.backend, "ddp: auto, nccl or gloo")
      ->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--timeout", f.timeout_s,
                 "ddp: seconds the rendezvous and each collective may take (default: DP_TIMEOUT, "
                 "else 60 s to rendezvous and 300 s per collective)")
      ->check(dp::cli::timeout_seconds(604800));
  dp::cli::add_launch_flags(app, f.launch);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  if (f.model == "llama") {
    if (gpt_config->count() > 0) {
      std::fprintf(stderr, "train_text: --gpt-config applies to --model gpt, not llama\n");
      return 2;
    }
    if (f.dropout != 0.f) {
      std::fprintf(stderr, "train_text: --dropout %g: --model llama has no dropout\n",
                   static_cast<double>(f.dropout));
      return 2;
    }
  }

  try {
    // What no single flag can check, before any work (and before DDP's ranks start).
    if (f.mode != "single") {
      const int64_t world = f.mode == "ddp" ? int64_t{f.gpus} * f.launch.nnodes : f.gpus;
      const char* unit = f.mode == "ddp" ? " ranks" : " devices";
      DP_CHECK(f.batch >= world, "--batch " << f.batch << " leaves some of the " << world << unit
                                            << " without rows: give --batch >= " << world);
    }
    DP_CHECK(f.save_every == 0 || !f.save.empty(),
             "--save-every " << f.save_every << " needs --save: the file it writes");
    DP_CHECK(f.timeout_s == 0 || f.mode == "ddp",
             "--timeout bounds DDP's rendezvous and collectives: give --mode ddp, or drop it");
    DP_CHECK(f.mode == "ddp" ||
                 (f.launch.nnodes == 1 && f.launch.node_rank == 0 && f.launch.master_port == 0 &&
                  !f.launch.max_local_ranks && f.launch.max_restarts == 0),
             "--nnodes, --node-rank, --master-port, --max-local-ranks and --max-restarts set how "
             "DDP's processes start, and --mode "
                 << f.mode << " starts none: give --mode ddp, or drop them");
    // --save may be the file resumed from (it is replaced at the end); --log may be neither.
    dp::cli::check_distinct_files({{"--log", f.log}, {"--save", f.save}});
    dp::cli::check_distinct_files({{"--log", f.log}, {"--resume", f.resume}});
    // The model: its name in reports and checkpoints, its context and vocabulary.
    std::string model_name;
    int64_t context = 0, vocab = 0;
    std::function<nn::ModulePtr()> make_model;
    if (f.model == "llama") {
      nn::LlamaConfig config = nn::LlamaConfig::preset("tiny");
      config.recompute = f.recompute;
      make_model = [config] { return nn::llama(config); };
      model_name = "llama-tiny";
      context = config.context, vocab = config.vocab;
    } else {
      nn::GptConfig config = nn::GptConfig::preset(f.gpt_config);
      config.dropout = f.dropout;
      config.recompute = f.recompute;
      make_model = [config] { return nn::gpt(config); };
      model_name = "gpt-" + f.gpt_config;
      context = config.context, vocab = config.vocab;
    }
    DP_CHECK(f.seq <= context,
             "--seq " << f.seq << " is longer than " << model_name << "'s context " << context);
    DP_CHECK(vocab >= 256, model_name << ": bytes need 256 tokens");
    // What a resume must match: a file of another program, model, batch or sequence length is
    // refused from its header, before the model is built or DDP's ranks start.
    // The seed too: it draws the batches, so another one resumes onto another stream.
    const std::map<std::string, std::string> settings = {{"program", "train_text"},
                                                         {"model", model_name},
                                                         {"batch", std::to_string(f.batch)},
                                                         {"seq", std::to_string(f.seq)},
                                                         {"seed", std::to_string(f.seed)}};
    if (!f.resume.empty()) nn::check_training_state_settings(f.resume, settings);
    // A save replaces only a state of this program and model (the one resumed from included):
    // another's is a run of its own, which a mistyped path would wipe.
    if (!f.save.empty()) {
      const std::string problem = dp::cli::state_owner_problem(f.save, "train_text", model_name);
      DP_CHECK(problem.empty(), "--save: " << problem);
    }
    // Read before DDP's ranks start too: a file that is not text, or too short, is said once,
    // by the launcher, not by every rank.
    dp::data::TextCorpus corpus = dp::data::read_text_corpus(f.data);
    if (f.mode == "ddp") {
      // The launcher's copy goes before the ranks start (it held the text while they ran): each
      // rank reads its own.
      if (!dp::dist::worker_env_from_environment()) corpus = dp::data::TextCorpus{};
      dp::dist::DdpTrainerOptions t;
      t.backend = f.backend;
      t.device = f.device;
      t.launch = f.launch;
      t.launch.nproc_per_node = f.gpus;
      if (std::optional<int> rc = dp::dist::launch_if_parent(t, argc, argv)) return *rc;
    }
    nn::ModulePtr model = make_model();
    // What the directory held that was not read, said once (entries that are not regular files,
    // links to none).
    if (!corpus.skipped.empty() && dp::cli::first_rank_or_alone()) {  // DDP: rank 0 says it
      std::string list;
      for (const std::string& s : corpus.skipped) list += (list.empty() ? "" : ", ") + s;
      std::fprintf(stderr, "train_text: not read: %s\n", list.c_str());
    }
    // The validation text may hold fewer batches than asked: each evaluation reads them all.
    const int64_t val_windows = dp::data::text_window_count(corpus.val, f.seq);
    const int64_t val_held = (val_windows + f.batch - 1) / f.batch;
    if (val_held < f.val_batches && dp::cli::first_rank_or_alone())
      std::fprintf(stderr,
                   "train_text: --val-batches %lld: the validation text holds %lld batch(es) of "
                   "--batch %lld x --seq %lld; each evaluation reads all of them\n",
                   static_cast<long long>(f.val_batches), static_cast<long long>(val_held),
                   static_cast<long long>(f.batch), static_cast<long long>(f.seq));
    std::string fallback;
    const kernels::DeviceType type = kernels::choose_device_type(f.device, &fallback);
    if (!fallback.empty()) std::fprintf(stderr, "train_text: %s\n", fallback.c_str());
    dp::cli::warn_if_generic_gemm("train_text", type);
    kernels::AdamWConfig adamw;
    adamw.lr = f.lr;
    adamw.weight_decay = f.weight_decay;
    adamw.beta2 = 0.95f;
    auto loss_fn = std::make_shared<nn::TokenCrossEntropyLoss>();
    // A step that does not fit is refused before training, with the figures measured on a probe
    // step of 1 and 2 sequences. CPU devices hold their activations in the host's memory, where a
    // run past it meets the OOM killer; CUDA devices are measured on GPU 0 where this process
    // holds them (not under DDP, whose ranks are other processes).
    if (type == kernels::DeviceType::cpu || f.mode == "single" || f.mode == "dp") {
      const int devices = f.mode == "single" ? 1 : f.gpus;
      const int64_t chunk = (f.batch + devices - 1) / devices;
      dp::cli::check_run_fits(  // activations of one micro-batch at a time
          "train_text", "--batch " + std::to_string(f.batch) + " --seq " + std::to_string(f.seq),
          f.mode, type, devices, chunk, f.micro_batches, [&](Device device, int64_t rows) {
            nn::ModulePtr m = make_model();
            m->materialize(device, f.seed);
            nn::GroupedAdamW o(*m, adamw, nn::decay_by_parameter(*m, f.weight_decay));
            dp::DataParallelOptions po;
            po.loss = loss_fn;
            po.graphs = dp::Graphs::off;  // one eager step: what the run's first step allocates
            dp::DataParallel e(m, o, {device}, po);
            auto [x, y] = dp::data::text_batch(corpus.train, rows, f.seq, f.seed, 0);
            e.train_step(x, y);
            return e.peak_memory_bytes()[0] + o.state_bytes();
          });
    }

    std::unique_ptr<dp::dist::DdpTrainer> ddp;
    Device home = Device::cpu(0);
    if (f.mode == "ddp") {
      ddp = std::make_unique<dp::dist::DdpTrainer>(
          type, f.backend, dp::dist::DdpOptions{},
          std::chrono::milliseconds(std::llround(f.timeout_s * 1000)));
      home = ddp->device();
    } else {
      home = kernels::make_devices(type, 1)[0];
    }
    const bool leader = !ddp || ddp->rank() == 0;
    auto building = std::make_unique<dp::cli::SlowNotice>(
        "train_text: building the " + model_name + " model and its engine",
        leader ? stderr : nullptr);
    model->materialize(home, f.seed);
    // Weight decay by parameter, nanoGPT's rule: matrices and embeddings decay, biases and
    // LayerNorm do not.
    nn::GroupedAdamW opt(*model, adamw, nn::decay_by_parameter(*model, f.weight_decay));
    // A save that does not fit is found now, not after the run: the weights, the buffers and
    // the optimizer state, f32, and the header (well under a MiB).
    if (!f.save.empty() && leader)
      dp::cli::check_free_space(
          "--save", f.save,
          static_cast<uint64_t>(model->flat_params().nbytes() + model->flat_buffers().nbytes() +
                                opt.state_bytes()) +
              (uint64_t{1} << 20));
    const nn::LinearWarmup schedule(
        nn::CosineLR(f.lr, std::max<int64_t>(f.steps - f.warmup, 1), f.lr / 10), f.warmup);

    nn::TrainingProgress progress;
    // A single run trains through DataParallel on one device, and its checkpoints say "dp":
    // resuming one is no change of mode (resume_note).
    progress.mode = f.mode == "single" ? "dp" : f.mode;
    progress.world_size = ddp ? ddp->world_size() : (f.mode == "dp" ? f.gpus : 1);
    progress.config = settings;
    // The text itself: a resume on another corpus (or another --data) trains on other windows.
    progress.config["corpus"] = corpus_identity(corpus);
    std::unique_ptr<dp::DataParallel> engine;
    if (ddp) {
      ddp->set_loss(loss_fn);
      ddp->set_clip_grad_norm(f.clip_grad);
      ddp->set_micro_batches(f.micro_batches);
      // What every rank must agree on, keyed by the flags as typed (wrap() verifies it before
      // the weights are broadcast): ranks with another --batch or --data would train apart.
      ddp->set_run_config(
          {{"program", "train_text"},
           {"--model", model_name},
           {"--batch", std::to_string(f.batch)},
           {"--seq", std::to_string(f.seq)},
           {"--steps", std::to_string(f.steps)},
           {"--warmup", std::to_string(f.warmup)},
           {"--lr", dp::dist::config_number(f.lr)},
           {"--weight-decay", dp::dist::config_number(f.weight_decay)},
           {"--clip-grad", dp::dist::config_number(f.clip_grad)},
           {"--dropout", dp::dist::config_number(f.dropout)},
           {"--seed", std::to_string(f.seed)},
           {"--data", f.data},
           {"--resume", f.resume},
           {"--save", f.save.empty() ? "none" : "given"},  // a collective (every rank's state)
           {"--save-every", std::to_string(f.save_every)},
           {"corpus_bytes", std::to_string(corpus.train.size()) + " train, " +
                                std::to_string(corpus.val.size()) + " validation"}});
      if (f.profile_layers) ddp->set_graphs(dp::Graphs::off);  // a replay calls no forward
      ddp->wrap(model, opt);
    } else {
      dp::DataParallelOptions o;
      o.loss = loss_fn;
      o.clip_grad_norm = f.clip_grad;
      o.micro_batches = f.micro_batches;
      if (f.profile_layers) o.graphs = dp::Graphs::off;
      engine = std::make_unique<dp::DataParallel>(
          model, opt, kernels::make_devices(type, f.mode == "dp" ? f.gpus : 1), o);
    }
    building.reset();
    nn::Module& trained = ddp ? ddp->ddp().module() : engine->module();
    std::optional<nn::LayerProfiler> profiler;
    if (f.profile_layers) profiler.emplace(trained);
    // Through the engine: each device's or rank's dropout offset restored, and DDP's ranks
    // checked to have loaded the same state.
    int64_t first_step = 0;
    std::optional<std::string> nothing_left;  // resumed at or past --steps
    if (!f.resume.empty()) {
      const nn::TrainingProgress got =
          ddp ? ddp->load(f.resume, progress) : engine->load(f.resume, progress);
      first_step = got.step;
      nothing_left = nn::nothing_left_to_train(first_step, f.steps, f.resume,
                                               "give more --steps to train further");
      if (leader) {
        std::printf("resumed %s at step %lld\n", f.resume.c_str(),
                    static_cast<long long>(first_step));
        // Another mode or world size than the saving run's: what changes, and that the
        // continuation is not bit-exact (as train_mnist and dp_bench say it).
        if (const std::string note = nn::resume_note(got, progress); !note.empty())
          std::printf("train_text: %s\n", note.c_str());
        if (nothing_left) std::printf("train_text: %s\n", nothing_left->c_str());
      }
    }
    if (leader)
      std::printf(
          "train_text: %s, %lld parameters, %s on %d device(s), %zu train / %zu "
          "validation bytes from %zu file(s)\n",
          model_name.c_str(), static_cast<long long>(trained.num_parameters()), f.mode.c_str(),
          progress.world_size, corpus.train.size(), corpus.val.size(), corpus.files.size());

    std::optional<dp::cli::StepLog> step_log;
    if (!f.log.empty() && leader) step_log.emplace("--log", f.log, "tokens_per_s");
    // One redrawn line on a terminal (plain lines every 10 s otherwise), between the
    // evaluations' lines; its clock starts now, so a first step slower than 10 s is reported.
    std::unique_ptr<dp::cli::ProgressLine> bar;
    if (leader && first_step < f.steps) {
      bar = std::make_unique<dp::cli::ProgressLine>("train", f.steps - first_step);
      bar->start();
    }
    // --save's state at `step` (DDP: a collective: every rank's dropout offset; rank 0 writes).
    auto save_at = [&](int64_t step) {
      progress.step = step;
      if (ddp)
        ddp->save(f.save, progress);
      else
        engine->save(f.save, progress);
    };
    std::optional<StopOnSignal> stop;
    if (!ddp) stop.emplace();
    int64_t done = first_step;  // steps the weights are at
    auto t_run = std::chrono::steady_clock::now();
    double train_time = 0, val = NAN;
    int64_t tokens = 0;
    float last_loss = NAN, grad_norm = 0;
    for (int64_t step = first_step; step < f.steps; ++step) {
      if (stop && stop->signal() != 0) break;  // between steps: the weights are at `done`
      auto [x, y] = dp::data::text_batch(corpus.train, f.batch, f.seq, f.seed, step);
      opt.set_lr(schedule.lr(step));  // stateless in the step: a resumed run takes the same
      auto t0 = std::chrono::steady_clock::now();
      if (ddp) {
        last_loss = ddp->train_step(x, y);
        grad_norm = ddp->last_grad_norm();
      } else {
        dp::StepStats st = engine->train_step(x, y);
        last_loss = st.loss;
        grad_norm = st.grad_norm;
      }
      done = step + 1;
      const double dt = seconds_since(t0);
      train_time += dt;
      tokens += y.numel();
      if (step_log)
        step_log->write({step + 1, last_loss, opt.lr(),
                         f.clip_grad > 0.f ? std::optional<double>(grad_norm) : std::nullopt,
                         static_cast<double>(y.numel()) / std::max(dt, 1e-9), 1.0});
      if (bar) {
        char detail[48];
        std::snprintf(detail, sizeof detail, "loss %.4f", last_loss);
        bar->update(step + 1 - first_step, detail);
      }
      if (f.save_every > 0 && (step + 1) % f.save_every == 0 && step + 1 < f.steps) {
        save_at(step + 1);  // the last step's save is the one at the end
        if (bar) bar->finish();
        if (leader) {
          std::printf("saved %s at step %lld\n", f.save.c_str(), static_cast<long long>(step + 1));
          std::fflush(stdout);
        }
      }
      if ((step + 1) % f.eval_every == 0 || step + 1 == f.steps) {
        if (bar) bar->finish();
        val = val_loss(trained, corpus.val, f);
        if (leader)
          std::printf(
              "step %lld train loss %.4f val loss %.4f grad norm %.3f lr %.2e %.0f "
              "tokens/s\n",
              static_cast<long long>(step + 1), last_loss, val, grad_norm, opt.lr(),
              static_cast<double>(tokens) / std::max(train_time, 1e-9));
        std::fflush(stdout);
      }
    }
    if (bar) bar->finish();
    if (step_log) step_log->close();  // a log that did not reach the disk is an error
    if (const int sig = stop ? stop->signal() : 0; sig != 0 && done < f.steps) {
      // Stopped between steps: the state at `done` is saved where --save asks, and said.
      if (!f.save.empty() && done > first_step) save_at(done);
      const std::string what = !f.save.empty() && done > first_step
                                   ? "saved " + f.save + " (--resume " + f.save + " goes on)"
                               : !f.save.empty() ? "nothing trained, nothing saved"
                                                 : "nothing saved (--save FILE keeps a run)";
      std::fprintf(stderr, "train_text: %s after step %lld of %lld: %s\n",
                   sig == SIGINT ? "interrupted (SIGINT)" : "stopped (SIGTERM)",
                   static_cast<long long>(done), static_cast<long long>(f.steps), what.c_str());
      return 128 + sig;
    }
    stop.reset();  // a signal from here on ends the process at once
    if (std::isnan(val)) val = val_loss(trained, corpus.val, f);
    // The step the weights are at: --steps, or the checkpoint's when it was already past.
    const int64_t at_step = std::max(first_step, f.steps);
    if (leader)
      std::printf("final val loss %.4f after %lld steps, %.1f s\n", val,
                  static_cast<long long>(at_step), seconds_since(t_run));
    if (!f.save.empty() && nothing_left) {
      // Nothing trained: the checkpoint given to --resume is this state, with its own label.
      if (leader)
        std::printf("--save %s: not written: nothing was trained; %s holds this state\n",
                    f.save.c_str(), f.resume.c_str());
    } else if (!f.save.empty()) {
      save_at(at_step);
      if (leader) std::printf("saved %s\n", f.save.c_str());
    }
    if (profiler && leader) std::printf("%s", profiler->table().c_str());
    std::fflush(stdout);  // what the run printed is kept if the sampling is cut short
    if (f.sample_bytes > 0 && leader) {
      std::string sample;
      {
        // One forward a byte over the whole context: minutes for the largest --sample-bytes.
        dp::cli::SlowNotice sampling(
            "train_text: sampling " + std::to_string(f.sample_bytes) + " bytes", stderr);
        sample = sample_text(trained, "The ", f.sample_bytes, f.top_k, context, f.seed);
      }
      std::printf("sample (%s): %s\n", f.top_k == 1 ? "greedy" : "top-k", sample.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_text: %s\n", e.what());
    return 1;
  }
}
