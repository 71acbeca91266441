// gloo-allreduce-perf: Gloo's ring all-reduce (gloo::allreduce, Algorithm::RING: the one PyTorch's
// ProcessGroupGloo runs) over Gloo's TCP transport on loopback, measured the way scape-perf
// and nccl-tests measure all-reduce, for the side-by-side comparison (perf/main_job.sh).
//
//   gloo-allreduce-perf -np N -b 1M -e 256M -f 2 [-n 20] [-w 5] [-c 1] [-I 0|1] [-J FILE]
//
// The parent forks N ranks, which meet through a gloo::rendezvous::FileStore in a fresh
// temporary directory and connect a full mesh of TCP pairs on 127.0.0.1 (float, sum).
// Per size: one untimed call, a barrier, -n timed calls (out-of-place: input and output
// buffers; then in place: output only); time is the average per call, maximum over ranks;
// algbw = bytes / time (GB = 1e9), busbw = algbw * 2(n-1)/n. With -c 1 the inputs are
// re-initialised, one more call runs and the result is compared exactly against a seeded
// expectation (small integers, exact in fp32; the same pattern as mpi-allreduce-perf); the
// wrong-element counts are summed over ranks.
//
// The options, the columns, the JSON rows ("impl": "gloo") and the launcher (fork, watchdog)
// are perf/common's, shared with scape-perf (see scape-perf -h) and mpi-allreduce-perf.
// Exit status: 0 ok, 1 a call failed, 2 wrong results, 64 bad command line, 124 watchdog.

#include <dirent.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "perf/common/launch.h"
#include "perf/common/perf_common.h"

namespace {

const char* kProg = "gloo-allreduce-perf";
constexpr int kModeWidth = 8;  // the width of the mode column

struct Options {
  perf_sweep sweep;
  int nranks = 1, timeoutS = 120, watchdogS = 1800;
  std::string json;
};

void usage(FILE* f) {
  std::fprintf(f,
               "Usage: %s -np N [options]\n"
               "Gloo ring all-reduce (float, sum, TCP on 127.0.0.1) with scape-perf's columns.\n"
               "  -np N     ranks to fork [1]\n"
               "  -b SIZE   smallest message in bytes (K/M/G suffixes, 1024-based) [32M]\n"
               "  -e SIZE   largest message in bytes [32M]\n"
               "  -f N      multiply the size by N (integer >= 2) between steps [2]\n"
               "  -n N      timed iterations per size [20]\n"
               "  -w N      warm-up iterations (at the largest and smallest size) [5]\n"
               "  -c 0|1    check results [1]\n"
               "  -I 0|1    also time the in-place form [1]\n"
               "  -T S      Gloo operation timeout in seconds [120]\n"
               "  -W S      kill the run after S seconds [1800]\n"
               "  -J FILE   also write the results as a JSON array (scape-perf's format)\n"
               "  -h        this text\n",
               kProg);
}

void onOption(void* ctx, int key, const char* opt, const char* v) {
  auto* o = static_cast<Options*>(ctx);
  if (perf_sweep_opt(&o->sweep, key, opt, v)) return;
  switch (key) {
    case 'N':
      o->nranks = perf_parse_int(opt, v, 1, 256, "a rank count 1..256");
      break;
    case 'T':
      o->timeoutS = perf_parse_int(opt, v, 1, 1 << 20, "a timeout in seconds >= 1");
      break;
    case 'W':
      o->watchdogS = perf_parse_int(opt, v, 1, 1 << 30, "a watchdog limit in seconds >= 1");
      break;
    case 'J':
      if (*v == '\0') perf_usage_error("-J expects a file name");
      o->json = v;
      break;
    case 'h':
      usage(stdout);
      std::exit(0);
    default:
      perf_usage_error("unknown argument '%s'", opt);
  }
}

Options parseArgs(int argc, char** argv) {
  static const perf_opt_spec kSpecs[] = {
      {"-np", "--nranks", 'N', 1},  // before "-n" so "-np4" is not "-n p4"
      PERF_SWEEP_OPT_SPECS,        {"-T", "--timeout", 'T', 1}, {"-W", "--watchdog", 'W', 1},
      {"-J", "--json", 'J', 1},    {"-h", "--help", 'h', 0},
  };
  perf_set_prog(kProg);
  Options o;
  perf_sweep_init(&o.sweep);
  perf_parse_opts(argc, argv, kSpecs, sizeof(kSpecs) / sizeof(kSpecs[0]), onOption, &o);
  perf_sweep_finish(&o.sweep, sizeof(float));
  return o;
}

// The pattern of mpi-allreduce-perf and scape-perf (float sum): partial sums stay exact.
uint32_t g_modulus = 16;
int64_t valueOf(int r, uint64_t j) {
  return static_cast<int64_t>(perf_pattern_hash(r, j) % g_modulus);
}
int64_t reducedOf(int nranks, uint64_t j) {
  int64_t acc = 0;
  for (int r = 0; r < nranks; ++r) acc += valueOf(r, j);
  return acc;
}
void fill(float* buf, uint64_t count, int rank) {
  for (uint64_t i = 0; i < count; ++i) buf[i] = static_cast<float>(valueOf(rank, i));
}
int64_t countWrong(const float* buf, uint64_t count, int nranks) {
  int64_t wrong = 0;
  for (uint64_t i = 0; i < count; ++i)
    wrong += static_cast<double>(buf[i]) != static_cast<double>(reducedOf(nranks, i));
  return wrong;
}

class Rank {
 public:
  Rank(const Options& o, std::shared_ptr<gloo::Context> ctx)
      : o_(o), s_(o.sweep), ctx_(std::move(ctx)) {
    rank_ = ctx_->rank;
    nranks_ = ctx_->size;
  }

  void allreduce(float* in, float* out, uint64_t count) {
    gloo::AllreduceOptions opts(ctx_);
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    if (in != nullptr && in != out) opts.setInput(in, count);
    opts.setOutput(out, count);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setTag(tag_++);
    opts.setTimeout(std::chrono::seconds(o_.timeoutS));
    gloo::allreduce(opts);
  }

  template <typename T>
  void reduceSmall(T* v, size_t n, bool max) {
    gloo::AllreduceOptions opts(ctx_);
    opts.setOutput(v, n);
    if (max)
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::max<T>));
    else
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
    opts.setTag(tag_++);
    opts.setTimeout(std::chrono::seconds(o_.timeoutS));
    gloo::allreduce(opts);
  }

  void barrier() {
    gloo::BarrierOptions opts(ctx_);
    opts.setTag(tag_++);
    opts.setTimeout(std::chrono::seconds(o_.timeoutS));
    gloo::barrier(opts);
  }

  // One placement: untimed call, barrier, timed calls, optional check.
  void benchOne(float* send, float* recv, uint64_t count, bool inPlace, double* sec,
                int64_t* wrong) {
    float* data = inPlace ? recv : send;
    float* in = inPlace ? nullptr : send;
    fill(data, count, rank_);
    allreduce(in, recv, count);
    barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < s_.iters; ++i) allreduce(in, recv, count);
    *sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / s_.iters;
    *wrong = 0;
    if (s_.check) {
      fill(data, count, rank_);
      if (!inPlace) std::memset(recv, 0xa5, count * sizeof(float));
      allreduce(in, recv, count);
      *wrong = countWrong(recv, count, nranks_);
    }
    perf::beat();
  }

  // One size: both placements, the slowest rank's times, the ranks' wrong elements.
  perf_row measure(float* send, float* recv, uint64_t size) {
    perf_row row{};
    const uint64_t count = size / sizeof(float);
    double sec[2] = {0, 0};
    int64_t wrong[2] = {0, 0};
    benchOne(send, recv, count, false, &sec[0], &wrong[0]);
    if (s_.in_place) benchOne(send, recv, count, true, &sec[1], &wrong[1]);
    reduceSmall(sec, 2, true);
    reduceSmall(wrong, 2, false);
    row.bytes = count * sizeof(float);
    row.count = count;
    row.type = "float";
    row.redop = "sum";
    row.root = -1;
    row.mode = "dense";
    row.density = 1.0;
    row.k = count;
    row.wire = 2.0 * (nranks_ - 1) / nranks_ * static_cast<double>(row.bytes);
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !s_.in_place) continue;
      perf_place& p = row.place[k];
      p.ran = 1;
      p.time_us = sec[k] * 1e6;
      p.algbw = sec[k] > 0 ? static_cast<double>(row.bytes) / 1e9 / sec[k] : 0.0;
      p.busbw = p.algbw * 2.0 * (nranks_ - 1) / nranks_;
      p.deqbw = p.algbw;
      p.wrong = wrong[k];
    }
    return row;
  }

  int run() {
    g_modulus = perf_float_sum_modulus(nranks_);
    perf_json json{nullptr, 0};
    if (rank_ == 0 && !o_.json.empty()) {
      FILE* f = std::fopen(o_.json.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "%s: -J: cannot open '%s': %s\n", kProg, o_.json.c_str(),
                     std::strerror(errno));
        return PERF_EXIT_USAGE;
      }
      perf_json_open(&json, f);
    }
    std::vector<float> send(s_.max_bytes / sizeof(float)), recv(s_.max_bytes / sizeof(float));
    if (rank_ == 0) {
      std::printf("# %s: Gloo %d.%d.%d ring all-reduce (TCP, 127.0.0.1), nranks %d\n", kProg,
                  GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH, nranks_);
      perf_print_sweep_line(stdout, nranks_, &s_);
      std::printf("#\n");
      perf_print_columns(stdout, kModeWidth);
      std::fflush(stdout);
    }
    for (uint64_t wsize : {s_.max_bytes, s_.min_bytes}) {
      const uint64_t count = wsize / sizeof(float);
      fill(send.data(), count, rank_);
      for (int i = 0; i < s_.warmup; ++i) allreduce(send.data(), recv.data(), count);
    }
    double bwSum = 0;
    int bwCount = 0;
    int64_t wrongTotal = 0;
    uint64_t size = s_.min_bytes;
    do {
      const perf_row row = measure(send.data(), recv.data(), size);
      for (const perf_place& p : row.place) {
        if (!p.ran) continue;
        bwSum += p.busbw;
        ++bwCount;
        wrongTotal += p.wrong;
      }
      if (rank_ == 0) {
        perf_print_row(stdout, &row, kModeWidth, s_.check);
        std::fflush(stdout);
      }
      perf_json_row_start(&json);
      perf_json_row_head(&json, "gloo", "allreduce", nranks_, &row);
      perf_json_row_tail(&json, &row, s_.check);
    } while (perf_sweep_next(&s_, &size));
    if (rank_ == 0) {
      perf_print_wrong_footer(stdout, s_.check, wrongTotal);
      perf_print_summary_line(stdout, "Avg bus bandwidth", bwCount ? bwSum / bwCount : 0.0);
      std::printf("#\n");
      std::fflush(stdout);
    }
    if (json.f != nullptr && perf_json_close(&json) != 0) {
      std::fprintf(stderr, "%s: writing %s failed\n", kProg, o_.json.c_str());
      return PERF_EXIT_CALL_FAILED;
    }
    return wrongTotal ? PERF_EXIT_WRONG : 0;
  }

 private:
  const Options& o_;
  const perf_sweep& s_;
  std::shared_ptr<gloo::Context> ctx_;
  int rank_ = 0, nranks_ = 1;
  uint32_t tag_ = 1;
};

int runRank(const Options& o, int rank, const std::string& storeDir) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    attr.ai_family = AF_INET;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore fileStore(storeDir);
    gloo::rendezvous::PrefixStore store("gloo-allreduce-perf", fileStore);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, o.nranks);
    ctx->setTimeout(std::chrono::seconds(o.timeoutS));
    ctx->connectFullMesh(store, dev);
    perf::beat();
    Rank r(o, ctx);
    return r.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rank %d: Gloo failed: %s\n", kProg, rank, e.what());
    return PERF_EXIT_CALL_FAILED;
  }
}

// The FileStore's files (flat), then the directory.
void removeStore(const std::string& storeDir) {
  if (DIR* d = opendir(storeDir.c_str())) {
    while (const struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") unlink((storeDir + "/" + name).c_str());
    }
    closedir(d);
  }
  rmdir(storeDir.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  char tmpl[] = "/tmp/gloo-allreduce-perf.XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) {
    std::fprintf(stderr, "%s: mkdtemp failed: %s\n", kProg, std::strerror(errno));
    return PERF_EXIT_CALL_FAILED;
  }
  const std::string storeDir = dir;
  // The ranks: the first failure ends the others after a grace of 5 s (so that rank 0 still
  // writes its rows and JSON when every rank ends with "wrong results"); the watchdog (-W).
  perf::LaunchOptions lo;
  lo.prog = kProg;
  lo.nranks = o.nranks;
  lo.watchdogS = o.watchdogS;
  lo.failGraceS = 5.0;
  const int exitCode =
      perf::forkRanks(lo, [&](int rank, void*) { return runRank(o, rank, storeDir); });
  removeStore(storeDir);
  return exitCode;
}
