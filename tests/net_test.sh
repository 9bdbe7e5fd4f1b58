#!/usr/bin/env bash
# net: jobs across network namespaces made by scripts/cluster.sh (each node its own address,
# a rate-limited link through a bridge). One case per run:
#   net_test.sh cluster_up_down | ddp_gloo | hybrid | ddp_mpi | restart | partition | stopped
# Paths come from the environment (tests/net.cmake): CLUSTER (scripts/cluster.sh), DP_BENCH,
# MPIRUN (empty without MPI). Exits 77 (ctest: skipped), saying why, when not root or without
# ip netns. Every cluster has a prefix of its own (the case and this PID) and is removed on exit.
set -uo pipefail

case_name=${1:?give a case: cluster_up_down, ddp_gloo, hybrid, ddp_mpi, restart, partition or stopped}
skip() {
  echo "net.$case_name: SKIPPED: $*"
  exit 77
}
fail() {
  echo "net.$case_name: FAILED: $*" >&2
  exit 1
}
[ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces, veth, tc)"
command -v ip > /dev/null && command -v tc > /dev/null || skip "iproute2 (ip, tc) is missing"
probe="dpprobe$$"
ip netns add "$probe" 2> /dev/null || skip "'ip netns add' is not allowed here"
ip netns del "$probe"

prefix="t$$${case_name:0:1}"
work=$(mktemp -d "${TMPDIR:-/tmp}/net_$case_name.XXXXXX")
cleanup() {
  "$CLUSTER" down --prefix "$prefix"
  [ -n "${NET_KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

node() {  # node I CMD...: CMD inside node I
  local i=$1
  shift
  "$CLUSTER" exec "$i" --prefix "$prefix" "$@"
}

# Whether a file matching the glob PATTERN appears within 15 s. Checkpoints are pruned to the
# last 3: a run saving every step keeps step 1's file for a few ms only, which a poll every
# 50 ms could miss (net.partition's ddp-first did, under load), so a run's first checkpoint is
# waited for as any step's.
appears() {
  for _ in $(seq 300); do
    compgen -G "$1" > /dev/null && return 0
    sleep 0.05
  done
  return 1
}

# The pid of rank 1 on node 1 (the process whose environment holds RANK=1), or nothing.
rank1_pid() {
  local found=""
  for p in $(ip netns pids "$prefix-n1"); do
    tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "RANK=1" && found=$p
  done
  echo "$found"
}

# Waits for both nodes' commands (pids[0], pids[1]): their exit codes in rc0 and rc1.
wait_nodes() {
  rc0=0 rc1=0
  wait "${pids[0]}" || rc0=$?
  wait "${pids[1]}" || rc1=$?
}

# The losses of the first run in dp_bench's --json file, one a line.
losses() { jq -c '.runs[0].losses[]' "$1"; }

# Whether two loss lists agree within a relative 1e-5 (another summation order).
close_losses() {
  paste "$1" "$2" | awk '{ d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2;
    if (d > 1e-5 * m) { print "loss " NR ": " $1 " vs " $2; bad = 1 } } END { exit bad }'
}

bench_args=(--device cpu --baseline 0 --warmup 0 --batch 24)
short=(--steps 4)
mode_args=(--mode ddp --gpus 1)  # what two_nodes runs on each node

# DDP over Gloo, one rank per node: node 1 in the background, node 0 in the foreground.
# `env...` are extra variables for both nodes.
two_nodes() {
  local json=$1
  shift
  local master
  master=$("$CLUSTER" addr 0 --prefix "$prefix")
  node 1 env "$@" timeout 60 "$DP_BENCH" "${bench_args[@]}" "${short[@]}" "${mode_args[@]}" --nnodes 2 --node-rank 1 \
    --master-addr "$master" --master-port 29500 > "$work/node1.txt" 2>&1 &
  local pid1=$!
  node 0 env "$@" timeout 60 "$DP_BENCH" "${bench_args[@]}" "${short[@]}" "${mode_args[@]}" --nnodes 2 --node-rank 0 \
    --master-addr "$master" --master-port 29500 --json "$json" > "$work/node0.txt" 2>&1
  local rc0=$? rc1=0
  wait $pid1 || rc1=$?
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] ||
    fail "node 0 exited $rc0, node 1 exited $rc1: $(tail -n 5 "$work/node0.txt" "$work/node1.txt")"
}

case $case_name in
  cluster_up_down)
    "$CLUSTER" up 2 --rate 100mbit --prefix "$prefix" || fail "up 2"
    [ "$("$CLUSTER" addr 1 --prefix "$prefix")" = 10.29.0.2 ] || fail "node 1's address"
    node 1 tc qdisc show dev eth0 | grep -q "tbf.*rate 100Mbit" || fail "no tbf on node 1"
    # Node 0 reaches node 1 through the bridge (bash's /dev/tcp against a listener).
    node 1 timeout 10 python3 -c "import socket; s = socket.create_server(('10.29.0.2', 7777)); \
c, _ = s.accept(); c.sendall(c.recv(5))" &
    sleep 0.5
    got=$(node 0 timeout 5 python3 -c "import socket, time; c = socket.create_connection(\
('10.29.0.2', 7777), timeout=5); c.sendall(b'hello'); print(c.recv(5).decode())")
    wait
    [ "$got" = hello ] || fail "node 0 could not talk to node 1 (got '$got')"
    "$CLUSTER" up 2 --prefix "$prefix" 2> "$work/again.txt" && fail "a second up succeeded"
    grep -q "exists already" "$work/again.txt" || fail "second up: $(cat "$work/again.txt")"
    "$CLUSTER" up 0 --prefix "${prefix}x" > "$work/zero.txt" 2>&1 && fail "up 0 succeeded"
    grep -q "give a whole number of nodes" "$work/zero.txt" || fail "up 0: $(cat "$work/zero.txt")"
    "$CLUSTER" up 2 --rate fast --prefix "${prefix}x" > "$work/fast.txt" 2>&1 &&
      fail "--rate fast succeeded"
    grep -q "give a number and a unit" "$work/fast.txt" || fail "--rate fast: $(cat "$work/fast.txt")"
    "$CLUSTER" up 2 --rate 0bit --prefix "${prefix}x" > "$work/zero.txt" 2>&1 &&
      fail "--rate 0bit succeeded"
    grep -q "below 8 bit/s" "$work/zero.txt" || fail "--rate 0bit: $(cat "$work/zero.txt")"
    node 0 sleep 60 &
    sleeper=$!
    for _ in $(seq 100); do  # inside node 0 before down, so that down has it to stop
      [ -n "$(ip netns pids "$prefix-n0" 2> /dev/null)" ] && break
      sleep 0.05
    done
    [ -n "$(ip netns pids "$prefix-n0" 2> /dev/null)" ] || fail "the sleep never ran in node 0"
    "$CLUSTER" down --prefix "$prefix" || fail "down"
    for _ in $(seq 50); do
      kill -0 "$sleeper" 2> /dev/null || break
      sleep 0.1
    done
    if kill -0 "$sleeper" 2> /dev/null; then
      pkill -P "$sleeper" 2> /dev/null
      fail "down left the sleep inside node 0 running"
    fi
    wait "$sleeper" 2> /dev/null
    "$CLUSTER" down --prefix "$prefix" || fail "a second down"
    [ -z "$(ip netns list | grep "^$prefix-")" ] || fail "namespaces left: $(ip netns list)"
    ;;
  ddp_gloo)
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    "$DP_BENCH" "${bench_args[@]}" "${short[@]}" --mode ddp --gpus 2 --json "$work/one_node.json" > "$work/ref.txt" 2>&1 ||
      fail "2 ranks on one node: $(tail -n 5 "$work/ref.txt")"
    "$DP_BENCH" "${bench_args[@]}" "${short[@]}" --mode dp --gpus 1 --json "$work/one_device.json" > "$work/ref.txt" 2>&1 ||
      fail "1 device: $(tail -n 5 "$work/ref.txt")"
    losses "$work/one_node.json" > "$work/one_node.txt"
    losses "$work/one_device.json" > "$work/one_device.txt"
    # The interface named (DP_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), then none: the address this
    # node reaches the master from.
    for how in DP_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 DP_UNUSED=1; do
      two_nodes "$work/nodes.json" "$how"
      losses "$work/nodes.json" > "$work/nodes.txt"
      [ "$(wc -l < "$work/nodes.txt")" -eq 4 ] || fail "$how: $(cat "$work/nodes.txt")"
      cmp -s "$work/nodes.txt" "$work/one_node.txt" ||
        fail "$how: two nodes $(tr '\n' ' ' < "$work/nodes.txt") differ from 2 ranks on one node" \
          "$(tr '\n' ' ' < "$work/one_node.txt")"
      close_losses "$work/nodes.txt" "$work/one_device.txt" || fail "$how: against 1 device"
      echo "net.ddp_gloo: $how: the losses of 2 ranks on 2 nodes equal those on one node"
    done
    ;;
  hybrid)
    # DP over 2 devices inside each node, device 0s joined over the link: 4 devices in all,
    # an uneven batch (23 rows: 12 and 11 per node), equal to one device on the global batch.
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    bench_args=(--device cpu --baseline 0 --warmup 0 --batch 23)
    "$DP_BENCH" "${bench_args[@]}" "${short[@]}" --mode dp --gpus 1 --json "$work/one_device.json" > "$work/ref.txt" 2>&1 ||
      fail "1 device: $(tail -n 5 "$work/ref.txt")"
    losses "$work/one_device.json" > "$work/one_device.txt"
    mode_args=(--mode hybrid --gpus 2)
    two_nodes "$work/nodes.json" DP_SOCKET_IFNAME=eth0
    losses "$work/nodes.json" > "$work/nodes.txt"
    [ "$(wc -l < "$work/nodes.txt")" -eq 4 ] || fail "hybrid: $(cat "$work/nodes.txt")"
    [ "$(jq '.runs[0].gpus' "$work/nodes.json")" -eq 4 ] || fail "hybrid: not 4 devices in all"
    close_losses "$work/nodes.txt" "$work/one_device.txt" || fail "hybrid against 1 device"
    echo "net.hybrid: 2 nodes x 2 devices follow one device: $(tr '\n' ' ' < "$work/nodes.txt")"
    ;;
  ddp_mpi)
    [ -n "${MPIRUN:-}" ] || skip "this build has no MPI (install libopenmpi-dev, openmpi-bin)"
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    "$DP_BENCH" "${bench_args[@]}" "${short[@]}" --mode ddp --gpus 2 --json "$work/one_node.json" > "$work/ref.txt" 2>&1 ||
      fail "2 ranks on one node: $(tail -n 5 "$work/ref.txt")"
    losses "$work/one_node.json" > "$work/one_node.txt"
    printf '%s slots=1\n' "$("$CLUSTER" addr 0 --prefix "$prefix")" \
      "$("$CLUSTER" addr 1 --prefix "$prefix")" > "$work/hosts"
    # mpirun in node 0; its orted on node 1 is started by cluster.sh rsh (an ssh stand-in that
    # enters the node's namespace), so both talk over eth0 only. No MASTER_ADDR or MASTER_PORT:
    # docs/several-machines.md's command as it is written (MPI's backend needs no store).
    node 0 timeout 60 env -u MASTER_ADDR -u MASTER_PORT "$MPIRUN" --allow-run-as-root -np 2 \
      --hostfile "$work/hosts" --display-map \
      --mca plm_rsh_agent "$CLUSTER rsh --prefix $prefix" --mca btl self,tcp \
      --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
      "$DP_BENCH" "${bench_args[@]}" "${short[@]}" --mode ddp --backend mpi --json "$work/mpi.json" \
      > "$work/mpi.txt" 2>&1 || fail "mpirun: $(tail -n 20 "$work/mpi.txt")"
    grep -q "10.29.0.2" "$work/mpi.txt" || fail "no rank on node 1: $(head -20 "$work/mpi.txt")"
    losses "$work/mpi.json" > "$work/mpi_losses.txt"
    [ "$(wc -l < "$work/mpi_losses.txt")" -eq 4 ] || fail "losses: $(cat "$work/mpi_losses.txt")"
    close_losses "$work/mpi_losses.txt" "$work/one_node.txt" || fail "MPI on 2 nodes vs Gloo on one"
    echo "net.ddp_mpi: 2 ranks on 2 nodes over MPI follow 2 ranks on one node over Gloo"
    ;;
  restart)
    # 300 steps, a checkpoint every 10; rank 1 (node 1) is killed once step 40 is saved.
    steps=(--optim adamw --steps 300 --save-every 10)
    "$DP_BENCH" "${bench_args[@]}" "${steps[@]}" --mode ddp --gpus 2 --checkpoint-dir "$work/whole" \
      --json "$work/whole.json" \
      > "$work/whole.txt" 2>&1 || fail "the uninterrupted run: $(tail -n 5 "$work/whole.txt")"
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    master=$("$CLUSTER" addr 0 --prefix "$prefix")
    pids=()
    for i in 1 0; do
      node $i timeout 60 "$DP_BENCH" "${bench_args[@]}" "${steps[@]}" --mode ddp --gpus 1 \
        --nnodes 2 --node-rank $i --master-addr "$master" --master-port 29500 --max-restarts 1 \
        --checkpoint-dir "$work/run" --resume latest --json "$work/node$i.json" \
        > "$work/node$i.txt" 2>&1 &
      pids[i]=$!
    done
    appears "$work/run/step_00000040.safetensors" || fail "no checkpoint of step 40 in 15 s"
    rank1=$(rank1_pid)
    [ -n "$rank1" ] || fail "rank 1 is not running on node 1 (finished already?)"
    kill -KILL "$rank1"
    wait_nodes
    [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] ||
      fail "node 0 exited $rc0, node 1 $rc1: $(tail -n 8 "$work/node0.txt" "$work/node1.txt")"
    for i in 0 1; do
      grep -q "launch_workers: restart 1 of 1 after rank 1 (node 1) was killed by signal 9" \
        "$work/node$i.txt" || fail "node $i did not restart: $(tail -n 8 "$work/node$i.txt")"
    done
    # The second attempt went on from a checkpoint: it ran fewer steps than the whole run, and
    # its losses are the whole run's last ones.
    losses "$work/whole.json" > "$work/whole_losses.txt"
    losses "$work/node0.json" > "$work/resumed_losses.txt"
    n=$(wc -l < "$work/resumed_losses.txt")
    [ "$n" -gt 0 ] && [ "$n" -le 260 ] || fail "the second attempt ran $n steps, not a resumed few"
    tail -n "$n" "$work/whole_losses.txt" | cmp -s - "$work/resumed_losses.txt" ||
      fail "the resumed losses differ from the uninterrupted run's last $n"
    cmp -s "$work/whole/step_00000300.safetensors" "$work/run/step_00000300.safetensors" ||
      fail "the restarted job's final checkpoint differs from the uninterrupted run's"
    for i in 0 1; do
      [ -z "$(ip netns pids "$prefix-n$i")" ] || fail "processes left on node $i"
    done
    echo "net.restart: rank 1 killed on node 1, both nodes restarted, the final state is the" \
      "uninterrupted run's bit for bit"
    ;;
  partition)
    # Node 1's link goes down mid-run (a network partition: no reset reaches either side). Each
    # node's launcher sees it from the heartbeats within about DP_HEARTBEAT_TIMEOUT (5 s), names
    # it and stops its workers, instead of waiting out the collective timeout (300 s). DDP is cut
    # after step 10, and after step 1 (ddp-first: a cut before a launcher's first look at the
    # store went unseen until the ranks waited for that look), hybrid after 4 s. ddp-restarts
    # (--max-restarts 1) must not restart: node 0 waits for node 1's end only as long as a node
    # still reachable would take to publish it (it waited the launchers' 60 s).
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    master=$("$CLUSTER" addr 0 --prefix "$prefix")
    for run in ddp ddp-first hybrid ddp-restarts; do
      rm -rf "$work/ck"
      mode=${run%-*}
      gpus=1
      [ "$mode" = hybrid ] && gpus=2
      cut_after=10
      [ "$run" = ddp-first ] && cut_after=1
      pids=()
      for i in 1 0; do
        # Only node 0 saves (rank 0): its checkpoints prove the nodes train together.
        extra=()
        [ "$mode" = ddp ] && extra=(--checkpoint-dir "$work/ck" --save-every "$cut_after")
        [ "$run" = ddp-restarts ] && extra+=(--max-restarts 1)
        node $i timeout 50 "$DP_BENCH" "${bench_args[@]}" --steps 100000 --mode $mode --gpus $gpus \
          --nnodes 2 --node-rank $i --master-addr "$master" --master-port 29500 "${extra[@]}" \
          > "$work/$run-node$i.txt" 2>&1 &
        pids[i]=$!
      done
      if [ "$mode" = ddp ]; then
        appears "$work/ck/step_*.safetensors" ||
          fail "$run: no checkpoint (every $cut_after steps) in 15 s: $(tail -n 3 "$work/$run-node0.txt")"
      else
        sleep 4  # hybrid saves nothing: time to rendezvous and train a few steps
      fi
      kill -0 "${pids[0]}" 2> /dev/null && kill -0 "${pids[1]}" 2> /dev/null ||
        fail "$run: a node ended before the cut: $(tail -n 3 "$work/$run-node0.txt" "$work/$run-node1.txt")"
      cut=$(date +%s)
      ip -n "$prefix-n1" link set eth0 down
      wait_nodes
      took=$(($(date +%s) - cut))
      [ $rc0 -eq 1 ] && [ $rc1 -eq 1 ] ||
        fail "$run: node 0 exited $rc0, node 1 $rc1 (want 1 and 1; 124 is timeout's):" \
          "$(tail -n 3 "$work/$run-node0.txt" "$work/$run-node1.txt")"
      limit=20
      [ "$run" = ddp-restarts ] && limit=30  # node 0 also waits up to 13 s for node 1's end
      [ "$took" -le $limit ] || fail "$run: the nodes took $took s to stop after the cut"
      if [ "$run" = ddp-restarts ]; then
        grep -q "launch_workers: node 1 is unreachable (.*), and a restart needs every node; no restart" \
          "$work/$run-node0.txt" || fail "$run: node 0 did not refuse the restart: $(tail -n 3 "$work/$run-node0.txt")"
        ! grep -q "restart 1 of 1" "$work/$run-node0.txt" "$work/$run-node1.txt" ||
          fail "$run: a node restarted without the other"
      fi
      grep -q "launch_workers: rank 1 (node 1) sent no heartbeat for [0-9.]* s: node 1 died, froze, or is cut off from this node (a network partition)" \
        "$work/$run-node0.txt" || fail "$run: node 0 did not name node 1: $(tail -n 3 "$work/$run-node0.txt")"
      grep -q "launch_workers: the store on rank 0 (node 0, $master:29500) stopped answering for [0-9.]* s: node 0 died, froze, or is cut off from this node (a network partition)" \
        "$work/$run-node1.txt" || fail "$run: node 1 did not name node 0: $(tail -n 3 "$work/$run-node1.txt")"
      for i in 0 1; do
        [ -z "$(ip netns pids "$prefix-n$i")" ] || fail "$run: processes left on node $i"
      done
      ip -n "$prefix-n1" link set eth0 up
      echo "net.partition: $run: both nodes named the partition and stopped in $took s"
    done
    ;;
  stopped)
    # Node 1's worker is stopped (SIGSTOP) mid-run. Node 1 names its own rank as hung (it used
    # to blame node 0 when node 0, judging rank 1 first, took rank 0's store down with it) and
    # node 0 names rank 1. With --max-restarts 1 both nodes restart and finish, naming rank 1.
    "$CLUSTER" up 2 --rate 1gbit --prefix "$prefix" > /dev/null || fail "up 2"
    master=$("$CLUSTER" addr 0 --prefix "$prefix")
    for run in plain restarts; do
      rm -rf "$work/ck"
      extra=(--checkpoint-dir "$work/ck" --save-every 10)
      n_steps=100000
      [ "$run" = restarts ] && extra+=(--max-restarts 1) && n_steps=400
      pids=()
      for i in 1 0; do
        node $i timeout 80 "$DP_BENCH" "${bench_args[@]}" --steps $n_steps --mode ddp --gpus 1 \
          --nnodes 2 --node-rank $i --master-addr "$master" --master-port 29500 "${extra[@]}" \
          > "$work/$run-node$i.txt" 2>&1 &
        pids[i]=$!
      done
      appears "$work/ck/step_*.safetensors" ||
        fail "$run: no checkpoint (every 10 steps) in 15 s: $(tail -n 3 "$work/$run-node0.txt")"
      worker=$(rank1_pid)
      [ -n "$worker" ] || fail "$run: no worker process on node 1"
      kill -STOP "$worker"
      wait_nodes
      want=1
      [ "$run" = restarts ] && want=0
      [ $rc0 -eq $want ] && [ $rc1 -eq $want ] ||
        fail "$run: node 0 exited $rc0, node 1 $rc1 (want $want and $want):" \
          "$(tail -n 4 "$work/$run-node0.txt" "$work/$run-node1.txt")"
      # With restarts, node 0's judgement, published first, may stop node 1's workers instead.
      [ "$run" = restarts ] ||
        grep -q "launch_workers: rank 1 (local rank 0, pid $worker) sent no heartbeat for [0-9.]* s: hung" \
          "$work/$run-node1.txt" || fail "$run: node 1 did not name its rank 1: $(tail -n 3 "$work/$run-node1.txt")"
      ! grep -q "node 0 died, froze" "$work/$run-node1.txt" || fail "$run: node 1 blamed node 0"
      if [ "$run" = restarts ]; then
        for i in 0 1; do
          grep -q "launch_workers: restart 1 of 1 after rank 1 (node 1) sent no heartbeat for" \
            "$work/$run-node$i.txt" || fail "$run: node $i did not name rank 1 at the restart:" \
            "$(grep restart "$work/$run-node$i.txt")"
        done
      else
        # Node 0 names rank 1's silence, or, when node 1 killed it first, the reset connection.
        grep -q "launch_workers: rank 1 (node 1) sent no heartbeat for\|Connection reset by peer" \
          "$work/$run-node0.txt" || fail "$run: node 0 named nothing: $(tail -n 3 "$work/$run-node0.txt")"
      fi
      for i in 0 1; do
        [ -z "$(ip netns pids "$prefix-n$i")" ] || fail "$run: processes left on node $i"
      done
      echo "net.stopped: $run: the nodes named rank 1, none blamed node 0"
    done
    ;;
  *) fail "unknown case '$case_name'" ;;
esac
echo "net.$case_name: passed"
