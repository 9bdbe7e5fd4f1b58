// Pointwise activations and their gradients (f32, f16 and bf16 storage, computed in f32).
// Backward kernels overwrite dx or add to it.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/vec_math.hpp"

namespace kernels::cpu {

namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// y = rows(x) over the whole tensor, any storage (cpu_util.hpp): rows(out, in, m) fills m
// outputs from m f32 inputs, a vectorised function of vec_math.hpp or an element loop (map). 16-bit
// storage is widened into and rounded out of per-thread blocks of kConvertBlock elements.
template <class Rows>
void map_rows(Tensor& y, const Tensor& x, Rows rows) {
  with_storage(
      [&](auto y_t, auto x_t) {
        using Y = decltype(y_t);
        const auto* px = x.data<decltype(x_t)>();
        Y* py = y.data<Y>();
        parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          float in[kConvertBlock], out[kConvertBlock];
          for (int64_t b = begin; b < end; b += kConvertBlock) {
            const int64_t m = std::min(kConvertBlock, end - b);
            const float* src = widen_block(px + b, m, in);
            if constexpr (std::is_same_v<Y, float>) {
              rows(py + b, src, m);
            } else {
              rows(out, src, m);
              store_block(py + b, out, m);
            }
          }
        });
      },
      y.dtype(), x.dtype());
}

// y[i] = f(x[i]).
template <class F>
void map(Tensor& y, const Tensor& x, F f) {
  map_rows(y, x, [&](float* out, const float* in, int64_t m) {
    for (int64_t j = 0; j < m; ++j) out[j] = f(in[j]);
  });
}

// dx (+)= dy * grad(v), any storage: grad(g, v, m) fills the derivative at m forward inputs or
// outputs v (per activation), a vectorised function of vec_math.hpp or ReLU's compare, in a block
// of its own.
template <class Grad>
void backward_rows(Tensor& dx, const Tensor& dy, const Tensor& v, Accumulate acc, Grad grad) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto v_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pv = v.data<decltype(v_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          using DX = std::remove_pointer_t<decltype(pdx)>;
          float in[kConvertBlock], g[kConvertBlock], dy_buf[kConvertBlock], out[kConvertBlock];
          for (int64_t b = begin; b < end; b += kConvertBlock) {
            const int64_t m = std::min(kConvertBlock, end - b);
            grad(g, widen_block(pv + b, m, in), m);
            const float* d = widen_block(pdy + b, m, dy_buf);
            if constexpr (std::is_same_v<DX, float>) {
              if (acc == Accumulate::yes)
                for (int64_t j = 0; j < m; ++j) pdx[b + j] += d[j] * g[j];
              else
                for (int64_t j = 0; j < m; ++j) pdx[b + j] = d[j] * g[j];
            } else {
              accumulate_block(pdx + b, m, acc, out, [&](int64_t j) { return d[j] * g[j]; });
            }
          }
        });
      },
      dx.dtype(), dy.dtype(), v.dtype());
}

// dx[i] (+)= dy[i] * d(v[i]), v the forward input or output (per activation). Not backward_rows
// with an element loop for grad: a cheap derivative fused into the product's loop is faster than a
// block of its own (tanh's backward: 0.063 against 0.10 ns an element, f32, 2 threads).
template <class DerivativeOf>
void backward(Tensor& dx, const Tensor& dy, const Tensor& v, Accumulate acc, DerivativeOf d) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto v_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pv = v.data<decltype(v_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        using DX = std::remove_pointer_t<decltype(pdx)>;
        using DY = std::remove_cv_t<std::remove_pointer_t<decltype(pdy)>>;
        using V = std::remove_cv_t<std::remove_pointer_t<decltype(pv)>>;
        parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          if constexpr (std::is_same_v<DX, float> && std::is_same_v<DY, float> &&
                        std::is_same_v<V, float>) {
            if (acc == Accumulate::yes)
              for (int64_t i = begin; i < end; ++i) pdx[i] += pdy[i] * d(pv[i]);
            else
              for (int64_t i = begin; i < end; ++i) pdx[i] = pdy[i] * d(pv[i]);
          } else {  // 16-bit storage: through f32 blocks (cpu_util.hpp)
            float v_buf[kConvertBlock], dy_buf[kConvertBlock], out[kConvertBlock];
            for (int64_t b = begin; b < end; b += kConvertBlock) {
              const int64_t m = std::min(kConvertBlock, end - b);
              const float* vv = widen_block(pv + b, m, v_buf);
              const float* g = widen_block(pdy + b, m, dy_buf);
              accumulate_block(pdx + b, m, acc, out, [&](int64_t j) { return g[j] * d(vv[j]); });
            }
          }
        });
      },
      dx.dtype(), dy.dtype(), v.dtype());
}

}  // namespace

// NaN stays NaN (torch.relu's rule): mapped to 0, a NaN input left a finite loss over NaN weights.
void relu(Tensor& y, const Tensor& x) {
  map(y, x, [](float v) { return (v > 0.f || v != v) ? v : 0.f; });
}

// ReLU's derivative, 1 or 0, over a block: a loop of its own, which GCC vectorises (a compare
// and a mask). In the element loop of backward() it made `v > 0` a branch, which a ReLU's random
// signs mispredict about half the time.
void relu_grad_rows(float* g, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = x[i] > 0.f ? 1.f : 0.f;
}

void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  backward_rows(dx, dy, x, acc, relu_grad_rows);  // dy times 1 or 0: the same bits as before
}

// x Phi(x), Phi the standard normal CDF.
void gelu(Tensor& y, const Tensor& x) {
  map(y, x, [](float v) { return 0.5f * v * (1.f + std::erf(v * kInvSqrt2)); });
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x).
void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  backward(dx, dy, x, acc, [](float v) {
    float cdf = 0.5f * (1.f + std::erf(v * kInvSqrt2));
    float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
    return cdf + v * pdf;
  });
}

// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), vectorised (vec_math.hpp).
void gelu_tanh(Tensor& y, const Tensor& x) {
  map_rows(y, x, gelu_tanh_rows);
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2).
void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  backward_rows(dx, dy, x, acc, gelu_tanh_grad_rows);
}

void tanh(Tensor& y, const Tensor& x) {
  map_rows(y, x, tanh_rows);
}

// d tanh = 1 - tanh^2, from the forward output y.
void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc) {
  backward(dx, dy, y, acc, [](float t) { return 1.f - t * t; });
}

}  // namespace kernels::cpu
