// The parts of one training step that DP's workers (dp/data_parallel.hpp) and DDP's ranks
// (dp/distributed/ddp_trainer.hpp) run alike, written once: the loss and its gradient after
// forward, the step's host values on the device, and the update after the gradients met (clip, the
// loss scaler's check, the optimizer), each queued on the device without a host read, so a captured
// step can replay it. Whether a step runs graphed at all is graphs_wanted (dp/graphs.hpp).
//
//   queue_loss(loss, out, labels, metrics.view(0, {1}), &dlogits, scaler, loss_scale);
//   ... backward(dlogits), the gradients reduced ...
//   scaler.prepare_deferred(optimizer);  // host, outside any graph
//   queue_update(grads, optimizer, scaler, clip, unscale, non_finite, grad_norm);
#pragma once

#include <algorithm>
#include <vector>

#include "kernels/ops.hpp"
#include "kernels/runtime/tensor.hpp"
#include "nn/amp.hpp"
#include "nn/clip.hpp"
#include "nn/loss.hpp"
#include "nn/optim.hpp"

namespace dp {

// The points a step marks on each device or rank (kernels::Event), in order: phase times and
// trace slices are the time between two of them, and later work waits on them. DDP has no
// replicate phase (its weights are the same on every rank after each step): it marks no
// kReplicated, and its forward starts at kScattered (its chunk copied in).
enum StepMark {
  kBegin,
  kScattered,
  kReplicated,
  kForwarded,
  kBackwarded,
  kReduced,
  kStepped,
  kStepMarks
};

// A step's host values where its kernels read them (kernels::Scalar: the loss scale and its
// inverse, the chunks' shares), so that a captured step replays with the current step's: one f32
// buffer on the device, made once (graphs hold its address) and rewritten only when a value
// changed. Each engine's device or rank has its own.
class StepScalars {
 public:
  // requires n >= 1, the same n every call. ensures the device holds values[0, n): the
  // buffer made on the first call (returns true: take its views with at() then), the values
  // written (queued on the current context) when one differs from the last written.
  bool write(const float* values, int n, const kernels::Device& device) {
    const bool made = !values_.defined();
    if (made) {
      values_ = kernels::Tensor::empty({n}, kernels::DType::f32, device);
    } else {
      DP_CHECK(static_cast<int>(written_.size()) == n,
               "StepScalars: " << n << " values for a buffer of " << written_.size());
      if (std::equal(values, values + n, written_.begin())) return false;  // held already
    }
    for (int at = 0; at < n; at += kernels::kMaxValues) {
      kernels::Tensor part = values_.view(at, {std::min(kernels::kMaxValues, n - at)});
      kernels::set_values(part, values + at, static_cast<int>(part.numel()));
    }
    written_.assign(values, values + n);  // once the writes are queued (their storage is reused)
    return made;
  }
  // requires write() called. ensures value i on the device, as the step's kernels read it.
  kernels::Scalar at(int i) const { return kernels::Scalar(values_.view(i, {1})); }

 private:
  kernels::Tensor values_;
  std::vector<float> written_;
};

// requires out the model's output for `labels` (as `loss` takes them), loss_out (1) f32 on out's
// device; dlogits null (forward only) or a buffer kept between steps; correct undefined or (1)
// f32 on out's device. ensures queued on the current context: loss_out := the loss's mean over
// the chunk; with dlogits, *dlogits := its gradient, times the loss scale read on the device at
// `loss_scale` where the scaler scales (fp16): `out` itself, overwritten, when out_free (nothing
// reads the output after the loss: !model.backward_reads_output()) and the loss writes its
// gradient in place (Loss::grad_in_place), else a buffer made again only when out's shape or
// dtype changed; a defined correct := the loss's count of right predictions
// (Loss::compute_and_count: one read of the output for both where the loss can).
inline void queue_loss(const nn::Loss& loss, const kernels::Tensor& out,
                       const kernels::Tensor& labels, kernels::Tensor loss_out,
                       kernels::Tensor* dlogits, const nn::GradScaler& scaler,
                       const kernels::Scalar& loss_scale,
                       kernels::Tensor correct = kernels::Tensor(), bool out_free = false) {
  // The output's dtype: f32, or a 16-bit one for a loss that takes it (nn::output_for).
  kernels::Tensor none;  // forward only: no gradient
  // No second buffer the size of the output (a GPT's (B, T, V) logits).
  if (dlogits && out_free && loss.grad_in_place()) *dlogits = out;
  kernels::Tensor& grad =
      dlogits ? kernels::ensure(*dlogits, out.shape(), out.dtype(), out.device()) : none;
  if (correct.defined())
    loss.compute_and_count(loss_out, grad, correct, out, labels);
  else
    loss.compute(loss_out, grad, out, labels);
  if (dlogits) scaler.scale_loss_grad(grad, loss_scale);  // fp16: the gradient carries the scale
}

// requires grads the step's final flat gradient (DP: device 0's reduced one; DDP: this rank's
// after the all-reduce), scaled by the loss scale whose inverse `unscale` holds on the device;
// non_finite and grad_norm (1) f32 on its device; scaler.prepare_deferred(optimizer) done for
// this step. ensures queued: grads clipped to the global norm clip_grad_norm when > 0 (the norm
// before it into grad_norm), the scaler's check into non_finite and the optimizer's update,
// which skips itself when the check fails. Reads nothing back: the caller reads both slots with
// the step's metrics and settles the scaler.
inline void queue_update(kernels::Tensor grads, nn::Optimizer& optimizer, nn::GradScaler& scaler,
                         float clip_grad_norm, const kernels::Scalar& unscale,
                         kernels::Tensor non_finite, kernels::Tensor grad_norm) {
  // One decision on the device: clipping scales the gradient by its norm there, and the update
  // skips itself when the check finds a non-finite value; the host learns both with the metrics.
  if (clip_grad_norm > 0.f) nn::clip_grad_norm_into(grads, clip_grad_norm, unscale, grad_norm);
  scaler.apply_deferred(optimizer, grads, non_finite);
}

}  // namespace dp
