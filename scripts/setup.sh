#!/usr/bin/env bash
# Installs the Debian packages the project builds and runs with. Run as root.
# Installs only what is missing, so a second run costs one dpkg query.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  libtbb-dev libopenblas-dev zlib1g-dev
  doctest-dev libcli11-dev nlohmann-json3-dev
  libgloo-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist
  fortunes-min
  gnuplot-nox
  iproute2 jq python3
  clang-14 libclang-rt-14-dev
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
# fortunes-min is the English text train_text trains its byte-level GPT on (dp/data/text.hpp).
# clang-14 and libclang-rt-14-dev (libFuzzer, ASan, UBSan) build the fuzz targets (tests/fuzz).
# The CUDA toolkit is not a Debian package here: when nvcc is on PATH or under
# /usr/local/cuda the build compiles the CUDA backend, otherwise it builds CPU-only.
