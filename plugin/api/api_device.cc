// Public entry points of the GPU data path (the "device" block of scape.h).
// scapeCommInitNccl and the NCCL communicator the library makes itself (InitNccl,
// MakeOwnedNccl) attach an NCCL data path (plugin/backend) to the communicator.
#include <cstring>
#include <functional>
#include <memory>

#include "base/log.h"
#include "base/param.h"
#include "plugin/api/api_internal.h"
#include "plugin/backend/backend.h"
#include "plugin/device/nccl_comm.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "scape_config.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/bootstrap/socket.h"

using scape::Status;
using scape::api::Guard;
using scape::api::Report;

namespace scape {
namespace device {
namespace {

// scapeCommInitNccl: an NCCL-backend communicator on the caller's ncclComm_t, with a host
// communicator (SCAPE_NCCL_HOST_COMM=1, the default: its bootstrap id carried by NCCL) or
// without one.
Status InitNccl(scapeComm** out, void* ncclComm, const scapeConfig_t* config) {
  if (!out) return InvalidArgument("comm is NULL");
  if (!ncclComm) return InvalidArgument("ncclComm is NULL");
  CommConfig cfg;
  SCAPE_RETURN_IF_ERROR(ResolveConfig(config, &cfg));
  int64_t hostComm = 1;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_NCCL_HOST_COMM", &hostComm));
  std::unique_ptr<NcclComm> nccl;
  SCAPE_RETURN_IF_ERROR(NcclComm::Create(ncclComm, &nccl));
  NcclComm& b = *nccl;
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
  c->data = backend::DataPath::ForNccl(c->impl.get(), std::move(nccl), cfg.timeoutMs,
                                       cfg.deviceAllocator);
  *out = c;
  return Status::Ok();
}

// scapeCommInitNcclRank / scapeCommInitNcclFromEnv, once `comm` (a new UCX communicator, not
// yet handed out) is formed: rank 0's ncclUniqueId (from the dlopen'd NCCL) goes to every rank
// over `comm` (a host broadcast), every rank calls ncclCommInitRank on the calling thread's
// current device (waited for with the communicator's deadline), the ranks agree on the outcome
// (a host all-reduce), and `comm` becomes an NCCL-backend communicator that owns the NCCL one
// (scapeCommDestroy: ncclCommDestroy; scapeCommAbort: ncclCommAbort). On an error nothing is
// attached (the caller destroys `comm`).
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
  std::unique_ptr<NcclComm> backend;
  if (st.ok() && !as.ok())
    st = as.Prepend(StrFormat("rank %d: agreeing on the NCCL communicator's creation", rank));
  if (st.ok() && ok != 1)
    st = RemoteError(StrFormat(
        "rank %d: another rank failed to make its NCCL communicator (its message says why)", rank));
  if (st.ok()) st = NcclComm::Create(nc, &backend, true);
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
  // The communicator's data path becomes the NCCL one (its UCX one has made no device call).
  comm->data = backend::DataPath::ForNccl(comm->impl.get(), std::move(backend), timeoutMs,
                                          comm->impl->config().deviceAllocator);
  return Status::Ok();
}

}  // namespace
}  // namespace device
}  // namespace scape

extern "C" {

SCAPE_API scapeResult_t scapeCommInitNccl(scapeComm_t* comm, void* ncclComm,
                                          const scapeConfig_t* config) {
  return Guard(nullptr, "scapeCommInitNccl",
               [&]() -> Status { return scape::device::InitNccl(comm, ncclComm, config); });
}

}  // extern "C"

namespace {

// After the host communicator of scapeCommInitNcclRank / FromEnv is formed: the NCCL one.
// NCCL is loaded before the host communicator is joined (a missing library fails fast on
// every rank, without a peer waiting); on any later error the host communicator is destroyed.
Status JoinNccl(scapeComm_t* comm, const std::function<Status(scapeComm_t*)>& joinHost) {
  if (!comm) return scape::InvalidArgument("comm is NULL");
  const scape::device::NcclApi* api = nullptr;
  SCAPE_RETURN_IF_ERROR(scape::device::LoadNccl(&api));
  SCAPE_RETURN_IF_ERROR(scape::device::CheckOwnedNccl(*api));
  scapeComm_t host = nullptr;
  SCAPE_RETURN_IF_ERROR(joinHost(&host));
  Status st = scape::device::MakeOwnedNccl(host);
  if (!st.ok()) {
    scape::api::ReleaseData(host);
    delete host;
    return st;
  }
  *comm = host;
  return Status::Ok();
}

}  // namespace

extern "C" {

SCAPE_API scapeResult_t scapeCommInitNcclRank(scapeComm_t* comm, int nranks, scapeUniqueId id,
                                              int rank, const scapeConfig_t* config) {
  return Guard(nullptr, "scapeCommInitNcclRank", [&]() -> Status {
    // The arguments first (as scapeCommInitRank checks them), before NCCL is looked for.
    if (!comm) return scape::InvalidArgument("comm is NULL");
    if (nranks < 1)
      return scape::InvalidArgument(scape::StrFormat("nranks = %d: expected >= 1", nranks));
    if (rank < 0 || rank >= nranks)
      return scape::InvalidArgument(
          scape::StrFormat("rank = %d: expected 0..%d (nranks = %d)", rank, nranks - 1, nranks));
    return JoinNccl(comm, [&](scapeComm_t* host) {
      return scape::api::InitRank(host, nranks, id, rank, config);
    });
  });
}

SCAPE_API scapeResult_t scapeCommInitNcclFromEnv(scapeComm_t* comm, const scapeConfig_t* config) {
  return Guard(nullptr, "scapeCommInitNcclFromEnv", [&]() -> Status {
    return JoinNccl(comm, [&](scapeComm_t* host) { return scape::api::InitFromEnv(host, config); });
  });
}

SCAPE_API scapeResult_t scapeCommGetBackend(scapeComm_t comm, int* backend) {
  if (!comm) return Report(nullptr, scape::InvalidArgument("scapeCommGetBackend: comm is NULL"));
  if (!backend) return Report(comm, scape::InvalidArgument("scapeCommGetBackend: backend is NULL"));
  // Not a counted call: a handle that is not live reads as a UCX one (as it always has); a
  // data path with a rank space of its own says what it reports (NCCL's: scapeBackendNccl).
  scape::backend::RankSpace ranks;
  const bool own = scape::api::HandleLive(comm, scape::api::HandleKind::kComm) && comm->data &&
                   comm->data->Topology(&ranks);
  *backend = own ? ranks.reportAs : scapeBackendUcx;
  return scapeSuccess;
}

SCAPE_API scapeResult_t scapeGetDeviceSupport(int* cudaBuilt, int* deviceAvailable) {
  if (!cudaBuilt || !deviceAvailable)
    return Report(nullptr, scape::InvalidArgument(
                               "scapeGetDeviceSupport: cudaBuilt or deviceAvailable is NULL"));
  *cudaBuilt = SCAPE_HAVE_CUDA ? 1 : 0;
  *deviceAvailable = scape::device::GetRuntime()->Available() ? 1 : 0;
  return scapeSuccess;
}

// Internal, for tests only (not in scape.h, no compatibility promise): installs a device
// runtime (a scape::device::Runtime* of the same build, e.g. tests/device's CPU fake), as
// scape::device::SetRuntimeForTesting does; NULL restores the built-in one. Returns the
// previous override (NULL if none). Lets a test library loaded beside the shipped one (the
// Python tests' fake device) drive its device paths without a GPU. Only while no device work
// is in flight; production code never calls it.
SCAPE_API void* scapeInternalTestingSetDeviceRuntime(void* runtime) {
  return scape::device::SetRuntimeForTesting(static_cast<scape::device::Runtime*>(runtime));
}

}  // extern "C"
