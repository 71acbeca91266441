// CUDA top-k, the threshold half (phases 1-2 of kernels/cuda/topk_internal.cuh): setup, the
// radix select (exact: histograms over x or the candidates; sampled: over the sample), and the
// one collecting read of x into per-tile lists or candidates.
#include "kernels/cuda/topk_internal.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace topk_detail {
namespace {

// One full warp: the bin of `hist` (bins entries, a multiple of 32) holding the rem-th largest
// key counting from the top bin (1 <= rem <= sum). Returns the bin; *above = keys in higher
// bins. Valid in every lane.
__device__ int WarpFindBin(const uint32_t* hist, int bins, uint64_t rem, uint64_t* above) {
  const unsigned lane = threadIdx.x & 31u;
  const int per = bins / 32;
  const int lo = static_cast<int>(lane) * per;
  uint64_t own = 0;
  for (int b = lo; b < lo + per; ++b) own += hist[b];
  uint64_t incl = own;  // sum over lanes >= this lane
  for (int off = 1; off < 32; off <<= 1) {
    const uint64_t v = __shfl_down_sync(0xffffffffu, incl, off);
    if (lane + off < 32) incl += v;
  }
  const uint64_t ab = incl - own;
  const unsigned ballot = __ballot_sync(0xffffffffu, ab < rem && rem <= incl);
  const int leader = ballot == 0 ? 0 : __ffs(ballot) - 1;
  int sel = lo;
  uint64_t cum = ab;
  if (static_cast<int>(lane) == leader) {
    for (int b = lo + per - 1; b >= lo; --b) {
      if (cum + hist[b] >= rem) {
        sel = b;
        break;
      }
      cum += hist[b];
    }
  }
  sel = __shfl_sync(0xffffffffu, sel, leader);
  *above = __shfl_sync(0xffffffffu, cum, leader);
  return sel;
}

}  // namespace

__global__ void __launch_bounds__(kSetupThreads)
    SetupKernel(const uint64_t* offsets, const uint64_t* k, uint64_t nseg, uint64_t max_tiles,
                TopkTemp tt) {
  __shared__ uint64_t ws[32];
  __shared__ int bad_sh;
  if (threadIdx.x == 0) bad_sh = 0;
  __syncthreads();
  for (uint64_t s = threadIdx.x; s < nseg; s += blockDim.x) {
    if (offsets[s + 1] < offsets[s]) atomicOr(&bad_sh, 1);
  }
  __syncthreads();
  const bool bad = bad_sh != 0;
  uint64_t carry = 0;
  bool trivial = false, full = false;  // a segment with tiles and k == 0 or k == len; k == len
  for (uint64_t base = 0; base < nseg; base += blockDim.x) {
    const uint64_t s = base + threadIdx.x;
    uint64_t tiles = 0, len = 0;
    if (s < nseg && !bad) {
      len = offsets[s + 1] - offsets[s];
      tiles = (len + kTileElems - 1) / kTileElems;
    }
    uint64_t total;
    const uint64_t excl = dev::BlockExclusiveSum(tiles, ws, &total);
    if (s < nseg) {
      tt.tile_begin[s] = carry + excl;
      const uint64_t kk = k[s] < len ? k[s] : len;
      tt.keff[s] = kk;
      tt.prefix[s] = 0;
      tt.pmask[s] = 0;
      tt.rem[s] = kk;
      tt.take[s] = 0;
      tt.mode[s] = kModeRadix;
      if (kk == 0) {
        tt.thr[s] = kAboveAllKeys;
        tt.active[s] = 0;
        trivial = trivial || len > 0;
      } else if (kk == len) {
        tt.thr[s] = 0;
        tt.active[s] = 0;
        trivial = true;
        full = true;
      } else {
        tt.thr[s] = kAboveAllKeys;
        tt.active[s] = 1;
      }
    }
    carry += total;
  }
  trivial = __syncthreads_or(trivial);
  full = __syncthreads_or(full);
  if (threadIdx.x == 0) {
    const bool overflow = carry > max_tiles;
    tt.tile_begin[nseg] = (bad || overflow) ? 0 : carry;
    *tt.error = (bad || overflow) ? 1u : 0u;
    tt.misc[0] = 0;
    tt.misc[1] = 0;
    tt.misc[2] = 0;
    tt.misc[3] = 0;
    // Which passes over x have work (CandPlanKernel adds its fallback and candidate segments):
    // [4] the counting pass (trivial segments), [5] the write pass (k == len segments).
    tt.misc[4] = trivial ? 1 : 0;
    tt.misc[5] = full ? 1 : 0;
  }
}

// tile_seg[t] = the segment of tile t (one table read per tile instead of a binary search of
// tile_begin: ~log2(nseg) dependent global loads at the start of every tile of every pass).
__global__ void __launch_bounds__(kThreads) TileSegKernel(uint64_t nseg, TopkTemp tt) {
  if (*tt.error) return;
  for (uint64_t s = blockIdx.x; s < nseg; s += gridDim.x) {
    const uint64_t t0 = tt.tile_begin[s], t1 = tt.tile_begin[s + 1];
    for (uint64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      tt.tile_seg[t] = static_cast<uint32_t>(s);
    }
  }
}

// Histogram pass over x. Each block takes a contiguous run of tiles (not grid-stride), so a
// long segment's tiles share one shared-memory histogram that is merged into the segment's
// global histogram once per run (when the segment changes or the run ends) instead of once per
// tile. The shared histogram has kHistCopies copies, lane % kHistCopies picks one; copy c
// starts at word c * kHistStride, which shifts its banks by 8, so the same bin in the four
// copies lies in four different banks. A warp's atomics then conflict only among the 8 lanes of
// one copy instead of all 32 (smooth keys put a warp's digit 0 in a few dozen bins).
constexpr int kHistCopies = 4;
constexpr int kHistStride = topk::kMaxBins + 8;
__global__ void __launch_bounds__(kThreads)
    HistKernel(const float* x, const uint64_t* offsets, uint64_t nseg, TopkTemp tt, int digit) {
  __shared__ uint32_t sh[kHistStride * kHistCopies];
  if (*tt.error) return;
  // Digits 1 and 2 run over x only for kModeFallback segments (the others use the candidates).
  if (digit > 0 && tt.misc[0] == 0) return;
  const uint64_t ntiles = tt.tile_begin[nseg];
  const uint64_t per = (ntiles + gridDim.x - 1) / gridDim.x;
  const uint64_t tb = blockIdx.x * per;
  const uint64_t te = tb + per < ntiles ? tb + per : ntiles;
  if (tb >= te) return;
  const int shift = topk::DigitShift(digit), bins = 1 << topk::DigitBits(digit);
  const uint32_t dmask = static_cast<uint32_t>(bins - 1);
  uint32_t* const mine = sh + (threadIdx.x & (kHistCopies - 1)) * kHistStride;
  for (int i = threadIdx.x; i < kHistStride * kHistCopies; i += blockDim.x) sh[i] = 0;
  __syncthreads();
  for (uint64_t t = tb; t < te; ++t) {
    const uint64_t s = tt.tile_seg[t];
    if (!tt.active[s] || (digit > 0 && tt.mode[s] != kModeFallback)) continue;  // uniform
    const uint32_t prefix = tt.prefix[s], pmask = tt.pmask[s];
    uint64_t e0, e1;
    TileRange(offsets, tt.tile_begin, s, t, &e0, &e1);
    // kBatch independent loads in flight per thread before the shared-memory atomics.
    constexpr int kBatch = 8;
    for (uint64_t r0 = e0; r0 < e1; r0 += kBatch * kThreads) {
      uint32_t key[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const uint64_t i = r0 + j * kThreads + threadIdx.x;
        key[j] = i < e1 ? KeyAt(x, i) : kInvalidKey;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (key[j] != kInvalidKey && (key[j] & pmask) == prefix) {
          atomicAdd(&mine[(key[j] >> shift) & dmask], 1u);
        }
      }
    }
    // Merge (and clear) when the next tile of this run is in another segment or there is none.
    if (t + 1 == te || tt.tile_seg[t + 1] != s) {  // uniform over the block
      __syncthreads();
      uint32_t* gh = tt.hist + s * topk::kMaxBins;
      for (int b = threadIdx.x; b < bins; b += blockDim.x) {
        uint32_t c = 0;
#pragma unroll
        for (int q = 0; q < kHistCopies; ++q) {
          c += sh[q * kHistStride + b];
          sh[q * kHistStride + b] = 0;
        }
        if (c) atomicAdd(&gh[b], c);
      }
      __syncthreads();
    }
  }
}

// One block of kThreads per segment: the segment's histogram is copied to shared memory with
// coalesced loads (and cleared in global memory for the next digit: only one memset, before
// digit 0, is needed; the histograms of inactive segments are never written), then warp 0
// picks the bin there. (A lone warp reading the histogram from global memory, 64 strided bins
// per lane and then a serial walk of up to 64 bins, was a chain of L2 round trips per digit.)
__global__ void __launch_bounds__(kThreads) FindBinKernel(uint64_t nseg, TopkTemp tt, int digit) {
  __shared__ uint32_t sh[topk::kMaxBins];
  const uint64_t s = blockIdx.x;
  if (s >= nseg || *tt.error || !tt.active[s]) return;  // uniform over the block
  const int shift = topk::DigitShift(digit), bins = 1 << topk::DigitBits(digit);
  uint32_t* hist = tt.hist + s * topk::kMaxBins;
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    sh[b] = hist[b];
    hist[b] = 0;
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  uint64_t above = 0;
  const uint64_t rem = tt.rem[s];
  const int sel = WarpFindBin(sh, bins, rem, &above);
  if (threadIdx.x == 0) {
    const uint32_t prefix = tt.prefix[s] | (static_cast<uint32_t>(sel) << shift);
    tt.prefix[s] = prefix;
    tt.pmask[s] |= static_cast<uint32_t>(bins - 1) << shift;
    tt.rem[s] = rem - above;
    if (digit == 0) tt.ccount[s] = sh[sel];
    if (digit == topk::kNumDigits - 1) tt.thr[s] = prefix;
  }
}

__global__ void __launch_bounds__(kSampleThreads)
    SampleSelectKernel(const float* x, const uint64_t* offsets, uint64_t nseg, uint64_t sample_size,
                       TopkTemp tt) {
  __shared__ uint32_t sh[topk::kMaxBins];
  __shared__ uint32_t prefix_sh, pmask_sh;
  __shared__ uint64_t rem_sh;
  const uint64_t s = blockIdx.x;
  if (s >= nseg || *tt.error || !tt.active[s]) return;
  const uint64_t off = offsets[s];
  const uint64_t len = offsets[s + 1] - off;
  const uint64_t ns = len < sample_size ? len : sample_size;
  const uint64_t sq = len / ns, sr = len % ns;  // SamplePositionQR without a division per sample
  if (threadIdx.x == 0) {
    prefix_sh = 0;
    pmask_sh = 0;
    rem_sh = topk::SampleRank(tt.keff[s], len, ns);
  }
  // Up to kSampleRegs samples per thread (the default sample_size) are read once, with all
  // their positions (three 64-bit divisions each) computed and loads in flight together, and
  // kept in registers for the three digits; larger samples recompute and reread per digit.
  // Either way each digit's histogram counts the same keys, so the same threshold.
  const bool cached = ns <= static_cast<uint64_t>(kSampleRegs) * blockDim.x;  // uniform
  uint32_t ck[kSampleRegs];
#pragma unroll
  for (int r = 0; r < kSampleRegs; ++r) {
    const uint64_t j = threadIdx.x + static_cast<uint64_t>(r) * blockDim.x;
    ck[r] = kInvalidKey;
    if (cached && j < ns) {
      uint64_t pos = topk::SamplePositionQR(len, sq, sr, ns, j);
      if (pos >= len) pos = len - 1;  // only with positions beyond the documented 2^43
      ck[r] = KeyAt(x, off + pos);
    }
  }
  __syncthreads();
  for (int d = 0; d < topk::kNumDigits; ++d) {
    const int shift = topk::DigitShift(d), bins = 1 << topk::DigitBits(d);
    const uint32_t dmask = static_cast<uint32_t>(bins - 1);
    for (int b = threadIdx.x; b < bins; b += blockDim.x) sh[b] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_sh, pmask = pmask_sh;
    if (cached) {
#pragma unroll
      for (int r = 0; r < kSampleRegs; ++r) {
        // kInvalidKey (no sample) is not a key (keys are < 2^31).
        if (ck[r] != kInvalidKey && (ck[r] & pmask) == prefix) {
          atomicAdd(&sh[(ck[r] >> shift) & dmask], 1u);
        }
      }
    } else {
      for (uint64_t j = threadIdx.x; j < ns; j += blockDim.x) {
        uint64_t pos = topk::SamplePositionQR(len, sq, sr, ns, j);
        if (pos >= len) pos = len - 1;  // only with positions beyond the documented 2^43
        const uint32_t key = KeyAt(x, off + pos);
        if ((key & pmask) == prefix) atomicAdd(&sh[(key >> shift) & dmask], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      uint64_t above = 0;
      const uint64_t rem = rem_sh;
      const int sel = WarpFindBin(sh, bins, rem, &above);
      if (threadIdx.x == 0) {
        prefix_sh = prefix | (static_cast<uint32_t>(sel) << shift);
        pmask_sh = pmask | (dmask << shift);
        rem_sh = rem - above;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    tt.thr[s] = prefix_sh;
    tt.mode[s] = kModeList;
  }
}

// Exact mode, after digit 0: when the lists of all active segments (the keys above the
// threshold bin, keff - rem of them, plus the bin's ccount) fit the candidate buffer, every
// active segment is kModeList and segment s's list gets the slots [base, base + its size),
// bases ascending with s. Otherwise segment s's candidates (the keys in its threshold bin,
// ccount[s] of them) get [base, base + ccount[s]) (kModeCand); a segment whose candidates do
// not fit becomes kModeFallback (so do all after it).
__global__ void __launch_bounds__(kSetupThreads)
    CandPlanKernel(uint64_t nseg, uint64_t cand_cap, TopkTemp tt) {
  __shared__ uint64_t ws[32];
  if (*tt.error) return;
  uint64_t lists = 0;
  for (uint64_t base = 0; base < nseg; base += blockDim.x) {
    const uint64_t s = base + threadIdx.x;
    const bool act = s < nseg && tt.active[s];
    lists += dev::BlockSum(act ? tt.keff[s] - tt.rem[s] + tt.ccount[s] : 0, ws);
  }
  const bool list = lists <= cand_cap;  // uniform over the block
  uint64_t carry = 0, filled = 0;
  bool any_fallback = false;
  for (uint64_t base = 0; base < nseg; base += blockDim.x) {
    const uint64_t s = base + threadIdx.x;
    const bool act = s < nseg && tt.active[s];
    const uint64_t c = !act ? 0 : list ? tt.keff[s] - tt.rem[s] + tt.ccount[s] : tt.ccount[s];
    uint64_t total;
    const uint64_t excl = carry + dev::BlockExclusiveSum(c, ws, &total);
    // Once a region ends past cand_cap every later one does too, so the kModeCand regions are
    // exactly [0, filled).
    const bool cand = act && excl + c <= cand_cap;
    if (act) {
      if (cand) {
        tt.mode[s] = list ? kModeList : kModeCand;
        tt.cand_cur[s] = excl;
      } else {
        tt.mode[s] = kModeFallback;
        any_fallback = true;
      }
    }
    filled += dev::BlockSum(cand ? c : 0, ws);
    carry += total;
  }
  any_fallback = __syncthreads_or(any_fallback);
  if (threadIdx.x == 0) {
    tt.misc[0] = any_fallback ? 1 : 0;
    tt.misc[1] = filled;
    if (any_fallback) tt.misc[4] = 1;
    if (!list && lists > 0) tt.misc[5] = 1;  // kModeCand / kModeFallback segments
  }
}

// Exact mode, after digit 0 (b0 = the threshold bin of the segment). kModeCand tiles:
// tile_gt[t] = keys above the bin (digit 0 > b0), tile_eq[t] = 0, and the keys in the bin are
// appended to the segment's candidate region with their tile (one atomic per tile; the order
// of the tiles inside a region does not matter). kModeList tiles: tile_gt[t] = tile_eq[t] = 0
// (CandCountKernel counts the list), and every key with digit 0 >= b0 is appended with its
// tile and its offset in the tile, in index order; tile_lbase[t] / tile_lcnt[t] say where.
// (At most 64 registers: 4 blocks per SM, where 70 registers left 3.)
__global__ void __launch_bounds__(kThreads, 4)
    CollectKernel(const float* x, const uint64_t* offsets, uint64_t nseg, TopkTemp tt) {
  constexpr int kWarps = kThreads / 32;
  __shared__ uint32_t sh_gt[kWarps], sh_c[kWarps];
  __shared__ unsigned long long sh_base;
  if (*tt.error) return;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint32_t lt_mask = (1u << lane) - 1u;
  const int shift0 = topk::DigitShift(0);
  const uint64_t ntiles = tt.tile_begin[nseg];
  for (uint64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const uint64_t s = tt.tile_seg[t];
    const uint32_t mode = tt.mode[s];
    if (mode != kModeCand && mode != kModeList) continue;  // uniform over the block
    const bool list = mode == kModeList;
    const uint32_t b0 = tt.prefix[s] >> shift0;
    uint64_t e0, c0;
    uint32_t key[kRounds];
    uint32_t g = 0, c = 0;
    const bool mine = LoadTileShare(x, offsets, tt.tile_begin, s, t, warp, key, &e0, &c0);
    if (mine) {  // uniform over the warp
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const uint32_t hi = key[r] >> shift0;  // kInvalidKey gives 4095 > every bin
        const bool valid = key[r] != kInvalidKey;
        g += __popc(__ballot_sync(0xffffffffu, valid && hi > b0));
        c += __popc(__ballot_sync(0xffffffffu, valid && (list ? hi >= b0 : hi == b0)));
      }
    }
    if (lane == 0) {
      sh_gt[warp] = g;
      sh_c[warp] = c;
    }
    __syncthreads();
    uint64_t c_before = 0;
    for (unsigned w = 0; w < warp; ++w) c_before += sh_c[w];
    if (threadIdx.x == 0) {
      uint32_t tg = 0, tc = 0;
      for (int w = 0; w < kWarps; ++w) {
        tg += sh_gt[w];
        tc += sh_c[w];
      }
      tt.tile_gt[t] = list ? 0 : tg;
      tt.tile_eq[t] = 0;
      sh_base = tc ? atomicAdd(reinterpret_cast<unsigned long long*>(&tt.cand_cur[s]),
                               static_cast<unsigned long long>(tc))
                   : 0;
      if (list) {
        tt.tile_lbase[t] = sh_base;
        tt.tile_lcnt[t] = tc;
      }
    }
    __syncthreads();
    if (mine && c != 0) {
      uint64_t pos = sh_base + c_before;
      const uint32_t off0 = static_cast<uint32_t>(c0 - e0) + lane;
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const uint32_t hi = key[r] >> shift0;
        const bool is_c = key[r] != kInvalidKey && (list ? hi >= b0 : hi == b0);
        const uint32_t b = __ballot_sync(0xffffffffu, is_c);
        if (is_c) {
          const uint64_t p = pos + __popc(b & lt_mask);
          tt.cand_key[p] = key[r];
          tt.cand_tile[p] = static_cast<uint32_t>(t);
          if (list) tt.cand_local[p] = static_cast<uint16_t>(off0 + 32u * r);
        }
        pos += __popc(b);
      }
    }
    __syncthreads();  // sh_* and sh_base are rewritten by the next tile
  }
}

// Sampled mode, kModeList tiles (threshold T = thr[s] from the sample): the one read of x.
// tile_gt[t] / tile_eq[t] = the tile's keys > T and == T, and its keys >= T are appended to
// the list buffer (one atomic per tile on the shared cursor misc[2]) with their offsets in the
// tile, in index order; tile_lbase[t] / tile_lcnt[t] say where. A tile whose entries do not
// fit the buffer sets misc[3] (overflow) and writes none: the write pass then reads x for
// every list segment (the counts are complete either way).
__global__ void __launch_bounds__(kThreads)
    SampledCollectKernel(const float* x, const uint64_t* offsets, uint64_t nseg, uint64_t cap,
                         TopkTemp tt) {
  constexpr int kWarps = kThreads / 32;
  __shared__ uint32_t sh_gt[kWarps], sh_eq[kWarps];
  __shared__ unsigned long long sh_base;
  __shared__ int sh_fit;
  if (*tt.error) return;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint32_t lt_mask = (1u << lane) - 1u;
  const uint64_t ntiles = tt.tile_begin[nseg];
  for (uint64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const uint64_t s = tt.tile_seg[t];
    if (tt.mode[s] != kModeList) continue;  // uniform over the block
    const uint32_t T = tt.thr[s];
    uint64_t e0, c0;
    uint32_t key[kRounds];
    uint32_t g, e;
    const bool mine =
        LoadCountTileShare(x, offsets, tt.tile_begin, s, t, T, key, &e0, &c0, &g, &e, sh_gt, sh_eq);
    uint64_t before = 0;
    for (unsigned w = 0; w < warp; ++w) before += sh_gt[w] + sh_eq[w];
    if (threadIdx.x == 0) {
      uint32_t tg = 0, te = 0;
      for (int w = 0; w < kWarps; ++w) {
        tg += sh_gt[w];
        te += sh_eq[w];
      }
      tt.tile_gt[t] = tg;
      tt.tile_eq[t] = te;
      const unsigned long long tc = static_cast<unsigned long long>(tg) + te;
      const unsigned long long base = tc ? atomicAdd(&tt.misc[2], tc) : 0;
      sh_fit = base + tc <= cap;
      if (!sh_fit) atomicExch(&tt.misc[3], 1ull);
      sh_base = base;
      tt.tile_lbase[t] = base;
      tt.tile_lcnt[t] = sh_fit ? static_cast<uint32_t>(tc) : 0u;
    }
    __syncthreads();
    if (mine && sh_fit && g + e != 0) {
      uint64_t pos = sh_base + before;
      const uint32_t off0 = static_cast<uint32_t>(c0 - e0) + lane;
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const bool ge = key[r] >= T && key[r] != kInvalidKey;
        const uint32_t b = __ballot_sync(0xffffffffu, ge);
        if (ge) {
          const uint64_t p = pos + __popc(b & lt_mask);
          tt.cand_key[p] = key[r];
          tt.cand_local[p] = static_cast<uint16_t>(off0 + 32u * r);
        }
        pos += __popc(b);
      }
    }
    __syncthreads();  // sh_* are rewritten by the next tile
  }
}

__global__ void __launch_bounds__(kThreads) CandHistKernel(TopkTemp tt, int digit) {
  __shared__ uint32_t sh[topk::kMaxBins];
  if (*tt.error) return;
  const uint64_t total = tt.misc[1];
  const int shift = topk::DigitShift(digit), bins = 1 << topk::DigitBits(digit);
  const uint32_t dmask = static_cast<uint32_t>(bins - 1);
  for (uint64_t c0 = blockIdx.x * kCandChunk; c0 < total; c0 += gridDim.x * kCandChunk) {
    const uint64_t c1 = c0 + kCandChunk < total ? c0 + kCandChunk : total;
    const uint32_t s_first = tt.tile_seg[tt.cand_tile[c0]];
    const uint32_t s_last = tt.tile_seg[tt.cand_tile[c1 - 1]];
    if (s_first == s_last) {  // uniform over the block
      const uint32_t prefix = tt.prefix[s_first], pmask = tt.pmask[s_first];
      for (int b = threadIdx.x; b < bins; b += blockDim.x) sh[b] = 0;
      __syncthreads();
      for (uint64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        const uint32_t key = tt.cand_key[i];
        if ((key & pmask) == prefix) atomicAdd(&sh[(key >> shift) & dmask], 1u);
      }
      __syncthreads();
      uint32_t* gh = tt.hist + static_cast<uint64_t>(s_first) * topk::kMaxBins;
      for (int b = threadIdx.x; b < bins; b += blockDim.x) {
        const uint32_t c = sh[b];
        if (c) atomicAdd(&gh[b], c);
      }
      __syncthreads();
    } else {
      for (uint64_t i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
        const uint64_t s = tt.tile_seg[tt.cand_tile[i]];
        const uint32_t key = tt.cand_key[i];
        if ((key & tt.pmask[s]) == tt.prefix[s]) {
          atomicAdd(&tt.hist[s * topk::kMaxBins + ((key >> shift) & dmask)], 1u);
        }
      }
    }
  }
}

// Exact mode, kModeCand segments, after digit 2 (threshold T, whose digit 0 is the bin b0):
// tile_gt[t] += candidates of tile t with key > T, tile_eq[t] = those with key == T (keys above
// the bin were counted by CollectKernel). Candidates of one tile are mostly consecutive: a warp
// whose valid lanes share one tile adds with one atomic per counter.
__global__ void __launch_bounds__(kThreads) CandCountKernel(TopkTemp tt) {
  if (*tt.error) return;
  const uint64_t total = tt.misc[1];
  const unsigned lane = threadIdx.x & 31u;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  // Whole warps iterate together (the loop bound is uniform over the warp).
  for (uint64_t base = static_cast<uint64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u);
       base < total; base += stride) {
    const uint64_t i = base + lane;
    const bool valid = i < total;
    uint32_t t = 0;
    bool gt = false, eq = false;
    if (valid) {
      t = tt.cand_tile[i];
      const uint32_t key = tt.cand_key[i];
      const uint32_t T = tt.thr[tt.tile_seg[t]];
      gt = key > T;
      eq = key == T;
    }
    const uint32_t t_lane0 = __shfl_sync(0xffffffffu, t, 0);  // lane 0 is valid when any is
    if (__all_sync(0xffffffffu, !valid || t == t_lane0)) {
      const uint32_t ng = __popc(__ballot_sync(0xffffffffu, gt));
      const uint32_t ne = __popc(__ballot_sync(0xffffffffu, eq));
      if (lane == 0) {
        if (ng) atomicAdd(&tt.tile_gt[t_lane0], ng);
        if (ne) atomicAdd(&tt.tile_eq[t_lane0], ne);
      }
    } else {
      if (gt) atomicAdd(&tt.tile_gt[t], 1u);
      if (eq) atomicAdd(&tt.tile_eq[t], 1u);
    }
  }
}

}  // namespace topk_detail
}  // namespace cuda
}  // namespace kernels
}  // namespace scape
