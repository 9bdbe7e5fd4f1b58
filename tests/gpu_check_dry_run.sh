#!/usr/bin/env bash
# ctest "bench.gpu_check: a dry run of the lease ...": scripts/gpu_check.sh's plan run on CPU
# devices (GPU_CHECK_DRY_RUN=1, a stand-in nvidia-smi, and a compute-sanitizer and an ncu that
# refuse this machine as a VM's would), so its bash is proved here before a lent GPU's few
# minutes are spent on it.
#   1. --lease with every part: exit 0; the parts in the lease's order (tests and amp-tests side
#      by side, then probe, gpt, gpt-batch, torch-gpt, graphs, ...); each part's "done" line; the
#      graphed probe of each model; the graphs, metrics-lag and 4-follow-1 comparisons ok; the
#      graphed step's time per node; the tool probes' SKIP with the tools' words; a pack written
#      after every part, the last one a tar.gz that holds every part's done line and the JSON.
#   2. A lease too short for its list: exit 3, CUT verdicts, and a last line naming the parts not
#      done with the --stage list that runs them.
#   3. --skip-done with the first summary: its parts are skipped, the others run.
#   4. The GPT batch search ends at the first size out of memory (no failure), cuBLAS's
#      allocation failure included; a crash fails it. A run whose capture fell back says so in
#      its verdict (a stand-in dp_bench).
#      A results folder of another build is left alone: the run writes DATEb_DEVICE (then c);
#      two calls of one build share a folder.
#   5. A bad --lease, --skip-done or --pack: exit 2 naming it, before any work.
#   6. The lease killed at a random moment (3 to 20 s in, with SIGKILL, everything at once, or
#      SIGTERM to the script, which stops its step and packs once more; GPU_CHECK_KILL="SIG S"
#      picks them): the pack left behind is a whole tar.gz, every part its summary marks done
#      has its files in it, and no temporary file is left beside it.
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
# The tools a Firecracker VM may refuse: compute-sanitizer answers --version but cannot attach;
# ncu profiles nothing for want of the counters (and still exits 0).
cat > "$scratch/fake/compute-sanitizer" << 'EOF'
#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "NVIDIA (R) Compute Sanitizer (a stand-in)"; exit 0; }
echo "========= Error: the debugger interface is not supported on this device (a stand-in)"
exit 1
EOF
cat > "$scratch/fake/ncu" << 'EOF'
#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "NVIDIA (R) Nsight Compute Command Line Profiler (a stand-in)"; exit 0; }
echo "==PROF== Connected to process 1 (a stand-in)"
echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters on the target device 0."
exit 0
EOF
chmod +x "$scratch/fake/nvidia-smi" "$scratch/fake/compute-sanitizer" "$scratch/fake/ncu"
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
# The lease's order: the side-by-side jobs first (either may start first), then the rest.
side=(tests amp-tests)
timed=(probe gpt gpt-profile gpt-batch torch-gpt torch-gpt-b32 graphs torch-fp32 torch-bf16 amp-runs
  bench-more memcheck racecheck gemm profile)
order=$(sed -n 's/^== part \([a-z0-9-]*\) (.*/\1/p' "${sum1:-/dev/null}" | paste -sd' ' -)
[[ $order == "tests amp-tests ${timed[*]}" || $order == "amp-tests tests ${timed[*]}" ]] ||
  no "the parts ran in the order '$order', expected ${side[*]} (either first), then ${timed[*]}"
# Every part done, then packed: the pack after it, and the last pack holding its done line.
tar -xzOf "$scratch/one.tar.gz" --wildcards '*/summary.txt' > "$scratch/one.summary" 2> /dev/null ||
  no "the pack has no summary.txt"
for p in "${side[@]}" "${timed[@]}"; do
  grep -q "^== part $p: done in" "${sum1:-/dev/null}" || no "part $p is not done"
  grep -q "^   packed after part $p: $scratch/one.tar.gz ([0-9]* KiB)" "$scratch/one.out" ||
    no "no pack after part $p"
  grep -q "^== part $p: done in" "$scratch/one.summary" || no "the pack does not say part $p is done"
done
grep -q "^   packed after the setup: " "$scratch/one.out" || no "no pack after the setup"
for m in mlp cnn gpt-tiny; do
  grep -q "^ok    probe $m graphs on *[0-9.]* ms/step, loss [0-9.]*, graphed: [0-9]* of [0-9]* steps replayed, [0-9]* nodes each" \
    "${sum1:-/dev/null}" || no "the probe does not give $m's graphed step"
done
grep -q "^SKIP  compute-sanitizer *refused here: ========= Error: the debugger interface is not supported" \
  "${sum1:-/dev/null}" || no "a compute-sanitizer that cannot attach is not a SKIP in its words"
grep -q "^SKIP  ncu (profile) *refused here: ==ERROR== ERR_NVGPUCTRPERM" "${sum1:-/dev/null}" ||
  no "an ncu refused the counters is not a SKIP in its words"
compgen -G "$scratch/.one.tar.gz.*" > /dev/null && no "a temporary pack was left beside the pack"
for c in "graphs = uncaptured, mlp --gpus 4" "graphs = uncaptured, cnn --gpus 1" \
  "metrics lag 1 = 0, mlp --gpus 4" "graphs = uncaptured, gpt-tiny --dropout 0.1" \
  "mlp: 4 GPUs follow 1 (fp32) *ddp N=4 largest gap" "amp cnn fp16: 4 GPUs follow 1 *ddp N=4" \
  "staged pulls = in place, mlp --gpus 4, graphs off" \
  "pulls beside = after, cnn --gpus 4 graphed" \
  "--recompute = plain, gpt-tiny --dropout 0.1 --gpus 2 graphed" \
  "mlp: graphed step per node *dp N=1 [0-9.]* ms over [0-9]* nodes: [0-9.]* us each, ddp N=1"; do
  grep -q "^ok    $c" "${sum1:-/dev/null}" || no "no ok verdict for '$c'"
done
grep -q "^ok    dp_bench gpt-124m bf16 --gpus 1, 4 *dp x1 .*dp x4 .*t4/t1 [0-9.]* \[" \
  "${sum1:-/dev/null}" || no "the GPT part does not report DP at 1 and 4 devices with their ratio"
grep -q "^ok    dp_bench mlp --gpus 1 .*; verdict: .*DP and DDP\|^ok    dp_bench mlp --gpus 1 .*; verdict: .*than" \
  "${sum1:-/dev/null}" || no "the graphs part does not give DP against DDP at one device"
grep -q "^ok    gpt-124m largest batch *32 (of 16 32): batch 16 .* tok/s, MFU .*; batch 32 " \
  "${sum1:-/dev/null}" || no "the GPT batch search does not report both sizes"
grep -q "^ok    gpt-124m batch 16 --recompute *[0-9]* tok/s, MFU [0-9.]*%, HFU [0-9.]*%, peak " \
  "${sum1:-/dev/null}" || no "the GPT batch part does not report batch 16 with --recompute"
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

# 4. The GPT batch search (with a stand-in dp_bench whose batches over 32 run out of memory, in
#    the allocator's words or cuBLAS's, or crash): out of memory ends it, and is no failure; a
#    crash fails it. Its graphed runs fall back uncaptured, as a failed capture does: the probe
#    and the gpt part say so.
mkdir -p "$scratch/fakebuild/bin"
cat > "$scratch/fakebuild/bin/dp_bench" << 'EOF'
#!/usr/bin/env bash
json="" batch=8 graphs=auto
while (($#)); do
  case $1 in
    --json) json=$2 && shift ;;
    --batch) batch=$2 && shift ;;
    --cuda-graphs) graphs=$2 && shift ;;
  esac
  shift
done
if ((batch > 32)); then
  [[ -n ${FAKE_CRASH:-} ]] && exit 139
  if [[ -n ${FAKE_CUBLAS:-} ]]; then
    echo "dp_bench: error: dp/train_step on cuda:0: cublasLtMatmul(handle, ...) failed: cublas status 3 [at gemm.cu:114]" >&2
  else
    echo "dp_bench: out of memory on cuda:0 allocating 1073741824 bytes: out of memory" >&2
  fi
  exit 1
fi
fallback=""
if [[ $graphs != off ]]; then
  fallback="capture failed: allocating 262144 bytes on cuda:0 while a graph captures"
  echo "graphs off: $fallback"
fi
echo "{\"runs\": [{\"mode\": \"dp\", \"gpus\": 1, \"step_ms_median\": 1.5, \"final_loss\": 2.3, \"losses\": [2.3], \"graphed_steps\": 0, \"graphs_fallback\": \"$fallback\", \"tokens_per_s\": $((batch * 1000)), \"mfu\": 0.5, \"peak_mem_bytes\": [1073741824]}]}" > "$json"
EOF
chmod +x "$scratch/fakebuild/bin/dp_bench"
GPU_CHECK_DRY_RUN=0 FAKE_CUBLAS=1 bash "$script" --stage gpt-batch,probe,gpt "$scratch/fakebuild" \
  "$scratch/r7" > "$scratch/seven.out" 2>&1
rc=$?
cat "$scratch/seven.out"
((rc == 0)) || no "a batch that cuBLAS cannot allocate for exited $rc, expected 0"
grep -q "^ok    gpt-124m largest batch *32 (of 16 32 64 128 256); batch 64 does not fit: .*cublas status 3" \
  "$scratch/seven.out" || no "cuBLAS's allocation failure (status 3) does not end the batch search"
grep -q "^ok    dp_bench gpt-124m bf16 batch 32 --gpus 1, 4 dp x1 1.500 ms/step" "$scratch/seven.out" ||
  no "the gpt part does not run DP 4/1 at batch 32"
grep -q "^SKIP  dp_bench gpt-124m bf16 batch 64 --gpus 1, 4 does not fit: .*cublas status 3" \
  "$scratch/seven.out" || no "the gpt part does not skip a batch that does not fit, saying why"
grep -q "^ok    probe mlp graphs auto *1.500 ms/step, loss 2.3000, uncaptured (graphs fell back: capture failed: allocating 262144 bytes" \
  "$scratch/seven.out" || no "the probe does not say the capture fell back, and why"
grep -q "^ok    dp_bench gpt-124m bf16 --gpus 1, 4 dp x1 1.500 ms/step.* (graphs fell back: capture failed: " \
  "$scratch/seven.out" || no "the gpt part does not say the capture fell back"
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

# 4b. A results folder another build wrote (a machine that kept /tmp from an earlier lease) is
#     left as it is, and the run writes DATEb_DEVICE; a second call of the same build continues
#     there; a third build takes DATEc_DEVICE.
day=$(date -u +%Y-%m-%d)
mkdir -p "$scratch/r8/${day}_dry-run-gpu"
echo "an earlier lease's figure" > "$scratch/r8/${day}_dry-run-gpu/stale.txt"
printf 'gpu_check bundle\nsource: aaaaaaa\nbuilt: one\n' > "$scratch/fakebuild/VERSION"
for call in 1 2; do
  GPU_CHECK_DRY_RUN=0 bash "$script" --stage probe "$scratch/fakebuild" "$scratch/r8" \
    > "$scratch/eight$call.out" 2>&1 || no "the probe into r8 (call $call) failed: $(cat "$scratch/eight$call.out")"
done
grep -q "r8/${day}_dry-run-gpu holds another build's results (its build.txt: none); left as it is" \
  "$scratch/eight1.out" || no "the run does not say it left another build's folder alone"
[[ $(cat "$scratch/r8/${day}_dry-run-gpu/stale.txt") == "an earlier lease's figure" &&
  $(ls "$scratch/r8/${day}_dry-run-gpu") == stale.txt ]] || no "the other build's folder was changed"
[[ $(grep -c "^== part probe: done" "$scratch/r8/${day}b_dry-run-gpu/summary.txt" 2> /dev/null) -eq 2 ]] ||
  no "the two calls of one build did not both write into ${day}b_dry-run-gpu"
printf 'gpu_check bundle\nsource: bbbbbbb\nbuilt: two\n' > "$scratch/fakebuild/VERSION"
GPU_CHECK_DRY_RUN=0 bash "$script" --stage probe "$scratch/fakebuild" "$scratch/r8" \
  > "$scratch/eight3.out" 2>&1 || no "the probe of another build into r8 failed"
grep -q "^source: bbbbbbb" "$scratch/r8/${day}c_dry-run-gpu/build.txt" 2> /dev/null ||
  no "a third build did not take ${day}c_dry-run-gpu"
[[ $(grep -c "^== part probe: done" "$scratch/r8/${day}b_dry-run-gpu/summary.txt") -eq 2 ]] ||
  no "a third build wrote into the second's folder"
rm -f "$scratch/fakebuild/VERSION"

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

# 6. The lease killed at a random moment: SIGKILL to every process it started at once (its own
#    session), as when a machine is taken back, or SIGTERM to the script alone, as a call's time
#    limit sends it. The pack left behind must be a whole tar.gz in which every part marked done
#    has its last file (whole JSON where it is JSON); after a TERM the script has stopped its
#    step, said so in the summary, packed once more, and left nothing running.
kill_sig=TERM
((RANDOM % 2)) && kill_sig=KILL
kill_at=$((RANDOM % 18 + 3))
[[ -n ${GPU_CHECK_KILL:-} ]] && read -r kill_sig kill_at <<< "$GPU_CHECK_KILL"
echo "6. the lease, SIG$kill_sig after $kill_at s (GPU_CHECK_KILL=\"$kill_sig $kill_at\" repeats this)"
declare -A part_file=([tests]=cuda_tests.txt [amp-tests]=amp_tests.txt [probe]=probe_gpt.json
  [gpt]=dp_bench_gpt124m_bf16.json [gpt-batch]=dp_bench_gpt124m_bf16_batch32.json
  [torch-gpt]=summary.txt [torch-gpt-b32]=summary.txt [graphs]=dp_bench_cnn_gpus4_nographs.json [torch-fp32]=summary.txt
  [torch-bf16]=summary.txt [amp-runs]=amp_cnn_bf16_gpus4_commbf16.json
  [bench-more]=dp_bench_gpt_tiny_dropout_graphs_off.json [memcheck]=probe_compute-sanitizer.txt
  [racecheck]=probe_compute-sanitizer.txt [gemm]=bench_kernels.json [profile]=probe_ncu.txt
  [gpt-profile]=probe_ncu.txt)
killed=$scratch/killed.tar.gz
LEASE_SIDE_S=120 setsid bash -c 'echo $$ > "$1" && shift && exec "$@"' - "$scratch/killed.pid" \
  bash "$script" --lease 600 --pack "$killed" "$build" "$scratch/r8" > "$scratch/eight.out" 2>&1 &
sleep "$kill_at"
sid=$(cat "$scratch/killed.pid" 2> /dev/null)
if [[ -z $sid ]]; then
  no "the killed lease did not start"
elif [[ $kill_sig == KILL ]]; then
  pkill -KILL -s "$sid"
  { wait; } 2> /dev/null  # not bash's "Killed" line
else
  kill -TERM "$sid"
  wait
  for _ in {1..30}; do pgrep -s "$sid" > /dev/null || break; sleep 1; done
  pgrep -s "$sid" > /dev/null && no "processes of the lease still run 30 s after its TERM: $(pgrep -a -s "$sid")"
  pkill -KILL -s "$sid"
fi
cat "$scratch/eight.out"
if ! tar -tzf "$killed" > "$scratch/killed.list" 2> /dev/null; then
  no "the pack left by SIG$kill_sig after $kill_at s is no whole tar.gz"
else
  tar -xzOf "$killed" --wildcards '*/summary.txt' > "$scratch/killed.summary" 2> /dev/null ||
    no "the pack left by SIG$kill_sig has no summary.txt"
  grep -q "/environment.txt\$" "$scratch/killed.list" || no "the pack left by SIG$kill_sig has no environment.txt"
  for p in $(sed -n 's/^== part \([a-z0-9-]*\): done in .*/\1/p' "$scratch/killed.summary"); do
    f=${part_file[$p]:-}
    if [[ -z $f ]]; then
      no "the pack's summary marks an unknown part done: $p"
    elif ! grep -q "/$f\$" "$scratch/killed.list"; then
      no "the pack's summary marks $p done, but the pack has no $f"
    elif [[ $f == *.json ]] && ! tar -xzOf "$killed" --wildcards "*/$f" |
      python3 -c 'import json, sys; json.load(sys.stdin)' 2> /dev/null; then
      no "the pack's $f (part $p, marked done) is not whole JSON"
    fi
  done
  echo "   the pack left behind marks done: $(sed -n 's/^== part \([a-z0-9-]*\): done in .*/\1/p' \
    "$scratch/killed.summary" | paste -sd' ' -)"
  if [[ $kill_sig == TERM ]]; then
    grep -q "^gpu_check: stopped by SIGTERM after [0-9]* s: the pack holds what finished" \
      "$scratch/killed.summary" || no "the pack after a TERM does not say the run was stopped"
    grep -q "^gpu_check: not done: [a-z0-9,-]*; run them again with --stage " \
      "$scratch/killed.summary" || no "the pack after a TERM does not name the parts left"
    compgen -G "$scratch/.killed.tar.gz.*" > /dev/null && no "a TERM left a temporary pack behind"
  fi
fi
exit $fail
