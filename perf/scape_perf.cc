// scape-perf: an nccl-tests-style benchmark of SCAPE comm's dense collectives.
//
// It uses only the public C API (include/scape/scape.h) and links the shipped shared library.
// Output follows nccl-tests (all_reduce_perf and friends): a header, then one line per size
// with out-of-place and in-place time, algorithm bandwidth, bus bandwidth and the number of
// wrong elements, then "# Out of bounds values" and "# Avg bus bandwidth".
//
// Launch modes:
//   scape-perf -np N ...   forks N local ranks; the parent creates the unique id, waits, forwards
//                          the first failing rank's exit code and kills the rest on failure or
//                          when its watchdog fires.
//   <launcher> scape-perf  one rank per process from the launcher's environment (torchrun,
//                          mpirun, srun): scapeCommInitFromEnv.
//   scape-perf             a single rank.
//
// Exit status: 0 success; 1 a call failed; 2 wrong results; 64 bad command line;
// 124 the watchdog killed the run.

#include <errno.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "scape/scape.h"
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {

constexpr int kExitOk = 0;
constexpr int kExitCallFailed = 1;
constexpr int kExitWrong = 2;
constexpr int kExitUsage = 64;
constexpr int kExitWatchdog = 124;

constexpr int kMaxLocalRanks = 1024;
constexpr int kDefaultTimeoutMs = 120000;  // the library's documented default
constexpr int kDefaultWatchdogS = 1800;

// ------------------------------------------------------------------------------------------
// Command line
// ------------------------------------------------------------------------------------------

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

struct Options {
  uint64_t minBytes = 32ull << 20;
  uint64_t maxBytes = 32ull << 20;
  uint64_t stepFactor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  scapeDataType_t dtype = scapeFloat32;
  scapeRedOp_t op = scapeSum;
  Coll coll = Coll::kAllReduce;
  int root = 0;
  int localRanks = 0;  // -np; 0: not forking
  int timeoutMs = SCAPE_CONFIG_UNDEF_INT;
  int watchdogS = kDefaultWatchdogS;
  std::string jsonPath;
};

const char* kProg = "scape-perf";

void usage(FILE* f) {
  std::fprintf(
      f,
      "Usage: %s [options]\n"
      "nccl-tests-style benchmark of SCAPE comm collectives (host memory).\n"
      "\n"
      "  -b, --minbytes SIZE     smallest message in bytes (K/M/G suffixes, 1024-based) [32M]\n"
      "  -e, --maxbytes SIZE     largest message in bytes [32M]\n"
      "  -f, --stepfactor N      multiply the size by N (integer >= 2) between steps [2]\n"
      "  -n, --iters N           timed iterations per size [20]\n"
      "  -w, --warmup_iters N    warm-up iterations (at the largest and smallest size) [5]\n"
      "  -c, --check 0|1         check results against a seeded expectation [1]\n"
      "  -d, --datatype TYPE     float, half, bfloat16, int32, int64 [float]\n"
      "  -o, --op OP             sum, avg, max, min [sum]\n"
      "  -t, --coll COLL         allreduce, reducescatter, allgather, broadcast [allreduce]\n"
      "  -r, --root N            broadcast root [0]\n"
      "  -np, --nranks N         fork N local ranks (bootstrap on loopback unless\n"
      "                          SCAPE_SOCKET_IFNAME is set)\n"
      "  -T, --timeout MS        communicator timeout in ms (scapeConfig_t.timeoutMs)\n"
      "                          [SCAPE_TIMEOUT_MS, else %d]\n"
      "  -W, --watchdog S        kill the run after S seconds in total [%d]; with -np the\n"
      "                          parent also kills the ranks when none completes an operation\n"
      "                          for 2 x timeout + 30 s\n"
      "  -J, --json FILE         also write the results as a JSON array\n"
      "  -h, --help              this text\n"
      "\n"
      "Sizes are total bytes per rank for allreduce and broadcast, and nranks x per-rank bytes\n"
      "for reducescatter (send) and allgather (receive), as in nccl-tests.\n"
      "Without -np, a launcher's environment (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE,\n"
      "PMI_RANK, SLURM_PROCID) selects scapeCommInitFromEnv; otherwise one rank runs.\n"
      "Exit status: 0 ok, 1 a call failed, 2 wrong results, 64 bad usage, 124 watchdog.\n",
      kProg, kDefaultTimeoutMs, kDefaultWatchdogS);
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

// Parses "123", "4K", "1M", "2G", "64KB", "1MiB" (1024-based, as nccl-tests).
uint64_t parseSize(const char* opt, const char* s) {
  if (s == nullptr || *s == '\0') usageError("%s expects a size such as 8, 64K, 1M, 2G", opt);
  errno = 0;
  char* end = nullptr;
  if (*s == '-' || *s == '+') usageError("%s expects a non-negative size, got '%s'", opt, s);
  unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || errno == ERANGE)
    usageError("%s expects a size such as 8, 64K, 1M, 2G, got '%s'", opt, s);
  uint64_t mult = 1;
  switch (*end) {
    case 'k':
    case 'K':
      mult = 1ull << 10;
      ++end;
      break;
    case 'm':
    case 'M':
      mult = 1ull << 20;
      ++end;
      break;
    case 'g':
    case 'G':
      mult = 1ull << 30;
      ++end;
      break;
    default:
      break;
  }
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
  long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    usageError("%s expects %s, got '%s'", opt, what, s);
  return static_cast<int>(v);
}

const char* typeName(scapeDataType_t t) {
  switch (t) {
    case scapeFloat32:
      return "float";
    case scapeFloat16:
      return "half";
    case scapeBfloat16:
      return "bfloat16";
    case scapeInt32:
      return "int32";
    case scapeInt64:
      return "int64";
    default:
      return "?";
  }
}

const char* opName(scapeRedOp_t op) {
  switch (op) {
    case scapeSum:
      return "sum";
    case scapeAvg:
      return "avg";
    case scapeMax:
      return "max";
    case scapeMin:
      return "min";
    default:
      return "?";
  }
}

const char* collName(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "allreduce";
    case Coll::kReduceScatter:
      return "reducescatter";
    case Coll::kAllGather:
      return "allgather";
    case Coll::kBroadcast:
      return "broadcast";
  }
  return "?";
}

scapeDataType_t parseType(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects a datatype", opt);
  std::string v(s);
  if (v == "float" || v == "float32" || v == "fp32" || v == "f32") return scapeFloat32;
  if (v == "half" || v == "float16" || v == "fp16" || v == "f16") return scapeFloat16;
  if (v == "bfloat16" || v == "bf16") return scapeBfloat16;
  if (v == "int32" || v == "int") return scapeInt32;
  if (v == "int64") return scapeInt64;
  usageError("%s: unknown datatype '%s' (expected float, half, bfloat16, int32 or int64)", opt, s);
}

scapeRedOp_t parseOp(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects an op", opt);
  std::string v(s);
  if (v == "sum") return scapeSum;
  if (v == "avg") return scapeAvg;
  if (v == "max") return scapeMax;
  if (v == "min") return scapeMin;
  usageError("%s: unknown op '%s' (expected sum, avg, max or min)", opt, s);
}

Coll parseColl(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects a collective", opt);
  std::string v(s);
  if (v == "allreduce" || v == "all_reduce") return Coll::kAllReduce;
  if (v == "reducescatter" || v == "reduce_scatter") return Coll::kReduceScatter;
  if (v == "allgather" || v == "all_gather") return Coll::kAllGather;
  if (v == "broadcast" || v == "bcast") return Coll::kBroadcast;
  usageError(
      "%s: unknown collective '%s' (expected allreduce, reducescatter, allgather or "
      "broadcast)",
      opt, s);
}

Options parseArgs(int argc, char** argv) {
  struct Spec {
    const char* shortName;
    const char* longName;
    char key;
    bool hasArg;
  };
  static const Spec kSpecs[] = {
      {"-np", "--nranks", 'N', true},  // before "-n" so "-np4" is not "-n p4"
      {"-b", "--minbytes", 'b', true},     {"-e", "--maxbytes", 'e', true},
      {"-f", "--stepfactor", 'f', true},   {"-n", "--iters", 'n', true},
      {"-w", "--warmup_iters", 'w', true}, {"-c", "--check", 'c', true},
      {"-d", "--datatype", 'd', true},     {"-o", "--op", 'o', true},
      {"-t", "--coll", 't', true},         {"-r", "--root", 'r', true},
      {"-T", "--timeout", 'T', true},      {"-W", "--watchdog", 'W', true},
      {"-J", "--json", 'J', true},         {"-h", "--help", 'h', false},
  };
  Options o;
  bool sawMin = false, sawMax = false;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const Spec* spec = nullptr;
    const char* val = nullptr;
    std::string optName;
    for (const Spec& s : kSpecs) {
      size_t sl = std::strlen(s.shortName);
      size_t ll = std::strlen(s.longName);
      if (std::strcmp(a, s.shortName) == 0 || std::strcmp(a, s.longName) == 0) {
        spec = &s;
        optName = a;
        if (s.hasArg) {
          if (i + 1 >= argc) usageError("%s expects a value", a);
          val = argv[++i];
        }
        break;
      }
      if (s.hasArg && std::strncmp(a, s.longName, ll) == 0 && a[ll] == '=') {
        spec = &s;
        optName = s.longName;
        val = a + ll + 1;
        break;
      }
      if (s.hasArg && std::strncmp(a, s.shortName, sl) == 0 && a[sl] != '\0' && a[1] != '-') {
        spec = &s;
        optName = s.shortName;
        val = a + sl;
        break;
      }
    }
    if (spec == nullptr) usageError("unknown argument '%s'", a);
    const char* on = optName.c_str();
    switch (spec->key) {
      case 'N':
        o.localRanks = parseInt(on, val, 1, kMaxLocalRanks, "a rank count 1..1024");
        break;
      case 'b':
        o.minBytes = parseSize(on, val);
        sawMin = true;
        break;
      case 'e':
        o.maxBytes = parseSize(on, val);
        sawMax = true;
        break;
      case 'f':
        o.stepFactor =
            static_cast<uint64_t>(parseInt(on, val, 2, 1 << 20, "an integer factor >= 2"));
        break;
      case 'n':
        o.iters = parseInt(on, val, 1, 1 << 30, "an iteration count >= 1");
        break;
      case 'w':
        o.warmup = parseInt(on, val, 0, 1 << 30, "a warm-up count >= 0");
        break;
      case 'c':
        o.check = parseInt(on, val, 0, 1, "0 or 1");
        break;
      case 'd':
        o.dtype = parseType(on, val);
        break;
      case 'o':
        o.op = parseOp(on, val);
        break;
      case 't':
        o.coll = parseColl(on, val);
        break;
      case 'r':
        o.root = parseInt(on, val, 0, 1 << 30, "a root rank >= 0");
        break;
      case 'T':
        o.timeoutMs = parseInt(on, val, 1, 1 << 30, "a timeout in ms >= 1");
        break;
      case 'W':
        o.watchdogS = parseInt(on, val, 1, 1 << 30, "a watchdog limit in seconds >= 1");
        break;
      case 'J':
        if (val == nullptr || *val == '\0') usageError("%s expects a file name", on);
        o.jsonPath = val;
        break;
      case 'h':
        usage(stdout);
        std::exit(kExitOk);
      default:
        usageError("internal: unhandled option '%s'", a);
    }
  }
  // Like nccl-tests: a lone -b or -e sets both ends.
  if (sawMin && !sawMax) o.maxBytes = std::max(o.maxBytes, o.minBytes);
  if (sawMax && !sawMin) o.minBytes = std::min(o.minBytes, o.maxBytes);
  if (o.minBytes == 0) usageError("-b must be at least 1 byte");
  if (o.minBytes > o.maxBytes)
    usageError("-b (%" PRIu64 " bytes) must not exceed -e (%" PRIu64 " bytes)", o.minBytes,
               o.maxBytes);
  return o;
}

// ------------------------------------------------------------------------------------------
// Element encoding. Test values are small non-negative integers, exact in every type.
// ------------------------------------------------------------------------------------------

uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into inf: correct
  return static_cast<uint16_t>(sign | h);
}

double halfToDouble(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0)
    v = std::ldexp(static_cast<double>(mant), -24);
  else if (exp == 31)
    v = mant ? NAN : INFINITY;
  else
    v = std::ldexp(static_cast<double>(1024 + mant), exp - 25);
  return (h & 0x8000) ? -v : v;
}

uint16_t floatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

double bf16ToDouble(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

struct CodecF32 {
  using T = float;
  static T enc(int64_t v) { return static_cast<float>(v); }
  static bool eq(T x, int64_t v) { return static_cast<double>(x) == static_cast<double>(v); }
};
struct CodecF16 {
  using T = uint16_t;
  static T enc(int64_t v) { return floatToHalf(static_cast<float>(v)); }
  static bool eq(T x, int64_t v) { return halfToDouble(x) == static_cast<double>(v); }
};
struct CodecBF16 {
  using T = uint16_t;
  static T enc(int64_t v) { return floatToBf16(static_cast<float>(v)); }
  static bool eq(T x, int64_t v) { return bf16ToDouble(x) == static_cast<double>(v); }
};
struct CodecI32 {
  using T = int32_t;
  static T enc(int64_t v) { return static_cast<int32_t>(v); }
  static bool eq(T x, int64_t v) { return static_cast<int64_t>(x) == v; }
};
struct CodecI64 {
  using T = int64_t;
  static T enc(int64_t v) { return v; }
  static bool eq(T x, int64_t v) { return x == v; }
};

template <class F>
void withCodec(scapeDataType_t t, F&& f) {
  switch (t) {
    case scapeFloat32:
      f(CodecF32{});
      break;
    case scapeFloat16:
      f(CodecF16{});
      break;
    case scapeBfloat16:
      f(CodecBF16{});
      break;
    case scapeInt32:
      f(CodecI32{});
      break;
    case scapeInt64:
      f(CodecI64{});
      break;
    default:
      break;
  }
}

// The largest integer up to which every integer is exact in `t` (so partial sums stay exact).
int64_t exactLimit(scapeDataType_t t) {
  switch (t) {
    case scapeFloat16:
      return 2048;
    case scapeBfloat16:
      return 256;
    default:
      return 1 << 24;
  }
}

// Deterministic input: rank r's element at (global) index j. Values are small integers chosen
// so that every partial sum the library may form is exact in the element type; for avg they
// are multiples of nranks, so the average is exact whether the library divides the total or
// pre-scales each contribution.
struct Pattern {
  int nranks = 1;
  scapeRedOp_t op = scapeSum;
  uint32_t modulus = 16;  // values are base * scale, base in [0, modulus)
  int64_t scale = 1;

  Pattern(int n, scapeDataType_t t, scapeRedOp_t o) : nranks(n), op(o) {
    const int64_t lim = exactLimit(t);
    int64_t maxBase = 15;
    if (op == scapeSum) maxBase = std::min<int64_t>(15, lim / n);
    if (op == scapeAvg) {
      maxBase = std::min<int64_t>(15, lim / (static_cast<int64_t>(n) * n));
      scale = n;
    }
    modulus = static_cast<uint32_t>(maxBase + 1);
  }
  int64_t value(int r, uint64_t j) const {
    uint32_t h = static_cast<uint32_t>(j) * 2654435761u ^ static_cast<uint32_t>(j >> 32) ^
                 (static_cast<uint32_t>(r) + 1u) * 0x85ebca77u;
    h ^= h >> 15;
    return static_cast<int64_t>(h % modulus) * scale;
  }
  int64_t reduced(uint64_t j) const {
    int64_t acc = value(0, j);
    for (int r = 1; r < nranks; ++r) {
      const int64_t v = value(r, j);
      switch (op) {
        case scapeMax:
          acc = std::max(acc, v);
          break;
        case scapeMin:
          acc = std::min(acc, v);
          break;
        default:
          acc += v;
          break;
      }
    }
    if (op == scapeAvg) acc /= nranks;
    return acc;
  }
};

constexpr unsigned char kSentinelByte = 0xa5;  // negative in every type: never an expected value

// ------------------------------------------------------------------------------------------
// Buffers
// ------------------------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<unsigned char, FreeDeleter>;

Buffer allocBuffer(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) bytes = 64;
  if (posix_memalign(&p, 4096, bytes) != 0) return Buffer();
  return Buffer(static_cast<unsigned char*>(p));
}

// ------------------------------------------------------------------------------------------
// One rank's benchmark
// ------------------------------------------------------------------------------------------

std::atomic<uint64_t>* g_heartbeat = nullptr;  // shared with the -np parent, else null
inline void beat() {
  if (g_heartbeat) g_heartbeat->fetch_add(1, std::memory_order_relaxed);
}

struct Row {
  uint64_t bytes;
  uint64_t count;
  double timeUs[2];
  double algBw[2];
  double busBw[2];
  int64_t wrong[2];
};

class Bench {
 public:
  Bench(const Options& o, scapeComm_t comm, int rank, int nranks, FILE* json)
      : o_(o),
        comm_(comm),
        rank_(rank),
        nranks_(nranks),
        json_(json),
        pattern_(nranks, o.dtype,
                 o.coll == Coll::kAllReduce || o.coll == Coll::kReduceScatter
                     ? o.op
                     : scapeMax),  // no reduction: the full value range
        ts_(scapeTypeSize(o.dtype)) {}

  // Returns an exit code.
  int run();

 private:
  // Per size: the parameter count (per-rank count for reduce-scatter / all-gather), and the
  // element counts of the send and receive buffers.
  struct Shape {
    uint64_t count, sendElems, recvElems, bytes;
  };
  Shape shape(uint64_t sizeBytes) const {
    Shape s{};
    const uint64_t n = static_cast<uint64_t>(nranks_);
    switch (o_.coll) {
      case Coll::kAllReduce:
      case Coll::kBroadcast:
        s.count = sizeBytes / ts_;
        s.sendElems = s.recvElems = s.count;
        s.bytes = s.count * ts_;
        break;
      case Coll::kReduceScatter:
        s.count = sizeBytes / ts_ / n;
        s.sendElems = s.count * n;
        s.recvElems = s.count;
        s.bytes = s.count * ts_ * n;
        break;
      case Coll::kAllGather:
        s.count = sizeBytes / ts_ / n;
        s.sendElems = s.count;
        s.recvElems = s.count * n;
        s.bytes = s.count * ts_ * n;
        break;
    }
    return s;
  }
  double busFactor() const {
    const double n = nranks_;
    switch (o_.coll) {
      case Coll::kAllReduce:
        return 2.0 * (n - 1) / n;
      case Coll::kReduceScatter:
      case Coll::kAllGather:
        return (n - 1) / n;
      case Coll::kBroadcast:
        return 1.0;
    }
    return 1.0;
  }
  bool hasOp() const { return o_.coll == Coll::kAllReduce || o_.coll == Coll::kReduceScatter; }
  int printedRoot() const { return o_.coll == Coll::kBroadcast ? o_.root : -1; }

  // Buffers of one placement.
  struct Ptrs {
    const void* send;
    void* recv;
    unsigned char* fillBase;  // where this rank's input starts (null: no input)
    uint64_t fillElems;       // input elements, indexed from 0
  };
  Ptrs ptrs(const Shape& s, bool inPlace);
  void initInputs(const Shape& s, bool inPlace);
  int64_t countWrong(const Shape& s, bool inPlace);
  bool launch(const Shape& s, bool inPlace);
  bool fail(const char* call, scapeResult_t r);
  bool timeOne(const Shape& s, bool inPlace, int64_t* ns, int64_t* wrong);
  void printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts);
  void writeJson();
  bool reduceResults(int64_t ns[2], int64_t wrong[2]);
  int runSizes();
  bool exchangeRankInfo(std::vector<int64_t>* pids, std::vector<std::string>* hosts);

  const Options& o_;
  scapeComm_t comm_;
  int rank_, nranks_;
  FILE* json_;
  Pattern pattern_;
  size_t ts_;
  Buffer send_, recv_;
  std::vector<Row> rows_;
  bool failed_ = false;
};

bool Bench::fail(const char* call, scapeResult_t r) {
  std::fprintf(stderr, "%s: rank %d: %s failed: %s: %s\n", kProg, rank_, call,
               scapeGetErrorString(r), scapeGetLastError(comm_));
  std::fflush(stderr);
  failed_ = true;
  return false;
}

#define PERF_CHECK(what, call)                                   \
  do {                                                           \
    const scapeResult_t perf_res_ = (call);                      \
    if (perf_res_ != scapeSuccess) return fail(what, perf_res_); \
  } while (0)

Bench::Ptrs Bench::ptrs(const Shape& s, bool inPlace) {
  Ptrs p{};
  unsigned char* sb = send_.get();
  unsigned char* rb = recv_.get();
  const uint64_t rOff = static_cast<uint64_t>(rank_) * s.count;
  switch (o_.coll) {
    case Coll::kAllReduce:
      p.send = inPlace ? rb : sb;
      p.recv = rb;
      p.fillBase = inPlace ? rb : sb;
      p.fillElems = s.count;
      break;
    case Coll::kBroadcast:
      p.send = inPlace ? rb : sb;
      p.recv = rb;
      p.fillBase = (rank_ == o_.root) ? (inPlace ? rb : sb) : nullptr;
      p.fillElems = s.count;
      break;
    case Coll::kReduceScatter:  // in place: recvbuf == sendbuf + rank * recvcount
      p.send = sb;
      p.recv = inPlace ? sb + rOff * ts_ : rb;
      p.fillBase = sb;
      p.fillElems = s.sendElems;
      break;
    case Coll::kAllGather:  // in place: sendbuf == recvbuf + rank * sendcount
      p.send = inPlace ? rb + rOff * ts_ : sb;
      p.recv = rb;
      p.fillBase = inPlace ? rb + rOff * ts_ : sb;
      p.fillElems = s.count;
      break;
  }
  return p;
}

void Bench::initInputs(const Shape& s, bool inPlace) {
  const Ptrs p = ptrs(s, inPlace);
  // Receive side first (sentinel), then the input, which may lie inside the receive buffer.
  const bool recvIsInput =
      inPlace && (o_.coll == Coll::kAllReduce || o_.coll == Coll::kReduceScatter);
  if (!recvIsInput) std::memset(p.recv, kSentinelByte, s.recvElems * ts_);
  if (p.fillBase == nullptr) return;
  const int r = (o_.coll == Coll::kBroadcast) ? o_.root : rank_;
  withCodec(o_.dtype, [&](auto codec) {
    using C = decltype(codec);
    auto* out = reinterpret_cast<typename C::T*>(p.fillBase);
    for (uint64_t i = 0; i < p.fillElems; ++i) out[i] = C::enc(pattern_.value(r, i));
  });
}

int64_t Bench::countWrong(const Shape& s, bool inPlace) {
  const Ptrs p = ptrs(s, inPlace);
  int64_t wrong = 0;
  withCodec(o_.dtype, [&](auto codec) {
    using C = decltype(codec);
    const auto* in = reinterpret_cast<const typename C::T*>(p.recv);
    switch (o_.coll) {
      case Coll::kAllReduce:
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pattern_.reduced(i));
        break;
      case Coll::kReduceScatter: {
        const uint64_t base = static_cast<uint64_t>(rank_) * s.count;
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pattern_.reduced(base + i));
        break;
      }
      case Coll::kAllGather:
        for (int r = 0; r < nranks_; ++r)
          for (uint64_t i = 0; i < s.count; ++i)
            wrong += !C::eq(in[static_cast<uint64_t>(r) * s.count + i], pattern_.value(r, i));
        break;
      case Coll::kBroadcast:
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pattern_.value(o_.root, i));
        break;
    }
  });
  return wrong;
}

bool Bench::launch(const Shape& s, bool inPlace) {
  const Ptrs p = ptrs(s, inPlace);
  scapeResult_t r = scapeSuccess;
  const char* name = "";
  switch (o_.coll) {
    case Coll::kAllReduce:
      name = "scapeAllReduce";
      r = scapeAllReduce(p.send, p.recv, s.count, o_.dtype, o_.op, nullptr, comm_, nullptr);
      break;
    case Coll::kReduceScatter:
      name = "scapeReduceScatter";
      r = scapeReduceScatter(p.send, p.recv, s.count, o_.dtype, o_.op, comm_, nullptr);
      break;
    case Coll::kAllGather:
      name = "scapeAllGather";
      r = scapeAllGather(p.send, p.recv, s.count, o_.dtype, comm_, nullptr);
      break;
    case Coll::kBroadcast:
      name = "scapeBroadcast";
      r = scapeBroadcast(p.send, p.recv, s.count, o_.dtype, o_.root, comm_, nullptr);
      break;
  }
  if (r != scapeSuccess) {
    char what[192];
    std::snprintf(what, sizeof(what), "%s(%s, count %" PRIu64 ", %s%s%s, root %d)", name,
                  inPlace ? "in place" : "out of place", s.count, typeName(o_.dtype),
                  hasOp() ? ", " : "", hasOp() ? opName(o_.op) : "", printedRoot());
    return fail(what, r);
  }
  beat();
  return true;
}

// nccl-tests' BenchTime: one untimed operation, a barrier, `iters` timed operations; then, if
// checking, fresh inputs, one more operation and a count of the wrong elements.
bool Bench::timeOne(const Shape& s, bool inPlace, int64_t* ns, int64_t* wrong) {
  initInputs(s, inPlace);
  if (!launch(s, inPlace)) return false;
  PERF_CHECK("scapeBarrier (before timing)", scapeBarrier(comm_));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o_.iters; ++i)
    if (!launch(s, inPlace)) return false;
  const auto t1 = std::chrono::steady_clock::now();
  *ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count() / o_.iters;
  *wrong = 0;
  if (o_.check) {
    initInputs(s, inPlace);
    if (!launch(s, inPlace)) return false;
    *wrong = countWrong(s, inPlace);
  }
  return true;
}

bool Bench::exchangeRankInfo(std::vector<int64_t>* pids, std::vector<std::string>* hosts) {
  constexpr int kHostWords = 8;  // 64 bytes of host name
  constexpr int kSlot = 1 + kHostWords;
  std::vector<int64_t> info(static_cast<size_t>(nranks_) * kSlot, 0);
  int64_t* mine = &info[static_cast<size_t>(rank_) * kSlot];
  mine[0] = static_cast<int64_t>(getpid());
  char host[kHostWords * 8] = {};
  gethostname(host, sizeof(host) - 1);
  std::memcpy(mine + 1, host, sizeof(host));
  PERF_CHECK("scapeAllReduce(rank pids and host names, int64, sum)",
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

bool Bench::reduceResults(int64_t ns[2], int64_t wrong[2]) {
  PERF_CHECK("scapeAllReduce(times, int64, max)",
             scapeAllReduce(ns, ns, 2, scapeInt64, scapeMax, nullptr, comm_, nullptr));
  PERF_CHECK("scapeAllReduce(#wrong, int64, sum)",
             scapeAllReduce(wrong, wrong, 2, scapeInt64, scapeSum, nullptr, comm_, nullptr));
  beat();
  return true;
}

void Bench::printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts) {
  int version = 0;
  scapeGetVersion(&version);
  const std::string timeout = o_.timeoutMs == SCAPE_CONFIG_UNDEF_INT
                                  ? std::string("library default")
                                  : std::to_string(o_.timeoutMs) + " ms";
  std::printf("# %s: SCAPE comm %d.%d.%d, collective %s, nranks %d, timeout %s\n", kProg,
              version / 10000, version / 100 % 100, version % 100, collName(o_.coll), nranks_,
              timeout.c_str());
  std::printf("# nRanks %d minBytes %" PRIu64 " maxBytes %" PRIu64 " step: %" PRIu64
              "(factor) warmup iters: %d iters: %d validation: %d\n",
              nranks_, o_.minBytes, o_.maxBytes, o_.stepFactor, o_.warmup, o_.iters, o_.check);
  std::printf("#\n# Using ranks\n");
  for (int r = 0; r < nranks_; ++r)
    std::printf("#  Rank %2d Pid %6" PRId64 " on %10s (host memory)\n", r, pids[r],
                hosts[r].c_str());
  std::printf("#\n");
  std::printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place\n",
              "", "", "", "", "");
  std::printf("# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
  std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
  std::printf("  %7s  %6s  %6s  %6s\n", "time", "algbw", "busbw", "#wrong");
  std::printf("# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
  std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
  std::printf("  %7s  %6s  %6s  %6s\n", "(us)", "(GB/s)", "(GB/s)", "");
  std::fflush(stdout);
}

void formatTime(char* buf, size_t n, double us) {
  if (us >= 10000.0)
    std::snprintf(buf, n, "%7.0f", us);
  else if (us >= 100.0)
    std::snprintf(buf, n, "%7.1f", us);
  else
    std::snprintf(buf, n, "%7.2f", us);
}

void Bench::writeJson() {
  if (json_ == nullptr) return;
  std::fprintf(json_, "[\n");
  for (size_t i = 0; i < rows_.size(); ++i) {
    const Row& w = rows_[i];
    std::fprintf(json_,
                 "  {\"collective\": \"%s\", \"nranks\": %d, \"size\": %" PRIu64
                 ", \"count\": %" PRIu64 ", \"type\": \"%s\", \"redop\": \"%s\", \"root\": %d",
                 collName(o_.coll), nranks_, w.bytes, w.count, typeName(o_.dtype),
                 hasOp() ? opName(o_.op) : "none", printedRoot());
    static const char* kPlace[2] = {"out_of_place", "in_place"};
    for (int k = 0; k < 2; ++k) {
      std::fprintf(json_,
                   ", \"%s\": {\"time_us\": %.3f, \"algbw_gbs\": %.4f, \"busbw_gbs\": %.4f, ",
                   kPlace[k], w.timeUs[k], w.algBw[k], w.busBw[k]);
      if (o_.check)
        std::fprintf(json_, "\"wrong\": %" PRId64 "}", w.wrong[k]);
      else
        std::fprintf(json_, "\"wrong\": null}");
    }
    std::fprintf(json_, "}%s\n", i + 1 < rows_.size() ? "," : "");
  }
  std::fprintf(json_, "]\n");
}

int Bench::run() {
  const int code = runSizes();
  if (rank_ == 0) writeJson();  // whatever was measured, also after a failure
  return code;
}

int Bench::runSizes() {
  if (o_.coll == Coll::kBroadcast && o_.root >= nranks_) {
    std::fprintf(stderr, "%s: rank %d: -r %d is not a rank (nranks is %d)\n", kProg, rank_, o_.root,
                 nranks_);
    return kExitUsage;
  }
  // Buffers for the largest size.
  const Shape maxShape = shape(o_.maxBytes);
  send_ = allocBuffer(maxShape.sendElems * ts_);
  recv_ = allocBuffer(maxShape.recvElems * ts_);
  if (!send_ || !recv_) {
    std::fprintf(stderr,
                 "%s: rank %d: cannot allocate %" PRIu64 " + %" PRIu64
                 " bytes of buffers for -e %" PRIu64 "\n",
                 kProg, rank_, maxShape.sendElems * ts_, maxShape.recvElems * ts_, o_.maxBytes);
    return kExitCallFailed;
  }

  std::vector<int64_t> pids;
  std::vector<std::string> hosts;
  if (!exchangeRankInfo(&pids, &hosts)) return kExitCallFailed;
  if (rank_ == 0) printHeader(pids, hosts);

  // Warm-up at the largest and the smallest size, as nccl-tests does.
  for (uint64_t wsize : {o_.maxBytes, o_.minBytes}) {
    const Shape s = shape(wsize);
    initInputs(s, false);
    for (int i = 0; i < o_.warmup; ++i)
      if (!launch(s, false)) return kExitCallFailed;
  }

  double bwSum = 0;
  int bwCount = 0;
  int64_t wrongTotal = 0;
  for (uint64_t size = o_.minBytes; size <= o_.maxBytes;) {
    const Shape s = shape(size);
    int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
    for (int k = 0; k < 2; ++k)
      if (!timeOne(s, k == 1, &ns[k], &wrong[k])) return kExitCallFailed;
    // Time: the slowest rank; wrong elements: the sum over ranks.
    if (!reduceResults(ns, wrong)) return kExitCallFailed;
    Row row{};
    row.bytes = s.bytes;
    row.count = s.count;
    for (int k = 0; k < 2; ++k) {
      row.timeUs[k] = static_cast<double>(ns[k]) / 1e3;
      const double sec = static_cast<double>(ns[k]) / 1e9;
      row.algBw[k] = sec > 0 ? static_cast<double>(s.bytes) / 1e9 / sec : 0.0;
      row.busBw[k] = row.algBw[k] * busFactor();
      row.wrong[k] = wrong[k];
      bwSum += row.busBw[k];
      ++bwCount;
      wrongTotal += wrong[k];
    }
    rows_.push_back(row);
    if (rank_ == 0) {
      std::printf("%12" PRIu64 "  %12" PRIu64 "  %8s  %6s  %6d", s.bytes, s.count,
                  typeName(o_.dtype), hasOp() ? opName(o_.op) : "none", printedRoot());
      for (int k = 0; k < 2; ++k) {
        char t[32], w[32];
        formatTime(t, sizeof(t), row.timeUs[k]);
        if (o_.check)
          std::snprintf(w, sizeof(w), "%" PRId64, row.wrong[k]);
        else
          std::snprintf(w, sizeof(w), "N/A");
        std::printf("  %7s  %6.2f  %6.2f  %6s", t, row.algBw[k], row.busBw[k], w);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    if (size > o_.maxBytes / o_.stepFactor) break;
    size *= o_.stepFactor;
  }

  if (rank_ == 0) {
    if (o_.check)
      std::printf("# Out of bounds values : %" PRId64 " %s\n", wrongTotal,
                  wrongTotal ? "FAILED" : "OK");
    else
      std::printf("# Out of bounds values : N/A (-c 0)\n");
    std::printf("# Avg bus bandwidth    : %g \n", bwCount ? bwSum / bwCount : 0.0);
    std::printf("#\n");
    std::fflush(stdout);
  }
  return wrongTotal ? kExitWrong : kExitOk;
}

// ------------------------------------------------------------------------------------------
// Launch
// ------------------------------------------------------------------------------------------

scapeConfig_t makeConfig(const Options& o) {
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = o.timeoutMs;
  return cfg;
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
    return kExitCallFailed;
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
      if (code == kExitOk) code = kExitCallFailed;
    }
  }
  if (code == kExitCallFailed || code == kExitUsage) {
    scapeCommAbort(comm);  // tell the peers at once instead of letting them time out
    return code;
  }
  r = scapeCommDestroy(comm);
  if (r != scapeSuccess) {
    std::fprintf(stderr, "%s: rank %d: scapeCommDestroy failed: %s: %s\n", kProg, rank,
                 scapeGetErrorString(r), scapeGetLastError(comm));
    if (code == kExitOk) code = kExitCallFailed;
  }
  return code;
}

bool launcherEnvPresent() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  return (has("RANK") && has("WORLD_SIZE")) ||
         (has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE")) || has("PMI_RANK") ||
         has("SLURM_PROCID");
}

volatile sig_atomic_t g_signal = 0;
extern "C" void onSignal(int sig) { g_signal = sig; }
extern "C" void onAlarm(int) {
  static const char msg[] = "scape-perf: watchdog: the run exceeded its -W limit; exiting\n";
  ssize_t ignored = write(2, msg, sizeof(msg) - 1);
  (void)ignored;
  _exit(kExitWatchdog);
}

[[noreturn]] void finish(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  // _exit: a forked rank (and the parent, whose rendezvous thread may still run) must not run
  // static destructors that belong to another process's threads.
  _exit(code);
}

int effectiveTimeoutMs(const Options& o) {
  if (o.timeoutMs != SCAPE_CONFIG_UNDEF_INT) return o.timeoutMs;
  if (const char* e = std::getenv("SCAPE_TIMEOUT_MS")) {
    long v = std::strtol(e, nullptr, 10);
    if (v > 0 && v < (1L << 30)) return static_cast<int>(v);
  }
  return kDefaultTimeoutMs;
}

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string describeStatus(int st) {
  char buf[96];
  if (WIFEXITED(st))
    std::snprintf(buf, sizeof(buf), "exited with status %d", WEXITSTATUS(st));
  else if (WIFSIGNALED(st))
    std::snprintf(buf, sizeof(buf), "was killed by signal %d (%s)", WTERMSIG(st),
                  strsignal(WTERMSIG(st)));
  else
    std::snprintf(buf, sizeof(buf), "ended with wait status %d", st);
  return buf;
}

int exitCodeOf(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return kExitCallFailed;
}

// -np N: the parent creates the unique id, forks the ranks and watches them.
int runForked(const Options& o, FILE* json) {
  const int n = o.localRanks;
  if (o.coll == Coll::kBroadcast && o.root >= n)
    usageError("-r %d is not a rank of -np %d", o.root, n);
  // Local ranks talk over loopback unless the user chose an interface.
  setenv("SCAPE_SOCKET_IFNAME", "lo", 0);

  scapeUniqueId id;
  scapeResult_t r = scapeGetUniqueId(&id);
  if (r != scapeSuccess) {
    std::fprintf(stderr, "%s: scapeGetUniqueId failed: %s: %s\n", kProg, scapeGetErrorString(r),
                 scapeGetLastError(nullptr));
    return kExitCallFailed;
  }

  // One heartbeat counter per rank, shared with the parent.
  void* shm = mmap(nullptr, sizeof(std::atomic<uint64_t>) * n, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    std::fprintf(stderr, "%s: mmap of the heartbeat page failed: %s\n", kProg,
                 std::strerror(errno));
    return kExitCallFailed;
  }
  auto* beats = static_cast<std::atomic<uint64_t>*>(shm);
  for (int i = 0; i < n; ++i) new (&beats[i]) std::atomic<uint64_t>(0);

  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  const pid_t parent = getpid();
  std::vector<pid_t> pids(n, -1);
  std::vector<int> status(n, 0);
  std::vector<bool> done(n, false);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int rank = 0; rank < n; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "%s: fork of rank %d failed: %s; killing the %d ranks started\n", kProg,
                   rank, std::strerror(errno), rank);
      for (int k = 0; k < rank; ++k) kill(pids[k], SIGKILL);
      for (int k = 0; k < rank; ++k) waitpid(pids[k], nullptr, 0);
      return kExitCallFailed;
    }
    if (pid == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
#if defined(__linux__)
      prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
      if (getppid() != parent) _exit(kExitCallFailed);
      g_heartbeat = &beats[rank];
      if (rank != 0) json = nullptr;
      scapeConfig_t cfg = makeConfig(o);
      scapeComm_t comm = nullptr;
      scapeResult_t ir = scapeCommInitRankConfig(&comm, n, id, rank, &cfg);
      if (ir != scapeSuccess) {
        std::fprintf(stderr, "%s: rank %d: scapeCommInitRankConfig(nranks=%d) failed: %s: %s\n",
                     kProg, rank, n, scapeGetErrorString(ir), scapeGetLastError(nullptr));
        finish(kExitCallFailed);
      }
      beat();
      finish(runRank(o, comm, json));
    }
    pids[rank] = pid;
  }
  if (json != nullptr) std::fclose(json);  // the parent's copy; rank 0 writes its own

  const double start = nowSec();
  const double stallLimit = 2.0 * effectiveTimeoutMs(o) / 1000.0 + 30.0;
  double lastProgress = start;
  uint64_t lastTotal = 0;
  int firstFailed = -1;
  double failedAt = 0;
  bool killed = false;
  int exitCode = kExitOk;
  int alive = n;

  auto killAll = [&](int sig) {
    for (int k = 0; k < n; ++k)
      if (!done[k]) kill(pids[k], sig);
  };
  auto listAlive = [&]() {
    std::string s;
    for (int k = 0; k < n; ++k)
      if (!done[k]) {
        if (!s.empty()) s += ", ";
        s += std::to_string(k) + " (pid " + std::to_string(pids[k]) + ", " +
             std::to_string(beats[k].load()) + " ops done)";
      }
    return s;
  };

  while (alive > 0) {
    int st = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
      for (int k = 0; k < n; ++k) {
        if (pids[k] != pid || done[k]) continue;
        done[k] = true;
        status[k] = st;
        --alive;
        const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && !killed && firstFailed < 0) {
          firstFailed = k;
          failedAt = nowSec();
          exitCode = exitCodeOf(st);
          if (WIFSIGNALED(st) || WEXITSTATUS(st) != kExitWrong)
            std::fprintf(stderr, "%s: rank %d %s (the first rank to end with an error)\n", kProg, k,
                         describeStatus(st).c_str());
        }
      }
    }
    if (alive == 0) break;
    const double now = nowSec();
    if (g_signal != 0 && !killed) {
      std::fprintf(stderr, "%s: caught signal %d; killing ranks %s\n", kProg,
                   static_cast<int>(g_signal), listAlive().c_str());
      killAll(SIGKILL);
      killed = true;
      exitCode = 128 + g_signal;
    }
    if (!killed && firstFailed >= 0 && now - failedAt > 5.0) {
      std::fprintf(stderr, "%s: rank %d failed 5 s ago; killing ranks still running: %s\n", kProg,
                   firstFailed, listAlive().c_str());
      killAll(SIGKILL);
      killed = true;
    }
    uint64_t total = 0;
    for (int k = 0; k < n; ++k) total += beats[k].load(std::memory_order_relaxed);
    if (total != lastTotal) {
      lastTotal = total;
      lastProgress = now;
    }
    if (!killed && now - start > o.watchdogS) {
      std::fprintf(stderr,
                   "%s: watchdog: the run exceeded -W %d s; killing ranks %s (raise -W for "
                   "longer sweeps)\n",
                   kProg, o.watchdogS, listAlive().c_str());
      killAll(SIGKILL);
      killed = true;
      exitCode = kExitWatchdog;
    }
    if (!killed && now - lastProgress > stallLimit) {
      std::fprintf(stderr,
                   "%s: watchdog: no rank completed an operation for %.0f s (2 x timeout + 30 s); "
                   "killing ranks %s\n",
                   kProg, stallLimit, listAlive().c_str());
      killAll(SIGKILL);
      killed = true;
      exitCode = kExitWatchdog;
    }
    usleep(20000);
  }
  munmap(shm, sizeof(std::atomic<uint64_t>) * n);
  return exitCode;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);

  FILE* json = nullptr;
  if (!o.jsonPath.empty()) {
    json = std::fopen(o.jsonPath.c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "%s: -J: cannot open '%s' for writing: %s\n", kProg, o.jsonPath.c_str(),
                   std::strerror(errno));
      return kExitUsage;
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
      finish(kExitCallFailed);
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
      finish(kExitCallFailed);
    }
  }
  finish(runRank(o, comm, json));
}
