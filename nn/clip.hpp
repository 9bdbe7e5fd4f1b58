// Gradient clipping by global norm (PyTorch's clip_grad_norm_ with the 2-norm) on a flat
// gradient buffer: one reduction into a device scalar, then one kernel that computes the norm
// and the factor on the device and scales when the norm is too large (no host read). The engines
// clip where the gradient is whole: device 0 after the DP reduce, every rank after the DDP
// all-reduce, and under ZeRO-1 each rank's shard with the norm from one all-reduce of the
// shards' squared norms (clip_factor).
#pragma once

#include <cmath>

#include "kernels/clip_norm.hpp"
#include "nn/module.hpp"

namespace nn {

// The factor clipping multiplies the gradient by when its global norm is `norm`:
// min(1, max_norm / (norm + 1e-6)), PyTorch's (0 for an infinite norm, 1 for a NaN one:
// kernels/clip_norm.hpp says why). requires max_norm > 0. The device computes the same bits.
inline float clip_factor(double norm, float max_norm) {
  return kernels::clip::factor(norm, max_norm);
}

// Sum of squares of x (f32), read to the host (waits).
inline double squared_norm(const Tensor& x) {
  Tensor out = Tensor::empty({1}, DType::f32, x.device());
  kernels::sum_squares(out, x);
  return static_cast<double>(out.item());
}

// requires grads f32 on one device, norm_out (1) f32 on that device, max_norm finite and > 0;
// grads hold the gradient divided by `unscale` (the loss scale under fp16: grad_unscale =
// 1 / scale; 1 otherwise), fixed or read on the device when the clip runs (a captured step's).
// ensures, queued on the device (no host read, nothing allocated: norm_out holds the sum of
// squares in between): norm_out = the global 2-norm of grads * unscale (the gradient the
// optimizer sees), and grads scaled by clip_factor(norm, max_norm).
inline void clip_grad_norm_into(Tensor& grads, float max_norm, kernels::Scalar unscale,
                                Tensor& norm_out) {
  DP_CHECK(max_norm > 0.f && std::isfinite(max_norm),
           "clip_grad_norm: max_norm " << max_norm << " must be finite and > 0");
  kernels::NvtxRange range("clip_grad_norm");
  kernels::sum_squares(norm_out, grads);
  kernels::clip_by_norm(grads, norm_out, norm_out, max_norm, unscale);
}

// clip_grad_norm_into, and returns the norm (one host read).
inline float clip_grad_norm(Tensor& grads, float max_norm, float unscale = 1.f) {
  Tensor norm = Tensor::empty({1}, DType::f32, grads.device());
  clip_grad_norm_into(grads, max_norm, unscale, norm);
  return norm.item();
}

}  // namespace nn
