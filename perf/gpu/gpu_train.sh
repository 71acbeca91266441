#!/usr/bin/env bash
# perf/gpu/gpu_train.sh: one prepared end-to-end run on one GPU, under 8 minutes on an H100 or H200:
# the optimizer step on device (perf/gpu/gpu_step.py: 256 Mi fp32 parameters, 4 ranks, SCAPE at
# density 1 / 0.1 / 0.01 against the dense AdamS step and torch AdamW + NCCL all-reduce), then
# a GPT of ~25M parameters in bf16 with fp32 master weights trained on Debian's fortunes by 4
# data-parallel ranks (perf/gpu/gpu_train.py: AdamW under torch DDP, dense AdamS through the
# library, SCAPE at 0.1 and 0.01 with bf16 payloads, and the entering="segment_rms" variant
# where this scape has it), every rank a process on the one GPU, NCCL forced through this
# library's net plugin (NCCL_NET=SCAPE, a distinct NCCL_HOSTID per rank, as perf/gpu/gpu_check.sh).
# The library's communicator is its NCCL backend (Communicator.from_env(backend="nccl")).
#
#   bash perf/gpu/gpu_train.sh bundle [DIR]     # here (no GPU): the wheel with CUDA kernels, the
#                                           # shared libraries a bare machine lacks (UCX, ...),
#                                           # the corpus -> DIR (default <repo>/.gpu-train-bundle)
#   bash perf/gpu/gpu_train.sh run [DIR]        # on the GPU machine: installs the wheel from DIR
#                                           # (pip --target, no network), runs both, figures ->
#                                           # $OUT (default perf/out/gpu_train)
#   bash perf/gpu/gpu_train.sh dry-run [OUTDIR] # here, no GPU: the same scripts on the CPU, 2 ranks,
#                                           # gloo + UCX, tiny sizes, a few steps (ctest
#                                           # GpuRun.DryRun's train part); not a measurement
#   GPU_TRAIN_CPU=1 bash perf/gpu/gpu_train.sh run [DIR]   # here: rehearses `run` on the CPU with
#                                           # the bundle (its wheel, libraries and corpus)
#   bash perf/gpu/gpu_train.sh length [DIR]     # on the GPU machine: the length axis of issue 30
#                                           # (perf/gpu/gpu_length.py): dense AdamS, SCAPE 0.1 and
#                                           # 0.01 at several training lengths, 19M parameters,
#                                           # 4 ranks, within BUDGET_S; report -> $OUT (default
#                                           # perf/out/gpu_length)/gpu_length.md
#   bash perf/gpu/gpu_train.sh length-dry-run [OUTDIR]  # here, no GPU: the same on the CPU, 2
#                                           # ranks, tiny model (ctest GpuTrain.LengthDryRun)
#
# Outputs (in $OUT, at most 8 files, as the device tool returns them): gpu_train.md (a section
# ready for perf/RESULTS_gpu.md, with the targets and verdicts), train_loss.png (validation
# loss against step and against bytes sent), step_bench.png, train_runs.jsonl (one JSON line per
# configuration), step_bench.jsonl (one per step row), meta.json, gpu_train.log.
#
# Environment: RANKS (4), PARAMS (268435456: the step benchmark's fp32 parameters; 1073741824
# needs ~70 GiB for 4 ranks: an H200), STEPS (the training shape's 200), BUDGET_S (460: the
# whole run; rows and configurations that would not fit are skipped or truncated and say so),
# STEP_BUDGET_S (150), VARIANT (segment_rms; "+"-joined options of perf/gpu/gpu_train.py, e.g.
# segment_rms+clipstay, the quality study's candidates; empty: no variant run), ALLOC_CHECK (1:
# `run` first runs perf/gpu/gpu_alloc_check.py, device memory per step, its PASS/FAIL lines
# appended to $CHECKS and its figures to $ALLOC_JSON, within the budget; ALLOC_S, 40 s), STREAM_CHECK
# (1: then perf/gpu/gpu_stream_check.py, ScapeAdamS under torch's current stream, its line to
# $CHECKS, figures to $STREAM_JSON; STREAM_S, 30 s), TRAIN_CONFIGS (the training configurations
# to run, in order, instead of all; "none": no training run), PYTHON (python3 there,
# /usr/bin/python3 here), NCCL_LIBRARY_DIR (found under python3's nvidia.nccl, /usr, /opt
# otherwise). bundle: BUILD_DIR (<repo>/build-gpu-wheel, the wheel's CMake build folder, kept
# for incremental rebuilds), CUDA_HOME (/usr/local/cuda), WHEELHOUSE (a folder holding
# scikit-build-core's wheel to build offline; else pip fetches it from PyPI). length: LENGTHS
# (tokens per parameter, "0.1 0.2 0.4"; the dry run "0.1 0.2 1000", the last to be skipped),
# METHODS ("adams scape-0.1 scape-0.01", gpu_train.py's configurations: an option is a suffix,
# scape-0.1-artifact is SCAPE 0.1 with bias_correction="artifact"; default the paper's),
# LR_ADAMS (0.001), LR_SCAPE (0.002), EVALS (8 a run; the dry run 4), BUDGET_S (460 s,
# everything; the dry run 240), RANKS.
# Outputs of length (at most 8 files in $OUT): gpu_length.md, length_gap.png, length_runs.jsonl,
# length_plan.json, meta.json, gpu_length.log.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mode=${1:-}
shift || true
ranks=${RANKS:-4}
variant=${VARIANT-segment_rms}

die() { echo "gpu_train: $*" >&2; exit 1; }

# make_corpus DIR: the fortune databases perf/train/data.py reads (package_files: the text files
# of Debian's `fortunes`), copied with a manifest (names in order, sha256, package version).
make_corpus() {
  local dir=$1
  mkdir -p "$dir"
  "${PYTHON:-/usr/bin/python3}" - "$dir" <<'EOF' || return 1
import hashlib, json, os, shutil, sys
sys.path.insert(0, os.path.join(os.environ["GT_ROOT"], "perf", "train"))
import data
out = sys.argv[1]
files = data.package_files()
if not files:
    sys.exit(f"no fortune databases under {data.FORTUNE_DIR} (apt-get install fortunes)")
names = [os.path.basename(f) for f in files]
if len(set(names)) != len(names):
    sys.exit("two fortune files share a name")
h = hashlib.sha256()
for f in files:
    with open(f, "rb") as fh:
        h.update(fh.read())
    shutil.copyfile(f, os.path.join(out, os.path.basename(f)))
man = {"package": data.PACKAGE, "version": data.package_version(), "files": names,
       "sha256": h.hexdigest()}
with open(os.path.join(out, "manifest.json"), "w") as f:
    json.dump(man, f, indent=1)
print(f"corpus: {len(names)} files, sha256 {man['sha256'][:16]}..., {data.PACKAGE} {man['version']}")
EOF
}
export GT_ROOT=$root

# has_kwarg NAME: whether the importable scape.optim.ScapeAdamS takes keyword NAME.
has_kwarg() {
  "$py" -c 'import inspect, sys
from scape.optim import ScapeAdamS
sys.exit(0 if sys.argv[1] in inspect.signature(ScapeAdamS.__init__).parameters else 1)' "$1" \
    >/dev/null 2>&1
}

# ------------------------------------------------------------------------------------------------
bundle() {
  local out=${1:-$root/.gpu-train-bundle}
  local build=${BUILD_DIR:-$root/build-gpu-wheel}
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  local py=${PYTHON:-/usr/bin/python3}
  [ -x "$cuda/bin/nvcc" ] || die "bundle: no nvcc at $cuda/bin/nvcc (set CUDA_HOME): the GPU wheel needs the CUDA kernels"
  rm -rf "$out"
  mkdir -p "$out/dist" "$out/lib/fallback" "$out/corpus"
  out=$(cd "$out" && pwd)
  local idx=()
  [ -n "${WHEELHOUSE:-}" ] && idx=(--no-index --find-links "$WHEELHOUSE")
  local launcher=()
  command -v ccache >/dev/null 2>&1 &&
    launcher=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
              --config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache
              --config-settings=cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  echo "== the wheel, with the CUDA kernels (CMake build folder $build)"
  (cd "$root" && "$py" -m pip wheel --disable-pip-version-check --no-deps "${idx[@]}" -w "$out/dist" \
     --config-settings=build-dir="$build" --config-settings=cmake.define.SCAPE_WITH_CUDA=ON \
     --config-settings=cmake.define.CMAKE_CUDA_COMPILER="$cuda/bin/nvcc" "${launcher[@]}" .) ||
    die "bundle: pip wheel failed"
  local whl
  whl=$(ls "$out"/dist/*.whl) || die "bundle: no wheel"
  local tmp
  tmp=$(mktemp -d)
  "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("scape/libnccl-net-scape.so", sys.argv[2])' \
    "$whl" "$tmp" || die "bundle: the wheel has no scape/libnccl-net-scape.so"
  local so=$tmp/scape/libnccl-net-scape.so
  bash "$root/tests/device/check_needed.sh" "$so" || die "bundle: the library links CUDA or NCCL"
  readelf -S "$so" | grep -q nv_fatbin || die "bundle: the wheel's library has no CUDA kernels (.nv_fatbin)"
  # Shared libraries of this machine the library needs, except glibc's own and CUDA's/NCCL's
  # (the GPU machine has those); libstdc++ and libgcc_s go to lib/fallback, searched last: the
  # GPU machine's own (newer, torch's) must win.
  local skip='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libcuda|libcudart|libnccl)\.so'
  copy_deps() {
    ldd "$1" 2>/dev/null | awk '/=> \//{print $3}' | while read -r lib; do
      local name
      name=$(basename "$lib")
      [[ "$name" =~ $skip ]] && continue
      case "$name" in
        libstdc++.so*|libgcc_s.so*) [ -e "$out/lib/fallback/$name" ] || cp -L "$lib" "$out/lib/fallback/$name" ;;
        *) [ -e "$out/lib/$name" ] || cp -L "$lib" "$out/lib/$name" ;;
      esac
    done
  }
  copy_deps "$so"
  local ucxmod
  ucxmod=$(pkg-config --variable=libdir ucx)/ucx
  [ -d "$ucxmod" ] && cp -rL "$ucxmod" "$out/lib/ucx"
  for f in "$out"/lib/ucx/*.so*; do [ -e "$f" ] && copy_deps "$f"; done
  rm -rf "$tmp"
  echo "== the corpus"
  make_corpus "$out/corpus" || die "bundle: corpus"
  git -C "$root" rev-parse --short HEAD >"$out/COMMIT" 2>/dev/null || echo unknown >"$out/COMMIT"
  local kib
  kib=$(du -sk "$out" | cut -f1)
  echo "bundle: $out ($((kib / 1024)) MiB), commit $(cat "$out/COMMIT"), $(basename "$whl")"
  [ "$kib" -lt $((56 * 1024)) ] ||
    echo "WARNING: the bundle is over 56 MiB; with the working tree it may pass the device tool's 64 MiB"
}

# ------------------------------------------------------------------------------------------------
# launch NAME TIMEOUT SCRIPT ARGS...: RANKS ranks of SCRIPT under scape.launch; its whole output
# to $work/NAME.log, the lines that are not NCCL's INFO chatter to the console (and the log).
launch() {
  local name=$1 tmo=$2
  shift 2
  local log=$work/$name.log rc
  echo "== $name ($ranks ranks, at most ${tmo} s, $(( $(date +%s) - start )) s into the run)"
  timeout -k 10 "$((tmo + 15))" "$py" -m scape.launch -n "$ranks" --timeout "$tmo" --grace 20 \
    "$@" >"$log" 2>&1
  rc=$?
  grep -v ' NCCL INFO ' "$log" | tail -n "${tail_lines:-60}"
  local via
  via=$(grep -c 'via NET/SCAPE' "$log")
  vialog+=("$name: $via lines 'via NET/SCAPE' in NCCL's log")
  # On the GPU every launch uses NCCL (torch's process group, and the library's NCCL backend):
  # it must have gone through this library's net plugin.
  [ -z "$dry_flag" ] && [ "$via" -eq 0 ] && failed+=("$name: NCCL did not use the SCAPE net plugin")
  if [ $rc -ne 0 ]; then
    echo "gpu_train: $name exited $rc; the last 80 lines of its whole log ($log):"
    tail -n 80 "$log" | sed 's/^/  | /'
    failed+=("$name (exit $rc)")
  fi
  return $rc
}

left() { echo $(( budget - ($(date +%s) - start) )); }

write_meta() {
  "$py" - "$out/meta.json" "$@" <<'EOF'
import json, sys
path, *kv = sys.argv[1:]
meta = {}
for item in kv:
    k, _, v = item.partition("=")
    meta[k] = v
with open(path, "w") as f:
    json.dump(meta, f, indent=1)
EOF
}

run_all() {  # DEVICE BACKEND FAKE_HOSTS STEP_ARGS... -- TRAIN_ARGS...
  local device=$1 backend=$2 fake=$3
  shift 3
  local step_args=() train_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do step_args+=("$1"); shift; done
  shift || true
  train_args=("$@")
  local fh=()
  [ "$fake" = 1 ] && fh=(--fake-hosts)

  local st=${STEP_BUDGET_S:-150}
  [ "$st" -gt "$(left)" ] && st=$(left)
  launch step "$st" "$root/perf/gpu/gpu_step.py" --device "$device" --backend "$backend" "${fh[@]}" \
    --deadline-s "$((st - 25))" --out "$out" "${step_args[@]}"

  # The fast configurations first: each gets an equal share of the time left, and what one
  # does not use goes to those after it, so the slow dense ones at the end get the slack.
  local configs=(scape-0.01 scape-0.1)
  if [ -n "$variant" ]; then
    if has_kwarg entering; then configs+=("scape-0.01-$variant")
    else not_run+=("scape-0.01-$variant (this scape's ScapeAdamS has no entering=)"); fi
  fi
  configs+=(adamw adams)
  # TRAIN_CONFIGS: these configurations instead, in this order (perf/gpu/run.sh's short run)
  if [ "${TRAIN_CONFIGS:-}" = none ]; then
    configs=()
    not_run+=("the training runs (TRAIN_CONFIGS=none)")
  elif [ -n "${TRAIN_CONFIGS:-}" ]; then
    read -r -a configs <<<"$TRAIN_CONFIGS"
    not_run+=("the other configurations (TRAIN_CONFIGS=$TRAIN_CONFIGS)")
  fi
  local i=0 n=${#configs[@]}
  for c in "${configs[@]}"; do
    local l cap
    l=$(( $(left) - 20 ))  # 20 s for the report
    # an equal share of what is left for each configuration still to run
    cap=$(( l / (n - i) ))
    i=$((i + 1))
    if [ "$cap" -lt "${MIN_CONFIG_S:-30}" ]; then
      not_run+=("$c (time budget: ${l} s left)")
      continue
    fi
    launch "train-$c" "$cap" "$root/perf/gpu/gpu_train.py" --config "$c" --device "$device" \
      --backend "$backend" "${fh[@]}" --deadline-s "$((cap - 20))" --out "$out" "${train_args[@]}"
  done
}

finish() {  # extra meta key=value...
  local not="" f=""
  [ ${#not_run[@]} -gt 0 ] && not=$(IFS=';'; echo "${not_run[*]}")
  [ ${#failed[@]} -gt 0 ] && f=$(IFS=';'; echo "${failed[*]}")
  local vl=""
  [ -z "$dry_flag" ] && vl=$(IFS=';'; echo "${vialog[*]}")
  write_meta "total_seconds=$(( $(date +%s) - start ))" "not_run=$not" "failed=$f" \
    "nccl_net_plugin=$vl" "$@"
  "$py" "$root/perf/gpu/gpu_report.py" --out "$out" --meta "$out/meta.json" $dry_flag
}

# ------------------------------------------------------------------------------------------------
# find_nccl_dir: the folder of this machine's libnccl.so.2 (NCCL_LIBRARY_DIR, python3's
# nvidia.nccl, /usr, /opt), empty if none.
find_nccl_dir() {
  local nccl_dir=${NCCL_LIBRARY_DIR:-}
  if [ -z "$nccl_dir" ]; then
    local nccl
    # bounded (run.sh passes NCCL_LIBRARY_DIR, so this runs only when used alone)
    nccl=$( (timeout 10 "$py" -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null |
             xargs -r -I{} timeout 5 find {} -maxdepth 2 -name 'libnccl.so.2' 2>/dev/null
             timeout 10 find /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /opt /usr/local -maxdepth 6 \
               -name 'libnccl.so.2' 2>/dev/null) | head -1)
    [ -n "$nccl" ] && nccl_dir=$(dirname "$nccl")
  fi
  echo "$nccl_dir"
}

# install_bundle BDIR REHEARSE: the bundle's wheel into $work/site (pip --target, no network),
# and what every rank needs to load it with the bundle's libraries and this machine's NCCL,
# NCCL forced through the library's net plugin; then one import to check it loads the wheel's.
install_bundle() {
  local bdir=$1 rehearse=$2
  local site=$work/site
  timeout 90 "$py" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps --no-compile \
    --target "$site" "$bdir"/dist/*.whl || die "pip install of the bundled wheel failed (or took over 90 s)"
  nccl_dir=$(find_nccl_dir)
  [ -n "$nccl_dir" ] || [ "$rehearse" = 1 ] || die "no libnccl.so.2 on this machine (set NCCL_LIBRARY_DIR)"
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1
  export LD_LIBRARY_PATH=$bdir/lib:$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:$bdir/lib/fallback
  export UCX_MODULE_DIR=$bdir/lib/ucx SCAPE_NCCL_LIBRARY=$nccl_dir/libnccl.so.2
  local so=$site/scape/libnccl-net-scape.so
  export NCCL_NET_PLUGIN=$so NCCL_NET=SCAPE NCCL_NET_PLUGIN_REF_COUNT=1 NCCL_SOCKET_IFNAME=lo
  export SCAPE_NCCL_DEVICES="=lo" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH
  export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  (cd "$work" && timeout 60 "$py" -c 'import sys, scape, torch
p = scape.library_path()
print("scape", scape.__version__, "from", scape.__file__, "library", p, "| torch", torch.__version__,
      "| python", sys.version.split()[0])
assert p.startswith(sys.argv[1]), "the library loaded is not the one of the installed wheel"' "$site") ||
    die "the installed wheel does not import"
}

# ------------------------------------------------------------------------------------------------
run_gpu() {
  local bdir=${1:-$root/.gpu-train-bundle}
  [ -d "$bdir" ] || die "run: no bundle at $bdir (bash perf/gpu/gpu_train.sh bundle, then carry it)"
  bdir=$(cd "$bdir" && pwd)
  py=${PYTHON:-python3}
  out=${OUT:-$root/perf/out/gpu_train}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  work=$(mktemp -d /tmp/gpu_train.XXXXXX)
  budget=${BUDGET_S:-460}
  start=$(date +%s)
  failed=() not_run=() vialog=()
  dry_flag=""
  # GPU_TRAIN_CPU=1: a rehearsal of this mode on a machine without a GPU (the bundle's wheel
  # and libraries, the same steps, but the CPU with gloo and UCX, 2 ranks and the dry run's
  # sizes), to check a bundle before spending device time on it. Not a measurement.
  local rehearse=${GPU_TRAIN_CPU:-0}
  [ "$rehearse" = 1 ] && { dry_flag=--dry-run; ranks=${RANKS:-2}; }
  exec > >(tee -a "$out/gpu_train.log") 2>&1
  echo "== device"
  [ "$rehearse" = 1 ] || timeout 20 nvidia-smi -L || die "no GPU (nvidia-smi)"
  install_bundle "$bdir" "$rehearse"
  local gpu="none (GPU_TRAIN_CPU=1 rehearsal)"
  if [ "${ALLOC_CHECK:-0}" = 1 ] && [ "$rehearse" != 1 ]; then
    echo "== alloc (device memory per step, at most ${ALLOC_S:-40} s)"
    (cd "$work" && timeout -k 5 "${ALLOC_S:-40}" "$py" "$root/perf/gpu/gpu_alloc_check.py" \
      --json "${ALLOC_JSON:-$work/alloc.json}") | grep -v ' NCCL INFO ' | tee -a "${CHECKS:-/dev/null}"
  fi
  if [ "${STREAM_CHECK:-0}" = 1 ] && [ "$rehearse" != 1 ]; then
    echo "== stream (ScapeAdamS on CUDA tensors under torch's current stream, at most ${STREAM_S:-30} s)"
    (cd "$work" && timeout -k 5 "${STREAM_S:-30}" "$py" "$root/perf/gpu/gpu_stream_check.py" \
      --json "${STREAM_JSON:-$work/stream.json}") | grep -v ' NCCL INFO ' | tee -a "${CHECKS:-/dev/null}"
  fi
  if [ "$rehearse" = 1 ]; then
    STEP_BUDGET_S=${STEP_BUDGET_S:-180} MIN_CONFIG_S=${MIN_CONFIG_S:-1} \
      run_all cpu ucx 0 --params "${PARAMS:-262144}" --segments 4 --warmup 2 --iters 2 -- \
      --shape dry --dtype auto --corpus "$bdir/corpus" --steps "${STEPS:-8}" --eval-every 4
  else
    gpu=$(timeout 20 nvidia-smi -i 0 --query-gpu=name,memory.total --format=csv,noheader)
    run_all cuda nccl 1 --params "${PARAMS:-268435456}" -- --shape gpu --dtype bfloat16 \
      --corpus "$bdir/corpus" ${STEPS:+--steps "$STEPS"}
  fi
  finish "command=bash perf/gpu/gpu_train.sh bundle .gpu-train-bundle   # here; then on the GPU machine: bash perf/gpu/gpu_train.sh run .gpu-train-bundle (device tool: carry .gpu-train-bundle)" \
    "bundle_commit=$(cat "$bdir/COMMIT" 2>/dev/null)" "wheel=$(basename "$bdir"/dist/*.whl)" \
    "nvidia_smi=$gpu" "nccl_library=$nccl_dir/libnccl.so.2" "budget_s=$budget"
  echo "figures: $out"
  sleep 1  # let tee write the log's end
  [ ${#failed[@]} -eq 0 ]
}

# ------------------------------------------------------------------------------------------------
dry_run() {
  py=${PYTHON:-/usr/bin/python3}
  out=${1:-$root/perf/out/gpu_train_dry}
  rm -rf "$out"
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  work=$(mktemp -d /tmp/gpu_train_dry.XXXXXX)
  ranks=${RANKS:-2}
  budget=${BUDGET_S:-600}
  start=$(date +%s)
  failed=() not_run=() vialog=()
  dry_flag=--dry-run
  export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n OMP_NUM_THREADS=1
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  "$py" -c 'import scape, torch' || die "dry-run: scape (PYTHONPATH=<build>/python) and torch must import"
  make_corpus "$work/corpus" || die "dry-run: corpus"
  STEP_BUDGET_S=${STEP_BUDGET_S:-180} MIN_CONFIG_S=${MIN_CONFIG_S:-1} \
    run_all cpu ucx 0 --params "${PARAMS:-262144}" --segments 4 --warmup 2 --iters 2 -- \
    --shape dry --dtype auto --corpus "$work/corpus" --steps "${STEPS:-8}" --eval-every 4
  finish "command=bash perf/gpu/gpu_train.sh dry-run" "budget_s=$budget"
  # The outputs a GPU run must leave, and what they must say.
  local bad=0
  for f in gpu_train.md train_runs.jsonl step_bench.jsonl meta.json; do
    [ -s "$out/$f" ] || { echo "dry-run: no $out/$f"; bad=1; }
  done
  "$py" -c 'import matplotlib' 2>/dev/null && for f in train_loss.png step_bench.png; do
    [ -s "$out/$f" ] || { echo "dry-run: no $out/$f"; bad=1; }
  done
  "$py" - "$out" "$variant" <<'EOF' || bad=1
import inspect, json, os, sys
from scape.optim import ScapeAdamS
out, variant = sys.argv[1], sys.argv[2]
runs = [json.loads(l) for l in open(os.path.join(out, "train_runs.jsonl")) if l.strip()]
rows = [json.loads(l) for l in open(os.path.join(out, "step_bench.jsonl")) if l.strip()]
want = ["scape-0.01", "scape-0.1"]
if variant and "entering" in inspect.signature(ScapeAdamS.__init__).parameters:
    want.append(f"scape-0.01-{variant}")
want += ["adamw", "adams"]
got = [r["config"] for r in runs]
errors = []
if got != want:
    errors.append(f"configurations {got}, expected {want}")
for r in runs:
    if not r["ranks_identical"] or not all(c["identical"] for c in r["curve"]):
        errors.append(f"{r['config']}: ranks differ")
    if r["steps_done"] != r["steps"] or r["truncated"]:
        errors.append(f"{r['config']}: {r['steps_done']} of {r['steps']} steps")
    if len(r["curve"]) < 2 or not r["tokens_per_second"] or r["bytes_per_step"] <= 0:
        errors.append(f"{r['config']}: empty figures {r['curve'][:1]} {r['tokens_per_second']}")
    if r["opt"] != "adamw" and not r["phases_ms_mean"]:
        errors.append(f"{r['config']}: no library phases")
scape = {r["config"]: r for r in runs}
if "scape-0.01" in scape and "adams" in scape and \
        not scape["scape-0.01"]["bytes_per_step"] < scape["adams"]["bytes_per_step"]:
    errors.append("SCAPE 0.01 did not send fewer bytes than dense AdamS")
names = [r["row"] for r in rows]
if names != ["adams-dense", "scape-0.01", "scape-0.1", "adamw-gloo", "scape-1"]:
    errors.append(f"step rows {names}")
for r in rows:
    if r.get("skipped") or not r.get("ranks_identical") or not r.get("step_ms_median"):
        errors.append(f"step row {r}")
md = open(os.path.join(out, "gpu_train.md")).read()
for s in ("DRY RUN", "### The optimizer step on device", "### Training", "Target"):
    if s not in md:
        errors.append(f"gpu_train.md lacks {s!r}")
for e in errors:
    print("dry-run check:", e)
print(f"dry-run check: {len(runs)} configurations, {len(rows)} step rows, "
      f"{'ok' if not errors else 'FAILED'}")
sys.exit(1 if errors else 0)
EOF
  rm -rf "$work"
  [ ${#failed[@]} -eq 0 ] && [ $bad -eq 0 ] || { echo "gpu_train dry-run: FAILED ${failed[*]}"; exit 1; }
  echo "gpu_train dry-run: ok ($(( $(date +%s) - start )) s; outputs in $out)"
}

# ------------------------------------------------------------------------------------------------
# The length axis (issue 30): perf/gpu/gpu_length.py runs every (length, method) one after the
# other in one launch of RANKS ranks, plans the lengths on the first run's first steps and
# shrinks or skips, saying so, what would not end by the budget; perf/gpu/gpu_length_report.py
# writes the table.

# length_preflight BDIR: what a GPU run needs and this machine lacks, in one line; exit 2.
length_preflight() {
  local bdir=$1 missing=()
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 ||
    missing+=("an NVIDIA driver (nvidia-smi lists no GPU)")
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 ||
    missing+=("torch with CUDA ($py -c 'import torch; torch.cuda.is_available()')")
  [ -n "$(find_nccl_dir)" ] || missing+=("NCCL (no libnccl.so.2; set NCCL_LIBRARY_DIR)")
  ls "$bdir"/dist/*.whl >/dev/null 2>&1 ||
    missing+=("the train bundle $bdir (bash perf/gpu/gpu_train.sh bundle, then carry it)")
  if [ ${#missing[@]} -gt 0 ]; then
    local msg
    msg=$(printf '%s; ' "${missing[@]}")
    echo "gpu_train length: cannot run: missing ${msg%; }"
    exit 2
  fi
}

# length_axis DEVICE BACKEND FAKE_HOSTS SHAPE DTYPE CORPUS LENGTHS: the launch, ending by the
# budget less REPORT_S (25 s) for the report.
length_axis() {
  local device=$1 backend=$2 fake=$3 shape=$4 dtype=$5 corpus=$6 lengths=$7
  local fh=()
  [ "$fake" = 1 ] && fh=(--fake-hosts)
  local l=$(( $(left) - ${REPORT_S:-25} ))
  if [ "$l" -lt 30 ]; then
    not_run+=("the length axis (time budget: ${l} s left)")
    return 1
  fi
  tail_lines=400 launch length "$l" "$root/perf/gpu/gpu_length.py" --device "$device" \
    --backend "$backend" "${fh[@]}" --shape "$shape" --dtype "$dtype" --corpus "$corpus" \
    --out "$out" --lengths "$lengths" --methods "${METHODS:-adams scape-0.1 scape-0.01}" \
    --lr-adams "${LR_ADAMS:-0.001}" --lr-scape "${LR_SCAPE:-0.002}" --evals "${EVALS:-8}" \
    --end-epoch "$(( $(date +%s) + l - 10 ))"
}

length_finish() {  # CORPUS META(key=value)...
  local corpus=$1
  shift
  local not="" f="" vl=""
  [ ${#not_run[@]} -gt 0 ] && not=$(IFS=';'; echo "${not_run[*]}")
  [ ${#failed[@]} -gt 0 ] && f=$(IFS=';'; echo "${failed[*]}")
  [ -z "$dry_flag" ] && vl=$(IFS=';'; echo "${vialog[*]}")
  write_meta "total_seconds=$(( $(date +%s) - start ))" "not_run=$not" "failed=$f" \
    "nccl_net_plugin=$vl" "lengths=${LENGTHS:-$length_default}" \
    "methods=${METHODS:-adams scape-0.1 scape-0.01}" "$@"
  "$py" "$root/perf/gpu/gpu_length_report.py" --out "$out" --meta "$out/meta.json" \
    --corpus "$corpus" $dry_flag
}

# length_outputs: $out made absolute, the files of an earlier run of this mode removed (only
# those: $OUT may hold other things).
length_outputs() {
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  rm -f "$out"/gpu_length.md "$out"/length_gap.png "$out"/length_runs.jsonl \
    "$out"/length_plan.json "$out"/meta.json "$out"/gpu_length.log
}

length_gpu() {
  start=$(date +%s)
  local bdir=${1:-$root/.gpu-train-bundle}
  py=${PYTHON:-python3}
  local rehearse=${GPU_TRAIN_CPU:-0}
  [ "$rehearse" = 1 ] || length_preflight "$bdir"
  [ -d "$bdir/dist" ] || die "length: no bundle at $bdir (bash perf/gpu/gpu_train.sh bundle, then carry it)"
  bdir=$(cd "$bdir" && pwd)
  out=${OUT:-$root/perf/out/gpu_length}
  length_outputs
  work=$(mktemp -d /tmp/gpu_length.XXXXXX)
  budget=${BUDGET_S:-460}
  failed=() not_run=() vialog=()
  dry_flag=""
  # GPU_TRAIN_CPU=1: rehearses this mode on the CPU with the bundle (2 ranks, the dry sizes)
  [ "$rehearse" = 1 ] && { dry_flag=--dry-run; ranks=${RANKS:-2}; }
  exec > >(tee -a "$out/gpu_length.log") 2>&1
  echo "== device"
  local gpu="none (GPU_TRAIN_CPU=1 rehearsal)"
  [ "$rehearse" = 1 ] || gpu=$(nvidia-smi -i 0 --query-gpu=name,memory.total --format=csv,noheader)
  echo "$gpu"
  install_bundle "$bdir" "$rehearse"
  if [ "$rehearse" = 1 ]; then
    length_default="0.1 0.2 1000"
    EVALS=${EVALS:-4} length_axis cpu ucx 0 dry auto "$bdir/corpus" "${LENGTHS:-$length_default}"
  else
    length_default="0.1 0.2 0.4"
    length_axis cuda nccl 1 len20 bfloat16 "$bdir/corpus" "${LENGTHS:-$length_default}"
  fi
  length_finish "$bdir/corpus" "command=bash perf/gpu/gpu_train.sh bundle .gpu-train-bundle   # here; then on the GPU machine: bash perf/gpu/gpu_train.sh length .gpu-train-bundle (device tool: carry .gpu-train-bundle)" \
    "bundle_commit=$(cat "$bdir/COMMIT" 2>/dev/null)" "wheel=$(basename "$bdir"/dist/*.whl)" \
    "nvidia_smi=$gpu" "nccl_library=$nccl_dir/libnccl.so.2" "budget_s=$budget"
  echo "report: $out/gpu_length.md (the launch's whole log, NCCL's lines too: $work/length.log)"
  sleep 1  # let tee write the log's end
  [ ${#failed[@]} -eq 0 ]
}

length_dry_run() {
  start=$(date +%s)
  py=${PYTHON:-/usr/bin/python3}
  out=${1:-$root/perf/out/gpu_length_dry}
  rm -rf "$out"
  length_outputs
  work=$(mktemp -d /tmp/gpu_length_dry.XXXXXX)
  ranks=${RANKS:-2}
  # 240 s: the planner runs 0.1 and 0.2 tokens per parameter (19 s in a CI run of e4e0e09)
  # and skips 1000 whatever the budget; the margin is for a loaded machine (6x slower steps
  # left nothing inside 60 s and failed the check)
  budget=${BUDGET_S:-240}
  failed=() not_run=() vialog=()
  dry_flag=--dry-run
  length_default="0.1 0.2 1000"
  export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n OMP_NUM_THREADS=1
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  exec > >(tee -a "$out/gpu_length.log") 2>&1
  "$py" -c 'import scape, torch' || die "length-dry-run: scape (PYTHONPATH=<build>/python) and torch must import"
  "$py" "$root/perf/gpu/gpu_length.py" --self-test || failed+=("gpu_length.py --self-test")
  make_corpus "$work/corpus" || die "length-dry-run: corpus"
  EVALS=${EVALS:-4} REPORT_S=8 length_axis cpu ucx 0 dry auto "$work/corpus" \
    "${LENGTHS:-$length_default}"
  length_finish "$work/corpus" "command=bash perf/gpu/gpu_train.sh length-dry-run" "budget_s=$budget"
  # What a GPU run must leave, and what its report must say.
  local bad=0
  "$py" - "$out" "${LENGTHS:-$length_default}" "${METHODS:-adams scape-0.1 scape-0.01}" <<'EOF' || bad=1
import json, math, os, re, sys
out, lengths, methods = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
errors = []
files = sorted(os.listdir(out))
want = ["gpu_length.md", "length_runs.jsonl", "length_plan.json", "meta.json", "gpu_length.log"]
errors += [f"no {f}" for f in want if f not in files or not os.path.getsize(os.path.join(out, f))]
if len(files) > 8:
    errors.append(f"{len(files)} files in {out} (at most 8): {files}")
try:
    import matplotlib  # noqa: F401
    if "length_gap.png" not in files:
        errors.append("no length_gap.png")
except ImportError:
    pass
if errors:
    print("\n".join("length-dry-run check: " + e for e in errors))
    sys.exit(1)
runs = [json.loads(l) for l in open(os.path.join(out, "length_runs.jsonl")) if l.strip()]
plan = json.load(open(os.path.join(out, "length_plan.json")))
md = open(os.path.join(out, "gpu_length.md")).read()
if plan["methods"] != methods:
    errors.append(f"methods {plan['methods']}, expected {methods}")
if sorted(d["requested"] for d in plan["plan"]) != sorted(float(x) for x in lengths):
    errors.append(f"lengths {[d['requested'] for d in plan['plan']]}, expected {lengths}")
if not plan["estimates"]["step_seconds"] or not plan["history"]:
    errors.append("no plan made on measured step times")
ran = [d for d in plan["plan"] if d["status"] != "skipped"]
if not ran:
    errors.append("no length ran")
for d in plan["plan"]:
    if d["status"] != "run" and not d["why"]:
        errors.append(f"{d['requested']:g} {d['status']} without a reason")
    if d["requested"] == 1000 and d["status"] != "skipped":
        errors.append("1000 tokens per parameter was not skipped")
for d in ran:
    got = {r["method"]: r for r in runs if r["tokens_per_param_requested"] == d["requested"]}
    if list(got) != methods:
        errors.append(f"{d['requested']:g}: runs {list(got)}, expected {methods}")
    for m, r in got.items():
        if r["steps"] != d["steps"] or r["steps_done"] != d["steps"] or r["truncated"]:
            errors.append(f"{d['requested']:g} {m}: {r['steps_done']} of {r['steps']} steps, "
                          f"the plan's {d['steps']}")
        if not r["ranks_identical"] or not math.isfinite(r["final_val_loss"]):
            errors.append(f"{d['requested']:g} {m}: ranks differ or loss {r['final_val_loss']}")
    if "adams" in got and "scape-0.01" in got and \
            not got["scape-0.01"]["bytes_per_step"] < got["adams"]["bytes_per_step"]:
        errors.append(f"{d['requested']:g}: SCAPE 0.01 did not send fewer bytes than dense AdamS")
for s in ("DRY RUN", "Corpus baselines (validation, nats per token): unigram",
          "| tokens/param (steps) |", "Step time and bytes"):
    if s not in md:
        errors.append(f"gpu_length.md lacks {s!r}")
for d in plan["plan"]:
    if d["status"] == "skipped" and f"{d['requested']:g} tokens per parameter: skipped" not in md:
        errors.append(f"gpu_length.md does not say that {d['requested']:g} was skipped")
# the table: a row per length run, a cell per method, a gap in % and nats in every other cell
lines = md.splitlines()
h = next((i for i, l in enumerate(lines) if l.startswith("| tokens/param (steps) |")), None)
rows = []
if h is not None:
    for l in lines[h + 2:]:
        if not l.startswith("| "):
            break
        rows.append([c.strip() for c in l.strip().strip("|").split("|")])
if len(rows) != len(ran):
    errors.append(f"the table has {len(rows)} rows, {len(ran)} lengths ran")
num = r"\d+\.\d{3}( \[[a-z/]+ plateau\])?"
for row in rows:
    if len(row) != 1 + len(methods):
        errors.append(f"row {row}: {len(row)} cells")
        continue
    for m, c in zip(methods, row[1:]):
        tail = "$" if m == "adams" else r": [+-]\d+\.\d% \([+-]\d+\.\d{3} nats\), = dense step "
        if not re.match(num + tail, c):
            errors.append(f"{m}'s cell {c!r}")
for e in errors:
    print("length-dry-run check:", e)
print(f"length-dry-run check: {len(runs)} runs, {len(rows)} lengths in the table, "
      f"{'ok' if not errors else 'FAILED'}")
sys.exit(1 if errors else 0)
EOF
  rm -rf "$work"
  [ ${#failed[@]} -eq 0 ] && [ $bad -eq 0 ] || { echo "gpu_train length-dry-run: FAILED ${failed[*]}"; sleep 1; exit 1; }
  echo "gpu_train length-dry-run: ok ($(( $(date +%s) - start )) s; outputs in $out)"
  sleep 1  # let tee write the log's end
}

# One compound command, read whole before it runs: a script edited while it runs (a checkout
# during a long run) cannot make bash read on at a stale offset after it.
{
  case "$mode" in
    bundle) bundle "$@" ;;
    run) run_gpu "$@" ;;
    dry-run) dry_run "$@" ;;
    length) length_gpu "$@" ;;
    length-dry-run) length_dry_run "$@" ;;
    *) sed -n '2,56p' "$0"; exit 2 ;;
  esac
  exit $?
}
