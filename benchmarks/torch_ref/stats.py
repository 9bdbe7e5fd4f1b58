"""Medians and a bootstrap confidence interval for a ratio of medians, standard library only.

variants.py uses these to compare the K repeats of dp_bench (ours) with the K repeats of a
PyTorch variant: each repeat gives one sample (its median step time), and the ratio
ours/variant comes with a percentile-bootstrap interval. No numpy: the unit test runs on any
python3.

  ci = bootstrap_ratio_ci(ours, theirs)   # RatioCi(ratio, lo, hi), 95% by default
  verdict(ci)                             # "ours faster" | "ours slower" | "within noise"
"""

import collections
import random

RatioCi = collections.namedtuple("RatioCi", "ratio lo hi")

DEFAULT_RESAMPLES = 10000
DEFAULT_SEED = 20240601  # fixed: the same inputs always give the same interval


def median(values):
    """The middle value (the mean of the two middle ones for an even count).
    requires at least one value."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return v[mid] if n % 2 else 0.5 * (v[mid - 1] + v[mid])


def percentile(sorted_values, q):
    """Linear interpolation between closest ranks (report.cpp's percentile), q in [0, 1].
    requires sorted_values sorted and not empty."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_ratio_ci(a, b, resamples=DEFAULT_RESAMPLES, level=0.95, seed=DEFAULT_SEED):
    """median(a) / median(b) with its percentile-bootstrap confidence interval.

    requires a and b non-empty lists of positive numbers, resamples >= 2000, 0 < level < 1.
    ensures: each of `resamples` rounds draws len(a) values from a and len(b) values from b,
    independently and with replacement, and takes the ratio of their medians; lo and hi are the
    (1 - level) / 2 and (1 + level) / 2 percentiles of those ratios. The generator is seeded
    with `seed`, so the same call gives the same interval.
    """
    a, b = list(a), list(b)
    for name, v in (("a", a), ("b", b)):
        if not v:
            raise ValueError(f"bootstrap_ratio_ci: {name} is empty")
        if any(not x > 0 for x in v):
            raise ValueError(f"bootstrap_ratio_ci: {name} holds a value that is not positive: {v}")
    if resamples < 2000:
        raise ValueError(f"bootstrap_ratio_ci: resamples {resamples}: give at least 2000")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_ratio_ci: level {level}: give a number in (0, 1)")
    rng = random.Random(seed)
    ratios = sorted(median(rng.choices(a, k=len(a))) / median(rng.choices(b, k=len(b)))
                    for _ in range(resamples))
    tail = (1 - level) / 2
    return RatioCi(median(a) / median(b), percentile(ratios, tail), percentile(ratios, 1 - tail))


def verdict(ci):
    """For a ratio of step times ours/theirs: "within noise" when the interval contains 1,
    "ours faster" when all of it is below 1, "ours slower" when all of it is above."""
    if ci.lo <= 1.0 <= ci.hi:
        return "within noise"
    return "ours faster" if ci.hi < 1.0 else "ours slower"
