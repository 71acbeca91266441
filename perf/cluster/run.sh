#!/usr/bin/env bash
# The emulated bandwidth-bound cluster (issue 34): P = 2 and 4 hosts in network + UTS
# namespaces on a tbf-shaped bridge, the quality study's training for dense AdamW, dense AdamS,
# SCAPE 0.1 / 0.01 and PowerSGD; see perf/cluster/README.md.
#   bash perf/cluster/run.sh [--quick] [--out DIR] [more cluster.py options]
#   bash perf/cluster/run.sh --self-test      # plumbing only: no root, no namespaces
# Needs the CPU library built in ./build (or SCAPE_PYTHONPATH=<build>/python). Without root it
# prints why and exits 0 (skipped). Uses /usr/bin/python3 (Debian's torch) unless PYTHON is set.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-/usr/bin/python3}"
[ -x "$py" ] || py=python3
selftest=0
for a in "$@"; do [ "$a" = "--self-test" ] && selftest=1; done
if [ "$selftest" = "0" ] && [ "$(id -u)" != "0" ]; then
  echo "SKIP: perf/cluster needs root (network namespaces, tc); nothing was run"
  exit 0
fi
exec "$py" "$here/cluster.py" "$@"
