// The kernels of Llama's layers on CUDA: RMSNorm (one block per row; the gain gradient by the
// deterministic column sums of cuda_common.cuh), SwiGLU's gate and rotary embeddings
// (elementwise, grid-stride). Activations f32, f16 or bf16 (with_storage): read as f32, each
// stored value rounded once. Mirrors kernels/cpu/llama_ops.cpp.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

template <class Y, class X>
__global__ void rms_forward_kernel(Y* y, float* save_rstd, const X* x, const float* gamma,
                                   int64_t d, float eps) {
  const int64_t row = blockIdx.x;
  const X* xr = x + row * d;
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = to_float(xr[j]);
    sq += v * v;
  }
  const float rstd = rsqrtf(block_reduce_sum(sq) / static_cast<float>(d) + eps);
  if (threadIdx.x == 0) save_rstd[row] = rstd;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    y[row * d + j] = from_float<Y>(to_float(xr[j]) * rstd * gamma[j]);
}

// dx = rstd (g - x rstd^2 mean(g x)), g = dy gamma.
template <class DX, class DY, class X>
__global__ void rms_backward_dx_kernel(DX* dx, const DY* dy, const X* x, const float* gamma,
                                       const float* save_rstd, int64_t d) {
  const int64_t row = blockIdx.x;
  const X* xr = x + row * d;
  const DY* dyr = dy + row * d;
  const float rstd = save_rstd[row];
  float sum_gx = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    sum_gx += to_float(dyr[j]) * gamma[j] * to_float(xr[j]);
  const float k = rstd * rstd * block_reduce_sum(sum_gx) / static_cast<float>(d);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    dx[row * d + j] = from_float<DX>(rstd * (to_float(dyr[j]) * gamma[j] - to_float(xr[j]) * k));
}

// dgamma's column-sum operand: dy x rstd.
template <class DY, class X>
struct DyTimesXRstd {
  const DY* dy;
  const X* x;
  const float* rstd;
  int64_t d;
  __device__ float operator()(int64_t r, int64_t c) const {
    return to_float(dy[r * d + c]) * to_float(x[r * d + c]) * rstd[r];
  }
};

__device__ __forceinline__ float sigmoid(float a) {
  return 1.f / (1.f + expf(-a));
}

template <class Y, class H>
__global__ void swiglu_forward_kernel(Y* y, const H* h, int64_t n, int64_t width) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const int64_t r = i / width, j = i % width;
    const float a = to_float(h[r * 2 * width + j]), b = to_float(h[r * 2 * width + width + j]);
    y[i] = from_float<Y>(a * sigmoid(a) * b);
  }
}

template <class DH, class DY, class H>
__global__ void swiglu_backward_kernel(DH* dh, const DY* dy, const H* h, int64_t n, int64_t width) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const int64_t r = i / width, j = i % width;
    const int64_t ia = r * 2 * width + j, ib = ia + width;
    const float a = to_float(h[ia]), b = to_float(h[ib]), g = to_float(dy[i]);
    const float s = sigmoid(a);
    dh[ia] = from_float<DH>(g * b * (s * (1.f + a * (1.f - s))));
    dh[ib] = from_float<DH>(g * (a * s));
  }
}

// One thread per rotated pair: n = rows * heads * half.
template <class X>
__global__ void rotary_kernel(X* x, const float* cos, const float* sin, int64_t n, int64_t steps,
                              int64_t width, int64_t heads, int64_t half, float sign) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const int64_t j = i % half, hd = (i / half) % heads, row = i / (half * heads);
    const int64_t t = row % steps;
    X* v = x + row * width + hd * 2 * half;
    const float c = cos[t * half + j], s = sign * sin[t * half + j];
    const float x1 = to_float(v[j]), x2 = to_float(v[j + half]);
    v[j] = from_float<X>(x1 * c - x2 * s);
    v[j + half] = from_float<X>(x2 * c + x1 * s);
  }
}

}  // namespace

void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma, float eps,
                      DeviceContext& ctx) {
  NvtxRange range("kernels/rms_norm_forward");
  require_f32("rms_norm_forward", {&save_rstd, &gamma});
  require_floating("rms_norm_forward", {&y, &x});
  const int64_t d = gamma.numel(), rows = d == 0 ? 0 : x.numel() / d;
  if (rows == 0) return;
  with_storage(
      [&](auto y_t, auto x_t) {
        rms_forward_kernel<<<static_cast<unsigned>(rows), row_block_threads(d), 0,
                             stream_of(ctx)>>>(y.data<decltype(y_t)>(), save_rstd.data<float>(),
                                               x.data<decltype(x_t)>(), gamma.data<float>(), d,
                                               eps);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc,
                       DeviceContext& ctx) {
  NvtxRange range("kernels/rms_norm_backward");
  require_f32("rms_norm_backward", {&dgamma, &gamma, &save_rstd});
  require_floating("rms_norm_backward", {&dx, &dy, &x});
  const int64_t d = gamma.numel(), rows = d == 0 ? 0 : x.numel() / d;
  if (d == 0) return;
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t) {
        using DY = decltype(dy_t);
        using X = decltype(x_t);
        if (rows > 0) {
          rms_backward_dx_kernel<<<static_cast<unsigned>(rows), row_block_threads(d), 0, s>>>(
              dx.data<decltype(dx_t)>(), dy.data<DY>(), x.data<X>(), gamma.data<float>(),
              save_rstd.data<float>(), d);
          DP_CUDA_CHECK_LAUNCH();
        }
        auto* scratch =
            static_cast<float*>(ctx.workspace(sizeof(float) * column_sum_chunks(rows) * d));
        launch_column_sums(
            dgamma.data<float>(), rows, d,
            DyTimesXRstd<DY, X>{dy.data<DY>(), x.data<X>(), save_rstd.data<float>(), d},
            acc == Accumulate::yes, scratch, s);
      },
      dx.dtype(), dy.dtype(), x.dtype());
}

void swiglu_forward(Tensor& y, const Tensor& h, DeviceContext& ctx) {
  NvtxRange range("kernels/swiglu_forward");
  require_floating("swiglu_forward", {&y, &h});
  const int64_t n = y.numel(), width = y.dim(1);
  with_storage(
      [&](auto y_t, auto h_t) {
        swiglu_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), h.data<decltype(h_t)>(), n, width);
      },
      y.dtype(), h.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h, DeviceContext& ctx) {
  NvtxRange range("kernels/swiglu_backward");
  require_floating("swiglu_backward", {&dh, &dy, &h});
  const int64_t n = dy.numel(), width = dy.dim(1);
  with_storage(
      [&](auto dh_t, auto dy_t, auto h_t) {
        swiglu_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            dh.data<decltype(dh_t)>(), dy.data<decltype(dy_t)>(), h.data<decltype(h_t)>(), n,
            width);
      },
      dh.dtype(), dy.dtype(), h.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation, DeviceContext& ctx) {
  NvtxRange range("kernels/rotary_embedding");
  require_floating("rotary_embedding", {&x});
  require_f32("rotary_embedding", {&cos, &sin});
  const int64_t half = head_dim / 2, heads = columns / head_dim;
  const int64_t n = x.dim(0) * x.dim(1) * heads * half;
  const float sign = rotation == Rotation::forward ? 1.f : -1.f;
  with_storage(
      [&](auto x_t) {
        rotary_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            x.data<decltype(x_t)>(), cos.data<float>(), sin.data<float>(), n, x.dim(1), x.dim(2),
            heads, half, sign);
      },
      x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
