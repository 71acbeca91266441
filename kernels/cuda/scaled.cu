#include "kernels/cuda/scaled.cuh"

#include "kernels/dtypes.h"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(size_t k) {
  const size_t want = (k + kThreads - 1) / kThreads;
  return static_cast<int>(want < 4096 ? want : 4096);
}

// Non-negative floats order like their bits: one atomicMax per warp on the bits.
__global__ void AmaxKernel(const float* __restrict__ x, size_t k, unsigned int* amax_bits) {
  unsigned int m = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const unsigned int b = __float_as_uint(x[j]) & 0x7fffffffu;
    if (b <= 0x7f800000u && b > m) m = b;  // NaN skipped
  }
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0 && m) atomicMax(amax_bits, m);
}

template <typename T>
__global__ void QuantizeKernel(const float* __restrict__ x, size_t k, const float* amax, int nranks,
                               float max_finite, typename T::Storage* __restrict__ q,
                               const uint64_t* __restrict__ pos, float* __restrict__ residual) {
  const int e = dtypes::ScaleExponent(*amax, nranks, max_finite);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    const float v = x[j];
    const typename T::Storage c = T::Store(ldexpf(v, -e));
    q[j] = c;
    if (residual) {
      const float err = __fsub_rn(v, ldexpf(T::Load(c), e));
      residual[pos[j]] = isfinite(err) ? err : 0.0f;
    }
  }
}

template <typename T>
__global__ void DequantizeKernel(const typename T::Storage* __restrict__ q, size_t k,
                                 const float* amax, int nranks, float max_finite,
                                 float* __restrict__ out) {
  const int e = dtypes::ScaleExponent(*amax, nranks, max_finite);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride)
    out[j] = ldexpf(T::Load(q[j]), e);
}

KernelStatus Launched() {
  return cudaGetLastError() == cudaSuccess ? KernelStatus::kOk : KernelStatus::kCudaError;
}

}  // namespace

KernelStatus PayloadAmaxCuda(const float* d_x, size_t k, float* d_amax, cudaStream_t stream) {
  if (!d_amax || (k > 0 && !d_x)) return KernelStatus::kInvalidArgument;
  if (cudaMemsetAsync(d_amax, 0, sizeof(float), stream) != cudaSuccess)
    return KernelStatus::kCudaError;
  if (k == 0) return KernelStatus::kOk;
  AmaxKernel<<<Blocks(k), kThreads, 0, stream>>>(d_x, k, reinterpret_cast<unsigned int*>(d_amax));
  return Launched();
}

KernelStatus QuantizeScaledCuda(const float* d_x, size_t k, scapeDataType_t type,
                                const float* d_amax, int nranks, void* d_q, const uint64_t* d_pos,
                                float* d_residual, cudaStream_t stream) {
  if (!dtypes::IsScaled(type)) return KernelStatus::kUnsupported;
  if (nranks < 1 || !d_amax || (k > 0 && (!d_x || !d_q || (d_residual && !d_pos))))
    return KernelStatus::kInvalidArgument;
  if (k == 0) return KernelStatus::kOk;
  const float mf = dtypes::Row(type)->maxFinite;
  dtypes::VisitFloat(type, [&](auto tr) {
    using T = decltype(tr);
    QuantizeKernel<T><<<Blocks(k), kThreads, 0, stream>>>(
        d_x, k, d_amax, nranks, mf, static_cast<typename T::Storage*>(d_q), d_pos, d_residual);
  });
  return Launched();
}

KernelStatus DequantizeScaledCuda(const void* d_q, size_t k, scapeDataType_t type,
                                  const float* d_amax, int nranks, float* d_out,
                                  cudaStream_t stream) {
  if (!dtypes::IsScaled(type)) return KernelStatus::kUnsupported;
  if (nranks < 1 || !d_amax || (k > 0 && (!d_q || !d_out))) return KernelStatus::kInvalidArgument;
  if (k == 0) return KernelStatus::kOk;
  const float mf = dtypes::Row(type)->maxFinite;
  dtypes::VisitFloat(type, [&](auto tr) {
    using T = decltype(tr);
    DequantizeKernel<T><<<Blocks(k), kThreads, 0, stream>>>(
        static_cast<const typename T::Storage*>(d_q), k, d_amax, nranks, mf, d_out);
  });
  return Launched();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
