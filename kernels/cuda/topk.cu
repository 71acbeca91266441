// CUDA top-k per segment on |x| (contract: kernels/cpu/topk.h and kernels/cuda/scape_kernels.cuh).
//
// The flat input is cut into tiles of kTileElems elements that never cross a segment boundary
// (tile_begin[s] = first tile of segment s, computed on the device). Phases, all
// stream-ordered, no host synchronisation:
//   1. Setup (1 block): tile table, clamped k, trivial segments (k == 0: threshold above every
//      key; k == len: threshold 0, i.e. everything).
//   2. Threshold T per segment:
//      exact:   3 radix digits (11, 11, 9 bits of the 31-bit key); after each digit one warp
//               per segment picks the bin holding the rem-th largest key. Digit 0: a
//               histogram pass over x (shared-memory histogram per tile, merged with global
//               atomics into a per-segment histogram). Then one collecting read of x
//               (CollectKernel) copies to a buffer, per tile and in index order, every key
//               whose digit 0 is at or above the chosen bin, with its offset in the tile: the
//               keys above the bin (all selected) and the bin's keys (the candidates, a few
//               per cent of the segment for smooth data). Digits 1 and 2 are histogrammed over
//               the candidates only. When these lists do not fit the buffer (len/8 + 4096
//               entries in all; large k), only the candidates are copied (kModeCand), and when
//               not even those fit (heavy ties), digits 1 and 2 run over x. After 3 digits, T
//               is the k-th largest key and exactly k - #(> T) ties are needed; the same T
//               every way.
//      sampled: one block per segment runs the same radix select on the sampled keys
//               (topk::SamplePosition) in shared memory, with rank topk::SampleRank; then one
//               collecting read of x (SampledCollectKernel) counts per tile the keys > T and
//               == T and copies the keys >= T with their offsets to per-tile lists.
//   3. Per-tile counts of keys > T and == T: from the lists or the candidates (tile of each
//      entry, atomics), else by a counting pass over x (trivial segments, fallback).
//   4. Scan (one block per segment): per-tile exclusive offsets, ties taken =
//      topk::TiesTaken(k, gt, eq), count = min(gt + ties, capacity).
//   5. Write: each tile writes its selected positions in index order, so the output is sorted
//      without any sort: from its list (ListWriteKernel) when it has one, else by a pass over
//      x (warp-owned chunks, ballot prefixes; WriteKernel).
// Reads of x with smooth keys and small k: exact 2 (histogram, collect), sampled 1 (collect)
// plus the samples. (Without lists: exact 3, sampled 2.)
#include <cuda_runtime.h>

#include "kernels/cpu/topk_common.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

using topk::kAboveAllKeys;

constexpr int kThreads = 256;
constexpr uint64_t kTileElems = 8192;
constexpr int kSetupThreads = 1024;
constexpr int kSampleThreads = 1024;
// Sampled mode: samples per thread held in registers (kSampleRegs * kSampleThreads = 16384, the
// default sample_size).
constexpr int kSampleRegs = 16;
// Marks a lane without an element (keys are < 2^31, and a threshold is <= kAboveAllKeys).
constexpr uint32_t kInvalidKey = 0xffffffffu;
// The write pass: each warp owns kWarpElems consecutive elements of a tile (kRounds rounds of
// 32), so a tile is kTileElems / kWarpElems warps = one block of kThreads.
constexpr int kRounds = 32;
constexpr uint64_t kWarpElems = 32 * kRounds;
static_assert(kWarpElems * (kThreads / 32) == kTileElems, "a block's warps cover one tile");
static_assert(kTileElems <= 65536, "a list entry's offset in its tile is 16 bits");

struct TopkTemp {
  uint64_t* tile_begin;   // nseg + 1
  uint64_t* keff;         // nseg
  uint64_t* rem;          // nseg
  uint64_t* take;         // nseg
  uint32_t* prefix;       // nseg
  uint32_t* pmask;        // nseg
  uint32_t* thr;          // nseg
  uint32_t* active;       // nseg: 1 while a radix select runs
  uint32_t* hist;         // nseg * kMaxBins (exact mode)
  uint32_t* tile_gt;      // max_tiles
  uint32_t* tile_eq;      // max_tiles
  uint64_t* tile_gt_off;  // max_tiles
  uint64_t* tile_eq_off;  // max_tiles
  uint32_t* error;        // 1
  uint32_t* tile_seg;     // max_tiles: the segment of each tile
  // Exact mode, candidate path (see CandPlanKernel):
  uint32_t* mode;      // nseg: kModeRadix / kModeCand / kModeFallback
  uint64_t* ccount;    // nseg: keys in the threshold bin of digit 0
  uint64_t* cand_cur;  // nseg: next free candidate slot while collecting
  // [0] any fallback segment, [1] candidates in all (exact), [2] next free list entry and
  // [3] list overflow (sampled), [4] the counting pass over x has work, [5] the write pass
  // over x has work (besides an overflow)
  unsigned long long* misc;
  uint32_t* cand_key;    // cand_cap
  uint32_t* cand_tile;   // cand_cap (exact)
  uint16_t* cand_local;  // cand_cap: the element's offset in its tile (list entries)
  uint64_t* tile_lbase;  // max_tiles: a kModeList tile's first list entry
  uint32_t* tile_lcnt;   // max_tiles: its entries
};

// Per segment mode. kModeRadix: a trivial segment (k == 0 or k == len): the counting pass over
// x. kModeList: every key that can be selected (exact: digit 0 at or above the threshold bin b0;
// sampled: key >= the sampled threshold) is copied with its offset in the tile to a per-tile
// list by the one collecting read of x (in index order inside the tile); digits 1 and 2
// (exact), the per-tile counts and the write pass then read the lists, not x
// (ListWriteKernel). Exact: when the lists of all active segments fit the candidate buffer;
// sampled: every active segment, with the write pass over x as the fallback when the lists
// overflow the buffer (misc[3]). kModeCand (exact, the lists do not fit): only the keys in bin
// b0 are copied (the candidates), the counts come from them and the write pass reads x.
// kModeFallback (exact, not even the candidates fit): the histogram passes over x for all
// three digits, as the radix select always did.
constexpr uint32_t kModeRadix = 0, kModeCand = 1, kModeFallback = 2, kModeList = 3;

constexpr int kTempArrays = 24;
struct TempLayout {
  size_t off[kTempArrays];
  size_t total;
};

TempLayout Layout(size_t nseg, uint64_t max_tiles, uint64_t cand_cap, bool exact) {
  const size_t sizes[kTempArrays] = {(nseg + 1) * 8,
                                     nseg * 8,
                                     nseg * 8,
                                     nseg * 8,
                                     nseg * 4,
                                     nseg * 4,
                                     nseg * 4,
                                     nseg * 4,
                                     exact ? nseg * topk::kMaxBins * 4 : 0,
                                     max_tiles * 4,
                                     max_tiles * 4,
                                     max_tiles * 8,
                                     max_tiles * 8,
                                     4,
                                     max_tiles * 4,
                                     nseg * 4,
                                     nseg * 8,
                                     nseg * 8,
                                     48,
                                     cand_cap * 4,
                                     exact ? cand_cap * 4 : 0,
                                     cand_cap * 2,
                                     max_tiles * 8,
                                     max_tiles * 4};
  TempLayout L;
  size_t o = 0;
  for (int i = 0; i < kTempArrays; ++i) {
    L.off[i] = o;
    o += dev::AlignUp(sizes[i]);
  }
  L.total = o + 256;
  return L;
}

TopkTemp Carve(void* base, const TempLayout& L) {
  char* b = static_cast<char*>(base);
  TopkTemp t;
  t.tile_begin = reinterpret_cast<uint64_t*>(b + L.off[0]);
  t.keff = reinterpret_cast<uint64_t*>(b + L.off[1]);
  t.rem = reinterpret_cast<uint64_t*>(b + L.off[2]);
  t.take = reinterpret_cast<uint64_t*>(b + L.off[3]);
  t.prefix = reinterpret_cast<uint32_t*>(b + L.off[4]);
  t.pmask = reinterpret_cast<uint32_t*>(b + L.off[5]);
  t.thr = reinterpret_cast<uint32_t*>(b + L.off[6]);
  t.active = reinterpret_cast<uint32_t*>(b + L.off[7]);
  t.hist = reinterpret_cast<uint32_t*>(b + L.off[8]);
  t.tile_gt = reinterpret_cast<uint32_t*>(b + L.off[9]);
  t.tile_eq = reinterpret_cast<uint32_t*>(b + L.off[10]);
  t.tile_gt_off = reinterpret_cast<uint64_t*>(b + L.off[11]);
  t.tile_eq_off = reinterpret_cast<uint64_t*>(b + L.off[12]);
  t.error = reinterpret_cast<uint32_t*>(b + L.off[13]);
  t.tile_seg = reinterpret_cast<uint32_t*>(b + L.off[14]);
  t.mode = reinterpret_cast<uint32_t*>(b + L.off[15]);
  t.ccount = reinterpret_cast<uint64_t*>(b + L.off[16]);
  t.cand_cur = reinterpret_cast<uint64_t*>(b + L.off[17]);
  t.misc = reinterpret_cast<unsigned long long*>(b + L.off[18]);
  t.cand_key = reinterpret_cast<uint32_t*>(b + L.off[19]);
  t.cand_tile = reinterpret_cast<uint32_t*>(b + L.off[20]);
  t.cand_local = reinterpret_cast<uint16_t*>(b + L.off[21]);
  t.tile_lbase = reinterpret_cast<uint64_t*>(b + L.off[22]);
  t.tile_lcnt = reinterpret_cast<uint32_t*>(b + L.off[23]);
  return t;
}

__device__ __forceinline__ uint32_t KeyAt(const float* x, uint64_t i) {
  return topk::KeyFromBits(__float_as_uint(x[i]));
}

// The element range [*e0, *e1) (positions in x) of tile t of segment s.
__device__ __forceinline__ void TileRange(const uint64_t* offsets, const uint64_t* tile_begin,
                                          uint64_t s, uint64_t t, uint64_t* e0, uint64_t* e1) {
  const uint64_t seg0 = offsets[s], seg1 = offsets[s + 1];
  const uint64_t b = seg0 + (t - tile_begin[s]) * kTileElems;
  *e0 = b;
  *e1 = b + kTileElems < seg1 ? b + kTileElems : seg1;
}

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

// The keys of warp w's share of a tile, [c0, c1) with c1 - c0 <= kWarpElems: key[r] is element
// c0 + 32 r + lane (kInvalidKey past c1). All kRounds loads are issued before any is used.
__device__ __forceinline__ void LoadWarpKeys(const float* x, uint64_t c0, uint64_t c1,
                                             uint32_t (&key)[kRounds]) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t i = c0 + static_cast<uint64_t>(r) * 32 + lane;
    key[r] = i < c1 ? KeyAt(x, i) : kInvalidKey;
  }
}

// Per warp: how many of its keys are > T and == T (valid in every lane; T < kAboveAllKeys).
__device__ __forceinline__ void WarpCountKeys(const uint32_t (&key)[kRounds], uint32_t T,
                                              uint32_t* gt, uint32_t* eq) {
  uint32_t g = 0, e = 0;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    g += __popc(__ballot_sync(0xffffffffu, key[r] > T && key[r] != kInvalidKey));
    e += __popc(__ballot_sync(0xffffffffu, key[r] == T));
  }
  *gt = g;
  *eq = e;
}

// Per tile: keys > T and == T. Warp w counts elements [e0 + w kWarpElems, ...) (the same split
// as the write pass), one shared-memory reduction per tile.
__global__ void __launch_bounds__(kThreads)
    CountKernel(const float* x, const uint64_t* offsets, uint64_t nseg, TopkTemp tt) {
  __shared__ uint32_t sh_gt[kThreads / 32], sh_eq[kThreads / 32];
  if (*tt.error || tt.misc[4] == 0) return;  // no tile to count (the usual case)
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint64_t ntiles = tt.tile_begin[nseg];
  for (uint64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const uint64_t s = tt.tile_seg[t];
    // Counted from the candidates or the lists (CandCountKernel, SampledCollectKernel).
    if (tt.mode[s] == kModeCand || tt.mode[s] == kModeList) continue;
    const uint32_t T = tt.thr[s];
    uint32_t g = 0, e = 0;
    if (T != kAboveAllKeys) {  // uniform over the block
      uint64_t e0, e1;
      TileRange(offsets, tt.tile_begin, s, t, &e0, &e1);
      const uint64_t c0 = e0 + warp * kWarpElems;
      const uint64_t c1 = c0 + kWarpElems < e1 ? c0 + kWarpElems : e1;
      if (c0 < e1) {  // uniform over the warp
        uint32_t key[kRounds];
        LoadWarpKeys(x, c0, c1, key);
        WarpCountKeys(key, T, &g, &e);
      }
    }
    if (lane == 0) {
      sh_gt[warp] = g;
      sh_eq[warp] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t tg = 0, te = 0;
      for (int w = 0; w < kThreads / 32; ++w) {
        tg += sh_gt[w];
        te += sh_eq[w];
      }
      tt.tile_gt[t] = tg;
      tt.tile_eq[t] = te;
    }
    __syncthreads();
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
    uint64_t e0, e1;
    TileRange(offsets, tt.tile_begin, s, t, &e0, &e1);
    const uint64_t c0 = e0 + warp * kWarpElems;
    const uint64_t c1 = c0 + kWarpElems < e1 ? c0 + kWarpElems : e1;
    uint32_t key[kRounds];
    uint32_t g = 0, c = 0;
    if (c0 < e1) {  // uniform over the warp
      LoadWarpKeys(x, c0, c1, key);
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
    if (c0 < e1 && c != 0) {
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
    uint64_t e0, e1;
    TileRange(offsets, tt.tile_begin, s, t, &e0, &e1);
    const uint64_t c0 = e0 + warp * kWarpElems;
    const uint64_t c1 = c0 + kWarpElems < e1 ? c0 + kWarpElems : e1;
    uint32_t key[kRounds];
    uint32_t g = 0, e = 0;
    if (c0 < e1) {  // uniform over the warp
      LoadWarpKeys(x, c0, c1, key);
      WarpCountKeys(key, T, &g, &e);
    }
    if (lane == 0) {
      sh_gt[warp] = g;
      sh_eq[warp] = e;
    }
    __syncthreads();
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
    if (c0 < e1 && sh_fit && g + e != 0) {
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

// Exact mode, digits 1 and 2 of the kModeCand segments: histogram of the candidates matching
// the prefix so far. A chunk of kCandChunk consecutive candidates lies in one segment's region
// or spans several: one segment -> shared-memory histogram merged with one atomic per non-zero
// bin; several (short regions) -> one global atomic per matching candidate.
constexpr uint64_t kCandChunk = 4096;
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

// Any block size that is a multiple of 32 up to kScanMaxThreads (the block scans adapt).
constexpr int kScanMaxThreads = 1024;
__global__ void __launch_bounds__(kScanMaxThreads)
    ScanKernel(const uint64_t* out_offsets, uint64_t nseg, TopkTemp tt, uint64_t* counts) {
  __shared__ uint64_t ws[32];
  const uint64_t s = blockIdx.x;
  if (s >= nseg) return;
  if (*tt.error) {
    if (threadIdx.x == 0) counts[s] = ~uint64_t{0};
    return;
  }
  // Each thread takes a contiguous run of `per` tiles: it sums them (independent loads), one
  // block scan of the sums gives every run its offsets, then the run is walked again (cached)
  // to write the per-tile offsets. (A block scan per blockDim tiles was a serial chain of
  // load -> scan steps: ~38 us for the 8193 tiles of a 64 Mi segment on an H200.)
  const uint64_t tb = tt.tile_begin[s], te = tt.tile_begin[s + 1];
  const uint64_t per = (te - tb + blockDim.x - 1) / blockDim.x;
  const uint64_t r0 = tb + threadIdx.x * per < te ? tb + threadIdx.x * per : te;
  const uint64_t r1 = r0 + per < te ? r0 + per : te;
  uint64_t sum_gt = 0, sum_eq = 0;
  for (uint64_t t = r0; t < r1; ++t) {
    sum_gt += tt.tile_gt[t];
    sum_eq += tt.tile_eq[t];
  }
  uint64_t carry_gt, carry_eq;
  uint64_t og = dev::BlockExclusiveSum(sum_gt, ws, &carry_gt);
  uint64_t oe = dev::BlockExclusiveSum(sum_eq, ws, &carry_eq);
  for (uint64_t t = r0; t < r1; ++t) {
    tt.tile_gt_off[t] = og;
    tt.tile_eq_off[t] = oe;
    og += tt.tile_gt[t];
    oe += tt.tile_eq[t];
  }
  if (threadIdx.x == 0) {
    const uint64_t take = topk::TiesTaken(tt.keff[s], carry_gt, carry_eq);
    const uint64_t cap = out_offsets[s + 1] - out_offsets[s];
    const uint64_t c = carry_gt + take;
    tt.take[s] = take;
    counts[s] = c < cap ? c : cap;
  }
}

// Per tile: the selected positions in index order. Warp w owns elements
// [e0 + w kWarpElems, ...): it loads all its keys (kRounds loads in flight), counts its keys > T
// and == T, one shared-memory exchange gives every warp its offset inside the tile, then the
// warp writes its selected positions round by round with ballot prefixes (no block barrier per
// round). Ties (key == T) are taken in index order while their rank in the segment is < take.
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    WriteKernel(const float* x, const uint64_t* offsets, const uint64_t* out_offsets, uint64_t nseg,
                TopkTemp tt, Index* out) {
  constexpr int kWarps = kThreads / 32;
  __shared__ uint32_t sh_gt[kWarps], sh_eq[kWarps];
  if (*tt.error || (tt.misc[5] == 0 && tt.misc[3] == 0)) return;  // every tile has a list
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint32_t lt_mask = (1u << lane) - 1u;
  const uint64_t ntiles = tt.tile_begin[nseg];
  for (uint64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const uint64_t s = tt.tile_seg[t];
    const uint32_t T = tt.thr[s];
    if (T == kAboveAllKeys) continue;                          // uniform over the block
    if (tt.mode[s] == kModeList && tt.misc[3] == 0) continue;  // ListWriteKernel's
    const uint64_t take = tt.take[s];
    const uint64_t eq_off = tt.tile_eq_off[t];
    const uint64_t eq_end = eq_off + tt.tile_eq[t];
    const uint64_t taken_before = eq_off < take ? eq_off : take;
    const uint64_t taken_after = eq_end < take ? eq_end : take;
    const uint64_t start = tt.tile_gt_off[t] + taken_before;
    const uint64_t cap = out_offsets[s + 1] - out_offsets[s];
    uint64_t stop = start + tt.tile_gt[t] + (taken_after - taken_before);
    if (stop > cap) stop = cap;
    if (start >= stop) continue;  // uniform over the block
    Index* o = out + out_offsets[s];
    uint64_t e0, e1;
    TileRange(offsets, tt.tile_begin, s, t, &e0, &e1);
    const uint64_t c0 = e0 + warp * kWarpElems;
    const uint64_t c1 = c0 + kWarpElems < e1 ? c0 + kWarpElems : e1;
    uint32_t key[kRounds];
    uint32_t g = 0, e = 0;
    if (c0 < e1) {  // uniform over the warp
      LoadWarpKeys(x, c0, c1, key);
      WarpCountKeys(key, T, &g, &e);
    }
    if (lane == 0) {
      sh_gt[warp] = g;
      sh_eq[warp] = e;
    }
    __syncthreads();
    uint64_t gt_before = 0, eq_before = 0;  // in the warps before this one, inside the tile
    for (unsigned w = 0; w < warp; ++w) {
      gt_before += sh_gt[w];
      eq_before += sh_eq[w];
    }
    __syncthreads();  // sh_* are rewritten by the next tile
    if (c0 >= e1) continue;
    // Ties before this warp in the segment: eq_off + eq_before; those taken: min(that, take).
    const uint64_t eq_rank0 = eq_off + eq_before;
    const uint64_t taken_w0 = eq_rank0 < take ? eq_rank0 : take;
    uint64_t pos = start + gt_before + (taken_w0 - taken_before);  // next output slot
    uint64_t eq_rank = eq_rank0;
    if (pos >= stop) continue;
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const bool is_eq = key[r] == T;
      const uint32_t b_eq = __ballot_sync(0xffffffffu, is_eq);
      const bool sel = (key[r] > T && key[r] != kInvalidKey) ||
                       (is_eq && eq_rank + __popc(b_eq & lt_mask) < take);
      const uint32_t b_sel = __ballot_sync(0xffffffffu, sel);
      if (sel) {
        const uint64_t p = pos + __popc(b_sel & lt_mask);
        if (p < stop) o[p] = static_cast<Index>(c0 + static_cast<uint64_t>(r) * 32 + lane);
      }
      pos += __popc(b_sel);
      eq_rank += __popc(b_eq);
    }
  }
}

// The write pass of kModeList tiles (without a list overflow): the same output as
// WriteKernel, from the tile's list (its selectable keys with their offsets, in index order)
// instead of x. One warp per tile (kThreads / 32 tiles per block, no block barrier): the warp
// takes the list 32 entries at a time; ballots give each entry its tie rank and output slot.
template <typename Index>
__global__ void __launch_bounds__(kThreads)
    ListWriteKernel(const uint64_t* offsets, const uint64_t* out_offsets, uint64_t nseg,
                    TopkTemp tt, Index* out) {
  if (*tt.error || tt.misc[3] != 0) return;
  const unsigned lane = threadIdx.x & 31u;
  const uint32_t lt_mask = (1u << lane) - 1u;
  const uint64_t ntiles = tt.tile_begin[nseg];
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
  for (uint64_t t = static_cast<uint64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
       t < ntiles; t += warps) {
    const uint64_t s = tt.tile_seg[t];
    if (tt.mode[s] != kModeList) continue;  // uniform over the warp
    const uint64_t lc = tt.tile_lcnt[t];
    if (lc == 0) continue;
    const uint32_t T = tt.thr[s];
    const uint64_t take = tt.take[s];
    const uint64_t eq_off = tt.tile_eq_off[t];
    const uint64_t eq_end = eq_off + tt.tile_eq[t];
    const uint64_t taken_before = eq_off < take ? eq_off : take;
    const uint64_t taken_after = eq_end < take ? eq_end : take;
    const uint64_t start = tt.tile_gt_off[t] + taken_before;
    const uint64_t cap = out_offsets[s + 1] - out_offsets[s];
    uint64_t stop = start + tt.tile_gt[t] + (taken_after - taken_before);
    if (stop > cap) stop = cap;
    if (start >= stop) continue;
    Index* o = out + out_offsets[s];
    const uint64_t e0 = offsets[s] + (t - tt.tile_begin[s]) * kTileElems;
    const uint64_t lb = tt.tile_lbase[t];
    uint64_t eq_rank = eq_off, pos = start;
    for (uint64_t j0 = 0; j0 < lc && pos < stop; j0 += 32) {  // uniform over the warp
      const uint64_t j = j0 + lane;
      const bool valid = j < lc;
      const uint32_t key = valid ? tt.cand_key[lb + j] : 0u;
      const uint32_t local = valid ? tt.cand_local[lb + j] : 0u;
      const bool is_eq = valid && key == T;
      const uint32_t b_eq = __ballot_sync(0xffffffffu, is_eq);
      const bool sel = valid && (key > T || (is_eq && eq_rank + __popc(b_eq & lt_mask) < take));
      const uint32_t b_sel = __ballot_sync(0xffffffffu, sel);
      const uint64_t p = pos + __popc(b_sel & lt_mask);
      if (sel && p < stop) o[p] = static_cast<Index>(e0 + local);
      eq_rank += __popc(b_eq);
      pos += __popc(b_sel);
    }
  }
}

// Candidate buffer entries (exact mode): an eighth of the elements, plus some room for small
// inputs. Digit 0's threshold bin holds k' + (keys tied with it) keys; with 2048 bins of the
// high 11 key bits (1/8 of a binade each) that is a few per cent of a segment for smooth
// data; heavy ties or a bin holding more than this fall back to the histogram passes over x.
// A candidate's tile is stored in 32 bits: no candidate path beyond 2^32 tiles.
uint64_t CandCapacity(uint64_t max_elements, uint64_t max_tiles) {
  return max_tiles >= (uint64_t{1} << 32) ? 0 : max_elements / 8 + 4096;
}

template <typename Index>
KernelStatus TopkImpl(const float* x, const TopkCudaSegments& sg, const TopkOptions& opt,
                      Index* out, uint64_t* counts, void* d_temp, size_t* temp_bytes,
                      cudaStream_t stream) {
  if (temp_bytes == nullptr) return KernelStatus::kInvalidArgument;
  if (opt.mode != TopkMode::kExact && opt.mode != TopkMode::kSampled) {
    return KernelStatus::kInvalidArgument;
  }
  if (opt.mode == TopkMode::kSampled &&
      (opt.sample_size < 1 || opt.sample_size > topk::kMaxSampleSize)) {
    return KernelStatus::kInvalidArgument;
  }
  const bool exact = opt.mode == TopkMode::kExact;
  const uint64_t nseg = sg.nseg;
  const uint64_t max_tiles = sg.max_elements / kTileElems + nseg + 1;
  const uint64_t cand_cap = CandCapacity(sg.max_elements, max_tiles);
  const TempLayout L = Layout(nseg, max_tiles, cand_cap, exact);
  if (d_temp == nullptr) {
    *temp_bytes = L.total;
    return KernelStatus::kOk;
  }
  if (*temp_bytes < L.total) return KernelStatus::kBufferTooSmall;
  if (nseg == 0) return KernelStatus::kOk;
  if (sg.d_offsets == nullptr || sg.d_k == nullptr || sg.d_out_offsets == nullptr ||
      counts == nullptr || out == nullptr || (x == nullptr && sg.max_elements > 0)) {
    return KernelStatus::kInvalidArgument;
  }
  if (!exact && sg.max_elements >= topk::kMaxSampledPosition) {
    return KernelStatus::kInvalidArgument;
  }
  if (nseg >= (uint64_t{1} << 31)) return KernelStatus::kInvalidArgument;
  TopkTemp tt = Carve(d_temp, L);
  SetupKernel<<<1, kSetupThreads, 0, stream>>>(sg.d_offsets, sg.d_k, nseg, max_tiles, tt);
  SCAPE_CUDA_LAUNCH_CHECK();
  TileSegKernel<<<dev::GridFor(nseg, 1, 65535), kThreads, 0, stream>>>(nseg, tt);
  SCAPE_CUDA_LAUNCH_CHECK();
  const unsigned tile_grid = dev::GridFor(max_tiles, 1, 65535);
  const unsigned seg_grid = static_cast<unsigned>(nseg);  // checked above: nseg < 2^31
  if (exact) {
    // The histogram pass: about 6 resident blocks per SM (32 KiB of shared memory each), each
    // with a contiguous run of tiles.
    int dev_id = 0, sms = 0;
    SCAPE_CUDA_CALL(cudaGetDevice(&dev_id));
    SCAPE_CUDA_CALL(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev_id));
    const unsigned hist_grid =
        dev::GridFor(max_tiles, 1, static_cast<unsigned>(sms > 0 ? sms : 1) * 6);
    const unsigned cand_grid = dev::GridFor(cand_cap, kCandChunk, 65535);
    SCAPE_CUDA_CALL(cudaMemsetAsync(tt.hist, 0, nseg * topk::kMaxBins * sizeof(uint32_t), stream));
    for (int d = 0; d < topk::kNumDigits; ++d) {
      HistKernel<<<hist_grid, kThreads, 0, stream>>>(x, sg.d_offsets, nseg, tt, d);
      SCAPE_CUDA_LAUNCH_CHECK();
      if (d > 0) {
        CandHistKernel<<<cand_grid, kThreads, 0, stream>>>(tt, d);
        SCAPE_CUDA_LAUNCH_CHECK();
      }
      FindBinKernel<<<seg_grid, kThreads, 0, stream>>>(nseg, tt, d);
      SCAPE_CUDA_LAUNCH_CHECK();
      if (d == 0) {
        CandPlanKernel<<<1, kSetupThreads, 0, stream>>>(nseg, cand_cap, tt);
        SCAPE_CUDA_LAUNCH_CHECK();
        CollectKernel<<<tile_grid, kThreads, 0, stream>>>(x, sg.d_offsets, nseg, tt);
        SCAPE_CUDA_LAUNCH_CHECK();
      }
    }
  } else {
    SampleSelectKernel<<<seg_grid, kSampleThreads, 0, stream>>>(x, sg.d_offsets, nseg,
                                                                opt.sample_size, tt);
    SCAPE_CUDA_LAUNCH_CHECK();
    SampledCollectKernel<<<tile_grid, kThreads, 0, stream>>>(x, sg.d_offsets, nseg, cand_cap, tt);
    SCAPE_CUDA_LAUNCH_CHECK();
  }
  CountKernel<<<tile_grid, kThreads, 0, stream>>>(x, sg.d_offsets, nseg, tt);
  SCAPE_CUDA_LAUNCH_CHECK();
  if (exact) {
    CandCountKernel<<<dev::GridFor(cand_cap, kThreads * 8, 65535), kThreads, 0, stream>>>(tt);
    SCAPE_CUDA_LAUNCH_CHECK();
  }
  // One block per segment walks its tiles blockDim at a time: long segments (a 64 Mi-element
  // segment has 8192 tiles) get 1024 threads, a quarter of the serial block-scan steps.
  const unsigned scan_threads = max_tiles / nseg >= 512 ? kScanMaxThreads : kThreads;
  ScanKernel<<<seg_grid, scan_threads, 0, stream>>>(sg.d_out_offsets, nseg, tt, counts);
  SCAPE_CUDA_LAUNCH_CHECK();
  WriteKernel<Index>
      <<<tile_grid, kThreads, 0, stream>>>(x, sg.d_offsets, sg.d_out_offsets, nseg, tt, out);
  SCAPE_CUDA_LAUNCH_CHECK();
  ListWriteKernel<Index><<<dev::GridFor(max_tiles, kThreads / 32, 65535), kThreads, 0, stream>>>(
      sg.d_offsets, sg.d_out_offsets, nseg, tt, out);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

}  // namespace

KernelStatus TopkAbsCuda(const float* d_x, const TopkCudaSegments& segments,
                         const TopkOptions& options, uint32_t* d_out, uint64_t* d_counts,
                         void* d_temp, size_t* temp_bytes, cudaStream_t stream) {
  return TopkImpl(d_x, segments, options, d_out, d_counts, d_temp, temp_bytes, stream);
}
KernelStatus TopkAbsCuda(const float* d_x, const TopkCudaSegments& segments,
                         const TopkOptions& options, uint64_t* d_out, uint64_t* d_counts,
                         void* d_temp, size_t* temp_bytes, cudaStream_t stream) {
  return TopkImpl(d_x, segments, options, d_out, d_counts, d_temp, temp_bytes, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
