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

#include "plugin/core/comm.h"
#include "plugin/mask/mask.h"
#include "scape/scape.h"
#include "base/status.h"

struct scapeRequest;

struct scapeComm {
  std::unique_ptr<scape::Comm> impl;
  std::string lastError;
  std::set<scapeRequest*> requests;  // live request handles
  std::set<scapeMask*> masks;        // live masks created on this communicator
  // Calls in progress on this communicator (counted by ActiveCall), so that scapeCommAbort
  // from another thread frees nothing while a blocked call is still inside the library.
  std::atomic<int> activeCalls{0};
  std::atomic<bool> aborting{false};
};

struct scapeRequest {
  scapeComm* comm;
  std::shared_ptr<scape::PendingOp> op;
};

struct scapeMask {
  std::unique_ptr<scape::Mask> impl;
  scapeComm* comm;
};

namespace scape {
namespace api {

inline thread_local std::string t_lastError;

inline scapeResult_t Report(scapeComm* comm, const Status& st) {
  if (st.ok()) return scapeSuccess;
  if (comm) comm->lastError = st.message();
  else t_lastError = st.message();
  return st.code();
}

// Counts a call as in progress on `comm` (NULL: nothing) for the lifetime of the object. The
// decrement is the last thing a call does to its communicator.
class ActiveCall {
 public:
  explicit ActiveCall(scapeComm* comm) : comm_(comm) {
    if (comm_) comm_->activeCalls.fetch_add(1, std::memory_order_acq_rel);
  }
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
  ActiveCall active(comm);
  if (comm && comm->aborting.load(std::memory_order_acquire))
    // Not recorded on the communicator: its owner is tearing it down on another thread.
    return Report(nullptr, InvalidUsage(std::string(fn) + ": the communicator is being aborted "
                                        "(scapeCommAbort)"));
  try {
    Status st = body();
    if (!st.ok()) {
      if (st.message().rfind(fn, 0) != 0) st.Prepend(fn);
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
  if (!comm || !comm->impl) return InvalidArgument("comm is NULL");
  return Status::Ok();
}

// scapeAllReduce with a mask: pack, dense all-reduce of the k values, unpack (api_mask.cc).
// request NULL: blocking; else the operation is queued and *request receives its handle (the
// unpack runs when the exchange completes).
Status MaskedAllReduce(scapeComm* comm, const void* send, void* recv, size_t count,
                       scapeDataType_t dtype, scapeRedOp_t op, scapeMask* mask,
                       scapeRequest_t* request);

// Queues a validated collective: blocking (request NULL) waits for it; otherwise *request
// receives a new handle registered with the communicator.
Status SubmitOrRun(scapeComm* comm, const coll::CollArgs& a, scapeRequest_t* request,
                   std::function<void()> onDone = nullptr);

}  // namespace api
}  // namespace scape

#endif  // SCAPE_PLUGIN_API_INTERNAL_H_
