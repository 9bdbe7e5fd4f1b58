// Losses (fused softmax + cross-entropy, MSE), reductions (sum, mean) and metrics (argmax,
// count_correct). Every floating reduction is deterministic: per-block partials in a fixed
// layout, then one block adds them in a fixed order (no float atomics).
#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

// ---- two-stage deterministic sum -----------------------------------------------------------

constexpr int64_t kMaxPartials = 1024;

// Number of first-stage blocks for n terms: a function of n only.
int64_t partial_blocks(int64_t n) {
  int64_t b = blocks_for(n);
  return b < kMaxPartials ? b : kMaxPartials;
}

// partial[block] = sum of f(i) over the block's grid-stride share of [0, n).
template <class F>
__global__ void partial_sum_kernel(float* partial, int64_t n, F f) {
  float acc = 0.f;
  DP_GRID_STRIDE_LOOP(i, n) acc += f(i);
  acc = block_reduce_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// *out = (sum of partial[0, count)) / divisor, one block.
__global__ void finish_sum_kernel(float* out, const float* partial, int64_t count, float divisor) {
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_reduce_sum(acc);
  if (threadIdx.x == 0) *out = acc / divisor;
}

// Queues *out = (sum over i in [0, n) of f(i)) / divisor; `partials` holds kMaxPartials floats.
template <class F>
void launch_sum(float* out, int64_t n, F f, float divisor, float* partials, cudaStream_t s) {
  int64_t blocks = partial_blocks(n);
  partial_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(partials, n, f);
  DP_CUDA_CHECK_LAUNCH();
  finish_sum_kernel<<<1, kThreads, 0, s>>>(out, partials, blocks, divisor);
  DP_CUDA_CHECK_LAUNCH();
}

struct ReadValue {
  const float* x;
  __device__ float operator()(int64_t i) const { return x[i]; }
};
struct SquareValue {
  const float* x;
  __device__ float operator()(int64_t i) const { return x[i] * x[i]; }
};

// (pred - target)^2, writing dpred = grad_scale (pred - target) on the way when asked.
struct SquaredError {
  const float* pred;
  const float* target;
  float* dpred;
  float grad_scale;
  __device__ float operator()(int64_t i) const {
    float d = pred[i] - target[i];
    if (dpred) dpred[i] = grad_scale * d;
    return d * d;
  }
};

// Bytes of workspace before the partials, rounded to keep them 256-byte aligned.
size_t aligned_bytes(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// ---- softmax cross-entropy -----------------------------------------------------------------

// f(c, x[c] as f32) for this thread's share of a row of n values, the block's threads side by
// side: for 16-bit values in a 16-byte aligned row of a multiple of 8, eight at a time from one
// 16-byte load (thread t takes values 8t to 8t + 7, then 8(t + blockDim), ...); else one at a
// time (t, t + blockDim, ...). Each thread's order is fixed, so results are reproducible.
template <class T, class F>
__device__ __forceinline__ void for_each_in_row(const T* x, int64_t n, F&& f) {
  if constexpr (sizeof(T) == 2) {
    if (n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      for (int64_t q = threadIdx.x; q < n / 8; q += blockDim.x) {
        const Pack8<T> e = load8(x, q);
#pragma unroll
        for (int k = 0; k < 8; ++k) f(q * 8 + k, to_float(e.v[k]));
      }
      return;
    }
  }
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) f(c, to_float(x[c]));
}

// The first index of the block's largest value, returned to every thread: each thread gives its
// own (best, idx), idx == none when it saw no non-NaN value (best -inf then); the larger value
// wins, the lower index on ties (none, the largest index, never beats a real entry).
__device__ long long block_reduce_first_max(float best, long long idx) {
  __shared__ float warp_best[32];
  __shared__ long long warp_idx[32];
  auto merge = [&](float ob, long long oi) {
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  };
  for (int o = 16; o > 0; o >>= 1)
    merge(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  __syncthreads();  // a previous reduction may still be reading the shared words
  if (lane == 0) {
    warp_best[warp] = best;
    warp_idx[warp] = idx;
  }
  __syncthreads();
  if (lane < n_warps) {
    best = warp_best[lane];
    idx = warp_idx[lane];
  } else {
    best = -INFINITY;
    idx = LLONG_MAX;
  }
  for (int o = 16; o > 0; o >>= 1)
    merge(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  return idx;
}

// One block per row i of logits (B, C). With lse = log sum exp x, t = (1 - ls) onehot + ls / C:
//   row_loss[i] = w ((1 - ls)(lse - x_label) + ls (lse - mean_c x_c))
//   dlogits_i = g (w / B) (softmax(x) - t),  g = grad_scale (1: the same bits as without it)
// Token cross-entropy (count_of_kept not null): rows whose label is ignore_index get no loss
// and a zero gradient, and the gradient divisor is the count of the others (*count_of_kept).
// T, D: the storage types of logits and dlogits (float, __half, __nv_bfloat16): logits read as
// f32, each gradient value rounded once. correct (zeroed before) not null: 1 is added for each
// row whose argmax (warp_row_argmax's rule, found in the same pass) is its label.
template <class T, class D>
__global__ void softmax_xent_kernel(float* row_loss, D* dlogits, const T* logits,
                                    const int32_t* labels, const float* weights, int64_t batch,
                                    int64_t classes, float ls, unsigned long long* fault,
                                    int32_t ignore_index, const float* count_of_kept,
                                    float* correct, ScalarArg grad_scale) {
  int64_t i = blockIdx.x;
  const T* x = logits + i * classes;
  int32_t label = labels[i];
  if (count_of_kept && label == ignore_index) {
    if (threadIdx.x == 0) row_loss[i] = 0.f;
    if (dlogits)
      for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
        dlogits[i * classes + c] = from_float<D>(0.f);
    return;
  }
  if (label < 0 || label >= classes) {
    // No __trap(): it would end the CUDA context every logical device on this GPU shares. The
    // fault record keeps the first bad row (the smallest (row, label) word wins) for the host,
    // which throws the CPU backend's text at its next read (bad_label_text).
    if (threadIdx.x == 0) {
      atomicMin(&fault[0], (static_cast<unsigned long long>(i) << 32) |
                               static_cast<unsigned long long>(static_cast<uint32_t>(label)));
      fault[1] = static_cast<unsigned long long>(batch);
      fault[2] = static_cast<unsigned long long>(classes);
      row_loss[i] = NAN;
    }
    // The row's gradient is zero, not NaN: the step fails at its read, but an update queued
    // before that read (an engine's) must not turn every weight into NaN and end the run.
    if (dlogits)
      for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
        dlogits[i * classes + c] = from_float<D>(0.f);
    return;  // the whole block leaves: no block reduction below is entered
  }
  // One pass over the row for its maximum and its sum of exponentials (online: a thread's sum is
  // rescaled when its maximum grows), then the threads' pairs combined at the block's maximum.
  // The smoothing term only when there is smoothing (ls is the same for the whole block): a
  // -inf logit (a masked class) would make it 0 * inf = NaN.
  // Every read of the row by another thread than the one that writes its gradient comes before
  // the block reductions below (barriers): dlogits may be the logits themselves (the gradient
  // written over them: each value is read, then written, by one thread).
  const float x_label = threadIdx.x == 0 ? to_float(x[label]) : 0.f;
  // The thread's argmax rides along: its columns come in increasing order, so a strictly larger
  // value is the first of its maximum; a NaN never is; -inf only when nothing came before. Its
  // first NaN is kept apart: a NaN is the argmax (warp_row_argmax's rule).
  float max_t = -INFINITY, sum_t = 0.f, sum_x = 0.f;
  long long arg_t = LLONG_MAX, nan_t = LLONG_MAX;  // none yet
  for_each_in_row(x, classes, [&](int64_t c, float xc) {
    if (xc > max_t) {
      sum_t = sum_t * expf(max_t - xc) + 1.f;  // the old terms at the new maximum, and e^0
      max_t = xc;
      arg_t = c;
    } else if (xc != -INFINITY) {
      sum_t += expf(xc - max_t);  // a NaN logit makes the sum NaN, as it should
      if (isnan(xc) && nan_t == LLONG_MAX) nan_t = c;
    } else if (arg_t == LLONG_MAX) {
      arg_t = c;
    }
    if (ls != 0.f) sum_x += xc;
  });
  if (correct) {  // the same for the whole block
    long long arg = block_reduce_first_max(max_t, arg_t);
    // The lowest NaN column of the row, if any: the threads that saw one rank above the rest.
    const long long first_nan = block_reduce_first_max(nan_t != LLONG_MAX ? 1.f : 0.f, nan_t);
    if (threadIdx.x == 0) {
      if (first_nan != LLONG_MAX) arg = first_nan;
      if (arg == label) atomicAdd(correct, 1.f);  // whole numbers: exact, in any order
    }
  }
  const float max_x = block_reduce_max(max_t);
  // A thread that saw only -inf (or nothing) has sum_t 0: its term is 0, not 0 * e^NaN.
  float sum_exp = block_reduce_sum(sum_t > 0.f ? sum_t * expf(max_t - max_x) : sum_t);
  if (ls != 0.f) sum_x = block_reduce_sum(sum_x);
  float lse = max_x + logf(sum_exp);
  float w = weights ? weights[i] : 1.f;
  if (threadIdx.x == 0)
    row_loss[i] = w * (ls != 0.f ? (1.f - ls) * (lse - x_label) + ls * (lse - sum_x / classes)
                                 : lse - x_label);
  if (!dlogits) return;
  float scale = grad_scale.get() *
                (w / (count_of_kept ? fmaxf(*count_of_kept, 1.f) : static_cast<float>(batch)));
  float off = ls / static_cast<float>(classes), on = (1.f - ls) + off;
  D* d = dlogits + i * classes;
  auto grad = [&](int64_t c, float xc) {
    return scale * (expf(xc - lse) - (c == label ? on : off));
  };
  // Eight values a thread through one 16-byte load and store each (two for f32) where the row
  // allows: one-value stores of 16-bit gradients left each warp's store eight partial sectors
  // apart (GPT-2's 8192 x 50304 bf16 logits: 2.1 ms on an H200, about six times the bytes' time,
  // 2026-11-29). The same values, converted one by one: the same bits.
  if (classes % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(d) % 16 == 0) {
    for (int64_t q = threadIdx.x; q < classes / 8; q += blockDim.x) {
      float v[8];
      load8_f32(x, q, v);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = grad(q * 8 + k, v[k]);
      store8_f32(d, q, v);
    }
    return;
  }
  for_each_in_row(x, classes, [&](int64_t c, float xc) { d[c] = from_float<D>(grad(c, xc)); });
}

// Rows whose label is not ignore_index, as a float (exact below 2^24 rows).
struct KeptRow {
  const int32_t* labels;
  int32_t ignore_index;
  __device__ float operator()(int64_t i) const { return labels[i] != ignore_index ? 1.f : 0.f; }
};

// *loss /= max(*count, 1).
__global__ void divide_by_count_kernel(float* loss, const float* count) {
  *loss = *loss / fmaxf(*count, 1.f);
}

// ---- argmax --------------------------------------------------------------------------------

constexpr int kRowsPerBlock = kThreads / 32;  // one warp per row

// The CPU's rule (kernels/cpu/cpu_util.hpp's row_argmax, PyTorch's), valid in lane 0: the
// first NaN's index when the row has one, else the first index of its maximum. Each lane keeps
// its first NaN and the first maximum of its other strided columns; lanes then merge, the lower
// NaN index first, ties of the maximum to the lower index.
template <class T>
__device__ long long warp_row_argmax(const T* x, int64_t classes, int lane) {
  float best = -INFINITY;
  long long idx = classes;      // sentinel: no non-NaN column yet; loses every tie
  long long nan_idx = classes;  // sentinel: no NaN yet
  for (int64_t c = lane; c < classes; c += 32) {
    float v = to_float(x[c]);
    if (isnan(v)) {
      if (nan_idx == classes) nan_idx = c;
    } else if (idx == classes || v > best) {
      best = v;
      idx = c;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    float ob = __shfl_down_sync(0xffffffffu, best, o);
    long long oi = __shfl_down_sync(0xffffffffu, idx, o);
    long long on = __shfl_down_sync(0xffffffffu, nan_idx, o);
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
    if (on < nan_idx) nan_idx = on;
  }
  return nan_idx < classes ? nan_idx : idx;
}

template <class T>
__global__ void argmax_kernel(int32_t* out, const T* x, int64_t batch, int64_t classes) {
  int lane = threadIdx.x & 31;
  int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + (threadIdx.x >> 5);
  if (row >= batch) return;  // whole warps leave together
  long long idx = warp_row_argmax(x + row * classes, classes, lane);
  if (lane == 0) out[row] = static_cast<int32_t>(idx);
}

// Integer atomics are exact, so the count is the same whatever the order.
// Count: unsigned long long, or float (exact up to 2^24: adding 1s is then order-free too).
template <class Count, class T>
__global__ void count_correct_kernel(Count* count, const T* x, const int32_t* labels, int64_t batch,
                                     int64_t classes) {
  int lane = threadIdx.x & 31;
  int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + (threadIdx.x >> 5);
  if (row >= batch) return;
  long long idx = warp_row_argmax(x + row * classes, classes, lane);
  if (lane == 0 && idx == labels[row]) atomicAdd(count, Count(1));
}

// The host side of softmax_xent_kernel's fault record: word 0 packs (row << 32 | label).
std::string bad_label_fault_text(const uint64_t* record) {
  auto row = static_cast<int64_t>(record[0] >> 32);
  auto label = static_cast<int32_t>(static_cast<uint32_t>(record[0] & 0xffffffffu));
  return bad_label_text(label, row, static_cast<int64_t>(record[1]),
                        static_cast<int64_t>(record[2]));
}

unsigned row_warp_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// One block per row of softmax_xent_kernel, instantiated for the logits' and dlogits' storage
// (dlogits: f32 or the logits' dtype; undefined: forward only).
// correct: undefined, or zeroed here and counted by the kernel.
void launch_xent(float* row_loss, Tensor& dlogits, const Tensor& logits, const int32_t* labels,
                 const float* weights, float ls, unsigned long long* fault, int32_t ignore_index,
                 const float* count_of_kept, Tensor& correct, const Scalar& grad_scale,
                 cudaStream_t s) {
  const int64_t rows = logits.dim(0), classes = logits.dim(1);
  float* count_to = data_or_null<float>(correct);
  if (count_to) DP_CUDA_CHECK(cudaMemsetAsync(count_to, 0, sizeof(float), s));
  with_storage(
      [&](auto x_t, auto d_t) {
        using T = decltype(x_t);
        using D = decltype(d_t);
        softmax_xent_kernel<T, D>
            <<<static_cast<unsigned>(rows), row_block_threads(classes), 0, s>>>(
                row_loss, data_or_null<D>(dlogits), logits.data<T>(), labels, weights, rows,
                classes, ls, fault, ignore_index, count_of_kept, count_to,
                ScalarArg::of(grad_scale));
        DP_CUDA_CHECK_LAUNCH();
      },
      logits.dtype(), dlogits.defined() ? dlogits.dtype() : logits.dtype());
}

}  // namespace

void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights, float label_smoothing,
                           Tensor& correct, const Scalar& grad_scale, DeviceContext& ctx) {
  NvtxRange range("kernels/softmax_cross_entropy");
  require_f32("softmax_cross_entropy", loss);
  require_floating("softmax_cross_entropy", {&logits});
  if (dlogits.defined()) require_floating("softmax_cross_entropy", {&dlogits});
  if (weights.defined()) require_f32("softmax_cross_entropy", weights);
  DP_CHECK(labels.dtype() == DType::i32,
           "softmax_cross_entropy: labels must be i32, got " << labels);
  cudaStream_t s = stream_of(ctx);
  int64_t batch = logits.dim(0), classes = logits.dim(1);
  // Workspace: per-row losses (B floats), then the partial sums of their total.
  size_t rows_bytes = aligned_bytes(sizeof(float) * static_cast<size_t>(batch));
  char* ws = static_cast<char*>(ctx.workspace(rows_bytes + sizeof(float) * kMaxPartials));
  auto* row_loss = reinterpret_cast<float*>(ws);
  auto* partials = reinterpret_cast<float*>(ws + rows_bytes);
  if (batch > 0) {
    auto* fault = reinterpret_cast<unsigned long long*>(ctx.fault_record());
    launch_xent(row_loss, dlogits, logits, labels.data<int32_t>(),
                data_or_null<const float>(weights), label_smoothing, fault, 0, nullptr, correct,
                grad_scale, s);
    ctx.arm_fault_check(bad_label_fault_text);
  } else if (correct.defined()) {
    DP_CUDA_CHECK(cudaMemsetAsync(correct.data<float>(), 0, sizeof(float), s));
  }
  // loss = (sum_i row_loss[i]) / B, 0 for an empty batch.
  float divisor = batch > 0 ? static_cast<float>(batch) : 1.f;
  launch_sum(loss.data<float>(), batch, ReadValue{row_loss}, divisor, partials, s);
}

void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor& correct, const Scalar& grad_scale,
                         const Tensor& kept, DeviceContext& ctx) {
  NvtxRange range("kernels/token_cross_entropy");
  require_f32("token_cross_entropy", loss);
  require_floating("token_cross_entropy", {&logits});
  if (dlogits.defined()) require_floating("token_cross_entropy", {&dlogits});
  cudaStream_t s = stream_of(ctx);
  int64_t rows = logits.dim(0), classes = logits.dim(1);
  if (rows == 0) {  // no token: loss 0, as the CPU (and no launch of zero blocks)
    DP_CUDA_CHECK(cudaMemsetAsync(loss.data<float>(), 0, sizeof(float), s));
    if (correct.defined())
      DP_CUDA_CHECK(cudaMemsetAsync(correct.data<float>(), 0, sizeof(float), s));
    return;
  }
  // Workspace: per-row losses, the kept-row count, then the partial sums.
  size_t rows_bytes = aligned_bytes(sizeof(float) * static_cast<size_t>(rows));
  char* ws = static_cast<char*>(ctx.workspace(rows_bytes + 256 + sizeof(float) * kMaxPartials));
  auto* row_loss = reinterpret_cast<float*>(ws);
  auto* count = reinterpret_cast<float*>(ws + rows_bytes);
  auto* partials = reinterpret_cast<float*>(ws + rows_bytes + 256);
  if (kept.defined())  // the whole batch's count, of which these rows are a part
    count = const_cast<float*>(kept.data<float>());
  else
    launch_sum(count, rows, KeptRow{targets.data<int32_t>(), ignore_index}, 1.f, partials, s);
  auto* fault = reinterpret_cast<unsigned long long*>(ctx.fault_record());
  launch_xent(row_loss, dlogits, logits, targets.data<int32_t>(), nullptr, 0.f, fault, ignore_index,
              count, correct, grad_scale, s);
  ctx.arm_fault_check(bad_label_fault_text);
  launch_sum(loss.data<float>(), rows, ReadValue{row_loss}, 1.f, partials, s);
  divide_by_count_kernel<<<1, 1, 0, s>>>(loss.data<float>(), count);
  DP_CUDA_CHECK_LAUNCH();
}

void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index, DeviceContext& ctx) {
  NvtxRange range("kernels/count_kept");
  require_f32("count_kept", out);
  auto* partials = static_cast<float*>(ctx.workspace(sizeof(float) * kMaxPartials));
  launch_sum(out.data<float>(), targets.numel(), KeptRow{targets.data<int32_t>(), ignore_index},
             1.f, partials, stream_of(ctx));
}

void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target,
              DeviceContext& ctx) {
  NvtxRange range("kernels/mse_loss");
  require_f32("mse_loss", loss);
  require_f32("mse_loss", pred);
  require_f32("mse_loss", target);
  if (dpred.defined()) require_f32("mse_loss", dpred);
  int64_t n = pred.numel();
  auto* partials = static_cast<float*>(ctx.workspace(sizeof(float) * kMaxPartials));
  float grad_scale = n > 0 ? static_cast<float>(2.0 / static_cast<double>(n)) : 0.f;
  float divisor = n > 0 ? static_cast<float>(n) : 1.f;
  SquaredError f{pred.data<float>(), target.data<float>(), data_or_null<float>(dpred), grad_scale};
  launch_sum(loss.data<float>(), n, f, divisor, partials, stream_of(ctx));
}

void sum(Tensor& out, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/sum");
  require_f32("sum", out);
  require_f32("sum", x);
  auto* partials = static_cast<float*>(ctx.workspace(sizeof(float) * kMaxPartials));
  launch_sum(out.data<float>(), x.numel(), ReadValue{x.data<float>()}, 1.f, partials,
             stream_of(ctx));
}

void mean(Tensor& out, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/mean");
  require_f32("mean", out);
  require_f32("mean", x);
  int64_t n = x.numel();
  auto* partials = static_cast<float*>(ctx.workspace(sizeof(float) * kMaxPartials));
  float divisor = n > 0 ? static_cast<float>(n) : 1.f;
  launch_sum(out.data<float>(), n, ReadValue{x.data<float>()}, divisor, partials, stream_of(ctx));
}

void sum_squares(Tensor& out, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/sum_squares");
  require_f32("sum_squares", {&out, &x});
  auto* partials = static_cast<float*>(ctx.workspace(sizeof(float) * kMaxPartials));
  launch_sum(out.data<float>(), x.numel(), SquareValue{x.data<float>()}, 1.f, partials,
             stream_of(ctx));
}

void argmax(Tensor& out, const Tensor& x, DeviceContext& ctx) {
  NvtxRange range("kernels/argmax");
  require_floating("argmax", {&x});
  DP_CHECK(out.dtype() == DType::i32, "argmax: out must be i32, got " << out);
  int64_t batch = x.dim(0), classes = x.dim(1);
  if (batch == 0) return;
  with_storage(
      [&](auto x_t) {
        using T = decltype(x_t);
        argmax_kernel<T><<<row_warp_blocks(batch), kThreads, 0, stream_of(ctx)>>>(
            out.data<int32_t>(), x.data<T>(), batch, classes);
        DP_CUDA_CHECK_LAUNCH();
      },
      x.dtype());
}

int64_t count_correct(const Tensor& logits, const Tensor& labels, DeviceContext& ctx) {
  NvtxRange range("kernels/count_correct");
  require_floating("count_correct", {&logits});
  DP_CHECK(labels.dtype() == DType::i32, "count_correct: labels must be i32, got " << labels);
  int64_t batch = logits.dim(0), classes = logits.dim(1);
  if (batch == 0) return 0;
  cudaStream_t s = stream_of(ctx);
  auto* count = static_cast<unsigned long long*>(ctx.workspace(sizeof(unsigned long long)));
  DP_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(*count), s));
  with_storage(
      [&](auto x_t) {
        using T = decltype(x_t);
        count_correct_kernel<unsigned long long, T><<<row_warp_blocks(batch), kThreads, 0, s>>>(
            count, logits.data<T>(), labels.data<int32_t>(), batch, classes);
        DP_CUDA_CHECK_LAUNCH();
      },
      logits.dtype());
  unsigned long long host_count = 0;
  DP_CUDA_CHECK(cudaMemcpyAsync(&host_count, count, sizeof(host_count), cudaMemcpyDeviceToHost, s));
  // The op returns a host value: wait for the count to arrive.
  DP_CUDA_CHECK(cudaStreamSynchronize(s));
  return static_cast<int64_t>(host_count);
}

void count_correct_into(Tensor& out, const Tensor& logits, const Tensor& labels,
                        DeviceContext& ctx) {
  NvtxRange range("kernels/count_correct_into");
  require_f32("count_correct_into", out);
  require_floating("count_correct_into", {&logits});
  int64_t batch = logits.dim(0), classes = logits.dim(1);
  cudaStream_t s = stream_of(ctx);
  DP_CUDA_CHECK(cudaMemsetAsync(out.data<float>(), 0, sizeof(float), s));
  if (batch == 0) return;
  with_storage(
      [&](auto x_t) {
        using T = decltype(x_t);
        count_correct_kernel<float, T><<<row_warp_blocks(batch), kThreads, 0, s>>>(
            out.data<float>(), logits.data<T>(), labels.data<int32_t>(), batch, classes);
        DP_CUDA_CHECK_LAUNCH();
      },
      logits.dtype());
}

}  // namespace kernels::cuda
