// Argument checks of the broadcasting op set (kernels/tensor_ops.hpp) and its dispatch: shapes
// are resolved here into Layouts in the output's index space, so each backend sees strides only.
#include "kernels/tensor_ops.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dispatch.hpp"

namespace kernels {

namespace {

struct Arg {
  const char* name;
  const Tensor& t;
};

// requires each tensor defined, on the first one's device, f32, f16 or bf16 (f16 and bf16 not
// both), with at most kMaxDims dimensions.
void check_args(const char* op, std::initializer_list<Arg> args) {
  const Arg& first = *args.begin();
  const Arg* half = nullptr;
  for (const Arg& a : args) {
    DP_CHECK(a.t.defined(), op << ": tensor '" << a.name << "' is undefined");
    DP_CHECK(a.t.device() == first.t.device(),
             op << ": tensors on different devices: " << first.name << " " << first.t << " vs "
                << a.name << " " << a.t);
    DP_CHECK(is_floating(a.t.dtype()),
             op << ": " << a.name << " must be f32, f16 or bf16, got " << a.t);
    DP_CHECK(a.t.ndim() <= kMaxDims,
             op << ": " << a.name << " " << a.t << " has more than " << kMaxDims << " dimensions");
    if (a.t.dtype() == DType::f32) continue;
    if (!half) half = &a;
    DP_CHECK(a.t.dtype() == half->t.dtype(), op << ": " << half->name << " " << half->t << " and "
                                                << a.name << " " << a.t
                                                << " mix f16 and bf16 (one 16-bit dtype per call)");
  }
}

void check_same_shape(const char* op, const Arg& a, const Arg& b) {
  DP_CHECK(a.t.shape() == b.t.shape(), op << ": shapes differ: " << a.name << " "
                                          << shape_str(a.t.shape()) << " vs " << b.name << " "
                                          << shape_str(b.t.shape()));
}

// An operand of shape `s` in the index space of `out` (s broadcasts to out): out's shape, s's
// contiguous strides, 0 where s has size 1 or no dimension.
Layout in_space(const Shape& s, const Shape& out) {
  Layout l;
  l.ndim = static_cast<int>(out.size());
  const int lead = l.ndim - static_cast<int>(s.size());
  int64_t stride = 1;
  for (int k = l.ndim - 1; k >= 0; --k) {
    l.shape[k] = out[k];
    const int j = k - lead;
    if (j >= 0) {
      l.stride[k] = s[j] == 1 ? 0 : stride;
      stride *= s[j];
    }
  }
  return l;
}

// The output shape of a broadcast, checked against y's.
void check_broadcast_out(const char* op, const Arg& y, const Shape& want) {
  DP_CHECK(y.t.shape() == want, op << ": " << y.name << " " << shape_str(y.t.shape())
                                   << " must be the broadcast shape " << shape_str(want));
}

// x as (outer, n, inner) around `dim`.
struct Split {
  int64_t outer = 1, n = 1, inner = 1;
};
Split split_at(const char* op, const Tensor& x, int dim) {
  DP_CHECK(dim >= 0 && dim < x.ndim(),
           op << ": dim " << dim << " out of range for x " << shape_str(x.shape()));
  Split s;
  for (int k = 0; k < dim; ++k) s.outer *= x.dim(k);
  s.n = x.dim(dim);
  for (int k = dim + 1; k < x.ndim(); ++k) s.inner *= x.dim(k);
  return s;
}
// A reduction's output: outer * inner elements.
void check_reduced(const char* op, const Arg& y, const Tensor& x, int dim, const Split& s) {
  DP_CHECK(y.t.numel() == s.outer * s.inner, op << ": " << y.name << " " << shape_str(y.t.shape())
                                                << " must hold x " << shape_str(x.shape())
                                                << " reduced over dim " << dim << " ("
                                                << s.outer * s.inner << " elements)");
}

// The element a non-empty view with non-negative strides reaches last.
int64_t last_element(const Layout& v) {
  int64_t last = v.offset;
  for (int k = 0; k < v.ndim; ++k) last += (v.shape[k] - 1) * v.stride[k];
  return last;
}

// requires the view within a tensor of `numel` elements, non-negative strides.
void check_view(const char* op, const char* name, const Layout& v, int64_t numel) {
  DP_CHECK(v.ndim >= 0 && v.ndim <= kMaxDims,
           op << ": " << name << " view has " << v.ndim << " dimensions (0 to " << kMaxDims << ")");
  bool empty = false;
  for (int k = 0; k < v.ndim; ++k) {
    DP_CHECK(v.shape[k] >= 0 && v.stride[k] >= 0,
             op << ": " << name << " view " << shape_str(v.sizes()) << " has a negative size or "
                << "stride at dim " << k);
    if (v.shape[k] == 0) empty = true;
  }
  if (empty) return;
  const int64_t last = last_element(v);
  DP_CHECK(v.offset >= 0 && last < numel, op << ": " << name << " view " << shape_str(v.sizes())
                                             << " at offset " << v.offset << " reaches element "
                                             << last << " of a tensor of " << numel);
}

// The bytes [first, end) of t's storage that a non-empty view of t's elements reaches.
std::pair<size_t, size_t> view_bytes(const Tensor& t, const Layout& v) {
  const int64_t last = last_element(v);
  const size_t e = dtype_size(t.dtype());
  return {t.offset_bytes() + static_cast<size_t>(v.offset) * e,
          t.offset_bytes() + static_cast<size_t>(last + 1) * e};
}

// requires non-empty views within their tensors. Throws when the views' byte ranges in one
// storage meet, unless they are the same view (each element then read and written by one
// thread): an element written before another thread reads it would pass on the copy's own
// value. Views that interleave without sharing an element (a tensor's even and odd columns) are
// refused too: the byte ranges say nothing finer.
void check_views_apart(const char* op, const Tensor& dst, const Layout& d, const Tensor& src,
                       const Layout& s) {
  if (!dst.same_storage(src)) return;
  const auto [d0, d1] = view_bytes(dst, d);
  const auto [s0, s1] = view_bytes(src, s);
  if (d1 <= s0 || s1 <= d0) return;
  bool same = dst.dtype() == src.dtype() && d0 == s0 && d.ndim == s.ndim;
  for (int k = 0; same && k < d.ndim; ++k)
    same = d.shape[k] == s.shape[k] && (d.shape[k] == 1 || d.stride[k] == s.stride[k]);
  DP_CHECK(same, op << ": dst's view and src's view share memory (bytes [" << d0 << ", " << d1
                    << ") and [" << s0 << ", " << s1
                    << ") of one buffer): copy through a buffer of its own");
}

// requires no two coordinates of the view at one element: sorted by stride, each stride at
// least the extent of the dims before it.
// requires v.ndim <= kMaxDims (check_view).
void check_no_overlap(const char* op, const char* name, const Layout& v) {
  int dims[kMaxDims], n = 0;  // no allocation: this runs on every copy of a step
  for (int k = 0; k < v.ndim; ++k)
    if (v.shape[k] == 0) return;  // no element at all (a contiguous layout gives it stride 0)
  for (int k = 0; k < v.ndim; ++k)
    if (v.shape[k] > 1) dims[n++] = k;
  for (int i = 1; i < n; ++i)  // by stride, insertion sort: at most kMaxDims of them
    for (int j = i; j > 0 && v.stride[dims[j]] < v.stride[dims[j - 1]]; --j)
      std::swap(dims[j], dims[j - 1]);
  int64_t extent = 1;
  for (int i = 0; i < n; ++i) {
    const int k = dims[i];
    DP_CHECK(v.stride[k] >= extent, op << ": " << name << " view " << shape_str(v.sizes())
                                       << " writes elements twice (stride " << v.stride[k]
                                       << " at dim " << k << ")");
    extent = v.stride[k] * v.shape[k];
  }
}

}  // namespace

const char* unary_name(UnaryOp op) {
  static const char* const names[] = {
      "identity", "affine", "exp",     "log",  "sqrt", "rsqrt",    "reciprocal", "neg",
      "abs",      "pow",    "sigmoid", "tanh", "silu", "gelu_erf", "gelu_tanh",  "relu"};
  return names[static_cast<int>(op)];
}
const char* binary_name(BinaryOp op) {
  static const char* const names[] = {"add", "sub", "mul", "div", "maximum", "minimum"};
  return names[static_cast<int>(op)];
}
const char* reduce_name(ReduceOp op) {
  static const char* const names[] = {"sum", "mean", "max"};
  return names[static_cast<int>(op)];
}

namespace {
// The backward ops' names, for messages (fixed strings: no allocation per call).
const char* binary_backward_name(BinaryOp op) {
  static const char* const names[] = {"add_backward", "sub_backward",     "mul_backward",
                                      "div_backward", "maximum_backward", "minimum_backward"};
  return names[static_cast<int>(op)];
}
const char* reduce_backward_name(ReduceOp op) {
  static const char* const names[] = {"sum_backward", "mean_backward", "max_backward"};
  return names[static_cast<int>(op)];
}
}  // namespace

Layout contiguous_layout(const Shape& shape) {
  DP_CHECK(
      shape.size() <= static_cast<size_t>(kMaxDims),
      "contiguous_layout: " << shape_str(shape) << " has more than " << kMaxDims << " dimensions");
  return in_space(shape, shape);
}

Shape broadcast_shape(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t da = k < n - a.size() ? 1 : a[k - (n - a.size())];
    const int64_t db = k < n - b.size() ? 1 : b[k - (n - b.size())];
    DP_CHECK(da == db || da == 1 || db == 1, "shapes " << shape_str(a) << " and " << shape_str(b)
                                                       << " do not broadcast (dim " << k << ": "
                                                       << da << " vs " << db << ")");
    out[k] = da == 1 ? db : da;
  }
  return out;
}

void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p) {
  check_args("unary", {{"x", x}, {"y", y}});  // inputs first: y is often made from x
  check_same_shape(unary_name(op), {"x", x}, {"y", y});
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), unary, y, x, op, p);
}

void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc) {
  check_args("unary_backward", {{"dy", dy}, {"x", x}, {"y", y}, {"dx", dx}});
  check_same_shape(unary_name(op), {"x", x}, {"dx", dx});
  check_same_shape(unary_name(op), {"x", x}, {"dy", dy});
  check_same_shape(unary_name(op), {"x", x}, {"y", y});
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), unary_backward, dx, dy, x, y, op, p, acc);
}

void binary(Tensor& y, const Tensor& a, const Tensor& b, BinaryOp op) {
  check_args(binary_name(op), {{"y", y}, {"a", a}, {"b", b}});
  const Shape out = broadcast_shape(a.shape(), b.shape());
  check_broadcast_out(binary_name(op), {"y", y}, out);
  if (y.numel() == 0) return;
  const Layout la = in_space(a.shape(), out), lb = in_space(b.shape(), out);
  DP_DISPATCH(y.device(), binary, y, a, la, b, lb, op);
}

void binary_backward(Tensor& d, Operand which, const Tensor& dy, const Tensor& a, const Tensor& b,
                     BinaryOp op, Accumulate acc) {
  const char* opn = binary_backward_name(op);
  check_args(opn, {{"d", d}, {"dy", dy}, {"a", a}, {"b", b}});
  const Shape out = broadcast_shape(a.shape(), b.shape());
  check_broadcast_out(opn, {"dy", dy}, out);
  const Tensor& operand = which == Operand::a ? a : b;
  check_same_shape(opn, {which == Operand::a ? "a" : "b", operand}, {"d", d});
  if (d.numel() == 0) return;
  if (dy.numel() == 0) {  // a sum over nothing
    if (acc == Accumulate::no) fill(d, 0.f);
    return;
  }
  const Layout ld = in_space(d.shape(), out), la = in_space(a.shape(), out),
               lb = in_space(b.shape(), out);
  DP_DISPATCH(d.device(), binary_backward, d, ld, which, dy, a, la, b, lb, op, acc);
}

void where(Tensor& y, const Tensor& mask, const Tensor& a, const Tensor& b) {
  check_args("where", {{"mask", mask}, {"a", a}, {"b", b}, {"y", y}});
  const Shape out = broadcast_shape(broadcast_shape(mask.shape(), a.shape()), b.shape());
  check_broadcast_out("where", {"y", y}, out);
  if (y.numel() == 0) return;
  const Layout lm = in_space(mask.shape(), out), la = in_space(a.shape(), out),
               lb = in_space(b.shape(), out);
  DP_DISPATCH(y.device(), where, y, mask, lm, a, la, b, lb);
}

void where_backward(Tensor& d, Operand which, const Tensor& dy, const Tensor& mask,
                    Accumulate acc) {
  check_args("where_backward", {{"dy", dy}, {"mask", mask}, {"d", d}});
  // d's shape broadcasts to dy's, as its operand's did.
  check_broadcast_out("where_backward", {"dy", dy}, broadcast_shape(d.shape(), dy.shape()));
  check_broadcast_out("where_backward", {"dy", dy}, broadcast_shape(mask.shape(), dy.shape()));
  if (d.numel() == 0) return;
  if (dy.numel() == 0) {
    if (acc == Accumulate::no) fill(d, 0.f);
    return;
  }
  const Layout ld = in_space(d.shape(), dy.shape()), lm = in_space(mask.shape(), dy.shape());
  DP_DISPATCH(d.device(), where_backward, d, ld, which, dy, mask, lm, acc);
}

void reduce(Tensor& y, const Tensor& x, int dim, ReduceOp op) {
  check_args(reduce_name(op), {{"y", y}, {"x", x}});
  const Split s = split_at(reduce_name(op), x, dim);
  check_reduced(reduce_name(op), {"y", y}, x, dim, s);
  if (y.numel() == 0) return;
  if (s.n == 0) {
    DP_CHECK(op != ReduceOp::max,
             "max: x " << shape_str(x.shape()) << " has no elements along dim " << dim);
    return fill(y, op == ReduceOp::sum ? 0.f : std::nanf(""));
  }
  DP_DISPATCH(y.device(), reduce, y, x, s.outer, s.n, s.inner, op);
}

void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, int dim,
                     ReduceOp op, Accumulate acc) {
  const char* name = reduce_backward_name(op);
  check_args(name, {{"dx", dx}, {"dy", dy}, {"x", x}, {"y", y}});
  check_same_shape(name, {"x", x}, {"dx", dx});
  const Split s = split_at(name, x, dim);
  check_reduced(name, {"dy", dy}, x, dim, s);
  check_reduced(name, {"y", y}, x, dim, s);
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), reduce_backward, dx, dy, x, y, s.outer, s.n, s.inner, op, acc);
}

void softmax(Tensor& y, const Tensor& x, int dim, Softmax kind) {
  const char* op = kind == Softmax::softmax ? "softmax" : "log_softmax";
  check_args(op, {{"y", y}, {"x", x}});
  check_same_shape(op, {"x", x}, {"y", y});
  const Split s = split_at(op, x, dim);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), softmax, y, x, s.outer, s.n, s.inner, kind);
}

void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int dim, Softmax kind,
                      Accumulate acc) {
  const char* op = kind == Softmax::softmax ? "softmax_backward" : "log_softmax_backward";
  check_args(op, {{"dx", dx}, {"dy", dy}, {"y", y}});
  check_same_shape(op, {"y", y}, {"dx", dx});
  check_same_shape(op, {"y", y}, {"dy", dy});
  const Split s = split_at(op, y, dim);
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), softmax_backward, dx, dy, y, s.outer, s.n, s.inner, kind, acc);
}

void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc) {
  const char* op = "strided_copy";
  check_args(op, {{"dst", dst}, {"src", src}});
  DP_CHECK(dst_view.sizes() == src_view.sizes(), op << ": views differ: dst "
                                                    << shape_str(dst_view.sizes()) << " vs src "
                                                    << shape_str(src_view.sizes()));
  check_view(op, "dst", dst_view, dst.numel());
  check_view(op, "src", src_view, src.numel());
  check_no_overlap(op, "dst", dst_view);
  if (dst_view.numel() == 0) return;
  check_views_apart(op, dst, dst_view, src, src_view);
  DP_DISPATCH(dst.device(), strided_copy, dst, dst_view, src, src_view, acc);
}

}  // namespace kernels
