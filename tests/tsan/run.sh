#!/usr/bin/env bash
# ThreadSanitizer pass over the tests where several threads touch one communicator or engine:
# a call blocked in a collective or a mask sync and scapeCommAbort from another thread, the
# mask's background sync thread, peer death during a sync; and the NCCL net plugin driven from
# several threads on one context (two comms on two threads, test() on requests another thread
# posted, registration beside progress). Built with clang-14 -fsanitize=thread in build-tsan/
# (or $SCAPE_TSAN_DIR).
#   bash tests/tsan/run.sh
#   bash tests/tsan/run.sh --build-only   # configure and build only (run_all.sh builds it in the
#                                         # background while other tests run)
# Clean means: every selected test passes and no "ThreadSanitizer" report appears (TSan also
# fails the process that reports, exit code 66).
set -euo pipefail
cd "$(dirname "$0")/../.."
build_only=0
[ "${1:-}" = "--build-only" ] && build_only=1
dir="${SCAPE_TSAN_DIR:-build-tsan}"
# The NCCL plugin's fake-NCCL tests load it as a shared library, which clang 14's
# ThreadSanitizer runtime does not support here (a .so needs -shared-libsan, whose executables
# crash at start on this machine): the pass runs nccl_net_threads_test instead, which links the
# plugin's entry points (net_v11.cc and the shims) and its UCX engine statically.
source tests/cmake_generator.sh
# shellcheck disable=SC2046 # scape_generator prints nothing or two words
# -O1 -g1 (line tables): what ThreadSanitizer's reports need, at half the compile time of -O2 -g.
CC=clang-14 CXX=clang++-14 cmake $(scape_generator "$dir") -B "$dir" -S . -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" \
  -DSCAPE_WITH_CUDA=OFF -DSCAPE_BUILD_PERF=OFF -DSCAPE_SANITIZE=thread \
  -DCMAKE_EXE_LINKER_FLAGS= -DCMAKE_SHARED_LINKER_FLAGS= \
  > "$dir.cmake.log" 2>&1 || { cat "$dir.cmake.log"; exit 1; }
rm -f "$dir.cmake.log"
cmake --build "$dir" -j"${SCAPE_JOBS:-2}" --target errors_test mask_test reliability_test \
  nccl_net_threads_test
[ "$build_only" = 1 ] && exit 0
export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_WARN_UNUSED_ENV_VARS=n
export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan/tsan.supp halt_on_error=1 second_deadlock_stack=1"
unset ASAN_OPTIONS UBSAN_OPTIONS LSAN_OPTIONS
log="$dir/tsan.log"
: > "$log"
run() {
  echo "tsan: $1 --gtest_filter=$2"
  if ! timeout 600 "$dir/tests/$1" --gtest_filter="$2" >> "$log" 2>&1; then
    grep -A30 "ThreadSanitizer" "$log" | head -80 || tail -40 "$log"
    echo "TSAN FAILURE in $1 ($2); full log: $log" >&2
    exit 1
  fi
}
run errors_test 'Errors.AbortFromAnotherThread*:Errors.RankDeathDuringMaskSync*:Errors.AbortNotifiesPeers'
run mask_test 'Mask.AsyncFormsP3:Mask.AbortWithALiveMask:Mask.RepeatedStepsWithChangingK'
run reliability_test 'Abort.*:MaskArgs.SyncWithoutSelecting*:Mismatch.Broadcast*'
run nccl/nccl_net_threads_test 'Threads.*'
if grep -q "WARNING: ThreadSanitizer" "$log"; then
  grep -A30 "WARNING: ThreadSanitizer" "$log" | head -80
  echo "TSAN: reports in $log" >&2
  exit 1
fi
echo "tsan: clean ($(grep -c '^\[       OK \]' "$log") tests, no report)"
