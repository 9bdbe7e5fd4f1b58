// nn training pieces: losses, optimizers against hand-computed values, schedules, seeded init,
// replicas, flat buffer layout, checkpoints, model zoo.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include <unistd.h>

#include "tests/nn_test_util.hpp"

using namespace nn_test;
using nn::Bias;
using std::make_shared;

namespace {

// A 3-parameter module (Linear 2 -> 1) with given parameter values and gradients.
std::shared_ptr<nn::Linear> tiny(const std::vector<float>& params,
                                 const std::vector<float>& grads) {
  auto m = materialized(make_shared<nn::Linear>(2, 1));
  set_packed(*m, Which::values, params);
  set_packed(*m, Which::grads, grads);
  return m;
}

void check_close(const std::vector<float>& got, const std::vector<double>& want,
                 double tol = 1e-6) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(tol));
}

std::string temp_path(const std::string& name) {
  return "/tmp/nn_test_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace

// ---- losses --------------------------------------------------------------------------------

TEST_CASE("nn.loss: CrossEntropyLoss value and gradient, with label smoothing") {
  Tensor logits = Tensor::from_vector({1, 2, 3, 0, 0, 0}, {2, 3});
  Tensor labels = Tensor::from_ints({2, 0}, {2});
  nn::CrossEntropyLoss ce;
  Tensor loss = ce.forward(logits, labels);
  CHECK(loss.shape() == Shape{1});
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  const double want = ((lse - 3.0) + std::log(3.0)) / 2.0;
  CHECK(loss.item() == doctest::Approx(want).epsilon(1e-6));
  std::vector<float> d = host(ce.backward());
  CHECK(d[2] == doctest::Approx((std::exp(3.0 - lse) - 1.0) / 2.0).epsilon(1e-5));
  CHECK(d[3] == doctest::Approx((1.0 / 3.0 - 1.0) / 2.0).epsilon(1e-5));
  nn::CrossEntropyLoss smooth(0.1f);
  const double row1 = 0.9 * std::log(3.0) + 0.1 * std::log(3.0);  // uniform logits
  const double row0 = 0.9 * (lse - 3.0) + 0.1 / 3.0 * (3 * lse - 6.0);
  CHECK(smooth.forward(logits, labels).item() == doctest::Approx((row0 + row1) / 2).epsilon(1e-5));
  CHECK_THROWS_AS(ce.forward(logits, Tensor::from_ints({1}, {1})), kernels::Error);
}

TEST_CASE("nn.loss: MSELoss value and gradient") {
  nn::MSELoss mse;
  Tensor loss = mse.forward(Tensor::from_vector({1, 2, 3, 4}, {2, 2}),
                            Tensor::from_vector({1, 0, 3, 5}, {2, 2}));
  CHECK(loss.item() == doctest::Approx(5.0 / 4.0));
  check_close(host(mse.backward()), {0.0, 1.0, 0.0, -0.5});
}

// The engines' call: the gradient times a factor (fp16's loss scale, a micro-batch's weight),
// the loss and count as without it. The cross-entropies multiply inside their kernel; a loss
// that keeps the default (MSE, or a user's that only defines compute) scales in a second pass.
TEST_CASE("nn.loss: compute_scaled multiplies the gradient alone, fixed or read on the device") {
  Tensor logits = Tensor::from_vector({1, 2, 3, 0, 0, 0}, {2, 3});
  Tensor labels = Tensor::from_ints({2, 0}, {2});
  Tensor tokens = logits.reshape({1, 2, 3}), targets = labels.reshape({1, 2});
  const Tensor on_device = Tensor::from_vector({0.375f}, {1});
  struct Case {
    std::shared_ptr<const nn::Loss> loss;
    Tensor pred, target;
  };
  struct Plain : nn::Loss {  // only what a user must write
    std::string name() const override { return "plain"; }
    void check_target(const Tensor&) const override {}
    int64_t denominator(const Tensor& t) const override { return t.numel(); }
    void compute(Tensor& loss, Tensor& dpred, const Tensor& pred,
                 const Tensor& target) const override {
      kernels::mse_loss(loss, dpred, pred, target);
    }
  };
  const Tensor goal = Tensor::from_vector({0, 1, 2, 1, 0, 1}, {2, 3});
  auto zeros = [](const kernels::Shape& s) {
    return Tensor::zeros(s, kernels::DType::f32, kernels::Device::cpu());
  };
  for (const Case& c : {Case{std::make_shared<nn::CrossEntropyLoss>(0.1f), logits, labels},
                        Case{std::make_shared<nn::TokenCrossEntropyLoss>(), tokens, targets},
                        Case{std::make_shared<nn::MSELoss>(), logits, goal},
                        Case{std::make_shared<Plain>(), logits, goal}}) {
    CAPTURE(c.loss->name());
    Tensor loss = zeros({1}), dpred = zeros(c.pred.shape()), none;
    c.loss->compute(loss, dpred, c.pred, c.target);
    const std::vector<float> g1 = host(dpred);
    for (const kernels::Scalar& factor : {kernels::Scalar(3.f), kernels::Scalar(on_device)}) {
      Tensor scaled_loss = zeros({1}), scaled = zeros(c.pred.shape());
      c.loss->compute_scaled(scaled_loss, scaled, none, c.pred, c.target, factor);
      CHECK(scaled_loss.item() == loss.item());
      const std::vector<float> g = host(scaled);
      for (size_t i = 0; i < g.size(); ++i)
        CHECK(g[i] == doctest::Approx(g1[i] * factor.read()).epsilon(1e-6));
    }
    Tensor correct = zeros({1}), counted = zeros({1});
    c.loss->compute_and_count(loss, dpred, correct, c.pred, c.target);
    c.loss->compute_scaled(loss, dpred, counted, c.pred, c.target, kernels::Scalar(2.f));
    CHECK(counted.item() == correct.item());
  }
}

// ---- optimizers ----------------------------------------------------------------------------

TEST_CASE("nn.optim: SGD plain and with weight decay") {
  auto m = tiny({1, -2, 0.5f}, {0.1f, 0.2f, -0.3f});
  kernels::SgdConfig c;
  c.lr = 0.5f;
  nn::SGD sgd(*m, c);
  CHECK(sgd.state().empty());
  sgd.step();
  check_close(packed_values(*m), {0.95, -2.1, 0.65});
  CHECK(sgd.step_count() == 1);

  auto w = tiny({1, -2, 0.5f}, {0.1f, 0.2f, -0.3f});
  c.weight_decay = 0.1f;
  nn::SGD sgd_wd(*w, c);
  sgd_wd.step();  // g = grad + 0.1 p
  check_close(packed_values(*w), {1 - 0.5 * 0.2, -2 - 0.5 * 0.0, 0.5 - 0.5 * (-0.25)});
}

TEST_CASE("nn.optim: SGD momentum and Nesterov over two steps") {
  const std::vector<double> p0{1, -2, 0.5}, g{0.1, 0.2, -0.3};
  for (auto nesterov : {kernels::Nesterov::no, kernels::Nesterov::yes}) {
    auto m = tiny({1, -2, 0.5f}, {0.1f, 0.2f, -0.3f});
    kernels::SgdConfig c;
    c.lr = 0.1f;
    c.momentum = 0.9f;
    c.nesterov = nesterov;
    nn::SGD sgd(*m, c);
    sgd.step();
    sgd.set_lr(0.05f);
    sgd.step();  // same gradient again
    std::vector<double> want(3);
    for (int i = 0; i < 3; ++i) {
      double buf = g[i];  // step 1: buf = g
      double d = nesterov == kernels::Nesterov::yes ? g[i] + 0.9 * buf : buf;
      double p = p0[i] - 0.1 * d;
      buf = 0.9 * buf + g[i];  // step 2
      d = nesterov == kernels::Nesterov::yes ? g[i] + 0.9 * buf : buf;
      want[i] = p - 0.05 * d;
    }
    check_close(packed_values(*m), want, 1e-5);
    REQUIRE(sgd.state().size() == 1);
    CHECK(host(sgd.state()[0].second)[0] == doctest::Approx(1.9 * 0.1));
  }
  auto m = tiny({1, 1, 1}, {0, 0, 0});
  kernels::SgdConfig bad;
  bad.nesterov = kernels::Nesterov::yes;
  CHECK_THROWS_WITH_AS(nn::SGD(*m, bad), doctest::Contains("Nesterov"), kernels::Error);
}

TEST_CASE("nn.optim: require_steps takes the optimizer's own module tree, refuses another") {
  auto net = materialized(make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{make_shared<nn::Linear>(2, 3), make_shared<nn::Linear>(3, 1)}));
  nn::SGD opt(*net, kernels::SgdConfig{});
  opt.require_steps(*net, "engine");  // its own module
  // A child shares the tree's flat buffer: the optimizer steps it too.
  opt.require_steps(*net->children().front().second, "engine");
  auto other = tiny({1, 2, 3}, {0, 0, 0});
  CHECK_THROWS_WITH_AS(opt.require_steps(*other, "engine"),
                       doctest::Contains("engine: the optimizer steps another module's parameters "
                                         "(a Sequential), not the Linear's given here: build it "
                                         "on this module"),
                       kernels::Error);
  auto unmaterialised = make_shared<nn::Linear>(2, 1);
  CHECK_THROWS_AS(opt.require_steps(*unmaterialised, "engine"), kernels::Error);
}

TEST_CASE("nn.optim: AdamW over two steps") {
  const std::vector<double> p0{1, -2, 0.5}, g1{0.1, 0.2, -0.3}, g2{-0.2, 0.05, 0.4};
  auto m = tiny({1, -2, 0.5f}, {0.1f, 0.2f, -0.3f});
  kernels::AdamWConfig c;
  c.lr = 0.01f;
  c.weight_decay = 0.1f;
  nn::AdamW adam(*m, c);
  adam.step();
  set_packed(*m, Which::grads, {-0.2f, 0.05f, 0.4f});
  adam.step();
  std::vector<double> want(3);
  for (int i = 0; i < 3; ++i) {
    double p = p0[i], mm = 0, v = 0;
    const double g[2] = {g1[i], g2[i]};
    for (int t = 1; t <= 2; ++t) {
      p *= 1 - 0.01 * 0.1;
      mm = 0.9 * mm + 0.1 * g[t - 1];
      v = 0.999 * v + 0.001 * g[t - 1] * g[t - 1];
      const double mh = mm / (1 - std::pow(0.9, t)), vh = v / (1 - std::pow(0.999, t));
      p -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
    want[i] = p;
  }
  check_close(packed_values(*m), want, 1e-5);
  CHECK(adam.step_count() == 2);
  CHECK(adam.state().size() == 2);
}

TEST_CASE("nn.optim: an optimizer needs a materialised module") {
  nn::Linear m(2, 2);
  CHECK_THROWS_WITH_AS(nn::SGD(m, kernels::SgdConfig{}), doctest::Contains("materialize"),
                       kernels::Error);
}

// ---- schedules -----------------------------------------------------------------------------

TEST_CASE("nn.schedule: StepLR, CosineLR, LinearWarmup") {
  nn::StepLR step(0.1f, 3, 0.5f);
  CHECK(step.lr(0) == doctest::Approx(0.1));
  CHECK(step.lr(2) == doctest::Approx(0.1));
  CHECK(step.lr(3) == doctest::Approx(0.05));
  CHECK(step.lr(7) == doctest::Approx(0.025));

  nn::CosineLR cosine(0.1f, 10, 0.001f);
  CHECK(cosine.lr(0) == doctest::Approx(0.1));
  CHECK(cosine.lr(5) == doctest::Approx(0.0505));
  CHECK(cosine.lr(10) == doctest::Approx(0.001));
  CHECK(cosine.lr(25) == doctest::Approx(0.001));
  CHECK(cosine.lr(3) ==
        doctest::Approx(0.001 + 0.099 * 0.5 * (1 + std::cos(3.14159265358979 * 0.3))));

  nn::LinearWarmup warm(cosine, 4);
  CHECK(warm.lr(0) == doctest::Approx(0.025));
  CHECK(warm.lr(3) == doctest::Approx(0.1));
  CHECK(warm.lr(4) == doctest::Approx(cosine.lr(0)));
  CHECK(warm.lr(9) == doctest::Approx(cosine.lr(5)));

  auto m = tiny({1, 1, 1}, {1, 1, 1});
  nn::SGD sgd(*m, kernels::SgdConfig{});
  sgd.set_lr(warm.lr(0));
  CHECK(sgd.lr() == doctest::Approx(0.025));
  sgd.step();
  CHECK(host(m->flat_params())[0] == doctest::Approx(0.975));
}

// ---- init, replicas, layout ----------------------------------------------------------------

TEST_CASE("nn.init: the same seed gives the same model, another seed another") {
  auto a = materialized(nn::lenet(1, 10), 42);
  auto b = materialized(nn::lenet(1, 10), 42);
  auto c = materialized(nn::lenet(1, 10), 43);
  CHECK(host(a->flat_params()) == host(b->flat_params()));
  CHECK(host(a->flat_params()) != host(c->flat_params()));
  c->reinitialize(42);
  CHECK(host(a->flat_params()) == host(c->flat_params()));
  // PyTorch's defaults: |W| <= 1/sqrt(fan_in) for Linear and Conv2d; BN gamma 1, beta 0.
  auto& w = nn::find_parameter(*a, "7.weight");  // Linear(400, 120)
  for (float v : host(w.value)) REQUIRE(std::fabs(v) <= 1.f / 20.f);
  auto r = materialized(nn::resnet(8, 1, 10), 1);
  CHECK(host(nn::find_parameter(*r, "1.weight").value) == std::vector<float>(16, 1.f));
  CHECK(host(nn::find_parameter(*r, "1.bias").value) == std::vector<float>(16, 0.f));
  CHECK(host(nn::find_buffer(*r, "1.running_var").value) == std::vector<float>(16, 1.f));
}

TEST_CASE("nn.replica: clone_to(cpu:1) gives bitwise identical forward and backward") {
  auto net = materialized(
      nn::sequential({make_shared<nn::Conv2d>(2, 4, 3, 1, 1), make_shared<nn::BatchNorm2d>(4),
                      make_shared<nn::ReLU>(), make_shared<nn::MaxPool2d>(2),
                      make_shared<nn::Flatten>(), make_shared<nn::Linear>(36, 5),
                      make_shared<nn::GELU>(), make_shared<nn::LayerNorm>(5)}),
      7);
  auto replica = net->clone_to(Device::cpu(1));
  CHECK(replica->device() == Device::cpu(1));
  CHECK(replica->named_parameters().size() == net->named_parameters().size());
  CHECK(!replica->flat_params().same_storage(net->flat_params()));
  CHECK(host(replica->flat_params()) == host(net->flat_params()));
  CHECK(host(replica->flat_buffers()) == host(net->flat_buffers()));

  Tensor x0 = uniform({3, 2, 6, 6}, 1);
  Tensor x1 = x0.to(Device::cpu(1));
  Tensor dy0 = uniform({3, 5}, 2);
  Tensor dy1 = dy0.to(Device::cpu(1));
  CHECK(host(net->forward(x0)) == host(replica->forward(x1)));
  CHECK(host(net->backward(dy0)) == host(replica->backward(dy1)));
  CHECK(host(net->flat_grads()) == host(replica->flat_grads()));
  CHECK(host(net->flat_buffers()) == host(replica->flat_buffers()));  // running stats

  net->eval();
  auto eval_replica = net->clone_to(Device::cpu(2));
  CHECK(!eval_replica->is_training());
  CHECK(host(net->forward(x0)) == host(eval_replica->forward(x0.to(Device::cpu(2)))));
}

TEST_CASE("nn.layout: views alias one flat buffer, with hierarchical names") {
  auto net = materialized(nn::sequential({make_shared<nn::Linear>(3, 4),
                                          make_shared<nn::BatchNorm1d>(4), make_shared<nn::ReLU>(),
                                          make_shared<nn::Residual>(make_shared<nn::Linear>(4, 4)),
                                          make_shared<nn::Linear>(4, 2, Bias::no)}));
  std::vector<std::string> names;
  int64_t expected_offset = 0, end = 0;
  for (auto& [name, p] : net->named_parameters()) {
    names.push_back(name);
    expected_offset = nn::align_flat_offset(end);  // the next 256-byte boundary
    CHECK(p->offset == expected_offset);
    end = expected_offset + p->numel();
    CHECK(p->value.same_storage(net->flat_params()));
    CHECK(p->grad.same_storage(net->flat_grads()));
  }
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias",
                                          "3.block.weight", "3.block.bias", "4.weight"});
  CHECK(end == net->flat_params().numel());
  CHECK(net->num_parameters() == 12 + 4 + 4 + 4 + 16 + 4 + 8);
  std::vector<std::string> buffers;
  for (auto& [name, b] : net->named_buffers()) buffers.push_back(name);
  CHECK(buffers == std::vector<std::string>{"1.running_mean", "1.running_var"});
  CHECK(net->flat_buffers().numel() == 64 + 4);  // running_var on the next 256-byte boundary

  // A write through the flat buffer shows in the view, and the other way round.
  std::vector<float> flat = host(net->flat_params());
  flat[64] = 123.f;  // first element of 0.bias
  nn::set_values(net->flat_params(), flat);
  CHECK(host(nn::find_parameter(*net, "0.bias").value)[0] == 123.f);
  nn::set_values(nn::find_parameter(*net, "4.weight"), std::vector<float>(8, -1.f));
  CHECK(host(net->flat_params())[end - 1] == -1.f);
}

TEST_CASE("nn.layout: every view starts on a 256-byte boundary, the gaps are never a parameter") {
  // Odd sizes everywhere (3x5 weights, 5 biases, BatchNorm's 5-element statistics).
  auto net = materialized(nn::sequential(
      {make_shared<nn::Linear>(3, 5), make_shared<nn::BatchNorm1d>(5), make_shared<nn::ReLU>(),
       make_shared<nn::Linear>(5, 7), make_shared<nn::Linear>(7, 2, Bias::no)}));
  const int64_t total = net->flat_params().numel();
  std::vector<int> owner(static_cast<size_t>(total), -1);  // which parameter holds element i
  int index = 0, n_params = 0;
  for (auto& [name, p] : net->named_parameters()) {
    CAPTURE(name);
    CHECK(p->value.offset_bytes() % nn::kFlatAlignBytes == 0);
    CHECK(p->grad.offset_bytes() % nn::kFlatAlignBytes == 0);
    CHECK(reinterpret_cast<uintptr_t>(p->value.raw()) % nn::kFlatAlignBytes == 0);
    for (int64_t i = p->offset; i < p->offset + p->numel(); ++i) {
      REQUIRE(owner[i] == -1);  // no two parameters share an element
      owner[i] = index;
    }
    n_params += static_cast<int>(p->numel());
    ++index;
  }
  for (auto& [name, b] : net->named_buffers()) {
    CAPTURE(name);
    CHECK(b->value.offset_bytes() % nn::kFlatAlignBytes == 0);
  }
  // The gaps: fewer than 64 floats each, only before an aligned view, and zero.
  const int64_t gaps = total - n_params;
  CHECK(gaps > 0);
  CHECK(n_params == net->num_parameters());
  auto check_gaps_zero = [&](const char* when) {
    CAPTURE(when);
    std::vector<float> params = host(net->flat_params()), grads = host(net->flat_grads());
    for (int64_t i = 0; i < total; ++i)
      if (owner[i] < 0) {
        CAPTURE(i);
        REQUIRE(params[i] == 0.f);
        REQUIRE(grads[i] == 0.f);
      }
  };
  check_gaps_zero("materialised");

  // Training steps over the whole flat buffers (SGD with momentum and weight decay, AdamW):
  // every parameter element moves, the gaps stay zero.
  const std::vector<float> before = packed_values(*net);
  nn::CrossEntropyLoss loss_fn;
  Tensor x = uniform({4, 3}, 5);
  Tensor y = Tensor::from_ints({0, 1, 1, 0}, {4});
  kernels::SgdConfig sc;
  sc.lr = 0.1f;
  sc.momentum = 0.9f;
  sc.weight_decay = 0.01f;
  nn::SGD sgd(*net, sc);
  kernels::AdamWConfig ac;
  ac.weight_decay = 0.1f;
  nn::AdamW adam(*net, ac);
  for (int step = 0; step < 4; ++step) {
    net->zero_grad();
    loss_fn.forward(net->forward(x), y);
    net->backward(loss_fn.backward());
    check_gaps_zero("after backward");
    step % 2 ? adam.step() : sgd.step();
    check_gaps_zero("after a step");
  }
  const std::vector<float> after = packed_values(*net);
  for (size_t i = 0; i < after.size(); ++i) CHECK(after[i] != before[i]);

  // clone_to and checkpoints carry the same layout and values.
  auto replica = net->clone_to(Device::cpu(1));
  CHECK(host(replica->flat_params()) == host(net->flat_params()));
  const std::string path = temp_path("aligned.ckpt");
  nn::save_checkpoint(*net, path);
  auto loaded =
      materialized(nn::sequential({make_shared<nn::Linear>(3, 5), make_shared<nn::BatchNorm1d>(5),
                                   make_shared<nn::ReLU>(), make_shared<nn::Linear>(5, 7),
                                   make_shared<nn::Linear>(7, 2, Bias::no)}),
                   9);
  nn::load_checkpoint(*loaded, path);
  std::remove(path.c_str());
  CHECK(packed_values(*loaded) == after);
  CHECK(host(loaded->flat_buffers()) == host(net->flat_buffers()));
}

// ---- checkpoints ---------------------------------------------------------------------------

TEST_CASE("nn.checkpoint: round trip restores parameters and buffers") {
  const std::string path = temp_path("roundtrip.ckpt");
  auto a = materialized(nn::resnet(8, 1, 10, 4), 1);
  a->forward(uniform({2, 1, 8, 8}, 1));  // moves the running statistics
  nn::save_checkpoint(*a, path);
  auto b = materialized(nn::resnet(8, 1, 10, 4), 2);
  CHECK(host(a->flat_params()) != host(b->flat_params()));
  nn::load_checkpoint(*b, path);
  CHECK(host(a->flat_params()) == host(b->flat_params()));
  CHECK(host(a->flat_buffers()) == host(b->flat_buffers()));
  std::remove(path.c_str());
}

TEST_CASE("nn.checkpoint: corrupt, truncated and mismatched files give clear errors") {
  const std::string path = temp_path("corrupt.ckpt");
  auto a = materialized(nn::mlp({4, 3, 2}), 1);
  nn::save_checkpoint(*a, path);
  std::string bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& b) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  auto b = materialized(nn::mlp({4, 3, 2}), 2);

  std::string flipped = bytes;
  flipped[flipped.size() - 5] ^= 0x40;  // inside the data
  write(flipped);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*b, path), doctest::Contains("corrupt"), kernels::Error);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*b, path), doctest::Contains(path.c_str()),
                       kernels::Error);
  write(bytes.substr(0, bytes.size() - 8));
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*b, path), doctest::Contains("truncated"),
                       kernels::Error);
  write("not a checkpoint at all");
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*b, path), doctest::Contains("magic"), kernels::Error);
  // One parameter element counted as a buffer's (the data's size unchanged): every tensor
  // matches, the flat layout does not.
  std::string moved = bytes;
  uint64_t counts[2];  // parameter and buffer elements, after the magic, version and entry count
  std::memcpy(counts, moved.data() + 16, sizeof counts);
  --counts[0], ++counts[1];
  std::memcpy(&moved[16], counts, sizeof counts);
  write(moved);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*b, path),
                       doctest::Contains("alignment gaps included: every tensor's name and shape"),
                       kernels::Error);
  CHECK(host(b->flat_params()) != host(a->flat_params()));  // failed loads change nothing

  write(bytes);
  auto wider = materialized(nn::mlp({4, 5, 2}), 1);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*wider, path), doctest::Contains("'1.weight'"),
                       kernels::Error);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*wider, path), doctest::Contains("[3, 4]"),
                       kernels::Error);
  auto deeper = materialized(nn::mlp({4, 3, 3, 2}), 1);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*deeper, path), doctest::Contains("tensors"),
                       kernels::Error);
  CHECK_THROWS_WITH_AS(nn::load_checkpoint(*a, "/nonexistent/x.ckpt"),
                       doctest::Contains("/nonexistent/x.ckpt"), kernels::Error);
  nn::load_checkpoint(*b, path);
  CHECK(host(b->flat_params()) == host(a->flat_params()));
  std::remove(path.c_str());
}

// ---- model zoo -----------------------------------------------------------------------------

TEST_CASE("nn.zoo: mlp, lenet and resnet shapes on 28x28 and 32x32") {
  auto m = nn::mlp({12, 8, 8, 3});
  CHECK(!m->materialized());
  m->materialize(Device::cpu(), 1);
  CHECK(m->size() == 6);
  CHECK(m->forward(uniform({2, 3, 4}, 1)).shape() == Shape{2, 3});

  auto l28 = materialized(nn::lenet(1, 10));
  CHECK(l28->forward(uniform({2, 1, 28, 28}, 1)).shape() == Shape{2, 10});
  CHECK(l28->num_parameters() == 61706);  // the classic LeNet-5 count
  auto l32 = materialized(nn::lenet(3, 10, 32));
  CHECK(l32->forward(uniform({2, 3, 32, 32}, 1)).shape() == Shape{2, 10});

  auto r8 = materialized(nn::resnet(8, 1, 10));
  CHECK(r8->forward(uniform({2, 1, 28, 28}, 1)).shape() == Shape{2, 10});
  auto r20 = nn::resnet(20, 3, 10);
  // 269722 with identity/zero-pad skips (He et al.); 1x1 conv + BN projections add 2752.
  CHECK(r20->num_parameters() == 269722 + (16 * 32 + 32 * 64) + 2 * (32 + 64));
  r20->materialize(Device::cpu(), 1);
  Tensor y = r20->forward(uniform({2, 3, 32, 32}, 1));
  CHECK(y.shape() == Shape{2, 10});
  CHECK(r20->backward(uniform({2, 10}, 2)).shape() == Shape{2, 3, 32, 32});
  CHECK_THROWS_WITH_AS(nn::resnet(10, 3, 10), doctest::Contains("6n + 2"), kernels::Error);
}

TEST_CASE("nn.zoo: a clone of the structure trains like the original") {
  auto net = materialized(nn::mlp({6, 8, 3}), 3);
  auto copy = net->clone_structure();
  copy->materialize(Device::cpu(), 3);
  CHECK(host(copy->flat_params()) == host(net->flat_params()));
  CHECK(copy->type_name() == "Sequential");
}

TEST_CASE("nn.train: a small MLP fits a fixed batch with SGD and AdamW") {
  Tensor x = uniform({16, 6}, 5);
  std::vector<int32_t> labels(16);
  for (int i = 0; i < 16; ++i) labels[i] = i % 3;
  Tensor t = Tensor::from_ints(labels, {16});
  for (int which = 0; which < 2; ++which) {
    auto net = materialized(nn::mlp({6, 32, 3}), 4);
    std::unique_ptr<nn::Optimizer> opt;
    if (which == 0) {
      kernels::SgdConfig c;
      c.lr = 0.5f;
      c.momentum = 0.9f;
      opt = std::make_unique<nn::SGD>(*net, c);
    } else {
      kernels::AdamWConfig c;
      c.lr = 0.02f;
      opt = std::make_unique<nn::AdamW>(*net, c);
    }
    nn::CrossEntropyLoss ce;
    float first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      opt->zero_grad();
      Tensor loss = ce.forward(net->forward(x), t);
      net->backward(ce.backward());
      opt->step();
      (step == 0 ? first : last) = loss.item();
    }
    INFO("optimizer " << which << ": loss " << first << " -> " << last);
    CHECK(last < 0.2f * first);
  }
}
