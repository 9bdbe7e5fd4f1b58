// nn::Llama: a Llama-style decoder (pre-RMSNorm blocks, SwiGLU MLP, rotary position embeddings
// in attention, no biases, an untied LM head), built from the same flat buffers and engines as
// nn::Gpt. Every head has its own keys and values here; grouped-query attention is a composed
// layer (nn::ComposedAttention, nn/composed.hpp), not yet an option of the fused attention.
//
//   auto net = nn::llama(nn::LlamaConfig::preset("tiny"));   // nn/zoo.hpp
//   net->materialize(Device::cpu(), seed);
//   Tensor logits = net->forward(ids);                        // ids (B, T) i32 -> (B, T, vocab)
#pragma once

#include <cmath>
#include <memory>
#include <string>

#include "nn/attention.hpp"
#include "nn/composed.hpp"
#include "nn/containers.hpp"
#include "nn/embedding.hpp"
#include "nn/linear.hpp"
#include "nn/loss.hpp"
#include "nn/norm.hpp"

namespace nn {

struct LlamaConfig {
  int64_t vocab = 256;
  int64_t context = 128;  // the longest sequence (rows of the rotary tables)
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t dim = 128;
  int64_t hidden = 352;  // SwiGLU width: 8 dim / 3 rounded up to a multiple of 32
  float norm_eps = 1e-5f;
  float rope_base = 10000.f;
  // RMSNorm and SwiGLU written with autograd (nn/composed.hpp) instead of the fused layers: the
  // same parameters and the same function, the reference the fused ones are tested against.
  bool composed = false;
  // Activation checkpointing of every block (LlamaBlock::set_recompute): a block keeps its input
  // alone and runs its forward again in its backward.
  bool recompute = false;
  // The chunked classifier, as GptConfig::loss_chunk (0: never).
  int64_t loss_chunk = 8192;
  std::string name = "custom";

  // "tiny" (byte vocabulary, about 0.9M parameters, for CI). Throws naming the choices
  // otherwise.
  static LlamaConfig preset(const std::string& name) {
    LlamaConfig c;
    c.name = name;
    if (name == "tiny") return c;
    DP_THROW("LlamaConfig::preset(\"" << name << "\"): choose tiny");
  }
  // Llama's rule for the SwiGLU width: 8 dim / 3, rounded up to a multiple of `multiple_of`.
  static int64_t swiglu_hidden(int64_t dim, int64_t multiple_of) {
    const int64_t h = (8 * dim + 2) / 3;
    return (h + multiple_of - 1) / multiple_of * multiple_of;
  }
  int64_t block_parameters() const { return 2 * dim + 4 * dim * dim + 3 * dim * hidden; }
  int64_t parameters() const { return 2 * vocab * dim + layers * block_parameters() + dim; }
  // As GptConfig's: 2 P_blocks + 4 L T D, what recompute adds.
  double block_forward_flops_per_token(int64_t seq) const {
    return 2.0 * static_cast<double>(layers * block_parameters()) +
           4.0 * static_cast<double>(layers * seq * dim);
  }
  // Training FLOPs per token, as GptConfig's: 6 P + 12 L T D (the embedding table is a lookup,
  // but counted in P as nanoGPT and llm.c count it).
  double flops_per_token(int64_t seq) const {
    return 6.0 * static_cast<double>(parameters()) + 12.0 * static_cast<double>(layers * seq * dim);
  }
};

// Llama's MLP: x (..., D) -> down(silu(x W_gate) * (x W_up)). The gate and up projections are
// one Linear "gate_up" (D -> 2 H, [gate | up] rows), fused by kernels::swiglu_*; "down" (H -> D).
// No biases.
class SwiGLU : public Module {
 public:
  SwiGLU(int64_t dim, int64_t hidden) : dim_(dim), hidden_(hidden) {
    DP_CHECK(dim > 0 && hidden > 0, "SwiGLU(" << dim << ", " << hidden << "): sizes must be > 0");
    gate_up_ = register_module("gate_up", std::make_shared<Linear>(dim, 2 * hidden, Bias::no));
    down_ = register_module("down", std::make_shared<Linear>(hidden, dim, Bias::no));
  }
  std::string type_name() const override { return "SwiGLU"; }
  Linear& gate_up() { return *gate_up_; }
  Linear& down() { return *down_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    h_ = gate_up_->forward(x);  // (..., 2 H)
    const int64_t rows = h_.numel() / (2 * hidden_);
    Shape g_shape = h_.shape();
    g_shape.back() = hidden_;
    Tensor g = Tensor::empty({rows, hidden_}, h_.dtype(), x.device());  // (M, H)
    kernels::swiglu_forward(g, h_.reshape({rows, 2 * hidden_}));
    return down_->forward(g.reshape(g_shape));
  }
  Tensor backward_impl(const Tensor& dy) override {
    DP_CHECK(h_.defined(), "SwiGLU::backward called before forward");
    Tensor dg = down_->backward(dy);  // (..., H)
    const int64_t rows = h_.numel() / (2 * hidden_);
    Tensor dh = Tensor::empty(h_.shape(), h_.dtype(), dy.device());
    Tensor dh2 = dh.reshape({rows, 2 * hidden_});
    kernels::swiglu_backward(dh2, dg.reshape({rows, hidden_}), h_.reshape({rows, 2 * hidden_}));
    return gate_up_->backward(dh);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<SwiGLU>(dim_, hidden_);
  }

 private:
  int64_t dim_, hidden_;
  std::shared_ptr<Linear> gate_up_, down_;
  Tensor h_;  // the gate and up projections, cached for backward
  void release_saved() override { h_ = Tensor(); }
};

// x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)): (B, T, D) -> (B, T, D).
class LlamaBlock : public Module {
 public:
  explicit LlamaBlock(const LlamaConfig& c) : c_(c) {
    AttentionOptions o;
    o.bias = Bias::no;
    o.rotary_context = c.context;
    o.rotary_base = c.rope_base;
    attn_norm_ = register_module("attn_norm", norm(c));
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(c.dim, c.heads, 0.f, o));
    mlp_norm_ = register_module("mlp_norm", norm(c));
    mlp_ = register_module("mlp", c.composed
                                      ? ModulePtr(std::make_shared<ComposedSwiGLU>(c.dim, c.hidden))
                                      : ModulePtr(std::make_shared<SwiGLU>(c.dim, c.hidden)));
  }
  std::string type_name() const override { return "LlamaBlock"; }
  // The fused RMSNorm, or the composed one with c.composed.
  static ModulePtr norm(const LlamaConfig& c) {
    if (c.composed) return std::make_shared<ComposedRMSNorm>(c.dim, c.norm_eps);
    return std::make_shared<RMSNorm>(c.dim, c.norm_eps);
  }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor h = residual_sum(x, attn_->forward(attn_norm_->forward(x)));
    return residual_sum(h, mlp_->forward(mlp_norm_->forward(h)));
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor dh = residual_sum(dy, mlp_norm_->backward(mlp_->backward(dy)));
    return residual_sum(dh, attn_norm_->backward(attn_->backward(dh)));
  }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<LlamaBlock>(c_); }

 private:
  LlamaConfig c_;
  ModulePtr attn_norm_, mlp_norm_, mlp_;
  std::shared_ptr<CausalSelfAttention> attn_;
};

// ids (B, T) i32 with T <= context -> logits (B, T, vocab): f32, or output_dtype() for a loss
// that reads 16-bit logits.
//   x = embed[ids];  x = layers.L-1(...layers.0(x));  logits = lm_head(norm(x))
// Init: embeddings and Linear weights N(0, 0.02), the residual projections (attn.c_proj,
// mlp.down) N(0, 0.02 / sqrt(2 layers)), RMSNorm gains 1.
class Llama : public Module {
 public:
  explicit Llama(LlamaConfig c) : c_(std::move(c)) {
    DP_CHECK(c_.vocab > 0 && c_.context > 0 && c_.layers > 0 && c_.heads > 0 && c_.dim > 0 &&
                 c_.dim % c_.heads == 0 && (c_.dim / c_.heads) % 2 == 0 && c_.hidden > 0 &&
                 c_.loss_chunk >= 0,
             "Llama(" << c_.name << "): vocab " << c_.vocab << ", context " << c_.context << ", "
                      << c_.layers << " layers, " << c_.heads << " heads, dim " << c_.dim
                      << ", hidden " << c_.hidden << ", loss_chunk " << c_.loss_chunk
                      << ": sizes must be > 0, heads must divide dim into even head widths, "
                         "loss_chunk >= 0");
    const InitSpec w = InitSpec::normal(0.02f);
    const InitSpec w_resid =
        InitSpec::normal(0.02f / std::sqrt(2.f * static_cast<float>(c_.layers)));
    embed_ = register_module("embed", std::make_shared<Embedding>(c_.vocab, c_.dim));
    embed_->weight().init = w;
    layers_ = register_module("layers", std::make_shared<Sequential>());
    for (int64_t l = 0; l < c_.layers; ++l) {
      auto block = layers_->add(std::make_shared<LlamaBlock>(c_));
      block->set_recompute(c_.recompute);
      for (auto& [name, p] : block->named_parameters())
        if (name == "attn.c_attn.weight" || name == "mlp.gate_up.weight")
          p->init = w;
        else if (name == "attn.c_proj.weight" || name == "mlp.down.weight")
          p->init = w_resid;
    }
    norm_ = register_module("norm", LlamaBlock::norm(c_));
    lm_head_ = register_module("lm_head", std::make_shared<Linear>(c_.dim, c_.vocab, Bias::no));
    lm_head_->weight().init = w;
  }
  std::string type_name() const override { return "Llama"; }
  const LlamaConfig& config() const { return c_; }
  // The chunked classifier (LlamaConfig::loss_chunk), as Gpt's.
  bool takes_loss(const Loss& loss, const Tensor& labels) const override {
    return takes_chunked_token_loss(c_.loss_chunk, recomputes(), loss, labels);
  }

 protected:
  Tensor forward_impl(const Tensor& ids) override {
    DP_CHECK(ids.ndim() == 2 && ids.dtype() == DType::i32 && ids.dim(1) <= c_.context,
             "Llama(" << c_.name << "): ids " << ids << " must be (B, T) i32 with T <= context "
                      << c_.context);
    // The residual stream in the activation dtype from the embedding on (one cast under 16-bit
    // activations: the lookup writes f32).
    Tensor x = as_dtype(embed_->forward(ids), activation_dtype());
    Tensor h = norm_->forward(layers_->forward(x));
    dhidden_ = Tensor();
    LossInForward* request = loss_in_forward();
    if (!request) return lm_head_->forward(h);
    // The chunked classifier: lm_head's GEMMs run here, a chunk of tokens at a time, and its
    // backward never runs (its weight's gradient is final once this forward is done).
    hidden_shape_ = h.shape();
    const Tensor rows = to_compute(h.reshape({h.numel() / c_.dim, c_.dim}));
    Parameter& w = lm_head_->weight();
    dhidden_ = chunked_token_loss(*request, rows, w.compute, w.grad, c_.loss_chunk, output_dtype(),
                                  activation_dtype(), "Llama(" + c_.name + ")");
    return Tensor();
  }
  Tensor backward_impl(const Tensor& dlogits) override {
    Tensor dh;
    if (dhidden_.defined()) {
      DP_CHECK(!dlogits.defined(), "Llama(" << c_.name
                                            << ")::backward: its forward took the loss "
                                               "(LlamaConfig::loss_chunk): give an undefined "
                                               "gradient");
      dh = dhidden_.reshape(hidden_shape_);
      dhidden_ = Tensor();
      own_grads_ready(*lm_head_);
    } else {
      dh = lm_head_->backward(dlogits);
    }
    return embed_->backward(layers_->backward(norm_->backward(dh)));
  }
  void release_saved() override { dhidden_ = Tensor(); }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Llama>(c_); }

 private:
  LlamaConfig c_;
  std::shared_ptr<Embedding> embed_;
  std::shared_ptr<Sequential> layers_;
  ModulePtr norm_;
  std::shared_ptr<Linear> lm_head_;
  Tensor dhidden_;  // d norm's output, when the forward took the loss (chunked_token_loss)
  Shape hidden_shape_;
};

}  // namespace nn
