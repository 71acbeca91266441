// Public entry points of the GPU data path (the "device" block of scape.h).
#include "plugin/api/api_internal.h"
#include "plugin/api/device_dispatch.h"
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

}  // extern "C"
