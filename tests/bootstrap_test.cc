// The bootstrap root faces the network: garbage, wrong secrets and absurd sizes must be refused
// without disturbing the ranks that do belong.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "tests/harness.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/bootstrap/socket.h"

namespace scape_test {
namespace {

using scape::bootstrap::RootAddress;
using scape::bootstrap::Socket;

// Mirrors the wire layout of a hello (transport/bootstrap/bootstrap.cc) to forge bad ones.
struct ForgedHello {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t nranks;
  uint32_t blobLen;
  uint64_t hostHash;
  uint8_t secret[16];
  int32_t timeoutMs;
  uint32_t reserved;
};

TEST(BootstrapRoot, RefusesHostileClientsAndStillFormsTheCommunicator) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 5000;
  RunResult res = RunRanks(
      2,
      [&](RankCtx& c) {
        if (c.rank == 0) {
          RootAddress root;
          EXPECT_TRUE(scape::bootstrap::DecodeUniqueId(c.id, &root).ok());
          auto dl = scape::Deadline::AfterMs(3000);
          {  // garbage bytes
            Socket s;
            EXPECT_TRUE(Socket::Connect(root.addr, dl, &s).ok());
            std::vector<char> junk(200, 'x');
            (void)s.SendAll(junk.data(), junk.size(), dl);
          }
          {  // wrong secret: refused with an answer
            Socket s;
            EXPECT_TRUE(Socket::Connect(root.addr, dl, &s).ok());
            ForgedHello h{};
            h.magic = 0x3148455041435353ull;
            h.version = 1;
            h.rank = 1;
            h.nranks = 2;
            h.blobLen = 8;
            EXPECT_TRUE(s.SendAll(&h, sizeof(h), dl).ok());
            int32_t hdr[6] = {0};
            EXPECT_TRUE(s.RecvAll(hdr, sizeof(hdr), dl).ok());
            EXPECT_EQ(hdr[2], scapeRemoteError);
          }
          {  // right secret, absurd blob size: refused before any allocation
            Socket s;
            EXPECT_TRUE(Socket::Connect(root.addr, dl, &s).ok());
            ForgedHello h{};
            h.magic = 0x3148455041435353ull;
            h.version = 1;
            h.rank = 1;
            h.nranks = 2;
            h.blobLen = 0xffffffffu;
            std::memcpy(h.secret, root.secret.data(), 16);
            EXPECT_TRUE(s.SendAll(&h, sizeof(h), dl).ok());
            int32_t hdr[6] = {0};
            EXPECT_TRUE(s.RecvAll(hdr, sizeof(hdr), dl).ok());
            EXPECT_EQ(hdr[2], scapeInvalidUsage);
          }
        }
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        scapeResult_t r = scapeCommInitRankConfig(&comm, 2, c.id, c.rank, &cfg);
        EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(nullptr);
        if (r != scapeSuccess) return false;
        int v = 1, sum = 0;
        EXPECT_SCAPE_OK(scapeAllReduce(&v, &sum, 1, scapeInt32, scapeSum, nullptr, comm, nullptr),
                        comm);
        EXPECT_EQ(sum, 2);
        EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Many communicators, one after the other, in the same processes: nothing leaks that stops
// the next one from forming.
TEST(BootstrapRoot, RepeatedInitDestroy) {
  RankOptions o;
  o.initComm = false;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = 10000;
        scapeComm_t base = nullptr;
        EXPECT_EQ(scapeCommInitRankConfig(&base, 3, c.id, c.rank, &cfg), scapeSuccess)
            << scapeGetLastError(nullptr);
        if (!base) return false;
        for (int i = 0; i < 5; ++i) {
          scapeUniqueId id;
          if (c.rank == 0) {
            EXPECT_EQ(scapeGetUniqueId(&id), scapeSuccess);
          }
          // Each new unique id travels over the first communicator, as an application would do.
          EXPECT_SCAPE_OK(scapeBroadcast(&id, &id, sizeof(id) / 4, scapeInt32, 0, base, nullptr),
                          base);
          scapeComm_t comm = nullptr;
          EXPECT_EQ(scapeCommInitRankConfig(&comm, 3, id, c.rank, &cfg), scapeSuccess)
              << scapeGetLastError(nullptr);
          if (!comm) return false;
          EXPECT_SCAPE_OK(scapeBarrier(comm), comm);
          EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
        }
        EXPECT_EQ(scapeCommDestroy(base), scapeSuccess);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

int64_t MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

// Anyone who can reach the root's port, without the secret, must not be able to stop a
// communicator from forming: idle connections, connections that trickle a partial hello, and
// more of them than the root keeps at once (kMaxUnauthenticated), all opened before the ranks
// arrive and held open while they do. The old root served connections one at a time, 5 s
// each: three idle ones made every rank of a 10 s communicator time out.
TEST(BootstrapRoot, IdleAndSlowConnectionsDoNotStopFormation) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 10000;
  RunResult res = RunRanks(
      3,
      [&](RankCtx& c) {
        std::vector<Socket> idle;
        if (c.rank == 0) {
          RootAddress root;
          EXPECT_TRUE(scape::bootstrap::DecodeUniqueId(c.id, &root).ok());
          auto dl = scape::Deadline::AfterMs(5000);
          const size_t nIdle = scape::bootstrap::kMaxUnauthenticated + 32;
          for (size_t i = 0; i < nIdle; ++i) {
            Socket s;
            EXPECT_TRUE(Socket::Connect(root.addr, dl, &s).ok());
            if (i % 8 == 0) {
              // A slow one: the first bytes of a hello, the rest never comes.
              ForgedHello h{};
              h.magic = 0x3148455041435353ull;
              (void)s.SendAll(&h, 12, dl);
            }
            idle.push_back(std::move(s));
          }
        } else {
          usleep(300000);  // the idle connections are queued before these ranks arrive
        }
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        auto t0 = std::chrono::steady_clock::now();
        scapeResult_t r = scapeCommInitRankConfig(&comm, 3, c.id, c.rank, &cfg);
        const int64_t ms = MsSince(t0);
        EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(nullptr);
        EXPECT_LT(ms, 4000) << "formation waited on connections that never presented the secret";
        if (r != scapeSuccess) return false;
        EXPECT_SCAPE_OK(scapeBarrier(comm), comm);
        EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Ranks that arrive after formation failed (here: two processes claim rank 1) learn the real
// cause from the root, which stays to tell them, instead of retrying a refused connection for
// the whole timeout and reporting scapeTimeout.
TEST(BootstrapRoot, RanksArrivingAfterAFailureLearnTheCause) {
  RankOptions o;
  o.initComm = false;
  o.timeoutMs = 6000;
  RunResult res = RunRanks(
      4,
      [&](RankCtx& c) {
        const int claimed[] = {0, 1, 1, 2};
        const int rank = claimed[c.rank];
        if (c.rank == 2) usleep(300000);   // the second claimant of rank 1
        if (c.rank == 3) usleep(1500000);  // long after the failure
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = o.timeoutMs;
        scapeComm_t comm = nullptr;
        auto t0 = std::chrono::steady_clock::now();
        scapeResult_t r = scapeCommInitRankConfig(&comm, 3, c.id, rank, &cfg);
        const int64_t ms = MsSince(t0);
        EXPECT_EQ(r, scapeInvalidUsage)
            << "process " << c.rank << ": " << scapeGetLastError(nullptr);
        EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("two processes claim rank 1"),
                  std::string::npos)
            << "process " << c.rank << ": " << scapeGetLastError(nullptr);
        EXPECT_LT(ms, 3000) << "process " << c.rank;
        EXPECT_EQ(comm, nullptr);
        // The root runs in process 0 (it made the unique id): keep it until the late rank is done.
        if (c.rank == 0) usleep(2500000);
        return true;
      },
      o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The wire readers take bytes as they come: one at a time gives the same result as all at
// once, and malformed input is refused with an error, never read past.
TEST(BootstrapWire, ReadersAcceptAnySplitAndRefuseMalformedInput) {
  scape::bootstrap::Secret secret{};
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> blob = {1, 2, 3, 4, 5};
  scape::bootstrap::Hello h = scape::bootstrap::MakeHello(secret, 2, 4, 5, 99, 1000, 7);
  std::vector<uint8_t> msg(reinterpret_cast<uint8_t*>(&h),
                           reinterpret_cast<uint8_t*>(&h) + sizeof(h));
  msg.insert(msg.end(), blob.begin(), blob.end());
  {
    scape::bootstrap::HelloReader rd;
    for (size_t i = 0; i < msg.size(); ++i) {
      size_t used = 0;
      bool refuse = false;
      ASSERT_TRUE(rd.Feed(&msg[i], 1, secret, &used, &refuse).ok());
      EXPECT_EQ(used, 1u);
    }
    EXPECT_TRUE(rd.complete());
    EXPECT_EQ(rd.blob(), blob);
    EXPECT_EQ(rd.hello().rank, 2);
  }
  {
    scape::bootstrap::Secret wrong = secret;
    wrong[0] ^= 1;
    scape::bootstrap::HelloReader rd;
    size_t used = 0;
    bool refuse = false;
    scape::Status st = rd.Feed(msg.data(), msg.size(), wrong, &used, &refuse);
    EXPECT_EQ(st.code(), scapeRemoteError);
    EXPECT_TRUE(refuse);
    EXPECT_FALSE(rd.authenticated());
  }
  std::vector<scape::bootstrap::PeerEntry> table(3);
  for (size_t r = 0; r < table.size(); ++r) {
    table[r].hostHash = r + 10;
    table[r].pid = static_cast<uint32_t>(r + 100);
    table[r].blob.assign(r + 1, static_cast<uint8_t>(r));
  }
  std::vector<uint8_t> reply = scape::bootstrap::EncodeReply(scape::Status::Ok(), 3, &table);
  {
    scape::bootstrap::ReplyReader rd(3);
    for (size_t i = 0; i < reply.size(); ++i) {
      size_t used = 0;
      ASSERT_TRUE(rd.Feed(&reply[i], 1, &used).ok());
      EXPECT_EQ(used, 1u);
    }
    ASSERT_TRUE(rd.complete());
    ASSERT_TRUE(rd.verdict().ok());
    ASSERT_EQ(rd.table().size(), 3u);
    EXPECT_EQ(rd.table()[2].blob, table[2].blob);
    EXPECT_EQ(rd.table()[1].pid, 101u);
  }
  {
    scape::bootstrap::ReplyReader rd(4);  // the root answered for 3
    size_t used = 0;
    EXPECT_EQ(rd.Feed(reply.data(), reply.size(), &used).code(), scapeRemoteError);
  }
  {
    std::vector<uint8_t> bad = reply;
    bad[24 + 8] = 0;  // first entry's blob length: 0
    bad[24 + 9] = 0;
    scape::bootstrap::ReplyReader rd(3);
    size_t used = 0;
    EXPECT_EQ(rd.Feed(bad.data(), bad.size(), &used).code(), scapeRemoteError);
  }
  {
    std::vector<uint8_t> err = scape::bootstrap::EncodeReply(
        scape::InvalidUsage("two processes claim rank 1"), 3, nullptr);
    scape::bootstrap::ReplyReader rd(3);
    size_t used = 0;
    ASSERT_TRUE(rd.Feed(err.data(), err.size(), &used).ok());
    ASSERT_TRUE(rd.complete());
    EXPECT_EQ(rd.verdict().code(), scapeInvalidUsage);
    EXPECT_NE(rd.verdict().message().find("two processes"), std::string::npos);
  }
}

}  // namespace
}  // namespace scape_test
