// Built by pkg.consumer with `pkg-config --cflags --libs dptrain` alone: a dot product on the
// op set, on a CPU device.
#include <cstdio>

#include "kernels/ops.hpp"

int main() {
  kernels::Tensor a = kernels::Tensor::from_vector({1, 2, 3}, {1, 3});
  kernels::Tensor b = kernels::Tensor::from_vector({4, 5, 6}, {1, 3});
  kernels::Tensor c = kernels::Tensor::empty({1, 1}, kernels::DType::f32, a.device());
  kernels::gemm(c, a, kernels::Transpose::no, b, kernels::Transpose::yes);
  const float got = c.to_host_f32()[0];
  std::printf("dot = %g\n", got);
  return got == 32.f ? 0 : 1;
}
