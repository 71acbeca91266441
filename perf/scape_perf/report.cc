// scape-perf: the Bench's output: the header, the rows (scape-perf's columns, perf/common),
// the footer and the JSON array.
#include <unistd.h>

#include <cinttypes>
#include <cstring>

#include "perf/scape_perf/bench.h"

namespace scape_perf {

constexpr int kModeWidth = 11;  // the width of the mode column

bool Bench::exchangeRankInfo(std::vector<int64_t>* pids, std::vector<std::string>* hosts) {
  constexpr int kHostWords = 8;  // 64 bytes of host name
  constexpr int kSlot = 1 + kHostWords;
  std::vector<int64_t> info(static_cast<size_t>(nranks_) * kSlot, 0);
  int64_t* mine = &info[static_cast<size_t>(rank_) * kSlot];
  mine[0] = static_cast<int64_t>(getpid());
  char host[kHostWords * 8] = {};
  gethostname(host, sizeof(host) - 1);
  std::memcpy(mine + 1, host, sizeof(host));
  PERF_CHECK(*this, "scapeAllReduce(rank pids and host names, int64, sum)",
             scapeAllReduce(info.data(), info.data(), info.size(), scapeInt64, scapeSum, nullptr,
                            comm_, nullptr));
  beat();
  for (int r = 0; r < nranks_; ++r) {
    const int64_t* slot = &info[static_cast<size_t>(r) * kSlot];
    pids->push_back(slot[0]);
    char h[kHostWords * 8 + 1] = {};
    std::memcpy(h, slot + 1, kHostWords * 8);
    hosts->push_back(h);
  }
  return true;
}

void Bench::printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts) {
  int version = 0;
  scapeGetVersion(&version);
  const std::string timeout = o_.timeoutMs == SCAPE_CONFIG_UNDEF_INT
                                  ? std::string("library default")
                                  : std::to_string(o_.timeoutMs) + " ms";
  std::printf("# %s: SCAPE comm %d.%d.%d, collective %s, mode %s, nranks %d, timeout %s\n", kProg,
              version / 10000, version / 100 % 100, version % 100, collName(o_.coll), o_.mode->name,
              nranks_, timeout.c_str());
  perf_sweep s;
  perf_sweep_init(&s);
  s.min_bytes = o_.minBytes;
  s.max_bytes = o_.maxBytes;
  s.step_factor = o_.stepFactor;
  s.warmup = o_.warmup;
  s.iters = o_.iters;
  s.check = o_.check;
  perf_print_sweep_line(stdout, nranks_, &s);
  if (o_.mode->flags & kModeDensities) {
    std::string line = "# densities:";
    char d[32];
    for (double v : o_.densities) {
      std::snprintf(d, sizeof(d), " %g", v);
      line += d;
    }
    if (o_.mode->describe) o_.mode->describe(o_, &line);
    std::printf("%s\n", line.c_str());
  }
  if (inject_)
    std::printf("# SCAPE_PERF_INJECT_ERROR: rank 0 corrupts one element of each result\n");
  std::printf("#\n# Using ranks\n");
  for (int r = 0; r < nranks_; ++r)
    perf_print_rank_line(stdout, r, static_cast<long long>(pids[r]), hosts[r].c_str());
  std::printf("#\n");
  if (o_.mode->printColumns)
    o_.mode->printColumns(*this);
  else
    perf_print_columns(stdout, kModeWidth);
  std::fflush(stdout);
}

perf_row Bench::columns(const Row& w) const {
  perf_row c{};
  const bool bytes = (w.mode->flags & kModeBytes) != 0;
  c.bytes = w.bytes;
  c.count = w.count;
  c.type = bytes ? "byte" : typeName(o_.dtype);
  c.redop = hasOp() && !bytes ? opName(o_.op) : "none";
  c.root = printedRoot();
  c.mode = w.mode->name;
  c.density = w.density;
  c.k = w.k;
  c.wire = w.wire;
  for (int k = 0; k < 2; ++k) {
    c.place[k].ran = w.has[k];
    c.place[k].time_us = w.timeUs[k];
    c.place[k].algbw = w.algBw[k];
    c.place[k].busbw = w.busBw[k];
    c.place[k].deqbw = w.deqBw[k];
    c.place[k].wrong = w.wrong[k];
  }
  return c;
}

void Bench::printRow(const Row& w) {
  const perf_row c = columns(w);
  perf_print_row(stdout, &c, kModeWidth, o_.check);
  if (!w.note.empty()) std::fputs(w.note.c_str(), stdout);
  std::fflush(stdout);
}

void Bench::printFooter() {
  perf_print_wrong_footer(stdout, o_.check, wrongTotal_);
  const char* label = o_.mode->summaryLabel ? o_.mode->summaryLabel : "Avg bus bandwidth";
  perf_print_summary_line(stdout, label, summaryCount_ ? summarySum_ / summaryCount_ : 0.0);
  CpuTicks t1;
  if (haveTicks_ && readCpuTicks(&t1) && t1.total() > ticks0_.total()) {
    const CpuTicks& t0 = ticks0_;
    const double d = static_cast<double>(t1.total() - t0.total());
    const double busy = static_cast<double>((t1.user + t1.nice + t1.sys + t1.irq + t1.softirq) -
                                            (t0.user + t0.nice + t0.sys + t0.irq + t0.softirq));
    const double idle = static_cast<double>((t1.idle + t1.iowait) - (t0.idle + t0.iowait));
    std::printf(
        "# Host CPU during run  : busy %.1f%%, idle %.1f%%, stolen by the hypervisor "
        "%.1f%% (/proc/stat)\n",
        100.0 * busy / d, 100.0 * idle / d, 100.0 * static_cast<double>(t1.steal - t0.steal) / d);
  }
  std::printf("#\n");
  std::fflush(stdout);
}

void Bench::writeJson() {
  if (json_ == nullptr) return;
  perf_json j;
  perf_json_open(&j, json_);
  for (const Row& w : rows_) {
    const perf_row c = columns(w);
    perf_json_row_start(&j);
    perf_json_row_head(&j, "scape", collName(o_.coll), nranks_, &c);
    std::fputs(w.jsonExtra.c_str(), json_);
    perf_json_row_tail(&j, &c, o_.check);
  }
  for (const std::string& fields : customJson_) {
    perf_json_row_start(&j);
    std::fputs(fields.c_str(), json_);
    std::fputs("}", json_);
  }
  perf_json_end(&j);
}

}  // namespace scape_perf
