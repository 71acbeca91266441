// The mask calls on device buffers (UCX backend, CPU fake device, real ranks over UCX): the
// packed collectives (scapeMaskAllReducePacked / ReduceScatter / AllGather), the masked
// dense-in/dense-out scapeAllReduce, scapeMaskPack / Unpack and scapeMaskSelectNextTopk with a
// device statistic. Every device call is compared bit for bit with the same call on host
// buffers (fresh random inputs each run); the calls enqueue on the stream and return; mixes
// of host and device buffers and the *Async forms with device buffers are clear errors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plugin/device/device_pool.h"
#include "plugin/device/runtime.h"
#include "plugin/device/staging.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape_test::RankCtx;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

// Random valid values of the type (finite floats).
std::vector<char> RandomValues(std::mt19937& rng, size_t n, scapeDataType_t t) {
  const size_t esz = scapeTypeSize(t);
  std::vector<char> v(n * esz);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (size_t i = 0; i < n; ++i) {
    float f = nd(rng);
    if (t == scapeFloat32) {
      std::memcpy(&v[i * esz], &f, 4);
    } else if (t == scapeBfloat16) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      uint16_t h = static_cast<uint16_t>(u >> 16);
      std::memcpy(&v[i * esz], &h, 2);
    } else {
      int32_t x = static_cast<int32_t>(rng() % 200001) - 100000;
      std::memcpy(&v[i * esz], &x, 4);
    }
  }
  return v;
}

// A device buffer holding `bytes` (at least one byte allocated).
char* ToDevice(FakeRuntime& rt, const std::vector<char>& h, size_t bytes) {
  char* d = static_cast<char*>(rt.DeviceMalloc(bytes + 1));
  if (bytes) std::memcpy(d, h.data(), bytes);
  return d;
}

// Makes a mask of n positions on `comm` and gives it a next mask chosen by top-k from a random
// statistic (the same on every rank), so k and the per-rank counts vary. kind 0: segments
// ownership with one dense segment; 1: shards, sparse; 2: the initial mask (no selection: k
// is 0); 3: shards, every segment dense (after a selection, the identity mask: no gather /
// scatter).
scapeMask_t MakeMask(RankCtx& ctx, uint64_t n, int kind, unsigned seed, double density) {
  std::vector<uint64_t> offs = {0, n / 3, n / 3 + 1, n};
  std::vector<uint8_t> dense = {0, static_cast<uint8_t>(kind == 0), 0};
  if (kind == 3) dense = {1, 1, 1};
  const scapeOwnership_t own = kind == 0 ? scapeOwnershipSegments : scapeOwnershipShards;
  scapeMask_t m = nullptr;
  EXPECT_SCAPE_OK(
      scapeMaskCreate(&m, n, 3, offs.data(), dense.data(), own, scapeMaskEncodingAuto, ctx.comm),
      ctx.comm);
  if (!m || kind == 2) return m;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> stat(n);
  for (auto& x : stat) x = nd(rng);
  EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, stat.data(), density), ctx.comm);
  EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
  EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
  EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
  return m;
}

// Every mask call on device buffers against the same call on host buffers, bit for bit.
// zeroCopy: the channel moves all-gathers directly (no staging copies to count).
bool MaskCallsMatchHost(RankCtx& ctx, uint64_t n, int kind, scapeDataType_t t, scapeRedOp_t op,
                        bool inPlace, unsigned seed, bool zeroCopy = false) {
  FakeRuntime& rt = Fake();
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " kind=" << kind << " type=" << t << " op=" << op
               << " inPlace=" << inPlace << " rank=" << ctx.rank << " seed=" << seed);
  scapeMask_t m = MakeMask(ctx, n, kind, seed, 0.05 + (seed % 7) * 0.1);
  if (!m) return false;
  const size_t esz = scapeTypeSize(t);
  uint64_t k = 0, mine = 0, off = 0;
  EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
  EXPECT_SCAPE_OK(scapeMaskGetRankCount(m, ctx.rank, &mine, &off), ctx.comm);
  if (kind == 2) {
    EXPECT_EQ(k, 0u) << "the initial mask of a mask without dense segments should be empty";
  }
  if (kind == 3) {
    EXPECT_EQ(k, n) << "a mask of dense segments only should hold every position";
  }
  std::mt19937 rng(seed * 131u + static_cast<unsigned>(ctx.rank));
  void* s = rt.NewStream();
  auto sync = [&]() { EXPECT_TRUE(rt.StreamOf(s)->Sync()); };
  auto same = [&](const char* what, const char* got, const std::vector<char>& want) {
    if (want.empty()) return;
    EXPECT_EQ(std::memcmp(got, want.data(), want.size()), 0)
        << what << ": device result differs from the host call";
  };

  // Packed all-reduce (k values).
  {
    std::vector<char> in = RandomValues(rng, k, t), junk = RandomValues(rng, k, t);
    std::vector<char> hin = in, hout = inPlace ? in : junk;
    EXPECT_SCAPE_OK(scapeMaskAllReducePacked(inPlace ? hout.data() : hin.data(), hout.data(), t, op,
                                             m, ctx.comm, nullptr),
                    ctx.comm);
    char* ds = ToDevice(rt, in, k * esz);
    char* dr = inPlace ? ds : ToDevice(rt, junk, k * esz);
    const uint64_t d2h0 = rt.d2hCopies;
    EXPECT_SCAPE_OK(scapeMaskAllReducePacked(ds, dr, t, op, m, ctx.comm, s), ctx.comm);
    sync();
    if (k) {
      EXPECT_GT(rt.d2hCopies.load(), d2h0) << "the packed all-reduce was not staged";
    }
    same("packed all-reduce", dr, hout);
    rt.DeviceFree(ds);
    if (!inPlace) rt.DeviceFree(dr);
  }
  // Packed reduce-scatter (k values in, this rank's block out) and all-gather (the reverse).
  {
    std::vector<char> in = RandomValues(rng, k, t), junk = RandomValues(rng, mine, t);
    std::vector<char> hout = junk;
    EXPECT_SCAPE_OK(scapeMaskReduceScatter(in.data(), hout.data(), t, op, m, ctx.comm, nullptr),
                    ctx.comm);
    char* ds = ToDevice(rt, in, k * esz);
    char* dr = ToDevice(rt, junk, mine * esz);
    const uint64_t d2h0 = rt.d2hCopies;
    EXPECT_SCAPE_OK(scapeMaskReduceScatter(ds, dr, t, op, m, ctx.comm, s), ctx.comm);
    sync();
    if (k) {
      EXPECT_GT(rt.d2hCopies.load(), d2h0) << "the packed reduce-scatter was not staged";
    }
    same("packed reduce-scatter", dr, hout);
    rt.DeviceFree(ds);
    rt.DeviceFree(dr);
  }
  {
    std::vector<char> in = RandomValues(rng, mine, t), junk = RandomValues(rng, k, t);
    std::vector<char> hout = junk;
    if (inPlace && mine) std::memcpy(hout.data() + off * esz, in.data(), mine * esz);
    EXPECT_SCAPE_OK(scapeMaskAllGather(inPlace ? hout.data() + off * esz : in.data(), hout.data(),
                                       t, m, ctx.comm, nullptr),
                    ctx.comm);
    char* dr = ToDevice(rt, junk, k * esz);
    char* ds = nullptr;
    if (inPlace) {
      if (mine) std::memcpy(dr + off * esz, in.data(), mine * esz);
    } else {
      ds = ToDevice(rt, in, mine * esz);
    }
    const uint64_t h2d0 = rt.h2dCopies;
    EXPECT_SCAPE_OK(scapeMaskAllGather(inPlace ? dr + off * esz : ds, dr, t, m, ctx.comm, s),
                    ctx.comm);
    sync();
    if (k && !zeroCopy) {
      EXPECT_GT(rt.h2dCopies.load(), h2d0) << "the packed all-gather was not staged";
    }
    if (zeroCopy) {
      EXPECT_EQ(rt.h2dCopies.load(), h2d0) << "zero copy: the packed all-gather was staged";
    }
    same("packed all-gather", dr, hout);
    rt.DeviceFree(ds);
    rt.DeviceFree(dr);
  }
  // The masked dense-in/dense-out all-reduce: n values; positions outside the mask of recvbuf
  // keep their bytes (not in place: recvbuf starts as junk).
  {
    std::vector<char> in = RandomValues(rng, n, t), junk = RandomValues(rng, n, t);
    std::vector<char> hs = in, hr = inPlace ? in : junk;
    EXPECT_SCAPE_OK(
        scapeAllReduce(inPlace ? hr.data() : hs.data(), hr.data(), n, t, op, m, ctx.comm, nullptr),
        ctx.comm);
    char* ds = ToDevice(rt, in, n * esz);
    char* dr = inPlace ? ds : ToDevice(rt, junk, n * esz);
    const uint64_t g0 = rt.gathers, s0 = rt.scatters, d2h0 = rt.d2hCopies;
    EXPECT_SCAPE_OK(scapeAllReduce(ds, dr, n, t, op, m, ctx.comm, s), ctx.comm);
    sync();
    if (k) {
      EXPECT_GT(rt.d2hCopies.load(), d2h0) << "the masked all-reduce was not staged";
      if (kind == 0 || k != n) {  // the identity mask (shards, k == n): no gather / scatter
        EXPECT_EQ(rt.gathers - g0, 1u) << "the mask's positions were not gathered on the device";
        EXPECT_EQ(rt.scatters - s0, 1u) << "the result was not scattered on the device";
      }
    }
    same("masked all-reduce", dr, hr);
    if (!inPlace) same("masked all-reduce (sendbuf untouched)", ds, in);
    rt.DeviceFree(ds);
    if (!inPlace) rt.DeviceFree(dr);
  }
  // Pack / unpack (default stream).
  {
    std::vector<char> dense = RandomValues(rng, n, t), pjunk = RandomValues(rng, k, t);
    std::vector<char> hp = pjunk;
    EXPECT_SCAPE_OK(scapeMaskPack(m, dense.data(), hp.data(), t), ctx.comm);
    char* dd = ToDevice(rt, dense, n * esz);
    char* dp = ToDevice(rt, pjunk, k * esz);
    const uint64_t g0 = rt.gathers, s0 = rt.scatters;
    EXPECT_SCAPE_OK(scapeMaskPack(m, dd, dp, t), ctx.comm);
    EXPECT_TRUE(rt.StreamSynchronize(nullptr).ok());
    same("pack", dp, hp);
    std::vector<char> packed = RandomValues(rng, k, t), djunk = RandomValues(rng, n, t);
    std::vector<char> hd = djunk;
    EXPECT_SCAPE_OK(scapeMaskUnpack(m, packed.data(), hd.data(), t), ctx.comm);
    if (k) std::memcpy(dp, packed.data(), k * esz);
    std::memcpy(dd, djunk.data(), n * esz);
    EXPECT_SCAPE_OK(scapeMaskUnpack(m, dp, dd, t), ctx.comm);
    EXPECT_TRUE(rt.StreamSynchronize(nullptr).ok());
    same("unpack", dd, hd);
    EXPECT_EQ(rt.gathers - g0, k ? 1u : 0u) << "pack did not gather on the device";
    EXPECT_EQ(rt.scatters - s0, k ? 1u : 0u) << "unpack did not scatter on the device";
    rt.DeviceFree(dd);
    rt.DeviceFree(dp);
  }
  EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
  return !::testing::Test::HasFailure();
}

class DeviceMask : public ::testing::TestWithParam<int> {};

TEST_P(DeviceMask, EveryMaskCallOnDeviceBuffersMatchesTheHostCall) {
  const int P = GetParam();
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "8192", 1);
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(P, [&](RankCtx& ctx) {
    unsigned s = seed;
    for (uint64_t n : {uint64_t{3}, uint64_t{1001}, uint64_t{30011}})
      for (int kind = 0; kind < 4; ++kind)
        for (bool inPlace : {false, true}) {
          const scapeDataType_t t = (s % 3 == 0)   ? scapeFloat32
                                    : (s % 3 == 1) ? scapeBfloat16
                                                   : scapeInt32;
          const scapeRedOp_t op = static_cast<scapeRedOp_t>(s % scapeNumOps);
          if (!MaskCallsMatchHost(ctx, n, kind, t, op, inPlace, s++)) return false;
        }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceMask, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// With zero copy (forced on: the fake's "device" memory is host memory UCX can move), the
// packed all-gather runs on the caller's buffers with the mask's per-rank blocks: the same bits.
TEST(DeviceMaskZeroCopy, PackedAllGatherMovesDeviceBuffersDirectly) {
  const unsigned seed = scape_test::FreshSeed();
  for (int P : {2, 3}) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      Fake();
      scape::device::SetZeroCopyForTesting(1);  // before the first device collective
      unsigned s = seed;
      for (uint64_t n : {uint64_t{7}, uint64_t{20011}})
        for (int kind : {0, 1, 2})
          for (bool inPlace : {false, true})
            if (!MaskCallsMatchHost(ctx, n, kind, scapeFloat32, scapeSum, inPlace, s++, true))
              return false;
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// The masked all-reduce and the packed all-reduce enqueue and return while their stream is
// held: nothing is written before the stream runs; then the results follow stream order.
TEST(DeviceMaskStream, CallsEnqueueAndReturn) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 5003;
    scapeMask_t m = MakeMask(ctx, n, 1, 77, 0.2);
    if (!m) return false;
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
    std::vector<uint64_t> idx(k);
    EXPECT_SCAPE_OK(scapeMaskGetIndices(m, idx.data(), k), ctx.comm);
    auto* d = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(i % 11) + ctx.rank;
    auto* p = static_cast<int32_t*>(rt.DeviceMalloc(k * 4 + 4));
    for (uint64_t i = 0; i < k; ++i) p[i] = 1;
    void* s = rt.NewStream();
    Gate gate;
    rt.HoldStream(s, &gate);
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, m, ctx.comm, s), ctx.comm);
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, m, ctx.comm, s), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskAllReducePacked(p, p, scapeInt32, scapeSum, m, ctx.comm, s), ctx.comm);
    for (uint64_t i = 0; i < n; ++i)
      if (d[i] != static_cast<int32_t>(i % 11) + ctx.rank) {
        ADD_FAILURE() << "element " << i << " changed before the stream reached the call";
        break;
      }
    for (uint64_t i = 0; i < k; ++i)
      if (p[i] != 1) {
        ADD_FAILURE() << "packed element " << i << " changed before the stream ran";
        break;
      }
    gate.Open();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    std::vector<char> inMask(n, 0);
    for (uint64_t i : idx) inMask[i] = 1;
    for (uint64_t i = 0; i < n; ++i) {
      const int32_t v = static_cast<int32_t>(i % 11);
      // Twice summed over 2 ranks: (2v + 1) * 2; outside the mask: unchanged.
      const int32_t want = inMask[i] ? (2 * v + 1) * 2 : v + ctx.rank;
      if (d[i] != want) {
        ADD_FAILURE() << "element " << i << " = " << d[i] << ", want " << want;
        break;
      }
    }
    for (uint64_t i = 0; i < k; ++i)
      if (p[i] != 2) {
        ADD_FAILURE() << "packed element " << i << " = " << p[i] << ", want 2";
        break;
      }
    rt.DeviceFree(d);
    rt.DeviceFree(p);
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The stream forms of the calls that otherwise run on the default stream (issue 31: the
// Python binding passes the framework's current stream): scapeMaskPackStream /
// scapeMaskUnpackStream enqueue on the given stream and return, the top-k of a device statistic
// runs after the work queued on it; the results equal the default-stream forms'.
TEST(DeviceMaskStream, PackUnpackAndTopkStreamFormsRunOnTheirStream) {
  auto res = RunRanks(1, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 999;
    scapeMask_t m = MakeMask(ctx, n, 1, 78, 0.1);
    if (!m) return false;
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
    std::vector<uint64_t> idx(k);
    EXPECT_SCAPE_OK(scapeMaskGetIndices(m, idx.data(), k), ctx.comm);
    auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
    for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<float>(i);
    auto* p = static_cast<float*>(rt.DeviceMalloc(k * 4 + 4));
    auto* out = static_cast<float*>(rt.DeviceMalloc(n * 4));
    void* s = rt.NewStream();
    Gate gate;
    rt.HoldStream(s, &gate);
    EXPECT_SCAPE_OK(scapeMaskPackStream(m, d, p, scapeFloat32, s), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskUnpackStream(m, p, out, scapeFloat32, s), ctx.comm);
    EXPECT_TRUE(rt.StreamSynchronize(nullptr).ok());
    for (uint64_t j = 0; j < k; ++j)
      if (p[j] != 0.0f) {
        ADD_FAILURE() << "packed element " << j << " written before the stream reached the call";
        break;
      }
    gate.Open();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    for (uint64_t j = 0; j < k; ++j) EXPECT_EQ(p[j], static_cast<float>(idx[j])) << j;
    for (uint64_t j = 0; j < k; ++j) EXPECT_EQ(out[idx[j]], static_cast<float>(idx[j])) << j;
    // The top-k of a statistic written by a copy still queued on the stream sees its values.
    std::vector<float> stat(n, 0.0f);
    stat[7] = 5.0f;
    stat[500] = -9.0f;
    auto* dstat = static_cast<float*>(rt.DeviceMalloc(n * 4));
    Gate g2;
    rt.HoldStream(s, &g2);
    EXPECT_TRUE(rt.CopyAsync(dstat, stat.data(), n * 4, s).ok());
    std::thread opener([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      g2.Open();
    });
    // One position per segment piece (density below 1/length: k = 1 each): 7, the one-element
    // segment's 333, and 500.
    EXPECT_SCAPE_OK(scapeMaskSelectNextTopkStream(m, dstat, 1e-6, s), ctx.comm);
    opener.join();
    EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
    uint64_t k2 = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k2), ctx.comm);
    std::vector<uint64_t> sel(k2);
    EXPECT_SCAPE_OK(scapeMaskGetIndices(m, sel.data(), sel.size()), ctx.comm);
    std::sort(sel.begin(), sel.end());
    EXPECT_EQ(sel, (std::vector<uint64_t>{7, 333, 500}));
    rt.DeviceFree(d);
    rt.DeviceFree(p);
    rt.DeviceFree(out);
    rt.DeviceFree(dstat);
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Host/device mixes name both arguments; the *Async forms with device buffers are
// scapeUnsupported (as for the dense *Async forms); nothing is sent, so the communicator and the
// mask still work afterwards.
TEST(DeviceMaskStream, MixesAndAsyncAreClearErrors) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 4096;
    scapeMask_t m = MakeMask(ctx, n, 1, 5, 0.3);
    if (!m) return false;
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
    EXPECT_GT(k, 0u);
    void* d = rt.DeviceMalloc(n * 4);
    std::vector<float> h(n, 1.f);
    void* s = rt.NewStream();
    auto expectMix = [&](scapeResult_t r, const char* want) {
      EXPECT_EQ(r, scapeInvalidArgument);
      std::string msg = scapeGetLastError(ctx.comm);
      EXPECT_NE(msg.find(want), std::string::npos) << msg;
    };
    expectMix(scapeMaskAllReducePacked(d, h.data(), scapeFloat32, scapeSum, m, ctx.comm, s),
              "sendbuf is device memory but recvbuf is host memory");
    expectMix(scapeMaskReduceScatter(h.data(), d, scapeFloat32, scapeSum, m, ctx.comm, s),
              "sendbuf is host memory but recvbuf is device memory");
    expectMix(scapeMaskAllGather(d, h.data(), scapeFloat32, m, ctx.comm, s),
              "sendbuf is device memory but recvbuf is host memory");
    expectMix(scapeAllReduce(h.data(), d, n, scapeFloat32, scapeSum, m, ctx.comm, s),
              "sendbuf is host memory but recvbuf is device memory");
    expectMix(scapeMaskPack(m, d, h.data(), scapeFloat32),
              "dense is device memory but packed is host memory");
    expectMix(scapeMaskUnpack(m, d, h.data(), scapeFloat32),
              "dense is host memory but packed is device memory");
    scapeRequest_t req = nullptr;
    auto expectAsync = [&](scapeResult_t r) {
      EXPECT_EQ(r, scapeUnsupported);
      std::string msg = scapeGetLastError(ctx.comm);
      EXPECT_NE(msg.find("blocking form"), std::string::npos) << msg;
      EXPECT_EQ(req, nullptr);
    };
    expectAsync(scapeMaskAllReducePackedAsync(d, d, scapeFloat32, scapeSum, m, ctx.comm, s, &req));
    expectAsync(scapeMaskReduceScatterAsync(d, d, scapeFloat32, scapeSum, m, ctx.comm, s, &req));
    expectAsync(scapeMaskAllGatherAsync(d, d, scapeFloat32, m, ctx.comm, s, &req));
    expectAsync(scapeAllReduceAsync(d, d, n, scapeFloat32, scapeSum, m, ctx.comm, s, &req));
    // A wrong count with a mask and device buffers: the host path's argument error.
    EXPECT_EQ(scapeAllReduce(d, d, n - 1, scapeFloat32, scapeSum, m, ctx.comm, s),
              scapeInvalidArgument);
    // Still works, on both paths.
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, m, ctx.comm, s), ctx.comm);
    EXPECT_SCAPE_OK(
        scapeAllReduce(h.data(), h.data(), n, scapeFloat32, scapeSum, m, ctx.comm, nullptr),
        ctx.comm);
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    scapeResult_t ae = scapeInternalError;
    EXPECT_SCAPE_OK(scapeCommGetAsyncError(ctx.comm, &ae), ctx.comm);
    EXPECT_EQ(ae, scapeSuccess);
    rt.DeviceFree(d);
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Device memory of a call in flight (the positions, the packed temporary) is not freed under it:
// the mask destroyed right after the call, with the stream still held, and the work then runs
// (the fake fails the stream if an op finds one of its buffers freed). Pack on the default
// stream the same way.
TEST(DeviceMaskStream, DestroyingTheMaskDoesNotFreeMemoryInFlight) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 4001;
    scapeMask_t m = MakeMask(ctx, n, 0, 31, 0.2);
    if (!m) return false;
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
    std::vector<uint64_t> idx(k);
    EXPECT_SCAPE_OK(scapeMaskGetIndices(m, idx.data(), k), ctx.comm);
    auto* d = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(i % 5);
    auto* p = static_cast<int32_t*>(rt.DeviceMalloc(k * 4 + 4));
    void* s = rt.NewStream();
    Gate gate, gate0;
    rt.HoldStream(s, &gate);
    rt.HoldStream(nullptr, &gate0);
    const uint64_t live0 = rt.deviceLive;
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, m, ctx.comm, s), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskPack(m, d, p, scapeInt32), ctx.comm);
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    EXPECT_GT(rt.deviceLive.load(), live0) << "memory of the calls in flight was freed";
    gate.Open();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    EXPECT_TRUE(rt.StreamError(s).ok()) << rt.StreamError(s).message();
    gate0.Open();  // the pack runs after the all-reduce (it was queued on the default stream)
    EXPECT_TRUE(rt.StreamOf(nullptr)->Sync());
    EXPECT_TRUE(rt.StreamError(nullptr).ok()) << rt.StreamError(nullptr).message();
    std::vector<char> inMask(n, 0);
    for (uint64_t i : idx) inMask[i] = 1;
    for (uint64_t i = 0; i < n; ++i) {
      const int32_t want = static_cast<int32_t>(i % 5) * (inMask[i] ? 2 : 1);
      if (d[i] != want) {
        ADD_FAILURE() << "element " << i << " = " << d[i] << ", want " << want;
        break;
      }
    }
    // The pack read d either before or after the all-reduce (streams are independent): each
    // packed value is the element's value before or after.
    for (uint64_t i = 0; i < k; ++i) {
      const int32_t v = static_cast<int32_t>(idx[i] % 5);
      if (p[i] != v && p[i] != 2 * v) {
        ADD_FAILURE() << "packed element " << i << " = " << p[i];
        break;
      }
    }
    // The finished calls' blocks went back to the communicator's device pool, which keeps at
    // most kMaxIdle of them for the next calls (and frees them with the communicator).
    scapeMask_t m2 = MakeMask(ctx, n, 1, 32, 0.2);
    if (!m2) return false;
    EXPECT_SCAPE_OK(scapeMaskDestroy(m2), ctx.comm);
    EXPECT_LE(rt.deviceLive.load() - live0, scape::device::DevicePool::kMaxIdle)
        << "more device memory kept than the pool's idle bound";
    rt.DeviceFree(d);
    rt.DeviceFree(p);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The device copy of the mask's positions is uploaded once per mask generation (several calls,
// a sync in flight: no upload), into device buffers reused while they are large enough; after
// each advance (k up, then down) the results are still the host call's; destroying the mask
// frees everything.
TEST(DeviceMaskStream, PositionsAreCachedPerGenerationAndFreed) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 3001;
    void* s = rt.NewStream();
    auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
    const uint64_t live0 = rt.deviceLive;
    scapeMask_t m = MakeMask(ctx, n, 1, 9, 0.1);
    if (!m) return false;
    std::mt19937 rng(5u + static_cast<unsigned>(ctx.rank));
    // One masked all-reduce on the device against the host call.
    auto matchesHost = [&](const char* what) {
      std::vector<char> in = RandomValues(rng, n, scapeFloat32), h = in;
      EXPECT_SCAPE_OK(
          scapeAllReduce(h.data(), h.data(), n, scapeFloat32, scapeSum, m, ctx.comm, nullptr),
          ctx.comm);
      std::memcpy(d, in.data(), n * 4);
      EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, m, ctx.comm, s), ctx.comm);
      EXPECT_TRUE(rt.StreamOf(s)->Sync());
      EXPECT_EQ(std::memcmp(d, h.data(), n * 4), 0) << what << ": differs from the host call";
    };
    auto advance = [&](double density) {
      std::vector<float> stat(n);
      for (uint64_t i = 0; i < n; ++i) stat[i] = static_cast<float>((i * 7919 + 13) % 1000);
      EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, stat.data(), density), ctx.comm);
      EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
      // While the next mask syncs, the current one is unchanged: nothing is allocated.
      const uint64_t a = rt.deviceAllocs;
      EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, m, ctx.comm, s), ctx.comm);
      EXPECT_EQ(rt.deviceAllocs - a, 0u) << "device memory was allocated again";
      EXPECT_TRUE(rt.StreamOf(s)->Sync());  // before the next test writes d
      EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
      EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
    };
    const uint64_t allocs0 = rt.deviceAllocs;
    for (int i = 0; i < 3; ++i) matchesHost("first mask");
    // One positions buffer and one packed temporary, reused by the three calls.
    EXPECT_EQ(rt.deviceAllocs - allocs0, 2u);
    advance(0.3);  // k grows: both buffers grow
    const uint64_t allocs1 = rt.deviceAllocs;
    matchesHost("second mask (larger)");
    EXPECT_EQ(rt.deviceAllocs - allocs1, 2u);
    advance(0.02);  // k shrinks: the buffers are reused, the new positions uploaded into them
    const uint64_t allocs2 = rt.deviceAllocs;
    matchesHost("third mask (smaller)");
    EXPECT_EQ(rt.deviceAllocs - allocs2, 0u);
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    // Destroying the mask (its work done) hands its blocks back to the communicator's pool,
    // which keeps at most kMaxIdle idle ones.
    EXPECT_LE(rt.deviceLive.load() - live0, scape::device::DevicePool::kMaxIdle)
        << "device memory of the mask calls was kept beyond the pool's idle bound";
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The cached device positions are keyed on the stream's handle, and a runtime hands a
// destroyed stream's handle to a new stream: a pack on the new stream must wait for the
// upload still queued on the old one (here behind a held gate), not read the block before it.
TEST(DeviceMaskStream, ANewStreamAtADestroyedStreamsHandleWaitsForTheUpload) {
  auto res = RunRanks(1, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 3001;
    scapeMask_t m = MakeMask(ctx, n, 1, 9, 0.1);
    if (!m) return false;
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
    std::vector<float> h(n), want(k);
    for (uint64_t i = 0; i < n; ++i) h[i] = static_cast<float>(i) + 0.5f;
    EXPECT_SCAPE_OK(scapeMaskPack(m, h.data(), want.data(), scapeFloat32), ctx.comm);
    auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
    auto* p1 = static_cast<float*>(rt.DeviceMalloc(k * 4));
    auto* p2 = static_cast<float*>(rt.DeviceMalloc(k * 4));
    std::memcpy(d, h.data(), n * 4);
    void* a = nullptr;
    void* b = nullptr;
    EXPECT_TRUE(rt.StreamCreate(&a).ok());
    Gate gate;
    rt.HoldStream(a, &gate);
    EXPECT_SCAPE_OK(scapeMaskPackStream(m, d, p1, scapeFloat32, a), ctx.comm);
    rt.StreamDestroy(a);  // its queued work (the upload) still runs once the gate opens
    EXPECT_TRUE(rt.StreamCreate(&b).ok());
    EXPECT_EQ(a, b) << "the fake did not reuse the handle: the test shows nothing";
    EXPECT_SCAPE_OK(scapeMaskPackStream(m, d, p2, scapeFloat32, b), ctx.comm);
    std::thread opener([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      gate.Open();
    });
    EXPECT_TRUE(rt.StreamSynchronize(b).ok()) << rt.StreamError(b).message();
    opener.join();
    EXPECT_EQ(std::memcmp(p2, want.data(), k * 4), 0) << "the pack read positions not uploaded yet";
    // The mask first: it hands its blocks back on the stream it used (a live handle).
    EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    rt.StreamDestroy(b);
    rt.DeviceFree(d);
    rt.DeviceFree(p1);
    rt.DeviceFree(p2);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The device top-k's host wait keeps the communicator's deadline behind a held stream: the
// selected positions come back into page-locked memory (a copy into pageable memory returns
// only once it has run, which waited here until the gate opened).
TEST(DeviceMaskStream, TopkBehindAHeldStreamTimesOutWithinTheTimeout) {
  scape_test::RankOptions opts;
  opts.timeoutMs = 1000;
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        FakeRuntime& rt = Fake();
        const uint64_t n = 3001;
        scapeMask_t m = MakeMask(ctx, n, 1, 9, 0.1);
        if (!m) return false;
        auto* dstat = static_cast<float*>(rt.DeviceMalloc(n * 4));
        void* s = rt.NewStream();
        Gate gate;
        rt.HoldStream(s, &gate);
        std::thread opener([&] {
          std::this_thread::sleep_for(std::chrono::seconds(6));
          gate.Open();
        });
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(scapeMaskSelectNextTopkStream(m, dstat, 0.1, s), scapeTimeout);
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_LT(sec, 4.0) << "the top-k's host wait ignored the timeout";
        opener.join();
        EXPECT_TRUE(rt.StreamSynchronize(s).ok());
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
        rt.DeviceFree(dstat);
        return !::testing::Test::HasFailure();
      },
      opts);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Top-k from a device statistic: the top-k runs on the device (over the segments this rank
// owns) and only the selected positions come back; the next mask is the one the same
// statistic in host memory selects, on 1-3 ranks, both ownerships, several densities.
TEST(DeviceMaskTopk, DeviceStatisticSelectsTheHostMask) {
  const unsigned seed = scape_test::FreshSeed();
  for (int P = 1; P <= 3; ++P) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      FakeRuntime& rt = Fake();
      for (int trial = 0; trial < 4; ++trial) {
        const uint64_t n = 20011 + 17 * static_cast<uint64_t>(trial);
        const uint64_t offs[] = {0, 1000, 1003, 9000, n};
        const uint8_t dense[] = {0, 1, 0, 0};
        const double density = trial == 3 ? 1.0 : 0.003 + 0.05 * trial;
        const scapeOwnership_t own = trial % 2 ? scapeOwnershipSegments : scapeOwnershipShards;
        SCOPED_TRACE(::testing::Message() << "P=" << P << " trial=" << trial << " rank=" << ctx.rank
                                          << " seed=" << seed);
        std::mt19937 rng(seed + static_cast<unsigned>(trial));  // the same on every rank
        std::normal_distribution<float> nd(0.f, 1.f);
        std::vector<float> stat(n);
        for (auto& x : stat) x = nd(rng);
        auto* dstat = static_cast<float*>(rt.DeviceMalloc(n * 4));
        std::memcpy(dstat, stat.data(), n * 4);
        std::vector<uint64_t> got[2];
        for (int which = 0; which < 2; ++which) {
          scapeMask_t m = nullptr;
          EXPECT_SCAPE_OK(
              scapeMaskCreate(&m, n, 4, offs, dense, own, scapeMaskEncodingAuto, ctx.comm),
              ctx.comm);
          if (!m) return false;
          const uint64_t topks = rt.topks, bytes = rt.copiedBytes;
          EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, which ? dstat : stat.data(), density),
                          ctx.comm);
          const uint64_t copied = rt.copiedBytes - bytes;
          if (which) {
            EXPECT_EQ(rt.topks - topks, 1u) << "the top-k did not run on the device";
          }
          EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
          EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
          EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
          uint64_t k = 0;
          EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
          uint64_t mine = 0;
          EXPECT_SCAPE_OK(scapeMaskGetRankCount(m, ctx.rank, &mine, nullptr), ctx.comm);
          if (which) {
            // The always-dense segment [1000, 1003) is added by the mask, not selected: only
            // the positions the top-k chose in this rank's sparse pieces come back.
            size_t nr = 0;
            EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(m, ctx.rank, nullptr, 0, &nr), ctx.comm);
            std::vector<uint64_t> rg(2 * nr);
            EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(m, ctx.rank, rg.data(), nr, &nr), ctx.comm);
            uint64_t ownedDense = 0;
            for (size_t r = 0; r < nr; ++r) {
              const uint64_t lo = std::max<uint64_t>(rg[2 * r], 1000),
                             hi = std::min<uint64_t>(rg[2 * r + 1], 1003);
              if (hi > lo) ownedDense += hi - lo;
            }
            EXPECT_EQ(copied, (mine - ownedDense) * 8)
                << "not just this rank's selected positions came back";
          }
          got[which].resize(k);
          EXPECT_SCAPE_OK(scapeMaskGetIndices(m, got[which].data(), k), ctx.comm);
          EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
        }
        EXPECT_GT(got[0].size(), 3u);
        EXPECT_EQ(got[0], got[1]) << "device and host statistics selected different masks";
        rt.DeviceFree(dstat);
      }
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

}  // namespace

// Issue 24 item 3: one device pool serves every device temporary of the mask calls, so a
// training loop's steady state makes no cudaMalloc / cudaFree: device top-k, mask sync and
// advance, masked all-reduce on a stream, pack and unpack on the default stream, step after
// step. Counted with the fake runtime; the results are checked against the host calls.
TEST(DeviceMaskPool, SteadyStateAllocatesNothing) {
  const unsigned seed = scape_test::FreshSeed();
  for (int P = 1; P <= 3; P += 2) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      FakeRuntime& rt = Fake();
      SCOPED_TRACE(::testing::Message() << "P=" << P << " rank=" << ctx.rank << " seed=" << seed);
      const uint64_t n = 30011;
      const uint64_t offs[] = {0, 7000, 7003, n};
      const uint8_t dense[] = {0, 1, 0};
      scapeMask_t m = nullptr;
      EXPECT_SCAPE_OK(scapeMaskCreate(&m, n, 3, offs, dense, scapeOwnershipShards,
                                      scapeMaskEncodingAuto, ctx.comm),
                      ctx.comm);
      if (!m) return false;
      auto* dstat = static_cast<float*>(rt.DeviceMalloc(n * 4));
      auto* dvals = static_cast<float*>(rt.DeviceMalloc(n * 4));
      auto* dpacked = static_cast<float*>(rt.DeviceMalloc(n * 4));
      void* s = rt.NewStream();
      std::mt19937 rng(seed);  // the same statistic on every rank: an agreed mask either way
      std::normal_distribution<float> nd(0.f, 1.f);
      std::mt19937 vr(seed * 31u + static_cast<unsigned>(ctx.rank));
      std::uniform_int_distribution<int> vi(-8, 8);  // small integers: sums are exact
      uint64_t allocsAfterWarmup = 0;
      const int kSteps = 6;
      for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(::testing::Message() << "step " << step);
        std::vector<float> stat(n), vals(n);
        for (auto& x : stat) x = nd(rng);
        for (auto& x : vals) x = static_cast<float>(vi(vr));
        std::memcpy(dstat, stat.data(), n * 4);
        std::memcpy(dvals, vals.data(), n * 4);
        if (step == 2) allocsAfterWarmup = rt.deviceAllocs;
        EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, dstat, 0.02), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
        std::vector<float> want = vals;
        EXPECT_SCAPE_OK(scapeAllReduce(want.data(), want.data(), n, scapeFloat32, scapeSum, m,
                                       ctx.comm, nullptr),
                        ctx.comm);
        EXPECT_SCAPE_OK(scapeAllReduce(dvals, dvals, n, scapeFloat32, scapeSum, m, ctx.comm, s),
                        ctx.comm);
        EXPECT_TRUE(rt.StreamOf(s)->Sync());
        EXPECT_EQ(std::memcmp(dvals, want.data(), n * 4), 0) << "masked all-reduce";
        uint64_t k = 0;
        EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
        std::vector<float> packed(k);
        EXPECT_SCAPE_OK(scapeMaskPack(m, want.data(), packed.data(), scapeFloat32), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskPack(m, dvals, dpacked, scapeFloat32), ctx.comm);
        EXPECT_SCAPE_OK(scapeMaskUnpack(m, dpacked, dstat, scapeFloat32), ctx.comm);
        EXPECT_TRUE(rt.StreamOf(nullptr)->Sync());
        EXPECT_EQ(std::memcmp(dpacked, packed.data(), k * 4), 0) << "pack";
      }
      EXPECT_GT(allocsAfterWarmup, 0u);
      EXPECT_EQ(rt.deviceAllocs.load(), allocsAfterWarmup)
          << "device memory allocated in the steady state (steps 2.." << kSteps - 1 << ")";
      EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
      rt.DeviceFree(dstat);
      rt.DeviceFree(dvals);
      rt.DeviceFree(dpacked);
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << res.Describe();
  }
}
