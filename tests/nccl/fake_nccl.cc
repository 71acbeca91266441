#include "tests/nccl/fake_nccl.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

namespace fake_nccl {

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool g_skipLeakCheck = false;
std::mutex g_logMu;
std::vector<LogLine>* g_logs = new std::vector<LogLine>();

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

bool LoadPlugin(Plugin* p, std::string* err) {
  p->lib = dlopen(SCAPE_SO_PATH, RTLD_NOW | RTLD_LOCAL);
  if (!p->lib) {
    *err = std::string("dlopen: ") + dlerror();
    return false;
  }
  p->v11 = static_cast<ncclNet_v11_t*>(dlsym(p->lib, "ncclNetPlugin_v11"));
  p->v10 = static_cast<ncclNet_v10_t*>(dlsym(p->lib, "ncclNetPlugin_v10"));
  p->v9 = static_cast<ncclNet_v9_t*>(dlsym(p->lib, "ncclNetPlugin_v9"));
  p->v8 = static_cast<ncclNet_v8_t*>(dlsym(p->lib, "ncclNetPlugin_v8"));
  if (!p->v11 || !p->v10 || !p->v9 || !p->v8) {
    *err = "a ncclNetPlugin_vN symbol is missing";
    return false;
  }
  return true;
}

void Logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_WARN || std::getenv("FAKE_NCCL_VERBOSE"))
    std::fprintf(stderr, "[fake-nccl %d] %s %s:%d %s\n", static_cast<int>(getpid()),
                 level == NCCL_LOG_WARN   ? "WARN"
                 : level == NCCL_LOG_INFO ? "INFO"
                                          : "TRACE",
                 file, line, buf);
  std::lock_guard<std::mutex> lk(g_logMu);
  g_logs->push_back(LogLine{level, flags, buf, file ? file : "", line});
}

std::vector<LogLine> Logs() {
  std::lock_guard<std::mutex> lk(g_logMu);
  return *g_logs;
}

void ClearLogs() {
  std::lock_guard<std::mutex> lk(g_logMu);
  g_logs->clear();
}

bool Logged(int level, const std::vector<std::string>& needles) {
  for (const LogLine& l : Logs()) {
    if (l.level != level) continue;
    bool all = true;
    for (const std::string& n : needles) all = all && l.text.find(n) != std::string::npos;
    if (all) return true;
  }
  return false;
}

void SkipLeakCheck() { g_skipLeakCheck = true; }

bool RunProcs(const std::vector<std::function<bool()>>& bodies, int watchdogMs,
              std::string* report) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (size_t i = 0; i < bodies.size(); ++i) {
    pid_t pid = fork();
    if (pid == 0) {
      bool ok = false;
      try {
        ok = bodies[i]();
      } catch (...) {
        std::fprintf(stderr, "child %zu: exception\n", i);
      }
      ok = ok && !::testing::Test::HasFailure();
#if defined(__SANITIZE_ADDRESS__)
      // _exit skips LeakSanitizer's exit-time check: run it here (the body has released all it
      // made: finalize, close, dlclose are part of the bodies).
      if (!g_skipLeakCheck && __lsan_do_recoverable_leak_check() != 0) {
        std::fprintf(stderr, "child %zu: LeakSanitizer found leaks\n", i);
        ok = false;
      }
#endif
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(ok ? 0 : 1);
    }
    if (pid < 0) {
      *report = "fork failed";
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      return false;
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), 999);
  size_t left = pids.size();
  int64_t deadline = NowMs() + watchdogMs;
  bool fired = false;
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != 999) continue;
      int st = 0;
      pid_t r = waitpid(pids[i], &st, WNOHANG);
      if (r == pids[i]) {
        codes[i] = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
        --left;
      }
    }
    if (left == 0) break;
    if (NowMs() > deadline) {
      fired = true;
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == 999) kill(pids[i], SIGKILL);
      for (size_t i = 0; i < pids.size(); ++i)
        if (codes[i] == 999) {
          int st = 0;
          waitpid(pids[i], &st, 0);
          codes[i] = -SIGKILL;
        }
      break;
    }
    usleep(2000);
  }
  std::ostringstream os;
  bool ok = !fired;
  if (fired) os << "watchdog fired after " << watchdogMs << " ms (children killed); ";
  os << "exit codes:";
  for (size_t i = 0; i < codes.size(); ++i) {
    os << " child" << i << "=" << codes[i];
    if (codes[i] != 0) ok = false;
  }
  *report = os.str();
  return ok;
}

Pipe::Pipe() {
  if (pipe2(fd_, O_CLOEXEC) != 0) fd_[0] = fd_[1] = -1;
}

Pipe::~Pipe() {
  if (fd_[0] >= 0) close(fd_[0]);
  if (fd_[1] >= 0) close(fd_[1]);
}

bool Pipe::Write(const void* buf, size_t len, int timeoutMs) const {
  const char* p = static_cast<const char*>(buf);
  int64_t deadline = NowMs() + timeoutMs;
  while (len > 0) {
    struct pollfd pf = {fd_[1], POLLOUT, 0};
    int64_t left = deadline - NowMs();
    if (left <= 0) return false;
    if (poll(&pf, 1, static_cast<int>(left)) <= 0) continue;
    ssize_t n = write(fd_[1], p, len);
    if (n < 0 && errno != EINTR && errno != EAGAIN) return false;
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    }
  }
  return true;
}

bool Pipe::Read(void* buf, size_t len, int timeoutMs) const {
  char* p = static_cast<char*>(buf);
  int64_t deadline = NowMs() + timeoutMs;
  while (len > 0) {
    struct pollfd pf = {fd_[0], POLLIN, 0};
    int64_t left = deadline - NowMs();
    if (left <= 0) return false;
    if (poll(&pf, 1, static_cast<int>(left)) <= 0) continue;
    ssize_t n = read(fd_[0], p, len);
    if (n == 0) return false;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return false;
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
    }
  }
  return true;
}

ncclResult_t InitCtx(const ncclNet_v11_t* net, void** ctx, uint64_t commId) {
  ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
  return net->init(ctx, commId, &cfg, &Logger, nullptr);
}

int PollConnect(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void** sendComm,
                int timeoutMs) {
  *sendComm = nullptr;
  ncclNetDeviceHandle_v11_t* dh = nullptr;
  int64_t deadline = NowMs() + timeoutMs;
  while (!*sendComm) {
    ncclResult_t r = net->connect(ctx, dev, handle, sendComm, &dh);
    if (r != ncclSuccess) return r;
    if (*sendComm) break;
    if (NowMs() > deadline) return kTimedOut;
    usleep(100);
  }
  return ncclSuccess;
}

int PollAccept(const ncclNet_v11_t* net, void* listenComm, void** recvComm, int timeoutMs) {
  *recvComm = nullptr;
  ncclNetDeviceHandle_v11_t* dh = nullptr;
  int64_t deadline = NowMs() + timeoutMs;
  while (!*recvComm) {
    ncclResult_t r = net->accept(listenComm, recvComm, &dh);
    if (r != ncclSuccess) return r;
    if (*recvComm) break;
    if (NowMs() > deadline) return kTimedOut;
    usleep(100);
  }
  return ncclSuccess;
}

int PollConnectAccept(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void* listenComm,
                      void** sendComm, void** recvComm, int timeoutMs) {
  *sendComm = *recvComm = nullptr;
  int64_t deadline = NowMs() + timeoutMs;
  while (!*sendComm || !*recvComm) {
    if (!*sendComm) {
      ncclResult_t r = net->connect(ctx, dev, handle, sendComm, nullptr);
      if (r != ncclSuccess) return r;
    }
    if (!*recvComm) {
      ncclResult_t r = net->accept(listenComm, recvComm, nullptr);
      if (r != ncclSuccess) return r;
    }
    if (NowMs() > deadline) return kTimedOut;
  }
  return ncclSuccess;
}

int PostSend(const ncclNet_v11_t* net, void* comm, void* data, size_t size, int tag, void* mh,
             void** req, int timeoutMs) {
  int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    *req = nullptr;
    ncclResult_t r = net->isend(comm, data, size, tag, mh, nullptr, req);
    if (r != ncclSuccess) return r;
    if (*req) return ncclSuccess;
    if (NowMs() > deadline) return kTimedOut;
  }
}

int PostRecv(const ncclNet_v11_t* net, void* comm, int n, void** data, size_t* sizes, int* tags,
             void** mhs, void** req, int timeoutMs) {
  int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    *req = nullptr;
    ncclResult_t r = net->irecv(comm, n, data, sizes, tags, mhs, nullptr, req);
    if (r != ncclSuccess) return r;
    if (*req) return ncclSuccess;
    if (NowMs() > deadline) return kTimedOut;
  }
}

int WaitReq(const ncclNet_v11_t* net, void* req, int* sizes, int timeoutMs) {
  int64_t deadline = NowMs() + timeoutMs;
  for (;;) {
    int done = 0;
    ncclResult_t r = net->test(req, &done, sizes);
    if (r != ncclSuccess) return r;
    if (done) return ncclSuccess;
    if (NowMs() > deadline) return kTimedOut;
  }
}

void Fill(void* buf, size_t len, uint64_t seed) {
  uint8_t* b = static_cast<uint8_t*>(buf);
  size_t words = len / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t v = Mix(seed ^ (i * 0x100000001b3ull));
    std::memcpy(b + i * 8, &v, 8);
  }
  uint64_t v = Mix(seed ^ (words * 0x100000001b3ull));
  for (size_t i = words * 8; i < len; ++i) b[i] = static_cast<uint8_t>(v >> (8 * (i % 8)));
}

size_t FirstMismatch(const void* buf, size_t len, uint64_t seed) {
  const uint8_t* b = static_cast<const uint8_t*>(buf);
  size_t words = len / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t v = Mix(seed ^ (i * 0x100000001b3ull));
    if (std::memcmp(b + i * 8, &v, 8) != 0) {
      for (size_t k = 0; k < 8; ++k)
        if (b[i * 8 + k] != static_cast<uint8_t>(v >> (8 * k))) return i * 8 + k;
    }
  }
  uint64_t v = Mix(seed ^ (words * 0x100000001b3ull));
  for (size_t i = words * 8; i < len; ++i)
    if (b[i] != static_cast<uint8_t>(v >> (8 * (i % 8)))) return i;
  return len;
}

int CountFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - 1;  // the directory stream itself
}

size_t HeapInUse() {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
}

}  // namespace fake_nccl
