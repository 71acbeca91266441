#!/usr/bin/env bash
# Sourced by tests/run_all.sh, tests/tsan/run.sh and tests/fuzz/run.sh. scape_generator DIR
# prints the CMake generator arguments for the build tree DIR: "-G Ninja" for a new tree when
# ninja is installed (tests/install_deps.sh installs ninja-build; Ninja starts a target's
# compiles before the libraries it links are archived, so both cores stay busy across targets,
# where Make finishes one target before starting the next), nothing otherwise: a tree that was
# configured before keeps its generator (CMake refuses to switch one), and without ninja CMake
# uses Make.
scape_generator() {
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja > /dev/null 2>&1; then
    echo "-G Ninja"
  fi
}
