#!/usr/bin/env bash
# The density-schedule study of docs/ALGORITHM.md 4.10a (issue 42 item 3), as one resumable
# command: every finished run is a line of perf/train/out-sched/probe.jsonl and is skipped when
# the command runs again. It prints its CPU estimate before it starts.
#
#   bash perf/train/run_sched.sh            # the recorded grid: 2-3 seeds per point (~55 CPU-min)
#   SHORT=1 bash perf/train/run_sched.sh    # one point of the table (density 0.01, no ramp
#                                           # against a 100-step ramp, seed 1; under 10 minutes
#                                           # on a free core), into out-sched-short
#   LIB=1 bash perf/train/run_sched.sh      # adds the two library runs (2 ranks each)
set -euo pipefail
cd "$(dirname "$0")/../.."
SKIP_BUILD=${SKIP_BUILD:-1} . perf/train/setup_env.sh
PY=${PYTHON:-/usr/bin/python3}
RUN="nice -n 10 $PY perf/train/sched_probe.py"
PER_RUN_CPU_S=85   # one 1000-step run of the simulation, measured on the development VM
if [ "${SHORT:-0}" = 1 ]; then
  OUT=perf/train/out-sched-short
  echo "run_sched.sh SHORT: 2 runs, about $((2 * PER_RUN_CPU_S / 60 + 1)) CPU-minutes"
  $RUN --out "$OUT" --warmup 0 100 --seeds 1
  $PY perf/train/sched_probe.py --out "$OUT" --summary
  echo "recorded (seed 1): none 2.5275, geometric 100 2.8397 (docs/ALGORITHM.md 4.10a)"
  exit 0
fi
RUNS=41
echo "run_sched.sh: $RUNS simulation runs, about $((RUNS * PER_RUN_CPU_S / 60)) CPU-minutes" \
     "(finished runs in perf/train/out-sched/probe.jsonl are skipped)"
$RUN --warmup 0 100 300 700 --seeds 1 2
$RUN --warmup 100 --fix leave-drop --seeds 1 2
$RUN --schedule linear --warmup 100 --seeds 1 2
$RUN --density 0.1 --warmup 0 700 --seeds 1 2
$RUN --density 1.0 --warmup 0 --seeds 1 2
$RUN --lr-warmup 100 --warmup 0 100 --seeds 1 2
# the lr warm-up's table of docs/ALGORITHM.md 4.10a (2026-12-08): a third seed, the other ramps
# and dense AdamS with the same 100-step lr warm-up
$RUN --warmup 0 100 --seeds 3
$RUN --lr-warmup 100 --warmup 0 100 --seeds 3
$RUN --lr-warmup 100 --warmup 300 700 --seeds 1 2 3
$RUN --lr-warmup 100 --density 0.1 --warmup 0 700 --seeds 1 2
$RUN --lr-warmup 100 --density 1.0 --warmup 0 --seeds 1 2 3
$RUN --warmup 0 100 --seeds 1 --stop 200 --out perf/train/out-sched/drift
if [ "${LIB:-0}" = 1 ]; then
  for w in 0 100; do
    nice -n 10 $PY -m scape.launch -n 2 perf/train/sched_lib.py --warmup "$w" --seed 1
  done
fi
$PY perf/train/sched_probe.py --summary
