// 2-D convolution (NCHW, cross-correlation) as im2col + GEMM:
//   forward        y_n (K, PQ)    = w (K, CRS) x col(x_n) (CRS, PQ)
//   backward data  dcol (CRS, PQ) = w^T (CRS, K) x dy_n (K, PQ),  dx_n (+)= col2im(dcol)
//   backward filter dw (K, CRS)  (+)= sum_n dy_n (K, PQ) x col(x_n)^T (PQ, CRS)
// Images run in parallel, each with its own column buffer. The filter gradient sums fixed
// groups of images into their own buffers and adds those in group order: deterministic.
// bf16 inputs run on the CPU's bf16 instructions where it has them (bf16 columns, the GEMMs of
// gemm_bf16.cpp, f32 sums); f16 inputs, and bf16 ones elsewhere, are widened to f32 (exact) and
// run through the f32 code. Either way the sums land in f32 scratch and each result is rounded
// once to the inputs' dtype before it is stored or added (as cuDNN's pseudo-16-bit
// configurations round their 16-bit output).
#include <algorithm>
#include <cstring>
#include <memory>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

// Filter gradient: at most this many partial sums (groups of images) in flight.
constexpr int64_t kMaxFilterPartials = 8;

struct ConvGeometry {
  int64_t channels, height, width;      // C, H, W of one input image
  int64_t filters, kernel_h, kernel_w;  // K, R, S
  int64_t out_h, out_w;                 // P, Q
  int64_t stride_h, stride_w, pad_h, pad_w;

  int64_t col_rows() const { return channels * kernel_h * kernel_w; }  // CRS
  int64_t col_cols() const { return out_h * out_w; }                   // PQ
  int64_t image_size() const { return channels * height * width; }
  int64_t output_size() const { return filters * out_h * out_w; }
  // A 1x1 filter with unit stride and no padding: col(x_n) is x_n itself.
  bool is_pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 &&
           pad_w == 0;
  }
};

ConvGeometry geometry(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  return {x.dim(1), x.dim(2), x.dim(3),   w.dim(0),   w.dim(2), w.dim(3),
          y.dim(2), y.dim(3), p.stride_h, p.stride_w, p.pad_h,  p.pad_w};
}

// The columns q of an output row whose input column w = q stride - shift lies in the image: the
// range [q0, q1) (col2im's add).
struct InImage {
  int64_t q0, q1;
};
InImage in_image(const ConvGeometry& g, int64_t shift) {
  const int64_t q0 = std::min(g.out_w, shift <= 0 ? 0 : (shift + g.stride_w - 1) / g.stride_w);
  const int64_t q1 = std::max(
      q0, std::min(g.out_w, g.width + shift <= 0 ? 0 : (g.width - 1 + shift) / g.stride_w + 1));
  return {q0, q1};
}

// col (CRS, PQ): col[(c, r, s), (p, q)] = x[c, p stride - pad + r, q stride - pad + s], or 0 in
// the padding. Read from a copy of the image inside its zero border (`padded`, the caller's
// scratch), so that each row of col is one plain copy, with no bounds per row and no fills: half
// the time of copying each row's in-image span between fills (LeNet's two convolutions and a
// ResNet 3x3, f32 and bf16).
template <typename T>
void im2col(const T* x, const ConvGeometry& g, T* col, std::vector<T>& padded) {
  const int64_t padded_h = g.height + 2 * g.pad_h, padded_w = g.width + 2 * g.pad_w;
  padded.assign(static_cast<size_t>(g.channels * padded_h * padded_w), T{});  // +0, f32 and bf16
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t h = 0; h < g.height; ++h)
      std::copy_n(x + (c * g.height + h) * g.width, g.width,
                  padded.data() + (c * padded_h + h + g.pad_h) * padded_w + g.pad_w);
  // Row p of (c, r, s) reads padded row p stride + r from column s: inside the copy, since the
  // output's size is (padded - kernel) / stride + 1.
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t r = 0; r < g.kernel_h; ++r)
      for (int64_t s = 0; s < g.kernel_w; ++s) {
        T* dst = col + ((c * g.kernel_h + r) * g.kernel_w + s) * g.col_cols();
        const T* first = padded.data() + (c * padded_h + r) * padded_w + s;
        for (int64_t p = 0; p < g.out_h; ++p, dst += g.out_w) {
          const T* src = first + p * g.stride_h * padded_w;
          if (g.stride_w == 1)
            for (int64_t q = 0; q < g.out_w; ++q) dst[q] = src[q];
          else
            for (int64_t q = 0; q < g.out_w; ++q) dst[q] = src[q * g.stride_w];
        }
      }
}

// The adjoint of im2col: x += scatter of col (entries in the padding are dropped). Each row of
// col adds to distinct elements of x, so its in-image span is one loop without a test per element
// (contiguous at stride 1); every element receives its terms in the same order as before.
void col2im_add(const float* col, const ConvGeometry& g, float* x) {
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t r = 0; r < g.kernel_h; ++r)
      for (int64_t s = 0; s < g.kernel_w; ++s) {
        const float* src = col + ((c * g.kernel_h + r) * g.kernel_w + s) * g.col_cols();
        const int64_t shift = g.pad_w - s;  // w = q stride - shift
        const InImage span = in_image(g, shift);
        for (int64_t p = 0; p < g.out_h; ++p, src += g.out_w) {
          int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.height) continue;
          float* dst = x + (c * g.height + h) * g.width;
          if (g.stride_w == 1) {
            for (int64_t q = span.q0; q < span.q1; ++q) dst[q - shift] += src[q];
          } else {
            for (int64_t q = span.q0; q < span.q1; ++q) dst[q * g.stride_w - shift] += src[q];
          }
        }
      }
}

// A task's scratch of n values whose first use overwrites them all (im2col's columns, a GEMM's
// output with beta 0): not zeroed first, as a std::vector of n would be (a memset of the whole
// buffer per task and call: 5% of the ResNet's step).
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(n)]);
}

// The products of the f32 path, and of the bf16 one (bf16 operands as stored, f32 sums).
void conv_gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  sgemm_parallel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void conv_gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// y (N, K, P, Q) = w (K, CRS) x col(x_n) for every image; T is float, or uint16_t for bf16.
template <typename T>
void forward_cols(const ConvGeometry& g, int64_t batch, const T* px, const T* pw, float* py) {
  parallel_range(batch, 1, [&](int64_t first, int64_t last) {
    auto col = scratch<T>(g.is_pointwise() ? 0 : g.col_rows() * g.col_cols());
    std::vector<T> padded;
    for (int64_t n = first; n < last; ++n) {
      const T* x_n = px + n * g.image_size();
      if (!g.is_pointwise()) im2col(x_n, g, col.get(), padded);
      const T* cols = g.is_pointwise() ? x_n : col.get();
      // (K, CRS) x (CRS, PQ) -> (K, PQ)
      conv_gemm(Transpose::no, Transpose::no, g.filters, g.col_cols(), g.col_rows(), 1.f, pw,
                g.col_rows(), cols, g.col_cols(), 0.f, py + n * g.output_size(), g.col_cols());
    }
  });
}

// dx (N, C, H, W) (+)= col2im(w^T dy_n) for every image.
template <typename T>
void backward_data_cols(const ConvGeometry& g, int64_t batch, const T* pdy, const T* pw, float* pdx,
                        Accumulate acc) {
  parallel_range(batch, 1, [&](int64_t first, int64_t last) {
    auto dcol = scratch<float>(g.is_pointwise() ? 0 : g.col_rows() * g.col_cols());
    for (int64_t n = first; n < last; ++n) {
      float* dx_n = pdx + n * g.image_size();
      const T* dy_n = pdy + n * g.output_size();
      // (CRS, K) x (K, PQ) -> (CRS, PQ), straight into dx_n when col(x_n) is x_n.
      float beta = g.is_pointwise() && acc == Accumulate::yes ? 1.f : 0.f;
      float* target = g.is_pointwise() ? dx_n : dcol.get();
      conv_gemm(Transpose::yes, Transpose::no, g.col_rows(), g.col_cols(), g.filters, 1.f, pw,
                g.col_rows(), dy_n, g.col_cols(), beta, target, g.col_cols());
      if (g.is_pointwise()) continue;
      if (acc == Accumulate::no) std::fill_n(dx_n, g.image_size(), 0.f);
      col2im_add(dcol.get(), g, dx_n);
    }
  });
}

// dw (K, CRS) (+)= sum_n dy_n col(x_n)^T, summed in fixed groups of images.
template <typename T>
void backward_filter_cols(const ConvGeometry& g, int64_t batch, const T* pdy, const T* px,
                          float* pdw, Accumulate acc) {
  int64_t per_group = (batch + kMaxFilterPartials - 1) / kMaxFilterPartials;
  int64_t groups = (batch + per_group - 1) / per_group;
  int64_t dw_size = g.filters * g.col_rows();
  // One group writes dw directly; several write partials that are added in group order.
  // Each group's first GEMM writes its partial whole (beta 0).
  auto partials = scratch<float>(groups > 1 ? groups * dw_size : 0);
  parallel_range(groups, 1, [&](int64_t first, int64_t last) {
    auto col = scratch<T>(g.is_pointwise() ? 0 : g.col_rows() * g.col_cols());
    std::vector<T> padded;
    for (int64_t group = first; group < last; ++group) {
      float* target = groups > 1 ? partials.get() + group * dw_size : pdw;
      float beta = groups == 1 && acc == Accumulate::yes ? 1.f : 0.f;
      for (int64_t n = group * per_group; n < std::min(batch, (group + 1) * per_group); ++n) {
        const T* x_n = px + n * g.image_size();
        if (!g.is_pointwise()) im2col(x_n, g, col.get(), padded);
        const T* cols = g.is_pointwise() ? x_n : col.get();
        // (K, PQ) x (PQ, CRS) -> (K, CRS), accumulated over the group's images.
        conv_gemm(Transpose::no, Transpose::yes, g.filters, g.col_rows(), g.col_cols(), 1.f,
                  pdy + n * g.output_size(), g.col_cols(), cols, g.col_cols(), beta, target,
                  g.col_rows());
        beta = 1.f;
      }
    }
  });
  if (groups == 1) return;
  parallel_range(dw_size, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float total = acc == Accumulate::yes ? pdw[i] : 0.f;
      for (int64_t group = 0; group < groups; ++group) total += partials[group * dw_size + i];
      pdw[i] = total;
    }
  });
}

// Both GEMM operands bf16 on a CPU whose bf16 products run on its bf16 instructions.
bool on_bf16_instructions(const Tensor& a, const Tensor& b) {
  return a.dtype() == DType::bf16 && b.dtype() == DType::bf16 && bf16_gemm_enabled();
}

// to = from rounded to `inputs` (an f16/bf16 dtype), + prev when given (bf16: vec_math.hpp's
// rounding, at the CPU's vector width).
void round_all(float* to, const float* from, const float* prev, int64_t n, DType inputs) {
  parallel_range(n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    if (inputs != DType::bf16) {
      if (prev)
        for (int64_t i = begin; i < end; ++i) to[i] = prev[i] + round_to(inputs, from[i]);
      else
        for (int64_t i = begin; i < end; ++i) to[i] = round_to(inputs, from[i]);
      return;
    }
    if (!prev) return round_to_bf16_rows(to + begin, from + begin, end - begin);
    float rounded[kConvertBlock];
    for (int64_t b = begin; b < end; b += kConvertBlock) {
      const int64_t m = std::min(kConvertBlock, end - b);
      round_to_bf16_rows(rounded, from + b, m);
      for (int64_t j = 0; j < m; ++j) to[b + j] = prev[b + j] + rounded[j];
    }
  });
}

// out (+)= result rounded to `inputs` (an f16/bf16 dtype); a 16-bit out rounds the sum again.
void store_rounded(Tensor& out, const std::vector<float>& result, DType inputs, Accumulate acc) {
  bool add = acc == Accumulate::yes;
  if (out.dtype() == DType::f32) {
    float* po = out.data<float>();
    round_all(po, result.data(), add ? po : nullptr, out.numel(), inputs);
    return;
  }
  std::vector<float> sum(static_cast<size_t>(out.numel()));
  const float* prev = add ? as_f32(out, sum) : nullptr;  // fills sum with out when adding
  round_all(sum.data(), result.data(), prev, out.numel(), inputs);
  store_from_f32(out, sum.data());
}

}  // namespace

// x (N, C, H, W) * w (K, C, R, S) -> y (N, K, P, Q)
void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  ConvGeometry g = geometry(x, w, y, p);
  if (x.dtype() == DType::f32)
    return forward_cols(g, x.dim(0), x.data<float>(), w.data<float>(), y.data<float>());
  std::vector<float> x_f32, w_f32, y_f32(static_cast<size_t>(y.numel()));
  if (on_bf16_instructions(x, w))
    forward_cols(g, x.dim(0), x.data<uint16_t>(), w.data<uint16_t>(), y_f32.data());
  else
    forward_cols(g, x.dim(0), as_f32(x, x_f32), as_f32(w, w_f32), y_f32.data());
  store_rounded(y, y_f32, x.dtype(), Accumulate::no);
}

// dy (N, K, P, Q), w (K, C, R, S) -> dx (N, C, H, W)
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc) {
  ConvGeometry g = geometry(dx, w, dy, p);
  if (dy.dtype() == DType::f32)
    return backward_data_cols(g, dx.dim(0), dy.data<float>(), w.data<float>(), dx.data<float>(),
                              acc);
  std::vector<float> dy_f32, w_f32, dx_f32(static_cast<size_t>(dx.numel()));
  if (on_bf16_instructions(dy, w))
    backward_data_cols(g, dx.dim(0), dy.data<uint16_t>(), w.data<uint16_t>(), dx_f32.data(),
                       Accumulate::no);
  else
    backward_data_cols(g, dx.dim(0), as_f32(dy, dy_f32), as_f32(w, w_f32), dx_f32.data(),
                       Accumulate::no);
  store_rounded(dx, dx_f32, dy.dtype(), acc);
}

// dy (N, K, P, Q), x (N, C, H, W) -> dw (K, C, R, S)
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc) {
  ConvGeometry g = geometry(x, dw, dy, p);
  if (x.dtype() == DType::f32)
    return backward_filter_cols(g, x.dim(0), dy.data<float>(), x.data<float>(), dw.data<float>(),
                                acc);
  std::vector<float> dy_f32, x_f32, dw_f32(static_cast<size_t>(dw.numel()));
  if (on_bf16_instructions(dy, x))
    backward_filter_cols(g, x.dim(0), dy.data<uint16_t>(), x.data<uint16_t>(), dw_f32.data(),
                         Accumulate::no);
  else
    backward_filter_cols(g, x.dim(0), as_f32(dy, dy_f32), as_f32(x, x_f32), dw_f32.data(),
                         Accumulate::no);
  store_rounded(dw, dw_f32, x.dtype(), acc);
}

}  // namespace kernels::cpu
