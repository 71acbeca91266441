// The one mapping from UCX's ucs_status_t to the library's result codes, shared by the
// communicator's transport (transport/ucx/ucx_transport.cc) and the NCCL plugin's engine
// (through ucx_layer.h's CodeError), so that a peer failure is reported the same way by both.
// Only files inside transport/ucx/ (and tests) include this one: it includes UCX's header.
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

}  // namespace transport
}  // namespace scape

#endif  // SCAPE_TRANSPORT_UCX_UCX_STATUS_H_
