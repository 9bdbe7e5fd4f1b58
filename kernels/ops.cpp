// Argument checks and the one dispatch point of every op: CPU ops run inside the device
// context's task arena, CUDA ops get the context (stream, handles) of the calling thread.
#include "kernels/ops.hpp"

#include <sstream>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/dispatch.hpp"
#include "kernels/runtime/memory.hpp"

namespace kernels {

namespace {

void check_defined(const char* op, const Tensor& t, const char* name) {
  DP_CHECK(t.defined(), op << ": tensor '" << name << "' is undefined");
}

// A tensor argument with its name, for messages such as "add: shapes differ: a [2, 3] vs ...".
struct Arg {
  const char* name;
  const Tensor& t;
};

// requires every tensor defined and on the device of the first.
void check_devices(const char* op, std::initializer_list<Arg> args) {
  for (const Arg& a : args) check_defined(op, a.t, a.name);
  const Arg& first = *args.begin();
  for (const Arg& a : args)
    DP_CHECK(a.t.device() == first.t.device(),
             op << ": tensors on different devices: " << first.name << " " << first.t << " vs "
                << a.name << " " << a.t);
}

void check_dtype(const char* op, const Arg& a, DType want) {
  DP_CHECK(a.t.dtype() == want, op << ": " << a.name << " must be " << want << ", got " << a.t);
}

// requires a device scalar to be (1) f32 on `device` (a fixed one needs nothing).
void check_scalar(const char* op, const char* name, const Scalar& s, const Device& device) {
  if (!s.at.defined()) return;
  DP_CHECK(s.at.dtype() == DType::f32 && s.at.numel() == 1 && s.at.device() == device,
           op << ": scalar " << name << " " << s.at << " must be one f32 element on " << device);
}

// requires a device base to be (1) i64 on `device`.
void check_rng_offset(const char* op, const RngOffset& o, const Device& device) {
  if (!o.base.defined()) return;
  DP_CHECK(o.base.dtype() == DType::i64 && o.base.numel() == 1 && o.base.device() == device,
           op << ": random offset base " << o.base << " must be one i64 element on " << device);
}

// ---- 16-bit activations --------------------------------------------------------------------
// The elementwise, bias, activation, pooling, dropout, LayerNorm, embedding-gradient and (on the
// CPU) attention ops take f16/bf16 tensors natively on both backends: their kernels read 16-bit
// values as f32, compute as the f32 kernels do and round each 16-bit output once (cpu_util.hpp's
// with_storage, cuda_common.cuh's).

bool is_16bit(const Tensor& t) {
  return t.defined() && (t.dtype() == DType::f16 || t.dtype() == DType::bf16);
}

// requires each tensor f32, f16 or bf16, with f16 and bf16 not both in one call (a kernel
// computes in f32 and rounds to the call's one 16-bit dtype).
void check_floating(const char* op, std::initializer_list<Arg> args) {
  const Arg* half = nullptr;
  for (const Arg& a : args) {
    DP_CHECK(is_floating(a.t.dtype()),
             op << ": " << a.name << " must be f32, f16 or bf16, got " << a.t);
    if (!is_16bit(a.t)) continue;
    if (!half) half = &a;
    DP_CHECK(a.t.dtype() == half->t.dtype(), op << ": " << half->name << " " << half->t << " and "
                                                << a.name << " " << a.t
                                                << " mix f16 and bf16 (one 16-bit dtype per call)");
  }
}

void check_f32(const char* op, std::initializer_list<Arg> args) {
  for (const Arg& a : args) check_dtype(op, a, DType::f32);
}

// requires a and b defined. Throws when their memory meets (views of one storage whose byte
// ranges overlap): for ops whose output is written before, or at once with, the other is read.
// (tensor_ops.cpp's check_no_overlap is another check: one view's own elements apart.)
void check_disjoint(const char* op, const Arg& a, const Arg& b) {
  const size_t a0 = a.t.offset_bytes(), b0 = b.t.offset_bytes();
  DP_CHECK(!a.t.same_storage(b.t) || a.t.nbytes() == 0 || b.t.nbytes() == 0 ||
               a0 + a.t.nbytes() <= b0 || b0 + b.t.nbytes() <= a0,
           op << ": " << a.name << " and " << b.name << " share memory: give each its own buffer");
}

void check_same_shape(const char* op, const Arg& a, const Arg& b) {
  DP_CHECK(a.t.shape() == b.t.shape(), op << ": shapes differ: " << a.name << " "
                                          << shape_str(a.t.shape()) << " vs " << b.name << " "
                                          << shape_str(b.t.shape()));
}

void check_shape(const char* op, const Arg& a, const Shape& want) {
  DP_CHECK(a.t.shape() == want, op << ": " << a.name << " must be " << shape_str(want) << ", got "
                                   << shape_str(a.t.shape()));
}

void check_ndim(const char* op, const Arg& a, int ndim) {
  DP_CHECK(a.t.ndim() == ndim,
           op << ": " << a.name << " must be " << ndim << "-D, got " << shape_str(a.t.shape()));
}

// A one-element f32 output such as a loss: shape (1) (any shape with one element is taken).
void check_scalar_out(const char* op, const Arg& a) {
  check_dtype(op, a, DType::f32);
  DP_CHECK(a.t.numel() == 1,
           op << ": " << a.name << " must have one element, got " << shape_str(a.t.shape()));
}

// A loss's optional count of right rows: undefined, or (1) f32 on the logits' device.
void check_count_out(const char* op, const Tensor& correct, const Tensor& logits) {
  if (!correct.defined()) return;
  check_devices(op, {{"logits", logits}, {"correct", correct}});
  check_scalar_out(op, {"correct", correct});
}

}  // namespace

void copy(Tensor& dst, const Tensor& src) {
  check_defined("copy", dst, "dst");
  check_defined("copy", src, "src");
  DP_CHECK(dst.numel() == src.numel(),
           "copy: " << src << " into " << dst << ": element counts differ");
  if (dst.device() != src.device())
    DP_CHECK(dst.dtype() == src.dtype(),
             "copy: across devices the dtypes must match: " << src << " into " << dst);
  else if (dst.dtype() != src.dtype())
    DP_CHECK(is_floating(dst.dtype()) && is_floating(src.dtype()),
             "copy: converts only between f32, f16 and bf16: " << src << " into " << dst);
  if (dst.numel() == 0) return;
  if (dst.dtype() == src.dtype()) return copy_bytes(dst, src);
  context(dst.device()).note_cast();  // DeviceContext::casts
  DP_DISPATCH(dst.device(), cast, dst, src);
}

Tensor cast(const Tensor& x, DType dtype) {
  check_defined("cast", x, "x");
  Tensor y = Tensor::empty(x.shape(), dtype, x.device());
  copy(y, x);
  return y;
}

void fill(Tensor& y, float value) {
  check_defined("fill", y, "y");
  // An integer dtype takes whole values it can hold (the cast of NaN or 3e9 is undefined).
  if (!is_floating(y.dtype())) {
    const double lo = y.dtype() == DType::u8    ? 0.0
                      : y.dtype() == DType::i32 ? -2147483648.0
                                                : -9223372036854775808.0;
    const double end = y.dtype() == DType::u8    ? 256.0
                       : y.dtype() == DType::i32 ? 2147483648.0
                                                 : 9223372036854775808.0;
    DP_CHECK(std::isfinite(value) && std::trunc(value) == value && value >= lo && value < end,
             "fill: " << value << " is not a whole value that y " << y << " can hold");
  }
  if (y.numel() == 0) return;
  // A zero (but -0.f) is all-zero bytes in every dtype: a memset, which on a CPU writes the
  // lines without reading them first (twice the speed of a loop of stores on a replica's 1 MiB
  // of gradients, which zero_grad fills every step).
  if (value == 0.f && !std::signbit(value)) return fill_bytes(y, 0);
  DP_DISPATCH(y.device(), fill, y, value);
}

// ---- elementwise ---------------------------------------------------------------------------

namespace {
// Whether `tail` is the last dims of `shape` (fewer dims than it).
bool is_trailing_shape(const Shape& tail, const Shape& shape) {
  return tail.size() < shape.size() &&
         std::equal(tail.begin(), tail.end(), shape.end() - tail.size());
}
// y, x on one device, same shape; the caller checks the dtypes.
void check_unary(const char* op, const Tensor& y, const Tensor& x) {
  check_devices(op, {{"y", y}, {"x", x}});
  check_same_shape(op, {"x", x}, {"y", y});
}
// ... and f32.
void check_unary_f32(const char* op, const Tensor& y, const Tensor& x) {
  check_unary(op, y, x);
  check_f32(op, {{"y", y}, {"x", x}});
}
// ... or f32, f16 and bf16 (check_floating).
void check_unary_floating(const char* op, const Tensor& y, const Tensor& x) {
  check_unary(op, y, x);
  check_floating(op, {{"y", y}, {"x", x}});
}
// y, a same shape; b a's shape (returns false) or a's trailing dims (returns true: broadcast).
bool check_broadcast_binary(const char* op, const Tensor& y, const Tensor& a, const Tensor& b) {
  check_devices(op, {{"y", y}, {"a", a}, {"b", b}});
  check_floating(op, {{"y", y}, {"a", a}, {"b", b}});
  check_same_shape(op, {"a", a}, {"y", y});
  if (b.shape() == a.shape()) return false;
  DP_CHECK(is_trailing_shape(b.shape(), a.shape()),
           op << ": shapes differ: a " << shape_str(a.shape()) << " vs b " << shape_str(b.shape())
              << ", and b is not a's trailing dims (b broadcasts over a's leading dims only)");
  return true;
}
// A (C) vector over dim 1 of an (N, C, ...) tensor.
void check_channel_vector(const char* op, const Arg& t, const Arg& vec) {
  DP_CHECK(t.t.ndim() >= 2,
           op << ": " << t.name << " must be (N, C, ...), got " << shape_str(t.t.shape()));
  check_shape(op, vec, {t.t.dim(1)});
}
}  // namespace

void add(Tensor& y, const Tensor& a, const Tensor& b) {
  const bool broadcast = check_broadcast_binary("add", y, a, b);
  if (y.numel() == 0) return;
  if (broadcast) {
    DP_DISPATCH(y.device(), add_trailing, y, a, b);
  } else {
    DP_DISPATCH(y.device(), add, y, a, b);
  }
}

void mul(Tensor& y, const Tensor& a, const Tensor& b) {
  const bool broadcast = check_broadcast_binary("mul", y, a, b);
  if (y.numel() == 0) return;
  if (broadcast) {
    DP_DISPATCH(y.device(), mul_trailing, y, a, b);
  } else {
    DP_DISPATCH(y.device(), mul, y, a, b);
  }
}

void sum_leading(Tensor& out, const Tensor& x, Accumulate acc) {
  check_devices("sum_leading", {{"out", out}, {"x", x}});
  check_f32("sum_leading", {{"out", out}, {"x", x}});
  DP_CHECK(out.shape() == x.shape() || is_trailing_shape(out.shape(), x.shape()),
           "sum_leading: out " << shape_str(out.shape()) << " is not x's " << shape_str(x.shape())
                               << " trailing dims");
  if (out.numel() == 0) return;
  if (x.numel() == 0) {  // no rows: the sum is 0
    if (acc == Accumulate::no) fill(out, 0.f);
    return;
  }
  DP_DISPATCH(out.device(), sum_leading, out, x, acc);
}

void scale(Tensor& y, const Tensor& x, Scalar alpha) {
  check_unary_floating("scale", y, x);
  check_scalar("scale", "alpha", alpha, y.device());
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), scale, y, x, alpha);
}

void axpy(Tensor& y, Scalar alpha, const Tensor& x) {
  check_devices("axpy", {{"y", y}, {"x", x}});
  check_scalar("axpy", "alpha", alpha, y.device());
  check_dtype("axpy", {"y", y}, DType::f32);
  DP_CHECK(is_floating(x.dtype()), "axpy: x must be f32, f16 or bf16, got " << x);
  check_same_shape("axpy", {"x", x}, {"y", y});
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), axpy, y, alpha, x);
}

void add_bias(Tensor& y, const Tensor& bias) {
  check_devices("add_bias", {{"y", y}, {"bias", bias}});
  check_floating("add_bias", {{"y", y}, {"bias", bias}});
  check_channel_vector("add_bias", {"y", y}, {"bias", bias});
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), add_bias, y, bias);
}

void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc) {
  check_devices("bias_backward", {{"db", db}, {"dy", dy}});
  check_floating("bias_backward", {{"db", db}, {"dy", dy}});
  check_channel_vector("bias_backward", {"dy", dy}, {"db", db});
  if (db.numel() == 0) return;
  if (dy.numel() == 0) {  // an empty batch contributes nothing
    if (acc == Accumulate::no) fill(db, 0.f);
    return;
  }
  DP_DISPATCH(db.device(), bias_backward, db, dy, acc);
}

// ---- matrix product ------------------------------------------------------------------------

namespace {

// gemm's requirements, for gemm and the ops built on it (`op` names the one called).
void check_gemm(const char* op, const Tensor& c, const Tensor& a, Transpose ta, const Tensor& b,
                Transpose tb, const Tensor& bias) {
  check_devices(op, {{"c", c}, {"a", a}, {"b", b}});
  if (bias.defined()) check_devices(op, {{"c", c}, {"bias", bias}});
  check_ndim(op, {"a", a}, 2);
  check_ndim(op, {"b", b}, 2);
  check_ndim(op, {"c", c}, 2);
  DP_CHECK(is_floating(a.dtype()) && a.dtype() == b.dtype(),
           op << ": a and b must be f32, f16 or bf16 of one dtype, got " << a << " and " << b);
  DP_CHECK(c.dtype() == DType::f32 || c.dtype() == a.dtype(),
           op << ": c must be f32 or " << a.dtype() << ", got " << c);
  Shape op_a = ta == Transpose::no ? a.shape() : Shape{a.dim(1), a.dim(0)};
  Shape op_b = tb == Transpose::no ? b.shape() : Shape{b.dim(1), b.dim(0)};
  DP_CHECK(op_a[1] == op_b[0], op << ": inner dimensions differ: op(a) " << shape_str(op_a)
                                  << " x op(b) " << shape_str(op_b) << " (a "
                                  << shape_str(a.shape()) << ", b " << shape_str(b.shape()) << ")");
  DP_CHECK(c.shape() == (Shape{op_a[0], op_b[1]}),
           op << ": c must be " << shape_str({op_a[0], op_b[1]}) << " for op(a) " << shape_str(op_a)
              << " x op(b) " << shape_str(op_b) << ", got " << shape_str(c.shape()));
  if (bias.defined()) {
    DP_CHECK(bias.dtype() == DType::f32 || bias.dtype() == c.dtype(),
             op << ": bias must be f32 or c's dtype " << c.dtype() << ", got " << bias);
    check_shape(op, {"bias", bias}, {op_b[1]});
  }
}

}  // namespace

void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias) {
  check_gemm("gemm", c, a, ta, b, tb, bias);
  // c is written while a and b are read (c = a a gave 7 22 33 742 for 7 10 15 22).
  check_disjoint("gemm", {"c", c}, {"a", a});
  check_disjoint("gemm", {"c", c}, {"b", b});
  if (c.numel() == 0) return;
  DP_DISPATCH(c.device(), gemm, c, a, ta, b, tb, alpha, beta, bias);
}

void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias) {
  const char* op = "gemm_gelu_tanh";
  check_gemm(op, pre, a, ta, b, tb, bias);
  check_devices(op, {{"pre", pre}, {"y", y}});
  check_same_shape(op, {"pre", pre}, {"y", y});
  check_dtype(op, {"y", y}, pre.dtype());
  // The GPU's epilogue writes both at once: one buffer for both is undefined there.
  check_disjoint(op, {"y", y}, {"pre", pre});
  if (pre.numel() == 0) return;
  DP_DISPATCH(pre.device(), gemm_gelu_tanh, y, pre, a, ta, b, tb, bias);
}

void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre) {
  const char* op = "gemm_gelu_tanh_backward";
  check_gemm(op, dpre, dy, tdy, w, tw, Tensor());
  check_devices(op, {{"dpre", dpre}, {"pre", pre}});
  check_same_shape(op, {"dpre", dpre}, {"pre", pre});
  check_dtype(op, {"pre", pre}, dpre.dtype());
  // The product is written into dpre before the derivative reads pre.
  check_disjoint(op, {"dpre", dpre}, {"pre", pre});
  if (dbias.defined()) {
    check_devices(op, {{"dpre", dpre}, {"dbias", dbias}});
    check_dtype(op, {"dbias", dbias}, DType::f32);
    check_shape(op, {"dbias", dbias}, {dpre.dim(1)});
  }
  if (dpre.numel() == 0) {  // no rows: the bias gradient of nothing
    if (dbias.defined() && bias_acc == Accumulate::no) fill(dbias, 0.f);
    return;
  }
  DP_DISPATCH(dpre.device(), gemm_gelu_tanh_backward, dpre, dbias, bias_acc, dy, tdy, w, tw, pre);
}

namespace {

// 1: cuBLASLt's DGELU_BGRAD may run, 0: the ops (the default); -1 until the environment is read.
std::atomic<int>& dgelu_epilogue_state() {
  static std::atomic<int> state{-1};
  return state;
}

}  // namespace

void set_cuda_dgelu_epilogue(bool enabled) {
  dgelu_epilogue_state().store(enabled ? 1 : 0);
}

bool cuda_dgelu_epilogue() {
  std::atomic<int>& state = dgelu_epilogue_state();
  int s = state.load();
  if (s >= 0) return s == 1;
  const char* env = std::getenv("DP_CUDA_DGELU");
  const std::string v = env ? env : "";
  DP_CHECK(v.empty() || v == "epilogue" || v == "ops",
           "DP_CUDA_DGELU=" << v
                            << ": give ops (the GEMM, gelu_tanh_backward and bias_backward, the "
                               "default) or epilogue (cuBLASLt's DGELU_BGRAD where it has an "
                               "algorithm)");
  state.compare_exchange_strong(s, v == "epilogue" ? 1 : 0);  // a setter's call first wins
  return state.load() == 1;
}

void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias) {
  const char* op = "linear_param_grads";
  check_gemm(op, dw, dy, Transpose::yes, x, Transpose::no, Tensor());
  check_dtype(op, {"dw", dw}, DType::f32);
  if (dbias.defined()) {
    check_devices(op, {{"dw", dw}, {"dbias", dbias}, {"dy_for_bias", dy_for_bias}});
    check_dtype(op, {"dbias", dbias}, DType::f32);
    check_shape(op, {"dbias", dbias}, {dw.dim(0)});
    check_same_shape(op, {"dy", dy}, {"dy_for_bias", dy_for_bias});
    DP_CHECK(
        dy_for_bias.dtype() == DType::f32 || dy_for_bias.dtype() == dy.dtype(),
        op << ": dy_for_bias must be f32 or dy's dtype " << dy.dtype() << ", got " << dy_for_bias);
  }
  if (dw.numel() == 0) {  // no weight (in or out features 0): the bias gradient still counts
    if (dbias.defined()) bias_backward(dbias, dy_for_bias, Accumulate::yes);
    return;
  }
  DP_DISPATCH(dw.device(), linear_param_grads, dw, dbias, dy, x, dy_for_bias);
}

// ---- activations ---------------------------------------------------------------------------

namespace {
// dx, dy and v (the forward input or output) on one device, one shape, f32, f16 or bf16.
void check_activation_backward(const char* op, const Tensor& dx, const Tensor& dy, const Tensor& v,
                               const char* v_name) {
  check_devices(op, {{"dx", dx}, {"dy", dy}, {v_name, v}});
  check_floating(op, {{"dx", dx}, {"dy", dy}, {v_name, v}});
  check_same_shape(op, {"dy", dy}, {"dx", dx});
  check_same_shape(op, {"dy", dy}, {v_name, v});
}
}  // namespace

void relu(Tensor& y, const Tensor& x) {
  check_unary_floating("relu", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), relu, y, x);
}

void relu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  check_activation_backward("relu_backward", dx, dy, x, "x");
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), relu_backward, dx, dy, x, acc);
}

void gelu(Tensor& y, const Tensor& x) {
  check_unary_floating("gelu", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), gelu, y, x);
}

void gelu_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  check_activation_backward("gelu_backward", dx, dy, x, "x");
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), gelu_backward, dx, dy, x, acc);
}

void gelu_tanh(Tensor& y, const Tensor& x) {
  check_unary_floating("gelu_tanh", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), gelu_tanh, y, x);
}

void gelu_tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& x, Accumulate acc) {
  check_activation_backward("gelu_tanh_backward", dx, dy, x, "x");
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), gelu_tanh_backward, dx, dy, x, acc);
}

void tanh(Tensor& y, const Tensor& x) {
  check_unary_floating("tanh", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), tanh, y, x);
}

void tanh_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc) {
  check_activation_backward("tanh_backward", dx, dy, y, "y");
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), tanh_backward, dx, dy, y, acc);
}

void sigmoid(Tensor& y, const Tensor& x) {
  check_unary_f32("sigmoid", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), sigmoid, y, x);
}

void sigmoid_backward(Tensor& dx, const Tensor& dy, const Tensor& y, Accumulate acc) {
  check_activation_backward("sigmoid_backward", dx, dy, y, "y");
  check_f32("sigmoid_backward", {{"dx", dx}, {"dy", dy}, {"y", y}});
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), sigmoid_backward, dx, dy, y, acc);
}

void exp(Tensor& y, const Tensor& x) {
  check_unary_f32("exp", y, x);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), exp, y, x);
}

// ---- losses, reductions, metrics -----------------------------------------------------------

namespace {
// logits (B, C) f32, f16 or bf16 and labels (B) i32 on one device.
void check_logits_labels(const char* op, const Tensor& logits, const Tensor& labels) {
  check_devices(op, {{"logits", logits}, {"labels", labels}});
  check_floating(op, {{"logits", logits}});
  check_dtype(op, {"labels", labels}, DType::i32);
  check_ndim(op, {"logits", logits}, 2);
  check_shape(op, {"labels", labels}, {logits.dim(0)});
  DP_CHECK(logits.dim(1) > 0 || logits.dim(0) == 0,
           op << ": logits " << shape_str(logits.shape()) << " have no classes");
}
// dlogits like logits, on its device, in f32 or the logits' dtype.
void check_logits_grad(const char* op, const Tensor& dlogits, const Tensor& logits) {
  check_devices(op, {{"logits", logits}, {"dlogits", dlogits}});
  DP_CHECK(dlogits.dtype() == DType::f32 || dlogits.dtype() == logits.dtype(),
           op << ": dlogits " << dlogits << " must be f32 or the logits' dtype (logits " << logits
              << ")");
  check_same_shape(op, {"logits", logits}, {"dlogits", dlogits});
}
}  // namespace

std::string bad_label_text(int64_t label, int64_t row, int64_t batch, int64_t classes) {
  std::ostringstream os;
  os << "softmax_cross_entropy: label " << label << " of row " << row << " is outside [0, "
     << classes << ") for logits " << shape_str({batch, classes});
  return os.str();
}

void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights, float label_smoothing,
                           Tensor correct, const Scalar& grad_scale) {
  const char* op = "softmax_cross_entropy";
  check_logits_labels(op, logits, labels);
  check_devices(op, {{"logits", logits}, {"loss", loss}});
  check_scalar_out(op, {"loss", loss});
  check_scalar(op, "grad_scale", grad_scale, logits.device());
  if (weights.defined()) {
    check_devices(op, {{"logits", logits}, {"weights", weights}});
    check_dtype(op, {"weights", weights}, DType::f32);
    check_shape(op, {"weights", weights}, {logits.dim(0)});
  }
  if (dlogits.defined()) check_logits_grad(op, dlogits, logits);
  check_count_out(op, correct, logits);
  DP_CHECK(label_smoothing >= 0.f && label_smoothing < 1.f,
           op << ": label_smoothing must be in [0, 1), got " << label_smoothing);
  if (logits.dim(0) == 0) {  // the loss of an empty batch is 0, and nothing in it is right
    if (correct.defined()) fill(correct, 0.f);
    return fill(loss, 0.f);
  }
  DP_DISPATCH(logits.device(), softmax_cross_entropy, loss, dlogits, logits, labels, weights,
              label_smoothing, correct, grad_scale);
}

void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor correct, const Scalar& grad_scale,
                         const Tensor& kept) {
  const char* op = "token_cross_entropy";
  check_logits_labels(op, logits, targets);
  check_devices(op, {{"logits", logits}, {"loss", loss}});
  check_scalar_out(op, {"loss", loss});
  check_scalar(op, "grad_scale", grad_scale, logits.device());
  if (dlogits.defined()) check_logits_grad(op, dlogits, logits);
  check_count_out(op, correct, logits);
  if (kept.defined()) {
    check_devices(op, {{"logits", logits}, {"kept", kept}});
    check_scalar_out(op, {"kept", kept});
  }
  if (logits.dim(0) == 0) {
    if (correct.defined()) fill(correct, 0.f);
    return fill(loss, 0.f);
  }
  DP_DISPATCH(logits.device(), token_cross_entropy, loss, dlogits, logits, targets, ignore_index,
              correct, grad_scale, kept);
}

void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index) {
  const char* op = "count_kept";
  check_devices(op, {{"targets", targets}, {"out", out}});
  check_dtype(op, {"targets", targets}, DType::i32);
  check_scalar_out(op, {"out", out});
  DP_CHECK(targets.ndim() == 1, op << ": targets must be (N), got " << shape_str(targets.shape()));
  constexpr int64_t exact = int64_t{1} << 24;  // every count below it is an f32 integer
  DP_CHECK(targets.numel() <= exact, op << ": " << targets.numel()
                                        << " targets: the f32 count is exact up to " << exact
                                        << "; give a device fewer tokens a step");
  if (targets.numel() == 0) return fill(out, 0.f);
  DP_DISPATCH(targets.device(), count_kept, out, targets, ignore_index);
}

void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target) {
  const char* op = "mse_loss";
  check_devices(op, {{"pred", pred}, {"target", target}, {"loss", loss}});
  check_f32(op, {{"pred", pred}, {"target", target}});
  check_same_shape(op, {"pred", pred}, {"target", target});
  check_scalar_out(op, {"loss", loss});
  if (dpred.defined()) {
    check_devices(op, {{"pred", pred}, {"dpred", dpred}});
    check_dtype(op, {"dpred", dpred}, DType::f32);
    check_same_shape(op, {"pred", pred}, {"dpred", dpred});
  }
  if (pred.numel() == 0) return fill(loss, 0.f);
  DP_DISPATCH(pred.device(), mse_loss, loss, dpred, pred, target);
}

void sum(Tensor& out, const Tensor& x) {
  check_devices("sum", {{"x", x}, {"out", out}});
  check_dtype("sum", {"x", x}, DType::f32);
  check_scalar_out("sum", {"out", out});
  if (x.numel() == 0) return fill(out, 0.f);
  DP_DISPATCH(x.device(), sum, out, x);
}

void mean(Tensor& out, const Tensor& x) {
  check_devices("mean", {{"x", x}, {"out", out}});
  check_dtype("mean", {"x", x}, DType::f32);
  check_scalar_out("mean", {"out", out});
  if (x.numel() == 0) return fill(out, 0.f);
  DP_DISPATCH(x.device(), mean, out, x);
}

void sum_squares(Tensor& out, const Tensor& x) {
  check_devices("sum_squares", {{"x", x}, {"out", out}});
  check_dtype("sum_squares", {"x", x}, DType::f32);
  check_scalar_out("sum_squares", {"out", out});
  if (x.numel() == 0) return fill(out, 0.f);
  DP_DISPATCH(x.device(), sum_squares, out, x);
}

void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar unscale) {
  const char* op = "clip_by_norm";
  check_devices(op, {{"grads", grads}, {"norm_out", norm_out}, {"sum_squares", sum_squares}});
  check_dtype(op, {"grads", grads}, DType::f32);
  check_scalar_out(op, {"norm_out", norm_out});
  check_scalar_out(op, {"sum_squares", sum_squares});
  DP_CHECK(max_norm > 0.f && std::isfinite(max_norm),
           op << ": max_norm " << max_norm << " must be finite and > 0");
  check_scalar(op, "unscale", unscale, grads.device());
  DP_DISPATCH(grads.device(), clip_by_norm, grads, norm_out, sum_squares, max_norm, unscale);
}

void argmax(Tensor& out, const Tensor& x) {
  const char* op = "argmax";
  check_devices(op, {{"x", x}, {"out", out}});
  check_floating(op, {{"x", x}});
  check_dtype(op, {"out", out}, DType::i32);
  check_ndim(op, {"x", x}, 2);
  check_shape(op, {"out", out}, {x.dim(0)});
  DP_CHECK(x.dim(1) > 0 || x.dim(0) == 0,
           op << ": x " << shape_str(x.shape()) << " has no columns");
  if (out.numel() == 0) return;
  DP_DISPATCH(x.device(), argmax, out, x);
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  check_logits_labels("count_correct", logits, labels);
  if (logits.dim(0) == 0) return 0;
  DeviceContext& ctx = context(logits.device());
  ctx.note_host_sync();  // the count comes back to the host
  if (logits.device().is_cpu())
    return run_cpu(ctx, [&] { return cpu::count_correct(logits, labels); });
  return DP_CUDA_DISPATCH_VALUE(int64_t, cuda::count_correct(logits, labels, ctx));
}

void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels) {
  check_logits_labels("count_correct_into", logits, labels);
  check_devices("count_correct_into", {{"logits", logits}, {"out", out}});
  check_dtype("count_correct_into", {"out", out}, DType::f32);
  check_shape("count_correct_into", {"out", out}, {1});
  DP_DISPATCH(logits.device(), count_correct_into, out, logits, labels);
}

void weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights) {
  const char* op = "weighted_sum";
  check_defined(op, y, "y");
  check_dtype(op, {"y", y}, DType::f32);
  DP_CHECK(xs.size() == weights.size(),
           op << ": " << xs.size() << " sources but " << weights.size() << " weights");
  check_scalar(op, "y_weight", y_weight, y.device());
  for (const Scalar& w : weights) check_scalar(op, "weights[k]", w, y.device());
  for (size_t k = 0; k < xs.size(); ++k) {
    check_defined(op, xs[k], "xs[k]");
    DP_CHECK(xs[k].numel() == y.numel(),
             op << ": source " << k << " " << xs[k] << " and y " << y << " differ in size");
    DP_CHECK(xs[k].dtype() == xs[0].dtype() &&
                 (xs[k].dtype() == DType::f32 || xs[k].dtype() == DType::bf16),
             op << ": sources must all be f32 or all bf16, source " << k << " is " << xs[k]);
    DP_CHECK(direct_access(y.device(), xs[k].device()),
             op << ": " << y.device() << " cannot read source " << k << " on " << xs[k].device()
                << " directly (stage it first)");
    // y is scaled, then each source added into it: a source in y's memory would be read scaled.
    check_disjoint(op, {"y", y}, {"a source", xs[k]});
  }
  DP_DISPATCH(y.device(), weighted_sum, y, y_weight, xs, weights);
}

// ---- convolution and pooling ---------------------------------------------------------------

int64_t conv_out_size(int64_t in, int64_t k, int stride, int pad) {
  DP_CHECK(k >= 1 && stride >= 1 && pad >= 0,
           "conv_out_size: needs window >= 1, stride >= 1, pad >= 0, got window "
               << k << ", stride " << stride << ", pad " << pad);
  DP_CHECK(in + 2 * pad >= k,
           "conv_out_size: window " << k << " exceeds the padded input " << in << " + 2 * " << pad);
  return (in + 2 * static_cast<int64_t>(pad) - k) / stride + 1;
}

namespace {
// The two inputs of a convolution pass f32, f16 or bf16 of one dtype; the output f32 or theirs.
void check_conv_dtypes(const char* op, const Arg& out, const Arg& in1, const Arg& in2) {
  DP_CHECK(is_floating(in1.t.dtype()) && in1.t.dtype() == in2.t.dtype(),
           op << ": " << in1.name << " and " << in2.name
              << " must be f32, f16 or bf16 of one dtype, got " << in1.name << " " << in1.t.dtype()
              << " and " << in2.name << " " << in2.t.dtype() << " (" << in1.t << ", " << in2.t
              << ")");
  DType in = in1.t.dtype();
  DP_CHECK(out.t.dtype() == DType::f32 || out.t.dtype() == in,
           op << ": " << out.name << " must be f32" << (in != DType::f32 ? " or " : "")
              << (in != DType::f32 ? dtype_name(in) : "") << " for " << in1.name << " and "
              << in2.name << " of " << in << ", got " << out.t);
}

// x (N, C, H, W), w (K, C, R, S), y (N, K, P, Q): one device, sizes consistent with p.
void check_conv(const char* op, const Arg& y, const Arg& x, const Arg& w, const Conv2dParams& p) {
  check_devices(op, {y, x, w});
  check_ndim(op, x, 4);
  check_ndim(op, w, 4);
  check_ndim(op, y, 4);
  DP_CHECK(x.t.dim(1) == w.t.dim(1), op << ": channels differ: " << x.name << " "
                                        << shape_str(x.t.shape()) << " vs " << w.name << " "
                                        << shape_str(w.t.shape()));
  Shape want{x.t.dim(0), w.t.dim(0), conv_out_size(x.t.dim(2), w.t.dim(2), p.stride_h, p.pad_h),
             conv_out_size(x.t.dim(3), w.t.dim(3), p.stride_w, p.pad_w)};
  DP_CHECK(y.t.shape() == want, op << ": " << y.name << " must be " << shape_str(want) << " for "
                                   << x.name << " " << shape_str(x.t.shape()) << " and " << w.name
                                   << " " << shape_str(w.t.shape()) << ", got "
                                   << shape_str(y.t.shape()));
}
}  // namespace

void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  check_conv("conv2d_forward", {"y", y}, {"x", x}, {"w", w}, p);
  check_conv_dtypes("conv2d_forward", {"y", y}, {"x", x}, {"w", w});
  if (y.numel() == 0) return;
  if (x.dim(1) == 0) return fill(y, 0.f);  // no input channels: the sum is empty
  DP_DISPATCH(y.device(), conv2d_forward, y, x, w, p);
}

void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc) {
  check_conv("conv2d_backward_data", {"dy", dy}, {"dx", dx}, {"w", w}, p);
  check_conv_dtypes("conv2d_backward_data", {"dx", dx}, {"dy", dy}, {"w", w});
  if (dx.numel() == 0) return;
  if (dy.numel() == 0) {  // no output channels: nothing flows back
    if (acc == Accumulate::no) fill(dx, 0.f);
    return;
  }
  DP_DISPATCH(dx.device(), conv2d_backward_data, dx, dy, w, p, acc);
}

void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc) {
  check_conv("conv2d_backward_filter", {"dy", dy}, {"x", x}, {"dw", dw}, p);
  check_conv_dtypes("conv2d_backward_filter", {"dw", dw}, {"dy", dy}, {"x", x});
  if (dw.numel() == 0) return;
  if (dy.numel() == 0) {  // an empty batch contributes nothing
    if (acc == Accumulate::no) fill(dw, 0.f);
    return;
  }
  DP_DISPATCH(dw.device(), conv2d_backward_filter, dw, dy, x, p, acc);
}

namespace {
// x (N, C, H, W) and y (N, C, P, Q) with P, Q from the window; padding at most half a window
// (as PyTorch), so every window holds at least one real element.
void check_pool(const char* op, const Arg& y, const Arg& x, const Pool2dParams& p) {
  check_devices(op, {y, x});
  check_floating(op, {y, x});
  check_ndim(op, x, 4);
  DP_CHECK(x.t.dim(2) > 0 && x.t.dim(3) > 0,
           op << ": " << x.name << " " << shape_str(x.t.shape()) << " has empty planes");
  DP_CHECK(p.pad_h >= 0 && p.pad_w >= 0 && 2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w,
           op << ": padding " << p.pad_h << "x" << p.pad_w << " exceeds half the window "
              << p.kernel_h << "x" << p.kernel_w);
  Shape want{x.t.dim(0), x.t.dim(1), conv_out_size(x.t.dim(2), p.kernel_h, p.stride_h, p.pad_h),
             conv_out_size(x.t.dim(3), p.kernel_w, p.stride_w, p.pad_w)};
  DP_CHECK(y.t.shape() == want, op << ": " << y.name << " must be " << shape_str(want) << " for "
                                   << x.name << " " << shape_str(x.t.shape()) << ", got "
                                   << shape_str(y.t.shape()));
}
}  // namespace

void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  check_pool("max_pool2d_forward", {"y", y}, {"x", x}, p);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), max_pool2d_forward, y, x, p);
}

void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc) {
  const char* op = "max_pool2d_backward";
  check_pool(op, {"y", y}, {"x", x}, p);
  check_devices(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_floating(op, {{"dx", dx}, {"dy", dy}, {"x", x}, {"y", y}});
  check_same_shape(op, {"x", x}, {"dx", dx});
  check_same_shape(op, {"y", y}, {"dy", dy});
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), max_pool2d_backward, dx, dy, x, y, p, acc);
}

void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p) {
  check_pool("avg_pool2d_forward", {"y", y}, {"x", x}, p);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), avg_pool2d_forward, y, x, p);
}

void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc) {
  check_pool("avg_pool2d_backward", {"dy", dy}, {"dx", dx}, p);
  if (dx.numel() == 0) return;
  DP_DISPATCH(dx.device(), avg_pool2d_backward, dx, dy, p, acc);
}

// ---- normalisation -------------------------------------------------------------------------

namespace {
// x (N, C, ...) f32 and per-channel (C) f32 vectors, all on x's device.
void check_batch_norm(const char* op, const Arg& x, std::initializer_list<Arg> per_channel) {
  check_devices(op, {x});
  DP_CHECK(x.t.ndim() >= 2,
           op << ": " << x.name << " must be (N, C, ...), got " << shape_str(x.t.shape()));
  check_dtype(op, x, DType::f32);
  for (const Arg& v : per_channel) {
    check_devices(op, {x, v});
    check_dtype(op, v, DType::f32);
    check_shape(op, v, {x.t.dim(1)});
  }
}
void check_eps(const char* op, float eps) {
  DP_CHECK(eps >= 0.f, op << ": eps must be >= 0, got " << eps);
}
}  // namespace

void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps) {
  const char* op = "batch_norm_forward_train";
  check_batch_norm(op, {"x", x},
                   {{"gamma", gamma},
                    {"beta", beta},
                    {"running_mean", running_mean},
                    {"running_var", running_var},
                    {"save_mean", save_mean},
                    {"save_invstd", save_invstd}});
  check_devices(op, {{"x", x}, {"y", y}});
  check_dtype(op, {"y", y}, DType::f32);
  check_same_shape(op, {"x", x}, {"y", y});
  check_eps(op, eps);
  if (x.numel() == 0) return;
  DP_CHECK(x.numel() / x.dim(1) > 1,
           op << ": expected more than one value per channel, got x " << shape_str(x.shape()));
  DP_DISPATCH(x.device(), batch_norm_forward_train, y, save_mean, save_invstd, running_mean,
              running_var, x, gamma, beta, momentum, eps);
}

void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps) {
  const char* op = "batch_norm_forward_eval";
  check_batch_norm(op, {"x", x},
                   {{"gamma", gamma},
                    {"beta", beta},
                    {"running_mean", running_mean},
                    {"running_var", running_var}});
  check_devices(op, {{"x", x}, {"y", y}});
  check_dtype(op, {"y", y}, DType::f32);
  check_same_shape(op, {"x", x}, {"y", y});
  check_eps(op, eps);
  if (x.numel() == 0) return;
  DP_DISPATCH(x.device(), batch_norm_forward_eval, y, x, gamma, beta, running_mean, running_var,
              eps);
}

void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc) {
  const char* op = "batch_norm_backward";
  check_batch_norm(op, {"x", x},
                   {{"dgamma", dgamma},
                    {"dbeta", dbeta},
                    {"gamma", gamma},
                    {"save_mean", save_mean},
                    {"save_invstd", save_invstd}});
  check_devices(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_f32(op, {{"dx", dx}, {"dy", dy}});
  check_same_shape(op, {"x", x}, {"dx", dx});
  check_same_shape(op, {"x", x}, {"dy", dy});
  if (x.numel() == 0) {  // an empty batch: no input gradient, no parameter gradient
    if (acc == Accumulate::no) {
      fill(dgamma, 0.f);
      fill(dbeta, 0.f);
    }
    return;
  }
  DP_DISPATCH(x.device(), batch_norm_backward, dx, dgamma, dbeta, dy, x, gamma, save_mean,
              save_invstd, acc);
}

namespace {
// x (M, D) f32, f16 or bf16; per-row (M) and per-feature (D) f32 vectors, all on x's device.
void check_layer_norm(const char* op, const Arg& x, std::initializer_list<Arg> per_row,
                      std::initializer_list<Arg> per_feature) {
  check_devices(op, {x});
  check_ndim(op, x, 2);
  check_floating(op, {x});
  for (const Arg& v : per_row) {
    check_devices(op, {x, v});
    check_dtype(op, v, DType::f32);
    check_shape(op, v, {x.t.dim(0)});
  }
  for (const Arg& v : per_feature) {
    check_devices(op, {x, v});
    check_dtype(op, v, DType::f32);
    check_shape(op, v, {x.t.dim(1)});
  }
}
}  // namespace

namespace {
// layer_norm_backward's checks, and its answer for no features (nothing to do) or no rows (an
// empty batch contributes nothing: dgamma and dbeta are zeroed unless accumulating). True when
// the kernel has work.
bool layer_norm_backward_needed(const char* op, Tensor& dx, Tensor& dgamma, Tensor& dbeta,
                                const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc) {
  check_layer_norm(op, {"x", x}, {{"save_mean", save_mean}, {"save_rstd", save_rstd}},
                   {{"gamma", gamma}, {"dgamma", dgamma}, {"dbeta", dbeta}});
  check_devices(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_floating(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_same_shape(op, {"x", x}, {"dx", dx});
  check_same_shape(op, {"x", x}, {"dy", dy});
  if (dgamma.numel() == 0) return false;
  if (x.numel() == 0) {
    if (acc == Accumulate::no) {
      fill(dgamma, 0.f);
      fill(dbeta, 0.f);
    }
    return false;
  }
  return true;
}
}  // namespace

void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps) {
  const char* op = "layer_norm_forward";
  check_layer_norm(op, {"x", x}, {{"save_mean", save_mean}, {"save_rstd", save_rstd}},
                   {{"gamma", gamma}, {"beta", beta}});
  check_devices(op, {{"x", x}, {"y", y}});
  check_floating(op, {{"x", x}, {"y", y}});
  check_same_shape(op, {"x", x}, {"y", y});
  check_eps(op, eps);
  DP_CHECK(x.dim(1) > 0 || x.dim(0) == 0,
           op << ": x " << shape_str(x.shape()) << " has no features");
  if (x.numel() == 0) return;
  DP_DISPATCH(x.device(), layer_norm_forward, y, save_mean, save_rstd, x, gamma, beta, eps);
}

void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc) {
  if (!layer_norm_backward_needed("layer_norm_backward", dx, dgamma, dbeta, dy, x, gamma, save_mean,
                                  save_rstd, acc))
    return;
  DP_DISPATCH(x.device(), layer_norm_backward, dx, dgamma, dbeta, dy, x, gamma, save_mean,
              save_rstd, acc);
}

void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps) {
  const char* op = "add_layer_norm_forward";
  check_layer_norm(op, {"h", h}, {{"save_mean", save_mean}, {"save_rstd", save_rstd}},
                   {{"gamma", gamma}, {"beta", beta}});
  check_devices(op, {{"h", h}, {"y", y}, {"a", a}, {"b", b}});
  check_floating(op, {{"h", h}, {"y", y}});
  for (const Arg& v : {Arg{"a", a}, Arg{"b", b}}) {
    check_same_shape(op, {"h", h}, v);
    check_dtype(op, v, h.dtype());
  }
  check_same_shape(op, {"h", h}, {"y", y});
  check_eps(op, eps);
  DP_CHECK(h.dim(1) > 0 || h.dim(0) == 0,
           op << ": h " << shape_str(h.shape()) << " has no features");
  if (h.numel() == 0) return;
  DP_DISPATCH(h.device(), add_layer_norm_forward, h, y, save_mean, save_rstd, a, b, gamma, beta,
              eps);
}

void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc) {
  const char* op = "layer_norm_backward_add";
  check_devices(op, {{"x", x}, {"dskip", dskip}});
  check_same_shape(op, {"x", x}, {"dskip", dskip});
  check_dtype(op, {"dskip", dskip}, dx.dtype());
  if (!layer_norm_backward_needed(op, dx, dgamma, dbeta, dy, x, gamma, save_mean, save_rstd, acc))
    return;
  DP_DISPATCH(x.device(), layer_norm_backward_add, dx, dgamma, dbeta, dy, dskip, x, gamma,
              save_mean, save_rstd, acc);
}

// ---- Llama's layers ------------------------------------------------------------------------

void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma,
                      float eps) {
  const char* op = "rms_norm_forward";
  check_layer_norm(op, {"x", x}, {{"save_rstd", save_rstd}}, {{"gamma", gamma}});
  check_devices(op, {{"x", x}, {"y", y}});
  check_floating(op, {{"x", x}, {"y", y}});
  check_same_shape(op, {"x", x}, {"y", y});
  check_eps(op, eps);
  DP_CHECK(x.dim(1) > 0 || x.dim(0) == 0,
           op << ": x " << shape_str(x.shape()) << " has no features");
  if (x.numel() == 0) return;
  DP_DISPATCH(x.device(), rms_norm_forward, y, save_rstd, x, gamma, eps);
}

void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc) {
  const char* op = "rms_norm_backward";
  check_layer_norm(op, {"x", x}, {{"save_rstd", save_rstd}},
                   {{"gamma", gamma}, {"dgamma", dgamma}});
  check_devices(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_floating(op, {{"x", x}, {"dx", dx}, {"dy", dy}});
  check_same_shape(op, {"x", x}, {"dx", dx});
  check_same_shape(op, {"x", x}, {"dy", dy});
  if (dgamma.numel() == 0) return;
  if (x.numel() == 0) {
    if (acc == Accumulate::no) fill(dgamma, 0.f);
    return;
  }
  DP_DISPATCH(x.device(), rms_norm_backward, dx, dgamma, dy, x, gamma, save_rstd, acc);
}

namespace {
// h (M, 2 H) and y (M, H): the gate's halves.
void check_swiglu(const char* op, const Arg& y, const Arg& h) {
  check_devices(op, {y, h});
  check_floating(op, {y, h});
  check_ndim(op, y, 2);
  check_ndim(op, h, 2);
  DP_CHECK(h.t.dim(0) == y.t.dim(0) && h.t.dim(1) == 2 * y.t.dim(1),
           op << ": " << h.name << " " << shape_str(h.t.shape()) << " must be (M, 2 H) for "
              << y.name << " " << shape_str(y.t.shape()) << " (M, H)");
}
}  // namespace

void swiglu_forward(Tensor& y, const Tensor& h) {
  check_swiglu("swiglu_forward", {"y", y}, {"h", h});
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), swiglu_forward, y, h);
}

void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h) {
  const char* op = "swiglu_backward";
  check_swiglu(op, {"dy", dy}, {"h", h});
  check_devices(op, {{"h", h}, {"dh", dh}});
  check_floating(op, {{"dy", dy}, {"h", h}, {"dh", dh}});
  check_same_shape(op, {"h", h}, {"dh", dh});
  if (dy.numel() == 0) return;
  DP_DISPATCH(dy.device(), swiglu_backward, dh, dy, h);
}

void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation) {
  const char* op = "rotary_embedding";
  check_devices(op, {{"x", x}, {"cos", cos}, {"sin", sin}});
  check_floating(op, {{"x", x}});
  check_f32(op, {{"cos", cos}, {"sin", sin}});
  check_ndim(op, {"x", x}, 3);
  check_ndim(op, {"cos", cos}, 2);
  check_same_shape(op, {"cos", cos}, {"sin", sin});
  DP_CHECK(head_dim > 0 && head_dim % 2 == 0 && columns >= 0 && columns % head_dim == 0 &&
               columns <= x.dim(2),
           op << ": head_dim " << head_dim << " and columns " << columns << " for x "
              << shape_str(x.shape()) << " (need an even head_dim dividing columns <= " << x.dim(2)
              << ")");
  DP_CHECK(cos.dim(1) == head_dim / 2 && cos.dim(0) >= x.dim(1),
           op << ": tables " << shape_str(cos.shape()) << " must be (T_max >= " << x.dim(1) << ", "
              << head_dim / 2 << ")");
  if (x.numel() == 0 || columns == 0) return;
  DP_DISPATCH(x.device(), rotary_embedding, x, cos, sin, head_dim, columns, rotation);
}

// ---- dropout -------------------------------------------------------------------------------

void dropout_forward(Tensor& y, Tensor& mask, const Tensor& x, float p, uint64_t seed,
                     RngOffset offset) {
  const char* op = "dropout_forward";
  check_devices(op, {{"x", x}, {"y", y}, {"mask", mask}});
  check_floating(op, {{"x", x}, {"y", y}});
  check_dtype(op, {"mask", mask}, DType::f32);
  check_same_shape(op, {"x", x}, {"y", y});
  check_same_shape(op, {"x", x}, {"mask", mask});
  DP_CHECK(p >= 0.f && p < 1.f, op << ": p must be in [0, 1), got " << p);
  check_rng_offset(op, offset, x.device());
  if (x.numel() == 0) return;
  DP_DISPATCH(x.device(), dropout_forward, y, mask, x, p, seed, offset);
}

// ---- optimizers ----------------------------------------------------------------------------

namespace {
// requires skip_if undefined, or (1) f32 on the parameters' device.
void check_skip_flag(const char* op, const Tensor& params, const Tensor& skip_if) {
  if (!skip_if.defined()) return;
  check_devices(op, {{"params", params}, {"skip_if", skip_if}});
  check_dtype(op, {"skip_if", skip_if}, DType::f32);
  check_shape(op, {"skip_if", skip_if}, {1});
}

// requires copy undefined, or f16/bf16 with params' element count on their device
// (SgdConfig::compute_copy; being 16-bit, it cannot be a view of the f32 params).
void check_compute_copy(const char* op, const Tensor& params, const Tensor& copy) {
  if (!copy.defined()) return;
  check_devices(op, {{"params", params}, {"compute_copy", copy}});
  DP_CHECK(copy.dtype() == DType::f16 || copy.dtype() == DType::bf16,
           op << ": compute_copy " << copy << " must be f16 or bf16 (the parameters' 16-bit copy)");
  DP_CHECK(copy.numel() == params.numel(), op << ": compute_copy " << copy << " must hold the "
                                              << params.numel() << " values of params " << params);
}

// requires scalars f32 on the parameters' device with at least `count` elements.
void check_scalars(const char* op, const Tensor& params, const Tensor& scalars, int count) {
  check_devices(op, {{"params", params}, {"scalars", scalars}});
  check_dtype(op, {"scalars", scalars}, DType::f32);
  DP_CHECK(scalars.numel() >= count,
           op << ": scalars " << scalars << " must hold at least " << count << " values");
}

void check_step(const char* op, int64_t step) {
  DP_CHECK(step >= 1, op << ": step must be >= 1 (1 is the first step), got " << step);
}
}  // namespace

void set_values(Tensor& dst, const float* values, int n) {
  const char* op = "set_values";
  check_defined(op, dst, "dst");
  check_dtype(op, {"dst", dst}, DType::f32);
  DP_CHECK(n >= 0 && n <= kMaxValues && n <= dst.numel(),
           op << ": " << n << " values into dst " << dst << " (at most " << kMaxValues << ")");
  if (n == 0) return;
  Values vals;  // by value from here on: the caller's array is not read again
  std::copy(values, values + n, vals.v);
  vals.n = n;
  DP_DISPATCH(dst.device(), set_values, dst, vals);
}

void set_counter(Tensor& dst, uint64_t value) {
  const char* op = "set_counter";
  check_defined(op, dst, "dst");
  check_dtype(op, {"dst", dst}, DType::i64);
  check_shape(op, {"dst", dst}, {1});
  DP_DISPATCH(dst.device(), set_counter, dst, value);
}

std::array<float, SgdScalar::count> sgd_scalars(const SgdConfig& c, int64_t step) {
  check_step("sgd_scalars", step);
  std::array<float, SgdScalar::count> s{};
  s[SgdScalar::lr] = c.lr;
  s[SgdScalar::grad_unscale] = c.grad_unscale;
  s[SgdScalar::first_step] = step == 1 ? 1.f : 0.f;
  return s;
}

AdamWGroups single_group(const AdamWConfig& c) {
  AdamWGroups g;
  g.count = 1;
  g.weight_decay[0] = c.weight_decay;
  return g;
}

// Scalars in double, as PyTorch computes them in Python, rounded to float once.
std::array<float, AdamWScalar::count> adamw_scalars(const AdamWConfig& c, const AdamWGroups& groups,
                                                    int64_t step) {
  const char* op = "adamw_scalars";
  check_step(op, step);
  DP_CHECK(groups.count >= 1 && groups.count <= kMaxAdamWGroups,
           op << ": " << groups.count << " groups; 1 to " << kMaxAdamWGroups << " are supported");
  const double t = static_cast<double>(step);
  std::array<float, AdamWScalar::count> s{};
  s[AdamWScalar::grad_unscale] = c.grad_unscale;
  s[AdamWScalar::correction2_sqrt] =
      static_cast<float>(std::sqrt(1.0 - std::pow(double{c.beta2}, t)));
  for (int k = 0; k < groups.count; ++k) {
    const double lr = static_cast<double>(c.lr) * groups.lr_scale[k];
    s[AdamWScalar::decay + k] = static_cast<float>(1.0 - lr * groups.weight_decay[k]);
    s[AdamWScalar::step_size + k] = static_cast<float>(lr / (1.0 - std::pow(double{c.beta1}, t)));
  }
  return s;
}

void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars) {
  const char* op = "sgd_update";
  check_devices(op, {{"params", params}, {"grads", grads}});
  check_f32(op, {{"params", params}, {"grads", grads}});
  check_same_shape(op, {"params", params}, {"grads", grads});
  if (c.momentum != 0.f) {
    check_devices(op, {{"params", params}, {"momentum_buf", momentum_buf}});
    check_dtype(op, {"momentum_buf", momentum_buf}, DType::f32);
    check_same_shape(op, {"params", params}, {"momentum_buf", momentum_buf});
  }
  check_scalars(op, params, scalars, SgdScalar::count);
  check_skip_flag(op, params, c.skip_if);
  check_compute_copy(op, params, c.compute_copy);
  if (params.numel() == 0) return;
  DP_DISPATCH(params.device(), sgd_update, params, grads, momentum_buf, c, scalars);
}

namespace {
void check_adamw(const char* op, const Tensor& params, const Tensor& grads, const Tensor& m,
                 const Tensor& v, const AdamWConfig& c, const Tensor& scalars) {
  check_devices(op, {{"params", params}, {"grads", grads}, {"m", m}, {"v", v}});
  check_f32(op, {{"params", params}, {"grads", grads}, {"m", m}, {"v", v}});
  check_same_shape(op, {"params", params}, {"grads", grads});
  check_same_shape(op, {"params", params}, {"m", m});
  check_same_shape(op, {"params", params}, {"v", v});
  check_scalars(op, params, scalars, AdamWScalar::count);
  check_skip_flag(op, params, c.skip_if);
  check_compute_copy(op, params, c.compute_copy);
}
}  // namespace

void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const AdamWConfig& c,
                  const Tensor& scalars) {
  check_adamw("adamw_update", params, grads, m, v, c, scalars);
  if (params.numel() == 0) return;
  const Tensor no_groups;  // every element in group 0
  DP_DISPATCH(params.device(), adamw_update, params, grads, m, v, no_groups, c, scalars);
}

void adamw_update_grouped(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                          const Tensor& group_of, const AdamWConfig& c, const Tensor& scalars) {
  const char* op = "adamw_update_grouped";
  check_adamw(op, params, grads, m, v, c, scalars);
  check_devices(op, {{"params", params}, {"group_of", group_of}});
  check_dtype(op, {"group_of", group_of}, DType::u8);
  check_same_shape(op, {"params", params}, {"group_of", group_of});
  if (params.numel() == 0) return;
  DP_DISPATCH(params.device(), adamw_update, params, grads, m, v, group_of, c, scalars);
}

bool all_finite(const Tensor& x) {
  check_defined("all_finite", x, "x");
  if (x.numel() == 0) return true;
  DeviceContext& ctx = context(x.device());
  ctx.note_host_sync();  // the verdict comes back to the host
  if (x.device().is_cpu()) return run_cpu(ctx, [&] { return cpu::all_finite(x); });
  return DP_CUDA_DISPATCH_VALUE(bool, cuda::all_finite(x, ctx));
}

void non_finite_into(Tensor& flag, const Tensor& x) {
  const char* op = "non_finite_into";
  check_devices(op, {{"x", x}, {"flag", flag}});
  check_dtype(op, {"flag", flag}, DType::f32);
  check_shape(op, {"flag", flag}, {1});
  DP_DISPATCH(x.device(), non_finite_into, flag, x);
}

// ---- transformer ops -----------------------------------------------------------------------

namespace {

// ids (...) i32, table (V, D) f32, rows (..., D) f32 with ids.numel() rows of D.
// The rows (forward's y, backward's dy) are f32, or any floating dtype where `rows_floating`.
void check_embedding(const char* op, const Tensor& rows, const char* rows_name, const Tensor& ids,
                     const Tensor& table, const char* table_name, bool rows_floating = false) {
  check_devices(op, {{table_name, table}, {"ids", ids}, {rows_name, rows}});
  check_dtype(op, {"ids", ids}, DType::i32);
  check_f32(op, {{table_name, table}});
  if (rows_floating)
    check_floating(op, {{rows_name, rows}});
  else
    check_f32(op, {{rows_name, rows}});
  check_ndim(op, {table_name, table}, 2);
  DP_CHECK(rows.ndim() >= 1 && rows.dim(-1) == table.dim(1) &&
               rows.numel() == ids.numel() * table.dim(1),
           op << ": " << rows_name << " " << shape_str(rows.shape()) << " must be (..., "
              << table.dim(1) << ") with one row per id of " << shape_str(ids.shape()));
}

// qkv (B, T, 3 D) and y (B, T, D) of one dtype (f32, f16 or bf16), lse (B, H, T) f32, all on
// one device.
void check_attention(const char* op, const Tensor& qkv, const Tensor& y, const Tensor& lse,
                     const AttentionParams& p) {
  check_devices(op, {{"qkv", qkv}, {"y", y}, {"lse", lse}});
  DP_CHECK(is_floating(qkv.dtype()), op << ": qkv must be f32, f16 or bf16, got " << qkv);
  check_dtype(op, {"y", y}, qkv.dtype());
  check_f32(op, {{"lse", lse}});
  check_ndim(op, {"qkv", qkv}, 3);
  const int64_t b = qkv.dim(0), t = qkv.dim(1);
  DP_CHECK(qkv.dim(2) % 3 == 0, op << ": qkv " << shape_str(qkv.shape())
                                   << " must be (B, T, 3 D): its last dim is not a multiple of 3");
  const int64_t d = qkv.dim(2) / 3;
  DP_CHECK(p.heads >= 1 && d % p.heads == 0, op << ": " << p.heads
                                                << " heads do not divide the width " << d
                                                << " of qkv " << shape_str(qkv.shape()));
  DP_CHECK(std::isfinite(p.scale), op << ": scale " << p.scale << " is not finite");
  DP_CHECK(p.dropout >= 0.f && p.dropout < 1.f,
           op << ": dropout must be in [0, 1), got " << p.dropout);
  check_shape(op, {"y", y}, {b, t, d});
  check_shape(op, {"lse", lse}, {b, p.heads, t});
  check_rng_offset(op, p.dropout_offset, qkv.device());
}

}  // namespace

void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table) {
  check_embedding("embedding_forward", y, "y", ids, table, "table");
  if (ids.numel() == 0) return;
  DP_DISPATCH(y.device(), embedding_forward, y, ids, table);
}

void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids) {
  check_embedding("embedding_backward", dy, "dy", ids, dtable, "dtable", true);
  if (ids.numel() == 0) return;
  DP_DISPATCH(dy.device(), embedding_backward, dtable, dy, ids);
}

// 16-bit qkv: CUDA runs cuDNN's fused SDPA where it accepts the shape (kernels/cuda/sdpa.cu),
// else widens itself; the CPU backend widens each head in its task (no f32 copy of a tensor).
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p) {
  check_attention("attention_forward", qkv, y, lse, p);
  if (y.numel() == 0) return;
  DP_DISPATCH(y.device(), attention_forward, y, lse, qkv, p);
}

void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                        const Tensor& lse, const AttentionParams& p) {
  const char* op = "attention_backward";
  check_attention(op, qkv, y, lse, p);
  check_devices(op, {{"qkv", qkv}, {"dqkv", dqkv}, {"dy", dy}});
  check_dtype(op, {"dqkv", dqkv}, qkv.dtype());
  check_dtype(op, {"dy", dy}, qkv.dtype());
  check_same_shape(op, {"qkv", qkv}, {"dqkv", dqkv});
  check_same_shape(op, {"y", y}, {"dy", dy});
  if (y.numel() == 0) return;
  DP_DISPATCH(dy.device(), attention_backward, dqkv, dy, qkv, y, lse, p);
}

AttentionReport attention_report(DeviceContext& ctx) {
#if DP_HAVE_CUDA
  if (ctx.device().is_cuda()) {
    cuda::SdpaCounts c = cuda::sdpa_counts(ctx);
    return {c.fused, c.refused, std::move(c.refusals)};
  }
#endif
  (void)ctx;
  return {};
}

std::vector<std::pair<std::string, std::string>> library_versions() {
  std::vector<std::pair<std::string, std::string>> out = {{"openblas", cpu::blas_version()}};
  if (std::string onednn = cpu::bf16_gemm_version(); !onednn.empty())
    out.emplace_back("onednn", std::move(onednn));
#if DP_HAVE_CUDA
  for (auto& v : cuda::library_versions()) out.push_back(std::move(v));
#endif
  return out;
}

// ---- helpers for tests ---------------------------------------------------------------------

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  DP_CHECK(a.size() == b.size(), "max_abs_diff: sizes differ: " << a.size() << " vs " << b.size());
  float m = 0.f;
  for (size_t i = 0; i < a.size(); ++i) {
    float d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return d;
    m = std::max(m, d);
  }
  return m;
}

}  // namespace kernels
