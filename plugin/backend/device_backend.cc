// The device backends (UCX staged, NCCL) and what they share: see backend.h.
#include <chrono>
#include <thread>
#include <utility>

#include "base/clock.h"
#include "base/log.h"
#include "kernels/cpu/topk.h"
#include "plugin/backend/backend.h"

namespace scape {
namespace backend {

namespace {

Status AsyncWithDevice(const char* what) {
  return Unsupported(
      StrFormat("device buffers are stream-ordered: the %s forms take host buffers only; call the "
                "blocking form, which enqueues on the stream and returns at once",
                what));
}

}  // namespace

DeviceBackend::~DeviceBackend() {
  // The positions' blocks go back to the pool before the pool goes (if this was its last
  // owner: an optimizer's device state may still hold it, SharedPool).
  positions_.reset();
  pool_.reset();
}

void DeviceBackend::MakePool(device::Runtime* rt) {
  std::lock_guard<std::mutex> lk(mu_);
  if (pool_) return;
  pool_.reset(new device::DevicePool(rt, timeoutMs_, &alloc_));
  positions_.reset(new device::MaskPositions(pool_.get()));
}

device::DevicePool& DeviceBackend::Pool() {
  MakePool(device::GetRuntime());
  return *pool_;
}

std::shared_ptr<device::DevicePool> DeviceBackend::SharedPool() {
  MakePool(device::GetRuntime());
  std::lock_guard<std::mutex> lk(mu_);
  return pool_;
}

device::MaskPositions& DeviceBackend::MaskPos() {
  MakePool(device::GetRuntime());
  return *positions_;
}

Status DeviceBackend::Positions(const Mask& m, Stream s, const uint64_t** pos) {
  return MaskPos().Get(m, s, pos);
}

Status DeviceBackend::AcquirePacked(Mask& m, size_t k, size_t esz, Stream s, bool, Packed* out) {
  if (k == 0) return Status::Ok();  // every rank has the same (agreed) mask: no values move
  Status st = MaskPos().Get(m, s, &out->pos);
  if (!st.ok()) return st.Prepend(StrFormat("rank %d", rank()));
  st = Pool().Acquire(k * esz, s, &out->blk);
  if (!st.ok())
    return st.Prepend(StrFormat("rank %d: device memory for %zu packed values", rank(), k));
  out->buf = out->blk.d;
  return Status::Ok();
}

void DeviceBackend::ReleasePacked(Packed* p, Stream s) {
  if (p->blk.d) Pool().Release(p->blk, s);
  p->blk = device::DevicePool::Block();
  p->buf = nullptr;
}

Status DeviceBackend::Gather(const void* dense, const uint64_t* pos, size_t k, size_t esz,
                             void* packed, Stream s) {
  return Pool().runtime()->Gather(dense, pos, k, esz, packed, s);
}

Status DeviceBackend::Scatter(const void* packed, const uint64_t* pos, size_t k, size_t esz,
                              void* dense, Stream s) {
  return Pool().runtime()->Scatter(packed, pos, k, esz, dense, s);
}

Status DeviceBackend::SelectTopk(Mask& m, const float* statistic, double density, Stream s) {
  if (m.SyncInFlight()) return InvalidUsage("a mask sync is in flight: wait for it first");
  // The host path's segment table and options (Mask::SelectNextTopk): the same selected set.
  Mask::TopkTable t;
  m.TopkPlan(density, &t);
  if (t.total == 0) return m.SetNextFromTopk(nullptr, 0);  // only always-dense pieces, or none
  const uint64_t total = t.total;
  device::Runtime* rt = device::GetRuntime();
  device::DevicePool& pool = Pool();
  device::DevicePool::Block dOut, dCounts;
  Status st = pool.Acquire(total * sizeof(uint64_t), s, &dOut);
  if (st.ok()) st = pool.Acquire(t.k.size() * sizeof(uint64_t), s, &dCounts);
  // On the caller's stream (NULL, the legacy default stream: ordered after the caller's work on
  // blocking streams).
  device::ScopedTempSource temps(rt, &pool);  // the top-k's table and scratch: the pool's
  if (st.ok())
    st = rt->TopkAbs(statistic, t.Segments(), kernels::TopkOptions(),
                     static_cast<uint64_t*>(dOut.d), static_cast<uint64_t*>(dCounts.d), s);
  // Only the selected positions come back (a host wait on that copy, with a deadline), into
  // page-locked memory: a copy into pageable memory returns only once it has run (CUDA), a
  // host wait without the deadline.
  void* hp = nullptr;
  if (st.ok()) st = rt->HostAlloc(total * sizeof(uint64_t), &hp);
  std::shared_ptr<uint64_t> host(static_cast<uint64_t*>(hp), [rt](uint64_t* p) {
    if (p) rt->HostFree(p);
  });
  if (st.ok()) st = rt->CopyAsync(host.get(), dOut.d, total * sizeof(uint64_t), s);
  device::Event ev = nullptr;
  if (st.ok()) st = rt->EventCreate(&ev);
  if (st.ok()) st = rt->EventRecord(ev, s);
  bool done = false;
  Deadline dl = Deadline::AfterMs(timeoutMs_);
  while (st.ok()) {
    st = rt->EventQuery(ev, &done);
    if (!st.ok() || done) break;
    if (dl.Expired()) {
      st = TimeoutError(StrFormat("the device top-k did not complete within %d ms", timeoutMs_));
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (ev) rt->EventDestroy(ev);
  // Back to the pool; if the work is not known to have finished, the copy's target stays
  // alive until it has.
  pool.Release(dOut, s, done ? nullptr : host);
  pool.Release(dCounts, s);
  if (!done) return st.Prepend("top-k of the device statistic");
  return m.SetNextFromTopk(host.get(), total);
}

void DeviceBackend::DropMask(const Mask& m) {
  std::lock_guard<std::mutex> lk(mu_);
  if (positions_) positions_->Drop(&m);
}

void DeviceBackend::DropStale(const Mask& m) {
  std::lock_guard<std::mutex> lk(mu_);
  if (positions_) positions_->DropStale(m);
}

void DeviceBackend::Abort() {
  std::lock_guard<std::mutex> lk(mu_);
  if (pool_) pool_->Abandon();
}

// --- UCX staged ---------------------------------------------------------------------------

UcxStagedBackend::~UcxStagedBackend() = default;

Status UcxStagedBackend::Admit(const coll::CollArgs&, Stream, bool async) {
  if (async) return AsyncWithDevice("*Async");
  if (!comm_->error().ok()) return comm_->error();
  return Status::Ok();
}

Status UcxStagedBackend::Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>*,
                             std::function<void()>) {
  if (!comm_->error().ok()) return comm_->error();
  device::Runtime* rt = device::GetRuntime();
  device::StagingChannel* ch = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ch = staging_.get();
  }
  if (!ch) {
    // The first device collective: the staging channel (collective: every rank makes its
    // first device collective at the same call, as every rank passes the same buffer kinds).
    std::unique_ptr<device::StagingChannel> made;
    Status st = device::StagingChannel::Create(comm_, rt, &made);
    if (!st.ok()) return st.Prepend("setting up the device staging channel");
    MakePool(rt);
    std::lock_guard<std::mutex> lk(mu_);
    staging_ = std::move(made);
    ch = staging_.get();
  }
  if (ch->runtime() != rt)
    return InvalidUsage("the device runtime changed while device work was in flight");
  return ch->Enqueue(a, s);
}

Status UcxStagedBackend::AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                                         std::shared_ptr<PendingOp>* async,
                                         std::function<void()> onDone) {
  a.counts = m.RankCounts();  // owner blocks: the host path's bits
  return Run(a, s, async, std::move(onDone));
}

void UcxStagedBackend::Release(int timeoutMs) {
  std::unique_ptr<device::StagingChannel> ch;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ch = std::move(staging_);
  }
  if (!ch) return;
  Status st = ch->Drain(ch->aborted() ? 1000 : timeoutMs);
  if (!st.ok()) SCAPE_WARN("scapeCommDestroy: %s", st.message().c_str());
}

void UcxStagedBackend::Abort() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (staging_) staging_->Abort();
  }
  DeviceBackend::Abort();
}

Status UcxStagedBackend::AsyncError() {
  std::lock_guard<std::mutex> lk(mu_);
  return staging_ ? staging_->error() : Status::Ok();
}

// --- NCCL ---------------------------------------------------------------------------------

NcclBackend::NcclBackend(std::unique_ptr<device::NcclComm> nccl, int timeoutMs,
                         const scapeDeviceAllocator_t& alloc)
    : DeviceBackend(timeoutMs, alloc), nccl_(std::move(nccl)) {
  MakePool(device::GetRuntime());  // made at init, as the NCCL communicator is
}

bool NcclBackend::Topology(RankSpace* out) const {
  out->nranks = nccl_->nranks();
  out->rank = nccl_->rank();
  out->reportAs = scapeBackendNccl;
  return true;
}

Status NcclBackend::Admit(const coll::CollArgs& a, Stream, bool async) {
  using coll::CollType;
  const int rank = nccl_->rank();
  // After scapeCommAbort (from another thread while this call is in progress): a clear error,
  // never a call on the aborted NCCL communicator (Run checks again).
  SCAPE_RETURN_IF_ERROR(nccl_->CheckOpen(coll::CollName(a.type)));
  if (a.type == CollType::kBarrier)
    return Unsupported(
        "the NCCL backend has no barrier (NCCL has none): all-reduce one "
        "element on the stream and synchronise it instead");
  if (async) return AsyncWithDevice("*Async");
  // The API validated the arguments (type, op, root, NULLs, sizes, overlap, the mask) before
  // routing the call here; what is left is what only this backend cannot do.
  const bool needSend = a.type != CollType::kBroadcast || rank == a.root;
  // Elements each side holds (per-rank blocks: a mask's packed values).
  size_t sendElems = a.count, recvElems = a.count;
  if (!a.counts.empty()) {  // the packed forms: counts are the mask's, one per rank
    size_t total = 0;
    for (size_t c : a.counts) total += c;
    const size_t mine =
        static_cast<size_t>(rank) < a.counts.size() ? a.counts[static_cast<size_t>(rank)] : 0;
    sendElems = a.type == CollType::kAllGather ? mine : total;
    recvElems = a.type == CollType::kReduceScatter ? mine : total;
  }
  if (sendElems > 0 || recvElems > 0) {
    Buffers b;
    SCAPE_RETURN_IF_ERROR(BufferKinds(a, rank, &b));  // a mix, named
    if (!b.Any(Mem::kDevice))
      return InvalidArgument(StrFormat(
          "rank %d: %s is host memory: the NCCL backend moves device memory only, and this "
          "communicator has no host communicator to run host buffers on (it was made with "
          "SCAPE_NCCL_HOST_COMM=0)",
          rank, needSend ? "sendbuf" : "recvbuf"));
  }
  return Status::Ok();
}

Status NcclBackend::Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>*,
                        std::function<void()>) {
  return nccl_->Run(a, s);
}

Status NcclBackend::AllReducePacked(const Mask&, coll::CollArgs a, Stream s,
                                    std::shared_ptr<PendingOp>*, std::function<void()>) {
  if (a.count == 0) return Status::Ok();  // nothing moves
  return nccl_->Run(a, s);
}

void NcclBackend::Release(int timeoutMs) {
  // An NCCL communicator the library made (no-op for a caller's, or one already aborted).
  nccl_->Close(false, timeoutMs);
}

void NcclBackend::Abort() {
  DeviceBackend::Abort();
  nccl_->Close(true, 1000);  // ncclCommAbort (an owned one only)
}

Status NcclBackend::AsyncError() { return nccl_->AsyncError(); }

}  // namespace backend
}  // namespace scape
