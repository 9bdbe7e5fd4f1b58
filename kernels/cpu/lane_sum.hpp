// Row sums for the CPU norms (layer_norm.cpp, llama_ops.cpp).
#pragma once

#include <cstdint>

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

}  // namespace kernels::cpu
