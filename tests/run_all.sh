#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds everything (CUDA kernels included when
# a toolkit is found), runs ctest, then rebuilds the CPU code under AddressSanitizer +
# UndefinedBehaviorSanitizer and runs the suite again.
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
phase "ctest (release)"
echo "=== ctest (release) ==="
# Tests run one at a time: multi-rank tests fork up to 8 ranks on 2 cores.
(cd build && ctest --output-on-failure --timeout 300)

if [ "${SCAPE_SKIP_SANITIZE:-0}" != "1" ]; then
  phase "build (ASan+UBSan)"
  echo "=== build (AddressSanitizer + UndefinedBehaviorSanitizer) ==="
  # -g1 (line tables only): the sanitizers' reports keep file and line; the full debug info of
  # -g costs about a tenth more compile time and is not read.
  # shellcheck disable=SC2046
  cmake $(scape_generator build-asan) -B build-asan -S . -DCMAKE_BUILD_TYPE=Debug -DSCAPE_WITH_CUDA=OFF -DSCAPE_BUILD_PERF=OFF \
        -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCMAKE_C_FLAGS_DEBUG=-g1 \
        -DSCAPE_SANITIZE=address,undefined > build-asan.cmake.log 2>&1 || { cat build-asan.cmake.log; exit 1; }
  rm -f build-asan.cmake.log
  cmake --build build-asan -j"$jobs"
  phase "ctest (ASan+UBSan)"
  echo "=== ctest (sanitizers) ==="
  # UCX's malloc/mmap hooks fight the sanitizer's allocator: turn them off for this pass.
  export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  (cd build-asan && ctest --output-on-failure --timeout 600)
fi
if [ "${SCAPE_SKIP_TSAN:-0}" != "1" ]; then
  phase "TSan (build + run)"
  echo "=== ThreadSanitizer (clang-14): the multi-threaded tests ==="
  # A subset: abort from another thread, the mask's sync thread, peer death during a sync, the
  # NCCL plugin's progress from several threads (tests/tsan/run.sh says which).
  (unset ASAN_OPTIONS UBSAN_OPTIONS; bash tests/tsan/run.sh)
fi
if [ "${SCAPE_SKIP_FUZZ:-0}" != "1" ]; then
  phase "fuzz (build + smoke)"
  echo "=== fuzz smoke (libFuzzer, every target a few seconds) ==="
  bash tests/fuzz/run.sh --smoke
fi
phase ""
echo "=== time per phase ==="
printf '%s\n' "${phases[@]}"
cpu_so_far
echo "total: $(($(date +%s) - run_start)) s wall, $cpu s CPU"
echo "=== all tests passed ==="
