#!/usr/bin/env bash
# A cluster of N "machines" on this one: N network namespaces ("nodes"), each with a veth
# (eth0) into a bridge that lives in a namespace of its own (the "switch"), its own address
# 10.29.0.(1+i)/24, loopback up, and its egress rate-limited by tc's token bucket (tbf). The
# root namespace is not touched. Needs root (ip netns, veth, bridge, tc).
#
#   scripts/cluster.sh up N [--rate 1gbit] [--prefix NAME]   make nodes 0..N-1 (refuses when
#                                                            the prefix is in use)
#   scripts/cluster.sh down [--prefix NAME]                  stop what runs in them and remove
#                                                            them (idempotent)
#   scripts/cluster.sh exec NODE [--prefix NAME] CMD...      run CMD inside node NODE
#   scripts/cluster.sh addr NODE [--prefix NAME]             print node NODE's address
#   scripts/cluster.sh rsh [--prefix NAME] ADDR CMD...       run the shell command CMD inside
#                                        the node of address ADDR: an rsh/ssh stand-in for
#                                        mpirun (-mca plm_rsh_agent "cluster.sh rsh --prefix P")
#
# Namespaces are "<prefix>-sw" and "<prefix>-n<i>"; the default prefix is "dpnet" (also
# DP_CLUSTER_PREFIX). Give each concurrent cluster its own prefix (tests use one with their PID).
# Inside a node the interface is eth0: GLOO_SOCKET_IFNAME=eth0 or DP_SOCKET_IFNAME=eth0.
set -euo pipefail

readonly kSubnet=10.29.0
readonly kMaxNodes=64
readonly kIfname=eth0

die() {
  echo "cluster.sh: $*" >&2
  exit 1
}

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

prefix=${DP_CLUSTER_PREFIX:-dpnet}
rate=1gbit

check_prefix() {
  [[ $prefix =~ ^[a-z][a-z0-9]{0,19}$ ]] ||
    die "--prefix '$prefix': give 1 to 20 lower-case letters or digits, starting with a letter"
}

check_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (ip netns, veth, bridge, tc); run it with sudo"
  command -v ip > /dev/null || die "the 'ip' command (iproute2) is missing"
  command -v tc > /dev/null || die "the 'tc' command (iproute2) is missing"
}

# Rate in bits per second of a tc rate such as 1gbit, 100mbit, 2.5gbit.
rate_bits() {
  local r=$1
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$ ]] ||
    die "--rate '$r': give a number and a unit, e.g. 100mbit, 1gbit, 10gbit (or 'none')"
  local scale
  case ${BASH_REMATCH[3]} in
    bit) scale=1 ;; kbit) scale=1e3 ;; mbit) scale=1e6 ;; gbit) scale=1e9 ;; tbit) scale=1e12 ;;
  esac
  local bits
  bits=$(awk -v n="${BASH_REMATCH[1]}" -v s="$scale" 'BEGIN { printf "%.0f\n", n * s }')
  # tc takes no zero rate: 0bit would leave the link unlimited while the report said otherwise.
  [ "$bits" -ge 8 ] || die "--rate '$r' is below 8 bit/s: give a positive rate, or 'none' for no limit"
  echo "$bits"
}

switch_ns() { echo "$prefix-sw"; }
node_ns() { echo "$prefix-n$1"; }

# The namespaces of this prefix that exist (switch last, so nodes go first on down).
existing() {
  ip netns list | awk '{print $1}' | grep -E "^$prefix-(n[0-9]+)$" || true
  ip netns list | awk '{print $1}' | grep -Ex "$prefix-sw" || true
}

node_count() {
  ip netns list | awk '{print $1}' | grep -cE "^$prefix-n[0-9]+$" || true
}

check_node() {
  local node=$1
  [[ $node =~ ^[0-9]+$ ]] || die "NODE '$node': give a node index (0, 1, ...)"
  ip netns list | awk '{print $1}' | grep -qx "$(node_ns "$node")" ||
    die "node $node of cluster '$prefix' does not exist ($(node_count) node(s); run 'up' first)"
}

# The processes whose network namespace is the one of inode $1 (what 'ip netns pids' lists,
# found without the name, which is gone once the namespace is deleted).
pids_in_inode() {
  local f
  for f in /proc/[0-9]*/ns/net; do
    [ "$(stat -L -c %i "$f" 2> /dev/null)" = "$1" ] && basename "$(dirname "$(dirname "$f")")"
  done
  return 0
}

# Stops the processes of namespace inode $1: TERM, up to 2 s, then KILL.
stop_inode() {
  local -a pids
  mapfile -t pids < <(pids_in_inode "$1")
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2> /dev/null || true
  for _ in $(seq 20); do
    mapfile -t pids < <(pids_in_inode "$1")
    [ ${#pids[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2> /dev/null || true
}

cmd_down() {
  local ns inode
  for ns in $(existing); do
    # What still runs inside keeps the namespace alive after its name is gone: stop it first,
    # and again after the name is gone, for a process that entered in between ('exec' started
    # just before 'down').
    inode=$(stat -L -c %i "/var/run/netns/$ns" 2> /dev/null || true)
    [ -n "$inode" ] && stop_inode "$inode"
    ip netns del "$ns" 2> /dev/null || true
    [ -n "$inode" ] && stop_inode "$inode"
  done
  return 0
}

cmd_up() {
  local n=$1
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le $kMaxNodes ] ||
    die "N '$n': give a whole number of nodes in [1, $kMaxNodes]"
  local bits=0
  [ "$rate" = none ] || bits=$(rate_bits "$rate")
  [ -z "$(existing)" ] ||
    die "a cluster with prefix '$prefix' exists already ($(existing | tr '\n' ' ')); run" \
      "'$0 down --prefix $prefix' first, or give another --prefix"
  # A failure half-way removes what was made.
  # shellcheck disable=SC2154  # status is the trap's own
  trap 'status=$?; trap - EXIT; if [ $status -ne 0 ]; then cmd_down; echo "cluster.sh: up failed; removed cluster $prefix" >&2; fi; exit $status' EXIT
  trap 'exit 130' INT TERM
  local sw
  sw=$(switch_ns)
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  # tbf drops a packet larger than its bucket: the bucket holds 5 ms at the rate, and at least
  # 256 KiB (veth passes 64 KiB GSO segments).
  local burst=$((bits / 8 / 200))
  [ "$burst" -ge 262144 ] || burst=262144
  for ((i = 0; i < n; i++)); do
    local ns
    ns=$(node_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$sw" link add "p$i" type veth peer name $kIfname netns "$ns"
    ip -n "$sw" link set "p$i" master br0 up
    ip -n "$ns" addr add "$kSubnet.$((i + 1))/24" dev $kIfname
    ip -n "$ns" link set $kIfname up
    if [ "$bits" -gt 0 ]; then
      ip netns exec "$ns" tc qdisc add dev $kIfname root tbf rate "$rate" burst "$burst" \
        latency 50ms
    fi
  done
  trap - EXIT INT TERM
  echo "cluster.sh: $n node(s) up: namespaces $(node_ns 0)..$(node_ns $((n - 1))), addresses" \
    "$kSubnet.1..$kSubnet.$n on $kIfname, egress $rate"
}

[ $# -ge 1 ] || usage
sub=$1
shift
args=()
node=""
while [ $# -gt 0 ]; do
  case $1 in
    --prefix)
      [ $# -ge 2 ] || die "--prefix needs a value"
      prefix=$2
      shift 2
      ;;
    --rate)
      [ $# -ge 2 ] || die "--rate needs a value"
      rate=$2
      shift 2
      ;;
    *)
      if { [ "$sub" = exec ] || [ "$sub" = rsh ]; } && [ -n "$node" ]; then
        args+=("$@")  # the command, untouched
        break
      fi
      if [ "$sub" = exec ] || [ "$sub" = addr ] || [ "$sub" = rsh ]; then
        [ -z "$node" ] && node=$1 && shift && continue
      fi
      args+=("$1")
      shift
      ;;
  esac
done
check_prefix
case $sub in
  up)
    [ ${#args[@]} -eq 1 ] || die "up: give the number of nodes: up N [--rate 1gbit] [--prefix NAME]"
    check_root
    cmd_up "${args[0]}"
    ;;
  down)
    [ ${#args[@]} -eq 0 ] || die "down takes no arguments but --prefix (got: ${args[*]})"
    check_root
    cmd_down
    ;;
  exec)
    [ -n "$node" ] && [ ${#args[@]} -ge 1 ] || die "exec: give a node and a command: exec NODE CMD..."
    check_root
    check_node "$node"
    exec ip netns exec "$(node_ns "$node")" "${args[@]}"
    ;;
  addr)
    [ -n "$node" ] && [ ${#args[@]} -eq 0 ] || die "addr: give one node: addr NODE"
    check_root
    check_node "$node"
    echo "$kSubnet.$((node + 1))"
    ;;
  rsh)
    [ -n "$node" ] && [ ${#args[@]} -ge 1 ] || die "rsh: give an address and a command: rsh ADDR CMD..."
    [[ $node =~ ^$kSubnet\.([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge 1 ] ||
      die "rsh: '$node' is not a node address ($kSubnet.1, $kSubnet.2, ...)"
    node=$((BASH_REMATCH[1] - 1))
    check_root
    check_node "$node"
    # As ssh does: the words are one command line for a shell on the node.
    exec ip netns exec "$(node_ns "$node")" /bin/sh -c "${args[*]}"
    ;;
  -h | --help | help) usage ;;
  *) die "unknown command '$sub': give up, down, exec or addr (--help)" ;;
esac
