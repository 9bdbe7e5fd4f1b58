// The fused reduction of data parallelism (y = w0 y + sum_k w_k x_k in one pass) and the
// device-side correct count.
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

void weighted_sum(Tensor& y, float y_weight, const std::vector<Tensor>& xs,
                  const std::vector<float>& weights) {
  float* py = y.data<float>();
  const bool wide = xs.empty() || xs[0].dtype() == DType::f32;
  std::vector<const void*> src(xs.size());
  for (size_t k = 0; k < xs.size(); ++k) src[k] = xs[k].raw();
  // A chunk of y stays in cache while every source is added into it, in source order: one
  // rounding per term, the same sum on every run and thread count.
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] *= y_weight;
    for (size_t k = 0; k < src.size(); ++k) {
      const float w = weights[k];
      if (wide) {
        const float* px = static_cast<const float*>(src[k]);
        for (int64_t i = begin; i < end; ++i) py[i] += w * px[i];
      } else {
        const uint16_t* px = static_cast<const uint16_t*>(src[k]);
        for (int64_t i = begin; i < end; ++i) py[i] += w * bf16_to_f32(px[i]);
      }
    }
  });
}

void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels) {
  out.data<float>()[0] = static_cast<float>(cpu::count_correct(logits, labels));
}

}  // namespace kernels::cpu
