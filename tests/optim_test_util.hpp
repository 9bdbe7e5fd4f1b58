// One-off optimizer updates for the kernel suites: the host scalars of step t written into a
// fresh scalars tensor (set_values), then the update that reads them, as nn::Optimizer's
// prepare_step() and apply_step() do it. Allocates: for tests, not for a training loop.
#pragma once

#include "kernels/ops.hpp"

namespace dp_test {

inline kernels::Tensor scalars_tensor(const float* values, int n, kernels::Device d) {
  kernels::Tensor s = kernels::Tensor::zeros({kernels::kMaxValues}, kernels::DType::f32, d);
  kernels::set_values(s, values, n);
  return s;
}

inline void sgd_step(kernels::Tensor& params, const kernels::Tensor& grads,
                     kernels::Tensor& momentum_buf, const kernels::SgdConfig& c, int64_t step) {
  const auto s = kernels::sgd_scalars(c, step);
  kernels::sgd_update(params, grads, momentum_buf, c,
                      scalars_tensor(s.data(), static_cast<int>(s.size()), params.device()));
}

inline void adamw_step(kernels::Tensor& params, const kernels::Tensor& grads, kernels::Tensor& m,
                       kernels::Tensor& v, const kernels::AdamWConfig& c, int64_t step) {
  const auto s = kernels::adamw_scalars(c, kernels::single_group(c), step);
  kernels::adamw_update(params, grads, m, v, c,
                        scalars_tensor(s.data(), static_cast<int>(s.size()), params.device()));
}

}  // namespace dp_test
