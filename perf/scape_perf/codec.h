// scape-perf: element encoding, the seeded test values every mode checks against, and buffers.
// Test values are small non-negative integers, exact in every element type.
#ifndef SCAPE_PERF_SCAPE_PERF_CODEC_H_
#define SCAPE_PERF_SCAPE_PERF_CODEC_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "perf/common/perf_common.h"
#include "scape/scape.h"

namespace scape_perf {

inline uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into inf: correct
  return static_cast<uint16_t>(sign | h);
}

inline double halfToDouble(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0)
    v = std::ldexp(static_cast<double>(mant), -24);
  else if (exp == 31)
    v = mant ? NAN : INFINITY;
  else
    v = std::ldexp(static_cast<double>(1024 + mant), exp - 25);
  return (h & 0x8000) ? -v : v;
}

inline uint16_t floatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline double bf16ToDouble(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

struct CodecF32 {
  using T = float;
  static T enc(int64_t v) { return static_cast<float>(v); }
  static bool eq(T x, int64_t v) { return static_cast<double>(x) == static_cast<double>(v); }
};
struct CodecF16 {
  using T = uint16_t;
  static T enc(int64_t v) { return floatToHalf(static_cast<float>(v)); }
  static bool eq(T x, int64_t v) { return halfToDouble(x) == static_cast<double>(v); }
};
struct CodecBF16 {
  using T = uint16_t;
  static T enc(int64_t v) { return floatToBf16(static_cast<float>(v)); }
  static bool eq(T x, int64_t v) { return bf16ToDouble(x) == static_cast<double>(v); }
};
// OCP 8-bit floats (E exponent bits, M mantissa bits; the test values are small non-negative
// integers, exact in both): written here from the format, independently of the library.
template <int E, int M>
struct CodecF8 {
  using T = uint8_t;
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static T enc(int64_t v) {
    if (v <= 0) return 0;
    int e = 0;
    while ((int64_t{2} << e) <= v) ++e;  // 2^e <= v < 2^(e+1)
    const int64_t man = ((v << M) >> e) - (int64_t{1} << M);
    return static_cast<T>(((e + kBias) << M) | man);
  }
  static double dec(T x) {
    const int exp = (x >> M) & ((1 << E) - 1), man = x & ((1 << M) - 1);
    const double v = exp == 0 ? std::ldexp(static_cast<double>(man), 1 - kBias - M)
                              : std::ldexp(static_cast<double>((1 << M) + man), exp - kBias - M);
    return (x & 0x80) ? -v : v;
  }
  static bool eq(T x, int64_t v) { return dec(x) == static_cast<double>(v); }
};
using CodecE4M3 = CodecF8<4, 3>;
using CodecE5M2 = CodecF8<5, 2>;
struct CodecI32 {
  using T = int32_t;
  static T enc(int64_t v) { return static_cast<int32_t>(v); }
  static bool eq(T x, int64_t v) { return static_cast<int64_t>(x) == v; }
};
struct CodecI64 {
  using T = int64_t;
  static T enc(int64_t v) { return v; }
  static bool eq(T x, int64_t v) { return x == v; }
};

// Calls f(Codec{}) with the codec of `t` (f is a generic lambda).
template <class F>
void withCodec(scapeDataType_t t, F&& f) {
  switch (t) {
    case scapeFloat32:
      f(CodecF32{});
      break;
    case scapeFloat16:
      f(CodecF16{});
      break;
    case scapeBfloat16:
      f(CodecBF16{});
      break;
    case scapeInt32:
      f(CodecI32{});
      break;
    case scapeInt64:
      f(CodecI64{});
      break;
    case scapeFloat8E4M3:
      f(CodecE4M3{});
      break;
    case scapeFloat8E5M2:
      f(CodecE5M2{});
      break;
    default:
      break;
  }
}
static_assert(scapeNumTypes == 7, "scape-perf: a codec for every scapeDataType_t (withCodec)");

// The largest integer up to which every integer is exact in `t` (so partial sums stay exact).
inline int64_t exactLimit(scapeDataType_t t) {
  switch (t) {
    case scapeFloat16:
      return 2048;
    case scapeBfloat16:
      return 256;
    case scapeFloat8E4M3:
      return 16;
    case scapeFloat8E5M2:
      return 8;
    default:
      return 1 << 24;
  }
}

// Deterministic input: rank r's element at (global) index j. Values are small integers chosen
// so that every partial sum the library may form is exact in the element type; for avg they
// are multiples of nranks, so the average is exact whether the library divides the total or
// pre-scales each contribution. The hash is the one the peers use (perf/common).
struct Pattern {
  int nranks = 1;
  scapeRedOp_t op = scapeSum;
  uint32_t modulus = 16;  // values are base * scale, base in [0, modulus)
  int64_t scale = 1;

  Pattern(int n, scapeDataType_t t, scapeRedOp_t o) : nranks(n), op(o) {
    const int64_t lim = exactLimit(t);
    int64_t maxBase = 15;
    if (op == scapeSum) maxBase = std::min<int64_t>(15, lim / n);
    if (op == scapeAvg) {
      maxBase = std::min<int64_t>(15, lim / (static_cast<int64_t>(n) * n));
      scale = n;
    }
    modulus = static_cast<uint32_t>(maxBase + 1);
  }
  static uint32_t hash(int r, uint64_t j) { return perf_pattern_hash(r, j); }
  int64_t value(int r, uint64_t j) const {
    return static_cast<int64_t>(hash(r, j) % modulus) * scale;
  }
  // Never 0 (COO lists: the library's list output omits exact zeros of a dense intermediate):
  // base in [1, modulus), so sums stay within the same exact range as value().
  int64_t nonzero(int r, uint64_t j) const {
    const uint32_t m = modulus > 1 ? modulus - 1 : 1;
    return (1 + static_cast<int64_t>(hash(r, j) % m)) * scale;
  }
  int64_t reduced(uint64_t j) const {
    int64_t acc = value(0, j);
    for (int r = 1; r < nranks; ++r) {
      const int64_t v = value(r, j);
      switch (op) {
        case scapeMax:
          acc = std::max(acc, v);
          break;
        case scapeMin:
          acc = std::min(acc, v);
          break;
        default:
          acc += v;
          break;
      }
    }
    if (op == scapeAvg) acc /= nranks;
    return acc;
  }
};

constexpr unsigned char kSentinelByte = 0xa5;  // negative in every type: never an expected value

inline bool isSentinel(const unsigned char* p, size_t ts) {
  for (size_t b = 0; b < ts; ++b)
    if (p[b] != kSentinelByte) return false;
  return true;
}

// Flips the lowest bit of one element: a small integer stored in any element type changes value.
inline void corruptElement(void* elem) { static_cast<unsigned char*>(elem)[0] ^= 0x01u; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<unsigned char, FreeDeleter>;

// Page-aligned; an empty request still gets a small buffer (a valid pointer for the API).
inline Buffer allocBuffer(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) bytes = 64;
  if (posix_memalign(&p, 4096, bytes) != 0) return Buffer();
  return Buffer(static_cast<unsigned char*>(p));
}

}  // namespace scape_perf

#endif  // SCAPE_PERF_SCAPE_PERF_CODEC_H_
