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

#include <cstring>

#include "kernels/ops.hpp"
#include "kernels/runtime/error.hpp"

namespace kernels::cpu {

namespace {

constexpr int kLanes = 16;
typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef int VecI __attribute__((vector_size(4 * kLanes)));

#define DP_VEC inline __attribute__((always_inline))

DP_VEC VecF splat(float v) {
  return VecF{} + v;
}

// exp(x) for x in [-80, 0] (x below is taken as -80: exp(-80) ~ 1.8e-35, whose 2^n still has a
// normal exponent; tanh needs no more, being 1 in f32 from |u| = 9 on).
DP_VEC VecF exp_nonpositive(VecF x) {
  x = x < splat(-80.f) ? splat(-80.f) : x;
  // round(x log2 e) by adding and removing 1.5 * 2^23: the float's low bits then hold n.
  const VecF shifter = splat(12582912.f);
  const VecF t = x * splat(1.44269504088896341f) + shifter;
  const VecF n = t - shifter;
  const VecF r = (x - n * splat(0.693145751953125f)) - n * splat(1.42860682030941723e-6f);
  VecF p = splat(1.f / 5040.f);
  p = p * r + splat(1.f / 720.f);
  p = p * r + splat(1.f / 120.f);
  p = p * r + splat(1.f / 24.f);
  p = p * r + splat(1.f / 6.f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  VecI ti, pi;
  std::memcpy(&ti, &t, sizeof ti);
  std::memcpy(&pi, &p, sizeof pi);
  // n sits in t's low mantissa bits (t = 1.5 * 2^23 + n): scale p by 2^n in its exponent.
  const VecI bits = pi + ((ti - 0x4B400000) << 23);
  VecF out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

DP_VEC VecF tanh_vec(VecF u) {
  const VecF a = u < splat(0.f) ? -u : u;
  const VecF e = exp_nonpositive(splat(-2.f) * a);
  VecF big = (splat(1.f) - e) / (splat(1.f) + e);
  big = u < splat(0.f) ? -big : big;
  const VecF u2 = u * u;
  VecF s = splat(62.f / 2835.f);
  s = s * u2 - splat(17.f / 315.f);
  s = s * u2 + splat(2.f / 15.f);
  s = s * u2 - splat(1.f / 3.f);
  const VecF small = u + u * (u2 * s);
  VecF out = a < splat(0.125f) ? small : big;
  return u != u ? u : out;  // NaN stays NaN
}

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

DP_VEC VecF gelu_tanh_vec(VecF x) {
  const VecF t = tanh_vec(splat(kSqrt2OverPi) * (x + splat(kGeluCubic) * x * x * x));
  return splat(0.5f) * x * (splat(1.f) + t);
}

DP_VEC VecF gelu_tanh_grad_vec(VecF x) {
  const VecF t = tanh_vec(splat(kSqrt2OverPi) * (x + splat(kGeluCubic) * x * x * x));
  return splat(0.5f) * (splat(1.f) + t) + splat(0.5f) * x * (splat(1.f) - t * t) *
                                              splat(kSqrt2OverPi) *
                                              (splat(1.f) + splat(3.f * kGeluCubic) * x * x);
}

}  // namespace

// Each function in three builds of the same code: AVX-512, AVX2 with FMA, and the baseline (SSE2),
// the first the CPU runs chosen at the first call (cpu_vector_isa, from cpuid). Chosen by hand,
// not with target_clones: an ifunc resolver runs before the sanitizers' runtimes start, and
// crashes ThreadSanitizer builds at load.
// out[i] = expr(v = in[i]) for n floats: whole vectors, then a zero-padded last one. Written out
// in each build (no lambda between them: a call would cross from one ISA's code to another's).
#define DP_VEC_LOOP(expr)                                                  \
  int64_t i = 0;                                                           \
  for (; i + kLanes <= n; i += kLanes) {                                   \
    VecF v;                                                                \
    std::memcpy(&v, in + i, sizeof v);                                     \
    const VecF r = (expr);                                                 \
    std::memcpy(out + i, &r, sizeof r);                                    \
  }                                                                        \
  if (i < n) {                                                             \
    float buf[kLanes] = {};                                                \
    std::memcpy(buf, in + i, sizeof(float) * static_cast<size_t>(n - i));  \
    VecF v;                                                                \
    std::memcpy(&v, buf, sizeof v);                                        \
    const VecF r = (expr);                                                 \
    std::memcpy(buf, &r, sizeof r);                                        \
    std::memcpy(out + i, buf, sizeof(float) * static_cast<size_t>(n - i)); \
  }

#define DP_VEC_VARIANTS(name, expr)                                                              \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd"))) void name##_avx512(     \
      float* out, const float* in, int64_t n) {                                                  \
    DP_VEC_LOOP(expr)                                                                            \
  }                                                                                              \
  __attribute__((target("avx2,fma"))) void name##_avx2(float* out, const float* in, int64_t n) { \
    DP_VEC_LOOP(expr)                                                                            \
  }                                                                                              \
  void name##_base(float* out, const float* in, int64_t n) {                                     \
    DP_VEC_LOOP(expr)                                                                            \
  }

namespace {
DP_VEC_VARIANTS(tanh_rows, tanh_vec(v))
DP_VEC_VARIANTS(gelu_tanh_rows, gelu_tanh_vec(v))
DP_VEC_VARIANTS(gelu_tanh_grad_rows, gelu_tanh_grad_vec(v))

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

}  // namespace kernels::cpu
