// The fake device runtime is as strict as CUDA where code can depend on the difference (issue
// 31, "What to build" 2): one test per class of behaviour, each of which the earlier, lenient
// fake would have passed (it ran host functions on each stream's own thread, let them call the
// runtime, gave the default stream no implicit synchronisation, copied pageable memory like
// page-locked memory, freed event handles for good and had one device).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "tests/device/fake_device.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape::device::Event;
using scape::device::Stream;

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// CUDA runs the host functions of every stream of a context on one thread: while one blocks,
// no other stream's host function runs.
TEST(StrictFake, HostFunctionsOfAllStreamsShareOneThread) {
  FakeRuntime rt;
  struct Shared {
    std::atomic<bool> aStarted{false}, bRan{false}, sawB{false};
  } sh;
  auto fnA = [](void* p) {
    auto* s = static_cast<Shared*>(p);
    s->aStarted = true;
    for (int i = 0; i < 300 && !s->bRan.load(); ++i) SleepMs(1);  // blocks up to 0.3 s
    s->sawB = s->bRan.load();
  };
  auto fnB = [](void* p) { static_cast<Shared*>(p)->bRan = true; };
  Stream a = rt.NewStream(), b = rt.NewStream();
  ASSERT_TRUE(rt.LaunchHostFunc(a, fnA, &sh).ok());
  while (!sh.aStarted.load()) SleepMs(1);
  ASSERT_TRUE(rt.LaunchHostFunc(b, fnB, &sh).ok());
  ASSERT_TRUE(rt.StreamSynchronize(a).ok());
  ASSERT_TRUE(rt.StreamSynchronize(b).ok());
  EXPECT_TRUE(sh.bRan.load());
  EXPECT_FALSE(sh.sawB.load()) << "stream b's host function ran while stream a's was still running";
}

// CUDA forbids CUDA calls inside a host function: the fake refuses them with an error.
TEST(StrictFake, RuntimeCallsInsideAHostFunctionAreRefused) {
  FakeRuntime rt;
  struct Shared {
    FakeRuntime* rt;
    scape::Status create, copy;
  } sh{&rt, {}, {}};
  auto fn = [](void* p) {
    auto* s = static_cast<Shared*>(p);
    Event e = nullptr;
    s->create = s->rt->EventCreate(&e);
    char src = 1, dst = 0;
    s->copy = s->rt->CopyAsync(&dst, &src, 1, nullptr);
  };
  Stream s = rt.NewStream();
  ASSERT_TRUE(rt.LaunchHostFunc(s, fn, &sh).ok());
  ASSERT_TRUE(rt.StreamSynchronize(s).ok());
  EXPECT_EQ(sh.create.code(), scapeInvalidUsage) << sh.create.message();
  EXPECT_EQ(sh.copy.code(), scapeInvalidUsage) << sh.copy.message();
  EXPECT_NE(sh.copy.message().find("inside a host function"), std::string::npos);
  EXPECT_EQ(rt.callsInHostFn.load(), 2u);
}

// The legacy default stream waits for blocking streams (and they for it); non-blocking
// streams synchronise with neither.
TEST(StrictFake, LegacyDefaultStreamSynchronisesWithBlockingStreamsOnly) {
  FakeRuntime rt;
  auto* d = static_cast<unsigned char*>(rt.DeviceMalloc(4));  // zero-filled
  Stream blocking = rt.NewStream(true), nonBlocking = rt.NewStream();
  Gate g1;
  rt.HoldStream(blocking, &g1);
  ASSERT_TRUE(rt.Memset(d, 1, 4, nullptr).ok());
  SleepMs(100);
  EXPECT_EQ(d[0], 0) << "the default stream ran past a held blocking stream";
  g1.Open();
  ASSERT_TRUE(rt.StreamSynchronize(nullptr).ok());
  EXPECT_EQ(d[0], 1);

  Gate g2;
  rt.HoldStream(nonBlocking, &g2);
  ASSERT_TRUE(rt.Memset(d, 2, 4, nullptr).ok());
  ASSERT_TRUE(rt.StreamSynchronize(nullptr).ok()) << "the default stream waited for a "
                                                     "non-blocking stream";
  EXPECT_EQ(d[0], 2);
  g2.Open();

  Gate g3;
  rt.HoldStream(nullptr, &g3);
  ASSERT_TRUE(rt.Memset(d, 3, 4, blocking).ok());
  SleepMs(100);
  EXPECT_EQ(d[0], 2) << "a blocking stream ran past the held default stream";
  g3.Open();
  ASSERT_TRUE(rt.StreamSynchronize(blocking).ok());
  EXPECT_EQ(d[0], 3);
  rt.DeviceFree(d);
}

// cudaMemcpyAsync with pageable memory: into it, the call returns once the copy is done; from
// it, CUDA may read the source only when the stream gets there, so a change after the call is
// an error the test sees.
TEST(StrictFake, PageableCopiesFollowCudasRules) {
  FakeRuntime rt;
  void* d = rt.DeviceMalloc(64);
  Stream s = rt.NewStream();
  {
    std::vector<char> src(64, 1);
    Gate g;
    rt.HoldStream(s, &g);
    ASSERT_TRUE(rt.CopyAsync(d, src.data(), 64, s).ok());
    src[7] = 2;  // reused before the stream reached the copy
    g.Open();
    scape::Status st = rt.StreamSynchronize(s);
    EXPECT_EQ(st.code(), scapeInvalidUsage) << st.message();
    EXPECT_NE(st.message().find("pageable source"), std::string::npos) << st.message();
    rt.ClearStreamError(s);
  }
  {
    std::memset(d, 9, 64);
    std::vector<char> dst(64, 0);
    Gate g;
    rt.HoldStream(s, &g);
    std::thread opener([&] {
      SleepMs(100);
      g.Open();
    });
    ASSERT_TRUE(rt.CopyAsync(dst.data(), d, 64, s).ok());
    EXPECT_EQ(dst[0], 9) << "a copy into pageable memory returned before it had run";
    opener.join();
  }
  {
    // Page-locked memory is copied when the stream gets there, with no check and no wait.
    void* h = nullptr;
    ASSERT_TRUE(rt.HostAlloc(64, &h).ok());
    std::memset(h, 4, 64);
    Gate g;
    rt.HoldStream(s, &g);
    ASSERT_TRUE(rt.CopyAsync(d, h, 64, s).ok());
    static_cast<char*>(h)[0] = 5;
    g.Open();
    ASSERT_TRUE(rt.StreamSynchronize(s).ok());
    EXPECT_EQ(static_cast<char*>(d)[0], 5);
    rt.HostFree(h);
  }
  rt.DeviceFree(d);
}

// A destroyed event's handle is an error until the next EventCreate hands it out again, for a
// new event (as a CUDA runtime may); stream handles are reused the same way.
TEST(StrictFake, HandlesAreReusedAfterDestroy) {
  FakeRuntime rt;
  Event e1 = nullptr, e2 = nullptr, keep = nullptr;
  ASSERT_TRUE(rt.EventCreate(&e1).ok());
  ASSERT_TRUE(rt.EventCreate(&keep).ok());
  Stream s = rt.NewStream();
  Gate g;
  rt.HoldStream(s, &g);
  ASSERT_TRUE(rt.EventRecord(e1, s).ok());
  rt.EventDestroy(e1);
  bool done = true;
  EXPECT_EQ(rt.EventQuery(e1, &done).code(), scapeInvalidArgument);
  ASSERT_TRUE(rt.EventCreate(&e2).ok());
  EXPECT_EQ(e2, e1) << "the destroyed event's handle was not reused";
  ASSERT_TRUE(rt.EventQuery(e2, &done).ok());
  EXPECT_TRUE(done) << "the new event at the old handle inherited the old one's record";
  g.Open();
  ASSERT_TRUE(rt.StreamSynchronize(s).ok());

  Stream a = nullptr, b = nullptr;
  ASSERT_TRUE(rt.StreamCreate(&a).ok());
  rt.StreamDestroy(a);
  ASSERT_TRUE(rt.StreamCreate(&b).ok());
  EXPECT_EQ(a, b);
  rt.StreamDestroy(b);
  rt.EventDestroy(e2);
  rt.EventDestroy(keep);
}

// Device memory belongs to the device current at its allocation; a device op on another
// device is an error (no peer access in the fake).
TEST(StrictFake, MemoryOfAnotherDeviceIsAnError) {
  FakeRuntime rt;
  rt.SetDevice(1);
  void* d1 = nullptr;
  ASSERT_TRUE(rt.DeviceAlloc(16, &d1).ok());
  ASSERT_TRUE(rt.Memset(d1, 0, 16, nullptr).ok());
  ASSERT_TRUE(rt.StreamSynchronize(nullptr).ok());
  rt.SetDevice(0);
  EXPECT_EQ(rt.GetDevice(), 0);
  scape::Status st = rt.Memset(d1, 0, 16, nullptr);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("memory of device 1, used on device 0"), std::string::npos)
      << st.message();
  rt.DeviceFree(d1);
}

// The stream waits for a host flag on its own thread (no host function): the staging
// pipeline's wait for the exchange.
TEST(StrictFake, StreamWaitValueHoldsTheStreamUntilTheFlagIsWritten) {
  FakeRuntime rt;
  void* f = nullptr;
  ASSERT_TRUE(rt.HostAlloc(4, &f).ok());
  auto* flag = static_cast<uint32_t*>(f);
  *flag = 0xfffffffeu;  // the comparison is cyclic: 0xfffffffe is before 1
  auto* d = static_cast<unsigned char*>(rt.DeviceMalloc(4));
  Stream s = rt.NewStream();
  ASSERT_TRUE(rt.StreamWaitValue(s, flag, 1).ok());
  ASSERT_TRUE(rt.Memset(d, 7, 4, s).ok());
  SleepMs(50);
  EXPECT_EQ(d[0], 0);
  __atomic_store_n(flag, 1u, __ATOMIC_RELEASE);
  ASSERT_TRUE(rt.StreamSynchronize(s).ok());
  EXPECT_EQ(d[0], 7);
  uint32_t pageable = 0;
  EXPECT_EQ(rt.StreamWaitValue(s, &pageable, 0).code(), scapeInvalidArgument);
  EXPECT_EQ(rt.hostFuncs.load(), 0u);
  rt.DeviceFree(d);
  rt.HostFree(f);
}

}  // namespace
