// Device memory per step (issue 31 finding 5): the device optimizer step and the device
// collectives allocate no driver memory after their first step, with the library's own pool
// and with the caller's allocator (scapeConfig_t.deviceAllocator), and the caller's allocator
// gets every device buffer of the library and back with the stream and size it was allocated
// with. Real ranks over UCX with the CPU fake device (tests/device/fake_device.h), whose
// deviceAllocs counts driver-level allocations and whose top-k and norm ops take a temporary
// as their CUDA forms do (outside the pool, one driver allocation per call: the old
// StreamTemp's cudaMallocAsync with a release threshold of 0).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "plugin/device/device_pool.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using scape_test::RankCtx;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

// A caching allocator in the manner of torch's: freed blocks are kept per (stream, size) and
// handed to the next request of that size on that stream; checks that every free matches its
// alloc (pointer, bytes, device, stream).
struct TestAllocator {
  struct Live {
    size_t bytes;
    int device;
    void* stream;
  };
  std::mutex mu;
  std::map<void*, Live> live;
  std::multimap<std::tuple<void*, size_t>, void*> cache;
  uint64_t allocs = 0, frees = 0, mismatches = 0;
  bool failNext = false;

  static int Alloc(void* user, size_t bytes, int device, void* stream, void** ptr) {
    auto* a = static_cast<TestAllocator*>(user);
    std::lock_guard<std::mutex> lk(a->mu);
    if (a->failNext) {
      a->failNext = false;
      return 2;
    }
    ++a->allocs;
    auto it = a->cache.find(std::make_tuple(stream, bytes));
    if (it != a->cache.end()) {
      *ptr = it->second;
      a->cache.erase(it);
    } else if (!Fake().DeviceAlloc(bytes, ptr).ok()) {
      return 1;
    }
    a->live[*ptr] = Live{bytes, device, stream};
    return 0;
  }
  static void Free(void* user, void* ptr, size_t bytes, int device, void* stream) {
    auto* a = static_cast<TestAllocator*>(user);
    std::lock_guard<std::mutex> lk(a->mu);
    ++a->frees;
    auto it = a->live.find(ptr);
    if (it == a->live.end() || it->second.bytes != bytes || it->second.device != device ||
        it->second.stream != stream) {
      ++a->mismatches;
      return;
    }
    a->live.erase(it);
    a->cache.emplace(std::make_tuple(stream, bytes), ptr);
  }
  void Drain() {
    std::lock_guard<std::mutex> lk(mu);
    for (auto& kv : cache) Fake().DeviceFree(kv.second);
    cache.clear();
  }
  scapeDeviceAllocator_t Hook() { return scapeDeviceAllocator_t{&Alloc, &Free, this}; }
};

scapeComm_t Join(RankCtx& ctx, TestAllocator* hook) {
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = ctx.opts->timeoutMs;
  if (hook) cfg.deviceAllocator = hook->Hook();
  scapeComm_t c = nullptr;
  EXPECT_SCAPE_OK(scapeCommInitRankConfig(&c, ctx.nranks, ctx.id, ctx.rank, &cfg), nullptr);
  return c;
}

scape_test::RankOptions NoComm() {
  scape_test::RankOptions o;
  o.initComm = false;
  return o;
}

std::vector<float> Randoms(unsigned seed, size_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

struct OptimCase {
  int ownership;
  float clip;
  int entering;
};

// Ten device optimizer steps: the driver allocations of each step (after its stream has been
// synchronised) must be 0 once the mask has its size: step 0 runs the full mask (every
// optimizer's first step does) and allocates the state; step 1, the first at the configured
// density, refits the mask-sized blocks to it; from step 2 on nothing is allocated. No op
// temporary may bypass the communicator's pool.
bool OptimSteps(RankCtx& ctx, TestAllocator* hook, const OptimCase& oc, unsigned seed) {
  Fake();
  scapeComm_t comm = Join(ctx, hook);
  if (!comm) return false;
  const std::vector<uint64_t> offs{0, 0, 1, 400, 413, 1200, 2001};
  const std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0};
  const size_t n = offs.back();
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = n;
  c.nsegments = static_cast<int>(offs.size() - 1);
  c.segOffsets = offs.data();
  c.denseFlags = dense.data();
  c.ownership = oc.ownership;
  c.maxGradNorm = oc.clip;
  c.entering = oc.entering;
  c.density = 0.05;
  c.warmupSteps = 0;  // a constant density: the mask's size, and so every block's, settles
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
  float* dp = static_cast<float*>(Fake().DeviceMalloc(4 * n));
  float* dg = static_cast<float*>(Fake().DeviceMalloc(4 * n));
  std::vector<float> p = Randoms(seed, n);
  std::memcpy(dp, p.data(), 4 * n);
  void* s = Fake().NewStream();
  const uint64_t temps0 = Fake().tempAllocs.load();
  uint64_t hookAllocs = 0;
  for (int t = 0; t < 10 && !::testing::Test::HasFailure(); ++t) {
    std::vector<float> g = Randoms(seed * 31u + static_cast<unsigned>(ctx.rank * 1000 + t), n);
    std::memcpy(dg, g.data(), 4 * n);
    const uint64_t before = Fake().deviceAllocs.load();
    const uint64_t hookBefore = hook ? hook->allocs : 0;
    EXPECT_SCAPE_OK(scapeOptimStepStream(o, dp, dg, n, s), comm);
    EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
    const uint64_t driver = Fake().deviceAllocs.load() - before;
    if (t >= 2) {
      EXPECT_EQ(driver, 0u) << "driver allocations in device step " << t;
    }
    if (hook) hookAllocs += hook->allocs - hookBefore;
  }
  EXPECT_EQ(Fake().tempAllocs.load() - temps0, 0u) << "op temporaries outside the pool";
  // With the hook, the step's buffers come from it at every step (it caches; the library
  // does not), and none from the driver directly.
  if (hook) {
    EXPECT_GE(hookAllocs, 10u);
  }
  EXPECT_SCAPE_OK(scapeOptimDestroy(o), comm);
  EXPECT_SCAPE_OK(scapeCommDestroy(comm), nullptr);
  ctx.comm = nullptr;
  Fake().DeviceFree(dp);
  Fake().DeviceFree(dg);
  return !::testing::Test::HasFailure();
}

void CheckHookBalanced(TestAllocator& a) {
  std::lock_guard<std::mutex> lk(a.mu);
  EXPECT_EQ(a.mismatches, 0u) << "a free that does not match its alloc";
  EXPECT_TRUE(a.live.empty()) << a.live.size() << " block(s) never given back";
  EXPECT_EQ(a.allocs, a.frees);
}

class DeviceMemory : public ::testing::TestWithParam<bool> {};  // true: the caller's allocator

TEST_P(DeviceMemory, OptimizerStepAllocatesNothingAfterItsFirstStep) {
  const bool useHook = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  for (OptimCase oc : {OptimCase{scapeOptimReplicated, 0.0f, scapeOptimEnteringPayload},
                       OptimCase{scapeOptimSharded, 1.0f, scapeOptimEnteringPayload},
                       OptimCase{scapeOptimReplicated, 1.0f, scapeOptimEnteringSegmentRms}}) {
    auto res = RunRanks(
        2,
        [&](RankCtx& ctx) {
          TestAllocator a;
          bool ok = OptimSteps(ctx, useHook ? &a : nullptr, oc, seed);
          if (useHook) {
            CheckHookBalanced(a);
            EXPECT_GT(a.allocs, 0u);
          }
          a.Drain();
          return ok && !::testing::Test::HasFailure();
        },
        NoComm());
    EXPECT_TRUE(res.AllOk()) << "ownership " << oc.ownership << " clip " << oc.clip << " entering "
                             << oc.entering << ": " << res.Describe();
  }
}

// The device collectives of a training step on a mask: the top-k of a device statistic, the
// mask sync, a masked all-reduce and a dense all-reduce of device buffers; no driver allocation
// after the first round.
TEST_P(DeviceMemory, DeviceCollectivesAllocateNothingAfterTheirFirstStep) {
  const bool useHook = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        Fake();
        TestAllocator a;
        scapeComm_t comm = Join(ctx, useHook ? &a : nullptr);
        if (!comm) return false;
        const std::vector<uint64_t> offs{0, 700, 1500, 3000};
        const std::vector<uint8_t> dense{0, 1, 0};
        const size_t n = offs.back();
        scapeMask_t m = nullptr;
        EXPECT_SCAPE_OK(scapeMaskCreate(&m, n, 3, offs.data(), dense.data(), scapeOwnershipShards,
                                        scapeMaskEncodingAuto, comm),
                        comm);
        float* stat = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        float* buf = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        float* packed = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        void* s = Fake().NewStream();
        const uint64_t temps0 = Fake().tempAllocs.load();
        for (int t = 0; t < 8 && !::testing::Test::HasFailure(); ++t) {
          std::vector<float> h = Randoms(seed + static_cast<unsigned>(t), n);
          std::memcpy(stat, h.data(), 4 * n);
          std::memcpy(buf, h.data(), 4 * n);
          const uint64_t before = Fake().deviceAllocs.load();
          EXPECT_SCAPE_OK(scapeMaskSelectNextTopkStream(m, stat, 0.05, s), comm);
          EXPECT_SCAPE_OK(scapeMaskSyncStart(m), comm);
          EXPECT_SCAPE_OK(scapeMaskSyncWait(m), comm);
          EXPECT_SCAPE_OK(scapeMaskAdvance(m), comm);
          EXPECT_SCAPE_OK(scapeMaskPackStream(m, buf, packed, scapeFloat32, s), comm);
          EXPECT_SCAPE_OK(
              scapeMaskAllReducePacked(packed, packed, scapeFloat32, scapeSum, m, comm, s), comm);
          EXPECT_SCAPE_OK(scapeAllReduce(buf, buf, n, scapeFloat32, scapeSum, nullptr, comm, s),
                          comm);
          EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
          const uint64_t driver = Fake().deviceAllocs.load() - before;
          if (t > 0) {
            EXPECT_EQ(driver, 0u) << "driver allocations in round " << t;
          }
        }
        EXPECT_EQ(Fake().tempAllocs.load() - temps0, 0u) << "op temporaries outside the pool";
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), nullptr);
        if (useHook) {
          CheckHookBalanced(a);
          EXPECT_GT(a.allocs, 0u);
        }
        a.Drain();
        Fake().DeviceFree(stat);
        Fake().DeviceFree(buf);
        Fake().DeviceFree(packed);
        return !::testing::Test::HasFailure();
      },
      NoComm());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Pool, DeviceMemory, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("CallersAllocator")
                                          : std::string("LibraryPool");
                         });

// A failing allocator: the call that needed the memory fails with scapeSystemError naming the
// allocator; the next call (the allocator working again) succeeds.
TEST(DeviceMemoryHook, AFailedAllocationFailsTheCallNotTheCommunicator) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        Fake();
        TestAllocator a;
        scapeComm_t comm = Join(ctx, &a);
        if (!comm) return false;
        const std::vector<uint64_t> offs{0, 1000};
        scapeMask_t m = nullptr;
        EXPECT_SCAPE_OK(scapeMaskCreate(&m, 1000, 1, offs.data(), nullptr, scapeOwnershipShards,
                                        scapeMaskEncodingAuto, comm),
                        comm);
        float* stat = static_cast<float*>(Fake().DeviceMalloc(4000));
        void* s = Fake().NewStream();
        a.failNext = true;
        EXPECT_EQ(scapeMaskSelectNextTopkStream(m, stat, 0.1, s), scapeSystemError);
        EXPECT_NE(std::string(scapeGetLastError(comm)).find("deviceAllocator"), std::string::npos)
            << scapeGetLastError(comm);
        EXPECT_SCAPE_OK(scapeMaskSelectNextTopkStream(m, stat, 0.1, s), comm);
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), nullptr);
        CheckHookBalanced(a);
        a.Drain();
        Fake().DeviceFree(stat);
        return !::testing::Test::HasFailure();
      },
      NoComm());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// With the caller's allocator, a block handed back on the stream it was allocated for goes back
// to the allocator at once (stream-ordered), but only on that very stream (issue 44 item 6): a
// stream destroyed and a new one created at the same handle (the fake, like CUDA, reuses it) is
// another stream, and the block then goes back only once an event on the new stream says the
// work there has finished. Before: matched on the raw handle, returned at once.
TEST(DeviceMemoryHook, ReturnNowMatchesTheStreamNotItsHandle) {
  FakeRuntime& rt = Fake();
  TestAllocator a;
  const scapeDeviceAllocator_t hook = a.Hook();
  {
    scape::device::DevicePool pool(&rt, 5000, &hook);
    scape::device::Stream s1 = nullptr;
    ASSERT_TRUE(rt.StreamCreate(&s1).ok());
    // Same stream: back at once.
    scape::device::DevicePool::Block b;
    ASSERT_TRUE(pool.Acquire(4096, s1, &b).ok());
    fake_device::Gate g1;
    rt.HoldStream(s1, &g1);
    pool.Release(b, s1);
    EXPECT_EQ(a.frees, 1u) << "a block handed back on its own stream goes back at once";
    g1.Open();
    EXPECT_TRUE(rt.StreamSynchronize(s1).ok());
    // Allocated on s1; s1 destroyed; s2 made at the same handle; handed back on s2.
    ASSERT_TRUE(pool.Acquire(4096, s1, &b).ok());
    rt.StreamDestroy(s1);
    scape::device::Stream s2 = nullptr;
    ASSERT_TRUE(rt.StreamCreate(&s2).ok());
    ASSERT_EQ(s2, s1) << "the fake reuses a destroyed stream's handle";
    fake_device::Gate g2;
    rt.HoldStream(s2, &g2);
    pool.Release(b, s2);
    pool.Sweep();
    EXPECT_EQ(a.frees, 1u) << "returned at once on a new stream that only shares the handle";
    g2.Open();
    EXPECT_TRUE(rt.StreamSynchronize(s2).ok());
    pool.Sweep();
    EXPECT_EQ(a.frees, 2u) << "not returned once the new stream's work had finished";
    EXPECT_EQ(a.mismatches, 0u);
    rt.StreamDestroy(s2);
  }
  a.Drain();
}

// Half a hook is refused at init.
TEST(DeviceMemoryHook, AllocWithoutFreeIsRefused) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.deviceAllocator.alloc = &TestAllocator::Alloc;
        scapeComm_t c = nullptr;
        EXPECT_EQ(scapeCommInitRankConfig(&c, ctx.nranks, ctx.id, ctx.rank, &cfg),
                  scapeInvalidArgument);
        EXPECT_EQ(c, nullptr);
        return !::testing::Test::HasFailure();
      },
      NoComm());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
