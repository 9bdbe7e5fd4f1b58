// kernels.*: BatchNorm, LayerNorm (forward against references in double, backward against
// finite differences of those references) and the counter-based dropout mask.
#include "kernels/philox.hpp"
#include "tests/test_kernels_util.hpp"

using namespace kernels;
using namespace kt;

namespace {

// BatchNorm over (N, C, inner) with batch statistics: y and the per-channel mean and biased var.
struct BatchNormReference {
  std::vector<double> y, mean, var;
};

BatchNormReference ref_batch_norm(const std::vector<double>& x, const Shape& shape,
                                  const std::vector<double>& gamma, const std::vector<double>& beta,
                                  double eps) {
  int64_t N = shape[0], C = shape[1], inner = shape_numel(shape) / (N * C);
  BatchNormReference out{std::vector<double>(x.size()), std::vector<double>(C),
                         std::vector<double>(C)};
  auto at = [&](int64_t n, int64_t c, int64_t i) { return (n * C + c) * inner + i; };
  for (int64_t c = 0; c < C; ++c) {
    double s = 0.0, ss = 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < inner; ++i) s += x[at(n, c, i)];
    double mean = s / (N * inner);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < inner; ++i) ss += (x[at(n, c, i)] - mean) * (x[at(n, c, i)] - mean);
    double var = ss / (N * inner);
    out.mean[c] = mean;
    out.var[c] = var;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < inner; ++i)
        out.y[at(n, c, i)] = (x[at(n, c, i)] - mean) / std::sqrt(var + eps) * gamma[c] + beta[c];
  }
  return out;
}

// LayerNorm of rows of x (M, D).
std::vector<double> ref_layer_norm(const std::vector<double>& x, int64_t D,
                                   const std::vector<double>& gamma,
                                   const std::vector<double>& beta, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / D; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t j = 0; j < D; ++j) mean += x[r * D + j] / D;
    for (int64_t j = 0; j < D; ++j) var += (x[r * D + j] - mean) * (x[r * D + j] - mean) / D;
    for (int64_t j = 0; j < D; ++j)
      y[r * D + j] = (x[r * D + j] - mean) / std::sqrt(var + eps) * gamma[j] + beta[j];
  }
  return y;
}

}  // namespace

TEST_CASE("kernels.batch_norm: training forward, saved statistics, running averages") {
  const float eps = 1e-5f, momentum = 0.1f;
  for (Shape shape : {Shape{7, 5}, Shape{3, 4, 5, 3}}) {
    CAPTURE(shape_str(shape));
    int64_t C = shape[1], count = shape_numel(shape) / C;
    Tensor x = random_tensor(shape, 200, -2.f, 3.f), y = zeros(shape);
    Tensor gamma = random_tensor({C}, 201, 0.5f, 1.5f), beta = random_tensor({C}, 202);
    Tensor save_mean = zeros({C}), save_invstd = zeros({C});
    Tensor running_mean = filled({C}, 0.5f), running_var = filled({C}, 2.f);
    BatchNormReference want =
        ref_batch_norm(to_double(x), shape, to_double(gamma), to_double(beta), eps);
    batch_norm_forward_train(y, save_mean, save_invstd, running_mean, running_var, x, gamma, beta,
                             momentum, eps);
    CHECK(max_error(y, want.y) <= 1e-5);
    CHECK(max_error(save_mean, want.mean) <= 1e-6);
    std::vector<double> invstd(C), rm(C), rv(C);
    for (int64_t c = 0; c < C; ++c) {
      invstd[c] = 1.0 / std::sqrt(want.var[c] + eps);
      rm[c] = 0.9 * 0.5 + 0.1 * want.mean[c];
      rv[c] = 0.9 * 2.0 + 0.1 * want.var[c] * count / (count - 1);  // unbiased
    }
    CHECK(max_error(save_invstd, invstd) <= 1e-5);
    CHECK(max_error(running_mean, rm) <= 1e-6);
    CHECK(max_error(running_var, rv) <= 1e-6);

    // Eval with the running statistics is an affine map per channel.
    batch_norm_forward_eval(y, x, gamma, beta, running_mean, running_var, eps);
    std::vector<double> X = to_double(x), G = to_double(gamma), B = to_double(beta), eval(X.size());
    int64_t inner = count / shape[0];
    for (size_t i = 0; i < X.size(); ++i) {
      int64_t c = (static_cast<int64_t>(i) / inner) % C;
      eval[i] = (X[i] - rm[c]) / std::sqrt(rv[c] + eps) * G[c] + B[c];
    }
    CHECK(max_error(y, eval) <= 1e-5);
  }
}

TEST_CASE("kernels.batch_norm: backward matches finite differences") {
  const float eps = 1e-5f;
  for (Shape shape : {Shape{6, 3}, Shape{2, 3, 3, 2}}) {
    CAPTURE(shape_str(shape));
    int64_t C = shape[1];
    Tensor x = random_tensor(shape, 210), y = zeros(shape), dy = random_tensor(shape, 211);
    Tensor gamma = random_tensor({C}, 212, 0.5f, 1.5f), beta = random_tensor({C}, 213);
    Tensor save_mean = zeros({C}), save_invstd = zeros({C}), rm = zeros({C}), rv = zeros({C});
    batch_norm_forward_train(y, save_mean, save_invstd, rm, rv, x, gamma, beta, 0.1f, eps);
    Tensor dx = filled(shape, NAN), dgamma = filled({C}, 1.f), dbeta = filled({C}, 1.f);
    batch_norm_backward(dx, dgamma, dbeta, dy, x, gamma, save_mean, save_invstd, Accumulate::yes);

    std::vector<double> X = to_double(x), G = to_double(gamma), B = to_double(beta);
    std::vector<double> DY = to_double(dy);
    auto loss_x = [&](const std::vector<double>& v) {
      return dot(DY, ref_batch_norm(v, shape, G, B, eps).y);
    };
    auto loss_g = [&](const std::vector<double>& v) {
      return dot(DY, ref_batch_norm(X, shape, v, B, eps).y);
    };
    auto loss_b = [&](const std::vector<double>& v) {
      return dot(DY, ref_batch_norm(X, shape, G, v, eps).y);
    };
    CHECK(max_error(dx, numeric_gradient(loss_x, X)) <= 1e-4);
    std::vector<double> dg = numeric_gradient(loss_g, G), db = numeric_gradient(loss_b, B);
    for (int64_t c = 0; c < C; ++c) {
      dg[c] += 1.0;  // accumulated onto 1
      db[c] += 1.0;
    }
    CHECK(max_error(dgamma, dg) <= 1e-5);
    CHECK(max_error(dbeta, db) <= 1e-5);
  }
}

TEST_CASE("kernels.batch_norm: empty batch and bad arguments") {
  Tensor x = zeros({0, 3}), g = filled({3}, 1.f), b = zeros({3}), m = zeros({3}), s = zeros({3});
  Tensor rm = filled({3}, 0.5f), rv = filled({3}, 2.f), dg = filled({3}, 9.f),
         db = filled({3}, 9.f);
  batch_norm_forward_train(x, m, s, rm, rv, x, g, b, 0.1f, 1e-5f);
  CHECK(rm.to_host_f32() == std::vector<float>(3, 0.5f));  // no statistics, no update
  batch_norm_backward(x, dg, db, x, x, g, m, s, Accumulate::no);
  CHECK(dg.to_host_f32() == std::vector<float>(3, 0.f));
  Tensor one = zeros({1, 3});
  CHECK_THROWS_WITH_AS(batch_norm_forward_train(one, m, s, rm, rv, one, g, b, 0.1f, 1e-5f),
                       doctest::Contains("more than one value per channel, got x [1, 3]"), Error);
  Tensor x2 = zeros({4, 3});
  CHECK_THROWS_WITH_AS(batch_norm_forward_eval(x2, x2, zeros({4}), b, rm, rv, 1e-5f),
                       doctest::Contains("gamma must be [3], got [4]"), Error);
}

TEST_CASE("kernels.layer_norm: forward and backward (finite differences)") {
  const int64_t M = 7, D = 13;
  const float eps = 1e-5f;
  Tensor x = random_tensor({M, D}, 220, -2.f, 2.f), y = zeros({M, D});
  Tensor gamma = random_tensor({D}, 221, 0.5f, 1.5f), beta = random_tensor({D}, 222);
  Tensor mean = zeros({M}), rstd = zeros({M});
  std::vector<double> X = to_double(x), G = to_double(gamma), B = to_double(beta);
  layer_norm_forward(y, mean, rstd, x, gamma, beta, eps);
  CHECK(max_error(y, ref_layer_norm(X, D, G, B, eps)) <= 1e-5);
  std::vector<double> want_mean(M), want_rstd(M);
  for (int64_t r = 0; r < M; ++r) {
    double s = 0.0, ss = 0.0;
    for (int64_t j = 0; j < D; ++j) s += X[r * D + j];
    for (int64_t j = 0; j < D; ++j) ss += (X[r * D + j] - s / D) * (X[r * D + j] - s / D);
    want_mean[r] = s / D;
    want_rstd[r] = 1.0 / std::sqrt(ss / D + eps);
  }
  CHECK(max_error(mean, want_mean) <= 1e-6);
  CHECK(max_error(rstd, want_rstd) <= 1e-5);

  Tensor dy = random_tensor({M, D}, 223), dx = filled({M, D}, NAN);
  Tensor dgamma = filled({D}, NAN), dbeta = filled({D}, NAN);
  layer_norm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, Accumulate::no);
  std::vector<double> DY = to_double(dy);
  auto loss_x = [&](const std::vector<double>& v) {
    return dot(DY, ref_layer_norm(v, D, G, B, eps));
  };
  auto loss_g = [&](const std::vector<double>& v) {
    return dot(DY, ref_layer_norm(X, D, v, B, eps));
  };
  auto loss_b = [&](const std::vector<double>& v) {
    return dot(DY, ref_layer_norm(X, D, G, v, eps));
  };
  CHECK(max_error(dx, numeric_gradient(loss_x, X)) <= 1e-4);
  std::vector<double> dg = numeric_gradient(loss_g, G), db = numeric_gradient(loss_b, B);
  CHECK(max_error(dgamma, dg) <= 1e-5);
  CHECK(max_error(dbeta, db) <= 1e-5);
  layer_norm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, Accumulate::yes);
  for (int64_t j = 0; j < D; ++j) dg[j] *= 2.0;
  CHECK(max_error(dgamma, dg) <= 1e-5);
}

TEST_CASE("kernels.layer_norm: parameter gradients are the same bits on any thread count") {
  const int64_t M = 3001, D = 37;
  Tensor x = random_tensor({M, D}, 230), y = zeros({M, D}), dy = random_tensor({M, D}, 231);
  Tensor gamma = random_tensor({D}, 232), beta = random_tensor({D}, 233);
  Tensor mean = zeros({M}), rstd = zeros({M});
  layer_norm_forward(y, mean, rstd, x, gamma, beta, 1e-5f);
  Tensor dx1 = zeros({M, D}), dx2 = zeros({M, D});
  Tensor dg1 = zeros({D}), dg2 = zeros({D}), db1 = zeros({D}), db2 = zeros({D});
  with_cpu_threads(
      1, [&] { layer_norm_backward(dx1, dg1, db1, dy, x, gamma, mean, rstd, Accumulate::no); });
  with_cpu_threads(
      2, [&] { layer_norm_backward(dx2, dg2, db2, dy, x, gamma, mean, rstd, Accumulate::no); });
  CHECK(bitwise_equal(dx1, dx2));
  CHECK(bitwise_equal(dg1, dg2));
  CHECK(bitwise_equal(db1, db2));
  Tensor empty = zeros({0, D});
  layer_norm_backward(empty, dg1, db1, empty, empty, gamma, zeros({0}), zeros({0}), Accumulate::no);
  CHECK(dg1.to_host_f32() == std::vector<float>(D, 0.f));
  Tensor too_long = zeros({M + 1});
  CHECK_THROWS_WITH_AS(layer_norm_forward(y, too_long, rstd, x, gamma, beta, 1e-5f),
                       doctest::Contains("save_mean must be [3001], got [3002]"), Error);
}

TEST_CASE("kernels.rms_norm: the gain gradient is the same bits on any thread count") {
  // 3001 rows: chunks of 47 rows and a short last one (rows_with_feature_sums), in f32 and bf16.
  const int64_t M = 3001, D = 37;
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dt);
    Tensor x = cast(random_tensor({M, D}, 240), dt), dy = cast(random_tensor({M, D}, 241), dt);
    Tensor gamma = random_tensor({D}, 242), y = cast(zeros({M, D}), dt), rstd = zeros({M});
    rms_norm_forward(y, rstd, x, gamma, 1e-6f);
    Tensor dx1 = cast(zeros({M, D}), dt), dx2 = cast(zeros({M, D}), dt);
    Tensor dg1 = random_tensor({D}, 243), dg2 = random_tensor({D}, 243);
    with_cpu_threads(1, [&] { rms_norm_backward(dx1, dg1, dy, x, gamma, rstd, Accumulate::yes); });
    with_cpu_threads(2, [&] { rms_norm_backward(dx2, dg2, dy, x, gamma, rstd, Accumulate::yes); });
    CHECK(bitwise_equal(dx1, dx2));
    CHECK(bitwise_equal(dg1, dg2));
  }
}

TEST_CASE(
    "kernels.layer_norm: the fused skip sum and backward add are the bits of add and the norm") {
  // GPT-2's residual + ln_2 (add_layer_norm_forward) and each norm's backward + skip gradient
  // (layer_norm_backward_add) against the separate ops, in f32, bf16 and f16 streams, with an
  // f32 norm output and an f32 incoming gradient too; the fused ones on 2 threads, the separate
  // ones on 1. 3001 rows of 37 features: uneven row blocks.
  const int64_t M = 3001, D = 37;
  struct Case {
    DType stream, y, dy;
  };
  for (Case c :
       {Case{DType::f32, DType::f32, DType::f32}, Case{DType::bf16, DType::bf16, DType::bf16},
        Case{DType::f16, DType::f16, DType::f16}, Case{DType::bf16, DType::f32, DType::f32}}) {
    CAPTURE(c.stream);
    CAPTURE(c.y);
    auto data = [&](uint32_t seed, DType dt, float lo = -2.f, float hi = 2.f) {
      return Tensor::from_vector(dp_test::random_vector(static_cast<size_t>(M * D), seed, lo, hi),
                                 {M, D}, Device::cpu(), dt);
    };
    Tensor a = data(240, c.stream), b = data(241, c.stream, -0.5f, 0.5f);
    Tensor gamma = random_tensor({D}, 242, 0.5f, 1.5f), beta = random_tensor({D}, 243);
    Tensor h1 = zeros({M, D}, c.stream), y1 = zeros({M, D}, c.y), m1 = zeros({M}), r1 = zeros({M});
    Tensor h2 = zeros({M, D}, c.stream), y2 = zeros({M, D}, c.y), m2 = zeros({M}), r2 = zeros({M});
    with_cpu_threads(1, [&] {
      add(h1, a, b);
      layer_norm_forward(y1, m1, r1, h1, gamma, beta, 1e-5f);
    });
    with_cpu_threads(2, [&] { add_layer_norm_forward(h2, y2, m2, r2, a, b, gamma, beta, 1e-5f); });
    CHECK(bitwise_equal(h1, h2));
    CHECK(bitwise_equal(y1, y2));
    CHECK(bitwise_equal(m1, m2));
    CHECK(bitwise_equal(r1, r2));

    Tensor dy = data(244, c.dy), dskip = data(245, c.dy);
    Tensor dg1 = random_tensor({D}, 246), db1 = random_tensor({D}, 247);
    Tensor dg2 = random_tensor({D}, 246), db2 = random_tensor({D}, 247);
    Tensor dnorm = zeros({M, D}, c.stream), dx1 = zeros({M, D}, c.dy), dx2 = zeros({M, D}, c.dy);
    with_cpu_threads(1, [&] {
      layer_norm_backward(dnorm, dg1, db1, dy, h1, gamma, m1, r1, Accumulate::yes);
      add(dx1, dskip, dnorm);
    });
    with_cpu_threads(2, [&] {
      layer_norm_backward_add(dx2, dg2, db2, dy, dskip, h2, gamma, m2, r2, Accumulate::yes);
    });
    CHECK(bitwise_equal(dx1, dx2));
    CHECK(bitwise_equal(dg1, dg2));
    CHECK(bitwise_equal(db1, db2));
  }
  Tensor x = random_tensor({4, D}, 248), h = zeros({4, D}), y = zeros({4, D});
  Tensor g = random_tensor({D}, 249), mean = zeros({4}), rstd = zeros({4});
  Tensor x16 = Tensor::zeros({4, D}, DType::bf16, Device::cpu());
  CHECK_THROWS_WITH_AS(add_layer_norm_forward(h, y, mean, rstd, x, x16, g, g, 1e-5f),
                       doctest::Contains("add_layer_norm_forward: b must be f32"), Error);
  CHECK_THROWS_WITH_AS(add_layer_norm_forward(h, y, mean, rstd, x, zeros({4, D + 1}), g, g, 1e-5f),
                       doctest::Contains("shapes differ: h [4, 37] vs b [4, 38]"), Error);
  add_layer_norm_forward(h, y, mean, rstd, x, x, g, g, 1e-5f);
  CHECK_THROWS_WITH_AS(layer_norm_backward_add(h, g, g, y, x16, x, g, mean, rstd, Accumulate::yes),
                       doctest::Contains("layer_norm_backward_add: dskip must be f32"), Error);
  Tensor empty = zeros({0, D}), dg = filled({D}, 3.f), db = filled({D}, 3.f);
  layer_norm_backward_add(empty, dg, db, empty, empty, empty, g, zeros({0}), zeros({0}),
                          Accumulate::no);
  CHECK(dg.to_host_f32() == std::vector<float>(D, 0.f));
}

TEST_CASE("kernels.dropout: Philox mask by formula, scaling, offsets") {
  const int64_t n = 100003;
  const uint64_t seed = 1234;
  Tensor x = random_tensor({n}, 240), y = zeros({n}), mask = zeros({n});
  const float p = 0.3f;
  dropout_forward(y, mask, x, p, seed, 0);
  std::vector<float> X = x.to_host_f32(), Y = y.to_host_f32(), K = mask.to_host_f32();
  int64_t kept = 0, wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    bool keep = philox::uniform(seed, static_cast<uint64_t>(i)) >= p;
    float want = keep ? 1.f / (1.f - p) : 0.f;
    wrong += K[i] != want || Y[i] != X[i] * want;
    kept += keep;
  }
  CHECK(wrong == 0);
  CHECK(static_cast<double>(kept) / n == doctest::Approx(0.7).epsilon(0.01));

  // Offsets continue the stream: elements [5, n) of offset 0 are the mask at offset 5, also
  // from an unaligned start inside a Philox block.
  Tensor tail = x.view(5, {n - 5}), y_tail = zeros({n - 5}), mask_tail = zeros({n - 5});
  dropout_forward(y_tail, mask_tail, tail, p, seed, 5);
  CHECK(std::equal(K.begin() + 5, K.end(), mask_tail.to_host_f32().begin()));
  Tensor mask1 = zeros({n}), mask2 = zeros({n});
  with_cpu_threads(1, [&] { dropout_forward(y, mask1, x, p, seed, 7); });
  with_cpu_threads(2, [&] { dropout_forward(y, mask2, x, p, seed, 7); });
  CHECK(bitwise_equal(mask1, mask2));
  Tensor other_seed = zeros({n});
  dropout_forward(y, other_seed, x, p, seed + 1, 0);
  CHECK_FALSE(bitwise_equal(other_seed, mask));

  dropout_forward(y, mask, x, 0.f, seed, 0);  // p = 0 keeps everything, unscaled
  CHECK(mask.to_host_f32() == std::vector<float>(n, 1.f));
  CHECK(bitwise_equal(y, x));
  CHECK_THROWS_WITH_AS(dropout_forward(y, mask, x, 1.f, seed, 0),
                       doctest::Contains("p must be in [0, 1)"), Error);
  Tensor short_mask = zeros({3});
  CHECK_THROWS_WITH_AS(dropout_forward(y, short_mask, x, 0.5f, seed, 0),
                       doctest::Contains("x [100003] vs mask [3]"), Error);
}
