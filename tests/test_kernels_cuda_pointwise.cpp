// kernels.cuda.pointwise: the CUDA backend of the custom-layer ops (broadcast add and mul,
// sum_leading, sigmoid and its gradient, exp) against the CPU backend; skips without a GPU.
#include <cstring>

#include "tests/test_util.hpp"

using namespace kernels;

namespace {

Tensor rnd(Device d, const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed, lo, hi), s, d);
}

// The op's outputs on `d`, from fixed seeds.
std::vector<std::vector<float>> run(Device d) {
  const Shape s{9, 5, 67};
  Tensor a = rnd(d, s, 70, -5.f, 5.f), b = rnd(d, {5, 67}, 71), dy = rnd(d, s, 72);
  Tensor added = Tensor::zeros(s, DType::f32, d), multiplied = Tensor::zeros(s, DType::f32, d);
  Tensor sig = Tensor::zeros(s, DType::f32, d), e = Tensor::zeros(s, DType::f32, d);
  Tensor dx = rnd(d, s, 73), db = rnd(d, {5, 67}, 74);
  add(added, a, b);
  mul(multiplied, a, b);
  sum_leading(db, dy, Accumulate::yes);
  sigmoid(sig, a);
  sigmoid_backward(dx, dy, sig, Accumulate::yes);
  kernels::exp(e, a);
  std::vector<std::vector<float>> out;
  for (const Tensor* t : {&added, &multiplied, &db, &sig, &dx, &e}) out.push_back(t->to_host_f32());
  return out;
}

}  // namespace

TEST_CASE("kernels.cuda.pointwise: broadcast add, mul, sum_leading, sigmoid, exp match CPU") {
  DP_REQUIRE_GPU();
  auto gpu = run(Device::cuda(0));
  auto cpu = run(Device::cpu(0));
  REQUIRE(gpu.size() == cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    CAPTURE(i);
    CHECK(dp_test::rel_diff(gpu[i], cpu[i]) <= 2e-6f);
  }
  // sum_leading adds the rows in the same order in double on both: the same bits.
  CHECK(std::memcmp(gpu[2].data(), cpu[2].data(), gpu[2].size() * sizeof(float)) == 0);
}
