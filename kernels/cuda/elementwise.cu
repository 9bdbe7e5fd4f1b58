// Elementwise arithmetic (add, mul, scale, axpy), per-channel bias and its gradient. add, mul,
// scale, add_bias and bias_backward also take f16/bf16 tensors (with_storage, cuda_common.cuh),
// axpy an f16/bf16 x.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

template <class Y, class A, class B>
__global__ void add_kernel(Y* y, const A* a, const B* b, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(to_float(a[i]) + to_float(b[i]));
}

template <class Y, class A, class B>
__global__ void mul_kernel(Y* y, const A* a, const B* b, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(to_float(a[i]) * to_float(b[i]));
}

template <class Y, class X>
__global__ void scale_kernel(Y* y, const X* x, ScalarArg by, int64_t n) {
  const float alpha = by.get();
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(alpha * to_float(x[i]));
}

// y f32 += alpha * float(x), x f32, __half or __nv_bfloat16.
template <class T>
__global__ void axpy_kernel(float* y, ScalarArg by, const T* x, int64_t n) {
  const float alpha = by.get();
  DP_GRID_STRIDE_LOOP(i, n) y[i] += alpha * to_float<T>(x[i]);
}

// y (N, C, inner) += bias[c].
template <class Y, class B>
__global__ void add_bias_kernel(Y* y, const B* bias, int64_t n, int64_t channels, int64_t inner) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const float b = to_float(bias[(i / inner) % channels]);
    y[i] = from_float<Y>(to_float(y[i]) + b);
  }
}

// db[c] (+)= sum over (n, s) of dy (N, C, inner), for launch_channel_sums.
template <class DB>
struct SetBiasGrad {
  DB* db;
  bool accumulate;
  __device__ void operator()(int64_t c, float sum, float) const {
    db[c] = from_float<DB>(accumulate ? to_float(db[c]) + sum : sum);
  }
};

// Reads dy (N, C, inner) as f32 for launch_channel_sums: (dy[index], 0).
template <class T>
struct ReadChannel {
  const T* x;
  __device__ float2 operator()(int64_t idx, int64_t) const {
    return make_float2(to_float(x[idx]), 0.f);
  }
};

// Reads dy (rows, cols) as f32 for launch_column_sums.
template <class T>
struct ReadMatrix {
  const T* m;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return to_float(m[r * cols + c]); }
};

}  // namespace

void add(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  NvtxRange range("kernels/add");
  require_floating("add", {&y, &a, &b});
  int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        add_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), a.data<decltype(a_t)>(), b.data<decltype(b_t)>(), n);
      },
      y.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void mul(Tensor& y, const Tensor& a, const Tensor& b, DeviceContext& ctx) {
  NvtxRange range("kernels/mul");
  require_floating("mul", {&y, &a, &b});
  int64_t n = y.numel();
  if (n == 0) return;
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        mul_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), a.data<decltype(a_t)>(), b.data<decltype(b_t)>(), n);
      },
      y.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void scale(Tensor& y, const Tensor& x, Scalar alpha, DeviceContext& ctx) {
  NvtxRange range("kernels/scale");
  require_floating("scale", {&y, &x});
  int64_t n = y.numel();
  if (n == 0) return;
  const ScalarArg by = ScalarArg::of(alpha);
  with_storage(
      [&](auto y_t, auto x_t) {
        scale_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), x.data<decltype(x_t)>(), by, n);
      },
      y.dtype(), x.dtype());
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
  require_floating("add_bias", {&y, &bias});
  int64_t n = y.numel(), channels = bias.numel();
  if (n == 0 || channels == 0) return;
  int64_t inner = n / (y.dim(0) * channels);  // product of the dims after C
  with_storage(
      [&](auto y_t, auto bias_t) {
        add_bias_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), bias.data<decltype(bias_t)>(), n, channels, inner);
      },
      y.dtype(), bias.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

// The sums are f32 in the f32 kernel's order whatever the storage: a 16-bit dy is read as f32,
// a 16-bit db gets the f32 result rounded once.
void bias_backward(Tensor& db, const Tensor& dy, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/bias_backward");
  require_floating("bias_backward", {&db, &dy});
  int64_t channels = db.numel(), batch = dy.dim(0);
  if (channels == 0) return;
  int64_t inner = batch * channels == 0 ? 1 : dy.numel() / (batch * channels);
  bool accumulate = acc == Accumulate::yes;
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto db_t, auto dy_t) {
        using DB = decltype(db_t);
        using DY = decltype(dy_t);
        if (inner == 1) {  // (N, C): column sums, coalesced along each row
          size_t scratch_bytes = sizeof(float) * column_sum_chunks(batch) * channels;
          auto* scratch = static_cast<float*>(ctx.workspace(scratch_bytes));
          launch_column_sums(db.data<DB>(), batch, channels,
                             ReadMatrix<DY>{dy.data<DY>(), channels}, accumulate, scratch, s);
          return;
        }
        // (N, C, H, W): chunks of every channel in parallel, coalesced within each (n, c) plane.
        auto* scratch =
            static_cast<float2*>(ctx.workspace(channel_sum_scratch_bytes(batch, channels, inner)));
        launch_channel_sums(batch, channels, inner, ReadChannel<DY>{dy.data<DY>()},
                            SetBiasGrad<DB>{db.data<DB>(), accumulate}, scratch, s);
      },
      db.dtype(), dy.dtype());
}

}  // namespace kernels::cuda
