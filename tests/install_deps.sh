#!/usr/bin/env bash
# Installs what the build, the tests and scape-perf need on a Debian 12 machine, skipping what
# is already there (so a warm machine does not touch the network). The CUDA toolkit is not
# installed here: CMake uses /usr/local/cuda when present and builds CPU-only otherwise.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libucx-dev ucx-utils libibverbs-dev librdmacm-dev
      openmpi-bin libopenmpi-dev googletest libgtest-dev libbenchmark-dev python3 libgloo-dev python3-matplotlib
      clang-format  # clang-format: tests/check_format.sh (Debian 12: version 14)
      ninja-build   # the test trees' generator when present (tests/cmake_generator.sh)
      # clang 14 with its runtimes: libFuzzer targets (tests/fuzz) and the ThreadSanitizer
      # pass (tests/tsan); iproute2 and util-linux: the off-host tests' namespaces.
      clang-14 libclang-rt-14-dev iproute2 util-linux
      # The Python package's tests and perf/train: Debian's torch (1.13) and numpy for
      # /usr/bin/python3, OpenBLAS (torch otherwise runs on the reference BLAS, ~10x slower),
      # and the fortune databases the training experiment reads.
      python3-numpy python3-torch libopenblas0-pthread fortunes
      # The pip route (pyproject.toml) and its test: pip and venv for /usr/bin/python3.
      python3-pip python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  # No pipe into grep -q: under pipefail an early grep exit can fail the writer (SIGPIPE).
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" == *"install ok installed"* ]] ||
    missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Hugging Face transformers and accelerate for /usr/bin/python3 (Debian's torch 1.13): the
# framework examples and their test (examples/hf_trainer_scape.py, accelerate_scape.py,
# tests/python/test_frameworks.py). Pinned, with every dependency Debian does not ship named
# and pinned too, and installed with --no-deps so that pip never pulls torch from PyPI or
# replaces a Debian package (numpy, packaging, psutil, pyyaml, requests and typing_extensions
# come from Debian). User site (/root/.local for root): Debian 12's pip refuses the system
# site; --break-system-packages only lifts that refusal for this user-site install.
# Skipped when the pinned versions already import.
hf_pins=(transformers==4.38.2 accelerate==0.27.2 huggingface-hub==0.20.3 tokenizers==0.15.2
         safetensors==0.4.2 regex==2023.12.25 tqdm==4.66.2 filelock==3.13.1 fsspec==2024.2.0)
if ! /usr/bin/python3 - "${hf_pins[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
import transformers, accelerate  # noqa: F401  (imports with Debian's torch)
PY
then
  echo "install_deps: pip installing ${hf_pins[*]} for /usr/bin/python3 (user site, --no-deps)"
  /usr/bin/python3 -m pip install --user --break-system-packages --no-deps \
    --disable-pip-version-check --no-warn-script-location -q "${hf_pins[@]}"
  /usr/bin/python3 -c "import transformers, accelerate, torch; print('install_deps: transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'torch', torch.__version__)"
fi
