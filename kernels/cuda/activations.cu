// Pointwise activations (ReLU, exact GELU, GELU-tanh, tanh) and their gradients, on f32, f16
// and bf16 storage computed in f32 (with_storage, cuda_common.cuh). Backward kernels overwrite dx
// or add to it. Formulas mirror kernels/cpu/activations.cpp.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

struct Relu {  // NaN stays NaN, as in torch.relu
  __device__ float operator()(float v) const { return (v > 0.f || v != v) ? v : 0.f; }
};
struct ReluGrad {  // of the forward input
  __device__ float operator()(float v) const { return v > 0.f ? 1.f : 0.f; }
};
struct Gelu {  // x Phi(x)
  __device__ float operator()(float v) const { return 0.5f * v * (1.f + erff(v * kInvSqrt2)); }
};
struct GeluGrad {  // Phi(x) + x phi(x), of the forward input
  __device__ float operator()(float v) const {
    float cdf = 0.5f * (1.f + erff(v * kInvSqrt2));
    float pdf = kInvSqrt2Pi * expf(-0.5f * v * v);
    return cdf + v * pdf;
  }
};
struct GeluTanh {  // cuda_common.cuh's gelu_tanh_of
  __device__ float operator()(float v) const { return gelu_tanh_of(v); }
};
struct GeluTanhGrad {  // of the forward input
  __device__ float operator()(float v) const { return gelu_tanh_derivative(v); }
};
struct Tanh {
  __device__ float operator()(float v) const { return tanhf(v); }
};
struct TanhGrad {  // 1 - y^2, of the forward output
  __device__ float operator()(float t) const { return 1.f - t * t; }
};

template <class Y, class X, class F>
__global__ void map_kernel(Y* y, const X* x, int64_t n, F f) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(f(to_float(x[i])));
}

// dx (+)= dy * d(v): v is the forward input or output, per activation.
template <class DX, class DY, class V, class D>
__global__ void backward_kernel(DX* dx, const DY* dy, const V* v, int64_t n, bool accumulate, D d) {
  DP_GRID_STRIDE_LOOP(i, n) {
    // _rn: never contracted into an FMA, so backward8_kernel's values are these bits.
    const float g = __fmul_rn(to_float(dy[i]), d(to_float(v[i])));
    dx[i] = from_float<DX>(accumulate ? __fadd_rn(to_float(dx[i]), g) : g);
  }
}

// The same maps over 16-bit storage, eight values per thread from 16-byte loads and stores
// (load8/store8, cuda_common.cuh): each value computed as map_kernel and backward_kernel compute
// it, so the bits are theirs.
template <class Y, class X, class F>
__global__ void map8_kernel(Y* y, const X* x, int64_t groups, F f) {
  DP_GRID_STRIDE_LOOP(q, groups) {
    const Pack8<X> in = load8(x, q);
    Pack8<Y> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) out.v[k] = from_float<Y>(f(to_float(in.v[k])));
    store8(y, q, out);
  }
}

template <class DX, class DY, class V, class D>
__global__ void backward8_kernel(DX* dx, const DY* dy, const V* v, int64_t groups, bool accumulate,
                                 D d) {
  DP_GRID_STRIDE_LOOP(q, groups) {
    const Pack8<DY> g_in = load8(dy, q);
    const Pack8<V> v_in = load8(v, q);
    Pack8<DX> out;
    if (accumulate) out = load8(dx, q);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float g = __fmul_rn(to_float(g_in.v[k]), d(to_float(v_in.v[k])));
      out.v[k] = from_float<DX>(accumulate ? __fadd_rn(to_float(out.v[k]), g) : g);
    }
    store8(dx, q, out);
  }
}

template <class F>
void launch_map(const char* op, Tensor& y, const Tensor& x, F f, DeviceContext& ctx) {
  require_floating(op, {&y, &x});
  int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto x_t) {
        auto* py = y.data<decltype(y_t)>();
        const auto* px = x.data<decltype(x_t)>();
        auto tail = [&](int64_t first, int64_t count) {
          map_kernel<<<blocks_for(count), kThreads, 0, stream_of(ctx)>>>(py + first, px + first,
                                                                         count, f);
          DP_CUDA_CHECK_LAUNCH();
        };
        if constexpr (sizeof(y_t) == 2 && sizeof(x_t) == 2) {
          auto bulk = [&](int64_t groups) {
            map8_kernel<<<blocks_for(groups), kThreads, 0, stream_of(ctx)>>>(py, px, groups, f);
            DP_CUDA_CHECK_LAUNCH();
          };
          launch_eight_wide_then_tail(n, eight_wide(py, px), bulk, tail);
        } else {
          tail(0, n);
        }
      },
      y.dtype(), x.dtype());
}

template <class D>
void launch_backward(const char* op, Tensor& dx, const Tensor& dy, const Tensor& v, Accumulate acc,
                     D d, DeviceContext& ctx) {
  require_floating(op, {&dx, &dy, &v});
  int64_t n = dx.numel();
  if (n == 0) return;
  with_storage(
      [&](auto dx_t, auto dy_t, auto v_t) {
        auto* pdx = dx.data<decltype(dx_t)>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pv = v.data<decltype(v_t)>();
        auto tail = [&](int64_t first, int64_t count) {
          backward_kernel<<<blocks_for(count), kThreads, 0, stream_of(ctx)>>>(
              pdx + first, pdy + first, pv + first, count, acc == Accumulate::yes, d);
          DP_CUDA_CHECK_LAUNCH();
        };
        if constexpr (sizeof(dx_t) == 2 && sizeof(dy_t) == 2 && sizeof(v_t) == 2) {
          auto bulk = [&](int64_t groups) {
            backward8_kernel<<<blocks_for(groups), kThreads, 0, stream_of(ctx)>>>(
                pdx, pdy, pv, groups, acc == Accumulate::yes, d);
            DP_CUDA_CHECK_LAUNCH();
          };
          launch_eight_wide_then_tail(n, eight_wide(pdx, pdy, pv), bulk, tail);
        } else {
          tail(0, n);
        }
      },
      dx.dtype(), dy.dtype(), v.dtype());
}

}  // namespace

void relu(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/relu");
  launch_map("relu", y, x, Relu{}, ctx);
}

void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                   DeviceContext& ctx) {
  NvtxRange range("kernels/relu_backward");
  launch_backward("relu_backward", dx, dy, x, acc, ReluGrad{}, ctx);
}

void gelu(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/gelu");
  launch_map("gelu", y, x, Gelu{}, ctx);
}

void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                   DeviceContext& ctx) {
  NvtxRange range("kernels/gelu_backward");
  launch_backward("gelu_backward", dx, dy, x, acc, GeluGrad{}, ctx);
}

void gelu_tanh(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/gelu_tanh");
  launch_map("gelu_tanh", y, x, GeluTanh{}, ctx);
}

void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc,
                        DeviceContext& ctx) {
  NvtxRange range("kernels/gelu_tanh_backward");
  launch_backward("gelu_tanh_backward", dx, dy, x, acc, GeluTanhGrad{}, ctx);
}

void tanh(Tensor& y, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/tanh");
  launch_map("tanh", y, x, Tanh{}, ctx);
}

void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc,
                   DeviceContext& ctx) {
  NvtxRange range("kernels/tanh_backward");
  launch_backward("tanh_backward", dx, dy, y, acc, TanhGrad{}, ctx);
}

}  // namespace kernels::cuda
