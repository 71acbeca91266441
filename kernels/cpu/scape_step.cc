// CPU implementation of kernels/cpu/scape_step.h. Built with -ffp-contract=off (see
// kernels/CMakeLists.txt): the bit-exact agreement with the CUDA kernels depends on it.
#include "kernels/cpu/scape_step.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <new>
#include <utility>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/parallel.h"

namespace scape {
namespace kernels {
namespace {

// Elements per thread at least (below twice this a kernel runs on the calling thread).
constexpr size_t kParallelGrain = size_t{1} << 18;

// Payload stores that hand back the value as stored (for the error feedback of 16-bit
// payloads); kExact: the stored value is the argument (fp32).
struct StoreF32 {
  float* p;
  float operator()(size_t j, float v) const {
    p[j] = v;
    return v;
  }
  static constexpr bool kExact = true;
};
struct StoreBf16 {
  uint16_t* p;
  float operator()(size_t j, float v) const {
    const uint16_t h = FloatToBf16(v);
    p[j] = h;
    return Bf16ToFloat(h);
  }
  static constexpr bool kExact = false;
};
struct StoreFp16 {
  uint16_t* p;
  float operator()(size_t j, float v) const {
    const uint16_t h = FloatToFp16(v);
    p[j] = h;
    return Fp16ToFloat(h);
  }
  static constexpr bool kExact = false;
};
struct LoadF32 {
  const float* p;
  float operator()(size_t j) const { return p[j]; }
};
struct LoadBf16 {
  const uint16_t* p;
  float operator()(size_t j) const { return Bf16ToFloat(p[j]); }
};
struct LoadFp16 {
  const uint16_t* p;
  float operator()(size_t j) const { return Fp16ToFloat(p[j]); }
};

// Calls fn with the loader of `type`'s payload (fp32, bf16, else fp16) and returns its result:
// the one place the update kernels dispatch on the payload type.
template <typename F>
bool WithPayloadLoader(scapeDataType_t type, const void* payload, F&& fn) {
  switch (type) {
    case scapeFloat32:
      return fn(LoadF32{static_cast<const float*>(payload)});
    case scapeBfloat16:
      return fn(LoadBf16{static_cast<const uint16_t*>(payload)});
    default:
      return fn(LoadFp16{static_cast<const uint16_t*>(payload)});
  }
}

template <typename Index>
bool ValidMask(const Index* mask, size_t k, size_t n) {
  if (k == 0) return true;
  if (mask == nullptr || k > n) return false;
  uint64_t prev = mask[0];
  if (prev >= n) return false;
  for (size_t j = 1; j < k; ++j) {
    uint64_t cur = mask[j];
    if (cur <= prev) return false;
    prev = cur;
  }
  return prev < n;
}

// Runs body(begin, end, jb, je) on disjoint chunks of [0, n), where [jb, je) are the mask
// entries that fall into [begin, end).
template <typename Index, typename Body>
bool ForMaskChunks(size_t n, const Index* mask, size_t k, int max_threads, Body body) {
  const int nt = detail::ThreadsFor(n, kParallelGrain, max_threads);
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    if (b >= e) return;
    size_t jb = 0, je = k;
    if (nt > 1) {
      auto less = [](Index a, uint64_t v) { return static_cast<uint64_t>(a) < v; };
      jb = static_cast<size_t>(std::lower_bound(mask, mask + k, uint64_t{b}, less) - mask);
      je = e >= n ? k
                  : static_cast<size_t>(std::lower_bound(mask + jb, mask + k, uint64_t{e}, less) -
                                        mask);
    }
    body(b, e, jb, je);
  });
}

// ------------------------------------------------------------------------------------------
// Candidate, pack, residual
// ------------------------------------------------------------------------------------------

inline float Candidate(float m, float g, float e, float b1, float omb1) {
  return ((b1 * m) + (omb1 * g)) + e;
}

void CandidateDense(const float* m, const float* g, float* e, size_t b, size_t end, float b1,
                    float omb1) {
  for (size_t i = b; i < end; ++i) e[i] = Candidate(m[i], g[i], e[i], b1, omb1);
}
void CandidateDenseOut(const float* m, const float* g, float* e, float* c, size_t b, size_t end,
                       float b1, float omb1) {
  for (size_t i = b; i < end; ++i) {
    const float v = Candidate(m[i], g[i], e[i], b1, omb1);
    e[i] = v;
    c[i] = v;
  }
}

// keep_rounding: e at a masked position is the rounding error c - stored (+0 for fp32 and for a
// non-finite stored value), the view kernel's residual; else +0.
template <typename Index, typename Store>
void CandidateChunk(const float* m, const float* g, float* e, float* c_out, size_t b, size_t end,
                    float b1, float omb1, const Index* mask, size_t jb, size_t je, Store store,
                    bool keep_rounding) {
  size_t i = b;
  for (size_t j = jb; j < je; ++j) {
    const size_t p = static_cast<size_t>(mask[j]);
    if (c_out) {
      CandidateDenseOut(m, g, e, c_out, i, p, b1, omb1);
    } else {
      CandidateDense(m, g, e, i, p, b1, omb1);
    }
    const float v = Candidate(m[p], g[p], e[p], b1, omb1);
    const float q = store(j, v);
    e[p] = (Store::kExact || !keep_rounding || !std::isfinite(q)) ? 0.0f : v - q;
    if (c_out) c_out[p] = v;
    i = p + 1;
  }
  if (c_out) {
    CandidateDenseOut(m, g, e, c_out, i, end, b1, omb1);
  } else {
    CandidateDense(m, g, e, i, end, b1, omb1);
  }
}

template <typename Index>
KernelStatus CandidateImpl(const float* m, const float* g, float* e, size_t n, float beta1,
                           const Index* mask, size_t k, scapeDataType_t type, void* payload,
                           float* c_out, int max_threads, bool keep_rounding) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (n > 0 && (m == nullptr || g == nullptr || e == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (k > 0 && payload == nullptr) return KernelStatus::kInvalidArgument;
  if (!ValidMask(mask, k, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  const float b1 = beta1;
  const float omb1 = 1.0f - beta1;
  bool ok = false;
  switch (type) {
    case scapeFloat32: {
      StoreF32 st{static_cast<float*>(payload)};
      ok = ForMaskChunks(n, mask, k, max_threads, [&](size_t b, size_t end, size_t jb, size_t je) {
        CandidateChunk(m, g, e, c_out, b, end, b1, omb1, mask, jb, je, st, keep_rounding);
      });
      break;
    }
    case scapeBfloat16: {
      StoreBf16 st{static_cast<uint16_t*>(payload)};
      ok = ForMaskChunks(n, mask, k, max_threads, [&](size_t b, size_t end, size_t jb, size_t je) {
        CandidateChunk(m, g, e, c_out, b, end, b1, omb1, mask, jb, je, st, keep_rounding);
      });
      break;
    }
    default: {
      StoreFp16 st{static_cast<uint16_t*>(payload)};
      ok = ForMaskChunks(n, mask, k, max_threads, [&](size_t b, size_t end, size_t jb, size_t je) {
        CandidateChunk(m, g, e, c_out, b, end, b1, omb1, mask, jb, je, st, keep_rounding);
      });
      break;
    }
  }
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

// ------------------------------------------------------------------------------------------
// Unpack and AdamS update
// ------------------------------------------------------------------------------------------

inline float RecoveredGrad(float mt, float mp, const AdamSScalars& s) {
  return (mt - (s.b1 * mp)) / s.omb1;
}

inline void AdamSPoint(float mt, float* theta, float* m, const AdamSScalars& s) {
  const float mp = *m;
  const float g = RecoveredGrad(mt, mp, s) * s.clip;
  const float mn = s.rebuild_momentum ? ((s.b1 * mp) + (s.omb1 * g)) : mt;
  const float mpc = mp * s.pscale;
  const float v = (s.b2 * (mpc * mpc)) + (s.omb2 * (g * g));
  const float den = std::sqrt(v * s.vscale) + s.eps;
  *theta = (*theta * s.decay) - ((s.lr * (mn * s.mscale)) / den);
  *m = mn;
}

// AdamSPoint with the "segment_rms" entering rule (AdamSParams.enter_vs): vs is the segment's
// enter_vs value (not finite or <= 0: the paper's form).
inline void AdamSPointEnter(float mt, float* theta, float* m, const AdamSScalars& s, float vs) {
  const float mp = *m;
  if (!(mp == 0.0f && vs > 0.0f && vs <= FLT_MAX)) {
    AdamSPoint(mt, theta, m, s);
    return;
  }
  const float g = RecoveredGrad(mt, mp, s) * s.clip;
  const float mn = s.rebuild_momentum ? ((s.b1 * mp) + (s.omb1 * g)) : mt;
  const float v = s.clip2 * vs;
  const float den = std::sqrt(v * s.vscale) + s.eps;
  float u = (s.lr * (mn * s.mscale)) / den;
  u = u > s.cap_lr ? s.cap_lr : (u < -s.cap_lr ? -s.cap_lr : u);  // NaN stays NaN
  *theta = (*theta * s.decay) - u;
  *m = mn;
}

// The segment of position p under AdamSParams' enter table, with a cursor for ascending p.
struct EnterLookup {
  const uint64_t* off = nullptr;
  const float* vs = nullptr;
  size_t nseg = 0;
  uint64_t lo = 1, hi = 0;  // current segment's [lo, hi) (empty: none yet)
  float cur = -1.0f;
  float operator()(uint64_t p) {
    if (p < lo || p >= hi) {
      const size_t sidx = static_cast<size_t>(std::upper_bound(off, off + nseg + 1, p) - off) - 1;
      lo = off[sidx];
      hi = off[sidx + 1];
      cur = vs[sidx];
    }
    return cur;
  }
};

// The enter table of `p` describes [0, n): nseg >= 1, offsets from 0 to n, non-decreasing.
bool ValidEnter(const AdamSParams& p, size_t n) {
  if (p.enter_vs == nullptr) return true;
  if (p.enter_offsets == nullptr || p.enter_nseg == 0) return false;
  if (p.enter_offsets[0] != 0 || p.enter_offsets[p.enter_nseg] != n) return false;
  for (size_t i = 0; i < p.enter_nseg; ++i)
    if (p.enter_offsets[i + 1] < p.enter_offsets[i]) return false;
  return true;
}

// Calls point(load(j), theta + p, m + p) with the paper's or the entering rule.
template <typename Load>
struct PointFn {
  const AdamSScalars& s;
  Load load;
  bool enter;
  EnterLookup look;
  void operator()(size_t j, size_t p, float* theta, float* m) {
    if (enter) {
      AdamSPointEnter(load(j), theta + p, m + p, s, look(p));
    } else {
      AdamSPoint(load(j), theta + p, m + p, s);
    }
  }
};
template <typename Load>
PointFn<Load> MakePointFn(const AdamSScalars& s, Load load, const AdamSParams& params) {
  PointFn<Load> f{s, load, params.enter_vs != nullptr, EnterLookup{}};
  f.look.off = params.enter_offsets;
  f.look.vs = params.enter_vs;
  f.look.nseg = params.enter_nseg;
  return f;
}

void DecayZeroRun(float* theta, float* m, size_t b, size_t end, float decay, bool do_decay) {
  if (do_decay) {
    for (size_t i = b; i < end; ++i) theta[i] = theta[i] * decay;
  }
  if (end > b) std::fill(m + b, m + end, 0.0f);
}

// The 16-bit model copy of a mixed-precision update (ModelCopy): NoCopy compiles to nothing.
struct NoCopy {
  static constexpr bool kOn = false;
  void operator()(size_t, float) const {}
};
struct CopyBf16 {
  uint16_t* p;
  static constexpr bool kOn = true;
  void operator()(size_t i, float v) const { p[i] = FloatToBf16(v); }
};
struct CopyFp16 {
  uint16_t* p;
  static constexpr bool kOn = true;
  void operator()(size_t i, float v) const { p[i] = FloatToFp16(v); }
};

// kOk, or why the copy cannot be written.
KernelStatus CheckCopy(const ModelCopy* c, size_t n) {
  if (c == nullptr) return KernelStatus::kOk;
  if (c->type != scapeBfloat16 && c->type != scapeFloat16) return KernelStatus::kUnsupported;
  if (n > 0 && c->p == nullptr) return KernelStatus::kInvalidArgument;
  return KernelStatus::kOk;
}

// Calls fn with the copy functor of `c` (NoCopy for nullptr).
template <typename F>
bool WithCopy(const ModelCopy* c, F&& fn) {
  if (c == nullptr) return fn(NoCopy{});
  if (c->type == scapeBfloat16) return fn(CopyBf16{static_cast<uint16_t*>(c->p)});
  return fn(CopyFp16{static_cast<uint16_t*>(c->p)});
}

// Positions [b, end) outside the mask: theta *= decay (when do_decay), the copy of every
// position (also when theta keeps its bits), m = +0 when zero_m.
template <typename Copy>
void DecayRunCopy(float* theta, float* m, size_t b, size_t end, float decay, bool do_decay,
                  bool zero_m, Copy copy) {
  if (!Copy::kOn) {
    if (zero_m) {
      DecayZeroRun(theta, m, b, end, decay, do_decay);
    } else if (do_decay) {
      for (size_t i = b; i < end; ++i) theta[i] = theta[i] * decay;
    }
    return;
  }
  if (do_decay) {
    for (size_t i = b; i < end; ++i) {
      const float t = theta[i] * decay;
      theta[i] = t;
      copy(i, t);
    }
  } else {
    for (size_t i = b; i < end; ++i) copy(i, theta[i]);
  }
  if (zero_m && end > b) std::fill(m + b, m + end, 0.0f);
}

template <typename Index, typename Point, typename Copy>
void UpdateChunk(const Index* mask, size_t jb, size_t je, float* theta, float* m, size_t b,
                 size_t end, const AdamSScalars& s, Point point, Copy copy) {
  const bool do_decay = s.decay != 1.0f;
  size_t i = b;
  for (size_t j = jb; j < je; ++j) {
    const size_t p = static_cast<size_t>(mask[j]);
    DecayRunCopy(theta, m, i, p, s.decay, do_decay, true, copy);
    point(j, p, theta, m);
    copy(p, theta[p]);
    i = p + 1;
  }
  DecayRunCopy(theta, m, i, end, s.decay, do_decay, true, copy);
}

template <typename Index>
KernelStatus UpdateImpl(const void* payload, scapeDataType_t type, const Index* mask, size_t k,
                        float* theta, float* m, size_t n, const AdamSParams& params,
                        int max_threads, const ModelCopy* copy) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if ((st = CheckCopy(copy, n)) != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (k > 0 && payload == nullptr) return KernelStatus::kInvalidArgument;
  if (!ValidMask(mask, k, n)) return KernelStatus::kInvalidArgument;
  if (!ValidEnter(params, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  auto run = [&](auto load) {
    return WithCopy(copy, [&](auto cp) {
      return ForMaskChunks(
          n, mask, k, max_threads, [&](size_t b, size_t end, size_t jb, size_t je) {
            UpdateChunk(mask, jb, je, theta, m, b, end, s, MakePointFn(s, load, params), cp);
          });
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

// ------------------------------------------------------------------------------------------
// Squared norm of the recovered gradient, blocked order
// ------------------------------------------------------------------------------------------

// Sums blocks of kSqNormBlock values of `v` in place until one value is left.
double BlockedReduce(double* v, size_t count) {
  while (count > 1) {
    const size_t out = (count + kSqNormBlock - 1) / kSqNormBlock;
    for (size_t b = 0; b < out; ++b) {
      const size_t lo = b * kSqNormBlock, hi = std::min(count, lo + kSqNormBlock);
      double acc = v[lo];
      for (size_t i = lo + 1; i < hi; ++i) acc = acc + v[i];
      v[b] = acc;
    }
    count = out;
  }
  return count == 1 ? v[0] : 0.0;
}

template <typename Index>
KernelStatus SqNormImpl(const void* payload, scapeDataType_t type, const Index* mask, size_t k,
                        const float* m, size_t n, float beta1, double* sq_norm, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (sq_norm == nullptr) return KernelStatus::kInvalidArgument;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (k > 0 && (payload == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (!ValidMask(mask, k, n)) return KernelStatus::kInvalidArgument;
  if (k == 0) {
    *sq_norm = 0.0;
    return KernelStatus::kOk;
  }
  AdamSScalars s{};
  s.b1 = beta1;
  s.omb1 = 1.0f - beta1;
  const size_t nblocks = (k + kSqNormBlock - 1) / kSqNormBlock;
  std::vector<double> partial;
  try {
    partial.resize(nblocks);
  } catch (...) {
    return KernelStatus::kOutOfMemory;
  }
  auto level0 = [&](auto load) {
    const int nt = detail::ThreadsFor(k, kParallelGrain / 4, max_threads);
    return detail::ParallelRun(nt, [&](int t) {
      const size_t bb = detail::ChunkBegin(nblocks, nt, t, 1);
      const size_t be = detail::ChunkBegin(nblocks, nt, t + 1, 1);
      for (size_t b = bb; b < be; ++b) {
        const size_t lo = b * kSqNormBlock, hi = std::min(k, lo + kSqNormBlock);
        double acc = 0.0;
        for (size_t j = lo; j < hi; ++j) {
          // m[mask[j]] is a gather: prefetch a few entries ahead.
          if (j + 16 < k) __builtin_prefetch(m + mask[j + 16]);
          const double gh = static_cast<double>(RecoveredGrad(load(j), m[mask[j]], s));
          const double sq = gh * gh;
          acc = j == lo ? sq : acc + sq;
        }
        partial[b] = acc;
      }
    });
  };
  const bool ok = WithPayloadLoader(type, payload, level0);
  if (!ok) return KernelStatus::kOutOfMemory;
  *sq_norm = BlockedReduce(partial.data(), nblocks);
  return KernelStatus::kOk;
}

template <typename Load>
void StayingBlock(Load load, const uint64_t* idx, const float* m, const AdamSScalars& s,
                  uint64_t lo, uint64_t hi, double* sum, uint64_t* count) {
  double acc = 0.0;
  uint64_t c = 0;
  for (uint64_t j = lo; j < hi; ++j) {
    const float mp = m[idx[j]];
    if (mp != 0.0f) {  // a staying coordinate; the others add +0.0, which changes nothing
      const double gh = static_cast<double>(RecoveredGrad(load(j), mp, s));
      acc = acc + gh * gh;
      ++c;
    }
  }
  *sum = acc;
  *count = c;
}

}  // namespace

double BlockedSum(double* v, size_t count) { return BlockedReduce(v, count); }

size_t StayingBlockBounds(uint64_t jb, uint64_t je, uint64_t* out) {
  size_t nb = 0;
  for (uint64_t lo = jb; lo < je; lo += kSqNormBlock)
    out[nb++] = std::min<uint64_t>(je, lo + kSqNormBlock);
  return nb;
}

float SegmentEnterVs(double sum, uint64_t count) {
  if (count == 0) return -1.0f;
  const float vs = static_cast<float>(sum / static_cast<double>(count));
  return (vs > 0.0f && vs <= FLT_MAX) ? vs : -1.0f;
}

KernelStatus StayingGradSqBlocks(const void* payload, scapeDataType_t type, const uint64_t* idx,
                                 const float* m, size_t n, float beta1, const uint64_t* bounds,
                                 size_t nb, double* sums, uint64_t* counts, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (nb == 0) return KernelStatus::kOk;
  if (bounds == nullptr || sums == nullptr || counts == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  for (size_t b = 0; b < nb; ++b)
    if (bounds[b + 1] < bounds[b] || bounds[b + 1] - bounds[b] > kSqNormBlock)
      return KernelStatus::kInvalidArgument;
  const uint64_t j0 = bounds[0], j1 = bounds[nb];
  if (j1 > j0 && (payload == nullptr || idx == nullptr || m == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  for (uint64_t j = j0; j < j1; ++j)
    if (idx[j] >= n) return KernelStatus::kInvalidArgument;
  AdamSScalars s{};
  s.b1 = beta1;
  s.omb1 = 1.0f - beta1;
  auto run = [&](auto load) {
    const int nt = detail::ThreadsFor(j1 - j0, kParallelGrain / 4, max_threads);
    return detail::ParallelRun(nt, [&](int t) {
      const size_t bb = detail::ChunkBegin(nb, nt, t, 1);
      const size_t be = detail::ChunkBegin(nb, nt, t + 1, 1);
      for (size_t b = bb; b < be; ++b)
        StayingBlock(load, idx, m, s, bounds[b], bounds[b + 1], &sums[b], &counts[b]);
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

size_t PayloadElementSize(scapeDataType_t type) {
  switch (type) {
    case scapeFloat32:
      return 4;
    case scapeBfloat16:
    case scapeFloat16:
      return 2;
    default:
      return 0;
  }
}

bool MaskIsValid(const uint32_t* mask, size_t k, size_t n) { return ValidMask(mask, k, n); }
bool MaskIsValid(const uint64_t* mask, size_t k, size_t n) { return ValidMask(mask, k, n); }

KernelStatus MakeAdamSScalars(const AdamSParams& p, AdamSScalars* out) {
  if (out == nullptr) return KernelStatus::kInvalidArgument;
  const float fs[] = {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.clip_scale};
  for (float f : fs) {
    if (!std::isfinite(f)) return KernelStatus::kInvalidArgument;
  }
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f)) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.lr < 0.0f || p.eps < 0.0f || !(p.clip_scale > 0.0f)) {
    return KernelStatus::kInvalidArgument;
  }
  double bc1 = 1.0, bc2 = 1.0;
  switch (p.bias_correction) {
    case BiasCorrection::kNone:
      break;
    case BiasCorrection::kAdamSReference:
    case BiasCorrection::kScapeArtifact:
      if (p.step < 1) return KernelStatus::kInvalidArgument;
      bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step));
      bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step));
      if (!(bc1 > 0.0) || !(bc2 > 0.0)) return KernelStatus::kInvalidArgument;
      break;
    default:
      return KernelStatus::kInvalidArgument;
  }
  AdamSScalars s;
  s.b1 = p.beta1;
  s.omb1 = static_cast<float>(1.0 - static_cast<double>(p.beta1));
  s.b2 = p.beta2;
  s.omb2 = static_cast<float>(1.0 - static_cast<double>(p.beta2));
  s.eps = p.eps;
  s.lr = p.lr;
  s.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  s.clip = p.clip_scale;
  s.mscale = 1.0f;
  s.pscale = 1.0f;
  s.vscale = 1.0f;
  if (p.bias_correction == BiasCorrection::kAdamSReference) {
    s.mscale = static_cast<float>(1.0 / bc1);
    s.pscale = s.mscale;
  } else if (p.bias_correction == BiasCorrection::kScapeArtifact) {
    s.mscale = static_cast<float>(1.0 / bc1);
    s.vscale = static_cast<float>(1.0 / bc2);
  }
  s.rebuild_momentum = (p.clip_momentum && p.clip_scale != 1.0f) ? 1 : 0;
  if (!std::isfinite(s.mscale) || !std::isfinite(s.vscale) || !std::isfinite(s.decay)) {
    return KernelStatus::kInvalidArgument;
  }
  s.clip2 = s.clip * s.clip;
  s.cap_lr = s.lr * p.enter_cap;
  if (p.enter_vs != nullptr &&
      !(std::isfinite(p.enter_cap) && p.enter_cap > 0.0f && std::isfinite(s.cap_lr))) {
    return KernelStatus::kInvalidArgument;
  }
  *out = s;
  return KernelStatus::kOk;
}

KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint32_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads,
                                   bool keep_rounding) {
  return CandidateImpl(m, g, e, n, beta1, mask, k, payload_type, payload, c_out, max_threads,
                       keep_rounding);
}
KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint64_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads,
                                   bool keep_rounding) {
  return CandidateImpl(m, g, e, n, beta1, mask, k, payload_type, payload, c_out, max_threads,
                       keep_rounding);
}

KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint32_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads, const ModelCopy* copy) {
  return UpdateImpl(payload, payload_type, mask, k, theta, m, n, params, max_threads, copy);
}
KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint64_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads, const ModelCopy* copy) {
  return UpdateImpl(payload, payload_type, mask, k, theta, m, n, params, max_threads, copy);
}

KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint32_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads) {
  return SqNormImpl(payload, payload_type, mask, k, m, n, beta1, sq_norm, max_threads);
}
KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint64_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads) {
  return SqNormImpl(payload, payload_type, mask, k, m, n, beta1, sq_norm, max_threads);
}

// ------------------------------------------------------------------------------------------
// Mask views (any owner order) and the optimizer's fused passes
// ------------------------------------------------------------------------------------------
namespace {

// Walks positions [b, e) of a view in increasing order: dense(i0, i1, run) for every stretch
// of positions outside the mask (inside one run), point(p, j, run) for every mask entry.
template <typename Dense, typename Point>
void WalkView(const MaskView& v, size_t b, size_t e, Dense dense, Point point) {
  const MaskRun* const rend = v.runs + v.nruns;
  const MaskRun* r = std::upper_bound(v.runs, rend, uint64_t{b},
                                      [](uint64_t x, const MaskRun& run) { return x < run.end; });
  for (; r < rend && r->begin < e; ++r) {
    const uint64_t lo = std::max<uint64_t>(b, r->begin), hi = std::min<uint64_t>(e, r->end);
    const uint64_t* jb = v.idx + r->jb;
    const uint64_t* je = v.idx + r->je;
    if (lo > r->begin) jb = std::lower_bound(jb, je, lo);
    if (hi < r->end) je = std::lower_bound(jb, je, hi);
    size_t i = static_cast<size_t>(lo);
    for (const uint64_t* q = jb; q < je; ++q) {
      const size_t p = static_cast<size_t>(*q);
      if (p > i) dense(i, p, *r);
      point(p, static_cast<size_t>(q - v.idx), *r);
      i = p + 1;
    }
    if (hi > i) dense(i, static_cast<size_t>(hi), *r);
  }
}

template <typename Body>
bool ForChunks(size_t n, int max_threads, Body body) {
  const int nt = detail::ThreadsFor(n, kParallelGrain, max_threads);
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    if (b < e) body(b, e);
  });
}

// Candidate where m is +0: (0 + (omb1*g)) + e, the bits of ((b1*0) + (omb1*g)) + e.
void CandidateDenseNoM(const float* g, float* e, float* c, size_t b, size_t end, float omb1) {
  if (c) {
    for (size_t i = b; i < end; ++i) {
      const float v = (0.0f + (omb1 * g[i])) + e[i];
      e[i] = v;
      c[i] = v;
    }
  } else {
    for (size_t i = b; i < end; ++i) e[i] = (0.0f + (omb1 * g[i])) + e[i];
  }
}

bool SameRuns(const MaskView& a, const MaskView& b) {
  if (a.nruns != b.nruns) return false;
  for (size_t r = 0; r < a.nruns; ++r)
    if (a.runs[r].begin != b.runs[r].begin || a.runs[r].end != b.runs[r].end) return false;
  return true;
}

template <typename Store>
bool CandidateViewRun(const float* m, const float* g, float* e, size_t n, float b1, float omb1,
                      const MaskView& v, Store store, float* stat, int max_threads,
                      const MaskView* support) {
  return ForChunks(n, max_threads, [&](size_t b, size_t end) {
    // The support's entries of the run being walked (a cursor that only moves forward).
    const MaskRun* srun = nullptr;
    const uint64_t *q = nullptr, *qe = nullptr;
    WalkView(
        v, b, end,
        [&](size_t i0, size_t i1, const MaskRun& r) {
          float* c = (stat && (r.flags & kRunOwned)) ? stat : nullptr;
          if (!support) {
            if (c) {
              CandidateDenseOut(m, g, e, c, i0, i1, b1, omb1);
            } else {
              CandidateDense(m, g, e, i0, i1, b1, omb1);
            }
            return;
          }
          if (srun != &r) {
            srun = &r;
            const MaskRun& sr = support->runs[&r - v.runs];
            q = std::lower_bound(support->idx + sr.jb, support->idx + sr.je, uint64_t{i0});
            qe = support->idx + sr.je;
          }
          while (q < qe && *q < i0) ++q;
          size_t i = i0;
          for (; q < qe && *q < i1; ++q) {
            const size_t p = static_cast<size_t>(*q);
            CandidateDenseNoM(g, e, c, i, p, omb1);
            const float val = Candidate(m[p], g[p], e[p], b1, omb1);
            e[p] = val;
            if (c) c[p] = val;
            i = p + 1;
          }
          CandidateDenseNoM(g, e, c, i, i1, omb1);
        },
        [&](size_t p, size_t j, const MaskRun& r) {
          const float c = Candidate(m[p], g[p], e[p], b1, omb1);
          const float q = store(j, c);
          e[p] = (Store::kExact || !std::isfinite(q)) ? 0.0f : c - q;
          if (stat && (r.flags & kRunOwned)) stat[p] = c;
        });
  });
}

}  // namespace

bool MaskViewIsValid(const MaskView& v, size_t n) {
  if (v.k > 0 && v.idx == nullptr) return false;
  if (v.nruns > 0 && v.runs == nullptr) return false;
  if (n == 0) return v.k == 0;
  if (v.nruns == 0 || v.runs[0].begin != 0 || v.runs[v.nruns - 1].end != n) return false;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  try {
    ranges.reserve(v.nruns);
  } catch (...) {
    return false;
  }
  for (size_t r = 0; r < v.nruns; ++r) {
    const MaskRun& run = v.runs[r];
    if (run.begin > run.end || (r + 1 < v.nruns && run.end != v.runs[r + 1].begin)) return false;
    if (run.jb > run.je || run.je > v.k) return false;
    for (uint64_t j = run.jb; j < run.je; ++j) {
      const uint64_t p = v.idx[j];
      if (p < run.begin || p >= run.end || (j > run.jb && p <= v.idx[j - 1])) return false;
    }
    if (run.je > run.jb) ranges.emplace_back(run.jb, run.je);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t next = 0;
  for (const auto& rg : ranges) {
    if (rg.first != next) return false;
    next = rg.second;
  }
  return next == v.k;
}

KernelStatus CandidatePackResidualView(const float* m, const float* g, float* e, size_t n,
                                       float beta1, const MaskView& mask, scapeDataType_t type,
                                       void* payload, float* stat, int max_threads,
                                       const MaskView* support) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (n > 0 && (m == nullptr || g == nullptr || e == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (mask.k > 0 && payload == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskViewIsValid(mask, n)) return KernelStatus::kInvalidArgument;
  if (support && (!MaskViewIsValid(*support, n) || !SameRuns(mask, *support))) {
    return KernelStatus::kInvalidArgument;
  }
  if (n == 0) return KernelStatus::kOk;
  const float b1 = beta1, omb1 = 1.0f - beta1;
  bool ok = false;
  switch (type) {
    case scapeFloat32:
      ok = CandidateViewRun(m, g, e, n, b1, omb1, mask, StoreF32{static_cast<float*>(payload)},
                            stat, max_threads, support);
      break;
    case scapeBfloat16:
      ok = CandidateViewRun(m, g, e, n, b1, omb1, mask, StoreBf16{static_cast<uint16_t*>(payload)},
                            stat, max_threads, support);
      break;
    default:
      ok = CandidateViewRun(m, g, e, n, b1, omb1, mask, StoreFp16{static_cast<uint16_t*>(payload)},
                            stat, max_threads, support);
      break;
  }
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus UnpackAdamSUpdateView(const void* payload, scapeDataType_t type, const MaskView& mask,
                                   float* theta, float* m, size_t n, const AdamSParams& params,
                                   int max_threads, bool keep_m_outside, const ModelCopy* copy) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if ((st = CheckCopy(copy, n)) != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (mask.k > 0 && payload == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskViewIsValid(mask, n)) return KernelStatus::kInvalidArgument;
  if (!ValidEnter(params, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  const bool do_decay = s.decay != 1.0f;
  auto run = [&](auto load) {
    return WithCopy(copy, [&](auto cp) {
      return ForChunks(n, max_threads, [&](size_t b, size_t end) {
        auto point = MakePointFn(s, load, params);
        WalkView(
            mask, b, end,
            [&](size_t i0, size_t i1, const MaskRun&) {
              DecayRunCopy(theta, m, i0, i1, s.decay, do_decay, !keep_m_outside, cp);
            },
            [&](size_t p, size_t j, const MaskRun&) {
              point(j, p, theta, m);
              cp(p, theta[p]);
            });
      });
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus AdamSUpdatePairs(const void* payload, scapeDataType_t type, const uint64_t* idx,
                              size_t k, const float* theta, const float* m, size_t n,
                              const AdamSParams& params, float* pairs, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if (k > 0 && (payload == nullptr || theta == nullptr || m == nullptr || pairs == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (!ValidMask(idx, k, n)) return KernelStatus::kInvalidArgument;
  if (!ValidEnter(params, n)) return KernelStatus::kInvalidArgument;
  auto run = [&](auto load) {
    const int nt = detail::ThreadsFor(k, kParallelGrain / 4, max_threads);
    return detail::ParallelRun(nt, [&](int t) {
      const size_t jb = detail::ChunkBegin(k, nt, t), je = detail::ChunkBegin(k, nt, t + 1);
      auto point = MakePointFn(s, load, params);
      for (size_t j = jb; j < je; ++j) {
        const size_t i = static_cast<size_t>(idx[j]);
        float th = theta[i], mm = m[i];
        point.enter ? AdamSPointEnter(load(j), &th, &mm, s, point.look(i))
                    : AdamSPoint(load(j), &th, &mm, s);
        pairs[2 * j] = th;
        pairs[2 * j + 1] = mm;
      }
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus UnpackPairsDecayView(const float* pairs, const MaskView& mask, float* theta, float* m,
                                  size_t n, const AdamSParams& params, int max_threads,
                                  bool keep_m_outside, const ModelCopy* copy) {
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if ((st = CheckCopy(copy, n)) != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (mask.k > 0 && pairs == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskViewIsValid(mask, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  const bool do_decay = s.decay != 1.0f;
  const bool ok = WithCopy(copy, [&](auto cp) {
    return ForChunks(n, max_threads, [&](size_t b, size_t end) {
      WalkView(
          mask, b, end,
          [&](size_t i0, size_t i1, const MaskRun&) {
            DecayRunCopy(theta, m, i0, i1, s.decay, do_decay, !keep_m_outside, cp);
          },
          [&](size_t p, size_t j, const MaskRun&) {
            theta[p] = pairs[2 * j];
            m[p] = pairs[2 * j + 1];
            cp(p, theta[p]);
          });
    });
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus ZeroOutsideMask(float* m, size_t n, const MaskView& support, const MaskView& mask) {
  if (n > 0 && m == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskViewIsValid(support, n) || !MaskViewIsValid(mask, n) || !SameRuns(support, mask)) {
    return KernelStatus::kInvalidArgument;
  }
  for (size_t r = 0; r < support.nruns; ++r) {
    const uint64_t* a = support.idx + support.runs[r].jb;
    const uint64_t* const ae = support.idx + support.runs[r].je;
    const uint64_t* c = mask.idx + mask.runs[r].jb;
    const uint64_t* const ce = mask.idx + mask.runs[r].je;
    for (; a < ae; ++a) {
      while (c < ce && *c < *a) ++c;
      if (c < ce && *c == *a) continue;
      m[*a] = 0.0f;
    }
  }
  return KernelStatus::kOk;
}

KernelStatus DenseAdamSStep(const float* g, float* theta, float* m, size_t n,
                            const AdamSParams& params, int max_threads) {
  AdamSParams p = params;
  p.bias_correction = BiasCorrection::kNone;
  p.clip_scale = 1.0f;
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(p, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (g == nullptr || theta == nullptr || m == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const bool ok = ForChunks(n, max_threads, [&](size_t b, size_t end) {
    for (size_t i = b; i < end; ++i) {
      const float mp = m[i], gi = g[i];
      const float mn = (s.b1 * mp) + (s.omb1 * gi);
      const float v = (s.b2 * (mp * mp)) + (s.omb2 * (gi * gi));
      theta[i] = (theta[i] * s.decay) - ((s.lr * mn) / (std::sqrt(v) + s.eps));
      m[i] = mn;
    }
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus DenseAdamWStep(const float* g, float* theta, float* m, float* v, size_t n,
                            const AdamSParams& params, int max_threads) {
  AdamSParams p = params;
  p.bias_correction = BiasCorrection::kNone;
  p.clip_scale = 1.0f;
  AdamSScalars s;
  KernelStatus st = MakeAdamSScalars(p, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (g == nullptr || theta == nullptr || m == nullptr || v == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const bool ok = ForChunks(n, max_threads, [&](size_t b, size_t end) {
    for (size_t i = b; i < end; ++i) {
      const float gi = g[i];
      const float mn = (s.b1 * m[i]) + (s.omb1 * gi);
      const float vn = (s.b2 * v[i]) + (s.omb2 * (gi * gi));
      theta[i] = (theta[i] * s.decay) - ((s.lr * mn) / (std::sqrt(vn) + s.eps));
      m[i] = mn;
      v[i] = vn;
    }
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

}  // namespace kernels
}  // namespace scape
