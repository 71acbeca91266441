#!/usr/bin/env bash
# The pip route (ctest: Packaging.PipWheel, labels pip and network). Builds the wheel with
# `python3 -m pip wheel` from the source tree (pyproject.toml, scikit-build-core), checks its
# name and contents, installs it into a fresh venv made with --system-site-packages over the
# system's torch, and from there, with no build tree or source tree on the path, runs a 2-rank
# ScapeAdamS step under `python3 -m scape.launch -n 2`. Then installs it into a second, plain
# venv (no torch, no numpy) and imports the package there.
#
#   bash tests/packaging/pip_wheel_test.sh SOURCE_DIR WORK_DIR [PYTHON]
#
# Network: pip builds the wheel in an isolated environment that needs scikit-build-core (and
# its dependencies, packaging and pathspec) from PyPI. They are downloaded once into
# WORK_DIR/wheelhouse and the build then runs with --no-index from there, so only the first
# run needs PyPI. Offline on a first run, the test is skipped (exit 77) with a message that
# says so. WORK_DIR/skbuild is the CMake build folder of the wheel (scikit-build-core's
# build-dir), kept between runs so that a rebuild is incremental. The wheel is built without
# CUDA (the kernels would take minutes to compile; the wheel a GPU user builds has them:
# SCAPE_WITH_CUDA=AUTO). KEEP=1 keeps the venvs and the wheel.
set -u -o pipefail

src=$(cd "${1:?usage: pip_wheel_test.sh SOURCE_DIR WORK_DIR [PYTHON]}" && pwd)
work=${2:?WORK_DIR}
py=${3:-/usr/bin/python3}
mkdir -p "$work"
work=$(cd "$work" && pwd)
wh=$work/wheelhouse
dist=$work/dist
venv=$work/venv
plain=$work/venv-plain
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok:   $*"; }
skip() { echo "SKIP: $*"; exit 77; }
cleanup() {
  [ "${KEEP:-0}" = 1 ] && { echo "kept $work"; return; }
  rm -rf "$venv" "$plain" "$work/run"
}
trap cleanup EXIT

version=$(sed -n 's/^project(scape_comm VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
[ -n "$version" ] || { echo "FAIL: no version in $src/CMakeLists.txt"; exit 1; }
"$py" -m pip --version >/dev/null 2>&1 || skip "$py has no pip (Debian: apt-get install python3-pip)"
"$py" -c 'import ensurepip' >/dev/null 2>&1 || skip "$py cannot make venvs (Debian: apt-get install python3-venv)"

# ---- 1. the build backend, from PyPI once -----------------------------------------------------
mkdir -p "$wh"
if ! ls "$wh"/scikit_build_core-*.whl >/dev/null 2>&1; then
  echo "downloading the build backend (scikit-build-core) into $wh"
  if ! "$py" -m pip download --disable-pip-version-check --timeout 20 --retries 1 \
       --only-binary=:all: -d "$wh" "scikit-build-core>=0.10" >"$work/download.log" 2>&1; then
    tail -5 "$work/download.log"
    skip "PyPI is not reachable and $wh holds no scikit-build-core wheel: pip's isolated" \
         "build needs the build backend from PyPI the first time (later runs are offline)"
  fi
fi
pass "build backend: $(cd "$wh" && ls scikit_build_core-*.whl | tail -1)"

# ---- 2. python3 -m pip wheel . ----------------------------------------------------------------
rm -rf "$dist"
launcher=()
command -v ccache >/dev/null 2>&1 &&
  launcher=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
            --config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache)
# scikit-build-core runs `cmake --build`, which takes its job count from
# CMAKE_BUILD_PARALLEL_LEVEL; without it Ninja runs every core + 2 jobs, too many beside the
# rest of the suite on the 2-core CI machine (run_all.sh builds with -j2 too).
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
t0=$(date +%s)
if ! (cd "$src" && "$py" -m pip wheel --disable-pip-version-check --no-index --find-links "$wh" \
        --no-deps -w "$dist" --config-settings=build-dir="$work/skbuild" \
        --config-settings=cmake.define.SCAPE_WITH_CUDA=OFF \
        "${launcher[@]}" .) >"$work/wheel.log" 2>&1; then
  tail -40 "$work/wheel.log"
  echo "FAIL: python3 -m pip wheel . (log: $work/wheel.log)"
  exit 1
fi
whl=$(ls "$dist"/*.whl)
pass "pip wheel . in $(( $(date +%s) - t0 )) s: $(basename "$whl")"
expect="scape_comm-$version-py3-none-linux_x86_64.whl"
[ "$(basename "$whl")" = "$expect" ] || fail "wheel name $(basename "$whl"), expected $expect"

# ---- 3. the wheel's contents ------------------------------------------------------------------
list=$("$py" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$whl")
for f in scape/__init__.py scape/_lib.py scape/optim.py scape/launch.py scape/py.typed \
         scape/integrations/__init__.py scape/integrations/hf.py \
         scape/libnccl-net-scape.so; do
  grep -qx "$f" <<<"$list" && pass "wheel holds $f" || fail "wheel lacks $f"
done
bad=$(grep -E '_build_info\.py|__pycache__|\.pyc$|^include/|^lib/|cmake/|scape-perf' <<<"$list")
[ -z "$bad" ] && pass "nothing else (no _build_info.py, headers, CMake package, caches)" ||
  fail "unexpected files in the wheel: $bad"
meta=$("$py" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
print(z.read([n for n in z.namelist() if n.endswith(".dist-info/WHEEL")][0]).decode())' "$whl")
grep -qx "Tag: py3-none-linux_x86_64" <<<"$meta" && grep -qx "Root-Is-Purelib: false" <<<"$meta" &&
  pass "WHEEL: one tag py3-none-linux_x86_64, platlib" || fail "WHEEL metadata: $meta"
mkdir -p "$work/run"
"$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("scape/libnccl-net-scape.so", sys.argv[2])' \
  "$whl" "$work/run/x"
bash "$src/tests/device/check_needed.sh" "$work/run/x/scape/libnccl-net-scape.so" >"$work/run/needed.log" 2>&1 &&
  pass "the wheel's library needs no libcuda, libcudart or libnccl" ||
  { cat "$work/run/needed.log"; fail "NEEDED of the wheel's library"; }
if readelf -d "$work/run/x/scape/libnccl-net-scape.so" | grep -E 'R(UN)?PATH' | grep -qE "$src|$work"; then
  fail "the wheel's library has an RPATH into the source or build tree"
else
  pass "no RPATH into the source or build tree"
fi

# ---- 4. a venv over the system's torch: a 2-rank ScapeAdamS step from the installed wheel ----
rm -rf "$venv" "$plain"
"$py" -m venv --system-site-packages "$venv" >"$work/venv.log" 2>&1 ||
  { cat "$work/venv.log"; echo "FAIL: venv"; exit 1; }
"$venv/bin/python" -m pip install --disable-pip-version-check --no-index --no-deps -q "$whl" \
  >"$work/install.log" 2>&1 || { cat "$work/install.log"; echo "FAIL: pip install of the wheel"; exit 1; }
pass "installed into a venv with --system-site-packages"

# No build tree or source tree anywhere: a neutral working directory, no PYTHONPATH, no user
# site-packages (python/develop.sh puts a .pth to a build tree there, which would come first).
clean_env=(env -u PYTHONPATH -u SCAPE_LIBRARY -u LD_LIBRARY_PATH PYTHONNOUSERSITE=1
           PYTHONDONTWRITEBYTECODE=1 SCAPE_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo
           UCX_WARN_UNUSED_ENV_VARS=n OMP_NUM_THREADS=1)
cat >"$work/run/step.py" <<'EOF'
"""Two ranks, one ScapeAdamS step at density 0.1 and two more, from the installed wheel."""
import os, sys
import numpy as np
import torch
import scape
from scape.optim import ScapeAdamS

venv = os.path.realpath(sys.prefix)
for what, path in (("scape", scape.__file__), ("library", scape.library_path())):
    if not os.path.realpath(path).startswith(venv + os.sep):
        sys.exit(f"{what} comes from {path}, not from the venv {venv}")
with scape.Communicator.from_env(timeout_ms=60000) as comm:
    torch.manual_seed(1234 + comm.rank)  # different on each rank: the broadcast makes them equal
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = ScapeAdamS(m.parameters(), comm, lr=1e-2, density=0.1, max_grad_norm=1.0)
    before = opt.parameter_hash()
    x = torch.randn(32, 64)
    for _ in range(3):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    info = opt.info()[0]
    after = opt.parameter_hash()
    mine = np.frombuffer(bytes.fromhex(after), dtype=np.int64).copy()
    every = comm.all_gather(mine).reshape(comm.size, -1)
    if after == before:
        sys.exit("the parameters did not change")
    if not (every == every[0]).all():
        sys.exit("ranks differ after the step")
    if info["step"] != 3 or info["bytes_sent"] <= 0:
        sys.exit(f"unexpected step info {info}")
    opt.destroy()
    print(f"rank {comm.rank}/{comm.size}: 3 steps, {info['bytes_sent']} bytes in the last, "
          f"hash {after[:16]} on every rank; scape {scape.__version__} from {scape.__file__}, "
          f"library {scape.library_path()}", flush=True)
EOF
if (cd "$work/run" && "${clean_env[@]}" timeout 150 "$venv/bin/python" -m scape.launch -n 2 \
      --timeout 120 step.py) >"$work/run/step.log" 2>&1; then
  cat "$work/run/step.log"
  pass "2-rank ScapeAdamS step from the installed wheel (python3 -m scape.launch -n 2)"
else
  cat "$work/run/step.log"
  fail "2-rank ScapeAdamS step from the installed wheel"
fi

# ---- 5. a plain venv (no torch, no numpy): the package imports and loads its library --------
"$py" -m venv "$plain" >"$work/venv.log" 2>&1 &&
  "$plain/bin/python" -m pip install --disable-pip-version-check --no-index --no-deps -q "$whl" \
    >"$work/install.log" 2>&1 || { cat "$work/venv.log" "$work/install.log"; fail "plain venv install"; }
if out=$(cd "$work/run" && "${clean_env[@]}" "$plain/bin/python" -c '
import sys, scape
assert "torch" not in sys.modules and "numpy" not in sys.modules
v = scape.version()
assert scape.library_path().startswith(sys.prefix), scape.library_path()
print("scape", scape.__version__, "library version", v)' 2>&1); then
  pass "plain venv: $out"
else
  echo "$out"
  fail "import scape in a plain venv"
fi
# A _build_info.py left in the package folder (an earlier `cmake --install` into the same
# site-packages) names another real copy of the library: the wheel's own copy still wins.
pkg=$("$plain/bin/python" -c 'import os, scape; print(os.path.dirname(scape.__file__))')
echo "LIBRARY_PATH = \"$work/run/x/scape/libnccl-net-scape.so\"" >"$pkg/_build_info.py"
if out=$(cd "$work/run" && "${clean_env[@]}" "$plain/bin/python" -c '
import sys, scape
print(scape.library_path())
assert scape.library_path().startswith(sys.prefix)' 2>&1); then
  pass "the package's own library before a stale _build_info.py: $out"
else
  echo "$out"
  fail "a stale _build_info.py made the wheel load another library"
fi

[ $failures -eq 0 ] && { echo "pip wheel test: all passed"; exit 0; }
echo "pip wheel test: $failures failure(s)"
exit 1
