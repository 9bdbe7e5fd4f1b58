#!/usr/bin/env bash
# ctest "bench.torch_ref: gpt-tiny in torch does the same work as dp_bench --model gpt".
# variants.py's same-work check on gpt-tiny (eager, 2 short repeats): torch's model, weights,
# tokens, loss and AdamW must give dp_bench's losses (gap within 1e-3, else exit 1). Skipped
# (77) where the interpreter ($PYTHON, default python3) has no torch or numpy.
#   bash tests/torch_ref_gpt.sh VARIANTS_PY BUILD_DIR
set -u
variants=$1
build=$2
py=${PYTHON:-python3}
if ! "$py" -c 'import torch, numpy' > /dev/null 2>&1; then
  echo "SKIPPED: $py has no torch or numpy (PYTHON=/path/to/venv/bin/python to run this)"
  exit 77
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$py" "$variants" --build "$build" --device cpu --model gpt --gpt-config tiny --seq 16 \
  --batch 4 --steps 4 --warmup 3 --repeat 2 --variants eager --torch-threads 1 \
  --out-dir "$scratch" > "$scratch/log" 2>&1
rc=$?
cat "$scratch/log"
fail=0
[[ $rc -eq 0 ]] || { echo "FAIL: exit status $rc (1: NOT THE SAME WORK)"; fail=1; }
grep -q 'same-work check.*eager [0-9.e+-]*$' "$scratch/log" ||
  { echo "FAIL: no same-work gap for eager"; fail=1; }
grep -q 'tokens/s: eager: ours [0-9]*, torch [0-9]*' "$scratch/log" ||
  { echo "FAIL: no tokens/s line"; fail=1; }
exit $fail
