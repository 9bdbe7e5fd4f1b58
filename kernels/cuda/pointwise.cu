// The ops small custom layers are built from (f32): a and b combined with b broadcast over the
// leading dims of a (also f16/bf16, computed in f32: with_storage), the reduction that is its
// gradient, sigmoid and exp. Formulas and sum order mirror kernels/cpu/pointwise.cpp.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

struct Add {
  __device__ float operator()(float u, float v) const { return u + v; }
};
struct Mul {
  __device__ float operator()(float u, float v) const { return u * v; }
};

// y[r, j] = f(a[r, j], b[j]) for a viewed as (rows, inner).
template <class Y, class A, class B, class F>
__global__ void broadcast_trailing_kernel(Y* y, const A* a, const B* b, int64_t n, int64_t inner,
                                          F f) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(f(to_float(a[i]), to_float(b[i % inner])));
}

// out[j] (+)= sum over r of x[r, j]: one thread per column, rows in order, in double (the CPU's
// order and accumulator).
__global__ void sum_leading_kernel(float* out, const float* x, int64_t rows, int64_t inner,
                                   bool accumulate) {
  DP_GRID_STRIDE_LOOP(j, inner) {
    double s = 0.0;
    for (int64_t r = 0; r < rows; ++r) s += x[r * inner + j];
    out[j] = accumulate ? out[j] + static_cast<float>(s) : static_cast<float>(s);
  }
}

__global__ void sigmoid_kernel(float* y, const float* x, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const float v = x[i];
    if (v >= 0.f) {
      y[i] = 1.f / (1.f + expf(-v));
    } else {
      const float e = expf(v);
      y[i] = e / (1.f + e);
    }
  }
}

__global__ void sigmoid_backward_kernel(float* dx, const float* dy, const float* y, int64_t n,
                                        bool accumulate) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const float g = dy[i] * y[i] * (1.f - y[i]);
    dx[i] = accumulate ? dx[i] + g : g;
  }
}

__global__ void exp_kernel(float* y, const float* x, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = expf(x[i]);
}

template <class F>
void launch_broadcast(const char* op, Tensor& y, const Tensor& a, const Tensor& b, F f,
                      DeviceContext& ctx) {
  NvtxRange range(op);
  require_floating(op, {&y, &a, &b});
  const int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        broadcast_trailing_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), a.data<decltype(a_t)>(), b.data<decltype(b_t)>(), n, b.numel(),
            f);
      },
      y.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void add_trailing(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  launch_broadcast("kernels/add_trailing", y, a, b, Add{}, ctx);
}

void mul_trailing(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  launch_broadcast("kernels/mul_trailing", y, a, b, Mul{}, ctx);
}

void sum_leading(Tensor& out, const Tensor& x, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/sum_leading");
  require_f32("sum_leading", {&out, &x});
  const int64_t inner = out.numel();
  if (inner == 0) return;
  sum_leading_kernel<<<blocks_for(inner), kThreads, 0, stream_of(ctx)>>>(
      out.data<float>(), x.data<float>(), x.numel() / inner, inner, acc == Accumulate::yes);
  DP_CUDA_CHECK_LAUNCH();
}

void sigmoid(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/sigmoid");
  require_f32("sigmoid", {&y, &x});
  const int64_t n = y.numel();
  if (n == 0) return;
  sigmoid_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.data<float>(), x.data<float>(),
                                                                 n);
  DP_CUDA_CHECK_LAUNCH();
}

void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc,
                      DeviceContext& ctx) {
  NvtxRange range("kernels/sigmoid_backward");
  require_f32("sigmoid_backward", {&dx, &dy, &y});
  const int64_t n = dx.numel();
  if (n == 0) return;
  sigmoid_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      dx.data<float>(), dy.data<float>(), y.data<float>(), n, acc == Accumulate::yes);
  DP_CUDA_CHECK_LAUNCH();
}

void exp(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/exp");
  require_f32("exp", {&y, &x});
  const int64_t n = y.numel();
  if (n == 0) return;
  exp_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.data<float>(), x.data<float>(), n);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
