// The one place that creates a UCP context: the communicator's transport (ucx_transport.cc) and
// the NCCL plugin's engine (plugin/nccl/ucx_engine.cc) both go through it, so UCX settings,
// features and the CUDA-memory query are applied the same way by both. Only files that already
// include UCX headers include this one.
#ifndef SCAPE_TRANSPORT_UCX_UCX_CONTEXT_H_
#define SCAPE_TRANSPORT_UCX_UCX_CONTEXT_H_

#include <ucp/api/ucp.h>

#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace scape {
namespace transport {

struct UcpContextOptions {
  // UCX settings applied on top of the environment's UCX_* (key without the UCX_ prefix, e.g.
  // "TLS"); an empty value leaves the setting alone.
  std::vector<std::pair<std::string, std::string>> settings;
  bool wakeup = false;           // UCP_FEATURE_WAKEUP (sleep on the worker's event fd)
  bool sharedByThreads = false;  // workers on several threads share the context
  const char* name = nullptr;    // shown in UCX's logs; NULL: UCX's default
};

// Creates a context with the tag API. On success *out owns it (ucp_cleanup) and *cudaMemory
// says whether UCX can move CUDA memory. A setting UCX refuses is reported with its key and
// value: "unknown UCX setting" for a key this UCX does not have, else "bad UCX setting".
Status CreateUcpContext(const UcpContextOptions& opts, ucp_context_h* out, bool* cudaMemory);

}  // namespace transport
}  // namespace scape

#endif  // SCAPE_TRANSPORT_UCX_UCX_CONTEXT_H_
