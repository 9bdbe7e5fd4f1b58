// Fused optimizer steps over one flat f32 buffer (PyTorch's SGD and AdamW, with the operation
// order of kernels/cpu/optim.cpp; the per-step scalars are read from device memory when the
// kernel runs), the finiteness check, and small by-value writes (set_values).
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

// dst[i] = values.v[i]: the values travel in the launch's arguments.
__global__ void set_values_kernel(float* dst, Values values) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < values.n) dst[i] = values.v[i];
}

// g = grad unscale + wd p; buf = first ? g : m buf + (1 - damp) g; g = nesterov ? g + m buf : buf;
// p -= lr g. buf is nullptr without momentum; lr, unscale and first come from `scalars`
// (SgdScalar), read when the kernel runs.
__global__ void sgd_kernel(float* p, const float* grad, float* buf, const float* scalars,
                           float momentum, float keep, float weight_decay, bool nesterov,
                           const float* skip, int64_t n) {
  if (skip && *skip != 0.f) return;  // a non-finite gradient: no update
  const float lr = scalars[SgdScalar::lr], unscale = scalars[SgdScalar::grad_unscale];
  const bool first_step = scalars[SgdScalar::first_step] != 0.f;
  DP_GRID_STRIDE_LOOP(i, n) {
    float g = grad[i] * unscale;
    float d = weight_decay != 0.f ? g + weight_decay * p[i] : g;
    if (buf) {
      float b = first_step ? d : momentum * buf[i] + keep * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

// Per element of group k (group_of nullptr: group 0): p *= decay[k]; m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= step_size[k] m / (sqrt(v) / sqrt(1 - b2^t) + eps), with the
// per-step scalars (AdamWScalar) read from `scalars` when the kernel runs.
__global__ void adamw_kernel(float* p, const float* grad, const uint8_t* group_of, float* m,
                             float* v, const float* scalars, float beta1, float beta2,
                             float one_minus_b1, float one_minus_b2, float eps, const float* skip,
                             int64_t n) {
  if (skip && *skip != 0.f) return;  // a non-finite gradient: no update
  const float unscale = scalars[AdamWScalar::grad_unscale];
  const float correction2_sqrt = scalars[AdamWScalar::correction2_sqrt];
  const float* decay = scalars + AdamWScalar::decay;
  const float* step_size = scalars + AdamWScalar::step_size;
  DP_GRID_STRIDE_LOOP(i, n) {
    const int k = group_of ? group_of[i] : 0;
    float g = grad[i] * unscale;
    float pi = p[i] * decay[k];
    float mi = beta1 * m[i] + one_minus_b1 * g;
    float vi = beta2 * v[i] + one_minus_b2 * g * g;
    m[i] = mi;
    v[i] = vi;
    float denom = sqrtf(vi) / correction2_sqrt + eps;
    p[i] = pi - step_size[k] * mi / denom;
  }
}

// Sets *flag when some element is not finite (every writer writes the same value).
template <class Flag, class T>
__global__ void non_finite_kernel(Flag* flag, const T* x, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) {
    if (!isfinite(to_float(x[i]))) *flag = Flag(1);
  }
}

// Launches non_finite_kernel over a floating x (flag zeroed first).
template <class Flag>
void launch_non_finite(Flag* flag, const Tensor& x, cudaStream_t s) {
  int64_t n = x.numel();
  DP_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(Flag), s));
  switch (x.dtype()) {  // floating dtypes, as the CPU backend
    case DType::f32:
      non_finite_kernel<<<blocks_for(n), kThreads, 0, s>>>(flag, x.data<float>(), n);
      break;
    case DType::f16:
      non_finite_kernel<<<blocks_for(n), kThreads, 0, s>>>(flag, x.data<__half>(), n);
      break;
    case DType::bf16:
      non_finite_kernel<<<blocks_for(n), kThreads, 0, s>>>(flag, x.data<__nv_bfloat16>(), n);
      break;
    default:
      DP_THROW("all_finite: dtype " << x.dtype() << " is not supported");
  }
  DP_CUDA_CHECK_LAUNCH();
}

const float* skip_pointer(const Tensor& skip_if) {
  return skip_if.defined() ? skip_if.data<float>() : nullptr;
}

}  // namespace

void set_values(Tensor& dst, const Values& values, DeviceContext& ctx) {
  NvtxRange range("kernels/set_values");
  require_f32("set_values", dst);
  set_values_kernel<<<1, kMaxValues, 0, stream_of(ctx)>>>(dst.data<float>(), values);
  DP_CUDA_CHECK_LAUNCH();
}

void sgd_update(Tensor& params, const Tensor& grads, Tensor& momentum_buf, const SgdConfig& c,
                const Tensor& scalars, DeviceContext& ctx) {
  NvtxRange range("kernels/sgd_update");
  require_f32("sgd_update", {&params, &grads, &scalars});
  float* buf = nullptr;
  if (c.momentum != 0.f) {
    require_f32("sgd_update", momentum_buf);
    buf = momentum_buf.data<float>();
  }
  int64_t n = params.numel();
  if (n == 0) return;
  sgd_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      params.data<float>(), grads.data<float>(), buf, scalars.data<float>(), c.momentum,
      1.f - c.dampening, c.weight_decay, c.nesterov == Nesterov::yes, skip_pointer(c.skip_if), n);
  DP_CUDA_CHECK_LAUNCH();
}

void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars, DeviceContext& ctx) {
  NvtxRange range(group_of.defined() ? "kernels/adamw_update_grouped" : "kernels/adamw_update");
  require_f32("adamw_update", {&params, &grads, &m, &v, &scalars});
  int64_t n = params.numel();
  if (n == 0) return;
  adamw_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      params.data<float>(), grads.data<float>(),
      group_of.defined() ? group_of.data<uint8_t>() : nullptr, m.data<float>(), v.data<float>(),
      scalars.data<float>(), c.beta1, c.beta2, 1.f - c.beta1, 1.f - c.beta2, c.eps,
      skip_pointer(c.skip_if), n);
  DP_CUDA_CHECK_LAUNCH();
}

bool all_finite(const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/all_finite");
  int64_t n = x.numel();
  if (n == 0 || !is_floating(x.dtype())) return true;  // integers are always finite
  cudaStream_t s = stream_of(ctx);
  auto* flag = static_cast<int*>(ctx.workspace(sizeof(int)));
  launch_non_finite(flag, x, s);
  int host_flag = 0;
  DP_CUDA_CHECK(cudaMemcpyAsync(&host_flag, flag, sizeof(int), cudaMemcpyDeviceToHost, s));
  // The op returns a host value: wait for the flag to arrive.
  DP_CUDA_CHECK(cudaStreamSynchronize(s));
  return host_flag == 0;
}

void non_finite_into(Tensor& flag, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/non_finite_into");
  require_f32("non_finite_into", flag);
  cudaStream_t s = stream_of(ctx);
  if (x.numel() == 0 || !is_floating(x.dtype())) {
    DP_CUDA_CHECK(cudaMemsetAsync(flag.data<float>(), 0, sizeof(float), s));
    return;
  }
  launch_non_finite(flag.data<float>(), x, s);
}

}  // namespace kernels::cuda
