// Losses: forward returns the loss as a (1) tensor on the device (no host sync; call .item()
// when the value is needed), backward returns the gradient of that loss w.r.t. pred, computed
// in the same fused kernel as the forward.
#pragma once

#include "nn/module.hpp"

namespace nn {

// Softmax cross-entropy with optional label smoothing, averaged over the batch.
// pred (B, C) logits, target (B) i32 class indices in [0, C).
class CrossEntropyLoss {
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

 private:
  float smoothing_;
  Tensor dpred_;
};

// Mean squared error over all elements: pred and target the same shape.
class MSELoss {
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

 private:
  Tensor dpred_;
};

}  // namespace nn
