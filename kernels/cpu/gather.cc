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

// The gather (dst[i] = src[idx[i]]) or the scatter (dst[idx[i]] = src[i]) of k elements of esz
// bytes: as unsigned integers for 1, 2, 4 or 8 bytes, else with memcpy per element.
void MoveIndexed(bool scatter, const void* src, const uint64_t* idx, size_t k, size_t esz,
                 void* dst) {
  const bool bits = VisitElementBits(esz, [&](auto t) {
    using T = decltype(t);
    const T* s = static_cast<const T*>(src);
    T* d = static_cast<T*>(dst);
    if (scatter) {
      Scatter(s, idx, k, d);
    } else {
      Gather(s, idx, k, d);
    }
  });
  if (bits) return;
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (size_t i = 0; i < k; ++i) {
    const size_t from = scatter ? i : idx[i], to = scatter ? idx[i] : i;
    std::memcpy(d + to * esz, s + from * esz, esz);
  }
}

}  // namespace

void GatherByIndex(const void* dense, const uint64_t* idx, size_t k, size_t esz, void* packed) {
  MoveIndexed(/*scatter=*/false, dense, idx, k, esz, packed);
}

void ScatterByIndex(const void* packed, const uint64_t* idx, size_t k, size_t esz, void* dense) {
  MoveIndexed(/*scatter=*/true, packed, idx, k, esz, dense);
}

}  // namespace kernels
}  // namespace scape
