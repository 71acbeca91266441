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
// Columns and JSON rows are scape-perf's ("impl": "gloo"; see scape-perf -h).
// Exit status: 0 ok, 1 a call failed, 2 wrong results, 64 bad command line, 124 watchdog.

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int kExitCallFailed = 1;
constexpr int kExitWrong = 2;
constexpr int kExitUsage = 64;
constexpr int kExitWatchdog = 124;
const char* kProg = "gloo-allreduce-perf";

struct Options {
  uint64_t minBytes = 32ull << 20, maxBytes = 32ull << 20, factor = 2;
  int iters = 20, warmup = 5, check = 1, inPlace = 1, nranks = 1, timeoutS = 120,
      watchdogS = 1800;
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

[[noreturn]] void usageError(const char* fmt, ...) {
  std::fprintf(stderr, "%s: ", kProg);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, " (run '%s -h' for the options)\n", kProg);
  std::exit(kExitUsage);
}

uint64_t parseSize(const char* opt, const char* s) {
  if (s == nullptr || *s == '\0' || *s == '-' || *s == '+')
    usageError("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s ? s : "");
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || errno == ERANGE) usageError("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s);
  uint64_t mult = 1;
  if (*end == 'k' || *end == 'K') mult = 1ull << 10;
  if (*end == 'm' || *end == 'M') mult = 1ull << 20;
  if (*end == 'g' || *end == 'G') mult = 1ull << 30;
  if (mult > 1) ++end;
  if (mult > 1 && (std::strcmp(end, "B") == 0 || std::strcmp(end, "iB") == 0))
    end += std::strlen(end);
  else if (mult == 1 && std::strcmp(end, "B") == 0)
    ++end;
  if (*end != '\0') usageError("%s: unexpected '%s' in size '%s' (suffixes: K, M, G)", opt, end, s);
  if (v > UINT64_MAX / mult) usageError("%s: size '%s' is too large", opt, s);
  return v * mult;
}

int parseInt(const char* opt, const char* s, long lo, long hi, const char* what) {
  if (s == nullptr || *s == '\0') usageError("%s expects %s", opt, what);
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    usageError("%s expects %s, got '%s'", opt, what, s);
  return static_cast<int>(v);
}

Options parseArgs(int argc, char** argv) {
  Options o;
  bool sawMin = false, sawMax = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usageError("%s expects a value (or is unknown)", a.c_str());
    const char* v = argv[++i];
    if (a == "-np") {
      o.nranks = parseInt("-np", v, 1, 256, "a rank count 1..256");
    } else if (a == "-b") {
      o.minBytes = parseSize("-b", v);
      sawMin = true;
    } else if (a == "-e") {
      o.maxBytes = parseSize("-e", v);
      sawMax = true;
    } else if (a == "-f") {
      o.factor = static_cast<uint64_t>(parseInt("-f", v, 2, 1 << 20, "an integer factor >= 2"));
    } else if (a == "-n") {
      o.iters = parseInt("-n", v, 1, 1 << 30, "an iteration count >= 1");
    } else if (a == "-w") {
      o.warmup = parseInt("-w", v, 0, 1 << 30, "a warm-up count >= 0");
    } else if (a == "-c") {
      o.check = parseInt("-c", v, 0, 1, "0 or 1");
    } else if (a == "-I") {
      o.inPlace = parseInt("-I", v, 0, 1, "0 or 1");
    } else if (a == "-T") {
      o.timeoutS = parseInt("-T", v, 1, 1 << 20, "a timeout in seconds >= 1");
    } else if (a == "-W") {
      o.watchdogS = parseInt("-W", v, 1, 1 << 30, "a watchdog limit in seconds >= 1");
    } else if (a == "-J") {
      if (*v == '\0') usageError("-J expects a file name");
      o.json = v;
    } else {
      usageError("unknown argument '%s'", a.c_str());
    }
  }
  if (sawMin && !sawMax) o.maxBytes = std::max(o.maxBytes, o.minBytes);
  if (sawMax && !sawMin) o.minBytes = std::min(o.minBytes, o.maxBytes);
  if (o.minBytes < sizeof(float)) usageError("-b must be at least %zu bytes", sizeof(float));
  if (o.minBytes > o.maxBytes)
    usageError("-b (%" PRIu64 " bytes) must not exceed -e (%" PRIu64 " bytes)", o.minBytes,
               o.maxBytes);
  return o;
}

// The pattern of mpi-allreduce-perf and scape-perf (float sum): partial sums stay exact.
uint32_t g_modulus = 16;
int64_t valueOf(int r, uint64_t j) {
  uint32_t h = static_cast<uint32_t>(j) * 2654435761u ^ static_cast<uint32_t>(j >> 32) ^
               (static_cast<uint32_t>(r) + 1u) * 0x85ebca77u;
  h ^= h >> 15;
  return static_cast<int64_t>(h % g_modulus);
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

void formatTime(char* out, size_t n, double us) {
  if (us >= 10000.0)
    std::snprintf(out, n, "%7.0f", us);
  else if (us >= 100.0)
    std::snprintf(out, n, "%7.1f", us);
  else
    std::snprintf(out, n, "%7.2f", us);
}

class Rank {
 public:
  Rank(const Options& o, std::shared_ptr<gloo::Context> ctx) : o_(o), ctx_(std::move(ctx)) {
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
    for (int i = 0; i < o_.iters; ++i) allreduce(in, recv, count);
    *sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o_.iters;
    *wrong = 0;
    if (o_.check) {
      fill(data, count, rank_);
      if (!inPlace) std::memset(recv, 0xa5, count * sizeof(float));
      allreduce(in, recv, count);
      *wrong = countWrong(recv, count, nranks_);
    }
  }

  int run() {
    g_modulus = static_cast<uint32_t>(std::min<int64_t>(16777216 / nranks_, 15) + 1);
    FILE* json = nullptr;
    if (rank_ == 0 && !o_.json.empty()) {
      json = std::fopen(o_.json.c_str(), "w");
      if (json == nullptr) {
        std::fprintf(stderr, "%s: -J: cannot open '%s': %s\n", kProg, o_.json.c_str(),
                     std::strerror(errno));
        return kExitUsage;
      }
      std::fprintf(json, "[\n");
    }
    std::vector<float> send(o_.maxBytes / sizeof(float)), recv(o_.maxBytes / sizeof(float));
    if (rank_ == 0) {
      std::printf("# %s: Gloo %d.%d.%d ring all-reduce (TCP, 127.0.0.1), nranks %d\n", kProg,
                  GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH, nranks_);
      std::printf("# nRanks %d minBytes %" PRIu64 " maxBytes %" PRIu64 " step: %" PRIu64
                  "(factor) warmup iters: %d iters: %d validation: %d\n",
                  nranks_, o_.minBytes, o_.maxBytes, o_.factor, o_.warmup, o_.iters, o_.check);
      std::printf("#\n");
      std::printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place"
                  "          %8s  %7s  %12s  %12s  %7s  %7s\n",
                  "", "", "", "", "", "", "", "", "", "deqbw", "deqbw");
      std::printf("# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
      std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
      std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
      std::printf("  %8s  %7s  %12s  %12s  %7s  %7s\n", "mode", "density", "k", "wire", "oop", "ip");
      std::printf("# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
      std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
      std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
      std::printf("  %8s  %7s  %12s  %12s  %7s  %7s\n", "", "", "(elements)", "(B/rank)", "(GB/s)",
                  "(GB/s)");
      std::fflush(stdout);
    }
    for (uint64_t wsize : {o_.maxBytes, o_.minBytes}) {
      const uint64_t count = wsize / sizeof(float);
      fill(send.data(), count, rank_);
      for (int i = 0; i < o_.warmup; ++i) allreduce(send.data(), recv.data(), count);
    }
    double bwSum = 0;
    int bwCount = 0, rows = 0;
    int64_t wrongTotal = 0;
    for (uint64_t size = o_.minBytes; size <= o_.maxBytes;) {
      const uint64_t count = size / sizeof(float), bytes = count * sizeof(float);
      double sec[2] = {0, 0};
      int64_t wrong[2] = {0, 0};
      benchOne(send.data(), recv.data(), count, false, &sec[0], &wrong[0]);
      if (o_.inPlace) benchOne(send.data(), recv.data(), count, true, &sec[1], &wrong[1]);
      reduceSmall(sec, 2, true);
      reduceSmall(wrong, 2, false);
      const double wire = 2.0 * (nranks_ - 1) / nranks_ * static_cast<double>(bytes);
      double alg[2] = {0, 0}, bus[2] = {0, 0};
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && !o_.inPlace) continue;
        alg[k] = sec[k] > 0 ? static_cast<double>(bytes) / 1e9 / sec[k] : 0.0;
        bus[k] = alg[k] * 2.0 * (nranks_ - 1) / nranks_;
        bwSum += bus[k];
        ++bwCount;
        wrongTotal += wrong[k];
      }
      if (rank_ == 0) {
        std::printf("%12" PRIu64 "  %12" PRIu64 "  %8s  %6s  %6d", bytes, count, "float", "sum", -1);
        for (int k = 0; k < 2; ++k) {
          if (k == 1 && !o_.inPlace) {
            std::printf("  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
            continue;
          }
          char t[32], w[32];
          formatTime(t, sizeof(t), sec[k] * 1e6);
          if (o_.check)
            std::snprintf(w, sizeof(w), "%" PRId64, wrong[k]);
          else
            std::snprintf(w, sizeof(w), "N/A");
          std::printf("  %7s  %6.2f  %6.2f  %6s", t, alg[k], bus[k], w);
        }
        char ip[32];
        if (o_.inPlace)
          std::snprintf(ip, sizeof(ip), "%7.2f", alg[1]);
        else
          std::snprintf(ip, sizeof(ip), "%7s", "N/A");
        std::printf("  %8s  %7.4g  %12" PRIu64 "  %12.0f  %7.2f  %7s\n", "dense", 1.0, count, wire,
                    alg[0], ip);
        std::fflush(stdout);
      }
      if (json != nullptr) {
        static const char* kPlace[2] = {"out_of_place", "in_place"};
        std::fprintf(json,
                     "%s  {\"impl\": \"gloo\", \"collective\": \"allreduce\", \"mode\": \"dense\", "
                     "\"nranks\": %d, \"size\": %" PRIu64 ", \"count\": %" PRIu64
                     ", \"type\": \"float\", \"redop\": \"sum\", \"root\": -1, \"density\": 1, "
                     "\"k\": %" PRIu64 ", \"wire_bytes\": %.0f",
                     rows++ ? ",\n" : "", nranks_, bytes, count, count, wire);
        for (int k = 0; k < 2; ++k) {
          if (k == 1 && !o_.inPlace) {
            std::fprintf(json, ", \"%s\": null", kPlace[k]);
            continue;
          }
          std::fprintf(json,
                       ", \"%s\": {\"time_us\": %.3f, \"algbw_gbs\": %.4f, \"busbw_gbs\": %.4f, "
                       "\"deq_bw_gbs\": %.4f, ",
                       kPlace[k], sec[k] * 1e6, alg[k], bus[k], alg[k]);
          if (o_.check)
            std::fprintf(json, "\"wrong\": %" PRId64 "}", wrong[k]);
          else
            std::fprintf(json, "\"wrong\": null}");
        }
        std::fprintf(json, "}");
      }
      if (size > o_.maxBytes / o_.factor) break;
      size *= o_.factor;
    }
    if (rank_ == 0) {
      if (o_.check)
        std::printf("# Out of bounds values : %" PRId64 " %s\n", wrongTotal,
                    wrongTotal ? "FAILED" : "OK");
      else
        std::printf("# Out of bounds values : N/A (-c 0)\n");
      std::printf("# Avg bus bandwidth    : %g \n#\n", bwCount ? bwSum / bwCount : 0.0);
      std::fflush(stdout);
    }
    if (json != nullptr) {
      std::fprintf(json, "\n]\n");
      if (std::fclose(json) != 0) {
        std::fprintf(stderr, "%s: writing %s failed\n", kProg, o_.json.c_str());
        return kExitCallFailed;
      }
    }
    return wrongTotal ? kExitWrong : 0;
  }

 private:
  const Options& o_;
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
    Rank r(o, ctx);
    return r.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rank %d: Gloo failed: %s\n", kProg, rank, e.what());
    return kExitCallFailed;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  char tmpl[] = "/tmp/gloo-allreduce-perf.XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) {
    std::fprintf(stderr, "%s: mkdtemp failed: %s\n", kProg, std::strerror(errno));
    return kExitCallFailed;
  }
  const std::string storeDir = dir;
  std::fflush(stdout);
  const pid_t parent = getpid();
  std::vector<pid_t> pids;
  for (int r = 0; r < o.nranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "%s: fork failed: %s\n", kProg, std::strerror(errno));
      for (pid_t p : pids) kill(p, SIGKILL);
      return kExitCallFailed;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(kExitCallFailed);
      const int code = runRank(o, r, storeDir);
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  // Wait for the ranks; the first failure (or the watchdog) ends the others.
  const auto start = std::chrono::steady_clock::now();
  int exitCode = 0, alive = o.nranks;
  bool killed = false;
  std::vector<bool> done(pids.size(), false);
  auto killRest = [&]() {
    for (size_t i = 0; i < pids.size(); ++i)
      if (!done[i]) kill(pids[i], SIGKILL);
    killed = true;
  };
  while (alive > 0) {
    int st = 0;
    const pid_t pid = waitpid(-1, &st, WNOHANG);
    if (pid > 0) {
      --alive;
      for (size_t i = 0; i < pids.size(); ++i)
        if (pids[i] == pid) done[i] = true;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (code != 0 && exitCode == 0 && !killed) {
        exitCode = code;
        if (code != kExitWrong)
          std::fprintf(stderr, "%s: a rank (pid %d) ended with status %d; stopping the others\n",
                       kProg, static_cast<int>(pid), code);
        killRest();
      }
      continue;
    }
    if (!killed && std::chrono::steady_clock::now() - start > std::chrono::seconds(o.watchdogS)) {
      std::fprintf(stderr, "%s: watchdog: the run exceeded -W %d s; killing the ranks\n", kProg,
                   o.watchdogS);
      killRest();
      exitCode = kExitWatchdog;
    }
    usleep(20000);
  }
  // The FileStore's files (flat), then the directory.
  if (DIR* d = opendir(storeDir.c_str())) {
    while (const struct dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") unlink((storeDir + "/" + name).c_str());
    }
    closedir(d);
  }
  rmdir(storeDir.c_str());
  return exitCode;
}
