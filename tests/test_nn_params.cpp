// What a custom layer registers: parameters that say whether they decay (nn::Decay, used by
// nn::decay_by_parameter) and constant tables (Module::register_constant: made on each device,
// never averaged across replicas or saved).
#include <cstring>
#include <memory>

#include "dp/data_parallel.hpp"
#include "nn/nn.hpp"
#include "nn/param_groups.hpp"
#include "tests/train_util.hpp"

using namespace kernels;

namespace {

// y = x * c + b over (B, D): c a constant table (0.5, 1, 1.5, ...), b a parameter.
class ScaledShift : public nn::Module {
 public:
  explicit ScaledShift(int64_t d) : d_(d) {
    c_ = &register_constant("scale", {d}, [](const Shape& s) {
      std::vector<float> v(static_cast<size_t>(s[0]));
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * static_cast<float>(i + 1);
      return v;
    });
    b_ = &register_parameter("shift", {d}, nn::InitSpec::uniform(0.1f));
  }
  std::string type_name() const override { return "ScaledShift"; }
  const Tensor& scale() const { return c_->value; }
  static std::vector<float> made(int64_t d) {
    std::vector<float> v(static_cast<size_t>(d));
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * static_cast<float>(i + 1);
    return v;
  }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    Tensor y = Tensor::empty(x.shape(), DType::f32, x.device());
    kernels::mul(y, x, c_->value);  // c broadcast over the rows
    kernels::add_bias(y, b_->value);
    return y;
  }
  Tensor backward_impl(const Tensor& dy) override {
    kernels::bias_backward(b_->grad, dy, Accumulate::yes);
    Tensor dx = Tensor::empty(dy.shape(), DType::f32, dy.device());
    kernels::mul(dx, dy, c_->value);
    return dx;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<ScaledShift>(d_);
  }

 private:
  int64_t d_;
  nn::Constant* c_ = nullptr;
  nn::Parameter* b_ = nullptr;
};

nn::ModulePtr scaled_mlp() {
  auto s = std::make_shared<nn::Sequential>();
  s->add(std::make_shared<ScaledShift>(6));
  s->add(std::make_shared<nn::Linear>(6, 5));
  return s;
}

// A layer with one parameter of each decay rule.
class Mixed : public nn::Module {
 public:
  Mixed() {
    register_parameter("matrix", {3, 4}, nn::InitSpec::uniform(1.f));
    register_parameter("vector", {4}, nn::InitSpec::uniform(1.f));
    register_parameter("gain", {4}, nn::InitSpec::uniform(1.f), nn::Decay::yes);
    register_parameter("table", {2, 4}, nn::InitSpec::uniform(1.f), nn::Decay::no);
    register_module("lin", std::make_shared<nn::Linear>(4, 3));
    register_module("ln", std::make_shared<nn::LayerNorm>(4));
    register_module("emb", std::make_shared<nn::Embedding>(5, 4));
  }
  std::string type_name() const override { return "Mixed"; }

 protected:
  Tensor forward_impl(const Tensor& x) override { return x; }
  Tensor backward_impl(const Tensor& dy) override { return dy; }
  std::shared_ptr<nn::Module> clone_config() const override { return std::make_shared<Mixed>(); }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("nn.params: decay_by_parameter decays 2+ dimensions and what a layer says, not others") {
  Mixed m;
  m.materialize(Device::cpu(0), 3);
  const nn::ParamGroups g = nn::decay_by_parameter(m, 0.1f);
  REQUIRE(g.groups.size() == 2);
  CHECK(g.groups[0].weight_decay == 0.1f);
  CHECK(g.groups[1].weight_decay == 0.f);
  const std::vector<std::pair<std::string, int>> want{
      {"matrix", 0},   {"vector", 1},    {"gain", 0},    {"table", 1},     {"lin.weight", 0},
      {"lin.bias", 1}, {"ln.weight", 1}, {"ln.bias", 1}, {"emb.weight", 0}};
  auto params = m.named_parameters();
  REQUIRE(params.size() == want.size());
  REQUIRE(g.group_of_param.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(params[i].first);
    CHECK(params[i].first == want[i].first);
    CHECK(g.group_of_param[i] == want[i].second);
  }
  // By layer type, the custom layer's matrix and gain got no decay: the gap this closes.
  const nn::ParamGroups by_type = nn::decay_matrices_only(m, 0.1f);
  CHECK(by_type.group_of_param[0] == 1);
  CHECK(by_type.group_of_param[2] == 1);

  // One step on a zero gradient is decay alone: p (1 - lr wd) for group 0, untouched for 1.
  AdamWConfig cfg;
  cfg.lr = 0.5f;
  cfg.weight_decay = 0.1f;
  nn::GroupedAdamW opt(m, cfg, g);
  const std::vector<float> before = m.flat_params().to_host_f32();
  opt.step();
  const std::vector<float> after = m.flat_params().to_host_f32();
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(params[i].first);
    const nn::Parameter& p = *params[i].second;
    for (int64_t k = p.offset; k < p.offset + p.numel(); ++k) {
      if (g.group_of_param[i] == 0) {
        CHECK(after[k] == doctest::Approx(before[k] * (1.f - 0.05f)).epsilon(1e-6));
        CHECK(after[k] != before[k]);
      } else {
        CHECK(after[k] == before[k]);
      }
    }
  }
}

TEST_CASE("nn.params: a constant is made on each device, never a buffer, never saved") {
  auto m = scaled_mlp();
  m->materialize(Device::cpu(0), 5);
  auto constants = m->named_constants();
  REQUIRE(constants.size() == 1);
  CHECK(constants[0].first == "0.scale");
  CHECK(constants[0].second->value.device() == Device::cpu(0));
  CHECK(same_bits(constants[0].second->value.to_host_f32(), ScaledShift::made(6)));
  CHECK(m->named_buffers().empty());
  CHECK(m->flat_buffers().numel() == 0);
  // Not in a checkpoint: a saved model loads into a fresh one whose constant is its own.
  const std::string path = dp_test::temp_path("nn_params", "constant.ckpt");
  nn::save_checkpoint(*m, path);
  auto loaded = scaled_mlp();
  loaded->materialize(Device::cpu(0), 99);
  nn::load_checkpoint(*loaded, path);
  CHECK(same_bits(loaded->flat_params().to_host_f32(), m->flat_params().to_host_f32()));
  std::remove(path.c_str());
  // A replica makes its own on its device.
  auto copy = m->clone_to(Device::cpu(1));
  auto copied = copy->named_constants();
  REQUIRE(copied.size() == 1);
  CHECK(copied[0].second->value.device() == Device::cpu(1));
  CHECK(copied[0].second->value.raw() != constants[0].second->value.raw());
  CHECK(same_bits(copied[0].second->value.to_host_f32(), ScaledShift::made(6)));
  // A wrong count of values is refused naming the constant and both counts.
  class Bad : public ScaledShift {
   public:
    Bad() : ScaledShift(2) {
      register_constant("bad", {2, 3}, [](const Shape&) { return std::vector<float>(5); });
    }
  };
  Bad bad;
  CHECK_THROWS_WITH_AS(bad.materialize(Device::cpu(0), 1),
                       doctest::Contains("constant bad [2, 3]: made 5 values for 6 elements"),
                       kernels::Error);
}

TEST_CASE("dp.params: a layer with a constant table trains on 3 devices as on one (uneven)") {
  SgdConfig cfg;
  cfg.lr = 0.1f;
  cfg.momentum = 0.9f;
  std::vector<float> ref_losses, losses;
  const std::vector<float> ref = dp_test::train_single(scaled_mlp(), 11, 4, 10, cfg, &ref_losses);
  auto m = scaled_mlp();
  m->materialize(Device::cpu(0), 11);
  nn::SGD opt(*m, cfg);
  dp::DataParallel engine(m, opt, make_devices(DeviceType::cpu, 3));
  for (int s = 0; s < 4; ++s) {
    auto [x, y] = dp_test::toy_batch(10, 100 + s);  // chunks of 4, 3 and 3 rows
    losses.push_back(engine.train_step(x, y).loss);
  }
  CHECK(dp_test::rel_diff(m->flat_params().to_host_f32(), ref) <= 1e-5f);
  for (int s = 0; s < 4; ++s) CHECK(losses[s] == doctest::Approx(ref_losses[s]).epsilon(1e-5));
  // Every replica's table is still the one it made, on its own device.
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    auto c = engine.replica(i).named_constants();
    REQUIRE(c.size() == 1);
    CHECK(c[0].second->value.device() == Device::cpu(i));
    CHECK(same_bits(c[0].second->value.to_host_f32(), ScaledShift::made(6)));
  }
}
