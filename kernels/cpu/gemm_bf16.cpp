// bf16 x bf16 GEMM tiles on the CPU's bf16 instructions (AVX512_BF16's dot products, or AMX),
// through oneDNN's matmul primitive, where the build has oneDNN and the CPU has the instructions.
// gemm.cpp tiles C as it does for f32 and hands each tile here; without oneDNN, or on a CPU
// without AVX512_BF16, or for a layout oneDNN would run only on a reference kernel, it widens the
// operands to f32 and runs sgemm as before.
//
// Each tile is one single-threaded matmul on the calling thread (the device's arena supplies the
// parallelism, as with OpenBLAS): oneDNN's OpenMP runtime is held to one thread per caller.
// Primitives are kept per thread and per tile shape, so a step's GEMMs create none after the
// first step.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"

#if DP_HAVE_ONEDNN
#include <dlfcn.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace kernels::cpu {

namespace {

std::atomic<bool>& bf16_gemm_wanted() {
  static std::atomic<bool> wanted{[] {
    const char* env = std::getenv("DP_CPU_BF16_GEMM");
    return !(env && std::strcmp(env, "widen") == 0);
  }()};
  return wanted;
}

#if DP_HAVE_ONEDNN

struct TileKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool ta, tb;
  uint32_t alpha, beta;  // bit patterns
  bool operator==(const TileKey& o) const {
    return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb && ldc == o.ldc &&
           ta == o.ta && tb == o.tb && alpha == o.alpha && beta == o.beta;
  }
};

struct TileKeyHash {
  size_t operator()(const TileKey& t) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : {t.m, t.n, t.k, t.lda, t.ldb, t.ldc, int64_t{t.ta}, int64_t{t.tb},
                      int64_t{t.alpha}, int64_t{t.beta}})
      h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// One tile shape's primitive and the memory objects it runs on (their pointers set per call).
struct TilePrimitive {
  bool ok = false;
  std::string impl;  // oneDNN's name for its kernel
  dnnl::matmul matmul;
  dnnl::memory a, b, c;
  uint64_t last_use = 0;  // ThreadState::uses when tile_for last returned it
};

// Tiles a thread keeps: a run whose batch size keeps changing made one primitive per exact shape
// (54 MB of them for about 200 sizes), never dropped. Past this, the half used longest ago goes.
constexpr size_t kMaxTiles = 2048;

// This thread's oneDNN calls stay on it: Debian's oneDNN runs on OpenMP (libgomp, loaded with it),
// whose per-thread team size is set here. Looked up, so that a build of oneDNN on another runtime
// (TBB, sequential) needs nothing.
void run_on_calling_thread_only() {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"))) set(1);
}

// Everything oneDNN needs, per thread: its engine and stream are not shared between threads.
struct ThreadState {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<TileKey, TilePrimitive, TileKeyHash> tiles;
  uint64_t uses = 0;
  ThreadState() { run_on_calling_thread_only(); }
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// oneDNN's name for the kernel it runs ("brg:avx512_core_bf16"); a reference kernel ("ref:any",
// "gemm:ref") would be slower than widening to f32.
bool is_fast_impl(const std::string& impl) {
  return impl.find("ref") == std::string::npos;
}

TilePrimitive make_tile(ThreadState& st, const TileKey& key) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  TilePrimitive t;
  // op(A) (m, k) and op(B) (k, n) as stored: row-major with their leading dimension, or
  // transposed (column-major) when the flag says so.
  dnnl::memory::desc a_md({key.m, key.k}, dt::bf16, key.ta ? dims{1, key.lda} : dims{key.lda, 1});
  dnnl::memory::desc b_md({key.k, key.n}, dt::bf16, key.tb ? dims{1, key.ldb} : dims{key.ldb, 1});
  dnnl::memory::desc c_md({key.m, key.n}, dt::f32, dims{key.ldc, 1});
  float alpha, beta;
  std::memcpy(&alpha, &key.alpha, sizeof alpha);
  std::memcpy(&beta, &key.beta, sizeof beta);
  dnnl::primitive_attr attr;
  dnnl::post_ops ops;
  // C = alpha A B + beta C: the product scaled, then the old C added with its scale.
#if DNNL_VERSION_MAJOR >= 3
  if (alpha != 1.f) ops.append_eltwise(dnnl::algorithm::eltwise_linear, alpha, 0.f);
#else
  if (alpha != 1.f) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_linear, alpha, 0.f);
#endif
  if (beta != 0.f) ops.append_sum(beta);
  attr.set_post_ops(ops);
  try {
#if DNNL_VERSION_MAJOR >= 3
    dnnl::matmul::primitive_desc pd(st.engine, a_md, b_md, c_md, attr);
#else
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, st.engine);
#endif
    t.impl = pd.impl_info_str();
    if (!is_fast_impl(t.impl)) return t;
    t.matmul = dnnl::matmul(pd);
    t.a = dnnl::memory(a_md, st.engine, DNNL_MEMORY_NONE);
    t.b = dnnl::memory(b_md, st.engine, DNNL_MEMORY_NONE);
    t.c = dnnl::memory(c_md, st.engine, DNNL_MEMORY_NONE);
    t.ok = true;
  } catch (const dnnl::error&) {
    t.ok = false;  // a layout oneDNN does not take: the caller widens
  }
  return t;
}

TilePrimitive& tile_for(const TileKey& key) {
  ThreadState& st = thread_state();
  auto it = st.tiles.find(key);
  if (it == st.tiles.end()) {
    if (st.tiles.size() >= kMaxTiles) {  // the older half goes (a tile in use is the newest)
      std::vector<uint64_t> uses;
      uses.reserve(st.tiles.size());
      for (const auto& [k, t] : st.tiles) uses.push_back(t.last_use);
      std::nth_element(uses.begin(), uses.begin() + uses.size() / 2, uses.end());
      const uint64_t median = uses[uses.size() / 2];
      for (auto t = st.tiles.begin(); t != st.tiles.end();)
        t = t->second.last_use < median ? st.tiles.erase(t) : std::next(t);
    }
    it = st.tiles.emplace(key, make_tile(st, key)).first;
  }
  it->second.last_use = ++st.uses;
  return it->second;
}

TileKey key_of(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
               int64_t lda, int64_t ldb, float beta, int64_t ldc) {
  return TileKey{m,
                 n,
                 k,
                 lda,
                 ldb,
                 ldc,
                 ta == Transpose::yes,
                 tb == Transpose::yes,
                 bits_of(alpha),
                 bits_of(beta)};
}

// What the CPU offers and the kernel oneDNN picks for a typical product, once per process.
struct Bf16Support {
  bool usable = false;
  std::string kernel;  // oneDNN's implementation name
};

const Bf16Support& bf16_support() {
  static const Bf16Support support = [] {
    Bf16Support s;
#if defined(__SANITIZE_THREAD__)
    // oneDNN's process-wide primitive cache shares primitives between threads through
    // synchronisation ThreadSanitizer cannot see (the library is not instrumented), and it
    // reports their keys as races. Primitives are kept per thread here anyway (thread_state), so
    // ThreadSanitizer builds turn the shared cache off and keep every check of this file's code.
    dnnl::set_primitive_cache_capacity(0);
#endif
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return s;
    TilePrimitive& t =
        tile_for(key_of(Transpose::no, Transpose::yes, 64, 64, 64, 1.f, 64, 64, 0.f, 64));
    if (!t.ok) return s;
    s.usable = true;
    s.kernel = t.impl;
    return s;
  }();
  return support;
}

#endif  // DP_HAVE_ONEDNN

}  // namespace

void set_bf16_gemm_enabled(bool enabled) {
  bf16_gemm_wanted() = enabled;
}

bool bf16_gemm_enabled() {
#if DP_HAVE_ONEDNN
  return bf16_gemm_wanted() && bf16_support().usable;
#else
  return false;
#endif
}

std::string bf16_gemm_version() {
#if DP_HAVE_ONEDNN
  const dnnl_version_t* v = dnnl_version();
  std::string text = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                     std::to_string(v->patch);
  const Bf16Support& s = bf16_support();
  if (!s.usable)
    text += " (not used: this CPU has no AVX512_BF16; bf16 GEMMs widen to f32)";
  else if (!bf16_gemm_wanted())
    text += " (not used: turned off, DP_CPU_BF16_GEMM=widen; bf16 GEMMs widen to f32)";
  else
    text += " (bf16 kernels: " + s.kernel + ")";
  return text;
#else
  return "";
#endif
}

bool bf16_gemm_prepare(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                       int64_t lda, int64_t ldb, float beta, int64_t ldc) {
#if DP_HAVE_ONEDNN
  return tile_for(key_of(ta, tb, m, n, k, alpha, lda, ldb, beta, ldc)).ok;
#else
  (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)lda, (void)ldb, (void)beta,
      (void)ldc;
  return false;
#endif
}

void bf16_gemm_tile(Transpose ta, Transpose tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta,
                    float* c, int64_t ldc) {
#if DP_HAVE_ONEDNN
  TilePrimitive& t = tile_for(key_of(ta, tb, m, n, k, alpha, lda, ldb, beta, ldc));
  if (!t.ok)
    throw Error("bf16 GEMM tile (" + std::to_string(m) + " x " + std::to_string(n) + " x " +
                std::to_string(k) + ") has no oneDNN kernel; bf16_gemm_prepare said so first");
  t.a.set_data_handle(const_cast<uint16_t*>(a));
  t.b.set_data_handle(const_cast<uint16_t*>(b));
  t.c.set_data_handle(c);
  ThreadState& st = thread_state();
  t.matmul.execute(st.stream, {{DNNL_ARG_SRC, t.a}, {DNNL_ARG_WEIGHTS, t.b}, {DNNL_ARG_DST, t.c}});
  st.stream.wait();
#else
  (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b,
      (void)ldb, (void)beta, (void)c, (void)ldc;
  throw Error("bf16_gemm_tile: this build has no oneDNN");
#endif
}

}  // namespace kernels::cpu
