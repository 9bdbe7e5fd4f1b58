// The cross-entropies' count of right rows (ops.hpp: softmax_cross_entropy and
// token_cross_entropy with `correct`) against count_correct, on any device: logits with ties,
// NaN (first, inside, everywhere), -inf rows and finite rows, f32, bf16 and f16, rows narrower and
// wider than a block's 8-wide reads. The loss and its gradient must keep their bits when the
// count is asked for, and when the gradient is written over the logits. kernels.loss_count (CPU)
// and kernels.cuda.loss_count run them.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "kernels/ops.hpp"
#include "tests/test_util.hpp"

namespace loss_count {

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

// rows x classes logits: small integers (ties everywhere), with row 0's first value NaN, row 1 a
// NaN inside, row 2 all -inf, row 3 -inf but its last value, row 4 all NaN (those rows where the
// row is that wide), the rest as drawn.
inline std::vector<float> logits(int64_t rows, int64_t classes, uint32_t seed) {
  std::vector<float> v =
      dp_test::random_vector(static_cast<size_t>(rows * classes), seed, 0.f, 4.f);
  for (float& x : v) x = static_cast<float>(static_cast<int>(x));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto at = [&](int64_t r, int64_t c) -> float& { return v[static_cast<size_t>(r * classes + c)]; };
  at(0, 0) = nan;
  at(1, classes / 2) = nan;
  for (int64_t c = 0; c < classes; ++c) at(2, c) = -inf;
  for (int64_t c = 0; c + 1 < classes; ++c) at(3, c) = -inf;
  for (int64_t c = 0; c < classes; ++c) at(4, c) = nan;
  return v;
}

// Labels: the row's argmax (by the CPU's rule) for even rows, another class for odd ones, and
// `ignored` in every fifth row when it is not -1.
inline std::vector<int32_t> labels(const Tensor& x_cpu, int32_t ignored) {
  const int64_t rows = x_cpu.dim(0), classes = x_cpu.dim(1);
  Tensor best = Tensor::zeros({rows}, DType::i32, x_cpu.device());
  kernels::argmax(best, x_cpu);
  std::vector<int32_t> out = best.to_host_i32();
  for (int64_t i = 0; i < rows; ++i) {
    if (i % 2 == 1) out[i] = static_cast<int32_t>((out[i] + 1) % classes);
    if (ignored != -1 && i % 5 == 4) out[i] = ignored;
  }
  return out;
}

using dp_test::same_bits;  // same dtype, shape and bytes

// Runs every case on device d: the count each loss gives there against count_correct on the CPU
// (over the kept rows: an ignored row's label is -1 there, which no argmax equals), and the loss
// and gradient with the count against without. Calls check(what, ok) for each verdict.
template <class Check>
void run(Device d, Check&& check) {
  const Device cpu = Device::cpu();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t classes : {int64_t{1}, int64_t{10}, int64_t{77}, int64_t{1000}, int64_t{4104}}) {
      const int64_t rows = 37;
      const std::string at =
          std::string(kernels::dtype_name(t)) + " classes " + std::to_string(classes) + ": ";
      Tensor x_cpu = Tensor::from_vector(logits(rows, classes, 11), {rows, classes}, cpu, t);
      Tensor x = x_cpu.to(d);
      for (float ls : {0.f, 0.1f}) {
        std::vector<int32_t> y = labels(x_cpu, -1);
        Tensor correct = Tensor::zeros({1}, DType::f32, d), loss = correct.clone(),
               plain = correct.clone();
        Tensor dx = Tensor::zeros(x.shape(), t, d), dx_plain = dx.clone();
        Tensor yd = Tensor::from_ints(y, {rows}, d);
        kernels::softmax_cross_entropy(loss, dx, x, yd, Tensor(), ls, correct);
        kernels::softmax_cross_entropy(plain, dx_plain, x, yd, Tensor(), ls);
        const int64_t want = kernels::count_correct(x_cpu, Tensor::from_ints(y, {rows}));
        check(at + "softmax_cross_entropy's count", correct.item() == static_cast<float>(want));
        check(at + "softmax_cross_entropy's loss and gradient keep their bits",
              same_bits(loss, plain) && same_bits(dx, dx_plain));
        // The gradient written over the logits: the same loss, count and gradient bits.
        Tensor over = x.clone(), in_place = correct.clone(), c2 = correct.clone();
        kernels::softmax_cross_entropy(in_place, over, over, yd, Tensor(), ls, c2);
        check(at + "softmax_cross_entropy over its logits gives the same loss, count, gradient",
              same_bits(in_place, loss) && same_bits(c2, correct) && same_bits(over, dx));
      }
      // Token cross-entropy, ignoring a class the logits could pick (0, so ignored rows with
      // argmax 0 would count if the count forgot them), then ignoring -1.
      for (int32_t ignored : {int32_t{0}, int32_t{-1}}) {
        std::vector<int32_t> y = labels(x_cpu, ignored), kept = y;
        for (int32_t& k : kept)
          if (k == ignored) k = -1;
        Tensor correct = Tensor::zeros({1}, DType::f32, d), loss = correct.clone(),
               plain = correct.clone();
        Tensor dx = Tensor::zeros(x.shape(), t, d), dx_plain = dx.clone();
        Tensor yd = Tensor::from_ints(y, {rows}, d);
        kernels::token_cross_entropy(loss, dx, x, yd, ignored, correct);
        kernels::token_cross_entropy(plain, dx_plain, x, yd, ignored);
        const int64_t want = kernels::count_correct(x_cpu, Tensor::from_ints(kept, {rows}));
        check(at + "token_cross_entropy's count, ignoring " + std::to_string(ignored),
              correct.item() == static_cast<float>(want));
        check(at + "token_cross_entropy's loss and gradient keep their bits",
              same_bits(loss, plain) && same_bits(dx, dx_plain));
        Tensor over = x.clone(), in_place = correct.clone(), c2 = correct.clone();
        kernels::token_cross_entropy(in_place, over, over, yd, ignored, c2);
        check(at + "token_cross_entropy over its logits gives the same loss, count, gradient",
              same_bits(in_place, loss) && same_bits(c2, correct) && same_bits(over, dx));
      }
    }
  }
}

}  // namespace loss_count
