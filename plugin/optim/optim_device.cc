// The SCAPE-AdamS step on device buffers (scapeOptimStepStream): the host step of optim.cc
// made of the stream-ordered device ops of plugin/device/runtime.h, with the same bits.
//
// Per step, on the caller's stream:
//   upload the current mask (mask order, sorted, and the permutations between them) |
//   CandidatePackResidual at the sorted mask (payload, residual, the candidate as statistic) |
//   Gather the payload into mask order | TopkAbs over this rank's owned pieces (the segments
//   and options of Mask::SelectNextTopk) | copy the selected positions to pinned host memory,
//   record an event | the packed exchange (replicated: all-reduce, per-rank counts; sharded:
//   reduce-scatter then all-gather of the reduced payload, per-rank counts) through the device
//   dispatch | [maxGradNorm > 0: RecoveredGradSqNorm per owner block, copied to the host: a
//   HOST WAIT, the clip scale is an argument of the update] | Gather the payload back into
//   sorted order | UnpackAdamSUpdate at the sorted mask.
// The next mask's sync starts from the host with the positions of the event: at the end of the
// call when the event has completed, else at the next optimizer call (step, checkpoint,
// destroy), which waits for that event (a host wait on the small copy).
//
// Payloads: fp32, bf16 or fp16 (hyper_.payload): the payload buffers and the gathers use its
// element size, and the exchange carries its type (on a UCX communicator the staged exchange
// reduces it on the host, with the collectives of the host step's exchange).
//
// Bits: the flat device kernels at the sorted mask compute what the host's view kernels
// compute at the mask order, entry by entry. The candidate kernel runs with keepRounding: the
// residual inside the mask is c - float(payload), the rounding error of a bf16/fp16 payload
// (+0 for fp32, and +0 when the payload value is not finite), as the host's view kernel leaves
// it. With sharded ownership every rank applies the update from the gathered reduced payload
// instead of gathering the owner's (theta, m) pairs: the same bits when the ranks' params are
// the same (data-parallel replicas), which the host step also assumes for m.
#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "base/clock.h"
#include "kernels/cpu/dtype.h"
#include "plugin/backend/backend.h"
#include "plugin/optim/optim.h"
#include "plugin/optim/optim_device.h"

namespace scape {
namespace {

// One of the step's packed collectives on the communicator's device backend, stream-ordered:
// the backend's own checks first (as every call the API routes to it), then the collective.
Status RunOn(backend::Backend* b, const coll::CollArgs& a, void* stream) {
  if (b == nullptr) return InternalError("the communicator has no device backend");
  SCAPE_RETURN_IF_ERROR(b->Admit(a, stream, false));
  return b->Run(a, stream, nullptr);
}

template <typename T>
Status Alloc(device::Runtime* rt, size_t count, T** p) {
  void* v = nullptr;
  SCAPE_RETURN_IF_ERROR(rt->DeviceAlloc(sizeof(T) * std::max<size_t>(count, 1), &v));
  *p = static_cast<T*>(v);
  return Status::Ok();
}

// Waits for an event (the runtime has no blocking wait: poll). Fails with the stream's error,
// or scapeTimeout after timeoutMs (the communicator's timeout), so a stuck stream never hangs
// the host.
Status WaitEvent(device::Runtime* rt, device::Event e, int timeoutMs) {
  const int64_t deadline = NowNs() + static_cast<int64_t>(timeoutMs) * 1000000;
  for (int spin = 0;; ++spin) {
    bool done = false;
    SCAPE_RETURN_IF_ERROR(rt->EventQuery(e, &done));
    if (done) return Status::Ok();
    if (NowNs() > deadline)
      return TimeoutError(
          StrFormat("the stream did not reach the step's selected positions "
                    "within %d ms (work queued ahead of the step, or a held "
                    "stream)",
                    timeoutMs));
    if (spin < 100)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

Status Optimizer::DeviceState::AllocPayload(uint64_t n, size_t esz) {
  for (void** p : {&dPaySorted, &dSend, &dRecv}) {
    rt->DeviceFree(*p);
    *p = nullptr;
  }
  payEsz = 0;
  const size_t bytes = esz * std::max<uint64_t>(n, 1);
  for (void** p : {&dPaySorted, &dSend, &dRecv}) SCAPE_RETURN_IF_ERROR(rt->DeviceAlloc(bytes, p));
  payEsz = esz;
  return Status::Ok();
}

Optimizer::DeviceState::~DeviceState() {
  if (!rt) return;
  for (void* p :
       {static_cast<void*>(dM), static_cast<void*>(dE), static_cast<void*>(dStat), dPaySorted,
        dSend, dRecv, static_cast<void*>(dMaskOrder), static_cast<void*>(dSorted),
        static_cast<void*>(dPerm), static_cast<void*>(dInv), static_cast<void*>(dTop),
        static_cast<void*>(dCounts), static_cast<void*>(dSq), static_cast<void*>(dFlag),
        static_cast<void*>(dMaster), static_cast<void*>(dStaySum), static_cast<void*>(dStayCnt)})
    rt->DeviceFree(p);
  if (hTop) rt->HostFree(hTop);
  if (hSq) rt->HostFree(hSq);
  if (hFlag) rt->HostFree(hFlag);
  if (selDone) rt->EventDestroy(selDone);
}

void Optimizer::DeviceRelease() {
  if (!dev_) return;
  if (dev_->rt) (void)dev_->rt->StreamSynchronize(dev_->stream);
  dev_.reset();
}

Status Optimizer::DeviceFinishSelect() {
  if (!dev_ || !dev_->selPending) return Status::Ok();
  DeviceState& d = *dev_;
  d.selPending = false;
  SCAPE_RETURN_IF_ERROR(WaitEvent(d.rt, d.selDone, comm_->config().timeoutMs)
                            .Prepend("next-mask selection on the device"));
  if (mask_->SyncInFlight()) SCAPE_RETURN_IF_ERROR(mask_->SyncWait());
  SCAPE_RETURN_IF_ERROR(mask_->SetNextIndices(d.hTop, d.selCount));
  SCAPE_RETURN_IF_ERROR(mask_->SyncStart());
  pending_ = true;
  gen_ = mask_->Generation();
  return Status::Ok();
}

Status Optimizer::DevicePull() {
  SCAPE_RETURN_IF_ERROR(DeviceFinishSelect());
  DeviceState& d = *dev_;
  const size_t n = layout_.n;
  SCAPE_RETURN_IF_ERROR(d.rt->StreamSynchronize(d.stream));
  // The device holds the momentum dense (n floats); the host packs it (PackMomentum).
  std::vector<float> dense(n);
  SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(dense.data(), d.dM, 4 * n, d.stream));
  SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(e_.data(), d.dE, 4 * n, d.stream));
  if (masterType_ != scapeFloat32 && d.dMaster) {
    master_.resize(n);
    SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(master_.data(), d.dMaster, 4 * n, d.stream));
  }
  SCAPE_RETURN_IF_ERROR(d.rt->StreamSynchronize(d.stream));
  PackMomentum(dense.data());
  return Status::Ok();
}

Status Optimizer::DevicePush() {
  DeviceState& d = *dev_;
  const size_t n = layout_.n;
  SCAPE_RETURN_IF_ERROR(d.rt->StreamSynchronize(d.stream));
  std::vector<float> dense(n);  // the packed momentum, dense for the device
  DenseMomentum(dense.data());
  SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(d.dM, dense.data(), 4 * n, d.stream));
  SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(d.dE, e_.data(), 4 * n, d.stream));
  // The master weights live beside the state while the optimizer has them.
  if (masterType_ != scapeFloat32) {
    if (!d.dMaster) SCAPE_RETURN_IF_ERROR(Alloc(d.rt, n, &d.dMaster));
    SCAPE_RETURN_IF_ERROR(d.rt->CopyAsync(d.dMaster, master_.data(), 4 * n, d.stream));
  } else if (d.dMaster) {
    d.rt->DeviceFree(d.dMaster);
    d.dMaster = nullptr;
  }
  return d.rt->StreamSynchronize(d.stream);
}

Status Optimizer::DeviceToHost() {
  SCAPE_RETURN_IF_ERROR(DevicePull());
  DeviceRelease();
  return Status::Ok();
}

Status Optimizer::StepDeviceMixed(void* dParams, scapeDataType_t paramType, const void* dG,
                                  scapeDataType_t gradType, void* stream,
                                  backend::Backend* exchange) {
  SCAPE_RETURN_IF_ERROR(CheckMixedTypes(paramType, gradType));
  if (!comm_->error().ok()) return comm_->error();
  device::Runtime* rt = device::GetRuntime();
  const uint64_t n = layout_.n;
  if (paramType != scapeFloat32 && masterType_ == scapeFloat32) {
    // The first mixed step: the masters are the params, widened exactly. A host wait (once):
    // params come to the host after the work queued before them on the stream.
    if (dev_) SCAPE_RETURN_IF_ERROR(DevicePull().Prepend("finishing the previous device step"));
    std::vector<uint16_t> h(n);
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(h.data(), dParams, 2 * n, stream));
    SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(stream).Prepend("copying params to the host"));
    master_.resize(n);
    if (paramType == scapeBfloat16)
      kernels::ConvertBf16ToFloat(h.data(), master_.data(), n);
    else
      kernels::ConvertFp16ToFloat(h.data(), master_.data(), n);
    masterType_ = paramType;
    if (dev_)
      SCAPE_RETURN_IF_ERROR(DevicePush().Prepend("moving the master weights to the device"));
  }
  kernels::ModelCopy c;
  c.p = dParams;
  c.type = paramType;
  copy_ = paramType != scapeFloat32 ? &c : nullptr;
  devGradType_ = gradType;
  // dTheta = nullptr: the device master weights (StepDevice).
  Status st = StepDevice(paramType != scapeFloat32 ? nullptr : static_cast<float*>(dParams),
                         static_cast<const float*>(dG), stream, exchange);
  copy_ = nullptr;
  devGradType_ = scapeFloat32;
  return st;
}

Status Optimizer::StepDevice(float* dTheta, const float* dG, void* stream,
                             backend::Backend* exchange) {
  if (!comm_->error().ok()) return comm_->error();
  if (masterType_ != scapeFloat32 && copy_ == nullptr)
    return InvalidUsage(
        "this optimizer holds fp32 master weights of 16-bit params: step with "
        "scapeOptimStepMixed and those params (nothing was changed)");
  device::Runtime* rt = device::GetRuntime();
  const uint64_t n = layout_.n;
  // The payload type (validated at create and load: fp32, bf16 or fp16) and its element size.
  const scapeDataType_t pt = static_cast<scapeDataType_t>(hyper_.payload);
  const size_t esz = scapeTypeSize(pt);
  if (!dev_) {
    // The first device step: the state moves to device memory.
    std::unique_ptr<DeviceState> d(new DeviceState());
    d->rt = rt;
    d->stream = stream;
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dM));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dE));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dStat));
    SCAPE_RETURN_IF_ERROR(d->AllocPayload(n, esz));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dMaskOrder));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dSorted));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dPerm));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, n, &d->dInv));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, std::max<uint64_t>(ownedSize_, 1), &d->dTop));
    SCAPE_RETURN_IF_ERROR(Alloc(rt, static_cast<size_t>(nranks_), &d->dSq));
    void* h = nullptr;
    SCAPE_RETURN_IF_ERROR(rt->HostAlloc(8 * std::max<uint64_t>(ownedSize_, 1), &h));
    d->hTop = static_cast<uint64_t*>(h);
    SCAPE_RETURN_IF_ERROR(rt->HostAlloc(8 * static_cast<size_t>(nranks_), &h));
    d->hSq = static_cast<double*>(h);
    SCAPE_RETURN_IF_ERROR(Alloc(rt, 1, &d->dFlag));
    SCAPE_RETURN_IF_ERROR(rt->HostAlloc(4, &h));
    d->hFlag = static_cast<uint32_t*>(h);
    SCAPE_RETURN_IF_ERROR(rt->EventCreate(&d->selDone));
    dev_ = std::move(d);
    Status st = DevicePush();
    if (!st.ok()) {
      dev_.reset();
      return st.Prepend("moving the optimizer state to the device");
    }
  }
  DeviceState& d = *dev_;
  if (d.rt != rt) return InvalidUsage("the device runtime changed since the last device step");
  if (copy_ != nullptr) dTheta = d.dMaster;  // mixed precision: the update runs on the masters
  // The previous step's selection starts its mask sync now, at the latest.
  SCAPE_RETURN_IF_ERROR(DeviceFinishSelect());
  if (stream != d.stream) {
    // The state and scratch are ordered on the last step's stream: finish it first.
    SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(d.stream).Prepend("the previous step's stream"));
    d.stream = stream;
  }
  if (d.payEsz != esz) {
    // A loaded checkpoint changed the payload type: buffers of the new element size.
    SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(d.stream).Prepend("the previous step's stream"));
    SCAPE_RETURN_IF_ERROR(d.AllocPayload(n, esz));
  }
  SCAPE_RETURN_IF_ERROR(CheckMaskUse());
  for (double& p : phase_) p = 0.0;

  int64_t t0 = NowNs();
  // Non-finite gradients (scape.h, scapeOptimNonFinite_t): the scan on the stream, a HOST WAIT
  // for its one-word result, then the ranks' agreement, before anything of the state changes.
  const bool agree = layout_.nonFinite != scapeOptimNonFiniteIgnore;
  if (agree) {
    SCAPE_RETURN_IF_ERROR(
        rt->AnyNonFinite(dG, n, devGradType_, d.dFlag, stream).Prepend("non-finite check"));
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.hFlag, d.dFlag, 4, stream));
    SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(stream).Prepend("non-finite check (host wait)"));
    bool skip = false;
    SCAPE_RETURN_IF_ERROR(AgreeFinite(*d.hFlag != 0, UINT64_MAX, 0.0f, &skip));
    if (skip) {
      phase_[scapeOptimPhaseSyncWait] = static_cast<double>(NowNs() - t0) * 1e-9;
      return Status::Ok();
    }
  }
  SCAPE_RETURN_IF_ERROR(AdvanceToAgreedMask());
  phase_[scapeOptimPhaseSyncWait] = static_cast<double>(NowNs() - t0) * 1e-9;

  // The mask in mask order, sorted (the runs in position order), and the permutations:
  // sorted slot s holds mask entry perm[s]; mask slot j is sorted slot inv[j].
  const std::vector<uint64_t>& cur = mask_->Current();
  const uint64_t k = cur.size();
  const bool sharded = layout_.ownership == scapeOptimSharded;
  d.hMaskOrder.assign(cur.begin(), cur.end());
  d.hSorted.resize(k);
  d.hPerm.resize(k);
  d.hInv.resize(k);
  {
    std::vector<kernels::MaskRun> byPos = runs_;
    std::sort(byPos.begin(), byPos.end(), [](const kernels::MaskRun& a, const kernels::MaskRun& b) {
      return a.begin < b.begin;
    });
    uint64_t s = 0;
    for (const kernels::MaskRun& r : byPos)
      for (uint64_t j = r.jb; j < r.je; ++j, ++s) {
        d.hSorted[s] = cur[j];
        d.hPerm[s] = j;
        d.hInv[j] = s;
      }
    if (s != k)
      return InternalError(StrFormat("rank %d: mask runs cover %llu of %llu entries", rank_,
                                     static_cast<unsigned long long>(s),
                                     static_cast<unsigned long long>(k)));
  }
  bool identity = true;
  for (uint64_t s = 0; s < k && identity; ++s) identity = d.hPerm[s] == s;
  void* st = stream;
  if (k) {
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.dMaskOrder, d.hMaskOrder.data(), 8 * k, st));
    if (!identity) {
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.dSorted, d.hSorted.data(), 8 * k, st));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.dPerm, d.hPerm.data(), 8 * k, st));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.dInv, d.hInv.data(), 8 * k, st));
    }
  }
  const uint64_t* dSortedMask = identity ? d.dMaskOrder : d.dSorted;

  // Candidate + pack + residual; the candidate is the statistic. A bf16/fp16 payload's rounding
  // error stays in the residual inside the mask, as in the host step.
  t0 = NowNs();
  void* paySorted = identity ? d.dSend : d.dPaySorted;
  if (devGradType_ == scapeFloat32) {
    SCAPE_RETURN_IF_ERROR(rt->CandidatePackResidual(d.dM, dG, d.dE, n, hyper_.beta1, dSortedMask, k,
                                                    pt, paySorted, d.dStat, st)
                              .Prepend("candidate"));
  } else {
    SCAPE_RETURN_IF_ERROR(rt->CandidatePackResidualGrad(d.dM, dG, devGradType_, d.dE, n,
                                                        hyper_.beta1, dSortedMask, k, pt, paySorted,
                                                        d.dStat, st)
                              .Prepend("candidate"));
  }
  if (!identity && k) SCAPE_RETURN_IF_ERROR(rt->Gather(paySorted, d.dInv, k, esz, d.dSend, st));
  phase_[scapeOptimPhaseCandidate] = static_cast<double>(NowNs() - t0) * 1e-9;

  // The next mask: top-k over this rank's owned pieces, as Mask::SelectNextTopk does it.
  t0 = NowNs();
  {
    const double density = Density(step_ + 1);
    Mask::TopkTable t;
    mask_->TopkPlan(density, &t);
    if (t.total > 0) {  // else only always-dense pieces (added by the mask), or none
      if (t.k.size() > d.countsCap) {
        d.rt->DeviceFree(d.dCounts);
        d.dCounts = nullptr;
        SCAPE_RETURN_IF_ERROR(Alloc(rt, t.k.size(), &d.dCounts));
        d.countsCap = t.k.size();
      }
      SCAPE_RETURN_IF_ERROR(
          rt->TopkAbs(d.dStat, t.Segments(), kernels::TopkOptions(), d.dTop, d.dCounts, st)
              .Prepend("top-k selection"));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.hTop, d.dTop, 8 * t.total, st));
    }
    SCAPE_RETURN_IF_ERROR(rt->EventRecord(d.selDone, st));
    d.selCount = t.total;
    d.selPending = true;
  }
  phase_[scapeOptimPhaseSelect] = static_cast<double>(NowNs() - t0) * 1e-9;

  // The values-only exchange (average over ranks).
  t0 = NowNs();
  coll::CollArgs a;
  a.type = sharded ? coll::CollType::kReduceScatter : coll::CollType::kAllReduce;
  a.send = d.dSend;
  a.recv = d.dRecv;
  a.count = k;
  a.counts = mask_->RankCounts();
  a.dtype = pt;
  a.op = scapeAvg;
  if (sharded) {
    // The reduced own block lands in place in the full payload (dRecv) via the all-gather;
    // reduce-scatter into dStat's storage (free again: the top-k read it before, in order).
    a.recv = d.dStat;
  }
  SCAPE_RETURN_IF_ERROR(RunOn(exchange, a, st).Prepend("payload exchange"));
  if (sharded) {
    coll::CollArgs g;
    g.type = coll::CollType::kAllGather;
    g.send = d.dStat;
    g.recv = d.dRecv;
    g.dtype = pt;
    g.counts = mask_->RankCounts();
    SCAPE_RETURN_IF_ERROR(RunOn(exchange, g, st).Prepend("reduced payload all-gather"));
  }
  phase_[scapeOptimPhaseExchange] = static_cast<double>(NowNs() - t0) * 1e-9;

  // Global norm of the recovered gradient (clipping only): per owner block, summed in rank
  // order on the host, as the host step sums its partials.
  t0 = NowNs();
  gradNorm_ = 0.0;
  clipScale_ = 1.0f;
  if (hyper_.maxGradNorm > 0.0f) {
    for (int r = 0; r < nranks_; ++r) {
      const uint64_t o = mask_->RankOffset(r), c = mask_->RankCount(r);
      SCAPE_RETURN_IF_ERROR(rt->RecoveredGradSqNorm(static_cast<char*>(d.dRecv) + esz * o, pt,
                                                    d.dMaskOrder + o, c, d.dM, n, hyper_.beta1,
                                                    d.dSq + r, st)
                                .Prepend("gradient norm"));
    }
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d.hSq, d.dSq, 8 * static_cast<size_t>(nranks_), st));
    SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(st).Prepend("gradient norm (host wait)"));
    double sq = 0.0;
    for (int r = 0; r < nranks_; ++r) sq += d.hSq[r];
    gradNorm_ = std::sqrt(sq);
    if (std::isfinite(gradNorm_)) {
      const double c = static_cast<double>(hyper_.maxGradNorm) / (gradNorm_ + 1e-6);
      if (c < 1.0) clipScale_ = std::max(static_cast<float>(c), FLT_MIN);
    }
  }
  // "segment_rms": the staying sums of every piece from the full reduced payload (every rank
  // holds it, in both ownerships), block sums on the device, the rest as the host step (a host
  // wait, like the clipping's).
  if (SegmentRms()) {
    SCAPE_RETURN_IF_ERROR(StayingPlan(0, false));
    const size_t nb = staySum_.size();
    if (nb > d.stayCap) {
      d.rt->DeviceFree(d.dStaySum);
      d.rt->DeviceFree(d.dStayCnt);
      d.dStaySum = nullptr;
      d.dStayCnt = nullptr;
      d.stayCap = 0;
      SCAPE_RETURN_IF_ERROR(Alloc(rt, nb, &d.dStaySum));
      SCAPE_RETURN_IF_ERROR(Alloc(rt, nb, &d.dStayCnt));
      d.stayCap = nb;
    }
    if (nb) {
      SCAPE_RETURN_IF_ERROR(rt->StayingGradSqBlocks(d.dRecv, pt, d.dMaskOrder, d.dM, n,
                                                    hyper_.beta1, stayBounds_.data(), nb,
                                                    d.dStaySum, d.dStayCnt, st)
                                .Prepend("segment_rms sums"));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(staySum_.data(), d.dStaySum, 8 * nb, st));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(stayCnt_.data(), d.dStayCnt, 8 * nb, st));
      SCAPE_RETURN_IF_ERROR(rt->StreamSynchronize(st).Prepend("segment_rms sums (host wait)"));
    }
    StayingFinish();
    EnterVsFromPieces();
  }
  phase_[scapeOptimPhaseNorm] = static_cast<double>(NowNs() - t0) * 1e-9;
  if (agree && !std::isfinite(gradNorm_)) {
    // Finite gradients, a reduced payload that is not (seen only with clipping, where the norm
    // is computed): the update is left out, as in the host step.
    SCAPE_RETURN_IF_ERROR(SkipAfterExchange());
    const uint64_t kd = denseCount_, ks_ = k - std::min(k, kd);
    const uint64_t r = nranks_ <= 1 ? 0 : static_cast<uint64_t>(nranks_ - 1);
    payloadBytes_ = 2 * (ks_ * esz * r / static_cast<uint64_t>(nranks_));
    denseBytes_ = 2 * (kd * esz * r / static_cast<uint64_t>(nranks_));
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
  const void* recvSorted = d.dRecv;
  if (!identity && k) {
    SCAPE_RETURN_IF_ERROR(rt->Gather(d.dRecv, d.dPerm, k, esz, d.dPaySorted, st));
    recvSorted = d.dPaySorted;
  }
  if (copy_ == nullptr) {
    SCAPE_RETURN_IF_ERROR(
        rt->UnpackAdamSUpdate(recvSorted, pt, dSortedMask, k, dTheta, d.dM, n, ap, st)
            .Prepend("AdamS update"));
  } else {
    // Mixed precision: the masters and the 16-bit params in the same pass.
    SCAPE_RETURN_IF_ERROR(rt->UnpackAdamSUpdateCopy(recvSorted, pt, dSortedMask, k, dTheta, d.dM, n,
                                                    ap, copy_->p, copy_->type, st)
                              .Prepend("AdamS update"));
  }
  phase_[scapeOptimPhaseUpdate] = static_cast<double>(NowNs() - t0) * 1e-9;

  const uint64_t kd = denseCount_, ks_ = k - std::min(k, kd);
  auto ring = [&](uint64_t b) { return nranks_ <= 1 ? 0 : b * (nranks_ - 1) / nranks_; };
  if (!sharded) {
    payloadBytes_ = 2 * ring(ks_ * esz);
    denseBytes_ = 2 * ring(kd * esz);
  } else {
    payloadBytes_ = 2 * ring(ks_ * esz);
    denseBytes_ = 2 * ring(kd * esz);
  }
  // The non-finite agreement; the norm partials stay on this rank (no exchange).
  controlBytes_ = agree ? 8 * static_cast<uint64_t>(nranks_ - 1) : 0;
  ++step_;
  // Start the next mask's sync now if the selection is already done (no wait).
  bool done = false;
  if (rt->EventQuery(d.selDone, &done).ok() && done) SCAPE_RETURN_IF_ERROR(DeviceFinishSelect());
  return Status::Ok();
}

}  // namespace scape
