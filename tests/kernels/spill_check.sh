#!/usr/bin/env bash
# The optimizer's and the top-k's CUDA kernels must not spill registers (issue 31 item 9: a
# spill is local-memory traffic in the kernels that stream over n). Compiles the given .cu files
# with nvcc --resource-usage for the shipped architectures and fails, naming the kernel and the
# architecture, when ptxas reports spill stores or loads. No GPU needed.
#   spill_check.sh NVCC "80-real;90" INCLUDE_DIRS... -- FILE.cu...
#   spill_check.sh --logs OBJDIR -- FILE.cu...   (what ptxas printed when the build compiled
#     them: OBJDIR/FILE.cu.o.ptxas.log, kept by tests/kernels/ptxas_log.sh; nothing compiled)
# SCAPE_SPILL_ALLOW="KERNEL:BYTES ..." names known spills that may not grow (tests/kernels/
# CMakeLists.txt says why each is there).
# With SCAPE_SPILL_CHECK_SELFTEST=1 it checks a kernel made to spill instead and fails if that
# is not reported (so the check itself can fail).
set -euo pipefail
logdir=""
if [ "$1" = "--logs" ]; then
  logdir=$2
  shift 3  # --logs OBJDIR --
  nvcc="" archs=""
  set -- -- "$@"
else
  nvcc=$1 archs=$2
  shift 2
fi
incs=()
while [ "$1" != "--" ]; do incs+=("-I$1"); shift; done
shift
gen=()
for a in ${archs//;/ }; do
  n=${a%-real}
  if [ "$a" = "$n-real" ]; then gen+=("--generate-code=arch=compute_$n,code=[sm_$n]")
  else gen+=("--generate-code=arch=compute_$n,code=[compute_$n,sm_$n]"); fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
files=("$@")
if [ "${SCAPE_SPILL_CHECK_SELFTEST:-0}" = 1 ]; then
  # 64 live floats per thread under a 32-register cap: ptxas must spill.
  cat > "$tmp/spill.cu" <<'CU'
__global__ void __launch_bounds__(1024, 2) Spills(float* p, int n) {
  float v[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) v[i] = p[threadIdx.x * 64 + i] * (i + 1);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < n; ++j)
#pragma unroll
    for (int i = 0; i < 64; ++i) s += v[(i * 7 + j) % 64] * v[i];
  p[threadIdx.x] = s;
}
CU
  files=("$tmp/spill.cu")
fi
bad=0
for f in "${files[@]}"; do
  if [ -n "$logdir" ]; then
    log="$logdir/$(basename "$f").o.ptxas.log"
    [ -s "$log" ] || { echo "spill: no ptxas report $log (build the kernels first)"; exit 1; }
  else
    log="$tmp/$(basename "$f").log"
    "$nvcc" -O2 -DNDEBUG -std=c++17 "${gen[@]}" "${incs[@]}" --resource-usage -c "$f" \
      -o "$tmp/$(basename "$f").o" > "$log" 2>&1 || { cat "$log"; exit 1; }
  fi
  # ptxas prints "Compiling entry function 'NAME' for 'sm_XX'" then, per function,
  # "N bytes stack frame, S bytes spill stores, L bytes spill loads".
  while IFS= read -r line; do
    echo "spill: $(basename "$f"): $line"
    bad=1
  done < <(awk -v allow="${SCAPE_SPILL_ALLOW:-}" '
                /Compiling entry function/ { fn = $0 }
                /bytes spill stores/ {
                  if ($5 + 0 == 0 && $9 + 0 == 0) next
                  # allow: "NAME:BYTES ..." a kernel whose spill stores and loads may reach
                  # BYTES each (a known, explained spill; more than that still fails)
                  n = split(allow, a, " ")
                  for (i = 1; i <= n; ++i) {
                    split(a[i], kv, ":")
                    if (index(fn, kv[1]) && $5 + 0 <= kv[2] + 0 && $9 + 0 <= kv[2] + 0) next
                  }
                  print fn " -> " $0
                }' "$log")
  built=$(grep -c 'Compiling entry function' "$log" || true)
  echo "$(basename "$f"): $built kernel builds checked"
  [ "$built" -gt 0 ] || { echo "spill: $log names no kernel (no --resource-usage report?)"; bad=1; }
done
if [ "${SCAPE_SPILL_CHECK_SELFTEST:-0}" = 1 ]; then
  [ "$bad" = 1 ] && { echo "self-test: the spill was reported"; exit 0; }
  echo "self-test: a spilling kernel was not reported"; exit 1
fi
[ "$bad" = 0 ] && echo "no spills"
exit "$bad"
