// Internal: the small fork-join helper the CPU kernels use (std::thread, no pool).
//
// ParallelRun(n, f) calls f(t) for t in [0, n): t == 0 on the calling thread, the others on
// fresh std::threads, and joins them all. No exception escapes: a failure to start a thread runs
// that share on the caller instead, and an exception thrown by f is caught and reported through
// the return value (false). Kernels size their work so that spawning cost (tens of
// microseconds) is negligible: small inputs run on one thread.
#ifndef SCAPE_KERNELS_CPU_PARALLEL_H_
#define SCAPE_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace scape {
namespace kernels {
namespace detail {

// Threads to use: max_threads <= 0 means "all", and never more than the hardware offers.
inline int KernelThreads(int max_threads) {
  unsigned hw = std::thread::hardware_concurrency();
  int n = hw == 0 ? 1 : static_cast<int>(hw);
  if (max_threads > 0 && max_threads < n) n = max_threads;
  return n;
}

// Threads worth using for `work` units when each thread should get at least `grain` of them.
inline int ThreadsFor(size_t work, size_t grain, int max_threads) {
  size_t want = grain == 0 ? 1 : work / grain;
  int n = KernelThreads(max_threads);
  if (want < static_cast<size_t>(n)) n = want == 0 ? 1 : static_cast<int>(want);
  return n;
}

// Start of chunk i of n split into `parts` chunks, rounded down to a multiple of `align`
// elements (chunk 0 starts at 0 and chunk `parts` ends at n).
inline size_t ChunkBegin(size_t n, int parts, int i, size_t align = 16) {
  if (i <= 0) return 0;
  if (i >= parts) return n;
  // n * i may overflow for huge n; split the product.
  size_t q = n / static_cast<size_t>(parts), r = n % static_cast<size_t>(parts);
  size_t b = q * static_cast<size_t>(i) + r * static_cast<size_t>(i) / static_cast<size_t>(parts);
  if (align > 1) b -= b % align;
  return b;
}

template <typename F>
[[nodiscard]] bool ParallelRun(int nthreads, F&& f) {
  std::atomic<bool> ok{true};
  auto guarded = [&](int t) {
    try {
      f(t);
    } catch (...) {
      ok.store(false, std::memory_order_relaxed);
    }
  };
  if (nthreads <= 1) {
    guarded(0);
    return ok.load();
  }
  std::vector<std::thread> threads;
  std::vector<int> inline_ids;
  try {
    threads.reserve(static_cast<size_t>(nthreads - 1));
  } catch (...) {
  }
  for (int t = 1; t < nthreads; ++t) {
    try {
      threads.emplace_back(guarded, t);
    } catch (...) {
      try {
        inline_ids.push_back(t);
      } catch (...) {
        ok.store(false);
      }
    }
  }
  guarded(0);
  for (int t : inline_ids) guarded(t);
  for (auto& th : threads) th.join();
  return ok.load();
}

}  // namespace detail
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_PARALLEL_H_
