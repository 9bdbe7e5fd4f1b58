// Uncertainty of timings: medians with 95% percentile-bootstrap confidence intervals, and the
// words a report prints for them ("within noise" when the interval holds the null value).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bench {

// A point estimate and its 95% confidence interval [lo, hi]. `samples` is how many values it
// came from (0: no estimate).
struct Estimate {
  double value = 0, lo = 0, hi = 0;
  int samples = 0;

  // One sample resamples to itself: its interval has no width and says nothing.
  bool has_interval() const { return samples >= 2; }
  bool contains(double x) const { return has_interval() && lo <= x && x <= hi; }
};

constexpr int kBootstrapResamples = 2000;

// q-quantile (0..1) by linear interpolation; 0 for an empty list.
double percentile(std::vector<double> values, double q);
// percentile(xs, 0.5).
double median(std::vector<double> xs);

// The median of xs with its 95% percentile-bootstrap interval: xs resampled with replacement
// kBootstrapResamples times from a fixed seed, so a report is reproducible.
Estimate median_ci(const std::vector<double>& xs, uint64_t seed = 1);

// How two samples relate. paired: value k of both came from the same interleaved repeat and
// shares its drift, so the bootstrap resamples pairs (requires equal lengths); independent:
// each is resampled on its own (the steps of two different runs).
enum class Pairing { paired, independent };

// median(num) / median(den), and (median(a) - median(b)) * scale. requires both non-empty.
Estimate ratio_ci(const std::vector<double>& num, const std::vector<double>& den, Pairing pairing,
                  uint64_t seed = 1);
Estimate difference_ci(const std::vector<double>& a, const std::vector<double>& b, double scale,
                       Pairing pairing, uint64_t seed = 1);

// "1.83 (95% CI 1.62 to 2.05)" with `digits` after the point.
// "1.23 (95% CI 1.10 to 1.40)", or "1.23 (95% CI n/a: one sample)".
std::string format_ci(const Estimate& e, int digits);

// A run is noisy when its p90 step exceeds 1.5 times its median step.
bool noisy(const std::vector<double>& step_ms);

}  // namespace bench
