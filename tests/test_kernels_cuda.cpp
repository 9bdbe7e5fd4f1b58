// kernels.cuda.*: every op of the CUDA backend against the CPU backend on the same random
// inputs (odd sizes, empty batches, accumulation), bitwise reproducibility of the reductions,
// logical devices sharing one GPU, and memory returning to its start value. Each case skips,
// visibly, without a GPU.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>

#include "kernels/runtime/event.hpp"
#include "kernels/runtime/graph.hpp"
#include "kernels/runtime/memory.hpp"
#include "kernels/tensor_ops.hpp"
#include "tests/compute_copy_cases.hpp"
#include "tests/device_scalars.hpp"
#include "tests/gemm_gelu_cases.hpp"
#include "tests/loss_count_cases.hpp"
#include "tests/loss_scale_cases.hpp"
#include "tests/native16_cases.hpp"
#include "tests/optim_test_util.hpp"
#include "tests/test_util.hpp"

#if DP_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/cuda/sdpa.hpp"
#endif

using namespace kernels;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCpu = Device::cpu(0);

// Uniform [lo, hi) data from `seed`: the same values on every device.
Tensor rnd(Device d, const Shape& s, uint32_t seed, float lo = -1.f, float hi = 1.f,
           DType dtype = DType::f32) {
  return Tensor::from_vector(
      dp_test::random_vector(static_cast<size_t>(shape_numel(s)), seed, lo, hi), s, d, dtype);
}

// Small integers as floats: many exact ties (argmax, max pooling).
Tensor small_ints(Device d, const Shape& s, uint32_t seed, int levels) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(0, levels - 1);
  std::vector<float> v(static_cast<size_t>(shape_numel(s)));
  for (auto& x : v) x = static_cast<float>(dist(gen));
  return Tensor::from_vector(v, s, d);
}

Tensor labels(Device d, int64_t batch, int64_t classes, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(classes - 1));
  std::vector<int32_t> v(static_cast<size_t>(batch));
  for (auto& x : v) x = dist(gen);
  return Tensor::from_ints(v, {batch}, d);
}

Tensor zeros(Device d, const Shape& s) {
  return Tensor::zeros(s, DType::f32, d);
}

Tensor full(Device d, const Shape& s, float value) {
  Tensor t = Tensor::empty(s, DType::f32, d);
  fill(t, value);
  return t;
}

float diff(const Tensor& a, const Tensor& b) {
  return max_abs_diff(a.to_host_f32(), b.to_host_f32());
}

bool same_bits(const Tensor& a, const Tensor& b) {
  std::vector<float> x = a.to_host_f32(), y = b.to_host_f32();
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

// Runs `run` on cuda:0 and on cpu:0 (it makes its inputs from fixed seeds, so both see the
// same values) and checks that every returned output agrees within `tol`.
using Outputs = std::vector<Tensor>;
void check_matches_cpu(const std::function<Outputs(Device)>& run, float tol) {
  Outputs on_gpu = run(kGpu);
  Outputs on_cpu = run(kCpu);
  REQUIRE(on_gpu.size() == on_cpu.size());
  for (size_t i = 0; i < on_gpu.size(); ++i) {
    INFO("output ", i, ": ", on_gpu[i]);
    CHECK(on_gpu[i].device() == kGpu);
    CHECK(on_gpu[i].shape() == on_cpu[i].shape());
    CHECK(diff(on_gpu[i], on_cpu[i]) <= tol);
  }
}

Shape stored(int64_t rows, int64_t cols, Transpose t) {
  return t == Transpose::no ? Shape{rows, cols} : Shape{cols, rows};
}

// Sets a context's math mode for one scope.
struct MathScope {
  DeviceContext& ctx;
  MathMode previous;
  MathScope(DeviceContext& c, MathMode m) : ctx(c), previous(c.math()) { c.set_math(m); }
  ~MathScope() { ctx.set_math(previous); }
};

}  // namespace

// ---- elementwise ---------------------------------------------------------------------------

TEST_CASE("kernels.cuda.elementwise: add, mul, scale, axpy match CPU (odd sizes, aliasing)") {
  DP_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1237}, int64_t{300007}}) {
    CAPTURE(n);
    check_matches_cpu(
        [&](Device d) {
          Tensor a = rnd(d, {n}, 1), b = rnd(d, {n}, 2);
          Tensor sum_ab = zeros(d, {n}), prod = zeros(d, {n}), scaled = zeros(d, {n});
          add(sum_ab, a, b);
          mul(prod, a, b);
          scale(scaled, a, -2.5f);
          Tensor y = rnd(d, {n}, 3);
          axpy(y, 0.75f, b);
          Tensor in_place = a.clone();
          scale(in_place, in_place, 3.f);  // y aliases x
          return Outputs{sum_ab, prod, scaled, y, in_place};
        },
        1e-6f);
  }
}

// alpha = 0.75 (two significant bits) times a 16-bit x is exact in f32, so y + alpha x is one
// f32 rounding whether or not the GPU fuses it: the same bits as the CPU.
TEST_CASE("kernels.cuda.axpy: a bf16 or f16 x adds into an f32 y like the CPU, bit for bit") {
  DP_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t n : {int64_t{1}, int64_t{1237}, int64_t{300007}}) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(n);
      check_matches_cpu(
          [&](Device d) {
            Tensor y = rnd(d, {n}, 4), x = rnd(d, {n}, 5, -8.f, 8.f, t);
            axpy(y, 0.75f, x);
            return Outputs{y};
          },
          0.f);
    }
}

TEST_CASE("kernels.cuda.bias: add_bias and bias_backward match CPU ((N, C), (N, C, H, W))") {
  DP_REQUIRE_GPU();
  // 1000 rows use several row chunks of the column sums; 3 rows use one.
  // (8, 3, 64, 64): 32768 elements per channel, split in 16 chunks per channel.
  for (Shape s : {Shape{3, 37}, Shape{1000, 37}, Shape{5, 7, 3, 11}, Shape{2, 300, 1, 1},
                  Shape{8, 3, 64, 64}}) {
    CAPTURE(shape_str(s));
    // A channel's sum of n terms, taken in another order on each side, differs by rounding
    // that grows with n: 2e-7 n (about 3u per term of |y| <= 2) with a floor of 2e-4.
    const int64_t per_channel = shape_numel(s) / s[1];
    const float tol = std::max(2e-4f, 2e-7f * static_cast<float>(per_channel));
    check_matches_cpu(
        [&](Device d) {
          Tensor y = rnd(d, s, 4), bias = rnd(d, {s[1]}, 5);
          add_bias(y, bias);
          Tensor db = zeros(d, {s[1]});
          bias_backward(db, y, Accumulate::no);
          Tensor db_acc = rnd(d, {s[1]}, 6);
          bias_backward(db_acc, y, Accumulate::yes);
          return Outputs{y, db, db_acc};
        },
        tol);
  }
}

// ---- gemm ----------------------------------------------------------------------------------

TEST_CASE("kernels.cuda.gemm: matches CPU (transposes, alpha/beta, bias, odd sizes)") {
  DP_REQUIRE_GPU();
  const int64_t m = 37, n = 53, k = 29;
  for (Transpose ta : {Transpose::no, Transpose::yes})
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      CAPTURE(static_cast<int>(ta));
      CAPTURE(static_cast<int>(tb));
      check_matches_cpu(
          [&](Device d) {
            Tensor a = rnd(d, stored(m, k, ta), 7), b = rnd(d, stored(k, n, tb), 8);
            Tensor bias = rnd(d, {n}, 9);
            Tensor c0 = zeros(d, {m, n});
            gemm(c0, a, ta, b, tb);
            Tensor c1 = rnd(d, {m, n}, 10);
            gemm(c1, a, ta, b, tb, 0.5f, -1.5f, bias);
            Tensor c2 = full(d, {m, n}, std::numeric_limits<float>::quiet_NaN());
            gemm(c2, a, ta, b, tb, 2.f, 0.f, bias);  // beta = 0 never reads c
            return Outputs{c0, c1, c2};
          },
          2e-5f);
    }
}

TEST_CASE("kernels.cuda.gemm: larger product, tf32, unaligned views") {
  DP_REQUIRE_GPU();
  const int64_t m = 129, n = 257, k = 515;
  check_matches_cpu(
      [&](Device d) {
        Tensor a = rnd(d, {m, k}, 11), b = rnd(d, {n, k}, 12), bias = rnd(d, {n}, 13);
        Tensor c = zeros(d, {m, n});
        gemm(c, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, bias);
        return Outputs{c};
      },
      2e-4f);
  {
    MathScope tf32(context(kGpu), MathMode::tf32);
    check_matches_cpu(
        [&](Device d) {
          Tensor a = rnd(d, {m, k}, 11), b = rnd(d, {k, n}, 12), bias = rnd(d, {n}, 13);
          Tensor c = zeros(d, {m, n});
          gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.f, bias);
          return Outputs{c};
        },
        5e-2f);  // TF32 keeps 10 mantissa bits of each operand
  }
  // Views one element into their buffers (4-byte aligned only), as flat parameter buffers
  // hand out: the heuristic must pick algorithms for that alignment, the bias goes unfused.
  check_matches_cpu(
      [&](Device d) {
        Tensor a = rnd(d, {m * k + 1}, 14).view(1, {m, k});
        Tensor b = rnd(d, {k * n + 1}, 15).view(1, {k, n});
        Tensor bias = rnd(d, {n + 1}, 16).view(1, {n});
        Tensor c = zeros(d, {m * n + 1}).view(1, {m, n});
        gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.f, bias);
        return Outputs{c};
      },
      2e-4f);
}

TEST_CASE("kernels.cuda.gemm: f16 and bf16 operands, f32 or 16-bit output") {
  DP_REQUIRE_GPU();
  // Odd sizes (2-byte aligned rows: cuBLASLt has no bias epilogue for them, the bias kernel adds
  // it) and 16-byte aligned ones (where the 16-bit output's bias epilogue can run).
  for (const Shape& mnk : {Shape{33, 65, 47}, Shape{64, 128, 48}})
    for (DType t : {DType::f16, DType::bf16}) {
      const int64_t m = mnk[0], n = mnk[1], k = mnk[2];
      CAPTURE(shape_str(mnk));
      CAPTURE(dtype_name(t));
      check_matches_cpu(
          [&](Device d) {
            Tensor a = rnd(d, {m, k}, 17, -1.f, 1.f, t), b = rnd(d, {n, k}, 18, -1.f, 1.f, t);
            Tensor bias = rnd(d, {n}, 19);
            Tensor c32 = zeros(d, {m, n});
            gemm(c32, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, bias);
            return Outputs{c32};
          },
          1e-4f);  // same rounded operands, f32 accumulation: only the order differs
      auto run16 = [&](Device d) {
        Tensor a = rnd(d, {k, m}, 20, -1.f, 1.f, t), b = rnd(d, {k, n}, 21, -1.f, 1.f, t);
        Tensor bias = rnd(d, {n}, 22);
        Tensor c16 = Tensor::zeros({m, n}, t, d);
        gemm(c16, a, Transpose::yes, b, Transpose::no, 1.f, 0.f, bias);
        // A bias in c's dtype (what Linear passes under 16-bit activations): the epilogue
        // reads it as it is, with no rounding kernel; the bound below holds with its term 0.
        Tensor bias16 = rnd(d, {n}, 23, -1.f, 1.f, t);
        Tensor c16b = Tensor::zeros({m, n}, t, d);
        gemm(c16b, a, Transpose::yes, b, Transpose::no, 1.f, 0.f, bias16);
        return Outputs{c16, c16b};
      };
      // The tolerance, from the rounding steps. With s the exact product a^T b (the operands are
      // already 16-bit values, so exact in f32), bias b_j in [-1, 1) and u the unit roundoff of
      // the output type (2^-11 for f16, 2^-8 for bf16; |fl(v) - v| <= u |v|):
      //   CPU: c = fl16(s1 + b), one 16-bit rounding of the f32 sum s1 = s + e1;
      //   GPU: g = fl16(fl16(s2) + b): cuBLASLt rounds the product s2 = s + e2 to 16 bits, then
      //        the bias kernel adds the bias in f32 and rounds again; or, where cuBLASLt has a
      //        bias epilogue for this shape, g = fl16(s2 + fl16(b)): the bias rounded to 16 bits
      //        (|fl16(b) - b| <= u, as |b| < 1 <= M), added in f32, one rounding.
      // With M a bound on |s| and |s + b|, and |e1|, |e2| <= k^2 2^-24 (f32 accumulation of k
      // terms of size <= 1, in any order; a bound of 2.4e-4 here, an order of magnitude below
      // the 16-bit terms):
      //   |g - c| <= u M (first GPU rounding, or the bias's) + u M (1 + u) (second GPU rounding)
      //              + u M (the CPU's rounding) + |e1| + |e2| + 2^-24 M (the f32 bias add)
      //           <= 3 u M (1 + u) + 2 k^2 2^-24 + 2^-24 M.
      // M is taken from the data: the CPU result's largest magnitude plus 1 (|b| < 1) and its
      // own half-ulp slack, so the bound holds for these operands, not for an assumed range.
      float m_bound = 1.f;
      for (const Tensor& out : run16(kCpu))
        for (float v : out.to_host_f32()) m_bound = std::max(m_bound, std::fabs(v) + 1.f);
      const double u = t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
      const double f32u = std::ldexp(1.0, -24);
      const double tol16 =
          3 * u * m_bound * (1 + u) * (1 + u) + 2.0 * k * k * f32u + f32u * m_bound;
      CAPTURE(m_bound);
      CAPTURE(tol16);
      check_matches_cpu(run16, static_cast<float>(tol16));
    }
}

// c f32 = alpha a b + beta c with 16-bit a, b. The products are exact in f32, so the backends
// differ only in the order of the k f32 additions (|e| <= k 2^-24 sum |a_i b_i| <= k^2 2^-24 each
// for |a|, |b| <= 1) and in the f32 roundings of alpha (.) and + beta c (2^-24 of a result of
// magnitude <= k + 1 each): 2 k^2 2^-24 + 4 (k + 1) 2^-24, about 3e-4 for k = 47.
// The GELU epilogues (cuBLASLt's GELU_AUX_BIAS and DGELU_BGRAD, where it has them: 16-bit
// outputs, n a multiple of 8) against the GPU's ops in turn, and both against the CPU. Where the
// epilogue runs, y is GELU of the f32 value before it is rounded into pre, the derivative
// multiplies the unrounded product, and the bias gradient is summed by cuBLASLt and rounded to
// the 16-bit dtype. Bound, with u the output's unit roundoff (2^-8 bf16, 2^-11 f16) and M the
// largest magnitude of the two results plus 1: each result differs by at most two roundings of
// its own and one of its input's (3 u M), plus cuBLASLt's GELU against ours (both the tanh
// formula in f32: 1e-3 M of slack) and f32 sums in another order (k or m terms: 1e-4 M). The
// bias gradient sums m rows of dpre: its M is m times dpre's, plus its own rounding.
// f32 outputs run the ops in turn on the GPU, the CPU's 1e-4 apart.
TEST_CASE("kernels.cuda.gemm_gelu: the fused forward and backward follow the ops within a bound") {
  DP_REQUIRE_GPU();
  const bool was = cuda_dgelu_epilogue();
  set_cuda_dgelu_epilogue(true);  // as DP_CUDA_DGELU=epilogue: the ops are the default
  for (const gemm_gelu::Case& c : gemm_gelu::cases()) {
    CAPTURE(dtype_name(c.t));
    CAPTURE(c.m);
    CAPTURE(c.bias);
    CAPTURE(c.acc == Accumulate::yes);
    const gemm_gelu::Outputs f = gemm_gelu::run(c, kGpu, true);
    const gemm_gelu::Outputs r = gemm_gelu::run(c, kGpu, false);
    const gemm_gelu::Outputs h = gemm_gelu::run(c, kCpu, false);
    const double u = c.t == DType::bf16  ? std::ldexp(1.0, -8)
                     : c.t == DType::f16 ? std::ldexp(1.0, -11)
                                         : 0.0;
    // The largest magnitude of a and b, plus 1.
    auto magnitude = [](const Tensor& a, const Tensor& b) {
      double m_bound = 1.0;
      for (const Tensor* t : {&a, &b})
        for (float v : t->to_host_f32()) m_bound = std::max(m_bound, std::fabs(double{v}) + 1);
      return m_bound;
    };
    auto close = [&](const Tensor& a, const Tensor& b, const char* what, double m_bound) {
      std::vector<float> x = a.to_host_f32(), y = b.to_host_f32();
      const double tol = 3 * u * m_bound + 1e-3 * m_bound + 1e-4 * m_bound;
      double worst = 0.0;
      for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(double{x[i]} - y[i]));
      CAPTURE(what);
      CAPTURE(worst);
      CAPTURE(tol);
      CHECK(worst <= tol);
    };
    for (const gemm_gelu::Outputs* o : {&r, &h}) {
      close(f.pre, o->pre, "pre", magnitude(f.pre, o->pre));
      close(f.y, o->y, "y", magnitude(f.y, o->y));
      const double dpre_bound = magnitude(f.dpre, o->dpre);
      close(f.dpre, o->dpre, "dpre", dpre_bound);
      close(f.dbias, o->dbias, "dbias",
            static_cast<double>(c.m) * dpre_bound + magnitude(f.dbias, o->dbias));
    }
    // linear_param_grads: the same rounded operands, f32 sums of m terms of size <= 2.25 in
    // another order (and, where the epilogue runs, the bias summed from dy's 16-bit values):
    // at most m^2 2.25 2^-24 apart, plus u of the bias's terms for the f32 dy it may not read.
    for (bool f32_bias_dy : {false, true}) {
      auto [dw, db] = gemm_gelu::param_grads(c, kGpu, true, f32_bias_dy);
      for (Device d : {kGpu, kCpu}) {
        auto [dw_ops, db_ops] = gemm_gelu::param_grads(c, d, false, f32_bias_dy);
        const double sums = static_cast<double>(c.m) * c.m * 2.25 * std::ldexp(1.0, -24);
        const double rounding = static_cast<double>(c.m) * 1.5 * u;
        for (auto [got, want] : {std::pair{dw, dw_ops}, std::pair{db, db_ops}}) {
          std::vector<float> x = got.to_host_f32(), y = want.to_host_f32();
          double worst = 0.0;
          for (size_t i = 0; i < x.size(); ++i)
            worst = std::max(worst, std::fabs(double{x[i]} - y[i]));
          CAPTURE(f32_bias_dy);
          CAPTURE(worst);
          CHECK(worst <= sums + rounding + 1e-6);
        }
      }
    }
  }
  set_cuda_dgelu_epilogue(was);
}

TEST_CASE(
    "kernels.cuda.gemm_gelu: without the DGELU epilogue the backward is the ops, their bits") {
  DP_REQUIRE_GPU();
  const bool was = cuda_dgelu_epilogue();
  set_cuda_dgelu_epilogue(false);  // as DP_CUDA_DGELU=ops
  for (const gemm_gelu::Case& c : gemm_gelu::cases()) {
    CAPTURE(dtype_name(c.t));
    CAPTURE(c.m);
    CAPTURE(c.bias);
    CAPTURE(c.acc == Accumulate::yes);
    Tensor pre = gemm_gelu::input(kGpu, {c.m, c.n}, 11, c.t);
    Tensor w2 = gemm_gelu::input(kGpu, {c.n2, c.n}, 4, c.t);
    Tensor dy = gemm_gelu::input(kGpu, {c.m, c.n2}, 5, c.t);
    Tensor dpre = Tensor::zeros({c.m, c.n}, c.t, kGpu);
    Tensor db = gemm_gelu::input(kGpu, {c.n}, 6, DType::f32);
    Tensor dbias = c.bias ? db : Tensor();
    gemm_gelu_tanh_backward(dpre, dbias, c.acc, dy, Transpose::no, w2, Transpose::no, pre);
    Tensor g = Tensor::zeros({c.m, c.n}, c.t, kGpu);
    gemm(g, dy, Transpose::no, w2, Transpose::no);
    Tensor want = Tensor::zeros({c.m, c.n}, c.t, kGpu);
    gelu_tanh_backward(want, g, pre, Accumulate::no);
    Tensor want_db = gemm_gelu::input(kGpu, {c.n}, 6, DType::f32);
    if (c.bias) bias_backward(want_db, want, c.acc);
    CHECK(dp_test::same_bits(dpre, want));
    CHECK(dp_test::same_bits(db, want_db));
  }
  set_cuda_dgelu_epilogue(was);
}

TEST_CASE("kernels.cuda.gemm: f16 and bf16 operands into f32 c with beta 0 and 1") {
  DP_REQUIRE_GPU();
  const int64_t m = 29, n = 71, k = 47;
  const double f32u = std::ldexp(1.0, -24);
  const float tol = static_cast<float>(2.0 * k * k * f32u + 4.0 * (k + 1) * f32u);
  for (DType t : {DType::f16, DType::bf16})
    for (float beta : {0.f, 1.f}) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(beta);
      check_matches_cpu(
          [&](Device d) {
            Tensor a = rnd(d, {k, m}, 23, -1.f, 1.f, t), b = rnd(d, {n, k}, 24, -1.f, 1.f, t);
            Tensor c = rnd(d, {m, n}, 25), c_bias = rnd(d, {m, n}, 26);
            gemm(c, a, Transpose::yes, b, Transpose::yes, 0.5f, beta);
            gemm(c_bias, a, Transpose::yes, b, Transpose::yes, 1.f, beta, rnd(d, {n}, 27));
            return Outputs{c, c_bias};
          },
          tol);
    }
}

// The shapes cuBLASLt's heuristic may have nothing for (a dimension of 1: a one-row DP chunk,
// a layer with one output) and the leading dimensions that are not 16-byte multiples in our
// models (k = 10, 47, 84): every one runs (cuBLASLt, else the cublasGemmEx fallback) and
// matches the CPU in f32, bf16 and f16. Operands in [-1, 1], strict f32 math: the backends differ
// in the order of k f32 additions (<= k^2 2^-24), the f32 roundings of the products (16-bit
// products are exact), of alpha, beta c and the bias (<= 6 (k + 1) 2^-24 together).
TEST_CASE("kernels.cuda.gemm: dimensions of 1 and k = 10, 47, 84 in f32, bf16, f16 match CPU") {
  DP_REQUIRE_GPU();
  MathScope strict(context(kGpu), MathMode::strict);
  const double f32u = std::ldexp(1.0, -24);
  struct Mnk {
    int64_t m, n, k;
  };
  const Mnk shapes[] = {{1, 10, 47}, {33, 1, 84},  {17, 12, 1}, {1, 1, 10},
                        {8, 10, 84}, {64, 47, 10}, {5, 84, 47}};
  uint32_t seed = 300;
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (const Mnk& s : shapes)
      for (Transpose tb : {Transpose::no, Transpose::yes}) {
        CAPTURE(dtype_name(t));
        CAPTURE(s.m);
        CAPTURE(s.n);
        CAPTURE(s.k);
        CAPTURE(tb == Transpose::yes);
        seed += 4;
        const float tol = static_cast<float>(2.0 * s.k * s.k * f32u + 6.0 * (s.k + 1) * f32u);
        check_matches_cpu(
            [&](Device d) {
              Tensor a = rnd(d, {s.m, s.k}, seed, -1.f, 1.f, t);
              Tensor b = rnd(d, stored(s.k, s.n, tb), seed + 1, -1.f, 1.f, t);
              Tensor bias = rnd(d, {s.n}, seed + 2);
              Tensor c = zeros(d, {s.m, s.n}), c_beta = rnd(d, {s.m, s.n}, seed + 3);
              gemm(c, a, Transpose::no, b, tb, 1.f, 0.f, bias);
              gemm(c_beta, a, Transpose::no, b, tb, 0.5f, 1.f);
              return Outputs{c, c_beta};
            },
            tol);
      }
}

TEST_CASE("kernels.cuda.gemm: empty products (k == 0 gives beta c + bias - empty batch)") {
  DP_REQUIRE_GPU();
  check_matches_cpu(
      [&](Device d) {
        Tensor a = zeros(d, {5, 0}), b = zeros(d, {0, 7}), bias = rnd(d, {7}, 23);
        Tensor c = rnd(d, {5, 7}, 24);
        gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.5f, bias);
        Tensor empty_batch = zeros(d, {0, 7});
        gemm(empty_batch, zeros(d, {0, 3}), Transpose::no, rnd(d, {3, 7}, 25), Transpose::no);
        return Outputs{c, empty_batch};
      },
      1e-6f);
#if DP_HAVE_CUDA
  // The backend itself, below the dispatcher's early returns.
  DeviceContext& ctx = context(kGpu);
  Tensor c = full(kGpu, {4, 3}, 2.f), a = zeros(kGpu, {4, 0}), b = zeros(kGpu, {0, 3});
  cuda::gemm(c, a, Transpose::no, b, Transpose::no, 1.f, 0.f, Tensor(), ctx);
  CHECK(c.to_host_f32() == std::vector<float>(12, 0.f));
#endif
}

// ---- activations ---------------------------------------------------------------------------

TEST_CASE("kernels.cuda.activations: relu, gelu, gelu_tanh, tanh and gradients match CPU") {
  DP_REQUIRE_GPU();
  const Shape s{7, 331};
  check_matches_cpu(
      [&](Device d) {
        Tensor x = rnd(d, s, 26, -4.f, 4.f), dy = rnd(d, s, 27);
        Outputs out;
        for (int which = 0; which < 4; ++which) {
          Tensor y = zeros(d, s), dx = zeros(d, s), dx_acc = rnd(d, s, 28);
          if (which == 0) {
            relu(y, x);
            relu_backward(dx, dy, x, Accumulate::no);
            relu_backward(dx_acc, dy, x, Accumulate::yes);
          } else if (which == 1) {
            gelu(y, x);
            gelu_backward(dx, dy, x, Accumulate::no);
            gelu_backward(dx_acc, dy, x, Accumulate::yes);
          } else if (which == 2) {
            gelu_tanh(y, x);
            gelu_tanh_backward(dx, dy, x, Accumulate::no);
            gelu_tanh_backward(dx_acc, dy, x, Accumulate::yes);
          } else {
            kernels::tanh(y, x);
            tanh_backward(dx, dy, y, Accumulate::no);
            tanh_backward(dx_acc, dy, y, Accumulate::yes);
          }
          out.insert(out.end(), {y, dx, dx_acc});
        }
        return out;
      },
      2e-6f);
}

TEST_CASE(
    "kernels.cuda.activations: gelu_tanh's derivative at huge |x| and tanh(-0) as on the CPU") {
  DP_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> xs = {1e20f, -1e20f, 3e38f, -3e38f, inf, -inf, 12.f, -12.f, -0.f};
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_vector(xs, {n}, kGpu),
         ones = Tensor::from_vector(std::vector<float>(xs.size(), 1.f), {n}, kGpu);
  Tensor dx = zeros(kGpu, {n}), du = zeros(kGpu, {n}), y = zeros(kGpu, {n}), t = zeros(kGpu, {n});
  gelu_tanh_backward(dx, ones, x, Accumulate::no);
  unary(y, x, UnaryOp::gelu_tanh);
  unary_backward(du, ones, x, y, UnaryOp::gelu_tanh, {}, Accumulate::no);
  const std::vector<float> want = {1.f, 0.f, 1.f, 0.f, 1.f, 0.f, 1.f, 0.f, 0.5f};
  CHECK(dx.to_host_f32() == want);
  CHECK(du.to_host_f32() == want);
  kernels::tanh(t, x);
  CHECK(std::signbit(t.to_host_f32()[8]));
}

TEST_CASE("kernels.cuda.activations: 16-bit values eight at a time give the one-at-a-time bits") {
  DP_REQUIRE_GPU();
  // 8 x 1000 + 5 values: 16-byte aligned tensors take the 8-wide kernels for 8000 values and the
  // one-wide kernel for the last 5; the same values in views one element into their buffers
  // (2-byte aligned) take the one-wide kernel for all of them. The bits must be the same.
  const int64_t n = 8005;
  for (DType t : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(t));
    auto misaligned = [&](const Tensor& a) {
      Tensor b = Tensor::zeros({n + 1}, t, kGpu).view(1, {n});
      copy(b, a);
      return b;
    };
    const Tensor x = rnd(kGpu, {n}, 31, -4.f, 4.f, t), dy = rnd(kGpu, {n}, 32, -1.f, 1.f, t);
    const Tensor acc0 = rnd(kGpu, {n}, 33, -1.f, 1.f, t);
    auto run = [&](const Tensor& xv, const Tensor& dyv, Tensor acc, Tensor y, Tensor dx) {
      gelu_tanh(y, xv);
      gelu_tanh_backward(dx, dyv, xv, Accumulate::no);
      gelu_tanh_backward(acc, dyv, xv, Accumulate::yes);
      return Outputs{y, dx, acc};
    };
    Tensor acc_al = Tensor::zeros({n}, t, kGpu);
    copy(acc_al, acc0);
    Outputs wide = run(x, dy, acc_al, Tensor::zeros({n}, t, kGpu), Tensor::zeros({n}, t, kGpu));
    Outputs narrow =
        run(misaligned(x), misaligned(dy), misaligned(acc0), misaligned(acc0), misaligned(acc0));
    for (size_t i = 0; i < wide.size(); ++i) {
      INFO("output ", i);
      CHECK(same_bits(wide[i], narrow[i]));
    }
  }
}

// ---- losses, reductions, metrics -----------------------------------------------------------

TEST_CASE("kernels.cuda.softmax_cross_entropy: matches CPU (smoothing, weights, wide rows)") {
  DP_REQUIRE_GPU();
  for (int64_t classes : {int64_t{1}, int64_t{11}, int64_t{1000}}) {
    for (float ls : {0.f, 0.1f}) {
      CAPTURE(classes);
      CAPTURE(ls);
      check_matches_cpu(
          [&](Device d) {
            const int64_t batch = 37;
            Tensor logits = rnd(d, {batch, classes}, 29, -5.f, 5.f);
            Tensor lab = labels(d, batch, classes, 30), w = rnd(d, {batch}, 31, 0.f, 2.f);
            Tensor loss = zeros(d, {1}), dlogits = zeros(d, {batch, classes});
            softmax_cross_entropy(loss, dlogits, logits, lab, Tensor(), ls);
            Tensor wloss = zeros(d, {1}), wdlogits = zeros(d, {batch, classes});
            softmax_cross_entropy(wloss, wdlogits, logits, lab, w, ls);
            Tensor floss = zeros(d, {1}), none;
            softmax_cross_entropy(floss, none, logits, lab, w, ls);  // forward only
            return Outputs{loss, dlogits, wloss, wdlogits, floss};
          },
          5e-5f);
    }
  }
  // Huge logits stay finite; an empty batch has loss 0.
  check_matches_cpu(
      [&](Device d) {
        Tensor logits = rnd(d, {4, 9}, 32, -1e4f, 1e4f), lab = labels(d, 4, 9, 33);
        Tensor loss = zeros(d, {1}), dl = zeros(d, {4, 9});
        softmax_cross_entropy(loss, dl, logits, lab);
        Tensor empty_loss = full(d, {1}, 5.f), none;
        softmax_cross_entropy(empty_loss, none, zeros(d, {0, 9}), labels(d, 0, 9, 34));
        return Outputs{loss, dl, empty_loss};
      },
      2e-2f);  // the huge loss (~1e4) itself carries f32 rounding of that size
}

TEST_CASE(
    "kernels.cuda.softmax_cross_entropy: the eight-wide gradient pass gives the one-wide bits") {
  // The gradient of a 16-byte aligned row of a multiple of 8 values is written eight values at a
  // time; a gradient one value off alignment takes the one-value path. The logits are the same
  // aligned rows for both (their first pass, eight wide for 16-bit logits, sums in another order
  // than the one-wide one), so the loss and gradient bits must be the same: into a gradient of
  // the logits' dtype, into an f32 one, and over the logits themselves.
  DP_REQUIRE_GPU();
  const int64_t batch = 6, classes = 1000;
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (bool f32_grad : {false, true}) {
      CAPTURE(dtype_name(t));
      CAPTURE(f32_grad);
      const DType g = f32_grad ? DType::f32 : t;
      Tensor x = rnd(kGpu, {batch, classes}, 42, -6.f, 6.f, t);
      Tensor lab = labels(kGpu, batch, classes, 43);
      Tensor loss_w = zeros(kGpu, {1}), loss_o = zeros(kGpu, {1});
      Tensor d_w = Tensor::zeros({batch, classes}, g, kGpu);
      Tensor d_o = Tensor::zeros({batch * classes + 1}, g, kGpu).view(1, {batch, classes});
      softmax_cross_entropy(loss_w, d_w, x, lab);
      softmax_cross_entropy(loss_o, d_o, x, lab);
      CHECK(same_bits(loss_w, loss_o));
      CHECK(same_bits(d_w, d_o));
      CHECK(diff(d_w, zeros(kGpu, {batch, classes})) > 0.f);  // a gradient was written
      if (!f32_grad) {  // over the logits themselves, eight wide
        Tensor loss_in = zeros(kGpu, {1});
        softmax_cross_entropy(loss_in, x, x, lab);
        CHECK(same_bits(loss_in, loss_w));
        CHECK(same_bits(x, d_w));
      }
    }
  }
}

TEST_CASE("kernels.cuda.mse_loss, sum, mean: match CPU - same bits on every run") {
  DP_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1237}, int64_t{1000003}}) {
    CAPTURE(n);
    check_matches_cpu(
        [&](Device d) {
          Tensor pred = rnd(d, {n}, 35), target = rnd(d, {n}, 36);
          Tensor loss = zeros(d, {1}), dpred = zeros(d, {n}), s = zeros(d, {1}), mu = zeros(d, {1});
          mse_loss(loss, dpred, pred, target);
          sum(s, pred);
          mean(mu, pred);
          return Outputs{loss, dpred, mu};
        },
        1e-5f);
    // The sum of n values in [-1, 1] is up to ~sqrt(n) in size: compare relative to that.
    Tensor xg = rnd(kGpu, {n}, 37), xc = rnd(kCpu, {n}, 37);
    Tensor sg = zeros(kGpu, {1}), sc = zeros(kCpu, {1}), again = zeros(kGpu, {1});
    sum(sg, xg);
    sum(sc, xc);
    CHECK(std::fabs(sg.item() - sc.item()) <= 1e-6f * std::sqrt(static_cast<float>(n)) * 10.f);
    sum(again, xg);
    CHECK(same_bits(sg, again));
  }
  check_matches_cpu(
      [&](Device d) {
        Tensor s = full(d, {1}, 3.f), mu = full(d, {1}, 3.f), loss = full(d, {1}, 3.f), none;
        sum(s, zeros(d, {0, 4}));
        mean(mu, zeros(d, {0}));
        mse_loss(loss, none, zeros(d, {0, 2}), zeros(d, {0, 2}));
        return Outputs{s, mu, loss};
      },
      0.f);
}

TEST_CASE("kernels.cuda.loss_count: the cross-entropies count in their pass what the CPU counts") {
  DP_REQUIRE_GPU();
  int checks = 0;
  loss_count::run(kGpu, [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 3 * 5 * 2 * 6);
}

TEST_CASE("kernels.cuda.loss_scale: the cross-entropies multiply their gradient before rounding") {
  DP_REQUIRE_GPU();
  int checks = 0;
  loss_scale::run(kGpu, [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 66);
}

TEST_CASE("kernels.cuda.argmax and count_correct: first maximum on ties, match CPU") {
  DP_REQUIRE_GPU();
  for (int64_t classes : {int64_t{1}, int64_t{10}, int64_t{77}, int64_t{1000}}) {
    CAPTURE(classes);
    const int64_t batch = 301;
    Outputs got;
    int64_t correct[2] = {0, 0};
    int which = 0;
    for (Device d : {kGpu, kCpu}) {
      Tensor x = small_ints(d, {batch, classes}, 38, 4);  // ties everywhere
      Tensor out = Tensor::zeros({batch}, DType::i32, d);
      argmax(out, x);
      got.push_back(out);
      correct[which++] = count_correct(x, labels(d, batch, classes, 39));
    }
    CHECK(got[0].to_host_i32() == got[1].to_host_i32());
    CHECK(correct[0] == correct[1]);
  }
  // NaN: the CPU's rule (PyTorch's: a row's first NaN is its argmax), in rows wider than a warp
  // too, with the NaN at a lane's first column and elsewhere.
  {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const int64_t classes = 70;
    std::vector<float> v(static_cast<size_t>(6 * classes));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 37) % 11);
    v[0 * classes + 0] = nan;    // row 0: NaN first
    v[1 * classes + 3] = nan;    // row 1: NaN seeds lane 3, and is the argmax
    v[1 * classes + 40] = 20.f;  //        though the maximum is after it
    v[1 * classes + 36] = nan;   //        and another lane's NaN comes later
    v[2 * classes + 35] = nan;   // row 2: NaN in a lane's second column
    for (int64_t c = 0; c < classes; ++c) v[3 * classes + c] = nan;  // row 3: all NaN
    for (int64_t c = 1; c < classes; ++c) v[4 * classes + c] = nan;  // row 4: one number first
    v[4 * classes + 0] = -1.f;
    v[5 * classes + 69] = nan;  // row 5: NaN last
    Outputs got;
    for (Device d : {kGpu, kCpu}) {
      Tensor out = Tensor::zeros({6}, DType::i32, d);
      argmax(out, Tensor::from_vector(v, {6, classes}, d));
      got.push_back(out);
    }
    CHECK(got[0].to_host_i32() == got[1].to_host_i32());
    CHECK(got[1].to_host_i32()[0] == 0);
    CHECK(got[1].to_host_i32()[1] == 3);
    CHECK(got[1].to_host_i32()[2] == 35);
    CHECK(got[1].to_host_i32()[5] == 69);
  }
  // Every label right, then none: the count is exact.
  Tensor x = rnd(kGpu, {50, 6}, 40);
  Tensor idx = Tensor::zeros({50}, DType::i32, kGpu);
  argmax(idx, x);
  CHECK(count_correct(x, idx) == 50);
  std::vector<int32_t> wrong = idx.to_host_i32();
  for (auto& v : wrong) v = (v + 1) % 6;
  CHECK(count_correct(x, Tensor::from_ints(wrong, {50}, kGpu)) == 0);
  CHECK(count_correct(zeros(kGpu, {0, 6}), Tensor::from_ints({}, {0}, kGpu)) == 0);
}

// ---- convolution and pooling ---------------------------------------------------------------

namespace {
struct ConvCase {
  Shape x, w;
  Conv2dParams p;
};
Shape conv_out(const ConvCase& c) {
  return {c.x[0], c.w[0], conv_out_size(c.x[2], c.w[2], c.p.stride_h, c.p.pad_h),
          conv_out_size(c.x[3], c.w[3], c.p.stride_w, c.p.pad_w)};
}
}  // namespace

TEST_CASE("kernels.cuda.conv2d: forward, backward data and filter match CPU") {
  DP_REQUIRE_GPU();
  std::vector<ConvCase> cases = {
      {{3, 5, 11, 9}, {7, 5, 3, 2}, {1, 1, 0, 0}}, {{2, 3, 13, 12}, {4, 3, 3, 3}, {2, 2, 1, 1}},
      {{1, 8, 7, 7}, {6, 8, 1, 1}, {1, 1, 0, 0}},  {{4, 2, 9, 10}, {3, 2, 5, 3}, {2, 1, 2, 1}},
      {{0, 3, 8, 8}, {4, 3, 3, 3}, {1, 1, 1, 1}},  // empty batch
  };
  for (const ConvCase& c : cases) {
    CAPTURE(shape_str(c.x));
    CAPTURE(shape_str(c.w));
    Shape ys = conv_out(c);
    check_matches_cpu(
        [&](Device d) {
          Tensor x = rnd(d, c.x, 41), w = rnd(d, c.w, 42), dy = rnd(d, ys, 43);
          Tensor y = zeros(d, ys);
          conv2d_forward(y, x, w, c.p);
          Tensor dx = zeros(d, c.x), dx_acc = rnd(d, c.x, 44);
          conv2d_backward_data(dx, dy, w, c.p, Accumulate::no);
          conv2d_backward_data(dx_acc, dy, w, c.p, Accumulate::yes);
          Tensor dw = zeros(d, c.w), dw_acc = rnd(d, c.w, 45);
          conv2d_backward_filter(dw, dy, x, c.p, Accumulate::no);
          conv2d_backward_filter(dw_acc, dy, x, c.p, Accumulate::yes);
          return Outputs{y, dx, dx_acc, dw, dw_acc};
        },
        5e-4f);  // cuDNN may pick Winograd or FFT algorithms
  }
}

TEST_CASE("kernels.cuda.conv2d: weight views at any offset - same bits on every run") {
  DP_REQUIRE_GPU();
  ConvCase c{{2, 3, 10, 10}, {5, 3, 3, 3}, {1, 1, 1, 1}};
  Shape ys = conv_out(c);
  int64_t wn = shape_numel(c.w);
  check_matches_cpu(
      [&](Device d) {
        Tensor x = rnd(d, c.x, 46), dy = rnd(d, ys, 47);
        Tensor w = rnd(d, {wn + 1}, 48).view(1, c.w);  // 4-byte aligned only
        Tensor y = zeros(d, ys), dx = zeros(d, c.x);
        Tensor dw = zeros(d, {wn + 1}).view(1, c.w);
        conv2d_forward(y, x, w, c.p);
        conv2d_backward_data(dx, dy, w, c.p, Accumulate::no);
        conv2d_backward_filter(dw, dy, x, c.p, Accumulate::no);
        return Outputs{y, dx, dw};
      },
      5e-4f);
  Tensor x = rnd(kGpu, c.x, 46), dy = rnd(kGpu, ys, 47);
  Tensor dw1 = zeros(kGpu, c.w), dw2 = zeros(kGpu, c.w);
  conv2d_backward_filter(dw1, dy, x, c.p, Accumulate::no);
  conv2d_backward_filter(dw2, dy, x, c.p, Accumulate::no);
  CHECK(same_bits(dw1, dw2));
}

namespace {

// One unit in the last place of a 16-bit dtype at magnitude v >= 0: 2^(e - 7) (bf16) or
// 2^(e - 10) (f16) for 2^e <= v < 2^(e + 1); f16 subnormals have 2^-24.
double ulp16(DType t, double v) {
  int e = v > 0 ? std::ilogb(v) : -126;
  double ulp = std::ldexp(1.0, e - (t == DType::bf16 ? 7 : 10));
  return t == DType::f16 ? std::max(ulp, std::ldexp(1.0, -24)) : ulp;
}

Tensor abs_on_cpu(const Tensor& t) {
  std::vector<float> v = t.to_host_f32();
  for (float& x : v) x = std::fabs(x);
  return Tensor::from_vector(v, t.shape(), kCpu);
}

// The bound on |GPU - CPU| for one output of a 16-bit convolution pass, per element i.
// The inputs are 16-bit values, so every product is exact in f32 (8 x 8 or 11 x 11 significant
// bits); with S_i the sum of the |products| of element i (the same pass on |inputs|) and n its
// number of terms, each backend's f32 sum is within n 2^-23 S_i of the exact one (one f32 ulp
// per addition, in any order, also for tensor cores that truncate), so the two f32 results differ
// by at most b = 2 n 2^-23 S_i. Each is rounded once to 16 bits (half a 16-bit ulp each, at most
// one ulp of M = |r_cpu| (1 + 2^-7) + b, a bound on both magnitudes):
//   |r_gpu - r_cpu| <= t_r = ulp16(M) + b.
// Accumulate::yes adds both to the same prev: an f32 output rounds each sum once more (2^-24 of
// its magnitude each, 2^-23 m with m = |out_cpu| + t_r), a 16-bit output rounds each to 16 bits
// again (one more ulp of m (1 + 2^-7)).
void check_16bit_pass(const char* what, const Tensor& on_gpu, const Tensor& on_cpu,
                      const Tensor& cpu_result, const Tensor& sums, int64_t terms, DType dt,
                      DType out, Accumulate acc) {
  INFO(what, (acc == Accumulate::yes ? " (accumulate)" : ""));
  CHECK(on_gpu.device() == kGpu);
  CHECK(on_gpu.dtype() == out);
  std::vector<float> g = on_gpu.to_host_f32(), c = on_cpu.to_host_f32();
  std::vector<float> r = cpu_result.to_host_f32(), sum = sums.to_host_f32();
  REQUIRE(g.size() == c.size());
  REQUIRE(r.size() == c.size());
  const double f32_ulp = std::ldexp(1.0, -23), widen = 1.0 + std::ldexp(1.0, -7);
  int64_t outside = 0;
  std::string first;
  for (size_t i = 0; i < g.size(); ++i) {
    double b = 2.0 * static_cast<double>(terms) * f32_ulp * sum[i];
    double tol = ulp16(dt, std::fabs(r[i]) * widen + b) + b;
    if (acc == Accumulate::yes) {
      double m = std::fabs(c[i]) + tol;
      tol += out == DType::f32 ? f32_ulp * m : ulp16(dt, m * widen);
    }
    if (std::fabs(static_cast<double>(g[i]) - c[i]) <= tol) continue;
    if (outside++ == 0)
      first = "element " + std::to_string(i) + ": gpu " + std::to_string(g[i]) + " cpu " +
              std::to_string(c[i]) + " tol " + std::to_string(tol);
  }
  INFO(first);
  CHECK(outside == 0);
}

}  // namespace

TEST_CASE("kernels.cuda.conv2d: f16 and bf16 inputs match CPU (f32 or 16-bit output, accumulate)") {
  DP_REQUIRE_GPU();
  std::vector<ConvCase> cases = {
      {{3, 5, 11, 9}, {7, 5, 3, 2}, {1, 1, 0, 0}},     {{2, 3, 13, 12}, {4, 3, 3, 3}, {2, 2, 1, 1}},
      {{1, 8, 7, 7}, {6, 8, 1, 1}, {1, 1, 0, 0}},      {{4, 2, 9, 10}, {3, 2, 5, 3}, {2, 1, 2, 1}},
      {{2, 16, 12, 12}, {32, 16, 3, 3}, {1, 1, 1, 1}},  // tensor-core friendly channel counts
  };
  for (const ConvCase& c : cases)
    for (DType dt : {DType::bf16, DType::f16})
      for (DType out : {DType::f32, dt}) {
        CAPTURE(shape_str(c.x));
        CAPTURE(shape_str(c.w));
        CAPTURE(std::string(dtype_name(dt)));
        CAPTURE(std::string(dtype_name(out)));
        Shape ys = conv_out(c);
        auto run = [&](Device d) {
          Tensor x = rnd(d, c.x, 81, -1.f, 1.f, dt), w = rnd(d, c.w, 82, -1.f, 1.f, dt);
          Tensor dy = rnd(d, ys, 83, -1.f, 1.f, dt);
          Tensor y = Tensor::empty(ys, out, d), dx = Tensor::empty(c.x, out, d);
          Tensor dw = Tensor::empty(c.w, out, d);
          conv2d_forward(y, x, w, c.p);
          conv2d_backward_data(dx, dy, w, c.p, Accumulate::no);
          conv2d_backward_filter(dw, dy, x, c.p, Accumulate::no);
          Tensor dx_acc = rnd(d, c.x, 84, -1.f, 1.f, out), dw_acc = rnd(d, c.w, 85, -1.f, 1.f, out);
          conv2d_backward_data(dx_acc, dy, w, c.p, Accumulate::yes);
          conv2d_backward_filter(dw_acc, dy, x, c.p, Accumulate::yes);
          return Outputs{y, dx, dw, dx_acc, dw_acc, x, w, dy};
        };
        Outputs gpu = run(kGpu), cpu = run(kCpu);
        // Sums of |products| per output element: the f32 passes on |inputs| (16-bit values).
        Tensor ax = abs_on_cpu(cpu[5]), aw = abs_on_cpu(cpu[6]), ady = abs_on_cpu(cpu[7]);
        Tensor sy = Tensor::zeros(ys, DType::f32, kCpu), sdx = Tensor::zeros(c.x, DType::f32, kCpu);
        Tensor sdw = Tensor::zeros(c.w, DType::f32, kCpu);
        conv2d_forward(sy, ax, aw, c.p);
        conv2d_backward_data(sdx, ady, aw, c.p, Accumulate::no);
        conv2d_backward_filter(sdw, ady, ax, c.p, Accumulate::no);
        const int64_t fwd_terms = c.w[1] * c.w[2] * c.w[3], data_terms = c.w[0] * c.w[2] * c.w[3];
        const int64_t filter_terms = ys[0] * ys[2] * ys[3];
        check_16bit_pass("y", gpu[0], cpu[0], cpu[0], sy, fwd_terms, dt, out, Accumulate::no);
        check_16bit_pass("dx", gpu[1], cpu[1], cpu[1], sdx, data_terms, dt, out, Accumulate::no);
        check_16bit_pass("dw", gpu[2], cpu[2], cpu[2], sdw, filter_terms, dt, out, Accumulate::no);
        check_16bit_pass("dx", gpu[3], cpu[3], cpu[1], sdx, data_terms, dt, out, Accumulate::yes);
        check_16bit_pass("dw", gpu[4], cpu[4], cpu[2], sdw, filter_terms, dt, out, Accumulate::yes);
      }
}

TEST_CASE("kernels.cuda.pool2d: max and average pooling match CPU (ties, overlap, padding)") {
  DP_REQUIRE_GPU();
  {
    // A NaN in a window is its max, and its first NaN takes the gradient, as on the CPU.
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> xv = {1.f, nan, 0.f, 2.f, 4.f, 3.f, 1.f, 0.5f};  // two 2x2 windows
    Tensor x = Tensor::from_vector(xv, {1, 1, 2, 4}, Device::cuda(0));
    Tensor y = zeros(Device::cuda(0), {1, 1, 1, 2}), dx = zeros(Device::cuda(0), {1, 1, 2, 4});
    max_pool2d_forward(y, x, Pool2dParams{});
    max_pool2d_backward(dx, full(Device::cuda(0), {1, 1, 1, 2}, 5.f), x, y, Pool2dParams{},
                        Accumulate::no);
    const std::vector<float> ys = y.to_host_f32();
    CHECK(std::isnan(ys[0]));
    CHECK(ys[1] == 2.f);
    CHECK(dx.to_host_f32() == std::vector<float>{0.f, 5.f, 0.f, 5.f, 0.f, 0.f, 0.f, 0.f});
  }
  std::vector<std::pair<Shape, Pool2dParams>> cases = {
      {{2, 3, 8, 8}, {2, 2, 2, 2, 0, 0}},
      {{2, 3, 9, 7}, {3, 3, 2, 2, 1, 1}},  // overlapping windows, padding
      {{1, 2, 5, 6}, {3, 2, 1, 1, 1, 1}},  // stride 1: heavy overlap
      {{3, 1, 7, 9}, {2, 3, 3, 2, 1, 0}},
      {{0, 2, 6, 6}, {2, 2, 2, 2, 0, 0}},  // empty batch
  };
  for (const auto& [xs, p] : cases) {
    CAPTURE(shape_str(xs));
    Shape ys{xs[0], xs[1], conv_out_size(xs[2], p.kernel_h, p.stride_h, p.pad_h),
             conv_out_size(xs[3], p.kernel_w, p.stride_w, p.pad_w)};
    for (bool ties : {false, true}) {
      CAPTURE(ties);
      check_matches_cpu(
          [&](Device d) {
            // Negative inputs check that padding never wins a max.
            Tensor x = ties ? small_ints(d, xs, 49, 3) : rnd(d, xs, 49, -3.f, -1.f);
            Tensor dy = rnd(d, ys, 50);
            Tensor y = zeros(d, ys), dx = zeros(d, xs), dx_acc = rnd(d, xs, 51);
            max_pool2d_forward(y, x, p);
            max_pool2d_backward(dx, dy, x, y, p, Accumulate::no);
            max_pool2d_backward(dx_acc, dy, x, y, p, Accumulate::yes);
            Tensor ya = zeros(d, ys), dxa = zeros(d, xs), dxa_acc = rnd(d, xs, 52);
            avg_pool2d_forward(ya, x, p);
            avg_pool2d_backward(dxa, dy, p, Accumulate::no);
            avg_pool2d_backward(dxa_acc, dy, p, Accumulate::yes);
            return Outputs{y, dx, dx_acc, ya, dxa, dxa_acc};
          },
          1e-5f);
    }
  }
}

// ---- normalisation -------------------------------------------------------------------------

TEST_CASE("kernels.cuda.batch_norm: train, eval, backward match CPU ((N, C), (N, C, H, W))") {
  DP_REQUIRE_GPU();
  // (16, 4, 64, 64): 65536 elements per channel, split in 32 chunks per channel.
  for (Shape s : {Shape{37, 5}, Shape{3, 7, 5, 9}, Shape{2, 3, 40, 41}, Shape{16, 4, 64, 64}}) {
    CAPTURE(shape_str(s));
    int64_t c = s[1];
    check_matches_cpu(
        [&](Device d) {
          Tensor x = rnd(d, s, 53, -2.f, 3.f), gamma = rnd(d, {c}, 54), beta = rnd(d, {c}, 55);
          Tensor y = zeros(d, s), mean = zeros(d, {c}), invstd = zeros(d, {c});
          Tensor rmean = rnd(d, {c}, 56), rvar = rnd(d, {c}, 57, 0.5f, 2.f);
          batch_norm_forward_train(y, mean, invstd, rmean, rvar, x, gamma, beta, 0.1f, 1e-5f);
          Tensor ye = zeros(d, s);
          batch_norm_forward_eval(ye, x, gamma, beta, rmean, rvar, 1e-5f);
          Tensor dy = rnd(d, s, 58), dx = zeros(d, s);
          Tensor dgamma = zeros(d, {c}), dbeta = zeros(d, {c});
          batch_norm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, invstd, Accumulate::no);
          Tensor dx2 = zeros(d, s), dgamma_acc = rnd(d, {c}, 59), dbeta_acc = rnd(d, {c}, 60);
          batch_norm_backward(dx2, dgamma_acc, dbeta_acc, dy, x, gamma, mean, invstd,
                              Accumulate::yes);
          return Outputs{y,  mean,   invstd, rmean,      rvar,     ye,
                         dx, dgamma, dbeta,  dgamma_acc, dbeta_acc};
        },
        5e-4f);
  }
}

TEST_CASE("kernels.cuda.layer_norm: forward and backward match CPU - same bits on every run") {
  DP_REQUIRE_GPU();
  // 1000 rows use several row chunks for dgamma/dbeta; 700 features use 256-thread rows.
  for (Shape s : {Shape{5, 37}, Shape{1000, 37}, Shape{9, 700}, Shape{0, 16}}) {
    CAPTURE(shape_str(s));
    int64_t d_feat = s[1];
    check_matches_cpu(
        [&](Device d) {
          Tensor x = rnd(d, s, 61, -2.f, 3.f), gamma = rnd(d, {d_feat}, 62),
                 beta = rnd(d, {d_feat}, 63);
          Tensor y = zeros(d, s), mean = zeros(d, {s[0]}), rstd = zeros(d, {s[0]});
          layer_norm_forward(y, mean, rstd, x, gamma, beta, 1e-5f);
          Tensor dy = rnd(d, s, 64), dx = zeros(d, s);
          Tensor dgamma = zeros(d, {d_feat}), dbeta = zeros(d, {d_feat});
          layer_norm_backward(dx, dgamma, dbeta, dy, x, gamma, mean, rstd, Accumulate::no);
          Tensor dgamma_acc = rnd(d, {d_feat}, 65), dbeta_acc = rnd(d, {d_feat}, 66);
          layer_norm_backward(dx, dgamma_acc, dbeta_acc, dy, x, gamma, mean, rstd, Accumulate::yes);
          return Outputs{y, mean, rstd, dx, dgamma, dbeta, dgamma_acc, dbeta_acc};
        },
        5e-4f);
  }
  Shape s{1000, 37};
  Tensor x = rnd(kGpu, s, 61), gamma = rnd(kGpu, {37}, 62), beta = rnd(kGpu, {37}, 63);
  Tensor y = zeros(kGpu, s), mean = zeros(kGpu, {1000}), rstd = zeros(kGpu, {1000});
  layer_norm_forward(y, mean, rstd, x, gamma, beta, 1e-5f);
  Tensor dy = rnd(kGpu, s, 64), dx = zeros(kGpu, s);
  Tensor g1 = zeros(kGpu, {37}), b1 = zeros(kGpu, {37}), g2 = zeros(kGpu, {37}),
         b2 = zeros(kGpu, {37});
  layer_norm_backward(dx, g1, b1, dy, x, gamma, mean, rstd, Accumulate::no);
  layer_norm_backward(dx, g2, b2, dy, x, gamma, mean, rstd, Accumulate::no);
  CHECK(same_bits(g1, g2));
  CHECK(same_bits(b1, b2));
}

TEST_CASE(
    "kernels.cuda.layer_norm: the fused skip sum and backward add are the separate ops' bits") {
  DP_REQUIRE_GPU();
  // On the GPU the fused kernels (add_layer_norm_forward, layer_norm_backward_add) give the bits
  // of add then layer_norm_forward, and of layer_norm_backward then add, in an f32 and a bf16
  // stream; they agree with the CPU's fused ops within the unfused ops' tolerance.
  // 700 features use 256-thread rows and strided loads; 1000 rows several column chunks. 768
  // (GPT-2's width) and 4104 (more packs than threads) take the pack kernels, whose sums' order
  // depends on the width alone: with a, b and dskip one value off alignment (the fused op then
  // moves its packs one value at a time, the separate ops' fresh h and dnorm sixteen bytes at a
  // time) the bits are the same.
  for (const Shape& s : {Shape{1000, 700}, Shape{64, 768}, Shape{24, 4104}})
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (bool off : {false, true}) {
        CAPTURE(dt);
        CAPTURE(shape_str(s));
        CAPTURE(off);
        const int64_t rows = s[0], feat = s[1];
        // One value past an aligned start when `off`.
        auto operand = [&](Device d, uint32_t seed, float lo, float hi) {
          if (!off) return rnd(d, s, seed, lo, hi, dt);
          return rnd(d, {rows * feat + 1}, seed, lo, hi, dt).view(1, s);
        };
        auto run = [&](Device d, bool fused) {
          Tensor a = operand(d, 71, -2.f, 2.f), b = operand(d, 72, -0.5f, 0.5f);
          Tensor gamma = rnd(d, {feat}, 73, 0.5f, 1.5f), beta = rnd(d, {feat}, 74);
          Tensor h = Tensor::zeros(s, dt, d), y = Tensor::zeros(s, dt, d);
          Tensor mean = zeros(d, {rows}), rstd = zeros(d, {rows});
          Tensor dy = rnd(d, s, 75, -1.f, 1.f, dt), dskip = operand(d, 76, -1.f, 1.f);
          Tensor dx = Tensor::zeros(s, dt, d), dg = rnd(d, {feat}, 77), db = rnd(d, {feat}, 78);
          if (fused) {
            add_layer_norm_forward(h, y, mean, rstd, a, b, gamma, beta, 1e-5f);
            layer_norm_backward_add(dx, dg, db, dy, dskip, h, gamma, mean, rstd, Accumulate::yes);
          } else {
            add(h, a, b);
            layer_norm_forward(y, mean, rstd, h, gamma, beta, 1e-5f);
            Tensor dnorm = Tensor::zeros(s, dt, d);
            layer_norm_backward(dnorm, dg, db, dy, h, gamma, mean, rstd, Accumulate::yes);
            add(dx, dskip, dnorm);
          }
          return Outputs{h, y, mean, rstd, dx, dg, db};
        };
        Outputs fused = run(kGpu, true), separate = run(kGpu, false);
        for (size_t i = 0; i < fused.size(); ++i) {
          INFO("output ", i);
          CHECK(same_bits(fused[i], separate[i]));
        }
        // 16-bit outputs may differ from the CPU's by one rounding step (bf16: 2^-8 of values up
        // to ~4).
        check_matches_cpu([&](Device d) { return run(d, true); }, dt == DType::f32 ? 5e-4f : 5e-2f);
      }
}

// ---- dropout -------------------------------------------------------------------------------

TEST_CASE("kernels.cuda.dropout: the same mask as the CPU bit for bit (any offset)") {
  DP_REQUIRE_GPU();
  // The last offsets wrap past 2^64 within the tensor: counters are modulo 2^64 on both.
  for (uint64_t offset :
       {uint64_t{0}, uint64_t{6}, uint64_t{(1ull << 32) + 3}, ~uint64_t{0}, ~uint64_t{0} - 4}) {
    for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1237}}) {
      CAPTURE(offset);
      CAPTURE(n);
      check_matches_cpu(
          [&](Device d) {
            Tensor x = rnd(d, {n}, 67), y = zeros(d, {n}), mask = zeros(d, {n});
            dropout_forward(y, mask, x, 0.3f, 0x1234abcdull, offset);
            return Outputs{y, mask};
          },
          0.f);
    }
  }
}

// The native 16-bit kernels on the GPU (tests/native16_cases.hpp): each equals the GPU's own
// widening path (cast kernels, the f32 kernel, a cast back) bit for bit, and converts nothing
// (DeviceContext::casts). Where the f32 kernels of both backends are exactly rounded arithmetic
// (add, mul, add_bias, relu and its gradient, dropout, max pooling forward), the GPU's 16-bit
// results are the CPU's too, value for value (a NaN may carry another payload on each backend).
TEST_CASE(
    "kernels.cuda.native16: 16-bit kernels equal the widening path, and the CPU where exact") {
  DP_REQUIRE_GPU();
  struct Group {
    const char* name;
    native16::Results (*cases)(Device, DType);
  };
  const Group groups[] = {{"elementwise", native16::elementwise},
                          {"bias", native16::bias},
                          {"activations", native16::activations},
                          {"dropout", native16::dropout},
                          {"pooling", native16::pooling},
                          {"layer_norm", native16::layer_norm},
                          {"embedding", native16::embedding},
                          {"losses", native16::losses},
                          {"llama", native16::llama}};
  auto exact_across_backends = [](const std::string& what) {
    for (const char* op :
         {"add", "mul", "add_bias", "relu", "dropout_forward", "max_pool2d_forward",
          "embedding_backward", "argmax", "count_correct_into"})
      if (what.rfind(std::string(op) + " ", 0) == 0) return true;
    return false;
  };
  for (DType t : {DType::bf16, DType::f16})
    for (const Group& g : groups) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(g.name);
      const native16::Results gpu = g.cases(kGpu, t);
      const native16::Results cpu = g.cases(kCpu, t);
      REQUIRE(gpu.size() == cpu.size());
      for (size_t i = 0; i < gpu.size(); ++i) {
        CAPTURE(gpu[i].what);
        CHECK(gpu[i].native.device() == kGpu);
        CHECK(native16::equal(gpu[i]));
        if (exact_across_backends(gpu[i].what))
          CHECK(native16::same_values(gpu[i].native, cpu[i].native));
      }
    }
  // No cast kernel: the ops read and write the 16-bit tensors themselves.
  DeviceContext& ctx = context(kGpu);
  Tensor x = rnd(kGpu, {4, 33}, 81, -2.f, 2.f, DType::bf16), b = rnd(kGpu, {33}, 82);
  Tensor y = Tensor::empty({4, 33}, DType::bf16, kGpu);
  Tensor dx = Tensor::zeros({4, 33}, DType::bf16, kGpu);
  const int64_t casts = ctx.casts();
  gelu_tanh(y, x);
  add(y, y, b);
  add_bias(y, b);
  gelu_tanh_backward(dx, y, x, Accumulate::yes);
  bias_backward(b, dx, Accumulate::yes);
  Tensor mean = Tensor::empty({4}, DType::f32, kGpu), rstd = Tensor::empty({4}, DType::f32, kGpu);
  Tensor gamma = rnd(kGpu, {33}, 83), dgamma = rnd(kGpu, {33}, 84), dbeta = rnd(kGpu, {33}, 85);
  layer_norm_forward(y, mean, rstd, x, gamma, b, 1e-5f);
  layer_norm_backward(dx, dgamma, dbeta, y, x, gamma, mean, rstd, Accumulate::yes);
  Tensor loss = Tensor::empty({1}, DType::f32, kGpu);
  Tensor targets = Tensor::from_ints({1, 0, 32, -1}, {4}, kGpu);
  token_cross_entropy(loss, dx, y, targets, -1);
  count_correct_into(loss, y, targets);
  CHECK(ctx.casts() == casts);
}

TEST_CASE("kernels.cuda.attention: forward and backward match CPU, dropout mask included") {
  DP_REQUIRE_GPU();
  for (float drop : {0.f, 0.25f}) {
    CAPTURE(drop);
    check_matches_cpu(
        [&](Device d) {
          const int64_t b = 2, t = 11, heads = 2, width = 16;
          AttentionParams p{heads, 0.3f, AttentionMask::causal};
          p.dropout = drop, p.dropout_seed = 0xabcull, p.dropout_offset = 7;
          Tensor qkv = rnd(d, {b, t, 3 * width}, 71), dy = rnd(d, {b, t, width}, 72);
          Tensor y = zeros(d, {b, t, width}), lse = zeros(d, {b, heads, t});
          Tensor dqkv = zeros(d, {b, t, 3 * width});
          attention_forward(y, lse, qkv, p);
          attention_backward(dqkv, dy, qkv, y, lse, p);
          return Outputs{y, lse, dqkv};
        },
        1e-5f);
  }
}

// ---- embedding -----------------------------------------------------------------------------

// dtable starts from nonzero values and gathers many rows per id, in an order that rounding
// makes visible: float atomics would differ from the CPU, and from run to run.
TEST_CASE("kernels.cuda: embedding backward adds in position order: bitwise the CPU's, every run") {
  DP_REQUIRE_GPU();
  struct Shape3 {
    int64_t n, vocab, d;
  };
  // Many repeats (about 80 per id); more ids in the table than positions; a width that is not
  // a multiple of the block (300 = 256 + 44); one id for every position (one run of 1000).
  for (Shape3 k :
       {Shape3{4096, 50, 96}, Shape3{300, 5000, 64}, Shape3{2049, 37, 300}, Shape3{1000, 1, 33}}) {
    CAPTURE(k.n);
    CAPTURE(k.vocab);
    CAPTURE(k.d);
    Tensor expected = rnd(kCpu, {k.vocab, k.d}, 83);
    embedding_backward(expected, rnd(kCpu, {k.n, k.d}, 82), labels(kCpu, k.n, k.vocab, 81));
    Tensor ids = labels(kGpu, k.n, k.vocab, 81), dy = rnd(kGpu, {k.n, k.d}, 82);
    for (int run = 0; run < 2; ++run) {
      CAPTURE(run);
      Tensor dtable = rnd(kGpu, {k.vocab, k.d}, 83);
      embedding_backward(dtable, dy, ids);
      CHECK(same_bits(dtable, expected));
    }
  }
  // Captured once warm: the capture allocates nothing and every replay gives the same bits.
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  const int64_t n = 4096, vocab = 50, d = 96;
  Tensor expected = rnd(kCpu, {vocab, d}, 83);
  embedding_backward(expected, rnd(kCpu, {n, d}, 82), labels(kCpu, n, vocab, 81));
  Tensor ids = labels(kGpu, n, vocab, 81), dy = rnd(kGpu, {n, d}, 82);
  Tensor start = rnd(kGpu, {vocab, d}, 83), dtable = start.clone();
  embedding_backward(dtable, dy, ids);  // eager, and warms the cache for the capture
  CHECK(same_bits(dtable, expected));
  const int64_t allocations = ctx.memory()->allocations.load();
  Graph g;
  g.capture(ctx, [&] { embedding_backward(dtable, dy, ids); });
  CHECK(ctx.memory()->allocations.load() == allocations);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    copy(dtable, start);
    g.replay();
    CHECK(same_bits(dtable, expected));
  }
}

// ---- optimizers ----------------------------------------------------------------------------

TEST_CASE("kernels.cuda.sgd_update and adamw_update: three steps match CPU") {
  DP_REQUIRE_GPU();
  const int64_t n = 1237;
  std::vector<SgdConfig> sgd = {
      {0.1f, 0.f, 0.f, 0.f, Nesterov::no},
      {0.05f, 0.9f, 0.1f, 1e-2f, Nesterov::no},
      {0.05f, 0.9f, 0.f, 1e-3f, Nesterov::yes},
  };
  for (size_t i = 0; i < sgd.size(); ++i) {
    CAPTURE(i);
    check_matches_cpu(
        [&](Device d) {
          Tensor p = rnd(d, {n}, 68), buf = zeros(d, {n});
          for (int64_t step = 1; step <= 3; ++step)
            dp_test::sgd_step(p, rnd(d, {n}, 69 + static_cast<uint32_t>(step)), buf, sgd[i], step);
          return Outputs{p, buf};
        },
        1e-6f);
  }
  check_matches_cpu(
      [&](Device d) {
        AdamWConfig c;
        c.lr = 1e-2f;
        Tensor p = rnd(d, {n}, 73), m = zeros(d, {n}), v = zeros(d, {n});
        for (int64_t step = 1; step <= 3; ++step)
          dp_test::adamw_step(p, rnd(d, {n}, 74 + static_cast<uint32_t>(step)), m, v, c, step);
        return Outputs{p, m, v};
      },
      1e-6f);
}

TEST_CASE("kernels.cuda.sgd_update and adamw_update: grad_unscale != 1 matches CPU") {
  DP_REQUIRE_GPU();
  const int64_t n = 1237;
  const float unscale = 1.f / 1024.f;  // loss scale 1024: gradients of up to ~1e3
  SgdConfig sgd{0.05f, 0.9f, 0.1f, 1e-2f, Nesterov::yes};
  sgd.grad_unscale = unscale;
  check_matches_cpu(
      [&](Device d) {
        Tensor p = rnd(d, {n}, 75), buf = zeros(d, {n});
        for (int64_t step = 1; step <= 3; ++step)
          dp_test::sgd_step(p, rnd(d, {n}, 76 + static_cast<uint32_t>(step), -1024.f, 1024.f), buf,
                            sgd, step);
        return Outputs{p, buf};
      },
      1e-6f);
  AdamWConfig adam;
  adam.lr = 1e-2f;
  adam.grad_unscale = 0.3f;  // not a power of two: the product rounds the same on both
  check_matches_cpu(
      [&](Device d) {
        Tensor p = rnd(d, {n}, 80), m = zeros(d, {n}), v = zeros(d, {n});
        for (int64_t step = 1; step <= 3; ++step)
          dp_test::adamw_step(p, rnd(d, {n}, 81 + static_cast<uint32_t>(step), -4.f, 4.f), m, v,
                              adam, step);
        return Outputs{p, m, v};
      },
      1e-6f);
}

TEST_CASE("kernels.cuda.adamw_update_grouped: three steps with per-group scalars match CPU") {
  DP_REQUIRE_GPU();
  const int64_t n = 1237;
  AdamWConfig c;
  AdamWGroups groups;
  groups.count = 3;
  groups.lr_scale[1] = 0.5f;
  groups.weight_decay[0] = 0.1f;
  groups.weight_decay[2] = 0.01f;
  Tensor ids = Tensor::zeros({n}, DType::u8, kCpu);
  for (int64_t i = 0; i < n; ++i) ids.data<uint8_t>()[i] = static_cast<uint8_t>(i * 7 % 3);
  check_matches_cpu(
      [&](Device d) {
        Tensor p = rnd(d, {n}, 83), m = zeros(d, {n}), v = zeros(d, {n});
        Tensor group_of = ids.to(d);
        Tensor scalars = zeros(d, {kMaxValues});
        for (int64_t step = 1; step <= 3; ++step) {
          c.lr = 1e-2f / static_cast<float>(step);
          const auto s = adamw_scalars(c, groups, step);
          set_values(scalars, s.data(), static_cast<int>(s.size()));
          adamw_update_grouped(p, rnd(d, {n}, 84 + static_cast<uint32_t>(step)), m, v, group_of, c,
                               scalars);
        }
        return Outputs{p, m, v};
      },
      1e-6f);
}

// The wide kernels (eight values a thread for casts, four for AdamW) give the one-wide kernels'
// bits: the same data in an aligned buffer and in a view one value off 16-byte alignment (which
// runs one-wide throughout).
TEST_CASE("kernels.cuda.cast and adamw_update: the wide kernels give the one-wide bits") {
  DP_REQUIRE_GPU();
  const int64_t n = 4099;  // a bulk and a tail of every width
  auto off_by_one = [](const Tensor& t) {
    Tensor big = Tensor::zeros({t.numel() + 1}, t.dtype(), t.device());
    Tensor v = big.view(1, t.shape());
    copy(v, t);
    return v;
  };
  auto same = [](const Tensor& a, const Tensor& b) {
    Tensor x = a.to(kCpu), y = b.to(kCpu);
    return std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
  };
  for (DType from : {DType::f32, DType::f16, DType::bf16}) {
    for (DType to : {DType::f32, DType::f16, DType::bf16}) {
      CAPTURE(dtype_name(from));
      CAPTURE(dtype_name(to));
      // Values an f16 overflows on or rounds to a subnormal, and NaN and infinities.
      std::vector<float> v = dp_test::random_vector(n, 91, -7e4f, 7e4f);
      v[5] = std::numeric_limits<float>::quiet_NaN();
      v[9] = -std::numeric_limits<float>::infinity();
      v[13] = 3e-6f;
      Tensor x = Tensor::from_vector(v, {n}, kGpu, from);
      Tensor wide = cast(x, to), narrow = cast(off_by_one(x), to);
      CHECK(same(wide, narrow));
    }
  }
  AdamWConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 0.1f;
  Tensor p = rnd(kGpu, {n}, 92), m = zeros(kGpu, {n}), v = zeros(kGpu, {n});
  Tensor p1 = off_by_one(p), m1 = off_by_one(m), v1 = off_by_one(v);
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor g = rnd(kGpu, {n}, 93 + static_cast<uint32_t>(step), -4.f, 4.f);
    dp_test::adamw_step(p, g, m, v, c, step);
    dp_test::adamw_step(p1, off_by_one(g), m1, v1, c, step);
  }
  CHECK(same(p, p1));
  CHECK(same(m, m1));
  CHECK(same(v, v1));
}

TEST_CASE("kernels.cuda.compute_copy: the fused steps write cast()'s 16-bit copy, wide or not") {
  DP_REQUIRE_GPU();
  int checks = 0;
  compute_copy::run(kGpu, [&](const std::string& what, bool ok) {
    CAPTURE(what);
    CHECK(ok);
    ++checks;
  });
  CHECK(checks == 3 * 2 * 2 * 11);
}

// The values travel in the launch's arguments: the host array is overwritten right after the
// call, before the stream runs the kernel, and the tensor still gets the first values.
TEST_CASE("kernels.cuda.set_values: writes the values given at the call, bit for bit") {
  DP_REQUIRE_GPU();
  Tensor dst = full(kGpu, {40}, -1.f);
  std::vector<float> values(kMaxValues);
  for (int i = 0; i < kMaxValues; ++i) values[i] = 1.f / static_cast<float>(i + 3);
  const std::vector<float> want = values;
  set_values(dst, values.data(), kMaxValues);
  std::fill(values.begin(), values.end(), 99.f);
  set_values(dst, values.data(), 0);  // nothing
  const std::vector<float> got = dst.to_host_f32();
  for (int i = 0; i < kMaxValues; ++i) CHECK(got[i] == want[i]);
  for (int i = kMaxValues; i < 40; ++i) CHECK(got[i] == -1.f);
}

TEST_CASE("kernels.cuda.all_finite and non_finite_into: NaN and inf anywhere, f32 and 16-bit") {
  DP_REQUIRE_GPU();
  const int64_t n = 100003;
  // The verdict read back at once, and left on the device (0 finite, 1 not) for a graph.
  auto on_device = [](const Tensor& x) {
    Tensor flag = full(kGpu, {1}, 5.f);
    non_finite_into(flag, x);
    return flag.item();
  };
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(t));
    std::vector<float> v = dp_test::random_vector(n, 78);
    CHECK(all_finite(Tensor::from_vector(v, {n}, kGpu, t)));
    CHECK(on_device(Tensor::from_vector(v, {n}, kGpu, t)) == 0.f);
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      // In the eight-wide bulk (first and inside a group), in the tail, and in a view one
      // value off the 16-byte alignment (all one-wide).
      for (int64_t at : {int64_t{0}, int64_t{50005}, n - 1}) {
        std::vector<float> w = v;
        w[at] = bad;
        CHECK_FALSE(all_finite(Tensor::from_vector(w, {n}, kGpu, t)));
        CHECK(on_device(Tensor::from_vector(w, {n}, kGpu, t)) == 1.f);
        CHECK(on_device(Tensor::from_vector(w, {n}, kGpu, t).view(1, {n - 1})) ==
              (at == 0 ? 0.f : 1.f));
      }
    }
  }
  CHECK(all_finite(zeros(kGpu, {0})));
}

// ---- devices and memory --------------------------------------------------------------------

TEST_CASE("kernels.cuda.devices: logical devices cuda:0 and cuda:1 share a GPU - copies work") {
  DP_REQUIRE_GPU();
  const Device gpu1 = Device::cuda(1);
  const int64_t m = 17, n = 23, k = 19;
  Tensor a_cpu = rnd(kCpu, {m, k}, 79), b_cpu = rnd(kCpu, {k, n}, 80);
  Tensor c_cpu = zeros(kCpu, {m, n});
  gemm(c_cpu, a_cpu, Transpose::no, b_cpu, Transpose::no);
  relu(c_cpu, c_cpu);

  Tensor a1 = rnd(gpu1, {m, k}, 79), b1 = rnd(gpu1, {k, n}, 80), c1 = zeros(gpu1, {m, n});
  gemm(c1, a1, Transpose::no, b1, Transpose::no);
  relu(c1, c1);
  CHECK(diff(c1, c_cpu) <= 2e-5f);
  // cuda:1 -> cuda:0: the copy runs on cuda:0's stream, so cuda:1's work must be done first.
  context(gpu1).synchronize();
  Tensor c0 = Tensor::empty({m, n}, DType::f32, kGpu);
  copy(c0, c1);
  CHECK(same_bits(c0, c1));
  // And back, through an op on cuda:0 first.
  scale(c0, c0, 2.f);
  context(kGpu).synchronize();
  Tensor back = Tensor::empty({m, n}, DType::f32, gpu1);
  copy(back, c0);
  Tensor twice = zeros(kCpu, {m, n});
  scale(twice, c_cpu, 2.f);
  CHECK(diff(back, twice) <= 4e-5f);
}

TEST_CASE("kernels.cuda.clip_by_norm: the host formula's bits, computed on the device") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  for (float max_norm : {0.5f, 100.f}) {
    for (float unscale : {1.f, 1.f / 128.f}) {
      for (int odd : {0, 1, 2}) {  // none, a NaN, a finite value whose square overflows
        CAPTURE(max_norm);
        CAPTURE(unscale);
        CAPTURE(odd);
        std::vector<float> v = rnd(kCpu, {5000}, 91, -0.3f, 0.3f).to_host_f32();
        if (odd == 1) v[4321] = std::nanf("");
        if (odd == 2) v[4321] = 2e20f;  // the norm reads inf: factor 0, PyTorch's
        // Before: the sum of squares read to the host, the norm and factor computed there.
        Tensor before = Tensor::from_vector(v, {5000}, kGpu);
        Tensor ss = zeros(kGpu, {1});
        sum_squares(ss, before);
        const double norm = std::sqrt(static_cast<double>(ss.item())) * unscale;
        if (odd == 2) CHECK(std::isinf(norm));
        if (!std::isnan(norm) && norm > max_norm)
          scale(before, before, static_cast<float>(max_norm / (norm + 1e-6)));
        // Now: the same on the device, the norm left in a slot, no host read.
        Tensor now = Tensor::from_vector(v, {5000}, kGpu);
        Tensor metrics = zeros(kGpu, {3}), slot = metrics.view(1, {1});
        const int64_t syncs = ctx.host_syncs();
        sum_squares(slot, now);
        clip_by_norm(now, slot, slot, max_norm, unscale);
        CHECK(ctx.host_syncs() == syncs);
        CHECK(same_bits(now, before));
        CHECK(same_bits(slot, Tensor::from_vector({static_cast<float>(norm)}, {1})));
        CHECK(metrics.to_host_f32()[0] == 0.f);
        // From one sum of squares, the CPU and CUDA ops agree bit for bit.
        Tensor on_cpu = Tensor::from_vector(v, {5000}, kCpu), cpu_norm = zeros(kCpu, {1});
        Tensor gpu_norm = zeros(kGpu, {1});
        clip_by_norm(on_cpu, cpu_norm, ss.to(kCpu), max_norm, unscale);
        Tensor on_gpu = Tensor::from_vector(v, {5000}, kGpu);
        clip_by_norm(on_gpu, gpu_norm, ss, max_norm, unscale);
        CHECK(same_bits(on_gpu, on_cpu));
        CHECK(same_bits(gpu_norm, cpu_norm));
      }
    }
  }
}

TEST_CASE("kernels.cuda.memory: per-step allocations return to the start value") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  ctx.synchronize();
  const int64_t start = ctx.memory()->current.load();
  for (int step = 0; step < 5; ++step) {
    {
      Tensor x = rnd(kGpu, {64, 128}, 81), w = rnd(kGpu, {32, 128}, 82), b = rnd(kGpu, {32}, 83);
      Tensor y = zeros(kGpu, {64, 32});
      gemm(y, x, Transpose::no, w, Transpose::yes, 1.f, 0.f, b);
      Tensor h = zeros(kGpu, {64, 32});
      relu(h, y);
      Tensor loss = zeros(kGpu, {1}), dh = zeros(kGpu, {64, 32});
      softmax_cross_entropy(loss, dh, h, labels(kGpu, 64, 32, 84));
      Tensor db = zeros(kGpu, {32});
      bias_backward(db, dh, Accumulate::no);
      CHECK(std::isfinite(loss.item()));
      CHECK(ctx.memory()->current.load() > start);
    }
    ctx.synchronize();
    CHECK(ctx.memory()->current.load() == start);
  }
}

#if DP_HAVE_CUDA
TEST_CASE("kernels.cuda.empty: the backend itself handles zero-sized inputs") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  // Column sums over zero rows write zeros (or keep the values when accumulating).
  Tensor db = full(kGpu, {5}, 7.f);
  cuda::bias_backward(db, zeros(kGpu, {0, 5}), Accumulate::no, ctx);
  CHECK(db.to_host_f32() == std::vector<float>(5, 0.f));
  Tensor dg = full(kGpu, {4}, 7.f), dbeta = full(kGpu, {4}, 7.f);
  Tensor none = zeros(kGpu, {0, 4}), rows = zeros(kGpu, {0});
  cuda::layer_norm_backward(none, dg, dbeta, none, none, full(kGpu, {4}, 1.f), rows, rows,
                            Accumulate::yes, ctx);
  CHECK(dg.to_host_f32() == std::vector<float>(4, 7.f));
  // Reductions of nothing are 0.
  Tensor out = full(kGpu, {1}, 3.f);
  cuda::sum(out, zeros(kGpu, {0}), ctx);
  CHECK(out.item() == 0.f);
  cuda::mean(out, zeros(kGpu, {0}), ctx);
  CHECK(out.item() == 0.f);
  Tensor loss = full(kGpu, {1}, 3.f), no_grad, right = full(kGpu, {1}, 3.f);
  cuda::softmax_cross_entropy(loss, no_grad, zeros(kGpu, {0, 3}), Tensor::from_ints({}, {0}, kGpu),
                              Tensor(), 0.f, right, Scalar(), ctx);
  CHECK(loss.item() == 0.f);
  CHECK(right.item() == 0.f);
  CHECK(cuda::count_correct(zeros(kGpu, {0, 3}), Tensor::from_ints({}, {0}, kGpu), ctx) == 0);
  // Convolutions with an empty batch: dw is zeroed, y untouched (nothing to write).
  Tensor dw = full(kGpu, {2, 3, 3, 3}, 7.f);
  cuda::conv2d_backward_filter(dw, zeros(kGpu, {0, 2, 4, 4}), zeros(kGpu, {0, 3, 4, 4}),
                               Conv2dParams{1, 1, 1, 1}, Accumulate::no, ctx);
  CHECK(dw.to_host_f32() == std::vector<float>(54, 0.f));
}

TEST_CASE(
    "kernels.cuda.softmax_cross_entropy: a bad label throws the CPU's text at the read, or its "
    "fault word says so") {
  DP_REQUIRE_GPU();
  Tensor logits = rnd(kGpu, {2, 3}, 90);
  Tensor loss = zeros(kGpu, {1}), dlogits = zeros(kGpu, {2, 3});
  // The same text as the CPU backend, which tests/test_kernels_loss.cpp pins; the first bad
  // row wins when there are several.
  for (auto [lab, row, label] :
       {std::tuple<std::vector<int32_t>, int, int>{{0, 3}, 1, 3}, {{-1, 7}, 0, -1}}) {
    softmax_cross_entropy(loss, dlogits, logits, Tensor::from_ints(lab, {2}, kGpu));
    std::string what;
    try {
      (void)loss.item();  // the host read reports the device-side fault
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(what == bad_label_text(label, row, 2, 3));
    CHECK(what == "softmax_cross_entropy: label " + std::to_string(label) + " of row " +
                      std::to_string(row) + " is outside [0, 3) for logits [2, 3]");
  }
  // A read elsewhere (another device's metrics, a lagged read) takes the record's first word:
  // it says a fault was written, and the context's synchronize() then reports its text.
  DeviceContext& ctx = context(kGpu);
  Tensor word = zeros(kGpu, {2});
  queue_fault_word(word, ctx);
  CHECK(!fault_written(word.to_host_f32().data()));
  softmax_cross_entropy(loss, dlogits, logits, Tensor::from_ints({0, 4}, {2}, kGpu));
  queue_fault_word(word, ctx);
  Tensor host = Tensor::empty_pinned({2}, DType::f32);
  queue_read_back(host, word);  // reports nothing itself
  Event read(Event::Timing::off);
  read.record(ctx);
  read.synchronize();
  CHECK(fault_written(host.data<float>()));
  CHECK_THROWS_WITH_AS(ctx.synchronize(), doctest::Contains("label 4 of row 1"), Error);
  queue_fault_word(word, ctx);
  CHECK(!fault_written(word.to_host_f32().data()));  // reported once, then cleared
  // No trap: the context, and every logical device sharing the GPU, stays usable.
  softmax_cross_entropy(loss, dlogits, logits, Tensor::from_ints({0, 2}, {2}, kGpu));
  CHECK(std::isfinite(loss.item()));
  Tensor y = zeros(Device::cuda(1), {4});
  fill(y, 2.f);
  CHECK(y.to_host_f32() == std::vector<float>(4, 2.f));
}

TEST_CASE(
    "kernels.cuda.token_cross_entropy: matches CPU (ignored rows, all ignored, masked logits, "
    "chunks)") {
  DP_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t vocab : {int64_t{5}, int64_t{1000}}) {
    CAPTURE(vocab);
    check_matches_cpu(
        [&](Device d) {
          const int64_t rows = 41;
          std::vector<float> x =
              dp_test::random_vector(static_cast<size_t>(rows * vocab), 120, -5.f, 5.f);
          for (int64_t r = 0; r < rows; r += 3) x[r * vocab + (r + 1) % vocab] = -inf;  // masked
          Tensor logits = Tensor::from_vector(x, {rows, vocab}, d);
          std::vector<int32_t> t = labels(kCpu, rows, vocab, 121).to_host_i32();
          for (int64_t r = 0; r < rows; r += 3) t[r] = static_cast<int32_t>(r % vocab);
          for (int64_t r = 1; r < rows; r += 4) t[r] = -100;  // ignored
          Tensor targets = Tensor::from_ints(t, {rows}, d);
          Tensor loss = zeros(d, {1}), dlogits = full(d, {rows, vocab}, 7.f), none;
          token_cross_entropy(loss, dlogits, logits, targets, -100);
          Tensor forward_only = zeros(d, {1});
          token_cross_entropy(forward_only, none, logits, targets, -100);
          // Every row ignored: loss 0, gradient 0.
          Tensor all_ignored = full(d, {1}, 3.f), zero_grad = full(d, {rows, vocab}, 7.f);
          token_cross_entropy(all_ignored, zero_grad, logits,
                              Tensor::from_ints(std::vector<int32_t>(rows, -100), {rows}, d), -100);
          // In chunks of 10 rows, each given the batch's kept count (count_kept): the calls of
          // the chunked classifier (nn::Gpt, GptConfig::loss_chunk).
          Tensor kept = zeros(d, {1}), parts = zeros(d, {5}), dparts = full(d, {rows, vocab}, 7.f);
          count_kept(kept, targets, -100);
          for (int64_t j = 0, r0 = 0; r0 < rows; ++j, r0 += 10) {
            const int64_t r1 = std::min(rows, r0 + 10);
            Tensor part = parts.view(j, {1}), dj = dparts.slice(r0, r1);
            token_cross_entropy(part, dj, logits.slice(r0, r1), targets.slice(r0, r1), -100,
                                Tensor(), Scalar(), kept);
          }
          return Outputs{loss, dlogits, forward_only, all_ignored, zero_grad, kept, parts, dparts};
        },
        5e-5f);
  }
  // A target outside [0, V) that is not ignore_index: the CPU's text at the next read.
  Tensor loss = zeros(kGpu, {1}), none;
  token_cross_entropy(loss, none, rnd(kGpu, {3, 4}, 122),
                      Tensor::from_ints({0, -100, 9}, {3}, kGpu), -100);
  std::string what;
  try {
    (void)loss.item();
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK(what == bad_label_text(9, 2, 3, 4));
}

TEST_CASE("kernels.cuda.plans: GEMM and convolution plans are built once per shape and context") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  Tensor a = rnd(kGpu, {40, 24}, 91), b = rnd(kGpu, {16, 24}, 92), bias = rnd(kGpu, {16}, 93);
  Tensor c = zeros(kGpu, {40, 16});
  gemm(c, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, bias);
  cuda::PlanCounts g0 = cuda::gemm_plan_counts(ctx);
  for (int i = 0; i < 3; ++i) gemm(c, a, Transpose::no, b, Transpose::yes, 1.f, 0.f, bias);
  cuda::PlanCounts g1 = cuda::gemm_plan_counts(ctx);
  CHECK(g1.hits == g0.hits + 3);
  CHECK(g1.misses == g0.misses);
  Tensor c2 = zeros(kGpu, {41, 16}), a2 = rnd(kGpu, {41, 24}, 94);
  gemm(c2, a2, Transpose::no, b, Transpose::yes);  // another shape: one more plan
  CHECK(cuda::gemm_plan_counts(ctx).misses == g1.misses + 1);

  Tensor x = rnd(kGpu, {2, 3, 9, 9}, 95), w = rnd(kGpu, {4, 3, 3, 3}, 96);
  Tensor y = zeros(kGpu, {2, 4, 9, 9}), dx = zeros(kGpu, {2, 3, 9, 9});
  Tensor dw = zeros(kGpu, {4, 3, 3, 3});
  Conv2dParams p{1, 1, 1, 1};
  auto pass = [&] {
    conv2d_forward(y, x, w, p);
    conv2d_backward_data(dx, y, w, p, Accumulate::no);
    conv2d_backward_filter(dw, y, x, p, Accumulate::no);
  };
  pass();
  cuda::PlanCounts c0 = cuda::conv_plan_counts(ctx);
  pass();
  pass();
  cuda::PlanCounts c1 = cuda::conv_plan_counts(ctx);
  CHECK(c1.hits == c0.hits + 6);
  CHECK(c1.misses == c0.misses);
  // Another context has its own plans (no global cache).
  DeviceContext other(kGpu);
  {
    ContextScope scope(other);
    pass();
  }
  CHECK(cuda::conv_plan_counts(other).misses == 3);
  CHECK(cuda::conv_plan_counts(ctx).misses == c1.misses);
}

TEST_CASE("kernels.cuda.conv2d: plans are keyed on the dtype - f32, bf16, f16 plans apart") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu);
  ContextScope scope(ctx);
  ConvCase c{{2, 8, 10, 10}, {8, 8, 3, 3}, {1, 1, 1, 1}};
  Shape ys = conv_out(c);
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::bf16}) {
    Tensor x = rnd(kGpu, c.x, 86, -1.f, 1.f, dt), w = rnd(kGpu, c.w, 87, -1.f, 1.f, dt);
    Tensor y = zeros(kGpu, ys);
    conv2d_forward(y, x, w, c.p);
  }
  cuda::PlanCounts counts = cuda::conv_plan_counts(ctx);
  CHECK(counts.misses == 3);  // one plan per dtype; the second bf16 call finds its plan
  CHECK(counts.hits == 1);
}

TEST_CASE("kernels.cuda.runtime: pool release threshold, peer access, current GPU, stale errors") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  int gpu = physical_gpu(kGpu);
  cudaMemPool_t pool = nullptr;
  REQUIRE(cudaDeviceGetDefaultMemPool(&pool, gpu) == cudaSuccess);
  uint64_t threshold = 0;
  REQUIRE(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold) ==
          cudaSuccess);
  CHECK(threshold == UINT64_MAX);  // synchronize() no longer unmaps the pool
  // Peer access is on for every pair that allows it (enabling it again says so).
  for (int peer = 0; peer < cuda_device_count(); ++peer) {
    int can = 0;
    cudaDeviceCanAccessPeer(&can, gpu, peer);
    if (peer == gpu || !can) continue;
    DeviceContext peer_ctx(Device::cuda(peer));  // prepares the peer GPU too
    cudaSetDevice(gpu);
    CHECK(cudaDeviceEnablePeerAccess(peer, 0) == cudaErrorPeerAccessAlreadyEnabled);
    cudaGetLastError();
  }
  // Freeing a tensor of another GPU leaves the thread's current GPU as it was.
  int last = cuda_device_count() - 1;
  {
    Tensor far = zeros(Device::cuda(last), {8});
    cudaSetDevice(0);
  }
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0);
  // A failed workspace allocation leaves no stale error for the next launch on this thread.
  CHECK_THROWS_WITH_AS(ctx.workspace(size_t{1} << 52), doctest::Contains("out of memory"), Error);
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  Tensor t = zeros(kGpu, {1000});
  fill(t, 3.f);
  CHECK(t.to_host_f32() == std::vector<float>(1000, 3.f));
}
#endif

// Sources on other logical devices of the same GPU are read in place; more than one launch's
// worth (16) keeps the order of the sum. Each term is one f32 FMA or multiply-add: allow the
// CPU's rounding to differ by an ulp per term.
TEST_CASE("kernels.cuda.weighted_sum: sources on other logical devices, f32 and bf16, match CPU") {
  DP_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16})
    for (int n_src : {1, 3, 17}) {
      CAPTURE(std::string(dtype_name(t)));
      CAPTURE(n_src);
      const int64_t n = 300007;
      Outputs got;
      for (Device d : {kGpu, kCpu}) {
        Tensor y = rnd(d, {n}, 6);
        std::vector<Tensor> xs;
        std::vector<kernels::Scalar> w;
        for (int k = 0; k < n_src; ++k) {
          Device src = d.is_cuda() ? Device::cuda(k % 4) : d;
          xs.push_back(rnd(src, {n}, 40 + k, -4.f, 4.f, t));
          w.push_back(0.25f * static_cast<float>(k + 1));
        }
        weighted_sum(y, 0.5f, xs, w);
        got.push_back(y);
      }
      CHECK(max_abs_diff(got[0].to_host_f32(), got[1].to_host_f32()) <= 2e-6f * n_src * 40);
    }
}

TEST_CASE(
    "kernels.cuda.scalar: device scalars and offsets match fixed ones, captures replay new ones") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  dp_test::check_device_scalars(ctx);
}

TEST_CASE("kernels.cuda.count_correct_into: matches count_correct without a host read") {
  DP_REQUIRE_GPU();
  Tensor x = small_ints(kGpu, {301, 10}, 38, 4);
  Tensor l = labels(kGpu, 301, 10, 39);
  Tensor out = Tensor::zeros({1}, DType::f32, kGpu);
  count_correct_into(out, x, l);
  CHECK(out.item() == static_cast<float>(count_correct(x, l)));
}

// ---- attention: the plain f32 kernels and cuDNN's fused SDPA for 16-bit qkv -----------------

namespace {

struct AttentionRun {
  Tensor y, lse, dqkv;
};

// Forward and backward of attention on d: qkv (B, T, 3 D) and dy (B, T, D) uniform in [-1, 1)
// from fixed seeds, of dtype `dt` (16-bit values are the rounded f32 ones on every device).
AttentionRun run_attention(Device d, DType dt, int64_t b, int64_t t, int64_t heads, int64_t width,
                           uint32_t seed) {
  AttentionParams p{heads, 1.f / std::sqrt(static_cast<float>(width / heads)),
                    AttentionMask::causal};
  Tensor qkv = rnd(d, {b, t, 3 * width}, seed, -1.f, 1.f, dt);
  Tensor dy = rnd(d, {b, t, width}, seed + 1, -1.f, 1.f, dt);
  AttentionRun r{Tensor::empty({b, t, width}, dt, d), Tensor::empty({b, heads, t}, DType::f32, d),
                 Tensor::empty(qkv.shape(), dt, d)};
  attention_forward(r.y, r.lse, qkv, p);
  attention_backward(r.dqkv, dy, qkv, r.y, r.lse, p);
  return r;
}

float max_abs(const Tensor& t) {
  float m = 0.f;
  for (float v : t.to_host_f32()) m = std::max(m, std::fabs(v));
  return m;
}

// The 16-bit unit roundoff: half an ulp at 1 (bf16 8 significant bits, f16 11).
float unit_roundoff(DType dt) {
  return dt == DType::bf16 ? std::ldexp(1.f, -8) : std::ldexp(1.f, -11);
}

}  // namespace

TEST_CASE(
    "kernels.cuda.attention: the plain f32 path matches CPU (causal, T up to 70), same bits on "
    "every run") {
  DP_REQUIRE_GPU();
  for (int64_t t : {int64_t{1}, int64_t{17}, int64_t{70}}) {
    CAPTURE(t);
    AttentionRun g = run_attention(kGpu, DType::f32, 2, t, 3, 24, 71);
    AttentionRun c = run_attention(kCpu, DType::f32, 2, t, 3, 24, 71);
    CHECK(diff(g.y, c.y) <= 1e-5f);
    CHECK(diff(g.lse, c.lse) <= 1e-5f);
    CHECK(diff(g.dqkv, c.dqkv) <= 1e-4f);
    // No atomics: a second run (as a replayed graph's against an uncaptured step) has its bits.
    AttentionRun again = run_attention(kGpu, DType::f32, 2, t, 3, 24, 71);
    CHECK(same_bits(again.y, g.y));
    CHECK(same_bits(again.dqkv, g.dqkv));
  }
}

// The CPU widens the 16-bit inputs, computes in f32 and rounds each output once. cuDNN's fused
// kernels read the same 16-bit values, accumulate in f32 (products of 16-bit values are exact),
// but round the probabilities P to 16 bits before P V (relative error <= u each) and round y
// once. So |y_gpu - y_cpu| <= u sum_j P_j |v_j| (P) + u |y| on each side (rounding) <=
// 3 u max|v| = 3 u here (|v| <= 1); 4 u leaves room for the f32 sums' order. lse is f32 on both
// sides from the same exact products: only summation order differs. Backward also rounds dS to
// 16 bits before dS K and dS^T Q, and takes D = rowsum(dO * O) from the 16-bit O: each output
// is a sum of products with one factor off by a relative u, plus the output rounding, and these
// inputs keep the sums of absolute terms within twice the largest reference value, giving
// 3 u + 2 (2 u) ~ 8 u max|ref|.
TEST_CASE(
    "kernels.cuda.sdpa: bf16 and f16 forward and backward match CPU within the 16-bit bound") {
  DP_REQUIRE_GPU();
  [[maybe_unused]] DeviceContext& ctx = context(kGpu);
  for (DType dt : {DType::bf16, DType::f16})
    for (auto [t, heads, width] :
         {std::tuple<int64_t, int64_t, int64_t>{64, 2, 128}, {37, 4, 128}, {129, 1, 128}}) {
      CAPTURE(std::string(dtype_name(dt)));
      CAPTURE(t);
      CAPTURE(width / heads);
      const float u = unit_roundoff(dt);
#if DP_HAVE_CUDA  // a build without the CUDA backend has no GPU: DP_REQUIRE_GPU skipped above
      cuda::SdpaCounts before = cuda::sdpa_counts(ctx);
#endif
      AttentionRun g = run_attention(kGpu, dt, 2, t, heads, width, 72);
      AttentionRun c = run_attention(kCpu, dt, 2, t, heads, width, 72);
#if DP_HAVE_CUDA
      cuda::SdpaCounts after = cuda::sdpa_counts(ctx);
      if (cuda::sdpa_built()) {
        CHECK(after.fused == before.fused + 2);  // forward and backward both fused
        CHECK(after.refused == before.refused);
      } else {
        MESSAGE("built without the cuDNN frontend: the 16-bit plain path is checked instead");
      }
#endif
      CHECK(diff(g.y, c.y) <= 4.f * u);
      CHECK(diff(g.lse, c.lse) <= 1e-4f * (1.f + max_abs(c.lse)));
      CHECK(diff(g.dqkv, c.dqkv) <= 8.f * u * max_abs(c.dqkv));
    }
}

TEST_CASE("kernels.cuda.sdpa: causal - changing the last token leaves every earlier row alone") {
  DP_REQUIRE_GPU();
  const int64_t b = 1, t = 48, width = 64;
  AttentionParams p{2, 1.f / std::sqrt(32.f), AttentionMask::causal};
  std::vector<float> host =
      dp_test::random_vector(static_cast<size_t>(b * t * 3 * width), 73, -1.f, 1.f);
  auto forward = [&](const std::vector<float>& v) {
    Tensor qkv = Tensor::from_vector(v, {b, t, 3 * width}, kGpu, DType::bf16);
    Tensor y = Tensor::empty({b, t, width}, DType::bf16, kGpu);
    Tensor lse = Tensor::empty({b, 2, t}, DType::f32, kGpu);
    attention_forward(y, lse, qkv, p);
    return y.to_host_f32();
  };
  std::vector<float> y0 = forward(host);
  for (int64_t c = 0; c < 3 * width; ++c)
    host[static_cast<size_t>((t - 1) * 3 * width + c)] *= -3.f;
  std::vector<float> y1 = forward(host);
  const size_t earlier = static_cast<size_t>((t - 1) * width);
  CHECK(std::memcmp(y0.data(), y1.data(), earlier * sizeof(float)) == 0);  // rows 0 .. T-2
  CHECK(std::memcmp(y0.data() + earlier, y1.data() + earlier, width * sizeof(float)) != 0);
}

#if DP_HAVE_CUDA
// Head dim 12 is no multiple of 8: cuDNN is not asked; the plain path runs on the widened
// values and rounds once, which is the f32 path's result rounded (forward bit for bit; the
// backward's float atomics may move a sum across a rounding boundary: one ulp).
TEST_CASE("kernels.cuda.sdpa: a refused shape falls back to the plain path with its result") {
  DP_REQUIRE_GPU();
  DeviceContext& ctx = context(kGpu);
  cuda::SdpaCounts before = cuda::sdpa_counts(ctx);
  AttentionRun half = run_attention(kGpu, DType::bf16, 2, 33, 2, 24, 74);
  CHECK(cuda::sdpa_counts(ctx).refused == before.refused + 2);
  CHECK(cuda::sdpa_counts(ctx).fused == before.fused);
  // The f32 path on the same (bf16-rounded) values, rounded to bf16.
  const int64_t b = 2, t = 33, width = 24;
  AttentionParams p{2, 1.f / std::sqrt(12.f), AttentionMask::causal};
  Tensor qkv = cast(rnd(kGpu, {b, t, 3 * width}, 74, -1.f, 1.f, DType::bf16), DType::f32);
  Tensor dy = cast(rnd(kGpu, {b, t, width}, 75, -1.f, 1.f, DType::bf16), DType::f32);
  Tensor y = Tensor::empty({b, t, width}, DType::f32, kGpu);
  Tensor lse = Tensor::empty({b, 2, t}, DType::f32, kGpu);
  Tensor dqkv = Tensor::empty(qkv.shape(), DType::f32, kGpu);
  attention_forward(y, lse, qkv, p);
  attention_backward(dqkv, dy, qkv, y, lse, p);
  CHECK(same_bits(half.y, cast(y, DType::bf16)));
  CHECK(same_bits(half.lse, lse));
  CHECK(diff(half.dqkv, cast(dqkv, DType::bf16)) <= std::ldexp(1.f, -7) * max_abs(dqkv));
}
#endif

TEST_CASE("kernels.cuda.graph: replays check their device faults, a grown workspace stays theirs") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  Tensor logits = rnd(kGpu, {2, 3}, 140), loss = zeros(kGpu, {1}), dlogits = zeros(kGpu, {2, 3});
  Tensor lab = Tensor::from_ints({0, 2}, {2}, kGpu);
  auto body = [&] { softmax_cross_entropy(loss, dlogits, logits, lab); };
  body();
  const float good = loss.item();
  Graph g;
  g.capture(ctx, body);
  g.replay();
  CHECK(loss.item() == good);
  // A bad label written into the captured labels: the replay's read reports it (a replay runs
  // no host code, so the graph arms the check itself).
  Tensor bad = Tensor::from_ints({0, 3}, {2}), fine = Tensor::from_ints({0, 2}, {2});
  copy(lab, bad);
  g.replay();
  CHECK_THROWS_WITH_AS((void)loss.item(), doctest::Contains("label 3 of row 1"), Error);
  copy(lab, fine);
  g.replay();
  CHECK(loss.item() == good);
  // The context's workspace grows after the capture (the row losses of a 1M-row batch); the old
  // buffer, which the graph's kernels use, is kept, not handed on: a tensor of its size made
  // next (which the pool would give the freed buffer's memory) is left alone by the replay.
  const size_t old_bytes = ctx.workspace_bytes();
  REQUIRE(old_bytes % sizeof(float) == 0);
  {
    const int64_t rows = 1'000'000;
    Tensor big = zeros(kGpu, {rows, 3}), big_loss = zeros(kGpu, {1}), none;
    softmax_cross_entropy(big_loss, none, big, Tensor::zeros({rows}, DType::i32, kGpu));
    CHECK(big_loss.item() == doctest::Approx(std::log(3.0)));
  }
  CHECK(ctx.workspace_bytes() > old_bytes);
  const auto n = static_cast<int64_t>(old_bytes / sizeof(float));
  Tensor filler = full(kGpu, {n}, 9.f);
  g.replay();
  CHECK(loss.item() == good);
  CHECK(filler.to_host_f32() == std::vector<float>(static_cast<size_t>(n), 9.f));
}

TEST_CASE(
    "kernels.cuda.graph: a buffer made before the capture stays the graph's after its owner "
    "drops it") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  const int64_t n = 4099;
  Tensor x = rnd(kGpu, {n}, 21), out = zeros(kGpu, {1});
  // A layer's buffer for one shape, made on a warm-up run (as nn's `ensure`d buffers are).
  Tensor buffer = zeros(kGpu, {n});
  auto body = [&] {
    scale(buffer, x, 3.f);
    sum_squares(out, buffer);
  };
  body();
  const float expected = out.item();
  Graph g;
  g.capture(ctx, body);
  const void* address = buffer.raw();
  // The owner lets the buffer go (a new shape replaced it); a tensor of its size made next is
  // what the cache would hand the freed block. The graph holds it: the new tensor gets other
  // memory, and a replay leaves it alone.
  buffer = Tensor();
  Tensor other = full(kGpu, {n}, 7.f);
  CHECK(other.raw() != address);
  fill(out, 0.f);
  g.replay();
  CHECK(out.item() == expected);
  CHECK(other.to_host_f32() == std::vector<float>(static_cast<size_t>(n), 7.f));
}

TEST_CASE("kernels.cuda.graph: a captured sequence replays bit for bit, memory stays the graph's") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  const int64_t n = 100003;
  Tensor x = rnd(kGpu, {n}, 11), b = rnd(kGpu, {n}, 12);
  Tensor y = zeros(kGpu, {n}), z = zeros(kGpu, {1});
  Tensor y_ref = zeros(kGpu, {n}), z_ref = zeros(kGpu, {1});
  auto body = [&](Tensor& yy, Tensor& zz) {
    Tensor temp = Tensor::empty({n}, DType::f32, kGpu);
    add(temp, x, b);
    scale(yy, temp, 2.f);
    sum_squares(zz, yy);
  };
  body(y_ref, z_ref);  // eager, and warms the cache for the capture
  body(y, z);
  fill(y, 0.f);
  const int64_t allocations = ctx.memory()->allocations.load();
  Graph g;
  g.capture(ctx, [&] { body(y, z); });
  CHECK(g.nodes() >= 3);
  CHECK(ctx.memory()->allocations.load() == allocations);
  CHECK(y.to_host_f32() == std::vector<float>(n, 0.f));  // captured, not run
  for (int r = 0; r < 3; ++r) {
    g.replay();
    CHECK(same_bits(y, y_ref));
    CHECK(same_bits(z, z_ref));
  }
  // A host read inside a capture is refused, and the context keeps working.
  Graph bad;
  CHECK_THROWS_WITH_AS(bad.capture(ctx, [&] { (void)y.to_host_f32(); }),
                       doctest::Contains("not capturable"), Error);
  g.replay();
  CHECK(same_bits(y, y_ref));
}

// Event::record_in_graph: a replay records the event inside the graph, and work queued on another
// stream after the launch waits for that point of this replay (DP's pulls beside a captured
// backward rely on it), replay after replay.
TEST_CASE("kernels.cuda.graph: an event recorded in a graph orders work queued after each replay") {
  DP_REQUIRE_GPU();
  DeviceContext ctx(kGpu, {.caching = Caching::on});
  DeviceContext other(kGpu, {.caching = Caching::on});
  ContextScope scope(ctx);
  const int64_t n = 1 << 24;  // long enough that an unordered copy would read it half written
  Tensor x = zeros(kGpu, {n}), ones = zeros(kGpu, {n}), seen = zeros(kGpu, {n});
  fill(ones, 1.f);
  Event done(Event::Timing::off);
  auto body = [&] {
    for (int r = 0; r < 8; ++r) add(x, x, ones);
    done.record_in_graph(ctx);
  };
  body();  // the uncaptured run records it first
  Graph g;
  g.capture(ctx, body);
  fill(x, 0.f);
  for (int r = 1; r <= 3; ++r) {
    g.replay();  // x += 8
    done.wait(other);
    {
      ContextScope on_other(other);
      copy(seen, x);
    }
    other.synchronize();
    CHECK(seen.to_host_f32() == std::vector<float>(n, 8.f * r));
  }
}

// Without a GPU (this runs everywhere, CI included), the reason the programs print names what is
// missing before CUDA's own words: with no NVIDIA driver at all, the runtime says "CUDA driver
// version is insufficient for CUDA runtime version", which reads as a version problem.
TEST_CASE("kernels.cuda.absent: without a usable GPU the reason names what is missing") {
  const std::string reason = cuda_unavailable_reason();
  if (!built_with_cuda()) {
    CHECK(reason == "this build has no CUDA backend");
    return;
  }
  if (dp_test::gpu_available()) {
    CHECK(reason.empty());
    return;
  }
  CAPTURE(reason);
  const bool driver = ::access("/proc/driver/nvidia/version", F_OK) == 0;
  if (!driver) CHECK(reason.rfind("no NVIDIA GPU or driver on this machine", 0) == 0);
  CHECK(reason.rfind("CUDA driver version is insufficient", 0) != 0);  // never the bare words
  std::string fallback;
  CHECK(choose_device_type("auto", &fallback) == DeviceType::cpu);
  CHECK(fallback == "no usable GPU (" + reason + "): running on the CPU");
}
