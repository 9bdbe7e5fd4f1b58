// The cross-entropies' grad_scale (ops.hpp: softmax_cross_entropy and token_cross_entropy), on
// any device: the factor the engines hand the loss (fp16's loss scale, a micro-batch's weight),
// fixed or read on the device. A power of two gives the bits of the old two passes (the loss,
// then scale()), a 16-bit gradient the bits of the f32 one rounded once, and the loss keeps its
// bits. kernels.loss_scale (CPU) and kernels.cuda.loss_scale run them.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kernels/ops.hpp"
#include "tests/test_util.hpp"

namespace loss_scale {

using kernels::Device;
using kernels::DType;
using kernels::Scalar;
using kernels::Tensor;

using dp_test::same_bits;  // same dtype, shape and bytes

// One of the two losses over x and y: token (rows labelled `ignored` get no loss) or softmax
// (label smoothing 0.1), its gradient, in dx's dtype, times g.
struct Run {
  bool token;
  Tensor x, y;
  int32_t ignored;
  void operator()(Tensor& loss, Tensor& dx, const Scalar& g) const {
    if (token)
      kernels::token_cross_entropy(loss, dx, x, y, ignored, Tensor(), g);
    else
      kernels::softmax_cross_entropy(loss, dx, x, y, Tensor(), 0.1f, Tensor(), g);
  }
};

// Runs every case on device d; calls check(what, ok) for each verdict.
template <class Check>
void run(Device d, Check&& check) {
  const Device cpu = Device::cpu();
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (int64_t classes : {int64_t{10}, int64_t{1000}, int64_t{4104}})
      for (bool token : {false, true}) {
        const int64_t rows = 37;
        const std::string at = std::string(kernels::dtype_name(t)) + " classes " +
                               std::to_string(classes) + (token ? " token: " : " softmax: ");
        std::vector<float> xv =
            dp_test::random_vector(static_cast<size_t>(rows * classes), 21, -4.f, 4.f);
        std::vector<int32_t> yv(static_cast<size_t>(rows));
        for (int64_t i = 0; i < rows; ++i)
          yv[i] = token && i % 5 == 4 ? -1 : static_cast<int32_t>((i * 7) % classes);
        const Run loss_of{token, Tensor::from_vector(xv, {rows, classes}, cpu, t).to(d),
                          Tensor::from_ints(yv, {rows}, d), -1};
        Tensor loss1 = Tensor::zeros({1}, DType::f32, d), loss_g = loss1.clone();
        // f32 gradients: a power of two, fixed (fp16's 2^16) or on the device (2^-3), gives the
        // bits of the loss at 1 and a scale() pass after it; the loss is not scaled.
        Tensor plain = Tensor::zeros(loss_of.x.shape(), DType::f32, d);
        loss_of(loss1, plain, Scalar());
        Tensor on_device = Tensor::from_vector(std::vector<float>{0.125f}, {1}, d);
        const std::pair<Scalar, const char*> factors[] = {{Scalar(65536.f), "2^16"},
                                                          {Scalar(on_device), "2^-3 on device"}};
        for (const auto& [g, name] : factors) {
          Tensor folded = Tensor::zeros(plain.shape(), DType::f32, d), two_pass = plain.clone();
          loss_of(loss_g, folded, g);
          kernels::scale(two_pass, two_pass, g);
          check(at + "f32 gradient times " + name + " = the two passes' bits",
                same_bits(folded, two_pass) && same_bits(loss_g, loss1));
        }
        if (t == DType::f32) continue;
        // 16-bit gradients: each value the f32 one (times g) rounded once, written over the
        // logits too; a weight that is not a power of two (a micro-batch's 3/7) included.
        for (const Scalar& g : {Scalar(65536.f), Scalar(3.f / 7.f)}) {
          Tensor wide = Tensor::zeros(plain.shape(), DType::f32, d);
          Tensor narrow = Tensor::zeros(plain.shape(), t, d), over = loss_of.x.clone();
          loss_of(loss_g, wide, g);
          loss_of(loss1, narrow, g);
          Run in_place = loss_of;
          in_place.x = over;
          in_place(loss1, over, g);
          check(at + "16-bit gradient times " + std::to_string(g.value) +
                    " = the f32 one rounded once, over the logits too",
                same_bits(narrow, kernels::cast(wide, t)) && same_bits(over, narrow));
        }
        if (t != DType::f16 || classes < 1000) continue;
        // What the factor inside the pass is for: fp16's smallest step is 2^-24 (6e-8), and the
        // smallest of these gradient values (softmax / about 35 rows, over 1000 or 4104 classes
        // of logits in [-4, 4]) are near it or below half of it. Rounded first and scaled
        // after, they keep a bit or two or are lost; scaled first (by 2^16), each value the
        // scale lifts into fp16's normal range (2^-14 and up) is kept within fp16's rounding
        // (2^-11) and f32's before it.
        Tensor kept = Tensor::zeros(plain.shape(), t, d), lost = kept.clone();
        loss_of(loss_g, kept, Scalar(65536.f));
        loss_of(loss1, lost, Scalar());
        kernels::scale(lost, lost, Scalar(65536.f));
        const std::vector<float> k = kept.to_host_f32(), l = lost.to_host_f32();
        const std::vector<float> ref = plain.to_host_f32();  // f32, at 1
        size_t lifted = 0, zeros_kept = 0, zeros_lost = 0;
        double worst = 0.0;
        for (size_t i = 0; i < ref.size(); ++i) {
          if (std::fabs(ref[i]) * 65536.0 < std::ldexp(1.0, -14)) continue;  // 0 or still small
          ++lifted;
          zeros_kept += k[i] == 0.f;
          zeros_lost += l[i] == 0.f;
          worst = std::max(worst, std::fabs(k[i] / 65536.0 - ref[i]) / std::fabs(ref[i]));
        }
        check(at + "fp16: scaled before its rounding, no value is lost and each is within 2^-11",
              lifted > ref.size() / 2 && zeros_kept == 0 &&
                  worst <= std::ldexp(1.0, -11) + std::ldexp(1.0, -22));
        if (classes == 4104)
          check(at + "fp16: rounded before the scale, values are lost", zeros_lost > 0);
      }
}

}  // namespace loss_scale
