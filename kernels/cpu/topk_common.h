// Internal: definitions the CPU and CUDA top-k share so that both select the same set. Every
// function here is integer-only and compiles as host and device code (under nvcc).
#ifndef SCAPE_KERNELS_CPU_TOPK_COMMON_H_
#define SCAPE_KERNELS_CPU_TOPK_COMMON_H_

#include <cstdint>

#if defined(__CUDACC__)
#define SCAPE_KERNELS_HD __host__ __device__ __forceinline__
#else
#define SCAPE_KERNELS_HD inline
#endif

namespace scape {
namespace kernels {
namespace topk {

// The order statistic is taken on key(x) = the bits of |x| as an unsigned integer (sign bit
// cleared). It orders like |x| for every non-NaN value (+0 == -0), puts +-inf above every finite
// value and NaN above +-inf (NaNs order among themselves by payload). Keys are < 2^31.
SCAPE_KERNELS_HD uint32_t KeyFromBits(uint32_t bits) { return bits & 0x7fffffffu; }
// Larger than every key: a threshold that selects nothing.
constexpr uint32_t kAboveAllKeys = 0x80000000u;

// Radix digits of the 31-bit key, most significant first: 11 + 11 + 9 bits.
constexpr int kNumDigits = 3;
constexpr int kMaxBins = 2048;
SCAPE_KERNELS_HD int DigitShift(int d) { return d == 0 ? 20 : (d == 1 ? 9 : 0); }
SCAPE_KERNELS_HD int DigitBits(int d) { return d == 2 ? 9 : 11; }

// Sampled mode limits: at most this many samples per segment, positions below 2^43.
constexpr uint32_t kMaxSampleSize = 1u << 20;
constexpr uint64_t kMaxSampledPosition = uint64_t{1} << 43;

SCAPE_KERNELS_HD uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// High 64 bits of the 128-bit product a*b.
SCAPE_KERNELS_HD uint64_t MulHi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// floor(len * j / s) for len = q*s + r (r < s <= 2^20) and j <= s, without a 64-bit integer
// division: q*j + floor(r*j / s), where r*j < 2^40 is exact in a double and the double quotient
// is within one of the floor (corrected here), so the result is exact.
SCAPE_KERNELS_HD uint64_t StratumStart(uint64_t q, uint64_t r, uint64_t s, uint64_t j) {
  const uint64_t a = r * j;
  uint64_t f = static_cast<uint64_t>(static_cast<double>(a) / static_cast<double>(s));
  if (f * s > a) {
    --f;
  } else if ((f + 1) * s <= a) {
    ++f;
  }
  return q * j + f;
}

// Sampled mode: the position (within a segment of `len` elements) of sample j of s, s <= len,
// len < 2^43, s <= 2^20. Stratified: sample j lies in [len*j/s, len*(j+1)/s), at a pseudo-random
// but fixed offset inside its stratum (the high half of Mix64(...) times the stratum's length).
// q = len / s and r = len % s (SamplePositionQR: computed once per segment by the caller).
SCAPE_KERNELS_HD uint64_t SamplePositionQR(uint64_t len, uint64_t q, uint64_t r, uint64_t s,
                                           uint64_t j) {
  const uint64_t lo = StratumStart(q, r, s, j), hi = StratumStart(q, r, s, j + 1);
  return lo + MulHi64(Mix64(j ^ (len << 20)), hi - lo);
}
SCAPE_KERNELS_HD uint64_t SamplePosition(uint64_t len, uint64_t s, uint64_t j) {
  return SamplePositionQR(len, len / s, len % s, s, j);
}

// Sampled mode: the threshold is the r-th largest sample key, r = round(k*s/len) in [1, s]
// (k >= 1, k <= len).
SCAPE_KERNELS_HD uint64_t SampleRank(uint64_t k, uint64_t len, uint64_t s) {
  uint64_t r = (k * s + len / 2) / len;
  if (r < 1) r = 1;
  if (r > s) r = s;
  return r;
}

// How many of the elements equal to the threshold are taken (in index order) when `gt`
// elements are above it, `eq` equal to it, and k are wanted: clamp(k - gt, 0, eq).
SCAPE_KERNELS_HD uint64_t TiesTaken(uint64_t k, uint64_t gt, uint64_t eq) {
  if (gt >= k) return 0;
  const uint64_t want = k - gt;
  return want < eq ? want : eq;
}

}  // namespace topk
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_TOPK_COMMON_H_
