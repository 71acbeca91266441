// CUDA top-k per segment on |x| (contract: kernels/cpu/topk.h and kernels/cuda/scape_kernels.cuh):
// phases 3-5 (per-tile counts, scan, write), the temporary-storage layout and the host entry
// points. The phases and the threshold half (topk_select.cu) are described in
// kernels/cuda/topk_internal.cuh.
#include <cuda_runtime.h>

#include "kernels/cpu/topk_common.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"
#include "kernels/cuda/topk_internal.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

using namespace topk_detail;  // NOLINT(build/namespaces): the top-k's own internals

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
      uint64_t e0, c0;
      uint32_t key[kRounds];
      if (LoadTileShare(x, offsets, tt.tile_begin, s, t, warp, key, &e0, &c0))  // uniform / warp
        WarpCountKeys(key, T, &g, &e);
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

// Where tile t of segment s writes in the segment's output (both write passes): its keys > T
// start after the keys > T of the tiles before it, plus the ties those took (taken_before, at
// most take); [start, stop) is clamped to the segment's output capacity.
struct TileSlots {
  uint64_t take, eq_off, taken_before, start, stop;
};
__device__ __forceinline__ TileSlots TileOutSlots(const TopkTemp& tt, const uint64_t* out_offsets,
                                                  uint64_t s, uint64_t t) {
  TileSlots w;
  w.take = tt.take[s];
  w.eq_off = tt.tile_eq_off[t];
  const uint64_t eq_end = w.eq_off + tt.tile_eq[t];
  w.taken_before = w.eq_off < w.take ? w.eq_off : w.take;
  const uint64_t taken_after = eq_end < w.take ? eq_end : w.take;
  w.start = tt.tile_gt_off[t] + w.taken_before;
  const uint64_t cap = out_offsets[s + 1] - out_offsets[s];
  w.stop = w.start + tt.tile_gt[t] + (taken_after - w.taken_before);
  if (w.stop > cap) w.stop = cap;
  return w;
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
    const TileSlots slots = TileOutSlots(tt, out_offsets, s, t);
    const uint64_t take = slots.take, eq_off = slots.eq_off, taken_before = slots.taken_before;
    const uint64_t start = slots.start, stop = slots.stop;
    if (start >= stop) continue;  // uniform over the block
    Index* o = out + out_offsets[s];
    uint64_t e0, c0;
    uint32_t key[kRounds];
    uint32_t g, e;
    const bool mine =
        LoadCountTileShare(x, offsets, tt.tile_begin, s, t, T, key, &e0, &c0, &g, &e, sh_gt, sh_eq);
    uint64_t gt_before = 0, eq_before = 0;  // in the warps before this one, inside the tile
    for (unsigned w = 0; w < warp; ++w) {
      gt_before += sh_gt[w];
      eq_before += sh_eq[w];
    }
    __syncthreads();  // sh_* are rewritten by the next tile
    if (!mine) continue;
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
    const TileSlots slots = TileOutSlots(tt, out_offsets, s, t);
    const uint64_t take = slots.take, eq_off = slots.eq_off, start = slots.start, stop = slots.stop;
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
