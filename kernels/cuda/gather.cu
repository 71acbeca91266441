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

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    GatherKernel(const T* __restrict__ dense, const uint64_t* __restrict__ idx, uint64_t k,
                 T* __restrict__ packed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < k;
       base += stride * kUnroll) {
    uint64_t ix[kUnroll];
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + u * stride;
      if (i < k) ix[u] = idx[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < k) v[u] = dense[ix[u]];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + u * stride;
      if (i < k) packed[i] = v[u];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ScatterKernel(const T* __restrict__ packed, const uint64_t* __restrict__ idx, uint64_t k,
                  T* __restrict__ dense) {
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
        v[u] = packed[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < k) dense[ix[u]] = v[u];
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

}  // namespace

KernelStatus GatherByIndexCuda(const void* d_dense, const uint64_t* d_idx, size_t k, size_t esz,
                               void* d_packed, cudaStream_t stream) {
  const KernelStatus st = CheckArgs(d_dense, d_idx, k, esz, d_packed);
  if (st != KernelStatus::kOk || k == 0) return st;
  const unsigned grid = GatherGrid(k);
  switch (esz) {
    case 1:
      GatherKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(d_dense), d_idx, k,
                                                  static_cast<uint8_t*>(d_packed));
      break;
    case 2:
      GatherKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(d_dense), d_idx, k,
                                                  static_cast<uint16_t*>(d_packed));
      break;
    case 4:
      GatherKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(d_dense), d_idx, k,
                                                  static_cast<uint32_t*>(d_packed));
      break;
    default:
      GatherKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint64_t*>(d_dense), d_idx, k,
                                                  static_cast<uint64_t*>(d_packed));
      break;
  }
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

KernelStatus ScatterByIndexCuda(const void* d_packed, const uint64_t* d_idx, size_t k, size_t esz,
                                void* d_dense, cudaStream_t stream) {
  const KernelStatus st = CheckArgs(d_packed, d_idx, k, esz, d_dense);
  if (st != KernelStatus::kOk || k == 0) return st;
  const unsigned grid = GatherGrid(k);
  switch (esz) {
    case 1:
      ScatterKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint8_t*>(d_packed), d_idx, k,
                                                   static_cast<uint8_t*>(d_dense));
      break;
    case 2:
      ScatterKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(d_packed), d_idx, k,
                                                   static_cast<uint16_t*>(d_dense));
      break;
    case 4:
      ScatterKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(d_packed), d_idx, k,
                                                   static_cast<uint32_t*>(d_dense));
      break;
    default:
      ScatterKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint64_t*>(d_packed), d_idx, k,
                                                   static_cast<uint64_t*>(d_dense));
      break;
  }
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
