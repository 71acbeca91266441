// Internal (CUDA only): the shared part of the CUDA top-k per segment on |x| (contract:
// kernels/cpu/topk.h and kernels/cuda/scape_kernels.cuh), split in two files:
//   topk_select.cu: phases 1-2 and the list / candidate collection (the threshold per segment);
//   topk.cu:        phases 3-5 (per-tile counts, scan, write) and the host entry points.
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
#ifndef SCAPE_KERNELS_CUDA_TOPK_INTERNAL_CUH_
#define SCAPE_KERNELS_CUDA_TOPK_INTERNAL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/topk_common.h"
#include "kernels/cuda/device_common.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace topk_detail {

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

// Exact mode: candidates per chunk of CandHistKernel (its grid is sized by the host).
constexpr uint64_t kCandChunk = 4096;

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

// The per-tile prelude of the passes over x that split a tile among a block's warps (the
// counting, collecting and write passes): tile t of segment s starts at *e0, warp `warp`'s share
// [*c0, min(*c0 + kWarpElems, tile end)) starts at *c0, and its keys are loaded into key[]
// (LoadWarpKeys) when the share is not empty. Returns whether it is (uniform over the warp; key[]
// is left alone otherwise).
__device__ __forceinline__ bool LoadTileShare(const float* x, const uint64_t* offsets,
                                              const uint64_t* tile_begin, uint64_t s, uint64_t t,
                                              unsigned warp, uint32_t (&key)[kRounds], uint64_t* e0,
                                              uint64_t* c0) {
  uint64_t e1;
  TileRange(offsets, tile_begin, s, t, e0, &e1);
  *c0 = *e0 + warp * kWarpElems;
  if (*c0 >= e1) return false;
  const uint64_t c1 = *c0 + kWarpElems < e1 ? *c0 + kWarpElems : e1;
  LoadWarpKeys(x, *c0, c1, key);
  return true;
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

// The counting prelude of the write pass and the sampled collecting pass: LoadTileShare, then
// WarpCountKeys when the warp's share is not empty (*g, *e; 0 otherwise), the warp's counts
// published in sh_gt[warp] / sh_eq[warp], and a block barrier. Returns LoadTileShare's result.
__device__ __forceinline__ bool LoadCountTileShare(const float* x, const uint64_t* offsets,
                                                   const uint64_t* tile_begin, uint64_t s,
                                                   uint64_t t, uint32_t T, uint32_t (&key)[kRounds],
                                                   uint64_t* e0, uint64_t* c0, uint32_t* g,
                                                   uint32_t* e, uint32_t* sh_gt, uint32_t* sh_eq) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  *g = 0;
  *e = 0;
  const bool mine = LoadTileShare(x, offsets, tile_begin, s, t, warp, key, e0, c0);
  if (mine) WarpCountKeys(key, T, g, e);  // uniform over the warp
  if (lane == 0) {
    sh_gt[warp] = *g;
    sh_eq[warp] = *e;
  }
  __syncthreads();
  return mine;
}

// ---- kernels of topk_select.cu, launched by topk.cu (TopkImpl), in launch order ----------------

__global__ void SetupKernel(const uint64_t* offsets, const uint64_t* k, uint64_t nseg,
                            uint64_t max_tiles, TopkTemp tt);
__global__ void TileSegKernel(uint64_t nseg, TopkTemp tt);
// Exact mode.
__global__ void HistKernel(const float* x, const uint64_t* offsets, uint64_t nseg, TopkTemp tt,
                           int digit);
__global__ void CandHistKernel(TopkTemp tt, int digit);
__global__ void FindBinKernel(uint64_t nseg, TopkTemp tt, int digit);
__global__ void CandPlanKernel(uint64_t nseg, uint64_t cand_cap, TopkTemp tt);
__global__ void CollectKernel(const float* x, const uint64_t* offsets, uint64_t nseg, TopkTemp tt);
__global__ void CandCountKernel(TopkTemp tt);
// Sampled mode.
__global__ void SampleSelectKernel(const float* x, const uint64_t* offsets, uint64_t nseg,
                                   uint64_t sample_size, TopkTemp tt);
__global__ void SampledCollectKernel(const float* x, const uint64_t* offsets, uint64_t nseg,
                                     uint64_t cap, TopkTemp tt);

}  // namespace topk_detail
}  // namespace cuda
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CUDA_TOPK_INTERNAL_CUH_
