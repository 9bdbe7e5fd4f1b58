// The native 16-bit kernels (ops.hpp, "16-bit activations") against the widening path they
// replace, on any device: each case runs an op on f16/bf16 tensors (alone, or beside f32 ones),
// and the reference each result must equal bit for bit: every 16-bit input widened to an f32 copy
// (cast), the f32 op, each 16-bit output rounded once (cast back), an accumulating 16-bit output
// widened first. kernels.native16 (CPU) and kernels.cuda.native16 run them.
#pragma once

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "tests/test_util.hpp"

namespace native16 {

using kernels::Accumulate;
using kernels::Device;
using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

// One output of a case: the op's native result and the widening path's.
struct Result {
  std::string what;
  Tensor native, reference;
  // A reduction whose NaN (from a row holding inf and -inf) may take either sign: the compiler
  // may order the operands of a commutative add differently in two instantiations, and x86
  // keeps the first operand's NaN. Such results compare NaN-equal, other bits exactly.
  bool nan_sign_free = false;
};
using Results = std::vector<Result>;

// Inputs in [lo, hi) from `seed` with special values at seed-dependent places: zeros of both
// signs, infinities, NaN, values an f16 overflows on or rounds to a subnormal or zero.
inline Tensor input(Device d, const Shape& s, DType t, uint32_t seed, float lo = -3.f,
                    float hi = 3.f) {
  const size_t n = static_cast<size_t>(kernels::shape_numel(s));
  std::vector<float> v = dp_test::random_vector(n, seed, lo, hi);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.f,  -0.f,  inf,   -inf,   std::numeric_limits<float>::quiet_NaN(),
                            6e4f, -7e4f, 3e-6f, -2e-8f, 65504.f};
  for (size_t k = 0; k < std::size(specials) && k < n / 8; ++k)
    v[(k * 97 + seed) % n] = specials[k];
  return Tensor::from_vector(v, s, d, t);
}

// The widening path's pieces: an f32 copy of x (a new tensor for f32 too: the native op may
// write x), an f32 stand-in for output `out` (its widened copy when accumulating), and an f32
// result rounded once into out's dtype.
inline Tensor widened(const Tensor& x) {
  return kernels::cast(x, DType::f32);
}
inline Tensor stand_in(const Tensor& out, Accumulate acc) {
  return acc == Accumulate::yes ? widened(out)
                                : Tensor::zeros(out.shape(), DType::f32, out.device());
}
inline Tensor rounded(const Tensor& f32, DType d) {
  return kernels::cast(f32, d);
}

using dp_test::same_bits;  // same dtype, shape and bytes
// The same values, NaN equal to NaN (two backends may give a NaN different payloads): for
// outputs that the f32 ops on both backends compute with exactly rounded arithmetic.
inline bool same_values(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  std::vector<float> x = a.to_host_f32(), y = b.to_host_f32();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(std::isnan(x[i]) && std::isnan(y[i])) && std::memcmp(&x[i], &y[i], sizeof(float)) != 0)
      return false;
  return true;
}

// A case's verdict: the same bits (same values, NaN equal to NaN, where nan_sign_free).
inline bool equal(const Result& r) {
  return r.nan_sign_free ? same_values(r.native, r.reference) : same_bits(r.native, r.reference);
}

// The dtypes of an op's `count` tensors (outputs first): all t, then each one alone f32.
inline std::vector<std::vector<DType>> mixes(DType t, int count) {
  std::vector<std::vector<DType>> out{std::vector<DType>(static_cast<size_t>(count), t)};
  for (int i = 0; i < count; ++i) {
    out.push_back(out.front());
    out.back()[static_cast<size_t>(i)] = DType::f32;
  }
  return out;
}
inline std::string describe(const char* op, const std::vector<DType>& m, const Shape& s,
                            Accumulate acc = Accumulate::no) {
  std::string r = std::string(op) + " " + kernels::shape_str(s) + " dtypes";
  for (DType t : m) r += std::string(" ") + kernels::dtype_name(t);
  return r + (acc == Accumulate::yes ? " accumulate" : "");
}
inline Tensor empty(Device d, const Shape& s, DType t) {
  return Tensor::empty(s, t, d);
}
constexpr Accumulate kAccumulates[] = {Accumulate::no, Accumulate::yes};

// add and mul: same shapes (odd; one past the CPU's parallel grain), b broadcast over a's
// leading dims ((D) and (T, D)), and y aliasing a; scale by a fixed and a device factor.
inline Results elementwise(Device d, DType t) {
  Results out;
  const Shape big{2, 8209};
  for (auto [a_shape, b_shape] : {std::pair<Shape, Shape>{{3, 5, 7}, {3, 5, 7}},
                                  {big, big},
                                  {{3, 5, 7}, {7}},
                                  {{3, 5, 7}, {5, 7}}})
    for (const auto& m : mixes(t, 3))
      for (int which = 0; which < 2; ++which) {
        const char* op = which == 0 ? "add" : "mul";
        auto run = which == 0 ? kernels::add : kernels::mul;
        Tensor a = input(d, a_shape, m[1], 1), b = input(d, b_shape, m[2], 2);
        Tensor y = empty(d, a_shape, m[0]);
        run(y, a, b);
        Tensor y32 = empty(d, a_shape, DType::f32);
        run(y32, widened(a), widened(b));
        out.push_back({describe(op, m, b_shape), y, rounded(y32, m[0])});
      }
  for (DType dt : {t, DType::f32}) {  // y aliases a: a 16-bit a with an f32 b, and the reverse
    const DType bt = dt == t ? DType::f32 : t;
    Tensor a = input(d, {5, 11}, dt, 3), b = input(d, {11}, bt, 4);
    Tensor y32 = empty(d, {5, 11}, DType::f32);
    kernels::add(y32, widened(a), widened(b));
    kernels::add(a, a, b);
    out.push_back({describe("add in place", {dt, dt, bt}, {11}), a, rounded(y32, dt)});
  }
  // scale: by a fixed factor and by one read on the device (a micro-batch's weight), in place.
  Tensor factor = Tensor::empty({1}, DType::f32, d);
  kernels::fill(factor, 0.3f);
  for (const Shape& s : {Shape{3, 5, 7}, big})
    for (const auto& m : mixes(t, 2)) {
      Tensor x = input(d, s, m[1], 5), y = empty(d, s, m[0]);
      kernels::scale(y, x, -2.5f);
      Tensor y32 = empty(d, s, DType::f32);
      kernels::scale(y32, widened(x), -2.5f);
      out.push_back({describe("scale", m, s), y, rounded(y32, m[0])});
    }
  Tensor x = input(d, big, t, 6);
  Tensor y32 = empty(d, big, DType::f32);
  kernels::scale(y32, widened(x), kernels::Scalar(factor));
  kernels::scale(x, x, kernels::Scalar(factor));
  out.push_back({describe("scale in place by a device factor", {t, t}, big), x, rounded(y32, t)});
  return out;
}

// add_bias and bias_backward over (N, C) and (N, C, H, W); 1000 rows use several row chunks of
// the CUDA column sums, (4, 3, 32, 33) several chunks per channel.
inline Results bias(Device d, DType t) {
  Results out;
  for (const Shape& s : {Shape{5, 37}, Shape{1000, 37}, Shape{3, 7, 5, 3}, Shape{4, 3, 32, 33}}) {
    const Shape c{s[1]};
    for (const auto& m : mixes(t, 2)) {
      Tensor y = input(d, s, m[0], 5), bias = input(d, c, m[1], 6);
      Tensor y32 = widened(y);
      kernels::add_bias(y32, widened(bias));
      kernels::add_bias(y, bias);
      out.push_back({describe("add_bias", m, s), y, rounded(y32, m[0])});
      for (Accumulate acc : kAccumulates) {
        // Finite dy: a channel sum of specials is NaN or inf whatever the order.
        Tensor dy = Tensor::from_vector(
            dp_test::random_vector(static_cast<size_t>(kernels::shape_numel(s)), 7), s, d, m[1]);
        Tensor db = input(d, c, m[0], 8);
        Tensor db32 = stand_in(db, acc);
        kernels::bias_backward(db32, widened(dy), acc);
        kernels::bias_backward(db, dy, acc);
        out.push_back({describe("bias_backward", m, s, acc), db, rounded(db32, m[0])});
      }
    }
  }
  return out;
}

// relu, gelu, gelu_tanh, tanh and their backwards (tanh's from its output).
inline Results activations(Device d, DType t) {
  Results out;
  const Shape s{7, 331};
  for (int which = 0; which < 4; ++which) {
    const char* names[] = {"relu", "gelu", "gelu_tanh", "tanh"};
    auto forward = [&](Tensor& y, const Tensor& x) {
      if (which == 0) kernels::relu(y, x);
      if (which == 1) kernels::gelu(y, x);
      if (which == 2) kernels::gelu_tanh(y, x);
      if (which == 3) kernels::tanh(y, x);
    };
    auto backward = [&](Tensor& dx, const Tensor& dy, const Tensor& v, Accumulate acc) {
      if (which == 0) kernels::relu_backward(dx, dy, v, acc);
      if (which == 1) kernels::gelu_backward(dx, dy, v, acc);
      if (which == 2) kernels::gelu_tanh_backward(dx, dy, v, acc);
      if (which == 3) kernels::tanh_backward(dx, dy, v, acc);
    };
    for (const auto& m : mixes(t, 2)) {
      Tensor x = input(d, s, m[1], 9, -4.f, 4.f), y = empty(d, s, m[0]);
      forward(y, x);
      Tensor y32 = empty(d, s, DType::f32);
      forward(y32, widened(x));
      out.push_back({describe(names[which], m, s), y, rounded(y32, m[0])});
    }
    for (const auto& m : mixes(t, 3))
      for (Accumulate acc : kAccumulates) {
        Tensor dy = input(d, s, m[1], 10), v = input(d, s, m[2], 11, -4.f, 4.f);
        if (which == 3) {  // tanh's v is its output, in [-1, 1]
          Tensor x = v;
          v = empty(d, s, m[2]);
          kernels::tanh(v, x);
        }
        Tensor dx = input(d, s, m[0], 12);
        Tensor dx32 = stand_in(dx, acc);
        backward(dx32, widened(dy), widened(v), acc);
        backward(dx, dy, v, acc);
        out.push_back({describe(names[which], m, s, acc) + " backward", dx, rounded(dx32, m[0])});
      }
  }
  return out;
}

// dropout_forward: y and x 16-bit or f32, the mask f32 (the same bits as the f32 op's), an
// offset that is not a multiple of 4.
inline Results dropout(Device d, DType t) {
  Results out;
  const Shape s{3, 1237};
  for (const auto& m : mixes(t, 2)) {
    Tensor x = input(d, s, m[1], 13), y = empty(d, s, m[0]);
    Tensor mask = empty(d, s, DType::f32), mask32 = empty(d, s, DType::f32);
    kernels::dropout_forward(y, mask, x, 0.3f, 21, 5);
    Tensor y32 = empty(d, s, DType::f32);
    kernels::dropout_forward(y32, mask32, widened(x), 0.3f, 21, 5);
    out.push_back({describe("dropout_forward", m, s), y, rounded(y32, m[0])});
    out.push_back({describe("dropout_forward mask", m, s), mask, mask32});
  }
  return out;
}

// Max and average pooling, forward and backward: plain, overlapping windows with padding, and
// stride 1 (heavy overlap: a 16-bit dx adds several windows in f32 before it rounds); ties.
inline Results pooling(Device d, DType t) {
  Results out;
  std::vector<std::pair<Shape, kernels::Pool2dParams>> cases = {
      {{2, 3, 8, 8}, {2, 2, 2, 2, 0, 0}},
      {{2, 3, 9, 7}, {3, 3, 2, 2, 1, 1}},
      {{1, 2, 5, 6}, {3, 2, 1, 1, 1, 1}},
  };
  for (const auto& [xs, p] : cases) {
    const Shape ys{xs[0], xs[1], kernels::conv_out_size(xs[2], p.kernel_h, p.stride_h, p.pad_h),
                   kernels::conv_out_size(xs[3], p.kernel_w, p.stride_w, p.pad_w)};
    for (const auto& m : mixes(t, 2)) {
      Tensor x = input(d, xs, m[1], 14);
      Tensor y = empty(d, ys, m[0]), y32 = empty(d, ys, DType::f32);
      kernels::max_pool2d_forward(y, x, p);
      kernels::max_pool2d_forward(y32, widened(x), p);
      out.push_back({describe("max_pool2d_forward", m, xs), y, rounded(y32, m[0])});
      Tensor ya = empty(d, ys, m[0]), ya32 = empty(d, ys, DType::f32);
      kernels::avg_pool2d_forward(ya, x, p);
      kernels::avg_pool2d_forward(ya32, widened(x), p);
      out.push_back({describe("avg_pool2d_forward", m, xs), ya, rounded(ya32, m[0])});
      for (Accumulate acc : kAccumulates) {
        Tensor dy = input(d, ys, m[1], 15), dx = input(d, xs, m[0], 16);
        Tensor dx32 = stand_in(dx, acc);
        kernels::avg_pool2d_backward(dx32, widened(dy), p, acc);
        kernels::avg_pool2d_backward(dx, dy, p, acc);
        out.push_back({describe("avg_pool2d_backward", m, xs, acc), dx, rounded(dx32, m[0])});
      }
    }
    // (dx, dy, x, y); y is the forward's output of x in y's dtype (a rounded maximum may match
    // no element: that window passes nothing back, on both paths).
    for (const auto& m : mixes(t, 4))
      for (Accumulate acc : kAccumulates) {
        Tensor x = input(d, xs, m[2], 17), dy = input(d, ys, m[1], 18);
        Tensor y = empty(d, ys, m[3]);
        kernels::max_pool2d_forward(y, x, p);
        Tensor dx = input(d, xs, m[0], 19);
        Tensor dx32 = stand_in(dx, acc);
        kernels::max_pool2d_backward(dx32, widened(dy), widened(x), widened(y), p, acc);
        kernels::max_pool2d_backward(dx, dy, x, y, p, acc);
        out.push_back({describe("max_pool2d_backward", m, xs, acc), dx, rounded(dx32, m[0])});
      }
  }
  return out;
}

// layer_norm_forward (y, x) and layer_norm_backward (dx, dy, x): rows past the CPU's grain, an
// odd feature count, one row, and rows of a multiple of 8 (the GPU's pack kernels, 64 and
// GPT-2's 768); the statistics and parameter gradients stay f32 and must match too. Inputs
// within +-3 (a special value would poison a whole row's statistics alike).
inline Results layer_norm(Device d, DType t) {
  Results out;
  for (const Shape& xs :
       {Shape{37, 75}, Shape{1, 9}, Shape{300, 129}, Shape{5, 64}, Shape{3, 768}}) {
    const Shape rows{xs[0]}, features{xs[1]};
    auto f32 = [&](const Shape& s, uint32_t seed) {
      return Tensor::from_vector(
          dp_test::random_vector(static_cast<size_t>(kernels::shape_numel(s)), seed, -1.f, 1.f), s,
          d);
    };
    Tensor gamma = f32(features, 21), beta = f32(features, 22);
    auto plain = [&](const Shape& s, DType dt, uint32_t seed) {
      return Tensor::from_vector(
          dp_test::random_vector(static_cast<size_t>(kernels::shape_numel(s)), seed, -3.f, 3.f), s,
          d, dt);
    };
    for (const auto& m : mixes(t, 2)) {
      Tensor x = plain(xs, m[1], 23);
      Tensor y = empty(d, xs, m[0]), mean = empty(d, rows, DType::f32),
             rstd = empty(d, rows, DType::f32);
      kernels::layer_norm_forward(y, mean, rstd, x, gamma, beta, 1e-5f);
      Tensor y32 = empty(d, xs, DType::f32), mean32 = empty(d, rows, DType::f32),
             rstd32 = empty(d, rows, DType::f32);
      kernels::layer_norm_forward(y32, mean32, rstd32, widened(x), gamma, beta, 1e-5f);
      out.push_back({describe("layer_norm_forward", m, xs), y, rounded(y32, m[0])});
      out.push_back({describe("layer_norm_forward mean", m, xs), mean, mean32});
      out.push_back({describe("layer_norm_forward rstd", m, xs), rstd, rstd32});
    }
    for (const auto& m : mixes(t, 3)) {  // (dx, dy, x)
      Tensor x = plain(xs, m[2], 24), dy = plain(xs, m[1], 25);
      Tensor mean = empty(d, rows, DType::f32), rstd = empty(d, rows, DType::f32);
      Tensor unused = empty(d, xs, DType::f32);
      kernels::layer_norm_forward(unused, mean, rstd, x, gamma, beta, 1e-5f);
      Tensor dx = empty(d, xs, m[0]), dg = f32(features, 26), db = f32(features, 27);
      Tensor dx32 = empty(d, xs, DType::f32), dg32 = dg.clone(), db32 = db.clone();
      kernels::layer_norm_backward(dx, dg, db, dy, x, gamma, mean, rstd, Accumulate::yes);
      kernels::layer_norm_backward(dx32, dg32, db32, widened(dy), widened(x), gamma, mean, rstd,
                                   Accumulate::yes);
      out.push_back({describe("layer_norm_backward", m, xs), dx, rounded(dx32, m[0])});
      out.push_back({describe("layer_norm_backward dgamma", m, xs), dg, dg32});
      out.push_back({describe("layer_norm_backward dbeta", m, xs), db, db32});
    }
  }
  return out;
}

// embedding_backward with a 16-bit dy: repeated ids (accumulated in position order), an odd
// width, into a non-zero table.
inline Results embedding(Device d, DType t) {
  Results out;
  const int64_t vocab = 13, width = 7;
  std::vector<int32_t> id_values{3, 0, 3, 12, 5, 3, 0, 7, 7, 1, 3};
  const auto n = static_cast<int64_t>(id_values.size());
  Tensor ids = Tensor::from_ints(id_values, {n}, d);
  Tensor dy = input(d, {n, width}, t, 28);
  Tensor table = input(d, {vocab, width}, DType::f32, 29);
  Tensor table32 = table.clone();
  kernels::embedding_backward(table, dy, ids);
  kernels::embedding_backward(table32, widened(dy), ids);
  out.push_back({describe("embedding_backward", {DType::f32, t}, {n, width}), table, table32});
  return out;
}

// The losses and metrics of a 16-bit model output: softmax_cross_entropy (weights, smoothing)
// and token_cross_entropy (ignored rows) with 16-bit logits, dlogits in their dtype or f32; and
// argmax and count_correct_into of 16-bit logits. Rows of 53 classes, and rows of 1031 (several
// CUDA threads per row, one past the CPU's per-row grain).
inline Results losses(Device d, DType t) {
  Results out;
  for (const Shape& s : {Shape{37, 53}, Shape{9, 1031}}) {
    const int64_t rows = s[0], classes = s[1];
    std::vector<int32_t> label_values, target_values;
    for (int64_t i = 0; i < rows; ++i) {
      label_values.push_back(static_cast<int32_t>((i * 7 + 3) % classes));
      target_values.push_back(i % 4 == 1 ? -1 : label_values.back());  // -1: ignored
    }
    Tensor labels = Tensor::from_ints(label_values, {rows}, d);
    Tensor targets = Tensor::from_ints(target_values, {rows}, d);
    Tensor weights = input(d, {rows}, DType::f32, 30, 0.f, 2.f);
    Tensor logits = input(d, s, t, 31, -8.f, 8.f);
    for (DType dt : {t, DType::f32}) {
      const std::vector<DType> m{dt, t};
      for (const char* op : {"softmax_cross_entropy", "token_cross_entropy"}) {
        Tensor loss = empty(d, {1}, DType::f32), loss32 = empty(d, {1}, DType::f32);
        Tensor dl = empty(d, s, dt), dl32 = empty(d, s, DType::f32);
        if (op[0] == 's') {
          kernels::softmax_cross_entropy(loss, dl, logits, labels, weights, 0.1f);
          kernels::softmax_cross_entropy(loss32, dl32, widened(logits), labels, weights, 0.1f);
        } else {
          kernels::token_cross_entropy(loss, dl, logits, targets, -1);
          kernels::token_cross_entropy(loss32, dl32, widened(logits), targets, -1);
        }
        out.push_back({describe(op, m, s) + " loss", loss, loss32, true});
        out.push_back({describe(op, m, s) + " dlogits", dl, rounded(dl32, dt), true});
      }
    }
    Tensor idx = empty(d, {rows}, DType::i32), idx32 = empty(d, {rows}, DType::i32);
    kernels::argmax(idx, logits);
    kernels::argmax(idx32, widened(logits));
    out.push_back({describe("argmax", {DType::i32, t}, s), idx, idx32});
    Tensor hits = empty(d, {1}, DType::f32), hits32 = empty(d, {1}, DType::f32);
    kernels::count_correct_into(hits, logits, idx32);  // every row right: the count is rows
    kernels::count_correct_into(hits32, widened(logits), idx32);
    out.push_back({describe("count_correct_into", {DType::f32, t}, s), hits, hits32});
  }
  return out;
}

// Llama's kernels: rms_norm forward and backward (odd width, accumulating dgamma), swiglu both
// ways, rotary in place both ways (q and k turned, v kept).
inline Results llama(Device d, DType t) {
  Results out;
  const Shape xs{5, 37};
  for (const auto& m : mixes(t, 3)) {  // (y or dx, x, dy)
    Tensor x = input(d, xs, m[1], 40), gamma = input(d, {37}, DType::f32, 41, 0.5f, 1.5f);
    Tensor y = empty(d, xs, m[0]), y32 = empty(d, xs, DType::f32);
    Tensor r = empty(d, {5}, DType::f32), r32 = empty(d, {5}, DType::f32);
    kernels::rms_norm_forward(y, r, x, gamma, 1e-5f);
    kernels::rms_norm_forward(y32, r32, widened(x), gamma, 1e-5f);
    out.push_back({describe("rms_norm_forward", m, xs), y, rounded(y32, m[0])});
    out.push_back({describe("rms_norm_forward rstd", m, xs), r, r32});
    Tensor dy = input(d, xs, m[2], 42);
    Tensor dx = empty(d, xs, m[0]), dx32 = empty(d, xs, DType::f32);
    Tensor dg = input(d, {37}, DType::f32, 43), dg32 = dg.clone();
    kernels::rms_norm_backward(dx, dg, dy, x, gamma, r32, Accumulate::yes);
    kernels::rms_norm_backward(dx32, dg32, widened(dy), widened(x), gamma, r32, Accumulate::yes);
    out.push_back({describe("rms_norm_backward", m, xs), dx, rounded(dx32, m[0])});
    out.push_back({describe("rms_norm_backward dgamma", m, xs), dg, dg32});
  }
  const Shape hs{6, 2 * 29}, gs{6, 29};
  for (const auto& m : mixes(t, 3)) {  // (y or dh, h, dy)
    Tensor h = input(d, hs, m[1], 44);
    Tensor y = empty(d, gs, m[0]), y32 = empty(d, gs, DType::f32);
    kernels::swiglu_forward(y, h);
    kernels::swiglu_forward(y32, widened(h));
    out.push_back({describe("swiglu_forward", m, hs), y, rounded(y32, m[0])});
    Tensor dy = input(d, gs, m[2], 45);
    Tensor dh = empty(d, hs, m[0]), dh32 = empty(d, hs, DType::f32);
    kernels::swiglu_backward(dh, dy, h);
    kernels::swiglu_backward(dh32, widened(dy), widened(h));
    // silu' at a = -inf is 0 (-inf): a NaN whose sign the compiler's operand order picks.
    out.push_back({describe("swiglu_backward", m, hs), dh, rounded(dh32, m[0]), true});
  }
  const int64_t half = 3;
  Tensor cos = input(d, {9, half}, DType::f32, 46), sin = input(d, {9, half}, DType::f32, 47);
  for (auto rotation : {kernels::Rotation::forward, kernels::Rotation::inverse}) {
    Tensor x = input(d, {2, 7, 3 * 12}, t, 48);
    Tensor x32 = widened(x);
    kernels::rotary_embedding(x, cos, sin, 2 * half, 24, rotation);
    kernels::rotary_embedding(x32, cos, sin, 2 * half, 24, rotation);
    out.push_back({describe(rotation == kernels::Rotation::forward ? "rotary_embedding forward"
                                                                   : "rotary_embedding inverse",
                            {t}, {2, 7, 36}),
                   x, rounded(x32, t)});
  }
  return out;
}

}  // namespace native16
