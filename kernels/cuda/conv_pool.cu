// 2-D convolution (cuDNN, NCHW cross-correlation) and max/average pooling (hand-written
// kernels mirroring kernels/cpu/pool.cpp, on f32, f16 or bf16 storage computed in f32:
// with_storage; the backward passes gather per input element, so they need no atomics and are
// deterministic).
// Each plan keeps cuDNN's ranked algorithms that the numerics policy admits
// (kernels/runtime/algo_select.hpp: no Winograd or FFT in 16-bit, never FP32 -> FP16
// down-conversion, no tensor cores under strict f32); a call runs the chosen one and, when cuDNN
// answers NOT_SUPPORTED, the next. DP_LOG=debug logs the choice per shape and dtype.
// f16/bf16 convolutions run cuDNN's pseudo-16-bit configuration (16-bit x, w, y descriptors, f32
// compute, tensor-op math allowed): cuDNN writes a 16-bit result, straight into a 16-bit output
// without accumulation, else into scratch that a small kernel stores or adds into the output.
#include <algorithm>
#include <array>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/runtime/algo_select.hpp"
#include "kernels/runtime/handle.hpp"
#include "kernels/runtime/plan_cache.hpp"

namespace kernels::cuda {

namespace {

// ---- cuDNN descriptors and plans ----------------------------------------------------------
// A descriptor is owned by a UniqueHandle from its create call on, so a cudnnSet* that throws
// (a shape cuDNN rejects) destroys it; plans keep their descriptors for the context's life.

int to_int(int64_t v, const char* what) {
  DP_CHECK(v >= 0 && v <= INT32_MAX, "conv2d: " << what << " = " << v << " does not fit cuDNN");
  return static_cast<int>(v);
}

using TensorDescHandle = UniqueHandle<cudnnTensorDescriptor_t, cudnnStatus_t,
                                      cudnnDestroyTensorDescriptor, CUDNN_STATUS_SUCCESS>;
using FilterDescHandle = UniqueHandle<cudnnFilterDescriptor_t, cudnnStatus_t,
                                      cudnnDestroyFilterDescriptor, CUDNN_STATUS_SUCCESS>;
using ConvDescHandle = UniqueHandle<cudnnConvolutionDescriptor_t, cudnnStatus_t,
                                    cudnnDestroyConvolutionDescriptor, CUDNN_STATUS_SUCCESS>;

cudnnDataType_t cudnn_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::f16:
      return CUDNN_DATA_HALF;
    case DType::bf16:
      return CUDNN_DATA_BFLOAT16;
    default:
      DP_THROW("conv2d: cuDNN convolutions take f32, f16 or bf16, got " << t);
  }
}

// (N, C, H, W) contiguous, of the convolution's data type (its inputs' dtype).
TensorDescHandle tensor_desc(const Tensor& t, DType dtype) {
  cudnnTensorDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&raw));
  TensorDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d.get(), CUDNN_TENSOR_NCHW, cudnn_dtype(dtype),
                                            to_int(t.dim(0), "N"), to_int(t.dim(1), "C"),
                                            to_int(t.dim(2), "H"), to_int(t.dim(3), "W")));
  return d;
}

FilterDescHandle filter_desc(const Tensor& w, DType dtype) {  // (K, C, R, S)
  cudnnFilterDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&raw));
  FilterDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d.get(), cudnn_dtype(dtype), CUDNN_TENSOR_NCHW,
                                            to_int(w.dim(0), "K"), to_int(w.dim(1), "C"),
                                            to_int(w.dim(2), "R"), to_int(w.dim(3), "S")));
  return d;
}

// Strict f32 math uses FMA kernels only (cuDNN's default math would allow TF32 on Ampere+).
// 16-bit inputs always allow tensor-op math: their products are exact in f32 either way.
bool strict_math(DeviceContext& ctx, DType inputs) {
  return ctx.math() == MathMode::strict && inputs == DType::f32;
}

// The descriptor's math type while cuDNN ranks the algorithms: it offers tensor-core ones only
// when tensor-op math is set, so 16-bit inputs ask for it (each candidate then runs with its own
// math type, set_math).
ConvDescHandle conv_desc(const Conv2dParams& p, bool strict, DType inputs) {
  cudnnConvolutionDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&raw));
  ConvDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d.get(), p.pad_h, p.pad_w, p.stride_h, p.stride_w,
                                                 1, 1, CUDNN_CROSS_CORRELATION,
                                                 CUDNN_DATA_FLOAT));  // f32 compute, any dtype
  const cudnnMathType_t math = strict                 ? CUDNN_FMA_MATH
                               : inputs != DType::f32 ? CUDNN_TENSOR_OP_MATH
                                                      : CUDNN_DEFAULT_MATH;
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(d.get(), math));
  return d;
}

enum class ConvPass { forward, backward_data, backward_filter };

const char* pass_name(ConvPass pass) {
  switch (pass) {
    case ConvPass::forward:
      return "conv2d_forward";
    case ConvPass::backward_data:
      return "conv2d_backward_data";
    default:
      return "conv2d_backward_filter";
  }
}

// What a convolution call needs besides its pointers: the descriptors and the algorithm choice
// (the admissible candidates with their math types and workspace sizes; the math type is set
// on `conv` per run). Searched once per key and context.
struct ConvPlan {
  TensorDescHandle x, y;  // input and output activations (dx, dy for the backward passes)
  FilterDescHandle w;
  ConvDescHandle conv;
  AlgoChoice choice;
};

// pass, data type (the inputs' dtype, which the plan's x, w and y descriptors all take),
// x (N, C, H, W), w (K, C, R, S), y (N, K, P, Q), stride, padding, strict math. Tensors are
// contiguous NCHW, so shapes fix strides.
using ConvKey = std::array<int64_t, 19>;

ConvKey conv_key(ConvPass pass, DType dtype, const Tensor& x, const Tensor& w, const Tensor& y,
                 const Conv2dParams& p, bool strict) {
  return {static_cast<int64_t>(pass),
          static_cast<int64_t>(dtype),
          x.dim(0),
          x.dim(1),
          x.dim(2),
          x.dim(3),
          w.dim(0),
          w.dim(1),
          w.dim(2),
          w.dim(3),
          y.dim(0),
          y.dim(1),
          y.dim(2),
          y.dim(3),
          p.stride_h,
          p.stride_w,
          p.pad_h,
          p.pad_w,
          strict ? 1 : 0};
}

// The convolution plans of one DeviceContext (ctx.state<ConvPlans>()).
struct ConvPlans {
  PlanCache<ConvKey, ConvPlan> cache;
};

// Algorithms needing more workspace than this are skipped.
constexpr size_t kMaxConvWorkspace = size_t{256} << 20;

// The numerical and behaviour notes of a legacy cuDNN algorithm: the Winograd and FFT engines
// by their algorithm ids (the notes the backend API reports for them), down-conversion and
// tensor cores by the math type, determinism as ranked.
uint32_t algo_notes(ConvPass pass, int algo, cudnnMathType_t math, cudnnDeterminism_t det) {
  uint32_t notes = 0;
  switch (pass) {
    case ConvPass::forward:
      if (algo == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD ||
          algo == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED)
        notes |= kNoteWinograd;
      if (algo == CUDNN_CONVOLUTION_FWD_ALGO_FFT || algo == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING)
        notes |= kNoteFft;
      break;
    case ConvPass::backward_data:
      if (algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD ||
          algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED)
        notes |= kNoteWinograd;
      if (algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT ||
          algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING)
        notes |= kNoteFft;
      break;
    case ConvPass::backward_filter:
      if (algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED) notes |= kNoteWinograd;
      if (algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT ||
          algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING)
        notes |= kNoteFft;
      break;
  }
  if (math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) notes |= kNoteDownConvert | kNoteTensorCore;
  if (math == CUDNN_TENSOR_OP_MATH) notes |= kNoteTensorCore;
  if (det != CUDNN_DETERMINISTIC) notes |= kNoteNondeterministic;
  return notes;
}

const char* algo_name(ConvPass pass, int algo) {
  static const char* const kFwd[] = {
      "IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING",
      "WINOGRAD",      "WINOGRAD_NONFUSED"};
  static const char* const kData[] = {"ALGO_0",     "ALGO_1",   "FFT",
                                      "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"};
  static const char* const kFilter[] = {
      "ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING"};
  auto pick = [&](const char* const* names, int n) {
    return algo >= 0 && algo < n ? names[algo] : "?";
  };
  switch (pass) {
    case ConvPass::forward:
      return pick(kFwd, 8);
    case ConvPass::backward_data:
      return pick(kData, 6);
    default:
      return pick(kFilter, 7);
  }
}

// The math type to run a candidate with.
void set_math(const ConvDescHandle& conv, const AlgoCandidate& c, bool strict) {
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(
      conv.get(), strict ? CUDNN_FMA_MATH : static_cast<cudnnMathType_t>(c.math)));
}

// Completes the plan of one pass from its descriptors: cuDNN's ranked algorithms
// (find(plan, max, &count, perf), at most max_count() of them), as candidates that the numerics
// policy of `dtype` and `strict` filters. Each one's workspace is what cuDNN asks for with the
// math type it will run with (workspace_size(plan, id), after set_math): the ranking's estimate
// is for the math type it reported, which strict math overrides. `what` names the pass, shapes
// and dtype.
template <class Perf, class MaxCount, class Find, class WorkspaceSize>
ConvPlan complete_plan(ConvPlan pl, ConvPass pass, DType dtype, bool strict, MaxCount max_count,
                       Find find, WorkspaceSize workspace_size, const std::string& what) {
  int max = max_count(), count = 0;
  std::vector<Perf> perf(static_cast<size_t>(max));
  find(pl, max, &count, perf.data());
  std::vector<AlgoCandidate> ranked;
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[i];
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    int id = static_cast<int>(p.algo);
    AlgoCandidate c{id, algo_name(pass, id), p.memory,
                    algo_notes(pass, id, p.mathType, p.determinism), static_cast<int>(p.mathType)};
    set_math(pl.conv, c, strict);
    size_t bytes = 0;
    if (workspace_size(pl, id, &bytes) == CUDNN_STATUS_SUCCESS)
      c.workspace_bytes = std::max(c.workspace_bytes, bytes);
    ranked.push_back(std::move(c));
  }
  pl.choice = AlgoChoice(admissible(ranked, numerics_policy(dtype, strict, kMaxConvWorkspace)),
                         what, ranked.size());
  return pl;
}

// A cuDNN execution's status as an attempt: NOT_SUPPORTED (any sub-code) means "try the next
// algorithm" (nothing was written, so even an accumulating call may retry); other failures
// throw, naming `call`.
AlgoAttempt cudnn_attempt(cudnnStatus_t st, const char* call) {
  if (st == CUDNN_STATUS_SUCCESS) return AlgoAttempt::success();
  if (CUDNN_STATUS_CATEGORY(st) == CUDNN_STATUS_NOT_SUPPORTED)
    return AlgoAttempt::unsupported(cudnnGetErrorString(st));
  DP_THROW(call << " failed: " << cudnnGetErrorString(st));
}

// Names one plan in logs and errors: the pass, its two operands (shape and dtype) and the math.
std::string plan_what(ConvPass pass, const Tensor& a, const Tensor& b, bool strict) {
  std::ostringstream os;
  os << pass_name(pass) << " " << a << ", " << b << (strict ? " (strict f32)" : "");
  return os.str();
}

// Output gradient or result with nothing to add up: zero it, or leave it when accumulating.
void zero_unless_accumulating(Tensor& t, Accumulate acc, cudaStream_t s) {
  if (acc == Accumulate::no) DP_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), s));
}

// ---- the output of a convolution pass ------------------------------------------------------

// out (+)= result, with result a 16-bit value (cuDNN's rounded output); a 16-bit out rounds the
// f32 sum once more.
template <class Out, class T>
__global__ void store_rounded_kernel(Out* out, const T* result, int64_t n, bool accumulate) {
  DP_GRID_STRIDE_LOOP(i, n) {
    float r = to_float<T>(result[i]);
    out[i] = from_float<Out>(accumulate ? to_float<Out>(out[i]) + r : r);
  }
}

template <class T>
void launch_store_rounded(Tensor& out, const void* result, bool accumulate, cudaStream_t s) {
  int64_t n = out.numel();
  const T* r = static_cast<const T*>(result);
  if (out.dtype() == DType::f32)
    store_rounded_kernel<<<blocks_for(n), kThreads, 0, s>>>(out.data<float>(), r, n, accumulate);
  else
    store_rounded_kernel<<<blocks_for(n), kThreads, 0, s>>>(out.data<T>(), r, n, accumulate);
  DP_CUDA_CHECK_LAUNCH();
}

// Where cuDNN writes one pass: the plan's workspace and the result buffer with its beta. The
// result is `out` itself for f32 inputs, and for 16-bit inputs into a 16-bit output without
// accumulation; otherwise 16-bit scratch placed after the workspace (one ctx.workspace), which
// finish() then stores or adds into `out`.
struct ConvOutput {
  void* workspace = nullptr;
  void* result = nullptr;
  float beta = 0.f;
  bool staged = false;
};

ConvOutput conv_output(size_t plan_ws_bytes, Tensor& out, DType inputs, Accumulate acc,
                       DeviceContext& ctx) {
  bool staged = inputs != DType::f32 && (out.dtype() == DType::f32 || acc == Accumulate::yes);
  constexpr size_t kAlign = 256;
  size_t ws_bytes = (plan_ws_bytes + kAlign - 1) / kAlign * kAlign;
  size_t scratch_bytes = staged ? static_cast<size_t>(out.numel()) * dtype_size(inputs) : 0;
  size_t total = ws_bytes + scratch_bytes;
  auto* base = static_cast<char*>(total ? ctx.workspace(total) : nullptr);
  ConvOutput o;
  o.workspace = plan_ws_bytes ? base : nullptr;
  o.staged = staged;
  o.result = staged ? base + ws_bytes : out.raw();
  o.beta = !staged && acc == Accumulate::yes ? 1.f : 0.f;
  return o;
}

// After cuDNN wrote o.result: out (+)= the staged 16-bit result (nothing when not staged).
void finish(const ConvOutput& o, Tensor& out, DType inputs, Accumulate acc, cudaStream_t s) {
  if (!o.staged) return;
  bool accumulate = acc == Accumulate::yes;
  if (inputs == DType::f16)
    launch_store_rounded<__half>(out, o.result, accumulate, s);
  else
    launch_store_rounded<__nv_bfloat16>(out, o.result, accumulate, s);
}

// Runs one pass with the plan's chosen algorithm, and the next ones while cuDNN answers
// NOT_SUPPORTED: sets the candidate's math type, places its workspace and result buffer, makes
// the cuDNN call (`call(candidate, output)` returns its status; `name` names it in errors) and
// stores the result into `out`.
template <class Call>
void run_pass(ConvPlan& plan, Tensor& out, DType inputs, Accumulate acc, bool strict,
              DeviceContext& ctx, const char* name, Call call) {
  plan.choice.run([&](const AlgoCandidate& c) {
    set_math(plan.conv, c, strict);
    ConvOutput o = conv_output(c.workspace_bytes, out, inputs, acc, ctx);
    AlgoAttempt a = cudnn_attempt(call(c, o), name);
    if (a.outcome == AlgoAttempt::Outcome::ok) finish(o, out, inputs, acc, stream_of(ctx));
    return a;
  });
}

// ---- pooling kernels ------------------------------------------------------------------------

struct PoolGeometry {
  int64_t planes, height, width, out_h, out_w;  // planes = N * C
  int kh, kw, sh, sw, ph, pw;
};

PoolGeometry pool_geometry(const Tensor& x, const Tensor& y, const Pool2dParams& p) {
  return {x.dim(0) * x.dim(1), x.dim(2),   x.dim(3),   y.dim(2), y.dim(3), p.kernel_h,
          p.kernel_w,          p.stride_h, p.stride_w, p.pad_h,  p.pad_w};
}

// Maximum of window (oh, ow); padding is skipped (never wins). -inf if the window holds no
// input element.
template <class T>
__device__ float window_max(const T* plane, const PoolGeometry& g, int64_t oh, int64_t ow) {
  float best = -INFINITY;
  bool any = false;
  for (int r = 0; r < g.kh; ++r) {
    int64_t h = oh * g.sh - g.ph + r;
    if (h < 0 || h >= g.height) continue;
    for (int c = 0; c < g.kw; ++c) {
      int64_t w = ow * g.sw - g.pw + c;
      if (w < 0 || w >= g.width) continue;
      float v = to_float(plane[h * g.width + w]);
      // NaN propagates, the first one winning (the CPU's max_or_nan).
      if (!any || v > best || (isnan(v) && !isnan(best))) best = v;
      any = true;
    }
  }
  return best;
}

// Offset in the plane of the first element of window (oh, ow), in row-major window order,
// equal to the forward maximum `target` (a NaN equal to a NaN); -1 if none is.
template <class T>
__device__ int64_t window_first_equal(const T* plane, const PoolGeometry& g, int64_t oh, int64_t ow,
                                      float target) {
  for (int r = 0; r < g.kh; ++r) {
    int64_t h = oh * g.sh - g.ph + r;
    if (h < 0 || h >= g.height) continue;
    for (int c = 0; c < g.kw; ++c) {
      int64_t w = ow * g.sw - g.pw + c;
      if (w < 0 || w >= g.width) continue;
      const float v = to_float(plane[h * g.width + w]);
      if (v == target || (isnan(v) && isnan(target))) return h * g.width + w;
    }
  }
  return -1;
}

template <class Y, class X>
__global__ void max_pool_forward_kernel(Y* y, const X* x, PoolGeometry g) {
  int64_t n = g.planes * g.out_h * g.out_w;
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t ow = i % g.out_w, oh = (i / g.out_w) % g.out_h, plane = i / (g.out_w * g.out_h);
    y[i] = from_float<Y>(window_max(x + plane * g.height * g.width, g, oh, ow));
  }
}

// Output rows/cols whose windows cover input coordinate `h`: [*first, *last] (may be empty).
__device__ void covering_range(int64_t h, int k, int stride, int pad, int64_t out, int64_t* first,
                               int64_t* last) {
  int64_t lo = h + pad - k + 1;  // smallest window start <= h with start + k > h
  *first = lo <= 0 ? 0 : (lo + stride - 1) / stride;
  int64_t hi = (h + pad) / stride;  // h + pad >= 0
  *last = hi < out - 1 ? hi : out - 1;
}

// Gather: dx[h, w] (+)= sum of dy over the windows whose first element equal to the forward
// maximum y is (h, w).
template <class DX, class DY, class X, class Y>
__global__ void max_pool_backward_kernel(DX* dx, const DY* dy, const X* x, const Y* y,
                                         PoolGeometry g, bool accumulate) {
  int64_t n = g.planes * g.height * g.width;
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t w = i % g.width, h = (i / g.width) % g.height, plane = i / (g.width * g.height);
    const X* xp = x + plane * g.height * g.width;
    const DY* dyp = dy + plane * g.out_h * g.out_w;
    const Y* yp = y + plane * g.out_h * g.out_w;
    int64_t p0, p1, q0, q1;
    covering_range(h, g.kh, g.sh, g.ph, g.out_h, &p0, &p1);
    covering_range(w, g.kw, g.sw, g.pw, g.out_w, &q0, &q1);
    float grad = 0.f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) {
        int64_t o = p * g.out_w + q;
        if (window_first_equal(xp, g, p, q, to_float(yp[o])) == h * g.width + w)
          grad += to_float(dyp[o]);
      }
    dx[i] = from_float<DX>(accumulate ? to_float(dx[i]) + grad : grad);
  }
}

// Average over the window, padding counted in the divisor (count_include_pad).
template <class Y, class X>
__global__ void avg_pool_forward_kernel(Y* y, const X* x, PoolGeometry g) {
  int64_t n = g.planes * g.out_h * g.out_w;
  float inv_area = 1.f / static_cast<float>(g.kh * g.kw);
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t ow = i % g.out_w, oh = (i / g.out_w) % g.out_h, plane = i / (g.out_w * g.out_h);
    const X* xp = x + plane * g.height * g.width;
    float s = 0.f;
    for (int r = 0; r < g.kh; ++r) {
      int64_t h = oh * g.sh - g.ph + r;
      if (h < 0 || h >= g.height) continue;
      for (int c = 0; c < g.kw; ++c) {
        int64_t w = ow * g.sw - g.pw + c;
        if (w >= 0 && w < g.width) s += to_float(xp[h * g.width + w]);
      }
    }
    y[i] = from_float<Y>(s * inv_area);
  }
}

// Gather: dx[h, w] (+)= sum over the windows covering (h, w) of dy / (kh kw).
template <class DX, class DY>
__global__ void avg_pool_backward_kernel(DX* dx, const DY* dy, PoolGeometry g, bool accumulate) {
  int64_t n = g.planes * g.height * g.width;
  float inv_area = 1.f / static_cast<float>(g.kh * g.kw);
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t w = i % g.width, h = (i / g.width) % g.height, plane = i / (g.width * g.height);
    const DY* dyp = dy + plane * g.out_h * g.out_w;
    int64_t p0, p1, q0, q1;
    covering_range(h, g.kh, g.sh, g.ph, g.out_h, &p0, &p1);
    covering_range(w, g.kw, g.sw, g.pw, g.out_w, &q0, &q1);
    float grad = 0.f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) grad += to_float(dyp[p * g.out_w + q]) * inv_area;
    dx[i] = from_float<DX>(accumulate ? to_float(dx[i]) + grad : grad);
  }
}

}  // namespace

// ---- convolution ---------------------------------------------------------------------------

PlanCounts conv_plan_counts(DeviceContext& ctx) {
  auto& c = ctx.state<ConvPlans>().cache;
  return {c.hits(), c.misses()};
}

// x (N, C, H, W) * w (K, C, R, S) -> y (N, K, P, Q)
void conv2d_forward(Tensor& y, const Tensor& x, const Tensor& w, const Conv2dParams& p,
                    DeviceContext& ctx) {
  NvtxRange range("kernels/conv2d_forward");
  cudaStream_t s = stream_of(ctx);
  if (y.numel() == 0) return;
  if (x.numel() == 0 || w.numel() == 0) return zero_unless_accumulating(y, Accumulate::no, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  DType dt = x.dtype();
  bool strict = strict_math(ctx, dt);
  ConvKey key = conv_key(ConvPass::forward, dt, x, w, y, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionFwdAlgoPerf_t>(
        ConvPlan{tensor_desc(x, dt), tensor_desc(y, dt), filter_desc(w, dt),
                 conv_desc(p, strict, dt), AlgoChoice()},
        ConvPass::forward, dt, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(
              handle, pl.x.get(), pl.w.get(), pl.conv.get(), pl.y.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, int id, size_t* bytes) {
          return cudnnGetConvolutionForwardWorkspaceSize(
              handle, pl.x.get(), pl.w.get(), pl.conv.get(), pl.y.get(),
              static_cast<cudnnConvolutionFwdAlgo_t>(id), bytes);
        },
        plan_what(ConvPass::forward, x, w, strict));
  });
  run_pass(plan, y, dt, Accumulate::no, strict, ctx, "cudnnConvolutionForward",
           [&](const AlgoCandidate& c, const ConvOutput& o) {
             float alpha = 1.f;
             return cudnnConvolutionForward(
                 handle, &alpha, plan.x.get(), x.raw(), plan.w.get(), w.raw(), plan.conv.get(),
                 static_cast<cudnnConvolutionFwdAlgo_t>(c.id), o.workspace, c.workspace_bytes,
                 &o.beta, plan.y.get(), o.result);
           });
}

// dy (N, K, P, Q), w (K, C, R, S) -> dx (N, C, H, W)
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/conv2d_backward_data");
  cudaStream_t s = stream_of(ctx);
  if (dx.numel() == 0) return;
  if (dy.numel() == 0 || w.numel() == 0) return zero_unless_accumulating(dx, acc, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  DType dt = dy.dtype();
  bool strict = strict_math(ctx, dt);
  ConvKey key = conv_key(ConvPass::backward_data, dt, dx, w, dy, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionBwdDataAlgoPerf_t>(
        ConvPlan{tensor_desc(dx, dt), tensor_desc(dy, dt), filter_desc(w, dt),
                 conv_desc(p, strict, dt), AlgoChoice()},
        ConvPass::backward_data, dt, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
              handle, pl.w.get(), pl.y.get(), pl.conv.get(), pl.x.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, int id, size_t* bytes) {
          return cudnnGetConvolutionBackwardDataWorkspaceSize(
              handle, pl.w.get(), pl.y.get(), pl.conv.get(), pl.x.get(),
              static_cast<cudnnConvolutionBwdDataAlgo_t>(id), bytes);
        },
        plan_what(ConvPass::backward_data, dy, w, strict));
  });
  run_pass(plan, dx, dt, acc, strict, ctx, "cudnnConvolutionBackwardData",
           [&](const AlgoCandidate& c, const ConvOutput& o) {
             float alpha = 1.f;
             return cudnnConvolutionBackwardData(
                 handle, &alpha, plan.w.get(), w.raw(), plan.y.get(), dy.raw(), plan.conv.get(),
                 static_cast<cudnnConvolutionBwdDataAlgo_t>(c.id), o.workspace, c.workspace_bytes,
                 &o.beta, plan.x.get(), o.result);
           });
}

// dy (N, K, P, Q), x (N, C, H, W) -> dw (K, C, R, S)
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/conv2d_backward_filter");
  cudaStream_t s = stream_of(ctx);
  if (dw.numel() == 0) return;
  if (dy.numel() == 0 || x.numel() == 0) return zero_unless_accumulating(dw, acc, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  DType dt = x.dtype();
  bool strict = strict_math(ctx, dt);
  ConvKey key = conv_key(ConvPass::backward_filter, dt, x, dw, dy, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionBwdFilterAlgoPerf_t>(
        ConvPlan{tensor_desc(x, dt), tensor_desc(dy, dt), filter_desc(dw, dt),
                 conv_desc(p, strict, dt), AlgoChoice()},
        ConvPass::backward_filter, dt, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
              handle, pl.x.get(), pl.y.get(), pl.conv.get(), pl.w.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, int id, size_t* bytes) {
          return cudnnGetConvolutionBackwardFilterWorkspaceSize(
              handle, pl.x.get(), pl.y.get(), pl.conv.get(), pl.w.get(),
              static_cast<cudnnConvolutionBwdFilterAlgo_t>(id), bytes);
        },
        plan_what(ConvPass::backward_filter, dy, x, strict));
  });
  run_pass(plan, dw, dt, acc, strict, ctx, "cudnnConvolutionBackwardFilter",
           [&](const AlgoCandidate& c, const ConvOutput& o) {
             float alpha = 1.f;
             return cudnnConvolutionBackwardFilter(
                 handle, &alpha, plan.x.get(), x.raw(), plan.y.get(), dy.raw(), plan.conv.get(),
                 static_cast<cudnnConvolutionBwdFilterAlgo_t>(c.id), o.workspace, c.workspace_bytes,
                 &o.beta, plan.w.get(), o.result);
           });
}

// ---- pooling -------------------------------------------------------------------------------

// x (N, C, H, W) -> y (N, C, P, Q)
void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx) {
  NvtxRange range("kernels/max_pool2d_forward");
  require_floating("max_pool2d_forward", {&y, &x});
  int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto x_t) {
        max_pool_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), x.data<decltype(x_t)>(), pool_geometry(x, y, p));
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/max_pool2d_backward");
  require_floating("max_pool2d_backward", {&dx, &dy, &x, &y});
  int64_t n = dx.numel();
  if (n == 0) return;
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        max_pool_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            dx.data<decltype(dx_t)>(), dy.data<decltype(dy_t)>(), x.data<decltype(x_t)>(),
            y.data<decltype(y_t)>(), pool_geometry(x, y, p), acc == Accumulate::yes);
      },
      dx.dtype(), dy.dtype(), x.dtype(), y.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx) {
  NvtxRange range("kernels/avg_pool2d_forward");
  require_floating("avg_pool2d_forward", {&y, &x});
  int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto x_t) {
        avg_pool_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), x.data<decltype(x_t)>(), pool_geometry(x, y, p));
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc,
                         DeviceContext& ctx) {
  NvtxRange range("kernels/avg_pool2d_backward");
  require_floating("avg_pool2d_backward", {&dx, &dy});
  int64_t n = dx.numel();
  if (n == 0) return;
  with_storage(
      [&](auto dx_t, auto dy_t) {
        avg_pool_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            dx.data<decltype(dx_t)>(), dy.data<decltype(dy_t)>(), pool_geometry(dx, dy, p),
            acc == Accumulate::yes);
      },
      dx.dtype(), dy.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
