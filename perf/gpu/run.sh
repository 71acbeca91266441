#!/usr/bin/env bash
# perf/gpu/run.sh: the one command on a GPU machine (see perf/gpu/README.md). Every check of the
# GPU path, then the end-to-end training timing, within 540 s on one H100, from the two bundles
# built on a CPU machine:
#
#   bash perf/gpu/gpu_bundle.sh .gpu-bundle              # here: the C programs + libraries
#   bash perf/gpu/gpu_train.sh bundle .gpu-train-bundle  # here: the wheel + libraries + corpus
#   bash perf/gpu/run.sh [.gpu-bundle] [.gpu-train-bundle]   # there
#   GPU_RUN_DRY=1 bash perf/gpu/run.sh ...               # here: prints the plan, runs nothing
#
# Parts, each under its own timeout (the arithmetic is in perf/gpu/README.md):
#   preflight  ~5 s: the driver (nvidia-smi), NCCL (libnccl.so.2), torch with CUDA, the
#              bundles; if one is missing: one line "gpu run: cannot run: missing ..." and exit 2
#   checks     165 s at most: perf/gpu/gpu_check.sh on the bundle (DEVICE_N 16 Mi, ITERS 10):
#              packaging, cuda-kernels, device-data-path, kernel-timings, optimizer-on-device
#   train      345 s at most: perf/gpu/gpu_train.sh run (BUDGET_S 320): the allocator check
#              (perf/gpu/gpu_alloc_check.py: alloc-torch, alloc-library), the step benchmark
#              (128 Mi parameters, 80 s) and the training runs (dense AdamS, SCAPE 0.1 / 0.01,
#              AdamW; 100 steps, each truncated to its share of the time left)
# It ends with one "PASS name" / "FAIL name: why" line per check and the path of a JSON of the
# figures ($OUT/gpu_run.json: the checks, gpu_check.sh's RESULT lines, the allocator figures,
# the step rows and the training runs). Exit 0 when every check passed. Never needs the network.
#
# Environment: OUT (perf/out/gpu_run), CHECK_S (165), TRAIN_S (345), and what the two scripts
# take (PARAMS, STEPS, VARIANT, NCCL_LIBRARY_DIR, PYTHON, ...).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/perf/gpu
cb=${1:-$root/.gpu-bundle}
tb=${2:-$root/.gpu-train-bundle}
out=${OUT:-$root/perf/out/gpu_run}
check_s=${CHECK_S:-165}
train_s=${TRAIN_S:-345}
py=${PYTHON:-python3}
start=$(date +%s)

if [ "${GPU_RUN_DRY:-0}" = 1 ]; then
  echo "gpu run (dry): check bundle $cb, train bundle $tb, figures -> $out"
  echo "  checks: GPU_CHECK_BUNDLE=$cb DEVICE_N=16777216 ITERS=10 BUDGET_S=$((check_s - 15)) timeout $check_s bash $here/gpu_check.sh"
  echo "  train:  ALLOC_CHECK=1 BUDGET_S=$((train_s - 25)) STEP_BUDGET_S=80 PARAMS=134217728 STEPS=100 VARIANT= timeout $train_s bash $here/gpu_train.sh run $tb"
  echo "  total at most: 10 + $check_s + $train_s = $((10 + check_s + train_s)) s"
  [ $((10 + check_s + train_s)) -le 540 ] || { echo "gpu run (dry): over 540 s"; exit 1; }
  for d in "$cb" "$tb"; do [ -d "$d" ] || echo "  (no $d here yet)"; done
  exit 0
fi

# ---- preflight: what is missing, in one line ---------------------------------------------------
missing=()
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ||
  missing+=("an NVIDIA driver (nvidia-smi lists no GPU)")
nccl=${NCCL_LIBRARY_DIR:-}
if [ -z "$nccl" ]; then
  nccl=$( ("$py" -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null |
           xargs -r -I{} find {} -name 'libnccl.so.2' 2>/dev/null
           find /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /opt /usr/local -name 'libnccl.so.2' 2>/dev/null) | head -1)
  [ -n "$nccl" ] && nccl=$(dirname "$nccl")
fi
[ -n "$nccl" ] || missing+=("NCCL (no libnccl.so.2; set NCCL_LIBRARY_DIR)")
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 ||
  missing+=("torch with CUDA ($py -c 'import torch; torch.cuda.is_available()')")
[ -d "$cb/bin" ] || missing+=("the check bundle $cb (bash perf/gpu/gpu_bundle.sh)")
[ -d "$tb/dist" ] || missing+=("the train bundle $tb (bash perf/gpu/gpu_train.sh bundle)")
if [ ${#missing[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${missing[@]}")
  echo "gpu run: cannot run: missing ${msg%; }"
  exit 2
fi
export NCCL_LIBRARY_DIR=$nccl
cb=$(cd "$cb" && pwd)
tb=$(cd "$tb" && pwd)
rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)
checks=$out/checks.txt
: >"$checks"

# ---- checks ----------------------------------------------------------------------------------------
echo "== checks (at most $check_s s)"
CHECKS=$checks FIGURES=$out/gpu_figures.md GPU_CHECK_BUNDLE=$cb DEVICE_N=16777216 ITERS=10 \
  BUDGET_S=$((check_s - 15)) timeout -k 5 "$check_s" bash "$here/gpu_check.sh" \
  >"$out/gpu_check.log" 2>&1
rc=$?
[ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "FAIL checks: gpu_check.sh ran past $check_s s" >>"$checks"
grep -q . "$checks" || echo "FAIL checks: gpu_check.sh reported nothing (log: $out/gpu_check.log)" >>"$checks"

# ---- allocator check and training timing -----------------------------------------------------------
echo "== train (at most $train_s s, $(( $(date +%s) - start )) s in)"
n0=$(wc -l <"$checks")
CHECKS=$checks ALLOC_CHECK=1 ALLOC_JSON=$out/alloc.json OUT=$out/train BUDGET_S=$((train_s - 25)) \
  STEP_BUDGET_S=${STEP_BUDGET_S:-80} PARAMS=${PARAMS:-134217728} STEPS=${STEPS:-100} \
  VARIANT=${VARIANT-} timeout -k 10 "$train_s" bash "$here/gpu_train.sh" run "$tb" >"$out/gpu_train.log" 2>&1
rc=$?
[ "$(wc -l <"$checks")" -gt "$n0" ] || echo "FAIL alloc: gpu_alloc_check.py reported nothing" >>"$checks"
if [ $rc -eq 0 ]; then echo "PASS train" >>"$checks"
elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "FAIL train: ran past $train_s s" >>"$checks"
else echo "FAIL train: gpu_train.sh exited $rc (log: $out/gpu_train.log)" >>"$checks"; fi

# ---- the figures, one JSON ---------------------------------------------------------------------------
"$py" - "$out" "$(( $(date +%s) - start ))" <<'EOF' || echo "gpu run: could not write $1/gpu_run.json"
import json, os, re, sys
out, seconds = sys.argv[1], int(sys.argv[2])
def lines(path):
    try:
        with open(path) as f:
            return [l.rstrip("\n") for l in f]
    except OSError:
        return []
def jsonl(path):
    return [json.loads(l) for l in lines(path) if l.strip()]
checks = {}
for l in lines(os.path.join(out, "checks.txt")):
    m = re.match(r"(PASS|FAIL) (\S+?):?( (.*))?$", l)
    if m:
        checks[m.group(2)] = {"pass": m.group(1) == "PASS", "why": m.group(4) or ""}
results = [l.split(None, 1)[1] for l in lines(os.path.join(out, "gpu_figures.md"))
           if l.startswith("RESULT ")]
try:
    alloc = json.load(open(os.path.join(out, "alloc.json")))
except (OSError, ValueError):
    alloc = None
try:
    meta = json.load(open(os.path.join(out, "train", "meta.json")))
except (OSError, ValueError):
    meta = None
doc = {"seconds": seconds, "checks": checks, "gpu_check_results": results, "alloc": alloc,
       "step_bench": jsonl(os.path.join(out, "train", "step_bench.jsonl")),
       "train_runs": jsonl(os.path.join(out, "train", "train_runs.jsonl")), "train_meta": meta}
with open(os.path.join(out, "gpu_run.json"), "w") as f:
    json.dump(doc, f, indent=1)
EOF

echo "== summary ($(( $(date +%s) - start )) s; logs and figures in $out)"
cat "$checks"
echo "figures: $out/gpu_run.json"
! grep -q '^FAIL' "$checks"
