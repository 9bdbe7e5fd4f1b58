// 2-D convolution (NCHW, cross-correlation) as im2col + GEMM:
//   forward        y_n (K, PQ)    = w (K, CRS) x col(x_n) (CRS, PQ)
//   backward data  dcol (CRS, PQ) = w^T (CRS, K) x dy_n (K, PQ),  dx_n (+)= col2im(dcol)
//   backward filter dw (K, CRS)  (+)= sum_n dy_n (K, PQ) x col(x_n)^T (PQ, CRS)
// Images run in parallel, each with its own column buffer. The filter gradient sums fixed
// groups of images into their own buffers and adds those in group order: deterministic.
#include <cstring>

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

// col (CRS, PQ): col[(c, r, s), (p, q)] = x[c, p stride - pad + r, q stride - pad + s], or 0 in
// the padding.
void im2col(const float* x, const ConvGeometry& g, float* col) {
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t r = 0; r < g.kernel_h; ++r)
      for (int64_t s = 0; s < g.kernel_w; ++s) {
        float* dst = col + ((c * g.kernel_h + r) * g.kernel_w + s) * g.col_cols();
        for (int64_t p = 0; p < g.out_h; ++p, dst += g.out_w) {
          int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.height) {
            std::fill_n(dst, g.out_w, 0.f);
            continue;
          }
          const float* src = x + (c * g.height + h) * g.width;
          for (int64_t q = 0; q < g.out_w; ++q) {
            int64_t w = q * g.stride_w - g.pad_w + s;
            dst[q] = w >= 0 && w < g.width ? src[w] : 0.f;
          }
        }
      }
}

// The adjoint of im2col: x += scatter of col (entries in the padding are dropped).
void col2im_add(const float* col, const ConvGeometry& g, float* x) {
  for (int64_t c = 0; c < g.channels; ++c)
    for (int64_t r = 0; r < g.kernel_h; ++r)
      for (int64_t s = 0; s < g.kernel_w; ++s) {
        const float* src = col + ((c * g.kernel_h + r) * g.kernel_w + s) * g.col_cols();
        for (int64_t p = 0; p < g.out_h; ++p, src += g.out_w) {
          int64_t h = p * g.stride_h - g.pad_h + r;
          if (h < 0 || h >= g.height) continue;
          float* dst = x + (c * g.height + h) * g.width;
          for (int64_t q = 0; q < g.out_w; ++q) {
            int64_t w = q * g.stride_w - g.pad_w + s;
            if (w >= 0 && w < g.width) dst[w] += src[q];
          }
        }
      }
}

}  // namespace

void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  ConvGeometry g = geometry(x, w, y, p);
  const float* px = x.data<float>();
  const float* pw = w.data<float>();
  float* py = y.data<float>();
  parallel_range(x.dim(0), 1, [&](int64_t first, int64_t last) {
    std::vector<float> col(g.is_pointwise() ? 0 : static_cast<size_t>(g.col_rows() * g.col_cols()));
    for (int64_t n = first; n < last; ++n) {
      const float* x_n = px + n * g.image_size();
      if (!g.is_pointwise()) im2col(x_n, g, col.data());
      const float* cols = g.is_pointwise() ? x_n : col.data();
      // (K, CRS) x (CRS, PQ) -> (K, PQ)
      sgemm_parallel(Transpose::no, Transpose::no, g.filters, g.col_cols(), g.col_rows(), 1.f, pw,
                     g.col_rows(), cols, g.col_cols(), 0.f, py + n * g.output_size(), g.col_cols());
    }
  });
}

void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc) {
  ConvGeometry g = geometry(dx, w, dy, p);
  const float* pdy = dy.data<float>();
  const float* pw = w.data<float>();
  float* pdx = dx.data<float>();
  parallel_range(dx.dim(0), 1, [&](int64_t first, int64_t last) {
    std::vector<float> dcol(g.is_pointwise() ? 0
                                             : static_cast<size_t>(g.col_rows() * g.col_cols()));
    for (int64_t n = first; n < last; ++n) {
      float* dx_n = pdx + n * g.image_size();
      const float* dy_n = pdy + n * g.output_size();
      // (CRS, K) x (K, PQ) -> (CRS, PQ), straight into dx_n when col(x_n) is x_n.
      float beta = g.is_pointwise() && acc == Accumulate::yes ? 1.f : 0.f;
      float* target = g.is_pointwise() ? dx_n : dcol.data();
      sgemm_parallel(Transpose::yes, Transpose::no, g.col_rows(), g.col_cols(), g.filters, 1.f, pw,
                     g.col_rows(), dy_n, g.col_cols(), beta, target, g.col_cols());
      if (g.is_pointwise()) continue;
      if (acc == Accumulate::no) std::fill_n(dx_n, g.image_size(), 0.f);
      col2im_add(dcol.data(), g, dx_n);
    }
  });
}

void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc) {
  ConvGeometry g = geometry(x, dw, dy, p);
  int64_t batch = x.dim(0);
  int64_t per_group = (batch + kMaxFilterPartials - 1) / kMaxFilterPartials;
  int64_t groups = (batch + per_group - 1) / per_group;
  int64_t dw_size = dw.numel();
  const float* px = x.data<float>();
  const float* pdy = dy.data<float>();
  float* pdw = dw.data<float>();
  // One group writes dw directly; several write partials that are added in group order.
  std::vector<float> partials(groups > 1 ? static_cast<size_t>(groups * dw_size) : 0);
  parallel_range(groups, 1, [&](int64_t first, int64_t last) {
    std::vector<float> col(g.is_pointwise() ? 0 : static_cast<size_t>(g.col_rows() * g.col_cols()));
    for (int64_t group = first; group < last; ++group) {
      float* target = groups > 1 ? partials.data() + group * dw_size : pdw;
      float beta = groups == 1 && acc == Accumulate::yes ? 1.f : 0.f;
      for (int64_t n = group * per_group; n < std::min(batch, (group + 1) * per_group); ++n) {
        const float* x_n = px + n * g.image_size();
        if (!g.is_pointwise()) im2col(x_n, g, col.data());
        const float* cols = g.is_pointwise() ? x_n : col.data();
        // (K, PQ) x (PQ, CRS) -> (K, CRS), accumulated over the group's images.
        sgemm_parallel(Transpose::no, Transpose::yes, g.filters, g.col_rows(), g.col_cols(), 1.f,
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

}  // namespace kernels::cpu
