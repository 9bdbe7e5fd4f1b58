// Gradient clipping by global norm and AdamW parameter groups (nn/clip.hpp, nn/param_groups.hpp).
#include <cmath>
#include <cstring>
#include <memory>

#include "nn/param_groups.hpp"
#include "tests/nn_test_util.hpp"

using namespace nn_test;
using std::make_shared;

TEST_CASE("nn.clip: the global norm is reported and clipped to max_norm") {
  Tensor g = Tensor::from_vector({3.f, 0.f, 4.f}, {3});
  CHECK(nn::clip_grad_norm(g, 10.f) == doctest::Approx(5.f));
  CHECK(host(g) == std::vector<float>{3.f, 0.f, 4.f});  // under the bound: untouched
  CHECK(nn::clip_grad_norm(g, 1.f) == doctest::Approx(5.f));
  std::vector<float> c = host(g);
  CHECK(c[0] == doctest::Approx(0.6f).epsilon(1e-5));
  CHECK(c[2] == doctest::Approx(0.8f).epsilon(1e-5));
  // A loss-scaled gradient: the norm is the unscaled one, the clip keeps the scale.
  Tensor s = Tensor::from_vector({300.f, 400.f}, {2});
  CHECK(nn::clip_grad_norm(s, 1.f, 1.f / 100.f) == doctest::Approx(5.f));
  CHECK(host(s)[1] == doctest::Approx(80.f).epsilon(1e-5));
  CHECK_THROWS_WITH_AS(nn::clip_grad_norm(s, 0.f), doctest::Contains("max_norm 0"), kernels::Error);
}

namespace {

// clip_grad_norm as it was before the norm stayed on the device: the sum of squares read to the
// host, the norm and the factor computed there, then one scale. The reference for the bits.
float host_clip_grad_norm(Tensor& grads, float max_norm, float unscale) {
  Tensor ss = Tensor::empty({1}, DType::f32, grads.device());
  kernels::sum_squares(ss, grads);
  const double norm = std::sqrt(static_cast<double>(ss.item())) * static_cast<double>(unscale);
  float factor = 1.f;  // PyTorch's: 0 for an infinite norm, and NaN here leaves it at 1
  if (!std::isnan(norm) && norm > static_cast<double>(max_norm))
    factor = static_cast<float>(static_cast<double>(max_norm) / (norm + 1e-6));
  if (factor != 1.f) kernels::scale(grads, grads, factor);
  return static_cast<float>(norm);
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  if (!v.empty()) std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

uint32_t bits(float f) {
  return bits(std::vector<float>{f})[0];
}

}  // namespace

TEST_CASE("nn.clip: clip_grad_norm_into gives the host formula's bits, with no host read") {
  const Tensor random = uniform({1000}, 31, -0.3f, 0.3f);
  const Tensor three_four = Tensor::from_vector({3.f, 0.f, 4.f}, {3});  // norm exactly 5
  std::vector<float> with_nan = host(random), with_inf = host(random);
  with_nan[17] = std::nanf("");
  with_inf[400] = -INFINITY;
  struct Case {
    const char* name;
    Tensor grads;
    float max_norm, unscale;
  };
  Tensor probe = random.clone();
  const float random_norm = host_clip_grad_norm(probe, 1e9f, 1.f);
  const std::vector<Case> cases = {
      {"above", random, 0.5f, 1.f},
      {"above, loss-scaled", random, 0.01f, 1.f / 128.f},
      {"below", random, 100.f, 1.f},
      {"exactly at", three_four, 5.f, 1.f},
      {"at the float of the norm", random, random_norm, 1.f},
      {"NaN", Tensor::from_vector(with_nan, {1000}), 0.5f, 1.f},
      {"infinity", Tensor::from_vector(with_inf, {1000}), 0.5f, 1.f},
      {"empty", Tensor::empty({0}, DType::f32, Device::cpu()), 0.5f, 1.f},
  };
  kernels::DeviceContext& ctx = kernels::context(Device::cpu());
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Tensor want = c.grads.clone(), got = c.grads.clone(), wrapped = c.grads.clone();
    const float want_norm = host_clip_grad_norm(want, c.max_norm, c.unscale);
    // The norm lands in a slot of a metrics buffer, as the engines use it.
    Tensor metrics = Tensor::zeros({3}, DType::f32, Device::cpu());
    Tensor slot = metrics.view(2, {1});
    const int64_t syncs = ctx.host_syncs();
    nn::clip_grad_norm_into(got, c.max_norm, c.unscale, slot);
    CHECK(ctx.host_syncs() == syncs);
    std::vector<float> m = host(metrics);
    CHECK(bits(m[2]) == bits(want_norm));
    CHECK(m[0] == 0.f);
    CHECK(m[1] == 0.f);
    CHECK(bits(host(got)) == bits(host(want)));
    // The wrapper: the same, and the norm read once.
    CHECK(bits(nn::clip_grad_norm(wrapped, c.max_norm, c.unscale)) == bits(want_norm));
    CHECK(bits(host(wrapped)) == bits(host(want)));
  }
  // The clip was active above the bound and not below it, at it, or for a NaN norm.
  Tensor g = random.clone();
  CHECK(nn::clip_grad_norm(g, 0.5f) > 0.5f);
  CHECK(host(g) != host(random));
  for (const Case& c : {cases[2], cases[3], cases[5]}) {
    CAPTURE(c.name);
    Tensor kept = c.grads.clone();
    nn::clip_grad_norm(kept, c.max_norm, c.unscale);
    CHECK(bits(host(kept)) == bits(host(c.grads)));
  }
  Tensor wrong = Tensor::zeros({2}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(nn::clip_grad_norm_into(g, 1.f, 1.f, wrong),
                       doctest::Contains("must have one element"), kernels::Error);
}

TEST_CASE("nn.optim: GroupedAdamW decays matrices only, one step per group's settings") {
  auto build = [] {
    auto m = nn::gpt([] {
      nn::GptConfig c;
      c.vocab = 9, c.context = 4, c.layers = 1, c.heads = 2, c.dim = 8;
      return c;
    }());
    m->materialize(Device::cpu(), 5);
    return m;
  };
  kernels::AdamWConfig cfg;
  cfg.lr = 0.05f;
  cfg.weight_decay = 0.5f;
  auto decayed = build(), plain = build(), grouped = build();
  nn::AdamW opt_decay(*decayed, cfg);
  kernels::AdamWConfig no_wd = cfg;
  no_wd.weight_decay = 0.f;
  nn::AdamW opt_plain(*plain, no_wd);
  nn::ParamGroups groups = nn::decay_matrices_only(*grouped, cfg.weight_decay);
  nn::GroupedAdamW opt_grouped(*grouped, cfg, groups);
  Tensor ids = Tensor::from_ints({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  // One step from the same weights and gradient: each group's elements move exactly as
  // AdamW with that group's weight decay moves them.
  for (auto* model : {&decayed, &plain, &grouped}) {
    (*model)->zero_grad();
    Tensor y = (*model)->forward(ids);
    (*model)->backward(uniform(y.shape(), 40));
  }
  opt_decay.step();
  opt_plain.step();
  opt_grouped.step();
  auto params = grouped->named_parameters();
  auto dp = decayed->named_parameters(), pp = plain->named_parameters();
  int matrices = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(params[i].first);
    const bool matrix = groups.group_of_param[i] == 0;
    matrices += matrix;
    const auto want = host((matrix ? dp : pp)[i].second->value);
    CHECK(host(params[i].second->value) == want);
    // Embeddings, LayerNorm and biases are not decayed.
    if (params[i].first == "wte.weight" || params[i].first == "wpe") CHECK(!matrix);
  }
  CHECK(matrices == 4);  // c_attn, attn c_proj, c_fc, mlp c_proj weights
  // A group with lr_scale 0 does not move.
  groups.groups[1].lr_scale = 0.f;
  auto frozen = build();
  nn::GroupedAdamW opt_frozen(*frozen, cfg, groups);
  std::vector<float> before = host(frozen->named_parameters()[0].second->value);  // wpe
  frozen->zero_grad();
  Tensor y = frozen->forward(ids);
  frozen->backward(uniform(y.shape(), 3));
  opt_frozen.step();
  CHECK(host(frozen->named_parameters()[0].second->value) == before);
}
