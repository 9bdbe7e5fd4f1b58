// Vectorised f32 math for the CPU's pointwise kernels (vec_math.cpp): each function fills n
// outputs from n inputs, in the CPU's widest vector ISA (AVX-512, AVX2 or SSE, chosen at the
// first call), with the same bits on any of them. Within 3 ulp of libm's (kernels.vec_math).
#pragma once

#include <cstdint>

#include "kernels/ops.hpp"

namespace kernels::cpu {

void tanh_rows(float* y, const float* x, int64_t n);
// GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its derivative.
void gelu_tanh_rows(float* y, const float* x, int64_t n);
void gelu_tanh_grad_rows(float* g, const float* x, int64_t n);

// One of the functions above in the build for `isa` (at most the CPU's: cpu_vector_isa; the
// avx build is the baseline's), for tests that check every build gives the same bits.
enum class VecFunction { tanh, gelu_tanh, gelu_tanh_grad };
void rows_for(VecFunction f, CpuVectorIsa isa, float* out, const float* in, int64_t n);

}  // namespace kernels::cpu
