// Casts between floating dtypes on one GPU, and fill. Byte copies between devices are the
// runtime's (kernels/runtime/memory.hpp).
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

template <class Out, class In>
__global__ void cast_kernel(Out* y, const In* x, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Out>(to_float<In>(x[i]));
}

// Eight values a thread (load8_f32 / store8_f32), each converted as cast_kernel converts it.
template <class Out, class In>
__global__ void cast8_kernel(Out* y, const In* x, int64_t groups) {
  DP_GRID_STRIDE_LOOP(q, groups) {
    float v[8];
    load8_f32(x, q, v);
    store8_f32(y, q, v);
  }
}

template <class Out, class In>
void launch_cast(Out* y, const In* x, int64_t n, cudaStream_t s) {
  launch_eight_wide_then_tail(
      n, aligned16(y, x),
      [&](int64_t groups) { cast8_kernel<<<blocks_for(groups), kThreads, 0, s>>>(y, x, groups); },
      [&](int64_t first, int64_t count) {
        cast_kernel<<<blocks_for(count), kThreads, 0, s>>>(y + first, x + first, count);
      });
}

template <class In>
void cast_from(Tensor& dst, const In* x, cudaStream_t s) {
  int64_t n = dst.numel();
  switch (dst.dtype()) {
    case DType::f32:
      launch_cast(dst.data<float>(), x, n, s);
      break;
    case DType::f16:
      launch_cast(dst.data<__half>(), x, n, s);
      break;
    case DType::bf16:
      launch_cast(dst.data<__nv_bfloat16>(), x, n, s);
      break;
    default:
      DP_THROW("cast to " << dst.dtype() << " is not supported");
  }
  DP_CUDA_CHECK_LAUNCH();
}

template <class T>
__global__ void fill_kernel(T* y, T v, int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = v;
}

template <class T>
void launch_fill(Tensor& y, T v, cudaStream_t s) {
  fill_kernel<<<blocks_for(y.numel()), kThreads, 0, s>>>(y.data<T>(), v, y.numel());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void cast(Tensor& dst, const Tensor& src, DeviceContext& ctx) {
  NvtxRange range("kernels/cast");
  cudaStream_t s = stream_of(ctx);
  switch (src.dtype()) {
    case DType::f32:
      cast_from(dst, src.data<float>(), s);
      break;
    case DType::f16:
      cast_from(dst, src.data<__half>(), s);
      break;
    case DType::bf16:
      cast_from(dst, src.data<__nv_bfloat16>(), s);
      break;
    default:
      DP_THROW("cast from " << src.dtype() << " is not supported");
  }
}

void fill(Tensor& y, float value, DeviceContext& ctx) {
  cudaStream_t s = stream_of(ctx);
  switch (y.dtype()) {
    case DType::f32:
      launch_fill<float>(y, value, s);
      break;
    case DType::f16:
      launch_fill<__half>(y, __float2half_rn(value), s);
      break;
    case DType::bf16:
      launch_fill<__nv_bfloat16>(y, __float2bfloat16_rn(value), s);
      break;
    case DType::i32:
      launch_fill<int32_t>(y, static_cast<int32_t>(value), s);
      break;
    case DType::i64:
      launch_fill<int64_t>(y, static_cast<int64_t>(value), s);
      break;
    case DType::u8:
      launch_fill<uint8_t>(y, static_cast<uint8_t>(value), s);
      break;
  }
}

}  // namespace kernels::cuda
