// The arithmetic of gradient clipping by global norm, shared by the host (nn::clip_factor,
// ZeRO-1's shard clipping) and the clip_by_norm kernels, so that a norm and a factor computed on
// the device have the host's bits: IEEE double, round to nearest, no fused multiply-add.
#pragma once

#include <cmath>

#if !defined(DP_HOST_DEVICE)
#if defined(__CUDACC__)
#define DP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DP_HOST_DEVICE inline
#endif
#endif

namespace kernels::clip {

// The global 2-norm of a gradient from the f32 sum of squares of what the buffer holds, the
// gradient divided by `unscale` (1 / loss scale under fp16; 1 otherwise): sqrt(ss) * unscale.
DP_HOST_DEVICE double norm_from_sum_squares(float sum_squares, float unscale) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(__dsqrt_rn(static_cast<double>(sum_squares)), static_cast<double>(unscale));
#else
  return std::sqrt(static_cast<double>(sum_squares)) * static_cast<double>(unscale);
#endif
}

// The factor clipping multiplies the gradient by when its global norm is `norm`:
// min(1, max_norm / (norm + 1e-6)), PyTorch's, also for an infinite norm: 0 then. Such a norm
// is an infinite gradient (times 0 it is NaN, which the loss scaler's check skips, or fails
// visibly) or finite gradients whose f32 sum of squares overflowed (a norm above about 1.8e19:
// they become 0, PyTorch's outcome, not kept unclipped). 1 for a NaN norm: the gradient's NaN is
// left for the same check. requires max_norm > 0.
DP_HOST_DEVICE float factor(double norm, float max_norm) {
#if defined(__CUDA_ARCH__)
  if (isnan(norm) || norm <= static_cast<double>(max_norm)) return 1.f;
  return __double2float_rn(__ddiv_rn(static_cast<double>(max_norm), __dadd_rn(norm, 1e-6)));
#else
  if (std::isnan(norm) || norm <= static_cast<double>(max_norm)) return 1.f;
  return static_cast<float>(static_cast<double>(max_norm) / (norm + 1e-6));
#endif
}

}  // namespace kernels::clip
