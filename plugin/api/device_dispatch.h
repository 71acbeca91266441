// Device dispatch: the one place the API entry points ask "is this a device call?".
//
// - Pointer kinds come from the device runtime (cudaPointerGetAttributes; without a driver
//   every pointer is host memory). A collective's buffers must both be host memory or both
//   device (or managed) memory; a mix is scapeInvalidArgument naming the arguments.
// - Host buffers with a non-NULL stream (UCX backend): the call first waits for the stream
//   (work queued on it before the call, a host wait), then runs as with stream = NULL.
// - Device buffers on the UCX backend: staged through page-locked host buffers
//   (plugin/device/staging.h), enqueued on the stream; the call returns at once. Masks: the
//   packed values are staged as one V collective (a.counts); the masked all-reduce and
//   pack/unpack gather/scatter on the device with a per-mask device copy of the positions.
// - NCCL backend (scapeCommInitNccl): device buffers are issued to NCCL on the stream; host
//   buffers (and barriers) run on its host communicator when it has one (as on a UCX
//   communicator: a non-NULL stream is waited for first), else they are an error.
#ifndef SCAPE_PLUGIN_API_DEVICE_DISPATCH_H_
#define SCAPE_PLUGIN_API_DEVICE_DISPATCH_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "base/status.h"
#include "plugin/coll/coll.h"
#include "scape/scape.h"

struct scapeComm;
struct scapeMask;

namespace scape {
namespace device {

// For a validated collective on a UCX communicator. *handled = true when the device layer
// took the call (device buffers); false when the host path must run it (host buffers; a
// non-NULL stream has then been synchronised). async: the *Async form was called.
Status UcxCollective(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                     bool async, bool* handled);

// The masked (dense-in/dense-out) all-reduce on device buffers, on a UCX communicator: `a` is
// the validated dense call (count = the mask's n), `mask` a live mask of `comm` (validated).
// Enqueued on the stream: gather the mask's positions into a device packed temporary, the
// staged V all-reduce of the packed values (the mask's per-rank counts), scatter into recv;
// positions not in the mask are left as they are (the host path's semantics, same bits). A
// full mask with shard ownership runs the staged V all-reduce on the dense buffers directly.
Status UcxMaskedAllReduce(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream);

// scapeMaskPack / scapeMaskUnpack: *handled = false for two host buffers (the host path runs);
// device buffers are gathered / scattered on the default stream (stream-ordered: the call
// returns once enqueued); a host/device mix is scapeInvalidArgument naming both arguments.
// `mask` is live (validated); unpack: packed -> dense.
Status MaskPackDevice(scapeMask* mask, const void* dense, void* packed, size_t esz, bool unpack,
                      bool* handled);

// scapeMaskSelectNextTopk with a device statistic: *handled = false for host memory (the host
// path runs). Otherwise runs the top-k of |statistic| on the device over the segments this
// rank owns (the host path's segments and options), copies only the selected positions back
// (a host wait on that copy; the statistic is read on the default stream) and selects them.
Status MaskSelectTopkDevice(scapeMask* mask, const float* statistic, double density, bool* handled);

// Hooks of the mask's lifecycle: the device copies of its positions are dropped (freed once
// the device work that uses them has completed). Release: the mask is being destroyed;
// DropStale: its current positions may have changed (only copies of older ones are dropped).
void ReleaseMask(const scapeMask* mask);
void DropStaleMaskPositions(const scapeMask* mask);

// NCCL-backend communicators (made by scapeCommInitNccl). Their scapeComm's impl is the host
// (UCX) communicator that scapeCommInitNccl joins (SCAPE_NCCL_HOST_COMM=1), or NULL (0).
bool IsNcclComm(const scapeComm* comm);
// The API's routing rule, in one place: a collective goes to NcclCollective when `comm` is an
// NCCL-backend communicator and the call does not run on its host communicator (it has one,
// and the call is a barrier or its buffers are host memory); otherwise the UCX path
// (UcxCollective, then the host collective) takes it.
bool RunsOnNccl(const scapeComm* comm, const coll::CollArgs& a);
// Validates and issues a collective on an NCCL-backend communicator (device buffers). a.counts
// non-empty: the packed (V) forms (NcclBackend::Run); mask non-NULL: the masked dense-in/out
// all-reduce (plugin/device/device_masked.h, with the communicator's device pool).
Status NcclCollective(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                      bool async);
Status InitNccl(scapeComm** out, void* ncclComm, const scapeConfig_t* config);
// scapeCommInitNcclRank / scapeCommInitNcclFromEnv, once `comm` (a new UCX communicator, not
// yet handed out) is formed: rank 0's ncclUniqueId (from the dlopen'd NCCL) goes to every rank
// over `comm` (a host broadcast), every rank calls ncclCommInitRank on the calling thread's
// current device (waited for with the communicator's deadline), the ranks agree on the outcome
// (a host all-reduce), and `comm` becomes an NCCL-backend communicator that owns the NCCL one
// (scapeCommDestroy: ncclCommDestroy; scapeCommAbort: ncclCommAbort). On an error nothing is
// attached (the caller destroys `comm`).
Status MakeOwnedNccl(scapeComm* comm);
// rank / nranks of an NCCL-backend communicator (false if `comm` is not one).
bool NcclCommInfo(const scapeComm* comm, int* nranks, int* rank);

// Calls with no stream that take device buffers through host copies (scapeSparseAllReduce):
// StageIn copies `bytes` of a device `p` to *copy and points *view at it (host memory: *view
// = p, nothing copied); StageOut gives a host *view for an output `p` of up to `bytes`, and
// FinishOut copies its first `bytes` back when `p` is device memory. Copies run on the default
// stream and are waited for (host waits).
Status StageIn(const void* p, size_t bytes, std::vector<char>* copy, const void** view);
void StageOut(void* p, size_t bytes, std::vector<char>* copy, void** view);
Status FinishOut(void* p, const std::vector<char>& copy, size_t bytes);

// Lifecycle hooks of scapeCommDestroy / scapeCommAbort (any communicator; no-ops when it
// never made a device call): release drains the device work in flight (within the timeout),
// abort makes it fail fast.
void ReleaseComm(scapeComm* comm);
void AbortComm(scapeComm* comm);
// The first error of the communicator's device work (ok if none), for scapeCommGetAsyncError.
Status AsyncError(scapeComm* comm);

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_API_DEVICE_DISPATCH_H_
