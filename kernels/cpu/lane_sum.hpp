// Row and column sums for the CPU norms (layer_norm.cpp, llama_ops.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

// The sum of f(j) over j in [0, n), in double, as kSumLanes interleaved partial sums (f(j) into sum
// j mod kSumLanes) added pairwise at the end: a fixed order, so the same bits on any build, and no
// serial chain of dependent adds (a single running sum waits an add's latency per element; the
// lanes run side by side in vector registers).
constexpr int64_t kSumLanes = 8;
inline double add_lanes(const double (&s)[kSumLanes]) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
template <class F>
inline void lane_sums(int64_t n, double (&s)[kSumLanes], F&& f) {
  int64_t j = 0;
  for (; j + kSumLanes <= n; j += kSumLanes)
    for (int64_t k = 0; k < kSumLanes; ++k) s[k] += f(j + k);
  for (int64_t k = 0; j + k < n; ++k) s[k] += f(j + k);
}

// A pass over rows [0, rows) that also sums K values per feature over the rows (a norm's
// parameter gradients): the rows run in fixed chunks (a function of `rows` only), in parallel;
// row(r, sums) handles row r and adds its terms into sums[k * features + j], its chunk's zeroed
// K x features doubles, while the row is in cache; then finish(j, totals) per feature, totals[k]
// the chunks' sums added in chunk order. The same bits for any thread count, and one read of the
// rows (a second pass per block of features strides a row's length between reads).
template <int K, class Row, class Finish>
void rows_with_feature_sums(int64_t rows, int64_t features, Row&& row, Finish&& finish) {
  const int64_t chunk = std::max<int64_t>(16, (rows + 63) / 64);
  const int64_t chunks = (rows + chunk - 1) / chunk;
  std::vector<double> partial(static_cast<size_t>(chunks * K * features), 0.0);
  parallel_range(chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c)
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r)
        row(r, partial.data() + c * K * features);
  });
  const int64_t grain = std::max<int64_t>(64, kElementwiseGrain / std::max<int64_t>(1, chunks));
  parallel_range(features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      double totals[K] = {};
      for (int64_t c = 0; c < chunks; ++c)
        for (int k = 0; k < K; ++k)
          totals[k] += partial[static_cast<size_t>((c * K + k) * features + j)];
      finish(j, totals);
    }
  });
}

}  // namespace kernels::cpu
