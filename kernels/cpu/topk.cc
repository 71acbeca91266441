// CPU implementation of kernels/cpu/topk.h.
#include "kernels/cpu/topk.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/topk_common.h"

namespace scape {
namespace kernels {

// Per-thread scratch.
struct TopkScratch {
  std::vector<uint64_t> def;       // positions with key above the bracket
  std::vector<uint64_t> cand_pos;  // positions inside the bracket
  std::vector<uint32_t> cand_key;
  std::vector<uint32_t> sample;
  std::vector<uint64_t> hist;      // topk::kMaxBins counters
  uint64_t gt = 0, eq = 0;         // this thread's chunk: keys above / equal to the threshold
};

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

// Segments at least this long are split across threads; shorter ones run one per thread.
constexpr uint64_t kBigSegment = uint64_t{1} << 20;
// Segments at least this long use the sampled bracket in exact mode.
constexpr uint64_t kBracketMin = uint64_t{1} << 16;
// Samples for the exact-mode bracket.
constexpr uint64_t kBracketSamples = 16384;
// Elements per prefilter block.
constexpr size_t kBlock = 16;

inline uint32_t KeyAt(const float* x, size_t i) {
  uint32_t b;
  std::memcpy(&b, x + i, 4);
  return topk::KeyFromBits(b);
}

// True if some key in x[i, i + kBlock) is >= lo (vectorisable).
inline bool BlockHasKeyAtLeast(const float* x, size_t i, int32_t lo) {
  int hit = 0;
  for (size_t q = 0; q < kBlock; ++q) {
    uint32_t b;
    std::memcpy(&b, x + i + q, 4);
    hit |= static_cast<int32_t>(b & 0x7fffffffu) >= lo;
  }
  return hit != 0;
}

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

// Exact radix select, one thread: the k-th largest of key_at(0..n-1), 1 <= k <= n.
template <typename KeyFn>
Threshold RadixSelectSeq(size_t n, uint64_t k, KeyFn key_at, uint64_t* hist) {
  uint32_t prefix = 0, pmask = 0;
  uint64_t rem = k, gt = 0;
  for (int d = 0; d < topk::kNumDigits; ++d) {
    const int shift = topk::DigitShift(d), bins = 1 << topk::DigitBits(d);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    std::fill(hist, hist + bins, uint64_t{0});
    if (pmask == 0) {
      for (size_t i = 0; i < n; ++i) ++hist[(key_at(i) >> shift) & dmask];
    } else {
      for (size_t i = 0; i < n; ++i) {
        const uint32_t key = key_at(i);
        if ((key & pmask) == prefix) ++hist[(key >> shift) & dmask];
      }
    }
    uint64_t above = 0;
    const int sel = FindBin(hist, bins, rem, &above);
    gt += above;
    rem -= above;
    prefix |= static_cast<uint32_t>(sel) << shift;
    pmask |= dmask << shift;
  }
  return {prefix, gt, rem};
}

// Exact radix select over xs[0, len), nt threads on fixed chunks. Leaves each thread's count of
// keys > T and == T in sc[t].gt / sc[t].eq.
Threshold RadixSelectPar(const float* xs, size_t len, uint64_t k, int nt, TopkScratch* sc,
                         bool* ok) {
  uint32_t prefix = 0, pmask = 0;
  uint64_t rem = k, gt = 0;
  for (int t = 0; t < nt; ++t) sc[t].gt = sc[t].eq = 0;
  for (int d = 0; d < topk::kNumDigits; ++d) {
    const int shift = topk::DigitShift(d), bins = 1 << topk::DigitBits(d);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    *ok = *ok && detail::ParallelRun(nt, [&](int t) {
      uint64_t* h = sc[t].hist.data();
      std::fill(h, h + bins, uint64_t{0});
      const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
      for (size_t i = b; i < e; ++i) {
        const uint32_t key = KeyAt(xs, i);
        if ((key & pmask) == prefix) ++h[(key >> shift) & dmask];
      }
    });
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

// Counts keys > T and == T per thread chunk into sc[t].gt / sc[t].eq.
bool CountPar(const float* xs, size_t len, uint32_t T, int nt, TopkScratch* sc) {
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    uint64_t gt = 0, eq = 0;
    for (size_t i = b; i < e; ++i) {
      const uint32_t key = KeyAt(xs, i);
      gt += key > T;
      eq += key == T;
    }
    sc[t].gt = gt;
    sc[t].eq = eq;
  });
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
  const int32_t lo = static_cast<int32_t>(T > 0x7fffffffu ? 0x7fffffffu : T);
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    uint64_t p = off[t];
    const uint64_t end = std::min(cap, off[t] + sc[t].gt + quota[t]);
    uint64_t q = quota[t];
    if (p >= end || T == kAboveAllKeys) return;
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
      if (!BlockHasKeyAtLeast(xs, i, lo)) continue;
      for (size_t j = i; j < i + kBlock && p < end; ++j) one(j);
    }
    for (; i < e && p < end; ++i) one(i);
  });
}

// One-thread version of CountPar + WritePar. Returns the number written.
template <typename Index>
uint64_t WriteSeq(const float* xs, uint64_t base, size_t len, uint32_t T, uint64_t take,
                  uint64_t cap, Index* out) {
  uint64_t p = 0, q = take;
  if (T == kAboveAllKeys) return 0;
  for (size_t i = 0; i < len && p < cap; ++i) {
    const uint32_t key = KeyAt(xs, i);
    if (key > T) {
      out[p++] = static_cast<Index>(base + i);
    } else if (key == T && q > 0) {
      --q;
      out[p++] = static_cast<Index>(base + i);
    }
  }
  return p;
}

// Exact selection via a sampled bracket and one pass (see topk.h). 1 <= k < len. Returns false
// if the bracket missed; then nothing useful was written and the caller falls back.
template <typename Index>
bool BracketSelect(const float* xs, uint64_t base, size_t len, uint64_t k, int nt,
                   TopkScratch* sc, Index* out, bool* ok) {
  TopkScratch& s0 = sc[0];
  const uint64_t s = std::min<uint64_t>(len / 16, kBracketSamples);
  s0.sample.resize(s);
  for (uint64_t j = 0; j < s; ++j) s0.sample[j] = KeyAt(xs, topk::SamplePosition(len, s, j));
  const double p = static_cast<double>(k) / static_cast<double>(len);
  const double r = p * static_cast<double>(s);
  const double margin = 4.0 * std::sqrt(r * (1.0 - p)) + 4.0;
  const int64_t r_hi = static_cast<int64_t>(std::floor(r - margin));
  const int64_t r_lo = static_cast<int64_t>(std::ceil(r + margin));
  uint32_t t_hi = kAboveAllKeys, t_lo = 0;
  auto& smp = s0.sample;
  if (r_hi >= 1) {
    std::nth_element(smp.begin(), smp.begin() + (r_hi - 1), smp.end(), std::greater<uint32_t>());
    t_hi = smp[static_cast<size_t>(r_hi - 1)];
  }
  if (r_lo <= static_cast<int64_t>(s)) {
    auto first = r_hi >= 1 ? smp.begin() + r_hi : smp.begin();
    std::nth_element(first, smp.begin() + (r_lo - 1), smp.end(), std::greater<uint32_t>());
    t_lo = smp[static_cast<size_t>(r_lo - 1)];
  }
  if (t_lo == 0) return false;  // the bracket would hold (nearly) everything
  const double expect_c =
      static_cast<double>(r_lo - std::max<int64_t>(r_hi, 0)) / static_cast<double>(s) *
      static_cast<double>(len);
  const uint64_t cand_cap = static_cast<uint64_t>(2.0 * expect_c) / static_cast<uint64_t>(nt) + 4096;
  const uint64_t def_reserve = k / static_cast<uint64_t>(nt) + 1024;
  std::atomic<bool> miss{false};
  const int32_t lo = static_cast<int32_t>(t_lo);
  *ok = *ok && detail::ParallelRun(nt, [&](int t) {
    TopkScratch& th = sc[t];
    th.def.clear();
    th.cand_pos.clear();
    th.cand_key.clear();
    th.def.reserve(std::min<uint64_t>(def_reserve, k));
    th.cand_pos.reserve(cand_cap);
    th.cand_key.reserve(cand_cap);
    const size_t b = detail::ChunkBegin(len, nt, t), e = detail::ChunkBegin(len, nt, t + 1);
    auto one = [&](size_t j) {
      const uint32_t key = KeyAt(xs, j);
      if (key > t_hi) {
        th.def.push_back(base + j);
      } else if (key >= t_lo) {
        th.cand_pos.push_back(base + j);
        th.cand_key.push_back(key);
      }
    };
    size_t i = b;
    size_t next_check = b + 65536;
    for (; i + kBlock <= e; i += kBlock) {
      if (BlockHasKeyAtLeast(xs, i, lo)) {
        for (size_t j = i; j < i + kBlock; ++j) one(j);
        if (th.def.size() >= k || th.cand_pos.size() > cand_cap) {
          miss.store(true, std::memory_order_relaxed);
          return;
        }
      }
      if (i >= next_check) {
        if (miss.load(std::memory_order_relaxed)) return;
        next_check = i + 65536;
      }
    }
    for (; i < e; ++i) one(i);
    if (th.def.size() >= k || th.cand_pos.size() > cand_cap) miss.store(true);
  });
  if (!*ok || miss.load()) return false;
  uint64_t D = 0, C = 0;
  for (int t = 0; t < nt; ++t) {
    D += sc[t].def.size();
    C += sc[t].cand_pos.size();
  }
  if (D >= k || D + C < k) return false;
  const uint64_t need = k - D;
  for (int t = 1; t < nt; ++t) {
    s0.cand_pos.insert(s0.cand_pos.end(), sc[t].cand_pos.begin(), sc[t].cand_pos.end());
    s0.cand_key.insert(s0.cand_key.end(), sc[t].cand_key.begin(), sc[t].cand_key.end());
  }
  const uint32_t* ck = s0.cand_key.data();
  const Threshold th =
      RadixSelectSeq(C, need, [ck](size_t i) { return ck[i]; }, s0.hist.data());
  uint64_t w = 0, q = th.take;
  for (uint64_t i = 0; i < C; ++i) {
    const uint32_t key = ck[i];
    if (key > th.key || (key == th.key && q > 0)) {
      if (key == th.key) --q;
      s0.cand_pos[w++] = s0.cand_pos[i];
    }
  }
  // Defs (sorted across chunks) into out[0, D), then merge the selected candidates in from the
  // back.
  uint64_t pos = 0;
  for (int t = 0; t < nt; ++t) {
    for (uint64_t d : sc[t].def) out[pos++] = static_cast<Index>(d);
  }
  uint64_t i = D, j = need, o = k;
  while (j > 0) {
    if (i > 0 && static_cast<uint64_t>(out[i - 1]) > s0.cand_pos[j - 1]) {
      out[--o] = out[--i];
    } else {
      out[--o] = static_cast<Index>(s0.cand_pos[--j]);
    }
  }
  return true;
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
    if (len >= kBracketMin && BracketSelect(xs, seg_begin, len, k, nt, sc, out, ok)) return k;
    if (!*ok) return 0;
    if (nt > 1) {
      const Threshold th = RadixSelectPar(xs, len, k, nt, sc, ok);
      if (*ok) *ok = WritePar(xs, seg_begin, len, th.key, th.take, cap, nt, sc, out);
      return k;
    }
    const Threshold th =
        RadixSelectSeq(len, k, [xs](size_t i) { return KeyAt(xs, i); }, sc[0].hist.data());
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
      if (len < kBigSegment) {
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
      int nt = detail::ThreadsFor(static_cast<size_t>(small_work), size_t{1} << 18,
                                  opt.max_threads);
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
      if (len < kBigSegment) continue;
      const int nt = detail::ThreadsFor(static_cast<size_t>(len), size_t{1} << 19,
                                        opt.max_threads);
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
