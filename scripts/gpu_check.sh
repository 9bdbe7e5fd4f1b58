#!/usr/bin/env bash
# gpu_check.sh: proves a GPU machine and makes this project's GPU figures.
#
#   scripts/gpu_check.sh [--stage LIST] [--lease SECONDS] [--skip-done SUMMARY] [--pack FILE]
#                        BUILD_DIR RESULTS_DIR
#   scripts/gpu_check.sh --bundle [DEST]          build here for sm_90 and pack a self-contained
#                                                 folder and DEST.tar.xz (default
#                                                 build-sm90/gpu_check_bundle)
#   scripts/gpu_check.sh --cuda-lib-dirs          print where it looks for the CUDA libraries
#
# A lent GPU comes with 15 minutes of device time for the whole task, the machine's start (a
# minute or two) included, and 10 minutes a command. The usual run is one lease in one call:
#   here:  scripts/gpu_check.sh --bundle   (installs what is missing, then builds: about 12
#          minutes from nothing on 2 cores, a minute or two after a change to a few files)
#   there: run(timeout_s 540, carry ["build-sm90/gpu_check_bundle.tar.xz"]):
#            python3 scripts/unpack_bundle.py build-sm90/gpu_check_bundle.tar.xz /tmp &&
#            cd /tmp/gpu_check_bundle &&
#            bash gpu_check.sh --lease 480 --pack "$OUT/gpu_check.tar.gz" . /tmp/results
#   then give_back; unpack the tar.gz into benchmarks/results/ and commit it. 480 s leaves a
#   few minutes of the 15 for a short second call on the still warm machine (within its 30 s):
#   --lease 120 --stage LIST with what the summary's last line lists.
# ($OUT brings back at most 8 files, two folders deep: the results come back packed, one file.)
#
# --lease S: every part below, ended within S seconds of the script's start (setup included),
# most wanted first: what has never run on a GPU leads. First the two light parts that time
# nothing run side by side (tests | amp-tests), for at most LEASE_SIDE_S seconds (default 120);
# then one at a time: probe (one graphed 1-repeat run of each model), gpt, gpt-profile, gpt-batch,
# torch-gpt (at most LEASE_TORCH_GPT_S, default 180), torch-gpt-b32 (at most
# LEASE_TORCH_GPT_B32_S, default 200), graphs, torch-fp32, torch-bf16, amp-runs, bench-more,
# memcheck, racecheck (alone: GPU processes time-slice, and their slowed kernels would hold the
# others back), gemm, profile. After every part the results are packed again
# (--pack: a new file beside it, then renamed over it), so a run stopped at any moment leaves
# the pack of the parts finished so far. Steps the deadline cuts off or leaves unstarted are
# marked CUT; the last line names the parts not done and the --stage list that runs them. A
# later lease runs that list (--lease S --stage LIST runs it in order, one at a time), or all
# again with --skip-done OLD_SUMMARY (parts whose summary line there says "done" are skipped).
#
# --stage LIST: stages or parts, comma-separated, run in that order (default: all, the six stages
# in order); without --lease each item gets STAGE_BUDGET_S seconds (default 420, so a stage fits
# a 10-minute call). The stages and their parts:
#   tests      tests: nvidia-smi and the libraries; the CUDA doctest cases of test_kernels_cuda,
#              test_nn, test_dp, test_dist (Gloo staging of CUDA tensors, NCCL at one rank) and
#              test_bench (graphed DDP on a GPU);
#   sanitizer  memcheck: compute-sanitizer memcheck on the CUDA kernel tests; racecheck: on the
#              block reductions (both SKIP where compute-sanitizer --version or a trivial run
#              under it fails: the machine does not support it);
#   amp        amp-tests: the CUDA AMP tests (16-bit kernels, nn.cuda.amp); amp-runs: dp_bench
#              --dtype fp32, bf16 and fp16 for the MLP and CNN at --gpus 1 (bf16 also with
#              --activations bf16), bf16 and fp16 DP and DDP on 1 and 4 logical GPUs (4 must
#              follow 1 within 5e-2), and bf16 at --gpus 4 --comm-dtype bf16: step time, loss,
#              loss scale, skipped steps and peak memory in the summary;
#   bench      probe: one dp_bench run of each model (MLP, CNN, tiny GPT) at --gpus 1 with
#              --cuda-graphs auto, one repeat: its ms/step, and whether it ran graphed or fell
#              back uncaptured (and why); gemm: bench_kernels (TF32 and bf16 GEMM against peak);
#              graphs: dp_bench --mode both, --gpus 1 and 4, MLP and CNN (DP and DDP graphed:
#              --cuda-graphs auto; 4 must follow 1 within 1e-3), and again with --cuda-graphs
#              off, whose losses must equal the graphed runs' bit for bit (a run whose capture
#              fell back says so and why), and DP at 4 with --dp-graph-pulls beside (the same
#              losses); gpt: GPT-2 124M in bf16, DP on 1 and 4 logical GPUs
#              (tokens/s, MFU, the 4/1 ratio), 3 interleaved repeats, at batch 8, 32 and 64,
#              32 again uncaptured (--cuda-graphs off: the reduce overlaps backward) and graphed
#              with --dp-graph-pulls beside (the sums beside the captured backward), and one GPU
#              at 32 with --loss-chunk 0;
#              gpt-batch: the largest GPT-2 124M batch that fits (16, 32, ... 256; out of memory
#              ends it, cuBLAS's CUBLAS_STATUS_ALLOC_FAILED included), tokens/s and MFU at each;
#              bench-more: DP on 4 GPUs with a 0.25 MiB first bucket, staged pulls
#              (--dp-peer-reads off, graphed and not: the in-place losses), the MLP with
#              --phase-times off and with --metrics-lag 1 too (same losses), the tiny GPT at
#              --gpus 4, and with dropout graphed and not (same losses);
#   torch      the PyTorch side by side (benchmarks/torch_ref/variants.py: ours against eager,
#              CUDA graph and torch.compile, 5 interleaved repeats, 95% intervals) where torch
#              imports with CUDA: torch-fp32 (MLP, CNN), torch-bf16 (MLP, CNN), torch-gpt (GPT-2
#              124M bf16, batch 8, 3 repeats), torch-gpt-b32 (the same at batch 32 against
#              torch.compile alone: issue 49 asks for 1.1x its tokens/s and 45% MFU at one
#              batch, and our MFU passes 45% at 32, not at 8); variants.py gets what is left of the budget (--budget-s),
#              prints each measurement as it is taken, and stops with what it has when that runs
#              out (CUT, naming what it did not reach);
#   profile    profile: ncu --clock-control none on one replica's backward (NVTX dp/backward, the
#              first worker) and on the reduce (dp/reduce), a few kernels each (uncaptured steps:
#              --cuda-graphs off, whose phases have their own NVTX ranges); SKIP where ncu
#              --version or a trivial profile fails or is refused (ERR_NVGPUCTRPERM, "not
#              supported": a VM without access to the GPU's counters); gpt-profile: ncu's
#              duration of every kernel of one uncaptured GPT-2 124M step (bf16, batch 8),
#              summed by kind, NVTX range and kernel (benchmarks/ncu_summary.py).
# Every part writes into RESULTS_DIR/DATE_DEVICE/ (logs, JSON) and appends its verdict lines (ok,
# FAIL, SKIP, CUT) and one "== part NAME: done|not done" line to summary.txt there, so runs in
# separate calls of one build end up in one folder, ready to commit to benchmarks/results/ (its
# build.txt names the build; another build's folder is left alone: the results folder below).
# --pack FILE writes that folder as a tar.gz once set up, again after every part, and at the
# end, each time whole (a temporary file in FILE's folder, then renamed: a kill leaves the last
# pack or the new one; a TERM or INT stops the running step and packs once more). Every helper
# command has its own time limit (helper_limits below: nvidia-smi queries, ldd, python3
# verdicts, torch's import, the library search, the tool probes, the pack). Exit status: 0 when
# every step ran and none failed, 1 when one failed (or the pack could not be written), 3 when
# none failed but some were cut off or not started by the budget, 2 when there is no GPU (at
# once, with one line) or the arguments are wrong, 128 + N when signal N stopped it.
# GPU_CHECK_DRY_RUN=1 (for this script's own test, with a stand-in nvidia-smi) runs the same
# steps on CPU devices, shortened.
#
# The CUDA libraries (cuBLAS(Lt), cuDNN, NCCL) are found where they are: PyTorch's pip wheels
# (site-packages/nvidia/*/lib), /usr/local/cuda, else a search of the file system; the script
# puts their folders on LD_LIBRARY_PATH. A bundle carries every other shared library its
# programs need (TBB, Gloo, OpenBLAS, ...) in lib/.
set -uo pipefail

# The clock starts here: a lease's seconds count from the script's start, the library search and
# the setup included.
now() { printf '%(%s)T' -1; }
t_start=$(now)

# helper_limits: seconds each helper command may take, so that a hung driver, interpreter or file
# system costs a step, never the lease: nvidia-smi queries, ldd, python3 (verdicts, JSON reads,
# the library folders), torch's import, the search of the file system for the CUDA libraries, a
# compute-sanitizer or ncu probe (--version, then a trivial run), and one pack. t_torch_margin:
# what a PyTorch side by side keeps of its budget for side_by_side.sh's own imports and report.
t_smi=20 t_ldd=20 t_py=30 t_torch=60 t_find=20 t_probe=60 t_pack=60 t_torch_margin=20

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

stages=(tests sanitizer amp bench torch profile)
parts=(tests memcheck racecheck amp-tests amp-runs probe gemm graphs gpt gpt-batch bench-more
  torch-fp32 torch-bf16 torch-gpt torch-gpt-b32 profile gpt-profile)
stage_parts() {
  case "$1" in
    tests) echo tests ;;
    sanitizer) echo memcheck racecheck ;;
    amp) echo amp-tests amp-runs ;;
    bench) echo probe gemm graphs gpt gpt-batch bench-more ;;
    torch) echo torch-fp32 torch-bf16 torch-gpt torch-gpt-b32 ;;
    profile) echo profile gpt-profile ;;
  esac
}
# A lease runs first what has never run on a GPU: the CUDA tests, side by side (each job runs
# its parts in order; neither times anything, and each keeps the GPU lightly loaded), then one
# at a time the graphed probe of each model, GPT-2 124M (tokens/s, MFU), its largest batch and
# the PyTorch GPT beside it; then the repeats and ratios (issue 26's goals), the AMP runs, the
# rest of the bench, the sanitizers (alone: processes on one GPU time-slice them, and their
# instrumented kernels would slow whatever ran beside them), the GEMMs and the profile.
lease_jobs=("tests" "amp-tests")
lease_timed=(probe gpt gpt-profile gpt-batch torch-gpt torch-gpt-b32 graphs torch-fp32 torch-bf16
  amp-runs bench-more memcheck racecheck gemm profile)
# A part's cap within a lease, seconds (none: up to the lease's end).
declare -A lease_cap_s=([torch-gpt]=${LEASE_TORCH_GPT_S:-180}
  [torch-gpt-b32]=${LEASE_TORCH_GPT_B32_S:-200})

usage() {
  {
    echo "usage: $0 [--stage LIST] [--lease SECONDS] [--skip-done SUMMARY] [--pack FILE]" \
      "BUILD_DIR RESULTS_DIR | $0 --bundle [DEST] | $0 --cuda-lib-dirs"
    echo "  LIST: all, or stages and parts, comma-separated: ${stages[*]}; ${parts[*]}"
    echo "  --lease S (all): ${lease_jobs[*]} side by side (LEASE_SIDE_S, 120 s), then" \
      "${lease_timed[*]}; packed (--pack) after every part"
  } >&2
  exit 2
}

# ---- --bundle: build here for sm_90 and pack ------------------------------------------------

# The programs the check runs (test_bench for its graphed DDP case, run against the bundle's
# dp_bench through DP_BENCH_PROGRAM; test_samples and test_train_text for their CUDA memory
# checks, against the bundle's train_mnist and train_text likewise).
bundle_targets=(test_kernels_cuda test_nn test_dp test_dist test_bench bench_kernels dp_bench
  test_samples train_mnist test_train_text train_text)

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
  local repo dest build size_kib tgz_kib tree_kib limit_kib
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
  # A fresh machine lacks the Debian packages (the configure step would fail on oneTBB, 15
  # minutes into a lease's wait, as on 2026-12-04); setup.sh installs what is missing, and
  # returns in a fraction of a second when nothing is.
  bash "$repo/scripts/setup.sh" || {
    echo "gpu_check --bundle: scripts/setup.sh failed: the packages the build needs are missing" >&2
    exit 1
  }
  echo "gpu_check --bundle: building ${bundle_targets[*]} for sm_90 in $build"
  mkdir -p "$build"
  # Without MPI: the GPU machine has no mpirun, and Open MPI's libraries (libmpi, open-pal,
  # open-rte, hwloc, libevent: about 3.4 MiB) would take the bundle past 60 MiB.
  cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_dnnl=ON "${launcher[@]}" > "$build/configure.log" 2>&1 || {
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
  cp "$repo/benchmarks/ncu_summary.py" "$dest/ncu_summary.py"
  cp "$repo"/benchmarks/torch_ref/*.py "$repo"/benchmarks/torch_ref/*.sh \
    "$repo"/benchmarks/torch_ref/README.md "$dest/torch_ref/"
  {
    echo "gpu_check bundle"
    echo "source: $(git -C "$repo" describe --always --dirty 2> /dev/null || echo unknown)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) for sm_90 on $(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "run: bash gpu_check.sh . results"
    echo "CUDA libraries it expects on the GPU machine: $(tr '\n' ' ' < "$dest/lib/cuda_needed.txt")"
  } > "$dest/VERSION"

  # xz, not gzip: the programs carry the same CUDA kernels each, which gzip's 32 KiB window
  # cannot see twice and xz's 64 MiB dictionary can (215 MiB unpacked: 58 MiB as tar.gz, 20 MiB
  # as tar.xz). The GPU machine unpacks it with python3's tarfile (scripts/unpack_bundle.py),
  # whatever its tar has.
  command -v xz > /dev/null || {
    echo "gpu_check --bundle: xz is missing here (apt-get install xz-utils)" >&2
    exit 1
  }
  rm -f "$dest.tar.gz"
  tar -C "$(dirname "$dest")" -cf - "$(basename "$dest")" | xz -9 -T2 > "$dest.tar.xz.tmp"
  mv "$dest.tar.xz.tmp" "$dest.tar.xz"
  size_kib=$(du -sk "$dest" | cut -f1)
  echo "gpu_check --bundle: $dest: $((size_kib / 1024)) MiB ($size_kib KiB) unpacked," \
    "$(($(stat -c %s "$dest.tar.xz") / 1024)) KiB as $dest.tar.xz"
  local f listing=""
  for f in "$dest"/bin/* "$dest"/lib/*.so* "$dest"/lib/compat/*.so*; do
    [[ -e $f ]] && listing+="  ${f#"$dest"/} $(($(stat -c %s "$f") / 1024)) KiB"$'\n'
  done
  echo "  contents:"
  printf '%s' "$listing"
  # What travels is the tar.xz beside the working tree (tracked and untracked files git does not
  # ignore), within the device tool's 64 MiB a call; 1 MiB is kept for files added before the
  # call.
  tgz_kib=$(($(stat -c %s "$dest.tar.xz") / 1024))
  tree_kib=$(($(git -C "$repo" ls-files -co --exclude-standard -z |
    (cd "$repo" && du -cb --files0-from=- 2> /dev/null) | tail -1 | cut -f1) / 1024))
  limit_kib=$((63 * 1024 - tree_kib))
  echo "  travels: $((tgz_kib / 1024)) MiB of bundle + $((tree_kib / 1024)) MiB of working tree" \
    "(a device call takes 64 MiB)"
  if ((tgz_kib >= limit_kib)); then
    echo "gpu_check --bundle: $dest.tar.xz is $((tgz_kib / 1024)) MiB, over the" \
      "$((limit_kib / 1024)) MiB that the working tree ($((tree_kib / 1024)) MiB) leaves of a" \
      "device call's 64 MiB" >&2
    exit 1
  fi
}

# Folders holding the CUDA libraries the programs need: Python's site-packages (PyTorch's
# wheels: nvidia/cudnn/lib, nvidia/nccl/lib, nvidia/cublas/lib ...), the toolkit, else a search.
cuda_lib_dirs() {
  local d
  {
    if command -v python3 > /dev/null; then
      timeout "$t_py" python3 - 2> /dev/null << 'EOF'
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

# ---- arguments (checked before anything else, so a typo is named even without a GPU) ---------

stage=all lease_s="" skip_done="" pack=""
positional=()
while (($#)); do
  case "$1" in
    --stage | --lease | --skip-done | --pack)
      [[ $# -ge 2 ]] || usage
      case "$1" in
        --stage) stage=$2 ;;
        --lease) lease_s=$2 ;;
        --skip-done) skip_done=$2 ;;
        --pack) pack=$2 ;;
      esac
      shift 2
      ;;
    --stage=*) stage=${1#--stage=} && shift ;;
    --lease=*) lease_s=${1#--lease=} && shift ;;
    --skip-done=*) skip_done=${1#--skip-done=} && shift ;;
    --pack=*) pack=${1#--pack=} && shift ;;
    -h | --help) usage ;;
    --*)
      echo "gpu_check: unknown flag '$1' (flags: --stage --lease --skip-done --pack)" >&2
      exit 2
      ;;
    *) positional+=("$1") && shift ;;
  esac
done

# The parts to run, in order, from --stage; items[i] is the stage or part that gave each group.
items=()
if [[ $stage == all ]]; then
  items=("${stages[@]}")
else
  IFS=',' read -r -a items <<< "$stage"
  ((${#items[@]})) || usage
fi
for item in "${items[@]}"; do
  if [[ " ${stages[*]} " != *" $item "* && " ${parts[*]} " != *" $item "* ]]; then
    echo "gpu_check: unknown --stage '$item': give all, or stages and parts (comma-separated):" \
      "${stages[*]}; ${parts[*]}" >&2
    exit 2
  fi
done
item_parts() {  # ITEM: its parts
  if [[ " ${stages[*]} " == *" $1 "* ]]; then stage_parts "$1"; else echo "$1"; fi
}
if [[ -n $lease_s ]] && ! [[ $lease_s =~ ^[1-9][0-9]{0,4}$ ]]; then
  echo "gpu_check: --lease '$lease_s': give the seconds the run must end within (1 to 99999)" >&2
  exit 2
fi
if [[ -n $skip_done && ! -r $skip_done ]]; then
  echo "gpu_check: --skip-done '$skip_done': no such readable file (give an earlier summary.txt)" >&2
  exit 2
fi
if [[ -n $pack ]]; then
  [[ -d $(dirname "$pack") && $pack != */ ]] || {
    echo "gpu_check: --pack '$pack': its folder does not exist (give a file in an existing folder)" >&2
    exit 2
  }
  pack=$(cd "$(dirname "$pack")" && pwd)/$(basename "$pack")
fi

# ---- no GPU: one line, exit 2 ----------------------------------------------------------------

if ! command -v nvidia-smi > /dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi is not installed): nothing to check" >&2
  exit 2
fi
if ! gpu_list=$(timeout "$t_smi" nvidia-smi -L 2> /dev/null) || ! grep -q '^GPU ' <<< "$gpu_list"
then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none, or gave no answer in $t_smi s):" \
    "nothing to check" >&2
  exit 2
fi

[[ ${#positional[@]} -eq 2 ]] || usage
build=$(cd "${positional[0]}" 2> /dev/null && pwd) || {
  echo "gpu_check: build folder '${positional[0]}' does not exist" >&2
  exit 2
}
results_root=${positional[1]}
# The programs each part needs.
needed_programs() {
  case "$1" in
    tests | memcheck | racecheck | amp-tests) echo test_kernels_cuda ;;
    gemm) echo bench_kernels ;;
    profile | gpt-profile) echo dp_bench test_kernels_cuda ;;
    *) echo dp_bench ;;
  esac
}
for item in "${items[@]}"; do
  for p in $(item_parts "$item"); do
    for t in $(needed_programs "$p"); do
      [[ -x $build/bin/$t ]] || {
        echo "gpu_check: $build/bin/$t is missing (part $p): build it (cmake --build ${positional[0]}) or use a bundle" >&2
        exit 2
      }
    done
  done
done
# test_bench's CUDA case runs this dp_bench (the path built into it is the build machine's), and
# the samples' CUDA cases these train_mnist and train_text.
export DP_BENCH_PROGRAM=$build/bin/dp_bench
export DP_TRAIN_MNIST_PROGRAM=$build/bin/train_mnist
export DP_TRAIN_TEXT_PROGRAM=$build/bin/train_text

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

missing_libs() {
  timeout "$t_ldd" ldd "$build/bin/$1" 2> /dev/null | awk '/not found/ {print $1}' | sort -u
}
if [[ -n $(missing_libs dp_bench) ]]; then  # last resort: look everywhere, for t_find seconds
  while read -r f; do add_lib_dir "$(dirname "$f")"; done < <(
    timeout "$t_find" find / -xdev \( -name 'libcudnn.so*' -o -name 'libnccl.so*' -o \
      -name 'libcublasLt.so*' -o -name 'libnvrtc.so*' \) 2> /dev/null | awk '!seen[$0]++')
  export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# The bundle's libstdc++/libgcc_s only where the machine's own are older than the build's
# (ldd then reports a GLIBCXX/CXXABI/GCC version as not found): a newer system libstdc++ must
# win, since LD_LIBRARY_PATH goes before the system folders.
if [[ -n $bundle_lib ]] && timeout "$t_ldd" ldd "$build/bin/dp_bench" 2>&1 |
  grep "\(GLIBCXX\|CXXABI\|GCC\)_.*not found" > /dev/null; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$bundle_lib/compat"
fi

# ---- results folder --------------------------------------------------------------------------

gpu_name=$(timeout "$t_smi" nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null |
  head -1)
n_gpus=$(grep -c '^GPU ' <<< "$gpu_list")
slug=$(tr '[:upper:]' '[:lower:]' <<< "${gpu_name:-gpu}" | tr -cs 'a-z0-9' '-' | sed 's/^-//;s/-$//')
# The build's identity: a bundle's source and build lines (its VERSION), else the build folder.
# Separate calls of one lease write into one folder; a folder that holds another build's results
# (a machine keeps /tmp from an earlier lease) is left as it is, and this run takes the next free
# name (DATEb_DEVICE, DATEc_DEVICE, ...), so that no pack mixes two builds' files.
if [[ -f $build/VERSION ]]; then
  build_id=$(sed -n '2,3p' "$build/VERSION")
else
  build_id="build folder $(cd "$build" && pwd)"
fi
day=$(date -u +%Y-%m-%d)
out=""
for suffix in "" b c d e f g h i j k l m n o p q r s t u v w x y z; do
  try=$results_root/$day${suffix}_$slug
  if [[ ! -d $try ]] || [[ -z $(ls -A "$try" 2> /dev/null) ]] ||
    [[ -f $try/build.txt && $(cat "$try/build.txt") == "$build_id" ]]; then
    out=$try
    break
  fi
  other=$(head -1 "$try/build.txt" 2> /dev/null || echo none)
  echo "gpu_check: $try holds another build's results (its build.txt: $other); left as it is" >&2
done
[[ -n $out ]] || {
  echo "gpu_check: every results folder of $day in $results_root holds another build's results" >&2
  exit 2
}
mkdir -p "$out" || {
  echo "gpu_check: cannot make $out" >&2
  exit 2
}
out=$(cd "$out" && pwd)
printf '%s\n' "$build_id" > "$out/build.txt"
summary=$out/summary.txt
touch "$summary"
run_from=$(wc -l < "$summary")  # this run's lines follow
stage_budget_s=${STAGE_BUDGET_S:-420}
lease_side_s=${LEASE_SIDE_S:-120}
lease_end=0
[[ -n $lease_s ]] && lease_end=$((t_start + lease_s))
budget_end=0    # the epoch second by which the running part's steps must end
budget_what=""  # which budget that is, for the CUT verdicts
n_fail=0 n_cut=0 part_fail=0 part_cut=0  # this shell's counts (a side-by-side job has its own)

dry_run=${GPU_CHECK_DRY_RUN:-0}
bench_device=cuda
[[ $dry_run == 1 ]] && bench_device=cpu

# One verdict line per step, on the terminal and appended to summary.txt (side-by-side jobs
# append whole lines, each one write).
verdict() {  # STATUS STEP DETAILS...: STATUS is ok, FAIL, SKIP or CUT
  local status=$1 step=$2
  shift 2
  printf '%-4s  %-34s %s\n' "$status" "$step" "$*" | tee -a "$summary"
  case $status in
    FAIL) n_fail=$((n_fail + 1)) part_fail=$((part_fail + 1)) ;;
    CUT) n_cut=$((n_cut + 1)) part_cut=$((part_cut + 1)) ;;
  esac
  return 0
}

# Runs a command with its output in LOG, within what is left of the budget; the exit status is
# the command's (124 or 137 when the budget cut it off, 125 when none was left to start it). It
# runs in the background, waited for, so that a TERM to this shell is handled at once (on_signal
# stops it through step_pid).
step_pid=""
logged() {  # LOG CMD...
  local log=$1 left=$((budget_end - $(now))) rc
  shift
  echo "\$ $*" > "$log"
  if ((left <= 0)); then
    echo "gpu_check: $budget_what was spent: not started" >> "$log"
    return 125
  fi
  timeout --kill-after=10 "$left" "$@" >> "$log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  rc=$?
  step_pid=""
  return $rc
}

# Whether an exit status of logged() means the budget stopped the step (a kill at another time,
# by the kernel say, is a failure).
budget_stopped() {  # STATUS
  (($1 == 125)) || { (($1 == 124 || $1 == 137)) && (($(now) >= budget_end)); }
}

# One step's verdict from its exit status: ok, CUT when the budget stopped it, else FAIL.
step_verdict() {  # STATUS LABEL OK_DETAILS FAIL_DETAILS
  local rc=$1 label=$2
  if ((rc == 0)); then
    verdict ok "$label" "$3"
  elif ((rc == 125)); then
    verdict CUT "$label" "not started: $budget_what was spent"
  elif budget_stopped "$rc"; then
    verdict CUT "$label" "cut off by $budget_what: $4"
  else
    verdict FAIL "$label" "exit $rc: $4"
  fi
}

# ---- the pack and signals --------------------------------------------------------------------

# Writes the results folder into --pack FILE, whole: a temporary file in FILE's folder, renamed
# over FILE once complete, so that a kill at any moment leaves the last pack or the new one, never
# a part of one. WHEN says after what. tar's status 1 (a file changed while it was read: the
# other side-by-side job writing its log) still gives a whole archive.
pack_tmp=""  # the temporary file being written (a signal's trap removes it)
pack_results() {  # WHEN
  [[ -n $pack ]] || return 0
  local rc
  if pack_tmp=$(mktemp "$(dirname "$pack")/.$(basename "$pack").XXXXXX"); then
    timeout "$t_pack" tar -C "$(dirname "$out")" -czf "$pack_tmp" "$(basename "$out")" 2> /dev/null
    rc=$?
    if ((rc <= 1)) && chmod 644 "$pack_tmp" && mv -f "$pack_tmp" "$pack"; then
      pack_tmp=""
      echo "   packed after $1: $pack ($(($(stat -c %s "$pack") / 1024)) KiB)"
      return 0
    fi
    rm -f "$pack_tmp"
    pack_tmp=""
  fi
  echo "gpu_check: could not write $pack (after $1)" >&2
  return 1
}

# The parts this run is to run, in order; parts_left: those its summary lines do not mark done
# (comma-separated, a --stage list); say_left: the line that names them.
planned=()
if [[ -n $lease_s && $stage == all ]]; then
  for job in "${lease_jobs[@]}"; do for p in $job; do planned+=("$p"); done; done
  planned+=("${lease_timed[@]}")
else
  for item in "${items[@]}"; do for p in $(item_parts "$item"); do planned+=("$p"); done; done
fi
parts_left() {
  local p lines list=()
  lines=$(tail -n +$((run_from + 1)) "$summary")
  for p in "${planned[@]}"; do grep -q "^== part $p: done" <<< "$lines" || list+=("$p"); done
  (IFS=, && echo "${list[*]}")
}
say_left() {
  local left
  left=$(parts_left)
  [[ -z $left ]] && return
  echo "gpu_check: not done: $left; run them again with --stage $left, or all with" \
    "--skip-done $summary" | tee -a "$summary"
}

# A TERM or INT (a call's time limit, ^C): the running step and the side-by-side jobs are
# stopped, the summary says so, and the results are packed once more. (A KILL leaves the pack of
# the last part finished.)
side_pids=()
on_signal() {  # NAME NUMBER
  trap '' TERM INT
  [[ -n $pack_tmp ]] && rm -f "$pack_tmp"
  [[ -n $step_pid ]] && kill -TERM "$step_pid" 2> /dev/null
  ((${#side_pids[@]})) && kill -TERM "${side_pids[@]}" 2> /dev/null
  wait
  echo "gpu_check: stopped by SIG$1 after $(($(now) - t_start)) s: the pack holds what finished" |
    tee -a "$summary"
  say_left
  pack_results "SIG$1"
  exit $((128 + $2))
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT

echo "gpu_check: $n_gpus GPU(s), $gpu_name; stage $stage${lease_s:+, lease $lease_s s}; results in $out"
{
  echo "gpu_check --stage $stage${lease_s:+ --lease $lease_s} of $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  [[ -f $build/VERSION ]] && sed -n '2,3p' "$build/VERSION"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "set up in $(($(now) - t_start)) s (the clock starts with the script)"
  [[ $dry_run == 1 ]] && echo "GPU_CHECK_DRY_RUN=1: CPU devices, shortened runs (the script's own test)"
} >> "$out/environment.txt"
# A pack's temporary files that a kill left behind (a KILL cannot clean up), then the first pack.
[[ -n $pack ]] && rm -f -- "$(dirname "$pack")/.$(basename "$pack")".??????
pack_results "the setup"

# dp_bench's --json as one summary line: per run, mode, replicas, step time, loss, loss scale
# and skipped steps, and where a run's capture failed and it went on uncaptured, why
# (graphs_fallback: empty, or absent from older builds, when graphs ran or were off by the flag).
bench_line() {  # JSON
  timeout "$t_py" python3 - "$1" 2> /dev/null << 'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
def fell_back(r):
    why = (r.get("graphs_fallback") or "")[:160]
    return f" (graphs fell back: {why})" if why else ""
def ratio(r):  # t_N / t_1 with its 95% interval, where the run has one (--repeat)
    q = r.get("ratio_to_one")
    if not isinstance(q, dict) or q.get("value") is None:
        return ""
    ci = q.get("ci95") or []
    return f", t{r['gpus']}/t1 {q['value']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if len(ci) == 2 else "")
runs = [f"{r['mode']} x{r['gpus']} {r['step_ms_median']:.3f} ms/step, loss {r['final_loss']:.4f}, "
        f"scale {r.get('loss_scale', 1):g}, skipped {r.get('skipped_steps', 0)}, peak "
        f"{max(r.get('peak_mem_bytes') or [0]) / 2**20:.1f} MiB{ratio(r)}{fell_back(r)}"
        for r in j["runs"]]
note = " (logical GPUs share hardware: overhead, not scaling)" if j.get("oversubscribed") else ""
verdict = f"; verdict: {j['verdict']}" if j.get("verdict") else ""
print(", ".join(runs) + note + verdict)
EOF
}

# Whether the runs a check reads finished (LABEL JSON...): else a CUT verdict naming them.
finished() {
  local label=$1 f missing=()
  shift
  for f in "$@"; do [[ -s $f ]] || missing+=("$(basename "${f%.json}")"); done
  ((${#missing[@]} == 0)) && return 0
  verdict CUT "$label" "not compared: ${missing[*]} did not finish"
  return 1
}

# A verdict from a Python check read from standard input: LABEL N ARGS..., the first N of ARGS
# being the dp_bench JSON files it reads (CUT, not run, where one did not finish). The check
# gets ARGS and prints one line, "ok DETAILS" or "FAIL DETAILS" (a Python error fails too).
python_verdict() {
  local label=$1 n=$2 line
  shift 2
  finished "$label" "${@:1:n}" || return 0
  line=$(timeout "$t_py" python3 - "$@" 2>&1) || [[ $line == "ok "* ]] ||
    line="FAIL ${line:-the check gave no answer within $t_py s}"
  if [[ $line == "ok "* ]]; then
    verdict ok "$label" "${line#ok }"
  else
    verdict FAIL "$label" "${line#FAIL }"
  fi
}

# Two dp_bench runs that must train alike (CUT where one did not finish): LABEL GRAPHED_JSON
# OTHER_JSON. Every run (mode, N) of the second must be in the first, have replayed steps
# there (or say why its capture fell back: then it ran uncaptured, and the line says so), and
# the same losses.
same_losses_verdict() {
  python_verdict "$1" 2 "$2" "$3" << 'EOF'
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
    why = (g.get("graphs_fallback") or "")[:160]
    if why:
        said.append(f"{name} uncaptured (graphs fell back: {why})")
    else:
        said.append(f"{name} {g.get('graphed_steps', 0)} of {len(g['losses'])} replayed")
        if g.get("graphed_steps", 0) == 0:
            bad.append(f"{name} never replayed")
    if g["losses"] != r["losses"]:
        bad.append(f"{name} losses differ")
print(("FAIL " if bad or not said else "ok ") + ", ".join(said + bad))
EOF
}

# What a graphed step replays (LABEL JSON): per run, the median step over the graph nodes it
# replays (dp_bench's graph_nodes_per_step: each a launch), the time per node against the
# ~2 us a kernel takes inside a graph: what is launch floor and what is work. A measurement:
# it fails only on a run that never replayed without saying why (a run whose capture fell back
# has no floor to measure: the line says why).
floor_verdict() {
  python_verdict "$1" 1 "$2" << 'EOF'
import json, statistics, sys
said, bad = [], []
for r in json.load(open(sys.argv[1]))["runs"]:
    name = f"{r['mode']} N={r['gpus']}"
    nodes = r.get("graph_nodes_per_step", 0)
    if r.get("graphs_fallback"):
        said.append(f"{name} uncaptured (graphs fell back: {r['graphs_fallback'][:160]})")
        continue
    if not nodes:
        bad.append(f"{name} replayed no graph")
        continue
    ms = r.get("step_ms_median") or statistics.median(r["step_ms"])
    said.append(f"{name} {ms:.3f} ms over {nodes:.0f} nodes: {1000 * ms / nodes:.1f} us each")
print(("FAIL " if bad or not said else "ok ") + ", ".join(said + bad))
EOF
}

# One dp_bench run with its 1-device baseline (LABEL JSON TOL): per mode, the N-device loss curve
# must follow the 1-device one, step by step, within TOL (the rounding of the dtype; the largest
# gap is said either way).
follows_verdict() {
  python_verdict "$1" 1 "$2" "$3" << 'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
tol = float(sys.argv[2])
said, bad = [], []
for mode in sorted({r["mode"] for r in runs}):
    one = [r for r in runs if r["mode"] == mode and r["gpus"] == 1]
    for r in (r for r in runs if r["mode"] == mode and r["gpus"] > 1):
        name = f"{mode} N={r['gpus']}"
        if not one or len(one[0]["losses"]) != len(r["losses"]) or not r["losses"]:
            bad.append(f"{name}: no 1-device curve of its length")
            continue
        gap = max(abs(a - b) for a, b in zip(r["losses"], one[0]["losses"]))
        said.append(f"{name} largest gap {gap:.2e}")
        if not gap <= tol:
            bad.append(f"{name} over {tol:g}")
print(("FAIL " if bad or not said else "ok ") + ", ".join(said + bad))
EOF
}

# A dry run's dp_bench arguments: the same run, shortened (6 steps after 2, 2 repeats, GPT-2 124M
# as the tiny preset at 64 tokens), with --cuda-graphs on where none is given (auto is on for a
# GPU's capturable steps, off on CPU devices, which replay through the same interface when on).
# Sets bench_args.
dry_rewrite() {  # ARGS...
  local a prev="" steps=0 warmup=0 graphs=0
  bench_args=()
  for a in "$@"; do
    case $prev in
      --steps) a=6 steps=1 ;;
      --warmup) a=2 warmup=1 ;;
      --repeat) a=2 ;;
      --gpt-config) a=tiny ;;
      --seq) a=64 ;;
      --cuda-graphs) graphs=1 ;;
    esac
    bench_args+=("$a")
    prev=$a
  done
  ((steps)) || bench_args+=(--steps 6)
  ((warmup)) || bench_args+=(--warmup 2)
  ((graphs)) || bench_args+=(--cuda-graphs on)
}

# One dp_bench run as a step: NAME LABEL ARGS...
bench_step() {
  local name=$1 label=$2 rc line
  shift 2
  bench_args=("$@")
  [[ $dry_run == 1 ]] && dry_rewrite "$@"
  logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
    --json "$out/$name.json" "${bench_args[@]}"
  rc=$?
  ((rc == 0)) && line=$(bench_line "$out/$name.json")
  step_verdict "$rc" "$label" "${line:-see $name.txt}" "see $name.txt"
}



# Doctest binaries with their test-case filters, into one log: LOG LABEL BIN:FILTER...
doctest_step() {
  local log=$1 label=$2 worst=0 counts="" spec bin filter rc
  shift 2
  : > "$out/$log"
  for spec in "$@"; do
    bin=${spec%%:*} filter=${spec#*:}
    if [[ ! -x $build/bin/$bin ]]; then
      counts+="$bin: missing; "
      worst=1
      continue
    fi
    logged "$out/$log.part" "$build/bin/$bin" -tc="$filter"
    rc=$?
    cat "$out/$log.part" >> "$out/$log"
    rm -f "$out/$log.part"
    counts+="$bin: $(grep 'test cases:' "$out/$log" | tail -1 | tr -s ' ' | cut -c1-80); "
    if ((rc != 0)) && ! budget_stopped "$rc"; then
      worst=1
    elif ((rc != 0 && worst == 0)); then
      worst=$rc
    fi
  done
  case $worst in
    0) verdict ok "$label" "$counts" ;;
    1) verdict FAIL "$label" "$counts see $log" ;;
    *) step_verdict "$worst" "$label" "" "$counts see $log" ;;
  esac
}

# variants.py's report (VARIANTS_JSON) as one line: per variant ours/torch with its interval and
# repeats (tokens/s for GPT), the variants skipped, and what its budget did not reach.
torch_line() {
  timeout "$t_py" python3 - "$1" 2> /dev/null << 'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
said = []
for v, r in (j.get("variants") or {}).items():
    ci = r.get("ci95") or []
    said.append(f"{v} ours/torch {r['ratio']:.2f}" +
                (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if len(ci) == 2 else "") +
                f" {r.get('verdict', '')} over {len(r.get('repeats') or [])} repeats" +
                (f" ({r['tokens_per_s_ours']:.0f} against {r['tokens_per_s_torch']:.0f} tok/s)"
                 if "tokens_per_s_torch" in r else ""))
for v, why in (j.get("skipped") or {}).items():
    said.append(f"{v} skipped ({why[:80]})")
if j.get("not_reached"):
    said.append("not reached: " + "; ".join(j["not_reached"]))
print("; ".join(said) or "no variant ran")
EOF
}

# Runs the PyTorch side by side (benchmarks/torch_ref/side_by_side.sh): NAME LABEL N FLAGS... At
# N = 1 variants.py gets what is left of the budget less t_torch_margin (side_by_side.sh's own
# imports of torch and numpy, the last report) as --budget-s; it prints each measurement as it
# is taken and exits 3 where that budget ran out first, with what it measured: CUT.
torch_step() {
  local name=$1 label=$2 n=$3 torch_ref=$here/torch_ref rc line budget=() left
  shift 3
  [[ -d $torch_ref ]] || torch_ref=$here/../benchmarks/torch_ref
  if ((n == 1)); then
    left=$((budget_end - $(now) - t_torch_margin))
    if ((left < 10)); then
      verdict CUT "$label" "not started: under $((t_torch_margin + 10)) s of $budget_what left"
      return
    fi
    budget=(--budget-s "$left")
  fi
  OUT_DIR=$out/$name logged "$out/$name.txt" bash "$torch_ref/side_by_side.sh" "$build" "$n" \
    --device "$bench_device" "$@" "${budget[@]}"
  rc=$?
  ((rc == 0 || rc == 3)) && [[ -s $out/$name/variants.json ]] &&
    line=$(torch_line "$out/$name/variants.json")
  if ((rc == 3)); then
    verdict CUT "$label" "N=$n: its $left s ran out: ${line:-see $name.txt}"
  else
    step_verdict "$rc" "$label" "N=$n: ${line:-see $name.txt}" "see $name.txt"
  fi
}

# Whether python3 here imports torch with CUDA (the torch parts skip without it). Asked once (an
# import of torch takes seconds; at most t_torch), and not once the budget is spent (the steps
# are CUT then).
torch_found=""
torch_usable() {
  (($(now) < budget_end)) || return 0
  if [[ -z $torch_found ]]; then
    timeout "$t_torch" python3 -c \
      'import torch, numpy, sys; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1
    case $? in
      0) torch_found=yes ;;
      124 | 137) torch_found="torch did not import within $t_torch s" ;;
      *) torch_found="torch (with CUDA) or numpy does not import in python3" ;;
    esac
  fi
  if [[ $torch_found != yes ]]; then
    verdict SKIP "PyTorch side by side" "$torch_found"
    return 1
  fi
}

# ---- parts -----------------------------------------------------------------------------------

part_tests() {
  local driver
  if logged "$out/nvidia-smi.txt" timeout "$t_smi" nvidia-smi; then
    driver=$(timeout "$t_smi" nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
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
    "test_nn:nn.cuda*" "test_dp:dp.cuda*" "test_dist:*cuda*" "test_bench:bench.cuda*" \
    "test_samples:samples.train_mnist.cuda*" "test_train_text:samples.train_text.cuda*"
}

# A tool the machine may not support (compute-sanitizer, ncu: a VM may refuse the GPU's debug
# interface or its counters), probed once, before its first part: TOOL --version, then a trivial
# run under it (one small kernel test case), each within t_probe seconds; the output goes to
# probe_TOOL.txt. Sets tool_why[TOOL] to "usable" or why not (the tool's own words where it said
# any), tool_bin[TOOL] to its path. Returns 0 where usable; else a SKIP verdict (or CUT where the
# budget stopped the probe) and 1.
declare -A tool_why=() tool_bin=()
tool_usable() {  # TOOL LABEL ARGS...: ARGS, the trivial run's after the tool
  local tool=$1 label=$2 bin log rc ran why=""
  shift 2
  if [[ -z ${tool_why[$tool]:-} ]]; then
    bin=$(command -v "$tool" || ls "/usr/local/cuda/bin/$tool" 2> /dev/null | head -1)
    log=$out/probe_$tool.txt
    if [[ -z $bin ]]; then
      why="not installed (it comes with the CUDA toolkit)"
    else
      logged "$log" timeout "$t_probe" "$bin" --version
      rc=$?
      if ((rc == 0)); then
        logged "$log.run" timeout "$t_probe" "$bin" "$@"
        rc=$?
        cat "$log.run" >> "$log"
        rm -f "$log.run"
      fi
      if ((rc != 0)) && budget_stopped "$rc"; then
        step_verdict "$rc" "$label" "" "probing $tool: see probe_$tool.txt"
        return 1
      fi
      # A sanitizer that ran (0, or 99: --error-exitcode, it found an error, which memcheck
      # then reports) works here, whatever it said; ncu may refuse the counters and exit 0.
      ran=0
      ((rc == 0)) || [[ $tool == compute-sanitizer && $rc == 99 ]] && ran=1
      if ((ran == 0)) || [[ $tool == ncu ]]; then
        why=$(grep -m1 -e ERR_NVGPUCTRPERM -e '==ERROR==' -e '========= Error:' "$log" ||
          grep -m1 -i 'not supported' "$log")
      fi
      if [[ -n $why ]]; then
        why="refused here: $(cut -c1-160 <<< "$why")"
      elif ((rc == 124 || rc == 137)); then
        why="gave no answer within $t_probe s"
      elif ((ran == 0)); then
        why="a trivial run failed (exit $rc)"
      elif [[ $tool == ncu ]] && ! grep -q '==PROF== Profiling' "$log"; then
        why="profiled no kernel in a trivial run"
      fi
      [[ -n $why ]] && why+=": see probe_$tool.txt"
    fi
    tool_why[$tool]=${why:-usable}
    tool_bin[$tool]=$bin
  fi
  [[ ${tool_why[$tool]} == usable ]] && return 0
  verdict SKIP "$label" "${tool_why[$tool]}"
  return 1
}

# compute-sanitizer: API errors are not reported (the tests provoke some on purpose: an
# allocation larger than the GPU must fail with a clear error); memory and race errors are.
sanitizer_usable() {
  tool_usable compute-sanitizer compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 99 "$build/bin/test_kernels_cuda" -tc='kernels.cuda.elementwise*'
}

part_memcheck() {
  sanitizer_usable || return 0
  logged "$out/memcheck.txt" "${tool_bin[compute-sanitizer]}" --tool memcheck \
    --report-api-errors no --error-exitcode 99 "$build/bin/test_kernels_cuda" -tc='kernels.cuda*'
  local rc=$? said
  said=$(grep -o 'ERROR SUMMARY.*' "$out/memcheck.txt" | tail -1)
  step_verdict "$rc" "memcheck (kernel tests)" "$said" "${said:+$said: }see memcheck.txt"
}

part_racecheck() {
  sanitizer_usable || return 0
  # The kernels with shared-memory reductions and chunked sums.
  local race='kernels.cuda.mse_loss*,kernels.cuda.batch_norm*,kernels.cuda.layer_norm*,kernels.cuda.bias*,kernels.cuda.softmax_cross_entropy: matches*'
  logged "$out/racecheck.txt" "${tool_bin[compute-sanitizer]}" --tool racecheck \
    --report-api-errors no --error-exitcode 99 "$build/bin/test_kernels_cuda" -tc="$race"
  local rc=$?
  step_verdict "$rc" "racecheck (reductions)" \
    "$(grep -o 'RACECHECK SUMMARY.*\|ERROR SUMMARY.*' "$out/racecheck.txt" | tail -1)" \
    "see racecheck.txt"
}

part_amp_tests() {
  # The 16-bit kernel cases (bf16 and f16 GEMM, convolution, axpy, all_finite) and nn.cuda.amp
  # (bf16 and fp16 steps against the CPU).
  doctest_step amp_tests.txt "CUDA AMP tests (doctest)" \
    "test_kernels_cuda:*f16*,*16-bit*" "test_nn:nn.cuda.amp*"
}

part_amp_runs() {
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
    # DP and DDP on 4 logical GPUs against 1 device, in 16 bits: the loss curves must follow
    # within the dtype's rounding.
    for dtype in bf16 fp16; do
      bench_step "amp_${model}_${dtype}_gpus4" "amp $model $dtype --gpus 1, 4" --mode both \
        --gpus 4 --model "$model" --dtype "$dtype"
      follows_verdict "amp $model $dtype: 4 GPUs follow 1" "$out/amp_${model}_${dtype}_gpus4.json" 5e-2
    done
    # bf16 gradients on the wire (--comm-dtype bf16): step time and bytes against the run above.
    bench_step "amp_${model}_bf16_gpus4_commbf16" "amp $model bf16 --gpus 4 comm bf16" \
      --mode both --gpus 4 --baseline 0 --model "$model" --dtype bf16 --comm-dtype bf16
  done
}

part_gemm() {
  local rc line args=(--device "$bench_device")
  [[ $dry_run == 1 ]] && args+=(--sizes 128 --min-time 0.01 --stream-elems 65536)
  logged "$out/bench_kernels.txt" "$build/bin/bench_kernels" "${args[@]}" \
    --json "$out/bench_kernels.json"
  rc=$?
  if ((rc == 0)); then
    line=$(
      timeout "$t_py" python3 - "$out/bench_kernels.json" 2> /dev/null << 'EOF'
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
fused = {r["kind"]: r for r in rows
         if r.get("dtype") == "bf16" and "ratio" in r and r.get("kind", "").startswith(("add_", "layer_"))}
if fused:
    out.append("bf16 residual+LN fused/separate " + " ".join(
        f"{'fwd' if k.startswith('add_') else 'bwd'} {r['ratio']:.2f}" for k, r in sorted(fused.items())))
print(", ".join(out))
EOF
    )
  fi
  step_verdict "$rc" "bench_kernels (GEMM)" "${line:-see bench_kernels.txt}" "see bench_kernels.txt"
}

# One run of each model at one GPU with --cuda-graphs auto, one repeat (what the graphs part
# repeats, first seen): its step time, and whether it ran graphed (the steps replayed and the
# nodes each launches), fell back uncaptured because its capture failed (dp_bench's
# graphs_fallback: why), or ran uncaptured (auto found the step not capturable). A dry run
# replays on CPU devices (--cuda-graphs on: auto is off there).
probe_line() {  # JSON
  timeout "$t_py" python3 - "$1" 2> /dev/null << 'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
why = (r.get("graphs_fallback") or "")[:160]
if why:
    how = f"uncaptured (graphs fell back: {why})"
elif r.get("graphed_steps", 0):
    how = (f"graphed: {r['graphed_steps']} of {len(r.get('losses') or [])} steps replayed, "
           f"{r.get('graph_nodes_per_step', 0):.0f} nodes each")
else:
    how = "uncaptured (not capturable)"
print(f"{r['step_ms_median']:.3f} ms/step, loss {r['final_loss']:.4f}, {how}")
EOF
}
part_probe() {
  local model name rc line graphs=auto
  [[ $dry_run == 1 ]] && graphs=on
  for model in mlp cnn gpt; do
    name=probe_$model
    bench_args=(--mode dp --gpus 1 --baseline 0 --model "$model" --cuda-graphs "$graphs"
      --repeat 1 --project-from off)
    [[ $model == gpt ]] && bench_args+=(--gpt-config tiny)
    [[ $dry_run == 1 ]] && dry_rewrite "${bench_args[@]}"
    logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
      --json "$out/$name.json" "${bench_args[@]}"
    rc=$?
    line=""
    ((rc == 0)) && line=$(probe_line "$out/$name.json")
    step_verdict "$rc" "probe ${model/gpt/gpt-tiny} graphs $graphs" "${line:-see $name.txt}" \
      "see $name.txt"
  done
}

part_graphs() {
  local model g
  # DP and DDP, 1 and 4 logical GPUs, MLP and CNN, graphed where the step is capturable (auto),
  # 3 interleaved repeats: DP 4/1 (goal <= 1.10) and DDP against DP at 1 (goal <= 1.05) with
  # their 95% intervals.
  for model in mlp cnn; do
    for g in 1 4; do
      bench_step "dp_bench_${model}_gpus$g" "dp_bench $model --gpus $g" --mode both \
        --gpus "$g" --model "$model" --repeat 3
    done
    follows_verdict "$model: 4 GPUs follow 1 (fp32)" "$out/dp_bench_${model}_gpus4.json" 1e-3
    floor_verdict "$model: graphed step per node" "$out/dp_bench_${model}_gpus1.json"
  done
  # DP's graphed sums beside backward (--dp-graph-pulls beside: each pull on device 0's second
  # stream waits for events the replicas' captured backward records), never run on a GPU before:
  # the graphed runs' losses bit for bit, and its DP 4/1 against theirs.
  for model in mlp cnn; do
    bench_step "dp_bench_${model}_gpus4_graph_pulls_beside" \
      "dp_bench $model --gpus 4 --dp-graph-pulls beside" --mode both --gpus 4 --model "$model" \
      --repeat 3 --dp-graph-pulls beside
    same_losses_verdict "pulls beside = after, $model --gpus 4 graphed" \
      "$out/dp_bench_${model}_gpus4.json" "$out/dp_bench_${model}_gpus4_graph_pulls_beside.json"
  done
  # The same DP and DDP steps uncaptured (--cuda-graphs off), against the graphed runs above;
  # their losses must be the graphed runs' bit for bit.
  for model in mlp cnn; do
    for g in 1 4; do
      bench_step "dp_bench_${model}_gpus${g}_nographs" "dp_bench $model --gpus $g graphs off" \
        --mode both --baseline 0 --gpus "$g" --model "$model" --cuda-graphs off
      same_losses_verdict "graphs = uncaptured, $model --gpus $g" \
        "$out/dp_bench_${model}_gpus$g.json" "$out/dp_bench_${model}_gpus${g}_nographs.json"
    done
  done
}

part_gpt() {
  # GPT-2 124M in bf16 (bf16 activations: attention on cuDNN's fused SDPA): tokens/s and MFU on
  # one GPU, and DP on 4 logical GPUs against it (issues 26 and 49: 4/1 <= 1.05), interleaved,
  # at batch 8, then 32 and 64, where the replicas' copies and the reduce (fixed bytes a step)
  # weigh less against forward and backward (1.23 at 8, 1.07 at 32 on 2026-12-04).
  bench_step dp_bench_gpt124m_bf16 "dp_bench gpt-124m bf16 --gpus 1, 4" --mode dp --gpus 4 \
    --model gpt --gpt-config 124m --seq 1024 --batch 8 --dtype bf16 --activations bf16 \
    --steps 10 --warmup 3 --repeat 3 --project-from off
  [[ $dry_run == 1 ]] && return 0
  local b rc name label line
  for b in 32 64; do  # a batch that does not fit (a smaller GPU) is skipped, saying so
    name=dp_bench_gpt124m_bf16_b$b label="dp_bench gpt-124m bf16 batch $b --gpus 1, 4" line=""
    logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
      --json "$out/$name.json" --mode dp --gpus 4 --model gpt --gpt-config 124m --seq 1024 \
      --batch "$b" --dtype bf16 --activations bf16 --steps 6 --warmup 3 --repeat 3 \
      --project-from off
    rc=$?
    if ((rc != 0)) && grep -q "$oom_said" "$out/$name.txt"; then
      verdict SKIP "$label" "does not fit: $(grep -m1 "$oom_said" "$out/$name.txt" | cut -c1-120)"
      return 0
    fi
    ((rc == 0)) && line=$(bench_line "$out/$name.json")
    step_verdict "$rc" "$label" "${line:-see $name.txt}" "see $name.txt"
  done
  # Batch 32 uncaptured (--cuda-graphs off): DP's graphed step sums the replicas' buckets after
  # every backward ended (1.59 ms of the 4/1's 4.0 on 2026-12-04, "0 pulled while backward ran
  # on"), where an uncaptured one pulls each bucket as backward makes it; GPT-2's kernels are
  # long enough that the graphs' launch savings may weigh less than that overlap.
  name=dp_bench_gpt124m_bf16_b32_graphs_off line=""
  label="dp_bench gpt-124m bf16 batch 32 --gpus 1, 4 --cuda-graphs off"
  logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
    --json "$out/$name.json" --mode dp --gpus 4 --model gpt --gpt-config 124m --seq 1024 \
    --batch 32 --dtype bf16 --activations bf16 --cuda-graphs off --steps 6 --warmup 3 --repeat 3 \
    --project-from off
  rc=$?
  ((rc == 0)) && line=$(bench_line "$out/$name.json")
  step_verdict "$rc" "$label" "${line:-see $name.txt}" "see $name.txt"
  # The same graphed, the sums beside backward (--dp-graph-pulls beside): the overlap of the
  # uncaptured step with the graphs' launches.
  name=dp_bench_gpt124m_bf16_b32_graph_pulls_beside line=""
  label="dp_bench gpt-124m bf16 batch 32 --gpus 1, 4 --dp-graph-pulls beside"
  logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
    --json "$out/$name.json" --mode dp --gpus 4 --model gpt --gpt-config 124m --seq 1024 \
    --batch 32 --dtype bf16 --activations bf16 --dp-graph-pulls beside --steps 6 --warmup 3 \
    --repeat 3 --project-from off
  rc=$?
  ((rc == 0)) && line=$(bench_line "$out/$name.json")
  step_verdict "$rc" "$label" "${line:-see $name.txt}" "see $name.txt"
  # The chunked classifier (GptConfig::loss_chunk: 8192 tokens, so batch 32 runs 4 chunks): one
  # GPU at batch 32 with the whole (B, T, V) logits (--loss-chunk 0), against the run above,
  # for the step time and the peak.
  name=dp_bench_gpt124m_bf16_b32_whole_logits line=""
  label="dp_bench gpt-124m bf16 batch 32 --gpus 1 --loss-chunk 0"
  logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
    --json "$out/$name.json" --mode dp --gpus 1 --baseline 0 --model gpt --gpt-config 124m \
    --seq 1024 --batch 32 --dtype bf16 --activations bf16 --loss-chunk 0 --steps 6 --warmup 3 \
    --repeat 3 --project-from off
  rc=$?
  ((rc == 0)) && line=$(bench_line "$out/$name.json")
  step_verdict "$rc" "$label" "${line:-see $name.txt}" "see $name.txt"
}

# Whether ncu can profile here (tool_usable's probe: one kernel test case profiled): LABEL.
ncu_usable() {
  tool_usable ncu "$1" --launch-count 1 --section LaunchStats "$build/bin/test_kernels_cuda" \
    -tc='kernels.cuda.elementwise*'
}

# GPT-2 124M's step kernel by kernel (issue 49): ncu's duration of every kernel of one uncaptured
# step (bf16, bf16 activations, batch 8; no projection runs), packed, and ncu_summary.py's sums
# by kind, NVTX range and kernel (ncu_gpt124m_b8_summary.txt). SKIP where ncu is refused.
part_gpt_profile() {
  local rc csv=$out/ncu_gpt124m_b8.csv label="ncu gpt-124m step" py=$here/ncu_summary.py
  [[ -f $py ]] || py=$here/../benchmarks/ncu_summary.py
  ncu_usable "ncu (gpt profile)" || return 0
  logged "$csv" "${tool_bin[ncu]}" --clock-control none --nvtx --metrics gpu__time_duration.sum \
    --csv "$build/bin/dp_bench" --device "$bench_device" --mode dp --gpus 1 --baseline 0 \
    --model gpt --gpt-config 124m --seq 1024 --batch 8 --dtype bf16 --activations bf16 \
    --steps 1 --warmup 1 --cuda-graphs off --project-from off
  rc=$?
  if ((rc != 0)); then
    step_verdict "$rc" "$label" "" "see ncu_gpt124m_b8.csv.gz"
  elif timeout "$t_py" python3 "$py" "$csv" > "${csv%.csv}_summary.txt" 2>&1; then
    verdict ok "$label" "$(head -1 "${csv%.csv}_summary.txt"): see ncu_gpt124m_b8_summary.txt"
  else
    verdict FAIL "$label" "ncu_summary.py: $(tail -1 "${csv%.csv}_summary.txt" | cut -c1-160)"
  fi
  gzip -f "$csv"
}

# The largest batch of GPT-2 124M (bf16, sequences of 1024) that fits one GPU, doubling from 16
# (issue 26), with tokens/s, MFU and peak memory at each size that fits. A size that runs out of
# memory ends the search (the caching allocator's words, CUDA's, or cuBLAS's: a workspace it
# cannot allocate is CUBLAS_STATUS_ALLOC_FAILED, "cublas status 3" in our errors); any other
# failure fails the step.
oom_said='out of memory\|ALLOC_FAILED\|cudaErrorMemoryAllocation\|cublas[a-z]* status 3\b'
part_gpt_batch() {
  local b rc name fits=0 sizes=(16 32 64 128 256) said="" why="" label="gpt-124m largest batch"
  [[ $dry_run == 1 ]] && sizes=(16 32)
  for b in "${sizes[@]}"; do
    name=dp_bench_gpt124m_bf16_batch$b
    bench_args=(--mode dp --gpus 1 --baseline 0 --model gpt --gpt-config 124m --seq 1024
      --batch "$b" --dtype bf16 --activations bf16 --steps 3 --warmup 2 --project-from off)
    [[ $dry_run == 1 ]] && dry_rewrite "${bench_args[@]}"
    logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
      --json "$out/$name.json" "${bench_args[@]}"
    rc=$?
    if ((rc == 0)); then
      fits=$b
      said+="$(
        timeout "$t_py" python3 - "$out/$name.json" "$b" 2> /dev/null << 'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print(f"batch {sys.argv[2]} {r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%, "
      f"peak {max(r.get('peak_mem_bytes') or [0]) / 2**30:.1f} GiB", end="")
EOF
      ); "
    elif ! budget_stopped "$rc" &&
      grep -qi "$oom_said" "$out/$name.txt"; then
      why="batch $b does not fit: $(grep -i -m1 "$oom_said" "$out/$name.txt" | cut -c1-160)"
      break
    else
      step_verdict "$rc" "$label" "" "batch $b: see $name.txt"
      return
    fi
  done
  verdict ok "$label" "$fits (of ${sizes[*]})${why:+; $why}: $said"
  # The smallest batch again with every block checkpointed (--recompute): the peak it saves
  # against the tokens/s the blocks' second forward costs.
  name=dp_bench_gpt124m_bf16_batch${sizes[0]}_recompute
  bench_args=(--mode dp --gpus 1 --baseline 0 --model gpt --gpt-config 124m --seq 1024
    --batch "${sizes[0]}" --dtype bf16 --activations bf16 --steps 3 --warmup 2 --project-from off
    --recompute)
  [[ $dry_run == 1 ]] && dry_rewrite "${bench_args[@]}"
  logged "$out/$name.txt" "$build/bin/dp_bench" --device "$bench_device" \
    --json "$out/$name.json" "${bench_args[@]}"
  rc=$?
  label="gpt-124m batch ${sizes[0]} --recompute"
  if ((rc != 0)); then
    step_verdict "$rc" "$label" "" "see $name.txt"
    return
  fi
  verdict ok "$label" "$(
    timeout "$t_py" python3 - "$out/$name.json" 2> /dev/null << 'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print(f"{r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f}%, HFU {100 * r['hfu']:.1f}%, "
      f"peak {max(r.get('peak_mem_bytes') or [0]) / 2**30:.1f} GiB", end="")
EOF
  )"
}

part_bench_more() {
  local g graphs
  # A first bucket of 0.25 MiB against the default 1 MiB, where buckets overlap backward (DP
  # uncaptured; the MLP's 1.03 MiB of gradients make 2 buckets instead of 1): against the
  # graphs part's nographs run.
  bench_step dp_bench_mlp_gpus4_nographs_bucket025 "dp_bench mlp --gpus 4 graphs off, first bucket 0.25 MiB" \
    --mode dp --baseline 0 --gpus 4 --model mlp --cuda-graphs off --first-bucket-mb 0.25
  # Pulls staged through device 0's memory (--dp-peer-reads off: the path of GPUs without peer
  # access, D2D copies here), graphed and on the comm stream uncaptured: the losses of the graphs
  # part's in-place run, bit for bit.
  for graphs in auto off; do
    bench_step "dp_bench_mlp_gpus4_staged_graphs_$graphs" \
      "dp_bench mlp --gpus 4 --dp-peer-reads off, graphs $graphs" --mode dp --baseline 0 \
      --gpus 4 --model mlp --dp-peer-reads off --cuda-graphs "$graphs"
    same_losses_verdict "staged pulls = in place, mlp --gpus 4, graphs $graphs" \
      "$out/dp_bench_mlp_gpus4.json" "$out/dp_bench_mlp_gpus4_staged_graphs_$graphs.json"
  done
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
  # The tiny GPT through DP and DDP on 4 logical GPUs.
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
  # Activation checkpointing, graphed: every block runs its forward again in backward (the
  # attention and the GEMM epilogues again, dropout at the same offsets read on the GPU), for
  # the plain graphed run's losses bit for bit.
  bench_step dp_bench_gpt_tiny_dropout_recompute \
    "dp_bench gpt-tiny --dropout 0.1 --gpus 2 --recompute graphs on" --mode both --gpus 2 \
    --baseline 0 --model gpt --gpt-config tiny --dropout 0.1 --cuda-graphs on --recompute
  same_losses_verdict "--recompute = plain, gpt-tiny --dropout 0.1 --gpus 2 graphed" \
    "$out/dp_bench_gpt_tiny_dropout_recompute.json" "$out/dp_bench_gpt_tiny_dropout_graphs_on.json"
}

# The side by side at N = 1 (variants.py): ours against torch eager, CUDA graph and
# torch.compile, 5 interleaved repeats with 95% intervals, for the MLP and the CNN in DTYPE.
torch_models() {  # DTYPE (fp32, or bf16: our policy against torch.autocast)
  local model tag
  torch_usable || return 0
  for model in mlp cnn; do
    tag=${model}${1/fp32/}
    torch_step "torch_side_by_side_$tag" "PyTorch side by side $model $1" 1 --model "$model" \
      --dtype "$1"
  done
}
part_torch_fp32() { torch_models fp32; }
part_torch_bf16() { torch_models bf16; }

part_torch_gpt() {
  # GPT-2 124M on one GPU: ours against torch eager, CUDA graph and torch.compile.
  torch_usable || return 0
  torch_step torch_side_by_side_gpt124m "PyTorch side by side gpt-124m bf16" 1 --model gpt \
    --gpt-config 124m --seq 1024 --batch 8 --dtype bf16 --steps 30 --warmup 5 --repeat 3
}

# The same at batch 32 against torch.compile alone (its compilation once, then 3 interleaved
# repeats of 10 steps): issue 49's two goals at one batch, 1.1x compile's tokens/s and 45% MFU
# (ours: 48.2% at 32 on 2026-12-04, 42.4% at 8).
part_torch_gpt_b32() {
  torch_usable || return 0
  torch_step torch_side_by_side_gpt124m_b32 "PyTorch side by side gpt-124m bf16 batch 32" 1 \
    --model gpt --gpt-config 124m --seq 1024 --batch 32 --dtype bf16 --variants compile \
    --steps 10 --warmup 3 --repeat 3
}

# Nsight Compute on the kernels inside one NVTX range of a short DP run of the CNN on 2 logical
# GPUs: dp/backward (the workers' ranges are named by phase; --launch-count keeps the first
# kernels, one replica's backward) and dp/reduce. --clock-control none keeps the GPU's own
# clocks, as in the timed runs. ncu's filter reads "/" as nesting, so the one inside our range
# names is escaped: "dp\/backward/" is the push/pop range named dp/backward. First a probe: ncu
# --version and one kernel of a small test case profiled (SKIP where refused: a VM without
# access to the GPU's counters says ERR_NVGPUCTRPERM or "not supported").
part_profile() {
  local rc what
  ncu_usable "ncu (profile)" || return 0
  for what in backward reduce; do
    logged "$out/ncu_$what.txt" "${tool_bin[ncu]}" --clock-control none --nvtx \
      --nvtx-include "dp\\/$what/" --launch-count 12 --section SpeedOfLight --section LaunchStats \
      --csv --page details "$build/bin/dp_bench" --device "$bench_device" --mode dp --gpus 2 \
      --baseline 0 --model cnn --warmup 1 --steps 2 --cuda-graphs off
    rc=$?
    if ((rc == 0)) && ! grep -q 'Duration' "$out/ncu_$what.txt"; then
      verdict FAIL "ncu dp/$what" "no kernel in the range: see ncu_$what.txt"
    else
      step_verdict "$rc" "ncu dp/$what" \
        "$(grep -c '"Duration"' "$out/ncu_$what.txt") kernels profiled: see ncu_$what.txt" \
        "see ncu_$what.txt"
    fi
  done
}

# ---- running the parts -----------------------------------------------------------------------

# One part: its steps, then one line saying whether it is done (every step ok or skipped); then
# the results are packed again (--pack), so a run stopped later still returns this part.
run_part() {  # PART
  local p=$1 t0
  if [[ -n $skip_done ]] && grep -q "^== part $p: done" "$skip_done"; then
    echo "== part $p: done in an earlier run ($skip_done): skipped" | tee -a "$summary"
    return
  fi
  t0=$(now)
  part_fail=0 part_cut=0
  echo "== part $p ($(date -u +%H:%M:%S))" | tee -a "$summary"
  "part_${p//-/_}"
  if ((part_fail == 0 && part_cut == 0)); then
    echo "== part $p: done in $(($(now) - t0)) s" | tee -a "$summary"
  else
    echo "== part $p: not done in $(($(now) - t0)) s ($part_fail failed, $part_cut cut off or not started)" |
      tee -a "$summary"
  fi
  pack_results "part $p"
}

# A part's budget within a lease: up to the lease's end, or its cap (lease_cap_s) from now.
lease_budget() {  # PART
  local cap=${lease_cap_s[$1]:-}
  budget_end=$lease_end budget_what="the lease's $lease_s s"
  if [[ -n $cap ]] && (($(now) + cap < lease_end)); then
    budget_end=$(($(now) + cap)) budget_what="$1's $cap s of the lease"
  fi
}

if [[ -n $lease_s && $stage == all ]]; then
  # The lease: the untimed jobs side by side, within the side window; then the timed parts. A
  # job stops its running step on a TERM (on_signal sends one to each job).
  budget_end=$((t_start + lease_side_s))
  ((budget_end > lease_end)) && budget_end=$lease_end
  budget_what="the lease's side-by-side window ($((budget_end - t_start)) s)"
  for job in "${lease_jobs[@]}"; do
    (
      trap '[[ -n $step_pid ]] && kill -TERM "$step_pid" 2> /dev/null
        [[ -n $pack_tmp ]] && rm -f "$pack_tmp"
        exit 143' TERM
      trap '' INT  # the main shell stops the job
      for p in $job; do run_part "$p"; done
      ((n_fail)) && exit 1
      ((n_cut)) && exit 3
      exit 0
    ) &
    side_pids+=($!)
  done
  for pid in "${side_pids[@]}"; do
    wait "$pid"
    case $? in
      0) ;;
      3) n_cut=$((n_cut + 1)) ;;
      *) n_fail=$((n_fail + 1)) ;;
    esac
  done
  side_pids=()
  for p in "${lease_timed[@]}"; do
    lease_budget "$p"
    run_part "$p"
  done
else
  for item in "${items[@]}"; do
    if [[ -z $lease_s ]]; then
      budget_end=$(($(now) + stage_budget_s)) budget_what="the $item budget ($stage_budget_s s)"
    fi
    for p in $(item_parts "$item"); do
      [[ -n $lease_s ]] && lease_budget "$p"
      run_part "$p"
    done
  done
fi

# What is left, as the --stage list that runs it.
echo "   took $(($(now) - t_start)) s" | tee -a "$summary"
say_left
status=0
if ((n_fail)); then
  echo "gpu_check: step(s) failed; everything is in $out" | tee -a "$summary"
  status=1
elif ((n_cut)); then
  echo "gpu_check: nothing failed, but steps were cut off or not started; everything is in $out" |
    tee -a "$summary"
  status=3
else
  echo "gpu_check: every step passed; commit $out to benchmarks/results/" | tee -a "$summary"
fi
pack_results "the end" || status=1
exit $status
