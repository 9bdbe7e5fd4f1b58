// The single-device reference the DP and DDP suites compare against.
#pragma once

#include <vector>

#include "nn/nn.hpp"
#include "tests/test_util.hpp"

namespace dp_test {

// One step on one device: zero_grad, forward, fused softmax cross-entropy over the whole
// batch, backward, optimizer step. Returns the batch's mean loss.
inline float single_step(nn::Module& m, nn::Optimizer& opt, const kernels::Tensor& x,
                         const kernels::Tensor& y) {
  kernels::Device d = m.device();
  m.zero_grad();
  kernels::Tensor out = m.forward(x.to(d));
  kernels::Tensor loss = kernels::Tensor::empty({1}, kernels::DType::f32, d);
  kernels::Tensor dlogits = kernels::Tensor::empty(out.shape(), kernels::DType::f32, d);
  kernels::softmax_cross_entropy(loss, dlogits, out, y.to(d));
  m.backward(dlogits);
  opt.step();
  return loss.item();
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

}  // namespace dp_test
