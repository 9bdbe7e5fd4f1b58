// The single-device reference the DP and DDP suites compare against.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "nn/nn.hpp"
#include "tests/test_util.hpp"

namespace dp_test {

// Linear(6, 32), ReLU, Dropout(0.3), Linear(32, 5): an MLP of toy_batch's shapes whose steps
// draw random numbers (what a bit-exact resume must restore).
inline nn::ModulePtr dropout_mlp() {
  auto s = std::make_shared<nn::Sequential>();
  s->add(std::make_shared<nn::Linear>(6, 32));
  s->add(std::make_shared<nn::ReLU>());
  s->add(std::make_shared<nn::Dropout>(0.3f));
  s->add(std::make_shared<nn::Linear>(32, 5));
  return s;
}

// SGD at learning rate 0.1 with momentum 0.9: the engines' suites' recipe.
inline kernels::SgdConfig momentum_sgd() {
  kernels::SgdConfig c;
  c.lr = 0.1f;
  c.momentum = 0.9f;
  return c;
}

// One step on one device under `scaler`: zero_grad, forward, fused softmax cross-entropy over
// the whole batch, the loss scale into its gradient, backward, then the scaler's check and
// (unscaled) optimizer step or skip. Returns the batch's mean loss.
inline float amp_step(nn::Module& m, nn::Optimizer& opt, nn::GradScaler& scaler,
                      const kernels::Tensor& x, const kernels::Tensor& y) {
  kernels::Device d = m.device();
  m.zero_grad();
  kernels::Tensor out = m.forward(x.to(d));
  kernels::Tensor loss = kernels::Tensor::empty({1}, kernels::DType::f32, d);
  kernels::Tensor dlogits = kernels::Tensor::empty(out.shape(), kernels::DType::f32, d);
  kernels::softmax_cross_entropy(loss, dlogits, out, y.to(d));
  scaler.scale_loss_grad(dlogits);
  m.backward(dlogits);
  scaler.step(opt, m.flat_grads());
  return loss.item();
}

// The same in f32: the scaler is off (scale 1, no check), so the optimizer always steps.
inline float single_step(nn::Module& m, nn::Optimizer& opt, const kernels::Tensor& x,
                         const kernels::Tensor& y) {
  nn::GradScaler off(nn::Precision::fp32);
  return amp_step(m, opt, off, x, y);
}

// Materialises `m` on cpu:0 from `seed` and trains it on toy batches 100, 101, ... of `batch`
// rows with SGD. Returns the flat parameters; `losses` (if given) gets each step's loss.
inline std::vector<float> train_single(nn::ModulePtr m, uint64_t seed, int steps, int64_t batch,
                                       kernels::SgdConfig cfg,
                                       std::vector<float>* losses = nullptr) {
  m->materialize(kernels::Device::cpu(0), seed);
  nn::SGD opt(*m, cfg);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = toy_batch(batch, 100 + s);
    float l = single_step(*m, opt, x, y);
    if (losses) losses->push_back(l);
  }
  return m->flat_params().to_host_f32();
}

// Step s's image batch: (batch, 1, 8, 8) and labels in [0, 10).
inline std::pair<kernels::Tensor, kernels::Tensor> image_batch(int64_t batch, int s) {
  kernels::Tensor x =
      kernels::Tensor::from_vector(random_vector(batch * 64, 300 + s), {batch, 1, 8, 8});
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) y[i] = static_cast<int32_t>((i * 7 + s) % 10);
  return {x, kernels::Tensor::from_ints(y, {batch})};
}

// A layer that throws from forward on one chosen device while `armed` is set (failure tests).
class Faulty : public nn::Module {
 public:
  // Where it throws: in forward, or in backward (after the layers behind it had theirs).
  enum class Pass { forward, backward };
  Faulty(kernels::Device victim, std::shared_ptr<std::atomic<bool>> armed,
         Pass pass = Pass::forward)
      : victim_(victim), armed_(std::move(armed)), pass_(pass) {}
  std::string type_name() const override { return "Faulty"; }

 protected:
  kernels::Tensor forward_impl(const kernels::Tensor& x) override {
    throw_if(Pass::forward, x);
    return x;
  }
  kernels::Tensor backward_impl(const kernels::Tensor& dy) override {
    throw_if(Pass::backward, dy);
    return dy;
  }
  std::shared_ptr<nn::Module> clone_config() const override {
    return std::make_shared<Faulty>(victim_, armed_, pass_);
  }

 private:
  void throw_if(Pass pass, const kernels::Tensor& t) const {
    if (pass == pass_ && *armed_ && t.device() == victim_) throw kernels::Error("injected fault");
  }

  kernels::Device victim_;
  std::shared_ptr<std::atomic<bool>> armed_;
  Pass pass_;
};

}  // namespace dp_test
