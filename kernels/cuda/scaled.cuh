// Contract: kernels/cpu/scaled.h on the device (a scaled payload type's conversions, for the
// optimizer's device step, plugin/optim/optim_device.cc). The same bits as the CPU kernels: the
// conversions are kernels/dtypes.h's SCAPE_HD functions, the scale a power of two.
// Every function is enqueued on `stream` and returns without synchronising; the amax is device
// memory (the step agrees it with a max all-reduce on the device, no host wait).
#ifndef SCAPE_KERNELS_CUDA_SCALED_CUH_
#define SCAPE_KERNELS_CUDA_SCALED_CUH_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {
namespace cuda {

// *d_amax = max_j |d_x[j]| (NaN skipped; +0 for k == 0); cleared first, on the stream.
KernelStatus PayloadAmaxCuda(const float* d_x, size_t k, float* d_amax, cudaStream_t stream);
// QuantizeScaled with the amax read from d_amax (device); d_pos / d_residual may be null
// together (no error feedback).
KernelStatus QuantizeScaledCuda(const float* d_x, size_t k, scapeDataType_t type,
                                const float* d_amax, int nranks, void* d_q, const uint64_t* d_pos,
                                float* d_residual, cudaStream_t stream);
KernelStatus DequantizeScaledCuda(const void* d_q, size_t k, scapeDataType_t type,
                                  const float* d_amax, int nranks, float* d_out,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CUDA_SCALED_CUH_
