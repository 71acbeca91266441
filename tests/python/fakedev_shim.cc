// A test-only shared library for the Python tests: the CPU fake device runtime of the C tests
// (tests/device/fake_device.h) installed into the shipped libnccl-net-scape.so through its
// internal test entry point scapeInternalTestingSetDeviceRuntime, plus the few C functions a
// Python stand-in for a CUDA array needs ("device" memory, streams, copies, a gate that holds
// a stream). Loaded with ctypes by tests/python/_fakedev.py; never shipped. Optionally points
// the fake libnccl's stream hook at the fake device's streams, so NCCL work runs in stream
// order as in the C tests.
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "tests/device/fake_device.h"

namespace {
std::string g_error;
using FakeNcclFn = void (*)(void*);
fake_device::FakeRuntime& Fake() { return fake_device::InstalledFake(); }
void EnqueueOnFake(void* stream, FakeNcclFn fn, void* arg) {
  Fake().Submit(stream, [fn, arg] { fn(arg); });
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* fakedev_error() { return g_error.c_str(); }

// Installs the fake into the library at `scapeLib` (already loaded by the caller: found with
// RTLD_NOLOAD, so the same copy); `ncclLib` non-NULL: the fake libnccl whose work goes on the
// fake streams. 0 on success, else -1 (fakedev_error says why).
__attribute__((visibility("default"))) int fakedev_install(const char* scapeLib,
                                                           const char* ncclLib) {
  void* h = dlopen(scapeLib, RTLD_NOW | RTLD_NOLOAD);
  if (!h) {
    g_error = std::string("not loaded: ") + scapeLib;
    return -1;
  }
  auto set = reinterpret_cast<void* (*)(void*)>(dlsym(h, "scapeInternalTestingSetDeviceRuntime"));
  if (!set) {
    g_error = "the library has no scapeInternalTestingSetDeviceRuntime";
    return -1;
  }
  set(static_cast<scape::device::Runtime*>(&Fake()));
  if (ncclLib && *ncclLib) {
    void* n = dlopen(ncclLib, RTLD_NOW | RTLD_LOCAL);
    auto hook = n ? reinterpret_cast<void (*)(void (*)(void*, FakeNcclFn, void*))>(
                        dlsym(n, "fakeNcclSetEnqueue"))
                  : nullptr;
    if (!hook) {
      g_error = std::string("cannot use the fake NCCL ") + ncclLib;
      return -1;
    }
    hook(EnqueueOnFake);
  }
  return 0;
}

__attribute__((visibility("default"))) void* fakedev_alloc(size_t bytes) {
  return Fake().DeviceMalloc(bytes);
}
__attribute__((visibility("default"))) void fakedev_free(void* p) { Fake().DeviceFree(p); }
__attribute__((visibility("default"))) void* fakedev_new_stream() { return Fake().NewStream(); }
__attribute__((visibility("default"))) int fakedev_is_device(const void* p) {
  return Fake().Kind(p) != scape::device::PtrKind::kHost ? 1 : 0;
}
// Waits for the stream (NULL: the default one); 0, or -1 with its error.
__attribute__((visibility("default"))) int fakedev_sync(void* stream) {
  scape::Status st = Fake().StreamSynchronize(stream);
  if (st.ok()) return 0;
  g_error = st.message();
  return -1;
}
// A copy in either direction on the default stream, waited for.
__attribute__((visibility("default"))) int fakedev_copy(void* dst, const void* src, size_t bytes) {
  scape::Status st = Fake().CopyAsync(dst, src, bytes, nullptr);
  if (st.ok()) st = Fake().StreamSynchronize(nullptr);
  if (st.ok()) return 0;
  g_error = st.message();
  return -1;
}
// Holds `stream` at this point until fakedev_open(gate).
__attribute__((visibility("default"))) void* fakedev_hold(void* stream) {
  auto* g = new fake_device::Gate();
  Fake().HoldStream(stream, g);
  return g;
}
__attribute__((visibility("default"))) void fakedev_open(void* gate) {
  static_cast<fake_device::Gate*>(gate)->Open();  // leaked: the stream may still reference it
}
__attribute__((visibility("default"))) uint64_t fakedev_counter(const char* name) {
  auto& f = Fake();
  if (!std::strcmp(name, "h2d")) return f.h2dCopies.load();
  if (!std::strcmp(name, "d2h")) return f.d2hCopies.load();
  if (!std::strcmp(name, "kernels")) return f.kernelLaunches.load();
  if (!std::strcmp(name, "gathers")) return f.gathers.load();
  if (!std::strcmp(name, "scatters")) return f.scatters.load();
  if (!std::strcmp(name, "hostFuncs")) return f.hostFuncs.load();
  if (!std::strcmp(name, "syncs")) return f.syncs.load();
  if (!std::strcmp(name, "deviceAllocs")) return f.deviceAllocs.load();
  if (!std::strcmp(name, "tempAllocs")) return f.tempAllocs.load();
  return ~uint64_t{0};
}

}  // extern "C"
