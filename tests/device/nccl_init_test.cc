// scapeCommInitNcclRank / scapeCommInitNcclFromEnv: the library makes the NCCL communicator
// itself. Forked ranks (tests/harness.h) with the CPU fake device (fake_device.h) and the fake
// libnccl (fake_libnccl.cc), whose ncclGetUniqueId / ncclCommInitRank meet the ranks in a
// named shared-memory segment, so its collectives really move data between the processes.
// Checked on 1, 2 and 3 ranks: the communicator (rank, size, backend, one NCCL communicator
// made with the right size), a dense all-reduce and a masked all-reduce on device buffers
// through NCCL against the same calls on host buffers (bit for bit: small integer values,
// exact in every summation order), and that scapeCommDestroy / scapeCommAbort end the NCCL
// communicator (ncclCommDestroy / ncclCommAbort). Errors: bad arguments, NCCL missing (named),
// an NCCL without the init entry points, ncclGetUniqueId failing on rank 0, ncclCommInitRank
// failing on one rank (every rank fails, none hangs).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using scape_test::RankCtx;
using scape_test::RankOptions;
using scape_test::RunRanks;
using FakeNcclFn = void (*)(void*);

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

void EnqueueOnFake(void* stream, FakeNcclFn fn, void* arg) {
  Fake().Submit(stream, [fn, arg] { fn(arg); });
}

// The fake libnccl's test entry points in this process.
struct FakeNccl {
  void* h = nullptr;
  int (*live)() = nullptr;
  int (*destroyed)() = nullptr;
  int (*aborted)() = nullptr;
  int (*lastInitNranks)() = nullptr;
};

// fake_libnccl.cc's record of the last collective (the same layout).
struct FakeNcclCall {
  char fn[32];
  const void* send;
  void* recv;
  size_t count;
  int dtype, op, root;
  void* comm;
  void* stream;
  int calls;
};
const FakeNcclCall* g_lastCall = nullptr;

// In a rank: the fake device, NCCL work queued on its streams, SCAPE_NCCL_LIBRARY.
FakeNccl RankSetup(const char* lib) {
  Fake();
  setenv("SCAPE_NCCL_LIBRARY", lib, 1);
  FakeNccl f;
  f.h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  EXPECT_NE(f.h, nullptr) << dlerror();
  if (!f.h) return f;
  auto set = reinterpret_cast<void (*)(void (*)(void*, FakeNcclFn, void*))>(
      dlsym(f.h, "fakeNcclSetEnqueue"));
  EXPECT_NE(set, nullptr);
  if (set) set(EnqueueOnFake);
  f.live = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclCommsLive"));
  f.destroyed = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclCommsDestroyed"));
  f.aborted = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclCommsAborted"));
  f.lastInitNranks = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclLastInitNranks"));
  EXPECT_TRUE(f.live && f.destroyed && f.aborted && f.lastInitNranks);
  auto last = reinterpret_cast<const FakeNcclCall* (*)()>(dlsym(f.h, "fakeNcclLastCall"));
  EXPECT_NE(last, nullptr);
  if (last) g_lastCall = last();
  return f;
}

RankOptions Opts() {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 8000;
  o.watchdogMs = 90000;
  return o;
}

scapeConfig_t Config(int timeoutMs) {
  scapeConfig_t c = SCAPE_CONFIG_INITIALIZER;
  c.timeoutMs = timeoutMs;
  return c;
}

template <typename T>
std::vector<T> Values(size_t n, int rank, unsigned seed) {
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank));
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(static_cast<int>(rng() % 201) - 100);
  return v;
}

void* ToDevice(const void* h, size_t bytes) {
  void* d = Fake().DeviceMalloc(bytes + 1);
  EXPECT_TRUE(Fake().CopyAsync(d, h, bytes, nullptr).ok());
  EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
  return d;
}

std::vector<char> FromDevice(const void* d, size_t bytes, void* stream) {
  EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
  std::vector<char> h(bytes);
  EXPECT_TRUE(Fake().CopyAsync(h.data(), d, bytes, nullptr).ok());
  EXPECT_TRUE(Fake().StreamSynchronize(nullptr).ok());
  return h;
}

// A mask of n over the ranks' shards, rank r selecting 5 + 17 r positions of its shard.
scapeMask_t MakeMask(scapeComm_t comm, int rank, uint64_t n, unsigned seed) {
  scapeMask_t m = nullptr;
  const uint64_t offs[2] = {0, n};
  EXPECT_SCAPE_OK(
      scapeMaskCreate(&m, n, 1, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, comm),
      comm);
  if (!m) return nullptr;
  uint64_t range[2] = {0, 0};
  size_t cnt = 0;
  EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(m, rank, range, 1, &cnt), comm);
  std::vector<uint64_t> idx;
  for (uint64_t i = range[0]; i < range[1]; ++i) idx.push_back(i);
  std::mt19937 rng(seed + static_cast<unsigned>(rank));
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(std::min<size_t>(idx.size(), static_cast<size_t>(5 + 17 * rank)));
  std::sort(idx.begin(), idx.end());
  EXPECT_SCAPE_OK(scapeMaskSetNextIndices(m, idx.data(), idx.size()), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncStart(m), comm);
  EXPECT_SCAPE_OK(scapeMaskSyncWait(m), comm);
  EXPECT_SCAPE_OK(scapeMaskAdvance(m), comm);
  return m;
}

// Dense and masked all-reduces on device buffers (NCCL) against host buffers (the host
// communicator): the same bits, positions outside the mask untouched.
void CheckCollectives(scapeComm_t comm, int rank, unsigned seed) {
  void* stream = Fake().NewStream();
  for (size_t n : {size_t{1}, size_t{1001}}) {
    SCOPED_TRACE(testing::Message() << "dense n " << n);
    auto in = Values<float>(n, rank, seed + static_cast<unsigned>(n));
    std::vector<float> ref(n, -7.0f);
    EXPECT_SCAPE_OK(
        scapeAllReduce(in.data(), ref.data(), n, scapeFloat32, scapeSum, nullptr, comm, nullptr),
        comm);
    void* dIn = ToDevice(in.data(), n * 4);
    void* dOut = Fake().DeviceMalloc(n * 4);
    const int calls = g_lastCall->calls;
    EXPECT_SCAPE_OK(scapeAllReduce(dIn, dOut, n, scapeFloat32, scapeSum, nullptr, comm, stream),
                    comm);
    EXPECT_EQ(g_lastCall->calls, calls + 1) << "the device all-reduce did not go to NCCL";
    EXPECT_STREQ(g_lastCall->fn, "ncclAllReduce");
    EXPECT_EQ(g_lastCall->stream, stream);
    EXPECT_EQ(std::memcmp(FromDevice(dOut, n * 4, stream).data(), ref.data(), n * 4), 0);
    Fake().DeviceFree(dIn);
    Fake().DeviceFree(dOut);
  }
  const uint64_t n = 600;
  scapeMask_t m = MakeMask(comm, rank, n, seed);
  ASSERT_NE(m, nullptr);
  auto in = Values<float>(n, rank, seed + 3);
  auto before = Values<float>(n, rank, seed + 4);  // recv's prior contents
  std::vector<float> ref = before;
  EXPECT_SCAPE_OK(
      scapeAllReduce(in.data(), ref.data(), n, scapeFloat32, scapeSum, m, comm, nullptr), comm);
  EXPECT_NE(std::memcmp(ref.data(), before.data(), n * 4), 0) << "the host reference did nothing";
  void* dIn = ToDevice(in.data(), n * 4);
  void* dOut = ToDevice(before.data(), n * 4);
  const int calls = g_lastCall->calls;
  EXPECT_SCAPE_OK(scapeAllReduce(dIn, dOut, n, scapeFloat32, scapeSum, m, comm, stream), comm);
  EXPECT_EQ(g_lastCall->calls, calls + 1) << "the masked all-reduce did not go to NCCL";
  EXPECT_EQ(std::memcmp(FromDevice(dOut, n * 4, stream).data(), ref.data(), n * 4), 0)
      << "masked all-reduce";
  Fake().DeviceFree(dIn);
  Fake().DeviceFree(dOut);
  EXPECT_SCAPE_OK(scapeMaskDestroy(m), comm);
}

class NcclInit : public ::testing::TestWithParam<int> {};

TEST_P(NcclInit, RankInitCollectivesDestroy) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNccl f = RankSetup(FAKE_NCCL_PATH);
        if (!f.live) return false;
        scapeConfig_t cfg = Config(8000);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNcclRank(&comm, P, ctx.id, ctx.rank, &cfg), nullptr);
        if (!comm) return false;
        EXPECT_EQ(f.live(), 1);
        EXPECT_EQ(f.lastInitNranks(), P);
        int n = 0, r = -1, b = -1;
        EXPECT_SCAPE_OK(scapeCommCount(comm, &n), comm);
        EXPECT_SCAPE_OK(scapeCommUserRank(comm, &r), comm);
        EXPECT_SCAPE_OK(scapeCommGetBackend(comm, &b), comm);
        EXPECT_EQ(n, P);
        EXPECT_EQ(r, ctx.rank);
        EXPECT_EQ(b, scapeBackendNccl);
        CheckCollectives(comm, ctx.rank, seed);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), comm);
        EXPECT_EQ(f.live(), 0) << "scapeCommDestroy left the NCCL communicator alive";
        EXPECT_EQ(f.destroyed(), 1);
        EXPECT_EQ(f.aborted(), 0);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclInit, ::testing::Values(1, 2, 3));

TEST(NcclInitEnv, FromEnvThenAbortEndsTheNcclCommunicator) {
  const int P = 2;
  const int port = 20000 + static_cast<int>(getpid() % 20000);
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNccl f = RankSetup(FAKE_NCCL_PATH);
        if (!f.live) return false;
        setenv("RANK", std::to_string(ctx.rank).c_str(), 1);
        setenv("WORLD_SIZE", std::to_string(P).c_str(), 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        setenv("SCAPE_SOCKET_IFNAME", "lo", 1);
        scapeConfig_t cfg = Config(8000);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNcclFromEnv(&comm, &cfg), nullptr);
        if (!comm) return false;
        int r = -1, b = -1;
        EXPECT_SCAPE_OK(scapeCommUserRank(comm, &r), comm);
        EXPECT_SCAPE_OK(scapeCommGetBackend(comm, &b), comm);
        EXPECT_EQ(r, ctx.rank);
        EXPECT_EQ(b, scapeBackendNccl);
        EXPECT_EQ(f.live(), 1);
        // A device all-reduce works before the abort.
        std::vector<int32_t> h(33, ctx.rank + 1);
        void* d = ToDevice(h.data(), h.size() * 4);
        EXPECT_SCAPE_OK(
            scapeAllReduce(d, d, h.size(), scapeInt32, scapeSum, nullptr, comm, nullptr), comm);
        std::vector<char> out = FromDevice(d, h.size() * 4, nullptr);
        int32_t v = 0;
        std::memcpy(&v, out.data() + 32 * 4, 4);
        EXPECT_EQ(v, 3);
        Fake().DeviceFree(d);
        EXPECT_EQ(scapeCommAbort(comm), scapeSuccess);
        EXPECT_EQ(f.live(), 0);
        EXPECT_EQ(f.aborted(), 1) << "scapeCommAbort did not call ncclCommAbort";
        EXPECT_EQ(f.destroyed(), 0);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommAbort from another thread while device collectives are being issued (issue 44 item
// 1): every NCCL call of the library holds a use of the communicator from its open check to
// its return, and the abort waits for those uses (bounded) before ncclCommAbort. The fake NCCL
// keeps each collective inside the call for 3 ms (FAKE_NCCL_CALL_US) and counts communicators
// ended while a call on them was in progress (real NCCL frees it under that call) and calls
// that reach an ended communicator. Before the fix the abort landed inside a call (the check
// passed, then ncclCommAbort freed the communicator under it).
TEST(NcclInitAbort, ConcurrentAbortNeverEndsTheCommunicatorUnderAnNcclCall) {
  auto res = RunRanks(
      1,
      [&](RankCtx& ctx) {
        FakeNccl f = RankSetup(FAKE_NCCL_PATH);
        if (!f.live) return false;
        auto endedDuringCall = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclEndedDuringCall"));
        auto callsOnEnded = reinterpret_cast<int (*)()>(dlsym(f.h, "fakeNcclCallsOnEndedComms"));
        EXPECT_TRUE(endedDuringCall && callsOnEnded);
        if (!endedDuringCall || !callsOnEnded) return false;
        scapeConfig_t cfg = Config(8000);
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitNcclRank(&comm, 1, ctx.id, 0, &cfg), nullptr);
        if (!comm) return false;
        void* stream = Fake().NewStream();
        std::vector<int32_t> h(64, 1);
        void* d = ToDevice(h.data(), h.size() * 4);
        const int before = callsOnEnded();
        setenv("FAKE_NCCL_CALL_US", "3000", 1);
        std::atomic<int> issued{0};
        std::atomic<int> lastResult{scapeSuccess};
        std::thread caller([&] {
          for (int i = 0; i < 100000; ++i) {
            const scapeResult_t r =
                scapeAllReduce(d, d, h.size(), scapeInt32, scapeSum, nullptr, comm, stream);
            if (r != scapeSuccess) {
              lastResult.store(r);
              return;
            }
            issued.fetch_add(1);
          }
        });
        while (issued.load() < 5) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        EXPECT_EQ(scapeCommAbort(comm), scapeSuccess);
        caller.join();
        unsetenv("FAKE_NCCL_CALL_US");
        EXPECT_NE(lastResult.load(), scapeSuccess) << "the calls after the abort did not fail";
        EXPECT_EQ(f.aborted(), 1) << "scapeCommAbort did not call ncclCommAbort";
        EXPECT_EQ(endedDuringCall(), 0)
            << "ncclCommAbort ended the communicator while another thread was inside an NCCL "
               "call with it";
        EXPECT_EQ(callsOnEnded() - before, 0) << "an NCCL call reached the aborted communicator";
        EXPECT_TRUE(Fake().StreamSynchronize(stream).ok());
        Fake().DeviceFree(d);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Bad arguments: named, before NCCL is looked for (so even without NCCL).
TEST(NcclInitErrors, BadArguments) {
  setenv("SCAPE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  scapeUniqueId id;
  std::memset(&id, 0, sizeof(id));
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNcclRank(nullptr, 1, id, 0, nullptr), scapeInvalidArgument);
  EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("comm is NULL"), std::string::npos);
  EXPECT_EQ(scapeCommInitNcclRank(&comm, 0, id, 0, nullptr), scapeInvalidArgument);
  EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("nranks = 0"), std::string::npos);
  EXPECT_EQ(scapeCommInitNcclRank(&comm, 2, id, 2, nullptr), scapeInvalidArgument);
  EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("rank = 2"), std::string::npos);
  EXPECT_EQ(scapeCommInitNcclRank(&comm, 2, id, -1, nullptr), scapeInvalidArgument);
  EXPECT_EQ(scapeCommInitNcclFromEnv(nullptr, nullptr), scapeInvalidArgument);
  EXPECT_EQ(comm, nullptr);
  unsetenv("SCAPE_NCCL_LIBRARY");
}

// NCCL missing: scapeUnsupported naming the library, on every rank at once (nothing joined).
TEST(NcclInitErrors, NcclMissingIsUnsupportedNamingTheLibrary) {
  setenv("SCAPE_NCCL_LIBRARY", "/nonexistent/dir/libnccl.so.2", 1);
  scapeUniqueId id;
  ASSERT_EQ(scapeGetUniqueId(&id), scapeSuccess);
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNcclRank(&comm, 2, id, 1, nullptr), scapeUnsupported);
  const std::string msg = scapeGetLastError(nullptr);
  EXPECT_NE(msg.find("scapeCommInitNcclRank"), std::string::npos) << msg;
  EXPECT_NE(msg.find("/nonexistent/dir/libnccl.so.2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("SCAPE_NCCL_LIBRARY"), std::string::npos) << msg;
  EXPECT_EQ(comm, nullptr);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  EXPECT_EQ(scapeCommInitNcclFromEnv(&comm, nullptr), scapeUnsupported);
  EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("/nonexistent/dir/libnccl.so.2"),
            std::string::npos);
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("SCAPE_NCCL_LIBRARY");
}

// An NCCL library without ncclGetUniqueId / ncclCommInitRank: scapeUnsupported naming both.
TEST(NcclInitErrors, NcclWithoutInitEntryPoints) {
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_NOINIT_PATH, 1);
  scapeUniqueId id;
  ASSERT_EQ(scapeGetUniqueId(&id), scapeSuccess);
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNcclRank(&comm, 1, id, 0, nullptr), scapeUnsupported);
  const std::string msg = scapeGetLastError(nullptr);
  EXPECT_NE(msg.find("ncclGetUniqueId"), std::string::npos) << msg;
  EXPECT_NE(msg.find(FAKE_NCCL_NOINIT_PATH), std::string::npos) << msg;
  unsetenv("SCAPE_NCCL_LIBRARY");
}

// ncclGetUniqueId fails on rank 0: rank 0 names it, the others are told, nobody hangs.
TEST(NcclInitErrors, UniqueIdFailureReachesEveryRank) {
  const int P = 2;
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNccl f = RankSetup(FAKE_NCCL_PATH);
        setenv("FAKE_NCCL_NO_INIT_UNIQUE_ID", "1", 1);
        scapeConfig_t cfg = Config(8000);
        scapeComm_t comm = nullptr;
        const scapeResult_t r = scapeCommInitNcclRank(&comm, P, ctx.id, ctx.rank, &cfg);
        const std::string msg = scapeGetLastError(nullptr);
        EXPECT_NE(r, scapeSuccess);
        EXPECT_EQ(comm, nullptr);
        if (ctx.rank == 0) {
          EXPECT_EQ(r, scapeSystemError) << msg;
          EXPECT_NE(msg.find("ncclGetUniqueId"), std::string::npos) << msg;
          EXPECT_NE(msg.find("fake NCCL error string"), std::string::npos) << msg;
        } else {
          EXPECT_EQ(r, scapeRemoteError) << msg;
          EXPECT_NE(msg.find("rank 0 could not get an NCCL unique id"), std::string::npos) << msg;
        }
        EXPECT_EQ(f.live ? f.live() : -1, 0);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// ncclCommInitRank fails at once on rank 1 (it never meets the others): rank 1 names NCCL's
// error; the others' ncclCommInitRank waits for it and is given up at the deadline
// (scapeTimeout naming ncclCommInitRank), or fails itself when it comes after rank 1 removed
// the fake's segment; every rank returns within the deadline, none keeps a communicator.
TEST(NcclInitErrors, InitFailureOnOneRankFailsEveryRankWithinTheDeadline) {
  const int P = 3;
  auto res = RunRanks(
      P,
      [&](RankCtx& ctx) {
        FakeNccl f = RankSetup(FAKE_NCCL_PATH);
        setenv("FAKE_NCCL_INIT_FAIL_RANK", "1", 1);
        scapeConfig_t cfg = Config(3000);
        scapeComm_t comm = nullptr;
        const auto t0 = std::chrono::steady_clock::now();
        const scapeResult_t r = scapeCommInitNcclRank(&comm, P, ctx.id, ctx.rank, &cfg);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const std::string msg = scapeGetLastError(nullptr);
        EXPECT_EQ(comm, nullptr);
        if (ctx.rank == 1) {
          EXPECT_EQ(r, scapeSystemError) << msg;
          EXPECT_NE(msg.find("ncclCommInitRank returned 2: fake NCCL error string"),
                    std::string::npos)
              << msg;
        } else if (r == scapeTimeout) {
          // It mapped the segment before rank 1 unlinked it: it waits for rank 1 until the
          // deadline.
          EXPECT_NE(msg.find("ncclCommInitRank"), std::string::npos) << msg;
          EXPECT_NE(msg.find("3000 ms"), std::string::npos) << msg;
        } else {
          // It came after rank 1 had unlinked the segment: its own ncclCommInitRank fails.
          EXPECT_EQ(r, scapeSystemError) << msg;
          EXPECT_NE(msg.find("ncclCommInitRank returned"), std::string::npos) << msg;
        }
        EXPECT_LT(s, 15.0) << "took " << s << " s";
        EXPECT_EQ(f.live ? f.live() : -1, 0);
        return true;
      },
      Opts());
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
