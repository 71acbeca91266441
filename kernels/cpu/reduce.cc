#include "kernels/cpu/reduce.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "kernels/cpu/dtype.h"

namespace scape {
namespace kernels {
namespace {

struct OpSum {
  template <typename T>
  static T Apply(T a, T b) {
    return a + b;
  }
};
// fmax/fmin of +0 and -0 may return either operand (x86's maxss returns the second), so equal
// operands are settled on their bits: max(+0, -0) = +0 (AND of the sign bits), min = -0 (OR).
// Equal non-zero operands have equal bits, which AND and OR leave as they are.
struct OpMax {
  static float Apply(float a, float b) {
    return a == b ? BitsFloat(FloatBits(a) & FloatBits(b)) : std::fmax(a, b);
  }
  template <typename T>
  static T Apply(T a, T b) {
    return a > b ? a : b;
  }
};
struct OpMin {
  static float Apply(float a, float b) {
    return a == b ? BitsFloat(FloatBits(a) | FloatBits(b)) : std::fmin(a, b);
  }
  template <typename T>
  static T Apply(T a, T b) {
    return a < b ? a : b;
  }
};

// A NaN result becomes the canonical quiet NaN: which operand's payload an fp32 add (or
// fmax/fmin of two NaNs) keeps depends on the operand order the compiler or the vector unit
// picks, and the contract promises the same bits for (a, b) and (b, a).
constexpr uint32_t kCanonicalNaNBits = 0x7fc00000u;
inline float CanonNaN(float r) { return r != r ? BitsFloat(kCanonicalNaNBits) : r; }

// Integers: two's complement wrap-around, done in unsigned arithmetic to avoid UB.
template <typename T, typename U>
struct IntSum {
  static T Apply(T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
};

template <typename Op>
void ReduceF32(float* dst, const float* a, const float* b, size_t n, int div) {
  if (div > 1) {
    const float d = static_cast<float>(div);
    for (size_t i = 0; i < n; ++i) dst[i] = CanonNaN(Op::Apply(a[i], b[i]) / d);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = CanonNaN(Op::Apply(a[i], b[i]));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SCAPE_X86_SIMD 1
// Sums of fp16 and bf16 with AVX2 (and F16C for fp16). They give the same bits as the scalar
// loops below (one IEEE fp32 add, an optional fp32 divide, a NaN made canonical, one
// round-to-nearest-even), so ranks on machines with and without these instructions still agree
// bit for bit.
__attribute__((target("avx2"))) inline __m256 CanonNaN8(__m256 r) {
  return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(kCanonicalNaNBits)),
                          _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
}

__attribute__((target("avx2,f16c"))) size_t SumFp16Avx2(uint16_t* dst, const uint16_t* a,
                                                        const uint16_t* b, size_t n, int div) {
  const __m256 d = _mm256_set1_ps(static_cast<float>(div));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    __m256 r = _mm256_add_ps(x, y);
    if (div > 1) r = _mm256_div_ps(r, d);
    r = CanonNaN8(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  return i;
}

__attribute__((target("avx2"))) size_t SumBf16Avx2(uint16_t* dst, const uint16_t* a,
                                                   const uint16_t* b, size_t n, int div) {
  const __m256 d = _mm256_set1_ps(static_cast<float>(div));
  const __m256i absMask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i xa = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))), 16);
    __m256i xb = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))), 16);
    __m256 r = _mm256_add_ps(_mm256_castsi256_ps(xa), _mm256_castsi256_ps(xb));
    if (div > 1) r = _mm256_div_ps(r, d);
    r = CanonNaN8(r);
    __m256i u = _mm256_castps_si256(r);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absMask), inf);
    __m256i rounded = _mm256_add_epi32(
        u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan);
    out = _mm256_srli_epi32(out, 16);
    // pack 8 x 32-bit (values < 65536) into 8 x 16-bit
    __m128i lo = _mm256_castsi256_si128(out), hi = _mm256_extracti128_si256(out, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi32(lo, hi));
  }
  return i;
}

bool HaveAvx2F16c() {
  // clang 14 knows no "f16c" for __builtin_cpu_supports: read CPUID leaf 1, ECX bit 29.
  static const bool have = __builtin_cpu_supports("avx2") && [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
  }();
  return have;
}
#endif

// T: the element traits of a narrower floating-point type (kernels/dtypes.h).
template <typename Op, typename T>
void ReduceNarrow(typename T::Storage* dst, const typename T::Storage* a,
                  const typename T::Storage* b, size_t n, int div) {
#ifdef SCAPE_X86_SIMD
  constexpr bool kF16 = std::is_same<T, dtypes::F16T>::value;
  constexpr bool kBf16 = std::is_same<T, dtypes::Bf16T>::value;
  if ((kF16 || kBf16) && std::is_same<Op, OpSum>::value && HaveAvx2F16c()) {
    auto* d16 = reinterpret_cast<uint16_t*>(dst);
    auto* a16 = reinterpret_cast<const uint16_t*>(a);
    auto* b16 = reinterpret_cast<const uint16_t*>(b);
    size_t done = kF16 ? SumFp16Avx2(d16, a16, b16, n, div) : SumBf16Avx2(d16, a16, b16, n, div);
    dst += done;
    a += done;
    b += done;
    n -= done;
  }
#endif
  const float d = static_cast<float>(div > 1 ? div : 1);
  if (div > 1) {
    for (size_t i = 0; i < n; ++i)
      dst[i] = T::Store(CanonNaN(Op::Apply(T::Load(a[i]), T::Load(b[i])) / d));
  } else {
    for (size_t i = 0; i < n; ++i)
      dst[i] = T::Store(CanonNaN(Op::Apply(T::Load(a[i]), T::Load(b[i]))));
  }
}

template <typename T, typename Op>
void ReduceInt(T* dst, const T* a, const T* b, size_t n, int div) {
  for (size_t i = 0; i < n; ++i) {
    T r = Op::Apply(a[i], b[i]);
    dst[i] = div > 1 ? static_cast<T>(r / div) : r;
  }
}

template <typename T>
bool ReduceIntAny(scapeRedOp_t op, T* dst, const T* a, const T* b, size_t n, int div) {
  using U = typename std::make_unsigned<T>::type;
  switch (op) {
    case scapeSum:
    case scapeAvg:
      ReduceInt<T, IntSum<T, U>>(dst, a, b, n, div);
      return true;
    case scapeMax:
      ReduceInt<T, OpMax>(dst, a, b, n, div);
      return true;
    case scapeMin:
      ReduceInt<T, OpMin>(dst, a, b, n, div);
      return true;
    default:
      return false;
  }
}

template <typename Op>
bool ReduceTyped(scapeDataType_t dtype, void* dst, const void* a, const void* b, size_t n,
                 int div) {
  if (dtype == scapeFloat32) {
    ReduceF32<Op>(static_cast<float*>(dst), static_cast<const float*>(a),
                  static_cast<const float*>(b), n, div);
    return true;
  }
  // The narrower floating-point types (kernels/dtypes.h): in fp32, rounded once.
  return dtypes::VisitFloat(dtype, [&](auto tr) {
    using T = decltype(tr);
    using S = typename T::Storage;
    ReduceNarrow<Op, T>(static_cast<S*>(dst), static_cast<const S*>(a), static_cast<const S*>(b), n,
                        div);
  });
}

bool ReduceAny(scapeDataType_t dtype, scapeRedOp_t op, void* dst, const void* a, const void* b,
               size_t n, int finalDivisor) {
  if (dtype == scapeInt32)
    return ReduceIntAny(op, static_cast<int32_t*>(dst), static_cast<const int32_t*>(a),
                        static_cast<const int32_t*>(b), n, finalDivisor);
  if (dtype == scapeInt64)
    return ReduceIntAny(op, static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                        static_cast<const int64_t*>(b), n, finalDivisor);
  switch (op) {
    case scapeSum:
    case scapeAvg:
      return ReduceTyped<OpSum>(dtype, dst, a, b, n, finalDivisor);
    case scapeMax:
      return ReduceTyped<OpMax>(dtype, dst, a, b, n, finalDivisor);
    case scapeMin:
      return ReduceTyped<OpMin>(dtype, dst, a, b, n, finalDivisor);
    default:
      return false;
  }
}

bool DivideAny(scapeDataType_t dtype, void* buf, size_t n, int divisor) {
  if (divisor <= 1) return dtype >= 0 && dtype < scapeNumTypes;
  if (dtype == scapeFloat32) {
    float* p = static_cast<float*>(buf);
    const float d = static_cast<float>(divisor);
    for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
    return true;
  }
  if (dtypes::VisitFloat(dtype, [&](auto tr) {
        using T = decltype(tr);
        auto* p = static_cast<typename T::Storage*>(buf);
        for (size_t i = 0; i < n; ++i) p[i] = T::Store(T::Load(p[i]) / divisor);
      }))
    return true;
  switch (dtype) {
    case scapeInt32: {
      int32_t* p = static_cast<int32_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return true;
    }
    case scapeInt64: {
      int64_t* p = static_cast<int64_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return true;
    }
    default:
      return false;
  }
}

}  // namespace

KernelStatus ReduceInto(scapeDataType_t dtype, scapeRedOp_t op, void* dst, const void* a,
                        const void* b, size_t n, int finalDivisor) {
  if (n > 0 && (!dst || !a || !b)) return KernelStatus::kInvalidArgument;
  return ReduceAny(dtype, op, dst, a, b, n, finalDivisor) ? KernelStatus::kOk
                                                          : KernelStatus::kInvalidArgument;
}

KernelStatus DivideInPlace(scapeDataType_t dtype, void* buf, size_t n, int divisor) {
  if (n > 0 && !buf) return KernelStatus::kInvalidArgument;
  return DivideAny(dtype, buf, n, divisor) ? KernelStatus::kOk : KernelStatus::kInvalidArgument;
}

void ConvertFloatToBf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}
void ConvertBf16ToFloat(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(src[i]);
}
void ConvertFloatToFp16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FloatToFp16(src[i]);
}
void ConvertFp16ToFloat(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp16ToFloat(src[i]);
}

}  // namespace kernels
}  // namespace scape
