#!/usr/bin/env bash
# perf/gpu/run.sh: the one command on a GPU machine (perf/gpu/README.md). Every correctness
# check of the GPU path, then a short end-to-end training timing, within 420 s on one H100, from
# two bundles built on a CPU machine and carried:
#
#   bash perf/gpu/gpu_bundle.sh .gpu-bundle              # here: the C programs + libraries
#   bash perf/gpu/gpu_train.sh bundle .gpu-train-bundle  # here: the wheel + libraries + corpus
#   bash perf/gpu/run.sh --dry-run [BUILD] [OUTDIR]      # here: everything below against the fakes
#   bash perf/gpu/run.sh [.gpu-bundle] [.gpu-train-bundle]   # there; device tool call:
#     run(command="bash perf/gpu/run.sh .gpu-bundle .gpu-train-bundle",
#         carry=[".gpu-bundle", ".gpu-train-bundle"], timeout_s=480)
#   bash perf/gpu/run.sh --plan                          # the parts, their bounds and estimates
#
# Parts, each under its own timeout (bounds in s; the estimates and their basis: --plan):
#   preflight  15: the driver (nvidia-smi), NCCL (libnccl.so.2, a bounded search), torch with
#              CUDA, the bundles, probed at once; if one is missing: one line
#              "gpu run: cannot run: missing ..." and exit 2
#   checks     CHECK_S (290): perf/gpu/gpu_check.sh on the bundle (its header lists the checks)
#   train      TRAIN_S (105): perf/gpu/gpu_train.sh run: the allocator check (alloc-torch,
#              alloc-library), the side-stream check (stream-side) and a short step benchmark
#              (64 Mi parameters, 45 s); no training run: the checks leave no room for one in
#              420 s (bash perf/gpu/gpu_train.sh run is its own call; TRAIN_CONFIGS="scape-0.01
#              adams" with a larger TRAIN_S adds runs here)
#   report     10: the JSON
# The sum of the bounds is at most 420 s. Output: one line per check, "PASS name" or
# "FAIL name: why" (correctness only; the dry run adds "SKIP name: why" for what the fakes
# cannot run), "TIMING ..." lines (figures beside their targets, never a failure), and in $OUT
# at most 8 files, none in a subfolder (the device tool brings back 8): gpu_run.json (every
# check, timing and figure), gpu_run.log (this output, then gpu_check.sh's and gpu_train.sh's
# logs without NCCL's INFO lines), gpu_figures.md, gpu_train.md and its two plots. The per-rank
# logs stay in a folder under /tmp (not the bundle, not $OUT). Exit 0 when no check failed.
# Never needs the network.
#
# Environment: OUT (perf/out/gpu_run), CHECK_S, TRAIN_S, PYTHON (python3 there), and what the
# two scripts take (DEVICE_N, ITERS, LARGE_N, NCCL_LIBRARY_DIR, ...). --dry-run: BUNDLES=1
# also builds the two real bundles (the CUDA library and the wheel: many minutes on 2 cores)
# and checks their size; else the sizes are checked on what is there.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/perf/gpu
check_s=${CHECK_S:-290}
train_s=${TRAIN_S:-105}
pre_s=15 report_s=10
limit_s=420
device_command="bash perf/gpu/run.sh .gpu-bundle .gpu-train-bundle"
carry=(.gpu-bundle .gpu-train-bundle)
device_timeout_s=480
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

# ---- the plan: every part's estimate on one H100, and what it rests on -----------------------
# name:seconds:basis. Measured figures are from the last GPU run (an H200, bundle 8fc1dd1,
# perf/gpu/gpu_figures.md), +30% where the part is bound by HBM bandwidth (an H100's is slower);
# the checks added since have not run on a GPU: their estimates count their start-ups (a
# 2-rank UCX communicator ~1 s, an NCCL one through this plugin ~3 s: the data-path runs' ~25 s
# were mostly those) and their data.
plan=(
  "preflight:8:nvidia-smi, the NCCL search, import torch, in parallel"
  "packaging:4:measured 2 s, H200; + unpacking the bundle (~9 MB of xz)"
  "cuda-kernels:17:measured 15 s, H200; +HBM"
  "device-data-path:78:measured ~25 s a run, 3 runs, H200; +HBM on the data"
  "kernel-timings:18:measured 15 s, H200 (64 Mi floats); +HBM"
  "optimizer-on-device:42:measured ~10 s a run, 4 runs (e4m3 not measured), H200"
  "nccl-init-rank:6:1 NCCL init, 4 collectives, 5 steps of 256 Ki"
  "mixed-precision:8:1 UCX + 1 NCCL init, 2x8 steps of 256 Ki"
  "fp8-over-nccl:5:1 NCCL init, 5 steps"
  "teardown-order:20:5 UCX + 4 NCCL inits (4 orders x 2 backends, then UCX), small work"
  "abort-during-step:10:2 UCX + 1 NCCL inits, steps of 256 Ki until the watchdog's 20 ms"
  "abort-race:16:5 NCCL inits + 1 UCX, all-reduces of 256 Ki until 0-7 ms"
  "host-wait-deadline:14:4 UCX inits, 3 calls that must time out at 2 s"
  "device-pool:4:1 UCX init, 20 steps of 256 Ki"
  "large-n:30:4 GiB bf16 per buffer: host pattern 3 s, 2 staged/NCCL all-reduces over loopback ~5 s each, 2 checks of 2^31 elements ~3 s each"
  "train:105:its bound: install and import 15, alloc 15, stream-side 15, step bench 45, report 15 (estimates: none has run on a GPU in this form)"
  "report:3:the JSON"
)

print_plan() {
  local total=0 e name basis
  echo "gpu run plan (one H100; the estimate of each part, then the bounds):"
  for p in "${plan[@]}"; do
    IFS=: read -r name e basis <<<"$p"
    printf '  %-20s %4d s  %s\n' "$name" "$e" "$basis"
    total=$((total + e))
  done
  echo "  estimate: $total s of $limit_s"
  echo "  bounds: preflight $pre_s + checks $check_s + train $train_s + report $report_s = $((pre_s + check_s + train_s + report_s)) s of $limit_s"
  echo "  device call: command=\"$device_command\" (${#device_command} characters), carry=[${carry[*]}], timeout_s=$device_timeout_s"
  echo "  15 minutes of device time: a start (~60-120 s) + this run ($limit_s s at most) leaves ~$((900 - 120 - limit_s)) s for a rerun of what failed"
  local bad=0 checks_est=0
  for p in "${plan[@]}"; do
    IFS=: read -r name e basis <<<"$p"
    case "$name" in preflight|train|report) ;; *) checks_est=$((checks_est + e)) ;; esac
  done
  echo "  the checks: $checks_est s estimated of gpu_check.sh's budget $((check_s - 10)) s (its timeout $check_s s)"
  [ "$checks_est" -le $((check_s - 10)) ] || { echo "gpu run plan: the checks' estimate is over their budget"; bad=1; }
  [ "$total" -le "$limit_s" ] || { echo "gpu run plan: the estimate $total s is over $limit_s s"; bad=1; }
  [ $((pre_s + check_s + train_s + report_s)) -le "$limit_s" ] ||
    { echo "gpu run plan: the bounds are over $limit_s s"; bad=1; }
  [ ${#device_command} -lt 2000 ] || { echo "gpu run plan: the command is 2,000 characters or more"; bad=1; }
  [ ${#carry[@]} -le 8 ] || { echo "gpu run plan: more than 8 carried paths"; bad=1; }
  [ "$device_timeout_s" -gt $((pre_s + check_s + train_s + report_s)) ] && [ "$device_timeout_s" -le 600 ] ||
    { echo "gpu run plan: timeout_s $device_timeout_s must exceed the bounds and be at most 600"; bad=1; }
  return $bad
}

# travel_mib ROOT PATHS...: MiB (rounded up) of what the device tool would send: ROOT's tracked
# and untracked-not-ignored files, plus the carried PATHS (relative to ROOT; absent ones count 0).
travel_kib() {
  local r=$1
  shift
  "${PYTHON:-python3}" - "$r" "$@" <<'EOF'
import os, subprocess, sys
root, carried = sys.argv[1], sys.argv[2:]
names = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                        "--exclude-standard"], capture_output=True, check=True).stdout.split(b"\0")
total = 0
for n in names:
    p = os.path.join(root, os.fsdecode(n))
    if n and os.path.isfile(p) and not os.path.islink(p):
        total += os.path.getsize(p)
tree = total
for c in carried:
    for d, _, fs in os.walk(os.path.join(root, c)):
        for f in fs:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
print(tree // 1024, total // 1024)
EOF
}

mode=run
case "${1:-}" in
  --plan) print_plan; exit $? ;;
  --dry-run) mode=dry; shift ;;
  -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
esac
py=${PYTHON:-python3}

if [ "$mode" = dry ]; then
  build=${1:-$root/build}
  dry_out=${2:-$root/perf/out/gpu_run_dry}
  build=$(cd "$build" && pwd) || { echo "gpu run (dry): no build folder $1"; exit 1; }
  py=${PYTHON:-/usr/bin/python3}
  echo "== gpu run dry run: build $build, outputs $dry_out"
  print_plan || exit 1
  # the dry run's bundle, packed as the real one from what the build holds (the fake programs)
  fb=$build/gpu-run-dry-bundle
  GPU_BUNDLE_FAKE=$build bash "$here/gpu_bundle.sh" "$fb" >"$build/gpu-run-dry-bundle.log" 2>&1 ||
    { tail -20 "$build/gpu-run-dry-bundle.log"; echo "gpu run (dry): the fake bundle did not pack"; exit 1; }
  tail -2 "$build/gpu-run-dry-bundle.log"
  if [ "${BUNDLES:-0}" = 1 ]; then
    echo "== the real bundles (BUNDLES=1)"
    bash "$here/gpu_bundle.sh" "$root/.gpu-bundle" || { echo "gpu run (dry): gpu_bundle.sh failed"; exit 1; }
    bash "$here/gpu_train.sh" bundle "$root/.gpu-train-bundle" || { echo "gpu run (dry): gpu_train.sh bundle failed"; exit 1; }
  fi
  read -r tree_kib all_kib < <(travel_kib "$root" "${carry[@]}")
  have=()
  for c in "${carry[@]}"; do [ -d "$root/$c" ] && have+=("$c"); done
  echo "travel: the tree $((tree_kib / 1024)) MiB; with the carried bundles present here (${have[*]:-none}) $((all_kib / 1024)) MiB of 64"
  [ ${#have[@]} -eq ${#carry[@]} ] ||
    echo "travel: not every real bundle is built here (BUNDLES=1 builds them): their size is unchecked"
  [ "$all_kib" -le $((64 * 1024)) ] || { echo "gpu run (dry): what would travel is over 64 MiB"; exit 1; }
  fake_kib=$(du -sk "$fb" | cut -f1)
  echo "travel: the fake bundle is $((fake_kib / 1024)) MiB (the real one carries the CUDA library instead)"
  export GPU_CHECK_DRY=1 NCCL_LIBRARY_DIR=$fb/nccl OUT=$dry_out
  set -- "$fb" ""
fi

cb=${1:-$root/.gpu-bundle}
tb=${2:-$root/.gpu-train-bundle}
[ "$mode" = dry ] && tb=""
out=${OUT:-$root/perf/out/gpu_run}
dry=${GPU_CHECK_DRY:-0}
# $OUT may be the device tool's folder: only this script's own files are removed from it
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/gpu_run.json "$out"/gpu_run.log "$out"/gpu_figures.md "$out"/gpu_train.md \
  "$out"/train_loss.png "$out"/step_bench.png
work=$(mktemp -d /tmp/gpu_run.XXXXXX)
checks=$work/checks.txt timings=$work/timings.txt
: >"$checks"; : >"$timings"

body() {
# ---- preflight: what is missing, in one line (the probes at once, each bounded) ----------------
echo "== preflight (at most $pre_s s)"
missing=()
if [ "$dry" = 1 ]; then
  echo "dry run: no driver or CUDA torch probed; NCCL is the fake ($NCCL_LIBRARY_DIR)"
else
  ( timeout 10 nvidia-smi -L >"$work/smi.txt" 2>&1 ) & p_smi=$!
  ( timeout 14 "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
      >/dev/null 2>&1 ) & p_torch=$!
  nccl=${NCCL_LIBRARY_DIR:-}
  if [ -z "$nccl" ]; then
    # 5 + 2 + 7 s at most, beside the other two probes
    nccl=$( (timeout 5 "$py" -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null |
             xargs -r -I{} timeout 2 find {} -maxdepth 2 -name 'libnccl.so.2' 2>/dev/null
             timeout 7 find /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /opt /usr/local -maxdepth 6 \
               -name 'libnccl.so.2' 2>/dev/null) | head -1)
    [ -n "$nccl" ] && nccl=$(dirname "$nccl")
  fi
  [ -n "$nccl" ] || missing+=("NCCL (no libnccl.so.2; set NCCL_LIBRARY_DIR)")
  wait $p_smi || missing+=("an NVIDIA driver (nvidia-smi lists no GPU)")
  wait $p_torch || missing+=("torch with CUDA ($py -c 'import torch; torch.cuda.is_available()')")
  export NCCL_LIBRARY_DIR=$nccl
  [ -d "$tb/dist" ] || missing+=("the train bundle $tb (bash perf/gpu/gpu_train.sh bundle)")
fi
[ -d "$cb/bin" ] || [ -f "$cb/bundle.tar.xz" ] || missing+=("the check bundle $cb (bash perf/gpu/gpu_bundle.sh)")
if [ ${#missing[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${missing[@]}")
  echo "gpu run: cannot run: missing ${msg%; }"
  return 2
fi
cb=$(cd "$cb" && pwd)
[ -n "$tb" ] && [ -d "$tb" ] && tb=$(cd "$tb" && pwd)
echo "bundle $(cat "$cb/COMMIT" 2>/dev/null), train bundle $(cat "$tb/COMMIT" 2>/dev/null || echo -), $(elapsed) s in"

# ---- checks --------------------------------------------------------------------------------------
echo "== checks (at most $check_s s)"
CHECKS=$checks TIMINGS=$timings FIGURES=$out/gpu_figures.md GPU_CHECK_BUNDLE=$cb \
  GPU_CHECK_LOGS=$work/ranks DEVICE_N=${DEVICE_N:-$([ "$dry" = 1 ] && echo 65536 || echo 16777216)} \
  ITERS=${ITERS:-10} N=${N:-$([ "$dry" = 1 ] && echo 65536 || echo 67108864)} \
  BUDGET_S=$((check_s - 10)) timeout -k 5 "$check_s" bash "$here/gpu_check.sh" >"$work/gpu_check.log" 2>&1
rc=$?
# killed by its timeout: its figures so far
[ -f "$out/gpu_figures.md.tmp" ] && mv "$out/gpu_figures.md.tmp" "$out/gpu_figures.md"
grep -E '^(PASS|FAIL|SKIP) ' "$work/gpu_check.log" | sed 's/^/  /'
{ [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo "FAIL checks: gpu_check.sh ran past $check_s s" >>"$checks"
grep -q . "$checks" || echo "FAIL checks: gpu_check.sh reported nothing" >>"$checks"

# ---- the allocator and side-stream checks, the training timing ----------------------------------
echo "== train (at most $train_s s, $(elapsed) s in)"
if [ "$dry" = 1 ]; then
  echo "SKIP alloc-torch: needs torch with CUDA (the dry run's torch is the CPU one)" >>"$checks"
  echo "SKIP alloc-library: needs torch with CUDA" >>"$checks"
  "$py" -m py_compile "$here/gpu_alloc_check.py" "$here/gpu_stream_check.py" &&
    echo "SKIP stream-side: needs torch with CUDA (gpu_stream_check.py compiles)" >>"$checks" ||
    echo "FAIL stream-side: gpu_stream_check.py does not compile" >>"$checks"
  # the training scripts on the CPU (what GpuTrain.DryRun ran): gpu_train.sh's own dry run
  # its own budget (600 s: a loaded CI machine), not the GPU run's: this part is CI's only
  timeout -k 10 900 bash "$here/gpu_train.sh" dry-run "$work/train" \
    >"$work/gpu_train.log" 2>&1
  rc=$?
else
  # the step benchmark gets 45 s: gpu_step.py keeps 25 of them for start-up, and at 35 s a
  # rehearsal here ran only the first of its five rows
  CHECKS=$checks ALLOC_CHECK=1 ALLOC_S=15 ALLOC_JSON=$work/alloc.json STREAM_CHECK=1 STREAM_S=15 \
    STREAM_JSON=$work/stream.json OUT=$work/train BUDGET_S=$((train_s - 10)) STEP_BUDGET_S=45 \
    PARAMS=${PARAMS:-67108864} STEPS=${STEPS:-100} VARIANT= TRAIN_CONFIGS=${TRAIN_CONFIGS:-none} \
    timeout -k 10 "$train_s" bash "$here/gpu_train.sh" run "$tb" >"$work/gpu_train.log" 2>&1
  rc=$?
  for c in alloc-torch alloc-library stream-side; do
    grep -q "^\(PASS\|FAIL\) $c" "$checks" || echo "FAIL $c: reported nothing (out of time, or it crashed)" >>"$checks"
  done
fi
if [ $rc -eq 0 ]; then echo "PASS train" >>"$checks"
elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "FAIL train: ran past $train_s s" >>"$checks"
else echo "FAIL train: gpu_train.sh exited $rc" >>"$checks"; fi
for f in gpu_train.md train_loss.png step_bench.png; do
  [ -f "$work/train/$f" ] && cp "$work/train/$f" "$out/"
done

# ---- the figures, one JSON ---------------------------------------------------------------------------
echo "== report ($(elapsed) s in)"
timeout "$report_s" "$py" - "$work" "$out" "$(elapsed)" "$dry" <<'PYEOF' || echo "gpu run: could not write gpu_run.json"
import json, os, re, sys
work, out, seconds, dry = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
def lines(path):
    try:
        with open(path) as f:
            return [l.rstrip("\n") for l in f]
    except OSError:
        return []
def jsonl(path):
    return [json.loads(l) for l in lines(path) if l.strip()]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
checks = {}
for l in lines(os.path.join(work, "checks.txt")):
    m = re.match(r"(PASS|FAIL|SKIP) (\S+?):?( (.*))?$", l)
    if m:
        checks[m.group(2)] = {"result": m.group(1), "why": m.group(4) or ""}
timings = []
for l in lines(os.path.join(work, "timings.txt")):
    m = re.match(r"TIMING (.*): (.*) \(target (.*)\): (met|missed)$", l)
    if m:
        timings.append({"what": m.group(1), "figure": m.group(2), "target": m.group(3),
                        "met": m.group(4) == "met"})
results = [l.split(None, 1)[1] for l in lines(os.path.join(out, "gpu_figures.md"))
           if l.startswith("RESULT ")]
train = os.path.join(work, "train")
doc = {"dry_run": dry, "seconds": seconds, "checks": checks, "timings": timings,
       "gpu_check_results": results, "alloc": load(os.path.join(work, "alloc.json")),
       "stream": load(os.path.join(work, "stream.json")),
       "step_bench": jsonl(os.path.join(train, "step_bench.jsonl")),
       "train_runs": jsonl(os.path.join(train, "train_runs.jsonl")),
       "train_meta": load(os.path.join(train, "meta.json"))}
with open(os.path.join(out, "gpu_run.json"), "w") as f:
    json.dump(doc, f, indent=1)
PYEOF

npass=$(grep -c '^PASS' "$checks") nfail=$(grep -c '^FAIL' "$checks") nskip=$(grep -c '^SKIP' "$checks")
echo "== summary ($(elapsed) s; $npass passed, $nfail failed, $nskip skipped; figures in $out)"
cat "$checks"
cat "$timings"
echo "figures: $out/gpu_run.json (per-rank logs: $work/ranks)"
! grep -q '^FAIL' "$checks"
}

body 2>&1 | tee "$work/console.log"
rc=${PIPESTATUS[0]}
{
  cat "$work/console.log"
  echo; echo "==== gpu_check.sh's log"; cat "$work/gpu_check.log" 2>/dev/null
  echo; echo "==== gpu_train.sh's log (without NCCL's INFO lines; the last 3000)"
  grep -v ' NCCL INFO ' "$work/gpu_train.log" 2>/dev/null | tail -n 3000
} >"$out/gpu_run.log"
[ "$rc" -eq 2 ] && exit 2  # cannot run: said so in one line

if [ "$mode" = dry ]; then
  # What a GPU run leaves and says, checked here: at most 8 files, at most two folders down,
  # every check reported, the fakeable ones passed, the rest skipped saying why.
  "$py" - "$out" <<'EOF' | tee -a "$out/gpu_run.log"
import json, os, sys
out = sys.argv[1]
errors = []
entries = []
for d, dirs, files in os.walk(out):
    if d != out and os.path.relpath(d, out).count(os.sep) >= 2:
        errors.append(f"{d}: more than two folders down")
    entries += [os.path.join(d, f) for f in files]
if len(entries) > 8:
    errors.append(f"{len(entries)} files under {out} (the device tool brings back 8)")
doc = json.load(open(os.path.join(out, "gpu_run.json")))
want_pass = ["packaging", "device-data-path", "optimizer-on-device", "nccl-init-rank",
             "mixed-precision", "fp8-over-nccl", "teardown-order", "abort-during-step",
             "abort-race", "host-wait-deadline", "device-pool", "large-n", "train"]
want_skip = ["cuda-kernels", "kernel-timings", "alloc-torch", "alloc-library", "stream-side"]
got = doc["checks"]
for c in want_pass:
    if got.get(c, {}).get("result") != "PASS":
        errors.append(f"check {c}: {got.get(c)} (expected PASS)")
for c in want_skip:
    if got.get(c, {}).get("result") != "SKIP" or not got[c]["why"]:
        errors.append(f"check {c}: {got.get(c)} (expected SKIP with a reason)")
extra = sorted(set(got) - set(want_pass) - set(want_skip))
if extra:
    errors.append(f"checks not expected: {extra}")
if not doc["gpu_check_results"]:
    errors.append("no RESULT figures")
if not doc["train_runs"] or not doc["step_bench"]:
    errors.append("no training or step figures")
for e in errors:
    print("gpu run dry-run check:", e)
print(f"gpu run dry-run check: {len(entries)} files under {out}: "
      f"{sorted(os.path.basename(e) for e in entries)}; {len(got)} checks; "
      f"{'ok' if not errors else 'FAILED'}")
sys.exit(1 if errors else 0)
EOF
  vrc=${PIPESTATUS[0]}
  [ "$vrc" -eq 0 ] || rc=1
  # CI leaves nothing in /tmp when it passed; on a failure the per-rank logs stay, named above
  [ $rc -eq 0 ] && rm -rf "$work"
  echo "gpu run dry run: $([ $rc -eq 0 ] && echo ok || echo FAILED) in $(elapsed) s" |
    tee -a "$out/gpu_run.log"
fi
exit $rc
