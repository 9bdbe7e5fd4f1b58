// kernels.*: elementwise ops, bias helpers, GEMM and activations against plain-loop references
// in double; argument checks. Losses, convolutions and normalisation have their own files.
#include <cblas.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iterator>
#include <limits>
#include <thread>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/vec_math.hpp"
#include "kernels/runtime/graph.hpp"
#include "tests/device_scalars.hpp"
#include "tests/gemm_gelu_cases.hpp"
#include "tests/native16_cases.hpp"
#include "tests/test_kernels_util.hpp"

using namespace kernels;
using namespace kt;

namespace {

// Reference op(a) op(b) with a, b row-major as stored: c = alpha op(a) op(b) + beta c + bias.
std::vector<double> ref_gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb,
                             float alpha, float beta, const Tensor& c, const Tensor& bias) {
  std::vector<double> A = to_double(a), B = to_double(b), C = to_double(c);
  int64_t m = c.dim(0), n = c.dim(1);
  int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  auto at = [&](int64_t i, int64_t l) {
    return ta == Transpose::no ? A[i * a.dim(1) + l] : A[l * a.dim(1) + i];
  };
  auto bt = [&](int64_t l, int64_t j) {
    return tb == Transpose::no ? B[l * b.dim(1) + j] : B[j * b.dim(1) + l];
  };
  std::vector<double> bias_v = bias.defined() ? to_double(bias) : std::vector<double>(n, 0.0);
  std::vector<double> out(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t l = 0; l < k; ++l) s += at(i, l) * bt(l, j);
      double prior = beta == 0.f ? 0.0 : beta * C[i * n + j];
      out[i * n + j] = alpha * s + prior + bias_v[j];
    }
  return out;
}

Shape stored(int64_t rows, int64_t cols, Transpose t) {
  return t == Transpose::no ? Shape{rows, cols} : Shape{cols, rows};
}

}  // namespace

TEST_CASE("kernels.cast: f32, f16 and bf16 convert on one device, same dtype copies") {
  Tensor t = Tensor::from_vector({1.f, 0.5f, -3.f, 1e6f}, {4}, Device::cpu(), DType::bf16);
  Tensor h = cast(t, DType::f16);
  CHECK(h.dtype() == DType::f16);
  std::vector<float> back = cast(h, DType::f32).to_host_f32();
  CHECK(back[0] == 1.f);
  CHECK(back[1] == 0.5f);
  CHECK(back[2] == -3.f);
  CHECK(std::isinf(back[3]));  // bf16 holds 1e6 (as 999424); f16 overflows to inf
  Tensor same = cast(t, DType::bf16);
  CHECK_FALSE(same.same_storage(t));
  CHECK(same.to_host_f32() == t.to_host_f32());
  Tensor ints = Tensor::from_ints({1, 2}, {2});
  CHECK_THROWS_WITH_AS(cast(ints, DType::f32), doctest::Contains("converts only between"), Error);
}

TEST_CASE("kernels.fill: zero over old values in every dtype, -0.f keeps its sign, a view only") {
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(d);
    Tensor t = cast(Tensor::from_vector(std::vector<float>(37, 3.f), {37}), d);
    Tensor part = t.view(1, {35});
    fill(part, 0.f);
    std::vector<float> got = cast(t, DType::f32).to_host_f32();
    CHECK(got.front() == 3.f);
    CHECK(got.back() == 3.f);
    for (int i = 1; i < 36; ++i) CHECK(got[i] == 0.f);
    fill(part, 2.5f);
    got = cast(t, DType::f32).to_host_f32();
    CHECK(got[1] == 2.5f);
  }
  Tensor ints = Tensor::from_ints({7, 7, 7, 7}, {4});
  Tensor mid = ints.view(1, {2});
  fill(mid, 0.f);
  CHECK(ints.to_host_i32() == std::vector<int32_t>{7, 0, 0, 7});
  // An integer dtype takes whole values it holds: the cast of NaN or 3e9 gave INT_MIN.
  fill(mid, -2147483648.f);
  CHECK(ints.to_host_i32() == std::vector<int32_t>{7, INT32_MIN, INT32_MIN, 7});
  for (float bad : {NAN, 3e9f, 2.5f, INFINITY})
    CHECK(dp_test::error_of([&] {
            fill(mid, bad);
          }).find("is not a whole value that y Tensor(i32") != std::string::npos);
  Tensor bytes = Tensor::zeros({2}, DType::u8, Device::cpu());
  CHECK(dp_test::error_of([&] { fill(bytes, 256.f); }).find("is not a whole value") !=
        std::string::npos);
  CHECK(ints.to_host_i32() == std::vector<int32_t>{7, INT32_MIN, INT32_MIN, 7});
  Tensor t = Tensor::from_vector({1.f, 1.f, 1.f}, {3});
  fill(t, -0.f);
  for (float v : t.to_host_f32()) CHECK((v == 0.f && std::signbit(v)));
  fill(t, 0.f);
  for (float v : t.to_host_f32()) CHECK((v == 0.f && !std::signbit(v)));
}

TEST_CASE("kernels.elementwise: add, mul, scale, axpy (odd sizes, in place)") {
  for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{100003}}) {
    Tensor a = random_tensor({n}, 1), b = random_tensor({n}, 2), y = zeros({n});
    std::vector<double> A = to_double(a), B = to_double(b), want(n);
    add(y, a, b);
    for (int64_t i = 0; i < n; ++i) want[i] = A[i] + B[i];
    CHECK(max_error(y, want) <= 1e-6);
    mul(y, a, b);
    for (int64_t i = 0; i < n; ++i) want[i] = A[i] * B[i];
    CHECK(max_error(y, want) <= 1e-6);
    scale(y, a, -2.5f);
    for (int64_t i = 0; i < n; ++i) want[i] = -2.5 * A[i];
    CHECK(max_error(y, want) <= 1e-6);
    axpy(y, 0.5f, b);  // y = -2.5 a + 0.5 b
    for (int64_t i = 0; i < n; ++i) want[i] += 0.5 * B[i];
    CHECK(max_error(y, want) <= 1e-6);
    scale(a, a, 3.f);  // y may alias x
    for (int64_t i = 0; i < n; ++i) want[i] = 3.0 * A[i];
    CHECK(max_error(a, want) <= 1e-6);
    add(a, a, a);
    for (int64_t i = 0; i < n; ++i) want[i] *= 2.0;
    CHECK(max_error(a, want) <= 1e-6);
  }
}

// alpha = 0.75 has two significant bits, so alpha * float(x) is exact in f32 for a 16-bit x
// (8 or 11 bits): the sum is one f32 rounding on every backend, fused or not.
TEST_CASE("kernels.axpy: a bf16 or f16 x adds into an f32 y (odd sizes)") {
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{100003}}) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(n);
      Tensor y = random_tensor({n}, 3), x = cast(random_tensor({n}, 4, -8.f, 8.f), t);
      std::vector<float> before = y.to_host_f32(), widened = x.to_host_f32(), want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = before[i] + 0.75f * widened[i];
      axpy(y, 0.75f, x);
      CHECK(y.to_host_f32() == want);
    }
  Tensor y16 = zeros({4}, DType::bf16), x16 = zeros({4}, DType::bf16);
  CHECK_THROWS_WITH_AS(axpy(y16, 1.f, x16), doctest::Contains("axpy: y must be f32"), Error);
  Tensor y = zeros({4}), xi = zeros({4}, DType::i32);
  CHECK_THROWS_WITH_AS(axpy(y, 1.f, xi), doctest::Contains("x must be f32, f16 or bf16"), Error);
}

TEST_CASE("kernels.bias: add_bias and bias_backward over (N, C) and (N, C, H, W)") {
  for (Shape shape : {Shape{7, 5}, Shape{3, 4, 5, 7}, Shape{2, 3, 1}}) {
    int64_t channels = shape[1], inner = shape_numel(shape) / (shape[0] * channels);
    Tensor y = random_tensor(shape, 3), bias = random_tensor({channels}, 4);
    std::vector<double> Y = to_double(y), Bv = to_double(bias), want = Y;
    for (size_t i = 0; i < want.size(); ++i) want[i] += Bv[(i / inner) % channels];
    add_bias(y, bias);
    CHECK(max_error(y, want) <= 1e-6);

    Tensor dy = random_tensor(shape, 5), db = filled({channels}, 100.f);
    std::vector<double> DY = to_double(dy), sums(channels, 0.0);
    for (size_t i = 0; i < DY.size(); ++i) sums[(i / inner) % channels] += DY[i];
    bias_backward(db, dy, Accumulate::no);
    CHECK(max_error(db, sums) <= 1e-5);
    bias_backward(db, dy, Accumulate::yes);
    for (double& s : sums) s *= 2.0;
    CHECK(max_error(db, sums) <= 1e-5);
  }
  // An empty batch adds nothing: db is zeroed when overwriting, kept when accumulating.
  Tensor dy = zeros({0, 3}), db = filled({3}, 7.f);
  bias_backward(db, dy, Accumulate::yes);
  CHECK(db.to_host_f32() == std::vector<float>{7.f, 7.f, 7.f});
  bias_backward(db, dy, Accumulate::no);
  CHECK(db.to_host_f32() == std::vector<float>{0.f, 0.f, 0.f});
}

TEST_CASE("kernels.gemm: transposes, alpha/beta, bias (7x13x5)") {
  const int64_t m = 7, k = 13, n = 5;
  for (Transpose ta : {Transpose::no, Transpose::yes})
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      CAPTURE(static_cast<int>(ta));
      CAPTURE(static_cast<int>(tb));
      Tensor a = random_tensor(stored(m, k, ta), 10), b = random_tensor(stored(k, n, tb), 11);
      Tensor bias = random_tensor({n}, 12), c = random_tensor({m, n}, 13);
      std::vector<double> want = ref_gemm(a, ta, b, tb, 1.5f, 0.5f, c, bias);
      gemm(c, a, ta, b, tb, 1.5f, 0.5f, bias);
      CHECK(max_error(c, want) <= 1e-5);
      // Defaults: c = op(a) op(b), whatever c held before.
      Tensor d = filled({m, n}, NAN);
      gemm(d, a, ta, b, tb);
      CHECK(max_error(d, ref_gemm(a, ta, b, tb, 1.f, 0.f, d, Tensor())) <= 1e-5);
    }
}

TEST_CASE("kernels.gemm: tiled parallel path matches the reference and any thread count") {
  // 300 x 600 x 40 spans several tiles of C in both dimensions.
  const int64_t m = 300, k = 40, n = 600;
  for (Transpose ta : {Transpose::no, Transpose::yes}) {
    Transpose tb = ta == Transpose::no ? Transpose::yes : Transpose::no;
    Tensor a = random_tensor(stored(m, k, ta), 20), b = random_tensor(stored(k, n, tb), 21);
    Tensor bias = random_tensor({n}, 22), c = random_tensor({m, n}, 23);
    std::vector<double> want = ref_gemm(a, ta, b, tb, 0.75f, 2.f, c, bias);
    Tensor c1 = c.clone(), c2 = c.clone();
    with_cpu_threads(1, [&] { gemm(c1, a, ta, b, tb, 0.75f, 2.f, bias); });
    with_cpu_threads(2, [&] { gemm(c2, a, ta, b, tb, 0.75f, 2.f, bias); });
    CHECK(max_error(c1, want) <= 1e-5);
    CHECK(bitwise_equal(c1, c2));
  }
}

namespace {

// The number of this process's threads.
int thread_count() {
  return static_cast<int>(std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                                        std::filesystem::directory_iterator()));
}

// thread_count() once it is `want`, or whatever it is after 2 s: a joined thread can stay in
// /proc/self/task for a moment after pthread_join returns (the kernel clears its id, which wakes
// the join, before it reaps the thread).
int thread_count_settled_at(int want) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int n = thread_count();
  while (n != want && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    n = thread_count();
  }
  return n;
}

}  // namespace

TEST_CASE(
    "kernels.gemm: the first CPU GEMM ends OpenBLAS's idle pool, a threaded call restarts it") {
  // OpenBLAS's pthread build starts openblas_get_num_threads() - 1 pool threads when it loads;
  // kernels::gemm calls it on one thread, so the pool (which spins for about 0.1 s when idle)
  // must be gone after the first GEMM. This case runs in its own process under ctest.
  with_cpu_threads(1, [&] {  // one thread: no TBB worker appears while threads are counted
    const int64_t m = 300, k = 40, n = 600;  // past the skinny path: OpenBLAS's sgemm
    Tensor a = random_tensor({m, k}, 30), b = random_tensor({k, n}, 31);
    Tensor c = filled({m, n}, 0.f), d = filled({m, n}, 0.f);
    const int pool = openblas_get_num_threads() - 1, before = thread_count();
    gemm(c, a, Transpose::no, b, Transpose::no);
    CHECK(openblas_get_num_threads() == 1);
    CHECK(thread_count_settled_at(before - pool) == before - pool);
    // A threaded call afterwards (bench_kernels' OpenBLAS baseline does one) brings the pool
    // back, through OpenBLAS's own re-start after a fork, and computes the same product.
    openblas_set_num_threads(2);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a.data<float>(), k,
                b.data<float>(), n, 0.f, d.data<float>(), n);
    openblas_set_num_threads(1);
    CHECK(max_error(d, ref_gemm(a, Transpose::no, b, Transpose::no, 1.f, 0.f, d, Tensor())) <=
          1e-5);
  });
}

// A run whose products never reach OpenBLAS's sgemm (a replica's few rows take the skinny path;
// bf16 products run on oneDNN) ends the pool at its first product all the same: before, its pool
// thread spun through the run's first 0.1 s (a bf16 CNN's first 15-20 steps at 3.5 ms where the
// rest took 2.1). This case runs in its own process under ctest.
TEST_CASE("kernels.gemm: a skinny or bf16 first product ends OpenBLAS's idle pool too") {
  with_cpu_threads(1, [&] {  // one thread: no TBB worker appears while threads are counted
    const int pool = openblas_get_num_threads() - 1, before = thread_count();
    REQUIRE(pool >= 0);
    if (cpu::bf16_gemm_enabled()) {  // oneDNN's bf16 product first
      Tensor a = cast(random_tensor({64, 48}, 40), DType::bf16);
      Tensor b = cast(random_tensor({48, 80}, 41), DType::bf16);
      Tensor c = filled({64, 80}, 0.f);
      gemm(c, a, Transpose::no, b, Transpose::no);
    } else {  // a replica's two rows: the skinny path
      MESSAGE("no bf16 products on the CPU's instructions here: the skinny path goes first");
      Tensor a = random_tensor({2, 40}, 40), b = random_tensor({40, 600}, 41);
      Tensor c = filled({2, 600}, 0.f);
      gemm(c, a, Transpose::no, b, Transpose::no);
    }
    CHECK(openblas_get_num_threads() == 1);
    CHECK(thread_count_settled_at(before - pool) == before - pool);
  });
}

// OpenBLAS 0.3.21 falls back to its Prescott (SSE3) kernels on CPUs it does not know; the first
// GEMM of a process chooses again from the CPU's instruction sets (kernels::cpu_blas_kernels).
// The fallback is made here through OpenBLAS's own OPENBLAS_CORETYPE path; a choice the user
// forced stays, with a warning. This case runs in its own process under ctest.
TEST_CASE(
    "kernels.blas: GEMM kernels chosen for the CPU that runs, even after a Prescott fallback") {
  CHECK(better_blas_core("Prescott", CpuVectorIsa::avx512, true) == "Cooperlake");
  CHECK(better_blas_core("Prescott", CpuVectorIsa::avx512, false) == "SkylakeX");
  CHECK(better_blas_core("Nehalem", CpuVectorIsa::avx2, false) == "Haswell");
  CHECK(better_blas_core("Haswell", CpuVectorIsa::avx512, false) == "SkylakeX");
  CHECK(better_blas_core("Sandybridge", CpuVectorIsa::avx, false) == "");
  CHECK(better_blas_core("Zen", CpuVectorIsa::avx2, false) == "");
  CHECK(better_blas_core("SkylakeX", CpuVectorIsa::avx512, true) == "");  // as wide as the CPU
  CHECK(better_blas_core("Prescott", CpuVectorIsa::sse, false) == "");
  const CpuVectorIsa isa = cpu_vector_isa();
  if (isa < CpuVectorIsa::avx2) {
    MESSAGE("SKIPPED: this CPU has no AVX2: no OpenBLAS kernel is wider than SSE here");
    return;
  }
  using Switch = void (*)();
  auto quit = reinterpret_cast<Switch>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit"));
  auto init = reinterpret_cast<Switch>(dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init"));
  const bool dynamic = quit && init;
  auto reload = [&](const char* coretype) {  // OpenBLAS chooses again, as when it loads
    if (coretype)
      setenv("OPENBLAS_CORETYPE", coretype, 1);
    else
      unsetenv("OPENBLAS_CORETYPE");
    quit();
    init();
  };
  // The machine's environment may force a core of its own (OPENBLAS_CORETYPE=Haswell on an
  // AVX-512 CPU): a user's choice, kept with a warning (below). What OpenBLAS and the choice
  // make of this CPU is seen without it.
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE")) {
    if (!dynamic) {
      MESSAGE("SKIPPED: OPENBLAS_CORETYPE=" << forced
                                            << " is set and this OpenBLAS cannot choose again");
      return;
    }
    MESSAGE("OPENBLAS_CORETYPE=" << forced << " in the environment: unset for this case");
    reload(nullptr);
    choose_blas_kernels();
  }
  const BlasKernels first = cpu_blas_kernels();
  CHECK_FALSE(first.generic);  // on this CPU, as OpenBLAS or the choice left it
  CHECK(first.warning.empty());
  CHECK(first.library.find("OpenBLAS") != std::string::npos);
  CHECK(library_versions()[0].second.find("(kernels: " + first.core) != std::string::npos);
  if (!dynamic) {
    MESSAGE("SKIPPED: this OpenBLAS is not a DYNAMIC_ARCH build: its kernels are fixed");
    return;
  }
  const int64_t m = 300, k = 40, n = 600;  // past the skinny path: OpenBLAS's sgemm
  Tensor a = random_tensor({m, k}, 32), b = random_tensor({k, n}, 33);
  auto product_ok = [&] {
    Tensor c = filled({m, n}, 0.f);
    gemm(c, a, Transpose::no, b, Transpose::no);
    return max_error(c, ref_gemm(a, Transpose::no, b, Transpose::no, 1.f, 0.f, c, Tensor())) <=
           1e-5;
  };
  // An old OpenBLAS on a CPU it does not know: Prescott, and no OPENBLAS_CORETYPE of the user's.
  reload("Prescott");
  unsetenv("OPENBLAS_CORETYPE");
  REQUIRE(std::string(openblas_get_corename()) == "Prescott");
  choose_blas_kernels();
  BlasKernels k1 = cpu_blas_kernels();
  CHECK(k1.switched_from == "Prescott");
  CHECK(k1.core ==
        better_blas_core("Prescott", isa,
                         isa == CpuVectorIsa::avx512 && __builtin_cpu_supports("avx512bf16")));
  CHECK_FALSE(k1.generic);
  CHECK(k1.warning.empty());
  CHECK(std::getenv("OPENBLAS_CORETYPE") == nullptr);  // set for the choice only
  CHECK(library_versions()[0].second.find("chosen for this CPU over Prescott") !=
        std::string::npos);
  CHECK(product_ok());
  // The user forced Prescott: it stays, and the warning says what to do.
  reload("Prescott");
  choose_blas_kernels();
  BlasKernels k2 = cpu_blas_kernels();
  CHECK(k2.core == "Prescott");
  CHECK(k2.generic);
  CHECK(k2.switched_from.empty());
  CHECK(k2.warning.find("OpenBLAS runs its Prescott kernels (SSE) on a CPU with AVX") == 0);
  CHECK(k2.warning.find("OPENBLAS_CORETYPE=Prescott chose them: unset it, or set it to ") !=
        std::string::npos);
  CHECK(product_ok());
  reload(nullptr);
  choose_blas_kernels();
  CHECK_FALSE(cpu_blas_kernels().generic);
}

TEST_CASE("kernels.gemm: skinny products (1 to 8 rows) match the reference, row by row alike") {
  // A replica's few rows through a weight matrix, forward (x W^T) and backward (dy W): read in
  // place, not packed. k = 45 has full 16-wide blocks and a tail; n = 37 full lane tiles and a
  // tail. Each row must have the same bits alone as among others, on any thread count.
  const int64_t k = 45, n = 37;
  for (Transpose tb : {Transpose::yes, Transpose::no})
    for (int64_t m = 1; m <= 8; ++m) {
      CAPTURE(static_cast<int>(tb));
      CAPTURE(m);
      Tensor a = random_tensor({m, k}, 30 + m), b = random_tensor(stored(k, n, tb), 31);
      Tensor bias = random_tensor({n}, 32), c = random_tensor({m, n}, 33);
      std::vector<double> want = ref_gemm(a, Transpose::no, b, tb, 1.25f, -0.5f, c, bias);
      Tensor c1 = c.clone();
      gemm(c1, a, Transpose::no, b, tb, 1.25f, -0.5f, bias);
      CHECK(max_error(c1, want) <= 1e-5);
      Tensor d = filled({m, n}, NAN);  // beta 0 never reads c
      gemm(d, a, Transpose::no, b, tb);
      CHECK(max_error(d, ref_gemm(a, Transpose::no, b, tb, 1.f, 0.f, d, Tensor())) <= 1e-5);
      for (int64_t i = 0; i < m; ++i) {
        Tensor row = a.view(i * k, {1, k}).clone(), alone = filled({1, n}, NAN);
        gemm(alone, row, Transpose::no, b, tb);
        CHECK(bitwise_equal(alone, d.view(i * n, {1, n}).clone()));
      }
    }
  // Large enough to be split by columns over the arena's threads.
  const int64_t m = 6, wide_k = 333, wide_n = 2100;
  for (Transpose tb : {Transpose::yes, Transpose::no}) {
    Tensor a = random_tensor({m, wide_k}, 40), b = random_tensor(stored(wide_k, wide_n, tb), 41);
    Tensor c = random_tensor({m, wide_n}, 42);
    std::vector<double> want = ref_gemm(a, Transpose::no, b, tb, 1.f, 1.f, c, Tensor());
    Tensor c1 = c.clone(), c2 = c.clone();
    with_cpu_threads(1, [&] { gemm(c1, a, Transpose::no, b, tb, 1.f, 1.f); });
    with_cpu_threads(2, [&] { gemm(c2, a, Transpose::no, b, tb, 1.f, 1.f); });
    CHECK(max_error(c1, want) <= 1e-4);
    CHECK(bitwise_equal(c1, c2));
  }
}

TEST_CASE("kernels.gemm: concurrent CPU devices (one thread each) agree bit for bit") {
  // Each replica thread owns a context on its own CPU device; their single-threaded sgemm
  // calls run at the same time and must give the same bits as a lone call.
  const int64_t m = 256, k = 192, n = 320;
  Tensor a = random_tensor({m, k}, 24), b = random_tensor({k, n}, 25);
  Tensor alone = zeros({m, n});
  gemm(alone, a, Transpose::no, b, Transpose::no);
  std::vector<Tensor> outs;
  for (int d = 0; d < 3; ++d) outs.push_back(Tensor::zeros({m, n}, DType::f32, Device::cpu(d)));
  std::vector<std::thread> replicas;
  std::vector<std::exception_ptr> errors(outs.size());
  for (size_t d = 0; d < outs.size(); ++d)
    replicas.emplace_back([&, d] {
      try {
        DeviceContext ctx(Device::cpu(static_cast<int>(d)));
        ContextScope scope(ctx);
        Tensor ad = a.to(Device::cpu(static_cast<int>(d)));
        Tensor bd = b.to(Device::cpu(static_cast<int>(d)));
        for (int rep = 0; rep < 5; ++rep) gemm(outs[d], ad, Transpose::no, bd, Transpose::no);
      } catch (...) {
        errors[d] = std::current_exception();
      }
    });
  for (auto& t : replicas) t.join();
  for (size_t d = 0; d < outs.size(); ++d) {
    CHECK(!errors[d]);
    CHECK(bitwise_equal(outs[d], alone));
  }
}

TEST_CASE("kernels.gemm: f16 and bf16 operands accumulate in f32") {
  const int64_t m = 9, k = 31, n = 6;
  for (DType dt : {DType::f16, DType::bf16}) {
    CAPTURE(dt);
    Tensor a = cast(random_tensor({m, k}, 30), dt), b = cast(random_tensor({n, k}, 31), dt);
    Tensor c32 = zeros({m, n});
    // The reference uses the rounded 16-bit inputs, so only the product's rounding differs.
    std::vector<double> want =
        ref_gemm(a, Transpose::no, b, Transpose::yes, 1.f, 0.f, c32, Tensor());
    gemm(c32, a, Transpose::no, b, Transpose::yes);
    CHECK(max_error(c32, want) <= 1e-5);
    Tensor c16 = Tensor::zeros({m, n}, dt, Device::cpu());
    kernels::fill(c16, 1.f);
    Tensor bias = random_tensor({n}, 32);
    want = ref_gemm(a, Transpose::no, b, Transpose::yes, 1.f, 1.f, c16, bias);
    gemm(c16, a, Transpose::no, b, Transpose::yes, 1.f, 1.f, bias);
    CHECK(max_error(c16, want) <= (dt == DType::bf16 ? 8e-3 : 1e-3));
    // A bias in c's 16-bit dtype is widened and added in f32 before the one rounding: the same
    // bits as its f32 widening given as the bias.
    Tensor bias16 = cast(bias, dt);
    Tensor got = Tensor::zeros({m, n}, dt, Device::cpu()), ref = got.clone();
    kernels::fill(got, 1.f);
    kernels::fill(ref, 1.f);
    gemm(got, a, Transpose::no, b, Transpose::yes, 1.f, 1.f, bias16);
    gemm(ref, a, Transpose::no, b, Transpose::yes, 1.f, 1.f, cast(bias16, DType::f32));
    CHECK(got.to_host_f32() == ref.to_host_f32());
    // A 16-bit bias with an f32 c, or of the other 16-bit dtype, is refused by name.
    const DType other = dt == DType::bf16 ? DType::f16 : DType::bf16;
    CHECK_THROWS_WITH(gemm(c32, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, bias16),
                      doctest::Contains("gemm: bias must be f32 or c's dtype f32"));
    CHECK_THROWS_WITH(gemm(got, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, cast(bias, other)),
                      doctest::Contains("bias must be f32 or c's dtype"));
  }
}

// bf16 x bf16 products run on the CPU's bf16 instructions (oneDNN's matmul, one tile per call on
// the arena's threads) where the build has oneDNN and the CPU AVX512_BF16; elsewhere they widen
// to f32. Either way: the double loop over the rounded inputs, every transpose, alpha, beta, bias,
// skinny and tiled shapes, f32 and bf16 outputs, and the same bits on any thread count.
TEST_CASE("kernels.gemm: bf16 x bf16 on the CPU's bf16 instructions match the double loop") {
  bool built_with_onednn = false;
  for (auto& [name, version] : library_versions()) built_with_onednn |= name == "onednn";
  __builtin_cpu_init();
  const BlasKernels k = cpu_blas_kernels();
  if (built_with_onednn && __builtin_cpu_supports("avx512bf16")) {
    CHECK(k.bf16.find("oneDNN") == 0);
    CHECK(k.bf16.find("bf16 kernels: ") != std::string::npos);
    CHECK(k.bf16.find("ref") == std::string::npos);
  } else {
    MESSAGE("bf16 GEMMs widen to f32 here: "
            << (built_with_onednn ? "this CPU has no AVX512_BF16" : "built without oneDNN")
            << "; the products are still checked");
    CHECK(k.bf16.empty());
  }
  struct Case {
    int64_t m, k, n;
  };
  for (Case sz : {Case{7, 13, 5}, Case{1, 300, 40}, Case{3, 64, 257}, Case{8, 96, 130},
                  Case{33, 129, 65}, Case{300, 40, 600}}) {
    for (Transpose ta : {Transpose::no, Transpose::yes})
      for (Transpose tb : {Transpose::no, Transpose::yes})
        for (DType out : {DType::f32, DType::bf16}) {
          CAPTURE(sz.m);
          CAPTURE(sz.k);
          CAPTURE(sz.n);
          CAPTURE(static_cast<int>(ta));
          CAPTURE(static_cast<int>(tb));
          CAPTURE(out);
          Tensor a = cast(random_tensor(stored(sz.m, sz.k, ta), 40), DType::bf16);
          Tensor b = cast(random_tensor(stored(sz.k, sz.n, tb), 41), DType::bf16);
          Tensor bias = random_tensor({sz.n}, 42);
          Tensor c = cast(random_tensor({sz.m, sz.n}, 43), out);
          // Only the f32 sums' rounding (and a bf16 output's one rounding) differ from the loop.
          const double bound = (out == DType::bf16 ? 8e-3 : 0.0) + 1e-6 * static_cast<double>(sz.k);
          std::vector<double> want = ref_gemm(a, ta, b, tb, 1.5f, 0.5f, c, bias);
          Tensor c1 = c.clone(), c2 = c.clone();
          with_cpu_threads(1, [&] { gemm(c1, a, ta, b, tb, 1.5f, 0.5f, bias); });
          with_cpu_threads(2, [&] { gemm(c2, a, ta, b, tb, 1.5f, 0.5f, bias); });
          CHECK(max_error(c1, want) <= bound);
          CHECK(bitwise_equal(c1, c2));
          // beta 0 ignores what c held, NaN included.
          Tensor d = cast(filled({sz.m, sz.n}, NAN), out);
          gemm(d, a, ta, b, tb);
          CHECK(max_error(d, ref_gemm(a, ta, b, tb, 1.f, 0.f, d, Tensor())) <= bound);
          // The widening path agrees to the same bound.
          Tensor w = c.clone();
          set_cpu_bf16_gemm(false);
          gemm(w, a, ta, b, tb, 1.5f, 0.5f, bias);
          set_cpu_bf16_gemm(true);
          CHECK(max_error(w, to_double(c1)) <= 2 * bound);
        }
  }
  set_cpu_bf16_gemm(false);
  CHECK(cpu_blas_kernels().bf16.empty());
  set_cpu_bf16_gemm(true);
}

TEST_CASE("kernels.gemm: empty products") {
  // k == 0: c = beta c + bias; beta == 0 ignores what c held (NaN included).
  Tensor a = zeros({3, 0}), b = zeros({0, 2}), bias = tensor({1.f, -1.f}, {2});
  Tensor c = filled({3, 2}, 4.f);
  gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.5f, bias);
  CHECK(c.to_host_f32() == std::vector<float>{3.f, 1.f, 3.f, 1.f, 3.f, 1.f});
  Tensor d = filled({3, 2}, NAN);
  gemm(d, a, Transpose::no, b, Transpose::no);
  CHECK(d.to_host_f32() == std::vector<float>(6, 0.f));
  // m == 0 (an empty batch): nothing to do, no error.
  Tensor e = zeros({0, 4});
  gemm(e, zeros({0, 5}), Transpose::no, random_tensor({4, 5}, 1), Transpose::yes);
  CHECK(e.numel() == 0);
}

TEST_CASE("kernels.gemm: alpha 0 reads neither a nor b, on every path (BLAS's rule)") {
  // A NaN in a once reached c through the 1-row path (0 * NaN) but not through OpenBLAS. Rows 1
  // and 4 take the skinny kernels, 40 the tiled BLAS one; f32 and bf16 operands.
  for (int64_t m : {1, 4, 40}) {
    for (DType t : {DType::f32, DType::bf16}) {
      CAPTURE(m);
      CAPTURE(t);
      Tensor a = filled({m, 6}, NAN), b = random_tensor({6, 5}, 3);
      if (t == DType::bf16) {
        a = cast(a, DType::bf16);
        b = cast(b, DType::bf16);
      }
      Tensor c = filled({m, 5}, 4.f), bias = tensor({1.f, 2.f, 3.f, 4.f, 5.f}, {5});
      gemm(c, a, Transpose::no, b, Transpose::no, 0.f, 0.5f, bias);
      std::vector<float> want;
      for (int64_t i = 0; i < m; ++i)
        for (float v : {3.f, 4.f, 5.f, 6.f, 7.f}) want.push_back(v);
      CHECK(c.to_host_f32() == want);
      Tensor d = filled({m, 5}, NAN);  // beta 0: what c held is not read either
      gemm(d, a, Transpose::no, b, Transpose::no, 0.f, 0.f);
      CHECK(d.to_host_f32() == std::vector<float>(static_cast<size_t>(m * 5), 0.f));
    }
  }
}

TEST_CASE("kernels.gemm_gelu: the fused Linear ops are the ops' bits on the CPU") {
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.dtype() == b.dtype() && a.shape() == b.shape() &&
           std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  for (const gemm_gelu::Case& c : gemm_gelu::cases()) {
    CAPTURE(dtype_name(c.t));
    CAPTURE(c.m);
    CAPTURE(c.bias);
    CAPTURE(c.acc == Accumulate::yes);
    const gemm_gelu::Outputs f = gemm_gelu::run(c, Device::cpu(), true);
    const gemm_gelu::Outputs r = gemm_gelu::run(c, Device::cpu(), false);
    CHECK(same(f.pre, r.pre));
    CHECK(same(f.y, r.y));
    CHECK(same(f.dpre, r.dpre));
    CHECK(same(f.dbias, r.dbias));
    for (bool f32_bias_dy : {false, true}) {
      auto [dw, db] = gemm_gelu::param_grads(c, Device::cpu(), true, f32_bias_dy);
      auto [dw_ops, db_ops] = gemm_gelu::param_grads(c, Device::cpu(), false, f32_bias_dy);
      CHECK(same(dw, dw_ops));
      CHECK(same(db, db_ops));
    }
  }
  // Shapes and dtypes are checked, naming the operand.
  Tensor x = random_tensor({4, 3}, 1), w = random_tensor({5, 3}, 2);
  Tensor y = zeros({4, 5}), pre = zeros({4, 6});
  CHECK_THROWS_WITH_AS(gemm_gelu_tanh(y, pre, x, Transpose::no, w, Transpose::yes, Tensor()),
                       doctest::Contains("gemm_gelu_tanh: c must be [4, 5]"), Error);
  Tensor pre5 = zeros({4, 5}), y16 = Tensor::zeros({4, 5}, DType::bf16, Device::cpu());
  CHECK_THROWS_WITH_AS(gemm_gelu_tanh(y16, pre5, x, Transpose::no, w, Transpose::yes, Tensor()),
                       doctest::Contains("y must be f32"), Error);
  Tensor dbias = zeros({6}), dy = random_tensor({4, 2}, 3), w2 = random_tensor({2, 5}, 4);
  CHECK_THROWS_WITH_AS(
      gemm_gelu_tanh_backward(pre5, dbias, Accumulate::no, dy, Transpose::no, w2, Transpose::no, y),
      doctest::Contains("dbias must be [5], got [6]"), Error);
  Tensor dw = zeros({2, 5}), db2 = zeros({2});
  CHECK_THROWS_WITH_AS(
      linear_param_grads(dw, db2, dy, pre5, random_tensor({4, 3}, 5)),
      doctest::Contains("linear_param_grads: shapes differ: dy [4, 2] vs dy_for_bias [4, 3]"),
      Error);
  // One buffer for two of the fused ops' operands: the GPU's epilogue writes y and pre at once,
  // and the backward's product overwrites pre before the derivative reads it.
  CHECK_THROWS_WITH_AS(gemm_gelu_tanh(pre5, pre5, x, Transpose::no, w, Transpose::yes, Tensor()),
                       doctest::Contains("gemm_gelu_tanh: y and pre share memory"), Error);
  Tensor both = zeros({9, 5}), top = both.slice(0, 4), overlapping = both.slice(3, 7);
  CHECK_THROWS_WITH_AS(
      gemm_gelu_tanh(overlapping, top, x, Transpose::no, w, Transpose::yes, Tensor()),
      doctest::Contains("y and pre share memory"), Error);
  Tensor bottom = both.slice(4, 8);  // the same storage, apart: taken
  gemm_gelu_tanh(bottom, top, x, Transpose::no, w, Transpose::yes, Tensor());
  Tensor pre_ops = zeros({4, 5}), y_ops = zeros({4, 5});
  gemm(pre_ops, x, Transpose::no, w, Transpose::yes);
  gelu_tanh(y_ops, pre_ops);
  CHECK(same(top, pre_ops));
  CHECK(same(bottom, y_ops));
  CHECK_THROWS_WITH_AS(gemm_gelu_tanh_backward(pre5, dbias, Accumulate::no, dy, Transpose::no, w2,
                                               Transpose::no, pre5),
                       doctest::Contains("gemm_gelu_tanh_backward: dpre and pre share memory"),
                       Error);
}

TEST_CASE("kernels.gemm_gelu: a Linear of no input features still sums its bias gradient") {
  // dw (out, 0) holds nothing, but dbias += the column sums of dy as for any Linear.
  Tensor dw = zeros({2, 0}), x = zeros({4, 0}), dy = random_tensor({4, 2}, 6);
  Tensor dbias = tensor({1.f, -1.f}, {2}), want = dbias.clone();
  bias_backward(want, dy, Accumulate::yes);
  linear_param_grads(dw, dbias, dy, x, dy);
  CHECK(dbias.to_host_f32() == want.to_host_f32());
  CHECK(dbias.to_host_f32() != std::vector<float>{1.f, -1.f});
}

TEST_CASE("kernels.relu: forward, backward, accumulate") {
  Tensor x = tensor({-2.f, -0.f, 0.f, 0.5f, 3.f, -1e-30f, 1e-30f}, {7});
  Tensor y = zeros({7});
  relu(y, x);
  CHECK(y.to_host_f32() == std::vector<float>{0.f, 0.f, 0.f, 0.5f, 3.f, 0.f, 1e-30f});
  Tensor dy = tensor({1, 2, 3, 4, 5, 6, 7}, {7}), dx = filled({7}, 10.f);
  relu_backward(dx, dy, x, Accumulate::no);
  CHECK(dx.to_host_f32() == std::vector<float>{0, 0, 0, 4, 5, 0, 7});
  relu_backward(dx, dy, x, Accumulate::yes);
  CHECK(dx.to_host_f32() == std::vector<float>{0, 0, 0, 8, 10, 0, 14});
  // NaN stays NaN, as torch.relu keeps it (it was 0: a NaN input gave a finite loss while its
  // gradient made the weights NaN); its gradient is 0, as torch's. The composed op too.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Tensor xn = tensor({nan, -1.f, 2.f, inf, -inf}, {5}), yn = zeros({5}), yu = zeros({5});
  relu(yn, xn);
  kernels::unary(yu, xn, kernels::UnaryOp::relu);
  for (const Tensor& out : {yn, yu}) {
    const std::vector<float> v = out.to_host_f32();
    CHECK(std::isnan(v[0]));
    CHECK(std::vector<float>(v.begin() + 1, v.end()) == std::vector<float>{0.f, 2.f, inf, 0.f});
  }
  Tensor dn = zeros({5});
  relu_backward(dn, filled({5}, 1.f), xn, Accumulate::no);
  CHECK(dn.to_host_f32() == std::vector<float>{0, 0, 1, 1, 0});
}

TEST_CASE("kernels.gelu: exact erf form, gradient matches finite differences") {
  const int64_t n = 41;
  Tensor x = random_tensor({n}, 40, -4.f, 4.f), y = zeros({n});
  std::vector<double> X = to_double(x), want(n);
  auto gelu_ref = [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); };
  for (int64_t i = 0; i < n; ++i) want[i] = gelu_ref(X[i]);
  gelu(y, x);
  CHECK(max_error(y, want) <= 1e-6);
  CHECK(gelu_ref(1.0) == doctest::Approx(0.8413447460685429));  // the erf form, not tanh's

  Tensor dy = random_tensor({n}, 41), dx = filled({n}, 1.f);
  std::vector<double> DY = to_double(dy);
  auto loss = [&](const std::vector<double>& v) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += DY[i] * gelu_ref(v[i]);
    return s;
  };
  std::vector<double> grad = numeric_gradient(loss, X);
  gelu_backward(dx, dy, x, Accumulate::no);
  CHECK(max_error(dx, grad) <= 1e-5);
  gelu_backward(dx, dy, x, Accumulate::yes);
  for (double& g : grad) g *= 2.0;
  CHECK(max_error(dx, grad) <= 1e-5);
}

TEST_CASE("kernels.tanh: forward, backward from the output") {
  const int64_t n = 29;
  Tensor x = random_tensor({n}, 50, -3.f, 3.f), y = zeros({n});
  std::vector<double> X = to_double(x), want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = std::tanh(X[i]);
  kernels::tanh(y, x);
  CHECK(max_error(y, want) <= 1e-6);
  Tensor dy = random_tensor({n}, 51), dx = zeros({n});
  std::vector<double> DY = to_double(dy);
  std::vector<double> grad = numeric_gradient(
      [&](const std::vector<double>& v) {
        double s = 0.0;
        for (int64_t i = 0; i < n; ++i) s += DY[i] * std::tanh(v[i]);
        return s;
      },
      X);
  tanh_backward(dx, dy, y, Accumulate::no);
  CHECK(max_error(dx, grad) <= 1e-5);
  tanh_backward(dx, dy, y, Accumulate::yes);
  for (double& g : grad) g *= 2.0;
  CHECK(max_error(dx, grad) <= 1e-5);
}

TEST_CASE("kernels.empty: zero-sized tensors are valid no-ops") {
  Tensor e = zeros({0, 3}), f = zeros({0, 3});
  add(e, f, f);
  mul(e, f, f);
  scale(e, f, 2.f);
  axpy(e, 2.f, f);
  add_bias(e, zeros({3}));
  relu(e, f);
  gelu(e, f);
  kernels::tanh(e, f);
  relu_backward(e, f, f, Accumulate::no);
  gelu_backward(e, f, f, Accumulate::yes);
  tanh_backward(e, f, f, Accumulate::no);
  fill(e, 0.f);  // nothing to write: no memset of a null pointer (DP_ASAN checks it)
  fill(e, 1.f);
  CHECK(e.to_host_f32().empty());
  CHECK(e.numel() == 0);
}

TEST_CASE("kernels.errors: mismatched shapes name the shapes") {
  Tensor a = zeros({2, 3}), b = zeros({3, 2}), y = zeros({2, 3});
  CHECK_THROWS_WITH_AS(add(y, a, b), doctest::Contains("add: shapes differ: a [2, 3] vs b [3, 2]"),
                       Error);
  CHECK_THROWS_WITH_AS(mul(b, a, a), doctest::Contains("[3, 2]"), Error);
  CHECK_THROWS_WITH_AS(axpy(y, 1.f, b), doctest::Contains("[2, 3]"), Error);
  CHECK_THROWS_WITH_AS(relu_backward(y, y, b, Accumulate::no), doctest::Contains("[3, 2]"), Error);
  CHECK_THROWS_WITH_AS(add_bias(y, zeros({2})), doctest::Contains("bias must be [3], got [2]"),
                       Error);
  Tensor flat = zeros({4});
  CHECK_THROWS_WITH_AS(add_bias(flat, zeros({4})), doctest::Contains("[4]"), Error);
  Tensor c = zeros({2, 2});
  CHECK_THROWS_WITH_AS(gemm(c, a, Transpose::no, a, Transpose::no),
                       doctest::Contains("inner dimensions differ: op(a) [2, 3] x op(b) [2, 3]"),
                       Error);
  CHECK_THROWS_WITH_AS(gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.f, zeros({3})),
                       doctest::Contains("bias must be [2], got [3]"), Error);
  CHECK_THROWS_WITH_AS(gemm(y, a, Transpose::no, b, Transpose::no),
                       doctest::Contains("c must be [2, 2]"), Error);
  CHECK_THROWS_WITH_AS(gemm(c, zeros({6}), Transpose::no, b, Transpose::no),
                       doctest::Contains("2-D, got [6]"), Error);
}

TEST_CASE("kernels.errors: wrong dtypes and devices") {
  Tensor a = zeros({2, 3}), y = zeros({2, 3});
  Tensor h = zeros({2, 3}, DType::f16), i = zeros({2, 3}, DType::i32);
  CHECK_NOTHROW(add(y, a, h));  // a 16-bit b is read as f32 (16-bit activations)
  Tensor b16 = zeros({2, 3}, DType::bf16);
  CHECK_THROWS_WITH_AS(add(b16, a, h),
                       doctest::Contains("add: y Tensor(bf16, cpu:0, [2, 3]) and b Tensor(f16"),
                       Error);
  CHECK_THROWS_WITH_AS(relu(b16, h), doctest::Contains("mix f16 and bf16"), Error);
  CHECK_THROWS_WITH_AS(sigmoid(b16, b16), doctest::Contains("y must be f32, got"), Error);
  CHECK_THROWS_WITH_AS(add(y, a, i), doctest::Contains("i32"), Error);
  CHECK_THROWS_WITH_AS(relu(i, a), doctest::Contains("i32"), Error);
  Tensor c = zeros({2, 2});
  CHECK_THROWS_WITH_AS(gemm(c, a, Transpose::no, h, Transpose::yes), doctest::Contains("one dtype"),
                       Error);
  Tensor c_bf16 = zeros({2, 2}, DType::bf16);
  CHECK_THROWS_WITH_AS(gemm(c_bf16, h, Transpose::no, h, Transpose::yes),
                       doctest::Contains("c must be f32 or f16"), Error);

  Tensor other = Tensor::zeros({2, 3}, DType::f32, Device::cpu(1));
  CHECK_THROWS_WITH_AS(add(y, a, other), doctest::Contains("different devices"), Error);
  CHECK_THROWS_WITH_AS(add(y, a, other), doctest::Contains("Tensor(f32, cpu:1, [2, 3])"), Error);
  CHECK_THROWS_WITH_AS(
      gemm(c, a, Transpose::no, other, Transpose::yes),
      doctest::Contains("c Tensor(f32, cpu:0, [2, 2]) vs b Tensor(f32, cpu:1, [2, 3])"), Error);
  CHECK_THROWS_WITH_AS(scale(y, Tensor(), 1.f), doctest::Contains("scale: tensor 'x' is undefined"),
                       Error);
  // Ops on cpu:1 alone run on cpu:1's own context.
  Tensor o2 = Tensor::zeros({2, 3}, DType::f32, Device::cpu(1));
  kernels::fill(other, 1.f);
  add(o2, other, other);
  CHECK(o2.to_host_f32() == std::vector<float>(6, 2.f));
}

// Written while read: gemm's c = a a gave 7 22 33 742 for 7 10 15 22, and weighted_sum with y
// among its sources read y scaled. Both are refused; disjoint views of one buffer are not.
TEST_CASE("kernels.errors: an output sharing memory with gemm's or weighted_sum's inputs") {
  Tensor a = Tensor::from_vector({1.f, 2.f, 3.f, 4.f}, {2, 2});
  CHECK(dp_test::error_of([&] {
          gemm(a, a, Transpose::no, a, Transpose::no);
        }).find("gemm: c and a share memory") != std::string::npos);
  Tensor both = Tensor::zeros({8}, DType::f32, Device::cpu());
  Tensor lo = both.view(0, {2, 2}), hi = both.view(4, {2, 2});
  CHECK(dp_test::error_of([&] {
          gemm(hi, a, Transpose::no, hi, Transpose::no);
        }).find("gemm: c and b share memory") != std::string::npos);
  kernels::copy(lo, a);
  gemm(hi, lo, Transpose::no, lo, Transpose::no);
  CHECK(hi.to_host_f32() == std::vector<float>{7.f, 10.f, 15.f, 22.f});
  Tensor y = Tensor::from_vector({1.f, 2.f, 3.f}, {3});
  CHECK(dp_test::error_of([&] {
          weighted_sum(y, 1.f, {y, y}, {1.f, 2.f});
        }).find("weighted_sum: y and a source share memory") != std::string::npos);
  CHECK(y.to_host_f32() == std::vector<float>{1.f, 2.f, 3.f});
}

TEST_CASE("kernels.weighted_sum: y = w0 y + sum w_k x_k against double, f32 and bf16 sources") {
  for (DType t : {DType::f32, DType::bf16})
    for (int n_src : {0, 1, 3, 17}) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(n_src);
      const int64_t n = 100003;
      Tensor y = random_tensor({n}, 7);
      std::vector<Tensor> xs;
      std::vector<kernels::Scalar> w;
      for (int k = 0; k < n_src; ++k) {
        xs.push_back(cast(random_tensor({n}, 10 + k, -4.f, 4.f), t));
        w.push_back(0.125f * static_cast<float>(k + 1));
      }
      std::vector<double> want = to_double(y);
      for (double& v : want) v *= 0.3;
      for (int k = 0; k < n_src; ++k) {
        std::vector<double> xk = to_double(xs[k]);
        for (int64_t i = 0; i < n; ++i) want[i] += w[k].value * xk[i];
      }
      weighted_sum(y, 0.3f, xs, w);
      // One f32 rounding per term, of terms below 4 * sum(w) + 1 in size.
      CHECK(max_error(y, want) <= (n_src + 1) * 6e-7 * (1 + 4 * 0.125 * 17 * 18 / 2));
    }
  Tensor y = zeros({4}), a = zeros({4}), short_x = zeros({3});
  CHECK_THROWS_WITH_AS(weighted_sum(y, 1.f, {a}, {}), doctest::Contains("1 sources but 0 weights"),
                       Error);
  CHECK_THROWS_WITH_AS(weighted_sum(y, 1.f, {short_x}, {1.f}), doctest::Contains("differ in size"),
                       Error);
  Tensor mixed = zeros({4}, DType::bf16);
  CHECK_THROWS_WITH_AS(weighted_sum(y, 1.f, {a, mixed}, {1.f, 1.f}),
                       doctest::Contains("must all be f32 or all bf16"), Error);
}

TEST_CASE(
    "kernels.scalar: device scalars and offsets give fixed ones' bits, captures replay new "
    "values") {
  DeviceContext ctx(Device::cpu(0), {.cpu_threads = 2, .caching = Caching::on});
  ContextScope scope(ctx);
  dp_test::check_device_scalars(ctx);
}

TEST_CASE("kernels.count_correct_into: the count on the device equals count_correct") {
  Tensor x = random_tensor({37, 5}, 21);
  std::vector<int32_t> l(37);
  for (int i = 0; i < 37; ++i) l[i] = i % 5;
  Tensor labels = Tensor::from_ints(l, {37});
  Tensor out = zeros({1});
  count_correct_into(out, x, labels);
  CHECK(out.item() == static_cast<float>(count_correct(x, labels)));
  Tensor wrong = zeros({2});
  CHECK_THROWS_WITH_AS(count_correct_into(wrong, x, labels), doctest::Contains("out"), Error);
}

// 16-bit activations: each op on bf16/f16 tensors is the f32 op on the same (widened) values,
// rounded once into the 16-bit output, accumulation included.
TEST_CASE(
    "kernels.activations16: relu, gelu, pooling, dropout, bias on 16-bit tensors round once") {
  const Device cpu = Device::cpu(0);
  for (DType t : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(t));
    const Shape s{2, 3, 4, 4};
    // 16-bit inputs and their exact f32 values
    Tensor x16 = cast(Tensor::from_vector(dp_test::random_vector(96, 41, -2.f, 2.f), s), t);
    Tensor x = cast(x16, DType::f32);
    auto rounded = [&](const Tensor& f32) { return cast(cast(f32, t), DType::f32).to_host_f32(); };
    auto host = [](const Tensor& v) { return cast(v, DType::f32).to_host_f32(); };

    Tensor y16 = Tensor::empty(s, t, cpu), y = Tensor::empty(s, DType::f32, cpu);
    relu(y16, x16);
    relu(y, x);
    CHECK(host(y16) == rounded(y));
    gelu(y16, x16);
    gelu(y, x);
    CHECK(host(y16) == rounded(y));
    // backward with accumulation into a 16-bit dx: widened, accumulated in f32, rounded once
    Tensor dy16 = cast(Tensor::from_vector(dp_test::random_vector(96, 42, -1.f, 1.f), s), t);
    Tensor dx16 = cast(Tensor::from_vector(dp_test::random_vector(96, 43, -1.f, 1.f), s), t);
    Tensor dx = cast(dx16, DType::f32);
    gelu_backward(dx16, dy16, x16, Accumulate::yes);
    gelu_backward(dx, cast(dy16, DType::f32), x, Accumulate::yes);
    CHECK(host(dx16) == rounded(dx));

    Pool2dParams p;
    p.kernel_h = p.kernel_w = p.stride_h = p.stride_w = 2;
    Tensor m16 = Tensor::empty({2, 3, 2, 2}, t, cpu),
           m = Tensor::empty({2, 3, 2, 2}, DType::f32, cpu);
    max_pool2d_forward(m16, x16, p);
    max_pool2d_forward(m, x, p);
    CHECK(host(m16) == host(m));  // a maximum of 16-bit values is one of them: exact
    avg_pool2d_forward(m16, x16, p);
    avg_pool2d_forward(m, x, p);
    CHECK(host(m16) == rounded(m));

    Tensor bias = Tensor::from_vector({0.1f, -0.2f, 0.3f}, {3});
    Tensor b16 = cast(x16, t);
    add_bias(b16, bias);
    Tensor b = cast(x16, DType::f32);
    add_bias(b, bias);
    CHECK(host(b16) == rounded(b));
    Tensor db = Tensor::zeros({3}, DType::f32, cpu), db_ref = Tensor::zeros({3}, DType::f32, cpu);
    bias_backward(db, dy16, Accumulate::no);
    bias_backward(db_ref, cast(dy16, DType::f32), Accumulate::no);
    CHECK(db.to_host_f32() == db_ref.to_host_f32());  // an f32 reduction of the same values

    Tensor mask16 = Tensor::empty(s, DType::f32, cpu), mask = Tensor::empty(s, DType::f32, cpu);
    dropout_forward(y16, mask16, x16, 0.3f, 5, 0);
    dropout_forward(y, mask, x, 0.3f, 5, 0);
    CHECK(mask16.to_host_f32() == mask.to_host_f32());  // the same f32 mask
    CHECK(host(y16) == rounded(y));
  }
}

// Native 16-bit kernels: each op on f16/bf16 tensors (all 16-bit, or one of them f32; odd sizes;
// overwriting and accumulating) equals, bit for bit, the widening path it replaced: the 16-bit
// inputs cast to f32 copies, the f32 op, the output cast back (tests/native16_cases.hpp). Special
// values (+-0, +-inf, NaN, f16 overflow and subnormals) go through both paths alike.
namespace {
void check_native16(native16::Results (*cases)(Device, DType)) {
  for (DType t : {DType::bf16, DType::f16})
    for (const native16::Result& r : cases(Device::cpu(0), t)) {
      CAPTURE(r.what);
      CHECK(native16::equal(r));
    }
}
}  // namespace

TEST_CASE("kernels.native16: add, mul (broadcast, in place) and scale equal the widening bits") {
  check_native16(native16::elementwise);
}

TEST_CASE("kernels.native16: add_bias and bias_backward equal the widening path's bits") {
  check_native16(native16::bias);
}

TEST_CASE("kernels.native16: relu, gelu, gelu_tanh, tanh and gradients equal the widening bits") {
  check_native16(native16::activations);
}

TEST_CASE("kernels.native16: layer_norm forward and backward equal the widening path's bits") {
  check_native16(native16::layer_norm);
}

TEST_CASE("kernels.native16: embedding_backward of a 16-bit dy equals the widening path's bits") {
  check_native16(native16::embedding);
}

TEST_CASE(
    "kernels.native16: cross-entropies, argmax and count of 16-bit logits equal the widening") {
  check_native16(native16::losses);
}

TEST_CASE("kernels.native16: rms_norm, swiglu and rotary (Llama's kernels) equal the widening") {
  check_native16(native16::llama);
}

TEST_CASE("kernels.native16: dropout_forward equals the widening path's bits, the same mask") {
  check_native16(native16::dropout);
}

TEST_CASE("kernels.native16: max and average pooling, both passes, equal the widening bits") {
  check_native16(native16::pooling);
}

// DeviceContext::casts counts the conversions a context's work performs: each kernels::copy
// between dtypes (a same-dtype copy is none), none for an op that takes 16-bit tensors natively;
// a graph's capture counts nothing (it runs nothing) and each replay counts the captured casts.
TEST_CASE("kernels.cast: conversions count on the context, a graph's at each replay") {
  DeviceContext ctx(Device::cpu(0));
  ContextScope scope(ctx);
  Tensor x = random_tensor({3, 5}, 61), h = Tensor::empty({3, 5}, DType::bf16, Device::cpu(0));
  const int64_t start = ctx.casts();
  copy(h, x);
  Tensor back = cast(h, DType::f32);
  Tensor same = cast(h, DType::bf16);
  CHECK(ctx.casts() == start + 2);
  Tensor y = Tensor::empty({3, 5}, DType::bf16, Device::cpu(0));
  relu(y, h);
  add(y, y, x);
  CHECK(ctx.casts() == start + 2);  // native 16-bit kernels convert nothing

  Graph g;
  g.capture(ctx, [&] {
    copy(h, x);
    relu(y, h);
    copy(back, y);
  });
  CHECK(g.casts() == 2);
  CHECK(ctx.casts() == start + 2);
  g.replay();
  g.replay();
  CHECK(ctx.casts() == start + 6);
  CHECK(bitwise_equal(back, cast(y, DType::f32)));
}

// The vectorised tanh and tanh-GELU (kernels/cpu/vec_math.cpp, used by kernels::tanh,
// gelu_tanh and gelu_tanh_backward on CPU devices) against double-precision libm over a sweep of
// the floats (every 997th bit pattern of the positive floats below 20, and their negatives),
// plus the special values: tanh within kTanhUlps units in the last place, GELU within 4 units of
// 2^-24 of its larger term (measured: 4 ulp and 1.6 units), signs and NaN kept. A
// thread count changes no bit (each element is computed alone, in whatever block).
// f32 -> bf16 rounding (f32_to_bf16, and the block conversions of vec_math.hpp in every build this
// CPU runs) against a reference that picks the nearer of the two bf16 neighbours of each value, an
// exact tie going to the even one, and quiets a NaN: every 4099th bit pattern (ties, subnormals,
// infinities and NaNs of both signs among them) and the edges, in a buffer whose length leaves a
// partial last vector. Widening is exact (the bits shifted up), and rounding in f32 is the round
// trip through bf16.
TEST_CASE("kernels.bf16_rows: f32 to bf16 rounds to nearest even in every build, NaN quieted") {
  auto reference = [](uint32_t u) -> uint16_t {
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    const uint32_t below = u >> 16, rest = u & 0xffffu;  // truncated bf16, and what it drops
    if (rest > 0x8000u || (rest == 0x8000u && (below & 1u)))
      return static_cast<uint16_t>(below + 1);
    return static_cast<uint16_t>(below);
  };
  std::vector<float> xs;
  std::vector<uint16_t> want;
  auto add = [&](uint32_t u) {
    float v;
    std::memcpy(&v, &u, 4);
    xs.push_back(v);
    want.push_back(reference(u));
  };
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) add(static_cast<uint32_t>(u));
  for (uint32_t u :
       {0x00000000u, 0x80000000u, 0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7f800001u, 0x7fc00000u,
        0xffffffffu, 0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x00008000u, 0x0001ffffu, 0x7f7f8000u})
    add(u);
  const int64_t n = static_cast<int64_t>(xs.size());
  REQUIRE(n % 16 != 0);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += f32_to_bf16(xs[i]) != want[i];
  CHECK(bad == 0);
  for (CpuVectorIsa isa : {CpuVectorIsa::sse, CpuVectorIsa::avx2, CpuVectorIsa::avx512}) {
    if (isa > cpu_vector_isa()) continue;
    CAPTURE(static_cast<int>(isa));
    std::vector<uint16_t> got(xs.size());
    cpu::f32_to_bf16_rows_for(isa, got.data(), xs.data(), n);
    CHECK(got == want);
    std::vector<float> wide(xs.size());
    cpu::bf16_to_f32_rows_for(isa, wide.data(), got.data(), n);
    bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t shifted = static_cast<uint32_t>(want[i]) << 16;
      bad += std::memcmp(&wide[i], &shifted, 4) != 0;
    }
    CHECK(bad == 0);
  }
  std::vector<float> rounded(xs.size());
  cpu::round_to_bf16_rows(rounded.data(), xs.data(), n);
  bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t shifted = static_cast<uint32_t>(want[i]) << 16;
    bad += std::memcmp(&rounded[i], &shifted, 4) != 0;
  }
  CHECK(bad == 0);
}

TEST_CASE("kernels.vec_math: tanh and GELU(tanh) within a few ulp of libm over the floats") {
  constexpr int64_t kTanhUlps = 6;
  auto ulps = [](float a, double want) {
    const float w = static_cast<float>(want);
    if (a == w) return int64_t{0};
    int32_t ia = 0, iw = 0;
    std::memcpy(&ia, &a, 4);
    std::memcpy(&iw, &w, 4);
    if ((ia < 0) != (iw < 0)) return int64_t{1} << 40;  // opposite signs
    return std::abs(static_cast<int64_t>(ia) - static_cast<int64_t>(iw));
  };
  std::vector<float> xs;
  for (uint32_t bits = 0; bits < 0x41A00000u; bits += 997) {  // 0 up to 20
    float v = 0.f;
    std::memcpy(&v, &bits, 4);
    xs.push_back(v);
    xs.push_back(-v);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.f, -0.f, 1e-30f, -1e-30f, 1e-45f, 9.f, -9.f, 50.f, -88.f, 1e30f, -inf, inf})
    xs.push_back(v);
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_vector(xs, {n});
  Tensor t = zeros({n}), g = zeros({n});
  kernels::tanh(t, x);
  gelu_tanh(g, x);
  std::vector<float> th = t.to_host_f32(), gh = g.to_host_f32();
  int64_t worst_tanh = 0;
  double worst_gelu = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = xs[static_cast<size_t>(i)];
    worst_tanh = std::max(worst_tanh, ulps(th[static_cast<size_t>(i)], std::tanh(v)));
    if (std::isfinite(v) && std::fabs(v) < 1e4) {
      const double want =
          0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      // In units of 2^-24 of the larger of the two terms 0.5 x and 0.5 x tanh(u): where they
      // cancel (x << 0) f32 arithmetic, libm's included, can do no better.
      // (At least the smallest subnormal: below it f32 has no finer step.)
      const double unit = std::max(std::ldexp(std::fabs(want) + 0.5 * std::fabs(v), -24),
                                   double{std::numeric_limits<float>::denorm_min()});
      worst_gelu = std::max(worst_gelu, std::fabs(gh[static_cast<size_t>(i)] - want) / unit);
    }
  }
  CAPTURE(worst_tanh);
  CAPTURE(worst_gelu);
  CHECK(worst_tanh <= kTanhUlps);
  CHECK(worst_gelu <= 4);
  Tensor nan_in = Tensor::from_vector({std::numeric_limits<float>::quiet_NaN()}, {1}),
         nan_out = zeros({1});
  kernels::tanh(nan_out, nan_in);
  CHECK(std::isnan(nan_out.to_host_f32()[0]));
  // -0 keeps its sign (the small-argument series gave +0), and so does a tiny negative.
  for (size_t i = 0; i < xs.size(); ++i)
    if (xs[i] == 0.f || std::fabs(xs[i]) < 1e-3f) {
      CAPTURE(xs[i]);
      CHECK(std::signbit(th[i]) == std::signbit(xs[i]));
    }
  // The same bits on 1 and 2 threads.
  Tensor t1 = zeros({n});
  with_cpu_threads(1, [&] { kernels::tanh(t1, x); });
  CHECK(bitwise_equal(t1, t));
  // And from every build this CPU runs (AVX-512, AVX2, the baseline): the same bits, and the
  // ones the kernels gave.
  using cpu::VecFunction;
  for (VecFunction f : {VecFunction::tanh, VecFunction::gelu_tanh, VecFunction::gelu_tanh_grad}) {
    std::vector<float> base(xs.size());
    cpu::rows_for(f, CpuVectorIsa::sse, base.data(), xs.data(), n);
    if (f == VecFunction::tanh) CHECK(std::memcmp(base.data(), th.data(), 4 * xs.size()) == 0);
    if (f == VecFunction::gelu_tanh) CHECK(std::memcmp(base.data(), gh.data(), 4 * xs.size()) == 0);
    for (CpuVectorIsa isa : {CpuVectorIsa::avx2, CpuVectorIsa::avx512}) {
      if (isa > cpu_vector_isa()) continue;
      CAPTURE(static_cast<int>(isa));
      std::vector<float> other(xs.size());
      cpu::rows_for(f, isa, other.data(), xs.data(), n);
      CHECK(std::memcmp(base.data(), other.data(), 4 * xs.size()) == 0);
    }
  }
}

TEST_CASE("kernels.gelu_tanh_backward: the derivative's limits 1 and 0 at huge |x|, no NaN") {
  // Where tanh is +-1 in f32 the second term is 0; it was 0 * inf = NaN once x^2 overflowed
  // (|x| >= 1.8e19). Both the activation's kernel and unary's gelu_tanh, at each vector width.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> xs = {1e20f, -1e20f, 3e38f, -3e38f, inf, -inf, 12.f, -12.f, 1e10f};
  const std::vector<float> want = {1.f, 0.f, 1.f, 0.f, 1.f, 0.f, 1.f, 0.f, 1.f};
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_vector(xs, {n}), ones = filled({n}, 1.f), dx = zeros({n});
  gelu_tanh_backward(dx, ones, x, Accumulate::no);
  CHECK(dx.to_host_f32() == want);
  Tensor y = zeros({n}), du = zeros({n});
  unary(y, x, UnaryOp::gelu_tanh);
  unary_backward(du, ones, x, y, UnaryOp::gelu_tanh, {}, Accumulate::no);
  CHECK(du.to_host_f32() == want);
  for (CpuVectorIsa isa : {CpuVectorIsa::sse, CpuVectorIsa::avx2, CpuVectorIsa::avx512}) {
    if (isa > cpu_vector_isa()) continue;
    CAPTURE(static_cast<int>(isa));
    std::vector<float> got(xs.size());
    cpu::rows_for(cpu::VecFunction::gelu_tanh_grad, isa, got.data(), xs.data(), n);
    CHECK(got == want);
  }
}

// The vectorised e^x of softmax's shifted scores (x <= 0; attention on CPU devices) against
// double-precision libm over every 997th bit pattern of the floats in [-100, 0]: within 3 ulp
// down to -80, 0 below, NaN kept, and the same bits from every build this CPU runs.
TEST_CASE("kernels.vec_math: exp of non-positive floats within 3 ulp of libm, 0 below -80") {
  std::vector<float> xs;
  for (uint32_t bits = 0x80000000u; bits <= 0xC2C80000u; bits += 997) {  // -0 down to -100
    float v = 0.f;
    std::memcpy(&v, &bits, 4);
    xs.push_back(v);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {0.f, -0.f, -1e-45f, -80.f, -80.0001f, -87.f, -inf}) xs.push_back(v);
  xs.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<float> y(xs.size());
  cpu::exp_nonpositive_rows(y.data(), xs.data(), n);
  int64_t worst = 0;
  for (size_t i = 0; i + 1 < xs.size(); ++i) {
    CAPTURE(xs[i]);
    if (xs[i] < -80.f) {
      CHECK(y[i] == 0.f);
      continue;
    }
    const float want = static_cast<float>(std::exp(static_cast<double>(xs[i])));
    int32_t a = 0, w = 0;
    std::memcpy(&a, &y[i], 4);
    std::memcpy(&w, &want, 4);
    worst = std::max<int64_t>(worst, std::abs(static_cast<int64_t>(a) - w));
  }
  CAPTURE(worst);
  CHECK(worst <= 3);
  CHECK(std::isnan(y.back()));
  std::vector<float> in_place = xs;  // y may be x
  cpu::exp_nonpositive_rows(in_place.data(), in_place.data(), n);
  CHECK(std::memcmp(in_place.data(), y.data(), 4 * (xs.size() - 1)) == 0);
  for (CpuVectorIsa isa : {CpuVectorIsa::sse, CpuVectorIsa::avx2, CpuVectorIsa::avx512}) {
    if (isa > cpu_vector_isa()) continue;
    CAPTURE(static_cast<int>(isa));
    std::vector<float> other(xs.size());
    cpu::rows_for(cpu::VecFunction::exp_nonpositive, isa, other.data(), xs.data(), n);
    CHECK(std::memcmp(other.data(), y.data(), 4 * (xs.size() - 1)) == 0);
  }
}
