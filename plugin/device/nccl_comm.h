// NcclComm: one communicator's NCCL state and the NCCL calls of SCAPE collectives on a caller's
// (or the library's) ncclComm_t, with libnccl loaded by dlopen (the shipped library has no
// link-time dependency on NCCL). The NCCL backend over it (backend::NcclBackend) is in
// plugin/backend/backend.h. The NCCL types are mirrored here as plain integers so that no NCCL
// header is needed; their values are NCCL's ABI (nccl.h of NCCL 2.x) and tests/device checks
// them against nccl.h where it is installed.
#ifndef SCAPE_PLUGIN_DEVICE_NCCL_COMM_H_
#define SCAPE_PLUGIN_DEVICE_NCCL_COMM_H_

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "base/status.h"
#include "plugin/coll/coll.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"

namespace scape {
namespace device {

// NCCL ABI values (nccl.h).
enum : int {
  kNcclInt8 = 0,
  kNcclUint8 = 1,
  kNcclInt32 = 2,
  kNcclInt64 = 4,
  kNcclFloat16 = 6,
  kNcclFloat32 = 7,
  kNcclBfloat16 = 9
};
enum : int { kNcclSum = 0, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4 };
// NCCL result codes (ncclResult_t).
enum : int {
  kNcclSuccess = 0,
  kNcclUnhandledCudaError = 1,
  kNcclSystemError = 2,
  kNcclInternalError = 3,
  kNcclInvalidArgument = 4,
  kNcclInvalidUsage = 5,
  kNcclRemoteError = 6,
  kNcclInProgress = 7
};
int NcclDataType(scapeDataType_t t);  // -1: none
int NcclRedOp(scapeRedOp_t o);        // -1: none
// Maps an ncclResult_t to a Status; `what` names the call.
Status FromNccl(int r, const char* what, const char* ncclMessage);

// ncclUniqueId (nccl.h): 128 opaque bytes, passed by value to ncclCommInitRank.
struct NcclUniqueId {
  char internal[128];
};

// The entry points the backend uses, resolved from the library.
struct NcclApi {
  std::string path;
  int version = 0;
  int (*getVersion)(int*) = nullptr;
  const char* (*getErrorString)(int) = nullptr;
  const char* (*getLastError)(void*) = nullptr;  // optional (NCCL >= 2.13)
  int (*commCount)(void*, int*) = nullptr;
  int (*commUserRank)(void*, int*) = nullptr;
  int (*commGetAsyncError)(void*, int*) = nullptr;
  int (*allReduce)(const void*, void*, size_t, int, int, void*, void*) = nullptr;
  int (*reduceScatter)(const void*, void*, size_t, int, int, void*, void*) = nullptr;
  int (*allGather)(const void*, void*, size_t, int, void*, void*) = nullptr;
  int (*broadcast)(const void*, void*, size_t, int, int, void*, void*) = nullptr;
  // Optional at load; the packed (V) collectives with unequal blocks need them (NCCL 2.x has
  // them all; a library without them gets a clear error at that call).
  int (*reduce)(const void*, void*, size_t, int, int, int, void*, void*) = nullptr;
  int (*groupStart)() = nullptr;
  int (*groupEnd)() = nullptr;
  // Optional at load; a communicator the library makes itself (scapeCommInitNcclRank /
  // scapeCommInitNcclFromEnv) needs the first three (NCCL 2.x has them all), ncclCommAbort is
  // used by scapeCommAbort when present (else ncclCommDestroy).
  int (*getUniqueId)(NcclUniqueId*) = nullptr;
  int (*commInitRank)(void**, int, NcclUniqueId, int) = nullptr;
  int (*commDestroy)(void*) = nullptr;
  int (*commAbort)(void*) = nullptr;
};

// Loads NCCL once per path and keeps it loaded: SCAPE_NCCL_LIBRARY if set, else
// "libnccl.so.2" through the dynamic loader's search path. scapeUnsupported when the library
// cannot be opened (message: the path and dlerror), scapeSystemError when it lacks an entry
// point or is older than 2.10 (no ncclAvg).
Status LoadNccl(const NcclApi** out);

// For a communicator the library makes itself: scapeUnsupported naming the library when one of
// ncclGetUniqueId, ncclCommInitRank, ncclCommDestroy is missing.
Status CheckOwnedNccl(const NcclApi& api);

// Runs fn() (an NCCL call that may wait for other ranks) on a helper thread whose current
// device is `device`, and waits for it at most timeoutMs. True with *result = fn's result
// when it returned in time; false on a timeout: the thread is left to finish on its own (it
// owns everything it touches), what fn makes is then never used.
bool RunWithDeadline(std::function<int()> fn, int device, int timeoutMs, int* result);

// One communicator's NCCL state (the NCCL backend's channel to NCCL).
class NcclComm {
 public:
  // owned: the library made `ncclComm` (scapeCommInitNcclRank/FromEnv) and Close() ends it;
  // otherwise it stays the caller's and Close() does nothing.
  static Status Create(void* ncclComm, std::unique_ptr<NcclComm>* out, bool owned = false);
  // Ends an owned NCCL communicator once: abort = ncclCommAbort (ncclCommDestroy when the
  // library has no ncclCommAbort), else ncclCommDestroy on a helper thread with the calling
  // thread's device, waited for at most timeoutMs (a destroy that does not return in time is
  // left behind with a warning rather than hanging the caller). Later calls do nothing.
  // From then on (a caller's communicator too: the library makes no more calls on it) every
  // call of this object that would reach NCCL (Run, BroadcastHostBytes, AsyncError) is
  // scapeInvalidUsage saying so, without touching the NCCL communicator, which ncclCommAbort /
  // ncclCommDestroy has freed. Close may come from another thread (scapeCommAbort) while a call
  // is in progress: every call of this object holds a use of the communicator (Use below) from
  // its check that it is open until it has left its last NCCL call, and Close, after marking
  // the object closed (so no use starts any more), waits until the uses in progress have
  // ended before it ends the communicator: a call that passed the check never reaches NCCL
  // with a freed communicator. That wait is bounded (min(timeoutMs, kUseWaitMs)): an NCCL call
  // that does not return by then (blocked inside NCCL on a peer) is left to NCCL, and
  // ncclCommAbort, which is made to end such calls, is called with a warning naming it.
  void Close(bool abort, int timeoutMs);
  static constexpr int kUseWaitMs = 5000;
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // scapeInvalidUsage naming `what` when closed, else Ok.
  Status CheckOpen(const char* what) const;
  bool owned() const { return owned_; }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const NcclApi& api() const { return *api_; }
  // Issues a validated collective on `stream` (device pointers checked by the caller).
  // a.counts non-empty (nranks entries, the per-rank blocks of a mask's packed values):
  //   all-reduce: one ncclAllReduce of their sum;
  //   reduce-scatter: ncclReduceScatter when all blocks are equal, else one ncclReduce per
  //     non-empty block (root = the block's rank) inside ncclGroupStart / ncclGroupEnd;
  //   all-gather: ncclAllGather when all blocks are equal, else one ncclBroadcast per non-empty
  //     block (root = its rank) inside a group.
  // 8-bit float payloads (e4m3, e5m2): an all-gather or a broadcast moves them as bytes
  // (ncclUint8: any NCCL, the bits unchanged); a reduction needs NCCL's own fp8 types, which
  // NCCL has only from 2.24 and on devices of compute capability 9.0 or later: elsewhere it is
  // scapeUnsupported naming the NCCL version, the device and what to use instead (checked
  // before any NCCL call). Where NCCL has them, its fp8 reduction is every rank's same result
  // but rounds as NCCL does, not necessarily to the bits of the UCX path's (the device script
  // compares them).
  Status Run(const coll::CollArgs& a, Stream stream);
  static constexpr int kNcclFp8Version = 22400;  // NCCL 2.24.0
  // Broadcasts `bytes` host bytes from rank `root` to every rank over this communicator (a
  // host wait, for init): the bytes go through a small device buffer on a stream made for
  // the call, which is waited for with a deadline of timeoutMs (an error, never a hang: a
  // rank that does not take part leaves the others with scapeTimeout). On a timeout the
  // device buffer and the stream are leaked (NCCL may still write to them).
  Status BroadcastHostBytes(void* bytes, size_t n, int root, int timeoutMs);
  // ncclCommGetAsyncError as a Status.
  Status AsyncError();

 private:
  Status Fail(int r, const char* what);
  // A use of the communicator (see Close): Begin fails with CheckOpen's error once closed,
  // else counts the use until End.
  Status BeginUse(const char* what);
  void EndUse();
  class Use;
  // Waits (at most ms) for the uses in progress to end; false on the deadline.
  bool WaitUses(int ms);
  mutable std::mutex useMu_;
  std::condition_variable useCv_;
  int uses_ = 0;  // under useMu_
  const NcclApi* api_ = nullptr;
  void* comm_ = nullptr;
  bool owned_ = false;
  std::atomic<bool> closed_{false};
  std::atomic<bool> aborted_{false};  // closed by Close(abort = true)
  int rank_ = 0, nranks_ = 1;
};

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_NCCL_COMM_H_
