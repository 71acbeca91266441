// The runtime of a build (or a machine) without CUDA: every pointer is host memory, and a
// stream cannot exist, so anything stream-ordered is scapeUnsupported.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/clock.h"
#include "base/log.h"

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
  Status StreamQuery(Stream, bool*) override { return NoStream(); }
  Status StreamWaitEvent(Stream, Event) override { return NoStream(); }
  Status StreamWaitValue(Stream, const uint32_t*, uint32_t) override { return NoStream(); }
};

std::atomic<Runtime*> g_override{nullptr};

Status NoDeviceOp(const Runtime* rt, const char* op) {
  return Unsupported(StrFormat("the %s device runtime has no %s", rt->Name(), op));
}

}  // namespace

Status Runtime::StreamQuery(Stream s, bool* done) {
  *done = false;
  SCAPE_RETURN_IF_ERROR(StreamSynchronize(s));
  *done = true;
  return Status::Ok();
}

Status Runtime::StreamWaitValue(Stream, const uint32_t*, uint32_t) {
  return Unsupported(StrFormat("the %s device runtime has no stream waits on a host flag", Name()));
}

Status Runtime::StreamWaitEvent(Stream, Event e) {
  for (;;) {
    bool done = false;
    SCAPE_RETURN_IF_ERROR(EventQuery(e, &done));
    if (done) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

Status StreamWaitFor(Runtime* rt, Stream s, int timeoutMs, const char* what) {
  Deadline dl = Deadline::AfterMs(timeoutMs);
  for (int spin = 0;; ++spin) {
    bool done = false;
    SCAPE_RETURN_IF_ERROR(rt->StreamQuery(s, &done).Prepend(what));
    if (done) return Status::Ok();
    if (dl.Expired())
      return TimeoutError(
          StrFormat("%s: the stream did not get there within %d ms (work queued ahead of it that "
                    "does not finish, or a held stream; the communicator's timeout, "
                    "SCAPE_TIMEOUT_MS, sets the limit)",
                    what, timeoutMs));
    if (spin < 100)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

HostStaging::~HostStaging() {
  if (queued_) {
    size_t total = 0;
    for (const Buf& b : bufs_) total += b.bytes;
    if (total)
      SCAPE_WARN(
          "%zu bytes of page-locked staging leaked: copies queued on a stream that was not "
          "waited for to the end (a timeout or an error), which may still use them",
          total);
    return;
  }
  for (const Buf& b : bufs_) rt_->HostFree(b.pinned);
}

Status HostStaging::Stage(size_t bytes, void** pinned) {
  *pinned = nullptr;
  Status st = rt_->HostAlloc(bytes, pinned);
  if (!st.ok()) return st.Prepend(StrFormat("%zu bytes of page-locked staging", bytes));
  return Status::Ok();
}

Status HostStaging::Download(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  void* p = nullptr;
  SCAPE_RETURN_IF_ERROR(Stage(bytes, &p));
  bufs_.push_back(Buf{p, dst, bytes});
  queued_ = true;  // from here on, the buffer is the stream's until a wait says otherwise
  return rt_->CopyAsync(p, src, bytes, s_);
}

Status HostStaging::Upload(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  void* p = nullptr;
  SCAPE_RETURN_IF_ERROR(Stage(bytes, &p));
  std::memcpy(p, src, bytes);
  bufs_.push_back(Buf{p, nullptr, bytes});
  queued_ = true;
  return rt_->CopyAsync(dst, p, bytes, s_);
}

Status HostStaging::Wait(int timeoutMs, const char* what) {
  if (!queued_) return Status::Ok();
  SCAPE_RETURN_IF_ERROR(StreamWaitFor(rt_, s_, timeoutMs, what));
  queued_ = false;
  for (Buf& b : bufs_) {
    if (b.dst) std::memcpy(b.dst, b.pinned, b.bytes);
    b.dst = nullptr;
  }
  return Status::Ok();
}

Status DownloadWithin(Runtime* rt, void* dst, const void* src, size_t bytes, Stream s,
                      int timeoutMs, const char* what) {
  HostStaging h(rt, s);
  SCAPE_RETURN_IF_ERROR(h.Download(dst, src, bytes).Prepend(what));
  return h.Wait(timeoutMs, what);
}

Status Runtime::UploadStaged(void* dDst, const void* src, size_t bytes, Stream s) {
  return CopyAsync(dDst, src, bytes, s);
}

Status Runtime::StreamCreate(Stream* s) {
  *s = nullptr;
  return NoDeviceOp(this, "streams");
}
void Runtime::StreamDestroy(Stream) {}

// The device ops' defaults: a runtime without a device has none of them.
Status Runtime::DeviceAlloc(size_t, void** d) {
  *d = nullptr;
  return NoDeviceOp(this, "device memory");
}
void Runtime::DeviceFree(void*) {}
Status Runtime::DeviceAllocAsync(size_t bytes, Stream, void** d) { return DeviceAlloc(bytes, d); }
void Runtime::DeviceFreeAsync(void* d, Stream s) {
  if (!d) return;
  // No stream-ordered free: the work that uses d must have run first.
  (void)StreamSynchronize(s);
  DeviceFree(d);
}

ScopedTempSource::ScopedTempSource(Runtime* rt, TempSource* src) : rt_(rt) {
  std::lock_guard<std::mutex> lk(rt->tempMu_);
  rt->tempScopes_.emplace_back(std::this_thread::get_id(), src);
}

ScopedTempSource::~ScopedTempSource() {
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lk(rt_->tempMu_);
  auto& v = rt_->tempScopes_;
  for (auto it = v.rbegin(); it != v.rend(); ++it)
    if (it->first == me) {
      v.erase(std::next(it).base());
      return;
    }
}

TempSource* Runtime::CurrentTempSource() {
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lk(tempMu_);
  for (auto it = tempScopes_.rbegin(); it != tempScopes_.rend(); ++it)
    if (it->first == me) return it->second;
  return nullptr;
}

Status OpTemp::Alloc(const char* op, size_t bytes, void** d) {
  Release();
  *d = nullptr;
  Status st = src_ ? src_->TempAlloc(bytes ? bytes : 1, s_, &d_)
                   : rt_->DeviceAllocAsync(bytes ? bytes : 1, s_, &d_);
  if (!st.ok()) {
    d_ = nullptr;
    return st.Prepend(StrFormat("%s: %zu temporary bytes", op, bytes));
  }
  *d = d_;
  return Status::Ok();
}

void OpTemp::Release() {
  if (!d_) return;
  if (src_)
    src_->TempFree(d_, s_);
  else
    rt_->DeviceFreeAsync(d_, s_);
  d_ = nullptr;
}
Status Runtime::Memset(void*, int, size_t, Stream) { return NoDeviceOp(this, "memset"); }
Status Runtime::Gather(const void*, const uint64_t*, size_t, size_t, void*, Stream) {
  return NoDeviceOp(this, "gather kernel");
}
Status Runtime::Scatter(const void*, const uint64_t*, size_t, size_t, void*, Stream) {
  return NoDeviceOp(this, "scatter kernel");
}
Status Runtime::TopkAbs(const float*, const kernels::TopkSegments&, const kernels::TopkOptions&,
                        uint64_t*, uint64_t*, Stream) {
  return NoDeviceOp(this, "top-k kernel");
}
Status Runtime::CandidatePackResidual(const float*, const float*, float*, size_t, float,
                                      const uint64_t*, size_t, scapeDataType_t, void*, float*,
                                      Stream, float) {
  return NoDeviceOp(this, "candidate kernel");
}
Status Runtime::UnpackAdamSUpdate(const void*, scapeDataType_t, const uint64_t*, size_t, float*,
                                  float*, size_t, const kernels::AdamSParams&, Stream) {
  return NoDeviceOp(this, "AdamS update kernel");
}
Status Runtime::CandidatePackResidualGrad(const float* dM, const void* dG, scapeDataType_t gradType,
                                          float* dE, size_t n, float beta1, const uint64_t* dMask,
                                          size_t k, scapeDataType_t payloadType, void* dPayload,
                                          float* dCOut, Stream s, float gradScale) {
  if (gradType == scapeFloat32)
    return CandidatePackResidual(dM, static_cast<const float*>(dG), dE, n, beta1, dMask, k,
                                 payloadType, dPayload, dCOut, s, gradScale);
  return NoDeviceOp(this, "candidate kernel (16-bit gradients)");
}
Status Runtime::UnpackAdamSUpdateCopy(const void*, scapeDataType_t, const uint64_t*, size_t, float*,
                                      float*, size_t, const kernels::AdamSParams&, void*,
                                      scapeDataType_t, Stream) {
  return NoDeviceOp(this, "AdamS update kernel (16-bit model copy)");
}
Status Runtime::AdamSUpdatePairs(const void*, scapeDataType_t, const uint64_t*, size_t,
                                 const float*, const float*, size_t, const kernels::AdamSParams&,
                                 float*, Stream) {
  return NoDeviceOp(this, "AdamS pairs kernel");
}
Status Runtime::UnpackPairsDecay(const float*, const uint64_t*, size_t, float*, float*, size_t,
                                 const kernels::AdamSParams&, void*, scapeDataType_t, Stream) {
  return NoDeviceOp(this, "pairs unpack kernel");
}
Status Runtime::RecoveredGradSqNorm(const void*, scapeDataType_t, const uint64_t*, size_t,
                                    const float*, size_t, float, double*, Stream) {
  return NoDeviceOp(this, "gradient norm kernel");
}
Status Runtime::GradSqNorm(const void*, scapeDataType_t, size_t, double*, Stream) {
  return NoDeviceOp(this, "local gradient norm kernel");
}
Status Runtime::AnyNonFinite(const void*, size_t, scapeDataType_t, uint32_t*, Stream) {
  return NoDeviceOp(this, "non-finite check kernel");
}
Status Runtime::PayloadAmax(const float*, size_t, float*, Stream) {
  return NoDeviceOp(this, "payload scale kernel");
}
Status Runtime::QuantizeScaled(const float*, size_t, scapeDataType_t, const float*, int, void*,
                               const uint64_t*, float*, Stream) {
  return NoDeviceOp(this, "payload conversion kernel");
}
Status Runtime::DequantizeScaled(const void*, size_t, scapeDataType_t, const float*, int, float*,
                                 Stream) {
  return NoDeviceOp(this, "payload conversion kernel");
}
Status Runtime::StayingGradSqBlocks(const void*, scapeDataType_t, const uint64_t*, const float*,
                                    size_t, float, const uint64_t*, size_t, double*, uint64_t*,
                                    Stream) {
  return NoDeviceOp(this, "segment_rms sums kernel");
}

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
