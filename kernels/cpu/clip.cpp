// Gradient clipping by global norm from a sum of squares already computed (kernels/clip_norm.hpp
// holds the arithmetic, the same as the CUDA kernels').
#include "kernels/clip_norm.hpp"
#include "kernels/cpu/cpu_ops.hpp"

namespace kernels::cpu {

void clip_by_norm(Tensor& grads, Tensor& norm_out, const Tensor& sum_squares, float max_norm,
                  Scalar unscale) {
  // Read the sum before writing the norm: norm_out may alias sum_squares.
  const double norm = clip::norm_from_sum_squares(sum_squares.data<float>()[0], unscale.read());
  const float factor = clip::factor(norm, max_norm);
  norm_out.data<float>()[0] = static_cast<float>(norm);
  if (factor != 1.f && grads.numel() > 0) cpu::scale(grads, grads, factor);
}

}  // namespace kernels::cpu
