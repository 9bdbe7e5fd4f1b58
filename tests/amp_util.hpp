// Mixed-precision helpers shared by the nn, DP and DDP suites: the loss difference that 16-bit
// rounding allows between two runs, and the single-device curve the engines are held to.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "nn/nn.hpp"
#include "tests/train_util.hpp"

namespace dp_test {

// The unit roundoff of a 16-bit format: half the distance between 1 and the next value
// (bf16: 8 significand bits, 2^-8; f16: 11 bits, 2^-11).
inline double unit_roundoff(kernels::DType t) {
  return t == kernels::DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

// How far the mean cross-entropy of one mixed-precision forward of an MLP (Linear, ReLU, ...,
// Linear) can lie from the exact f32 forward of the same master weights on batch x (B, in).
// Derivation (the standard model of rounding: each rounding to the 16-bit type multiplies a
// value by (1 + d) with |d| <= u, the d independent). For z = W a + b, with the input a already
// off by at most e_a elementwise, both operands of every product are rounded once:
//   dz = sum_k w_k a_k (d_k + d'_k) + (rounded W) e_a + f32 accumulation error.
// The first sum has independent terms bounded by 2u |w_k a_k|, so by Hoeffding's inequality it
// exceeds lambda * sqrt(sum_k (2u w_k a_k)^2) with probability at most 2 exp(-lambda^2 / 2)
// (lambda = 6: 3e-8 per entry), and never exceeds 2u sum_k |w_k a_k| (plus u^2 terms). The second
// is bounded outright by (1 + u) |W| e_a, the third by gamma_n sum_k |w_k a_k| (gamma_n = n 2^-24).
// ReLU is 1-Lipschitz: e passes on unchanged. Per row, cross-entropy moves by at most ||dz||_inf *
// ||softmax - target||_1 <= 2 ||dz||_inf, so the batch's mean loss moves by at most (2 / B) sum_i
// max_c e_z[i][c]. Two runs that each round their own way differ by up to twice that (each within
// it of the same f32 value).
inline double mixed_precision_loss_bound(nn::Module& mlp, const kernels::Tensor& x,
                                         kernels::DType dtype) {
  const double u = unit_roundoff(dtype);
  constexpr double kLambda = 6;  // Hoeffding: exceeded with probability <= 2 exp(-18) per entry
  const int64_t batch = x.dim(0);
  std::vector<float> xs = x.to_host_f32();
  std::vector<double> a(xs.begin(), xs.end()), e(a.size(), 0.0);
  int64_t width = x.numel() / batch;
  std::vector<nn::Linear*> layers;
  mlp.for_each_module([&](nn::Module& m) {
    if (auto* l = dynamic_cast<nn::Linear*>(&m)) layers.push_back(l);
  });
  for (size_t l = 0; l < layers.size(); ++l) {
    nn::Linear& lin = *layers[l];
    const int64_t in = lin.in_features(), out = lin.out_features();
    std::vector<float> w = lin.weight().value.to_host_f32();
    std::vector<float> bias =
        lin.bias() ? lin.bias()->value.to_host_f32() : std::vector<float>(out, 0.f);
    const double gamma = static_cast<double>(in) * std::ldexp(1.0, -24);
    std::vector<double> z(batch * out), ez(batch * out);
    for (int64_t i = 0; i < batch; ++i)
      for (int64_t o = 0; o < out; ++o) {
        double sum = bias[o], abs_wa = 0, sq_wa = 0, abs_we = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double wk = w[o * in + k], ak = a[i * width + k];
          sum += wk * ak;
          abs_wa += std::fabs(wk * ak);
          sq_wa += (wk * ak) * (wk * ak);
          abs_we += std::fabs(wk) * e[i * width + k];
        }
        z[i * out + o] = sum;
        // The rounding sum: the smaller of its worst case and Hoeffding's bound (wins when the
        // layer is wider than lambda^2 inputs).
        const double rounding = std::min(2 * u * abs_wa, kLambda * 2 * u * std::sqrt(sq_wa));
        ez[i * out + o] = (1 + u) * abs_we + rounding + u * u * abs_wa + gamma * abs_wa;
      }
    if (l + 1 < layers.size())
      for (double& v : z) v = std::max(v, 0.0);  // ReLU
    a = std::move(z);
    e = std::move(ez);
    width = out;
  }
  double sum = 0;
  for (int64_t i = 0; i < batch; ++i)
    sum += 2 * *std::max_element(e.begin() + i * width, e.begin() + (i + 1) * width);
  return sum / static_cast<double>(batch);
}

// A single-device run in `dtype`: losses[s] of each step, and bounds[s], how far another run's
// loss at that step may lie from it (twice mixed_precision_loss_bound at the step's weights).
struct MixedPrecisionCurve {
  std::vector<float> losses;
  std::vector<double> bounds;
};
// `m` materialised on cpu:0 from `seed`, trained with SGD `cfg` on toy batches 100, 101, ... of
// `batch` rows under the GradScaler of `dtype`.
inline MixedPrecisionCurve mixed_precision_curve(nn::ModulePtr m, uint64_t seed,
                                                 kernels::SgdConfig cfg, int64_t batch, int steps,
                                                 kernels::DType dtype) {
  m->materialize(kernels::Device::cpu(0), seed);
  m->set_compute_dtype(dtype);
  nn::SGD opt(*m, cfg);
  nn::GradScaler scaler(dtype == kernels::DType::bf16 ? nn::Precision::bf16 : nn::Precision::fp16);
  MixedPrecisionCurve c;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = toy_batch(batch, 100 + s);
    c.bounds.push_back(2 * mixed_precision_loss_bound(*m, x, dtype));
    c.losses.push_back(amp_step(*m, opt, scaler, x, y));
  }
  return c;
}

}  // namespace dp_test
