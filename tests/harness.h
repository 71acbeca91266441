// Multi-rank test harness: forks P ranks that meet through the real bootstrap on loopback and
// talk over the real UCX transport. A watchdog kills every rank and fails the test if they do
// not finish in time, so a hang costs seconds, not the CI limit.
#ifndef SCAPE_TESTS_HARNESS_H_
#define SCAPE_TESTS_HARNESS_H_

#include <functional>
#include <string>
#include <vector>

#include "scape/scape.h"

namespace scape_test {

struct RankOptions {
  int timeoutMs = 10000;   // communicator timeout
  int watchdogMs = 90000;  // whole run
  bool initComm = true;    // false: the body creates its own communicator
  int progressMode = SCAPE_CONFIG_UNDEF_INT;
};

// What a rank body sees.
struct RankCtx {
  int rank;
  int nranks;
  scapeComm_t comm;  // NULL when initComm is false
  scapeUniqueId id;
  const RankOptions* opts;
};

// Per-rank exit codes (0 = body returned true and no gtest failure in that rank).
struct RunResult {
  std::vector<int> exitCodes;  // -SIG for a rank killed by a signal
  bool watchdogFired = false;
  bool AllOk() const;
  std::string Describe() const;
};

// Runs `body` in nranks forked processes. Rank failures (body returning false, a failed gtest
// expectation, a crash) show up in the exit codes.
RunResult RunRanks(int nranks, const std::function<bool(RankCtx&)>& body,
                   const RankOptions& opts = RankOptions());

// A fresh seed per run (printed), so every run checks new random inputs.
unsigned FreshSeed();

}  // namespace scape_test

#define EXPECT_SCAPE_OK(expr, comm)                                                 \
  do {                                                                              \
    scapeResult_t _r = (expr);                                                      \
    EXPECT_EQ(_r, scapeSuccess) << #expr << ": " << scapeGetErrorString(_r) << ": " \
                                << scapeGetLastError(comm);                         \
  } while (0)

#endif  // SCAPE_TESTS_HARNESS_H_
