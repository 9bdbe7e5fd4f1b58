#!/usr/bin/env bash
# Installs the Debian packages the project builds and runs with. Run as root.
# Installs only what is missing, so a second run costs one dpkg query.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  libtbb-dev libopenblas-dev libdnnl-dev ocl-icd-opencl-dev zlib1g-dev
  doctest-dev libcli11-dev nlohmann-json3-dev
  libgloo-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist
  fortunes-min
  gnuplot-nox
  iproute2 jq python3
  clang-14 libclang-rt-14-dev
  python3-pip
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing packages: ${missing[*]}; run this script as root" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# libdnnl-dev (oneDNN) runs bf16 GEMMs on the CPU's bf16 instructions (AVX512_BF16, AMX); its CMake
# config looks for OpenCL's headers and library (Debian builds it with an OpenCL GPU runtime),
# hence ocl-icd-opencl-dev.
# fortunes-min is the English text train_text trains its byte-level GPT on (dp/data/text.hpp).
# clang-14 and libclang-rt-14-dev (libFuzzer, ASan, UBSan) build the fuzz targets (tests/fuzz).
# The CUDA toolkit is not a Debian package here: when nvcc is on PATH or under
# /usr/local/cuda the build compiles the CUDA backend, otherwise it builds CPU-only.
# python3-pip fetches the cuDNN frontend below.

# The cuDNN frontend: NVIDIA's header-only C++ graph API over cuDNN, which the fused attention
# (kernels/cuda/sdpa.cu) is written in. Its headers ship in PyPI's nvidia-cudnn-frontend wheel
# (include/); only they are taken, into .deps/cudnn_frontend/include of the source tree, where
# CMake looks first. The wheel is fetched for a fixed Python and platform: the headers are the
# same in every wheel, so the local Python does not matter. Only the build machine needs them.
frontend_version=1.32.0
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
frontend_dir=$repo/.deps/cudnn_frontend
if ! grep -qx "$frontend_version" "$frontend_dir/VERSION" 2> /dev/null; then
  echo "setup: fetching the cuDNN frontend $frontend_version headers into $frontend_dir"
  wheel_dir=$(mktemp -d)
  trap 'rm -rf "$wheel_dir"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$wheel_dir" "nvidia-cudnn-frontend==$frontend_version"
  rm -rf "$frontend_dir"
  python3 - "$wheel_dir" "$frontend_dir" << 'EOF'
import glob, os, sys, zipfile
wheel_dir, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(wheel_dir, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"setup: expected one nvidia-cudnn-frontend wheel in {wheel_dir}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as z:
    headers = [n for n in z.namelist() if n.startswith("include/") and not n.endswith("/")]
    if "include/cudnn_frontend.h" not in headers:
        sys.exit(f"setup: {wheels[0]} has no include/cudnn_frontend.h")
    for n in headers:
        z.extract(n, dest)
EOF
  echo "$frontend_version" > "$frontend_dir/VERSION"
fi
