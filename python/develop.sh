#!/usr/bin/env bash
# Makes `import scape` work for /usr/bin/python3 from anywhere, pointing at a build tree:
# writes <user site-packages>/scape-comm.pth containing <build>/python (the package staged by
# CMake, whose _build_info.py names that build's libnccl-net-scape.so). Run by
# tests/run_all.sh after the release build; re-run it to point at another build tree, or
# delete the .pth file to undo. `cmake --install` is the alternative for a system-wide copy.
#   bash python/develop.sh [BUILD_DIR]        (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" && pwd)
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if [ ! -f "$build/python/scape/__init__.py" ] || [ ! -f "$build/python/scape/_build_info.py" ]; then
  echo "develop.sh: $build/python/scape is not staged: configure and build $build first" >&2
  exit 1
fi
site=$("$py" -c 'import site, sys; sys.stdout.write(site.getusersitepackages() if site.ENABLE_USER_SITE else "")')
if [ -z "$site" ]; then
  echo "develop.sh: $py has user site-packages disabled; use PYTHONPATH=$build/python" >&2
  exit 1
fi
mkdir -p "$site"
echo "$build/python" > "$site/scape-comm.pth"
(cd / && "$py" -c "import scape; print('scape', scape.__version__, 'from', scape.__file__, 'library', scape.library_path())")
