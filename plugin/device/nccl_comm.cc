// The NCCL calls (NcclComm): see nccl_comm.h.
#include "plugin/device/nccl_comm.h"

#include <dlfcn.h>
#include <time.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "base/clock.h"
#include "base/log.h"
#include "base/param.h"
#include "kernels/dtypes.h"

namespace scape {
namespace device {

int NcclDataType(scapeDataType_t t) { return dtypes::Row(t) ? dtypes::Row(t)->ncclType : -1; }

int NcclRedOp(scapeRedOp_t o) {
  // NCCL's operation for each scapeRedOp_t, in the enum's order.
  static const int kOps[] = {kNcclSum, kNcclAvg, kNcclMax, kNcclMin};
  static_assert(sizeof(kOps) / sizeof(kOps[0]) == scapeNumOps, "one NCCL operation per op");
  return o >= 0 && o < scapeNumOps ? kOps[o] : -1;
}

Status FromNccl(int r, const char* what, const char* msg) {
  if (r == kNcclSuccess || r == kNcclInProgress) return Status::Ok();
  std::string m = StrFormat("%s returned %d", what, r);
  if (msg && *msg) m += std::string(": ") + msg;
  switch (r) {
    case kNcclInvalidArgument:
      return InvalidArgument(m);
    case kNcclInvalidUsage:
      return InvalidUsage(m);
    case kNcclRemoteError:
      return RemoteError(m);
    case kNcclInternalError:
      return InternalError(m);
    default:
      return SystemError(m);  // unhandled CUDA error, system error, unknown
  }
}

namespace {

std::mutex g_mu;
// Loaded libraries by path. Deliberately never destroyed (like the libraries themselves): a
// map destroyed at exit would leave the tables it pointed to unreachable.
std::map<std::string, NcclApi*>& Loaded() {
  static auto* loaded = new std::map<std::string, NcclApi*>();
  return *loaded;
}

template <typename F>
Status Resolve(void* lib, const std::string& path, const char* name, F* fn, bool required) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!*fn && required)
    return SystemError(
        StrFormat("the NCCL library %s has no %s: not an NCCL 2.x library?", path.c_str(), name));
  return Status::Ok();
}

}  // namespace

Status LoadNccl(const NcclApi** out) {
  const std::string path = ParamString("SCAPE_NCCL_LIBRARY");  // default libnccl.so.2
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = Loaded().find(path);
  if (it != Loaded().end()) {
    *out = it->second;
    return Status::Ok();
  }
  dlerror();
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    return Unsupported(
        StrFormat("the NCCL backend needs NCCL, and %s cannot be loaded (%s); "
                  "install NCCL 2.x or set SCAPE_NCCL_LIBRARY to its path",
                  path.c_str(), e ? e : "unknown dlopen error"));
  }
  auto api = std::make_unique<NcclApi>();
  api->path = path;
  Status st = Resolve(lib, path, "ncclGetVersion", &api->getVersion, true);
  if (st.ok()) st = Resolve(lib, path, "ncclGetErrorString", &api->getErrorString, true);
  if (st.ok()) st = Resolve(lib, path, "ncclGetLastError", &api->getLastError, false);
  if (st.ok()) st = Resolve(lib, path, "ncclCommCount", &api->commCount, true);
  if (st.ok()) st = Resolve(lib, path, "ncclCommUserRank", &api->commUserRank, true);
  if (st.ok()) st = Resolve(lib, path, "ncclCommGetAsyncError", &api->commGetAsyncError, true);
  if (st.ok()) st = Resolve(lib, path, "ncclAllReduce", &api->allReduce, true);
  if (st.ok()) st = Resolve(lib, path, "ncclReduceScatter", &api->reduceScatter, true);
  if (st.ok()) st = Resolve(lib, path, "ncclAllGather", &api->allGather, true);
  if (st.ok()) st = Resolve(lib, path, "ncclBroadcast", &api->broadcast, true);
  if (st.ok()) st = Resolve(lib, path, "ncclReduce", &api->reduce, false);
  if (st.ok()) st = Resolve(lib, path, "ncclGroupStart", &api->groupStart, false);
  if (st.ok()) st = Resolve(lib, path, "ncclGroupEnd", &api->groupEnd, false);
  if (st.ok()) st = Resolve(lib, path, "ncclGetUniqueId", &api->getUniqueId, false);
  if (st.ok()) st = Resolve(lib, path, "ncclCommInitRank", &api->commInitRank, false);
  if (st.ok()) st = Resolve(lib, path, "ncclCommDestroy", &api->commDestroy, false);
  if (st.ok()) st = Resolve(lib, path, "ncclCommAbort", &api->commAbort, false);
  if (st.ok()) {
    int v = 0;
    int r = api->getVersion(&v);
    if (r != kNcclSuccess)
      st = FromNccl(r, "ncclGetVersion", nullptr);
    else if (v < 21000)
      st =
          SystemError(StrFormat("the NCCL library %s is version %d; the NCCL backend needs "
                                "2.10 or later (ncclAvg)",
                                path.c_str(), v));
    api->version = v;
  }
  if (!st.ok()) {
    dlclose(lib);
    return st;
  }
  // Never closed: NCCL keeps threads and state for the process's lifetime.
  *out = Loaded()[path] = api.release();
  return Status::Ok();
}

Status CheckOwnedNccl(const NcclApi& api) {
  const char* missing = !api.getUniqueId    ? "ncclGetUniqueId"
                        : !api.commInitRank ? "ncclCommInitRank"
                        : !api.commDestroy  ? "ncclCommDestroy"
                                            : nullptr;
  if (missing)
    return Unsupported(
        StrFormat("the NCCL library %s has no %s, which a communicator the library makes "
                  "itself needs (set SCAPE_NCCL_LIBRARY to an NCCL 2.x library)",
                  api.path.c_str(), missing));
  return Status::Ok();
}

bool RunWithDeadline(std::function<int()> fn, int device, int timeoutMs, int* result) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    int result = 0;
  };
  auto sh = std::make_shared<Shared>();
  std::thread th([sh, fn = std::move(fn), device] {
    GetRuntime()->SetDevice(device);
    const int r = fn();
    std::lock_guard<std::mutex> lk(sh->mu);
    sh->result = r;
    sh->done = true;
    sh->cv.notify_all();
  });
  std::unique_lock<std::mutex> lk(sh->mu);
  const bool done = sh->cv.wait_for(lk, std::chrono::milliseconds(timeoutMs < 0 ? 0 : timeoutMs),
                                    [&] { return sh->done; });
  lk.unlock();
  if (done) {
    th.join();
    *result = sh->result;
  } else {
    th.detach();  // it holds `sh` and `fn`: nothing of the caller's
  }
  return done;
}

Status NcclComm::Create(void* ncclComm, std::unique_ptr<NcclComm>* out, bool owned) {
  if (!ncclComm) return InvalidArgument("ncclComm is NULL");
  const NcclApi* api = nullptr;
  SCAPE_RETURN_IF_ERROR(LoadNccl(&api));
  std::unique_ptr<NcclComm> b(new NcclComm());
  b->api_ = api;
  b->comm_ = ncclComm;
  b->owned_ = owned;
  int r = api->commCount(ncclComm, &b->nranks_);
  if (r != kNcclSuccess) return FromNccl(r, "ncclCommCount", api->getErrorString(r));
  r = api->commUserRank(ncclComm, &b->rank_);
  if (r != kNcclSuccess) return FromNccl(r, "ncclCommUserRank", api->getErrorString(r));
  if (b->nranks_ < 1 || b->rank_ < 0 || b->rank_ >= b->nranks_)
    return InvalidArgument(StrFormat("ncclComm reports rank %d of %d", b->rank_, b->nranks_));
  *out = std::move(b);
  return Status::Ok();
}

Status NcclComm::CheckOpen(const char* what) const {
  if (!closed()) return Status::Ok();
  return InvalidUsage(StrFormat(
      "rank %d: %s: the NCCL communicator was %s (scapeComm%s was called): no NCCL call is made "
      "on it any more",
      rank_, what, aborted_.load() ? "aborted" : "destroyed",
      aborted_.load() ? "Abort" : "Destroy"));
}

// A use of the communicator for the scope of one call of NcclComm (see Close).
class NcclComm::Use {
 public:
  Use(NcclComm* c, const char* what) : c_(c), st_(c->BeginUse(what)) {}
  ~Use() {
    if (st_.ok()) c_->EndUse();
  }
  const Status& status() const { return st_; }

 private:
  NcclComm* c_;
  Status st_;
};

Status NcclComm::BeginUse(const char* what) {
  std::lock_guard<std::mutex> lk(useMu_);
  // closed_ is set under useMu_ in Close: a use begun here is seen by Close's wait.
  SCAPE_RETURN_IF_ERROR(CheckOpen(what));
  ++uses_;
  return Status::Ok();
}

void NcclComm::EndUse() {
  std::lock_guard<std::mutex> lk(useMu_);
  if (--uses_ == 0) useCv_.notify_all();
}

bool NcclComm::WaitUses(int ms) {
  std::unique_lock<std::mutex> lk(useMu_);
  return useCv_.wait_for(lk, std::chrono::milliseconds(ms < 0 ? 0 : ms),
                         [&] { return uses_ == 0; });
}

void NcclComm::Close(bool abort, int timeoutMs) {
  if (abort) aborted_.store(true);
  bool already;
  {
    std::lock_guard<std::mutex> lk(useMu_);
    already = closed_.exchange(true, std::memory_order_acq_rel);
  }
  if (already) return;
  // No use starts from here on; wait for those in progress (a caller's communicator too: the
  // caller may free it as soon as scapeCommAbort / scapeCommDestroy returns).
  const int waitMs = timeoutMs > 0 && timeoutMs < kUseWaitMs ? timeoutMs : kUseWaitMs;
  if (!WaitUses(waitMs))
    SCAPE_WARN(
        "scapeComm%s: rank %d: a call on the NCCL communicator from another thread has not "
        "returned from NCCL within %d ms (blocked on a peer?); the communicator is %s "
        "regardless, which NCCL documents as the way to end such a call",
        abort ? "Abort" : "Destroy", rank_, waitMs,
        owned_ ? (abort && api_->commAbort ? "aborted" : "destroyed") : "released to its owner");
  if (!owned_) return;
  void* comm = comm_;
  const NcclApi* api = api_;
  if (abort && api->commAbort) {
    // ncclCommAbort returns without waiting for the other ranks or the work in flight.
    const int r = api->commAbort(comm);
    if (r != kNcclSuccess)
      SCAPE_WARN("scapeCommAbort: ncclCommAbort returned %d: %s", r, api->getErrorString(r));
    return;
  }
  int r = kNcclSuccess;
  if (!RunWithDeadline([api, comm] { return api->commDestroy(comm); }, GetRuntime()->GetDevice(),
                       timeoutMs, &r)) {
    SCAPE_WARN(
        "scapeComm%s: ncclCommDestroy did not return within %d ms (work still queued on a "
        "stream that never completes?); it is left to finish on its own",
        abort ? "Abort" : "Destroy", timeoutMs);
    return;
  }
  if (r != kNcclSuccess)
    SCAPE_WARN("scapeComm%s: ncclCommDestroy returned %d: %s", abort ? "Abort" : "Destroy", r,
               api->getErrorString(r));
}

Status NcclComm::Fail(int r, const char* what) {
  if (r == kNcclSuccess || r == kNcclInProgress) return Status::Ok();
  // ncclGetLastError reads the communicator: not once it has been ended.
  const char* msg = api_->getLastError && !closed() ? api_->getLastError(comm_) : nullptr;
  if (!msg || !*msg) msg = api_->getErrorString(r);
  return FromNccl(r, what, msg);
}

namespace {

// The packed (V) forms: the per-rank blocks of a.counts.
Status RunV(const NcclComm& self, const NcclApi& api, void* comm, int rank, const coll::CollArgs& a,
            int dt, Stream stream, int* r, const char** what) {
  using coll::CollType;
  const size_t p = a.counts.size(), esz = scapeTypeSize(a.dtype);
  size_t total = 0;
  bool equal = true;
  for (size_t c : a.counts) {
    total += c;
    equal = equal && c == a.counts[0];
  }
  if (a.type == CollType::kAllReduce) {
    *what = "ncclAllReduce";
    *r = api.allReduce(a.send, a.recv, total, dt, NcclRedOp(a.op), comm, stream);
    return Status::Ok();
  }
  if (a.type != CollType::kReduceScatter && a.type != CollType::kAllGather)
    return InvalidArgument(
        StrFormat("rank %d: per-rank counts are for all-reduce, "
                  "reduce-scatter and all-gather, not %s",
                  rank, coll::CollName(a.type)));
  if (equal) {
    // NCCL's own reduce-scatter / all-gather: the blocks are its per-rank counts.
    if (a.type == CollType::kReduceScatter) {
      *what = "ncclReduceScatter";
      *r = api.reduceScatter(a.send, a.recv, a.counts[0], dt, NcclRedOp(a.op), comm, stream);
    } else {
      *what = "ncclAllGather";
      *r = api.allGather(a.send, a.recv, a.counts[0], dt, comm, stream);
    }
    return Status::Ok();
  }
  const bool rs = a.type == CollType::kReduceScatter;
  const char* need = rs ? "ncclReduce" : "ncclBroadcast";
  const char* missing = !api.groupStart     ? "ncclGroupStart"
                        : !api.groupEnd     ? "ncclGroupEnd"
                        : rs && !api.reduce ? "ncclReduce"
                                            : nullptr;
  if (missing)
    return SystemError(
        StrFormat("rank %d: the NCCL library %s has no %s: a packed %s with unequal per-rank "
                  "blocks runs as grouped %s calls, which need it",
                  rank, api.path.c_str(), missing, coll::CollName(a.type), need));
  *what = "ncclGroupStart";
  *r = api.groupStart();
  if (*r != kNcclSuccess && *r != kNcclInProgress) return Status::Ok();
  int first = kNcclSuccess;
  const char* firstWhat = "";
  size_t off = 0;
  for (size_t b = 0; b < p; ++b) {
    const size_t n = a.counts[b];
    if (n == 0) continue;      // every rank skips the same blocks (the counts agree)
    if (self.closed()) break;  // aborted meanwhile: no call on it (the group is still closed)
    int rr;
    if (rs) {
      const char* blk = static_cast<const char*>(a.send) + off * esz;
      // Only the root's receive buffer is written; the others pass their send block.
      void* dst = static_cast<int>(b) == rank ? a.recv : const_cast<char*>(blk);
      rr = api.reduce(blk, dst, n, dt, NcclRedOp(a.op), static_cast<int>(b), comm, stream);
    } else {
      char* dst = static_cast<char*>(a.recv) + off * esz;
      const void* src = static_cast<int>(b) == rank ? a.send : dst;
      rr = api.broadcast(src, dst, n, dt, static_cast<int>(b), comm, stream);
    }
    if (rr != kNcclSuccess && rr != kNcclInProgress && first == kNcclSuccess) {
      first = rr;
      firstWhat = need;
    }
    off += n;
  }
  // The group is always closed, even after a failed call inside it.
  int re = api.groupEnd();
  SCAPE_RETURN_IF_ERROR(self.CheckOpen(need));
  if (first != kNcclSuccess) {
    *r = first;
    *what = firstWhat;
  } else {
    *r = re;
    *what = "ncclGroupEnd";
  }
  return Status::Ok();
}

}  // namespace

Status NcclComm::Run(const coll::CollArgs& a, Stream stream) {
  using coll::CollType;
  Use use(this, coll::CollName(a.type));  // held until the last NCCL call (Fail included)
  SCAPE_RETURN_IF_ERROR(use.status());
  int dt = NcclDataType(a.dtype);
  if (dt < 0) return InvalidArgument(StrFormat("datatype %d has no NCCL type", a.dtype));
  if (dtypes::IsScaled(a.dtype)) {
    const bool reduces = a.type == CollType::kAllReduce || a.type == CollType::kReduceScatter;
    if (!reduces) {
      dt = kNcclUint8;  // moved, not computed: the bytes as they are
    } else {
      const int cc = GetRuntime()->ComputeCapability();
      if (api_->version < kNcclFp8Version || cc < 90) {
        const int v = api_->version;
        return Unsupported(StrFormat(
            "rank %d: %s of %s on the NCCL backend: NCCL reduces 8-bit floats only from "
            "version 2.24 and on devices of compute capability 9.0 or later, and this is NCCL "
            "%d.%d.%d (%s) on a device of compute capability %s; use a payload of 16 bits or "
            "more (scapeOptimConfig_t.payloadType = scapeBfloat16), or a UCX communicator "
            "(scapeCommInitRank), whose staged device path reduces them as the host does",
            rank_, coll::CollName(a.type), dtypes::Name(a.dtype), v / 10000, v / 100 % 100, v % 100,
            api_->path.c_str(), cc > 0 ? StrFormat("%d.%d", cc / 10, cc % 10).c_str() : "unknown"));
      }
    }
  }
  int r = kNcclSuccess;
  const char* what = "";
  if (!a.counts.empty()) {
    if (a.counts.size() != static_cast<size_t>(nranks_))
      return InvalidArgument(
          StrFormat("rank %d: %zu per-rank counts for %d ranks", rank_, a.counts.size(), nranks_));
    SCAPE_RETURN_IF_ERROR(RunV(*this, *api_, comm_, rank_, a, dt, stream, &r, &what));
    return Fail(r, what);
  }
  switch (a.type) {
    case CollType::kAllReduce:
      what = "ncclAllReduce";
      r = api_->allReduce(a.send, a.recv, a.count, dt, NcclRedOp(a.op), comm_, stream);
      break;
    case CollType::kReduceScatter:
      what = "ncclReduceScatter";
      r = api_->reduceScatter(a.send, a.recv, a.count, dt, NcclRedOp(a.op), comm_, stream);
      break;
    case CollType::kAllGather:
      what = "ncclAllGather";
      r = api_->allGather(a.send, a.recv, a.count, dt, comm_, stream);
      break;
    case CollType::kBroadcast:
      what = "ncclBroadcast";
      r = api_->broadcast(a.send, a.recv, a.count, dt, a.root, comm_, stream);
      break;
    default:
      return Unsupported(
          StrFormat("%s has no NCCL form (NCCL has no barrier: synchronise the "
                    "stream after a 1-element all-reduce instead)",
                    coll::CollName(a.type)));
  }
  return Fail(r, what);
}

Status NcclComm::BroadcastHostBytes(void* bytes, size_t n, int root, int timeoutMs) {
  SCAPE_RETURN_IF_ERROR(CheckOpen("broadcast"));  // the NCCL call itself holds a use below
  Runtime* rt = GetRuntime();
  // Page-locked host memory: a device-to-pageable copy would block the host until NCCL has
  // finished, past any deadline.
  void* h = nullptr;
  Status st = rt->HostAlloc(n, &h);
  if (!st.ok())
    return st.Prepend(StrFormat("%zu bytes of page-locked memory for the broadcast", n));
  Stream s = nullptr;
  st = rt->StreamCreate(&s);
  if (!st.ok()) {
    rt->HostFree(h);
    return st.Prepend("a stream for the broadcast");
  }
  void* d = nullptr;
  st = rt->DeviceAlloc(n, &d);
  if (!st.ok()) {
    rt->StreamDestroy(s);
    rt->HostFree(h);
    return st.Prepend(StrFormat("%zu bytes of device memory for the broadcast", n));
  }
  Event ev = nullptr;
  st = rt->EventCreate(&ev);
  if (st.ok() && rank_ == root) {
    std::memcpy(h, bytes, n);
    st = rt->CopyAsync(d, h, n, s);
  }
  if (st.ok()) {
    Use use(this, "broadcast");
    st = use.status();
    if (st.ok()) st = Fail(api_->broadcast(d, d, n, kNcclInt8, root, comm_, s), "ncclBroadcast");
  }
  if (st.ok()) st = rt->CopyAsync(h, d, n, s);
  if (st.ok()) st = rt->EventRecord(ev, s);
  bool done = false;
  if (st.ok()) {
    Deadline dl = Deadline::AfterMs(timeoutMs);
    while (st.ok()) {
      st = rt->EventQuery(ev, &done);
      if (!st.ok() || done) break;
      if (dl.Expired()) {
        st = TimeoutError(StrFormat(
            "rank %d: the broadcast from rank %d over NCCL did not complete within %d ms (does "
            "every rank of the NCCL communicator call scapeCommInitNccl? SCAPE_TIMEOUT_MS "
            "sets the limit)",
            rank_, root, timeoutMs));
        break;
      }
      struct timespec ts = {0, 200000};
      nanosleep(&ts, nullptr);
    }
  }
  if (!st.ok()) {
    Status ae = AsyncError();  // NCCL's own account, when it has one
    if (!ae.ok()) st.Prepend(ae.message());
  }
  if (done) {
    std::memcpy(bytes, h, n);
    rt->EventDestroy(ev);
    rt->DeviceFree(d);
    rt->StreamDestroy(s);
    rt->HostFree(h);
  }
  // Not done: NCCL or the copies may still use the buffers, the event and the stream; they are
  // leaked rather than freed under them (a failed init only).
  return st;
}

Status NcclComm::AsyncError() {
  Use use(this, "ncclCommGetAsyncError");
  SCAPE_RETURN_IF_ERROR(use.status());
  int e = kNcclSuccess;
  int r = api_->commGetAsyncError(comm_, &e);
  if (r != kNcclSuccess) return FromNccl(r, "ncclCommGetAsyncError", api_->getErrorString(r));
  if (e == kNcclSuccess || e == kNcclInProgress) return Status::Ok();
  const char* msg = api_->getLastError ? api_->getLastError(comm_) : nullptr;
  return FromNccl(e, "the NCCL communicator", msg && *msg ? msg : api_->getErrorString(e));
}

}  // namespace device
}  // namespace scape
