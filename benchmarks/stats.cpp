#include "benchmarks/stats.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>

#include "kernels/runtime/error.hpp"

namespace bench {

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(pos));
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

double median(std::vector<double> xs) {
  return percentile(std::move(xs), 0.5);
}

namespace {

// One resample of xs (with replacement), drawn through `pick` so that paired samples can share
// their indices.
std::vector<double> resample(const std::vector<double>& xs, const std::vector<size_t>& picks) {
  std::vector<double> out(picks.size());
  for (size_t i = 0; i < picks.size(); ++i) out[i] = xs[picks[i]];
  return out;
}

std::vector<size_t> draw(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<size_t> index(0, n - 1);
  std::vector<size_t> picks(n);
  for (auto& p : picks) p = index(rng);
  return picks;
}

// The percentile bootstrap of statistic(a, b): a and b resampled together (paired) or each on
// its own.
Estimate bootstrap(const std::vector<double>& a, const std::vector<double>& b, Pairing pairing,
                   uint64_t seed,
                   const std::function<double(const std::vector<double>&,
                                              const std::vector<double>&)>& statistic) {
  Estimate e;
  e.value = statistic(a, b);
  e.samples = static_cast<int>(std::min(a.size(), b.empty() ? a.size() : b.size()));
  std::mt19937_64 rng(seed);
  const bool paired = pairing == Pairing::paired;
  DP_CHECK(!paired || a.size() == b.size(),
           "bootstrap: paired samples of " << a.size() << " and " << b.size() << " values");
  std::vector<double> stats(kBootstrapResamples);
  for (double& s : stats) {
    std::vector<size_t> pa = draw(rng, a.size());
    std::vector<size_t> pb = b.empty() ? std::vector<size_t>{} : paired ? pa : draw(rng, b.size());
    s = statistic(resample(a, pa), resample(b, pb));
  }
  e.lo = percentile(stats, 0.025);
  e.hi = percentile(stats, 0.975);
  return e;
}

}  // namespace

Estimate median_ci(const std::vector<double>& xs, uint64_t seed) {
  if (xs.empty()) return {};
  return bootstrap(
      xs, {}, Pairing::independent, seed,
      [](const std::vector<double>& a, const std::vector<double>&) { return median(a); });
}

Estimate ratio_ci(const std::vector<double>& num, const std::vector<double>& den, Pairing pairing,
                  uint64_t seed) {
  DP_CHECK(!num.empty() && !den.empty(), "ratio_ci: " << num.size() << " and " << den.size()
                                                      << " values: both need at least one");
  return bootstrap(num, den, pairing, seed,
                   [](const std::vector<double>& a, const std::vector<double>& b) {
                     double d = median(b);
                     return d > 0 ? median(a) / d : 0.0;
                   });
}

Estimate difference_ci(const std::vector<double>& a, const std::vector<double>& b, double scale,
                       Pairing pairing, uint64_t seed) {
  DP_CHECK(!a.empty() && !b.empty(), "difference_ci: " << a.size() << " and " << b.size()
                                                       << " values: both need at least one");
  return bootstrap(a, b, pairing, seed,
                   [scale](const std::vector<double>& x, const std::vector<double>& y) {
                     return (median(x) - median(y)) * scale;
                   });
}

std::string format_ci(const Estimate& e, int digits) {
  char buf[128];
  if (!e.has_interval()) {
    std::snprintf(buf, sizeof(buf), "%.*f (95%% CI n/a: one sample)", digits, e.value);
    return buf;
  }
  std::snprintf(buf, sizeof(buf), "%.*f (95%% CI %.*f to %.*f)", digits, e.value, digits, e.lo,
                digits, e.hi);
  return buf;
}

bool noisy(const std::vector<double>& step_ms) {
  return !step_ms.empty() && percentile(step_ms, 0.9) > 1.5 * percentile(step_ms, 0.5);
}

}  // namespace bench
