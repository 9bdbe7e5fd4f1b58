// custom_reducer: your own way for the gradient buckets to meet (a communication hook,
// dp/distributed/comm_hook.hpp), trained beside DDP's built-in bucket all-reduce on the same
// model, data and ranks, and then under DP (one process, a thread per device) beside its sums to
// device 0. The hook here is PowerSGD (samples/low_rank_hook.hpp): a rank-r approximation of
// each bucket with error feedback, in about 100 lines of public API.
//
//   bin/custom_reducer --nproc 2
//   bin/custom_reducer --nproc 4 --device cuda --backend nccl --rank 8 --steps 200
//
// Without RANK/WORLD_SIZE in its environment the program is the launcher: it runs --nproc
// workers of itself. Each worker trains the same MLP on its shard of the same synthetic global
// batches twice, from the same initial weights: with the all-reduce, then with the hook. Rank 0
// prints each run's loss along the way, the bytes it handed to the collectives per step and its
// median step time; the program fails if the ranks' weights differ after either run. Then the
// launcher trains the same two runs under DP on --nproc devices (the hook over an in-process
// group of them: dp::dist::device_reducers) and prints them alike: the hook's losses are DDP's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "dp/chunks.hpp"
#include "dp/cli/cli.hpp"
#include "dp/data/loader.hpp"
#include "dp/data/synthetic.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/ddp.hpp"
#include "dp/distributed/device_reducers.hpp"
#include "dp/distributed/launcher.hpp"
#include "kernels/runtime/memory_info.hpp"
#include "nn/nn.hpp"
#include "samples/low_rank_hook.hpp"

using kernels::Device;
using kernels::Tensor;

namespace {

struct Flags {
  int nproc = 2;
  std::string backend = "auto";
  std::string device = "cpu";
  int steps = 60;
  int64_t batch = 256;
  int64_t width = 512;
  int rank = 4;
  int start_step = 10;
  float lr = 0.05f;
  uint64_t seed = 1;
};

constexpr int64_t kFeatures = 64;
constexpr int kClasses = 10;

struct Run {
  std::string name;
  std::vector<float> losses;  // the global batch's mean loss, per step
  int64_t bytes_first = 0;    // bytes handed to the collectives on the first step ...
  int64_t bytes_last = 0;     // ... and on the last
  double median_ms = 0;
  float replica_diff = 0;  // max |w - rank 0's w| over the weights, on any rank
};

// One training run of this rank: its chunk of each global batch, DDP with `hook` (null: the
// built-in all-reduce), SGD with momentum.
Run train(const Flags& f, dp::dist::ProcessGroup& pg, Device dev, const dp::data::Dataset& data,
          std::shared_ptr<dp::dist::CommHook> hook) {
  Run run;
  run.name = hook ? hook->name() : "all-reduce (built-in)";
  auto model = nn::mlp({kFeatures, f.width, f.width, kClasses});
  model->materialize(dev, f.seed);  // rank 0's weights are broadcast anyway
  kernels::SgdConfig cfg;
  cfg.lr = f.lr;
  cfg.momentum = 0.9f;
  nn::SGD opt(*model, cfg);
  dp::dist::DdpOptions options;
  options.comm_hook = std::move(hook);
  dp::dist::DistributedDataParallel ddp(model, pg, options);
  const int r = pg.rank(), world = pg.size();
  const std::vector<int64_t> sizes = dp::chunk_sizes(f.batch, world);
  const int64_t begin = dp::chunk_begin(sizes, r);
  std::vector<double> ms;
  Tensor loss = Tensor::empty({1}, kernels::DType::f32, dev), dlogits;
  for (int s = 0; s < f.steps; ++s) {
    dp::data::Batch b = dp::data::make_batch(data, s * f.batch, f.batch);  // the global batch
    Tensor x = b.images.slice(begin, begin + sizes[r]).to(dev);
    Tensor y = b.labels.slice(begin, begin + sizes[r]).to(dev);
    kernels::context(dev).synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    ddp.set_batch_share(sizes[r], f.batch);
    model->zero_grad();
    Tensor out = ddp.forward(x);
    kernels::ensure(dlogits, out.shape(), kernels::DType::f32, dev);  // made once
    kernels::softmax_cross_entropy(loss, dlogits, out, y);
    ddp.backward(dlogits);
    ddp.finish_gradient_sync();
    opt.step();
    kernels::context(dev).synchronize();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    run.bytes_last = ddp.stats().comm_bytes;  // one step: the first is the last
    if (s == 0) run.bytes_first = run.bytes_last;
    kernels::scale(loss, loss, dp::chunk_share(sizes[r], f.batch));
    pg.all_reduce(loss)->wait();  // the global batch's mean loss
    run.losses.push_back(loss.item());
  }
  std::sort(ms.begin(), ms.end());
  run.median_ms = ms[ms.size() / 2];
  // Every rank stepped with the same reduced gradient: the weights must be rank 0's, bit for bit.
  Tensor mine = model->flat_params().clone();
  Tensor root = model->flat_params().clone();
  pg.broadcast(root, 0)->wait();
  Tensor diff = Tensor::from_vector({kernels::max_abs_diff(mine.to_host_f32(), root.to_host_f32())},
                                    {1}, dev);
  pg.all_reduce(diff, dp::dist::ReduceOp::max)->wait();
  run.replica_diff = diff.item();
  return run;
}

// The synthetic set both engines train on: classes that overlap, so dozens of steps to separate.
dp::data::SyntheticDataset training_data(const Flags& f) {
  dp::data::SyntheticOptions hard;
  hard.signal = 0.15f;
  return dp::data::SyntheticDataset(static_cast<int64_t>(f.steps) * f.batch, {kFeatures}, kClasses,
                                    f.seed, hard);
}

std::shared_ptr<dp::dist::CommHook> make_hook(const Flags& f) {
  samples::LowRankOptions lo;
  lo.rank = f.rank;
  lo.start_step = f.start_step;
  return std::make_shared<samples::LowRankHook>(lo);
}

// Each run's losses at a few steps, its bytes per step, its median step time and, for DDP's ranks
// (`ddp`), whether their weights were equal. DDP's rows both count what was handed to the group,
// so equal bytes mean the hook compressed no bucket; DP's rows count the star's pulls against
// every device's hook bucket, which differ even then.
void print_runs(const Flags& f, const std::vector<Run>& runs, bool ddp) {
  std::vector<int> at = {0, f.steps / 4, f.steps / 2, 3 * f.steps / 4, f.steps - 1};
  at.erase(std::unique(at.begin(), at.end()), at.end());
  std::printf("%-28s", "reducer");
  for (int s : at) std::printf("  loss@%-4d", s);
  std::printf("  bytes/step (first, last)   ms/step (median)%s\n", ddp ? "  replicas" : "");
  for (const Run& run : runs) {
    std::printf("%-28s", run.name.c_str());
    for (int s : at) std::printf("  %9.4f", static_cast<double>(run.losses[s]));
    std::printf("  %11lld, %-11lld  %16.2f", static_cast<long long>(run.bytes_first),
                static_cast<long long>(run.bytes_last), run.median_ms);
    if (ddp) std::printf("  %s", run.replica_diff == 0.f ? "equal" : "DIFFER");
    std::printf("\n");
  }
  if (f.steps <= f.start_step) {  // the last step was all-reduced whole
    std::printf(
        "%s compresses from step %d on (--start-step): these %d steps ran before it, so they "
        "show no compression; give --steps above %d\n",
        runs[1].name.c_str(), f.start_step, f.steps, f.start_step);
  } else if (ddp && runs[1].bytes_last == runs[0].bytes_last) {  // every bucket whole
    std::printf(
        "%s compressed no bucket: a bucket of n values is a matrix of about sqrt(n) x sqrt(n), "
        "and rank %d shrinks none of them enough; give a smaller --rank\n",
        runs[1].name.c_str(), f.rank);
  } else if (runs[1].bytes_last > 0) {
    const double ratio =
        static_cast<double>(runs[0].bytes_last) / static_cast<double>(runs[1].bytes_last);
    std::printf(
        "%s hands %.1fx %s bytes to the collectives per step once it compresses "
        "(step %d on), at %.2fx the step time\n",
        runs[1].name.c_str(), ratio >= 1 ? ratio : 1 / ratio, ratio >= 1 ? "fewer" : "more",
        f.start_step, runs[1].median_ms / runs[0].median_ms);
  }
}

// The same two runs under DP: --nproc devices of this process, the same model, data and initial
// weights, with the sums to device 0 and then with the hook (one per device, over an in-process
// group). Bytes: the gradients' between the devices per step, over all of them (the star's pulls
// into device 0, or what the devices' hooks handed to their group); the weights' copies to the
// replicas are the same in both runs and left out.
std::vector<Run> train_threaded(const Flags& f) {
  const dp::data::SyntheticDataset data = training_data(f);
  const auto devices = kernels::make_devices(
      f.device == "cuda" ? kernels::DeviceType::cuda : kernels::DeviceType::cpu, f.nproc);
  std::vector<Run> runs;
  for (bool hooked : {false, true}) {
    Run run;
    auto model = nn::mlp({kFeatures, f.width, f.width, kClasses});
    model->materialize(devices[0], f.seed);
    kernels::SgdConfig cfg;
    cfg.lr = f.lr;
    cfg.momentum = 0.9f;
    nn::SGD opt(*model, cfg);
    dp::DataParallelOptions o;
    if (hooked) o.reducers = dp::dist::device_reducers(f.nproc, [&](int) { return make_hook(f); });
    run.name = hooked ? make_hook(f)->name() : "sums to device 0 (built-in)";
    dp::DataParallel engine(model, opt, devices, o);
    std::vector<double> ms;
    for (int s = 0; s < f.steps; ++s) {
      const dp::data::Batch b = dp::data::make_batch(data, s * f.batch, f.batch);
      const dp::StepStats st = engine.train_step(b.images, b.labels);
      ms.push_back(st.ms.total);
      run.bytes_last = hooked ? st.reducer_bytes : (st.devices_used - 1) * engine.parameter_bytes();
      if (s == 0) run.bytes_first = run.bytes_last;  // one step: the first is the last
      run.losses.push_back(st.loss);
    }
    std::sort(ms.begin(), ms.end());
    run.median_ms = ms[ms.size() / 2];
    runs.push_back(std::move(run));
  }
  return runs;
}

int run_worker(const Flags& f) {
  dp::dist::InitOptions o;
  o.backend = dp::dist::parse_backend(f.backend);
  const auto env = dp::dist::worker_env_from_environment();
  o.device = f.device == "cuda" ? Device::cuda(env->local_rank) : Device::cpu();
  o.timeout = std::chrono::seconds(120);
  auto pg = dp::dist::init_process_group(o);
  const dp::data::SyntheticDataset data = training_data(f);
  std::vector<Run> runs;
  runs.push_back(train(f, *pg, o.device, data, nullptr));
  runs.push_back(train(f, *pg, o.device, data, make_hook(f)));
  bool ok = true;
  for (const Run& run : runs) ok = ok && run.replica_diff == 0.f;
  if (pg->rank() != 0) return ok ? 0 : 1;
  std::printf("%d ranks (%s, %s), MLP %lld-%lld-%lld-%d, global batch %lld, %d steps, SGD lr %g\n",
              pg->size(), pg->backend_name().c_str(), f.device.c_str(),
              static_cast<long long>(kFeatures), static_cast<long long>(f.width),
              static_cast<long long>(f.width), kClasses, static_cast<long long>(f.batch), f.steps,
              static_cast<double>(f.lr));
  print_runs(f, runs, true);
  if (!ok) std::fprintf(stderr, "custom_reducer: the ranks' weights differ after a run\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "custom_reducer: a communication hook (PowerSGD) beside DDP's built-in all-reduce and DP's "
      "sums to device 0");
  app.option_defaults()->always_capture_default();  // --help shows every default
  Flags f;
  using dp::cli::whole_number;
  app.add_option("--nproc", f.nproc, "worker processes")->check(whole_number(1, 8));
  app.add_option("--backend", f.backend, "auto, gloo or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--device", f.device, "where each rank trains")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--steps", f.steps, "training steps of each run")->check(whole_number(1, 100000));
  app.add_option("--batch", f.batch, "global batch (rows over every rank)")
      ->check(whole_number(1, 1 << 20));
  app.add_option("--width", f.width, "the MLP's hidden width")->check(whole_number(1, 8192));
  app.add_option("--rank", f.rank, "PowerSGD's rank r")->check(whole_number(1, 1024));
  app.add_option("--start-step", f.start_step, "steps all-reduced whole before compressing")
      ->check(whole_number(0, 100000));
  app.add_option("--lr", f.lr, "SGD's learning rate")->check(dp::cli::positive_number(10));
  app.add_option("--seed", f.seed, "weights and data");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  try {
    if (f.batch < f.nproc)
      throw kernels::Error("--batch " + std::to_string(f.batch) + " leaves ranks of --nproc " +
                           std::to_string(f.nproc) + " without rows: give at least " +
                           std::to_string(f.nproc));
    if (dp::dist::worker_env_from_environment()) return run_worker(f);
    // Before any worker starts: what the flags ask of this machine.
    if (f.device == "cuda" && kernels::cuda_device_count() == 0)
      throw kernels::Error("--device cuda: no usable GPU (" + kernels::cuda_unavailable_reason() +
                           "); give --device cpu");
    if (f.device == "cpu" && f.backend == "nccl")
      throw kernels::Error(
          "--backend nccl with --device cpu: NCCL runs on GPUs; give --backend "
          "gloo or auto");
    if (f.device == "cpu") {
      // Per rank: the weights, gradients and momentum, and the hook's matrix, approximation and
      // error per bucket: about 6 copies of the parameters in f32; and its chunk's activations
      // and their gradients (the input, each hidden layer before and after its ReLU, the
      // logits): a batch of 2^20 rows at --width 8192 met the OOM killer with the parameters
      // alone counted.
      const int64_t params =
          (kFeatures + 1) * f.width + (f.width + 1) * f.width + (f.width + 1) * kClasses;
      const int64_t rows = (f.batch + f.nproc - 1) / f.nproc;
      const int64_t activations = 2 * rows * (kFeatures + 4 * f.width + kClasses);
      dp::cli::check_fits("--width " + std::to_string(f.width) + " and --batch " +
                              std::to_string(f.batch) + " on --nproc " + std::to_string(f.nproc) +
                              " ranks (6 copies of " + std::to_string(params) + " parameters and " +
                              std::to_string(activations) + " activation values each)",
                          4 * (6 * params + activations) * f.nproc, "the host",
                          kernels::host_memory_available(),
                          "give a smaller --width or --batch, or fewer --nproc");
    }
    dp::dist::LaunchOptions lo;
    lo.nproc_per_node = f.nproc;
    const int rc = dp::dist::launch_workers(lo, std::vector<std::string>(argv, argv + argc));
    if (rc != 0) return rc;
    std::fflush(stdout);  // rank 0's table came through the same terminal
    std::printf("\nDP: %d devices, threads of one process (%s), the same model, data and steps\n",
                f.nproc, f.device.c_str());
    print_runs(f, train_threaded(f), false);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_reducer: %s\n", e.what());
    return 1;
  }
}
