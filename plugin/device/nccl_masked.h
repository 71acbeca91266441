// The masked (dense-in/out) all-reduce on the NCCL backend: scapeAllReduce with a mask on
// device buffers of a scapeCommInitNccl communicator. On the caller's stream: the mask's
// current positions are gathered from sendbuf into a packed device buffer, ncclAllReduce
// reduces the k packed values in place, and they are scattered into recvbuf (positions
// outside the mask are left as they are), as the host masked all-reduce does. A full mask
// with shard ownership (mask order = buffer order) all-reduces the dense buffers directly.
//
// The positions go to the device once per mask generation: uploaded on the caller's stream
// from the mask's own host copy (a shared reference to it is held until the upload has run),
// and kept for the later calls of that generation. Device buffers are freed only once the
// stream work that uses them has finished (an event recorded after each call). Retired buffers
// are kept for reuse rather than freed (cudaFree synchronises the whole device, which would stall
// every stream once a step): a buffer whose work has finished serves any later call, and a
// packed-values buffer serves the next call on the same stream at once (stream order makes it
// safe). At most kMaxIdle finished buffers are kept; the rest are freed.
#ifndef SCAPE_PLUGIN_DEVICE_NCCL_MASKED_H_
#define SCAPE_PLUGIN_DEVICE_NCCL_MASKED_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "plugin/coll/coll.h"
#include "plugin/device/nccl_backend.h"
#include "plugin/device/runtime.h"
#include "plugin/mask/mask.h"

namespace scape {
namespace device {

class NcclMaskCache {
 public:
  // timeoutMs bounds the wait for in-flight work at destruction.
  explicit NcclMaskCache(int timeoutMs) : timeoutMs_(timeoutMs) {}
  // Waits (up to the timeout) for the calls in flight, then frees their device buffers;
  // buffers still in use after that are leaked, not freed under the device.
  ~NcclMaskCache();

  // The masked all-reduce (a: all-reduce, count = m.n(), send/recv device memory, validated by
  // the caller) on `stream`.
  Status AllReduce(NcclBackend& b, const Mask& m, const coll::CollArgs& a, Stream stream);

  // scapeCommAbort: the destructor then frees only what has finished, at once, and leaks the
  // rest instead of waiting for it.
  void Abandon() { abandoned_.store(true); }

  // Device buffers held (positions and packed temps, live or waiting to be freed): for tests.
  size_t BuffersHeld();

 private:
  struct Buf {
    void* d = nullptr;
    size_t bytes = 0;
    Event done = nullptr;                               // recorded after the last work that uses d
    Stream stream = nullptr;                            // where that work was queued
    bool idle = false;                                  // retired and its work finished
    std::shared_ptr<const std::vector<uint64_t>> host;  // an upload's source, kept alive
  };
  static constexpr size_t kMaxIdle = 4;
  struct Positions {
    std::shared_ptr<const std::vector<uint64_t>> gen;  // the mask generation uploaded
    Buf buf;
  };
  // Marks the retired buffers whose work has finished idle (dropping their upload sources) and
  // frees the idle ones beyond kMaxIdle, smallest first. With `freeDone` (teardown) it frees
  // every finished one instead, and with `wait` also waits, up to the deadline, for the rest.
  void Sweep(Runtime* rt, bool wait, bool freeDone);
  void Retire(Buf b) { retired_.push_back(std::move(b)); }
  // A buffer of at least `bytes` for work on `s`: a retired one that is idle, or (when
  // `sameStreamOk`) a retired packed-values buffer last used on `s`; else a new allocation.
  Status Take(Runtime* rt, size_t bytes, Stream s, bool sameStreamOk, Buf* out);
  Status Mark(Runtime* rt, Buf* b, Stream s);

  const int timeoutMs_;
  std::atomic<bool> abandoned_{false};
  std::mutex mu_;
  std::map<const Mask*, Positions> pos_;
  std::vector<Buf> retired_;
};

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_NCCL_MASKED_H_
