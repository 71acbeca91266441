// Public entry points of the GPU data path (the "device" block of scape.h).
#include <functional>

#include "plugin/api/api_internal.h"
#include "plugin/api/device_dispatch.h"
#include "plugin/device/nccl_backend.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "scape_config.h"

using scape::Status;
using scape::api::Guard;
using scape::api::Report;

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
    scape::device::ReleaseComm(host);
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
  *backend = scape::device::IsNcclComm(comm) ? scapeBackendNccl : scapeBackendUcx;
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
