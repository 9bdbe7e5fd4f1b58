// kernels.pointwise: the ops custom layers are built from (add and mul with b broadcast over
// a's leading dims, sum_leading, sigmoid, exp) against double loops; argument checks.
#include "tests/test_kernels_util.hpp"

using namespace kernels;
using namespace kt;

TEST_CASE("kernels.pointwise: add and mul broadcast b over a's leading dims") {
  const int64_t n = 5, t = 3, d = 7;
  Tensor a = random_tensor({n, t, d}, 60);
  std::vector<double> A = to_double(a);
  for (Shape bs : {Shape{d}, Shape{t, d}, Shape{n, t, d}}) {
    CAPTURE(shape_str(bs));
    Tensor b = random_tensor(bs, 61);
    std::vector<double> B = to_double(b), sum(A.size()), prod(A.size());
    const int64_t inner = b.numel();
    for (int64_t r = 0; r < a.numel() / inner; ++r)
      for (int64_t j = 0; j < inner; ++j) {
        sum[r * inner + j] = A[r * inner + j] + B[j];
        prod[r * inner + j] = A[r * inner + j] * B[j];
      }
    Tensor y = zeros({n, t, d});
    add(y, a, b);
    CHECK(max_error(y, sum) <= 1e-6);
    mul(y, a, b);
    CHECK(max_error(y, prod) <= 1e-6);
  }
  Tensor y = zeros({n, t, d});
  CHECK_THROWS_WITH_AS(add(y, a, zeros({t})), doctest::Contains("is not a's trailing dims"), Error);
  CHECK_THROWS_WITH_AS(mul(y, a, zeros({d, t})), doctest::Contains("vs b [7, 3]"), Error);
}

TEST_CASE("kernels.pointwise: sum_leading is the gradient of a broadcast b") {
  const int64_t rows = 37, d = 6;
  Tensor x = random_tensor({rows, d}, 62), out = random_tensor({d}, 63);
  std::vector<double> X = to_double(x), prior = to_double(out), want(d, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < d; ++j) want[j] += X[r * d + j];
  sum_leading(out, x, Accumulate::yes);
  for (int64_t j = 0; j < d; ++j) want[j] += prior[j];
  CHECK(max_error(out, want) <= 1e-5);
  sum_leading(out, x, Accumulate::no);
  for (int64_t j = 0; j < d; ++j) want[j] -= prior[j];
  CHECK(max_error(out, want) <= 1e-5);
  // The same bits on one thread and on many.
  Tensor big = random_tensor({4099, 5}, 64), one = zeros({5}), many = zeros({5});
  with_cpu_threads(1, [&] { sum_leading(one, big, Accumulate::no); });
  with_cpu_threads(4, [&] { sum_leading(many, big, Accumulate::no); });
  CHECK(bitwise_equal(one, many));
  CHECK_THROWS_WITH_AS(sum_leading(out, zeros({rows, d + 1}), Accumulate::no),
                       doctest::Contains("trailing dims"), Error);
}

TEST_CASE("kernels.pointwise: sigmoid (no overflow at the ends), its gradient, exp") {
  const int64_t n = 31;
  Tensor x = random_tensor({n}, 65, -6.f, 6.f), y = zeros({n});
  std::vector<double> X = to_double(x), want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = 1.0 / (1.0 + std::exp(-X[i]));
  sigmoid(y, x);
  CHECK(max_error(y, want) <= 1e-6);
  Tensor dy = random_tensor({n}, 66), dx = zeros({n});
  std::vector<double> DY = to_double(dy);
  std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) {
        double s = 0.0;
        for (int64_t i = 0; i < n; ++i) s += DY[i] / (1.0 + std::exp(-v[i]));
        return s;
      },
      X);
  sigmoid_backward(dx, dy, y, Accumulate::no);
  CHECK(max_error(dx, grad) <= 1e-5);
  sigmoid_backward(dx, dy, y, Accumulate::yes);
  for (double& g : grad) g *= 2.0;
  CHECK(max_error(dx, grad) <= 1e-5);

  Tensor ends = tensor({-1000.f, 1000.f, 0.f}, {3}), s = zeros({3});
  sigmoid(s, ends);
  CHECK(s.to_host_f32() == std::vector<float>{0.f, 1.f, 0.5f});

  Tensor e = zeros({n});
  kernels::exp(e, x);
  for (int64_t i = 0; i < n; ++i) want[i] = std::exp(X[i]);
  CHECK(max_error(e, want) <= 1e-6 * 500);  // relative to e^6
}
