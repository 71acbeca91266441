#include "tests/harness.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <new>
#include <random>
#include <sstream>
#include <thread>

namespace scape_test {

bool RunResult::AllOk() const {
  if (watchdogFired) return false;
  for (int c : exitCodes)
    if (c != 0) return false;
  return true;
}

std::string RunResult::Describe() const {
  std::ostringstream os;
  if (watchdogFired) os << "watchdog fired (ranks killed); ";
  os << "exit codes:";
  for (size_t r = 0; r < exitCodes.size(); ++r) os << " rank" << r << "=" << exitCodes[r];
  return os.str();
}

unsigned FreshSeed() {
  static unsigned seed = [] {
    unsigned s = std::random_device{}();
    std::printf("[ seed ] %u\n", s);
    return s;
  }();
  return seed;
}

RunResult RunRanks(int nranks, const std::function<bool(RankCtx&)>& body, const RankOptions& opts) {
  RunResult res;
  res.exitCodes.assign(static_cast<size_t>(nranks), -1);
  // Rank 0 makes the unique id (its bootstrap root thread lives in rank 0, as in a real job)
  // and publishes it through shared memory. The parent never starts a thread, so forking it
  // is safe.
  struct Shared {
    std::atomic<int> state;  // 0 pending, 1 ready, 2 failed
    scapeUniqueId id;
  };
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    ADD_FAILURE() << "mmap failed";
    return res;
  }
  Shared* shared = new (mem) Shared();
  shared->state.store(0);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(nranks), -1);
  for (int rank = 0; rank < nranks; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      scapeUniqueId id;
      if (rank == 0) {
        if (scapeGetUniqueId(&shared->id) != scapeSuccess) {
          std::fprintf(stderr, "scapeGetUniqueId: %s\n", scapeGetLastError(nullptr));
          shared->state.store(2);
          _exit(3);
        }
        shared->state.store(1);
      }
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (shared->state.load() == 0 && std::chrono::steady_clock::now() < until) usleep(1000);
      if (shared->state.load() != 1) _exit(3);
      id = shared->id;
      RankCtx ctx{rank, nranks, nullptr, id, &opts};
      bool ok = true;
      if (opts.initComm) {
        scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
        cfg.timeoutMs = opts.timeoutMs;
        cfg.progressMode = opts.progressMode;
        scapeResult_t ir = scapeCommInitRankConfig(&ctx.comm, nranks, id, rank, &cfg);
        if (ir != scapeSuccess) {
          std::fprintf(stderr, "rank %d: init failed: %s: %s\n", rank, scapeGetErrorString(ir),
                       scapeGetLastError(nullptr));
          ok = false;
        }
      }
      if (ok) ok = body(ctx);
      if (ctx.comm) {
        scapeResult_t dr = scapeCommDestroy(ctx.comm);
        if (dr != scapeSuccess) {
          std::fprintf(stderr, "rank %d: destroy: %s\n", rank, scapeGetLastError(ctx.comm));
          ok = false;
        }
      }
      if (::testing::Test::HasFailure()) ok = false;
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(ok ? 0 : 1);
    }
    pids[static_cast<size_t>(rank)] = pid;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(opts.watchdogMs);
  int left = nranks;
  while (left > 0) {
    int status = 0;
    pid_t p = waitpid(-1, &status, WNOHANG);
    if (p > 0) {
      for (int rank = 0; rank < nranks; ++rank)
        if (pids[static_cast<size_t>(rank)] == p) {
          res.exitCodes[static_cast<size_t>(rank)] =
              WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
          pids[static_cast<size_t>(rank)] = -1;
          --left;
        }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      res.watchdogFired = true;
      for (pid_t q : pids)
        if (q > 0) kill(q, SIGKILL);
      for (int rank = 0; rank < nranks; ++rank)
        if (pids[static_cast<size_t>(rank)] > 0) {
          waitpid(pids[static_cast<size_t>(rank)], nullptr, 0);
          res.exitCodes[static_cast<size_t>(rank)] = -SIGKILL;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  munmap(mem, sizeof(Shared));
  return res;
}

}  // namespace scape_test
