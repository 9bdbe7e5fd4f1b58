// dp_bench's flags and runs, shared by its main and its DDP worker processes.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "benchmarks/report.hpp"
#include "dp/cli/progress.hpp"
#include "dp/data/loader.hpp"
#include "dp/data/synthetic.hpp"
#include "dp/data_parallel.hpp"
#include "dp/distributed/comm_hook.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/trace.hpp"
#include "kernels/ops.hpp"
#include "nn/amp.hpp"
#include "nn/loss.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"
#include "nn/train_state.hpp"

namespace bench {

// What to train: a model, its data and its loss. dp_bench's built-in ones are --model's (mlp,
// cnn, resnet) on synthetic 28x28 images and --model gpt on synthetic tokens
// (benchmarks/gpt_workload.hpp); a research user passes their own (samples/
// compare_my_model.cpp). The default loss is softmax cross-entropy over the data set's classes.
struct Workload {
  std::string name;  // in the report and the checkpoint config
  // A fresh, unmaterialised model; the runs materialise it from --seed, on every device alike.
  std::function<nn::ModulePtr()> make_model;
  // A data set of at least `samples` samples (fewer are used modulo their count): the global
  // batch of step s is samples [s B, (s+1) B).
  std::function<std::unique_ptr<dp::data::Dataset>(int64_t samples)> make_dataset;
  // In place of make_dataset, for inputs that are not images and labels (token ids): the global
  // batch of step `step` of `batch` rows as host tensors (inputs, targets), the same for every
  // mode and device count. `images` and `labels` are then those two; `indices` is unused.
  std::function<dp::data::Batch(int64_t step, int64_t batch)> make_batch;
  nn::LossPtr loss;  // null: softmax cross-entropy
  // The run's own recipe, so that the comparison measures the user's training and not a stand-in:
  // the optimizer (with its parameter groups) made on each mode's model (null: --optim's SGD or
  // AdamW; --optim is then refused), and the global gradient norm clipped to (0: no clipping).
  std::function<std::unique_ptr<nn::Optimizer>(nn::Module&)> make_optimizer;
  float clip_grad_norm = 0.f;
  std::string optimizer_name = "custom";  // in the report, with make_optimizer
  // Language models: tokens per sample and training FLOPs per token, for tokens/s and MFU.
  int64_t tokens_per_sample = 0;
  double flops_per_token = 0;
  // FLOPs per token the hardware does beyond flops_per_token: checkpointed blocks' forward run
  // again in backward (--recompute). The report's HFU counts them, MFU does not.
  double recompute_flops_per_token = 0;
  // A reducer of the user's: a DDP communication hook (dp/distributed/comm_hook.hpp), made on
  // each rank. --mode ddp and both then also train DDP with it, as "hook" rows beside DDP's
  // (its bytes handed to the group, step time and loss against the built-in all-reduce's).
  // Null: none.
  std::function<std::shared_ptr<dp::dist::CommHook>()> make_comm_hook;
};

struct Options {
  std::optional<int> gpus;  // unset: all visible GPUs, or 4 CPU devices
  std::string device = "auto";
  std::string mode = "both";
  std::string model = "mlp";
  std::string gpt_config = "tiny";  // --model gpt: nn::GptConfig::preset
  std::optional<int64_t> seq;       // --model gpt: tokens per sequence (default: the context)
  float dropout = 0;                // --model gpt: GPT-2's dropout p (embeddings, residuals)
  bool recompute = false;  // --model gpt or llama: every block checkpointed (set_recompute)
  // --model gpt or llama: tokens per chunk of the chunked classifier (nn::GptConfig::
  // loss_chunk, 0: never); unset: the model's default.
  std::optional<int64_t> loss_chunk;
  std::optional<double> peak_tflops;  // MFU's peak per GPU (or the CPU); unset: found
  int64_t batch = 256;
  std::optional<int64_t> batch_per_device;  // set: the global batch is N x this
  int steps = 30;
  int warmup = 5;
  std::string dtype = "fp32";       // fp32|tf32|bf16|fp16 (nn/amp.hpp)
  std::string comm_dtype = "fp32";  // fp32|bf16: the dtype gradients travel in
  std::string activations = "f32";  // f32|bf16: the dtype activations travel in between layers
  std::string backend = "auto";
  uint64_t seed = 1;
  std::string json_path, trace_path, sweep, csv_path, chart_path, profile_steps;
  int baseline = 1;      // also run N=1 of each mode for speedup (0 to skip)
  double link_gbps = 0;  // > 0: the report adds what crosses between nodes and its time
  int hybrid_procs = 0;  // --mode hybrid: node processes started here (0: see hybrid_procs())
  int repeat = 1;        // interleaved repeats of every run, for confidence intervals
  std::optional<double> max_skip_fraction;  // mixed precision: more skipped steps is an error
  double bucket_cap_mb = 25, first_bucket_mb = 1;  // DP and DDP buckets (PyTorch's defaults)
  std::string dp_reduce = "star";                  // DP: star|tree
  std::string dp_peer_reads = "auto";              // DP: auto|off (dp::PeerReads)
  std::string dp_graph_pulls = "after";            // DP: after|beside (dp::GraphPulls)
  std::string cuda_graphs = "auto";                // DP, DDP: auto|on|off (dp::Graphs)
  std::string ddp_graph_collectives = "auto";      // DDP: auto|off (set_graph_collectives)
  std::string phase_times = "on";                  // DP, DDP: on|off (timing events or not)
  int metrics_lag = 0;                             // DP: 0|1 (DataParallelOptions::metrics_lag)
  int micro_batches = 1;     // DP, DDP, hybrid: per device or rank and step (gradient accumulation)
  std::string project_from;  // GPU results file for the projection
  // DDP across nodes: every node runs dp_bench with the same flags and its own --node-rank.
  // DDP launch flags (dp::cli::add_launch_flags); nproc_per_node is set per run.
  dp::dist::LaunchOptions launch;
  double timeout_s = 0;  // DDP rendezvous and collectives; 0: DP_TIMEOUT or the defaults
  // Training state: saved every save_every steps and at the end into checkpoint_dir (the newest
  // `keep` kept), resumed from a file or "latest" there. One run at a time.
  std::string checkpoint_dir, resume;
  std::optional<int> save_every;
  int keep = 3;
  std::string optim = "sgd";  // sgd (momentum 0.9) or adamw
  int zero = 0;               // DDP: 1 shards the optimizer state (ZeRO stage 1)
  bool zero_overlap = false;  // ZeRO-1's gradient through DDP's buckets, beside backward
  // --mode ps: bounded staleness (-1: unbounded), and lr / (1 + staleness) per update.
  bool sync_bn = false;  // BatchNorm statistics combined across devices (DP) and ranks (DDP)
  int max_staleness = -1;
  bool scale_lr = false;
  // Set by compare() for a user's workload; null: --model's built-in model and synthetic data.
  std::shared_ptr<const Workload> workload;
};

// dp_bench prints the message and exits with `exit_code` after this: the DDP launcher's own
// code when its ranks failed (the last attempt's under --max-restarts, as torchrun), 130 or 143
// when it was stopped by SIGINT or SIGTERM.
struct RunFailed : kernels::Error {
  RunFailed(const std::string& what, int code) : kernels::Error(what), exit_code(code) {}
  int exit_code;
};

// The resolved device type and counts of a run.
struct Setup {
  kernels::DeviceType type = kernels::DeviceType::cpu;
  int physical = 0;  // GPUs, or cores for CPU devices
  int gpus = 1;
  kernels::MathMode math = kernels::MathMode::strict;
  nn::Precision precision = nn::Precision::fp32;
  kernels::DType comm_dtype = kernels::DType::f32;
  kernels::DType activations = kernels::DType::f32;  // bf16: nn::Activations::compute
};

void add_flags(CLI::App& app, Options& o);
Setup resolve(const Options& o);
// Checks what each flag alone cannot (products, batches against device counts, default output
// paths, memory for the batches), before any work. Throws kernels::Error saying what is wrong
// and what is allowed.
void validate(const Options& o, const Setup& s, const std::vector<int>& counts);
int64_t global_batch(const Options& o, int n);
nn::ModulePtr make_model(const std::string& name);
// The run's model (the workload's, or --model's) and its name; its data set for `batch` rows
// per step (sized for warm-up and timed steps); the global batch of step `step`.
nn::ModulePtr model_of(const Options& o);
std::string model_name(const Options& o);
std::unique_ptr<dp::data::Dataset> dataset_of(const Options& o, int64_t batch);
dp::data::Batch step_batch(const dp::data::Dataset& data, int64_t step, int64_t batch);
// The global batches of a run: the data set's samples, or the workload's make_batch.
class StepBatches {
 public:
  StepBatches(const Options& o, int64_t batch);
  dp::data::Batch at(int64_t step) const;
  // The samples behind the batches (make_batch: every step's fresh, so steps x batch).
  int64_t size() const;

 private:
  std::shared_ptr<const Workload> workload_;
  std::unique_ptr<dp::data::Dataset> data_;
  int64_t batch_, steps_;
};
// The run's loss: the workload's, or null (the engines' softmax cross-entropy).
nn::LossPtr loss_of(const Options& o);
kernels::SgdConfig optimizer_config();
// What a checkpoint of this run records and must match on resume: the mode, the world size,
// and the model, batch and seed.
nn::TrainingProgress bench_state(const Options& o, const char* mode, int n);
// Prints on stderr what nn::resume_report says: checkpoints skipped, what was re-sharded.
void print_resume_report(const nn::Resumed& resumed, const nn::TrainingProgress& now);
// The run's optimizer (--optim) on `model`.
std::unique_ptr<nn::Optimizer> make_optimizer(const Options& o, nn::Module& model);
// The DP engine's options from the flags (math, precision, comm dtype, topology, buckets).
dp::DataParallelOptions dp_options(const Options& o, const Setup& s);
// The most micro-batches a device or rank runs (RunResult::micro_batches_run): --micro-batches,
// but no more than the rows of the largest chunk, when `batch` rows are split over `nodes`
// groups (hybrid's node processes; 1 otherwise) of `per_node` devices or ranks each.
int micro_batches_run(int asked, int64_t batch, int nodes, int per_node);
// --cuda-graphs as dp::Graphs (DP and DDP).
dp::Graphs graphs_of(const Options& o);
// --phase-times as the timing of the engines' phase marks (DP and DDP).
kernels::Event::Timing phase_timing_of(const Options& o);
// --timeout in milliseconds (0: not given, the library's default).
std::chrono::milliseconds timeout_of(const Options& o);
// Prototype scale of the benchmark's synthetic data: hard enough that the loss falls over the
// default 35 steps instead of collapsing to zero in ten (torch_ref/ref_common.py mirrors it).
constexpr float kBenchSignal = 0.12f;
// The synthetic data set: the global batch of step s is samples [s B, (s+1) B) for every mode
// and device count, so all runs follow one loss curve.
dp::data::SyntheticDataset bench_dataset(const Options& o, int64_t batch);
std::pair<int, int> profile_range(const Options& o);
// --metrics-lag 1: each timed step reported the loss of the step before it. Files every loss
// under its own step: drops the first, appends `last` (the engine's finish_metrics()).
void file_lagged_losses(RunResult& r, float last);
// The runtime's counts of each timed step (allocations, host syncs, graph nodes replayed, dtype
// casts), reported as the run's medians (RunResult::allocations_per_step, host_syncs_per_step,
// graph_nodes_per_step, casts_per_step).
struct ReplayCounts {
  std::vector<double> allocations, host_syncs, graph_nodes, casts;
  void add(int64_t step_allocations, int64_t step_host_syncs, int64_t step_graph_nodes,
           int64_t step_casts) {
    allocations.push_back(static_cast<double>(step_allocations));
    host_syncs.push_back(static_cast<double>(step_host_syncs));
    graph_nodes.push_back(static_cast<double>(step_graph_nodes));
    casts.push_back(static_cast<double>(step_casts));
  }
  void report(RunResult& r) const;
};
// What a run's attention ran on, for the report: "" for models without attention, else the
// backend's kernels and, on CUDA, whether cuDNN's fused SDPA ran or why not (f32, dropout, or
// cuDNN's refusal).
std::string attention_summary(const Options& o, const Setup& s, const kernels::AttentionReport& a);
// Every step's memory, warm-up included: the first step that captured is the run's capture
// (RunResult::capture_*), measured against the eager step before it.
struct CaptureWatch {
  int64_t last_peak = 0;  // the step before's
  void see(RunResult& r, int step, bool captured, int64_t allocations, int64_t peak_bytes);
};
// The figures of a DP engine's timed steps (plain DP, or one node of a hybrid run): added step by
// step, and their medians written into the run's result at the end.
struct DpSteps {
  std::map<std::string, std::vector<double>> phases;
  ReplayCounts replay;
  std::vector<double> overlapped, beside;  // per step: buckets overlapped, pulls beside backward
  int graphed = 0;                         // steps that ran graphed
  // off (--phase-times off): the steps' phases were not timed, and none are reported.
  kernels::Event::Timing timing = kernels::Event::Timing::on;
  // Hybrid steps report the bytes across nodes (in-node links: RunResult::link_bytes).
  void add(RunResult& r, const dp::StepStats& st, float loss_scale);
  // Sets the run's figures from its steps, the phases those of its median step
  // (median_step_phases): call again after replacing r.step_ms (a hybrid run's slowest node).
  void finish(RunResult& r) const;
  // The phases that follow one another within a DP step.
  static const std::vector<std::string>& additive_phases();
};
// A run's progress line (dp/cli/progress.hpp): redrawn with rate and ETA on a terminal, plain
// lines every 10 s otherwise; its clock starts now, at step `first` (a resumed run's), so a
// first step of minutes is reported when it ends. Prints nothing unless `shown` (rank 0's).
std::unique_ptr<dp::cli::ProgressLine> progress_line(const std::string& label, int total,
                                                     int first = 0, bool shown = true);
// Said when building a run's model and engine (weights made, copied to the devices or
// broadcast to the ranks) takes 5 s or more (dp/cli/progress.hpp's SlowNotice): "dp_bench:
// building the gpt model and its engine for dp N=4". Nothing unless `shown` (rank 0's).
std::unique_ptr<dp::cli::SlowNotice> build_notice(const Options& o, const std::string& run, int n,
                                                  bool shown = true);
std::string gpu_name();
// The workload's tokens and FLOPs per token, and for those the peak MFU divides by:
// --peak-tflops, else the GPU's data sheet in the run's dtype, else a GEMM measured here.
Header make_header(const Options& o, const Setup& s, int logical);

// `lock`: the --checkpoint-dir lock this process holds (null without --checkpoint-dir). hooked:
// the "dp-hook" run, the workload's comm hook (Workload::make_comm_hook, one per device) in
// place of the sums to device 0 (DataParallelOptions::reducers).
RunResult run_dp(const Options& o, const Setup& s, int n, dp::Trace* trace,
                 const nn::CheckpointDirLock* lock = nullptr, bool hooked = false);
// Runs what the options ask for and prints the report (or, in a DDP worker process, trains its
// rank). Returns the exit code.
int run(const Options& o, int argc, char** argv);

}  // namespace bench
