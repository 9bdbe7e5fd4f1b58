"""Checks engine_compat.py bit for bit against numbers dumped by the C++ engine.

  python3 check_compat.py --reference ref.json     # a file written by dump_reference
  python3 check_compat.py --engine-build BUILD_DIR # compiles dump_reference with g++ first

--engine-build needs a CPU build (DP_CUDA=OFF) with BUILD_DIR/kernels/libdp_kernels.a; the
g++ build takes about a minute. Checked bit for bit: Philox, mix_key, uniform, synthetic labels
and images, and the names, shapes, order and initial values of the bench models' parameters.
When torch is importable, the torch models of models.py are also compared with the engine's
initial parameters (bit for bit), and a few CPU training steps with the engine's losses (close,
not bit-exact: summation orders differ). Needs numpy; torch is optional.
Prints one PASS/FAIL/SKIP line per check; exits 1 on any FAIL.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import engine_compat as ec  # noqa: E402

failures = 0


def report(ok, what, detail=""):
    global failures
    failures += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""))


def as_bits(values):
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def compare_bits(what, got, want_bits):
    got, want = as_bits(got).ravel(), np.asarray(want_bits, dtype=np.uint32).ravel()
    if got.shape != want.shape:
        report(False, what, f"{got.size} values, expected {want.size}")
        return
    bad = np.flatnonzero(got != want)
    detail = f"{want.size} values" if bad.size == 0 else (
        f"{bad.size} of {want.size} differ, first at {bad[0]}: "
        f"{got.view(np.float32)[bad[0]]!r} vs {want.view(np.float32)[bad[0]]!r}")
    report(bad.size == 0, what, detail)


def build_reference(engine_root, build_dir, out_dir, seed):
    """Compiles dump_reference.cpp with g++ against an engine build and runs it; returns the
    JSON path. The data code already needs the kernels library (Tensor), so it is required."""
    lib = os.path.join(build_dir, "kernels", "libdp_kernels.a")
    if not os.path.exists(lib):
        raise SystemExit(f"check_compat: no {lib}: build the engine's kernels first "
                         f"(a CPU build will do) or pass --reference")
    exe = os.path.join(out_dir, "dump_reference")
    cmd = ["g++", "-std=c++17", "-O2", "-I", engine_root,
           os.path.join(HERE, "dump_reference.cpp"),
           os.path.join(engine_root, "dp", "data", "synthetic.cpp"),
           os.path.join(engine_root, "dp", "data", "dataset.cpp"), lib, "-ltbb", "-lopenblas",
           "-o", exe]
    cache = os.path.join(build_dir, "CMakeCache.txt")
    if os.path.exists(cache) and "DP_CUDA:BOOL=ON" in open(cache).read():
        raise SystemExit(f"check_compat: {build_dir} is a CUDA build: pass a CPU build "
                         f"(-DDP_CUDA=OFF), whose kernels library links without the CUDA libraries")
    print("building:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    path = os.path.join(out_dir, "ref.json")
    subprocess.run([exe, path, str(seed)], check=True)
    return path


def check_random(ref):
    for case in ref["philox"]:
        words = ec.philox4x32(np.uint64(int(case["key"])), np.uint64(int(case["ctr"])))
        got = [int(w) for w in words]
        report(got == case["words"], f"philox4x32(key={case['key']}, ctr={case['ctr']})")
    got = [int(ec.mix_key(int(m["seed"]), int(m["a"]), int(m["b"]))) for m in ref["mix_key"]]
    want = [int(m["key"]) for m in ref["mix_key"]]
    report(got == want, f"mix_key, {len(want)} (seed, a, b) triples")
    key = int(ref["stream_key"])
    i = np.arange(len(ref["random_u32"]), dtype=np.uint64)
    report([int(w) for w in ec.random_u32(key, i)] == ref["random_u32"], "random_u32, 64 words")
    compare_bits("uniform, 64 values", ec.uniform(key, i), ref["uniform_bits"])


def check_synthetic(ref, seed):
    syn = ref["synthetic"]
    ds = ec.SyntheticDataset(syn["size"], (1, 28, 28), 10, seed)
    labels = ds.labels(np.arange(len(syn["labels"])))
    report(labels.tolist() == syn["labels"], f"synthetic labels of samples 0..{len(labels) - 1}")
    indices = [s["index"] for s in syn["samples"]]
    images, labels = ds.samples(np.array(indices))
    for k, s in enumerate(syn["samples"]):
        report(int(labels[k]) == s["label"], f"synthetic label of sample {s['index']}")
        compare_bits(f"synthetic image of sample {s['index']}", images[k], s["bits"])
    batch, _ = ds.batch(255, 2)  # make_batch(first, count) is samples first..first+count-1
    compare_bits("synthetic batch [255, 257)", batch, syn["samples"][3]["bits"]
                 + syn["samples"][4]["bits"])
    odd = syn["odd"]
    small = ec.SyntheticDataset(10, odd["shape"], odd["classes"], seed)
    img, lab = small.samples(np.array([odd["index"]]))
    report(int(lab[0]) == odd["label"], "synthetic label, odd shape (3, 5), 7 classes")
    compare_bits("synthetic image, odd shape (3, 5)", img, odd["bits"])


def check_params(ref, seed):
    if "params" not in ref:
        print("SKIP  initial parameters (reference built without the kernels library)")
        return
    try:
        import torch  # noqa: F401
        import models
    except ImportError:
        models = None
    for name, want in ref["params"].items():
        spec = ec.model_params(name)
        ours = [(n, list(s)) for n, s, _ in spec]
        theirs = [(p["name"], list(p["shape"])) for p in want["parameters"]]
        report(ours == theirs, f"{name}: parameter names, shapes and order ({len(theirs)})")
        compare_bits(f"{name}: initial flat parameters, seed {seed}", ec.flat_params(name, seed),
                     want["bits"])
        if models is None:
            print(f"SKIP  {name}: torch model parameters (torch is not installed)")
            continue
        model = models.build(name, seed)
        flat = np.concatenate([p.detach().cpu().numpy().ravel() for p in model.parameters()])
        compare_bits(f"{name}: torch model parameters after models.build", flat, want["bits"])


def check_training(ref, seed, tolerance=1e-3):
    """Trains the torch models on the CPU as dump_reference trained the engine's: close losses."""
    if "train" not in ref:
        print("SKIP  training losses (reference built without the kernels library)")
        return
    try:
        import torch
        import models
    except ImportError:
        print("SKIP  training losses (torch is not installed)")
        return
    torch.backends.mkldnn.enabled = False  # plain fp32 kernels on the CPU
    batch, steps = ref["train"]["batch"], ref["train"]["steps"]
    ds = ec.SyntheticDataset(batch * steps, (1, 28, 28), 10, seed)
    for name, want in ref["train"]["losses"].items():
        model = models.build(name, seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        got = []
        for s in range(steps):
            x, y = ds.batch(s * batch, batch)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                     torch.from_numpy(y).long())
            loss.backward()
            opt.step()
            got.append(loss.item())
        diff = max(abs(a - b) for a, b in zip(got, want))
        report(diff <= tolerance, f"{name}: torch vs engine losses, {steps} CPU steps of batch "
               f"{batch}", f"max |diff| {diff:.2e}, engine {want[-1]:.6f}, torch {got[-1]:.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", help="JSON written by dump_reference")
    ap.add_argument("--engine-build", help="engine build dir (for kernels/libdp_kernels.a)")
    ap.add_argument("--engine-root", default=os.path.normpath(os.path.join(HERE, "..", "..")))
    ap.add_argument("--seed", type=int, default=1, help="seed when building the reference")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.reference or build_reference(args.engine_root, args.engine_build, tmp,
                                                 args.seed)
        with open(path) as f:
            ref = json.load(f)
    seed = int(ref["seed"])
    check_random(ref)
    check_synthetic(ref, seed)
    check_params(ref, seed)
    check_training(ref, seed)
    print(f"{'FAIL' if failures else 'PASS'}: {failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
