#!/usr/bin/env bash
# Reproduces perf/RESULTS_training.md: installs what is missing, builds the library, trains the
# byte-level GPT of perf/train on 4 local ranks (launched by scape.launch from RANK /
# WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as torchrun would), every configuration of the plan
# one after the other, then writes perf/train/out/val_loss.png and perf/train/out/table.md and
# (plan full) replaces the generated section of perf/RESULTS_training.md.
#   bash perf/train/run.sh                 # the experiment (plan full, estimated ~35 min on 2 cores)
#   PLAN=tiny bash perf/train/run.sh       # every code path in a few steps (~30 s)
#   BUILD_DIR=... OUT=... NPROC=... also apply
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAN=${PLAN:-full}
OUT=${OUT:-perf/train/out}
NPROC=${NPROC:-4}
source perf/train/setup_env.sh
lscpu | grep -E "^(Model name|CPU\(s\))" || true
start=$(date +%s)
/usr/bin/python3 -m scape.launch -n "$NPROC" --timeout 3600 perf/train/train.py --plan "$PLAN" --out "$OUT"
echo "run.sh: training took $(( $(date +%s) - start )) s"
if [ "$PLAN" = full ] && [ "$NPROC" = 4 ]; then
  /usr/bin/python3 perf/train/summarize.py "$OUT" --results perf/RESULTS_training.md
else
  /usr/bin/python3 perf/train/summarize.py "$OUT"
fi
