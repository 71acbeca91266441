// The CPU fake of the device runtime: see fake_device.h.
#include "tests/device/fake_device.h"

#include <time.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

namespace fake_device {

using scape::Status;
using scape::device::PtrKind;
using scape::device::Stream;

FakeStream::FakeStream() : th_([this] { Main(); }) {}

FakeStream::~FakeStream() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  th_.join();
}

void FakeStream::Push(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
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

void FakeStream::Main() {
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

void Gate::Open() {
  std::lock_guard<std::mutex> lk(mu_);
  open_ = true;
  cv_.notify_all();
}

void Gate::Wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::seconds(60), [&] { return open_; });
}

namespace {
struct FakeEvent {
  std::atomic<uint64_t> recorded{0}, reached{0};
};
}  // namespace

FakeRuntime::FakeRuntime() : default_(new FakeStream()) {}

FakeRuntime::~FakeRuntime() {
  default_.reset();
  streams_.clear();
  for (auto& kv : device_) std::free(reinterpret_cast<void*>(kv.first));
}

PtrKind FakeRuntime::Kind(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = device_.upper_bound(u);
  if (it == device_.begin()) return PtrKind::kHost;
  --it;
  return u < it->first + it->second ? PtrKind::kDevice : PtrKind::kHost;
}

void* FakeRuntime::DeviceMalloc(size_t bytes) {
  void* p = std::calloc(bytes ? bytes : 1, 1);
  std::lock_guard<std::mutex> lk(mu_);
  device_[reinterpret_cast<uintptr_t>(p)] = bytes ? bytes : 1;
  return p;
}

void FakeRuntime::DeviceFree(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lk(mu_);
  device_.erase(reinterpret_cast<uintptr_t>(p));
  std::free(p);
}

Status FakeRuntime::HostAlloc(size_t bytes, void** p) {
  *p = std::malloc(bytes ? bytes : 1);
  ++pinnedAllocs;
  ++pinnedLive;
  return Status::Ok();
}

void FakeRuntime::HostFree(void* p) {
  --pinnedLive;
  std::free(p);
}

Stream FakeRuntime::NewStream() {
  std::lock_guard<std::mutex> lk(mu_);
  streams_.emplace_back(new FakeStream());
  return streams_.back().get();
}

FakeStream* FakeRuntime::StreamOf(Stream s) {
  return s ? static_cast<FakeStream*>(s) : default_.get();
}

void FakeRuntime::HoldStream(Stream s, Gate* gate) {
  StreamOf(s)->Push([gate] { gate->Wait(); });
}

Status FakeRuntime::CopyAsync(void* dst, const void* src, size_t bytes, Stream s) {
  const bool dd = Kind(dst) != PtrKind::kHost, sd = Kind(src) != PtrKind::kHost;
  if (!dd && sd)
    ++d2hCopies;
  else if (dd && !sd)
    ++h2dCopies;
  else
    ++otherCopies;
  copiedBytes += bytes;
  StreamOf(s)->Push([this, dst, src, bytes] {
    if (int us = copyDelayUs.load()) {
      struct timespec ts = {us / 1000000, (us % 1000000) * 1000L};
      nanosleep(&ts, nullptr);
    }
    std::memcpy(dst, src, bytes);
  });
  return Status::Ok();
}

Status FakeRuntime::EventCreate(scape::device::Event* e) {
  *e = new FakeEvent();
  return Status::Ok();
}

void FakeRuntime::EventDestroy(scape::device::Event e) { delete static_cast<FakeEvent*>(e); }

Status FakeRuntime::EventRecord(scape::device::Event e, Stream s) {
  auto* ev = static_cast<FakeEvent*>(e);
  const uint64_t gen = ++ev->recorded;
  StreamOf(s)->Push([ev, gen] { ev->reached.store(gen); });
  return Status::Ok();
}

Status FakeRuntime::EventQuery(scape::device::Event e, bool* done) {
  auto* ev = static_cast<FakeEvent*>(e);
  *done = ev->reached.load() >= ev->recorded.load();
  return Status::Ok();
}

Status FakeRuntime::LaunchHostFunc(Stream s, scape::device::HostFn fn, void* arg) {
  ++hostFuncs;
  StreamOf(s)->Push([fn, arg] { fn(arg); });
  return Status::Ok();
}

Status FakeRuntime::StreamSynchronize(Stream s) {
  ++syncs;
  if (!StreamOf(s)->Sync()) return scape::TimeoutError("fake stream did not drain in 30 s");
  return Status::Ok();
}

}  // namespace fake_device
