// The optimizers' per-step scalars (lr, grad unscale, first step, bias corrections, per-group
// decay and step size) live in device memory: prepare_step() writes them, apply_step() queues the
// fused update that reads them when it runs. Checked against a plain host loop with the
// documented formulas, bit for bit, and by changing the host values between the two halves.
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "nn/amp.hpp"
#include "nn/param_groups.hpp"
#include "tests/nn_test_util.hpp"

using namespace nn_test;

namespace {

constexpr int kSteps = 4;

std::shared_ptr<nn::Sequential> small_mlp() {
  return materialized(nn::mlp({7, 5, 3}), 11);
}

// The gradient of step t (packed), and the learning rate and unscale the loop gives it: both
// change every step, as a schedule and a loss scaler change them.
std::vector<float> grads_of(nn::Module& m, int t) {
  return dp_test::random_vector(packed_values(m).size(), 300 + static_cast<uint32_t>(t), -2.f, 2.f);
}
float lr_of(int t) {
  return 0.05f / static_cast<float>(t);
}
float unscale_of(int t) {
  return 1.f / static_cast<float>(3 + t);
}

// Steps `opt` kSteps times with grads_of(t), lr_of(t), unscale_of(t), through `step`.
template <class Step>
void run(nn::Module& m, nn::Optimizer& opt, Step step) {
  for (int t = 1; t <= kSteps; ++t) {
    set_packed(m, Which::grads, grads_of(m, t));
    opt.set_lr(lr_of(t));
    opt.set_grad_unscale(unscale_of(t));
    step(opt);
  }
}

void plain_step(nn::Optimizer& opt) {
  opt.step();
}
void split_step(nn::Optimizer& opt) {
  opt.prepare_step();
  opt.apply_step();
}

// kernels::sgd_update's formulas in the kernels' float order, for kSteps steps.
std::vector<float> sgd_reference(nn::Module& m, const kernels::SgdConfig& c) {
  std::vector<float> p = packed_values(m), buf(p.size(), 0.f);
  const float keep = 1.f - c.dampening;
  for (int t = 1; t <= kSteps; ++t) {
    const std::vector<float> g = grads_of(m, t);
    const float lr = lr_of(t), unscale = unscale_of(t);
    for (size_t i = 0; i < p.size(); ++i) {
      const float gi = g[i] * unscale;
      float d = c.weight_decay != 0.f ? gi + c.weight_decay * p[i] : gi;
      if (c.momentum != 0.f) {
        buf[i] = t == 1 ? d : c.momentum * buf[i] + keep * d;
        d = c.nesterov == kernels::Nesterov::yes ? d + c.momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
  return p;
}

// kernels::adamw_update(_grouped)'s formulas: scalars in double, rounded to float once; the
// element update in float. group[i] is element i's group in `groups`.
std::vector<float> adamw_reference(nn::Module& m, const kernels::AdamWConfig& c,
                                   const std::vector<nn::ParamGroup>& groups,
                                   const std::vector<int>& group) {
  std::vector<float> p = packed_values(m), mo(p.size(), 0.f), v(p.size(), 0.f);
  for (int t = 1; t <= kSteps; ++t) {
    const std::vector<float> g = grads_of(m, t);
    const double td = t;
    const float unscale = unscale_of(t);
    const float c2 = static_cast<float>(std::sqrt(1.0 - std::pow(double{c.beta2}, td)));
    for (size_t i = 0; i < p.size(); ++i) {
      const nn::ParamGroup& k = groups[static_cast<size_t>(group[i])];
      const double lr = static_cast<double>(lr_of(t)) * k.lr_scale;
      const auto decay = static_cast<float>(1.0 - lr * k.weight_decay);
      const auto step_size = static_cast<float>(lr / (1.0 - std::pow(double{c.beta1}, td)));
      p[i] *= decay;
      const float gi = g[i] * unscale;
      mo[i] = c.beta1 * mo[i] + (1.f - c.beta1) * gi;
      v[i] = c.beta2 * v[i] + (1.f - c.beta2) * gi * gi;
      const float denom = std::sqrt(v[i]) / c2 + c.eps;
      p[i] -= step_size * mo[i] / denom;
    }
  }
  return p;
}

// Element i's group (packed order) under a ParamGroups assignment.
std::vector<int> packed_groups(nn::Module& m, const nn::ParamGroups& g) {
  std::vector<int> out;
  auto params = m.named_parameters();
  for (size_t i = 0; i < params.size(); ++i)
    out.insert(out.end(), static_cast<size_t>(params[i].second->numel()), g.group_of_param[i]);
  return out;
}

std::vector<kernels::SgdConfig> sgd_configs() {
  kernels::SgdConfig plain;
  plain.weight_decay = 1e-2f;
  kernels::SgdConfig damped;
  damped.momentum = 0.9f;
  damped.dampening = 0.3f;
  kernels::SgdConfig nesterov;
  nesterov.momentum = 0.8f;
  nesterov.weight_decay = 5e-3f;
  nesterov.nesterov = kernels::Nesterov::yes;
  return {plain, damped, nesterov};
}

kernels::AdamWConfig adamw_config() {
  kernels::AdamWConfig c;
  c.beta1 = 0.8f;
  c.beta2 = 0.95f;
  c.weight_decay = 0.1f;
  return c;
}

}  // namespace

TEST_CASE("nn.optim_scalars: SGD's steps equal the host formulas bit for bit") {
  for (const kernels::SgdConfig& c : sgd_configs()) {
    CAPTURE(c.momentum);
    auto want_of = small_mlp();
    const std::vector<float> want = sgd_reference(*want_of, c);
    for (auto step : {plain_step, split_step}) {
      auto m = small_mlp();
      nn::SGD opt(*m, c);
      run(*m, opt, step);
      CHECK(packed_values(*m) == want);
      CHECK(opt.step_count() == kSteps);
    }
  }
}

TEST_CASE("nn.optim_scalars: AdamW's steps equal the host formulas bit for bit") {
  const kernels::AdamWConfig c = adamw_config();
  auto want_of = small_mlp();
  const std::vector<float> want = adamw_reference(*want_of, c, {{"all", 1.f, c.weight_decay}},
                                                  std::vector<int>(packed_values(*want_of).size()));
  for (auto step : {plain_step, split_step}) {
    auto m = small_mlp();
    nn::AdamW opt(*m, c);
    run(*m, opt, step);
    CHECK(packed_values(*m) == want);
  }
}

TEST_CASE("nn.optim_scalars: GroupedAdamW's steps equal the host formulas bit for bit") {
  const kernels::AdamWConfig c = adamw_config();
  auto want_of = small_mlp();
  nn::ParamGroups groups = nn::decay_matrices_only(*want_of, 0.2f);
  groups.groups[1].lr_scale = 0.5f;
  const std::vector<float> want =
      adamw_reference(*want_of, c, groups.groups, packed_groups(*want_of, groups));
  for (auto step : {plain_step, split_step}) {
    auto m = small_mlp();
    nn::GroupedAdamW opt(*m, c, groups);
    run(*m, opt, step);
    CHECK(packed_values(*m) == want);
  }
}

namespace {

// The optimizers under test, each over its own fresh model.
struct Case {
  const char* name;
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<nn::Optimizer> opt;
};
std::vector<Case> every_optimizer() {
  std::vector<Case> cases;
  auto add = [&](const char* name, auto make) {
    auto m = small_mlp();
    auto opt = make(*m);
    cases.push_back({name, m, std::move(opt)});
  };
  add("SGD", [](nn::Module& m) { return std::make_unique<nn::SGD>(m, sgd_configs()[2]); });
  add("AdamW", [](nn::Module& m) { return std::make_unique<nn::AdamW>(m, adamw_config()); });
  add("GroupedAdamW", [](nn::Module& m) {
    return std::make_unique<nn::GroupedAdamW>(m, adamw_config(), nn::decay_matrices_only(m, 0.2f));
  });
  return cases;
}

}  // namespace

// apply_step takes no host value: what prepare_step wrote is what it uses. Scalars for lr = 0
// leave the weights as they are even after the host lr changes; the next prepare_step (lr back)
// moves them. The scalars tensor is the same allocation throughout.
TEST_CASE("nn.optim_scalars: apply_step reads the scalars prepare_step wrote, not host values") {
  for (Case& c : every_optimizer()) {
    CAPTURE(c.name);
    nn::Module& m = *c.model;
    nn::Optimizer& opt = *c.opt;
    const float* scalars = opt.step_scalars().data<float>();
    const std::vector<float> before = packed_values(m);
    set_packed(m, Which::grads, grads_of(m, 1));
    opt.set_lr(0.f);
    opt.prepare_step();
    opt.set_lr(0.1f);           // after prepare_step: not seen by apply_step
    opt.set_grad_unscale(2.f);  // neither
    opt.apply_step();
    CHECK(packed_values(m) == before);
    opt.prepare_step();  // step 2 with lr 0.1
    opt.apply_step();
    CHECK(packed_values(m) != before);
    CHECK(opt.step_count() == 2);
    CHECK(opt.step_scalars().data<float>() == scalars);
    CHECK(opt.step_scalars().numel() == kernels::kMaxValues);
  }
}

TEST_CASE("nn.optim_scalars: a nonzero skip flag leaves every optimizer's weights unchanged") {
  for (Case& c : every_optimizer()) {
    CAPTURE(c.name);
    nn::Module& m = *c.model;
    const std::vector<float> before = packed_values(m);
    set_packed(m, Which::grads, grads_of(m, 1));
    Tensor flag = Tensor::from_vector({1.f}, {1});
    c.opt->set_skip_if(flag);
    c.opt->step();
    CHECK(packed_values(m) == before);
    flag.data<float>()[0] = 0.f;
    c.opt->step();
    CHECK(packed_values(m) != before);
  }
}

// GradScaler's deferred step in two halves equals step_deferred, bit for bit, and a non-finite
// gradient skips the applied half (settle() takes the step back).
TEST_CASE("nn.optim_scalars: GradScaler prepare_deferred + apply_deferred equal step_deferred") {
  auto whole = small_mlp(), split = small_mlp();
  nn::AdamW opt_whole(*whole, adamw_config()), opt_split(*split, adamw_config());
  nn::GradScaler scaler_whole(nn::Precision::fp16), scaler_split(nn::Precision::fp16);
  Tensor flag_whole = Tensor::zeros({1}, DType::f32, Device::cpu());
  Tensor flag_split = flag_whole.clone();
  for (int t = 1; t <= kSteps; ++t) {
    std::vector<float> g = grads_of(*whole, t);
    for (float& x : g) x *= scaler_whole.scale();
    if (t == 2) g[3] = std::numeric_limits<float>::infinity();
    set_packed(*whole, Which::grads, g);
    set_packed(*split, Which::grads, g);
    const std::vector<float> before = packed_values(*split);
    scaler_whole.step_deferred(opt_whole, whole->flat_grads(), flag_whole);
    scaler_split.prepare_deferred(opt_split);
    scaler_split.apply_deferred(opt_split, split->flat_grads(), flag_split);
    const bool finite = flag_split.data<float>()[0] == 0.f;
    CHECK(finite == (t != 2));
    CHECK(scaler_whole.settle(opt_whole, flag_whole.data<float>()[0] == 0.f) == finite);
    CHECK(scaler_split.settle(opt_split, finite) == finite);
    CHECK(packed_values(*split) == packed_values(*whole));
    CHECK((packed_values(*split) == before) == !finite);
  }
  CHECK(opt_split.step_count() == kSteps - 1);
  CHECK(scaler_split.scale() == scaler_whole.scale());
}
