// scape-perf: the Bench's shared machinery (see bench.h); its output is in report.cc.
#include "perf/scape_perf/bench.h"

#include <cinttypes>
#include <cstdarg>
#include <cstdlib>
#include <cstring>

namespace scape_perf {
namespace {

bool injectErrorRequested() {
  const char* e = std::getenv("SCAPE_PERF_INJECT_ERROR");
  return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0;
}

}  // namespace

bool readCpuTicks(CpuTicks* t) {
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return false;
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &t->user, &t->nice,
                            &t->sys, &t->idle, &t->iowait, &t->irq, &t->softirq, &t->steal);
  std::fclose(f);
  return n == 8;
}

Bench::Bench(const Options& o, scapeComm_t comm, int rank, int nranks, FILE* json)
    : o_(o),
      comm_(comm),
      rank_(rank),
      nranks_(nranks),
      json_(json),
      pattern_(nranks, o.dtype,
               o.coll == Coll::kAllReduce || o.coll == Coll::kReduceScatter
                   ? o.op
                   : scapeMax),  // no reduction: the full value range
      ts_(scapeTypeSize(o.dtype)),
      inject_(injectErrorRequested() && rank == 0) {}

std::vector<uint64_t> Bench::sizes() const {
  perf_sweep s;
  perf_sweep_init(&s);
  s.min_bytes = o_.minBytes;
  s.max_bytes = o_.maxBytes;
  s.step_factor = o_.stepFactor;
  std::vector<uint64_t> v;
  uint64_t size = o_.minBytes;
  do {
    v.push_back(size);
  } while (perf_sweep_next(&s, &size));
  return v;
}

bool Bench::fail(const char* call, scapeResult_t r) {
  std::fprintf(stderr, "%s: rank %d: %s failed: %s: %s\n", kProg, rank_, call,
               scapeGetErrorString(r), scapeGetLastError(comm_));
  std::fflush(stderr);
  return false;
}

bool Bench::failMsg(const char* fmt, ...) {
  std::fprintf(stderr, "%s: rank %d: ", kProg, rank_);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  return false;
}

bool Bench::reduceI64(int64_t* v, size_t n, scapeRedOp_t op, const char* what) {
  PERF_CHECK(*this, what, scapeAllReduce(v, v, n, scapeInt64, op, nullptr, comm_, nullptr));
  beat();
  return true;
}

bool Bench::allocDense(uint64_t sendBytes, uint64_t recvBytes) {
  send_ = allocBuffer(sendBytes);
  recv_ = allocBuffer(recvBytes);
  if (!send_ || !recv_) {
    std::fprintf(stderr,
                 "%s: rank %d: cannot allocate %" PRIu64 " + %" PRIu64
                 " bytes of buffers for -e %" PRIu64 "\n",
                 kProg, rank_, sendBytes, recvBytes, o_.maxBytes);
    return false;
  }
  return true;
}

bool Bench::finishRow(Row* row, int64_t ns[2], int64_t wrong[2]) {
  // Time: the slowest rank; wrong elements: the sum over ranks.
  if (!reduceI64(ns, 2, scapeMax, "scapeAllReduce(times, int64, max)")) return false;
  if (!reduceI64(wrong, 2, scapeSum, "scapeAllReduce(#wrong, int64, sum)")) return false;
  for (int k = 0; k < 2; ++k) {
    if (!row->has[k]) continue;
    row->timeUs[k] = static_cast<double>(ns[k]) / 1e3;
    const double sec = static_cast<double>(ns[k]) / 1e9;
    row->algBw[k] = sec > 0 ? row->algBytes / 1e9 / sec : 0.0;
    row->busBw[k] = sec > 0 ? row->wire / 1e9 / sec : 0.0;
    row->deqBw[k] = sec > 0 ? static_cast<double>(row->bytes) / 1e9 / sec : 0.0;
    if (row->mode->flags & kModeBytes) row->busBw[k] = row->algBw[k];
    row->wrong[k] = o_.check ? wrong[k] : 0;
    summarySum_ += row->busBw[k];
    ++summaryCount_;
    wrongTotal_ += row->wrong[k];
  }
  rows_.push_back(*row);
  if (rank_ == 0) printRow(*row);
  return true;
}

void Bench::addCustomRow(std::string json, double summaryValue, int64_t wrong) {
  customJson_.push_back(std::move(json));
  summarySum_ += summaryValue;
  ++summaryCount_;
  wrongTotal_ += wrong;
}

int Bench::run() {
  if (o_.coll == Coll::kBroadcast && o_.root >= nranks_) {
    std::fprintf(stderr, "%s: rank %d: -r %d is not a rank (nranks is %d)\n", kProg, rank_, o_.root,
                 nranks_);
    return PERF_EXIT_USAGE;
  }
  std::vector<int64_t> pids;
  std::vector<std::string> hosts;
  if (!exchangeRankInfo(&pids, &hosts)) return PERF_EXIT_CALL_FAILED;
  if (rank_ == 0) printHeader(pids, hosts);
  haveTicks_ = readCpuTicks(&ticks0_);
  const int code = o_.mode->run(*this);
  if (rank_ == 0) {
    writeJson();  // whatever was measured, also after a failure
    if (code == PERF_EXIT_OK) printFooter();
  }
  if (code != PERF_EXIT_OK) return code;
  return wrongTotal_ ? PERF_EXIT_WRONG : PERF_EXIT_OK;
}

}  // namespace scape_perf
