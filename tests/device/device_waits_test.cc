// Every host wait of a call on a communicator has the communicator's deadline (issue 44 item 2
// and 3): a held stream behind each of them gives scapeTimeout within the timeout, never a
// hang, and none of them is an unbounded StreamSynchronize or a copy into (or out of) pageable
// memory that makes the host wait for the stream. The CPU fake device (fake_device.h) holds a
// stream with a gate (HoldStream, or HoldAfterNextOp to hold it in the middle of a call) and
// counts StreamSynchronize calls (syncs), copies into pageable memory that waited
// (pageableSyncCopies) and uploads from pageable memory (pageableUploads). Before the fix the
// paths below called StreamSynchronize (the fake's waits 30 s, CUDA's for ever) or copied into
// pageable vectors.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape_test::RankCtx;
using scape_test::RankOptions;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

constexpr int kTimeoutMs = 700;

RankOptions Opts() {
  RankOptions o;
  o.timeoutMs = kTimeoutMs;
  o.watchdogMs = 120000;
  return o;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// r is scapeTimeout, came within the deadline (plus slack), and the message names `what`.
void ExpectTimedOut(scapeResult_t r, double seconds, scapeComm_t comm, const char* what) {
  const std::string msg = scapeGetLastError(comm);
  EXPECT_EQ(r, scapeTimeout) << what << ": " << msg;
  EXPECT_LT(seconds, kTimeoutMs / 1000.0 + 5.0) << what << ": took " << seconds << " s";
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
}

scapeMask_t FullMask(scapeComm_t comm, uint64_t n) {
  scapeMask_t m = nullptr;
  const uint64_t offs[2] = {0, n};
  EXPECT_SCAPE_OK(
      scapeMaskCreate(&m, n, 1, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, comm),
      comm);
  return m;
}

// Host buffers with a held stream: the call waits for the stream's earlier work with the
// deadline (HostBackend::Admit, MaskPack, the host statistic's top-k).
TEST(DeviceWaits, HostBuffersBehindAHeldStreamTimeOut) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        Fake();
        const uint64_t n = 256;
        scapeMask_t m = FullMask(ctx.comm, n);
        if (!m) return false;
        std::vector<float> a(n, 1.0f), b(n, 0.0f), packed(n, 0.0f);
        void* s = Fake().NewStream();
        Gate gate;
        Fake().HoldStream(s, &gate);
        const uint64_t syncs0 = Fake().syncs.load();
        auto t0 = std::chrono::steady_clock::now();
        scapeResult_t r =
            scapeAllReduce(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, ctx.comm, s);
        ExpectTimedOut(r, SecondsSince(t0), ctx.comm, "host buffers with a non-NULL stream");
        t0 = std::chrono::steady_clock::now();
        r = scapeMaskPackStream(m, a.data(), packed.data(), scapeFloat32, s);
        ExpectTimedOut(r, SecondsSince(t0), ctx.comm, "before the pack");
        t0 = std::chrono::steady_clock::now();
        r = scapeMaskSelectNextTopkStream(m, a.data(), 0.5, s);
        ExpectTimedOut(r, SecondsSince(t0), ctx.comm, "host statistic's top-k");
        EXPECT_EQ(Fake().syncs.load(), syncs0) << "an unbounded StreamSynchronize";
        gate.Open();
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        // And with the stream free again they work.
        EXPECT_SCAPE_OK(scapeMaskPackStream(m, a.data(), packed.data(), scapeFloat32, s), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeSparseAllReduce on device buffers copies them to the host and back on the legacy
// default stream: held, the copies time out (through page-locked staging: no pageable copy
// that would wait for the stream without a deadline).
TEST(DeviceWaits, SparseAllReduceDeviceBuffersBehindAHeldDefaultStreamTimeOut) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        Fake();
        const uint64_t n = 64;
        const size_t nnz = 4;
        std::vector<uint64_t> hIdx{1, 5, 9, 33};
        std::vector<float> hVal{1.0f, 2.0f, 3.0f, 4.0f};
        auto* dIdx = static_cast<uint64_t*>(Fake().DeviceMalloc(8 * nnz));
        auto* dVal = static_cast<float*>(Fake().DeviceMalloc(4 * nnz));
        auto* dOut = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        std::memcpy(dIdx, hIdx.data(), 8 * nnz);
        std::memcpy(dVal, hVal.data(), 4 * nnz);
        // Unheld first: it works, and waits through staging only.
        const uint64_t sync0 = Fake().syncs.load(), pg0 = Fake().pageableSyncCopies.load();
        EXPECT_SCAPE_OK(
            scapeSparseAllReduce(dIdx, dVal, nnz, n, scapeFloat32, scapeSum, scapeSparseAuto, dOut,
                                 nullptr, nullptr, 0, nullptr, nullptr, ctx.comm),
            ctx.comm);
        EXPECT_EQ(dOut[5], 2.0f);
        EXPECT_EQ(Fake().syncs.load(), sync0) << "an unbounded StreamSynchronize";
        EXPECT_EQ(Fake().pageableSyncCopies.load(), pg0) << "a copy into pageable memory";
        Gate gate;
        Fake().HoldStream(nullptr, &gate);
        auto t0 = std::chrono::steady_clock::now();
        scapeResult_t r =
            scapeSparseAllReduce(dIdx, dVal, nnz, n, scapeFloat32, scapeSum, scapeSparseAuto, dOut,
                                 nullptr, nullptr, 0, nullptr, nullptr, ctx.comm);
        ExpectTimedOut(r, SecondsSince(t0), ctx.comm, "copying a device input to the host");
        gate.Open();
        EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
        Fake().DeviceFree(dIdx);
        Fake().DeviceFree(dVal);
        Fake().DeviceFree(dOut);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A staged device collective (UCX backend) on a stream that captures into a CUDA graph is
// refused before anything is enqueued (issue 44 item 6: its stream would wait for a host
// exchange that a graph replay never runs), and works again once the capture has ended.
TEST(DeviceWaits, StagedCollectiveUnderGraphCaptureIsRefused) {
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        Fake();
        const size_t n = 1000;
        auto* d = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(ctx.rank + 1);
        void* s = Fake().NewStream();
        // The first device collective makes the staging channel (collectively): outside capture.
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, nullptr, ctx.comm, s),
                        ctx.comm);
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        EXPECT_EQ(d[7], 3.0f);
        Fake().capturing.store(s);
        const uint64_t copies = Fake().d2hCopies.load() + Fake().h2dCopies.load(),
                       waits = Fake().valueWaits.load();
        const scapeResult_t r =
            scapeAllReduce(d, d, n, scapeFloat32, scapeSum, nullptr, ctx.comm, s);
        const std::string msg = scapeGetLastError(ctx.comm);
        Fake().capturing.store(nullptr);
        EXPECT_EQ(r, scapeUnsupported) << msg;
        EXPECT_NE(msg.find("CUDA graph"), std::string::npos) << msg;
        EXPECT_EQ(Fake().d2hCopies.load() + Fake().h2dCopies.load(), copies) << "enqueued copies";
        EXPECT_EQ(Fake().valueWaits.load(), waits) << "enqueued a stream wait";
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, nullptr, ctx.comm, s),
                        ctx.comm);
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        EXPECT_EQ(d[7], 6.0f);
        Fake().DeviceFree(d);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

struct Layout {
  std::vector<uint64_t> offs{0, 0, 1, 400, 413, 1200, 2001};
  std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0};
  uint64_t n() const { return offs.back(); }
};

scapeOptim_t Create(scapeComm_t comm, const Layout& l, int entering) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = l.n();
  c.nsegments = static_cast<int>(l.offs.size() - 1);
  c.segOffsets = l.offs.data();
  c.denseFlags = l.dense.data();
  c.lr = 1e-2f;
  c.density = 0.05;
  c.entering = entering;
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
  return o;
}

void FillGrads(float* g, size_t n, int step) {
  std::mt19937 rng(977u + static_cast<unsigned>(step));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) g[i] = d(rng);
}

// The device step's "segment_rms" sums come back to the host in the middle of the step: with
// the stream held right behind their kernel, the step returns the communicator's timeout error
// naming them (before: a copy into a pageable vector, which waits for the stream with no
// deadline; the fake's waited 30 s).
TEST(DeviceWaits, SegmentRmsSumsBehindAHeldStreamTimeOut) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        Fake();
        Layout l;
        const size_t n = l.n();
        scapeOptim_t o = Create(ctx.comm, l, scapeOptimEnteringSegmentRms);
        if (!o) return false;
        auto* dp = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        auto* dg = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        void* s = Fake().NewStream();
        const uint64_t pg0 = Fake().pageableSyncCopies.load(), sync0 = Fake().syncs.load();
        for (int t = 0; t < 3; ++t) {
          FillGrads(dg, n, t);
          EXPECT_SCAPE_OK(scapeOptimStepStream(o, dp, dg, n, s), ctx.comm);
          EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        }
        EXPECT_EQ(Fake().pageableSyncCopies.load(), pg0) << "a device step copied into pageable "
                                                            "memory (a host wait without deadline)";
        const uint64_t sync1 = Fake().syncs.load();
        EXPECT_EQ(sync1 - sync0, 3u) << "only the test's own StreamSynchronize calls";
        const uint64_t sums0 = Fake().stayingSums.load();
        Gate gate;
        Fake().HoldAfterNextOp("StayingGradSqBlocks", &gate);
        FillGrads(dg, n, 3);
        auto t0 = std::chrono::steady_clock::now();
        scapeResult_t r = scapeOptimStepStream(o, dp, dg, n, s);
        const double secs = SecondsSince(t0);
        EXPECT_GT(Fake().stayingSums.load(), sums0) << "the step ran no segment_rms sums";
        ExpectTimedOut(r, secs, ctx.comm, "segment_rms sums");
        EXPECT_EQ(Fake().syncs.load(), sync1) << "an unbounded StreamSynchronize";
        gate.Open();
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        scapeOptimDestroy(o);
        Fake().DeviceFree(dp);
        Fake().DeviceFree(dg);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The device state to the host and back (a checkpoint after device steps, a load, the first
// mixed step's masters): every copy through page-locked staging with the deadline, no
// StreamSynchronize, no pageable copy; and the per-step uploads (PrepareMask, the mask's
// positions) from page-locked staging, not pageable memory.
TEST(DeviceWaits, StateCopiesAndStepUploadsHaveNoUnboundedWait) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        Fake();
        Layout l;
        const size_t n = l.n();
        scapeOptim_t o = Create(ctx.comm, l, scapeOptimEnteringPayload);
        if (!o) return false;
        auto* dp = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        auto* dg = static_cast<float*>(Fake().DeviceMalloc(4 * n));
        void* s = Fake().NewStream();
        const uint64_t sync0 = Fake().syncs.load(), pg0 = Fake().pageableSyncCopies.load(),
                       up0 = Fake().pageableUploads.load(), st0 = Fake().stagedUploads.load();
        int own = 0;
        for (int t = 0; t < 3; ++t) {
          FillGrads(dg, n, t);
          EXPECT_SCAPE_OK(scapeOptimStepStream(o, dp, dg, n, s), ctx.comm);
          EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
          ++own;
        }
        EXPECT_EQ(Fake().pageableUploads.load(), up0) << "a device step uploaded from pageable "
                                                         "memory";
        EXPECT_GT(Fake().stagedUploads.load(), st0);
        size_t bytes = 0, written = 0;
        EXPECT_SCAPE_OK(scapeOptimCheckpointSize(o, &bytes), ctx.comm);
        std::vector<uint8_t> ck(bytes);
        EXPECT_SCAPE_OK(scapeOptimSave(o, ck.data(), ck.size(), &written), ctx.comm);
        EXPECT_SCAPE_OK(scapeOptimLoad(o, ck.data(), written), ctx.comm);
        FillGrads(dg, n, 3);
        EXPECT_SCAPE_OK(scapeOptimStepStream(o, dp, dg, n, s), ctx.comm);
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        ++own;
        EXPECT_EQ(Fake().syncs.load() - sync0, static_cast<uint64_t>(own))
            << "a StreamSynchronize besides the test's own";
        EXPECT_EQ(Fake().pageableSyncCopies.load(), pg0) << "a copy into pageable memory";
        EXPECT_SCAPE_OK(scapeOptimDestroy(o), ctx.comm);
        // The first mixed step copies the 16-bit params to the host for the masters.
        scapeOptim_t mx = Create(ctx.comm, l, scapeOptimEnteringPayload);
        if (!mx) return false;
        auto* dp16 = static_cast<uint16_t*>(Fake().DeviceMalloc(2 * n));
        auto* dg16 = static_cast<uint16_t*>(Fake().DeviceMalloc(2 * n));
        for (size_t i = 0; i < n; ++i) dp16[i] = dg16[i] = 0x3c00;  // bf16 1.0 ... any value
        const uint64_t sync2 = Fake().syncs.load(), pg2 = Fake().pageableSyncCopies.load();
        EXPECT_SCAPE_OK(scapeOptimStepMixed(mx, dp16, scapeBfloat16, dg16, scapeBfloat16, n, s),
                        ctx.comm);
        EXPECT_EQ(Fake().syncs.load(), sync2) << "an unbounded StreamSynchronize (mixed step)";
        EXPECT_EQ(Fake().pageableSyncCopies.load(), pg2) << "a copy into pageable memory";
        EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
        EXPECT_SCAPE_OK(scapeOptimDestroy(mx), ctx.comm);
        Fake().DeviceFree(dp);
        Fake().DeviceFree(dg);
        Fake().DeviceFree(dp16);
        Fake().DeviceFree(dg16);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
