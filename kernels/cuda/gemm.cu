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
#include <cstdio>
#include <sstream>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/ops.hpp"
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

// The column-major operands of row-major c (m, n) = op(a) (m, k) op(b) (k, n), as cuBLASLt is
// asked for them (the header), with the preference that bounds the workspace and states the
// pointers' alignments.
struct LtOperands {
  LayoutHandle lt_a, lt_b, lt_c;  // cuBLASLt's A (our b), B (our a), and C = D (c^T)
  PreferenceHandle pref;
};
LtOperands lt_operands(cudaDataType_t in_type, cudaDataType_t out_type, int64_t m, int64_t n,
                       int64_t k, Transpose ta, Transpose tb, const void* a, const void* b,
                       const void* c, uint64_t workspace_bytes) {
  LtOperands o;
  // b (k, n) row-major is (n, k) ld n; b^T stored (n, k) is (k, n) ld k. a (m, k) row-major is
  // (k, m) ld k; a^T stored (k, m) is (m, k) ld m.
  o.lt_a = tb == Transpose::no ? make_layout(in_type, n, k, n) : make_layout(in_type, k, n, k);
  o.lt_b = ta == Transpose::no ? make_layout(in_type, k, m, k) : make_layout(in_type, m, k, m);
  o.lt_c = make_layout(out_type, n, m, n);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  DP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  o.pref = PreferenceHandle(raw_pref);
  set_pref(o.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  set_pref(o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(b));
  set_pref(o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(a));
  set_pref(o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(c));
  set_pref(o.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(c));
  return o;
}

// A matmul descriptor with our transposes (cuBLASLt's A is our b).
MatmulDescHandle lt_desc(cublasComputeType_t compute, Transpose ta, Transpose tb) {
  MatmulDescHandle d = make_matmul_desc(compute);
  set_attr(d, CUBLASLT_MATMUL_DESC_TRANSA, tb == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T);
  set_attr(d, CUBLASLT_MATMUL_DESC_TRANSB, ta == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T);
  return d;
}

// The heuristic's best algorithm for `desc` over `o`; false when it has none (or answers an
// error, e.g. INVALID_VALUE for a dimension of 1).
bool lt_find_algo(cublasLtHandle_t handle, const MatmulDescHandle& desc, const LtOperands& o,
                  cublasLtMatmulHeuristicResult_t* result) {
  int found = 0;
  cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), o.lt_a.get(), o.lt_b.get(), o.lt_c.get(),
                                     o.lt_c.get(), o.pref.get(), 1, result, &found);
  return st == CUBLAS_STATUS_SUCCESS && found > 0;
}

// Everything cublasLtMatmul needs but the pointers, for one (shape, transposes, dtypes, math,
// epilogue, alignments): built and searched once per context, then reused. The bias pointer is
// the one attribute that changes between calls; it is set on the cached descriptor per call.
struct GemmPlan {
  MatmulDescHandle desc_fused, desc;  // with the bias epilogue (when wanted), without
  LtOperands ops;
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
      v = __fmul_rn(beta, to_float(c[i]));  // rounded before the add, as on the CPU (no FMA)
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
  if (k == 0 || alpha == 0.f) {  // empty or zero product: c = beta c + bias (a, b not read)
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
  cublasOperation_t op_lt_a = tb == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;     // our b
  cublasOperation_t op_lt_b = ta == Transpose::no ? CUBLAS_OP_N : CUBLAS_OP_T;     // our a
  int64_t ld_a = tb == Transpose::no ? n : k, ld_b = ta == Transpose::no ? k : m;  // lt_operands
  GemmPlan& plan = ctx.state<GemmPlans>().cache.get(key, [&] {
    GemmPlan pl;
    pl.ops = lt_operands(in_type, out_type, m, n, k, ta, tb, a.raw(), b.raw(), c.raw(),
                         kGemmWorkspaceBytes);
    auto new_desc = [&] { return lt_desc(compute, ta, tb); };
    auto find_algo = [&](const MatmulDescHandle& desc, cublasLtMatmulHeuristicResult_t* result) {
      return lt_find_algo(handle, desc, pl.ops, result);
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
            cublasLtMatmul(handle, plan.desc_fused.get(), &alpha, b.raw(), plan.ops.lt_a.get(),
                           a.raw(), plan.ops.lt_b.get(), &beta, c.raw(), plan.ops.lt_c.get(),
                           c.raw(), plan.ops.lt_c.get(), &plan.result_fused.algo, workspace,
                           kGemmWorkspaceBytes, s),
            "cublasLtMatmul");
      case kGemmLt:
        return cublas_attempt(
            cublasLtMatmul(handle, plan.desc.get(), &alpha, b.raw(), plan.ops.lt_a.get(), a.raw(),
                           plan.ops.lt_b.get(), &beta, c.raw(), plan.ops.lt_c.get(), c.raw(),
                           plan.ops.lt_c.get(), &plan.result.algo, workspace, kGemmWorkspaceBytes,
                           s),
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

namespace {

// The epilogues of the fused ops (ops.hpp): the MLP's GELU forward and backward
// (gemm_gelu_tanh), and a Linear's bias gradient beside its weight gradient (gemm_bias_grad).
enum class Epilogue : int64_t { gelu_aux_bias = 1, dgelu_bgrad = 2, bgradb = 3 };

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::gelu_aux_bias:
      return "GELU_AUX_BIAS";
    case Epilogue::dgelu_bgrad:
      return "DGELU_BGRAD";
    default:
      return "BGRADB";
  }
}

// One epilogue GEMM's cuBLASLt plan: the descriptor with the epilogue (its pointers set per
// call) and the heuristic's algorithm; usable false when there is none, or when a run refused
// it (the ops in turn run from then on).
struct EpiloguePlan {
  MatmulDescHandle desc;
  LtOperands ops;
  cublasLtMatmulHeuristicResult_t result{};
  bool usable = false;
};
// epilogue, m, n, k, ta, tb, in and out dtypes, beta != 0, alignments of a, b, c, aux, vector.
using EpilogueKey = std::array<int64_t, 15>;
struct EpiloguePlans {
  PlanCache<EpilogueKey, EpiloguePlan> cache;
};

// c (m, n) = the epilogue over op(a) op(b) (+ beta c), where cuBLASLt has an algorithm for it:
// - gelu_aux_bias: c = gelu(product + vec), aux = product + vec (vec: the bias, n values);
// - dgelu_bgrad: c = product * gelu'(aux), vec = c's column sums (n values);
// - bgradb: c = product + beta c, vec = the sums of op(a)'s columns over k (m values: with
//   a = dy^T, the bias gradient of dw = dy^T x).
// vec in c's dtype (cuBLASLt's bias type for these: the output's); aux (m, n) in c's dtype, its
// leading dimension n. Returns false, having queued nothing, when cuBLASLt has no algorithm for
// it or refuses it, or the operands do not meet its rules (16-bit operands; for GELU a 16-bit c
// of the operands' dtype and n a multiple of 8; 16-byte aligned vectors).
bool epilogue_gemm(Epilogue e, Tensor& c, const Tensor& a, Transpose ta, const Tensor& b,
                   Transpose tb, float beta, void* vec, void* aux, DeviceContext& ctx) {
  const int64_t m = c.dim(0), n = c.dim(1);
  const int64_t k = ta == Transpose::no ? a.dim(1) : a.dim(0);
  const bool gelu = e != Epilogue::bgradb;
  // The GPT runs these in 16-bit; f32 operands keep the ops, which the CPU matches.
  if (a.dtype() == DType::f32 || k == 0 || alignment_of(vec) < 16 ||
      (gelu && (a.dtype() != c.dtype() || n % 8 != 0 || alignment_of(aux) < 16)))
    return false;
  const cudaDataType_t in_type = cuda_type(a.dtype()), out_type = cuda_type(c.dtype());
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  EpilogueKey key{static_cast<int64_t>(e),
                  m,
                  n,
                  k,
                  static_cast<int64_t>(ta),
                  static_cast<int64_t>(tb),
                  static_cast<int64_t>(a.dtype()),
                  static_cast<int64_t>(c.dtype()),
                  beta != 0.f ? 1 : 0,
                  alignment_of(a.raw()),
                  alignment_of(b.raw()),
                  alignment_of(c.raw()),
                  gelu ? alignment_of(aux) : 0,
                  alignment_of(vec),
                  static_cast<int64_t>(compute)};
  cublasLtHandle_t handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  EpiloguePlan& plan = ctx.state<EpiloguePlans>().cache.get(key, [&] {
    EpiloguePlan pl;
    pl.ops = lt_operands(in_type, out_type, m, n, k, ta, tb, a.raw(), b.raw(), c.raw(),
                         kGemmWorkspaceBytes);
    pl.desc = lt_desc(compute, ta, tb);
    const cublasLtEpilogue_t lt = e == Epilogue::gelu_aux_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                  : e == Epilogue::dgelu_bgrad ? CUBLASLT_EPILOGUE_DGELU_BGRAD
                                                               : CUBLASLT_EPILOGUE_BGRADB;
    set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(lt));
    set_attr(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(out_type));
    set_attr(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, vec);
    if (gelu) {
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, n);  // D^T's rows: c's columns
      set_attr(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
               static_cast<int32_t>(out_type));
    }
    pl.usable = lt_find_algo(handle, pl.desc, pl.ops, &pl.result);
    if (debug_logging())
      std::fprintf(stderr, "dp: debug: gemm %s epilogue (m %lld, n %lld, k %lld): %s\n",
                   epilogue_name(e), static_cast<long long>(m), static_cast<long long>(n),
                   static_cast<long long>(k),
                   pl.usable ? "cuBLASLt has an algorithm" : "no algorithm: the ops in turn");
    return pl;
  });
  if (!plan.usable) return false;
  set_attr(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, vec);  // the per-call pointers
  if (gelu) set_attr(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
  const float alpha = 1.f;
  char* workspace = static_cast<char*>(ctx.workspace(kGemmWorkspaceBytes + kBias16Bytes));
  cublasStatus_t st = cublasLtMatmul(
      handle, plan.desc.get(), &alpha, b.raw(), plan.ops.lt_a.get(), a.raw(), plan.ops.lt_b.get(),
      &beta, c.raw(), plan.ops.lt_c.get(), c.raw(), plan.ops.lt_c.get(), &plan.result.algo,
      workspace, kGemmWorkspaceBytes, stream_of(ctx));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    plan.usable = false;  // refused before launching: the ops in turn, now and from now on
    return false;
  }
  DP_CUBLAS_CHECK(st);
  return true;
}

// The vector behind the GEMM workspace (where a 16-bit bias is rounded for the bias epilogue)
// that an epilogue's bias gradient of `count` values of `t` fits in; null when it does not.
void* epilogue_vector(DeviceContext& ctx, int64_t count, DType t) {
  if (count * static_cast<int64_t>(dtype_size(t)) > static_cast<int64_t>(kBias16Bytes))
    return nullptr;
  return static_cast<char*>(ctx.workspace(kGemmWorkspaceBytes + kBias16Bytes)) +
         kGemmWorkspaceBytes;
}

// db (f32, n) (+)= g (n, f32 or 16-bit): an epilogue's bias gradient into the parameter's.
template <class T>
__global__ void add_bias_grad_kernel(float* db, const T* g, int64_t n, bool accumulate) {
  DP_GRID_STRIDE_LOOP(i, n) db[i] = accumulate ? db[i] + to_float(g[i]) : to_float(g[i]);
}

void launch_add_bias_grad(Tensor& dbias, const void* g, DType t, Accumulate acc, cudaStream_t s) {
  const int64_t n = dbias.numel();
  const bool accumulate = acc == Accumulate::yes;
  float* db = dbias.data<float>();
  switch (t) {
    case DType::f32:
      add_bias_grad_kernel<<<blocks_for(n), kThreads, 0, s>>>(db, static_cast<const float*>(g), n,
                                                              accumulate);
      break;
    case DType::bf16:
      add_bias_grad_kernel<<<blocks_for(n), kThreads, 0, s>>>(
          db, static_cast<const __nv_bfloat16*>(g), n, accumulate);
      break;
    default:
      add_bias_grad_kernel<<<blocks_for(n), kThreads, 0, s>>>(db, static_cast<const __half*>(g), n,
                                                              accumulate);
  }
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gemm_gelu_tanh(Tensor& y, Tensor& pre, const Tensor& a, Transpose ta, const Tensor& b,
                    Transpose tb, const Tensor& bias, DeviceContext& ctx) {
  NvtxRange range("kernels/gemm_gelu_tanh");
  // The epilogue takes a bias in y's dtype: a Linear passes its 16-bit copy.
  if (bias.defined() && bias.dtype() == y.dtype() &&
      epilogue_gemm(Epilogue::gelu_aux_bias, y, a, ta, b, tb, 0.f, const_cast<void*>(bias.raw()),
                    pre.raw(), ctx))
    return;
  cuda::gemm(pre, a, ta, b, tb, 1.f, 0.f, bias, ctx);
  cuda::gelu_tanh(y, pre, ctx);
}

void gemm_gelu_tanh_backward(Tensor& dpre, Tensor& dbias, Accumulate bias_acc, const Tensor& dy,
                             Transpose tdy, const Tensor& w, Transpose tw, const Tensor& pre,
                             DeviceContext& ctx) {
  NvtxRange range("kernels/gemm_gelu_tanh_backward");
  void* grad = dbias.defined() && cuda_dgelu_epilogue()
                   ? epilogue_vector(ctx, dpre.dim(1), dpre.dtype())
                   : nullptr;
  if (grad && epilogue_gemm(Epilogue::dgelu_bgrad, dpre, dy, tdy, w, tw, 0.f, grad,
                            const_cast<void*>(pre.raw()), ctx)) {
    launch_add_bias_grad(dbias, grad, dpre.dtype(), bias_acc, stream_of(ctx));
    return;
  }
  cuda::gemm(dpre, dy, tdy, w, tw, 1.f, 0.f, Tensor(), ctx);
  cuda::gelu_tanh_backward(dpre, dpre, pre, Accumulate::no, ctx);  // in place: element by element
  if (dbias.defined()) cuda::bias_backward(dbias, dpre, bias_acc, ctx);
}

void linear_param_grads(Tensor& dw, Tensor& dbias, const Tensor& dy, const Tensor& x,
                        const Tensor& dy_for_bias, DeviceContext& ctx) {
  NvtxRange range("kernels/linear_param_grads");
  // The epilogue sums the GEMM's own operand: where the bias is summed from that tensor.
  const bool same =
      dbias.defined() && dy_for_bias.raw() == dy.raw() && dy_for_bias.dtype() == dy.dtype();
  void* grad = same ? epilogue_vector(ctx, dw.dim(0), dw.dtype()) : nullptr;
  if (grad && epilogue_gemm(Epilogue::bgradb, dw, dy, Transpose::yes, x, Transpose::no, 1.f, grad,
                            nullptr, ctx)) {
    launch_add_bias_grad(dbias, grad, dw.dtype(), Accumulate::yes, stream_of(ctx));
    return;
  }
  cuda::gemm(dw, dy, Transpose::yes, x, Transpose::no, 1.f, 1.f, Tensor(), ctx);
  if (dbias.defined()) cuda::bias_backward(dbias, dy_for_bias, Accumulate::yes, ctx);
}

}  // namespace kernels::cuda
