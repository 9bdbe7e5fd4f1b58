// nn::CausalSelfAttention: multi-head self-attention with a fused QKV projection, as GPT-2; with
// rotary position embeddings and no biases, as Llama (AttentionOptions).
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/dropout.hpp"
#include "nn/linear.hpp"

namespace nn {

// What differs between GPT-2's attention (the defaults) and Llama's.
struct AttentionOptions {
  Bias bias = Bias::yes;  // c_attn and c_proj add biases (Llama: no)
  // > 0: rotary position embeddings (RoFormer, Llama's rotate-half pairing) turn q and k by
  // their position, for sequences up to this length; 0: none (GPT-2 learns positions instead).
  int64_t rotary_context = 0;
  float rotary_base = 10000.f;  // angle of pair j at position t: t base^(-2 j / head_dim)
};

// x (B, T, D) -> y (B, T, D):
//   qkv = c_attn(x)                          (B, T, 3 D), [q | k | v], heads inside each
//   q, k = rotary(q, k)                      with rotary_context > 0 (constants "rope_cos",
//                                            "rope_sin" (rotary_context, D / H / 2), per device)
//   a   = dropout(softmax(q k^T / sqrt(D / H) + causal mask)) v, per head (kernels::attention_*)
//   y   = dropout(c_proj(a))
// Children "c_attn" (Linear(D, 3 D)), "c_proj" (Linear(D, D)), "resid_drop" (Dropout(p)).
// In training with p > 0 the probabilities' mask comes from the tree's random stream, as
// nn::Dropout's (B H T T counters per call), so CPU and CUDA drop the same entries.
class CausalSelfAttention : public Module {
 public:
  // requires heads divides dim; 0 <= dropout < 1; with rotary, an even head width and a base
  // > 1.
  CausalSelfAttention(int64_t dim, int64_t heads, float dropout = 0.f, AttentionOptions o = {})
      : dim_(dim), heads_(heads), dropout_(dropout), options_(o) {
    DP_CHECK(dim > 0 && heads > 0 && dim % heads == 0,
             "CausalSelfAttention(" << dim << ", " << heads << " heads): heads must divide dim");
    c_attn_ = register_module("c_attn", std::make_shared<Linear>(dim, 3 * dim, o.bias));
    c_proj_ = register_module("c_proj", std::make_shared<Linear>(dim, dim, o.bias));
    drop_ = register_module("resid_drop", std::make_shared<Dropout>(dropout));
    if (o.rotary_context > 0) {
      const int64_t head_dim = dim / heads;
      DP_CHECK(head_dim % 2 == 0 && o.rotary_base > 1.f,
               "CausalSelfAttention(" << dim << ", " << heads << " heads): rotary embeddings need "
                                      << "an even head width (got " << head_dim
                                      << ") and a base > 1 (got " << o.rotary_base << ")");
      const double base = o.rotary_base;
      auto table = [head_dim, base](bool cosine) {
        return [head_dim, base, cosine](const Shape& s) {
          std::vector<float> v(static_cast<size_t>(s[0] * s[1]));
          for (int64_t t = 0; t < s[0]; ++t)
            for (int64_t j = 0; j < s[1]; ++j) {
              const double angle =
                  static_cast<double>(t) *
                  std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
              v[static_cast<size_t>(t * s[1] + j)] =
                  static_cast<float>(cosine ? std::cos(angle) : std::sin(angle));
            }
          return v;
        };
      };
      cos_ = &register_constant("rope_cos", {o.rotary_context, head_dim / 2}, table(true));
      sin_ = &register_constant("rope_sin", {o.rotary_context, head_dim / 2}, table(false));
    }
  }
  std::string type_name() const override { return "CausalSelfAttention"; }
  int64_t dim() const { return dim_; }
  int64_t heads() const { return heads_; }
  Linear& c_attn() { return *c_attn_; }
  Linear& c_proj() { return *c_proj_; }
  const AttentionOptions& options() const { return options_; }
  kernels::AttentionParams params() const {
    return {heads_, 1.f / std::sqrt(static_cast<float>(dim_ / heads_)),
            kernels::AttentionMask::causal};
  }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    DP_CHECK(x.ndim() == 3 && x.dim(2) == dim_,
             "CausalSelfAttention(" << dim_ << "): input " << kernels::shape_str(x.shape())
                                    << " must be (B, T, " << dim_ << ")");
    const int64_t b = x.dim(0), t = x.dim(1);
    // Under 16-bit activations qkv and a are 16-bit: cuDNN's fused attention on CUDA.
    qkv_ = c_attn_->forward(x);  // (B, T, 3 D)
    if (cos_) {
      DP_CHECK(t <= options_.rotary_context, "CausalSelfAttention: " << t << " positions, but the "
                                                                     << "rotary tables hold "
                                                                     << options_.rotary_context);
      kernels::rotary_embedding(qkv_, cos_->value, sin_->value, dim_ / heads_, 2 * dim_,
                                kernels::Rotation::forward);  // q and k, in place
    }
    a_ = Tensor::empty({b, t, dim_}, qkv_.dtype(), x.device());    // (B, T, D)
    lse_ = Tensor::empty({b, heads_, t}, DType::f32, x.device());  // (B, H, T)
    used_ = params();
    if (is_training() && dropout_ > 0.f) {
      FlatState& st = flat();
      used_.dropout = dropout_;
      used_.dropout_seed = st.rng_key;
      used_.dropout_offset = st.rng_at();  // read on the device in graphed steps
      st.rng_offset += static_cast<uint64_t>(b * heads_ * t * t);
    }
    kernels::attention_forward(a_, lse_, qkv_, used_);
    return drop_->forward(c_proj_->forward(a_));
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(qkv_.defined(), "CausalSelfAttention::backward called before forward");
    Tensor da = c_proj_->backward(drop_->backward(dy));                    // (B, T, D)
    Tensor dqkv = Tensor::empty(qkv_.shape(), qkv_.dtype(), dy.device());  // (B, T, 3 D)
    kernels::attention_backward(dqkv, da, qkv_, a_, lse_, used_);          // the forward's mask
    // The rotation is orthogonal: its gradient turns back by the same angles.
    if (cos_)
      kernels::rotary_embedding(dqkv, cos_->value, sin_->value, dim_ / heads_, 2 * dim_,
                                kernels::Rotation::inverse);
    return c_attn_->backward(dqkv);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<CausalSelfAttention>(dim_, heads_, dropout_, options_);
  }

 private:
  int64_t dim_, heads_;
  float dropout_;
  AttentionOptions options_;
  Constant* cos_ = nullptr;  // rotary tables (rotary_context, head_dim / 2), or null
  Constant* sin_ = nullptr;
  std::shared_ptr<Linear> c_attn_, c_proj_;
  std::shared_ptr<Dropout> drop_;
  void release_saved() override { qkv_ = a_ = lse_ = Tensor(); }
  Tensor qkv_, a_, lse_;           // cached for backward
  kernels::AttentionParams used_;  // the forward's, dropout mask included
};

}  // namespace nn
