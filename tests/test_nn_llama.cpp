// Llama's layers (nn/llama.hpp, nn::RMSNorm, rotary attention): the kernels against double loops
// from their definitions, rotary's relative-position property, gradient checks of every layer
// and of the model, its parameter count, and a few training steps in f32 and in bf16.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "tests/nn_test_util.hpp"

using namespace nn_test;
using std::make_shared;

namespace {

std::vector<double> as_double(const Tensor& t) {
  std::vector<float> f = t.to_host_f32();
  return std::vector<double>(f.begin(), f.end());
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

Tensor token_ids(const Shape& s, int64_t vocab, uint32_t seed) {
  std::vector<float> r = dp_test::random_vector(static_cast<size_t>(numel(s)), seed, 0.f, 1.f);
  std::vector<int32_t> ids(r.size());
  for (size_t i = 0; i < r.size(); ++i)
    ids[i] = std::min(static_cast<int32_t>(r[i] * static_cast<float>(vocab)),
                      static_cast<int32_t>(vocab - 1));
  return Tensor::from_ints(ids, s);
}

nn::LlamaConfig micro() {
  nn::LlamaConfig c;
  c.vocab = 11, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 8, c.hidden = 12;
  return c;
}

}  // namespace

TEST_CASE("kernels.llama: rms_norm forward and backward match a double loop") {
  const int64_t m = 5, d = 7;
  Tensor x = uniform({m, d}, 1, -2.f, 2.f), gamma = uniform({d}, 2, 0.5f, 1.5f);
  Tensor dy = uniform({m, d}, 3), dgamma = uniform({d}, 4);
  const std::vector<double> xd = as_double(x), gd = as_double(gamma), dyd = as_double(dy);
  const std::vector<double> dg0 = as_double(dgamma);
  Tensor y = Tensor::empty({m, d}, DType::f32, Device::cpu());
  Tensor rstd = Tensor::empty({m}, DType::f32, Device::cpu());
  Tensor dx = Tensor::empty({m, d}, DType::f32, Device::cpu());
  const float eps = 1e-5f;
  kernels::rms_norm_forward(y, rstd, x, gamma, eps);
  kernels::rms_norm_backward(dx, dgamma, dy, x, gamma, rstd, kernels::Accumulate::yes);
  std::vector<double> y_ref(xd.size()), dx_ref(xd.size()), dg_ref = dg0, r_ref(m);
  for (int64_t i = 0; i < m; ++i) {
    double sq = 0.0;
    for (int64_t j = 0; j < d; ++j) sq += xd[i * d + j] * xd[i * d + j];
    const double r = 1.0 / std::sqrt(sq / d + eps);
    r_ref[i] = r;
    // d/dx_k of sum_j dy_j gamma_j x_j r: dy_k gamma_k r + sum_j dy_j gamma_j x_j dr/dx_k,
    // dr/dx_k = -r^3 x_k / d.
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += dyd[i * d + j] * gd[j] * xd[i * d + j];
    for (int64_t k = 0; k < d; ++k) {
      y_ref[i * d + k] = xd[i * d + k] * r * gd[k];
      dx_ref[i * d + k] = dyd[i * d + k] * gd[k] * r - s * r * r * r * xd[i * d + k] / d;
      dg_ref[k] += dyd[i * d + k] * xd[i * d + k] * r;
    }
  }
  CHECK(max_abs_diff(y.to_host_f32(), y_ref) <= 1e-6);
  CHECK(max_abs_diff(rstd.to_host_f32(), r_ref) <= 1e-6);
  CHECK(max_abs_diff(dx.to_host_f32(), dx_ref) <= 1e-6);
  CHECK(max_abs_diff(dgamma.to_host_f32(), dg_ref) <= 1e-6);
}

TEST_CASE("kernels.llama: swiglu forward and backward match a double loop") {
  const int64_t m = 4, w = 9;
  Tensor h = uniform({m, 2 * w}, 5, -4.f, 4.f), dy = uniform({m, w}, 6);
  Tensor y = Tensor::empty({m, w}, DType::f32, Device::cpu());
  Tensor dh = Tensor::empty({m, 2 * w}, DType::f32, Device::cpu());
  kernels::swiglu_forward(y, h);
  kernels::swiglu_backward(dh, dy, h);
  const std::vector<double> hd = as_double(h), dyd = as_double(dy);
  std::vector<double> y_ref(m * w), dh_ref(m * 2 * w);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < w; ++j) {
      const double a = hd[i * 2 * w + j], b = hd[i * 2 * w + w + j], g = dyd[i * w + j];
      const double s = 1.0 / (1.0 + std::exp(-a));
      y_ref[i * w + j] = a * s * b;
      dh_ref[i * 2 * w + j] = g * b * (s + a * s * (1.0 - s));  // d(a s)/da
      dh_ref[i * 2 * w + w + j] = g * a * s;
    }
  CHECK(max_abs_diff(y.to_host_f32(), y_ref) <= 1e-5);
  CHECK(max_abs_diff(dh.to_host_f32(), dh_ref) <= 1e-5);
  Tensor bad = Tensor::empty({m, w + 1}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(kernels::swiglu_forward(y, bad), doctest::Contains("must be (M, 2 H)"),
                       kernels::Error);
}

TEST_CASE("kernels.llama: rotary turns each pair by its angle, inverse undoes it, v untouched") {
  const int64_t b = 2, t = 5, heads = 2, hd = 6, dim = heads * hd, half = hd / 2;
  Tensor qkv = uniform({b, t, 3 * dim}, 7);
  const std::vector<float> before = qkv.to_host_f32();
  std::vector<float> cos_v(static_cast<size_t>(8 * half)), sin_v(cos_v.size());
  for (int64_t p = 0; p < 8; ++p)
    for (int64_t j = 0; j < half; ++j) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * j / hd);
      cos_v[p * half + j] = static_cast<float>(std::cos(angle));
      sin_v[p * half + j] = static_cast<float>(std::sin(angle));
    }
  Tensor cos = Tensor::from_vector(cos_v, {8, half}), sin = Tensor::from_vector(sin_v, {8, half});
  kernels::rotary_embedding(qkv, cos, sin, hd, 2 * dim, kernels::Rotation::forward);
  const std::vector<float> after = qkv.to_host_f32();
  std::vector<double> ref(before.begin(), before.end());
  for (int64_t row = 0; row < b * t; ++row)
    for (int64_t h = 0; h < 2 * heads; ++h)  // q's heads, then k's
      for (int64_t j = 0; j < half; ++j) {
        const size_t i1 = static_cast<size_t>(row * 3 * dim + h * hd + j), i2 = i1 + half;
        const double c = cos_v[(row % t) * half + j], s = sin_v[(row % t) * half + j];
        ref[i1] = before[i1] * c - before[i2] * s;
        ref[i2] = before[i2] * c + before[i1] * s;
      }
  CHECK(max_abs_diff(after, ref) <= 1e-6);
  for (int64_t row = 0; row < b * t; ++row)  // v keeps its bits
    for (int64_t c = 2 * dim; c < 3 * dim; ++c)
      CHECK(after[row * 3 * dim + c] == before[row * 3 * dim + c]);
  kernels::rotary_embedding(qkv, cos, sin, hd, 2 * dim, kernels::Rotation::inverse);
  CHECK(max_abs_diff(qkv.to_host_f32(), as_double(Tensor::from_vector(before, {b, t, 3 * dim}))) <=
        1e-6);
  CHECK_THROWS_WITH_AS(kernels::rotary_embedding(qkv, cos, sin, 5, 10, kernels::Rotation::forward),
                       doctest::Contains("head_dim 5 and columns 10"), kernels::Error);
  Tensor short_cos = Tensor::zeros({4, half}, DType::f32, Device::cpu());
  Tensor short_sin = short_cos;
  CHECK_THROWS_WITH_AS(
      kernels::rotary_embedding(qkv, short_cos, short_sin, hd, 2 * dim, kernels::Rotation::forward),
      doctest::Contains("must be (T_max >= 5, 3)"), kernels::Error);
}

TEST_CASE("nn.llama: rotary attention scores depend on relative positions only") {
  // One head, the same q and k vector at every position: after the rotation, q_i . k_j is a
  // function of i - j alone (the rotation by i's angles, then back by j's, is a rotation by
  // i - j's).
  nn::AttentionOptions o;
  o.rotary_context = 16;
  auto attn = materialized(make_shared<nn::CausalSelfAttention>(8, 1, 0.f, o));
  auto constants = attn->named_constants();
  REQUIRE(constants.size() == 2);
  const int64_t t = 12, d = 8;
  std::vector<float> row = dp_test::random_vector(static_cast<size_t>(3 * d), 9);
  std::vector<float> v;
  for (int64_t i = 0; i < t; ++i) v.insert(v.end(), row.begin(), row.end());
  Tensor qkv = Tensor::from_vector(v, {1, t, 3 * d});
  kernels::rotary_embedding(qkv, constants[0].second->value, constants[1].second->value, d, 2 * d,
                            kernels::Rotation::forward);
  const std::vector<float> r = qkv.to_host_f32();
  auto score = [&](int64_t i, int64_t j) {
    double s = 0.0;
    for (int64_t c = 0; c < d; ++c) s += double{r[i * 3 * d + c]} * r[j * 3 * d + d + c];
    return s;
  };
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      CAPTURE(i);
      CAPTURE(j);
      CHECK(score(i, j) == doctest::Approx(score(i - j, 0)).epsilon(1e-5));
    }
}

TEST_CASE("nn.gradcheck: RMSNorm, SwiGLU, rotary attention without biases, LlamaBlock") {
  check_grads(*materialized(make_shared<nn::RMSNorm>(7)), uniform({3, 7}, 10, -2.f, 2.f));
  check_grads(*materialized(make_shared<nn::SwiGLU>(6, 5)), uniform({2, 3, 6}, 11));
  nn::AttentionOptions o;
  o.bias = nn::Bias::no;
  o.rotary_context = 8;
  auto attn = materialized(make_shared<nn::CausalSelfAttention>(8, 2, 0.f, o));
  CHECK(attn->c_attn().bias() == nullptr);
  check_grads(*attn, uniform({2, 5, 8}, 12));
  nn::LlamaConfig c = micro();
  check_grads(*materialized(make_shared<nn::LlamaBlock>(c)), uniform({2, 4, 8}, 13));
}

TEST_CASE("nn.gradcheck: the Llama model") {
  auto net = materialized(nn::llama(micro()), 3);
  nn::GradcheckOptions o;
  o.check_input = nn::CheckInput::no;
  check_grads(*net, token_ids({2, 6}, 11, 14), o);
}

TEST_CASE("nn.llama: presets, parameter count, decay groups, refusals") {
  for (const nn::LlamaConfig& c : {nn::LlamaConfig::preset("tiny"), micro()}) {
    auto net = materialized(nn::llama(c));
    CAPTURE(c.name);
    CHECK(net->num_parameters() == c.parameters());
    CHECK(net->named_buffers().empty());
    CHECK(net->named_constants().size() == static_cast<size_t>(2 * c.layers));  // cos, sin
    // No biases anywhere: every 1-D parameter is an RMSNorm gain, and none of them decays.
    const nn::ParamGroups g = nn::decay_by_parameter(*net, 0.1f);
    auto params = net->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      CAPTURE(params[i].first);
      const bool gain = params[i].first.find("norm.weight") != std::string::npos;
      CHECK(g.group_of_param[i] == (gain ? 1 : 0));
    }
  }
  CHECK(nn::LlamaConfig::preset("tiny").hidden == nn::LlamaConfig::swiglu_hidden(128, 32));
  CHECK_THROWS_WITH_AS(nn::LlamaConfig::preset("7b"), doctest::Contains("choose tiny"),
                       kernels::Error);
  nn::LlamaConfig odd = micro();
  odd.heads = 8;  // head width 1
  CHECK_THROWS_WITH_AS(nn::llama(odd), doctest::Contains("even head widths"), kernels::Error);
  auto net = materialized(nn::llama(micro()));
  CHECK_THROWS_WITH_AS(net->forward(token_ids({1, 9}, 11, 1)), doctest::Contains("T <= context 8"),
                       kernels::Error);
}

TEST_CASE("nn.llama: trains, and bf16 activations with bf16 logits follow f32") {
  nn::LlamaConfig c = micro();
  const int64_t b = 3, t = 8;
  Tensor ids = token_ids({b, t}, c.vocab, 41), targets = token_ids({b, t}, c.vocab, 42);
  auto run = [&](bool bf16, std::vector<int64_t>* casts) {
    auto net = materialized(nn::llama(c), 5);
    if (bf16) {
      net->set_compute_dtype(DType::bf16);
      net->set_activations(nn::Activations::compute);
      net->set_output(nn::Output::activations);
    }
    nn::AdamW opt(*net, kernels::AdamWConfig{3e-3f});
    nn::TokenCrossEntropyLoss loss_fn;
    Tensor loss = Tensor::empty({1}, DType::f32, Device::cpu());
    std::vector<float> losses;
    kernels::DeviceContext& ctx = kernels::context(Device::cpu());
    for (int step = 0; step < 20; ++step) {
      const int64_t before = ctx.casts();
      net->zero_grad();
      Tensor logits = net->forward(ids);
      CHECK(logits.dtype() == (bf16 ? DType::bf16 : DType::f32));
      Tensor dl = Tensor::empty(logits.shape(), logits.dtype(), Device::cpu());
      loss_fn.compute(loss, dl, logits, targets);
      net->backward(dl);
      if (casts) casts->push_back(ctx.casts() - before);
      opt.step();
      losses.push_back(loss.item());
    }
    return losses;
  };
  std::vector<int64_t> casts;
  const std::vector<float> l32 = run(false, nullptr), l16 = run(true, &casts);
  // The embedding's output into the bf16 stream, and at the first step the weights' bf16 copy
  // (AdamW's steps write it after): nothing per layer.
  for (size_t k = 0; k < casts.size(); ++k) CHECK(casts[k] == (k == 0 ? 2 : 1));
  for (size_t i = 0; i < l32.size(); ++i) {
    CAPTURE(i);
    CHECK(std::isfinite(l16[i]));
    CHECK(std::fabs(l16[i] - l32[i]) <= 0.03f * l32[i]);
  }
  CHECK(l32.back() < 0.9f * l32.front());
  CHECK(l16.back() < 0.9f * l16.front());
}

TEST_CASE(
    "nn.llama: the chunked classifier gives the whole logits' loss and gradients, hooks once") {
  // LlamaConfig::loss_chunk, 7 tokens a chunk (24 tokens: 7, 7, 7, 3), in f32 against the plain
  // forward, loss and backward. lm_head's backward never runs: the model fires its weight's
  // on_grad_ready itself, once, as every other parameter's.
  nn::LlamaConfig c = micro();
  nn::LlamaConfig chunked = c;
  c.loss_chunk = 0;
  chunked.loss_chunk = 7;
  auto whole = materialized(nn::llama(c), 5);
  auto parts = materialized(nn::llama(chunked), 5);
  const Tensor ids = token_ids({3, 8}, c.vocab, 41), targets = token_ids({3, 8}, c.vocab, 42);
  nn::TokenCrossEntropyLoss loss_fn;
  CHECK_FALSE(whole->takes_loss(loss_fn, targets));
  CHECK(parts->takes_loss(loss_fn, targets));
  const Device cpu = Device::cpu();
  Tensor loss = Tensor::zeros({1}, DType::f32, cpu);
  Tensor out = whole->forward(ids);
  Tensor dl = Tensor::empty(out.shape(), DType::f32, cpu);
  loss_fn.compute(loss, dl, out, targets);
  whole->backward(dl);

  std::map<const nn::Parameter*, int> fired;
  parts->flat().on_grad_ready = [&](const nn::Parameter& p) { ++fired[&p]; };
  nn::LossInForward r;
  r.loss = &loss_fn;
  r.labels = targets;
  r.loss_out = Tensor::zeros({1}, DType::f32, cpu);
  r.grad = true;
  parts->set_loss_in_forward(&r);
  CHECK_FALSE(parts->forward(ids).defined());
  parts->set_loss_in_forward(nullptr);
  parts->backward(Tensor());
  parts->flat().on_grad_ready = nullptr;
  CHECK(r.loss_out.item() == doctest::Approx(loss.item()).epsilon(1e-6));
  const std::vector<float> want = packed_grads(*whole), got = packed_grads(*parts);
  REQUIRE(want.size() == got.size());
  double worst = 0, top = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - want[i]));
    top = std::max(top, std::abs(double(want[i])));
  }
  CHECK(worst <= 1e-5 * top);
  const auto params = parts->named_parameters();
  CHECK(fired.size() == params.size());
  for (const auto& [name, p] : params) {
    CAPTURE(name);
    CHECK(fired[p] == 1);
  }
}
