// Teardown order of a communicator after device work (issue 31): device collectives, masked
// device all-reduces and device optimizer steps, then scapeCommAbort / scapeCommDestroy with
// the optimizer and the masks still alive, with them destroyed first, and scapeCommAbort from
// another thread while device work is being issued. Real ranks over UCX, the CPU fake device;
// run under AddressSanitizer, a teardown that uses the device pool (or anything else) after it
// is freed fails here (the device optimizer's state drops its blocks to the communicator's
// pool when it goes, which scapeCommAbort used to free first).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using scape_test::RankCtx;
using scape_test::RankOptions;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

const std::vector<uint64_t> kOffs{0, 700, 1000, 2001};
const std::vector<uint8_t> kDense{0, 1, 0};
uint64_t N() { return kOffs.back(); }

std::vector<float> Random(unsigned seed, size_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

scapeOptim_t MakeOptim(scapeComm_t comm) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = N();
  c.nsegments = static_cast<int>(kOffs.size() - 1);
  c.segOffsets = kOffs.data();
  c.denseFlags = kDense.data();
  c.lr = 1e-2f;
  c.maxGradNorm = 1.0f;  // the norm's host wait runs too
  c.density = 0.05;
  c.warmupSteps = 2;
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
  return o;
}

// A mask with an agreed current generation (selected from a host statistic).
scapeMask_t MakeMask(scapeComm_t comm, int rank) {
  scapeMask_t m = nullptr;
  EXPECT_SCAPE_OK(scapeMaskCreate(&m, N(), static_cast<int>(kOffs.size() - 1), kOffs.data(),
                                  kDense.data(), scapeOwnershipShards, scapeMaskEncodingAuto, comm),
                  comm);
  if (!m) return nullptr;
  std::vector<float> stat = Random(17u + static_cast<unsigned>(rank), N());
  EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, stat.data(), 0.1), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncStart(m), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncWait(m), comm);
  EXPECT_SCAPE_OK(scapeMaskAdvance(m), comm);
  return m;
}

// Device buffers and a stream of the rank, and the device work of the tests on them.
struct Work {
  RankCtx& ctx;
  float *dp = nullptr, *dg = nullptr, *dx = nullptr;
  void* s = nullptr;
  explicit Work(RankCtx& c) : ctx(c) {
    const size_t n = N();
    dp = static_cast<float*>(Fake().DeviceMalloc(4 * n));
    dg = static_cast<float*>(Fake().DeviceMalloc(4 * n));
    dx = static_cast<float*>(Fake().DeviceMalloc(4 * n));
    std::vector<float> p = Random(5u, n);
    std::memcpy(dp, p.data(), 4 * n);
    s = Fake().NewStream();
  }
  ~Work() {
    Fake().DeviceFree(dp);
    Fake().DeviceFree(dg);
    Fake().DeviceFree(dx);
  }
  // A dense device all-reduce and a masked one, on the stream.
  void Collectives(scapeMask_t m) {
    std::vector<float> x = Random(11u + static_cast<unsigned>(ctx.rank), N());
    std::memcpy(dx, x.data(), 4 * N());
    EXPECT_SCAPE_OK(scapeAllReduce(dx, dx, N(), scapeFloat32, scapeAvg, nullptr, ctx.comm, s),
                    ctx.comm);
    EXPECT_SCAPE_OK(scapeAllReduce(dx, dx, N(), scapeFloat32, scapeAvg, m, ctx.comm, s), ctx.comm);
    EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
  }
  // Device optimizer steps on the stream (each synchronised before the next gradient).
  void Steps(scapeOptim_t o, int steps) {
    for (int t = 0; t < steps; ++t) {
      std::vector<float> g = Random(100u * static_cast<unsigned>(t) + ctx.rank, N());
      std::memcpy(dg, g.data(), 4 * N());
      EXPECT_SCAPE_OK(scapeOptimStepStream(o, dp, dg, N(), s), ctx.comm);
      EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
    }
  }
};

RankOptions Opts() {
  RankOptions o;
  o.timeoutMs = 5000;
  o.watchdogMs = 120000;
  return o;
}

// The watchdog's case: three device optimizer steps, then scapeCommAbort without
// scapeOptimDestroy (the optimizer, and a mask with device positions, die with the
// communicator). Under ASan this was a heap-use-after-free in DevicePool::Drop from the
// optimizer's device state, after the pool had gone with the device backend.
TEST(DeviceTeardown, AbortWithTheOptimizerAndAMaskAlive) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        const uint64_t live0 = Fake().LiveBytes();
        {
          Work w(ctx);
          scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
          scapeOptim_t o = MakeOptim(ctx.comm);
          if (!m || !o) return false;
          w.Collectives(m);
          w.Steps(o, 3);
          EXPECT_EQ(scapeCommAbort(ctx.comm), scapeSuccess);
          ctx.comm = nullptr;
          // The handles died with the communicator.
          scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
          EXPECT_EQ(scapeOptimGetInfo(o, &info), scapeInvalidArgument);
          uint64_t k = 0;
          EXPECT_EQ(scapeMaskGetCount(m, &k), scapeInvalidArgument);
        }
        // The pool went with its last owner (the optimizer's state) and freed every block.
        EXPECT_EQ(Fake().LiveBytes(), live0) << "device memory left after scapeCommAbort";
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The same with only the optimizer (its own mask) left alive, and a step's work still queued
// on the stream when the abort comes.
TEST(DeviceTeardown, AbortWithAStepStillOnTheStream) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        Work w(ctx);
        scapeOptim_t o = MakeOptim(ctx.comm);
        if (!o) return false;
        w.Steps(o, 3);
        std::vector<float> g = Random(77u + ctx.rank, N());
        std::memcpy(w.dg, g.data(), 4 * N());
        EXPECT_SCAPE_OK(scapeOptimStepStream(o, w.dp, w.dg, N(), w.s), ctx.comm);
        EXPECT_EQ(scapeCommAbort(ctx.comm), scapeSuccess);
        ctx.comm = nullptr;
        EXPECT_TRUE(Fake().StreamSynchronize(w.s).ok());
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommDestroy refuses while the optimizer or a mask is alive (changing nothing: the
// device work goes on), and frees every device byte once they are destroyed first.
TEST(DeviceTeardown, DestroyWithTheOptimizerAliveIsRefusedThenFreesEverything) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        const uint64_t live0 = Fake().LiveBytes();
        {
          Work w(ctx);
          scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
          scapeOptim_t o = MakeOptim(ctx.comm);
          if (!m || !o) return false;
          w.Collectives(m);
          w.Steps(o, 3);
          EXPECT_EQ(scapeCommDestroy(ctx.comm), scapeInvalidUsage);
          // Still usable: more device work on both.
          w.Collectives(m);
          w.Steps(o, 1);
          EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
          EXPECT_EQ(scapeCommDestroy(ctx.comm), scapeInvalidUsage);  // the optimizer's mask
          EXPECT_SCAPE_OK(scapeOptimDestroy(o), ctx.comm);
          EXPECT_SCAPE_OK(scapeCommDestroy(ctx.comm), nullptr);
          ctx.comm = nullptr;
        }
        EXPECT_EQ(Fake().LiveBytes(), live0) << "device memory left after scapeCommDestroy";
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The optimizer and the mask destroyed first, then scapeCommAbort: nothing left on the device.
TEST(DeviceTeardown, AbortAfterDestroyingTheOptimizerAndTheMask) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        const uint64_t live0 = Fake().LiveBytes();
        {
          Work w(ctx);
          scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
          scapeOptim_t o = MakeOptim(ctx.comm);
          if (!m || !o) return false;
          w.Collectives(m);
          w.Steps(o, 3);
          EXPECT_SCAPE_OK(scapeOptimDestroy(o), ctx.comm);
          EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
          EXPECT_EQ(scapeCommAbort(ctx.comm), scapeSuccess);
          ctx.comm = nullptr;
        }
        EXPECT_EQ(Fake().LiveBytes(), live0) << "device memory left after scapeCommAbort";
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A watchdog thread aborts while the rank's thread keeps issuing device collectives, masked
// all-reduces and optimizer steps: every call returns (an error once the abort has begun),
// the abort frees the communicator with the optimizer and the mask alive, and nothing is used
// after it is freed.
TEST(DeviceTeardown, AbortFromAnotherThreadDuringDeviceWork) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        Work w(ctx);
        scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
        scapeOptim_t o = MakeOptim(ctx.comm);
        if (!m || !o) return false;
        w.Steps(o, 2);
        std::atomic<int> calls{0};
        std::atomic<bool> failed{false};
        scapeComm_t comm = ctx.comm;
        std::thread worker([&] {
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          for (int t = 0; std::chrono::steady_clock::now() < until; ++t) {
            std::vector<float> g = Random(300u + static_cast<unsigned>(t), N());
            std::memcpy(w.dg, g.data(), 4 * N());
            scapeResult_t r = scapeOptimStepStream(o, w.dp, w.dg, N(), w.s);
            if (r == scapeSuccess)
              r = scapeAllReduce(w.dx, w.dx, N(), scapeFloat32, scapeAvg, m, comm, w.s);
            (void)Fake().StreamSynchronize(w.s);
            calls.fetch_add(1);
            if (r != scapeSuccess) {
              failed.store(true);
              return;
            }
          }
        });
        while (calls.load() < 2 && !failed.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        EXPECT_EQ(scapeCommAbort(comm), scapeSuccess);
        worker.join();
        EXPECT_TRUE(failed.load()) << "no call failed after scapeCommAbort";
        ctx.comm = nullptr;
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A staged exchange in flight: rank 1's stream is held (its caller's earlier work), so rank
// 0's exchange has gone on the wire and waits for rank 1, when both ranks abort, the optimizer
// and a mask alive. The abort returns within its bounded wait; once the gate opens, the held
// stream runs what was queued (its copies, its waits for the exchange, the job's end) against
// memory that is still valid: the staging channel leaves a job its stream has not finished
// (its stages, its flag word, the job itself) rather than free it under the stream.
TEST(DeviceTeardown, AbortWithAStagedExchangeInFlight) {
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        Work w(ctx);
        scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
        scapeOptim_t o = MakeOptim(ctx.comm);
        if (!m || !o) return false;
        w.Collectives(m);
        w.Steps(o, 2);
        fake_device::Gate gate;
        if (ctx.rank == 1) Fake().HoldStream(w.s, &gate);
        EXPECT_SCAPE_OK(
            scapeAllReduce(w.dx, w.dx, N(), scapeFloat32, scapeSum, nullptr, ctx.comm, w.s),
            ctx.comm);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 on the wire
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(scapeCommAbort(ctx.comm), scapeSuccess);
        ctx.comm = nullptr;
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_LT(sec, 4.0) << "scapeCommAbort waited for the held stream";
        gate.Open();
        EXPECT_TRUE(Fake().StreamOf(w.s)->Sync(10000)) << "the stream was left waiting";
        EXPECT_EQ(Fake().callsInHostFn.load(), 0u);
        return !::testing::Test::HasFailure();
      },
      Opts());
  unsetenv("SCAPE_DEVICE_CHUNK_BYTES");
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommDestroy (and the optimizer's and mask's destroys before it) from a thread other
// than the one that issued the device work, with a staged collective still on the stream: the
// destroy drains it (the result lands) and frees every device and page-locked byte.
TEST(DeviceTeardown, DestroyFromAnotherThreadWithACollectiveInFlight) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        const uint64_t live0 = Fake().LiveBytes();
        {
          Work w(ctx);
          scapeMask_t m = MakeMask(ctx.comm, ctx.rank);
          scapeOptim_t o = MakeOptim(ctx.comm);
          if (!m || !o) return false;
          w.Collectives(m);
          w.Steps(o, 2);
          for (size_t i = 0; i < N(); ++i) w.dx[i] = 1.0f;
          Fake().copyDelayUs = 2000;
          EXPECT_SCAPE_OK(
              scapeAllReduce(w.dx, w.dx, N(), scapeFloat32, scapeSum, nullptr, ctx.comm, w.s),
              ctx.comm);
          scapeComm_t comm = ctx.comm;
          std::thread other([&] {
            EXPECT_SCAPE_OK(scapeOptimDestroy(o), comm);
            EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
            EXPECT_SCAPE_OK(scapeCommDestroy(comm), nullptr);
          });
          other.join();
          ctx.comm = nullptr;
          Fake().copyDelayUs = 0;
          for (size_t i = 0; i < N(); ++i)
            if (w.dx[i] != 2.0f) {
              ADD_FAILURE() << "element " << i << " = " << w.dx[i] << " after the destroy";
              break;
            }
        }
        EXPECT_EQ(Fake().LiveBytes(), live0) << "device memory left after scapeCommDestroy";
        EXPECT_EQ(Fake().pinnedLive.load(), 0u) << "page-locked memory left";
        return !::testing::Test::HasFailure();
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
