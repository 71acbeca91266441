#!/usr/bin/env bash
# The main comparison (perf/main_job.sh runs it): SCAPE's masked all-reduce beside its peers, in
# one run on this host, at 2 and 4 local ranks, one size (64 Mi fp32 = 256 MiB), densities
# 1.0 / 0.1 / 0.01:
#   - Open MPI's MPI_Allreduce (dense; mpi-allreduce-perf under mpirun, shared memory),
#   - Gloo's ring all-reduce (gloo-allreduce-perf, TCP on loopback; skipped when not built,
#     unless REQUIRE_PEERS names it),
#   - SCAPE dense (scape-perf), SCAPE masked (scape-perf --mode mask: scapeAllReduce with an
#     agreed mask, dense in and out; and --mode mask-packed: scapeMaskAllReducePacked, the same
#     exchange on the k packed values, without the gather/scatter), the COO sparse baseline
#     (scape-perf --mode coo: scapeSparseAllReduce, list in and out),
#   - the mask-sync table (scape-perf --mask-sync: bytes per parameter per encoding, sync
#     time, fraction hidden behind an equal compute phase),
#   - the limits: memcpy bandwidth of one rank (scape-perf --mode memcpy) and the transport's
#     loopback bandwidth and latency (ucx_perftest tag_bw / tag_lat on 127.0.0.1, UCX devices
#     limited to lo as SCAPE's local ranks are, UCX_TLS = SCAPE_UCX_TLS when set).
# Then perf/summarize.py prints the speedups and the targets, perf/model.py the step-time model
# next to the measurement, and perf/plot draws results.png (when matplotlib is installed).
#
#   perf/compare_all.sh [BUILD_DIR [OUT_DIR]]   BUILD_DIR: <repo>/build; OUT_DIR: BUILD_DIR/perf-results
#
# Environment (defaults): RANKS ("2 4"), SIZE (256M), DENSITIES (1.0,0.1,0.01), RUN_TIMEOUT_S
# (240, per run), SCALE (1: multiplies every iteration count below), REQUIRE_PEERS ("": the
# peers, of "mpi gloo", whose absence is an error; perf/main_job.sh requires both, otherwise a
# missing peer is skipped with a note).
# Iterations (timed -n / warm-up -w; in scape-perf's sparse modes the first warm-up operation is
# the checked one), chosen so that the whole job fits in about 4 minutes on a quiet 2-core
# machine: every dense peer 3/0 (plus its untimed and its checked operation); masked all-reduce
# (both forms) 1/0 at density >= 0.5, 10/2 at density >= 0.05, 20/3 below; COO 1/0 at density
# >= 0.05, 10/2 below (with -w 0 the single timed operation is also the checked one); mask sync
# 1/0 at density >= 0.5 (auto encoding only and no idle-overlap diagnostic: at density 1 one
# sync takes seconds and the other encodings only cost more), 8/1 at density >= 0.05, 20/2 below
# (all five encodings; each iteration is a round of five timings, see scape-perf -h; how
# repeatable the overlap figures are: perf/overlap_repeat.sh). Every result is checked (-c 1);
# only the out-of-place form is timed (-I 0).
# Exit status: 0 if every run succeeded with no wrong values, else 1.
set -u

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$repo/build}
out=${2:-$build/perf-results}
RANKS=${RANKS:-"2 4"}
SIZE=${SIZE:-256M}
DENSITIES=${DENSITIES:-1.0,0.1,0.01}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}
SCALE=${SCALE:-1}
# Debian's matplotlib lives in the system interpreter, which a pyenv shim may hide.
PYTHON=${PYTHON:-python3}

scape=$build/perf/scape-perf
mpiperf=$build/perf/mpi-allreduce-perf
glooperf=$build/perf/gloo-allreduce-perf
if [ ! -x "$scape" ]; then
  echo "compare_all.sh: $scape not found; build it with cmake --build $build --target scape-perf" >&2
  exit 1
fi
REQUIRE_PEERS=${REQUIRE_PEERS:-}
# A required peer that is missing fails the run at once, before minutes of measurements.
for peer in $REQUIRE_PEERS; do
  case $peer in
    mpi)
      [ -x "$mpiperf" ] || { echo "compare_all.sh: ERROR: required peer mpi: $mpiperf not built" >&2; exit 1; }
      command -v mpirun >/dev/null 2>&1 ||
        { echo "compare_all.sh: ERROR: required peer mpi: mpirun not found (openmpi-bin)" >&2; exit 1; } ;;
    gloo)
      [ -x "$glooperf" ] ||
        { echo "compare_all.sh: ERROR: required peer gloo: $glooperf not built (libgloo-dev)" >&2; exit 1; } ;;
    *) echo "compare_all.sh: ERROR: REQUIRE_PEERS: unknown peer '$peer' (mpi, gloo)" >&2; exit 1 ;;
  esac
done
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.out "$out"/*.err "$out"/results.png

# iters MODE DENSITY: "-n N -w W" for one row (see the header).
iters() {
  awk -v m="$1" -v d="$2" -v s="$SCALE" 'BEGIN {
    if (m == "dense") { n = 3; w = 0 }
    else if (m == "mask") { if (d >= 0.5) { n = 1; w = 0 } else if (d >= 0.05) { n = 10; w = 2 }
                            else { n = 20; w = 3 } }
    else if (m == "coo") { if (d >= 0.05) { n = 1; w = 0 } else { n = 10; w = 2 } }
    else { if (d >= 0.5) { n = 1; w = 0 } else if (d >= 0.05) { n = 8; w = 1 } else { n = 20; w = 2 } }
    n = int(n * s + 0.5); if (n < 1) n = 1; w = int(w * s + 0.5)
    printf "-n %d -w %d", n, w }'
}
# group MODE: the densities of DENSITIES that share one iteration setting, one group per line.
group() {
  local m=$1 d
  for d in $(echo "$DENSITIES" | tr ',' ' '); do echo "$(iters "$m" "$d") $d"; done |
    awk '{ k = $1 " " $2 " " $3 " " $4; if (!(k in g)) o[++n] = k; g[k] = g[k] (g[k] ? "," : "") $5 }
         END { for (i = 1; i <= n; i++) print o[i] "|" g[o[i]] }'
}

# shellcheck disable=SC2054  # "self,vader" is one argument
mpirun_cmd=(mpirun --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader
  --mca oob_tcp_if_include lo)
[ "$(id -u)" = 0 ] && mpirun_cmd+=(--allow-run-as-root)

status=0
watchdog=$((RUN_TIMEOUT_S > 20 ? RUN_TIMEOUT_S - 10 : RUN_TIMEOUT_S))

# run NAME CMD...: runs CMD (stdout to $out/NAME.out, also shown), notes a failure.
run() {
  local name=$1
  shift
  local t0=$SECONDS rc=0
  echo "######## $name: $*"
  timeout --kill-after=10 "$RUN_TIMEOUT_S" "$@" >"$out/$name.out" 2>"$out/$name.err" || rc=$?
  grep -v '^#  Rank\|^# Using ranks' "$out/$name.out"
  if [ "$rc" != 0 ]; then
    status=1
    if [ "$rc" = 124 ]; then
      echo "compare_all.sh: '$*' was stopped after ${RUN_TIMEOUT_S} s (RUN_TIMEOUT_S)" >&2
    elif [ "$rc" = 137 ]; then
      echo "compare_all.sh: '$*' was killed (SIGKILL: the run timeout, or out of memory)" >&2
    else
      echo "compare_all.sh: '$*' exited with status $rc" >&2
    fi
    sed 's/^/    /' "$out/$name.err" | tail -20 >&2
  fi
  echo "# ($name: $((SECONDS - t0)) s)"
  echo
}

# ---- limits -----------------------------------------------------------------------------
run limits_memcpy "$scape" -b "$SIZE" -e "$SIZE" -n 5 -w 1 --mode memcpy -J "$out/limits_memcpy.json" \
  -W "$watchdog"

# ucx_perftest between two processes on 127.0.0.1: a server, then the client (retried while the
# server is not listening yet). Prints the client's output.
ucx_pair() {
  local port=$((20000 + RANDOM % 20000)) spid rc=1 _
  env UCX_NET_DEVICES=lo ${SCAPE_UCX_TLS:+UCX_TLS=$SCAPE_UCX_TLS} UCX_WARN_UNUSED_ENV_VARS=n \
    timeout 60 ucx_perftest -p "$port" >/dev/null 2>&1 &
  spid=$!
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    sleep 0.3
    if env UCX_NET_DEVICES=lo ${SCAPE_UCX_TLS:+UCX_TLS=$SCAPE_UCX_TLS} UCX_WARN_UNUSED_ENV_VARS=n \
      timeout 60 ucx_perftest 127.0.0.1 -p "$port" "$@" 2>&1; then
      rc=0
      break
    fi
  done
  kill "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null
  return $rc
}
ucx_bw=null
ucx_lat=null
if command -v ucx_perftest >/dev/null 2>&1; then
  echo "######## limits_ucx: ucx_perftest tag_bw (16 MiB) and tag_lat (8 B) on 127.0.0.1"
  ucx_pair -t tag_bw -s 16777216 -n 100 -w 10 >"$out/limits_ucx_bw.out" || true
  ucx_pair -t tag_lat -s 8 -n 20000 -w 1000 >"$out/limits_ucx_lat.out" || true
  # "Final: iters p50 avg overall bw_avg bw_overall ..." (UCX's MB is 2^20 bytes).
  mbs=$(awk '/^Final:/ { print $7 }' "$out/limits_ucx_bw.out")
  lat=$(awk '/^Final:/ { print $4 }' "$out/limits_ucx_lat.out")
  [ -n "$mbs" ] && ucx_bw=$(awk -v m="$mbs" 'BEGIN { printf "%.4f", m * 1048576 / 1e9 }')
  [ -n "$lat" ] && ucx_lat=$lat
  echo "# transport (UCX tag, loopback): bandwidth $ucx_bw GB/s, one-way latency $ucx_lat us"
  echo
else
  echo "# ucx_perftest not found (apt-get install ucx-utils): no transport limit"
fi
cat >"$out/limits.json" <<EOF
{"transport_bw_gbs": $ucx_bw, "transport_lat_us": $ucx_lat, "transport": "ucx_perftest tag_bw/tag_lat, 127.0.0.1, UCX_NET_DEVICES=lo, UCX_TLS=${SCAPE_UCX_TLS:-default}"}
EOF

# ---- the peers, per rank count --------------------------------------------------------------
# shellcheck disable=SC2207
dense_args=(-b "$SIZE" -e "$SIZE" $(iters dense 1) -I 0)
for n in $RANKS; do
  if [ -x "$mpiperf" ] && command -v mpirun >/dev/null 2>&1; then
    run "mpi_dense_np$n" "${mpirun_cmd[@]}" -np "$n" "$mpiperf" "${dense_args[@]}" \
      -J "$out/mpi_dense_np$n.json"
  else
    echo "# Open MPI: skipped (mpi-allreduce-perf not built or mpirun missing)"
  fi
  if [ -x "$glooperf" ]; then
    run "gloo_dense_np$n" "$glooperf" -np "$n" "${dense_args[@]}" -W "$watchdog" \
      -J "$out/gloo_dense_np$n.json"
  else
    echo "# Gloo: skipped (gloo-allreduce-perf not built: install libgloo-dev and re-run cmake)"
  fi
  run "scape_dense_np$n" "$scape" -np "$n" "${dense_args[@]}" -W "$watchdog" \
    -J "$out/scape_dense_np$n.json"
  for mode in mask mask-packed coo masksync; do
    kind=$mode
    [ "$mode" = mask-packed ] && kind=mask
    i=0
    while IFS='|' read -r it ds; do
      [ -n "$ds" ] || continue
      # The packed form is the exchange alone: only below density 1 is it of interest.
      if [ "$mode" = mask-packed ]; then
        ds=$(echo "$ds" | tr ',' '\n' | awk '$1 + 0 < 1' | paste -sd, -)
        [ -n "$ds" ] || continue
      fi
      i=$((i + 1))
      name="scape_${mode//-/_}_np${n}_$i"
      extra=()
      if [ "$mode" = masksync ] && [ "$(echo "$ds" | awk -F, '{ print ($1 + 0 >= 0.5) }')" = 1 ]; then
        extra=(--encoding auto --sync-idle 0)
      fi
      # shellcheck disable=SC2086
      run "$name" "$scape" -np "$n" --mode "$mode" -D "$ds" -b "$SIZE" -e "$SIZE" $it -I 0 \
        "${extra[@]}" -W "$watchdog" -J "$out/$name.json"
    done < <(group "$kind")
  done
done

for f in "$out"/*.out; do
  if grep -q 'Out of bounds values : [1-9]' "$f"; then
    echo "compare_all.sh: wrong values in $(basename "$f" .out)" >&2
    status=1
  fi
done

# ---- summary, model, plot ---------------------------------------------------------------------
echo "######## summary"
"$PYTHON" "$repo/perf/summarize.py" "$out" || status=1
echo
echo "######## step-time model (perf/model.py)"
"$PYTHON" "$repo/perf/model.py" --local "$out" || status=1
echo
"$repo/perf/plot" -o "$out/results.png" "$out"/*.json ||
  echo "# plot: skipped (perf/plot needs python3-matplotlib)"
exit "$status"
