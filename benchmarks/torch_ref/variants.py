"""Ours (dp_bench --mode dp --gpus 1) against PyTorch's best single-device setups, K interleaved
repeats, ratio of medians with a 95% bootstrap interval.

  python3 variants.py --build BUILD --model mlp --batch 256 --steps 200 --warmup 20 --repeat 5

Variants, all on one device, on the model, weights, data, batch and steps of dp_bench:
  eager    the plain module, no DataParallel wrapper, SGD(fused=True) (foreach, with a note,
           where fused is refused)
  graph    the whole step (forward, loss, backward, SGD step) captured once in a
           torch.cuda.CUDAGraph over static input buffers and replayed (CUDA only)
  compile  torch.compile(model, mode="reduce-overhead") on CUDA, torch.compile(model) on CPU
For repeat k = 1..K it runs dp_bench (a new process each time), then each variant in this
process (a fresh model from the same seed), so drift hits all alike. A repeat's sample is its
median step time; per variant the table gives the median of the K samples of ours and of the
variant, ours/variant, a 95% bootstrap interval (stats.py) and "ours faster", "ours slower" or
"within noise" (the interval contains 1). The loss curves must agree (same work). First, a
same-work check: ours and each variant train steps 3..7 from the seed's weights, and a loss gap
above the tolerance of the dtype (fp32 1e-3) there is flagged "NOT THE SAME WORK" and makes the
exit status 1. The largest |loss gap| over all timed steps and repeats is printed too, but not
held to it: float rounding differences between two correct engines grow with training (fp32 mlp,
seen 2e-7 at the first timed step, 1e-3 by timed step 70, 5e-3 by 160; resnet at batch 32 drifts
by 1e-2 within 30 steps, torch eager against torch compile as much). A variant that cannot
run here is skipped with one line saying why, and recorded under "skipped" in the JSON. Each
variant's check runs just before its first timed steps (in repeat 1), so a slow one (compile's
compilation) holds back only itself.
Every measurement is printed (flushed) as it is taken. --budget-s S: seconds from this process's
start (torch's import included); when they run out, wherever the run is, it stops, reports what
it measured, names what it did not reach ("not reached:", and "not_reached" in the JSON), and
exits 3 (1 still where the work differs).
Clock: from the host batch (made and pinned before the clock starts) to the updated weights,
one loss read (.item()) per step, the device synchronised; the garbage collector is off while
the steps run.
"""

import argparse
import copy
import gc
import inspect
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

START = time.monotonic()  # --budget-s counts from here: torch's import is in it

import torch  # noqa: E402

import ref_common as rc  # noqa: E402
import stats  # noqa: E402

VARIANTS = ("eager", "graph", "compile")
GRAPH_SIDE_WARMUP = 3  # eager steps on a side stream before capture (PyTorch's recipe)
LOSS_TOLERANCE = {"fp32": 1e-3, "tf32": 1e-2, "bf16": 5e-2, "fp16": 5e-2}
CHECK_WARMUP, CHECK_STEPS = GRAPH_SIDE_WARMUP, 5  # the same-work check: steps 3..7
MAX_REPEAT = 1000


class Skip(Exception):
    """A variant that cannot run here; the message says why, in one line."""


class OutOfBudget(BaseException):
    """--budget-s ran out. A BaseException, so that no `except Exception` (a variant that fails
    is skipped) takes it for a failure."""


class Budget:
    """--budget-s: seconds from START. arm() sets an alarm that raises OutOfBudget in the main
    thread wherever it is (a timed loop, torch.compile's compilation, waiting on dp_bench, which
    subprocess.run then kills); spent says it rang; 0 seconds: no budget."""

    def __init__(self, seconds):
        self.seconds, self.spent, self.armed = seconds, False, False

    def left(self):
        return self.seconds - (time.monotonic() - START) if self.seconds else math.inf

    def _ring(self, signum, frame):
        if self.armed:  # not once disarm() has begun
            self.spent = True
            raise OutOfBudget()

    def arm(self):
        if not self.seconds:
            return
        if self.left() <= 0:
            self.spent = True
            raise OutOfBudget()
        self.armed = True
        signal.signal(signal.SIGALRM, self._ring)
        signal.setitimer(signal.ITIMER_REAL, self.left())

    def disarm(self):
        self.armed = False
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)


SEED_MODELS = {}


def seed_model(args):
    """rc.build_model(args), built once per process and copied after: the engine's initial
    weights come from a NumPy port of its generator, about 80 s for GPT-2 124M's 124M values on
    one core here (est. from one 4M chunk), and every variant and repeat starts from them."""
    key = (rc.model_name(args), args.seed)
    if key not in SEED_MODELS:
        SEED_MODELS[key] = rc.build_model(args)
    return copy.deepcopy(SEED_MODELS[key])


def one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sgd(params, device, capturable=False):
    """SGD lr 0.05 momentum 0.9 (ref_common), fused where this build allows it on `device`,
    else foreach; capturable=True where this torch's SGD takes it (graph capture). Returns
    (optimizer, notes saying which)."""
    params = list(params)
    accepted = inspect.signature(torch.optim.SGD).parameters
    extra, notes = {}, []
    if capturable:
        if "capturable" in accepted:
            extra["capturable"] = True
        else:
            notes.append("this torch's SGD takes no capturable= (it needs none: it keeps no "
                         "host-side step count)")
    if "fused" in accepted:
        try:
            opt = torch.optim.SGD(params, lr=rc.LR, momentum=rc.MOMENTUM, fused=True, **extra)
            return opt, notes + ["optimizer SGD fused"]
        except (RuntimeError, ValueError) as e:
            notes.append(f"SGD(fused=True) refused on {device.type} ({one_line(e)}): foreach used")
    else:
        notes.append("this torch's SGD has no fused=: foreach used")
    opt = torch.optim.SGD(params, lr=rc.LR, momentum=rc.MOMENTUM, foreach=True, **extra)
    return opt, notes + ["optimizer SGD foreach"]


def adamw(params, device, capturable=False):
    """AdamW with dp_bench's settings (ref_common.ADAMW), fused where this build allows it on
    `device`, else foreach; capturable=True for graph capture (its step count stays on the
    device). Returns (optimizer, notes saying which)."""
    params = list(params)
    extra = {"capturable": True} if capturable else {}
    try:
        opt = torch.optim.AdamW(params, fused=True, **rc.ADAMW, **extra)
        return opt, ["optimizer AdamW fused"]
    except (RuntimeError, ValueError, TypeError) as e:
        note = f"AdamW(fused=True) refused on {device.type} ({one_line(e)}): foreach used"
    opt = torch.optim.AdamW(params, foreach=True, **rc.ADAMW, **extra)
    return opt, [note, "optimizer AdamW foreach"]


def optimizer(args, params, device, capturable=False):
    """dp_bench's optimizer for the model: SGD, or AdamW for --model gpt."""
    return (adamw if args.model == "gpt" else sgd)(params, device, capturable)


def timed_steps(args, ds, batch, device, step_fn, first=0):
    """Runs steps first..warmup+steps-1; step_fn(x, y) takes the host batch, trains one step and
    returns the loss tensor. Returns (step_ms, losses) of the timed steps."""
    pin = device.type == "cuda"
    step_ms, losses = [], []
    gc.collect()
    gc.disable()  # no collection inside a timed step; re-enabled below whatever happens
    try:
        for step in range(first, args.warmup + args.steps):
            x, y = rc.host_batch(ds, step * batch, batch, pin=pin)
            sync(device)
            t0 = time.perf_counter()
            value = step_fn(x, y).item()
            sync(device)
            ms = (time.perf_counter() - t0) * 1000.0
            if step >= args.warmup:
                step_ms.append(ms)
                losses.append(value)
    finally:
        gc.enable()
    return step_ms, losses


def eager_step(net, opt, amp, device, begin=None):
    def step(x, y):
        if begin is not None:
            begin()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = rc.loss_fn(net(x), y)
        amp.backward_and_step(loss, opt)
        return loss
    return step


def run_eager(args, ds, batch, device, state):
    model = seed_model(args).to(device)
    opt, notes = optimizer(args, model.parameters(), device)
    step_ms, losses = timed_steps(args, ds, batch, device,
                                  eager_step(model, opt, rc.Amp(args.dtype, device.type), device))
    return step_ms, losses, notes


def run_graph(args, ds, batch, device, state):
    """PyTorch's whole-network capture: warm up on a side stream, capture forward, loss, backward
    and the optimizer step once, then per step copy the host batch into the static inputs and
    replay. The side-stream warm-up trains the first GRAPH_SIDE_WARMUP warm-up steps for real, so
    the loss curve stays dp_bench's."""
    if device.type != "cuda":
        raise Skip("CUDA graphs need a CUDA device (this run is on the CPU)")
    if args.dtype == "fp16":
        raise Skip("fp16 needs GradScaler, whose scale update reads back to the host: "
                   "not capturable")
    if args.warmup < GRAPH_SIDE_WARMUP:
        raise Skip(f"needs --warmup >= {GRAPH_SIDE_WARMUP}: the side-stream warm-up before "
                   f"capture trains real steps (got {args.warmup})")
    amp_dtype = torch.bfloat16 if args.dtype == "bf16" else None

    def autocast():  # the autocast cache must be off under graph capture
        return torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None,
                              cache_enabled=False)

    model = seed_model(args).to(device)
    # SGD keeps no host-side step count (unlike Adam): its step is capturable as it is. Where
    # this torch's SGD takes capturable=, it is set, as the recipe says. AdamW (--model gpt)
    # needs capturable=True: its step count then lives on the device.
    opt, notes = optimizer(args, model.parameters(), device, capturable=True)
    x0, y0 = rc.host_batch(ds, 0, batch, pin=False)
    static_x = torch.empty(x0.shape, dtype=x0.dtype, device=device)
    static_y = torch.empty(y0.shape, dtype=y0.dtype, device=device)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in range(GRAPH_SIDE_WARMUP):  # steps 0..2 of the warm-up, untimed
            x, y = rc.host_batch(ds, step * batch, batch, pin=True)
            static_x.copy_(x, non_blocking=True)
            static_y.copy_(y, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = rc.loss_fn(model(static_x), static_y)
            loss.backward()
            opt.step()
            side.synchronize()  # the pinned host batch lives until its copy is done
    torch.cuda.current_stream(device).wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # backward in the capture allocates .grad from its pool
    with torch.cuda.graph(graph):
        with autocast():
            static_loss = rc.loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()  # capture records the work; nothing ran, so the weights are unchanged

    def step(x, y):
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        return static_loss

    step_ms, losses = timed_steps(args, ds, batch, device, step, first=GRAPH_SIDE_WARMUP)
    return step_ms, losses, notes


def run_compile(args, ds, batch, device, state):
    """torch.compile of the module (reduce-overhead: CUDA graph trees, on CUDA). The compiled
    module is made once and kept across repeats (re-compiling each repeat would hit dynamo's
    recompile limit); each repeat loads the seed's weights into it again, resets BatchNorm's
    running statistics and makes a new optimizer, so every repeat trains the same steps."""
    if "compiled" not in state:
        model = seed_model(args).to(device)
        mode = "reduce-overhead" if device.type == "cuda" else None
        state["model"] = model
        state["compiled"] = torch.compile(model, mode=mode) if mode else torch.compile(model)
        state["mode"] = mode or "default"
    else:
        model = state["model"]
        fresh = seed_model(args)
        with torch.no_grad():
            for p, q in zip(model.parameters(), fresh.parameters()):
                p.copy_(q)
            for b, c in zip(model.buffers(), fresh.buffers()):
                b.copy_(c)
    opt, notes = optimizer(args, model.parameters(), device)
    begin = None
    if device.type == "cuda" and hasattr(torch, "compiler") and hasattr(
            torch.compiler, "cudagraph_mark_step_begin"):
        begin = torch.compiler.cudagraph_mark_step_begin  # one graph-tree step per train step
    step_ms, losses = timed_steps(
        args, ds, batch, device,
        eager_step(state["compiled"], opt, rc.Amp(args.dtype, device.type), device, begin))
    notes = [f"torch.compile mode {state['mode']}"] + notes
    return step_ms, losses, notes


RUNNERS = {"eager": run_eager, "graph": run_graph, "compile": run_compile}


def run_ours(args, bench, batch, path, log_path):
    """One dp_bench process: --mode dp --gpus 1 --baseline 0 with the same work; its run."""
    cmd = [bench, "--mode", "dp", "--gpus", "1", "--baseline", "0", "--json", path,
           "--device", args.device, *rc.bench_flags(args), "--batch", str(batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
           "--seed", str(args.seed)]
    with open(log_path, "w") as log:
        rc_ = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc_ != 0:
        with open(log_path) as log:
            tail = log.read()[-2000:]
        raise SystemExit(f"variants: dp_bench failed (exit {rc_}): {' '.join(cmd)}\n{tail}")
    with open(path) as f:
        report = json.load(f)
    runs = report.get("runs") or []
    if not runs or not runs[0].get("step_ms"):
        raise SystemExit(f"variants: {path} has no runs[0].step_ms")
    return report, runs[0]


def summary(step_ms, losses):
    """One repeat's figures; the load average says how busy the machine was."""
    return {"step_ms_median": stats.median(step_ms), "step_ms_p90": rc.percentile(step_ms, 0.9),
            "step_ms": step_ms, "losses": losses, "final_loss": losses[-1] if losses else None,
            "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def command_output(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def cpu_model():
    text = command_output(["lscpu"]) or ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device):
    env = {"cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "platform": platform.platform(), "gpu": None, "driver": None}
    if torch.backends.cudnn.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        smi = command_output(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader", "-i", str(device.index or 0)])
        if smi and "," in smi:
            env["driver"] = smi.strip().splitlines()[0].split(",")[-1].strip()
        else:  # torch gives the CUDA driver API version, not the NVIDIA driver's own
            api = getattr(torch._C, "_cuda_getDriverVersion", lambda: "unknown")()
            env["driver"] = f"CUDA driver API {api} (no nvidia-smi)"
    return env


def parse_args():
    ap = rc.parser(__doc__.split("\n")[0])
    ap.set_defaults(steps=200, warmup=20)
    ap.add_argument("--build", required=True, help="the build folder holding bin/dp_bench")
    ap.add_argument("--repeat", type=int, default=5,
                    help="interleaved repeats K (each gives one sample per variant)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--resamples", type=int, default=stats.DEFAULT_RESAMPLES,
                    help="bootstrap resamples (2000 to 1000000)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT_DIR"),
                    help="where dp_bench's reports go (default $OUT_DIR, else a new temp folder)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads for the CPU variants (0: torch's default, one "
                         "per core; OpenMP's spinning threads suffer most on a busy machine)")
    ap.add_argument("--baseline", type=int, default=0, help="accepted for dp_bench's flags; unused")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="seconds this run may take from its start (0: no limit); when they run "
                         "out it reports what it measured, names what it did not reach and "
                         "exits 3")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        ap.error(f"--variants {args.variants!r}: give a comma-separated subset of "
                 f"{','.join(VARIANTS)}")
    args.variant_names = names
    if not 2 <= args.repeat <= MAX_REPEAT:
        ap.error(f"--repeat {args.repeat}: give a whole number in [2, {MAX_REPEAT}] "
                 f"(5 or more for a useful interval)")
    if args.gpus not in (0, 1):
        ap.error(f"--gpus {args.gpus}: the variants run on one device (N > 1: side_by_side.sh "
                 f"runs dp_ref.py and ddp_ref.py)")
    if not 0 <= args.torch_threads <= 4096:
        ap.error(f"--torch-threads {args.torch_threads}: give a whole number in [0, 4096]")
    if not 0 <= args.budget_s <= 1e6:
        ap.error(f"--budget-s {args.budget_s:g}: give seconds in [0, 1000000] (0: no limit)")
    if not 2000 <= args.resamples <= 1_000_000:
        ap.error(f"--resamples {args.resamples}: give a whole number in [2000, 1000000]")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.batch_per_device < 0:
        ap.error("--steps and --batch must be >= 1, --warmup and --batch-per-device >= 0")
    bench = os.path.join(args.build, "bin", "dp_bench")
    if not os.access(bench, os.X_OK):
        ap.error(f"--build {args.build}: no {bench} (cmake --build {args.build} --target dp_bench)")
    args.bench = bench
    return args


def run_variant(v, args, ds, batch, device, state, when, skipped, budget):
    """(step_ms, losses, notes) of variant v, or None once it is recorded in `skipped` with the
    reason, printed in one line. A failure after the budget rang is the budget's (the alarm
    inside a capture or a compilation can come out as torch's own error): OutOfBudget."""
    try:
        return RUNNERS[v](args, ds, batch, device, state)
    except Skip as e:
        skipped[v] = str(e)
    except Exception as e:  # a variant failing here (e.g. no compiler) is skipped, not fatal
        if budget.spent:
            raise OutOfBudget() from e
        skipped[v] = f"failed in {when}: {one_line(e)}"
    print(f"{v}: skipped: {skipped[v]}")
    state.clear()
    return None


def check_args(args):
    """The same-work check's settings: CHECK_STEPS steps after CHECK_WARMUP."""
    check = argparse.Namespace(**vars(args))
    check.warmup, check.steps = CHECK_WARMUP, CHECK_STEPS
    return check


# The same-work check: ours and each variant train CHECK_STEPS steps after CHECK_WARMUP from the
# seed's weights; check["gaps"][variant] is the largest |loss gap| there. Early in training the gap
# is float rounding (check_compat.py sees at most 1.5e-5); different work (data, weights,
# optimizer) shows at once. Ours is checked first; each variant just before its first timed
# steps, so that its compilation, if any, is in no repeat and holds back no other variant.
def check_ours(args, batch, out_dir, check):
    t0 = time.monotonic()
    _, run = run_ours(check_args(args), args.bench, batch, os.path.join(out_dir, "ours_check.json"),
                      os.path.join(out_dir, "ours_check.log"))
    check["ours_losses"] = run.get("losses", [])
    print(f"check: ours trained steps {CHECK_WARMUP}..{CHECK_WARMUP + CHECK_STEPS - 1} "
          f"({time.monotonic() - t0:.1f} s)")


def check_variant(v, args, ds_check, batch, device, state, skipped, check, budget):
    """Variant v's part of the check; False where v was skipped."""
    t0 = time.monotonic()
    got = run_variant(v, check_args(args), ds_check, batch, device, state, "the same-work check",
                      skipped, budget)
    if got is None:
        return False
    ours, losses = check["ours_losses"], got[1]
    check["gaps"][v] = (max((abs(a - b) for a, b in zip(ours, losses)), default=float("nan"))
                        if len(losses) == len(ours) else float("inf"))
    print(f"check: {v} |loss gap| {check['gaps'][v]:.2e} ({time.monotonic() - t0:.1f} s)")
    return True


def check_line(check):
    return (f"same-work check, |loss ours - torch| over steps {CHECK_WARMUP}.."
            f"{CHECK_WARMUP + CHECK_STEPS - 1}: "
            + (", ".join(f"{v} {g:.2e}" for v, g in check["gaps"].items()) or "no variant ran"))


def measure(args, batch, device, out_dir, budget):
    """The check, then K interleaved repeats (ours, then each variant), each measurement printed
    as it is taken, until done or the budget rings. Returns (check, ours, results, skipped,
    ours_device): what was measured."""
    skipped, state = {}, {v: {} for v in args.variant_names}
    check = {"warmup": CHECK_WARMUP, "steps": CHECK_STEPS, "ours_losses": None, "gaps": {}}
    results = {v: {"repeats": [], "notes": []} for v in args.variant_names}
    ours, ours_device, said_check = [], None, False
    try:
        budget.arm()
        ds = rc.dataset(args, batch)
        ds_check = rc.dataset(check_args(args), batch)
        check_ours(args, batch, out_dir, check)
        for k in range(args.repeat):
            head = f"repeat {k + 1}/{args.repeat}:"
            t0 = time.monotonic()
            path = os.path.join(out_dir, f"ours_{k + 1}.json")
            report, run = run_ours(args, args.bench, batch, path,
                                   os.path.join(out_dir, f"ours_{k + 1}.log"))
            ours_device = report.get("device")
            ours.append(dict(summary(run["step_ms"], run.get("losses", [])), json=path))
            print(f"{head} ours {ours[-1]['step_ms_median']:.3f} ms ({time.monotonic() - t0:.1f} s)")
            for v in args.variant_names:
                if v in skipped or (v not in check["gaps"] and not check_variant(
                        v, args, ds_check, batch, device, state[v], skipped, check, budget)):
                    continue
                t0 = time.monotonic()
                got = run_variant(v, args, ds, batch, device, state[v], f"repeat {k + 1}", skipped,
                                  budget)
                if got is None:
                    continue
                step_ms, losses, notes = got
                results[v]["repeats"].append(summary(step_ms, losses))
                results[v]["notes"] = sorted(set(results[v]["notes"]) | set(notes))
                print(f"{head} {v} {results[v]['repeats'][-1]['step_ms_median']:.3f} ms "
                      f"({time.monotonic() - t0:.1f} s)")
            if not said_check:
                print(check_line(check))
                said_check = True
            if device.type == "cuda":
                torch.cuda.empty_cache()  # torch's cached blocks are not dp_bench's to compete with
    except OutOfBudget:
        budget.spent = True
        print(f"variants: the budget of {args.budget_s:g} s ran out "
              f"({time.monotonic() - START:.0f} s in): stopping with what was measured")
    finally:
        budget.disarm()
    if not said_check:
        print(check_line(check))
    for v in skipped:
        results.pop(v, None)
    return check, ours, results, skipped, ours_device


def not_reached(args, check, ours, results, skipped):
    """What the budget left unmeasured, per name: "compile: same-work check, repeats 1-3"."""
    out = []

    def missing(name, done, checked):
        said = [] if checked else ["same-work check"]
        if done < args.repeat:
            said.append(f"repeat {args.repeat}" if done + 1 == args.repeat
                        else f"repeats {done + 1}-{args.repeat}")
        if said:
            out.append(f"{name}: {', '.join(said)}")

    missing("ours", len(ours), check["ours_losses"] is not None)
    for v in args.variant_names:
        if v not in skipped:
            missing(v, len(results[v]["repeats"]), v in check["gaps"])
    return out


def main():
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is printed, also into a file
    args = parse_args()
    have_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not have_gpu:
        raise SystemExit("variants: --device cuda: torch sees no usable GPU")
    device = torch.device("cuda", 0) if have_gpu and args.device != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rc.set_math(args.dtype)
    torch.backends.cudnn.benchmark = args.model in ("cnn", "resnet")
    batch = rc.global_batch(args, 1)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="variants.")
    os.makedirs(out_dir, exist_ok=True)
    json_path = args.json_path or os.path.join(out_dir, "variants.json")
    tolerance = LOSS_TOLERANCE[args.dtype]

    print(f"variants: {rc.model_name(args)}"
          f"{f' seq {rc.seq_len(args)}' if args.model == 'gpt' else ''}, batch {batch}, {args.steps} timed steps after "
          f"{args.warmup} warm-up, {args.dtype}, torch on {device}"
          f"{f' ({torch.get_num_threads()} threads)' if device.type == 'cpu' else ''}, "
          f"{args.repeat} repeats; reports in {out_dir}")
    budget = Budget(args.budget_s)
    check, ours, results, skipped, ours_device = measure(args, batch, device, out_dir, budget)
    unmeasured = not_reached(args, check, ours, results, skipped)

    ours_medians = [r["step_ms_median"] for r in ours]
    table, mismatched = {}, []
    print(f"\n {'variant':8s} {'ours ms':>9s} {'torch ms':>9s} {'ours/torch':>10s}  "
          f"{'95% CI':17s} {'verdict':13s} |loss gap| check / timed")
    for v in args.variant_names:
        if v in skipped:
            print(f" {v:8s} skipped: {skipped[v]}")
            continue
        reps = results[v]["repeats"]
        if not reps:
            print(f" {v:8s} not reached: the budget ran out"
                  + (f" (same-work check {check['gaps'][v]:.2e})" if v in check["gaps"] else ""))
            if v in check["gaps"] and not check["gaps"][v] <= tolerance:
                mismatched.append(v)
            continue
        theirs = [r["step_ms_median"] for r in reps]
        ci = stats.bootstrap_ratio_ci(ours_medians, theirs, resamples=args.resamples)
        gap = max((abs(a - b) for o, t in zip(ours, reps)
                   for a, b in zip(o["losses"], t["losses"])), default=float("nan"))
        same_len = all(len(o["losses"]) == len(t["losses"]) for o, t in zip(ours, reps))
        same_work = same_len and check["gaps"][v] <= tolerance
        word = stats.verdict(ci)
        table[v] = dict(results[v], ours_ms=stats.median(ours_medians),
                        torch_ms=stats.median(theirs), ratio=ci.ratio, ci95=[ci.lo, ci.hi],
                        verdict=word, loss_gap_check=check["gaps"][v], max_loss_gap=gap,
                        same_work=same_work)
        print(f" {v:8s} {stats.median(ours_medians):9.3f} {stats.median(theirs):9.3f} "
              f"{ci.ratio:10.3f}  [{ci.lo:6.3f}, {ci.hi:6.3f}]  {word:13s} "
              f"{check['gaps'][v]:.2e} / {gap:.2e}")
        if not same_work:
            mismatched.append(v)
    for v in mismatched:
        print(f"!! {v}: NOT THE SAME WORK: ours and {v} differ by {check['gaps'][v]:.2e} "
              f"in the same-work check (tolerance {tolerance:g} for {args.dtype}) or in the "
              f"number of losses: its timing compares different training")
    for v in table:
        for note in table[v]["notes"]:
            print(f"note: {v}: {note}")
    print(f"ours/torch < 1: ours takes less time per step. 95% CI: bootstrap over the "
          f"{len(ours)} repeats; 'within noise': the interval contains 1. |loss gap| timed: "
          f"the largest over all timed steps and repeats (rounding grows with training)")
    if unmeasured:
        print(f"not reached (the budget of {args.budget_s:g} s ran out): " + "; ".join(unmeasured))
    torch_device = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    if ours_device is not None and (ours_device == "cpu") != (device.type == "cpu"):
        print(f"!! ours ran on {ours_device!r}, torch on {torch_device!r}: not the same device")

    if args.model == "gpt":  # tokens/s of ours and each variant, from the median steps
        tokens = batch * rc.seq_len(args)
        for v in table:
            table[v]["tokens_per_s_ours"] = tokens * 1000.0 / table[v]["ours_ms"]
            table[v]["tokens_per_s_torch"] = tokens * 1000.0 / table[v]["torch_ms"]
            print(f"tokens/s: {v}: ours {table[v]['tokens_per_s_ours']:.0f}, torch "
                  f"{table[v]['tokens_per_s_torch']:.0f}")
    out = {"model": rc.model_name(args), "batch": batch,
           "seq": rc.seq_len(args) if args.model == "gpt" else None, "steps": args.steps, "warmup": args.warmup,
           "dtype": args.dtype, "activations_ours": rc.activations(args), "seed": args.seed,
           "repeat": args.repeat,
           "resamples": args.resamples, "ci_level": 0.95, "loss_tolerance": tolerance,
           "ours_device": ours_device, "torch_device": torch_device,
           "cudnn_benchmark": torch.backends.cudnn.benchmark,
           "command": ["variants.py"] + sys.argv[1:], "environment": environment(device),
           "same_work_check": check, "ours": {"repeats": ours}, "variants": table,
           "skipped": skipped, "budget_s": args.budget_s or None, "not_reached": unmeasured}
    try:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise SystemExit(f"variants: could not write {json_path}: {e}")
    print(f"json: {json_path}")
    return 1 if mismatched else 3 if unmeasured else 0


if __name__ == "__main__":
    sys.exit(main())
