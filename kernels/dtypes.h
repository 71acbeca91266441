// The element-type table: one row per scapeDataType_t, the one home of what the library knows
// about a type (CONTRIBUTING.md, "Adding a payload type"). Everything that depends on a type
// asks here: its size (scapeTypeSize, buffer sizes, byte accounting), its C and Python names
// (error messages, scape-perf, the Python binding's names), whether it may be the optimizer's
// payload, its scale rule, the code a checkpoint stores, NCCL's code, and its conversion to and
// from fp32 (SCAPE_HD: the same code on the host and in CUDA kernels, so both give the same
// bits). Code that handles several floating-point types visits them through VisitFloat (the one
// switch on a type outside this file's rows); an unknown type is an error there, never a
// default. tests/check_closed_sets.py fails the test command on a switch over scapeDataType_t
// values anywhere else.
//
// Conversions from fp32 round to nearest, ties to even. fp16 / bf16: overflow gives +-inf, NaN
// stays NaN (quiet). fp8 (OCP 8-bit floating point, v1.0):
//   e4m3 ("E4M3FN"): 4 exponent bits (bias 7), 3 mantissa bits, no infinities, one NaN per sign
//     (S.1111.111); largest finite 448, smallest subnormal 2^-9. Not saturating: a value that
//     rounds beyond 448, an infinity or a NaN gives NaN (0x7f, or 0xff with the sign).
//   e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: +-inf (S.11111.00), NaN; largest
//     finite 57344, smallest subnormal 2^-16. Overflow gives +-inf; a NaN gives 0x7e (quiet).
// Conversions to fp32 are exact.
//
// Scale rule (TypeRow::scaled): an 8-bit payload carries one shared power-of-two scale per
// message, s = 2^ScaleExponent(amax, nranks, maxFinite), agreed by every rank before the values
// are converted (amax: the largest |value| over all ranks' messages). Values move as x / s, so
// the sum of nranks of them stays within the type's range; a reduced value is read back as
// s * value. Multiplying by a power of two is exact, so the scale adds no rounding of its own.
#ifndef SCAPE_KERNELS_DTYPES_H_
#define SCAPE_KERNELS_DTYPES_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "scape/scape.h"

#if defined(__CUDACC__)
#define SCAPE_HD __host__ __device__ __forceinline__
#else
#define SCAPE_HD inline
#endif

namespace scape {
namespace dtypes {

SCAPE_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
SCAPE_HD float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// Round to the nearest integer, ties to even (the default rounding mode on the host).
SCAPE_HD float RoundEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// ---- bf16 / fp16 ----------------------------------------------------------------------------
SCAPE_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }
SCAPE_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (carries into the exponent)
  return static_cast<uint16_t>(u >> 16);
}
SCAPE_HD float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsFloat(sign | FloatBits(mag));
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}
SCAPE_HD uint16_t FloatToFp16(float f) {
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
    const float t = BitsFloat(u) + 0.5f;
    out = FloatBits(t) - 0x3f000000u;
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round half to even
    out = u >> 13;
    if (out > 0x7c00u) out = 0x7c00u;
  }
  return static_cast<uint16_t>(out | sign);
}

// ---- fp8: E exponent bits, M mantissa bits, bias 2^(E-1) - 1 ----------------------------------
// kIeee: the all-ones exponent holds inf / NaN (e5m2); otherwise only S.1..1.1..1 is NaN (e4m3).
template <int E, int M, bool kIeee>
struct Fp8 {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr uint32_t kExpMax = (1u << E) - 1;
  // Largest finite code (magnitude) and the NaN / inf codes (magnitude).
  static constexpr uint32_t kMaxCode =
      kIeee ? ((kExpMax << M) - 1) : ((kExpMax << M) | ((1u << M) - 2));
  static constexpr uint32_t kNan =
      kIeee ? ((kExpMax << M) | (1u << (M - 1))) : ((kExpMax << M) | ((1u << M) - 1));
  static constexpr uint32_t kInf = kIeee ? (kExpMax << M) : kNan;

  static SCAPE_HD float ToFloat(uint8_t c) {
    const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
    const uint32_t mag = c & 0x7fu;
    const uint32_t exp = mag >> M, man = mag & ((1u << M) - 1);
    if (kIeee ? exp == kExpMax : mag == kNan)
      return BitsFloat(sign | (kIeee && man == 0 ? 0x7f800000u : 0x7fc00000u));
    if (exp == 0) {  // zero or subnormal: man * 2^(1 - bias - M), exact in fp32
      const float mag_f =
          static_cast<float>(man) * BitsFloat(static_cast<uint32_t>(127 + 1 - kBias - M) << 23);
      return BitsFloat(sign | FloatBits(mag_f));
    }
    return BitsFloat(sign | ((exp + 127u - kBias) << 23) | (man << (23 - M)));
  }
  static SCAPE_HD uint8_t FromFloat(float f) {
    const uint32_t u = FloatBits(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint8_t>(kIeee ? kNan : (kNan | sign));  // NaN
    uint32_t mag;
    if (a < (static_cast<uint32_t>(127 + 1 - kBias) << 23)) {
      // Below the smallest normal: a multiple of the subnormal step 2^(1 - bias - M), rounded to
      // nearest even by the FPU (the scaling by a power of two is exact). A value that rounds up
      // to 2^M steps is the smallest normal, whose code is 2^M as well.
      const float steps =
          BitsFloat(a) * BitsFloat(static_cast<uint32_t>(127 - 1 + kBias + M) << 23);
      mag = static_cast<uint32_t>(RoundEven(steps));
    } else if (a >= 0x7f800000u) {
      mag = kInf;  // an infinity: inf (e5m2) or NaN (e4m3)
    } else {
      // Round fp32's 23 mantissa bits to M, to nearest even (a carry moves into the exponent),
      // then rebias the exponent.
      const uint32_t shift = 23 - M;
      const uint32_t r = (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u)) >> shift;
      const uint32_t rebias = static_cast<uint32_t>(127 - kBias) << M;
      mag = r - rebias;
      if (r < rebias || mag > kMaxCode) mag = kInf;  // beyond the largest finite value
    }
    return static_cast<uint8_t>(mag | sign);
  }
};
using E4m3 = Fp8<4, 3, false>;
using E5m2 = Fp8<5, 2, true>;

SCAPE_HD float E4m3ToFloat(uint8_t c) { return E4m3::ToFloat(c); }
SCAPE_HD uint8_t FloatToE4m3(float f) { return E4m3::FromFloat(f); }
SCAPE_HD float E5m2ToFloat(uint8_t c) { return E5m2::ToFloat(c); }
SCAPE_HD uint8_t FloatToE5m2(float f) { return E5m2::FromFloat(f); }

// ---- the table ----------------------------------------------------------------------------
struct TypeRow {
  scapeDataType_t type;
  const char* cName;       // "scapeFloat32": error messages
  const char* shortName;   // "fp32": scape-perf's -d, the Python binding's string form
  const char* torchName;   // the torch dtype's attribute ("float32"), nullptr: none
  unsigned size;           // bytes of one element
  bool floating;           // converts to and from fp32 (VisitFloat)
  bool payload;            // may be the optimizer's payload type (scapeOptimConfig_t.payloadType)
  bool scaled;             // the scale rule above applies (8-bit payloads)
  float maxFinite;         // largest finite value (floating types)
  int32_t checkpointCode;  // what a checkpoint stores for it as payload type
  int ncclType;            // ncclDataType_t, -1: NCCL has none
};

// Indexed by scapeDataType_t (the static_asserts below).
constexpr TypeRow kTypes[] = {
    {scapeFloat32, "scapeFloat32", "fp32", "float32", 4, true, true, false, 3.40282347e38f, 0, 7},
    {scapeFloat16, "scapeFloat16", "fp16", "float16", 2, true, true, false, 65504.0f, 1, 6},
    {scapeBfloat16, "scapeBfloat16", "bf16", "bfloat16", 2, true, true, false, 3.38953139e38f, 2,
     9},
    {scapeInt32, "scapeInt32", "int32", "int32", 4, false, false, false, 0.0f, -1, 2},
    {scapeInt64, "scapeInt64", "int64", "int64", 8, false, false, false, 0.0f, -1, 4},
    {scapeFloat8E4M3, "scapeFloat8E4M3", "e4m3", "float8_e4m3fn", 1, true, true, true, 448.0f, 5,
     10},
    {scapeFloat8E5M2, "scapeFloat8E5M2", "e5m2", "float8_e5m2", 1, true, true, true, 57344.0f, 6,
     11},
};
static_assert(sizeof(kTypes) / sizeof(kTypes[0]) == scapeNumTypes,
              "kernels/dtypes.h: one row per scapeDataType_t");
constexpr bool RowsInOrder(int i = 0) {
  return i == scapeNumTypes || (kTypes[i].type == i && RowsInOrder(i + 1));
}
static_assert(RowsInOrder(), "kernels/dtypes.h: row i is scapeDataType_t i");

// The row of t, or nullptr for a value that is no scapeDataType_t.
inline const TypeRow* Row(int t) { return t >= 0 && t < scapeNumTypes ? &kTypes[t] : nullptr; }
inline size_t Size(int t) { return Row(t) ? Row(t)->size : 0; }
inline const char* Name(int t) { return Row(t) ? Row(t)->cName : "an unknown type"; }
inline bool IsPayload(int t) { return Row(t) && Row(t)->payload; }
inline bool IsScaled(int t) { return Row(t) && Row(t)->scaled; }
// The type a checkpoint's payload code stands for (TypeRow::checkpointCode), -1 for none.
inline int FromCheckpointCode(int32_t code) {
  for (const TypeRow& r : kTypes)
    if (r.payload && r.checkpointCode == code) return r.type;
  return -1;
}
// The payload types' C names, "a, b or c" (for the error of a bad payloadType).
inline const char* PayloadNames() {
  static const std::string names = [] {
    std::string s, last;
    for (const TypeRow& r : kTypes) {
      if (!r.payload) continue;
      if (!last.empty()) s += s.empty() ? last : ", " + last;
      last = r.cName;
    }
    return s.empty() ? last : s + " or " + last;
  }();
  return names.c_str();
}

// The exponent e of the shared scale s = 2^e: the smallest e with amax * nranks / 2^e <=
// maxFinite; 0 when amax is 0 or not finite (a NaN or inf then shows in the reduced values).
SCAPE_HD int ScaleExponent(float amax, int nranks, float maxFinite) {
  if (!(amax > 0.0f) || !(amax <= 3.40282347e38f) || nranks < 1) return 0;
  const double y = static_cast<double>(amax) * nranks;
  int e = static_cast<int>(::ilogb(y / maxFinite));
  while (::ldexp(y, -e) > maxFinite) ++e;
  while (::ldexp(y, -(e - 1)) <= maxFinite) --e;
  return e;
}

// ---- visiting the floating-point types -------------------------------------------------------
// The element traits VisitFloat hands to its callable: Storage, and the conversions.
struct F32T {
  using Storage = float;
  static SCAPE_HD float Load(float v) { return v; }
  static SCAPE_HD float Store(float v) { return v; }
};
struct F16T {
  using Storage = uint16_t;
  static SCAPE_HD float Load(uint16_t v) { return Fp16ToFloat(v); }
  static SCAPE_HD uint16_t Store(float v) { return FloatToFp16(v); }
};
struct Bf16T {
  using Storage = uint16_t;
  static SCAPE_HD float Load(uint16_t v) { return Bf16ToFloat(v); }
  static SCAPE_HD uint16_t Store(float v) { return FloatToBf16(v); }
};
struct E4m3T {
  using Storage = uint8_t;
  static SCAPE_HD float Load(uint8_t v) { return E4m3::ToFloat(v); }
  static SCAPE_HD uint8_t Store(float v) { return E4m3::FromFloat(v); }
};
struct E5m2T {
  using Storage = uint8_t;
  static SCAPE_HD float Load(uint8_t v) { return E5m2::ToFloat(v); }
  static SCAPE_HD uint8_t Store(float v) { return E5m2::FromFloat(v); }
};

// The one switch on the floating-point types: calls f(Traits{}) for a floating-point type and
// returns true; false (f not called) for any other value, and, kScaled false, for the scaled
// types too (whose traits are then not instantiated).
template <bool kScaled, typename F>
inline bool VisitFloatTypes(int t, F&& f) {
  switch (t) {
    case scapeFloat32:
      f(F32T{});
      return true;
    case scapeFloat16:
      f(F16T{});
      return true;
    case scapeBfloat16:
      f(Bf16T{});
      return true;
    case scapeFloat8E4M3:
      if constexpr (kScaled) f(E4m3T{});
      return kScaled;
    case scapeFloat8E5M2:
      if constexpr (kScaled) f(E5m2T{});
      return kScaled;
    default:
      return false;
  }
}
static_assert(kTypes[scapeFloat8E4M3].scaled && kTypes[scapeFloat8E5M2].scaled &&
                  !kTypes[scapeFloat32].scaled && !kTypes[scapeFloat16].scaled &&
                  !kTypes[scapeBfloat16].scaled,
              "kernels/dtypes.h: VisitFloatTypes' scaled cases are the rows marked scaled");
// Every floating-point type.
template <typename F>
inline bool VisitFloat(int t, F&& f) {
  return VisitFloatTypes<true>(t, f);
}
// The payload types the step kernels take directly (payload and not scaled: a scaled payload
// reaches them as fp32, converted around the exchange).
template <typename F>
inline bool VisitUnscaledPayload(int t, F&& f) {
  return VisitFloatTypes<false>(t, f);
}

// One element of a floating-point type <-> fp32 (p: the element's bytes). Slow paths (per
// element dispatch): messages, the sparse codec. NaN (Load) / nothing written (Store) for a
// type that is not floating.
inline float LoadAsFloat(int t, const void* p) {
  float out = NAN;
  VisitFloat(t, [&](auto tr) {
    typename decltype(tr)::Storage v;
    memcpy(&v, p, sizeof v);
    out = decltype(tr)::Load(v);
  });
  return out;
}
inline void StoreFromFloat(int t, void* p, float f) {
  VisitFloat(t, [&](auto tr) {
    const typename decltype(tr)::Storage v = decltype(tr)::Store(f);
    memcpy(p, &v, sizeof v);
  });
}

}  // namespace dtypes
}  // namespace scape

#endif  // SCAPE_KERNELS_DTYPES_H_
