// Elementwise arithmetic and the bias helpers of linear/conv layers (f32; axpy also takes an
// f16/bf16 x).
#include <algorithm>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

void add(Tensor& y, const Tensor& a, const Tensor& b) {
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* py = y.data<float>();
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] = pa[i] + pb[i];
  });
}

void mul(Tensor& y, const Tensor& a, const Tensor& b) {
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  float* py = y.data<float>();
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] = pa[i] * pb[i];
  });
}

void scale(Tensor& y, const Tensor& x, Scalar by) {
  const float alpha = by.read();
  const float* px = x.data<float>();
  float* py = y.data<float>();
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] = alpha * px[i];
  });
}

// y f32 += alpha * x, x f32 or widened from f16/bf16 (exact) element by element.
void axpy(Tensor& y, Scalar by, const Tensor& x) {
  const float alpha = by.read();
  float* py = y.data<float>();
  if (x.dtype() == DType::f32) {
    const float* px = x.data<float>();
    parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) py[i] += alpha * px[i];
    });
    return;
  }
  const uint16_t* px = x.data<uint16_t>();
  bool is_bf16 = x.dtype() == DType::bf16;
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      py[i] += alpha * (is_bf16 ? bf16_to_f32(px[i]) : f16_to_f32(px[i]));
  });
}

// y viewed as (N, C, inner): rows of (n, c) run in parallel, each adds bias[c] to its inner run.
void add_bias(Tensor& y, const Tensor& bias) {
  int64_t channels = y.dim(1);
  int64_t rows = y.dim(0) * channels;
  int64_t inner = y.numel() / rows;
  const float* pb = bias.data<float>();
  float* py = y.data<float>();
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / inner);
  parallel_range(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float b = pb[r % channels];
      float* row = py + r * inner;
      for (int64_t i = 0; i < inner; ++i) row[i] += b;
    }
  });
}

// db[c] (+)= sum over n, then inner, of dy[n, c, inner]. Channel ranges run in parallel; each
// channel adds in the same order whatever the partition (double accumulators).
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc) {
  int64_t batch = dy.dim(0);
  int64_t channels = dy.dim(1);
  int64_t inner = batch * channels == 0 ? 0 : dy.numel() / (batch * channels);
  const float* pdy = dy.data<float>();
  float* pdb = db.data<float>();
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, batch * inner));
  parallel_range(channels, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(static_cast<size_t>(end - begin), 0.0);
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t c = begin; c < end; ++c) {
        const float* run = pdy + (n * channels + c) * inner;
        double s = 0.0;
        for (int64_t i = 0; i < inner; ++i) s += run[i];
        sums[c - begin] += s;
      }
    for (int64_t c = begin; c < end; ++c) {
      float s = static_cast<float>(sums[c - begin]);
      pdb[c] = acc == Accumulate::yes ? pdb[c] + s : s;
    }
  });
}

}  // namespace kernels::cpu
