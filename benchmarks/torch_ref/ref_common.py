"""What dp_ref.py and ddp_ref.py share: dp_bench's flags, the data, the optimizer and the report
(the JSON fields of benchmarks/report.cpp)."""

import argparse
import json

import torch

import engine_compat as ec
import models

LR, MOMENTUM = 0.05, 0.9  # bench_common.cpp optimizer_config()


def add_flags(ap):
    ap.add_argument("--gpus", type=int, default=0,
                    help="devices (DP) or ranks (DDP); 0: all visible GPUs, or 1 on the CPU")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn", "resnet", "gpt"])
    ap.add_argument("--gpt-config", default="tiny", choices=sorted(ec.GPT_PRESETS),
                    help="--model gpt: the nn/gpt.hpp preset")
    ap.add_argument("--seq", type=int, default=0,
                    help="--model gpt: tokens per sequence (0: the preset's context)")
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--batch-per-device", type=int, default=0,
                    help="per-device batch (global = N x this); overrides --batch")
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "tf32", "bf16", "fp16"],
                    help="bf16/fp16: torch.autocast around forward and loss (fp16 with GradScaler)")
    ap.add_argument("--activations", default="auto", choices=["auto", "f32", "bf16"],
                    help="ours: dp_bench's --activations (auto: bf16 with --dtype bf16, as "
                         "torch.autocast hands its matmuls' bf16 outputs on; else f32)")
    ap.add_argument("--seed", type=int, default=1, help="model and data seed")
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                    help="DDP backend (DP ignores it)")
    ap.add_argument("--json", dest="json_path", help="write the report as JSON")
    return ap


def parser(description):
    return add_flags(argparse.ArgumentParser(description=description))


def model_name(args):
    """dp_bench's model name: mlp | cnn | resnet, or gpt-<preset>."""
    return f"gpt-{args.gpt_config}" if args.model == "gpt" else args.model


def seq_len(args):
    return args.seq or ec.GPT_PRESETS[args.gpt_config][1]


def activations(args):
    """dp_bench's --activations for these flags: auto is bf16 under --dtype bf16, else f32."""
    if args.activations == "auto":
        return "bf16" if args.dtype == "bf16" else "f32"
    return args.activations


def bench_flags(args):
    """The flags that give dp_bench this model, optimizer (dp_bench's GPT default: AdamW) and
    activation dtype."""
    acts = ["--activations", activations(args)]
    if args.model != "gpt":
        return ["--model", args.model, *acts]
    return ["--model", "gpt", "--gpt-config", args.gpt_config, "--seq", str(seq_len(args)),
            "--optim", "adamw", *acts]


def global_batch(args, n):
    return args.batch_per_device * n if args.batch_per_device > 0 else args.batch


def set_math(dtype):
    """fp32: no TF32 anywhere (torch lets cuDNN use TF32 by default); tf32: both."""
    tf32 = dtype == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


class Amp:
    """torch.autocast and GradScaler for --dtype bf16/fp16; a no-op for fp32/tf32."""

    def __init__(self, dtype, device_type):
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type, enabled=dtype == "fp16")

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def backward_and_step(self, loss, opt):
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()


def dataset(args, batch):
    """bench_dataset(): samples [s B, (s + 1) B) are the global batch of step s; --model gpt:
    dp::data::synthetic_token_batch of step s."""
    if args.model == "gpt":
        return ec.SyntheticTokens(ec.GPT_PRESETS[args.gpt_config][0], seq_len(args), args.seed)
    # dp_bench's data set: signal kBenchSignal = 0.12 (benchmarks/bench_common.hpp), noise 1.
    return ec.SyntheticDataset((args.steps + args.warmup) * batch, (1, 28, 28), 10, args.seed,
                               signal=0.12)


def host_batch(ds, first, count, pin):
    """(images float32 (count, 1, 28, 28), labels int64 (count)) as CPU tensors; tokens:
    (ids, targets) int64 (count, seq)."""
    x, y = ds.batch(first, count)
    if x.dtype.kind == "i":
        x = x.astype("int64")
    x, y = torch.from_numpy(x), torch.from_numpy(y.astype("int64"))
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# bench_common.cpp make_optimizer() for --optim adamw: kernels::AdamWConfig's defaults.
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def loss_fn(pred, target):
    """The engines' loss: row cross-entropy, or token cross-entropy over (B, T, V) logits (the
    mean over every token, nn::TokenCrossEntropyLoss)."""
    if pred.dim() == 3:
        return torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]),
                                                 target.reshape(-1))
    return torch.nn.functional.cross_entropy(pred, target)


def percentile(values, q):
    """report.cpp percentile(): linear interpolation, 0 for an empty list."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def dp_bytes_theory(n, p):
    return 2 * (n - 1) * p


def ring_bytes_theory(n, p):
    return 0 if n <= 1 else 2 * (n - 1) * p // n


def run_record(mode, n, batch, step_ms, param_bytes, bytes_theory, peak, losses):
    """One entry of "runs", as report.cpp run_to_json() writes it. Torch does not report the
    bytes it copies: bytes_per_step is the formula's value (see "bytes_per_step_source")."""
    median = percentile(step_ms, 0.5)
    return {"mode": mode, "gpus": n, "batch": batch, "step_ms": step_ms,
            "step_ms_median": median, "step_ms_p90": percentile(step_ms, 0.9),
            "samples_per_s": batch * 1000.0 / median if median > 0 else 0.0,
            "phases_ms": {"step": median}, "param_bytes": param_bytes,
            "bytes_per_step": bytes_theory, "bytes_per_step_source": "theory",
            "bytes_theory": bytes_theory, "peak_mem_bytes": peak, "losses": losses,
            "final_loss": losses[-1] if losses else 0.0}


def report(args, device, physical, logical, runs, notes):
    """Prints a short summary and writes the JSON report (report.cpp to_json() fields)."""
    params = sum(v.size for _, v in ec.init_params(args.model, args.seed))
    base = {r["mode"]: r for r in runs if r["gpus"] == 1}
    for r in runs:
        b = base.get(r["mode"])
        if b and r["step_ms_median"] > 0:
            r["speedup"] = b["step_ms_median"] / r["step_ms_median"]
            r["efficiency"] = r["speedup"] / r["gpus"]
    out = {"device": device, "physical_devices": physical, "logical_devices": logical,
           "oversubscribed": False, "model": args.model, "params": int(params),
           "dtype": args.dtype, "framework": f"torch {torch.__version__}", "runs": runs,
           "note": "; ".join(notes)}
    for note in notes:
        print(f"note: {note}")
    for r in runs:
        print(f"{r['mode']:9s} N={r['gpus']} batch {r['batch']}: step {r['step_ms_median']:.3f} ms "
              f"median / {r['step_ms_p90']:.3f} p90, {r['samples_per_s']:.0f} samples/s, "
              f"final loss {r['final_loss']:.6f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        print(f"json: {args.json_path}")
    return out


def build_model(args):
    return models.build(model_name(args), args.seed)
