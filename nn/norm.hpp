// Normalisation layers: BatchNorm1d, BatchNorm2d, LayerNorm.
#pragma once

#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// BatchNorm over every dim but 1, PyTorch semantics: gamma (C) = 1, beta (C) = 0; buffers
// running_mean (C) = 0 and running_var (C) = 1. Training normalises with the batch statistics
// (biased variance) and updates the running ones with `momentum` (unbiased variance); eval
// normalises with the running statistics.
class BatchNormBase : public Module {
 public:
  int64_t num_features() const { return c_; }
  float momentum() const { return momentum_; }
  float eps() const { return eps_; }
  Parameter& weight() { return *gamma_; }
  Parameter& bias() { return *beta_; }
  Buffer& running_mean() { return *running_mean_; }
  Buffer& running_var() { return *running_var_; }

 protected:
  BatchNormBase(int64_t num_features, float momentum, float eps)
      : c_(num_features), momentum_(momentum), eps_(eps) {
    DP_CHECK(c_ > 0 && momentum >= 0.f && momentum <= 1.f && eps > 0.f,
             "BatchNorm(" << c_ << ", momentum " << momentum << ", eps " << eps
                          << "): invalid configuration");
    gamma_ = &register_parameter("weight", {c_}, InitSpec::constant(1.f));
    beta_ = &register_parameter("bias", {c_}, InitSpec::constant(0.f));
    running_mean_ = &register_buffer("running_mean", {c_}, 0.f);
    running_var_ = &register_buffer("running_var", {c_}, 1.f);
  }

  // requires x4 (N, C, ...) with dim 1 == C (checked by the subclass).
  Tensor normalize(const Tensor& x) {
    x_ = x;
    Tensor y = Tensor::empty(x.shape(), DType::f32, x.device());
    train_forward_ = is_training();
    if (train_forward_) {
      DP_CHECK(x.numel() / c_ > 1, type_name() << "(" << c_ << "): training needs more than one "
                                               << "value per channel, got input "
                                               << kernels::shape_str(x.shape()));
      save_mean_ = Tensor::empty({c_}, DType::f32, x.device());
      save_invstd_ = Tensor::empty({c_}, DType::f32, x.device());
      kernels::batch_norm_forward_train(y, save_mean_, save_invstd_, running_mean_->value,
                                        running_var_->value, x, gamma_->value, beta_->value,
                                        momentum_, eps_);
    } else {
      kernels::batch_norm_forward_eval(y, x, gamma_->value, beta_->value, running_mean_->value,
                                       running_var_->value, eps_);
    }
    return y;
  }

  Tensor normalize_backward(const Tensor& dy) {
    DP_CHECK(x_.defined(), type_name() << "::backward called before forward");
    Tensor dx = Tensor::empty(x_.shape(), DType::f32, dy.device());
    if (train_forward_) {
      kernels::batch_norm_backward(dx, gamma_->grad, beta_->grad, dy, x_, gamma_->value, save_mean_,
                                   save_invstd_, kernels::Accumulate::yes);
      return dx;
    }
    // Eval: y = gamma xhat + beta with xhat = (x - rm) / sqrt(rv + eps) a per-channel affine map,
    // so dx = dy gamma / sqrt(rv + eps), dgamma += sum dy xhat, dbeta += sum dy.
    Tensor zeros = Tensor::zeros({c_}, DType::f32, dy.device());
    Tensor ones = Tensor::empty({c_}, DType::f32, dy.device());
    kernels::fill(ones, 1.f);
    kernels::batch_norm_forward_eval(dx, dy, gamma_->value, zeros, zeros, running_var_->value,
                                     eps_);
    Tensor xhat = Tensor::empty(x_.shape(), DType::f32, dy.device());
    kernels::batch_norm_forward_eval(xhat, x_, ones, zeros, running_mean_->value,
                                     running_var_->value, eps_);
    Tensor dy_xhat = Tensor::empty(x_.shape(), DType::f32, dy.device());
    kernels::mul(dy_xhat, dy, xhat);
    kernels::bias_backward(gamma_->grad, dy_xhat, kernels::Accumulate::yes);
    kernels::bias_backward(beta_->grad, dy, kernels::Accumulate::yes);
    return dx;
  }

  int64_t c_;
  float momentum_, eps_;

 private:
  Parameter* gamma_ = nullptr;
  Parameter* beta_ = nullptr;
  Buffer* running_mean_ = nullptr;
  Buffer* running_var_ = nullptr;
  bool train_forward_ = true;       // whether the cached forward used batch statistics
  Tensor x_;                        // cached input (N, C, ...)
  Tensor save_mean_, save_invstd_;  // (C) batch statistics of the cached forward
};

// x (N, C) or (N, C, L).
class BatchNorm1d : public BatchNormBase {
 public:
  explicit BatchNorm1d(int64_t num_features, float momentum = 0.1f, float eps = 1e-5f)
      : BatchNormBase(num_features, momentum, eps) {}
  std::string type_name() const override { return "BatchNorm1d"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK((x.ndim() == 2 || x.ndim() == 3) && x.dim(1) == c_,
             "BatchNorm1d(" << c_ << "): input " << kernels::shape_str(x.shape()) << " must be (N, "
                            << c_ << ") or (N, " << c_ << ", L)");
    x_shape_ = x.shape();
    // (N, C, L) runs as (N, C, L, 1): the op normalises over every dim but 1 either way.
    Tensor x4 = x.ndim() == 3 ? x.reshape({x.dim(0), c_, x.dim(2), 1}) : x;
    return normalize(x4).reshape(x_shape_);
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor dy4 = x_shape_.size() == 3 ? dy.reshape({x_shape_[0], c_, x_shape_[2], 1}) : dy;
    return normalize_backward(dy4).reshape(x_shape_);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<BatchNorm1d>(c_, momentum_, eps_);
  }

 private:
  Shape x_shape_;
};

// x (N, C, H, W).
class BatchNorm2d : public BatchNormBase {
 public:
  explicit BatchNorm2d(int64_t num_features, float momentum = 0.1f, float eps = 1e-5f)
      : BatchNormBase(num_features, momentum, eps) {}
  std::string type_name() const override { return "BatchNorm2d"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() == 4 && x.dim(1) == c_, "BatchNorm2d(" << c_ << "): input "
                                                             << kernels::shape_str(x.shape())
                                                             << " must be (N, " << c_ << ", H, W)");
    return normalize(x);
  }
  Tensor backward_impl(const Tensor& dy) override { return normalize_backward(dy); }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<BatchNorm2d>(c_, momentum_, eps_);
  }
};

// LayerNorm over the last dim: x (..., D) -> y (..., D); gamma (D) = 1, beta (D) = 0.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, float eps = 1e-5f) : d_(dim), eps_(eps) {
    DP_CHECK(d_ > 0 && eps > 0.f, "LayerNorm(" << d_ << ", eps " << eps << "): invalid");
    gamma_ = &register_parameter("weight", {d_}, InitSpec::constant(1.f));
    beta_ = &register_parameter("bias", {d_}, InitSpec::constant(0.f));
  }
  std::string type_name() const override { return "LayerNorm"; }
  int64_t dim() const { return d_; }
  Parameter& weight() { return *gamma_; }
  Parameter& bias() { return *beta_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() >= 1 && x.dim(-1) == d_, "LayerNorm(" << d_ << "): input "
                                                            << kernels::shape_str(x.shape())
                                                            << " must be (..., " << d_ << ")");
    x_shape_ = x.shape();
    const int64_t rows = x.numel() / d_;
    x2_ = x.reshape({rows, d_});  // (M, D)
    save_mean_ = Tensor::empty({rows}, DType::f32, x.device());
    save_rstd_ = Tensor::empty({rows}, DType::f32, x.device());
    Tensor y = Tensor::empty({rows, d_}, DType::f32, x.device());
    kernels::layer_norm_forward(y, save_mean_, save_rstd_, x2_, gamma_->value, beta_->value, eps_);
    return y.reshape(x_shape_);
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x2_.defined(), "LayerNorm::backward called before forward");
    Tensor dx = Tensor::empty(x2_.shape(), DType::f32, dy.device());
    kernels::layer_norm_backward(dx, gamma_->grad, beta_->grad, dy.reshape(x2_.shape()), x2_,
                                 gamma_->value, save_mean_, save_rstd_, kernels::Accumulate::yes);
    return dx.reshape(x_shape_);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<LayerNorm>(d_, eps_);
  }

 private:
  int64_t d_;
  float eps_;
  Parameter* gamma_ = nullptr;
  Parameter* beta_ = nullptr;
  Shape x_shape_;
  Tensor x2_;                     // cached input as (M, D)
  Tensor save_mean_, save_rstd_;  // (M)
};

}  // namespace nn
