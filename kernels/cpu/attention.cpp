// Transformer ops on the CPU: embedding lookup and multi-head scaled dot-product attention.
// Attention runs one task per (batch, head), each with single-threaded sgemm calls on strided
// views of the fused qkv tensor (a 16-bit one widened per head), and an f32 softmax whose
// exponentials run on the vector math (vec_math.hpp, within 3 ulp of expf): the same bits for
// any thread count and vector ISA.
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/vec_math.hpp"
#include "kernels/philox.hpp"

namespace kernels::cpu {

namespace {

std::string bad_id_text(int64_t id, int64_t position, const Tensor& ids, int64_t vocab) {
  std::ostringstream os;
  os << "embedding: id " << id << " at position " << position << " of ids "
     << shape_str(ids.shape()) << " is outside [0, " << vocab << ")";
  return os.str();
}

// The shape of one attention call: B, T, H, head dim, width D = H Dh.
struct AttentionShape {
  int64_t batch, seq, heads, head_dim, width;
  explicit AttentionShape(const Tensor& qkv, int64_t h)
      : batch(qkv.dim(0)),
        seq(qkv.dim(1)),
        heads(h),
        head_dim(qkv.dim(2) / 3 / h),
        width(qkv.dim(2) / 3) {}
  // Offsets of q, k, v of head h of batch b in qkv (row stride 3 D), and of y (row stride D).
  int64_t q(int64_t b, int64_t h) const { return b * seq * 3 * width + h * head_dim; }
  int64_t k(int64_t b, int64_t h) const { return q(b, h) + width; }
  int64_t v(int64_t b, int64_t h) const { return q(b, h) + 2 * width; }
  int64_t y(int64_t b, int64_t h) const { return b * seq * width + h * head_dim; }
  int64_t lse(int64_t b, int64_t h) const { return (b * heads + h) * seq; }
};

// Columns of row i the mask lets through: [0, i] (causal) or [0, T).
int64_t visible(const AttentionParams& p, int64_t i, int64_t seq) {
  return p.mask == AttentionMask::causal ? i + 1 : seq;
}

// Rows (T, Dh) at `at` with row stride `ld` of a tensor of storage S, as f32: in place for f32,
// else widened, exactly, into `own` (row stride Dh); *ld_out is the stride to read them with.
template <class S>
const float* rows_f32(const S* at, int64_t ld, const AttentionShape& a, std::vector<float>& own,
                      int64_t* ld_out) {
  if constexpr (std::is_same_v<S, float>) {
    *ld_out = ld;
    return at;
  } else {
    own.resize(static_cast<size_t>(a.seq * a.head_dim));
    for (int64_t i = 0; i < a.seq; ++i)
      for (int64_t c = 0; c < a.head_dim; ++c)
        own[static_cast<size_t>(i * a.head_dim + c)] = load_f32(at[i * ld + c]);
    *ld_out = a.head_dim;
    return own.data();
  }
}
// One (b, h)'s q, k, v (T, Dh each) as f32, all read with row stride ld (rows_f32): the f32
// arithmetic below is then the f32 kernel's on any storage.
struct Head {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t ld = 0;
  std::vector<float> own_q, own_k, own_v;
};
template <class S>
void head_of(Head& hd, const S* qkv, const AttentionShape& a, int64_t b, int64_t h) {
  const int64_t ld = 3 * a.width;
  hd.q = rows_f32(qkv + a.q(b, h), ld, a, hd.own_q, &hd.ld);
  hd.k = rows_f32(qkv + a.k(b, h), ld, a, hd.own_k, &hd.ld);
  hd.v = rows_f32(qkv + a.v(b, h), ld, a, hd.own_v, &hd.ld);
}
// f32 rows (T, Dh), row stride `ld`, rounded once into `at` (row stride `ld_at`); f32: nothing
// (they were written in place).
template <class S>
void store_rows(S* at, int64_t ld_at, const float* rows, int64_t ld, const AttentionShape& a) {
  if constexpr (!std::is_same_v<S, float>)
    for (int64_t i = 0; i < a.seq; ++i)
      for (int64_t c = 0; c < a.head_dim; ++c) store_rounded(at[i * ld_at + c], rows[i * ld + c]);
}

// s (T, T) = scale q k^T for one (b, h); rows then hold probabilities P = softmax(s) over the
// visible columns (zeros beyond). Writes lse[i] when lse is not null; else reads it.
void attention_probs(std::vector<float>& s, const float* q, const float* k, int64_t ld, float* lse,
                     const float* lse_in, const AttentionShape& a, const AttentionParams& p) {
  const int64_t t = a.seq;
  sgemm_serial(Transpose::no, Transpose::yes, t, t, a.head_dim, p.scale, q, ld, k, ld, 0.f,
               s.data(), t);
  // The exponentials of both passes on the vector math (vec_math.hpp); the forward's and the
  // backward's P are the same bits, exp(s - lse) from the same s and lse.
  static thread_local std::vector<float> shifted;
  shifted.resize(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) {
    float* row = s.data() + i * t;
    const int64_t n = visible(p, i, t);
    float row_lse;
    if (lse_in) {
      row_lse = lse_in[i];
    } else {
      const float m = exp_minus_max_rows(shifted.data(), row, n);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += shifted[j];
      row_lse = m + std::log(sum);
      lse[i] = row_lse;
    }
    for (int64_t j = 0; j < n; ++j) row[j] -= row_lse;
    exp_nonpositive_rows(row, row, n);
    for (int64_t j = n; j < t; ++j) row[j] = 0.f;
  }
}

// m (T, T) of task bh = b H + h: the dropout mask's keep / (1 - p) for the visible columns
// (ops.hpp: counter dropout_offset + (bh T + i) T + j).
void dropout_scales(std::vector<float>& m, int64_t bh, const AttentionShape& a,
                    const AttentionParams& p) {
  const int64_t t = a.seq;
  const float keep_scale = 1.f / (1.f - p.dropout);
  for (int64_t i = 0; i < t; ++i) {
    const uint64_t row = p.dropout_offset.read() + static_cast<uint64_t>((bh * t + i) * t);
    const int64_t n = visible(p, i, t);
    for (int64_t j = 0; j < n; ++j)
      m[i * t + j] = philox::uniform(p.dropout_seed, row + static_cast<uint64_t>(j)) >= p.dropout
                         ? keep_scale
                         : 0.f;
    for (int64_t j = n; j < t; ++j) m[i * t + j] = 0.f;
  }
}

}  // namespace

void embedding_forward(Tensor& y, const Tensor& ids, const Tensor& table) {
  const int64_t n = ids.numel(), vocab = table.dim(0), d = table.dim(1);
  const int32_t* pi = ids.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    DP_CHECK(pi[i] >= 0 && pi[i] < vocab, bad_id_text(pi[i], i, ids, vocab));
  const float* pt = table.data<float>();
  float* py = y.data<float>();
  parallel_range(n, std::max<int64_t>(1, kElementwiseGrain / d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(py + i * d, pt + pi[i] * d, sizeof(float) * static_cast<size_t>(d));
  });
}

// Columns split across tasks; each task adds the rows in position order: bitwise reproducible
// (the CUDA kernel adds in the same order).
void embedding_backward(Tensor& dtable, const Tensor& dy, const Tensor& ids) {
  const int64_t n = ids.numel(), vocab = dtable.dim(0), d = dtable.dim(1);
  const int32_t* pi = ids.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    DP_CHECK(pi[i] >= 0 && pi[i] < vocab, bad_id_text(pi[i], i, ids, vocab));
  float* pt = dtable.data<float>();
  with_storage(
      [&](auto dy_t) {
        const auto* pdy = dy.data<decltype(dy_t)>();
        parallel_range(d, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(n, 1)),
                       [&](int64_t c0, int64_t c1) {
                         for (int64_t i = 0; i < n; ++i) {
                           float* dst = pt + pi[i] * d;
                           const auto* src = pdy + i * d;
                           for (int64_t c = c0; c < c1; ++c) dst[c] += load_f32(src[c]);
                         }
                       });
      },
      dy.dtype());
}

// qkv, y (and dy, dqkv) f32, f16 or bf16, one dtype (ops.cpp checks it): a 16-bit head is
// widened per task and its results rounded once, the bits of widening the tensors, the f32
// kernel and rounding its outputs, without f32 copies of the tensors.
void attention_forward(Tensor& y, Tensor& lse, const Tensor& qkv, const AttentionParams& p) {
  with_storage(
      [&](auto s_t) {
        using S = decltype(s_t);
        const AttentionShape a(qkv, p.heads);
        const S* px = qkv.data<S>();
        S* py = y.data<S>();
        float* pl = lse.data<float>();
        parallel_range(a.batch * a.heads, 1, [&](int64_t first, int64_t last) {
          std::vector<float> s(static_cast<size_t>(a.seq * a.seq)), m, y_own;
          if (p.dropout > 0.f) m.resize(s.size());
          Head hd;
          for (int64_t task = first; task < last; ++task) {
            const int64_t b = task / a.heads, h = task % a.heads;
            head_of(hd, px, a, b, h);
            attention_probs(s, hd.q, hd.k, hd.ld, pl + a.lse(b, h), nullptr, a, p);
            if (p.dropout > 0.f) {  // P <- P * m
              dropout_scales(m, task, a, p);
              for (size_t e = 0; e < s.size(); ++e) s[e] *= m[e];
            }
            // y (T, Dh) = P (T, T) v (T, Dh): into y itself (f32), or rows rounded once.
            float* out;
            int64_t ld_out;
            if constexpr (std::is_same_v<S, float>) {
              out = py + a.y(b, h), ld_out = a.width;
            } else {
              y_own.resize(static_cast<size_t>(a.seq * a.head_dim));
              out = y_own.data(), ld_out = a.head_dim;
            }
            sgemm_serial(Transpose::no, Transpose::no, a.seq, a.head_dim, a.seq, 1.f, s.data(),
                         a.seq, hd.v, hd.ld, 0.f, out, ld_out);
            store_rows(py + a.y(b, h), a.width, out, ld_out, a);
          }
        });
      },
      qkv.dtype());
}

// With P recomputed from q, k and lse, per (b, h):
//   dV = P^T dY,  dP = dY V^T,  dS = P * (dP - rowsum(P * dP)),  dQ = scale dS K,
//   dK = scale dS^T Q.
void attention_backward(Tensor& dqkv, const Tensor& dy, const Tensor& qkv, const Tensor&,
                        const Tensor& lse, const AttentionParams& p) {
  with_storage(
      [&](auto s_t) {
        using S = decltype(s_t);
        const AttentionShape a(qkv, p.heads);
        const S* px = qkv.data<S>();
        const S* pdy = dy.data<S>();
        const float* pl = lse.data<float>();
        S* pdx = dqkv.data<S>();
        const int64_t t = a.seq;
        parallel_range(a.batch * a.heads, 1, [&](int64_t first, int64_t last) {
          std::vector<float> prob(static_cast<size_t>(t * t)), dp(static_cast<size_t>(t * t)), m,
              pm, dy_own, dx_own;
          if (p.dropout > 0.f) m.resize(prob.size()), pm.resize(prob.size());
          Head hd;
          for (int64_t task = first; task < last; ++task) {
            const int64_t b = task / a.heads, h = task % a.heads;
            head_of(hd, px, a, b, h);
            int64_t ld_dy = 0;
            const float* g = rows_f32(pdy + a.y(b, h), a.width, a, dy_own, &ld_dy);
            // dq | dk | dv: into dqkv itself (f32, row stride 3 D), or (T, 3 Dh) rounded once.
            float *dq, *dk, *dv;
            int64_t ld_dx;
            if constexpr (std::is_same_v<S, float>) {
              dq = pdx + a.q(b, h), dk = pdx + a.k(b, h), dv = pdx + a.v(b, h);
              ld_dx = 3 * a.width;
            } else {
              dx_own.resize(static_cast<size_t>(t * 3 * a.head_dim));
              dq = dx_own.data(), dk = dq + a.head_dim, dv = dq + 2 * a.head_dim;
              ld_dx = 3 * a.head_dim;
            }
            attention_probs(prob, hd.q, hd.k, hd.ld, nullptr, pl + a.lse(b, h), a, p);
            // Under dropout the forward used P m: dV takes P m, and dP = (dY V^T) m.
            const float* used = prob.data();
            if (p.dropout > 0.f) {
              dropout_scales(m, task, a, p);
              for (size_t e = 0; e < prob.size(); ++e) pm[e] = prob[e] * m[e];
              used = pm.data();
            }
            // dV (T, Dh) = P^T (T, T) dY (T, Dh)
            sgemm_serial(Transpose::yes, Transpose::no, t, a.head_dim, t, 1.f, used, t, g, ld_dy,
                         0.f, dv, ld_dx);
            // dP (T, T) = dY (T, Dh) V^T
            sgemm_serial(Transpose::no, Transpose::yes, t, t, a.head_dim, 1.f, g, ld_dy, hd.v,
                         hd.ld, 0.f, dp.data(), t);
            if (p.dropout > 0.f)
              for (size_t e = 0; e < dp.size(); ++e) dp[e] *= m[e];
            for (int64_t i = 0; i < t; ++i) {
              float* pr = prob.data() + i * t;
              float* dr = dp.data() + i * t;
              const int64_t n = visible(p, i, t);
              float dot = 0.f;
              for (int64_t j = 0; j < n; ++j) dot += pr[j] * dr[j];
              for (int64_t j = 0; j < n; ++j) dr[j] = pr[j] * (dr[j] - dot);
              for (int64_t j = n; j < t; ++j) dr[j] = 0.f;
            }
            // dQ (T, Dh) = scale dS (T, T) K (T, Dh);  dK (T, Dh) = scale dS^T Q
            sgemm_serial(Transpose::no, Transpose::no, t, a.head_dim, t, p.scale, dp.data(), t,
                         hd.k, hd.ld, 0.f, dq, ld_dx);
            sgemm_serial(Transpose::yes, Transpose::no, t, a.head_dim, t, p.scale, dp.data(), t,
                         hd.q, hd.ld, 0.f, dk, ld_dx);
            for (int64_t part = 0; part < 3; ++part)
              store_rows(pdx + a.q(b, h) + part * a.width, 3 * a.width, dq + part * a.head_dim,
                         ld_dx, a);
          }
        });
      },
      qkv.dtype());
}

}  // namespace kernels::cpu
