"""PyTorch nn.DataParallel on the model, data, global batch and steps of `dp_bench --mode dp`.

  python3 dp_ref.py --gpus 4 --model mlp --batch 256 --steps 30 --warmup 5 --seed 1 --json out.json

Runs on cuda:0..N-1. DataParallel needs one real GPU per device: with fewer GPUs than N it runs
N = (number of GPUs) and says so (stdout and the JSON "note"); without a GPU it trains on one
CPU device. The model starts from the engine's weights for --seed (models.build), the global
batch of step s is synthetic samples [s B, (s + 1) B), split into chunks of B/N (+1 for the first
B % N) as the engine splits it, and SGD is lr 0.05, momentum 0.9: the loss curve should follow
dp_bench's. Each step is timed from the host batch to the updated weights, every device
synchronised (torch.cuda.synchronize + time.perf_counter).
"""

import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel._functions import Scatter

import engine_compat as ec
import ref_common as rc


class EngineChunksDataParallel(torch.nn.DataParallel):
    """DataParallel whose scatter uses the engine's chunk sizes (torch's own split gives
    ceil(B/N) to the first devices, which differs when N does not divide B)."""

    def scatter(self, inputs, kwargs, device_ids):
        (x,) = inputs
        sizes = ec.chunk_sizes(x.shape[self.dim], len(device_ids))
        chunks = Scatter.apply(device_ids, sizes, self.dim, x)
        return tuple((c,) for c in chunks), tuple({} for _ in chunks)


def sync(devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def run_dp(args, n, batch, use_cuda):
    devices = [torch.device("cuda", i) for i in range(n)] if use_cuda else [torch.device("cpu")]
    model = rc.build_model(args).to(devices[0])
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    opt = rc.sgd(model)  # the optimizer holds the parameters on device 0, as DataParallel wants
    net = EngineChunksDataParallel(model, device_ids=list(range(n))) if use_cuda else model
    ds = rc.dataset(args, batch)
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
    step_ms, losses = [], []
    amp = rc.Amp(args.dtype, devices[0].type)
    for step in range(args.warmup + args.steps):
        x, y = rc.host_batch(ds, step * batch, batch, pin=use_cuda)
        sync(devices)
        t0 = time.perf_counter()
        y = y.to(devices[0], non_blocking=True)
        if not use_cuda:
            x = x.to(devices[0])
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = F.cross_entropy(net(x), y)  # output gathered on device 0: the global mean
        amp.backward_and_step(loss, opt)
        value = loss.item()
        sync(devices)
        ms = (time.perf_counter() - t0) * 1000.0
        if step >= args.warmup:
            step_ms.append(ms)
            losses.append(value)
    peak = [torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0 for d in devices]
    return rc.run_record("torch_dp", n, batch, step_ms, param_bytes,
                         rc.dp_bytes_theory(n, param_bytes), peak, losses)


def main():
    ap = rc.parser(__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=int, default=1,
                    help="also run 1 device for speedup (1/0), as dp_bench does")
    args = ap.parse_args()
    if args.model == "gpt":  # its loss, optimizer and data are variants.py's (N = 1) only
        ap.error("--model gpt: the N > 1 references train the image models only; run "
                 "variants.py (one device) for GPT")
    rc.set_math(args.dtype)
    have_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not have_gpu:
        raise SystemExit("dp_ref: --device cuda: torch sees no usable GPU")
    use_cuda = have_gpu and args.device != "cpu"
    gpus = torch.cuda.device_count() if use_cuda else 0
    requested = args.gpus if args.gpus > 0 else max(gpus, 1)
    notes = []
    if use_cuda:
        n = min(requested, gpus)
        if n < requested:
            notes.append(f"asked for {requested} devices but DataParallel needs one real GPU per "
                         f"device and this machine has {gpus}: ran N={n}")
    else:
        n = 1
        notes.append("no GPU: torch DataParallel ran on one CPU device (figures are not "
                     "multi-GPU scaling)" + (f"; asked for {requested}" if requested > 1 else ""))
    batch = rc.global_batch(args, requested)  # the same global batch as dp_bench's at N
    if batch < n:
        raise SystemExit(f"dp_ref: global batch {batch} is smaller than {n} devices")
    if args.batch_per_device > 0 and n != requested:
        notes.append(f"global batch {batch} kept from --batch-per-device x {requested}")
    counts = ([1] if args.baseline and n > 1 else []) + [n]
    runs = [run_dp(args, k, batch, use_cuda) for k in counts]
    device = torch.cuda.get_device_name(0) if use_cuda else "cpu"
    physical = gpus if use_cuda else os.cpu_count()
    rc.report(args, device, physical, n, runs, notes)


if __name__ == "__main__":
    main()
