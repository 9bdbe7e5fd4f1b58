// Normalisation layers: BatchNorm1d, BatchNorm2d, LayerNorm.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.hpp"

namespace nn {

// How BatchNorm replicas combine their statistics (SyncBatchNorm). nn/ declares it and dp/
// implements it, for the devices of a DP step (threads) and the ranks of a DDP job: a model
// does not know how it is parallelised.
class StatsSync {
 public:
  virtual ~StatsSync() = default;
  // Collective over the replicas of one step, called by each in the same layer order.
  // requires every replica passes the same number of values. ensures values[k] = the sum of
  // every replica's values[k].
  virtual void all_reduce_sum(std::vector<double>& values) = 0;
};

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
  // SyncBatchNorm: with a sync, training normalises with the statistics of every replica's
  // rows together (count, sum and sum of squares combined in one all_reduce), and backward
  // combines the sums of dy and dy xhat the same way; the running variance takes the global
  // unbiased variance. Without one (nullptr, the default) each replica normalises its own rows.
  // A replica's gradients stay those of its own rows' mean loss, so DP and DDP weigh them by
  // the rows' share of the batch as for any layer.
  void set_sync(std::shared_ptr<StatsSync> sync) { sync_ = std::move(sync); }
  bool synced() const { return sync_ != nullptr; }

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

  // Under 16-bit activations the input is widened: the statistics and y are f32, and dx takes
  // the input's dtype again.
  DType x_dtype_ = DType::f32;

  // requires x4 (N, C, ...) with dim 1 == C (checked by the subclass).
  Tensor normalize(const Tensor& x) {
    x_ = x;
    Tensor y = Tensor::empty(x.shape(), DType::f32, x.device());
    train_forward_ = is_training();
    if (train_forward_ && recomputing()) return normalize_again(x, y);
    if (train_forward_ && sync_) return normalize_synced(x, y);
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
    if (train_forward_ && sync_) return normalize_backward_synced(dy, dx);
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
  // y[n, c, ...] = scale[c] x[n, c, ...] + shift[c], through the eval-mode op (running mean 0,
  // running variance 1 - eps, so that its 1 / sqrt(var + eps) is 1).
  static void channel_affine(Tensor& y, const Tensor& x, const std::vector<double>& scale,
                             const std::vector<double>& shift, float eps) {
    int64_t c = static_cast<int64_t>(scale.size());
    Device d = x.device();
    Tensor s = Tensor::from_vector(std::vector<float>(scale.begin(), scale.end()), {c}, d);
    Tensor b = Tensor::from_vector(std::vector<float>(shift.begin(), shift.end()), {c}, d);
    Tensor zero = Tensor::zeros({c}, DType::f32, d);
    Tensor one = Tensor::from_vector(std::vector<float>(c, 1.f - eps), {c}, d);
    kernels::batch_norm_forward_eval(y, x, s, b, zero, one, eps);
  }
  static std::vector<double> to_doubles(const Tensor& t) {
    std::vector<float> f = t.to_host_f32();
    return std::vector<double>(f.begin(), f.end());
  }

  // A checkpointed module's forward run again (Module::set_recompute): y as the first run made
  // it, and no side effect. The running statistics took this step's update in the first run,
  // so the kernel updates copies; synced, the kept global statistics give y without a second
  // exchange, as the first run computed it.
  Tensor normalize_again(const Tensor& x, Tensor& y) {
    DP_CHECK(save_mean_.defined(), type_name() << "(" << c_ << "): run again with no first run");
    if (sync_) {
      kernels::batch_norm_forward_eval(y, x, gamma_->value, beta_->value, save_mean_, save_var_,
                                       eps_);
      return y;
    }
    Tensor rm = Tensor::empty({c_}, DType::f32, x.device());
    Tensor rv = Tensor::empty({c_}, DType::f32, x.device());
    kernels::copy(rm, running_mean_->value);
    kernels::copy(rv, running_var_->value);
    kernels::batch_norm_forward_train(y, save_mean_, save_invstd_, rm, rv, x, gamma_->value,
                                      beta_->value, momentum_, eps_);
    return y;
  }

  // Training forward with the statistics of every replica. The sums are taken around the
  // running mean (the same on every replica), which keeps E[x^2] - E[x]^2 from cancelling.
  Tensor normalize_synced(const Tensor& x, Tensor& y) {
    const Device d = x.device();
    n_local_ = x.numel() / c_;
    std::vector<double> shift = to_doubles(running_mean_->value);
    std::vector<double> neg_shift(shift.size()), ones(shift.size(), 1.0);
    for (size_t k = 0; k < shift.size(); ++k) neg_shift[k] = -shift[k];
    Tensor xs = Tensor::empty(x.shape(), DType::f32, d);
    channel_affine(xs, x, ones, neg_shift, eps_);  // x - shift
    Tensor s1 = Tensor::empty({c_}, DType::f32, d), s2 = Tensor::empty({c_}, DType::f32, d);
    kernels::bias_backward(s1, xs, kernels::Accumulate::no);
    kernels::mul(xs, xs, xs);
    kernels::bias_backward(s2, xs, kernels::Accumulate::no);
    // Packed: count, then the sums, then the sums of squares: one all_reduce.
    std::vector<double> packed(1 + 2 * c_);
    packed[0] = static_cast<double>(n_local_);
    std::vector<double> h1 = to_doubles(s1), h2 = to_doubles(s2);
    std::copy(h1.begin(), h1.end(), packed.begin() + 1);
    std::copy(h2.begin(), h2.end(), packed.begin() + 1 + c_);
    sync_->all_reduce_sum(packed);
    const double n = packed[0];
    DP_CHECK(n > 1, type_name() << "(" << c_ << "): training needs more than one value per "
                                << "channel across the replicas, got " << n);
    n_total_ = static_cast<int64_t>(std::llround(n));
    std::vector<double> mean(c_), var(c_), invstd(c_);
    std::vector<double> rm = shift, rv = to_doubles(running_var_->value);
    for (int64_t k = 0; k < c_; ++k) {
      double m1 = packed[1 + k] / n;
      mean[k] = shift[k] + m1;
      var[k] = std::max(0.0, packed[1 + c_ + k] / n - m1 * m1);  // biased
      invstd[k] = 1.0 / std::sqrt(var[k] + eps_);
      rm[k] = (1 - momentum_) * rm[k] + momentum_ * mean[k];
      rv[k] = (1 - momentum_) * rv[k] + momentum_ * var[k] * n / (n - 1);  // unbiased
    }
    auto to_tensor = [&](const std::vector<double>& v) {
      return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), {c_}, d);
    };
    save_mean_ = to_tensor(mean);
    save_var_ = to_tensor(var);
    save_invstd_ = to_tensor(invstd);
    kernels::copy(running_mean_->value, to_tensor(rm));
    kernels::copy(running_var_->value, to_tensor(rv));
    kernels::batch_norm_forward_eval(y, x, gamma_->value, beta_->value, save_mean_, save_var_,
                                     eps_);
    return y;
  }

  // dx = gamma invstd (dy - (S_dy + xhat S_dyxhat) / n_local), where S_* sum share_r times
  // replica r's sums (share_r = n_r / n_total: each replica's dy is of its own rows' mean).
  Tensor normalize_backward_synced(const Tensor& dy, Tensor& dx) {
    const Device d = dy.device();
    Tensor xhat = Tensor::empty(x_.shape(), DType::f32, d);
    Tensor one = Tensor::from_vector(std::vector<float>(c_, 1.f), {c_}, d);
    Tensor zero = Tensor::zeros({c_}, DType::f32, d);
    kernels::batch_norm_forward_eval(xhat, x_, one, zero, save_mean_, save_var_, eps_);
    Tensor dy_xhat = Tensor::empty(x_.shape(), DType::f32, d);
    kernels::mul(dy_xhat, dy, xhat);
    Tensor sdy = Tensor::empty({c_}, DType::f32, d), sdyx = Tensor::empty({c_}, DType::f32, d);
    kernels::bias_backward(sdy, dy, kernels::Accumulate::no);
    kernels::bias_backward(sdyx, dy_xhat, kernels::Accumulate::no);
    kernels::axpy(beta_->grad, 1.f, sdy);  // this replica's rows, like any parameter
    kernels::axpy(gamma_->grad, 1.f, sdyx);
    const double share = static_cast<double>(n_local_) / static_cast<double>(n_total_);
    std::vector<double> packed(2 * c_), h1 = to_doubles(sdy), h2 = to_doubles(sdyx);
    for (int64_t k = 0; k < c_; ++k) {
      packed[k] = share * h1[k];
      packed[c_ + k] = share * h2[k];
    }
    sync_->all_reduce_sum(packed);
    std::vector<double> a(c_), b(c_), g = to_doubles(gamma_->value), gi(c_), zeros(c_, 0.0);
    std::vector<double> invstd = to_doubles(save_invstd_);
    for (int64_t k = 0; k < c_; ++k) {
      a[k] = -packed[k] / static_cast<double>(n_local_);
      b[k] = -packed[c_ + k] / static_cast<double>(n_local_);
      gi[k] = g[k] * invstd[k];
    }
    Tensor u = Tensor::empty(x_.shape(), DType::f32, d);
    channel_affine(u, xhat, b, a, eps_);  // -(S_dy + xhat S_dyxhat) / n_local
    kernels::add(u, u, dy);
    channel_affine(dx, u, gi, zeros, eps_);
    return dx;
  }

  std::shared_ptr<StatsSync> sync_;
  int64_t n_local_ = 0, n_total_ = 0;
  Tensor save_var_;  // (C) the global biased variance of the cached synced forward
  Parameter* gamma_ = nullptr;
  Parameter* beta_ = nullptr;
  Buffer* running_mean_ = nullptr;
  Buffer* running_var_ = nullptr;
  bool train_forward_ = true;       // whether the cached forward used batch statistics
  Tensor x_;                        // cached input (N, C, ...)
  Tensor save_mean_, save_invstd_;  // (C) batch statistics of the cached forward
  // The statistics stay (C values each): a forward run again reads them (normalize_again).
  void release_saved() override { x_ = Tensor(); }
};

// Sets (or clears, with nullptr) the statistics sync of every BatchNorm layer under `root`.
inline void set_batch_norm_sync(Module& root, const std::shared_ptr<StatsSync>& sync) {
  root.for_each_module([&](Module& m) {
    if (auto* bn = dynamic_cast<BatchNormBase*>(&m)) bn->set_sync(sync);
  });
}

// Values each replica combines per training step in the BatchNorm layers of `root` when they
// are synced: forward (count, sums, sums of squares: 1 + 2C) and backward (2C) per layer.
inline int64_t batch_norm_sync_values_per_step(Module& root) {
  int64_t values = 0;
  root.for_each_module([&](Module& m) {
    if (auto* bn = dynamic_cast<BatchNormBase*>(&m)) values += 1 + 4 * bn->num_features();
  });
  return values;
}

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
    x_dtype_ = x.dtype();
    // (N, C, L) runs as (N, C, L, 1): the op normalises over every dim but 1 either way.
    Tensor x4 = x.ndim() == 3 ? x.reshape({x.dim(0), c_, x.dim(2), 1}) : x;
    return normalize(as_f32(x4)).reshape(x_shape_);
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor dy4 = x_shape_.size() == 3 ? dy.reshape({x_shape_[0], c_, x_shape_[2], 1}) : dy;
    return as_dtype(normalize_backward(as_f32(dy4)).reshape(x_shape_), x_dtype_);
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
    x_dtype_ = x.dtype();
    return normalize(as_f32(x));
  }
  Tensor backward_impl(const Tensor& dy) override {
    return as_dtype(normalize_backward(as_f32(dy)), x_dtype_);
  }
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

  // A pre-LN block's skip and this norm (kernels::add_layer_norm_forward): h = a + b, made here
  // in a's dtype and returned through `h`, and the norm of h returned, the same bits as
  // h = add(a, b) then forward(h). One pass over each row when a and b share a dtype; else the
  // sum, then the norm. requires a and b of one shape.
  Tensor forward_add(const Tensor& a, const Tensor& b, Tensor& h) {
    return run_forward(
        [&] {
          DP_CHECK(a.shape() == b.shape(), "LayerNorm(" << d_ << ")::forward_add: a " << a
                                                        << " and b " << b
                                                        << " must match in shape");
          h = Tensor::empty(a.shape(), a.dtype(), a.device());
          if (a.dtype() == b.dtype()) return normalize(h, &a, &b);
          kernels::add(h, a, b);
          return normalize(h, nullptr, nullptr);
        },
        nullptr);
  }
  // backward(dy) plus the skip's gradient dskip in one pass (kernels::layer_norm_backward_add):
  // the same bits as add(dskip, backward(dy)), in dskip's dtype. requires forward_add (or
  // forward) ran; dskip of the input's shape.
  Tensor backward_add(const Tensor& dy, const Tensor& dskip) {
    return run_backward([&] {
      DP_CHECK(x2_.defined(), "LayerNorm::backward_add called before forward");
      DP_CHECK(dskip.shape() == x_shape_, "LayerNorm(" << d_ << ")::backward_add: dskip "
                                                       << kernels::shape_str(dskip.shape())
                                                       << " must have the input's "
                                                       << kernels::shape_str(x_shape_) << " shape");
      Tensor dx = Tensor::empty(x2_.shape(), dskip.dtype(), dy.device());
      kernels::layer_norm_backward_add(dx, gamma_->grad, beta_->grad, dy.reshape(x2_.shape()),
                                       dskip.reshape(x2_.shape()), x2_, gamma_->value, save_mean_,
                                       save_rstd_, kernels::Accumulate::yes);
      return dx.reshape(x_shape_);
    });
  }

 protected:
  Tensor forward_impl(const Tensor& x) override { return normalize(x, nullptr, nullptr); }
  // dx takes the input's dtype; dy may be f32 or 16-bit.
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x2_.defined(), "LayerNorm::backward called before forward");
    Tensor dx = Tensor::empty(x2_.shape(), x2_.dtype(), dy.device());
    kernels::layer_norm_backward(dx, gamma_->grad, beta_->grad, dy.reshape(x2_.shape()), x2_,
                                 gamma_->value, save_mean_, save_rstd_, kernels::Accumulate::yes);
    return dx.reshape(x_shape_);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<LayerNorm>(d_, eps_);
  }

 private:
  // The norm of x, or with a and b the norm of x = a + b written into x first. Under 16-bit
  // activations the output is 16-bit (rounded once from the f32 arithmetic), and a 16-bit input
  // is read as it is: no casts either way; the statistics stay f32.
  Tensor normalize(const Tensor& x, const Tensor* a, const Tensor* b) {
    DP_CHECK(x.ndim() >= 1 && x.dim(-1) == d_, "LayerNorm(" << d_ << "): input "
                                                            << kernels::shape_str(x.shape())
                                                            << " must be (..., " << d_ << ")");
    x_shape_ = x.shape();
    const int64_t rows = x.numel() / d_;
    x2_ = x.reshape({rows, d_});  // (M, D), in the input's dtype
    save_mean_ = Tensor::empty({rows}, DType::f32, x.device());
    save_rstd_ = Tensor::empty({rows}, DType::f32, x.device());
    const DType out = x.dtype() != DType::f32 ? x.dtype() : activation_dtype();
    Tensor y = Tensor::empty({rows, d_}, out, x.device());
    if (a)
      kernels::add_layer_norm_forward(x2_, y, save_mean_, save_rstd_, a->reshape({rows, d_}),
                                      b->reshape({rows, d_}), gamma_->value, beta_->value, eps_);
    else
      kernels::layer_norm_forward(y, save_mean_, save_rstd_, x2_, gamma_->value, beta_->value,
                                  eps_);
    return y.reshape(x_shape_);
  }

  int64_t d_;
  float eps_;
  Parameter* gamma_ = nullptr;
  Parameter* beta_ = nullptr;
  Shape x_shape_;
  Tensor x2_;                     // cached input as (M, D), in its own dtype (dx takes it)
  Tensor save_mean_, save_rstd_;  // (M)
  void release_saved() override { x2_ = save_mean_ = save_rstd_ = Tensor(); }
};

// RMSNorm over the last dim (Zhang and Sennrich 2019; Llama's norm): x (..., D) -> y (..., D),
// y = x / sqrt(mean(x^2) + eps) * gamma; gamma (D) = 1, no shift. One fused kernel each way
// (kernels::rms_norm_forward/backward); 16-bit activations as LayerNorm's.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, float eps = 1e-5f) : d_(dim), eps_(eps) {
    DP_CHECK(d_ > 0 && eps > 0.f, "RMSNorm(" << d_ << ", eps " << eps << "): invalid");
    gamma_ = &register_parameter("weight", {d_}, InitSpec::constant(1.f));
  }
  std::string type_name() const override { return "RMSNorm"; }
  int64_t dim() const { return d_; }
  float eps() const { return eps_; }
  Parameter& weight() { return *gamma_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() >= 1 && x.dim(-1) == d_, "RMSNorm(" << d_ << "): input "
                                                          << kernels::shape_str(x.shape())
                                                          << " must be (..., " << d_ << ")");
    x_shape_ = x.shape();
    const int64_t rows = x.numel() / d_;
    x2_ = x.reshape({rows, d_});  // (M, D), in the input's dtype
    save_rstd_ = Tensor::empty({rows}, DType::f32, x.device());
    const DType out = x.dtype() != DType::f32 ? x.dtype() : activation_dtype();
    Tensor y = Tensor::empty({rows, d_}, out, x.device());
    kernels::rms_norm_forward(y, save_rstd_, x2_, gamma_->value, eps_);
    return y.reshape(x_shape_);
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x2_.defined(), "RMSNorm::backward called before forward");
    Tensor dx = Tensor::empty(x2_.shape(), x2_.dtype(), dy.device());
    kernels::rms_norm_backward(dx, gamma_->grad, dy.reshape(x2_.shape()), x2_, gamma_->value,
                               save_rstd_, kernels::Accumulate::yes);
    return dx.reshape(x_shape_);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<RMSNorm>(d_, eps_);
  }

 private:
  int64_t d_;
  float eps_;
  Parameter* gamma_ = nullptr;
  Shape x_shape_;
  Tensor x2_;         // cached input as (M, D), in its own dtype (dx takes it)
  Tensor save_rstd_;  // (M)
  void release_saved() override { x2_ = save_rstd_ = Tensor(); }
};

}  // namespace nn
