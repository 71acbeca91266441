// CUDA implementation of the SCAPE step kernels (contract: kernels/cpu/scape_step.h and
// kernels/cuda/scape_kernels.cuh). Every float operation uses an explicit round-to-nearest
// intrinsic, in the order the contract writes, so that nvcc cannot contract a multiply-add
// into an FMA: the results equal the CPU implementation bit for bit.
//
// Both fused kernels work on tiles of kTile consecutive elements. A block first finds the
// tile's range of mask entries (two warp-parallel lower_bound searches) and marks each masked
// element's payload slot in shared memory; then every thread streams its elements once,
// reading m/g/e (or theta/m) and writing the outputs, with the payload accessed at the
// marked slots. One pass over the dense arrays, no temp storage.
#include <cuda_runtime.h>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 4096;

// First index in a[0, n) whose value is >= target (n if none), computed by one full warp with
// 32-way splits. Robust to unsorted input: the result always lies in [0, n].
template <typename Index>
__device__ uint64_t WarpLowerBound(const Index* a, uint64_t n, uint64_t target) {
  const unsigned lane = threadIdx.x & 31u;
  uint64_t lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (hi - lo > 32) {
    const uint64_t step = (hi - lo) / 32;
    const uint64_t pos = lo + (lane + 1) * step - 1;
    const bool less = static_cast<uint64_t>(a[pos]) < target;
    const int c = __popc(__ballot_sync(0xffffffffu, less));
    const uint64_t new_lo = c == 0 ? lo : lo + static_cast<uint64_t>(c) * step;
    const uint64_t new_hi = c == 32 ? hi : lo + static_cast<uint64_t>(c + 1) * step - 1;
    lo = new_lo;
    hi = new_hi;
  }
  const uint64_t pos = lo + lane;
  const bool less = pos < hi && static_cast<uint64_t>(a[pos]) < target;
  return lo + static_cast<uint64_t>(__popc(__ballot_sync(0xffffffffu, less)));
}

// The body of MarkTile and MarkTile16 once slot[] holds -1: the mask range [jb, je) of the tile
// [t0, t1) (two warps' lower bounds), then slot[p - t0] = j - jb for each masked position p of
// the tile (at most kTileN of them). Ends with a block barrier.
template <int kTileN, typename Slot, typename Index>
__device__ void MarkSlots(const Index* mask, uint64_t k, uint64_t t0, uint64_t t1, Slot* slot,
                          uint64_t* range, uint64_t* jb_out) {
  const unsigned warp = threadIdx.x >> 5;
  if (warp < 2) {
    const uint64_t r = WarpLowerBound(mask, k, warp == 0 ? t0 : t1);
    if ((threadIdx.x & 31u) == 0) range[warp] = r;
  }
  __syncthreads();
  const uint64_t jb = range[0], je = range[1];
  for (uint64_t j = jb + threadIdx.x; j < je && j - jb < static_cast<uint64_t>(kTileN);
       j += blockDim.x) {
    const uint64_t p = static_cast<uint64_t>(mask[j]);
    if (p >= t0 && p < t1) slot[p - t0] = static_cast<Slot>(j - jb);
  }
  __syncthreads();
  *jb_out = jb;
}

// Fills slot[0, t1 - t0) with the payload index offset (j - *jb) of each masked element of the
// tile [t0, t1), -1 elsewhere. Ends with a block barrier.
template <typename Index>
__device__ void MarkTile(const Index* mask, uint64_t k, uint64_t t0, uint64_t t1, int* slot,
                         uint64_t* range, uint64_t* jb_out) {
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) slot[i] = -1;
  MarkSlots<kTile>(mask, k, t0, t1, slot, range, jb_out);
}

// keep: the residual at a masked element is the rounding error c - stored (+0 when the stored
// value is not finite; always +0 for fp32), else +0 (the contract's keep_rounding).
// kG: the gradients' type (dtypes' traits: F32T, Bf16T, F16T), widened exactly as read.
template <typename Index, typename kType, bool kCOut, typename kG>
__global__ void __launch_bounds__(kThreads)
    CandidateKernel(const float* m, const void* g, float* e, uint64_t n, float b1, float omb1,
                    const Index* mask, uint64_t k, void* payload, float* c_out, bool keep) {
  __shared__ int slot[kTile];
  __shared__ uint64_t range[2];
  for (uint64_t tile = blockIdx.x; tile * kTile < n; tile += gridDim.x) {
    const uint64_t t0 = tile * kTile;
    const uint64_t t1 = t0 + kTile < n ? t0 + kTile : n;
    uint64_t jb;
    MarkTile(mask, k, t0, t1, slot, range, &jb);
    for (uint64_t i = t0 + threadIdx.x; i < t1; i += blockDim.x) {
      const float gi = dev::LoadPayload<kG>(g, i);
      const float c = __fadd_rn(__fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi)), e[i]);
      const int s = slot[i - t0];
      if (s >= 0 && jb + static_cast<uint64_t>(s) < k) {
        const float q = dev::StorePayload<kType>(payload, jb + static_cast<uint64_t>(s), c);
        e[i] = (dev::kIsF32<kType> || !keep || !isfinite(q)) ? 0.0f : __fsub_rn(c, q);
      } else {
        e[i] = c;
      }
      if (kCOut) c_out[i] = c;
    }
    __syncthreads();  // slot is reused by the next tile
  }
}

// The update kernel's tiles: kUTile elements, 16-bit payload slots (kUTile <= 32767).
constexpr int kUTile = 8192;
constexpr int kUGroups = kUTile / (kThreads * 4);  // float4 groups per thread in a full tile
static_assert(kUGroups * kThreads * 4 == kUTile, "a full tile is whole float4 groups");

// MarkTile with 16-bit slots (16 KiB of shared memory for kUTile elements).
template <typename Index>
__device__ void MarkTile16(const Index* mask, uint64_t k, uint64_t t0, uint64_t t1, short* slot,
                           uint64_t* range, uint64_t* jb_out) {
  int4* s4 = reinterpret_cast<int4*>(slot);
  for (int i = threadIdx.x; i < kUTile / 8; i += blockDim.x) s4[i] = make_int4(-1, -1, -1, -1);
  MarkSlots<kUTile>(mask, k, t0, t1, slot, range, jb_out);
}

// The AdamS update of one masked element (mp = m_{t-1}[i], th = theta[i]): returns theta_t and
// sets *m_out = m_t. The operation order is the contract's (kernels/cpu/scape_step.h).
// The "segment_rms" entering rule (AdamSParams.enter_vs, device copies): the segment value of
// position i when m_{t-1}[i] == 0 and a table is given, else -1 (the paper's form).
struct EnterTable {
  const uint64_t* off;  // nseg + 1
  const float* vs;      // nseg; nullptr: off
  uint64_t nseg;
};
__device__ __forceinline__ float EnterVs(const EnterTable& et, uint64_t i, float mp) {
  if (et.vs == nullptr || mp != 0.0f) return -1.0f;
  uint64_t lo = 0, hi = et.nseg;  // the last s with off[s] <= i lies in [lo, hi)
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (et.off[mid] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return et.vs[lo];
}

template <typename kType>
__device__ __forceinline__ float MaskedUpdate(const void* payload, uint64_t j, float mp, float th,
                                              const AdamSScalars& s, float* m_out,
                                              float vs = -1.0f) {
  const float mt = dev::LoadPayload<kType>(payload, j);
  const float gh = __fdiv_rn(__fsub_rn(mt, __fmul_rn(s.b1, mp)), s.omb1);
  const float gc = __fmul_rn(gh, s.clip);
  const float mn = s.rebuild_momentum ? __fadd_rn(__fmul_rn(s.b1, mp), __fmul_rn(s.omb1, gc)) : mt;
  if (mp == 0.0f && vs > 0.0f && vs <= 3.402823466e38f) {
    // Entering coordinate, "segment_rms": the segment's mean square, the update capped.
    const float v = __fmul_rn(s.clip2, vs);
    const float den = __fadd_rn(__fsqrt_rn(__fmul_rn(v, s.vscale)), s.eps);
    float u = __fdiv_rn(__fmul_rn(s.lr, __fmul_rn(mn, s.mscale)), den);
    u = u > s.cap_lr ? s.cap_lr : (u < -s.cap_lr ? -s.cap_lr : u);
    if (s.enter_mcap) {  // momentum factor masking: keep one step's worth (NaN stays NaN)
      const float bound = __fmul_rn(s.omb1, __fsqrt_rn(v));
      *m_out = mn > bound ? bound : (mn < -bound ? -bound : mn);
    } else {
      *m_out = mn;
    }
    return __fsub_rn(__fmul_rn(th, s.decay), u);
  }
  const float mpc = __fmul_rn(mp, s.pscale);
  const float v =
      __fadd_rn(__fmul_rn(s.b2, __fmul_rn(mpc, mpc)), __fmul_rn(s.omb2, __fmul_rn(gc, gc)));
  const float den = __fadd_rn(__fsqrt_rn(__fmul_rn(v, s.vscale)), s.eps);
  const float upd = __fdiv_rn(__fmul_rn(s.lr, __fmul_rn(mn, s.mscale)), den);
  *m_out = mn;
  return __fsub_rn(__fmul_rn(th, s.decay), upd);
}

// The work at one masked element of the update pass, a template parameter of UpdateKernel:
// point(j, i, th, m, s, &m_out) returns theta_t at position i (mask entry j, theta_{t-1} = th)
// and sets m_out = m_t. kReadsTheta: whether it uses th (else the scalar path does not load it).
// The AdamS update (UnpackAdamSUpdate): m_{t-1} = m[i], payload value j.
template <typename kType>
struct AdamSPointOp {
  static constexpr bool kReadsTheta = true;
  const void* payload;
  EnterTable et;
  __device__ __forceinline__ float operator()(uint64_t j, uint64_t i, float th, const float* m,
                                              const AdamSScalars& s, float* m_out) const {
    const float mp = m[i];
    return MaskedUpdate<kType>(payload, j, mp, th, s, m_out, EnterVs(et, i, mp));
  }
};
// The gathered pairs (UnpackPairsDecayView): theta_t = pairs[2j], m_t = pairs[2j+1].
struct PairsPointOp {
  static constexpr bool kReadsTheta = false;
  const float* pairs;
  __device__ __forceinline__ float operator()(uint64_t j, uint64_t, float, const float*,
                                              const AdamSScalars&, float* m_out) const {
    *m_out = pairs[2 * j + 1];
    return pairs[2 * j];
  }
};

// One pass over theta and m. Full tiles with decay != 1 and 16-byte aligned theta/m (kVec):
// every thread loads its kUGroups float4 of theta first (all in flight), then updates and
// stores theta and m as float4; m_{t-1} is read only at masked elements (m is 0 elsewhere).
// Otherwise (the last partial tile, decay == 1 where theta is only touched at masked
// elements, unaligned pointers) element by element as before. Same results either way.
// Point: the work at a masked element (AdamSPointOp, PairsPointOp); outside the mask
// theta *= decay and m = +0 whatever Point is.
// kCopy (mixed precision, kernels::ModelCopy): void (none), dtypes::Bf16T or F16T; the 16-bit copy
// of theta is stored at every element in the same pass (also where decay == 1 leaves theta).
template <typename kCopy>
__device__ __forceinline__ void StoreCopy(void* copy, uint64_t i, float v) {
  if constexpr (!std::is_void<kCopy>::value)
    static_cast<typename kCopy::Storage*>(copy)[i] = kCopy::Store(v);
}

// Launch bounds: 3 blocks per SM (85 registers a thread) rather than 4 (64), under which ptxas
// spilled (8 bytes stored, 56 loaded per thread in every instantiation on sm_80 and sm_90;
// issue 31 item 9): tests/kernels/spill_check.sh fails on any spill here.
template <typename Index, typename Point, bool kVec, typename kCopy>
__global__ void __launch_bounds__(kThreads, 3)
    UpdateKernel(Point point, const Index* mask, uint64_t k, float* theta, float* m, uint64_t n,
                 AdamSScalars s, void* copy) {
  __shared__ __align__(16) short slot[kUTile];
  __shared__ uint64_t range[2];
  const bool do_decay = s.decay != 1.0f;
  for (uint64_t tile = blockIdx.x; tile * kUTile < n; tile += gridDim.x) {
    const uint64_t t0 = tile * kUTile;
    const uint64_t t1 = t0 + kUTile < n ? t0 + kUTile : n;
    const bool vec_tile = kVec && do_decay && t1 - t0 == static_cast<uint64_t>(kUTile);
    float4* th4 = reinterpret_cast<float4*>(theta + t0);
    float4* m4 = reinterpret_cast<float4*>(m + t0);
    // The theta loads do not depend on the mask: issued before MarkTile16, their DRAM latency
    // overlaps the mask search and slot marking instead of following it (theta[t0, t1) is
    // written only by this block, below).
    float4 th[kUGroups];
    if (vec_tile) {
#pragma unroll
      for (int g = 0; g < kUGroups; ++g) th[g] = th4[g * kThreads + threadIdx.x];
    }
    uint64_t jb;
    MarkTile16(mask, k, t0, t1, slot, range, &jb);
    if (vec_tile) {
#pragma unroll
      for (int g = 0; g < kUGroups; ++g) {
        const int v = g * kThreads + threadIdx.x;  // float4 index inside the tile
        const uint2 sl2 = reinterpret_cast<const uint2*>(slot)[v];
        const short sl[4] = {static_cast<short>(sl2.x & 0xffffu), static_cast<short>(sl2.x >> 16),
                             static_cast<short>(sl2.y & 0xffffu), static_cast<short>(sl2.y >> 16)};
        float t[4] = {th[g].x, th[g].y, th[g].z, th[g].w};
        float mo[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (sl[q] >= 0 && jb + static_cast<uint64_t>(sl[q]) < k) {
            const uint64_t i = t0 + static_cast<uint64_t>(v) * 4 + q;
            t[q] = point(jb + static_cast<uint64_t>(sl[q]), i, t[q], m, s, &mo[q]);
          } else {
            t[q] = __fmul_rn(t[q], s.decay);
            mo[q] = 0.0f;
          }
        }
        th4[v] = make_float4(t[0], t[1], t[2], t[3]);
        m4[v] = make_float4(mo[0], mo[1], mo[2], mo[3]);
        if (!std::is_void<kCopy>::value) {
#pragma unroll
          for (int q = 0; q < 4; ++q)
            StoreCopy<kCopy>(copy, t0 + static_cast<uint64_t>(v) * 4 + q, t[q]);
        }
      }
    } else {
      for (uint64_t i = t0 + threadIdx.x; i < t1; i += blockDim.x) {
        const int sl = slot[i - t0];
        if (sl >= 0 && jb + static_cast<uint64_t>(sl) < k) {
          float mn;
          const float th_i = Point::kReadsTheta ? theta[i] : 0.0f;
          const float t = point(jb + static_cast<uint64_t>(sl), i, th_i, m, s, &mn);
          theta[i] = t;
          m[i] = mn;
          if (!std::is_void<kCopy>::value) StoreCopy<kCopy>(copy, i, t);
        } else {
          if (do_decay) theta[i] = __fmul_rn(theta[i], s.decay);
          m[i] = 0.0f;
          if (!std::is_void<kCopy>::value) StoreCopy<kCopy>(copy, i, theta[i]);
        }
      }
    }
    __syncthreads();
  }
}

// AdamSUpdatePairs: one thread per mask entry j (any order), theta and m only read. An entry
// >= n (a device precondition) is skipped: its pair is not written.
template <typename kType>
__global__ void __launch_bounds__(kThreads)
    PairsKernel(const void* payload, const uint64_t* idx, uint64_t k, const float* theta,
                const float* m, uint64_t n, AdamSScalars s, EnterTable et, float* pairs) {
  const AdamSPointOp<kType> point{payload, et};
  for (uint64_t j = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t i = idx[j];
    if (i >= n) continue;
    float mn;
    const float t = point(j, i, theta[i], m, s, &mn);
    pairs[2 * j] = t;
    pairs[2 * j + 1] = mn;
  }
}

// The blocked order, one CUDA block of kSqNormBlock threads per summation block: every thread
// computes one value (all loads of the block in flight at once) into shared memory, then thread
// 0 adds the values left to right, the contract's sequential order, so the same bits as the CPU.
// (One thread per summation block, as before, issued its 256 dependent gathers one after the
// other: ~0.2 ms for 2600 blocks, latency bound.) Launched with kSqNormBlock threads.
__device__ __forceinline__ double SqNormSumShared(const double* sh, uint64_t count) {
  double acc = sh[0];
  for (uint64_t i = 1; i < count; ++i) acc = __dadd_rn(acc, sh[i]);
  return acc;
}

// Both levels' loop: out[b] = the sum of value(j) over block b of [0, count), one CUDA block of
// kSqNormBlock threads per summation block (grid-stride over the blocks), each thread computing
// one value into shared memory and thread 0 adding them (SqNormSumShared).
template <typename Value>
__device__ __forceinline__ void SumBlocks(uint64_t count, double* out, Value value) {
  __shared__ double sh[kSqNormBlock];
  const uint64_t nblocks = (count + kSqNormBlock - 1) / kSqNormBlock;
  for (uint64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const uint64_t lo = b * kSqNormBlock;
    const uint64_t hi = lo + kSqNormBlock < count ? lo + kSqNormBlock : count;
    const uint64_t j = lo + threadIdx.x;
    if (j < hi) sh[threadIdx.x] = value(j);
    __syncthreads();
    if (threadIdx.x == 0) out[b] = SqNormSumShared(sh, hi - lo);
    __syncthreads();  // sh is rewritten by the next block
  }
}

// Level 0: the squares of the recovered gradients.
template <typename Index, typename kType>
__global__ void __launch_bounds__(kSqNormBlock)
    SqNormLevel0(const void* payload, const Index* mask, uint64_t k, const float* m, uint64_t n,
                 float b1, float omb1, double* out) {
  SumBlocks(k, out, [&](uint64_t j) {
    const uint64_t p = static_cast<uint64_t>(mask[j]);
    const float mp = p < n ? m[p] : 0.0f;
    const float mt = dev::LoadPayload<kType>(payload, j);
    const double gh = static_cast<double>(__fdiv_rn(__fsub_rn(mt, __fmul_rn(b1, mp)), omb1));
    return __dmul_rn(gh, gh);
  });
}

// "segment_rms" staying sums (StayingGradSqBlocks): one thread per block of at most
// kSqNormBlock slots, left to right in double from +0.0, the contract's order.
template <typename kType>
__global__ void StayingBlocksKernel(const void* payload, const uint64_t* idx, const float* m,
                                    uint64_t n, float b1, float omb1, const uint64_t* bounds,
                                    uint64_t nb, double* sums, uint64_t* counts) {
  for (uint64_t b = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; b < nb;
       b += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    double acc = 0.0;
    uint64_t c = 0;
    for (uint64_t j = bounds[b]; j < bounds[b + 1]; ++j) {
      const uint64_t p = idx[j];
      const float mp = p < n ? m[p] : 0.0f;
      if (mp != 0.0f) {
        const float mt = dev::LoadPayload<kType>(payload, j);
        const double gh = static_cast<double>(__fdiv_rn(__fsub_rn(mt, __fmul_rn(b1, mp)), omb1));
        acc = __dadd_rn(acc, __dmul_rn(gh, gh));
        ++c;
      }
    }
    sums[b] = acc;
    counts[b] = c;
  }
}

// Level 0 of a rank's own gradient (GradSqNorm): the squares of the widened gradients.
template <typename kG>
__global__ void __launch_bounds__(kSqNormBlock)
    GradSqLevel0(const void* g, uint64_t n, double* out) {
  SumBlocks(n, out, [&](uint64_t j) {
    const double v = static_cast<double>(dev::LoadPayload<kG>(g, j));
    return __dmul_rn(v, v);
  });
}

// Higher levels: sums of kSqNormBlock partial sums.
__global__ void __launch_bounds__(kSqNormBlock)
    SqNormLevel(const double* in, uint64_t count, double* out) {
  SumBlocks(count, out, [&](uint64_t j) { return in[j]; });
}

template <typename Index, typename kG>
void LaunchCandidate(const float* m, const void* g, float* e, size_t n, float beta1, float omb1,
                     const Index* mask, size_t k, scapeDataType_t type, void* payload, float* c_out,
                     bool keep_rounding, unsigned grid, cudaStream_t stream) {
  dev::VisitPayloadType(type, [&](auto t) {
    using kType = decltype(t);
    if (c_out) {
      CandidateKernel<Index, kType, true, kG><<<grid, kThreads, 0, stream>>>(
          m, g, e, n, beta1, omb1, mask, k, payload, c_out, keep_rounding);
    } else {
      CandidateKernel<Index, kType, false, kG><<<grid, kThreads, 0, stream>>>(
          m, g, e, n, beta1, omb1, mask, k, payload, c_out, keep_rounding);
    }
  });
}

template <typename Index>
KernelStatus CandidateImpl(const float* m, const void* g, float* e, size_t n, float beta1,
                           const Index* mask, size_t k, scapeDataType_t type, void* payload,
                           float* c_out, bool keep_rounding, cudaStream_t stream,
                           scapeDataType_t grad_type, float grad_scale) {
  if (!::scape::dtypes::VisitUnscaledPayload(type, [](auto) {})) return KernelStatus::kUnsupported;
  if (!::scape::dtypes::VisitUnscaledPayload(grad_type, [](auto) {}))
    return KernelStatus::kUnsupported;
  if (k > n) return KernelStatus::kInvalidArgument;
  if (!(grad_scale > 0.0f && grad_scale <= 1.0f)) return KernelStatus::kInvalidArgument;
  if (n > 0 && (m == nullptr || g == nullptr || e == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (k > 0 && (mask == nullptr || payload == nullptr)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  // The gradient's weight, the same rounding as the CPU (one fp32 subtraction, one product;
  // x 1.0f is exact).
  const float omb1 = (1.0f - beta1) * grad_scale;
  const unsigned grid = dev::GridFor(n, kTile);
  dev::VisitPayloadType(grad_type, [&](auto gk) {
    LaunchCandidate<Index, decltype(gk)>(m, g, e, n, beta1, omb1, mask, k, type, payload, c_out,
                                         keep_rounding, grid, stream);
  });
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

template <typename Index, typename Point, typename kCopy>
void LaunchUpdatePass(const Point& point, const Index* mask, size_t k, float* theta, float* m,
                      size_t n, const AdamSScalars& s, void* copy, bool vec, unsigned grid,
                      cudaStream_t stream) {
  if (vec) {
    UpdateKernel<Index, Point, true, kCopy>
        <<<grid, kThreads, 0, stream>>>(point, mask, k, theta, m, n, s, copy);
  } else {
    UpdateKernel<Index, Point, false, kCopy>
        <<<grid, kThreads, 0, stream>>>(point, mask, k, theta, m, n, s, copy);
  }
}

// The update pass over n with `point` at the masked elements; copy: the 16-bit copy's type
// (bf16 or fp16, checked by UpdateArgs), nullptr for none.
template <typename Index, typename Point>
void LaunchUpdatePass(const Point& point, const scapeDataType_t* copy_type, const Index* mask,
                      size_t k, float* theta, float* m, size_t n, const AdamSScalars& s, void* copy,
                      cudaStream_t stream) {
  const unsigned grid = dev::GridFor(n, kUTile);
  const bool vec = (reinterpret_cast<uintptr_t>(theta) | reinterpret_cast<uintptr_t>(m)) % 16 == 0;
  if (copy_type == nullptr) {
    LaunchUpdatePass<Index, Point, void>(point, mask, k, theta, m, n, s, copy, vec, grid, stream);
    return;
  }
  dev::VisitPayloadType(*copy_type, [&](auto ck) {
    if constexpr (!dev::kIsF32<decltype(ck)>)  // fp32 is no copy type (UpdateArgs)
      LaunchUpdatePass<Index, Point, decltype(ck)>(point, mask, k, theta, m, n, s, copy, vec, grid,
                                                   stream);
  });
}

// The update kernels' common checks (the CPU kernels' UpdatePrologue, device form), in this
// order: the payload type (`type` nullptr: the kernel takes none), the 16-bit copy's type (bf16
// or fp16), the AdamS scalars into *s, k <= n.
KernelStatus UpdateArgs(const scapeDataType_t* type, const ModelCopy* copy,
                        const AdamSParams& params, size_t k, size_t n, AdamSScalars* s) {
  if (type && !::scape::dtypes::VisitUnscaledPayload(*type, [](auto) {}))
    return KernelStatus::kUnsupported;
  if (copy && copy->type != scapeBfloat16 && copy->type != scapeFloat16)
    return KernelStatus::kUnsupported;  // bf16 or fp16 only
  if (copy && n > 0 && copy->p == nullptr) return KernelStatus::kInvalidArgument;
  const KernelStatus st = MakeAdamSScalars(params, s);
  if (st != KernelStatus::kOk) return st;
  return k > n ? KernelStatus::kInvalidArgument : KernelStatus::kOk;
}

// The "segment_rms" table of `params` (device pointers here: the runtime uploads them).
KernelStatus EnterTableOf(const AdamSParams& params, EnterTable* et) {
  *et = EnterTable{params.enter_offsets, params.enter_vs, params.enter_nseg};
  const bool bad = et->vs != nullptr && (et->off == nullptr || et->nseg == 0);
  return bad ? KernelStatus::kInvalidArgument : KernelStatus::kOk;
}

template <typename Index>
KernelStatus UpdateImpl(const void* payload, scapeDataType_t type, const Index* mask, size_t k,
                        float* theta, float* m, size_t n, const AdamSParams& params,
                        cudaStream_t stream, const ModelCopy* copy = nullptr) {
  AdamSScalars s;
  KernelStatus st = UpdateArgs(&type, copy, params, k, n, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (k > 0 && (mask == nullptr || payload == nullptr)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  EnterTable et;
  if ((st = EnterTableOf(params, &et)) != KernelStatus::kOk) return st;
  void* cp = copy ? copy->p : nullptr;
  const scapeDataType_t* ct = copy ? &copy->type : nullptr;
  dev::VisitPayloadType(type, [&](auto t) {
    LaunchUpdatePass(AdamSPointOp<decltype(t)>{payload, et}, ct, mask, k, theta, m, n, s, cp,
                     stream);
  });
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

KernelStatus PairsImpl(const void* payload, scapeDataType_t type, const uint64_t* idx, size_t k,
                       const float* theta, const float* m, size_t n, const AdamSParams& params,
                       float* pairs, cudaStream_t stream) {
  AdamSScalars s;
  KernelStatus st = UpdateArgs(&type, nullptr, params, k, n, &s);
  if (st != KernelStatus::kOk) return st;
  if (k > 0 && (payload == nullptr || idx == nullptr || theta == nullptr || m == nullptr ||
                pairs == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  EnterTable et;
  if ((st = EnterTableOf(params, &et)) != KernelStatus::kOk) return st;
  if (k == 0) return KernelStatus::kOk;
  const unsigned grid = dev::GridFor(k, kThreads);
  dev::VisitPayloadType(type, [&](auto t) {
    PairsKernel<decltype(t)>
        <<<grid, kThreads, 0, stream>>>(payload, idx, k, theta, m, n, s, et, pairs);
  });
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

KernelStatus UnpackPairsImpl(const float* pairs, const uint64_t* mask, size_t k, float* theta,
                             float* m, size_t n, const AdamSParams& params, const ModelCopy* copy,
                             cudaStream_t stream) {
  AdamSScalars s;
  const KernelStatus st = UpdateArgs(nullptr, copy, params, k, n, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (k > 0 && (mask == nullptr || pairs == nullptr)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  LaunchUpdatePass(PairsPointOp{pairs}, copy ? &copy->type : nullptr, mask, k, theta, m, n, s,
                   copy ? copy->p : nullptr, stream);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

// The blocked order's temp storage for k level-0 values: the first two levels' partial sums.
size_t SqNormTempBytes(uint64_t k, size_t* a_bytes) {
  const uint64_t l1 = (k + kSqNormBlock - 1) / kSqNormBlock;
  const uint64_t l2 = (l1 + kSqNormBlock - 1) / kSqNormBlock;
  *a_bytes = dev::AlignUp(l1 * sizeof(double));
  return *a_bytes + dev::AlignUp(l2 * sizeof(double)) + 256;
}

// The blocked sum of k level-0 values, with the temp-storage protocol of the *Cuda calls: no
// d_temp: *temp_bytes is set and nothing runs; too little: kBufferTooSmall; args false (the
// caller's argument checks): kInvalidArgument; k == 0: *d_out = 0. Else level0(grid, threads,
// dst) launches the level-0 kernel into dst (d_out when it is the last level), then the higher
// levels run into d_out.
template <typename Level0>
KernelStatus SqNormLevels(uint64_t k, double* d_out, void* d_temp, size_t* temp_bytes, bool args,
                          cudaStream_t stream, Level0 level0) {
  if (temp_bytes == nullptr) return KernelStatus::kInvalidArgument;
  size_t a_bytes = 0;
  const size_t need = SqNormTempBytes(k, &a_bytes);
  if (d_temp == nullptr) {
    *temp_bytes = need;
    return KernelStatus::kOk;
  }
  if (*temp_bytes < need) return KernelStatus::kBufferTooSmall;
  if (!args) return KernelStatus::kInvalidArgument;
  if (k == 0) {
    SCAPE_CUDA_CALL(cudaMemsetAsync(d_out, 0, sizeof(double), stream));
    return KernelStatus::kOk;
  }
  const uint64_t l1 = (k + kSqNormBlock - 1) / kSqNormBlock;
  double* bufs[2] = {static_cast<double*>(d_temp),
                     reinterpret_cast<double*>(static_cast<char*>(d_temp) + a_bytes)};
  constexpr unsigned kSqThreads = kSqNormBlock;  // one CUDA block per summation block
  level0(dev::GridFor(l1, 1, 65535), kSqThreads, l1 == 1 ? d_out : bufs[0]);
  SCAPE_CUDA_LAUNCH_CHECK();
  uint64_t count = l1;
  int src_buf = 0;
  while (count > 1) {
    const uint64_t next = (count + kSqNormBlock - 1) / kSqNormBlock;
    double* out = next == 1 ? d_out : bufs[1 - src_buf];
    SqNormLevel<<<dev::GridFor(next, 1, 65535), kSqThreads, 0, stream>>>(bufs[src_buf], count, out);
    SCAPE_CUDA_LAUNCH_CHECK();
    src_buf = 1 - src_buf;
    count = next;
  }
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus SqNormImpl(const void* payload, scapeDataType_t type, const Index* mask, size_t k,
                        const float* m, size_t n, float beta1, double* d_out, void* d_temp,
                        size_t* temp_bytes, cudaStream_t stream) {
  if (!::scape::dtypes::VisitUnscaledPayload(type, [](auto) {})) return KernelStatus::kUnsupported;
  const bool args = beta1 >= 0.0f && beta1 < 1.0f && d_out != nullptr && k <= n &&
                    (k == 0 || (payload != nullptr && mask != nullptr && m != nullptr));
  const float omb1 = 1.0f - beta1;
  return SqNormLevels(k, d_out, d_temp, temp_bytes, args, stream,
                      [&](unsigned grid, unsigned threads, double* dst) {
                        dev::VisitPayloadType(type, [&](auto t) {
                          SqNormLevel0<Index, decltype(t)><<<grid, threads, 0, stream>>>(
                              payload, mask, k, m, n, beta1, omb1, dst);
                        });
                      });
}

// GradSqNormCuda: the same blocked order over a rank's own (widened) gradients.
KernelStatus GradSqNormImpl(const void* g, scapeDataType_t type, size_t n, double* d_out,
                            void* d_temp, size_t* temp_bytes, cudaStream_t stream) {
  // fp32, bf16, fp16: the gradient types
  if (!::scape::dtypes::VisitUnscaledPayload(type, [](auto) {})) return KernelStatus::kUnsupported;
  const bool args = d_out != nullptr && (n == 0 || g != nullptr);
  return SqNormLevels(n, d_out, d_temp, temp_bytes, args, stream,
                      [&](unsigned grid, unsigned threads, double* dst) {
                        dev::VisitPayloadType(type, [&](auto t) {
                          GradSqLevel0<decltype(t)><<<grid, threads, 0, stream>>>(g, n, dst);
                        });
                      });
}

}  // namespace

KernelStatus StayingGradSqBlocksCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint64_t* d_idx, const float* d_m, size_t n, float beta1,
                                     const uint64_t* d_bounds, size_t nb, double* d_sums,
                                     uint64_t* d_counts, cudaStream_t stream) {
  if (!::scape::dtypes::VisitUnscaledPayload(payload_type, [](auto) {}))
    return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (nb == 0) return KernelStatus::kOk;
  if (d_bounds == nullptr || d_sums == nullptr || d_counts == nullptr || d_idx == nullptr ||
      d_m == nullptr || d_payload == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  const float omb1 = 1.0f - beta1;
  const unsigned grid = dev::GridFor(nb, kThreads);
  dev::VisitPayloadType(payload_type, [&](auto t) {
    StayingBlocksKernel<decltype(t)><<<grid, kThreads, 0, stream>>>(
        d_payload, d_idx, d_m, n, beta1, omb1, d_bounds, nb, d_sums, d_counts);
  });
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

KernelStatus CandidatePackResidualCuda(const float* d_m, const float* d_g, float* d_e, size_t n,
                                       float beta1, const uint32_t* d_mask, size_t k,
                                       scapeDataType_t payload_type, void* d_payload,
                                       float* d_c_out, cudaStream_t stream, bool keep_rounding,
                                       float grad_scale) {
  return CandidateImpl(d_m, d_g, d_e, n, beta1, d_mask, k, payload_type, d_payload, d_c_out,
                       keep_rounding, stream, scapeFloat32, grad_scale);
}
KernelStatus CandidatePackResidualCuda(const float* d_m, const float* d_g, float* d_e, size_t n,
                                       float beta1, const uint64_t* d_mask, size_t k,
                                       scapeDataType_t payload_type, void* d_payload,
                                       float* d_c_out, cudaStream_t stream, bool keep_rounding,
                                       float grad_scale) {
  return CandidateImpl(d_m, d_g, d_e, n, beta1, d_mask, k, payload_type, d_payload, d_c_out,
                       keep_rounding, stream, scapeFloat32, grad_scale);
}

KernelStatus UnpackAdamSUpdateCuda(const void* d_payload, scapeDataType_t payload_type,
                                   const uint32_t* d_mask, size_t k, float* d_theta, float* d_m,
                                   size_t n, const AdamSParams& params, cudaStream_t stream) {
  return UpdateImpl(d_payload, payload_type, d_mask, k, d_theta, d_m, n, params, stream);
}
KernelStatus UnpackAdamSUpdateCuda(const void* d_payload, scapeDataType_t payload_type,
                                   const uint64_t* d_mask, size_t k, float* d_theta, float* d_m,
                                   size_t n, const AdamSParams& params, cudaStream_t stream) {
  return UpdateImpl(d_payload, payload_type, d_mask, k, d_theta, d_m, n, params, stream);
}

KernelStatus CandidatePackResidualGradCuda(const float* d_m, const void* d_g,
                                           scapeDataType_t grad_type, float* d_e, size_t n,
                                           float beta1, const uint64_t* d_mask, size_t k,
                                           scapeDataType_t payload_type, void* d_payload,
                                           float* d_c_out, cudaStream_t stream, bool keep_rounding,
                                           float grad_scale) {
  return CandidateImpl(d_m, d_g, d_e, n, beta1, d_mask, k, payload_type, d_payload, d_c_out,
                       keep_rounding, stream, grad_type, grad_scale);
}

KernelStatus UnpackAdamSUpdateCopyCuda(const void* d_payload, scapeDataType_t payload_type,
                                       const uint64_t* d_mask, size_t k, float* d_theta, float* d_m,
                                       size_t n, const AdamSParams& params, const ModelCopy& copy,
                                       cudaStream_t stream) {
  return UpdateImpl(d_payload, payload_type, d_mask, k, d_theta, d_m, n, params, stream, &copy);
}

KernelStatus AdamSUpdatePairsCuda(const void* d_payload, scapeDataType_t payload_type,
                                  const uint64_t* d_idx, size_t k, const float* d_theta,
                                  const float* d_m, size_t n, const AdamSParams& params,
                                  float* d_pairs, cudaStream_t stream) {
  return PairsImpl(d_payload, payload_type, d_idx, k, d_theta, d_m, n, params, d_pairs, stream);
}

KernelStatus UnpackPairsDecayCuda(const float* d_pairs, const uint64_t* d_mask, size_t k,
                                  float* d_theta, float* d_m, size_t n, const AdamSParams& params,
                                  const ModelCopy* copy, cudaStream_t stream) {
  return UnpackPairsImpl(d_pairs, d_mask, k, d_theta, d_m, n, params, copy, stream);
}

KernelStatus RecoveredGradSqNormCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint32_t* d_mask, size_t k, const float* d_m, size_t n,
                                     float beta1, double* d_sq_norm, void* d_temp,
                                     size_t* temp_bytes, cudaStream_t stream) {
  return SqNormImpl(d_payload, payload_type, d_mask, k, d_m, n, beta1, d_sq_norm, d_temp,
                    temp_bytes, stream);
}
KernelStatus RecoveredGradSqNormCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint64_t* d_mask, size_t k, const float* d_m, size_t n,
                                     float beta1, double* d_sq_norm, void* d_temp,
                                     size_t* temp_bytes, cudaStream_t stream) {
  return SqNormImpl(d_payload, payload_type, d_mask, k, d_m, n, beta1, d_sq_norm, d_temp,
                    temp_bytes, stream);
}

KernelStatus GradSqNormCuda(const void* d_g, scapeDataType_t grad_type, size_t n, double* d_sq_norm,
                            void* d_temp, size_t* temp_bytes, cudaStream_t stream) {
  return GradSqNormImpl(d_g, grad_type, n, d_sq_norm, d_temp, temp_bytes, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
