// The CUDA runtime behind plugin/device/runtime.h. The runtime library is linked statically
// (CUDA::cudart_static), which opens libcuda.so.1 only when first used: on a machine without a
// driver, cudaGetDeviceCount fails, Available() is false and the library runs its host paths.
#include <cuda_runtime_api.h>

#include <mutex>

#include "plugin/device/runtime.h"

namespace scape {
namespace device {
namespace {

Status CudaFail(const char* what, cudaError_t e) {
  return SystemError(
      StrFormat("%s failed: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

class Cuda final : public Runtime {
 public:
  const char* Name() const override { return "cuda"; }
  bool Available() override {
    std::call_once(once_, [this] {
      int n = 0;
      cudaError_t e = cudaGetDeviceCount(&n);
      if (e != cudaSuccess) cudaGetLastError();  // clear it: no driver is not an error here
      available_ = e == cudaSuccess && n > 0;
    });
    return available_;
  }
  PtrKind Kind(const void* p) override {
    if (!p || !Available()) return PtrKind::kHost;
    cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
      cudaGetLastError();  // an unknown host pointer on old runtimes
      return PtrKind::kHost;
    }
    switch (a.type) {
      case cudaMemoryTypeDevice:
        return PtrKind::kDevice;
      case cudaMemoryTypeManaged:
        return PtrKind::kManaged;
      default:
        return PtrKind::kHost;
    }
  }
  Status HostAlloc(size_t bytes, void** p) override {
    cudaError_t e = cudaHostAlloc(p, bytes ? bytes : 1, cudaHostAllocPortable);
    return e == cudaSuccess ? Status::Ok() : CudaFail("cudaHostAlloc (staging buffer)", e);
  }
  void HostFree(void* p) override { cudaFreeHost(p); }
  Status CopyAsync(void* dst, const void* src, size_t bytes, Stream s) override {
    if (bytes == 0) return Status::Ok();
    cudaError_t e =
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s));
    return e == cudaSuccess ? Status::Ok() : CudaFail("cudaMemcpyAsync", e);
  }
  Status EventCreate(Event* ev) override {
    cudaEvent_t e;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) return CudaFail("cudaEventCreate", r);
    *ev = e;
    return Status::Ok();
  }
  void EventDestroy(Event e) override { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }
  Status EventRecord(Event e, Stream s) override {
    cudaError_t r = cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s));
    return r == cudaSuccess ? Status::Ok() : CudaFail("cudaEventRecord", r);
  }
  Status EventQuery(Event e, bool* done) override {
    cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (r == cudaErrorNotReady) {
      *done = false;
      return Status::Ok();
    }
    if (r != cudaSuccess) return CudaFail("cudaEventQuery (a copy into a staging buffer)", r);
    *done = true;
    return Status::Ok();
  }
  Status LaunchHostFunc(Stream s, HostFn fn, void* arg) override {
    cudaError_t r = cudaLaunchHostFunc(static_cast<cudaStream_t>(s), fn, arg);
    return r == cudaSuccess ? Status::Ok() : CudaFail("cudaLaunchHostFunc", r);
  }
  int GetDevice() override {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return d;
  }
  void SetDevice(int d) override {
    if (cudaSetDevice(d) != cudaSuccess) cudaGetLastError();
  }
  Status StreamSynchronize(Stream s) override {
    cudaError_t r = cudaStreamSynchronize(static_cast<cudaStream_t>(s));
    return r == cudaSuccess ? Status::Ok() : CudaFail("cudaStreamSynchronize", r);
  }

 private:
  std::once_flag once_;
  bool available_ = false;
};

}  // namespace

Runtime* CudaRuntime() {
  static Cuda cuda;
  return &cuda;
}

}  // namespace device
}  // namespace scape
