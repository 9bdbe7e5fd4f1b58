#!/usr/bin/env bash
# Runs dp_bench and the PyTorch references (nn.DataParallel, DistributedDataParallel) on the
# same model, data, global batch and steps, and prints a small comparison table.
#
#   bash benchmarks/torch_ref/side_by_side.sh BUILD_DIR N [dp_bench flags...]
#
# The extra flags go to all three (the defaults of all three are dp_bench's: --model mlp
# --batch 256 --steps 30 --warmup 5 --seed 1 --dtype fp32), e.g. --model resnet --batch 512.
# Only flags the references also know: --device --model --batch --batch-per-device --steps
# --warmup --dtype --seed --backend. Reports go to $OUT_DIR (default: a new side_by_side.XXXX
# folder here). PYTHON picks the interpreter (default python3).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 BUILD_DIR N [dp_bench flags...]" >&2
  exit 2
fi
build=$1
n=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}

if ! "$py" -c 'import torch' 2>/dev/null; then
  echo "side_by_side: PyTorch is not installed for $py (python3 -c 'import torch' fails)." >&2
  echo "  install it (e.g. pip install torch numpy) or set PYTHON to an interpreter that has it" >&2
  exit 2
fi
if ! "$py" -c 'import numpy' 2>/dev/null; then
  echo "side_by_side: numpy is not installed for $py: pip install numpy" >&2
  exit 2
fi
bench=$build/bin/dp_bench
if [[ ! -x $bench ]]; then
  echo "side_by_side: no $bench: build the engine first" \
    "(cmake --build $build --target dp_bench)" >&2
  exit 2
fi

out=${OUT_DIR:-$(mktemp -d -t side_by_side.XXXX)}
mkdir -p "$out"
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
