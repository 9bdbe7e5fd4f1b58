// Pooling over NCHW tensors: MaxPool2d, AvgPool2d (square windows), GlobalAvgPool.
#pragma once

#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

namespace detail {

inline kernels::Pool2dParams pool_params(int kernel, int stride, int pad, const char* layer) {
  DP_CHECK(kernel > 0 && stride >= 0 && pad >= 0 && 2 * pad <= kernel,
           layer << "(kernel " << kernel << ", stride " << stride << ", pad " << pad
                 << "): invalid configuration (pad must be at most half the kernel)");
  kernels::Pool2dParams p;
  p.kernel_h = p.kernel_w = kernel;
  p.stride_h = p.stride_w = stride > 0 ? stride : kernel;
  p.pad_h = p.pad_w = pad;
  return p;
}

// (N, C, H, W) -> (N, C, P, Q) for pooling window p; throws naming the layer on a bad input.
inline Shape pool_out_shape(const Tensor& x, const kernels::Pool2dParams& p, const char* layer) {
  DP_CHECK(x.ndim() == 4,
           layer << ": input " << kernels::shape_str(x.shape()) << " must be (N, C, H, W)");
  const int64_t oh = kernels::conv_out_size(x.dim(2), p.kernel_h, p.stride_h, p.pad_h);
  const int64_t ow = kernels::conv_out_size(x.dim(3), p.kernel_w, p.stride_w, p.pad_w);
  DP_CHECK(oh > 0 && ow > 0, layer << "(kernel " << p.kernel_h << "): input "
                                   << kernels::shape_str(x.shape())
                                   << " is smaller than the window");
  return {x.dim(0), x.dim(1), oh, ow};
}

}  // namespace detail

// Max over k x k windows (stride defaults to k). The gradient goes to the first maximum.
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int kernel, int stride = 0, int pad = 0)
      : p_(detail::pool_params(kernel, stride, pad, "MaxPool2d")) {}
  std::string type_name() const override { return "MaxPool2d"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor y = Tensor::empty(detail::pool_out_shape(x, p_, "MaxPool2d"), x.dtype(), x.device());
    kernels::max_pool2d_forward(y, x, p_);
    x_ = x;
    y_ = y;
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(x_.defined(), "MaxPool2d::backward called before forward");
    Tensor dx = Tensor::empty(x_.shape(), x_.dtype(), dy.device());
    kernels::max_pool2d_backward(dx, dy, x_, y_, p_, kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<MaxPool2d>(p_.kernel_h, p_.stride_h, p_.pad_h);
  }

 private:
  void release_saved() override { x_ = y_ = Tensor(); }
  kernels::Pool2dParams p_;
  Tensor x_, y_;  // cached input and output
};

// Mean over k x k windows (stride defaults to k); padding counts in the divisor.
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(int kernel, int stride = 0, int pad = 0)
      : p_(detail::pool_params(kernel, stride, pad, "AvgPool2d")) {}
  std::string type_name() const override { return "AvgPool2d"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor y = Tensor::empty(detail::pool_out_shape(x, p_, "AvgPool2d"), x.dtype(), x.device());
    kernels::avg_pool2d_forward(y, x, p_);
    x_shape_ = x.shape();
    x_dtype_ = x.dtype();
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(!x_shape_.empty(), "AvgPool2d::backward called before forward");
    Tensor dx = Tensor::empty(x_shape_, x_dtype_, dy.device());
    kernels::avg_pool2d_backward(dx, dy, p_, kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<AvgPool2d>(p_.kernel_h, p_.stride_h, p_.pad_h);
  }

 private:
  kernels::Pool2dParams p_;
  Shape x_shape_;
  DType x_dtype_ = DType::f32;
};

// (N, C, H, W) -> (N, C): the mean over each channel's H x W plane (one H x W average pool).
class GlobalAvgPool : public Module {
 public:
  std::string type_name() const override { return "GlobalAvgPool"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() == 4 && x.dim(2) > 0 && x.dim(3) > 0,
             "GlobalAvgPool: input " << kernels::shape_str(x.shape()) << " must be (N, C, H, W)");
    x_shape_ = x.shape();
    p_ = window(x_shape_);
    x_dtype_ = x.dtype();
    Tensor y = Tensor::empty({x.dim(0), x.dim(1), 1, 1}, x_dtype_, x.device());  // (N, C, 1, 1)
    kernels::avg_pool2d_forward(y, x, p_);
    return y.reshape({x.dim(0), x.dim(1)});
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(!x_shape_.empty(), "GlobalAvgPool::backward called before forward");
    Tensor dx = Tensor::empty(x_shape_, x_dtype_, dy.device());  // (N, C, H, W)
    kernels::avg_pool2d_backward(dx, dy.reshape({x_shape_[0], x_shape_[1], 1, 1}), p_,
                                 kernels::Accumulate::no);
    return dx;
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<GlobalAvgPool>();
  }

 private:
  static kernels::Pool2dParams window(const Shape& s) {
    kernels::Pool2dParams p;
    p.kernel_h = p.stride_h = static_cast<int>(s[2]);
    p.kernel_w = p.stride_w = static_cast<int>(s[3]);
    p.pad_h = p.pad_w = 0;
    return p;
  }
  kernels::Pool2dParams p_;
  Shape x_shape_;
  DType x_dtype_ = DType::f32;
};

}  // namespace nn
