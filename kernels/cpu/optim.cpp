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

namespace {
// copy[begin, end) := p[begin, end) rounded to the copy's 16-bit dtype (store_block: copy()'s
// bits), while the range is in cache; nothing for an undefined copy.
void write_copy(const Tensor& copy, const float* p, int64_t begin, int64_t end) {
  if (!copy.defined()) return;
  if (copy.dtype() == DType::bf16)
    store_block(copy.data<BF16>() + begin, p + begin, end - begin);
  else
    store_block(copy.data<F16>() + begin, p + begin, end - begin);
}

// The loops below take their constants by value and their arrays as __restrict pointers: a
// store through a float pointer may otherwise alias a config's float fields, which then are
// reloaded on every element and keep the loop from vectorising. Branches on constants are taken
// once per range, outside the element loops. (No FMA contraction on the baseline x86-64 ISA:
// the same roundings, per element, as the plain loop.)
struct SgdConstants {
  float lr, unscale, momentum, keep, weight_decay;
  bool first_step, nesterov;
};

template <bool kDecay>
void sgd_range(float* __restrict p, const float* __restrict g, float* __restrict buf, int64_t begin,
               int64_t end, const SgdConstants k) {
  auto direction = [&](int64_t i) {
    const float gi = g[i] * k.unscale;
    return kDecay ? gi + k.weight_decay * p[i] : gi;
  };
  if (!buf) {
    for (int64_t i = begin; i < end; ++i) p[i] -= k.lr * direction(i);
  } else if (k.first_step) {
    for (int64_t i = begin; i < end; ++i) {
      const float d = direction(i);
      buf[i] = d;
      p[i] -= k.lr * (k.nesterov ? d + k.momentum * d : d);
    }
  } else if (k.nesterov) {
    for (int64_t i = begin; i < end; ++i) {
      const float d = direction(i);
      const float b = k.momentum * buf[i] + k.keep * d;
      buf[i] = b;
      p[i] -= k.lr * (d + k.momentum * b);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const float b = k.momentum * buf[i] + k.keep * direction(i);
      buf[i] = b;
      p[i] -= k.lr * b;
    }
  }
}

struct AdamWConstants {
  float unscale, correction2_sqrt, beta1, beta2, one_minus_b1, one_minus_b2, eps;
  float decay[kMaxAdamWGroups], step_size[kMaxAdamWGroups];
};

// Elements [begin, end) of one group j: its decay and step size are constants of the loop.
void adamw_run(float* __restrict p, const float* __restrict g, float* __restrict pm,
               float* __restrict pv, int64_t begin, int64_t end, const AdamWConstants& c, int j) {
  const AdamWConstants k = c;  // a local copy: no store below can change it
  const float decay = k.decay[j], step_size = k.step_size[j];
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i] * k.unscale;
    const float m = k.beta1 * pm[i] + k.one_minus_b1 * gi;
    const float v = k.beta2 * pv[i] + k.one_minus_b2 * gi * gi;
    pm[i] = m;
    pv[i] = v;
    const float denom = std::sqrt(v) / k.correction2_sqrt + k.eps;
    const float decayed = p[i] * decay;
    p[i] = decayed - step_size * m / denom;
  }
}

// The elements of one tensor share a group: [begin, end) is cut into runs of one group each.
void adamw_range(float* p, const float* g, float* pm, float* pv, const uint8_t* grp, int64_t begin,
                 int64_t end, const AdamWConstants& k) {
  if (!grp) return adamw_run(p, g, pm, pv, begin, end, k, 0);
  for (int64_t i = begin; i < end;) {
    const uint8_t j = grp[i];
    int64_t run_end = i + 1;
    while (run_end < end && grp[run_end] == j) ++run_end;
    adamw_run(p, g, pm, pv, i, run_end, k, j);
    i = run_end;
  }
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
  const SgdConstants k{s[SgdScalar::lr],
                       s[SgdScalar::grad_unscale],
                       c.momentum,
                       1.f - c.dampening,
                       c.weight_decay,
                       s[SgdScalar::first_step] != 0.f,
                       c.nesterov == Nesterov::yes};
  const bool decay = c.weight_decay != 0.f;
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    if (decay)
      sgd_range<true>(p, g, buf, begin, end, k);
    else
      sgd_range<false>(p, g, buf, begin, end, k);
    write_copy(c.compute_copy, p, begin, end);
  });
}

// Per element of group k: p *= decay[k]; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= step_size[k] m / (sqrt(v) / sqrt(1 - b2^t) + eps).
void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars) {
  if (skipped(c.skip_if)) return;
  const float* s = scalars.data<float>();
  AdamWConstants k{};
  k.unscale = s[AdamWScalar::grad_unscale];
  k.correction2_sqrt = s[AdamWScalar::correction2_sqrt];
  k.beta1 = c.beta1;
  k.beta2 = c.beta2;
  k.one_minus_b1 = 1.f - c.beta1;
  k.one_minus_b2 = 1.f - c.beta2;
  k.eps = c.eps;
  std::copy_n(s + AdamWScalar::decay, kMaxAdamWGroups, k.decay);
  std::copy_n(s + AdamWScalar::step_size, kMaxAdamWGroups, k.step_size);
  float* p = params.data<float>();
  const float* g = grads.data<float>();
  const uint8_t* grp = group_of.defined() ? group_of.data<uint8_t>() : nullptr;
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  parallel_range(params.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    adamw_range(p, g, pm, pv, grp, begin, end, k);
    write_copy(c.compute_copy, p, begin, end);
  });
}

void non_finite_into(Tensor& flag, const Tensor& x) {
  flag.data<float>()[0] = cpu::all_finite(x) ? 0.f : 1.f;
}

}  // namespace kernels::cpu
