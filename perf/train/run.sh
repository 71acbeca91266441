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
BUILD_DIR=${BUILD_DIR:-build}
PLAN=${PLAN:-full}
OUT=${OUT:-perf/train/out}
NPROC=${NPROC:-4}
bash tests/install_deps.sh
cmake -B "$BUILD_DIR" -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 ||
  { cat "$BUILD_DIR.cmake.log"; exit 1; }
rm -f "$BUILD_DIR.cmake.log"
cmake --build "$BUILD_DIR" -j2 --target nccl-net-scape
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 SCAPE_SOCKET_IFNAME=${SCAPE_SOCKET_IFNAME:-lo}
lscpu | grep -E "^(Model name|CPU\(s\))" || true
start=$(date +%s)
/usr/bin/python3 -m scape.launch -n "$NPROC" --timeout 3600 perf/train/train.py --plan "$PLAN" --out "$OUT"
echo "run.sh: training took $(( $(date +%s) - start )) s"
if [ "$PLAN" = full ] && [ "$NPROC" = 4 ]; then
  /usr/bin/python3 perf/train/summarize.py "$OUT" --results perf/RESULTS_training.md
else
  /usr/bin/python3 perf/train/summarize.py "$OUT"
fi
