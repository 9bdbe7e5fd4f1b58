"""Side-by-side table of dp_bench's JSON and the torch reference JSONs.

  python3 compare.py ours.json torch_dp.json torch_ddp.json

For each of DP and DDP: the largest-N run of ours and of torch, step time median, samples/s,
final loss, ours/torch step-time and throughput ratios, and how far the two loss curves are
apart (same initial weights and data: they should agree to float rounding).
"""

import argparse
import json
import os


def load(path):
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def largest(report, mode):
    runs = [r for r in (report or {}).get("runs", []) if r["mode"] == mode]
    return max(runs, key=lambda r: r["gpus"]) if runs else None


def row(label, r):
    if r is None:
        return f" {label:10s}  (no run)"
    return (f" {label:10s} {r['gpus']:3d} {r['batch']:7d} {r['step_ms_median']:12.3f} "
            f"{r['samples_per_s']:12.0f} {r['final_loss']:12.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ours")
    ap.add_argument("torch_dp")
    ap.add_argument("torch_ddp")
    args = ap.parse_args()
    ours, tdp, tddp = load(args.ours), load(args.torch_dp), load(args.torch_ddp)
    for name, rep in (("ours", ours), ("torch DP", tdp), ("torch DDP", tddp)):
        if rep is None:
            print(f"{name}: no report ({name} run failed or was skipped)")
        else:
            note = f"; note: {rep['note']}" if rep.get("note") else ""
            print(f"{name}: device {rep['device']}, {rep.get('logical_devices')} logical / "
                  f"{rep.get('physical_devices')} physical, model {rep.get('model')}{note}")
    print("\n mode          N   batch  step ms med    samples/s   final loss")
    pairs = [("DP", largest(ours, "dp"), largest(tdp, "torch_dp")),
             ("DDP", largest(ours, "ddp"), largest(tddp, "torch_ddp"))]
    for mode, a, b in pairs:
        print(row(f"ours {mode.lower()}", a))
        print(row(f"torch {mode.lower()}", b))
    print()
    for mode, a, b in pairs:
        if a is None or b is None or not b["step_ms_median"] or not b["samples_per_s"]:
            print(f" {mode}: no ratio (a run is missing)")
            continue
        same_n = ("" if a["gpus"] == b["gpus"]
                  else f"  [N differs: ours {a['gpus']}, torch {b['gpus']}]")
        gap = max((abs(x - y) for x, y in zip(a["losses"], b["losses"])), default=float("nan"))
        print(f" {mode}: ours/torch step time {a['step_ms_median'] / b['step_ms_median']:.3f} "
              f"(< 1: ours faster), samples/s {a['samples_per_s'] / b['samples_per_s']:.3f}, "
              f"max |loss ours - torch| {gap:.2e}{same_n}")


if __name__ == "__main__":
    main()
