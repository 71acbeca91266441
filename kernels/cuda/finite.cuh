// Contract: kernels/cpu/finite.h on the device (the optimizer's non-finite check of device
// gradients, plugin/optim/optim_device.cc).
#ifndef SCAPE_KERNELS_CUDA_FINITE_CUH_
#define SCAPE_KERNELS_CUDA_FINITE_CUH_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"

namespace scape {
namespace kernels {
namespace cuda {

// Enqueued on `stream`: *d_flag (device) = 1 when d_x[0, n) holds an inf or NaN, else 0 (the
// flag is cleared first, on the stream). One read of d_x. kInvalidArgument: d_flag null, or
// d_x null with n > 0; kCudaError: a launch failed.
KernelStatus AnyNonFiniteCuda(const float* d_x, size_t n, uint32_t* d_flag, cudaStream_t stream);
// The same for n 16-bit floats whose exponent bits are exp_mask (bf16 0x7f80, fp16 0x7c00).
KernelStatus AnyNonFinite16Cuda(const uint16_t* d_x, size_t n, uint16_t exp_mask, uint32_t* d_flag,
                                cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CUDA_FINITE_CUH_
