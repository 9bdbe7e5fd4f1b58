// Elementwise arithmetic (add, mul, scale, axpy; axpy also takes an f16/bf16 x), per-channel
// bias and its gradient.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

__global__ void add_kernel(float* y, const float* a, const float* b, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = a[i] + b[i];
}

__global__ void mul_kernel(float* y, const float* a, const float* b, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = a[i] * b[i];
}

__global__ void scale_kernel(float* y, const float* x, ScalarArg by, int64_t n) {
  const float alpha = by.get();
  DP_GRID_STRIDE_LOOP(i, n) y[i] = alpha * x[i];
}

// y f32 += alpha * float(x), x f32, __half or __nv_bfloat16.
template <class T>
__global__ void axpy_kernel(float* y, ScalarArg by, const T* x, int64_t n) {
  const float alpha = by.get();
  DP_GRID_STRIDE_LOOP(i, n) y[i] += alpha * to_float<T>(x[i]);
}

// y (N, C, inner) += bias[c].
__global__ void add_bias_kernel(float* y, const float* bias, int64_t n, int64_t channels,
                                int64_t inner) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] += bias[(i / inner) % channels];
}

// db[c] (+)= sum over (n, s) of dy (N, C, inner), for launch_channel_sums.
struct SetBiasGrad {
  float* db;
  bool accumulate;
  __device__ void operator()(int64_t c, float sum, float) const {
    db[c] = accumulate ? db[c] + sum : sum;
  }
};

// Reads dy (rows, cols) for launch_column_sums.
struct ReadMatrix {
  const float* m;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return m[r * cols + c]; }
};

void check_elementwise(const char* op, const Tensor& y, const Tensor& a) {
  require_f32(op, y);
  require_f32(op, a);
}

}  // namespace

void add(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  NvtxRange range("kernels/add");
  check_elementwise("add", y, a);
  require_f32("add", b);
  int64_t n = y.numel();
  if (n == 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.data<float>(), a.data<float>(),
                                                             b.data<float>(), n);
  DP_CUDA_CHECK_LAUNCH();
}

void mul(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  NvtxRange range("kernels/mul");
  check_elementwise("mul", y, a);
  require_f32("mul", b);
  int64_t n = y.numel();
  if (n == 0) return;
  mul_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.data<float>(), a.data<float>(),
                                                             b.data<float>(), n);
  DP_CUDA_CHECK_LAUNCH();
}

void scale(Tensor& y, const Tensor& x, Scalar alpha, DeviceContext& ctx) {
  NvtxRange range("kernels/scale");
  check_elementwise("scale", y, x);
  int64_t n = y.numel();
  if (n == 0) return;
  scale_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.data<float>(), x.data<float>(),
                                                               ScalarArg::of(alpha), n);
  DP_CUDA_CHECK_LAUNCH();
}

void axpy(Tensor& y, Scalar by, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/axpy");
  const ScalarArg alpha = ScalarArg::of(by);
  require_f32("axpy", y);
  int64_t n = y.numel();
  if (n == 0) return;
  unsigned blocks = blocks_for(n);
  cudaStream_t s = stream_of(ctx);
  switch (x.dtype()) {
    case DType::f32:
      axpy_kernel<<<blocks, kThreads, 0, s>>>(y.data<float>(), alpha, x.data<float>(), n);
      break;
    case DType::f16:
      axpy_kernel<<<blocks, kThreads, 0, s>>>(y.data<float>(), alpha, x.data<__half>(), n);
      break;
    case DType::bf16:
      axpy_kernel<<<blocks, kThreads, 0, s>>>(y.data<float>(), alpha, x.data<__nv_bfloat16>(), n);
      break;
    default:
      DP_THROW("axpy: x must be f32, f16 or bf16, got " << x);
  }
  DP_CUDA_CHECK_LAUNCH();
}

namespace {

// Up to kMaxSources sources per launch (more: further launches, which keep the sum's order).
constexpr int kMaxSources = 16;
template <class T>
struct Sources {
  const T* x[kMaxSources];
  ScalarArg w[kMaxSources];
  int n;
};

// y = y_weight * y + sum_k w_k x_k, in k order, f32 accumulation.
template <class T>
__global__ void weighted_sum_kernel(float* y, ScalarArg y_scalar, Sources<T> src, int64_t n) {
  const float y_weight = y_scalar.get();
  float w[kMaxSources];
  for (int k = 0; k < src.n; ++k) w[k] = src.w[k].get();
  DP_GRID_STRIDE_LOOP(i, n) {
    float acc = y[i] * y_weight;
    for (int k = 0; k < src.n; ++k) acc += w[k] * to_float(src.x[k][i]);
    y[i] = acc;
  }
}

template <class T>
void launch_weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                         const std::vector<Scalar>& weights, cudaStream_t s) {
  const int64_t n = y.numel();
  size_t k = 0;
  do {
    Sources<T> src{};
    for (; k < xs.size() && src.n < kMaxSources; ++src.n, ++k) {
      src.x[src.n] = xs[k].data<T>();
      src.w[src.n] = ScalarArg::of(weights[k]);
    }
    weighted_sum_kernel<<<blocks_for(n), kThreads, 0, s>>>(y.data<float>(), ScalarArg::of(y_weight),
                                                           src, n);
    DP_CUDA_CHECK_LAUNCH();
    y_weight = 1.f;  // a further launch adds to the partial sum
  } while (k < xs.size());
}

}  // namespace

void weighted_sum(Tensor& y, Scalar y_weight, const std::vector<Tensor>& xs,
                  const std::vector<Scalar>& weights, DeviceContext& ctx) {
  NvtxRange range("kernels/weighted_sum");
  require_f32("weighted_sum", y);
  if (y.numel() == 0) return;
  cudaStream_t s = stream_of(ctx);
  if (xs.empty() || xs[0].dtype() == DType::f32)
    launch_weighted_sum<float>(y, y_weight, xs, weights, s);
  else
    launch_weighted_sum<__nv_bfloat16>(y, y_weight, xs, weights, s);
}

void add_bias(Tensor& y, const Tensor& bias, DeviceContext& ctx) {
  NvtxRange range("kernels/add_bias");
  check_elementwise("add_bias", y, bias);
  int64_t n = y.numel(), channels = bias.numel();
  if (n == 0 || channels == 0) return;
  int64_t inner = n / (y.dim(0) * channels);  // product of the dims after C
  add_bias_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      y.data<float>(), bias.data<float>(), n, channels, inner);
  DP_CUDA_CHECK_LAUNCH();
}

void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/bias_backward");
  check_elementwise("bias_backward", db, dy);
  int64_t channels = db.numel(), batch = dy.dim(0);
  if (channels == 0) return;
  int64_t inner = batch * channels == 0 ? 1 : dy.numel() / (batch * channels);
  bool accumulate = acc == Accumulate::yes;
  cudaStream_t s = stream_of(ctx);
  if (inner == 1) {  // (N, C): column sums, coalesced along each row
    size_t scratch_bytes = sizeof(float) * column_sum_chunks(batch) * channels;
    auto* scratch = static_cast<float*>(ctx.workspace(scratch_bytes));
    launch_column_sums(db.data<float>(), batch, channels, ReadMatrix{dy.data<float>(), channels},
                       accumulate, scratch, s);
    return;
  }
  // (N, C, H, W): chunks of every channel in parallel, coalesced within each (n, c) plane.
  auto* scratch =
      static_cast<float2*>(ctx.workspace(channel_sum_scratch_bytes(batch, channels, inner)));
  launch_channel_sums(batch, channels, inner, ReadChannelValue{dy.data<float>()},
                      SetBiasGrad{db.data<float>(), accumulate}, scratch, s);
}

}  // namespace kernels::cuda
