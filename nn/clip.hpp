// Gradient clipping by global norm (PyTorch's clip_grad_norm_ with the 2-norm) on a flat
// gradient buffer: one reduction, one read of the norm, and one scale when it is too large.
// The engines clip where the gradient is whole: device 0 after the DP reduce, every rank after
// the DDP all-reduce, and under ZeRO-1 each rank's shard with the norm from one all-reduce of
// the shards' squared norms (clip_factor).
#pragma once

#include <cmath>

#include "nn/module.hpp"

namespace nn {

// The factor clipping multiplies the gradient by when its global norm is `norm`:
// min(1, max_norm / (norm + 1e-6)), PyTorch's; 1 for a non-finite norm (the loss scaler skips
// that step, or it fails visibly). requires max_norm > 0.
inline float clip_factor(double norm, float max_norm) {
  if (!std::isfinite(norm) || norm <= static_cast<double>(max_norm)) return 1.f;
  return static_cast<float>(static_cast<double>(max_norm) / (norm + 1e-6));
}

// Sum of squares of x (f32), read to the host (waits).
inline double squared_norm(const Tensor& x) {
  Tensor out = Tensor::empty({1}, DType::f32, x.device());
  kernels::sum_squares(out, x);
  return static_cast<double>(out.item());
}

// requires grads f32 on one device, max_norm > 0; grads hold the gradient divided by `unscale`
// (the loss scale under fp16: grad_unscale = 1 / scale; 1 otherwise).
// ensures returns the global 2-norm of grads * unscale (the gradient the optimizer sees), and
// scales grads by clip_factor(norm, max_norm).
inline float clip_grad_norm(Tensor& grads, float max_norm, float unscale = 1.f) {
  DP_CHECK(max_norm > 0.f && std::isfinite(max_norm),
           "clip_grad_norm: max_norm " << max_norm << " must be finite and > 0");
  kernels::NvtxRange range("clip_grad_norm");
  const double norm = std::sqrt(squared_norm(grads)) * static_cast<double>(unscale);
  const float factor = clip_factor(norm, max_norm);
  if (factor != 1.f) kernels::scale(grads, grads, factor);
  return static_cast<float>(norm);
}

}  // namespace nn
