"""Unit tests of stats.py on cases with a known answer (standard library only).

  cd benchmarks/torch_ref && python3 -m unittest -v test_stats

ctest runs each case as "bench.torch_ref: ..." (tests/torch_ref.cmake).
"""

import math
import random
import unittest

import stats


def lognormal_samples(rng, median_value, sigma, k):
    """k draws whose distribution has median `median_value` (exp of a normal's median)."""
    return [median_value * math.exp(rng.gauss(0.0, sigma)) for _ in range(k)]


class Median(unittest.TestCase):
    def test_odd_even_and_empty(self):
        self.assertEqual(stats.median([3.0, 1.0, 2.0]), 2.0)
        self.assertEqual(stats.median([4.0, 1.0, 3.0, 2.0]), 2.5)
        with self.assertRaises(ValueError):
            stats.median([])


class BootstrapRatioCi(unittest.TestCase):
    TRUE_RATIO = 2.0 / 2.5  # medians of the two distributions below

    def draw(self, k, seed):
        rng = random.Random(seed)
        return lognormal_samples(rng, 2.0, 0.05, k), lognormal_samples(rng, 2.5, 0.05, k)

    def test_contains_the_known_ratio_and_is_narrow_for_large_k(self):
        a, b = self.draw(200, seed=7)
        ci = stats.bootstrap_ratio_ci(a, b)
        self.assertLessEqual(ci.lo, self.TRUE_RATIO)
        self.assertGreaterEqual(ci.hi, self.TRUE_RATIO)
        self.assertLess(ci.hi - ci.lo, 0.03, ci)  # sd of the ratio ~0.005 at K = 200
        self.assertEqual(stats.verdict(ci), "ours faster")

    def test_narrows_as_k_grows(self):
        widths = []
        for k in (10, 50, 250):
            ci = stats.bootstrap_ratio_ci(*self.draw(k, seed=11))
            widths.append(ci.hi - ci.lo)
        self.assertGreater(widths[0], widths[1], widths)
        self.assertGreater(widths[1], widths[2], widths)

    def test_covers_the_known_ratio_about_95_percent_of_the_time(self):
        trials, covered = 100, 0
        for t in range(trials):
            ci = stats.bootstrap_ratio_ci(*self.draw(25, seed=1000 + t), resamples=2000)
            covered += ci.lo <= self.TRUE_RATIO <= ci.hi
        self.assertGreaterEqual(covered / trials, 0.85, f"covered {covered} of {trials}")

    def test_equal_inputs_are_within_noise(self):
        a = [1.00, 1.02, 0.98, 1.05, 0.97]
        ci = stats.bootstrap_ratio_ci(a, list(a))
        self.assertEqual(ci.ratio, 1.0)
        self.assertLessEqual(ci.lo, 1.0)
        self.assertGreaterEqual(ci.hi, 1.0)
        self.assertEqual(stats.verdict(ci), "within noise")

    def test_same_distribution_k5_is_within_noise(self):
        rng = random.Random(3)
        a, b = lognormal_samples(rng, 2.0, 0.05, 5), lognormal_samples(rng, 2.0, 0.05, 5)
        self.assertEqual(stats.verdict(stats.bootstrap_ratio_ci(a, b)), "within noise")

    def test_clearly_slower_at_k5(self):
        ci = stats.bootstrap_ratio_ci([2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.02, 0.99, 1.01, 0.98])
        self.assertGreater(ci.lo, 1.0)
        self.assertEqual(stats.verdict(ci), "ours slower")

    def test_fixed_seed_is_reproducible(self):
        a, b = self.draw(5, seed=5)
        self.assertEqual(stats.bootstrap_ratio_ci(a, b), stats.bootstrap_ratio_ci(a, b))

    def test_refuses_bad_input(self):
        with self.assertRaises(ValueError):
            stats.bootstrap_ratio_ci([], [1.0])
        with self.assertRaises(ValueError):
            stats.bootstrap_ratio_ci([1.0, 0.0], [1.0])
        with self.assertRaises(ValueError):
            stats.bootstrap_ratio_ci([1.0], [1.0], resamples=100)


if __name__ == "__main__":
    unittest.main()
