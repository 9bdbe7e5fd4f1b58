#!/usr/bin/env bash
# ctest "bench.gpu_check: exits 2 without a GPU": on a machine without a GPU, scripts/gpu_check.sh
# must exit 2 at once with exactly one line naming the reason, and make no results folder.
# Skipped (77) where a GPU is present.
#   bash tests/gpu_check_no_gpu.sh SCRIPT BUILD_DIR
set -u
script=$1
build=$2
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  echo "SKIPPED: this machine has a GPU"
  exit 77
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
bash "$script" "$build" "$scratch/results" > "$scratch/out" 2>&1
rc=$?
lines=$(wc -l < "$scratch/out")
cat "$scratch/out"
fail=0
[[ $rc -eq 2 ]] || { echo "FAIL: exit status $rc, expected 2"; fail=1; }
[[ $lines -eq 1 ]] || { echo "FAIL: $lines lines of output, expected one"; fail=1; }
grep -q 'no NVIDIA GPU' "$scratch/out" || { echo "FAIL: the line does not say 'no NVIDIA GPU'"; fail=1; }
[[ ! -e $scratch/results ]] || { echo "FAIL: it made a results folder"; fail=1; }
exit $fail
