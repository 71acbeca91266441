// An independent reference for the OCP 8-bit floats (e4m3 "E4M3FN", e5m2), written from the
// format's definition with double arithmetic, not from kernels/dtypes.h: the value of every code,
// and round-to-nearest-even by searching all codes. Slow on purpose; tests only.
#ifndef SCAPE_TESTS_FP8_REF_H_
#define SCAPE_TESTS_FP8_REF_H_

#include <cmath>
#include <cstdint>
#include <limits>

namespace scape {
namespace testing {

struct Fp8Format {
  int expBits, manBits;
  bool ieee;  // e5m2: the top exponent holds inf / NaN; e4m3: only S.1111.111 is NaN
  int bias() const { return (1 << (expBits - 1)) - 1; }
};
constexpr Fp8Format kE4m3{4, 3, false};
constexpr Fp8Format kE5m2{5, 2, true};

// The value of code c (NaN / +-inf as doubles).
inline double Fp8Value(const Fp8Format& f, uint8_t c) {
  const bool neg = (c & 0x80) != 0;
  const int e = (c >> f.manBits) & ((1 << f.expBits) - 1);
  const int m = c & ((1 << f.manBits) - 1);
  const int top = (1 << f.expBits) - 1;
  double v;
  if (f.ieee && e == top) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!f.ieee && e == top && m == (1 << f.manBits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias() - f.manBits);
  } else {
    v = std::ldexp(1.0 + static_cast<double>(m) / (1 << f.manBits), e - f.bias());
  }
  return neg ? -v : v;
}

// The largest finite code's magnitude.
inline uint8_t Fp8MaxCode(const Fp8Format& f) {
  uint8_t best = 0;
  for (int c = 0; c < 128; ++c)
    if (std::isfinite(Fp8Value(f, static_cast<uint8_t>(c)))) best = static_cast<uint8_t>(c);
  return best;
}

// x rounded to nearest, ties to the even code; beyond the largest finite value by half an ulp
// or more (ties to even there too, the next code up counting as 2^(emax+1)): inf (e5m2) or
// NaN (e4m3). NaN in: the canonical NaN (e4m3 0x7f with x's sign, e5m2 0x7e). Returns the code.
inline uint8_t Fp8Round(const Fp8Format& f, double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return f.ieee ? 0x7e : static_cast<uint8_t>(0x7f | sign);
  const double a = std::fabs(x);
  const uint8_t maxc = Fp8MaxCode(f);
  const double maxv = Fp8Value(f, maxc);
  const double ulpTop = maxv - Fp8Value(f, static_cast<uint8_t>(maxc - 1));
  const uint8_t over = f.ieee ? static_cast<uint8_t>(((1 << f.expBits) - 1) << f.manBits)
                              : static_cast<uint8_t>(0x7f);
  // Far beyond (where double's precision could not tell the candidates apart): overflow.
  if (std::isinf(a) || a > maxv + ulpTop / 2) return static_cast<uint8_t>(over | sign);
  // Candidates: every finite magnitude code, and the one above the largest (overflow).
  int best = 0;
  double bestD = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= maxc + 1; ++c) {
    const double v = c <= maxc ? Fp8Value(f, static_cast<uint8_t>(c)) : maxv + ulpTop;
    const double d = std::fabs(a - v);
    if (d < bestD || (d == bestD && (c & 1) == 0)) {
      best = c;
      bestD = d;
    }
  }
  if (best > maxc) return static_cast<uint8_t>(over | sign);
  return static_cast<uint8_t>(best | sign);
}

}  // namespace testing
}  // namespace scape

#endif  // SCAPE_TESTS_FP8_REF_H_
