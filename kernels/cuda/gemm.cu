// Matrix product on row-major tensors with cuBLASLt (f32, f16, bf16 in; f32 accumulation).
//
// cuBLASLt is column-major. Row-major C (m, n) has the bytes of column-major C^T (n, m), and
// C^T = op(B)^T op(A)^T, so we ask cuBLASLt for D = op_lt(b) op_lt(a): its "A" is our b, its
// "B" is our a, and its (M, N, K) is (n, m, k). The bias epilogue adds a vector of length M =
// n (rows of column-major D) broadcast over its columns, i.e. bias[j] to column j of row-major C.
#include "kernels/cuda/cuda_common.cuh"

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

// Owners of the per-call cuBLASLt descriptors (nothing is cached between calls).
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  explicit MatmulDesc(cublasComputeType_t compute) {
    DP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  }
  ~MatmulDesc() {
    if (cublasLtMatmulDescDestroy(d) != CUBLAS_STATUS_SUCCESS)
      DP_LOG_ERROR("cublasLtMatmulDescDestroy failed");
  }
  template <class T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    DP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  // Column-major rows x cols with leading dimension ld.
  Layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
    DP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                               static_cast<uint64_t>(cols), ld));
  }
  ~Layout() {
    if (cublasLtMatrixLayoutDestroy(l) != CUBLAS_STATUS_SUCCESS)
      DP_LOG_ERROR("cublasLtMatrixLayoutDestroy failed");
  }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { DP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~Preference() {
    if (cublasLtMatmulPreferenceDestroy(p) != CUBLAS_STATUS_SUCCESS)
      DP_LOG_ERROR("cublasLtMatmulPreferenceDestroy failed");
  }
  template <class T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    DP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
  }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
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
  MatmulDesc desc(compute);
  cublasOperation_t op_lt_a = tb == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our b
  cublasOperation_t op_lt_b = ta == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;  // our a
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_lt_a);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_lt_b);

  // Column-major views: b (k, n) row-major is (n, k) ld n; b^T stored (n, k) is (k, n) ld k.
  // a (m, k) row-major is (k, m) ld k; a^T stored (k, m) is (m, k) ld m.
  Layout lt_a = tb == Transpose::no ? Layout(in_type, n, k, n) : Layout(in_type, k, n, k);
  Layout lt_b = ta == Transpose::no ? Layout(in_type, k, m, k) : Layout(in_type, m, k, m);
  Layout lt_c(out_type, n, m, n);  // C^T, also D (in place)

  Preference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kGemmWorkspaceBytes));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(b.raw()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(a.raw()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(c.raw()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(c.raw()));

  cublasLtHandle_t handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  auto find_algo = [&](cublasLtMatmulHeuristicResult_t& result) {
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, lt_a.l, lt_b.l, lt_c.l,
                                                       lt_c.l, pref.p, 1, &result, &found);
    return st == CUBLAS_STATUS_SUCCESS && found > 0;
  };

  // Fused bias for f32 outputs when the vector is 16-byte aligned; otherwise (or when no
  // algorithm supports the epilogue) a separate kernel adds it after the product.
  bool fused_bias = bias_ptr && c.dtype() == DType::f32 && alignment_of(bias_ptr) >= 16;
  cublasLtMatmulHeuristicResult_t result{};
  bool found = false;
  if (fused_bias) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS));
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F));
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias_ptr));
    found = find_algo(result);
    if (!found) {
      fused_bias = false;
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(CUBLASLT_EPILOGUE_DEFAULT));
    }
  }
  if (!found && !find_algo(result))
    DP_THROW("gemm: cuBLASLt has no algorithm for "
             << a << (ta == Transpose::yes ? "^T" : "") << " x " << b
             << (tb == Transpose::yes ? "^T" : "") << " -> " << c);

  void* workspace = ctx.workspace(kGemmWorkspaceBytes);
  DP_CUBLAS_CHECK(cublasLtMatmul(handle, desc.d, &alpha, b.raw(), lt_a.l, a.raw(), lt_b.l, &beta,
                                 c.raw(), lt_c.l, c.raw(), lt_c.l, &result.algo, workspace,
                                 kGemmWorkspaceBytes, s));
  if (bias_ptr && !fused_bias) launch_scale_add_bias(c, bias_ptr, 1.f, /*scale_c=*/false, s);
}

}  // namespace kernels::cuda
