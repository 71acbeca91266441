// Test helper: re-seal an edited optimizer checkpoint (scapeOptimSave's bytes) with the
// checksum of plugin/optim/optim.cc (docs/FORMATS.md section 6), to write the checkpoints of
// earlier format versions (or bad ones) as a library would have.
#ifndef SCAPE_TESTS_CHECKPOINT_UTIL_H_
#define SCAPE_TESTS_CHECKPOINT_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace scape_test {

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Checksum(const uint8_t* p, size_t n) {
  constexpr uint64_t K1 = 0x9e3779b97f4a7c15ull, K2 = 0xc2b2ae3d27d4eb4full;
  uint64_t h[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                   0x082efa98ec4e6c89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int q = 0; q < 4; ++q) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * q, 8);
      h[q] = Rotl(h[q] ^ (w * K1), 31) * K2;
    }
  for (; i < n; ++i) h[0] = (h[0] ^ p[i]) * 1099511628211ull;
  uint64_t x = static_cast<uint64_t>(n) * K1;
  for (int q = 0; q < 4; ++q) {
    x = (x ^ h[q]) * K2;
    x ^= x >> 29;
  }
  return x;
}
inline void Reseal(std::vector<uint8_t>* ck) {
  const uint64_t c = Checksum(ck->data() + 32, ck->size() - 32);
  std::memcpy(ck->data() + 24, &c, 8);
}

}  // namespace scape_test

#endif  // SCAPE_TESTS_CHECKPOINT_UTIL_H_
