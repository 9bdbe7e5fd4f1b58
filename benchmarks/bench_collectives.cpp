// bench_collectives: nccl-tests style bandwidth of the engine's communication paths, over
// message sizes (4 KiB .. 256 MiB by default on GPUs, .. 64 MiB on CPUs):
//   dp:   the in-process DP path on N logical devices (DataParallel::broadcast_params from
//         device 0, reduce_grads_to_root to device 0), the copies a DP step makes;
//   ddp:  all_reduce, broadcast and reduce_scatter of a ProcessGroup (gloo or nccl) on N
//         processes launched like torchrun.
// algbw = bytes / time; busbw = algbw x the collective's factor (nccl-tests' convention:
// all_reduce 2(N-1)/N, reduce_scatter (N-1)/N, broadcast 1; the DP star moves (N-1) copies
// through device 0, so its bus factor is N-1).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>

#include <CLI/CLI.hpp>

#include "benchmarks/report.hpp"
#include "dp/cli/cli.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/mpi_process_group.hpp"
#include "dp/distributed/process_group.hpp"
#include "nn/nn.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using kernels::Device;
using kernels::Tensor;

struct Flags {
  int n = 4;
  std::string device = "auto", what = "both", backend = "auto";
  int64_t min_bytes = 4 << 10;
  std::optional<int64_t> max_bytes;  // unset: 256 MiB on GPUs, 64 MiB on CPUs
  int iters = 5;
  std::optional<int> max_local_ranks;  // unset: dp::dist::local_rank_limit()
};

constexpr int64_t kMaxMessageBytes = int64_t(16) << 30;

kernels::DeviceType device_type(const Flags& f) {
  std::string fallback;
  kernels::DeviceType t = kernels::choose_device_type(f.device, &fallback);
  if (!fallback.empty() && !dp::dist::worker_env_from_environment())
    std::fprintf(stderr, "bench_collectives: %s\n", fallback.c_str());
  return t;
}

// The largest message: --max-bytes, else 256 MiB on GPUs and 64 MiB on CPUs.
int64_t largest_message(const Flags& f, kernels::DeviceType t) {
  return f.max_bytes ? *f.max_bytes : (t == kernels::DeviceType::cuda ? 256ll << 20 : 64ll << 20);
}

std::vector<int64_t> sizes(const Flags& f, kernels::DeviceType t) {
  const int64_t max = largest_message(f, t);
  std::vector<int64_t> out;
  for (int64_t b = f.min_bytes; b <= max; b *= 4) out.push_back(b);
  return out;
}

void header(const char* what, int n, const std::string& device) {
  std::printf("\n%s on %d x %s\n%12s %10s %12s %12s\n", what, n, device.c_str(), "bytes", "time us",
              "algbw GB/s", "busbw GB/s");
}

void row(int64_t bytes, double seconds, double bus_factor) {
  double algbw = bytes / seconds / 1e9;
  std::printf("%12lld %10.1f %12.3f %12.3f\n", static_cast<long long>(bytes), seconds * 1e6, algbw,
              algbw * bus_factor);
}

// The largest message's buffers, before any: about two copies of it per device or rank (DP:
// parameters and gradients of each replica; DDP: the tensor and the backend's scratch). A
// message that cannot fit is refused with the figures instead of growing until it is killed.
void check_memory(const Flags& f, kernels::DeviceType t) {
  const std::vector<int64_t> all = sizes(f, t);
  if (all.empty()) return;
  const int64_t largest = all.back();
  const std::string what = "--max-bytes " + std::to_string(largest) + " (" + std::to_string(f.n) +
                           (f.what == "dp" ? " devices" : " devices or ranks") + " x 2 buffers)";
  const std::string hint = "give a smaller --max-bytes or fewer --gpus";
  if (t == kernels::DeviceType::cpu) {
    dp::cli::check_fits(what, 2 * largest * f.n, "the host", kernels::host_memory_available(),
                        hint);
    return;
  }
  // Logical devices share the GPUs round-robin: GPU 0 holds the most; Gloo and MPI stage CUDA
  // tensors through one pinned host copy per rank.
  const int physical = std::max(1, kernels::cuda_device_count());
  const int on_gpu0 = (f.n + physical - 1) / physical;
  dp::cli::check_fits(what, 2 * largest * on_gpu0, "GPU 0", kernels::gpu_memory(0), hint);
  if (f.what != "dp")
    dp::cli::check_fits(what, largest * f.n, "the host", kernels::host_memory_available(), hint);
}

template <class F>
double time_it(int iters, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return bench::percentile(t, 0.5);
}

// DP's own broadcast and reduction, on a one-parameter model of `bytes`.
void bench_dp(const Flags& f, kernels::DeviceType type) {
  auto devices = kernels::make_devices(type, f.n);
  std::string dev = type == kernels::DeviceType::cuda ? "cuda (logical)" : "cpu";
  std::vector<std::pair<int64_t, double>> bcast, reduce;
  for (int64_t bytes : sizes(f, type)) {
    auto model = std::make_shared<nn::Sequential>();
    model->add(std::make_shared<nn::Linear>(bytes / 4, 1, nn::Bias::no));
    model->materialize(devices[0], 1);
    nn::SGD opt(*model, kernels::SgdConfig{});
    dp::DataParallel engine(model, opt, devices);
    std::vector<int64_t> even(f.n, 1);
    bcast.emplace_back(bytes, time_it(f.iters, [&] { engine.broadcast_params(); }));
    reduce.emplace_back(bytes, time_it(f.iters, [&] { engine.reduce_grads_to_root(even); }));
  }
  header("dp broadcast_params (device 0 -> each replica)", f.n, dev);
  for (auto& [b, s] : bcast) row(b, s, f.n - 1);
  header("dp reduce_grads_to_root (each replica -> device 0, weighted sum)", f.n, dev);
  for (auto& [b, s] : reduce) row(b, s, f.n - 1);
}

int bench_ddp_worker(const Flags& f, kernels::DeviceType type, const dp::dist::WorkerEnv& env) {
  Device dev{type, env.local_rank};
  kernels::ContextOptions co;
  co.cpu_threads = 1;
  kernels::DeviceContext ctx(dev, co);
  kernels::ContextScope scope(ctx);
  dp::dist::InitOptions io;
  io.backend = dp::dist::parse_backend(f.backend);
  io.device = dev;
  auto pg = dp::dist::init_process_group(io);
  int n = pg->size();
  struct Op {
    const char* name;
    double factor;
    std::function<void(Tensor&, Tensor&)> run;
  };
  std::vector<Op> ops = {
      {"all_reduce", 2.0 * (n - 1) / n,
       [&](Tensor& a, Tensor&) { pg->all_reduce(a, dp::dist::ReduceOp::sum)->wait(); }},
      {"broadcast", 1.0, [&](Tensor& a, Tensor&) { pg->broadcast(a, 0)->wait(); }},
      {"reduce_scatter", static_cast<double>(n - 1) / n,
       [&](Tensor& a, Tensor& out) {
         pg->reduce_scatter(out, a, dp::dist::ReduceOp::sum)->wait();
       }},
  };
  for (auto& op : ops) {
    if (pg->rank() == 0)
      header(("ddp " + std::string(op.name) + " (" + pg->backend_name() + ")").c_str(), n,
             dev.is_cuda() ? "cuda" : "cpu");
    for (int64_t bytes : sizes(f, type)) {
      int64_t elems = bytes / 4 / n * n;
      Tensor a = Tensor::zeros({elems}, kernels::DType::f32, dev);
      Tensor out = Tensor::zeros({elems / n}, kernels::DType::f32, dev);
      double s = time_it(f.iters, [&] {
        op.run(a, out);
        ctx.synchronize();
      });
      if (pg->rank() == 0) row(elems * 4, s, op.factor);
    }
  }
  pg->barrier()->wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"bench_collectives: bandwidth of the DP copies and the DDP collectives"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  using dp::cli::whole_number;
  app.add_option("--gpus,-n", f.n, "devices (dp) or ranks (ddp)")->check(whole_number(1, 64));
  app.add_option("--device", f.device)->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--mode", f.what, "dp|ddp|both")->check(CLI::IsMember({"dp", "ddp", "both"}));
  app.add_option("--backend", f.backend, "auto|gloo|nccl|mpi (mpi: under mpirun)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl", "mpi"}));
  app.add_option("--min-bytes", f.min_bytes, "smallest message")
      ->check(whole_number(4, kMaxMessageBytes));
  app.add_option("--max-bytes", f.max_bytes, "largest message (default 256 MiB GPU, 64 MiB CPU)")
      ->check(whole_number(4, kMaxMessageBytes));
  app.add_option("--iters", f.iters)->check(whole_number(1, 100000));
  app.add_option("--max-local-ranks", f.max_local_ranks,
                 "ddp: most ranks to start on this node (default: from its cores and memory)")
      ->check(whole_number(1, 4096));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }
  try {
    DP_CHECK(!f.max_bytes || f.min_bytes <= *f.max_bytes,
             "--min-bytes " << f.min_bytes << " is more than --max-bytes " << *f.max_bytes);
    kernels::DeviceType type = device_type(f);
    // An empty table, or DDP rows of 0 bytes (a message splits into n shards of whole f32s).
    DP_CHECK(!sizes(f, type).empty(), "--min-bytes " << f.min_bytes
                                                     << " is more than the largest message, "
                                                     << largest_message(f, type)
                                                     << " bytes by default: give --max-bytes too");
    DP_CHECK(f.what == "dp" || f.min_bytes >= 4 * int64_t{f.n},
             "--min-bytes " << f.min_bytes << " with -n " << f.n << ": a DDP message is " << f.n
                            << " shards of whole f32 values: give --min-bytes >= " << 4 * f.n);
    if (auto env = dp::dist::worker_env_from_environment()) return bench_ddp_worker(f, type, *env);
    check_memory(f, type);
    // What stops DDP's ranks from starting is said before the DP tables run, not after.
    if (f.what != "dp") {
      dp::dist::check_launchable(f.backend, "bench_collectives", f.n);
      dp::dist::check_backend_devices(f.backend, type, f.n);
      dp::dist::check_local_ranks(f.n, f.max_local_ranks);
    }
    if (type == kernels::DeviceType::cuda)
      dp::warn_if_oversubscribed(kernels::make_devices(type, f.n));
    if (f.what != "ddp") bench_dp(f, type);
    if (f.what != "dp") {
      std::fflush(stdout);
      dp::dist::LaunchOptions lo;
      lo.nproc_per_node = f.n;
      lo.max_local_ranks = f.max_local_ranks;
      const int rc = dp::dist::launch_workers(lo, std::vector<std::string>(argv, argv + argc));
      if (rc == 0) dp::cli::check_stdout("bench_collectives");
      return rc;
    }
    dp::cli::check_stdout("bench_collectives");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: error: %s\n", e.what());
    return 1;
  }
}
