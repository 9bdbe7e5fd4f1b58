// nn.activations.*: 16-bit activations (Module::set_activations): bf16 between the layers that
// keep it (Linear, Conv2d, ReLU, GELU, pooling, dropout, bias-add, LayerNorm), f32 at the model's
// output and through BatchNorm; gradients close to the f32-activation run. On the CPU the 16-bit
// ops widen to f32 and round once, which kernels.activations16 checks bit for bit.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/nn.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

namespace {

// Passes x and dy through, recording their dtypes.
class Probe : public nn::Module {
 public:
  explicit Probe(std::vector<DType>* seen) : seen_(seen) {}
  std::string type_name() const override { return "Probe"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    seen_->push_back(x.dtype());
    return x;
  }
  Tensor backward_impl(const Tensor& dy) override {
    seen_->push_back(dy.dtype());
    return dy;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<Probe>(seen_);
  }

 private:
  std::vector<DType>* seen_;
};

// Conv - ReLU - MaxPool - BatchNorm - Dropout - Flatten - Linear - GELU - Linear, with probes
// after the pooling (forward: its output; backward: the gradient reaching it), after the
// BatchNorm and after the GELU.
std::shared_ptr<nn::Sequential> probed_net(std::vector<DType>* seen) {
  auto net = std::make_shared<nn::Sequential>();
  net->add(std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1));
  net->add(std::make_shared<nn::ReLU>());
  net->add(std::make_shared<nn::MaxPool2d>(2));
  net->add(std::make_shared<Probe>(seen));
  net->add(std::make_shared<nn::BatchNorm2d>(4));
  net->add(std::make_shared<Probe>(seen));
  net->add(std::make_shared<nn::Dropout>(0.25f));
  net->add(std::make_shared<nn::Flatten>());
  net->add(std::make_shared<nn::Linear>(4 * 4 * 4, 16));
  net->add(std::make_shared<nn::GELU>());
  net->add(std::make_shared<Probe>(seen));
  net->add(std::make_shared<nn::Linear>(16, 3));
  return net;
}

Tensor input() {
  return Tensor::from_vector(dp_test::random_vector(2 * 1 * 8 * 8, 7, -1.f, 1.f), {2, 1, 8, 8});
}

}  // namespace

TEST_CASE("nn.activations: bf16 between layers, f32 through BatchNorm and at the output") {
  std::vector<DType> seen;
  auto net = probed_net(&seen);
  net->materialize(Device::cpu(0), 3);
  net->set_compute_dtype(DType::bf16);
  net->set_activations(nn::Activations::compute);
  CHECK(net->activation_dtype() == DType::bf16);
  Tensor y = net->forward(input());
  CHECK(y.dtype() == DType::f32);  // the loss reads f32
  CHECK(seen == std::vector<DType>{DType::bf16, DType::f32, DType::bf16});
  seen.clear();
  Tensor dy = Tensor::from_vector(std::vector<float>(6, 0.5f), {2, 3});
  Tensor dx = net->backward(dy);
  // backward meets the probes in reverse; each gradient takes its activation's dtype
  CHECK(seen == std::vector<DType>{DType::bf16, DType::f32, DType::bf16});
  CHECK(dx.dtype() == DType::f32);  // the input was f32
  for (float g : net->flat_grads().to_host_f32()) REQUIRE(std::isfinite(g));

  // f32 activations (the default) keep f32 everywhere, under the same bf16 compute dtype
  seen.clear();
  net->set_activations(nn::Activations::f32);
  net->forward(input());
  CHECK(seen == std::vector<DType>{DType::f32, DType::f32, DType::f32});
}

TEST_CASE(
    "nn.activations: bf16 activations give the f32-activation gradients within bf16 rounding") {
  auto grads = [](nn::Activations a) {
    std::vector<DType> seen;
    auto net = probed_net(&seen);
    net->materialize(Device::cpu(0), 11);
    net->set_compute_dtype(DType::bf16);
    net->set_activations(a);
    net->eval();  // no dropout: the same function both ways
    Tensor y = net->forward(input());
    Tensor dy = Tensor::from_vector(dp_test::random_vector(6, 5, -1.f, 1.f), {2, 3});
    net->backward(dy);
    return std::make_pair(y.to_host_f32(), net->flat_grads().to_host_f32());
  };
  auto [y16, g16] = grads(nn::Activations::compute);
  auto [y32, g32] = grads(nn::Activations::f32);
  // A few bf16 roundings (2^-8 relative each) along the way: 5% of the largest magnitude.
  auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    float scale = 0.f, worst = 0.f;
    for (size_t i = 0; i < a.size(); ++i) {
      scale = std::max(scale, std::fabs(b[i]));
      worst = std::max(worst, std::fabs(a[i] - b[i]));
    }
    CAPTURE(worst);
    CAPTURE(scale);
    return worst <= 0.05f * scale && scale > 0.f;
  };
  CHECK(close(y16, y32));
  CHECK(close(g16, g32));
  CHECK(y16 != y32);  // the activations really were rounded
}

TEST_CASE("nn.activations: replicas made by clone_to keep the activations setting") {
  std::vector<DType> seen;
  auto net = probed_net(&seen);
  net->materialize(Device::cpu(0), 3);
  net->set_compute_dtype(DType::bf16);
  net->set_activations(nn::Activations::compute);
  auto copy = net->clone_to(Device::cpu(1));
  CHECK(copy->activations() == nn::Activations::compute);
  copy->set_compute_dtype(DType::bf16);  // the engines set it again: the setting survives
  CHECK(copy->activation_dtype() == DType::bf16);
}

TEST_CASE("nn.activations: LayerNorm reads and writes bf16 without a cast, dx in x's dtype") {
  kernels::DeviceContext& ctx = kernels::context(Device::cpu(0));
  for (DType in : {DType::f32, DType::bf16}) {
    CAPTURE(std::string(dtype_name(in)));
    Tensor x = Tensor::from_vector(dp_test::random_vector(4 * 6, 9, -2.f, 2.f), {4, 6},
                                   Device::cpu(0), in);
    // The outermost forward casts the weights once, and its 16-bit output to f32 at the end:
    // call through a parent so that LayerNorm is an inner layer.
    auto net = std::make_shared<nn::Sequential>();
    net->add(std::make_shared<nn::LayerNorm>(6));
    std::vector<DType> seen;
    net->add(std::make_shared<Probe>(&seen));
    net->materialize(Device::cpu(0), 3);
    net->set_compute_dtype(DType::bf16);
    net->set_activations(nn::Activations::compute);
    const int64_t before = ctx.casts();
    Tensor y = net->forward(x);
    Tensor dx = net->backward(
        Tensor::from_vector(std::vector<float>(24, 0.25f), {4, 6}, Device::cpu(0), DType::bf16));
    CHECK(seen == std::vector<DType>{DType::bf16, DType::bf16});  // LN's output, and its dy
    CHECK(dx.dtype() == in);
    // the weights' copy and the model output's widening: LayerNorm itself converts nothing
    CHECK(ctx.casts() - before == 2);
  }
}
