// Gradient clipping by global norm from a sum of squares left on the device: the norm and the
// factor are computed by the kernels (kernels/clip_norm.hpp, the host's arithmetic), so
// clipping needs no host read.
#include "kernels/clip_norm.hpp"
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

// g *= factor, with factor = clip::factor(norm from *ss); nothing is written when it is 1.
__global__ void clip_scale_kernel(float* g, const float* ss, float max_norm, ScalarArg unscale,
                                  int64_t n) {
  __shared__ float factor;
  if (threadIdx.x == 0)
    factor = clip::factor(clip::norm_from_sum_squares(*ss, unscale.get()), max_norm);
  __syncthreads();
  if (factor == 1.f) return;
  DP_GRID_STRIDE_LOOP(i, n) g[i] = factor * g[i];
}

__global__ void clip_norm_kernel(float* norm_out, const float* ss, ScalarArg unscale) {
  *norm_out = __double2float_rn(clip::norm_from_sum_squares(*ss, unscale.get()));
}

}  // namespace

void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar scalar, DeviceContext& ctx) {
  const ScalarArg unscale = ScalarArg::of(scalar);
  NvtxRange range("kernels/clip_by_norm");
  require_f32("clip_by_norm", {&grads, &norm_out, &sum_squares});
  cudaStream_t s = stream_of(ctx);
  const int64_t n = grads.numel();
  // The scale first, the norm after it on the stream: norm_out may alias sum_squares.
  if (n > 0) {
    clip_scale_kernel<<<blocks_for(n), kThreads, 0, s>>>(
        grads.data<float>(), sum_squares.data<float>(), max_norm, unscale, n);
    DP_CUDA_CHECK_LAUNCH();
  }
  clip_norm_kernel<<<1, 1, 0, s>>>(norm_out.data<float>(), sum_squares.data<float>(), unscale);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
