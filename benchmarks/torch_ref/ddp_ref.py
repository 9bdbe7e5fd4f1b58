"""PyTorch DistributedDataParallel on the model, data, global batch and steps of
`dp_bench --mode ddp`. Start it with torchrun, one process per rank:

  torchrun --standalone --nproc_per_node 4 ddp_ref.py --model mlp --batch 256 --steps 30 \
      --warmup 5 --seed 1 --json out.json

(`python3 -m torch.distributed.run` is the same as torchrun; plain `python3 ddp_ref.py` runs
one rank.) Backends:
  nccl  one distinct GPU per rank (cuda:LOCAL_RANK). NCCL refuses two ranks on one GPU.
  gloo  CPU tensors. The fallback when there are fewer GPUs than ranks: gloo's CUDA-tensor
        path stages through host memory and ranks sharing one GPU would time contention, not
        DDP, so this script does not run gloo on CUDA tensors.
  auto  (default) nccl when every local rank has its own GPU, else gloo on the CPU.
Rank r trains chunk r of each global batch (sizes B/N, +1 for the first B % N, as the engine
splits it) and scales its mean loss by size_r * N / B, so DDP's gradient average is the gradient
of the global-batch mean loss. Reported losses are that global mean (all-reduced after the timed
steps); a step's time is the slowest rank's; rank 0 writes the JSON (mode "torch_ddp").
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import engine_compat as ec
import ref_common as rc


def pick_backend(args, world_local):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fits = gpus >= world_local
    if args.backend == "nccl" and not fits:
        raise SystemExit(f"ddp_ref: --backend nccl needs one GPU per rank: {world_local} local "
                         f"ranks, {gpus} GPU(s)")
    if args.device == "cuda" and not fits:
        raise SystemExit(f"ddp_ref: --device cuda: {world_local} local ranks, {gpus} GPU(s)")
    if args.backend == "auto":
        backend = "nccl" if fits and gpus > 0 and args.device != "cpu" else "gloo"
    else:
        backend = args.backend
    notes = []
    if backend == "gloo":
        if args.backend == "gloo":
            why = "as asked"
        elif args.device == "cpu":
            why = "--device cpu"
        else:
            why = f"{gpus} GPU(s) for {world_local} local ranks"
        notes.append(f"backend gloo on CPU tensors ({why}): figures are not multi-GPU scaling")
    return backend, gpus, notes


def main():
    ap = rc.parser(__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=int, default=0,
                    help="accepted for dp_bench's flags; ignored (torchrun fixes the rank count)")
    args = ap.parse_args()
    if args.model == "gpt":  # its loss, optimizer and data are variants.py's (N = 1) only
        ap.error("--model gpt: the N > 1 references train the image models only; run "
                 "variants.py (one device) for GPT")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, world_local = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.gpus not in (0, world):
        raise SystemExit(f"ddp_ref: --gpus {args.gpus} but torchrun started {world} ranks "
                         f"(--nproc_per_node sets the rank count)")
    rc.set_math(args.dtype)
    backend, gpus, notes = pick_backend(args, world_local)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)

    batch = rc.global_batch(args, world)
    if batch < world:
        raise SystemExit(f"ddp_ref: global batch {batch} is smaller than {world} ranks")
    sizes = ec.chunk_sizes(batch, world)
    first, count = sum(sizes[:rank]), sizes[rank]
    share = count / batch  # chunk share: world * share * (DDP's 1/world) = share

    model = rc.build_model(args).to(device)
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    net = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = rc.sgd(net)
    ds = rc.dataset(args, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms, local_losses = [], []
    amp = rc.Amp(args.dtype, device.type)
    for step in range(args.warmup + args.steps):
        x, y = rc.host_batch(ds, step * batch + first, count, pin=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = F.cross_entropy(net(x), y)  # mean over this rank's chunk
        amp.backward_and_step(loss * (share * world), opt)  # DDP averages over ranks
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1000.0
        if step >= args.warmup:
            step_ms.append(ms)
            local_losses.append(loss.detach() * share)

    # After the timed steps: the global mean loss per step (sum of the shares), the slowest
    # rank's time per step, and every rank's peak memory.
    losses = torch.stack(local_losses).to(device) if local_losses else torch.zeros(0, device=device)
    times = torch.tensor(step_ms, dtype=torch.float64, device=device)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0],
                        dtype=torch.int64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        run = rc.run_record("torch_ddp", world, batch, times.cpu().tolist(), param_bytes,
                            rc.ring_bytes_theory(world, param_bytes),
                            [int(p.item()) for p in peaks], losses.cpu().tolist())
        name = torch.cuda.get_device_name(local_rank) if device.type == "cuda" else "cpu"
        physical = gpus if device.type == "cuda" else os.cpu_count()
        rc.report(args, name, physical, world, [run], notes + [f"backend {backend}"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
