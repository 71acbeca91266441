#!/usr/bin/env bash
# Off-host tests of the NCCL net plugin: a receiver and a sender, each in its own network
# namespace (a veth into a bridge in a hub namespace, 10.214.0.1-2/24 inside the namespaces
# only) and UTS namespace (own hostname), each loading libnccl-net-scape.so through dlopen and
# restricted to its veth (SCAPE_NCCL_DEVICES==eth0) over UCX_TLS=tcp. The connect handle
# travels as a file in a shared temp directory. Cases (tests/offhost/offhost_plugin.cc):
#   xfer         1 KiB, 1 MiB, 64 MiB checked byte for byte
#   killrecv     the receiver killed (SIGKILL) with sends in flight: the sender's test() fails
#   killsendmid  the sender killed ~15 ms into a 256 MiB transfer: the receiver's test() fails
#   killsend     the sender killed right after posting a 64 MiB send: the same (until issue 15's
#                defect 9 was fixed the receiver aborted inside UCX 1.13 here; see
#                perf/RESULTS_reliability.md)
#   bash tests/offhost/run_plugin_netns.sh <offhost_plugin> <libnccl-net-scape.so> \
#        [--runs N] [--cases "xfer killsend ..."]
# (--with-killed-sender, which used to add the last two cases, is still accepted and does
# nothing: they run by default.)
# Exits 77 (ctest: skipped) with the reason when not root or without ip/unshare.
set -uo pipefail
bin="${1:?usage: run_plugin_netns.sh <offhost_plugin> <plugin.so> [--runs N] [--cases LIST]}"
lib="${2:?usage: run_plugin_netns.sh <offhost_plugin> <plugin.so> [--runs N] [--cases LIST]}"
shift 2
cases="xfer killrecv killsendmid killsend"
runs=1
while [ $# -gt 0 ]; do
  case "$1" in
    --with-killed-sender) ;;
    --runs) runs="$2"; shift ;;
    --cases) cases="$2"; shift ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
  shift
done
if [ "$(id -u)" != "0" ]; then echo "SKIP: off-host tests need root (ip netns)"; exit 77; fi
for t in ip unshare hostname timeout; do
  command -v "$t" > /dev/null || { echo "SKIP: no '$t' tool"; exit 77; }
done
tag="sp$$"
hub="${tag}h"
cleanup() {
  # Sides still running (an interrupted run): each job is `timeout` by then (every step of
  # the launch line execs), which passes TERM on to the program.
  local j
  for j in $(jobs -p); do kill -TERM "$j" 2> /dev/null; done
  for r in 0 1; do ip netns del "${tag}r$r" 2> /dev/null; done
  ip netns del "$hub" 2> /dev/null
  rm -rf "$work"
}
work=$(mktemp -d)
trap cleanup EXIT
trap 'exit 130' INT TERM
if ! ip netns add "$hub" 2> "$work/err"; then
  echo "SKIP: cannot create network namespaces: $(cat "$work/err")"; exit 77
fi
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
ip -n "$hub" link set lo up
for r in 0 1; do
  ns="${tag}r$r"
  ip netns add "$ns"
  ip link add "${tag}a$r" netns "$ns" type veth peer name "${tag}b$r" netns "$hub"
  ip -n "$ns" link set "${tag}a$r" name eth0
  ip -n "$ns" addr add "10.214.0.$((r + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "$hub" link set "${tag}b$r" master br0
  ip -n "$hub" link set "${tag}b$r" up
done
# One side: its namespace (0 receiver, 1 sender), its hostname, the plugin on eth0 only, TCP.
launch() {  # role case dir
  local r=0
  [ "$1" = "send" ] && r=1
  ip netns exec "${tag}r$r" unshare --uts sh -c "hostname scape-plugin-host-$r && exec env \
    SCAPE_NCCL_DEVICES==eth0 SCAPE_SOCKET_IFNAME=eth0 UCX_TLS=tcp SCAPE_NCCL_UCX_TLS=tcp \
    UCX_WARN_UNUSED_ENV_VARS=n OFFHOST_DEVICE=eth0 timeout 60 '$bin' '$lib' '$1' '$2' '$3'" \
    > "$3.$1.out" 2> "$3.$1.log" &
}
fail=0
runcase() {  # case run
  local dir="$work/$1.$2"
  mkdir -p "$dir"
  local t0=$SECONDS
  launch recv "$1" "$dir"; local rpid=$!
  launch send "$1" "$dir"; local spid=$!
  local rst sst
  { wait "$rpid"; rst=$?; } 2> /dev/null  # no "Killed" line from the shell: expected below
  { wait "$spid"; sst=$?; } 2> /dev/null
  local want_r=0 want_s=0
  case "$1" in
    killrecv) want_r=137 ;;
    killsend | killsendmid) want_s=137 ;;
  esac
  cat "$dir".*.out 2> /dev/null | grep "offhost-plugin" | sed "s/^/  /"
  if [ "$rst" != "$want_r" ] || [ "$sst" != "$want_s" ]; then
    echo "offhost-plugin $1 (run $2): receiver exited $rst (expected $want_r), sender $sst" \
      "(expected $want_s)"
    for s in recv send; do echo "--- $s"; cat "$dir.$s.out" "$dir.$s.log"; done
    fail=$((fail + 1))
  else
    echo "offhost-plugin $1 (run $2): ok ($((SECONDS - t0)) s)"
  fi
}
for i in $(seq 1 "$runs"); do
  for c in $cases; do runcase "$c" "$i"; done
done
if [ "$fail" != "0" ]; then echo "OFF-HOST PLUGIN TESTS FAILED ($fail case runs)"; exit 1; fi
echo "off-host plugin tests passed ($runs run(s) of: $cases; 2 namespaces, TCP, own hostnames)"
