// One side of an off-host NCCL net plugin test (run_plugin_netns.sh): loads the built
// libnccl-net-scape.so as NCCL does (dlopen, ncclNetPlugin_v11) and drives it as NCCL's proxy
// does. The receiver listens and publishes its connect handle as a file in a directory both
// namespaces see; the sender reads it and connects over the veth interface.
//   offhost_plugin <plugin.so> recv|send <case> <dir>
// Cases (all four run in ctest's OffHost.NcclPluginNetNamespaces):
//   xfer        1 KiB, 1 MiB, 64 MiB (eager and rendezvous), checked byte for byte.
//   killsend    the sender posts a 64 MiB send and a second thread SIGKILLs it at once; the
//               receiver's test() must fail (ncclRemoteError / ncclSystemError) within
//               kErrorBoundMs.
//   killsendmid the same with a 256 MiB send, the sender killed by a second thread ~15 ms into
//               the transfer while its main thread progresses the send (data flowing). (The
//               sender's own thread cannot time the kill: one test() call can push the whole
//               message into the socket, so on a quiet machine a sender that died "after 40 ms
//               of progress" had already sent all 64 MiB, and the case failed.)
//   killrecv    the sender posts 4 x 16 MiB; the receiver posts one receive, progresses it
//               until the sends are posted and ~40 ms more, then SIGKILLs itself; the
//               sender's test() (or isend) must fail within the bound.
// Exit status: 0 when the side saw what it should, 1 otherwise; the side that kills itself
// dies by SIGKILL. Every wait has a deadline. One line "offhost-plugin ..." per outcome.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "plugin/nccl/net_abi.h"

namespace {

constexpr int kErrorBoundMs = 15000;  // a dead peer must be reported within this
constexpr int kWaitMs = 30000;        // every other wait

const ncclNet_v11_t* g_net = nullptr;
std::string g_role;
std::string g_case;

// The killed sender's message: 64 MiB (killsend), 256 MiB (killsendmid: it must still be in
// flight after ~15 ms of progress on an idle machine).
size_t KillSendBytes() { return g_case == "killsendmid" ? size_t{256} << 20 : size_t{64} << 20; }

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Logger(ncclDebugLogLevel level, unsigned long, const char* file, int line, const char* fmt,
            ...) {
  if (level != NCCL_LOG_WARN && !std::getenv("OFFHOST_VERBOSE")) return;
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "[%s %s] %s:%d %s\n", g_role.c_str(),
               level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line, buf);
}

[[noreturn]] void Fail(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::printf("offhost-plugin %s %s: FAIL %s\n", g_case.c_str(), g_role.c_str(), buf);
  std::fflush(stdout);
  std::exit(1);
}

#define CHECK_OK(expr)                                             \
  do {                                                             \
    ncclResult_t _r = (expr);                                      \
    if (_r != ncclSuccess) Fail("%s returned %d", #expr, (int)_r); \
  } while (0)

// Files in the shared directory: written whole, then renamed, so a reader sees all or nothing.
void PutFile(const std::string& path, const void* data, size_t len) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f || std::fwrite(data, 1, len, f) != len || std::fclose(f) != 0)
    Fail("cannot write %s", tmp.c_str());
  if (std::rename(tmp.c_str(), path.c_str()) != 0) Fail("cannot rename %s", tmp.c_str());
}
bool GetFile(const std::string& path, void* data, size_t len, int timeoutMs) {
  const int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f) {
      size_t n = std::fread(data, 1, len, f);
      std::fclose(f);
      return n == len;
    }
    if (NowMs() > deadline) return false;
    usleep(2000);
  }
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint8_t Byte(uint64_t seed, size_t i) {
  return static_cast<uint8_t>(Mix(seed ^ (i / 8)) >> (8 * (i % 8)));
}
void Fill(std::vector<uint8_t>* b, uint64_t seed) {
  for (size_t i = 0; i < b->size(); ++i) (*b)[i] = Byte(seed, i);
}

// Polls a request to completion: ncclSuccess, the error test() returned, or -1 on timeout.
int Wait(void* req, int* size, int timeoutMs) {
  const int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    int done = 0;
    ncclResult_t r = g_net->test(req, &done, size);
    if (r != ncclSuccess) return r;
    if (done) return ncclSuccess;
    if (NowMs() > deadline) return -1;
  }
}
// isend retried while it returns no request: ncclSuccess, an error, or -1 on timeout.
int Send(void* sc, void* data, size_t size, int tag, void* mh, void** req, int timeoutMs) {
  const int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    *req = nullptr;
    ncclResult_t r = g_net->isend(sc, data, size, tag, mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (*req) return ncclSuccess;
    if (NowMs() > deadline) return -1;
  }
}
int Recv(void* rc, void* data, size_t size, int tag, void* mh, void** req, int timeoutMs) {
  const int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    *req = nullptr;
    size_t cap = size;
    ncclResult_t r = g_net->irecv(rc, 1, &data, &cap, &tag, &mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (*req) return ncclSuccess;
    if (NowMs() > deadline) return -1;
  }
}

bool IsPeerError(int r) { return r == ncclRemoteError || r == ncclSystemError; }

[[noreturn]] void DieNow() {
  std::fflush(stdout);
  std::fflush(stderr);
  raise(SIGKILL);
  _exit(99);  // not reached
}

// ---- receiver ---------------------------------------------------------------------------------
int Receiver(void* ctx, const std::string& dir) {
  char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
  void* lc = nullptr;
  CHECK_OK(g_net->listen(ctx, 0, h, &lc));
  PutFile(dir + "/handle", h, sizeof(h));
  void* rc = nullptr;
  ncclNetDeviceHandle_v11_t* dh = nullptr;
  const int64_t deadline = NowMs() + kWaitMs;
  while (!rc) {
    CHECK_OK(g_net->accept(lc, &rc, &dh));
    if (!rc && NowMs() > deadline) Fail("accept timed out");
    if (!rc) usleep(100);
  }
  CHECK_OK(g_net->closeListen(lc));

  if (g_case == "xfer") {
    const size_t sizes[] = {size_t{1} << 10, size_t{1} << 20, size_t{64} << 20};
    for (int k = 0; k < 3; ++k) {
      std::vector<uint8_t> buf(sizes[k], 0);
      void* mh = nullptr;
      CHECK_OK(g_net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
      void* req = nullptr;
      if (Recv(rc, buf.data(), buf.size(), k, mh, &req, kWaitMs) != ncclSuccess)
        Fail("irecv of %zu bytes", sizes[k]);
      int got = -1;
      const int64_t t0 = NowMs();
      int r = Wait(req, &got, kWaitMs);
      if (r != ncclSuccess) Fail("receive of %zu bytes: test() returned %d", sizes[k], r);
      if (got != static_cast<int>(sizes[k])) Fail("received size %d, expected %zu", got, sizes[k]);
      for (size_t i = 0; i < buf.size(); ++i)
        if (buf[i] != Byte(1000 + k, i)) Fail("%zu bytes: byte %zu differs", sizes[k], i);
      std::printf("offhost-plugin xfer recv: %zu bytes ok, byte for byte (%lld ms)\n", sizes[k],
                  static_cast<long long>(NowMs() - t0));
      CHECK_OK(g_net->deregMr(rc, mh));
    }
    const char done = 1;
    PutFile(dir + "/done", &done, 1);  // the sender closes only after this
    CHECK_OK(g_net->closeRecv(rc));
    return 0;
  }

  if (g_case == "killsend" || g_case == "killsendmid") {
    std::vector<uint8_t> buf(KillSendBytes());
    void* mh = nullptr;
    CHECK_OK(g_net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    if (Recv(rc, buf.data(), buf.size(), 7, mh, &req, kWaitMs) != ncclSuccess) Fail("irecv");
    const char one = 1;
    PutFile(dir + "/posted", &one, 1);
    const int64_t t0 = NowMs();
    int r = Wait(req, nullptr, kErrorBoundMs + 15000);
    const long long ms = static_cast<long long>(NowMs() - t0);
    std::printf("offhost-plugin %s recv: test() returned %d after %lld ms\n", g_case.c_str(), r,
                ms);
    if (r == -1) Fail("test() still pending after %lld ms: the dead sender was not noticed", ms);
    if (r == ncclSuccess) {
      size_t good = 0;
      for (uint8_t b : buf) good += b == 0x5a;
      Fail(
          "receive completed although the sender died before sending all (%zu of %zu bytes are "
          "the sender's)",
          good, buf.size());
    }
    if (!IsPeerError(r)) Fail("test() returned %d, not ncclRemoteError/ncclSystemError", r);
    if (ms > kErrorBoundMs) Fail("error after %lld ms (bound %d ms)", ms, kErrorBoundMs);
    (void)g_net->deregMr(rc, mh);
    (void)g_net->closeRecv(rc);
    return 0;
  }

  if (g_case == "killrecv") {
    std::vector<uint8_t> buf(size_t{16} << 20);
    void* mh = nullptr;
    CHECK_OK(g_net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    if (Recv(rc, buf.data(), buf.size(), 0, mh, &req, kWaitMs) != ncclSuccess) Fail("irecv");
    // Progress the receive until the sender says all its sends are posted, then ~40 ms more
    // (data flowing), then die with the sends in flight.
    int done = 0;
    char sent;
    const int64_t deadline = NowMs() + kWaitMs;
    while (!GetFile(dir + "/sent", &sent, 1, 0)) {
      if (!done) (void)g_net->test(req, &done, nullptr);
      if (NowMs() > deadline) Fail("the sender never posted its sends");
    }
    const int64_t until = NowMs() + 40;
    while (!done && NowMs() < until) (void)g_net->test(req, &done, nullptr);
    DieNow();
  }
  Fail("unknown case");
}

// ---- sender -----------------------------------------------------------------------------------
int Sender(void* ctx, const std::string& dir) {
  char h[NCCL_NET_HANDLE_MAXSIZE];
  if (!GetFile(dir + "/handle", h, sizeof(h), kWaitMs)) Fail("no handle from the receiver");
  void* sc = nullptr;
  ncclNetDeviceHandle_v11_t* dh = nullptr;
  const int64_t deadline = NowMs() + kWaitMs;
  while (!sc) {
    CHECK_OK(g_net->connect(ctx, 0, h, &sc, &dh));
    if (!sc && NowMs() > deadline) Fail("connect timed out");
    if (!sc) usleep(100);
  }

  if (g_case == "xfer") {
    const size_t sizes[] = {size_t{1} << 10, size_t{1} << 20, size_t{64} << 20};
    for (int k = 0; k < 3; ++k) {
      std::vector<uint8_t> buf(sizes[k]);
      Fill(&buf, 1000 + k);
      void* mh = nullptr;
      CHECK_OK(g_net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
      void* req = nullptr;
      if (Send(sc, buf.data(), buf.size(), k, mh, &req, kWaitMs) != ncclSuccess)
        Fail("isend of %zu bytes", sizes[k]);
      int r = Wait(req, nullptr, kWaitMs);
      if (r != ncclSuccess) Fail("send of %zu bytes: test() returned %d", sizes[k], r);
      CHECK_OK(g_net->deregMr(sc, mh));
    }
    char done;
    if (!GetFile(dir + "/done", &done, 1, kWaitMs)) Fail("receiver never finished");
    CHECK_OK(g_net->closeSend(sc));
    std::printf("offhost-plugin xfer send: 3 sends completed\n");
    return 0;
  }

  if (g_case == "killsend" || g_case == "killsendmid") {
    char posted;
    if (!GetFile(dir + "/posted", &posted, 1, kWaitMs)) Fail("receiver never posted");
    std::vector<uint8_t> buf(KillSendBytes(), 0x5a);
    void* mh = nullptr;
    CHECK_OK(g_net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
    void* req = nullptr;
    if (Send(sc, buf.data(), buf.size(), 7, mh, &req, kWaitMs) != ncclSuccess) Fail("isend");
    // A second thread kills the process (killsend: at once; killsendmid: ~15 ms from now) while
    // this one keeps progressing the send, far from long enough for the message to finish over
    // TCP... and if it did finish, the receiver reports that as a failure of the case, not a
    // pass. (A sender that itself stopped after "a few test() calls" could already have pushed
    // all 64 MiB into the socket within the last of them.)
    int done = 0;
    const int killMs = g_case == "killsendmid" ? 15 : 0;
    std::thread([killMs] {
      std::this_thread::sleep_for(std::chrono::milliseconds(killMs));
      DieNow();
    }).detach();
    const int64_t deadline = NowMs() + kWaitMs;
    while (!done && NowMs() < deadline) (void)g_net->test(req, &done, nullptr);
    std::printf("offhost-plugin %s send: the send completed before the kill\n", g_case.c_str());
    std::fflush(stdout);
    for (;;) pause();  // the killer thread ends the process
  }

  if (g_case == "killrecv") {
    constexpr int kSends = 4;
    std::vector<std::vector<uint8_t>> bufs(kSends, std::vector<uint8_t>(size_t{16} << 20, 0x3c));
    void* mhs[kSends];
    void* reqs[kSends] = {nullptr};
    for (int i = 0; i < kSends; ++i)
      CHECK_OK(g_net->regMr(sc, bufs[i].data(), bufs[i].size(), NCCL_PTR_HOST, &mhs[i]));
    const int64_t t0 = NowMs();
    int err = 0, posted = 0;
    for (int i = 0; i < kSends && !err; ++i) {
      int r = Send(sc, bufs[i].data(), bufs[i].size(), 0, mhs[i], &reqs[i], kErrorBoundMs);
      if (r == ncclSuccess) {
        ++posted;
      } else if (r == -1) {
        Fail("isend %d neither posted nor failed within %d ms", i, kErrorBoundMs);
      } else {
        err = r;
      }
    }
    const char one = 1;
    PutFile(dir + "/sent", &one, 1);
    // Poll every posted request until each is done or failed (done ones stay done).
    bool doneAll[kSends] = {false};
    const int64_t deadline = NowMs() + kErrorBoundMs + 15000;
    int left = posted;
    while (left > 0 && NowMs() < deadline) {
      for (int i = 0; i < posted; ++i) {
        if (doneAll[i]) continue;
        int done = 0;
        ncclResult_t r = g_net->test(reqs[i], &done, nullptr);
        if (r != ncclSuccess) {
          if (!err) err = r;
          doneAll[i] = true;
          --left;
        } else if (done) {
          doneAll[i] = true;
          --left;
        }
      }
    }
    const long long ms = static_cast<long long>(NowMs() - t0);
    std::printf(
        "offhost-plugin killrecv send: %d of %d sends posted, first error %d after %lld "
        "ms, %d still pending\n",
        posted, kSends, err, ms, left);
    if (left > 0)
      Fail("%d sends still pending after %lld ms: the dead receiver not noticed", left, ms);
    if (!err) Fail("every send completed although the receiver died");
    if (!IsPeerError(err)) Fail("error %d is not ncclRemoteError/ncclSystemError", err);
    if (ms > kErrorBoundMs) Fail("error after %lld ms (bound %d ms)", ms, kErrorBoundMs);
    for (int i = 0; i < kSends; ++i) (void)g_net->deregMr(sc, mhs[i]);
    (void)g_net->closeSend(sc);
    return 0;
  }
  Fail("unknown case");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <plugin.so> recv|send <case> <dir>\n", argv[0]);
    return 2;
  }
  g_role = argv[2];
  g_case = argv[3];
  const std::string dir = argv[4];
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) Fail("dlopen: %s", dlerror());
  g_net = static_cast<const ncclNet_v11_t*>(dlsym(lib, "ncclNetPlugin_v11"));
  if (!g_net) Fail("no ncclNetPlugin_v11");
  void* ctx = nullptr;
  ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
  CHECK_OK(g_net->init(&ctx, 0x5ca9e, &cfg, &Logger, nullptr));
  int ndev = 0;
  CHECK_OK(g_net->devices(&ndev));
  ncclNetProperties_v11_t props;
  CHECK_OK(g_net->getProperties(0, &props));
  if (ndev != 1) Fail("%d devices, expected only the veth (SCAPE_NCCL_DEVICES)", ndev);
  const char* want = std::getenv("OFFHOST_DEVICE");  // the one device the plugin must show
  if (want && (!props.name || std::strcmp(props.name, want) != 0))
    Fail("device 0 is '%s', expected '%s'", props.name ? props.name : "(null)", want);
  std::printf("offhost-plugin %s %s: the plugin's one device is %s\n", g_case.c_str(),
              g_role.c_str(), props.name ? props.name : "(null)");
  int rc = g_role == "recv" ? Receiver(ctx, dir) : g_role == "send" ? Sender(ctx, dir) : 2;
  if (rc == 0 && g_case == "xfer") CHECK_OK(g_net->finalize(ctx));
  std::fflush(stdout);
  // After a peer died, UCX may still hold that peer's endpoint: leave without finalize (NCCL
  // itself aborts its communicators in that state).
  _exit(rc);
}
