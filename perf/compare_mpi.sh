#!/usr/bin/env bash
# Compares scape-perf (SCAPE comm all-reduce, float sum) with Open MPI's MPI_Allreduce
# (mpi-allreduce-perf) on this host, for 2 and 4 ranks, 1 MiB to 256 MiB, step factor 2.
#
#   perf/compare_mpi.sh [BUILD_DIR]      BUILD_DIR defaults to <repo>/build
#
# Everything stays on this host: SCAPE's ranks are forked by scape-perf -np N and bootstrap on
# loopback; Open MPI is limited to its shared-memory (vader) and self transports, with its
# runtime on loopback, so no network is needed.
#
# Each table is measured in two runs to fit a small machine's time budget: 1 MiB - 8 MiB with
# -n $ITERS_SMALL -w $WARMUP_SMALL, then 16 MiB - 256 MiB with -n $ITERS_LARGE -w $WARMUP_LARGE
# (environment overrides; defaults 20/5 and 5/1). Results are checked (-c 1). The script then
# prints, per size >= 16 MiB, the ratio of bus bandwidths scape / MPI (out-of-place and
# in-place). Exit status: 0 if every run succeeded with no wrong values, 1 otherwise.
set -u

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$repo/build}
ITERS_SMALL=${ITERS_SMALL:-20}
WARMUP_SMALL=${WARMUP_SMALL:-5}
ITERS_LARGE=${ITERS_LARGE:-5}
WARMUP_LARGE=${WARMUP_LARGE:-1}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-240}  # per run: a stuck run is killed, the script goes on
RANKS=${RANKS:-"2 4"}

scape=$build/perf/scape-perf
mpiperf=$build/perf/mpi-allreduce-perf
missing=0
for exe in "$scape" "$mpiperf"; do
  if [ ! -x "$exe" ]; then
    echo "compare_mpi.sh: $exe not found or not executable; build it with" >&2
    echo "  cmake --build $build --target $(basename "$exe")" >&2
    missing=1
  fi
done
if ! command -v mpirun >/dev/null 2>&1; then
  echo "compare_mpi.sh: mpirun not found (install Open MPI, e.g. apt-get install openmpi-bin)" >&2
  missing=1
fi
[ "$missing" = 0 ] || exit 1

# Open MPI on loopback / shared memory only. Running as root needs --allow-run-as-root;
# --oversubscribe lets N exceed the core count; --bind-to none matches scape-perf's unbound
# forked ranks (and avoids binding 4 ranks onto 2 cores).
mpirun_cmd=(mpirun --oversubscribe --bind-to none
  --mca pml ob1 --mca btl self,vader
  --mca oob_tcp_if_include lo)
[ "$(id -u)" = 0 ] && mpirun_cmd+=(--allow-run-as-root)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/compare_mpi.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
status=0

# run NAME CMD...: runs CMD, output to $tmp/NAME.out; notes a failure.
run() {
  local name=$1
  shift
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$RUN_TIMEOUT_S" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  if [ "$rc" != 0 ]; then
    status=1
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      echo "compare_mpi.sh: '$*' was stopped after ${RUN_TIMEOUT_S} s (RUN_TIMEOUT_S)" >&2
    else
      echo "compare_mpi.sh: '$*' exited with status $rc" >&2
    fi
    sed 's/^/    /' "$tmp/$name.err" | tail -20 >&2
  fi
  echo "# ($name: $((SECONDS - t0)) s)" >>"$tmp/$name.out"
}

# merge A B: one nccl-tests table from the small-size run A and the large-size run B: A's
# header, the data lines of both, and a footer recomputed over all lines.
merge() {
  local a=$1 b=$2
  awk '/^#/ && !/Out of bounds|Avg bus bandwidth|^# \(/ && !done { print; next } !/^#/ { done = 1 }' "$a"
  grep -hv '^#' "$a" "$b" | awk '
    { print; n++; bw += $8 + $12; if ($9 != "N/A") wrong += $9; if ($13 != "N/A") wrong += $13 }
    END {
      if (n == 0) { print "# (no results)"; exit }
      printf "# Out of bounds values : %d %s\n", wrong, wrong ? "FAILED" : "OK"
      printf "# Avg bus bandwidth    : %g \n#\n", bw / (2 * n)
    }'
  grep -h '^# (' "$a" "$b"
}

for n in $RANKS; do
  run "scape$n-small" "$scape" -np "$n" -b 1M -e 8M -f 2 -n "$ITERS_SMALL" -w "$WARMUP_SMALL" \
    -W "$((RUN_TIMEOUT_S > 20 ? RUN_TIMEOUT_S - 10 : RUN_TIMEOUT_S))"
  run "scape$n-large" "$scape" -np "$n" -b 16M -e 256M -f 2 -n "$ITERS_LARGE" -w "$WARMUP_LARGE" \
    -W "$((RUN_TIMEOUT_S > 20 ? RUN_TIMEOUT_S - 10 : RUN_TIMEOUT_S))"
  run "mpi$n-small" "${mpirun_cmd[@]}" -np "$n" "$mpiperf" -b 1M -e 8M -f 2 -n "$ITERS_SMALL" \
    -w "$WARMUP_SMALL"
  run "mpi$n-large" "${mpirun_cmd[@]}" -np "$n" "$mpiperf" -b 16M -e 256M -f 2 -n "$ITERS_LARGE" \
    -w "$WARMUP_LARGE"

  echo "######## scape-perf -np $n (SCAPE comm all-reduce)"
  merge "$tmp/scape$n-small.out" "$tmp/scape$n-large.out" | tee "$tmp/scape$n.table"
  echo
  echo "######## mpirun -np $n mpi-allreduce-perf (Open MPI MPI_Allreduce)"
  merge "$tmp/mpi$n-small.out" "$tmp/mpi$n-large.out" | tee "$tmp/mpi$n.table"
  echo

  echo "######## busbw ratio scape / MPI, $n ranks, sizes >= 16 MiB"
  printf '# %10s  %9s %9s %6s  %9s %9s %6s\n' "size(B)" "oop scape" "oop mpi" "ratio" \
    "ip scape" "ip mpi" "ratio"
  awk -v min=16777216 '
    FNR == 1 { file++ }
    /^#/ { next }
    file == 1 && $1 >= min { s_oop[$1] = $8; s_ip[$1] = $12; order[++k] = $1 }
    file == 2 && $1 >= min { m_oop[$1] = $8; m_ip[$1] = $12 }
    function ratio(a, b) { return (b > 0) ? sprintf("%6.2f", a / b) : "   N/A" }
    END {
      for (i = 1; i <= k; i++) {
        s = order[i]
        if (!(s in m_oop)) { printf "  %10d  %9.2f %9s %6s  %9.2f %9s %6s\n", s, s_oop[s], "-", "-", s_ip[s], "-", "-"; continue }
        printf "  %10d  %9.2f %9.2f %s  %9.2f %9.2f %s\n", s, s_oop[s], m_oop[s], ratio(s_oop[s], m_oop[s]),
               s_ip[s], m_ip[s], ratio(s_ip[s], m_ip[s])
      }
      if (k == 0) print "# (no scape-perf results at these sizes)"
    }' "$tmp/scape$n.table" "$tmp/mpi$n.table"
  echo
done

for f in "$tmp"/*.table; do
  if grep -q 'Out of bounds values : [1-9]' "$f"; then
    echo "compare_mpi.sh: wrong values in $(basename "$f" .table)" >&2
    status=1
  fi
done
exit "$status"
