// The SCAPE API entry points: argument checks, error translation, and the guarantee that no
// C++ exception crosses into the caller. Everything below this file speaks scape::Status.
#include <time.h>

#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <unordered_map>

#include "base/clock.h"
#include "base/log.h"
#include "base/param.h"
#include "kernels/dtypes.h"
#include "plugin/api/api_internal.h"
#include "plugin/backend/backend.h"
#include "plugin/core/comm.h"
#include "scape/scape.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/bootstrap/launcher_env.h"

namespace {

using scape::Status;
using scape::StrFormat;
using scape::api::CheckComm;
using scape::api::Guard;
using scape::api::Report;
using scape::api::ValidOp;
using scape::api::ValidType;

bool Overlap(const void* a, size_t alen, const void* b, size_t blen) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return alen && blen && x < y + blen && y < x + alen;
}

// Validates a collective call and queues it. For the blocking forms, waits for it.
Status StartColl(scapeComm* comm, const scape::coll::CollArgs& a, scapeMask_t mask, void* stream,
                 scapeRequest_t* request, bool blocking) {
  using scape::coll::CollType;
  // Validated once, here, whichever backend runs it (rank and size: the host communicator's,
  // or the data path's own rank space when a backend has one, as NCCL's does).
  if (!comm) return scape::InvalidArgument("comm is NULL");
  int rank = 0, p = 1;
  scape::backend::RankSpace ranks;
  if (comm->data->Topology(&ranks)) {
    rank = ranks.rank;
    p = ranks.nranks;
  } else {
    SCAPE_RETURN_IF_ERROR(CheckComm(comm));
    rank = comm->impl->rank();
    p = comm->impl->nranks();
  }
  if (!blocking && !request) return scape::InvalidArgument("request is NULL");
  if (a.type != CollType::kBarrier) {
    if (!ValidType(a.dtype))
      return scape::InvalidArgument(
          StrFormat("rank %d: datatype %d is not a scapeDataType_t "
                    "(0..%d)",
                    rank, static_cast<int>(a.dtype), scapeNumTypes - 1));
    if ((a.type == CollType::kAllReduce || a.type == CollType::kReduceScatter) && !ValidOp(a.op))
      return scape::InvalidArgument(StrFormat("rank %d: op %d is not a scapeRedOp_t (0..%d)", rank,
                                              static_cast<int>(a.op), scapeNumOps - 1));
    if (a.type == CollType::kBroadcast && (a.root < 0 || a.root >= p))
      return scape::InvalidArgument(
          StrFormat("rank %d: root %d out of range 0..%d", rank, a.root, p - 1));
    const size_t esz = scapeTypeSize(a.dtype);
    size_t sendElems = a.count, recvElems = a.count;
    if (a.type == CollType::kReduceScatter) sendElems = a.count * static_cast<size_t>(p);
    if (a.type == CollType::kAllGather) recvElems = a.count * static_cast<size_t>(p);
    if (a.count > (SIZE_MAX / 2) / esz / static_cast<size_t>(p))
      return scape::InvalidArgument(StrFormat("rank %d: count %zu is too large", rank, a.count));
    const bool needSend = a.type != CollType::kBroadcast || rank == a.root;
    if (a.count > 0 && needSend && !a.send)
      return scape::InvalidArgument(
          StrFormat("rank %d: sendbuf is NULL with count %zu", rank, a.count));
    if (a.count > 0 && !a.recv)
      return scape::InvalidArgument(
          StrFormat("rank %d: recvbuf is NULL with count %zu", rank, a.count));
    if (needSend && a.send != a.recv) {
      bool inPlace = false;
      const char* r = static_cast<const char*>(a.recv);
      const char* s = static_cast<const char*>(a.send);
      if (a.type == CollType::kAllGather)
        inPlace = s == r + static_cast<size_t>(rank) * a.count * esz;
      if (a.type == CollType::kReduceScatter)
        inPlace = r == s + static_cast<size_t>(rank) * a.count * esz;
      if (!inPlace && Overlap(a.send, sendElems * esz, a.recv, recvElems * esz))
        return scape::InvalidArgument(StrFormat(
            "rank %d: sendbuf and recvbuf overlap without being the in-place layout", rank));
    }
  }
  if (mask) {
    if (a.type != CollType::kAllReduce)
      return scape::Unsupported(
          "a mask is accepted by scapeAllReduce / scapeAllReduceAsync "
          "only (use scapeMaskReduceScatter and friends for the others)");
    SCAPE_RETURN_IF_ERROR(scape::api::CheckMaskedAllReduce(comm, a.count, mask, rank));
  }
  // Routed once, after every check: the communicator's data path picks the backend (host, UCX
  // staged device memory, NCCL) and runs the call there.
  return scape::api::RouteAndRun(comm, a, mask, stream, blocking ? nullptr : request);
}

scape::coll::CollArgs Args(scape::coll::CollType t, const void* s, void* r, size_t n,
                           scapeDataType_t d, scapeRedOp_t o, int root) {
  scape::coll::CollArgs a;
  a.type = t;
  a.send = s;
  a.recv = r;
  a.count = n;
  a.dtype = d;
  a.op = o;
  a.root = root;
  return a;
}

Status InitWithRoot(scapeComm_t* comm, int nranks, const scape::bootstrap::RootAddress& root,
                    int rank, const scape::CommConfig& cfg) {
  std::unique_ptr<scape::Comm> impl;
  SCAPE_RETURN_IF_ERROR(scape::Comm::Create(nranks, rank, root, cfg, &impl));
  auto* c = new scapeComm();
  c->impl = std::move(impl);
  c->data = scape::backend::DataPath::ForUcx(c->impl.get());
  *comm = c;
  return Status::Ok();
}

Status CheckInitArgs(scapeComm_t* comm, int nranks, int rank) {
  if (!comm) return scape::InvalidArgument("comm is NULL");
  if (nranks < 1 || nranks > scape::bootstrap::kMaxRanks)
    return scape::InvalidArgument(
        StrFormat("nranks = %d: expected 1..%d", nranks, scape::bootstrap::kMaxRanks));
  if (rank < 0 || rank >= nranks)
    return scape::InvalidArgument(
        StrFormat("rank = %d: expected 0..%d (nranks = %d)", rank, nranks - 1, nranks));
  return Status::Ok();
}

}  // namespace

namespace scape {
namespace api {

Status InitRank(scapeComm_t* comm, int nranks, scapeUniqueId id, int rank,
                const scapeConfig_t* config) {
  SCAPE_RETURN_IF_ERROR(CheckInitArgs(comm, nranks, rank));
  scape::CommConfig cfg;
  SCAPE_RETURN_IF_ERROR(scape::ResolveConfig(config, &cfg));
  scape::bootstrap::RootAddress root;
  SCAPE_RETURN_IF_ERROR(scape::bootstrap::DecodeUniqueId(id, &root));
  Status st = InitWithRoot(comm, nranks, root, rank, cfg);
  if (!st.ok()) st.Prepend(StrFormat("rank %d", rank));
  return st;
}

Status InitFromEnv(scapeComm_t* comm, const scapeConfig_t* config) {
  if (!comm) return scape::InvalidArgument("comm is NULL");
  scape::CommConfig cfg;
  SCAPE_RETURN_IF_ERROR(scape::ResolveConfig(config, &cfg));
  scape::bootstrap::LauncherInfo li;
  SCAPE_RETURN_IF_ERROR(scape::bootstrap::ReadLauncherEnv(
      [](const char* k) -> const char* {
        // SCAPE_BOOTSTRAP_* are knobs (base/param.cc); the rest belong to the launchers.
        return std::strncmp(k, "SCAPE_", 6) == 0 ? scape::ParamCString(k) : scape::ParamExternal(k);
      },
      &li));
  scape::bootstrap::RootAddress root;
  SCAPE_RETURN_IF_ERROR(scape::bootstrap::ResolveHost(li.rootHost, li.rootPort, &root.addr));
  root.secret = li.secret;
  if (li.rank == 0) {
    // Rank 0 hosts the rendezvous root on the agreed address (any local address if the name
    // does not belong to this host).
    scape::bootstrap::RootAddress bound;
    Status st = scape::bootstrap::StartRoot(root.addr, li.secret, cfg.timeoutMs, &bound);
    if (!st.ok()) {
      scape::bootstrap::SockAddr any = root.addr;
      if (any.ss.ss_family == AF_INET)
        reinterpret_cast<sockaddr_in*>(&any.ss)->sin_addr.s_addr = htonl(INADDR_ANY);
      else
        reinterpret_cast<sockaddr_in6*>(&any.ss)->sin6_addr = in6addr_any;
      Status st2 = scape::bootstrap::StartRoot(any, li.secret, cfg.timeoutMs, &bound);
      if (!st2.ok())
        return st.Prepend(StrFormat("%s rank 0: cannot host the bootstrap root on %s",
                                    li.launcher.c_str(), root.addr.ToString().c_str()));
    }
  }
  Status st = InitWithRoot(comm, li.nranks, root, li.rank, cfg);
  if (!st.ok()) st.Prepend(StrFormat("%s rank %d", li.launcher.c_str(), li.rank));
  return st;
}

}  // namespace api
}  // namespace scape

namespace scape {
namespace api {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<const void*, HandleKind> live;
  std::deque<void*> quarantine[5];  // per kind (HandleKind): destroyed handles kept out of reuse
};

Registry& Reg() {
  static Registry* r = new Registry();  // never destroyed: handles may die during exit
  return *r;
}

bool LiveLocked(Registry& r, const void* h, HandleKind kind) {
  auto it = r.live.find(h);
  return it != r.live.end() && it->second == kind;
}

}  // namespace

void RegisterHandle(const void* h, HandleKind kind) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lk(r.mu);
  r.live[h] = kind;
}

void UnregisterHandle(const void* h) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lk(r.mu);
  r.live.erase(h);
}

bool HandleLive(const void* h, HandleKind kind) {
  if (!h) return false;
  Registry& r = Reg();
  std::lock_guard<std::mutex> lk(r.mu);
  return LiveLocked(r, h, kind);
}

void QuarantineFree(void* p, HandleKind kind) {
  if (!p) return;
  void* victim = nullptr;
  {
    Registry& r = Reg();
    std::lock_guard<std::mutex> lk(r.mu);
    std::deque<void*>& q = r.quarantine[static_cast<int>(kind)];
    q.push_back(p);
    if (q.size() > kHandleQuarantine) {
      victim = q.front();
      q.pop_front();
    }
  }
  ::operator delete(victim);
}

bool EnterComm(scapeComm* comm) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lk(r.mu);
  if (!LiveLocked(r, comm, HandleKind::kComm)) return false;
  comm->activeCalls.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

}  // namespace api
}  // namespace scape

namespace {
// rank / nranks of a live communicator whose data path has a rank space of its own (an
// NCCL-backend one; false otherwise: the caller's checks run).
bool OwnRankSpace(const scapeComm* comm, int* nranks, int* rank) {
  scape::backend::RankSpace ranks;
  if (!scape::api::HandleLive(comm, scape::api::HandleKind::kComm) || !comm->data ||
      !comm->data->Topology(&ranks))
    return false;
  if (nranks) *nranks = ranks.nranks;
  if (rank) *rank = ranks.rank;
  return true;
}

// The queries do not count as calls (they do not block); they only need a live handle.
Status QueryComm(const scapeComm* comm, const char* fn) {
  if (!comm) return scape::InvalidArgument(std::string(fn) + ": comm is NULL");
  if (!scape::api::HandleLive(comm, scape::api::HandleKind::kComm) || !comm->impl)
    return scape::InvalidArgument(std::string(fn) +
                                  ": comm is not a live communicator "
                                  "(destroyed, aborted, or not made by scapeCommInit*)");
  return Status::Ok();
}
}  // namespace

namespace {
// A request handle, checked before anything is read through it; on success the call is
// counted on the request's communicator (see EnterComm).
Status EnterRequest(scapeRequest* request, const char* fn, scapeComm** comm) {
  if (!request) return scape::InvalidArgument(std::string(fn) + ": request is NULL");
  if (!scape::api::HandleLive(request, scape::api::HandleKind::kRequest))
    return scape::InvalidArgument(std::string(fn) +
                                  ": request is not a live request (already "
                                  "completed by scapeTest/scapeWait, or its communicator was "
                                  "aborted)");
  if (!scape::api::EnterComm(request->comm))
    return scape::InvalidArgument(std::string(fn) +
                                  ": the request's communicator is not live "
                                  "(aborted)");
  *comm = request->comm;
  return Status::Ok();
}
}  // namespace

extern "C" {

SCAPE_API const char* scapeGetErrorString(scapeResult_t r) {
  switch (r) {
    case scapeSuccess:
      return "success";
    case scapeInvalidArgument:
      return "invalid argument";
    case scapeInvalidUsage:
      return "invalid usage";
    case scapeSystemError:
      return "system error";
    case scapeRemoteError:
      return "remote error";
    case scapeTimeout:
      return "timeout";
    case scapeUnsupported:
      return "unsupported";
    case scapeInternalError:
      return "internal error";
    case scapeInProgress:
      return "in progress";
    default:
      return "unknown result";
  }
}

SCAPE_API scapeResult_t scapeGetVersion(int* version) {
  if (!version) return Report(nullptr, scape::InvalidArgument("scapeGetVersion: version is NULL"));
  *version = SCAPE_VERSION_CODE;
  return scapeSuccess;
}

SCAPE_API size_t scapeTypeSize(scapeDataType_t t) { return scape::dtypes::Size(t); }

SCAPE_API scapeResult_t scapeGetUniqueId(scapeUniqueId* id) {
  return Guard(nullptr, "scapeGetUniqueId", [&]() -> Status {
    if (!id) return scape::InvalidArgument("uniqueId is NULL");
    scape::CommConfig cfg;
    SCAPE_RETURN_IF_ERROR(scape::ResolveConfig(nullptr, &cfg));
    scape::bootstrap::SockAddr addr;
    SCAPE_RETURN_IF_ERROR(scape::bootstrap::InterfaceAddress(cfg.netIf, &addr, nullptr));
    scape::bootstrap::Secret secret;
    SCAPE_RETURN_IF_ERROR(scape::bootstrap::RandomSecret(&secret));
    scape::bootstrap::RootAddress root;
    SCAPE_RETURN_IF_ERROR(scape::bootstrap::StartRoot(addr, secret, cfg.timeoutMs, &root));
    scape::bootstrap::EncodeUniqueId(root, id);
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeCommInitRankConfig(scapeComm_t* comm, int nranks, scapeUniqueId id,
                                                int rank, const scapeConfig_t* config) {
  return Guard(nullptr, "scapeCommInitRank",
               [&]() -> Status { return scape::api::InitRank(comm, nranks, id, rank, config); });
}

SCAPE_API scapeResult_t scapeCommInitRank(scapeComm_t* comm, int nranks, scapeUniqueId id,
                                          int rank) {
  return scapeCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

SCAPE_API scapeResult_t scapeCommInitFromEnv(scapeComm_t* comm, const scapeConfig_t* config) {
  return Guard(nullptr, "scapeCommInitFromEnv",
               [&]() -> Status { return scape::api::InitFromEnv(comm, config); });
}

SCAPE_API scapeResult_t scapeCommDestroy(scapeComm_t comm) {
  if (!comm) return scapeSuccess;
  // The checks run as a counted call; the delete after it, once nothing is counted.
  scapeResult_t r = Guard(comm, "scapeCommDestroy", [&]() -> Status {
    if (!comm->masks.empty())
      return scape::InvalidUsage(
          StrFormat("%zu mask(s) of this communicator still exist: destroy "
                    "them first (scapeMaskDestroy)",
                    comm->masks.size()));
    if (!comm->requests.empty())
      return scape::InvalidUsage(
          StrFormat("%zu request(s) of this communicator have not been "
                    "completed with scapeTest/scapeWait; complete them or "
                    "use scapeCommAbort",
                    comm->requests.size()));
    return Status::Ok();
  });
  if (r == scapeSuccess) {
    scape::api::ReleaseData(comm);  // device work in flight: drained first
    delete comm;
  }
  return r;
}

SCAPE_API scapeResult_t scapeCommAbort(scapeComm_t comm) {
  using scape::api::HandleKind;
  if (!comm) return scapeSuccess;
  if (!scape::api::EnterComm(comm))
    return Report(nullptr, scape::InvalidArgument("scapeCommAbort: comm is not a live "
                                                  "communicator (already destroyed or aborted)"));
  const bool already = comm->aborting.exchange(true, std::memory_order_acq_rel);
  comm->activeCalls.fetch_sub(1, std::memory_order_acq_rel);
  if (already)
    return Report(nullptr, scape::InvalidUsage("scapeCommAbort: another thread is already "
                                               "aborting this communicator"));
  try {
    // Another thread may be blocked in a call on this communicator (a watchdog thread aborting
    // a hung collective): ask it to give up, and free nothing until it has left the library.
    if (comm->impl) comm->impl->RequestAbort();
    if (comm->data) comm->data->Abort();  // device work in flight fails fast
    const int timeoutMs = comm->impl ? comm->impl->config().timeoutMs : 0;
    auto drained = [&](int64_t ms) {
      scape::Deadline dl = scape::Deadline::AfterMs(ms);
      while (comm->activeCalls.load(std::memory_order_acquire) > 0) {
        if (dl.Expired()) return false;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, nullptr);
      }
      return true;
    };
    bool ok = drained(timeoutMs + 10000);
    // From here on the handle is dead: calls that start now fail with scapeInvalidArgument
    // without touching it; the few that started since the abort began see `aborting` and
    // leave at once.
    scape::api::UnregisterHandle(comm);
    if (ok) ok = drained(2000);
    if (!ok) {
      // A call that does not come back: leak the communicator rather than free it under
      // that call. Its peers are told by the call itself when it fails.
      SCAPE_WARN(
          "scapeCommAbort: a call on this communicator did not return within %d ms; "
          "leaking the communicator instead of freeing it under that call",
          timeoutMs + 10000);
      return scapeSuccess;
    }
    scape::api::ReleaseData(comm);
    if (comm->impl) comm->impl->Abort("scapeCommAbort was called");
    // Masks die with their communicator (their sync threads finish within the timeout).
    for (scapeOptim* o : comm->optims) scape::api::DeleteOptimOnAbort(o);  // before masks
    comm->optims.clear();
    for (scapeMask* m : comm->masks) delete m;
    comm->masks.clear();
    for (scapeRequest* r : comm->requests) delete r;
    comm->requests.clear();
    delete comm;
  } catch (...) {
    // Abort must not fail; anything left is leaked rather than thrown into the caller.
  }
  return scapeSuccess;
}

SCAPE_API scapeResult_t scapeCommCount(const scapeComm_t comm, int* nranks) {
  if (nranks && OwnRankSpace(comm, nranks, nullptr)) return scapeSuccess;
  if (Status q = QueryComm(comm, "scapeCommCount"); !q.ok()) return Report(nullptr, q);
  if (!nranks) return Report(comm, scape::InvalidArgument("scapeCommCount: nranks is NULL"));
  *nranks = comm->impl->nranks();
  return scapeSuccess;
}

SCAPE_API scapeResult_t scapeCommUserRank(const scapeComm_t comm, int* rank) {
  if (rank && OwnRankSpace(comm, nullptr, rank)) return scapeSuccess;
  if (Status q = QueryComm(comm, "scapeCommUserRank"); !q.ok()) return Report(nullptr, q);
  if (!rank) return Report(comm, scape::InvalidArgument("scapeCommUserRank: rank is NULL"));
  *rank = comm->impl->rank();
  return scapeSuccess;
}

SCAPE_API const char* scapeGetLastError(scapeComm_t comm) {
  if (!comm) return scape::api::t_lastError.c_str();
  if (!scape::api::HandleLive(comm, scape::api::HandleKind::kComm))
    return "scapeGetLastError: comm is not a live communicator (destroyed or aborted); the "
           "message of a call ended by scapeCommAbort is in scapeGetLastError(NULL) on the "
           "thread that made it";
  return comm->lastError.c_str();
}

SCAPE_API scapeResult_t scapeCommGetAsyncError(scapeComm_t comm, scapeResult_t* asyncError) {
  if (asyncError && OwnRankSpace(comm, nullptr, nullptr)) {
    *asyncError = comm->data->AsyncError().code();
    // The host communicator's error, when it has one.
    if (*asyncError == scapeSuccess && comm->impl) *asyncError = comm->impl->error().code();
    return scapeSuccess;
  }
  if (Status q = QueryComm(comm, "scapeCommGetAsyncError"); !q.ok()) return Report(nullptr, q);
  if (!asyncError)
    return Report(comm, scape::InvalidArgument("scapeCommGetAsyncError: asyncError is NULL"));
  *asyncError = comm->impl->error().code();
  if (*asyncError == scapeSuccess && comm->data) *asyncError = comm->data->AsyncError().code();
  return scapeSuccess;
}

#define SCAPE_COLL(fnName, blocking, request, ...)                              \
  Guard(comm, fnName, [&]() -> Status {                                         \
    return StartColl(comm, Args(__VA_ARGS__), mask, stream, request, blocking); \
  })

SCAPE_API scapeResult_t scapeAllReduce(const void* sendbuf, void* recvbuf, size_t count,
                                       scapeDataType_t dtype, scapeRedOp_t op, scapeMask_t mask,
                                       scapeComm_t comm, void* stream) {
  return SCAPE_COLL("scapeAllReduce", true, nullptr, scape::coll::CollType::kAllReduce, sendbuf,
                    recvbuf, count, dtype, op, 0);
}
SCAPE_API scapeResult_t scapeAllReduceAsync(const void* sendbuf, void* recvbuf, size_t count,
                                            scapeDataType_t dtype, scapeRedOp_t op,
                                            scapeMask_t mask, scapeComm_t comm, void* stream,
                                            scapeRequest_t* request) {
  return SCAPE_COLL("scapeAllReduceAsync", false, request, scape::coll::CollType::kAllReduce,
                    sendbuf, recvbuf, count, dtype, op, 0);
}

SCAPE_API scapeResult_t scapeReduceScatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                           scapeDataType_t dtype, scapeRedOp_t op, scapeComm_t comm,
                                           void* stream) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeReduceScatter", true, nullptr, scape::coll::CollType::kReduceScatter,
                    sendbuf, recvbuf, recvcount, dtype, op, 0);
}
SCAPE_API scapeResult_t scapeReduceScatterAsync(const void* sendbuf, void* recvbuf,
                                                size_t recvcount, scapeDataType_t dtype,
                                                scapeRedOp_t op, scapeComm_t comm, void* stream,
                                                scapeRequest_t* request) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeReduceScatterAsync", false, request,
                    scape::coll::CollType::kReduceScatter, sendbuf, recvbuf, recvcount, dtype, op,
                    0);
}

SCAPE_API scapeResult_t scapeAllGather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                       scapeDataType_t dtype, scapeComm_t comm, void* stream) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeAllGather", true, nullptr, scape::coll::CollType::kAllGather, sendbuf,
                    recvbuf, sendcount, dtype, scapeSum, 0);
}
SCAPE_API scapeResult_t scapeAllGatherAsync(const void* sendbuf, void* recvbuf, size_t sendcount,
                                            scapeDataType_t dtype, scapeComm_t comm, void* stream,
                                            scapeRequest_t* request) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeAllGatherAsync", false, request, scape::coll::CollType::kAllGather,
                    sendbuf, recvbuf, sendcount, dtype, scapeSum, 0);
}

SCAPE_API scapeResult_t scapeBroadcast(const void* sendbuf, void* recvbuf, size_t count,
                                       scapeDataType_t dtype, int root, scapeComm_t comm,
                                       void* stream) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeBroadcast", true, nullptr, scape::coll::CollType::kBroadcast, sendbuf,
                    recvbuf, count, dtype, scapeSum, root);
}
SCAPE_API scapeResult_t scapeBroadcastAsync(const void* sendbuf, void* recvbuf, size_t count,
                                            scapeDataType_t dtype, int root, scapeComm_t comm,
                                            void* stream, scapeRequest_t* request) {
  scapeMask_t mask = nullptr;
  return SCAPE_COLL("scapeBroadcastAsync", false, request, scape::coll::CollType::kBroadcast,
                    sendbuf, recvbuf, count, dtype, scapeSum, root);
}

SCAPE_API scapeResult_t scapeBarrier(scapeComm_t comm) {
  scapeMask_t mask = nullptr;
  void* stream = nullptr;
  return SCAPE_COLL("scapeBarrier", true, nullptr, scape::coll::CollType::kBarrier, nullptr,
                    nullptr, 0, scapeFloat32, scapeSum, 0);
}
SCAPE_API scapeResult_t scapeBarrierAsync(scapeComm_t comm, scapeRequest_t* request) {
  scapeMask_t mask = nullptr;
  void* stream = nullptr;
  return SCAPE_COLL("scapeBarrierAsync", false, request, scape::coll::CollType::kBarrier, nullptr,
                    nullptr, 0, scapeFloat32, scapeSum, 0);
}

SCAPE_API scapeResult_t scapeTest(scapeRequest_t request, int* done) {
  scapeComm* comm = nullptr;
  if (Status st = EnterRequest(request, "scapeTest", &comm); !st.ok()) return Report(nullptr, st);
  scape::api::ActiveCall active(comm, scape::api::ActiveCall::Entered{});  // covers the erase
  if (!done) return Report(comm, scape::InvalidArgument("scapeTest: done is NULL"));
  bool fin = false;
  scapeResult_t r = Guard(comm, "scapeTest",
                          [&]() -> Status { return comm->impl->Test(request->op.get(), &fin); });
  *done = fin ? 1 : 0;
  if (!fin) return r == scapeSuccess ? scapeInProgress : r;
  comm->requests.erase(request);
  delete request;
  return r;
}

SCAPE_API scapeResult_t scapeWait(scapeRequest_t request) {
  scapeComm* comm = nullptr;
  if (Status st = EnterRequest(request, "scapeWait", &comm); !st.ok()) return Report(nullptr, st);
  scape::api::ActiveCall active(comm, scape::api::ActiveCall::Entered{});  // covers the erase
  scapeResult_t r =
      Guard(comm, "scapeWait", [&]() -> Status { return comm->impl->Wait(request->op.get()); });
  comm->requests.erase(request);
  delete request;
  return r;
}

}  // extern "C"
