// Helpers shared by the doctest suites.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.hpp"

namespace dp_test {

int& skipped_cases();

inline bool gpu_available() { return kernels::cuda_device_count() > 0; }

// Deterministic test data in [lo, hi).
inline std::vector<float> random_vector(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

}  // namespace dp_test

// Ends the current test case as skipped, visibly, when no GPU is usable.
#define DP_REQUIRE_GPU()                                                                  \
  do {                                                                                    \
    if (!dp_test::gpu_available()) {                                                      \
      std::printf("SKIPPED (no GPU: %s): %s\n", kernels::cuda_unavailable_reason().c_str(), \
                  doctest::getContextOptions()->currentTest->m_name);                     \
      ++dp_test::skipped_cases();                                                         \
      return;                                                                             \
    }                                                                                     \
  } while (0)
