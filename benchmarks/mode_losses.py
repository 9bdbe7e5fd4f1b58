#!/usr/bin/env python3
"""Every mode's and option's per-step losses from dp_bench on CPU devices, recorded or checked.

Before a change that must not move a bit (the reducer refactor of issue 54: DP, DDP, ZeRO-1,
hybrid and the parameter server on one step), record the losses of every case below; after it,
check them:

  benchmarks/mode_losses.py --build build-dev --record benchmarks/results/NAME/losses.json
  benchmarks/mode_losses.py --build build-dev --check benchmarks/results/NAME/losses.json

Record on the same machine and build configuration as the check: the GEMM library's kernels
(OpenBLAS picks them per CPU) decide the last bits. Each case is one dp_bench run of a few
steps on CPU devices (small models, uneven batches
where the case allows). --check prints one line per case, "same" or the first step whose loss
differs with both values, and exits 1 when any differs or is missing. Losses are compared as
the JSON report writes them (the shortest decimal that reads back as the same double).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MLP = ["--model", "mlp", "--steps", "3", "--warmup", "1"]
GPT = ["--model", "gpt", "--seq", "16", "--steps", "3", "--warmup", "1"]

# name: dp_bench flags (each run on CPU devices, no 1-device baseline).
CASES = {
    "dp mlp 3 devices, batch 25": MLP + ["--mode", "dp", "--gpus", "3", "--batch", "25"],
    "dp mlp tree reduce": MLP + ["--mode", "dp", "--gpus", "3", "--batch", "25",
                                 "--dp-reduce", "tree"],
    "dp mlp bf16 on the wire": MLP + ["--mode", "dp", "--gpus", "3", "--batch", "25",
                                      "--comm-dtype", "bf16"],
    "dp mlp bf16": MLP + ["--mode", "dp", "--gpus", "2", "--batch", "24", "--dtype", "bf16"],
    "dp mlp fp16": MLP + ["--mode", "dp", "--gpus", "2", "--batch", "24", "--dtype", "fp16"],
    "dp mlp adamw graphs metrics-lag 1": MLP + ["--mode", "dp", "--gpus", "2", "--batch", "24",
                                                "--optim", "adamw", "--cuda-graphs", "on",
                                                "--metrics-lag", "1", "--phase-times", "off"],
    "dp mlp graphs on": MLP + ["--mode", "dp", "--gpus", "2", "--batch", "24",
                               "--cuda-graphs", "on"],
    "dp resnet sync-bn": ["--model", "resnet", "--steps", "2", "--warmup", "1", "--mode", "dp",
                       "--gpus", "2", "--batch", "16", "--sync-bn"],
    "dp gpt dropout": GPT + ["--mode", "dp", "--gpus", "2", "--batch", "6", "--dropout", "0.1"],
    "ddp mlp 3 ranks, batch 25": MLP + ["--mode", "ddp", "--gpus", "3", "--batch", "25"],
    "ddp mlp small buckets": MLP + ["--mode", "ddp", "--gpus", "3", "--batch", "25",
                                    "--bucket-cap-mb", "0.01", "--first-bucket-mb", "0.01"],
    "ddp mlp bf16 on the wire": MLP + ["--mode", "ddp", "--gpus", "2", "--batch", "24",
                                       "--comm-dtype", "bf16"],
    "ddp mlp zero-1 adamw": MLP + ["--mode", "ddp", "--gpus", "3", "--batch", "24",
                                   "--optim", "adamw", "--zero", "1"],
    "ddp mlp graphs on": MLP + ["--mode", "ddp", "--gpus", "2", "--batch", "24",
                                "--cuda-graphs", "on"],
    "ddp resnet sync-bn": ["--model", "resnet", "--steps", "2", "--warmup", "1", "--mode", "ddp",
                        "--gpus", "2", "--batch", "16", "--sync-bn"],
    "ddp gpt bf16 activations": GPT + ["--mode", "ddp", "--gpus", "2", "--batch", "6",
                                       "--dtype", "bf16", "--activations", "bf16"],
    "hybrid mlp 2 nodes x 2": MLP + ["--mode", "hybrid", "--gpus", "2", "--batch", "24"],
    "ps mlp 3 workers, synchronous": MLP + ["--mode", "ps", "--gpus", "3", "--batch", "24",
                                            "--max-staleness", "0"],
}


def losses_of(build, flags):
    """The per-step losses of each run in one dp_bench report, keyed by mode and device count."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        cmd = [os.path.join(build, "bin", "dp_bench"), "--device", "cpu", "--baseline", "0",
               "--json", path] + flags
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            sys.exit(f"mode_losses: {' '.join(cmd[1:])} failed ({done.returncode}):\n{done.stdout}")
        with open(path) as f:
            report = json.load(f)
    out = {}
    for run in report.get("runs", []):
        out[f"{run['mode']} x{run['gpus']}"] = run["losses"]
    for key in ("dp", "ps"):  # the parameter server's report: its own curve beside DP's
        if isinstance(report.get(key), dict) and "curve" in report[key]:
            out[f"{key} curve"] = [p["loss"] for p in report[key]["curve"]]
    if not out:
        sys.exit(f"mode_losses: {' '.join(flags)}: the report holds no losses")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build-dev")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", metavar="JSON", help="write every case's losses here")
    group.add_argument("--check", metavar="JSON", help="compare every case with this record")
    ap.add_argument("--only", help="run the cases whose name contains this text")
    a = ap.parse_args()
    cases = {k: v for k, v in CASES.items() if not a.only or a.only in k}
    if a.record:
        record = {"cases": {}, "flags": {}}
        for name, flags in cases.items():
            record["cases"][name] = losses_of(a.build, flags)
            record["flags"][name] = flags
            print(f"recorded  {name}")
        with open(a.record, "w") as f:
            json.dump(record, f, indent=1)
        return 0
    with open(a.check) as f:
        record = json.load(f)["cases"]
    bad = 0
    for name, flags in cases.items():
        if name not in record:
            print(f"MISSING   {name}: not in {a.check}")
            bad += 1
            continue
        now, then = losses_of(a.build, flags), record[name]
        diffs = []
        for run in sorted(set(now) | set(then)):
            a_l, b_l = then.get(run), now.get(run)
            if a_l == b_l:
                continue
            if a_l is None or b_l is None or len(a_l) != len(b_l):
                diffs.append(f"{run}: {a_l} -> {b_l}")
                continue
            step = next(i for i, (x, y) in enumerate(zip(a_l, b_l)) if x != y)
            diffs.append(f"{run} step {step}: {a_l[step]!r} -> {b_l[step]!r}")
        print(f"{'same' if not diffs else 'DIFFERS':9s} {name}" +
              ("" if not diffs else ": " + "; ".join(diffs)))
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
