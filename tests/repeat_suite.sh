#!/usr/bin/env bash
# Runs the README's test command (tests/run_all.sh) N times in a row in this checkout and stops
# at the first failure. The first run builds everything; later runs reuse the trees (the
# builds are no-ops), so each repeat is the test phases: release ctest, ASan+UBSan ctest, the
# TSan subset and the fuzz smoke. Meant for a clean clone:
#   git clone <repo> /tmp/soak && bash /tmp/soak/tests/repeat_suite.sh 20
# Each run's log goes to repeat-logs/run-N.log (ignored by git); a summary line per run to
# stdout and repeat-logs/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-20}
mkdir -p repeat-logs
: > repeat-logs/summary.txt
echo "repeat_suite: $n runs of tests/run_all.sh at $(git rev-parse --short HEAD) on $(hostname), $(nproc) cores" |
  tee -a repeat-logs/summary.txt
for i in $(seq 1 "$n"); do
  t0=$(date +%s)
  bash tests/run_all.sh > "repeat-logs/run-$i.log" 2>&1
  rc=$?
  line="run $i/$n: rc=$rc, $(($(date +%s) - t0)) s, ended $(date -u +%H:%M:%S)"
  echo "$line" | tee -a repeat-logs/summary.txt
  if [ $rc -ne 0 ]; then
    echo "repeat_suite: run $i failed; its log is repeat-logs/run-$i.log" | tee -a repeat-logs/summary.txt
    grep -n "FAILED\|Failed\|\*\*\*" "repeat-logs/run-$i.log" | head -40
    exit 1
  fi
done
echo "repeat_suite: $n of $n runs passed" | tee -a repeat-logs/summary.txt
