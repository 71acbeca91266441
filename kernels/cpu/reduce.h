// Contract: element-wise reductions used by the collectives (CPU).
//
// ReduceInto(dtype, op, dst, a, b, n, finalDivisor):
//   dst[i] = op(a[i], b[i]) for i < n, computed in fp32 for fp16/bf16/fp8 (one rounding to the
//   element type at the end), in the element type for fp32/int32/int64.
//   op is scapeSum, scapeMax or scapeMin; scapeAvg reduces as scapeSum (the average is the sum
//   divided once, by the caller's finalDivisor).
//   If finalDivisor > 1 the result is divided by it before rounding (used by the last hop of
//   an average); integers divide with truncation toward zero.
//   Commutative bit for bit: ReduceInto(dst, a, b) == ReduceInto(dst, b, a), which is what lets
//   recursive doubling give identical bits on every rank.
//   Aliasing: dst may equal a or b; no other overlap. n == 0 is a no-op.
//   max/min follow fmaxf/fminf (a NaN operand loses to a number), with max(+0, -0) = +0 and
//   min(+0, -0) = -0 in either operand order (fmaxf may return either zero). A NaN result of a
//   floating-point type is the canonical quiet NaN (fp32 0x7fc00000, bf16 0x7fc0, fp16 0x7e00, e4m3
//   0x7f, e5m2 0x7e), whatever the operands' payloads: the order x86 keeps a payload in depends on
//   the operand order, which the bit-for-bit commutativity above excludes.
// Returns KernelStatus::kInvalidArgument for an invalid dtype or op, or a null pointer with
// n > 0 (nothing written); kOk otherwise.
#ifndef SCAPE_KERNELS_CPU_REDUCE_H_
#define SCAPE_KERNELS_CPU_REDUCE_H_

#include <cstddef>

#include "kernels/cpu/kernel_status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {

KernelStatus ReduceInto(scapeDataType_t dtype, scapeRedOp_t op, void* dst, const void* a,
                        const void* b, size_t n, int finalDivisor);

// buf[i] = buf[i] / divisor (used for an average when no reduction hop remains, e.g. 1 rank).
// kInvalidArgument for an invalid dtype or a null buf with n > 0.
KernelStatus DivideInPlace(scapeDataType_t dtype, void* buf, size_t n, int divisor);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_REDUCE_H_
