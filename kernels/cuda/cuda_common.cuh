// Shared by the CUDA backend's .cu files: stream/handle access, launch geometry, dtype loads.
#pragma once

#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/runtime/cuda_check.hpp"
#include "kernels/runtime/nvtx.hpp"

namespace kernels::cuda {

inline cudaStream_t stream_of(DeviceContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream());
}

constexpr int kThreads = 256;
// Grid for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

#define DP_GRID_STRIDE_LOOP(i, n)                                                        \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// Loads and stores of floating dtypes as float.
template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- host-side helpers ---------------------------------------------------------------------

// Most CUDA ops support f32 only; the others throw naming the op and the dtype.
inline void require_f32(const char* op, const Tensor& t) {
  if (t.dtype() != DType::f32)
    DP_THROW(op << ": the CUDA backend supports f32 only, got " << t.dtype() << " in " << t);
}
inline void require_f32(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) require_f32(op, *t);
}

// Data pointer of an optional tensor (nullptr when undefined).
template <class T>
T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

// Threads for a kernel that gives one block to a row of `n` elements: a multiple of 32 in
// [32, 256]. It depends only on n, so reductions over a row add in the same order every run.
inline int row_block_threads(int64_t n) {
  int64_t t = (n + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 256 ? 256 : t));
}

// ---- deterministic block reductions --------------------------------------------------------
// Fixed shapes of addition for a fixed block size: the same inputs give the same bits every
// run (no atomics). Every thread of the block must call them; blockDim.x a multiple of 32.

// Butterfly sum over a warp; every lane ends with the same value (a + b == b + a bitwise).
__device__ __forceinline__ float warp_reduce_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread.
__device__ __forceinline__ float block_reduce_sum(float v) {
  __shared__ float warp_part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_reduce_sum(v);
  __syncthreads();  // a previous call may still be reading warp_part
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  return warp_reduce_sum(lane < n_warps ? warp_part[lane] : 0.f);
}

// Max over the block, returned to every thread (NaN-ignoring, like fmaxf).
__device__ __forceinline__ float block_reduce_max(float v) {
  __shared__ float warp_part[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_reduce_max(v);
  __syncthreads();
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  return warp_reduce_max(lane < n_warps ? warp_part[lane] : -INFINITY);
}

// ---- deterministic column sums -------------------------------------------------------------
// out[col] (+)= sum over rows of f(row, col), for a row-major (rows, cols) operand that `f`
// reads. Blocks of 32 columns x 8 row lanes read coalesced along a row; the rows are split in
// `chunks` fixed ranges whose partial sums a second kernel adds in chunk order.

constexpr int kColTile = 32, kRowLanes = 8;

template <class F>
__global__ void column_partial_sums_kernel(float* partial, int64_t rows, int64_t cols,
                                           int64_t rows_per_chunk, F f) {
  __shared__ float part[kRowLanes][kColTile + 1];
  int64_t col = blockIdx.x * static_cast<int64_t>(kColTile) + threadIdx.x;
  int64_t begin = blockIdx.y * rows_per_chunk;
  int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float acc = 0.f;
  if (col < cols)
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) acc += f(r, col);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float s = part[0][threadIdx.x];
    for (int k = 1; k < kRowLanes; ++k) s += part[k][threadIdx.x];
    partial[blockIdx.y * cols + col] = s;
  }
}

// Adds the chunk partials of each column in chunk order (a template: defined once per program).
template <class T>
__global__ void column_finish_kernel(T* out, const T* partial, int64_t chunks, int64_t cols,
                                     bool accumulate) {
  DP_GRID_STRIDE_LOOP(col, cols) {
    T s = partial[col];
    for (int64_t k = 1; k < chunks; ++k) s += partial[k * cols + col];
    out[col] = accumulate ? out[col] + s : s;
  }
}

// Row chunks launch_column_sums uses for `rows`; its scratch holds chunks * cols floats.
inline int64_t column_sum_chunks(int64_t rows) {
  int64_t c = rows / 256;
  return c < 1 ? 1 : (c > 64 ? 64 : c);
}

// Queues out (+)= column sums on s; `scratch` holds column_sum_chunks(rows) * cols floats.
template <class F>
void launch_column_sums(float* out, int64_t rows, int64_t cols, F f, bool accumulate,
                        float* scratch, cudaStream_t s) {
  if (cols == 0) return;
  int64_t chunks = column_sum_chunks(rows);
  int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  dim3 block(kColTile, kRowLanes);
  dim3 grid(static_cast<unsigned>((cols + kColTile - 1) / kColTile), static_cast<unsigned>(chunks));
  column_partial_sums_kernel<<<grid, block, 0, s>>>(scratch, rows, cols, rows_per_chunk, f);
  DP_CUDA_CHECK_LAUNCH();
  column_finish_kernel<float>
      <<<blocks_for(cols), kThreads, 0, s>>>(out, scratch, chunks, cols, accumulate);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
