// The SCAPE-AdamS step, written once for host and device memory (issue 24 item 4): the
// phases, the routing of the step's collectives, the norm and clipping, the sharded pairs and
// the byte accounting. The per-element work is a StepKernels' (step_kernels.h): HostKernels
// (optim.cc) or DeviceKernels (optim_device.cc).
//
// One step, in order (docs/ALGORITHM.md section 4, docs/ARCHITECTURE.md "One optimizer step"):
//   non-finite agreement (one word per rank) | wait for the previous step's mask sync, advance |
//   candidate + pack + residual + statistic | select the next mask, start its sync |
//   the values-only exchange (replicated: all-reduce; sharded: reduce-scatter to the owners) |
//   the global norm (blocked partials summed in rank order; sharded: the owners' partials
//   all-gathered, with the "segment_rms" piece sums riding on that all-gather) and the clip
//   scale | replicated: unpack + update | sharded: the owner's update into (theta', m') pairs,
//   their all-gather, the unpack | the bytes of the step.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/clock.h"
#include "kernels/dtypes.h"
#include "plugin/optim/optim.h"
#include "plugin/optim/step_kernels.h"

namespace scape {
namespace {

// Ring volume one rank sends for an all-reduce / reduce-scatter or all-gather of `bytes`.
uint64_t RingAllReduce(uint64_t bytes, int p) { return p <= 1 ? 0 : 2 * bytes * (p - 1) / p; }
uint64_t RingHalf(uint64_t bytes, int p) { return p <= 1 ? 0 : bytes * (p - 1) / p; }

double Seconds(int64_t t0) { return static_cast<double>(NowNs() - t0) * 1e-9; }

}  // namespace

Status Optimizer::RunStep(StepRun& run) {
  SCAPE_RETURN_IF_ERROR(RunAgree(run));
  if (run.skipped) return Status::Ok();
  SCAPE_RETURN_IF_ERROR(RunLocalNorm(run));
  SetLocalClip(run.localSq);
  SCAPE_RETURN_IF_ERROR(RunFront(run));
  return RunBack(run, run.norm ? std::sqrt(run.clipSq) : 0.0, run.norm);
}

Status Optimizer::RunAgree(StepRun& run) {
  StepKernels& K = *run.K;
  if (!comm_->error().ok()) return comm_->error();
  if (masterType_ != scapeFloat32 && copy_ == nullptr)
    return InvalidUsage(
        "this optimizer holds fp32 master weights of 16-bit params: step with "
        "scapeOptimStepMixed and those params (nothing was changed)");
  SCAPE_RETURN_IF_ERROR(K.Begin());
  SCAPE_RETURN_IF_ERROR(CheckMaskUse());
  for (double& p : phase_) p = 0.0;
  run.sharded = layout_.ownership == scapeOptimSharded;

  int64_t t0 = NowNs();
  // Non-finite gradients (scape.h, scapeOptimNonFinite_t): every rank agrees before anything of
  // the state changes (timed with the sync wait).
  const bool agree = run.agree = layout_.nonFinite != scapeOptimNonFiniteIgnore;
  if (agree) {
    bool bad = false;
    uint64_t first = UINT64_MAX;
    float value = 0.0f;
    SCAPE_RETURN_IF_ERROR(K.FindNonFinite(&bad, &first, &value));
    bool skip = false;
    SCAPE_RETURN_IF_ERROR(AgreeFinite(bad, first, value, &skip));
    if (skip) run.skipped = true;
  }
  phase_[scapeOptimPhaseSyncWait] = Seconds(t0);
  return Status::Ok();
}

// clipNorm = local (Deep Gradient Compression's local clipping): this rank's own gradient norm,
// before anything of it enters the residual; no wire bytes.
Status Optimizer::RunLocalNorm(StepRun& run) {
  gradScale_ = 1.0f;
  run.local = ClipLocal();
  if (!run.local) return Status::Ok();
  const int64_t t0 = NowNs();
  SCAPE_RETURN_IF_ERROR(run.K->LocalGradSqNorm(&run.localSq));
  run.localSeconds = Seconds(t0);
  return Status::Ok();
}

// The gradient's weight in the candidate: min(1, maxGradNorm / (norm + 1e-6)) as the recovered
// clip computes it (1 for a norm that is not finite: the non-finite rule decides those).
void Optimizer::SetLocalClip(double sq) {
  gradScale_ = 1.0f;
  if (!ClipLocal()) return;
  localNorm_ = std::sqrt(sq);
  if (std::isfinite(localNorm_)) {
    const double c = static_cast<double>(hyper_.maxGradNorm) / (localNorm_ + 1e-6);
    if (c < 1.0) gradScale_ = std::max(static_cast<float>(c), FLT_MIN);
  }
}

Status Optimizer::RunFront(StepRun& run) {
  StepKernels& K = *run.K;
  const scapeDataType_t pt = static_cast<scapeDataType_t>(hyper_.payload);
  const bool sharded = run.sharded;
  int64_t t0 = NowNs();
  K.BeforeAdvance();
  {
    Status adv = AdvanceToAgreedMask();
    if (!adv.ok()) {
      K.AdvanceFailed();
      return adv;
    }
  }
  phase_[scapeOptimPhaseSyncWait] += Seconds(t0);
  // Whatever ends this step before its update leaves the momentum where it was (~StepRun).
  run.advanced = true;

  const uint64_t k = run.k = mask_->Current().size();
  const uint64_t kr = run.kr = mask_->RankCount(rank_), offr = run.offr = mask_->RankOffset(rank_);
  SCAPE_RETURN_IF_ERROR(K.PrepareMask(k, sharded ? kr : k, sharded));

  t0 = NowNs();
  SCAPE_RETURN_IF_ERROR(K.Candidate());
  phase_[scapeOptimPhaseCandidate] = Seconds(t0);

  // The next mask from the new statistic; its sync runs in the background during the rest of
  // this step and the next forward/backward, and is waited for at the next step.
  t0 = NowNs();
  SCAPE_RETURN_IF_ERROR(K.SelectNext(Density(step_ + 1)));
  phase_[scapeOptimPhaseSelect] = Seconds(t0);

  // The values-only exchange (average over ranks), owner blocks as reduce-scatter.
  t0 = NowNs();
  coll::CollArgs a;
  a.type = sharded ? coll::CollType::kReduceScatter : coll::CollType::kAllReduce;
  a.send = K.Send();
  a.recv = K.Recv();
  a.count = k;
  a.counts = mask_->RankCounts();
  a.dtype = pt;
  a.op = scapeAvg;
  const bool scaled = dtypes::IsScaled(pt);
  if (scaled) {
    // A scaled payload (kernels/dtypes.h): every rank's largest |value| agreed first (one
    // float), then the values move as `pt` with the scale that gives.
    float* amax = nullptr;
    SCAPE_RETURN_IF_ERROR(K.ScaledAmax(k, &amax));
    coll::CollArgs mx;
    mx.type = coll::CollType::kAllReduce;
    mx.send = mx.recv = amax;
    mx.count = 1;
    mx.dtype = scapeFloat32;
    mx.op = scapeMax;
    SCAPE_RETURN_IF_ERROR(K.Exchange(mx).Prepend("payload scale agreement"));
    void *ws = nullptr, *wr = nullptr;
    SCAPE_RETURN_IF_ERROR(K.Quantize(pt, k, sharded ? kr : k, &ws, &wr));
    a.send = ws;
    a.recv = wr;
  }
  SCAPE_RETURN_IF_ERROR(K.Exchange(a).Prepend("payload exchange"));
  if (scaled) SCAPE_RETURN_IF_ERROR(K.Dequantize(pt, sharded ? kr : k));
  phase_[scapeOptimPhaseExchange] = Seconds(t0);

  // Global norm of the recovered gradient: one partial per owner block (blocked order), summed
  // in rank order, so replicated and sharded state get the same bits. Computed where the
  // kernels always do (host) and for clipping; sharded, the partials' all-gather also runs for
  // "segment_rms", whose piece sums ride on it (with a partial of 0 when there is no norm).
  t0 = NowNs();
  // (The local clip needs no norm of g^: it has scaled the gradient already.)
  const bool norm = run.norm = K.NormAlways() || (hyper_.maxGradNorm > 0.0f && !ClipLocal());
  std::vector<double> partial(static_cast<size_t>(nranks_), 0.0);
  bool& normGathered = run.normGathered;
  uint64_t& stayBytes = run.stayBytes;
  if (sharded) {
    double mine = 0.0;
    if (norm) {
      const StepKernels::NormBlock b{0, offr, kr};
      SCAPE_RETURN_IF_ERROR(K.NormPartials(&b, 1, &mine));
    }
    coll::CollArgs ng;
    ng.type = coll::CollType::kAllGather;
    ng.send = &mine;
    ng.recv = partial.data();
    ng.count = 1;
    ng.dtype = scapeInt64;  // the doubles' bits, moved exactly
    if (NeedStaying()) {
      // Each owner's piece sums (bits, count) ride on the norm all-gather: [norm partial,
      // (sum, count) per owned piece in position order] per rank, no extra exchange.
      SCAPE_RETURN_IF_ERROR(StayingPlan(offr, true));
      SCAPE_RETURN_IF_ERROR(K.StayingBlocks(offr));
      StayingFinish();
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
    if (norm || NeedStaying()) {
      SCAPE_RETURN_IF_ERROR(comm_->Run(ng).Prepend("gradient norm all-gather"));
      normGathered = true;
    }
    if (NeedStaying()) {
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
      if (SegmentRms()) EnterVsFromPieces();
    }
  } else {
    if (norm) {
      std::vector<StepKernels::NormBlock> blocks(static_cast<size_t>(nranks_));
      for (int r = 0; r < nranks_; ++r) {
        const uint64_t o = mask_->RankOffset(r), c = mask_->RankCount(r);
        blocks[static_cast<size_t>(r)] = StepKernels::NormBlock{o, o, c};
      }
      SCAPE_RETURN_IF_ERROR(K.NormPartials(blocks.data(), blocks.size(), partial.data()));
    }
    if (NeedStaying()) {
      SCAPE_RETURN_IF_ERROR(StayingPlan(0, false));
      SCAPE_RETURN_IF_ERROR(K.StayingBlocks(0));
      StayingFinish();
      if (SegmentRms()) EnterVsFromPieces();
    }
  }
  run.sq = 0.0;
  if (norm)
    for (double p : partial) run.sq += p;
  // The staying clip norm: every piece's staying sum, in position order (the same bits on every
  // rank and in both ownerships).
  run.clipSq = run.sq;
  if (norm && ClipStaying()) {
    run.clipSq = 0.0;
    for (double p : pieceSum_) run.clipSq += p;
  }
  phase_[scapeOptimPhaseNorm] = Seconds(t0);
  return Status::Ok();
}

Status Optimizer::RunBack(StepRun& run, double clipNorm, bool haveNorm) {
  StepKernels& K = *run.K;
  const scapeDataType_t pt = static_cast<scapeDataType_t>(hyper_.payload);
  const size_t esz = scapeTypeSize(pt);
  const bool sharded = run.sharded, agree = run.agree, normGathered = run.normGathered;
  const uint64_t k = run.k, kr = run.kr, offr = run.offr, stayBytes = run.stayBytes;
  int64_t t0 = NowNs();
  gradNorm_ = 0.0;
  clipScale_ = 1.0f;
  if (haveNorm) {
    gradNorm_ = clipNorm;
    if (hyper_.maxGradNorm > 0.0f && !run.local && std::isfinite(gradNorm_)) {
      const double c = static_cast<double>(hyper_.maxGradNorm) / (gradNorm_ + 1e-6);
      if (c < 1.0) clipScale_ = std::max(static_cast<float>(c), FLT_MIN);
    }
  }
  phase_[scapeOptimPhaseNorm] += Seconds(t0) + run.localSeconds;

  // The step's bytes (scapeOptimInfo_t): the payload split into its always-dense and sparse
  // values; the control words (the non-finite agreement; sharded, the norm all-gather and the
  // piece sums riding on it) apart.
  const uint64_t kd = denseCount_, ksp = k - std::min(k, kd);
  auto count = [&](bool pairs) {
    if (!sharded) {
      payloadBytes_ = RingAllReduce(ksp * esz, nranks_);
      denseBytes_ = RingAllReduce(kd * esz, nranks_);
    } else {
      payloadBytes_ = RingHalf(ksp * esz, nranks_) + (pairs ? RingHalf(ksp * 8, nranks_) : 0);
      denseBytes_ = RingHalf(kd * esz, nranks_) + (pairs ? RingHalf(kd * 8, nranks_) : 0);
    }
    controlBytes_ =
        8 * static_cast<uint64_t>(nranks_ - 1) * ((agree ? 1 : 0) + (normGathered ? 1 : 0));
    controlBytes_ += stayBytes;
    // A scaled payload's scale agreement: one float's all-reduce.
    if (dtypes::IsScaled(pt)) controlBytes_ += 4 * static_cast<uint64_t>(nranks_ - 1);
  };
  if (agree && (!std::isfinite(gradNorm_) || (run.norm && !std::isfinite(run.sq)))) {
    // Every rank's gradients were finite, yet the reduced payload is not (the same norm on every
    // rank: replicated, each sums the same payload; sharded, the all-gathered partials). Seen
    // where the norm is computed.
    SCAPE_RETURN_IF_ERROR(SkipAfterExchange());
    count(false);
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
  if (run.local) {
    // scapeOptimInfo_t: this rank's gradient norm and the weight its gradient had (g^ itself
    // is not clipped: clipScale_ was 1 above).
    gradNorm_ = localNorm_;
    clipScale_ = gradScale_;
  }
  ap.bias_correction = KernelBias(static_cast<scapeBiasCorrection_t>(hyper_.bias));
  ap.step = step_ + 1;
  if (SegmentRms()) {
    ap.enter_offsets = layout_.offsets.data();
    ap.enter_vs = enterVs_.data();
    ap.enter_nseg = enterVs_.size();
    ap.enter_cap = kernels::kEnterCap;
    ap.enter_momentum_cap = hyper_.entering == scapeOptimEnteringSegmentRmsMasked;
  }

  t0 = NowNs();
  if (!sharded) {
    SCAPE_RETURN_IF_ERROR(K.Update(ap));
    phase_[scapeOptimPhaseUpdate] = Seconds(t0);
  } else {
    SCAPE_RETURN_IF_ERROR(K.UpdatePairs(ap, offr, kr));
    phase_[scapeOptimPhaseUpdate] = Seconds(t0);
    t0 = NowNs();
    coll::CollArgs gg;
    gg.type = coll::CollType::kAllGather;
    gg.send = K.PairsSend();
    gg.recv = K.PairsAll();
    gg.dtype = scapeFloat32;
    gg.counts = mask_->RankCounts();
    for (size_t& c : gg.counts) c *= 2;
    SCAPE_RETURN_IF_ERROR(K.Exchange(gg).Prepend("updated values all-gather"));
    SCAPE_RETURN_IF_ERROR(K.UnpackPairs(ap));
    phase_[scapeOptimPhaseGather] = Seconds(t0);
  }
  count(true);
  run.updated = true;
  ++step_;
  return K.Finish();
}

Status Optimizer::StepJoint(const JointMember* members, size_t count, bool device, void* stream,
                            backend::Backend* exchange) {
  std::vector<std::unique_ptr<StepRun>> runs(count);
  for (size_t i = 0; i < count; ++i)
    SCAPE_RETURN_IF_ERROR(
        members[i].opt->PrepareMember(members[i], device, stream, exchange, &runs[i]));
  // Every member's non-finite agreement first (collective: every rank learns every member's
  // answer): when one skips, all skip before anything of theirs changed.
  bool skipped = false;
  for (size_t i = 0; i < count; ++i) {
    SCAPE_RETURN_IF_ERROR(
        members[i].opt->RunAgree(*runs[i]).Prepend(StrFormat("joint step member %zu", i)));
    skipped = skipped || runs[i]->skipped;
  }
  if (skipped) {
    for (size_t i = 0; i < count; ++i)
      if (!runs[i]->skipped) members[i].opt->MarkSkipped();
    return Status::Ok();
  }
  // clipNorm = local: one norm over every member's gradient on this rank (member order), as
  // torch.nn.utils.clip_grad_norm_ over every group would take it.
  double localSq = 0.0;
  for (size_t i = 0; i < count; ++i) {
    SCAPE_RETURN_IF_ERROR(
        members[i].opt->RunLocalNorm(*runs[i]).Prepend(StrFormat("joint step member %zu", i)));
    if (runs[i]->local) localSq += runs[i]->localSq;
  }
  for (size_t i = 0; i < count; ++i) members[i].opt->SetLocalClip(localSq);
  // Every member's first half (each member's collectives in member order on every rank).
  bool haveNorm = true;
  double sq = 0.0, full = 0.0;  // the members' clip norms and full norms, squared
  for (size_t i = 0; i < count; ++i) {
    Optimizer* o = members[i].opt;
    SCAPE_RETURN_IF_ERROR(o->RunFront(*runs[i]).Prepend(StrFormat("joint step member %zu", i)));
    haveNorm = haveNorm && runs[i]->norm;
    if (runs[i]->norm) {
      sq += runs[i]->clipSq;
      full += runs[i]->sq;
    }
  }
  // A reduced payload that is not finite although every gradient was (see scape.h): every
  // member skips after its exchange.
  const double norm = std::sqrt(sq);
  if (haveNorm && runs[0]->agree && !std::isfinite(full)) skipped = true;
  for (size_t i = 0; i < count; ++i) {
    Optimizer* o = members[i].opt;
    if (skipped) {
      SCAPE_RETURN_IF_ERROR(o->SkipAfterExchange());
      continue;
    }
    SCAPE_RETURN_IF_ERROR(
        o->RunBack(*runs[i], haveNorm ? norm : std::sqrt(runs[i]->clipSq), runs[i]->norm)
            .Prepend(StrFormat("joint step member %zu", i)));
  }
  return Status::Ok();
}

}  // namespace scape
