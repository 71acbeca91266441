#!/usr/bin/env bash
# The scaling study of issue 23 (perf/train/scaling.py): every model size of the plan, every
# configuration, 4 local ranks, into OUT (default perf/train/out-scaling), then the summary
# (perf/train/scaling_summary.py: tables and PNGs in OUT, and the generated scaling section of
# perf/RESULTS_training.md). Resumable: runs already in OUT/runs.jsonl are skipped, so the same
# command continues an interrupted study. Long: run it in the background, e.g.
#   nohup bash perf/train/run_scaling.sh > perf/train/out-scaling/log.txt 2>&1 &
#   PLANS="cpu cpu-xl" bash perf/train/run_scaling.sh   # also the size beyond the budget
#   PLANS=smoke OUT=/tmp/s NPROC=2 bash perf/train/run_scaling.sh   # every code path, ~30 s
# BUILD_DIR, OUT, NPROC, PLANS, SKIP_BUILD=1, DEVICE (cpu | cuda) also apply.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLANS=${PLANS:-cpu}
OUT=${OUT:-perf/train/out-scaling}
NPROC=${NPROC:-4}
DEVICE=${DEVICE:-cpu}
source perf/train/setup_env.sh
# the machine may be shared: give a slow step more than the default 120 s before a deadline
export SCAPE_TIMEOUT_MS=${SCAPE_TIMEOUT_MS:-600000}
mkdir -p "$OUT"
lscpu | grep -E "^(Model name|CPU\(s\))" || true
for plan in $PLANS; do
  start=$(date +%s)
  /usr/bin/python3 -m scape.launch -n "$NPROC" --timeout 172800 perf/train/scaling.py \
    --plan "$plan" --out "$OUT" --device "$DEVICE"
  echo "run_scaling.sh: plan $plan took $(( $(date +%s) - start )) s"
done
if [ "$OUT" = perf/train/out-scaling ]; then
  /usr/bin/python3 perf/train/scaling_summary.py "$OUT" --results perf/RESULTS_training.md
else
  /usr/bin/python3 perf/train/scaling_summary.py "$OUT"
fi
