#!/usr/bin/env bash
# The main job: installs what is missing, builds (release), and runs scape-perf's dense
# all-reduce across 2 and 4 local ranks beside Open MPI's MPI_Allreduce on the same sizes
# (1 MiB - 256 MiB), printing both tables and the bus-bandwidth ratios. About 3-5 minutes on
# a 2-core machine.
#   bash perf/main_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/install_deps.sh
cmake -B build -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > build.cmake.log 2>&1 || { cat build.cmake.log; exit 1; }
rm -f build.cmake.log
cmake --build build -j2 --target scape-perf mpi-allreduce-perf
lscpu | grep -E "^(Model name|CPU\(s\))" || true
bash perf/compare_mpi.sh build
