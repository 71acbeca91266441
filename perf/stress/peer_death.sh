#!/usr/bin/env bash
# How soon every survivor hears of a same-host peer's death, per path (issue 33 item 4; figures
# in perf/RESULTS_reliability.md). Not in CI. Uses the off-host test driver's kill cases
# (build/tests/offhost/offhost_rank, or $SCAPE_STRESS_BIN), P ranks on this host with shared
# memory on (the library's default), the last rank SIGKILLed when every rank is at the same
# point; each survivor times its call from its start to the error.
#   bash perf/stress/peer_death.sh [trials] [paths...]
# paths: dense (a 4 MiB all-reduce), masked (a packed masked all-reduce at density
# 0.01), step (an optimizer step, 1 Mi parameters), masksync (a mask sync on the background
# thread); default all four, 25 trials each, P=4 ($SCAPE_DEATH_P). Extra environment for every
# rank: $SCAPE_DEATH_ENV (e.g. "SCAPE_LOCAL_SHM=0" for UCX's TCP transport).
# Prints per path: trials, clean trials, and the survivors' latencies (median, p90, max) in ms.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin="${SCAPE_STRESS_BIN:-build/tests/offhost/offhost_rank}"
[ -x "$bin" ] || { echo "build the driver first: cmake --build build --target offhost_rank"; exit 1; }
trials="${1:-25}"
shift || true
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(dense masked step masksync)
P="${SCAPE_DEATH_P:-4}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
read -r -a extra <<< "${SCAPE_DEATH_ENV:-}"
for path in "${paths[@]}"; do
  case "$path" in
    dense) kase=die-dense ;;
    masked) kase=die-masked ;;
    step) kase=die-step ;;
    masksync) kase=die-masksync ;;
    *) echo "unknown path $path (dense, masked, step, masksync)"; exit 2 ;;
  esac
  clean=0
  : > "$work/ms.$path"
  for i in $(seq 1 "$trials"); do
    d="$work/$path.$i"
    mkdir -p "$d"
    pids=()
    for r in $(seq 0 $((P - 1))); do
      env "${extra[@]}" timeout 60 "$bin" "$kase" "$r" "$P" "$d" 4000 > "$d/out.$r" 2> "$d/err.$r" &
      pids+=($!)
    done
    codes=""
    for pid in "${pids[@]}"; do { wait "$pid"; } 2> /dev/null; codes="$codes $?"; done
    want=""
    for r in $(seq 1 $((P - 1))); do want="$want 0"; done
    if [ "$codes" = "$want 137" ]; then clean=$((clean + 1)); else echo "  $path trial $i: exit codes$codes"; fi
    sed -n 's/.*seen after \([0-9]*\) ms.*/\1/p' "$d"/err.* >> "$work/ms.$path"
    rm -rf "$d"
  done
  sort -n "$work/ms.$path" | awk -v path="$path" -v trials="$trials" -v clean="$clean" '
    { v[NR] = $1 }
    END {
      if (NR == 0) { printf "%-9s %d trials, %d clean, no latencies\n", path, trials, clean; exit }
      p50 = v[int((NR + 1) / 2)]; p90 = v[int(NR * 0.9 + 0.999)]
      printf "%-9s %d trials, %d clean, %d survivor latencies: median %d ms, p90 %d ms, max %d ms\n",
             path, trials, clean, NR, p50, p90, v[NR]
    }'
done
