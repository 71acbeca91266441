#include "plugin/optim/optim.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <thread>

#include "base/clock.h"
#include "kernels/cpu/dtype.h"
#include "kernels/cpu/finite.h"
#include "kernels/cpu/kernel_status.h"
#include "plugin/coll/coll.h"
#include "plugin/optim/optim_device.h"
#include "plugin/optim/optim_internal.h"

namespace scape {
namespace {

using optim_internal::Fnv;

Status KernelError(const char* what, kernels::KernelStatus ks) {
  return Status(
      ks == kernels::KernelStatus::kInvalidArgument ? scapeInternalError : kernels::ToResult(ks),
      StrFormat("%s kernel failed: %s", what, kernels::KernelStatusString(ks)));
}

// Ring volume one rank sends for an all-reduce / reduce-scatter or all-gather of `bytes`.
uint64_t RingAllReduce(uint64_t bytes, int p) { return p <= 1 ? 0 : 2 * bytes * (p - 1) / p; }
uint64_t RingHalf(uint64_t bytes, int p) { return p <= 1 ? 0 : bytes * (p - 1) / p; }

// A mask in mask order with its runs, as the kernels take it.
kernels::MaskView ViewOf(const std::vector<uint64_t>& idx,
                         const std::vector<kernels::MaskRun>& runs) {
  kernels::MaskView v;
  v.idx = idx.data();
  v.k = idx.size();
  v.runs = runs.data();
  v.nruns = runs.size();
  return v;
}

double Seconds(int64_t t0) { return static_cast<double>(NowNs() - t0) * 1e-9; }

}  // namespace

kernels::BiasCorrection KernelBias(scapeBiasCorrection_t b) {
  switch (b) {
    case scapeBiasCorrectionAdamS:
      return kernels::BiasCorrection::kAdamSReference;
    case scapeBiasCorrectionArtifact:
      return kernels::BiasCorrection::kScapeArtifact;
    default:
      return kernels::BiasCorrection::kNone;
  }
}

Status ValidateHyper(const OptimHyper& h) {
  auto bad = [](const char* f, double v, const char* want) {
    return InvalidArgument(StrFormat("%s = %g: expected %s", f, v, want));
  };
  if (!(std::isfinite(h.lr) && h.lr >= 0.0f)) return bad("lr", h.lr, "a finite value >= 0");
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f)) return bad("beta1", h.beta1, "0 <= beta1 < 1");
  if (!(h.beta2 >= 0.0f && h.beta2 < 1.0f)) return bad("beta2", h.beta2, "0 <= beta2 < 1");
  if (!(std::isfinite(h.eps) && h.eps >= 0.0f)) return bad("eps", h.eps, "a finite value >= 0");
  if (!(std::isfinite(h.weightDecay) && h.weightDecay >= 0.0f))
    return bad("weightDecay", h.weightDecay, "a finite value >= 0");
  if (!(std::isfinite(h.maxGradNorm) && h.maxGradNorm >= 0.0f))
    return bad("maxGradNorm", h.maxGradNorm, "a finite value >= 0 (0: no clipping)");
  if (h.bias < 0 || h.bias >= scapeNumBiasCorrections)
    return InvalidArgument(
        StrFormat("biasCorrection = %d: expected a scapeBiasCorrection_t (0..%d)", h.bias,
                  scapeNumBiasCorrections - 1));
  if (!(h.density > 0.0 && h.density <= 1.0)) return bad("density", h.density, "0 < density <= 1");
  if (h.warmupSteps < 0)
    return InvalidArgument(
        StrFormat("warmupSteps = %lld: expected >= 0", static_cast<long long>(h.warmupSteps)));
  if (h.payload != scapeFloat32 && h.payload != scapeBfloat16 && h.payload != scapeFloat16)
    return InvalidArgument(
        StrFormat("payloadType = %d: expected scapeFloat32, scapeBfloat16 or "
                  "scapeFloat16",
                  h.payload));
  if (h.entering < 0 || h.entering >= scapeNumOptimEnterings)
    return InvalidArgument(StrFormat("entering = %d: expected a scapeOptimEntering_t (0..%d)",
                                     h.entering, scapeNumOptimEnterings - 1));
  const double decay = 1.0 - static_cast<double>(h.lr) * h.weightDecay;
  if (!(decay > 0.0))
    return InvalidArgument(
        StrFormat("lr * weightDecay = %g: expected below 1 (the decay factor "
                  "1 - lr*wd must stay positive)",
                  static_cast<double>(h.lr) * h.weightDecay));
  return Status::Ok();
}

Status Optimizer::Create(Comm* comm, Mask* mask, const OptimLayout& layout, const OptimHyper& hyper,
                         std::unique_ptr<Optimizer>* out) {
  SCAPE_RETURN_IF_ERROR(ValidateHyper(hyper));
  std::unique_ptr<Optimizer> o(new Optimizer());
  o->comm_ = comm;
  o->mask_ = mask;
  o->rank_ = comm->rank();
  o->nranks_ = comm->nranks();
  o->layout_ = layout;
  o->hyper_ = hyper;
  // The kernels share the host's cores with the other ranks on it (the tests and the
  // benchmark run every rank on one host).
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  o->threads_ = std::max(1, static_cast<int>(hw) / o->nranks_);

  // Every rank must run the same optimizer: compare a fingerprint of everything that is not
  // the mask's layout (scapeMaskCreate compared that one already).
  uint64_t h = 1469598103934665603ull;
  h = Fnv(h, static_cast<uint64_t>(layout.ownership));
  float fs[] = {hyper.lr,  hyper.beta1,       hyper.beta2,
                hyper.eps, hyper.weightDecay, hyper.maxGradNorm};
  for (float f : fs) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = Fnv(h, u);
  }
  uint64_t d;
  std::memcpy(&d, &hyper.density, 8);
  h = Fnv(Fnv(Fnv(Fnv(h, d), static_cast<uint64_t>(hyper.warmupSteps)),
              static_cast<uint64_t>(hyper.bias)),
          static_cast<uint64_t>(hyper.payload));
  h = Fnv(h, static_cast<uint64_t>(layout.nonFinite));
  h = Fnv(h, static_cast<uint64_t>(hyper.entering));
  int64_t mine = static_cast<int64_t>(h);
  std::vector<int64_t> all(static_cast<size_t>(o->nranks_));
  coll::CollArgs ag;
  ag.type = coll::CollType::kAllGather;
  ag.send = &mine;
  ag.recv = all.data();
  ag.count = 1;
  ag.dtype = scapeInt64;
  SCAPE_RETURN_IF_ERROR(comm->Run(ag));
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != mine)
      return InvalidUsage(
          StrFormat("rank %zu passed a different optimizer configuration than "
                    "rank %d (ownership, hyperparameters, density schedule, "
                    "payload type or nonFinite): every rank must pass the same",
                    r, o->rank_));

  const uint64_t n = layout.n;
  o->e_.assign(n, 0.0f);
  o->stat_.reset(new float[n]);  // untouched outside the owned part: never faulted in
  o->denseInMask_.assign(static_cast<size_t>(o->nranks_), 0);
  for (int r = 0; r < o->nranks_; ++r)
    for (const Mask::Piece& p : mask->Owned(r)) {
      if (p.dense) o->denseInMask_[static_cast<size_t>(r)] += p.end - p.begin;
      if (r == o->rank_) o->ownedSize_ += p.end - p.begin;
    }
  for (uint64_t c : o->denseInMask_) o->denseCount_ += c;

  // Step 0 has no mask chosen by a previous step: agree on the full mask (dense step).
  std::vector<uint64_t> all0;
  all0.reserve(o->ownedSize_);
  for (const Mask::Piece& p : mask->Owned(o->rank_))
    for (uint64_t i = p.begin; i < p.end; ++i) all0.push_back(i);
  SCAPE_RETURN_IF_ERROR(o->SyncOwnPart(all0.data(), all0.size()).Prepend("step-0 mask"));
  // No step yet: the momentum is +0 at the (full) current mask.
  o->m_.assign(mask->Current().size(), 0.0f);
  *out = std::move(o);
  return Status::Ok();
}

Optimizer::~Optimizer() {
  if (dev_) {
    (void)DeviceFinishSelect();
    DeviceRelease();
  }
  if (mask_ && pending_) (void)mask_->SyncWait();
}

Status Optimizer::SyncOwnPart(const uint64_t* idx, size_t k) {
  if (mask_->SyncInFlight()) SCAPE_RETURN_IF_ERROR(mask_->SyncWait());
  SCAPE_RETURN_IF_ERROR(mask_->SetNextIndices(idx, k));
  SCAPE_RETURN_IF_ERROR(mask_->SyncStart());
  SCAPE_RETURN_IF_ERROR(mask_->SyncWait());
  SCAPE_RETURN_IF_ERROR(mask_->Advance());
  pending_ = false;
  gen_ = mask_->Generation();
  return Status::Ok();
}

Status Optimizer::SetLr(float lr) {
  OptimHyper h = hyper_;
  h.lr = lr;
  SCAPE_RETURN_IF_ERROR(ValidateHyper(h));
  hyper_ = h;
  return Status::Ok();
}

Status Optimizer::SetHyper(const OptimHyper& h) {
  SCAPE_RETURN_IF_ERROR(ValidateHyper(h));
  hyper_ = h;
  return Status::Ok();
}

double Optimizer::Density(int64_t t) const {
  if (t <= 0) return 1.0;
  if (hyper_.warmupSteps > 0 && t < hyper_.warmupSteps)
    return std::pow(hyper_.density,
                    static_cast<double>(t) / static_cast<double>(hyper_.warmupSteps));
  return hyper_.density;
}

Status Optimizer::CheckMaskUse() const {
  if (mask_->Generation() == gen_) return Status::Ok();
  if (mask_->SyncInFlight())  // ours would carry our generation: this one is not ours
    return InvalidUsage(
        "a sync of the optimizer's mask started by another user of the mask is "
        "in flight: the optimizer owns its mask's syncs (nothing was changed)");
  return InvalidUsage(
      "the optimizer's mask was synchronised or advanced by another user of the "
      "mask since the last step, so the mask this step must use is gone "
      "(nothing was changed; load a checkpoint or recreate the optimizer)");
}

Status Optimizer::AdvanceToAgreedMask() {
  if (pending_) {
    SCAPE_RETURN_IF_ERROR(mask_->SyncWait().Prepend("mask sync of the previous step"));
    SCAPE_RETURN_IF_ERROR(mask_->Advance());
    pending_ = false;
    gen_ = mask_->Generation();
    maskBytes_ = mask_->Info().sentBytes;
  } else {
    maskBytes_ = 0;
  }
  BuildRuns();
  return Status::Ok();
}

void Optimizer::BuildRuns() {
  const std::vector<uint64_t>& cur = mask_->Current();
  runs_.clear();
  for (int r = 0; r < nranks_; ++r) {
    uint64_t j = mask_->RankOffset(r);
    const uint64_t jend = j + mask_->RankCount(r);
    for (const Mask::Piece& p : mask_->Owned(r)) {
      const uint64_t je = static_cast<uint64_t>(
          std::lower_bound(cur.begin() + static_cast<ptrdiff_t>(j),
                           cur.begin() + static_cast<ptrdiff_t>(jend), p.end) -
          cur.begin());
      uint32_t flags = (r == rank_ ? kernels::kRunOwned : 0u) | (p.dense ? kernels::kRunDense : 0u);
      runs_.push_back(kernels::MaskRun{p.begin, p.end, j, je, flags});
      j = je;
    }
  }
  std::sort(runs_.begin(), runs_.end(),
            [](const kernels::MaskRun& a, const kernels::MaskRun& b) { return a.begin < b.begin; });
}

kernels::MaskView Optimizer::MomentumView() const {
  return momOwn_ ? ViewOf(momIdx_, momRuns_) : View();
}

void Optimizer::KeepOldMomentumMask() {
  if (!oldHold_) return;
  // The momentum (m_, untouched) stays on the mask it was on, which is no longer current.
  momIdx_.assign(oldHold_->begin(), oldHold_->end());
  momRuns_ = oldRuns_;
  momOwn_ = true;
  oldHold_.reset();
}

void Optimizer::DenseMomentum(float* out) const {
  std::fill(out, out + layout_.n, 0.0f);
  const kernels::MaskView v = MomentumView();
  for (size_t j = 0; j < v.k; ++j) out[v.idx[j]] = m_[j];
}

void Optimizer::PackMomentum(const float* dense) {
  const kernels::MaskView cur = View();
  auto bits = [&](uint64_t i) {
    uint32_t u;
    std::memcpy(&u, &dense[i], 4);
    return u;
  };
  // Values outside the current mask (by their bits: -0 counts) keep a mask of their own.
  bool outside = false;
  for (const kernels::MaskRun& r : runs_) {  // position order; each run's entries sorted
    const uint64_t *q = cur.idx + r.jb, *qe = cur.idx + r.je;
    for (uint64_t i = r.begin; i < r.end && !outside; ++i) {
      if (q < qe && *q == i) {
        ++q;
        continue;
      }
      outside = bits(i) != 0;
    }
  }
  oldHold_.reset();
  momOwn_ = false;
  momIdx_.clear();
  momRuns_.clear();
  if (!outside) {
    m_.resize(cur.k);
    for (size_t j = 0; j < cur.k; ++j) m_[j] = dense[cur.idx[j]];
    return;
  }
  // The momentum mask: the current mask's entries and the other non-zero values, in position
  // order (one entry range per run).
  m_.clear();
  momRuns_ = runs_;
  for (kernels::MaskRun& r : momRuns_) {
    const uint64_t *q = cur.idx + r.jb, *qe = cur.idx + r.je;
    r.jb = momIdx_.size();
    for (uint64_t i = r.begin; i < r.end; ++i) {
      const bool masked = q < qe && *q == i;
      if (masked) ++q;
      if (masked || bits(i) != 0) {
        momIdx_.push_back(i);
        m_.push_back(dense[i]);
      }
    }
    r.je = momIdx_.size();
  }
  momOwn_ = true;
}

kernels::MaskView Optimizer::View() const { return ViewOf(mask_->Current(), runs_); }

void Optimizer::MarkSkipped() {
  ++skipped_;
  gradNorm_ = std::nan("");
  clipScale_ = 1.0f;
  maskBytes_ = payloadBytes_ = denseBytes_ = 0;
  controlBytes_ = 8 * static_cast<uint64_t>(nranks_ - 1);
}

Status Optimizer::AgreeFinite(bool bad, uint64_t first, float value, bool* skip) {
  *skip = false;
  // One word per rank: a fingerprint of the per-step hyperparameters (they must agree), its
  // lowest bit replaced by this rank's non-finite flag.
  uint64_t h = 1469598103934665603ull;
  for (float f : {hyper_.lr, hyper_.beta1, hyper_.beta2, hyper_.eps, hyper_.weightDecay}) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = Fnv(h, u);
  }
  const int64_t mine = static_cast<int64_t>((h & ~uint64_t{1}) | (bad ? 1u : 0u));
  std::vector<int64_t> all(static_cast<size_t>(nranks_));
  coll::CollArgs ag;
  ag.type = coll::CollType::kAllGather;
  ag.send = &mine;
  ag.recv = all.data();
  ag.count = 1;
  ag.dtype = scapeInt64;
  SCAPE_RETURN_IF_ERROR(comm_->Run(ag).Prepend("non-finite agreement"));
  std::string badRanks;
  int nbad = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    if ((all[r] | 1) != (mine | 1))
      return InvalidUsage(
          StrFormat("rank %zu set other per-step hyperparameters (lr, beta1, beta2, eps, "
                    "weightDecay) than rank %d: every rank must set the same values "
                    "(scapeOptimSetLr, scapeOptimSetHyperparams, ...); nothing was changed",
                    r, rank_));
    if (all[r] & 1) badRanks += (nbad++ ? ", " : "") + std::to_string(r);
  }
  if (nbad == 0) return Status::Ok();
  if (layout_.nonFinite == scapeOptimNonFiniteError) {
    std::string here;
    if (bad && first == UINT64_MAX)  // the device check gives no position
      here = StrFormat(" (rank %d: found on the device)", rank_);
    else if (bad)
      here = StrFormat(" (rank %d: grads[%llu] = %g)", rank_,
                       static_cast<unsigned long long>(first), static_cast<double>(value));
    return InvalidArgument(StrFormat(
        "the gradients of rank%s %s are not finite%s and the optimizer was made with nonFinite "
        "= scapeOptimNonFiniteError: no rank took the step (nothing was changed)",
        nbad > 1 ? "s" : "", badRanks.c_str(), here.c_str()));
  }
  MarkSkipped();
  *skip = true;
  return Status::Ok();
}

Status Optimizer::SkipAfterExchange() {
  if (layout_.nonFinite == scapeOptimNonFiniteError)
    return InvalidArgument(
        "the reduced payload is not finite although every rank's gradients were (a candidate "
        "beyond the payload type's range, fp16: |c| > 65504, or an overflow of the average), "
        "and the optimizer was made with nonFinite = scapeOptimNonFiniteError: parameters, "
        "momentum and the step counter are unchanged, the residual and the masks moved on");
  const uint64_t mb = maskBytes_;
  MarkSkipped();
  maskBytes_ = mb;  // that sync did complete
  return Status::Ok();
}

Status Optimizer::Step(float* theta, const float* g) {
  if (!comm_->error().ok()) return comm_->error();
  if (masterType_ != scapeFloat32 && copy_ == nullptr)
    return InvalidUsage(
        "this optimizer holds fp32 master weights of 16-bit params: step with "
        "scapeOptimStepMixed and those params (nothing was changed)");
  // State left on the device by device steps comes back to the host (a host wait).
  if (dev_) SCAPE_RETURN_IF_ERROR(DeviceToHost().Prepend("moving the state to the host"));
  SCAPE_RETURN_IF_ERROR(CheckMaskUse());
  for (double& p : phase_) p = 0.0;
  const uint64_t n = layout_.n;
  const scapeDataType_t pt = static_cast<scapeDataType_t>(hyper_.payload);
  const size_t esz = scapeTypeSize(pt);

  int64_t t0 = NowNs();
  // Non-finite gradients: every rank agrees before anything changes (timed with the sync wait).
  const bool agree = layout_.nonFinite != scapeOptimNonFiniteIgnore;
  if (agree) {
    size_t first = n;
    kernels::KernelStatus fk = kernels::FirstNonFinite(g, n, &first, threads_);
    if (fk != kernels::KernelStatus::kOk) return KernelError("non-finite check", fk);
    bool skip = false;
    SCAPE_RETURN_IF_ERROR(AgreeFinite(first < n, first, first < n ? g[first] : 0.0f, &skip));
    if (skip) {
      phase_[scapeOptimPhaseSyncWait] = Seconds(t0);
      return Status::Ok();
    }
  }
  // The momentum's mask when the mask advances now: held (with its runs) for the candidate
  // pass and for a step that ends without an update (KeepOldMomentumMask).
  if (pending_ && !momOwn_) {
    oldHold_ = mask_->CurrentShared();
    oldRuns_ = runs_;
  }
  {
    Status adv = AdvanceToAgreedMask();
    if (!adv.ok()) {
      oldHold_.reset();  // the mask did not advance: the momentum is on the current mask
      return adv;
    }
  }
  phase_[scapeOptimPhaseSyncWait] = Seconds(t0);
  // Whatever ends this step before its update leaves the momentum on the mask it was on.
  struct KeepOld {
    Optimizer* o;
    ~KeepOld() { o->KeepOldMomentumMask(); }
  } keepOld{this};

  const std::vector<uint64_t>& cur = mask_->Current();
  const uint64_t k = cur.size();
  const uint64_t kr = mask_->RankCount(rank_), offr = mask_->RankOffset(rank_);
  if (send_.size() < k * esz + 8) send_.resize(k * esz + 8);
  const bool sharded = layout_.ownership == scapeOptimSharded;
  const uint64_t recvElems = sharded ? kr : k;
  if (recvElems * esz + 8 > recv_.size()) recv_.resize(recvElems * esz + 8);
  const kernels::MaskView view = View();
  // The momentum m_{t-1}: m_ on its mask (the old view), gathered at the new mask's entries
  // (+0 at the entering ones) into mp (in place when the mask did not change).
  const kernels::MaskView old = oldHold_ ? ViewOf(*oldHold_, oldRuns_) : MomentumView();
  const bool moved = old.idx != view.idx;
  t0 = NowNs();
  // Each view is validated once per step (O(k)); the kernels below take the tokens and skip
  // their own validation. (A failure here is the error the first kernel gave before.)
  kernels::CheckedMaskView cview, cold;
  if (!kernels::CheckMaskView(view, n, &cview) || (moved && !kernels::CheckMaskView(old, n, &cold)))
    return KernelError(moved ? "momentum gather" : "candidate",
                       kernels::KernelStatus::kInvalidArgument);
  if (!moved) cold = cview;
  float* mp = m_.data();
  if (moved) {
    if (mPrev_.size() < k) mPrev_.resize(k);
    mp = mPrev_.data();
  }

  // Candidate + pack + residual (error feedback) + statistic of the owned part, with the
  // momentum m_{t-1} gathered at the new mask's entries into mp in the same pass (when the mask
  // moved); m is read at the old and the new mask's entries only.
  kernels::KernelStatus ks =
      kernels::CandidateGatherPacked(cold, m_.data(), g, e_.data(), n, hyper_.beta1, cview, mp, pt,
                                     send_.data(), stat_.get(), threads_);
  if (ks != kernels::KernelStatus::kOk) return KernelError("candidate", ks);
  phase_[scapeOptimPhaseCandidate] = Seconds(t0);

  // The next mask from the new statistic; its sync runs in the background during the rest of
  // this step and the next forward/backward, and is waited for at the next step.
  t0 = NowNs();
  SCAPE_RETURN_IF_ERROR(mask_->SelectNextTopk(stat_.get(), Density(step_ + 1)));
  SCAPE_RETURN_IF_ERROR(mask_->SyncStart());
  pending_ = true;
  gen_ = mask_->Generation();
  phase_[scapeOptimPhaseSelect] = Seconds(t0);

  // The values-only exchange (average over ranks), owner blocks as reduce-scatter.
  t0 = NowNs();
  coll::CollArgs a;
  a.type = sharded ? coll::CollType::kReduceScatter : coll::CollType::kAllReduce;
  a.send = send_.data();
  a.recv = recv_.data();
  a.count = k;
  a.counts = mask_->RankCounts();
  a.dtype = pt;
  a.op = scapeAvg;
  SCAPE_RETURN_IF_ERROR(comm_->Run(a).Prepend("payload exchange"));
  phase_[scapeOptimPhaseExchange] = Seconds(t0);

  // Global norm of the recovered gradient: one partial per owner block (blocked order), summed
  // in rank order, so replicated and sharded state get the same bits.
  t0 = NowNs();
  std::vector<double> partial(static_cast<size_t>(nranks_), 0.0);
  uint64_t stayBytes = 0;  // sharded "segment_rms": the piece sums' share of the all-gather
  if (sharded) {
    double mine = 0.0;
    ks = kernels::RecoveredGradSqNormPacked(recv_.data(), pt, mp + offr, kr, hyper_.beta1, &mine,
                                            threads_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("gradient norm", ks);
    coll::CollArgs ng;
    ng.type = coll::CollType::kAllGather;
    ng.send = &mine;
    ng.recv = partial.data();
    ng.count = 1;
    ng.dtype = scapeInt64;  // the doubles' bits, moved exactly
    if (SegmentRms()) {
      // Each owner's piece sums (bits, count) ride on the norm all-gather: [norm partial,
      // (sum, count) per owned piece in position order] per rank, no extra exchange.
      SCAPE_RETURN_IF_ERROR(StayingPieces(recv_.data(), offr, true, mp + offr));
      normMsg_.assign(1, 0);
      std::memcpy(normMsg_.data(), &mine, 8);
      ng.counts.assign(static_cast<size_t>(nranks_), 0);
      size_t total = 0;
      for (int r = 0; r < nranks_; ++r) {
        ng.counts[static_cast<size_t>(r)] = 1 + 2 * mask_->Owned(r).size();
        total += ng.counts[static_cast<size_t>(r)];
      }
      for (size_t q = 0; q < runs_.size(); ++q) {
        if (!(runs_[q].flags & kernels::kRunOwned)) continue;
        int64_t w;
        std::memcpy(&w, &pieceSum_[q], 8);
        normMsg_.push_back(w);
        normMsg_.push_back(static_cast<int64_t>(pieceCnt_[q]));
      }
      normAll_.assign(total, 0);
      ng.send = normMsg_.data();
      ng.recv = normAll_.data();
      ng.count = 0;
      stayBytes = RingHalf(16 * (total - static_cast<size_t>(nranks_)), nranks_);
    }
    SCAPE_RETURN_IF_ERROR(comm_->Run(ng).Prepend("gradient norm all-gather"));
    if (SegmentRms()) {
      size_t off = 0;
      for (int r = 0; r < nranks_; ++r) {
        std::memcpy(&partial[static_cast<size_t>(r)], &normAll_[off], 8);
        size_t w = off + 1;
        for (const Mask::Piece& p : mask_->Owned(r)) {
          const size_t q = static_cast<size_t>(
              std::lower_bound(runs_.begin(), runs_.end(), p.begin,
                               [](const kernels::MaskRun& a, uint64_t b) { return a.begin < b; }) -
              runs_.begin());
          if (q >= runs_.size() || runs_[q].begin != p.begin)
            return InternalError("segment_rms: a piece of the layout has no mask run");
          std::memcpy(&pieceSum_[q], &normAll_[w], 8);
          pieceCnt_[q] = static_cast<uint64_t>(normAll_[w + 1]);
          w += 2;
        }
        off += ng.counts[static_cast<size_t>(r)];
      }
      EnterVsFromPieces();
    }
  } else {
    for (int r = 0; r < nranks_; ++r) {
      const uint64_t o = mask_->RankOffset(r), c = mask_->RankCount(r);
      ks = kernels::RecoveredGradSqNormPacked(recv_.data() + o * esz, pt, mp + o, c, hyper_.beta1,
                                              &partial[static_cast<size_t>(r)], threads_);
      if (ks != kernels::KernelStatus::kOk) return KernelError("gradient norm", ks);
    }
    if (SegmentRms()) {
      SCAPE_RETURN_IF_ERROR(StayingPieces(recv_.data(), 0, false, mp));
      EnterVsFromPieces();
    }
  }
  double sq = 0.0;
  for (double p : partial) sq += p;
  gradNorm_ = std::sqrt(sq);
  clipScale_ = 1.0f;
  if (hyper_.maxGradNorm > 0.0f && std::isfinite(gradNorm_)) {
    const double c = static_cast<double>(hyper_.maxGradNorm) / (gradNorm_ + 1e-6);
    if (c < 1.0) clipScale_ = std::max(static_cast<float>(c), FLT_MIN);
  }
  phase_[scapeOptimPhaseNorm] = Seconds(t0);
  if (agree && !std::isfinite(gradNorm_)) {
    // Every rank's gradients were finite, yet the reduced payload is not (the same norm on every
    // rank: replicated, each sums the same payload; sharded, the all-gathered partials).
    SCAPE_RETURN_IF_ERROR(SkipAfterExchange());
    const uint64_t kd = denseCount_, ks_ = k - std::min(k, kd);
    payloadBytes_ = sharded ? RingHalf(ks_ * esz, nranks_) : RingAllReduce(ks_ * esz, nranks_);
    denseBytes_ = sharded ? RingHalf(kd * esz, nranks_) : RingAllReduce(kd * esz, nranks_);
    controlBytes_ = 8 * static_cast<uint64_t>(nranks_ - 1) * (sharded ? 2 : 1);
    return Status::Ok();
  }

  kernels::AdamSParams ap;
  ap.lr = hyper_.lr;
  ap.beta1 = hyper_.beta1;
  ap.beta2 = hyper_.beta2;
  ap.eps = hyper_.eps;
  ap.weight_decay = hyper_.weightDecay;
  ap.clip_scale = clipScale_;
  ap.clip_momentum = true;
  ap.bias_correction = KernelBias(static_cast<scapeBiasCorrection_t>(hyper_.bias));
  ap.step = step_ + 1;
  if (SegmentRms()) {
    ap.enter_offsets = layout_.offsets.data();
    ap.enter_vs = enterVs_.data();
    ap.enter_nseg = enterVs_.size();
    ap.enter_cap = kernels::kEnterCap;
  }

  t0 = NowNs();
  if (!sharded) {
    ks = kernels::UnpackAdamSUpdatePacked(recv_.data(), pt, cview, theta, mp, n, ap, threads_,
                                          copy_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("AdamS update", ks);
    phase_[scapeOptimPhaseUpdate] = Seconds(t0);
  } else {
    if (pairsSend_.size() < 2 * kr + 2) pairsSend_.resize(2 * kr + 2);
    if (pairsAll_.size() < 2 * k + 2) pairsAll_.resize(2 * k + 2);
    ks = kernels::AdamSUpdatePairsPacked(recv_.data(), pt, cur.data() + offr, kr, theta, mp + offr,
                                         n, ap, pairsSend_.data(), threads_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("AdamS update", ks);
    phase_[scapeOptimPhaseUpdate] = Seconds(t0);
    t0 = NowNs();
    coll::CollArgs gg;
    gg.type = coll::CollType::kAllGather;
    gg.send = pairsSend_.data();
    gg.recv = pairsAll_.data();
    gg.dtype = scapeFloat32;
    gg.counts = mask_->RankCounts();
    for (size_t& c : gg.counts) c *= 2;
    SCAPE_RETURN_IF_ERROR(comm_->Run(gg).Prepend("updated values all-gather"));
    ks =
        kernels::UnpackPairsDecayPacked(pairsAll_.data(), cview, theta, mp, n, ap, threads_, copy_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("unpack", ks);
    phase_[scapeOptimPhaseGather] = Seconds(t0);
  }

  const uint64_t kd = denseCount_, ks_ = k - std::min(k, kd);
  if (!sharded) {
    payloadBytes_ = RingAllReduce(ks_ * esz, nranks_);
    denseBytes_ = RingAllReduce(kd * esz, nranks_);
  } else {
    payloadBytes_ = RingHalf(ks_ * esz, nranks_) + RingHalf(ks_ * 8, nranks_);
    denseBytes_ = RingHalf(kd * esz, nranks_) + RingHalf(kd * 8, nranks_);
  }
  // The non-finite agreement and (sharded) the all-gather of the norm partials, one 8-byte word
  // per rank each: counted apart, not as payload.
  controlBytes_ = 8 * static_cast<uint64_t>(nranks_ - 1) * ((agree ? 1 : 0) + (sharded ? 1 : 0));
  controlBytes_ += stayBytes;  // sharded "segment_rms": its piece sums ride on the norm all-gather
  // The momentum m_t lives on the current mask now.
  if (moved) {
    mPrev_.resize(k);
    m_.swap(mPrev_);
  }
  momOwn_ = false;
  momIdx_.clear();
  momRuns_.clear();
  oldHold_.reset();
  ++step_;
  return Status::Ok();
}

Status Optimizer::CheckMixedTypes(scapeDataType_t paramType, scapeDataType_t gradType) const {
  auto name = [](scapeDataType_t t) {
    return t == scapeFloat32    ? "scapeFloat32"
           : t == scapeBfloat16 ? "scapeBfloat16"
                                : "scapeFloat16";
  };
  if (paramType != scapeFloat32 && paramType != scapeBfloat16 && paramType != scapeFloat16)
    return InvalidArgument(
        StrFormat("rank %d: paramType = %d: expected scapeFloat32, scapeBfloat16 or scapeFloat16",
                  rank_, static_cast<int>(paramType)));
  if (gradType != scapeFloat32 && gradType != scapeBfloat16 && gradType != scapeFloat16)
    return InvalidArgument(
        StrFormat("rank %d: gradType = %d: expected scapeFloat32, scapeBfloat16 or scapeFloat16",
                  rank_, static_cast<int>(gradType)));
  if (masterType_ != scapeFloat32 && paramType != masterType_)
    return InvalidArgument(
        StrFormat("rank %d: paramType = %s but this optimizer holds fp32 master weights of %s "
                  "params (since its first mixed step or a loaded checkpoint): the params' type "
                  "cannot change",
                  rank_, name(paramType), name(masterType_)));
  return Status::Ok();
}

Status Optimizer::StepMixed(void* params, scapeDataType_t paramType, const void* grads,
                            scapeDataType_t gradType) {
  SCAPE_RETURN_IF_ERROR(CheckMixedTypes(paramType, gradType));
  if (!comm_->error().ok()) return comm_->error();
  // State left on the device by device steps comes back to the host (master included).
  if (dev_) SCAPE_RETURN_IF_ERROR(DeviceToHost().Prepend("moving the state to the host"));
  const uint64_t n = layout_.n;
  const float* g = static_cast<const float*>(grads);
  if (gradType != scapeFloat32) {
    // 16-bit gradients: widened exactly (one pass over g) into fp32 scratch.
    if (gWide_.size() < n) gWide_.resize(n);
    if (gradType == scapeBfloat16)
      kernels::ConvertBf16ToFloat(static_cast<const uint16_t*>(grads), gWide_.data(), n);
    else
      kernels::ConvertFp16ToFloat(static_cast<const uint16_t*>(grads), gWide_.data(), n);
    g = gWide_.data();
  }
  if (paramType == scapeFloat32) return Step(static_cast<float*>(params), g);
  if (masterType_ == scapeFloat32) {
    // The first mixed step: the masters are the params, widened exactly (the same bits on
    // every rank, whose params are identical).
    master_.resize(n);
    if (paramType == scapeBfloat16)
      kernels::ConvertBf16ToFloat(static_cast<const uint16_t*>(params), master_.data(), n);
    else
      kernels::ConvertFp16ToFloat(static_cast<const uint16_t*>(params), master_.data(), n);
    masterType_ = paramType;
  }
  kernels::ModelCopy c;
  c.p = params;
  c.type = paramType;
  copy_ = &c;
  Status st = Step(master_.data(), g);
  copy_ = nullptr;
  return st;
}

Status Optimizer::StayingPlan(uint64_t slot0, bool owned) {
  // The pieces in mask order tile their slots; each is cut into blocks from its start.
  stayOrder_.clear();
  for (size_t q = 0; q < runs_.size(); ++q)
    if (!owned || (runs_[q].flags & kernels::kRunOwned)) stayOrder_.push_back(q);
  std::sort(stayOrder_.begin(), stayOrder_.end(),
            [&](size_t a, size_t b) { return runs_[a].jb < runs_[b].jb; });
  stayFirst_.assign(stayOrder_.size() + 1, 0);
  size_t nb = 0;
  for (size_t i = 0; i < stayOrder_.size(); ++i) {
    stayFirst_[i] = nb;
    nb += kernels::StayingBlockCount(runs_[stayOrder_[i]].je - runs_[stayOrder_[i]].jb);
  }
  stayFirst_[stayOrder_.size()] = nb;
  stayBounds_.assign(nb + 1, 0);
  if (!stayOrder_.empty()) stayBounds_[0] = runs_[stayOrder_[0]].jb - slot0;
  for (size_t i = 0; i < stayOrder_.size(); ++i) {
    const kernels::MaskRun& r = runs_[stayOrder_[i]];
    if (stayBounds_[stayFirst_[i]] != r.jb - slot0)
      return InternalError("segment_rms: the mask runs do not tile the payload");
    kernels::StayingBlockBounds(r.jb - slot0, r.je - slot0, stayBounds_.data() + stayFirst_[i] + 1);
  }
  staySum_.assign(nb, 0.0);
  stayCnt_.assign(nb, 0);
  return Status::Ok();
}

void Optimizer::StayingFinish() {
  pieceSum_.assign(runs_.size(), 0.0);
  pieceCnt_.assign(runs_.size(), 0);
  for (size_t i = 0; i < stayOrder_.size(); ++i) {
    const size_t q = stayOrder_[i];
    uint64_t c = 0;
    for (size_t b = stayFirst_[i]; b < stayFirst_[i + 1]; ++b) c += stayCnt_[b];
    pieceSum_[q] =
        kernels::BlockedSum(staySum_.data() + stayFirst_[i], stayFirst_[i + 1] - stayFirst_[i]);
    pieceCnt_[q] = c;
  }
}

Status Optimizer::StayingPieces(const void* payload, uint64_t slot0, bool owned, const float* m) {
  SCAPE_RETURN_IF_ERROR(StayingPlan(slot0, owned));
  const size_t nb = staySum_.size();
  const kernels::KernelStatus ks = kernels::StayingGradSqBlocksPacked(
      payload, static_cast<scapeDataType_t>(hyper_.payload), m, hyper_.beta1, stayBounds_.data(),
      nb, staySum_.data(), stayCnt_.data(), threads_);
  if (ks != kernels::KernelStatus::kOk) return KernelError("segment_rms sums", ks);
  StayingFinish();
  return Status::Ok();
}

void Optimizer::EnterVsFromPieces() {
  // Per segment: its pieces' sums added in position order (runs_ is in position order; a piece
  // lies inside one segment), from +0.0.
  const size_t nseg = layout_.offsets.size() - 1;
  std::vector<double> sum(nseg, 0.0);
  std::vector<uint64_t> cnt(nseg, 0);
  for (size_t q = 0; q < runs_.size(); ++q) {
    const size_t s = static_cast<size_t>(std::upper_bound(layout_.offsets.begin(),
                                                          layout_.offsets.end(), runs_[q].begin) -
                                         layout_.offsets.begin()) -
                     1;
    sum[s] = sum[s] + pieceSum_[q];
    cnt[s] += pieceCnt_[q];
  }
  enterVs_.resize(nseg);
  for (size_t s = 0; s < nseg; ++s) enterVs_[s] = kernels::SegmentEnterVs(sum[s], cnt[s]);
}

void Optimizer::GetInfo(scapeOptimInfo_t* info) const {
  scapeOptimInfo_t x{};
  x.step = step_;
  x.density = step_ > 0 ? Density(step_ - 1) : 1.0;
  x.nextDensity = Density(step_);
  x.maskCount = mask_->Current().size();
  x.denseCount = denseCount_;
  x.maskBytes = maskBytes_;
  x.payloadBytes = payloadBytes_;
  x.denseBytes = denseBytes_;
  x.controlBytes = controlBytes_;
  x.skippedSteps = skipped_;
  x.gradNorm = gradNorm_;
  x.clipScale = clipScale_;
  // The residual (n floats), the packed momentum (one float per entry of its mask) and the
  // masters (n floats); the device state holds its momentum dense (n floats).
  const uint64_t mom = dev_ ? layout_.n : m_.size();
  x.stateBytes = (masterType_ != scapeFloat32 ? 8 : 4) * layout_.n + 4 * mom;
  // The next mask's buffer belongs to the sync thread while a sync is in flight.
  const uint64_t nextSize = mask_->SyncInFlight() ? mask_->Current().size() : mask_->Next().size();
  x.maskStateBytes = 8 * (mask_->Current().size() + nextSize + (momOwn_ ? momIdx_.size() : 0));
  x.scratchBytes = send_.size() + recv_.size() + 4 * (pairsSend_.size() + pairsAll_.size()) +
                   4 * mPrev_.size() +  // m_{t-1} at the new mask (host step)
                   4 * ownedSize_ +
                   4 * gWide_.size();  // widened 16-bit gradients (scapeOptimStepMixed, host)
  for (int p = 0; p < scapeOptimNumPhases; ++p) x.phaseSeconds[p] = phase_[p];
  *info = x;
}

}  // namespace scape
