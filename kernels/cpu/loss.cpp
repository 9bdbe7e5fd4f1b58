// Losses: fused softmax + cross-entropy, and mean squared error. Rows or chunks run in parallel;
// the batch total adds their double partials in a fixed order (bitwise reproducible). The
// cross-entropies read f32, f16 or bf16 logits (widened exactly) and write dlogits in f32 or the
// logits' dtype, each value rounded once from the f32 the f32 kernel stores. The exponentials run
// on the vector math, once a row (vec_math.hpp).
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/lane_sum.hpp"
#include "kernels/cpu/vec_math.hpp"

namespace kernels::cpu {

namespace {

// A row's softmax statistics, stable: e[c] = exp(x_c - max) in f32 (exp_minus_max_rows on the
// widened row; x_c - max rounded to f32 first), their sum in double (lane_sums), and
// lse = log sum_c exp x_c = max + log(sum). softmax(x)_c is then e[c] / sum. e is the calling
// thread's scratch, valid until its next call.
struct RowSoftmax {
  const float* e;
  double sum, lse;
};
template <class S>
RowSoftmax row_softmax(const S* x, int64_t classes) {
  static thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(classes));
  float* e = scratch.data();
  for (int64_t c = 0; c < classes; ++c) e[c] = load_f32(x[c]);
  const float max_x = exp_minus_max_rows(e, e, classes);
  double sums[kSumLanes] = {};
  lane_sums(classes, sums, [&](int64_t c) { return double{e[c]}; });
  const double sum = add_lanes(sums);
  return {e, sum, max_x + std::log(sum)};
}

// Calls row(i, x, d) for every row i of logits (rows, classes), rows in parallel: x the row's
// logits and d its gradient row (null without dlogits), each in its storage type (dlogits: f32
// or the logits' dtype).
template <class Row>
void for_each_logits_row(const Tensor& logits, Tensor& dlogits, Row row) {
  const int64_t rows = logits.dim(0), classes = logits.dim(1);
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / classes);
  with_storage(
      [&](auto x_t, auto d_t) {
        using D = decltype(d_t);
        const auto* px = logits.data<decltype(x_t)>();
        D* pd = dlogits.defined() ? dlogits.data<D>() : nullptr;
        parallel_range(rows, grain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            row(i, px + i * classes, pd ? pd + i * classes : nullptr);
        });
      },
      logits.dtype(), dlogits.defined() ? dlogits.dtype() : logits.dtype());
}

// correct (1) f32 := how many rows are right (exact up to 2^24, as count_correct_into).
void store_count(Tensor& correct, const std::vector<uint8_t>& right) {
  int64_t hits = 0;
  for (uint8_t r : right) hits += r;
  correct.data<float>()[0] = static_cast<float>(hits);
}

}  // namespace

// Per row i (logits x, label l, weight w, smoothing ls, C classes), with lse = log sum exp x:
//   loss_i = w ((1 - ls)(lse - x_l) + ls (lse - mean_c x_c))
//   dlogits_i = g (w / B) (softmax(x) - t),  t = (1 - ls) onehot(l) + ls / C,  g = grad_scale.
void softmax_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits,
                           const Tensor& labels, const Tensor& weights, float label_smoothing,
                           Tensor& correct, const Scalar& grad_scale) {
  const int64_t batch = logits.dim(0), classes = logits.dim(1);
  const int32_t* pl = labels.data<int32_t>();
  const float* pw = weights.defined() ? weights.data<float>() : nullptr;
  for (int64_t i = 0; i < batch; ++i)
    DP_CHECK(pl[i] >= 0 && pl[i] < classes, bad_label_text(pl[i], i, batch, classes));
  const double ls = label_smoothing, g = grad_scale.read();
  std::vector<double> row_loss(static_cast<size_t>(batch));
  std::vector<uint8_t> right(correct.defined() ? static_cast<size_t>(batch) : 0);
  for_each_logits_row(logits, dlogits, [&](int64_t i, const auto* x, auto* d) {
    if (!right.empty()) right[i] = row_argmax(x, classes) == pl[i];  // the row is in cache
    const RowSoftmax sm = row_softmax(x, classes);
    const double lse = sm.lse;
    const double w = pw ? pw[i] : 1.0;
    const double x_label = load_f32(x[pl[i]]);
    // The smoothing term only with smoothing: a -inf logit would make it 0 * inf = NaN.
    double smooth = 0.0;
    if (ls != 0.0) {
      double sum_x = 0.0;
      for (int64_t c = 0; c < classes; ++c) sum_x += load_f32(x[c]);
      smooth = ls * (lse - sum_x / classes);
    }
    row_loss[i] = w * (ls != 0.0 ? (1.0 - ls) * (lse - x_label) + smooth : lse - x_label);
    if (!d) return;
    const double scale = g * (w / static_cast<double>(batch)), inv_sum = 1.0 / sm.sum;
    for (int64_t c = 0; c < classes; ++c) {
      const double target = (c == pl[i] ? 1.0 - ls : 0.0) + ls / classes;
      store_rounded(d[c], static_cast<float>(scale * (sm.e[c] * inv_sum - target)));
    }
  });
  double total = 0.0;
  for (double l : row_loss) total += l;
  loss.data<float>()[0] = static_cast<float>(total / static_cast<double>(batch));
  if (correct.defined()) store_count(correct, right);
}

// As softmax_cross_entropy without smoothing or weights, over the rows whose target is not
// ignore_index, divided by their count n (ignored rows: no loss, zero gradient).
void token_cross_entropy(Tensor& loss, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                         int32_t ignore_index, Tensor& correct, const Scalar& grad_scale,
                         const Tensor& kept_in) {
  const int64_t rows = logits.dim(0), classes = logits.dim(1);
  const int32_t* pt = targets.data<int32_t>();
  int64_t kept = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (pt[i] == ignore_index) continue;
    DP_CHECK(pt[i] >= 0 && pt[i] < classes, bad_label_text(pt[i], i, rows, classes));
    ++kept;
  }
  // The whole batch's count, of which these rows are a part (a chunked loss).
  if (kept_in.defined()) kept = static_cast<int64_t>(kept_in.data<float>()[0]);
  const double inv_n = kept > 0 ? 1.0 / static_cast<double>(kept) : 0.0;
  const double grad_by = kept > 0 ? grad_scale.read() / static_cast<double>(kept) : 0.0;
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  std::vector<uint8_t> right(correct.defined() ? static_cast<size_t>(rows) : 0);
  for_each_logits_row(logits, dlogits, [&](int64_t i, const auto* x, auto* d) {
    using D = std::remove_pointer_t<decltype(d)>;
    if (pt[i] == ignore_index) {
      if (d) std::fill(d, d + classes, D{});  // +0 in every storage type
      return;
    }
    if (!right.empty()) right[i] = row_argmax(x, classes) == pt[i];
    const RowSoftmax sm = row_softmax(x, classes);
    row_loss[i] = sm.lse - load_f32(x[pt[i]]);
    if (!d) return;
    const double inv_sum = 1.0 / sm.sum;
    for (int64_t c = 0; c < classes; ++c)
      store_rounded(d[c],
                    static_cast<float>(grad_by * (sm.e[c] * inv_sum - (c == pt[i] ? 1.0 : 0.0))));
  });
  double total = 0.0;
  for (double l : row_loss) total += l;
  loss.data<float>()[0] = static_cast<float>(total * inv_n);
  if (correct.defined()) store_count(correct, right);
}

void count_kept(Tensor& out, const Tensor& targets, int32_t ignore_index) {
  const int32_t* pt = targets.data<int32_t>();
  int64_t kept = 0;
  for (int64_t i = 0; i < targets.numel(); ++i) kept += pt[i] != ignore_index ? 1 : 0;
  out.data<float>()[0] = static_cast<float>(kept);
}

// loss = mean (pred - target)^2, dpred = 2 (pred - target) / numel.
void mse_loss(Tensor& loss, Tensor& dpred, const Tensor& pred, const Tensor& target) {
  int64_t n = pred.numel();
  const float* pp = pred.data<float>();
  const float* pt = target.data<float>();
  float* pd = dpred.defined() ? dpred.data<float>() : nullptr;
  double grad_scale = 2.0 / static_cast<double>(n);
  double total = chunked_sum(n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      double diff = static_cast<double>(pp[i]) - pt[i];
      s += diff * diff;
      if (pd) pd[i] = static_cast<float>(grad_scale * diff);
    }
    return s;
  });
  loss.data<float>()[0] = static_cast<float>(total / static_cast<double>(n));
}

}  // namespace kernels::cpu
