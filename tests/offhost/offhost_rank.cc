// One rank of an off-host test (tests/offhost/run_netns.sh runs each in its own network and
// UTS namespace, so the library sees other hosts and takes its TCP paths). Rank 0 makes the
// unique id and writes it to <dir>/id; the others wait for the file.
//   offhost_rank <case> <rank> <nranks> <dir> <timeoutMs>
// Cases: allreduce (correctness), die-allreduce (the last rank is killed mid-collective; the
// others must fail within the timeout), die-masksync (the same during a mask sync), late (the
// last rank never comes: the others must get scapeTimeout). For perf/stress/stress.sh also:
// cycles (SCAPE_STRESS_N init/destroy cycles, default 1000) and soak (SCAPE_STRESS_N steps of
// mask sync + masked all-reduce + dense all-reduce, default 5000, printing RSS); die-dense (the
// last rank dies before a dense 4 MiB all-reduce, every rank having run it twice), die-masked
// (the last rank dies before a packed masked all-reduce of a 1 Mi-position mask at density
// 0.01) and die-step (before an optimizer step of 1 Mi parameters), for
// perf/stress/peer_death.sh, which times how soon each path reports the death.
// Exit 0 on the expected outcome, 1 otherwise (with a line on stderr).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "scape/scape.h"

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

long RssKiB() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, rss = 0;
  f >> pages >> rss;
  return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

int StressN(int dflt) {
  const char* v = std::getenv("SCAPE_STRESS_N");
  return v && *v ? std::atoi(v) : dflt;
}

int Fail(int rank, const std::string& what) {
  std::fprintf(stderr, "offhost rank %d: FAIL: %s\n", rank, what.c_str());
  return 1;
}

// A survivor's verdict after a peer's death: the call `r` failed as a dead peer should, `ms`
// after it started, within the timeout (+3 s); prints the latency perf/stress reads.
int SurvivedDeath(int rank, scapeComm_t comm, scapeResult_t r, int64_t ms, int timeoutMs) {
  if (r != scapeRemoteError && r != scapeTimeout)
    return Fail(rank, std::string("expected an error, got ") + scapeGetErrorString(r));
  if (ms > timeoutMs + 3000) return Fail(rank, "error came after " + std::to_string(ms) + " ms");
  std::fprintf(stderr, "offhost rank %d: peer death seen after %lld ms: %s\n", rank,
               static_cast<long long>(ms), scapeGetLastError(comm));
  scapeCommAbort(comm);
  return 0;
}

bool ReadId(const std::string& path, scapeUniqueId* id, int timeoutMs) {
  const int64_t end = NowMs() + timeoutMs;
  while (NowMs() < end) {
    std::ifstream f(path, std::ios::binary);
    if (f.read(id->internal, sizeof(id->internal))) return true;
    usleep(20000);
  }
  return false;
}

}  // namespace

int Main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s <case> <rank> <nranks> <dir> <timeoutMs>\n", argv[0]);
    return 2;
  }
  const std::string kase = argv[1];
  const int rank = std::atoi(argv[2]), nranks = std::atoi(argv[3]);
  const std::string dir = argv[4];
  const int timeoutMs = std::atoi(argv[5]);
  const bool last = rank == nranks - 1;
  scapeUniqueId id;
  if (rank == 0) {
    if (scapeGetUniqueId(&id) != scapeSuccess) return Fail(rank, scapeGetLastError(nullptr));
    const std::string tmp = dir + "/id.tmp";
    std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof(id.internal));
    if (std::rename(tmp.c_str(), (dir + "/id").c_str()) != 0) return Fail(rank, "rename");
  } else if (!ReadId(dir + "/id", &id, 20000)) {
    return Fail(rank, "no unique id from rank 0");
  }
  if (kase == "late" && last) return 0;  // never joins
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = timeoutMs;
  scapeComm_t comm = nullptr;
  const int64_t t0 = NowMs();
  scapeResult_t r = scapeCommInitRankConfig(&comm, nranks, id, rank, &cfg);
  if (kase == "late") {
    if (r != scapeTimeout)
      return Fail(rank, std::string("init: expected a timeout, got ") + scapeGetErrorString(r));
    if (NowMs() - t0 > timeoutMs + 6000) return Fail(rank, "the timeout came late");
    std::fprintf(stderr, "offhost rank %d: late peer: %s after %lld ms\n", rank,
                 scapeGetLastError(nullptr), static_cast<long long>(NowMs() - t0));
    if (rank == 0) usleep(1000000);
    return 0;
  }
  if (r != scapeSuccess) return Fail(rank, std::string("init: ") + scapeGetLastError(nullptr));
  if (kase == "cycles") {
    const int n = StressN(1000);
    const int64_t s = NowMs();
    for (int i = 0; i < n; ++i) {
      scapeUniqueId cid;
      if (rank == 0 && scapeGetUniqueId(&cid) != scapeSuccess) return Fail(rank, "id");
      if (scapeBroadcast(&cid, &cid, sizeof(cid) / 4, scapeInt32, 0, comm, nullptr) != scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
      scapeComm_t c2 = nullptr;
      if (scapeCommInitRankConfig(&c2, nranks, cid, rank, &cfg) != scapeSuccess)
        return Fail(rank, std::string("cycle init: ") + scapeGetLastError(nullptr));
      if (scapeBarrier(c2) != scapeSuccess) return Fail(rank, scapeGetLastError(c2));
      if (scapeCommDestroy(c2) != scapeSuccess) return Fail(rank, "cycle destroy");
      if (rank == 0 && (i == 0 || i + 1 == n || (i + 1) % 250 == 0))
        std::printf("cycles: %d done, RSS %ld KiB, %.1f ms per cycle\n", i + 1, RssKiB(),
                    static_cast<double>(NowMs() - s) / (i + 1));
    }
    scapeCommDestroy(comm);
    return 0;
  }
  if (kase == "soak") {
    const int steps = StressN(5000);
    const uint64_t n = 200000, offs[] = {0, 1000, 150000, n};
    const uint8_t dense[] = {1, 0, 0};
    scapeMask_t mask = nullptr;
    if (scapeMaskCreate(&mask, n, 3, offs, dense, scapeOwnershipShards, scapeMaskEncodingAuto,
                        comm) != scapeSuccess)
      return Fail(rank, scapeGetLastError(comm));
    std::vector<float> stat(n), g(n, 1.0f), d(4096, 1.0f), e(4096);
    long rss0 = 0;
    const int64_t s = NowMs();
    for (int t = 0; t < steps; ++t) {
      for (uint64_t i = 0; i < n; ++i) stat[i] = static_cast<float>((i * 2654435761u + t) % 997);
      if (scapeMaskSelectNextTopk(mask, stat.data(), 0.01) != scapeSuccess ||
          scapeMaskSyncStart(mask) != scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
      if (scapeAllReduce(g.data(), g.data(), n, scapeFloat32, scapeAvg, mask, comm, nullptr) !=
              scapeSuccess ||
          scapeAllReduce(d.data(), e.data(), d.size(), scapeFloat32, scapeSum, nullptr, comm,
                         nullptr) != scapeSuccess ||
          scapeMaskSyncWait(mask) != scapeSuccess || scapeMaskAdvance(mask) != scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
      if (t == 99) rss0 = RssKiB();
      if (rank == 0 && ((t + 1) % 1000 == 0 || t + 1 == steps))
        std::printf("soak: step %d, RSS %ld KiB (at step 100: %ld KiB), %.2f ms per step\n", t + 1,
                    RssKiB(), rss0, static_cast<double>(NowMs() - s) / (t + 1));
    }
    scapeMaskDestroy(mask);
    scapeCommDestroy(comm);
    return 0;
  }
  if (kase == "allreduce") {
    for (size_t n : {size_t{1}, size_t{1000}, size_t{1} << 20}) {
      std::vector<float> a(n), b(n);
      for (size_t i = 0; i < n; ++i)
        a[i] = static_cast<float>((i * 7 + static_cast<size_t>(rank)) % 13);
      if (scapeAllReduce(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, comm, nullptr) !=
          scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
      for (size_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q = 0; q < nranks; ++q)
          want += static_cast<float>((i * 7 + static_cast<size_t>(q)) % 13);
        if (b[i] != want) return Fail(rank, "wrong sum at " + std::to_string(i));
      }
    }
    if (scapeCommDestroy(comm) != scapeSuccess) return Fail(rank, "destroy");
    return 0;
  }
  if (kase == "die-allreduce") {
    const size_t n = size_t{16} << 20;
    std::vector<float> a(n, 1.0f), b(n);
    if (last) {
      scapeRequest_t req;
      if (scapeAllReduceAsync(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, comm, nullptr,
                              &req) != scapeSuccess)
        return Fail(rank, "async");
      int done = 0;
      for (int i = 0; i < 3 && !done; ++i) scapeTest(req, &done);
      kill(getpid(), SIGKILL);
    }
    const int64_t s = NowMs();
    r = scapeAllReduce(a.data(), b.data(), n, scapeFloat32, scapeSum, nullptr, comm, nullptr);
    return SurvivedDeath(rank, comm, r, NowMs() - s, timeoutMs);
  }
  if (kase == "die-masksync") {
    const uint64_t n = 100000, offs[] = {0, 40000, n};
    scapeMask_t mask = nullptr;
    if (scapeMaskCreate(&mask, n, 2, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto,
                        comm) != scapeSuccess)
      return Fail(rank, scapeGetLastError(comm));
    std::vector<float> stat(n);
    for (uint64_t i = 0; i < n; ++i) stat[i] = static_cast<float>((i * 2654435761u) % 1000);
    if (scapeMaskSelectNextTopk(mask, stat.data(), 0.01) != scapeSuccess) return Fail(rank, "topk");
    if (last) kill(getpid(), SIGKILL);
    const int64_t s = NowMs();
    if (scapeMaskSyncStart(mask) != scapeSuccess) return Fail(rank, "sync start");
    r = scapeMaskSyncWait(mask);
    const int64_t ms = NowMs() - s;
    if (r != scapeRemoteError && r != scapeTimeout)
      return Fail(rank, std::string("expected an error, got ") + scapeGetErrorString(r));
    if (ms > timeoutMs + 3000) return Fail(rank, "error came after " + std::to_string(ms) + " ms");
    std::fprintf(stderr, "offhost rank %d: peer death in mask sync seen after %lld ms\n", rank,
                 static_cast<long long>(ms));
    scapeMaskDestroy(mask);
    scapeCommAbort(comm);
    return 0;
  }
  if (kase == "die-dense" || kase == "die-masked" || kase == "die-step") {
    // One path of a SCAPE step, run once by every rank (connections made, a mask agreed),
    // then the last rank dies and the survivors run it again: the time to their error.
    const uint64_t n = uint64_t{1} << 20, offs[] = {0, n};
    const bool step = kase == "die-step", dense = kase == "die-dense";
    scapeMask_t mask = nullptr;
    scapeOptim_t opt = nullptr;
    std::vector<float> theta(n, 0.5f), g(n), vals(n), out(n);
    for (uint64_t i = 0; i < n; ++i) g[i] = static_cast<float>((i * 2654435761u + rank) % 1000);
    auto once = [&]() -> scapeResult_t {
      if (step) return scapeOptimStep(opt, theta.data(), g.data(), n);
      if (dense)
        return scapeAllReduce(g.data(), out.data(), n, scapeFloat32, scapeAvg, nullptr, comm,
                              nullptr);
      return scapeMaskAllReducePacked(vals.data(), out.data(), scapeFloat32, scapeAvg, mask, comm,
                                      nullptr);
    };
    if (step) {
      scapeOptimConfig_t oc;
      scapeOptimConfigInit(&oc);
      oc.n = n;
      oc.nsegments = 1;
      oc.segOffsets = offs;
      oc.density = 0.01;
      if (scapeOptimCreate(&opt, &oc, comm) != scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
    } else if (!dense) {
      if (scapeMaskCreate(&mask, n, 1, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto,
                          comm) != scapeSuccess ||
          scapeMaskSelectNextTopk(mask, g.data(), 0.01) != scapeSuccess ||
          scapeMaskSyncStart(mask) != scapeSuccess || scapeMaskSyncWait(mask) != scapeSuccess ||
          scapeMaskAdvance(mask) != scapeSuccess)
        return Fail(rank, scapeGetLastError(comm));
    }
    for (int i = 0; i < 2; ++i)
      if (once() != scapeSuccess) return Fail(rank, scapeGetLastError(comm));
    // Every rank here, so that the survivors' call below starts together with the death.
    if (scapeBarrier(comm) != scapeSuccess) return Fail(rank, scapeGetLastError(comm));
    if (last) kill(getpid(), SIGKILL);
    const int64_t s = NowMs();
    r = once();
    return SurvivedDeath(rank, comm, r, NowMs() - s, timeoutMs);
  }
  return Fail(rank, "unknown case " + kase);
}

// Ends with _exit, as the test harness's ranks do: a survivor of a peer's death may keep UCX's
// worker on purpose (transport.h, LeakOnDestroy), which is not a leak to report at exit.
int main(int argc, char** argv) {
  const int rc = Main(argc, argv);
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(rc);
}
