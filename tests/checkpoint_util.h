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

// A version-4 checkpoint (packed momentum on the current mask: the u64 at 152 is 0) written in
// the layout of version 3 (144-byte header, dense momentum, residual, masters, mask parts), as
// a version-3 library saved it: `mask` is the full current mask in mask order
// (scapeMaskGetIndices of the optimizer's mask at the save), whose entries the packed momentum
// follows. Empty if the checkpoint is not such a version-4 one.
inline std::vector<uint8_t> ToVersion3(const std::vector<uint8_t>& v4,
                                       const std::vector<uint64_t>& mask, uint64_t n) {
  uint32_t ver = 0, header = 0;
  uint64_t km = 0, own = 1;
  std::memcpy(&ver, v4.data() + 8, 4);
  std::memcpy(&header, v4.data() + 12, 4);
  std::memcpy(&km, v4.data() + 144, 8);
  std::memcpy(&own, v4.data() + 152, 8);
  if ((ver < 4 || ver > 6) || header != 160 || own != 0 || km != mask.size()) return {};
  uint16_t mt = 0;
  std::memcpy(&mt, v4.data() + 108, 2);
  const size_t masters = mt != 0 ? 4 * n : 0;
  const size_t mom = 160 + 4 * n + masters;
  const size_t tail = v4.size() - (mom + 4 * km);  // the mask parts
  std::vector<uint8_t> v3(144 + 8 * n + masters + tail, 0);
  std::memcpy(v3.data(), v4.data(), 144);
  const uint32_t ver3 = 3, header3 = 144;
  const uint64_t total = v3.size();
  std::memcpy(v3.data() + 8, &ver3, 4);
  std::memcpy(v3.data() + 12, &header3, 4);
  std::memcpy(v3.data() + 16, &total, 8);
  for (uint64_t j = 0; j < km; ++j)
    std::memcpy(v3.data() + 144 + 4 * mask[j], v4.data() + mom + 4 * j, 4);
  std::memcpy(v3.data() + 144 + 4 * n, v4.data() + 160, 4 * n + masters);  // residual, masters
  std::memcpy(v3.data() + 144 + 8 * n + masters, v4.data() + mom + 4 * km, tail);
  Reseal(&v3);
  return v3;
}

}  // namespace scape_test

#endif  // SCAPE_TESTS_CHECKPOINT_UTIL_H_
