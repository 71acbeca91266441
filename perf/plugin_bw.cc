// plugin-bw: bandwidth of the NCCL net plugin (libnccl-net-scape.so, through its ncclNet_v11
// ABI, as NCCL's proxy drives it) between two processes on this host, beside ucx_perftest's
// tag_bw on the same UCX transports and sizes, in the same run (the two alternate per point so
// that a noisy machine hits both alike).
//
//   plugin_bw [-b 1M] [-e 256M] [-f 2] [-B 2G] [-W 8] [-r 3] [-t sm,self] [-P ucx_perftest|none]
//             [-L path/to/libnccl-net-scape.so] [-p 13500]
//
//   -b/-e/-f   sizes from -b to -e, multiplying by -f
//   -B         bytes moved per measured point (iterations = B / size, at least 5); warm-up is
//              a tenth of that (at least 2)
//   -W         transfers in flight per side (NCCL keeps up to 8 per connection); passed to
//              ucx_perftest as -O
//   -r         repeats per point; the table shows the median, min and max of the repeats
//   -t         UCX_TLS for both (UCX_NET_DEVICES defaults to lo when unset)
//   -P         the ucx_perftest binary, or "none"
//
// Like ucx_perftest's tag_bw, each side uses one buffer of the message size for every
// transfer. Bandwidth is MiB/s (2^20 bytes per second, as ucx_perftest prints "MB/s"),
// measured on the sender from its first isend to the completion of its last one (ucx_perftest
// tag_bw also reports the sender's side); the receiver's view is printed too.
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "plugin/nccl/net_abi.h"

namespace {

struct Opts {
  size_t minBytes = 1u << 20;
  size_t maxBytes = 256u << 20;
  double factor = 2;
  size_t bytesPerPoint = size_t(2) << 30;
  int window = 8;
  int repeats = 3;
  std::string tls;
  std::string perftest = "ucx_perftest";
  std::string lib = SCAPE_SO_PATH;
  int port = 13500;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t ParseSize(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end && *end ? *end : ' ') {
    case 'K':
    case 'k':
      v *= 1024;
      break;
    case 'M':
    case 'm':
      v *= 1024 * 1024;
      break;
    case 'G':
    case 'g':
      v *= 1024.0 * 1024 * 1024;
      break;
    default:
      break;
  }
  return static_cast<size_t>(v);
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = write(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n, int timeoutMs) {
  char* c = static_cast<char*>(p);
  double deadline = Now() + timeoutMs / 1000.0;
  while (n > 0) {
    struct pollfd pf = {fd, POLLIN, 0};
    if (Now() > deadline) return false;
    if (poll(&pf, 1, 100) <= 0) continue;
    ssize_t k = read(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void Logger(ncclDebugLogLevel level, unsigned long, const char* file, int line, const char* fmt,
            ...) {
  if (level != NCCL_LOG_WARN) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "plugin WARN %s:%d %s\n", file, line, buf);
}

#define CHECK(x)                                                            \
  do {                                                                      \
    ncclResult_t _r = (x);                                                  \
    if (_r != ncclSuccess) {                                                \
      std::fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, _r); \
      _exit(2);                                                             \
    }                                                                       \
  } while (0)

struct Result {
  double senderSec = 0;
  double receiverSec = 0;
};

// One side of one point, in a child process. Pipes: handle (recv -> send), ready (recv ->
// send, once per phase), result (child -> parent).
[[noreturn]] void PluginSide(const Opts& o, bool receiver, size_t size, int iters, int warm,
                             int handleFd[2], int readyFd[2], int resultFd) {
  void* lib = dlopen(o.lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "dlopen %s: %s\n", o.lib.c_str(), dlerror());
    _exit(2);
  }
  auto* net = static_cast<ncclNet_v11_t*>(dlsym(lib, "ncclNetPlugin_v11"));
  if (!net) _exit(2);
  void* ctx = nullptr;
  ncclNetCommConfig_v11_t cfg{-1};
  CHECK(net->init(&ctx, 1, &cfg, &Logger, nullptr));
  void* comm = nullptr;
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {0};
  if (receiver) {
    void* lc = nullptr;
    CHECK(net->listen(ctx, 0, handle, &lc));
    if (!WriteAll(handleFd[1], handle, sizeof(handle))) _exit(2);
    double deadline = Now() + 30;
    while (!comm) {
      CHECK(net->accept(lc, &comm, nullptr));
      if (Now() > deadline) _exit(3);
    }
    CHECK(net->closeListen(lc));
  } else {
    if (!ReadAll(handleFd[0], handle, sizeof(handle), 30000)) _exit(2);
    double deadline = Now() + 30;
    while (!comm) {
      CHECK(net->connect(ctx, 0, handle, &comm, nullptr));
      if (Now() > deadline) _exit(3);
    }
  }
  std::vector<char> buf(std::max<size_t>(size, 1));
  std::memset(buf.data(), receiver ? 0 : 0x5a, buf.size());
  void* mh = nullptr;
  CHECK(net->regMr(comm, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
  Result res;
  for (int phase = 0; phase < 2; ++phase) {
    int n = phase == 0 ? warm : iters;
    std::deque<void*> inflight;
    int posted = 0, done = 0;
    double t0 = 0;
    auto post = [&]() {
      void* req = nullptr;
      if (receiver) {
        void* d = buf.data();
        size_t sz = size;
        int tag = 1;
        CHECK(net->irecv(comm, 1, &d, &sz, &tag, &mh, nullptr, &req));
      } else {
        CHECK(net->isend(comm, buf.data(), size, 1, mh, nullptr, &req));
      }
      if (req) {
        inflight.push_back(req);
        ++posted;
      }
      return req != nullptr;
    };
    if (receiver) {
      while (posted < std::min(n, o.window)) post();
      t0 = Now();
      char go = 1;
      if (!WriteAll(readyFd[1], &go, 1)) _exit(2);
    } else {
      char go;
      if (!ReadAll(readyFd[0], &go, 1, 60000)) _exit(2);
      t0 = Now();
    }
    double deadline = Now() + 120;
    unsigned spins = 0;
    while (done < n) {
      while (posted < n && static_cast<int>(inflight.size()) < o.window && post()) {
      }
      int d = 0;
      int sizes[64];
      CHECK(net->test(inflight.front(), &d, sizes));
      if (d) {
        if (static_cast<size_t>(sizes[0]) != size) {
          std::fprintf(stderr, "size %d, expected %zu\n", sizes[0], size);
          _exit(4);
        }
        inflight.pop_front();
        ++done;
      } else if ((++spins & 4095) == 0 && Now() > deadline) {
        std::fprintf(stderr, "point timed out\n");
        _exit(3);
      }
    }
    double t = Now() - t0;
    if (receiver)
      res.receiverSec = t;
    else
      res.senderSec = t;
  }
  CHECK(net->deregMr(comm, mh));
  CHECK(receiver ? net->closeRecv(comm) : net->closeSend(comm));
  CHECK(net->finalize(ctx));
  if (!WriteAll(resultFd, &res, sizeof(res))) _exit(2);
  _exit(0);
}

// Waits for pids (kills them after timeoutSec). True if all exited 0.
bool WaitAll(const std::vector<pid_t>& pids, double timeoutSec) {
  double deadline = Now() + timeoutSec;
  bool ok = true;
  std::vector<bool> reaped(pids.size(), false);
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (reaped[i]) continue;
      int st = 0;
      if (waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        reaped[i] = true;
        --left;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
      }
    }
    if (left && Now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (!reaped[i]) {
          kill(pids[i], SIGKILL);
          waitpid(pids[i], nullptr, 0);
        }
      return false;
    }
    usleep(1000);
  }
  return ok;
}

// Returns MiB/s as the sender saw it (and the receiver's in *recvMiBs), or < 0 on failure.
double RunPlugin(const Opts& o, size_t size, int iters, int warm, double* recvMiBs) {
  int handleFd[2], readyFd[2], resFd[2];
  if (pipe(handleFd) || pipe(readyFd) || pipe(resFd)) return -1;
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int side = 0; side < 2; ++side) {
    pid_t pid = fork();
    if (pid == 0) PluginSide(o, side == 0, size, iters, warm, handleFd, readyFd, resFd[1]);
    pids.push_back(pid);
  }
  Result a, b;
  bool ok = ReadAll(resFd[0], &a, sizeof(a), 300000) && ReadAll(resFd[0], &b, sizeof(b), 300000);
  ok = WaitAll(pids, 60) && ok;
  for (int fd : {handleFd[0], handleFd[1], readyFd[0], readyFd[1], resFd[0], resFd[1]}) close(fd);
  if (!ok) return -1;
  double sendSec = a.senderSec > 0 ? a.senderSec : b.senderSec;
  double recvSec = a.receiverSec > 0 ? a.receiverSec : b.receiverSec;
  double mib = static_cast<double>(size) * iters / (1024.0 * 1024.0);
  *recvMiBs = mib / recvSec;
  return mib / sendSec;
}

// ucx_perftest tag_bw server + client; the client's final "overall" bandwidth (MB/s).
double RunPerftest(const Opts& o, size_t size, int iters, int warm, int port) {
  std::vector<std::string> common = {"-t", "tag_bw",
                                     "-s", std::to_string(size),
                                     "-n", std::to_string(iters),
                                     "-w", std::to_string(warm),
                                     "-O", std::to_string(o.window),
                                     "-p", std::to_string(port),
                                     "-f"};
  auto spawn = [&](bool client, int outFd) {
    pid_t pid = fork();
    if (pid == 0) {
      dup2(outFd, 1);
      int devnull = open("/dev/null", O_WRONLY);
      if (devnull >= 0) dup2(devnull, 2);
      std::vector<std::string> args = {o.perftest};
      if (client) args.push_back("127.0.0.1");
      args.insert(args.end(), common.begin(), common.end());
      std::vector<char*> argv;
      for (std::string& s : args) argv.push_back(&s[0]);
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    return pid;
  };
  int srvOut[2], cliOut[2];
  if (pipe(srvOut) || pipe(cliOut)) return -1;
  std::fflush(stdout);
  pid_t srv = spawn(false, srvOut[1]);
  usleep(300 * 1000);  // let the server listen
  pid_t cli = spawn(true, cliOut[1]);
  close(srvOut[1]);
  close(cliOut[1]);
  std::string out;
  char buf[4096];
  double deadline = Now() + 300;
  for (;;) {
    struct pollfd pf = {cliOut[0], POLLIN, 0};
    if (Now() > deadline) break;
    if (poll(&pf, 1, 100) <= 0) continue;
    ssize_t k = read(cliOut[0], buf, sizeof(buf));
    if (k <= 0) break;
    out.append(buf, static_cast<size_t>(k));
  }
  bool ok = WaitAll({cli, srv}, 30);
  close(srvOut[0]);
  close(cliOut[0]);
  if (!ok) return -1;
  // Final line: iterations, latency 50%/avg/overall, bandwidth avg/overall, msgrate avg/overall.
  std::vector<double> nums;
  size_t last = out.find_last_not_of(" \n");
  if (last == std::string::npos) return -1;
  size_t bol = out.rfind('\n', last);
  std::string line = out.substr(bol == std::string::npos ? 0 : bol + 1);
  char* p = &line[0];
  while (*p) {
    char* end = nullptr;
    double v = std::strtod(p, &end);
    if (end == p) {
      ++p;
      continue;
    }
    nums.push_back(v);
    p = end;
  }
  if (nums.size() < 8) return -1;
  return nums[5];
}

struct Stats {
  double med = -1, lo = -1, hi = -1;
};

Stats Summarise(std::vector<double> v) {
  Stats s;
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return x < 0; }), v.end());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.lo = v.front();
  s.hi = v.back();
  s.med = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  int c;
  while ((c = getopt(argc, argv, "b:e:f:B:W:r:t:P:L:p:h")) != -1) {
    switch (c) {
      case 'b':
        o.minBytes = ParseSize(optarg);
        break;
      case 'e':
        o.maxBytes = ParseSize(optarg);
        break;
      case 'f':
        o.factor = std::atof(optarg);
        break;
      case 'B':
        o.bytesPerPoint = ParseSize(optarg);
        break;
      case 'W':
        o.window = std::max(1, std::atoi(optarg));
        break;
      case 'r':
        o.repeats = std::max(1, std::atoi(optarg));
        break;
      case 't':
        o.tls = optarg;
        break;
      case 'P':
        o.perftest = optarg;
        break;
      case 'L':
        o.lib = optarg;
        break;
      case 'p':
        o.port = std::atoi(optarg);
        break;
      default:
        std::fprintf(stderr,
                     "usage: %s [-b min] [-e max] [-f factor] [-B bytes/point] [-W window] "
                     "[-r repeats] [-t UCX_TLS] [-P ucx_perftest|none] [-L plugin.so] "
                     "[-p port]\n",
                     argv[0]);
        return c == 'h' ? 0 : 1;
    }
  }
  if (o.factor <= 1 || o.minBytes == 0 || o.maxBytes < o.minBytes) {
    std::fprintf(stderr, "bad size range\n");
    return 1;
  }
  if (!o.tls.empty()) setenv("UCX_TLS", o.tls.c_str(), 1);
  if (!std::getenv("UCX_NET_DEVICES")) setenv("UCX_NET_DEVICES", "lo", 1);
  if (!std::getenv("SCAPE_NCCL_DEVICES") && !std::getenv("SCAPE_SOCKET_IFNAME"))
    setenv("SCAPE_NCCL_DEVICES", "=lo", 1);
  setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  bool perf = o.perftest != "none";
  std::printf(
      "# plugin-bw: %s\n# UCX_TLS=%s UCX_NET_DEVICES=%s window=%d repeats=%d "
      "bytes/point=%zu\n",
      o.lib.c_str(), std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "<default>",
      std::getenv("UCX_NET_DEVICES"), o.window, o.repeats, o.bytesPerPoint);
  std::printf(
      "# MiB/s: median [min..max] of %d runs; plugin = sender side (receiver side in "
      "parentheses)\n",
      o.repeats);
  std::printf("%12s %6s  %-30s %-24s %s\n", "bytes", "iters", "plugin isend/irecv MiB/s",
              perf ? "ucx_perftest tag_bw MiB/s" : "", perf ? "plugin/perftest" : "");
  int port = o.port;
  for (size_t size = o.minBytes; size <= o.maxBytes;
       size = static_cast<size_t>(static_cast<double>(size) * o.factor)) {
    int iters = static_cast<int>(std::max<size_t>(5, o.bytesPerPoint / size));
    int warm = std::max(2, iters / 10);
    std::vector<double> pl, pr, pt;
    for (int r = 0; r < o.repeats; ++r) {
      double rv = -1;
      pl.push_back(RunPlugin(o, size, iters, warm, &rv));
      pr.push_back(rv);
      if (perf) pt.push_back(RunPerftest(o, size, iters, warm, port++));
    }
    Stats a = Summarise(pl), b = Summarise(pr), t = Summarise(pt);
    char pcol[64], tcol[64], ratio[32];
    std::snprintf(pcol, sizeof(pcol), "%.0f [%.0f..%.0f] (%.0f)", a.med, a.lo, a.hi, b.med);
    std::snprintf(tcol, sizeof(tcol), "%.0f [%.0f..%.0f]", t.med, t.lo, t.hi);
    std::snprintf(ratio, sizeof(ratio), "%.2f", t.med > 0 && a.med > 0 ? a.med / t.med : 0.0);
    std::printf("%12zu %6d  %-30s %-24s %s\n", size, iters, pcol, perf ? tcol : "",
                perf ? ratio : "");
    std::fflush(stdout);
  }
  return 0;
}
