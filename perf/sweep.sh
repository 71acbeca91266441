#!/usr/bin/env bash
# Size sweep for the plot: every peer at RANKS ranks from MIN to MAX bytes (step FACTOR),
# SCAPE masked (dense in/out and packed) and COO at DENSITIES, then perf/plot draws the bus
# bandwidth and the dense-equivalent bandwidth against the size into OUT_DIR/results.png.
#
#   perf/sweep.sh [BUILD_DIR [OUT_DIR]]    BUILD_DIR: <repo>/build; OUT_DIR: BUILD_DIR/perf-sweep
#
# Environment (defaults): RANKS (2), MIN (1M), MAX (256M), FACTOR (4), DENSITIES (0.1,0.01),
# ITERS (5), WARMUP (1), RUN_TIMEOUT_S (300). About 2 minutes on a 2-core machine.
set -u
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$repo/build}
out=${2:-$build/perf-sweep}
RANKS=${RANKS:-2}
MIN=${MIN:-1M}
MAX=${MAX:-256M}
FACTOR=${FACTOR:-4}
DENSITIES=${DENSITIES:-0.1,0.01}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-1}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}
scape=$build/perf/scape-perf
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.out "$out"/results.png
status=0
sweep=(-b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" -I 0)
run() {
  local name=$1 rc=0
  shift
  echo "######## $name: $*"
  timeout --kill-after=10 "$RUN_TIMEOUT_S" "$@" >"$out/$name.out" 2>&1 || rc=$?
  grep -v '^#  Rank\|^# Using ranks' "$out/$name.out"
  [ "$rc" = 0 ] || { echo "sweep.sh: $name exited with status $rc" >&2; status=1; }
}
# shellcheck disable=SC2054  # "self,vader" is one argument
mpirun_cmd=(mpirun --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader
  --mca oob_tcp_if_include lo)
[ "$(id -u)" = 0 ] && mpirun_cmd+=(--allow-run-as-root)
if [ -x "$build/perf/mpi-allreduce-perf" ] && command -v mpirun >/dev/null 2>&1; then
  run mpi "${mpirun_cmd[@]}" -np "$RANKS" "$build/perf/mpi-allreduce-perf" "${sweep[@]}" \
    -J "$out/mpi.json"
fi
if [ -x "$build/perf/gloo-allreduce-perf" ]; then
  run gloo "$build/perf/gloo-allreduce-perf" -np "$RANKS" "${sweep[@]}" -J "$out/gloo.json"
fi
run scape_dense "$scape" -np "$RANKS" "${sweep[@]}" -J "$out/scape_dense.json"
for mode in mask mask-packed coo; do
  run "scape_${mode//-/_}" "$scape" -np "$RANKS" --mode "$mode" -D "$DENSITIES" "${sweep[@]}" \
    -J "$out/scape_${mode//-/_}.json"
done
"$repo/perf/plot" -o "$out/results.png" --title \
  "all-reduce on this host, $RANKS ranks (out-of-place): peers, SCAPE masked and COO" \
  "$out"/*.json || status=1
exit $status
