// Vectorised f32 math for the CPU's pointwise kernels (vec_math.cpp): each function fills n
// outputs from n inputs, in the CPU's widest vector ISA (AVX-512, AVX2 or SSE, chosen at the
// first call), with the same bits on any of them. Within 3 ulp of libm's (kernels.vec_math).
#pragma once

#include <cstdint>

#include "kernels/ops.hpp"

namespace kernels::cpu {

void tanh_rows(float* y, const float* x, int64_t n);
// e^x for x <= 0 (softmax's exp(s - max) and exp(s - lse)): 0 below -80 (e^-80 is 1.8e-35, under
// f32's resolution of a sum that holds a 1), NaN kept; within 3 ulp of libm's expf above. y may
// be x. Not for x > 0.
void exp_nonpositive_rows(float* y, const float* x, int64_t n);
// A softmax row's exponentials: y = exp(x - max x) by exp_nonpositive_rows, the max found left to
// right (std::max, so a NaN after the first value is skipped as in a scalar scan); returns the
// max. y may be x. requires n >= 1.
float exp_minus_max_rows(float* y, const float* x, int64_t n);
// GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its derivative.
void gelu_tanh_rows(float* y, const float* x, int64_t n);
void gelu_tanh_grad_rows(float* g, const float* x, int64_t n);

// bf16 storage in blocks: n values widened to f32 (exact), and n f32 values rounded to the
// nearest even bf16 (NaN quieted), stored as bf16 bits or as f32 (round_to_bf16_rows): the bits of
// f32_to_bf16 and bf16_to_f32 (kernels/runtime/dtype.hpp), in the CPU's widest vector ISA. The
// baseline build's narrowing takes several SSE2 shuffles a vector; AVX-512 has one instruction.
void bf16_to_f32_rows(float* out, const uint16_t* in, int64_t n);
void f32_to_bf16_rows(uint16_t* out, const float* in, int64_t n);
void round_to_bf16_rows(float* out, const float* in, int64_t n);

// One of the functions above in the build for `isa` (at most the CPU's: cpu_vector_isa; the
// avx build is the baseline's), for tests that check every build gives the same bits.
enum class VecFunction { tanh, gelu_tanh, gelu_tanh_grad, exp_nonpositive };
void rows_for(VecFunction f, CpuVectorIsa isa, float* out, const float* in, int64_t n);
// The bf16 conversions above in the build for `isa`, likewise.
void bf16_to_f32_rows_for(CpuVectorIsa isa, float* out, const uint16_t* in, int64_t n);
void f32_to_bf16_rows_for(CpuVectorIsa isa, uint16_t* out, const float* in, int64_t n);

}  // namespace kernels::cpu
