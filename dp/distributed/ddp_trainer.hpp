// DdpTrainer: what a DDP worker process does each step, shared by dp_bench and the samples.
//
//   if (auto rc = dp::dist::launch_if_parent(opts, argc, argv)) return *rc;  // the launcher
//   dp::dist::DdpTrainer t(kernels::DeviceType::cpu, "auto");                // a worker
//   model->materialize(t.device(), seed); nn::SGD opt(*model, cfg); t.wrap(model, opt);
//   float loss = t.train_step(global_images, global_labels);  // every rank passes the SAME batch
//
// Rank r trains on the r-th chunk of each global batch (dp/chunks.hpp: the rows DP gives
// device r), scaled by its share, so DDP follows the same loss curve as DP and as one device.
#pragma once

#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/distributed/config_check.hpp"
#include "dp/distributed/ddp.hpp"
#include "dp/distributed/launcher.hpp"
#include "dp/distributed/process_group.hpp"
#include "dp/distributed/zero.hpp"
#include "dp/graphs.hpp"
#include "dp/step.hpp"
#include "dp/step_metrics.hpp"
#include "dp/step_stages.hpp"
#include "kernels/runtime/event.hpp"
#include "nn/amp.hpp"
#include "nn/loss.hpp"
#include "nn/optim.hpp"
#include "nn/train_state.hpp"

namespace dp::dist {

struct DdpTrainerOptions {
  std::string backend = "auto";  // mpi is refused: its ranks come from mpirun
  LaunchOptions launch;          // launch.nproc_per_node: ranks on this node
  // The ranks' --device ("auto", "cpu" or "cuda"): checked against the backend before any rank
  // starts (check_backend_devices). Empty: not checked here.
  std::string device;
};

// In a process started as a worker (RANK etc. set, by us, torchrun, mpirun or Slurm): nullopt,
// go on as a worker. Otherwise: runs options.launch.nproc_per_node workers of this program with the
// same arguments, waits for them, and returns the launcher's exit code.
std::optional<int> launch_if_parent(const DdpTrainerOptions& options, int argc, char** argv);

// Milliseconds of the phases of the last step on this rank.
struct DdpStepTimes {
  double forward = 0, backward = 0, allreduce_wait = 0, optimizer = 0, total = 0;
  // Counted by the runtime on this rank's context during the step: memory taken from the
  // device (0 once the shape's blocks are cached) and host waits or reads (1: the metrics).
  int64_t allocations = 0, host_syncs = 0;
  // Dtype conversions the step's work performed on the rank's context (a replayed step: its
  // graphs' casts, kernels::Graph::casts): the same for graphed and uncaptured steps.
  int64_t casts = 0;
  bool graphed = false;   // captured graphs ran this step's work (replayed)
  bool captured = false;  // this step captured its shape's graphs (then replayed them)
  // The most memory in use on the rank's context during the step (tensors, not cached blocks).
  int64_t peak_bytes = 0;
  int64_t graph_nodes = 0;      // then: its graphs' nodes (CUDA: kernels, copies; CPU: ops)
  bool metrics_lagged = false;  // the step returned the previous step's loss (metrics_lag 1)
};

class DdpTrainer {
 public:
  // Joins the group described by the environment (throws naming what is missing). The rank's
  // device is cuda:LOCAL_RANK (logical: several may share a GPU) or cpu:LOCAL_RANK, with its
  // context bound to this thread for the trainer's life. `timeout` bounds the rendezvous and
  // each collective (0: DP_TIMEOUT, else the defaults of init_process_group).
  DdpTrainer(kernels::DeviceType type, const std::string& backend, DdpOptions ddp = {},
             std::chrono::milliseconds timeout = {});
  ~DdpTrainer();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const WorkerEnv& env() const { return env_; }
  kernels::Device device() const { return device_; }
  ProcessGroup& group() { return *group_; }
  DistributedDataParallel& ddp() { return *ddp_; }
  // The ZeRO-1 stage when on, else nullptr.
  const ZeroStage1* zero() const { return zero_.get(); }

  // ZeRO: 0 (off: every rank keeps the whole optimizer state) or 1 (dp/distributed/zero.hpp:
  // state sharded, reduce_scatter + all_gather instead of the bucketed all-reduce).
  // requires 0 or 1, called before wrap().
  void set_zero_stage(int stage);
  // ZeRO-1 overlapped (zero.hpp): the gradient meets through DDP's bucketed all-reduce while
  // backward runs (its comm dtype and comm hook too), every rank steps its shard of the whole
  // reduced gradient, then the shards are all-gathered: plain DDP's weights bit for bit with
  // 1/N of the optimizer state; graphed where DDP's step is (the all-gather after the graphs).
  // Off: one reduce-scatter after backward. Call before wrap(); takes effect with stage 1.
  void set_zero_overlap(bool on);
  bool zero_overlapped() const { return zero_ && zero_overlap_; }
  // ZeRO-1 in its own exchange after backward (reduce-scatter, shard step, all-gather).
  bool zero_reduce_scatters() const { return zero_ && !zero_overlap_; }
  // SyncBatchNorm: the model's BatchNorm layers normalise with the statistics of every rank's
  // rows (dp/distributed/sync_batch_norm.hpp). Off by default (each rank its own rows, as
  // PyTorch's BatchNorm under DDP). Call before wrap().
  void set_sync_batch_norm(bool on);
  // Mixed precision (nn/amp.hpp): the model's GEMMs and convolutions run in bf16/fp16, and the
  // GradScaler checks the all-reduced gradient, the same bytes on every rank, so every rank
  // takes or skips the same step (under ZeRO-1 the ranks combine their shards' verdicts).
  // `scaler` overrides GradScaler::options_for(p). Call before wrap().
  void set_precision(nn::Precision p, std::optional<nn::GradScalerOptions> scaler = {});
  // The program's run configuration (program, mode, model, batch, steps, seed, ...: what every
  // rank must agree on), verified across ranks by wrap(). Call before wrap().
  void set_run_config(RunConfig fields);
  // Gradient accumulation (dp/step.hpp, MicroBatches): each rank runs its chunk of a step as k
  // micro-batches (fewer when the chunk has fewer rows), one after another, under no_sync but the
  // last, whose backward all-reduces the summed gradient as one pass's would; the update runs once
  // per step. The rank holds one micro-batch's activations at a time and follows the loss curve
  // of one pass over the global batch (within f32 rounding). Graphed steps capture the whole loop.
  // last_times().forward covers every micro-batch but the last one's backward too. requires
  // k >= 1; 1 with SyncBatchNorm (its ranks exchange statistics at each forward). Call before
  // wrap(): the ranks verify it there.
  void set_micro_batches(int k);
  // The loss each rank computes on its chunk (nn/loss.hpp; default row cross-entropy). Each
  // rank's gradient is weighted by its chunk's share of the batch's loss denominator. Call
  // before wrap().
  void set_loss(nn::LossPtr loss);
  // > 0: the all-reduced gradient (the same on every rank) is clipped to this global 2-norm
  // before the step; under ZeRO-1 from one all-reduce of the shards' squared norms. 0: off.
  // Call before wrap().
  void set_clip_grad_norm(float max_norm);
  // Graphed steps (dp/graphs.hpp; default automatic: on for CUDA devices). Per step shape, a
  // captured graph holds zero_grad, forward, the loss, backward and the buckets' scaling, and a
  // second graph the clip, the scaler's check and the optimizer step. The bucket all-reduces:
  //  - inside the first graph, launched from backward's hooks and overlapped with it as in
  //    uncaptured steps, where the group can hold collectives in a capture (NCCL; every backend
  //    on CPU devices, whose graphs record them) and set_graph_collectives(true) (default);
  //  - else between the two graphs, after backward (the overlap is given up).
  // A shape's first two steps run uncaptured, the third captures. Bitwise the results of graphs
  // off. The loss scale, the rank's share and dropout's offsets are read on the device (each
  // replay uses its step's). Not capturable, run uncaptured with one line saying why: ZeRO-1,
  // SyncBatchNorm. Call before wrap().
  void set_graphs(Graphs mode);
  // false: a graphed step's bucket all-reduces run between its two graphs even where a graph
  // could hold them (for a backend whose captured collectives misbehave, and to compare).
  // Call before wrap().
  void set_graph_collectives(bool allowed);
  // Whether graphed steps hold the bucket all-reduces in their graph (valid after wrap()).
  bool collectives_in_graph() const;
  // Whether each step's phases are timed (last_times(): forward, backward, allreduce_wait,
  // optimizer; default on). off: the step's marks are events without a timestamp (cheaper to
  // record on a GPU) and last_times() holds the total, allocations and host syncs alone. Call
  // before wrap().
  void set_phase_timing(kernels::Event::Timing timing);
  // 1: train_step does not wait for its step's metrics: it queues their all-reduce and read
  // and returns the previous step's loss (NaN on the first step; last_grad_norm() the previous
  // step's too), so the host can queue step k + 1 while the device runs step k. finish_metrics()
  // gives the last step's. 0 (default): each step returns its own. Refused (at train_step, with
  // the reason) with a loss scaler's check (bf16, fp16: its verdict decides the next step) and
  // timed phases (the marks are not reached when the step returns). ZeRO-1 takes it too: its
  // clip and verdict stay on the device (ZeroStage1::queue_step). requires 0 or 1, called
  // before wrap().
  void set_metrics_lag(int lag);
  // metrics_lag 1: waits for the last step's metrics; returns its loss (its norm:
  // last_grad_norm()). requires a lagged step since the last call.
  float finish_metrics();
  // The global gradient norm of the last step, before clipping (0 with clipping off).
  float last_grad_norm() const { return grad_norm_; }
  // requires model materialised on device(); optimizer built on it.
  // First the ranks prove they agree (config_check.hpp): the run configuration plus the fields
  // the engine adds ("engine.*": world size, backend, parameter count, shapes and their hash,
  // the bucket plan, ZeRO, SyncBN, precision, comm dtype, the optimizer with its learning rate
  // and settings (SGD's momentum, dampening, weight decay and Nesterov; AdamW's betas, eps and
  // weight decay), the clip, the loss, metrics lag and graphs) are exchanged out of band, bounded
  // by the rendezvous timeout, and any difference throws on every rank naming the field and the
  // ranks. Then rank 0's weights are broadcast.
  void wrap(nn::ModulePtr model, nn::Optimizer& optimizer);
  // The fields wrap() verified: the run configuration and the engine's (empty before wrap()).
  const RunConfig& verified_config() const { return verified_config_; }
  // One step on this rank's chunk of the global host batch. Returns the global mean loss.
  // requires at least world_size() rows, so that every rank has one (a loader pads a short
  // last batch with LoaderOptions::pad_last_batch_to = world_size(), or drops it), and the
  // same global batch size on every rank: the loss's all-reduce carries it, and a rank whose
  // batch is not the ranks' mean throws (with metrics_lag 1, at the next step).
  // A step that throws after those first checks (a bad label in this rank's chunk, a failed
  // collective) leaves the trainer failed: every later train_step throws, naming the first
  // error. Its peers may be inside this step's collectives; a rank that went on would pair its
  // next step's with them, and the ranks would train on each other's gradients of other steps.
  float train_step(const kernels::Tensor& images, const kernels::Tensor& labels);
  // Rows of the global batch whose argmax equals the label (each rank counts its chunk).
  int64_t count_correct(const kernels::Tensor& images, const kernels::Tensor& labels);
  // Every rank's `value`, in rank order (a collective: every rank calls it).
  std::vector<uint64_t> all_gather(uint64_t value);
  // Every rank's `values` (as many on each), rank after rank: rank r's j-th at r * size + j.
  std::vector<uint64_t> all_gather(const std::vector<uint64_t>& values);
  const DdpStepTimes& last_times() const { return times_; }
  // Why graphs went off by themselves: empty, or "capture failed on rank R (DEVICE): ..." once
  // a capture failed (the work was not capturable). That step ran uncaptured (its results are
  // the uncaptured step's; one "ddp: graphs off: capture failed" line) and so does every later
  // one. A capture that only lacked cached memory is captured again at the shape's next step, up
  // to three times (DataParallel::graphs_fallback). Or "rank R (DEVICE): the comm hook 'NAME'
  // read GradBucket::share on the host while the step was captured ...": research code's
  // capturable hook baked the share in, and a later step of the shape had another (dp::dist::
  // HostShare); that step and every later one ran uncaptured.
  const std::string& graphs_fallback() const { return graphs_fallback_; }
  // What this rank's attention calls ran so far (kernels::attention_report).
  kernels::AttentionReport attention_report() { return kernels::attention_report(*context_); }
  // Bytes the last train_step handed to the process group (ProcessGroup::payload_bytes):
  // gradient buckets in the comm dtype, averaged buffers, SyncBN statistics, ZeRO-1's
  // reduce_scatter and all_gather. The reported loss's all-reduce, after the step, is not in it.
  int64_t last_payload_bytes() const { return last_payload_bytes_; }
  nn::GradScaler& scaler() { return scaler_; }
  // The whole training state, as DataParallel::save: every rank's dropout offset is gathered
  // and rank 0 writes `path` (the others' `path` is not used; load() reads it on every rank, so
  // across nodes it lies on a file system they share); a failed write throws on every rank.
  // Under ZeRO-1 every rank's shard of the optimizer state is gathered first: the file holds it
  // whole, as an unsharded run's, and loads into any world size, sharded or not. Collectives:
  // every rank calls them.
  // requires wrap() done.
  void save(const std::string& path, const nn::TrainingProgress& position = {});
  // Every rank reads `path` (each its own dropout offset; under ZeRO-1 its shard of the
  // optimizer state; the world size may differ); refuses another model or optimizer, naming
  // what differs; throws on every rank when one rank could not load or the
  // ranks loaded different states. metrics_lag 1: a pending step's metrics are dropped
  // (finish_metrics() first keeps them). Returns the saved position. A collective.
  nn::TrainingProgress load(const std::string& path, const nn::TrainingProgress& expected = {});
  // nn::resume_training_state on every rank (`resume` a file, "latest" in `dir`, or "" for
  // none), into the wrapped model and optimizer; then, as load(), every rank fails when one
  // could not load or the ranks picked different states ("latest" may differ per node).
  // Returns what this rank loaded. A collective.
  nn::Resumed resume(const std::string& resume, const std::string& dir,
                     const nn::TrainingProgress& expected);

 private:
  // After each rank loaded a state itself with `path` and `step` ("" and 0: none) or failed
  // (`failed`, rethrown here): throws on every rank, naming the rank, unless every rank loaded
  // and all hold the same step and weights. A collective.
  void agree_on_loaded_state(const std::string& path, int64_t step, std::exception_ptr failed);
  // `progress` with this run's mode ("ddp") and world size.
  nn::TrainingProgress here(const nn::TrainingProgress& progress) const;
  // The fields wrap() adds to the run configuration ("engine.*").
  RunConfig engine_config(nn::Module& model, nn::Optimizer& optimizer) const;
  // Queues this step's 1 / scale and scale into scale_values_ (nothing when they are there).
  void write_scale();
  // The global batch's mean loss from this rank's chunk loss (metrics_[0]) and share, and
  // whether the gradient was finite (metrics_[1]): one small all-reduce and the step's one read,
  // which also brings the ranks' summed batch sizes (metrics_[2], checked against `rows`) and
  // the gradient norm (metrics_[3], clipping on).
  float report_loss(float share, int64_t rows);
  // Scales `metrics` (4) loss by this rank's share, writes `rows` (this rank's global batch)
  // and starts the all-reduce of the loss, the verdict and the rows; null at world size 1.
  std::shared_ptr<Work> reduce_metrics(kernels::Tensor& metrics, float share, int64_t rows);
  // Throws unless the ranks' summed global batches are world_size() x `rows`.
  void check_same_batch(float summed_rows, int64_t rows) const;
  // metrics_lag 1: the same all-reduce on a copy of the step's metrics in a slot of their own,
  // its read queued; then waits for this step's input copy (the caller may refill the host
  // batch), which follows the previous step's read, and returns that step's loss (NaN on a
  // run's first step), with its gradient norm in grad_norm_.
  float report_loss_lagged(float share, int64_t rows);
  // metrics_lag 1: with a step's metrics, their copy on the device (6 values: metrics_, then the
  // context's fault word) and, world > 1, their all-reduce (waited when the slot is read).
  struct LaggedExtra {
    kernels::Tensor device;
    std::shared_ptr<Work> work;
    int64_t rows = 0;  // the step's global batch, checked against the ranks' sum
  };
  using LaggedSlot = LaggedSlots<LaggedExtra>::Slot;
  // Whether the host already waited for a point after the slot's read.
  enum class Waited { no, yes };
  // A lagged slot's loss (and norm into grad_norm_), after waiting for its read (unless waited).
  float take_lagged(LaggedSlot& slot, Waited waited);
  // Throws when the slot take_lagged read last held a device-side fault: the context's report.
  void report_lagged_fault();
  // This rank's rows of the global host batch (views), and with `share` its share of the
  // batch's loss denominator; requires labels valid for the loss.
  std::pair<kernels::Tensor, kernels::Tensor> slice_chunk(const kernels::Tensor& images,
                                                          const kernels::Tensor& labels,
                                                          float* share);
  // slice_chunk, copied into the rank's input buffers (input_, labels_).
  std::pair<kernels::Tensor, kernels::Tensor> my_chunk(const kernels::Tensor& images,
                                                       const kernels::Tensor& labels, float* share);
  void copy_in(const kernels::Tensor& x, const kernels::Tensor& y);
  // Why this step cannot run graphed (empty: it can).
  std::string graphs_blocked() const;
  // Whether this step runs graphed; says once why not when graphs were asked for.
  bool use_graphs();
  // Before a step: a captured graph of this step's shape (graph_key_) that baked in the host
  // share research code's hook read (StepSegments::host_share), where this step's share is
  // another, turns graphs off for good, saying why (graphs_fallback); the step runs uncaptured.
  void refuse_replay_of_other_share();
  // zero_grad, forward (without the buffer broadcast) and the loss into metrics_[0] and
  // dlogits_ (scaled by the loss scale): capturable.
  void forward_and_loss(nn::Module& m, const kernels::Tensor& x, const kernels::Tensor& y);
  // The clip and the scaler-checked optimizer step on the synchronised gradient: capturable.
  // requires scaler_.prepare_deferred(*optimizer_) for this step.
  void queue_update(nn::Module& m);
  // This rank's stages of a training step (dp/step_stages.hpp: the chunk copied in, forward,
  // backward with the buckets' reducer, the update), uncaptured or graphed.
  struct RankStages;
  // The step's stages from the chunk's copy (x, y: this rank's rows; share: its share of the
  // loss) to the update, uncaptured or (segments) graphed. Returns the bucket bytes a replayed
  // graph all-reduced (the group never saw them: the payload the host handed over is counted
  // there), else 0.
  int64_t run_stages(const kernels::Tensor& x, const kernels::Tensor& y, float share,
                     StepSegments* segments);

  WorkerEnv env_;
  kernels::Device device_;
  std::unique_ptr<kernels::DeviceContext> context_;
  std::unique_ptr<kernels::ContextScope> scope_;
  std::unique_ptr<ProcessGroup> group_;
  DdpOptions ddp_options_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  nn::Optimizer* optimizer_ = nullptr;
  int zero_stage_ = 0;
  bool zero_overlap_ = false;  // set_zero_overlap
  bool sync_bn_ = false;
  nn::Precision precision_ = nn::Precision::fp32;
  nn::GradScaler scaler_{nn::Precision::fp32};
  std::unique_ptr<ZeroStage1> zero_;
  RunConfig run_config_, verified_config_;
  kernels::Tensor input_, labels_, dlogits_;  // this rank's step buffers, reused
  // dlogits_ is the model's output, overwritten by its gradient (queue_loss's in-place case):
  // let go after an uncaptured backward, so that the next step's output is not made beside it.
  bool dlogits_is_output_ = false;
  MicroBatches micro_;  // the chunk's micro-batches (set_micro_batches)
  // (4) f32 on the device: chunk loss, non-finite, global batch rows (summed), grad norm
  kernels::Tensor metrics_;
  // The step's loss scale on the device, where the kernels read it (no graph bakes it in):
  // (2) f32, 1 / scale and scale, written at each step's start (write_scale).
  StepScalars scale_values_;
  kernels::Scalar unscale_, loss_scale_;
  kernels::Tensor host_metrics_;  // its pinned host copy
  int metrics_lag_ = 0;
  // metrics_lag 1: per step parity, a copy of the step's metrics being all-reduced and read.
  LaggedSlots<LaggedExtra> lagged_;
  bool lagged_fault_ = false;  // the slot read last said a fault was written
  std::string failed_;         // the error that ended a step midway: later steps are refused
  int64_t steps_ = 0;          // train_steps so far (the lag's parity)
  // Phase boundaries of a step on this rank's stream, by StepMark (dp/step.hpp): begin, chunk
  // copied in (kScattered), forward, backward, gradients synchronised (kReduced), stepped.
  kernels::Event marks_[kStepMarks];
  kernels::Event::Timing phase_timing_ = kernels::Event::Timing::on;
  nn::LossPtr loss_fn_;
  float clip_grad_norm_ = 0.f, grad_norm_ = 0.f;
  int64_t my_denominator_ = 0, total_denominator_ = 0;  // of the last my_chunk with a share
  DdpStepTimes times_;
  Graphs graphs_mode_ = Graphs::automatic;
  // Graph mode: by step shape, its two segments (the second: the update) and their buffers.
  std::map<GraphKey, StepSegments> graphs_;
  GraphKey graph_key_;  // this step's
  bool said_graphs_off_ = false;
  bool said_graph_shapes_ = false;  // graph_set_for's line (rank 0 says it)
  bool graph_collectives_ = true;   // set_graph_collectives
  CaptureFailure capture_failure_;  // the step in progress's, and the rank's tries
  std::string graphs_fallback_;     // graphs_fallback()
  int64_t last_payload_bytes_ = 0;
};

}  // namespace dp::dist
