// kernels.*: losses, reductions, metrics and optimizer steps against references in double and
// hand-computed values.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "tests/compute_copy_cases.hpp"
#include "tests/loss_count_cases.hpp"
#include "tests/loss_scale_cases.hpp"
#include "tests/optim_test_util.hpp"
#include "tests/test_kernels_util.hpp"

using namespace kernels;
using namespace kt;

namespace {

struct CrossEntropy {
  double loss = 0.0;
  std::vector<double> dlogits;
};

// The contract's formula, term by term.
CrossEntropy ref_cross_entropy(const std::vector<double>& x, const std::vector<int32_t>& labels,
                               const std::vector<double>& weights, int64_t classes, double ls) {
  int64_t batch = static_cast<int64_t>(labels.size());
  CrossEntropy out;
  out.dlogits.assign(x.size(), 0.0);
  for (int64_t i = 0; i < batch; ++i) {
    const double* row = x.data() + i * classes;
    double mx = *std::max_element(row, row + classes), s = 0.0;
    for (int64_t c = 0; c < classes; ++c) s += std::exp(row[c] - mx);
    double lse = mx + std::log(s);
    double w = weights.empty() ? 1.0 : weights[i];
    for (int64_t c = 0; c < classes; ++c) {
      double t = (c == labels[i] ? 1.0 - ls : 0.0) + ls / classes;
      out.loss += w * -t * (row[c] - lse) / batch;
      out.dlogits[i * classes + c] = w / batch * (std::exp(row[c] - lse) - t);
    }
  }
  return out;
}

std::vector<int32_t> random_labels(int64_t n, int32_t classes, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> v(n);
  for (auto& l : v) l = static_cast<int32_t>(gen() % classes);
  return v;
}

}  // namespace

TEST_CASE("kernels.softmax_cross_entropy: loss and gradient (smoothing, weights, 7x13)") {
  const int64_t batch = 7, classes = 13;
  Tensor logits = random_tensor({batch, classes}, 60, -3.f, 3.f);
  std::vector<int32_t> label_v = random_labels(batch, classes, 61);
  Tensor labels = Tensor::from_ints(label_v, {batch});
  Tensor weights = random_tensor({batch}, 62, 0.f, 2.f);
  std::vector<double> X = to_double(logits);
  for (float ls : {0.f, 0.1f})
    for (bool weighted : {false, true}) {
      CAPTURE(ls);
      CAPTURE(weighted);
      std::vector<double> W = weighted ? to_double(weights) : std::vector<double>{};
      CrossEntropy want = ref_cross_entropy(X, label_v, W, classes, ls);
      Tensor loss = scalar(), dlogits = filled({batch, classes}, NAN);
      softmax_cross_entropy(loss, dlogits, logits, labels, weighted ? weights : Tensor(), ls);
      CHECK(loss.item() == doctest::Approx(want.loss).epsilon(1e-6));
      CHECK(max_error(dlogits, want.dlogits) <= 1e-6);
      // The closed-form gradient is the derivative of the loss.
      std::vector<double> numeric = numeric_gradient(
          [&](const std::vector<double>& v) {
            return ref_cross_entropy(v, label_v, W, classes, ls).loss;
          },
          X);
      CHECK(max_error(dlogits, numeric) <= 1e-6);
    }
}

TEST_CASE("kernels.softmax_cross_entropy: a wide row (1027 classes) on the vector exp") {
  // Many whole vectors and a tail of every build's width; logits over a range whose
  // exponentials span 30 orders of magnitude (above the flush to 0 at e^-80). Each probability is
  // within a few f32 ulp of the double loop's (gradient entries ~1 / 1027), the loss within 1e-6
  // relative.
  const int64_t batch = 3, classes = 1027;
  Tensor logits = random_tensor({batch, classes}, 63, -35.f, 35.f);
  std::vector<int32_t> label_v = random_labels(batch, classes, 64);
  Tensor labels = Tensor::from_ints(label_v, {batch});
  CrossEntropy want = ref_cross_entropy(to_double(logits), label_v, {}, classes, 0.0);
  Tensor loss = scalar(), dlogits = filled({batch, classes}, NAN);
  softmax_cross_entropy(loss, dlogits, logits, labels, Tensor(), 0.f);
  CHECK(loss.item() == doctest::Approx(want.loss).epsilon(1e-6));
  std::vector<float> got = dlogits.to_host_f32();
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(
        worst, std::fabs(got[i] - want.dlogits[i]) / std::max(std::fabs(want.dlogits[i]), 1e-30));
  CHECK(worst <= 2e-5);  // x - max rounded to f32 (|x| up to 35: 4e-6 absolute), then exp
}

TEST_CASE("kernels.softmax_cross_entropy: stable for huge logits, forward only, empty batch") {
  Tensor logits = tensor({1000.f, 0.f, -1000.f, 500.f, 500.f, 500.f}, {2, 3});
  Tensor labels = Tensor::from_ints({0, 2}, {2});
  Tensor loss = scalar(), no_grad;
  softmax_cross_entropy(loss, no_grad, logits, labels);
  CHECK(std::isfinite(loss.item()));
  CHECK(loss.item() == doctest::Approx(std::log(3.0) / 2));  // row 0 costs 0, row 1 log 3

  Tensor empty_logits = zeros({0, 5}), empty_grad = zeros({0, 5});
  Tensor empty_labels = Tensor::from_ints({}, {0});
  kernels::fill(loss, 42.f);
  softmax_cross_entropy(loss, empty_grad, empty_logits, empty_labels);
  CHECK(loss.item() == 0.f);

  Tensor bad = Tensor::from_ints({0, 3}, {2});
  CHECK_THROWS_WITH_AS(softmax_cross_entropy(loss, no_grad, logits, bad),
                       doctest::Contains("label 3 of row 1 is outside [0, 3)"), Error);
  Tensor negative = Tensor::from_ints({-1, 0}, {2});
  CHECK_THROWS_AS(softmax_cross_entropy(loss, no_grad, logits, negative), Error);

  // A masked class (-inf logit) costs nothing without smoothing: no 0 * inf in the loss.
  const float inf = std::numeric_limits<float>::infinity();
  Tensor masked = tensor({2.f, -inf, 0.f}, {1, 3});
  softmax_cross_entropy(loss, no_grad, masked, Tensor::from_ints({0}, {1}));
  CHECK(loss.item() == doctest::Approx(std::log1p(std::exp(-2.0))));
  Tensor token_loss = scalar();
  token_cross_entropy(token_loss, no_grad, masked, Tensor::from_ints({0}, {1}), -100);
  CHECK(token_loss.item() == loss.item());
}

TEST_CASE("kernels.softmax_cross_entropy: a bad label's error text, the first bad row") {
  // The CUDA backend throws this same text (at the next host read), so it is pinned here.
  Tensor logits = tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  Tensor loss = scalar(), dlogits = zeros({2, 3});
  for (auto [labels, text] :
       {std::pair<std::vector<int32_t>, std::string>{
            {0, 3}, "softmax_cross_entropy: label 3 of row 1 is outside [0, 3) for logits [2, 3]"},
        {{-1, 7},
         "softmax_cross_entropy: label -1 of row 0 is outside [0, 3) for logits [2, 3]"}}) {
    CAPTURE(text);
    std::string what;
    try {
      softmax_cross_entropy(loss, dlogits, logits, Tensor::from_ints(labels, {2}));
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(what.substr(0, what.rfind(" [")) == text);  // the text, before " [check ... at file]"
    CHECK(bad_label_text(labels[0] < 0 ? -1 : 3, labels[0] < 0 ? 0 : 1, 2, 3) == text);
  }
  // The engine stays usable: a good call right after works.
  softmax_cross_entropy(loss, dlogits, logits, Tensor::from_ints({0, 2}, {2}));
  CHECK(std::isfinite(loss.item()));
}

TEST_CASE("kernels.argmax: a row's first NaN is its argmax, as in PyTorch") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Tensor x = tensor({nan,  5,    7,    1,    //  NaN first
                     1,    nan,  7,    7,    //  a NaN before the maximum ([1, NaN, 7] gave 2)
                     nan,  nan,  nan,  nan,  //
                     -3,   -2,   nan,  -2,   //
                     inf,  1,    2,    nan,  //  above +inf too
                     -inf, -inf, -inf, -inf},
                    {6, 4});
  Tensor out = Tensor::zeros({6}, DType::i32, Device::cpu());
  argmax(out, x);
  CHECK(out.to_host_i32() == std::vector<int32_t>{0, 1, 0, 2, 3, 0});
  // count_correct follows the same rule (the cross-entropies' counts: kernels.loss_count).
  Tensor labels = Tensor::from_ints({0, 1, 0, 2, 3, 0}, {6});
  CHECK(count_correct(x, labels) == 6);
}

TEST_CASE("kernels.mse_loss: mean of squares and its gradient") {
  Shape shape{5, 3, 7};
  Tensor pred = random_tensor(shape, 70), target = random_tensor(shape, 71);
  std::vector<double> P = to_double(pred), T = to_double(target), grad(P.size());
  double want = 0.0;
  for (size_t i = 0; i < P.size(); ++i) {
    want += (P[i] - T[i]) * (P[i] - T[i]) / P.size();
    grad[i] = 2.0 * (P[i] - T[i]) / P.size();
  }
  Tensor loss = scalar(), dpred = zeros(shape), none;
  mse_loss(loss, dpred, pred, target);
  CHECK(loss.item() == doctest::Approx(want).epsilon(1e-6));
  CHECK(max_error(dpred, grad) <= 1e-7);
  mse_loss(loss, none, pred, target);
  CHECK(loss.item() == doctest::Approx(want).epsilon(1e-6));
  Tensor e = zeros({0, 4});
  mse_loss(loss, e, e, e);
  CHECK(loss.item() == 0.f);
  CHECK_THROWS_WITH_AS(mse_loss(loss, none, pred, zeros({5, 3})),
                       doctest::Contains("[5, 3, 7] vs target [5, 3]"), Error);
}

TEST_CASE("kernels.reduce: sum and mean, bitwise equal for any thread count") {
  const int64_t n = 300007;  // many chunks
  Tensor x = random_tensor({n}, 80, -1.f, 3.f);
  std::vector<double> X = to_double(x);
  double want = 0.0;
  for (double v : X) want += v;
  Tensor s1 = scalar(), s2 = scalar(), m = scalar();
  with_cpu_threads(1, [&] { kernels::sum(s1, x); });
  with_cpu_threads(2, [&] { kernels::sum(s2, x); });
  CHECK(s1.item() == doctest::Approx(want).epsilon(1e-7));
  CHECK(bitwise_equal(s1, s2));
  kernels::mean(m, x);
  CHECK(m.item() == doctest::Approx(want / n).epsilon(1e-7));
  Tensor e = zeros({0});
  kernels::fill(s1, 5.f);
  kernels::sum(s1, e);
  kernels::mean(m, e);
  CHECK(s1.item() == 0.f);
  CHECK(m.item() == 0.f);
  Tensor two = zeros({2});
  CHECK_THROWS_WITH_AS(kernels::sum(two, x), doctest::Contains("one element, got [2]"), Error);
}

TEST_CASE("kernels.clip_by_norm: norm and factor from a sum of squares on the device") {
  // ss = 100, unscale 0.5: norm 5; over max_norm 2 the factor is 2 / (5 + 1e-6).
  Tensor g = tensor({6.f, -8.f}, {2}), ss = tensor({100.f}, {1}), norm = scalar();
  clip_by_norm(g, norm, ss, 2.f, 0.5f);
  CHECK(norm.item() == 5.f);
  const float factor = static_cast<float>(2.0 / (5.0 + 1e-6));
  CHECK(g.to_host_f32() == std::vector<float>{factor * 6.f, factor * -8.f});
  // At or under the bound, or a NaN norm: untouched.
  for (float bad : {25.f, NAN}) {
    CAPTURE(bad);
    Tensor kept = tensor({6.f, -8.f}, {2}), s = tensor({bad}, {1});
    clip_by_norm(kept, s, s, 5.f, 1.f);  // the norm overwrites the sum it came from
    CHECK(kept.to_host_f32() == std::vector<float>{6.f, -8.f});
    CHECK((std::isnan(bad) ? std::isnan(s.item()) : s.item() == std::sqrt(bad)));
  }
  // Finite gradients whose f32 sum of squares overflows (a norm of about 2.8e20): the norm
  // reads infinite, and the factor is PyTorch's max_norm / (inf + 1e-6) = 0, not 1 (which left
  // them at 2e20); an infinite gradient becomes NaN, as in PyTorch, for the step's check.
  {
    Tensor huge = tensor({2e20f, -2e20f, 1.f, -3.f}, {4}), s = scalar();
    sum_squares(s, huge);
    CHECK(std::isinf(s.item()));
    clip_by_norm(huge, s, s, 1.f, 1.f);
    CHECK(std::isinf(s.item()));
    const std::vector<float> got = huge.to_host_f32();
    CHECK(got == std::vector<float>{0.f, 0.f, 0.f, 0.f});
    CHECK(std::signbit(got[1]));  // -2e20 * 0: as PyTorch's mul_(0)
    Tensor inf = tensor({INFINITY, 1.f}, {2}), s2 = tensor({INFINITY}, {1});
    clip_by_norm(inf, s2, s2, 5.f, 1.f);
    CHECK(std::isnan(inf.to_host_f32()[0]));
    CHECK(inf.to_host_f32()[1] == 0.f);
  }
  Tensor empty = zeros({0});
  clip_by_norm(empty, norm, tensor({0.f}, {1}), 1.f, 1.f);
  CHECK(norm.item() == 0.f);
  CHECK_THROWS_WITH_AS(clip_by_norm(g, norm, ss, 0.f, 1.f), doctest::Contains("max_norm 0"), Error);
  Tensor two = zeros({2});
  CHECK_THROWS_WITH_AS(clip_by_norm(g, two, ss, 1.f, 1.f),
                       doctest::Contains("norm_out must have one element, got [2]"), Error);
  Tensor ints = Tensor::zeros({2}, DType::i32, Device::cpu());
  CHECK_THROWS_WITH_AS(clip_by_norm(ints, norm, ss, 1.f, 1.f),
                       doctest::Contains("grads must be f32"), Error);
}

TEST_CASE("kernels.argmax and count_correct: first maximum on ties") {
  Tensor x = tensor({1, 3, 3, 0,      //
                     -5, -7, -5, -6,  //
                     0, 0, 0, 0,      //
                     2, 1, 9, 9},
                    {4, 4});
  Tensor out = Tensor::zeros({4}, DType::i32, Device::cpu());
  argmax(out, x);
  CHECK(out.to_host_i32() == std::vector<int32_t>{1, 0, 0, 2});
  CHECK(count_correct(x, Tensor::from_ints({1, 0, 0, 2}, {4})) == 4);
  CHECK(count_correct(x, Tensor::from_ints({2, 0, 1, 3}, {4})) == 1);
  // A larger batch against a plain loop.
  const int64_t batch = 1001, classes = 17;
  Tensor big = random_tensor({batch, classes}, 81);
  std::vector<int32_t> labels = random_labels(batch, classes, 82);
  std::vector<float> B = big.to_host_f32();
  int64_t want = 0;
  for (int64_t i = 0; i < batch; ++i) {
    auto row = B.begin() + i * classes;
    want += std::max_element(row, row + classes) - row == labels[i];
  }
  CHECK(count_correct(big, Tensor::from_ints(labels, {batch})) == want);
  CHECK(count_correct(zeros({0, 3}), Tensor::from_ints({}, {0})) == 0);
  CHECK_THROWS_WITH_AS(argmax(out, zeros({3, 4})), doctest::Contains("out must be [3], got [4]"),
                       Error);
  CHECK_THROWS_WITH_AS(count_correct(x, zeros({4})), doctest::Contains("labels must be i32"),
                       Error);
}

TEST_CASE("kernels.loss_count: the cross-entropies count in their pass what count_correct counts") {
  int checks = 0;
  loss_count::run(Device::cpu(), [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 3 * 5 * 2 * 6);
  // An empty batch counts nothing; a count that is not (1) f32 on the logits' device is refused.
  Tensor loss = filled({1}, 3.f), right = filled({1}, 3.f), none;
  softmax_cross_entropy(loss, none, zeros({0, 3}), Tensor::from_ints({}, {0}), Tensor(), 0.f,
                        right);
  CHECK(right.item() == 0.f);
  right = filled({1}, 3.f);
  token_cross_entropy(loss, none, zeros({0, 3}), Tensor::from_ints({}, {0}), -1, right);
  CHECK(right.item() == 0.f);
  Tensor two = zeros({2});
  CHECK_THROWS_WITH_AS(softmax_cross_entropy(loss, none, zeros({2, 3}),
                                             Tensor::from_ints({0, 1}, {2}), Tensor(), 0.f, two),
                       doctest::Contains("correct must have one element, got [2]"), Error);
  CHECK_THROWS_WITH_AS(
      token_cross_entropy(loss, none, zeros({2, 3}), Tensor::from_ints({0, 1}, {2}), -1,
                          Tensor::zeros({1}, DType::i32, Device::cpu())),
      doctest::Contains("correct must be f32"), Error);
}

TEST_CASE("kernels.loss_scale: the cross-entropies multiply their gradient before its rounding") {
  int checks = 0;
  loss_scale::run(Device::cpu(), [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 66);
  // A factor on the device is one f32 value on the logits' device.
  Tensor loss = scalar(), dx = zeros({2, 3}), x = zeros({2, 3});
  Tensor y = Tensor::from_ints({0, 1}, {2});
  CHECK_THROWS_WITH_AS(
      softmax_cross_entropy(loss, dx, x, y, Tensor(), 0.f, Tensor(), Scalar(zeros({2}))),
      doctest::Contains("scalar grad_scale"), Error);
  CHECK_THROWS_WITH_AS(token_cross_entropy(loss, dx, x, y, -1, Tensor(),
                                           Scalar(Tensor::zeros({1}, DType::f32, Device::cpu(1)))),
                       doctest::Contains("must be one f32 element on cpu:0"), Error);
}

TEST_CASE("kernels.all_finite: NaN and inf anywhere, any floating dtype") {
  const int64_t n = 50001;
  Tensor x = random_tensor({n}, 90);
  CHECK(all_finite(x));
  CHECK(all_finite(zeros({0})));
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    Tensor y = x.clone();
    y.data<float>()[n - 1] = bad;
    CHECK_FALSE(all_finite(y));
    CHECK_FALSE(all_finite(cast(y, DType::bf16)));
    CHECK_FALSE(all_finite(cast(y, DType::f16)));
  }
  CHECK(all_finite(cast(x, DType::f16)));
  CHECK_FALSE(all_finite(cast(tensor({1e6f}, {1}), DType::f16)));  // overflows f16
}

TEST_CASE("kernels.set_values: writes n values, leaves the rest, checks its arguments") {
  Tensor dst = filled({40}, -1.f);
  std::vector<float> values(kMaxValues);
  for (int i = 0; i < kMaxValues; ++i) values[i] = 1.f / static_cast<float>(i + 3);
  set_values(dst, values.data(), 5);
  std::vector<float> got = dst.to_host_f32();
  for (int i = 0; i < 5; ++i) CHECK(got[i] == values[i]);
  CHECK(got[5] == -1.f);
  set_values(dst, values.data(), kMaxValues);
  got = dst.to_host_f32();
  CHECK(std::vector<float>(got.begin(), got.begin() + kMaxValues) == values);
  CHECK(got[kMaxValues] == -1.f);
  std::vector<float> more(kMaxValues + 1, 0.f);
  CHECK_THROWS_WITH_AS(set_values(dst, more.data(), kMaxValues + 1),
                       doctest::Contains("33 values into dst"), Error);
  Tensor small = zeros({2});
  CHECK_THROWS_WITH_AS(set_values(small, values.data(), 3), doctest::Contains("3 values into dst"),
                       Error);
  Tensor ints = Tensor::zeros({4}, DType::i32, Device::cpu());
  CHECK_THROWS_WITH_AS(set_values(ints, values.data(), 1), doctest::Contains("dst must be f32"),
                       Error);
}

TEST_CASE("kernels.sgd_scalars and adamw_scalars: the host formulas, step checked") {
  SgdConfig sgd;
  sgd.lr = 0.25f;
  sgd.grad_unscale = 0.5f;
  CHECK(sgd_scalars(sgd, 1) == std::array<float, SgdScalar::count>{0.25f, 0.5f, 1.f});
  CHECK(sgd_scalars(sgd, 2)[SgdScalar::first_step] == 0.f);
  AdamWConfig c;
  c.lr = 0.01f;
  c.beta1 = 0.9f;
  c.beta2 = 0.99f;
  AdamWGroups groups;
  groups.count = 2;
  groups.lr_scale[1] = 0.5f;
  groups.weight_decay[0] = 0.1f;
  const auto s = adamw_scalars(c, groups, 3);
  CHECK(s[AdamWScalar::correction2_sqrt] ==
        static_cast<float>(std::sqrt(1.0 - std::pow(double{0.99f}, 3.0))));
  CHECK(s[AdamWScalar::decay] == static_cast<float>(1.0 - double{0.01f} * double{0.1f}));
  CHECK(s[AdamWScalar::decay + 1] == 1.f);
  CHECK(s[AdamWScalar::step_size + 1] ==
        static_cast<float>(double{0.01f} * 0.5 / (1.0 - std::pow(double{0.9f}, 3.0))));
  CHECK_THROWS_WITH_AS(adamw_scalars(c, groups, 0), doctest::Contains("step must be >= 1"), Error);
  groups.count = kMaxAdamWGroups + 1;
  CHECK_THROWS_WITH_AS(adamw_scalars(c, groups, 1), doctest::Contains("9 groups"), Error);
}

TEST_CASE("kernels.sgd_update: plain, weight decay, momentum, dampening, nesterov") {
  Tensor grads = tensor({0.5f, -1.f}, {2});
  SUBCASE("plain with weight decay") {
    Tensor p = tensor({1.f, 2.f}, {2}), unused;
    SgdConfig c;
    c.lr = 0.1f;
    c.weight_decay = 0.01f;
    dp_test::sgd_step(p, grads, unused, c, 1);
    // g = grad + 0.01 p: (0.51, -0.98); p -= 0.1 g
    CHECK(p.to_host_f32()[0] == doctest::Approx(1.f - 0.051f));
    CHECK(p.to_host_f32()[1] == doctest::Approx(2.f + 0.098f));
  }
  SUBCASE("momentum with dampening: the first step takes the gradient as is") {
    Tensor p = tensor({1.f, 2.f}, {2}), buf = filled({2}, 123.f);
    SgdConfig c;
    c.lr = 0.1f;
    c.momentum = 0.9f;
    c.dampening = 0.5f;
    dp_test::sgd_step(p, grads, buf, c, 1);
    CHECK(buf.to_host_f32() == std::vector<float>{0.5f, -1.f});
    CHECK(p.to_host_f32()[0] == doctest::Approx(0.95));
    dp_test::sgd_step(p, grads, buf, c, 2);
    // buf = 0.9 buf + 0.5 g = (0.7, -1.4); p -= 0.1 buf
    CHECK(buf.to_host_f32()[0] == doctest::Approx(0.7));
    CHECK(buf.to_host_f32()[1] == doctest::Approx(-1.4));
    CHECK(p.to_host_f32()[0] == doctest::Approx(0.95 - 0.07));
    CHECK(p.to_host_f32()[1] == doctest::Approx(2.1 + 0.14));
  }
  SUBCASE("nesterov") {
    Tensor p = tensor({1.f, 2.f}, {2}), buf = zeros({2});
    SgdConfig c;
    c.lr = 0.1f;
    c.momentum = 0.9f;
    c.nesterov = Nesterov::yes;
    dp_test::sgd_step(p, grads, buf, c, 1);
    // buf = g; step = g + 0.9 buf = 1.9 g
    CHECK(p.to_host_f32()[0] == doctest::Approx(1.0 - 0.1 * 1.9 * 0.5));
    dp_test::sgd_step(p, grads, buf, c, 2);
    // buf = 0.9 g + g = 1.9 g; step = g + 0.9 * 1.9 g = 2.71 g
    CHECK(buf.to_host_f32()[1] == doctest::Approx(-1.9));
    CHECK(p.to_host_f32()[1] == doctest::Approx(2.0 + 0.19 + 0.271));
  }
  Tensor p = zeros({2}), unused;
  SgdConfig momentum;
  momentum.momentum = 0.9f;
  CHECK_THROWS_WITH_AS(dp_test::sgd_step(p, grads, unused, momentum, 1),
                       doctest::Contains("momentum_buf"), Error);
  CHECK_THROWS_WITH_AS(dp_test::sgd_step(p, grads, unused, SgdConfig{}, 0),
                       doctest::Contains("step must be >= 1"), Error);
  CHECK_THROWS_WITH_AS(dp_test::sgd_step(p, zeros({3}), unused, SgdConfig{}, 1),
                       doctest::Contains("params [2] vs grads [3]"), Error);
}

// Multiplying by 0.25 is exact in f32 (a power of two, no subnormals here), so a step on grads
// with grad_unscale = 0.25 and a step on grads * 0.25 with grad_unscale = 1 see the same g: the
// same bits, for SGD (weight decay, momentum, nesterov) and AdamW, over three steps.
TEST_CASE("kernels.sgd_update and adamw_update: grad_unscale multiplies the gradients first") {
  const int64_t n = 1000;
  auto grads_at = [&](int64_t step, float scale) {
    Tensor g = random_tensor({n}, 230 + static_cast<uint32_t>(step), -4.f, 4.f);
    kernels::scale(g, g, scale);
    return g;
  };
  SgdConfig sgd;
  sgd.lr = 0.05f;
  sgd.momentum = 0.9f;
  sgd.weight_decay = 1e-2f;
  sgd.nesterov = Nesterov::yes;
  SgdConfig sgd_unscaled = sgd;
  sgd_unscaled.grad_unscale = 0.25f;
  Tensor p1 = random_tensor({n}, 229), p2 = p1.clone(), b1 = zeros({n}), b2 = zeros({n});
  AdamWConfig adam;
  adam.lr = 1e-2f;
  AdamWConfig adam_unscaled = adam;
  adam_unscaled.grad_unscale = 0.25f;
  Tensor q1 = random_tensor({n}, 228), q2 = q1.clone();
  Tensor m1 = zeros({n}), m2 = zeros({n}), v1 = zeros({n}), v2 = zeros({n});
  for (int64_t step = 1; step <= 3; ++step) {
    dp_test::sgd_step(p1, grads_at(step, 1.f), b1, sgd_unscaled, step);
    dp_test::sgd_step(p2, grads_at(step, 0.25f), b2, sgd, step);
    dp_test::adamw_step(q1, grads_at(step, 1.f), m1, v1, adam_unscaled, step);
    dp_test::adamw_step(q2, grads_at(step, 0.25f), m2, v2, adam, step);
  }
  CHECK(bitwise_equal(p1, p2));
  CHECK(bitwise_equal(b1, b2));
  CHECK(bitwise_equal(q1, q2));
  CHECK(bitwise_equal(m1, m2));
  CHECK(bitwise_equal(v1, v2));
  CHECK_FALSE(bitwise_equal(p1, random_tensor({n}, 229)));  // the steps did move p
}

TEST_CASE("kernels.compute_copy: the fused steps write cast()'s 16-bit copy, nothing else moved") {
  int checks = 0;
  compute_copy::run(Device::cpu(), [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 3 * 2 * 2 * 11);
  // A copy that is not 16-bit, or of another size, is refused by name.
  Tensor p = zeros({8}), g = zeros({8}), m = zeros({8}), v = zeros({8});
  AdamWConfig c;
  c.compute_copy = zeros({8});
  CHECK_THROWS_WITH_AS(dp_test::adamw_step(p, g, m, v, c, 1),
                       doctest::Contains("adamw_update: compute_copy Tensor(f32, cpu:0, [8]) must "
                                         "be f16 or bf16"),
                       Error);
  c.compute_copy = zeros({7}, DType::bf16);
  CHECK_THROWS_WITH_AS(dp_test::adamw_step(p, g, m, v, c, 1),
                       doctest::Contains("must hold the 8 values of params"), Error);
  SgdConfig s;
  s.compute_copy = Tensor::zeros({8}, DType::bf16, Device::cpu(1));
  Tensor none;
  CHECK_THROWS_WITH_AS(dp_test::sgd_step(p, g, none, s, 1), doctest::Contains("compute_copy"),
                       Error);
}

TEST_CASE("kernels.adamw_update: two steps against hand-computed values") {
  AdamWConfig c;
  c.lr = 0.01f;
  c.beta1 = 0.9f;
  c.beta2 = 0.99f;
  c.eps = 1e-8f;
  c.weight_decay = 0.1f;
  Tensor p = tensor({1.f, -2.f, 0.f}, {3}), m = zeros({3}), v = zeros({3});
  Tensor g1 = tensor({0.5f, 0.25f, -1.f}, {3}), g2 = tensor({-0.5f, 0.5f, 2.f}, {3});
  std::vector<double> P{1.0, -2.0, 0.0}, M(3, 0.0), V(3, 0.0);
  const std::vector<double> G[2] = {{0.5, 0.25, -1.0}, {-0.5, 0.5, 2.0}};
  for (int t = 1; t <= 2; ++t) {
    dp_test::adamw_step(p, t == 1 ? g1 : g2, m, v, c, t);
    for (int i = 0; i < 3; ++i) {
      const double g = G[t - 1][i];
      P[i] *= 1.0 - 0.01 * 0.1;
      M[i] = 0.9 * M[i] + 0.1 * g;
      V[i] = 0.99 * V[i] + 0.01 * g * g;
      double m_hat = M[i] / (1.0 - std::pow(0.9, t)), v_hat = V[i] / (1.0 - std::pow(0.99, t));
      P[i] -= 0.01 * m_hat / (std::sqrt(v_hat) + 1e-8);
    }
    CHECK(max_error(p, P) <= 1e-6);
    CHECK(max_error(m, M) <= 1e-7);
    CHECK(max_error(v, V) <= 1e-7);
    // Adam's first step moves every parameter by about lr, against its gradient's sign.
    if (t == 1) CHECK(p.to_host_f32()[2] == doctest::Approx(0.01).epsilon(1e-5));
  }
  Tensor wrong = zeros({3}, DType::bf16);
  CHECK_THROWS_WITH_AS(dp_test::adamw_step(p, g1, wrong, v, c, 1),
                       doctest::Contains("m must be f32"), Error);
}

TEST_CASE("kernels.token_cross_entropy: chunks given the batch's kept count add up to the batch") {
  // The chunked classifier (nn::Gpt, GptConfig::loss_chunk): each chunk of rows is one call
  // given the whole batch's count of kept rows (count_kept), so each row's gradient has the bits
  // of one call over the batch, and the chunks' losses and counts add up to the batch's.
  const int64_t rows = 23, vocab = 37;
  std::vector<int32_t> t = random_labels(rows, vocab, 5);
  int64_t kept_rows = rows;
  for (int64_t r = 2; r < rows; r += 5, --kept_rows) t[r] = -1;  // ignored
  const Tensor targets = Tensor::from_ints(t, {rows});
  Tensor kept = zeros({1});
  count_kept(kept, targets, -1);
  CHECK(kept.item() == static_cast<float>(kept_rows));
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dt);
    const Tensor logits = cast(random_tensor({rows, vocab}, 7, -4.f, 4.f), dt);
    const Scalar grad_scale(2.f);
    Tensor whole = zeros({1}), right = zeros({1}), dwhole = zeros({rows, vocab}, dt);
    token_cross_entropy(whole, dwhole, logits, targets, -1, right, grad_scale);
    Tensor dchunks = filled({rows, vocab}, 7.f);
    if (dt != DType::f32) dchunks = cast(dchunks, dt);
    double loss = 0;
    float counted = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 7) {
      const int64_t r1 = std::min(rows, r0 + 7);
      Tensor part = zeros({1}), part_right = zeros({1}), d = dchunks.slice(r0, r1);
      token_cross_entropy(part, d, logits.slice(r0, r1), targets.slice(r0, r1), -1, part_right,
                          grad_scale, kept);
      loss += part.item();
      counted += part_right.item();
    }
    CHECK(bitwise_equal(dchunks, dwhole));
    CHECK(loss == doctest::Approx(whole.item()).epsilon(1e-6));
    CHECK(counted == right.item());
  }
  // A batch with every row ignored: count 0, loss 0 and a zero gradient.
  const Tensor ignored = Tensor::from_ints(std::vector<int32_t>(4, -1), {4});
  count_kept(kept, ignored, -1);
  CHECK(kept.item() == 0.f);
  Tensor loss = filled({1}, 3.f), d = filled({4, 5}, 7.f);
  token_cross_entropy(loss, d, random_tensor({4, 5}, 8), ignored, -1, Tensor(), Scalar(), kept);
  CHECK(loss.item() == 0.f);
  CHECK(d.to_host_f32() == std::vector<float>(20, 0.f));
  // A count that is not (1) f32, and targets that are not (N) i32, are refused by name.
  Tensor none;
  CHECK_THROWS_WITH_AS(token_cross_entropy(loss, none, random_tensor({4, 5}, 8), ignored, -1,
                                           Tensor(), Scalar(), zeros({2})),
                       doctest::Contains("kept must have one element, got [2]"), Error);
  CHECK_THROWS_WITH_AS(count_kept(kept, zeros({4}), -1), doctest::Contains("targets must be i32"),
                       Error);
  // A count that f32 would round (over 2^24 targets) is refused, naming the targets' count.
  const Tensor many = Tensor::empty({(int64_t{1} << 24) + 1}, DType::i32, Device::cpu());
  CHECK_THROWS_WITH_AS(count_kept(kept, many, -1),
                       doctest::Contains("16777217 targets: the f32 count is exact up to 16777216"),
                       Error);
}
