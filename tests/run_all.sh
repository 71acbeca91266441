#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds everything (CUDA kernels included when
# a toolkit is found), runs ctest, then rebuilds the CPU code under AddressSanitizer +
# UndefinedBehaviorSanitizer and runs the suite again, then a ThreadSanitizer subset and a fuzz
# smoke. The sanitizer, TSan and fuzz builds run in the background (nice 19) during the tests
# before them, on the cores those tests leave idle.
#   bash tests/run_all.sh            # both passes
#   SCAPE_SKIP_SANITIZE=1 bash tests/run_all.sh   # the normal pass only
#   SCAPE_SKIP_TSAN=1 / SCAPE_SKIP_FUZZ=1           # without the ThreadSanitizer pass / the fuzz smoke
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's wall time and CPU time (user + system of everything it ran, from bash's `times`),
# printed at the end, so a slow run says where its time went even on a shared machine.
phases=()
phase_name=""
cpu_so_far() {  # sets cpu: CPU seconds of this shell's finished children so far
  local f u c
  f=$(mktemp)
  times > "$f"  # not in $(...): a subshell would see only its own (no) children
  { read -r _ _; read -r u c; } < "$f"
  rm -f "$f"
  cpu=$(awk -v u="$u" -v c="$c" 'BEGIN { split(u, a, "m"); split(c, b, "m")
                                         printf "%.0f", a[1] * 60 + a[2] + b[1] * 60 + b[2] }')
}
phase() {  # phase NAME: ends the current phase (if any) and starts NAME ("" to only end)
  local now
  now=$(date +%s)
  cpu_so_far
  if [ -n "$phase_name" ]; then
    phases+=("$(printf '%-30s %5d s wall %6d s CPU' "$phase_name" $((now - phase_t0)) $((cpu - phase_c0)))")
  fi
  phase_name=$1 phase_t0=$now phase_c0=$cpu
}
run_start=$(date +%s)

phase "install deps + format check"
bash tests/install_deps.sh
# DeepSpeed, megatron-core and Lightning, pinned, in a venv over Debian's torch (skipped when
# it is up to date): the python.fw_* tests run the examples with it.
bash tests/install_frameworks.sh
# Formatting first (cheap): fails on any file clang-format would change (SCAPE_CHECK_FORMAT=0 skips).
bash tests/check_format.sh

source tests/cmake_generator.sh

jobs=2
phase "build (release)"
echo "=== build (release) ==="
# shellcheck disable=SC2046 # scape_generator prints nothing or two words
cmake $(scape_generator build) -B build -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > build.cmake.log 2>&1 || { cat build.cmake.log; exit 1; }
rm -f build.cmake.log
cmake --build build -j"$jobs"
# `import scape` for /usr/bin/python3 from anywhere: a .pth in the user's site-packages that
# points at build/python (the package CMake staged, which knows build/lib's library).
bash python/develop.sh build
san=1 tsan=1 fuzz=1
[ "${SCAPE_SKIP_SANITIZE:-0}" = "1" ] && san=0
[ "${SCAPE_SKIP_TSAN:-0}" = "1" ] && tsan=0
[ "${SCAPE_SKIP_FUZZ:-0}" = "1" ] && fuzz=0

# The later passes' builds run in the background at nice 19 while the release tests run (and
# the TSan and fuzz builds while the sanitizer tests run): the tests leave a core idle much of
# the time (a rank waiting for a peer, a timeout test sleeping), and a nice-19 compiler takes
# only what the tests leave. Each build runs in its own process group, killed if this script
# exits early; its output goes to a log that is printed when it fails.
bg_asan="" bg_rest=""
stop_bg() {
  local p
  for p in $bg_asan $bg_rest; do kill -- -"$p" 2>/dev/null || true; done
}
trap stop_bg EXIT
# wait_bg PID LOG WHAT: waits for a background build; its log's tail and a failure if it failed.
wait_bg() {
  if ! wait "$1"; then
    tail -60 "$2"
    echo "FAILED: $3 (log: $2)" >&2
    exit 1
  fi
  echo "$3: done (log: $2)"
}
if [ "$san" = 1 ]; then
  echo "=== configure (AddressSanitizer + UndefinedBehaviorSanitizer); its build starts in the background ==="
  # -g1 (line tables only): the sanitizers' reports keep file and line; the full debug info of
  # -g costs about a tenth more compile time and is not read.
  # shellcheck disable=SC2046
  cmake $(scape_generator build-asan) -B build-asan -S . -DCMAKE_BUILD_TYPE=Debug -DSCAPE_WITH_CUDA=OFF -DSCAPE_BUILD_PERF=OFF \
        -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCMAKE_C_FLAGS_DEBUG=-g1 \
        -DSCAPE_SANITIZE=address,undefined > build-asan.cmake.log 2>&1 || { cat build-asan.cmake.log; exit 1; }
  rm -f build-asan.cmake.log
  setsid nice -n 19 cmake --build build-asan -j"$jobs" > build-asan.bg.log 2>&1 &
  bg_asan=$!
fi
if [ "$tsan" = 1 ] || [ "$fuzz" = 1 ]; then
  # after the sanitizer build (one background build at a time)
  # shellcheck disable=SC2016 # the inner script's positional parameters, not this one's
  setsid nice -n 19 bash -c 'while [ -n "$1" ] && kill -0 "$1" 2>/dev/null; do sleep 2; done
    { [ "$2" = 0 ] || bash tests/tsan/run.sh --build-only; } &&
    { [ "$3" = 0 ] || bash tests/fuzz/run.sh --build-only; }' bg "$bg_asan" "$tsan" "$fuzz" \
    > build-tsan-fuzz.bg.log 2>&1 &
  bg_rest=$!
fi

phase "ctest (release)"
echo "=== ctest (release) ==="
# Tests run one at a time: multi-rank tests fork up to 8 ranks on 2 cores.
(cd build && ctest --output-on-failure --timeout 300)

if [ "$san" = 1 ]; then
  phase "build (ASan+UBSan), the rest"
  echo "=== build (AddressSanitizer + UndefinedBehaviorSanitizer): waiting for the background build ==="
  wait_bg "$bg_asan" build-asan.bg.log "build (ASan+UBSan)"
  bg_asan=""
  phase "ctest (ASan+UBSan)"
  echo "=== ctest (sanitizers) ==="
  # UCX's malloc/mmap hooks fight the sanitizer's allocator: turn them off for this pass.
  (export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none
   export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
   export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
   cd build-asan && ctest --output-on-failure --timeout 600)
fi
if [ -n "$bg_rest" ]; then
  phase "build (TSan, fuzz), the rest"
  wait_bg "$bg_rest" build-tsan-fuzz.bg.log "build (TSan, fuzz)"
  bg_rest=""
fi
if [ "$tsan" = 1 ]; then
  phase "TSan (run)"
  echo "=== ThreadSanitizer (clang-14): the multi-threaded tests ==="
  # A subset: abort from another thread, the mask's sync thread, peer death during a sync, the
  # NCCL plugin's progress from several threads (tests/tsan/run.sh says which). Its build above
  # is up to date: the script's own build step finds nothing to do.
  bash tests/tsan/run.sh
fi
if [ "$fuzz" = 1 ]; then
  phase "fuzz (smoke)"
  echo "=== fuzz smoke (libFuzzer, every target a few seconds) ==="
  bash tests/fuzz/run.sh --smoke
fi
phase ""
echo "=== time per phase ==="
printf '%s\n' "${phases[@]}"
cpu_so_far
echo "total: $(($(date +%s) - run_start)) s wall, $cpu s CPU"
echo "=== all tests passed ==="
