// The communicator's data path: one Backend interface for the memory a call moves, chosen when
// the communicator is made and owned by it (DataPath), and the operations written once over it
// (masked.h). As gloo's algorithms see only a transport interface, the masked operations see
// only a Backend: its checks (Admit), its exchange (Run, AllReducePacked), its temporaries
// (AcquirePacked) and its gather/scatter kernels (kernels/cpu on the host, the device runtime's
// on a device).
//
// The set of backends is closed here, in plugin/backend: code above it (plugin/api,
// plugin/optim, ...) sees Backend and DataPath only, never a concrete class, and asks
// capability questions (Takes, StreamOrdered, Topology, SharedPool) instead of which backend it
// has (tests/check_closed_sets.py, ctest ClosedSets, enforces it). Three implementations:
//   - HostBackend: host buffers, on the UCX communicator (plugin/core Comm::Submit / Wait; the
//     *Async forms return the queued operation). A non-NULL stream is waited for first.
//   - UcxStagedBackend: device buffers on a UCX communicator, staged through page-locked host
//     buffers on the stream (plugin/device/staging.h; the channel is made, collectively, at the
//     communicator's first device collective).
//   - NcclBackend: device buffers on an NCCL-backend communicator, over its NCCL state
//     (device::NcclComm, plugin/device/nccl_comm.h); its rank space is NCCL's (Topology).
// The two device backends share DeviceBackend: the communicator's DevicePool (every device
// temporary of the mask calls, shared with the optimizer: SharedPool) and the device copies of
// mask positions (MaskPositions).
//
// Routing: each backend says which calls it takes (Takes: the one place for the pointer-kind
// rules), and DataPath asks its backends in order; the first that takes a call runs it. A UCX
// communicator's DataPath holds HostBackend, UcxStagedBackend; an NCCL-backend one's holds
// NcclBackend, then HostBackend when it has a host communicator (SCAPE_NCCL_HOST_COMM=1). The
// lists are made in DataPath::ForUcx / ForNccl (host_backend.cc). Arguments are validated
// before routing (plugin/api StartColl), and each backend's Admit checks only what that backend
// cannot do.
#ifndef SCAPE_PLUGIN_BACKEND_BACKEND_H_
#define SCAPE_PLUGIN_BACKEND_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "plugin/coll/coll.h"
#include "plugin/core/comm.h"
#include "plugin/device/device_pool.h"
#include "plugin/device/mask_positions.h"
#include "plugin/device/nccl_comm.h"
#include "plugin/device/runtime.h"
#include "plugin/device/staging.h"
#include "plugin/mask/mask.h"

namespace scape {
namespace backend {

using device::Stream;

// Where a call's buffers are, as the routing rule sees them (BufferKinds): none (a NULL
// pointer, or a send buffer the call ignores: broadcast off the root), host memory, device (or
// managed) memory.
enum class Mem { kNone, kHost, kDevice };

// What a backend is asked (Backend::Takes): a barrier, or a call on these buffers.
struct Buffers {
  bool barrier = false;
  Mem send = Mem::kNone, recv = Mem::kNone;
  bool Any(Mem m) const { return send == m || recv == m; }
  bool Mixed() const { return Any(Mem::kHost) && Any(Mem::kDevice); }
};

// A rank space of a backend's own (a device library's communicator, not the host Comm).
struct RankSpace {
  int nranks = 1, rank = 0;
  int reportAs = scapeBackendUcx;  // the scapeBackend_t scapeCommGetBackend reports
};

// The packed values (and positions) of one masked operation, from AcquirePacked.
struct Packed {
  void* buf = nullptr;            // k elements (null on a device backend when k == 0)
  const uint64_t* pos = nullptr;  // the mask's k positions, in the backend's memory
  device::DevicePool::Block blk;  // device backends: the block behind buf
  std::shared_ptr<void> hold;     // host, *Async form: buf and the positions it packed
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual int rank() const = 0;

  // The one place for which calls this backend takes (DataPath asks its backends in order, the
  // first that says yes runs the call): host: barriers and calls with no device buffer; UCX
  // staged: calls with buffers, all device memory; NCCL: calls (not barriers) with a device
  // buffer or with none (a host/device mix included: its Admit names the mix).
  virtual bool Takes(const Buffers& b) const = 0;
  // True when the backend's work is enqueued on the caller's stream (device backends); false
  // when it runs at once, after what the caller queued on a non-NULL stream (host).
  virtual bool StreamOrdered() const = 0;
  // *out = this backend's rank space when it has one of its own (NCCL's communicator); false
  // when it runs on the communicator's host Comm (the default).
  virtual bool Topology(RankSpace* out) const {
    (void)out;
    return false;
  }
  // The communicator's device pool, shared (the device backends: made at the first call that
  // needs it); null on a backend without one (host). A user that holds blocks of it beyond one
  // call (the optimizer's device state) keeps the pool alive with them, so the order in which
  // the communicator's device side and that user go (scapeCommAbort frees the device side
  // before the optimizers) does not matter: the last owner frees the pool.
  virtual std::shared_ptr<device::DevicePool> SharedPool() { return nullptr; }

  // What this backend checks before it runs a validated call `a` on stream `s` (async: the
  // *Async form was called). Host: a non-NULL stream is waited for (what the caller queued on
  // it must finish first). UCX staged: device buffers are stream-ordered, so no *Async form;
  // the communicator is usable. NCCL: no barrier, no *Async form, device buffers only.
  virtual Status Admit(const coll::CollArgs& a, Stream s, bool async) = 0;
  // Runs an admitted collective (a.counts non-empty: the packed V forms of a mask). async
  // non-null (host only): queued, *async receives it and onDone runs when it completes;
  // otherwise blocking (host) or enqueued on `s` (device).
  virtual Status Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>* async,
                     std::function<void()> onDone = nullptr) = 0;
  // The exchange step of the masked all-reduce: the all-reduce of mask m's k packed values
  // (send == recv, count = k). Host and UCX staged run it over the owners' blocks
  // (m.RankCounts(): the same bits as reduce-scatter + all-gather), NCCL as one ncclAllReduce
  // (nothing when k == 0).
  virtual Status AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                                 std::shared_ptr<PendingOp>* async,
                                 std::function<void()> onDone) = 0;

  // The positions of m's current generation for work on `s`, in this backend's memory.
  virtual Status Positions(const Mask& m, Stream s, const uint64_t** pos) = 0;
  // Temporaries of one masked operation: positions and room for k elements of esz bytes.
  // async: the operation outlives the call (host: owned by the request).
  virtual Status AcquirePacked(Mask& m, size_t k, size_t esz, Stream s, bool async,
                               Packed* out) = 0;
  // Once the work that uses p has been enqueued on s (or has run).
  virtual void ReleasePacked(Packed* p, Stream s) = 0;
  // packed[i] = dense[pos[i]] / dense[pos[i]] = packed[i], i < k (the memory kind's kernels).
  virtual Status Gather(const void* dense, const uint64_t* pos, size_t k, size_t esz, void* packed,
                        Stream s) = 0;
  virtual Status Scatter(const void* packed, const uint64_t* pos, size_t k, size_t esz, void* dense,
                         Stream s) = 0;
};

// Host buffers on a UCX communicator (not owned).
class HostBackend final : public Backend {
 public:
  explicit HostBackend(Comm* comm) : comm_(comm) {}
  int rank() const override { return comm_->rank(); }
  bool Takes(const Buffers& b) const override { return b.barrier || !b.Any(Mem::kDevice); }
  bool StreamOrdered() const override { return false; }
  Status Admit(const coll::CollArgs& a, Stream s, bool async) override;
  Status Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>* async,
             std::function<void()> onDone = nullptr) override;
  Status AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                         std::shared_ptr<PendingOp>* async, std::function<void()> onDone) override;
  Status Positions(const Mask& m, Stream s, const uint64_t** pos) override;
  Status AcquirePacked(Mask& m, size_t k, size_t esz, Stream s, bool async, Packed* out) override;
  void ReleasePacked(Packed* p, Stream s) override;
  Status Gather(const void* dense, const uint64_t* pos, size_t k, size_t esz, void* packed,
                Stream s) override;
  Status Scatter(const void* packed, const uint64_t* pos, size_t k, size_t esz, void* dense,
                 Stream s) override;

 private:
  Comm* const comm_;
};

// What both device backends share: the communicator's device pool and the device copies of
// mask positions (made at the first device call that needs them, with the runtime of that
// moment), the device gather/scatter, and the device forms of the mask calls.
class DeviceBackend : public Backend {
 public:
  // alloc: the caller's device allocator, which the pool takes its memory from (alloc NULL:
  // the runtime's memory, kept in the pool).
  DeviceBackend(int timeoutMs, const scapeDeviceAllocator_t& alloc)
      : timeoutMs_(timeoutMs), alloc_(alloc) {}
  ~DeviceBackend() override;

  bool StreamOrdered() const override { return true; }
  Status Positions(const Mask& m, Stream s, const uint64_t** pos) override;
  Status AcquirePacked(Mask& m, size_t k, size_t esz, Stream s, bool async, Packed* out) override;
  void ReleasePacked(Packed* p, Stream s) override;
  Status Gather(const void* dense, const uint64_t* pos, size_t k, size_t esz, void* packed,
                Stream s) override;
  Status Scatter(const void* packed, const uint64_t* pos, size_t k, size_t esz, void* dense,
                 Stream s) override;

  // scapeMaskSelectNextTopk[Stream] with a device statistic: the top-k of |statistic| on the
  // device, on stream `s` (NULL: the legacy default stream), over the segments this rank owns
  // (the host path's segment table and options), only the selected positions copied back (a
  // host wait with the communicator's deadline).
  Status SelectTopk(Mask& m, const float* statistic, double density, Stream s = nullptr);
  // The mask's device positions are let go (freed once the work that uses them has run):
  // Drop, the mask is being destroyed; DropStale, only the copies of older generations.
  void DropMask(const Mask& m);
  void DropStale(const Mask& m);

  // The communicator's device pool (made at the first call that needs it): every device
  // temporary, the optimizer step's scratch included (plugin/optim/optim_device.cc, through
  // SharedPool).
  device::DevicePool& Pool();
  std::shared_ptr<device::DevicePool> SharedPool() override;

  // Lifecycle (scapeCommDestroy / scapeCommAbort / scapeCommGetAsyncError).
  virtual void Release(int timeoutMs) = 0;  // drains device work in flight, closes
  virtual void Abort();                     // device work in flight fails fast
  virtual Status AsyncError() = 0;

 protected:
  // The mask positions, made at the first call that needs them (with the pool).
  device::MaskPositions& MaskPos();
  // Made now, with `rt` (an NCCL-backend communicator's pool is made at init).
  void MakePool(device::Runtime* rt);
  std::mutex mu_;  // the lazily made members (scapeCommAbort may come from another thread)

 private:
  const int timeoutMs_;
  const scapeDeviceAllocator_t alloc_;
  // positions_ before pool_ in destruction order: its blocks go back to the pool first. Shared
  // with the optimizers' device states (SharedPool).
  std::shared_ptr<device::DevicePool> pool_;
  std::unique_ptr<device::MaskPositions> positions_;
};

// Device buffers on a UCX communicator, staged (the channel and its child communicator are made
// at the first device collective: collective, every rank makes it at the same call).
class UcxStagedBackend final : public DeviceBackend {
 public:
  explicit UcxStagedBackend(Comm* comm)
      : DeviceBackend(comm->config().timeoutMs, comm->config().deviceAllocator), comm_(comm) {}
  ~UcxStagedBackend() override;
  int rank() const override { return comm_->rank(); }
  bool Takes(const Buffers& b) const override {
    return !b.barrier && b.Any(Mem::kDevice) && !b.Any(Mem::kHost);
  }
  Status Admit(const coll::CollArgs& a, Stream s, bool async) override;
  Status Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>* async,
             std::function<void()> onDone = nullptr) override;
  Status AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                         std::shared_ptr<PendingOp>* async, std::function<void()> onDone) override;
  void Release(int timeoutMs) override;
  void Abort() override;
  Status AsyncError() override;

 private:
  Comm* const comm_;
  std::unique_ptr<device::StagingChannel> staging_;  // under mu_
};

// Device buffers on an NCCL-backend communicator (owns the NCCL state).
class NcclBackend final : public DeviceBackend {
 public:
  NcclBackend(std::unique_ptr<device::NcclComm> nccl, int timeoutMs,
              const scapeDeviceAllocator_t& alloc);
  int rank() const override { return nccl_->rank(); }
  bool Takes(const Buffers& b) const override {
    return !b.barrier && (b.Any(Mem::kDevice) || !b.Any(Mem::kHost));
  }
  bool Topology(RankSpace* out) const override;
  Status Admit(const coll::CollArgs& a, Stream s, bool async) override;
  Status Run(const coll::CollArgs& a, Stream s, std::shared_ptr<PendingOp>* async,
             std::function<void()> onDone = nullptr) override;
  Status AllReducePacked(const Mask& m, coll::CollArgs a, Stream s,
                         std::shared_ptr<PendingOp>* async, std::function<void()> onDone) override;
  void Release(int timeoutMs) override;
  void Abort() override;
  Status AsyncError() override;

 private:
  std::unique_ptr<device::NcclComm> nccl_;
};

// A communicator's backends, in routing order, and the routing rule: ask each in order.
class DataPath {
 public:
  // A UCX communicator: host buffers on `comm`, device buffers staged over it.
  static std::unique_ptr<DataPath> ForUcx(Comm* comm);
  // An NCCL-backend communicator: device buffers on NCCL; host buffers and barriers on `host`
  // when it has one (null: SCAPE_NCCL_HOST_COMM=0).
  // alloc: the caller's device allocator (scapeConfig_t.deviceAllocator; alloc NULL: none).
  static std::unique_ptr<DataPath> ForNccl(Comm* host, std::unique_ptr<device::NcclComm> nccl,
                                           int timeoutMs, const scapeDeviceAllocator_t& alloc);

  // The backend on the communicator's host Comm (null: an NCCL one without a host comm).
  Backend* host() const { return host_.get(); }
  // The backend of device buffers (null after Release).
  DeviceBackend* device() const { return device_.get(); }
  // The communicator's rank space when a backend has one of its own (NCCL's), from the first
  // backend that has; false when the ranks are the host Comm's.
  bool Topology(RankSpace* out) const;

  // Which backend runs the validated collective `a`: the first in order that takes it
  // (Backend::Takes). When none does, a host/device mix is scapeInvalidArgument naming both
  // buffers; anything else goes to the first backend, whose Admit names what it cannot do.
  Status Route(const coll::CollArgs& a, Backend** out) const;
  // The same for a mask's pack / unpack (dense <-> packed; a NULL pointer counts as host
  // memory): a mix is scapeInvalidArgument naming both; memory no backend takes (device memory
  // after Release) is scapeInvalidUsage.
  Status RouteBuffers(const void* dense, const void* packed, Backend** out) const;

  // scapeCommDestroy / scapeCommAbort: drains (within timeoutMs) and frees the device side;
  // the host side stays until the communicator goes.
  void Release(int timeoutMs);
  // scapeCommAbort, possibly from another thread while a call is in flight: device work fails
  // fast (the device side stays until Release).
  void Abort();
  // The first error of the device work (ok if none), for scapeCommGetAsyncError.
  Status AsyncError() const;

 private:
  DataPath() = default;
  // The first backend in order_ that takes b (null: none).
  Backend* Pick(const Buffers& b) const;
  // Owned by lifetime: the host side lives as long as the communicator, the device side goes at
  // Release (before the parent communicator).
  std::unique_ptr<Backend> host_;
  std::unique_ptr<DeviceBackend> device_;
  std::vector<Backend*> order_;  // the routing order (device_ leaves it at Release)
  mutable std::mutex mu_;        // device_, order_ (Abort / AsyncError / Topology vs Release)
};

// Classifies a collective's buffers for the routing rule (*out; rank: whether this rank is a
// broadcast's root). A host/device mix is an error naming both arguments (*out is still set).
Status BufferKinds(const coll::CollArgs& a, int rank, Buffers* out);

// Calls with no stream that take device buffers through host copies (scapeSparseAllReduce):
// StageIn copies `bytes` of a device `p` to *copy and points *view at it (host memory: *view
// = p, nothing copied); StageOut gives a host *view for an output `p` of up to `bytes`, and
// FinishOut copies its first `bytes` back when `p` is device memory. Copies run on the default
// stream through page-locked staging and are waited for within timeoutMs (host waits with the
// communicator's deadline: scapeTimeout past it, never a hang; device::HostStaging).
Status StageIn(const void* p, size_t bytes, std::vector<char>* copy, const void** view,
               int timeoutMs);
void StageOut(void* p, size_t bytes, std::vector<char>* copy, void** view);
Status FinishOut(void* p, const std::vector<char>& copy, size_t bytes, int timeoutMs);

}  // namespace backend
}  // namespace scape

#endif  // SCAPE_PLUGIN_BACKEND_BACKEND_H_
