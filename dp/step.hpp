// The parts of one training step that DP's workers (dp/data_parallel.hpp) and DDP's ranks
// (dp/distributed/ddp_trainer.hpp) run alike, written once: the loss and its gradient after
// forward (or a chunk's micro-batches: MicroBatches), the step's host values on the device, and the
// update after the gradients met (clip, the loss scaler's check, the optimizer), each queued on the
// device without a host read, so a captured step can replay it. Whether a step runs graphed at all
// is graphs_wanted (dp/graphs.hpp).
//
//   queue_loss(loss, out, labels, metrics.view(0, {1}), &dlogits,
//              scaler.loss_grad_factor(loss_scale));
//   ... backward(dlogits), the gradients reduced ...
//   scaler.prepare_deferred(optimizer);  // host, outside any graph
//   queue_update(grads, optimizer, scaler, clip, unscale, non_finite, grad_norm);
#pragma once

#include <algorithm>
#include <map>
#include <vector>

#include "dp/chunks.hpp"
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
// the chunk; with dlogits, *dlogits := its gradient times grad_scale (fp16's loss scale, a
// micro-batch's weight; read on the device when the loss runs, inside the loss's own pass where
// it can: Loss::compute_scaled): `out` itself, overwritten, when out_free (nothing reads the
// output after the loss: !model.backward_reads_output()) and the loss writes its gradient in
// place (Loss::grad_in_place), else a buffer made again only when out's shape or dtype changed;
// a defined correct := the loss's count of right predictions (one read of the output for both
// where the loss can).
inline void queue_loss(const nn::Loss& loss, const kernels::Tensor& out,
                       const kernels::Tensor& labels, kernels::Tensor loss_out,
                       kernels::Tensor* dlogits, const kernels::Scalar& grad_scale,
                       kernels::Tensor correct = kernels::Tensor(), bool out_free = false) {
  // The output's dtype: f32, or a 16-bit one for a loss that takes it (nn::output_for).
  kernels::Tensor none;  // forward only: no gradient
  // No second buffer the size of the output (a GPT's (B, T, V) logits).
  if (dlogits && out_free && loss.grad_in_place()) *dlogits = out;
  kernels::Tensor& grad =
      dlogits ? kernels::ensure(*dlogits, out.shape(), out.dtype(), out.device()) : none;
  loss.compute_scaled(loss_out, grad, correct, out, labels, grad_scale);
}

// requires the arguments as queue_loss's, with `forward` the model's forward of `model` (the
// root whose takes_loss is asked) and x its input. ensures queued on the current context: the
// forward of x and queue_loss after it, returning the output; or, where the model takes the loss
// in its forward (nn::Module::takes_loss: nn::Gpt's chunked classifier, which never holds the
// whole (B, T, V) logits), that forward alone, given the loss (nn::LossInForward), which writes
// loss_out and correct as queue_loss would: then the output returned and *dlogits are undefined,
// and the model's backward takes the undefined *dlogits.
template <class Forward>
kernels::Tensor queue_forward_and_loss(nn::Module& model, Forward&& forward, const nn::Loss& loss,
                                       const kernels::Tensor& x, const kernels::Tensor& labels,
                                       kernels::Tensor loss_out, kernels::Tensor* dlogits,
                                       const kernels::Scalar& grad_scale,
                                       kernels::Tensor correct = kernels::Tensor(),
                                       bool out_free = false) {
  if (!model.takes_loss(loss, labels)) {
    kernels::Tensor out = forward(x);
    queue_loss(loss, out, labels, loss_out, dlogits, grad_scale, correct, out_free);
    return out;
  }
  nn::LossInForward request;
  request.loss = &loss;
  request.labels = labels;
  request.loss_out = loss_out;
  request.correct = correct;
  request.grad_scale = grad_scale;
  request.grad = dlogits != nullptr;
  struct Handed {  // for this forward only, whatever it throws
    nn::Module& m;
    ~Handed() { m.set_loss_in_forward(nullptr); }
  } handed{model};
  model.set_loss_in_forward(&request);
  (void)forward(x);
  DP_CHECK(request.taken, model.type_name()
                              << ": takes_loss said it takes the loss '" << loss.name()
                              << "' in its forward, which did not take it");
  if (dlogits) *dlogits = kernels::Tensor();
  return kernels::Tensor();
}

// Gradient accumulation (DataParallelOptions::micro_batches, DdpTrainer::set_micro_batches): a
// device's or rank's chunk of a step runs as micro-batches, one after another, whose gradients add
// up before the reduction, as PyTorch's loop of backward() calls before optimizer.step(): the
// activations of one micro-batch live at a time. Each micro-batch's loss gradient is weighted on
// the device by its share of the chunk's loss denominator, so the sum is the chunk's gradient, the
// reduction and the update run once, and the step follows the same loss curve as one pass over
// the chunk (within f32 rounding: the gradient is summed in another order).
//
//   micro.plan(loss, host_labels_of_the_chunk);  // each step, before its work is queued
//   micro.write_weights(device, scaler.scale());   // outside any graph
//   out = micro.queue(forward, local_backward, loss, input, labels, loss_out, &dlogits, ...);
//   ... the step's backward(dlogits): the last micro-batch's, with the hooks that reduce ...
class MicroBatches {
 public:
  // requires k >= 1 (1: off, one pass over the chunk).
  void set(int k) {
    DP_CHECK(k >= 1, "micro_batches " << k << ": 1 or more");
    k_ = k;
  }
  int asked() const { return k_; }
  // requires labels the chunk's host labels, as `loss` takes them. ensures count() = min(k, rows)
  // micro-batches (1 for an empty chunk) of balanced rows (dp/chunks.hpp), each weighted by its
  // share of the chunk's loss denominator (all 0 when that is 0: a zero loss and gradient).
  void plan(const nn::Loss& loss, const kernels::Tensor& labels) {
    const int64_t rows = labels.dim(0);
    sizes_ = chunk_sizes(rows, static_cast<int>(std::clamp<int64_t>(rows, 1, k_)));
    denominators_.resize(sizes_.size());
    int64_t begin = 0;
    for (size_t j = 0; j < sizes_.size(); begin += sizes_[j++])
      denominators_[j] = loss.denominator(labels.slice(begin, begin + sizes_[j]));
    weights_ = loss_shares(denominators_);
  }
  int count() const { return static_cast<int>(sizes_.size()); }
  // requires plan() done; loss_scale the step's (GradScaler::scale(): 1 without scaling).
  // ensures on `device`, where queue()'s kernels read them (no graph bakes them in), queued on
  // the current context when they changed: the weights, and the factors each micro-batch's loss
  // gradient is multiplied by (its weight times the loss scale, which multiplies nothing but the
  // exponent: a power of two). Outside any graph. What queue() reads is kept by count(), made
  // the first time a count runs and kept (a graph of a chunk of that many rows holds its
  // addresses): memory grows with the micro-batches that run, not with the k asked for.
  void write_weights(const kernels::Device& device, float loss_scale) {
    const int n = count();
    host_.resize(2 * static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      host_[j] = weights_[j];
      host_[n + j] = weights_[j] * loss_scale;
    }
    at_ = &by_count_[n];
    if (!at_->on_device.write(host_.data(), 2 * n, device)) return;
    for (int j = 0; j < n; ++j) {
      at_->weight.push_back(at_->on_device.at(j));
      at_->grad_factor.push_back(at_->on_device.at(n + j));
    }
  }
  // requires plan() and write_weights() done for this step, count() > 1, input and labels the
  // chunk on the device, the module's gradients zeroed; the rest as queue_loss's. ensures queued on
  // the current context, for each micro-batch j in order: out_j = forward(rows of j), its loss into
  // a slot of its own and its gradient, times its factor (write_weights) inside the loss's pass,
  // then, for every one but the last, backward(its gradient), which must only accumulate (no hook
  // hands a bucket on: the chunk's gradient is not final yet), the weights' 16-bit copy the first
  // forward made kept for the next (module's FlatState::compute_written); the last one's gradient
  // in *dlogits for the step's backward; loss_out := the weighted sum of the micro-batches' mean
  // losses and a defined correct := the sum of their counts. Returns the last micro-batch's
  // output.
  template <class Forward, class Backward>
  kernels::Tensor queue(nn::Module& module, Forward&& forward, Backward&& backward,
                        const nn::Loss& loss, const kernels::Tensor& input,
                        const kernels::Tensor& labels, kernels::Tensor loss_out,
                        kernels::Tensor* dlogits, kernels::Tensor correct, bool out_free) {
    const int n = count();
    DP_CHECK(n > 1 && at_ != nullptr && static_cast<int>(at_->weight.size()) == n,
             "MicroBatches::queue: plan() and write_weights() first, for more than one");
    PerCount& b = *at_;
    if (!b.slots.defined()) {  // made once, on the first (uncaptured) step of n micro-batches
      b.slots = kernels::Tensor::zeros({2 * n}, kernels::DType::f32, loss_out.device());
      for (int j = 0; j < n; ++j) {
        b.losses.push_back(b.slots.view(j, {1}));
        b.counts.push_back(b.slots.view(n + j, {1}));
      }
      b.ones.assign(static_cast<size_t>(n), kernels::Scalar(1.f));
    }
    kernels::Tensor out;
    int64_t begin = 0;
    for (int j = 0; j < n; begin += sizes_[j++]) {
      const int64_t end = begin + sizes_[j];
      const bool last = j == n - 1;
      kernels::Tensor dy;
      kernels::Tensor* grad = last ? dlogits : &dy;
      out = queue_forward_and_loss(module, forward, loss, input.slice(begin, end),
                                   labels.slice(begin, end), b.losses[j], grad, b.grad_factor[j],
                                   correct.defined() ? b.counts[j] : kernels::Tensor(), out_free);
      if (!last) {
        backward(dy);
        // The weights' 16-bit copy this forward cast or took still holds the f32 weights
        // rounded (a backward only accumulates): the next forward takes it as it is.
        module.flat().compute_copy_fresh();
      }
    }
    kernels::fill(loss_out, 0.f);
    kernels::weighted_sum(loss_out, 1.f, b.losses, b.weight);
    if (correct.defined()) {
      kernels::fill(correct, 0.f);
      kernels::weighted_sum(correct, 1.f, b.counts, b.ones);
    }
    return out;
  }

 private:
  // What queue() reads for one count of micro-batches, on the device: the weights and gradient
  // factors (on_device's views), and each micro-batch's loss and count slot.
  struct PerCount {
    StepScalars on_device;
    std::vector<kernels::Scalar> weight, grad_factor, ones;
    kernels::Tensor slots;  // (2 n) f32: each micro-batch's loss, then its count
    std::vector<kernels::Tensor> losses, counts;
  };
  int k_ = 1;
  std::vector<int64_t> sizes_, denominators_;  // this step's (plan)
  std::vector<float> weights_;                 // this step's, one per micro-batch
  std::vector<float> host_;                    // what write_weights writes
  std::map<int, PerCount> by_count_;           // by count(): its entries never move
  PerCount* at_ = nullptr;                     // this step's
};

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
