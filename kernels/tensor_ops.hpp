// The broadcasting op set that research layers are composed of (nn/autograd.hpp derives their
// backward): elementwise unary ops, binary ops with NumPy broadcasting, reductions and softmax
// over any dimension, and strided copies (permute, narrow, expand, concatenate). Each op writes a
// preallocated output and has a backward op that writes or accumulates its input's gradient.
//
// Every tensor may be f32, f16 or bf16 (f16 and bf16 not both in one call): values are read as
// f32, computed in f32 and rounded once where stored; an accumulating output is read, added to
// in f32 and rounded once. Mirrored on CPU (kernels/cpu/tensor_ops.cpp) and CUDA
// (kernels/cuda/tensor_ops.cu). At most kMaxDims dimensions.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.hpp"

namespace kernels {

constexpr int kMaxDims = 8;

// ---- elementwise unary ---------------------------------------------------------------------
enum class UnaryOp {
  identity,    // x (a dtype conversion when y's dtype differs)
  affine,      // a x + b
  exp,         //
  log,         // natural logarithm
  sqrt,        //
  rsqrt,       // 1 / sqrt(x)
  reciprocal,  // 1 / x
  neg,         // -x
  abs,         // |x|; its gradient at 0 is 0
  pow,         // x^a
  sigmoid,     // 1 / (1 + e^-x)
  tanh,        //
  silu,        // x sigmoid(x)
  gelu_erf,    // x Phi(x) (PyTorch's GELU)
  gelu_tanh,   // GPT-2's tanh approximation
  relu,        // max(x, 0); its gradient at 0 is 0
};
const char* unary_name(UnaryOp op);
struct UnaryParams {
  float a = 1.f;  // affine's scale, pow's exponent
  float b = 0.f;  // affine's shift
};
// requires y and x one shape. ensures y = op(x).
void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p = {});
// requires dx, dy, x and y (the forward's output) one shape. ensures dx (+)= dy op'(x), from x
// or y as each op needs (exp, sqrt, rsqrt, reciprocal, sigmoid and tanh read y).
void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc);

// ---- binary with broadcasting --------------------------------------------------------------
enum class BinaryOp { add, sub, mul, div, maximum, minimum };
const char* binary_name(BinaryOp op);
// NumPy's rule: shapes aligned at their last dimension, each pair equal or one of them 1 (or
// missing). Throws naming both shapes when they do not broadcast.
Shape broadcast_shape(const Shape& a, const Shape& b);
// requires y's shape == broadcast_shape(a, b). ensures y = a op b.
void binary(Tensor& y, const Tensor& a, const Tensor& b, BinaryOp op);
enum class Operand { a, b };
// requires dy of broadcast_shape(a, b); d of the shape of `which` operand.
// ensures d (+)= the sum, over the elements of dy that the operand's element broadcast to, of
// dy times the partial derivative of (a op b) by that operand. maximum and minimum give the
// gradient (dy itself, selected) to a where a >= b (maximum) or a <= b (minimum), else to b.
void binary_backward(Tensor& d, Operand which, const Tensor& dy, const Tensor& a, const Tensor& b,
                     BinaryOp op, Accumulate acc);
// requires y's shape == broadcast of mask, a and b. ensures y = mask != 0 ? a : b.
void where(Tensor& y, const Tensor& mask, const Tensor& a, const Tensor& b);
// requires d of the shape of operand `which` (a or b), dy of y's shape. ensures d (+)= the sum
// over broadcast of dy where the mask selects that operand (mask != 0 for a, == 0 for b).
void where_backward(Tensor& d, Operand which, const Tensor& dy, const Tensor& mask, Accumulate acc);

// ---- reductions over one dimension ---------------------------------------------------------
enum class ReduceOp { sum, mean, max };
const char* reduce_name(ReduceOp op);
// requires 0 <= dim < x.ndim() (the caller resolves negative dims); y holds x.numel() /
// x.dim(dim) elements (kept dimension of size 1, or dropped). ensures y = op over dim of x.
void reduce(Tensor& y, const Tensor& x, int dim, ReduceOp op);
// requires dx of x's shape; dy and y as reduce's y. ensures dx (+)= dy (sum), dy / n (mean) or
// dy where x == y, else 0 (max: ties each take the whole gradient).
void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, int dim,
                     ReduceOp op, Accumulate acc);
enum class Softmax { softmax, log_softmax };
// requires y and x one shape, 0 <= dim < x.ndim(). ensures y = softmax or log-softmax over dim.
void softmax(Tensor& y, const Tensor& x, int dim, Softmax kind);
// requires dx, dy, y (the forward's output) one shape. ensures dx (+)= y (dy - sum(dy y)) for
// softmax, dy - exp(y) sum(dy) for log-softmax, sums over dim.
void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int dim, Softmax kind,
                      Accumulate acc);

// ---- strided copies ------------------------------------------------------------------------
// A strided view of a tensor's elements: element (i0, i1, ...) is at offset + sum_k i_k
// stride[k] (in elements) of the tensor's contiguous storage. Strides may be 0 (expand).
// Plain data, passed to CUDA kernels by value.
struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  int64_t offset = 0;
  int64_t numel() const {
    int64_t n = 1;
    for (int k = 0; k < ndim; ++k) n *= shape[k];
    return n;
  }
  Shape sizes() const { return Shape(shape, shape + ndim); }
};
// requires shape.size() <= kMaxDims. ensures the contiguous (row-major) layout of `shape`.
Layout contiguous_layout(const Shape& shape);
// requires both views of one shape, within their tensors; dst's view writes no element twice
// and shares no memory with src's (checked by byte range: views of one buffer must not meet,
// unless they are the same view).
// ensures each element of dst's view (+)= the same element of src's view.
void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc);

}  // namespace kernels
