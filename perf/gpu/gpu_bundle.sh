#!/usr/bin/env bash
# perf/gpu/gpu_bundle.sh: builds, on this machine (the CUDA toolkit and the project's dependencies;
# no GPU needed), everything perf/gpu/gpu_check.sh runs, and packs it into one folder with the
# shared libraries a bare GPU machine may lack (UCX and its modules, rdma-core, libnl,
# libstdc++), so the GPU machine spends its time on the checks, not on installing and building.
#
#   bash perf/gpu/gpu_bundle.sh [DIR]                 # default DIR: <repo>/.gpu-bundle, holding
#                                                     # COMMIT and bundle.tar.xz (bin/, lib/)
#   GPU_CHECK_BUNDLE=DIR bash perf/gpu/gpu_check.sh   # then, on the GPU machine
#   GPU_BUNDLE_FAKE=BUILD bash perf/gpu/gpu_bundle.sh DIR   # the dry run's bundle (below)
#
# NCCL is not packed (hundreds of MB): gpu_check.sh uses the GPU machine's libnccl.so.2
# (PyTorch's, or CUDA's). Environment: BUILD_DIR (default <repo>/build-gpu), JOBS (nproc),
# CUDA_HOME (/usr/local/cuda).
#
# GPU_BUNDLE_FAKE=BUILD: builds nothing; packs, the same way, what the CMake build folder BUILD
# already holds for perf/gpu/run.sh --dry-run: the check programs linked against the fake CUDA
# runtime (gpu_*_check_fake, as bin/gpu_*_check), that runtime (libgpu_fake_cudart.so), the
# fake libnccl (also as nccl/libnccl.so.2, the NCCL_LIBRARY_DIR of the dry run), the build's
# library, its kernel test programs and fatbin check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$root/.gpu-bundle}
fake=${GPU_BUNDLE_FAKE:-}
build=${BUILD_DIR:-$root/build-gpu}
[ -n "$fake" ] && build=$fake
jobs=${JOBS:-$(nproc)}
cuda=${CUDA_HOME:-/usr/local/cuda}
checks=(gpu_device_check gpu_optim_check gpu_extra_check)

if [ -z "$fake" ]; then
  targets=(nccl-net-scape scape_kernels_cuda_test scape_kernels_cpu_test scape_kernels_gpu_bench
           scape_fatbin_check gpu_optim_check)
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSCAPE_WITH_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" >/dev/null
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
fi
so=$(readlink -f "$build/lib/libnccl-net-scape.so")
[ -f "$so" ] || { echo "gpu_bundle: no $build/lib/libnccl-net-scape.so" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
soname=$(readelf -d "$so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
cp "$so" "$out/lib/libnccl-net-scape.so"
# Programs linked to the library need it under its soname (a symbolic link: one copy travels).
[ -n "$soname" ] && [ "$soname" != libnccl-net-scape.so ] && ln -s libnccl-net-scape.so "$out/lib/$soname"
# cp_in SRC DST: a copy (the dry run's bundle: a hard link where it can, nothing travels)
cp_in() { if [ -n "$fake" ]; then cp -l "$1" "$2" 2>/dev/null || cp "$1" "$2"; else cp "$1" "$2"; fi; }
for f in tests/kernels/scape_kernels_cuda_test tests/kernels/scape_kernels_cpu_test \
         tests/kernels/scape_fatbin_check perf/kernels/scape_kernels_gpu_bench; do
  if [ -x "$build/$f" ]; then cp_in "$build/$f" "$out/bin/"
  elif [ -z "$fake" ]; then echo "gpu_bundle: no $build/$f" >&2; exit 1; fi
done
if [ -n "$fake" ]; then
  for c in "${checks[@]}"; do
    p=$(find "$build" -maxdepth 3 -name "${c}_fake" -type f -perm -u+x | head -1)
    [ -n "$p" ] || { echo "gpu_bundle: no ${c}_fake under $build (build the target)" >&2; exit 1; }
    cp "$p" "$out/bin/$c"
  done
  for l in libgpu_fake_cudart.so libfake_libnccl.so; do
    p=$(find "$build" -maxdepth 3 -name "$l" | head -1)
    [ -n "$p" ] || { echo "gpu_bundle: no $l under $build" >&2; exit 1; }
    cp "$p" "$out/lib/"
  done
  mkdir -p "$out/nccl"
  ln -s ../lib/libfake_libnccl.so "$out/nccl/libnccl.so.2"  # one file: the same copy loaded
  for f in "$out"/bin/gpu_*_check; do patchelf --version >/dev/null 2>&1 &&
    patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
else
  cp "$build/perf/gpu_optim_check" "$out/bin/"
  # The checks built here with the CUDA runtime linked statically, NCCL from the GPU machine
  # (their NEEDED libnccl.so.2 is found through LD_LIBRARY_PATH there).
  for c in gpu_device_check gpu_extra_check; do
    g++ -std=c++17 -O2 -Wall -Wextra -o "$out/bin/$c" "$root/perf/gpu/$c.cc" \
      -I"$root/include" -I"$build/include" -I"$cuda/include" -L"$out/lib" -lnccl-net-scape \
      -L"$cuda/lib64" -lcudart_static -lnccl -ldl -lrt -lpthread -Wl,-rpath,'$ORIGIN/../lib'
  done
fi
[ -n "$fake" ] || strip --strip-unneeded "$out"/bin/* "$out/lib/libnccl-net-scape.so"

# Shared libraries from this machine's system folders that the programs need, except glibc's
# own (the GPU machine's glibc must be as new as this one's) and CUDA's/NCCL's.
skip='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libcuda|libcudart|libnccl)\.so'
for f in "$out"/bin/* "$out/lib/libnccl-net-scape.so"; do
  LD_LIBRARY_PATH="$out/lib" ldd "$f" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  [[ "$name" =~ $skip ]] && continue
  case "$lib" in "$out"/*) continue ;; esac
  [ -n "$fake" ] && case "$name" in libgpu_fake_cudart.so|libfake_libnccl.so) continue ;; esac
  cp -L "$lib" "$out/lib/$name"
done
# UCX loads its transports as modules (UCX_MODULE_DIR on the GPU machine).
ucxmod=$(pkg-config --variable=libdir ucx)/ucx
[ -d "$ucxmod" ] && cp -rL "$ucxmod" "$out/lib/ucx"
for f in "$out"/lib/ucx/*.so*; do
  [ -e "$f" ] || continue
  ldd "$f" 2>/dev/null | awk '/=> \//{print $3}' | while read -r lib; do
    name=$(basename "$lib")
    [[ "$name" =~ $skip ]] || [ -e "$out/lib/$name" ] || cp -L "$lib" "$out/lib/$name"
  done
done
git -C "$root" rev-parse --short HEAD >"$out/COMMIT" 2>/dev/null || echo unknown >"$out/COMMIT"
[ -n "$fake" ] && echo "$(cat "$out/COMMIT") (FAKE: the dry run's bundle)" >"$out/COMMIT"
ls "$out/bin"
echo "bundle: $out ($(du -sh "$out" | cut -f1) unpacked), commit $(cat "$out/COMMIT")"
# The real bundle travels packed: its kernels (sm_80 + sm_90 + PTX in the library and in the two
# kernel programs) are ~55 MB as they are, ~9 MB as xz (the device tool carries 64 MiB with the
# working tree). gpu_check.sh unpacks it (a second or two). The dry run's stays unpacked.
if [ -z "$fake" ]; then
  tar -C "$out" -cf - bin lib | xz -T0 -6 >"$out/bundle.tar.xz"
  rm -rf "$out/bin" "$out/lib"
  echo "packed: $out/bundle.tar.xz ($(du -sh "$out/bundle.tar.xz" | cut -f1))"
fi
