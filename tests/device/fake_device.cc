// The CPU fake of the device runtime: see fake_device.h.
#include "tests/device/fake_device.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/finite.h"
#include "kernels/cpu/gather.h"
#include "kernels/cpu/scaled.h"
#include "kernels/cpu/topk_common.h"
#include "kernels/dtypes.h"

namespace fake_device {

using scape::Status;
using scape::device::PtrKind;
using scape::device::Stream;
namespace kn = scape::kernels;

namespace {
thread_local int t_device = 0;         // the thread's current device (SetDevice)
thread_local bool t_inHostFn = false;  // the thread is the host-function thread
}  // namespace

namespace {
std::atomic<uint64_t> g_streamIds{0};
}  // namespace

FakeStream::FakeStream(int device, bool blocking)
    : device_(device), blocking_(blocking), id_(++g_streamIds), th_([this] { Main(); }) {}

FakeStream::~FakeStream() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  th_.join();
}

namespace {
std::atomic<size_t> g_queueDepth{0};
}  // namespace

void FakeStream::SetQueueDepth(size_t depth) { g_queueDepth.store(depth); }

void FakeStream::Push(std::function<void()> fn) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    const size_t depth = g_queueDepth.load();
    if (depth) cv_.wait(lk, [&] { return stop_ || pushed_ - ran_ < depth; });
    q_.push_back(std::move(fn));
    ++pushed_;
  }
  cv_.notify_all();
}

bool FakeStream::Sync(int timeoutMs) {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t target = pushed_;
  return cv_.wait_for(lk, std::chrono::milliseconds(timeoutMs), [&] { return ran_ >= target; });
}

bool FakeStream::Idle() {
  std::lock_guard<std::mutex> lk(mu_);
  return ran_ >= pushed_;
}

uint64_t FakeStream::Pushed() {
  std::lock_guard<std::mutex> lk(mu_);
  return pushed_;
}

void FakeStream::WaitRan(uint64_t n) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return ran_ >= n; });
}

void FakeStream::Main() {
  t_device = device_;  // the stream's ops run on its device
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      fn = std::move(q_.front());
      q_.pop_front();
    }
    fn();
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++ran_;
    }
    cv_.notify_all();
  }
}

void FakeStream::SetError(const Status& st) {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_.ok()) error_ = st;
}

Status FakeStream::Error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

void FakeStream::ClearError() {
  std::lock_guard<std::mutex> lk(mu_);
  error_ = Status::Ok();
}

void Gate::Open() {
  std::lock_guard<std::mutex> lk(mu_);
  open_ = true;
  cv_.notify_all();
}

void Gate::Wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::seconds(60), [&] { return open_; });
}

struct FakeRuntime::FakeEvent {
  std::atomic<uint64_t> recorded{0};
  // Shared with the work queued on streams (the record, StreamWaitEvent's waits), which may
  // run after the event is destroyed.
  std::shared_ptr<std::atomic<uint64_t>> reached = std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<FakeStream*> stream{nullptr};  // where it was last recorded
};

FakeRuntime::FakeRuntime() : hfThread_([this] { HostFnMain(); }) {
  for (int d = 0; d < kDevices; ++d) defaults_[d].reset(new FakeStream(d, false));
}

FakeRuntime::~FakeRuntime() {
  for (auto& d : defaults_) d.reset();
  streams_.clear();
  {
    std::lock_guard<std::mutex> lk(hfMu_);
    hfStop_ = true;
  }
  hfCv_.notify_all();
  hfThread_.join();
  for (auto& kv : device_) std::free(reinterpret_cast<void*>(kv.first));
}

Status FakeRuntime::Refuse(const char* call) {
  if (!t_inHostFn) return Status::Ok();
  ++callsInHostFn;
  return scape::InvalidUsage(scape::StrFormat(
      "fake device: %s called inside a host function (CUDA forbids CUDA calls there)", call));
}

int FakeRuntime::GetDevice() { return t_device; }

void FakeRuntime::SetDevice(int device) {
  if (device >= 0 && device < kDevices) t_device = device;
}

void FakeRuntime::HostFnMain() {
  t_inHostFn = true;
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(hfMu_);
      hfCv_.wait(lk, [&] { return hfStop_ || !hfQ_.empty(); });
      if (hfQ_.empty()) return;
      fn = std::move(hfQ_.front());
      hfQ_.pop_front();
    }
    fn();
  }
}

// On a stream thread: hands fn(arg) to the host-function thread and holds the stream until it
// has returned (as cudaLaunchHostFunc: the stream waits for the host function).
void FakeRuntime::RunOnHostFnThread(scape::device::HostFn fn, void* arg) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  {
    std::lock_guard<std::mutex> lk(hfMu_);
    hfQ_.push_back([&] {
      fn(arg);
      std::lock_guard<std::mutex> dl(m);
      done = true;
      cv.notify_all();
    });
  }
  hfCv_.notify_all();
  std::unique_lock<std::mutex> lk(m);
  cv.wait(lk, [&] { return done; });
}

void FakeRuntime::Submit(Stream s, std::function<void()> fn) { Submit(StreamOf(s), std::move(fn)); }

void FakeRuntime::Submit(FakeStream* st, std::function<void()> fn) {
  // The legacy default stream's implicit synchronisation: the entry first waits for what was
  // queued before it on the streams it synchronises with (blocking streams of its device for
  // the default stream, the default stream for a blocking one; none for non-blocking ones).
  std::lock_guard<std::mutex> order(orderMu_);
  std::vector<std::pair<FakeStream*, uint64_t>> after;
  FakeStream* legacy = defaults_[st->device()].get();
  if (st == legacy) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& o : streams_)
      if (o->blocking() && o->device() == st->device() && !o->Idle())
        after.emplace_back(o.get(), o->Pushed());
  } else if (st->blocking() && !legacy->Idle()) {
    after.emplace_back(legacy, legacy->Pushed());
  }
  if (after.empty()) return st->Push(std::move(fn));
  st->Push([after = std::move(after), fn = std::move(fn)] {
    for (const auto& a : after) a.first->WaitRan(a.second);
    fn();
  });
}

bool FakeRuntime::Pinned(const void* p, size_t bytes) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pinned_.upper_bound(u);
  if (it == pinned_.begin()) return false;
  --it;
  return u >= it->first && u - it->first <= it->second && bytes <= it->second - (u - it->first);
}

void* FakeRuntime::NewHandleLocked(std::vector<void*>* freeList) {
  // As a CUDA runtime may: the handle of a destroyed stream or event, for a new one.
  if (!freeList->empty()) {
    void* h = freeList->back();
    freeList->pop_back();
    return h;
  }
  handleMem_.emplace_back(new char);
  return handleMem_.back().get();
}

PtrKind FakeRuntime::Kind(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = device_.upper_bound(u);
  if (it == device_.begin()) return PtrKind::kHost;
  --it;
  return u < it->first + it->second ? PtrKind::kDevice : PtrKind::kHost;
}

void* FakeRuntime::Register(void* p, size_t bytes) {
  if (!p) return nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  device_[reinterpret_cast<uintptr_t>(p)] = bytes;
  deviceTag_[reinterpret_cast<uintptr_t>(p)] = t_device;
  ++deviceAllocs;
  ++deviceLive;
  return p;
}

void* FakeRuntime::DeviceMalloc(size_t bytes) {
  return Register(std::calloc(bytes ? bytes : 1, 1), bytes ? bytes : 1);
}

Status FakeRuntime::DeviceAlloc(size_t bytes, void** d) {
  SCAPE_RETURN_IF_ERROR(Refuse("DeviceAlloc"));
  if (d == nullptr) return scape::InvalidArgument("fake device: DeviceAlloc: d is null");
  *d = nullptr;
  void* p = std::malloc(bytes ? bytes : 1);
  if (!p) {
    return scape::SystemError(
        scape::StrFormat("fake device: DeviceAlloc: out of memory for %zu bytes", bytes));
  }
  std::memset(p, 0xA5, bytes ? bytes : 1);  // not zero: cudaMalloc memory is uninitialised
  *d = Register(p, bytes ? bytes : 1);
  return Status::Ok();
}

void FakeRuntime::DeviceFree(void* p) {
  if (!p || !Refuse("DeviceFree").ok()) return;
  std::unique_lock<std::shared_mutex> mem(memMu_);  // not while a device op runs on it
  std::lock_guard<std::mutex> lk(mu_);
  if (device_.erase(reinterpret_cast<uintptr_t>(p)) == 0) return;  // not ours: left alone
  deviceTag_.erase(reinterpret_cast<uintptr_t>(p));
  --deviceLive;
  std::free(p);
}

Status FakeRuntime::DeviceAllocAsync(size_t bytes, Stream, void** d) {
  ++tempAllocs;
  return DeviceAlloc(bytes, d);
}

void FakeRuntime::DeviceFreeAsync(void* d, Stream s) {
  if (d) StreamOf(s)->Push([this, d] { DeviceFree(d); });
}

uint64_t FakeRuntime::LiveBytes() {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t b = 0;
  for (const auto& kv : device_) b += kv.second;
  return b;
}

bool FakeRuntime::Extent(const void* p, uintptr_t* base, size_t* bytes) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = device_.upper_bound(u);
  if (it == device_.begin()) return false;
  --it;
  if (u >= it->first + it->second) return false;
  *base = it->first;
  *bytes = it->second;
  return true;
}

Status FakeRuntime::CheckRange(const char* op, const char* arg, const void* p, size_t bytes,
                               size_t align) {
  if (bytes == 0) return Status::Ok();
  if (p == nullptr) {
    return scape::InvalidArgument(
        scape::StrFormat("fake device: %s: %s is null for %zu bytes", op, arg, bytes));
  }
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    return scape::InvalidArgument(scape::StrFormat(
        "fake device: %s: %s (%p) is not aligned to %zu bytes", op, arg, p, align));
  }
  uintptr_t base = 0;
  size_t size = 0;
  if (!Extent(p, &base, &size)) {
    return scape::InvalidArgument(scape::StrFormat(
        "fake device: %s: %s (%p) is not device memory (no live device allocation holds it)", op,
        arg, p));
  }
  int dev = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto t = deviceTag_.find(base);
    dev = t == deviceTag_.end() ? 0 : t->second;
  }
  if (dev != t_device) {
    return scape::InvalidArgument(
        scape::StrFormat("fake device: %s: %s (%p) is memory of device %d, used on device %d", op,
                         arg, p, dev, t_device));
  }
  const uintptr_t off = reinterpret_cast<uintptr_t>(p) - base;
  if (bytes > size - off) {
    return scape::InvalidArgument(scape::StrFormat(
        "fake device: %s: %s (%zu bytes at offset %zu) runs past the end of its %zu-byte device "
        "allocation",
        op, arg, bytes, static_cast<size_t>(off), size));
  }
  return Status::Ok();
}

Status FakeRuntime::HostAlloc(size_t bytes, void** p) {
  SCAPE_RETURN_IF_ERROR(Refuse("HostAlloc"));
  *p = std::malloc(bytes ? bytes : 1);
  ++pinnedAllocs;
  ++pinnedLive;
  std::lock_guard<std::mutex> lk(mu_);
  pinned_[reinterpret_cast<uintptr_t>(*p)] = bytes ? bytes : 1;
  return Status::Ok();
}

void FakeRuntime::HostFree(void* p) {
  if (!p || !Refuse("HostFree").ok()) return;
  --pinnedLive;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pinned_.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

Stream FakeRuntime::NewStream(bool blocking) {
  std::lock_guard<std::mutex> lk(mu_);
  streams_.emplace_back(new FakeStream(t_device, blocking));
  return streams_.back().get();
}

Status FakeRuntime::StreamCreate(Stream* s) {
  SCAPE_RETURN_IF_ERROR(Refuse("StreamCreate"));
  std::lock_guard<std::mutex> lk(mu_);
  streams_.emplace_back(new FakeStream(t_device, false));
  *s = NewHandleLocked(&freeHandles_);
  handles_[*s] = streams_.back().get();
  ++streamsCreated;
  ++streamsLive;
  return Status::Ok();
}

void FakeRuntime::StreamDestroy(Stream s) {
  if (!s || !Refuse("StreamDestroy").ok()) return;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = handles_.find(s);
  if (it == handles_.end()) return;
  // The old stream's thread goes on with its queue (cudaStreamDestroy returns at once and the
  // work completes); its handle is free for the next StreamCreate.
  handles_.erase(it);
  freeHandles_.push_back(s);
  --streamsLive;
}

FakeStream* FakeRuntime::StreamOf(Stream s) {
  if (!s) return defaults_[t_device].get();
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = handles_.find(s);
    if (it != handles_.end()) return it->second;
  }
  return static_cast<FakeStream*>(s);
}

void FakeRuntime::HoldStream(Stream s, Gate* gate) {
  Submit(s, [gate] { gate->Wait(); });
}

Status FakeRuntime::StreamError(Stream s) { return StreamOf(s)->Error(); }

void FakeRuntime::ClearStreamError(Stream s) { StreamOf(s)->ClearError(); }

Status FakeRuntime::UploadStaged(void* dDst, const void* src, size_t bytes, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("UploadStaged"));
  if (bytes == 0) return Status::Ok();
  ++stagedUploads;
  // As the CUDA runtime's page-locked uploads: the source is copied at the call.
  auto snap = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                  static_cast<const char*>(src) + bytes);
  ++h2dCopies;
  copiedBytes += bytes;
  SCAPE_RETURN_IF_ERROR(CheckRange("UploadStaged", "dDst", dDst, bytes));
  FakeStream* st = StreamOf(s);
  Submit(st, [dDst, snap] { std::memcpy(dDst, snap->data(), snap->size()); });
  return Status::Ok();
}

Status FakeRuntime::CopyAsync(void* dst, const void* src, size_t bytes, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("CopyAsync"));
  const bool dd = Kind(dst) != PtrKind::kHost, sd = Kind(src) != PtrKind::kHost;
  if (!dd && sd)
    ++d2hCopies;
  else if (dd && !sd)
    ++h2dCopies;
  else
    ++otherCopies;
  copiedBytes += bytes;
  FakeStream* st = StreamOf(s);
  auto delay = [this] {
    if (int us = copyDelayUs.load()) {
      struct timespec ts = {us / 1000000, (us % 1000000) * 1000L};
      nanosleep(&ts, nullptr);
    }
  };
  if (bytes && sd && !dd && !Pinned(dst, bytes)) {
    // Into pageable memory: returns once the copy has completed.
    ++pageableSyncCopies;
    Submit(st, [delay, dst, src, bytes] {
      delay();
      std::memcpy(dst, src, bytes);
    });
    if (!st->Sync())
      return scape::TimeoutError(
          "fake device: CopyAsync into pageable memory waits for its stream, which did not "
          "drain in 30 s");
    return Status::Ok();
  }
  if (bytes && dd && !sd && !Pinned(src, bytes)) {
    // From pageable memory: CUDA may read the source when the stream reaches the copy. The
    // source must not change (or be freed) before then. (And the driver may make the host wait
    // for the stream first: counted, for the paths documented as having no host wait.)
    ++pageableUploads;
    auto snap = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                    static_cast<const char*>(src) + bytes);
    Submit(st, [delay, st, dst, src, bytes, snap] {
      delay();
      if (std::memcmp(src, snap->data(), bytes) != 0)
        st->SetError(scape::InvalidUsage(scape::StrFormat(
            "fake device: CopyAsync: the pageable source (%p, %zu bytes) changed after the call "
            "returned, before the stream reached the copy (CUDA may copy it only then: keep it "
            "until the copy has run, or use page-locked memory)",
            src, bytes)));
      std::memcpy(dst, src, bytes);
    });
    return Status::Ok();
  }
  Submit(st, [delay, dst, src, bytes] {
    delay();
    std::memcpy(dst, src, bytes);
  });
  return Status::Ok();
}

Status FakeRuntime::EventCreate(scape::device::Event* e) {
  SCAPE_RETURN_IF_ERROR(Refuse("EventCreate"));
  std::lock_guard<std::mutex> lk(mu_);
  *e = NewHandleLocked(&freeEvents_);
  events_[*e] = std::make_shared<FakeEvent>();
  return Status::Ok();
}

void FakeRuntime::EventDestroy(scape::device::Event e) {
  if (!e || !Refuse("EventDestroy").ok()) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (events_.erase(e)) freeEvents_.push_back(e);  // work queued on it keeps `reached`
}

std::shared_ptr<FakeRuntime::FakeEvent> FakeRuntime::EventOf(scape::device::Event e) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = events_.find(e);
  return it == events_.end() ? nullptr : it->second;
}

namespace {
Status NotAnEvent(const char* call, scape::device::Event e) {
  return scape::InvalidArgument(scape::StrFormat(
      "fake device: %s: %p is not a live event (destroyed, or never created)", call, e));
}
}  // namespace

Status FakeRuntime::EventRecord(scape::device::Event e, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("EventRecord"));
  std::shared_ptr<FakeEvent> ev = EventOf(e);
  if (!ev) return NotAnEvent("EventRecord", e);
  const uint64_t gen = ++ev->recorded;
  FakeStream* st = StreamOf(s);
  ev->stream.store(st);
  Submit(st, [reached = ev->reached, gen] { reached->store(gen); });
  return Status::Ok();
}

Status FakeRuntime::StreamWaitEvent(Stream s, scape::device::Event e) {
  SCAPE_RETURN_IF_ERROR(Refuse("StreamWaitEvent"));
  std::shared_ptr<FakeEvent> ev = EventOf(e);
  if (!ev) return NotAnEvent("StreamWaitEvent", e);
  const uint64_t gen = ev->recorded.load();
  ++streamWaits;
  Submit(s, [reached = ev->reached, gen] {
    while (reached->load() < gen) std::this_thread::sleep_for(std::chrono::microseconds(50));
  });
  return Status::Ok();
}

Status FakeRuntime::StreamWaitValue(Stream s, const uint32_t* flag, uint32_t value) {
  SCAPE_RETURN_IF_ERROR(Refuse("StreamWaitValue"));
  if (!Pinned(flag, sizeof *flag))
    return scape::InvalidArgument(
        "fake device: StreamWaitValue: the flag is not page-locked memory from HostAlloc");
  ++valueWaits;
  FakeStream* st = StreamOf(s);
  Submit(st, [st, flag, value] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (static_cast<int32_t>(__atomic_load_n(flag, __ATOMIC_ACQUIRE) - value) < 0) {
      if (std::chrono::steady_clock::now() > until) {
        st->SetError(
            scape::TimeoutError("fake device: StreamWaitValue: the flag was not released in 60 s"));
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  return Status::Ok();
}

Status FakeRuntime::EventQuery(scape::device::Event e, bool* done) {
  SCAPE_RETURN_IF_ERROR(Refuse("EventQuery"));
  std::shared_ptr<FakeEvent> ev = EventOf(e);
  if (!ev) return NotAnEvent("EventQuery", e);
  *done = ev->reached->load() >= ev->recorded.load();
  if (FakeStream* st = ev->stream.load()) {
    Status err = st->Error();  // sticky, as a CUDA kernel fault
    if (!err.ok()) {
      *done = false;
      return err;
    }
  }
  return Status::Ok();
}

Status FakeRuntime::LaunchHostFunc(Stream s, scape::device::HostFn fn, void* arg) {
  SCAPE_RETURN_IF_ERROR(Refuse("LaunchHostFunc"));
  ++hostFuncs;
  Submit(s, [this, fn, arg] { RunOnHostFnThread(fn, arg); });
  return Status::Ok();
}

Status FakeRuntime::StreamSynchronize(Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("StreamSynchronize"));
  ++syncs;
  FakeStream* st = StreamOf(s);
  if (!st->Sync()) return scape::TimeoutError("fake stream did not drain in 30 s");
  return st->Error();
}

bool FakeRuntime::StreamId(Stream s, uint64_t* id) {
  *id = StreamOf(s)->id();
  return true;
}

Status FakeRuntime::StreamQuery(Stream s, bool* done) {
  SCAPE_RETURN_IF_ERROR(Refuse("StreamQuery"));
  FakeStream* st = StreamOf(s);
  *done = st->Idle();
  Status err = st->Error();
  if (!err.ok()) *done = false;
  return err;
}

// ---- device ops --------------------------------------------------------------------------------

void FakeRuntime::HoldAfterNextOp(const char* op, Gate* gate) {
  std::lock_guard<std::mutex> lk(holdMu_);
  holdOp_ = op;
  holdGate_ = gate;
}

void FakeRuntime::Enqueue(Stream s, const char* op, std::function<Status()> fn) {
  ++kernelLaunches;
  Gate* hold = nullptr;
  {
    std::lock_guard<std::mutex> lk(holdMu_);
    if (holdGate_ && holdOp_ == op) {
      hold = holdGate_;
      holdGate_ = nullptr;
      holdOp_.clear();
    }
  }
  if (hold) {
    // The op, then the gate behind it on the same stream.
    Enqueue(s, op, std::move(fn));
    HoldStream(s, hold);
    return;
  }
  FakeStream* st = StreamOf(s);
  Submit(st, [this, st, op, fn = std::move(fn)] {
    if (!st->Error().ok()) {
      ++skippedOps;
      return;
    }
    Status r;
    int inject = failNextOps.load();
    while (inject > 0 && !failNextOps.compare_exchange_weak(inject, inject - 1)) {
    }
    if (inject > 0) {
      r = scape::SystemError("an injected device fault (failNextOps)");
    } else {
      std::shared_lock<std::shared_mutex> mem(memMu_);
      r = fn();
    }
    if (!r.ok()) {
      ++failedOps;
      st->SetError(Status(
          r.code(), std::string("fake device: ") + op + " failed on the stream: " + r.message()));
    }
  });
}

namespace {

// A kernel's status on the stream thread, with what in the device data it may be about.
Status KernelResult(kn::KernelStatus k, const char* about) {
  if (k == kn::KernelStatus::kOk) return Status::Ok();
  return Status(kn::ToResult(k), std::string(kn::KernelStatusString(k)) + " (" + about + ")");
}

Status CheckEsz(const char* op, size_t esz) {
  if (esz == 1 || esz == 2 || esz == 4 || esz == 8) return Status::Ok();
  return scape::InvalidArgument(
      scape::StrFormat("fake device: %s: element size esz = %zu is not 1, 2, 4 or 8", op, esz));
}

Status CheckPayloadType(const char* op, scapeDataType_t t, size_t* esz) {
  *esz = kn::PayloadElementSize(t);
  if (*esz) return Status::Ok();
  return scape::Unsupported(scape::StrFormat(
      "fake device: %s: payloadType %d is not scapeFloat32, scapeBfloat16 or scapeFloat16", op,
      static_cast<int>(t)));
}

Status CheckGradScale(const char* op, float gradScale) {
  if (gradScale > 0.0f && gradScale <= 1.0f) return Status::Ok();
  return scape::InvalidArgument(
      scape::StrFormat("fake device: %s: gradScale = %g is not in (0, 1]", op, gradScale));
}

Status CheckKn(const char* op, size_t k, size_t n) {
  if (k <= n) return Status::Ok();
  return scape::InvalidArgument(
      scape::StrFormat("fake device: %s: k = %zu entries in the mask > n = %zu", op, k, n));
}

}  // namespace

Status FakeRuntime::Memset(void* d, int value, size_t bytes, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("Memset"));
  SCAPE_RETURN_IF_ERROR(CheckRange("Memset", "d", d, bytes));
  if (bytes == 0) return Status::Ok();
  ++memsets;
  Enqueue(s, "Memset", [this, d, value, bytes] {
    SCAPE_RETURN_IF_ERROR(CheckRange("Memset", "d (freed before the op ran?)", d, bytes));
    std::memset(d, value, bytes);
    return Status::Ok();
  });
  return Status::Ok();
}

// Gather and Scatter: the dense side's extent is known only from the indices (device data),
// so it is checked on the stream thread, before anything is written.
Status FakeRuntime::Gather(const void* dDense, const uint64_t* dIdx, size_t k, size_t esz,
                           void* dPacked, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("Gather"));
  SCAPE_RETURN_IF_ERROR(CheckEsz("Gather", esz));
  if (k == 0) return Status::Ok();
  if (k > SIZE_MAX / 8) return scape::InvalidArgument("fake device: Gather: k is too large");
  SCAPE_RETURN_IF_ERROR(CheckRange("Gather", "dIdx", dIdx, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange("Gather", "dPacked", dPacked, k * esz, esz));
  SCAPE_RETURN_IF_ERROR(CheckRange("Gather", "dDense", dDense, esz, esz));
  ++gathers;
  Enqueue(s, "Gather", [this, dDense, dIdx, k, esz, dPacked] {
    SCAPE_RETURN_IF_ERROR(CheckRange("Gather", "dIdx", dIdx, k * 8, 8));
    SCAPE_RETURN_IF_ERROR(CheckRange("Gather", "dPacked", dPacked, k * esz, esz));
    uintptr_t base = 0;
    size_t size = 0;
    if (!Extent(dDense, &base, &size)) {
      return scape::InvalidArgument("dDense was freed before the op ran");
    }
    const uint64_t room = (size - (reinterpret_cast<uintptr_t>(dDense) - base)) / esz;
    for (size_t i = 0; i < k; ++i)
      if (dIdx[i] >= room) {
        return scape::InvalidArgument(scape::StrFormat(
            "dIdx[%zu] = %llu is outside dDense (%llu elements of %zu bytes up to the end of its "
            "allocation)",
            i, static_cast<unsigned long long>(dIdx[i]), static_cast<unsigned long long>(room),
            esz));
      }
    kn::GatherByIndex(dDense, dIdx, k, esz, dPacked);
    return Status::Ok();
  });
  return Status::Ok();
}

Status FakeRuntime::Scatter(const void* dPacked, const uint64_t* dIdx, size_t k, size_t esz,
                            void* dDense, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("Scatter"));
  SCAPE_RETURN_IF_ERROR(CheckEsz("Scatter", esz));
  if (k == 0) return Status::Ok();
  if (k > SIZE_MAX / 8) return scape::InvalidArgument("fake device: Scatter: k is too large");
  SCAPE_RETURN_IF_ERROR(CheckRange("Scatter", "dIdx", dIdx, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange("Scatter", "dPacked", dPacked, k * esz, esz));
  SCAPE_RETURN_IF_ERROR(CheckRange("Scatter", "dDense", dDense, esz, esz));
  ++scatters;
  Enqueue(s, "Scatter", [this, dDense, dIdx, k, esz, dPacked] {
    SCAPE_RETURN_IF_ERROR(CheckRange("Scatter", "dIdx", dIdx, k * 8, 8));
    SCAPE_RETURN_IF_ERROR(CheckRange("Scatter", "dPacked", dPacked, k * esz, esz));
    uintptr_t base = 0;
    size_t size = 0;
    if (!Extent(dDense, &base, &size)) {
      return scape::InvalidArgument("dDense was freed before the op ran");
    }
    const uint64_t room = (size - (reinterpret_cast<uintptr_t>(dDense) - base)) / esz;
    for (size_t i = 0; i < k; ++i)
      if (dIdx[i] >= room) {
        return scape::InvalidArgument(scape::StrFormat(
            "dIdx[%zu] = %llu is outside dDense (%llu elements of %zu bytes up to the end of its "
            "allocation)",
            i, static_cast<unsigned long long>(dIdx[i]), static_cast<unsigned long long>(room),
            esz));
      }
    kn::ScatterByIndex(dPacked, dIdx, k, esz, dDense);
    return Status::Ok();
  });
  return Status::Ok();
}

// The host-side checks of a top-k segment table (the CPU kernel's argument errors, which the
// CUDA kernel cannot see in a device table): the same rules as runtime_cuda.cc.
static Status CheckTopkTable(const kn::TopkSegments& sg, const kn::TopkOptions& o) {
  if (o.mode != kn::TopkMode::kExact && o.mode != kn::TopkMode::kSampled) {
    return scape::InvalidArgument(scape::StrFormat(
        "fake device: TopkAbs: options.mode = %d is neither exact nor sampled", int(o.mode)));
  }
  if (o.mode == kn::TopkMode::kSampled &&
      (o.sample_size < 1 || o.sample_size > kn::topk::kMaxSampleSize)) {
    return scape::InvalidArgument(
        scape::StrFormat("fake device: TopkAbs: options.sample_size = %u is not in [1, %u]",
                         o.sample_size, kn::topk::kMaxSampleSize));
  }
  if (sg.nseg == 0) return Status::Ok();
  if (!sg.offsets || !sg.k || !sg.out_offsets) {
    return scape::InvalidArgument(
        "fake device: TopkAbs: segments.offsets, .k or .out_offsets is null");
  }
  for (size_t i = 0; i < sg.nseg; ++i) {
    if (sg.offsets[i + 1] < sg.offsets[i] || sg.out_offsets[i + 1] < sg.out_offsets[i]) {
      return scape::InvalidArgument(scape::StrFormat(
          "fake device: TopkAbs: segments.offsets or .out_offsets descend at segment %zu", i));
    }
    const uint64_t len = sg.offsets[i + 1] - sg.offsets[i];
    if (sg.k[i] > len) {
      return scape::InvalidArgument(scape::StrFormat(
          "fake device: TopkAbs: segments.k[%zu] = %llu > its length %llu", i,
          static_cast<unsigned long long>(sg.k[i]), static_cast<unsigned long long>(len)));
    }
    if (o.mode == kn::TopkMode::kExact && sg.out_offsets[i + 1] - sg.out_offsets[i] < sg.k[i]) {
      return scape::InvalidArgument(scape::StrFormat(
          "fake device: TopkAbs: segment %zu's output capacity %llu < k = %llu", i,
          static_cast<unsigned long long>(sg.out_offsets[i + 1] - sg.out_offsets[i]),
          static_cast<unsigned long long>(sg.k[i])));
    }
  }
  if (o.mode == kn::TopkMode::kSampled && sg.offsets[sg.nseg] >= kn::topk::kMaxSampledPosition) {
    return scape::InvalidArgument(
        "fake device: TopkAbs: sampled mode needs every position below 2^43");
  }
  return Status::Ok();
}

Status FakeRuntime::TopkAbs(const float* dX, const kn::TopkSegments& segments,
                            const kn::TopkOptions& options, uint64_t* dOut, uint64_t* dCounts,
                            Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("TopkAbs"));
  SCAPE_RETURN_IF_ERROR(CheckTopkTable(segments, options));
  const size_t nseg = segments.nseg;
  if (nseg == 0) return Status::Ok();
  const uint64_t x0 = segments.offsets[0], x1 = segments.offsets[nseg];
  const uint64_t o0 = segments.out_offsets[0], o1 = segments.out_offsets[nseg];
  SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dX (offsets[0] .. offsets[nseg])", dX + x0,
                                   (x1 - x0) * sizeof(float), sizeof(float)));
  SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dOut (out_offsets[0] .. out_offsets[nseg])",
                                   dOut + o0, (o1 - o0) * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dCounts", dCounts, nseg * 8, 8));
  ++topks;
  // The table is host memory the caller may reuse at once: the op keeps its own copy (the CUDA
  // runtime uploads it at the call).
  auto off = std::make_shared<std::vector<uint64_t>>(segments.offsets, segments.offsets + nseg + 1);
  auto kk = std::make_shared<std::vector<uint64_t>>(segments.k, segments.k + nseg);
  auto oo = std::make_shared<std::vector<uint64_t>>(segments.out_offsets,
                                                    segments.out_offsets + nseg + 1);
  kn::TopkOptions opt = options;
  opt.max_threads = kernelThreads.load();
  // The CUDA form's temporary (its device segment table; its scratch is not modelled).
  scape::device::OpTemp temp(this, s);
  void* dTemp = nullptr;
  const size_t tempBytes = 8 * (3 * nseg + 2);
  SCAPE_RETURN_IF_ERROR(temp.Alloc("fake device: TopkAbs", tempBytes, &dTemp));
  Enqueue(s, "TopkAbs", [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "its temporary (freed?)", dTemp, tempBytes));
    SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dX (freed?)", dX + x0, (x1 - x0) * sizeof(float)));
    SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dOut (freed?)", dOut + o0, (o1 - o0) * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange("TopkAbs", "dCounts (freed?)", dCounts, nseg * 8));
    kn::TopkSegments sg;
    sg.offsets = off->data();
    sg.k = kk->data();
    sg.out_offsets = oo->data();
    sg.nseg = nseg;
    return KernelResult(kn::TopkAbs(dX, sg, opt, dOut, dCounts), "the top-k kernel");
  });
  return Status::Ok();
}

Status FakeRuntime::CandidatePackResidual(const float* dM, const float* dG, float* dE, size_t n,
                                          float beta1, const uint64_t* dMask, size_t k,
                                          scapeDataType_t payloadType, void* dPayload, float* dCOut,
                                          Stream s, float gradScale) {
  SCAPE_RETURN_IF_ERROR(Refuse("CandidatePackResidual"));
  const char* op = "CandidatePackResidual";
  SCAPE_RETURN_IF_ERROR(CheckGradScale(op, gradScale));
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: CandidatePackResidual: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG", dG, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dE", dE, n * 4, 4));
  if (dCOut) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCOut", dCOut, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  ++candidates;
  const int threads = kernelThreads.load();
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG (freed?)", dG, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dE (freed?)", dE, n * 4));
    if (dCOut) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCOut (freed?)", dCOut, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    return KernelResult(
        kn::CandidatePackResidual(dM, dG, dE, n, beta1, dMask, k, payloadType, dPayload, dCOut,
                                  threads, /*keep_rounding=*/true, gradScale),
        "dMask not strictly increasing, or an entry >= n");
  });
  return Status::Ok();
}

Status FakeRuntime::UnpackAdamSUpdate(const void* dPayload, scapeDataType_t payloadType,
                                      const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                      size_t n, const kn::AdamSParams& params, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("UnpackAdamSUpdate"));
  const char* op = "UnpackAdamSUpdate";
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  kn::AdamSScalars sc;
  if (kn::MakeAdamSScalars(params, &sc) != kn::KernelStatus::kOk) {
    return scape::InvalidArgument(scape::StrFormat(
        "fake device: %s: bad AdamS parameters (lr %g, beta1 %g, beta2 %g, eps %g, wd %g, clip "
        "%g, bias correction %d, step %lld)",
        op, params.lr, params.beta1, params.beta2, params.eps, params.weight_decay,
        params.clip_scale, static_cast<int>(params.bias_correction),
        static_cast<long long>(params.step)));
  }
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: UnpackAdamSUpdate: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta", dTheta, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  ++updates;
  const int threads = kernelThreads.load();
  // The "segment_rms" table is host memory: copied now, as the CUDA runtime uploads it.
  std::vector<uint64_t> enterOff;
  std::vector<float> enterVs;
  if (params.enter_vs != nullptr) {
    if (params.enter_offsets == nullptr || params.enter_nseg == 0)
      return scape::InvalidArgument("fake device: UnpackAdamSUpdate: enter_vs without offsets");
    enterOff.assign(params.enter_offsets, params.enter_offsets + params.enter_nseg + 1);
    enterVs.assign(params.enter_vs, params.enter_vs + params.enter_nseg);
    ++enteringUpdates;
  }
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta (freed?)", dTheta, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    kn::AdamSParams p = params;
    if (!enterVs.empty()) {
      p.enter_offsets = enterOff.data();
      p.enter_vs = enterVs.data();
    }
    return KernelResult(
        kn::UnpackAdamSUpdate(dPayload, payloadType, dMask, k, dTheta, dM, n, p, threads),
        "dMask not strictly increasing, an entry >= n, or a bad enter table");
  });
  return Status::Ok();
}

Status FakeRuntime::CandidatePackResidualGrad(const float* dM, const void* dG,
                                              scapeDataType_t gradType, float* dE, size_t n,
                                              float beta1, const uint64_t* dMask, size_t k,
                                              scapeDataType_t payloadType, void* dPayload,
                                              float* dCOut, Stream s, float gradScale) {
  SCAPE_RETURN_IF_ERROR(Refuse("CandidatePackResidualGrad"));
  if (gradType == scapeFloat32)
    return CandidatePackResidual(dM, static_cast<const float*>(dG), dE, n, beta1, dMask, k,
                                 payloadType, dPayload, dCOut, s, gradScale);
  const char* op = "CandidatePackResidualGrad";
  SCAPE_RETURN_IF_ERROR(CheckGradScale(op, gradScale));
  if (gradType != scapeBfloat16 && gradType != scapeFloat16)
    return scape::Status(scapeUnsupported,
                         scape::StrFormat("fake device: %s: gradType = %d: expected fp32, bf16 "
                                          "or fp16",
                                          op, static_cast<int>(gradType)));
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: CandidatePackResidualGrad: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG", dG, n * 2, 2));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dE", dE, n * 4, 4));
  if (dCOut) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCOut", dCOut, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  ++candidates;
  const int threads = kernelThreads.load();
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG (freed?)", dG, n * 2));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dE (freed?)", dE, n * 4));
    if (dCOut) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCOut (freed?)", dCOut, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    // The CUDA kernel widens each gradient as it reads it; widening is exact, so widening
    // first gives the same bits.
    std::vector<float> g(n);
    if (gradType == scapeBfloat16)
      kn::ConvertBf16ToFloat(static_cast<const uint16_t*>(dG), g.data(), n);
    else
      kn::ConvertFp16ToFloat(static_cast<const uint16_t*>(dG), g.data(), n);
    return KernelResult(kn::CandidatePackResidual(dM, g.data(), dE, n, beta1, dMask, k, payloadType,
                                                  dPayload, dCOut, threads,
                                                  /*keep_rounding=*/true, gradScale),
                        "dMask not strictly increasing, or an entry >= n");
  });
  return Status::Ok();
}

Status FakeRuntime::UnpackAdamSUpdateCopy(const void* dPayload, scapeDataType_t payloadType,
                                          const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                          size_t n, const kn::AdamSParams& params, void* dCopy,
                                          scapeDataType_t copyType, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("UnpackAdamSUpdateCopy"));
  const char* op = "UnpackAdamSUpdateCopy";
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  if (copyType != scapeBfloat16 && copyType != scapeFloat16)
    return scape::Status(scapeUnsupported,
                         scape::StrFormat("fake device: %s: copyType = %d: expected bf16 or fp16",
                                          op, static_cast<int>(copyType)));
  kn::AdamSScalars sc;
  if (kn::MakeAdamSScalars(params, &sc) != kn::KernelStatus::kOk)
    return scape::InvalidArgument(scape::StrFormat("fake device: %s: bad AdamS parameters", op));
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: UnpackAdamSUpdateCopy: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta", dTheta, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCopy", dCopy, n * 2, 2));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  ++updates;
  const int threads = kernelThreads.load();
  // The "segment_rms" table is host memory: copied now, as the CUDA runtime uploads it.
  std::vector<uint64_t> enterOff;
  std::vector<float> enterVs;
  if (params.enter_vs != nullptr) {
    if (params.enter_offsets == nullptr || params.enter_nseg == 0)
      return scape::InvalidArgument("fake device: UnpackAdamSUpdateCopy: enter_vs without offsets");
    enterOff.assign(params.enter_offsets, params.enter_offsets + params.enter_nseg + 1);
    enterVs.assign(params.enter_vs, params.enter_vs + params.enter_nseg);
    ++enteringUpdates;
  }
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta (freed?)", dTheta, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCopy (freed?)", dCopy, n * 2));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    kn::ModelCopy c;
    c.p = dCopy;
    c.type = copyType;
    kn::AdamSParams p = params;
    p.enter_offsets = enterVs.empty() ? nullptr : enterOff.data();
    p.enter_vs = enterVs.empty() ? nullptr : enterVs.data();
    return KernelResult(
        kn::UnpackAdamSUpdate(dPayload, payloadType, dMask, k, dTheta, dM, n, p, threads, &c),
        "dMask not strictly increasing, an entry >= n, or a bad enter table");
  });
  return Status::Ok();
}

Status FakeRuntime::AdamSUpdatePairs(const void* dPayload, scapeDataType_t payloadType,
                                     const uint64_t* dIdx, size_t k, const float* dTheta,
                                     const float* dM, size_t n, const kn::AdamSParams& params,
                                     float* dPairs, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("AdamSUpdatePairs"));
  const char* op = "AdamSUpdatePairs";
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  kn::AdamSScalars sc;
  if (kn::MakeAdamSScalars(params, &sc) != kn::KernelStatus::kOk)
    return scape::InvalidArgument(scape::StrFormat("fake device: %s: bad AdamS parameters", op));
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (params.enter_vs != nullptr && (params.enter_offsets == nullptr || params.enter_nseg == 0))
    return scape::InvalidArgument("fake device: AdamSUpdatePairs: enter_vs without offsets");
  if (k == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: AdamSUpdatePairs: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta", dTheta, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dIdx", dIdx, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPairs", dPairs, k * 8, 4));
  ++pairUpdates;
  const int threads = kernelThreads.load();
  // The "segment_rms" table is host memory: copied now, as the CUDA runtime uploads it.
  std::vector<uint64_t> enterOff;
  std::vector<float> enterVs;
  if (params.enter_vs != nullptr) {
    enterOff.assign(params.enter_offsets, params.enter_offsets + params.enter_nseg + 1);
    enterVs.assign(params.enter_vs, params.enter_vs + params.enter_nseg);
    ++enteringUpdates;
  }
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta (freed?)", dTheta, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dIdx (freed?)", dIdx, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPairs (freed?)", dPairs, k * 8));
    kn::AdamSParams p = params;
    p.enter_offsets = enterVs.empty() ? nullptr : enterOff.data();
    p.enter_vs = enterVs.empty() ? nullptr : enterVs.data();
    const char* about = "dIdx with a repeated entry, an entry >= n, or a bad enter table";
    if (std::is_sorted(dIdx, dIdx + k))
      return KernelResult(
          kn::AdamSUpdatePairs(dPayload, payloadType, dIdx, k, dTheta, dM, n, p, dPairs, threads),
          about);
    // The op takes the positions in any order (as the CUDA kernel does; every pair depends on
    // its own entry only), the host kernel sorted ones: run it on the entries sorted by
    // position, with their payload values, and put the pairs back in entry order.
    std::vector<size_t> order(k);
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return dIdx[a] < dIdx[b]; });
    std::vector<uint64_t> idx(k);
    std::vector<uint8_t> pay(k * esz);
    for (size_t j = 0; j < k; ++j) {
      idx[j] = dIdx[order[j]];
      std::memcpy(pay.data() + j * esz, static_cast<const uint8_t*>(dPayload) + order[j] * esz,
                  esz);
    }
    std::vector<float> pairs(2 * k);
    SCAPE_RETURN_IF_ERROR(
        KernelResult(kn::AdamSUpdatePairs(pay.data(), payloadType, idx.data(), k, dTheta, dM, n, p,
                                          pairs.data(), threads),
                     about));
    for (size_t j = 0; j < k; ++j) {
      dPairs[2 * order[j]] = pairs[2 * j];
      dPairs[2 * order[j] + 1] = pairs[2 * j + 1];
    }
    return Status::Ok();
  });
  return Status::Ok();
}

Status FakeRuntime::UnpackPairsDecay(const float* dPairs, const uint64_t* dMask, size_t k,
                                     float* dTheta, float* dM, size_t n,
                                     const kn::AdamSParams& params, void* dCopy,
                                     scapeDataType_t copyType, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("UnpackPairsDecay"));
  const char* op = "UnpackPairsDecay";
  if (dCopy && copyType != scapeBfloat16 && copyType != scapeFloat16)
    return scape::Status(scapeUnsupported,
                         scape::StrFormat("fake device: %s: copyType = %d: expected bf16 or fp16",
                                          op, static_cast<int>(copyType)));
  kn::AdamSScalars sc;
  if (kn::MakeAdamSScalars(params, &sc) != kn::KernelStatus::kOk)
    return scape::InvalidArgument(scape::StrFormat("fake device: %s: bad AdamS parameters", op));
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n == 0) return Status::Ok();
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: UnpackPairsDecay: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta", dTheta, n * 4, 4));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
  if (dCopy) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCopy", dCopy, n * 2, 2));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPairs", dPairs, k * 8, 4));
  ++pairUnpacks;
  const int threads = kernelThreads.load();
  kn::AdamSParams p = params;  // the enter table is not used (nor kept: it is host memory)
  p.enter_offsets = nullptr;
  p.enter_vs = nullptr;
  p.enter_nseg = 0;
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dTheta (freed?)", dTheta, n * 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
    if (dCopy) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCopy (freed?)", dCopy, n * 2));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPairs (freed?)", dPairs, k * 8));
    // The sorted mask as a view of one run.
    kn::MaskRun run{0, n, 0, k, 0};
    kn::MaskView view;
    view.idx = dMask;
    view.k = k;
    view.runs = &run;
    view.nruns = 1;
    kn::ModelCopy c;
    c.p = dCopy;
    c.type = copyType;
    return KernelResult(kn::UnpackPairsDecayView(dPairs, view, dTheta, dM, n, p, threads,
                                                 /*keep_m_outside=*/false, dCopy ? &c : nullptr),
                        "dMask not strictly increasing, or an entry >= n");
  });
  return Status::Ok();
}

Status FakeRuntime::RecoveredGradSqNorm(const void* dPayload, scapeDataType_t payloadType,
                                        const uint64_t* dMask, size_t k, const float* dM, size_t n,
                                        float beta1, double* dSqNorm, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("RecoveredGradSqNorm"));
  const char* op = "RecoveredGradSqNorm";
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) {
    return scape::InvalidArgument(
        scape::StrFormat("fake device: %s: beta1 = %g is not in [0, 1)", op, beta1));
  }
  SCAPE_RETURN_IF_ERROR(CheckKn(op, k, n));
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: RecoveredGradSqNorm: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSqNorm", dSqNorm, sizeof(double), sizeof(double)));
  if (k > 0) {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask", dMask, k * 8, 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, k * esz, esz));
  }
  ++norms;
  const int threads = kernelThreads.load();
  // The CUDA form's temporary (the blocks' partial sums).
  scape::device::OpTemp temp(this, s);
  void* dTemp = nullptr;
  const size_t tempBytes = 8 * (k / 1024 + 1);
  SCAPE_RETURN_IF_ERROR(temp.Alloc("fake device: RecoveredGradSqNorm", tempBytes, &dTemp));
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "its temporary (freed?)", dTemp, tempBytes));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSqNorm (freed?)", dSqNorm, sizeof(double)));
    if (k > 0) {
      SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM (freed?)", dM, n * 4));
      SCAPE_RETURN_IF_ERROR(CheckRange(op, "dMask (freed?)", dMask, k * 8));
      SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload (freed?)", dPayload, k * esz));
    }
    double r = 0.0;
    SCAPE_RETURN_IF_ERROR(KernelResult(
        kn::RecoveredGradSqNorm(dPayload, payloadType, dMask, k, dM, n, beta1, &r, threads),
        "dMask not strictly increasing, or an entry >= n"));
    std::memcpy(dSqNorm, &r, sizeof r);
    return Status::Ok();
  });
  return Status::Ok();
}

Status FakeRuntime::GradSqNorm(const void* dG, scapeDataType_t gradType, size_t n, double* dSqNorm,
                               Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("GradSqNorm"));
  const char* op = "GradSqNorm";
  if (gradType != scapeFloat32 && gradType != scapeBfloat16 && gradType != scapeFloat16)
    return scape::Status(scapeUnsupported, "fake device: GradSqNorm: gradType");
  const size_t esz = gradType == scapeFloat32 ? 4 : 2;
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: GradSqNorm: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSqNorm", dSqNorm, sizeof(double), sizeof(double)));
  if (n > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG", dG, n * esz, esz));
  ++localNorms;
  const int threads = kernelThreads.load();
  // The CUDA form's temporary (the blocks' partial sums).
  scape::device::OpTemp temp(this, s);
  void* dTemp = nullptr;
  const size_t tempBytes = 8 * (n / 1024 + 1);
  SCAPE_RETURN_IF_ERROR(temp.Alloc("fake device: GradSqNorm", tempBytes, &dTemp));
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "its temporary (freed?)", dTemp, tempBytes));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSqNorm (freed?)", dSqNorm, sizeof(double)));
    if (n > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dG (freed?)", dG, n * esz));
    double r = 0.0;
    SCAPE_RETURN_IF_ERROR(
        KernelResult(kn::GradSqNorm(dG, gradType, n, &r, threads), "the gradient norm"));
    std::memcpy(dSqNorm, &r, sizeof r);
    return Status::Ok();
  });
  return Status::Ok();
}

Status FakeRuntime::AnyNonFinite(const void* dX, size_t n, scapeDataType_t type, uint32_t* dFlag,
                                 Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("AnyNonFinite"));
  const char* op = "AnyNonFinite";
  if (type != scapeFloat32 && type != scapeBfloat16 && type != scapeFloat16)
    return scape::InvalidArgument("fake device: AnyNonFinite: type");
  const size_t esz = type == scapeFloat32 ? 4 : 2;
  if (n > SIZE_MAX / 4) return scape::InvalidArgument("fake device: AnyNonFinite: n");
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dFlag", dFlag, 4, 4));
  if (n > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dX", dX, n * esz, esz));
  const int threads = kernelThreads.load();
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dFlag (freed?)", dFlag, 4));
    if (n > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dX (freed?)", dX, n * esz));
    size_t first = n;
    SCAPE_RETURN_IF_ERROR(KernelResult(
        esz == 4 ? kn::FirstNonFinite(static_cast<const float*>(dX), n, &first, threads)
                 : kn::FirstNonFinite16(static_cast<const uint16_t*>(dX), n,
                                        type == scapeBfloat16 ? 0x7f80 : 0x7c00, &first),
        "dX"));
    const uint32_t f = first < n ? 1u : 0u;
    std::memcpy(dFlag, &f, 4);
    return Status::Ok();
  });
  return Status::Ok();
}

Status FakeRuntime::PayloadAmax(const float* dX, size_t k, float* dAmax, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("PayloadAmax"));
  const char* op = "PayloadAmax";
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dAmax", dAmax, 4, 4));
  if (k > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dX", dX, k * 4, 4));
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dAmax (freed?)", dAmax, 4));
    if (k > 0) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dX (freed?)", dX, k * 4));
    return KernelResult(kn::PayloadAmax(dX, k, dAmax), "dX");
  });
  return Status::Ok();
}

Status FakeRuntime::QuantizeScaled(const float* dX, size_t k, scapeDataType_t type,
                                   const float* dAmax, int nranks, void* dQ, const uint64_t* dPos,
                                   float* dResidual, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("QuantizeScaled"));
  const char* op = "QuantizeScaled";
  if (!scape::dtypes::IsScaled(type))
    return scape::InvalidArgument("fake device: QuantizeScaled: type");
  const size_t esz = scape::dtypes::Size(type);
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dAmax", dAmax, 4, 4));
  if (k > 0) {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dX", dX, k * 4, 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dQ", dQ, k * esz, esz));
    if (dResidual) SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPos", dPos, k * 8, 8));
  }
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dAmax (freed?)", dAmax, 4));
    float amax;
    std::memcpy(&amax, dAmax, 4);
    // The residual's positions are the caller's: checked as the device would not, one by one.
    if (dResidual)
      for (size_t j = 0; j < k; ++j)
        SCAPE_RETURN_IF_ERROR(CheckRange(op, "dResidual[dPos[j]]", dResidual + dPos[j], 4, 4));
    return KernelResult(kn::QuantizeScaled(dX, k, type, amax, nranks, dQ, dPos, dResidual), "dX");
  });
  return Status::Ok();
}

Status FakeRuntime::DequantizeScaled(const void* dQ, size_t k, scapeDataType_t type,
                                     const float* dAmax, int nranks, float* dOut, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("DequantizeScaled"));
  const char* op = "DequantizeScaled";
  if (!scape::dtypes::IsScaled(type))
    return scape::InvalidArgument("fake device: DequantizeScaled: type");
  const size_t esz = scape::dtypes::Size(type);
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dAmax", dAmax, 4, 4));
  if (k > 0) {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dQ", dQ, k * esz, esz));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dOut", dOut, k * 4, 4));
  }
  Enqueue(s, op, [=] {
    float amax;
    std::memcpy(&amax, dAmax, 4);
    return KernelResult(kn::DequantizeScaled(dQ, k, type, amax, nranks, dOut), "dQ");
  });
  return Status::Ok();
}

Status FakeRuntime::StayingGradSqBlocks(const void* dPayload, scapeDataType_t payloadType,
                                        const uint64_t* dIdx, const float* dM, size_t n,
                                        float beta1, const uint64_t* bounds, size_t nb,
                                        double* dSums, uint64_t* dCounts, Stream s) {
  SCAPE_RETURN_IF_ERROR(Refuse("StayingGradSqBlocks"));
  const char* op = "StayingGradSqBlocks";
  size_t esz = 0;
  SCAPE_RETURN_IF_ERROR(CheckPayloadType(op, payloadType, &esz));
  if (nb == 0) return Status::Ok();
  if (bounds == nullptr) return scape::InvalidArgument("fake device: StayingGradSqBlocks: bounds");
  if (n > SIZE_MAX / 8) return scape::InvalidArgument("fake device: StayingGradSqBlocks: n");
  std::vector<uint64_t> bd(bounds, bounds + nb + 1);
  const uint64_t j1 = bd[nb];
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSums", dSums, nb * 8, 8));
  SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCounts", dCounts, nb * 8, 8));
  if (j1 > 0) {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dM", dM, n * 4, 4));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dIdx", dIdx, j1 * 8, 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dPayload", dPayload, j1 * esz, esz));
  }
  ++stayingSums;
  const int threads = kernelThreads.load();
  Enqueue(s, op, [=] {
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dSums (freed?)", dSums, nb * 8));
    SCAPE_RETURN_IF_ERROR(CheckRange(op, "dCounts (freed?)", dCounts, nb * 8));
    return KernelResult(kn::StayingGradSqBlocks(dPayload, payloadType, dIdx, dM, n, beta1,
                                                bd.data(), nb, dSums, dCounts, threads),
                        "bad block bounds, or an index >= n");
  });
  return Status::Ok();
}

FakeRuntime& InstalledFake() {
  static FakeRuntime* rt = [] {
    auto* f = new FakeRuntime();
    scape::device::SetRuntimeForTesting(f);
    return f;
  }();
  return *rt;
}

}  // namespace fake_device
