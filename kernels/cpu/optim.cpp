// Fused optimizer steps over one flat f32 buffer, with PyTorch's formulas and operation order.
// The per-step scalars (computed on the host in double: kernels::sgd_scalars, adamw_scalars) are
// read from their tensor when the update runs.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

void set_values(Tensor& dst, const Values& values) {
  std::copy(values.v, values.v + values.n, dst.data<float>());
}

namespace {
// The device-side verdict of SgdConfig::skip_if (on a CPU device, read when the update runs).
bool skipped(const Tensor& skip_if) {
  return skip_if.defined() && skip_if.data<float>()[0] != 0.f;
}
}  // namespace

// g = grad unscale + wd p; buf = first ? g : m buf + (1 - damp) g; g = nesterov ? g + m buf : buf;
// p -= lr g.
void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars) {
  if (skipped(c.skip_if)) return;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  float* buf = c.momentum != 0.f ? momentum_buf.data<float>() : nullptr;
  const float* s = scalars.data<float>();
  const float lr = s[SgdScalar::lr], unscale = s[SgdScalar::grad_unscale];
  const bool first_step = s[SgdScalar::first_step] != 0.f;
  float keep = 1.f - c.dampening;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float gi = g[i] * unscale;
      float d = c.weight_decay != 0.f ? gi + c.weight_decay * p[i] : gi;
      if (buf) {
        buf[i] = first_step ? d : c.momentum * buf[i] + keep * d;
        d = c.nesterov == Nesterov::yes ? d + c.momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  });
}

// Per element of group k: p *= decay[k]; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= step_size[k] m / (sqrt(v) / sqrt(1 - b2^t) + eps).
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars) {
  if (skipped(c.skip_if)) return;
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  const uint8_t* grp = group_of.defined() ? group_of.data<uint8_t>() : nullptr;
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  const float* s = scalars.data<float>();
  const float unscale = s[AdamWScalar::grad_unscale];
  const float correction2_sqrt = s[AdamWScalar::correction2_sqrt];
  const float* decay = s + AdamWScalar::decay;
  const float* step_size = s + AdamWScalar::step_size;
  float one_minus_b1 = 1.f - c.beta1, one_minus_b2 = 1.f - c.beta2;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int k = grp ? grp[i] : 0;
      p[i] *= decay[k];
      float gi = g[i] * unscale;
      pm[i] = c.beta1 * pm[i] + one_minus_b1 * gi;
      pv[i] = c.beta2 * pv[i] + one_minus_b2 * gi * gi;
      float denom = std::sqrt(pv[i]) / correction2_sqrt + c.eps;
      p[i] -= step_size[k] * pm[i] / denom;
    }
  });
}

void non_finite_into(Tensor& flag, const Tensor& x) {
  flag.data<float>()[0] = cpu::all_finite(x) ? 0.f : 1.f;
}

}  // namespace kernels::cpu
