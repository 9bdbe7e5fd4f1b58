// nn on a GPU: the same model on cuda:0 matches the CPU, gradchecks there, and its checkpoints
// load on the CPU. Every case skips visibly without a usable GPU.
#include <cmath>
#include <cstdio>
#include <memory>

#include <unistd.h>

#include "tests/amp_util.hpp"
#include "tests/nn_test_util.hpp"

using namespace nn_test;
using std::make_shared;

namespace {

// max |a - b| / max(1, max |b|): a relative error that does not blow up near zero.
double scaled_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 1;
  for (float v : b) m = std::max(m, static_cast<double>(std::fabs(v)));
  return kernels::max_abs_diff(a, b) / m;
}

std::shared_ptr<nn::Sequential> small_net() {
  return nn::sequential({make_shared<nn::Conv2d>(2, 4, 3, 1, 1), make_shared<nn::BatchNorm2d>(4),
                         make_shared<nn::ReLU>(), make_shared<nn::MaxPool2d>(2),
                         make_shared<nn::Conv2d>(4, 4, 3, 2, 1), make_shared<nn::GELU>(),
                         make_shared<nn::AvgPool2d>(2), make_shared<nn::Flatten>(),
                         make_shared<nn::Linear>(4, 6), make_shared<nn::LayerNorm>(6),
                         make_shared<nn::Tanh>(), make_shared<nn::Linear>(6, 3)});
}

}  // namespace

TEST_CASE("nn.cuda: a network on cuda:0 matches the CPU, forward, backward and step") {
  DP_REQUIRE_GPU();
  auto cpu = materialized(small_net(), 5);
  auto gpu = cpu->clone_to(Device::cuda(0));
  Tensor x = uniform({4, 2, 8, 8}, 1);
  Tensor t = Tensor::from_ints({0, 1, 2, 1}, {4});
  nn::CrossEntropyLoss ce_cpu, ce_gpu;
  Tensor loss_cpu = ce_cpu.forward(cpu->forward(x), t);
  Tensor loss_gpu = ce_gpu.forward(gpu->forward(x.to(Device::cuda(0))), t.to(Device::cuda(0)));
  CHECK(loss_gpu.item() == doctest::Approx(loss_cpu.item()).epsilon(1e-4));
  std::vector<float> dx_cpu = host(cpu->backward(ce_cpu.backward()));
  std::vector<float> dx_gpu = host(gpu->backward(ce_gpu.backward()));
  CHECK(scaled_diff(dx_gpu, dx_cpu) < 1e-4);
  CHECK(scaled_diff(host(gpu->flat_grads()), host(cpu->flat_grads())) < 1e-4);
  CHECK(scaled_diff(host(gpu->flat_buffers()), host(cpu->flat_buffers())) < 1e-5);

  // The step from the same gradients: AdamW's first step is lr * sign(g), so gradients that
  // differ by rounding near zero would flip whole steps and test the rounding, not the step.
  kernels::copy(gpu->flat_grads(), cpu->flat_grads());
  kernels::AdamWConfig c;
  nn::AdamW opt_cpu(*cpu, c), opt_gpu(*gpu, c);
  opt_cpu.step();
  opt_gpu.step();
  CHECK(scaled_diff(host(gpu->flat_params()), host(cpu->flat_params())) < 1e-5);
}

TEST_CASE("nn.cuda: gradcheck on the GPU") {
  DP_REQUIRE_GPU();
  const Device d = Device::cuda(0);
  auto mlp =
      materialized(nn::sequential({make_shared<nn::Linear>(5, 6), make_shared<nn::Tanh>(),
                                   make_shared<nn::LayerNorm>(6), make_shared<nn::Linear>(6, 3)}),
                   1, d);
  check_grads(*mlp, uniform({4, 5}, 2, -1.f, 1.f, d));
  auto conv = materialized(
      nn::sequential({make_shared<nn::Conv2d>(2, 3, 3, 2, 1), make_shared<nn::BatchNorm2d>(3),
                      make_shared<nn::GlobalAvgPool>()}),
      1, d);
  check_grads(*conv, uniform({3, 2, 6, 6}, 3, -1.f, 1.f, d));
  auto drop = materialized(make_shared<nn::Dropout>(0.3f), 1, d);
  check_grads(*drop, uniform({4, 8}, 4, -1.f, 1.f, d));
}

// Llama's layers on the GPU (kernels/cuda/llama_ops.cu, cuDNN or the plain attention): the
// model's logits, loss and gradients follow the CPU's; its rotary tables are made on the GPU.
TEST_CASE("nn.cuda: a Llama on cuda:0 matches the CPU, forward and backward") {
  DP_REQUIRE_GPU();
  nn::LlamaConfig c;
  c.vocab = 11, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  auto cpu = materialized(nn::llama(c), 5);
  auto gpu = cpu->clone_to(Device::cuda(0));
  for (auto& [name, k] : gpu->named_constants()) CHECK(k->value.device() == Device::cuda(0));
  std::vector<int32_t> id_values;
  for (int i = 0; i < 2 * 7; ++i) id_values.push_back((i * 5 + 3) % 11);
  Tensor ids = Tensor::from_ints(id_values, {2, 7});
  nn::TokenCrossEntropyLoss loss_fn;
  auto step = [&](nn::Module& m) {
    const Device d = m.device();
    Tensor logits = m.forward(ids.to(d));
    Tensor loss = Tensor::empty({1}, DType::f32, d);
    Tensor dl = Tensor::empty(logits.shape(), DType::f32, d);
    loss_fn.compute(loss, dl, logits, ids.to(d));
    m.backward(dl);
    return std::make_pair(host(logits), loss.item());
  };
  auto [logits_cpu, loss_cpu] = step(*cpu);
  auto [logits_gpu, loss_gpu] = step(*gpu);
  CHECK(scaled_diff(logits_gpu, logits_cpu) < 1e-4);
  CHECK(loss_gpu == doctest::Approx(loss_cpu).epsilon(1e-4));
  CHECK(scaled_diff(host(gpu->flat_grads()), host(cpu->flat_grads())) < 1e-4);
  nn::GradcheckOptions o;
  o.check_input = nn::CheckInput::no;
  auto on_gpu = materialized(nn::llama(c), 3, Device::cuda(0));
  check_grads(*on_gpu, ids.to(Device::cuda(0)), o);
}

TEST_CASE("nn.cuda: a composed Llama (autograd) on cuda:0 matches the CPU, warm steps replay") {
  DP_REQUIRE_GPU();
  nn::LlamaConfig c;
  c.vocab = 11, c.context = 8, c.layers = 2, c.heads = 2, c.dim = 16, c.hidden = 24;
  c.composed = true;
  auto cpu = materialized(nn::llama(c), 5);
  auto gpu = cpu->clone_to(Device::cuda(0));
  std::vector<int32_t> id_values;
  for (int i = 0; i < 2 * 7; ++i) id_values.push_back((i * 5 + 3) % 11);
  Tensor ids = Tensor::from_ints(id_values, {2, 7});
  nn::TokenCrossEntropyLoss loss_fn;
  auto step = [&](nn::Module& m) {
    const Device d = m.device();
    m.zero_grad();
    Tensor logits = m.forward(ids.to(d));
    Tensor loss = Tensor::empty({1}, DType::f32, d);
    Tensor dl = Tensor::empty(logits.shape(), DType::f32, d);
    loss_fn.compute(loss, dl, logits, ids.to(d));
    m.backward(dl);
    return std::make_pair(host(logits), loss.item());
  };
  for (int rep = 0; rep < 2; ++rep) {  // the tapes recorded, then replayed
    CAPTURE(rep);
    auto [logits_cpu, loss_cpu] = step(*cpu);
    auto [logits_gpu, loss_gpu] = step(*gpu);
    CHECK(scaled_diff(logits_gpu, logits_cpu) < 1e-4);
    CHECK(loss_gpu == doctest::Approx(loss_cpu).epsilon(1e-4));
    CHECK(scaled_diff(host(gpu->flat_grads()), host(cpu->flat_grads())) < 1e-4);
  }
  nn::GradcheckOptions o;
  o.check_input = nn::CheckInput::no;
  auto on_gpu = materialized(nn::llama(c), 3, Device::cuda(0));
  check_grads(*on_gpu, ids.to(Device::cuda(0)), o);
}

TEST_CASE("nn.cuda: a checkpoint saved from the GPU loads on the CPU") {
  DP_REQUIRE_GPU();
  const std::string path = "/tmp/nn_test_" + std::to_string(::getpid()) + "_gpu.ckpt";
  auto gpu = materialized(small_net(), 3, Device::cuda(0));
  nn::save_checkpoint(*gpu, path);
  auto cpu = materialized(small_net(), 4);
  nn::load_checkpoint(*cpu, path);
  CHECK(host(cpu->flat_params()) == host(gpu->flat_params()));
  CHECK(host(cpu->flat_buffers()) == host(gpu->flat_buffers()));
  std::remove(path.c_str());
}

TEST_CASE("nn.cuda.amp: bf16 and fp16 steps on cuda:0 follow the CPU within the rounding bound") {
  DP_REQUIRE_GPU();
  for (DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(std::string(kernels::dtype_name(dtype)));
    const nn::Precision p = dtype == DType::bf16 ? nn::Precision::bf16 : nn::Precision::fp16;
    auto cpu = nn::mlp({6, 64, 64, 5});
    cpu->materialize(Device::cpu(), 11);
    auto gpu = cpu->clone_to(Device::cuda(0));
    cpu->set_compute_dtype(dtype);
    gpu->set_compute_dtype(dtype);
    kernels::SgdConfig c;
    c.lr = 0.1f;
    nn::SGD cpu_opt(*cpu, c), gpu_opt(*gpu, c);
    nn::GradScaler cpu_scaler(p), gpu_scaler(p);
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = dp_test::toy_batch(32, 40 + s);
      // Both within the bound of the CPU's f32 forward of its masters (derived in amp_util).
      const double bound = 2 * dp_test::mixed_precision_loss_bound(*cpu, x, dtype);
      float lc = dp_test::amp_step(*cpu, cpu_opt, cpu_scaler, x, y);
      float lg = dp_test::amp_step(*gpu, gpu_opt, gpu_scaler, x, y);
      CAPTURE(s);
      CHECK(std::fabs(lc - lg) <= bound);
    }
    CHECK(gpu_scaler.skipped_steps() == 0);
    CHECK(gpu_scaler.scale() == cpu_scaler.scale());
  }
}

// 16-bit activations on the GPU: the same network (convolutions, pooling, BatchNorm, LayerNorm,
// every activation) with bf16 between layers gives the CPU's output and gradients within a few
// bf16 roundings (5% of the largest magnitude), and the output reaches the loss as f32.
TEST_CASE("nn.cuda.amp: bf16 activations on cuda:0 follow the CPU") {
  DP_REQUIRE_GPU();
  auto cpu = materialized(small_net(), 9);
  cpu->eval();  // batch statistics of 4 rows in bf16 would only add noise to the comparison
  auto gpu = cpu->clone_to(Device::cuda(0));
  for (nn::Module* m : {static_cast<nn::Module*>(cpu.get()), static_cast<nn::Module*>(gpu.get())}) {
    m->set_compute_dtype(DType::bf16);
    m->set_activations(nn::Activations::compute);
  }
  Tensor x = uniform({4, 2, 8, 8}, 3);
  Tensor yc = cpu->forward(x), yg = gpu->forward(x.to(Device::cuda(0)));
  CHECK(yg.dtype() == DType::f32);
  CHECK(scaled_diff(yg.to_host_f32(), yc.to_host_f32()) <= 0.05);
  Tensor dy = uniform({4, 3}, 4);
  cpu->backward(dy);
  gpu->backward(dy.to(Device::cuda(0)));
  CHECK(scaled_diff(gpu->flat_grads().to_host_f32(), cpu->flat_grads().to_host_f32()) <= 0.05);
}

TEST_CASE(
    "nn.cuda.amp: an fp16 network with convolutions trains on cuda:0, an overflow is skipped") {
  DP_REQUIRE_GPU();
  auto gpu = materialized(small_net(), 5)->clone_to(Device::cuda(0));
  gpu->set_compute_dtype(DType::f16);
  nn::SGD opt(*gpu, kernels::SgdConfig{});
  nn::GradScalerOptions o = nn::GradScaler::options_for(nn::Precision::fp16);
  o.init_scale = std::ldexp(1.f, 40);  // f16 overflows at once
  nn::GradScaler scaler(o);
  Tensor x = uniform({4, 2, 8, 8}, 1);
  Tensor t = Tensor::from_ints({0, 1, 2, 1}, {4});
  auto before = gpu->flat_params().to_host_f32();
  dp_test::amp_step(*gpu, opt, scaler, x, t);
  CHECK(scaler.skipped_steps() == 1);
  CHECK(gpu->flat_params().to_host_f32() == before);
  for (int s = 0; s < 40 && scaler.skipped_steps() == s + 1; ++s)
    dp_test::amp_step(*gpu, opt, scaler, x, t);  // halves until f16 holds the gradient
  CHECK(scaler.scale() < std::ldexp(1.f, 30));
  float first = dp_test::amp_step(*gpu, opt, scaler, x, t), last = first;
  for (int s = 0; s < 20; ++s) last = dp_test::amp_step(*gpu, opt, scaler, x, t);
  CHECK(std::isfinite(last));
  CHECK(last < first);  // it trains
  CHECK(gpu->flat_params().to_host_f32() != before);
}
