// The kernels of Llama's layers: RMSNorm, SwiGLU's gate and rotary position embeddings. Rows run
// in parallel; RMSNorm's statistics are double (lane_sums), its gain gradient sums over fixed
// chunks of rows, then the chunks in order (rows_with_feature_sums: reproducible for any thread
// count). Activations and their gradients may each be f32, f16 or bf16 (with_storage): read as
// f32, rounded once where stored.
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
float sigmoid(float a) {
  return 1.f / (1.f + std::exp(-a));
}
}  // namespace

void rms_norm_forward(Tensor& y, Tensor& save_rstd, const Tensor& x, const Tensor& gamma,
                      float eps) {
  with_storage(
      [&](auto y_t, auto x_t) {
        const int64_t rows = x.dim(0), features = x.dim(1);
        const auto* px = x.data<decltype(x_t)>();
        const float* pg = gamma.data<float>();
        auto* py = y.data<decltype(y_t)>();
        float* pr = save_rstd.data<float>();
        parallel_range(rows, row_grain(features), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const auto* xr = px + r * features;
            double sq[kSumLanes] = {};
            lane_sums(features, sq,
                      [&](int64_t j) { return double{load_f32(xr[j])} * load_f32(xr[j]); });
            const double rstd =
                1.0 / std::sqrt(add_lanes(sq) / static_cast<double>(features) + eps);
            for (int64_t j = 0; j < features; ++j)
              store_rounded(py[r * features + j],
                            static_cast<float>(load_f32(xr[j]) * rstd * pg[j]));
            pr[r] = static_cast<float>(rstd);
          }
        });
      },
      y.dtype(), x.dtype());
}

// Per row, with g = dy gamma: dx = rstd (g - x rstd^2 mean_j(g_j x_j));
// per feature: dgamma (+)= sum_rows dy x rstd.
void rms_norm_backward(Tensor& dx, Tensor& dgamma, const Tensor& dy, const Tensor& x,
                       const Tensor& gamma, const Tensor& save_rstd, Accumulate acc) {
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t) {
        const int64_t rows = x.dim(0), features = x.dim(1);
        const auto* px = x.data<decltype(x_t)>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        const float* pg = gamma.data<float>();
        const float* pr = save_rstd.data<float>();
        auto* pdx = dx.data<decltype(dx_t)>();
        float* pdg = dgamma.data<float>();
        rows_with_feature_sums<1>(
            rows, features,
            [&](int64_t r, double* sums) {
              const auto* xr = px + r * features;
              const auto* dyr = pdy + r * features;
              const double rstd = pr[r];
              double sum_gx[kSumLanes] = {};
              lane_sums(features, sum_gx, [&](int64_t j) {
                return double{load_f32(dyr[j])} * pg[j] * load_f32(xr[j]);
              });
              const double k = rstd * rstd * add_lanes(sum_gx) / static_cast<double>(features);
              for (int64_t j = 0; j < features; ++j)
                store_rounded(pdx[r * features + j],
                              static_cast<float>(
                                  rstd * (double{load_f32(dyr[j])} * pg[j] - load_f32(xr[j]) * k)));
              for (int64_t j = 0; j < features; ++j)
                sums[j] += double{load_f32(dyr[j])} * load_f32(xr[j]) * rstd;
            },
            [&](int64_t j, const double* totals) {
              pdg[j] = static_cast<float>(acc == Accumulate::yes ? pdg[j] + totals[0] : totals[0]);
            });
      },
      dx.dtype(), dy.dtype(), x.dtype());
}

void swiglu_forward(Tensor& y, const Tensor& h) {
  with_storage(
      [&](auto y_t, auto h_t) {
        const int64_t rows = y.dim(0), width = y.dim(1);
        const auto* ph = h.data<decltype(h_t)>();
        auto* py = y.data<decltype(y_t)>();
        parallel_range(rows, row_grain(width), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const auto* a = ph + r * 2 * width;
            const auto* b = a + width;
            for (int64_t j = 0; j < width; ++j) {
              const float av = load_f32(a[j]);
              store_rounded(py[r * width + j], av * sigmoid(av) * load_f32(b[j]));
            }
          }
        });
      },
      y.dtype(), h.dtype());
}

// silu'(a) = s (1 + a (1 - s)), s = sigmoid(a).
void swiglu_backward(Tensor& dh, const Tensor& dy, const Tensor& h) {
  with_storage(
      [&](auto dh_t, auto dy_t, auto h_t) {
        const int64_t rows = dy.dim(0), width = dy.dim(1);
        const auto* ph = h.data<decltype(h_t)>();
        const auto* pdy = dy.data<decltype(dy_t)>();
        auto* pdh = dh.data<decltype(dh_t)>();
        parallel_range(rows, row_grain(width), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const auto* a = ph + r * 2 * width;
            const auto* b = a + width;
            auto* da = pdh + r * 2 * width;
            auto* db = da + width;
            for (int64_t j = 0; j < width; ++j) {
              const float av = load_f32(a[j]), bv = load_f32(b[j]),
                          g = load_f32(pdy[r * width + j]);
              const float s = sigmoid(av);
              store_rounded(da[j], g * bv * (s * (1.f + av * (1.f - s))));
              store_rounded(db[j], g * (av * s));
            }
          }
        });
      },
      dh.dtype(), dy.dtype(), h.dtype());
}

void rotary_embedding(Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                      int64_t columns, Rotation rotation) {
  with_storage(
      [&](auto x_t) {
        const int64_t batch = x.dim(0), steps = x.dim(1), width = x.dim(2);
        const int64_t half = head_dim / 2, heads = columns / head_dim;
        const float sign = rotation == Rotation::forward ? 1.f : -1.f;
        auto* px = x.data<decltype(x_t)>();
        const float* pc = cos.data<float>();
        const float* ps = sin.data<float>();
        parallel_range(batch * steps, row_grain(columns), [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) {
            const int64_t t = row % steps;
            const float* c = pc + t * half;
            const float* s = ps + t * half;
            for (int64_t hd = 0; hd < heads; ++hd) {
              auto* v = px + row * width + hd * head_dim;
              for (int64_t j = 0; j < half; ++j) {
                const float x1 = load_f32(v[j]), x2 = load_f32(v[j + half]);
                const float sn = sign * s[j];
                store_rounded(v[j], x1 * c[j] - x2 * sn);
                store_rounded(v[j + half], x2 * c[j] + x1 * sn);
              }
            }
          }
        });
      },
      x.dtype());
}

}  // namespace kernels::cpu
