// Llama's layers written with autograd (nn/autograd.hpp): forward only, a few lines each. They
// are the reference the fused layers (nn/norm.hpp's RMSNorm, nn/llama.hpp's SwiGLU, the rotary
// kernel of nn/attention.hpp) are tested against, and a model of how research code writes a
// layer. Parameter names, shapes and order match the fused layers', so the same seed gives the
// same weights and a checkpoint of one loads into the other.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/autograd.hpp"

namespace nn {

// x / sqrt(mean(x^2) + eps) * weight over the last dim, statistics in f32.
class ComposedRMSNorm : public Composed {
 public:
  explicit ComposedRMSNorm(int64_t dim, float eps = 1e-5f)
      : d_(dim), eps_(eps), weight_(register_parameter("weight", {dim}, InitSpec::constant(1.f))) {
    DP_CHECK(dim > 0 && eps > 0.f, "ComposedRMSNorm(" << dim << ", eps " << eps << "): invalid");
  }
  std::string type_name() const override { return "ComposedRMSNorm"; }
  Parameter& weight() { return weight_; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    const ag::Var xf = ag::cast(x, DType::f32);
    const ag::Var y = xf * ag::rsqrt(ag::mean(xf * xf, -1, ag::keepdim) + eps_) * param(weight_);
    return ag::cast(y, x.dtype());
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<ComposedRMSNorm>(d_, eps_);
  }

 private:
  int64_t d_;
  float eps_;
  Parameter& weight_;
};

// Llama's MLP: down(silu(x W_gate) * (x W_up)), with [gate | up] in one weight "gate_up.weight"
// (2 H, D) and "down.weight" (D, H), as nn::SwiGLU names them. No biases.
class ComposedSwiGLU : public Composed {
 public:
  ComposedSwiGLU(int64_t dim, int64_t hidden)
      : dim_(dim),
        hidden_(hidden),
        gate_up_(register_parameter("gate_up.weight", {2 * hidden, dim}, kaiming_uniform(dim, std::sqrt(5.f)))),
        down_(register_parameter("down.weight", {dim, hidden}, kaiming_uniform(hidden, std::sqrt(5.f)))) {
    DP_CHECK(dim > 0 && hidden > 0,
             "ComposedSwiGLU(" << dim << ", " << hidden << "): sizes must be > 0");
  }
  std::string type_name() const override { return "ComposedSwiGLU"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    const ag::Var h = ag::linear(x, param(gate_up_));  // (..., 2 H)
    const ag::Var gate = ag::narrow(h, -1, 0, hidden_), up = ag::narrow(h, -1, hidden_, hidden_);
    return ag::linear(ag::silu(gate) * up, param(down_));
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<ComposedSwiGLU>(dim_, hidden_);
  }

 private:
  int64_t dim_, hidden_;
  Parameter& gate_up_;
  Parameter& down_;
};

// Rotary position embeddings (RoFormer, Llama's rotate-half pairing) on x (B, T, H, head_dim):
// each pair (j, j + head_dim / 2) at position t turns by t base^(-2 j / head_dim). Tables are
// constants (per device, never averaged or saved).
class ComposedRotary : public Composed {
 public:
  ComposedRotary(int64_t head_dim, int64_t context, float base = 10000.f)
      : head_dim_(head_dim), context_(context), base_(base) {
    DP_CHECK(head_dim > 0 && head_dim % 2 == 0 && context > 0 && base > 1.f,
             "ComposedRotary(" << head_dim << ", " << context << ", " << base
                               << "): an even head width, a context > 0 and a base > 1");
    auto table = [head_dim, base](bool cosine) {
      return [head_dim, base, cosine](const Shape& s) {
        std::vector<float> v(static_cast<size_t>(s[0] * s[1]));
        for (int64_t t = 0; t < s[0]; ++t)
          for (int64_t j = 0; j < s[1]; ++j) {
            const double a =
                static_cast<double>(t) * std::pow(static_cast<double>(base), -2.0 * j / head_dim);
            v[static_cast<size_t>(t * s[1] + j)] =
                static_cast<float>(cosine ? std::cos(a) : std::sin(a));
          }
        return v;
      };
    };
    cos_ = &register_constant("rope_cos", {context, head_dim / 2}, table(true));
    sin_ = &register_constant("rope_sin", {context, head_dim / 2}, table(false));
  }
  std::string type_name() const override { return "ComposedRotary"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    const int64_t t = x.dim(1), half = head_dim_ / 2;
    const ag::Var c = ag::reshape(ag::narrow(constant(*cos_), 0, 0, t), {t, 1, half});
    const ag::Var s = ag::reshape(ag::narrow(constant(*sin_), 0, 0, t), {t, 1, half});
    const ag::Var x1 = ag::narrow(x, -1, 0, half), x2 = ag::narrow(x, -1, half, half);
    return ag::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<ComposedRotary>(head_dim_, context_, base_);
  }

 private:
  int64_t head_dim_, context_;
  float base_;
  Constant* cos_ = nullptr;
  Constant* sin_ = nullptr;
};

}  // namespace nn
