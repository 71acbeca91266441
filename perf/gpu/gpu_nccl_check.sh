#!/usr/bin/env bash
# GPU check of the NCCL net plugin with the real NCCL from the CUDA toolkit.
#
# Two processes share one GPU but claim different hosts (distinct NCCL_HOSTID), so NCCL puts a
# network between them and must use the net plugin: NCCL_NET_PLUGIN points at the built
# libnccl-net-scape.so and NCCL_NET=SCAPE forbids a silent fallback to NCCL's own IB/Socket
# networks. NCCL_DEBUG=INFO output must show the plugin loaded (v11) and the ring/tree channels
# going "via NET/SCAPE". Then an all-reduce is checked element by element and timed
# (perf/gpu/gpu_nccl_check.cc), once per UCX transport setting.
#
#   bash perf/gpu/gpu_nccl_check.sh                   # build what is missing, run, print a summary
#   bash perf/gpu/gpu_nccl_check.sh --compile-only    # only compile the check program (no GPU needed)
#
# Environment: CUDA_HOME (/usr/local/cuda), BUILD_DIR (build-gpu), PLUGIN (path to the .so;
# default BUILD_DIR/lib/libnccl-net-scape.so, built if missing), SIZES (bytes, comma list),
# ITERS (20), TIMEOUT_S per run (240), TLS_LIST (space-separated UCX_TLS values to try;
# "default" = UCX's choice), GPU_CHECK_DEVICE (0). Logs go to $OUT_DIR (/tmp/scape-gpu-check).
# Exit status: 0 if every run loaded the plugin, used it, and got the right sums.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
BUILD_DIR=${BUILD_DIR:-$ROOT/build-gpu}
OUT_DIR=${OUT_DIR:-/tmp/scape-gpu-check}
SIZES=${SIZES:-4096,1048576,67108864,268435456}
ITERS=${ITERS:-20}
TIMEOUT_S=${TIMEOUT_S:-240}
TLS_LIST=${TLS_LIST:-"default tcp"}
export GPU_CHECK_DEVICE=${GPU_CHECK_DEVICE:-0}
COMPILE_ONLY=0
[ "${1:-}" = "--compile-only" ] && COMPILE_ONLY=1

mkdir -p "$OUT_DIR"
fail() { echo "gpu_nccl_check: FAIL: $*" >&2; exit 1; }

# ---- the NCCL library and headers of the toolkit ------------------------------------------------
[ -f "$CUDA_HOME/include/nccl.h" ] || fail "no nccl.h under $CUDA_HOME/include"
[ -f "$CUDA_HOME/include/cuda_runtime.h" ] || fail "no cuda_runtime.h under $CUDA_HOME/include"
NCCL_LIB_DIR=""
for d in "$CUDA_HOME/lib64" "$CUDA_HOME/lib" /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu; do
  if [ -e "$d/libnccl.so" ] || [ -e "$d/libnccl.so.2" ]; then NCCL_LIB_DIR=$d; break; fi
done
[ -n "$NCCL_LIB_DIR" ] || fail "libnccl.so not found (looked in $CUDA_HOME/lib64, $CUDA_HOME/lib, /usr/lib/*)"
CUDART_DIR=""
for d in "$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/targets/$(uname -m)-linux/lib"; do
  if [ -e "$d/libcudart.so" ]; then CUDART_DIR=$d; break; fi
done
[ -n "$CUDART_DIR" ] || fail "libcudart.so not found under $CUDA_HOME"
NCCL_SO=$(find "$NCCL_LIB_DIR/" -maxdepth 1 -name "libnccl.so*" | sort | head -1)
echo "NCCL: $NCCL_SO ($(grep -m1 -o 'NCCL_VERSION_CODE [0-9]*' "$CUDA_HOME/include/nccl.h"))"

# ---- the check program ----------------------------------------------------------------------
CHECK_BIN=$OUT_DIR/gpu_nccl_check
CXX=${CXX:-g++}
"$CXX" -std=c++17 -O2 -Wall -Wextra -o "$CHECK_BIN" "$ROOT/perf/gpu/gpu_nccl_check.cc" \
  -I"$CUDA_HOME/include" -L"$CUDART_DIR" -L"$NCCL_LIB_DIR" -lnccl -lcudart \
  -Wl,-rpath,"$NCCL_LIB_DIR" -Wl,-rpath,"$CUDART_DIR" || fail "cannot compile perf/gpu/gpu_nccl_check.cc"
echo "compiled $CHECK_BIN"
[ "$COMPILE_ONLY" = 1 ] && exit 0

# ---- a GPU, shareable by two processes ---------------------------------------------------------
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: no GPU driver on this machine"
nvidia-smi -L || fail "nvidia-smi -L failed: no usable GPU"
MODE=$(nvidia-smi -i "$GPU_CHECK_DEVICE" --query-gpu=compute_mode --format=csv,noheader 2>/dev/null || true)
case "$MODE" in
  *Exclusive_Process*|*Prohibited*) fail "GPU $GPU_CHECK_DEVICE compute mode is '$MODE': two processes cannot share it" ;;
esac

# ---- the plugin ----------------------------------------------------------------------------------
PLUGIN=${PLUGIN:-$BUILD_DIR/lib/libnccl-net-scape.so}
if [ ! -f "$PLUGIN" ]; then
  echo "building the plugin in $BUILD_DIR"
  command -v cmake >/dev/null || fail "cmake not found and $PLUGIN does not exist"
  cmake -B "$BUILD_DIR" -S "$ROOT" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSCAPE_WITH_CUDA=OFF \
        -DSCAPE_BUILD_TESTS=OFF -DSCAPE_BUILD_PERF=OFF > "$OUT_DIR/cmake.log" 2>&1 \
    || { cat "$OUT_DIR/cmake.log"; fail "cmake configure failed (UCX development files missing?)"; }
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target nccl-net-scape > "$OUT_DIR/build.log" 2>&1 \
    || { tail -30 "$OUT_DIR/build.log"; fail "plugin build failed"; }
fi
PLUGIN=$(readlink -f "$PLUGIN")
MISSING=$(ldd "$PLUGIN" | grep 'not found' || true)
[ -z "$MISSING" ] || fail "the plugin's dependencies do not resolve (NCCL would silently skip it):
$MISSING"
# The symbols into a variable first: under pipefail, "nm | grep -q" fails when grep exits early
# and nm dies of SIGPIPE (the main job once skipped the Gloo peer that way).
SYMS=$(nm -D --defined-only "$PLUGIN")
grep -q ' ncclNetPlugin_v11$' <<<"$SYMS" || fail "$PLUGIN does not export ncclNetPlugin_v11"
echo "plugin: $PLUGIN"

# ---- runs ------------------------------------------------------------------------------------
run_pair() {  # $1 = label, $2 = UCX_TLS value or "default"
  local label=$1 tls=$2 dir="$OUT_DIR/$1"
  rm -rf "$dir"; mkdir -p "$dir"
  local pids=() r
  for r in 0 1; do
    (
      export NCCL_NET_PLUGIN="$PLUGIN"        # the exact file (no name search)
      export NCCL_NET=SCAPE                   # use it or fail; no fallback to IB/Socket
      export NCCL_HOSTID="scape-fake-node-$r" # two "hosts": NCCL must use the network
      export NCCL_NET_PLUGIN_REF_COUNT=1      # 2.28 reload bug (issue #1978)
      export NCCL_SOCKET_IFNAME=lo            # NCCL's bootstrap stays on this machine
      export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH
      export SCAPE_NCCL_DEVICES="=lo"         # the plugin's one device: loopback
      export UCX_WARN_UNUSED_ENV_VARS=n
      [ "$tls" != default ] && export UCX_TLS="$tls"
      export CUDA_VISIBLE_DEVICES="$GPU_CHECK_DEVICE" GPU_CHECK_DEVICE=0
      exec timeout -k 10 "$((TIMEOUT_S + 30))" "$CHECK_BIN" "$r" 2 "$dir/id" "$SIZES" "$ITERS" "$TIMEOUT_S"
    ) > "$dir/rank$r.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  local ok=1
  echo "=== $label (UCX_TLS=$tls): exit $rc"
  for r in 0 1; do
    if ! grep -q "Loaded net plugin SCAPE (v11)" "$dir/rank$r.log"; then
      echo "  rank $r: NCCL did not report 'Loaded net plugin SCAPE (v11)'"; ok=0
    fi
    if ! grep -Eq "via NET/SCAPE" "$dir/rank$r.log"; then
      echo "  rank $r: no channel 'via NET/SCAPE' in the log (NCCL did not use the plugin)"; ok=0
    fi
  done
  grep -h -m3 -E "NET/Plugin|Using network|Assigned NET plugin|NET/SCAPE : UCX" "$dir/rank0.log" | sed 's/^/  /'
  grep -h -m2 "via NET/SCAPE" "$dir/rank0.log" | sed 's/^/  /'
  grep -h "^RESULT" "$dir/rank0.log" | sed 's/^/  /'
  grep -h -E "WARN|wrong|timed out|error" "$dir"/rank*.log | head -20 | sed 's/^/  ! /'
  [ "$rc" = 0 ] && [ "$ok" = 1 ]
}

status=0
for tls in $TLS_LIST; do
  run_pair "tls-${tls//,/_}" "$tls" || status=1
done
echo "logs: $OUT_DIR"
[ "$status" = 0 ] && echo "gpu_nccl_check: PASS" || echo "gpu_nccl_check: FAIL"
exit $status
