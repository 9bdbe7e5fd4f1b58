// Matrix product on row-major tensors with cuBLASLt (f32, f16, bf16 in; f32 accumulation).
//
// cuBLASLt is column-major. Row-major C (m, n) has the bytes of column-major C^T (n, m), and
// C^T = op(B)^T op(A)^T, so we ask cuBLASLt for D = op_lt(b) op_lt(a): its "A" is our b, its
// "B" is our a, and its (M, N, K) is (n, m, k). The bias epilogue adds a vector of length M =
// n (rows of column-major D) broadcast over its columns, i.e. bias[j] to column j of row-major C.
#include <array>

#include "kernels/cuda/cuda_common.cuh"
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
  MatmulDescHandle desc;
  LayoutHandle lt_a, lt_b, lt_c;
  cublasLtMatmulHeuristicResult_t result{};
  bool fused_bias = false;
};

// m, n, k, ta, tb, in dtype, out dtype, compute type, bias wanted, alignments of a, b, c, bias.
using GemmKey = std::array<int64_t, 13>;

// The GEMM plans of one DeviceContext (ctx.state<GemmPlans>()).
struct GemmPlans {
  PlanCache<GemmKey, GemmPlan> cache;
};

// c (rows, cols) row-major: c = (scale_c ? beta * c : c) + bias[col]. With scale_c and beta == 0
// c is not read (it may hold NaN). bias may be nullptr.
template <class T>
__global__ void scale_add_bias_kernel(T* c, const float* bias, float beta, bool scale_c,
                                      int64_t total, int64_t cols) {
  DP_GRID_STRIDE_LOOP(i, total) {
    float v = 0.f;
    if (!scale_c)
      v = to_float(c[i]);
    else if (beta != 0.f)
      v = beta * to_float(c[i]);
    if (bias) v += bias[i % cols];
    c[i] = from_float<T>(v);
  }
}

void launch_scale_add_bias(Tensor& c, const float* bias, float beta, bool scale_c, cudaStream_t s) {
  int64_t total = c.numel(), cols = c.dim(1);
  switch (c.dtype()) {
    case DType::f32:
      scale_add_bias_kernel<<<blocks_for(total), kThreads, 0, s>>>(c.data<float>(), bias, beta,
                                                                   scale_c, total, cols);
      break;
    case DType::f16:
      scale_add_bias_kernel<<<blocks_for(total), kThreads, 0, s>>>(c.data<__half>(), bias, beta,
                                                                   scale_c, total, cols);
      break;
    case DType::bf16:
      scale_add_bias_kernel<<<blocks_for(total), kThreads, 0, s>>>(c.data<__nv_bfloat16>(), bias,
                                                                   beta, scale_c, total, cols);
      break;
    default:
      DP_THROW("gemm: output dtype " << c.dtype() << " is not supported");
  }
  DP_CUDA_CHECK_LAUNCH();
}

constexpr size_t kGemmWorkspaceBytes = 32u << 20;

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
  if (bias.defined()) require_f32("gemm (bias)", bias);
  cudaStream_t s = stream_of(ctx);

  int64_t m = c.dim(0), n = c.dim(1);
  int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  if (m == 0 || n == 0) return;
  const float* bias_ptr = data_or_null<const float>(bias);
  if (k == 0) {  // empty product: c = beta c + bias
    launch_scale_add_bias(c, bias_ptr, beta, /*scale_c=*/true, s);
    return;
  }

  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (a.dtype() == DType::f32 && ctx.math() == MathMode::tf32)
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  // The fused bias epilogue is tried for f32 outputs when the vector is 16-byte aligned;
  // otherwise (or when no algorithm supports it) a separate kernel adds it after the product.
  bool want_fused = bias_ptr && c.dtype() == DType::f32 && alignment_of(bias_ptr) >= 16;
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
              want_fused ? alignment_of(bias_ptr) : 0};
  cublasLtHandle_t handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  GemmPlan& plan = ctx.state<GemmPlans>().cache.get(key, [&] {
    GemmPlan pl;
    pl.desc = make_matmul_desc(compute);
    cublasOperation_t op_lt_a = tb == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our b
    cublasOperation_t op_lt_b = ta == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our a
    set_attr(pl.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_lt_a);
    set_attr(pl.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_lt_b);
    // Column-major views: b (k, n) row-major is (n, k) ld n; b^T stored (n, k) is (k, n) ld k.
    // a (m, k) row-major is (k, m) ld k; a^T stored (k, m) is (m, k) ld m.
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

    auto find_algo = [&] {
      int found = 0;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
          handle, pl.desc.get(), pl.lt_a.get(), pl.lt_b.get(), pl.lt_c.get(), pl.lt_c.get(),
          pref.get(), 1, &pl.result, &found);
      return st == CUBLAS_STATUS_SUCCESS && found > 0;
    };
    bool found = false;
    if (want_fused) {
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
               static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS));
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F));
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias_ptr));
      found = pl.fused_bias = find_algo();
      if (!found)
        set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                 static_cast<uint32_t>(CUBLASLT_EPILOGUE_DEFAULT));
    }
    if (!found && !find_algo())
      DP_THROW("gemm: cuBLASLt has no algorithm for "
               << a << (ta == Transpose::yes ? "^T" : "") << " x " << b
               << (tb == Transpose::yes ? "^T" : "") << " -> " << c);
    return pl;
  });
  if (plan.fused_bias)  // the one per-call attribute
    set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias_ptr));

  void* workspace = ctx.workspace(kGemmWorkspaceBytes);
  DP_CUBLAS_CHECK(cublasLtMatmul(handle, plan.desc.get(), &alpha, b.raw(), plan.lt_a.get(), a.raw(),
                                 plan.lt_b.get(), &beta, c.raw(), plan.lt_c.get(), c.raw(),
                                 plan.lt_c.get(), &plan.result.algo, workspace, kGemmWorkspaceBytes,
                                 s));
  if (bias_ptr && !plan.fused_bias) launch_scale_add_bias(c, bias_ptr, 1.f, /*scale_c=*/false, s);
}

}  // namespace kernels::cuda
