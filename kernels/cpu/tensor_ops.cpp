// The broadcasting op set on the CPU (kernels/tensor_ops.hpp): elementwise loops over fixed
// chunks run in parallel, an odometer walks the strided operands, and every sum (a broadcast
// operand's gradient, a reduction, softmax's normaliser) adds in a fixed order in double: the
// same bits for any thread count. Tensors f32, f16 or bf16 (with_storage).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;

float sigmoid_of(float x) {
  return 1.f / (1.f + std::exp(-x));
}

float forward_value(UnaryOp op, UnaryParams p, float x) {
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
      return 1.f / std::sqrt(x);
    case UnaryOp::reciprocal:
      return 1.f / x;
    case UnaryOp::neg:
      return -x;
    case UnaryOp::abs:
      return std::fabs(x);
    case UnaryOp::pow:
      return std::pow(x, p.a);
    case UnaryOp::sigmoid:
      return sigmoid_of(x);
    case UnaryOp::tanh:
      return std::tanh(x);
    case UnaryOp::silu:
      return x * sigmoid_of(x);
    case UnaryOp::gelu_erf:
      return 0.5f * x * (1.f + std::erf(x * kInvSqrt2));
    case UnaryOp::gelu_tanh:
      return 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    case UnaryOp::relu:  // NaN stays NaN, as in torch.relu
      return (x > 0.f || x != x) ? x : 0.f;
  }
  return x;
}

// d op / dx at x, with y = op(x).
float derivative(UnaryOp op, UnaryParams p, float x, float y) {
  switch (op) {
    case UnaryOp::identity:
      return 1.f;
    case UnaryOp::affine:
      return p.a;
    case UnaryOp::exp:
      return y;
    case UnaryOp::log:
      return 1.f / x;
    case UnaryOp::sqrt:
      return 0.5f / y;
    case UnaryOp::rsqrt:
      return -0.5f * y * y * y;
    case UnaryOp::reciprocal:
      return -y * y;
    case UnaryOp::neg:
      return -1.f;
    case UnaryOp::abs:
      return x > 0.f ? 1.f : (x < 0.f ? -1.f : 0.f);
    case UnaryOp::pow:
      return p.a == 0.f ? 0.f : p.a * std::pow(x, p.a - 1.f);  // x^0: 0 at x = 0 too
    case UnaryOp::sigmoid:
      return y * (1.f - y);
    case UnaryOp::tanh:
      return 1.f - y * y;
    case UnaryOp::silu: {
      const float s = sigmoid_of(x);
      return s * (1.f + x * (1.f - s));
    }
    case UnaryOp::gelu_erf:
      return 0.5f * (1.f + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5f * x * x);
    case UnaryOp::gelu_tanh: {
      const float u = kSqrt2OverPi * (x + 0.044715f * x * x * x);
      const float t = std::tanh(u);
      const float flat = 1.f - t * t;  // 0 where tanh is +-1: then no 0 * inf at x^2 = inf
      if (flat == 0.f) return 0.5f * (1.f + t);
      const float du = kSqrt2OverPi * (1.f + 3.f * 0.044715f * x * x);
      return 0.5f * (1.f + t) + 0.5f * x * flat * du;
    }
    case UnaryOp::relu:
      return x > 0.f ? 1.f : 0.f;
  }
  return 1.f;
}

float binary_value(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::add:
      return a + b;
    case BinaryOp::sub:
      return a - b;
    case BinaryOp::mul:
      return a * b;
    case BinaryOp::div:
      return a / b;
    case BinaryOp::maximum:
      return (a > b || a != a) ? a : b;
    case BinaryOp::minimum:
      return (a < b || a != a) ? a : b;
  }
  return a;
}

// d (a op b) / d operand.
float binary_partial(BinaryOp op, Operand which, float a, float b) {
  const bool to_a = which == Operand::a;
  switch (op) {
    case BinaryOp::add:
      return 1.f;
    case BinaryOp::sub:
      return to_a ? 1.f : -1.f;
    case BinaryOp::mul:
      return to_a ? b : a;
    case BinaryOp::div:
      return to_a ? 1.f / b : -a / (b * b);
    case BinaryOp::maximum:
      return (a >= b) == to_a ? 1.f : 0.f;
    case BinaryOp::minimum:
      return (a <= b) == to_a ? 1.f : 0.f;
  }
  return 0.f;
}

// Walks the coordinates of a shape in row-major order from a linear index, keeping each
// operand's element offset (its layout's strides) as it goes.
template <int K>
struct Odometer {
  int nd = 0;
  const int64_t* shape = nullptr;
  const int64_t* strides[K] = {};
  int64_t c[kMaxDims] = {};
  int64_t at[K] = {};

  Odometer(const Layout& space, std::initializer_list<const Layout*> layouts, int64_t linear)
      : nd(space.ndim), shape(space.shape) {
    int i = 0;
    for (const Layout* l : layouts) strides[i] = l->stride, at[i] = l->offset, ++i;
    for (int k = nd - 1; k >= 0; --k) {
      c[k] = shape[k] ? linear % shape[k] : 0;
      linear = shape[k] ? linear / shape[k] : 0;
      for (int j = 0; j < K; ++j) at[j] += c[k] * strides[j][k];
    }
  }
  void next() {
    for (int k = nd - 1; k >= 0; --k) {
      for (int j = 0; j < K; ++j) at[j] += strides[j][k];
      if (++c[k] < shape[k]) return;
      for (int j = 0; j < K; ++j) at[j] -= c[k] * strides[j][k];
      c[k] = 0;
    }
  }
};

// The layouts of one index space with size-1 dims dropped and neighbouring dims merged where
// every layout allows it, split into rows along the last dim: `outer` walks the rows (an
// Odometer over all dims but the last), `step` is each layout's stride along a row.
template <int K>
struct Rows {
  Layout outer[K];
  int64_t step[K] = {};
  int64_t len = 1, count = 1;

  explicit Rows(const Layout* const (&ls)[K]) {
    Layout m[K];
    for (int j = 0; j < K; ++j) m[j].offset = ls[j]->offset;
    for (int k = 0; k < ls[0]->ndim; ++k) {
      if (ls[0]->shape[k] == 1) continue;
      bool merge = m[0].ndim > 0;
      for (int j = 0; j < K && merge; ++j)
        merge = m[j].stride[m[j].ndim - 1] == ls[j]->stride[k] * ls[j]->shape[k];
      for (int j = 0; j < K; ++j) {
        if (merge) {
          m[j].shape[m[j].ndim - 1] *= ls[j]->shape[k];
          m[j].stride[m[j].ndim - 1] = ls[j]->stride[k];
        } else {
          m[j].shape[m[j].ndim] = ls[j]->shape[k];
          m[j].stride[m[j].ndim++] = ls[j]->stride[k];
        }
      }
    }
    for (int j = 0; j < K; ++j) {
      outer[j] = m[j];
      if (m[j].ndim > 0) {
        len = m[j].shape[m[j].ndim - 1];
        step[j] = m[j].stride[m[j].ndim - 1];
        outer[j].ndim = m[j].ndim - 1;
      }
    }
    count = outer[0].numel();
  }
  // f(row, offsets of the row's first element) for each row, in parallel over rows.
  template <class F>
  void each(F&& f) const {
    const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, len));
    parallel_range(count, grain, [&](int64_t begin, int64_t end) {
      Odometer<K> w = walk(begin);
      for (int64_t r = begin; r < end; ++r, w.next()) f(r, w.at);
    });
  }
  Odometer<K> walk(int64_t row) const { return walk_of(row, std::make_integer_sequence<int, K>{}); }

 private:
  template <int... J>
  Odometer<K> walk_of(int64_t row, std::integer_sequence<int, J...>) const {
    return Odometer<K>(outer[0], {&outer[J]...}, row);
  }
};

// Calls f(std::integral_constant<Op, op>) so that a loop over elements is compiled per op
// (its switch folds away).
template <class F>
void with_unary_op(UnaryOp op, F&& f) {
  switch (op) {
#define DP_UNARY_CASE(name) \
  case UnaryOp::name:       \
    return f(std::integral_constant<UnaryOp, UnaryOp::name>{});
    DP_UNARY_CASE(identity)
    DP_UNARY_CASE(affine)
    DP_UNARY_CASE(exp)
    DP_UNARY_CASE(log)
    DP_UNARY_CASE(sqrt)
    DP_UNARY_CASE(rsqrt)
    DP_UNARY_CASE(reciprocal)
    DP_UNARY_CASE(neg)
    DP_UNARY_CASE(abs)
    DP_UNARY_CASE(pow)
    DP_UNARY_CASE(sigmoid)
    DP_UNARY_CASE(tanh)
    DP_UNARY_CASE(silu)
    DP_UNARY_CASE(gelu_erf)
    DP_UNARY_CASE(gelu_tanh)
    DP_UNARY_CASE(relu)
#undef DP_UNARY_CASE
  }
}
template <class F>
void with_binary_op(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::add:
      return f(std::integral_constant<BinaryOp, BinaryOp::add>{});
    case BinaryOp::sub:
      return f(std::integral_constant<BinaryOp, BinaryOp::sub>{});
    case BinaryOp::mul:
      return f(std::integral_constant<BinaryOp, BinaryOp::mul>{});
    case BinaryOp::div:
      return f(std::integral_constant<BinaryOp, BinaryOp::div>{});
    case BinaryOp::maximum:
      return f(std::integral_constant<BinaryOp, BinaryOp::maximum>{});
    case BinaryOp::minimum:
      return f(std::integral_constant<BinaryOp, BinaryOp::minimum>{});
  }
}

template <class T>
void store(T& to, float v, Accumulate acc) {
  store_rounded(to, acc == Accumulate::yes ? load_f32(to) + v : v);
}

}  // namespace

void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        with_unary_op(op, [&](auto c) {
          parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
              store_rounded(py[i], forward_value(c.value, p, load_f32(px[i])));
          });
        });
      },
      y.dtype(), x.dtype());
}

void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* px = x.data<decltype(x_t)>();
        const auto* py = y.data<decltype(y_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        with_unary_op(op, [&](auto c) {
          parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
              store(pdx[i],
                    load_f32(pdy[i]) * derivative(c.value, p, load_f32(px[i]), load_f32(py[i])),
                    acc);
          });
        });
      },
      dx.dtype(), dy.dtype(), x.dtype(), y.dtype());
}

void binary(Tensor& y, const Tensor& a, const Layout& a_in_y, const Tensor& b, const Layout& b_in_y,
            BinaryOp op) {
  const Layout y_l = contiguous_layout(a_in_y.sizes());
  const Layout* const ls[3] = {&y_l, &a_in_y, &b_in_y};
  const Rows<3> rows(ls);
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        const auto* pa = a.data<decltype(a_t)>();
        const auto* pb = b.data<decltype(b_t)>();
        auto* py = y.data<decltype(y_t)>();
        with_binary_op(op, [&](auto c) {
          rows.each([&](int64_t, const int64_t* at) {
            auto* yr = py + at[0];
            const auto *ar = pa + at[1], *br = pb + at[2];
            const int64_t sa = rows.step[1], sb = rows.step[2];
            for (int64_t j = 0; j < rows.len; ++j)
              store_rounded(yr[j],
                            binary_value(c.value, load_f32(ar[j * sa]), load_f32(br[j * sb])));
          });
        });
      },
      y.dtype(), a.dtype(), b.dtype());
}

namespace {
// Splits dy's index space into the dims d keeps and those it sums over, for dy (its contiguous
// strides) and two more operands' layouts. The summed walk adds to the kept walk's offsets.
void split_summed(const Layout& d_in_dy, const Layout* const (&others)[2], Layout (&kept)[3],
                  Layout (&summed)[3]) {
  const Layout dy = contiguous_layout(d_in_dy.sizes());
  const Layout* all[3] = {&dy, others[0], others[1]};
  for (int k = 0; k < d_in_dy.ndim; ++k) {
    const bool sums = d_in_dy.stride[k] == 0 && d_in_dy.shape[k] > 1;
    for (int j = 0; j < 3; ++j) {
      Layout& l = sums ? summed[j] : kept[j];
      l.shape[l.ndim] = all[j]->shape[k];
      l.stride[l.ndim++] = all[j]->stride[k];
    }
  }
  for (int j = 0; j < 3; ++j) kept[j].offset = all[j]->offset;
}

// For each element of d (parallel), the sum over the summed dims of the f32 terms
// term(dy, x1, x2 offsets) in order, in double; stored once. Rows of the kept dims, rows of the
// summed dims inside.
template <class D, class Term>
void sum_into(D* pd, const Layout& d_in_dy, const Layout& x1, const Layout& x2, Accumulate acc,
              Term term) {
  Layout kept[3], summed[3];
  const Layout* const others[2] = {&x1, &x2};
  split_summed(d_in_dy, others, kept, summed);
  const Layout d_l = contiguous_layout(kept[0].sizes());
  const Layout* const kl[4] = {&d_l, &kept[0], &kept[1], &kept[2]};
  const Layout* const sl[3] = {&summed[0], &summed[1], &summed[2]};
  const Rows<4> rows(kl);
  const Rows<3> sums(sl);
  const int64_t n_summed = sums.count * sums.len;
  const int64_t grain =
      std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, rows.len * n_summed));
  // Each element adds its terms in the summed dims' order, whichever loop is inside: the summed
  // one when it runs along memory (a row's own sum), else the row's elements (a column sum over
  // leading dims), into a buffer of row sums. The same bits either way.
  const bool summed_inside = n_summed == 1 || sums.step[0] == 1;
  parallel_range(rows.count, grain, [&](int64_t begin, int64_t end) {
    // One buffer per thread, kept from call to call: no allocation per step.
    thread_local std::vector<double> row_sums;
    if (!summed_inside) row_sums.resize(static_cast<size_t>(rows.len));
    Odometer<4> w = rows.walk(begin);
    for (int64_t r = begin; r < end; ++r, w.next()) {
      if (!summed_inside) {
        std::fill_n(row_sums.begin(), rows.len, 0.0);
        Odometer<3> u = sums.walk(0);
        for (int64_t q = 0; q < sums.count; ++q, u.next())
          for (int64_t k = 0; k < sums.len; ++k) {
            const int64_t o0 = w.at[1] + u.at[0] + k * sums.step[0],
                          o1 = w.at[2] + u.at[1] + k * sums.step[1],
                          o2 = w.at[3] + u.at[2] + k * sums.step[2];
            for (int64_t j = 0; j < rows.len; ++j)
              row_sums[static_cast<size_t>(j)] +=
                  term(o0 + j * rows.step[1], o1 + j * rows.step[2], o2 + j * rows.step[3]);
          }
        for (int64_t j = 0; j < rows.len; ++j)
          store(pd[w.at[0] + j * rows.step[0]],
                static_cast<float>(row_sums[static_cast<size_t>(j)]), acc);
        continue;
      }
      if (n_summed == 1) {  // elementwise: one f32 term each
        for (int64_t j = 0; j < rows.len; ++j)
          store(pd[w.at[0] + j * rows.step[0]],
                term(w.at[1] + j * rows.step[1], w.at[2] + j * rows.step[2],
                     w.at[3] + j * rows.step[3]),
                acc);
        continue;
      }
      for (int64_t j = 0; j < rows.len; ++j) {
        const int64_t i0 = w.at[1] + j * rows.step[1], i1 = w.at[2] + j * rows.step[2],
                      i2 = w.at[3] + j * rows.step[3];
        double s = 0.0;
        {
          Odometer<3> u = sums.walk(0);
          for (int64_t q = 0; q < sums.count; ++q, u.next())
            for (int64_t k = 0; k < sums.len; ++k)
              s += term(i0 + u.at[0] + k * sums.step[0], i1 + u.at[1] + k * sums.step[1],
                        i2 + u.at[2] + k * sums.step[2]);
        }
        store(pd[w.at[0] + j * rows.step[0]], static_cast<float>(s), acc);
      }
    }
  });
}
}  // namespace

void binary_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                     const Tensor& a, const Layout& a_in_dy, const Tensor& b, const Layout& b_in_dy,
                     BinaryOp op, Accumulate acc) {
  const bool selects = op == BinaryOp::maximum || op == BinaryOp::minimum;
  with_storage(
      [&](auto d_t, auto dy_t, auto a_t, auto b_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pa = a.data<decltype(a_t)>();
        const auto* pb = b.data<decltype(b_t)>();
        auto* pd = d.data<decltype(d_t)>();
        with_binary_op(op, [&](auto c) {
          auto partial = [&](auto to) {
            sum_into(pd, d_in_dy, a_in_dy, b_in_dy, acc, [&](int64_t i, int64_t ia, int64_t ib) {
              const float p = binary_partial(c.value, to.value, load_f32(pa[ia]), load_f32(pb[ib]));
              // maximum and minimum select: an unselected element gets 0, whatever dy.
              if (selects && p == 0.f) return 0.f;
              return load_f32(pdy[i]) * p;
            });
          };
          if (which == Operand::a)
            partial(std::integral_constant<Operand, Operand::a>{});
          else
            partial(std::integral_constant<Operand, Operand::b>{});
        });
      },
      d.dtype(), dy.dtype(), a.dtype(), b.dtype());
}

void where(Tensor& y, const Tensor& mask, const Layout& mask_in_y, const Tensor& a,
           const Layout& a_in_y, const Tensor& b, const Layout& b_in_y) {
  with_storage(
      [&](auto y_t, auto m_t, auto a_t, auto b_t) {
        const auto* pm = mask.data<decltype(m_t)>();
        const auto* pa = a.data<decltype(a_t)>();
        const auto* pb = b.data<decltype(b_t)>();
        auto* py = y.data<decltype(y_t)>();
        const Layout y_l = contiguous_layout(a_in_y.sizes());
        const Layout* const ls[4] = {&y_l, &mask_in_y, &a_in_y, &b_in_y};
        const Rows<4> rows(ls);
        rows.each([&](int64_t, const int64_t* at) {
          for (int64_t j = 0; j < rows.len; ++j)
            store_rounded(py[at[0] + j * rows.step[0]],
                          load_f32(pm[at[1] + j * rows.step[1]]) != 0.f
                              ? load_f32(pa[at[2] + j * rows.step[2]])
                              : load_f32(pb[at[3] + j * rows.step[3]]));
        });
      },
      y.dtype(), mask.dtype(), a.dtype(), b.dtype());
}

void where_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                    const Tensor& mask, const Layout& mask_in_dy, Accumulate acc) {
  const bool to_a = which == Operand::a;
  with_storage(
      [&](auto d_t, auto dy_t, auto m_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* pm = mask.data<decltype(m_t)>();
        auto* pd = d.data<decltype(d_t)>();
        sum_into(pd, d_in_dy, mask_in_dy, mask_in_dy, acc, [&](int64_t i, int64_t im, int64_t) {
          return (load_f32(pm[im]) != 0.f) == to_a ? load_f32(pdy[i]) : 0.f;
        });
      },
      d.dtype(), dy.dtype(), mask.dtype());
}

void reduce(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, ReduceOp op) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / n);
        parallel_range(outer * inner, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const auto* xr = px + (r / inner) * n * inner + r % inner;
            if (op == ReduceOp::max) {
              float m = load_f32(xr[0]);
              for (int64_t j = 1; j < n; ++j)
                m = binary_value(BinaryOp::maximum, m, load_f32(xr[j * inner]));
              store_rounded(py[r], m);
              continue;
            }
            double s = 0.0;
            for (int64_t j = 0; j < n; ++j) s += load_f32(xr[j * inner]);
            store_rounded(py[r], static_cast<float>(op == ReduceOp::mean ? s / n : s));
          }
        });
      },
      y.dtype(), x.dtype());
}

void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                     int64_t /*outer*/, int64_t n, int64_t inner, ReduceOp op, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* px = x.data<decltype(x_t)>();
        const auto* py = y.data<decltype(y_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        const float scale = op == ReduceOp::mean ? 1.f / static_cast<float>(n) : 1.f;
        parallel_range(dx.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t r = (i / (n * inner)) * inner + i % inner;
            float g = load_f32(pdy[r]) * scale;
            if (op == ReduceOp::max && load_f32(px[i]) != load_f32(py[r])) g = 0.f;
            store(pdx[i], g, acc);
          }
        });
      },
      dx.dtype(), dy.dtype(), x.dtype(), y.dtype());
}

void softmax(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, Softmax kind) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, n));
        parallel_range(outer * inner, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t base = (r / inner) * n * inner + r % inner;
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < n; ++j) m = std::max(m, load_f32(px[base + j * inner]));
            double s = 0.0;
            for (int64_t j = 0; j < n; ++j) s += std::exp(load_f32(px[base + j * inner]) - m);
            const float log_s = static_cast<float>(std::log(s));
            const float inv_s = static_cast<float>(1.0 / s);
            for (int64_t j = 0; j < n; ++j) {
              const float z = load_f32(px[base + j * inner]) - m;
              store_rounded(py[base + j * inner],
                            kind == Softmax::softmax ? std::exp(z) * inv_s : z - log_s);
            }
          }
        });
      },
      y.dtype(), x.dtype());
}

void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int64_t outer, int64_t n,
                      int64_t inner, Softmax kind, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto y_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        const auto* py = y.data<decltype(y_t)>();
        auto* pdx = dx.data<decltype(dx_t)>();
        const bool soft = kind == Softmax::softmax;
        const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, n));
        parallel_range(outer * inner, grain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t base = (r / inner) * n * inner + r % inner;
            double s = 0.0;
            for (int64_t j = 0; j < n; ++j) {
              const int64_t i = base + j * inner;
              s += soft ? double{load_f32(pdy[i])} * load_f32(py[i]) : load_f32(pdy[i]);
            }
            const float sf = static_cast<float>(s);
            for (int64_t j = 0; j < n; ++j) {
              const int64_t i = base + j * inner;
              const float g = load_f32(pdy[i]), v = load_f32(py[i]);
              store(pdx[i], soft ? v * (g - sf) : g - std::exp(v) * sf, acc);
            }
          }
        });
      },
      dx.dtype(), dy.dtype(), y.dtype());
}

void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc) {
  with_storage(
      [&](auto d_t, auto s_t) {
        const auto* ps = src.data<decltype(s_t)>();
        auto* pd = dst.data<decltype(d_t)>();
        const Layout* const ls[2] = {&dst_view, &src_view};
        const Rows<2> rows(ls);
        rows.each([&](int64_t, const int64_t* at) {
          for (int64_t j = 0; j < rows.len; ++j)
            store(pd[at[0] + j * rows.step[0]], load_f32(ps[at[1] + j * rows.step[1]]), acc);
        });
      },
      dst.dtype(), src.dtype());
}

}  // namespace kernels::cpu
