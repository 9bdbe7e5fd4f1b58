// nn::Gpt: a GPT-2 decoder (pre-LayerNorm blocks, GELU-tanh MLP, learned positions, LM head
// tied to the token embedding), laid out and initialised as nanoGPT's model.
//
//   auto net = nn::gpt(nn::GptConfig::preset("tiny"));   // nn/zoo.hpp
//   net->materialize(Device::cpu(), seed);
//   Tensor logits = net->forward(ids);                    // ids (B, T) i32 -> (B, T, vocab)
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "nn/activations.hpp"
#include "nn/attention.hpp"
#include "nn/containers.hpp"
#include "nn/dropout.hpp"
#include "nn/embedding.hpp"
#include "nn/linear.hpp"
#include "nn/loss.hpp"
#include "nn/norm.hpp"

namespace nn {

struct GptConfig {
  int64_t vocab = 256;
  int64_t context = 128;  // the longest sequence (rows of the position embedding)
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t dim = 128;
  float dropout = 0.f;
  // Activation checkpointing of every block (GptBlock::set_recompute): a block keeps its input
  // alone and runs its forward again in its backward.
  bool recompute = false;
  // The chunked classifier: where a step's chunk has more tokens than this and its loss is
  // TokenCrossEntropyLoss, the engines hand the loss to the model's forward (Module::takes_loss),
  // which runs the LM head, the loss and the head's backward GEMMs over this many tokens at a
  // time, so that no buffer holds more than loss_chunk x vocab logits (GPT-2 at batch 32: 0.8 GB
  // of bf16 in place of 3.3). 0: never (the whole (B, T, V) logits, as a plain forward).
  int64_t loss_chunk = 8192;
  std::string name = "custom";

  // "tiny" (byte vocabulary, about 0.8M parameters, for CI), "124m" (GPT-2 small: 12 layers,
  // 12 heads, 768 wide, context 1024, vocabulary 50257 padded to 50304), "350m" (GPT-2 medium:
  // 24 layers, 16 heads, 1024 wide). Throws naming the choices for anything else.
  static GptConfig preset(const std::string& name) {
    GptConfig c;
    c.name = name;
    if (name == "tiny") return c;
    c.vocab = 50304;
    c.context = 1024;
    if (name == "124m") {
      c.layers = 12, c.heads = 12, c.dim = 768;
      return c;
    }
    if (name == "350m") {
      c.layers = 24, c.heads = 16, c.dim = 1024;
      return c;
    }
    DP_THROW("GptConfig::preset(\"" << name << "\"): choose tiny, 124m or 350m");
  }
  // Parameters of one block.
  int64_t block_parameters() const {
    return 2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (4 * dim * dim + 4 * dim) +
           (4 * dim * dim + dim);
  }
  // Parameters of the model (the LM head is tied: counted once).
  int64_t parameters() const {
    return vocab * dim + context * dim + layers * block_parameters() + 2 * dim;
  }
  // The blocks' forward FLOPs per token, 2 P_blocks + 4 L T D: what checkpointing them
  // (recompute) adds to a step, which MFU leaves out and HFU counts.
  double block_forward_flops_per_token(int64_t seq) const {
    return 2.0 * static_cast<double>(layers * block_parameters()) +
           4.0 * static_cast<double>(layers * seq * dim);
  }
  // Training FLOPs per token (PaLM's estimate, as llm.c and nanoGPT use for MFU):
  // 6 P + 12 L T D at sequence length T.
  double flops_per_token(int64_t seq) const {
    return 6.0 * static_cast<double>(parameters()) + 12.0 * static_cast<double>(layers * seq * dim);
  }
};

// fc (D -> 4 D), GELU (tanh), proj (4 D -> D), dropout. fc and the GELU run as one op each way
// (Linear::forward_gelu and backward_through_gelu: on a GPU, one GEMM with cuBLASLt's GELU
// epilogue where it has one; on the CPU the bits of the layers in turn), so the GELU module holds
// the place and the name of the layer in the model and runs nothing itself.
class GptMlp : public Module {
 public:
  GptMlp(int64_t dim, float dropout) : dim_(dim), dropout_(dropout) {
    c_fc_ = register_module("c_fc", std::make_shared<Linear>(dim, 4 * dim));
    gelu_ = register_module("gelu", std::make_shared<GELU>(GeluApproximation::tanh));
    c_proj_ = register_module("c_proj", std::make_shared<Linear>(4 * dim, dim));
    drop_ = register_module("drop", std::make_shared<Dropout>(dropout));
  }
  std::string type_name() const override { return "GptMlp"; }
  Linear& c_fc() { return *c_fc_; }
  Linear& c_proj() { return *c_proj_; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    return drop_->forward(c_proj_->forward(c_fc_->forward_gelu(x, pre_)));
  }
  Tensor backward_impl(const Tensor& dy) override {
    Tensor dpre = c_proj_->backward_through_gelu(drop_->backward(dy), pre_, *c_fc_);
    return c_fc_->backward_bias_given(dpre);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<GptMlp>(dim_, dropout_);
  }

 private:
  int64_t dim_;
  float dropout_;
  std::shared_ptr<Linear> c_fc_, c_proj_;
  std::shared_ptr<GELU> gelu_;
  std::shared_ptr<Dropout> drop_;
  Tensor pre_;  // fc's output, the GELU's input, for backward
  void release_saved() override { pre_ = Tensor(); }
};

// Pre-LN residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). (B, T, D) -> (B, T, D).
class GptBlock : public Module {
 public:
  GptBlock(int64_t dim, int64_t heads, float dropout) : dim_(dim), heads_(heads), p_(dropout) {
    ln_1_ = register_module("ln_1", std::make_shared<LayerNorm>(dim));
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(dim, heads, dropout));
    ln_2_ = register_module("ln_2", std::make_shared<LayerNorm>(dim));
    mlp_ = register_module("mlp", std::make_shared<GptMlp>(dim, dropout));
  }
  std::string type_name() const override { return "GptBlock"; }
  CausalSelfAttention& attn() { return *attn_; }
  GptMlp& mlp() { return *mlp_; }

  // The block on x = skip + delta with its last sum left to the caller, as llm.c runs GPT-2:
  // delta (undefined for the first block) is the previous block's MLP branch, so that sum runs
  // with ln_1 in one pass (LayerNorm::forward_add), and this block's own last sum, h + mlp_out,
  // with the next block's ln_1 or the model's ln_f. Returns h (x plus the attention branch) and
  // sets mlp_out. backward() is as after forward(x + delta): the same bits.
  Tensor forward_deferred(const Tensor& skip, const Tensor& delta, Tensor& mlp_out) {
    return run_forward([&] { return branches(skip, delta, mlp_out); },
                       [this, skip, delta] {
                         Tensor out;
                         (void)branches(skip, delta, out);
                       });
  }

 protected:
  // Each residual sum runs with the norm after it (LayerNorm::forward_add), and each norm's
  // backward adds the skip's gradient as it writes (backward_add): the bits of the separate
  // sums, with a pass over the (B, T, D) stream fewer for each. On its own the block adds its
  // last sum itself; Gpt leaves it to the next norm (forward_deferred).
  Tensor forward_impl(const Tensor& x) override {
    Tensor mlp_out, h = branches(x, Tensor(), mlp_out);
    return residual_sum(h, mlp_out);
  }
  // Reverse order: the MLP branch, then the attention branch; the skips pass dy through.
  Tensor backward_impl(const Tensor& dy) override {
    Tensor dh = ln_2_->backward_add(mlp_->backward(dy), dy);
    return ln_1_->backward_add(attn_->backward(dh), dh);
  }
  std::shared_ptr<Module> clone_config() const override {
    return std::make_shared<GptBlock>(dim_, heads_, p_);
  }

 private:
  // x = skip (+ delta, fused with ln_1), h = x + attn(ln_1(x)) fused with ln_2, mlp_out =
  // mlp(ln_2(h)); returns h.
  Tensor branches(const Tensor& skip, const Tensor& delta, Tensor& mlp_out) {
    Tensor x = skip, h;
    Tensor n = delta.defined() ? ln_1_->forward_add(skip, delta, x) : ln_1_->forward(skip);
    n = ln_2_->forward_add(x, attn_->forward(n), h);
    mlp_out = mlp_->forward(n);
    return h;
  }

  int64_t dim_, heads_;
  float p_;
  std::shared_ptr<LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<GptMlp> mlp_;
};

// ids (B, T) i32 with T <= context -> logits (B, T, vocab): f32, or output_dtype() (bf16 for a
// loss that reads 16-bit logits).
//   x = dropout(wte[ids] + wpe[0:T]);  x = h.0(...h.L-1(x));  logits = ln_f(x) wte^T
// Parameters in flat order: wpe (context, D), wte.weight (vocab, D), h.*, ln_f.*; the LM head
// reads wte (tied), so its gradient sums both uses. Init (GptConfig, as GPT-2 / nanoGPT):
// embeddings and Linear weights N(0, 0.02), biases 0, LayerNorm 1 and 0, and the residual
// projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 layers)).
class Gpt : public Module {
 public:
  explicit Gpt(GptConfig c) : c_(std::move(c)) {
    DP_CHECK(c_.vocab > 0 && c_.context > 0 && c_.layers > 0 && c_.heads > 0 && c_.dim > 0 &&
                 c_.dim % c_.heads == 0 && c_.dropout >= 0.f && c_.dropout < 1.f &&
                 c_.loss_chunk >= 0,
             "Gpt(" << c_.name << "): vocab " << c_.vocab << ", context " << c_.context << ", "
                    << c_.layers << " layers, " << c_.heads << " heads, dim " << c_.dim
                    << ", dropout " << c_.dropout << ", loss_chunk " << c_.loss_chunk
                    << ": sizes must be > 0, heads must divide dim, dropout in [0, 1), "
                       "loss_chunk >= 0");
    const InitSpec w = InitSpec::normal(0.02f);
    const InitSpec w_resid =
        InitSpec::normal(0.02f / std::sqrt(2.f * static_cast<float>(c_.layers)));
    wpe_ = &register_parameter("wpe", {c_.context, c_.dim}, w);
    wte_ = register_module("wte", std::make_shared<Embedding>(c_.vocab, c_.dim));
    wte_->weight().init = w;
    drop_ = register_module("drop", std::make_shared<Dropout>(c_.dropout));
    h_ = register_module("h", std::make_shared<Sequential>());
    for (int64_t l = 0; l < c_.layers; ++l) {
      auto block = h_->add(std::make_shared<GptBlock>(c_.dim, c_.heads, c_.dropout));
      block->set_recompute(c_.recompute);
      for (Linear* lin : {&block->attn().c_attn(), &block->attn().c_proj(), &block->mlp().c_fc(),
                          &block->mlp().c_proj()}) {
        lin->weight().init = w;
        lin->bias()->init = InitSpec::constant(0.f);
      }
      block->attn().c_proj().weight().init = w_resid;
      block->mlp().c_proj().weight().init = w_resid;
    }
    ln_f_ = register_module("ln_f", std::make_shared<LayerNorm>(c_.dim));
  }
  std::string type_name() const override { return "Gpt"; }
  bool backward_reads_output() const override { return false; }  // it keeps ln_f's output
  // The chunked classifier (GptConfig::loss_chunk).
  bool takes_loss(const Loss& loss, const Tensor& labels) const override {
    return takes_chunked_token_loss(c_.loss_chunk, recomputes(), loss, labels);
  }
  const GptConfig& config() const { return c_; }
  Embedding& wte() { return *wte_; }

 protected:
  Tensor forward_impl(const Tensor& ids) override {
    DP_CHECK(ids.ndim() == 2 && ids.dtype() == DType::i32 && ids.dim(1) <= c_.context,
             "Gpt(" << c_.name << "): ids " << ids << " must be (B, T) i32 with T <= context "
                    << c_.context);
    const int64_t b = ids.dim(0), t = ids.dim(1);
    Tensor e = wte_->forward(ids);  // (B, T, D) f32
    // + wpe[0:T]: the first T rows of wpe are its first T D elements, a bias over (B, T D). The
    // sum starts the residual stream, in the activation dtype (bf16 under 16-bit activations,
    // rounded once here: the blocks, their LayerNorms and ln_f then read and write it as it is).
    Tensor x = Tensor::empty(e.shape(), activation_dtype(), ids.device());
    Tensor x2 = x.reshape({b, t * c_.dim});
    kernels::add(x2, e.reshape({b, t * c_.dim}), wpe_->value.view(0, {t * c_.dim}));
    // The blocks, each one's last residual sum fused with the next norm (forward_deferred): the
    // bits of h_->forward, run as h's forward (forward_by_parts), whose backward then runs as it
    // is.
    Tensor skip = drop_->forward(x), delta;
    skip = h_->forward_by_parts([&] {
      Tensor s = skip;
      for (size_t l = 0; l < h_->size(); ++l) {
        auto* block = dynamic_cast<GptBlock*>((*h_)[l].get());
        DP_CHECK(block, "Gpt(" << c_.name << "): h." << l << " is not a GptBlock");
        Tensor mlp_out;
        s = block->forward_deferred(s, delta, mlp_out);
        delta = mlp_out;
      }
      return s;
    });
    Tensor stream;
    x = ln_f_->forward_add(skip, delta, stream);
    hidden_ = to_compute(x.reshape({b * t, c_.dim}));  // (B T, D)
    hidden_batch_ = b;
    dhidden_ = Tensor();
    if (LossInForward* request = loss_in_forward()) {  // the chunked classifier
      dhidden_ = chunked_token_loss(*request, hidden_, wte_->weight().compute, wte_->weight().grad,
                                    c_.loss_chunk, output_dtype(), activation_dtype(),
                                    "Gpt(" + c_.name + ")");
      return Tensor();
    }
    // f32 logits, or 16-bit ones for a loss that reads them (Module::set_output).
    Tensor logits = Tensor::empty({b * t, c_.vocab}, output_dtype(), ids.device());
    // (B T, D) x (V, D)^T -> (B T, V)
    kernels::gemm(logits, hidden_, kernels::Transpose::no, wte_->weight().compute,
                  kernels::Transpose::yes);
    return logits.reshape({b, t, c_.vocab});
  }
  Tensor backward_impl(const Tensor& dlogits) override {
    DP_CHECK(hidden_.defined(), "Gpt::backward called before forward");
    const int64_t rows = hidden_.dim(0), b = hidden_batch_, t = rows / b;
    Tensor dx = dhidden_;  // the chunked classifier's, from the forward that took the loss
    if (dx.defined()) {
      DP_CHECK(!dlogits.defined(), "Gpt(" << c_.name
                                          << ")::backward: its forward took the loss "
                                             "(GptConfig::loss_chunk): give an undefined gradient");
    } else {
      DP_CHECK(dlogits.defined() && dlogits.numel() == rows * c_.vocab,
               "Gpt(" << c_.name << ")::backward: dlogits " << dlogits << " for logits (" << b
                      << ", " << t << ", " << c_.vocab << ")");
      Tensor dl = to_compute(dlogits.reshape({rows, c_.vocab}));  // (B T, V)
      dx = Tensor::empty({rows, c_.dim}, activation_dtype(), dlogits.device());
      // (B T, V) x (V, D) -> (B T, D);  dwte += (B T, V)^T x (B T, D) -> (V, D)
      kernels::gemm(dx, dl, kernels::Transpose::no, wte_->weight().compute, kernels::Transpose::no);
      kernels::gemm(wte_->weight().grad, dl, kernels::Transpose::yes, hidden_,
                    kernels::Transpose::no, 1.f, 1.f);
    }
    dhidden_ = Tensor();
    Tensor g = drop_->backward(h_->backward(ln_f_->backward(dx.reshape({b, t, c_.dim}))));
    Tensor dwpe = wpe_->grad.view(0, {t * c_.dim});
    kernels::bias_backward(dwpe, g.reshape({b, t * c_.dim}), kernels::Accumulate::yes);
    return wte_->backward(g);
  }
  std::shared_ptr<Module> clone_config() const override { return std::make_shared<Gpt>(c_); }

 private:
  GptConfig c_;
  Parameter* wpe_ = nullptr;
  std::shared_ptr<Embedding> wte_;
  std::shared_ptr<Dropout> drop_;
  std::shared_ptr<Sequential> h_;
  std::shared_ptr<LayerNorm> ln_f_;
  Tensor hidden_;   // ln_f output as (B T, D), in the compute dtype
  Tensor dhidden_;  // its gradient, when the forward took the loss (chunked_token_loss)
  int64_t hidden_batch_ = 0;
  void release_saved() override {
    hidden_ = Tensor();
    dhidden_ = Tensor();
  }
};

}  // namespace nn
