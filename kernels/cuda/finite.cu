#include "kernels/cuda/finite.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

__global__ void AnyNonFiniteKernel(const float* __restrict__ x, size_t n, uint32_t* flag) {
  uint32_t bad = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
  // One store per warp that saw one (every writer stores 1: the order does not matter).
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *flag = 1;
}

__global__ void AnyNonFinite16Kernel(const uint16_t* __restrict__ x, size_t n, uint16_t mask,
                                     uint32_t* flag) {
  uint32_t bad = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    bad |= (x[i] & mask) == mask;
  if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *flag = 1;
}

constexpr int kThreads = 256;

// What both checks do around the launch: the argument check, the flag cleared on the stream,
// then launch(blocks) with kThreads threads each (one per element, at most 4096 blocks).
template <typename Launch>
KernelStatus FlagCheck(const void* d_x, size_t n, uint32_t* d_flag, cudaStream_t stream,
                       Launch launch) {
  if (!d_flag || (n > 0 && !d_x)) return KernelStatus::kInvalidArgument;
  if (cudaMemsetAsync(d_flag, 0, sizeof(uint32_t), stream) != cudaSuccess)
    return KernelStatus::kCudaError;
  if (n == 0) return KernelStatus::kOk;
  const size_t want = (n + kThreads - 1) / kThreads;
  launch(static_cast<int>(want < 4096 ? want : 4096));
  return cudaGetLastError() == cudaSuccess ? KernelStatus::kOk : KernelStatus::kCudaError;
}

}  // namespace

KernelStatus AnyNonFinite16Cuda(const uint16_t* d_x, size_t n, uint16_t exp_mask, uint32_t* d_flag,
                                cudaStream_t stream) {
  return FlagCheck(d_x, n, d_flag, stream, [&](int blocks) {
    AnyNonFinite16Kernel<<<blocks, kThreads, 0, stream>>>(d_x, n, exp_mask, d_flag);
  });
}

KernelStatus AnyNonFiniteCuda(const float* d_x, size_t n, uint32_t* d_flag, cudaStream_t stream) {
  return FlagCheck(d_x, n, d_flag, stream, [&](int blocks) {
    AnyNonFiniteKernel<<<blocks, kThreads, 0, stream>>>(d_x, n, d_flag);
  });
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
