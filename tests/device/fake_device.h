// A CPU fake of the device runtime (plugin/device/runtime.h) for tests without a GPU:
// "device memory" is host memory that the fake hands out and recognises by address; every
// stream is a thread that runs its queue in order (copies are memcpy, optionally slowed down,
// host functions run on the stream's thread and hold it while they run), events complete
// when the stream reaches them. So the library's staging pipeline and its stream ordering
// run for real; only the bytes never leave host memory.
#ifndef SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_
#define SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/device/runtime.h"

namespace fake_device {

class FakeStream {
 public:
  FakeStream();
  ~FakeStream();  // runs what is queued, then stops
  void Push(std::function<void()> fn);
  // Waits until everything queued so far has run (false after timeoutMs).
  bool Sync(int timeoutMs = 30000);

 private:
  void Main();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t pushed_ = 0, ran_ = 0;
  bool stop_ = false;
  std::thread th_;
};

// A gate: a host function queued on a stream that holds the stream until Open().
class Gate {
 public:
  void Open();
  void Wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

class FakeRuntime final : public scape::device::Runtime {
 public:
  FakeRuntime();
  ~FakeRuntime() override;
  const char* Name() const override { return "fake"; }
  bool Available() override { return true; }
  scape::device::PtrKind Kind(const void* p) override;
  scape::Status HostAlloc(size_t bytes, void** p) override;
  void HostFree(void* p) override;
  scape::Status CopyAsync(void* dst, const void* src, size_t bytes,
                          scape::device::Stream s) override;
  scape::Status EventCreate(scape::device::Event* e) override;
  void EventDestroy(scape::device::Event e) override;
  scape::Status EventRecord(scape::device::Event e, scape::device::Stream s) override;
  scape::Status EventQuery(scape::device::Event e, bool* done) override;
  scape::Status LaunchHostFunc(scape::device::Stream s, scape::device::HostFn fn,
                               void* arg) override;
  scape::Status StreamSynchronize(scape::device::Stream s) override;

  // "Device" memory (zero-filled) and its release.
  void* DeviceMalloc(size_t bytes);
  void DeviceFree(void* p);
  // A new stream (owned by the runtime); NULL is the default stream.
  scape::device::Stream NewStream();
  FakeStream* StreamOf(scape::device::Stream s);
  // Queues a gate on stream s: the stream holds there until gate->Open().
  void HoldStream(scape::device::Stream s, Gate* gate);

  // What the library did.
  std::atomic<uint64_t> d2hCopies{0}, h2dCopies{0}, otherCopies{0}, copiedBytes{0};
  std::atomic<uint64_t> hostFuncs{0}, pinnedAllocs{0}, pinnedLive{0}, syncs{0};
  // Slows every copy down by this many microseconds (to make overlap and ordering visible).
  std::atomic<int> copyDelayUs{0};

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> device_;  // base -> bytes
  std::vector<std::unique_ptr<FakeStream>> streams_;
  std::unique_ptr<FakeStream> default_;
};

}  // namespace fake_device

#endif  // SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_
