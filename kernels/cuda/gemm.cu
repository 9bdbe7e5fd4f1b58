// Matrix product on row-major tensors with cuBLASLt (f32, f16, bf16 in; f32 accumulation).
//
// cuBLASLt is column-major. Row-major C (m, n) has the bytes of column-major C^T (n, m), and
// C^T = op(B)^T op(A)^T, so we ask cuBLASLt for D = op_lt(b) op_lt(a): its "A" is our b, its
// "B" is our a, and its (M, N, K) is (n, m, k). The bias epilogue adds a vector of length M =
// n (rows of column-major D) broadcast over its columns, i.e. bias[j] to column j of row-major C.
//
// A 16-bit output takes the epilogue with a bias of its own dtype: cuBLASLt offers no algorithm
// for an f32 bias with a bf16 output (DP_LOG=debug on an H200, 2026-11-29). A bias given in c's
// dtype (a Linear passes its parameter's 16-bit copy, refreshed once a step, as torch.autocast
// rounds a Linear's bias) goes to the epilogue as it is; an f32 bias is first rounded into a
// small buffer behind the GEMM workspace. Either is added in f32 before D is rounded once.
// Without an algorithm for it, for an unaligned 16-bit bias, or for an f32 vector longer than
// that buffer, a separate kernel adds the bias to the product.
//
// The plan's candidates (kernels/runtime/algo_select.hpp): cuBLASLt with the bias epilogue and
// plain cuBLASLt, each when its heuristic finds an algorithm, then always cublasGemmEx with the
// same operand, output and compute types. A shape the heuristic has nothing for (a dimension of
// 1, leading dimensions that are not 16-byte multiples), or a cuBLASLt run that answers
// NOT_SUPPORTED or INVALID_VALUE, falls through to the next. DP_LOG=debug logs the choice.
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <sstream>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/runtime/algo_select.hpp"
#include "kernels/runtime/handle.hpp"
#include "kernels/runtime/plan_cache.hpp"

namespace kernels::cuda {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::f16:
      return CUDA_R_16F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      DP_THROW("gemm: dtype " << t << " is not supported (f32, f16, bf16)");
  }
}

// Largest power of two (<= 256) that divides the address: tensors may be views at any offset.
uint32_t alignment_of(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

using MatmulDescHandle = UniqueHandle<cublasLtMatmulDesc_t, cublasStatus_t,
                                      cublasLtMatmulDescDestroy, CUBLAS_STATUS_SUCCESS>;
using LayoutHandle = UniqueHandle<cublasLtMatrixLayout_t, cublasStatus_t,
                                  cublasLtMatrixLayoutDestroy, CUBLAS_STATUS_SUCCESS>;
using PreferenceHandle = UniqueHandle<cublasLtMatmulPreference_t, cublasStatus_t,
                                      cublasLtMatmulPreferenceDestroy, CUBLAS_STATUS_SUCCESS>;

MatmulDescHandle make_matmul_desc(cublasComputeType_t compute) {
  cublasLtMatmulDesc_t d = nullptr;
  DP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  return MatmulDescHandle(d);
}

template <class T>
void set_attr(const MatmulDescHandle& d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  DP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.get(), attr, &value, sizeof(value)));
}

// Column-major rows x cols with leading dimension ld.
LayoutHandle make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  DP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  return LayoutHandle(l);
}

template <class T>
void set_pref(const PreferenceHandle& p, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value) {
  DP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p.get(), attr, &value, sizeof(value)));
}

// Everything cublasLtMatmul needs but the pointers, for one (shape, transposes, dtypes, math,
// epilogue, alignments): built and searched once per context, then reused. The bias pointer is
// the one attribute that changes between calls; it is set on the cached descriptor per call.
struct GemmPlan {
  MatmulDescHandle desc_fused, desc;  // with the bias epilogue (when wanted), without
  LayoutHandle lt_a, lt_b, lt_c;
  cublasLtMatmulHeuristicResult_t result_fused{}, result{};
  AlgoChoice choice;  // over kGemmLtFusedBias, kGemmLt, kGemmEx
};

// m, n, k, ta, tb, in dtype, out dtype, compute type, bias wanted, alignments of a, b, c, bias.
using GemmKey = std::array<int64_t, 13>;

// The GEMM plans of one DeviceContext (ctx.state<GemmPlans>()).
struct GemmPlans {
  PlanCache<GemmKey, GemmPlan> cache;
};

using CublasHandle =
    UniqueHandle<cublasHandle_t, cublasStatus_t, cublasDestroy, CUBLAS_STATUS_SUCCESS>;

// The cuBLAS handle of the cublasGemmEx fallback, made on first use on the context's device.
struct GemmExHandle {
  CublasHandle handle;
};

// A cuBLAS(Lt) execution's status as an attempt: NOT_SUPPORTED and INVALID_VALUE (a
// configuration the algorithm rejects before launching) mean "try the next path"; other
// failures throw, naming `call`.
AlgoAttempt cublas_attempt(cublasStatus_t st, const char* call) {
  if (st == CUBLAS_STATUS_SUCCESS) return AlgoAttempt::success();
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)
    return AlgoAttempt::unsupported(std::string("cublas status ") + std::to_string(st));
  DP_THROW(call << " failed: cublas status " << static_cast<int>(st));
}

// c (rows, cols) row-major: c = (scale_c ? beta * c : c) + bias[col]. With scale_c and beta == 0
// c is not read (it may hold NaN). bias (f32 or c's dtype B) may be nullptr.
template <class T, class B>
__global__ void scale_add_bias_kernel(T* c, const B* bias, float beta, bool scale_c, int64_t total,
                                      int64_t cols) {
  DP_GRID_STRIDE_LOOP(i, total) {
    float v = 0.f;
    if (!scale_c)
      v = to_float(c[i]);
    else if (beta != 0.f)
      v = beta * to_float(c[i]);
    if (bias) v += to_float(bias[i % cols]);
    c[i] = from_float<T>(v);
  }
}

template <class T>
void launch_scale_add_bias_as(Tensor& c, const Tensor& bias, float beta, bool scale_c,
                              cudaStream_t s) {
  const int64_t total = c.numel(), cols = c.dim(1);
  if (bias.defined() && bias.dtype() != DType::f32)
    scale_add_bias_kernel<<<blocks_for(total), kThreads, 0, s>>>(c.data<T>(), bias.data<T>(), beta,
                                                                 scale_c, total, cols);
  else
    scale_add_bias_kernel<<<blocks_for(total), kThreads, 0, s>>>(
        c.data<T>(), data_or_null<const float>(bias), beta, scale_c, total, cols);
}

// bias is undefined, f32, or c's dtype (gemm checks).
void launch_scale_add_bias(Tensor& c, const Tensor& bias, float beta, bool scale_c,
                           cudaStream_t s) {
  switch (c.dtype()) {
    case DType::f32:
      launch_scale_add_bias_as<float>(c, bias, beta, scale_c, s);
      break;
    case DType::f16:
      launch_scale_add_bias_as<__half>(c, bias, beta, scale_c, s);
      break;
    case DType::bf16:
      launch_scale_add_bias_as<__nv_bfloat16>(c, bias, beta, scale_c, s);
      break;
    default:
      DP_THROW("gemm: output dtype " << c.dtype() << " is not supported");
  }
  DP_CUDA_CHECK_LAUNCH();
}

constexpr size_t kGemmWorkspaceBytes = 32u << 20;
// The 16-bit copy of a bias for a 16-bit output's epilogue, behind the GEMM workspace (256-byte
// aligned: the workspace is): vectors of up to 32768 values.
constexpr size_t kBias16Bytes = 64u << 10;

template <class T>
__global__ void round_bias_kernel(T* out, const float* bias, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) out[i] = from_float<T>(bias[i]);
}

// bias (n values) rounded to c's 16-bit dtype at `out`.
void launch_round_bias(void* out, const float* bias, int64_t n, DType t, cudaStream_t s) {
  if (t == DType::bf16)
    round_bias_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(out), bias, n);
  else
    round_bias_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<__half*>(out), bias, n);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace

PlanCounts gemm_plan_counts(DeviceContext& ctx) {
  auto& c = ctx.state<GemmPlans>().cache;
  return {c.hits(), c.misses()};
}

// (m, k) x (k, n) -> (m, n), with op() applied to a and b as asked.
void gemm(Tensor& c, const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, float alpha,
          float beta, const Tensor& bias, DeviceContext& ctx) {
  NvtxRange range("kernels/gemm");
  DP_CHECK(a.dtype() == b.dtype(), "gemm: a and b dtypes differ: " << a << ", " << b);
  cudaDataType_t in_type = cuda_type(a.dtype());
  DP_CHECK(c.dtype() == DType::f32 || c.dtype() == a.dtype(),
           "gemm: output " << c << " must be f32 or the inputs' dtype " << a.dtype());
  cudaDataType_t out_type = cuda_type(c.dtype());
  DP_CHECK(!bias.defined() || bias.dtype() == DType::f32 || bias.dtype() == c.dtype(),
           "gemm: bias " << bias << " must be f32 or the output's dtype " << c.dtype());
  cudaStream_t s = stream_of(ctx);

  int64_t m = c.dim(0), n = c.dim(1);
  int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // empty product: c = beta c + bias
    launch_scale_add_bias(c, bias, beta, /*scale_c=*/true, s);
    return;
  }

  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (a.dtype() == DType::f32 && ctx.math() == MathMode::tf32)
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  // The fused bias epilogue is tried when the vector is 16-byte aligned in the output's dtype, or
  // for a 16-bit output, with an f32 bias rounded to its dtype first (the header); otherwise (or
  // when no algorithm supports it) a separate kernel adds it after the product.
  const void* bias_ptr = bias.defined() ? bias.raw() : nullptr;
  const bool out16 = c.dtype() != DType::f32;
  const bool round_bias = bias_ptr && bias.dtype() != c.dtype();  // f32 bias, 16-bit output
  const bool want_fused = bias_ptr && (round_bias ? n * 2 <= static_cast<int64_t>(kBias16Bytes)
                                                  : alignment_of(bias_ptr) >= 16);
  // The workspace, and behind it the rounded 16-bit bias (one size for every GEMM: it never
  // grows between a warm-up and a capture).
  char* workspace = static_cast<char*>(ctx.workspace(kGemmWorkspaceBytes + kBias16Bytes));
  void* bias16 = workspace + kGemmWorkspaceBytes;
  const void* epilogue_bias = round_bias ? bias16 : bias_ptr;
  GemmKey key{m,
              n,
              k,
              static_cast<int64_t>(ta),
              static_cast<int64_t>(tb),
              static_cast<int64_t>(a.dtype()),
              static_cast<int64_t>(c.dtype()),
              static_cast<int64_t>(compute),
              want_fused ? 1 : 0,
              alignment_of(a.raw()),
              alignment_of(b.raw()),
              alignment_of(c.raw()),
              want_fused ? alignment_of(epilogue_bias) : 0};
  cublasLtHandle_t handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  cublasOperation_t op_lt_a = tb == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our b
  cublasOperation_t op_lt_b = ta == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our a
  // Column-major views: b (k, n) row-major is (n, k) ld n; b^T stored (n, k) is (k, n) ld k.
  // a (m, k) row-major is (k, m) ld k; a^T stored (k, m) is (m, k) ld m.
  int64_t ld_a = tb == Transpose::no ? n : k, ld_b = ta == Transpose::no ? k : m;
  GemmPlan& plan = ctx.state<GemmPlans>().cache.get(key, [&] {
    GemmPlan pl;
    pl.lt_a = tb == Transpose::no ? make_layout(in_type, n, k, n) : make_layout(in_type, k, n, k);
    pl.lt_b = ta == Transpose::no ? make_layout(in_type, k, m, k) : make_layout(in_type, m, k, m);
    pl.lt_c = make_layout(out_type, n, m, n);  // C^T, also D (in place)

    cublasLtMatmulPreference_t raw_pref = nullptr;
    DP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
    PreferenceHandle pref(raw_pref);
    set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
             static_cast<uint64_t>(kGemmWorkspaceBytes));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(b.raw()));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(a.raw()));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(c.raw()));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(c.raw()));

    auto new_desc = [&] {
      MatmulDescHandle d = make_matmul_desc(compute);
      set_attr(d, CUBLASLT_MATMUL_DESC_TRANSA, op_lt_a);
      set_attr(d, CUBLASLT_MATMUL_DESC_TRANSB, op_lt_b);
      return d;
    };
    // The heuristic's best algorithm for `desc`; false when it has none (or answers an error,
    // e.g. INVALID_VALUE for a dimension of 1).
    auto find_algo = [&](const MatmulDescHandle& desc, cublasLtMatmulHeuristicResult_t* result) {
      int found = 0;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
          handle, desc.get(), pl.lt_a.get(), pl.lt_b.get(), pl.lt_c.get(), pl.lt_c.get(),
          pref.get(), 1, result, &found);
      return st == CUBLAS_STATUS_SUCCESS && found > 0;
    };
    bool fused_found = false;
    if (want_fused) {
      pl.desc_fused = new_desc();
      set_attr(pl.desc_fused, CUBLASLT_MATMUL_DESC_EPILOGUE,
               static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS));
      set_attr(pl.desc_fused, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
               static_cast<int32_t>(out16 ? out_type : CUDA_R_32F));
      set_attr(pl.desc_fused, CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue_bias);
      fused_found = find_algo(pl.desc_fused, &pl.result_fused);
    }
    pl.desc = new_desc();
    bool plain_found = find_algo(pl.desc, &pl.result);
    std::ostringstream what;
    what << "gemm " << a << (ta == Transpose::yes ? "^T" : "") << " x " << b
         << (tb == Transpose::yes ? "^T" : "") << " -> " << c << " (m " << m << ", n " << n
         << ", k " << k << (compute == CUBLAS_COMPUTE_32F_FAST_TF32 ? ", tf32)" : ")");
    pl.choice = AlgoChoice(gemm_candidates(fused_found, pl.result_fused.workspaceSize, plain_found,
                                           pl.result.workspaceSize),
                           what.str(), 3);
    return pl;
  });

  const AlgoCandidate& ran = plan.choice.run([&](const AlgoCandidate& cand) {
    switch (cand.id) {
      case kGemmLtFusedBias:
        if (round_bias) launch_round_bias(bias16, bias.data<float>(), n, c.dtype(), s);
        set_attr(plan.desc_fused, CUBLASLT_MATMUL_DESC_BIAS_POINTER,  // the per-call attribute
                 epilogue_bias);
        return cublas_attempt(
            cublasLtMatmul(handle, plan.desc_fused.get(), &alpha, b.raw(), plan.lt_a.get(), a.raw(),
                           plan.lt_b.get(), &beta, c.raw(), plan.lt_c.get(), c.raw(),
                           plan.lt_c.get(), &plan.result_fused.algo, workspace, kGemmWorkspaceBytes,
                           s),
            "cublasLtMatmul");
      case kGemmLt:
        return cublas_attempt(
            cublasLtMatmul(handle, plan.desc.get(), &alpha, b.raw(), plan.lt_a.get(), a.raw(),
                           plan.lt_b.get(), &beta, c.raw(), plan.lt_c.get(), c.raw(),
                           plan.lt_c.get(), &plan.result.algo, workspace, kGemmWorkspaceBytes, s),
            "cublasLtMatmul");
      default: {
        if (std::max({m, n, k}) > INT32_MAX)
          return AlgoAttempt::unsupported("a dimension exceeds cublasGemmEx's int range");
        CublasHandle& h = ctx.state<GemmExHandle>().handle;
        if (!h) {
          ctx.refuse_in_capture("creating the cuBLAS handle");  // it allocates device memory
          cublasHandle_t raw = nullptr;
          DP_CUBLAS_CHECK(cublasCreate(&raw));
          h = CublasHandle(raw);
        }
        DP_CUBLAS_CHECK(cublasSetStream(h.get(), s));
        DP_CUBLAS_CHECK(cublasSetWorkspace(h.get(), workspace, kGemmWorkspaceBytes));
        return cublas_attempt(
            cublasGemmEx(h.get(), op_lt_a, op_lt_b, static_cast<int>(n), static_cast<int>(m),
                         static_cast<int>(k), &alpha, b.raw(), in_type, static_cast<int>(ld_a),
                         a.raw(), in_type, static_cast<int>(ld_b), &beta, c.raw(), out_type,
                         static_cast<int>(n), compute, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      }
    }
  });
  if (bias_ptr && ran.id != kGemmLtFusedBias)
    launch_scale_add_bias(c, bias, 1.f, /*scale_c=*/false, s);
}

}  // namespace kernels::cuda
