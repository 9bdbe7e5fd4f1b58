// nn::Linear: a fully connected layer, y = x W^T + b.
#pragma once

#include <cmath>
#include <memory>
#include <string>

#include "nn/module.hpp"

namespace nn {

// Whether a Linear or Conv2d layer adds a learned bias.
enum class Bias { no, yes };

// x (..., in) -> y (..., out); W (out, in), b (out). Leading dims are flattened into rows.
// Init as PyTorch: W ~ kaiming_uniform(fan_in = in, a = sqrt(5)), b ~ U(+-1/sqrt(in)).
class Linear : public Module {
 public:
  // requires in, out > 0.
  Linear(int64_t in_features, int64_t out_features, Bias bias = Bias::yes)
      : in_(in_features), out_(out_features), has_bias_(bias) {
    DP_CHECK(in_ > 0 && out_ > 0, "Linear(" << in_ << ", " << out_ << "): sizes must be > 0");
    weight_ = &register_parameter("weight", {out_, in_}, kaiming_uniform(in_, std::sqrt(5.f)));
    weight_->read_through_copy = true;  // GEMM operands only, forward and backward
    if (has_bias_ == Bias::yes) bias_ = &register_parameter("bias", {out_}, torch_default(in_));
  }

  std::string type_name() const override { return "Linear"; }
  bool backward_reads_output() const override { return false; }  // it keeps its input
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter& weight() { return *weight_; }
  Parameter* bias() { return bias_; }  // null without a bias

  // GPT-2's MLP (GptMlp) runs this layer and the GELU (tanh) after it as one op, and the next
  // layer's backward through that GELU as one op (kernels::gemm_gelu_tanh and its backward: on a
  // GPU, cuBLASLt's GELU epilogues where it has them; on the CPU the ops in turn, bit for bit).
  //
  // Returns gelu_tanh(x W^T + b) and sets pre to x W^T + b (the GELU's input, which the next
  // layer's backward_through_gelu reads). Hooks, NVTX and layer times as forward().
  Tensor forward_gelu(const Tensor& x, Tensor& pre) {
    return run_forward([&] { return forward_rows(x, &pre); }, nullptr);
  }
  // This layer's backward (it must follow a forward on gelu_tanh(pre)) with the GELU before it
  // folded in: returns d loss / d pre instead of d loss / d(its input), and adds `below`'s bias
  // gradient (the layer whose forward_gelu made pre) in the same op; then
  // below.backward_bias_given(d loss / d pre) runs below's backward without summing it again.
  Tensor backward_through_gelu(const Tensor& dy, const Tensor& pre, Linear& below) {
    return run_backward([&] { return backward_rows(dy, true, &pre, &below); });
  }
  // backward() when the bias gradient was already added (backward_through_gelu of the layer
  // after this one).
  Tensor backward_bias_given(const Tensor& dy) {
    return run_backward([&] { return backward_rows(dy, false, nullptr, nullptr); });
  }

 protected:
  Tensor forward_impl(const Tensor& x) override { return forward_rows(x, nullptr); }

  // The bias in y's dtype where its 16-bit copy has it, else the f32 value; none without one.
  Tensor bias_for(DType y_dtype) const {
    if (!bias_) return Tensor();
    return bias_->compute.defined() && bias_->compute.dtype() == y_dtype ? bias_->compute
                                                                         : bias_->value;
  }

  Tensor backward_impl(const Tensor& dy) override {
    return backward_rows(dy, true, nullptr, nullptr);
  }

  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<Linear>(in_, out_, has_bias_);
  }

 private:
  // y = x W^T + b; with pre, y = gelu_tanh(x W^T + b) and *pre = x W^T + b (forward_gelu).
  Tensor forward_rows(const Tensor& x, Tensor* pre) {
    DP_CHECK(x.ndim() >= 2 && x.dim(-1) == in_,
             "Linear(" << in_ << " -> " << out_ << "): input " << kernels::shape_str(x.shape())
                       << " must be (..., " << in_ << "), weight is "
                       << kernels::shape_str(weight_->shape));
    x_shape_ = x.shape();
    x_dtype_ = x.dtype();
    const int64_t rows = x.numel() / in_;
    // Under mixed precision the product takes 16-bit x and W (f32 accumulation); y is f32, or
    // 16-bit under 16-bit activations (rounded once, after the bias). A 16-bit y takes the
    // bias's 16-bit copy, as torch.autocast rounds a Linear's bias (on a GPU, cuBLASLt's bias
    // epilogue reads it as it is).
    x2_ = to_compute(x.reshape({rows, in_}));                                // (M, in)
    Tensor y = Tensor::empty({rows, out_}, activation_dtype(), x.device());  // (M, out)
    Shape y_shape = x_shape_;
    y_shape.back() = out_;
    // (M, in) x (out, in)^T + b -> (M, out)
    if (pre) {
      Tensor h = Tensor::empty({rows, out_}, y.dtype(), x.device());
      kernels::gemm_gelu_tanh(y, h, x2_, kernels::Transpose::no, weight_->compute,
                              kernels::Transpose::yes, bias_for(y.dtype()));
      *pre = h.reshape(y_shape);
    } else {
      kernels::gemm(y, x2_, kernels::Transpose::no, weight_->compute, kernels::Transpose::yes, 1.f,
                    0.f, bias_for(y.dtype()));
    }
    return y.reshape(y_shape);
  }

  // dx (or, with pre, d loss / d pre through the GELU and below's bias gradient: see
  // backward_through_gelu), dW += dy^T x, and with bias_grad db += the column sums of dy.
  Tensor backward_rows(const Tensor& dy, bool bias_grad, const Tensor* pre, Linear* below) {
    DP_CHECK(x2_.defined(), "Linear::backward called before forward");
    const int64_t rows = x2_.dim(0);
    DP_CHECK(dy.numel() == rows * out_, "Linear(" << in_ << " -> " << out_ << "): dy "
                                                  << kernels::shape_str(dy.shape())
                                                  << " does not match the forward output");
    Tensor dy2 = dy.reshape({rows, out_});  // (M, out)
    Tensor dy2c = to_compute(dy2);          // 16-bit under AMP
    Tensor dx;
    if (pre) {
      DP_CHECK(
          pre->numel() == rows * in_ && pre->dtype() == x_dtype_ && below && below->out_ == in_,
          "Linear(" << in_ << " -> " << out_ << ")::backward_through_gelu: pre " << *pre
                    << " must be this layer's input before the GELU, from the layer below");
      // d loss / d pre = (dy W) * gelu'(pre) in x's dtype, below's db summed with it.
      dx = Tensor::empty({rows, in_}, x_dtype_, dy.device());
      Tensor dbias = below->bias_ ? below->bias_->grad : Tensor();
      kernels::gemm_gelu_tanh_backward(dx, dbias, kernels::Accumulate::yes, dy2c,
                                       kernels::Transpose::no, weight_->compute,
                                       kernels::Transpose::no, pre->reshape({rows, in_}));
    } else if (input_grad_needed()) {
      dx = Tensor::empty({rows, in_}, x_dtype_, dy.device());  // (M, in), x's dtype
      // (M, out) x (out, in) -> (M, in)
      kernels::gemm(dx, dy2c, kernels::Transpose::no, weight_->compute, kernels::Transpose::no);
    }
    // dW += (M, out)^T x (M, in) -> (out, in), accumulated into the f32 gradient, and the bias
    // gradient, a reduction into f32 (a 16-bit dy is read as f32, no cast), in one op (on a GPU
    // one GEMM where its epilogue can sum it).
    Tensor dbias = bias_ && bias_grad ? bias_->grad : Tensor();
    kernels::linear_param_grads(weight_->grad, dbias, dy2c, x2_, dy2);
    if (!dx.defined()) return dx;
    return pre ? dx.reshape(pre->shape()) : dx.reshape(x_shape_);
  }

  int64_t in_, out_;
  Bias has_bias_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  Shape x_shape_;
  DType x_dtype_ = DType::f32;  // the input's dtype, which dx takes
  Tensor x2_;                   // cached input as (M, in), in the compute dtype
  void release_saved() override { x2_ = Tensor(); }
};

}  // namespace nn
