// The net plugin driven from several threads at once, as NCCL's proxy threads do, with the
// plugin linked statically (ncclNetPlugin_v11 referenced directly, no dlopen) so that the
// ThreadSanitizer pass (tests/tsan/run.sh) instruments the plugin's own code: clang 14's TSan
// runtime cannot load a sanitized shared library here. In one process on one shared context:
//   - two threads, each moving data over its own send/receive comm pair;
//   - a "proxy" pair where one thread posts isend/irecv and another calls test() on those
//     requests (handed over through a queue), as NCCL's proxy progress thread does;
//   - a service thread registering and deregistering memory on the comms being progressed.
// Every wait has a deadline; every transfer is checked byte for byte.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/nccl/net_abi.h"

extern "C" ncclNet_v11_t ncclNetPlugin_v11;

namespace {

const ncclNet_v11_t* const N = &ncclNetPlugin_v11;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Logger(ncclDebugLogLevel level, unsigned long, const char* file, int line, const char* fmt,
            ...) {
  if (level != NCCL_LOG_WARN) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "WARN %s:%d %s\n", file, line, buf);
}

uint8_t Byte(uint64_t seed, size_t i) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + (i / 8) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> (8 * (i % 8)));
}

// A send comm and a receive comm of one process connected to each other.
struct Pair {
  void* sc = nullptr;
  void* rc = nullptr;
  bool Open(void* ctx) {
    char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void* lc = nullptr;
    if (N->listen(ctx, 0, h, &lc) != ncclSuccess) return false;
    const int64_t deadline = NowMs() + 20000;
    while ((!sc || !rc) && NowMs() < deadline) {
      if (!sc && N->connect(ctx, 0, h, &sc, nullptr) != ncclSuccess) return false;
      if (!rc && N->accept(lc, &rc, nullptr) != ncclSuccess) return false;
    }
    return N->closeListen(lc) == ncclSuccess && sc && rc;
  }
  bool Close() { return N->closeSend(sc) == ncclSuccess && N->closeRecv(rc) == ncclSuccess; }
};

// isend/irecv retried while no request comes back; false on error or after the deadline.
bool PostSend(void* sc, void* d, size_t n, int tag, void* mh, void** req) {
  const int64_t deadline = NowMs() + 20000;
  do {
    *req = nullptr;
    if (N->isend(sc, d, n, tag, mh, nullptr, req) != ncclSuccess) return false;
    if (*req) return true;
  } while (NowMs() < deadline);
  return false;
}
bool PostRecv(void* rc, void* d, size_t n, int tag, void* mh, void** req) {
  const int64_t deadline = NowMs() + 20000;
  do {
    *req = nullptr;
    size_t cap = n;
    if (N->irecv(rc, 1, &d, &cap, &tag, &mh, nullptr, req) != ncclSuccess) return false;
    if (*req) return true;
  } while (NowMs() < deadline);
  return false;
}
bool WaitReq(void* req, int* size) {
  const int64_t deadline = NowMs() + 20000;
  do {
    int done = 0;
    if (N->test(req, &done, size) != ncclSuccess) return false;
    if (done) return true;
  } while (NowMs() < deadline);
  return false;
}

// One thread moving `iters` messages of `bytes` over its own pair, checking each.
bool DrivePair(Pair* p, size_t bytes, int iters, uint64_t seed) {
  std::vector<uint8_t> sb(bytes), rb(bytes);
  void *smh = nullptr, *rmh = nullptr;
  if (N->regMr(p->sc, sb.data(), bytes, NCCL_PTR_HOST, &smh) != ncclSuccess ||
      N->regMr(p->rc, rb.data(), bytes, NCCL_PTR_HOST, &rmh) != ncclSuccess)
    return false;
  bool ok = true;
  for (int it = 0; ok && it < iters; ++it) {
    for (size_t i = 0; i < bytes; ++i) sb[i] = Byte(seed + it, i);
    void *rreq, *sreq;
    int got = -1;
    ok = PostRecv(p->rc, rb.data(), bytes, it & 7, rmh, &rreq) &&
         PostSend(p->sc, sb.data(), bytes, it & 7, smh, &sreq) && WaitReq(sreq, nullptr) &&
         WaitReq(rreq, &got) && got == static_cast<int>(bytes) &&
         std::memcmp(sb.data(), rb.data(), bytes) == 0;
  }
  ok = N->deregMr(p->sc, smh) == ncclSuccess && ok;
  ok = N->deregMr(p->rc, rmh) == ncclSuccess && ok;
  return ok;
}

TEST(Threads, TwoCommsOneContextPlusProxyStyleTestThread) {
  void* ctx = nullptr;
  ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
  ASSERT_EQ(N->init(&ctx, 0x7e57, &cfg, &Logger, nullptr), ncclSuccess);
  Pair a, b, c;
  ASSERT_TRUE(a.Open(ctx));
  ASSERT_TRUE(b.Open(ctx));
  ASSERT_TRUE(c.Open(ctx));

  std::atomic<bool> okA{false}, okB{false}, stop{false};
  std::atomic<int> regErrors{0};
  // Two threads, each on its own comm pair: eager and rendezvous sizes.
  std::thread ta([&] { okA = DrivePair(&a, 4096, 200, 1); });
  std::thread tb([&] { okB = DrivePair(&b, size_t{1} << 20, 20, 2); });
  // A service thread registering memory on comms the others are progressing.
  std::thread service([&] {
    std::vector<char> buf(1 << 16);
    for (int i = 0; !stop.load(); ++i) {
      void* comm = (i % 4 == 0) ? a.sc : (i % 4 == 1) ? a.rc : (i % 4 == 2) ? b.sc : b.rc;
      void* mh = nullptr;
      if (N->regMr(comm, buf.data(), buf.size(), NCCL_PTR_HOST, &mh) != ncclSuccess ||
          N->deregMr(comm, mh) != ncclSuccess)
        regErrors++;
    }
  });

  // Proxy style on pair c: this thread posts, `tester` calls test() until each completes.
  constexpr int kMsgs = 64;
  constexpr size_t kBytes = 65536;
  void *smh = nullptr, *rmh = nullptr;
  std::vector<uint8_t> sarena(kBytes * kMsgs), rarena(kBytes * kMsgs);
  ASSERT_EQ(N->regMr(c.sc, sarena.data(), sarena.size(), NCCL_PTR_HOST, &smh), ncclSuccess);
  ASSERT_EQ(N->regMr(c.rc, rarena.data(), rarena.size(), NCCL_PTR_HOST, &rmh), ncclSuccess);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<void*> queue;
  std::atomic<int> completed{0}, testErrors{0};
  bool posterDone = false;
  std::thread tester([&] {
    const int64_t deadline = NowMs() + 60000;
    std::vector<void*> pending;
    while (NowMs() < deadline) {
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, std::chrono::milliseconds(1), [&] { return !queue.empty() || posterDone; });
        while (!queue.empty()) {
          pending.push_back(queue.front());
          queue.pop_front();
        }
        if (posterDone && pending.empty()) break;
      }
      for (size_t i = 0; i < pending.size();) {
        int done = 0;
        if (N->test(pending[i], &done, nullptr) != ncclSuccess) {
          testErrors++;
          done = 1;
        }
        if (done) {
          completed++;
          pending[i] = pending.back();
          pending.pop_back();
        } else {
          ++i;
        }
      }
    }
  });
  bool posted = true;
  int inFlight = 0;
  for (int m = 0; posted && m < kMsgs; ++m) {
    uint8_t* s = sarena.data() + m * kBytes;
    for (size_t i = 0; i < kBytes; ++i) s[i] = Byte(100 + m, i);
    void *rreq = nullptr, *sreq = nullptr;
    posted = PostRecv(c.rc, rarena.data() + m * kBytes, kBytes, m, rmh, &rreq) &&
             PostSend(c.sc, s, kBytes, m, smh, &sreq);
    if (posted) {
      std::lock_guard<std::mutex> lk(mu);
      queue.push_back(rreq);
      queue.push_back(sreq);
      inFlight += 2;
    }
    // Keep the window bounded: wait (with a deadline) until the tester caught up.
    const int64_t deadline = NowMs() + 20000;
    while (completed.load() < inFlight - 8 && NowMs() < deadline) std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    posterDone = true;
  }
  cv.notify_all();
  tester.join();
  ta.join();
  tb.join();
  stop = true;
  service.join();

  EXPECT_TRUE(posted);
  EXPECT_EQ(completed.load(), 2 * kMsgs);
  EXPECT_EQ(testErrors.load(), 0);
  EXPECT_EQ(std::memcmp(sarena.data(), rarena.data(), sarena.size()), 0);
  EXPECT_TRUE(okA.load());
  EXPECT_TRUE(okB.load());
  EXPECT_EQ(regErrors.load(), 0);
  EXPECT_EQ(N->deregMr(c.sc, smh), ncclSuccess);
  EXPECT_EQ(N->deregMr(c.rc, rmh), ncclSuccess);
  EXPECT_TRUE(a.Close());
  EXPECT_TRUE(b.Close());
  EXPECT_TRUE(c.Close());
  EXPECT_EQ(N->finalize(ctx), ncclSuccess);
}

}  // namespace
