# Sourced by the training studies' scripts (run.sh, run_scaling.sh, run_quality.sh) from the
# repository root: installs what is missing and builds the library into BUILD_DIR (unless
# SKIP_BUILD=1), then exports what every rank needs (the package from BUILD_DIR, one thread a
# rank, loopback).
BUILD_DIR=${BUILD_DIR:-build}
# SCAPE_TRAIN_CORPUS=pydoc (issue 42 item 1): the Python documentation's reStructuredText
# sources, from Debian's python3.11-doc (perf/train/data.py; apt may bring python3.11 itself to
# the matching point release).
if [ "${SCAPE_TRAIN_CORPUS:-fortunes}" = pydoc ] && ! dpkg -s python3.11-doc > /dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11-doc ||
    { echo "setup_env.sh: cannot install python3.11-doc (SCAPE_TRAIN_CORPUS=pydoc)" >&2; exit 1; }
fi
export SCAPE_TRAIN_CORPUS=${SCAPE_TRAIN_CORPUS:-fortunes}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  bash tests/install_deps.sh
  cmake -B "$BUILD_DIR" -S . -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$BUILD_DIR.cmake.log" 2>&1 ||
    { cat "$BUILD_DIR.cmake.log"; exit 1; }
  rm -f "$BUILD_DIR.cmake.log"
  cmake --build "$BUILD_DIR" -j2 --target nccl-net-scape
fi
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 SCAPE_SOCKET_IFNAME=${SCAPE_SOCKET_IFNAME:-lo}
