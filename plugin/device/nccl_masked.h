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
// stream work that uses them has finished (an event recorded after each call).
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
    std::shared_ptr<const std::vector<uint64_t>> host;  // an upload's source, kept alive
  };
  struct Positions {
    std::shared_ptr<const std::vector<uint64_t>> gen;  // the mask generation uploaded
    Buf buf;
  };
  // Frees the retired buffers whose work has finished (or every one, waiting up to the
  // deadline, when `all`).
  void Sweep(Runtime* rt, bool all);
  void Retire(Buf b) { retired_.push_back(std::move(b)); }
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
