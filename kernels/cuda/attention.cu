// Transformer ops on CUDA: embedding lookup and the plain (f32) attention path, mirroring
// kernels/cpu/attention.cpp. Attention gives one block to each query row of each (batch,
// head): the row's scores live in shared memory and the softmax is exact in f32. Backward gives
// one block to each query row (dq) and one to each key row (dk, dv): no atomics, so its bits
// are the same on every run. Embedding backward sorts the positions by id (stably) and adds
// each id's rows in position order, as the CPU does: no atomics, the CPU's bits.
// f16/bf16 qkv go to cuDNN's fused SDPA (kernels/cuda/sdpa.cu) when cuDNN accepts the shape;
// otherwise they are widened to f32 for the plain kernels and the results rounded once.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/sdpa.hpp"
#include "kernels/philox.hpp"

namespace kernels::cuda {

namespace {

// A bad id sets the fault record (the smallest position wins) instead of trapping.
__global__ void embedding_forward_kernel(float* y, const int32_t* ids, const float* table,
                                         int64_t n, int64_t vocab, int64_t d,
                                         unsigned long long* fault) {
  DP_GRID_STRIDE_LOOP(e, n * d) {
    int64_t i = e / d, c = e % d;
    int32_t id = ids[i];
    if (id < 0 || id >= vocab) {
      if (c == 0) {
        atomicMin(&fault[0], (static_cast<unsigned long long>(i) << 32) |
                                 static_cast<unsigned long long>(static_cast<uint32_t>(id)));
        fault[1] = static_cast<unsigned long long>(n);
        fault[2] = static_cast<unsigned long long>(vocab);
      }
      // Zero, not NaN: the step fails at its read, but work queued before it (an optimizer
      // step) must stay finite (the losses' bad labels do the same).
      y[e] = 0.f;
      continue;
    }
    y[e] = table[static_cast<int64_t>(id) * d + c];
  }
}

// The sort's input: keys[i] = ids[i], or `outside` (>= vocab) for an id outside [0, vocab),
// which the forward reported; positions[i] = i.
__global__ void embedding_sort_input_kernel(uint32_t* keys, int32_t* positions, const int32_t* ids,
                                            int64_t n, int64_t vocab, uint32_t outside) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int32_t id = ids[i];
    keys[i] = id >= 0 && id < vocab ? static_cast<uint32_t>(id) : outside;
    positions[i] = static_cast<int32_t>(i);
  }
}

// One block per sorted position j (blockIdx.x); the block's threads and blockIdx.y stride over
// the columns. The block whose j starts a run of equal ids adds the run's dy rows into the
// id's table row in sorted order, which is position order (the sort is stable): for each
// column, acc = dtable[id, c]; acc += dy[i, c] for i in increasing order; store acc.
template <class DY>
__global__ void embedding_backward_runs_kernel(float* dtable, const DY* dy,
                                               const uint32_t* sorted_ids,
                                               const int32_t* sorted_positions, int64_t n,
                                               int64_t vocab, int64_t d) {
  const int64_t j = blockIdx.x;
  const uint32_t id = sorted_ids[j];
  if (id >= vocab || (j > 0 && sorted_ids[j - 1] == id)) return;
  float* row = dtable + static_cast<int64_t>(id) * d;
  for (int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < d;
       c += static_cast<int64_t>(blockDim.x) * gridDim.y) {
    float acc = row[c];
    for (int64_t k = j; k < n && sorted_ids[k] == id; ++k)
      acc += to_float(dy[static_cast<int64_t>(sorted_positions[k]) * d + c]);
    row[c] = acc;
  }
}

std::string bad_id_fault_text(const uint64_t* record) {
  auto position = static_cast<int64_t>(record[0] >> 32);
  auto id = static_cast<int32_t>(static_cast<uint32_t>(record[0] & 0xffffffffu));
  return "embedding: id " + std::to_string(id) + " at position " + std::to_string(position) +
         " of " + std::to_string(record[1]) + " ids is outside [0, " + std::to_string(record[2]) +
         ")";
}

// Geometry shared by the attention kernels: blockIdx.x = b H + h (up to 2^31 - 1 of them),
// blockIdx.y = query row i.
struct Geometry {
  int64_t seq, heads, head_dim, width;
  bool causal;
  float scale;
  float dropout;  // on the probabilities; 0: off (kernels/ops.hpp AttentionParams)
  uint64_t dropout_seed;
  RngOffsetArg dropout_offset;
  __device__ int64_t qkv_row(int64_t b, int64_t t) const { return (b * seq + t) * 3 * width; }
  __device__ int64_t y_row(int64_t b, int64_t t) const { return (b * seq + t) * width; }
  __device__ int64_t visible(int64_t i) const { return causal ? i + 1 : seq; }
  // The dropout mask's keep / (1 - p) for P[b H + h, i, j], as the CPU's dropout_scales.
  __device__ float keep(int64_t bh, int64_t i, int64_t j) const {
    if (dropout <= 0.f) return 1.f;
    const uint64_t counter = dropout_offset.get() + static_cast<uint64_t>((bh * seq + i) * seq + j);
    return philox::uniform(dropout_seed, counter) >= dropout ? 1.f / (1.f - dropout) : 0.f;
  }
};

// Scores s_j = scale q_i . k_j for the visible j into s (shared), one thread per j.
__device__ void row_scores(float* s, const float* qkv, const Geometry& g, int64_t b, int64_t h,
                           int64_t i, int64_t n) {
  const float* q = qkv + g.qkv_row(b, i) + h * g.head_dim;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float* k = qkv + g.qkv_row(b, j) + g.width + h * g.head_dim;
    float acc = 0.f;
    for (int64_t c = 0; c < g.head_dim; ++c) acc += q[c] * k[c];
    s[j] = g.scale * acc;
  }
  __syncthreads();
}

__global__ void attention_forward_kernel(float* y, float* lse, const float* qkv, Geometry g) {
  extern __shared__ float s[];  // (T) scores, then probabilities
  const int64_t i = blockIdx.y, bh = blockIdx.x, b = bh / g.heads, h = bh % g.heads;
  const int64_t n = g.visible(i);
  row_scores(s, qkv, g, b, h, i, n);
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, s[j]);
  m = block_reduce_max(m);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += expf(s[j] - m);
  sum = block_reduce_sum(sum);
  const float row_lse = m + logf(sum);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    s[j] = expf(s[j] - row_lse) * g.keep(bh, i, j);
  if (threadIdx.x == 0) lse[bh * g.seq + i] = row_lse;
  __syncthreads();
  float* out = y + g.y_row(b, i) + h * g.head_dim;
  for (int64_t c = threadIdx.x; c < g.head_dim; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j)
      acc += s[j] * qkv[g.qkv_row(b, j) + 2 * g.width + h * g.head_dim + c];
    out[c] = acc;
  }
}

// Backward in two kernels, without atomics, so that its bits are the same on every run (a
// replayed graph's and an uncaptured step's too). With m_ij the dropout mask's keep / (1 - p)
// (1 without dropout), P_ij from lse, dP_ij = (dy_i . v_j) m_ij, D_i = sum_j P_ij dP_ij and
// dS_ij = P_ij (dP_ij - D_i):
//   query row i (attention_backward_q_kernel): dq_i = scale sum_j dS_ij k_j, and D_i;
//   key row j (attention_backward_kv_kernel):  dk_j = scale sum_i dS_ij q_i,
//                                              dv_j = sum_i P_ij m_ij dy_i,
// each sum in a fixed order by one thread.
__global__ void attention_backward_q_kernel(float* dqkv, float* d_rows, const float* dy,
                                            const float* qkv, const float* lse, Geometry g) {
  extern __shared__ float s[];  // (T) probabilities, then (T) dS
  float* ds = s + g.seq;
  const int64_t i = blockIdx.y, bh = blockIdx.x, b = bh / g.heads, h = bh % g.heads;
  const int64_t n = g.visible(i);
  row_scores(s, qkv, g, b, h, i, n);
  const float row_lse = lse[bh * g.seq + i];
  const float* dyi = dy + g.y_row(b, i) + h * g.head_dim;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float p = expf(s[j] - row_lse);
    const float* v = qkv + g.qkv_row(b, j) + 2 * g.width + h * g.head_dim;
    float dp = 0.f;
    for (int64_t c = 0; c < g.head_dim; ++c) dp += dyi[c] * v[c];
    s[j] = p;
    ds[j] = dp * g.keep(bh, i, j);  // dropout: the gradient w.r.t. P is (dy . v_j) m_j
    dot += p * ds[j];
  }
  dot = block_reduce_sum(dot);
  if (threadIdx.x == 0) d_rows[bh * g.seq + i] = dot;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) ds[j] = s[j] * (ds[j] - dot);
  __syncthreads();
  float* dqi = dqkv + g.qkv_row(b, i) + h * g.head_dim;
  for (int64_t c = threadIdx.x; c < g.head_dim; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j)
      acc += ds[j] * qkv[g.qkv_row(b, j) + g.width + h * g.head_dim + c];
    dqi[c] = g.scale * acc;
  }
}

// Key row j (blockIdx.y) of head b H + h (blockIdx.x): the query rows that see it, i >= j when
// causal, each one's scale dS_ij and P_ij m_ij into shared memory (one thread per i, the score
// computed as the forward computes it), then dk_j and dv_j (one thread per element).
__global__ void attention_backward_kv_kernel(float* dqkv, const float* dy, const float* qkv,
                                             const float* lse, const float* d_rows, Geometry g) {
  extern __shared__ float s[];  // (n) scale dS_ij, then (n) P_ij m_ij
  const int64_t j = blockIdx.y, bh = blockIdx.x, b = bh / g.heads, h = bh % g.heads;
  const int64_t first = g.causal ? j : 0, n = g.seq - first;
  float* pm = s + n;
  const float* k = qkv + g.qkv_row(b, j) + g.width + h * g.head_dim;
  const float* v = k + g.width;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    const int64_t i = first + r;
    const float* q = qkv + g.qkv_row(b, i) + h * g.head_dim;
    const float* dyi = dy + g.y_row(b, i) + h * g.head_dim;
    float qk = 0.f, dp = 0.f;
    for (int64_t c = 0; c < g.head_dim; ++c) {
      qk += q[c] * k[c];
      dp += dyi[c] * v[c];
    }
    // The forward's and the query kernel's roundings (no fused multiply-add): the same P_ij.
    const float p = expf(__fmul_rn(g.scale, qk) - lse[bh * g.seq + i]), m = g.keep(bh, i, j);
    s[r] = g.scale * (p * (__fmul_rn(dp, m) - d_rows[bh * g.seq + i]));
    pm[r] = p * m;
  }
  __syncthreads();
  float* dk = dqkv + g.qkv_row(b, j) + g.width + h * g.head_dim;
  float* dv = dk + g.width;
  for (int64_t c = threadIdx.x; c < g.head_dim; c += blockDim.x) {
    float acc_k = 0.f, acc_v = 0.f;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = first + r;
      acc_k += s[r] * qkv[g.qkv_row(b, i) + h * g.head_dim + c];
      acc_v += pm[r] * dy[g.y_row(b, i) + h * g.head_dim + c];
    }
    dk[c] = acc_k;
    dv[c] = acc_v;
  }
}

Geometry geometry(const Tensor& qkv, const AttentionParams& p) {
  const int64_t width = qkv.dim(2) / 3;
  return Geometry{qkv.dim(1),
                  p.heads,
                  width / p.heads,
                  width,
                  p.mask == AttentionMask::causal,
                  p.scale,
                  p.dropout,
                  p.dropout_seed,
                  RngOffsetArg::of(p.dropout_offset)};
}

// Floats of dynamic shared memory past the rows the kernels use. ptxas merges the unrolled
// loops' remainder reads of s[j], s[j + 1], s[j + 2] into one 12-byte load, taken before the
// branches that decide how many of them count: at T = 1 it read 8 bytes past the one-float
// array (compute-sanitizer memcheck on an H200, 2026-12-04: "Invalid __shared__ read of size 12
// bytes" in attention_forward_kernel, kernels.cuda.attention at t 1). Four floats keep any such
// read of up to 16 bytes inside the allocation.
constexpr size_t kSharedTail = 4;

// The launch's dynamic shared memory, within the 48 KiB a block has by default less 1 KiB
// for the block reductions' static shared memory (ptxas: 256 bytes at most).
void check_shared(const char* op, size_t bytes) {
  DP_CHECK(bytes <= 47 * 1024, op << ": sequence too long for the plain CUDA attention path ("
                                  << bytes << " bytes of shared memory per row; at most 47 KiB)");
}

}  // namespace

void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table, DeviceContext& ctx) {
  NvtxRange range("kernels/embedding_forward");
  const int64_t n = ids.numel(), vocab = table.dim(0), d = table.dim(1);
  auto* fault = reinterpret_cast<unsigned long long*>(ctx.fault_record());
  embedding_forward_kernel<<<blocks_for(n * d), kThreads, 0, stream_of(ctx)>>>(
      y.data<float>(), ids.data<int32_t>(), table.data<float>(), n, vocab, d, fault);
  DP_CUDA_CHECK_LAUNCH();
  ctx.arm_fault_check(bad_id_fault_text);
}

// A stable radix sort of the positions by id (CUB), then one pass over each id's run: the
// CPU's order of additions, so its bits on every run. The scratch comes from the context's
// block cache (the same sizes every step), all of it queued on the context's stream: no host
// wait, capturable.
void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids, DeviceContext& ctx) {
  NvtxRange range("kernels/embedding_backward");
  const int64_t n = ids.numel(), vocab = dtable.dim(0), d = dtable.dim(1);
  if (n == 0 || vocab == 0 || d == 0) return;  // nothing to add (vocab 0: every id is outside)
  DP_CHECK(n <= std::numeric_limits<int32_t>::max(),
           "embedding_backward: " << n << " ids; the CUDA backend sorts at most 2^31 - 1");
  cudaStream_t s = stream_of(ctx);
  // Every valid id is below `outside`, and the sort looks at the bits that hold `outside`.
  const auto outside =
      static_cast<uint32_t>(std::min<int64_t>(vocab, std::numeric_limits<uint32_t>::max()));
  int end_bit = 0;
  while (end_bit < 32 && (outside >> end_bit) != 0) ++end_bit;

  // (4, n): keys, positions, sorted keys, sorted positions.
  Tensor lists = Tensor::empty({4, n}, DType::i32, dy.device());
  auto* keys = reinterpret_cast<uint32_t*>(lists.data<int32_t>());
  int32_t* positions = lists.data<int32_t>() + n;
  uint32_t* sorted_keys = keys + 2 * n;
  int32_t* sorted_positions = positions + 2 * n;
  const int items = static_cast<int>(n);
  size_t temp_bytes = 0;  // CUB's size for (n, end_bit): computed on the host, no device work
  DP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, sorted_keys, positions,
                                                sorted_positions, items, 0, end_bit, s));
  Tensor temp = Tensor::empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))}, DType::u8,
                              dy.device());

  embedding_sort_input_kernel<<<blocks_for(n), kThreads, 0, s>>>(
      keys, positions, ids.data<int32_t>(), n, vocab, outside);
  DP_CUDA_CHECK_LAUNCH();
  DP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw(), temp_bytes, keys, sorted_keys,
                                                positions, sorted_positions, items, 0, end_bit, s));
  const int threads = row_block_threads(d);
  const int64_t column_blocks = std::min<int64_t>((d + threads - 1) / threads, 65535);
  dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(column_blocks));
  with_storage(
      [&](auto dy_t) {
        embedding_backward_runs_kernel<<<grid, threads, 0, s>>>(
            dtable.data<float>(), dy.data<decltype(dy_t)>(), sorted_keys, sorted_positions, n,
            vocab, d);
      },
      dy.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

namespace {

// A 16-bit tensor's f32 copy (widened on ctx's stream), and an f32 result rounded into a 16-bit
// output: casts, counted as the op layer counts its own (DeviceContext::casts).
Tensor widened(const Tensor& t, DeviceContext& ctx) {
  Tensor w = Tensor::empty(t.shape(), DType::f32, t.device());
  ctx.note_cast();
  cast(w, t, ctx);
  return w;
}
void round_into(Tensor& out, const Tensor& f32, DeviceContext& ctx) {
  ctx.note_cast();
  cast(out, f32, ctx);
}
Tensor f32_like(const Tensor& t) {
  return Tensor::empty(t.shape(), DType::f32, t.device());
}

}  // namespace

// 16-bit qkv without dropout: the fused path (cuDNN's dropout draws another mask than the
// CPU's), else the plain one on widened copies.
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p,
                       DeviceContext& ctx) {
  if (qkv.dtype() != DType::f32) {
    if (p.dropout <= 0.f && sdpa_forward(y, lse, qkv, p, ctx)) return;
    Tensor y32 = f32_like(y);
    attention_forward(y32, lse, widened(qkv, ctx), p, ctx);
    return round_into(y, y32, ctx);
  }
  NvtxRange range("kernels/attention_forward");
  const Geometry g = geometry(qkv, p);
  const size_t shared = sizeof(float) * (static_cast<size_t>(g.seq) + kSharedTail);
  check_shared("attention_forward", shared);
  dim3 grid(static_cast<unsigned>(qkv.dim(0) * g.heads), static_cast<unsigned>(g.seq));
  attention_forward_kernel<<<grid, 128, shared, stream_of(ctx)>>>(
      y.data<float>(), lse.data<float>(), qkv.data<float>(), g);
  DP_CUDA_CHECK_LAUNCH();
}

void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor& y,
                        const Tensor& lse, const AttentionParams& p, DeviceContext& ctx) {
  if (qkv.dtype() != DType::f32) {
    if (p.dropout <= 0.f && sdpa_backward(dqkv, dy, qkv, y, lse, p, ctx)) return;
    Tensor dqkv32 = f32_like(dqkv);
    attention_backward(dqkv32, widened(dy, ctx), widened(qkv, ctx), Tensor(), lse, p, ctx);
    return round_into(dqkv, dqkv32, ctx);
  }
  NvtxRange range("kernels/attention_backward");
  const Geometry g = geometry(qkv, p);
  const size_t shared = sizeof(float) * (2 * static_cast<size_t>(g.seq) + kSharedTail);
  check_shared("attention_backward", shared);
  cudaStream_t s = stream_of(ctx);
  // Every element of dqkv is written once: dq by its query row's block, dk and dv by their key
  // row's. D_i passes from the first kernel to the second through d_rows (B, H, T).
  Tensor d_rows = Tensor::empty({qkv.dim(0) * g.heads * g.seq}, DType::f32, qkv.device());
  dim3 grid(static_cast<unsigned>(qkv.dim(0) * g.heads), static_cast<unsigned>(g.seq));
  attention_backward_q_kernel<<<grid, 128, shared, s>>>(dqkv.data<float>(), d_rows.data<float>(),
                                                        dy.data<float>(), qkv.data<float>(),
                                                        lse.data<float>(), g);
  DP_CUDA_CHECK_LAUNCH();
  attention_backward_kv_kernel<<<grid, 128, shared, s>>>(dqkv.data<float>(), dy.data<float>(),
                                                         qkv.data<float>(), lse.data<float>(),
                                                         d_rows.data<float>(), g);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
