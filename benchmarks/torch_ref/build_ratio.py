#!/usr/bin/env python3
"""Two or more dp_bench binaries on the same flags, interleaved, with a 95% bootstrap interval.

For before/after figures of a change: build dp_bench before and after it, keep each binary, and

  benchmarks/torch_ref/build_ratio.py --bin before=/tmp/before/dp_bench \\
      --bin after=build-dev/bin/dp_bench --repeat 9 --json out.json -- \\
      --model gpt --seq 128 --batch 16

runs each binary K times on one CPU device in the order b1, b2, ..., b1, b2, ... (a slow minute
of a shared machine falls on every binary alike) and prints each one's median step, the ratio
of medians to the first binary with its percentile-bootstrap interval (stats.py), and the final
loss (a change meant to keep the bits must print the same loss).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dtype_ratio import parse_args, report, run_once  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", action="append", required=True, metavar="LABEL=PATH",
                    help="a dp_bench binary and its label (two or more; the first is the base)")
    a, flags = parse_args(ap)
    binaries = []
    for b in a.bin:
        label, sep, path = b.partition("=")
        if not sep or not label or not os.access(path, os.X_OK):
            sys.exit(f"build_ratio: --bin {b}: want LABEL=PATH to an executable dp_bench")
        binaries.append((label, path))
    if len(binaries) < 2 or a.repeat < 2:
        sys.exit("build_ratio: give at least two --bin and --repeat 2 or more")
    samples = {label: [] for label, _ in binaries}
    losses, environment = {}, None
    for _ in range(a.repeat):
        for label, path in binaries:
            ms, loss, environment = run_once(None, flags, {}, a.steps, program=path)
            samples[label].append(ms)
            losses[label] = loss
    report(flags, a, samples, losses, environment)


if __name__ == "__main__":
    main()
