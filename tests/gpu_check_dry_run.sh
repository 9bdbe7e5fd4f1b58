#!/usr/bin/env bash
# ctest "bench.gpu_check: a dry run of the lease ...": scripts/gpu_check.sh's plan run on CPU
# devices (GPU_CHECK_DRY_RUN=1, a stand-in nvidia-smi), so its bash is proved here before a
# lent GPU's few minutes are spent on it.
#   1. --lease with every part: exit 0, each part's "done" line, the graphs, metrics-lag and
#      4-follow-1 comparisons ok, the graphed step's time per node, the results packed into one tar.gz that holds the summary and
#      the JSON.
#   2. A lease too short for its list: exit 3, CUT verdicts, and a last line naming the parts not
#      done with the --stage list that runs them.
#   3. --skip-done with the first summary: its parts are skipped, the others run.
#   4. The GPT batch search ends at the first size out of memory (no failure); a crash fails it.
#   5. A bad --lease, --skip-done or --pack: exit 2 naming it, before any work.
#   bash tests/gpu_check_dry_run.sh SCRIPT BUILD_DIR
# shellcheck source=tests/gpu_check_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_check_common.sh" "$@"
mkdir -p "$scratch/fake"
cat > "$scratch/fake/nvidia-smi" << 'EOF'
#!/usr/bin/env bash
case "$*" in
  -L) echo "GPU 0: Dry Run GPU (UUID: GPU-00000000)" ;;
  *name*) echo "Dry Run GPU" ;;
  *driver_version*) echo "0.0" ;;
  *) echo "a stand-in nvidia-smi for gpu_check's dry run" ;;
esac
EOF
chmod +x "$scratch/fake/nvidia-smi"
export PATH=$scratch/fake:$PATH GPU_CHECK_DRY_RUN=1
fail=0
no() {
  echo "FAIL: $*"
  fail=1
}

# 1. The whole lease.
LEASE_SIDE_S=120 bash "$script" --lease 600 --pack "$scratch/one.tar.gz" "$build" \
  "$scratch/r1" > "$scratch/one.out" 2>&1
rc=$?
cat "$scratch/one.out"
((rc == 0)) || no "the whole lease exited $rc, expected 0"
sum1=$(ls "$scratch"/r1/*/summary.txt 2> /dev/null | head -1)
[[ -n $sum1 ]] || no "no summary.txt"
for p in tests memcheck racecheck amp-tests amp-runs gemm graphs gpt gpt-batch bench-more \
  torch-fp32 torch-bf16 torch-gpt profile; do
  grep -q "^== part $p: done in" "${sum1:-/dev/null}" || no "part $p is not done"
done
for c in "graphs = uncaptured, mlp --gpus 4" "graphs = uncaptured, cnn --gpus 1" \
  "metrics lag 1 = 0, mlp --gpus 4" "graphs = uncaptured, gpt-tiny --dropout 0.1" \
  "mlp: 4 GPUs follow 1 (fp32) *ddp N=4 largest gap" "amp cnn fp16: 4 GPUs follow 1 *ddp N=4" \
  "staged pulls = in place, mlp --gpus 4, graphs off" \
  "mlp: graphed step per node *dp N=1 [0-9.]* ms over [0-9]* nodes: [0-9.]* us each, ddp N=1"; do
  grep -q "^ok    $c" "${sum1:-/dev/null}" || no "no ok verdict for '$c'"
done
grep -q "^ok    dp_bench gpt-124m bf16 --gpus 1, 4 *dp x1 .*dp x4 .*t4/t1 [0-9.]* \[" \
  "${sum1:-/dev/null}" || no "the GPT part does not report DP at 1 and 4 devices with their ratio"
grep -q "^ok    dp_bench mlp --gpus 1 .*; verdict: .*DP and DDP\|^ok    dp_bench mlp --gpus 1 .*; verdict: .*than" \
  "${sum1:-/dev/null}" || no "the graphs part does not give DP against DDP at one device"
grep -q "^ok    gpt-124m largest batch *32 (of 16 32): batch 16 .* tok/s, MFU .*; batch 32 " \
  "${sum1:-/dev/null}" || no "the GPT batch search does not report both sizes"
tar -tzf "$scratch/one.tar.gz" > "$scratch/one.list" 2> /dev/null || no "the pack is no tar.gz"
for f in summary.txt dp_bench_mlp_gpus4.json dp_bench_gpt124m_bf16.json cuda_tests.txt; do
  grep -q "/$f\$" "$scratch/one.list" || no "the pack has no $f"
done

# 2. A lease that ends before its list: CUT, exit 3, and the list of what is left.
bash "$script" --lease 2 --stage graphs,gemm "$build" "$scratch/r2" > "$scratch/two.out" 2>&1
rc=$?
cat "$scratch/two.out"
((rc == 3)) || no "a lease too short exited $rc, expected 3"
grep -q "^CUT   .*not started: the lease's 2 s was spent" "$scratch/two.out" ||
  no "no step was marked not started"
grep -q "^gpu_check: not done: graphs.*; run them again with --stage graphs" "$scratch/two.out" ||
  no "the last lines do not name the parts left"

# 3. --skip-done: parts done in the first run are skipped, the others run.
bash "$script" --stage tests,graphs,gemm --skip-done "${sum1:-/dev/null}" "$build" \
  "$scratch/r3" > "$scratch/three.out" 2>&1
rc=$?
((rc == 0)) || no "--skip-done exited $rc, expected 0"
[[ $(grep -c "^== part .*: done in an earlier run" "$scratch/three.out") -eq 3 ]] ||
  no "--skip-done did not skip the three parts done before"
bash "$script" --stage gemm --skip-done "$scratch/two.out" "$build" "$scratch/r4" \
  > "$scratch/four.out" 2>&1
grep -q "^== part gemm: done in [0-9]* s" "$scratch/four.out" ||
  no "--skip-done skipped a part its summary did not mark done"

# 4. The GPT batch search (with a stand-in dp_bench whose batches over 32 run out of memory, or
#    crash): out of memory ends it, and is no failure; a crash fails it.
mkdir -p "$scratch/fakebuild/bin"
cat > "$scratch/fakebuild/bin/dp_bench" << 'EOF'
#!/usr/bin/env bash
json="" batch=8
while (($#)); do
  case $1 in
    --json) json=$2 && shift ;;
    --batch) batch=$2 && shift ;;
  esac
  shift
done
if ((batch > 32)); then
  [[ -n ${FAKE_CRASH:-} ]] && exit 139
  echo "dp_bench: out of memory on cuda:0 allocating 1073741824 bytes: out of memory" >&2
  exit 1
fi
echo "{\"runs\": [{\"tokens_per_s\": $((batch * 1000)), \"mfu\": 0.5, \"peak_mem_bytes\": [1073741824]}]}" > "$json"
EOF
chmod +x "$scratch/fakebuild/bin/dp_bench"
GPU_CHECK_DRY_RUN=0 bash "$script" --stage gpt-batch "$scratch/fakebuild" "$scratch/r5" \
  > "$scratch/five.out" 2>&1
rc=$?
cat "$scratch/five.out"
((rc == 0)) || no "a batch out of memory exited $rc, expected 0"
grep -q "^ok    gpt-124m largest batch *32 (of 16 32 64 128 256); batch 64 does not fit: .*out of memory.*: batch 16 16000 tok/s, MFU 50.0%, peak 1.0 GiB; batch 32 32000" \
  "$scratch/five.out" || no "the batch search does not say where it stopped and why"
FAKE_CRASH=1 GPU_CHECK_DRY_RUN=0 bash "$script" --stage gpt-batch "$scratch/fakebuild" \
  "$scratch/r6" > "$scratch/six.out" 2>&1
rc=$?
((rc == 1)) || no "a crash in the batch search exited $rc, expected 1"
grep -q "^FAIL  gpt-124m largest batch *exit 139: batch 64" "$scratch/six.out" ||
  no "a crash in the batch search is not a failure naming its batch"

# 5. Bad flags: exit 2, one line naming what was given, no results folder.
bad() {  # WANT ARGS...
  local want=$1
  shift
  bash "$script" "$@" "$build" "$scratch/bad" > "$scratch/bad.out" 2>&1
  local rc=$?
  ((rc == 2)) || no "[$*] exited $rc, expected 2"
  grep -q -- "$want" "$scratch/bad.out" || no "[$*] does not say '$want': $(cat "$scratch/bad.out")"
  [[ ! -e $scratch/bad ]] || no "[$*] made a results folder"
}
bad "--lease 'soon'" --lease soon
bad "--lease '0'" --lease 0
bad "--skip-done '$scratch/none.txt'" --skip-done "$scratch/none.txt"
bad "--pack '$scratch/no/such/x.tgz'" --pack "$scratch/no/such/x.tgz"
bad "unknown --stage 'graph'" --stage tests,graph
bad "unknown flag '--lease-s'" --lease-s 5
exit $fail
