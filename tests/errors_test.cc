// Bad input and failures: clear errors, never a crash or a hang. Every multi-rank case runs on
// real UCX over loopback with short timeouts, under the harness watchdog.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/harness.h"
#include "transport/bootstrap/bootstrap.h"

namespace scape_test {
namespace {

using Clock = std::chrono::steady_clock;
int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}
bool Contains(const char* s, const char* sub) { return s && std::strstr(s, sub) != nullptr; }

TEST(Api, VersionAndErrorStrings) {
  int v = 0;
  EXPECT_EQ(scapeGetVersion(&v), scapeSuccess);
  EXPECT_EQ(v, SCAPE_VERSION_CODE);
  EXPECT_EQ(scapeGetVersion(nullptr), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "version"));
  for (int r = 0; r < scapeNumResults; ++r) {
    const char* s = scapeGetErrorString(static_cast<scapeResult_t>(r));
    ASSERT_NE(s, nullptr);
    EXPECT_STRNE(s, "unknown result") << r;
  }
  EXPECT_STREQ(scapeGetErrorString(static_cast<scapeResult_t>(1234)), "unknown result");
  EXPECT_EQ(scapeTypeSize(scapeBfloat16), 2u);
  EXPECT_EQ(scapeTypeSize(static_cast<scapeDataType_t>(77)), 0u);
}

TEST(Api, InitArgumentErrors) {
  scapeUniqueId id;
  ASSERT_EQ(scapeGetUniqueId(&id), scapeSuccess) << scapeGetLastError(nullptr);
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitRank(nullptr, 2, id, 0), scapeInvalidArgument);
  EXPECT_EQ(scapeCommInitRank(&comm, 0, id, 0), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "nranks"));
  EXPECT_EQ(scapeCommInitRank(&comm, 2, id, 2), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "rank = 2")) << scapeGetLastError(nullptr);
  EXPECT_EQ(scapeCommInitRank(&comm, 2, id, -1), scapeInvalidArgument);
  scapeUniqueId zero;
  std::memset(&zero, 0, sizeof(zero));
  EXPECT_EQ(scapeCommInitRank(&comm, 1, zero, 0), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "uniqueId"));
  scapeConfig_t bad = SCAPE_CONFIG_INITIALIZER;
  bad.magic = 0;
  EXPECT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, &bad), scapeInvalidArgument);
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = -5;
  EXPECT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, &cfg), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "timeoutMs"));
  cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.progressMode = 99;
  EXPECT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, &cfg), scapeInvalidArgument);
  cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.netIf = "no-such-interface0";
  EXPECT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, &cfg), scapeSystemError);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "no-such-interface0"));
  EXPECT_EQ(comm, nullptr) << "output must be written only on success";
  EXPECT_EQ(scapeGetUniqueId(nullptr), scapeInvalidArgument);
  EXPECT_EQ(scapeCommDestroy(nullptr), scapeSuccess);
  EXPECT_EQ(scapeCommAbort(nullptr), scapeSuccess);
}

TEST(Api, EnvironmentConfigErrors) {
  scapeUniqueId id;
  ASSERT_EQ(scapeGetUniqueId(&id), scapeSuccess);
  scapeComm_t comm = nullptr;
  // A malformed knob is a configuration error (scapeInvalidUsage), as for the NCCL plugin.
  setenv("SCAPE_TIMEOUT_MS", "soon", 1);
  EXPECT_EQ(scapeCommInitRank(&comm, 1, id, 0), scapeInvalidUsage);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "SCAPE_TIMEOUT_MS"));
  unsetenv("SCAPE_TIMEOUT_MS");
  setenv("SCAPE_PROGRESS", "sometimes", 1);
  EXPECT_EQ(scapeCommInitRank(&comm, 1, id, 0), scapeInvalidUsage);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "SCAPE_PROGRESS"));
  unsetenv("SCAPE_PROGRESS");
  const char* keep[] = {"RANK",     "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "PMI_RANK", "PMI_SIZE",   "SLURM_PROCID",         "SLURM_NTASKS"};
  for (const char* k : keep) unsetenv(k);
  EXPECT_EQ(scapeCommInitFromEnv(&comm, nullptr), scapeInvalidUsage);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "WORLD_SIZE"));
}

// Argument errors on every rank: reported locally, and the communicator stays usable.
TEST(Errors, ArgumentErrorsLeaveCommUsable) {
  RunResult res = RunRanks(2, [](RankCtx& c) {
    std::vector<float> a(16, 1.0f), b(16);
    EXPECT_EQ(
        scapeAllReduce(nullptr, b.data(), 16, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
        scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "sendbuf")) << scapeGetLastError(c.comm);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "rank")) << scapeGetLastError(c.comm);
    EXPECT_EQ(
        scapeAllReduce(a.data(), nullptr, 16, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
        scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "recvbuf"));
    EXPECT_EQ(scapeAllReduce(a.data(), b.data(), 16, static_cast<scapeDataType_t>(42), scapeSum,
                             nullptr, c.comm, nullptr),
              scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "datatype 42"));
    EXPECT_EQ(scapeAllReduce(a.data(), b.data(), 16, scapeFloat32, static_cast<scapeRedOp_t>(-1),
                             nullptr, c.comm, nullptr),
              scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "op -1"));
    EXPECT_EQ(
        scapeAllReduce(a.data(), a.data() + 1, 8, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
        scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "overlap"));
    int dummyStream = 0;
    EXPECT_EQ(scapeAllReduce(a.data(), b.data(), 16, scapeFloat32, scapeSum, nullptr, c.comm,
                             &dummyStream),
              scapeUnsupported);
    scapeRequest_t req = nullptr;
    // A handle that is not a live mask of this communicator is refused without being used.
    EXPECT_EQ(
        scapeAllReduceAsync(a.data(), b.data(), 16, scapeFloat32, scapeSum,
                            reinterpret_cast<scapeMask_t>(&dummyStream), c.comm, nullptr, &req),
        scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "not a live mask"))
        << scapeGetLastError(c.comm);
    EXPECT_EQ(req, nullptr);
    EXPECT_EQ(scapeBroadcast(a.data(), b.data(), 16, scapeFloat32, 2, c.comm, nullptr),
              scapeInvalidArgument);
    EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "root 2"));
    EXPECT_EQ(
        scapeAllReduce(a.data(), b.data(), 16, scapeFloat32, scapeSum, nullptr, nullptr, nullptr),
        scapeInvalidArgument);
    EXPECT_EQ(scapeAllReduceAsync(a.data(), b.data(), 16, scapeFloat32, scapeSum, nullptr, c.comm,
                                  nullptr, nullptr),
              scapeInvalidArgument);
    int n = 0;
    EXPECT_EQ(scapeCommCount(c.comm, nullptr), scapeInvalidArgument);
    EXPECT_EQ(scapeCommCount(c.comm, &n), scapeSuccess);
    EXPECT_EQ(n, 2);
    EXPECT_EQ(scapeTest(nullptr, &n), scapeInvalidArgument);
    EXPECT_EQ(scapeWait(nullptr), scapeInvalidArgument);
    // Still usable.
    EXPECT_SCAPE_OK(
        scapeAllReduce(a.data(), b.data(), 16, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
        c.comm);
    EXPECT_EQ(b[3], 2.0f);
    scapeResult_t async = scapeInternalError;
    EXPECT_EQ(scapeCommGetAsyncError(c.comm, &async), scapeSuccess);
    EXPECT_EQ(async, scapeSuccess);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Ranks that disagree on the count (or type) are told so on every rank, fast.
void MismatchCase(int P, size_t n, size_t badN, scapeDataType_t badType) {
  RankOptions o;
  o.timeoutMs = 20000;
  o.initComm = false;
  RunResult res = RunRanks(
      P,
      [&](RankCtx& c) {
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeResult_t ir = scapeCommInitRankConfig(&c.comm, P, c.id, c.rank, &cfg);
        if (ir != scapeSuccess) {
          // A rank still finishing init's own barrier may hear of the mismatch there: that is
          // the same report, delivered a step earlier.
          EXPECT_EQ(ir, scapeRemoteError);
          EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "different collective") ||
                      Contains(scapeGetLastError(nullptr), "disagree"))
              << scapeGetLastError(nullptr);
          return true;
        }
        const bool odd = c.rank == 1;
        const size_t cnt = odd ? badN : n;
        const scapeDataType_t t = odd ? badType : scapeFloat32;
        std::vector<char> a(cnt * 4 + 8, 1), b(cnt * 4 + 8);
        auto t0 = Clock::now();
        scapeResult_t r =
            scapeAllReduce(a.data(), b.data(), cnt, t, scapeSum, nullptr, c.comm, nullptr);
        EXPECT_NE(r, scapeSuccess) << "rank " << c.rank;
        EXPECT_NE(r, scapeTimeout) << "rank " << c.rank << ": " << scapeGetLastError(c.comm);
        EXPECT_LT(MsSince(t0), 10000)
            << "rank " << c.rank << " took too long to learn of the mismatch";
        EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "disagree") ||
                    Contains(scapeGetLastError(c.comm), "different collective"))
            << scapeGetLastError(c.comm);
        // The communicator is now in error state.
        scapeResult_t async = scapeSuccess;
        EXPECT_EQ(scapeCommGetAsyncError(c.comm, &async), scapeSuccess);
        EXPECT_NE(async, scapeSuccess);
        EXPECT_NE(scapeBarrier(c.comm), scapeSuccess);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Errors, CountMismatchRingIsReportedOnEveryRank) {
  MismatchCase(3, 1 << 18, (1 << 18) + 5, scapeFloat32);
}
TEST(Errors, CountMismatchSmallIsReportedOnEveryRank) { MismatchCase(4, 10, 11, scapeFloat32); }
TEST(Errors, TypeMismatchIsReportedOnEveryRank) { MismatchCase(2, 1000, 1000, scapeBfloat16); }

TEST(Errors, WrongSecretIsRefused) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 2000;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        scapeUniqueId id = c.id;
        if (c.rank == 1) {
          scape::bootstrap::RootAddress root;
          EXPECT_TRUE(scape::bootstrap::DecodeUniqueId(id, &root).ok());
          root.secret[3] ^= 0x40;
          scape::bootstrap::EncodeUniqueId(root, &id);
        }
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        scapeResult_t r = scapeCommInitRankConfig(&comm, 2, id, c.rank, &cfg);
        if (c.rank == 1) {
          EXPECT_EQ(r, scapeRemoteError);
          EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "secret")) << scapeGetLastError(nullptr);
        } else {
          EXPECT_EQ(r, scapeTimeout) << scapeGetLastError(nullptr);
        }
        EXPECT_EQ(comm, nullptr);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Errors, PeerThatNeverArrivesIsATimeout) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 1500;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        if (c.rank == 2) return true;  // never joins
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        auto t0 = Clock::now();
        scapeResult_t r = scapeCommInitRankConfig(&comm, 3, c.id, c.rank, &cfg);
        EXPECT_EQ(r, scapeTimeout) << scapeGetLastError(nullptr);
        EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "missing ranks: 2"))
            << scapeGetLastError(nullptr);
        EXPECT_LT(MsSince(t0), o.timeoutMs + 6000);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Errors, RanksDisagreeOnNranks) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 3000;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        if (c.rank == 1) usleep(200000);  // arrive second, with a different nranks
        scapeResult_t r = scapeCommInitRankConfig(&comm, c.rank == 0 ? 2 : 3, c.id, c.rank, &cfg);
        EXPECT_EQ(r, scapeInvalidUsage) << scapeGetLastError(nullptr);
        EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "nranks")) << scapeGetLastError(nullptr);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The run of `nranks` ranks ended with rank `dead` killed by SIGKILL and every other rank
// passing, without the watchdog.
void ExpectOnlyRankKilled(const RunResult& res, size_t nranks, size_t dead) {
  ASSERT_EQ(res.exitCodes.size(), nranks);
  EXPECT_FALSE(res.watchdogFired);
  for (size_t r = 0; r < nranks; ++r)
    EXPECT_EQ(res.exitCodes[r], r == dead ? -SIGKILL : 0) << "rank " << r << ": " << res.Describe();
}

// A rank that dies in the middle of a collective: every survivor gets an error within the
// timeout, and the communicator stays in error state.
void RankDeathCase() {
  RankOptions o;
  o.timeoutMs = 4000;
  RunResult res = RunRanks(
      4,
      [&](RankCtx& c) {
        const size_t n = size_t{16} << 20;  // 64 MiB of floats: long enough to die in the middle
        std::vector<float> a(n, 1.0f), b(n);
        if (c.rank == 2) {
          scapeRequest_t req;
          scapeAllReduceAsync(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, c.comm,
                              nullptr, &req);
          // Start it and die while it is certainly unfinished (its peers still need our data).
          int done = 0;
          for (int i = 0; i < 3 && !done; ++i) scapeTest(req, &done);
          if (done) std::fprintf(stderr, "rank 2 finished early; the test proves nothing\n");
          EXPECT_EQ(done, 0);
          kill(getpid(), SIGKILL);
        }
        auto t0 = Clock::now();
        scapeResult_t r =
            scapeAllReduce(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, c.comm, nullptr);
        const int64_t ms = MsSince(t0);
        EXPECT_TRUE(r == scapeRemoteError || r == scapeTimeout)
            << "rank " << c.rank << ": " << scapeGetErrorString(r) << ": "
            << scapeGetLastError(c.comm);
        EXPECT_LT(ms, o.timeoutMs + 2000) << "rank " << c.rank;
        std::fprintf(stderr, "rank %d: error after %lld ms: %s\n", c.rank,
                     static_cast<long long>(ms), scapeGetLastError(c.comm));
        EXPECT_NE(scapeBarrier(c.comm), scapeSuccess);
        return true;
      },
      o);
  ExpectOnlyRankKilled(res, 4, 2);
}

// Over shared memory the survivors find the dead process themselves.
TEST(Errors, RankDeathMidCollectiveFailsEverySurvivor) { RankDeathCase(); }

// Over UCX's TCP transport (as between hosts) UCX reports the broken connection.
TEST(Errors, RankDeathOverTcpFailsEverySurvivor) {
  setenv("SCAPE_LOCAL_SHM", "0", 1);
  RankDeathCase();
  unsetenv("SCAPE_LOCAL_SHM");
}

// A rank that dies instead of joining a mask sync: the sync thread of every survivor finds out
// (its private channel watches the peers as the main one does) and scapeMaskSyncWait reports it
// within the timeout; the mask can still be destroyed.
void MaskSyncDeathCase() {
  RankOptions o;
  o.timeoutMs = 4000;
  RunResult res = RunRanks(
      4,
      [&](RankCtx& c) {
        const uint64_t n = 100000;
        const uint64_t offs[] = {0, 40000, n};
        scapeMask_t mask = nullptr;
        EXPECT_EQ(scapeMaskCreate(&mask, n, 2, offs, nullptr, scapeOwnershipShards,
                                  scapeMaskEncodingAuto, c.comm),
                  scapeSuccess)
            << scapeGetLastError(c.comm);
        if (!mask) return false;
        std::vector<float> stat(n);
        for (uint64_t i = 0; i < n; ++i) stat[i] = static_cast<float>((i * 2654435761u) % 1000);
        EXPECT_EQ(scapeMaskSelectNextTopk(mask, stat.data(), 0.01), scapeSuccess);
        if (c.rank == 2) kill(getpid(), SIGKILL);
        auto t0 = Clock::now();
        EXPECT_EQ(scapeMaskSyncStart(mask), scapeSuccess) << scapeGetLastError(c.comm);
        scapeResult_t r = scapeMaskSyncWait(mask);
        const int64_t ms = MsSince(t0);
        EXPECT_TRUE(r == scapeRemoteError || r == scapeTimeout)
            << "rank " << c.rank << ": " << scapeGetErrorString(r) << ": "
            << scapeGetLastError(c.comm);
        EXPECT_LT(ms, o.timeoutMs + 2000) << "rank " << c.rank;
        std::fprintf(stderr, "rank %d: mask sync error after %lld ms: %s\n", c.rank,
                     static_cast<long long>(ms), scapeGetLastError(c.comm));
        EXPECT_EQ(scapeMaskAdvance(mask), scapeInvalidUsage)
            << "a failed sync must not be advanced to";
        EXPECT_EQ(scapeMaskDestroy(mask), scapeSuccess) << scapeGetLastError(c.comm);
        // The main channel learns of the death too.
        EXPECT_NE(scapeBarrier(c.comm), scapeSuccess);
        return true;
      },
      o);
  ExpectOnlyRankKilled(res, 4, 2);
}

TEST(Errors, RankDeathDuringMaskSyncFailsEverySurvivor) { MaskSyncDeathCase(); }

TEST(Errors, RankDeathDuringMaskSyncOverTcpFailsEverySurvivor) {
  setenv("SCAPE_LOCAL_SHM", "0", 1);
  MaskSyncDeathCase();
  unsetenv("SCAPE_LOCAL_SHM");
}

// scapeCommAbort on one rank tells the others at once (well before their timeout).
TEST(Errors, AbortNotifiesPeers) {
  RankOptions o;
  o.timeoutMs = 30000;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        if (c.rank == 0) {
          usleep(100000);
          EXPECT_EQ(scapeCommAbort(c.comm), scapeSuccess);
          c.comm = nullptr;
          return true;
        }
        auto t0 = Clock::now();
        scapeResult_t r = scapeBarrier(c.comm);
        EXPECT_EQ(r, scapeRemoteError) << scapeGetLastError(c.comm);
        EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "rank 0")) << scapeGetLastError(c.comm);
        EXPECT_LT(MsSince(t0), 5000);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommAbort from another thread (a watchdog) while a call is blocked: the blocked call
// returns promptly with scapeInvalidUsage, the abort then frees the communicator, and the
// peers hear of it. `inMaskSync`: the blocked call is scapeMaskSyncWait (the mask's background
// channel must give up too) instead of a collective.
void AbortFromAnotherThreadCase(bool inMaskSync) {
  RankOptions o;
  o.timeoutMs = 30000;  // far beyond the test's limits: only the abort can end the wait
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        const uint64_t n = 100000;
        const uint64_t offs[] = {0, n};
        scapeMask_t mask = nullptr;
        if (inMaskSync) {
          EXPECT_EQ(scapeMaskCreate(&mask, n, 1, offs, nullptr, scapeOwnershipShards,
                                    scapeMaskEncodingAuto, c.comm),
                    scapeSuccess)
              << scapeGetLastError(c.comm);
          if (!mask) return false;
        }
        // Small messages (eager, no rendezvous): with UCX 1.13 a peer that later matches a
        // rendezvous request of a rank that has since closed its worker can die inside UCX (shmat
        // of the gone segment is fatal there); that hazard is UCX's and is not what this tests.
        const size_t count = 1024;
        if (c.rank == 0) {
          std::vector<float> a(count, 1.0f), b(count);
          scapeResult_t blocked = scapeSuccess;
          int64_t blockedMs = -1;
          std::thread worker([&] {
            auto t0 = Clock::now();
            if (inMaskSync) {
              blocked = scapeMaskSyncStart(mask) == scapeSuccess ? scapeMaskSyncWait(mask)
                                                                 : scapeInternalError;
            } else {
              blocked = scapeAllReduce(a.data(), b.data(), a.size(), scapeFloat32, scapeSum,
                                       nullptr, c.comm, nullptr);
            }
            blockedMs = MsSince(t0);
          });
          usleep(300000);  // the worker is blocked: the peers have not joined
          auto t0 = Clock::now();
          EXPECT_EQ(scapeCommAbort(c.comm), scapeSuccess);
          const int64_t abortMs = MsSince(t0);
          worker.join();
          c.comm = nullptr;  // gone, masks included
          EXPECT_EQ(blocked, scapeInvalidUsage) << scapeGetErrorString(blocked);
          EXPECT_GE(blockedMs, 250);
          EXPECT_LT(blockedMs, 3000) << "the blocked call did not give up promptly";
          EXPECT_LT(abortMs, 3000);
          std::fprintf(stderr, "rank 0: blocked call returned after %lld ms, abort took %lld ms\n",
                       static_cast<long long>(blockedMs), static_cast<long long>(abortMs));
          return true;
        }
        usleep(1000000);  // join late (the same call as rank 0): rank 0 has aborted by now
        auto t0 = Clock::now();
        std::vector<float> a(count, 1.0f), b(count);
        scapeResult_t r = inMaskSync ? scapeBarrier(c.comm)
                                     : scapeAllReduce(a.data(), b.data(), a.size(), scapeFloat32,
                                                      scapeSum, nullptr, c.comm, nullptr);
        EXPECT_EQ(r, scapeRemoteError) << scapeGetLastError(c.comm);
        EXPECT_TRUE(Contains(scapeGetLastError(c.comm), "rank 0")) << scapeGetLastError(c.comm);
        EXPECT_LT(MsSince(t0), 5000);
        if (mask) {
          EXPECT_EQ(scapeMaskDestroy(mask), scapeSuccess) << scapeGetLastError(c.comm);
        }
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Errors, AbortFromAnotherThreadEndsABlockedCollective) { AbortFromAnotherThreadCase(false); }
TEST(Errors, AbortFromAnotherThreadEndsABlockedMaskSync) { AbortFromAnotherThreadCase(true); }

// scapeCommInitFromEnv under a torchrun-like and an mpirun-like environment.
void EnvInitCase(const std::vector<std::pair<std::string, std::string>>& common,
                 const char* rankVar, const char* sizeVar) {
  RankOptions o;
  o.initComm = false;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        for (const auto& kv : common) setenv(kv.first.c_str(), kv.second.c_str(), 1);
        setenv(rankVar, std::to_string(c.rank).c_str(), 1);
        setenv(sizeVar, "3", 1);
        scapeComm_t comm = nullptr;
        scapeResult_t r = scapeCommInitFromEnv(&comm, nullptr);
        EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(nullptr);
        if (r != scapeSuccess) return false;
        int rank = -1, n = 0;
        EXPECT_EQ(scapeCommUserRank(comm, &rank), scapeSuccess);
        EXPECT_EQ(scapeCommCount(comm, &n), scapeSuccess);
        EXPECT_EQ(rank, c.rank);
        EXPECT_EQ(n, 3);
        int64_t v = rank + 1, sum = 0;
        EXPECT_SCAPE_OK(scapeAllReduce(&v, &sum, 1, scapeInt64, scapeSum, nullptr, comm, nullptr),
                        comm);
        EXPECT_EQ(sum, 6);
        EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

std::string FreePortString() {
  // A port from a range the test picks per process, unlikely to collide with other runs.
  return std::to_string(30000 + (getpid() * 7 + static_cast<int>(FreshSeed() % 1000)) % 20000);
}

TEST(EnvInit, Torchrun) {
  EnvInitCase({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", FreePortString()}}, "RANK",
              "WORLD_SIZE");
}

TEST(EnvInit, OpenMpiSingleHost) {
  EnvInitCase(
      {{"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}, {"OMPI_MCA_ess_base_jobid", "job-" + FreePortString()}},
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
}

}  // namespace
}  // namespace scape_test
