#!/usr/bin/env bash
# Reliability stress (not in CI; figures in perf/RESULTS_reliability.md). Uses the off-host
# test driver (build/tests/offhost/offhost_rank, or $SCAPE_STRESS_BIN):
#   bash perf/stress/stress.sh [trials]   # default 100 kill-a-rank trials per kind
# Prints, for each kind of kill-a-rank trial (dense all-reduce over shared memory, the same
# over UCX's TCP transport, a mask sync in the background thread, and off-host in network
# namespaces when root), how many trials ended with every survivor erroring in time; then
# 1000 init/destroy cycles and a 5000-step soak with RSS ($SCAPE_STRESS_CYCLES and
# $SCAPE_STRESS_STEPS change those counts).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin="${SCAPE_STRESS_BIN:-build/tests/offhost/offhost_rank}"
[ -x "$bin" ] || { echo "build the driver first: cmake --build build --target offhost_rank"; exit 1; }
trials="${1:-100}"
P=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
ranks() {  # case timeoutMs [env...]: runs P ranks on loopback; prints the exit codes
  local kase="$1" tmo="$2"; shift 2
  local d="$work/$kase.$RANDOM$RANDOM"
  mkdir -p "$d"
  local pids=() codes=""
  for r in $(seq 0 $((P - 1))); do
    env "$@" timeout 60 "$bin" "$kase" "$r" "$P" "$d" "$tmo" > "$d/out.$r" 2> "$d/err.$r" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do { wait "$pid"; } 2> /dev/null; codes="$codes $?"; done
  echo "$codes"
  cat "$d"/out.* 2> /dev/null
}
trial_kind() {  # label case [env...]
  local label="$1" kase="$2"; shift 2
  local ok=0 bad=0 start=$(date +%s)
  for i in $(seq 1 "$trials"); do
    codes=$(ranks "$kase" 4000 "$@" | head -1)
    # The last rank kills itself (137); every survivor must report the error in time (0).
    if [ "$codes" = " 0 0 137" ]; then ok=$((ok + 1)); else bad=$((bad + 1)); echo "  $label trial $i: exit codes$codes"; fi
  done
  echo "kill-a-rank $label: $ok of $trials trials clean (every survivor errored within the timeout), $bad not, $(( $(date +%s) - start )) s"
}
trial_kind "dense all-reduce (shared memory)" die-allreduce
trial_kind "dense all-reduce (UCX TCP)" die-allreduce SCAPE_LOCAL_SHM=0
trial_kind "mask sync in the background (shared memory)" die-masksync
if [ "$(id -u)" = "0" ] && command -v ip > /dev/null; then
  ok=0; start=$(date +%s)
  n=$(( (trials + 4) / 5 ))
  for i in $(seq 1 "$n"); do
    if bash tests/offhost/run_netns.sh "$bin" > "$work/netns.$i.log" 2>&1; then ok=$((ok + 1)); else tail -5 "$work/netns.$i.log"; fi
  done
  echo "kill-a-rank off-host (network namespaces, TCP; each run kills one rank mid-all-reduce and one in a mask sync): $ok of $n runs clean, $(( $(date +%s) - start )) s"
else
  echo "kill-a-rank off-host: skipped (needs root and ip)"
fi
echo "--- init/destroy cycles"
ranks cycles 10000 SCAPE_STRESS_N="${SCAPE_STRESS_CYCLES:-1000}" | tail -n +2
echo "--- soak"
ranks soak 10000 SCAPE_STRESS_N="${SCAPE_STRESS_STEPS:-5000}" | tail -n +2
