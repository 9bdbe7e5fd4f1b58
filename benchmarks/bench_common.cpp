#include "benchmarks/bench_common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>

#include "benchmarks/ddp_run.hpp"
#include "benchmarks/ps_run.hpp"
#include "dp/cli/cli.hpp"
#include "dp/data/loader.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/device_reducers.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/mpi_process_group.hpp"
#include "dp/distributed/nccl_process_group.hpp"
#include "nn/nn.hpp"

namespace bench {

using kernels::Device;
using kernels::DeviceType;

namespace {
using dp::cli::kMaxDevices;

// Dense tensor-core peaks of the GPUs we run on, from NVIDIA's data sheets (TFLOP/s, no
// sparsity), by the run's dtype; nullopt for any other device.
std::optional<double> data_sheet_tflops(const std::string& device, const std::string& dtype) {
  struct Sheet {
    const char* name;
    double fp32, tf32, half;
  };
  // H100 SXM and H200 share the compute; H100 PCIe is slower.
  static const Sheet sheets[] = {{"H100 PCIe", 51.2, 378, 756},
                                 {"H100", 66.9, 494.7, 989.4},
                                 {"H200", 66.9, 494.7, 989.4},
                                 {"A100", 19.5, 156, 312}};
  for (const Sheet& g : sheets)
    if (device.find(g.name) != std::string::npos)
      return dtype == "fp32" ? g.fp32 : dtype == "tf32" ? g.tf32 : g.half;
  return std::nullopt;
}

// The best of 5 (1024 x 1024) x (1024 x 1024) GEMMs on `dev` in `dtype`, in TFLOP/s.
double measured_gemm_tflops(const kernels::Device& dev, kernels::DType dtype) {
  constexpr int64_t n = 1024;
  kernels::Tensor a = kernels::Tensor::empty({n, n}, dtype, dev);
  kernels::Tensor b = kernels::Tensor::empty({n, n}, dtype, dev);
  kernels::Tensor c = kernels::Tensor::empty({n, n}, kernels::DType::f32, dev);
  kernels::fill(a, 0.5f);
  kernels::fill(b, 0.25f);
  double best_s = 1e30;
  for (int i = 0; i < 6; ++i) {
    kernels::context(dev).synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    kernels::gemm(c, a, kernels::Transpose::no, b, kernels::Transpose::no);
    kernels::context(dev).synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best_s = std::min(best_s, s);  // the first warms up
  }
  return 2.0 * n * n * n / best_s / 1e12;
}
constexpr int kMaxSteps = 10'000'000;
constexpr double kMaxBucketMb = 65536;

// The sweep's outputs: --csv and --chart, or their default names in the working directory;
// both empty without --sweep.
struct SweepPaths {
  std::string csv, chart;
};
SweepPaths sweep_paths(const Options& o) {
  if (o.sweep.empty()) return {};
  return {o.csv_path.empty() ? "dp_bench_sweep.csv" : o.csv_path,
          o.chart_path.empty() ? "dp_bench_sweep.svg" : o.chart_path};
}

// A bucket cap in MiB of at least one f32 gradient (a smaller one rounds to an empty bucket);
// runs after positive_number, so the text is a number.
CLI::Validator one_gradient_or_more() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const auto bytes = static_cast<int64_t>(std::stod(text) * (1 << 20));
        if (bytes >= 4) return "";
        std::ostringstream os;
        os << text << " MiB is " << bytes << " bytes, less than one f32 gradient: give at least "
           << 4.0 / (1 << 20) << " (4 bytes)";
        return os.str();
      },
      "");
}
}  // namespace

void add_flags(CLI::App& app, Options& o) {
  using dp::cli::whole_number;
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.add_option("--gpus", o.gpus,
                 "devices (DP) or ranks (DDP); default: all GPUs, or 4 CPU devices")
      ->check(whole_number(1, kMaxDevices));
  app.add_option("--device", o.device, "auto|cuda|cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  // A workload of the user's own trains DP, DDP and hybrid: the parameter server runs the
  // built-in models only, so its mode is not offered there.
  std::vector<std::string> modes = {"dp", "ddp", "both", "hybrid"};
  if (!o.workload) modes.push_back("ps");
  app.add_option("--mode", o.mode,
                 o.workload ? "dp|ddp|both, or hybrid (DP in each node, its device 0 joined across "
                              "nodes)"
                            : "dp|ddp|both, hybrid (DP in each node, its device 0 joined across "
                              "nodes), or ps (parameter server beside dp)")
      ->check(CLI::IsMember(modes));
  dp::cli::add_hybrid_procs_flag(app, o.hybrid_procs);
  app.add_option("--link-gbps", o.link_gbps,
                 "ddp/hybrid over several nodes: the link's measured rate in Gbit/s "
                 "(bench_collectives across the nodes); the report adds the bytes out of each "
                 "node per step and their time at that rate")
      ->check(dp::cli::number_in(0.001, 100000));
  app.add_option("--max-staleness", o.max_staleness,
                 "--mode ps: a worker waits while this many newer updates are outstanding "
                 "(-1: unbounded; 0: synchronous per update)")
      ->check(whole_number(-1, 1 << 20));
  app.add_flag("--staleness-lr", o.scale_lr, "--mode ps: each update's lr / (1 + staleness)");
  app.add_option("--model", o.model,
                 "mlp|cnn|resnet on 28x28 images, or gpt (GPT-2) or llama (the tiny Llama: "
                 "RMSNorm, SwiGLU, rotary attention) on tokens")
      ->check(CLI::IsMember({"mlp", "cnn", "resnet", "gpt", "llama"}));
  app.add_option("--gpt-config", o.gpt_config, "--model gpt: tiny|124m|350m (nn/gpt.hpp)")
      ->check(CLI::IsMember({"tiny", "124m", "350m"}));
  app.add_option("--seq", o.seq, "--model gpt or llama: tokens per sequence (default: the context)")
      ->check(whole_number(1, 1 << 20));
  app.add_option("--dropout", o.dropout,
                 "--model gpt: dropout p on embeddings, attention and residuals (GPT-2: 0.1)")
      ->check(dp::cli::number_in(0, 0.99));
  app.add_option(
         "--loss-chunk", o.loss_chunk,
         "--model gpt or llama: the chunked classifier's tokens per chunk: a step's chunk of more "
         "tokens than this runs the LM head, the loss and the head's backward this many "
         "tokens at a time, never holding the whole (B, T, vocab) logits (0: never; "
         "default: nn::GptConfig's and LlamaConfig's, 8192)")
      ->check(whole_number(0, int64_t{1} << 40));
  app.add_flag("--recompute", o.recompute,
               "--model gpt or llama: activation checkpointing of every transformer block (it "
               "keeps its input alone, and backward runs its forward again: less memory, one more "
               "forward per step; MFU counts the model's FLOPs alone)");
  app.add_option("--peak-tflops", o.peak_tflops,
                 "--model gpt or llama: the peak TFLOP/s per GPU (or of the CPU) that MFU divides "
                 "by "
                 "(default: the GPU's data sheet, else a GEMM measured at start)")
      ->check(dp::cli::positive_number(1e6));
  auto* b =
      app.add_option("--batch", o.batch, "global batch")->check(whole_number(1, dp::cli::kMaxRows));
  app.add_option("--batch-per-device", o.batch_per_device, "per-device batch (global = N x this)")
      ->check(whole_number(1, dp::cli::kMaxRows))
      ->excludes(b);
  app.add_option("--steps", o.steps, "timed steps")->check(whole_number(1, kMaxSteps));
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(whole_number(0, kMaxSteps));
  dp::cli::add_precision_flags(app, o.dtype, o.comm_dtype);
  dp::cli::add_activations_flag(app, o.activations);
  dp::cli::add_max_skip_fraction_flag(app, o.max_skip_fraction);
  app.add_option("--backend", o.backend, "DDP backend: auto|nccl|gloo|mpi (mpi: under mpirun)")
      ->check(CLI::IsMember({"auto", "nccl", "gloo", "mpi"}));
  app.add_option("--seed", o.seed, "model and data seed")
      ->check(whole_number(0, std::numeric_limits<int64_t>::max()));
  app.add_option("--json", o.json_path, "write the report as JSON")
      ->check(dp::cli::output_file(dp::cli::Output::report, dp::cli::OutputDir::or_checkpoint_dir));
  app.add_option("--trace", o.trace_path, "write a Chrome/Perfetto trace (one track per device)")
      ->check(dp::cli::output_file(dp::cli::Output::trace, dp::cli::OutputDir::or_checkpoint_dir));
  app.add_option("--sweep", o.sweep, "device counts to sweep, e.g. 1,2,4 (writes CSV + chart)")
      ->check(CLI::Validator(
          [](std::string& counts) {
            return counts.empty() ? std::string("the list is empty: give counts, e.g. 1,2,4")
                                  : std::string();
          },
          "COUNTS"));
  app.add_option("--csv", o.csv_path, "sweep CSV path (default dp_bench_sweep.csv)")
      ->check(dp::cli::output_file(dp::cli::Output::sweep_table));
  app.add_option("--chart", o.chart_path,
                 "sweep chart path, PNG or SVG (default dp_bench_sweep.svg)")
      ->check(dp::cli::output_file(dp::cli::Output::sweep_chart));
  app.add_option("--profile-steps", o.profile_steps,
                 "a:b brackets timed steps a..b with cudaProfilerStart/Stop (nsys "
                 "--capture-range=cudaProfilerApi)");
  app.add_option("--bucket-cap-mb", o.bucket_cap_mb, "DP and DDP gradient bucket cap in MiB")
      ->check(dp::cli::positive_number(kMaxBucketMb))
      ->check(one_gradient_or_more());
  app.add_option("--first-bucket-mb", o.first_bucket_mb, "DP and DDP first bucket cap in MiB")
      ->check(dp::cli::positive_number(kMaxBucketMb))
      ->check(one_gradient_or_more());
  app.add_option("--dp-reduce", o.dp_reduce,
                 "DP gradient reduction to device 0: star (each replica to device 0) or tree "
                 "(pairwise, log2 N rounds)")
      ->check(CLI::IsMember({"star", "tree"}));
  app.add_option("--dp-peer-reads", o.dp_peer_reads,
                 "DP: how device 0 (and the tree's inner devices) read a replica's gradient: in "
                 "place where they can (auto: one GPU, GPUs with peer access, CPU devices), or "
                 "copied into their own memory first (off: as NCCL_P2P_DISABLE, for peer links "
                 "that misbehave); the same sums either way")
      ->check(CLI::IsMember({"auto", "off"}));
  app.add_option("--cuda-graphs", o.cuda_graphs,
                 "DP and DDP: replay each step's captured work (auto: on for CUDA devices where "
                 "the step is capturable; on: also on CPU devices, which run the same interface)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--dp-graph-pulls", o.dp_graph_pulls,
                 "DP, graphed steps: device 0 sums the replicas' buckets after backward (after), "
                 "or beside it on a GPU (beside: each pull waits for events the captured "
                 "backward records; CPU devices sum after backward either way). The same sums")
      ->check(CLI::IsMember({"after", "beside"}));
  app.add_option("--ddp-graph-collectives", o.ddp_graph_collectives,
                 "DDP, graphed steps: the bucket all-reduces inside the captured backward, "
                 "overlapped with it, where the backend allows (auto: NCCL, and every backend on "
                 "CPU devices), or between the graphs, after backward (off)")
      ->check(CLI::IsMember({"auto", "off"}));
  app.add_option("--phase-times", o.phase_times,
                 "DP and DDP: time each step's phases (on), or mark them with events that only "
                 "order the work (off: cheaper on a GPU; the report then has the step time alone)")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--metrics-lag", o.metrics_lag,
                 "DP and DDP: 1 reads each step's metrics one step later, so the host queues the "
                 "next step while the devices run this one (needs --phase-times off, fp32 or "
                 "tf32, and for DP graphed steps)")
      ->check(CLI::Range(0, 1));
  dp::cli::add_micro_batches_flag(app, o.micro_batches, "DP, DDP and hybrid");
  app.add_option("--project-from", o.project_from,
                 "dp_bench JSON of a GPU run whose compute the NVLink/PCIe projection uses, or "
                 "off: no projection (on a GPU it runs one device again at the per-rank batches "
                 "of 4 and 8 devices)")
      ->check(CLI::IsMember({"off"}) | CLI::ExistingFile);
  dp::cli::add_launch_flags(app, o.launch);
  CLI::Option* checkpoint_dir = dp::cli::add_checkpoint_dir_flag(
      app, o.checkpoint_dir,
      "write the whole training state here (step_N.safetensors), every --save-every steps and "
      "at the end; created when missing, locked for the job; one run at a time (--mode dp|ddp "
      "--baseline 0)");
  app.add_option("--save-every", o.save_every, "steps between checkpoints (needs --checkpoint-dir)")
      ->check(whole_number(1, kMaxSteps));
  app.add_option("--keep", o.keep, "checkpoints to keep in --checkpoint-dir, newest first")
      ->check(whole_number(1, 1000))
      ->needs(checkpoint_dir);
  app.add_option("--resume", o.resume,
                 "resume from a training state file, or the newest whole one in --checkpoint-dir "
                 "(latest: damaged ones are skipped, named); same model, global batch and seed, "
                 "any --mode dp|ddp, --gpus and --zero (re-sharded, said so)");
  app.add_option("--timeout", o.timeout_s,
                 "DDP: seconds the rendezvous and each collective may take (default: DP_TIMEOUT, "
                 "else 60 s to rendezvous and 300 s per collective); also each collective of a "
                 "workload's comm hook under DP (default 300 s)")
      ->check(dp::cli::timeout_seconds(604800));
  app.add_flag("--sync-bn", o.sync_bn,
               "BatchNorm normalises with the whole batch's statistics, combined across devices "
               "(DP) and ranks (DDP); default: each its own chunk, as PyTorch");
  app.add_option("--optim", o.optim, "sgd (momentum 0.9) | adamw")
      ->check(CLI::IsMember({"sgd", "adamw"}));
  app.add_option("--zero", o.zero, "DDP: 1 shards the optimizer state across ranks (ZeRO-1)")
      ->check(whole_number(0, 1));
  app.add_flag("--zero-overlap", o.zero_overlap,
               "with --zero 1: the gradient meets through DDP's bucketed all-reduce while "
               "backward runs (--comm-dtype and a workload's hook apply), each rank steps its "
               "shard, then the shards are all-gathered: plain DDP's weights, 1/N of the state, "
               "1.5x the bytes; default: one reduce-scatter after backward");
  app.add_option("--baseline", o.baseline, "also run 1 device of each mode for speedup (1/0)")
      ->check(whole_number(0, 1));
  app.add_option("--repeat", o.repeat,
                 "run every mode and device count K times, interleaved (N=1, N, N=1, N, ...): "
                 "medians with 95% bootstrap CIs over the repeats")
      ->check(whole_number(1, 1000));
}

Setup resolve(const Options& o) {
  Setup s;
  std::string fallback;
  s.type = kernels::choose_device_type(o.device, &fallback);
  if (!fallback.empty() && !dp::dist::worker_env_from_environment())
    std::fprintf(stderr, "dp_bench: %s devices\n", fallback.c_str());
  s.physical = s.type == DeviceType::cuda ? kernels::cuda_device_count()
                                          : static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  s.gpus = o.gpus ? *o.gpus : (s.type == DeviceType::cuda ? s.physical : 4);
  s.precision = nn::parse_precision(o.dtype);
  s.math = nn::math_mode(s.precision);
  s.comm_dtype = dp::cli::comm_dtype(o.comm_dtype);
  s.activations = dp::cli::activations_dtype(o.activations, o.dtype);
  return s;
}

namespace {

// What a device holds for this run, measured: one step of 1 row and one of 2 rows, each on a
// fresh one-device engine on `device` (cpu:0, or cuda:0) with the run's model, precision and
// optimizer. The difference of their peaks is a row's activations and gradients in flight; the
// rest of the 1-row peak is the model's copies (parameters, gradients, buffers, and the 16-bit
// weights under mixed precision); the optimizer's state is counted apart (device 0 alone holds it
// in DP). The peaks are the tensors' bytes: what a caching allocator rounds up, and a library's
// own workspace, come on top, so a run this refuses cannot fit.
struct RowCost {
  dp::cli::StepMemory step;  // per row, and the rest (the model's copies)
  int64_t optimizer = 0;
};
// The probe's step on `device` (peak_of for measure_step_memory / probe_gpu0); `optimizer`
// receives the optimizer's state bytes.
std::function<int64_t(int64_t)> probe_step(const Options& o, const Setup& s, kernels::Device device,
                                           int64_t& optimizer) {
  return [&o, &s, device, &optimizer](int64_t rows) {
    nn::ModulePtr model = model_of(o);
    model->materialize(device, o.seed);
    if (s.activations != kernels::DType::f32) model->set_activations(nn::Activations::compute);
    std::unique_ptr<nn::Optimizer> opt = make_optimizer(o, *model);
    dp::DataParallelOptions dopt = dp_options(o, s);
    dopt.graphs = dp::Graphs::off;  // one eager step: what the run's first step allocates
    dopt.metrics_lag = 0;
    dopt.micro_batches = 1;  // the rows asked for in one pass (check_step divides the chunk)
    dopt.batch_norm = dp::BatchNormStats::per_device;
    dp::DataParallel engine(model, *opt, {device}, dopt);
    auto b = StepBatches(o, rows).at(0);
    engine.train_step(b.images, b.labels);
    optimizer = opt->state_bytes();  // counted apart: DP's device 0 alone holds it
    return engine.peak_memory_bytes()[0];
  };
}

}  // namespace

void validate(const Options& o, const Setup& s, const std::vector<int>& counts) {
  // Flags that would do nothing are refused, naming what they need.
  const int profile_last = profile_range(o).second;  // throws on a malformed --profile-steps
  DP_CHECK(profile_last < o.steps,
           "--profile-steps " << o.profile_steps << ": timed steps are 0 to " << o.steps - 1
                              << " (--steps " << o.steps << "); step " << profile_last
                              << " never runs, so the profiler would "
                                 "not stop where asked");
  DP_CHECK(profile_last < 0 || s.type == DeviceType::cuda,
           "--profile-steps " << o.profile_steps
                              << ": it brackets steps for a CUDA profiler (nsys "
                                 "--capture-range=cudaProfilerApi), and this run is on CPU "
                                 "devices, which no CUDA profiler sees; drop it, or run on a GPU");
  // One device reduces nothing and sends no gradient: DP's reduce flags would do nothing.
  const int most = counts.empty() ? 1 : *std::max_element(counts.begin(), counts.end());
  DP_CHECK(o.dp_reduce == "star" || most > 1,
           "--dp-reduce " << o.dp_reduce << " with --gpus " << most
                          << ": one device has no gradients to reduce; give --gpus 2 or more");
  DP_CHECK(s.comm_dtype == kernels::DType::f32 || o.mode != "dp" || most > 1,
           "--comm-dtype " << o.comm_dtype << " with --mode dp --gpus " << most
                           << ": one device sends no gradients; give --gpus 2 or more (DDP at one "
                              "rank rounds its bucket as a ring would: --mode ddp)");
  DP_CHECK(o.timeout_s <= 0 || o.mode != "dp" || (o.workload && o.workload->make_comm_hook),
           "--timeout with --mode dp: it bounds DDP's rendezvous and collectives (and a "
           "workload's comm hook under DP), and this DP run has none; give --mode ddp or both");
  DP_CHECK(!o.sweep.empty() || (o.csv_path.empty() && o.chart_path.empty()),
           (o.csv_path.empty() ? "--chart" : "--csv")
               << " writes the sweep's " << (o.csv_path.empty() ? "chart" : "table")
               << ": give --sweep too (e.g. --sweep 1,2,4)");
  if (!o.chart_path.empty()) {
    const std::string& c = o.chart_path;
    auto ends = [&](const std::string& e) {
      return c.size() > e.size() && c.compare(c.size() - e.size(), e.size(), e) == 0;
    };
    DP_CHECK(ends(".svg") || ends(".png"),
             "--chart " << c
                        << ": the chart is drawn as SVG or PNG, by the name's ending: give a .svg "
                           "or .png name");
  }
  if (projection_from(o.project_from) == ProjectionFrom::file)  // read now, not at the end
    check_projection_model(read_projection_file(o.project_from), o.project_from, model_name(o),
                           model_of(o)->num_parameters(), o.micro_batches);
  // The sweep's outputs, and the chart's script (written beside the chart and removed once
  // gnuplot drew it).
  const auto [csv, chart] = sweep_paths(o);
  if (!o.sweep.empty()) {
    dp::cli::check_output_file("--csv", csv, dp::cli::Output::sweep_table);
    dp::cli::check_output_file("--chart", chart, dp::cli::Output::sweep_chart);
    dp::cli::check_output_file("--chart", chart + ".gp", dp::cli::Output::gnuplot_script);
  }
  // No two outputs, and no output and the state resumed from, are one file; no output takes a
  // checkpoint's name.
  const std::vector<dp::cli::FlagPath> outputs = {
      {"--json", o.json_path},
      {"--trace", o.trace_path},
      {"--csv", csv},
      {"--chart", chart},
      {"--chart's script", chart.empty() ? "" : chart + ".gp"}};
  std::vector<dp::cli::FlagPath> files = outputs;
  if (o.resume != "latest") files.push_back({"--resume", o.resume});
  dp::cli::check_distinct_files(files);
  dp::cli::check_outside_checkpoints(outputs, o.checkpoint_dir);
  // A sample: its f32 values and an i32 label (the built-in data: 1x28x28 images), or the
  // workload's one row of inputs and targets.
  int64_t row_bytes = int64_t{28 * 28} * 4 + 4;
  if (o.workload && o.workload->make_batch) {
    const dp::data::Batch one = o.workload->make_batch(0, 1);
    row_bytes = one.images.nbytes() + one.labels.nbytes();
  } else if (o.workload) {
    row_bytes = dataset_of(o, 1)->sample_numel() * 4 + 4;
  }
  const int64_t steps = int64_t(o.steps) + o.warmup;
  const kernels::AvailableMemory host = kernels::host_memory_available();
  // Measured at the first CPU-device check, or the first DP check on CUDA devices.
  std::optional<RowCost> row_cost;
  bool gpu_probe_failed = false;
  const char* type = s.type == DeviceType::cuda ? "cuda" : "cpu";
  // The largest count first: its products are the largest.
  std::vector<int> largest_first = counts;
  std::sort(largest_first.rbegin(), largest_first.rend());
  for (const char* mode : {"dp", "ddp"}) {
    const bool ddp = mode[1] == 'd';
    // --mode ps runs threads (the DP checks), never DDP ranks.
    if ((ddp && (o.mode == "dp" || o.mode == "ps")) || (!ddp && o.mode == "ddp")) continue;
    for (int n : largest_first) {
      // DDP's global batch is split across the ranks of every node.
      const int world = ddp ? n * o.launch.nnodes : n;
      const std::string split =
          std::to_string(world) + (ddp ? " rank" : " device") + (world == 1 ? "" : "s");
      int64_t batch = o.batch;
      std::string flag = "--batch " + std::to_string(batch);
      if (o.batch_per_device) {
        batch = dp::cli::checked_product(*o.batch_per_device, "--batch-per-device", world,
                                         o.launch.nnodes > 1 && ddp ? "ranks" : "--gpus",
                                         dp::cli::kMaxRows);
        flag = "--batch-per-device " + std::to_string(*o.batch_per_device);
      }
      DP_CHECK(batch >= world, "--batch " << batch << " leaves some of the " << split
                                          << " without rows: give --batch >= " << world);
      if (ddp)
        dp::dist::check_local_ranks(n, o.launch.max_local_ranks);  // before the memory figures
      // Samples of the synthetic set: one global batch per step.
      dp::cli::checked_product(steps, "--steps + --warmup", batch, "the global batch",
                               std::numeric_limits<int64_t>::max());
      // The inputs alone, before any allocation: the host batch (assembled by every rank of
      // this node in DDP) and, on CPU devices, the chunks copied into the devices' memory.
      const int host_copies = (ddp ? n : 1) + (s.type == DeviceType::cpu ? 1 : 0);
      const int64_t batch_bytes = batch * row_bytes;  // batch <= 2^31: no overflow
      const std::string engine = std::string(ddp ? "DDP" : "DP") + " on " + split;
      dp::cli::check_fits(flag + " (" + engine + " (" + type + "): " + std::to_string(host_copies) +
                              " x " + std::to_string(batch) + " rows of " +
                              std::to_string(row_bytes) + " B for the input batches)",
                          batch_bytes * host_copies, "the host", host, "give a smaller batch");
      const int64_t chunk = (batch + world - 1) / world;
      // A device's activations: one micro-batch's (--micro-batches) at a time.
      const int64_t in_flight = (chunk + o.micro_batches - 1) / o.micro_batches;
      const std::string rows_text = dp::cli::held_rows_text(chunk, o.micro_batches);
      // The measured step on `holders` devices of one memory, each with a chunk: their model
      // copies and activations, and the optimizer's state (DP: device 0 steps alone).
      auto check_step = [&](const std::string& head, int64_t holders, const std::string& where,
                            const kernels::AvailableMemory& memory) {
        const int64_t rows_bytes = dp::cli::checked_product(
            in_flight, "rows per device", row_cost->step.per_row, "bytes per row",
            std::numeric_limits<int64_t>::max() / (4 * holders + 4));
        const int64_t optimizer_copies = ddp ? holders : 1;
        const int64_t need =
            holders * (row_cost->step.fixed + rows_bytes) + optimizer_copies * row_cost->optimizer;
        dp::cli::check_fits(flag + " (" + head + std::to_string(holders) + " x (" +
                                dp::cli::human_bytes(row_cost->step.fixed) + " of model copies + " +
                                rows_text + " x " + dp::cli::human_bytes(row_cost->step.per_row) +
                                " of activations, measured on a probe step) + " +
                                std::to_string(optimizer_copies) + " x " +
                                dp::cli::human_bytes(row_cost->optimizer) + " of optimizer state)",
                            need, where, memory, dp::cli::fits_advice(in_flight));
      };
      if (s.type == DeviceType::cpu) {
        // CPU devices hold their activations in the host's memory: what a run past it meets is
        // the kernel's OOM killer (rc 137, no message), so the step's needs are measured on a
        // probe step and refused here with the figures.
        if (!row_cost) {
          RowCost c;
          const auto notice = dp::cli::probe_notice("dp_bench", "cpu:0");
          c.step =
              dp::cli::measure_step_memory(probe_step(o, s, kernels::Device::cpu(0), c.optimizer));
          row_cost = c;
        }
        check_step(engine + " (cpu): ", world, "the host", host);
      }
      if (s.type == DeviceType::cuda) {
        // Logical devices share the physical GPUs round-robin: GPU 0 holds the most chunks.
        const int on_gpu0 = dp::cli::logical_on_gpu0(n, s.physical);
        const kernels::AvailableMemory gpu0 = kernels::gpu_memory(0);
        // DP runs in this process, which then holds a CUDA context anyway: its step is measured
        // on GPU 0 as a CPU device's is. A DDP launcher alone stays without one (its ranks have
        // theirs): it checks the input chunks only, unless DP measured the step already.
        if (!ddp && !row_cost && !gpu_probe_failed) {
          RowCost c;
          const std::optional<dp::cli::StepMemory> step =
              dp::cli::probe_gpu0("dp_bench", "checking the input batches alone",
                                  probe_step(o, s, kernels::Device::cuda(0), c.optimizer));
          if (step) {
            c.step = *step;
            row_cost = c;
          }
          gpu_probe_failed = !step;
        }
        if (row_cost)
          check_step(engine + " (cuda), on GPU 0: ", on_gpu0, "GPU 0", gpu0);
        else
          dp::cli::check_fits(flag + " (" + std::to_string(on_gpu0) + " chunk(s) of " +
                                  std::to_string(chunk) + " rows on GPU 0)",
                              chunk * row_bytes * on_gpu0, "GPU 0", gpu0, "give a smaller batch");
      }
    }
  }
}

int64_t global_batch(const Options& o, int n) {
  return o.batch_per_device ? *o.batch_per_device * n : o.batch;
}

nn::ModulePtr make_model(const std::string& name) {
  if (name == "mlp") return nn::mlp({784, 256, 256, 10});
  if (name == "cnn") return nn::lenet(1, 10);
  return nn::resnet(8, 1, 10);
}

kernels::SgdConfig optimizer_config() {
  kernels::SgdConfig c;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  return c;
}

nn::ModulePtr model_of(const Options& o) {
  return o.workload ? o.workload->make_model() : make_model(o.model);
}

std::string model_name(const Options& o) {
  return o.workload ? o.workload->name : o.model;
}

std::unique_ptr<dp::data::Dataset> dataset_of(const Options& o, int64_t batch) {
  DP_CHECK(!o.workload || o.workload->make_dataset,
           "workload '" << o.workload->name << "' has batches, not a data set (StepBatches)");
  if (!o.workload) return std::make_unique<dp::data::SyntheticDataset>(bench_dataset(o, batch));
  const int64_t samples = (o.steps + o.warmup) * batch;
  auto data = o.workload->make_dataset(samples);
  DP_CHECK(data && data->size() > 0, "workload '"
                                         << o.workload->name
                                         << "': its data set is empty; give samples to train on");
  return data;
}

dp::data::Batch step_batch(const dp::data::Dataset& data, int64_t step, int64_t batch) {
  const int64_t first = step * batch;
  if (first + batch <= data.size()) return dp::data::make_batch(data, first, batch);
  std::vector<int64_t> indices(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) indices[i] = (first + i) % data.size();
  return dp::data::make_batch(data, std::move(indices));
}

StepBatches::StepBatches(const Options& o, int64_t batch)
    : workload_(o.workload), batch_(batch), steps_(int64_t(o.steps) + o.warmup) {
  if (!workload_ || !workload_->make_batch) data_ = dataset_of(o, batch);
}

dp::data::Batch StepBatches::at(int64_t step) const {
  return data_ ? step_batch(*data_, step, batch_) : workload_->make_batch(step, batch_);
}

int64_t StepBatches::size() const {
  return data_ ? data_->size() : steps_ * batch_;
}

nn::LossPtr loss_of(const Options& o) {
  return o.workload ? o.workload->loss : nullptr;
}

void print_resume_report(const nn::Resumed& resumed, const nn::TrainingProgress& now) {
  for (const std::string& line : nn::resume_report(resumed, now))
    std::fprintf(stderr, "dp_bench: %s\n", line.c_str());
}

nn::TrainingProgress bench_state(const Options& o, const char* mode, int n) {
  nn::TrainingProgress st;
  st.mode = mode;
  st.world_size = n;
  st.optimizer_shards = o.zero == 1 && std::string(mode) == "ddp" ? n : 1;
  st.config = {{"program", "dp_bench"},
               {"model", model_name(o)},
               {"batch", std::to_string(global_batch(o, n))},
               {"seed", std::to_string(o.seed)},
               {"dtype", o.dtype}};
  return st;
}

std::unique_ptr<nn::Optimizer> make_optimizer(const Options& o, nn::Module& model) {
  if (o.workload && o.workload->make_optimizer) {
    std::unique_ptr<nn::Optimizer> opt = o.workload->make_optimizer(model);
    DP_CHECK(opt != nullptr,
             "workload '" << o.workload->name << "': make_optimizer returned no optimizer");
    return opt;
  }
  if (o.optim == "adamw") {
    kernels::AdamWConfig c;
    c.lr = 1e-3f;
    return std::make_unique<nn::AdamW>(model, c);
  }
  return std::make_unique<nn::SGD>(model, optimizer_config());
}

dp::data::SyntheticDataset bench_dataset(const Options& o, int64_t batch) {
  dp::data::SyntheticOptions so;
  so.signal = kBenchSignal;
  return dp::data::SyntheticDataset((o.steps + o.warmup) * batch, kernels::Shape{1, 28, 28}, 10,
                                    o.seed, so);
}

std::string gpu_name() {
  return kernels::gpu_name(0);
}

Header make_header(const Options& o, const Setup& s, int logical) {
  Header h;
  h.device = s.type == DeviceType::cuda ? gpu_name() : "cpu";
  h.physical = s.physical;
  h.logical = logical;
  h.model = model_name(o);
  h.params = model_of(o)->num_parameters();
  h.dtype = o.dtype;
  h.libraries = kernels::library_versions();
  if (kernels::built_with_cuda()) h.libraries.emplace_back("nccl", dp::dist::nccl_version());
  if (s.type == DeviceType::cpu) {
    const kernels::BlasKernels k = kernels::cpu_blas_kernels();
    h.cpu_gemm_kernels = k.core;
    h.cpu_gemm_chosen_over = k.switched_from;
    h.cpu_gemm_generic = k.generic;
    h.cpu_gemm_warning = k.warning;
    h.cpu_gemm_bf16 = k.bf16;
  } else {
    h.cuda_dgelu = kernels::cuda_dgelu_epilogue() ? "epilogue" : "ops";
  }
  if (o.workload && o.workload->flops_per_token > 0) {
    h.tokens_per_sample = o.workload->tokens_per_sample;
    h.flops_per_token = o.workload->flops_per_token;
    h.recompute_flops_per_token = o.workload->recompute_flops_per_token;
    if (o.peak_tflops) {
      h.peak_tflops = *o.peak_tflops;
      h.peak_source = "--peak-tflops";
    } else if (auto sheet = data_sheet_tflops(h.device, o.dtype)) {
      h.peak_tflops = *sheet;
      h.peak_source = "data sheet (" + h.device + ", " + o.dtype + ", dense)";
    } else {
      const kernels::Device dev = kernels::make_devices(s.type, 1)[0];
      h.peak_tflops = measured_gemm_tflops(dev, nn::compute_dtype(s.precision));
      h.peak_source = "measured: best of 5 GEMMs of 1024^3 on " + dev.str() + " in " + o.dtype;
    }
  }
  return h;
}

std::pair<int, int> profile_range(const Options& o) {
  if (o.profile_steps.empty()) return {-1, -1};
  int a = -1, b = -1;
  char c = 0;
  std::istringstream is(o.profile_steps);
  DP_CHECK((is >> a >> c >> b) && c == ':' && 0 <= a && a <= b && (is >> std::ws).eof(),
           "--profile-steps '" << o.profile_steps << "': expected a:b with 0 <= a <= b");
  return {a, b};
}

std::unique_ptr<dp::cli::ProgressLine> progress_line(const std::string& label, int total, int first,
                                                     bool shown) {
  auto line = std::make_unique<dp::cli::ProgressLine>(
      label, total, "steps", dp::cli::ProgressLine::Style::automatic, shown ? stderr : nullptr);
  line->start(first);
  return line;
}

std::unique_ptr<dp::cli::SlowNotice> build_notice(const Options& o, const std::string& run, int n,
                                                  bool shown) {
  return std::make_unique<dp::cli::SlowNotice>("dp_bench: building the " + model_name(o) +
                                                   " model and its engine for " + run +
                                                   " N=" + std::to_string(n),
                                               shown ? stderr : nullptr);
}

void file_lagged_losses(RunResult& r, float last) {
  if (r.losses.empty()) return;
  r.losses.erase(r.losses.begin());
  r.losses.push_back(last);
}

std::string attention_summary(const Options& o, const Setup& s, const kernels::AttentionReport& a) {
  if (o.model != "gpt" && o.model != "llama") return "";
  if (s.type == DeviceType::cpu) return "CPU kernels";
  if (s.precision == nn::Precision::fp32)
    return "plain f32 kernels (cuDNN's fused SDPA takes bf16 and fp16)";
  if (o.dropout > 0) return "plain kernels (attention dropout is not fused)";
  if (a.refused > 0)
    return std::string(a.fused > 0 ? "partly " : "") +
           "FELL BACK to the plain kernels: cuDNN refused " +
           (a.refusals.empty() ? std::string("a plan") : a.refusals.front()) + " (" +
           std::to_string(a.refused) + " of " + std::to_string(a.fused + a.refused) + " calls)";
  if (a.fused == 0) return "plain kernels (no call reached cuDNN: unaligned views)";
  return "cuDNN fused SDPA (" + std::to_string(a.fused) + " calls)";
}

void CaptureWatch::see(RunResult& r, int step, bool captured, int64_t allocations,
                       int64_t peak_bytes) {
  if (captured && r.capture_step < 0) {
    r.capture_step = step;
    r.capture_allocations = allocations;
    r.capture_peak_bytes = peak_bytes;
    r.eager_peak_bytes = last_peak;
  }
  last_peak = peak_bytes;
}

void ReplayCounts::report(RunResult& r) const {
  if (allocations.empty()) return;
  r.allocations_per_step = percentile(allocations, 0.5);
  r.host_syncs_per_step = percentile(host_syncs, 0.5);
  r.graph_nodes_per_step = percentile(graph_nodes, 0.5);
  r.casts_per_step = percentile(casts, 0.5);
}

dp::DataParallelOptions dp_options(const Options& o, const Setup& s) {
  dp::DataParallelOptions dopt;
  dopt.math = s.math;
  dopt.precision = s.precision;
  dopt.comm_dtype = s.comm_dtype;
  dopt.reduce = o.dp_reduce == "tree" ? dp::ReduceTopology::tree : dp::ReduceTopology::star;
  dopt.peer_reads = o.dp_peer_reads == "off" ? dp::PeerReads::off : dp::PeerReads::automatic;
  dopt.graph_pulls = o.dp_graph_pulls == "beside" ? dp::GraphPulls::beside : dp::GraphPulls::after;
  dopt.first_bucket_bytes = static_cast<int64_t>(o.first_bucket_mb * (1 << 20));
  dopt.bucket_cap_bytes = static_cast<int64_t>(o.bucket_cap_mb * (1 << 20));
  if (o.sync_bn) dopt.batch_norm = dp::BatchNormStats::synced;
  dopt.loss = loss_of(o);
  if (o.workload) dopt.clip_grad_norm = o.workload->clip_grad_norm;
  dopt.graphs = graphs_of(o);
  dopt.phase_timing = phase_timing_of(o);
  dopt.metrics_lag = o.metrics_lag;
  dopt.micro_batches = o.micro_batches;
  return dopt;
}

kernels::Event::Timing phase_timing_of(const Options& o) {
  return o.phase_times == "off" ? kernels::Event::Timing::off : kernels::Event::Timing::on;
}

std::chrono::milliseconds timeout_of(const Options& o) {
  return std::chrono::milliseconds(std::llround(o.timeout_s * 1000));
}

int micro_batches_run(int asked, int64_t batch, int nodes, int per_node) {
  const int64_t node_rows = (batch + nodes - 1) / nodes;  // balanced: the largest share
  const int64_t rows = (node_rows + per_node - 1) / per_node;
  return static_cast<int>(std::clamp<int64_t>(rows, 1, asked));
}

dp::Graphs graphs_of(const Options& o) {
  return o.cuda_graphs == "on"    ? dp::Graphs::on
         : o.cuda_graphs == "off" ? dp::Graphs::off
                                  : dp::Graphs::automatic;
}

void DpSteps::add(RunResult& r, const dp::StepStats& st, float loss_scale) {
  r.step_ms.push_back(st.ms.total);
  r.losses.push_back(st.loss);
  r.loss_scale = loss_scale;
  r.skipped_steps = st.skipped_steps;
  r.bytes_per_step = st.cross_node_bytes > 0 ? st.cross_node_bytes : st.bytes_moved;
  r.link_bytes = st.link_bytes;
  r.buckets = st.buckets;
  overlapped.push_back(st.buckets_overlapped);
  beside.push_back(st.pulls_beside_backward);
  replay.add(st.allocations, st.host_syncs, st.graph_nodes, st.casts);
  graphed += st.graphed;
  if (timing == kernels::Event::Timing::off) return;
  phases["scatter"].push_back(st.ms.scatter);
  phases["replicate"].push_back(st.ms.replicate);
  phases["forward"].push_back(st.ms.forward);
  phases["backward"].push_back(st.ms.backward);
  // Hybrid: device 0's reduce includes its wait for the sums over the nodes (finish_reduce
  // ends with it); shown apart as cross_node_exposed, so the two add up to the reduce, not
  // twice it. (The wait is host time, the reduce event time on a GPU: at most the whole.)
  const bool cross = st.cross_node_bytes > 0;
  const double cross_ms = cross ? std::min(st.ms.cross_node, st.ms.reduce) : 0;
  phases["reduce"].push_back(st.ms.reduce - cross_ms);
  phases["reduce_in_backward"].push_back(st.ms.reduce_in_backward);
  if (cross) phases["cross_node_exposed"].push_back(cross_ms);
  phases["optimizer"].push_back(st.ms.step);
}

const std::vector<std::string>& DpSteps::additive_phases() {
  // reduce_in_backward runs inside backward: shown, not subtracted.
  static const std::vector<std::string> names{
      "scatter", "replicate", "forward", "backward", "reduce", "cross_node_exposed", "optimizer"};
  return names;
}

void DpSteps::finish(RunResult& r) const {
  replay.report(r);
  r.graphed_steps = graphed;
  median_step_phases(r, phases, additive_phases());
  r.buckets_overlapped = static_cast<int>(std::lround(percentile(overlapped, 0.5)));
  r.pulls_beside_backward = static_cast<int>(std::lround(percentile(beside, 0.5)));
  r.final_loss = r.losses.empty() ? 0 : r.losses.back();
}

namespace {

// DP's bytes a step by the model (report.hpp's dp_bytes_theory), after the run: gradients travel
// in the comm dtype (half of P in bf16); a hook's bytes are its own choice, so the model counts
// the weights' copies alone. Under mixed precision device 0's optimizer writes the 16-bit
// weights, which the replicas copy with the f32 weights read outside them alone (dp::
// DataParallel::replicate; a composed layer's first forward may widen those, hence after).
int64_t dp_theory(nn::Module& model, const nn::Optimizer& opt, int n, kernels::DType comm,
                  bool hooked) {
  const nn::FlatState& flat = model.flat();
  const int64_t p = flat.params.nbytes();
  int64_t copy = 0, stale = 0;
  if (opt.writes_compute_copy() && flat.compute_params.defined()) {
    copy = flat.compute_params.nbytes();
    for (const auto& [name, q] : model.named_parameters())
      if (q->read_through_copy) stale += q->numel() * static_cast<int64_t>(sizeof(float));
  }
  return dp_bytes_theory(n, p, hooked ? 0 : p / 4 * static_cast<int64_t>(kernels::dtype_size(comm)),
                         copy, stale);
}

}  // namespace

RunResult run_dp(const Options& o, const Setup& s, int n, dp::Trace* trace,
                 const nn::CheckpointDirLock* lock, bool hooked) {
  int64_t batch = global_batch(o, n);
  const StepBatches data(o, batch);
  auto building = build_notice(o, hooked ? "dp-hook" : "dp", n);
  auto model = model_of(o);
  auto devices = kernels::make_devices(s.type, n);
  model->materialize(devices[0], o.seed);
  if (s.activations != kernels::DType::f32) model->set_activations(nn::Activations::compute);
  auto optimizer = make_optimizer(o, *model);
  nn::Optimizer& opt = *optimizer;
  dp::DataParallelOptions dopt = dp_options(o, s);
  if (hooked)  // its collectives bounded as DDP's (--timeout, else 300 s)
    dopt.reducers = dp::dist::device_reducers(
        n, [&](int) { return o.workload->make_comm_hook(); },
        o.timeout_s > 0 ? timeout_of(o) : std::chrono::milliseconds(std::chrono::seconds(300)));
  dp::DataParallel engine(model, opt, devices, dopt);
  building.reset();

  RunResult r;
  r.mode = hooked ? "dp-hook" : "dp";
  if (hooked) r.comm_hook = o.workload->make_comm_hook()->name();
  r.optim = o.optim;
  r.comm_dtype = o.comm_dtype;
  r.micro_batches = o.micro_batches;
  r.micro_batches_run = micro_batches_run(o.micro_batches, batch, 1, n);
  r.optimizer_state_bytes = {opt.state_bytes()};  // device 0 alone steps
  r.reduce = o.dp_reduce;
  r.peer_reads = o.dp_peer_reads;
  r.graph_pulls = o.dp_graph_pulls;
  if (o.sync_bn) r.sync_bn_values = nn::batch_norm_sync_values_per_step(*model);
  r.gpus = n;
  r.batch = batch;
  r.param_bytes = engine.parameter_bytes();
  DpSteps steps;
  steps.timing = phase_timing_of(o);
  auto [pa, pb] = profile_range(o);
  std::string label = r.mode + " N=" + std::to_string(n);
  nn::TrainingProgress state = bench_state(o, "dp", n);
  int first = 0;
  const nn::Resumed resumed =
      nn::resume_training_state(o.resume, o.checkpoint_dir, *model, opt, state);
  print_resume_report(resumed, state);
  if (const std::string& path = resumed.path; !path.empty()) {
    const nn::TrainingProgress& got = resumed.progress;
    if (auto msg = nn::nothing_left_to_train(got.step, o.warmup + o.steps, path,
                                             "give more --steps to train further")) {
      r.nothing_left = *msg;
      return r;
    }
    engine.set_rng_offsets(got.rng_offsets);
    if (got.scaler) engine.scaler().set_state(*got.scaler);
    first = static_cast<int>(got.step);  // < warmup + steps
  }
  auto save = [&](int step) {
    state.step = step;
    state.rng_offsets = engine.rng_offsets();
    if (engine.scaler().enabled()) state.scaler = engine.scaler().state();
    engine.drain();  // metrics_lag 1: the last step's update may still be running
    nn::save_checkpoint_in(*lock, o.keep, *model, opt, state);
  };
  auto bar = progress_line(label, o.warmup + o.steps, first);
  CaptureWatch capture;
  for (int step = first; step < o.warmup + o.steps; ++step) {
    int timed = step - o.warmup;
    auto b = data.at(step);
    if (timed == pa) kernels::profiler_start();
    if (timed == 0) engine.set_trace(trace);
    dp::StepStats st = engine.train_step(b.images, b.labels);
    if (timed == pb) kernels::profiler_stop();
    capture.see(r, step, st.captured, st.allocations, st.peak_bytes);
    if (o.save_every && (step + 1) % *o.save_every == 0) save(step + 1);
    bar->update(step + 1);
    if (timed < 0) continue;
    steps.add(r, st, engine.scaler().scale());
  }
  if (o.metrics_lag > 0) file_lagged_losses(r, engine.finish_metrics().loss);
  if (!o.checkpoint_dir.empty()) save(o.warmup + o.steps);  // the end of the run
  engine.set_trace(nullptr);
  steps.finish(r);
  r.bytes_theory = dp_theory(*model, opt, n, s.comm_dtype, hooked);
  r.graphs_fallback = engine.graphs_fallback();
  r.attention = attention_summary(o, s, engine.attention_report());
  r.peak_mem_bytes = engine.peak_memory_bytes();
  return r;
}

namespace {

std::vector<int> sweep_counts(const Options& o, const Setup& s) {
  std::vector<int> counts;
  if (!o.sweep.empty()) {
    std::stringstream ss(o.sweep);
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      long v = std::strtol(item.c_str(), &end, 10);
      DP_CHECK(end && *end == '\0' && v >= 1 && v <= 64,
               "--sweep '" << o.sweep << "': '" << item << "' is not a count in [1, 64]");
      DP_CHECK(std::find(counts.begin(), counts.end(), v) == counts.end(),
               "--sweep '" << o.sweep << "': " << v << " is given twice: give each count once");
      counts.push_back(static_cast<int>(v));
    }
    const int largest = *std::max_element(counts.begin(), counts.end());
    DP_CHECK(!o.gpus || *o.gpus == largest,
             "--gpus " << *o.gpus << " with --sweep " << o.sweep
                       << ": the sweep's counts are the device counts (the largest is " << largest
                       << "); drop --gpus");
    return counts;
  }
  if (o.baseline && s.gpus > 1) counts.push_back(1);
  counts.push_back(s.gpus);
  return counts;
}

void write_chart(const Options& o, const std::string& note) {
  const auto [csv, chart] = sweep_paths(o);
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("chart: skipped (gnuplot is not installed); the CSV is %s\n", csv.c_str());
    return;
  }
  bool png = chart.size() > 4 && chart.substr(chart.size() - 4) == ".png";
  std::string script = chart + ".gp";
  std::ostringstream gp;
  gp << "set terminal " << (png ? "pngcairo size 900,500" : "svg size 900,500") << "\n"
     << "set output '" << chart << "'\nset datafile separator ','\n"
     << "set termoption noenhanced\n"
     << "set title \"dp_bench: samples/s against device count" << (note.empty() ? "" : "\\n")
     << note << "\"\n"
     << "set xlabel 'devices (N)'\nset ylabel 'samples/s'\nset key outside right\nset grid\n"
     << "set xtics 1\nset yrange [0:*]\n"
     << "plot '" << csv << "' using 2:(strcol(1) eq 'dp' ? $6 : 1/0) with linespoints title 'DP', '"
     << csv << "' using 2:(strcol(1) eq 'ddp' ? $6 : 1/0) with linespoints title 'DDP'\n";
  dp::cli::write_output("--chart", script, gp.str());
  int rc = std::system(("gnuplot '" + script + "' 2>/dev/null").c_str());
  std::remove(script.c_str());
  if (rc == 0)
    std::printf("chart: %s\n", chart.c_str());
  else
    std::printf("chart: gnuplot failed (exit %d); the CSV is %s\n", rc, csv.c_str());
}

}  // namespace

// The flags a rank started by torchrun, mpirun or Slurm cannot honour: the launcher set the
// ranks (DDP: --gpus, if given, is the ranks on this node; hybrid: each node process's
// devices), and rank 0 prints the report alone (no trace, sweep or chart). Our own launcher's
// workers are given the flags it checked.
void check_external_rank(const Options& o, const dp::dist::WorkerEnv& env) {
  const std::string by =
      "a rank started by " + env.source + " (" + std::to_string(env.world_size) + " ranks)";
  DP_CHECK(o.mode == "ddp" || o.mode == "hybrid",
           "--mode " << o.mode << " in " << by
                     << ": only --mode ddp runs that way (DDP's ranks are "
                     << "the launcher's processes); run DP, both and ps without a launcher");
  DP_CHECK(o.sweep.empty() && o.trace_path.empty(),
           (o.sweep.empty() ? "--trace" : "--sweep")
               << " in " << by
               << ": sweeps and traces are made by dp_bench's own launcher; run dp_bench --mode "
                  "ddp without torchrun, mpirun or srun");
  DP_CHECK(o.mode != "ddp" || !o.gpus || *o.gpus == env.local_world_size,
           "--gpus " << *o.gpus << " in " << by << " with " << env.local_world_size
                     << " on this node: the launcher sets the ranks; drop --gpus or make it "
                     << env.local_world_size);
  DP_CHECK(o.launch.nnodes == 1 && o.launch.node_rank == 0 && o.launch.master_port == 0,
           "--nnodes/--node-rank/--master-port in "
               << by << ": the launcher sets the nodes and the address (MASTER_ADDR, MASTER_PORT)");
}

int run(const Options& o, int argc, char** argv) {
  (void)kernels::cuda_dgelu_epilogue();  // a bad DP_CUDA_DGELU refused before any work
  if (const auto env = dp::dist::worker_env_from_environment()) {
    if (!std::getenv("DP_BENCH_DDP_RESULT_FD")) check_external_rank(o, *env);  // not ours
    return o.mode == "hybrid" ? hybrid_worker_main(o) : ddp_worker_main(o, argc, argv);
  }
  DP_CHECK(o.hybrid_procs == 0 || o.mode == "hybrid",
           "--hybrid-procs " << o.hybrid_procs << " with --mode " << o.mode
                             << ": only --mode hybrid starts node processes");
  DP_CHECK(o.link_gbps == 0 || o.mode == "hybrid" || (o.mode == "ddp" && o.launch.nnodes > 1),
           "--link-gbps " << o.link_gbps << " with --mode " << o.mode << " on " << o.launch.nnodes
                          << " node(s): nothing crosses a link between nodes; give --mode ddp "
                             "with --nnodes > 1, or --mode hybrid");
  // Flags that only one mode reads are refused with the others, not ignored.
  DP_CHECK(o.zero == 0 || o.mode == "ddp" || o.mode == "both",
           "--zero " << o.zero << " with --mode " << o.mode
                     << ": ZeRO-1 shards DDP's optimizer state; give --mode ddp or both");
  DP_CHECK(!o.zero_overlap || o.zero == 1,
           "--zero-overlap without --zero 1: it says how ZeRO-1's gradient meets; add --zero 1");
  DP_CHECK(o.dp_peer_reads == "auto" || o.mode == "dp" || o.mode == "both" || o.mode == "hybrid",
           "--dp-peer-reads " << o.dp_peer_reads << " with --mode " << o.mode
                              << ": it sets how DP's reduce reads the replicas; give --mode dp, "
                                 "both or hybrid");
  DP_CHECK(o.dp_graph_pulls == "after" || o.mode == "dp" || o.mode == "both",
           "--dp-graph-pulls " << o.dp_graph_pulls << " with --mode " << o.mode
                               << ": it places DP's sums in a graphed step; give --mode dp or "
                                  "both");
  DP_CHECK(o.ddp_graph_collectives == "auto" || o.mode == "ddp" || o.mode == "both",
           "--ddp-graph-collectives " << o.ddp_graph_collectives << " with --mode " << o.mode
                                      << ": it places DDP's bucket all-reduces; give --mode ddp "
                                         "or both");
  DP_CHECK(o.dp_reduce == "star" || o.mode == "dp" || o.mode == "both" || o.mode == "hybrid",
           "--dp-reduce " << o.dp_reduce << " with --mode " << o.mode
                          << ": it sets DP's reduce to device 0; give --mode dp, both or hybrid");
  DP_CHECK((o.max_staleness == -1 && !o.scale_lr) || o.mode == "ps",
           (o.scale_lr ? "--staleness-lr" : "--max-staleness " + std::to_string(o.max_staleness))
               << " with --mode " << o.mode
               << ": it sets the parameter server's workers; give --mode ps");
  DP_CHECK(o.mode != "ps" || (o.sweep.empty() && o.repeat == 1),
           (o.sweep.empty() ? "--repeat " + std::to_string(o.repeat) : "--sweep " + o.sweep)
               << " with --mode ps: the parameter server's run is timed once against its DP "
                  "curve; give --mode dp, ddp or both");
  // Of the built-in models only the ResNet has BatchNorm layers (make_model); a workload's
  // model is its own.
  // Hybrid's DP engines would combine statistics within a node only (DataParallel refuses it
  // once the nodes have started): refused here, before any work.
  DP_CHECK(
      !o.sync_bn || (o.mode != "ps" && o.mode != "hybrid" && (o.workload || o.model == "resnet")),
      "--sync-bn with " << (o.mode == "ps" ? "--mode ps: the parameter server's workers step alone"
                            : o.mode == "hybrid"
                                ? "--mode hybrid: its devices would combine BatchNorm "
                                  "statistics within their node only"
                                : "--model " + o.model + ": the model has no BatchNorm")
                        << "; give --model resnet with --mode dp, ddp or both");
  if (o.sync_bn && o.workload) {
    nn::ModulePtr model = o.workload->make_model();  // unmaterialised: its layers only
    DP_CHECK(nn::batch_norm_sync_values_per_step(*model) > 0,
             "--sync-bn with the workload " << o.workload->name
                                            << ": its model has no BatchNorm layer, so there is "
                                               "nothing to sync; drop --sync-bn");
  }
  DP_CHECK(!o.launch.max_local_ranks || o.mode == "ddp" || o.mode == "both" || o.mode == "hybrid",
           "--max-local-ranks " << *o.launch.max_local_ranks << " with --mode " << o.mode
                                << ": it bounds the processes a launcher starts on this node; "
                                   "give --mode ddp, both or hybrid");
  dp::cli::check_max_skip_fraction(o.max_skip_fraction, o.dtype);
  DP_CHECK(o.backend != "mpi" || o.mode == "ddp",
           "--backend mpi with --mode " << o.mode
                                        << ": MPI carries DDP's collectives, and only --mode ddp "
                                           "runs under mpirun");
  if (o.mode == "ddp" || o.mode == "both")
    dp::dist::check_launchable(o.backend, "dp_bench",
                               (o.gpus ? *o.gpus : 4) * std::max(1, o.launch.nnodes));
  if (o.mode == "hybrid")
    dp::dist::check_launchable(o.backend, "dp_bench", hybrid_procs(o) * o.launch.nnodes);
  DP_CHECK(!o.workload || o.mode != "ps",
           "--mode ps: the parameter server runs dp_bench's built-in models only; give --mode "
           "dp, ddp or both for "
               << o.workload->name);
  Setup s = resolve(o);
  if (o.mode == "ddp" || o.mode == "both")  // said once, before any rank starts
    dp::dist::check_backend_devices(o.backend, s.type, s.gpus);
  if (o.launch.nnodes > 1) {
    DP_CHECK(o.mode == "ddp" || o.mode == "hybrid",
             "--nnodes " << o.launch.nnodes
                         << ": only --mode ddp and hybrid span nodes (DP is one process by "
                            "definition)");
    DP_CHECK(
        o.launch.master_port > 0 && o.sweep.empty(),
        "--nnodes " << o.launch.nnodes << ": give --master-addr/--master-port, and no --sweep");
    DP_CHECK(o.launch.node_rank < o.launch.nnodes,
             "--node-rank " << o.launch.node_rank << " is not in [0, " << o.launch.nnodes << ")");
  }
  if (!o.checkpoint_dir.empty() || !o.resume.empty()) {
    DP_CHECK(
        (o.mode == "dp" || o.mode == "ddp") && o.sweep.empty() && (o.baseline == 0 || s.gpus == 1),
        "--checkpoint-dir/--resume: one run at a time: give --mode dp or ddp, --baseline 0 "
        "and no --sweep");
    DP_CHECK(o.repeat == 1, "--repeat " << o.repeat
                                        << " with --checkpoint-dir/--resume: a training state "
                                           "belongs to one run; give --repeat 1");
    DP_CHECK(o.resume != "latest" || !o.checkpoint_dir.empty(),
             "--resume latest needs --checkpoint-dir (where to look)");
    // A file of another program, model, batch or dtype is refused here, from its header, before
    // a model is built or DDP's ranks start (each would refuse it).
    if (!o.resume.empty() && o.resume != "latest") {
      const int world = o.mode == "ddp" ? s.gpus * std::max(1, o.launch.nnodes) : s.gpus;
      nn::check_training_state_settings(o.resume, bench_state(o, o.mode.c_str(), world).config);
    }
  }
  DP_CHECK(!o.save_every || !o.checkpoint_dir.empty(),
           "--save-every needs --checkpoint-dir (where to write)");
  if (o.launch.max_restarts > 0) {
    DP_CHECK(o.mode == "ddp" || o.mode == "both",
             "--max-restarts " << o.launch.max_restarts
                               << ": only DDP (--mode ddp or both) has worker "
                               << "processes to restart");
    dp::dist::check_restarts_allowed(o.launch.max_restarts, o.launch.nnodes, o.launch.master_port);
  }
  if (o.micro_batches > 1) {
    DP_CHECK(o.mode != "ps", "--micro-batches "
                                 << o.micro_batches
                                 << " with --mode ps: the parameter server's workers "
                                    "step alone; give --mode dp, ddp, both or hybrid");
    DP_CHECK(!o.sync_bn, "--micro-batches " << o.micro_batches
                                            << " with --sync-bn: SyncBatchNorm exchanges "
                                               "statistics at each forward; give one of them");
  }
  if (o.metrics_lag > 0) {
    DP_CHECK(o.mode == "dp" || o.mode == "ddp" || o.mode == "both",
             "--metrics-lag 1 with --mode " << o.mode << ": DP and DDP only");
    DP_CHECK(o.phase_times == "off",
             "--metrics-lag 1 needs --phase-times off: a step's phase marks are not reached "
             "when it returns");
    DP_CHECK(o.dtype == "fp32" || o.dtype == "tf32",
             "--metrics-lag 1 with --dtype " << o.dtype
                                             << ": the loss scaler's verdict on a step decides "
                                                "the next one; use fp32 or tf32");
    DP_CHECK(o.mode == "ddp" || o.cuda_graphs == "on" ||
                 (o.cuda_graphs == "auto" && s.type != kernels::DeviceType::cpu),
             "--metrics-lag 1 needs graphed DP steps: --cuda-graphs on (auto is off on CPU "
             "devices)");
  }
  DP_CHECK(o.dp_graph_pulls == "after" || o.cuda_graphs == "on" ||
               (o.cuda_graphs == "auto" && s.type != kernels::DeviceType::cpu),
           "--dp-graph-pulls beside places the sums of graphed DP steps, and this run's are not "
           "graphed: add --cuda-graphs on (auto is off on CPU devices)");
  DP_CHECK(o.phase_times == "on" || o.trace_path.empty(),
           "--trace with --phase-times off: a trace is made of the timed phases");
  DP_CHECK(o.cuda_graphs != "on" || o.mode == "dp" || o.mode == "ddp" || o.mode == "both",
           "--cuda-graphs on with --mode "
               << o.mode
               << ": graphed steps are DP's and DDP's (--mode dp, ddp or both); hybrid "
                  "and the parameter server run uncaptured");
  const bool low_precision = nn::compute_dtype(s.precision) != kernels::DType::f32;
  DP_CHECK(o.zero == 0 || o.zero_overlap || s.comm_dtype == kernels::DType::f32 || o.mode == "dp",
           "--zero 1 with --comm-dtype "
               << o.comm_dtype
               << ": ZeRO-1's reduce_scatter and all_gather run in f32 (bf16 communication is for "
                  "the bucketed all-reduce: add --zero-overlap)");
  DP_CHECK(!(low_precision || s.comm_dtype != kernels::DType::f32) || o.mode != "ps",
           "--mode ps with --dtype " << o.dtype << " --comm-dtype " << o.comm_dtype
                                     << ": the parameter server trains and sends f32 only");
  std::vector<int> counts = o.launch.nnodes > 1 ? std::vector<int>{s.gpus} : sweep_counts(o, s);
  validate(o, s, counts);
  if (o.mode == "ps") return run_ps_mode(o, s);
  int max_n = *std::max_element(counts.begin(), counts.end());
  if (s.type == DeviceType::cuda)
    dp::warn_if_oversubscribed(kernels::make_devices(DeviceType::cuda, max_n));
  bool want_dp = o.mode == "dp" || o.mode == "both", want_ddp = o.mode == "ddp" || o.mode == "both";
  bool want_hybrid = o.mode == "hybrid";
  // The workload's comm hook trains beside DP ("dp-hook": in place of the sums to device 0),
  // DDP ("hook") and hybrid, for its sums over nodes ("hybrid-hook"), where nothing it cannot
  // take is asked for.
  const bool has_hook = o.workload && o.workload->make_comm_hook;
  bool want_dp_hook = want_dp && has_hook && o.launch.nnodes == 1;
  bool want_hook = want_ddp && has_hook, want_hybrid_hook = want_hybrid && has_hook;
  if (want_dp_hook || want_hook || want_hybrid_hook) {
    std::string why;
    if (s.comm_dtype != kernels::DType::f32)
      why = "--comm-dtype " + o.comm_dtype +
            " (a hook is handed f32 buckets and chooses what travels)";
    else if (o.zero != 0 && !o.zero_overlap)
      why =
          "--zero 1 without --zero-overlap (ZeRO-1 reduce-scatters the gradient, it hands no "
          "bucket to a hook)";
    else if (!o.checkpoint_dir.empty() || !o.resume.empty())
      why = "checkpoints (the hook's rows would share DDP's folder)";
    if (!why.empty()) {
      std::fprintf(stderr, "dp_bench: the comm hook's rows are not run with %s\n", why.c_str());
      want_dp_hook = want_hook = want_hybrid_hook = false;
    } else if (want_dp_hook && o.metrics_lag > 0) {
      std::fprintf(stderr,
                   "dp_bench: the comm hook's DP rows are not run with --metrics-lag 1 (a "
                   "hook's steps run uncaptured, and a lagged DP step needs graphs)\n");
      want_dp_hook = false;
    }
  }
  bool tracing = !o.trace_path.empty();
  // One job per checkpoint folder, for the whole run (DDP workers see it held by this process).
  std::optional<nn::CheckpointDirLock> lock;
  if (!o.checkpoint_dir.empty() && o.launch.node_rank == 0)
    lock.emplace(o.checkpoint_dir, "dp_bench");

  // Every (mode, N) run, K times, interleaved so that drift of the machine hits all alike. Each
  // repeat's median step is one sample of the run's confidence interval; the rest of the
  // figures are the median repeat's (combine_repeats). The trace is the first repeat's.
  std::vector<std::vector<RunResult>> repeats;  // per (mode, N), its repeats in order
  std::vector<dp::TracedRun> traces;
  bool other_node = false;
  for (int k = 0; k < o.repeat; ++k) {
    size_t slot = 0;
    for (const std::string mode : {"dp", "dp-hook", "ddp", "hook", "hybrid", "hybrid-hook"}) {
      if ((mode == "dp" && !want_dp) || (mode == "dp-hook" && !want_dp_hook) ||
          (mode == "ddp" && !want_ddp) || (mode == "hook" && !want_hook) ||
          (mode == "hybrid" && !want_hybrid) || (mode == "hybrid-hook" && !want_hybrid_hook))
        continue;
      for (int n : counts) {
        // A hybrid node process trains on --gpus devices whatever the count: one run (a second
        // at the baseline's count would repeat the same N).
        if ((mode == "hybrid" || mode == "hybrid-hook") && n != counts.back()) continue;
        dp::Trace trace;
        const bool trace_this = tracing && k == 0;
        dp::Trace* t = trace_this ? &trace : nullptr;
        const bool hooked = mode == "dp-hook" || mode == "hook" || mode == "hybrid-hook";
        std::optional<RunResult> got =
            mode == "dp" || mode == "dp-hook" ? run_dp(o, s, n, t, lock ? &*lock : nullptr, hooked)
            : mode == "ddp" || mode == "hook" ? run_ddp(o, s, n, argc, argv, t, hooked)
                                              : run_hybrid(o, s, n, argc, argv, t, hooked);
        if (!got) {  // this node's ranks ran; node 0 has the figures
          other_node = true;
          continue;
        }
        RunResult r = std::move(*got);
        if (!r.nothing_left.empty()) {  // a resumed run with no step left: no report of zeros
          std::printf("dp_bench: %s\n", r.nothing_left.c_str());
          dp::cli::check_stdout("dp_bench");
          return 0;
        }
        if (!isatty(fileno(stderr)))
          std::fprintf(stderr, "dp_bench: %s N=%d%s: %.3f ms/step, final loss %.6f\n", mode.c_str(),
                       r.gpus, o.repeat > 1 ? (" repeat " + std::to_string(k + 1)).c_str() : "",
                       median(r.step_ms), r.final_loss);
        if (trace_this) {
          dp::TracedRun run{mode + " N=" + std::to_string(r.gpus), trace.events(), {}};
          if (mode == "ddp" || mode == "hook")  // one process per rank: tracks are ranks
            for (const dp::TraceEvent& e : run.events)
              run.track_names.emplace(
                  e.track,
                  e.track >= dp::kCommTrackBase
                      ? "rank " + std::to_string(e.track - dp::kCommTrackBase) + " comm stream"
                      : "rank " + std::to_string(e.track));
          traces.push_back(std::move(run));
        }
        if (k == 0) repeats.emplace_back();
        repeats[slot].push_back(std::move(r));
        ++slot;
      }
    }
  }
  std::vector<RunResult> runs;
  for (std::vector<RunResult>& each : repeats) runs.push_back(combine_repeats(std::move(each)));
  if (other_node) {
    std::printf("dp_bench: node %d ran its %d ranks; node 0 prints the report\n",
                o.launch.node_rank, s.gpus);
    return 0;
  }

  // The projection's per-rank compute: one device at the per-rank batch of N = 4 and 8, host
  // time included. Only where the projection uses this machine's compute (a GPU).
  std::vector<RunResult> compute_runs;
  if (s.type == DeviceType::cuda &&
      projection_from(o.project_from) == ProjectionFrom::this_machine && !runs.empty()) {
    for (int n : {4, 8}) {
      Options per_rank = o;
      per_rank.batch = (runs[0].batch + n - 1) / n;
      per_rank.batch_per_device.reset();
      per_rank.checkpoint_dir.clear();
      per_rank.resume.clear();
      per_rank.save_every.reset();
      compute_runs.push_back(run_dp(per_rank, s, 1, nullptr));
    }
  }
  // The most devices a run used at once: a hybrid run's node processes each hold --gpus.
  int logical = max_n;
  for (const RunResult& r : runs) logical = std::max(logical, r.gpus);
  Header h = make_header(o, s, logical);
  ProjectionInput projection = projection_input(h, runs, o.project_from, compute_runs);
  print_table(std::cout, h, runs);
  print_memory_model(std::cout, runs);
  print_sync_bn(std::cout, runs);
  print_projection(std::cout, projection);
  // The nodes a run spans: DDP's launchers, or hybrid's node processes on every launcher.
  const int nodes = o.mode == "hybrid" ? hybrid_procs(o) * o.launch.nnodes : o.launch.nnodes;
  const std::vector<LinkTime> link = link_times(runs, nodes, o.link_gbps);
  print_link_times(std::cout, link, nodes, o.link_gbps);

  if (!o.json_path.empty()) {
    nlohmann::json j = to_json(h, runs, projection);
    if (!link.empty()) j["link"] = link_times_json(link, nodes, o.link_gbps);
    dp::cli::write_output("--json", o.json_path, j.dump(2) + "\n");
    std::printf("json: %s\n", o.json_path.c_str());
  }
  if (tracing) {
    dp::write_chrome_trace(o.trace_path, traces, "--trace");
    std::printf("trace: %s (open in ui.perfetto.dev or chrome://tracing)\n", o.trace_path.c_str());
  }
  if (!o.sweep.empty()) {
    const std::string csv = sweep_paths(o).csv;
    std::ostringstream table;
    write_sweep_csv(table, h, runs);
    dp::cli::write_output("--csv", csv, table.str());
    std::printf("sweep: %s\n", csv.c_str());
    std::string note;
    if (h.device == "cpu")
      note = "(CPU devices sharing cores: engine overhead, not scaling)";
    else if (oversubscribed(h))
      note = "(logical GPUs sharing one: engine overhead, not scaling)";
    write_chart(o, note);
  }
  // After the report and its files: a mixed-precision run that skipped too many steps warns
  // (over 5%) or fails (over --max-skip-fraction), naming the run.
  for (const RunResult& r : runs) {
    const int64_t steps = int64_t(o.warmup) + o.steps;  // skipped_steps counts warm-up too
    try {
      if (std::string warning =
              nn::check_skipped_steps(r.skipped_steps, steps, o.max_skip_fraction);
          !warning.empty())
        std::fprintf(stderr, "dp_bench: %s N=%d: %s\n", r.mode.c_str(), r.gpus, warning.c_str());
    } catch (const kernels::Error& e) {
      DP_THROW(r.mode << " N=" << r.gpus << ": " << e.what());
    }
  }
  dp::cli::check_stdout("dp_bench");
  return 0;
}

}  // namespace bench
