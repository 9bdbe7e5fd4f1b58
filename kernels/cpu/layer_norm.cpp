// LayerNorm over the last dim of x (M, D). Rows run in parallel (two-pass statistics in double,
// in 8 interleaved partial sums); the parameter gradients sum over fixed chunks of rows, then
// over the chunks in order, so they are reproducible for any thread count. x, y, dy and dx may each
// be f32, f16 or bf16 (with_storage): read as f32, computed as the f32 kernel computes, rounded
// once where stored.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/lane_sum.hpp"

namespace kernels::cpu {

namespace {
int64_t row_grain(int64_t features) {
  return std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, features));
}

// One row: two-pass statistics in double, y rounded once; the mean and rstd saved as f32.
template <class Y, class X>
void forward_row(Y* yr, float& mean_out, float& rstd_out, const X* xr, const float* pg,
                 const float* pb, int64_t features, float eps) {
  double sx[kSumLanes] = {}, sv[kSumLanes] = {};
  lane_sums(features, sx, [&](int64_t j) { return double{load_f32(xr[j])}; });
  const double mean = add_lanes(sx) / static_cast<double>(features);
  lane_sums(features, sv, [&](int64_t j) {
    const double d = load_f32(xr[j]) - mean;
    return d * d;
  });
  const double var = add_lanes(sv) / static_cast<double>(features);
  const double rstd = 1.0 / std::sqrt(var + eps);
  for (int64_t j = 0; j < features; ++j)
    store_rounded(yr[j], static_cast<float>((load_f32(xr[j]) - mean) * rstd * pg[j] + pb[j]));
  mean_out = static_cast<float>(mean);
  rstd_out = static_cast<float>(rstd);
}

// One row's input gradient, each value handed to store(j, v) unrounded.
template <class DY, class X, class Store>
void backward_row(const DY* dyr, const X* xr, const float* pg, double mean, double rstd,
                  int64_t features, Store&& store) {
  double sg[kSumLanes] = {}, sgx[kSumLanes] = {};
  lane_sums(features, sg, [&](int64_t j) { return double{load_f32(dyr[j])} * pg[j]; });
  lane_sums(features, sgx, [&](int64_t j) {
    return double{load_f32(dyr[j])} * pg[j] * (load_f32(xr[j]) - mean) * rstd;
  });
  const double mean_g = add_lanes(sg) / features, mean_g_xhat = add_lanes(sgx) / features;
  for (int64_t j = 0; j < features; ++j) {
    double xhat = (load_f32(xr[j]) - mean) * rstd;
    store(j, static_cast<float>(rstd *
                                (double{load_f32(dyr[j])} * pg[j] - mean_g - xhat * mean_g_xhat)));
  }
}

// The backward over all rows (rows_with_feature_sums): each row's input gradient to
// store(r, j, v), v unrounded, and its terms of dgamma (dy xhat) and dbeta (dy) per feature; then
// dgamma (+)= and dbeta (+)= the sums.
template <class DY, class X, class Store>
void backward_rows(Tensor& dgamma, Tensor& dbeta, const DY* pdy, const X* px, const float* pg,
                   const float* pmean, const float* prstd, int64_t rows, int64_t features,
                   Accumulate acc, Store&& store) {
  float* pdgamma = dgamma.data<float>();
  float* pdbeta = dbeta.data<float>();
  rows_with_feature_sums<2>(
      rows, features,
      [&](int64_t r, double* sums) {
        const DY* dyr = pdy + r * features;
        const X* xr = px + r * features;
        const double mean = pmean[r], rstd = prstd[r];
        backward_row(dyr, xr, pg, mean, rstd, features,
                     [&](int64_t j, float v) { store(r, j, v); });
        double* sgx = sums;
        double* sd = sums + features;
        for (int64_t j = 0; j < features; ++j) {
          const double d = load_f32(dyr[j]);
          sd[j] += d;
          sgx[j] += d * ((load_f32(xr[j]) - mean) * rstd);
        }
      },
      [&](int64_t j, const double* totals) {
        pdgamma[j] =
            static_cast<float>(acc == Accumulate::yes ? pdgamma[j] + totals[0] : totals[0]);
        pdbeta[j] = static_cast<float>(acc == Accumulate::yes ? pdbeta[j] + totals[1] : totals[1]);
      });
}
}  // namespace

void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps) {
  with_storage(
      [&](auto y_t, auto x_t) {
        int64_t rows = x.dim(0), features = x.dim(1);
        const auto* px = x.data<decltype(x_t)>();
        auto* py = y.data<decltype(y_t)>();
        float* pmean = save_mean.data<float>();
        float* prstd = save_rstd.data<float>();
        parallel_range(rows, row_grain(features), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r)
            forward_row(py + r * features, pmean[r], prstd[r], px + r * features,
                        gamma.data<float>(), beta.data<float>(), features, eps);
        });
      },
      y.dtype(), x.dtype());
}

// Per row, while the row is in cache: h = a + b rounded to h's dtype, then forward_row on h as
// stored, so the bits are those of add and then layer_norm_forward.
void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps) {
  with_storage(
      [&](auto y_t, auto h_t) {
        using H = decltype(h_t);
        int64_t rows = h.dim(0), features = h.dim(1);
        const H* pa = a.data<H>();
        const H* pb = b.data<H>();
        H* ph = h.data<H>();
        auto* py = y.data<decltype(y_t)>();
        float* pmean = save_mean.data<float>();
        float* prstd = save_rstd.data<float>();
        parallel_range(rows, row_grain(features), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t o = r * features;
            for (int64_t j = 0; j < features; ++j)
              store_rounded(ph[o + j], load_f32(pa[o + j]) + load_f32(pb[o + j]));
            forward_row(py + o, pmean[r], prstd[r], ph + o, gamma.data<float>(), beta.data<float>(),
                        features, eps);
          }
        });
      },
      y.dtype(), h.dtype());
}

// With xhat = (x - mean) rstd and g = dy gamma, per row:
//   dx = rstd (g - mean_j g - xhat mean_j (g xhat));
// per feature: dgamma (+)= sum_rows dy xhat, dbeta (+)= sum_rows dy.
void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t) {
        int64_t rows = x.dim(0), features = x.dim(1);
        const auto* px = x.data<decltype(x_t)>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        const float* pmean = save_mean.data<float>();
        const float* prstd = save_rstd.data<float>();
        auto* pdx = dx.data<decltype(dx_t)>();
        backward_rows(
            dgamma, dbeta, pdy, px, gamma.data<float>(), pmean, prstd, rows, features, acc,
            [&](int64_t r, int64_t j, float v) { store_rounded(pdx[r * features + j], v); });
      },
      dx.dtype(), dy.dtype(), x.dtype());
}

// layer_norm_backward's value rounded to x's dtype (the dx it would store), then + dskip and
// rounded to dx's dtype: the bits of layer_norm_backward and then add.
void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t) {
        using DX = decltype(dx_t);
        using X = decltype(x_t);
        int64_t rows = x.dim(0), features = x.dim(1);
        const X* px = x.data<X>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        const DX* pskip = dskip.data<DX>();
        const float* pmean = save_mean.data<float>();
        const float* prstd = save_rstd.data<float>();
        DX* pdx = dx.data<DX>();
        backward_rows(dgamma, dbeta, pdy, px, gamma.data<float>(), pmean, prstd, rows, features,
                      acc, [&](int64_t r, int64_t j, float v) {
                        X as_x;
                        store_rounded(as_x, v);
                        const int64_t i = r * features + j;
                        store_rounded(pdx[i], load_f32(pskip[i]) + load_f32(as_x));
                      });
      },
      dx.dtype(), dy.dtype(), x.dtype());
}

}  // namespace kernels::cpu
