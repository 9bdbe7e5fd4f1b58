#!/usr/bin/env bash
# Runs dp_bench and PyTorch on the same model, data, global batch and steps, and prints a
# comparison.
#
#   bash benchmarks/torch_ref/side_by_side.sh BUILD_DIR N [flags...]
#
# N = 1: variants.py, the single-device comparison: K interleaved repeats (--repeat, default 5)
#   of dp_bench --mode dp --gpus 1 and of torch eager (no wrapper, fused SGD), CUDA graph and
#   torch.compile, each with its ours/torch ratio and 95% bootstrap interval. Defaults
#   --steps 200 --warmup 20; flags: --device --model --batch --steps --warmup --dtype --seed
#   --repeat --variants (e.g. eager,compile).
# N > 1: dp_bench --mode both --gpus N, then dp_ref.py (nn.DataParallel) and ddp_ref.py
#   (DDP under torchrun), then compare.py; one run each, the defaults of all three are
#   dp_bench's (--model mlp --batch 256 --steps 30 --warmup 5 --seed 1 --dtype fp32). Flags:
#   --device --model --batch --batch-per-device --steps --warmup --dtype --seed --backend.
# Reports go to $OUT_DIR (default: a new side_by_side.XXXX temporary folder). PYTHON picks the
# interpreter (default python3). Without torch or numpy for it, one line says so and the exit
# status is 0 (nothing to compare against here).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 BUILD_DIR N [flags...]" >&2
  exit 2
fi
build=$1
n=$2
shift 2
if [[ ! $n =~ ^[1-9][0-9]*$ ]]; then
  echo "side_by_side: N '$n': give a whole number >= 1 (1: the single-device variants)" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}

for module in torch numpy; do
  if ! "$py" -c "import $module" > /dev/null 2>&1; then
    echo "side_by_side: skipped: $module is not installed for $py" \
      "(pip install torch numpy, or set PYTHON to an interpreter that has them)"
    exit 0
  fi
done
bench=$build/bin/dp_bench
if [[ ! -x $bench ]]; then
  echo "side_by_side: no $bench: build the engine first" \
    "(cmake --build $build --target dp_bench)" >&2
  exit 2
fi

out=${OUT_DIR:-$(mktemp -d -t side_by_side.XXXX)}
mkdir -p "$out"

if [[ $n == 1 ]]; then
  echo "== ours (dp_bench --mode dp --gpus 1) against torch eager, graph, compile: $*"
  exec "$py" "$here/variants.py" --build "$build" --out-dir "$out" --json "$out/variants.json" "$@"
fi

echo "side_by_side: reports in $out"
status=0

echo "== ours: dp_bench --mode both --gpus $n $*"
"$bench" --mode both --gpus "$n" --baseline 0 --json "$out/ours.json" "$@" || {
  echo "side_by_side: dp_bench failed" >&2
  status=1
}

echo "== torch DataParallel: dp_ref.py --gpus $n $*"
"$py" "$here/dp_ref.py" --gpus "$n" --baseline 0 --json "$out/torch_dp.json" "$@" || {
  echo "side_by_side: dp_ref.py failed" >&2
  status=1
}

echo "== torch DDP: torchrun --nproc_per_node $n ddp_ref.py $*"
"$py" -m torch.distributed.run --standalone --nproc_per_node "$n" "$here/ddp_ref.py" \
  --gpus "$n" --json "$out/torch_ddp.json" "$@" || {
  echo "side_by_side: ddp_ref.py failed" >&2
  status=1
}

echo
"$py" "$here/compare.py" "$out/ours.json" "$out/torch_dp.json" "$out/torch_ddp.json"
exit $status
