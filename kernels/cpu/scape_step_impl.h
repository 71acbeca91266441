// Internal helpers of the CPU step kernels (scape_step.cc, scape_step_view.cc): payload
// loaders and stores, the AdamS point, the model copy, the chunking and the mask walks. Every
// file that includes it must be built with -ffp-contract=off (kernels/CMakeLists.txt).
#ifndef SCAPE_KERNELS_CPU_SCAPE_STEP_IMPL_H_
#define SCAPE_KERNELS_CPU_SCAPE_STEP_IMPL_H_

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scape_step.h"

namespace scape {
namespace kernels {
namespace step_impl {

// Elements per thread at least (below twice this a kernel runs on the calling thread).
constexpr size_t kParallelGrain = size_t{1} << 18;

// A payload element store / load over the type table's traits (kernels/dtypes.h). The store
// returns the value as stored (v for fp32), for the rounding-error feedback of 16-bit payloads;
// kExact: the stored value is the argument (fp32).
template <typename T>
struct PayloadStore {
  typename T::Storage* p;
  float operator()(size_t j, float v) const {
    const typename T::Storage h = T::Store(v);
    p[j] = h;
    return T::Load(h);
  }
  static constexpr bool kExact = std::is_same<T, dtypes::F32T>::value;
};
template <typename T>
struct PayloadLoad {
  const typename T::Storage* p;
  float operator()(size_t j) const { return T::Load(p[j]); }
};
using StoreF32 = PayloadStore<dtypes::F32T>;

// Calls fn with the loader of `type`'s payload and returns its result (false for a type the
// kernels do not take): the one place the update kernels dispatch on the payload type.
template <typename F>
bool WithPayloadLoader(scapeDataType_t type, const void* payload, F&& fn) {
  bool ok = false;
  dtypes::VisitUnscaledPayload(type, [&](auto tr) {
    using T = decltype(tr);
    ok = fn(PayloadLoad<T>{static_cast<const typename T::Storage*>(payload)});
  });
  return ok;
}

// Calls fn with the store of `type`'s payload and returns its result.
template <typename F>
bool WithPayloadStore(scapeDataType_t type, void* payload, F&& fn) {
  bool ok = false;
  dtypes::VisitUnscaledPayload(type, [&](auto tr) {
    using T = decltype(tr);
    ok = fn(PayloadStore<T>{static_cast<typename T::Storage*>(payload)});
  });
  return ok;
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

inline void CandidateDense(const float* m, const float* g, float* e, size_t b, size_t end, float b1,
                           float omb1) {
  for (size_t i = b; i < end; ++i) e[i] = Candidate(m[i], g[i], e[i], b1, omb1);
}
inline void CandidateDenseOut(const float* m, const float* g, float* e, float* c, size_t b,
                              size_t end, float b1, float omb1) {
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
                           float* c_out, int max_threads, bool keep_rounding, float grad_scale) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(grad_scale > 0.0f && grad_scale <= 1.0f)) return KernelStatus::kInvalidArgument;
  if (n > 0 && (m == nullptr || g == nullptr || e == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (k > 0 && payload == nullptr) return KernelStatus::kInvalidArgument;
  if (!ValidMask(mask, k, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  const float b1 = beta1;
  const float omb1 = (1.0f - beta1) * grad_scale;  // the gradient's weight (x 1.0f: exact)
  bool ok = false;
  const bool visited = WithPayloadStore(type, payload, [&](auto st) {
    ok = ForMaskChunks(n, mask, k, max_threads, [&](size_t b, size_t end, size_t jb, size_t je) {
      CandidateChunk(m, g, e, c_out, b, end, b1, omb1, mask, jb, je, st, keep_rounding);
    });
    return true;
  });
  if (!visited) return KernelStatus::kUnsupported;
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
  if (s.enter_mcap) {  // momentum factor masking: keep one step's worth (NaN stays NaN)
    const float bound = s.omb1 * std::sqrt(v);
    *m = mn > bound ? bound : (mn < -bound ? -bound : mn);
  } else {
    *m = mn;
  }
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
inline bool ValidEnter(const AdamSParams& p, size_t n) {
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

inline void DecayZeroRun(float* theta, float* m, size_t b, size_t end, float decay, bool do_decay) {
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
inline KernelStatus CheckCopy(const ModelCopy* c, size_t n) {
  if (c == nullptr) return KernelStatus::kOk;
  if (c->type != scapeBfloat16 && c->type != scapeFloat16) return KernelStatus::kUnsupported;
  if (n > 0 && c->p == nullptr) return KernelStatus::kInvalidArgument;
  return KernelStatus::kOk;
}

// The update kernels' common checks, in this order: the payload type (`type` nullptr: the
// kernel takes no payload), the AdamS scalars (into *s), the 16-bit model copy. The pointer and
// mask checks, which differ by kernel, follow in each.
inline KernelStatus UpdatePrologue(const scapeDataType_t* type, const AdamSParams& params,
                                   const ModelCopy* copy, size_t n, AdamSScalars* s) {
  if (type != nullptr && PayloadElementSize(*type) == 0) return KernelStatus::kUnsupported;
  const KernelStatus st = MakeAdamSScalars(params, s);
  if (st != KernelStatus::kOk) return st;
  return CheckCopy(copy, n);
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
  AdamSScalars s;
  const KernelStatus st = UpdatePrologue(&type, params, copy, n, &s);
  if (st != KernelStatus::kOk) return st;
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
inline double BlockedReduce(double* v, size_t count) {
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

// m_{t-1} of mask entry j: at its position in a dense m (a gather, prefetched a few entries
// ahead), or slot j of a packed m (mask order).
template <typename Index>
struct MAtMask {
  const float* m;
  const Index* mask;
  size_t k;
  float operator()(size_t j) const {
    if (j + 16 < k) __builtin_prefetch(m + mask[j + 16]);
    return m[mask[j]];
  }
};
struct MAtSlot {
  const float* m;
  float operator()(size_t j) const { return m[j]; }
};

// RecoveredGradSqNorm's sum over k entries, m_{t-1} of entry j from mget(j). Arguments checked.
template <typename MGet>
KernelStatus SqNormCore(const void* payload, scapeDataType_t type, MGet mget, size_t k, float beta1,
                        double* sq_norm, int max_threads) {
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
          const double gh = static_cast<double>(RecoveredGrad(load(j), mget(j), s));
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

template <typename Index>
KernelStatus SqNormImpl(const void* payload, scapeDataType_t type, const Index* mask, size_t k,
                        const float* m, size_t n, float beta1, double* sq_norm, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (sq_norm == nullptr) return KernelStatus::kInvalidArgument;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (k > 0 && (payload == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (!ValidMask(mask, k, n)) return KernelStatus::kInvalidArgument;
  return SqNormCore(payload, type, MAtMask<Index>{m, mask, k}, k, beta1, sq_norm, max_threads);
}

// StayingGradSqBlocks' sums, m_{t-1} of slot j from mget(j). Arguments checked.
template <typename MGet>
KernelStatus StayingCore(const void* payload, scapeDataType_t type, MGet mget, float beta1,
                         const uint64_t* bounds, size_t nb, double* sums, uint64_t* counts,
                         int max_threads) {
  AdamSScalars s{};
  s.b1 = beta1;
  s.omb1 = 1.0f - beta1;
  const uint64_t j0 = bounds[0], j1 = bounds[nb];
  auto run = [&](auto load) {
    const int nt = detail::ThreadsFor(j1 - j0, kParallelGrain / 4, max_threads);
    return detail::ParallelRun(nt, [&](int t) {
      const size_t bb = detail::ChunkBegin(nb, nt, t, 1);
      const size_t be = detail::ChunkBegin(nb, nt, t + 1, 1);
      for (size_t b = bb; b < be; ++b) {
        double acc = 0.0;
        uint64_t c = 0;
        for (uint64_t j = bounds[b]; j < bounds[b + 1]; ++j) {
          const float mp = mget(j);
          if (mp != 0.0f) {  // a staying coordinate; the others add +0.0, which changes nothing
            const double gh = static_cast<double>(RecoveredGrad(load(j), mp, s));
            acc = acc + gh * gh;
            ++c;
          }
        }
        sums[b] = acc;
        counts[b] = c;
      }
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

// StayingGradSqBlocks' checks of the blocks; kOk with nothing to do when nb == 0.
inline KernelStatus CheckStayingBlocks(scapeDataType_t type, float beta1, const uint64_t* bounds,
                                       size_t nb, double* sums, uint64_t* counts) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (nb == 0) return KernelStatus::kOk;
  if (bounds == nullptr || sums == nullptr || counts == nullptr) {
    return KernelStatus::kInvalidArgument;
  }
  for (size_t b = 0; b < nb; ++b)
    if (bounds[b + 1] < bounds[b] || bounds[b + 1] - bounds[b] > kSqNormBlock)
      return KernelStatus::kInvalidArgument;
  return KernelStatus::kOk;
}

// Runs body(begin, end) on disjoint chunks of [0, n).
template <typename Body>
bool ForChunks(size_t n, int max_threads, Body body) {
  const int nt = detail::ThreadsFor(n, kParallelGrain, max_threads);
  return detail::ParallelRun(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    if (b < e) body(b, e);
  });
}

}  // namespace step_impl
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_SCAPE_STEP_IMPL_H_
