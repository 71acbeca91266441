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

namespace scape {
namespace kernels {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (carries into the exponent)
  return static_cast<uint16_t>(u >> 16);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in fp32
    float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(sign | FloatBits(mag));
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t FloatToFp16(float f) {
  uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t out;
  if (u >= 0x47800000u) {  // |f| >= 65536, inf or NaN
    // NaN keeps the top of its payload and is made quiet, as F16C hardware does.
    out = u > 0x7f800000u ? (0x7e00u | ((u >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (u < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // Adding 0.5 aligns the half's subnormal ulp (2^-24) with the fp32 ulp, so the FPU does
    // the round-to-nearest-even for us.
    float t = BitsFloat(u) + 0.5f;
    out = FloatBits(t) - 0x3f000000u;
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round half to even
    out = u >> 13;
    if (out > 0x7c00u) out = 0x7c00u;
  }
  return static_cast<uint16_t>(out | sign);
}

void ConvertFloatToBf16(const float* src, uint16_t* dst, size_t n);
void ConvertBf16ToFloat(const uint16_t* src, float* dst, size_t n);
void ConvertFloatToFp16(const float* src, uint16_t* dst, size_t n);
void ConvertFp16ToFloat(const uint16_t* src, float* dst, size_t n);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_DTYPE_H_
