// train_mnist: trains a model on Fashion-MNIST (Debian's dataset-fashion-mnist), on one
// device, or through DP (threads) or DDP (processes) on N devices, and reports test accuracy.
//
//   bin/train_mnist --model mlp --epochs 1
//   bin/train_mnist --model cnn --epochs 3 --mode dp --gpus 2
//   bin/train_mnist --model mlp --mode ddp --gpus 2 --json out.json
//   bin/train_mnist --model mlp --mode ps --gpus 4 --max-staleness 2
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "dp/cli/cli.hpp"
#include "dp/cli/progress.hpp"
#include "dp/data/loader.hpp"
#include "dp/data/mnist.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/cross_node_group.hpp"
#include "dp/distributed/ddp_trainer.hpp"
#include "dp/parameter_server.hpp"
#include "nn/nn.hpp"
#include "nn/train_state.hpp"

using kernels::Device;
using kernels::Tensor;

namespace {

struct Flags {
  std::string model = "mlp", device = "auto", mode = "single", data, json;
  std::string log;  // --log FILE.jsonl: one JSON object per step
  int epochs = 1, gpus = 1;
  std::optional<int64_t> limit_batches;  // unset: whole epochs
  std::optional<int64_t> train_samples;  // unset: the whole training set
  int64_t batch = 32;
  std::optional<float> lr;  // unset: the optimizer's default
  uint64_t seed = 1;
  std::string backend = "auto";
  std::string optim;  // unset: sgd for the MLP, adamw for the convolutional models
  std::string last_batch = "pad";
  int micro_batches = 1;   // dp/ddp/hybrid: gradient accumulation per device or rank and step
  int max_staleness = -1;  // ps: -1 unbounded
  int hybrid_procs = 0;    // hybrid: node processes started here (0: automatic)
  bool staleness_lr = false;
  bool sync_bn = false;
  std::string dtype = "fp32";               // nn/amp.hpp: fp32|tf32|bf16|fp16
  std::optional<double> max_skip_fraction;  // fp16/bf16: fail above this share of skipped steps
  std::string comm_dtype = "fp32";          // dp/ddp: fp32|bf16 gradient communication
  std::string activations = "f32";          // f32|bf16: activations between layers
  // Training state: saved every save_every steps (and at the end) into checkpoint_dir, keeping
  // the newest `keep`; resumed from a file or "latest".
  std::string checkpoint_dir, resume;
  std::optional<int64_t> save_every;
  int keep = 3;
  dp::dist::LaunchOptions launch;  // ddp (dp::cli::add_launch_flags); nproc_per_node: --gpus
  double timeout_s = 0;            // ddp rendezvous and collectives; 0: DP_TIMEOUT or the defaults
};

using dp::cli::kMaxDevices;

nn::ModulePtr make_model(const std::string& name) {
  if (name == "mlp") return nn::mlp({784, 256, 10});
  if (name == "cnn") return nn::lenet(1, 10);
  return nn::resnet(8, 1, 10);
}

std::string default_optim(const std::string& model) {
  return model == "mlp" ? "sgd" : "adamw";
}
// SGD with momentum 0.9, or AdamW.
float default_lr(const std::string& optim) {
  return optim == "sgd" ? 0.01f : 1e-3f;
}

kernels::DeviceType device_type(const std::string& flag) {
  std::string fallback;
  kernels::DeviceType t = kernels::choose_device_type(flag, &fallback);
  if (!fallback.empty()) std::fprintf(stderr, "train_mnist: %s\n", fallback.c_str());
  dp::cli::warn_if_generic_gemm("train_mnist", t);
  return t;
}

// An epoch's progress (dp/cli/progress.hpp): one redrawn line with rate and ETA on a terminal,
// plain lines every 10 s and a summary at the epoch's end otherwise. `line` is the epoch's,
// made at its first step.
void progress(std::unique_ptr<dp::cli::ProgressLine>& line, int epoch, int64_t done, int64_t total,
              float loss, double samples_per_s) {
  if (!line)
    line = std::make_unique<dp::cli::ProgressLine>("epoch " + std::to_string(epoch), total);
  char detail[96];
  std::snprintf(detail, sizeof detail, "loss %.4f  %.0f samples/s", loss, samples_per_s);
  line->update(done, detail);
  if (done == total && !line->redrawn())  // a log keeps one summary line per epoch
    std::fprintf(stderr, "epoch %d: %lld/%lld batches, loss %.4f, %.0f samples/s\n", epoch,
                 static_cast<long long>(done), static_cast<long long>(total), loss, samples_per_s);
}

// One training step and one evaluation over a host batch, whatever the mode.
struct Engine {
  std::function<float(const Tensor&, const Tensor&)> train_step;  // returns the batch loss
  std::function<int64_t(const Tensor&, const Tensor&)> count_correct;
};

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  using dp::cli::whole_number;
  CLI::App app{"train_mnist: Fashion-MNIST on one device, DP or DDP"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.add_option("--model", f.model, "mlp|cnn|resnet")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet"}));
  app.add_option("--epochs", f.epochs)->check(whole_number(1, 100000));
  app.add_option("--batch", f.batch, "global batch")->check(whole_number(1, dp::cli::kMaxRows));
  app.add_option("--lr", f.lr, "learning rate (default 0.01 for sgd, 1e-3 for adamw)")
      ->check(dp::cli::positive_number(100));
  app.add_option("--optim", f.optim, "sgd (momentum 0.9) | adamw; default sgd for mlp, adamw else")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--device", f.device, "auto|cpu|cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--seed", f.seed)->check(whole_number(0, std::numeric_limits<int64_t>::max()));
  app.add_option("--data", f.data, "directory of the IDX files")
      ->default_str(dp::data::kDefaultFashionMnistDir)
      ->check(CLI::ExistingDirectory);
  app.add_option("--json", f.json, "write {test_accuracy, train_loss[], seconds} here")
      ->check(dp::cli::output_file(dp::cli::Output::report, dp::cli::OutputDir::or_checkpoint_dir));
  app.add_option("--mode", f.mode,
                 "single|dp|ddp|hybrid (DP in each node, nodes joined like DDP)|ps (asynchronous "
                 "parameter server)")
      ->check(CLI::IsMember({"single", "dp", "ddp", "hybrid", "ps"}));
  dp::cli::add_hybrid_procs_flag(app, f.hybrid_procs);
  dp::cli::add_micro_batches_flag(app, f.micro_batches, "dp, ddp and hybrid");
  app.add_option("--max-staleness", f.max_staleness,
                 "ps: a worker waits while this many newer updates are outstanding (-1: unbounded)")
      ->check(whole_number(-1, 1 << 20));
  app.add_flag("--staleness-lr", f.staleness_lr, "ps: each update's lr / (1 + staleness)");
  app.add_flag("--sync-bn", f.sync_bn,
               "dp/ddp: BatchNorm normalises with the whole batch's statistics (default: each "
               "device or rank its own chunk, as PyTorch)");
  dp::cli::add_precision_flags(app, f.dtype, f.comm_dtype);
  dp::cli::add_activations_flag(app, f.activations);
  dp::cli::add_max_skip_fraction_flag(app, f.max_skip_fraction);
  app.add_option("--gpus", f.gpus, "devices for dp/ddp/ps")->check(whole_number(1, kMaxDevices));
  app.add_option("--last-batch", f.last_batch,
                 "an epoch's partial last batch: trained, padded by wrapping round to the "
                 "epoch's start when too short for every device or rank to get a row (pad); or "
                 "dropped whatever its size, as PyTorch's drop_last (drop)")
      ->check(CLI::IsMember({"pad", "drop"}));
  app.add_option("--backend", f.backend, "ddp: auto|nccl|gloo|mpi (mpi: under mpirun)")
      ->check(CLI::IsMember({"auto", "nccl", "gloo", "mpi"}));
  dp::cli::add_launch_flags(app, f.launch);
  app.add_option("--timeout", f.timeout_s,
                 "ddp: seconds the rendezvous and each collective may take (default: DP_TIMEOUT, "
                 "else 60 s to rendezvous and 300 s per collective)")
      ->check(dp::cli::timeout_seconds(604800));
  CLI::Option* checkpoint_dir = dp::cli::add_checkpoint_dir_flag(
      app, f.checkpoint_dir,
      "write the whole training state here (step_N.safetensors; rank 0 or the parameter server "
      "writes), every --save-every steps and at the end; created when missing, one job at a "
      "time");
  app.add_option("--save-every", f.save_every, "steps between checkpoints (needs --checkpoint-dir)")
      ->check(whole_number(1, std::numeric_limits<int32_t>::max()));
  app.add_option("--keep", f.keep, "checkpoints to keep in --checkpoint-dir, newest first")
      ->check(whole_number(1, 1000))
      ->needs(checkpoint_dir);
  app.add_option("--resume", f.resume,
                 "resume from a training state file, or the newest whole one in --checkpoint-dir "
                 "(latest: damaged ones are skipped, named); the same model, optimizer, --batch "
                 "and seed are required, another --mode or --gpus is re-sharded (said so)");
  app.add_option("--log", f.log,
                 "write one JSON object per step here (step, loss, lr, grad_norm, samples_per_s, "
                 "loss_scale; rank 0 in DDP; not with --mode ps)")
      ->check(
          dp::cli::output_file(dp::cli::Output::step_log, dp::cli::OutputDir::or_checkpoint_dir));
  app.add_option("--limit-batches", f.limit_batches,
                 "stop each epoch after this many batches (smoke runs)")
      ->check(whole_number(1, std::numeric_limits<int64_t>::max()));
  app.add_option("--train-samples", f.train_samples,
                 "train on the first N samples of the training set only (smoke runs)")
      ->check(whole_number(1, dp::cli::kMaxRows));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  try {
    // What no single flag can check, before any work.
    DP_CHECK(!f.save_every || !f.checkpoint_dir.empty(),
             "--save-every needs --checkpoint-dir (where to write)");
    DP_CHECK(f.resume != "latest" || !f.checkpoint_dir.empty(),
             "--resume latest needs --checkpoint-dir (where to look)");
    // No output is the file resumed from, the other output or a checkpoint's name.
    const std::vector<dp::cli::FlagPath> outputs = {{"--json", f.json}, {"--log", f.log}};
    dp::cli::check_distinct_files(
        {outputs[0], outputs[1], {"--resume", f.resume == "latest" ? "" : f.resume}});
    dp::cli::check_outside_checkpoints(outputs, f.checkpoint_dir);
    // What a resume must match, of what the flags give (the data set's sizes are added once it
    // is read): a file of another program, model, batch, seed or dtype is refused from its
    // header, before the data set is read or DDP's ranks start.
    const std::map<std::string, std::string> settings = {{"program", "train_mnist"},
                                                         {"model", f.model},
                                                         {"batch", std::to_string(f.batch)},
                                                         {"seed", std::to_string(f.seed)},
                                                         {"dtype", f.dtype}};
    if (!f.resume.empty() && f.resume != "latest")
      nn::check_training_state_settings(f.resume, settings);
    const nn::Precision precision = nn::parse_precision(f.dtype);
    const kernels::DType comm_dtype = dp::cli::comm_dtype(f.comm_dtype);
    const kernels::DType activations = dp::cli::activations_dtype(f.activations, f.dtype);
    DP_CHECK(f.mode != "ps" || nn::compute_dtype(precision) == kernels::DType::f32,
             "--mode ps with --dtype " << f.dtype << ": the parameter server trains in f32 only");
    const bool hybrid = f.mode == "hybrid";
    DP_CHECK(f.backend == "auto" || f.mode == "ddp" || hybrid,
             "--backend " << f.backend << " with --mode " << f.mode
                          << ": only --mode ddp and hybrid have a communication backend; drop "
                             "--backend");
    DP_CHECK(comm_dtype == kernels::DType::f32 || f.mode == "dp" || f.mode == "ddp" || hybrid,
             "--comm-dtype " << f.comm_dtype
                             << ": only --mode dp, ddp and hybrid communicate gradients");
    DP_CHECK(f.hybrid_procs == 0 || hybrid, "--hybrid-procs "
                                                << f.hybrid_procs << " with --mode " << f.mode
                                                << ": only --mode hybrid starts node processes");
    DP_CHECK(!hybrid || (f.checkpoint_dir.empty() && f.resume.empty() && !f.sync_bn),
             "--mode hybrid trains without --checkpoint-dir, --resume and --sync-bn (not "
             "supported across nodes yet)");
    // Flags that would do nothing with the others given.
    DP_CHECK(f.micro_batches == 1 || f.mode == "dp" || f.mode == "ddp" || hybrid,
             "--micro-batches " << f.micro_batches << " with --mode " << f.mode
                                << ": only --mode dp, ddp and hybrid accumulate gradients (one "
                                   "device: --mode dp --gpus 1)");
    DP_CHECK(f.micro_batches == 1 || !f.sync_bn,
             "--micro-batches " << f.micro_batches
                                << " with --sync-bn: SyncBatchNorm exchanges statistics at each "
                                   "forward; give one of them");
    DP_CHECK(!f.sync_bn || ((f.mode == "dp" || f.mode == "ddp") && f.model == "resnet"),
             "--sync-bn with --mode " << f.mode << " --model " << f.model
                                      << ": it syncs BatchNorm across devices or ranks, and only "
                                         "--model resnet has BatchNorm; give --model resnet with "
                                         "--mode dp or ddp");
    DP_CHECK(
        (f.max_staleness == -1 && !f.staleness_lr) || f.mode == "ps",
        (f.staleness_lr ? "--staleness-lr" : "--max-staleness " + std::to_string(f.max_staleness))
            << " with --mode " << f.mode
            << ": it sets the parameter server's workers; give --mode ps");
    const int node_procs = hybrid ? dp::cli::hybrid_procs(f.hybrid_procs, f.launch.nnodes) : 1;
    // Rows every global batch is split into (a parameter server's workers each take whole
    // batches).
    const int split =
        f.mode == "single" || f.mode == "ps" ? 1 : f.gpus * f.launch.nnodes * node_procs;
    DP_CHECK(f.mode == "ddp" || hybrid || f.launch.nnodes == 1,
             "--nnodes " << f.launch.nnodes << ": only --mode ddp and hybrid span nodes");
    DP_CHECK(f.mode == "ddp" || f.launch.max_restarts == 0,
             "--max-restarts " << f.launch.max_restarts
                               << ": only --mode ddp has worker processes to "
                               << "restart");
    dp::dist::check_restarts_allowed(f.launch.max_restarts, f.launch.nnodes, f.launch.master_port);
    DP_CHECK(!f.launch.max_local_ranks || f.mode == "ddp" || hybrid,
             "--max-local-ranks " << *f.launch.max_local_ranks << " with --mode " << f.mode
                                  << ": it bounds the processes a launcher starts on this node; "
                                     "give --mode ddp or hybrid");
    dp::cli::check_max_skip_fraction(f.max_skip_fraction, f.dtype);
    DP_CHECK(f.launch.node_rank < f.launch.nnodes, "--node-rank " << f.launch.node_rank
                                                                  << " is not in [0, --nnodes "
                                                                  << f.launch.nnodes << ")");
    DP_CHECK(f.batch >= split, "--batch " << f.batch << " leaves some of the " << split
                                          << (f.mode == "ddp" ? " ranks" : " devices")
                                          << " without rows: give --batch >= " << split);
    if (f.optim.empty()) f.optim = default_optim(f.model);
    const float lr = f.lr ? *f.lr : default_lr(f.optim);
    std::string dir = f.data.empty() ? dp::data::kDefaultFashionMnistDir : f.data;
    // The checkpoint folder is this job's alone, from before any work to the end: created when
    // missing, proven writable and locked (nn::CheckpointDirLock) here by a single, DP or PS
    // run, or by the DDP launcher of node 0 for all its ranks and restarts; ranks started by
    // another launcher take it as rank 0, below.
    std::optional<nn::CheckpointDirLock> checkpoint_lock;
    const bool ddp_worker = f.mode == "ddp" && dp::dist::worker_env_from_environment().has_value();
    if (!f.checkpoint_dir.empty() && !ddp_worker && f.launch.node_rank == 0)
      checkpoint_lock.emplace(f.checkpoint_dir, "train_mnist");
    if (f.mode == "ddp" || hybrid) {
      // Read before DDP's ranks start too: a missing or damaged file is said once, by the
      // launcher, not by every rank of every restart. The launcher's copy goes before they start
      // (55 MB it held while they ran): each rank reads its own below.
      if (!dp::dist::worker_env_from_environment()) {
        (void)dp::data::MnistDataset(dir, dp::data::Split::train);
        (void)dp::data::MnistDataset(dir, dp::data::Split::test);
      }
      dp::dist::DdpTrainerOptions t;
      t.backend = f.backend;
      t.device = f.device;
      t.launch = f.launch;
      t.launch.nproc_per_node = hybrid ? node_procs : f.gpus;
      // The ranks re-run this program; each trains its shard of every global batch.
      std::optional<int> rc = dp::dist::launch_if_parent(t, argc, argv);
      if (rc) return *rc;
    }
    dp::data::MnistDataset train(dir, dp::data::Split::train);
    dp::data::MnistDataset test(dir, dp::data::Split::test);
    // The models take 1x28x28 images (the MLP 784 inputs, LeNet's layers are sized for it).
    const kernels::Shape image_shape = {1, 28, 28};
    DP_CHECK(train.sample_shape() == test.sample_shape(),
             "--data " << dir << ": the training images are "
                       << kernels::shape_str(train.sample_shape()) << " but the test images "
                       << kernels::shape_str(test.sample_shape()) << "; both must be the same");
    DP_CHECK(train.sample_shape() == image_shape,
             "--data " << dir << ": the images are " << kernels::shape_str(train.sample_shape())
                       << ", but --model " << f.model << " takes "
                       << kernels::shape_str(image_shape) << " (MNIST's 28x28 grey images)");
    kernels::DeviceType type = device_type(f.device);
    auto devices = kernels::make_devices(type, f.mode == "single" ? 1 : f.gpus);
    // A step that does not fit is refused before training, with the figures: a step of 1 and of
    // 2 rows on the run's model, precision and optimizer measures what a row costs. CPU devices
    // hold their activations in the host's memory, where a run past it meets the OOM killer;
    // CUDA devices are measured on GPU 0 where this process holds them (not under DDP, whose
    // ranks are other processes).
    if (type == kernels::DeviceType::cpu || f.mode == "single" || f.mode == "dp") {
      const int holders = f.mode == "single" ? 1 : f.gpus;
      dp::cli::check_run_fits(
          "train_mnist", "--batch " + std::to_string(f.batch), f.mode, type, holders,
          (f.batch + holders - 1) / holders, f.micro_batches, [&](Device device, int64_t rows) {
            nn::ModulePtr m = make_model(f.model);
            m->materialize(device, f.seed);
            std::unique_ptr<nn::Optimizer> o;
            if (f.optim == "adamw")
              o = std::make_unique<nn::AdamW>(*m, kernels::AdamWConfig{});
            else
              o = std::make_unique<nn::SGD>(*m, kernels::SgdConfig{});
            if (activations != kernels::DType::f32) m->set_activations(nn::Activations::compute);
            dp::DataParallelOptions po;  // the run's precision: 16-bit copies and activations
            po.precision = precision;
            po.graphs = dp::Graphs::off;  // one eager step: what the run's first step allocates
            dp::DataParallel e(m, *o, {device}, po);
            const dp::data::Batch b = dp::data::make_batch(train, 0, rows);
            e.train_step(b.images, b.labels);
            return e.peak_memory_bytes()[0] + o->state_bytes();
          });
    }

    auto model = make_model(f.model);
    std::unique_ptr<dp::dist::DdpTrainer> ddp;
    Device home = devices[0];
    if (f.mode == "ddp") {
      dp::dist::DdpOptions ddp_options;
      ddp_options.comm_dtype = comm_dtype;
      ddp = std::make_unique<dp::dist::DdpTrainer>(
          type, f.backend, ddp_options,
          std::chrono::milliseconds(std::llround(f.timeout_s * 1000)));
      home = ddp->device();
      ddp->set_sync_batch_norm(f.sync_bn);
      ddp->set_precision(precision);
      kernels::context(home).set_math(nn::math_mode(precision));
      // A restarted job goes on from its newest checkpoint with --resume latest; without it,
      // it trains again from the start.
      if (ddp->rank() == 0 && !f.checkpoint_dir.empty() && !checkpoint_lock)
        checkpoint_lock.emplace(f.checkpoint_dir, "train_mnist");  // held by our launcher, or ours
      if (ddp->rank() == 0 && ddp->env().restart_count > 0)
        std::fprintf(
            stderr, "train_mnist: restart %d: %s\n", ddp->env().restart_count,
            f.resume.empty() ? "training again from the start (no --resume latest)" : "resuming");
    }
    model->materialize(home, f.seed);
    if (activations != kernels::DType::f32) model->set_activations(nn::Activations::compute);
    std::unique_ptr<nn::Optimizer> optimizer;
    if (f.optim == "adamw") {
      kernels::AdamWConfig cfg;
      cfg.lr = lr;
      optimizer = std::make_unique<nn::AdamW>(*model, cfg);
    } else {
      kernels::SgdConfig cfg;
      cfg.lr = lr;
      cfg.momentum = 0.9f;
      optimizer = std::make_unique<nn::SGD>(*model, cfg);
    }
    nn::Optimizer& opt = *optimizer;

    Engine engine;
    nn::GradScaler single_scaler(precision);  // --mode single
    nn::GradScaler* scaler = &single_scaler;
    std::unique_ptr<dp::DataParallel> dp_engine;
    std::unique_ptr<dp::ParameterServer> ps;
    // What every rank (DDP) or node (hybrid) must agree on, verified before the first
    // collective; keyed by the flags as typed, so that a mismatch names the flag to fix.
    auto opt_text = [](const auto& v) { return v ? std::to_string(*v) : std::string("all"); };
    dp::dist::RunConfig run_config = {
        {"program", "train_mnist"},
        {"--mode", f.mode},
        {"--model", f.model},
        {"--batch", std::to_string(f.batch)},
        {"--epochs", std::to_string(f.epochs)},
        {"--limit-batches", opt_text(f.limit_batches)},
        {"--train-samples", opt_text(f.train_samples)},
        {"--optim", f.optim},
        {"--lr", dp::dist::config_number(lr)},
        {"--seed", std::to_string(f.seed)},
        {"--dtype", f.dtype},
        {"--activations", f.activations},
        {"--comm-dtype", f.comm_dtype},
        {"--data", dir},
        {"--last-batch", f.last_batch},
        {"--sync-bn", f.sync_bn ? "on" : "off"},
        {"--micro-batches", std::to_string(f.micro_batches)},
        {"--resume", f.resume},
        {"--checkpoint-dir", f.checkpoint_dir.empty() ? "none" : "given"},
        {"--save-every", f.save_every ? std::to_string(*f.save_every) : "none"},
        {"train_samples", std::to_string(train.size())}};
    std::unique_ptr<dp::dist::ProcessGroup> nodes;  // hybrid: one rank per node process
    if (hybrid) {
      auto env = dp::dist::worker_env_from_environment();
      DP_CHECK(env, "train_mnist --mode hybrid: not started as a node process");
      dp::dist::InitOptions io;
      io.backend = dp::dist::parse_backend(f.backend);
      io.device = home;
      io.rank = env->rank;
      io.world_size = env->world_size;
      if (f.timeout_s > 0) io.timeout = std::chrono::milliseconds(std::llround(f.timeout_s * 1000));
      nodes = dp::dist::init_process_group(io);
      run_config["--gpus"] = std::to_string(devices.size());  // per node: uneven nodes refused
      dp::dist::verify_same_config(*nodes, run_config, nodes->timeout());
    }
    if (f.mode == "ps") {
      dp::PsOptions po;
      po.max_staleness = f.max_staleness;
      if (f.staleness_lr) po.lr = dp::PsOptions::StalenessLr::scaled;
      ps = std::make_unique<dp::ParameterServer>(model, opt, devices, po);
    }
    if (f.mode == "dp" || hybrid) {
      dp::DataParallelOptions dopt;
      if (nodes) dopt.cross_node = std::make_shared<dp::dist::GroupCrossNode>(*nodes);
      if (f.sync_bn) dopt.batch_norm = dp::BatchNormStats::synced;
      dopt.precision = precision;
      dopt.math = nn::math_mode(precision);
      dopt.comm_dtype = comm_dtype;
      dopt.micro_batches = f.micro_batches;
      dp_engine = std::make_unique<dp::DataParallel>(model, opt, devices, dopt);
      scaler = &dp_engine->scaler();
      engine.train_step = [&](const Tensor& x, const Tensor& y) {
        return dp_engine->train_step(x, y).loss;
      };
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        return dp_engine->evaluate(x, y).correct;
      };
    } else if (f.mode == "ddp") {
      // What every rank must agree on: wrap() verifies it before the weights are broadcast.
      ddp->set_run_config(run_config);
      ddp->set_micro_batches(f.micro_batches);
      ddp->wrap(model, opt);
      scaler = &ddp->scaler();
      engine.train_step = [&](const Tensor& x, const Tensor& y) { return ddp->train_step(x, y); };
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        return ddp->count_correct(x, y);
      };
    } else if (!ps) {
      kernels::context(home).set_math(nn::math_mode(precision));
      model->set_compute_dtype(nn::compute_dtype(precision));
      Tensor loss = Tensor::empty({1}, kernels::DType::f32, home);
      engine.train_step = [&, loss](const Tensor& x, const Tensor& y) mutable {
        Tensor xd = x.to(home), yd = y.to(home);
        model->zero_grad();
        Tensor out = model->forward(xd);
        Tensor dlogits = Tensor::empty(out.shape(), kernels::DType::f32, home);
        kernels::softmax_cross_entropy(loss, dlogits, out, yd);
        single_scaler.scale_loss_grad(dlogits);
        model->backward(dlogits);
        single_scaler.step(opt, model->flat_grads());  // checks, unscales, steps or skips
        return loss.item();
      };
    }
    if (f.mode == "single" || ps) {  // the server's weights are the model's, on devices[0]
      engine.count_correct = [&](const Tensor& x, const Tensor& y) {
        model->eval();
        int64_t c = kernels::count_correct(model->forward(x.to(home)), y.to(home));
        model->train();
        return c;
      };
    }

    bool chatty = (!ddp || ddp->rank() == 0) && (!nodes || nodes->rank() == 0);
    DP_CHECK(f.log.empty() || f.mode != "ps",
             "--log with --mode ps: the server's pushes are not steps; drop --log");
    std::optional<dp::cli::StepLog> step_log;
    if (!f.log.empty() && chatty) step_log.emplace("--log", f.log);
    // Every device or rank gets rows of every batch: DP and DDP split the same global batches,
    // the last one padded (or dropped) alike, so both train the same rows at every step.
    dp::data::LoaderOptions lo;
    lo.batch_size = f.batch;
    lo.seed = f.seed;
    lo.drop_last = f.last_batch == "drop" ? dp::data::DropLast::yes : dp::data::DropLast::no;
    // A launcher other than ours (torchrun, mpirun) decides the world size: checked here too.
    const int world = ddp     ? ddp->world_size()
                      : nodes ? nodes->size() * static_cast<int>(devices.size())
                              : split;
    DP_CHECK(f.batch >= world, "--batch " << f.batch << " leaves some of the " << world
                                          << " ranks without rows: give --batch >= " << world);
    lo.pad_last_batch_to = world;
    std::vector<int64_t> subset(static_cast<size_t>(
        f.train_samples ? std::min(*f.train_samples, train.size()) : train.size()));
    std::iota(subset.begin(), subset.end(), int64_t{0});
    if (f.train_samples && *f.train_samples > train.size() && chatty)
      std::fprintf(stderr, "train_mnist: --train-samples %lld: %s holds %lld; all of them train\n",
                   static_cast<long long>(*f.train_samples), dir.c_str(),
                   static_cast<long long>(train.size()));
    dp::data::Loader loader(train, std::move(subset), lo);
    DP_CHECK(loader.num_batches() > 0,
             "--last-batch drop with " << loader.num_samples() << " training samples and --batch "
                                       << f.batch
                                       << ": every batch is dropped and nothing would train; give "
                                          "--batch <= "
                                       << loader.num_samples() << ", or --last-batch pad");
    std::vector<float> epoch_loss;
    std::vector<float> step_losses;  // every step this process trained, from first_step on
    int64_t rows_trained = 0;        // padding rows included: they are trained too
    // The training state: where this run starts, and how it saves.
    nn::TrainingProgress run_state;
    run_state.mode = f.mode;
    run_state.world_size = ps ? f.gpus : world;  // a parameter server's workers
    // What a resume must match. The program and the data set too: a dp_bench state (its own
    // synthetic data) or one from a smaller --train-samples (which would drop the rest of the
    // epoch) is refused, naming what differs.
    run_state.config = settings;
    run_state.config["dataset_size"] = std::to_string(train.size());
    run_state.config["train_samples"] = std::to_string(loader.num_samples());
    const int my_index = ddp ? ddp->rank() : 0;
    auto save_state = [&](int64_t epoch, int64_t batches_done) {
      run_state.epoch = epoch;
      run_state.batches_done = batches_done;
      // Each device's or rank's dropout stream (a collective in DDP).
      run_state.rng_offsets = dp_engine ? dp_engine->rng_offsets()
                              : ps      ? ps->rng_offsets()
                              : ddp     ? ddp->all_gather(model->flat().rng_offset)
                                        : std::vector<uint64_t>{model->flat().rng_offset};
      if (scaler->enabled()) run_state.scaler = scaler->state();
      if (my_index == 0) nn::save_checkpoint_in(*checkpoint_lock, f.keep, *model, opt, run_state);
      // Nobody reads a half-written file: every rank waits until rank 0 has written it.
      if (ddp) ddp->group().barrier()->wait();
    };
    int start_epoch = 0;
    int64_t skip_batches = 0;
    // "latest" skips damaged checkpoints (DDP: every rank reads the same folder, and the ranks
    // check that they picked the same state).
    const nn::Resumed resumed = ddp ? ddp->resume(f.resume, f.checkpoint_dir, run_state)
                                    : nn::resume_training_state(f.resume, f.checkpoint_dir, *model,
                                                                opt, run_state, my_index);
    const std::string& resume_path = resumed.path;
    if (chatty)
      for (const std::string& line : nn::resume_report(resumed, run_state))
        std::fprintf(stderr, "train_mnist: %s\n", line.c_str());
    if (!resume_path.empty()) {
      const nn::TrainingProgress& got = resumed.progress;
      if (dp_engine) dp_engine->set_rng_offsets(got.rng_offsets);
      if (ps) ps->set_rng_offsets(got.rng_offsets);
      if (got.scaler) scaler->set_state(*got.scaler);
      run_state.step = got.step;
      start_epoch = static_cast<int>(got.epoch);
      skip_batches = got.batches_done;
      if (chatty)
        std::fprintf(stderr, "train_mnist: resumed from %s at step %lld (epoch %d, batch %lld)\n",
                     resume_path.c_str(), static_cast<long long>(got.step), start_epoch,
                     static_cast<long long>(skip_batches));
    }
    // Batches per epoch, and whether the checkpoint already holds the whole run.
    const int64_t per_epoch =
        f.limit_batches ? std::min(loader.num_batches(), *f.limit_batches) : loader.num_batches();
    const bool nothing_left =
        !resume_path.empty() &&
        (start_epoch >= f.epochs || (start_epoch == f.epochs - 1 && skip_batches >= per_epoch));
    if (nothing_left && chatty)
      std::fprintf(stderr,
                   "train_mnist: nothing left to train: checkpoint at step %lld of %lld (epoch "
                   "%d, batch %lld, of --epochs %d) in %s; give more --epochs to train further\n",
                   static_cast<long long>(run_state.step),
                   static_cast<long long>(std::max<int64_t>(f.epochs * per_epoch, run_state.step)),
                   start_epoch, static_cast<long long>(skip_batches), f.epochs,
                   resume_path.c_str());
    const int64_t first_step = run_state.step;
    auto t0 = std::chrono::steady_clock::now();
    for (int e = start_epoch; e < f.epochs && !nothing_left; ++e) {
      loader.set_epoch(e);
      double sum = 0;
      int64_t n = 0, rows = 0, total = loader.num_batches();
      if (f.limit_batches) total = std::min(total, *f.limit_batches);
      auto te = std::chrono::steady_clock::now();
      int64_t skip = e == start_epoch ? skip_batches : 0;  // trained before the resume
      int64_t trained_here = 0;                            // batches this process trained
      std::unique_ptr<dp::cli::ProgressLine> bar;          // this epoch's
      if (ps) {
        // The shared sampler: each worker takes the next batch of the epoch's order (the
        // loader's, so every mode visits the same batches) and trains it on the weights it
        // pulled; the server applies the gradients as they arrive. The epoch runs in pieces
        // that end where a checkpoint is due: run() returns with every drawn gradient applied,
        // a quiet point to save (at --max-staleness 0 the pieces change nothing).
        std::vector<int64_t> order = loader.epoch_order(e);
        auto batch_of = [&](int64_t k) {
          int64_t begin = k * f.batch;
          int64_t end = std::min<int64_t>(begin + f.batch, static_cast<int64_t>(order.size()));
          auto b = dp::data::make_batch(
              train, std::vector<int64_t>(order.begin() + begin, order.begin() + end));
          return std::make_pair(b.images, b.labels);
        };
        n = skip;
        int64_t max_stale = 0;
        double ps_seconds = 0;
        while (n < total) {
          int64_t piece = total - n;
          if (f.save_every)
            piece = std::min<int64_t>(piece, *f.save_every - run_state.step % *f.save_every);
          dp::PsReport r = ps->run(batch_of, n, piece);
          for (const auto& u : r.updates) {
            sum += u.loss;
            rows += u.samples;
            step_losses.push_back(u.loss);
          }
          n += piece;
          trained_here += r.pushes;
          run_state.step += piece;
          ps_seconds += r.seconds;
          max_stale =
              std::max<int64_t>(max_stale, static_cast<int64_t>(r.staleness_histogram.size()) - 1);
          if (f.save_every && run_state.step % *f.save_every == 0 && n < total) save_state(e, n);
        }
        if (chatty)
          progress(bar, e, n, total, static_cast<float>(sum / std::max<int64_t>(trained_here, 1)),
                   rows / std::max(ps_seconds, 1e-9));
        std::fprintf(stderr, "epoch %d: %lld updates at %.0f/s, staleness max %lld\n", e,
                     static_cast<long long>(trained_here),
                     trained_here / std::max(ps_seconds, 1e-9), static_cast<long long>(max_stale));
      }
      if (!ps)
        for (auto& batch : loader) {
          if (skip > 0) {
            --skip;
            if (++n == total) break;
            continue;
          }
          const auto t_step = std::chrono::steady_clock::now();
          float l = engine.train_step(batch.images, batch.labels);
          sum += l;
          ++n;
          ++trained_here;
          ++run_state.step;
          step_losses.push_back(l);
          if (step_log) {
            const double dt =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
            step_log->write({run_state.step, l, opt.lr(), std::nullopt,
                             batch.size() / std::max(dt, 1e-9), scaler->scale()});
          }
          rows += batch.size();
          if (f.save_every && run_state.step % *f.save_every == 0 && n < total) save_state(e, n);
          double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - te).count();
          if (chatty)
            progress(bar, e, n, total, static_cast<float>(sum / trained_here),
                     rows / std::max(s, 1e-9));
          if (n == total) break;  // --limit-batches
        }
      rows_trained += rows;
      epoch_loss.push_back(static_cast<float>(sum / std::max<int64_t>(trained_here, 1)));
      if (f.save_every && run_state.step % *f.save_every == 0) save_state(e + 1, 0);
    }
    if (!f.checkpoint_dir.empty() && !nothing_left) save_state(f.epochs, 0);  // the run's end
    if (step_log) step_log->close();  // a log that did not reach the disk is an error
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    int64_t correct = 0;
    for (int64_t first = 0; first < test.size(); first += 1000) {
      auto b = dp::data::make_batch(test, first, std::min<int64_t>(1000, test.size() - first));
      correct += engine.count_correct(b.images, b.labels);
    }
    double accuracy = static_cast<double>(correct) / test.size();
    if (chatty) {
      char last_loss[64] = "none trained";
      if (!epoch_loss.empty())
        std::snprintf(last_loss, sizeof last_loss, "%.4f", epoch_loss.back());
      std::printf(
          "train_mnist: model %s, mode %s on %d x %s, %d epoch(s): test accuracy %.4f, "
          "last epoch loss %s, %.1f s\n",
          f.model.c_str(), f.mode.c_str(),
          ddp     ? ddp->world_size()
          : nodes ? nodes->size() * static_cast<int>(devices.size())
                  : static_cast<int>(devices.size()),
          type == kernels::DeviceType::cuda ? "cuda" : "cpu", f.epochs, accuracy, last_loss,
          seconds);
      if (!f.json.empty()) {
        dp::cli::write_output(
            "--json", f.json,
            nlohmann::json{{"program", "train_mnist"},  // lets a later --json replace it
                           {"test_accuracy", accuracy},
                           {"train_loss", epoch_loss},
                           {"seconds", seconds},
                           {"rows_trained", rows_trained},
                           {"first_step", first_step},
                           {"step_losses", step_losses},
                           {"samples_per_s", rows_trained / std::max(seconds, 1e-9)},
                           {"model", f.model},
                           {"mode", f.mode},
                           {"dtype", f.dtype},
                           {"comm_dtype", f.comm_dtype},
                           {"loss_scale", scaler->scale()},
                           {"skipped_steps", scaler->skipped_steps()},
                           {"devices", devices.size()}}
                    .dump(2) +
                "\n");
      }
    }
    // Skipped steps (non-finite gradients) over the whole run, resumed parts included: a
    // warning past 5%, an error past --max-skip-fraction.
    if (!ps) {
      const std::string warning =
          nn::check_skipped_steps(scaler->skipped_steps(), run_state.step, f.max_skip_fraction);
      if (!warning.empty() && chatty) std::fprintf(stderr, "train_mnist: %s\n", warning.c_str());
    }
    dp::cli::check_stdout("train_mnist");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_mnist: error: %s\n", e.what());
    return 1;
  }
}
