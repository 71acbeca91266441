// Shared by the API entry point files: the public handle structs, error reporting, and the
// guard that keeps C++ exceptions from crossing into C callers.
#ifndef SCAPE_PLUGIN_API_INTERNAL_H_
#define SCAPE_PLUGIN_API_INTERNAL_H_

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <set>
#include <string>

#include "base/status.h"
#include "plugin/backend/backend.h"
#include "plugin/core/comm.h"
#include "plugin/mask/mask.h"
#include "scape/scape.h"

struct scapeRequest;
struct scapeOptim;

namespace scape {
namespace api {

// Handle registry (api.cc): every communicator, mask, request and optimizer handle is registered
// when it is made and unregistered when it is destroyed, and every entry point looks a handle up
// before it touches it, so a destroyed (or never created) handle is an error, not a crash.
// The memory of a destroyed handle is kept out of reuse for a while (kHandleQuarantine later
// destructions of the same kind), so that a stale handle is not mistaken for a newer one that
// the allocator placed at the same address.
enum class HandleKind { kComm = 1, kMask = 2, kRequest = 3, kOptim = 4 };
constexpr size_t kHandleQuarantine = 4096;
void RegisterHandle(const void* h, HandleKind kind);
void UnregisterHandle(const void* h);
bool HandleLive(const void* h, HandleKind kind);
// Frees a handle's memory later (class operator delete of the handle structs).
void QuarantineFree(void* p, HandleKind kind);

}  // namespace api
}  // namespace scape

struct scapeComm {
  scapeComm() { scape::api::RegisterHandle(this, scape::api::HandleKind::kComm); }
  ~scapeComm() { scape::api::UnregisterHandle(this); }
  static void* operator new(size_t n) { return ::operator new(n); }  // pairs with the delete
  static void operator delete(void* p) {
    scape::api::QuarantineFree(p, scape::api::HandleKind::kComm);
  }
  std::unique_ptr<scape::Comm> impl;
  // The communicator's data path (plugin/backend): its backends, chosen at init, and the
  // routing rule between them. Declared after impl: it goes first (a staging channel's child
  // communicator and the device pool before the parent).
  std::unique_ptr<scape::backend::DataPath> data;
  std::string lastError;
  std::set<scapeRequest*> requests;  // live request handles
  std::set<scapeMask*> masks;        // live masks created on this communicator
  std::set<scapeOptim*> optims;      // live optimizers (api_optim.cc); each owns one of masks
  // Calls in progress on this communicator (counted by ActiveCall), so that scapeCommAbort
  // from another thread frees nothing while a blocked call is still inside the library.
  std::atomic<int> activeCalls{0};
  std::atomic<bool> aborting{false};
};

struct scapeRequest {
  scapeRequest(scapeComm* c, std::shared_ptr<scape::PendingOp> o) : comm(c), op(std::move(o)) {
    scape::api::RegisterHandle(this, scape::api::HandleKind::kRequest);
  }
  ~scapeRequest() { scape::api::UnregisterHandle(this); }
  static void* operator new(size_t n) { return ::operator new(n); }  // pairs with the delete
  static void operator delete(void* p) {
    scape::api::QuarantineFree(p, scape::api::HandleKind::kRequest);
  }
  scapeComm* comm;
  std::shared_ptr<scape::PendingOp> op;
};

struct scapeMask {
  scapeMask(std::unique_ptr<scape::Mask> m, scapeComm* c) : impl(std::move(m)), comm(c) {
    scape::api::RegisterHandle(this, scape::api::HandleKind::kMask);
  }
  ~scapeMask() {
    // Its device positions (freed once unused); none once the communicator's device side is
    // released (scapeCommAbort frees masks after it).
    if (comm && comm->data && comm->data->device() && impl) comm->data->device()->DropMask(*impl);
    scape::api::UnregisterHandle(this);
  }
  static void* operator new(size_t n) { return ::operator new(n); }  // pairs with the delete
  static void operator delete(void* p) {
    scape::api::QuarantineFree(p, scape::api::HandleKind::kMask);
  }
  std::unique_ptr<scape::Mask> impl;
  scapeComm* comm;
};

namespace scape {
namespace api {

inline thread_local std::string t_lastError;

inline scapeResult_t Report(scapeComm* comm, const Status& st) {
  if (st.ok()) return scapeSuccess;
  if (comm)
    comm->lastError = st.message();
  else
    t_lastError = st.message();
  return st.code();
}

// Counts a call as in progress on `comm` (NULL: nothing) for the lifetime of the object. The
// decrement is the last thing a call does to its communicator.
// Looks `comm` up in the handle registry and, if it is live, counts a call as in progress on
// it, both under the registry's lock (so that scapeCommAbort, which retires the handle under
// that lock and then waits for the count to drop, never frees what a starting call uses).
bool EnterComm(scapeComm* comm);

class ActiveCall {
 public:
  explicit ActiveCall(scapeComm* comm) : comm_(comm) {
    if (comm_) comm_->activeCalls.fetch_add(1, std::memory_order_acq_rel);
  }
  struct Entered {};
  // For a call already counted by EnterComm.
  ActiveCall(scapeComm* comm, Entered) : comm_(comm) {}
  ~ActiveCall() {
    if (comm_) comm_->activeCalls.fetch_sub(1, std::memory_order_acq_rel);
  }
  ActiveCall(const ActiveCall&) = delete;
  ActiveCall& operator=(const ActiveCall&) = delete;

 private:
  scapeComm* comm_;
};

// Runs `body`, turning any escaped exception into an error instead of unwinding into C, and
// prefixes the message with the function name. The call counts as active on `comm` (see
// scapeCommAbort); once an abort has begun, new calls fail at once.
template <typename F>
scapeResult_t Guard(scapeComm* comm, const char* fn, F&& body) {
  if (comm && !EnterComm(comm))
    return Report(nullptr, InvalidArgument(std::string(fn) + ": comm is not a live communicator "
                                                             "(destroyed, aborted, or not made by "
                                                             "scapeCommInit*)"));
  ActiveCall active(comm, ActiveCall::Entered{});
  if (comm && comm->aborting.load(std::memory_order_acquire))
    // Not recorded on the communicator: its owner is tearing it down on another thread.
    return Report(nullptr, InvalidUsage(std::string(fn) + ": the communicator is being aborted "
                                                          "(scapeCommAbort)"));
  try {
    Status st = body();
    if (!st.ok()) {
      if (st.message().rfind(fn, 0) != 0) st.Prepend(fn);
      // A call ended by scapeCommAbort from another thread: the communicator is freed as soon
      // as this call has returned, so the message goes to this thread's slot as well
      // (scapeGetLastError(NULL)), where the caller can still read it.
      if (comm && comm->aborting.load(std::memory_order_acquire)) t_lastError = st.message();
      return Report(comm, st);
    }
    return scapeSuccess;
  } catch (const std::bad_alloc&) {
    return Report(comm, SystemError(std::string(fn) + ": out of memory"));
  } catch (const std::exception& e) {
    return Report(comm, InternalError(std::string(fn) + ": " + e.what()));
  } catch (...) {
    return Report(comm, InternalError(std::string(fn) + ": unknown exception"));
  }
}

inline bool ValidType(scapeDataType_t t) { return t >= 0 && t < scapeNumTypes; }
inline bool ValidOp(scapeRedOp_t o) { return o >= 0 && o < scapeNumOps; }

inline Status CheckComm(scapeComm* comm) {
  if (!comm) return InvalidArgument("comm is NULL");
  // Only an NCCL-backend communicator made with SCAPE_NCCL_HOST_COMM=0 has no host one.
  if (!comm->impl)
    return InvalidUsage(
        "this NCCL-backend communicator has no host communicator (it was made with "
        "SCAPE_NCCL_HOST_COMM=0), and this call needs one (masks, host buffers, barriers, the "
        "optimizer): make it with SCAPE_NCCL_HOST_COMM=1 (the default)");
  return Status::Ok();
}

// The bodies of scapeCommInitRankConfig and scapeCommInitFromEnv (api.cc), for the entry points
// that join a host communicator first (scapeCommInitNcclRank / scapeCommInitNcclFromEnv).
Status InitRank(scapeComm_t* comm, int nranks, scapeUniqueId id, int rank,
                const scapeConfig_t* config);
Status InitFromEnv(scapeComm_t* comm, const scapeConfig_t* config);

// Frees an optimizer for scapeCommAbort, which frees its mask with the other masks
// (api_optim.cc).
void DeleteOptimOnAbort(scapeOptim* optim);

// The mask checks of scapeAllReduce with a mask (any buffers): a live mask of `comm`, count
// equal to the mask's n (api_mask.cc).
Status CheckMaskedAllReduce(scapeComm* comm, size_t count, scapeMask* mask, int rank);

// Runs a validated collective on the communicator's host backend: blocking (request NULL)
// waits for it; otherwise *request receives a new handle registered with the communicator.
Status SubmitOrRun(scapeComm* comm, const coll::CollArgs& a, scapeRequest_t* request,
                   std::function<void()> onDone = nullptr);
// *request receives a new handle for the queued operation `op`, registered with `comm`.
void NewRequest(scapeComm* comm, std::shared_ptr<PendingOp> op, scapeRequest_t* request);

// Runs a validated collective where the communicator's data path routes it
// (backend::DataPath::Route, then the backend's Admit and Run; mask non-NULL: the masked
// all-reduce, plugin/backend/masked.h). request NULL: blocking (device backends: enqueued on
// the stream); else the *Async form.
Status RouteAndRun(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                   scapeRequest_t* request);

// The communicator's device side, for scapeCommDestroy / scapeCommAbort (drained within the
// communicator's timeout, then freed; no-op when it never made a device call).
void ReleaseData(scapeComm* comm);

}  // namespace api
}  // namespace scape

#endif  // SCAPE_PLUGIN_API_INTERNAL_H_
