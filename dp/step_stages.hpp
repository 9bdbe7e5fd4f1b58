// The order of one training step on one device or rank, written once for DP's workers
// (dp/data_parallel.hpp) and DDP's ranks (dp/distributed/ddp_trainer.hpp), uncaptured and
// graphed: an engine says what it does at each stage (StepStages), and run_step_stages or
// run_graphed_stages runs the stages in this order, recording the step's marks (StepMark,
// dp/step.hpp) between them:
//
//   kBegin  take_chunk  kScattered  [replicate  kReplicated]  before_forward
//   uncaptured:  forward_and_loss  kForwarded  before_backward  backward  kBackwarded
//                finish_reduce  kReduced  [prepare_update  update  kStepped]
//   graphed:     before_backward  {forward_and_loss  backward}  kForwarded  kBackwarded
//                finish_reduce  [kReduced]  [prepare_update]  {reduce_queued  [update]}
//                [kReduced]  [kStepped]
//
// {...} is a captured segment (dp/graphs.hpp: uncaptured for a shape's first runs, then captured
// and replayed); [...] depends on the engine and the device (replicate: DP; update: the devices
// and ranks that step). The phase times (mark_times), DP's trace slices and the waits between
// DP's devices are read from these marks, so they mean the same in both engines, and a stage
// added here is added to both.
//
//   struct MyStages : dp::StepStages { ... };
//   MyStages s(...);
//   dp::run_step_stages(s, marks, ctx, {"dp/scatter", ...});
#pragma once

#include <cstdint>
#include <optional>

#include "dp/graphs.hpp"
#include "dp/step.hpp"
#include "dp/trace.hpp"
#include "kernels/runtime/context.hpp"
#include "kernels/runtime/event.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "nn/optim.hpp"

namespace dp {

// What one engine does at each stage of a step on one device or rank.
class StepStages {
 public:
  virtual ~StepStages() = default;
  // The step's chunk into this device's input buffers (DP: scattered from the host batch, after
  // the step's host values; DDP: this rank's rows copied in).
  virtual void take_chunk() = 0;
  // DP: device 0's weights into this replica. An engine whose weights are equal everywhere after
  // each step (DDP) has no replicate stage and records no kReplicated.
  virtual bool has_replicate() const { return false; }
  virtual void replicate() {}
  virtual void before_forward() {}
  // zero_grad, forward, the loss into the metrics and its gradient: capturable.
  virtual void forward_and_loss() = 0;
  virtual void before_backward() {}
  // Backward from the loss's gradient. Uncaptured, its hooks hand each ready bucket to the
  // reducer; graphed, what the engine captures of that (capturable).
  virtual void backward() = 0;
  // Host: every bucket handed over, the reducer's collectives and waits done or queued. Graphed,
  // between the two segments.
  virtual void finish_reduce() = 0;
  // Graphed: whether the reduction has a capturable part after finish_reduce (reduce_queued, in
  // the second segment: kReduced then follows that segment).
  virtual bool reduces_queued() const { return false; }
  virtual void reduce_queued() {}
  // The optimizer when this device or rank updates the weights (null: it does not step).
  virtual nn::Optimizer* stepping() = 0;
  // Host, outside any segment: the update's per-step scalars to the device.
  virtual void prepare_update() {}
  // Clip, the loss scaler's check and the optimizer: queued, capturable.
  virtual void update() = 0;
  // A context for the update (a ContextScope over it; null: the step's own).
  virtual kernels::DeviceContext* update_context() { return nullptr; }
  // Graphed: after the compute segment; `ran` says whether its host code ran (else: replayed).
  virtual void after_compute(bool ran) { (void)ran; }
};

// The NVTX ranges around the stages ("dp/forward"); null where a stage names its own.
struct StageNames {
  const char* scatter = nullptr;
  const char* replicate = nullptr;
  const char* forward = nullptr;
  const char* backward = nullptr;
  const char* forward_backward = nullptr;  // graphed: the compute segment
  const char* reduce = nullptr;
  const char* step = nullptr;
  // A host-time slice of the step stage on `track` of this trace too (DDP's trace; null: none).
  Trace* step_trace = nullptr;
  int track = 0;
};

// One step shape's captured segments on one device or rank, and the chunk buffers they were
// captured with (a graph replays with the memory it was captured with).
struct StepSegments {
  int runs = 0;            // steps of this shape so far: the first kGraphWarmupRuns uncaptured
  kernels::Graph compute;  // forward, the loss, backward
  kernels::Graph finish;   // reduce_queued and the update
  kernels::Tensor input, labels, dlogits;
  uint64_t drawn = 0;     // random counters the compute segment draws (dropout)
  uint64_t last_use = 0;  // graph_set_for's order of use
  // DDP: the host share research code's hook read while the compute segment was captured
  // (DistributedDataParallel::take_share_read_in_capture), which its replays work with.
  std::optional<float> host_share;

  // Whether both segments are captured: a step that replays them captures nothing (one whose
  // capture lacked memory captures that segment at a later step).
  bool all_captured() const { return compute.captured() && finish.captured(); }
};

namespace detail {

struct MaybeRange {
  explicit MaybeRange(const char* name) {
    if (name) range.emplace(name);
  }
  std::optional<kernels::NvtxRange> range;
};

struct StepRange {
  explicit StepRange(const StageNames& names) : range(names.step) {
    if (names.step_trace && names.step) slice.emplace(names.step_trace, names.step, names.track);
  }
  MaybeRange range;
  std::optional<TraceScope> slice;
};

struct MaybeScope {
  explicit MaybeScope(kernels::DeviceContext* ctx) {
    if (ctx) scope.emplace(*ctx);
  }
  std::optional<kernels::ContextScope> scope;
};

inline void begin_stages(StepStages& s, kernels::Event* marks, kernels::DeviceContext& ctx,
                         const StageNames& names) {
  marks[kBegin].record(ctx);
  {
    MaybeRange range(names.scatter);
    s.take_chunk();
  }
  marks[kScattered].record(ctx);
  if (s.has_replicate()) {
    {
      MaybeRange range(names.replicate);
      s.replicate();
    }
    marks[kReplicated].record(ctx);
  }
  s.before_forward();
}

}  // namespace detail

// requires marks[kStepMarks] this device's or rank's, ctx its context (current). ensures the
// step's stages queued uncaptured in the order above, each mark recorded on ctx after its stage.
inline void run_step_stages(StepStages& s, kernels::Event* marks, kernels::DeviceContext& ctx,
                            const StageNames& names) {
  detail::begin_stages(s, marks, ctx, names);
  {
    detail::MaybeRange range(names.forward);
    s.forward_and_loss();
  }
  marks[kForwarded].record(ctx);
  s.before_backward();
  {
    detail::MaybeRange range(names.backward);
    s.backward();
  }
  marks[kBackwarded].record(ctx);
  {
    detail::MaybeRange range(names.reduce);
    s.finish_reduce();
  }
  marks[kReduced].record(ctx);
  if (!s.stepping()) return;
  {
    detail::StepRange range(names);
    detail::MaybeScope scope(s.update_context());
    s.prepare_update();
    s.update();
  }
  marks[kStepped].record(ctx);
}

// run_step_stages through `seg`'s two segments: forward, the loss and backward in the first
// (drawing from `flat`, the replica's random stream), then finish_reduce on the host, then
// reduce_queued and the update in the second, where there is any. A capture that fails (a
// kernels::Error) runs its segment uncaptured and leaves the reason in `failed`; any other
// failure of the second segment's capture puts the optimizer's step count back (the update
// never ran) and is thrown.
inline void run_graphed_stages(StepStages& s, StepSegments& seg, nn::FlatState& flat,
                               CaptureFailure& failed, kernels::Event* marks,
                               kernels::DeviceContext& ctx, const StageNames& names) {
  const int runs = seg.runs++;
  detail::begin_stages(s, marks, ctx, names);
  s.before_backward();
  bool ran = false;
  {
    detail::MaybeRange range(names.forward_backward);
    ran = run_drawing_segment(
        ctx, seg.compute, runs, flat, seg.drawn,
        [&] {
          s.forward_and_loss();
          s.backward();
        },
        &failed);
  }
  s.after_compute(ran);
  marks[kForwarded].record(ctx);
  marks[kBackwarded].record(ctx);
  nn::Optimizer* optimizer = s.stepping();
  const bool queued = s.reduces_queued();
  auto second = [&] {
    const int64_t steps_before = optimizer ? optimizer->step_count() : 0;
    if (optimizer) s.prepare_update();  // the step count grows here
    kernels::DeviceContext* on = optimizer ? s.update_context() : nullptr;
    kernels::DeviceContext& finish_ctx = on ? *on : ctx;
    detail::MaybeScope scope(on);
    // Replayed right after the first segment, on its context: one memory pool, as eagerly (the
    // update's temporaries take blocks backward's freed).
    const kernels::Graph* after = seg.compute.captured_on() == &finish_ctx ? &seg.compute : nullptr;
    try {
      run_graph_segment(
          finish_ctx, seg.finish, runs,
          [&s, optimizer] {  // two captures: held in std::function's own storage
            if (s.reduces_queued()) s.reduce_queued();
            if (optimizer) s.update();
          },
          &failed, nullptr, after);
    } catch (...) {
      // A capture that failed ran nothing: no update was taken, so the step is not counted.
      if (optimizer && runs >= kGraphWarmupRuns && !seg.finish.captured())
        optimizer->set_step_count(steps_before);
      throw;
    }
  };
  {
    detail::MaybeRange range(names.reduce);
    s.finish_reduce();
    if (queued) second();  // the reduction ends in it: kReduced after it
  }
  marks[kReduced].record(ctx);
  if (!optimizer) return;
  if (!queued) {
    detail::StepRange range(names);
    second();
  }
  marks[kStepped].record(ctx);
}

// The time between a step's marks, in ms (device time on a GPU, the host's on a CPU device), as
// both engines report it: scatter (the chunk taken), replicate (kScattered to kReplicated, 0
// without that stage), forward with the loss (from the replica's weights, or the chunk, to
// kForwarded), backward, reduce (kBackwarded to kReduced: what of the reduction was not hidden)
// and step (kReduced to kStepped, 0 where the device does not step). Graphed, forward and
// backward are one segment: forward holds it, backward is 0.
struct MarkTimes {
  double scatter = 0, replicate = 0, forward = 0, backward = 0, reduce = 0, step = 0;
};

// requires marks recorded by run_step_stages or run_graphed_stages with Timing::on, and reached.
inline MarkTimes mark_times(const kernels::Event* marks) {
  auto between = [&](StepMark a, StepMark b) {
    return kernels::Event::elapsed_ms(marks[a], marks[b]);
  };
  MarkTimes t;
  const bool replicated = marks[kReplicated].recorded();
  t.scatter = between(kBegin, kScattered);
  t.replicate = replicated ? between(kScattered, kReplicated) : 0;
  t.forward = between(replicated ? kReplicated : kScattered, kForwarded);
  t.backward = between(kForwarded, kBackwarded);
  t.reduce = between(kBackwarded, kReduced);
  t.step = marks[kStepped].recorded() ? between(kReduced, kStepped) : 0;
  return t;
}

}  // namespace dp
