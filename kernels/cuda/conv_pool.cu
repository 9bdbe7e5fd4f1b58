// 2-D convolution (cuDNN, NCHW f32 cross-correlation) and max/average pooling (hand-written
// kernels mirroring kernels/cpu/pool.cpp; the backward passes gather per input element, so they
// need no atomics and are deterministic).
#include <array>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_common.cuh"
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

TensorDescHandle tensor_desc(const Tensor& t) {  // (N, C, H, W) f32, contiguous
  cudnnTensorDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&raw));
  TensorDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                            to_int(t.dim(0), "N"), to_int(t.dim(1), "C"),
                                            to_int(t.dim(2), "H"), to_int(t.dim(3), "W")));
  return d;
}

FilterDescHandle filter_desc(const Tensor& w) {  // (K, C, R, S)
  cudnnFilterDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateFilterDescriptor(&raw));
  FilterDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d.get(), CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW,
                                            to_int(w.dim(0), "K"), to_int(w.dim(1), "C"),
                                            to_int(w.dim(2), "R"), to_int(w.dim(3), "S")));
  return d;
}

// Strict f32 math uses FMA kernels only (cuDNN's default math would allow TF32 on Ampere+).
bool strict_math(DeviceContext& ctx) {
  return ctx.math() == MathMode::strict;
}

ConvDescHandle conv_desc(const Conv2dParams& p, bool strict) {
  cudnnConvolutionDescriptor_t raw = nullptr;
  DP_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&raw));
  ConvDescHandle d(raw);
  DP_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d.get(), p.pad_h, p.pad_w, p.stride_h, p.stride_w,
                                                 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  DP_CUDNN_CHECK(
      cudnnSetConvolutionMathType(d.get(), strict ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH));
  return d;
}

enum class ConvPass { forward, backward_data, backward_filter };

// What a convolution call needs besides its pointers: the descriptors, the chosen algorithm
// (the math type is set on `conv`) and its workspace size. Searched once per key and context.
struct ConvPlan {
  TensorDescHandle x, y;  // input and output activations (dx, dy for the backward passes)
  FilterDescHandle w;
  ConvDescHandle conv;
  int algo = 0;
  size_t ws_bytes = 0;
};

// pass, x (N, C, H, W), w (K, C, R, S), y (N, K, P, Q), stride, padding, strict math. Tensors are
// contiguous NCHW f32, so shapes fix strides and dtype.
using ConvKey = std::array<int64_t, 18>;

ConvKey conv_key(ConvPass pass, const Tensor& x, const Tensor& w, const Tensor& y,
                 const Conv2dParams& p, bool strict) {
  return {static_cast<int64_t>(pass),
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

// Index of the first (fastest by cuDNN's heuristic) usable entry: status success, no tensor-op
// math under strict f32, workspace within the cap; deterministic algorithms preferred (replicas
// must compute bitwise-equal gradients from equal inputs). -1 when none.
template <class Perf>
int pick_algo(const std::vector<Perf>& perf, int count, bool strict) {
  for (int pass = 0; pass < 2; ++pass)
    for (int i = 0; i < count; ++i) {
      const Perf& p = perf[i];
      if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxConvWorkspace) continue;
      if (strict && (p.mathType == CUDNN_TENSOR_OP_MATH ||
                     p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION))
        continue;
      if (pass == 0 && p.determinism != CUDNN_DETERMINISTIC) continue;
      return i;
    }
  return -1;
}

// The math type to run the chosen algorithm with.
template <class Perf>
void set_math(const ConvDescHandle& conv, const Perf& p, bool strict) {
  DP_CUDNN_CHECK(cudnnSetConvolutionMathType(conv.get(), strict ? CUDNN_FMA_MATH : p.mathType));
}

// Completes the plan of one pass from its descriptors: cuDNN's ranked algorithms
// (find(plan, max, &count, perf), at most max_count() of them), the pick, its math type and its
// workspace (workspace(plan, algo, &bytes)). `none` is the error text when no algorithm fits.
template <class Perf, class MaxCount, class Find, class Workspace>
ConvPlan complete_plan(ConvPlan pl, bool strict, MaxCount max_count, Find find, Workspace workspace,
                       const std::string& none) {
  int max = max_count(), count = 0;
  std::vector<Perf> perf(static_cast<size_t>(max));
  find(pl, max, &count, perf.data());
  int pick = pick_algo(perf, count, strict);
  DP_CHECK(pick >= 0, none);
  set_math(pl.conv, perf[pick], strict);
  pl.algo = static_cast<int>(perf[pick].algo);
  workspace(pl, perf[pick].algo, &pl.ws_bytes);
  return pl;
}

// Text of the error when cuDNN offers no algorithm.
std::string no_algorithm(const char* op, const Tensor& a, const Tensor& b) {
  std::ostringstream os;
  os << op << ": cuDNN offers no algorithm for " << a << ", " << b;
  return os.str();
}

// Output gradient or result with nothing to add up: zero it, or leave it when accumulating.
void zero_unless_accumulating(Tensor& t, Accumulate acc, cudaStream_t s) {
  if (acc == Accumulate::no) DP_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, t.nbytes(), s));
}

void require_conv_f32(const char* op, const Tensor& a, const Tensor& b, const Tensor& c) {
  require_f32(op, a);
  require_f32(op, b);
  require_f32(op, c);
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
__device__ float window_max(const float* plane, const PoolGeometry& g, int64_t oh, int64_t ow) {
  float best = -INFINITY;
  bool any = false;
  for (int r = 0; r < g.kh; ++r) {
    int64_t h = oh * g.sh - g.ph + r;
    if (h < 0 || h >= g.height) continue;
    for (int c = 0; c < g.kw; ++c) {
      int64_t w = ow * g.sw - g.pw + c;
      if (w < 0 || w >= g.width) continue;
      float v = plane[h * g.width + w];
      if (!any || v > best) best = v;
      any = true;
    }
  }
  return best;
}

// Offset in the plane of the first element of window (oh, ow), in row-major window order,
// equal to the forward maximum `target`; -1 if none is (a NaN maximum).
__device__ int64_t window_first_equal(const float* plane, const PoolGeometry& g, int64_t oh,
                                      int64_t ow, float target) {
  for (int r = 0; r < g.kh; ++r) {
    int64_t h = oh * g.sh - g.ph + r;
    if (h < 0 || h >= g.height) continue;
    for (int c = 0; c < g.kw; ++c) {
      int64_t w = ow * g.sw - g.pw + c;
      if (w >= 0 && w < g.width && plane[h * g.width + w] == target) return h * g.width + w;
    }
  }
  return -1;
}

__global__ void max_pool_forward_kernel(float* y, const float* x, PoolGeometry g) {
  int64_t n = g.planes * g.out_h * g.out_w;
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t ow = i % g.out_w, oh = (i / g.out_w) % g.out_h, plane = i / (g.out_w * g.out_h);
    y[i] = window_max(x + plane * g.height * g.width, g, oh, ow);
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
__global__ void max_pool_backward_kernel(float* dx, const float* dy, const float* x, const float* y,
                                         PoolGeometry g, bool accumulate) {
  int64_t n = g.planes * g.height * g.width;
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t w = i % g.width, h = (i / g.width) % g.height, plane = i / (g.width * g.height);
    const float* xp = x + plane * g.height * g.width;
    const float* dyp = dy + plane * g.out_h * g.out_w;
    const float* yp = y + plane * g.out_h * g.out_w;
    int64_t p0, p1, q0, q1;
    covering_range(h, g.kh, g.sh, g.ph, g.out_h, &p0, &p1);
    covering_range(w, g.kw, g.sw, g.pw, g.out_w, &q0, &q1);
    float grad = 0.f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) {
        int64_t o = p * g.out_w + q;
        if (window_first_equal(xp, g, p, q, yp[o]) == h * g.width + w) grad += dyp[o];
      }
    dx[i] = accumulate ? dx[i] + grad : grad;
  }
}

// Average over the window, padding counted in the divisor (count_include_pad).
__global__ void avg_pool_forward_kernel(float* y, const float* x, PoolGeometry g) {
  int64_t n = g.planes * g.out_h * g.out_w;
  float inv_area = 1.f / static_cast<float>(g.kh * g.kw);
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t ow = i % g.out_w, oh = (i / g.out_w) % g.out_h, plane = i / (g.out_w * g.out_h);
    const float* xp = x + plane * g.height * g.width;
    float s = 0.f;
    for (int r = 0; r < g.kh; ++r) {
      int64_t h = oh * g.sh - g.ph + r;
      if (h < 0 || h >= g.height) continue;
      for (int c = 0; c < g.kw; ++c) {
        int64_t w = ow * g.sw - g.pw + c;
        if (w >= 0 && w < g.width) s += xp[h * g.width + w];
      }
    }
    y[i] = s * inv_area;
  }
}

// Gather: dx[h, w] (+)= sum over the windows covering (h, w) of dy / (kh kw).
__global__ void avg_pool_backward_kernel(float* dx, const float* dy, PoolGeometry g,
                                         bool accumulate) {
  int64_t n = g.planes * g.height * g.width;
  float inv_area = 1.f / static_cast<float>(g.kh * g.kw);
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t w = i % g.width, h = (i / g.width) % g.height, plane = i / (g.width * g.height);
    const float* dyp = dy + plane * g.out_h * g.out_w;
    int64_t p0, p1, q0, q1;
    covering_range(h, g.kh, g.sh, g.ph, g.out_h, &p0, &p1);
    covering_range(w, g.kw, g.sw, g.pw, g.out_w, &q0, &q1);
    float grad = 0.f;
    for (int64_t p = p0; p <= p1; ++p)
      for (int64_t q = q0; q <= q1; ++q) grad += dyp[p * g.out_w + q] * inv_area;
    dx[i] = accumulate ? dx[i] + grad : grad;
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
  require_conv_f32("conv2d_forward", y, x, w);
  cudaStream_t s = stream_of(ctx);
  if (y.numel() == 0) return;
  if (x.numel() == 0 || w.numel() == 0) return zero_unless_accumulating(y, Accumulate::no, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  bool strict = strict_math(ctx);
  ConvKey key = conv_key(ConvPass::forward, x, w, y, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionFwdAlgoPerf_t>(
        ConvPlan{tensor_desc(x), tensor_desc(y), filter_desc(w), conv_desc(p, strict)}, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(
              handle, pl.x.get(), pl.w.get(), pl.conv.get(), pl.y.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
          DP_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(
              handle, pl.x.get(), pl.w.get(), pl.conv.get(), pl.y.get(), algo, bytes));
        },
        no_algorithm("conv2d_forward", x, w));
  });
  void* ws = plan.ws_bytes ? ctx.workspace(plan.ws_bytes) : nullptr;
  float alpha = 1.f, beta = 0.f;
  DP_CUDNN_CHECK(cudnnConvolutionForward(handle, &alpha, plan.x.get(), x.raw(), plan.w.get(),
                                         w.raw(), plan.conv.get(),
                                         static_cast<cudnnConvolutionFwdAlgo_t>(plan.algo), ws,
                                         plan.ws_bytes, &beta, plan.y.get(), y.raw()));
}

// dy (N, K, P, Q), w (K, C, R, S) -> dx (N, C, H, W)
void conv2d_backward_data(Tensor& dx, const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                          Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/conv2d_backward_data");
  require_conv_f32("conv2d_backward_data", dx, dy, w);
  cudaStream_t s = stream_of(ctx);
  if (dx.numel() == 0) return;
  if (dy.numel() == 0 || w.numel() == 0) return zero_unless_accumulating(dx, acc, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  bool strict = strict_math(ctx);
  ConvKey key = conv_key(ConvPass::backward_data, dx, w, dy, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionBwdDataAlgoPerf_t>(
        ConvPlan{tensor_desc(dx), tensor_desc(dy), filter_desc(w), conv_desc(p, strict)}, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
              handle, pl.w.get(), pl.y.get(), pl.conv.get(), pl.x.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(
              handle, pl.w.get(), pl.y.get(), pl.conv.get(), pl.x.get(), algo, bytes));
        },
        no_algorithm("conv2d_backward_data", dy, w));
  });
  void* ws = plan.ws_bytes ? ctx.workspace(plan.ws_bytes) : nullptr;
  float alpha = 1.f, beta = acc == Accumulate::yes ? 1.f : 0.f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardData(handle, &alpha, plan.w.get(), w.raw(), plan.y.get(),
                                              dy.raw(), plan.conv.get(),
                                              static_cast<cudnnConvolutionBwdDataAlgo_t>(plan.algo),
                                              ws, plan.ws_bytes, &beta, plan.x.get(), dx.raw()));
}

// dy (N, K, P, Q), x (N, C, H, W) -> dw (K, C, R, S)
void conv2d_backward_filter(Tensor& dw, const Tensor& dy, const Tensor& x, const Conv2dParams& p,
                            Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/conv2d_backward_filter");
  require_conv_f32("conv2d_backward_filter", dw, dy, x);
  cudaStream_t s = stream_of(ctx);
  if (dw.numel() == 0) return;
  if (dy.numel() == 0 || x.numel() == 0) return zero_unless_accumulating(dw, acc, s);
  auto handle = static_cast<cudnnHandle_t>(ctx.cudnn());
  bool strict = strict_math(ctx);
  ConvKey key = conv_key(ConvPass::backward_filter, x, dw, dy, p, strict);
  ConvPlan& plan = ctx.state<ConvPlans>().cache.get(key, [&] {
    return complete_plan<cudnnConvolutionBwdFilterAlgoPerf_t>(
        ConvPlan{tensor_desc(x), tensor_desc(dy), filter_desc(dw), conv_desc(p, strict)}, strict,
        [&] {
          int n = 0;
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &n));
          return n;
        },
        [&](const ConvPlan& pl, int max, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
              handle, pl.x.get(), pl.y.get(), pl.conv.get(), pl.w.get(), max, count, perf));
        },
        [&](const ConvPlan& pl, cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
          DP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
              handle, pl.x.get(), pl.y.get(), pl.conv.get(), pl.w.get(), algo, bytes));
        },
        no_algorithm("conv2d_backward_filter", dy, x));
  });
  void* ws = plan.ws_bytes ? ctx.workspace(plan.ws_bytes) : nullptr;
  float alpha = 1.f, beta = acc == Accumulate::yes ? 1.f : 0.f;
  DP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
      handle, &alpha, plan.x.get(), x.raw(), plan.y.get(), dy.raw(), plan.conv.get(),
      static_cast<cudnnConvolutionBwdFilterAlgo_t>(plan.algo), ws, plan.ws_bytes, &beta,
      plan.w.get(), dw.raw()));
}

// ---- pooling -------------------------------------------------------------------------------

// x (N, C, H, W) -> y (N, C, P, Q)
void max_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx) {
  NvtxRange range("kernels/max_pool2d_forward");
  require_f32("max_pool2d_forward", y);
  require_f32("max_pool2d_forward", x);
  int64_t n = y.numel();
  if (n == 0) return;
  max_pool_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      y.data<float>(), x.data<float>(), pool_geometry(x, y, p));
  DP_CUDA_CHECK_LAUNCH();
}

void max_pool2d_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y,
                         const Pool2dParams& p, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/max_pool2d_backward");
  require_conv_f32("max_pool2d_backward", dx, dy, x);
  int64_t n = dx.numel();
  if (n == 0) return;
  require_f32("max_pool2d_backward", y);
  max_pool_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      dx.data<float>(), dy.data<float>(), x.data<float>(), y.data<float>(), pool_geometry(x, y, p),
      acc == Accumulate::yes);
  DP_CUDA_CHECK_LAUNCH();
}

void avg_pool2d_forward(Tensor& y, const Tensor& x, const Pool2dParams& p, DeviceContext& ctx) {
  NvtxRange range("kernels/avg_pool2d_forward");
  require_f32("avg_pool2d_forward", y);
  require_f32("avg_pool2d_forward", x);
  int64_t n = y.numel();
  if (n == 0) return;
  avg_pool_forward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      y.data<float>(), x.data<float>(), pool_geometry(x, y, p));
  DP_CUDA_CHECK_LAUNCH();
}

void avg_pool2d_backward(Tensor& dx, const Tensor& dy, const Pool2dParams& p, Accumulate acc,
                         DeviceContext& ctx) {
  NvtxRange range("kernels/avg_pool2d_backward");
  require_f32("avg_pool2d_backward", dx);
  require_f32("avg_pool2d_backward", dy);
  int64_t n = dx.numel();
  if (n == 0) return;
  avg_pool_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      dx.data<float>(), dy.data<float>(), pool_geometry(dx, dy, p), acc == Accumulate::yes);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
