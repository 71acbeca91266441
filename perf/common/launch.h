// perf/common: launching local ranks for scape-perf -np N and gloo-allreduce-perf -np N.
//
// The parent forks N ranks and watches them: it forwards the first failing rank's exit status,
// kills the ranks still running a grace period after that first failure, kills them all when
// its watchdog fires (the run's -W limit, or no heartbeat for a stall limit), and on SIGINT,
// SIGTERM or SIGHUP. Each rank gets a heartbeat counter in shared memory (perf::beat()) and,
// when asked, a zeroed shared region the ranks use among themselves (scape-perf: the unique id
// rank 0 creates after the fork).
#ifndef SCAPE_PERF_COMMON_LAUNCH_H_
#define SCAPE_PERF_COMMON_LAUNCH_H_

#include <cstddef>
#include <functional>

namespace perf {

struct LaunchOptions {
  const char* prog = "perf";  // names the messages
  int nranks = 1;
  int watchdogS = 1800;     // kill every rank after this many seconds in total
  double stallLimitS = 0;   // > 0: kill every rank when no heartbeat moved for this long
  double failGraceS = 5.0;  // after the first failure, the others may finish for this long
  size_t sharedBytes = 0;   // a zeroed MAP_SHARED region for the ranks (0: none)
};

// In a rank: runs `rank(index, shared)` and _exits with what it returns (after flushing stdio;
// _exit because a forked rank must not run destructors that belong to the parent's threads).
// In the parent: returns the run's exit status: 0; the first failing rank's status (128 + signal
// when killed by one); 124 when the watchdog fired; 128 + signal when interrupted; 1 when a fork
// failed.
int forkRanks(const LaunchOptions& opts, const std::function<int(int rank, void* shared)>& rank);

// One more operation done by this rank (no-op outside a rank forked by forkRanks).
void beat();

// Seconds on the steady clock.
double nowSec();

// fflush(stdout, stderr), then _exit(code).
[[noreturn]] void finish(int code);

}  // namespace perf

#endif  // SCAPE_PERF_COMMON_LAUNCH_H_
