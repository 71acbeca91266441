// CPU implementation of kernels/cpu/gather.h.
#include "kernels/cpu/gather.h"

#include <cstring>

namespace scape {
namespace kernels {
namespace {

// How many elements ahead the scatter prefetches its destination lines: far enough to cover a
// DRAM round trip at one element per few nanoseconds, near enough to stay in the line-fill
// buffers' reach.
constexpr size_t kScatterAhead = 32;

template <typename T>
void Gather(const T* d, const uint64_t* idx, size_t k, T* p) {
  for (size_t i = 0; i < k; ++i) p[i] = d[idx[i]];
}

template <typename T>
void Scatter(const T* p, const uint64_t* idx, size_t k, T* d) {
  const size_t head = k > kScatterAhead ? k - kScatterAhead : 0;
  size_t i = 0;
  for (; i < head; ++i) {
    __builtin_prefetch(d + idx[i + kScatterAhead], 1);
    d[idx[i]] = p[i];
  }
  for (; i < k; ++i) d[idx[i]] = p[i];
}

}  // namespace

void GatherByIndex(const void* dense, const uint64_t* idx, size_t k, size_t esz, void* packed) {
  switch (esz) {
    case 1:
      Gather(static_cast<const uint8_t*>(dense), idx, k, static_cast<uint8_t*>(packed));
      return;
    case 2:
      Gather(static_cast<const uint16_t*>(dense), idx, k, static_cast<uint16_t*>(packed));
      return;
    case 4:
      Gather(static_cast<const uint32_t*>(dense), idx, k, static_cast<uint32_t*>(packed));
      return;
    case 8:
      Gather(static_cast<const uint64_t*>(dense), idx, k, static_cast<uint64_t*>(packed));
      return;
    default: {
      const char* d = static_cast<const char*>(dense);
      char* p = static_cast<char*>(packed);
      for (size_t i = 0; i < k; ++i) std::memcpy(p + i * esz, d + idx[i] * esz, esz);
    }
  }
}

void ScatterByIndex(const void* packed, const uint64_t* idx, size_t k, size_t esz, void* dense) {
  switch (esz) {
    case 1:
      Scatter(static_cast<const uint8_t*>(packed), idx, k, static_cast<uint8_t*>(dense));
      return;
    case 2:
      Scatter(static_cast<const uint16_t*>(packed), idx, k, static_cast<uint16_t*>(dense));
      return;
    case 4:
      Scatter(static_cast<const uint32_t*>(packed), idx, k, static_cast<uint32_t*>(dense));
      return;
    case 8:
      Scatter(static_cast<const uint64_t*>(packed), idx, k, static_cast<uint64_t*>(dense));
      return;
    default: {
      const char* p = static_cast<const char*>(packed);
      char* d = static_cast<char*>(dense);
      for (size_t i = 0; i < k; ++i) std::memcpy(d + idx[i] * esz, p + i * esz, esz);
    }
  }
}

}  // namespace kernels
}  // namespace scape
