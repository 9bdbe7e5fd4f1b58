// kernels.tensor_ops: the broadcasting op set (kernels/tensor_ops.hpp) on the CPU backend against
// double loops: unary ops and their derivatives, binary ops with broadcasting on any dims and
// their reduced gradients, where, reductions and softmax over any dim, strided copies, 16-bit
// inputs, and the refusals.
#include <cmath>
#include <functional>

#include "kernels/tensor_ops.hpp"
#include "tests/test_util.hpp"

using namespace kernels;

namespace {

Tensor rnd(const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed, lo, hi), s);
}
std::vector<double> host(const Tensor& t) {
  std::vector<float> v = t.to_host_f32();
  return std::vector<double>(v.begin(), v.end());
}
float max_rel(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(1.0, std::fabs(want[i])));
  return static_cast<float>(worst);
}
// The coordinates of linear index i in `shape`, and the linear index in `s` (right-aligned,
// broadcast) of those coordinates.
std::vector<int64_t> coords(int64_t i, const Shape& shape) {
  std::vector<int64_t> c(shape.size());
  for (size_t k = shape.size(); k-- > 0;) c[k] = i % shape[k], i /= shape[k];
  return c;
}
int64_t index_in(const std::vector<int64_t>& c, const Shape& s) {
  const size_t lead = c.size() - s.size();
  int64_t at = 0;
  for (size_t k = 0; k < s.size(); ++k) at = at * s[k] + (s[k] == 1 ? 0 : c[lead + k]);
  return at;
}

double ref_unary(UnaryOp op, double x, UnaryParams p) {
  switch (op) {
    case UnaryOp::identity:
      return x;
    case UnaryOp::affine:
      return p.a * x + p.b;
    case UnaryOp::exp:
      return std::exp(x);
    case UnaryOp::log:
      return std::log(x);
    case UnaryOp::sqrt:
      return std::sqrt(x);
    case UnaryOp::rsqrt:
      return 1.0 / std::sqrt(x);
    case UnaryOp::reciprocal:
      return 1.0 / x;
    case UnaryOp::neg:
      return -x;
    case UnaryOp::abs:
      return std::fabs(x);
    case UnaryOp::pow:
      return std::pow(x, double{p.a});
    case UnaryOp::sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
    case UnaryOp::tanh:
      return std::tanh(x);
    case UnaryOp::silu:
      return x / (1.0 + std::exp(-x));
    case UnaryOp::gelu_erf:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case UnaryOp::gelu_tanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case UnaryOp::relu:
      return x > 0 ? x : 0.0;
  }
  return 0.0;
}

}  // namespace

TEST_CASE("kernels.tensor_ops: unary ops and their derivatives match double (central difference)") {
  const Shape s{3, 37};
  // Positive inputs for log, sqrt, rsqrt, reciprocal and pow; both signs for the rest.
  for (int o = 0; o <= static_cast<int>(UnaryOp::relu); ++o) {
    const UnaryOp op = static_cast<UnaryOp>(o);
    CAPTURE(unary_name(op));
    const bool positive = op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt ||
                          op == UnaryOp::reciprocal || op == UnaryOp::pow;
    const UnaryParams p{op == UnaryOp::pow ? 1.7f : 0.75f, -0.25f};
    Tensor x = positive ? rnd(s, 5, 0.2f, 3.f) : rnd(s, 5, -3.f, 3.f);
    Tensor y = Tensor::empty(s, DType::f32, Device::cpu()), dy = rnd(s, 6);
    unary(y, x, op, p);
    Tensor dx = rnd(s, 7), dx0 = Tensor::from_vector(dx.to_host_f32(), s);
    unary_backward(dx, dy, x, y, op, p, Accumulate::yes);
    const auto xs = host(x), dys = host(dy), dx0s = host(dx0);
    std::vector<double> want_y(xs.size()), want_dx(xs.size());
    for (size_t i = 0; i < xs.size(); ++i) {
      want_y[i] = ref_unary(op, xs[i], p);
      const double h = 1e-6 * std::max(1.0, std::fabs(xs[i]));
      const double d = (ref_unary(op, xs[i] + h, p) - ref_unary(op, xs[i] - h, p)) / (2 * h);
      want_dx[i] = dx0s[i] + dys[i] * d;
    }
    CHECK(max_rel(y.to_host_f32(), want_y) <= 2e-6f);
    CHECK(max_rel(dx.to_host_f32(), want_dx) <= 2e-5f);
  }
}

TEST_CASE(
    "kernels.tensor_ops: binary ops broadcast on any dims, gradients sum over the broadcast") {
  struct Case {
    Shape a, b;
  };
  for (const Case& c : {Case{{4, 1, 5}, {3, 1}}, Case{{2, 3, 4}, {2, 3, 4}}, Case{{6}, {2, 3, 1}},
                        Case{{1}, {5, 7}}, Case{{2, 1, 3, 1}, {1, 4, 1, 5}}}) {
    const Shape out = broadcast_shape(c.a, c.b);
    for (int o = 0; o <= static_cast<int>(BinaryOp::minimum); ++o) {
      const BinaryOp op = static_cast<BinaryOp>(o);
      CAPTURE(binary_name(op));
      CAPTURE(shape_str(c.a));
      CAPTURE(shape_str(c.b));
      Tensor a = rnd(c.a, 11, -2.f, 2.f), b = rnd(c.b, 12, 0.5f, 2.f), dy = rnd(out, 13);
      Tensor y = Tensor::empty(out, DType::f32, Device::cpu());
      binary(y, a, b, op);
      Tensor da = Tensor::zeros(c.a, DType::f32, Device::cpu()), db = rnd(c.b, 14);
      const auto db0 = host(db);
      binary_backward(da, Operand::a, dy, a, b, op, Accumulate::no);
      binary_backward(db, Operand::b, dy, a, b, op, Accumulate::yes);
      const auto as = host(a), bs = host(b), dys = host(dy);
      std::vector<double> want_y(static_cast<size_t>(shape_numel(out)));
      std::vector<double> want_da(as.size(), 0.0), want_db = db0;
      for (int64_t i = 0; i < shape_numel(out); ++i) {
        const auto cc = coords(i, out);
        const int64_t ia = index_in(cc, c.a), ib = index_in(cc, c.b);
        const double va = as[ia], vb = bs[ib], g = dys[i];
        double v = 0, pa = 0, pb = 0;
        switch (op) {
          case BinaryOp::add:
            v = va + vb, pa = 1, pb = 1;
            break;
          case BinaryOp::sub:
            v = va - vb, pa = 1, pb = -1;
            break;
          case BinaryOp::mul:
            v = va * vb, pa = vb, pb = va;
            break;
          case BinaryOp::div:
            v = va / vb, pa = 1 / vb, pb = -va / (vb * vb);
            break;
          case BinaryOp::maximum:
            v = std::max(va, vb), pa = va >= vb, pb = va < vb;
            break;
          case BinaryOp::minimum:
            v = std::min(va, vb), pa = va <= vb, pb = va > vb;
            break;
        }
        want_y[i] = v;
        want_da[ia] += g * pa;
        want_db[ib] += g * pb;
      }
      CHECK(max_rel(y.to_host_f32(), want_y) <= 1e-6f);
      CHECK(max_rel(da.to_host_f32(), want_da) <= 1e-5f);
      CHECK(max_rel(db.to_host_f32(), want_db) <= 1e-5f);
    }
  }
}

TEST_CASE("kernels.tensor_ops: where selects and routes the gradient, the mask broadcasts") {
  const Shape s{3, 4, 5};
  Tensor mask = Tensor::from_vector({1, 0, 0, 1, 1}, {5}), a = rnd(s, 21), b = rnd({4, 1}, 22);
  Tensor y = Tensor::empty(s, DType::f32, Device::cpu()), dy = rnd(s, 23);
  where(y, mask, a, b);
  Tensor da = Tensor::empty(s, DType::f32, Device::cpu()),
         db = Tensor::empty({4, 1}, DType::f32, Device::cpu());
  where_backward(da, Operand::a, dy, mask, Accumulate::no);
  where_backward(db, Operand::b, dy, mask, Accumulate::no);
  const auto ms = host(mask), as = host(a), bs = host(b), dys = host(dy);
  std::vector<double> want_y(as.size()), want_da(as.size()), want_db(4, 0.0);
  for (int64_t i = 0; i < shape_numel(s); ++i) {
    const auto c = coords(i, s);
    const bool m = ms[c[2]] != 0;
    want_y[i] = m ? as[i] : bs[c[1]];
    want_da[i] = m ? dys[i] : 0.0;
    if (!m) want_db[c[1]] += dys[i];
  }
  CHECK(max_rel(y.to_host_f32(), want_y) == 0.f);
  CHECK(max_rel(da.to_host_f32(), want_da) == 0.f);
  CHECK(max_rel(db.to_host_f32(), want_db) <= 1e-6f);
}

TEST_CASE("kernels.tensor_ops: sum, mean, max and (log-)softmax over each dim, with gradients") {
  const Shape s{3, 4, 5};
  Tensor x = rnd(s, 31, -3.f, 3.f);
  const auto xs = host(x);
  for (int dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    Shape rs = s;
    rs[dim] = 1;
    const int64_t n = s[dim];
    auto at = [&](int64_t r, int64_t j) {  // element j along dim of reduced position r
      auto c = coords(r, rs);
      c[dim] = j;
      int64_t i = 0;
      for (int k = 0; k < 3; ++k) i = i * s[k] + c[k];
      return i;
    };
    for (int o = 0; o <= static_cast<int>(ReduceOp::max); ++o) {
      const ReduceOp op = static_cast<ReduceOp>(o);
      CAPTURE(reduce_name(op));
      Tensor y = Tensor::empty(rs, DType::f32, Device::cpu()), dy = rnd(rs, 32);
      reduce(y, x, dim, op);
      Tensor dx = Tensor::empty(s, DType::f32, Device::cpu());
      reduce_backward(dx, dy, x, y, dim, op, Accumulate::no);
      const auto dys = host(dy);
      std::vector<double> want_y(dys.size()), want_dx(xs.size());
      for (int64_t r = 0; r < shape_numel(rs); ++r) {
        double acc = op == ReduceOp::max ? -1e30 : 0.0;
        for (int64_t j = 0; j < n; ++j)
          acc = op == ReduceOp::max ? std::max(acc, xs[at(r, j)]) : acc + xs[at(r, j)];
        want_y[r] = op == ReduceOp::mean ? acc / n : acc;
        for (int64_t j = 0; j < n; ++j)
          want_dx[at(r, j)] = op == ReduceOp::sum    ? dys[r]
                              : op == ReduceOp::mean ? dys[r] / n
                                                     : (xs[at(r, j)] == want_y[r] ? dys[r] : 0.0);
      }
      CHECK(max_rel(y.to_host_f32(), want_y) <= 1e-6f);
      CHECK(max_rel(dx.to_host_f32(), want_dx) <= 1e-6f);
    }
    for (Softmax kind : {Softmax::softmax, Softmax::log_softmax}) {
      CAPTURE(static_cast<int>(kind));
      Tensor y = Tensor::empty(s, DType::f32, Device::cpu()), dy = rnd(s, 33);
      softmax(y, x, dim, kind);
      Tensor dx = Tensor::empty(s, DType::f32, Device::cpu());
      softmax_backward(dx, dy, y, dim, kind, Accumulate::no);
      const auto dys = host(dy);
      std::vector<double> want_y(xs.size()), want_dx(xs.size());
      for (int64_t r = 0; r < shape_numel(rs); ++r) {
        double m = -1e30, z = 0.0, dot = 0.0, sdy = 0.0;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, xs[at(r, j)]);
        for (int64_t j = 0; j < n; ++j) z += std::exp(xs[at(r, j)] - m);
        for (int64_t j = 0; j < n; ++j) {
          const double p = std::exp(xs[at(r, j)] - m) / z;
          want_y[at(r, j)] = kind == Softmax::softmax ? p : std::log(p);
          dot += dys[at(r, j)] * p, sdy += dys[at(r, j)];
        }
        for (int64_t j = 0; j < n; ++j) {
          const double p = std::exp(xs[at(r, j)] - m) / z, g = dys[at(r, j)];
          want_dx[at(r, j)] = kind == Softmax::softmax ? p * (g - dot) : g - p * sdy;
        }
      }
      CHECK(max_rel(y.to_host_f32(), want_y) <= 2e-6f);
      CHECK(max_rel(dx.to_host_f32(), want_dx) <= 2e-6f);
    }
  }
}

TEST_CASE("kernels.tensor_ops: strided copies transpose, narrow, expand and accumulate") {
  Tensor x = rnd({2, 3, 4}, 41);
  const auto xs = host(x);
  // Transpose of the last two dims: y (2, 4, 3).
  Layout src = contiguous_layout({2, 3, 4});
  std::swap(src.shape[1], src.shape[2]);
  std::swap(src.stride[1], src.stride[2]);
  Tensor y = Tensor::empty({2, 4, 3}, DType::f32, Device::cpu());
  strided_copy(y, contiguous_layout({2, 4, 3}), x, src, Accumulate::no);
  std::vector<double> want(xs.size());
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 3; ++j) want[(b * 4 + i) * 3 + j] = xs[(b * 3 + j) * 4 + i];
  CHECK(max_rel(y.to_host_f32(), want) == 0.f);
  // Adding it back through the same view doubles x.
  Tensor x2 = Tensor::from_vector(x.to_host_f32(), {2, 3, 4});
  strided_copy(x2, src, y, contiguous_layout({2, 4, 3}), Accumulate::yes);
  std::vector<double> twice(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) twice[i] = 2 * xs[i];
  CHECK(max_rel(x2.to_host_f32(), twice) == 0.f);
  // Narrow along dim 2 ([1, 3)) and an expand (stride 0) of a row.
  Layout nar = contiguous_layout({2, 3, 4});
  nar.shape[2] = 2;
  nar.offset = 1;
  Tensor n = Tensor::empty({2, 3, 2}, DType::f32, Device::cpu());
  strided_copy(n, contiguous_layout({2, 3, 2}), x, nar, Accumulate::no);
  std::vector<double> want_n;
  for (int r = 0; r < 6; ++r)
    for (int j = 1; j < 3; ++j) want_n.push_back(xs[r * 4 + j]);
  CHECK(max_rel(n.to_host_f32(), want_n) == 0.f);
  Layout row = contiguous_layout({5, 4});
  row.stride[0] = 0;
  Tensor e = Tensor::empty({5, 4}, DType::f32, Device::cpu());
  strided_copy(e, contiguous_layout({5, 4}), x, row, Accumulate::no);
  std::vector<double> want_e;
  for (int r = 0; r < 5; ++r)
    for (int j = 0; j < 4; ++j) want_e.push_back(xs[j]);
  CHECK(max_rel(e.to_host_f32(), want_e) == 0.f);
}

TEST_CASE("kernels.tensor_ops: bf16 and f16 inputs compute in f32 and round once") {
  for (DType d : {DType::bf16, DType::f16}) {
    CAPTURE(d);
    Tensor a32 = rnd({4, 6}, 51), b32 = rnd({6}, 52);
    Tensor a = cast(a32, d), b = cast(b32, d);
    Tensor y = Tensor::empty({4, 6}, d, Device::cpu()),
           y32 = Tensor::empty({4, 6}, DType::f32, Device::cpu());
    binary(y, a, b, BinaryOp::mul);
    binary(y32, cast(a, DType::f32), cast(b, DType::f32), BinaryOp::mul);
    // The f32 product of the 16-bit values, rounded once to d: what the 16-bit op stored.
    CHECK(y.to_host_f32() == cast(y32, d).to_host_f32());
    Tensor s = Tensor::empty({4}, DType::f32, Device::cpu()),
           s32 = Tensor::empty({4}, DType::f32, Device::cpu());
    reduce(s, a, 1, ReduceOp::sum);
    reduce(s32, cast(a, DType::f32), 1, ReduceOp::sum);
    CHECK(s.to_host_f32() == s32.to_host_f32());
  }
}

TEST_CASE("kernels.tensor_ops: bad shapes, dims and views are refused by name") {
  Tensor a = rnd({2, 3}, 61), b = rnd({4}, 62),
         y = Tensor::empty({2, 3}, DType::f32, Device::cpu());
  CHECK(dp_test::error_of([&] {
          binary(y, a, b, BinaryOp::add);
        }).find("shapes [2, 3] and [4] do not broadcast") != std::string::npos);
  Tensor wrong = Tensor::empty({3, 2}, DType::f32, Device::cpu());
  CHECK(dp_test::error_of([&] {
          binary(wrong, a, a, BinaryOp::mul);
        }).find("must be the broadcast shape [2, 3]") != std::string::npos);
  Tensor r = Tensor::empty({2}, DType::f32, Device::cpu());
  CHECK(dp_test::error_of([&] { reduce(r, a, 2, ReduceOp::sum); }).find("dim 2 out of range") !=
        std::string::npos);
  CHECK(dp_test::error_of([&] { reduce(r, a, 0, ReduceOp::sum); }).find("reduced over dim 0") !=
        std::string::npos);
  Layout over = contiguous_layout({2, 3});
  over.offset = 1;  // reaches element 6 of 6
  CHECK(dp_test::error_of([&] {
          strided_copy(y, contiguous_layout({2, 3}), a, over, Accumulate::no);
        }).find("reaches element 6") != std::string::npos);
  Layout twice = contiguous_layout({2, 3});
  twice.stride[0] = 0;  // both rows onto one
  CHECK(dp_test::error_of([&] {
          strided_copy(y, twice, a, contiguous_layout({2, 3}), Accumulate::no);
        }).find("writes elements twice") != std::string::npos);
  // One buffer's two views that meet: a shift by one element is refused, naming the bytes; the
  // same view (a copy onto itself, or x += x) and views of one buffer apart still run.
  Tensor buf = Tensor::from_vector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f}, {8});
  Layout head = contiguous_layout({4}), shifted = contiguous_layout({4});
  shifted.offset = 1;
  CHECK(dp_test::error_of([&] { strided_copy(buf, shifted, buf, head, Accumulate::no); })
            .find("strided_copy: dst's view and src's view share memory (bytes [4, 20) and [0, "
                  "16) of one buffer)") != std::string::npos);
  CHECK(buf.to_host_f32() == std::vector<float>{1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f});
  Tensor tail_view = buf.view(4, {4});  // bytes [16, 32) of the same storage
  CHECK(dp_test::error_of([&] {
          strided_copy(tail_view, contiguous_layout({4}), buf, shifted, Accumulate::no);
        }).find("share memory (bytes [16, 32) and [4, 20)") != std::string::npos);
  strided_copy(tail_view, contiguous_layout({4}), buf, head, Accumulate::no);
  strided_copy(buf, head, buf, head, Accumulate::yes);
  CHECK(buf.to_host_f32() == std::vector<float>{2.f, 4.f, 6.f, 8.f, 1.f, 2.f, 3.f, 4.f});
  Tensor h = Tensor::empty({2, 3}, DType::f16, Device::cpu()),
         g = Tensor::empty({2, 3}, DType::bf16, Device::cpu());
  CHECK(dp_test::error_of([&] { unary(h, g, UnaryOp::exp); }).find("mix f16 and bf16") !=
        std::string::npos);
  // An integer input names the input, not the output made in its dtype.
  Tensor ids = Tensor::empty({2, 3}, DType::i32, Device::cpu()),
         out = Tensor::empty({2, 3}, DType::i32, Device::cpu());
  CHECK(dp_test::error_of([&] {
          unary(out, ids, UnaryOp::exp);
        }).find("unary: x must be f32, f16 or bf16, got") != std::string::npos);
}
