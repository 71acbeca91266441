#!/usr/bin/env bash
# CUDA compiler launcher of the kernels' object library (kernels/CMakeLists.txt): runs the nvcc
# command it is given (which has --resource-usage) and keeps what it prints (ptxas' per-kernel
# registers, stack and spills) next to the object, as OBJECT.ptxas.log, for the spill check
# (tests/kernels/spill_check.sh --logs) to read without compiling the kernels again. The output
# is shown only when the compile fails.
set -uo pipefail
obj=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && obj=$a
  prev=$a
done
log="${obj:-/dev/null}.ptxas.log"
"$@" > "$log.tmp" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then cat "$log.tmp" >&2; rm -f "$log.tmp"; exit "$rc"; fi
mv "$log.tmp" "$log"
