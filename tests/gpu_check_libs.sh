#!/usr/bin/env bash
# ctest "bench.gpu_check: finds the CUDA libraries of PyTorch's wheels": a fake site-packages
# tree (nvidia/cudnn/lib, nvidia/nccl/lib, nvidia/cublas/lib) on PYTHONPATH must come first in
# what scripts/gpu_check.sh puts on LD_LIBRARY_PATH. Needs no GPU.
#   bash tests/gpu_check_libs.sh SCRIPT
set -u
script=$1
command -v python3 > /dev/null || {
  echo "SKIPPED: no python3"
  exit 77
}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
site=$(cd "$scratch" && pwd -P)/site
for lib in cudnn nccl cublas; do mkdir -p "$site/nvidia/$lib/lib"; done
PYTHONPATH=$site bash "$script" --cuda-lib-dirs > "$scratch/dirs"
cat "$scratch/dirs"
fail=0
for lib in cudnn nccl cublas; do
  grep -qx "$site/nvidia/$lib/lib" "$scratch/dirs" || {
    echo "FAIL: $site/nvidia/$lib/lib is not searched"
    fail=1
  }
done
[[ $(head -3 "$scratch/dirs" | grep -c "^$site/nvidia/") -eq 3 ]] || {
  echo "FAIL: the site-packages folders do not come first"
  fail=1
}
exit $fail
