#!/usr/bin/env bash
# perf/gpu/gpu_bundle.sh: builds, on this machine (the CUDA toolkit and the project's dependencies;
# no GPU needed), everything perf/gpu/gpu_check.sh runs, and packs it into one folder with the
# shared libraries a bare GPU machine may lack (UCX and its modules, rdma-core, libnl,
# libstdc++), so the GPU machine spends its time on the checks, not on installing and building.
#
#   bash perf/gpu/gpu_bundle.sh [DIR]                 # default DIR: <repo>/.gpu-bundle
#   GPU_CHECK_BUNDLE=DIR bash perf/gpu/gpu_check.sh   # then, on the GPU machine
#
# NCCL is not packed (hundreds of MB): gpu_check.sh uses the GPU machine's libnccl.so.2
# (PyTorch's, or CUDA's). Environment: BUILD_DIR (default <repo>/build-gpu), JOBS (nproc),
# CUDA_HOME (/usr/local/cuda).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/.gpu-bundle}
build=${BUILD_DIR:-$root/build-gpu}
jobs=${JOBS:-$(nproc)}
cuda=${CUDA_HOME:-/usr/local/cuda}
targets=(nccl-net-scape scape_kernels_cuda_test scape_kernels_cpu_test scape_kernels_gpu_bench
         scape_fatbin_check)

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSCAPE_WITH_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" >/dev/null
# Optional programs that only some versions of the tree have.
# (The target list is read whole first: `grep -q` on a pipe can fail the writer under pipefail.)
help=$(cmake --build "$build" --target help)
for t in gpu_optim_check; do
  grep -q "\.\.\. $t\$" <<<"$help" && targets+=("$t")
done
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
so=$(readlink -f "$build/lib/libnccl-net-scape.so")
soname=$(readelf -d "$so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
cp "$so" "$out/lib/libnccl-net-scape.so"
# Programs linked to the library need it under its soname (a symbolic link: one copy travels).
[ -n "$soname" ] && [ "$soname" != libnccl-net-scape.so ] && ln -s libnccl-net-scape.so "$out/lib/$soname"
cp "$build/tests/kernels/scape_kernels_cuda_test" "$build/tests/kernels/scape_kernels_cpu_test" \
   "$build/tests/kernels/scape_fatbin_check" "$build/perf/kernels/scape_kernels_gpu_bench" \
   "$out/bin/"
[ -x "$build/perf/gpu_optim_check" ] && cp "$build/perf/gpu_optim_check" "$out/bin/"
# The device data-path check: the shipped library, the CUDA runtime linked statically, NCCL
# from the GPU machine (its NEEDED libnccl.so.2 is found through LD_LIBRARY_PATH there).
g++ -std=c++17 -O2 -Wall -Wextra -o "$out/bin/gpu_device_check" "$root/perf/gpu/gpu_device_check.cc" \
  -I"$root/include" -I"$build/include" -I"$cuda/include" -L"$out/lib" -lnccl-net-scape \
  -L"$cuda/lib64" -lcudart_static -lnccl -ldl -lrt -lpthread -Wl,-rpath,'$ORIGIN/../lib'
strip --strip-unneeded "$out"/bin/* "$out/lib/libnccl-net-scape.so"

# Shared libraries from this machine's system folders that the programs need, except glibc's
# own (the GPU machine's glibc must be as new as this one's) and CUDA's/NCCL's.
skip='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libcuda|libcudart|libnccl)\.so'
for f in "$out"/bin/* "$out/lib/libnccl-net-scape.so"; do
  LD_LIBRARY_PATH="$out/lib" ldd "$f" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  [[ "$name" =~ $skip ]] && continue
  case "$lib" in "$out"/*) continue ;; esac
  cp -L "$lib" "$out/lib/$name"
done
# UCX loads its transports as modules (UCX_MODULE_DIR on the GPU machine).
ucxmod=$(pkg-config --variable=libdir ucx)/ucx
[ -d "$ucxmod" ] && cp -rL "$ucxmod" "$out/lib/ucx"
for f in "$out"/lib/ucx/*.so*; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3}' | while read -r lib; do
    name=$(basename "$lib")
    [[ "$name" =~ $skip ]] || [ -e "$out/lib/$name" ] || cp -L "$lib" "$out/lib/$name"
  done
done
git -C "$root" rev-parse --short HEAD >"$out/COMMIT" 2>/dev/null || echo unknown >"$out/COMMIT"
echo "bundle: $out ($(du -sh "$out" | cut -f1)), commit $(cat "$out/COMMIT")"
ls "$out/bin"
