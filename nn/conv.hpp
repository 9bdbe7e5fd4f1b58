// nn::Conv2d: 2-D convolution (cross-correlation) over NCHW tensors, square kernels.
#pragma once

#include <cmath>
#include <memory>
#include <string>

#include "nn/linear.hpp"  // Bias
#include "nn/module.hpp"

namespace nn {

// x (N, C, H, W) -> y (N, K, P, Q), P = (H + 2 pad - k) / stride + 1; W (K, C, k, k), b (K).
// Init as PyTorch: W ~ kaiming_uniform(fan_in = C k k, a = sqrt(5)), b ~ U(+-1/sqrt(fan_in)).
class Conv2d : public Module {
 public:
  // requires channels, kernel, stride > 0, pad >= 0.
  Conv2d(int64_t in_channels, int64_t out_channels, int kernel, int stride = 1, int pad = 0,
         Bias bias = Bias::yes)
      : in_(in_channels), out_(out_channels), k_(kernel), has_bias_(bias) {
    DP_CHECK(in_ > 0 && out_ > 0 && k_ > 0 && stride > 0 && pad >= 0,
             "Conv2d(" << in_ << ", " << out_ << ", kernel " << k_ << ", stride " << stride
                       << ", pad " << pad << "): invalid configuration");
    p_.stride_h = p_.stride_w = stride;
    p_.pad_h = p_.pad_w = pad;
    const int64_t fan_in = in_ * k_ * k_;
    weight_ =
        &register_parameter("weight", {out_, in_, k_, k_}, kaiming_uniform(fan_in, std::sqrt(5.f)));
    weight_->read_through_copy = true;  // convolution operands only, forward and backward
    if (has_bias_ == Bias::yes) bias_ = &register_parameter("bias", {out_}, torch_default(fan_in));
  }

  std::string type_name() const override { return "Conv2d"; }
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int kernel_size() const { return k_; }
  int stride() const { return p_.stride_h; }
  int padding() const { return p_.pad_h; }
  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }  // null without a bias

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() == 4 && x.dim(1) == in_, describe()
                                                   << ": input " << kernels::shape_str(x.shape())
                                                   << " must be (N, " << in_ << ", H, W)");
    const int64_t oh = kernels::conv_out_size(x.dim(2), k_, p_.stride_h, p_.pad_h);
    const int64_t ow = kernels::conv_out_size(x.dim(3), k_, p_.stride_w, p_.pad_w);
    DP_CHECK(oh > 0 && ow > 0, describe() << ": input " << kernels::shape_str(x.shape())
                                          << " is smaller than the kernel");
    x_dtype_ = x.dtype();
    x_ = to_compute(x);  // 16-bit under mixed precision
    // f32, or 16-bit under 16-bit activations. (N, K, P, Q)
    Tensor y = Tensor::empty({x.dim(0), out_, oh, ow}, activation_dtype(), x.device());
    kernels::conv2d_forward(y, x_, weight_->compute, p_);
    if (bias_) kernels::add_bias(y, bias_->value);
    return y;
  }

  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x_.defined(), "Conv2d::backward called before forward");
    Tensor dx;
    Tensor dyc = to_compute(dy);
    if (input_grad_needed()) {
      dx = Tensor::empty(x_.shape(), x_dtype_, dy.device());  // (N, C, H, W), x's dtype
      kernels::conv2d_backward_data(dx, dyc, weight_->compute, p_, kernels::Accumulate::no);
    }
    kernels::conv2d_backward_filter(weight_->grad, dyc, x_, p_, kernels::Accumulate::yes);
    // The bias gradient is a reduction into f32 (a 16-bit dy is read as f32, no cast).
    if (bias_) kernels::bias_backward(bias_->grad, dy, kernels::Accumulate::yes);
    return dx;
  }

  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<Conv2d>(in_, out_, k_, p_.stride_h, p_.pad_h, has_bias_);
  }

 private:
  std::string describe() const {
    return "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) + ", kernel " +
           std::to_string(k_) + ", stride " + std::to_string(p_.stride_h) + ", pad " +
           std::to_string(p_.pad_h) + ")";
  }

  int64_t in_, out_;
  int k_;
  Bias has_bias_;
  kernels::Conv2dParams p_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  DType x_dtype_ = DType::f32;  // the input's dtype, which dx takes
  Tensor x_;                    // cached input (N, C, H, W), in the compute dtype
  void release_saved() override { x_ = Tensor(); }
};

}  // namespace nn
