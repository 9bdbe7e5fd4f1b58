#!/usr/bin/env bash
# Flat DDP against hybrid across two network-namespace nodes (scripts/cluster.sh) on a
# rate-limited link: 2 nodes x G CPU devices, DDP as 2G ranks (G per node) and hybrid as one
# DP process per node over G devices, the same global batch and steps. Writes dp_bench's JSON
# per (rate, mode, round) into OUT and prints one line each. Run as root from the repository
# root after a build:
#   benchmarks/cluster_hybrid.sh OUT [--rates "1gbit 10gbit"] [--gpus 4] [--rounds 2]
#       [--measured "1gbit=0.952"] -- DP_BENCH_ARGS...
# --measured gives, per rate, the link's Gbit/s measured by bench_collectives across the nodes
# (benchmarks/results/2026-11-24_netns-link/): dp_bench's report then adds the bytes out of each
# node and their time at that rate (--link-gbps).
set -euo pipefail
out=${1:?give an output folder}
shift
rates="1gbit 10gbit" gpus=4 rounds=2 measured=""
while [ $# -gt 0 ]; do
  case $1 in
    --rates) rates=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --measured) measured=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "cluster_hybrid: unknown flag $1" >&2; exit 2 ;;
  esac
done
bench_args=("$@")
here=$(cd "$(dirname "$0")/.." && pwd)
cluster="$here/scripts/cluster.sh" dp_bench="$here/build/bin/dp_bench"
[ -x "$dp_bench" ] || { echo "cluster_hybrid: build dp_bench first ($dp_bench)" >&2; exit 1; }
mkdir -p "$out"
prefix="hb$$"
trap '"$cluster" down --prefix "$prefix"' EXIT

run_pair() {  # run_pair MODE JSON RATE: node 1 in the background, node 0 in the foreground
  local mode=$1 json=$2 rate=$3 master link=()
  master=$("$cluster" addr 0 --prefix "$prefix")
  for m in $measured; do [ "${m%%=*}" = "$rate" ] && link=(--link-gbps "${m#*=}"); done
  local common=(--device cpu --mode "$mode" --gpus "$gpus" --baseline 0 --nnodes 2
    --master-addr "$master" --master-port 29600 "${link[@]}" "${bench_args[@]}")
  "$cluster" exec 1 --prefix "$prefix" env DP_SOCKET_IFNAME=eth0 timeout 600 "$dp_bench" \
    "${common[@]}" --node-rank 1 > "$json.node1.txt" 2>&1 &
  local pid=$!
  "$cluster" exec 0 --prefix "$prefix" env DP_SOCKET_IFNAME=eth0 timeout 600 "$dp_bench" \
    "${common[@]}" --node-rank 0 --json "$json" > "$json.node0.txt" 2>&1
  wait $pid
  rm -f "$json.node1.txt"
}

for round in $(seq 1 "$rounds"); do
  for rate in $rates; do
    "$cluster" up 2 --rate "$rate" --prefix "$prefix" > /dev/null
    for mode in ddp hybrid; do  # alternated within a round, so drift hits both
      json="$out/${rate}_${mode}_r${round}.json"
      run_pair "$mode" "$json" "$rate"
      jq -r --arg f "$json" '.runs[0] | "\($f): \(.mode) N=\(.gpus) median \(.step_ms_median) ms, final loss \(.final_loss), bytes/step \(.bytes_per_step)"' "$json"
    done
    "$cluster" down --prefix "$prefix" > /dev/null
  done
done
