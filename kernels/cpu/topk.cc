// CPU implementation of kernels/cpu/topk.h.
#include "kernels/cpu/topk.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/topk_common.h"

namespace scape {
namespace kernels {

// Per-thread scratch.
struct TopkScratch {
  // Grow-only buffers; nk / nc say how many entries are in use.
  std::vector<uint64_t> kept_pos;  // positions with key >= the bracket's lower bound, in order
  std::vector<uint32_t> kept_key;
  std::vector<uint32_t> cand_key;  // the keys of those inside the bracket
  std::vector<uint32_t> sample;
  std::vector<uint64_t> hist;       // topk::kMaxBins counters
  uint64_t nk = 0, nd = 0, nc = 0;  // kept, above the bracket, inside the bracket
  uint64_t gt = 0, eq = 0;          // this thread's chunk: keys above / equal to the threshold
};

template <typename T>
void GrowTo(std::vector<T>* v, size_t n) {
  if (v->size() < n) v->resize(n);
}

struct TopkWorkspace::Impl {
  std::vector<TopkScratch> threads;
  void Ensure(int nt) {
    if (threads.size() < static_cast<size_t>(nt)) threads.resize(static_cast<size_t>(nt));
    for (auto& t : threads) t.hist.resize(topk::kMaxBins);
  }
};

TopkWorkspace::TopkWorkspace() : impl_(new (std::nothrow) Impl) {}
TopkWorkspace::~TopkWorkspace() = default;

namespace {

using topk::kAboveAllKeys;

// Segments at least this long use the sampled bracket in exact mode.
constexpr uint64_t kBracketMin = uint64_t{1} << 16;
// Samples for the exact-mode bracket: whole runs of 16 consecutive keys (one cache line each),
// at most kBracketSamples, at most one run per 64 runs of the segment.
constexpr uint64_t kBracketSamples = 32768;
constexpr uint64_t kSampleRun = 16;
// Elements per prefilter block (one 64-byte line of floats).
constexpr size_t kBlock = 16;
// Streaming loops prefetch this many elements ahead (4 KiB): measured here, it raises one
// core's read bandwidth by ~25% over the hardware prefetcher alone. A prefetch past the end of
// the array is harmless (it never faults).
constexpr size_t kPrefetchAhead = 1024;

inline uint32_t KeyAt(const float* x, size_t i) {
  uint32_t b;
  std::memcpy(&b, x + i, 4);
  return topk::KeyFromBits(b);
}

// Bit q (q < 16) is set if key(x[q]) >= lo, for lo in [0, 2^31) (SSE2: 4 compares and a
// movemask per 16 keys).
inline uint32_t KeysAtLeastMask(const float* x, uint32_t lo) {
#if defined(__SSE2__)
  const __m128i absm = _mm_set1_epi32(0x7fffffff);
  const __m128i thr = _mm_set1_epi32(static_cast<int32_t>(lo - 1u));  // keys are < 2^31
  const __m128i* p = reinterpret_cast<const __m128i*>(x);
  const __m128i c0 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 0), absm), thr);
  const __m128i c1 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 1), absm), thr);
  const __m128i c2 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 2), absm), thr);
  const __m128i c3 = _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(p + 3), absm), thr);
  const __m128i b = _mm_packs_epi16(_mm_packs_epi32(c0, c1), _mm_packs_epi32(c2, c3));
  return static_cast<uint32_t>(_mm_movemask_epi8(b));
#else
  uint32_t m = 0;
  for (size_t q = 0; q < kBlock; ++q) m |= static_cast<uint32_t>(KeyAt(x, q) >= lo) << q;
  return m;
#endif
}

inline int Ctz32(uint32_t m) { return __builtin_ctz(m); }

struct Threshold {
  uint32_t key;   // T: the k-th largest key
  uint64_t gt;    // keys > T
  uint64_t take;  // keys == T to take, in index order (gt + take == k)
};

// Finds the digit bin holding the rem-th largest among `hist`, scanning from the top.
inline int FindBin(const uint64_t* hist, int bins, uint64_t rem, uint64_t* above) {
  uint64_t cum = 0;
  for (int b = bins - 1; b >= 0; --b) {
    if (cum + hist[b] >= rem) {
      *above = cum;
      return b;
    }
    cum += hist[b];
  }
  *above = cum;  // unreachable when 1 <= rem <= count
  return 0;
}

// Exact radix select over the keys a "for_each(t, fn)" functor hands out (fn(key) for every
// key of part t), nt parts processed by nt threads (1 = the calling thread only): T = the k-th
// largest key (1 <= k <= total). Leaves each part's count of keys > T and == T in
// sc[t].gt / sc[t].eq.
template <typename ForEach>
Threshold RadixSelect(uint64_t k, int nt, TopkScratch* sc, ForEach for_each, bool* ok) {
  uint32_t prefix = 0, pmask = 0;
  uint64_t rem = k, gt = 0;
  for (int t = 0; t < nt; ++t) sc[t].gt = sc[t].eq = 0;
  for (int d = 0; d < topk::kNumDigits; ++d) {
    const int shift = topk::DigitShift(d), bins = 1 << topk::DigitBits(d);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    auto part = [&](int t) {
      uint64_t* h = sc[t].hist.data();
      std::fill(h, h + bins, uint64_t{0});
      if (pmask == 0) {
        for_each(t, [&](uint32_t key) { ++h[(key >> shift) & dmask]; });
      } else {
        for_each(t, [&](uint32_t key) {
          if ((key & pmask) == prefix) ++h[(key >> shift) & dmask];
        });
      }
    };
    if (nt == 1) {
      part(0);
    } else {
      *ok = *ok && detail::ParallelRun(nt, part);
    }
    uint64_t total[topk::kMaxBins];
    for (int b = 0; b < bins; ++b) {
      uint64_t s = 0;
      for (int t = 0; t < nt; ++t) s += sc[t].hist[static_cast<size_t>(b)];
      total[b] = s;
    }
    uint64_t above = 0;
    const int sel = FindBin(total, bins, rem, &above);
    for (int t = 0; t < nt; ++t) {
      uint64_t a = 0;
      for (int b = sel + 1; b < bins; ++b) a += sc[t].hist[static_cast<size_t>(b)];
      sc[t].gt += a;
      if (d == topk::kNumDigits - 1) sc[t].eq = sc[t].hist[static_cast<size_t>(sel)];
    }
    gt += above;
    rem -= above;
    prefix |= static_cast<uint32_t>(sel) << shift;
    pmask |= dmask << shift;
  }
  return {prefix, gt, rem};
}

// Radix select over xs[0, len) split into nt fixed chunks.
Threshold RadixSelectData(const float* xs, size_t len, uint64_t k, int nt, TopkScratch* sc,
                          bool* ok) {
  return RadixSelect(
      k, nt, sc,
      [&](int t, auto&& fn) {
        const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
        for (size_t i = b; i < e; ++i) fn(KeyAt(xs, i));
      },
      ok);
}

// Counts keys > T and == T per thread chunk into sc[t].gt / sc[t].eq.
void CountRange(const float* xs, size_t b, size_t e, uint32_t T, uint64_t* gt_out,
                uint64_t* eq_out) {
  uint64_t gt = 0, eq = 0;
  size_t i = b;
#if defined(__SSE2__)
  if (T < kAboveAllKeys) {
    const __m128i absm = _mm_set1_epi32(0x7fffffff);
    const __m128i thr = _mm_set1_epi32(static_cast<int32_t>(T));
    while (i + 4 <= e) {
      // Lane counters of at most 2^20 steps each, then flushed (no overflow).
      __m128i agt = _mm_setzero_si128(), aeq = _mm_setzero_si128();
      const size_t stop = std::min(e - (e - i) % 4, i + (size_t{1} << 22));
      for (; i < stop; i += 4) {
        if ((i & 15) == 0) __builtin_prefetch(xs + i + kPrefetchAhead);
        const __m128i k =
            _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xs + i)), absm);
        agt = _mm_sub_epi32(agt, _mm_cmpgt_epi32(k, thr));
        aeq = _mm_sub_epi32(aeq, _mm_cmpeq_epi32(k, thr));
      }
      uint32_t lg[4], le[4];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lg), agt);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(le), aeq);
      gt += uint64_t{lg[0]} + lg[1] + lg[2] + lg[3];
      eq += uint64_t{le[0]} + le[1] + le[2] + le[3];
    }
  }
#endif
  for (; i < e; ++i) {
    const uint32_t key = KeyAt(xs, i);
    gt += key > T;
    eq += key == T;
  }
  *gt_out = gt;
  *eq_out = eq;
}

bool CountPar(const float* xs, size_t len, uint32_t T, int nt, TopkScratch* sc) {
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    CountRange(xs, b, e, T, &sc[t].gt, &sc[t].eq);
  });
}

// Writes, in index order, the positions in [b, e) with key > T and the first `q` with
// key == T, to out[p, end). Returns the new p.
template <typename Index>
uint64_t WriteRange(const float* xs, uint64_t base, size_t b, size_t e, uint32_t T, uint64_t q,
                    uint64_t p, uint64_t end, Index* out) {
  if (T == kAboveAllKeys) return p;
  size_t i = b;
  auto one = [&](size_t j) {
    const uint32_t key = KeyAt(xs, j);
    if (key > T) {
      out[p++] = static_cast<Index>(base + j);
    } else if (key == T && q > 0) {
      --q;
      out[p++] = static_cast<Index>(base + j);
    }
  };
  for (; i + kBlock <= e && p < end; i += kBlock) {
    __builtin_prefetch(xs + i + kPrefetchAhead);
    uint32_t m = KeysAtLeastMask(xs + i, T);
    while (m != 0 && p < end) {
      one(i + static_cast<size_t>(Ctz32(m)));
      m &= m - 1;
    }
  }
  for (; i < e && p < end; ++i) one(i);
  return p;
}

// Writes, in index order, every position with key > T and the first `take` with key == T, to
// out[0, cap). Uses the per-chunk counts in sc[t].gt / sc[t].eq (nt chunks of len).
template <typename Index>
bool WritePar(const float* xs, uint64_t base, size_t len, uint32_t T, uint64_t take, uint64_t cap,
              int nt, TopkScratch* sc, Index* out) {
  std::vector<uint64_t> off(static_cast<size_t>(nt)), quota(static_cast<size_t>(nt));
  uint64_t pos = 0, eq_before = 0;
  for (int t = 0; t < nt; ++t) {
    off[t] = pos;
    quota[t] = eq_before >= take ? 0 : std::min(sc[t].eq, take - eq_before);
    eq_before += sc[t].eq;
    pos += sc[t].gt + quota[t];
  }
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    const uint64_t end = std::min(cap, off[t] + sc[t].gt + quota[t]);
    if (off[t] >= end) return;
    WriteRange(xs, base, b, e, T, quota[t], off[t], end, out);
  });
}

// One-thread version of WritePar (every tie candidate in one chunk). Returns the number written.
template <typename Index>
uint64_t WriteSeq(const float* xs, uint64_t base, size_t len, uint32_t T, uint64_t take,
                  uint64_t cap, Index* out) {
  return WriteRange(xs, base, 0, len, T, take, 0, cap, out);
}

// Exact selection via a sampled bracket and one pass (see topk.h). 1 <= k < len. Returns false
// if the bracket missed; then nothing was written and the caller falls back.
//   1. Sample runs of kSampleRun consecutive keys (one cache line each) at stratified
//      positions; from the sample, an upper bound t_hi (fewer than k keys above it, with high
//      probability) and a lower bound t_lo (at least k keys at or above it).
//   2. One pass, nt threads: every key >= t_lo is kept (position and key, in index order);
//      those > t_hi are selected for sure ("defs"), those in [t_lo, t_hi] are candidates
//      (their keys are also copied to a compact array). Blocks of 16 keys with none >= t_lo
//      cost 4 SSE2 compares; the rest is branch-free.
//   3. If fewer than k defs and at least k defs + candidates: an exact radix select among the
//      candidate keys (parallel, per-thread histograms) gives the threshold T and the tie quota.
//   4. Each thread filters its kept entries (key > T, or == T within its quota) into its part
//      of the output.
template <typename Index>
bool BracketSelect(const float* xs, uint64_t base, size_t len, uint64_t k, int nt, TopkScratch* sc,
                   Index* out, bool* ok) {
  TopkScratch& s0 = sc[0];
  const uint64_t runs = std::min<uint64_t>(len / (kSampleRun * 64), kBracketSamples / kSampleRun);
  const uint64_t s = runs * kSampleRun;
  GrowTo(&s0.sample, s);
  for (uint64_t g = 0; g < runs; ++g) {
    // Run g starts inside stratum [len*g/runs, len*(g+1)/runs), which is >= 64 runs long.
    const uint64_t lo = len * g / runs, hi = len * (g + 1) / runs;
    const uint64_t start = lo + topk::Mix64(g ^ (len << 20)) % (hi - lo - kSampleRun + 1);
    for (uint64_t q = 0; q < kSampleRun; ++q) s0.sample[g * kSampleRun + q] = KeyAt(xs, start + q);
  }
  const double p = static_cast<double>(k) / static_cast<double>(len);
  const double r = p * static_cast<double>(s);
  const double margin = 4.0 * std::sqrt(r * (1.0 - p)) + 8.0;
  const int64_t r_hi = static_cast<int64_t>(std::floor(r - margin));
  const int64_t r_lo = static_cast<int64_t>(std::ceil(r + margin));
  uint32_t t_hi = kAboveAllKeys, t_lo = 0;
  auto smp = s0.sample.begin();
  if (r_hi >= 1) {
    std::nth_element(smp, smp + (r_hi - 1), smp + static_cast<ptrdiff_t>(s),
                     std::greater<uint32_t>());
    t_hi = smp[r_hi - 1];
  }
  if (r_lo <= static_cast<int64_t>(s)) {
    auto first = r_hi >= 1 ? smp + r_hi : smp;
    std::nth_element(first, smp + (r_lo - 1), smp + static_cast<ptrdiff_t>(s),
                     std::greater<uint32_t>());
    t_lo = smp[r_lo - 1];
  }
  if (t_lo == 0) return false;  // the bracket would hold (nearly) everything
  const double expect_c = static_cast<double>(r_lo - std::max<int64_t>(r_hi, 0)) /
                          static_cast<double>(s) * static_cast<double>(len);
  const uint64_t cand_cap =
      static_cast<uint64_t>(2.0 * expect_c) / static_cast<uint64_t>(nt) + 4096;
  std::atomic<bool> miss{false};
  *ok = *ok && detail::ParallelRun(nt, [&](int t) {
    TopkScratch& th = sc[t];
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    const uint64_t def_cap = std::min<uint64_t>(k, e - b);
    const uint64_t kept_cap = def_cap + cand_cap;
    GrowTo(&th.kept_pos, kept_cap + kBlock);
    GrowTo(&th.kept_key, kept_cap + kBlock);
    GrowTo(&th.cand_key, cand_cap + kBlock);
    uint64_t* kpos = th.kept_pos.data();
    uint32_t* kkey = th.kept_key.data();
    uint32_t* ckey = th.cand_key.data();
    uint64_t nk = 0, nd = 0, nc = 0;
    // x[j] has key >= t_lo.
    auto keep = [&](size_t j) {
      const uint32_t key = KeyAt(xs, j);
      kpos[nk] = base + j;
      kkey[nk++] = key;
      const uint64_t above = key > t_hi;
      nd += above;
      ckey[nc] = key;
      nc += 1 - above;
    };
    size_t i = b;
    size_t next_check = b + 65536;
    bool missed = false;
    for (; i + kBlock <= e; i += kBlock) {
      __builtin_prefetch(xs + i + kPrefetchAhead);
      uint32_t m = KeysAtLeastMask(xs + i, t_lo);
      if (m != 0) {
        do {
          keep(i + static_cast<size_t>(Ctz32(m)));
          m &= m - 1;
        } while (m != 0);
        // At most kBlock entries were added since the last check: the buffers have room.
        if (nd >= k || nc > cand_cap) {
          missed = true;
          break;
        }
      }
      if (i >= next_check) {
        if (miss.load(std::memory_order_relaxed)) {
          missed = true;  // another thread missed: stop (the tail below must not run)
          break;
        }
        next_check = i + 65536;
      }
    }
    if (!missed) {
      for (; i < e; ++i) {
        if (KeyAt(xs, i) >= t_lo) keep(i);
      }
      missed = nd >= k || nc > cand_cap;
    }
    if (missed) miss.store(true, std::memory_order_relaxed);
    th.nk = nk;
    th.nd = nd;
    th.nc = nc;
  });
  if (!*ok || miss.load()) return false;
  uint64_t D = 0, C = 0;
  for (int t = 0; t < nt; ++t) {
    D += sc[t].nd;
    C += sc[t].nc;
  }
  if (D >= k || D + C < k) return false;
  // Exact threshold among the candidates; sc[t].gt / eq = thread t's candidates above / at it.
  const Threshold th = RadixSelect(
      k - D, nt, sc,
      [&](int t, auto&& fn) {
        const uint32_t* ck = sc[t].cand_key.data();
        for (uint64_t i = 0, n = sc[t].nc; i < n; ++i) fn(ck[i]);
      },
      ok);
  if (!*ok) return false;
  std::vector<uint64_t> off(static_cast<size_t>(nt) + 1), quota(static_cast<size_t>(nt));
  uint64_t pos = 0, eq_before = 0;
  for (int t = 0; t < nt; ++t) {
    off[t] = pos;
    quota[t] = eq_before >= th.take ? 0 : std::min(sc[t].eq, th.take - eq_before);
    eq_before += sc[t].eq;
    pos += sc[t].nd + sc[t].gt + quota[t];
  }
  off[nt] = pos;
  // Filter each thread's kept entries (in index order) into its output range, branch-free:
  // every store lands below the range's end because the loop stops when the range is full.
  *ok = *ok && detail::ParallelRun(nt, [&](int t) {
    const TopkScratch& c = sc[t];
    const uint64_t* kpos = c.kept_pos.data();
    const uint32_t* kkey = c.kept_key.data();
    const uint32_t T = th.key;
    const uint64_t q = quota[t], n = off[t + 1] - off[t];
    Index* o = out + off[t];
    uint64_t w = 0, eq_seen = 0;
    for (uint64_t i = 0; i < c.nk && w < n; ++i) {
      const uint32_t key = kkey[i];
      const uint64_t is_eq = key == T;
      o[w] = static_cast<Index>(kpos[i]);
      w += static_cast<uint64_t>(key > T) | (is_eq & static_cast<uint64_t>(eq_seen < q));
      eq_seen += is_eq;
    }
  });
  return *ok;
}

// Selects one segment with nt threads (scratch sc[0, nt)). Returns the number written.
template <typename Index>
uint64_t SelectSegment(const float* x, uint64_t seg_begin, uint64_t len, uint64_t k, uint64_t cap,
                       const TopkOptions& opt, int nt, TopkScratch* sc, Index* out, bool* ok) {
  if (k == 0 || len == 0) return 0;
  if (k >= len) {
    const uint64_t c = std::min(len, cap);
    for (uint64_t i = 0; i < c; ++i) out[i] = static_cast<Index>(seg_begin + i);
    return c;
  }
  const float* xs = x + seg_begin;
  if (opt.mode == TopkMode::kExact) {
    if (len >= kBracketMin && k <= len / 8 &&
        BracketSelect(xs, seg_begin, len, k, nt, sc, out, ok)) {
      return k;
    }
    if (!*ok) return 0;
    const Threshold th = RadixSelectData(xs, len, k, nt, sc, ok);
    if (nt > 1) {
      if (*ok) *ok = WritePar(xs, seg_begin, len, th.key, th.take, cap, nt, sc, out);
      return k;
    }
    return WriteSeq(xs, seg_begin, len, th.key, th.take, cap, out);
  }
  // Sampled mode.
  const uint64_t s = std::min<uint64_t>(len, opt.sample_size);
  auto& smp = sc[0].sample;
  smp.resize(s);
  for (uint64_t j = 0; j < s; ++j) smp[j] = KeyAt(xs, topk::SamplePosition(len, s, j));
  const uint64_t r = topk::SampleRank(k, len, s);
  std::nth_element(smp.begin(), smp.begin() + static_cast<ptrdiff_t>(r - 1), smp.end(),
                   std::greater<uint32_t>());
  const uint32_t T = smp[r - 1];
  if (nt > 1) {
    *ok = *ok && CountPar(xs, len, T, nt, sc);
    uint64_t gt = 0, eq = 0;
    for (int t = 0; t < nt; ++t) {
      gt += sc[t].gt;
      eq += sc[t].eq;
    }
    const uint64_t take = topk::TiesTaken(k, gt, eq);
    if (*ok) *ok = WritePar(xs, seg_begin, len, T, take, cap, nt, sc, out);
    return std::min(cap, gt + take);
  }
  uint64_t gt = 0, eq = 0;
  for (uint64_t i = 0; i < len; ++i) {
    const uint32_t key = KeyAt(xs, i);
    gt += key > T;
    eq += key == T;
  }
  return WriteSeq(xs, seg_begin, len, T, topk::TiesTaken(k, gt, eq), cap, out);
}

template <typename Index>
KernelStatus TopkImpl(const float* x, const TopkSegments& sg, const TopkOptions& opt, Index* out,
                      uint64_t* counts, TopkWorkspace* workspace) {
  if (opt.mode != TopkMode::kExact && opt.mode != TopkMode::kSampled) {
    return KernelStatus::kInvalidArgument;
  }
  const size_t nseg = sg.nseg;
  if (nseg == 0) return KernelStatus::kOk;
  if (sg.offsets == nullptr || sg.k == nullptr || sg.out_offsets == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  if (opt.mode == TopkMode::kSampled) {
    if (counts == nullptr || opt.sample_size < 1 || opt.sample_size > topk::kMaxSampleSize) {
      return KernelStatus::kInvalidArgument;
    }
    if (sg.offsets[nseg] >= topk::kMaxSampledPosition) return KernelStatus::kInvalidArgument;
  }
  if (sizeof(Index) == 4 && sg.offsets[nseg] > (uint64_t{1} << 32)) {
    return KernelStatus::kInvalidArgument;
  }
  bool buffer_small = false;
  for (size_t s = 0; s < nseg; ++s) {
    if (sg.offsets[s + 1] < sg.offsets[s] || sg.out_offsets[s + 1] < sg.out_offsets[s]) {
      return KernelStatus::kInvalidArgument;
    }
    if (sg.k[s] > sg.offsets[s + 1] - sg.offsets[s]) return KernelStatus::kInvalidArgument;
    if (sg.out_offsets[s + 1] - sg.out_offsets[s] < sg.k[s]) buffer_small = true;
  }
  if (x == nullptr && sg.offsets[nseg] > sg.offsets[0]) return KernelStatus::kInvalidArgument;
  if (out == nullptr && sg.out_offsets[nseg] > sg.out_offsets[0]) {
    return KernelStatus::kInvalidArgument;
  }
  if (buffer_small && opt.mode == TopkMode::kExact) return KernelStatus::kBufferTooSmall;

  try {
    TopkWorkspace local;
    TopkWorkspace* ws = workspace ? workspace : &local;
    if (ws->impl() == nullptr) return KernelStatus::kOutOfMemory;
    const int nt_max = detail::KernelThreads(opt.max_threads);
    ws->impl()->Ensure(nt_max);
    TopkScratch* sc = ws->impl()->threads.data();

    std::vector<size_t> small;
    uint64_t small_work = 0;
    for (size_t s = 0; s < nseg; ++s) {
      const uint64_t len = sg.offsets[s + 1] - sg.offsets[s];
      if (len < opt.split_min) {
        small.push_back(s);
        small_work += len;
      }
    }
    bool ok = true;
    auto run_one = [&](size_t s, int nt, TopkScratch* scr, bool* okp) {
      const uint64_t len = sg.offsets[s + 1] - sg.offsets[s];
      const uint64_t cap = sg.out_offsets[s + 1] - sg.out_offsets[s];
      const uint64_t c = SelectSegment(x, sg.offsets[s], len, sg.k[s], cap, opt, nt, scr,
                                       out + sg.out_offsets[s], okp);
      if (counts) counts[s] = c;
    };
    if (!small.empty()) {
      int nt =
          detail::ThreadsFor(static_cast<size_t>(small_work), size_t{1} << 18, opt.max_threads);
      nt = std::min<int>(nt, static_cast<int>(std::min<size_t>(small.size(), 1 << 20)));
      std::atomic<size_t> next{0};
      std::atomic<bool> all_ok{true};
      ok = detail::ParallelRun(nt, [&](int t) {
        bool tok = true;
        for (size_t i = next.fetch_add(1); i < small.size(); i = next.fetch_add(1)) {
          run_one(small[i], 1, &sc[t], &tok);
          if (!tok) break;
        }
        if (!tok) all_ok.store(false);
      });
      ok = ok && all_ok.load();
    }
    for (size_t s = 0; s < nseg && ok; ++s) {
      const uint64_t len = sg.offsets[s + 1] - sg.offsets[s];
      if (len < opt.split_min) continue;
      const int nt = detail::ThreadsFor(static_cast<size_t>(len), size_t{1} << 18, opt.max_threads);
      run_one(s, nt, sc, &ok);
    }
    return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
  } catch (...) {
    return KernelStatus::kOutOfMemory;
  }
}

}  // namespace

KernelStatus TopkKFromDensity(const uint64_t* offsets, size_t nseg, double density,
                              uint64_t* k_out) {
  if (!(density >= 0.0 && density <= 1.0)) return KernelStatus::kInvalidArgument;
  if (nseg == 0) return KernelStatus::kOk;
  if (offsets == nullptr || k_out == nullptr) return KernelStatus::kInvalidArgument;
  for (size_t s = 0; s < nseg; ++s) {
    if (offsets[s + 1] < offsets[s]) return KernelStatus::kInvalidArgument;
  }
  for (size_t s = 0; s < nseg; ++s) {
    const uint64_t len = offsets[s + 1] - offsets[s];
    if (len == 0) {
      k_out[s] = 0;
      continue;
    }
    const double f = std::floor(density * static_cast<double>(len));
    uint64_t k = f >= static_cast<double>(len) ? len : static_cast<uint64_t>(f);
    k_out[s] = std::max<uint64_t>(1, k);
  }
  return KernelStatus::kOk;
}

uint64_t TopkOutOffsets(const uint64_t* k, size_t nseg, uint64_t* out_offsets) {
  uint64_t total = 0;
  if (out_offsets) out_offsets[0] = 0;
  for (size_t s = 0; s < nseg; ++s) {
    total += k[s];
    if (out_offsets) out_offsets[s + 1] = total;
  }
  return total;
}

KernelStatus TopkAbs(const float* x, const TopkSegments& segments, const TopkOptions& options,
                     uint32_t* out, uint64_t* counts, TopkWorkspace* workspace) {
  return TopkImpl(x, segments, options, out, counts, workspace);
}
KernelStatus TopkAbs(const float* x, const TopkSegments& segments, const TopkOptions& options,
                     uint64_t* out, uint64_t* counts, TopkWorkspace* workspace) {
  return TopkImpl(x, segments, options, out, counts, workspace);
}

}  // namespace kernels
}  // namespace scape
