// Helpers shared by the nn suites (test_nn*.cpp).
#pragma once

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "nn/nn.hpp"
#include "tests/test_util.hpp"

namespace nn_test {

using kernels::Device;
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

// Batch s of a small GPT's tokens ((batch, t) ids and targets in [0, 64)), other rows each step.
inline std::pair<Tensor, Tensor> gpt_tokens(int s, int64_t batch = 4, int64_t t = 16) {
  std::vector<int32_t> ids(static_cast<size_t>(batch * t)), tg(ids.size());
  for (int64_t i = 0; i < batch * t; ++i) {
    ids[i] = static_cast<int32_t>((i * 7 + s * 5 + i / 9) % 64);
    tg[i] = static_cast<int32_t>((i * 3 + s + 1) % 64);
  }
  return {Tensor::from_ints(ids, {batch, t}), Tensor::from_ints(tg, {batch, t})};
}

inline int64_t numel(const Shape& s) {
  return kernels::shape_numel(s);
}

// Uniform values in [lo, hi), deterministic.
inline Tensor uniform(const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f,
                      Device d = Device::cpu()) {
  return Tensor::from_vector(dp_test::random_vector(numel(s), seed, lo, hi), s, d);
}

// Distinct values at least `step` apart and at least step/2 away from 0, shuffled: finite
// differences (eps << step) never cross a kink of ReLU or a tie of max pooling.
inline Tensor separated(const Shape& s, uint32_t seed, float step = 0.02f,
                        Device d = Device::cpu()) {
  const int64_t n = numel(s);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = (static_cast<float>(i - n / 2) + 0.5f) * step;
  std::mt19937 gen(seed);
  std::shuffle(v.begin(), v.end(), gen);
  return Tensor::from_vector(v, s, d);
}

// Materialises m on `d` and gradchecks it, printing the result when it fails.
inline nn::GradcheckResult check_grads(nn::Module& m, const Tensor& x,
                                       nn::GradcheckOptions o = {}) {
  nn::GradcheckResult r = nn::gradcheck(m, x, o);
  INFO(r.message);
  CHECK(r.ok);
  CHECK(r.checked > 0);
  return r;
}

template <class M>
std::shared_ptr<M> materialized(std::shared_ptr<M> m, uint64_t seed = 1, Device d = Device::cpu()) {
  m->materialize(d, seed);
  return m;
}

inline std::vector<float> host(const Tensor& t) {
  return t.to_host_f32();
}

// m's parameter values or gradients, packed (flat order, no alignment gaps).
inline std::vector<float> packed_values(nn::Module& m) {
  return nn::packed_parameters(m, host(m.flat_params()));
}
inline std::vector<float> packed_grads(nn::Module& m) {
  return nn::packed_parameters(m, host(m.flat_grads()));
}
// Sets m's parameter values (or gradients) from packed values.
enum class Which { values, grads };
inline void set_packed(nn::Module& m, Which which, const std::vector<float>& v) {
  size_t at = 0;
  for (auto& [name, p] : m.named_parameters()) {
    auto n = static_cast<size_t>(p->numel());
    REQUIRE(at + n <= v.size());
    nn::set_values(which == Which::values ? p->value : p->grad,
                   std::vector<float>(v.begin() + at, v.begin() + at + n));
    at += n;
  }
  REQUIRE(at == v.size());
}

}  // namespace nn_test
