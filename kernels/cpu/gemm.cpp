// GEMM on OpenBLAS: single-threaded sgemm calls over fixed tiles of C, run in parallel in the
// device's arena. bf16 x bf16 products run on the CPU's bf16 instructions where it has them
// (gemm_bf16.cpp, oneDNN); other f16/bf16 operands are widened to f32 first (accumulation is f32
// either way).
#include <cblas.h>
#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"

namespace kernels {

namespace {

// The OpenBLAS cores (openblas_get_corename, lower case) by the widest vector ISA their kernels
// use; a core not listed (pre-AVX ones such as Prescott, Nehalem, Atom) counts as SSE.
CpuVectorIsa isa_of_core(std::string core) {
  for (char& c : core) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* k : {"skylakex", "cooperlake", "sapphirerapids"})
    if (core == k) return CpuVectorIsa::avx512;
  for (const char* k : {"haswell", "zen", "excavator"})
    if (core == k) return CpuVectorIsa::avx2;
  for (const char* k : {"sandybridge", "bulldozer", "piledriver", "steamroller"})
    if (core == k) return CpuVectorIsa::avx;
  return CpuVectorIsa::sse;
}

const char* isa_text(CpuVectorIsa isa) {
  switch (isa) {
    case CpuVectorIsa::avx512:
      return "AVX-512";
    case CpuVectorIsa::avx2:
      return "AVX2";
    case CpuVectorIsa::avx:
      return "AVX";
    default:
      return "SSE";
  }
}

// The OpenBLAS switches, looked up: builds without DYNAMIC_ARCH have neither.
using DynamicInit = void (*)();
DynamicInit dynamic_symbol(const char* name) {
  return reinterpret_cast<DynamicInit>(dlsym(RTLD_DEFAULT, name));
}

BlasKernels& blas_state() {
  static BlasKernels state;
  return state;
}

// OpenBLAS's thread pool, ended (see cpu::use_single_threaded_blas).
void end_blas_pool() {
  using Shutdown = int (*)();
  if (auto shutdown = reinterpret_cast<Shutdown>(dlsym(RTLD_DEFAULT, "blas_thread_shutdown_")))
    shutdown();
}

}  // namespace

CpuVectorIsa cpu_vector_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return CpuVectorIsa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuVectorIsa::avx2;
  if (__builtin_cpu_supports("avx")) return CpuVectorIsa::avx;
  return CpuVectorIsa::sse;
}

std::string better_blas_core(const std::string& core, CpuVectorIsa cpu, bool has_avx512_bf16) {
  if (isa_of_core(core) >= cpu) return "";
  switch (cpu) {
    case CpuVectorIsa::avx512:
      return has_avx512_bf16 ? "Cooperlake" : "SkylakeX";
    case CpuVectorIsa::avx2:
      return "Haswell";
    case CpuVectorIsa::avx:
      return "Sandybridge";
    default:
      return "";
  }
}

void choose_blas_kernels() {
  BlasKernels& k = blas_state();
  k.cpu = cpu_vector_isa();
  const bool bf16 = k.cpu == CpuVectorIsa::avx512 && __builtin_cpu_supports("avx512bf16");
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const std::string core = openblas_get_corename();
  const std::string better = better_blas_core(core, k.cpu, bf16);
  auto quit = dynamic_symbol("gotoblas_dynamic_quit");
  auto init = dynamic_symbol("gotoblas_dynamic_init");
  k.switched_from.clear();
  if (!better.empty() && (forced == nullptr || *forced == '\0') && quit && init) {
    // OpenBLAS did not know this CPU (a release older than the CPU falls back to its Prescott
    // kernels): choose again, by the CPU's instruction sets, through OpenBLAS's own
    // OPENBLAS_CORETYPE path, before any BLAS work of this process. The variable is set for the
    // choice only; child processes make their own.
    end_blas_pool();
    setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
    quit();
    init();
    unsetenv("OPENBLAS_CORETYPE");
    k.switched_from = core;
  }
  std::string config = openblas_get_config();  // names the core in use
  while (!config.empty() && config.back() == ' ') config.pop_back();
  k.library = config;
  k.core = openblas_get_corename();
  k.generic = isa_of_core(k.core) < k.cpu;
  k.warning.clear();
  if (k.generic)
    k.warning =
        "OpenBLAS runs its " + k.core + " kernels (" + isa_text(isa_of_core(k.core)) +
        ") on a CPU with " + isa_text(k.cpu) + ": its GEMMs run at a fraction of the CPU's speed" +
        (forced && *forced
             ? std::string("; OPENBLAS_CORETYPE=") + forced +
                   " chose them: unset it, or set it to " + better_blas_core("", k.cpu, bf16)
             : std::string("; install an OpenBLAS that knows this CPU, or "
                           "set OPENBLAS_CORETYPE=") +
                   better_blas_core("", k.cpu, bf16));
}

BlasKernels cpu_blas_kernels() {
  cpu::use_single_threaded_blas();
  BlasKernels k = blas_state();
  k.bf16 = cpu::bf16_gemm_enabled() ? cpu::bf16_gemm_version() : "";
  return k;
}

void set_cpu_bf16_gemm(bool enabled) {
  cpu::set_bf16_gemm_enabled(enabled);
}

}  // namespace kernels

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

// Skinny products: op(A) has at most kSkinnyRows rows and B is read as stored (a replica's few
// rows of a small batch through a weight matrix: forward x W^T and backward dy W). OpenBLAS packs
// all of B on every call, which for 2 rows costs three times the product itself (bench_kernels'
// skinny section); its sgemv, a row at a time, reads B once per row: as fast at 2 rows, half as
// fast at 8. These loops read B in place, once per 4 rows (A B^T) or 2 (A B). Every element of
// C is one sum over k in a fixed order, whatever m, the columns a call covers or the thread
// count, so the tiling below never changes a bit. The file builds with -ffp-contract=off and
// the avx2 clone enables no FMA: both clones round alike.
constexpr int64_t kSkinnyRows = 8;

typedef float Lanes __attribute__((vector_size(32)));  // 8 floats: one AVX or two SSE registers

// Everything the clones call is inlined into them, so that it is compiled for the clone's ISA.
#define DP_SKINNY inline __attribute__((always_inline))

DP_SKINNY void load_lanes(Lanes& v, const float* p) {
  __builtin_memcpy(&v, p, sizeof v);
}

DP_SKINNY void store_lanes(float* p, const Lanes& v) {
  __builtin_memcpy(p, &v, sizeof v);
}

DP_SKINNY float scaled(float sum, float alpha, float beta, float c) {
  return beta == 0.f ? alpha * sum : alpha * sum + beta * c;
}

// C[i, j] for rows i < R and columns j in [j0, j1), with A and B both k-contiguous (A B^T):
// 16 partial sums per element over k (two lane vectors), added in a fixed tree, then the tail.
template <int R>
DP_SKINNY void skinny_nt_rows(int64_t j0, int64_t j1, int64_t k, float alpha, const float* a,
                              int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                              int64_t ldc) {
  for (int64_t j = j0; j < j1; ++j) {
    const float* bj = b + j * ldb;
    Lanes lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = Lanes{};
    int64_t q = 0;
    for (; q + 16 <= k; q += 16) {
      Lanes b0, b1, a0, a1;
      load_lanes(b0, bj + q);
      load_lanes(b1, bj + q + 8);
      for (int r = 0; r < R; ++r) {
        load_lanes(a0, a + r * lda + q);
        load_lanes(a1, a + r * lda + q + 8);
        lo[r] += a0 * b0;
        hi[r] += a1 * b1;
      }
    }
    for (int r = 0; r < R; ++r) {
      const Lanes s = lo[r] + hi[r];
      float sum = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
      for (int64_t p = q; p < k; ++p) sum += a[r * lda + p] * bj[p];
      c[r * ldc + j] = scaled(sum, alpha, beta, c[r * ldc + j]);
    }
  }
}

// C[i, j] for rows i < R and the W * 8 columns from j, with B n-contiguous (A B): each element
// is summed over q in order, in its own lane.
template <int R, int W>
DP_SKINNY void skinny_nn_tile(int64_t j, int64_t k, float alpha, const float* a, int64_t lda,
                              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  Lanes acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = Lanes{};
  for (int64_t q = 0; q < k; ++q) {
    Lanes bq[W];
    for (int w = 0; w < W; ++w) load_lanes(bq[w], b + q * ldb + j + 8 * w);
    for (int r = 0; r < R; ++r) {
      const Lanes x = Lanes{} + a[r * lda + q];
      for (int w = 0; w < W; ++w) acc[r][w] += x * bq[w];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) {
      float* out = c + r * ldc + j + 8 * w;
      Lanes v = acc[r][w] * alpha;
      if (beta != 0.f) {
        Lanes old;
        load_lanes(old, out);
        v += old * beta;
      }
      store_lanes(out, v);
    }
}

template <int R>
DP_SKINNY void skinny_nn_rows(int64_t j0, int64_t j1, int64_t k, float alpha, const float* a,
                              int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                              int64_t ldc) {
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) skinny_nn_tile<R, 2>(j, k, alpha, a, lda, b, ldb, beta, c, ldc);
  for (; j + 8 <= j1; j += 8) skinny_nn_tile<R, 1>(j, k, alpha, a, lda, b, ldb, beta, c, ldc);
  for (; j < j1; ++j)
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t q = 0; q < k; ++q) sum += a[r * lda + q] * b[q * ldb + j];
      c[r * ldc + j] = scaled(sum, alpha, beta, c[r * ldc + j]);
    }
}

bool is_skinny(Transpose ta, int64_t m) {
  return ta == Transpose::no && m <= kSkinnyRows;
}

// Columns [j0, j1) of a skinny product: rows four at a time (A B^T) or two (A B), so that one
// pass over B serves several rows.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void skinny_columns(Transpose tb, int64_t m, int64_t j0, int64_t j1, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  int64_t i = 0;
  if (tb == Transpose::yes) {
    for (; i + 4 <= m; i += 4)
      skinny_nt_rows<4>(j0, j1, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
    for (; i + 2 <= m; i += 2)
      skinny_nt_rows<2>(j0, j1, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
    for (; i < m; ++i)
      skinny_nt_rows<1>(j0, j1, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  } else {
    for (; i + 2 <= m; i += 2)
      skinny_nn_rows<2>(j0, j1, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
    for (; i < m; ++i)
      skinny_nn_rows<1>(j0, j1, k, alpha, a + i * lda, lda, b, ldb, beta, c + i * ldc, ldc);
  }
}

#undef DP_SKINNY

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
  std::call_once(once, [] {
    choose_blas_kernels();
    openblas_set_num_threads(1);
    // OpenBLAS's pthread build starts its thread pool when it loads, and an idle pool thread
    // spins (sched_yield) for 2^28 cycles, about 0.1 s, before it sleeps: a core taken from the
    // devices during a run's first steps. One thread needs no pool, so it ends here. The
    // function is the one OpenBLAS runs itself before a fork; a later threaded call (a
    // benchmark's baseline) starts the pool again. Builds without a pool (serial, OpenMP
    // variants) may not have it, hence the lookup.
    end_blas_pool();
  });
}

std::string blas_version() {
  // OpenBLAS chooses its kernels for the CPU it runs on (DYNAMIC_ARCH builds), and
  // choose_blas_kernels chooses again where it did not know the CPU: the core decides the GEMM
  // speed of every CPU figure.
  const BlasKernels k = cpu_blas_kernels();
  std::string text = k.library + " (kernels: " + k.core;
  if (!k.switched_from.empty()) text += ", chosen for this CPU over " + k.switched_from;
  return text + ")";
}

const float* as_f32(const Tensor& t, std::vector<float>& scratch) {
  if (t.dtype() == DType::f32) return t.data<float>();
  scratch.resize(static_cast<size_t>(t.numel()));
  const uint16_t* src = t.data<uint16_t>();
  bool is_bf16 = t.dtype() == DType::bf16;
  parallel_range(t.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    if (is_bf16)
      bf16_to_f32_rows(scratch.data() + begin, src + begin, end - begin);
    else
      for (int64_t i = begin; i < end; ++i) scratch[i] = f16_to_f32(src[i]);
  });
  return scratch.data();
}

void store_from_f32(Tensor& t, const float* src) {
  uint16_t* dst = t.data<uint16_t>();
  bool is_bf16 = t.dtype() == DType::bf16;
  parallel_range(t.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    if (is_bf16)
      f32_to_bf16_rows(dst + begin, src + begin, end - begin);
    else
      for (int64_t i = begin; i < end; ++i) dst[i] = f32_to_f16(src[i]);
  });
}

void sgemm_serial(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  use_single_threaded_blas();
  if (is_skinny(ta, m)) return skinny_columns(tb, m, 0, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  cblas_sgemm(CblasRowMajor, blas_op(ta), blas_op(tb), static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void sgemm_parallel(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  // OpenBLAS's idle pool ended before the first product, whichever path it takes (skinny, tiles)
  use_single_threaded_blas();
  if (m * n * k <= kSerialMacs)
    return sgemm_serial(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (is_skinny(ta, m)) {  // split by columns: each element is computed alike in any split
    const int64_t grain = std::max<int64_t>(16, kMinTileMacs / (m * k));
    return parallel_range(n, grain, [&](int64_t j0, int64_t j1) {
      skinny_columns(tb, m, j0, j1, k, alpha, a, lda, b, ldb, beta, c, ldc);
    });
  }
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

namespace {

// The bf16 product over the same tiles as sgemm_parallel, each one oneDNN call on the arena's
// threads; false (nothing computed) where oneDNN has no fast kernel for a tile's shape. The
// tiling depends on the shape only: each element of C is computed the same way on any arena.
bool bf16_gemm_parallel(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                        float* c, int64_t ldc) {
  if (!bf16_gemm_enabled()) return false;
  const Tiling tiling = m * n * k <= kSerialMacs ? Tiling{m, n, 1, 1} : tiling_for(m, n, k);
  // The (at most four) tile shapes, checked on this thread before any tile runs.
  const int64_t last_rows = m - (tiling.tiles_m - 1) * tiling.rows;
  const int64_t last_cols = n - (tiling.tiles_n - 1) * tiling.cols;
  for (int64_t rows : {tiling.rows, last_rows})
    for (int64_t cols : {tiling.cols, last_cols})
      if (!bf16_gemm_prepare(ta, tb, rows, cols, k, alpha, lda, ldb, beta, ldc)) return false;
  auto run = [&](int64_t t) {
    const int64_t i0 = (t / tiling.tiles_n) * tiling.rows, j0 = (t % tiling.tiles_n) * tiling.cols;
    const int64_t rows = std::min(tiling.rows, m - i0), cols = std::min(tiling.cols, n - j0);
    const uint16_t* a_tile = ta == Transpose::no ? a + i0 * lda : a + i0;
    const uint16_t* b_tile = tb == Transpose::no ? b + j0 : b + j0 * ldb;
    bf16_gemm_tile(ta, tb, rows, cols, k, alpha, a_tile, lda, b_tile, ldb, beta, c + i0 * ldc + j0,
                   ldc);
  };
  if (tiling.tiles_m * tiling.tiles_n == 1) {
    run(0);
    return true;
  }
  parallel_range(tiling.tiles_m * tiling.tiles_n, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) run(t);
  });
  return true;
}

}  // namespace

void bf16_gemm(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  // A model whose products all run on oneDNN never reaches OpenBLAS: its idle pool thread would
  // spin beside the devices for the run's first 0.1 s (bf16 CNN: its first 15-20 steps at 3.5 ms
  // where the rest take 2.1).
  use_single_threaded_blas();
  if (bf16_gemm_parallel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  // Widened: each operand's stored rows (op(A) is (m, k); stored (k, m) when transposed).
  auto widen = [](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld) {
    std::vector<float> out(static_cast<size_t>(rows == 0 ? 0 : (rows - 1) * ld + cols));
    parallel_range(static_cast<int64_t>(out.size()), kElementwiseGrain,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) out[i] = bf16_to_f32(src[i]);
                   });
    return out;
  };
  const std::vector<float> a32 = ta == Transpose::no ? widen(a, m, k, lda) : widen(a, k, m, lda);
  const std::vector<float> b32 = tb == Transpose::no ? widen(b, k, n, ldb) : widen(b, n, k, ldb);
  sgemm_parallel(ta, tb, m, n, k, alpha, a32.data(), lda, b32.data(), ldb, beta, c, ldc);
}

// (m, k) x (k, n) -> (m, n), with op(a) and op(b) read through the transpose flags.
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias) {
  int64_t m = c.dim(0), n = c.dim(1);
  int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  std::vector<float> a_f32, b_f32, c_f32, bias_f32;
  float* c_data = c.data<float>();
  if (c.dtype() != DType::f32) {
    c_f32.assign(static_cast<size_t>(c.numel()), 0.f);
    if (beta != 0.f) as_f32(c, c_f32);
    c_data = c_f32.data();
  }
  if (k == 0 || alpha == 0.f) {
    // BLAS's rule, whatever the path: a and b are not read (their NaN or inf gives no NaN).
    scale_rows(c_data, m, n, beta);
  } else if (a.dtype() == DType::bf16 && b.dtype() == DType::bf16 && bf16_gemm_enabled()) {
    bf16_gemm(ta, tb, m, n, k, alpha, a.data<uint16_t>(), a.dim(1), b.data<uint16_t>(), b.dim(1),
              beta, c_data, n);
  } else {
    const float* a_data = as_f32(a, a_f32);
    const float* b_data = as_f32(b, b_f32);
    sgemm_parallel(ta, tb, m, n, k, alpha, a_data, a.dim(1), b_data, b.dim(1), beta, c_data, n);
  }
  if (bias.defined()) add_row_bias(c_data, m, n, as_f32(bias, bias_f32));  // 16-bit: widened
  if (c.dtype() != DType::f32) store_from_f32(c, c_data);
}

// The ops in turn (ops.hpp: the CPU has no fused epilogue, and these are their bits).
void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias) {
  cpu::gemm(pre, a, ta, b, tb, 1.f, 0.f, bias);
  cpu::gelu_tanh(y, pre);
}

void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre) {
  cpu::gemm(dpre, dy, tdy, w, tw, 1.f, 0.f, Tensor());
  cpu::gelu_tanh_backward(dpre, dpre, pre, Accumulate::no);  // in place: element by element
  if (dbias.defined()) cpu::bias_backward(dbias, dpre, bias_acc);
}

void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias) {
  cpu::gemm(dw, dy, Transpose::yes, x, Transpose::no, 1.f, 1.f, Tensor());
  if (dbias.defined()) cpu::bias_backward(dbias, dy_for_bias, Accumulate::yes);
}

}  // namespace kernels::cpu
