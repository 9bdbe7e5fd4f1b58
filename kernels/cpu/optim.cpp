// Fused optimizer steps over one flat f32 buffer, with PyTorch's formulas and operation order
// (scalars that PyTorch computes in Python are computed in double here too).
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

// g = grad unscale + wd p; buf = first ? g : m buf + (1 - damp) g; g = nesterov ? g + m buf : buf;
// p -= lr g.
namespace {
// The device-side verdict of SgdConfig::skip_if (on a CPU device, read when the update runs).
bool skipped(const Tensor& skip_if) {
  return skip_if.defined() && skip_if.data<float>()[0] != 0.f;
}
}  // namespace

void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                int64_t step) {
  if (skipped(c.skip_if)) return;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* buf = c.momentum != 0.f ? momentum_buf.data<float>() : nullptr;
  bool first_step = step == 1;
  float keep = 1.f - c.dampening;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float gi = g[i] * c.grad_unscale;
      float d = c.weight_decay != 0.f ? gi + c.weight_decay * p[i] : gi;
      if (buf) {
        buf[i] = first_step ? d : c.momentum * buf[i] + keep * d;
        d = c.nesterov == Nesterov::yes ? d + c.momentum * buf[i] : buf[i];
      }
      p[i] -= c.lr * d;
    }
  });
}

// p *= 1 - lr wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps).
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const AdamWConfig& c,
                  int64_t step) {
  if (skipped(c.skip_if)) return;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  double t = static_cast<double>(step);
  float decay = static_cast<float>(1.0 - static_cast<double>(c.lr) * c.weight_decay);
  float step_size = static_cast<float>(c.lr / (1.0 - std::pow(double{c.beta1}, t)));
  float correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double{c.beta2}, t)));
  float one_minus_b1 = 1.f - c.beta1, one_minus_b2 = 1.f - c.beta2;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      p[i] *= decay;
      float gi = g[i] * c.grad_unscale;
      pm[i] = c.beta1 * pm[i] + one_minus_b1 * gi;
      pv[i] = c.beta2 * pv[i] + one_minus_b2 * gi * gi;
      float denom = std::sqrt(pv[i]) / correction2_sqrt + c.eps;
      p[i] -= step_size * pm[i] / denom;
    }
  });
}

void non_finite_into(Tensor& flag, const Tensor& x) {
  flag.data<float>()[0] = cpu::all_finite(x) ? 0.f : 1.f;
}

// adamw_update per element, with its group's learning rate and weight decay.
void adamw_update_grouped(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v,
                          const Tensor& group_of, const AdamWConfig& c, const AdamWGroups& groups,
                          int64_t step) {
  if (skipped(c.skip_if)) return;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  const uint8_t* grp = group_of.data<uint8_t>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  double t = static_cast<double>(step);
  float decay[kMaxAdamWGroups], step_size[kMaxAdamWGroups];
  for (int k = 0; k < groups.count; ++k) {
    const double lr = static_cast<double>(c.lr) * groups.lr_scale[k];
    decay[k] = static_cast<float>(1.0 - lr * groups.weight_decay[k]);
    step_size[k] = static_cast<float>(lr / (1.0 - std::pow(double{c.beta1}, t)));
  }
  float correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double{c.beta2}, t)));
  float one_minus_b1 = 1.f - c.beta1, one_minus_b2 = 1.f - c.beta2;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int k = grp[i];
      p[i] *= decay[k];
      float gi = g[i] * c.grad_unscale;
      pm[i] = c.beta1 * pm[i] + one_minus_b1 * gi;
      pv[i] = c.beta2 * pv[i] + one_minus_b2 * gi * gi;
      float denom = std::sqrt(pv[i]) / correction2_sqrt + c.eps;
      p[i] -= step_size[k] * pm[i] / denom;
    }
  });
}

}  // namespace kernels::cpu
