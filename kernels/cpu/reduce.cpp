// Reductions and metrics. Sums add double partials of fixed chunks in chunk order, so the
// result has the same bits for any thread count.
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

double total(const Tensor& x) {
  const float* px = x.data<float>();
  return chunked_sum(x.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t i = begin; i < end; ++i) s += px[i];
    return s;
  });
}

}  // namespace

void sum(Tensor& out, const Tensor& x) {
  out.data<float>()[0] = static_cast<float>(total(x));
}

void mean(Tensor& out, const Tensor& x) {
  out.data<float>()[0] = static_cast<float>(total(x) / static_cast<double>(x.numel()));
}

void sum_squares(Tensor& out, const Tensor& x) {
  const float* px = x.data<float>();
  out.data<float>()[0] =
      static_cast<float>(chunked_sum(x.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        double s = 0.0;
        for (int64_t i = begin; i < end; ++i) s += static_cast<double>(px[i]) * px[i];
        return s;
      }));
}

void argmax(Tensor& out, const Tensor& x) {
  int64_t rows = x.dim(0), cols = x.dim(1);
  int32_t* po = out.data<int32_t>();
  with_storage(
      [&](auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        parallel_range(rows, std::max<int64_t>(1, kElementwiseGrain / cols),
                       [&](int64_t begin, int64_t end) {
                         for (int64_t i = begin; i < end; ++i)
                           po[i] = row_argmax(px + i * cols, cols);
                       });
      },
      x.dtype());
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  int64_t rows = logits.dim(0), cols = logits.dim(1);
  const int32_t* pl = labels.data<int32_t>();
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / cols);
  double correct = 0.0;
  with_storage(
      [&](auto x_t) {
        const auto* px = logits.data<decltype(x_t)>();
        correct = chunked_sum(rows, grain, [&](int64_t begin, int64_t end) {
          int64_t hits = 0;
          for (int64_t i = begin; i < end; ++i) hits += row_argmax(px + i * cols, cols) == pl[i];
          return static_cast<double>(hits);  // exact: counts stay far below 2^53
        });
      },
      logits.dtype());
  return static_cast<int64_t>(correct);
}

bool all_finite(const Tensor& x) {
  auto count_non_finite = [&](auto load) {
    return chunked_sum(x.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      int64_t bad = 0;
      for (int64_t i = begin; i < end; ++i) bad += !std::isfinite(load(i));
      return static_cast<double>(bad);
    });
  };
  switch (x.dtype()) {
    case DType::f32:
      return count_non_finite([p = x.data<float>()](int64_t i) { return p[i]; }) == 0;
    case DType::f16:
      return count_non_finite([p = x.data<uint16_t>()](int64_t i) { return f16_to_f32(p[i]); }) ==
             0;
    case DType::bf16:
      return count_non_finite([p = x.data<uint16_t>()](int64_t i) { return bf16_to_f32(p[i]); }) ==
             0;
    default:
      return true;  // integers are always finite
  }
}

}  // namespace kernels::cpu
