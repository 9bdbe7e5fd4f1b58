#!/usr/bin/env bash
# ctest "bench.torch_ref: side_by_side.sh without torch prints one line and exits 0".
# Without torch (or numpy) for the interpreter, benchmarks/torch_ref/side_by_side.sh must print
# exactly one line saying it skipped and exit 0. Where python3 has torch, the test hides its
# site-packages (python3 -S, no PYTHONPATH) to reach the same path; where torch is still
# importable then, it is skipped (77).
#   bash tests/torch_ref_no_torch.sh SIDE_BY_SIDE_SH BUILD_DIR
set -u
script=$1
build=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
py=python3
if python3 -c 'import torch, numpy' > /dev/null 2>&1; then
  printf '#!/bin/sh\nPYTHONPATH= PYTHONNOUSERSITE=1 exec python3 -S "$@"\n' \
    > "$scratch/python3-bare"
  chmod +x "$scratch/python3-bare"
  py=$scratch/python3-bare
  if "$py" -c 'import torch, numpy' > /dev/null 2>&1; then
    echo "SKIPPED: torch and numpy import even without site-packages; nothing to test here"
    exit 77
  fi
fi
OUT_DIR=$scratch/out PYTHON=$py bash "$script" "$build" 1 --device cpu > "$scratch/log" 2>&1
rc=$?
lines=$(wc -l < "$scratch/log")
cat "$scratch/log"
fail=0
[[ $rc -eq 0 ]] || { echo "FAIL: exit status $rc, expected 0"; fail=1; }
[[ $lines -eq 1 ]] || { echo "FAIL: $lines lines of output, expected one"; fail=1; }
grep -q 'skipped: .* is not installed' "$scratch/log" ||
  { echo "FAIL: the line does not say what is not installed"; fail=1; }
[[ ! -e $scratch/out ]] || { echo "FAIL: it made a reports folder"; fail=1; }
exit $fail
