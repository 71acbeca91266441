// Contract: indexed gather and scatter of fixed-size elements (the pack and unpack of a masked
// collective over a dense buffer).
//
//   GatherByIndex:  packed[i] = dense[idx[i]]   for i < k
//   ScatterByIndex: dense[idx[i]] = packed[i]   for i < k
//
// esz is the element size in bytes: 1, 2, 4 or 8 (anything else is copied with memcpy per
// element). The caller guarantees that every idx[i] is inside dense and that packed holds k
// elements; nothing is checked here (the mask validated its indices when it decoded them).
// Elements are moved as raw bits (NaN payloads survive). idx need not be sorted, but sorted
// indices are the fast case: the scatter prefetches the lines it is about to write, which
// hides most of the read-for-ownership latency of a sparse write (about 1.6x at density 0.01
// in a throwaway comparison during development; BM_MaskScatter in
// perf/kernels/bench_kernels.cc times the shipped kernel only). A sparse gather
// is bounded by the memory system's outstanding-miss limit, which out-of-order execution
// already reaches (software prefetch measured no faster there).
#ifndef SCAPE_KERNELS_CPU_GATHER_H_
#define SCAPE_KERNELS_CPU_GATHER_H_

#include <cstddef>
#include <cstdint>

namespace scape {
namespace kernels {

void GatherByIndex(const void* dense, const uint64_t* idx, size_t k, size_t esz, void* packed);
void ScatterByIndex(const void* packed, const uint64_t* idx, size_t k, size_t esz, void* dense);

// Calls f(T{}) with T the first of T, Rest... whose size is esz and returns true; returns false,
// calling nothing, when none is.
template <typename T, typename... Rest, typename F>
bool VisitTypeOfSize(size_t esz, F& f) {
  if (esz == sizeof(T)) {
    f(T{});
    return true;
  }
  if constexpr (sizeof...(Rest) > 0) {
    return VisitTypeOfSize<Rest...>(esz, f);
  } else {
    return false;
  }
}

// The one dispatch on an element size that moves raw bits (the CPU and CUDA gather / scatter):
// f(T{}) with T the unsigned integer of esz bytes; false for an esz other than 1, 2, 4 or 8.
template <typename F>
bool VisitElementBits(size_t esz, F&& f) {
  return VisitTypeOfSize<uint8_t, uint16_t, uint32_t, uint64_t>(esz, f);
}

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_GATHER_H_
