// Contract: top-k per segment on |statistic| (design brief section 2, step 4), CPU.
// The CUDA implementation (kernels/cuda/scape_kernels.cuh, TopkAbsCuda) has the same contract
// and selects the same sets.
//
// Inputs
//   x: n floats (the statistic, e.g. the candidate c). Segments are given by ascending offsets:
//     segment s is x[offsets[s] .. offsets[s+1]), len_s = offsets[s+1] - offsets[s] (0 allowed;
//     offsets[0] need not be 0).
//   k[s] <= len_s: how many to select (TopkKFromDensity gives max(1, floor(density*len)),
//     0 for an empty segment; k = 0 and k = len are allowed; a dense segment uses k = len).
//   out_offsets (nseg + 1, ascending): segment s writes its result to
//     out[out_offsets[s] .. out_offsets[s+1]); that range's size is the segment's capacity.
//     TopkOutOffsets makes the packed layout (capacity = k).
// Output
//   out: for each segment, the selected positions (offsets into x, i.e. offsets[s] + local
//     index), strictly increasing. counts[s] (optional in exact mode, required in sampled
//     mode) = how many were written. Entries of out beyond counts[s] are not touched.
// Ordering and ties (exact mode)
//   The key is |x| (topk_common.h: bit pattern of |x|; +0 == -0; inf above finite; NaN above
//   inf). Exactly k[s] positions are selected: every position whose key is larger than the
//   k-th largest key T, plus the lowest-indexed positions with key == T until k is reached. The
//   result is unique, so it is the same for every thread count and on CUDA.
// Sampled mode (estimated threshold; cheaper worst case, for very large segments)
//   s' = min(len, sample_size) keys are read at fixed pseudo-random stratified positions
//   (topk::SamplePosition); T = the r-th largest of them, r = round(k*s'/len) clamped to [1, s'].
//   The result is every position with key > T plus the lowest-indexed positions with key == T
//   while the total is below k (topk::TiesTaken), truncated in index order to the capacity.
//   k' = counts[s] therefore drifts from k:
//   - if len <= sample_size the threshold is exact and k' == k;
//   - k' < k only when fewer than k keys are >= T (T overestimated), k' > k only when more than
//     k keys are > T (T underestimated); ties at T never inflate k';
//   - for keys without heavy ties, k'/k is about 1 +- sqrt((1-p)/(p*s')) (one standard
//     deviation; the binomial error of a sample quantile) with p = k/len: with the default
//     s' = 16384, about +-7.8% at p = 0.01 and +-2.3% at p = 0.1 (the tests check 5 sd); 4x the
//     samples halve it. Adversarial layouts (large values packed in a region much smaller than
//     len/s') can make it arbitrarily wrong;
//   - k = 0 gives 0 and k = len gives every position, as in exact mode.
//   The result is deterministic (it depends only on x and the arguments) and identical on CUDA.
// Cost (CPU, exact): segments of >= 64 Ki elements with k <= len/8: a sample of whole cache
//   lines (up to 32768 keys), ONE multi-threaded pass over x that keeps the positions above a
//   sampled upper bound and the candidates between two sampled bounds (4 SSE2 compares per 16
//   keys when nothing is kept), an exact radix select among the candidates (per-thread
//   histograms) and a per-thread merge into the output. If the sampled bracket misses
//   (adversarial data, heavy ties) or k > len/8: radix select over x (three histogram passes on
//   11 + 11 + 9 bits of the key) and a collection pass. Smaller segments use the radix select
//   directly, several segments in parallel. No sort anywhere.
//   Sampled mode: sampling, a counting pass and a collection pass.
// Threads: at most max_threads (0 = hardware_concurrency) std::threads per call.
// Memory: a TopkWorkspace keeps the per-thread candidate buffers between calls (pass one to
//   avoid re-allocating every step; it must not be used by two calls at once). Roughly
//   (k + candidates) * 8 bytes in the common case.
// Errors (nothing is written): kInvalidArgument (null pointer for a non-empty range, offsets or
//   out_offsets not ascending, k[s] > len_s, uint32_t output with a position >= 2^32, sampled
//   mode with sample_size not in [1, 2^20] or a position >= 2^43, unknown mode);
//   kBufferTooSmall (exact mode and a capacity < k[s]); kOutOfMemory (workspace allocation or
//   thread failure; out may then be partly written).
#ifndef SCAPE_KERNELS_CPU_TOPK_H_
#define SCAPE_KERNELS_CPU_TOPK_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cpu/kernel_status.h"

namespace scape {
namespace kernels {

enum class TopkMode : int { kExact = 0, kSampled = 1 };

struct TopkSegments {
  const uint64_t* offsets = nullptr;      // nseg + 1
  const uint64_t* k = nullptr;            // nseg
  const uint64_t* out_offsets = nullptr;  // nseg + 1
  size_t nseg = 0;
};

struct TopkOptions {
  TopkMode mode = TopkMode::kExact;
  uint32_t sample_size = 16384;  // sampled mode only
  int max_threads = 0;
  // Segments at least this long are split across the threads one at a time; shorter ones are
  // processed whole, one per thread, several at once (CPU only; the result does not depend on
  // it).
  uint64_t split_min = uint64_t{1} << 22;
};

// Reusable buffers for TopkAbs (opaque). Not thread-safe: one call at a time.
class TopkWorkspace {
 public:
  TopkWorkspace();
  ~TopkWorkspace();
  TopkWorkspace(const TopkWorkspace&) = delete;
  TopkWorkspace& operator=(const TopkWorkspace&) = delete;
  struct Impl;
  Impl* impl() { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// k[s] = len_s == 0 ? 0 : max(1, floor(density * len_s)), computed in double.
// kInvalidArgument: density not in [0, 1] (or NaN), null pointers, offsets not ascending.
KernelStatus TopkKFromDensity(const uint64_t* offsets, size_t nseg, double density,
                              uint64_t* k_out);

// out_offsets[0] = 0, out_offsets[s + 1] = out_offsets[s] + k[s]. Returns the total.
uint64_t TopkOutOffsets(const uint64_t* k, size_t nseg, uint64_t* out_offsets);

KernelStatus TopkAbs(const float* x, const TopkSegments& segments, const TopkOptions& options,
                     uint32_t* out, uint64_t* counts, TopkWorkspace* workspace = nullptr);
KernelStatus TopkAbs(const float* x, const TopkSegments& segments, const TopkOptions& options,
                     uint64_t* out, uint64_t* counts, TopkWorkspace* workspace = nullptr);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_TOPK_H_
