// dp::DataParallel: one process, one persistent worker thread per device (PyTorch's
// nn.DataParallel, without re-cloning replicas every step).
//
// One train_step is ONE hand-off per worker: the caller posts the step, every worker runs its
// part end to end, and the caller waits for them. No barrier separates the phases. Worker i:
//   dp/scatter    copies its chunk of the host batch (uneven chunks allowed) to its device
//   dp/replicate  (i > 0) copies device 0's flat parameters and buffers into its replica: one
//                 copy each, before forward, so weights the caller changes between steps (a
//                 loaded checkpoint) take effect. Under mixed precision, where device 0's last
//                 optimizer step wrote its 16-bit weights (nn::FlatState::compute_written), the
//                 replica copies those too and casts nothing
//   dp/forward    forward + fused softmax cross-entropy of its chunk
//   dp/backward   backward. The gradient buckets (dp/bucket_plan.hpp: reverse layer order,
//                 1 MiB first, 25 MiB cap) become ready one by one, reported by the module's
//                 on_grad_ready hooks; each is handed to the device that reduces it.
//   dp/reduce     a device with sources sums bucket k of its sources into its own, weighted by
//                 each chunk's share of the batch, in fused kernels that read the sources'
//                 memory in place (same GPU, peer access, or host): one per run of sources
//                 that have published it, in source order, while backward goes on elsewhere: star
//                 (device 0 from 1..N-1) or tree (pairwise, log2 N rounds: 1->0, 3->2, then 2->0,
//                 ...). The result equals the single-device gradient of the same global batch, also
//                 for uneven chunks. BatchNorm running statistics are averaged into device 0 the
//                 same way (or left as device 0's, PyTorch's behaviour, with
//                 BufferSync::root_only). On a GPU the pulls made during backward run on a
//                 second stream of the receiver's (its communication stream): they wait for
//                 their sources there, and its backward goes on beside them
//                 (StepStats::pulls_beside_backward); the compute stream waits for them after
//                 backward.
//   dp/step       (device 0) one optimizer step on its flat buffers; on a CPU device with all
//                 the cores, since the other workers are idle by then
// Order between devices comes from kernels::Event (CUDA: events between streams, no host
// sync); phase times come from the events each worker records, not from barriers.
//
// The step is a replay: workers' contexts cache their blocks (kernels::Caching::on), so after
// the first step of a chunk shape nothing is allocated; each device writes its loss and
// correct count into a small device buffer, and device 0 reads them all at the end with the
// step's one host wait. StepStats::allocations and host_syncs count both, per step.
//
// Replicas run BatchNorm on their own chunk ("ghost" batch statistics), as PyTorch DP does; a
// BatchNorm model therefore matches one device that runs the same chunks one after another and
// accumulates their weighted gradients, not one that normalises the whole batch at once.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/bucket_plan.hpp"
#include "dp/chunks.hpp"
#include "dp/cross_node.hpp"
#include "dp/device_pulls.hpp"
#include "dp/graphs.hpp"
#include "dp/stats_sync.hpp"
#include "dp/step.hpp"
#include "dp/step_metrics.hpp"
#include "dp/step_signals.hpp"
#include "dp/step_stages.hpp"
#include "dp/worker_pool.hpp"
#include "kernels/runtime/event.hpp"
#include "kernels/runtime/graph.hpp"
#include "nn/amp.hpp"
#include "nn/loss.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"
#include "nn/train_state.hpp"

namespace dp {

using kernels::Device;
using kernels::Tensor;

// What happens to non-parameter buffers (BatchNorm running stats) after a step.
enum class BufferSync { average, root_only };

// ReduceTopology and PeerReads: dp/device_pulls.hpp.

// BatchNorm in training: each device normalises its own chunk (ghost statistics, PyTorch DP's
// behaviour), or the replicas combine their statistics (SyncBatchNorm: the full batch's).
enum class BatchNormStats { per_device, synced };

struct DataParallelOptions {
  BufferSync buffer_sync = BufferSync::average;
  float label_smoothing = 0.f;
  // The loss of each chunk (nn/loss.hpp); null: row cross-entropy with label_smoothing. Each
  // chunk's mean is weighted by its share of the batch's loss denominator (rows or tokens).
  nn::LossPtr loss;
  // > 0: device 0's reduced gradient is clipped to this global 2-norm before the step
  // (nn/clip.hpp); StepStats::grad_norm reports the norm either way when on.
  float clip_grad_norm = 0.f;
  kernels::MathMode math = kernels::MathMode::strict;
  int cpu_threads_per_device = 0;  // 0: the hardware threads split evenly among CPU devices
  ReduceTopology reduce = ReduceTopology::star;
  PeerReads peer_reads = PeerReads::automatic;
  int64_t first_bucket_bytes = 1ll << 20;  // the bucket plan shared with DDP
  int64_t bucket_cap_bytes = 25ll << 20;
  BatchNormStats batch_norm = BatchNormStats::per_device;
  // Mixed precision (nn/amp.hpp): bf16/fp16 GEMMs and convolutions on every replica, and the
  // GradScaler's check (and fp16 loss scale) on device 0's reduced gradient, so that one
  // decision holds for every device. `scaler` overrides GradScaler::options_for(precision).
  nn::Precision precision = nn::Precision::fp32;
  std::optional<nn::GradScalerOptions> scaler;
  // The dtype replica gradients travel in: f32, or bf16 (half the bytes; each source rounds its
  // bucket once and the receiver adds it into its f32 sum), as PyTorch's bf16 compress hook.
  kernels::DType comm_dtype = kernels::DType::f32;
  // Hybrid mode (dp/cross_node.hpp): this engine is one node of several; null: alone. Every
  // node is handed the same global batch and takes its chunk; the weights are node 0's from
  // construction on; device 0's summed buckets are summed over the nodes (in f32) while
  // backward goes on, and the loss, correct count and buffers too. A step that fails on this
  // node leaves the nodes' group (CrossNode::abort), so the other nodes' steps fail at once
  // rather than at the group's timeout; this engine then refuses later steps.
  std::shared_ptr<CrossNode> cross_node;
  // A reducer of research code's in place of the sums to device 0 (PyTorch's DDP comm hooks,
  // here under DP): reducers[i] is device i's end of a group whose ranks are this engine's
  // devices (CrossNode with nodes() == n_devices(), node() == i). Each device weights its own
  // gradient by its share of the batch and hands it over bucket by bucket, from backward's hooks
  // as each bucket becomes final; device 0 steps with what reducers[0] leaves in its buckets
  // once finished. dp::dist::device_reducers makes them from a CommHook
  // (dp/distributed/comm_hook.hpp) over an in-process Gloo group. Empty: the star or the tree.
  // requires one per device, comm_dtype f32, not hybrid, and every device given rows each step
  // (a batch of at least n_devices() rows); steps run uncaptured (a hook runs host code). A
  // device whose step fails (its hook throws, say) leaves the group, so the devices waiting for it
  // in a collective fail at once, not at the group's timeout; later steps are refused.
  std::vector<std::shared_ptr<CrossNode>> reducers;
  // Graphed steps: per worker and step shape, forward and backward are one captured graph, and
  // each receiving device's reduction (device 0's with the clip, the optimizer step and the
  // metrics) another, captured on the third step of that shape and replayed from then on (the
  // first two run uncaptured, which warms the memory caches). The reduction then starts after
  // backward (no overlap with it) unless graph_pulls is beside, and forward's phase time covers
  // backward too. Results are bitwise those of graphs off. The loss scale, the shares and
  // dropout's offsets are read on the devices, so they may change every step. Not capturable,
  // and run uncaptured with one line saying why: hybrid runs and SyncBatchNorm.
  Graphs graphs = Graphs::automatic;
  // Graphed steps: when a receiving device sums its sources' buckets: after backward, in its
  // second segment (after), or beside backward (beside: on a GPU, uncaptured on its second
  // stream, each bucket's pull waiting for events the devices' captured backward records as the
  // bucket becomes final, so the sums overlap backward as uncaptured steps' do; CPU devices sum
  // after backward either way). The same sums, bit for bit. after until a GPU has measured
  // beside (docs/gpu-check.md).
  GraphPulls graph_pulls = GraphPulls::after;
  // Whether each step's phases are timed (StepStats::ms, buckets_overlapped, a trace): the
  // workers' marks and pulls are then timing events. off: they only order the devices' work
  // (on a GPU, events without a timestamp, cheaper to record and wait on), StepStats::ms holds
  // the step's total alone and set_trace is refused.
  kernels::Event::Timing phase_timing = kernels::Event::Timing::on;
  // 1: train_step does not wait for its step's metrics (loss, correct count, gradient norm):
  // it queues their copy to the host and returns what the previous step's copy brought
  // (StepStats::metrics_lagged); finish_metrics() waits for the last step's. The host may then
  // queue step k + 1 while the devices still run step k: it waits only for each device to have
  // taken step k's inputs (so the caller may refill the host batch), which on a GPU means until
  // step k - 1 is done there. requires graphs asked for (on, or automatic on CUDA devices),
  // phase_timing off (a step's marks are not reached when it returns), no loss scaler check
  // (fp32: a checked step's verdict decides the next one's step count and scale), not hybrid.
  // A device-side fault (a bad label) is then reported with the step's metrics, by the next
  // step (or finish_metrics), and device 0's module is final for the host once
  // finish_metrics, save or load returns (they wait for every device; so does evaluate, in
  // order on the devices). 0: each step waits once, for its own metrics.
  int metrics_lag = 0;
  // Gradient accumulation (dp/step.hpp, MicroBatches): each device runs its chunk of a step as
  // this many micro-batches of balanced rows (fewer when the chunk has fewer rows), one after
  // another, their gradients added up before the reduction, which, like the update, runs once
  // per step. A device then holds one micro-batch's activations at a time, and the step follows
  // the loss curve of one pass over the same global batch (within f32 rounding). Graphed steps
  // capture the whole loop. Forward's phase time covers every micro-batch but the last one's
  // backward too. BatchNorm normalises each micro-batch on its own (as PyTorch's accumulation
  // loop does). requires >= 1; 1 with SyncBatchNorm, whose devices exchange statistics at each
  // forward.
  int micro_batches = 1;
};

// Milliseconds of each phase of one step, from the events each worker records (device time on
// a GPU): device 0's, the step's critical path (they follow one another; reduce includes its
// wait for the slowest device's backward).
struct PhaseTimes {
  double scatter = 0, replicate = 0, forward = 0, backward = 0;
  double reduce = 0;              // on device 0 after its own backward: the reduction not hidden
  double reduce_in_backward = 0;  // on device 0 while its own backward ran (hidden)
  double step = 0;
  double cross_node = 0;  // hybrid: device 0's wait for the sums over nodes (within its reduce)
  double total = 0;       // host wall time of train_step
};

struct StepStats {
  // metrics_lag 1: loss, correct, grad_norm and skipped are the previous step's (on a run's
  // first step there are none: loss NaN); DataParallel::finish_metrics() gives the last's.
  bool metrics_lagged = false;
  float loss = 0;                // mean loss over the global batch
  int64_t correct = 0;           // rows whose argmax equals the label
  int64_t samples = 0;           // global batch size (hybrid: over every node)
  int64_t node_samples = 0;      // hybrid: this node's chunk of it (samples otherwise)
  int64_t cross_node_bytes = 0;  // hybrid: bytes this node handed to the collectives this step
  // DataParallelOptions::reducers: bytes the devices handed to their group's collectives this
  // step, over every device (what a hook chose to send; 0 without reducers).
  int64_t reducer_bytes = 0;
  int devices_used = 0;  // fewer than n_devices() when the batch is smaller than the count
  PhaseTimes ms;
  // Parameter (and, under mixed precision, their 16-bit copy's), buffer and gradient bytes copied
  // between devices this step.
  int64_t bytes_moved = 0;
  std::vector<int64_t> link_bytes;  // per device used: bytes in + out of it this step
  int buckets = 0;                  // gradient buckets reduced (0 on one device)
  int buckets_overlapped = 0;       // of which the first pull began before the last backward ended
  // Fused pulls that ran on a receiver's communication stream beside its own backward (GPUs,
  // uncaptured steps: a graphed step sums after backward); 0 on CPU devices.
  int pulls_beside_backward = 0;
  float loss_scale = 1;  // the loss scale this step used (nn/amp.hpp)
  // Counted by the runtime over every device's context during the step: memory taken from a
  // device (0 once each shape's blocks are cached) and host waits or reads (1: the metrics).
  int64_t allocations = 0;
  int64_t host_syncs = 0;
  // Dtype conversions (f32/f16/bf16 casts) the step's work performed over every device's
  // context: a replayed step counts what its graphs convert (kernels::Graph::casts), so graphed
  // and uncaptured steps of one shape report the same.
  int64_t casts = 0;
  bool graphed = false;   // captured graphs ran this step's work (replayed)
  bool captured = false;  // this step captured its shape's graphs (then replayed them)
  // The most memory in use on one device during the step (its contexts' tensors, not the
  // cached blocks): a capturing step's equals the eager step's (kernels/runtime/graph.hpp).
  int64_t peak_bytes = 0;
  // A replayed step: the nodes of the graphs it replayed, over every device (CUDA: kernel, copy
  // and memset nodes; CPU: the ops recorded). Each costs a launch on a GPU: the step's floor.
  int64_t graph_nodes = 0;
  float grad_norm = 0;        // the gradient's global norm before clipping (clip on)
  bool skipped = false;       // the gradient was not finite: no optimizer step
  int64_t skipped_steps = 0;  // skipped so far
};

class DataParallel {
 public:
  // requires module materialised on devices[0], optimizer built on that module's flat buffers,
  // devices non-empty and distinct. Marks the module's input gradient not needed (its
  // backward returns none from then on: the input is data). Builds the replicas once (clone_to) on
  // their workers, and owns the module's on_grad_ready hook until destroyed (the reduction starts
  // from it).
  DataParallel(nn::ModulePtr module, nn::Optimizer& optimizer, std::vector<Device> devices,
               DataParallelOptions options = {});
  ~DataParallel();

  // requires images (B, ...) and labels (B, ...) on the host as the model and the loss take
  // them (f32 images and (B) i32 labels for the default loss), B >= 1. Pinned memory lets the
  // scatter overlap; pageable works too. A device-side fault on any device (a label out of
  // range on a GPU) throws from the step that reads its metrics, naming the device, once that
  // step is complete (the engine stays usable).
  StepStats train_step(const Tensor& images, const Tensor& labels);
  // requires metrics_lag 1 and a step whose metrics were not returned yet (the last one).
  // ensures every device's work is done; returns that step's loss, correct count, gradient
  // norm and verdict (metrics_lagged set), and reports a device-side fault of it.
  StepStats finish_metrics();
  // Forward in eval mode over the batch, split across devices. Returns loss and correct count.
  StepStats evaluate(const Tensor& images, const Tensor& labels);

  // Device 0's module: the one the optimizer steps, for evaluation and saving.
  nn::Module& module() { return *replicas_[0]; }
  nn::Module& replica(int i) { return *replicas_[i]; }
  int n_devices() const { return pool_.size(); }
  const std::vector<Device>& devices() const { return devices_; }

  // Copies device 0's flat parameters and buffers into replicas 1..n-1 (all when n < 0): the
  // replicate phase of a step, one copy per replica. Public for benchmarks and tests.
  void broadcast_params(int n = -1);
  // Device 0's gradient := sum_i (chunk_sizes[i] / sum) * replica i's gradient, bucket by
  // bucket over the configured topology: the same code train_step runs, here with every
  // gradient final from the start. Public so that tests can drive it directly. Under the tree,
  // inner devices' gradients hold their partial sums afterwards; under the star, replicas are
  // untouched.
  void reduce_grads_to_root(const std::vector<int64_t>& chunk_sizes);
  const std::vector<Bucket>& buckets() const { return plan_.buckets; }
  // Why graphs went off by themselves: empty, or "capture failed on DEVICE: ..." once a
  // capture failed (the work was not capturable). The engine then said so in one line ("dp:
  // graphs off: capture failed ..."), ran that step uncaptured (its results are the uncaptured
  // step's) and runs every later step uncaptured. A capture that only lacked cached memory (a
  // layer asking for a size no earlier step did: dp/graphs.hpp's kCaptureMemoryRetries) runs
  // uncaptured that step, which caches the memory, and is captured again at the shape's next
  // step, silently, up to three times per device.
  const std::string& graphs_fallback() const { return graphs_fallback_; }
  // What device 0's attention calls ran so far (kernels::attention_report; every device runs
  // the same shapes). Between steps.
  kernels::AttentionReport attention_report();
  // Balanced split of a batch of `batch` rows over `n` devices (dp/chunks.hpp).
  static std::vector<int64_t> chunk_sizes(int64_t batch, int n) {
    return dp::chunk_sizes(batch, n);
  }

  // Peak bytes allocated per device: through each worker's context, plus, on device 0, the
  // module's flat state (made before the workers started).
  std::vector<int64_t> peak_memory_bytes();
  // Records every phase of every worker into `trace` (null: off), each slice tagged with its
  // step. Set between steps.
  // requires phase timing on (DataParallelOptions::phase_timing) or a null trace.
  void set_trace(Trace* trace);
  // Each replica's dropout stream offset (device order), to save and restore a run exactly.
  // Call between steps.
  std::vector<uint64_t> rng_offsets();
  void set_rng_offsets(const std::vector<uint64_t>& offsets);
  // Bytes of one flat parameter copy (P * 4).
  int64_t parameter_bytes() { return replicas_[0]->flat_params().nbytes(); }
  // The loss scaler device 0 steps with: its state goes into checkpoints.
  nn::GradScaler& scaler() { return scaler_; }
  // The whole training state (nn/train_state.hpp, safetensors layout): device 0's weights and
  // buffers, the optimizer's state and step, every replica's dropout offset, the loss scaler
  // and the step (train_steps so far unless `position.step` says otherwise); `position` adds
  // the caller's epoch, batches done and config. Written atomically. Call between steps.
  void save(const std::string& path, const nn::TrainingProgress& position = {});
  // Waits for every device's queued work and reports a device-side fault: before the host reads
  // or writes device 0's module itself (metrics_lag 1: a step returns before its update is done;
  // save and load do this themselves).
  void drain();
  // Restores what save() wrote, bit for bit; refuses, naming what differs, a file from another
  // model or optimizer, or whose config differs from `expected.config`. A file of another
  // device count, or DdpTrainer's, is re-sharded (its state is whole in the file; dropout
  // streams are re-derived, so the continuation is not bit-exact): the returned position holds
  // the saved mode and world size, and nn::resume_note(returned, this run's) says what changed.
  // Returns the saved position (step, epoch, batches done). Call between steps. metrics_lag 1: a
  // step's metrics still pending belong to the run replaced and are dropped (finish_metrics()
  // first keeps them); the next step, like a run's first, returns none.
  nn::TrainingProgress load(const std::string& path, const nn::TrainingProgress& expected = {});

 private:
  // Entries of a device's metrics buffer: loss, correct count, on device 0 the non-finite
  // verdict and the gradient norm (clipping on), and the first word of the device's fault record
  // (two f32: kernels::queue_fault_word), read on the host with the rest.
  static constexpr int64_t kMetrics = 6;
  static constexpr int64_t kLoss = 0, kCorrect = 1, kNonFinite = 2, kGradNorm = 3, kFaultWord = 4;
  struct PerDevice {
    // Graph mode: by step shape (graph_key_), the device's segments (the second: its sums and,
    // on device 0, the update and the metrics' gather) and the chunk buffers they hold.
    std::map<GraphKey, StepSegments> graphs;
    CaptureFailure capture_failure;  // this step's, set by the device's worker
    std::vector<int> graph_waits;    // whose ends a graphed reduce waits for
    Tensor input, labels;            // this step's chunk on the device
    // The loss gradient backward reads: the model's output itself, overwritten, where the loss
    // writes it in place (dlogits_is_output: let go after an uncaptured backward, so that the
    // next step's output is not made while it is held), else a buffer kept for reuse.
    Tensor dlogits;
    bool dlogits_is_output = false;
    // (6) f32 on the device: the chunk's mean loss and correct count, (device 0) whether the
    // reduced gradient held a non-finite value (the GradScaler's verdict) and its norm (clipping
    // on), and the device's fault word (two f32), read with the rest.
    Tensor metrics;
    // The step's host scalars on the device (write_step_values): (2 + 2 devices) f32, made
    // once so that its address, which graphs hold, never changes. Views: the gradient unscale
    // (1 / loss scale), the loss scale, each device's loss share and each one's row share.
    StepScalars step_values;
    kernels::Scalar unscale, loss_scale;
    std::vector<kernels::Scalar> shares, row_shares;
    MicroBatches micro;  // the chunk's micro-batches (DataParallelOptions::micro_batches)
    // Touched by this device's worker only, during a step:
    BucketProgress own;  // this device's backward through the buckets
    bool in_step = false;
    // A graphed step's backward with GraphPulls::beside: the hooks mark each final bucket in
    // the graph (DevicePulls::mark_in_graph) instead of handing it on.
    bool marking_in_graph = false;
    kernels::Event marks[kStepMarks];  // by StepMark (dp/step.hpp)
    // A traced, uncaptured step of several micro-batches: the start and the end of each
    // micro-batch's backward but the last one's (forward_and_loss runs them), in order, so that
    // the trace shows them between the forwards. Made when a step first needs more; kept. The
    // count is set to 0 at each step's start (train_job).
    std::vector<kernels::Event> micro_marks;
    int micro_marks_used = 0;
  };
  // Device i's stages of a training step (dp/step_stages.hpp: scatter, replicate, forward,
  // backward, the reduction to device 0, device 0's update), uncaptured or graphed.
  struct DeviceStages;
  // Device i's part of a training step: its stages (graphed when graphed_step_), then device i
  // tells device 0 it is done, or device 0 reads the step's metrics.
  void train_job(int i, const Tensor& images, const Tensor& labels,
                 const std::vector<int64_t>& sizes);
  // Device 0's work after the reduce: clip, the loss scaler's check and the optimizer step,
  // all queued on the device. The host-side part (scaler_.prepare_deferred: the optimizer's
  // per-step scalars) runs first, outside any graph.
  void queue_update();
  // Why the step cannot run graphed (empty: it can).
  std::string graphs_blocked() const;
  // Whether this step runs graphed (options_.graphs and graphs_blocked); says once why not.
  bool use_graphs();
  // Models with buffers: replica i (> 0) tells device 0 its copy of them is taken; device 0
  // waits for every replica's before its forward changes them.
  void order_buffers_before_forward(int i, int n);
  // Sums every device's metrics into device 0's gathered buffer (waits for none: the caller
  // ordered device 0 after each device's last event).
  void gather_metrics_on_root(int n);
  // The gathered metrics' length for a step on n devices (kMetrics each, + 2 in a hybrid run).
  int64_t metric_slots(int n) const;
  void eval_job(int i, const Tensor& images, const Tensor& labels,
                const std::vector<int64_t>& sizes);
  // Whether a job hands buckets to research code's reducers (training, reduce_grads_to_root) or
  // not (evaluation).
  enum class UsesReducers { no, yes };
  // Runs `job` on the first n workers; a failure aborts the step for the others, and this node
  // (cross_node) leaves its group, and so does the failing device's reducer
  // (DataParallelOptions::reducers) when the job uses them.
  void run_step(const char* phase, int n, const std::function<void(int)>& job,
                UsesReducers uses_reducers);
  // Device i's own buckets after its backward: every one final (also unused layers'), reduced
  // as far as its pulls go, and its reducer's collectives finished (research code's reducers).
  void finish_own_buckets(int i);
  // requires no group was left (run_step); throws naming `op` and why otherwise.
  void check_groups_usable(const char* op) const;
  void begin_step(const std::vector<int64_t>& sizes);
  // Queues the step's loss scale and shares (step_values_) into device i's step_values, ahead
  // of its kernels, which read them there: no graph bakes them in. Nothing when they are there.
  void write_step_values(int i);
  // Copies chunk i of (images, labels) to worker i's device.
  void scatter_chunk(int i, const Tensor& images, const Tensor& labels,
                     const std::vector<int64_t>& sizes);
  // Copies device 0's state into replica i (its stream): the flat parameters and buffers, and
  // device 0's 16-bit weights where replicas_take_compute_ says they are fresh, with them only
  // the f32 weights read outside them (f32_runs_).
  void replicate(int i);
  // On the caller's thread, before a step's or a broadcast's jobs start: replicas_take_compute_
  // (device0_compute_fresh()), and the runs of device 0's flat parameters replicate copies,
  // made again only when that or device 0's host_values_version or copy_reads_version changed.
  void plan_replicate();
  // Whether device 0's 16-bit weights are its f32 weights rounded (its optimizer's step wrote
  // them, and nothing wrote the f32 weights since), read on the caller's thread before a step's
  // or a broadcast's jobs start: device 0's forward clears that flag while replicas copy.
  bool device0_compute_fresh() const;
  // Bytes replicate(i) sends each replica this step: the flat parameters and buffers, and
  // device 0's 16-bit weights when the replicas take them (replicas_take_compute_).
  int64_t replicate_bytes() const;
  void on_grad_ready(int i, const nn::Parameter& p);
  // Reduces what can be reduced on device i, in bucket order (pulls_.advance), and hands each
  // bucket made final on (hand_on). blocking: after backward, every bucket.
  void advance_reduction(int i, bool blocking);
  // Bucket k of device i, final there: a hybrid run's device 0 starts its sum over the nodes;
  // with research code's reducers, each device hands its own bucket, weighted, to its reducer.
  void hand_on(int i, int k);
  // ordered: the caller waited for every device's end already (graph mode).
  void average_buffers_on_root(const std::vector<int64_t>& sizes, bool ordered = false);
  int devices_for(int64_t batch);
  // Checks a host batch, fills stats.samples/devices_used and returns the chunk sizes.
  // Hybrid: narrows images and labels to this node's chunk first.
  std::vector<int64_t> split_batch(const char* what, Tensor& images, Tensor& labels,
                                   StepStats& stats);
  // Whether forward_and_loss marks each earlier micro-batch's backward for the trace.
  enum class MicroMarks { off, on };
  // Device i's forward and loss (train: with the gradient of the loss; several micro-batches:
  // every one's but the last's backward too, each between two of pd.micro_marks when marked).
  void forward_and_loss(int i, nn::Mode mode, MicroMarks marks = MicroMarks::off);
  // Device 0, at the end of a step: gathers every device's metrics and reads them to the host,
  // the step's one host wait (which also covers every other device's work: device 0 waited on
  // each one's last event first).
  // gathered_in_graph: a graphed step gathered them already, inside device 0's reduce graph.
  // lagged (metrics_lag 1, training): the copy is queued into this step's slot of lagged_,
  // and updated_ marks the end of device 0's part (the next step's replicas wait on it).
  enum class Read { now, lagged };
  Read step_read() const { return options_.metrics_lag > 0 ? Read::lagged : Read::now; }
  // requires m a step's host metrics over n devices. Throws when a device's fault word there says
  // it faulted (a bad label on a GPU): its worker's report (text and device), from drain(); a
  // word copied before that fault was reported already is not reported again.
  void report_device_faults(const float* m, int n);
  void read_step_metrics(int n, bool gathered_in_graph = false, Read read = Read::now);
  // The loss and correct count from metrics `m` read for a step whose devices' weights were
  // `shares` (one per device used).
  void gather_metrics(const float* m, const std::vector<float>& shares, StepStats& stats) const;
  // A training step's results from its metrics `m` (and `shares`): the loss scaler settled on
  // the verdict, the gradient norm, the loss and the correct count.
  void settle_step(const float* m, const std::vector<float>& shares, StepStats& stats);
  // Hybrid, on device 0 after its reduce: waits for the bucket sums over nodes, then sums the
  // buffers over nodes too.
  void finish_cross_node(int n);
  // Calls f on every context of device i (its worker's, its comm stream's, device 0's wide).
  template <class F>
  void for_each_context(int i, F f);
  // Calls f(i, context) on every context of every device, device by device (StepCounter's).
  template <class F>
  void each_context(F f);
  // The step's runtime counts over every context (counter_): begun, and taken at its end.
  void begin_counts();
  StepCounts end_counts();
  // After a step: phase times, overlap count and trace slices from the workers' events.
  void collect_step(int n_used, StepStats& stats);
  std::vector<int64_t> link_bytes(int n_used) const;

  std::vector<Device> devices_;
  DataParallelOptions options_;
  nn::Optimizer& optimizer_;
  WorkerPool pool_;
  StepSignals signals_;     // what the step's workers tell each other
  std::string left_group_;  // why the reducers or this node left their group (run_step), or empty
  std::vector<nn::ModulePtr> replicas_;  // [0] is the caller's module
  std::vector<PerDevice> per_device_;
  BucketPlan plan_;
  // The step's reduction (star or tree, when research code's reducers are not given), and its
  // weights.
  DevicePulls pulls_;
  DevicePulls::HandOn hand_on_;  // hand_on, when a run has a hand-on (hybrid, reducers)
  std::vector<float> shares_;
  // Each chunk's rows over the batch's (hybrid: the global batch's): the weights of the running
  // statistics, which are means over rows whatever the loss divides by.
  std::vector<float> row_shares_;
  // What write_step_values writes: 1 / step_scale_, step_scale_, shares_, then row_shares_ (each
  // padded to the device count).
  std::vector<float> step_values_;
  std::vector<int64_t> denominators_;    // the step's chunks' loss denominators (split_batch)
  int64_t global_denominator_ = 0;       // hybrid: the global batch's (split_batch)
  int64_t global_rows_ = 0;              // hybrid: the global batch's rows (split_batch)
  double cross_wait_ms_ = 0;             // hybrid: finish_cross_node's wait this step
  std::vector<int64_t> reducer_before_;  // per reducer: its payload bytes at the step's start
  // CPU device 0: a context with all the cores, for the optimizer step (null otherwise).
  std::unique_ptr<kernels::DeviceContext> wide_context_;
  std::unique_ptr<ThreadStatsSync> stats_sync_;  // BatchNormStats::synced
  Tensor staging_buffers_;                       // on device 0: one replica's buffers
  // On device 0: every device's metrics (kMetrics each), then (hybrid) the node's loss and
  // count; sized for n_devices() once, a step with n devices uses metric_slots(n) of them.
  Tensor gathered_metrics_;
  Tensor host_metrics_;  // pinned host copy of gathered_metrics_
  // device0_compute_fresh() at the start of the step or broadcast whose replicate runs: the
  // replicas then copy device 0's 16-bit weights rather than casting their own.
  bool replicas_take_compute_ = false;
  // What replicate copies of the f32 parameters, as [begin, end) runs of flat elements: all of
  // them, or when the replicas take the 16-bit copy every one but those read only through it
  // (nn::Parameter::read_through_copy), which are then stale on the replicas (stale_runs_;
  // filled with NaN while nn::weight_copy_check() is on, so that a read of one shows). Made for
  // planned_take_ and device 0's host_values_version and copy_reads_version, planned_version_.
  std::vector<std::pair<int64_t, int64_t>> f32_runs_, stale_runs_;
  bool planned_take_ = false;
  std::pair<uint64_t, uint64_t> planned_version_{0, 0};
  bool planned_ = false;
  // Device 0's source and weight lists of the metrics' sums (hybrid): no vectors per step.
  std::vector<Tensor> metric_from_;
  std::vector<kernels::Scalar> metric_weights_;
  // metrics_lag 1: per step parity, a step's metrics on their way to the host, and what reading
  // them needs; and the end of device 0's part of the last step.
  struct LaggedShares {
    std::vector<float> shares;  // one per device the step used
  };
  using LaggedSlot = LaggedSlots<LaggedShares>::Slot;
  LaggedSlots<LaggedShares> lagged_;
  StepCounter counter_;  // the step's runtime counts (begin_counts)
  kernels::Event updated_{kernels::Event::Timing::off};
  nn::GradScaler scaler_;
  float step_scale_ = 1.f;  // the loss scale of the step in progress (read by every worker)
  bool step_taken_ = true;  // device 0's decision of the step in progress
  Trace* trace_ = nullptr;
  int64_t step_index_ = 0;
  bool warned_small_batch_ = false;
  // Graph mode: whether this step runs graphed, its shape's key, and why graphs are off (said
  // once).
  bool graphed_step_ = false;
  GraphKey graph_key_;
  bool said_graphs_off_ = false;
  bool said_graph_shapes_ = false;  // device 0's worker's (graph_set_for)
  std::string graphs_fallback_;     // graphs_fallback()
  // After a step: when a device's capture failed, graphs go off (graphs_fallback_, one line) and
  // every graph is dropped, unless it lacked memory only (take_capture_failure: captured again
  // at the shape's next step). Whether one failed.
  bool settle_capture_failures(int n_used);
};

// Prints (once per call) a warning when logical CUDA devices outnumber physical GPUs: figures
// then measure engine overhead, not scaling. Returns true when that is the case.
bool warn_if_oversubscribed(const std::vector<Device>& devices);

}  // namespace dp
