// Helpers shared by the CPU backend's .cpp files: parallel loops over fixed partitions (so that
// every reduction adds in the same order for any thread count: replicas must agree bit for bit)
// and the single-threaded BLAS calls the GEMM-based ops are built from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "kernels/cpu/vec_math.hpp"
#include "kernels/ops.hpp"
#include "kernels/storage_dispatch.hpp"

namespace kernels::cpu {

// Elements per task for cheap elementwise loops.
constexpr int64_t kElementwiseGrain = 1 << 14;

// Runs body(begin, end) over [0, n) in parallel; body must write disjoint outputs only.
template <class Body>
void parallel_range(int64_t n, int64_t grain, Body&& body) {
  if (n <= grain) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

// Sum of partial(begin, end) over the fixed chunks [0, chunk), [chunk, 2 chunk), ... of [0, n),
// computed in parallel and added in chunk order: the same bits for any thread count.
template <class Partial>
double chunked_sum(int64_t n, int64_t chunk, Partial&& partial) {
  if (n <= 0) return 0.0;
  int64_t n_chunks = (n + chunk - 1) / chunk;
  std::vector<double> partials(static_cast<size_t>(n_chunks));
  parallel_range(n_chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      partials[i] = partial(i * chunk, std::min(n, (i + 1) * chunk));
  });
  double total = 0.0;
  for (double p : partials) total += p;
  return total;
}

// The elements of a floating tensor (f32, f16, bf16) as f32: a view of the data when it is f32,
// else `scratch` filled with the exact widened values.
const float* as_f32(const Tensor& t, std::vector<float>& scratch);
// requires t f16 or bf16 with t.numel() values at src. ensures t = src rounded to nearest even.
void store_from_f32(Tensor& t, const float* src);

// v rounded to the nearest (even) value of a floating dtype, as f32 (v itself for f32).
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::f16:
      return f16_to_f32(f32_to_f16(v));
    case DType::bf16:
      return bf16_to_f32(f32_to_bf16(v));
    default:
      return v;
  }
}

// ---- 16-bit storage ------------------------------------------------------------------------
// The ops that take f16/bf16 activations (ops.hpp) have one kernel templated on the storage type
// of each tensor: float, or F16 / BF16 (the bits of a 16-bit value). It reads every element as
// f32 (load_f32), computes exactly as the f32 kernel does, and rounds a result once where it is
// stored (store_rounded; an accumulating output is read, added to in f32 and rounded once): the
// bits of widening each 16-bit input, running the f32 kernel and rounding its output, without
// the casts and the f32 copies. Instantiated with float only, a kernel is the f32 kernel.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};
inline float load_f32(float v) {
  return v;
}
inline float load_f32(F16 v) {
  return f16_to_f32(v.bits);
}
inline float load_f32(BF16 v) {
  return bf16_to_f32(v.bits);
}
inline void store_rounded(float& to, float v) {
  to = v;
}
inline void store_rounded(F16& to, float v) {
  to.bits = f32_to_f16(v);
}
inline void store_rounded(BF16& to, float v) {
  to.bits = f32_to_bf16(v);
}

// Index of the largest of row[0, n), the first one on ties (n >= 1); S: float, F16 or BF16
// (compared as f32, which orders 16-bit values exactly). A NaN is larger than any number, as
// in PyTorch's argmax: the first NaN's index when the row has one. argmax, count_correct and the
// losses' counts.
template <class S>
int32_t row_argmax(const S* row, int64_t n) {
  int64_t best = 0;
  float best_value = load_f32(row[0]);
  if (best_value != best_value) return 0;
  for (int64_t c = 1; c < n; ++c) {
    const float v = load_f32(row[c]);
    if (v != v) return static_cast<int32_t>(c);
    if (v > best_value) {
      best = c;
      best_value = v;
    }
  }
  return static_cast<int32_t>(best);
}

// Blocks of 16-bit storage through f32, for kernels whose element loop would otherwise narrow one
// value at a time (bf16: vec_math.hpp's conversions, at the CPU's vector width). The same bits as
// load_f32 and store_rounded element by element.
constexpr int64_t kConvertBlock = 512;
// Elements [0, m) of p as f32: p itself for f32, else widened into buf (m floats; the kernels'
// buffers hold kConvertBlock).
inline const float* widen_block(const float* p, int64_t, float*) {
  return p;
}
inline const float* widen_block(const BF16* p, int64_t m, float* buf) {
  bf16_to_f32_rows(buf, reinterpret_cast<const uint16_t*>(p), m);
  return buf;
}
inline const float* widen_block(const F16* p, int64_t m, float* buf) {
  for (int64_t j = 0; j < m; ++j) buf[j] = load_f32(p[j]);
  return buf;
}
// to[0, m) := v[0, m) rounded once to to's storage.
inline void store_block(float* to, const float* v, int64_t m) {
  if (to != v) std::copy_n(v, m, to);
}
inline void store_block(BF16* to, const float* v, int64_t m) {
  f32_to_bf16_rows(reinterpret_cast<uint16_t*>(to), v, m);
}
inline void store_block(F16* to, const float* v, int64_t m) {
  for (int64_t j = 0; j < m; ++j) store_rounded(to[j], v[j]);
}
// to[0, m) (+)= term(j), through f32: out (m floats) takes term(j), added to to's widened values
// with acc, and is rounded once into to's storage. An activation's backward over a block.
template <class S, class Term>
void accumulate_block(S* to, int64_t m, Accumulate acc, float* out, Term term) {
  if (acc == Accumulate::yes) {
    const float* prev = widen_block(to, m, out);
    for (int64_t j = 0; j < m; ++j) out[j] = prev[j] + term(j);
  } else {
    for (int64_t j = 0; j < m; ++j) out[j] = term(j);
  }
  store_block(to, out, m);
}

// requires each dtype f32, f16 or bf16, f16 and bf16 not both (ops.cpp checks it).
// ensures f(S...) is called with a value of each dtype's storage type, in order:
//   with_storage([&](auto y_t, auto x_t) { auto* py = y.data<decltype(y_t)>(); ... },
//                y.dtype(), x.dtype());
template <class F, class... D>
void with_storage(F&& f, D... dtypes) {
  with_storage_of<F16, BF16>(f, dtypes...);
}

// y[i] = f(a[i], b[i % inner]) over y's elements, inner = b.numel(): b of y's shape, or
// broadcast over a's leading dims. Each of y, a, b f32, f16 or bf16 (with_storage), read as f32
// and stored rounded once.
template <class F>
void map_binary(Tensor& y, const Tensor& a, const Tensor& b, F f) {
  const int64_t inner = b.numel(), n = y.numel();
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        const auto* pa = a.data<decltype(a_t)>();
        const auto* pb = b.data<decltype(b_t)>();
        auto* py = y.data<decltype(y_t)>();
        using Y = std::remove_pointer_t<decltype(py)>;
        using A = std::remove_cv_t<std::remove_pointer_t<decltype(pa)>>;
        using B = std::remove_cv_t<std::remove_pointer_t<decltype(pb)>>;
        constexpr bool all_f32 =
            std::is_same_v<Y, float> && std::is_same_v<A, float> && std::is_same_v<B, float>;
        parallel_range(n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
          if (inner == n && all_f32) {  // same shapes: no index arithmetic in the loop
            for (int64_t i = begin; i < end; ++i)
              store_rounded(py[i], f(load_f32(pa[i]), load_f32(pb[i])));
          } else if (inner == n) {  // 16-bit storage: through f32 blocks
            float a_buf[kConvertBlock], b_buf[kConvertBlock], out[kConvertBlock];
            for (int64_t i = begin; i < end; i += kConvertBlock) {
              const int64_t m = std::min(kConvertBlock, end - i);
              const float* va = widen_block(pa + i, m, a_buf);
              const float* vb = widen_block(pb + i, m, b_buf);
              for (int64_t j = 0; j < m; ++j) out[j] = f(va[j], vb[j]);
              store_block(py + i, out, m);
            }
          } else
            for (int64_t i = begin; i < end; ++i)
              store_rounded(py[i], f(load_f32(pa[i]), load_f32(pb[i % inner])));
        });
      },
      y.dtype(), a.dtype(), b.dtype());
}

// Makes the process's GEMM kernel choice (kernels::choose_blas_kernels), sets OpenBLAS to one
// thread and ends its idle thread pool, once per process: every CPU device
// parallelises its GEMMs itself inside its own arena, so BLAS threads would oversubscribe the
// cores.
void use_single_threaded_blas();

// Row-major f32 GEMM on one thread: C (m, n) = alpha op(A) op(B) + beta C, with op(A) (m, k)
// and op(B) (k, n); lda/ldb/ldc are the row strides of A, B, C as stored. m, n, k >= 1.
void sgemm_serial(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc);
// The same, with C split into tiles run in parallel (deterministic: each tile is one
// single-threaded sgemm over the whole k, and the tiling depends on the shape only).
void sgemm_parallel(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc);

}  // namespace kernels::cpu
