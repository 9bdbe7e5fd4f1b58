#!/usr/bin/env python3
"""Our own step time in one dtype against another, interleaved, with a 95% bootstrap interval.

Runs dp_bench (one device) K times per variant, in the order v1, v2, ..., v1, v2, ... so that a
slow minute of a shared machine falls on every variant alike, and prints each variant's median
step with the ratio of medians to the first variant and its percentile-bootstrap interval
(stats.py). A variant is a label, dp_bench flags and optional environment settings:

  benchmarks/torch_ref/dtype_ratio.py --build build-dev --repeat 7 --json out.json -- \\
      --model gpt --gpt-config tiny --seq 64 --batch 8

compares `--dtype fp32`, `--dtype bf16` and `--dtype bf16` with DP_CPU_BF16_GEMM=widen (bf16
GEMMs widened to f32 on OpenBLAS, as before oneDNN) on the model the flags after `--` give.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stats import bootstrap_ratio_ci, median  # noqa: E402

VARIANTS = [
    ("fp32", ["--dtype", "fp32"], {}),
    ("bf16", ["--dtype", "bf16"], {}),
    ("bf16 widened", ["--dtype", "bf16"], {"DP_CPU_BF16_GEMM": "widen"}),
]


def run_once(build, flags, env_extra, steps, program=None):
    """One dp_bench run on one CPU device: (median step ms, final loss, environment). `program`
    is a dp_bench binary to run instead of the build's."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        program = program or os.path.join(build, "bin", "dp_bench")
        cmd = [program, "--device", "cpu", "--mode", "dp",
               "--gpus", "1", "--steps", str(steps), "--json", out.name] + flags
        env = dict(os.environ, **env_extra)
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if done.returncode != 0:
            sys.exit(f"{os.path.basename(sys.argv[0])}: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}")
        report = json.load(open(out.name))
    run = report["runs"][0]
    return run["step_ms_median"], run["final_loss"], report["environment"]


def parse_args(ap):
    """Adds the options every interleaved comparison takes (--repeat, --steps, --json, then
    dp_bench's flags after --) and parses: (the namespace, the dp_bench flags)."""
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", help="write the samples, medians and ratios here")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="-- then dp_bench's model flags")
    a = ap.parse_args()
    return a, a.flags[1:] if a.flags[:1] == ["--"] else a.flags


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build-dev")
    a, flags = parse_args(ap)
    if a.repeat < 2:
        sys.exit("dtype_ratio: --repeat must be at least 2 for an interval")
    samples = {label: [] for label, _, _ in VARIANTS}
    losses, environment = {}, None
    for _ in range(a.repeat):
        for label, extra, env in VARIANTS:
            ms, loss, environment = run_once(a.build, flags + extra, env, a.steps)
            samples[label].append(ms)
            losses[label] = loss
    report(flags, a, samples, losses, environment)


def report(flags, a, samples, losses, environment):
    """Prints each variant's median step and its ratio to the first one's (a 95% bootstrap
    interval) with its final loss, and writes them with the samples to a.json when given."""
    labels = list(samples)
    base = labels[0]
    out = {"flags": flags, "repeat": a.repeat, "steps": a.steps, "samples_ms": samples,
           "final_loss": losses, "environment": environment, "ratios": {}}
    print(f"dp_bench {' '.join(flags)}: median step of {a.repeat} interleaved runs")
    for label in labels:
        ci = bootstrap_ratio_ci(samples[label], samples[base])
        out["ratios"][label] = {"median_ms": median(samples[label]), "ratio": ci.ratio,
                                "lo": ci.lo, "hi": ci.hi}
        print(f"  {label:14s} {median(samples[label]):8.2f} ms   / {base}: "
              f"{ci.ratio:.2f} [{ci.lo:.2f}, {ci.hi:.2f}]   final loss {losses[label]:.6f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
