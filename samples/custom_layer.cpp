// A user-defined layer two ways, checked with nn::gradcheck and against each other.
//
// GatedLinear: y = (x W1^T + b1) * sigmoid(x W2^T + b2) * scale   x (N, in) -> y (N, out)
// with a learned per-feature scale (out), broadcast over the rows.
//
// - ComposedGatedLinear (nn::Composed, nn/autograd.hpp): the forward as one expression of ops;
//   its backward is derived (a tape recorded on the first step of a shape, replayed after).
// - GatedLinear (nn::Module): the same layer with a hand-written backward, the way built-in
//   layers are written when a fused kernel pays: cache what backward needs in forward_impl,
//   return dx and ADD parameter gradients in backward_impl.
// Both register the same parameters in the same order, so one seed gives both the same weights.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "nn/nn.hpp"

using kernels::Accumulate;
using kernels::Transpose;
using nn::DType;
using nn::Tensor;

namespace ag = nn::ag;

class ComposedGatedLinear : public nn::Composed {
 public:
  ComposedGatedLinear(int64_t in, int64_t out)
      : in_(in),
        out_(out),
        w1_(register_parameter("value_weight", {out, in}, nn::kaiming_uniform(in, std::sqrt(5.f)))),
        b1_(register_parameter("value_bias", {out}, nn::torch_default(in))),
        w2_(register_parameter("gate_weight", {out, in}, nn::kaiming_uniform(in, std::sqrt(5.f)))),
        b2_(register_parameter("gate_bias", {out}, nn::torch_default(in))),
        scale_(register_parameter("scale", {out}, nn::InitSpec::constant(1.f))) {}
  std::string type_name() const override { return "ComposedGatedLinear"; }

 protected:
  Var compose(const Var& x) override {
    const Var value = linear(x, param(w1_)) + param(b1_);
    const Var gate = sigmoid(linear(x, param(w2_)) + param(b2_));
    return value * gate * param(scale_);
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<ComposedGatedLinear>(in_, out_);
  }

 private:
  int64_t in_, out_;
  nn::Parameter &w1_, &b1_, &w2_, &b2_, &scale_;
};

class GatedLinear : public nn::Module {
 public:
  GatedLinear(int64_t in, int64_t out) : in_(in), out_(out) {
    w1_ = &register_parameter("value_weight", {out, in}, nn::kaiming_uniform(in, std::sqrt(5.f)));
    b1_ = &register_parameter("value_bias", {out}, nn::torch_default(in));
    w2_ = &register_parameter("gate_weight", {out, in}, nn::kaiming_uniform(in, std::sqrt(5.f)));
    b2_ = &register_parameter("gate_bias", {out}, nn::torch_default(in));
    scale_ = &register_parameter("scale", {out}, nn::InitSpec::constant(1.f));
  }
  std::string type_name() const override { return "GatedLinear"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() == 2 && x.dim(1) == in_, "GatedLinear: input "
                                                   << kernels::shape_str(x.shape())
                                                   << " must be (N, " << in_ << ")");
    const int64_t n = x.dim(0);
    auto dev = x.device();
    x_ = x;
    a_ = Tensor::empty({n, out_}, DType::f32, dev);  // value branch (N, out)
    Tensor z = Tensor::empty({n, out_}, DType::f32, dev);
    kernels::gemm(a_, x, Transpose::no, w1_->value, Transpose::yes, 1.f, 0.f, b1_->value);
    kernels::gemm(z, x, Transpose::no, w2_->value, Transpose::yes, 1.f, 0.f, b2_->value);
    s_ = Tensor::empty({n, out_}, DType::f32, dev);  // the gate, sigmoid(z)
    kernels::sigmoid(s_, z);
    g_ = Tensor::empty({n, out_}, DType::f32, dev);  // a * sigmoid(z)
    kernels::mul(g_, a_, s_);
    Tensor y = Tensor::empty({n, out_}, DType::f32, dev);
    kernels::mul(y, g_, scale_->value);  // (N, out) * (out): the scale broadcast over rows
    return y;
  }

  Tensor backward_impl(const Tensor& dy) override {
    const int64_t n = x_.dim(0);
    auto dev = dy.device();
    Tensor t = Tensor::empty({n, out_}, DType::f32, dev);
    kernels::mul(t, dy, g_);  // d scale = sum over rows of dy * g
    kernels::sum_leading(scale_->grad, t, Accumulate::yes);
    Tensor dg = Tensor::empty({n, out_}, DType::f32, dev);  // dy * scale
    kernels::mul(dg, dy, scale_->value);
    Tensor da = Tensor::empty({n, out_}, DType::f32, dev);  // dg * s
    kernels::mul(da, dg, s_);
    kernels::mul(t, dg, a_);  // dg * a, through the gate: dz = t s (1 - s)
    Tensor dz = Tensor::empty({n, out_}, DType::f32, dev);
    kernels::sigmoid_backward(dz, t, s_, Accumulate::no);
    // Parameter gradients accumulate: (N, out)^T x (N, in) -> (out, in).
    kernels::gemm(w1_->grad, da, Transpose::yes, x_, Transpose::no, 1.f, 1.f);
    kernels::bias_backward(b1_->grad, da, Accumulate::yes);
    kernels::gemm(w2_->grad, dz, Transpose::yes, x_, Transpose::no, 1.f, 1.f);
    kernels::bias_backward(b2_->grad, dz, Accumulate::yes);
    Tensor dx = Tensor::empty({n, in_}, DType::f32, dev);  // da W1 + dz W2: (N, in)
    kernels::gemm(dx, da, Transpose::no, w1_->value, Transpose::no);
    kernels::gemm(dx, dz, Transpose::no, w2_->value, Transpose::no, 1.f, 1.f);
    return dx;
  }

  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<GatedLinear>(in_, out_);
  }

 private:
  int64_t in_, out_;
  nn::Parameter *w1_, *b1_, *w2_, *b2_, *scale_;
  Tensor x_, a_, s_, g_;  // cached input, value branch, gate, gated value
};

// y, dx and the parameter gradients of m on x with dy = 1.
std::vector<std::vector<float>> pass(nn::Module& m, const Tensor& x) {
  m.zero_grad();
  Tensor y = m.forward(x);
  std::vector<float> ones(static_cast<size_t>(y.numel()), 1.f);
  Tensor dx = m.backward(Tensor::from_vector(ones, y.shape()));
  return {y.to_host_f32(), dx.to_host_f32(), m.flat_grads().to_host_f32()};
}

int main(int argc, char** argv) {
  // A demonstration with nothing to set: --help says what it does, anything else is refused.
  if (argc > 1) {
    const std::string arg = argv[1];
    if (arg == "-h" || arg == "--help") {
      std::printf(
          "custom_layer checks a layer written as ops (its backward derived by autograd) "
          "against the same layer with a hand-written backward, and both with gradcheck; it "
          "takes no arguments\n");
      return 0;
    }
    std::fprintf(stderr,
                 "custom_layer: '%s' is not an argument: it takes none (--help says what it "
                 "does)\n",
                 arg.c_str());
    return 2;
  }
  std::vector<float> xs(5 * 6);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.7f * static_cast<float>(i));
  Tensor x = Tensor::from_vector(xs, {5, 6});

  // The two ways agree: the same weights from one seed, then forward and backward.
  auto composed = std::make_shared<ComposedGatedLinear>(6, 4);
  auto layer = std::make_shared<GatedLinear>(6, 4);
  composed->materialize(kernels::Device::cpu(), 1);
  layer->materialize(kernels::Device::cpu(), 1);
  const auto a = pass(*composed, x), b = pass(*layer, x);
  const char* what[] = {"output", "input gradient", "parameter gradients"};
  bool ok = true;
  for (int i = 0; i < 3; ++i) {
    const float diff = kernels::max_abs_diff(a[i], b[i]);
    std::printf("composed vs hand-written %s: max |diff| %.3g\n", what[i], diff);
    ok = ok && diff <= 1e-5f;
  }

  // Each alone, and inside a small network beside built-in layers, against finite differences.
  auto net = nn::sequential(
      {std::make_shared<nn::Linear>(6, 8), std::make_shared<ComposedGatedLinear>(8, 8),
       std::make_shared<nn::LayerNorm>(8), std::make_shared<nn::Linear>(8, 3)});
  net->materialize(kernels::Device::cpu(), 2);
  for (nn::Module* m :
       {static_cast<nn::Module*>(composed.get()), static_cast<nn::Module*>(layer.get()),
        static_cast<nn::Module*>(net.get())}) {
    nn::GradcheckResult r = nn::gradcheck(*m, x);
    std::printf("%s\n", r.message.c_str());
    ok = ok && r.ok;
  }
  if (!ok) std::printf("custom_layer FAILED\n");
  return ok ? 0 : 1;
}
