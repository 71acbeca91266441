#!/usr/bin/env bash
# Off-host tests: each rank in its own network namespace (a veth into a bridge that lives in a
# hub namespace) and its own UTS namespace (its own hostname), so the library sees three hosts:
# bootstrap over the namespaces' addresses, UCX over TCP with error handling, no shared memory.
# Addresses exist only inside the namespaces (10.213.0.0/24); the host's own network is not
# touched. Cases: correctness, a rank killed mid-collective, a rank killed in a mask sync, a rank
# that never comes.
#   bash tests/offhost/run_netns.sh <path to offhost_rank>
# Exits 77 (ctest: skipped) with the reason when not root or without ip/unshare.
set -uo pipefail
bin="${1:?usage: run_netns.sh <offhost_rank>}"
if [ "$(id -u)" != "0" ]; then echo "SKIP: off-host tests need root (ip netns)"; exit 77; fi
for t in ip unshare hostname timeout; do
  command -v "$t" > /dev/null || { echo "SKIP: no '$t' tool"; exit 77; }
done
tag="sc$$"
hub="${tag}h"
P=3
cleanup() {
  for r in $(seq 0 $((P - 1))); do ip netns del "${tag}r$r" 2> /dev/null; done
  ip netns del "$hub" 2> /dev/null
  rm -rf "$work"
}
work=$(mktemp -d)
trap cleanup EXIT
if ! ip netns add "$hub" 2> "$work/err"; then
  echo "SKIP: cannot create network namespaces: $(cat "$work/err")"; exit 77
fi
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
ip -n "$hub" link set lo up
for r in $(seq 0 $((P - 1))); do
  ns="${tag}r$r"
  ip netns add "$ns"
  ip link add "${tag}a$r" netns "$ns" type veth peer name "${tag}b$r" netns "$hub"
  ip -n "$ns" link set "${tag}a$r" name eth0
  ip -n "$ns" addr add "10.213.0.$((r + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$hub" link set "${tag}b$r" master br0
  ip -n "$hub" link set "${tag}b$r" up
done
# Each rank: its namespace, its hostname, eth0 for the bootstrap and UCX, TCP only.
launch() {  # case rank timeoutMs
  local ns="${tag}r$2"
  ip netns exec "$ns" unshare --uts sh -c "hostname scape-host-$2 && exec env \
    SCAPE_SOCKET_IFNAME=eth0 UCX_NET_DEVICES=eth0 UCX_TLS=tcp UCX_WARN_UNUSED_ENV_VARS=n \
    timeout 60 '$bin' '$1' '$2' '$P' '$work/$1' '$3'" 2> "$work/$1.$2.log" &
}
fail=0
runcase() {  # case timeoutMs expect_last_killed(0/1)
  mkdir -p "$work/$1"
  local pids=()
  for r in $(seq 0 $((P - 1))); do launch "$1" "$r" "$2"; pids+=($!); done
  local r=0 st
  for pid in "${pids[@]}"; do
    wait "$pid"; st=$?
    local want=0
    if [ "$3" = "1" ] && [ "$r" = $((P - 1)) ]; then want=137; fi
    if [ "$st" != "$want" ]; then
      echo "offhost $1: rank $r exited $st (expected $want)"; cat "$work/$1.$r.log"; fail=1
    fi
    r=$((r + 1))
  done
  grep -h "offhost rank" "$work/$1".*.log 2> /dev/null | sed "s/^/  /"
  echo "offhost $1: done"
}
runcase allreduce 10000 0
runcase die-allreduce 5000 1
runcase die-masksync 5000 1
runcase late 2000 0
if [ "$fail" != "0" ]; then echo "OFF-HOST TESTS FAILED"; exit 1; fi
echo "off-host tests passed (3 namespaces, TCP, own hostnames)"
