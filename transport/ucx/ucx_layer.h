// The shared UCX layer: what the communicator's transport (transport/ucx/ucx_transport.cc) and
// the NCCL net plugin's engine (plugin/nccl/) both need from UCX, written once:
// - settings: the TLS list UCX runs with (the one read of UCX_TLS) and the UCX 1.13 rule for
//   which endpoints ask for failure reports (WantFailureReports);
// - the UCP context (features, settings, the CUDA-memory query), workers and their addresses;
// - endpoint set-up from a peer's address blob, and endpoint failure reports (EpFailure: how
//   UCX tells either user that a peer is gone);
// - tagged sends and receives (the 64-bit tag and its mask are the caller's: the library's
//   layout is in plugin/coll/coll.h, the NCCL plugin's in plugin/nccl/engine_internal.h), their
//   requests (test, cancel, free, wait with a deadline) and endpoint close.
// What differs stays with each user: the library's per-rank endpoint table and the
// communicator's process watching; the NCCL plugin's listen / connect / accept handles, its
// setup-socket liveness channel and grouped receives.
//
// This header names no UCX type, so that UCX headers stay inside transport/ucx/
// (tests/check_layers.py): UCX handles travel as opaque pointers and UCX status codes as ints.
// Thread safety: as UCX's; a Worker created with Threads::kSerialized must be serialised by its
// user (the NCCL engine holds a mutex per worker).
#ifndef SCAPE_TRANSPORT_UCX_UCX_LAYER_H_
#define SCAPE_TRANSPORT_UCX_UCX_LAYER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace scape {
namespace transport {
namespace ucx {

// ---- status codes ------------------------------------------------------------------------------

// A ucs_status_t carried without UCX's header: 0 is UCS_OK, 1 UCS_INPROGRESS, errors negative.
using UcsCode = int;
constexpr UcsCode kUcsOk = 0;
constexpr UcsCode kUcsInProgress = 1;
// UCX's text for a code (ucs_status_string).
const char* CodeText(UcsCode code);
// "what: <UCX's text>" with the result code of the project's one UCX mapping
// (transport/ucx/ucx_status.h, UcxResult).
Status CodeError(const std::string& what, UcsCode code);
// The message was longer than the posted receive buffer (UCS_ERR_MESSAGE_TRUNCATED).
bool IsTruncated(UcsCode code);
// UCX's version string, for logs.
const char* Version();

// ---- settings ----------------------------------------------------------------------------------

// The TLS list UCX runs with: `configured` (a SCAPE knob: SCAPE_UCX_TLS, SCAPE_NCCL_UCX_TLS)
// when set, else the user's UCX_TLS. The one place that reads UCX_TLS (base/param.h's
// ParamExternal); read at each call, like UCX reads it at each context.
std::string EffectiveTls(const std::string& configured);

// Whether UCX may pick a shared-memory transport under the TLS list `tls` (UCX_TLS syntax:
// empty or "all" for everything, "a,b" for a list, "^a,b" for all but those).
bool SharedMemoryPossible(const std::string& tls);

// The UCX 1.13 workaround, written once: whether an endpoint to a peer asks UCX for failure
// reports (UCP_ERR_HANDLING_MODE_PEER). UCX 1.13's shared-memory transports cannot report a
// peer failure, so an endpoint that asks for reports never uses them. A same-host peer
// therefore goes without (its user watches it by other means: the communicator watches the
// peer's process, the NCCL plugin its setup connection) -- but only where shared memory can be
// used at all: under UCX_TLS=tcp, say, an endpoint without failure reports lets UCX 1.13 abort
// the survivor of a peer's death, so there the endpoint asks for them. `configuredTls` is the
// caller's knob (see EffectiveTls). (UCX 1.13 can still abort a receiver whose peer dies while
// their wire-up is in flight, in either mode: see perf/RESULTS_reliability.md.)
bool WantFailureReports(bool sameHost, const std::string& configuredTls);

// ---- context
// -------------------------------------------------------------------------------------

struct ContextOptions {
  // UCX settings applied on top of the environment's UCX_* (key without the UCX_ prefix, e.g.
  // "TLS"); an empty value leaves the setting alone.
  std::vector<std::pair<std::string, std::string>> settings;
  bool wakeup = false;           // UCP_FEATURE_WAKEUP (sleep on the worker's event fd)
  bool sharedByThreads = false;  // workers on several threads share the context
  const char* name = nullptr;    // shown in UCX's logs; NULL: UCX's default
};

// A UCP context with the tag API: the one place that creates one, so UCX settings, features and
// the CUDA-memory query are applied the same way by both users. Workers keep it alive.
class Context {
 public:
  // A setting UCX refuses is reported with its key and value: "unknown UCX setting" for a key
  // this UCX does not have, else "bad UCX setting". Every failure is a system error.
  static Status Create(const ContextOptions& opts, std::shared_ptr<Context>* out);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  // Whether UCX can move CUDA memory.
  bool CudaMemory() const { return cuda_; }
  void* raw() const { return h_; }  // the ucp_context_h, for transport/ucx/ only

 private:
  Context() = default;
  void* h_ = nullptr;
  bool cuda_ = false;
};

// ---- endpoints, requests
// -------------------------------------------------------------------------

struct UcxEndpoint;                     // a ucp_ep_h
using Ep = UcxEndpoint*;                // opaque; null: none
using Req = void*;                      // a UCX request; null: completed at once (or none)
enum class Mem { kAny, kHost, kCuda };  // kAny: UCX detects the memory type

// Where UCX reports an endpoint's failure (peer liveness as UCX sees it): `code` holds the last
// failure (kUcsOk until one), and `onFail` (optional) runs in the progress call that saw it.
// Must outlive the endpoint (or the worker, while the endpoint's close is unfinished).
struct EpFailure {
  std::atomic<int> code{kUcsOk};
  void (*onFail)(EpFailure* self, Ep ep, UcsCode code) = nullptr;
};

// ---- worker
// ----------------------------------------------------------------------------------------

class Worker {
 public:
  enum class Threads { kSingle, kSerialized };
  // Creates a worker on `ctx` and reads its address; `eventFd`: WaitForEvent may sleep (the
  // context needs ContextOptions::wakeup).
  static Status Create(std::shared_ptr<Context> ctx, Threads threads, bool eventFd,
                       std::unique_ptr<Worker>* out);
  ~Worker();  // destroys the worker (and releases the context) unless Leak() was called
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Keep the worker and its context alive for good instead of destroying them: destroying a
  // worker whose shared-memory (CMA) lanes still hold a dead peer's pending operations trips an
  // assertion inside UCX 1.13 (ucs_arbiter_group_is_empty).
  void Leak() { leak_ = true; }
  const Context& context() const { return *ctx_; }
  const std::vector<uint8_t>& Address() const { return address_; }

  // One ucp_worker_progress; true if it did something.
  bool Progress();
  // Sleeps until the worker has events or timeoutMs passed; false if it cannot sleep (no event
  // fd) or arming failed. True without sleeping when events are already pending.
  bool WaitForEvent(int timeoutMs);
  // Whether a message matching (tag & mask) has arrived unclaimed; *senderTag gets its tag.
  bool Probe(uint64_t wantedTag, uint64_t tagMask, uint64_t* senderTag);

  // Creates an endpoint to the worker whose address is addr[0, len). `failureReports`: see
  // WantFailureReports. `failure` (optional) receives UCX's failure reports. Returns kUcsOk or
  // UCX's code.
  UcsCode Connect(const uint8_t* addr, size_t len, bool failureReports, EpFailure* failure,
                  Ep* out);
  // Starts closing an endpoint (force: at once, without flushing). Returns the close's request
  // (free it with Free once Check says it is done), or null when it finished at once.
  Req CloseEndpoint(Ep ep, bool force);

  // Posts a tagged send (sync: completes only once the receiver matched it). *req gets the
  // request, null when it completed at once. Returns kUcsOk or UCX's code.
  UcsCode Send(Ep ep, const void* buf, size_t len, uint64_t tag, Mem mem, bool sync, Req* req);
  // Posts a tagged receive of messages with (tag & tagMask) == (wantedTag & tagMask). Always asks
  // for a request: UCX 1.13 reports neither the sender tag nor the length of a receive that
  // completes at once. *req null with kUcsOk means UCX completed it without a request anyway.
  UcsCode Recv(void* buf, size_t len, uint64_t wantedTag, uint64_t tagMask, Mem mem, Req* req);

  // A request's state: kUcsInProgress, kUcsOk, or its error.
  static UcsCode Check(Req r);
  // A receive's state; once complete, *length and *senderTag (optional) are filled.
  static UcsCode CheckRecv(Req r, size_t* length, uint64_t* senderTag);
  // Cancels an incomplete request (it completes with an error on a later progress).
  void Cancel(Req r);
  // Releases a request (UCX frees it once it completes, if it has not).
  static void Free(Req r);
  // Progresses until `r` completes or NowNs() reaches deadlineNs. True if it completed.
  bool Wait(Req r, int64_t deadlineNs);

 private:
  Worker() = default;
  std::shared_ptr<Context> ctx_;
  void* h_ = nullptr;  // ucp_worker_h
  std::vector<uint8_t> address_;
  int efd_ = -1;
  bool leak_ = false;
};

}  // namespace ucx
}  // namespace transport
}  // namespace scape

#endif  // SCAPE_TRANSPORT_UCX_UCX_LAYER_H_
