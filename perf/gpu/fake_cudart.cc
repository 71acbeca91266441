// The dry run's CUDA runtime (perf/gpu/run.sh --dry-run): the subset of the CUDA runtime API
// that the GPU check programs (perf/gpu/gpu_*_check.cc) call, implemented on the CPU fake
// device of the C tests (tests/device/fake_device.h), which this library also installs into
// the shipped libnccl-net-scape.so (scapeInternalTestingSetDeviceRuntime) when it loads. So the
// same check sources, compiled against the real <cuda_runtime.h> and linked against this
// library instead of libcudart, run on a machine without a GPU: "device" memory is the fake's,
// streams are its threads, the library's device paths run its CPU kernels. With the fake
// libnccl (tests/device/fake_libnccl.cc) linked too, NCCL's work goes on the fake streams.
//
// Not shipped; not a CUDA emulator: no kernels of the caller's own, no events, no graphs. An
// entry point the programs do not use is absent (the link fails, which is the point: a check
// that starts using one must be run against the fake before a GPU is spent on it).
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "tests/device/fake_device.h"

namespace {

fake_device::FakeRuntime& Fake() { return fake_device::InstalledFake(); }

thread_local std::string t_error;
std::mutex g_mu;
std::set<void*> g_streams;  // the streams made here (cudaDeviceSynchronize waits for each)

cudaError_t Fail(const scape::Status& st, cudaError_t code = cudaErrorUnknown) {
  t_error = "fake CUDA: " + st.message();
  return code;
}
cudaError_t Of(const scape::Status& st) { return st.ok() ? cudaSuccess : Fail(st); }

using FakeNcclFn = void (*)(void*);
void EnqueueOnFake(void* stream, FakeNcclFn fn, void* arg) {
  Fake().Submit(stream, [fn, arg] { fn(arg); });
}

// At load (after the library, which this one needs): the fake becomes the library's device
// runtime, and the fake libnccl, if loaded, queues its work on the fake streams.
__attribute__((constructor)) void Install() {
  auto set = reinterpret_cast<void* (*)(void*)>(
      dlsym(RTLD_DEFAULT, "scapeInternalTestingSetDeviceRuntime"));
  if (!set) {
    std::fprintf(stderr,
                 "fake CUDA: libnccl-net-scape.so has no "
                 "scapeInternalTestingSetDeviceRuntime\n");
    std::abort();
  }
  set(static_cast<scape::device::Runtime*>(&Fake()));
  auto hook = reinterpret_cast<void (*)(void (*)(void*, FakeNcclFn, void*))>(
      dlsym(RTLD_DEFAULT, "fakeNcclSetEnqueue"));
  if (hook) hook(EnqueueOnFake);
}

}  // namespace

// The programs link against these: exported whatever the build's default visibility.
#pragma GCC visibility push(default)
extern "C" {

const char* CUDARTAPI cudaGetErrorString(cudaError_t e) {
  if (e == cudaSuccess) return "no error";
  if (e == cudaErrorNotReady) return "device not ready";
  return t_error.empty() ? "fake CUDA: error" : t_error.c_str();
}
cudaError_t CUDARTAPI cudaGetLastError() { return cudaSuccess; }
cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (device < 0 || device >= fake_device::FakeRuntime::kDevices) {
    t_error = "fake CUDA: no device " + std::to_string(device);
    return cudaErrorInvalidDevice;
  }
  Fake().SetDevice(device);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMalloc(void** p, size_t bytes) {
  return Of(Fake().DeviceAlloc(bytes ? bytes : 1, p));
}
cudaError_t CUDARTAPI cudaFree(void* p) {
  if (p) Fake().DeviceFree(p);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  return Of(Fake().HostAlloc(bytes, p));
}
cudaError_t CUDARTAPI cudaMallocHost(void** p, size_t bytes) {
  return Of(Fake().HostAlloc(bytes, p));
}
cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  Fake().HostFree(p);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                      cudaStream_t s) {
  return Of(Fake().CopyAsync(dst, src, bytes, s));
}
cudaError_t CUDARTAPI cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  scape::Status st = Fake().CopyAsync(dst, src, bytes, nullptr);
  if (st.ok()) st = Fake().StreamSynchronize(nullptr);
  return Of(st);
}
cudaError_t CUDARTAPI cudaMemsetAsync(void* d, int value, size_t bytes, cudaStream_t s) {
  return Of(Fake().Memset(d, value, bytes, s));
}
cudaError_t CUDARTAPI cudaMemset(void* d, int value, size_t bytes) {
  return Of(Fake().Memset(d, value, bytes, nullptr));  // asynchronous, as CUDA's
}
cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  void* h = Fake().NewStream((flags & cudaStreamNonBlocking) == 0);
  std::lock_guard<std::mutex> lk(g_mu);
  g_streams.insert(h);
  *s = static_cast<cudaStream_t>(h);
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t s) {
  // The fake owns its streams (NewStream); this one is drained and left to it.
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_streams.erase(s);
  }
  return Of(Fake().StreamSynchronize(s));
}
cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t s) {
  return Of(Fake().StreamSynchronize(s));
}
cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t s) {
  bool done = false;
  scape::Status st = Fake().StreamQuery(s, &done);
  if (!st.ok()) return Fail(st);
  return done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t CUDARTAPI cudaDeviceSynchronize() {
  std::set<void*> all;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    all = g_streams;
  }
  scape::Status st = Fake().StreamSynchronize(nullptr);
  for (void* s : all)
    if (st.ok()) st = Fake().StreamSynchronize(s);
  return Of(st);
}
// Device memory: 80 GiB, of which what the fake holds (cudaMalloc'd and the library's) is used.
cudaError_t CUDARTAPI cudaMemGetInfo(size_t* freeBytes, size_t* totalBytes) {
  const size_t total = size_t{80} << 30, live = Fake().LiveBytes();
  *totalBytes = total;
  *freeBytes = live < total ? total - live : 0;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* arg) {
  return Of(Fake().LaunchHostFunc(s, fn, arg));
}

// The fake libnccl's work queue when it is loaded after this library (the library dlopens NCCL
// at scapeCommInitNcclRank / FromEnv, RTLD_LOCAL, and a program that calls no NCCL entry point
// has no fake_libnccl in its NEEDED): it looks this up at its load (fake_libnccl.cc), since
// Install above found no fakeNcclSetEnqueue then. Without it the fake ran each collective at the
// call, ahead of the copies and kernels queued before it on the stream.
void fakeCudartNcclEnqueue(void* stream, void (*fn)(void*), void* arg) {
  EnqueueOnFake(stream, fn, arg);
}

}  // extern "C"
#pragma GCC visibility pop
