// CUDA implementation of kernels/cpu/gather.h (declared in kernels/cuda/scape_kernels.cuh):
// GatherByIndexCuda / ScatterByIndexCuda, the pack and unpack of a masked collective over a
// dense device buffer.
//
// One thread per element, grid-stride: consecutive threads handle consecutive i, so the index
// reads and the packed side are coalesced; the dense side is as coalesced as the indices make it
// (sorted dense masks read whole sectors). Each thread keeps kUnroll independent elements in
// flight (indices first, then the dense loads, then the stores), which hides the latency of a
// sparse dense access better than one element per thread. Elements are moved as raw bits in an
// unsigned integer of esz bytes (NaN payloads survive). No 16-byte vector path: the dense side
// is indexed element by element, and the packed side is already coalesced.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/gather.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr int kUnroll = 4;

// The gather (kScatter false: dst[i] = src[idx[i]]) or the scatter (kScatter true:
// dst[idx[i]] = src[i]) of i < k. The gather issues its index reads, then its dense loads, then
// its stores; the scatter issues its index and packed reads together, then its dense stores.
template <bool kScatter, typename T>
__global__ void __launch_bounds__(kThreads)
    IndexedKernel(const T* __restrict__ src, const uint64_t* __restrict__ idx, uint64_t k,
                  T* __restrict__ dst) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < k;
       base += stride * kUnroll) {
    uint64_t ix[kUnroll];
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + u * stride;
      if (i < k) {
        ix[u] = idx[i];
        if constexpr (kScatter) v[u] = src[i];
      }
    }
    if constexpr (!kScatter) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < k) v[u] = src[ix[u]];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + u * stride;
      if (i < k) dst[kScatter ? ix[u] : i] = v[u];
    }
  }
}

// Blocks: kUnroll elements per thread (at most 2^20 blocks, then grid-stride). One element per
// thread would leave too few loads in flight to saturate HBM: a full H200 holds about 8.4k
// warps, each with one 128-byte coalesced access at a time, about 1 MB in flight, where
// ~3-4 MB are needed to cover the memory latency at full bandwidth.
unsigned GatherGrid(uint64_t k) { return dev::GridFor(k, uint64_t{kThreads} * kUnroll); }

KernelStatus CheckArgs(const void* a, const uint64_t* idx, size_t k, size_t esz, const void* b) {
  if (esz != 1 && esz != 2 && esz != 4 && esz != 8) return KernelStatus::kInvalidArgument;
  if (k > 0 && (a == nullptr || idx == nullptr || b == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  return KernelStatus::kOk;
}

// The gather (packed[i] = src[idx[i]]) or the scatter (dst[idx[i]] = src[i]) of k elements of
// esz bytes, after the argument checks.
KernelStatus LaunchIndexed(bool scatter, const void* src, const uint64_t* d_idx, size_t k,
                           size_t esz, void* dst, cudaStream_t stream) {
  const KernelStatus st = CheckArgs(src, d_idx, k, esz, dst);
  if (st != KernelStatus::kOk || k == 0) return st;
  const unsigned grid = GatherGrid(k);
  // esz is 1, 2, 4 or 8 here (CheckArgs).
  VisitElementBits(esz, [&](auto t) {
    using T = decltype(t);
    const T* s = static_cast<const T*>(src);
    T* d = static_cast<T*>(dst);
    if (scatter) {
      IndexedKernel<true><<<grid, kThreads, 0, stream>>>(s, d_idx, k, d);
    } else {
      IndexedKernel<false><<<grid, kThreads, 0, stream>>>(s, d_idx, k, d);
    }
  });
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

}  // namespace

KernelStatus GatherByIndexCuda(const void* d_dense, const uint64_t* d_idx, size_t k, size_t esz,
                               void* d_packed, cudaStream_t stream) {
  return LaunchIndexed(/*scatter=*/false, d_dense, d_idx, k, esz, d_packed, stream);
}

KernelStatus ScatterByIndexCuda(const void* d_packed, const uint64_t* d_idx, size_t k, size_t esz,
                                void* d_dense, cudaStream_t stream) {
  return LaunchIndexed(/*scatter=*/true, d_packed, d_idx, k, esz, d_dense, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
