// nn layers: finite-difference gradient checks for every layer, layer semantics, bad input.
#include <cmath>
#include <memory>

#include "tests/amp_util.hpp"
#include "tests/nn_test_util.hpp"

using namespace nn_test;
using nn::Bias;
using std::make_shared;

// ---- gradient checks -----------------------------------------------------------------------

// Deep ReLU networks: internal pre-activations lie within eps of a kink often enough that some
// central differences are off by a few percent (measured up to 2% over seeds, with eps 3e-4,
// in correct code); a wrong backward is off by far more.
nn::GradcheckOptions relu_net_options() {
  nn::GradcheckOptions o;
  o.eps = 3e-4f;
  o.tolerance = 5e-2;
  return o;
}

TEST_CASE("nn.gradcheck: Linear") {
  auto m = materialized(make_shared<nn::Linear>(5, 4));
  check_grads(*m, uniform({3, 5}, 1));
  check_grads(*m, uniform({2, 3, 5}, 2));  // leading dims are rows
  auto nb = materialized(make_shared<nn::Linear>(5, 4, Bias::no));
  CHECK(nb->named_parameters().size() == 1);
  check_grads(*nb, uniform({3, 5}, 3));
}

TEST_CASE("nn.gradcheck: Conv2d with stride and padding") {
  auto a = materialized(make_shared<nn::Conv2d>(2, 3, 3, 2, 1));
  check_grads(*a, uniform({2, 2, 7, 7}, 4));
  auto b = materialized(make_shared<nn::Conv2d>(3, 2, 1, 1, 0, Bias::no));
  check_grads(*b, uniform({2, 3, 4, 5}, 5));
  auto c = materialized(make_shared<nn::Conv2d>(2, 2, 3, 1, 0));
  check_grads(*c, uniform({1, 2, 5, 6}, 6));
}

TEST_CASE("nn.gradcheck: ReLU, GELU, Tanh") {
  auto relu = materialized(make_shared<nn::ReLU>());
  check_grads(*relu, separated({2, 3, 4}, 7));
  auto gelu = materialized(make_shared<nn::GELU>());
  check_grads(*gelu, uniform({4, 6}, 8, -3.f, 3.f));
  auto tanh = materialized(make_shared<nn::Tanh>());
  check_grads(*tanh, uniform({4, 6}, 9, -2.f, 2.f));
}

TEST_CASE("nn.gradcheck: MaxPool2d and AvgPool2d") {
  auto mp = materialized(make_shared<nn::MaxPool2d>(2));
  check_grads(*mp, separated({2, 2, 6, 6}, 10));
  auto mp3 = materialized(make_shared<nn::MaxPool2d>(3, 2, 1));
  check_grads(*mp3, separated({1, 2, 7, 7}, 11));
  auto ap = materialized(make_shared<nn::AvgPool2d>(2));
  check_grads(*ap, uniform({2, 2, 6, 6}, 12));
  auto ap3 = materialized(make_shared<nn::AvgPool2d>(3, 2, 1));
  check_grads(*ap3, uniform({1, 2, 7, 7}, 13));
}

TEST_CASE("nn.gradcheck: GlobalAvgPool") {
  auto m = materialized(make_shared<nn::GlobalAvgPool>());
  Tensor x = uniform({2, 3, 4, 5}, 14);
  CHECK(m->forward(x).shape() == Shape{2, 3});
  check_grads(*m, x);
}

TEST_CASE("nn.gradcheck: BatchNorm1d in training mode") {
  auto m = materialized(make_shared<nn::BatchNorm1d>(4));
  nn::set_values(m->weight(), {0.5f, 1.5f, -1.f, 2.f});
  nn::set_values(m->bias(), {0.1f, -0.2f, 0.3f, 0.f});
  check_grads(*m, uniform({6, 4}, 15));
  check_grads(*m, uniform({3, 4, 5}, 16));  // (N, C, L)
}

TEST_CASE("nn.gradcheck: BatchNorm2d in training and eval mode") {
  auto m = materialized(make_shared<nn::BatchNorm2d>(3));
  nn::set_values(m->weight(), {0.5f, 1.5f, -1.f});
  nn::set_values(m->bias(), {0.1f, -0.2f, 0.3f});
  check_grads(*m, uniform({4, 3, 3, 3}, 17));
  nn::set_values(m->running_mean().value, {0.2f, -0.1f, 0.05f});
  nn::set_values(m->running_var().value, {0.5f, 2.f, 1.2f});
  m->eval();
  check_grads(*m, uniform({2, 3, 3, 3}, 18));
}

TEST_CASE("nn.gradcheck: LayerNorm") {
  auto m = materialized(make_shared<nn::LayerNorm>(6));
  nn::set_values(m->weight(), {0.5f, 1.5f, -1.f, 2.f, 1.f, 0.7f});
  nn::set_values(m->bias(), {0.1f, -0.2f, 0.3f, 0.f, 0.5f, -0.5f});
  check_grads(*m, uniform({4, 6}, 19));
  check_grads(*m, uniform({2, 3, 6}, 20));
}

TEST_CASE("nn.layernorm: forward_add and backward_add are the bits of the sums around the norm") {
  // Two LayerNorms with the same parameters: one fused (GptBlock's path), one with the sums
  // done apart. Same outputs, gradients and sums, and on_grad_ready fires for the fused one.
  auto fused = materialized(make_shared<nn::LayerNorm>(6));
  auto apart = materialized(make_shared<nn::LayerNorm>(6));
  for (auto* m : {fused.get(), apart.get()}) {
    nn::set_values(m->weight(), {0.5f, 1.5f, -1.f, 2.f, 1.f, 0.7f});
    nn::set_values(m->bias(), {0.1f, -0.2f, 0.3f, 0.f, 0.5f, -0.5f});
  }
  int ready = 0;
  fused->flat().on_grad_ready = [&](const nn::Parameter&) { ++ready; };
  Tensor a = uniform({2, 3, 6}, 23), b = uniform({2, 3, 6}, 24);
  Tensor h;
  Tensor y = fused->forward_add(a, b, h);
  Tensor h_apart = Tensor::empty(a.shape(), a.dtype(), a.device());
  kernels::add(h_apart, a, b);
  CHECK(host(h) == host(h_apart));
  CHECK(host(y) == host(apart->forward(h_apart)));
  Tensor dy = uniform({2, 3, 6}, 25), dskip = uniform({2, 3, 6}, 26);
  Tensor dx = fused->backward_add(dy, dskip);
  Tensor dx_apart = Tensor::empty(a.shape(), a.dtype(), a.device());
  kernels::add(dx_apart, dskip, apart->backward(dy));
  CHECK(dx.shape() == a.shape());
  CHECK(host(dx) == host(dx_apart));
  CHECK(host(fused->flat_grads()) == host(apart->flat_grads()));
  CHECK(ready == 2);
  CHECK_THROWS_WITH_AS(fused->forward_add(a, uniform({2, 6}, 27), h),
                       doctest::Contains("must match in shape"), kernels::Error);
  // b of another dtype: the sum in a's dtype, then the norm (two passes), the same bits.
  Tensor b16 = kernels::cast(b, DType::bf16), h16;
  Tensor y16 = fused->forward_add(a, b16, h16);
  Tensor h16_apart = Tensor::empty(a.shape(), a.dtype(), a.device());
  kernels::add(h16_apart, a, b16);
  CHECK(h16.dtype() == DType::f32);
  CHECK(host(h16) == host(h16_apart));
  CHECK(host(y16) == host(apart->forward(h16_apart)));
  CHECK_THROWS_WITH_AS(fused->backward_add(dy, uniform({6, 6}, 28)),
                       doctest::Contains("dskip [6, 6] must have the input's [2, 3, 6] shape"),
                       kernels::Error);
}

TEST_CASE("nn.gradcheck: Dropout in eval mode and with a replayed mask") {
  auto m = materialized(make_shared<nn::Dropout>(0.3f));
  check_grads(*m, uniform({4, 8}, 21));  // training: gradcheck replays the mask
  m->eval();
  check_grads(*m, uniform({4, 8}, 22));
}

TEST_CASE("nn.gradcheck: Flatten and Sequential") {
  auto f = materialized(make_shared<nn::Flatten>());
  check_grads(*f, uniform({2, 3, 2}, 23));
  auto seq = materialized(nn::sequential({make_shared<nn::Flatten>(), make_shared<nn::Linear>(6, 5),
                                          make_shared<nn::Tanh>(), make_shared<nn::Linear>(5, 3)}));
  check_grads(*seq, uniform({3, 2, 3}, 24));
}

TEST_CASE("nn.gradcheck: Residual, identity and projected skips") {
  auto id = materialized(make_shared<nn::Residual>(nn::sequential(
      {make_shared<nn::Linear>(4, 6), make_shared<nn::GELU>(), make_shared<nn::Linear>(6, 4)})));
  check_grads(*id, uniform({3, 4}, 25));
  auto proj = materialized(make_shared<nn::Residual>(
      nn::sequential({make_shared<nn::Linear>(4, 5), make_shared<nn::Tanh>()}),
      make_shared<nn::Linear>(4, 5, Bias::no)));
  check_grads(*proj, uniform({3, 4}, 26));
}

TEST_CASE("nn.gradcheck: ResNet basic block with BatchNorm in training mode") {
  auto block = materialized(nn::basic_block(2, 3, 2));
  check_grads(*block, uniform({3, 2, 6, 6}, 27), relu_net_options());
}

TEST_CASE("nn.gradcheck: zoo models mlp, lenet and a narrow resnet8") {
  nn::GradcheckOptions o = relu_net_options();
  o.samples_per_tensor = 6;
  auto mlp = materialized(nn::mlp({12, 8, 8, 3}), 1);
  check_grads(*mlp, uniform({3, 3, 4}, 30), o);
  auto lenet = materialized(nn::lenet(1, 4, 12), 2);
  check_grads(*lenet, uniform({2, 1, 12, 12}, 31), o);
  auto resnet = materialized(nn::resnet(8, 1, 3, 2), 3);
  check_grads(*resnet, uniform({2, 1, 8, 8}, 32), o);
}

// ---- layer semantics -----------------------------------------------------------------------

TEST_CASE("nn.linear: forward matches a hand computation") {
  auto m = materialized(make_shared<nn::Linear>(2, 2));
  nn::set_values(m->weight(), {1, 2, 3, 4});
  nn::set_values(*m->bias(), {0.5f, -1});
  Tensor y = m->forward(Tensor::from_vector({1, 1, 2, -1}, {2, 2}));
  CHECK(host(y) == std::vector<float>{3.5f, 6, 0.5f, 1});
}

TEST_CASE("nn.linear: a wrong feature count throws naming the shapes") {
  auto m = materialized(make_shared<nn::Linear>(4, 3));
  CHECK_THROWS_WITH_AS(m->forward(uniform({2, 5}, 1)), doctest::Contains("[2, 5]"), kernels::Error);
  CHECK_THROWS_WITH_AS(m->forward(uniform({2, 5}, 1)), doctest::Contains("[3, 4]"), kernels::Error);
  auto c = materialized(make_shared<nn::Conv2d>(3, 4, 3));
  CHECK_THROWS_WITH_AS(c->forward(uniform({1, 2, 5, 5}, 1)), doctest::Contains("[1, 2, 5, 5]"),
                       kernels::Error);
  CHECK_THROWS_AS(make_shared<nn::Linear>(0, 3), kernels::Error);
  auto fresh = make_shared<nn::Linear>(4, 3);
  CHECK_THROWS_WITH_AS(fresh->forward(uniform({2, 4}, 1)), doctest::Contains("materialize"),
                       kernels::Error);
}

TEST_CASE("nn.layers: output shapes") {
  CHECK(materialized(make_shared<nn::Conv2d>(3, 8, 3, 2, 1))
            ->forward(uniform({2, 3, 9, 9}, 1))
            .shape() == Shape{2, 8, 5, 5});
  CHECK(materialized(make_shared<nn::MaxPool2d>(2))->forward(uniform({2, 3, 9, 8}, 1)).shape() ==
        Shape{2, 3, 4, 4});
  CHECK(materialized(make_shared<nn::Flatten>())->forward(uniform({2, 3, 4}, 1)).shape() ==
        Shape{2, 12});
}

TEST_CASE("nn.gradients: zero_grad then two steps' backwards accumulate twice the gradient") {
  auto net = materialized(nn::sequential(
      {make_shared<nn::Conv2d>(2, 3, 3, 1, 1), make_shared<nn::BatchNorm2d>(3),
       make_shared<nn::ReLU>(), make_shared<nn::Flatten>(), make_shared<nn::Linear>(48, 4)}));
  Tensor x = uniform({2, 2, 4, 4}, 2);
  Tensor dy = uniform({2, 4}, 3);
  net->zero_grad();
  net->forward(x);
  std::vector<float> dx1 = host(net->backward(dy));
  std::vector<float> g1 = host(net->flat_grads());
  // A second backward needs a forward of its own: a module keeps one forward's state.
  CHECK(dp_test::error_of([&] {
          net->backward(dy);
        }).find("Sequential::backward a second time through one forward") != std::string::npos);
  net->forward(x);
  std::vector<float> dx2 = host(net->backward(dy));
  std::vector<float> g2 = host(net->flat_grads());
  CHECK(dx1 == dx2);
  double worst = 0;
  for (size_t i = 0; i < g1.size(); ++i)
    worst = std::max(worst, std::fabs(g2[i] - 2.0 * g1[i]) / (1e-6 + std::fabs(g1[i])));
  CHECK(worst < 1e-5);
  net->zero_grad();
  for (float g : host(net->flat_grads())) REQUIRE(g == 0.f);
}

TEST_CASE("nn.gradients: on_grad_ready fires per parameter in reverse layer order") {
  auto net = materialized(nn::sequential(
      {make_shared<nn::Linear>(3, 4), make_shared<nn::ReLU>(), make_shared<nn::Linear>(4, 2)}));
  std::vector<int64_t> offsets;
  net->flat().on_grad_ready = [&](const nn::Parameter& p) { offsets.push_back(p.offset); };
  net->forward(uniform({2, 3}, 1));
  net->backward(uniform({2, 2}, 2));
  // Layer "2" (weight, bias) before layer "0" (weight at 0, bias next); every view starts on
  // its own 256-byte boundary (64 floats).
  CHECK(offsets == std::vector<int64_t>{128, 192, 0, 64});
}

TEST_CASE("nn.batchnorm: running statistics in training, used in eval") {
  auto m = materialized(make_shared<nn::BatchNorm1d>(2));
  // Channel 0: {1, 3, 5, 7} (mean 4, biased var 5, unbiased 20/3); channel 1: {0, 0, 2, 2}.
  Tensor x = Tensor::from_vector({1, 0, 3, 0, 5, 2, 7, 2}, {4, 2});
  std::vector<float> y = host(m->forward(x));
  CHECK(y[0] == doctest::Approx(-3.f / std::sqrt(5.f + 1e-5f)).epsilon(1e-5));
  std::vector<float> rm = host(m->running_mean().value);
  CHECK(rm[0] == doctest::Approx(0.4f));
  CHECK(rm[1] == doctest::Approx(0.1f));
  std::vector<float> rv = host(m->running_var().value);
  CHECK(rv[0] == doctest::Approx(0.9f + 0.1f * 20.f / 3.f));
  CHECK(rv[1] == doctest::Approx(0.9f + 0.1f * 4.f / 3.f));
  m->eval();
  std::vector<float> ye = host(m->forward(Tensor::from_vector({0.4f, 0.1f}, {1, 2})));
  CHECK(ye[0] == doctest::Approx(0.f));        // the running mean maps to beta = 0
  CHECK(host(m->running_mean().value) == rm);  // eval: unchanged
  auto one = materialized(make_shared<nn::BatchNorm1d>(3));
  CHECK_THROWS_WITH_AS(one->forward(uniform({1, 3}, 1)), doctest::Contains("more than one"),
                       kernels::Error);
}

TEST_CASE("nn.dropout: masks advance the random stream, eval is the identity") {
  auto m = materialized(make_shared<nn::Dropout>(0.25f));
  Tensor x = Tensor::from_vector(std::vector<float>(4000, 1.f), {40, 100});
  const uint64_t offset0 = m->flat().rng_offset;
  std::vector<float> y1 = host(m->forward(x));
  CHECK(m->flat().rng_offset == offset0 + 4000);
  std::vector<float> y2 = host(m->forward(x));
  CHECK(y1 != y2);
  int64_t kept = 0;
  for (float v : y1) {
    REQUIRE((v == 0.f || v == doctest::Approx(1.f / 0.75f)));
    kept += v != 0.f;
  }
  CHECK(kept > 2800);
  CHECK(kept < 3200);
  std::vector<float> dx = host(m->backward(x));  // the gradient uses the last mask
  CHECK(dx == y2);
  m->flat().rng_offset = offset0;  // replay
  CHECK(host(m->forward(x)) == y1);
  m->eval();
  CHECK(host(m->forward(x)) == host(x));
  CHECK(m->flat().rng_offset == offset0 + 4000);
}

TEST_CASE("nn.dropout: the mask is kept between steps, remade for a new shape") {
  // Without a block cache every request is an allocation: after the first step of a shape,
  // Dropout's forward and backward allocate the output and dx, not the mask.
  kernels::DeviceContext plain(Device::cpu(1), {1});
  kernels::ContextScope scope(plain);
  auto m = materialized(make_shared<nn::Dropout>(0.4f), 3, Device::cpu(1));
  for (int64_t rows : {6, 6, 6, 9}) {  // 9: a new shape remakes the buffers
    CAPTURE(rows);
    Tensor x = uniform({rows, 5}, 40 + static_cast<uint32_t>(rows), -1.f, 1.f, Device::cpu(1));
    Tensor dy = uniform({rows, 5}, 50, -1.f, 1.f, Device::cpu(1));
    const uint64_t offset = m->flat().rng_offset;
    const int64_t before = plain.memory()->allocations.load();
    Tensor y = m->forward(x);
    Tensor dx = m->backward(dy);
    const int64_t allocated = plain.memory()->allocations.load() - before;
    // The same results as before the buffers were kept: the mask of (key, offset).
    Tensor want_y = Tensor::empty(x.shape(), DType::f32, Device::cpu(1));
    Tensor mask = Tensor::empty(x.shape(), DType::f32, Device::cpu(1));
    kernels::dropout_forward(want_y, mask, x, 0.4f, m->flat().rng_key, offset);
    Tensor want_dx = Tensor::empty(x.shape(), DType::f32, Device::cpu(1));
    kernels::mul(want_dx, dy, mask);
    CHECK(host(y) == host(want_y));
    CHECK(host(dx) == host(want_dx));
    if (offset > 0 && rows == 6)
      CHECK(allocated == 2);  // y, dx
    else
      CHECK(allocated == 3);  // y, the mask, dx
  }
}

TEST_CASE("nn.dropout: on a caching context a training step allocates nothing after the first") {
  kernels::ContextOptions o;
  o.cpu_threads = 1;
  o.caching = kernels::Caching::on;
  kernels::DeviceContext cached(Device::cpu(1), o);
  kernels::ContextScope scope(cached);
  auto m =
      materialized(nn::sequential({make_shared<nn::Linear>(5, 16), make_shared<nn::ReLU>(),
                                   make_shared<nn::Dropout>(0.3f), make_shared<nn::Linear>(16, 3)}),
                   4, Device::cpu(1));
  nn::CrossEntropyLoss loss;
  Tensor x = uniform({8, 5}, 60, -1.f, 1.f, Device::cpu(1));
  Tensor labels = Tensor::from_ints({0, 1, 2, 0, 1, 2, 0, 1}, {8}, Device::cpu(1));
  Tensor l = Tensor::empty({1}, DType::f32, Device::cpu(1));
  Tensor dlogits = Tensor::empty({8, 3}, DType::f32, Device::cpu(1));
  std::vector<int64_t> allocations;
  for (int step = 0; step < 3; ++step) {
    const int64_t before = cached.memory()->allocations.load();
    m->zero_grad();
    Tensor out = m->forward(x);
    loss.compute(l, dlogits, out, labels);
    m->backward(dlogits);
    allocations.push_back(cached.memory()->allocations.load() - before);
  }
  CHECK(allocations[0] > 0);
  CHECK(allocations[1] == 0);
  CHECK(allocations[2] == 0);
  // And every step's tensors get the same blocks (what a captured step needs): a mask made anew
  // while the last one was held made the output's address alternate between two blocks.
  auto drop = materialized(make_shared<nn::Dropout>(0.3f), 5, Device::cpu(1));
  std::vector<const void*> ys, dxs;
  for (int step = 0; step < 4; ++step) {
    Tensor y = drop->forward(x);
    Tensor dx = drop->backward(x);
    ys.push_back(y.data<float>());
    dxs.push_back(dx.data<float>());
  }
  for (int step = 2; step < 4; ++step) {
    CAPTURE(step);
    CHECK(ys[step] == ys[1]);
    CHECK(dxs[step] == dxs[1]);
  }
}

TEST_CASE("nn.residual: a shape mismatch without projection throws") {
  auto m = materialized(make_shared<nn::Residual>(make_shared<nn::Linear>(4, 5)));
  CHECK_THROWS_WITH_AS(m->forward(uniform({2, 4}, 1)), doctest::Contains("projection"),
                       kernels::Error);
}

namespace {
// Linear with a deliberately wrong backward: the bias gradient is scaled by 1.05.
class BrokenLinear : public nn::Linear {
 public:
  BrokenLinear() : nn::Linear(3, 2) {}

 protected:
  Tensor backward_impl(const Tensor& dy) override {
    std::vector<float> before = host(bias()->grad);
    Tensor dx = nn::Linear::backward_impl(dy);
    std::vector<float> after = host(bias()->grad);
    for (size_t i = 0; i < after.size(); ++i) after[i] = before[i] + 1.05f * (after[i] - before[i]);
    nn::set_values(bias()->grad, after);
    return dx;
  }
};
}  // namespace

TEST_CASE("nn.gradcheck: a wrong backward fails, naming the parameter") {
  auto m = materialized(make_shared<BrokenLinear>());
  nn::GradcheckResult r = nn::gradcheck(*m, uniform({4, 3}, 1));
  INFO(r.message);
  CHECK(!r.ok);
  CHECK(r.worst.rfind("bias[", 0) == 0);
  CHECK(r.message.find("FAILED") != std::string::npos);
  CHECK(r.max_rel_error > 0.03);
  // Before the noise allowance the bias gradient is 1.05x the true one: 0.05 / 1.05 apart.
  CHECK(r.worst_raw_error >= r.max_rel_error);
  CHECK(r.worst_raw_error == doctest::Approx(0.05 / 1.05).epsilon(0.1));
  CHECK(r.message.find("apart before the noise allowance") != std::string::npos);
}

// ---- mixed precision (nn/amp.hpp) ------------------------------------------------------------

TEST_CASE(
    "nn.amp: GradScaler's rules: 2^16 first, halve and skip on inf or NaN, double after 2000") {
  nn::GradScaler fp16(nn::Precision::fp16);
  CHECK(fp16.scale() == 65536.f);
  fp16.update(false);
  CHECK(fp16.scale() == 32768.f);
  CHECK(fp16.skipped_steps() == 1);
  for (int i = 0; i < 1999; ++i) fp16.update(true);
  CHECK(fp16.scale() == 32768.f);
  fp16.update(false);  // a bad step resets the count of good ones
  CHECK(fp16.scale() == 16384.f);
  CHECK(fp16.state().growth_tracker == 0);
  for (int i = 0; i < 2000; ++i) fp16.update(true);
  CHECK(fp16.scale() == 32768.f);
  CHECK(fp16.skipped_steps() == 2);
  nn::GradScaler bf16(nn::Precision::bf16);  // checked, never scaled
  CHECK(bf16.enabled());
  bf16.update(false);
  CHECK(bf16.scale() == 1.f);
  CHECK(bf16.skipped_steps() == 1);
  CHECK_FALSE(nn::GradScaler(nn::Precision::fp32).enabled());
  CHECK_THROWS_WITH_AS(nn::parse_precision("fp8"),
                       doctest::Contains("--dtype fp8: choose fp32, tf32, bf16 or fp16"),
                       kernels::Error);
}

TEST_CASE("nn.amp: a bf16 Linear computes the f32 product of bf16-rounded weights and inputs") {
  auto round_bf16 = [](Tensor t) {
    Tensor r = kernels::cast(kernels::cast(t, DType::bf16), DType::f32);
    kernels::copy(t, r);
  };
  auto low = nn::mlp({6, 5}), ref = nn::mlp({6, 5});  // Flatten, Linear(6, 5)
  low->materialize(Device::cpu(), 3);
  ref->materialize(Device::cpu(), 3);
  low->set_compute_dtype(DType::bf16);
  // ref: f32 throughout, with its weight (not its bias: biases stay f32) and input pre-rounded.
  round_bf16(dynamic_cast<nn::Linear&>(*ref->children()[1].second).weight().value);
  Tensor x = Tensor::from_vector(dp_test::random_vector(4 * 6, 9), {4, 6});
  Tensor xr = x.clone();
  round_bf16(xr);
  // Rounding to bf16 is exact in f32, and the CPU widens 16-bit operands to f32: bit for bit.
  std::vector<float> got = low->forward(x).to_host_f32();
  CHECK(got == ref->forward(xr).to_host_f32());
  // An optimizer step changes the f32 masters; the next forward sees it (one cast per forward).
  nn::SGD opt(*low, kernels::SgdConfig{});
  kernels::fill(low->flat_grads(), 1.f);
  opt.step();
  std::vector<float> after = low->forward(x).to_host_f32();
  CHECK(after != got);
  std::vector<float> masters = low->flat_params().to_host_f32();
  std::vector<float> copy16 = low->flat().compute_params.to_host_f32();
  for (size_t i = 0; i < masters.size(); ++i)
    CHECK(copy16[i] == kernels::bf16_to_f32(kernels::f32_to_bf16(masters[i])));
}

TEST_CASE(
    "nn.amp: an overflowing fp16 step and a poisoned bf16 step are skipped, weights unchanged") {
  SUBCASE("fp16: a loss scale of 2^40 overflows f16; the scale halves per skipped step") {
    auto m = nn::mlp({6, 16, 5});
    m->materialize(Device::cpu(), 5);
    m->set_compute_dtype(DType::f16);
    nn::SGD opt(*m, kernels::SgdConfig{});
    nn::GradScalerOptions o = nn::GradScaler::options_for(nn::Precision::fp16);
    o.init_scale = std::ldexp(1.f, 40);
    nn::GradScaler scaler(o);
    auto before = m->flat_params().to_host_f32();
    auto [x, y] = dp_test::toy_batch(8, 1);
    dp_test::amp_step(*m, opt, scaler, x, y);
    CHECK(m->flat_params().to_host_f32() == before);
    CHECK(scaler.scale() == std::ldexp(1.f, 39));
    CHECK(scaler.skipped_steps() == 1);
    CHECK(opt.step_count() == 0);
  }
  SUBCASE("bf16: a NaN in the batch poisons the gradient; the step is skipped, scale stays 1") {
    auto m = nn::mlp({6, 16, 5});
    m->materialize(Device::cpu(), 5);
    m->set_compute_dtype(DType::bf16);
    nn::SGD opt(*m, kernels::SgdConfig{});
    nn::GradScaler scaler(nn::Precision::bf16);
    auto [x, y] = dp_test::toy_batch(8, 1);
    x.data<float>()[3] = std::nanf("");
    auto before = m->flat_params().to_host_f32();
    dp_test::amp_step(*m, opt, scaler, x, y);
    CHECK(m->flat_params().to_host_f32() == before);
    CHECK(scaler.scale() == 1.f);
    CHECK(scaler.skipped_steps() == 1);
    auto [x2, y2] = dp_test::toy_batch(8, 2);  // a clean batch steps again
    dp_test::amp_step(*m, opt, scaler, x2, y2);
    CHECK(m->flat_params().to_host_f32() != before);
    CHECK(opt.step_count() == 1);
  }
}

TEST_CASE("nn.input_grad: a model marked not_needed skips its first layers' input gradient") {
  struct Case {
    nn::ModulePtr (*make)();
    Shape x;
  };
  for (const Case& c :
       {Case{+[]() -> nn::ModulePtr {
               return nn::mlp({6, 8, 3});
             },
             {2, 6}},
        Case{+[]() -> nn::ModulePtr { return nn::lenet(1, 4, 12); }, {2, 1, 12, 12}}}) {
    auto full = materialized(c.make(), 7), lean = materialized(c.make(), 7);
    lean->set_input_grad(nn::InputGrad::not_needed);
    Tensor x = uniform(c.x, 3);
    Tensor y_full = full->forward(x);
    lean->forward(x);
    Tensor dy = uniform(y_full.shape(), 4);
    full->zero_grad();
    lean->zero_grad();
    CHECK(full->backward(dy).defined());
    CHECK_FALSE(lean->backward(dy).defined());
    // The parameter gradients are the same bits: only the unread product was skipped.
    CHECK(full->flat_grads().to_host_f32() == lean->flat_grads().to_host_f32());
    CHECK_FALSE(lean->clone_to(Device::cpu())->input_grad_needed());
  }
}
