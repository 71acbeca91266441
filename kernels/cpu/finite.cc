#include "kernels/cpu/finite.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace scape {
namespace kernels {
namespace {

constexpr uint32_t kExp = 0x7f800000u;
constexpr size_t kBlock = 16384;  // elements per check of the running flag

// True when x[0, n) holds a non-finite value. (u & kExp) + 2^23 sets bit 31 exactly when the
// exponent bits are all ones, so the inner loop is and/add/or on integers (vectorised without
// compares); blocks keep it free of exits and still stop soon after a hit.
bool AnyNonFinite(const float* x, size_t n) {
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = b + kBlock < n ? b + kBlock : n;
    uint32_t acc = 0;
    for (size_t i = b; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      acc |= (u & kExp) + 0x00800000u;
    }
    if (acc & 0x80000000u) return true;
  }
  return false;
}

}  // namespace

KernelStatus FirstNonFinite16(const uint16_t* x, size_t n, uint16_t exp_mask, size_t* first) {
  if (!first || (n > 0 && !x)) return KernelStatus::kInvalidArgument;
  *first = n;
  for (size_t i = 0; i < n; ++i)
    if ((x[i] & exp_mask) == exp_mask) {
      *first = i;
      break;
    }
  return KernelStatus::kOk;
}

KernelStatus FirstNonFinite(const float* x, size_t n, size_t* first, int max_threads) {
  if (!first || (n > 0 && !x)) return KernelStatus::kInvalidArgument;
  *first = n;
  if (n == 0) return KernelStatus::kOk;
  const int nt = detail::ThreadsFor(n, size_t{512} << 10, max_threads);
  std::vector<uint8_t> hit(static_cast<size_t>(nt), 0);
  if (!detail::ParallelRun(nt, [&](int t) {
        const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
        hit[static_cast<size_t>(t)] = AnyNonFinite(x + b, e - b) ? 1 : 0;
      }))
    return KernelStatus::kOutOfMemory;  // f does not throw: only a failed allocation
  for (int t = 0; t < nt; ++t) {
    if (!hit[static_cast<size_t>(t)]) continue;
    // The lowest index: the first chunk with a hit, searched element by element.
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    for (size_t i = b; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      if ((u & kExp) == kExp) {
        *first = i;
        return KernelStatus::kOk;
      }
    }
  }
  return KernelStatus::kOk;
}

}  // namespace kernels
}  // namespace scape
