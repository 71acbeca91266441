// The one mapping from UCX's ucs_status_t to the library's result codes, shared by the
// communicator's transport (transport/ucx/ucx_transport.cc) and the NCCL plugin's engine
// (plugin/nccl/ucx_engine.cc), so that a peer failure is reported the same way by both.
// Only files that already include UCX headers include this one.
#ifndef SCAPE_TRANSPORT_UCX_UCX_STATUS_H_
#define SCAPE_TRANSPORT_UCX_UCX_STATUS_H_

#include <ucs/type/status.h>

#include <string>

#include "base/status.h"
#include "scape/scape.h"

namespace scape {
namespace transport {

// What a UCX status means for the caller:
// - a failure of the peer or of the path to it (reset, unreachable, rejected, endpoint or
//   link failures, I/O errors, and the shared-memory transport's "Shared memory error", which
//   UCX 1.13 reports when the peer's segment is gone because the peer tore down or died):
//   scapeRemoteError;
// - UCS_ERR_TIMED_OUT: scapeTimeout;
// - a message longer than the posted buffer: scapeInvalidUsage (the ranks disagree on a size);
// - an invalid parameter: scapeInternalError (a bug in the caller of UCX);
// - anything else (no memory, no device, no resource, unsupported): scapeSystemError.
inline scapeResult_t UcxResult(ucs_status_t s) {
  if (UCS_IS_LINK_ERROR(s) || UCS_IS_ENDPOINT_ERROR(s)) return scapeRemoteError;
  switch (s) {
    case UCS_OK:
      return scapeSuccess;
    case UCS_INPROGRESS:
      return scapeInProgress;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_SHMEM_SEGMENT:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SOME_CONNECTS_FAILED:
      return scapeRemoteError;
    case UCS_ERR_TIMED_OUT:
      return scapeTimeout;
    case UCS_ERR_MESSAGE_TRUNCATED:
      return scapeInvalidUsage;
    case UCS_ERR_INVALID_PARAM:
      return scapeInternalError;
    default:
      return scapeSystemError;
  }
}

// "what: <UCX's text>" with the code above.
inline Status UcxError(const std::string& what, ucs_status_t s) {
  return Status(UcxResult(s), what + ": " + ucs_status_string(s));
}

// Whether UCX may pick a shared-memory transport under the TLS list `tls` (UCX_TLS syntax:
// empty or "all" for everything, "a,b" for a list, "^a,b" for all but those). An endpoint to a
// same-host peer asks for no failure reports (UCP_ERR_HANDLING_MODE_NONE) only to let UCX use
// shared memory; where shared memory cannot be used anyway, it asks for them (MODE_PEER), so
// that UCX reports a dead peer through the error callback. (UCX 1.13 can still abort a
// receiver whose peer dies while their wire-up is in flight, in either mode: see
// perf/RESULTS_reliability.md.)
inline bool SharedMemoryPossible(const std::string& tls) {
  if (tls.empty() || tls == "all") return true;
  auto has = [&](const char* t) {
    const std::string s = "," + (tls[0] == '^' ? tls.substr(1) : tls) + ",";
    return s.find(std::string(",") + t + ",") != std::string::npos;
  };
  if (tls[0] == '^') return !has("sm") && !has("shm");
  return has("sm") || has("shm") || has("posix") || has("sysv") || has("xpmem") || has("all");
}

}  // namespace transport
}  // namespace scape

#endif  // SCAPE_TRANSPORT_UCX_UCX_STATUS_H_
