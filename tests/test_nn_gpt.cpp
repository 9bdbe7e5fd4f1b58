// GPT pieces: attention against a double-precision loop, gradient checks of the new layers,
// token cross-entropy with an ignore index, the GPT model's layout, init and presets.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "kernels/philox.hpp"
#include "tests/nn_test_util.hpp"

using namespace nn_test;
using std::make_shared;

namespace {

// Reference attention in double: qkv (B, T, 3 D) -> y (B, T, D), and the gradient of
// sum(y * dy) w.r.t. qkv, straight from the definition (causal mask; with p.dropout, P[b, h,
// i, j] times keep / (1 - p) by kernels/ops.hpp's counter formula).
struct RefAttention {
  std::vector<double> y, dqkv;
};
RefAttention reference_attention(const std::vector<float>& qkv, const std::vector<float>& dy,
                                 int64_t b_n, int64_t t_n, int64_t heads, int64_t d,
                                 const kernels::AttentionParams& drop = {}) {
  auto mask = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    if (drop.dropout <= 0.f) return 1.0;
    const uint64_t counter =
        drop.dropout_offset.read() + static_cast<uint64_t>(((b * heads + h) * t_n + i) * t_n + j);
    return kernels::philox::uniform(drop.dropout_seed, counter) >= drop.dropout
               ? 1.0 / (1.0 - drop.dropout)
               : 0.0;
  };
  const int64_t hd = d / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  RefAttention r;
  r.y.assign(static_cast<size_t>(b_n * t_n * d), 0.0);
  r.dqkv.assign(qkv.size(), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t c) {
    return static_cast<size_t>((b * t_n + t) * 3 * d + part * d + h * hd + c);
  };
  for (int64_t b = 0; b < b_n; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < t_n; ++i) {
        std::vector<double> p(static_cast<size_t>(i + 1));
        double m = -1e300, z = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t c = 0; c < hd; ++c)
            s += double(qkv[at(b, i, 0, h, c)]) * qkv[at(b, j, 1, h, c)];
          p[j] = s * scale;
          m = std::max(m, p[j]);
        }
        for (auto& v : p) z += (v = std::exp(v - m));
        for (auto& v : p) v /= z;
        const size_t yi = static_cast<size_t>((b * t_n + i) * d + h * hd);
        for (int64_t c = 0; c < hd; ++c)
          for (int64_t j = 0; j <= i; ++j)
            r.y[yi + c] += p[j] * mask(b, h, i, j) * qkv[at(b, j, 2, h, c)];
        // Backward of row i: dP_j = (dy . v_j) m_j.
        std::vector<double> dp(static_cast<size_t>(i + 1));
        double dot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t c = 0; c < hd; ++c) dp[j] += double(dy[yi + c]) * qkv[at(b, j, 2, h, c)];
          dp[j] *= mask(b, h, i, j);
          dot += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - dot) * scale;
          for (int64_t c = 0; c < hd; ++c) {
            r.dqkv[at(b, i, 0, h, c)] += ds * qkv[at(b, j, 1, h, c)];
            r.dqkv[at(b, j, 1, h, c)] += ds * qkv[at(b, i, 0, h, c)];
            r.dqkv[at(b, j, 2, h, c)] += p[j] * mask(b, h, i, j) * dy[yi + c];
          }
        }
      }
  return r;
}

double max_diff(const std::vector<float>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

nn::GptConfig micro_config() {
  nn::GptConfig c;
  c.vocab = 11, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 8;
  return c;
}

Tensor token_ids(const Shape& s, int64_t vocab, uint32_t seed) {
  std::vector<float> r = dp_test::random_vector(numel(s), seed, 0.f, static_cast<float>(vocab));
  std::vector<int32_t> ids(r.size());
  for (size_t i = 0; i < r.size(); ++i)
    ids[i] = std::min<int32_t>(static_cast<int32_t>(r[i]), static_cast<int32_t>(vocab - 1));
  return Tensor::from_ints(ids, s);
}

}  // namespace

TEST_CASE("nn.attention: CPU forward and backward match a double-precision loop") {
  const int64_t b = 2, t = 7, heads = 3, d = 12;
  Tensor qkv = uniform({b, t, 3 * d}, 5, -1.5f, 1.5f);
  Tensor dy = uniform({b, t, d}, 6);
  kernels::AttentionParams p{heads, 1.f / std::sqrt(4.f), kernels::AttentionMask::causal};
  Tensor y = Tensor::empty({b, t, d}, DType::f32, Device::cpu());
  Tensor lse = Tensor::empty({b, heads, t}, DType::f32, Device::cpu());
  kernels::attention_forward(y, lse, qkv, p);
  Tensor dqkv = Tensor::empty(qkv.shape(), DType::f32, Device::cpu());
  kernels::attention_backward(dqkv, dy, qkv, y, lse, p);
  RefAttention ref = reference_attention(host(qkv), host(dy), b, t, heads, d);
  CHECK(max_diff(host(y), ref.y) < 1e-5);
  CHECK(max_diff(host(dqkv), ref.dqkv) < 1e-5);
  // Row 0 sees only itself: y[0] = v[0] for every head.
  std::vector<float> yh = host(y), xh = host(qkv);
  for (int64_t c = 0; c < d; ++c) CHECK(yh[c] == doctest::Approx(xh[2 * d + c]).epsilon(1e-6));
}

TEST_CASE("nn.attention: dropout on the probabilities matches the loop with the same mask") {
  const int64_t b = 2, t = 9, heads = 2, d = 8;
  Tensor qkv = uniform({b, t, 3 * d}, 15, -1.5f, 1.5f);
  Tensor dy = uniform({b, t, d}, 16);
  kernels::AttentionParams p{heads, 1.f / std::sqrt(4.f), kernels::AttentionMask::causal};
  p.dropout = 0.3f, p.dropout_seed = 0x5eedull, p.dropout_offset = (1ull << 32) + 5;
  Tensor y = Tensor::empty({b, t, d}, DType::f32, Device::cpu());
  Tensor lse = Tensor::empty({b, heads, t}, DType::f32, Device::cpu());
  kernels::attention_forward(y, lse, qkv, p);
  Tensor dqkv = Tensor::empty(qkv.shape(), DType::f32, Device::cpu());
  kernels::attention_backward(dqkv, dy, qkv, y, lse, p);
  RefAttention ref = reference_attention(host(qkv), host(dy), b, t, heads, d, p);
  CHECK(max_diff(host(y), ref.y) < 1e-5);
  CHECK(max_diff(host(dqkv), ref.dqkv) < 1e-5);
  // The mask matters: without it the output differs.
  RefAttention plain = reference_attention(host(qkv), host(dy), b, t, heads, d);
  CHECK(max_diff(host(y), plain.y) > 1e-2);
  // A layer in training draws its mask from the tree's stream: one draw per call (the offset
  // moves by B H T T), none in eval; backward uses the forward's mask (gradcheck).
  auto attn = materialized(make_shared<nn::CausalSelfAttention>(8, 2, 0.3f));
  const uint64_t before = attn->flat().rng_offset;
  attn->forward(uniform({2, 5, 8}, 7));
  CHECK(attn->flat().rng_offset == before + 2 * 2 * 5 * 5 + 2 * 5 * 8);  // + resid_drop's
  attn->eval();
  attn->forward(uniform({2, 5, 8}, 7));
  CHECK(attn->flat().rng_offset == before + 2 * 2 * 5 * 5 + 2 * 5 * 8);
}

TEST_CASE(
    "nn.attention: bf16 and f16 qkv on CPU are the f32 result on their values, rounded once") {
  const int64_t b = 2, t = 5, heads = 2, d = 8;
  kernels::AttentionParams p{heads, 0.5f, kernels::AttentionMask::causal};
  for (DType dt : {DType::bf16, DType::f16}) {
    CAPTURE(kernels::dtype_name(dt));
    Tensor qkv = kernels::cast(uniform({b, t, 3 * d}, 8), dt),
           dy = kernels::cast(uniform({b, t, d}, 9), dt);
    Tensor y = Tensor::empty({b, t, d}, dt, Device::cpu());
    Tensor lse = Tensor::empty({b, heads, t}, DType::f32, Device::cpu());
    Tensor dqkv = Tensor::empty(qkv.shape(), dt, Device::cpu());
    kernels::attention_forward(y, lse, qkv, p);
    kernels::attention_backward(dqkv, dy, qkv, y, lse, p);
    Tensor qkv32 = kernels::cast(qkv, DType::f32), dy32 = kernels::cast(dy, DType::f32);
    Tensor y32 = Tensor::empty({b, t, d}, DType::f32, Device::cpu());
    Tensor lse32 = Tensor::empty({b, heads, t}, DType::f32, Device::cpu());
    Tensor dqkv32 = Tensor::empty(qkv.shape(), DType::f32, Device::cpu());
    kernels::attention_forward(y32, lse32, qkv32, p);
    kernels::attention_backward(dqkv32, dy32, qkv32, kernels::cast(y, DType::f32), lse32, p);
    CHECK(host(y) == host(kernels::cast(y32, dt)));
    CHECK(host(lse) == host(lse32));
    CHECK(host(dqkv) == host(kernels::cast(dqkv32, dt)));
  }
  Tensor mixed = Tensor::empty({b, t, d}, DType::f32, Device::cpu());
  Tensor lse = Tensor::empty({b, heads, t}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(kernels::attention_forward(
                           mixed, lse, kernels::cast(uniform({b, t, 3 * d}, 8), DType::bf16), p),
                       doctest::Contains("y must be bf16"), kernels::Error);
}

TEST_CASE("nn.attention: bad shapes are refused naming them") {
  Tensor qkv = uniform({1, 4, 3 * 6}, 1);
  Tensor y = Tensor::empty({1, 4, 6}, DType::f32, Device::cpu());
  Tensor lse = Tensor::empty({1, 4, 4}, DType::f32, Device::cpu());
  kernels::AttentionParams p{4, 1.f, kernels::AttentionMask::causal};  // 4 does not divide 6
  CHECK_THROWS_WITH_AS(kernels::attention_forward(y, lse, qkv, p),
                       doctest::Contains("4 heads do not divide the width 6"), kernels::Error);
  // A dropout probability outside [0, 1): NaN meant no dropout on the CPU, all dropped on a GPU.
  for (float bad : {std::nanf(""), 1.f, -0.1f}) {
    kernels::AttentionParams q{2, 1.f, kernels::AttentionMask::causal, bad};
    CHECK_THROWS_WITH_AS(kernels::attention_forward(y, lse, qkv, q),
                         doctest::Contains("dropout must be in [0, 1)"), kernels::Error);
  }
}

TEST_CASE("nn.gradcheck: Embedding, GELU(tanh), CausalSelfAttention, GptBlock") {
  auto emb = materialized(make_shared<nn::Embedding>(7, 5));
  nn::GradcheckOptions no_input;
  no_input.check_input = nn::CheckInput::no;
  check_grads(*emb, token_ids({2, 3}, 7, 3), no_input);

  auto gelu = materialized(make_shared<nn::GELU>(nn::GeluApproximation::tanh));
  check_grads(*gelu, uniform({3, 8}, 4, -3.f, 3.f));

  auto attn = materialized(make_shared<nn::CausalSelfAttention>(8, 2));
  check_grads(*attn, uniform({2, 5, 8}, 7));

  auto block = materialized(make_shared<nn::GptBlock>(8, 2, 0.f));
  check_grads(*block, uniform({2, 4, 8}, 8));
}

TEST_CASE("nn.gpt: a block run with its sums deferred gives forward's bits, then backward's") {
  // GptBlock::forward_deferred(skip, delta) (Gpt's path: the previous block's last sum fused
  // with ln_1, this block's left to the caller) against forward(skip + delta), on two blocks
  // with the same weights, in f32 and with bf16 activations.
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto deferred = materialized(make_shared<nn::GptBlock>(8, 2, 0.f), 5);
    auto plain = materialized(make_shared<nn::GptBlock>(8, 2, 0.f), 5);
    for (auto* b : {deferred.get(), plain.get()})
      if (bf16) {
        b->set_compute_dtype(DType::bf16);
        b->set_activations(nn::Activations::compute);
      }
    const DType dt = bf16 ? DType::bf16 : DType::f32;
    Tensor skip = kernels::cast(uniform({2, 4, 8}, 31), dt);
    Tensor delta = kernels::cast(uniform({2, 4, 8}, 32), dt);
    Tensor x = Tensor::empty(skip.shape(), dt, skip.device());
    kernels::add(x, skip, delta);
    Tensor mlp_out;
    Tensor h = deferred->forward_deferred(skip, delta, mlp_out);
    Tensor y = Tensor::empty(h.shape(), dt, h.device());
    kernels::add(y, h, mlp_out);
    CHECK(host(y) == host(plain->forward(x)));
    Tensor dy = kernels::cast(uniform({2, 4, 8}, 33), dt);
    CHECK(host(deferred->backward(dy)) == host(plain->backward(dy)));
    CHECK(host(deferred->flat_grads()) == host(plain->flat_grads()));
  }
}

TEST_CASE("nn.gpt: the MLP's fused fc + GELU and proj backward give the layers' bits") {
  // GptMlp runs c_fc with the GELU as one op each way (Linear::forward_gelu,
  // backward_through_gelu, backward_bias_given); on the CPU that must be the layers in turn:
  // the same output, input gradient and parameter gradients, bit for bit, in f32 and under bf16
  // activations, and every parameter reported ready once, after its gradient is final.
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    auto mlp = materialized(make_shared<nn::GptMlp>(8, 0.f), 7);
    auto chain = materialized(
        make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
            make_shared<nn::Linear>(8, 32), make_shared<nn::GELU>(nn::GeluApproximation::tanh),
            make_shared<nn::Linear>(32, 8)}),
        7);
    kernels::copy(chain->flat_params(), mlp->flat_params());  // the same layout: same weights
    for (nn::Module* m :
         {static_cast<nn::Module*>(mlp.get()), static_cast<nn::Module*>(chain.get())})
      if (bf16) {
        m->set_compute_dtype(DType::bf16);
        m->set_activations(nn::Activations::compute);
      }
    std::vector<int64_t> ready;
    mlp->flat().on_grad_ready = [&](const nn::Parameter& p) {
      ready.push_back(p.offset);
      // Final when reported: c_fc's bias gradient came with c_proj's backward already.
      Tensor g = p.grad.clone();
      CHECK(host(g) == host(chain->flat_grads().view(p.offset, p.shape)));
    };
    const DType dt = bf16 ? DType::bf16 : DType::f32;
    Tensor x = kernels::cast(uniform({2, 5, 8}, 41, -2.f, 2.f), dt);
    CHECK(host(mlp->forward(x)) == host(chain->forward(x)));
    Tensor dy = kernels::cast(uniform({2, 5, 8}, 42), dt);
    Tensor dx_chain = chain->backward(dy);  // first: the hook compares against its gradients
    CHECK(host(mlp->backward(dy)) == host(dx_chain));
    CHECK(host(mlp->flat_grads()) == host(chain->flat_grads()));
    CHECK(ready.size() == 4);
  }
}

TEST_CASE("nn.profile: a GPT's blocks count as h's time, not the model's own") {
  // Gpt runs its blocks through forward_deferred, as h's forward (forward_by_parts): the profile
  // gives h its blocks' time and leaves the model only its own (embedding sum, LM head).
  auto net = materialized(nn::gpt(micro_config()), 3);
  Tensor ids = token_ids({2, 6}, 11, 9);
  std::vector<nn::LayerProfiler::Row> rows;
  {
    nn::LayerProfiler prof(*net);
    for (int s = 0; s < 2; ++s) {
      Tensor logits = net->forward(ids);
      net->backward(uniform(logits.shape(), 40 + s));
    }
    rows = prof.rows();
  }
  const nn::LayerProfiler::Row* h = nullptr;
  double blocks_fwd = 0, blocks_bwd = 0, children_fwd = 0;
  for (const auto& r : rows) {
    CAPTURE(r.path);
    CHECK(r.self_forward_ms >= 0);
    CHECK(r.self_backward_ms >= 0);
    if (r.path == "h") h = &r;
    if (r.path == "h.0" || r.path == "h.1") blocks_fwd += r.forward_ms, blocks_bwd += r.backward_ms;
    if (r.path == "wte" || r.path == "drop" || r.path == "h" || r.path == "ln_f")
      children_fwd += r.forward_ms;
  }
  REQUIRE(h != nullptr);
  CHECK(h->forwards == 2);  // forward_by_parts
  CHECK(h->backwards == 2);
  CHECK(h->forward_ms >= blocks_fwd);
  CHECK(h->self_forward_ms >= 0);
  CHECK(h->backward_ms >= blocks_bwd);
  CHECK(rows[0].self_forward_ms == doctest::Approx(rows[0].forward_ms - children_fwd));
  CHECK(rows[0].self_forward_ms < rows[0].forward_ms - blocks_fwd + 1e-9);
}

// A holder whose parent runs its children both ways without forward_by_parts (the path Gpt's h
// took before it): the holder takes its children's time as its own, with none of its own.
TEST_CASE("nn.profile: a container its parent bypasses both ways takes its children's time") {
  class Bypass : public nn::Module {
   public:
    Bypass() {
      holder_ = register_module("holder", std::make_shared<nn::Sequential>());
      holder_->add(std::make_shared<nn::Linear>(4, 4));
      holder_->add(std::make_shared<nn::Linear>(4, 4));
    }
    std::string type_name() const override { return "Bypass"; }

   protected:
    Tensor forward_impl(const Tensor& x) override {
      return (*holder_)[1]->forward((*holder_)[0]->forward(x));
    }
    Tensor backward_impl(const Tensor& dy) override {
      return (*holder_)[0]->backward((*holder_)[1]->backward(dy));
    }
    std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Bypass>(); }

   private:
    std::shared_ptr<nn::Sequential> holder_;
  };
  auto net = materialized(std::make_shared<Bypass>(), 5);
  std::vector<nn::LayerProfiler::Row> rows;
  {
    nn::LayerProfiler prof(*net);
    for (int s = 0; s < 2; ++s) {
      net->forward(uniform({3, 4}, 60 + s));
      net->backward(uniform({3, 4}, 70 + s));
    }
    rows = prof.rows();
  }
  REQUIRE(rows.size() == 4);
  REQUIRE(rows[1].path == "holder");
  CHECK(rows[1].forwards == 0);
  CHECK(rows[1].backwards == 0);
  CHECK(rows[1].forward_ms > 0);
  CHECK(rows[1].forward_ms == doctest::Approx(rows[2].forward_ms + rows[3].forward_ms));
  CHECK(rows[1].backward_ms == doctest::Approx(rows[2].backward_ms + rows[3].backward_ms));
  CHECK(rows[1].self_forward_ms == 0);
  CHECK(rows[1].self_backward_ms == 0);
}

TEST_CASE("nn.gradcheck: GPT with a tied head") {
  auto net = materialized(nn::gpt(micro_config()), 3);
  nn::GradcheckOptions o;
  o.check_input = nn::CheckInput::no;
  check_grads(*net, token_ids({2, 6}, 11, 9), o);
}

TEST_CASE("nn.gpt: GELU(tanh) is GPT-2's formula") {
  Tensor x = Tensor::from_vector({-2.f, -0.5f, 0.f, 1.f, 3.f}, {5});
  Tensor y = Tensor::empty({5}, DType::f32, Device::cpu());
  kernels::gelu_tanh(y, x);
  std::vector<float> xh = host(x), yh = host(y);
  for (size_t i = 0; i < xh.size(); ++i) {
    double v = xh[i];
    double want = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    CHECK(yh[i] == doctest::Approx(want).epsilon(1e-6));
  }
}

TEST_CASE("nn.loss: token cross-entropy averages over the kept tokens") {
  const int64_t b = 2, t = 3, v = 5;
  Tensor logits = uniform({b, t, v}, 11, -2.f, 2.f);
  Tensor targets = Tensor::from_ints({1, -1, 4, 0, 2, -1}, {b, t});
  nn::TokenCrossEntropyLoss loss_fn(-1);
  CHECK(loss_fn.denominator(targets) == 4);
  Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu());
  Tensor dl = Tensor::empty(logits.shape(), DType::f32, Device::cpu());
  loss_fn.compute(loss, dl, logits, targets);
  std::vector<float> x = host(logits), g = host(dl);
  const std::vector<int> tg = {1, -1, 4, 0, 2, -1};
  double want = 0;
  for (int64_t r = 0; r < b * t; ++r) {
    double m = -1e300, z = 0;
    for (int64_t c = 0; c < v; ++c) m = std::max(m, double(x[r * v + c]));
    for (int64_t c = 0; c < v; ++c) z += std::exp(x[r * v + c] - m);
    for (int64_t c = 0; c < v; ++c) {
      double want_g = tg[r] < 0 ? 0.0 : (std::exp(x[r * v + c] - m) / z - (c == tg[r] ? 1 : 0)) / 4;
      CHECK(g[r * v + c] == doctest::Approx(want_g).epsilon(1e-5));
    }
    if (tg[r] >= 0) want += (m + std::log(z) - x[r * v + tg[r]]) / 4;
  }
  CHECK(loss.item() == doctest::Approx(want).epsilon(1e-6));
  // Every token ignored: loss 0, gradient 0, denominator 0.
  Tensor none = Tensor::from_ints({-1, -1, -1, -1, -1, -1}, {b, t});
  CHECK(loss_fn.denominator(none) == 0);
  loss_fn.compute(loss, dl, logits, none);
  CHECK(loss.item() == 0.f);
  for (float e : host(dl)) CHECK(e == 0.f);
  // A target outside [0, V) that is not the ignore index is named.
  Tensor bad = Tensor::from_ints({1, 7, 4, 0, 2, -1}, {b, t});
  CHECK_THROWS_WITH_AS(loss_fn.compute(loss, dl, logits, bad), doctest::Contains("label 7"),
                       kernels::Error);
}

TEST_CASE("nn.gpt: presets, parameter count, tied head and GPT-2 init") {
  CHECK_THROWS_WITH_AS(nn::GptConfig::preset("2b"), doctest::Contains("tiny, 124m or 350m"),
                       kernels::Error);
  nn::GptConfig big = nn::GptConfig::preset("124m");
  CHECK(big.layers == 12);
  CHECK(big.dim == 768);
  CHECK(big.vocab == 50304);
  CHECK(nn::gpt(big)->num_parameters() == big.parameters());  // declared, not allocated
  CHECK(big.parameters() > 124000000);
  CHECK(big.parameters() < 125000000);
  CHECK(nn::gpt(nn::GptConfig::preset("350m"))->num_parameters() > 350000000);

  nn::GptConfig tiny = nn::GptConfig::preset("tiny");
  auto net = materialized(nn::gpt(tiny), 1);
  CHECK(net->num_parameters() == tiny.parameters());
  CHECK(tiny.parameters() > 500000);
  CHECK(tiny.parameters() < 1500000);
  // Init: std 0.02 for embeddings and weights, 0.02 / sqrt(2 L) for the residual projections.
  auto std_of = [&](const std::string& name) {
    for (auto& [n, p] : net->named_parameters())
      if (n == name) {
        std::vector<float> v = host(p->value);
        double s = 0;
        for (float e : v) s += double(e) * e;
        return std::sqrt(s / v.size());
      }
    FAIL("no parameter " << name);
    return 0.0;
  };
  CHECK(std_of("wte.weight") == doctest::Approx(0.02).epsilon(0.05));
  CHECK(std_of("h.0.attn.c_attn.weight") == doctest::Approx(0.02).epsilon(0.05));
  CHECK(std_of("h.1.mlp.c_proj.weight") ==
        doctest::Approx(0.02 / std::sqrt(2.0 * tiny.layers)).epsilon(0.05));
  CHECK(std_of("h.0.attn.c_attn.bias") == 0.0);
  // The head is tied: no separate lm_head parameter, logits (B, T, V).
  for (auto& [n, p] : net->named_parameters()) CHECK(n.find("lm_head") == std::string::npos);
  Tensor logits = net->forward(token_ids({2, 5}, tiny.vocab, 4));
  CHECK(logits.shape() == Shape{2, 5, tiny.vocab});
  CHECK_THROWS_WITH_AS(net->forward(token_ids({1, tiny.context + 1}, tiny.vocab, 4)),
                       doctest::Contains("T <= context"), kernels::Error);
}

// 16-bit activations through the whole GPT: the residual stream starts in bf16 at the embedding
// sum, and the LayerNorms, residual adds, GEMMs and GELU read and write it as it is. A step then
// converts the weights once (amp/cast_weights) and the loss's f32 gradient once for the tied
// head; nothing per layer (attention reads and writes bf16 too, on the CPU by widening each head
// in its task). Twenty AdamW steps follow the
// f32-activation run (same bf16 GEMMs) within the stream's roundings: each of the 2 L + 2
// roundings of the stream and of a LayerNorm output moves a value by at most 2^-8 of itself,
// so the loss may move by about (2 L + 2) 2^-8 of itself (6% for L = 2, asserted at 3%).
TEST_CASE("nn.gpt: bf16 activations keep the residual stream bf16 and follow f32 activations") {
  nn::GptConfig c = micro_config();
  c.dropout = 0.f;
  const int64_t b = 3, t = 8;
  Tensor ids = token_ids({b, t}, c.vocab, 41), targets = token_ids({b, t}, c.vocab, 42);
  auto run = [&](nn::Activations a, nn::Output o, std::vector<int64_t>* casts) {
    auto net = materialized(nn::gpt(c), 5);
    net->set_compute_dtype(DType::bf16);
    net->set_activations(a);
    net->set_output(o);
    nn::AdamW opt(*net, kernels::AdamWConfig{3e-3f});
    nn::TokenCrossEntropyLoss loss_fn;
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu());
    std::vector<float> losses;
    kernels::DeviceContext& ctx = kernels::context(Device::cpu());
    for (int step = 0; step < 20; ++step) {
      const int64_t before = ctx.casts();
      net->zero_grad();
      Tensor logits = net->forward(ids);
      // The engines' rule: the loss gradient in the output's dtype.
      Tensor dl = Tensor::empty(logits.shape(), logits.dtype(), Device::cpu());
      loss_fn.compute(loss, dl, logits, targets);
      net->backward(dl);
      if (casts) casts->push_back(ctx.casts() - before);
      opt.step();
      losses.push_back(loss.item());
    }
    return losses;
  };
  std::vector<int64_t> casts, casts_bf16_logits;
  const std::vector<float> l16 = run(nn::Activations::compute, nn::Output::f32, &casts);
  const std::vector<float> l32 = run(nn::Activations::f32, nn::Output::f32, nullptr);
  // bf16 logits handed to the loss (nn::output_for under bf16): no f32 copy of the logits and
  // no cast of their gradient for the tied head. The weights' bf16 copy is cast by the first
  // forward alone: from then on AdamW's step writes it (Optimizer::writes_compute_copy).
  const std::vector<float> l16_out =
      run(nn::Activations::compute, nn::Output::activations, &casts_bf16_logits);
  for (size_t k = 0; k < casts.size(); ++k) CHECK(casts[k] == (k == 0 ? 2 : 1));
  for (size_t k = 0; k < casts.size(); ++k) CHECK(casts_bf16_logits[k] == (k == 0 ? 1 : 0));
  bool differ = false, differ_out = false;
  for (size_t i = 0; i < l16.size(); ++i) {
    CAPTURE(i);
    CHECK(std::isfinite(l16[i]));
    CHECK(std::fabs(l16[i] - l32[i]) <= 0.03f * l32[i]);
    CHECK(std::fabs(l16_out[i] - l32[i]) <= 0.03f * l32[i]);
    differ = differ || l16[i] != l32[i];
    differ_out = differ_out || l16_out[i] != l16[i];
  }
  CHECK(differ);                           // the stream really was rounded
  CHECK(differ_out);                       // and so were the logits and their gradient
  CHECK(l16.back() < 0.9f * l16.front());  // and it trains
  CHECK(l16_out.back() < 0.9f * l16_out.front());
}

TEST_CASE("nn.gpt: the chunked classifier gives the whole logits' loss, count and gradients") {
  // GptConfig::loss_chunk: the forward handed the loss (nn::LossInForward) runs the head, the
  // token loss and the head's backward GEMMs 10 tokens at a time (48 tokens: 4 chunks of 10 and
  // one of 8), with ignored targets; against the plain forward, loss and backward in f32. Each
  // row's loss gradient has the same bits; the sums (the loss, d wte) add in another order.
  nn::GptConfig c;
  c.vocab = 64, c.context = 16, c.layers = 2, c.heads = 2, c.dim = 32;
  nn::GptConfig chunked = c;
  c.loss_chunk = 0;
  chunked.loss_chunk = 10;
  auto whole = materialized(std::make_shared<nn::Gpt>(c), 5);
  auto parts = materialized(std::make_shared<nn::Gpt>(chunked), 5);
  auto [x, y] = gpt_tokens(1, 3, 16);
  std::vector<int32_t> tg = y.to_host_i32();
  for (size_t i = 0; i < tg.size(); i += 7) tg[i] = -1;
  y = Tensor::from_ints(tg, {3, 16});
  nn::TokenCrossEntropyLoss loss_fn;
  const nn::CrossEntropyLoss rows_loss;
  CHECK_FALSE(whole->takes_loss(loss_fn, y));  // loss_chunk 0
  CHECK(parts->takes_loss(loss_fn, y));
  CHECK_FALSE(parts->takes_loss(loss_fn, Tensor::from_ints(std::vector<int32_t>(8, 1), {1, 8})));
  CHECK_FALSE(parts->takes_loss(rows_loss, y));

  const Device cpu = Device::cpu();
  Tensor loss = Tensor::zeros({1}, DType::f32, cpu), right = Tensor::zeros({1}, DType::f32, cpu);
  Tensor out = whole->forward(x);
  Tensor dl = Tensor::empty(out.shape(), DType::f32, cpu);
  loss_fn.compute_and_count(loss, dl, right, out, y);
  whole->backward(dl);

  // Training, the gradient times 4 (a loss scale: a power of two, exact).
  nn::LossInForward r;
  r.loss = &loss_fn;
  r.labels = y;
  r.loss_out = Tensor::zeros({1}, DType::f32, cpu);
  r.correct = Tensor::zeros({1}, DType::f32, cpu);
  r.grad_scale = kernels::Scalar(4.f);
  r.grad = true;
  parts->set_loss_in_forward(&r);
  CHECK_FALSE(parts->forward(x).defined());
  parts->set_loss_in_forward(nullptr);
  CHECK(r.taken);
  // Its backward takes no gradient (the loss's went into the head in the forward).
  CHECK_THROWS_WITH_AS(parts->backward(dl), doctest::Contains("give an undefined gradient"),
                       kernels::Error);
  parts->zero_grad();  // the refused step's forward added its head's part already
  parts->set_loss_in_forward(&r);
  parts->forward(x);
  parts->set_loss_in_forward(nullptr);
  parts->backward(Tensor());
  CHECK(r.loss_out.item() == doctest::Approx(loss.item()).epsilon(1e-6));
  CHECK(r.correct.item() == right.item());
  std::vector<float> want = packed_grads(*whole), got = packed_grads(*parts);
  REQUIRE(want.size() == got.size());
  double worst = 0, top = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - 4.0 * want[i]));
    top = std::max(top, std::abs(4.0 * want[i]));
  }
  CHECK(worst <= 1e-5 * top);

  // Eval: the loss and count alone, no gradient touched.
  parts->zero_grad();
  parts->eval();
  nn::LossInForward e = r;
  e.grad = false;
  e.taken = false;
  e.loss_out = Tensor::zeros({1}, DType::f32, cpu);
  parts->set_loss_in_forward(&e);
  CHECK_FALSE(parts->forward(x).defined());
  parts->set_loss_in_forward(nullptr);
  CHECK(e.loss_out.item() == doctest::Approx(loss.item()).epsilon(1e-6));
  for (float g : host(parts->flat_grads())) REQUIRE(g == 0.f);

  // A loss other than the token cross-entropy handed over anyway is refused by name.
  nn::LossInForward bad = r;
  bad.loss = &rows_loss;
  parts->set_loss_in_forward(&bad);
  CHECK_THROWS_WITH_AS(parts->forward(x),
                       doctest::Contains("takes token_cross_entropy over one label per row"),
                       kernels::Error);
  parts->set_loss_in_forward(nullptr);
  CHECK_THROWS_WITH_AS(std::make_shared<nn::Gpt>([] {
                         nn::GptConfig n;
                         n.loss_chunk = -1;
                         return n;
                       }()),
                       doctest::Contains("loss_chunk -1"), kernels::Error);
}
