// perf/common: launching and watching local ranks (see launch.h).
#include "perf/common/launch.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "perf/common/perf_common.h"

namespace perf {
namespace {

std::atomic<uint64_t>* g_heartbeat = nullptr;  // this rank's counter; null outside a rank
volatile sig_atomic_t g_signal = 0;
extern "C" void onSignal(int sig) { g_signal = sig; }

std::string describeStatus(int st) {
  char buf[96];
  if (WIFEXITED(st))
    std::snprintf(buf, sizeof(buf), "exited with status %d", WEXITSTATUS(st));
  else if (WIFSIGNALED(st))
    std::snprintf(buf, sizeof(buf), "was killed by signal %d (%s)", WTERMSIG(st),
                  strsignal(WTERMSIG(st)));
  else
    std::snprintf(buf, sizeof(buf), "ended with wait status %d", st);
  return buf;
}

int exitCodeOf(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return PERF_EXIT_CALL_FAILED;
}

// The parent's view of the ranks while they run.
class Watcher {
 public:
  Watcher(const LaunchOptions& o, std::atomic<uint64_t>* beats)
      : o_(o), beats_(beats), pids_(o.nranks, -1), done_(o.nranks, false) {}

  std::vector<pid_t>& pids() { return pids_; }
  int wait();  // until every rank has ended; returns the exit status

 private:
  void reap();
  void police(double now);
  void killAll(int sig) {
    for (int k = 0; k < o_.nranks; ++k)
      if (!done_[k]) kill(pids_[k], sig);
    killed_ = true;
  }
  std::string listAlive() const;

  const LaunchOptions& o_;
  std::atomic<uint64_t>* beats_;
  std::vector<pid_t> pids_;
  std::vector<bool> done_;
  int alive_ = 0;
  int firstFailed_ = -1;
  double failedAt_ = 0, start_ = 0, lastProgress_ = 0;
  uint64_t lastTotal_ = 0;
  bool killed_ = false;
  int exitCode_ = PERF_EXIT_OK;
};

std::string Watcher::listAlive() const {
  std::string s;
  for (int k = 0; k < o_.nranks; ++k)
    if (!done_[k]) {
      if (!s.empty()) s += ", ";
      s += std::to_string(k) + " (pid " + std::to_string(pids_[k]);
      if (o_.stallLimitS > 0) s += ", " + std::to_string(beats_[k].load()) + " ops done";
      s += ")";
    }
  return s;
}

void Watcher::reap() {
  int st = 0;
  pid_t pid;
  while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
    for (int k = 0; k < o_.nranks; ++k) {
      if (pids_[k] != pid || done_[k]) continue;
      done_[k] = true;
      --alive_;
      const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      if (!ok && !killed_ && firstFailed_ < 0) {
        firstFailed_ = k;
        failedAt_ = nowSec();
        exitCode_ = exitCodeOf(st);
        if (WIFSIGNALED(st) || WEXITSTATUS(st) != PERF_EXIT_WRONG)
          std::fprintf(stderr, "%s: rank %d %s (the first rank to end with an error)\n", o_.prog, k,
                       describeStatus(st).c_str());
      }
    }
  }
}

void Watcher::police(double now) {
  if (g_signal != 0 && !killed_) {
    std::fprintf(stderr, "%s: caught signal %d; killing ranks %s\n", o_.prog,
                 static_cast<int>(g_signal), listAlive().c_str());
    killAll(SIGKILL);
    exitCode_ = 128 + g_signal;
  }
  if (!killed_ && firstFailed_ >= 0 && now - failedAt_ > o_.failGraceS) {
    std::fprintf(stderr, "%s: rank %d failed %.0f s ago; killing ranks still running: %s\n",
                 o_.prog, firstFailed_, o_.failGraceS, listAlive().c_str());
    killAll(SIGKILL);
  }
  uint64_t total = 0;
  for (int k = 0; k < o_.nranks; ++k) total += beats_[k].load(std::memory_order_relaxed);
  if (total != lastTotal_) {
    lastTotal_ = total;
    lastProgress_ = now;
  }
  if (!killed_ && now - start_ > o_.watchdogS) {
    std::fprintf(stderr,
                 "%s: watchdog: the run exceeded -W %d s; killing ranks %s (raise -W for "
                 "longer sweeps)\n",
                 o_.prog, o_.watchdogS, listAlive().c_str());
    killAll(SIGKILL);
    exitCode_ = PERF_EXIT_WATCHDOG;
  }
  if (!killed_ && o_.stallLimitS > 0 && now - lastProgress_ > o_.stallLimitS) {
    std::fprintf(stderr,
                 "%s: watchdog: no rank completed an operation for %.0f s (2 x timeout + 30 s); "
                 "killing ranks %s\n",
                 o_.prog, o_.stallLimitS, listAlive().c_str());
    killAll(SIGKILL);
    exitCode_ = PERF_EXIT_WATCHDOG;
  }
}

int Watcher::wait() {
  alive_ = o_.nranks;
  start_ = lastProgress_ = nowSec();
  while (alive_ > 0) {
    reap();
    if (alive_ == 0) break;
    police(nowSec());
    usleep(20000);
  }
  return exitCode_;
}

// The child side of a fork: never returns.
[[noreturn]] void runChild(pid_t parent, std::atomic<uint64_t>* beat, int rank, void* shared,
                           const std::function<int(int, void*)>& body) {
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGHUP, SIG_DFL);
#if defined(__linux__)
  prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
  if (getppid() != parent) _exit(PERF_EXIT_CALL_FAILED);
  g_heartbeat = beat;
  finish(body(rank, shared));
}

}  // namespace

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void beat() {
  if (g_heartbeat) g_heartbeat->fetch_add(1, std::memory_order_relaxed);
}

void finish(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

int forkRanks(const LaunchOptions& o, const std::function<int(int, void*)>& body) {
  const int n = o.nranks;
  // One page-aligned block: the heartbeats, then the caller's region.
  const size_t beatBytes = (sizeof(std::atomic<uint64_t>) * n + 63) / 64 * 64;
  const size_t shmBytes = beatBytes + o.sharedBytes;
  void* shm = mmap(nullptr, shmBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    std::fprintf(stderr, "%s: mmap of the shared page failed: %s\n", o.prog, std::strerror(errno));
    return PERF_EXIT_CALL_FAILED;
  }
  auto* beats = static_cast<std::atomic<uint64_t>*>(shm);
  for (int i = 0; i < n; ++i) new (&beats[i]) std::atomic<uint64_t>(0);
  void* shared = o.sharedBytes ? static_cast<char*>(shm) + beatBytes : nullptr;

  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  const pid_t parent = getpid();
  Watcher watcher(o, beats);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int rank = 0; rank < n; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "%s: fork of rank %d failed: %s; killing the %d ranks started\n", o.prog,
                   rank, std::strerror(errno), rank);
      for (int k = 0; k < rank; ++k) kill(watcher.pids()[k], SIGKILL);
      for (int k = 0; k < rank; ++k) waitpid(watcher.pids()[k], nullptr, 0);
      munmap(shm, shmBytes);
      return PERF_EXIT_CALL_FAILED;
    }
    if (pid == 0) runChild(parent, &beats[rank], rank, shared, body);
    watcher.pids()[rank] = pid;
  }
  const int code = watcher.wait();
  munmap(shm, shmBytes);
  return code;
}

}  // namespace perf
