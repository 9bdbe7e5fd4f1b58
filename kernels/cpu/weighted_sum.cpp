// The fused reduction of data parallelism (y = w0 y + sum_k w_k x_k in one pass) and the
// device-side correct count.
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

void weighted_sum(Tensor& y, Scalar y_scalar, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights) {
  float* py = y.data<float>();
  const float y_weight = y_scalar.read();
  const bool wide = xs.empty() || xs[0].dtype() == DType::f32;
  // A chunk of y stays in cache while every source is added into it, in source order: one
  // rounding per term, the same sum on every run and thread count. (Pointers are taken per
  // chunk and source, outside the element loops, which then vectorise.)
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] *= y_weight;
    for (size_t k = 0; k < xs.size(); ++k) {
      const float w = weights[k].read();
      if (wide) {
        const float* px = xs[k].data<float>();
        for (int64_t i = begin; i < end; ++i) py[i] += w * px[i];
      } else {
        const uint16_t* px = xs[k].data<uint16_t>();
        for (int64_t i = begin; i < end; ++i) py[i] += w * bf16_to_f32(px[i]);
      }
    }
  });
}

void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels) {
  out.data<float>()[0] = static_cast<float>(cpu::count_correct(logits, labels));
}

}  // namespace kernels::cpu
