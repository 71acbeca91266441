#!/usr/bin/env bash
# perf/gpu/gpu_check.sh: the correctness checks of SCAPE comm's GPU path on one machine with an
# NVIDIA GPU, from a bundle built on a CPU machine (perf/gpu/gpu_bundle.sh). perf/gpu/run.sh
# runs it as its first part; see perf/gpu/README.md for what each check checks.
#
#   GPU_CHECK_BUNDLE=DIR bash perf/gpu/gpu_check.sh     # on the GPU machine
#   bash perf/gpu/gpu_check.sh                          # a GPU machine with the project's
#                                                       # dependencies: builds the bundle first
#
# One line per check goes to stdout and to $CHECKS: "PASS name", "FAIL name: why" (correctness
# only), or, in the dry run alone, "SKIP name: why" (what the fake runtime cannot run). Timing
# targets are figures, never a failure: "TIMING label: figure (target ...): met|missed" lines go
# to $TIMINGS and the figures file. Checks, in order (each step under its own timeout, cut to
# what is left of BUDGET_S; a step with under MIN_STEP_S left is not started and FAILs saying
# so):
#   packaging          the shipped .so needs no libcuda/libcudart/libnccl; sm_80 + sm_90 SASS and
#                      compute_90 PTX in .nv_fatbin
#   cuda-kernels       every CUDA kernel test against the CPU kernels (a skipped test fails)
#   device-data-path   gpu_device_check.cc at 2 and 4 ranks and at 2 ranks with 64 KiB chunks:
#                      collectives, mask calls and the optimizer step on device buffers, UCX and
#                      NCCL (scapeCommInitNccl), bit-identical to the host path; NCCL through this
#                      plugin ("via NET/SCAPE" in every rank's log)
#   kernel-timings     the kernel table runs and has every row (its targets: TIMING lines)
#   optimizer-on-device  gpu_optim_check.cc: scapeOptimStepStream = scapeOptimStep bit for bit,
#                      fp32 (and timed), bf16, e4m3, sharded
#   nccl-init-rank, mixed-precision, fp8-over-nccl, teardown-order, abort-during-step,
#   abort-race, host-wait-deadline, device-pool, large-n  gpu_extra_check.cc's modes
#                      (nccl-rank, mixed, fp8-nccl, teardown, abort-step, abort-race,
#                      held-stream, pool, large; its header says what each checks)
#
# Environment: GPU_CHECK_BUNDLE, N (kernel table size, 67108864), DEVICE_N (the data-path and
# optimizer checks' size, N), ITERS (20), LARGE_N (large-n's bf16 elements, 2^31 + 4099),
# FIGURES (perf/gpu/gpu_figures.md), CHECKS, TIMINGS (files to append to), BUDGET_S (480),
# MIN_STEP_S (10), GPU_CHECK_LOGS (the per-rank logs; default a fresh folder under /tmp, never
# the bundle), GPU_CHECK_DEVICE (0), NCCL_LIBRARY_DIR (else found, bounded, under python3's
# nvidia.nccl, /usr/local/cuda/lib64, /usr/lib/x86_64-linux-gnu, /opt, /usr/local),
# GPU_CHECK_DRY (1: the dry run: the bundle's programs are linked against the fake CUDA
# runtime and the fake libnccl; no nvidia-smi, no "via NET/SCAPE", small sizes).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dry=${GPU_CHECK_DRY:-0}
n=${N:-67108864}
dn=${DEVICE_N:-$n}
iters=${ITERS:-20}
large_n=${LARGE_N:-$(( (1 << 31) + 4099 ))}
figures=${FIGURES:-$root/perf/gpu/gpu_figures.md}
budget_s=${BUDGET_S:-480}
min_step=${MIN_STEP_S:-10}
export CUDA_VISIBLE_DEVICES=${GPU_CHECK_DEVICE:-0}
start=$(date +%s)
failed=()
logs=${GPU_CHECK_LOGS:-$(mktemp -d /tmp/gpu_check_logs.XXXXXX)}
mkdir -p "$logs"
checks=${CHECKS:-$logs/checks.txt}
timings=${TIMINGS:-$logs/timings.txt}

bundle=${GPU_CHECK_BUNDLE:-}
if [ -z "$bundle" ]; then
  bundle=${BUILD_DIR:-$root/build-gpu-check}/bundle
  echo "== no GPU_CHECK_BUNDLE: building one ($bundle)"
  timeout 1200 bash "$root/perf/gpu/gpu_bundle.sh" "$bundle" >"$logs/bundle.log" 2>&1 ||
    { tail -30 "$logs/bundle.log"; echo "FAIL build: perf/gpu/gpu_bundle.sh (log: $logs/bundle.log)" | tee -a "$checks"; exit 1; }
fi
bundle=$(cd "$bundle" && pwd) || { echo "FAIL bundle: no folder $GPU_CHECK_BUNDLE" | tee -a "$checks"; exit 1; }
if [ ! -d "$bundle/bin" ] && [ -f "$bundle/bundle.tar.xz" ]; then
  # packed (gpu_bundle.sh): unpacked next to the logs, never into the carried folder
  mkdir -p "$logs/bundle"
  timeout 60 tar -C "$logs/bundle" -xJf "$bundle/bundle.tar.xz" 2>"$logs/unpack.log" ||
    timeout 60 python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$bundle/bundle.tar.xz" "$logs/bundle" 2>>"$logs/unpack.log" ||
    { cat "$logs/unpack.log"; echo "FAIL bundle: cannot unpack $bundle/bundle.tar.xz" | tee -a "$checks"; exit 1; }
  cp "$bundle/COMMIT" "$logs/bundle/" 2>/dev/null
  echo "unpacked $bundle/bundle.tar.xz into $logs/bundle in $(( $(date +%s) - start )) s"
  bundle=$logs/bundle
fi
[ -d "$bundle/bin" ] || { echo "FAIL bundle: no $bundle/bin" | tee -a "$checks"; exit 1; }

# One PASS/FAIL line per check: `check NAME` starts a check (ending the one before), `check ""`
# ends the last; `skip NAME WHY` records a check the dry run cannot run.
check_name="" check_nfail=0
check() {
  if [ -n "$check_name" ]; then
    if [ ${#failed[@]} -eq "$check_nfail" ]; then echo "PASS $check_name" | tee -a "$checks"
    else
      local why
      why=$(printf '%s; ' "${failed[@]:$check_nfail}")
      echo "FAIL $check_name: ${why%; }" | tee -a "$checks"
    fi
  fi
  check_name=$1 check_nfail=${#failed[@]}
}
# skip NAME WHY: ends the check begun with `check NAME` as skipped (nothing failed in it yet).
skip() { check_name="" check_nfail=${#failed[@]}; echo "SKIP $1: $2" | tee -a "$checks"; }
say() { printf '\n== %s (%d s)\n' "$*" "$(( $(date +%s) - start ))"; }
left() { echo $(( budget_s - ($(date +%s) - start) )); }
# limit WANT: the seconds a step may run: WANT, or what is left of the budget less 5 s if that
# is less. Prints nothing and returns 1 when that is under MIN_STEP_S: the step must not start
# (a timeout of 0 would mean no limit, a negative one an error).
limit() {
  local l
  l=$(( $(left) - 5 ))
  [ "$l" -gt "$1" ] && l=$1
  [ "$l" -ge "$min_step" ] || return 1
  echo "$l"
}
fail() { echo "FAIL: $*"; failed+=("$*"); }
fig() { echo "$*" >>"$figures.tmp"; }
timing() {  # LABEL FIGURE TARGET MET(0|1): a figure beside its target, never a failure
  local v=missed
  [ "$4" = 1 ] && v=met
  echo "TIMING $1: $2 (target $3): $v" | tee -a "$timings"
  fig "- $1: $2 (target $3): $v"
}
finish() {
  check ""
  fig ""
  fig "Total time: $(( $(date +%s) - start )) s."
  if [ ${#failed[@]} -eq 0 ]; then fig "Verdict: every check passed."
  else fig "Verdict: FAILED:"; for f in "${failed[@]}"; do fig "- $f"; done; fi
  mv "$figures.tmp" "$figures"
  echo; echo "figures: $figures (per-rank logs: $logs)"
  [ ${#failed[@]} -eq 0 ] && { echo "gpu_check: all passed"; exit 0; }
  echo "gpu_check: ${#failed[@]} failure(s)"; exit 1
}

: >"$figures.tmp"
fig "# GPU check figures (written by perf/gpu/gpu_check.sh)"
fig ""
fig "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
fig "- commit: $(cat "$bundle/COMMIT" 2>/dev/null || echo unknown) (the bundle's)"

say "device"
if [ "$dry" = 1 ]; then
  fig "- GPU: none: DRY RUN, the fake CUDA runtime (perf/gpu/fake_cudart.cc) and the fake libnccl"
else
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! timeout 20 nvidia-smi -L; then
    fail "no GPU: nvidia-smi is missing or lists no device"; finish
  fi
  fig "- GPU: $(timeout 20 nvidia-smi -i 0 --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
fi
fig "- N = $n floats (kernel table), DEVICE_N = $dn, $iters timed calls, LARGE_N = $large_n bf16"
so=$bundle/lib/libnccl-net-scape.so
bin=$bundle/bin
nccl_dir=${NCCL_LIBRARY_DIR:-}
if [ -z "$nccl_dir" ]; then
  # bounded: a slow or huge /opt must not eat the budget
  nccl=$( (timeout 5 python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null |
           xargs -r -I{} timeout 5 find {} -maxdepth 2 -name 'libnccl.so.2' 2>/dev/null
           timeout 10 find /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /opt /usr/local -maxdepth 6 \
             -name 'libnccl.so.2' 2>/dev/null) | head -1)
  [ -n "$nccl" ] && nccl_dir=$(dirname "$nccl")
fi
[ -n "$nccl_dir" ] || { fail "no libnccl.so.2 on this machine (set NCCL_LIBRARY_DIR)"; finish; }
echo "NCCL: $nccl_dir"
fig "- NCCL: $nccl_dir"
export LD_LIBRARY_PATH=$bundle/lib:$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$bundle/lib/ucx SCAPE_NCCL_LIBRARY=$nccl_dir/libnccl.so.2
export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
[ "$dry" = 1 ] && export GPU_CHECK_DRY=1

# ranks NAME P LIMIT VIA PROG ARGS...: P ranks of PROG (RANK NRANKS DIR ARGS...), each under
# `timeout LIMIT`, NCCL forced through this library's net plugin (a distinct NCCL_HOSTID per
# rank: NCCL must take the network path); logs in $logs/NAME. The "ok:" lines of rank 0 and the
# failures of every rank to stdout, the RESULT lines to the figures. VIA=1: every rank's NCCL
# log must show "via NET/SCAPE" (not in the dry run: the fake libnccl has no net). Returns the
# number of ranks that failed.
ranks() {
  local name=$1 P=$2 lim=$3 via=$4 prog=$5 r p bad=0
  shift 5
  local dir=$logs/$name pids=()
  rm -rf "$dir"; mkdir -p "$dir"
  for ((r = 0; r < P; ++r)); do
    (
      export NCCL_NET_PLUGIN="$so" NCCL_NET=SCAPE NCCL_HOSTID="scape-fake-node-$r"
      export NCCL_NET_PLUGIN_REF_COUNT=1 NCCL_SOCKET_IFNAME=lo SCAPE_NCCL_DEVICES="=lo"
      export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH
      exec timeout -k 5 "$lim" "$prog" "$r" "$P" "$dir" "$@"
    ) >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || bad=$((bad + 1)); done
  grep -h '^ok: ' "$dir/rank0.log" | sed 's/^/  /'
  grep -h 'CHECK FAILED\|^rank [0-9]*: ' "$dir"/rank*.log | head -10 | sed 's/^/  ! /'
  [ $bad -eq 0 ] || tail -5 "$dir"/rank*.log | grep -v ' NCCL INFO ' | sed 's/^/  | /'
  fig '```'
  grep -h '^RESULT' "$dir/rank0.log" >>"$figures.tmp"
  fig '```'
  if [ "$via" = 1 ] && [ "$dry" != 1 ]; then
    for ((r = 0; r < P; ++r)); do
      grep -q "via NET/SCAPE" "$dir/rank$r.log" ||
        fail "$name: rank $r's NCCL did not use the SCAPE net plugin (no 'via NET/SCAPE')"
    done
  fi
  return $bad
}

check packaging
say "packaging of the shipped library"
fig ""
fig "## Packaging"
fig '```'
timeout 30 bash "$root/tests/device/check_needed.sh" "$so" >>"$figures.tmp" 2>&1 || fail "NEEDED of $so"
if [ -x "$bin/scape_fatbin_check" ]; then
  timeout 30 "$bin/scape_fatbin_check" "$so" 80 90 ptx90 containers=3 >>"$figures.tmp" 2>&1 ||
    fail "fatbin of $so"
else
  fail "no $bin/scape_fatbin_check"
fi
fig '```'

check cuda-kernels
say "CUDA kernels vs the CPU kernels"
if [ "$dry" = 1 ] && [ ! -x "$bin/scape_kernels_cuda_test" ]; then
  fail "no scape_kernels_cuda_test in the bundle"
elif [ "$dry" = 1 ]; then
  skip cuda-kernels "the fake runtime runs no CUDA kernel (scape_kernels_cuda_test is in the bundle)"
elif t=$(limit 180); then
  out=$logs/cuda_test.txt
  timeout -k 5 "$t" "$bin/scape_kernels_cuda_test" >"$out" 2>&1
  rc=$?
  grep -E '^\[ +(FAILED|SKIPPED|PASSED) ' "$out" | tail -20
  fig ""
  fig "## CUDA kernel tests against the CPU kernels"
  fig '```'
  grep -E '^\[ +(PASSED|FAILED|SKIPPED) ' "$out" >>"$figures.tmp"
  grep -E '^\[  FAILED  \] [A-Za-z]' "$out" | sort -u >>"$figures.tmp"
  fig '```'
  if grep -q '^\[  SKIPPED \]' "$out"; then fail "CUDA tests skipped: the GPU is not visible to them"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then fail "CUDA kernel tests ran past $t s"
  elif [ $rc -ne 0 ]; then fail "CUDA kernel tests: $(grep -cE '^\[  FAILED  \] [A-Za-z]' "$out" | head -1) failed"; fi
  if t=$(limit 60); then
    timeout -k 5 "$t" "$bin/scape_kernels_cpu_test" --gtest_brief=1 >"$logs/cpu_test.txt" 2>&1 ||
      fail "CPU kernel tests in the CUDA build"
  fi
else
  fail "out of time before the CUDA kernel tests"
fi

check device-data-path
say "device data path: UCX staged and NCCL backends, 2 and 4 ranks on one GPU"
fig ""
fig "## Device data path (perf/gpu/gpu_device_check.cc, N = $dn floats)"
# 2 and 4 ranks at the default chunk size, then 2 ranks with 64 KiB chunks (the pipeline with
# many chunks per job: the stream's bounded queue of pending work fills).
for cfg in 2:0:120 4:0:150 2:65536:60; do
  IFS=: read -r P chunk want <<<"$cfg"
  label="$P ranks"
  [ "$chunk" != 0 ] && label="$P ranks, SCAPE_DEVICE_CHUNK_BYTES=$chunk"
  t=$(limit "$want") || { fail "out of time before the device check at $label"; break; }
  fig ""
  fig "### $label"
  if [ "$chunk" != 0 ]; then
    SCAPE_DEVICE_CHUNK_BYTES=$chunk SCAPE_TIMEOUT_MS=30000 ranks "data$P-$chunk" "$P" "$t" 1 \
      "$bin/gpu_device_check" "$dn" "$iters" $((t - 10))
  else
    ranks "data$P" "$P" "$t" 1 "$bin/gpu_device_check" "$dn" "$iters" $((t - 10))
  fi || fail "device check at $label (logs: $logs/data$P-$chunk)"
done

check kernel-timings
say "kernel timings (n = $n, $iters calls each)"
if [ "$dry" = 1 ] && [ ! -x "$bin/scape_kernels_gpu_bench" ]; then
  fail "no scape_kernels_gpu_bench in the bundle"
elif [ "$dry" = 1 ]; then
  skip kernel-timings "the fake runtime runs no CUDA kernel (scape_kernels_gpu_bench is in the bundle)"
elif t=$(limit 60); then
  bench=$logs/bench.txt
  timeout -k 5 "$t" "$bin/scape_kernels_gpu_bench" "$n" "$iters" >"$bench" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    cat "$bench"
    fig ""
    fig "## Kernels (perf/kernels/bench_kernels_gpu.cc), x_copy = time / (bytes / D2D bandwidth)"
    fig '```'
    cat "$bench" >>"$figures.tmp"
    fig '```'
    fig ""
    # Targets (worst matching row), figures only: pack and unpack at >= 70% of D2D copy speed
    # (x_copy <= 1.43), top-k at <= 3x one HBM read pass. A missing row is a failure: the
    # table is incomplete.
    target() {  # name-regex, limit, label
      local x
      x=$(grep -E "^$1" "$bench" | awk '{print $NF}' | sort -g | tail -1)
      if [ -z "$x" ]; then fail "no '$1' row in the kernel table"; return; fi
      timing "$3" "x_copy $x" "<= $2" "$(awk -v x="$x" -v l="$2" 'BEGIN { print (x <= l) ? 1 : 0 }')"
    }
    target "candidate\\+pack\\+residual fp32" 1.43 "pack (candidate+pack+residual fp32)"
    target "unpack\\+AdamS update fp32" 1.43 "unpack (+AdamS update fp32)"
    target "gather fp32" 1.43 "pack (gather fp32, worst of d = 0.01, 0.1, 1.0)"
    target "scatter fp32" 1.43 "unpack (scatter fp32, worst of d = 0.01, 0.1, 1.0)"
    target "top-k exact" 3 "top-k exact on $n floats (x one read pass)"
    target "top-k sampled" 3 "top-k sampled on $n floats (x one read pass)"
  else
    tail -20 "$bench"
    fail "the kernel table did not run (exit $rc)"
  fi
else
  fail "out of time before the kernel table"
fi

check optimizer-on-device
say "optimizer step on device vs host (2 ranks, n = $dn)"
fig ""
fig "## Optimizer step on device (perf/gpu/gpu_optim_check.cc, 2 ranks, n = $dn, density 0.01, 20 steps)"
# optim NAME WANT LABEL ARGS...: 2 ranks of gpu_optim_check; a failure unless both exited 0 and
# rank 0 says the bits matched.
optim() {
  local name=$1 want=$2 label=$3 t
  shift 3
  t=$(limit "$want") || { fail "out of time before the $label"; return; }
  fig ""
  fig "$label:"
  ranks "$name" 2 "$t" 0 "$bin/gpu_optim_check" "$@" || fail "$label (logs: $logs/$name)"
  grep -q '^RESULT optim_bits_match 1' "$logs/$name/rank0.log" ||
    fail "$label: not bit-identical to the host step"
}
if [ -x "$bin/gpu_optim_check" ]; then
  optim optim 60 "fp32, then timed" "$dn" 0.01 20 20
  optim optim_bf16 40 "bf16 payloads (20 steps, not timed)" "$dn" 0.01 20 0 bf16
  optim optim_e4m3 40 "e4m3 payloads (20 steps, not timed)" "$dn" 0.01 20 0 e4m3
  optim optim_sharded 40 "sharded ownership (20 steps, not timed)" "$dn" 0.01 20 0 f32 sharded
else
  fail "no $bin/gpu_optim_check in the bundle"
fi

# extra NAME MODE WANT VIA [N]: 2 ranks of gpu_extra_check MODE.
extra() {
  local name=$1 mode=$2 want=$3 via=$4 t
  shift 4
  check "$name"
  say "$name (gpu_extra_check $mode)"
  [ -x "$bin/gpu_extra_check" ] || { fail "no $bin/gpu_extra_check in the bundle"; return; }
  t=$(limit "$want") || { fail "out of time before it"; return; }
  fig ""
  fig "## $name (perf/gpu/gpu_extra_check.cc $mode, 2 ranks)"
  ranks "$name" 2 "$t" "$via" "$bin/gpu_extra_check" "$mode" $((t - 5)) "$@" ||
    fail "gpu_extra_check $mode (logs: $logs/$name)"
}
small=()
[ "$dry" = 1 ] && small=(20011)
extra nccl-init-rank nccl-rank 30 1 "${small[@]}"
extra mixed-precision mixed 30 1 "${small[@]}"
extra fp8-over-nccl fp8-nccl 25 1 "${small[@]}"
extra teardown-order teardown 40 1 "${small[@]}"
extra abort-during-step abort-step 40 1 "${small[@]}"
extra abort-race abort-race "$([ "$dry" = 1 ] && echo 60 || echo 40)" 1 "${small[@]}"
extra host-wait-deadline held-stream 40 0 "${small[@]}"
extra device-pool pool 30 0 "${small[@]}"
if [ "$dry" = 1 ]; then extra large-n large 30 1 262147
else extra large-n large 60 1 "$large_n"; fi

finish
