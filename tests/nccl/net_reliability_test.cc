// The net plugin used carelessly (issue 15): stale handles handed back a second time must be
// refused without reading freed memory (the sanitizer pass runs this too), and every WARN line
// must carry the location of the entry point that failed, not of a shared helper.
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "tests/nccl/fake_nccl.h"

namespace {

using namespace fake_nccl;

constexpr int kWatchdogMs = 60000;

TEST(StaleHandles, SecondDeregCloseAndFinalizeAreErrors) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    void* lc = nullptr;
    void* sc = nullptr;
    void* rc = nullptr;
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    std::memset(handle, 0, sizeof(handle));
    REQUIRE_OK(e.net->listen(e.ctx, 0, handle, &lc));
    REQUIRE_OK(PollConnectAccept(e.net, e.ctx, 0, handle, lc, &sc, &rc));
    REQUIRE_OK(e.net->closeListen(lc));
    EXPECT_NE(e.net->closeListen(lc), ncclSuccess);
    std::vector<char> buf(4096);
    void* mh = nullptr;
    REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
    REQUIRE_OK(e.net->deregMr(sc, mh));
    EXPECT_EQ(e.net->deregMr(sc, mh), ncclInternalError);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"deregMr", "not a live memory handle"}));
    REQUIRE_OK(e.net->closeSend(sc));
    REQUIRE_OK(e.net->closeRecv(rc));
    EXPECT_NE(e.net->closeSend(sc), ncclSuccess);
    EXPECT_NE(e.net->closeRecv(rc), ncclSuccess);
    void* ctx = e.ctx;
    REQUIRE(e.Down());
    EXPECT_EQ(e.net->finalize(ctx), ncclInternalError);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"finalize", "not a live context"}));
    return true;
  });
}

TEST(Logging, WarnLinesNameTheFailingEntryPoint) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    ClearLogs();
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    EXPECT_NE(e.net->listen(e.ctx, 77, h, &lc), ncclSuccess);
    EXPECT_NE(e.net->deregMr(nullptr, nullptr), ncclSuccess);
    int done = 0;
    EXPECT_NE(e.net->test(nullptr, &done, nullptr), ncclSuccess);
    std::vector<LogLine> logs = Logs();
    std::set<int> lines;
    for (const LogLine& l : logs) {
      if (l.level != NCCL_LOG_WARN) continue;
      EXPECT_NE(l.file.find("net_v11.cc"), std::string::npos) << l.file << ": " << l.text;
      lines.insert(l.line);
    }
    // Three entry points, three call sites (all three used to name the one reporting helper).
    EXPECT_EQ(lines.size(), 3u);
    REQUIRE(e.Down());
    return true;
  });
}

}  // namespace
