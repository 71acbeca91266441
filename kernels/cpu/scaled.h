// Contract: the conversion kernels of a scaled payload type (kernels/dtypes.h, the scale rule:
// e4m3 / e5m2 with one shared power-of-two scale per message). CPU here; the CUDA forms
// (kernels/cuda/scape_kernels.cuh, ScaledAmaxCuda / QuantizeScaledCuda / DequantizeScaledCuda)
// give the same bits: the conversions are the table's SCAPE_HD functions and the scaling is by
// a power of two (exact).
//
//   PayloadAmax:      *amax = max_j |x[j]| (j < k); NaN entries are skipped (fmaxf's rule), +0
//                     for k == 0.
//   QuantizeScaled:   e = ScaleExponent(amax, nranks, maxFinite of type); for j < k
//                       q[j] = Store(x[j] * 2^-e)
//                     and, with residual non-null, the rounding error goes back into the
//                     residual at the payload's position (error feedback):
//                       residual[pos[j]] = x[j] - Load(q[j]) * 2^e   (+0 where that is not
//                                                                     finite)
//   DequantizeScaled: out[j] = Load(q[j]) * 2^e, e from the same amax and nranks.
// amax must be the same on every rank (the largest over all ranks' messages), so the scale is.
// Errors: kUnsupported (type is not a scaled payload type), kInvalidArgument (a null pointer
// with k > 0, nranks < 1). Nothing is written on error. k == 0 is valid.
#ifndef SCAPE_KERNELS_CPU_SCALED_H_
#define SCAPE_KERNELS_CPU_SCALED_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {

KernelStatus PayloadAmax(const float* x, size_t k, float* amax);
KernelStatus QuantizeScaled(const float* x, size_t k, scapeDataType_t type, float amax, int nranks,
                            void* q, const uint64_t* pos, float* residual);
KernelStatus DequantizeScaled(const void* q, size_t k, scapeDataType_t type, float amax, int nranks,
                              float* out);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_SCALED_H_
