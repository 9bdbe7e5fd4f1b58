// A user-defined layer built from the public op set, checked with nn::gradcheck.
//
// GatedLinear: y = (x W1^T + b1) * sigmoid(x W2^T + b2) * scale   x (N, in) -> y (N, out)
// with a learned per-feature scale (out): kernels::mul broadcasts it over the rows, and
// kernels::sum_leading sums its gradient back over them.
//
// Everything a layer needs: register parameters with init specs in the constructor, cache what
// backward needs in forward_impl, return dx and ADD parameter gradients in backward_impl,
// rebuild the configuration in clone_config (replicas and DP need it), name it in type_name.
#include <cmath>
#include <cstdio>
#include <memory>

#include "nn/nn.hpp"

using kernels::Accumulate;
using kernels::Transpose;
using nn::DType;
using nn::Tensor;

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

int main() {
  // The layer alone, and inside a small network.
  auto layer = std::make_shared<GatedLinear>(6, 4);
  layer->materialize(kernels::Device::cpu(), 1);
  auto net =
      nn::sequential({std::make_shared<nn::Linear>(6, 8), std::make_shared<GatedLinear>(8, 8),
                      std::make_shared<nn::LayerNorm>(8), std::make_shared<nn::Linear>(8, 3)});
  net->materialize(kernels::Device::cpu(), 2);

  std::vector<float> xs(5 * 6);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.7f * static_cast<float>(i));
  Tensor x = Tensor::from_vector(xs, {5, 6});

  bool ok = true;
  for (nn::Module* m :
       {static_cast<nn::Module*>(layer.get()), static_cast<nn::Module*>(net.get())}) {
    nn::GradcheckResult r = nn::gradcheck(*m, x);
    std::printf("%s\n", r.message.c_str());
    ok = ok && r.ok;
  }
  return ok ? 0 : 1;
}
