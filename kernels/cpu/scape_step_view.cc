// CPU implementation of the mask-view kernels of kernels/cpu/scape_step.h (the optimizer's
// fused passes at masks in any owner order, and the packed momentum). Built with
// -ffp-contract=off (see kernels/CMakeLists.txt): the bit-exact agreement with the CUDA
// kernels depends on it.
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/scape_step_impl.h"

namespace scape {
namespace kernels {

using namespace step_impl;  // NOLINT: this file is its implementation

// ------------------------------------------------------------------------------------------
// Mask views (any owner order) and the optimizer's fused passes
// ------------------------------------------------------------------------------------------
namespace {

// The first run of v that ends after position b: where a chunk [b, ...) starts.
const MaskRun* FirstRunAfter(const MaskView& v, uint64_t b) {
  return std::upper_bound(v.runs, v.runs + v.nruns, b,
                          [](uint64_t x, const MaskRun& run) { return x < run.end; });
}

// Run r of view v (and the run of view w at the same index, the views having the same runs)
// inside the chunk [b, end): positions [lo, hi), and the entries of each view from lo on,
// [q, qe) of v and [s, se) of w (qe and se still the runs' ends).
struct RunPair {
  uint64_t lo, hi;
  const uint64_t *q, *qe, *s, *se;
};
RunPair RunPairIn(const MaskView& v, const MaskRun* r, const MaskView& w, uint64_t b,
                  uint64_t end) {
  const MaskRun& wr = w.runs[r - v.runs];
  RunPair x;
  x.lo = std::max<uint64_t>(b, r->begin);
  x.hi = std::min<uint64_t>(end, r->end);
  x.q = v.idx + r->jb;
  x.qe = v.idx + r->je;
  x.s = w.idx + wr.jb;
  x.se = w.idx + wr.je;
  if (x.lo > r->begin) {
    x.q = std::lower_bound(x.q, x.qe, x.lo);
    x.s = std::lower_bound(x.s, x.se, x.lo);
  }
  return x;
}

// Walks positions [b, e) of a view in increasing order: dense(i0, i1, run) for every stretch
// of positions outside the mask (inside one run), point(p, j, run) for every mask entry.
template <typename Dense, typename Point>
void WalkView(const MaskView& v, size_t b, size_t e, Dense dense, Point point) {
  const MaskRun* const rend = v.runs + v.nruns;
  for (const MaskRun* r = FirstRunAfter(v, b); r < rend && r->begin < e; ++r) {
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
    if (run.je > run.jb) {
      // Strictly increasing, the first entry >= begin and the last < end: every entry is inside
      // the run. The comparisons are accumulated without a branch per entry.
      const uint64_t* x = v.idx + run.jb;
      const size_t cnt = static_cast<size_t>(run.je - run.jb);
      if (x[0] < run.begin || x[cnt - 1] >= run.end) return false;
      bool bad = false;
      for (size_t t = 1; t < cnt; ++t) bad |= x[t] <= x[t - 1];
      if (bad) return false;
      ranges.emplace_back(run.jb, run.je);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t next = 0;
  for (const auto& rg : ranges) {
    if (rg.first != next) return false;
    next = rg.second;
  }
  return next == v.k;
}

bool CheckMaskView(const MaskView& v, size_t n, CheckedMaskView* out) {
  if (out == nullptr) return false;
  *out = CheckedMaskView();
  if (!MaskViewIsValid(v, n)) return false;
  out->v_ = v;
  out->n_ = n;
  out->valid_ = true;
  return true;
}

namespace {
bool Vouched(const CheckedMaskView& c, size_t n) { return c.valid() && c.n() == n; }
}  // namespace

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
  const bool ok = WithPayloadStore(type, payload, [&](auto store) {
    return CandidateViewRun(m, g, e, n, b1, omb1, mask, store, stat, max_threads, support);
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus UnpackAdamSUpdateView(const void* payload, scapeDataType_t type, const MaskView& mask,
                                   float* theta, float* m, size_t n, const AdamSParams& params,
                                   int max_threads, bool keep_m_outside, const ModelCopy* copy) {
  AdamSScalars s;
  const KernelStatus st = UpdatePrologue(&type, params, copy, n, &s);
  if (st != KernelStatus::kOk) return st;
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

namespace {

// AdamSUpdatePairs; packed: m_{t-1} of entry j is m[j], else m[idx[j]].
KernelStatus PairsImpl(const void* payload, scapeDataType_t type, const uint64_t* idx, size_t k,
                       const float* theta, const float* m, size_t n, const AdamSParams& params,
                       float* pairs, int max_threads, bool packed) {
  AdamSScalars s;
  const KernelStatus st = UpdatePrologue(&type, params, nullptr, n, &s);
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
        float th = theta[i], mm = m[packed ? j : i];
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

// UnpackPairsDecayView; packed: m_t of entry j goes to m[j] (and m outside the mask is not
// written), else to m[idx[j]].
KernelStatus UnpackPairsImpl(const float* pairs, const MaskView& mask, float* theta, float* m,
                             size_t n, const AdamSParams& params, int max_threads,
                             bool keep_m_outside, const ModelCopy* copy, bool packed,
                             bool checked = false) {
  AdamSScalars s;
  const KernelStatus st = UpdatePrologue(nullptr, params, copy, n, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (theta == nullptr || (m == nullptr && (!packed || mask.k > 0)))) {
    return KernelStatus::kInvalidArgument;
  }
  if (mask.k > 0 && pairs == nullptr) return KernelStatus::kInvalidArgument;
  if (!checked && !MaskViewIsValid(mask, n)) return KernelStatus::kInvalidArgument;
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
            m[packed ? j : p] = pairs[2 * j + 1];
            cp(p, theta[p]);
          });
    });
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

}  // namespace

KernelStatus AdamSUpdatePairs(const void* payload, scapeDataType_t type, const uint64_t* idx,
                              size_t k, const float* theta, const float* m, size_t n,
                              const AdamSParams& params, float* pairs, int max_threads) {
  return PairsImpl(payload, type, idx, k, theta, m, n, params, pairs, max_threads, false);
}
KernelStatus AdamSUpdatePairsPacked(const void* payload, scapeDataType_t type, const uint64_t* idx,
                                    size_t k, const float* theta, const float* m, size_t n,
                                    const AdamSParams& params, float* pairs, int max_threads) {
  return PairsImpl(payload, type, idx, k, theta, m, n, params, pairs, max_threads, true);
}

KernelStatus UnpackPairsDecayView(const float* pairs, const MaskView& mask, float* theta, float* m,
                                  size_t n, const AdamSParams& params, int max_threads,
                                  bool keep_m_outside, const ModelCopy* copy) {
  return UnpackPairsImpl(pairs, mask, theta, m, n, params, max_threads, keep_m_outside, copy,
                         false);
}
KernelStatus UnpackPairsDecayPacked(const float* pairs, const MaskView& mask, float* theta,
                                    float* m, size_t n, const AdamSParams& params, int max_threads,
                                    const ModelCopy* copy) {
  return UnpackPairsImpl(pairs, mask, theta, m, n, params, max_threads, true, copy, true);
}
KernelStatus UnpackPairsDecayPacked(const float* pairs, const CheckedMaskView& mask, float* theta,
                                    float* m, size_t n, const AdamSParams& params, int max_threads,
                                    const ModelCopy* copy) {
  if (!Vouched(mask, n)) return KernelStatus::kInvalidArgument;
  return UnpackPairsImpl(pairs, mask.view(), theta, m, n, params, max_threads, true, copy, true,
                         true);
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

// ------------------------------------------------------------------------------------------
// Packed momentum (m stored at the mask only, in mask order)
// ------------------------------------------------------------------------------------------
namespace {

// Positions per block of the packed update: the decay, the masked points and the model copy
// of one block run while it is in cache.
constexpr size_t kUpdateBlock = 8192;
// Masked points computed at once (contiguous scratch, so the arithmetic vectorises).
constexpr size_t kUpdateBatch = 256;

// The paper's AdamS form (AdamSPoint) on cnt points at once: mt = m_t as reduced, th = theta
// (already decayed: the caller's s.decay is 1), m = m_{t-1} in, m_t out. The same operations
// in the same order as AdamSPoint, each rounded separately (-ffp-contract=off), so the bits
// are AdamSPoint's; written over contiguous arrays with loop-invariant scalars so that the
// compiler vectorises it (IEEE sqrtps / divps; -fno-math-errno, kernels/CMakeLists.txt).
void AdamSBatch(const float* __restrict mt, float* __restrict th, float* __restrict m, size_t cnt,
                const AdamSScalars& s) {
  const float b1 = s.b1, omb1 = s.omb1, b2 = s.b2, omb2 = s.omb2, eps = s.eps, lr = s.lr;
  const float clip = s.clip, mscale = s.mscale, pscale = s.pscale, vscale = s.vscale;
  const float decay = s.decay;
  if (s.rebuild_momentum) {
    for (size_t t = 0; t < cnt; ++t) {
      const float mp = m[t];
      const float g = ((mt[t] - (b1 * mp)) / omb1) * clip;
      const float mn = (b1 * mp) + (omb1 * g);
      const float mpc = mp * pscale;
      const float v = (b2 * (mpc * mpc)) + (omb2 * (g * g));
      const float den = std::sqrt(v * vscale) + eps;
      th[t] = (th[t] * decay) - ((lr * (mn * mscale)) / den);
      m[t] = mn;
    }
  } else {
    for (size_t t = 0; t < cnt; ++t) {
      const float mp = m[t];
      const float g = ((mt[t] - (b1 * mp)) / omb1) * clip;
      const float mn = mt[t];
      const float mpc = mp * pscale;
      const float v = (b2 * (mpc * mpc)) + (omb2 * (g * g));
      const float den = std::sqrt(v * vscale) + eps;
      th[t] = (th[t] * decay) - ((lr * (mn * mscale)) / den);
      m[t] = mn;
    }
  }
}

// The candidate pass with a packed momentum, block by block (kUpdateBlock positions): the
// residual at the support's and the mask's entries is saved, the whole block takes the form
// with m = +0 (a vectorised pass at memory speed), then the entries are recomputed from the
// saved residual with their momentum. Every value is computed once from the original inputs,
// with the operations of Candidate: the bits are CandidateViewRun's.
// gather (CandidateGatherPacked): m_mask is written first, block by block, with m_{t-1} at the
// mask's entries (MomentumGather's values: the support's values are scattered into a zeroed
// block-sized scratch, read back at the mask's entries, and the scratch is zeroed again), so
// the index lists are read once while they are in cache. same: the support is the mask (the
// mask did not move; m_mask is m_sup), whose entries the mask loop computes, so the support
// loop is skipped (it would write the same candidate values that the mask loop overwrites).
template <typename Store>
bool CandidatePackedBlocks(float* m_mask, const MaskView& sup, const float* m_sup, const float* g,
                           float* e, size_t n, float b1, float omb1, const MaskView& v, Store store,
                           float* stat, int max_threads, bool gather, bool same) {
  return ForChunks(n, max_threads, [&](size_t b, size_t end) {
    float es[kUpdateBlock], em[kUpdateBlock], mz[kUpdateBlock];
    if (gather) std::fill(mz, mz + kUpdateBlock, 0.0f);
    const MaskRun* const rend = v.runs + v.nruns;
    for (const MaskRun* r = FirstRunAfter(v, b); r < rend && r->begin < end; ++r) {
      float* c = (stat && (r->flags & kRunOwned)) ? stat : nullptr;
      const RunPair rp = RunPairIn(v, r, sup, b, end);
      const uint64_t lo = rp.lo, hi = rp.hi;
      const uint64_t *q = rp.q, *qe = rp.qe, *s = rp.s, *se = rp.se;
      for (uint64_t s0 = lo; s0 < hi; s0 += kUpdateBlock) {
        const uint64_t s1 = std::min<uint64_t>(hi, s0 + kUpdateBlock);
        const uint64_t* qz = q;
        while (qz < qe && *qz < s1) ++qz;
        const uint64_t* sz = s;
        while (sz < se && *sz < s1) ++sz;
        const size_t nq = static_cast<size_t>(qz - q), ns = static_cast<size_t>(sz - s);
        if (gather) {
          const float* ms = m_sup + (s - sup.idx);
          float* mq = m_mask + (q - v.idx);
          for (size_t t = 0; t < ns; ++t) mz[s[t] - s0] = ms[t];
          for (size_t t = 0; t < nq; ++t) mq[t] = mz[q[t] - s0];
          for (size_t t = 0; t < ns; ++t) mz[s[t] - s0] = 0.0f;
        }
        for (size_t t = 0; t < nq; ++t) em[t] = e[q[t]];
        if (!same)
          for (size_t t = 0; t < ns; ++t) es[t] = e[s[t]];
        CandidateDenseNoM(g, e, c, s0, s1, omb1);
        for (size_t t = 0; t < (same ? 0 : ns); ++t) {
          const size_t p = static_cast<size_t>(s[t]);
          const float val = Candidate(m_sup[s + t - sup.idx], g[p], es[t], b1, omb1);
          e[p] = val;
          if (c) c[p] = val;
        }
        for (size_t t = 0; t < nq; ++t) {
          const size_t p = static_cast<size_t>(q[t]);
          const size_t j = static_cast<size_t>(q + t - v.idx);
          const float val = Candidate(m_mask[j], g[p], em[t], b1, omb1);
          const float st = store(j, val);
          e[p] = (Store::kExact || !std::isfinite(st)) ? 0.0f : val - st;
          if (c) c[p] = val;
        }
        q = qz;
        s = sz;
      }
    }
  });
}

}  // namespace

KernelStatus MomentumGather(const MaskView& from, const float* m_from, const MaskView& to,
                            float* m_to, size_t n, int max_threads) {
  if ((from.k > 0 && m_from == nullptr) || (to.k > 0 && m_to == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (!MaskViewIsValid(from, n) || !MaskViewIsValid(to, n) || !SameRuns(from, to)) {
    return KernelStatus::kInvalidArgument;
  }
  if (to.k == 0) return KernelStatus::kOk;
  const bool ok = ForChunks(n, max_threads, [&](size_t b, size_t e) {
    const MaskRun* const rend = to.runs + to.nruns;
    for (const MaskRun* r = FirstRunAfter(to, b); r < rend && r->begin < e; ++r) {
      const RunPair rp = RunPairIn(to, r, from, b, e);
      const uint64_t hi = rp.hi;
      const uint64_t *c = rp.q, *ce = rp.qe, *a = rp.s, *ae = rp.se;
      if (hi < r->end) ce = std::lower_bound(c, ce, hi);
      // A branch-free merge: the entering entries stay +0, the staying ones take their value.
      float* out = m_to + (c - to.idx);
      const float* in = m_from + (a - from.idx);
      const size_t nc = static_cast<size_t>(ce - c), na = static_cast<size_t>(ae - a);
      std::fill(out, out + nc, 0.0f);
      size_t i = 0, j = 0;
      while (i < na && j < nc) {
        const uint64_t x = a[i], y = c[j];
        out[j] = x == y ? in[i] : out[j];
        i += x <= y;
        j += y <= x;
      }
    }
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus CandidatePackResidualPacked(const float* m_mask, const MaskView& support,
                                         const float* m_support, const float* g, float* e, size_t n,
                                         float beta1, const MaskView& mask, scapeDataType_t type,
                                         void* payload, float* stat, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (n > 0 && (g == nullptr || e == nullptr)) return KernelStatus::kInvalidArgument;
  if (mask.k > 0 && (payload == nullptr || m_mask == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (support.k > 0 && m_support == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskViewIsValid(mask, n) || !MaskViewIsValid(support, n) || !SameRuns(mask, support)) {
    return KernelStatus::kInvalidArgument;
  }
  if (n == 0) return KernelStatus::kOk;
  const float b1 = beta1, omb1 = 1.0f - beta1;
  const bool ok = WithPayloadStore(type, payload, [&](auto store) {
    return CandidatePackedBlocks(const_cast<float*>(m_mask), support, m_support, g, e, n, b1, omb1,
                                 mask, store, stat, max_threads, false, false);
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus CandidateGatherPacked(const CheckedMaskView& support, const float* m_support,
                                   const float* g, float* e, size_t n, float beta1,
                                   const CheckedMaskView& mask, float* m_mask, scapeDataType_t type,
                                   void* payload, float* stat, int max_threads, float grad_scale) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (!(grad_scale > 0.0f && grad_scale <= 1.0f)) return KernelStatus::kInvalidArgument;
  if (!Vouched(mask, n) || !Vouched(support, n)) return KernelStatus::kInvalidArgument;
  const MaskView &v = mask.view(), &sv = support.view();
  if (n > 0 && (g == nullptr || e == nullptr)) return KernelStatus::kInvalidArgument;
  if (v.k > 0 && (payload == nullptr || m_mask == nullptr)) return KernelStatus::kInvalidArgument;
  if (sv.k > 0 && m_support == nullptr) return KernelStatus::kInvalidArgument;
  if (!SameRuns(v, sv)) return KernelStatus::kInvalidArgument;
  const bool same = v.idx == sv.idx && v.k == sv.k && v.runs == sv.runs;
  if (same && v.k > 0 && m_mask != m_support) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  // The gradient's weight (omb1 weighs only g in the candidate; x 1.0f is exact).
  const float b1 = beta1, omb1 = (1.0f - beta1) * grad_scale;
  const bool ok = WithPayloadStore(type, payload, [&](auto store) {
    return CandidatePackedBlocks(m_mask, sv, m_support, g, e, n, b1, omb1, v, store, stat,
                                 max_threads, !same, same);
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

namespace {

KernelStatus UpdatePackedImpl(const void* payload, scapeDataType_t type, const MaskView& mask,
                              float* theta, float* m, size_t n, const AdamSParams& params,
                              int max_threads, const ModelCopy* copy, bool checked) {
  AdamSScalars s;
  const KernelStatus st = UpdatePrologue(&type, params, copy, n, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && theta == nullptr) return KernelStatus::kInvalidArgument;
  if (mask.k > 0 && (payload == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  if (!checked && !MaskViewIsValid(mask, n)) return KernelStatus::kInvalidArgument;
  if (!ValidEnter(params, n)) return KernelStatus::kInvalidArgument;
  if (n == 0) return KernelStatus::kOk;
  const bool do_decay = s.decay != 1.0f;
  // Every position of a block is decayed first (theta*decay, rounded: the first operation of
  // the update), then the masked points subtract their step from it: the bits of
  // (theta*decay) - u. sp: the scalars of the masked points, whose theta is decayed already.
  AdamSScalars sp = s;
  sp.decay = 1.0f;
  const bool enter = params.enter_vs != nullptr;
  auto run = [&](auto load) {
    return WithCopy(copy, [&](auto cp) {
      return ForChunks(n, max_threads, [&](size_t b, size_t end) {
        float th[kUpdateBatch], mt[kUpdateBatch];
        EnterLookup look{params.enter_offsets, params.enter_vs, params.enter_nseg};
        const MaskRun* const rend = mask.runs + mask.nruns;
        for (const MaskRun* r = FirstRunAfter(mask, b); r < rend && r->begin < end; ++r) {
          const uint64_t lo = std::max<uint64_t>(b, r->begin), hi = std::min<uint64_t>(end, r->end);
          const uint64_t *q = mask.idx + r->jb, *qe = mask.idx + r->je;
          if (lo > r->begin) q = std::lower_bound(q, qe, lo);
          if (hi < r->end) qe = std::lower_bound(q, qe, hi);
          for (uint64_t s0 = lo; s0 < hi; s0 += kUpdateBlock) {
            const uint64_t s1 = std::min<uint64_t>(hi, s0 + kUpdateBlock);
            if (do_decay)
              for (size_t i = s0; i < s1; ++i) theta[i] = theta[i] * s.decay;
            const uint64_t* qz = s1 == hi ? qe : std::lower_bound(q, qe, s1);
            for (; q < qz;) {
              const size_t cnt = std::min<size_t>(kUpdateBatch, static_cast<size_t>(qz - q));
              const size_t j0 = static_cast<size_t>(q - mask.idx);
              for (size_t t = 0; t < cnt; ++t) {
                th[t] = theta[q[t]];
                mt[t] = load(j0 + t);
              }
              if (enter) {
                for (size_t t = 0; t < cnt; ++t)
                  AdamSPointEnter(mt[t], &th[t], &m[j0 + t], sp, look(q[t]));
              } else {
                AdamSBatch(mt, th, m + j0, cnt, sp);
              }
              for (size_t t = 0; t < cnt; ++t) theta[q[t]] = th[t];
              q += cnt;
            }
            if (decltype(cp)::kOn)
              for (size_t i = s0; i < s1; ++i) cp(i, theta[i]);
          }
        }
      });
    });
  };
  const bool ok = WithPayloadLoader(type, payload, run);
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

}  // namespace

KernelStatus UnpackAdamSUpdatePacked(const void* payload, scapeDataType_t type,
                                     const MaskView& mask, float* theta, float* m, size_t n,
                                     const AdamSParams& params, int max_threads,
                                     const ModelCopy* copy) {
  return UpdatePackedImpl(payload, type, mask, theta, m, n, params, max_threads, copy, false);
}
KernelStatus UnpackAdamSUpdatePacked(const void* payload, scapeDataType_t type,
                                     const CheckedMaskView& mask, float* theta, float* m, size_t n,
                                     const AdamSParams& params, int max_threads,
                                     const ModelCopy* copy) {
  if (!Vouched(mask, n)) return KernelStatus::kInvalidArgument;
  return UpdatePackedImpl(payload, type, mask.view(), theta, m, n, params, max_threads, copy, true);
}

}  // namespace kernels
}  // namespace scape
