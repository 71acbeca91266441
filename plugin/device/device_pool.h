// The one home of the library's device temporaries (CUB's temp-storage discipline, stream-
// ordered): the mask positions and packed values of the masked all-reduce on both backends,
// the positions of scapeMaskPack / scapeMaskUnpack and the device top-k's output. One pool per
// communicator, made at its first device call and torn down with its last owner (the
// communicator's device backend, or an optimizer's device state that outlives it).
//
// Policy (what removed cudaMalloc / cudaFree from every per-call path: cudaFree synchronises
// the whole device, a stall once a step):
//  - Release(block, stream) hands a block back after the work that uses it was enqueued on
//    `stream`; an event recorded there says when that work has finished.
//  - Acquire(bytes, stream) takes the smallest block that fits among the ones last released on
//    that same stream handle (reused at once: the stream waits on the device for the release's
//    event, so the reuse is ordered even when the handle is a new stream that the runtime
//    created at a destroyed one's address; NULL is the legacy default stream), else among the
//    idle ones (their work has finished); else it allocates, with a quarter to spare so that a
//    mask whose k varies a little is served from the same block.
//  - Drop(block, stream): freed once the work on `stream` has finished, never reused.
//  - At most kMaxIdle finished blocks are kept (enough for two masks on two streams: positions,
//    packed values and the top-k's output each); the smallest beyond that are freed.
//  - Teardown waits (within the communicator's timeout) for the work still using a block, then
//    frees everything; what is still in use after the deadline (after Abandon, the abort path:
//    kAbandonWaitMs at most) is leaked with a warning rather than freed under the device.
// Host memory that queued work still reads (an upload's source) rides along with a Release
// and is held until the event says the work has run.
//
// The device ops' per-call temporaries (runtime.h OpTemp) come from here too: the pool is the
// TempSource the device paths put in scope, so they are kept between steps like any block.
//
// With the caller's allocator (scapeConfig_t.deviceAllocator) the pool keeps nothing: Acquire
// asks the allocator for every block (on the stream it is for), and a block goes back to it
// as soon as the pool would have kept it: at once (stream-ordered) when it is handed back on
// the stream it was allocated for (the same stream, by Runtime::StreamId, not only the same
// handle: a destroyed stream's handle may name a new stream, which the allocator's ordering
// knows nothing of), else once an event says the work on the other stream has
// finished (so the allocator, which reuses a block on its allocation stream, never hands it to
// work that could overlap ours). The caching is then the allocator's (torch's caching
// allocator from Python), which also sees the memory. Allocations() counts the driver
// allocations (DeviceAlloc) either way; ExternalAllocations() the allocator's.
#ifndef SCAPE_PLUGIN_DEVICE_DEVICE_POOL_H_
#define SCAPE_PLUGIN_DEVICE_DEVICE_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "plugin/device/runtime.h"

namespace scape {
namespace device {

class DevicePool final : public TempSource {
 public:
  static constexpr size_t kMaxIdle = 8;
  static constexpr int kAbandonWaitMs = 200;

  struct Block {
    void* d = nullptr;
    size_t bytes = 0;  // capacity
    // With the caller's allocator: the stream and device it was allocated for, and that
    // stream's id (Runtime::StreamId; s0Known false: the runtime cannot tell, and the block
    // never goes back at once).
    Stream s0 = nullptr;
    int dev = 0;
    uint64_t s0Id = 0;
    bool s0Known = false;
  };

  // ext: the caller's allocator (copied), or nullptr / one without alloc: the runtime's memory.
  DevicePool(Runtime* rt, int timeoutMs, const scapeDeviceAllocator_t* ext = nullptr);
  ~DevicePool() override;
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  Runtime* runtime() const { return rt_; }

  // A block of at least `bytes` for work about to be enqueued on `s` (see the policy above).
  // exact: a new block gets no quarter to spare (a user that sizes its own blocks: the
  // optimizer's scratch, refitted by its own rule).
  Status Acquire(size_t bytes, Stream s, Block* out, bool exact = false);
  // Hands `b` back once the work that uses it has been enqueued on `s`, with `keep` (may be
  // null) held until that work has run. A null block only holds `keep`. If no event can be
  // recorded, waits for the stream instead (a host wait, bounded by the runtime's).
  void Release(Block b, Stream s, std::shared_ptr<const void> keep = nullptr);

  // Hands `b` back for good: it is freed (never reused) once the work enqueued on `s` so far
  // has finished, without a host wait. For a block a long-lived user outgrew or shrank out of
  // (the optimizer's scratch when its mask's size changes), which idle-keeping would hold.
  void Drop(Block b, Stream s);

  // Frees the dropped blocks whose work has finished (and trims the idle set): for a user that
  // holds its blocks across calls and may not call Acquire again for a long time.
  void Sweep();

  // scapeCommAbort: teardown then waits kAbandonWaitMs at most for the work in flight.
  void Abandon() { abandoned_.store(true); }

  // TempSource (runtime.h): an op's temporary is a block acquired on `s` and released there.
  Status TempAlloc(size_t bytes, Stream s, void** d) override;
  void TempFree(void* d, Stream s) override;

  // For tests: blocks the pool owns (retired or idle), driver allocations made so far, and the
  // caller's allocator's.
  size_t BlocksHeld();
  uint64_t Allocations() const { return allocs_.load(); }
  uint64_t ExternalAllocations() const { return extAllocs_.load(); }
  bool External() const { return ext_.alloc != nullptr; }

 private:
  struct Retired {
    Block b;  // d == nullptr: taken again on its stream, or none (keep only)
    Event ev = nullptr;
    Stream s = nullptr;
    bool idle = false;  // ev has completed
    bool drop = false;  // Drop: freed once idle, never taken again
    std::shared_ptr<const void> keep;
  };
  // Marks the records whose event has completed idle (dropping what they kept); frees the
  // idle blocks beyond kMaxIdle, smallest first. With `teardown`, frees every finished block
  // and waits (up to the deadline, unless abandoned) for the rest.
  void SweepLocked(bool teardown);
  void FreeLocked(Retired* r);
  // The block's memory back to where it came from (the caller's allocator or the runtime).
  void FreeBlock(const Block& b);
  // With the caller's allocator, a block handed back on the stream it was allocated for goes
  // back to the allocator at once (true); else it waits in retired_ for its event.
  bool ReturnNow(const Block& b, Stream s);

  Runtime* const rt_;
  const int timeoutMs_;
  scapeDeviceAllocator_t ext_{};
  std::atomic<bool> abandoned_{false};
  std::atomic<uint64_t> allocs_{0}, extAllocs_{0};
  std::mutex mu_;
  std::vector<Retired> retired_;
  std::vector<Block> temps_;  // TempAlloc's blocks in use (by address)
};

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_DEVICE_POOL_H_
