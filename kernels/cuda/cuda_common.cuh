// Shared by the CUDA backend's .cu files: stream/handle access, launch geometry, dtype loads.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/runtime/cuda_check.hpp"
#include "kernels/runtime/nvtx.hpp"
#include "kernels/storage_dispatch.hpp"

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

// A kernels::Scalar as a kernel argument: the fixed value, or where the device holds it (read
// when the kernel runs, so a replayed launch sees what the host wrote there since).
struct ScalarArg {
  const float* at;
  float value;
  static ScalarArg of(const Scalar& s) { return {s.device_value(), s.value}; }
  __device__ __forceinline__ float get() const { return at ? *at : value; }
};

// A kernels::RngOffset as a kernel argument: delta, plus the device's base when there is one
// (read when the kernel runs).
struct RngOffsetArg {
  const int64_t* base;
  uint64_t delta;
  static RngOffsetArg of(const RngOffset& o) { return {o.device_base(), o.delta}; }
  __device__ __forceinline__ uint64_t get() const {
    return delta + (base ? static_cast<uint64_t>(*base) : 0);
  }
};

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

// GELU's tanh form, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (PyTorch's
// approximate='tanh'), and its derivative: one formula for the activation's kernels and
// autograd's unary op (kernels/cpu/vec_math.cpp and cpu/tensor_ops.cpp hold the CPU's).
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;
__device__ __forceinline__ float gelu_tanh_of(float v) {
  return 0.5f * v * (1.f + tanhf(kSqrt2OverPi * (v + kGeluCubic * v * v * v)));
}
__device__ __forceinline__ float gelu_tanh_derivative(float v) {
  const float t = tanhf(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
  const float flat =
      1.f - t * t;  // 0 where tanh is +-1: the term is then 0, not 0 * inf at v^2 = inf
  if (flat == 0.f) return 0.5f * (1.f + t);
  return 0.5f * (1.f + t) + 0.5f * v * flat * kSqrt2OverPi * (1.f + 3.f * kGeluCubic * v * v);
}

// ---- 16-bit storage ------------------------------------------------------------------------
// The ops that take f16/bf16 activations (ops.hpp) launch one kernel templated on the storage
// type of each tensor (float, __half, __nv_bfloat16): it reads every element as f32 (to_float),
// computes exactly as the f32 kernel does and rounds a result once where it stores it
// (from_float; an accumulating output is read, added to in f32 and rounded once). That is the
// bits of widening each 16-bit input, running the f32 kernel and rounding its output, without
// the cast kernels and f32 copies; instantiated with float only, a kernel is the f32 kernel.
// Mirrors kernels/cpu/cpu_util.hpp.

// requires each dtype f32, f16 or bf16, f16 and bf16 not both (ops.cpp checks it).
// ensures f(S...) is called on the host with a value of each dtype's storage type, in order:
//   with_storage([&](auto y_t, auto x_t) { kernel<<<...>>>(y.data<decltype(y_t)>(), ...); },
//                y.dtype(), x.dtype());
template <class F, class... D>
void with_storage(F&& f, D... dtypes) {
  with_storage_of<__half, __nv_bfloat16>(f, dtypes...);
}

// Eight 16-bit values from one 16-byte load or store (group q: values 8q to 8q + 7 of p, which
// must be 16-byte aligned). On GPT-2's (8192, 3072) bf16 activations one-value kernels moved
// about 0.7 TB/s of an H200's 4.8 (2026-11-29).
template <class T>
struct Pack8 {
  static_assert(sizeof(T) == 2, "Pack8 holds 16-bit values");
  T v[8];
};
template <class T>
__device__ __forceinline__ Pack8<T> load8(const T* p, int64_t q) {
  const uint4 u = reinterpret_cast<const uint4*>(p)[q];
  Pack8<T> out;
  memcpy(out.v, &u, sizeof(u));
  return out;
}
template <class T>
__device__ __forceinline__ void store8(T* p, int64_t q, const Pack8<T>& in) {
  uint4 u;
  memcpy(&u, in.v, sizeof(u));
  reinterpret_cast<uint4*>(p)[q] = u;
}

// Whether every pointer is 16-byte aligned and every storage type 16-bit: load8 and store8 serve.
template <class... T>
bool eight_wide(const T*... p) {
  return ((sizeof(T) == 2 && reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

// Eight values of any storage type (float, __half, __nv_bfloat16) as f32, group q (values 8q to
// 8q + 7) of a 16-byte aligned p: one 16-byte access for 16-bit values, two for f32. Each value
// is converted as to_float / from_float convert it one at a time: the same bits as a one-wide
// loop. For passes over whole buffers (casts, the finiteness check), which one value a thread
// ran at a fraction of an H200's bandwidth (2026-11-29: 0.34 ms for GPT-2's weight cast).
template <class T>
__device__ __forceinline__ void load8_f32(const T* p, int64_t q, float (&out)[8]) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[2 * q];
    const float4 b = reinterpret_cast<const float4*>(p)[2 * q + 1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const Pack8<T> e = load8(p, q);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = to_float(e.v[k]);
  }
}
template <class T>
__device__ __forceinline__ void store8_f32(T* p, int64_t q, const float (&in)[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(p)[2 * q] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[2 * q + 1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    Pack8<T> e;
#pragma unroll
    for (int k = 0; k < 8; ++k) e.v[k] = from_float<T>(in[k]);
    store8(p, q, e);
  }
}
// Whether every pointer is 16-byte aligned (load8_f32 / store8_f32 serve any storage type).
template <class... T>
bool aligned16(const T*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

// An elementwise launch over n values split in two: bulk(groups) takes the first 8 * groups in
// groups of 8 when `wide` (the caller's eight_wide), tail(first, count) the rest (all n when not
// wide). The two run on one stream, in that order.
template <class Bulk, class Tail>
void launch_eight_wide_then_tail(int64_t n, bool wide, Bulk&& bulk, Tail&& tail) {
  int64_t done = 0;
  if (wide && n >= 8) {
    bulk(n / 8);
    done = n / 8 * 8;
  }
  if (done < n) tail(done, n - done);
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
// The ops with 16-bit kernels (with_storage): f32, f16 or bf16.
inline void require_floating(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (!is_floating(t->dtype()))
      DP_THROW(op << ": the CUDA backend takes f32, f16 or bf16, got " << t->dtype() << " in "
                  << *t);
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

// The sums' value: one float, or two side by side (float2: two sums of one pass, such as a
// LayerNorm's dgamma and dbeta), each component added as a float alone would be.
__device__ __forceinline__ float column_add(float a, float b) {
  return a + b;
}
__device__ __forceinline__ float2 column_add(float2 a, float2 b) {
  return make_float2(a.x + b.x, a.y + b.y);
}
template <class V>
__device__ __forceinline__ V column_zero() {
  if constexpr (std::is_same_v<V, float2>)
    return make_float2(0.f, 0.f);
  else
    return 0.f;
}

// V: f's value, float or float2.
template <class V, class F>
__global__ void column_partial_sums_kernel(V* partial, int64_t rows, int64_t cols,
                                           int64_t rows_per_chunk, F f) {
  __shared__ V part[kRowLanes][kColTile + 1];
  int64_t col = blockIdx.x * static_cast<int64_t>(kColTile) + threadIdx.x;
  int64_t begin = blockIdx.y * rows_per_chunk;
  int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  V acc = column_zero<V>();
  if (col < cols) {
    // Four rows a lane at a time into four sums, so that four loads are in flight per thread:
    // with one, GPT-2's bias gradients ((8192, 3072) bf16 and smaller) ran at about a fifth of
    // an H200's bandwidth (1.7 ms of a 23 ms step, ncu 2026-11-29). The sums meet in a fixed
    // order: the same bits every run.
    V a0 = column_zero<V>(), a1 = a0, a2 = a0, a3 = a0;
    int64_t r = begin + threadIdx.y;
    for (; r + 3 * kRowLanes < end; r += 4 * kRowLanes) {
      a0 = column_add(a0, f(r, col));
      a1 = column_add(a1, f(r + kRowLanes, col));
      a2 = column_add(a2, f(r + 2 * kRowLanes, col));
      a3 = column_add(a3, f(r + 3 * kRowLanes, col));
    }
    for (; r < end; r += kRowLanes) a0 = column_add(a0, f(r, col));
    acc = column_add(column_add(a0, a1), column_add(a2, a3));
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    V s = part[0][threadIdx.x];
    for (int k = 1; k < kRowLanes; ++k) s = column_add(s, part[k][threadIdx.x]);
    partial[blockIdx.y * cols + col] = s;
  }
}

// Adds the chunk partials of each column in chunk order into out (float, or 16-bit: read and
// added to in f32, rounded once). A template: defined once per program.
template <class Out>
__global__ void column_finish_kernel(Out* out, const float* partial, int64_t chunks, int64_t cols,
                                     bool accumulate) {
  DP_GRID_STRIDE_LOOP(col, cols) {
    float s = partial[col];
    for (int64_t k = 1; k < chunks; ++k) s += partial[k * cols + col];
    out[col] = from_float<Out>(accumulate ? to_float(out[col]) + s : s);
  }
}

// The same for two sums side by side, into two outputs (Out: float). A template, as above.
template <class Out>
__global__ void column_finish2_kernel(Out* out_x, Out* out_y, const float2* partial, int64_t chunks,
                                      int64_t cols, bool accumulate) {
  DP_GRID_STRIDE_LOOP(col, cols) {
    float2 s = partial[col];
    for (int64_t k = 1; k < chunks; ++k) s = column_add(s, partial[k * cols + col]);
    out_x[col] = accumulate ? out_x[col] + s.x : s.x;
    out_y[col] = accumulate ? out_y[col] + s.y : s.y;
  }
}

// Row chunks launch_column_sums uses for `rows`; its scratch holds chunks * cols floats.
inline int64_t column_sum_chunks(int64_t rows) {
  int64_t c = rows / 256;
  return c < 1 ? 1 : (c > 64 ? 64 : c);
}

// The first pass's shape for (rows, cols): its row chunks, the rows each takes, its grid.
struct ColumnPass {
  int64_t chunks, rows_per_chunk;
  dim3 grid, block;
};
inline ColumnPass column_pass(int64_t rows, int64_t cols) {
  ColumnPass p;
  p.chunks = column_sum_chunks(rows);
  p.rows_per_chunk = (rows + p.chunks - 1) / p.chunks;
  p.block = dim3(kColTile, kRowLanes);
  p.grid = dim3(static_cast<unsigned>((cols + kColTile - 1) / kColTile),
                static_cast<unsigned>(p.chunks));
  return p;
}

// Queues out (+)= column sums on s (out float, __half or __nv_bfloat16); `scratch` holds
// column_sum_chunks(rows) * cols floats.
template <class Out, class F>
void launch_column_sums(Out* out, int64_t rows, int64_t cols, F f, bool accumulate, float* scratch,
                        cudaStream_t s) {
  if (cols == 0) return;
  const ColumnPass p = column_pass(rows, cols);
  column_partial_sums_kernel<float>
      <<<p.grid, p.block, 0, s>>>(scratch, rows, cols, p.rows_per_chunk, f);
  DP_CUDA_CHECK_LAUNCH();
  column_finish_kernel<Out>
      <<<blocks_for(cols), kThreads, 0, s>>>(out, scratch, p.chunks, cols, accumulate);
  DP_CUDA_CHECK_LAUNCH();
}

// Two column sums from one pass over the rows: f returns float2, out_x (+)= the sums of .x and
// out_y (+)= those of .y (f32 outputs), each added as launch_column_sums adds one; `scratch`
// holds column_sum_chunks(rows) * cols float2.
template <class F>
void launch_column_sums2(float* out_x, float* out_y, int64_t rows, int64_t cols, F f,
                         bool accumulate, float2* scratch, cudaStream_t s) {
  if (cols == 0) return;
  const ColumnPass p = column_pass(rows, cols);
  column_partial_sums_kernel<float2>
      <<<p.grid, p.block, 0, s>>>(scratch, rows, cols, p.rows_per_chunk, f);
  DP_CUDA_CHECK_LAUNCH();
  column_finish2_kernel<float>
      <<<blocks_for(cols), kThreads, 0, s>>>(out_x, out_y, scratch, p.chunks, cols, accumulate);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda

namespace kernels::cuda {

// ---- deterministic per-channel sums --------------------------------------------------------
// For x viewed as (N, C, inner) (BatchNorm, the bias gradient of (N, C, H, W)): two sums per
// channel c over its N * inner elements of f(index, c), a float2. Each channel's elements are
// split in `chunks` fixed ranges, one block each (grid (C, chunks)), so that a few channels still
// fill every SM; a second kernel adds each channel's partials in chunk order and hands the two
// sums to g(c, sum_x, sum_y). The chunk count depends on the shape only: same bits every run.

// Chunks per channel for `count` elements each: at least ~2048 elements per block, and no more
// chunks than ~1024 blocks in all need.
inline int64_t channel_sum_chunks(int64_t channels, int64_t count) {
  int64_t by_size = (count + 2047) / 2048;
  int64_t by_grid = channels > 0 ? (1024 + channels - 1) / channels : 1;
  int64_t c = by_size < by_grid ? by_size : by_grid;
  return c < 1 ? 1 : (c > 256 ? 256 : c);
}

template <class F>
__global__ void channel_partial_sums_kernel(float2* partial, int64_t channels, int64_t inner,
                                            int64_t count, int64_t per_chunk, F f) {
  int64_t c = blockIdx.x, k = blockIdx.y, chunks = gridDim.y;
  int64_t begin = k * per_chunk;
  int64_t end = begin + per_chunk < count ? begin + per_chunk : count;
  float a = 0.f, b = 0.f;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    int64_t n = j / inner, s = j - n * inner;
    float2 v = f((n * channels + c) * inner + s, c);
    a += v.x;
    b += v.y;
  }
  a = block_reduce_sum(a);
  b = block_reduce_sum(b);
  if (threadIdx.x == 0) partial[c * chunks + k] = make_float2(a, b);
}

template <class G>
__global__ void channel_finish_kernel(const float2* partial, int64_t channels, int64_t chunks,
                                      G g) {
  DP_GRID_STRIDE_LOOP(c, channels) {
    float a = 0.f, b = 0.f;
    for (int64_t k = 0; k < chunks; ++k) {
      float2 v = partial[c * chunks + k];
      a += v.x;
      b += v.y;
    }
    g(c, a, b);
  }
}

// Queues g(c, sum f.x, sum f.y) for every channel on s; `scratch` holds
// channels * channel_sum_chunks(channels, batch * inner) float2.
template <class F, class G>
void launch_channel_sums(int64_t batch, int64_t channels, int64_t inner, F f, G g, float2* scratch,
                         cudaStream_t s) {
  if (channels == 0) return;
  int64_t count = batch * inner, chunks = channel_sum_chunks(channels, count);
  int64_t per_chunk = (count + chunks - 1) / chunks;
  dim3 grid(static_cast<unsigned>(channels), static_cast<unsigned>(chunks));
  channel_partial_sums_kernel<<<grid, kThreads, 0, s>>>(scratch, channels, inner, count, per_chunk,
                                                        f);
  DP_CUDA_CHECK_LAUNCH();
  channel_finish_kernel<<<blocks_for(channels), kThreads, 0, s>>>(scratch, channels, chunks, g);
  DP_CUDA_CHECK_LAUNCH();
}

// The plain channel sum: f = (x[index], 0).
struct ReadChannelValue {
  const float* x;
  __device__ float2 operator()(int64_t idx, int64_t) const { return make_float2(x[idx], 0.f); }
};

inline size_t channel_sum_scratch_bytes(int64_t batch, int64_t channels, int64_t inner) {
  return sizeof(float2) *
         static_cast<size_t>(channels * channel_sum_chunks(channels, batch * inner));
}

}  // namespace kernels::cuda
