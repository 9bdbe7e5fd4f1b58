#!/usr/bin/env python3
"""Where a step's GPU time goes, from an Nsight Compute CSV of kernel durations.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --nvtx \
        dp_bench ... --steps 1 --cuda-graphs off > ncu.csv
    benchmarks/ncu_summary.py ncu.csv[.gz] [--steps K] [--top N]

Each kernel's gpu__time_duration.sum is summed by kind (GEMM, casts, attention, losses, norms,
...: the patterns below, matched on the kernel's name) and by the NVTX range it ran in, where the
CSV has ncu's NVTX column (--nvtx). --steps K divides the totals by K (the steps the profiled run
took: count the optimizer's launches, e.g. adamw_kernel, in the kernel list) and says so; the
shares do not depend on it. Lines that are not CSV (ncu's ==PROF== lines, the program's own
output) are skipped.
"""
import argparse
import collections
import csv
import gzip
import io
import re
import sys

# First match wins: the order puts the specific names before the general ones.
KINDS = [
    ("cast", r"cast"),
    ("attention (cuDNN SDPA)", r"cudnn|fmha|flash|sdpa|attention"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas|Kernel2|splitK|gemv"),
    ("loss (softmax cross-entropy)", r"cross_entropy|xent|log_softmax|softmax"),
    ("LayerNorm / RMSNorm", r"layer_norm|rms_norm|layernorm|ln_forward|ln_backward|add_ln"),
    ("GELU / activations", r"gelu|relu|silu|tanh|swiglu"),
    ("bias", r"bias"),
    ("optimizer (AdamW, SGD)", r"adam|sgd|optimizer|momentum"),
    ("non-finite check", r"finite|isnan|nonfinite"),
    ("embedding", r"embedding"),
    ("dropout", r"dropout"),
    ("residual / elementwise add", r"add|axpy|scale"),
    ("reductions, sums", r"reduce|sum|norm|column_|count_correct|argmax"),
    ("fills, copies", r"set_values|fill|memset|copy|memcpy"),
]


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        text = [line for line in f if line.startswith('"')]
    return list(csv.reader(io.StringIO("".join(text))))


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def short(name):
    """The kernel's name without its argument list and template arguments."""
    name = name.replace("(anonymous namespace)", "").replace("<unnamed>::", "")
    name = name[5:] if name.startswith("void ") else name
    name = name.split("(")[0]
    while "<" in name:
        new = re.sub(r"<[^<>]*>", "", name)
        if new == name:
            break
        name = new
    return name.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --csv output (gzip allowed)")
    ap.add_argument("--steps", type=int, default=1, help="steps the profiled run took")
    ap.add_argument("--top", type=int, default=15, help="kernels to list by time")
    a = ap.parse_args()
    if a.steps < 1:
        sys.exit("ncu_summary: --steps must be >= 1")
    table = rows(a.csv)
    if not table:
        sys.exit(f"ncu_summary: {a.csv}: no CSV rows (was ncu run with --csv?)")
    head = table[0]
    try:
        i_name = head.index("Kernel Name")
        i_metric = head.index("Metric Name")
        i_value = head.index("Metric Value")
        i_unit = head.index("Metric Unit")
    except ValueError as e:
        sys.exit(f"ncu_summary: {a.csv}: not an ncu details CSV ({e})")
    i_nvtx = next((i for i, h in enumerate(head) if "Push/Pop" in h or "NVTX" in h), None)
    scale = {"ns": 1e-6, "nsecond": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}

    by_kind = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    by_range = collections.defaultdict(float)
    total = 0.0
    for r in table[1:]:
        if r == head or len(r) <= i_value or r[i_metric] != "gpu__time_duration.sum":
            continue
        ms = float(r[i_value].replace(",", "")) * scale.get(r[i_unit], 1e-6)
        name = r[i_name]
        total += ms
        k = kind_of(name)
        by_kind[k][0] += ms
        by_kind[k][1] += 1
        s = short(name)
        by_kernel[s][0] += ms
        by_kernel[s][1] += 1
        if i_nvtx is not None:
            ranges = re.findall(r"dp/[a-z_]+", r[i_nvtx]) or ["(outside dp/ ranges)"]
            by_range[ranges[-1]] += ms
    if total == 0:
        sys.exit(f"ncu_summary: {a.csv}: no gpu__time_duration.sum rows")
    per = f" per step (totals / {a.steps})" if a.steps > 1 else ""
    n = sum(c for _, c in by_kind.values())
    print(f"{total / a.steps:.3f} ms of kernel time{per}, {n / a.steps:.0f} launches")
    print(f"\n{'kind':34} {'ms':>9} {'share':>7} {'launches':>9}")
    for k, (ms, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:34} {ms / a.steps:9.3f} {100 * ms / total:6.1f}% {c / a.steps:9.0f}")
    if by_range:
        print(f"\n{'NVTX range (innermost dp/)':34} {'ms':>9} {'share':>7}")
        for k, ms in sorted(by_range.items(), key=lambda kv: -kv[1]):
            print(f"{k:34} {ms / a.steps:9.3f} {100 * ms / total:6.1f}%")
    print(f"\n{'kernel':70} {'ms':>9} {'share':>7} {'launches':>9}")
    for k, (ms, c) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{k[:70]:70} {ms / a.steps:9.3f} {100 * ms / total:6.1f}% {c / a.steps:9.0f}")


if __name__ == "__main__":
    main()
