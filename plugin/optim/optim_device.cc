// The SCAPE-AdamS step on device buffers (scapeOptimStepStream): the step of optim_step.cc
// (RunStep, the one algorithm) over the device's kernels (DeviceKernels below: the
// stream-ordered ops of plugin/device/runtime.h), with the same bits as the host step; and the
// device state's life (allocation, the copies between host and device state).
//
// What the device kernels add to the algorithm, per step on the caller's stream:
//   the non-finite scan's one-word result is a HOST WAIT (before anything changes) |
//   the current mask is uploaded in mask order and sorted, with the permutations between them,
//   and the payload is gathered from one order to the other around the candidate and the update
//   (the device kernels take a sorted mask) | the next mask's positions are copied to pinned
//   host memory behind an event; the mask sync starts from the host at the end of the call when
//   the event has completed, else at the next optimizer call (step, checkpoint, destroy), which
//   waits for that event (a host wait on the small copy) | the payload collectives run on the
//   communicator's device backend, stream-ordered | the norm is computed only for clipping, a
//   HOST WAIT for its partials; "segment_rms"'s block sums are another.
//
// Payloads: fp32, bf16 or fp16 (hyper_.payload): the payload buffers and the gathers use its
// element size, and the exchange carries its type (on a UCX communicator the staged exchange
// reduces it on the host, with the collectives of the host step's exchange).
//
// Bits: the flat device kernels at the sorted mask compute what the host's view kernels
// compute at the mask order, entry by entry. The candidate kernel runs with keepRounding: the
// residual inside the mask is c - float(payload), the rounding error of a bf16/fp16 payload
// (+0 for fp32, and +0 when the payload value is not finite), as the host's view kernel leaves
// it. Sharded ownership runs the host's algorithm: the owner's update into (theta', m') pairs,
// their all-gather, every rank's unpack.
#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "base/clock.h"
#include "base/log.h"
#include "kernels/cpu/dtype.h"
#include "kernels/dtypes.h"
#include "plugin/backend/backend.h"
#include "plugin/optim/optim.h"
#include "plugin/optim/optim_device.h"
#include "plugin/optim/step_kernels.h"

namespace scape {
namespace {

// One of the step's packed collectives on the communicator's device backend, stream-ordered:
// the backend's own checks first (as every call the API routes to it), then the collective.
Status RunOn(backend::Backend* b, const coll::CollArgs& a, void* stream) {
  if (b == nullptr) return InternalError("the communicator has no device backend");
  SCAPE_RETURN_IF_ERROR(b->Admit(a, stream, false));
  return b->Run(a, stream, nullptr);
}

// count (>= 1) elements of T held by the device state (DeviceState::Hold).
template <typename State, typename T>
Status Alloc(State* s, size_t count, T** p) {
  void* v = nullptr;
  SCAPE_RETURN_IF_ERROR(s->Hold(sizeof(T) * std::max<size_t>(count, 1), &v));
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

namespace {

// Carves aligned sub-buffers out of one block (CUB's temp-storage layout): Take(bytes) returns
// the next piece; with base == nullptr it only adds up the size.
struct Carve {
  char* base;
  size_t off = 0;
  void* Take(size_t bytes) {
    void* p = base ? base + off : nullptr;
    off += (bytes + 255) & ~static_cast<size_t>(255);
    return p;
  }
};

}  // namespace

Status Optimizer::DeviceState::Fit(uint64_t n, uint64_t k, size_t esz, size_t wEsz, bool perm,
                                   bool pairs) {
  // Blocks dropped at earlier refits are freed once the stream has passed them.
  pool->Sweep();
  const bool refit = !scratch.d || n != statN || k > cap || k < cap / 4 || esz != payEsz ||
                     wEsz != wireEsz || (perm && !hasPerm) || (pairs && !hasPairs);
  if (!refit) return Status::Ok();
  // The parts a mask needed once stay in the new block (they are likely needed again).
  const bool wantPerm = perm || hasPerm, wantPairs = pairs || hasPairs;
  const uint64_t c = std::max<uint64_t>(k, 1);
  auto layout = [&](char* base) {
    Carve cv{base};
    dStat = static_cast<float*>(cv.Take(4 * std::max<uint64_t>(n, 1)));
    dPaySorted = cv.Take(esz * c);
    dSend = cv.Take(esz * c);
    dRecv = cv.Take(esz * c);
    dMNew = static_cast<float*>(cv.Take(4 * c));
    dMaskOrder = static_cast<uint64_t*>(cv.Take(8 * c));
    dSorted = wantPerm ? static_cast<uint64_t*>(cv.Take(8 * c)) : nullptr;
    dPerm = wantPerm ? static_cast<uint64_t*>(cv.Take(8 * c)) : nullptr;
    dInv = wantPerm ? static_cast<uint64_t*>(cv.Take(8 * c)) : nullptr;
    dPairsSend = wantPairs ? static_cast<float*>(cv.Take(8 * c)) : nullptr;
    dPairsAll = wantPairs ? static_cast<float*>(cv.Take(8 * c)) : nullptr;
    dWireSend = wEsz ? cv.Take(wEsz * c) : nullptr;
    dWireRecv = wEsz ? cv.Take(wEsz * c) : nullptr;
    dAmax = wEsz ? static_cast<float*>(cv.Take(4)) : nullptr;
    return cv.off;
  };
  const size_t bytes = layout(nullptr);
  // Work queued on the stream may still use the old block: the pool frees it once the stream
  // has passed this point.
  pool->Drop(scratch, stream);
  scratch = device::DevicePool::Block();
  cap = 0;
  Status st = pool->Acquire(bytes, stream, &scratch, /*exact=*/true);
  if (!st.ok()) {
    layout(nullptr);  // no block: every pointer null
    return st.Prepend(
        StrFormat("device memory for the optimizer step's scratch (%zu bytes)", bytes));
  }
  layout(static_cast<char*>(scratch.d));
  statIsMomentum = false;  // a new block: the momentum is rebuilt from its packed form
  cap = c;
  statN = n;
  payEsz = esz;
  wireEsz = wEsz;
  hasPerm = wantPerm;
  hasPairs = wantPairs;
  return Status::Ok();
}

Status Optimizer::DeviceState::FitTop(uint64_t total) {
  if (top.d && total <= topCap && total >= topCap / 4) return Status::Ok();
  // Idle: the last selection's top-k and copy have run (DeviceFinishSelect, at the start of
  // this step, waited for the event recorded after them).
  if (selPending) return InternalError("the top-k output is resized with a selection pending");
  pool->Drop(top, stream);
  top = device::DevicePool::Block();
  dTop = nullptr;
  if (hTop) rt->HostFree(hTop);
  hTop = nullptr;
  topCap = 0;
  const uint64_t c = std::max<uint64_t>(total, 1);
  SCAPE_RETURN_IF_ERROR(
      pool->Acquire(8 * c, stream, &top, /*exact=*/true).Prepend("device memory for the top-k"));
  dTop = static_cast<uint64_t*>(top.d);
  void* h = nullptr;
  SCAPE_RETURN_IF_ERROR(rt->HostAlloc(8 * c, &h));
  hTop = static_cast<uint64_t*>(h);
  topCap = c;
  return Status::Ok();
}

Status Optimizer::DeviceState::FitMom(uint64_t km) {
  if (mom.d && km <= momCap && km >= momCap / 4) return Status::Ok();
  pool->Drop(mom, stream);
  mom = device::DevicePool::Block();
  dMp = nullptr;
  dMomIdx = nullptr;
  momCap = 0;
  const uint64_t c = std::max<uint64_t>(km, 1);
  Carve cv{nullptr};
  cv.Take(8 * c);
  cv.Take(4 * c);
  SCAPE_RETURN_IF_ERROR(pool->Acquire(cv.off, stream, &mom, /*exact=*/true)
                            .Prepend("device memory for the packed momentum"));
  Carve at{static_cast<char*>(mom.d)};
  dMomIdx = static_cast<uint64_t*>(at.Take(8 * c));
  dMp = static_cast<float*>(at.Take(4 * c));
  momCap = c;
  return Status::Ok();
}

uint64_t Optimizer::DeviceState::ScratchBytes() const {
  return scratch.bytes + top.bytes - IndexBytes();
}

uint64_t Optimizer::DeviceState::IndexBytes() const { return cap * 8 * (hasPerm ? 4 : 1); }

Status Optimizer::DeviceState::Hold(size_t bytes, void** p) {
  *p = nullptr;
  device::DevicePool::Block b;
  SCAPE_RETURN_IF_ERROR(
      pool->Acquire(bytes, stream, &b, /*exact=*/true)
          .Prepend(StrFormat("device memory for the optimizer state (%zu bytes)", bytes)));
  held.push_back(b);
  *p = b.d;
  return Status::Ok();
}

void Optimizer::DeviceState::Unhold(void* p) {
  if (!p) return;
  for (auto it = held.begin(); it != held.end(); ++it)
    if (it->d == p) {
      pool->Drop(*it, stream);
      held.erase(it);
      return;
    }
}

Optimizer::DeviceState::~DeviceState() {
  if (!rt) return;
  // The pool's blocks go back for good (the stream was synchronised: DeviceRelease).
  if (pool) {
    pool->Drop(scratch, stream);
    pool->Drop(top, stream);
    pool->Drop(mom, stream);
    for (const device::DevicePool::Block& b : held) pool->Drop(b, stream);
  }
  if (hTop) rt->HostFree(hTop);
  if (hSq) rt->HostFree(hSq);
  if (hFlag) rt->HostFree(hFlag);
  if (hStay) rt->HostFree(hStay);
  if (selDone) rt->EventDestroy(selDone);
}

void Optimizer::DeviceRelease() {
  if (!dev_) return;
  if (dev_->rt) {
    // Within the communicator's deadline: the state's memory is freed only once the stream has
    // passed the last step (a stuck stream leaks it, as the device pool leaks a block still in
    // use, rather than freeing it under the device or hanging scapeCommAbort). After an abort
    // (a watchdog's) the wait is the pool's abandon wait, not the whole timeout.
    const int waitMs =
        comm_->AbortRequested() ? device::DevicePool::kAbandonWaitMs : comm_->config().timeoutMs;
    Status st = device::StreamWaitFor(dev_->rt, dev_->stream, waitMs,
                                      "releasing the optimizer's device state");
    if (!st.ok()) {
      SCAPE_WARN("%s; its device memory is leaked rather than freed under the device",
                 st.message().c_str());
      (void)dev_.release();
      return;
    }
  }
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
  SCAPE_RETURN_IF_ERROR(device::StreamWaitFor(d.rt, d.stream, comm_->config().timeoutMs,
                                              "finishing the last device step"));
  // The device's packed momentum (sorted positions) comes back; the host keeps it in its own
  // packed form (PackMomentum: on the current mask unless values lie outside it).
  std::vector<float> mp(d.kMom), dense(n, 0.0f);
  std::vector<uint64_t> idx(d.kMom);
  // Through page-locked staging, waited for with the communicator's deadline: the copies never
  // write into these locals or the state after a timeout (the staging is leaked instead), and
  // a pageable destination would make each copy wait for the stream with no deadline.
  std::vector<float> e(n), master;
  device::HostStaging stage(d.rt, d.stream);
  if (d.kMom) {
    SCAPE_RETURN_IF_ERROR(stage.Download(mp.data(), d.dMp, 4 * d.kMom));
    SCAPE_RETURN_IF_ERROR(stage.Download(idx.data(), d.dMomIdx, 8 * d.kMom));
  }
  SCAPE_RETURN_IF_ERROR(stage.Download(e.data(), d.dE, 4 * n));
  const bool masters = masterType_ != scapeFloat32 && d.dMaster;
  if (masters) {
    master.resize(n);
    SCAPE_RETURN_IF_ERROR(stage.Download(master.data(), d.dMaster, 4 * n));
  }
  SCAPE_RETURN_IF_ERROR(
      stage.Wait(comm_->config().timeoutMs, "copying the device state to the host"));
  e_.swap(e);
  if (masters) master_.swap(master);
  for (uint64_t j = 0; j < d.kMom; ++j) {
    if (idx[j] >= n) return InternalError("the device momentum has a position beyond n");
    dense[idx[j]] = mp[j];
  }
  PackMomentum(dense.data());
  return Status::Ok();
}

Status Optimizer::DevicePush() {
  DeviceState& d = *dev_;
  const size_t n = layout_.n;
  SCAPE_RETURN_IF_ERROR(device::StreamWaitFor(d.rt, d.stream, comm_->config().timeoutMs,
                                              "finishing the last device step"));
  // The packed momentum in position order (the device's form): its mask's entries, sorted.
  const kernels::MaskView mv = MomentumView();
  std::vector<uint64_t> order(mv.k);
  for (uint64_t j = 0; j < mv.k; ++j) order[j] = j;
  std::sort(order.begin(), order.end(),
            [&](uint64_t a, uint64_t b) { return mv.idx[a] < mv.idx[b]; });
  std::vector<uint64_t> idx(mv.k);
  std::vector<float> mp(mv.k);
  for (uint64_t j = 0; j < mv.k; ++j) {
    idx[j] = mv.idx[order[j]];
    mp[j] = m_[order[j]];
  }
  SCAPE_RETURN_IF_ERROR(d.FitMom(mv.k));
  d.kMom = mv.k;
  d.statIsMomentum = false;  // a new momentum (a loaded checkpoint, the host's state)
  // Through page-locked staging (the sources are copied at once), waited for with the
  // communicator's deadline.
  device::HostStaging stage(d.rt, d.stream);
  if (mv.k) {
    SCAPE_RETURN_IF_ERROR(stage.Upload(d.dMp, mp.data(), 4 * mv.k));
    SCAPE_RETURN_IF_ERROR(stage.Upload(d.dMomIdx, idx.data(), 8 * mv.k));
  }
  SCAPE_RETURN_IF_ERROR(stage.Upload(d.dE, e_.data(), 4 * n));
  // The master weights live beside the state while the optimizer has them.
  if (masterType_ != scapeFloat32) {
    if (!d.dMaster) SCAPE_RETURN_IF_ERROR(Alloc(&d, n, &d.dMaster));
    SCAPE_RETURN_IF_ERROR(stage.Upload(d.dMaster, master_.data(), 4 * n));
  } else if (d.dMaster) {
    d.Unhold(d.dMaster);
    d.dMaster = nullptr;
  }
  return stage.Wait(comm_->config().timeoutMs, "copying the state to the device");
}

Status Optimizer::DeviceToHost() {
  SCAPE_RETURN_IF_ERROR(DevicePull());
  DeviceRelease();
  return Status::Ok();
}

Status Optimizer::StepDeviceMixed(void* dParams, scapeDataType_t paramType, const void* dG,
                                  scapeDataType_t gradType, void* stream,
                                  backend::Backend* exchange) {
  std::unique_ptr<StepRun> run;
  SCAPE_RETURN_IF_ERROR(
      PrepareDeviceMixed(dParams, paramType, dG, gradType, stream, exchange, &run));
  return RunStep(*run);
}

Status Optimizer::PrepareDeviceMixed(void* dParams, scapeDataType_t paramType, const void* dG,
                                     scapeDataType_t gradType, void* stream,
                                     backend::Backend* exchange, std::unique_ptr<StepRun>* run) {
  SCAPE_RETURN_IF_ERROR(CheckMixedTypes(paramType, gradType));
  if (!comm_->error().ok()) return comm_->error();
  device::Runtime* rt = device::GetRuntime();
  const uint64_t n = layout_.n;
  if (paramType != scapeFloat32 && masterType_ == scapeFloat32) {
    // The first mixed step: the masters are the params, widened exactly. A host wait (once):
    // params come to the host after the work queued before them on the stream.
    if (dev_) SCAPE_RETURN_IF_ERROR(DevicePull().Prepend("finishing the previous device step"));
    std::vector<uint16_t> h(n);
    SCAPE_RETURN_IF_ERROR(device::DownloadWithin(rt, h.data(), dParams, 2 * n, stream,
                                                 comm_->config().timeoutMs,
                                                 "copying params to the host"));
    master_.resize(n);
    if (paramType == scapeBfloat16)
      kernels::ConvertBf16ToFloat(h.data(), master_.data(), n);
    else
      kernels::ConvertFp16ToFloat(h.data(), master_.data(), n);
    masterType_ = paramType;
    if (dev_)
      SCAPE_RETURN_IF_ERROR(DevicePush().Prepend("moving the master weights to the device"));
  }
  // dTheta = nullptr: the device master weights (DeviceKernels).
  SCAPE_RETURN_IF_ERROR(
      PrepareDevice(paramType != scapeFloat32 ? nullptr : static_cast<float*>(dParams),
                    static_cast<const float*>(dG), stream, exchange, run));
  if (paramType != scapeFloat32) {
    (*run)->copy.p = dParams;
    (*run)->copy.type = paramType;
    copy_ = &(*run)->copy;
  }
  devGradType_ = gradType;
  return Status::Ok();
}

// The device step's kernels (step_kernels.h): the stream-ordered ops of the device runtime on
// the state in device memory (DeviceState), the payload collectives on the communicator's
// device backend on the step's stream. The momentum is packed at the mask of the last update
// (DeviceState::dMp / dMomIdx) and rebuilt densely in the statistic's buffer for the kernels,
// which read m by position. The device kernels take the mask sorted (strictly increasing); the
// payload is in mask order (per owner, its pieces in layout order), so the mask is uploaded in both
// orders with the permutations between them, and the payload is gathered from one to the other
// around the candidate and the update (skipped when the two orders are the same).
struct Optimizer::DeviceKernels final : Optimizer::StepKernels {
  DeviceKernels(Optimizer* o, float* dTheta, const float* dG, void* stream,
                backend::Backend* exchange)
      : o(o), dTheta(dTheta), dG(dG), st(stream), exchange(exchange) {}
  Optimizer* o;
  float* dTheta;
  const float* dG;
  void* st;
  backend::Backend* exchange;
  device::Runtime* rt = nullptr;
  DeviceState* d = nullptr;
  bool identity = true;  // sorted order == mask order
  const uint64_t* dSortedMask = nullptr;
  uint64_t k = 0;

  scapeDataType_t Pt() const { return o->KernelPayload(); }
  // The deadline of the step's host waits: the communicator's timeout.
  int TimeoutMs() const { return o->comm_->config().timeoutMs; }
  size_t Esz() const { return scapeTypeSize(Pt()); }

  Status Begin() override {
    rt = device::GetRuntime();
    const uint64_t n = o->layout_.n;
    if (!o->dev_) {
      // The first device step: the state moves to device memory.
      std::shared_ptr<device::DevicePool> pool = exchange ? exchange->SharedPool() : nullptr;
      if (!pool) return InternalError("the communicator has no device backend");
      std::unique_ptr<DeviceState> s(new DeviceState());
      s->rt = rt;
      s->stream = st;
      s->pool = std::move(pool);
      SCAPE_RETURN_IF_ERROR(Alloc(s.get(), n, &s->dE));
      // The scratch, the top-k output and the momentum are pool blocks fitted at each step
      // (Fit, FitTop, FitMom).
      SCAPE_RETURN_IF_ERROR(Alloc(s.get(), static_cast<size_t>(o->nranks_), &s->dSq));
      void* h = nullptr;
      SCAPE_RETURN_IF_ERROR(rt->HostAlloc(8 * static_cast<size_t>(o->nranks_), &h));
      s->hSq = static_cast<double*>(h);
      SCAPE_RETURN_IF_ERROR(Alloc(s.get(), 1, &s->dFlag));
      SCAPE_RETURN_IF_ERROR(rt->HostAlloc(4, &h));
      s->hFlag = static_cast<uint32_t*>(h);
      SCAPE_RETURN_IF_ERROR(rt->EventCreate(&s->selDone));
      o->dev_ = std::move(s);
      Status ps = o->DevicePush();
      if (!ps.ok()) {
        o->dev_.reset();
        return ps.Prepend("moving the optimizer state to the device");
      }
    }
    d = o->dev_.get();
    if (d->rt != rt) return InvalidUsage("the device runtime changed since the last device step");
    if (o->copy_ != nullptr)
      dTheta = d->dMaster;  // mixed precision: the update runs on the masters
    // The previous step's selection starts its mask sync now, at the latest.
    SCAPE_RETURN_IF_ERROR(o->DeviceFinishSelect());
    if (st != d->stream) {
      // The state and scratch are ordered on the last step's stream: finish it first.
      SCAPE_RETURN_IF_ERROR(
          device::StreamWaitFor(rt, d->stream, TimeoutMs(), "the previous step's stream"));
      d->stream = st;
    }
    return Status::Ok();
  }

  // The scan on the stream, then a HOST WAIT for its one-word result (no position known).
  Status FindNonFinite(bool* bad, uint64_t*, float*) override {
    SCAPE_RETURN_IF_ERROR(rt->AnyNonFinite(dG, o->layout_.n, o->devGradType_, d->dFlag, st)
                              .Prepend("non-finite check"));
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d->hFlag, d->dFlag, 4, st));
    // A host wait with the communicator's deadline (the flag lands in the state's pinned
    // word, which outlives a timeout).
    SCAPE_RETURN_IF_ERROR(
        device::StreamWaitFor(rt, st, TimeoutMs(), "non-finite check (host wait)"));
    *bad = *d->hFlag != 0;
    return Status::Ok();
  }

  // The mask in mask order, sorted (the runs in position order), and the permutations:
  // sorted slot s holds mask entry perm[s]; mask slot j is sorted slot inv[j].
  Status PrepareMask(uint64_t kk, uint64_t, bool sharded) override {
    k = kk;
    const std::vector<uint64_t>& cur = o->mask_->Current();
    // The uploads' source: one host array (mask order, sorted, perm, inv; k words each), new
    // at each step and held by the pool until the stream has run the copies (pageable memory:
    // CUDA may read it only when the stream gets there, so it must not be reused or freed
    // before, even if the step fails or the optimizer is torn down in between).
    auto up = std::make_shared<std::vector<uint64_t>>(4 * k);
    uint64_t* hMaskOrder = up->data();
    uint64_t *hSorted = hMaskOrder + k, *hPerm = hSorted + k, *hInv = hPerm + k;
    std::copy(cur.begin(),
              cur.begin() + static_cast<std::ptrdiff_t>(std::min<uint64_t>(k, cur.size())),
              hMaskOrder);
    std::vector<kernels::MaskRun> byPos = o->runs_;
    std::sort(byPos.begin(), byPos.end(), [](const kernels::MaskRun& a, const kernels::MaskRun& b) {
      return a.begin < b.begin;
    });
    uint64_t s = 0;
    for (const kernels::MaskRun& r : byPos)
      for (uint64_t j = r.jb; j < r.je; ++j, ++s) {
        if (s >= k || j >= k) continue;  // counted: the check below reports it
        hSorted[s] = cur[j];
        hPerm[s] = j;
        hInv[j] = s;
      }
    if (s != k)
      return InternalError(StrFormat("rank %d: mask runs cover %llu of %llu entries", o->rank_,
                                     static_cast<unsigned long long>(s),
                                     static_cast<unsigned long long>(k)));
    identity = true;
    for (uint64_t q = 0; q < k && identity; ++q) identity = hPerm[q] == q;
    // Scratch for k entries (a loaded checkpoint may have changed the payload type).
    const scapeDataType_t wire = static_cast<scapeDataType_t>(o->hyper_.payload);
    SCAPE_RETURN_IF_ERROR(d->Fit(o->layout_.n, k, Esz(),
                                 dtypes::IsScaled(wire) ? scapeTypeSize(wire) : 0, !identity,
                                 sharded));
    if (k) {
      // Staged through the runtime's page-locked buffers (no host wait; the pool still holds
      // `up` for a runtime without them, whose UploadStaged is a plain copy).
      Status st2 = rt->UploadStaged(d->dMaskOrder, hMaskOrder, 8 * k, st);
      if (st2.ok() && !identity) st2 = rt->UploadStaged(d->dSorted, hSorted, 8 * k, st);
      if (st2.ok() && !identity) st2 = rt->UploadStaged(d->dPerm, hPerm, 8 * k, st);
      if (st2.ok() && !identity) st2 = rt->UploadStaged(d->dInv, hInv, 8 * k, st);
      d->pool->Release(device::DevicePool::Block(), st, std::move(up));
      SCAPE_RETURN_IF_ERROR(st2);
    }
    dSortedMask = identity ? d->dMaskOrder : d->dSorted;
    return Status::Ok();
  }

  // The candidate is the statistic. A bf16/fp16 payload's rounding error stays in the residual
  // inside the mask, as in the host step.
  Status Candidate() override {
    const uint64_t n = o->layout_.n;
    // m_{t-1} dense in dStat (+0 outside its mask), and at this mask's entries in dMNew for
    // after the candidate pass, which turns dStat into the statistic in place. After an update
    // dStat holds exactly that already (the update wrote m_t there, +0 outside the mask, and
    // Finish packed it): then no memset and no scatter.
    if (!d->statIsMomentum) {
      SCAPE_RETURN_IF_ERROR(rt->Memset(d->dStat, 0, 4 * n, st).Prepend("momentum"));
      if (d->kMom) SCAPE_RETURN_IF_ERROR(rt->Scatter(d->dMp, d->dMomIdx, d->kMom, 4, d->dStat, st));
    }
    d->statIsMomentum = false;
    if (k) SCAPE_RETURN_IF_ERROR(rt->Gather(d->dStat, dSortedMask, k, 4, d->dMNew, st));
    float* dM = d->dStat;
    void* paySorted = identity ? d->dSend : d->dPaySorted;
    if (o->devGradType_ == scapeFloat32) {
      SCAPE_RETURN_IF_ERROR(rt->CandidatePackResidual(dM, dG, d->dE, n, o->hyper_.beta1,
                                                      dSortedMask, k, Pt(), paySorted, d->dStat, st,
                                                      o->gradScale_)
                                .Prepend("candidate"));
    } else {
      SCAPE_RETURN_IF_ERROR(rt->CandidatePackResidualGrad(dM, dG, o->devGradType_, d->dE, n,
                                                          o->hyper_.beta1, dSortedMask, k, Pt(),
                                                          paySorted, d->dStat, st, o->gradScale_)
                                .Prepend("candidate"));
    }
    if (!identity && k)
      SCAPE_RETURN_IF_ERROR(rt->Gather(paySorted, d->dInv, k, Esz(), d->dSend, st));
    return Status::Ok();
  }

  // Top-k over this rank's owned pieces, as Mask::SelectNextTopk does it; the positions reach
  // the host through pinned memory and an event, and the mask sync starts from there
  // (DeviceFinishSelect: at the end of this step when the event has completed, else at the
  // next optimizer call).
  Status SelectNext(double density) override {
    device::ScopedTempSource temps(rt, d->pool.get());  // the ops' temporaries: the pool's
    Mask::TopkTable t;
    o->mask_->TopkPlan(density, &t);
    SCAPE_RETURN_IF_ERROR(d->FitTop(t.total));
    if (t.total > 0) {  // else only always-dense pieces (added by the mask), or none
      if (t.k.size() > d->countsCap) {
        d->Unhold(d->dCounts);
        d->dCounts = nullptr;
        SCAPE_RETURN_IF_ERROR(Alloc(d, t.k.size(), &d->dCounts));
        d->countsCap = t.k.size();
      }
      SCAPE_RETURN_IF_ERROR(
          rt->TopkAbs(d->dStat, t.Segments(), kernels::TopkOptions(), d->dTop, d->dCounts, st)
              .Prepend("top-k selection"));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d->hTop, d->dTop, 8 * t.total, st));
    }
    SCAPE_RETURN_IF_ERROR(rt->EventRecord(d->selDone, st));
    d->selCount = t.total;
    d->selPending = true;
    // The statistic has been read (in stream order): dStat holds m_{t-1} at the mask again for
    // the norm, the update and the pairs, which read m only at masked positions.
    if (k) SCAPE_RETURN_IF_ERROR(rt->Scatter(d->dMNew, dSortedMask, k, 4, d->dStat, st));
    return Status::Ok();
  }

  void* Send() override { return d->dSend; }
  void* Recv() override { return d->dRecv; }
  float* PairsSend() override { return d->dPairsSend; }
  float* PairsAll() override { return d->dPairsAll; }
  Status Exchange(const coll::CollArgs& a) override { return RunOn(exchange, a, st); }
  Status ScaledAmax(uint64_t k, float** amax) override {
    SCAPE_RETURN_IF_ERROR(rt->PayloadAmax(static_cast<const float*>(d->dSend), k, d->dAmax, st)
                              .Prepend("payload scale"));
    *amax = d->dAmax;
    return Status::Ok();
  }
  Status Quantize(scapeDataType_t wire, uint64_t k, uint64_t, void** wireSend,
                  void** wireRecv) override {
    SCAPE_RETURN_IF_ERROR(rt->QuantizeScaled(static_cast<const float*>(d->dSend), k, wire, d->dAmax,
                                             o->nranks_, d->dWireSend, d->dMaskOrder, d->dE, st)
                              .Prepend("payload conversion"));
    *wireSend = d->dWireSend;
    *wireRecv = d->dWireRecv;
    return Status::Ok();
  }
  Status Dequantize(scapeDataType_t wire, uint64_t count) override {
    return rt
        ->DequantizeScaled(d->dWireRecv, count, wire, d->dAmax, o->nranks_,
                           static_cast<float*>(d->dRecv), st)
        .Prepend("payload conversion");
  }
  bool NormAlways() const override { return false; }

  Status LocalGradSqNorm(double* out) override {
    device::ScopedTempSource temps(rt, d->pool.get());
    SCAPE_RETURN_IF_ERROR(rt->GradSqNorm(dG, o->devGradType_, o->layout_.n, d->dSq, st)
                              .Prepend("local gradient norm"));
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d->hSq, d->dSq, 8, st));
    SCAPE_RETURN_IF_ERROR(
        device::StreamWaitFor(rt, st, TimeoutMs(), "local gradient norm (host wait)"));
    *out = d->hSq[0];
    return Status::Ok();
  }

  Status NormPartials(const NormBlock* b, size_t nb, double* out) override {
    device::ScopedTempSource temps(rt, d->pool.get());
    if (nb > static_cast<size_t>(o->nranks_)) return InternalError("more norm blocks than ranks");
    for (size_t i = 0; i < nb; ++i)
      SCAPE_RETURN_IF_ERROR(
          rt->RecoveredGradSqNorm(static_cast<char*>(d->dRecv) + Esz() * b[i].recvSlot, Pt(),
                                  d->dMaskOrder + b[i].maskSlot, b[i].count, d->dStat, o->layout_.n,
                                  o->hyper_.beta1, d->dSq + i, st)
              .Prepend("gradient norm"));
    if (nb == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d->hSq, d->dSq, 8 * nb, st));
    SCAPE_RETURN_IF_ERROR(device::StreamWaitFor(rt, st, TimeoutMs(), "gradient norm (host wait)"));
    for (size_t i = 0; i < nb; ++i) out[i] = d->hSq[i];
    return Status::Ok();
  }

  Status StayingBlocks(uint64_t slot0) override {
    device::ScopedTempSource temps(rt, d->pool.get());
    const size_t nb = o->staySum_.size();
    if (nb > d->stayCap) {
      d->Unhold(d->dStaySum);
      d->Unhold(d->dStayCnt);
      d->dStaySum = nullptr;
      d->dStayCnt = nullptr;
      d->stayCap = 0;
      SCAPE_RETURN_IF_ERROR(Alloc(d, nb, &d->dStaySum));
      SCAPE_RETURN_IF_ERROR(Alloc(d, nb, &d->dStayCnt));
      d->stayCap = nb;
    }
    if (nb == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(rt->StayingGradSqBlocks(d->dRecv, Pt(), d->dMaskOrder + slot0, d->dStat,
                                                  o->layout_.n, o->hyper_.beta1,
                                                  o->stayBounds_.data(), nb, d->dStaySum,
                                                  d->dStayCnt, st)
                              .Prepend("segment_rms sums"));
    // Into the state's page-locked copy, waited for with the deadline (a copy into the pageable
    // staySum_ would wait for the stream with none); the sums are read only once the wait
    // succeeded, and a copy that timed out keeps its buffer (leaked, a new one next time).
    const size_t bytes = 16 * nb;
    if (bytes > d->hStayCap) {
      if (d->hStay) rt->HostFree(d->hStay);  // idle: its last copies were waited for
      d->hStay = nullptr;
      d->hStayCap = 0;
      SCAPE_RETURN_IF_ERROR(rt->HostAlloc(bytes, &d->hStay).Prepend("segment_rms sums"));
      d->hStayCap = bytes;
    }
    char* h = static_cast<char*>(d->hStay);
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(h, d->dStaySum, 8 * nb, st));
    SCAPE_RETURN_IF_ERROR(rt->CopyAsync(h + 8 * nb, d->dStayCnt, 8 * nb, st));
    Status w = device::StreamWaitFor(rt, st, TimeoutMs(), "segment_rms sums (host wait)");
    if (!w.ok()) {
      if (w.code() == scapeTimeout) {
        SCAPE_WARN(
            "%zu bytes of page-locked memory leaked: a segment_rms copy may still write "
            "them",
            bytes);
        d->hStay = nullptr;
        d->hStayCap = 0;
      }
      return w;
    }
    std::memcpy(o->staySum_.data(), h, 8 * nb);
    std::memcpy(o->stayCnt_.data(), h + 8 * nb, 8 * nb);
    return Status::Ok();
  }

  Status Update(const kernels::AdamSParams& ap) override {
    device::ScopedTempSource temps(rt, d->pool.get());
    const void* recvSorted = d->dRecv;
    if (!identity && k) {
      SCAPE_RETURN_IF_ERROR(rt->Gather(d->dRecv, d->dPerm, k, Esz(), d->dPaySorted, st));
      recvSorted = d->dPaySorted;
    }
    const uint64_t n = o->layout_.n;
    if (o->copy_ == nullptr)
      return rt->UnpackAdamSUpdate(recvSorted, Pt(), dSortedMask, k, dTheta, d->dStat, n, ap, st)
          .Prepend("AdamS update");
    // Mixed precision: the masters and the 16-bit params in the same pass.
    return rt
        ->UnpackAdamSUpdateCopy(recvSorted, Pt(), dSortedMask, k, dTheta, d->dStat, n, ap,
                                o->copy_->p, o->copy_->type, st)
        .Prepend("AdamS update");
  }

  Status UpdatePairs(const kernels::AdamSParams& ap, uint64_t offr, uint64_t kr) override {
    device::ScopedTempSource temps(rt, d->pool.get());
    return rt
        ->AdamSUpdatePairs(d->dRecv, Pt(), d->dMaskOrder + offr, kr, dTheta, d->dStat, o->layout_.n,
                           ap, d->dPairsSend, st)
        .Prepend("AdamS update");
  }

  // The gathered pairs are in mask order: into sorted order first (in dPairsSend, whose pairs
  // the all-gather has read, in stream order).
  Status UnpackPairs(const kernels::AdamSParams& ap) override {
    const float* pairs = d->dPairsAll;
    if (!identity && k) {
      SCAPE_RETURN_IF_ERROR(rt->Gather(d->dPairsAll, d->dPerm, k, 8, d->dPairsSend, st));
      pairs = d->dPairsSend;
    }
    return rt
        ->UnpackPairsDecay(pairs, dSortedMask, k, dTheta, d->dStat, o->layout_.n, ap,
                           o->copy_ ? o->copy_->p : nullptr,
                           o->copy_ ? o->copy_->type : scapeFloat32, st)
        .Prepend("unpack");
  }

  // m_t (dense in dStat after the update) is packed at this mask: the momentum's new home.
  // Then the next mask's sync starts now if the selection is already done (no wait).
  Status Finish() override {
    SCAPE_RETURN_IF_ERROR(d->FitMom(k));
    if (k) {
      SCAPE_RETURN_IF_ERROR(rt->Gather(d->dStat, dSortedMask, k, 4, d->dMp, st));
      SCAPE_RETURN_IF_ERROR(rt->CopyAsync(d->dMomIdx, dSortedMask, 8 * k, st));
    }
    d->kMom = k;
    d->statIsMomentum = true;  // m_t, dense: the next step's candidate pass starts from it
    bool done = false;
    if (rt->EventQuery(d->selDone, &done).ok() && done) return o->DeviceFinishSelect();
    return Status::Ok();
  }
};

Status Optimizer::PrepareDevice(float* dTheta, const float* dG, void* stream,
                                backend::Backend* exchange, std::unique_ptr<StepRun>* run) {
  run->reset(new StepRun(
      this, std::unique_ptr<StepKernels>(new DeviceKernels(this, dTheta, dG, stream, exchange))));
  return Status::Ok();
}

Status Optimizer::StepDevice(float* dTheta, const float* dG, void* stream,
                             backend::Backend* exchange) {
  std::unique_ptr<StepRun> run;
  SCAPE_RETURN_IF_ERROR(PrepareDevice(dTheta, dG, stream, exchange, &run));
  return RunStep(*run);
}

}  // namespace scape
