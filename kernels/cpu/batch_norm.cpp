// BatchNorm over every dim but 1 of x (N, C, ...). Channels run in parallel; each channel's
// statistics are two-pass sums in double over (n, inner) in a fixed order (lane sums), so results
// are reproducible.
#include <cmath>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_util.hpp"
#include "kernels/cpu/lane_sum.hpp"

namespace kernels::cpu {

namespace {

// x viewed as (N, C, inner): channel c is N runs of `inner` contiguous values.
struct ChannelLayout {
  int64_t batch, channels, inner;

  explicit ChannelLayout(const Tensor& x)
      : batch(x.dim(0)), channels(x.dim(1)), inner(x.numel() / (x.dim(0) * x.dim(1))) {}
  int64_t count() const { return batch * inner; }
  int64_t run(int64_t n, int64_t c) const { return (n * channels + c) * inner; }
};

// body(c) for every channel, in parallel.
template <class Body>
void for_each_channel(const ChannelLayout& l, Body&& body) {
  int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, l.count()));
  parallel_range(l.channels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) body(c);
  });
}

// Sum over channel c of f(offset) for every element offset of the channel: each run's terms into
// kSumLanes interleaved partial sums (lane_sum.hpp), added pairwise at the end. A fixed order, so
// the same bits on any thread count, without a single running sum's chain of dependent adds.
template <class F>
double channel_sum(const ChannelLayout& l, int64_t c, F&& f) {
  double s[kSumLanes] = {};
  for (int64_t n = 0; n < l.batch; ++n) {
    const int64_t base = l.run(n, c);
    lane_sums(l.inner, s, [&](int64_t i) { return f(base + i); });
  }
  return add_lanes(s);
}

// y = (x - mean) * (gamma * invstd) + beta over channel c.
void normalize_channel(const ChannelLayout& l, int64_t c, const float* x, float* y, float mean,
                       float scale, float shift) {
  for (int64_t n = 0; n < l.batch; ++n) {
    int64_t base = l.run(n, c);
    for (int64_t i = 0; i < l.inner; ++i) y[base + i] = (x[base + i] - mean) * scale + shift;
  }
}

}  // namespace

void batch_norm_forward_train(Tensor& y, Tensor& save_mean, Tensor& save_invstd,
                              Tensor& running_mean, Tensor& running_var, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, float momentum, float eps) {
  ChannelLayout l(x);
  const float* px = x.data<float>();
  float* py = y.data<float>();
  double count = static_cast<double>(l.count());
  for_each_channel(l, [&](int64_t c) {
    double mean = channel_sum(l, c, [&](int64_t i) { return double{px[i]}; }) / count;
    double var = channel_sum(l, c,
                             [&](int64_t i) {
                               double d = px[i] - mean;
                               return d * d;
                             }) /
                 count;
    double invstd = 1.0 / std::sqrt(var + eps);
    float scale = static_cast<float>(gamma.data<float>()[c] * invstd);
    normalize_channel(l, c, px, py, static_cast<float>(mean), scale, beta.data<float>()[c]);
    save_mean.data<float>()[c] = static_cast<float>(mean);
    save_invstd.data<float>()[c] = static_cast<float>(invstd);
    float& rm = running_mean.data<float>()[c];
    float& rv = running_var.data<float>()[c];
    rm = static_cast<float>((1.0 - momentum) * rm + momentum * mean);
    rv = static_cast<float>((1.0 - momentum) * rv + momentum * var * count / (count - 1.0));
  });
}

void batch_norm_forward_eval(Tensor& y, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var, float eps) {
  ChannelLayout l(x);
  for_each_channel(l, [&](int64_t c) {
    double invstd = 1.0 / std::sqrt(double{running_var.data<float>()[c]} + eps);
    float scale = static_cast<float>(gamma.data<float>()[c] * invstd);
    normalize_channel(l, c, x.data<float>(), y.data<float>(), running_mean.data<float>()[c], scale,
                      beta.data<float>()[c]);
  });
}

// With xhat = (x - mean) invstd and M values per channel:
//   dbeta (+)= sum dy, dgamma (+)= sum dy xhat,
//   dx = gamma invstd (dy - sum dy / M - xhat sum (dy xhat) / M).
void batch_norm_backward(Tensor& dx, Tensor& dgamma, Tensor& dbeta, const Tensor& dy,
                         const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                         const Tensor& save_invstd, Accumulate acc) {
  ChannelLayout l(x);
  const float* px = x.data<float>();
  const float* pdy = dy.data<float>();
  float* pdx = dx.data<float>();
  double count = static_cast<double>(l.count());
  for_each_channel(l, [&](int64_t c) {
    double mean = save_mean.data<float>()[c], invstd = save_invstd.data<float>()[c];
    double sum_dy = channel_sum(l, c, [&](int64_t i) { return double{pdy[i]}; });
    double sum_dy_xhat =
        channel_sum(l, c, [&](int64_t i) { return pdy[i] * (px[i] - mean) * invstd; });
    float* pdgamma = dgamma.data<float>() + c;
    float* pdbeta = dbeta.data<float>() + c;
    *pdgamma = static_cast<float>(acc == Accumulate::yes ? *pdgamma + sum_dy_xhat : sum_dy_xhat);
    *pdbeta = static_cast<float>(acc == Accumulate::yes ? *pdbeta + sum_dy : sum_dy);
    double scale = gamma.data<float>()[c] * invstd;
    double mean_dy = sum_dy / count, mean_dy_xhat = sum_dy_xhat / count;
    for (int64_t n = 0; n < l.batch; ++n) {
      int64_t base = l.run(n, c);
      for (int64_t i = base; i < base + l.inner; ++i) {
        double xhat = (px[i] - mean) * invstd;
        pdx[i] = static_cast<float>(scale * (pdy[i] - mean_dy - xhat * mean_dy_xhat));
      }
    }
  });
}

}  // namespace kernels::cpu
