# shellcheck shell=bash disable=SC2034  # script, build and scratch are for the sourcing test
# Sourced by the gpu_check tests that need no GPU: SCRIPT and BUILD_DIR from their arguments, a
# scratch folder removed at exit, and exit 77 (skipped) where a GPU is present, where
# scripts/gpu_check.sh runs for real.
#   . "$(dirname "$0")/gpu_check_common.sh" SCRIPT BUILD_DIR
set -u
script=$1
build=$2
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  echo "SKIPPED: this machine has a GPU"
  exit 77
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
