// The broadcasting op set (kernels/tensor_ops.hpp) on CUDA: elementwise unary ops, binary ops
// and `where` over broadcast operands, their gradients summed over the broadcast dims, reductions
// and softmax over the middle dim of (outer, n, inner), and strided copies. Every tensor f32, f16
// or bf16 (with_storage): read as f32, computed in f32, each stored value rounded once. Sums add
// in an order fixed by the shape, so the same bits every run: a thread's sum over a whole row in
// order in double (the CPU's order and accumulator), a block's (long rows) in f32 partials and
// block_reduce_sum. Formulas mirror kernels/cpu/tensor_ops.cpp; the front end
// (kernels/tensor_ops.cpp) checks the arguments and resolves broadcasting into Layouts, so these
// functions assume valid, non-empty outputs.
#include <array>
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"

namespace kernels::cuda {

namespace {

// ---- index spaces --------------------------------------------------------------------------
// K operands' element offsets over one row-major index space: a linear index i decomposes into
// coordinates c (dims outermost first) and operand k's element is offset[k] + sum_d c_d
// stride[k][d]. Built on the host from Layouts with dims of size 1 dropped and adjacent dims
// merged where every operand allows it, so a lookup costs one division per remaining dim.
template <int K>
struct Indexer {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[K][kMaxDims] = {};
  int64_t offset[K] = {};

  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  // requires 0 <= i < numel(). ensures at[k] = operand k's element at linear index i.
  __device__ __forceinline__ void locate(int64_t i, int64_t (&at)[K]) const {
#pragma unroll
    for (int k = 0; k < K; ++k) at[k] = offset[k];
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d >= ndim) continue;
      int64_t c = i;
      if (d > 0) {
        c = i % shape[d];
        i /= shape[d];
      }
#pragma unroll
      for (int k = 0; k < K; ++k) at[k] += c * stride[k][d];
    }
  }
};

constexpr uint32_t kAllDims = ~0u;

// requires the Layouts' shapes equal once aligned at their last dim (missing leading dims are
// of size 1). ensures the Indexer of their common index space restricted to the dims whose bit
// is set in `dims` (bit j: the j-th dim from the last), with each Layout's offset, or 0 when
// `with_offsets` is false.
template <int K>
Indexer<K> make_indexer(const std::array<const Layout*, K>& views, uint32_t dims = kAllDims,
                        bool with_offsets = true) {
  const Layout* widest = views[0];
  for (const Layout* v : views)
    if (v->ndim > widest->ndim) widest = v;
  const int nd = widest->ndim;
  Indexer<K> ix;
  for (int k = 0; k < K; ++k) ix.offset[k] = with_offsets ? views[k]->offset : 0;
  for (int d = 0; d < nd; ++d) {
    const int64_t size = widest->shape[d];
    if (!((dims >> (nd - 1 - d)) & 1u) || size == 1) continue;
    int64_t s[K];
    for (int k = 0; k < K; ++k) {
      const int dk = d - (nd - views[k]->ndim);
      s[k] = dk >= 0 ? views[k]->stride[dk] : 0;
    }
    // Merged into the previous kept dim when, for every operand, stepping that dim by one is
    // stepping this one `size` times.
    bool merge = ix.ndim > 0;
    for (int k = 0; k < K && merge; ++k) merge = ix.stride[k][ix.ndim - 1] == s[k] * size;
    const int at = merge ? ix.ndim - 1 : ix.ndim++;
    ix.shape[at] = merge ? ix.shape[at] * size : size;
    for (int k = 0; k < K; ++k) ix.stride[k][at] = s[k];
  }
  return ix;
}

// The contiguous row-major layout of `like`'s shape.
Layout row_major(const Layout& like) {
  Layout l;
  l.ndim = like.ndim;
  int64_t s = 1;
  for (int d = like.ndim - 1; d >= 0; --d) {
    l.shape[d] = like.shape[d];
    l.stride[d] = s;
    s *= like.shape[d];
  }
  return l;
}

// Bit j set where the j-th dim from the last of dy's index space is summed over: the gradient's
// stride is 0 there and dy's size above 1.
uint32_t summed_dims(const Layout& d_in_dy) {
  uint32_t m = 0;
  for (int d = 0; d < d_in_dy.ndim; ++d)
    if (d_in_dy.stride[d] == 0 && d_in_dy.shape[d] > 1) m |= 1u << (d_in_dy.ndim - 1 - d);
  return m;
}

// Grid of a kernel giving one block to each of `rows` rows (capped; its loop covers the rest).
unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>(rows < 65535 * 8 ? rows : 65535 * 8);
}

// A block's rows of a kernel giving one block to each row: blockIdx.x, then a grid further on.
#define DP_BLOCK_STRIDE_LOOP(row, rows) \
  for (int64_t row = blockIdx.x; row < (rows); row += gridDim.x)

template <class T>
__device__ __forceinline__ void store_to(T* p, float v, bool accumulate) {
  *p = from_float<T>(accumulate ? to_float(*p) + v : v);
}

// max and min that propagate NaN.
__device__ __forceinline__ float nan_max(float u, float v) {
  return (u > v || u != u) ? u : v;
}
__device__ __forceinline__ float nan_min(float u, float v) {
  return (u < v || u != u) ? u : v;
}

// ---- unary ---------------------------------------------------------------------------------
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

__device__ __forceinline__ float sigmoid_of(float v) {
  return 1.f / (1.f + expf(-v));  // 0 for v below about -88 (expf(-v) is inf), as on the CPU
}

__device__ __forceinline__ float unary_value(UnaryOp op, UnaryParams p, float v) {
  switch (op) {
    case UnaryOp::identity:
      return v;
    case UnaryOp::affine:
      return p.a * v + p.b;
    case UnaryOp::exp:
      return expf(v);
    case UnaryOp::log:
      return logf(v);
    case UnaryOp::sqrt:
      return sqrtf(v);
    case UnaryOp::rsqrt:
      return 1.f / sqrtf(v);
    case UnaryOp::reciprocal:
      return 1.f / v;
    case UnaryOp::neg:
      return -v;
    case UnaryOp::abs:
      return fabsf(v);
    case UnaryOp::pow:
      return powf(v, p.a);
    case UnaryOp::sigmoid:
      return sigmoid_of(v);
    case UnaryOp::tanh:
      return tanhf(v);
    case UnaryOp::silu:
      return v * sigmoid_of(v);
    case UnaryOp::gelu_erf:
      return 0.5f * v * (1.f + erff(v * kInvSqrt2));
    case UnaryOp::gelu_tanh:
      return gelu_tanh_of(v);
    case UnaryOp::relu:  // NaN stays NaN, as in torch.relu
      return (v > 0.f || v != v) ? v : 0.f;
  }
  return v;
}

// op'(x), from the forward input v or output u as each op needs.
__device__ __forceinline__ float unary_derivative(UnaryOp op, UnaryParams p, float v, float u) {
  switch (op) {
    case UnaryOp::identity:
      return 1.f;
    case UnaryOp::affine:
      return p.a;
    case UnaryOp::exp:
      return u;
    case UnaryOp::log:
      return 1.f / v;
    case UnaryOp::sqrt:
      return 0.5f / u;
    case UnaryOp::rsqrt:
      return -0.5f * u * u * u;
    case UnaryOp::reciprocal:
      return -u * u;
    case UnaryOp::neg:
      return -1.f;
    case UnaryOp::abs:
      return v > 0.f ? 1.f : (v < 0.f ? -1.f : 0.f);
    case UnaryOp::pow:
      return p.a == 0.f ? 0.f : p.a * powf(v, p.a - 1.f);  // x^0: 0 at v = 0 too
    case UnaryOp::sigmoid:
      return u * (1.f - u);
    case UnaryOp::tanh:
      return 1.f - u * u;
    case UnaryOp::silu: {
      const float s = sigmoid_of(v);
      return s * (1.f + v * (1.f - s));
    }
    case UnaryOp::gelu_erf:
      return 0.5f * (1.f + erff(v * kInvSqrt2)) + v * kInvSqrt2Pi * expf(-0.5f * v * v);
    case UnaryOp::gelu_tanh:
      return gelu_tanh_derivative(v);
    case UnaryOp::relu:
      return v > 0.f ? 1.f : 0.f;
  }
  return 0.f;
}

// Which operand unary_derivative reads: the forward's output (true) or input.
bool derivative_reads_output(UnaryOp op) {
  switch (op) {
    case UnaryOp::exp:
    case UnaryOp::sqrt:
    case UnaryOp::rsqrt:
    case UnaryOp::reciprocal:
    case UnaryOp::sigmoid:
    case UnaryOp::tanh:
      return true;
    default:
      return false;
  }
}
bool derivative_reads_input(UnaryOp op) {
  switch (op) {
    case UnaryOp::log:
    case UnaryOp::abs:
    case UnaryOp::pow:
    case UnaryOp::silu:
    case UnaryOp::gelu_erf:
    case UnaryOp::gelu_tanh:
    case UnaryOp::relu:
      return true;
    default:
      return false;
  }
}

template <class Y, class X>
__global__ void unary_kernel(Y* y, const X* x, int64_t n, UnaryOp op, UnaryParams p) {
  DP_GRID_STRIDE_LOOP(i, n) y[i] = from_float<Y>(unary_value(op, p, to_float(x[i])));
}

// x or y is null where the op does not read it.
template <class DX, class DY, class X, class Y>
__global__ void unary_backward_kernel(DX* dx, const DY* dy, const X* x, const Y* y, int64_t n,
                                      UnaryOp op, UnaryParams p, bool accumulate) {
  DP_GRID_STRIDE_LOOP(i, n) {
    const float v = x ? to_float(x[i]) : 0.f, u = y ? to_float(y[i]) : 0.f;
    store_to(dx + i, to_float(dy[i]) * unary_derivative(op, p, v, u), accumulate);
  }
}

// ---- binary and where ----------------------------------------------------------------------
__device__ __forceinline__ float binary_value(BinaryOp op, float u, float v) {
  switch (op) {
    case BinaryOp::add:
      return u + v;
    case BinaryOp::sub:
      return u - v;
    case BinaryOp::mul:
      return u * v;
    case BinaryOp::div:
      return u / v;
    case BinaryOp::maximum:
      return nan_max(u, v);
    case BinaryOp::minimum:
      return nan_min(u, v);
  }
  return 0.f;
}

// y[i] = a op b at y's linear index i; ix: (a, b).
template <class Y, class A, class B>
__global__ void binary_kernel(Y* y, const A* a, const B* b, Indexer<2> ix, int64_t n, BinaryOp op) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t at[2];
    ix.locate(i, at);
    y[i] = from_float<Y>(binary_value(op, to_float(a[at[0]]), to_float(b[at[1]])));
  }
}

// g times the partial derivative of (a op b) by a (by_b false) or b; a and b are read only by
// the ops whose partial needs them. maximum and minimum select g (0 * inf is never formed).
template <class A, class B>
__device__ __forceinline__ float binary_term(BinaryOp op, bool by_b, float g, const A* a,
                                             const B* b) {
  switch (op) {
    case BinaryOp::add:
      return g;
    case BinaryOp::sub:
      return by_b ? -g : g;
    case BinaryOp::mul:
      return g * (by_b ? to_float(*a) : to_float(*b));
    case BinaryOp::div: {
      const float v = to_float(*b);
      return g * (by_b ? -to_float(*a) / (v * v) : 1.f / v);
    }
    case BinaryOp::maximum:
      return ((to_float(*a) >= to_float(*b)) != by_b) ? g : 0.f;
    case BinaryOp::minimum:
      return ((to_float(*a) <= to_float(*b)) != by_b) ? g : 0.f;
  }
  return 0.f;
}

// One operand's gradient: d[e] (+)= sum over the summed space of binary_term at dy's element.
// kept: (d, dy, a, b) over d's elements; summed: (dy, a, b) over the dims summed over (no
// offsets). Per element of d, one thread (small sums) or one block (large sums) each.
struct BinaryGradArgs {
  Indexer<4> kept;
  Indexer<3> summed;
  int64_t n_d, n_sum;
  BinaryOp op;
  bool by_b, accumulate;
};

template <class A, class B, class DY>
__device__ __forceinline__ float binary_grad_term(const BinaryGradArgs& g, const DY* dy, const A* a,
                                                  const B* b, const int64_t (&base)[4], int64_t r) {
  int64_t at[3];
  g.summed.locate(r, at);
  return binary_term(g.op, g.by_b, to_float(dy[base[1] + at[0]]), a + base[2] + at[1],
                     b + base[3] + at[2]);
}

template <class D, class DY, class A, class B>
__global__ void binary_grad_thread_kernel(D* d, const DY* dy, const A* a, const B* b,
                                          BinaryGradArgs g) {
  DP_GRID_STRIDE_LOOP(e, g.n_d) {
    int64_t base[4];
    g.kept.locate(e, base);
    double s = 0.0;
    for (int64_t r = 0; r < g.n_sum; ++r) s += binary_grad_term(g, dy, a, b, base, r);
    store_to(d + base[0], static_cast<float>(s), g.accumulate);
  }
}

template <class D, class DY, class A, class B>
__global__ void binary_grad_block_kernel(D* d, const DY* dy, const A* a, const B* b,
                                         BinaryGradArgs g) {
  DP_BLOCK_STRIDE_LOOP(e, g.n_d) {
    int64_t base[4];
    g.kept.locate(e, base);
    float s = 0.f;
    for (int64_t r = threadIdx.x; r < g.n_sum; r += blockDim.x)
      s += binary_grad_term(g, dy, a, b, base, r);
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) store_to(d + base[0], s, g.accumulate);
  }
}

// Above this many summed elements per gradient element, a block sums each.
constexpr int64_t kBlockSumThreshold = 1024;

// y[i] = mask != 0 ? a : b; ix: (mask, a, b).
template <class Y, class M, class A, class B>
__global__ void where_kernel(Y* y, const M* mask, const A* a, const B* b, Indexer<3> ix,
                             int64_t n) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t at[3];
    ix.locate(i, at);
    y[i] = from_float<Y>(to_float(mask[at[0]]) != 0.f ? to_float(a[at[1]]) : to_float(b[at[2]]));
  }
}

// As binary's gradient: kept (d, dy, mask), summed (dy, mask); dy where the mask selects the
// operand (mask != 0 for a, == 0 for b).
struct WhereGradArgs {
  Indexer<3> kept;
  Indexer<2> summed;
  int64_t n_d, n_sum;
  bool by_b, accumulate;
};

template <class DY, class M>
__device__ __forceinline__ float where_grad_term(const WhereGradArgs& g, const DY* dy,
                                                 const M* mask, const int64_t (&base)[3],
                                                 int64_t r) {
  int64_t at[2];
  g.summed.locate(r, at);
  const bool selects_a = to_float(mask[base[2] + at[1]]) != 0.f;
  return selects_a != g.by_b ? to_float(dy[base[1] + at[0]]) : 0.f;
}

template <class D, class DY, class M>
__global__ void where_grad_thread_kernel(D* d, const DY* dy, const M* mask, WhereGradArgs g) {
  DP_GRID_STRIDE_LOOP(e, g.n_d) {
    int64_t base[3];
    g.kept.locate(e, base);
    double s = 0.0;
    for (int64_t r = 0; r < g.n_sum; ++r) s += where_grad_term(g, dy, mask, base, r);
    store_to(d + base[0], static_cast<float>(s), g.accumulate);
  }
}

template <class D, class DY, class M>
__global__ void where_grad_block_kernel(D* d, const DY* dy, const M* mask, WhereGradArgs g) {
  DP_BLOCK_STRIDE_LOOP(e, g.n_d) {
    int64_t base[3];
    g.kept.locate(e, base);
    float s = 0.f;
    for (int64_t r = threadIdx.x; r < g.n_sum; r += blockDim.x)
      s += where_grad_term(g, dy, mask, base, r);
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) store_to(d + base[0], s, g.accumulate);
  }
}

// ---- reductions and softmax over the middle dim of (outer, n, inner) -----------------------
// A row is the n elements of one (outer, inner) pair, `inner` apart. Rows of contiguous
// elements (inner == 1) of at least kRowBlockMin get a block each (row_block_threads(n)
// threads, coalesced); other shapes a thread per row (coalesced across the inner index).
constexpr int64_t kRowBlockMin = 64;

bool block_per_row(int64_t n, int64_t inner) {
  return inner == 1 && n >= kRowBlockMin;
}

// Max over the block, returned to every thread; NaN propagates.
__device__ __forceinline__ float block_reduce_nan_max(float v) {
  __shared__ float warp_part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // a previous call may still be reading warp_part
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  v = lane < n_warps ? warp_part[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Thread per row.
template <class Y, class X>
__global__ void reduce_thread_kernel(Y* y, const X* x, int64_t outer, int64_t n, int64_t inner,
                                     ReduceOp op) {
  DP_GRID_STRIDE_LOOP(k, outer * inner) {
    const int64_t o = k / inner, i = k - o * inner;
    const X* xr = x + o * n * inner + i;
    float v;
    if (op == ReduceOp::max) {
      v = -INFINITY;
      for (int64_t j = 0; j < n; ++j) v = nan_max(v, to_float(xr[j * inner]));
    } else {
      double s = 0.0;
      for (int64_t j = 0; j < n; ++j) s += to_float(xr[j * inner]);
      v = static_cast<float>(op == ReduceOp::mean ? s / static_cast<double>(n) : s);
    }
    y[k] = from_float<Y>(v);
  }
}

// Block per contiguous row.
template <class Y, class X>
__global__ void reduce_block_kernel(Y* y, const X* x, int64_t rows, int64_t n, ReduceOp op) {
  DP_BLOCK_STRIDE_LOOP(row, rows) {
    const X* xr = x + row * n;
    float v;
    if (op == ReduceOp::max) {
      v = -INFINITY;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v = nan_max(v, to_float(xr[j]));
      v = block_reduce_nan_max(v);
    } else {
      v = 0.f;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) v += to_float(xr[j]);
      v = block_reduce_sum(v);
      if (op == ReduceOp::mean) v /= static_cast<float>(n);
    }
    if (threadIdx.x == 0) y[row] = from_float<Y>(v);
  }
}

// dx[o, j, i] (+)= dy[o, i] (sum), dy[o, i] (1 / n) (mean), or dy[o, i] where x == y (max; x and
// y null for sum and mean).
template <class DX, class DY, class X, class Y>
__global__ void reduce_backward_kernel(DX* dx, const DY* dy, const X* x, const Y* y, int64_t total,
                                       int64_t n, int64_t inner, ReduceOp op, bool accumulate) {
  DP_GRID_STRIDE_LOOP(k, total) {
    const int64_t i = k % inner, o = k / (n * inner), at = o * inner + i;
    float g = to_float(dy[at]);
    if (op == ReduceOp::mean) g *= 1.f / static_cast<float>(n);
    if (op == ReduceOp::max) g = to_float(x[k]) == to_float(y[at]) ? g : 0.f;
    store_to(dx + k, g, accumulate);
  }
}

// Softmax: y = e^(x - max) / sum e^(x - max); log-softmax: y = x - max - log(sum e^(x - max)).
template <class Y, class X>
__global__ void softmax_thread_kernel(Y* y, const X* x, int64_t outer, int64_t n, int64_t inner,
                                      Softmax kind) {
  DP_GRID_STRIDE_LOOP(k, outer * inner) {
    const int64_t o = k / inner, i = k - o * inner, base = o * n * inner + i;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = fmaxf(m, to_float(x[base + j * inner]));
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) s += expf(to_float(x[base + j * inner]) - m);
    const float log_s = static_cast<float>(log(s)), inv_s = static_cast<float>(1.0 / s);
    for (int64_t j = 0; j < n; ++j) {
      const float v = to_float(x[base + j * inner]) - m;
      y[base + j * inner] = from_float<Y>(kind == Softmax::softmax ? expf(v) * inv_s : v - log_s);
    }
  }
}

template <class Y, class X>
__global__ void softmax_block_kernel(Y* y, const X* x, int64_t rows, int64_t n, Softmax kind) {
  DP_BLOCK_STRIDE_LOOP(row, rows) {
    const X* xr = x + row * n;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, to_float(xr[j]));
    m = block_reduce_max(m);
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += expf(to_float(xr[j]) - m);
    s = block_reduce_sum(s);
    const float log_s = logf(s), inv_s = 1.f / s;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float v = to_float(xr[j]) - m;
      y[row * n + j] = from_float<Y>(kind == Softmax::softmax ? expf(v) * inv_s : v - log_s);
    }
  }
}

// Softmax: dx (+)= y (dy - sum dy y); log-softmax: dx (+)= dy - e^y sum dy.
__device__ __forceinline__ float softmax_grad(Softmax kind, float g, float u, float sum) {
  return kind == Softmax::softmax ? u * (g - sum) : g - expf(u) * sum;
}

template <class DX, class DY, class Y>
__global__ void softmax_backward_thread_kernel(DX* dx, const DY* dy, const Y* y, int64_t outer,
                                               int64_t n, int64_t inner, Softmax kind,
                                               bool accumulate) {
  DP_GRID_STRIDE_LOOP(k, outer * inner) {
    const int64_t o = k / inner, i = k - o * inner, base = o * n * inner + i;
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double g = to_float(dy[base + j * inner]);
      s += kind == Softmax::softmax ? g * to_float(y[base + j * inner]) : g;
    }
    const float sum = static_cast<float>(s);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = base + j * inner;
      store_to(dx + at, softmax_grad(kind, to_float(dy[at]), to_float(y[at]), sum), accumulate);
    }
  }
}

template <class DX, class DY, class Y>
__global__ void softmax_backward_block_kernel(DX* dx, const DY* dy, const Y* y, int64_t rows,
                                              int64_t n, Softmax kind, bool accumulate) {
  DP_BLOCK_STRIDE_LOOP(row, rows) {
    const int64_t base = row * n;
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float g = to_float(dy[base + j]);
      sum += kind == Softmax::softmax ? g * to_float(y[base + j]) : g;
    }
    sum = block_reduce_sum(sum);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      store_to(dx + base + j,
               softmax_grad(kind, to_float(dy[base + j]), to_float(y[base + j]), sum), accumulate);
  }
}

// ---- strided copy --------------------------------------------------------------------------
// ix: (dst, src). The dst view writes no element twice: one thread per element.
template <class D, class S>
__global__ void strided_copy_kernel(D* dst, const S* src, Indexer<2> ix, int64_t n,
                                    bool accumulate) {
  DP_GRID_STRIDE_LOOP(i, n) {
    int64_t at[2];
    ix.locate(i, at);
    store_to(dst + at[0], to_float(src[at[1]]), accumulate);
  }
}

}  // namespace

void unary(Tensor& y, const Tensor& x, UnaryOp op, UnaryParams p, DeviceContext& ctx) {
  NvtxRange range("kernels/unary");
  require_floating("unary", {&y, &x});
  const int64_t n = y.numel();
  with_storage(
      [&](auto y_t, auto x_t) {
        unary_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), x.data<decltype(x_t)>(), n, op, p);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void unary_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, UnaryOp op,
                    UnaryParams p, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/unary_backward");
  require_floating("unary_backward", {&dx, &dy, &x, &y});
  const int64_t n = dx.numel();
  const bool reads_x = derivative_reads_input(op), reads_y = derivative_reads_output(op);
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        using X = decltype(x_t);
        using Y = decltype(y_t);
        unary_backward_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            dx.data<decltype(dx_t)>(), dy.data<decltype(dy_t)>(),
            reads_x ? x.data<X>() : static_cast<const X*>(nullptr),
            reads_y ? y.data<Y>() : static_cast<const Y*>(nullptr), n, op, p,
            acc == Accumulate::yes);
      },
      dx.dtype(), dy.dtype(), x.dtype(), y.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void binary(Tensor& y, const Tensor& a, const Layout& a_in_y, const Tensor& b, const Layout& b_in_y,
            BinaryOp op, DeviceContext& ctx) {
  NvtxRange range("kernels/binary");
  require_floating("binary", {&y, &a, &b});
  const int64_t n = y.numel();
  const Indexer<2> ix = make_indexer<2>({&a_in_y, &b_in_y});
  with_storage(
      [&](auto y_t, auto a_t, auto b_t) {
        binary_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), a.data<decltype(a_t)>(), b.data<decltype(b_t)>(), ix, n, op);
      },
      y.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void binary_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                     const Tensor& a, const Layout& a_in_dy, const Tensor& b, const Layout& b_in_dy,
                     BinaryOp op, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/binary_backward");
  require_floating("binary_backward", {&d, &dy, &a, &b});
  const Layout dy_in_dy = row_major(d_in_dy);
  const uint32_t summed = summed_dims(d_in_dy);
  BinaryGradArgs g;
  g.kept = make_indexer<4>({&d_in_dy, &dy_in_dy, &a_in_dy, &b_in_dy}, ~summed);
  g.summed = make_indexer<3>({&dy_in_dy, &a_in_dy, &b_in_dy}, summed, false);
  g.n_d = g.kept.numel();
  g.n_sum = g.summed.numel();
  g.op = op;
  g.by_b = which == Operand::b;
  g.accumulate = acc == Accumulate::yes;
  if (g.n_d != d.numel())
    DP_THROW("binary_backward: the gradient's layout keeps "
             << g.n_d << " elements of dy, the gradient is " << d);
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto d_t, auto dy_t, auto a_t, auto b_t) {
        auto* dp = d.data<decltype(d_t)>();
        const auto* dyp = dy.data<decltype(dy_t)>();
        const auto* ap = a.data<decltype(a_t)>();
        const auto* bp = b.data<decltype(b_t)>();
        if (g.n_sum > kBlockSumThreshold)
          binary_grad_block_kernel<<<row_blocks(g.n_d), kThreads, 0, s>>>(dp, dyp, ap, bp, g);
        else
          binary_grad_thread_kernel<<<blocks_for(g.n_d), kThreads, 0, s>>>(dp, dyp, ap, bp, g);
      },
      d.dtype(), dy.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void where(Tensor& y, const Tensor& mask, const Layout& mask_in_y, const Tensor& a,
           const Layout& a_in_y, const Tensor& b, const Layout& b_in_y, DeviceContext& ctx) {
  NvtxRange range("kernels/where");
  require_floating("where", {&y, &mask, &a, &b});
  const int64_t n = y.numel();
  const Indexer<3> ix = make_indexer<3>({&mask_in_y, &a_in_y, &b_in_y});
  with_storage(
      [&](auto y_t, auto m_t, auto a_t, auto b_t) {
        where_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            y.data<decltype(y_t)>(), mask.data<decltype(m_t)>(), a.data<decltype(a_t)>(),
            b.data<decltype(b_t)>(), ix, n);
      },
      y.dtype(), mask.dtype(), a.dtype(), b.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void where_backward(Tensor& d, const Layout& d_in_dy, Operand which, const Tensor& dy,
                    const Tensor& mask, const Layout& mask_in_dy, Accumulate acc,
                    DeviceContext& ctx) {
  NvtxRange range("kernels/where_backward");
  require_floating("where_backward", {&d, &dy, &mask});
  const Layout dy_in_dy = row_major(d_in_dy);
  const uint32_t summed = summed_dims(d_in_dy);
  WhereGradArgs g;
  g.kept = make_indexer<3>({&d_in_dy, &dy_in_dy, &mask_in_dy}, ~summed);
  g.summed = make_indexer<2>({&dy_in_dy, &mask_in_dy}, summed, false);
  g.n_d = g.kept.numel();
  g.n_sum = g.summed.numel();
  g.by_b = which == Operand::b;
  g.accumulate = acc == Accumulate::yes;
  if (g.n_d != d.numel())
    DP_THROW("where_backward: the gradient's layout keeps "
             << g.n_d << " elements of dy, the gradient is " << d);
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto d_t, auto dy_t, auto m_t) {
        auto* dp = d.data<decltype(d_t)>();
        const auto* dyp = dy.data<decltype(dy_t)>();
        const auto* mp = mask.data<decltype(m_t)>();
        if (g.n_sum > kBlockSumThreshold)
          where_grad_block_kernel<<<row_blocks(g.n_d), kThreads, 0, s>>>(dp, dyp, mp, g);
        else
          where_grad_thread_kernel<<<blocks_for(g.n_d), kThreads, 0, s>>>(dp, dyp, mp, g);
      },
      d.dtype(), dy.dtype(), mask.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void reduce(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, ReduceOp op,
            DeviceContext& ctx) {
  NvtxRange range("kernels/reduce");
  require_floating("reduce", {&y, &x});
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto y_t, auto x_t) {
        auto* yp = y.data<decltype(y_t)>();
        const auto* xp = x.data<decltype(x_t)>();
        if (block_per_row(n, inner))
          reduce_block_kernel<<<row_blocks(outer), row_block_threads(n), 0, s>>>(yp, xp, outer, n,
                                                                                 op);
        else
          reduce_thread_kernel<<<blocks_for(outer * inner), kThreads, 0, s>>>(yp, xp, outer, n,
                                                                              inner, op);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void reduce_backward(Tensor& dx, const Tensor& dy, const Tensor& x, const Tensor& y, int64_t outer,
                     int64_t n, int64_t inner, ReduceOp op, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/reduce_backward");
  const bool reads_xy = op == ReduceOp::max;
  require_floating("reduce_backward", {&dx, &dy});
  if (reads_xy) require_floating("reduce_backward", {&x, &y});
  const int64_t total = outer * n * inner;
  with_storage(
      [&](auto dx_t, auto dy_t, auto x_t, auto y_t) {
        using X = decltype(x_t);
        using Y = decltype(y_t);
        reduce_backward_kernel<<<blocks_for(total), kThreads, 0, stream_of(ctx)>>>(
            dx.data<decltype(dx_t)>(), dy.data<decltype(dy_t)>(),
            reads_xy ? x.data<X>() : static_cast<const X*>(nullptr),
            reads_xy ? y.data<Y>() : static_cast<const Y*>(nullptr), total, n, inner, op,
            acc == Accumulate::yes);
      },
      dx.dtype(), dy.dtype(), reads_xy ? x.dtype() : dx.dtype(), reads_xy ? y.dtype() : dx.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void softmax(Tensor& y, const Tensor& x, int64_t outer, int64_t n, int64_t inner, Softmax kind,
             DeviceContext& ctx) {
  NvtxRange range("kernels/softmax");
  require_floating("softmax", {&y, &x});
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto y_t, auto x_t) {
        auto* yp = y.data<decltype(y_t)>();
        const auto* xp = x.data<decltype(x_t)>();
        if (block_per_row(n, inner))
          softmax_block_kernel<<<row_blocks(outer), row_block_threads(n), 0, s>>>(yp, xp, outer, n,
                                                                                  kind);
        else
          softmax_thread_kernel<<<blocks_for(outer * inner), kThreads, 0, s>>>(yp, xp, outer, n,
                                                                               inner, kind);
      },
      y.dtype(), x.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void softmax_backward(Tensor& dx, const Tensor& dy, const Tensor& y, int64_t outer, int64_t n,
                      int64_t inner, Softmax kind, Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/softmax_backward");
  require_floating("softmax_backward", {&dx, &dy, &y});
  const bool accumulate = acc == Accumulate::yes;
  cudaStream_t s = stream_of(ctx);
  with_storage(
      [&](auto dx_t, auto dy_t, auto y_t) {
        auto* dxp = dx.data<decltype(dx_t)>();
        const auto* dyp = dy.data<decltype(dy_t)>();
        const auto* yp = y.data<decltype(y_t)>();
        if (block_per_row(n, inner))
          softmax_backward_block_kernel<<<row_blocks(outer), row_block_threads(n), 0, s>>>(
              dxp, dyp, yp, outer, n, kind, accumulate);
        else
          softmax_backward_thread_kernel<<<blocks_for(outer * inner), kThreads, 0, s>>>(
              dxp, dyp, yp, outer, n, inner, kind, accumulate);
      },
      dx.dtype(), dy.dtype(), y.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

void strided_copy(Tensor& dst, const Layout& dst_view, const Tensor& src, const Layout& src_view,
                  Accumulate acc, DeviceContext& ctx) {
  NvtxRange range("kernels/strided_copy");
  require_floating("strided_copy", {&dst, &src});
  const Indexer<2> ix = make_indexer<2>({&dst_view, &src_view});
  const int64_t n = ix.numel();
  with_storage(
      [&](auto d_t, auto s_t) {
        strided_copy_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
            dst.data<decltype(d_t)>(), src.data<decltype(s_t)>(), ix, n, acc == Accumulate::yes);
      },
      dst.dtype(), src.dtype());
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels::cuda
