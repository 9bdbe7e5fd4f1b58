// ZeRO stage 1 (Rajbhandari et al., 2020): the optimizer state sharded across DDP ranks.
//
// Rank r owns a contiguous shard [r S, (r + 1) S) of the flat parameter buffer, S = P / N
// rounded down to 64 elements (256 bytes); the last rank also owns the tail [N S, P), fewer
// than 64 N elements. Its optimizer keeps state for its shard alone: AdamW's 2P floats become
// about 2P/N per rank. A step, in place on the module's flat buffers:
//   zero/reduce_scatter  each rank scales its local gradient by its share of the global batch
//                        (B_r / B, as DDP does), then reduce_scatter(sum) of [0, N S) gives
//                        every rank the global gradient of its shard (the tail: all_reduce)
//   zero/step            the optimizer steps the shard (params and state of the shard only)
//   zero/all_gather      every rank's updated shard is gathered into the full flat parameters
//                        (the tail: broadcast from the last rank)
// Beyond DDP, a rank holds two shard-sized buffers (S each), not a second copy of P.
// Communication per step is reduce_scatter + all_gather, 2 (N-1)/N P: the same as one ring
// all-reduce. The gradient of the whole model is computed as in DDP (backward runs in
// DDP's no_sync, then this class communicates); the exchange is not overlapped with backward.
//
// Overlapped (DdpTrainer::set_zero_overlap, as PyTorch's ZeroRedundancyOptimizer beside DDP):
// the gradient meets through DDP's bucketed all-reduce (or its comm hook) while backward runs;
// every rank then holds the whole reduced gradient, clips it and checks it as DDP does, steps its
// shard, and gather_params() all-gathers the shards. 1.5x the bytes (all-reduce, then the
// all-gather), most of them hidden behind backward, and plain DDP's weights bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dp/distributed/process_group.hpp"
#include "nn/amp.hpp"
#include "nn/module.hpp"
#include "nn/optim.hpp"

namespace dp::dist {

struct ZeroShardPlan {
  int64_t numel = 0;  // P
  int world = 1;      // N
  int64_t shard = 0;  // S: elements of every rank's shard (a multiple of 64; may be 0)
  int64_t begin(int rank) const { return rank * shard; }
  // The last rank's shard runs to P: it owns the tail too.
  int64_t end(int rank) const { return rank == world - 1 ? numel : (rank + 1) * shard; }
};
// requires numel >= 0, world >= 1.
ZeroShardPlan make_zero_plan(int64_t numel, int world);

// Milliseconds of the last step's phases.
struct ZeroStepTimes {
  double reduce_scatter = 0, step = 0, all_gather = 0;
};

class ZeroStage1 {
 public:
  // Checks that every rank computed the same plan (same P and N; the error names the first
  // rank that differs), then shards `optimizer` (which must not have stepped yet).
  // requires module materialised on this rank's device, optimizer built on it; `group`,
  // `module` and `optimizer` outlive this object. Collective: every rank constructs one.
  ZeroStage1(ProcessGroup& group, nn::Module& module, nn::Optimizer& optimizer);

  // requires the module's flat grads hold this rank's local gradient (of its rows' mean loss)
  // and share = B_r / B. ensures every rank's flat params hold the result of one optimizer
  // step on the global batch's gradient. Collective.
  // With a `scaler` (mixed precision): each rank checks the reduced gradient of its shard, one
  // all_reduce(max) of that verdict makes it every rank's, and the step is taken (unscaled) or
  // skipped by all alike. Returns whether the step was taken: queue_step, then one host read of
  // the verdict and the norm.
  bool step(float share, nn::GradScaler* scaler = nullptr);

  // step() without a host read, as DDP's own update (dp/step.hpp): the decisions stay on the
  // device and the caller reads them with the step's other metrics, then settles the scaler.
  // requires step()'s inputs, and the optimizer's per-step scalars made for this step:
  // scaler->prepare_deferred(optimizer), or optimizer.prepare_step() without a scaler;
  // non_finite and grad_norm (1) f32 on the module's device. ensures queued on the device:
  // with clipping, the global norm into grad_norm (from one all-reduce of the shards' squared
  // norms) and the shard scaled by its factor; with the scaler's check, the combined verdict
  // into non_finite (1: some rank's shard is not finite), which the update reads and skips
  // itself on (a skipped step gathers every rank's unchanged shard); then the all-gather.
  // Waits on the host only for the collectives (Work::wait), never for the device's results.
  void queue_step(float share, nn::GradScaler* scaler, kernels::Tensor non_finite,
                  kernels::Tensor grad_norm);

  // zero/all_gather: every rank's shard of the flat parameters (each updated by its own
  // optimizer step) gathered into every rank's full buffer, the tail broadcast from the last
  // rank; last_times().all_gather. queue_step ends with it; an overlapped step (the whole
  // gradient all-reduced, the sharded optimizer stepped by the caller) calls it after the step.
  // Collective; waits for its collectives on the host.
  void gather_params();

  // The whole optimizer state, gathered from every rank's shard (all_gather of the equal
  // shards, the tail broadcast from the last rank), for a checkpoint that does not depend on
  // the world size: (name, (P) tensor on this rank's device) per state tensor, the same bytes
  // on every rank. Collective; allocates P floats per state tensor (a save, not a step).
  std::vector<std::pair<std::string, kernels::Tensor>> gather_optimizer_state() const;

  // > 0: the reduced gradient is clipped to this global 2-norm before the shard step: each
  // rank's shard's squared norm, one all_reduce(sum), the same factor on every rank. 0: off.
  void set_clip_grad_norm(float max_norm) { clip_ = max_norm; }
  // The global gradient norm of the last step (before clipping; 0 with clipping off).
  float last_grad_norm() const { return grad_norm_; }
  const ZeroShardPlan& plan() const { return plan_; }
  const ZeroStepTimes& last_times() const { return times_; }

 private:
  ProcessGroup& group_;
  nn::Module& module_;
  nn::Optimizer& optimizer_;
  ZeroShardPlan plan_;
  kernels::Tensor grad_shard_;  // (S): this rank's shard of the global gradient (queue_step's)
  kernels::Tensor mine_;        // (S): this rank's updated shard, sent to the others
  kernels::Tensor flags_;       // (2): step()'s verdict and norm, read on the host
  ZeroStepTimes times_;
  float clip_ = 0.f, grad_norm_ = 0.f;
};

}  // namespace dp::dist
