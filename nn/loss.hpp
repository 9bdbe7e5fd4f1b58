// Losses. Each implements nn::Loss, the interface the engines (single device, DP, DDP, ZeRO-1,
// the parameter server) call: the value and gradient in one call, and the loss's denominator,
// from which each chunk of a batch gets its exact share. The classes also keep their own
// forward/backward pair for plain training loops: forward returns the loss as a (1) tensor on
// the device (no host sync), backward the gradient w.r.t. pred.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// A loss as the engines see it: a mean over a denominator (rows, kept tokens, elements).
// Implement it for a user-defined loss; the engines split a batch along dim 0, call compute on
// each chunk, and weight chunk i's mean by denominator(chunk i) / denominator(batch), so the
// result equals the loss of the whole batch on one device.
class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string name() const = 0;
  // requires target a host tensor (B, ...). Throws naming the shape or dtype it does not take.
  virtual void check_target(const Tensor& target) const = 0;
  // requires target a host tensor accepted by check_target. ensures the count this loss's mean
  // divides by for that target: rows, tokens not ignored, or elements. May be 0.
  virtual int64_t denominator(const Tensor& target) const = 0;
  // requires pred and target on one device; loss (1) f32; dpred like pred or undefined. pred
  // and dpred are f32, or with takes_16bit_pred() both pred's 16-bit dtype may be given.
  // ensures loss = the mean over denominator(target) (0 when it is 0) and, when dpred is
  // defined, dpred = d loss / d pred; queued on the device, no host sync.
  virtual void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
                       const Tensor& target) const = 0;
  // requires correct (1) f32 on pred's device. ensures correct = the predictions that are right
  // (rows or tokens), for reporting; 0 where that means nothing. Queued, no host sync.
  virtual void count_correct_into(Tensor& correct, const Tensor& pred, const Tensor& target) const {
    (void)pred, (void)target;
    kernels::fill(correct, 0.f);
  }
  // compute and count_correct_into in one call: the engines' step. A loss that finds both in one
  // read of pred (the cross-entropies) overrides it; the default makes the two calls.
  virtual void compute_and_count(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                                 const Tensor& target) const {
    compute(loss, dpred, pred, target);
    count_correct_into(correct, pred, target);
  }
  // The engines' step: compute_and_count (compute when `correct` is undefined) with dpred
  // multiplied by grad_scale, a factor read when the work runs (fp16's loss scale, a
  // micro-batch's weight). The default scales dpred in a second pass, after its rounding; a
  // loss that writes 16-bit dpred overrides it to multiply before the one rounding, so that no
  // value below the 16-bit range is lost before the scale lifts it (the cross-entropies, inside
  // their kernel: no second pass either).
  virtual void compute_scaled(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                              const Tensor& target, const kernels::Scalar& grad_scale) const {
    if (correct.defined())
      compute_and_count(loss, dpred, correct, pred, target);
    else
      compute(loss, dpred, pred, target);
    if (dpred.defined() && (grad_scale.at.defined() || grad_scale.value != 1.f))
      kernels::scale(dpred, dpred, grad_scale);
  }
  // Whether compute and count_correct_into take a bf16 or f16 pred and write dpred in its dtype
  // (f32 arithmetic inside, each gradient value rounded once), so that a model under 16-bit
  // activations can hand its output over without an f32 copy (Module::set_output). A loss
  // that only reads f32 keeps the default: the engines then give it f32.
  virtual bool takes_16bit_pred() const { return false; }
  // Whether compute_scaled multiplies a 16-bit dpred by grad_scale before its one rounding (an
  // override as the cross-entropies' is): only such a loss is handed fp16 predictions under
  // fp16 (nn::output_for), since the default's second pass would scale values that the
  // rounding to fp16 already flushed to zero. bf16, with f32's range, needs no such care.
  virtual bool scales_before_rounding() const { return false; }
  // Whether compute may be given dpred = pred (the gradient written over the prediction): the
  // engines then keep no second buffer the size of the model's output (a GPT's (B, T, V)
  // logits). A loss that reads pred after writing dpred keeps the default.
  virtual bool grad_in_place() const { return false; }
  // count_correct_into read back to the host (waits).
  int64_t count_correct(const Tensor& pred, const Tensor& target) const {
    Tensor correct = Tensor::empty({1}, DType::f32, pred.device());
    count_correct_into(correct, pred, target);
    return static_cast<int64_t>(correct.item());
  }
};
using LossPtr = std::shared_ptr<const Loss>;

// Softmax cross-entropy with optional label smoothing, averaged over the batch.
// pred (B, C) logits, target (B) i32 class indices in [0, C).
class CrossEntropyLoss : public Loss {
 public:
  // requires 0 <= label_smoothing < 1.
  explicit CrossEntropyLoss(float label_smoothing = 0.f) : smoothing_(label_smoothing) {
    DP_CHECK(label_smoothing >= 0.f && label_smoothing < 1.f,
             "CrossEntropyLoss(" << label_smoothing << "): label_smoothing must be in [0, 1)");
  }

  // ensures returns the mean loss (1); caches dpred (B, C) for backward().
  Tensor forward(const Tensor& pred, const Tensor& target) {
    DP_CHECK(pred.ndim() == 2 && target.ndim() == 1 && target.dim(0) == pred.dim(0) &&
                 target.dtype() == DType::i32,
             "CrossEntropyLoss: pred " << kernels::shape_str(pred.shape()) << " must be (B, C) and"
                                       << " target " << kernels::shape_str(target.shape())
                                       << " (B) i32");
    Tensor loss = Tensor::empty({1}, DType::f32, pred.device());
    dpred_ = Tensor::empty(pred.shape(), DType::f32, pred.device());
    kernels::softmax_cross_entropy(loss, dpred_, pred, target, Tensor(), smoothing_);
    return loss;
  }
  // requires forward() ran. ensures d(loss)/d(pred) (B, C).
  Tensor backward() const {
    DP_CHECK(dpred_.defined(), "CrossEntropyLoss::backward called before forward");
    return dpred_;
  }
  float label_smoothing() const { return smoothing_; }

  std::string name() const override { return "cross_entropy"; }
  bool takes_16bit_pred() const override { return true; }
  bool scales_before_rounding() const override { return true; }
  bool grad_in_place() const override { return true; }
  void check_target(const Tensor& target) const override {
    DP_CHECK(target.ndim() == 1 && target.dtype() == DType::i32,
             "cross_entropy: labels " << target << " must be (B) i32");
  }
  int64_t denominator(const Tensor& target) const override { return target.dim(0); }
  void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
               const Tensor& target) const override {
    kernels::softmax_cross_entropy(loss, dpred, pred, target, Tensor(), smoothing_);
  }
  void count_correct_into(Tensor& correct, const Tensor& pred,
                          const Tensor& target) const override {
    kernels::count_correct_into(correct, pred, target);
  }
  void compute_and_count(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                         const Tensor& target) const override {
    kernels::softmax_cross_entropy(loss, dpred, pred, target, Tensor(), smoothing_, correct);
  }
  void compute_scaled(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                      const Tensor& target, const kernels::Scalar& grad_scale) const override {
    kernels::softmax_cross_entropy(loss, dpred, pred, target, Tensor(), smoothing_, correct,
                                   grad_scale);
  }

 private:
  float smoothing_;
  Tensor dpred_;
};

// Mean squared error over all elements: pred and target the same shape.
class MSELoss : public Loss {
 public:
  Tensor forward(const Tensor& pred, const Tensor& target) {
    DP_CHECK(pred.shape() == target.shape(),
             "MSELoss: pred " << kernels::shape_str(pred.shape()) << " and target "
                              << kernels::shape_str(target.shape()) << " differ");
    Tensor loss = Tensor::empty({1}, DType::f32, pred.device());
    dpred_ = Tensor::empty(pred.shape(), DType::f32, pred.device());
    kernels::mse_loss(loss, dpred_, pred, target);
    return loss;
  }
  Tensor backward() const {
    DP_CHECK(dpred_.defined(), "MSELoss::backward called before forward");
    return dpred_;
  }

  std::string name() const override { return "mse"; }
  void check_target(const Tensor& target) const override {
    DP_CHECK(target.ndim() >= 1 && target.dtype() == DType::f32,
             "mse: targets " << target << " must be (B, ...) f32");
  }
  int64_t denominator(const Tensor& target) const override { return target.numel(); }
  void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
               const Tensor& target) const override {
    // The same shape, but for dims of 1 ((B, 1) predictions of (B) targets): a target of the
    // same size in another shape (transposed) would pair other elements.
    auto squeezed = [](const Shape& s) {
      Shape out;
      for (int64_t d : s)
        if (d != 1) out.push_back(d);
      return out;
    };
    DP_CHECK(squeezed(pred.shape()) == squeezed(target.shape()),
             "mse: pred " << kernels::shape_str(pred.shape()) << " and target "
                          << kernels::shape_str(target.shape())
                          << " differ in shape (other than in dims of 1)");
    kernels::mse_loss(loss, dpred, pred, target.reshape(pred.shape()));
  }

 private:
  Tensor dpred_;
};

// Token cross-entropy of a language model: logits (B, T, V), targets (B, T) i32, the mean over
// the tokens whose target is not ignore_index (PyTorch's F.cross_entropy(logits.view(-1, V),
// targets.view(-1), ignore_index=...)).
class TokenCrossEntropyLoss : public Loss {
 public:
  explicit TokenCrossEntropyLoss(int32_t ignore_index = -1) : ignore_(ignore_index) {}
  int32_t ignore_index() const { return ignore_; }

  std::string name() const override { return "token_cross_entropy"; }
  bool takes_16bit_pred() const override { return true; }
  bool scales_before_rounding() const override { return true; }
  bool grad_in_place() const override { return true; }
  void check_target(const Tensor& target) const override {
    DP_CHECK(target.ndim() == 2 && target.dtype() == DType::i32,
             "token_cross_entropy: targets " << target << " must be (B, T) i32");
  }
  int64_t denominator(const Tensor& target) const override {
    DP_CHECK(target.device().is_cpu() && target.dtype() == DType::i32,
             "token_cross_entropy: denominator needs host i32 targets, got " << target);
    const int32_t* t = target.data<int32_t>();
    int64_t kept = 0;
    for (int64_t i = 0; i < target.numel(); ++i) kept += t[i] != ignore_ ? 1 : 0;
    return kept;
  }
  void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
               const Tensor& target) const override {
    Tensor none;
    compute_and_count(loss, dpred, none, pred, target);
  }
  // The tokens whose target is not ignore_index and whose logits' argmax is that target (an
  // ignored token is never counted, whatever ignore_index is). Reads the logits once for the
  // loss and the count; the loss's value is left in a scratch (1).
  void count_correct_into(Tensor& correct, const Tensor& pred,
                          const Tensor& target) const override {
    Tensor loss = Tensor::empty({1}, DType::f32, pred.device()), none;
    compute_and_count(loss, none, correct, pred, target);
  }
  void compute_and_count(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                         const Tensor& target) const override {
    compute_scaled(loss, dpred, correct, pred, target, kernels::Scalar());
  }
  void compute_scaled(Tensor& loss, Tensor& dpred, Tensor& correct, const Tensor& pred,
                      const Tensor& target, const kernels::Scalar& grad_scale) const override {
    const int64_t v = pred.ndim() >= 1 ? pred.dim(-1) : 0;
    DP_CHECK(pred.ndim() == 3 && target.ndim() == 2 && pred.dim(0) == target.dim(0) &&
                 pred.dim(1) == target.dim(1),
             "token_cross_entropy: logits " << kernels::shape_str(pred.shape())
                                            << " must be (B, T, V) and targets "
                                            << kernels::shape_str(target.shape()) << " (B, T)");
    const int64_t rows = target.numel();
    Tensor d2 = dpred.defined() ? dpred.reshape({rows, v}) : Tensor();
    kernels::token_cross_entropy(loss, d2, pred.reshape({rows, v}), target.reshape({rows}), ignore_,
                                 correct, grad_scale);
  }

 private:
  int32_t ignore_;
};

// Whether a language model with a chunked classifier of `chunk` tokens (0: none) takes `loss`
// in its forward for these labels (Module::takes_loss): a token cross-entropy over more tokens
// than a chunk, unless the model is checkpointed as a whole (`recomputes`: its forward would run
// the loss again).
inline bool takes_chunked_token_loss(int64_t chunk, bool recomputes, const Loss& loss,
                                     const Tensor& labels) {
  return chunk > 0 && labels.numel() > chunk && !recomputes &&
         dynamic_cast<const TokenCrossEntropyLoss*>(&loss) != nullptr;
}

// The chunked classifier of a language model whose forward takes the loss (Module::takes_loss:
// nn::Gpt, nn::Llama; GptConfig::loss_chunk): its LM head's logits = hidden weight^T and the token
// cross-entropy over them, `chunk` tokens at a time (one reused (chunk, V) buffer of
// logits_dtype), never holding the whole (N, V) logits; in training (r.grad) each chunk's loss
// gradient (times r.grad_scale) written over its logits and taken straight into the head's two
// backward GEMMs. Each chunk's loss is given the whole batch's count of kept tokens
// (kernels::count_kept), so each token's gradient has the bits of one loss over every token;
// the sums (the loss, the weight's gradient) are added in another order.
// requires r.loss a TokenCrossEntropyLoss over r.labels of N tokens (throws naming `who`, the
// loss and the labels otherwise); hidden (N, D) and weight (V, D) in one dtype on r.labels'
// device; grad (V, D) f32; chunk >= 1. ensures queued: r.loss_out, a defined r.correct as
// LossInForward says, r.taken; with r.grad, grad += d weight and returns d hidden (N, D) in
// dhidden_dtype, else an undefined tensor.
inline Tensor chunked_token_loss(LossInForward& r, const Tensor& hidden, const Tensor& weight,
                                 Tensor& grad, int64_t chunk, DType logits_dtype,
                                 DType dhidden_dtype, const std::string& who) {
  const auto* loss = dynamic_cast<const TokenCrossEntropyLoss*>(r.loss);
  const int64_t rows = hidden.ndim() == 2 ? hidden.dim(0) : -1;
  DP_CHECK(loss && r.labels.numel() == rows && chunk >= 1,
           who << ": the chunked classifier takes token_cross_entropy over one label per row of "
               << hidden << ", in chunks of >= 1; got "
               << (r.loss ? r.loss->name() : std::string("no loss")) << " over " << r.labels
               << ", chunks of " << chunk);
  r.taken = true;
  kernels::NvtxRange range("nn/chunked_token_loss");
  chunk = std::min(chunk, std::max<int64_t>(rows, 1));
  const int64_t n = (rows + chunk - 1) / chunk, vocab = weight.dim(0);
  const kernels::Device dev = hidden.device();
  const Tensor targets = r.labels.reshape({rows});
  // Per chunk its loss, then per chunk its count of right tokens, then the batch's kept count.
  Tensor slots = Tensor::empty({2 * n + 1}, DType::f32, dev);
  Tensor kept = slots.view(2 * n, {1});
  kernels::count_kept(kept, targets, loss->ignore_index());
  Tensor logits = Tensor::empty({chunk, vocab}, logits_dtype, dev);
  Tensor dhidden = r.grad ? Tensor::empty({rows, hidden.dim(1)}, dhidden_dtype, dev) : Tensor();
  for (int64_t j = 0, r0 = 0; j < n; ++j, r0 += chunk) {
    const int64_t r1 = std::min(rows, r0 + chunk);
    Tensor lj = logits.view(0, {r1 - r0, vocab});
    const Tensor hj = hidden.slice(r0, r1);
    kernels::gemm(lj, hj, kernels::Transpose::no, weight, kernels::Transpose::yes);
    Tensor dj = r.grad ? lj : Tensor();  // written over the logits
    Tensor lossj = slots.view(j, {1});
    kernels::token_cross_entropy(lossj, dj, lj, targets.slice(r0, r1), loss->ignore_index(),
                                 r.correct.defined() ? slots.view(n + j, {1}) : Tensor(),
                                 r.grad_scale, kept);
    if (!r.grad) continue;
    const Tensor dl = lj.dtype() == weight.dtype() ? lj : kernels::cast(lj, weight.dtype());
    Tensor dhj = dhidden.slice(r0, r1);
    kernels::gemm(dhj, dl, kernels::Transpose::no, weight, kernels::Transpose::no);
    kernels::gemm(grad, dl, kernels::Transpose::yes, hj, kernels::Transpose::no, 1.f, 1.f);
  }
  kernels::sum(r.loss_out, slots.view(0, {n}));
  if (r.correct.defined()) kernels::sum(r.correct, slots.view(n, {n}));
  return dhidden;
}

}  // namespace nn
