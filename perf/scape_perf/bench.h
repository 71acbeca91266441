// scape-perf: one rank's benchmark. The Bench owns what every mode shares (the communicator,
// the options, the seeded pattern, the dense buffers, the timing loop, the reductions of the
// per-rank figures, the rows, the header, footer and JSON); the modes (mode_*.cc, see mode.h)
// measure through it.
#ifndef SCAPE_PERF_SCAPE_PERF_BENCH_H_
#define SCAPE_PERF_SCAPE_PERF_BENCH_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "perf/common/launch.h"
#include "perf/scape_perf/codec.h"
#include "perf/scape_perf/mode.h"
#include "perf/scape_perf/options.h"
#include "scape/scape.h"

namespace scape_perf {

using perf::beat;
using perf::nowSec;

// One row of scape-perf's columns (one size and density).
struct Row {
  const ModeDesc* mode = nullptr;
  uint64_t bytes = 0, count = 0;
  double density = 1.0;
  uint64_t k = 0;   // elements each rank contributes (coo: mean nnz)
  double wire = 0;  // bytes each rank sends
  double algBytes = 0;
  bool has[2] = {false, false};
  double timeUs[2] = {0, 0}, algBw[2] = {0, 0}, busBw[2] = {0, 0}, deqBw[2] = {0, 0};
  int64_t wrong[2] = {0, 0};
  std::string note;       // a line printed under the row ("#   mask: ..."), or empty
  std::string jsonExtra;  // more fields of its JSON object (", \"key\": value..."), or empty
};

// The host's aggregate CPU counters (/proc/stat "cpu" line, in ticks).
struct CpuTicks {
  unsigned long long user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                     steal = 0;
  unsigned long long total() const {
    return user + nice + sys + idle + iowait + irq + softirq + steal;
  }
};
bool readCpuTicks(CpuTicks* t);

class Bench {
 public:
  Bench(const Options& o, scapeComm_t comm, int rank, int nranks, FILE* json);

  // Runs the mode; returns an exit code.
  int run();

  // ---- for the modes ----
  const Options& opts() const { return o_; }
  scapeComm_t comm() const { return comm_; }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const Pattern& pattern() const { return pattern_; }
  size_t typeSize() const { return ts_; }
  bool inject() const { return inject_; }  // SCAPE_PERF_INJECT_ERROR on this rank
  unsigned char* send() { return send_.get(); }
  unsigned char* recv() { return recv_.get(); }
  std::vector<float>& statScratch() { return stat_; }
  // Whether the collective (-t) reduces, and the root column (broadcast's root, else -1).
  bool hasOp() const { return o_.coll == Coll::kAllReduce || o_.coll == Coll::kReduceScatter; }
  int printedRoot() const { return o_.coll == Coll::kBroadcast ? o_.root : -1; }
  // Sizes of the sweep, -b to -e by -f.
  std::vector<uint64_t> sizes() const;

  // The dense send and receive buffers (send()/recv()); false (reported) if out of memory.
  bool allocDense(uint64_t sendBytes, uint64_t recvBytes);
  // Report a failed call / a failure; both return false.
  bool fail(const char* call, scapeResult_t r);
  bool failMsg(const char* fmt, ...) PERF_PRINTF(2, 3);
  // In place on every rank: max or sum over ranks (int64); false (reported) on failure.
  bool reduceI64(int64_t* v, size_t n, scapeRedOp_t op, const char* what);

  // Times one placement. Dense rows (checkFirst false), nccl-tests' BenchTime: init, one
  // untimed operation, a barrier, -n timed operations; then, if checking, fresh inputs, one
  // more operation and a count of the wrong elements. Sparse rows (checkFirst true), to spare
  // the costly rows operations: init, one untimed operation whose result is checked,
  // `warmup - 1` more untimed operations, a barrier, -n timed operations; with warmup 0, no
  // untimed operation: the first timed one is checked (outside the timing, then a barrier).
  // init(forCheck) and launch() return false on failure; check() returns the count.
  template <class Init, class Launch, class Check>
  bool timePlacement(bool checkFirst, int warmup, Init&& init, Launch&& launch, Check&& check,
                     int64_t* ns, int64_t* wrong);

  // The slowest rank's time and the ranks' wrong elements of both placements; then the
  // bandwidths, the row's line (rank 0) and its JSON object.
  bool finishRow(Row* row, int64_t ns[2], int64_t wrong[2]);
  // A row of a mode's own table (the mode prints it): its JSON object ("{...}"), the value the
  // footer averages (ModeDesc::summaryLabel) and its wrong elements.
  void addCustomRow(std::string json, double summaryValue, int64_t wrong);

 private:
  void printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts);
  void printRow(const Row& w);
  void printFooter();
  void writeJson();
  bool exchangeRankInfo(std::vector<int64_t>* pids, std::vector<std::string>* hosts);
  perf_row columns(const Row& w) const;

  const Options& o_;
  scapeComm_t comm_;
  int rank_, nranks_;
  FILE* json_;
  Pattern pattern_;
  size_t ts_;
  bool inject_;
  Buffer send_, recv_;
  std::vector<float> stat_;
  std::vector<Row> rows_;
  std::vector<std::string> customJson_;
  double summarySum_ = 0;
  int summaryCount_ = 0;
  int64_t wrongTotal_ = 0;
  CpuTicks ticks0_;  // host CPU counters at the start of the run (rank 0 reports)
  bool haveTicks_ = false;
};

// Returns false from the enclosing function (through bench.fail) when a call fails.
#define PERF_CHECK(bench, what, call)                                    \
  do {                                                                   \
    const scapeResult_t perf_res_ = (call);                              \
    if (perf_res_ != scapeSuccess) return (bench).fail(what, perf_res_); \
  } while (0)

template <class Init, class Launch, class Check>
bool Bench::timePlacement(bool checkFirst, int warmup, Init&& init, Launch&& launch, Check&& check,
                          int64_t* ns, int64_t* wrong) {
  using Clock = std::chrono::steady_clock;
  *wrong = 0;
  if (checkFirst && warmup == 0) {
    if (!init(o_.check != 0)) return false;
    PERF_CHECK(*this, "scapeBarrier (before timing)", scapeBarrier(comm_));
    int64_t total = 0;
    for (int i = 0; i < o_.iters; ++i) {
      const auto t0 = Clock::now();
      if (!launch()) return false;
      total += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      if (i == 0 && o_.check) {
        *wrong = check();
        PERF_CHECK(*this, "scapeBarrier (after the check)", scapeBarrier(comm_));
      }
    }
    *ns = total / o_.iters;
    return true;
  }
  if (checkFirst) {
    if (!init(o_.check != 0)) return false;
    if (!launch()) return false;
    if (o_.check) *wrong = check();
    for (int i = 1; i < warmup; ++i)
      if (!launch()) return false;
  } else {
    if (!init(false)) return false;
    for (int i = 0; i < warmup; ++i)
      if (!launch()) return false;
    if (!launch()) return false;
  }
  PERF_CHECK(*this, "scapeBarrier (before timing)", scapeBarrier(comm_));
  const auto t0 = Clock::now();
  for (int i = 0; i < o_.iters; ++i)
    if (!launch()) return false;
  const auto t1 = Clock::now();
  *ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count() / o_.iters;
  if (o_.check && !checkFirst) {
    if (!init(true)) return false;
    if (!launch()) return false;
    *wrong = check();
  }
  return true;
}

}  // namespace scape_perf

#endif  // SCAPE_PERF_SCAPE_PERF_BENCH_H_
