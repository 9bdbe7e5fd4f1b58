// bench_kernels: GEMM throughput (f32 / tf32 / bf16) and memory bandwidth of copy, axpy and add
// on one device, each figure printed next to the device's peak where it is known. On CPU it
// also times OpenBLAS's sgemm and dgemm called directly (one thread and all threads), so our
// tiled, arena-parallel GEMM can be read against the library's own threading. Then GPT-2's
// pointwise ops at its width: GELU(tanh), and the residual sum with the LayerNorm after it,
// separate against fused, with the ratio's 95% interval.
//
//   bench_kernels [--device cpu|cuda|auto] [--sizes 256,512,1024,2048] [--threads N]
//                 [--min-time 0.25] [--json PATH]
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "benchmarks/stats.hpp"
#include "dp/cli/cli.hpp"
#include "kernels/ops.hpp"
#include "nn/file_io.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace kernels;

namespace {

struct Options {
  std::string device = "auto";
  std::vector<int64_t> sizes{256, 512, 1024, 2048};
  int threads = 0;  // CPU arena threads; 0 = all hardware threads
  double min_time = 0.25;
  int64_t stream_elems = 0;  // elements per memory-bound op; 0 = 16M (CPU) / 64M (GPU)
  std::string json_path;
};

// Published dense peaks of the device, where known (0 = unknown).
struct Peaks {
  std::string name;
  double f32_tflops = 0, tf32_tflops = 0, bf16_tflops = 0, memory_tbps = 0;
};

Peaks peaks_of(Device device) {
  if (device.is_cpu()) return {"CPU"};
  std::string name = "CUDA GPU";
#if DP_HAVE_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, physical_gpu(device)) == cudaSuccess) name = prop.name;
#endif
  // H100 SXM and H200 share the compute peaks; H200's HBM3e is faster.
  if (name.find("H200") != std::string::npos) return {name, 67, 494, 989, 4.8};
  if (name.find("H100") != std::string::npos) return {name, 67, 494, 989, 3.35};
  return {name};
}

// ---- the CPU's measured f32 peak ----------------------------------------------------------
// A multiply-add loop in the CPU's widest vector ISA (cpu_vector_isa): kAccumulators independent
// chains, each step one fused multiply-add per chain (SSE: a multiply and an add), enough chains
// to cover the FMA latency on two ports. Its rate is the most f32 arithmetic a core can do, the
// peak a GEMM's GFLOP/s is read against ("x% of peak" on a CPU as on a GPU).
constexpr int kAccumulators = 12;

__attribute__((target("avx512f"))) float fma_steps_avx512(int64_t steps) {
  __m512 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_set1_ps(1.f + 0.01f * j);
  const __m512 m = _mm512_set1_ps(0.9999999f), a = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < steps; ++i)
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, a);
  __m512 sum = acc[0];
  for (int j = 1; j < kAccumulators; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return _mm512_reduce_add_ps(sum);
}
__attribute__((target("avx2,fma"))) float fma_steps_avx2(int64_t steps) {
  __m256 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_set1_ps(1.f + 0.01f * j);
  const __m256 m = _mm256_set1_ps(0.9999999f), a = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < steps; ++i)
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, a);
  float out[8];
  __m256 sum = acc[0];
  for (int j = 1; j < kAccumulators; ++j) sum = _mm256_add_ps(sum, acc[j]);
  _mm256_storeu_ps(out, sum);
  return out[0] + out[7];
}
float fma_steps_sse(int64_t steps) {
  __m128 acc[kAccumulators];
  for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm_set1_ps(1.f + 0.01f * j);
  const __m128 m = _mm_set1_ps(0.9999999f), a = _mm_set1_ps(1e-7f);
  for (int64_t i = 0; i < steps; ++i)
    for (int j = 0; j < kAccumulators; ++j) acc[j] = _mm_add_ps(_mm_mul_ps(acc[j], m), a);
  float out[4];
  _mm_storeu_ps(out, acc[0]);
  return out[0];
}

struct FmaPeak {
  const char* isa;
  int threads;
  double gflops;  // all threads together
};

// The loop run on `threads` threads at once for about `min_time` seconds.
FmaPeak measure_fma_peak(int threads, double min_time) {
  const CpuVectorIsa isa = cpu_vector_isa();
  const int lanes = isa == CpuVectorIsa::avx512 ? 16 : isa == CpuVectorIsa::avx2 ? 8 : 4;
  const char* name = isa == CpuVectorIsa::avx512 ? "AVX-512 FMA"
                     : isa == CpuVectorIsa::avx2 ? "AVX2 FMA"
                                                 : "SSE multiply + add";
  auto run = [isa](int64_t steps) {
    return isa == CpuVectorIsa::avx512 ? fma_steps_avx512(steps)
           : isa == CpuVectorIsa::avx2 ? fma_steps_avx2(steps)
                                       : fma_steps_sse(steps);
  };
  using clock = std::chrono::steady_clock;
  int64_t steps = 1 << 16;
  for (;;) {  // one thread: grow the loop until it lasts a tenth of min_time
    const auto t0 = clock::now();
    volatile float sink = run(steps);
    (void)sink;
    if (std::chrono::duration<double>(clock::now() - t0).count() >= min_time / 10) break;
    steps *= 2;
  }
  steps *= 10;
  std::vector<std::thread> pool;
  const auto t0 = clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      volatile float sink = run(steps);
      (void)sink;
    });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(clock::now() - t0).count();
  const double flops = 2.0 * static_cast<double>(steps) * kAccumulators * lanes * threads;
  return {name, threads, flops / s / 1e9};
}

// Seconds per call of `f`: one warm-up call, then rounds of calls (each ended by `sync`, which
// waits for queued device work) until one round lasts at least `min_time`.
double seconds_per_call(const std::function<void()>& f, const std::function<void()>& sync,
                        double min_time) {
  using clock = std::chrono::steady_clock;
  f();
  sync();
  int64_t calls = 1;
  for (;;) {
    auto start = clock::now();
    for (int64_t i = 0; i < calls; ++i) f();
    sync();
    double elapsed = std::chrono::duration<double>(clock::now() - start).count();
    if (elapsed >= min_time || calls >= (int64_t{1} << 24)) return elapsed / calls;
    // Aim 20% past min_time from this round's rate, growing at least 2x and at most 100x.
    double wanted = elapsed > 0 ? 1.2 * min_time / (elapsed / calls) : 100.0 * calls;
    calls = std::clamp<int64_t>(static_cast<int64_t>(wanted), 2 * calls, 100 * calls);
  }
}

std::string vs_peak(double value, double peak, const char* unit) {
  if (peak <= 0) return "(peak n/a)";
  char buf[96];
  std::snprintf(buf, sizeof buf, "(%.1f%% of %.4g %s peak)", 100.0 * value / peak, peak, unit);
  return buf;
}

class Bench {
 public:
  Bench(const Options& o, Device device) : o_(o), device_(device), peaks_(peaks_of(device)) {
    if (device_.is_cpu()) {  // the cores the arena GEMM runs on, measured
      fma_ = measure_fma_peak(context(device_).cpu_threads(), o_.min_time);
      peaks_.f32_tflops = fma_.gflops / 1e3;
      // bf16 GEMMs on the bf16 instructions: VDPBF16PS does two multiply-adds per f32 lane where
      // an FMA does one, so twice the measured FMA peak (derived, not measured).
      peaks_.bf16_tflops = cpu_blas_kernels().bf16.empty() ? 0.0 : 2.0 * peaks_.f32_tflops;
    }
  }

  void run_all() {
    print_header();
    gemm_section();
    skinny_section();
    if (device_.is_cpu()) openblas_section();
    bandwidth_section();
    transformer_section();
    if (!device_.is_cpu()) gelu_gemm_backward_section();
  }
  const nlohmann::json& results() const { return results_; }

 private:
  void sync() { context(device_).synchronize(); }

  // A tensor of `shape` and `dt` on the device, every element v.
  Tensor filled(const Shape& shape, DType dt, float v) {
    Tensor t = Tensor::empty(shape, dt, device_);
    fill(t, v);
    return t;
  }

  // Seconds per call of a and of b, alternating over `rounds` rounds of at least round_time each
  // (paired: round r of a beside round r of b).
  std::pair<std::vector<double>, std::vector<double>> alternate(const std::function<void()>& a,
                                                                const std::function<void()>& b,
                                                                int rounds, double round_time) {
    std::vector<double> ta, tb;
    for (int r = 0; r < rounds; ++r) {
      ta.push_back(seconds_per_call(
          a, [&] { sync(); }, round_time));
      tb.push_back(seconds_per_call(
          b, [&] { sync(); }, round_time));
    }
    return {ta, tb};
  }

  void print_header() {
    std::printf("device: %s (%s)", device_.str().c_str(), peaks_.name.c_str());
    if (device_.is_cpu())
      std::printf(", arena of %d threads, %u hardware threads", context(device_).cpu_threads(),
                  std::thread::hardware_concurrency());
    std::printf("\n");
    if (!device_.is_cpu()) return;
    const BlasKernels k = cpu_blas_kernels();
    std::printf(
        "GEMM library: %s, %s kernels%s\n", k.library.c_str(), k.core.c_str(),
        k.switched_from.empty()
            ? ""
            : (" (chosen for this CPU; OpenBLAS had chosen " + k.switched_from + ")").c_str());
    if (!k.warning.empty()) std::printf("warning: %s\n", k.warning.c_str());
    std::printf("bf16 GEMM: %s\n",
                k.bf16.empty() ? "widened to f32 (no oneDNN, or no AVX512_BF16)" : k.bf16.c_str());
    std::printf("f32 peak: %.1f GFLOP/s, measured (an %s loop on %d threads, the arena's)\n",
                fma_.gflops, fma_.isa, fma_.threads);
    results_.push_back({{"kind", "fma_peak"},
                        {"isa", fma_.isa},
                        {"threads", fma_.threads},
                        {"gflops", fma_.gflops}});
    results_.push_back({{"kind", "blas"},
                        {"library", k.library},
                        {"kernels", k.core},
                        {"generic", k.generic},
                        {"chosen_over", k.switched_from}});
  }

  // C (n, n) = A (n, n) B (n, n) in `dtype` through kernels::gemm.
  void gemm_section() {
    std::printf("\nGEMM through kernels::gemm, C = A B, n x n x n (2 n^3 flop per call)\n");
    struct Variant {
      const char* label;
      DType dtype;
      MathMode math;
      double peak;
    };
    const Variant variants[] = {{"f32", DType::f32, MathMode::strict, peaks_.f32_tflops},
                                {"tf32", DType::f32, MathMode::tf32, peaks_.tf32_tflops},
                                {"bf16", DType::bf16, MathMode::strict, peaks_.bf16_tflops}};
    DeviceContext& ctx = context(device_);
    MathMode saved = ctx.math();
    for (const Variant& v : variants) {
      if (device_.is_cpu() && v.math != MathMode::strict) {
        std::printf("  %-5s skipped (CPU): a tensor-core format of CUDA devices\n", v.label);
        continue;
      }
      if (device_.is_cpu() && v.dtype == DType::bf16 && peaks_.bf16_tflops == 0.0) {
        std::printf(
            "  %-5s skipped (CPU): bf16 GEMMs widen to f32 here (no oneDNN or no "
            "AVX512_BF16)\n",
            v.label);
        continue;
      }
      ctx.set_math(v.math);
      for (int64_t n : o_.sizes) {
        Tensor a = Tensor::empty({n, n}, v.dtype, device_),
               b = Tensor::empty({n, n}, v.dtype, device_);
        Tensor c = Tensor::empty({n, n}, v.dtype, device_);
        fill(a, 0.5f);
        fill(b, 0.25f);
        double s = seconds_per_call([&] { gemm(c, a, Transpose::no, b, Transpose::no); },
                                    [&] { sync(); }, o_.min_time);
        double gflops = 2.0 * n * n * n / s / 1e9;
        std::printf("  %-5s n=%-5lld %10.1f GFLOP/s  %8.3f ms  %s\n", v.label,
                    static_cast<long long>(n), gflops, s * 1e3,
                    vs_peak(gflops / 1e3, v.peak, "TFLOP/s").c_str());
        results_.push_back({{"kind", "gemm"},
                            {"impl", "kernels::gemm"},
                            {"dtype", v.label},
                            {"n", n},
                            {"seconds", s},
                            {"gflops", gflops},
                            {"peak_tflops", v.peak}});
      }
    }
    ctx.set_math(saved);
  }

  // A replica's few rows through a weight matrix (the MLP's first layer, 784 -> 256): forward
  // x W^T and backward dy W, through kernels::gemm and, on a CPU, OpenBLAS's sgemm on one thread
  // (which packs all of W on every call).
  void skinny_section() {
    const int64_t in = 784, out = 256;
    std::printf("\nSkinny GEMM, rows x %lld x %lld (a replica's rows through one layer), us\n",
                static_cast<long long>(in), static_cast<long long>(out));
    std::printf("  %-5s %12s %12s %12s %12s\n", "rows", "x W^T", "sgemm", "dy W", "sgemm");
    Tensor w = Tensor::empty({out, in}, DType::f32, device_);
    fill(w, 0.25f);
    for (int64_t rows : {1, 2, 4, 8, 16}) {
      Tensor x = Tensor::empty({rows, in}, DType::f32, device_);
      Tensor y = Tensor::empty({rows, out}, DType::f32, device_);
      fill(x, 0.5f);
      fill(y, 0.5f);
      // us: x W^T and dy W through kernels::gemm, each followed by OpenBLAS's time for it.
      double us[4] = {0, 0, 0, 0};
      auto time_pair = [&](double* at, Tensor& c, const Tensor& a, Transpose tb) {
        at[0] = 1e6 * seconds_per_call([&] { gemm(c, a, Transpose::no, w, tb); }, [&] { sync(); },
                                       o_.min_time);
        if (!device_.is_cpu()) return;
        openblas_set_num_threads(1);
        const blasint m = static_cast<blasint>(c.dim(0)), n = static_cast<blasint>(c.dim(1));
        const blasint k = static_cast<blasint>(a.dim(1));
        const CBLAS_TRANSPOSE op = tb == Transpose::yes ? CblasTrans : CblasNoTrans;
        at[1] =
            1e6 * seconds_per_call(
                      [&] {
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, op, m, n, k, 1.f, a.data<float>(),
                                    k, w.data<float>(), in, 0.f, c.data<float>(), n);
                      },
                      [] {}, o_.min_time);
      };
      time_pair(us, y, x, Transpose::yes);
      time_pair(us + 2, x, y, Transpose::no);
      std::printf("  %-5lld %12.1f %12.1f %12.1f %12.1f\n", static_cast<long long>(rows), us[0],
                  us[1], us[2], us[3]);
      results_.push_back({{"kind", "skinny_gemm"},
                          {"rows", rows},
                          {"forward_us", us[0]},
                          {"forward_sgemm_us", us[1]},
                          {"backward_data_us", us[2]},
                          {"backward_data_sgemm_us", us[3]}});
    }
  }

  // OpenBLAS called directly, with its own threads: the reference for kernels::gemm on CPU.
  void openblas_section() {
    int all = std::max(1, openblas_get_num_procs());
    std::printf("\nOpenBLAS called directly (cblas_*gemm, row-major, n x n x n), GFLOP/s\n");
    std::printf("  %-6s %-7s %14s %16s\n", "", "", "1 thread",
                (std::to_string(all) + " threads").c_str());
    for (const char* routine : {"sgemm", "dgemm"}) {
      bool single = std::string(routine) == "sgemm";
      for (int64_t n : o_.sizes) {
        std::vector<float> fa(single ? n * n : 0, 0.5f), fb(fa.size(), 0.25f), fc(fa.size());
        std::vector<double> da(single ? 0 : n * n, 0.5), db(da.size(), 0.25), dc(da.size());
        auto call = [&] {
          blasint m = static_cast<blasint>(n);
          if (single)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.f, fa.data(), m,
                        fb.data(), m, 0.f, fc.data(), m);
          else
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0, da.data(), m,
                        db.data(), m, 0.0, dc.data(), m);
        };
        double rate[2];
        for (int t = 0; t < 2; ++t) {
          openblas_set_num_threads(t == 0 ? 1 : all);
          double s = seconds_per_call(
              call, [] {}, o_.min_time);
          rate[t] = 2.0 * n * n * n / s / 1e9;
          results_.push_back({{"kind", "gemm"},
                              {"impl", std::string("openblas ") + routine},
                              {"dtype", single ? "f32" : "f64"},
                              {"n", n},
                              {"threads", t == 0 ? 1 : all},
                              {"seconds", s},
                              {"gflops", rate[t]}});
        }
        std::printf("  %-6s n=%-5lld %9.1f GFLOP/s %9.1f GFLOP/s\n", routine,
                    static_cast<long long>(n), rate[0], rate[1]);
      }
    }
    openblas_set_num_threads(1);  // kernels::gemm parallelises across the arena itself
  }

  // Bytes moved per call: copy reads and writes n floats; axpy and add read two, write one.
  void bandwidth_section() {
    int64_t n = o_.stream_elems > 0 ? o_.stream_elems
                                    : (device_.is_cpu() ? int64_t{1} << 24 : int64_t{1} << 26);
    std::printf("\nMemory-bound ops, %lld f32 elements (%.0f MiB per tensor), GB/s\n",
                static_cast<long long>(n), n * 4.0 / (1 << 20));
    Tensor x = Tensor::empty({n}, DType::f32, device_), y = Tensor::empty({n}, DType::f32, device_);
    Tensor z = Tensor::empty({n}, DType::f32, device_);
    fill(x, 1.f);
    fill(y, 2.f);
    fill(z, 0.f);
    struct Op {
      const char* name;
      double bytes;
      std::function<void()> call;
    };
    const Op ops[] = {{"copy", 2.0 * n * 4, [&] { copy(z, x); }},
                      {"axpy", 3.0 * n * 4, [&] { axpy(y, 1e-3f, x); }},
                      {"add", 3.0 * n * 4, [&] { add(z, x, y); }}};
    for (const Op& op : ops) {
      double s = seconds_per_call(
          op.call, [&] { sync(); }, o_.min_time);
      double gbps = op.bytes / s / 1e9;
      std::printf("  %-5s %10.1f GB/s  %8.3f ms  %s\n", op.name, gbps, s * 1e3,
                  vs_peak(gbps / 1e3, peaks_.memory_tbps, "TB/s").c_str());
      results_.push_back({{"kind", "bandwidth"},
                          {"op", op.name},
                          {"elements", n},
                          {"seconds", s},
                          {"gbps", gbps},
                          {"peak_tbps", peaks_.memory_tbps}});
    }
  }

  // GPT-2 124M's pointwise ops at its width (D 768; 2048 rows on a CPU, 16384 on a GPU: batch 16
  // of 1024 tokens): GELU(tanh) forward and backward over (rows, 4 D), and the residual sum with
  // the LayerNorm after it, separate (add then layer_norm_forward; layer_norm_backward then add)
  // against fused (add_layer_norm_forward; layer_norm_backward_add), in f32 and bf16. Separate
  // and fused alternate over kRounds rounds: the ratio of their medians, with a paired 95%
  // bootstrap interval (benchmarks/stats.hpp).
  void transformer_section() {
    constexpr int kRounds = 7;
    const int64_t rows = device_.is_cpu() ? 2048 : 16384, d = 768;
    std::printf("\nGPT-2's pointwise ops, %lld rows x %lld (x 4 for GELU), ms per call\n",
                static_cast<long long>(rows), static_cast<long long>(d));
    const double round_time = std::max(0.02, o_.min_time / 4);
    for (DType dt : {DType::f32, DType::bf16}) {
      auto filled_with = [&](const Shape& shape, float v) { return filled(shape, dt, v); };
      Tensor h4 = filled_with({rows, 4 * d}, 0.3f), g4 = filled_with({rows, 4 * d}, 0.f);
      Tensor dy4 = filled_with({rows, 4 * d}, 1.f);
      const double gelu_fwd =
          seconds_per_call([&] { gelu_tanh(g4, h4); }, [&] { sync(); }, o_.min_time);
      const double gelu_bwd = seconds_per_call(
          [&] { gelu_tanh_backward(g4, dy4, h4, Accumulate::no); }, [&] { sync(); }, o_.min_time);
      const double elems = static_cast<double>(rows * 4 * d);
      std::printf("  %-4s gelu_tanh        fwd %8.3f ms (%5.2f ns/element)   bwd %8.3f ms\n",
                  dtype_name(dt), gelu_fwd * 1e3, gelu_fwd * 1e9 / elems, gelu_bwd * 1e3);
      results_.push_back({{"kind", "gelu_tanh"},
                          {"dtype", dtype_name(dt)},
                          {"elements", rows * 4 * d},
                          {"forward_seconds", gelu_fwd},
                          {"backward_seconds", gelu_bwd}});

      Tensor a = filled_with({rows, d}, 0.5f), b = filled_with({rows, d}, -0.25f);
      Tensor h = filled_with({rows, d}, 0.f), y = filled_with({rows, d}, 0.f);
      Tensor dy = filled_with({rows, d}, 0.1f), dskip = filled_with({rows, d}, 0.2f);
      Tensor dnorm = filled_with({rows, d}, 0.f), dx = filled_with({rows, d}, 0.f);
      Tensor gamma = Tensor::empty({d}, DType::f32, device_);
      Tensor beta = Tensor::empty({d}, DType::f32, device_);
      Tensor dgamma = Tensor::empty({d}, DType::f32, device_);
      Tensor dbeta = Tensor::empty({d}, DType::f32, device_);
      Tensor mean = Tensor::empty({rows}, DType::f32, device_);
      Tensor rstd = Tensor::empty({rows}, DType::f32, device_);
      fill(gamma, 1.f);
      fill(beta, 0.f);
      const std::function<void()> fwd[2] = {
          [&] {
            add(h, a, b);
            layer_norm_forward(y, mean, rstd, h, gamma, beta, 1e-5f);
          },
          [&] { add_layer_norm_forward(h, y, mean, rstd, a, b, gamma, beta, 1e-5f); }};
      const std::function<void()> bwd[2] = {
          [&] {
            layer_norm_backward(dnorm, dgamma, dbeta, dy, h, gamma, mean, rstd, Accumulate::yes);
            add(dx, dskip, dnorm);
          },
          [&] {
            layer_norm_backward_add(dx, dgamma, dbeta, dy, dskip, h, gamma, mean, rstd,
                                    Accumulate::yes);
          }};
      for (int dir = 0; dir < 2; ++dir) {
        const std::function<void()>* calls = dir == 0 ? fwd : bwd;
        auto [separate, fused] = alternate(calls[0], calls[1], kRounds, round_time);
        const bench::Estimate ratio = bench::ratio_ci(fused, separate, bench::Pairing::paired);
        const char* what = dir == 0 ? "residual+LN fwd" : "LN+residual bwd";
        std::printf("  %-4s %-16s separate %8.3f ms   fused %8.3f ms   fused/separate %s\n",
                    dtype_name(dt), what, bench::median(separate) * 1e3, bench::median(fused) * 1e3,
                    bench::format_ci(ratio, 2).c_str());
        results_.push_back(
            {{"kind", dir == 0 ? "add_layer_norm_forward" : "layer_norm_backward_add"},
             {"dtype", dtype_name(dt)},
             {"rows", rows},
             {"features", d},
             {"separate_seconds", separate},
             {"fused_seconds", fused},
             {"ratio", ratio.value},
             {"ratio_lo", ratio.lo},
             {"ratio_hi", ratio.hi}});
      }
    }
  }

  // GPT-2 124M's MLP backward through the GELU at batch 8 (8192 rows, D 768, bf16): dpre (rows,
  // 4 D) = (dy (rows, D) W (D, 4 D)) * gelu_tanh'(pre), and the bias gradient, by cuBLASLt's
  // DGELU_BGRAD epilogue against the three ops (kernels::set_cuda_dgelu_epilogue), alternating
  // over kRounds rounds: the ratio of their medians with a paired 95% bootstrap interval. CUDA
  // only: a CPU runs the ops either way.
  void gelu_gemm_backward_section() {
    constexpr int kRounds = 7;
    const int64_t rows = 8192, d = 768;
    const double round_time = std::max(0.02, o_.min_time / 4);
    Tensor dy = filled({rows, d}, DType::bf16, 0.01f);
    Tensor w = filled({d, 4 * d}, DType::bf16, 0.02f);
    Tensor pre = filled({rows, 4 * d}, DType::bf16, 0.3f);
    Tensor dpre = filled({rows, 4 * d}, DType::bf16, 0.f);
    Tensor dbias = filled({4 * d}, DType::f32, 0.f);
    const bool was = cuda_dgelu_epilogue();
    auto call = [&](bool epilogue) {
      return [&, epilogue] {
        set_cuda_dgelu_epilogue(epilogue);
        gemm_gelu_tanh_backward(dpre, dbias, Accumulate::yes, dy, Transpose::no, w, Transpose::no,
                                pre);
      };
    };
    auto [with_epilogue, with_ops] = alternate(call(true), call(false), kRounds, round_time);
    set_cuda_dgelu_epilogue(was);
    const double flops =
        2.0 * static_cast<double>(rows) * static_cast<double>(4 * d) * static_cast<double>(d);
    const bench::Estimate ratio = bench::ratio_ci(with_ops, with_epilogue, bench::Pairing::paired);
    std::printf(
        "\nGPT-2's MLP backward through the GELU, bf16, %lld x %lld x %lld (batch 8), ms per call\n"
        "  cuBLASLt DGELU_BGRAD %8.3f ms   GEMM + gelu_tanh_backward + bias_backward %8.3f ms   "
        "ops/epilogue %s  (the GEMM alone at the %.0f TFLOP/s peak: %.3f ms)\n",
        static_cast<long long>(rows), static_cast<long long>(4 * d), static_cast<long long>(d),
        bench::median(with_epilogue) * 1e3, bench::median(with_ops) * 1e3,
        bench::format_ci(ratio, 2).c_str(), peaks_.bf16_tflops,
        peaks_.bf16_tflops > 0 ? flops / (peaks_.bf16_tflops * 1e12) * 1e3 : 0.0);
    results_.push_back({{"kind", "gemm_gelu_tanh_backward"},
                        {"dtype", "bf16"},
                        {"m", rows},
                        {"n", 4 * d},
                        {"k", d},
                        {"epilogue_seconds", with_epilogue},
                        {"ops_seconds", with_ops},
                        {"ratio", ratio.value},
                        {"ratio_lo", ratio.lo},
                        {"ratio_hi", ratio.hi}});
  }

  Options o_;
  Device device_;
  Peaks peaks_;
  FmaPeak fma_{"", 0, 0};
  nlohmann::json results_ = nlohmann::json::array();
};

// The device to measure: cuda:0 for "cuda", cpu:0 for "cpu", and for "auto" the first GPU if
// any, else the CPU with one line saying why.
std::optional<Device> pick_device(const std::string& choice) {
  try {
    std::string fallback;
    DeviceType t = choose_device_type(choice, &fallback);
    if (!fallback.empty()) std::printf("auto: %s\n", fallback.c_str());
    return Device{t, 0};
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return std::nullopt;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GEMM throughput and memory bandwidth of the kernels on one device"};
  app.option_defaults()->always_capture_default();  // --help shows every default
  Options o;
  app.add_option("--device", o.device, "cpu, cuda or auto (cuda when a GPU is usable)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  // Each value checked before any work (a NaN --min-time timed forever).
  app.add_option("--sizes", o.sizes, "square GEMM sizes n")
      ->delimiter(',')
      ->check(dp::cli::whole_number(1, 1 << 17));
  app.add_option("--threads", o.threads, "CPU arena threads (0: all hardware threads)")
      ->check(dp::cli::whole_number(0, 4096));
  app.add_option("--min-time", o.min_time, "seconds to time each figure for")
      ->check(dp::cli::positive_number(3600));
  app.add_option("--stream-elems", o.stream_elems,
                 "elements per memory-bound op (0: 16M on CPU, 64M on GPU)")
      ->check(dp::cli::whole_number(0, int64_t{1} << 34));
  app.add_option("--json", o.json_path, "also write the figures as JSON to this file")
      ->check(dp::cli::output_file(dp::cli::Output::report));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return dp::cli::parse_exit(app, e);
  }

  try {
    (void)cuda_dgelu_epilogue();  // a bad DP_CUDA_DGELU refused before any work
    std::optional<Device> device = pick_device(o.device);
    if (!device) return 1;
    ContextOptions options;
    options.cpu_threads = o.threads;
    DeviceContext ctx(*device, options);
    ContextScope scope(ctx);
    Bench bench(o, *device);
    bench.run_all();
    if (!o.json_path.empty()) {
      nn::io::write_output_file(
          o.json_path,
          nlohmann::json{
              {"program", "bench_kernels"}, {"device", device->str()}, {"results", bench.results()}}
                  .dump(2) +
              "\n",
          "--json");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kernels: %s\n", e.what());
    return 1;
  }
  return 0;
}
