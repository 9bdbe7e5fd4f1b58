// Elementwise activations: ReLU, GELU (exact erf form, or GPT-2's tanh approximation), Tanh.
// Shapes and dtypes are preserved (16-bit activations stay 16-bit; dx takes the input's dtype).
#pragma once

#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// y = max(x, 0). Caches x.
class ReLU : public Module {
 public:
  std::string type_name() const override { return "ReLU"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    x_ = x;
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    kernels::relu(y, x);
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x_.defined(), "ReLU::backward called before forward");
    Tensor dx = Tensor::empty(x_.shape(), x_.dtype(), dy.device());
    kernels::relu_backward(dx, dy, x_, kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<ReLU>(); }

 private:
  void release_saved() override { x_ = Tensor(); }
  Tensor x_;
};

// Which GELU: exact (x Phi(x), PyTorch's default) or the tanh approximation (GPT-2's,
// PyTorch's approximate="tanh").
enum class GeluApproximation { none, tanh };

// y = x Phi(x), or its tanh approximation. Caches x.
class GELU : public Module {
 public:
  explicit GELU(GeluApproximation approximate = GeluApproximation::none)
      : approximate_(approximate) {}
  std::string type_name() const override {
    return approximate_ == GeluApproximation::tanh ? "GELU(tanh)" : "GELU";
  }
  GeluApproximation approximation() const { return approximate_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    x_ = x;
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    if (approximate_ == GeluApproximation::tanh)
      kernels::gelu_tanh(y, x);
    else
      kernels::gelu(y, x);
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x_.defined(), "GELU::backward called before forward");
    Tensor dx = Tensor::empty(x_.shape(), x_.dtype(), dy.device());
    if (approximate_ == GeluApproximation::tanh)
      kernels::gelu_tanh_backward(dx, dy, x_, kernels::Accumulate::no);
    else
      kernels::gelu_backward(dx, dy, x_, kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<GELU>(approximate_);
  }

 private:
  void release_saved() override { x_ = Tensor(); }
  GeluApproximation approximate_;
  Tensor x_;
};

// y = tanh(x). Caches y (the derivative is 1 - y^2).
class Tanh : public Module {
 public:
  std::string type_name() const override { return "Tanh"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    y_ = Tensor::empty(x.shape(), x.dtype(), x.device());
    kernels::tanh(y_, x);
    return y_;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(y_.defined(), "Tanh::backward called before forward");
    Tensor dx = Tensor::empty(y_.shape(), y_.dtype(), dy.device());
    kernels::tanh_backward(dx, dy, y_, kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Tanh>(); }

 private:
  void release_saved() override { y_ = Tensor(); }
  Tensor y_;
};

}  // namespace nn
