// The bootstrap root faces the network: garbage, wrong secrets and absurd sizes must be refused
// without disturbing the ranks that do belong.
#include <gtest/gtest.h>

#include <cstring>
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
  RunResult res = RunRanks(2, [&](RankCtx& c) {
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
    EXPECT_SCAPE_OK(scapeAllReduce(&v, &sum, 1, scapeInt32, scapeSum, nullptr, comm, nullptr), comm);
    EXPECT_EQ(sum, 2);
    EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
    return true;
  }, o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Many communicators, one after the other, in the same processes: nothing leaks that stops
// the next one from forming.
TEST(BootstrapRoot, RepeatedInitDestroy) {
  RankOptions o;
  o.initComm = false;
  RunResult res = RunRanks(3, [&](RankCtx& c) {
    scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
    cfg.timeoutMs = 10000;
    scapeComm_t base = nullptr;
    EXPECT_EQ(scapeCommInitRankConfig(&base, 3, c.id, c.rank, &cfg), scapeSuccess) << scapeGetLastError(nullptr);
    if (!base) return false;
    for (int i = 0; i < 5; ++i) {
      scapeUniqueId id;
      if (c.rank == 0) {
        EXPECT_EQ(scapeGetUniqueId(&id), scapeSuccess);
      }
      // Each new unique id travels over the first communicator, as an application would do.
      EXPECT_SCAPE_OK(scapeBroadcast(&id, &id, sizeof(id) / 4, scapeInt32, 0, base, nullptr), base);
      scapeComm_t comm = nullptr;
      EXPECT_EQ(scapeCommInitRankConfig(&comm, 3, id, c.rank, &cfg), scapeSuccess) << scapeGetLastError(nullptr);
      if (!comm) return false;
      EXPECT_SCAPE_OK(scapeBarrier(comm), comm);
      EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
    }
    EXPECT_EQ(scapeCommDestroy(base), scapeSuccess);
    return true;
  }, o);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
}  // namespace scape_test
