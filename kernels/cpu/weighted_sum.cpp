// The fused reduction of data parallelism (y = w0 y + sum_k w_k x_k in one pass) and the
// device-side correct count.
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

void weighted_sum(Tensor& y, float y_weight, const std::vector<Tensor>& xs,
                  const std::vector<float>& weights) {
  float* py = y.data<float>();
  const bool wide = xs.empty() || xs[0].dtype() == DType::f32;
  parallel_range(y.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // In source order, one rounding per term: the same sum on every run and thread count.
      float acc = py[i] * y_weight;
      for (size_t k = 0; k < xs.size(); ++k) {
        const float x = wide ? xs[k].data<float>()[i] : bf16_to_f32(xs[k].data<uint16_t>()[i]);
        acc += weights[k] * x;
      }
      py[i] = acc;
    }
  });
}

void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels) {
  out.data<float>()[0] = static_cast<float>(cpu::count_correct(logits, labels));
}

}  // namespace kernels::cpu
