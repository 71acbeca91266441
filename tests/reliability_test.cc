// Defects found by a reliability audit that used the library as a hostile or careless user
// would (issue 15): handle misuse, mismatched collectives, one-sided failures, error messages
// after an abort, outputs written on failure. Each test failed before its fix.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <ucs/type/status.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/harness.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_layer.h"
#include "transport/ucx/ucx_status.h"

namespace scape_test {
namespace {

using Clock = std::chrono::steady_clock;
int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}
bool Contains(const char* s, const char* sub) { return s && std::strstr(s, sub) != nullptr; }

// A one-rank communicator in this process (no fork).
scapeComm_t OneRank() {
  scapeUniqueId id;
  EXPECT_EQ(scapeGetUniqueId(&id), scapeSuccess) << scapeGetLastError(nullptr);
  scapeComm_t comm = nullptr;
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = 10000;
  EXPECT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, &cfg), scapeSuccess)
      << scapeGetLastError(nullptr);
  return comm;
}

// Destroying twice, aborting twice, using a handle after destroy: errors, never a crash (the
// sanitizer pass runs this too, so a read of freed memory fails it).
TEST(Handles, MisuseOfDestroyedHandlesIsAnError) {
  scapeComm_t comm = OneRank();
  ASSERT_NE(comm, nullptr);
  float a[4] = {1, 2, 3, 4}, b[4];
  // Requests: completed handles are dead.
  scapeRequest_t req = nullptr;
  ASSERT_EQ(scapeAllReduceAsync(a, b, 4, scapeFloat32, scapeSum, nullptr, comm, nullptr, &req),
            scapeSuccess);
  EXPECT_EQ(scapeWait(req), scapeSuccess);
  EXPECT_EQ(scapeWait(req), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "not a live request"))
      << scapeGetLastError(nullptr);
  int done = 0;
  EXPECT_EQ(scapeTest(req, &done), scapeInvalidArgument);
  // Masks.
  const uint64_t offs[] = {0, 100};
  scapeMask_t mask = nullptr;
  ASSERT_EQ(scapeMaskCreate(&mask, 100, 1, offs, nullptr, scapeOwnershipShards,
                            scapeMaskEncodingAuto, comm),
            scapeSuccess)
      << scapeGetLastError(comm);
  EXPECT_EQ(scapeMaskDestroy(mask), scapeSuccess);
  EXPECT_EQ(scapeMaskDestroy(mask), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "not a live mask"))
      << scapeGetLastError(nullptr);
  const uint64_t idx[] = {3};
  EXPECT_EQ(scapeMaskSetNextIndices(mask, idx, 1), scapeInvalidArgument);
  EXPECT_EQ(scapeMaskSyncStart(mask), scapeInvalidArgument);
  uint64_t k = 0;
  EXPECT_EQ(scapeMaskGetCount(mask, &k), scapeInvalidArgument);
  EXPECT_EQ(scapeAllReduce(a, b, 100, scapeFloat32, scapeSum, mask, comm, nullptr),
            scapeInvalidArgument);
  // Communicators: destroy twice, use after destroy, abort after destroy.
  EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
  EXPECT_EQ(scapeCommDestroy(comm), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(nullptr), "not a live communicator"))
      << scapeGetLastError(nullptr);
  EXPECT_EQ(scapeAllReduce(a, b, 4, scapeFloat32, scapeSum, nullptr, comm, nullptr),
            scapeInvalidArgument);
  EXPECT_EQ(scapeBarrier(comm), scapeInvalidArgument);
  int n = 0;
  EXPECT_EQ(scapeCommCount(comm, &n), scapeInvalidArgument);
  scapeResult_t async = scapeSuccess;
  EXPECT_EQ(scapeCommGetAsyncError(comm, &async), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(comm), "not a live communicator"));
  EXPECT_EQ(scapeCommAbort(comm), scapeInvalidArgument);
  // Abort twice.
  scapeComm_t c2 = OneRank();
  ASSERT_NE(c2, nullptr);
  EXPECT_EQ(scapeCommAbort(c2), scapeSuccess);
  EXPECT_EQ(scapeCommAbort(c2), scapeInvalidArgument);
  EXPECT_EQ(scapeCommDestroy(c2), scapeInvalidArgument);
  // A pointer that never was a handle.
  int junk[64] = {0};
  EXPECT_EQ(scapeBarrier(reinterpret_cast<scapeComm_t>(junk)), scapeInvalidArgument);
  EXPECT_EQ(scapeMaskDestroy(reinterpret_cast<scapeMask_t>(junk)), scapeInvalidArgument);
  EXPECT_EQ(scapeWait(reinterpret_cast<scapeRequest_t>(junk)), scapeInvalidArgument);
}

// k = SIZE_MAX used to escape as scapeInternalError "vector::reserve".
TEST(MaskArgs, HugeKIsAnArgumentError) {
  scapeComm_t comm = OneRank();
  ASSERT_NE(comm, nullptr);
  const uint64_t offs[] = {0, 1000};
  scapeMask_t mask = nullptr;
  ASSERT_EQ(scapeMaskCreate(&mask, 1000, 1, offs, nullptr, scapeOwnershipShards,
                            scapeMaskEncodingAuto, comm),
            scapeSuccess);
  const uint64_t idx[] = {1, 2};
  EXPECT_EQ(scapeMaskSetNextIndices(mask, idx, SIZE_MAX), scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(comm), "k = ")) << scapeGetLastError(comm);
  EXPECT_EQ(scapeMaskSetNextIndices(mask, idx, 1001), scapeInvalidArgument);
  EXPECT_EQ(scapeMaskSetNextIndices(mask, idx, 2), scapeSuccess) << scapeGetLastError(comm);
  EXPECT_EQ(scapeMaskDestroy(mask), scapeSuccess);
  EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
}

// A rank that syncs without selecting contributes its always-dense segments (as an empty
// selection does), not nothing.
TEST(MaskArgs, SyncWithoutSelectingKeepsTheDenseSegments) {
  RunResult res = RunRanks(2, [](RankCtx& c) {
    const uint64_t offs[] = {0, 10, 1000, 1010};
    const uint8_t dense[] = {1, 0, 1};
    scapeMask_t mask = nullptr;
    EXPECT_EQ(scapeMaskCreate(&mask, 1010, 3, offs, dense, scapeOwnershipShards,
                              scapeMaskEncodingAuto, c.comm),
              scapeSuccess);
    if (!mask) return false;
    if (c.rank == 1) {  // rank 1 selects nothing explicitly; rank 0 an empty list
      EXPECT_EQ(scapeMaskSetNextIndices(mask, nullptr, 0), scapeSuccess);
    }
    for (int round = 0; round < 2; ++round) {  // and again after an advance
      EXPECT_EQ(scapeMaskSyncStart(mask), scapeSuccess) << scapeGetLastError(c.comm);
      EXPECT_EQ(scapeMaskSyncWait(mask), scapeSuccess) << scapeGetLastError(c.comm);
      EXPECT_EQ(scapeMaskAdvance(mask), scapeSuccess);
      uint64_t k = 0;
      EXPECT_EQ(scapeMaskGetCount(mask, &k), scapeSuccess);
      EXPECT_EQ(k, 20u) << "round " << round;
    }
    EXPECT_EQ(scapeMaskDestroy(mask), scapeSuccess);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A collective ended by scapeCommAbort from a watchdog thread: its message is readable on
// the thread that made the call (the communicator is gone by the time it could be read).
TEST(Abort, CallEndedByAbortHasAMessage) {
  RankOptions o;
  o.timeoutMs = 30000;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        if (c.rank == 1) {
          usleep(1000000);  // joins late: rank 0 has aborted by now
          float a = 1, b = 0;
          EXPECT_EQ(scapeAllReduce(&a, &b, 1, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
                    scapeRemoteError);
          return true;
        }
        scapeResult_t blocked = scapeSuccess;
        std::string msg;
        std::thread worker([&] {
          float a = 1, b = 0;
          blocked = scapeAllReduce(&a, &b, 1, scapeFloat32, scapeSum, nullptr, c.comm, nullptr);
          msg = scapeGetLastError(nullptr);
        });
        usleep(300000);
        EXPECT_EQ(scapeCommAbort(c.comm), scapeSuccess);
        worker.join();
        c.comm = nullptr;
        EXPECT_EQ(blocked, scapeInvalidUsage);
        EXPECT_NE(msg.find("aborted"), std::string::npos) << "message: '" << msg << "'";
        EXPECT_NE(msg.find("scapeAllReduce"), std::string::npos) << "message: '" << msg << "'";
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Ranks that disagree on a broadcast's root, or on a count where one passes 0: every rank
// fails, well before the timeout (they used to split into successes and timeouts).
void MismatchEverywhere(const std::function<scapeResult_t(RankCtx&)>& call) {
  RankOptions o;
  o.timeoutMs = 20000;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        auto t0 = Clock::now();
        scapeResult_t r = call(c);
        const int64_t ms = MsSince(t0);
        EXPECT_NE(r, scapeSuccess) << "rank " << c.rank;
        EXPECT_NE(r, scapeTimeout) << "rank " << c.rank << ": " << scapeGetLastError(c.comm);
        EXPECT_LT(ms, 8000) << "rank " << c.rank;
        const char* m = scapeGetLastError(c.comm);
        EXPECT_TRUE(Contains(m, "different collective") || Contains(m, "disagree") ||
                    Contains(m, "aborted the communicator"))
            << "rank " << c.rank << ": " << m;
        scapeResult_t async = scapeSuccess;
        EXPECT_EQ(scapeCommGetAsyncError(c.comm, &async), scapeSuccess);
        EXPECT_NE(async, scapeSuccess) << "rank " << c.rank;
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Mismatch, BroadcastRootIsReportedOnEveryRank) {
  MismatchEverywhere([](RankCtx& c) {
    std::vector<float> buf(64, static_cast<float>(c.rank));
    const int root = c.rank == 1 ? 1 : 0;
    return scapeBroadcast(buf.data(), buf.data(), buf.size(), scapeFloat32, root, c.comm, nullptr);
  });
}

TEST(Mismatch, LargeBroadcastRootIsReportedOnEveryRank) {
  MismatchEverywhere([](RankCtx& c) {
    std::vector<float> buf(1 << 20, static_cast<float>(c.rank));  // rendezvous-sized
    const int root = c.rank == 2 ? 2 : 0;
    return scapeBroadcast(buf.data(), buf.data(), buf.size(), scapeFloat32, root, c.comm, nullptr);
  });
}

TEST(Mismatch, CountZeroAgainstCountHundredIsReportedOnEveryRank) {
  MismatchEverywhere([](RankCtx& c) {
    std::vector<float> a(100, 1.0f), b(100);
    const size_t n = c.rank == 1 ? 0 : 100;
    return scapeAllReduce(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, c.comm, nullptr);
  });
}

// Count-0 collectives still agree with each other (and stay cheap enough to be used).
TEST(Mismatch, CountZeroCollectivesStillSucceed) {
  RunResult res = RunRanks(3, [](RankCtx& c) {
    for (int i = 0; i < 50; ++i) {
      EXPECT_SCAPE_OK(
          scapeAllReduce(nullptr, nullptr, 0, scapeFloat32, scapeSum, nullptr, c.comm, nullptr),
          c.comm);
      EXPECT_SCAPE_OK(scapeBroadcast(nullptr, nullptr, 0, scapeFloat32, 2, c.comm, nullptr),
                      c.comm);
      EXPECT_SCAPE_OK(scapeAllGather(nullptr, nullptr, 0, scapeInt32, c.comm, nullptr), c.comm);
      std::vector<int32_t> v(10, c.rank);
      EXPECT_SCAPE_OK(
          scapeBroadcast(v.data(), v.data(), v.size(), scapeInt32, i % 3, c.comm, nullptr), c.comm);
      EXPECT_EQ(v[9], i % 3);
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A sparse all-reduce that fails validation on some ranks (here: rank 0 passes a larger n and
// sends indices the others refuse) fails on every rank and breaks the communicator on every
// rank; it used to succeed on rank 0 and leave the others' communicators usable.
TEST(Sparse, ValidationFailureIsReportedOnEveryRank) {
  RankOptions o;
  o.timeoutMs = 20000;
  for (scapeSparseAlgo_t algo : {scapeSparseAllGather, scapeSparseRecursiveDoubling}) {
    RunResult res = RunRanks(
        3,
        [&](RankCtx& c) {
          const uint64_t n = c.rank == 0 ? 5000 : 1000;
          std::vector<uint64_t> idx;
          for (uint64_t i = 0; i < 10; ++i) idx.push_back(c.rank == 0 ? 4000 + i : 10 * i + c.rank);
          std::vector<float> vals(idx.size(), 1.0f), dense(n);
          auto t0 = Clock::now();
          scapeResult_t r = scapeSparseAllReduce(idx.data(), vals.data(), idx.size(), n,
                                                 scapeFloat32, scapeSum, algo, dense.data(),
                                                 nullptr, nullptr, 0, nullptr, nullptr, c.comm);
          EXPECT_NE(r, scapeSuccess) << "rank " << c.rank << " algo " << algo;
          EXPECT_LT(MsSince(t0), 8000);
          scapeResult_t async = scapeSuccess;
          EXPECT_EQ(scapeCommGetAsyncError(c.comm, &async), scapeSuccess);
          EXPECT_NE(async, scapeSuccess) << "rank " << c.rank << ": the communicator stayed usable";
          return true;
        },
        o);
    EXPECT_TRUE(res.AllOk()) << "algo " << algo << ": " << res.Describe();
  }
}

// Outputs are written only on success: a union larger than the capacity leaves *outNnz,
// the lists and denseOut untouched.
TEST(Sparse, NoOutputOnCapacityError) {
  scapeComm_t comm = OneRank();
  ASSERT_NE(comm, nullptr);
  const uint64_t idx[] = {1, 5, 7};
  const float vals[] = {1, 2, 3};
  uint64_t outIdx[2] = {77, 77};
  float outVals[2] = {-1, -1};
  std::vector<float> dense(10, -1.0f);
  size_t outNnz = 12345;
  uint64_t sent = 999;
  EXPECT_EQ(scapeSparseAllReduce(idx, vals, 3, 10, scapeFloat32, scapeSum, scapeSparseAuto,
                                 dense.data(), outIdx, outVals, 2, &outNnz, &sent, comm),
            scapeInvalidArgument);
  EXPECT_TRUE(Contains(scapeGetLastError(comm), "capacity")) << scapeGetLastError(comm);
  EXPECT_EQ(outNnz, 12345u);
  EXPECT_EQ(sent, 999u);
  EXPECT_EQ(outIdx[0], 77u);
  EXPECT_EQ(dense[1], -1.0f);
  uint64_t bigIdx[3];
  float bigVals[3];
  EXPECT_EQ(scapeSparseAllReduce(idx, vals, 3, 10, scapeFloat32, scapeSum, scapeSparseAuto,
                                 dense.data(), bigIdx, bigVals, 3, &outNnz, &sent, comm),
            scapeSuccess)
      << scapeGetLastError(comm);
  EXPECT_EQ(outNnz, 3u);
  EXPECT_EQ(bigIdx[2], 7u);
  EXPECT_EQ(dense[5], 2.0f);
  EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
}

// One mapping from UCX statuses to results (transport/ucx/ucx_status.h): a peer's torn-down
// shared-memory segment is the peer's failure, not a local system error.
TEST(UcxStatus, PeerFailuresAreRemoteErrors) {
  using scape::transport::UcxResult;
  EXPECT_EQ(UcxResult(UCS_ERR_SHMEM_SEGMENT), scapeRemoteError);
  EXPECT_EQ(UcxResult(UCS_ERR_CONNECTION_RESET), scapeRemoteError);
  EXPECT_EQ(UcxResult(UCS_ERR_ENDPOINT_TIMEOUT), scapeRemoteError);
  EXPECT_EQ(UcxResult(UCS_ERR_NOT_CONNECTED), scapeRemoteError);
  EXPECT_EQ(UcxResult(UCS_ERR_IO_ERROR), scapeRemoteError);
  EXPECT_EQ(UcxResult(static_cast<ucs_status_t>(UCS_ERR_FIRST_LINK_FAILURE - 1)), scapeRemoteError);
  EXPECT_EQ(UcxResult(UCS_ERR_TIMED_OUT), scapeTimeout);
  EXPECT_EQ(UcxResult(UCS_ERR_MESSAGE_TRUNCATED), scapeInvalidUsage);
  EXPECT_EQ(UcxResult(UCS_ERR_INVALID_PARAM), scapeInternalError);
  EXPECT_EQ(UcxResult(UCS_ERR_NO_MEMORY), scapeSystemError);
  EXPECT_EQ(UcxResult(UCS_OK), scapeSuccess);
  // The UCX layer's int-carried codes go through the same mapping.
  EXPECT_EQ(scape::transport::ucx::CodeError("x", UCS_ERR_ENDPOINT_TIMEOUT).code(),
            scapeRemoteError);
  EXPECT_TRUE(scape::transport::ucx::IsTruncated(UCS_ERR_MESSAGE_TRUNCATED));
  EXPECT_FALSE(scape::transport::ucx::IsTruncated(UCS_ERR_NO_MEMORY));
}

// Two ranks' transports connected over pipes made before the fork (no bootstrap): the UCX
// transport alone, so a test can hold a transfer where it wants it.
bool WriteAll(int fd, const void* p, size_t n) {
  return write(fd, p, n) == static_cast<ssize_t>(n);
}
bool ReadAll(int fd, void* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, static_cast<char*>(p) + got, n - got);
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}
struct TransportPair {
  int toPeer[2][2];  // toPeer[r]: rank r writes, the other rank reads
  TransportPair() {
    EXPECT_EQ(pipe(toPeer[0]), 0);
    EXPECT_EQ(pipe(toPeer[1]), 0);
  }
  // In rank `me`: a transport connected to the other rank, or null (with a test failure).
  std::unique_ptr<scape::transport::Transport> Connect(int me, const std::string& tls) {
    const int peer = 1 - me;
    scape::transport::TransportOptions to;
    to.rank = me;
    to.nranks = 2;
    to.tls = tls;
    scape::Status st;
    std::unique_ptr<scape::transport::Transport> tp = scape::transport::CreateUcxTransport(to, &st);
    EXPECT_TRUE(st.ok()) << st.message();
    if (!tp) return nullptr;
    const std::vector<uint8_t>& mine = tp->LocalAddress();
    const uint32_t len = static_cast<uint32_t>(mine.size());
    EXPECT_TRUE(WriteAll(toPeer[me][1], &len, sizeof(len)));
    EXPECT_TRUE(WriteAll(toPeer[me][1], mine.data(), mine.size()));
    uint32_t peerLen = 0;
    EXPECT_TRUE(ReadAll(toPeer[peer][0], &peerLen, sizeof(peerLen)));
    std::vector<uint8_t> blob(peerLen);
    EXPECT_TRUE(ReadAll(toPeer[peer][0], blob.data(), blob.size()));
    st = tp->Connect(peer, blob.data(), blob.size(), /*sameHost=*/true);
    EXPECT_TRUE(st.ok()) << st.message();
    return st.ok() ? std::move(tp) : nullptr;
  }
  // Posts a 64 MiB transfer, rank 0 to rank 1, on `tp`; rank 1 then progresses until the first
  // bytes are in its buffer (bounded).
  static constexpr size_t kBytes = size_t{64} << 20;
  void StartTransfer(int me, scape::transport::Transport* tp, uint64_t tag,
                     std::vector<uint8_t>* buf, std::unique_ptr<scape::transport::Request>* req) {
    buf->assign(kBytes, me == 0 ? 0xab : 0);
    if (me == 0) {
      EXPECT_TRUE(tp->Isend(1, tag, buf->data(), kBytes, req).ok());
      return;
    }
    EXPECT_TRUE(tp->Irecv(0, tag, ~uint64_t{0}, buf->data(), kBytes, req).ok());
    auto t0 = Clock::now();
    while ((*buf)[0] == 0 && MsSince(t0) < 20000) tp->Progress();
    EXPECT_NE((*buf)[0], 0) << "the transfer never started";
    EXPECT_EQ((*buf)[kBytes - 1], 0) << "the transfer finished before the test could hold it";
  }
  // Rank 1, after destroying its receive: progresses 200 ms; nothing may write into the buffer.
  static void ExpectUntouched(scape::transport::Transport* tp, const std::vector<uint8_t>& buf) {
    const uint8_t last = buf[kBytes - 1];
    auto t0 = Clock::now();
    while (MsSince(t0) < 200) tp->Progress();
    EXPECT_EQ(buf[kBytes - 1], last) << "UCX wrote into the buffer of a destroyed receive";
  }
  // Rank 1: tells rank 0 it is done.
  void Done() {
    const char done = 1;
    EXPECT_TRUE(WriteAll(toPeer[1][1], &done, 1));
  }
  // Rank 0: progresses its transport until rank 1 writes a byte (bounded), then closes.
  void ProgressUntilRank1IsDone(scape::transport::Transport* tp) {
    EXPECT_EQ(fcntl(toPeer[1][0], F_SETFL, O_NONBLOCK), 0);
    char done = 0;
    auto t0 = Clock::now();
    while (read(toPeer[1][0], &done, 1) != 1 && MsSince(t0) < 20000) tp->Progress();
    EXPECT_EQ(done, 1) << "rank 1 did not finish";
    tp->CloseAll(/*force=*/true);
  }
};

// Shared-memory (CMA) copies run in the worker's progress, a segment per call, and cancelling a
// receive that has matched does not stop its copy. Destroying such a request used to return at
// once: the copy went on into the caller's freed buffer on later progress calls, and UCX 1.13
// aborted the process (arbiter.c: "ucs_arbiter_group_is_empty") if the worker was destroyed
// with it queued. A collective aborted on a count mismatch did this in 6 of 15 runs; here it is
// made certain: rank 1 destroys its receive a segment into a 64 MiB copy.
TEST(UcxLayer, DestroyWithASharedMemoryCopyInFlight) {
  TransportPair pair;
  RankOptions o;
  o.initComm = false;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        std::unique_ptr<scape::transport::Transport> tp = pair.Connect(c.rank, "");
        if (!tp) return false;
        std::vector<uint8_t> buf;
        std::unique_ptr<scape::transport::Request> req;
        pair.StartTransfer(c.rank, tp.get(), /*tag=*/7, &buf, &req);
        if (c.rank == 0) {
          pair.ProgressUntilRank1IsDone(tp.get());
          req.reset();
          return true;
        }
        // Destroying the request gives the buffer back (the caller frees it). Then the
        // transport goes with no copy queued.
        req.reset();
        TransportPair::ExpectUntouched(tp.get(), buf);
        tp.reset();
        pair.Done();
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The other side of that wait: a receive that cannot end (its sender is stopped mid-transfer,
// over TCP) is waited for 1 s, then the transport never progresses its worker again, so the
// buffer the caller frees is never written, and the transport's destruction keeps the worker.
TEST(UcxLayer, AReceiveThatCannotEndStopsTheWorkersProgress) {
  TransportPair pair;
  RankOptions o;
  o.initComm = false;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        std::unique_ptr<scape::transport::Transport> tp = pair.Connect(c.rank, "tcp");
        if (!tp) return false;
        std::vector<uint8_t> buf;
        std::unique_ptr<scape::transport::Request> req;
        pair.StartTransfer(c.rank, tp.get(), /*tag=*/9, &buf, &req);
        if (c.rank == 0) {
          // Progress until rank 1 has the first bytes, then stop (rank 1 continues us).
          char got = 0;
          EXPECT_EQ(fcntl(pair.toPeer[1][0], F_SETFL, O_NONBLOCK), 0);
          auto t0 = Clock::now();
          while (read(pair.toPeer[1][0], &got, 1) != 1 && MsSince(t0) < 20000) tp->Progress();
          EXPECT_EQ(got, 2) << "rank 1 never received the first bytes";
          const pid_t me = getpid();
          EXPECT_TRUE(WriteAll(pair.toPeer[0][1], &me, sizeof(me)));
          raise(SIGSTOP);
          pair.ProgressUntilRank1IsDone(tp.get());
          req.reset();
          return true;
        }
        const char started = 2;
        EXPECT_TRUE(WriteAll(pair.toPeer[1][1], &started, 1));
        pid_t sender = 0;
        EXPECT_TRUE(ReadAll(pair.toPeer[0][0], &sender, sizeof(sender)));
        // Wait until the sender is stopped (state T in /proc/PID/stat).
        bool stopped = false;
        auto t0 = Clock::now();
        while (!stopped && MsSince(t0) < 20000) {
          FILE* f = std::fopen(("/proc/" + std::to_string(sender) + "/stat").c_str(), "r");
          char state = 0;
          if (f) {
            EXPECT_EQ(std::fscanf(f, "%*d %*s %c", &state), 1);
            std::fclose(f);
          }
          stopped = state == 'T';
          if (!stopped) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        EXPECT_TRUE(stopped);
        EXPECT_EQ(buf[TransportPair::kBytes - 1], 0)
            << "the transfer ended before the sender stopped";
        t0 = Clock::now();
        req.reset();  // waits 1 s, gives up
        EXPECT_GE(MsSince(t0), 900);
        EXPECT_FALSE(tp->Progress());
        EXPECT_EQ(kill(sender, SIGCONT), 0);
        TransportPair::ExpectUntouched(tp.get(), buf);
        tp.reset();  // keeps the worker: no progress, no abort
        pair.Done();
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The UCX 1.13 rule, written once in the UCX layer for both the communicator and the NCCL
// plugin: only a same-host peer where shared memory is possible goes without failure reports;
// the caller's knob wins over UCX_TLS, which is read when no knob is set.
TEST(UcxLayer, FailureReportsFollowHostAndTls) {
  using scape::transport::ucx::EffectiveTls;
  using scape::transport::ucx::SharedMemoryPossible;
  using scape::transport::ucx::WantFailureReports;
  EXPECT_TRUE(SharedMemoryPossible(""));
  EXPECT_TRUE(SharedMemoryPossible("all"));
  EXPECT_TRUE(SharedMemoryPossible("sm,self"));
  EXPECT_TRUE(SharedMemoryPossible("tcp,posix"));
  EXPECT_FALSE(SharedMemoryPossible("tcp"));
  EXPECT_FALSE(SharedMemoryPossible("^sm"));
  EXPECT_TRUE(SharedMemoryPossible("^ib"));
  const char* old = getenv("UCX_TLS");
  const std::string saved = old ? old : "";
  unsetenv("UCX_TLS");
  EXPECT_EQ(EffectiveTls(""), "");
  EXPECT_FALSE(WantFailureReports(true, ""));
  EXPECT_TRUE(WantFailureReports(false, ""));
  EXPECT_TRUE(WantFailureReports(true, "tcp"));
  setenv("UCX_TLS", "tcp", 1);
  EXPECT_EQ(EffectiveTls(""), "tcp");
  EXPECT_EQ(EffectiveTls("sm,self"), "sm,self");
  EXPECT_TRUE(WantFailureReports(true, ""));
  EXPECT_FALSE(WantFailureReports(true, "sm,self"));
  if (old)
    setenv("UCX_TLS", saved.c_str(), 1);
  else
    unsetenv("UCX_TLS");
}

}  // namespace
}  // namespace scape_test
