#!/usr/bin/env bash
# check_needed.sh LIB [PATTERN...]: fails if the NEEDED entries of ELF file LIB name CUDA
# (libcuda, libcudart), NCCL (libnccl) or any extra PATTERN (an extended regex): the shipped
# library must load on a machine without a GPU driver, the CUDA runtime or NCCL.
set -euo pipefail
lib=$1
shift
command -v readelf >/dev/null || { echo "readelf not found (binutils)"; exit 2; }
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "NEEDED of $lib:"
echo "$needed" | sed 's/^/  /'
pat='^(libcuda\.|libcudart\.|libnccl\.)'
for p in "$@"; do pat="$pat|$p"; done
if bad=$(echo "$needed" | grep -E "$pat"); then
  echo "FAIL: hard dependencies: $bad"
  exit 1
fi
echo "OK: no libcuda, libcudart or libnccl${*:+ or $*}"
