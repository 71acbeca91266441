// HostBackend, the routing rule (DataPath) and the host copies of device buffers: see
// backend.h.
#include <algorithm>
#include <utility>

#include "kernels/cpu/gather.h"
#include "plugin/backend/backend.h"

namespace scape {
namespace backend {

Status HostBackend::Admit(const coll::CollArgs& a, Stream s, bool) {
  if (a.type == coll::CollType::kBarrier || !s) return Status::Ok();
  // Host buffers on a stream: what the caller queued on the stream must finish first.
  Status st = device::StreamWaitFor(device::GetRuntime(), s, comm_->config().timeoutMs,
                                    "the work queued on the stream before the host buffers' call");
  if (!st.ok()) st.Prepend(StrFormat("rank %d: host buffers with a non-NULL stream", rank()));
  return st;
}

Status HostBackend::Run(const coll::CollArgs& a, Stream, std::shared_ptr<PendingOp>* async,
                        std::function<void()> onDone) {
  std::shared_ptr<PendingOp> op;
  SCAPE_RETURN_IF_ERROR(comm_->Submit(a, &op, std::move(onDone)));
  if (!async) return comm_->Wait(op.get());
  *async = std::move(op);
  return Status::Ok();
}

Status HostBackend::AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                                    std::shared_ptr<PendingOp>* async,
                                    std::function<void()> onDone) {
  a.counts = m.RankCounts();  // owner blocks: the same bits as reduce-scatter + all-gather
  return Run(a, s, async, std::move(onDone));
}

Status HostBackend::Positions(const Mask& m, Stream, const uint64_t** pos) {
  *pos = m.Current().data();
  return Status::Ok();
}

Status HostBackend::AcquirePacked(Mask& m, size_t k, size_t esz, Stream, bool async, Packed* out) {
  std::shared_ptr<const std::vector<uint64_t>> pos = m.CurrentShared();
  out->pos = pos->data();
  if (!async) {
    // The mask's packing buffer (kept between calls: no allocation or page faults per step).
    out->buf = m.PackBuffer(k * esz + 1);
    return Status::Ok();
  }
  // The operation owns its buffer and holds the positions it packed.
  struct Held {
    std::vector<char> buf;
    std::shared_ptr<const std::vector<uint64_t>> pos;
  };
  auto held = std::make_shared<Held>();
  held->buf.resize(k * esz + 1);
  held->pos = std::move(pos);
  out->buf = held->buf.data();
  out->hold = std::move(held);
  return Status::Ok();
}

void HostBackend::ReleasePacked(Packed* p, Stream) { p->hold.reset(); }

Status HostBackend::Gather(const void* dense, const uint64_t* pos, size_t k, size_t esz,
                           void* packed, Stream) {
  kernels::GatherByIndex(dense, pos, k, esz, packed);
  return Status::Ok();
}

Status HostBackend::Scatter(const void* packed, const uint64_t* pos, size_t k, size_t esz,
                            void* dense, Stream) {
  kernels::ScatterByIndex(packed, pos, k, esz, dense);
  return Status::Ok();
}

namespace {
bool IsDev(device::PtrKind k) { return k != device::PtrKind::kHost; }
Mem MemOf(device::PtrKind k) { return IsDev(k) ? Mem::kDevice : Mem::kHost; }
}  // namespace

Status BufferKinds(const coll::CollArgs& a, int rank, Buffers* out) {
  device::Runtime* rt = device::GetRuntime();
  const bool needSend = a.type != coll::CollType::kBroadcast || rank == a.root;
  const bool hasSend = needSend && a.send, hasRecv = a.recv != nullptr;
  const device::PtrKind ks = hasSend ? rt->Kind(a.send) : device::PtrKind::kHost;
  const device::PtrKind kr = hasRecv ? rt->Kind(a.recv) : device::PtrKind::kHost;
  out->barrier = a.type == coll::CollType::kBarrier;
  out->send = hasSend ? MemOf(ks) : Mem::kNone;
  out->recv = hasRecv ? MemOf(kr) : Mem::kNone;
  if (out->Mixed())
    return InvalidArgument(StrFormat(
        "rank %d: sendbuf is %s but recvbuf is %s: a collective's buffers must both be host "
        "memory or both device memory",
        rank, device::PtrKindName(ks), device::PtrKindName(kr)));
  return Status::Ok();
}

// The backends' lists, in routing order: the first that takes a call runs it.
std::unique_ptr<DataPath> DataPath::ForUcx(Comm* comm) {
  std::unique_ptr<DataPath> d(new DataPath());
  d->host_.reset(new HostBackend(comm));
  d->device_.reset(new UcxStagedBackend(comm));
  d->order_ = {d->host_.get(), d->device_.get()};
  return d;
}

std::unique_ptr<DataPath> DataPath::ForNccl(Comm* host, std::unique_ptr<device::NcclComm> nccl,
                                            int timeoutMs, const scapeDeviceAllocator_t& alloc) {
  std::unique_ptr<DataPath> d(new DataPath());
  // NCCL first: it takes calls without buffers; the host communicator, when there is one, takes
  // barriers and host buffers.
  d->device_.reset(new NcclBackend(std::move(nccl), timeoutMs, alloc));
  d->order_.push_back(d->device_.get());
  if (host) {
    d->host_.reset(new HostBackend(host));
    d->order_.push_back(d->host_.get());
  }
  return d;
}

bool DataPath::Topology(RankSpace* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  for (Backend* b : order_)
    if (b->Topology(out)) return true;
  return false;
}

Backend* DataPath::Pick(const Buffers& b) const {
  for (Backend* be : order_)
    if (be->Takes(b)) return be;
  return nullptr;
}

Status DataPath::Route(const coll::CollArgs& a, Backend** out) const {
  *out = nullptr;
  if (order_.empty()) return InvalidUsage("the communicator's data path has been released");
  Buffers b;
  const Status kinds = BufferKinds(a, order_.front()->rank(), &b);
  *out = Pick(b);
  if (*out) return Status::Ok();
  if (!kinds.ok()) return kinds;  // a mix no backend takes
  *out = order_.front();          // its Admit names what it cannot do
  return Status::Ok();
}

Status DataPath::RouteBuffers(const void* dense, const void* packed, Backend** out) const {
  device::Runtime* rt = device::GetRuntime();
  const device::PtrKind kd = dense ? rt->Kind(dense) : device::PtrKind::kHost;
  const device::PtrKind kp = packed ? rt->Kind(packed) : device::PtrKind::kHost;
  if (dense && packed && IsDev(kd) != IsDev(kp))
    return InvalidArgument(
        StrFormat("dense is %s but packed is %s: both must be host memory or both device memory",
                  device::PtrKindName(kd), device::PtrKindName(kp)));
  Buffers b;  // one memory kind for both (a NULL pointer takes the other's; both NULL: host)
  b.send = b.recv = IsDev(kd) || IsDev(kp) ? Mem::kDevice : Mem::kHost;
  *out = Pick(b);
  if (!*out) return InvalidUsage("the communicator's device data path has been released");
  return Status::Ok();
}

void DataPath::Release(int timeoutMs) {
  std::unique_ptr<DeviceBackend> dev;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dev = std::move(device_);
    order_.erase(std::remove(order_.begin(), order_.end(), dev.get()), order_.end());
  }
  // The channel (its worker and child communicator) and the device pool (waiting, within the
  // timeout, for the work that uses its blocks) go here, before the parent communicator.
  if (dev) dev->Release(timeoutMs);
}

void DataPath::Abort() {
  std::lock_guard<std::mutex> lk(mu_);
  if (device_) device_->Abort();
}

Status DataPath::AsyncError() const {
  std::lock_guard<std::mutex> lk(mu_);
  return device_ ? device_->AsyncError() : Status::Ok();
}

Status StageIn(const void* p, size_t bytes, std::vector<char>* copy, const void** view,
               int timeoutMs) {
  *view = p;
  if (!p || bytes == 0) return Status::Ok();
  device::Runtime* rt = device::GetRuntime();
  if (rt->Kind(p) == device::PtrKind::kHost) return Status::Ok();
  copy->resize(bytes);
  // Through page-locked staging, with a deadline (a pageable copy would wait without one).
  Status st = device::DownloadWithin(rt, copy->data(), p, bytes, nullptr, timeoutMs,
                                     "copying a device input to the host");
  if (!st.ok()) return st;
  *view = copy->data();
  return Status::Ok();
}

void StageOut(void* p, size_t bytes, std::vector<char>* copy, void** view) {
  *view = p;
  if (!p || device::GetRuntime()->Kind(p) == device::PtrKind::kHost) return;
  copy->resize(bytes);
  *view = copy->data();
}

Status FinishOut(void* p, const std::vector<char>& copy, size_t bytes, int timeoutMs) {
  if (!p || bytes == 0 || copy.empty()) return Status::Ok();
  device::HostStaging h(device::GetRuntime(), nullptr);
  Status st = h.Upload(p, copy.data(), bytes);
  if (st.ok()) st = h.Wait(timeoutMs, "copying an output to the device");
  if (!st.ok()) return st.Prepend("copying an output to the device");
  return Status::Ok();
}

}  // namespace backend
}  // namespace scape
