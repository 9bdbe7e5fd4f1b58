#!/usr/bin/env bash
# ctest "bench.gpu_check: exits 2 without a GPU": on a machine without a GPU, scripts/gpu_check.sh
# must exit 2 at once with exactly one line naming the reason, and make no results folder: with
# no --stage, with each --stage (tests, sanitizer, amp, bench, torch, profile, all) and with a
# lease of parts. An unknown stage is named, also with exit 2. Skipped (77) where a GPU is
# present.
#   bash tests/gpu_check_no_gpu.sh SCRIPT BUILD_DIR
# shellcheck source=tests/gpu_check_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_check_common.sh" "$@"
fail=0
# One run: ARGS... ; expects exit 2, one line containing $want, no results folder, within 10 s.
check() {
  local start=$SECONDS rc lines
  bash "$script" "$@" "$build" "$scratch/results" > "$scratch/out" 2>&1
  rc=$?
  lines=$(wc -l < "$scratch/out")
  echo "[$*] $(cat "$scratch/out")"
  [[ $rc -eq 2 ]] || { echo "FAIL [$*]: exit status $rc, expected 2"; fail=1; }
  [[ $lines -eq 1 ]] || { echo "FAIL [$*]: $lines lines of output, expected one"; fail=1; }
  grep -q "$want" "$scratch/out" || { echo "FAIL [$*]: the line does not say '$want'"; fail=1; }
  [[ ! -e $scratch/results ]] || { echo "FAIL [$*]: it made a results folder"; fail=1; }
  ((SECONDS - start <= 10)) || { echo "FAIL [$*]: took $((SECONDS - start)) s, not at once"; fail=1; }
}
want='no NVIDIA GPU'
check
for stage in tests sanitizer amp bench torch profile all; do
  check --stage "$stage"
done
check --stage=amp
check --stage graphs,gemm --lease 540 --pack "$scratch/x.tar.gz"
want="unknown --stage 'gpu'"
check --stage gpu
exit $fail
