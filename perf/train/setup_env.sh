# Sourced by the training studies' scripts (run.sh, run_scaling.sh, run_quality.sh) from the
# repository root: installs what is missing and builds the library into BUILD_DIR (unless
# SKIP_BUILD=1), then exports what every rank needs (the package from BUILD_DIR, one thread a
# rank, loopback).
BUILD_DIR=${BUILD_DIR:-build}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  bash tests/install_deps.sh
  cmake -B "$BUILD_DIR" -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 ||
    { cat "$BUILD_DIR.cmake.log"; exit 1; }
  rm -f "$BUILD_DIR.cmake.log"
  cmake --build "$BUILD_DIR" -j2 --target nccl-net-scape
fi
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 SCAPE_SOCKET_IFNAME=${SCAPE_SOCKET_IFNAME:-lo}
