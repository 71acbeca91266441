#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-14, AddressSanitizer + UndefinedBehaviorSanitizer,
# coverage on the whole library) in build-fuzz/ and runs each on its corpus.
#   bash tests/fuzz/run.sh                 # 10M executions per target (the issue's bar; long)
#   bash tests/fuzz/run.sh --runs 200000   # N executions per target
#   bash tests/fuzz/run.sh --smoke         # CI: every target for a few seconds, <= 60 s in all
#   bash tests/fuzz/run.sh --seconds 600   # a time budget per target instead of a count
#   bash tests/fuzz/run.sh --build-only    # configure and build only (run_all.sh builds it in the
#                                          # background while other tests run)
# New inputs that libFuzzer finds go to build-fuzz/corpus/<target>/ (a copy of
# tests/fuzz/corpus/<target>/), never into the repository. A crash, leak or sanitizer report
# stops the run with a non-zero exit; the reproducer is left in build-fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=10000000
seconds=0
smoke=0
build_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --build-only) build_only=1; shift ;;
    *) echo "usage: $0 [--runs N | --seconds S | --smoke | --build-only]" >&2; exit 2 ;;
  esac
done
targets=(fuzz_bootstrap_hello fuzz_bootstrap_reply fuzz_unique_id fuzz_mask_decode
         fuzz_nccl_handle fuzz_optim_checkpoint)
if [ ! -x build-fuzz/tests/fuzz/fuzz_make_seeds ] || [ "${SCAPE_FUZZ_REBUILD:-1}" = "1" ]; then
  source tests/cmake_generator.sh
  # shellcheck disable=SC2046 # scape_generator prints nothing or two words
  # -O1 -g1 (line tables): libFuzzer's and the sanitizers' reports keep file and line, at about
  # four fifths of the compile time of -O2 -g.
  CC=clang-14 CXX=clang++-14 cmake $(scape_generator build-fuzz) -B build-fuzz -S . -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DCMAKE_C_FLAGS_DEBUG="-O1 -g1" \
    -DSCAPE_WITH_CUDA=OFF -DSCAPE_BUILD_PERF=OFF -DSCAPE_SANITIZE=address,undefined -DSCAPE_FUZZ=ON \
    -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link \
    > build-fuzz.cmake.log 2>&1 || { cat build-fuzz.cmake.log; exit 1; }
  rm -f build-fuzz.cmake.log
  cmake --build build-fuzz -j"${SCAPE_JOBS:-2}" --target fuzz_all
fi
[ "$build_only" = 1 ] && exit 0
# UCX's allocator hooks fight the sanitizer's (as in the sanitizer pass of run_all.sh); every
# target that needs a communicator keeps it on loopback.
export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_WARN_UNUSED_ENV_VARS=n
export SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/tests/fuzz/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p build-fuzz/corpus build-fuzz/artifacts
if [ ! -d tests/fuzz/corpus/fuzz_bootstrap_hello ]; then
  build-fuzz/tests/fuzz/fuzz_make_seeds tests/fuzz/corpus
fi
total_start=$(date +%s)
for t in "${targets[@]}"; do
  work="build-fuzz/corpus/$t"
  mkdir -p "$work"
  [ -d "tests/fuzz/corpus/$t" ] && cp -n tests/fuzz/corpus/$t/* "$work/" 2>/dev/null || true
  args=(-max_len=70000 -timeout=20 -rss_limit_mb=3072 -print_final_stats=1
        -artifact_prefix="build-fuzz/artifacts/$t-")
  if [ "$smoke" = "1" ]; then
    args+=(-max_total_time=6)
  elif [ "$seconds" != "0" ]; then
    args+=(-max_total_time="$seconds")
  else
    args+=(-runs="$runs")
  fi
  log="build-fuzz/$t.log"
  start=$(date +%s)
  if ! "build-fuzz/tests/fuzz/$t" "${args[@]}" "$work" > "$log" 2>&1; then
    tail -40 "$log"
    echo "FUZZ FAILURE: $t (log: $log; reproducer in build-fuzz/artifacts/)" >&2
    exit 1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo '?')
  echo "fuzz $t: $execs executions in $(( $(date +%s) - start )) s, coverage $cov, corpus $(ls "$work" | wc -l) inputs, no crash/leak/sanitizer report"
done
echo "fuzz: all targets clean in $(( $(date +%s) - total_start )) s"
