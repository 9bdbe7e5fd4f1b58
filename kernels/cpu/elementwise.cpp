// Elementwise arithmetic and the bias helpers of linear/conv layers (f32; add, mul, scale, add_bias
// and bias_backward also take f16/bf16 tensors through with_storage, axpy an f16/bf16 x).
#include <algorithm>
#include <type_traits>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/lane_sum.hpp"

namespace kernels::cpu {

void add(Tensor& y, const Tensor& a, const Tensor& b) {
  map_binary(y, a, b, [](float u, float v) { return u + v; });
}

void mul(Tensor& y, const Tensor& a, const Tensor& b) {
  map_binary(y, a, b, [](float u, float v) { return u * v; });
}

void scale(Tensor& y, const Tensor& x, Scalar by) {
  const float alpha = by.read();
  if (y.dtype() == DType::f32 && x.dtype() == DType::f32) {
    const float* px = x.data<float>();
    float* py = y.data<float>();
    parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) py[i] = alpha * px[i];
    });
    return;
  }
  with_storage(  // 16-bit storage: through f32 blocks, each output rounded once
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          float x_buf[kConvertBlock], out[kConvertBlock];
          for (int64_t i = begin; i < end; i += kConvertBlock) {
            const int64_t m = std::min(kConvertBlock, end - i);
            const float* vx = widen_block(px + i, m, x_buf);
            for (int64_t j = 0; j < m; ++j) out[j] = alpha * vx[j];
            store_block(py + i, out, m);
          }
        });
      },
      y.dtype(), x.dtype());
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
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / inner);
  with_storage(
      [&](auto y_t, auto bias_t) {
        const auto* pb = bias.data<decltype(bias_t)>();
        auto* py = y.data<decltype(y_t)>();
        parallel_range(rows, grain, [&](int64_t begin, int64_t end) {
          using Y = std::remove_pointer_t<decltype(py)>;
          for (int64_t r = begin; r < end; ++r) {
            float b = load_f32(pb[r % channels]);
            Y* row = py + r * inner;
            if constexpr (std::is_same_v<Y, float>) {
              for (int64_t i = 0; i < inner; ++i) row[i] += b;
            } else {  // 16-bit storage: through f32 blocks (cpu_util.hpp)
              float sum[kConvertBlock];
              for (int64_t i = 0; i < inner; i += kConvertBlock) {
                const int64_t m = std::min(kConvertBlock, inner - i);
                widen_block(row + i, m, sum);
                for (int64_t j = 0; j < m; ++j) sum[j] += b;
                store_block(row + i, sum, m);
              }
            }
          }
        });
      },
      y.dtype(), bias.dtype());
}

// db[c] (+)= sum over n, then inner, of dy[n, c, inner]. Channel ranges run in parallel; each
// channel adds in the same order whatever the partition (double accumulators; each (n, c) run
// in lane_sums' interleaved lanes, added pairwise).
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc) {
  int64_t batch = dy.dim(0);
  int64_t channels = dy.dim(1);
  int64_t inner = batch * channels == 0 ? 0 : dy.numel() / (batch * channels);
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, batch * inner));
  with_storage(
      [&](auto db_t, auto dy_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        auto* pdb = db.data<decltype(db_t)>();
        parallel_range(channels, grain, [&](int64_t begin, int64_t end) {
          std::vector<double> sums(static_cast<size_t>(end - begin), 0.0);
          if (inner == 1) {  // (N, C), a Linear's: a loop over the channels the compiler vectorises
            double* acc = sums.data();
            const int64_t width = end - begin;
            for (int64_t n = 0; n < batch; ++n) {
              const auto* row = pdy + n * channels + begin;
              for (int64_t j = 0; j < width; ++j) acc[j] += double{load_f32(row[j])};
            }
          } else {
            for (int64_t n = 0; n < batch; ++n)
              for (int64_t c = begin; c < end; ++c) {
                const auto* run = pdy + (n * channels + c) * inner;
                double s[kSumLanes] = {};  // lanes: no chain of dependent adds (lane_sum.hpp)
                lane_sums(inner, s, [&](int64_t i) { return double{load_f32(run[i])}; });
                sums[c - begin] += add_lanes(s);
              }
          }
          for (int64_t c = begin; c < end; ++c) {
            float s = static_cast<float>(sums[c - begin]);
            store_rounded(pdb[c], acc == Accumulate::yes ? load_f32(pdb[c]) + s : s);
          }
        });
      },
      db.dtype(), dy.dtype());
}

}  // namespace kernels::cpu
