// Device dispatch: see device.h.
#include "plugin/api/device_dispatch.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "base/clock.h"
#include "base/log.h"
#include "base/param.h"
#include "kernels/cpu/topk.h"
#include "plugin/api/api_internal.h"
#include "plugin/core/comm.h"
#include "plugin/device/device_masked.h"
#include "plugin/device/device_pool.h"
#include "plugin/device/nccl_backend.h"
#include "plugin/device/runtime.h"
#include "plugin/device/staging.h"
#include "plugin/mask/mask.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/bootstrap/socket.h"

namespace scape {
namespace device {
namespace {

struct Entry {
  std::unique_ptr<StagingChannel> staging;  // UCX backend, after its first device call
  std::unique_ptr<NcclBackend> nccl;        // NCCL backend
  // Device temporaries of the mask calls (both backends); positions before pool: they go
  // back to the pool when the entry is torn down.
  std::unique_ptr<DevicePool> pool;
  std::unique_ptr<MaskPositions> positions;
};

std::mutex g_mu;
std::map<const scapeComm*, std::shared_ptr<Entry>> g_entries;

std::shared_ptr<Entry> Find(const scapeComm* comm) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_entries.find(comm);
  return it == g_entries.end() ? nullptr : it->second;
}

std::shared_ptr<Entry> Take(const scapeComm* comm) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_entries.find(comm);
  if (it == g_entries.end()) return nullptr;
  std::shared_ptr<Entry> e = it->second;
  g_entries.erase(it);
  return e;
}

void MakePool(Entry* e, Runtime* rt, int timeoutMs) {
  e->pool.reset(new DevicePool(rt, timeoutMs));
  e->positions.reset(new MaskPositions(e->pool.get()));
}

// The communicator's entry, made (with its device pool) at its first device call.
std::shared_ptr<Entry> EntryOf(scapeComm* comm, Runtime* rt) {
  std::lock_guard<std::mutex> lk(g_mu);
  std::shared_ptr<Entry>& slot = g_entries[comm];
  if (!slot) slot = std::make_shared<Entry>();
  if (!slot->pool) {
    const int timeoutMs = comm->impl ? comm->impl->config().timeoutMs : kDefaultTimeoutMs;
    MakePool(slot.get(), rt, timeoutMs);
  }
  return slot;
}

bool IsDev(PtrKind k) { return k != PtrKind::kHost; }

// Classifies a collective's buffers: *device = true for device (or managed) memory. A mix is
// an error naming both arguments.
Status CheckKinds(Runtime* rt, const coll::CollArgs& a, int rank, bool* device) {
  const bool needSend = a.type != coll::CollType::kBroadcast || rank == a.root;
  const bool hasSend = needSend && a.send, hasRecv = a.recv != nullptr;
  const PtrKind ks = hasSend ? rt->Kind(a.send) : PtrKind::kHost;
  const PtrKind kr = hasRecv ? rt->Kind(a.recv) : PtrKind::kHost;
  if (hasSend && hasRecv && IsDev(ks) != IsDev(kr))
    return InvalidArgument(StrFormat(
        "rank %d: sendbuf is %s but recvbuf is %s: a collective's buffers must both be host "
        "memory or both device memory",
        rank, PtrKindName(ks), PtrKindName(kr)));
  *device = (hasSend && IsDev(ks)) || (hasRecv && IsDev(kr));
  return Status::Ok();
}

Status AsyncWithDevice(const char* what) {
  return Unsupported(
      StrFormat("device buffers are stream-ordered: the %s forms take host buffers only; call the "
                "blocking form, which enqueues on the stream and returns at once",
                what));
}

// Enqueues a validated collective on device buffers through the communicator's staging
// channel (made at the first device collective).
Status EnqueueStaged(scapeComm* comm, Runtime* rt, const coll::CollArgs& a, Stream stream) {
  Comm& c = *comm->impl;
  if (!c.error().ok()) return c.error();
  std::shared_ptr<Entry> e = Find(comm);
  if (!e || !e->staging) {
    // The first device collective: the staging channel (collective: every rank makes its
    // first device collective at the same call, as every rank passes the same buffer kinds).
    std::unique_ptr<StagingChannel> ch;
    Status st = StagingChannel::Create(&c, rt, &ch);
    if (!st.ok()) return st.Prepend("setting up the device staging channel");
    e = EntryOf(comm, rt);
    std::lock_guard<std::mutex> lk(g_mu);
    e->staging = std::move(ch);
  }
  if (e->staging->runtime() != rt)
    return InvalidUsage("the device runtime changed while device work was in flight");
  return e->staging->Enqueue(a, stream);
}

}  // namespace

Status UcxCollective(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                     bool async, bool* handled) {
  *handled = false;
  if (a.type == coll::CollType::kBarrier) return Status::Ok();
  Runtime* rt = GetRuntime();
  Comm& c = *comm->impl;
  bool dev = false;
  SCAPE_RETURN_IF_ERROR(CheckKinds(rt, a, c.rank(), &dev));
  if (!dev) {
    if (!stream) return Status::Ok();
    // Host buffers on a stream: what the caller queued on the stream must finish first.
    Status st = rt->StreamSynchronize(stream);
    if (!st.ok()) st.Prepend(StrFormat("rank %d: host buffers with a non-NULL stream", c.rank()));
    return st;
  }
  *handled = true;
  if (async) return AsyncWithDevice("*Async");
  if (mask) return UcxMaskedAllReduce(comm, a, mask, stream);
  return EnqueueStaged(comm, rt, a, stream);
}

Status UcxMaskedAllReduce(scapeComm* comm, const coll::CollArgs& dense, scapeMask* mask,
                          void* stream) {
  Runtime* rt = GetRuntime();
  Comm& c = *comm->impl;
  if (!c.error().ok()) return c.error();
  std::shared_ptr<Entry> e = EntryOf(comm, rt);
  const Mask& m = *mask->impl;
  return MaskedAllReduce(*e->pool, *e->positions, m, dense, stream, c.rank(),
                         [&](coll::CollArgs& packed) {
                           packed.counts = m.RankCounts();  // owner blocks: the host path's bits
                           return EnqueueStaged(comm, rt, packed, stream);
                         });
}

Status MaskPackDevice(scapeMask* mask, const void* dense, void* packed, size_t esz, bool unpack,
                      bool* handled) {
  *handled = false;
  Runtime* rt = GetRuntime();
  const PtrKind kd = dense ? rt->Kind(dense) : PtrKind::kHost;
  const PtrKind kp = packed ? rt->Kind(packed) : PtrKind::kHost;
  if (dense && packed && IsDev(kd) != IsDev(kp))
    return InvalidArgument(
        StrFormat("dense is %s but packed is %s: both must be host memory or both device memory",
                  PtrKindName(kd), PtrKindName(kp)));
  if (!IsDev(kd) && !IsDev(kp)) return Status::Ok();
  *handled = true;
  const Mask& m = *mask->impl;
  const size_t k = m.Current().size();
  if (k == 0) return Status::Ok();
  if (!dense || !packed) return InvalidArgument(dense ? "packed is NULL" : "dense is NULL");
  std::shared_ptr<Entry> e = EntryOf(mask->comm, rt);
  const uint64_t* dPos = nullptr;
  Status st = e->positions->Get(m, nullptr, &dPos);
  if (st.ok())
    st = unpack ? rt->Scatter(packed, dPos, k, esz, const_cast<void*>(dense), nullptr)
                : rt->Gather(dense, dPos, k, esz, packed, nullptr);
  if (!st.ok()) st.Prepend(unpack ? "scattering on the device" : "gathering on the device");
  return st;
}

Status MaskSelectTopkDevice(scapeMask* mask, const float* statistic, double density,
                            bool* handled) {
  *handled = false;
  Runtime* rt = GetRuntime();
  if (!statistic || rt->Kind(statistic) == PtrKind::kHost) return Status::Ok();
  *handled = true;
  Mask& m = *mask->impl;
  if (m.SyncInFlight()) return InvalidUsage("a mask sync is in flight: wait for it first");
  // The host path's segment table and options (Mask::SelectNextTopk): the same selected set.
  Mask::TopkTable t;
  m.TopkPlan(density, &t);
  if (t.total == 0) return m.SetNextFromTopk(nullptr, 0);  // only always-dense pieces, or none
  const uint64_t total = t.total;
  DevicePool& pool = *EntryOf(mask->comm, rt)->pool;
  DevicePool::Block dOut, dCounts;
  Status st = pool.Acquire(total * sizeof(uint64_t), nullptr, &dOut);
  if (st.ok()) st = pool.Acquire(t.k.size() * sizeof(uint64_t), nullptr, &dCounts);
  // Legacy default stream: ordered after the caller's work on blocking streams.
  if (st.ok())
    st = rt->TopkAbs(statistic, t.Segments(), kernels::TopkOptions(),
                     static_cast<uint64_t*>(dOut.d), static_cast<uint64_t*>(dCounts.d), nullptr);
  // Only the selected positions come back (a host wait on that copy, with a deadline).
  auto host = std::make_shared<std::vector<uint64_t>>(total);
  if (st.ok()) st = rt->CopyAsync(host->data(), dOut.d, total * sizeof(uint64_t), nullptr);
  Event ev = nullptr;
  if (st.ok()) st = rt->EventCreate(&ev);
  if (st.ok()) st = rt->EventRecord(ev, nullptr);
  const int timeoutMs =
      mask->comm && mask->comm->impl ? mask->comm->impl->config().timeoutMs : kDefaultTimeoutMs;
  bool done = false;
  Deadline dl = Deadline::AfterMs(timeoutMs);
  while (st.ok()) {
    st = rt->EventQuery(ev, &done);
    if (!st.ok() || done) break;
    if (dl.Expired()) {
      st = TimeoutError(StrFormat("the device top-k did not complete within %d ms", timeoutMs));
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (ev) rt->EventDestroy(ev);
  // Back to the pool; if the work is not known to have finished, the copy's target stays
  // alive until it has.
  pool.Release(dOut, nullptr, done ? nullptr : host);
  pool.Release(dCounts, nullptr);
  if (!done) return st.Prepend("top-k of the device statistic");
  return m.SetNextFromTopk(host->data(), host->size());
}

void ReleaseMask(const scapeMask* mask) {
  std::shared_ptr<Entry> e = mask ? Find(mask->comm) : nullptr;
  if (e && e->positions && mask->impl) e->positions->Drop(mask->impl.get());
}

void DropStaleMaskPositions(const scapeMask* mask) {
  if (!mask || !mask->impl) return;
  std::shared_ptr<Entry> e = Find(mask->comm);
  if (e && e->positions) e->positions->DropStale(*mask->impl);
}

bool IsNcclComm(const scapeComm* comm) {
  if (!comm) return false;
  std::shared_ptr<Entry> e = Find(comm);
  return e && e->nccl;
}

bool NcclCommInfo(const scapeComm* comm, int* nranks, int* rank) {
  std::shared_ptr<Entry> e = comm ? Find(comm) : nullptr;
  if (!e || !e->nccl) return false;
  if (nranks) *nranks = e->nccl->nranks();
  if (rank) *rank = e->nccl->rank();
  return true;
}

Status NcclCollective(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                      bool async) {
  using coll::CollType;
  std::shared_ptr<Entry> e = Find(comm);
  if (!e || !e->nccl) return InternalError("not an NCCL-backend communicator");
  NcclBackend& b = *e->nccl;
  const int rank = b.rank();
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
    const size_t mine = a.counts[static_cast<size_t>(rank)];
    sendElems = a.type == CollType::kAllGather ? mine : total;
    recvElems = a.type == CollType::kReduceScatter ? mine : total;
  }
  Runtime* rt = GetRuntime();
  if (sendElems > 0 || recvElems > 0) {
    bool dev = false;
    SCAPE_RETURN_IF_ERROR(CheckKinds(rt, a, rank, &dev));
    if (!dev)
      return InvalidArgument(StrFormat(
          "rank %d: %s is host memory: the NCCL backend moves device memory only, and this "
          "communicator has no host communicator to run host buffers on (it was made with "
          "SCAPE_NCCL_HOST_COMM=0)",
          rank, needSend ? "sendbuf" : "recvbuf"));
  }
  if (mask)
    return MaskedAllReduce(*e->pool, *e->positions, *mask->impl, a, stream, rank,
                           [&](coll::CollArgs& packed) {
                             if (packed.count == 0) return Status::Ok();  // nothing moves
                             return b.Run(packed, stream);
                           });
  return b.Run(a, stream);
}

Status InitNccl(scapeComm** out, void* ncclComm, const scapeConfig_t* config) {
  if (!out) return InvalidArgument("comm is NULL");
  if (!ncclComm) return InvalidArgument("ncclComm is NULL");
  CommConfig cfg;
  SCAPE_RETURN_IF_ERROR(ResolveConfig(config, &cfg));
  int64_t hostComm = 1;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_NCCL_HOST_COMM", &hostComm));
  auto entry = std::make_shared<Entry>();
  SCAPE_RETURN_IF_ERROR(NcclBackend::Create(ncclComm, &entry->nccl));
  MakePool(entry.get(), GetRuntime(), cfg.timeoutMs);
  NcclBackend& b = *entry->nccl;
  std::unique_ptr<Comm> impl;
  if (hostComm) {
    // The host communicator: rank 0 makes a bootstrap id, NCCL carries it to every rank (a
    // host wait with the communicator's deadline), and every rank joins a UCX communicator
    // with it, as scapeCommInitRank does.
    scapeUniqueId id;
    std::memset(&id, 0, sizeof(id));
    Status st;
    if (b.rank() == 0) {
      // As scapeGetUniqueId, with this call's configuration (interface, timeout).
      bootstrap::SockAddr addr;
      bootstrap::Secret secret;
      bootstrap::RootAddress root0;
      st = bootstrap::InterfaceAddress(cfg.netIf, &addr, nullptr);
      if (st.ok()) st = bootstrap::RandomSecret(&secret);
      if (st.ok()) st = bootstrap::StartRoot(addr, secret, cfg.timeoutMs, &root0);
      if (st.ok()) bootstrap::EncodeUniqueId(root0, &id);
    }
    // Every rank takes part in the broadcast, rank 0 even after a failure (its id is then all
    // zero, which the others reject), so no rank waits for a broadcast that never comes.
    Status bs = b.BroadcastHostBytes(&id, sizeof(id), 0, cfg.timeoutMs);
    if (st.ok()) st = bs;
    bootstrap::RootAddress root;
    if (st.ok()) st = bootstrap::DecodeUniqueId(id, &root);
    if (st.ok()) st = Comm::Create(b.nranks(), b.rank(), root, cfg, &impl);
    if (!st.ok())
      return st.Prepend(
          StrFormat("rank %d: the host communicator (SCAPE_NCCL_HOST_COMM=1; set it to 0 for "
                    "dense device collectives only)",
                    b.rank()));
  }
  auto* c = new scapeComm();
  c->impl = std::move(impl);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_entries[c] = entry;
  }
  *out = c;
  return Status::Ok();
}

Status MakeOwnedNccl(scapeComm* comm) {
  if (!comm || !comm->impl) return InternalError("MakeOwnedNccl: no host communicator");
  Comm& c = *comm->impl;
  const int rank = c.rank(), p = c.nranks(), timeoutMs = c.config().timeoutMs;
  const NcclApi* api = nullptr;
  SCAPE_RETURN_IF_ERROR(LoadNccl(&api));
  SCAPE_RETURN_IF_ERROR(CheckOwnedNccl(*api));
  // Rank 0's ncclUniqueId goes to every rank over the host communicator (host memory, a host
  // broadcast with the communicator's deadline). Word 0 says whether rank 0 got one: rank 0
  // takes part even after a failure, so no rank waits for a broadcast that never comes.
  int32_t msg[1 + sizeof(NcclUniqueId) / sizeof(int32_t)] = {0};
  static_assert(sizeof(msg) == 4 + sizeof(NcclUniqueId), "ncclUniqueId is 128 bytes");
  Status st;
  if (rank == 0) {
    NcclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    const int r = api->getUniqueId(&id);
    if (r != kNcclSuccess)
      st = FromNccl(r, "ncclGetUniqueId", api->getErrorString(r));
    else
      std::memcpy(&msg[1], &id, sizeof(id));
    msg[0] = st.ok() ? 1 : 0;
  }
  coll::CollArgs b;
  b.type = coll::CollType::kBroadcast;
  b.send = b.recv = msg;
  b.count = sizeof(msg) / sizeof(int32_t);
  b.dtype = scapeInt32;
  b.root = 0;
  Status bs = api::SubmitOrRun(comm, b, nullptr);
  if (!st.ok()) return st.Prepend(StrFormat("rank %d", rank));
  if (!bs.ok())
    return bs.Prepend(
        StrFormat("rank %d: broadcasting the NCCL unique id over the host communicator", rank));
  if (msg[0] != 1)
    return RemoteError(StrFormat(
        "rank %d: rank 0 could not get an NCCL unique id (ncclGetUniqueId failed there; its "
        "message says why)",
        rank));
  NcclUniqueId id;
  std::memcpy(&id, &msg[1], sizeof(id));
  // ncclCommInitRank waits for every rank: on a helper thread with the caller's device, with
  // the communicator's deadline.
  void* nc = nullptr;
  auto ncOut = std::make_shared<void*>(nullptr);
  int r = kNcclSuccess;
  const int device = GetRuntime()->GetDevice();
  if (!RunWithDeadline(
          [api, ncOut, p, id, rank] { return api->commInitRank(ncOut.get(), p, id, rank); }, device,
          timeoutMs, &r)) {
    st = TimeoutError(
        StrFormat("rank %d: ncclCommInitRank (%d ranks, device %d) did not return within %d ms "
                  "(does every rank call it? SCAPE_TIMEOUT_MS sets the limit)",
                  rank, p, device, timeoutMs));
  } else if (r != kNcclSuccess) {
    st = FromNccl(r, "ncclCommInitRank", api->getErrorString(r))
             .Prepend(StrFormat("rank %d (device %d)", rank, device));
  } else {
    nc = *ncOut;
    if (!nc)
      st = InternalError(StrFormat("rank %d: ncclCommInitRank returned no communicator", rank));
  }
  // Every rank learns whether every rank has its NCCL communicator (a host all-reduce with the
  // deadline), so none keeps one its peers gave up on.
  int32_t ok = st.ok() ? 1 : 0;
  coll::CollArgs m;
  m.type = coll::CollType::kAllReduce;
  m.send = m.recv = &ok;
  m.count = 1;
  m.dtype = scapeInt32;
  m.op = scapeMin;
  Status as = api::SubmitOrRun(comm, m, nullptr);
  std::unique_ptr<NcclBackend> backend;
  if (st.ok() && !as.ok())
    st = as.Prepend(StrFormat("rank %d: agreeing on the NCCL communicator's creation", rank));
  if (st.ok() && ok != 1)
    st = RemoteError(StrFormat(
        "rank %d: another rank failed to make its NCCL communicator (its message says why)", rank));
  if (st.ok()) st = NcclBackend::Create(nc, &backend, true);
  if (st.ok() && (backend->rank() != rank || backend->nranks() != p))
    st = InternalError(StrFormat("the NCCL communicator is rank %d of %d, the host one %d of %d",
                                 backend->rank(), backend->nranks(), rank, p));
  if (!st.ok()) {
    if (nc) {
      // Not used by anyone: abort it (no waiting for peers), or destroy it.
      const int rr = api->commAbort ? api->commAbort(nc) : api->commDestroy(nc);
      if (rr != kNcclSuccess) SCAPE_WARN("releasing a failed NCCL communicator: %d", rr);
    }
    return st;
  }
  auto entry = std::make_shared<Entry>();
  entry->nccl = std::move(backend);
  MakePool(entry.get(), GetRuntime(), timeoutMs);
  std::lock_guard<std::mutex> lk(g_mu);
  g_entries[comm] = entry;
  return Status::Ok();
}

// True when a collective on an NCCL-backend communicator runs on its host communicator
// instead of NCCL: it has one, and the call is a barrier or its buffers are host memory.
static bool NcclOnHost(const scapeComm* comm, const coll::CollArgs& a) {
  if (!comm || !comm->impl || !IsNcclComm(comm)) return false;
  if (a.type == coll::CollType::kBarrier) return true;
  bool dev = false;
  // A mix of kinds is left to NcclCollective, which names it.
  Runtime* rt = GetRuntime();
  const bool needSend = a.type != coll::CollType::kBroadcast || comm->impl->rank() == a.root;
  const bool hasSend = needSend && a.send, hasRecv = a.recv != nullptr;
  if (!hasSend && !hasRecv) return false;
  if (!CheckKinds(rt, a, comm->impl->rank(), &dev).ok()) return false;
  return !dev;
}

bool RunsOnNccl(const scapeComm* comm, const coll::CollArgs& a) {
  return IsNcclComm(comm) && !NcclOnHost(comm, a);
}

Status StageIn(const void* p, size_t bytes, std::vector<char>* copy, const void** view) {
  *view = p;
  if (!p || bytes == 0) return Status::Ok();
  Runtime* rt = GetRuntime();
  if (rt->Kind(p) == PtrKind::kHost) return Status::Ok();
  copy->resize(bytes);
  Status st = rt->CopyAsync(copy->data(), p, bytes, nullptr);
  if (st.ok()) st = rt->StreamSynchronize(nullptr);
  if (!st.ok()) return st.Prepend("copying a device input to the host");
  *view = copy->data();
  return Status::Ok();
}

void StageOut(void* p, size_t bytes, std::vector<char>* copy, void** view) {
  *view = p;
  if (!p || GetRuntime()->Kind(p) == PtrKind::kHost) return;
  copy->resize(bytes);
  *view = copy->data();
}

Status FinishOut(void* p, const std::vector<char>& copy, size_t bytes) {
  if (!p || bytes == 0 || copy.empty()) return Status::Ok();
  Runtime* rt = GetRuntime();
  Status st = rt->CopyAsync(p, copy.data(), bytes, nullptr);
  if (st.ok()) st = rt->StreamSynchronize(nullptr);
  if (!st.ok()) return st.Prepend("copying an output to the device");
  return Status::Ok();
}

void ReleaseComm(scapeComm* comm) {
  std::shared_ptr<Entry> e = Take(comm);
  if (e && e->staging) {
    const int ms = e->staging->aborted() ? 1000
                   : comm->impl          ? comm->impl->config().timeoutMs
                                         : 10000;
    Status st = e->staging->Drain(ms);
    if (!st.ok()) SCAPE_WARN("scapeCommDestroy: %s", st.message().c_str());
  }
  // An NCCL communicator the library made (no-op for a caller's, or one already aborted).
  if (e && e->nccl)
    e->nccl->Close(false, comm->impl ? comm->impl->config().timeoutMs : kDefaultTimeoutMs);
  // The channel (its worker and child communicator) and the device pool (waiting, within the
  // timeout, for the work that uses its blocks) go with the entry, before the parent.
}

void AbortComm(scapeComm* comm) {
  std::shared_ptr<Entry> e = Find(comm);
  if (e && e->staging) e->staging->Abort();
  if (e && e->pool) e->pool->Abandon();
  if (e && e->nccl) e->nccl->Close(true, 1000);  // ncclCommAbort (an owned one only)
}

Status AsyncError(scapeComm* comm) {
  std::shared_ptr<Entry> e = Find(comm);
  if (!e) return Status::Ok();
  if (e->nccl) return e->nccl->AsyncError();
  if (e->staging) return e->staging->error();
  return Status::Ok();
}

}  // namespace device
}  // namespace scape
