#!/usr/bin/env bash
# The quality study of issue 30, one command, resumable (perf/train/scaling.py, plans q20 then
# the two axes; README "Model quality", perf/RESULTS_training.md):
#   q20      the lr of every method at 20 tokens per parameter (0.12M params, seed 1, grids of 5+
#            points spaced 2x, extended until the best is interior), then 3 seeds at the best lr,
#            the peers at matched steady-state bytes (PowerSGD-EF, top-k + EF, 3 seeds) and the
#            screen of the options (clip_norm=staying, bias_correction=artifact, segment_rms,
#            local clipping, each alone; artifact + local clipping stacked; 2 seeds)
#   q-lenT   0.12M at T = 2, 5, 10, 40 tokens per parameter, dense AdamS and SCAPE 0.1 / 0.01 at
#            q20's lr, 3 seeds, seed-major, then the options the screen kept (scaling.py KEPT_Q:
#            bias_correction=artifact, local clipping and their stack at 0.1), 3 seeds; at T = 2
#            and 40 also q20's lr re-checked (half and twice it, seed 1)
#   q-size   0.02M, 0.036M, 0.07M at 20 tokens per parameter (with q20's 0.12M: 4 sizes), the
#            same (the peers run at the largest size, q20's)
# FULL=1 adds what does not fit 6 CPU-hours: the size 0.37M in q-size (seed-major, so that a
# study cut short there has every method's first seeds), PowerSGD-EF at each size's SCAPE
# steady-state bytes (3 seeds) and plan q20-more (the screen's further checks: segment_rms +
# staying clip norm, no clipping, tighter clips, the payload's type, the library's own local
# clipping, the same-seed noise floor; 2 seeds).
# Cost, estimated before starting (scaling.py --dry-run: each plan's runs x the median CPU time
# of the recorded runs of its size and length, 4 ranks on 2 cores): q20 2.58, q-len2 0.14,
# q-len5 0.23, q-len10 0.49, q-len40 1.80, q-size 0.65 CPU-hours: 5.9 CPU-hours by default;
# FULL=1 adds q20-more 1.0, the small sizes' peers 0.2 and 0.37M 5.85: about 13.
# Every run is one line of OUT/runs.jsonl; a rerun skips what is there, so the same command
# continues an interrupted study. 4 local ranks, one thread each; the same tokens per step
# (4 sequences of 64 per rank) at every point. Then perf/train/quality_summary.py prints the
# tables (OUT/summary.md).
#   bash perf/train/run_quality.sh                      # the whole study, hours: run it with nohup
#   PLANS=q20 bash perf/train/run_quality.sh            # one plan
#   SHORT=1 bash perf/train/run_quality.sh              # < 10 min: one point of each table
#                                                       # (length, size, peers, options, kept
#                                                       # options; seed 1) rerun beside what
#                                                       # OUT recorded
#   FULL=1 bash perf/train/run_quality.sh               # + 0.37M and q20-more (~13 CPU-hours)
# BUILD_DIR, OUT, NPROC, PLANS, SIZES (of q-size), SKIP_BUILD=1 also apply.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-perf/train/out-quality}
NPROC=${NPROC:-4}
if [ "${FULL:-0}" = 1 ]; then
  PLANS=${PLANS:-"q20 q-len2 q-len5 q-len10 q-len40 q-size q20-more"}
  SIZES=${SIZES:-"d24L2 d32L2 d48L2 d96L3"}
  qsize_peers=()
else
  PLANS=${PLANS:-"q20 q-len2 q-len5 q-len10 q-len40 q-size"}
  SIZES=${SIZES:-"d24L2 d32L2 d48L2"}
  qsize_peers=(--peers)  # none
fi
source perf/train/setup_env.sh
export SCAPE_TIMEOUT_MS=${SCAPE_TIMEOUT_MS:-600000}  # a shared machine: slow steps are no hang
mkdir -p "$OUT"
if [ "${SHORT:-0}" = 1 ]; then
  # One point of each table rerun into a scratch folder holding OUT's q20 sweep (for the lr),
  # then compared with what OUT recorded: the length table (2 tokens per parameter, dense
  # AdamS and SCAPE 0.01), the size table, the peers and the kept options (0.022M: dense
  # AdamS, SCAPE 0.1, PowerSGD-EF at its bytes, the kept stack), the options screen (local
  # clipping at 0.12M / 20 tokens per parameter, whose method's seed 1 is the sweep's run).
  # All seed 1; about 7 CPU-minutes.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  [ -f "$OUT/runs.jsonl" ] && grep '"stage": "sweep"' "$OUT/runs.jsonl" > "$tmp/runs.jsonl" || true
  run() { /usr/bin/python3 -m scape.launch -n "$NPROC" --timeout 3600 perf/train/scaling.py \
            --out "$tmp" --seeds 1 "$@"; }
  run --plan q-len2 --only adams scape-0.01
  run --plan q-size --sizes d24L2 --peers powersgd@0.1 \
      --only adams scape-0.1 powersgd@0.1 scape-0.1-artifact-localclip
  run --plan q20 --variant-seeds 1 --only scape-0.1-localclip
  /usr/bin/python3 - "$OUT" "$tmp" <<'PY'
import json, sys
def rows(d):
    try:
        return [json.loads(l) for l in open(d + "/runs.jsonl") if l.strip()]
    except OSError:
        return []
old, new = rows(sys.argv[1]), rows(sys.argv[2])
if not [r for r in new if r["stage"] != "sweep"]:
    print("short: nothing to rerun yet: q-len2 takes its lr from the q20 sweep, which is not "
          "finished in " + sys.argv[1])
for r in new:
    if r["stage"] == "sweep":
        continue
    same = [o["final_val_loss"] for o in old if o["key"] == r["key"]]
    seeds = [o["final_val_loss"] for o in old if o["group"] == r["group"] and
             o["steps"] == r["steps"] and o["lr"] == r["lr"] and o["size"] == r["size"]]
    spread = (max(seeds) - min(seeds)) if len(seeds) > 1 else float("nan")
    near = ("within it" if abs(r["final_val_loss"] - same[0]) <= spread else "OUTSIDE it") \
        if same and spread == spread else "no spread to compare"
    print(f"short: {r['size']} {r['group']} {r['tokens_per_param']:.0f} tokens/param lr "
          f"{r['lr']:g}: {r['final_val_loss']:.4f} now, recorded "
          f"{same[0] if same else 'none'} (seed spread {spread:.4f}: {near})")
PY
  exit 0
fi
lscpu | grep -E "^(Model name|CPU\(s\))" || true
# The estimate first (whole plans, done or not, from what OUT recorded).
plan_args() {  # sets args: q-size's sizes and peers (none for the other plans)
  args=()
  if [ "$1" = q-size ]; then
    read -r -a args <<<"$SIZES"
    args=(--sizes "${args[@]}" "${qsize_peers[@]}")
  fi
}
for plan in $PLANS; do
  plan_args "$plan"
  echo "estimate $plan: $(/usr/bin/python3 perf/train/scaling.py --plan "$plan" --out "$OUT" \
    --world "$NPROC" "${args[@]}" --dry-run | tail -1)"
done
for plan in $PLANS; do
  start=$(date +%s)
  plan_args "$plan"
  /usr/bin/python3 -m scape.launch -n "$NPROC" --timeout 172800 perf/train/scaling.py \
    --plan "$plan" --out "$OUT" "${args[@]}"
  echo "run_quality.sh: plan $plan took $(( $(date +%s) - start )) s"
done
/usr/bin/python3 perf/train/quality_summary.py "$OUT" --md "$OUT/summary.md"
