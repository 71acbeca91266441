// Contract: finding a non-finite value (inf or NaN) in an fp32 buffer, for the optimizer's
// agreement on non-finite gradients (plugin/optim, issue 24 item 9).
//
// FirstNonFinite writes to *first the lowest index i < n with x[i] infinite or NaN (exponent
// bits all ones), or n when every value is finite. n == 0 is valid (x may then be null).
// The common case (all finite) is one read of x on up to max_threads threads (0: all cores;
// inputs below 512 Ki elements on the calling thread), a compare-and-or per element that the
// compiler vectorises; the index is searched only when something was found.
// Errors: kInvalidArgument (x null with n > 0).
#ifndef SCAPE_KERNELS_CPU_FINITE_H_
#define SCAPE_KERNELS_CPU_FINITE_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"

namespace scape {
namespace kernels {

KernelStatus FirstNonFinite(const float* x, size_t n, size_t* first, int max_threads = 0);

// The same for n 16-bit floats whose exponent bits are `exp_mask` (bf16: 0x7f80, fp16: 0x7c00):
// non-finite when they are all ones. One thread. Errors: kInvalidArgument (x null with n > 0).
KernelStatus FirstNonFinite16(const uint16_t* x, size_t n, uint16_t exp_mask, size_t* first);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_FINITE_H_
