// Fused optimizer steps over one flat f32 buffer (PyTorch's SGD and AdamW, with the operation
// order of kernels/cpu/optim.cpp; the per-step scalars are read from device memory when the
// kernel runs), the finiteness check, and small by-value writes (set_values).
#include <cmath>
#include <type_traits>

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
// copy (nullptr: none) takes each updated p rounded to T (SgdConfig::compute_copy).
template <class T>
__global__ void sgd_kernel(float* p, const float* grad, float* buf, const float* scalars,
                           float momentum, float keep, float weight_decay, bool nesterov,
                           const float* skip, T* copy, int64_t n) {
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
    if (copy) copy[i] = from_float<T>(p[i]);
  }
}

// Per element of group k (group_of nullptr: group 0): p *= decay[k]; m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= step_size[k] m / (sqrt(v) / sqrt(1 - b2^t) + eps), with the
// per-step scalars (AdamWScalar) read from `scalars` when the kernel runs. One function for the
// one-wide and the four-wide kernel, each operation rounded on its own (the _rn intrinsics, which
// nvcc never contracts): written as plain expressions, nvcc fused b1 m + (1 - b1) g into an FMA
// around one product in one kernel and around the other in the other (the PTX of both, reviewed
// 2026-12-01), so the two kernels' m, v and p differed in the last bit from the second step on.
struct AdamWElement {
  float unscale, correction2_sqrt, beta1, beta2, one_minus_b1, one_minus_b2, eps;
  const float* decay;
  const float* step_size;
  __device__ __forceinline__ void operator()(float& p, float grad, float& m, float& v,
                                             int k) const {
    const float g = __fmul_rn(grad, unscale);
    const float pi = __fmul_rn(p, decay[k]);
    const float mi = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
    m = mi;
    v = vi;
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), correction2_sqrt), eps);
    p = __fsub_rn(pi, __fdiv_rn(__fmul_rn(step_size[k], mi), denom));
  }
};

__device__ __forceinline__ AdamWElement adamw_element(const float* scalars, float beta1,
                                                      float beta2, float one_minus_b1,
                                                      float one_minus_b2, float eps) {
  return {scalars[AdamWScalar::grad_unscale],
          scalars[AdamWScalar::correction2_sqrt],
          beta1,
          beta2,
          one_minus_b1,
          one_minus_b2,
          eps,
          scalars + AdamWScalar::decay,
          scalars + AdamWScalar::step_size};
}

// copy (nullptr: none) takes each updated p rounded to T (AdamWConfig::compute_copy).
template <class T>
__global__ void adamw_kernel(float* p, const float* grad, const uint8_t* group_of, float* m,
                             float* v, const float* scalars, float beta1, float beta2,
                             float one_minus_b1, float one_minus_b2, float eps, const float* skip,
                             T* copy, int64_t n) {
  if (skip && *skip != 0.f) return;  // a non-finite gradient: no update
  const AdamWElement step = adamw_element(scalars, beta1, beta2, one_minus_b1, one_minus_b2, eps);
  DP_GRID_STRIDE_LOOP(i, n) {
    float pi = p[i];
    step(pi, grad[i], m[i], v[i], group_of ? group_of[i] : 0);
    p[i] = pi;
    if (copy) copy[i] = from_float<T>(pi);
  }
}

// Four 16-bit values stored at once (8 bytes): the four-wide kernel's copy.
template <class T>
struct alignas(8) Four16 {
  T v[4];
};

// Four elements a thread from 16-byte loads of p, grad, m and v (and 4-byte ones of group_of):
// GPT-2's 124M-parameter step moves 28 bytes a parameter, 1.02 ms one-wide on an H200
// (2026-11-29) where its bytes take about 0.73.
template <class T>
__global__ void adamw4_kernel(float4* p, const float4* grad, const uchar4* group_of, float4* m,
                              float4* v, const float* scalars, float beta1, float beta2,
                              float one_minus_b1, float one_minus_b2, float eps, const float* skip,
                              Four16<T>* copy, int64_t quads) {
  if (skip && *skip != 0.f) return;
  const AdamWElement step = adamw_element(scalars, beta1, beta2, one_minus_b1, one_minus_b2, eps);
  DP_GRID_STRIDE_LOOP(q, quads) {
    float4 pq = p[q], mq = m[q], vq = v[q];
    const float4 gq = grad[q];
    const uchar4 kq = group_of ? group_of[q] : make_uchar4(0, 0, 0, 0);
    step(pq.x, gq.x, mq.x, vq.x, kq.x);
    step(pq.y, gq.y, mq.y, vq.y, kq.y);
    step(pq.z, gq.z, mq.z, vq.z, kq.z);
    step(pq.w, gq.w, mq.w, vq.w, kq.w);
    p[q] = pq;
    m[q] = mq;
    v[q] = vq;
    if (copy)
      copy[q] = Four16<T>{
          {from_float<T>(pq.x), from_float<T>(pq.y), from_float<T>(pq.z), from_float<T>(pq.w)}};
  }
}

// Sets *flag when some element is not finite (every writer writes the same value).
template <class Flag, class T>
__global__ void non_finite_kernel(Flag* flag, const T* x, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) {
    if (!isfinite(to_float(x[i]))) *flag = Flag(1);
  }
}

// The same eight values a thread (load8_f32): the check of a whole gradient buffer, which one
// value a thread ran at a quarter of an H200's bandwidth (GPT-2: 0.41 ms, 2026-11-29).
template <class Flag, class T>
__global__ void non_finite8_kernel(Flag* flag, const T* x, int64_t groups) {
  DP_GRID_STRIDE_LOOP(q, groups) {
    float v[8];
    load8_f32(x, q, v);
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 8; ++k) bad |= !isfinite(v[k]);
    if (bad) *flag = Flag(1);
  }
}

template <class Flag, class T>
void launch_non_finite_as(Flag* flag, const T* x, int64_t n, cudaStream_t s) {
  launch_eight_wide_then_tail(
      n, aligned16(x),
      [&](int64_t groups) {
        non_finite8_kernel<<<blocks_for(groups), kThreads, 0, s>>>(flag, x, groups);
      },
      [&](int64_t first, int64_t count) {
        non_finite_kernel<<<blocks_for(count), kThreads, 0, s>>>(flag, x + first, count);
      });
}

// Launches the check over a floating x (flag zeroed first).
template <class Flag>
void launch_non_finite(Flag* flag, const Tensor& x, cudaStream_t s) {
  int64_t n = x.numel();
  DP_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(Flag), s));
  switch (x.dtype()) {  // floating dtypes, as the CPU backend
    case DType::f32:
      launch_non_finite_as(flag, x.data<float>(), n, s);
      break;
    case DType::f16:
      launch_non_finite_as(flag, x.data<__half>(), n, s);
      break;
    case DType::bf16:
      launch_non_finite_as(flag, x.data<__nv_bfloat16>(), n, s);
      break;
    default:
      DP_THROW("all_finite: dtype " << x.dtype() << " is not supported");
  }
  DP_CUDA_CHECK_LAUNCH();
}

const float* skip_pointer(const Tensor& skip_if) {
  return skip_if.defined() ? skip_if.data<float>() : nullptr;
}

// f(copy) with the compute copy's data as __nv_bfloat16* or __half*: a null __nv_bfloat16*
// when there is none (the kernels then write no copy).
template <class F>
void with_copy_type(const Tensor& copy, F&& f) {
  if (copy.defined() && copy.dtype() == DType::f16)
    f(copy.data<__half>());
  else
    f(copy.defined() ? copy.data<__nv_bfloat16>() : static_cast<__nv_bfloat16*>(nullptr));
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
  with_copy_type(c.compute_copy, [&](auto* copy) {
    sgd_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
        params.data<float>(), grads.data<float>(), buf, scalars.data<float>(), c.momentum,
        1.f - c.dampening, c.weight_decay, c.nesterov == Nesterov::yes, skip_pointer(c.skip_if),
        copy, n);
    DP_CUDA_CHECK_LAUNCH();
  });
}

void adamw_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, const Tensor& group_of,
                  const AdamWConfig& c, const Tensor& scalars, DeviceContext& ctx) {
  NvtxRange range(group_of.defined() ? "kernels/adamw_update_grouped" : "kernels/adamw_update");
  require_f32("adamw_update", {&params, &grads, &m, &v, &scalars});
  int64_t n = params.numel();
  if (n == 0) return;
  float *pp = params.data<float>(), *pm = m.data<float>(), *pv = v.data<float>();
  const float* pg = grads.data<float>();
  const uint8_t* pk = group_of.defined() ? group_of.data<uint8_t>() : nullptr;
  cudaStream_t s = stream_of(ctx);
  with_copy_type(c.compute_copy, [&](auto* copy) {
    using T = std::remove_pointer_t<decltype(copy)>;
    const bool wide = aligned16(pp, pm, pv, pg) && reinterpret_cast<uintptr_t>(pk) % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(copy) % 8 == 0;
    const int64_t quads = wide ? n / 4 : 0;
    if (quads > 0) {
      adamw4_kernel<<<blocks_for(quads), kThreads, 0, s>>>(
          reinterpret_cast<float4*>(pp), reinterpret_cast<const float4*>(pg),
          reinterpret_cast<const uchar4*>(pk), reinterpret_cast<float4*>(pm),
          reinterpret_cast<float4*>(pv), scalars.data<float>(), c.beta1, c.beta2, 1.f - c.beta1,
          1.f - c.beta2, c.eps, skip_pointer(c.skip_if), reinterpret_cast<Four16<T>*>(copy), quads);
      DP_CUDA_CHECK_LAUNCH();
    }
    const int64_t done = quads * 4;
    if (done < n) {
      adamw_kernel<<<blocks_for(n - done), kThreads, 0, s>>>(
          pp + done, pg + done, pk ? pk + done : nullptr, pm + done, pv + done,
          scalars.data<float>(), c.beta1, c.beta2, 1.f - c.beta1, 1.f - c.beta2, c.eps,
          skip_pointer(c.skip_if), copy ? copy + done : nullptr, n - done);
      DP_CUDA_CHECK_LAUNCH();
    }
  });
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
