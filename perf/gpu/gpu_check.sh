#!/usr/bin/env bash
# perf/gpu/gpu_check.sh: the whole GPU check of SCAPE comm, for one machine with an NVIDIA GPU
# (sized for one H200 with 16 cores: under 8 minutes). Nothing here runs without a GPU.
#
#   bash perf/gpu/gpu_check.sh                 # everything below; figures -> perf/gpu/gpu_figures.md
#
# Steps (each bounded by a timeout; the script stops at the 8-minute mark):
#  1. Build the project with CUDA (Release; sm_80 + sm_90 SASS and compute_90 PTX).
#  2. Packaging of the shipped libnccl-net-scape.so: no libcuda/libcudart/libnccl in NEEDED,
#     kernels for sm_80, sm_90 and compute_90 PTX in .nv_fatbin (ctest device.so_*, kernels.*).
#  3. Every CUDA kernel test against the CPU kernels (tests/kernels/test_kernels_cuda.cc: same
#     bits for the integer and codec paths and the fp32 step kernels, same top-k sets). A
#     skipped test is a failure here: the GPU was not visible.
#  4. The device data path with the real CUDA runtime (perf/gpu/gpu_device_check.cc), at 2 and at 4
#     ranks sharing the one GPU: UCX backend (device buffers staged through pinned memory on
#     the stream, bit-identical to the host collectives, enqueue-and-return checked; the mask
#     calls on device buffers and top-k of a device statistic against the host calls) and NCCL
#     backend (scapeCommInitNccl on a real ncclComm_t) with NCCL forced through our net plugin
#     (NCCL_NET_PLUGIN = the built .so, NCCL_NET=SCAPE, a distinct NCCL_HOSTID per rank so
#     NCCL must take the network path; the NCCL log must show "via NET/SCAPE"): a dense
#     all-reduce and a values-only exchange of 1% of the values, checked and timed; on both
#     backends the mask calls on device buffers (top-k from a device statistic, pack/unpack,
#     packed collectives, masked all-reduce) against the host calls, the masked all-reduce at
#     density 0.01 timed against the dense one; and on both backends the optimizer step on
#     device buffers against the host step (bit for bit; NCCL above 2 ranks: the same params
#     on every rank), the SCAPE step timed. Then 2 ranks again with 64 KiB chunks.
#  5. Kernel timings (perf/kernels/bench_kernels_gpu.cc, 64 Mi floats) with cudaMemcpy D2D in
#     the same run: pack/unpack efficiency vs D2D (target >= 0.70) for the fused step kernels
#     (candidate+pack+residual, unpack+AdamS) and for the masked collectives' gather (pack) and
#     scatter (unpack) at density 0.01, 0.1 and 1.0 (bytes: index + packed + the dense side's
#     32-byte sectors, and for the scatter a read of every partially written sector: ECC
#     read-modify-write), top-k vs one HBM read pass of the 64 Mi floats (target <= 3x).
#  6. Optimizer step on device vs host (perf/gpu/gpu_optim_check.cc, 2 ranks): 20 steps of
#     scapeOptimStepStream against scapeOptimStep, params and checkpoints bit for bit; then the
#     SCAPE step (density 0.01) timed against a dense AdamS step (the same call with every
#     segment always dense: no top-k, every value exchanged) and the dense all-reduce alone, on
#     device; then 20 steps with bf16 payloads, and 20 with sharded ownership, bit for bit.
# The figures (every RESULT line, the kernel table, the targets and the verdicts) go to
# $FIGURES (default perf/gpu/gpu_figures.md), which perf/RESULTS_gpu.md quotes.
#
# Environment: BUILD_DIR (default <repo>/build-gpu-check), JOBS (nproc), N (67108864),
# DEVICE_N (N; step 4's size), ITERS (20), FIGURES, CUDA_HOME (/usr/local/cuda), GPU_CHECK_DEVICE (0),
# BUDGET_S (480: the script stops starting steps past it), CHECKS (a file: one "PASS name" or
# "FAIL name: why" line per step is appended to it, as perf/gpu/run.sh collects them).
#
# A GPU machine without the project's dependencies (UCX, GoogleTest): build on a CPU machine
# with `bash perf/gpu/gpu_bundle.sh DIR` (the same programs, Release, plus the shared libraries
# they need) and run `GPU_CHECK_BUNDLE=DIR bash perf/gpu/gpu_check.sh` there: step 1 is then
# skipped, the CPU-side ctest checks of steps 2-3 are left to CI, and NCCL is the GPU
# machine's own libnccl.so.2 (found under /usr, /opt and python3's site-packages, or
# NCCL_LIBRARY_DIR).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=${GPU_CHECK_BUNDLE:-}
[ -n "$bundle" ] && bundle=$(cd "$bundle" && pwd)
build=${BUILD_DIR:-$root/build-gpu-check}
[ -n "$bundle" ] && build=$bundle
jobs=${JOBS:-$(nproc)}
n=${N:-67108864}
dn=${DEVICE_N:-$n}  # the device data-path check's size (step 4)
iters=${ITERS:-20}
cuda=${CUDA_HOME:-/usr/local/cuda}
figures=${FIGURES:-$root/perf/gpu/gpu_figures.md}
logs=$build/gpu_check_logs
export CUDA_VISIBLE_DEVICES=${GPU_CHECK_DEVICE:-0}
budget_s=${BUDGET_S:-480}
start=$(date +%s)
failed=()
mkdir -p "$logs"
checks=${CHECKS:-$logs/checks.txt}
# One PASS/FAIL line per step: check NAME starts a step (ending the one before), check "" ends.
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

say() { printf '\n== %s (%d s)\n' "$*" "$(( $(date +%s) - start ))"; }
left() { echo $(( budget_s - ($(date +%s) - start) )); }
fail() { echo "FAIL: $*"; failed+=("$*"); }
fig() { echo "$*" >>"$figures.tmp"; }
finish() {
  check ""
  fig ""
  fig "Total time: $(( $(date +%s) - start )) s."
  if [ ${#failed[@]} -eq 0 ]; then fig "Verdict: every check passed."
  else fig "Verdict: FAILED:"; for f in "${failed[@]}"; do fig "- $f"; done; fi
  mv "$figures.tmp" "$figures"
  echo; echo "figures: $figures"
  [ ${#failed[@]} -eq 0 ] && { echo "gpu_check: all passed"; exit 0; }
  echo "gpu_check: ${#failed[@]} failure(s)"; exit 1
}

: >"$figures.tmp"
fig "# GPU check figures (written by perf/gpu/gpu_check.sh)"
fig ""
fig "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
if [ -n "$bundle" ]; then fig "- commit: $(cat "$bundle/COMMIT" 2>/dev/null || echo unknown) (the bundle's)"
else fig "- commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"; fi

say "device"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L; then
  fail "no GPU: nvidia-smi is missing or lists no device"; finish
fi
gpu=$(nvidia-smi -i 0 --query-gpu=name,driver_version,memory.total --format=csv,noheader)
fig "- GPU: $gpu"
nvcc=$cuda/bin/nvcc
if [ -z "$bundle" ]; then
  [ -x "$nvcc" ] || { fail "no nvcc at $nvcc (set CUDA_HOME)"; finish; }
  fig "- nvcc: $("$nvcc" --version | tail -1)"
fi
fig "- N = $n floats, $iters timed calls"

if [ -n "$bundle" ]; then
  say "1. prebuilt bundle $bundle (commit $(cat "$bundle/COMMIT" 2>/dev/null))"
  fig "- prebuilt by perf/gpu/gpu_bundle.sh at commit $(cat "$bundle/COMMIT" 2>/dev/null)"
  so=$bundle/lib/libnccl-net-scape.so
  bin_cuda_test=$bundle/bin/scape_kernels_cuda_test
  bin_cpu_test=$bundle/bin/scape_kernels_cpu_test
  bin_fatbin=$bundle/bin/scape_fatbin_check
  bin_bench=$bundle/bin/scape_kernels_gpu_bench
  bin_optim=$bundle/bin/gpu_optim_check
  check_bin=$bundle/bin/gpu_device_check
  # NCCL: the machine's own.
  nccl_dir=${NCCL_LIBRARY_DIR:-}
  if [ -z "$nccl_dir" ]; then
    nccl=$( (python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' 2>/dev/null |
             xargs -r -I{} find {} -name 'libnccl.so.2' 2>/dev/null
             find /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /opt /usr/local -name 'libnccl.so.2' 2>/dev/null) | head -1)
    [ -n "$nccl" ] && nccl_dir=$(dirname "$nccl")
  fi
  [ -n "$nccl_dir" ] || fail "no libnccl.so.2 on this machine (set NCCL_LIBRARY_DIR)"
  echo "NCCL: $nccl_dir"
  fig "- NCCL: $nccl_dir"
  export LD_LIBRARY_PATH=$bundle/lib${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export UCX_MODULE_DIR=$bundle/lib/ucx SCAPE_NCCL_LIBRARY=${nccl_dir:+$nccl_dir/}libnccl.so.2
else
say "1. configure and build ($build, -j$jobs)"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSCAPE_WITH_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" >"$logs/configure.log" 2>&1 ||
  { tail -30 "$logs/configure.log"; fail "configure (log: $logs/configure.log)"; finish; }
optim_target=""
help=$(cmake --build "$build" --target help)
grep -q '\.\.\. gpu_optim_check$' <<<"$help" && optim_target=gpu_optim_check
timeout 300 cmake --build "$build" -j "$jobs" --target nccl-net-scape scape_kernels_cuda_test \
  scape_kernels_cpu_test scape_kernels_gpu_bench scape_fatbin_check device_coll_test \
  device_nccl_backend_test device_dlopen_test $optim_target >"$logs/build.log" 2>&1 ||
  { grep -E "error|Error" "$logs/build.log" | head -30; fail "build (log: $logs/build.log)"; finish; }
so=$(readlink -f "$build/lib/libnccl-net-scape.so")
bin_cuda_test=$build/tests/kernels/scape_kernels_cuda_test
bin_cpu_test=$build/tests/kernels/scape_kernels_cpu_test
bin_fatbin=$build/tests/kernels/scape_fatbin_check
bin_bench=$build/perf/kernels/scape_kernels_gpu_bench
bin_optim=$build/perf/gpu_optim_check
check_bin=$logs/gpu_device_check
echo "built in $(( $(date +%s) - start )) s: $so"
fi

check packaging
say "2. packaging of the shipped library"
if [ -n "$bundle" ]; then
  echo "bundle: the ctest packaging checks ran in CI; NEEDED and .nv_fatbin checked below"
elif (cd "$build" && ctest -R "device\.so_|kernels\.fatbin|ShippedLibrary" --output-on-failure) \
  >"$logs/packaging.log" 2>&1; then
  grep -E "tests passed" "$logs/packaging.log"
else
  tail -40 "$logs/packaging.log"
  fail "packaging checks (log: $logs/packaging.log)"
fi
fig ""
fig "## Packaging"
fig '```'
bash "$root/tests/device/check_needed.sh" "$so" >>"$figures.tmp" 2>&1
"$bin_fatbin" "$so" 80 90 ptx90 containers=3 >>"$figures.tmp" 2>&1 ||
  fail "fatbin of $so"
fig '```'

check cuda-kernels
say "3. CUDA kernels vs the CPU kernels"
out=$logs/cuda_test.txt
timeout 180 "$bin_cuda_test" >"$out" 2>&1
rc=$?
grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) ' "$out" | tail -40
fig ""
fig "## CUDA kernel tests against the CPU kernels"
fig '```'
grep -E '^\[ +(PASSED|FAILED|SKIPPED) ' "$out" >>"$figures.tmp"
fig '```'
if grep -q '^\[  SKIPPED \]' "$out"; then fail "CUDA tests skipped: the GPU is not visible to them"
elif [ $rc -ne 0 ]; then fail "CUDA kernel tests (log: $out)"; fi
timeout 60 "$bin_cpu_test" --gtest_brief=1 >"$logs/cpu_test.txt" 2>&1 ||
  fail "CPU kernel tests in the CUDA build (log: $logs/cpu_test.txt)"
[ -n "$bundle" ] || (cd "$build" && SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo timeout 120 ctest -R "Device|NcclBackend|StagePlan" \
  --output-on-failure) >"$logs/device_cpu_tests.log" 2>&1 ||
  fail "device tests with the fake device (log: $logs/device_cpu_tests.log)"

check device-data-path
say "4. device data path: UCX staged and NCCL backends, 2 and 4 ranks on one GPU"
[ -n "$bundle" ] || g++ -std=c++17 -O2 -Wall -Wextra -o "$check_bin" "$root/perf/gpu/gpu_device_check.cc" \
  -I"$root/include" -I"$build/include" -I"$cuda/include" -L"$(dirname "$so")" -lnccl-net-scape \
  -L"$cuda/lib64" -lcudart -lnccl -Wl,-rpath,"$(dirname "$so")" -Wl,-rpath,"$cuda/lib64" \
  >"$logs/check_build.log" 2>&1 || { cat "$logs/check_build.log"; fail "cannot build perf/gpu/gpu_device_check.cc"; }
fig ""
fig "## Device data path (perf/gpu/gpu_device_check.cc, N = $dn floats)"
# 2 and 4 ranks at the default chunk size, then 2 ranks with 64 KiB chunks (the pipeline with
# many chunks per job: the stream's bounded queue of pending work fills).
for cfg in 2 4 2:65536; do
  P=${cfg%%:*}
  chunk=${cfg#*:}; [ "$chunk" = "$cfg" ] && chunk=""
  [ -x "$check_bin" ] || break
  [ "$(left)" -gt 60 ] || { fail "out of time before the $P-rank device check"; break; }
  dir=$logs/ranks$P${chunk:+_chunk$chunk}
  rm -rf "$dir"; mkdir -p "$dir"
  pids=()
  for ((r = 0; r < P; ++r)); do
    (
      export NCCL_NET_PLUGIN="$so" NCCL_NET=SCAPE NCCL_HOSTID="scape-fake-node-$r"
      export NCCL_NET_PLUGIN_REF_COUNT=1 NCCL_SOCKET_IFNAME=lo SCAPE_NCCL_DEVICES="=lo"
      export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH
      export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
      tmo=150
      [ -n "$chunk" ] && { export SCAPE_DEVICE_CHUNK_BYTES=$chunk SCAPE_TIMEOUT_MS=30000; tmo=60; }
      exec timeout -k 5 $tmo "$check_bin" "$r" "$P" "$dir" "$dn" "$iters" $((tmo - 10))
    ) >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  grep -h '^ok: ' "$dir/rank0.log" | sed 's/^/  /'
  grep -h 'CHECK FAILED\|rank [0-9]*: ' "$dir"/rank*.log | grep -v NCCL | head -10 | sed 's/^/  ! /'
  fig ""
  fig "### $P ranks${chunk:+, SCAPE_DEVICE_CHUNK_BYTES=$chunk}"
  fig '```'
  grep -h '^RESULT' "$dir/rank0.log" >>"$figures.tmp"
  fig '```'
  [ $rc -eq 0 ] || fail "$P-rank device check (logs: $dir)"
  for ((r = 0; r < P; ++r)); do
    grep -q "via NET/SCAPE" "$dir/rank$r.log" ||
      fail "$P ranks: rank $r's NCCL did not use the SCAPE net plugin (no 'via NET/SCAPE')"
  done
done

check kernel-timings
say "5. kernel timings (n = $n, $iters calls each)"
bench=$logs/bench.txt
if [ "$(left)" -gt 30 ] && timeout "$(left)" "$bin_bench" "$n" "$iters" >"$bench" 2>&1; then
  cat "$bench"
  fig ""
  fig "## Kernels (perf/kernels/bench_kernels_gpu.cc), x_copy = time / (bytes / D2D bandwidth)"
  fig '```'
  cat "$bench" >>"$figures.tmp"
  fig '```'
  # Targets (worst matching row): pack (candidate+pack+residual) and unpack (+AdamS) at >= 70%
  # of D2D copy speed,
  # top-k (bytes = one read of the n floats) at <= 3x one HBM read pass.
  verdict() {  # name-regex, op, limit, label
    local x
    x=$(grep -E "^$1" "$bench" | awk '{print $NF}' | sort -g | tail -1)  # the worst row
    if [ -z "$x" ]; then fail "no '$1' row in the kernel table"; return; fi
    if awk -v x="$x" -v l="$3" -v op="$2" 'BEGIN { e = (op == "eff") ? 1 / x : x;
         exit !((op == "eff" && e >= l) || (op == "ratio" && e <= l)) }'; then
      fig "- $4: x_copy = $x: meets the target"
    else
      fig "- $4: x_copy = $x: MISSES the target"
      fail "$4 (x_copy $x)"
    fi
  }
  fig ""
  verdict "candidate\\+pack\\+residual fp32" eff 0.70 "pack (candidate+pack+residual fp32) >= 70% of D2D"
  verdict "unpack\\+AdamS update fp32" eff 0.70 "unpack (+AdamS update fp32) >= 70% of D2D"
  verdict "gather fp32" eff 0.70 "pack (gather fp32, worst of d = 0.01, 0.1, 1.0) >= 70% of D2D"
  verdict "scatter fp32" eff 0.70 "unpack (scatter fp32, worst of d = 0.01, 0.1, 1.0) >= 70% of D2D"
  verdict "top-k exact" ratio 3 "top-k exact on $n floats <= 3x one read pass"
  verdict "top-k sampled" ratio 3 "top-k sampled on $n floats <= 3x one read pass"
else
  cat "$bench" 2>/dev/null | tail -20
  fail "kernel timings (log: $bench)"
fi

check optimizer-on-device
say "6. optimizer step on device vs host, SCAPE step vs dense AdamS step (2 ranks, n = $dn)"
fig ""
fig "## Optimizer step on device (perf/gpu/gpu_optim_check.cc, 2 ranks, n = $dn, density 0.01, 20 steps)"
# optim_pair NAME LIMIT_S LABEL ARGS...: gpu_optim_check on 2 ranks (ARGS after RANK NRANKS DIR),
# its RESULT lines to the figures, a failure unless it exited 0 and matched the host bit for bit.
optim_pair() {
  local name=$1 limit=$2 label=$3 dir=$logs/$1 rc=0 p
  shift 3
  rm -rf "$dir"; mkdir -p "$dir"
  local pids=()
  for r in 0 1; do
    (
      export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
      exec timeout -k 5 "$(( $(left) > limit ? limit : $(left) ))" "$bin_optim" "$r" 2 "$dir" "$@"
    ) >"$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  grep -h '^RESULT' "$dir/rank0.log"
  grep -h 'rank [0-9]*: ' "$dir"/rank*.log | head -10 | sed 's/^/  ! /'
  fig '```'
  grep -h '^RESULT' "$dir/rank0.log" >>"$figures.tmp"
  fig '```'
  [ $rc -eq 0 ] || fail "$label (logs: $dir)"
  grep -q '^RESULT optim_bits_match 1' "$dir/rank0.log" ||
    fail "$label: not bit-identical to the host step"
}
if [ -x "$bin_optim" ] && [ "$(left)" -gt 30 ]; then
  optim_pair optim 200 "optimizer step on device" "$dn" 0.01 20 20
  # bf16 payloads (the rounding error fed back into the residual on the device too): 20 steps
  # bit for bit, no timed steps.
  fig ""
  fig "bf16 payloads (20 steps, not timed):"
  optim_pair optim_bf16 120 "bf16 optimizer step on device" "$dn" 0.01 20 0 bf16
  # e4m3 payloads (issue 33: the scale's max all-reduce and the two conversion kernels on the
  # device): 20 steps bit for bit, no timed steps.
  fig ""
  fig "e4m3 payloads (20 steps, not timed):"
  optim_pair optim_e4m3 120 "e4m3 optimizer step on device" "$dn" 0.01 20 0 e4m3
  # Sharded ownership (the owners' pairs all-gathered on the stream, AdamSUpdatePairs and
  # UnpackPairsDecay on the GPU): 20 steps bit for bit, no timed steps.
  fig ""
  fig "sharded ownership (20 steps, not timed):"
  optim_pair optim_sharded 120 "sharded optimizer step on device" "$dn" 0.01 20 0 f32 sharded
else
  fail "optimizer step on device: no $bin_optim (or out of time)"
fi

finish
