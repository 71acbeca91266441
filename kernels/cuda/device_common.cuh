// Internal (CUDA only): helpers shared by the kernels in kernels/cuda/*.cu.
#ifndef SCAPE_KERNELS_CUDA_DEVICE_COMMON_CUH_
#define SCAPE_KERNELS_CUDA_DEVICE_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/kernel_status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {
namespace cuda {
namespace dev {

// Checks the launch just made (configuration errors surface here; execution errors surface at
// the caller's next synchronisation, as for any stream-ordered library).
inline KernelStatus LaunchStatus() {
  return cudaGetLastError() == cudaSuccess ? KernelStatus::kOk : KernelStatus::kCudaError;
}

#define SCAPE_CUDA_LAUNCH_CHECK()                                                     \
  do {                                                                                \
    ::scape::kernels::KernelStatus _ls = ::scape::kernels::cuda::dev::LaunchStatus(); \
    if (_ls != ::scape::kernels::KernelStatus::kOk) return _ls;                       \
  } while (0)

#define SCAPE_CUDA_CALL(expr)                                                     \
  do {                                                                            \
    if ((expr) != cudaSuccess) return ::scape::kernels::KernelStatus::kCudaError; \
  } while (0)

// Blocks for a grid-stride launch over `work` items with `per_block` items per block.
inline unsigned GridFor(uint64_t work, uint64_t per_block, unsigned max_blocks = 1u << 20) {
  uint64_t b = (work + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

inline size_t AlignUp(size_t x, size_t a = 256) { return (x + a - 1) / a * a; }

// ---- dtype conversions: bit-for-bit the same as kernels/cpu/dtype.h ------------------------

__device__ __forceinline__ float Bf16ToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ __forceinline__ float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = __fmul_rn(static_cast<float>(mant), 5.9604644775390625e-8f);
    return __uint_as_float(sign | __float_as_uint(mag));
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ uint16_t FloatToFp16(float f) {
  uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t out;
  if (u >= 0x47800000u) {
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {
    const float t = __fadd_rn(__uint_as_float(u), 0.5f);
    out = __float_as_uint(t) - 0x3f000000u;
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;
    out = u >> 13;
    if (out > 0x7c00u) out = 0x7c00u;
  }
  return static_cast<uint16_t>(out | sign);
}

// Payload element access by runtime type (0 = fp32, 1 = bf16, 2 = fp16 as template parameter).
// StorePayload returns the value as stored (v for fp32), for the rounding-error feedback.
template <int kType>
__device__ __forceinline__ float StorePayload(void* p, uint64_t j, float v) {
  if (kType == 0) {
    static_cast<float*>(p)[j] = v;
    return v;
  } else if (kType == 1) {
    const uint16_t h = FloatToBf16(v);
    static_cast<uint16_t*>(p)[j] = h;
    return Bf16ToFloat(h);
  } else {
    const uint16_t h = FloatToFp16(v);
    static_cast<uint16_t*>(p)[j] = h;
    return Fp16ToFloat(h);
  }
}
template <int kType>
__device__ __forceinline__ float LoadPayload(const void* p, uint64_t j) {
  if (kType == 0) return static_cast<const float*>(p)[j];
  if (kType == 1) return Bf16ToFloat(static_cast<const uint16_t*>(p)[j]);
  return Fp16ToFloat(static_cast<const uint16_t*>(p)[j]);
}

inline int PayloadKind(scapeDataType_t t) {
  return t == scapeFloat32 ? 0 : (t == scapeBfloat16 ? 1 : (t == scapeFloat16 ? 2 : -1));
}

// The one dispatch of a payload kind onto a template argument (host code, around launches):
// f(std::integral_constant<int, K>{}) with K = kind for 0 and 1, K = 2 otherwise.
template <typename F>
void VisitKind(int kind, F&& f) {
  if (kind == 0) {
    f(std::integral_constant<int, 0>{});
  } else if (kind == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

// ---- block-wide scans (blockDim.x a multiple of 32, at most 1024) ---------------------------

// The second half of both scans: once each warp has written its sum to warp_sums[its warp], the
// sum of the warps before `warp` (returned) and of all of them (*total). Synchronises the block
// before reading warp_sums and after (so that it may be reused).
template <typename T>
__device__ __forceinline__ T WarpSumsBefore(const T* warp_sums, unsigned warp, T* total) {
  __syncthreads();
  T before = 0, all = 0;
  const unsigned nwarps = blockDim.x >> 5;
  for (unsigned w = 0; w < nwarps; ++w) {
    const T s = warp_sums[w];
    before += w < warp ? s : 0;
    all += s;
  }
  __syncthreads();
  *total = all;
  return before;
}

// Exclusive prefix of `flag` over the block in thread order; *total = block sum.
// Uses `warp_sums` (32 entries of shared memory) and synchronises the block twice.
__device__ __forceinline__ uint32_t BlockExclusiveCount(bool flag, uint32_t* warp_sums,
                                                        uint32_t* total) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const uint32_t in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_sums[warp] = __popc(ballot);
  return WarpSumsBefore(warp_sums, warp, total) + in_warp;
}

// Exclusive prefix sum of a 64-bit value over the block; *total = block sum.
__device__ __forceinline__ uint64_t BlockExclusiveSum(uint64_t v, uint64_t* warp_sums,
                                                      uint64_t* total) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  uint64_t incl = v;
  for (int off = 1; off < 32; off <<= 1) {
    const uint64_t o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= static_cast<unsigned>(off)) incl += o;
  }
  if (lane == 31) warp_sums[warp] = incl;
  return WarpSumsBefore(warp_sums, warp, total) + incl - v;
}

// Block-wide sum of a 64-bit value (result valid in every thread).
__device__ __forceinline__ uint64_t BlockSum(uint64_t v, uint64_t* warp_sums) {
  uint64_t total;
  BlockExclusiveSum(v, warp_sums, &total);
  return total;
}

}  // namespace dev
}  // namespace cuda
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CUDA_DEVICE_COMMON_CUH_
