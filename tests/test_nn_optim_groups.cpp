// Gradient clipping by global norm and AdamW parameter groups (nn/clip.hpp, nn/param_groups.hpp).
#include <cmath>
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
