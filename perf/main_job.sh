#!/usr/bin/env bash
# The main job: installs what is missing, builds (release), and runs the default comparison
# (perf/compare_all.sh) at 2 and 4 local ranks on one 64 Mi fp32 buffer (256 MiB), densities
# 1.0 / 0.1 / 0.01: Open MPI's MPI_Allreduce, Gloo's ring all-reduce, the COO sparse baseline,
# SCAPE dense and SCAPE masked, the mask-sync table and the limits (memcpy, UCX loopback), then
# a summary of the speedups and targets, the step-time model and perf-results/results.png.
# About 3-5 minutes on a 2-core machine. The dense 1 MiB - 256 MiB table against MPI alone is
# perf/compare_mpi.sh.
#   bash perf/main_job.sh            (BUILD_DIR=... to build elsewhere than ./build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
bash tests/install_deps.sh
cmake -B "$BUILD_DIR" -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 ||
  { cat "$BUILD_DIR.cmake.log"; exit 1; }
rm -f "$BUILD_DIR.cmake.log"
targets=(scape-perf mpi-allreduce-perf)
# Gloo's peer exists when CMake found Debian's libgloo-dev.
if cmake --build "$BUILD_DIR" --target help 2>/dev/null | grep -q 'gloo-allreduce-perf'; then
  targets+=(gloo-allreduce-perf)
fi
cmake --build "$BUILD_DIR" -j2 --target "${targets[@]}"
lscpu | grep -E "^(Model name|CPU\(s\))" || true
# Debian's matplotlib is in the system interpreter (a pyenv shim may come first on PATH).
if [ -x /usr/bin/python3 ]; then export PYTHON=/usr/bin/python3; fi
bash perf/compare_all.sh "$BUILD_DIR" "$BUILD_DIR/perf-results"
