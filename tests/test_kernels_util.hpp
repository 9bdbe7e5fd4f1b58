// Helpers for the kernels.* suites: tensors from host data, comparisons against references
// computed in double, central finite differences, and running an op on a pinned thread count.
#pragma once

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "tests/test_util.hpp"

namespace kt {

using kernels::Device;
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

inline Tensor tensor(const std::vector<float>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape);
}
inline Tensor random_tensor(const Shape& shape, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return tensor(dp_test::random_vector(kernels::shape_numel(shape), seed, lo, hi), shape);
}
inline Tensor zeros(const Shape& shape, DType dtype = DType::f32) {
  return Tensor::zeros(shape, dtype, Device::cpu());
}
inline Tensor filled(const Shape& shape, float value) {
  Tensor t = zeros(shape);
  kernels::fill(t, value);
  return t;
}
inline Tensor scalar() {
  return zeros({1});
}

inline std::vector<double> to_double(const Tensor& t) {
  std::vector<float> f = t.to_host_f32();
  return {f.begin(), f.end()};
}

// Largest |actual - expected| / (1 + |expected|): an absolute error near 0, relative beyond.
inline double max_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  REQUIRE(actual.size() == expected.size());
  double worst = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    double e = std::fabs(actual[i] - expected[i]) / (1.0 + std::fabs(expected[i]));
    if (std::isnan(e)) return e;
    worst = std::max(worst, e);
  }
  return worst;
}
inline double max_error(const Tensor& actual, const std::vector<double>& expected) {
  return max_error(actual.to_host_f32(), expected);
}

// Central differences of a scalar function of x, evaluated in double.
inline std::vector<double> numeric_gradient(
    const std::function<double(const std::vector<double>&)>& f, std::vector<double> x,
    double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double keep = x[i];
    x[i] = keep + h;
    double up = f(x);
    x[i] = keep - h;
    double down = f(x);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Runs f with cpu:0 bound to a context of `threads` arena threads (for determinism checks).
inline void with_cpu_threads(int threads, const std::function<void()>& f) {
  kernels::ContextOptions options;
  options.cpu_threads = threads;
  kernels::DeviceContext ctx(Device::cpu(0), options);
  kernels::ContextScope scope(ctx);
  f();
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_host_f32(), y = b.to_host_f32();
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

}  // namespace kt
