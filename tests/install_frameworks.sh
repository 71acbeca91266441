#!/usr/bin/env bash
# Installs the real training frameworks that tests/python/test_fw_*.py and examples/*_scape.py
# run against (DeepSpeed, megatron-core, PyTorch Lightning), pinned, into one venv over Debian's
# torch: `python3 -m venv --system-site-packages` (torch 1.13, numpy and friends from Debian; the
# user site, with transformers and the `scape` .pth of python/develop.sh, stays visible), then
# `pip install --no-deps` of every pin in tests/python/frameworks/requirements-*.txt, so pip
# never pulls a CUDA torch wheel (Debian's torch reports 1.13.0a0, which pip takes as older than
# any torch>=1.13 requirement). DeepSpeed builds with DS_BUILD_OPS=0 (no C++/CUDA ops).
# Skipped when the venv exists and was made from the same pins (a stamp of their contents).
#   bash tests/install_frameworks.sh        # prints the venv's python on its last line
# The venv: $SCAPE_FRAMEWORKS_VENV, default ~/.cache/scape/frameworks-venv (outside the
# checkout: a clean clone on the same machine reuses it).
set -euo pipefail
cd "$(dirname "$0")/.."
# HOME may be unset (a CI environment): the passwd entry's home, as Python's expanduser uses
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
venv=${SCAPE_FRAMEWORKS_VENV:-$home/.cache/scape/frameworks-venv}
reqs=(tests/python/frameworks/requirements-*.txt)
[ -e "${reqs[0]}" ] || { echo "install_frameworks: no requirement files" >&2; exit 1; }
stamp=$(cat /usr/bin/python3 --version 2>&1; cat "${reqs[@]}" | sha256sum)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.scape-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "$venv/bin/python"
  exit 0
fi
echo "install_frameworks: making $venv (pins: ${reqs[*]})" >&2
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
/usr/bin/python3 -m venv --system-site-packages "$venv"
# One pip call per file, in name order, each --no-deps: a file lists its framework and every
# dependency Debian does not ship, pinned.
for r in "${reqs[@]}"; do
  DS_BUILD_OPS=0 DS_BUILD_AIO=0 "$venv/bin/python" -m pip install --no-deps --no-build-isolation \
    --disable-pip-version-check --no-warn-script-location -q -r "$r" >&2
done
echo "$stamp" > "$venv/.scape-stamp"
echo "$venv/bin/python"
