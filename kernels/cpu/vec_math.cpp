// Vectorised f32 math for the pointwise kernels (vec_math.hpp): tanh through exp, in GCC vector
// extensions, built for AVX-512, AVX2 with FMA and the baseline, chosen at the first call (one
// binary for any x86-64). The file builds with -ffp-contract=off, so every build does the same
// IEEE operations in the same order: the same bits on any CPU.
//
// exp(x), x <= 0: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, r in [-ln2/2, ln2/2]),
// exp(r) by its Taylor series to r^7 (the first omitted term, r^8 / 8!, is below 5e-9 of it),
// times 2^n put into the exponent bits. tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|),
// for |u| >= 1/8; below, the odd series u - u^3/3 + 2 u^5/15 - 17 u^7/315 + 62 u^9/2835 (whose
// first omitted term is below 3e-10 of u there), which keeps the relative error of small
// values. Both within 3 ulp of tanh over the floats (kernels.vec_math checks it against libm).
#include "kernels/cpu/vec_math.hpp"

#include <algorithm>
#include <cstring>

#include "kernels/ops.hpp"
#include "kernels/runtime/error.hpp"

namespace kernels::cpu {

namespace {

// N lanes of f32 (and of i32 for the exponent bits): each build uses its ISA's register width
// (16 for AVX-512, 8 for AVX2, 4 for SSE2). Wider than the registers, GCC lowers the vector
// selects (a < b ? c : d) lane by lane with branches: the AVX2 and SSE2 builds of 16-lane code
// ran GELU 10x slower than their own width does.
template <int N>
struct Vec {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int I __attribute__((vector_size(4 * N)));
};

#define DP_VEC inline __attribute__((always_inline))

template <int N>
DP_VEC typename Vec<N>::F splat(float v) {
  return typename Vec<N>::F{} + v;
}

// exp(x) for x in [-80, 0] (x below is taken as -80: exp(-80) ~ 1.8e-35, whose 2^n still has a
// normal exponent; tanh needs no more, being 1 in f32 from |u| = 9 on).
template <int N>
DP_VEC typename Vec<N>::F exp_nonpositive(typename Vec<N>::F x) {
  using F = typename Vec<N>::F;
  using I = typename Vec<N>::I;
  x = x < splat<N>(-80.f) ? splat<N>(-80.f) : x;
  // round(x log2 e) by adding and removing 1.5 * 2^23: the float's low bits then hold n.
  const F shifter = splat<N>(12582912.f);
  const F t = x * splat<N>(1.44269504088896341f) + shifter;
  const F n = t - shifter;
  const F r = (x - n * splat<N>(0.693145751953125f)) - n * splat<N>(1.42860682030941723e-6f);
  F p = splat<N>(1.f / 5040.f);
  p = p * r + splat<N>(1.f / 720.f);
  p = p * r + splat<N>(1.f / 120.f);
  p = p * r + splat<N>(1.f / 24.f);
  p = p * r + splat<N>(1.f / 6.f);
  p = p * r + splat<N>(0.5f);
  p = p * r + splat<N>(1.f);
  p = p * r + splat<N>(1.f);
  I ti, pi;
  std::memcpy(&ti, &t, sizeof ti);
  std::memcpy(&pi, &p, sizeof pi);
  // n sits in t's low mantissa bits (t = 1.5 * 2^23 + n): scale p by 2^n in its exponent.
  const I bits = pi + ((ti - 0x4B400000) << 23);
  F out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <int N>
DP_VEC typename Vec<N>::F tanh_vec(typename Vec<N>::F u) {
  using F = typename Vec<N>::F;
  const F a = u < splat<N>(0.f) ? -u : u;
  const F e = exp_nonpositive<N>(splat<N>(-2.f) * a);
  F big = (splat<N>(1.f) - e) / (splat<N>(1.f) + e);
  big = u < splat<N>(0.f) ? -big : big;
  const F u2 = u * u;
  F s = splat<N>(62.f / 2835.f);
  s = s * u2 - splat<N>(17.f / 315.f);
  s = s * u2 + splat<N>(2.f / 15.f);
  s = s * u2 - splat<N>(1.f / 3.f);
  const F small = u + u * (u2 * s);
  F out = a < splat<N>(0.125f) ? small : big;
  // NaN stays NaN, and -0 stays -0 (u + u u^2 s gave +0 for it).
  return u != u || u == splat<N>(0.f) ? u : out;
}

// exp_nonpositive with 0 below -80 and NaN kept (exp_nonpositive_rows).
template <int N>
DP_VEC typename Vec<N>::F exp_flushed_vec(typename Vec<N>::F x) {
  const typename Vec<N>::F e = exp_nonpositive<N>(x);
  return x != x ? x : x < splat<N>(-80.f) ? splat<N>(0.f) : e;
}

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

template <int N>
DP_VEC typename Vec<N>::F gelu_tanh_vec(typename Vec<N>::F x) {
  const auto t = tanh_vec<N>(splat<N>(kSqrt2OverPi) * (x + splat<N>(kGeluCubic) * x * x * x));
  return splat<N>(0.5f) * x * (splat<N>(1.f) + t);
}

template <int N>
DP_VEC typename Vec<N>::F gelu_tanh_grad_vec(typename Vec<N>::F x) {
  const auto t = tanh_vec<N>(splat<N>(kSqrt2OverPi) * (x + splat<N>(kGeluCubic) * x * x * x));
  const auto flat = splat<N>(1.f) - t * t;
  const auto slope = splat<N>(0.5f) * x * flat * splat<N>(kSqrt2OverPi) *
                     (splat<N>(1.f) + splat<N>(3.f * kGeluCubic) * x * x);
  // Where tanh is +-1 in f32 (|x| > 5 or so) the second term is 0, not 0 * inf (NaN) once x^2
  // overflows (|x| >= 1.8e19): the derivative's limits 1 and 0.
  return splat<N>(0.5f) * (splat<N>(1.f) + t) + (flat == splat<N>(0.f) ? splat<N>(0.f) : slope);
}

}  // namespace

// Each function in three builds of the same code: AVX-512, AVX2 with FMA, and the baseline (SSE2),
// the first the CPU runs chosen at the first call (cpu_vector_isa, from cpuid). Chosen by hand,
// not with target_clones: an ifunc resolver runs before the sanitizers' runtimes start, and
// crashes ThreadSanitizer builds at load.
// out[i] = expr(v = in[i]) for n floats: whole vectors, then a zero-padded last one. Written out
// in each build (no lambda between them: a call would cross from one ISA's code to another's).
#define DP_VEC_LOOP(N, expr)                                               \
  using F = typename Vec<N>::F;                                            \
  int64_t i = 0;                                                           \
  for (; i + (N) <= n; i += (N)) {                                         \
    F v;                                                                   \
    std::memcpy(&v, in + i, sizeof v);                                     \
    const F r = (expr);                                                    \
    std::memcpy(out + i, &r, sizeof r);                                    \
  }                                                                        \
  if (i < n) {                                                             \
    float buf[N] = {};                                                     \
    std::memcpy(buf, in + i, sizeof(float) * static_cast<size_t>(n - i));  \
    F v;                                                                   \
    std::memcpy(&v, buf, sizeof v);                                        \
    const F r = (expr);                                                    \
    std::memcpy(buf, &r, sizeof r);                                        \
    std::memcpy(out + i, buf, sizeof(float) * static_cast<size_t>(n - i)); \
  }

// fn: a template over the lane count, instantiated at the build's width.
#define DP_VEC_VARIANTS(name, fn)                                                                \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd"))) void name##_avx512(     \
      float* out, const float* in, int64_t n) {                                                  \
    DP_VEC_LOOP(16, fn<16>(v))                                                                   \
  }                                                                                              \
  __attribute__((target("avx2,fma"))) void name##_avx2(float* out, const float* in, int64_t n) { \
    DP_VEC_LOOP(8, fn<8>(v))                                                                     \
  }                                                                                              \
  void name##_base(float* out, const float* in, int64_t n) {                                     \
    DP_VEC_LOOP(4, fn<4>(v))                                                                     \
  }

namespace {
DP_VEC_VARIANTS(tanh_rows, tanh_vec)
DP_VEC_VARIANTS(gelu_tanh_rows, gelu_tanh_vec)
DP_VEC_VARIANTS(gelu_tanh_grad_rows, gelu_tanh_grad_vec)
DP_VEC_VARIANTS(exp_nonpositive_rows, exp_flushed_vec)

// The bf16 conversions: plain loops of dtype.hpp's select-form conversions, which each build
// vectorises at its own width (AVX-512 narrows 16 lanes with one vpmovdw).
#define DP_BF16_CONVERSIONS(suffix, attributes)                                     \
  attributes void bf16_to_f32_##suffix(float* out, const uint16_t* in, int64_t n) { \
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);                    \
  }                                                                                 \
  attributes void f32_to_bf16_##suffix(uint16_t* out, const float* in, int64_t n) { \
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);                    \
  }                                                                                 \
  attributes void round_to_bf16_##suffix(float* out, const float* in, int64_t n) {  \
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(f32_to_bf16(in[i]));       \
  }
DP_BF16_CONVERSIONS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd"))))
DP_BF16_CONVERSIONS(avx2, __attribute__((target("avx2,fma"))))
DP_BF16_CONVERSIONS(base, )

using Rows = void (*)(float*, const float*, int64_t);
Rows pick(Rows avx512, Rows avx2, Rows base) {
  const CpuVectorIsa isa = cpu_vector_isa();
  return isa == CpuVectorIsa::avx512 ? avx512 : isa == CpuVectorIsa::avx2 ? avx2 : base;
}
}  // namespace

Rows for_isa(CpuVectorIsa isa, Rows avx512, Rows avx2, Rows base) {
  DP_CHECK(isa <= cpu_vector_isa(), "vec_math: this CPU cannot run the build asked for");
  return isa == CpuVectorIsa::avx512 ? avx512 : isa >= CpuVectorIsa::avx2 ? avx2 : base;
}

void rows_for(VecFunction f, CpuVectorIsa isa, float* out, const float* in, int64_t n) {
  switch (f) {
    case VecFunction::tanh:
      return for_isa(isa, tanh_rows_avx512, tanh_rows_avx2, tanh_rows_base)(out, in, n);
    case VecFunction::gelu_tanh:
      return for_isa(isa, gelu_tanh_rows_avx512, gelu_tanh_rows_avx2, gelu_tanh_rows_base)(out, in,
                                                                                           n);
    case VecFunction::gelu_tanh_grad:
      return for_isa(isa, gelu_tanh_grad_rows_avx512, gelu_tanh_grad_rows_avx2,
                     gelu_tanh_grad_rows_base)(out, in, n);
    case VecFunction::exp_nonpositive:
      return for_isa(isa, exp_nonpositive_rows_avx512, exp_nonpositive_rows_avx2,
                     exp_nonpositive_rows_base)(out, in, n);
  }
}

void tanh_rows(float* y, const float* x, int64_t n) {
  static const Rows impl = pick(tanh_rows_avx512, tanh_rows_avx2, tanh_rows_base);
  impl(y, x, n);
}

void gelu_tanh_rows(float* y, const float* x, int64_t n) {
  static const Rows impl = pick(gelu_tanh_rows_avx512, gelu_tanh_rows_avx2, gelu_tanh_rows_base);
  impl(y, x, n);
}

void gelu_tanh_grad_rows(float* g, const float* x, int64_t n) {
  static const Rows impl =
      pick(gelu_tanh_grad_rows_avx512, gelu_tanh_grad_rows_avx2, gelu_tanh_grad_rows_base);
  impl(g, x, n);
}

void exp_nonpositive_rows(float* y, const float* x, int64_t n) {
  static const Rows impl =
      pick(exp_nonpositive_rows_avx512, exp_nonpositive_rows_avx2, exp_nonpositive_rows_base);
  impl(y, x, n);
}

float exp_minus_max_rows(float* y, const float* x, int64_t n) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] - m;
  exp_nonpositive_rows(y, y, n);
  return m;
}

namespace {
template <class Fn>
Fn pick_build(CpuVectorIsa isa, Fn avx512, Fn avx2, Fn base) {
  return isa == CpuVectorIsa::avx512 ? avx512 : isa >= CpuVectorIsa::avx2 ? avx2 : base;
}
}  // namespace

void bf16_to_f32_rows_for(CpuVectorIsa isa, float* out, const uint16_t* in, int64_t n) {
  DP_CHECK(isa <= cpu_vector_isa(), "vec_math: this CPU cannot run the build asked for");
  pick_build(isa, bf16_to_f32_avx512, bf16_to_f32_avx2, bf16_to_f32_base)(out, in, n);
}

void f32_to_bf16_rows_for(CpuVectorIsa isa, uint16_t* out, const float* in, int64_t n) {
  DP_CHECK(isa <= cpu_vector_isa(), "vec_math: this CPU cannot run the build asked for");
  pick_build(isa, f32_to_bf16_avx512, f32_to_bf16_avx2, f32_to_bf16_base)(out, in, n);
}

void bf16_to_f32_rows(float* out, const uint16_t* in, int64_t n) {
  static const auto impl =
      pick_build(cpu_vector_isa(), bf16_to_f32_avx512, bf16_to_f32_avx2, bf16_to_f32_base);
  impl(out, in, n);
}

void f32_to_bf16_rows(uint16_t* out, const float* in, int64_t n) {
  static const auto impl =
      pick_build(cpu_vector_isa(), f32_to_bf16_avx512, f32_to_bf16_avx2, f32_to_bf16_base);
  impl(out, in, n);
}

void round_to_bf16_rows(float* out, const float* in, int64_t n) {
  static const auto impl =
      pick_build(cpu_vector_isa(), round_to_bf16_avx512, round_to_bf16_avx2, round_to_bf16_base);
  impl(out, in, n);
}

}  // namespace kernels::cpu
