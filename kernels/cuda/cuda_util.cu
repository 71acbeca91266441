// Runtime helpers declared in kernels/cuda/scape_kernels.cuh.
#include <cuda_runtime.h>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return 0;
  }
  return n;
}

const char* DeviceName() {
  static thread_local cudaDeviceProp prop;
  int dev = 0;
  if (DeviceCount() == 0 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    return "";
  }
  return prop.name;
}

KernelStatus DeviceMalloc(void** d_ptr, size_t bytes) {
  if (d_ptr == nullptr) return KernelStatus::kInvalidArgument;
  if (cudaMalloc(d_ptr, bytes == 0 ? 1 : bytes) != cudaSuccess) {
    *d_ptr = nullptr;
    return KernelStatus::kCudaError;
  }
  return KernelStatus::kOk;
}

KernelStatus DeviceFree(void* d_ptr) {
  SCAPE_CUDA_CALL(cudaFree(d_ptr));
  return KernelStatus::kOk;
}

KernelStatus CopyToDevice(void* d_dst, const void* src, size_t bytes) {
  if (bytes == 0) return KernelStatus::kOk;
  SCAPE_CUDA_CALL(cudaMemcpy(d_dst, src, bytes, cudaMemcpyHostToDevice));
  return KernelStatus::kOk;
}

KernelStatus CopyToHost(void* dst, const void* d_src, size_t bytes) {
  if (bytes == 0) return KernelStatus::kOk;
  SCAPE_CUDA_CALL(cudaMemcpy(dst, d_src, bytes, cudaMemcpyDeviceToHost));
  return KernelStatus::kOk;
}

KernelStatus CopyDeviceToDevice(void* d_dst, const void* d_src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return KernelStatus::kOk;
  SCAPE_CUDA_CALL(cudaMemcpyAsync(d_dst, d_src, bytes, cudaMemcpyDeviceToDevice, stream));
  return KernelStatus::kOk;
}

KernelStatus DeviceMemset(void* d_ptr, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return KernelStatus::kOk;
  SCAPE_CUDA_CALL(cudaMemsetAsync(d_ptr, value, bytes, stream));
  return KernelStatus::kOk;
}

KernelStatus StreamSynchronize(cudaStream_t stream) {
  SCAPE_CUDA_CALL(cudaStreamSynchronize(stream));
  return KernelStatus::kOk;
}

KernelStatus EventCreate(void** event) {
  if (event == nullptr) return KernelStatus::kInvalidArgument;
  cudaEvent_t e;
  SCAPE_CUDA_CALL(cudaEventCreate(&e));
  *event = e;
  return KernelStatus::kOk;
}

KernelStatus EventRecord(void* event, cudaStream_t stream) {
  SCAPE_CUDA_CALL(cudaEventRecord(static_cast<cudaEvent_t>(event), stream));
  return KernelStatus::kOk;
}

KernelStatus EventElapsedMs(void* start, void* stop, float* ms) {
  if (ms == nullptr) return KernelStatus::kInvalidArgument;
  SCAPE_CUDA_CALL(cudaEventSynchronize(static_cast<cudaEvent_t>(stop)));
  SCAPE_CUDA_CALL(
      cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)));
  return KernelStatus::kOk;
}

KernelStatus EventDestroy(void* event) {
  SCAPE_CUDA_CALL(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return KernelStatus::kOk;
}

namespace {
__global__ void WaitHostFlagKernel(const volatile uint32_t* flag, uint32_t value) {
  while (static_cast<int32_t>(*flag - value) < 0) __nanosleep(1000);
}
}  // namespace

KernelStatus WaitHostFlagCuda(const uint32_t* h_flag, uint32_t value, cudaStream_t stream) {
  if (h_flag == nullptr) return KernelStatus::kInvalidArgument;
  void* d_flag = nullptr;  // the device's address of the mapped word (the same under UVA)
  SCAPE_CUDA_CALL(cudaHostGetDevicePointer(&d_flag, const_cast<uint32_t*>(h_flag), 0));
  WaitHostFlagKernel<<<1, 1, 0, stream>>>(static_cast<const volatile uint32_t*>(d_flag), value);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

const char* LastCudaError() { return cudaGetErrorString(cudaGetLastError()); }

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
