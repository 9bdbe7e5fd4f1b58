// The ops small custom layers are built from (f32): a and b combined with b broadcast over the
// leading dims of a (also f16/bf16, computed in f32), the reduction that is its gradient,
// sigmoid and exp. Mirrors kernels/cuda/pointwise.cu.
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

// y[r, j] = a[r, j] (+ or *) b[j], a viewed as (rows, b.numel()) (cpu_util.hpp's map_binary).
void add_trailing(Tensor& y, const Tensor& a, const Tensor& b) {
  map_binary(y, a, b, [](float u, float v) { return u + v; });
}

void mul_trailing(Tensor& y, const Tensor& a, const Tensor& b) {
  map_binary(y, a, b, [](float u, float v) { return u * v; });
}

// out[j] (+)= sum over r of x[r, j], x viewed as (rows, inner). Column ranges run in parallel;
// each column adds its rows in order (double accumulators): the same bits for any thread count.
void sum_leading(Tensor& out, const Tensor& x, Accumulate acc) {
  const int64_t inner = out.numel();
  const int64_t rows = inner == 0 ? 0 : x.numel() / inner;
  const float* px = x.data<float>();
  float* po = out.data<float>();
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, rows));
  parallel_range(inner, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(static_cast<size_t>(end - begin), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = begin; j < end; ++j) sums[j - begin] += px[r * inner + j];
    for (int64_t j = begin; j < end; ++j) {
      const float s = static_cast<float>(sums[j - begin]);
      po[j] = acc == Accumulate::yes ? po[j] + s : s;
    }
  });
}

// 1 / (1 + e^-x), written so that neither branch overflows.
void sigmoid(Tensor& y, const Tensor& x) {
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = px[i];
      if (v >= 0.f) {
        py[i] = 1.f / (1.f + std::exp(-v));
      } else {
        const float e = std::exp(v);
        py[i] = e / (1.f + e);
      }
    }
  });
}

// d sigmoid = y (1 - y), from the forward output y.
void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc) {
  const float* pdy = dy.data<float>();
  const float* py = y.data<float>();
  float* pdx = dx.data<float>();
  parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = pdy[i] * py[i] * (1.f - py[i]);
      pdx[i] = acc == Accumulate::yes ? pdx[i] + g : g;
    }
  });
}

void exp(Tensor& y, const Tensor& x) {
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] = std::exp(px[i]);
  });
}

}  // namespace kernels::cpu
