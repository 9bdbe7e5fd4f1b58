#!/usr/bin/env bash
# gpu_check.sh: proves a GPU machine and makes this project's GPU figures, one stage per call
# (a GPU machine allows 10 minutes a command: each stage is sized to end well under 8).
#
#   scripts/gpu_check.sh [--stage NAME] BUILD_DIR RESULTS_DIR
#                                                 run one stage (default: all, in order)
#   scripts/gpu_check.sh --bundle [DEST]          build here for sm_90 and pack a self-contained
#                                                 folder and DEST.tar.gz (default
#                                                 build-sm90/gpu_check_bundle)
#   scripts/gpu_check.sh --cuda-lib-dirs          print where it looks for the CUDA libraries
#
# BUILD_DIR is a CMake build tree (its bin/ holds the programs) or an unpacked bundle (bin/,
# lib/, torch_ref/, this script at its top: run `bash gpu_check.sh --stage tests . results`).
# The stages, in the order `--stage all` runs them:
#   tests      nvidia-smi and the libraries; the CUDA tests (ctest -R cuda in a build tree; the
#              doctest binaries with their filters in a bundle), test_dist's CUDA cases (Gloo
#              staging of CUDA tensors, NCCL at one rank) included;
#   sanitizer  compute-sanitizer: memcheck on the CUDA kernel tests, racecheck on the block
#              reductions;
#   amp        the CUDA AMP tests (16-bit kernels, nn.cuda.amp), then dp_bench --dtype fp32, bf16
#              and fp16 for the MLP and CNN at --gpus 1 (bf16 also with --activations bf16), and
#              bf16, fp16 at --gpus 4 --comm-dtype bf16: step time, loss, loss scale, skipped
#              steps and peak memory in the summary;
#   bench      bench_kernels (TF32 and bf16 GEMM against peak); dp_bench --mode both, --gpus 1
#              and 4, MLP and CNN (DP and DDP graphed: --cuda-graphs auto), and again with
#              --cuda-graphs off, whose losses must equal the graphed runs' bit for bit; DP on
#              4 GPUs with a 0.25 MiB first bucket; the MLP with --phase-times off, and with
#              --metrics-lag 1 too (same losses); GPT-2 124M bf16 on one GPU (tokens/s, MFU)
#              and the tiny GPT at --gpus 4;
#   torch      the PyTorch side by side (benchmarks/torch_ref) where torch imports with CUDA,
#              GPT-2 124M included;
#   profile    ncu --clock-control none on one replica's backward (NVTX dp/backward, the first
#              worker) and on the reduce (dp/reduce), a few kernels each (uncaptured steps:
#              --cuda-graphs off, whose phases have their own NVTX ranges).
# Every stage writes into RESULTS_DIR/DATE_DEVICE/ (logs, JSON) and appends its verdict lines to
# summary.txt there, so stages run in separate calls end up in one folder, ready to commit to
# benchmarks/results/. A stage stops starting steps once it has run STAGE_BUDGET_S seconds
# (default 420); a step cut off by the budget fails naming it. Exit status: 0 when no step
# failed, 1 when one did, 2 when there is no GPU (at once, with one line) or the arguments are
# wrong.
#
# The CUDA libraries (cuBLAS(Lt), cuDNN, NCCL) are found where they are: PyTorch's pip wheels
# (site-packages/nvidia/*/lib), /usr/local/cuda, else a search of the file system; the script
# puts their folders on LD_LIBRARY_PATH. A bundle carries every other shared library its
# programs need (TBB, Gloo, OpenBLAS, ...) in lib/.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

stages=(tests sanitizer amp bench torch profile)

usage() {
  echo "usage: $0 [--stage $(IFS='|' && echo "${stages[*]}")|all] BUILD_DIR RESULTS_DIR" \
    "| $0 --bundle [DEST] | $0 --cuda-lib-dirs" >&2
  exit 2
}

# ---- --bundle: build here for sm_90 and pack ------------------------------------------------

# The programs the check runs.
bundle_targets=(test_kernels_cuda test_nn test_dp test_dist bench_kernels dp_bench)

# Shared libraries a GPU machine provides itself: the C library family, and the CUDA libraries
# (present there in PyTorch's wheels or the toolkit; the script finds them at run time).
provided_lib() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libpthread.so* | libdl.so* | \
      librt.so* | libresolv.so* | libutil.so*) return 0 ;;
    libcuda.so* | libcudart.so* | libcublas*.so* | libcudnn*.so* | libnccl*.so* | \
      libnvrtc*.so* | libnvJitLink*.so* | libnvToolsExt*.so* | libcufft*.so* | \
      libcurand*.so* | libcusparse*.so* | libcusolver*.so*) return 0 ;;
  esac
  return 1
}

make_bundle() {
  local repo dest build size_kib limit_kib=$((60 * 1024))
  repo=$(cd "$here/.." && pwd)
  build=$repo/build-sm90
  dest=${1:-$build/gpu_check_bundle}
  [[ -f $repo/CMakeLists.txt && -d $repo/benchmarks/torch_ref ]] || {
    echo "gpu_check --bundle: run it from the source tree (scripts/gpu_check.sh)" >&2
    exit 2
  }
  local launcher=()
  if command -v ccache > /dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  echo "gpu_check --bundle: building ${bundle_targets[*]} for sm_90 in $build"
  mkdir -p "$build"
  # Without MPI: the GPU machine has no mpirun, and Open MPI's libraries (libmpi, open-pal,
  # open-rte, hwloc, libevent: about 3.4 MiB) would take the bundle past 60 MiB.
  cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON "${launcher[@]}" > "$build/configure.log" 2>&1 || {
    cat "$build/configure.log" >&2
    echo "gpu_check --bundle: configuring failed" >&2
    exit 1
  }
  cmake --build "$build" -j"$(nproc)" --target "${bundle_targets[@]}" || {
    echo "gpu_check --bundle: the build failed" >&2
    exit 1
  }
  # grep reads all of ldd's output: with pipefail, `grep -q` stopping at the first match could
  # fail the pipeline by ldd's SIGPIPE.
  ldd "$build/bin/dp_bench" | grep libcudnn > /dev/null || {
    echo "gpu_check --bundle: dp_bench was built without the CUDA backend (no nvcc here?)" >&2
    exit 1
  }

  rm -rf "$dest"
  mkdir -p "$dest/bin" "$dest/lib/compat" "$dest/torch_ref"
  local t
  for t in "${bundle_targets[@]}"; do
    cp "$build/bin/$t" "$dest/bin/"
    strip --strip-unneeded "$dest/bin/$t"
  done
  # Every shared library the programs load (ldd resolves the whole tree), but the ones the GPU
  # machine has. libstdc++ and libgcc_s go to lib/compat: used only when the machine's own are
  # older than the build's.
  local lib name
  while read -r lib; do
    name=$(basename "$lib")
    provided_lib "$name" && continue
    case "$name" in
      libstdc++.so* | libgcc_s.so*) cp -L "$lib" "$dest/lib/compat/$name" ;;
      *) cp -L "$lib" "$dest/lib/$name" ;;
    esac
  done < <(for t in "${bundle_targets[@]}"; do ldd "$build/bin/$t"; done |
    awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u)
  strip --strip-unneeded "$dest"/lib/*.so* "$dest"/lib/compat/*.so* 2> /dev/null
  # What the programs expect of the CUDA libraries, so the run can say what it looks for.
  for t in "${bundle_targets[@]}"; do ldd "$build/bin/$t"; done |
    awk '{print $1}' | while read -r name; do provided_lib "$name" && echo "$name"; done |
    grep -v '^\(linux-vdso\|ld-linux\|libc\.\|libm\.\|libpthread\|libdl\|librt\|libresolv\|libutil\)' |
    sort -u > "$dest/lib/cuda_needed.txt"

  cp "$here/gpu_check.sh" "$dest/gpu_check.sh"
  cp "$repo"/benchmarks/torch_ref/*.py "$repo"/benchmarks/torch_ref/*.sh \
    "$repo"/benchmarks/torch_ref/README.md "$dest/torch_ref/"
  {
    echo "gpu_check bundle"
    echo "source: $(git -C "$repo" describe --always --dirty 2> /dev/null || echo unknown)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) for sm_90 on $(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "run: bash gpu_check.sh . results"
    echo "CUDA libraries it expects on the GPU machine: $(tr '\n' ' ' < "$dest/lib/cuda_needed.txt")"
  } > "$dest/VERSION"

  tar -C "$(dirname "$dest")" -czf "$dest.tar.gz" "$(basename "$dest")"
  size_kib=$(du -sk "$dest" | cut -f1)
  echo "gpu_check --bundle: $dest: $((size_kib / 1024)) MiB ($size_kib KiB) unpacked," \
    "$(($(stat -c %s "$dest.tar.gz") / 1024)) KiB as $dest.tar.gz"
  local f listing=""
  for f in "$dest"/bin/* "$dest"/lib/*.so* "$dest"/lib/compat/*.so*; do
    [[ -e $f ]] && listing+="  ${f#"$dest"/} $(($(stat -c %s "$f") / 1024)) KiB"$'\n'
  done
  echo "  contents:"
  printf '%s' "$listing"
  if ((size_kib >= limit_kib)); then
    echo "gpu_check --bundle: the bundle is over the 60 MiB limit" >&2
    exit 1
  fi
}

# Folders holding the CUDA libraries the programs need: Python's site-packages (PyTorch's
# wheels: nvidia/cudnn/lib, nvidia/nccl/lib, nvidia/cublas/lib ...), the toolkit, else a search.
cuda_lib_dirs() {
  local d
  {
    if command -v python3 > /dev/null; then
      python3 - 2> /dev/null << 'EOF'
import site, sys, glob, os
roots = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path
for r in roots:
    for lib in glob.glob(os.path.join(r, "nvidia", "*", "lib")):
        print(os.path.realpath(lib))
EOF
    fi
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/*/lib; do
      [[ -d $d ]] && echo "$d"
    done
  } | awk '!seen[$0]++'
}

if [[ ${1:-} == --cuda-lib-dirs ]]; then  # what the run would search first (for tests)
  cuda_lib_dirs
  exit 0
fi
if [[ ${1:-} == --bundle ]]; then
  make_bundle "${2:-}"
  exit 0
fi
[[ ${1:-} == -h || ${1:-} == --help ]] && usage

# ---- the stage (checked before anything else, so a typo is named even without a GPU) --------

stage=all
if [[ ${1:-} == --stage ]]; then
  [[ $# -ge 2 ]] || usage
  stage=$2
  shift 2
elif [[ ${1:-} == --stage=* ]]; then
  stage=${1#--stage=}
  shift
fi
if [[ $stage != all && " ${stages[*]} " != *" $stage "* ]]; then
  echo "gpu_check: unknown --stage '$stage': give one of ${stages[*]} or all" >&2
  exit 2
fi

# ---- no GPU: one line, exit 2 ----------------------------------------------------------------

if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi is not installed): nothing to check" >&2
  exit 2
fi
if ! gpu_list=$(nvidia-smi -L 2> /dev/null) || ! grep -q '^GPU ' <<< "$gpu_list"; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none): nothing to check" >&2
  exit 2
fi

[[ $# -eq 2 ]] || usage
build=$(cd "$1" 2> /dev/null && pwd) || {
  echo "gpu_check: build folder '$1' does not exist" >&2
  exit 2
}
results_root=$2
# The programs each stage needs.
needed_programs() {
  case "$1" in
    tests | sanitizer) echo test_kernels_cuda ;;
    amp) echo test_kernels_cuda dp_bench ;;
    bench) echo bench_kernels dp_bench ;;
    torch | profile) echo dp_bench ;;
  esac
}
run_stages=("${stages[@]}")
[[ $stage != all ]] && run_stages=("$stage")
for st in "${run_stages[@]}"; do
  for t in $(needed_programs "$st"); do
    [[ -x $build/bin/$t ]] || {
      echo "gpu_check: $build/bin/$t is missing (stage $st): build it (cmake --build $1) or use a bundle" >&2
      exit 2
    }
  done
done

# ---- the CUDA libraries ----------------------------------------------------------------------

lib_path=""
add_lib_dir() { [[ -d $1 ]] && lib_path="${lib_path:+$lib_path:}$1"; }
bundle_lib=""
if [[ -d $build/lib ]]; then  # a bundle
  bundle_lib=$build/lib
  add_lib_dir "$bundle_lib"
fi
while read -r d; do add_lib_dir "$d"; done < <(cuda_lib_dirs)
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

missing_libs() { ldd "$build/bin/$1" 2> /dev/null | awk '/not found/ {print $1}' | sort -u; }
if [[ -n $(missing_libs dp_bench) ]]; then  # last resort: look everywhere
  while read -r f; do add_lib_dir "$(dirname "$f")"; done < <(
    timeout 120 find / -xdev \( -name 'libcudnn.so*' -o -name 'libnccl.so*' -o \
      -name 'libcublasLt.so*' -o -name 'libnvrtc.so*' \) 2> /dev/null | awk '!seen[$0]++')
  export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The bundle's libstdc++/libgcc_s only where the machine's own are older than the build's
# (ldd then reports a GLIBCXX/CXXABI/GCC version as not found): a newer system libstdc++ must
# win, since LD_LIBRARY_PATH goes before the system folders.
if [[ -n $bundle_lib ]] && ldd "$build/bin/dp_bench" 2>&1 | grep "\(GLIBCXX\|CXXABI\|GCC\)_.*not found" > /dev/null; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$bundle_lib/compat"
fi

# ---- results folder --------------------------------------------------------------------------

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)
n_gpus=$(grep -c '^GPU ' <<< "$gpu_list")
slug=$(tr '[:upper:]' '[:lower:]' <<< "${gpu_name:-gpu}" | tr -cs 'a-z0-9' '-' | sed 's/^-//;s/-$//')
out=$results_root/$(date -u +%Y-%m-%d)_$slug
mkdir -p "$out" || {
  echo "gpu_check: cannot make $out" >&2
  exit 2
}
out=$(cd "$out" && pwd)
summary=$out/summary.txt
failures=0
stage_budget_s=${STAGE_BUDGET_S:-420}
stage_start=$SECONDS

# One verdict line per step, on the terminal and appended to summary.txt.
verdict() {  # STATUS STEP DETAILS...
  local status=$1 step=$2
  shift 2
  printf '%-4s  %-34s %s\n' "$status" "$step" "$*" | tee -a "$summary"
  [[ $status == FAIL ]] && failures=$((failures + 1))
  return 0
}

# Runs a command with its output in LOG, within what is left of the stage's budget; the exit
# status is the command's (124 when the budget cut it off, 125 when none was left to start it).
logged() {  # LOG CMD...
  local log=$1 left=$((stage_budget_s - (SECONDS - stage_start)))
  shift
  echo "\$ $*" > "$log"
  if ((left <= 0)); then
    echo "gpu_check: the stage's ${stage_budget_s} s budget is spent: not started" >> "$log"
    return 125
  fi
  timeout --kill-after=10 "$left" "$@" >> "$log" 2>&1
}

# What to say after the exit status of a step that logged() stopped, else nothing.
budget_note() {  # STATUS
  case "$1" in
    124 | 137) echo " (cut off by the ${stage_budget_s} s stage budget)" ;;
    125) echo " (not started: the ${stage_budget_s} s stage budget was spent)" ;;
  esac
}

echo "gpu_check: $n_gpus GPU(s), $gpu_name; stage $stage; results in $out"
{
  echo "gpu_check --stage $stage of $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  [[ -f $build/VERSION ]] && sed -n '2,3p' "$build/VERSION"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} >> "$out/environment.txt"

# dp_bench's --json as one summary line: per run, mode, replicas, step time, loss, loss scale
# and skipped steps.
bench_line() {  # JSON
  python3 - "$1" 2> /dev/null << 'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
runs = [f"{r['mode']} x{r['gpus']} {r['step_ms_median']:.3f} ms/step, loss {r['final_loss']:.4f}, "
        f"scale {r.get('loss_scale', 1):g}, skipped {r.get('skipped_steps', 0)}, peak "
        f"{max(r.get('peak_mem_bytes') or [0]) / 2**20:.1f} MiB" for r in j["runs"]]
note = " (logical GPUs share hardware: overhead, not scaling)" if j.get("oversubscribed") else ""
print(", ".join(runs) + note)
EOF
}

# One dp_bench run as a step: NAME LABEL ARGS...
bench_step() {
  local name=$1 label=$2 rc line
  shift 2
  logged "$out/$name.txt" "$build/bin/dp_bench" --device cuda --json "$out/$name.json" "$@"
  rc=$?
  if ((rc == 0)); then
    line=$(bench_line "$out/$name.json")
    verdict ok "$label" "${line:-see $name.txt}"
  else
    verdict FAIL "$label" "exit $rc$(budget_note $rc): see $name.txt"
  fi
}

# Two dp_bench runs that must train alike: LABEL GRAPHED_JSON OTHER_JSON. Every run (mode, N)
# of the second must be in the first, have replayed steps there, and the same losses.
same_losses_verdict() {
  local label=$1 line
  line=$(
    python3 - "$2" "$3" 2>&1 << 'EOF'
import json, sys
on = {(r["mode"], r["gpus"]): r for r in json.load(open(sys.argv[1]))["runs"]}
off = {(r["mode"], r["gpus"]): r for r in json.load(open(sys.argv[2]))["runs"]}
said, bad = [], []
for key, r in sorted(off.items()):
    name = f"{key[0]} N={key[1]}"
    g = on.get(key)
    if g is None:
        bad.append(f"{name} missing")
        continue
    said.append(f"{name} {g.get('graphed_steps', 0)} of {len(g['losses'])} replayed")
    if g.get("graphed_steps", 0) == 0:
        bad.append(f"{name} never replayed")
    if g["losses"] != r["losses"]:
        bad.append(f"{name} losses differ")
print(("FAIL " if bad or not said else "ok ") + ", ".join(said + bad))
EOF
  )
  if [[ $line == "ok "* ]]; then
    verdict ok "$label" "${line#ok }"
  else
    verdict FAIL "$label" "${line#FAIL }"
  fi
}

# Doctest binaries with their test-case filters, into one log: LOG LABEL BIN:FILTER...
doctest_step() {
  local log=$1 label=$2 ok=1 counts="" spec bin filter rc
  shift 2
  : > "$out/$log"
  for spec in "$@"; do
    bin=${spec%%:*} filter=${spec#*:}
    if [[ ! -x $build/bin/$bin ]]; then
      counts+="$bin: missing; "
      ok=0
      continue
    fi
    logged "$out/$log.part" "$build/bin/$bin" -tc="$filter"
    rc=$?
    cat "$out/$log.part" >> "$out/$log"
    rm -f "$out/$log.part"
    ((rc == 0)) || ok=0
    counts+="$bin: $(grep 'test cases:' "$out/$log" | tail -1 | tr -s ' ' | cut -c1-80)$(budget_note $rc); "
  done
  if ((ok)); then verdict ok "$label" "$counts"; else verdict FAIL "$label" "$counts see $log"; fi
}

# ---- stages ----------------------------------------------------------------------------------

stage_tests() {
  local driver
  if logged "$out/nvidia-smi.txt" nvidia-smi; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    verdict ok nvidia-smi "$n_gpus GPU(s): $gpu_name, driver $driver"
  else
    verdict FAIL nvidia-smi "nvidia-smi failed: see nvidia-smi.txt"
  fi
  if [[ -n $(missing_libs test_kernels_cuda) ]]; then
    verdict FAIL libraries "not found: $(missing_libs test_kernels_cuda | tr '\n' ' ')(install PyTorch's CUDA wheels or the CUDA toolkit)"
  else
    verdict ok libraries "every shared library of the programs resolves (ldd)"
  fi
  # The doctest binaries with their filters, in a build tree as in a bundle (ctest -R cuda
  # would miss test_dist's CUDA cases, one ctest entry per binary). Filters ignore case.
  doctest_step cuda_tests.txt "CUDA tests (doctest)" "test_kernels_cuda:kernels.cuda*" \
    "test_nn:nn.cuda*" "test_dp:dp.cuda*" "test_dist:*cuda*"
}

stage_sanitizer() {
  # API errors are not reported: the tests provoke some on purpose (an allocation larger than
  # the GPU must fail with a clear error); memory and race errors are.
  if ! command -v compute-sanitizer > /dev/null; then
    verdict SKIP compute-sanitizer "not installed (it comes with the CUDA toolkit)"
    return
  fi
  local rc
  logged "$out/memcheck.txt" compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 99 "$build/bin/test_kernels_cuda" -tc='kernels.cuda*'
  rc=$?
  if ((rc == 0)); then
    verdict ok "memcheck (kernel tests)" "$(grep -o 'ERROR SUMMARY.*' "$out/memcheck.txt" | tail -1)"
  else
    verdict FAIL "memcheck (kernel tests)" "$(grep -o 'ERROR SUMMARY.*' "$out/memcheck.txt" | tail -1)$(budget_note $rc): see memcheck.txt"
  fi
  # The kernels with shared-memory reductions and chunked sums.
  local race='kernels.cuda.mse_loss*,kernels.cuda.batch_norm*,kernels.cuda.layer_norm*,kernels.cuda.bias*,kernels.cuda.softmax_cross_entropy: matches*'
  logged "$out/racecheck.txt" compute-sanitizer --tool racecheck --report-api-errors no \
    --error-exitcode 99 "$build/bin/test_kernels_cuda" -tc="$race"
  rc=$?
  if ((rc == 0)); then
    verdict ok "racecheck (reductions)" "$(grep -o 'RACECHECK SUMMARY.*\|ERROR SUMMARY.*' "$out/racecheck.txt" | tail -1)"
  else
    verdict FAIL "racecheck (reductions)" "exit $rc$(budget_note $rc): see racecheck.txt"
  fi
}

stage_amp() {
  # The CUDA AMP tests: the 16-bit kernel cases (bf16 and f16 GEMM, convolution, axpy,
  # all_finite) and nn.cuda.amp (bf16 and fp16 steps against the CPU).
  doctest_step amp_tests.txt "CUDA AMP tests (doctest)" \
    "test_kernels_cuda:*f16*,*16-bit*" "test_nn:nn.cuda.amp*"
  local model dtype
  for model in mlp cnn; do
    # fp32 is the reference step time. LeNet's channel counts (1, 6, 16) are not multiples of
    # 8: expect bf16 slower than fp32 on the CNN, and read it as such.
    for dtype in fp32 bf16 fp16; do
      bench_step "amp_${model}_${dtype}_gpus1" "amp $model $dtype --gpus 1" --mode both \
        --gpus 1 --baseline 0 --model "$model" --dtype "$dtype"
    done
    # bf16 activations between layers (--activations bf16): step time and peak memory against
    # the bf16 run above, whose activations are f32
    bench_step "amp_${model}_bf16_actbf16_gpus1" "amp $model bf16 --activations bf16" \
      --mode both --gpus 1 --baseline 0 --model "$model" --dtype bf16 --activations bf16
    for dtype in bf16 fp16; do
      bench_step "amp_${model}_${dtype}_gpus4_commbf16" "amp $model $dtype --gpus 4 comm bf16" \
        --mode both --gpus 4 --baseline 0 --model "$model" --dtype "$dtype" --comm-dtype bf16
    done
  done
}

stage_bench() {
  local rc line model g
  logged "$out/bench_kernels.txt" "$build/bin/bench_kernels" --device cuda \
    --json "$out/bench_kernels.json"
  rc=$?
  if ((rc == 0)); then
    line=$(
      python3 - "$out/bench_kernels.json" 2> /dev/null << 'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
rows = j["results"]
best = {}
for r in rows:
    if r.get("kind") == "gemm" and r.get("dtype") in ("tf32", "bf16"):
        d = r["dtype"]
        if d not in best or r["gflops"] > best[d]["gflops"]:
            best[d] = r
out = []
for d in ("tf32", "bf16"):
    if d in best:
        r = best[d]
        tf = r["gflops"] / 1e3
        peak = r.get("peak_tflops") or 0
        out.append(f"{d} {tf:.0f} TFLOP/s at n={r['n']}" +
                   (f" ({100 * tf / peak:.0f}% of {peak:g})" if peak else " (peak unknown)"))
print(", ".join(out))
EOF
    )
    verdict ok "bench_kernels (GEMM)" "${line:-see bench_kernels.txt}"
  else
    verdict FAIL "bench_kernels (GEMM)" "exit $rc$(budget_note $rc): see bench_kernels.txt"
  fi
  # DP and DDP, 1 and 4 logical GPUs, MLP and CNN
  for model in mlp cnn; do
    for g in 1 4; do
      bench_step "dp_bench_${model}_gpus$g" "dp_bench $model --gpus $g" --mode both \
        --gpus "$g" --model "$model"
    done
  done
  # The same DP and DDP steps uncaptured (--cuda-graphs off), against the graphed runs above
  # (auto: on); their losses must be the graphed runs' bit for bit.
  for model in mlp cnn; do
    for g in 1 4; do
      bench_step "dp_bench_${model}_gpus${g}_nographs" "dp_bench $model --gpus $g graphs off" \
        --mode both --baseline 0 --gpus "$g" --model "$model" --cuda-graphs off
      same_losses_verdict "graphs = uncaptured, $model --gpus $g" \
        "$out/dp_bench_${model}_gpus$g.json" "$out/dp_bench_${model}_gpus${g}_nographs.json"
    done
  done
  # A first bucket of 0.25 MiB against the default 1 MiB, where buckets overlap backward (DP
  # uncaptured; the MLP's 1.03 MiB of gradients make 2 buckets instead of 1): against the
  # nographs run above.
  bench_step dp_bench_mlp_gpus4_nographs_bucket025 "dp_bench mlp --gpus 4 graphs off, first bucket 0.25 MiB" \
    --mode dp --baseline 0 --gpus 4 --model mlp --cuda-graphs off --first-bucket-mb 0.25
  # Graphed MLP steps (DP and DDP) with untimed marks (--phase-times off), then also with the
  # metrics read a step late (--metrics-lag 1: the host queues step k+1 while the GPU runs step
  # k): step times side by side, and the lagged run's losses the same as the untimed one's.
  for g in 1 4; do
    bench_step "dp_bench_mlp_gpus${g}_untimed" "dp_bench mlp --gpus $g --phase-times off" \
      --mode both --baseline 0 --gpus "$g" --model mlp --phase-times off
    bench_step "dp_bench_mlp_gpus${g}_lag1" "dp_bench mlp --gpus $g --metrics-lag 1" \
      --mode both --baseline 0 --gpus "$g" --model mlp --phase-times off --metrics-lag 1
    same_losses_verdict "metrics lag 1 = 0, mlp --gpus $g" \
      "$out/dp_bench_mlp_gpus${g}_lag1.json" "$out/dp_bench_mlp_gpus${g}_untimed.json"
  done
  # GPT-2 124M in bf16 (bf16 activations: attention on cuDNN's fused SDPA), tokens/s and MFU;
  # the tiny GPT through DP and DDP on 4 logical GPUs.
  bench_step dp_bench_gpt124m_bf16 "dp_bench gpt-124m bf16 --gpus 1" --mode dp --gpus 1 \
    --baseline 0 --model gpt --gpt-config 124m --seq 1024 --batch 8 --dtype bf16 \
    --activations bf16 --steps 20 --warmup 3
  bench_step dp_bench_gpt_tiny_gpus4 "dp_bench gpt-tiny --gpus 4" --mode both --gpus 4 \
    --model gpt --gpt-config tiny
  # Dropout under graphs (attention and residual): the offsets are read on the GPU, so every
  # replay draws its step's masks; the losses must equal the uncaptured run's bit for bit.
  for graphs in on off; do
    bench_step "dp_bench_gpt_tiny_dropout_graphs_$graphs" \
      "dp_bench gpt-tiny --dropout 0.1 --gpus 2 graphs $graphs" --mode both --gpus 2 \
      --baseline 0 --model gpt --gpt-config tiny --dropout 0.1 --cuda-graphs "$graphs"
  done
  same_losses_verdict "graphs = uncaptured, gpt-tiny --dropout 0.1 --gpus 2" \
    "$out/dp_bench_gpt_tiny_dropout_graphs_on.json" "$out/dp_bench_gpt_tiny_dropout_graphs_off.json"
}

stage_torch() {
  local torch_ref=$here/torch_ref n_side model dtype tag rc
  [[ -d $torch_ref ]] || torch_ref=$here/../benchmarks/torch_ref
  if ! python3 -c 'import torch, numpy, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    > /dev/null 2>&1; then
    verdict SKIP "PyTorch side by side" "torch (with CUDA) or numpy does not import in python3"
    return
  fi
  n_side=$((n_gpus < 4 ? n_gpus : 4))
  for model in mlp cnn; do
    for dtype in fp32 bf16; do  # bf16: our policy against torch.autocast
      tag=${model}${dtype/fp32/}
      OUT_DIR=$out/torch_side_by_side_$tag logged "$out/torch_side_by_side_$tag.txt" \
        bash "$torch_ref/side_by_side.sh" "$build" "$n_side" --device cuda --model "$model" \
        --dtype "$dtype"
      rc=$?
      if ((rc == 0)); then
        verdict ok "PyTorch side by side $model $dtype" "N=$n_side: see torch_side_by_side_$tag.txt"
      else
        verdict FAIL "PyTorch side by side $model $dtype" "exit $rc$(budget_note $rc): see torch_side_by_side_$tag.txt"
      fi
    done
  done
  # GPT-2 124M on one GPU: ours against torch eager, CUDA graph and torch.compile.
  OUT_DIR=$out/torch_side_by_side_gpt124m logged "$out/torch_side_by_side_gpt124m.txt" \
    bash "$torch_ref/side_by_side.sh" "$build" 1 --device cuda --model gpt --gpt-config 124m \
    --seq 1024 --batch 8 --dtype bf16 --steps 30 --warmup 5 --repeat 3
  rc=$?
  if ((rc == 0)); then
    verdict ok "PyTorch side by side gpt-124m bf16" "N=1: see torch_side_by_side_gpt124m.txt"
  else
    verdict FAIL "PyTorch side by side gpt-124m bf16" "exit $rc$(budget_note $rc): see torch_side_by_side_gpt124m.txt"
  fi
}

# Nsight Compute on the kernels inside one NVTX range of a short DP run of the CNN on 2 logical
# GPUs: dp/backward (the workers' ranges are named by phase; --launch-count keeps the first
# kernels, one replica's backward) and dp/reduce. --clock-control none keeps the GPU's own
# clocks, as in the timed runs. ncu's filter reads "/" as nesting, so the one inside our range
# names is escaped: "dp\/backward/" is the push/pop range named dp/backward.
stage_profile() {
  local ncu_bin rc what
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2> /dev/null | head -1)
  if [[ -z $ncu_bin ]]; then
    verdict SKIP "ncu (profile)" "Nsight Compute (ncu) is not installed (it comes with the CUDA toolkit)"
    return
  fi
  for what in backward reduce; do
    logged "$out/ncu_$what.txt" "$ncu_bin" --clock-control none --nvtx \
      --nvtx-include "dp\\/$what/" --launch-count 12 --section SpeedOfLight --section LaunchStats \
      --csv --page details "$build/bin/dp_bench" --device cuda --mode dp --gpus 2 --baseline 0 \
      --model cnn --warmup 1 --steps 2 --cuda-graphs off
    rc=$?
    if ((rc == 0)) && grep -q 'Duration' "$out/ncu_$what.txt"; then
      verdict ok "ncu dp/$what" "$(grep -c '"Duration"' "$out/ncu_$what.txt") kernels profiled: see ncu_$what.txt"
    else
      verdict FAIL "ncu dp/$what" "exit $rc$(budget_note $rc), or no kernel in the range: see ncu_$what.txt"
    fi
  done
}

for st in "${run_stages[@]}"; do
  stage_start=$SECONDS
  echo "== stage $st ($(date -u +%Y-%m-%dT%H:%M:%SZ)) ==" | tee -a "$summary"
  "stage_$st"
  echo "   stage $st took $((SECONDS - stage_start)) s" | tee -a "$summary"
done

if ((failures)); then
  echo "gpu_check: $failures step(s) failed in stage $stage; everything is in $out" | tee -a "$summary"
  exit 1
fi
echo "gpu_check: stage $stage passed; commit $out to benchmarks/results/" | tee -a "$summary"
exit 0
