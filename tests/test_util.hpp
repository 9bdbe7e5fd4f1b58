// Helpers shared by the doctest suites.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.hpp"

namespace dp_test {

// What `f` writes to stderr (fd 2 goes to a temporary file meanwhile).
inline std::string capture_stderr(const std::function<void()>& f) {
  std::fflush(stderr);
  FILE* tmp = std::tmpfile();
  REQUIRE(tmp != nullptr);
  int saved = dup(2);
  dup2(fileno(tmp), 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(tmp);
  std::string out;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, tmp)) > 0) out.append(buf, n);
  std::fclose(tmp);
  return out;
}

// The message of what `f` throws as kernels::Error, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return e.what();
  }
  return "(no error)";
}

int& skipped_cases();

// Removes `path` (a file, or a directory with all it holds) when the test program ends.
void remove_at_exit(const std::string& path);
// A path for a file the test writes: $TMPDIR (or /tmp)/dp_test_<suite>_<pid>_<name>. Every path
// handed out is removed when the test program ends, so no case leaves files behind.
std::string temp_path(const std::string& suite, const std::string& name);

inline bool gpu_available() {
  return kernels::cuda_device_count() > 0;
}

// Deterministic test data in [lo, hi).
inline std::vector<float> random_vector(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// A host batch for a 6-feature, 5-class toy problem: (b, 6) f32 and (b) i32, fixed by seed.
inline std::pair<kernels::Tensor, kernels::Tensor> toy_batch(int64_t b, uint32_t seed) {
  kernels::Tensor x = kernels::Tensor::from_vector(random_vector(b * 6, seed), {b, 6});
  std::vector<int32_t> y(b);
  for (int64_t i = 0; i < b; ++i) y[i] = static_cast<int32_t>((i * 7 + seed) % 5);
  return {x, kernels::Tensor::from_ints(y, {b})};
}

// Largest |a - b| relative to the largest |b|.
inline float rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float scale = 0.f;
  for (float v : b) scale = std::max(scale, std::fabs(v));
  return kernels::max_abs_diff(a, b) / std::max(scale, 1e-12f);
}

// Same dtype, shape and bytes (on any device: compared on the host).
inline bool same_bits(const kernels::Tensor& a, const kernels::Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  kernels::Tensor x = a.to(kernels::Device::cpu()), y = b.to(kernels::Device::cpu());
  return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

}  // namespace dp_test

// Ends the current test case as skipped, visibly, when no GPU is usable.
#define DP_REQUIRE_GPU()                                                                    \
  do {                                                                                      \
    if (!dp_test::gpu_available()) {                                                        \
      std::printf("SKIPPED (no GPU: %s): %s\n", kernels::cuda_unavailable_reason().c_str(), \
                  doctest::getContextOptions()->currentTest->m_name);                       \
      ++dp_test::skipped_cases();                                                           \
      return;                                                                               \
    }                                                                                       \
  } while (0)
