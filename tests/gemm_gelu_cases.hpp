// The fused Linear ops against the ops they stand for, on any device: kernels::gemm_gelu_tanh and
// its backward (GPT-2's MLP: a Linear with the GELU after it, and the next Linear's backward
// through it: the product into pre then gelu_tanh; the product into dpre, gelu_tanh_backward in
// place and bias_backward), and kernels::linear_param_grads (gemm into dw, bias_backward).
// kernels.gemm_gelu (CPU: the same bits) and kernels.cuda.gemm_gelu (within a bound where
// cuBLASLt's epilogues run) use them.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/ops.hpp"
#include "tests/test_util.hpp"

namespace gemm_gelu {

using kernels::Accumulate;
using kernels::Device;
using kernels::DType;
using kernels::Tensor;
using kernels::Transpose;

// One case: x (m, k), the layer's weight (n, k) and bias (n), the next layer's weight (n2, n) and
// the gradient dy (m, n2) it receives; activations in `t` (the bias too, as a Linear passes its
// 16-bit copy under 16-bit activations).
struct Case {
  int64_t m, n, k, n2;
  DType t;
  bool bias;
  Accumulate acc;
};

struct Outputs {
  Tensor y, pre, dpre, dbias;
};

inline Tensor input(Device d, const kernels::Shape& s, uint32_t seed, DType t) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(kernels::shape_numel(s)), seed, -1.5f, 1.5f), s, d,
      t);
}

// The op under test (fused true) or the ops in turn, on device d.
inline Outputs run(const Case& c, Device d, bool fused) {
  Tensor x = input(d, {c.m, c.k}, 1, c.t), w = input(d, {c.n, c.k}, 2, c.t);
  Tensor b = c.bias ? input(d, {c.n}, 3, c.t) : Tensor();
  Tensor w2 = input(d, {c.n2, c.n}, 4, c.t), dy = input(d, {c.m, c.n2}, 5, c.t);
  Outputs o;
  o.y = Tensor::zeros({c.m, c.n}, c.t, d);
  o.pre = Tensor::zeros({c.m, c.n}, c.t, d);
  o.dpre = Tensor::zeros({c.m, c.n}, c.t, d);
  o.dbias = input(d, {c.n}, 6, DType::f32);  // a gradient to add to, or to replace
  Tensor dbias = c.bias ? o.dbias : Tensor();
  if (fused) {
    kernels::gemm_gelu_tanh(o.y, o.pre, x, Transpose::no, w, Transpose::yes, b);
    kernels::gemm_gelu_tanh_backward(o.dpre, dbias, c.acc, dy, Transpose::no, w2, Transpose::no,
                                     o.pre);
  } else {
    kernels::gemm(o.pre, x, Transpose::no, w, Transpose::yes, 1.f, 0.f, b);
    kernels::gelu_tanh(o.y, o.pre);
    Tensor g = Tensor::zeros({c.m, c.n}, c.t, d);
    kernels::gemm(g, dy, Transpose::no, w2, Transpose::no);
    kernels::gelu_tanh_backward(o.dpre, g, o.pre, Accumulate::no);
    if (c.bias) kernels::bias_backward(dbias, o.dpre, c.acc);
  }
  return o;
}

// A Linear's parameter gradients from dy (m, n2) and x (m, n) of the case (the weight (n2, n)
// and bias (n2) gradients start from values to add to): linear_param_grads (fused true) or
// gemm and bias_backward. With f32_bias_dy the bias sums an f32 dy that dy was rounded from
// (mixed precision under f32 activations), else dy itself.
inline std::pair<Tensor, Tensor> param_grads(const Case& c, Device d, bool fused,
                                             bool f32_bias_dy) {
  Tensor dy32 = input(d, {c.m, c.n2}, 7, DType::f32), x = input(d, {c.m, c.n}, 8, c.t);
  Tensor dy = kernels::cast(dy32, c.t);
  const Tensor& for_bias = f32_bias_dy ? dy32 : dy;
  Tensor dw = input(d, {c.n2, c.n}, 9, DType::f32), db = input(d, {c.n2}, 10, DType::f32);
  Tensor dbias = c.bias ? db : Tensor();
  if (fused) {
    kernels::linear_param_grads(dw, dbias, dy, x, for_bias);
  } else {
    kernels::gemm(dw, dy, Transpose::yes, x, Transpose::no, 1.f, 1.f);
    if (c.bias) kernels::bias_backward(dbias, for_bias, Accumulate::yes);
  }
  return {dw, db};
}

// Aligned shapes (where a GPU's epilogue can run: n a multiple of 8) and odd ones, every dtype,
// with and without a bias, the bias gradient added to and replaced.
inline std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (bool bias : {true, false})
      for (Accumulate acc : {Accumulate::yes, Accumulate::no}) {
        out.push_back({64, 96, 40, 24, t, bias, acc});
        out.push_back({37, 13, 9, 5, t, bias, acc});
      }
  return out;
}

}  // namespace gemm_gelu
