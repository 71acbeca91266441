// Contract: element-type conversion (CPU).
//
// fp32 -> fp16 and fp32 -> bf16 round to nearest, ties to even; overflow gives +-inf; NaN stays
// NaN (quiet). fp16/bf16 -> fp32 is exact. All functions are pure, thread-safe, and accept
// n == 0 with any pointers. src and dst may not overlap unless they are the same pointer and
// the element sizes are equal.
#ifndef SCAPE_KERNELS_CPU_DTYPE_H_
#define SCAPE_KERNELS_CPU_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/dtypes.h"

namespace scape {
namespace kernels {

// The scalar conversions live in the type table (kernels/dtypes.h, host and CUDA alike).
using dtypes::Bf16ToFloat;
using dtypes::BitsFloat;
using dtypes::FloatBits;
using dtypes::FloatToBf16;
using dtypes::FloatToFp16;
using dtypes::Fp16ToFloat;

void ConvertFloatToBf16(const float* src, uint16_t* dst, size_t n);
void ConvertBf16ToFloat(const uint16_t* src, float* dst, size_t n);
void ConvertFloatToFp16(const float* src, uint16_t* dst, size_t n);
void ConvertFp16ToFloat(const uint16_t* src, float* dst, size_t n);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_DTYPE_H_
