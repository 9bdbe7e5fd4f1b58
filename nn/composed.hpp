// Llama's layers written with autograd (nn/autograd.hpp): forward only, a few lines each. They
// are the reference the fused layers (nn/norm.hpp's RMSNorm, nn/llama.hpp's SwiGLU, the rotary
// kernel of nn/attention.hpp) are tested against, and a model of how research code writes a
// layer. Parameter names, shapes and order match the fused layers', so the same seed gives the
// same weights and a checkpoint of one loads into the other.
#pragma once

#include <cmath>
#include <functional>
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
    DP_CHECK(x.ndim() >= 1 && x.dim(-1) == d_,
             "ComposedRMSNorm(" << d_ << "): input " << kernels::shape_str(x.shape())
                                << " must be (..., " << d_ << ")");
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
        gate_up_(register_parameter("gate_up.weight", {2 * hidden, dim},
                                    kaiming_uniform(dim, std::sqrt(5.f)))),
        down_(register_parameter("down.weight", {dim, hidden},
                                 kaiming_uniform(hidden, std::sqrt(5.f)))) {
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
    cos_ = &register_constant("rope_cos", {context, head_dim / 2}, table(head_dim, base, true));
    sin_ = &register_constant("rope_sin", {context, head_dim / 2}, table(head_dim, base, false));
  }
  std::string type_name() const override { return "ComposedRotary"; }

  // x (B, T, H, hd) turned by the tables' first T rows (cos, sin: (context, hd / 2)).
  static ag::Var rotate(const ag::Var& x, const ag::Var& cos, const ag::Var& sin) {
    const int64_t t = x.dim(1), half = x.dim(-1) / 2;
    const ag::Var c = ag::reshape(ag::narrow(cos, 0, 0, t), {t, 1, half});
    const ag::Var s = ag::reshape(ag::narrow(sin, 0, 0, t), {t, 1, half});
    const ag::Var x1 = ag::narrow(x, -1, 0, half), x2 = ag::narrow(x, -1, half, half);
    return ag::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  }
  // The table register_constant makes: cos or sin of t base^(-2 j / head_dim).
  static std::function<std::vector<float>(const Shape&)> table(int64_t head_dim, float base,
                                                               bool cosine) {
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
  }

 protected:
  ag::Var compose(const ag::Var& x) override {
    DP_CHECK(x.ndim() == 4 && x.dim(1) <= context_ && x.dim(-1) == head_dim_,
             "ComposedRotary(" << head_dim_ << ", context " << context_ << "): input "
                               << kernels::shape_str(x.shape()) << " must be (B, T <= " << context_
                               << ", H, " << head_dim_ << ")");
    return rotate(x, constant(*cos_), constant(*sin_));
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

// Causal self-attention with grouped-query heads (GQA, as Llama 2 70B and Llama 3): `heads`
// query heads share `kv_heads` key/value heads (kv_heads divides heads; kv_heads == heads is
// multi-head attention, 1 is multi-query), optional rotary embeddings on queries and keys, no
// biases. x (B, T, D) -> (B, T, D). Weights "q.weight" (D, D), "k.weight" and "v.weight"
// (kv_heads hd, D), "o.weight" (D, D). Scores materialised (B, H, T, T): a research layer, not
// the fused kernel.
class ComposedAttention : public Composed {
 public:
  ComposedAttention(int64_t dim, int64_t heads, int64_t kv_heads, int64_t context,
                    bool rotary = true)
      : dim_(dim),
        heads_(heads),
        kv_heads_(kv_heads),
        context_(context),
        rotary_(rotary),
        hd_(heads > 0 ? dim / heads : 0),
        q_(register_parameter("q.weight", {dim, dim}, kaiming_uniform(dim, std::sqrt(5.f)))),
        k_(register_parameter("k.weight", {kv_heads * hd_, dim},
                              kaiming_uniform(dim, std::sqrt(5.f)))),
        v_(register_parameter("v.weight", {kv_heads * hd_, dim},
                              kaiming_uniform(dim, std::sqrt(5.f)))),
        o_(register_parameter("o.weight", {dim, dim}, kaiming_uniform(dim, std::sqrt(5.f)))) {
    DP_CHECK(heads > 0 && kv_heads > 0 && dim % heads == 0 && heads % kv_heads == 0 &&
                 context > 0 && (!rotary || hd_ % 2 == 0),
             "ComposedAttention(" << dim << ", " << heads << " heads, " << kv_heads
                                  << " kv heads, context " << context
                                  << "): heads must divide dim, kv heads divide heads, and rotary "
                                     "needs an even head width");
    if (rotary) {
      cos_ = &register_constant("rope_cos", {context, hd_ / 2},
                                ComposedRotary::table(hd_, 1e4f, true));
      sin_ = &register_constant("rope_sin", {context, hd_ / 2},
                                ComposedRotary::table(hd_, 1e4f, false));
    }
    // 1 on and below the diagonal: the causal mask, a constant table.
    mask_ = &register_constant("causal_mask", {context, context}, [](const Shape& s) {
      std::vector<float> m(static_cast<size_t>(s[0] * s[1]));
      for (int64_t i = 0; i < s[0]; ++i)
        for (int64_t j = 0; j <= i; ++j) m[static_cast<size_t>(i * s[1] + j)] = 1.f;
      return m;
    });
    masked_ =
        &register_constant("masked", {1}, [](const Shape&) { return std::vector<float>{-1e30f}; });
  }
  std::string type_name() const override { return "ComposedAttention"; }

 protected:
  ag::Var compose(const ag::Var& x) override {
    DP_CHECK(x.ndim() == 3 && x.dim(1) <= context_ && x.dim(2) == dim_,
             "ComposedAttention(" << dim_ << ", context " << context_ << "): input "
                                  << kernels::shape_str(x.shape())
                                  << " must be (B, T <= " << context_ << ", " << dim_ << ")");
    const int64_t b = x.dim(0), t = x.dim(1), g = heads_ / kv_heads_;
    ag::Var q = ag::reshape(ag::linear(x, param(q_)), {b, t, heads_, hd_});
    ag::Var k = ag::reshape(ag::linear(x, param(k_)), {b, t, kv_heads_, hd_});
    const ag::Var v = ag::reshape(ag::linear(x, param(v_)), {b, t, kv_heads_, 1, hd_});
    if (rotary_) {
      q = ComposedRotary::rotate(q, constant(*cos_), constant(*sin_));
      k = ComposedRotary::rotate(k, constant(*cos_), constant(*sin_));
    }
    // Each key/value head serves g query heads: (B, T, G, 1, hd) -> (B, T, H, hd).
    auto share = [&](const ag::Var& kv) {
      return ag::reshape(ag::expand(kv, {b, t, kv_heads_, g, hd_}), {b, t, heads_, hd_});
    };
    const ag::Var qh = ag::permute(q, {0, 2, 1, 3});  // (B, H, T, hd)
    const ag::Var kh = ag::permute(share(ag::reshape(k, {b, t, kv_heads_, 1, hd_})), {0, 2, 3, 1});
    const ag::Var vh = ag::permute(share(v), {0, 2, 1, 3});
    const ag::Var scores = ag::matmul(qh, kh) * (1.f / std::sqrt(static_cast<float>(hd_)));
    const ag::Var mask = ag::narrow(ag::narrow(constant(*mask_), 0, 0, t), 1, 0, t);
    const ag::Var att = ag::softmax(ag::where(mask, scores, constant(*masked_)), -1);
    const ag::Var y = ag::reshape(ag::permute(ag::matmul(att, vh), {0, 2, 1, 3}), {b, t, dim_});
    return ag::linear(y, param(o_));
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<ComposedAttention>(dim_, heads_, kv_heads_, context_, rotary_);
  }

 private:
  int64_t dim_, heads_, kv_heads_, context_;
  bool rotary_;
  int64_t hd_;
  Parameter& q_;
  Parameter& k_;
  Parameter& v_;
  Parameter& o_;
  Constant* cos_ = nullptr;
  Constant* sin_ = nullptr;
  Constant* mask_ = nullptr;
  Constant* masked_ = nullptr;
};

}  // namespace nn
