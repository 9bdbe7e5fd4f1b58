// GEMM on OpenBLAS: single-threaded sgemm calls over fixed tiles of C, run in parallel in the
// device's arena. f16/bf16 operands are widened to f32 first (accumulation is f32 either way).
#include <cblas.h>

#include <mutex>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels::cpu {

namespace {

// Tiles of C per sgemm call. A tile re-packs (rows + cols) * k values of A and B for its
// rows * cols * k multiply-adds, so tiles start large (kTileRows x kTileCols) and are halved,
// down to kMinTileRows x kMinTileCols and kMinTileMacs of work, until there are kTargetTiles
// of them to spread over the arena. The tiling depends on the shape only, never on the thread
// count, so every element of C is computed the same way on any machine and any arena.
constexpr int64_t kTileRows = 128, kTileCols = 512;
constexpr int64_t kMinTileRows = 64, kMinTileCols = 128;
constexpr int64_t kMinTileMacs = int64_t{1} << 20;
constexpr int64_t kTargetTiles = 16;
// Below this many multiply-adds one call is cheaper than any split.
constexpr int64_t kSerialMacs = int64_t{1} << 21;

struct Tiling {
  int64_t rows, cols;
  int64_t tiles_m, tiles_n;
};

Tiling tiling_for(int64_t m, int64_t n, int64_t k) {
  auto make = [&](int64_t rows, int64_t cols) {
    return Tiling{rows, cols, (m + rows - 1) / rows, (n + cols - 1) / cols};
  };
  Tiling t = make(std::min(m, kTileRows), std::min(n, kTileCols));
  while (t.tiles_m * t.tiles_n < kTargetTiles) {
    Tiling finer = t;
    if (t.cols >= 2 * kMinTileCols && t.cols >= t.rows)
      finer = make(t.rows, t.cols / 2);
    else if (t.rows >= 2 * kMinTileRows)
      finer = make(t.rows / 2, t.cols);
    else
      break;
    if (finer.rows * finer.cols * k < kMinTileMacs) break;
    t = finer;
  }
  return t;
}

CBLAS_TRANSPOSE blas_op(Transpose t) {
  return t == Transpose::yes ? CblasTrans : CblasNoTrans;
}

// c (m, n) = beta c + bias: the product term of a GEMM with k == 0.
void scale_rows(float* c, int64_t m, int64_t n, float beta) {
  parallel_range(m * n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
  });
}

void add_row_bias(float* c, int64_t m, int64_t n, const float* bias) {
  parallel_range(m, std::max<int64_t>(1, kElementwiseGrain / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * n + j] += bias[j];
  });
}

}  // namespace

void use_single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

const float* as_f32(const Tensor& t, std::vector<float>& scratch) {
  if (t.dtype() == DType::f32) return t.data<float>();
  scratch.resize(static_cast<size_t>(t.numel()));
  const uint16_t* src = t.data<uint16_t>();
  bool is_bf16 = t.dtype() == DType::bf16;
  parallel_range(t.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      scratch[i] = is_bf16 ? bf16_to_f32(src[i]) : f16_to_f32(src[i]);
  });
  return scratch.data();
}

void store_from_f32(Tensor& t, const float* src) {
  uint16_t* dst = t.data<uint16_t>();
  bool is_bf16 = t.dtype() == DType::bf16;
  parallel_range(t.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dst[i] = is_bf16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
  });
}

void sgemm_serial(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  use_single_threaded_blas();
  cblas_sgemm(CblasRowMajor, blas_op(ta), blas_op(tb), static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void sgemm_parallel(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  if (m * n * k <= kSerialMacs)
    return sgemm_serial(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  Tiling tiling = tiling_for(m, n, k);
  parallel_range(tiling.tiles_m * tiling.tiles_n, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      int64_t i0 = (t / tiling.tiles_n) * tiling.rows, j0 = (t % tiling.tiles_n) * tiling.cols;
      int64_t rows = std::min(tiling.rows, m - i0), cols = std::min(tiling.cols, n - j0);
      // Rows i0.. of op(A) and columns j0.. of op(B), wherever they sit in storage.
      const float* a_tile = ta == Transpose::no ? a + i0 * lda : a + i0;
      const float* b_tile = tb == Transpose::no ? b + j0 : b + j0 * ldb;
      sgemm_serial(ta, tb, rows, cols, k, alpha, a_tile, lda, b_tile, ldb, beta, c + i0 * ldc + j0,
                   ldc);
    }
  });
}

// (m, k) x (k, n) -> (m, n), with op(a) and op(b) read through the transpose flags.
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias) {
  int64_t m = c.dim(0), n = c.dim(1);
  int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  std::vector<float> a_f32, b_f32, c_f32;
  float* c_data = c.data<float>();
  if (c.dtype() != DType::f32) {
    c_f32.assign(static_cast<size_t>(c.numel()), 0.f);
    if (beta != 0.f) as_f32(c, c_f32);
    c_data = c_f32.data();
  }
  if (k == 0) {
    scale_rows(c_data, m, n, beta);
  } else {
    const float* a_data = as_f32(a, a_f32);
    const float* b_data = as_f32(b, b_f32);
    sgemm_parallel(ta, tb, m, n, k, alpha, a_data, a.dim(1), b_data, b.dim(1), beta, c_data, n);
  }
  if (bias.defined()) add_row_bias(c_data, m, n, bias.data<float>());
  if (c.dtype() != DType::f32) store_from_f32(c, c_data);
}

}  // namespace kernels::cpu
