// The NCCL backend on real ranks without NCCL: forked ranks (tests/harness.h) each hold a
// FakeNcclComm over one shared-memory segment, so the fake libnccl (fake_libnccl.cc) really
// moves data between them, in stream order on the CPU fake device (fake_device.h). Checked:
// scapeCommInitNccl's host communicator (the bootstrap id broadcast over NCCL, then UCX), masks
// made and synced on an NCCL communicator, the packed (V) collectives on NCCL against the same
// collectives on the host communicator with host buffers (bit for bit: the values are small
// integers, exact in every summation order), the masked dense-in/out all-reduce on device
// buffers against the host masked all-reduce, and the errors (no host communicator, NCCL
// without the group calls, a rank that never comes to init).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "plugin/api/api_internal.h"
#include "plugin/backend/backend.h"
#include "plugin/coll/coll.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using scape_test::RankCtx;
using scape_test::RankOptions;
using scape_test::RunRanks;

// A validated collective on an NCCL-backend communicator's NCCL backend, as the API's routing
// hands it there (the backend's checks, then NCCL).
scape::Status NcclRun(scapeComm_t comm, const scape::coll::CollArgs& a, void* stream) {
  scape::backend::Backend* b = comm->data->device();
  if (!dynamic_cast<scape::backend::NcclBackend*>(b))
    return scape::InternalError("not an NCCL-backend communicator");
  SCAPE_RETURN_IF_ERROR(b->Admit(a, stream, false));
  return b->Run(a, stream, nullptr);
}

// fake_libnccl.cc's types (the same layout).
struct FakeNcclShared;
struct FakeNcclComm {
  int nranks, rank, failWith, asyncError;
  FakeNcclShared* shared;
  uint64_t barriers;
  int barrierTimeoutMs;
  int ops;
};
using FakeNcclFn = void (*)(void*);

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

void* FakeLib(const char* path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }

// NCCL work runs on the fake device's stream, in order with the copies and kernels there.
void EnqueueOnFake(void* stream, FakeNcclFn fn, void* arg) {
  Fake().Submit(stream, [fn, arg] { fn(arg); });
}

// A segment shared by the ranks about to be forked (made in the parent).
FakeNcclShared* NewShared(const char* lib, int nranks) {
  void* h = FakeLib(lib);
  if (!h) return nullptr;
  auto make = reinterpret_cast<FakeNcclShared* (*)(int, size_t)>(dlsym(h, "fakeNcclSharedCreate"));
  return make ? make(nranks, size_t{1} << 20) : nullptr;
}

// In a rank: the fake device, the fake NCCL's stream hook, the library path; a communicator
// of the fake NCCL for this rank.
FakeNcclComm RankSetup(const char* lib, FakeNcclShared* shared, const RankCtx& ctx) {
  Fake();
  setenv("SCAPE_NCCL_LIBRARY", lib, 1);
  void* h = FakeLib(lib);
  EXPECT_NE(h, nullptr);
  auto set = reinterpret_cast<void (*)(void (*)(void*, FakeNcclFn, void*))>(
      h ? dlsym(h, "fakeNcclSetEnqueue") : nullptr);
  EXPECT_NE(set, nullptr);
  if (set) set(EnqueueOnFake);
  FakeNcclComm fc{ctx.nranks, ctx.rank, 0, 0, shared, 0, 8000, 0};
  return fc;
}

RankOptions Opts() {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 8000;
  o.watchdogMs = 60000;
  return o;
}

// A mask of n over the ranks' shards, rank r selecting `k(r)` positions spread over its shard;
// synced and made current.
scapeMask_t MakeMask(scapeComm_t comm, int rank, uint64_t n, size_t (*k)(int), unsigned seed) {
  scapeMask_t m = nullptr;
  const uint64_t offs[2] = {0, n};
  EXPECT_SCAPE_OK(
      scapeMaskCreate(&m, n, 1, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, comm),
      comm);
  if (!m) return nullptr;
  uint64_t range[2] = {0, 0};
  size_t cnt = 0;
  EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(m, rank, range, 1, &cnt), comm);
  const uint64_t len = range[1] - range[0];
  const size_t want = std::min<size_t>(k(rank), len);
  std::mt19937 rng(seed + static_cast<unsigned>(rank));
  std::vector<uint64_t> idx;
  for (uint64_t i = range[0]; i < range[1]; ++i) idx.push_back(i);
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(want);
  std::sort(idx.begin(), idx.end());
  EXPECT_SCAPE_OK(scapeMaskSetNextIndices(m, idx.data(), idx.size()), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncStart(m), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncWait(m), comm);
  EXPECT_SCAPE_OK(scapeMaskAdvance(m), comm);
  return m;
}

// Small integers as floats / int32: every summation order gives the same bits.
template <typename T>
std::vector<T> Values(size_t n, int rank, unsigned seed) {
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank));
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(static_cast<int>(rng() % 201) - 100);
  return v;
}

// Device copy of host bytes (synchronously).
void* ToDevice(const void* h, size_t bytes) {
  void* d = Fake().DeviceMalloc(bytes + 1);
  EXPECT_TRUE(Fake().CopyAsync(d, h, bytes, nullptr).ok());
  EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
  return d;
}
template <typename T>
std::vector<T> FromDevice(const void* d, size_t n, void* stream) {
  EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
  std::vector<T> h(n);
  EXPECT_TRUE(Fake().CopyAsync(h.data(), d, n * sizeof(T), nullptr).ok());
  EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
  return h;
}

class NcclRanks : public ::testing::TestWithParam<int> {};

TEST_P(NcclRanks, InitMakesAHostCommunicatorOverTheNcclBroadcast) {
  const int P = GetParam();
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, P);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        // The id went over NCCL (one broadcast), on a stream of its own, released.
        EXPECT_EQ(fc.ops, 1);
        EXPECT_GE(Fake().streamsCreated.load(), 1u);
        EXPECT_EQ(Fake().streamsLive.load(), 0u);
        EXPECT_GE(Fake().pinnedAllocs.load(), 1u);  // the id comes back to page-locked memory
        EXPECT_EQ(Fake().pinnedLive.load(), 0u);
        int n = 0, r = -1, b = -1;
        EXPECT_SCAPE_OK(scapeCommCount(comm, &n), comm);
        EXPECT_SCAPE_OK(scapeCommUserRank(comm, &r), comm);
        EXPECT_SCAPE_OK(scapeCommGetBackend(comm, &b), comm);
        EXPECT_EQ(n, P);
        EXPECT_EQ(r, ctx.rank);
        EXPECT_EQ(b, scapeBackendNccl);
        // Host calls run on the host communicator: a barrier, host buffers (with a stream).
        EXPECT_SCAPE_OK(scapeBarrier(comm), comm);
        std::vector<int32_t> h(100, ctx.rank + 1), out(100, -1);
        EXPECT_SCAPE_OK(scapeAllReduce(h.data(), out.data(), h.size(), scapeInt32, scapeSum,
                                       nullptr, comm, Fake().NewStream()),
                        comm);
        EXPECT_EQ(out[0], P * (P + 1) / 2);
        EXPECT_EQ(out[99], P * (P + 1) / 2);
        EXPECT_EQ(fc.ops, 1) << "host buffers went to NCCL";
        // Device buffers still go to NCCL.
        void* d = ToDevice(h.data(), h.size() * 4);
        EXPECT_SCAPE_OK(
            scapeAllReduce(d, d, h.size(), scapeInt32, scapeSum, nullptr, comm, nullptr), comm);
        EXPECT_EQ(FromDevice<int32_t>(d, 100, nullptr)[7], P * (P + 1) / 2);
        EXPECT_EQ(fc.ops, 2);
        Fake().DeviceFree(d);
        scapeResult_t ae = scapeInternalError;
        EXPECT_SCAPE_OK(scapeCommGetAsyncError(comm, &ae), comm);
        EXPECT_EQ(ae, scapeSuccess);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

size_t KUnequal(int r) { return static_cast<size_t>(5 + 17 * r); }
size_t KEqual(int) { return 20; }

// The packed collectives through the NCCL backend (the NCCL backend with the mask's
// per-rank counts, as scapeMask* calls on device buffers reach it) against the same call on
// the host communicator with host buffers.
void PackedVAgainstHost(int P, const char* lib, size_t (*k)(int), bool expectGroup) {
  FakeNcclShared* shared = NewShared(lib, P);
  ASSERT_NE(shared, nullptr);
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(lib, shared, ctx);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        scapeMask_t m = MakeMask(comm, ctx.rank, 600, k, seed);
        if (!m) return false;
        uint64_t kk = 0, mine = 0, off = 0;
        EXPECT_SCAPE_OK(scapeMaskGetCount(m, &kk), comm);
        EXPECT_SCAPE_OK(scapeMaskGetRankCount(m, ctx.rank, &mine, &off), comm);
        std::vector<size_t> counts(static_cast<size_t>(P));
        for (int r = 0; r < P; ++r) {
          uint64_t c = 0;
          EXPECT_SCAPE_OK(scapeMaskGetRankCount(m, r, &c, nullptr), comm);
          counts[static_cast<size_t>(r)] = c;
          EXPECT_EQ(c, std::min<uint64_t>(k(r), 600 / P)) << "rank " << r;
        }
        void* stream = Fake().NewStream();
        const scapeRedOp_t ops[] = {scapeSum, scapeMax, scapeMin};
        for (scapeRedOp_t op : ops) {
          for (scapeDataType_t t : {scapeFloat32, scapeInt32}) {
            SCOPED_TRACE(testing::Message() << "op " << op << " type " << t);
            auto in = Values<float>(kk, ctx.rank, seed + op);
            std::vector<int32_t> ini(in.begin(), in.end());
            const void* hin = t == scapeFloat32 ? static_cast<const void*>(in.data())
                                                : static_cast<const void*>(ini.data());
            // Host reference on the host communicator.
            std::vector<char> ar(kk * 4 + 4), rs(mine * 4 + 4), ag(kk * 4 + 4);
            EXPECT_SCAPE_OK(scapeMaskAllReducePacked(hin, ar.data(), t, op, m, comm, nullptr),
                            comm);
            EXPECT_SCAPE_OK(scapeMaskReduceScatter(hin, rs.data(), t, op, m, comm, nullptr), comm);
            EXPECT_SCAPE_OK(scapeMaskAllGather(static_cast<const char*>(hin) + off * 4, ag.data(),
                                               t, m, comm, nullptr),
                            comm);
            // The same on NCCL, device buffers.
            void* dIn = ToDevice(hin, kk * 4);
            void* dOut = Fake().DeviceMalloc(kk * 4 + 4);
            scape::coll::CollArgs a;
            a.dtype = t;
            a.op = op;
            a.counts = counts;
            a.type = scape::coll::CollType::kAllReduce;
            a.count = kk;
            a.send = dIn;
            a.recv = dOut;
            EXPECT_TRUE(NcclRun(comm, a, stream).ok());
            EXPECT_EQ(std::memcmp(FromDevice<char>(dOut, kk * 4, stream).data(), ar.data(), kk * 4),
                      0)
                << "all-reduce";
            a.type = scape::coll::CollType::kReduceScatter;
            a.count = 0;
            const int before = fc.ops;
            scape::Status st = NcclRun(comm, a, stream);
            EXPECT_TRUE(st.ok()) << st.message();
            EXPECT_EQ(
                std::memcmp(FromDevice<char>(dOut, mine * 4, stream).data(), rs.data(), mine * 4),
                0)
                << "reduce-scatter";
            // Grouped: one NCCL call per non-empty block; else one reduce-scatter.
            int blocks = 0;
            for (size_t c : counts) blocks += c > 0;
            EXPECT_EQ(fc.ops - before, expectGroup ? blocks : 1);
            a.type = scape::coll::CollType::kAllGather;
            a.send = static_cast<char*>(dIn) + off * 4;
            st = NcclRun(comm, a, stream);
            EXPECT_TRUE(st.ok()) << st.message();
            EXPECT_EQ(std::memcmp(FromDevice<char>(dOut, kk * 4, stream).data(), ag.data(), kk * 4),
                      0)
                << "all-gather";
            Fake().DeviceFree(dIn);
            Fake().DeviceFree(dOut);
          }
        }
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(NcclRanks, PackedVCollectivesWithUnequalBlocksMatchTheHostCommunicator) {
  PackedVAgainstHost(GetParam(), FAKE_NCCL_PATH, KUnequal, GetParam() > 1);
}

TEST_P(NcclRanks, PackedVCollectivesWithEqualBlocksUseNcclsOwnCalls) {
  PackedVAgainstHost(GetParam(), FAKE_NCCL_PATH, KEqual, false);
}

// scapeAllReduce with a mask on device buffers: gather on the device, ncclAllReduce, scatter;
// positions outside the mask keep recvbuf's values, as in the host masked all-reduce.
TEST_P(NcclRanks, MaskedDenseAllReduceMatchesTheHostMaskedAllReduce) {
  const int P = GetParam();
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, P);
  ASSERT_NE(shared, nullptr);
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        const uint64_t n = 900;
        void* stream = Fake().NewStream();
        const uint64_t allocsBefore = Fake().deviceAllocs.load();
        for (int gen = 0; gen < 3; ++gen) {
          SCOPED_TRACE(testing::Message() << "mask generation " << gen);
          scapeMask_t m = MakeMask(comm, ctx.rank, n, KUnequal, seed + gen);
          if (!m) return false;
          auto in = Values<float>(n, ctx.rank, seed + gen);
          std::vector<float> hostOut(n, 0.5f);  // outside the mask: left as it is
          EXPECT_SCAPE_OK(scapeAllReduce(in.data(), hostOut.data(), n, scapeFloat32, scapeSum, m,
                                         comm, nullptr),
                          comm);
          void* dIn = ToDevice(in.data(), n * 4);
          std::vector<float> init(n, 0.5f);
          void* dOut = ToDevice(init.data(), n * 4);
          const uint64_t gathersBefore = Fake().gathers.load();
          // Twice: the second call of a generation reuses the uploaded positions and the
          // packed-values buffer (a cudaMalloc/cudaFree per call would synchronise the device).
          for (int rep = 0; rep < 2; ++rep) {
            const uint64_t h2d = Fake().h2dCopies.load(), allocs = Fake().deviceAllocs.load();
            EXPECT_SCAPE_OK(scapeAllReduce(dIn, dOut, n, scapeFloat32, scapeSum, m, comm, stream),
                            comm);
            EXPECT_EQ(Fake().h2dCopies.load() - h2d, rep == 0 ? 1u : 0u) << "position upload";
            if (rep > 0) {
              EXPECT_EQ(Fake().deviceAllocs.load(), allocs) << "allocated again";
            }
            auto got = FromDevice<float>(dOut, n, stream);
            EXPECT_EQ(std::memcmp(got.data(), hostOut.data(), n * 4), 0);
          }
          EXPECT_EQ(Fake().gathers.load() - gathersBefore, 2u);
          // In place too (nothing allocated).
          const uint64_t allocs = Fake().deviceAllocs.load();
          EXPECT_SCAPE_OK(scapeAllReduce(dIn, dIn, n, scapeFloat32, scapeSum, m, comm, stream),
                          comm);
          EXPECT_EQ(Fake().deviceAllocs.load(), allocs) << "allocated again";
          std::vector<float> inPlace = in;
          EXPECT_SCAPE_OK(scapeAllReduce(inPlace.data(), inPlace.data(), n, scapeFloat32, scapeSum,
                                         m, comm, nullptr),
                          comm);
          EXPECT_EQ(std::memcmp(FromDevice<float>(dIn, n, stream).data(), inPlace.data(), n * 4),
                    0);
          // Behind a held stream (the first call queued, not run), the second call on that
          // stream reuses the packed-values buffer at once: stream order makes that safe.
          {
            std::vector<float> want = FromDevice<float>(dOut, n, stream);
            EXPECT_SCAPE_OK(scapeAllReduce(inPlace.data(), want.data(), n, scapeFloat32, scapeSum,
                                           m, comm, nullptr),
                            comm);
            fake_device::Gate gate;
            Fake().HoldStream(stream, &gate);
            const uint64_t held = Fake().deviceAllocs.load();
            for (int rep = 0; rep < 2; ++rep)
              EXPECT_SCAPE_OK(scapeAllReduce(dIn, dOut, n, scapeFloat32, scapeSum, m, comm, stream),
                              comm);
            EXPECT_EQ(Fake().deviceAllocs.load(), held) << "allocated behind a held stream";
            gate.Open();
            EXPECT_EQ(std::memcmp(FromDevice<float>(dOut, n, stream).data(), want.data(), n * 4),
                      0);
          }
          // Argument errors: count, another type of collective.
          EXPECT_EQ(scapeAllReduce(dIn, dOut, n - 1, scapeFloat32, scapeSum, m, comm, stream),
                    scapeInvalidArgument);
          EXPECT_NE(std::string(scapeGetLastError(comm)).find("differs from the mask's n"),
                    std::string::npos)
              << scapeGetLastError(comm);
          EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
          Fake().DeviceFree(dIn);
          Fake().DeviceFree(dOut);
          EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        }
        // Three generations: the test's own 2 buffers each, and the cache's positions and
        // packed values, reused across generations once their work is done (sizes vary).
        EXPECT_LE(Fake().deviceAllocs.load() - allocsBefore, 3u * 2u + 4u)
            << "the masked all-reduce allocated device memory on every call";
        scapeResult_t ae = scapeInternalError;
        EXPECT_SCAPE_OK(scapeCommGetAsyncError(comm, &ae), comm);
        EXPECT_EQ(ae, scapeSuccess);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

size_t KAll(int) { return SIZE_MAX; }

// A full mask with shard ownership is the buffer's own order: one ncclAllReduce on the dense
// device buffers, nothing gathered or uploaded; the same values as the host masked all-reduce.
TEST_P(NcclRanks, MaskedAllReduceWithAFullShardMaskRunsOnTheDenseBuffers) {
  const int P = GetParam();
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, P);
  ASSERT_NE(shared, nullptr);
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        const uint64_t n = 301;
        scapeMask_t m = MakeMask(comm, ctx.rank, n, KAll, seed);
        if (!m) return false;
        uint64_t k = 0;
        EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), comm);
        EXPECT_EQ(k, n);
        auto in = Values<float>(n, ctx.rank, seed);
        std::vector<float> hostOut(n, 0.f);
        EXPECT_SCAPE_OK(
            scapeAllReduce(in.data(), hostOut.data(), n, scapeFloat32, scapeMax, m, comm, nullptr),
            comm);
        void* dIn = ToDevice(in.data(), n * 4);
        void* dOut = Fake().DeviceMalloc(n * 4);
        void* stream = Fake().NewStream();
        const uint64_t gathers = Fake().gathers.load(), h2d = Fake().h2dCopies.load();
        const int ops = fc.ops;
        EXPECT_SCAPE_OK(scapeAllReduce(dIn, dOut, n, scapeFloat32, scapeMax, m, comm, stream),
                        comm);
        auto got = FromDevice<float>(dOut, n, stream);
        EXPECT_EQ(std::memcmp(got.data(), hostOut.data(), n * 4), 0);
        EXPECT_EQ(Fake().gathers.load(), gathers);
        EXPECT_EQ(Fake().h2dCopies.load(), h2d);
        EXPECT_EQ(fc.ops - ops, 1);
        Fake().DeviceFree(dIn);
        Fake().DeviceFree(dOut);
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Destroy frees the backend's device buffers (positions, packed temps) with the host
// communicator; abort tears down a communicator with live masks.
TEST_P(NcclRanks, DestroyAndAbortTearDownBoth) {
  const int P = GetParam();
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, P);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        const uint64_t liveBefore = Fake().deviceLive.load();
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        const uint64_t n = 300;
        scapeMask_t m = MakeMask(comm, ctx.rank, n, KUnequal, 5);
        if (!m) return false;
        void* d = Fake().DeviceMalloc(n * 4);
        void* stream = Fake().NewStream();
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, m, comm, stream), comm);
        EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
        Fake().DeviceFree(d);
        EXPECT_GT(Fake().deviceLive.load(), liveBefore) << "the uploaded positions";
        EXPECT_EQ(scapeCommDestroy(comm), scapeInvalidUsage);  // the mask first
        EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        EXPECT_EQ(Fake().deviceLive.load(), liveBefore) << "device buffers left after destroy";
        int nr = 0;
        EXPECT_EQ(scapeCommCount(comm, &nr), scapeInvalidArgument);
        // Abort with a mask still live and device work done on it.
        scapeComm_t c2 = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&c2, &fc, nullptr), nullptr);
        if (!c2) return false;
        scapeMask_t m2 = MakeMask(c2, ctx.rank, n, KUnequal, 6);
        if (!m2) return false;
        d = Fake().DeviceMalloc(n * 4);
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, m2, c2, stream), c2);
        EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
        EXPECT_EQ(scapeCommAbort(c2), scapeSuccess);
        uint64_t k2 = 0;
        EXPECT_EQ(scapeMaskGetCount(m2, &k2), scapeInvalidArgument);
        EXPECT_EQ(scapeCommCount(c2, &nr), scapeInvalidArgument);
        Fake().DeviceFree(d);
        EXPECT_EQ(Fake().deviceLive.load(), liveBefore) << "device buffers left after abort";
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The optimizer step on device buffers on an NCCL-backend communicator: the packed exchange
// goes over NCCL (ncclAllReduce with ncclAvg; sharded: grouped ncclReduce then ncclBroadcast),
// the mask sync over the host communicator. Against the host step on the same communicator
// (its exchange on the host communicator): with 1 or 2 ranks the same bits (a sum of two values
// does not depend on its order), params and whole checkpoints, every step; with 3 ranks the
// fake NCCL sums in rank order, not in the host ring's order, so only "every rank holds the
// same params" is checked there. fp32, bf16 and e4m3 payloads (the fake averages two bf16 or
// e4m3 values as the host does: the float sum divided, rounded once; an 8-bit payload's scale is
// agreed with an ncclAllReduce of one float, max).
TEST_P(NcclRanks, OptimizerStepOnDeviceExchangesOverNccl) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  for (int payload : {scapeFloat32, scapeBfloat16, scapeFloat8E4M3})
    for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
      FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, P);
      ASSERT_NE(shared, nullptr);
      auto res = RunRanks(
          P,
          [&](RankCtx& ctx) {
            FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
            scapeComm_t comm = nullptr;
            EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
            if (!comm) return false;
            // Odd n, a dense segment, an empty one.
            const std::vector<uint64_t> offs{0, 0, 517, 530, 1203};
            const std::vector<uint8_t> dense{0, 0, 1, 0};
            const uint64_t n = offs.back();
            auto make = [&]() {
              scapeOptimConfig_t c;
              EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
              c.n = n;
              c.nsegments = static_cast<int>(offs.size() - 1);
              c.segOffsets = offs.data();
              c.denseFlags = dense.data();
              c.ownership = own;
              c.lr = 1e-2f;
              c.weightDecay = 0.1f;
              c.density = 0.05;
              c.warmupSteps = 2;
              c.payloadType = payload;
              scapeOptim_t o = nullptr;
              EXPECT_SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
              return o;
            };
            auto save = [&](scapeOptim_t o) {
              size_t bytes = 0, written = 0;
              EXPECT_SCAPE_OK(scapeOptimCheckpointSize(o, &bytes), comm);
              std::vector<uint8_t> b(bytes);
              EXPECT_SCAPE_OK(scapeOptimSave(o, b.data(), b.size(), &written), comm);
              return b;
            };
            scapeOptim_t host = make(), dev = make();
            if (!host || !dev) return false;
            std::mt19937 prng(seed);
            std::uniform_real_distribution<float> pu(-1.0f, 1.0f);
            std::vector<float> hp(n);
            for (float& x : hp) x = pu(prng);
            float* dp = static_cast<float*>(ToDevice(hp.data(), 4 * n));
            float* dg = static_cast<float*>(Fake().DeviceMalloc(4 * n));
            void* stream = Fake().NewStream();
            const int opsBefore = fc.ops;
            for (int t = 0; t < 12; ++t) {
              std::mt19937 rng(seed * 31u + static_cast<unsigned>(t) * 7u +
                               static_cast<unsigned>(ctx.rank));
              std::normal_distribution<float> nd(0.0f, 1.0f);
              std::vector<float> g(n);
              for (float& x : g) x = nd(rng);
              EXPECT_SCAPE_OK(scapeOptimStep(host, hp.data(), g.data(), n), comm);
              EXPECT_TRUE(Fake().CopyAsync(dg, g.data(), 4 * n, stream).ok());
              EXPECT_SCAPE_OK(scapeOptimStepStream(dev, dp, dg, n, stream), comm);
              std::vector<float> back = FromDevice<float>(dp, n, stream);
              if (P <= 2) {
                EXPECT_EQ(std::memcmp(back.data(), hp.data(), 4 * n), 0) << "params, step " << t;
                EXPECT_EQ(save(dev), save(host)) << "checkpoint, step " << t;
              } else {
                // Every rank the same params: gather them (host buffers: the host communicator).
                std::vector<float> all(n * static_cast<size_t>(P));
                EXPECT_SCAPE_OK(
                    scapeAllGather(back.data(), all.data(), n, scapeFloat32, comm, nullptr), comm);
                for (int r = 1; r < P; ++r)
                  EXPECT_EQ(std::memcmp(all.data(), all.data() + n * static_cast<size_t>(r), 4 * n),
                            0)
                      << "rank " << r << "'s params differ from rank 0's, step " << t;
              }
              if (::testing::Test::HasFailure()) break;
            }
            // Each device step went over NCCL (one call, or a group of calls per step).
            EXPECT_GE(fc.ops - opsBefore, 12) << "the device steps did not use NCCL";
            EXPECT_SCAPE_OK(scapeOptimDestroy(dev), comm);
            EXPECT_SCAPE_OK(scapeOptimDestroy(host), comm);
            Fake().DeviceFree(dp);
            Fake().DeviceFree(dg);
            EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
            return !::testing::Test::HasFailure();
          },
          Opts());
      EXPECT_TRUE(res.AllOk()) << "payload " << payload << ", ownership " << own << ": "
                               << res.Describe();
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclRanks, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

TEST(NcclRanksErrors, WithoutAHostCommunicatorMasksAndHostBuffersFailClearly) {
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, 2);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        setenv("SCAPE_NCCL_HOST_COMM", "0", 1);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        EXPECT_EQ(fc.ops, 0) << "no id broadcast without a host communicator";
        scapeMask_t m = nullptr;
        const uint64_t offs[2] = {0, 100};
        EXPECT_EQ(scapeMaskCreate(&m, 100, 1, offs, nullptr, scapeOwnershipShards,
                                  scapeMaskEncodingAuto, comm),
                  scapeInvalidUsage);
        std::string msg = scapeGetLastError(comm);
        EXPECT_NE(msg.find("scapeMaskCreate"), std::string::npos) << msg;
        EXPECT_NE(msg.find("SCAPE_NCCL_HOST_COMM=0"), std::string::npos) << msg;
        EXPECT_EQ(m, nullptr);
        std::vector<float> h(10);
        EXPECT_EQ(
            scapeAllReduce(h.data(), h.data(), 10, scapeFloat32, scapeSum, nullptr, comm, nullptr),
            scapeInvalidArgument);
        msg = scapeGetLastError(comm);
        EXPECT_NE(msg.find("SCAPE_NCCL_HOST_COMM=0"), std::string::npos) << msg;
        EXPECT_EQ(scapeBarrier(comm), scapeUnsupported);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The routing rule (backend::DataPath::Route), in one place, on the three kinds of data path a
// communicator can own: which backend each call goes to, and a host/device mix named.
scape::backend::Backend* RouteOf(scapeComm_t comm, scape::coll::CollType t, const void* send,
                                 void* recv, size_t count, scape::Status* st) {
  scape::coll::CollArgs a;
  a.type = t;
  a.send = send;
  a.recv = recv;
  a.count = count;
  scape::backend::Backend* b = nullptr;
  *st = comm->data->Route(a, &b);
  return st->ok() ? b : nullptr;
}

// Which concrete backend `b` is (tests may name them; the library above plugin/backend asks
// Backend's questions instead: tests/check_closed_sets.py).
template <class T>
bool Is(const scape::backend::Backend* b) {
  return dynamic_cast<const T*>(b) != nullptr;
}

TEST(DataPath, EachCommunicatorRoutesEachCallToOneBackend) {
  using scape::backend::HostBackend;
  using scape::backend::NcclBackend;
  using scape::backend::RankSpace;
  using scape::backend::UcxStagedBackend;
  using scape::coll::CollType;
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, 2);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        std::vector<float> h(8);
        void* d = Fake().DeviceMalloc(8 * 4);
        scape::Status st;
        // A UCX communicator: host buffers and barriers on the host, device buffers staged.
        scapeComm_t ucx = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitRank(&ucx, ctx.nranks, ctx.id, ctx.rank), nullptr);
        if (!ucx) return false;
        RankSpace ranks;
        EXPECT_FALSE(ucx->data->Topology(&ranks)) << "a UCX communicator's ranks are its own";
        EXPECT_TRUE(Is<UcxStagedBackend>(ucx->data->device()));
        auto* b = RouteOf(ucx, CollType::kAllReduce, h.data(), h.data(), 8, &st);
        EXPECT_TRUE(Is<HostBackend>(b) && b == ucx->data->host()) << st.message();
        b = RouteOf(ucx, CollType::kAllReduce, d, d, 8, &st);
        EXPECT_TRUE(Is<UcxStagedBackend>(b) && b == ucx->data->device()) << st.message();
        b = RouteOf(ucx, CollType::kBarrier, nullptr, nullptr, 0, &st);
        EXPECT_TRUE(Is<HostBackend>(b)) << st.message();
        b = RouteOf(ucx, CollType::kAllReduce, nullptr, nullptr, 0, &st);
        EXPECT_TRUE(Is<HostBackend>(b)) << st.message();
        // Off the root, a broadcast's send buffer is not looked at: the receive buffer decides.
        for (int root : {0, 1}) {
          scape::coll::CollArgs bc;
          bc.type = CollType::kBroadcast;
          bc.root = root;
          bc.send = h.data();
          bc.recv = d;
          bc.count = 8;
          b = nullptr;
          st = ucx->data->Route(bc, &b);
          if (root == ctx.rank) {
            EXPECT_EQ(st.code(), scapeInvalidArgument) << st.message();
          } else {
            EXPECT_TRUE(st.ok() && Is<UcxStagedBackend>(b)) << st.message();
          }
        }
        b = RouteOf(ucx, CollType::kAllReduce, h.data(), d, 8, &st);
        EXPECT_EQ(b, nullptr);
        EXPECT_EQ(st.code(), scapeInvalidArgument);
        EXPECT_NE(st.message().find("sendbuf is host memory but recvbuf is device memory"),
                  std::string::npos)
            << st.message();
        // Pack / unpack: by the memory kind of the buffers (a NULL one takes the other's).
        scape::backend::Backend* pb = nullptr;
        EXPECT_TRUE(ucx->data->RouteBuffers(h.data(), h.data(), &pb).ok());
        EXPECT_EQ(pb, ucx->data->host());
        EXPECT_TRUE(ucx->data->RouteBuffers(d, nullptr, &pb).ok());
        EXPECT_EQ(pb, ucx->data->device());
        EXPECT_TRUE(ucx->data->RouteBuffers(nullptr, nullptr, &pb).ok());
        EXPECT_EQ(pb, ucx->data->host());
        st = ucx->data->RouteBuffers(h.data(), d, &pb);
        EXPECT_EQ(st.code(), scapeInvalidArgument) << st.message();
        EXPECT_NE(st.message().find("dense is host memory but packed is device memory"),
                  std::string::npos)
            << st.message();
        int backendId = -1;
        EXPECT_EQ(scapeCommGetBackend(ucx, &backendId), scapeSuccess);
        EXPECT_EQ(backendId, scapeBackendUcx);
        EXPECT_SCAPE_OK(scapeCommDestroy(ucx), nullptr);
        // An NCCL-backend communicator with a host one: host buffers and barriers there,
        // device buffers, calls without buffers and mixes (named by NCCL's Admit) on NCCL.
        for (int hostComm : {1, 0}) {
          SCOPED_TRACE(testing::Message() << "SCAPE_NCCL_HOST_COMM=" << hostComm);
          setenv("SCAPE_NCCL_HOST_COMM", hostComm ? "1" : "0", 1);
          scapeComm_t nc = nullptr;
          EXPECT_SCAPE_OK(scapeCommInitNccl(&nc, &fc, nullptr), nullptr);
          if (!nc) return false;
          EXPECT_TRUE(Is<NcclBackend>(nc->data->device()));
          EXPECT_EQ(nc->data->host() != nullptr, hostComm == 1);
          RankSpace nr;
          EXPECT_TRUE(nc->data->Topology(&nr)) << "an NCCL-backend communicator's are NCCL's";
          EXPECT_EQ(nr.rank, ctx.rank);
          EXPECT_EQ(nr.nranks, ctx.nranks);
          EXPECT_EQ(scapeCommGetBackend(nc, &backendId), scapeSuccess);
          EXPECT_EQ(backendId, scapeBackendNccl);
          auto hostSide = [&](const scape::backend::Backend* x) {
            return hostComm ? Is<HostBackend>(x) : Is<NcclBackend>(x);
          };
          b = RouteOf(nc, CollType::kAllReduce, h.data(), h.data(), 8, &st);
          EXPECT_TRUE(hostSide(b)) << st.message();
          b = RouteOf(nc, CollType::kBarrier, nullptr, nullptr, 0, &st);
          EXPECT_TRUE(hostSide(b)) << st.message();
          b = RouteOf(nc, CollType::kAllReduce, d, d, 8, &st);
          EXPECT_TRUE(Is<NcclBackend>(b)) << st.message();
          b = RouteOf(nc, CollType::kAllReduce, nullptr, nullptr, 0, &st);
          EXPECT_TRUE(Is<NcclBackend>(b)) << st.message();
          b = RouteOf(nc, CollType::kAllReduce, h.data(), d, 8, &st);
          EXPECT_TRUE(Is<NcclBackend>(b)) << st.message();
          scape::coll::CollArgs mix;
          mix.type = CollType::kAllReduce;
          mix.send = h.data();
          mix.recv = d;
          mix.count = 8;
          st = b ? b->Admit(mix, nullptr, false) : scape::InternalError("no backend");
          EXPECT_EQ(st.code(), scapeInvalidArgument) << st.message();
          EXPECT_NE(st.message().find("sendbuf is host memory but recvbuf is device memory"),
                    std::string::npos)
              << st.message();
          // Pack / unpack: device buffers on NCCL's backend; host ones on the host
          // communicator, or none to run them.
          EXPECT_TRUE(nc->data->RouteBuffers(d, d, &pb).ok());
          EXPECT_EQ(pb, nc->data->device());
          st = nc->data->RouteBuffers(h.data(), nullptr, &pb);
          if (hostComm) {
            EXPECT_TRUE(st.ok() && Is<HostBackend>(pb)) << st.message();
          } else {
            EXPECT_EQ(st.code(), scapeInvalidUsage) << st.message();
          }
          EXPECT_SCAPE_OK(scapeCommDestroy(nc), nullptr);
        }
        unsetenv("SCAPE_NCCL_HOST_COMM");
        Fake().DeviceFree(d);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(NcclRanksErrors, AnNcclWithoutTheGroupCallsFailsUnequalBlocksByName) {
  FakeNcclShared* shared = NewShared(FAKE_NCCL_NOGROUP_PATH, 2);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_NOGROUP_PATH, shared, ctx);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNccl(&comm, &fc, nullptr), nullptr);
        if (!comm) return false;
        void* d = Fake().DeviceMalloc(64 * 4);
        scape::coll::CollArgs a;
        a.type = scape::coll::CollType::kReduceScatter;
        a.counts = {3, 5};
        a.send = d;
        a.recv = d;
        scape::Status st = NcclRun(comm, a, nullptr);
        EXPECT_EQ(st.code(), scapeSystemError);
        EXPECT_NE(st.message().find("has no ncclGroupStart"), std::string::npos) << st.message();
        EXPECT_NE(st.message().find(FAKE_NCCL_NOGROUP_PATH), std::string::npos) << st.message();
        // Equal blocks need no group: NCCL's reduce-scatter.
        a.counts = {4, 4};
        st = NcclRun(comm, a, nullptr);
        EXPECT_TRUE(st.ok()) << st.message();
        // Bad per-rank counts are argument errors.
        a.counts = {4};
        st = NcclRun(comm, a, nullptr);
        EXPECT_EQ(st.code(), scapeInvalidArgument);
        EXPECT_NE(st.message().find("1 per-rank counts for 2 ranks"), std::string::npos)
            << st.message();
        EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
        Fake().DeviceFree(d);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A rank that never calls scapeCommInitNccl: the others' init fails with scapeTimeout within
// the communicator's timeout (the id broadcast has a deadline), it does not hang.
TEST(NcclRanksErrors, AMissingRankMakesInitTimeOutNotHang) {
  FakeNcclShared* shared = NewShared(FAKE_NCCL_PATH, 2);
  ASSERT_NE(shared, nullptr);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeNcclComm fc = RankSetup(FAKE_NCCL_PATH, shared, ctx);
        if (ctx.rank == 1) return true;  // never comes
        fc.barrierTimeoutMs = 30000;     // NCCL itself would wait for ever
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = 1500;
        scapeComm_t comm = nullptr;
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(scapeCommInitNccl(&comm, &fc, &cfg), scapeTimeout);
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
        EXPECT_LT(ms, 10000);
        std::string msg = scapeGetLastError(nullptr);
        EXPECT_NE(msg.find("did not complete within 1500 ms"), std::string::npos) << msg;
        EXPECT_NE(msg.find("host communicator"), std::string::npos) << msg;
        EXPECT_EQ(comm, nullptr);
        // The fake's stream thread is still in the broadcast: leave without waiting for it.
        std::fflush(stdout);
        std::fflush(stderr);
        _exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
