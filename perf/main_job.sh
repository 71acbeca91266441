#!/usr/bin/env bash
# The main job: installs what is missing, builds (release), and runs the default comparison
# (perf/compare_all.sh) at 2 and 4 local ranks on one 64 Mi fp32 buffer (256 MiB), densities
# 1.0 / 0.1 / 0.01: Open MPI's MPI_Allreduce, Gloo's ring all-reduce, the COO sparse baseline,
# SCAPE dense and SCAPE masked, the mask-sync table and the limits (memcpy, UCX loopback), then
# a summary of the speedups and targets, the step-time model and perf-results/results.png.
# Both peers are required: if CMake did not configure one, the job stops with an error.
# About 3-5 minutes on a 2-core machine. The dense 1 MiB - 256 MiB table against MPI alone is
# perf/compare_mpi.sh.
#   bash perf/main_job.sh            (BUILD_DIR=... to build elsewhere than ./build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
bash tests/install_deps.sh
cmake -B "$BUILD_DIR" -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 ||
  { cat "$BUILD_DIR.cmake.log"; exit 1; }
# The job promises both peers: install_deps.sh installs Open MPI and Debian's libgloo-dev, so a
# peer CMake did not configure is an error here, not a silent skip. perf/CMakeLists.txt lists
# the peers it configured in perf/peers.txt (read from a file, not from a pipe: under pipefail,
# `cmake --build --target help | grep -q` fails when grep exits early and make gets SIGPIPE,
# which once made this job skip the Gloo peer without a word).
peers_file="$BUILD_DIR/perf/peers.txt"
configured=$(cat "$peers_file" 2>/dev/null || true)
for peer in mpi gloo; do
  if ! grep -qw "$peer" <<<"$configured"; then
    echo "main_job.sh: ERROR: the $peer peer was not configured: CMake did not find it" \
      "($peers_file lists '${configured}'), although tests/install_deps.sh installs it." \
      "CMake said:" >&2
    grep -i "perf\|mpi\|gloo" "$BUILD_DIR.cmake.log" >&2 || cat "$BUILD_DIR.cmake.log" >&2
    exit 1
  fi
done
rm -f "$BUILD_DIR.cmake.log"
cmake --build "$BUILD_DIR" -j2 --target scape-perf mpi-allreduce-perf gloo-allreduce-perf
# The set-up also makes `import scape` work for /usr/bin/python3 (the package staged in the build).
cmake --build "$BUILD_DIR" -j2 --target nccl-net-scape
bash python/develop.sh "$BUILD_DIR"
lscpu | grep -E "^(Model name|CPU\(s\))" || true
# Debian's matplotlib is in the system interpreter (a pyenv shim may come first on PATH).
if [ -x /usr/bin/python3 ]; then export PYTHON=/usr/bin/python3; fi
REQUIRE_PEERS="mpi gloo" bash perf/compare_all.sh "$BUILD_DIR" "$BUILD_DIR/perf-results"
