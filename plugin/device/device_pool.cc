// The device temporaries' pool: see device_pool.h.
#include "plugin/device/device_pool.h"

#include <time.h>

#include <algorithm>

#include "base/clock.h"
#include "base/log.h"

namespace scape {
namespace device {

DevicePool::DevicePool(Runtime* rt, int timeoutMs, const scapeDeviceAllocator_t* ext)
    : rt_(rt), timeoutMs_(timeoutMs) {
  if (ext && ext->alloc && ext->free) ext_ = *ext;
}

DevicePool::~DevicePool() {
  std::lock_guard<std::mutex> lk(mu_);
  SweepLocked(true);
}

size_t DevicePool::BlocksHeld() {
  std::lock_guard<std::mutex> lk(mu_);
  SweepLocked(false);
  size_t n = 0;
  for (const Retired& r : retired_) n += r.b.d != nullptr;
  return n;
}

void DevicePool::FreeLocked(Retired* r) {
  if (r->ev) rt_->EventDestroy(r->ev);
  r->ev = nullptr;
  if (r->b.d) FreeBlock(r->b);
  r->b = Block();
  r->keep.reset();
}

void DevicePool::SweepLocked(bool teardown) {
  // After an abort the wait is short: the streams may never get there.
  const int waitMs = abandoned_.load() ? std::min(timeoutMs_, kAbandonWaitMs) : timeoutMs_;
  const bool wait = teardown && waitMs > 0;
  Deadline dl = Deadline::AfterMs(wait ? waitMs : 0);
  for (;;) {
    size_t pending = 0;
    for (Retired& r : retired_) {
      if (r.idle || r.ev == nullptr) {
        r.idle = true;
        continue;
      }
      bool done = false;
      if (!rt_->EventQuery(r.ev, &done).ok()) {
        // A failed stream: its event may never be reached, and copies queued there may still
        // run, so the block is neither reused nor waited for; teardown leaks it.
        ++pending;
        continue;
      }
      if (done) {
        r.idle = true;
        r.keep.reset();  // the work that read it has run
        rt_->EventDestroy(r.ev);
        r.ev = nullptr;
      } else {
        ++pending;
      }
    }
    // Dropped blocks whose work has finished are freed.
    for (Retired& r : retired_)
      if (r.idle && r.drop && r.b.d) FreeLocked(&r);
    // Records that hold nothing any more go.
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                  [](const Retired& r) { return r.idle && r.b.d == nullptr; }),
                   retired_.end());
    if (teardown) {
      for (Retired& r : retired_)
        if (r.idle) FreeLocked(&r);
      retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                    [](const Retired& r) { return r.b.d == nullptr && !r.ev; }),
                     retired_.end());
    }
    if (!teardown) break;
    if (pending == 0) return;
    if (!wait || dl.Expired()) {
      SCAPE_WARN(
          "device pool: %zu device block(s) still in use by stream work at teardown%s; leaked "
          "rather than freed under the device",
          pending, wait ? StrFormat(" after %d ms", waitMs).c_str() : "");
      for (Retired& r : retired_) r.keep.reset();  // host memory: no device work reads it now
      retired_.clear();
      return;
    }
    struct timespec ts = {0, 500000};
    nanosleep(&ts, nullptr);
  }
  // Keep the largest kMaxIdle idle blocks: the next calls' sizes are the recent ones.
  size_t idle = 0;
  for (const Retired& r : retired_) idle += r.idle && r.b.d;
  while (idle > kMaxIdle) {
    auto smallest = retired_.end();
    for (auto it = retired_.begin(); it != retired_.end(); ++it)
      if (it->idle && it->b.d && (smallest == retired_.end() || it->b.bytes < smallest->b.bytes))
        smallest = it;
    FreeLocked(&*smallest);
    retired_.erase(smallest);
    --idle;
  }
}

void DevicePool::FreeBlock(const Block& b) {
  if (External())
    ext_.free(ext_.user, b.d, b.bytes, b.dev, b.s0);
  else
    rt_->DeviceFree(b.d);
}

bool DevicePool::ReturnNow(const Block& b, Stream s) {
  if (!External() || !b.d || s != b.s0 || !b.s0Known) return false;
  // The handle alone is not the stream: it may have been destroyed and reused for a new one.
  uint64_t id = 0;
  if (!rt_->StreamId(s, &id) || id != b.s0Id) return false;
  std::lock_guard<std::mutex> lk(mu_);
  FreeBlock(b);
  return true;
}

Status DevicePool::Acquire(size_t bytes, Stream s, Block* out, bool exact) {
  *out = Block();
  if (bytes == 0) return Status::Ok();
  std::lock_guard<std::mutex> lk(mu_);
  SweepLocked(false);
  if (External()) {
    // Nothing is kept here: the caller's allocator caches (and sees) the memory.
    const int dev = rt_->GetDevice();
    void* d = nullptr;
    const int rc = ext_.alloc(ext_.user, bytes, dev, s, &d);
    if (rc != 0 || d == nullptr)
      return SystemError(
          StrFormat("the caller's device allocator (scapeConfig_t.deviceAllocator) did not "
                    "allocate %zu bytes on device %d for stream %p (it returned %d%s)",
                    bytes, dev, s, rc, rc == 0 ? " and a NULL pointer" : ""));
    extAllocs_.fetch_add(1);
    out->d = d;
    out->bytes = bytes;
    out->s0 = s;
    out->dev = dev;
    out->s0Known = rt_->StreamId(s, &out->s0Id);
    return Status::Ok();
  }
  // The smallest that fits among the blocks last released on `s` (whatever their work's
  // state: the event wait below orders the reuse; the legacy default stream, NULL, is one
  // stream per device too), else among the idle ones. Trying `s` first keeps each stream on its own
  // blocks, so whether another stream's event has completed yet does not change the choice.
  auto best = retired_.end();
  for (int pass = 0; pass < 2 && best == retired_.end(); ++pass)
    for (auto it = retired_.begin(); it != retired_.end(); ++it) {
      const bool usable = it->b.d && !it->drop && (pass == 0 ? it->s == s : it->idle);
      if (usable && it->b.bytes >= bytes && (best == retired_.end() || it->b.bytes < best->b.bytes))
        best = it;
    }
  // A block from pass 0 may still be in use by the work released with it: the new work waits
  // for its event on the device (no host wait). Stream order alone is not enough: a stream
  // destroyed and a new one created at the same address are one key here but two streams.
  if (best != retired_.end() && !best->idle && best->ev && !rt_->StreamWaitEvent(s, best->ev).ok())
    best = retired_.end();  // no wait could be enqueued: a new block instead
  if (best != retired_.end()) {
    *out = best->b;
    best->b = Block();
    // A record still waiting for its event stays, holding what its work reads, until then.
    if (best->idle) retired_.erase(best);
    return Status::Ok();
  }
  // With a quarter to spare (unless exact), rounded to 256 bytes (the runtime's alignment is
  // larger anyway).
  size_t want = exact ? bytes : bytes + bytes / 4;
  want = (want + 255) & ~static_cast<size_t>(255);
  void* d = nullptr;
  SCAPE_RETURN_IF_ERROR(rt_->DeviceAlloc(want, &d));
  allocs_.fetch_add(1);
  out->d = d;
  out->bytes = want;
  return Status::Ok();
}

void DevicePool::Release(Block b, Stream s, std::shared_ptr<const void> keep) {
  if (ReturnNow(b, s)) b = Block();
  if (!b.d && !keep) return;
  Retired r;
  r.b = b;
  r.s = s;
  r.drop = External();  // the caller's allocator gets it back once the event has completed
  r.keep = std::move(keep);
  Status st = rt_->EventCreate(&r.ev);
  if (st.ok()) st = rt_->EventRecord(r.ev, s);
  if (!st.ok()) {
    if (r.ev) rt_->EventDestroy(r.ev);
    r.ev = nullptr;
    Status w = rt_->StreamSynchronize(s);
    if (!w.ok()) SCAPE_WARN("device pool: %s", w.message().c_str());
    r.keep.reset();  // the stream has run what read it
    r.idle = true;
  }
  std::lock_guard<std::mutex> lk(mu_);
  retired_.push_back(std::move(r));
}

void DevicePool::Sweep() {
  std::lock_guard<std::mutex> lk(mu_);
  SweepLocked(false);
}

Status DevicePool::TempAlloc(size_t bytes, Stream s, void** d) {
  Block b;
  SCAPE_RETURN_IF_ERROR(Acquire(bytes, s, &b));
  std::lock_guard<std::mutex> lk(mu_);
  temps_.push_back(b);
  *d = b.d;
  return Status::Ok();
}

void DevicePool::TempFree(void* d, Stream s) {
  Block b;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = std::find_if(temps_.begin(), temps_.end(), [d](const Block& t) { return t.d == d; });
    if (it == temps_.end()) {
      SCAPE_WARN("device pool: a temporary at %p that the pool did not hand out", d);
      return;
    }
    b = *it;
    temps_.erase(it);
  }
  Release(b, s);
}

void DevicePool::Drop(Block b, Stream s) {
  if (ReturnNow(b, s)) return;
  if (!b.d) return;
  Retired r;
  r.b = b;
  r.s = s;
  r.drop = true;
  Status st = rt_->EventCreate(&r.ev);
  if (st.ok()) st = rt_->EventRecord(r.ev, s);
  if (!st.ok()) {
    // No event: wait for the stream (a host wait), then free.
    if (r.ev) rt_->EventDestroy(r.ev);
    Status w = rt_->StreamSynchronize(s);
    if (!w.ok()) SCAPE_WARN("device pool: %s", w.message().c_str());
    std::lock_guard<std::mutex> lk(mu_);
    FreeBlock(b);
    return;
  }
  std::lock_guard<std::mutex> lk(mu_);
  retired_.push_back(std::move(r));
  SweepLocked(false);
}

}  // namespace device
}  // namespace scape
