// Internal (CUDA only): helpers shared by the kernels in kernels/cuda/*.cu.
#ifndef SCAPE_KERNELS_CUDA_DEVICE_COMMON_CUH_
#define SCAPE_KERNELS_CUDA_DEVICE_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/kernel_status.h"
#include "kernels/dtypes.h"
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

// ---- element types: kernels/dtypes.h's, the one type system ---------------------------------
// The conversions are dtypes.h's SCAPE_HD functions, the host's own code, so a conversion gives
// the host's bits for every value, NaN payloads included (an fp16 NaN keeps the top of its
// payload, as on the host). What is not the same is fp32 arithmetic on a NaN: the GPU returns
// its canonical NaN (0x7fffffff, stored as fp16 0x7fff, bf16 0x7fff), x86 keeps an operand's
// payload and sign (a quiet NaN 0x7fc00000 input stays 0x7fc00000: fp16 0x7e00). So with
// nonFinite = Ignore a NaN that went through the step's arithmetic may differ in its bits
// between the device and the host step (never in being a NaN); the host's reductions make
// every NaN result canonical (kernels/cpu/reduce.cc), so reduced values agree again. The
// payload types a kernel takes directly are visited through
// dtypes.h's one switch (VisitUnscaledPayload): a kernel is instantiated on dtypes' traits
// (F32T, Bf16T, F16T), and any other type is kUnsupported at the call, never a default.
using ::scape::dtypes::Bf16ToFloat;
using ::scape::dtypes::FloatToBf16;
using ::scape::dtypes::FloatToFp16;
using ::scape::dtypes::Fp16ToFloat;

// The payload traits' element access. StorePayload returns the value as stored (v for fp32),
// for the rounding-error feedback.
template <typename Tr>
__device__ __forceinline__ float StorePayload(void* p, uint64_t j, float v) {
  using S = typename Tr::Storage;
  const S h = Tr::Store(v);
  static_cast<S*>(p)[j] = h;
  return Tr::Load(h);
}
template <typename Tr>
__device__ __forceinline__ float LoadPayload(const void* p, uint64_t j) {
  return Tr::Load(static_cast<const typename Tr::Storage*>(p)[j]);
}
// fp32: no rounding on store (the residual's rounding error is +0).
template <typename Tr>
constexpr bool kIsF32 = std::is_same<Tr, ::scape::dtypes::F32T>::value;

// Host code, around launches: f(Traits{}) for fp32, bf16 and fp16; false (f not called) for
// any other value.
template <typename F>
bool VisitPayloadType(int t, F&& f) {
  return ::scape::dtypes::VisitUnscaledPayload(t, f);
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
