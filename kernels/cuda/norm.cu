// BatchNorm (statistics over every dim but 1) and LayerNorm (over the last dim), hand-written.
// Each reduction has a fixed shape (the chunked channel sums and column sums of
// cuda_common.cuh, one block per LayerNorm row), so results are bitwise reproducible.
#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

// ---- batch norm ----------------------------------------------------------------------------
// x viewed as (N, C, inner); channel c holds count = N * inner elements.

// Channel sums for launch_channel_sums (cuda_common.cuh): chunks of every channel in parallel,
// partials added in a fixed order. Forward: mean, then the biased variance around it (two
// passes), then y elementwise. Backward: sum dy and sum dy xhat, then dx elementwise.

struct SetMean {
  float* mean;
  float count;
  __device__ void operator()(int64_t c, float sum, float) const { mean[c] = sum / count; }
};

struct SquaredDeviation {
  const float* x;
  const float* mean;
  __device__ float2 operator()(int64_t idx, int64_t c) const {
    float d = x[idx] - mean[c];
    return make_float2(d * d, 0.f);
  }
};

// invstd from the biased variance; running averages as PyTorch (r = (1 - m) r + m stat, the
// unbiased variance for the running one).
struct SetVariance {
  float* save_invstd;
  float* running_mean;
  float* running_var;
  const float* mean;
  int64_t count;
  float momentum, eps;
  __device__ void operator()(int64_t c, float sum_sq, float) const {
    float var = sum_sq / static_cast<float>(count);
    save_invstd[c] = 1.f / sqrtf(var + eps);
    float unbiased =
        count > 1 ? var * static_cast<float>(count) / static_cast<float>(count - 1) : var;
    running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean[c];
    running_var[c] = (1.f - momentum) * running_var[c] + momentum * unbiased;
  }
};

__global__ void bn_normalize_kernel(float* y, const float* x, const float* mean,
                                    const float* invstd, const float* gamma, const float* beta,
                                    int64_t n, int64_t channels, int64_t inner) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t c = (i / inner) % channels;
    y[i] = (x[i] - mean[c]) * invstd[c] * gamma[c] + beta[c];
  }
}

__global__ void bn_forward_eval_kernel(float* y, const float* x, const float* gamma,
                                       const float* beta, const float* running_mean,
                                       const float* running_var, int64_t n, int64_t channels,
                                       int64_t inner, float eps) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t c = (i / inner) % channels;
    float invstd = 1.f / sqrtf(running_var[c] + eps);
    y[i] = (x[i] - running_mean[c]) * invstd * gamma[c] + beta[c];
  }
}

// (dy, dy xhat) with xhat = (x - mean) invstd.
struct DyAndDyXhat {
  const float* dy;
  const float* x;
  const float* mean;
  const float* invstd;
  __device__ float2 operator()(int64_t idx, int64_t c) const {
    float g = dy[idx];
    return make_float2(g, g * (x[idx] - mean[c]) * invstd[c]);
  }
};

// dbeta (+)= sum dy, dgamma (+)= sum dy xhat; the two sums are kept for dx.
struct SetBnGrads {
  float* dgamma;
  float* dbeta;
  float* sums;  // (2, C): sum dy, sum dy xhat
  int64_t channels;
  bool accumulate;
  __device__ void operator()(int64_t c, float sum_dy, float sum_dy_xhat) const {
    dbeta[c] = accumulate ? dbeta[c] + sum_dy : sum_dy;
    dgamma[c] = accumulate ? dgamma[c] + sum_dy_xhat : sum_dy_xhat;
    sums[c] = sum_dy;
    sums[channels + c] = sum_dy_xhat;
  }
};

// dx = gamma invstd (dy - sum dy / count - xhat sum(dy xhat) / count).
__global__ void bn_backward_dx_kernel(float* dx, const float* dy, const float* x,
                                      const float* gamma, const float* mean, const float* invstd,
                                      const float* sums, int64_t n, int64_t channels, int64_t inner,
                                      float count) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t c = (i / inner) % channels;
    float xhat = (x[i] - mean[c]) * invstd[c];
    dx[i] = gamma[c] * invstd[c] * (dy[i] - sums[c] / count - xhat * (sums[channels + c] / count));
  }
}

struct BatchNormShape {
  int64_t batch, channels, inner;
};

BatchNormShape bn_shape(const Tensor& x) {
  int64_t batch = x.dim(0), channels = x.dim(1);
  int64_t inner = batch * channels == 0 ? 1 : x.numel() / (batch * channels);
  return {batch, channels, inner};
}

// ---- layer norm ----------------------------------------------------------------------------
// x (rows, d): one block per row.

// One row per block: x and y f32, f16 or bf16 (with_storage): read as f32, y rounded once.
template <class Y, class X>
__device__ void ln_forward_row(Y* yr, float* save_mean, float* save_rstd, const X* xr,
                               const float* gamma, const float* beta, int64_t d, float eps) {
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) s += to_float(xr[j]);
  float mean = block_reduce_sum(s) / static_cast<float>(d);
  float sq = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float t = to_float(xr[j]) - mean;
    sq += t * t;
  }
  float var = block_reduce_sum(sq) / static_cast<float>(d);
  float rstd = 1.f / sqrtf(var + eps);
  if (threadIdx.x == 0) {
    *save_mean = mean;
    *save_rstd = rstd;
  }
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    yr[j] = from_float<Y>((to_float(xr[j]) - mean) * rstd * gamma[j] + beta[j]);
}

template <class Y, class X>
__global__ void ln_forward_kernel(Y* y, float* save_mean, float* save_rstd, const X* x,
                                  const float* gamma, const float* beta, int64_t d, float eps) {
  int64_t row = blockIdx.x;
  ln_forward_row(y + row * d, save_mean + row, save_rstd + row, x + row * d, gamma, beta, d, eps);
}

// h = a + b rounded to H, then the row of ln_forward_kernel on h as stored. Each thread reads
// back only the elements it wrote, so no barrier is needed between the two.
template <class Y, class H>
__global__ void add_ln_forward_kernel(H* h, Y* y, float* save_mean, float* save_rstd, const H* a,
                                      const H* b, const float* gamma, const float* beta, int64_t d,
                                      float eps) {
  int64_t row = blockIdx.x;
  H* hr = h + row * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
    hr[j] = from_float<H>(to_float(a[row * d + j]) + to_float(b[row * d + j]));
  ln_forward_row(y + row * d, save_mean + row, save_rstd + row, hr, gamma, beta, d, eps);
}

// ---- layer norm over rows of a multiple of 8 values, in packs of eight -----------------
// GPT-2's rows (768 bf16 values) ran the kernels above at about a quarter of an H200's
// bandwidth (2026-11-29: 0.86 ms for 24 fused sums and norms, 0.85 ms for 25 backwards, of a
// 23 ms step): a thread read single 2-byte values, three times a row. Here each thread holds its
// packs of eight (q = threadIdx.x + i blockDim.x, i < kLnPacks) in registers, read once; the
// same formulas, the sums in another order (within the rounding the tests allow). Every row of
// d values, d a multiple of 8 up to 8 kLnPacks 256 (ln_wide), takes these kernels, whatever the
// dtypes and the alignment: the order of the sums depends on d alone, so a 16-bit x gives the
// bits of its widening (ops.hpp), and the fused sum + norm and backward + add give the separate
// ops' bits, for any operands. `vec` (every operand 16-byte aligned, and then so is every row:
// d values are a multiple of 16 bytes) only chooses how a pack is moved: one 16-byte access (two
// for f32), or eight, the same values.
constexpr int kLnPacks = 4;

// Whether the pack kernels serve a row of d values: d % 8 == 0, not too wide.
bool ln_wide(int64_t d) {
  return d % 8 == 0 && d / 8 <= int64_t{kLnPacks} * 256;
}
// Pack q of p (values 8q .. 8q + 7) as f32, and its store rounded to T: 16-byte accesses with
// `vec`, one value at a time otherwise.
template <class T>
__device__ __forceinline__ void load_pack(const T* p, int64_t q, float (&v)[8], bool vec) {
  if (vec) {
    load8_f32(p, q, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_float(p[q * 8 + k]);
}
template <class T>
__device__ __forceinline__ void store_pack(T* p, int64_t q, const float (&v)[8], bool vec) {
  if (vec) {
    store8_f32(p, q, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) p[q * 8 + k] = from_float<T>(v[k]);
}
// Threads per row for the eight-wide kernels: a pack each up to 256 packs.
int ln_wide_threads(int64_t d) {
  return row_block_threads(d / 8);
}

// f(i, q) for each of this thread's packs q = threadIdx.x + i blockDim.x below `packs`
// (i < kLnPacks, unrolled: the register arrays indexed by i stay registers).
template <class F>
__device__ __forceinline__ void for_each_pack(int64_t packs, F&& f) {
#pragma unroll
  for (int i = 0; i < kLnPacks; ++i) {
    const int64_t q = threadIdx.x + i * static_cast<int64_t>(blockDim.x);
    if (q < packs) f(i, q);
  }
}

// The row statistics and y of ln_forward_row from values held in registers (v[i]: pack
// threadIdx.x + i blockDim.x, valid below `packs`).
template <class Y>
__device__ void ln_forward_regs(Y* yr, float* save_mean, float* save_rstd,
                                const float (&v)[kLnPacks][8], int64_t packs, const float* gamma,
                                const float* beta, int64_t d, float eps, bool vec) {
  float s = 0.f;
  for_each_pack(packs, [&](int i, int64_t) {
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[i][k];
  });
  const float mean = block_reduce_sum(s) / static_cast<float>(d);
  float sq = 0.f;
  for_each_pack(packs, [&](int i, int64_t) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float t = v[i][k] - mean;
      sq += t * t;
    }
  });
  const float var = block_reduce_sum(sq) / static_cast<float>(d);
  const float rstd = 1.f / sqrtf(var + eps);
  if (threadIdx.x == 0) {
    *save_mean = mean;
    *save_rstd = rstd;
  }
  for_each_pack(packs, [&](int i, int64_t q) {
    float g[8], b[8], out[8];
    load_pack(gamma, q, g, vec);
    load_pack(beta, q, b, vec);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = (v[i][k] - mean) * rstd * g[k] + b[k];
    store_pack(yr, q, out, vec);
  });
}

template <class Y, class X>
__global__ void ln_forward8_kernel(Y* y, float* save_mean, float* save_rstd, const X* x,
                                   const float* gamma, const float* beta, int64_t d, float eps,
                                   bool vec) {
  const int64_t row = blockIdx.x, packs = d / 8;
  float v[kLnPacks][8];
  for_each_pack(packs, [&](int i, int64_t q) { load_pack(x + row * d, q, v[i], vec); });
  ln_forward_regs(y + row * d, save_mean + row, save_rstd + row, v, packs, gamma, beta, d, eps,
                  vec);
}

// h = a + b rounded to H and stored, then the norm of h as stored (its values kept in
// registers): ln_forward8_kernel's bits on add's output.
template <class Y, class H>
__global__ void add_ln_forward8_kernel(H* h, Y* y, float* save_mean, float* save_rstd, const H* a,
                                       const H* b, const float* gamma, const float* beta, int64_t d,
                                       float eps, bool vec) {
  const int64_t row = blockIdx.x, packs = d / 8;
  float v[kLnPacks][8];
  for_each_pack(packs, [&](int i, int64_t q) {
    float av[8], bv[8];
    load_pack(a + row * d, q, av, vec);
    load_pack(b + row * d, q, bv, vec);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[i][k] = to_float(from_float<H>(av[k] + bv[k]));
    store_pack(h + row * d, q, v[i], vec);  // exact: the values are H's already
  });
  ln_forward_regs(y + row * d, save_mean + row, save_rstd + row, v, packs, gamma, beta, d, eps,
                  vec);
}

// ln_backward_dx_kernel's formulas with the row's x and g = dy gamma held in registers.
template <class DX, class DY, class X>
__global__ void ln_backward_dx8_kernel(DX* dx, const DY* dy, const X* x, const float* gamma,
                                       const float* save_mean, const float* save_rstd, int64_t d,
                                       const DX* skip, bool vec) {
  const int64_t row = blockIdx.x, packs = d / 8;
  const float mean = save_mean[row], rstd = save_rstd[row];
  float xv[kLnPacks][8], gv[kLnPacks][8];
  float sum_g = 0.f, sum_g_xhat = 0.f;
  for_each_pack(packs, [&](int i, int64_t q) {
    float dyv[8], gam[8];
    load_pack(dy + row * d, q, dyv, vec);
    load_pack(gamma, q, gam, vec);
    load_pack(x + row * d, q, xv[i], vec);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float g = dyv[k] * gam[k];
      gv[i][k] = g;
      sum_g += g;
      sum_g_xhat += g * (xv[i][k] - mean) * rstd;
    }
  });
  const float mean_g = block_reduce_sum(sum_g) / static_cast<float>(d);
  const float mean_g_xhat = block_reduce_sum(sum_g_xhat) / static_cast<float>(d);
  for_each_pack(packs, [&](int i, int64_t q) {
    float sk[8], out[8];
    if (skip) load_pack(skip + row * d, q, sk, vec);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float xhat = (xv[i][k] - mean) * rstd;
      float v = rstd * (gv[i][k] - mean_g - xhat * mean_g_xhat);
      if (skip) v = __fadd_rn(sk[k], to_float(from_float<X>(v)));  // as ln_backward_dx_kernel
      out[k] = v;
    }
    store_pack(dx + row * d, q, out, vec);
  });
}

// With g = dy gamma and xhat = (x - mean) rstd, per row:
//   dx = rstd (g - mean(g) - xhat mean(g xhat)).
// dx, dy and x f32, f16 or bf16 (with_storage): read as f32, dx rounded once.
// With skip (layer_norm_backward_add): that value rounded to X, + skip, rounded to DX.
template <class DX, class DY, class X>
__global__ void ln_backward_dx_kernel(DX* dx, const DY* dy, const X* x, const float* gamma,
                                      const float* save_mean, const float* save_rstd, int64_t d,
                                      const DX* skip) {
  int64_t row = blockIdx.x;
  const X* xr = x + row * d;
  const DY* dyr = dy + row * d;
  DX* dxr = dx + row * d;
  float mean = save_mean[row], rstd = save_rstd[row];
  float sum_g = 0.f, sum_g_xhat = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float g = to_float(dyr[j]) * gamma[j];
    sum_g += g;
    sum_g_xhat += g * (to_float(xr[j]) - mean) * rstd;
  }
  float mean_g = block_reduce_sum(sum_g) / static_cast<float>(d);
  float mean_g_xhat = block_reduce_sum(sum_g_xhat) / static_cast<float>(d);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float xhat = (to_float(xr[j]) - mean) * rstd;
    float v = rstd * (to_float(dyr[j]) * gamma[j] - mean_g - xhat * mean_g_xhat);
    // __fadd_rn: never contracted with the product above into one FMA (for f32 X the rounding
    // to X is no rounding, and nvcc fused it, giving other bits than the separate add).
    if (skip) v = __fadd_rn(to_float(skip[row * d + j]), to_float(from_float<X>(v)));
    dxr[j] = from_float<DX>(v);
  }
}

// The column-sum operand of dgamma = sum_rows dy xhat and dbeta = sum_rows dy: (dy xhat, dy),
// both terms from one read of dy and x.
template <class DY, class X>
struct DgammaDbetaTerms {
  const DY* dy;
  const X* x;
  const float* mean;
  const float* rstd;
  int64_t d;
  __device__ float2 operator()(int64_t r, int64_t c) const {
    const float g = to_float(dy[r * d + c]);
    return make_float2(g * ((to_float(x[r * d + c]) - mean[r]) * rstd[r]), g);
  }
};

}  // namespace

void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps,
                              DeviceContext& ctx) {
  NvtxRange range("kernels/batch_norm_forward_train");
  require_f32("batch_norm_forward_train",
              {&y, &save_mean, &save_invstd, &running_mean, &running_var, &x, &gamma, &beta});
  BatchNormShape sh = bn_shape(x);
  // No elements: no statistics, and the running averages stay as they are.
  if (x.numel() == 0) return;
  cudaStream_t s = stream_of(ctx);
  int64_t count = sh.batch * sh.inner;
  auto* scratch = static_cast<float2*>(
      ctx.workspace(channel_sum_scratch_bytes(sh.batch, sh.channels, sh.inner)));
  float* mean = save_mean.data<float>();
  launch_channel_sums(sh.batch, sh.channels, sh.inner, ReadChannelValue{x.data<float>()},
                      SetMean{mean, static_cast<float>(count)}, scratch, s);
  launch_channel_sums(sh.batch, sh.channels, sh.inner, SquaredDeviation{x.data<float>(), mean},
                      SetVariance{save_invstd.data<float>(), running_mean.data<float>(),
                                  running_var.data<float>(), mean, count, momentum, eps},
                      scratch, s);
  int64_t n = x.numel();
  bn_normalize_kernel<<<blocks_for(n), kThreads, 0, s>>>(
      y.data<float>(), x.data<float>(), mean, save_invstd.data<float>(), gamma.data<float>(),
      beta.data<float>(), n, sh.channels, sh.inner);
  DP_CUDA_CHECK_LAUNCH();
}

void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps,
                             DeviceContext& ctx) {
  NvtxRange range("kernels/batch_norm_forward_eval");
  require_f32("batch_norm_forward_eval", {&y, &x, &gamma, &beta, &running_mean, &running_var});
  int64_t n = x.numel();
  if (n == 0) return;
  BatchNormShape sh = bn_shape(x);
  bn_forward_eval_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
      y.data<float>(), x.data<float>(), gamma.data<float>(), beta.data<float>(),
      running_mean.data<float>(), running_var.data<float>(), n, sh.channels, sh.inner, eps);
  DP_CUDA_CHECK_LAUNCH();
}

void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/batch_norm_backward");
  require_f32("batch_norm_backward",
              {&dx, &dgamma, &dbeta, &dy, &x, &gamma, &save_mean, &save_invstd});
  BatchNormShape sh = bn_shape(x);
  if (sh.channels == 0) return;
  // An empty batch still writes dgamma = dbeta = 0 (or leaves them when accumulating).
  cudaStream_t s = stream_of(ctx);
  size_t partial_bytes = channel_sum_scratch_bytes(sh.batch, sh.channels, sh.inner);
  size_t sums_offset = (partial_bytes + 255) / 256 * 256;
  char* ws = static_cast<char*>(ctx.workspace(sums_offset + sizeof(float) * 2 * sh.channels));
  auto* scratch = reinterpret_cast<float2*>(ws);
  auto* sums = reinterpret_cast<float*>(ws + sums_offset);
  launch_channel_sums(sh.batch, sh.channels, sh.inner,
                      DyAndDyXhat{dy.data<float>(), x.data<float>(), save_mean.data<float>(),
                                  save_invstd.data<float>()},
                      SetBnGrads{dgamma.data<float>(), dbeta.data<float>(), sums, sh.channels,
                                 acc == Accumulate::yes},
                      scratch, s);
  int64_t n = x.numel();
  if (n == 0) return;
  bn_backward_dx_kernel<<<blocks_for(n), kThreads, 0, s>>>(
      dx.data<float>(), dy.data<float>(), x.data<float>(), gamma.data<float>(),
      save_mean.data<float>(), save_invstd.data<float>(), sums, n, sh.channels, sh.inner,
      static_cast<float>(sh.batch * sh.inner));
  DP_CUDA_CHECK_LAUNCH();
}

void layer_norm_forward(Tensor& y, Tensor& save_mean, Tensor& save_rstd, const Tensor& x,
                        const Tensor& gamma, const Tensor& beta, float eps, DeviceContext& ctx) {
  NvtxRange range("kernels/layer_norm_forward");
  require_f32("layer_norm_forward", {&save_mean, &save_rstd, &gamma, &beta});
  require_floating("layer_norm_forward", {&y, &x});
  int64_t d = gamma.numel(), rows = d == 0 ? 0 : x.numel() / d;
  if (rows == 0) return;
  with_storage(
      [&](auto y_t, auto x_t) {
        using Y = decltype(y_t);
        using X = decltype(x_t);
        if (ln_wide(d))
          ln_forward8_kernel<<<static_cast<unsigned>(rows), ln_wide_threads(d), 0,
                               stream_of(ctx)>>>(
              y.data<Y>(), save_mean.data<float>(), save_rstd.data<float>(), x.data<X>(),
              gamma.data<float>(), beta.data<float>(), d, eps,
              aligned16(y.data<Y>(), x.data<X>(), gamma.data<float>(), beta.data<float>()));
        else
          ln_forward_kernel<<<static_cast<unsigned>(rows), row_block_threads(d), 0,
                              stream_of(ctx)>>>(y.data<Y>(), save_mean.data<float>(),
                                                save_rstd.data<float>(), x.data<X>(),
                                                gamma.data<float>(), beta.data<float>(), d, eps);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

namespace {
// layer_norm_backward, and with skip (of dx's dtype) layer_norm_backward_add.
void ln_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy, const Tensor* skip,
                 const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                 const Tensor& save_rstd, Accumulate acc, DeviceContext& ctx) {
  int64_t d = gamma.numel(), rows = d == 0 ? 0 : x.numel() / d;
  if (d == 0) return;
  cudaStream_t s = stream_of(ctx);
  bool accumulate = acc == Accumulate::yes;
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t) {
        using DX = decltype(dx_t);
        using DY = decltype(dy_t);
        using X = decltype(x_t);
        if (rows > 0) {
          const DX* sk = skip ? skip->data<DX>() : nullptr;
          if (ln_wide(d))
            ln_backward_dx8_kernel<<<static_cast<unsigned>(rows), ln_wide_threads(d), 0, s>>>(
                dx.data<DX>(), dy.data<DY>(), x.data<X>(), gamma.data<float>(),
                save_mean.data<float>(), save_rstd.data<float>(), d, sk,
                aligned16(dx.data<DX>(), dy.data<DY>(), x.data<X>(), gamma.data<float>(),
                          sk ? sk : dx.data<DX>()));
          else
            ln_backward_dx_kernel<<<static_cast<unsigned>(rows), row_block_threads(d), 0, s>>>(
                dx.data<DX>(), dy.data<DY>(), x.data<X>(), gamma.data<float>(),
                save_mean.data<float>(), save_rstd.data<float>(), d, sk);
          DP_CUDA_CHECK_LAUNCH();
        }
        // dgamma, dbeta: deterministic column sums over the rows, both from one pass (two
        // passes read dy twice and launched twice the kernels: 25 LayerNorms in a GPT-2 step).
        auto* scratch =
            static_cast<float2*>(ctx.workspace(sizeof(float2) * column_sum_chunks(rows) * d));
        launch_column_sums2(
            dgamma.data<float>(), dbeta.data<float>(), rows, d,
            DgammaDbetaTerms<DY, X>{dy.data<DY>(), x.data<X>(), save_mean.data<float>(),
                                    save_rstd.data<float>(), d},
            accumulate, scratch, s);
      },
      dx.dtype(), dy.dtype(), x.dtype());
}
}  // namespace

void layer_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_rstd, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/layer_norm_backward");
  require_f32("layer_norm_backward", {&dgamma, &dbeta, &gamma, &save_mean, &save_rstd});
  require_floating("layer_norm_backward", {&dx, &dy, &x});
  ln_backward(dx, dgamma, dbeta, dy, nullptr, x, gamma, save_mean, save_rstd, acc, ctx);
}

void layer_norm_backward_add(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                             const Tensor& dskip, const Tensor& x, const Tensor& gamma,
                             const Tensor& save_mean, const Tensor& save_rstd, Accumulate acc,
                             DeviceContext& ctx) {
  NvtxRange range("kernels/layer_norm_backward_add");
  require_f32("layer_norm_backward_add", {&dgamma, &dbeta, &gamma, &save_mean, &save_rstd});
  require_floating("layer_norm_backward_add", {&dx, &dy, &x, &dskip});
  ln_backward(dx, dgamma, dbeta, dy, &dskip, x, gamma, save_mean, save_rstd, acc, ctx);
}

void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& save_mean, Tensor& save_rstd,
                            const Tensor& a, const Tensor& b, const Tensor& gamma,
                            const Tensor& beta, float eps, DeviceContext& ctx) {
  NvtxRange range("kernels/add_layer_norm_forward");
  require_f32("add_layer_norm_forward", {&save_mean, &save_rstd, &gamma, &beta});
  require_floating("add_layer_norm_forward", {&h, &y, &a, &b});
  int64_t d = gamma.numel(), rows = d == 0 ? 0 : h.numel() / d;
  if (rows == 0) return;
  with_storage(
      [&](auto y_t, auto h_t) {
        using H = decltype(h_t);
        using Y = decltype(y_t);
        if (ln_wide(d))
          add_ln_forward8_kernel<<<static_cast<unsigned>(rows), ln_wide_threads(d), 0,
                                   stream_of(ctx)>>>(
              h.data<H>(), y.data<Y>(), save_mean.data<float>(), save_rstd.data<float>(),
              a.data<H>(), b.data<H>(), gamma.data<float>(), beta.data<float>(), d, eps,
              aligned16(h.data<H>(), y.data<Y>(), a.data<H>(), b.data<H>(), gamma.data<float>(),
                        beta.data<float>()));
        else
          add_ln_forward_kernel<<<static_cast<unsigned>(rows), row_block_threads(d), 0,
                                  stream_of(ctx)>>>(
              h.data<H>(), y.data<Y>(), save_mean.data<float>(), save_rstd.data<float>(),
              a.data<H>(), b.data<H>(), gamma.data<float>(), beta.data<float>(), d, eps);
      },
      y.dtype(), h.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
