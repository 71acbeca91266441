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
#include "kernels/cpu/scaled.h"
#include "kernels/dtypes.h"
#include "plugin/coll/coll.h"
#include "plugin/optim/optim_device.h"
#include "plugin/optim/optim_internal.h"
#include "plugin/optim/step_kernels.h"

namespace scape {
namespace {

using optim_internal::Fnv;

Status KernelError(const char* what, kernels::KernelStatus ks) {
  return Status(
      ks == kernels::KernelStatus::kInvalidArgument ? scapeInternalError : kernels::ToResult(ks),
      StrFormat("%s kernel failed: %s", what, kernels::KernelStatusString(ks)));
}

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
  if (h.schedule < 0 || h.schedule >= scapeNumDensitySchedules)
    return InvalidArgument(
        StrFormat("densitySchedule = %d: expected a scapeDensitySchedule_t (0..%d)", h.schedule,
                  scapeNumDensitySchedules - 1));
  if (!dtypes::IsPayload(h.payload))
    return InvalidArgument(
        StrFormat("payloadType = %d: expected %s", h.payload, dtypes::PayloadNames()));
  if (h.entering < 0 || h.entering >= scapeNumOptimEnterings)
    return InvalidArgument(StrFormat("entering = %d: expected a scapeOptimEntering_t (0..%d)",
                                     h.entering, scapeNumOptimEnterings - 1));
  if (h.clipNorm < 0 || h.clipNorm >= scapeNumOptimClipNorms)
    return InvalidArgument(StrFormat("clipNorm = %d: expected a scapeOptimClipNorm_t (0..%d)",
                                     h.clipNorm, scapeNumOptimClipNorms - 1));
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
  h = Fnv(h, static_cast<uint64_t>(hyper.clipNorm));
  h = Fnv(h, static_cast<uint64_t>(hyper.schedule));
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

double ScheduleDensity(int schedule, double density, int64_t warmupSteps, int64_t t) {
  if (t <= 0) return 1.0;
  if (warmupSteps <= 0 || t >= warmupSteps) return density;
  const double x = static_cast<double>(t) / static_cast<double>(warmupSteps);
  if (schedule == scapeDensityLinear) return 1.0 - (1.0 - density) * x;
  return std::pow(density, x);  // geometric: the expression of the only schedule before issue 42
}

namespace {

// (1/N) sum_{t<N} rho(t) for warm-up length w (0 <= w <= N), in closed form: the ramp's terms
// t = 0..w-1 are rho*^(t/w) (a geometric series of ratio q = rho*^(1/w)) or 1 - (1-rho*) t/w.
double AverageDensity(int schedule, double density, int64_t w, int64_t n) {
  double ramp;  // sum over t = 0..w-1 (w >= 1; t = 0 gives 1 in both shapes)
  if (w <= 1) {
    ramp = 1.0;
    w = 1;
  } else if (schedule == scapeDensityLinear) {
    ramp = static_cast<double>(w) - (1.0 - density) * static_cast<double>(w - 1) / 2.0;
  } else {
    const double q = std::pow(density, 1.0 / static_cast<double>(w));
    ramp = q < 1.0 ? (1.0 - density) / (1.0 - q) : static_cast<double>(w);
  }
  return (ramp + static_cast<double>(n - w) * density) / static_cast<double>(n);
}

}  // namespace

Status ScheduleForBudget(int schedule, double density, double averageDensity, int64_t totalSteps,
                         int64_t* warmupSteps) {
  if (!warmupSteps) return InvalidArgument("warmupSteps is NULL");
  if (schedule < 0 || schedule >= scapeNumDensitySchedules)
    return InvalidArgument(StrFormat("schedule = %d: expected a scapeDensitySchedule_t (0..%d)",
                                     schedule, scapeNumDensitySchedules - 1));
  if (!(density > 0.0 && density <= 1.0))
    return InvalidArgument(StrFormat("density = %g: expected 0 < density <= 1", density));
  if (totalSteps < 1)
    return InvalidArgument(StrFormat("totalSteps = %lld: expected >= 1 (the planned steps)",
                                     static_cast<long long>(totalSteps)));
  const double floor0 = AverageDensity(schedule, density, 0, totalSteps);
  if (!(averageDensity <= 1.0) || !(averageDensity >= floor0 * (1.0 - 1e-12)))
    return InvalidArgument(StrFormat(
        "averageDensity = %g: expected between %.9g (a fixed density %g over %lld steps, step "
        "0 dense) and 1",
        averageDensity, floor0, density, static_cast<long long>(totalSteps)));
  // The average grows with w (every ramp term grows with w and stays above rho*): bisect for
  // the largest w within the budget, give or take the closed forms' rounding (1e-12 relative:
  // a budget computed as a ramp's own average gives that ramp back).
  const double within = averageDensity * (1.0 + 1e-12);
  int64_t lo = 0, hi = totalSteps;
  if (AverageDensity(schedule, density, hi, totalSteps) <= within) lo = hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (AverageDensity(schedule, density, mid, totalSteps) <= within)
      lo = mid;
    else
      hi = mid;
  }
  *warmupSteps = lo;
  return Status::Ok();
}

double Optimizer::Density(int64_t t) const {
  return ScheduleDensity(hyper_.schedule, hyper_.density, hyper_.warmupSteps, t);
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
  maskWait_ = 0.0;
  if (pending_) {
    const int64_t t0 = NowNs();
    SCAPE_RETURN_IF_ERROR(mask_->SyncWait().Prepend("mask sync of the previous step"));
    maskWait_ = static_cast<double>(NowNs() - t0) * 1e-9;
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

// The host step's kernels (step_kernels.h): host memory, kernels/cpu, the communicator's
// collectives. The momentum is packed at its mask (m_); when the mask advances, the candidate
// pass reads m_{t-1} at the old mask and writes it at the new mask's entries (+0 at the entering
// ones) into mPrev_, which becomes m_ after the update.
struct Optimizer::HostKernels final : Optimizer::StepKernels {
  HostKernels(Optimizer* o, float* theta, const float* g) : o(o), theta(theta), g(g) {}
  Optimizer* o;
  float* theta;
  const float* g;
  kernels::MaskView view, old;
  kernels::CheckedMaskView cview, cold;
  bool moved = false;
  float* mp = nullptr;  // m_{t-1} at the current mask's entries (mask order)

  scapeDataType_t Pt() const { return o->KernelPayload(); }

  Status Begin() override {
    // State left on the device by device steps comes back to the host (a host wait).
    if (o->dev_) SCAPE_RETURN_IF_ERROR(o->DeviceToHost().Prepend("moving the state to the host"));
    return Status::Ok();
  }
  Status FindNonFinite(bool* bad, uint64_t* first, float* value) override {
    const uint64_t n = o->layout_.n;
    size_t f = n;
    kernels::KernelStatus fk = kernels::FirstNonFinite(g, n, &f, o->threads_);
    if (fk != kernels::KernelStatus::kOk) return KernelError("non-finite check", fk);
    *bad = f < n;
    if (*bad) {
      *first = f;
      *value = g[f];
    }
    return Status::Ok();
  }
  // The momentum's mask when the mask advances now: held (with its runs) for the candidate
  // pass and for a step that ends without an update (KeepOldMomentumMask).
  void BeforeAdvance() override {
    if (o->pending_ && !o->momOwn_) {
      o->oldHold_ = o->mask_->CurrentShared();
      o->oldRuns_ = o->runs_;
    }
  }
  void AdvanceFailed() override { o->oldHold_.reset(); }  // the momentum is on the current mask
  void EndedWithoutUpdate() override { o->KeepOldMomentumMask(); }
  Status PrepareMask(uint64_t k, uint64_t recvElems, bool sharded) override {
    const size_t esz = scapeTypeSize(Pt());
    if (o->send_.size() < k * esz + 8) o->send_.resize(k * esz + 8);
    if (recvElems * esz + 8 > o->recv_.size()) o->recv_.resize(recvElems * esz + 8);
    if (sharded) {
      const uint64_t kr = o->mask_->RankCount(o->rank_);
      if (o->pairsSend_.size() < 2 * kr + 2) o->pairsSend_.resize(2 * kr + 2);
      if (o->pairsAll_.size() < 2 * k + 2) o->pairsAll_.resize(2 * k + 2);
    }
    view = o->View();
    // The momentum m_{t-1}: m_ on its mask (the old view), gathered at the new mask's entries
    // (+0 at the entering ones) into mp (in place when the mask did not change).
    old = o->oldHold_ ? ViewOf(*o->oldHold_, o->oldRuns_) : o->MomentumView();
    moved = old.idx != view.idx;
    // Each view is validated once per step (O(k)); the kernels take the tokens and skip their
    // own validation. (A failure here is the error the first kernel gave before.)
    const uint64_t n = o->layout_.n;
    if (!kernels::CheckMaskView(view, n, &cview) ||
        (moved && !kernels::CheckMaskView(old, n, &cold)))
      return KernelError(moved ? "momentum gather" : "candidate",
                         kernels::KernelStatus::kInvalidArgument);
    if (!moved) cold = cview;
    mp = o->m_.data();
    if (moved) {
      if (o->mPrev_.size() < k) o->mPrev_.resize(k);
      mp = o->mPrev_.data();
    }
    return Status::Ok();
  }
  Status Candidate() override {
    // With m_{t-1} gathered at the new mask's entries into mp in the same pass (when the mask
    // moved); m is read at the old and the new mask's entries only.
    kernels::KernelStatus ks = kernels::CandidateGatherPacked(
        cold, o->m_.data(), g, o->e_.data(), o->layout_.n, o->hyper_.beta1, cview, mp, Pt(),
        o->send_.data(), o->stat_.get(), o->threads_, o->gradScale_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("candidate", ks);
    return Status::Ok();
  }
  Status LocalGradSqNorm(double* out) override {
    const kernels::KernelStatus ks =
        kernels::GradSqNorm(g, scapeFloat32, o->layout_.n, out, o->threads_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("local gradient norm", ks);
    return Status::Ok();
  }
  Status SelectNext(double density) override {
    SCAPE_RETURN_IF_ERROR(o->mask_->SelectNextTopk(o->stat_.get(), density));
    SCAPE_RETURN_IF_ERROR(o->mask_->SyncStart());
    o->pending_ = true;
    o->gen_ = o->mask_->Generation();
    return Status::Ok();
  }
  void* Send() override { return o->send_.data(); }
  void* Recv() override { return o->recv_.data(); }
  float* PairsSend() override { return o->pairsSend_.data(); }
  float* PairsAll() override { return o->pairsAll_.data(); }
  Status Exchange(const coll::CollArgs& a) override { return o->comm_->Run(a); }
  Status ScaledAmax(uint64_t k, float** amax) override {
    const kernels::KernelStatus ks =
        kernels::PayloadAmax(reinterpret_cast<const float*>(o->send_.data()), k, &o->amax_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("payload scale", ks);
    *amax = &o->amax_;
    return Status::Ok();
  }
  Status Quantize(scapeDataType_t wire, uint64_t k, uint64_t recvElems, void** wireSend,
                  void** wireRecv) override {
    const size_t esz = scapeTypeSize(wire);
    if (o->wireSend_.size() < k * esz + 8) o->wireSend_.resize(k * esz + 8);
    if (o->wireRecv_.size() < recvElems * esz + 8) o->wireRecv_.resize(recvElems * esz + 8);
    const kernels::KernelStatus ks =
        kernels::QuantizeScaled(reinterpret_cast<const float*>(o->send_.data()), k, wire, o->amax_,
                                o->nranks_, o->wireSend_.data(), view.idx, o->e_.data());
    if (ks != kernels::KernelStatus::kOk) return KernelError("payload conversion", ks);
    *wireSend = o->wireSend_.data();
    *wireRecv = o->wireRecv_.data();
    return Status::Ok();
  }
  Status Dequantize(scapeDataType_t wire, uint64_t count) override {
    const kernels::KernelStatus ks =
        kernels::DequantizeScaled(o->wireRecv_.data(), count, wire, o->amax_, o->nranks_,
                                  reinterpret_cast<float*>(o->recv_.data()));
    if (ks != kernels::KernelStatus::kOk) return KernelError("payload conversion", ks);
    return Status::Ok();
  }
  bool NormAlways() const override { return true; }
  Status NormPartials(const NormBlock* b, size_t nb, double* out) override {
    const size_t esz = scapeTypeSize(Pt());
    for (size_t i = 0; i < nb; ++i) {
      kernels::KernelStatus ks = kernels::RecoveredGradSqNormPacked(
          o->recv_.data() + b[i].recvSlot * esz, Pt(), mp + b[i].maskSlot, b[i].count,
          o->hyper_.beta1, &out[i], o->threads_);
      if (ks != kernels::KernelStatus::kOk) return KernelError("gradient norm", ks);
    }
    return Status::Ok();
  }
  Status StayingBlocks(uint64_t slot0) override {
    const kernels::KernelStatus ks = kernels::StayingGradSqBlocksPacked(
        o->recv_.data(), Pt(), mp + slot0, o->hyper_.beta1, o->stayBounds_.data(),
        o->staySum_.size(), o->staySum_.data(), o->stayCnt_.data(), o->threads_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("segment_rms sums", ks);
    return Status::Ok();
  }
  Status Update(const kernels::AdamSParams& ap) override {
    kernels::KernelStatus ks = kernels::UnpackAdamSUpdatePacked(
        o->recv_.data(), Pt(), cview, theta, mp, o->layout_.n, ap, o->threads_, o->copy_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("AdamS update", ks);
    return Status::Ok();
  }
  Status UpdatePairs(const kernels::AdamSParams& ap, uint64_t offr, uint64_t kr) override {
    kernels::KernelStatus ks = kernels::AdamSUpdatePairsPacked(
        o->recv_.data(), Pt(), view.idx + offr, kr, theta, mp + offr, o->layout_.n, ap,
        o->pairsSend_.data(), o->threads_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("AdamS update", ks);
    return Status::Ok();
  }
  Status UnpackPairs(const kernels::AdamSParams& ap) override {
    kernels::KernelStatus ks = kernels::UnpackPairsDecayPacked(
        o->pairsAll_.data(), cview, theta, mp, o->layout_.n, ap, o->threads_, o->copy_);
    if (ks != kernels::KernelStatus::kOk) return KernelError("unpack", ks);
    return Status::Ok();
  }
  Status Finish() override {
    // The momentum m_t lives on the current mask now.
    if (moved) {
      o->mPrev_.resize(view.k);
      o->m_.swap(o->mPrev_);
    }
    o->momOwn_ = false;
    o->momIdx_.clear();
    o->momRuns_.clear();
    o->oldHold_.reset();
    return Status::Ok();
  }
};

Status Optimizer::PrepareHost(float* theta, const float* g, std::unique_ptr<StepRun>* run) {
  run->reset(new StepRun(this, std::unique_ptr<StepKernels>(new HostKernels(this, theta, g))));
  return Status::Ok();
}

Status Optimizer::Step(float* theta, const float* g) {
  std::unique_ptr<StepRun> run;
  SCAPE_RETURN_IF_ERROR(PrepareHost(theta, g, &run));
  return RunStep(*run);
}

Status Optimizer::PrepareMember(const JointMember& m, bool device, void* stream,
                                backend::Backend* exchange, std::unique_ptr<StepRun>* run) {
  if (device)
    return PrepareDeviceMixed(m.params, m.paramType, m.grads, m.gradType, stream, exchange, run);
  return PrepareMixed(m.params, m.paramType, m.grads, m.gradType, run);
}

scapeDataType_t Optimizer::KernelPayload() const {
  const scapeDataType_t pt = static_cast<scapeDataType_t>(hyper_.payload);
  return dtypes::IsScaled(pt) ? scapeFloat32 : pt;
}

Status Optimizer::CheckMixedTypes(scapeDataType_t paramType, scapeDataType_t gradType) const {
  auto name = [](scapeDataType_t t) { return dtypes::Name(t); };
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
  std::unique_ptr<StepRun> run;
  SCAPE_RETURN_IF_ERROR(PrepareMixed(params, paramType, grads, gradType, &run));
  return RunStep(*run);
}

Status Optimizer::PrepareMixed(void* params, scapeDataType_t paramType, const void* grads,
                               scapeDataType_t gradType, std::unique_ptr<StepRun>* run) {
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
  if (paramType == scapeFloat32) return PrepareHost(static_cast<float*>(params), g, run);
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
  SCAPE_RETURN_IF_ERROR(PrepareHost(master_.data(), g, run));
  (*run)->copy.p = params;
  (*run)->copy.type = paramType;
  copy_ = &(*run)->copy;
  return Status::Ok();
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
  // masters (n floats), on the host or the device.
  const uint64_t mom = dev_ ? dev_->kMom : m_.size();
  x.stateBytes = (masterType_ != scapeFloat32 ? 8 : 4) * layout_.n + 4 * mom;
  // The next mask's buffer belongs to the sync thread while a sync is in flight.
  const uint64_t nextSize = mask_->SyncInFlight() ? mask_->Current().size() : mask_->Next().size();
  x.maskStateBytes = 8 * (mask_->Current().size() + nextSize + (momOwn_ ? momIdx_.size() : 0));
  x.scratchBytes = send_.size() + recv_.size() + 4 * (pairsSend_.size() + pairsAll_.size()) +
                   4 * mPrev_.size() +  // m_{t-1} at the new mask (host step)
                   4 * ownedSize_ +
                   4 * gWide_.size();  // widened 16-bit gradients (scapeOptimStepMixed, host)
  if (dev_) {
    // Device memory: the mask's index buffers, and the statistic (n floats: the device
    // candidate writes every position), the payload, pair and top-k buffers (mask-sized), as
    // allocated from the communicator's device pool.
    x.maskStateBytes += dev_->IndexBytes() + 8 * dev_->kMom;  // + the momentum's positions
    x.scratchBytes += dev_->ScratchBytes();
  }
  for (int p = 0; p < scapeOptimNumPhases; ++p) x.phaseSeconds[p] = phase_[p];
  x.maskWaitSeconds = maskWait_;
  *info = x;
}

}  // namespace scape
