// scape-perf: an nccl-tests-style benchmark of SCAPE comm's collectives, dense and sparse.
//
// It uses only the public C API (include/scape/scape.h) and links the shipped shared library.
// Output follows nccl-tests (all_reduce_perf and friends): a header, then one line per size
// with out-of-place and in-place time, algorithm bandwidth, bus bandwidth and the number of
// wrong elements, then "# Out of bounds values" and "# Avg bus bandwidth".
//
// Modes (--mode), one file each (perf/scape_perf/mode_<name>.cc; mode.h says how to add one):
//   dense        the dense collective (-t allreduce, reducescatter, allgather, broadcast).
//   mask         scapeAllReduce on an agreed mask, dense in / dense out (or, with -t,
//                scapeMaskReduceScatter / scapeMaskAllGather on the packed values).
//   mask-packed  scapeMaskAllReducePacked: the same exchange on the k packed values.
//   coo          scapeSparseAllReduce of random sorted index lists at the density.
//   masksync     the mask synchronisation alone (also --mask-sync): per density and encoding,
//                encoded bytes, sync time, and the fraction hidden behind a compute phase.
//   memcpy       memcpy bandwidth of one rank (the memory-copy limit for the comparison).
//
// Columns of the collective modes (one line per size and density; also documented in -h):
//    1 size(B)  2 count(elements)  3 type  4 redop  5 root
//    6-9   out-of-place: time(us) algbw(GB/s) busbw(GB/s) #wrong
//    10-13 in-place:     time(us) algbw(GB/s) busbw(GB/s) #wrong   ("N/A" where not run)
//    14 mode  15 density  16 k (elements each rank contributes: dense count, mask k, coo mean
//    nnz)  17 wire(B) (bytes each rank sends: dense busFactor*size; mask busFactor*k*typesize;
//    coo the bytesSent scapeSparseAllReduce returns, mean over ranks)  18 deqbw-oop(GB/s)
//    19 deqbw-ip(GB/s): dense-equivalent bandwidth, size / time.
// In sparse modes algbw = k * typesize / time (coo: k * (8 + typesize) / time) and busbw =
// wire / time, so busbw is the hardware efficiency and deqbw the sparsity gain. Columns 1-13
// are exactly nccl-tests' (dense rows are unchanged from nccl-tests' meaning). The columns, the
// option parsing and the JSON rows are perf/common's, shared with the Gloo and MPI peers.
//
// Launch modes:
//   scape-perf -np N ...   forks N local ranks (perf/common/launch.h); rank 0 creates the
//                          unique id (after the fork, so the parent never forks with a second
//                          thread running); the parent waits, forwards the first failing rank's
//                          exit code and kills the rest on failure or when its watchdog fires.
//   <launcher> scape-perf  one rank per process from the launcher's environment (torchrun,
//                          mpirun, srun): scapeCommInitFromEnv.
//   scape-perf             a single rank.
//
// Exit status: 0 success; 1 a call failed; 2 wrong results; 64 bad command line;
// 124 the watchdog killed the run.
//
// Test hook: with SCAPE_PERF_INJECT_ERROR=1 in the environment, rank 0 corrupts one element of
// every result it checks (before checking), so that the tests can prove #wrong counts real
// mismatches.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "perf/common/launch.h"
#include "perf/scape_perf/bench.h"

namespace scape_perf {
namespace {

using perf::finish;

scapeConfig_t makeConfig(const Options& o) {
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = o.timeoutMs;
  return cfg;
}

int effectiveTimeoutMs(const Options& o) {
  if (o.timeoutMs != SCAPE_CONFIG_UNDEF_INT) return o.timeoutMs;
  if (const char* e = std::getenv("SCAPE_TIMEOUT_MS")) {
    long v = std::strtol(e, nullptr, 10);
    if (v > 0 && v < (1L << 30)) return static_cast<int>(v);
  }
  return kDefaultTimeoutMs;
}

// Runs one rank on an initialised communicator; destroys it (or aborts it on failure).
int runRank(const Options& o, scapeComm_t comm, FILE* json) {
  int rank = 0, nranks = 0;
  scapeResult_t r = scapeCommUserRank(comm, &rank);
  if (r == scapeSuccess) r = scapeCommCount(comm, &nranks);
  if (r != scapeSuccess) {
    std::fprintf(stderr, "%s: scapeCommUserRank/scapeCommCount failed: %s: %s\n", kProg,
                 scapeGetErrorString(r), scapeGetLastError(comm));
    scapeCommAbort(comm);
    return PERF_EXIT_CALL_FAILED;
  }
  int code;
  {
    Bench bench(o, comm, rank, nranks, rank == 0 ? json : nullptr);
    code = bench.run();
  }
  if (json != nullptr && rank == 0) {
    if (std::fclose(json) != 0) {
      std::fprintf(stderr, "%s: writing %s failed: %s\n", kProg, o.jsonPath.c_str(),
                   std::strerror(errno));
      if (code == PERF_EXIT_OK) code = PERF_EXIT_CALL_FAILED;
    }
  }
  if (code == PERF_EXIT_CALL_FAILED || code == PERF_EXIT_USAGE) {
    scapeCommAbort(comm);  // tell the peers at once instead of letting them time out
    return code;
  }
  r = scapeCommDestroy(comm);
  if (r != scapeSuccess) {
    std::fprintf(stderr, "%s: rank %d: scapeCommDestroy failed: %s: %s\n", kProg, rank,
                 scapeGetErrorString(r), scapeGetLastError(comm));
    if (code == PERF_EXIT_OK) code = PERF_EXIT_CALL_FAILED;
  }
  return code;
}

bool launcherEnvPresent() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  return (has("RANK") && has("WORLD_SIZE")) ||
         (has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE")) || has("PMI_RANK") ||
         has("SLURM_PROCID");
}

extern "C" void onAlarm(int) {
  static const char msg[] = "scape-perf: watchdog: the run exceeded its -W limit; exiting\n";
  ssize_t ignored = write(2, msg, sizeof(msg) - 1);
  (void)ignored;
  _exit(PERF_EXIT_WATCHDOG);
}

// The unique id rank 0 publishes to the other forked ranks (shared memory). Rank 0 makes the id
// after the fork: scapeGetUniqueId starts the rendezvous thread, and a process must not fork
// while another of its threads may hold a lock (an allocator's, say) that the child then finds
// held forever (seen as a hang under AddressSanitizer).
struct IdSlot {
  std::atomic<int> state;  // 0 not yet, 1 ready, 2 rank 0 failed to make it
  scapeUniqueId id;
};

// One forked rank: the unique id (made by rank 0, awaited by the others), init, the benchmark.
int forkedRank(const Options& o, int n, int rank, IdSlot* slot, FILE* json) {
  if (rank != 0) json = nullptr;
  if (rank == 0) {
    const scapeResult_t r = scapeGetUniqueId(&slot->id);
    slot->state.store(r == scapeSuccess ? 1 : 2, std::memory_order_release);
    if (r != scapeSuccess) {
      std::fprintf(stderr, "%s: scapeGetUniqueId failed: %s: %s\n", kProg, scapeGetErrorString(r),
                   scapeGetLastError(nullptr));
      return PERF_EXIT_CALL_FAILED;
    }
  } else {
    const double deadline = perf::nowSec() + effectiveTimeoutMs(o) / 1000.0;
    while (slot->state.load(std::memory_order_acquire) == 0) {
      if (perf::nowSec() > deadline) {
        std::fprintf(stderr, "%s: rank %d: rank 0 did not publish the unique id in time\n", kProg,
                     rank);
        return PERF_EXIT_CALL_FAILED;
      }
      usleep(1000);
    }
    if (slot->state.load(std::memory_order_acquire) != 1) return PERF_EXIT_CALL_FAILED;
  }
  scapeUniqueId id;
  std::memcpy(&id, &slot->id, sizeof(id));
  scapeConfig_t cfg = makeConfig(o);
  scapeComm_t comm = nullptr;
  const scapeResult_t ir = scapeCommInitRankConfig(&comm, n, id, rank, &cfg);
  if (ir != scapeSuccess) {
    std::fprintf(stderr, "%s: rank %d: scapeCommInitRankConfig(nranks=%d) failed: %s: %s\n", kProg,
                 rank, n, scapeGetErrorString(ir), scapeGetLastError(nullptr));
    return PERF_EXIT_CALL_FAILED;
  }
  beat();
  return runRank(o, comm, json);
}

// -np N: the parent forks the ranks and watches them.
int runForked(const Options& o, FILE* json) {
  const int n = o.localRanks;
  if (o.coll == Coll::kBroadcast && o.root >= n)
    usageError("-r %d is not a rank of -np %d", o.root, n);
  // Local ranks talk over loopback unless the user chose an interface.
  setenv("SCAPE_SOCKET_IFNAME", "lo", 0);
  perf::LaunchOptions lo;
  lo.prog = kProg;
  lo.nranks = n;
  lo.watchdogS = o.watchdogS;
  lo.stallLimitS = 2.0 * effectiveTimeoutMs(o) / 1000.0 + 30.0;
  lo.failGraceS = 5.0;
  lo.sharedBytes = sizeof(IdSlot);
  const int code = perf::forkRanks(lo, [&](int rank, void* shared) {
    auto* slot = static_cast<IdSlot*>(shared);
    if (rank == 0) new (slot) IdSlot();  // zeroed memory: state 0 in every rank already
    return forkedRank(o, n, rank, slot, json);
  });
  if (json != nullptr) std::fclose(json);  // the parent's copy; rank 0 wrote its own
  return code;
}

int runInProcess(const Options& o, FILE* json) {
  // In-process watchdog for launcher-started and single ranks.
  signal(SIGALRM, onAlarm);
  alarm(static_cast<unsigned>(o.watchdogS));
  scapeConfig_t cfg = makeConfig(o);
  scapeComm_t comm = nullptr;
  if (launcherEnvPresent()) {
    scapeResult_t r = scapeCommInitFromEnv(&comm, &cfg);
    if (r != scapeSuccess) {
      std::fprintf(stderr, "%s: scapeCommInitFromEnv failed: %s: %s\n", kProg,
                   scapeGetErrorString(r), scapeGetLastError(nullptr));
      return PERF_EXIT_CALL_FAILED;
    }
  } else {
    if (o.coll == Coll::kBroadcast && o.root != 0)
      usageError("-r %d is not a rank of a single-rank run (use -np N)", o.root);
    scapeUniqueId id;
    scapeResult_t r = scapeGetUniqueId(&id);
    if (r == scapeSuccess) r = scapeCommInitRankConfig(&comm, 1, id, 0, &cfg);
    if (r != scapeSuccess) {
      std::fprintf(stderr, "%s: single-rank init failed: %s: %s\n", kProg, scapeGetErrorString(r),
                   scapeGetLastError(nullptr));
      return PERF_EXIT_CALL_FAILED;
    }
  }
  return runRank(o, comm, json);
}

}  // namespace
}  // namespace scape_perf

int main(int argc, char** argv) {
  using namespace scape_perf;
  const Options o = parseArgs(argc, argv);
  FILE* json = nullptr;
  if (!o.jsonPath.empty()) {
    json = std::fopen(o.jsonPath.c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "%s: -J: cannot open '%s' for writing: %s\n", kProg, o.jsonPath.c_str(),
                   std::strerror(errno));
      return PERF_EXIT_USAGE;
    }
  }
  if (o.localRanks > 0) {
    if (launcherEnvPresent())
      std::fprintf(stderr,
                   "%s: note: -np %d given, so the launcher's environment is ignored and "
                   "each process forks its own %d ranks\n",
                   kProg, o.localRanks, o.localRanks);
    finish(runForked(o, json));
  }
  finish(runInProcess(o, json));
}
