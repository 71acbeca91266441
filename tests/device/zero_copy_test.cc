// Zero copy of device buffers on the UCX backend (plugin/device/staging.h, MakeDirectPlan): when
// every rank's UCX moves CUDA memory, all-gathers and broadcasts run on the caller's device
// buffers with no staging through host memory. Debian's UCX has no CUDA, so the tests force the
// path on (SetZeroCopyForTesting) with the CPU fake device, whose "device" memory is host memory
// that UCX can move; and check that the automatic choice stages on this UCX.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "plugin/device/runtime.h"
#include "plugin/device/staging.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape::coll::CollArgs;
using scape::coll::CollType;
using scape::device::MakeDirectPlan;
using scape::device::StagePlan;
using scape_test::RankCtx;
using scape_test::RunRanks;

// In a rank process: the fake runtime, installed once (leaked: it must outlive the
// communicator) and the zero-copy mode chosen before the first device collective.
FakeRuntime& Fake(int zeroCopy) {
  FakeRuntime& rt = fake_device::InstalledFake();
  scape::device::SetZeroCopyForTesting(zeroCopy);
  return rt;
}

TEST(ZeroCopyPlan, AllGatherPlacesTheOwnBlockAndMovesNothingElse) {
  std::vector<char> send(64), recv(256);
  CollArgs a;
  a.type = CollType::kAllGather;
  a.dtype = scapeFloat32;
  a.count = 5;
  a.send = send.data();
  a.recv = recv.data();
  StagePlan p;
  ASSERT_TRUE(MakeDirectPlan(a, 2, 4, &p).ok());
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.sendStageBytes + p.recvStageBytes, 0u) << "zero copy allocates no stage";
  const auto& c = p.chunks[0];
  EXPECT_EQ(c.count, 5u);
  EXPECT_EQ(c.sendOff, 2u * 5 * 4);
  EXPECT_EQ(c.recvOff, 0u);
  ASSERT_EQ(c.d2h.size(), 1u);
  EXPECT_EQ(c.d2h[0].dst, 40u);
  EXPECT_EQ(c.d2h[0].src, 0u);
  EXPECT_EQ(c.d2h[0].bytes, 20u);
  EXPECT_TRUE(c.h2d.empty());

  // Per-rank blocks (the values-only all-gather of a mask): the own block's offset is the sum of
  // the blocks before it; an empty own block copies nothing.
  a.counts = {3, 0, 7, 1};
  a.dtype = scapeBfloat16;
  ASSERT_TRUE(MakeDirectPlan(a, 2, 4, &p).ok());
  EXPECT_EQ(p.chunks[0].count, 11u);
  EXPECT_EQ(p.chunks[0].sendOff, 3u * 2);
  ASSERT_EQ(p.chunks[0].d2h.size(), 1u);
  EXPECT_EQ(p.chunks[0].d2h[0].bytes, 14u);
  ASSERT_TRUE(MakeDirectPlan(a, 1, 4, &p).ok());
  EXPECT_TRUE(p.chunks[0].d2h.empty());
  a.send = recv.data() + 6;  // in place: the own block of recvbuf
  ASSERT_TRUE(MakeDirectPlan(a, 2, 4, &p).ok());
  EXPECT_TRUE(p.chunks[0].d2h.empty()) << "in place copies nothing";
  a.counts = {1, 2};
  EXPECT_FALSE(MakeDirectPlan(a, 1, 4, &p).ok()) << "counts of the wrong length";
}

TEST(ZeroCopyPlan, BroadcastCopiesOnlyAtTheRootAndReductionsAreRefused) {
  std::vector<char> send(72), recv(72);
  CollArgs a;
  a.type = CollType::kBroadcast;
  a.send = send.data();
  a.recv = recv.data();
  a.dtype = scapeInt64;
  a.count = 9;
  a.root = 1;
  StagePlan p;
  ASSERT_TRUE(MakeDirectPlan(a, 1, 3, &p).ok());
  ASSERT_EQ(p.chunks[0].d2h.size(), 1u);
  EXPECT_EQ(p.chunks[0].d2h[0].bytes, 72u);
  EXPECT_TRUE(p.chunks[0].hasSend);
  ASSERT_TRUE(MakeDirectPlan(a, 0, 3, &p).ok());
  EXPECT_TRUE(p.chunks[0].d2h.empty());
  EXPECT_FALSE(p.chunks[0].hasSend);
  for (CollType t : {CollType::kAllReduce, CollType::kReduceScatter}) {
    a.type = t;
    scape::Status st = MakeDirectPlan(a, 0, 3, &p);
    EXPECT_EQ(st.code(), scapeUnsupported) << st.message();
  }
}

std::vector<int32_t> Values(unsigned seed, size_t n) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng());
  return v;
}

// All-gather and broadcast on device buffers, zero copy forced: the same bits as on host
// buffers, no copy through host memory, and the all-reduce beside them still staged.
bool ZeroCopyMatchesHost(RankCtx& ctx, size_t n, bool inPlace, unsigned seed) {
  FakeRuntime& rt = Fake(1);
  SCOPED_TRACE(::testing::Message() << "n=" << n << " inPlace=" << inPlace << " rank=" << ctx.rank);
  const size_t P = static_cast<size_t>(ctx.nranks);
  const int root = static_cast<int>(seed % P);
  const std::vector<int32_t> mine = Values(seed + static_cast<unsigned>(ctx.rank), n);
  std::vector<int32_t> hostAg(P * n, -1), hostBc = mine;
  EXPECT_SCAPE_OK(scapeAllGather(mine.data(), hostAg.data(), n, scapeInt32, ctx.comm, nullptr),
                  ctx.comm);
  EXPECT_SCAPE_OK(
      scapeBroadcast(hostBc.data(), hostBc.data(), n, scapeInt32, root, ctx.comm, nullptr),
      ctx.comm);

  auto* dsend = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
  auto* dag = static_cast<int32_t*>(rt.DeviceMalloc(P * n * 4));
  auto* dbc = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
  if (n) std::memcpy(dsend, mine.data(), n * 4);
  std::fill(dag, dag + P * n, -7);
  int32_t* agSend = dsend;
  if (inPlace) {
    agSend = dag + static_cast<size_t>(ctx.rank) * n;
    if (n) std::memcpy(agSend, mine.data(), n * 4);
  }
  std::fill(dbc, dbc + n, -9);
  const int32_t* bcSend = ctx.rank == root ? (inPlace ? dbc : dsend) : nullptr;
  if (inPlace && ctx.rank == root && n) std::memcpy(dbc, mine.data(), n * 4);

  void* s = rt.NewStream();
  const uint64_t d2h0 = rt.d2hCopies, h2d0 = rt.h2dCopies, other0 = rt.otherCopies;
  EXPECT_SCAPE_OK(scapeAllGather(agSend, dag, n, scapeInt32, ctx.comm, s), ctx.comm);
  EXPECT_SCAPE_OK(scapeBroadcast(bcSend, dbc, n, scapeInt32, root, ctx.comm, s), ctx.comm);
  EXPECT_TRUE(rt.StreamOf(s)->Sync());
  EXPECT_EQ(rt.d2hCopies.load(), d2h0) << "zero copy staged through host memory";
  EXPECT_EQ(rt.h2dCopies.load(), h2d0) << "zero copy staged through host memory";
  // Out of place: the own all-gather block and the root's broadcast data are placed by
  // device-to-device copies; in place, nothing is copied at all.
  const uint64_t want = inPlace || n == 0 ? 0 : 1 + (ctx.rank == root ? 1 : 0);
  EXPECT_EQ(rt.otherCopies.load() - other0, want);
  EXPECT_TRUE(std::equal(hostAg.begin(), hostAg.end(), dag)) << "all-gather differs from host";
  EXPECT_TRUE(std::equal(hostBc.begin(), hostBc.end(), dbc)) << "broadcast differs from host";

  // A reduction on the same channel is still staged (the host reduces).
  if (n) {
    EXPECT_SCAPE_OK(scapeAllReduce(dsend, dsend, n, scapeInt32, scapeMax, nullptr, ctx.comm, s),
                    ctx.comm);
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    EXPECT_GT(rt.d2hCopies.load(), d2h0) << "the all-reduce was not staged";
  }
  rt.DeviceFree(dsend);
  rt.DeviceFree(dag);
  rt.DeviceFree(dbc);
  return !::testing::Test::HasFailure();
}

class ZeroCopy : public ::testing::TestWithParam<int> {};

TEST_P(ZeroCopy, AllGatherAndBroadcastMoveDeviceBuffersDirectly) {
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(GetParam(), [&](RankCtx& ctx) {
    unsigned s = seed;
    for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{2049}, size_t{100003}})
      for (bool inPlace : {false, true})
        if (!ZeroCopyMatchesHost(ctx, n, inPlace, s++)) return false;
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, ZeroCopy, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// The zero-copy job keeps stream order: the call returns while the stream is held, the
// exchange waits for the stream's earlier work, and later work on the stream sees its result.
TEST(ZeroCopyStream, FollowsStreamOrder) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake(1);
    const size_t n = 4099;
    auto* src = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    auto* mine = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    auto* all = static_cast<int32_t*>(rt.DeviceMalloc(2 * n * 4));
    auto* back = static_cast<int32_t*>(rt.DeviceMalloc(2 * n * 4));
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<int32_t>(i) * 10 + ctx.rank;
    std::fill(all, all + 2 * n, -1);
    void* s = rt.NewStream();
    Gate gate;
    rt.HoldStream(s, &gate);
    // On the held stream: produce the send buffer, all-gather it, copy the result onward.
    EXPECT_TRUE(rt.CopyAsync(mine, src, n * 4, s).ok());
    EXPECT_SCAPE_OK(scapeAllGather(mine, all, n, scapeInt32, ctx.comm, s), ctx.comm);
    EXPECT_TRUE(rt.CopyAsync(back, all, 2 * n * 4, s).ok());
    EXPECT_EQ(all[0], -1) << "the all-gather ran before the stream reached it";
    gate.Open();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    for (size_t r = 0; r < 2; ++r)
      for (size_t i = 0; i < n; ++i)
        if (back[r * n + i] != static_cast<int32_t>(i) * 10 + static_cast<int32_t>(r)) {
          ADD_FAILURE() << "block " << r << " element " << i << " = " << back[r * n + i];
          return false;
        }
    rt.DeviceFree(src);
    rt.DeviceFree(mine);
    rt.DeviceFree(all);
    rt.DeviceFree(back);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Automatic choice: Debian's UCX does not move CUDA memory, so every rank agrees to stage.
TEST(ZeroCopyAuto, StagesWhereUcxHasNoCudaSupport) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake(-1);
    const size_t n = 1000;
    auto* d = static_cast<int32_t*>(rt.DeviceMalloc(2 * n * 4));
    for (size_t i = 0; i < 2 * n; ++i) d[i] = static_cast<int32_t>(i) + ctx.rank;
    void* s = rt.NewStream();
    const uint64_t d2h0 = rt.d2hCopies;
    EXPECT_SCAPE_OK(
        scapeAllGather(d + static_cast<size_t>(ctx.rank) * n, d, n, scapeInt32, ctx.comm, s),
        ctx.comm);
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    EXPECT_GT(rt.d2hCopies.load(), d2h0) << "expected the staged path on this UCX";
    for (size_t r = 0; r < 2; ++r)
      EXPECT_EQ(d[r * n + 5], static_cast<int32_t>(r * n + 5) + static_cast<int32_t>(r));
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
