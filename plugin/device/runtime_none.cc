// The runtime of a build (or a machine) without CUDA: every pointer is host memory, and a
// stream cannot exist, so anything stream-ordered is scapeUnsupported.
#include <atomic>
#include <cstdlib>

#include "plugin/device/runtime.h"
#include "scape_config.h"

namespace scape {
namespace device {

const char* PtrKindName(PtrKind k) {
  switch (k) {
    case PtrKind::kHost:
      return "host memory";
    case PtrKind::kDevice:
      return "device memory";
    case PtrKind::kManaged:
      return "managed memory";
  }
  return "unknown memory";
}

namespace {

Status NoStream() {
  return Unsupported(
      "this build has no CUDA device support (or no CUDA driver was found), so "
      "a non-NULL stream cannot be used: pass stream = NULL with host buffers");
}

class None final : public Runtime {
 public:
  const char* Name() const override { return "none"; }
  bool Available() override { return false; }
  PtrKind Kind(const void*) override { return PtrKind::kHost; }
  Status HostAlloc(size_t bytes, void** p) override {
    *p = std::malloc(bytes ? bytes : 1);
    return *p ? Status::Ok() : SystemError("out of host memory for staging buffers");
  }
  void HostFree(void* p) override { std::free(p); }
  Status CopyAsync(void*, const void*, size_t, Stream) override { return NoStream(); }
  Status EventCreate(Event*) override { return NoStream(); }
  void EventDestroy(Event) override {}
  Status EventRecord(Event, Stream) override { return NoStream(); }
  Status EventQuery(Event, bool*) override { return NoStream(); }
  Status LaunchHostFunc(Stream, HostFn, void*) override { return NoStream(); }
  Status StreamSynchronize(Stream) override { return NoStream(); }
};

std::atomic<Runtime*> g_override{nullptr};

}  // namespace

Runtime* NoneRuntime() {
  static None none;
  return &none;
}

Runtime* GetRuntime() {
  if (Runtime* r = g_override.load(std::memory_order_acquire)) return r;
  static Runtime* def = [] {
    Runtime* c = CudaRuntime();
    return c && c->Available() ? c : NoneRuntime();
  }();
  return def;
}

Runtime* SetRuntimeForTesting(Runtime* rt) { return g_override.exchange(rt); }

#if !SCAPE_HAVE_CUDA
Runtime* CudaRuntime() { return nullptr; }
#endif

}  // namespace device
}  // namespace scape
