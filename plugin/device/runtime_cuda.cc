// The CUDA runtime behind plugin/device/runtime.h. The runtime library is linked statically
// (CUDA::cudart_static), which opens libcuda.so.1 only when first used: on a machine without a
// driver, cudaGetDeviceCount fails, Available() is false and the library runs its host paths.
//
// The device ops (DeviceAlloc ... RecoveredGradSqNorm) launch the kernels of kernels/cuda/
// (scape_kernels.cuh). What the host can check (element sizes, payload types, k > n, null or
// misaligned pointers, AdamS parameters, the top-k segment table, which is host memory here)
// is checked before anything is enqueued and returned with the op's name; errors on the device
// surface as CUDA's sticky errors at the next EventQuery / StreamSynchronize.
#include <cuda_runtime_api.h>
#include <time.h>

#include <cstring>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/log.h"
#include "kernels/cpu/topk_common.h"
#include "kernels/cuda/finite.cuh"
#include "kernels/cuda/scaled.cuh"
#include "kernels/cuda/scape_kernels.cuh"
#include "kernels/dtypes.h"
#include "plugin/device/runtime.h"

namespace scape {
namespace device {
namespace {

Status CudaFail(const char* what, cudaError_t e) {
  return SystemError(
      StrFormat("%s failed: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// The status of a CUDA call `what` that returned e.
Status CudaCheck(const char* what, cudaError_t e) {
  return e == cudaSuccess ? Status::Ok() : CudaFail(what, e);
}

// An event or stream query `what` that returned r: *done is false while the work is pending
// (cudaErrorNotReady), true once it has completed; any other error is the query's failure, and
// *done is left alone.
Status QueryDone(const char* what, cudaError_t r, bool* done) {
  if (r == cudaErrorNotReady) {
    *done = false;
    return Status::Ok();
  }
  if (r != cudaSuccess) return CudaFail(what, r);
  *done = true;
  return Status::Ok();
}

namespace kn = kernels;
namespace kc = kernels::cuda;

// A kernel wrapper's status for `op`: its argument errors (which the checks below should have
// caught with a better message) or the CUDA error of the launch.
Status KernelFail(const char* op, kn::KernelStatus k) {
  if (k == kn::KernelStatus::kOk) return Status::Ok();
  std::string msg = StrFormat("%s: %s", op, kn::KernelStatusString(k));
  if (k == kn::KernelStatus::kCudaError) {
    // The wrapper's launch check has read (and cleared) the error; a sticky one is still here.
    const cudaError_t e = cudaPeekAtLastError();
    if (e != cudaSuccess) msg += StrFormat(" (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return Status(kn::ToResult(k), msg);
}

Status CheckAligned(const char* op, const char* arg, const void* p, size_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align == 0) return Status::Ok();
  return InvalidArgument(StrFormat("%s: %s (%p) is not aligned to %zu bytes", op, arg, p, align));
}

Status CheckNonNull(const char* op, const char* arg, const void* p) {
  if (p) return Status::Ok();
  return InvalidArgument(StrFormat("%s: %s is null", op, arg));
}

// The pointer arguments of one check, in the order they are checked: the first that fails is
// reported, with CheckNonNull's / CheckAligned's message. PTR_ARG(p) and ALIGNED_ARG(p, bytes) name
// an argument by its variable's name.
#define PTR_ARG(p) \
  Arg { #p, p }
#define ALIGNED_ARG(p, bytes) \
  AlignedArg { #p, p, bytes }
struct Arg {
  const char* name;
  const void* p;
};
Status CheckAllNonNull(const char* op, std::initializer_list<Arg> args) {
  for (const Arg& a : args) SCAPE_RETURN_IF_ERROR(CheckNonNull(op, a.name, a.p));
  return Status::Ok();
}
struct AlignedArg {
  const char* name;
  const void* p;
  size_t align;
};
Status CheckAllAligned(const char* op, std::initializer_list<AlignedArg> args) {
  for (const AlignedArg& a : args) SCAPE_RETURN_IF_ERROR(CheckAligned(op, a.name, a.p, a.align));
  return Status::Ok();
}

// The mask and the payload of a masked kernel: both non-null when k > 0, dMask 8-byte aligned,
// then the op's `other` aligned arguments, then dPayload aligned to its element type.
Status CheckMaskAndPayload(const char* op, size_t k, const uint64_t* dMask, const void* dPayload,
                           scapeDataType_t payloadType,
                           std::initializer_list<AlignedArg> other = {}) {
  if (k > 0) {
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dMask), PTR_ARG(dPayload)}));
  }
  SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dMask", dMask, 8));
  SCAPE_RETURN_IF_ERROR(CheckAllAligned(op, other));
  return CheckAligned(op, "dPayload", dPayload, kn::PayloadElementSize(payloadType));
}

Status CheckBeta1(const char* op, float beta1) {
  if (beta1 >= 0.0f && beta1 < 1.0f) return Status::Ok();
  return InvalidArgument(StrFormat("%s: beta1 = %g is not in [0, 1)", op, beta1));
}

// The candidate's gradient scale (the local clipping's factor).
Status CheckGradScale(const char* op, float gradScale) {
  if (gradScale > 0.0f && gradScale <= 1.0f) return Status::Ok();
  return InvalidArgument(StrFormat("%s: gradScale = %g is not in (0, 1]", op, gradScale));
}

// The 16-bit model copy's element type.
Status CheckCopyType(const char* op, scapeDataType_t copyType) {
  if (copyType == scapeBfloat16 || copyType == scapeFloat16) return Status::Ok();
  return Status(scapeUnsupported,
                StrFormat("%s: copyType = %d: expected scapeBfloat16 or scapeFloat16", op,
                          static_cast<int>(copyType)));
}

// A scaled (8-bit) payload type and its device amax word.
Status CheckScaled(const char* op, scapeDataType_t type, const float* dAmax) {
  if (!dtypes::IsScaled(type))
    return InvalidArgument(
        StrFormat("%s: type %s is not a scaled payload type", op, dtypes::Name(type)));
  return CheckNonNull(op, "dAmax", dAmax);
}

Status CheckPayloadType(const char* op, scapeDataType_t t) {
  if (kn::PayloadElementSize(t)) return Status::Ok();
  return Unsupported(
      StrFormat("%s: payloadType %d is not scapeFloat32, scapeBfloat16 or scapeFloat16", op,
                static_cast<int>(t)));
}

Status CheckKn(const char* op, size_t k, size_t n) {
  if (k <= n) return Status::Ok();
  return InvalidArgument(StrFormat("%s: k = %zu entries in the mask > n = %zu", op, k, n));
}

// The host-side checks of a top-k segment table: the CPU kernel's argument errors, which the
// CUDA kernel cannot report from a device table (it would select nothing instead).
Status CheckTopkTable(const kn::TopkSegments& sg, const kn::TopkOptions& o) {
  const char* op = "top-k kernel";
  if (o.mode != kn::TopkMode::kExact && o.mode != kn::TopkMode::kSampled) {
    return InvalidArgument(
        StrFormat("%s: options.mode = %d is neither exact nor sampled", op, int(o.mode)));
  }
  if (o.mode == kn::TopkMode::kSampled &&
      (o.sample_size < 1 || o.sample_size > kn::topk::kMaxSampleSize)) {
    return InvalidArgument(StrFormat("%s: options.sample_size = %u is not in [1, %u]", op,
                                     o.sample_size, kn::topk::kMaxSampleSize));
  }
  if (sg.nseg == 0) return Status::Ok();
  if (!sg.offsets || !sg.k || !sg.out_offsets) {
    return InvalidArgument(StrFormat("%s: segments.offsets, .k or .out_offsets is null", op));
  }
  for (size_t i = 0; i < sg.nseg; ++i) {
    if (sg.offsets[i + 1] < sg.offsets[i] || sg.out_offsets[i + 1] < sg.out_offsets[i]) {
      return InvalidArgument(
          StrFormat("%s: segments.offsets or .out_offsets descend at segment %zu", op, i));
    }
    const uint64_t len = sg.offsets[i + 1] - sg.offsets[i];
    if (sg.k[i] > len) {
      return InvalidArgument(StrFormat("%s: segments.k[%zu] = %llu > its length %llu", op, i,
                                       static_cast<unsigned long long>(sg.k[i]),
                                       static_cast<unsigned long long>(len)));
    }
    if (o.mode == kn::TopkMode::kExact && sg.out_offsets[i + 1] - sg.out_offsets[i] < sg.k[i]) {
      return InvalidArgument(
          StrFormat("%s: segment %zu's output capacity %llu < k = %llu", op, i,
                    static_cast<unsigned long long>(sg.out_offsets[i + 1] - sg.out_offsets[i]),
                    static_cast<unsigned long long>(sg.k[i])));
    }
  }
  if (o.mode == kn::TopkMode::kSampled && sg.offsets[sg.nseg] >= kn::topk::kMaxSampledPosition) {
    return InvalidArgument(StrFormat("%s: sampled mode needs every position below 2^43", op));
  }
  if (sg.nseg >= (uint64_t{1} << 31)) {
    return InvalidArgument(StrFormat("%s: %zu segments (at most 2^31 - 1)", op, sg.nseg));
  }
  return Status::Ok();
}

// Per-call temporaries (the top-k's device segment table and scratch, the norm's partial sums,
// the uploaded tables) are OpTemps (runtime.h): from the communicator's pool (or the caller's
// allocator behind it) when the library's device paths have put it in scope, else from
// DeviceAllocAsync below.
//
// DeviceAllocAsync / DeviceFreeAsync are stream-ordered: cudaMallocAsync / cudaFreeAsync on the
// op's stream. The free is enqueued right after the kernels and takes effect when the stream
// reaches it, so the call returns without waiting; cudaFree would instead synchronise the
// whole device. They come from a memory pool of the library's own per device (not the device's
// default pool, which other code in the process may use and tune), whose release threshold
// keeps up to kKeepPoolBytes reserved across synchronisations: the same temporaries at every
// step are served again from the pool instead of from the driver (the default pool's
// threshold, 0, returns everything at each synchronisation), and no more than that stays
// reserved when idle. A device without memory pools (old drivers, some virtualised GPUs) gets
// cudaMalloc, and cudaFree once the stream has passed the free (a bounded wait; past it the
// block is leaked with a warning rather than freed under a kernel).
constexpr uint64_t kKeepPoolBytes = uint64_t{512} << 20;
constexpr int kMaxPoolDevices = 64;
constexpr int kFreeWaitMs = 60000;

bool MemoryPools() {
  int dev = 0, pools = 0;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev) == cudaSuccess)
    return pools != 0;
  cudaGetLastError();  // a failed attribute query is not an error here
  return false;
}

// The library's pool of the current device (nullptr: none could be made; then the device's
// default pool serves, as before). Made once per device, never destroyed (the process's).
cudaMemPool_t OwnPool() {
  static std::mutex mu;
  static cudaMemPool_t pools[kMaxPoolDevices] = {};
  static bool tried[kMaxPoolDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxPoolDevices) {
    cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> lk(mu);
  if (!tried[dev]) {
    tried[dev] = true;
    cudaMemPoolProps props;
    std::memset(&props, 0, sizeof(props));
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t p = nullptr;
    if (cudaMemPoolCreate(&p, &props) == cudaSuccess) {
      uint64_t keep = kKeepPoolBytes;
      if (cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
        cudaGetLastError();  // the pool still works, releasing at each synchronisation
      pools[dev] = p;
    } else {
      cudaGetLastError();
    }
  }
  return pools[dev];
}

// Host tables a kernel reads (the top-k's segment table, the "segment_rms" enter table, the
// staying sums' bounds) go to the device from page-locked memory that this owns until the copy
// has run. From pageable memory cudaMemcpyAsync is host-synchronous only in part: the driver
// may read the source when the stream reaches the copy, after the caller's table is gone.
class PinnedUploads {
 public:
  ~PinnedUploads() = default;  // the process's runtime: its buffers live as long as it
  // Copies `bytes` at `src` into a page-locked buffer, enqueues the copy to dDst on `stream`,
  // and records an event after it; the buffer is reused once that event has completed.
  Status Upload(const char* what, void* dDst, const void* src, size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return Status::Ok();
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) cudaGetLastError();
    std::lock_guard<std::mutex> lk(mu_);
    Buf* b = nullptr;  // events belong to a device: a buffer serves the device it was made on
    for (Buf& c : bufs_)
      if (c.dev == dev && c.bytes >= bytes && (!b || c.bytes < b->bytes) &&
          cudaEventQuery(c.ev) == cudaSuccess)
        b = &c;
    cudaGetLastError();  // a query's cudaErrorNotReady is not an error here
    if (!b) {
      Buf nb;
      nb.dev = dev;
      nb.bytes = (bytes + 4095) / 4096 * 4096;
      cudaError_t e = cudaHostAlloc(&nb.h, nb.bytes, cudaHostAllocPortable);
      if (e != cudaSuccess) return CudaFail(StrFormat("%s: cudaHostAlloc", what).c_str(), e);
      e = cudaEventCreateWithFlags(&nb.ev, cudaEventDisableTiming);
      if (e != cudaSuccess) {
        cudaFreeHost(nb.h);
        return CudaFail(StrFormat("%s: cudaEventCreate", what).c_str(), e);
      }
      bufs_.push_back(nb);
      b = &bufs_.back();
    }
    std::memcpy(b->h, src, bytes);
    cudaError_t e = cudaMemcpyAsync(dDst, b->h, bytes, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess) e = cudaEventRecord(b->ev, stream);
    return CudaCheck(what, e);
  }

 private:
  struct Buf {
    void* h = nullptr;
    size_t bytes = 0;
    cudaEvent_t ev = nullptr;
    int dev = 0;
  };
  std::mutex mu_;
  std::deque<Buf> bufs_;  // a deque: pointers to its elements stay valid as it grows
};

// The AdamS parameters of `op`, checked as the kernels check them (MakeAdamSScalars).
Status CheckAdamSParams(const char* op, const kn::AdamSParams& params) {
  kn::AdamSScalars sc;
  if (kn::MakeAdamSScalars(params, &sc) == kn::KernelStatus::kOk) return Status::Ok();
  return InvalidArgument(StrFormat(
      "%s: bad AdamS parameters (lr %g, beta1 %g, beta2 %g, eps %g, weight_decay %g, "
      "clip_scale %g, bias_correction %d, step %lld)",
      op, params.lr, params.beta1, params.beta2, params.eps, params.weight_decay, params.clip_scale,
      static_cast<int>(params.bias_correction), static_cast<long long>(params.step)));
}

// "segment_rms": the host enter table (when enter_vs is set) tiles [0, n) in non-decreasing
// offsets, as the CPU kernels require.
Status CheckEnterTable(const char* op, const kn::AdamSParams& params, size_t n) {
  if (params.enter_vs == nullptr) return Status::Ok();
  const size_t nseg = params.enter_nseg;
  bool ok = params.enter_offsets != nullptr && nseg > 0 && params.enter_offsets[0] == 0 &&
            params.enter_offsets[nseg] == n;
  for (size_t i = 0; ok && i < nseg; ++i)
    ok = params.enter_offsets[i + 1] >= params.enter_offsets[i];
  if (ok) return Status::Ok();
  return InvalidArgument(
      StrFormat("%s: enter table (%zu segments) does not tile [0, %zu)", op, nseg, n));
}

// "segment_rms": *p = params with its host enter table (params.enter_offsets / enter_vs)
// uploaded for this launch (offsets, then the values) into temp's memory on `stream`. Without
// a table (enter_vs null) *p = params and nothing is uploaded. The table must tile [0, n).
Status UploadEnterTable(const char* op, const kn::AdamSParams& params, size_t n,
                        cudaStream_t stream, OpTemp* temp, PinnedUploads* up, kn::AdamSParams* p) {
  *p = params;
  SCAPE_RETURN_IF_ERROR(CheckEnterTable(op, params, n));
  if (params.enter_vs == nullptr) return Status::Ok();
  const size_t nseg = params.enter_nseg;
  const size_t offBytes = 8 * (nseg + 1);
  std::vector<char> table(offBytes + 4 * nseg);
  std::memcpy(table.data(), params.enter_offsets, offBytes);
  std::memcpy(table.data() + offBytes, params.enter_vs, 4 * nseg);
  void* base = nullptr;
  SCAPE_RETURN_IF_ERROR(temp->Alloc(op, table.size(), &base));
  SCAPE_RETURN_IF_ERROR(up->Upload(StrFormat("%s: uploading the enter table", op).c_str(), base,
                                   table.data(), table.size(), stream));
  p->enter_offsets = static_cast<const uint64_t*>(base);
  p->enter_vs = reinterpret_cast<const float*>(static_cast<char*>(base) + offBytes);
  return Status::Ok();
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
    // Mapped: the staging pipeline's stream waits read a flag word here from the device.
    return CudaCheck(
        "cudaHostAlloc (staging buffer)",
        cudaHostAlloc(p, bytes ? bytes : 1, cudaHostAllocPortable | cudaHostAllocMapped));
  }
  void HostFree(void* p) override { cudaFreeHost(p); }
  bool StreamId(Stream s, uint64_t* id) override {
    *id = 0;
#if CUDART_VERSION >= 12000
    unsigned long long v = 0;  // NOLINT(runtime/int): cudaStreamGetId's type
    if (cudaStreamGetId(static_cast<cudaStream_t>(s), &v) == cudaSuccess) {
      *id = static_cast<uint64_t>(v);
      return true;
    }
    cudaGetLastError();
#else
    (void)s;
#endif
    return false;
  }
  int ComputeCapability() override {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return major * 10 + minor;
  }
  Status UploadStaged(void* dDst, const void* src, size_t bytes, Stream s) override {
    return uploads_.Upload("uploading a host table", dDst, src, bytes,
                           static_cast<cudaStream_t>(s));
  }
  Status CopyAsync(void* dst, const void* src, size_t bytes, Stream s) override {
    if (bytes == 0) return Status::Ok();
    return CudaCheck("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                                        static_cast<cudaStream_t>(s)));
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
    return CudaCheck("cudaEventRecord",
                     cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)));
  }
  Status EventQuery(Event e, bool* done) override {
    return QueryDone("cudaEventQuery (a copy into a staging buffer)",
                     cudaEventQuery(static_cast<cudaEvent_t>(e)), done);
  }
  Status LaunchHostFunc(Stream s, HostFn fn, void* arg) override {
    return CudaCheck("cudaLaunchHostFunc",
                     cudaLaunchHostFunc(static_cast<cudaStream_t>(s), fn, arg));
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
    return CudaCheck("cudaStreamSynchronize", cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
  }
  Status StreamWaitEvent(Stream s, Event e) override {
    return CudaCheck("cudaStreamWaitEvent", cudaStreamWaitEvent(static_cast<cudaStream_t>(s),
                                                                static_cast<cudaEvent_t>(e), 0));
  }
  bool StreamCapturing(Stream s) override {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &cap) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return cap != cudaStreamCaptureStatusNone;
  }
  Status StreamWaitValue(Stream s, const uint32_t* flag, uint32_t value) override {
    // The wait is a kernel spinning on a host flag that the library's worker sets when the
    // exchange has run: captured in a CUDA graph, a replay would spin on a flag nobody sets for
    // it (or pass on a stale one). Refused while the stream captures (the staging channel
    // refuses the collective before enqueueing anything; this is the backstop).
    if (StreamCapturing(s))
      return Unsupported(
          "a staged device collective (UCX backend) cannot be captured in a CUDA graph: its "
          "stream waits for the host exchange on a flag the library sets when that exchange "
          "runs, which a graph replay never does; run it outside the capture (or use the NCCL "
          "backend)");
    return KernelFail("stream wait on a host flag",
                      kc::WaitHostFlagCuda(flag, value, static_cast<cudaStream_t>(s)));
  }
  Status StreamQuery(Stream s, bool* done) override {
    cudaError_t r = cudaStreamQuery(static_cast<cudaStream_t>(s));
    *done = false;  // on an error too
    return QueryDone("cudaStreamQuery", r, done);
  }
  Status StreamCreate(Stream* s) override {
    cudaStream_t cs = nullptr;
    cudaError_t r = cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking);
    *s = cs;
    return CudaCheck("cudaStreamCreateWithFlags", r);
  }
  void StreamDestroy(Stream s) override {
    if (s) cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }

  // ---- device memory and the kernel ops ------------------------------------------------------
  Status DeviceAlloc(size_t bytes, void** d) override {
    if (d == nullptr) return InvalidArgument("DeviceAlloc: d is null");
    *d = nullptr;
    cudaError_t e = cudaMalloc(d, bytes ? bytes : 1);
    if (e != cudaSuccess) {
      *d = nullptr;
      return CudaFail(StrFormat("cudaMalloc of %zu bytes", bytes).c_str(), e);
    }
    return Status::Ok();
  }
  void DeviceFree(void* d) override {
    if (d && cudaFree(d) != cudaSuccess) cudaGetLastError();  // nothing to act on here
  }
  Status DeviceAllocAsync(size_t bytes, Stream s, void** d) override {
    *d = nullptr;
    cudaError_t e = cudaSuccess;
    if (MemoryPools()) {
      cudaMemPool_t pool = OwnPool();
      e = pool ? cudaMallocFromPoolAsync(d, bytes ? bytes : 1, pool, static_cast<cudaStream_t>(s))
               : cudaMallocAsync(d, bytes ? bytes : 1, static_cast<cudaStream_t>(s));
    } else {
      e = cudaMalloc(d, bytes ? bytes : 1);
    }
    if (e != cudaSuccess) {
      *d = nullptr;
      return CudaFail(StrFormat("allocating %zu bytes of device memory", bytes).c_str(), e);
    }
    return Status::Ok();
  }
  void DeviceFreeAsync(void* d, Stream s) override {
    if (!d) return;
    if (MemoryPools()) {
      cudaFreeAsync(d, static_cast<cudaStream_t>(s));
      return;
    }
    // No pools: the block is the kernels' until the stream has passed them (bounded).
    Deadline dl = Deadline::AfterMs(kFreeWaitMs);
    for (;;) {
      const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>(s));
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady || dl.Expired()) {
        cudaGetLastError();
        SCAPE_WARN("a device temporary (%p) is leaked: its stream did not finish within %d ms", d,
                   kFreeWaitMs);
        return;
      }
      struct timespec ts = {0, 100000};
      nanosleep(&ts, nullptr);
    }
    cudaFree(d);
  }
  Status Memset(void* d, int value, size_t bytes, Stream s) override {
    if (bytes == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckNonNull("memset", "d", d));
    return CudaCheck("cudaMemsetAsync",
                     cudaMemsetAsync(d, value, bytes, static_cast<cudaStream_t>(s)));
  }
  Status Gather(const void* dDense, const uint64_t* dIdx, size_t k, size_t esz, void* dPacked,
                Stream s) override {
    return Indexed("gather kernel", dDense, dIdx, k, esz, dPacked, [&] {
      return kc::GatherByIndexCuda(dDense, dIdx, k, esz, dPacked, static_cast<cudaStream_t>(s));
    });
  }
  Status Scatter(const void* dPacked, const uint64_t* dIdx, size_t k, size_t esz, void* dDense,
                 Stream s) override {
    return Indexed("scatter kernel", dDense, dIdx, k, esz, dPacked, [&] {
      return kc::ScatterByIndexCuda(dPacked, dIdx, k, esz, dDense, static_cast<cudaStream_t>(s));
    });
  }
  Status TopkAbs(const float* dX, const kn::TopkSegments& segments, const kn::TopkOptions& options,
                 uint64_t* dOut, uint64_t* dCounts, Stream s) override {
    const char* op = "top-k kernel";
    SCAPE_RETURN_IF_ERROR(CheckTopkTable(segments, options));
    const size_t nseg = segments.nseg;
    if (nseg == 0) return Status::Ok();
    const uint64_t elems = segments.offsets[nseg] - segments.offsets[0];
    if (elems > 0) SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dX", dX));
    if (segments.out_offsets[nseg] > segments.out_offsets[0]) {
      SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dOut", dOut));
    }
    SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dCounts", dCounts));
    SCAPE_RETURN_IF_ERROR(CheckAllAligned(
        op, {ALIGNED_ARG(dX, sizeof(float)), ALIGNED_ARG(dOut, 8), ALIGNED_ARG(dCounts, 8)}));
    // No output capacity at all: the kernel still wants a non-null dOut, which it never writes.
    if (dOut == nullptr) dOut = dCounts;
    auto stream = static_cast<cudaStream_t>(s);
    kc::TopkCudaSegments dseg;
    dseg.nseg = nseg;
    dseg.max_elements = elems;
    size_t tempBytes = 0;
    SCAPE_RETURN_IF_ERROR(KernelFail(
        op, kc::TopkAbsCuda(dX, dseg, options, dOut, dCounts, nullptr, &tempBytes, stream)));
    // One allocation: the segment table (offsets, k, out_offsets), then the kernel's scratch.
    const size_t tableWords = 3 * nseg + 2;
    const size_t tableBytes = (tableWords * 8 + 255) / 256 * 256;
    std::vector<uint64_t> table(tableWords);
    for (size_t i = 0; i <= nseg; ++i) {
      table[i] = segments.offsets[i];
      table[2 * nseg + 1 + i] = segments.out_offsets[i];
      if (i < nseg) table[nseg + 1 + i] = segments.k[i];
    }
    OpTemp temp(this, stream);
    void* base = nullptr;
    SCAPE_RETURN_IF_ERROR(temp.Alloc(op, tableBytes + tempBytes, &base));
    // Through page-locked memory: `table` goes out of scope when this call returns.
    SCAPE_RETURN_IF_ERROR(uploads_.Upload("top-k kernel: uploading the segment table", base,
                                          table.data(), tableWords * 8, stream));
    const uint64_t* dTable = static_cast<const uint64_t*>(base);
    dseg.d_offsets = dTable;
    dseg.d_k = dTable + nseg + 1;
    dseg.d_out_offsets = dTable + 2 * nseg + 1;
    return KernelFail(
        op, kc::TopkAbsCuda(dX, dseg, options, dOut, dCounts, static_cast<char*>(base) + tableBytes,
                            &tempBytes, stream));
  }
  Status CandidatePackResidual(const float* dM, const float* dG, float* dE, size_t n, float beta1,
                               const uint64_t* dMask, size_t k, scapeDataType_t payloadType,
                               void* dPayload, float* dCOut, Stream s, float gradScale) override {
    const char* op = "candidate kernel";
    SCAPE_RETURN_IF_ERROR(CheckGradScale(op, gradScale));
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    if (n == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dM), PTR_ARG(dG), PTR_ARG(dE)}));
    SCAPE_RETURN_IF_ERROR(CheckMaskAndPayload(op, k, dMask, dPayload, payloadType));
    return KernelFail(op, kc::CandidatePackResidualCuda(
                              dM, dG, dE, n, beta1, dMask, k, payloadType, dPayload, dCOut,
                              static_cast<cudaStream_t>(s), /*keep_rounding=*/true, gradScale));
  }
  Status UnpackAdamSUpdate(const void* dPayload, scapeDataType_t payloadType, const uint64_t* dMask,
                           size_t k, float* dTheta, float* dM, size_t n,
                           const kn::AdamSParams& params, Stream s) override {
    const char* op = "AdamS update kernel";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckAdamSParams(op, params));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    if (n == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dTheta), PTR_ARG(dM)}));
    SCAPE_RETURN_IF_ERROR(CheckMaskAndPayload(op, k, dMask, dPayload, payloadType));
    auto stream = static_cast<cudaStream_t>(s);
    if (params.enter_vs == nullptr)
      return KernelFail(op, kc::UnpackAdamSUpdateCuda(dPayload, payloadType, dMask, k, dTheta, dM,
                                                      n, params, stream));
    // "segment_rms": upload the host table (offsets, then the values) for this launch.
    OpTemp temp(this, stream);
    kn::AdamSParams p;
    SCAPE_RETURN_IF_ERROR(UploadEnterTable(op, params, n, stream, &temp, &uploads_, &p));
    return KernelFail(
        op, kc::UnpackAdamSUpdateCuda(dPayload, payloadType, dMask, k, dTheta, dM, n, p, stream));
  }
  Status AdamSUpdatePairs(const void* dPayload, scapeDataType_t payloadType, const uint64_t* dIdx,
                          size_t k, const float* dTheta, const float* dM, size_t n,
                          const kn::AdamSParams& params, float* dPairs, Stream s) override {
    const char* op = "AdamS pairs kernel";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckAdamSParams(op, params));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    SCAPE_RETURN_IF_ERROR(CheckEnterTable(op, params, n));
    if (k == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(
        op, {PTR_ARG(dPayload), PTR_ARG(dIdx), PTR_ARG(dTheta), PTR_ARG(dM), PTR_ARG(dPairs)}));
    SCAPE_RETURN_IF_ERROR(CheckAllAligned(
        op, {ALIGNED_ARG(dIdx, 8), ALIGNED_ARG(dTheta, 4), ALIGNED_ARG(dM, 4),
             ALIGNED_ARG(dPairs, 4), ALIGNED_ARG(dPayload, kn::PayloadElementSize(payloadType))}));
    auto stream = static_cast<cudaStream_t>(s);
    OpTemp temp(this, stream);
    kn::AdamSParams p;
    SCAPE_RETURN_IF_ERROR(UploadEnterTable(op, params, n, stream, &temp, &uploads_, &p));
    return KernelFail(op, kc::AdamSUpdatePairsCuda(dPayload, payloadType, dIdx, k, dTheta, dM, n, p,
                                                   dPairs, stream));
  }
  Status UnpackPairsDecay(const float* dPairs, const uint64_t* dMask, size_t k, float* dTheta,
                          float* dM, size_t n, const kn::AdamSParams& params, void* dCopy,
                          scapeDataType_t copyType, Stream s) override {
    const char* op = dCopy ? "pairs unpack kernel (16-bit model copy)" : "pairs unpack kernel";
    if (dCopy) SCAPE_RETURN_IF_ERROR(CheckCopyType(op, copyType));
    SCAPE_RETURN_IF_ERROR(CheckAdamSParams(op, params));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    if (n == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dTheta), PTR_ARG(dM)}));
    if (k > 0) {
      SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dMask), PTR_ARG(dPairs)}));
    }
    SCAPE_RETURN_IF_ERROR(
        CheckAllAligned(op, {ALIGNED_ARG(dMask, 8), ALIGNED_ARG(dPairs, 4), ALIGNED_ARG(dTheta, 4),
                             ALIGNED_ARG(dM, 4), ALIGNED_ARG(dCopy, 2)}));
    kn::ModelCopy c;
    c.p = dCopy;
    c.type = copyType;
    return KernelFail(
        op, kc::UnpackPairsDecayCuda(dPairs, dMask, k, dTheta, dM, n, params, dCopy ? &c : nullptr,
                                     static_cast<cudaStream_t>(s)));
  }
  Status StayingGradSqBlocks(const void* dPayload, scapeDataType_t payloadType,
                             const uint64_t* dIdx, const float* dM, size_t n, float beta1,
                             const uint64_t* bounds, size_t nb, double* dSums, uint64_t* dCounts,
                             Stream s) override {
    const char* op = "segment_rms sums kernel";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckBeta1(op, beta1));
    if (nb == 0) return Status::Ok();
    if (bounds == nullptr) return InvalidArgument(StrFormat("%s: bounds is NULL", op));
    for (size_t b = 0; b < nb; ++b)
      if (bounds[b + 1] < bounds[b] || bounds[b + 1] - bounds[b] > kn::kSqNormBlock)
        return InvalidArgument(
            StrFormat("%s: block %zu is descending or over %zu slots", op, b, kn::kSqNormBlock));
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(
        op, {PTR_ARG(dSums), PTR_ARG(dCounts), PTR_ARG(dIdx), PTR_ARG(dM), PTR_ARG(dPayload)}));
    SCAPE_RETURN_IF_ERROR(CheckAllAligned(
        op, {ALIGNED_ARG(dSums, 8), ALIGNED_ARG(dCounts, 8), ALIGNED_ARG(dIdx, 8)}));
    auto stream = static_cast<cudaStream_t>(s);
    OpTemp temp(this, stream);
    void* base = nullptr;
    SCAPE_RETURN_IF_ERROR(temp.Alloc(op, 8 * (nb + 1), &base));
    SCAPE_RETURN_IF_ERROR(uploads_.Upload("segment_rms sums kernel: uploading the bounds", base,
                                          bounds, 8 * (nb + 1), stream));
    return KernelFail(op, kc::StayingGradSqBlocksCuda(dPayload, payloadType, dIdx, dM, n, beta1,
                                                      static_cast<const uint64_t*>(base), nb, dSums,
                                                      dCounts, stream));
  }
  Status CandidatePackResidualGrad(const float* dM, const void* dG, scapeDataType_t gradType,
                                   float* dE, size_t n, float beta1, const uint64_t* dMask,
                                   size_t k, scapeDataType_t payloadType, void* dPayload,
                                   float* dCOut, Stream s, float gradScale) override {
    if (gradType == scapeFloat32)
      return CandidatePackResidual(dM, static_cast<const float*>(dG), dE, n, beta1, dMask, k,
                                   payloadType, dPayload, dCOut, s, gradScale);
    const char* op = "candidate kernel (16-bit gradients)";
    SCAPE_RETURN_IF_ERROR(CheckGradScale(op, gradScale));
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, gradType));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    if (n == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dM), PTR_ARG(dG), PTR_ARG(dE)}));
    SCAPE_RETURN_IF_ERROR(
        CheckMaskAndPayload(op, k, dMask, dPayload, payloadType, {ALIGNED_ARG(dG, 2)}));
    return KernelFail(
        op, kc::CandidatePackResidualGradCuda(dM, dG, gradType, dE, n, beta1, dMask, k, payloadType,
                                              dPayload, dCOut, static_cast<cudaStream_t>(s),
                                              /*keep_rounding=*/true, gradScale));
  }
  Status UnpackAdamSUpdateCopy(const void* dPayload, scapeDataType_t payloadType,
                               const uint64_t* dMask, size_t k, float* dTheta, float* dM, size_t n,
                               const kn::AdamSParams& params, void* dCopy, scapeDataType_t copyType,
                               Stream s) override {
    const char* op = "AdamS update kernel (16-bit model copy)";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckCopyType(op, copyType));
    kn::AdamSScalars sc;
    if (kn::MakeAdamSScalars(params, &sc) != kn::KernelStatus::kOk)
      return InvalidArgument(StrFormat("%s: bad AdamS parameters", op));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    if (n == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dTheta), PTR_ARG(dM), PTR_ARG(dCopy)}));
    SCAPE_RETURN_IF_ERROR(
        CheckMaskAndPayload(op, k, dMask, dPayload, payloadType, {ALIGNED_ARG(dCopy, 2)}));
    kn::ModelCopy c;
    c.p = dCopy;
    c.type = copyType;
    // "segment_rms": the host table uploaded for this launch, as in UnpackAdamSUpdate (the
    // kernel reads params.enter_offsets / enter_vs as device pointers).
    auto stream = static_cast<cudaStream_t>(s);
    OpTemp temp(this, stream);
    kn::AdamSParams p;
    SCAPE_RETURN_IF_ERROR(UploadEnterTable(op, params, n, stream, &temp, &uploads_, &p));
    return KernelFail(op, kc::UnpackAdamSUpdateCopyCuda(dPayload, payloadType, dMask, k, dTheta, dM,
                                                        n, p, c, stream));
  }
  Status RecoveredGradSqNorm(const void* dPayload, scapeDataType_t payloadType,
                             const uint64_t* dMask, size_t k, const float* dM, size_t n,
                             float beta1, double* dSqNorm, Stream s) override {
    const char* op = "gradient norm kernel";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType));
    SCAPE_RETURN_IF_ERROR(CheckBeta1(op, beta1));
    SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
    SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dSqNorm", dSqNorm));
    SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dSqNorm", dSqNorm, sizeof(double)));
    if (k > 0) {
      SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dPayload), PTR_ARG(dMask), PTR_ARG(dM)}));
    }
    SCAPE_RETURN_IF_ERROR(CheckAllAligned(
        op, {ALIGNED_ARG(dMask, 8), ALIGNED_ARG(dPayload, kn::PayloadElementSize(payloadType))}));
    auto stream = static_cast<cudaStream_t>(s);
    size_t tempBytes = 0;
    SCAPE_RETURN_IF_ERROR(
        KernelFail(op, kc::RecoveredGradSqNormCuda(dPayload, payloadType, dMask, k, dM, n, beta1,
                                                   dSqNorm, nullptr, &tempBytes, stream)));
    OpTemp temp(this, stream);
    void* dTemp = nullptr;
    SCAPE_RETURN_IF_ERROR(temp.Alloc(op, tempBytes, &dTemp));
    return KernelFail(op, kc::RecoveredGradSqNormCuda(dPayload, payloadType, dMask, k, dM, n, beta1,
                                                      dSqNorm, dTemp, &tempBytes, stream));
  }
  Status GradSqNorm(const void* dG, scapeDataType_t gradType, size_t n, double* dSqNorm,
                    Stream s) override {
    const char* op = "local gradient norm kernel";
    SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, gradType));
    SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dSqNorm", dSqNorm));
    SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dSqNorm", dSqNorm, sizeof(double)));
    if (n > 0) SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dG", dG));
    SCAPE_RETURN_IF_ERROR(CheckAllAligned(op, {ALIGNED_ARG(dG, kn::PayloadElementSize(gradType))}));
    auto stream = static_cast<cudaStream_t>(s);
    size_t tempBytes = 0;
    SCAPE_RETURN_IF_ERROR(
        KernelFail(op, kc::GradSqNormCuda(dG, gradType, n, dSqNorm, nullptr, &tempBytes, stream)));
    OpTemp temp(this, stream);
    void* dTemp = nullptr;
    SCAPE_RETURN_IF_ERROR(temp.Alloc(op, tempBytes, &dTemp));
    return KernelFail(op, kc::GradSqNormCuda(dG, gradType, n, dSqNorm, dTemp, &tempBytes, stream));
  }
  Status AnyNonFinite(const void* dX, size_t n, scapeDataType_t type, uint32_t* dFlag,
                      Stream s) override {
    const char* op = "non-finite check kernel";
    SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dFlag", dFlag));
    SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dFlag", dFlag, 4));
    if (n > 0) SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dX", dX));
    if (type == scapeFloat32) {
      SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dX", dX, 4));
      return KernelFail(op, kc::AnyNonFiniteCuda(static_cast<const float*>(dX), n, dFlag,
                                                 static_cast<cudaStream_t>(s)));
    }
    if (type != scapeBfloat16 && type != scapeFloat16)
      return InvalidArgument(StrFormat("%s: element type %d", op, static_cast<int>(type)));
    SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dX", dX, 2));
    return KernelFail(op, kc::AnyNonFinite16Cuda(static_cast<const uint16_t*>(dX), n,
                                                 type == scapeBfloat16 ? 0x7f80 : 0x7c00, dFlag,
                                                 static_cast<cudaStream_t>(s)));
  }

  Status PayloadAmax(const float* dX, size_t k, float* dAmax, Stream s) override {
    const char* op = "payload scale kernel";
    SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dAmax", dAmax));
    SCAPE_RETURN_IF_ERROR(CheckAligned(op, "dAmax", dAmax, 4));
    if (k > 0) SCAPE_RETURN_IF_ERROR(CheckNonNull(op, "dX", dX));
    return KernelFail(op, kc::PayloadAmaxCuda(dX, k, dAmax, static_cast<cudaStream_t>(s)));
  }
  Status QuantizeScaled(const float* dX, size_t k, scapeDataType_t type, const float* dAmax,
                        int nranks, void* dQ, const uint64_t* dPos, float* dResidual,
                        Stream s) override {
    const char* op = "payload conversion kernel";
    SCAPE_RETURN_IF_ERROR(CheckScaled(op, type, dAmax));
    return KernelFail(op, kc::QuantizeScaledCuda(dX, k, type, dAmax, nranks, dQ, dPos, dResidual,
                                                 static_cast<cudaStream_t>(s)));
  }
  Status DequantizeScaled(const void* dQ, size_t k, scapeDataType_t type, const float* dAmax,
                          int nranks, float* dOut, Stream s) override {
    const char* op = "payload conversion kernel";
    SCAPE_RETURN_IF_ERROR(CheckScaled(op, type, dAmax));
    return KernelFail(op, kc::DequantizeScaledCuda(dQ, k, type, dAmax, nranks, dOut,
                                                   static_cast<cudaStream_t>(s)));
  }

 private:
  // Gather / scatter: the checks (CheckIndexed), then launch() unless k is 0.
  template <typename Launch>
  static Status Indexed(const char* op, const void* dDense, const uint64_t* dIdx, size_t k,
                        size_t esz, const void* dPacked, Launch launch) {
    SCAPE_RETURN_IF_ERROR(CheckIndexed(op, dDense, dIdx, k, esz, dPacked));
    if (k == 0) return Status::Ok();
    return KernelFail(op, launch());
  }
  // Gather / scatter arguments: the element size, null and misaligned pointers.
  static Status CheckIndexed(const char* op, const void* dDense, const uint64_t* dIdx, size_t k,
                             size_t esz, const void* dPacked) {
    if (esz != 1 && esz != 2 && esz != 4 && esz != 8) {
      return InvalidArgument(StrFormat("%s: element size esz = %zu is not 1, 2, 4 or 8", op, esz));
    }
    if (k == 0) return Status::Ok();
    SCAPE_RETURN_IF_ERROR(CheckAllNonNull(op, {PTR_ARG(dDense), PTR_ARG(dIdx), PTR_ARG(dPacked)}));
    return CheckAllAligned(
        op, {ALIGNED_ARG(dDense, esz), ALIGNED_ARG(dIdx, 8), ALIGNED_ARG(dPacked, esz)});
  }

  std::once_flag once_;
  bool available_ = false;
  PinnedUploads uploads_;
};

}  // namespace

Runtime* CudaRuntime() {
  static Cuda cuda;
  return &cuda;
}

}  // namespace device
}  // namespace scape
