// Deterministic random inputs and double-precision references for the collective tests.
#ifndef SCAPE_TESTS_TEST_UTIL_H_
#define SCAPE_TESTS_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "scape/scape.h"

namespace scape_test {

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Value of element i on rank r as a double that is exactly representable in `t`.
inline double InputValue(scapeDataType_t t, unsigned seed, int rank, size_t i) {
  uint64_t h =
      SplitMix((static_cast<uint64_t>(seed) << 32) ^ (static_cast<uint64_t>(rank) << 48) ^ i);
  if (t == scapeInt32 || t == scapeInt64)
    return static_cast<double>(static_cast<int64_t>(h % 2001) - 1000);
  float f =
      static_cast<float>(static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0) * 4.0 - 2.0);
  if (t == scapeFloat16) return scape::kernels::Fp16ToFloat(scape::kernels::FloatToFp16(f));
  if (t == scapeBfloat16) return scape::kernels::Bf16ToFloat(scape::kernels::FloatToBf16(f));
  return f;
}

inline void Store(scapeDataType_t t, void* buf, size_t i, double v) {
  switch (t) {
    case scapeFloat32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case scapeFloat16:
      static_cast<uint16_t*>(buf)[i] = scape::kernels::FloatToFp16(static_cast<float>(v));
      break;
    case scapeBfloat16:
      static_cast<uint16_t*>(buf)[i] = scape::kernels::FloatToBf16(static_cast<float>(v));
      break;
    case scapeInt32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
      break;
    case scapeInt64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    default:
      break;
  }
}

inline double Load(scapeDataType_t t, const void* buf, size_t i) {
  switch (t) {
    case scapeFloat32:
      return static_cast<const float*>(buf)[i];
    case scapeFloat16:
      return scape::kernels::Fp16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case scapeBfloat16:
      return scape::kernels::Bf16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case scapeInt32:
      return static_cast<const int32_t*>(buf)[i];
    case scapeInt64:
      return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    default:
      return 0;
  }
}

// Unit roundoff of the element type (0 for integers: exact).
inline double Eps(scapeDataType_t t) {
  switch (t) {
    case scapeFloat32:
      return std::ldexp(1.0, -24);
    case scapeFloat16:
      return std::ldexp(1.0, -11);
    case scapeBfloat16:
      return std::ldexp(1.0, -8);
    default:
      return 0;
  }
}

// Reference reduction over ranks of element i in double, and the error bound the library's
// result must meet: exact for max/min and integers; for sums, one rounding per hop.
struct Ref {
  double value;
  double tol;
};
inline Ref Reference(scapeDataType_t t, scapeRedOp_t op, unsigned seed, int nranks, size_t i) {
  double acc = InputValue(t, seed, 0, i), absSum = std::fabs(acc);
  for (int r = 1; r < nranks; ++r) {
    double v = InputValue(t, seed, r, i);
    absSum += std::fabs(v);
    if (op == scapeMax)
      acc = v > acc ? v : acc;
    else if (op == scapeMin)
      acc = v < acc ? v : acc;
    else
      acc += v;
  }
  if (op == scapeMax || op == scapeMin) return {acc, 0};
  if (t == scapeInt32 || t == scapeInt64) {
    if (op == scapeAvg) acc = std::trunc(acc / nranks);
    return {acc, 0};
  }
  // Every hop rounds once (and the average once more); the bound covers nranks roundings of
  // partial sums no larger than absSum, plus the final rounding of the result.
  double tol = (nranks + 1) * Eps(t) * absSum + 1e-30;
  if (op == scapeAvg) {
    acc /= nranks;
    tol /= nranks;
    tol += Eps(t) * std::fabs(acc);
  }
  return {acc, tol};
}

inline uint64_t HashBytes(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= c[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace scape_test

#endif  // SCAPE_TESTS_TEST_UTIL_H_
