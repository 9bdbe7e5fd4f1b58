// Pointwise activations and their gradients (f32, f16 and bf16 storage, computed in f32).
// Backward kernels overwrite dx or add to it.
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

// y[i] = f(x[i]) over the whole tensor (any storage: cpu_util.hpp).
template <class F>
void map(Tensor& y, const Tensor& x, F f) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) store_rounded(py[i], f(load_f32(px[i])));
        });
      },
      y.dtype(), x.dtype());
}

// dx[i] (+)= dy[i] * f'(v[i]), where v is the forward input or output (per activation).
template <class DerivativeOf>
void backward(Tensor& dx, const Tensor& dy, const Tensor& v, Accumulate acc, DerivativeOf d) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto v_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pv = v.data<decltype(v_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          if (acc == Accumulate::yes)
            for (int64_t i = begin; i < end; ++i)
              store_rounded(pdx[i], load_f32(pdx[i]) + load_f32(pdy[i]) * d(load_f32(pv[i])));
          else
            for (int64_t i = begin; i < end; ++i)
              store_rounded(pdx[i], load_f32(pdy[i]) * d(load_f32(pv[i])));
        });
      },
      dx.dtype(), dy.dtype(), v.dtype());
}

}  // namespace

void relu(Tensor& y, const Tensor& x) {
  map(y, x, [](float v) { return v > 0.f ? v : 0.f; });
}

void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  backward(dx, dy, x, acc, [](float v) { return v > 0.f ? 1.f : 0.f; });
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

// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
void gelu_tanh(Tensor& y, const Tensor& x) {
  map(y, x, [](float v) {
    return 0.5f * v * (1.f + std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v)));
  });
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2).
void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  backward(dx, dy, x, acc, [](float v) {
    float t = std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
    return 0.5f * (1.f + t) +
           0.5f * v * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * v * v);
  });
}

void tanh(Tensor& y, const Tensor& x) {
  map(y, x, [](float v) { return std::tanh(v); });
}

// d tanh = 1 - tanh^2, from the forward output y.
void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc) {
  backward(dx, dy, y, acc, [](float t) { return 1.f - t * t; });
}

}  // namespace kernels::cpu
