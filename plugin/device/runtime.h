// The device runtime seen by the device dispatch layer: pointer kinds, pinned host memory,
// stream-ordered copies, events and host functions on a stream. Three implementations:
//   - the CUDA runtime (runtime_cuda.cc, builds with CUDA; cudart is linked statically and
//     loads libcuda at run time, so a machine with no driver gets "no device", not a failed
//     load);
//   - "none" (runtime_none.cc, every build): every pointer is host memory and no stream exists;
//   - a CPU fake (tests/device/fake_device.h): memcpy on per-stream worker threads, so the
//     staging pipeline and the stream-ordering bookkeeping run, and are tested, without a GPU.
// No CUDA header is needed to use this interface: streams and events are opaque pointers.
#ifndef SCAPE_PLUGIN_DEVICE_RUNTIME_H_
#define SCAPE_PLUGIN_DEVICE_RUNTIME_H_

#include <cstddef>

#include "base/status.h"

namespace scape {
namespace device {

enum class PtrKind {
  kHost,     // pageable or page-locked host memory (cudaMemoryTypeHost / Unregistered)
  kDevice,   // device memory (cudaMemoryTypeDevice)
  kManaged,  // managed memory: treated as device memory (staged, stream-ordered)
};
const char* PtrKindName(PtrKind k);

using Stream = void*;  // a cudaStream_t (NULL: the default stream)
using Event = void*;   // a cudaEvent_t
using HostFn = void (*)(void* arg);

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual const char* Name() const = 0;
  // True when device memory can exist (a driver and at least one device).
  virtual bool Available() = 0;
  // Where `p` lives. Never fails: anything the runtime does not know is host memory.
  virtual PtrKind Kind(const void* p) = 0;

  // Page-locked host memory for staging (cudaHostAlloc).
  virtual Status HostAlloc(size_t bytes, void** p) = 0;
  virtual void HostFree(void* p) = 0;
  // Stream-ordered copy; the direction follows from the pointers (cudaMemcpyDefault).
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, Stream s) = 0;
  // Events: recorded on a stream, queried from any thread.
  virtual Status EventCreate(Event* e) = 0;
  virtual void EventDestroy(Event e) = 0;
  virtual Status EventRecord(Event e, Stream s) = 0;
  // *done = the work before the record has finished. An error is a failed stream.
  virtual Status EventQuery(Event e, bool* done) = 0;
  // Runs fn(arg) on a runtime thread once the stream reaches it; the stream waits for fn to
  // return (cudaLaunchHostFunc). fn must not call the runtime.
  virtual Status LaunchHostFunc(Stream s, HostFn fn, void* arg) = 0;
  virtual Status StreamSynchronize(Stream s) = 0;
  // The calling thread's current device, and setting it on another thread (the staging
  // worker queries events of the device the call was made on).
  virtual int GetDevice() { return 0; }
  virtual void SetDevice(int) {}
};

// The process's runtime: the CUDA runtime in CUDA builds, else "none".
Runtime* GetRuntime();
// Tests: replaces the runtime (nullptr restores the default). Returns the previous one. Only
// while no device operation is in flight.
Runtime* SetRuntimeForTesting(Runtime* rt);

// The built-in runtimes (used by GetRuntime; exposed for tests).
Runtime* NoneRuntime();
Runtime* CudaRuntime();  // nullptr in builds without CUDA

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_RUNTIME_H_
