// scape-perf: an nccl-tests-style benchmark of SCAPE comm's collectives, dense and sparse.
//
// It uses only the public C API (include/scape/scape.h) and links the shipped shared library.
// Output follows nccl-tests (all_reduce_perf and friends): a header, then one line per size
// with out-of-place and in-place time, algorithm bandwidth, bus bandwidth and the number of
// wrong elements, then "# Out of bounds values" and "# Avg bus bandwidth".
//
// Modes (--mode):
//   dense     the dense collective (-t allreduce, reducescatter, allgather, broadcast).
//   mask-packed  the same exchange on packed values (scapeMaskAllReducePacked: k values in and
//             out), i.e. without the gather from / scatter to the dense buffer.
//   mask      SCAPE's values-only exchange on an agreed mask: a scapeMask over the buffer
//             (count elements, --segments segments, shard ownership), selected by
//             scapeMaskSelectNextTopk on a per-rank random statistic at each --density,
//             synchronised and advanced, then timed: scapeAllReduce(send, recv, count, dtype,
//             op, mask, comm, NULL) (dense in / dense out), or scapeMaskReduceScatter /
//             scapeMaskAllGather on the packed values (-t reducescatter / allgather).
//   coo       the generic sparse all-reduce, scapeSparseAllReduce: every rank brings a random
//             sorted index list at the density (--coo-algo auto or allgather; --coo-out list or
//             dense).
//   masksync  the mask synchronisation alone (also --mask-sync): per density and encoding,
//             encoded bytes, sync time, and the fraction hidden behind an equal compute phase.
//   memcpy    memcpy bandwidth of one rank (the memory-copy limit for the comparison).
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
// are exactly nccl-tests' (dense rows are unchanged from nccl-tests' meaning).
//
// Launch modes:
//   scape-perf -np N ...   forks N local ranks; rank 0 creates the unique id (after the fork,
//                          so the parent never forks with a second thread running); the parent
//                          waits, forwards the first failing rank's exit code and kills the rest
//                          on failure or when its watchdog fires.
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


#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
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
enum class Mode { kDense, kMask, kMaskPacked, kCoo, kMaskSync, kMemcpy };

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
  // Sparse modes.
  Mode mode = Mode::kDense;
  std::vector<double> densities{1.0};
  bool densitySet = false;
  scapeSparseAlgo_t cooAlgo = scapeSparseAuto;
  bool cooAlgoSet = false;
  bool cooDenseOut = false;
  bool cooOutSet = false;
  scapeMaskEncoding_t encoding = scapeMaskEncodingAuto;
  std::vector<scapeMaskEncoding_t> encodings;  // --encoding list (masksync: each in turn)
  bool encodingSet = false;
  int segments = 5;
  bool segmentsSet = false;
  int syncIdle = 1;  // masksync: also measure the overlap with an idle compute phase
  bool idleSleep = false;  // masksync: the idle phase sleeps (else it polls with sched_yield)
  int inPlace = 1;
};

const char* kProg = "scape-perf";

void usage(FILE* f) {
  std::fprintf(
      f,
      "Usage: %s [options]\n"
      "nccl-tests-style benchmark of SCAPE comm collectives (host memory), dense and sparse.\n"
      "\n"
      "  -b, --minbytes SIZE     smallest message in bytes (K/M/G suffixes, 1024-based) [32M]\n"
      "  -e, --maxbytes SIZE     largest message in bytes [32M]\n"
      "  -f, --stepfactor N      multiply the size by N (integer >= 2) between steps [2]\n"
      "  -n, --iters N           timed iterations per size [20]\n"
      "  -w, --warmup_iters N    warm-up iterations (dense: at the largest and smallest size,\n"
      "                          then one untimed operation per size, and the check after the\n"
      "                          timing, as nccl-tests; other modes: untimed operations before\n"
      "                          each row, the first of them checked; with 0, the first timed\n"
      "                          operation is the checked one) [5]\n"
      "  -c, --check 0|1         check results against a seeded expectation [1]\n"
      "  -d, --datatype TYPE     float, half, bfloat16, int32, int64 [float]\n"
      "  -o, --op OP             sum, avg, max, min [sum]\n"
      "  -t, --coll COLL         allreduce, reducescatter, allgather, broadcast [allreduce]\n"
      "  -r, --root N            broadcast root [0]\n"
      "  -I, --inplace 0|1       also time the in-place form (dense; mask all-reduce) [1]\n"
      "  -m, --mode MODE         dense, mask, mask-packed, coo, masksync, memcpy [dense]\n"
      "                            mask: scapeAllReduce with an agreed mask, dense in and out\n"
      "                                  (or, with -t, scapeMaskReduceScatter /\n"
      "                                  scapeMaskAllGather on the packed values)\n"
      "                            mask-packed: scapeMaskAllReducePacked (k packed values in\n"
      "                                  and out: the exchange without the gather/scatter)\n"
      "                            coo: scapeSparseAllReduce of random (index, value) lists\n"
      "                            masksync: mask encoding size, sync time, hidden fraction\n"
      "                            memcpy: memcpy bandwidth of each rank\n"
      "      --mask-sync         the same as --mode masksync\n"
      "  -D, --density LIST      densities, comma-separated, each in (0, 1] [1.0]\n"
      "      --segments N        mask: segments of the buffer (sizes 1:2:..:N) [5]\n"
      "      --encoding ENC      mask/masksync: auto, bitmap, indices, eliasfano, deltavarint\n"
      "                          (masksync: a comma-separated list) [mask: auto; masksync:\n"
      "                          bitmap,indices,eliasfano,deltavarint,auto]\n"
      "      --coo-algo ALGO     coo: auto (recursive doubling with the dense switch) or\n"
      "                          allgather [auto]\n"
      "      --coo-out OUT       coo: list (outIndices/outValues) or dense (denseOut) [list]\n"
      "      --sync-idle 0|1     masksync: also time the overlap with an idle compute phase\n"
      "                          (hid-idle; N/A with 0) [1]\n"
      "      --idle-wait yield|sleep  masksync: how the idle phase's host thread waits for the\n"
      "                          device: yield = polls with sched_yield, like CUDA's\n"
      "                          cudaDeviceScheduleYield; sleep = one nanosleep (on a VM whose\n"
      "                          idle vCPUs take timers late, this measures the VM) [yield]\n"
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
      "for reducescatter (send) and allgather (receive), as in nccl-tests. In mask mode the\n"
      "size is always the dense buffer the mask covers (count = size / typesize).\n"
      "\n"
      "Columns: 1 size(B) 2 count 3 type 4 redop 5 root | out-of-place: 6 time(us) 7 algbw\n"
      "8 busbw 9 #wrong | in-place: 10 time 11 algbw 12 busbw 13 #wrong (N/A: not run) |\n"
      "14 mode 15 density 16 k (elements per rank: dense count, mask k, coo mean nnz)\n"
      "17 wire(B) (bytes each rank sends: dense 2(P-1)/P*size for allreduce; mask\n"
      "2(P-1)/P*k*typesize; coo the bytesSent of scapeSparseAllReduce, mean over ranks)\n"
      "18 deqbw out-of-place 19 deqbw in-place (dense-equivalent bandwidth: size / time).\n"
      "Sparse rows: algbw = k*typesize/time (coo: k*(8+typesize)/time), busbw = wire/time.\n"
      "GB = 1e9 bytes. Times: the slowest rank's mean; #wrong: summed over ranks.\n"
      "masksync columns: count density encoding sent-as (rank 0's encoding) k sent(B/rank)\n"
      "total(B) mask(B/param) sync(us) busy(us) overlapped(us) hidden mask+payload(B/param)\n"
      "dense(B/param) #wrong sync-cpu(us) idle(us) idle-ovl(us) hid-idle;\n"
      "sync = T_sync, start + wait alone; busy = T_busy, a fixed amount of memory work on this\n"
      "thread that takes T_c alone (T_c = the calibrated T_sync, below); overlapped = start,\n"
      "the same work, wait; hidden = 1 - (overlapped - busy) / sync clipped to [0, 1];\n"
      "mask+payload = total/count + 8*density;\n"
      "sync-cpu = CPU time per sync outside the calling thread (mean over ranks); idle = a\n"
      "wait of T_c alone (--idle-wait), idle-ovl = start, the wait, wait for the sync;\n"
      "hid-idle = 1 - (idle-ovl - idle) / sync: the hidden fraction when the host thread\n"
      "waits for a device.\n"
      "masksync times: T_c is calibrated first (median of -n syncs), then -n rounds of\n"
      "(sync, busy, busy overlapped, idle, idle overlapped) run interleaved; each is the\n"
      "slowest rank's median over its rounds.\n"
      "\n"
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


const char* modeName(Mode m) {
  switch (m) {
    case Mode::kDense:
      return "dense";
    case Mode::kMask:
      return "mask";
    case Mode::kMaskPacked:
      return "mask-packed";
    case Mode::kCoo:
      return "coo";
    case Mode::kMaskSync:
      return "masksync";
    case Mode::kMemcpy:
      return "memcpy";
  }
  return "?";
}

Mode parseMode(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects a mode", opt);
  std::string v(s);
  if (v == "dense") return Mode::kDense;
  if (v == "mask" || v == "masked") return Mode::kMask;
  if (v == "mask-packed" || v == "maskpacked" || v == "packed") return Mode::kMaskPacked;
  if (v == "coo" || v == "sparse") return Mode::kCoo;
  if (v == "masksync" || v == "mask-sync" || v == "mask_sync") return Mode::kMaskSync;
  if (v == "memcpy") return Mode::kMemcpy;
  usageError("%s: unknown mode '%s' (expected dense, mask, mask-packed, coo, masksync or memcpy)",
             opt, s);
}

const char* encodingName(scapeMaskEncoding_t e) {
  switch (e) {
    case scapeMaskEncodingAuto:
      return "auto";
    case scapeMaskEncodingBitmap:
      return "bitmap";
    case scapeMaskEncodingIndices:
      return "indices";
    case scapeMaskEncodingEliasFano:
      return "eliasfano";
    case scapeMaskEncodingDeltaVarint:
      return "deltavarint";
    default:
      return "?";
  }
}

scapeMaskEncoding_t parseEncoding(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects an encoding", opt);
  std::string v(s);
  if (v == "auto") return scapeMaskEncodingAuto;
  if (v == "bitmap") return scapeMaskEncodingBitmap;
  if (v == "indices" || v == "idx32") return scapeMaskEncodingIndices;
  if (v == "eliasfano" || v == "elias-fano" || v == "ef") return scapeMaskEncodingEliasFano;
  if (v == "deltavarint" || v == "delta-varint" || v == "varint") return scapeMaskEncodingDeltaVarint;
  usageError("%s: unknown encoding '%s' (expected auto, bitmap, indices, eliasfano or deltavarint)",
             opt, s);
}

// "1.0,0.1,0.01": every entry a number in (0, 1].
std::vector<double> parseDensities(const char* opt, const char* s) {
  if (s == nullptr || *s == '\0') usageError("%s expects densities such as 1.0,0.1,0.01", opt);
  std::vector<double> out;
  const char* p = s;
  while (true) {
    const char* comma = std::strchr(p, ',');
    std::string item = comma ? std::string(p, static_cast<size_t>(comma - p)) : std::string(p);
    errno = 0;
    char* end = nullptr;
    const double d = std::strtod(item.c_str(), &end);
    if (item.empty() || end == item.c_str() || *end != '\0' || errno == ERANGE || !(d > 0.0) ||
        d > 1.0)
      usageError("%s: '%s' is not a density in (0, 1] (in '%s')", opt, item.c_str(), s);
    out.push_back(d);
    if (!comma) break;
    p = comma + 1;
  }
  return out;
}

scapeSparseAlgo_t parseCooAlgo(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects an algorithm", opt);
  std::string v(s);
  if (v == "auto") return scapeSparseAuto;
  if (v == "allgather" || v == "all_gather" || v == "ag") return scapeSparseAllGather;
  if (v == "rd" || v == "recursive-doubling" || v == "recursive_doubling")
    return scapeSparseRecursiveDoubling;
  usageError("%s: unknown algorithm '%s' (expected auto, allgather or rd)", opt, s);
}

const char* cooAlgoName(scapeSparseAlgo_t a) {
  switch (a) {
    case scapeSparseAuto:
      return "auto";
    case scapeSparseAllGather:
      return "allgather";
    case scapeSparseRecursiveDoubling:
      return "rd";
    default:
      return "?";
  }
}

Options parseArgs(int argc, char** argv) {
  struct Spec {
    const char* shortName;  // "" for long-only options
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
      {"-I", "--inplace", 'I', true},      {"-m", "--mode", 'm', true},
      {"-D", "--density", 'D', true},      {"", "--mask-sync", 'S', false},
      {"", "--segments", 's', true},       {"", "--encoding", 'E', true},
      {"", "--coo-algo", 'A', true},       {"", "--coo-out", 'O', true},
      {"", "--sync-idle", 'Y', true},      {"", "--idle-wait", 'Z', true},
  };
  Options o;
  bool sawMin = false, sawMax = false, sawMode = false, syncIdleSet = false, idleWaitSet = false;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const Spec* spec = nullptr;
    const char* val = nullptr;
    std::string optName;
    for (const Spec& s : kSpecs) {
      const size_t sl = std::strlen(s.shortName);
      const size_t ll = std::strlen(s.longName);
      if ((sl > 0 && std::strcmp(a, s.shortName) == 0) || std::strcmp(a, s.longName) == 0) {
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
      if (sl > 0 && s.hasArg && std::strncmp(a, s.shortName, sl) == 0 && a[sl] != '\0' &&
          a[1] != '-') {
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
      case 'I':
        o.inPlace = parseInt(on, val, 0, 1, "0 or 1");
        break;
      case 'm': {
        const Mode m = parseMode(on, val);
        if (sawMode && m != o.mode)
          usageError("%s %s conflicts with an earlier --mode %s / --mask-sync", on, val,
                     modeName(o.mode));
        o.mode = m;
        sawMode = true;
        break;
      }
      case 'S':
        if (sawMode && o.mode != Mode::kMaskSync)
          usageError("--mask-sync conflicts with --mode %s", modeName(o.mode));
        o.mode = Mode::kMaskSync;
        sawMode = true;
        break;
      case 'D':
        o.densities = parseDensities(on, val);
        o.densitySet = true;
        break;
      case 's':
        o.segments = parseInt(on, val, 1, 1 << 20, "a segment count 1..1048576");
        o.segmentsSet = true;
        break;
      case 'E':
        o.encodings.clear();
        if (val == nullptr || *val == '\0') usageError("%s expects an encoding", on);
        for (const char* p = val;;) {
          const char* comma = std::strchr(p, ',');
          const std::string item = comma ? std::string(p, static_cast<size_t>(comma - p)) : p;
          o.encodings.push_back(parseEncoding(on, item.c_str()));
          if (!comma) break;
          p = comma + 1;
        }
        o.encoding = o.encodings.front();
        o.encodingSet = true;
        break;
      case 'A':
        o.cooAlgo = parseCooAlgo(on, val);
        o.cooAlgoSet = true;
        break;
      case 'O': {
        if (val == nullptr) usageError("%s expects list or dense", on);
        const std::string v(val);
        if (v == "list")
          o.cooDenseOut = false;
        else if (v == "dense")
          o.cooDenseOut = true;
        else
          usageError("%s: unknown output '%s' (expected list or dense)", on, val);
        o.cooOutSet = true;
        break;
      }
      case 'Y':
        o.syncIdle = parseInt(on, val, 0, 1, "0 or 1");
        syncIdleSet = true;
        break;
      case 'Z': {
        const std::string v = val;
        if (v == "yield")
          o.idleSleep = false;
        else if (v == "sleep")
          o.idleSleep = true;
        else
          usageError("%s: unknown wait '%s' (expected yield or sleep)", on, val);
        idleWaitSet = true;
        break;
      }
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

  // Flags that belong to one mode.
  const char* mn = modeName(o.mode);
  if (o.mode == Mode::kDense || o.mode == Mode::kMemcpy) {
    for (double d : o.densities)
      if (d != 1.0)
        usageError("--density %g: --mode %s moves every element; densities apply to --mode "
                   "mask, coo and masksync",
                   d, mn);
  }
  if (o.cooAlgoSet && o.mode != Mode::kCoo)
    usageError("--coo-algo applies to --mode coo only (this run is --mode %s)", mn);
  if (o.cooOutSet && o.mode != Mode::kCoo)
    usageError("--coo-out applies to --mode coo only (this run is --mode %s)", mn);
  const bool maskLike =
      o.mode == Mode::kMask || o.mode == Mode::kMaskPacked || o.mode == Mode::kMaskSync;
  if (o.encodingSet && !maskLike)
    usageError("--encoding applies to the mask modes only (this run is --mode %s)", mn);
  if (syncIdleSet && o.mode != Mode::kMaskSync)
    usageError("--sync-idle applies to --mode masksync only (this run is --mode %s)", mn);
  if (idleWaitSet && o.mode != Mode::kMaskSync)
    usageError("--idle-wait applies to --mode masksync only (this run is --mode %s)", mn);
  if (idleWaitSet && o.syncIdle == 0)
    usageError("--idle-wait has no effect with --sync-idle 0");
  if (o.encodings.size() > 1 && o.mode != Mode::kMaskSync)
    usageError("--encoding: a list of encodings applies to --mode masksync only");
  if (o.segmentsSet && !maskLike)
    usageError("--segments applies to the mask modes only (this run is --mode %s)", mn);
  if (o.mode == Mode::kMask && o.coll == Coll::kBroadcast)
    usageError("--mode mask supports -t allreduce, reducescatter and allgather, not broadcast");
  if ((o.mode == Mode::kCoo || o.mode == Mode::kMaskSync || o.mode == Mode::kMemcpy ||
       o.mode == Mode::kMaskPacked) &&
      o.coll != Coll::kAllReduce)
    usageError("--mode %s measures its own operation; -t %s does not apply", mn,
               collName(o.coll));
  if (o.mode == Mode::kCoo) {
    if (o.dtype != scapeFloat32 && o.dtype != scapeFloat16 && o.dtype != scapeBfloat16)
      usageError("--mode coo: scapeSparseAllReduce takes float, half or bfloat16, not %s",
                 typeName(o.dtype));
    if (o.op != scapeSum && o.op != scapeAvg)
      usageError("--mode coo: scapeSparseAllReduce takes -o sum or avg, not %s", opName(o.op));
  }
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
  static uint32_t hash(int r, uint64_t j) {
    uint32_t h = static_cast<uint32_t>(j) * 2654435761u ^ static_cast<uint32_t>(j >> 32) ^
                 (static_cast<uint32_t>(r) + 1u) * 0x85ebca77u;
    h ^= h >> 15;
    return h;
  }
  int64_t value(int r, uint64_t j) const {
    return static_cast<int64_t>(hash(r, j) % modulus) * scale;
  }
  // Never 0 (COO lists: the library's list output omits exact zeros of a dense intermediate):
  // base in [1, modulus), so sums stay within the same exact range as value().
  int64_t nonzero(int r, uint64_t j) const {
    const uint32_t m = modulus > 1 ? modulus - 1 : 1;
    return (1 + static_cast<int64_t>(hash(r, j) % m)) * scale;
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
// Deterministic random streams in (rank, index): mask statistics and COO selections
// ------------------------------------------------------------------------------------------

constexpr uint64_t kStatSalt = 0x5ca9e57a7u;
constexpr uint64_t kCooSalt = 0xc00c00c00ull;

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

inline uint64_t hashRJ(int r, uint64_t j, uint64_t salt) {
  return mix64(j * 0x9e3779b97f4a7c15ull + (static_cast<uint64_t>(r) + 1u) * 0xd1b54a32d192ed03ull +
               salt);
}

// Rank r's statistic (the SCAPE candidate |c| stands in) at index j: uniform in [-1, 1).
inline float statValue(int r, uint64_t j) {
  return static_cast<float>(static_cast<int32_t>(hashRJ(r, j, kStatSalt) >> 32)) *
         (1.0f / 2147483648.0f);
}

// COO: rank r lists index j with probability `density` (independently per rank and index).
struct CooSelect {
  bool all = false;
  uint64_t threshold = 0;  // on the top 32 bits of the hash
  explicit CooSelect(double density) {
    all = density >= 1.0;
    threshold = static_cast<uint64_t>(std::floor(density * 4294967296.0));
  }
  bool operator()(int r, uint64_t j) const {
    return all || (hashRJ(r, j, kCooSalt) >> 32) < threshold;
  }
};

// Segment offsets of a flat buffer of n elements cut into `nseg` segments of sizes 1:2:..:nseg
// (uneven on purpose, so that segments and shards do not line up).
std::vector<uint64_t> segmentOffsets(uint64_t n, int nseg) {
  std::vector<uint64_t> offs(static_cast<size_t>(nseg) + 1, 0);
  const long double total = static_cast<long double>(nseg) * (nseg + 1) / 2;
  for (int s = 1; s < nseg; ++s) {
    const long double frac = static_cast<long double>(s) * (s + 1) / 2 / total;
    offs[static_cast<size_t>(s)] =
        std::min<uint64_t>(n, static_cast<uint64_t>(frac * static_cast<long double>(n)));
  }
  offs[static_cast<size_t>(nseg)] = n;
  for (int s = 1; s <= nseg; ++s)
    offs[static_cast<size_t>(s)] =
        std::max(offs[static_cast<size_t>(s)], offs[static_cast<size_t>(s) - 1]);
  return offs;
}

// The documented top-k count of one piece (scapeMaskSelectNextTopk).
uint64_t pieceK(uint64_t len, double density) {
  if (len == 0) return 0;
  uint64_t k = static_cast<uint64_t>(std::floor(density * static_cast<double>(len)));
  return std::max<uint64_t>(1, std::min(k, len));
}

bool injectErrorRequested() {
  const char* e = std::getenv("SCAPE_PERF_INJECT_ERROR");
  return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0;
}

// Flips the lowest bit of one element: a small integer stored in any element type changes value.
inline void corruptElement(void* elem) { static_cast<unsigned char*>(elem)[0] ^= 0x01u; }

inline bool isSentinel(const unsigned char* p, size_t ts) {
  for (size_t b = 0; b < ts; ++b)
    if (p[b] != 0xa5u) return false;
  return true;
}

double nowSec();

// CPU seconds of this process (all threads) and of the calling thread.
double processCpuSec() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}
double threadCpuSec() {
  struct timespec ts {};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The host's aggregate CPU counters (/proc/stat "cpu" line, in ticks); false where there is
// no such file. Used to report how much CPU time the hypervisor took from this VM during a
// run ("steal"), which on shared cloud machines is the main source of stalls.
struct CpuTicks {
  unsigned long long user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                     steal = 0;
  unsigned long long total() const {
    return user + nice + sys + idle + iowait + irq + softirq + steal;
  }
};
bool readCpuTicks(CpuTicks* t) {
  FILE* f = std::fopen("/proc/stat", "r");
  if (!f) return false;
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &t->user, &t->nice,
                            &t->sys, &t->idle, &t->iowait, &t->irq, &t->softirq, &t->steal);
  std::fclose(f);
  return n == 8;
}

// Median of a non-empty list (the mean of the middle two for an even count).
int64_t medianI64(std::vector<int64_t> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// Memory work on this thread (the busy compute phase the mask sync hides behind):
// y = 0.999 y + x over two buffers larger than the caches. The phase is a fixed amount of
// work, calibrated to last `sec` when it runs alone, so that CPU the sync takes from it makes
// the phase longer (a phase of fixed length would instead just do less work).
class BusyCompute {
 public:
  BusyCompute() : x_(kElems, 1.0f), y_(kElems, 0.0f) {}
  // Chunks that take `sec` on this thread now (measured by running for `sec`).
  uint64_t calibrate(double sec) {
    const double end = nowSec() + sec;
    uint64_t n = 0;
    do {
      chunk();
      ++n;
    } while (nowSec() < end);
    sink_ += y_[pos_];
    return n;
  }
  void run(uint64_t chunks) {
    for (uint64_t c = 0; c < chunks; ++c) chunk();
    sink_ += y_[pos_];
  }
  float sink() const { return sink_; }

 private:
  static constexpr size_t kElems = size_t{8} << 20;  // 32 MiB per buffer
  static constexpr size_t kChunk = 16384;
  void chunk() {
    float* y = y_.data() + pos_;
    const float* x = x_.data() + pos_;
    for (size_t i = 0; i < kChunk; ++i) y[i] = 0.999f * y[i] + x[i];
    pos_ = (pos_ + kChunk) % kElems;
  }
  std::vector<float> x_, y_;
  size_t pos_ = 0;
  float sink_ = 0;
};

// ------------------------------------------------------------------------------------------
// One rank's benchmark
// ------------------------------------------------------------------------------------------

std::atomic<uint64_t>* g_heartbeat = nullptr;  // shared with the -np parent, else null
inline void beat() {
  if (g_heartbeat) g_heartbeat->fetch_add(1, std::memory_order_relaxed);
}

struct Row {
  Mode mode = Mode::kDense;
  uint64_t bytes = 0, count = 0;
  double density = 1.0;
  uint64_t k = 0;     // elements each rank contributes (coo: mean nnz)
  double wire = 0;    // bytes each rank sends
  double algBytes = 0;
  bool has[2] = {false, false};
  double timeUs[2] = {0, 0}, algBw[2] = {0, 0}, busBw[2] = {0, 0}, deqBw[2] = {0, 0};
  int64_t wrong[2] = {0, 0};
  // mask rows
  double selectUs = 0, maskSyncUs = 0;
  double packUs = -1, unpackUs = -1;  // scapeMaskPack / scapeMaskUnpack alone (dense form)
  uint64_t maskTotalBytes = 0;
  scapeMaskEncoding_t sentEncoding = scapeMaskEncodingAuto;
};

struct SyncRow {
  uint64_t count = 0;
  double density = 0;
  scapeMaskEncoding_t requested = scapeMaskEncodingAuto, sent = scapeMaskEncodingAuto;
  uint64_t k = 0;
  double sentBytes = 0;  // mean over ranks
  uint64_t totalBytes = 0;
  double syncUs = 0, libSyncUs = 0, bothUs = 0, hidden = 0, maskBpp = 0, totalBpp = 0;
  double syncCpuUs = 0;  // CPU time of the background sync (other threads than the caller's)
  double idleUs = 0, hiddenIdle = 0;  // the same overlap with an idle (sleeping) compute phase
  double busyAloneUs = 0, idleAloneUs = 0;  // the compute phases alone, same rounds
  int64_t wrong = 0;
};

void formatTime(char* buf, size_t n, double us) {
  if (us >= 10000.0)
    std::snprintf(buf, n, "%7.0f", us);
  else if (us >= 100.0)
    std::snprintf(buf, n, "%7.1f", us);
  else
    std::snprintf(buf, n, "%7.2f", us);
}

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
        ts_(scapeTypeSize(o.dtype)),
        inject_(injectErrorRequested() && rank == 0) {}

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

  // Dense mode. Buffers of one placement.
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

  // Shared machinery.
  bool fail(const char* call, scapeResult_t r);
  bool failMsg(const char* fmt, ...);
  template <class Init, class Launch, class Check>
  bool timePlacement(bool checkFirst, int warmup, Init&& init, Launch&& launch, Check&& check,
                     int64_t* ns,
                     int64_t* wrong);
  bool reduceI64(int64_t* v, size_t n, scapeRedOp_t op, const char* what);
  bool finishRow(Row* row, int64_t ns[2], int64_t wrong[2]);
  void printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts);
  void printColumns();
  void printRow(const Row& w);
  void printSyncColumns();
  void printSyncRow(const SyncRow& w);
  void printFooter();
  void writeJson();
  bool exchangeRankInfo(std::vector<int64_t>* pids, std::vector<std::string>* hosts);
  bool allocDense(uint64_t sendBytes, uint64_t recvBytes);
  bool ownedRanges(scapeMask_t mask, int rank, std::vector<uint64_t>* ranges);
  bool expectedMaskK(scapeMask_t mask, const std::vector<uint64_t>& offs, double density,
                     uint64_t* k);
  bool selectMask(scapeMask_t mask, uint64_t count, double density, double* selectUs,
                  double* syncUs);

  // Modes.
  int runDense();
  int runMask();
  int runCoo();
  int runMaskSync();
  int runMemcpy();
  bool maskRow(uint64_t count, double density);
  bool cooRow(uint64_t count, double density);
  bool syncRows(uint64_t count, double density, BusyCompute* compute);
  bool memcpyRow(uint64_t bytes);

  // Sizes of the sweep, -b to -e by -f.
  std::vector<uint64_t> sizes() const {
    std::vector<uint64_t> v;
    for (uint64_t size = o_.minBytes; size <= o_.maxBytes;) {
      v.push_back(size);
      if (size > o_.maxBytes / o_.stepFactor) break;
      size *= o_.stepFactor;
    }
    return v;
  }

  const Options& o_;
  scapeComm_t comm_;
  int rank_, nranks_;
  FILE* json_;
  Pattern pattern_;
  size_t ts_;
  bool inject_;
  Buffer send_, recv_;
  uint64_t sendCap_ = 0, recvCap_ = 0;
  std::vector<float> stat_;
  std::vector<Row> rows_;
  std::vector<SyncRow> syncRows_;
  double bwSum_ = 0;
  int bwCount_ = 0;
  int64_t wrongTotal_ = 0;
  CpuTicks ticks0_;          // host CPU counters at the start of the run (rank 0 reports)
  bool haveTicks_ = false;
  bool failed_ = false;
};

bool Bench::fail(const char* call, scapeResult_t r) {
  std::fprintf(stderr, "%s: rank %d: %s failed: %s: %s\n", kProg, rank_, call,
               scapeGetErrorString(r), scapeGetLastError(comm_));
  std::fflush(stderr);
  failed_ = true;
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
  failed_ = true;
  return false;
}

#define PERF_CHECK(what, call)                                   \
  do {                                                           \
    const scapeResult_t perf_res_ = (call);                      \
    if (perf_res_ != scapeSuccess) return fail(what, perf_res_); \
  } while (0)

// Dense rows (checkFirst false), nccl-tests' BenchTime: init, one untimed operation, a barrier,
// `iters` timed operations; then, if checking, fresh inputs, one more operation and a count of
// the wrong elements. Sparse rows (checkFirst true), to spare the costly rows operations: init,
// one untimed operation whose result is checked, `warmup - 1` more untimed operations, a
// barrier, `iters` timed operations; with warmup 0, no untimed operation: the first timed one is
// checked (outside the timing, then a barrier). init(forCheck) returns false on failure;
// launch() likewise; check() returns the count.
template <class Init, class Launch, class Check>
bool Bench::timePlacement(bool checkFirst, int warmup, Init&& init, Launch&& launch,
                          Check&& check, int64_t* ns, int64_t* wrong) {
  *wrong = 0;
  if (checkFirst && warmup == 0) {
    if (!init(o_.check != 0)) return false;
    PERF_CHECK("scapeBarrier (before timing)", scapeBarrier(comm_));
    int64_t total = 0;
    for (int i = 0; i < o_.iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!launch()) return false;
      total += std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now() - t0)
                   .count();
      if (i == 0 && o_.check) {
        *wrong = check();
        PERF_CHECK("scapeBarrier (after the check)", scapeBarrier(comm_));
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
  PERF_CHECK("scapeBarrier (before timing)", scapeBarrier(comm_));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o_.iters; ++i)
    if (!launch()) return false;
  const auto t1 = std::chrono::steady_clock::now();
  *ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count() / o_.iters;
  if (o_.check && !checkFirst) {
    if (!init(true)) return false;
    if (!launch()) return false;
    *wrong = check();
  }
  return true;
}

bool Bench::reduceI64(int64_t* v, size_t n, scapeRedOp_t op, const char* what) {
  PERF_CHECK(what, scapeAllReduce(v, v, n, scapeInt64, op, nullptr, comm_, nullptr));
  beat();
  return true;
}

bool Bench::allocDense(uint64_t sendBytes, uint64_t recvBytes) {
  send_ = allocBuffer(sendBytes);
  recv_ = allocBuffer(recvBytes);
  if (!send_ || !recv_) {
    std::fprintf(stderr,
                 "%s: rank %d: cannot allocate %" PRIu64 " + %" PRIu64 " bytes of buffers for -e %" PRIu64
                 "\n",
                 kProg, rank_, sendBytes, recvBytes, o_.maxBytes);
    return false;
  }
  sendCap_ = sendBytes;
  recvCap_ = recvBytes;
  return true;
}

// ---- dense ---------------------------------------------------------------------------------

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
  if (inject_ && s.recvElems > 0)
    corruptElement(static_cast<unsigned char*>(p.recv) + (s.recvElems / 2) * ts_);
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

int Bench::runDense() {
  const Shape maxShape = shape(o_.maxBytes);
  if (!allocDense(maxShape.sendElems * ts_, maxShape.recvElems * ts_)) return kExitCallFailed;
  // Warm-up at the largest and the smallest size, as nccl-tests does.
  for (uint64_t wsize : {o_.maxBytes, o_.minBytes}) {
    const Shape s = shape(wsize);
    initInputs(s, false);
    for (int i = 0; i < o_.warmup; ++i)
      if (!launch(s, false)) return kExitCallFailed;
  }
  for (uint64_t size : sizes()) {
    const Shape s = shape(size);
    Row row;
    row.mode = Mode::kDense;
    row.bytes = s.bytes;
    row.count = s.count;
    row.density = 1.0;
    row.k = s.sendElems;
    row.wire = busFactor() * static_cast<double>(s.bytes);
    row.algBytes = static_cast<double>(s.bytes);
    int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !o_.inPlace) continue;
      const bool ip = k == 1;
      row.has[k] = true;
      if (!timePlacement(
              false, 0,
              [&](bool) {
                initInputs(s, ip);
                return true;
              },
              [&]() { return launch(s, ip); }, [&]() { return countWrong(s, ip); }, &ns[k],
              &wrong[k]))
        return kExitCallFailed;
    }
    if (!finishRow(&row, ns, wrong)) return kExitCallFailed;
  }
  return kExitOk;
}

// ---- mask ----------------------------------------------------------------------------------

bool Bench::ownedRanges(scapeMask_t mask, int rank, std::vector<uint64_t>* ranges) {
  size_t n = 0;
  PERF_CHECK("scapeMaskGetOwnedRanges", scapeMaskGetOwnedRanges(mask, rank, nullptr, 0, &n));
  ranges->assign(2 * n, 0);
  size_t got = 0;
  if (n > 0)
    PERF_CHECK("scapeMaskGetOwnedRanges",
               scapeMaskGetOwnedRanges(mask, rank, ranges->data(), n, &got));
  return true;
}

// The mask size the documented selection rule gives: every piece of a segment inside an owned
// part selects max(1, floor(density * length)) positions.
bool Bench::expectedMaskK(scapeMask_t mask, const std::vector<uint64_t>& offs, double density,
                          uint64_t* k) {
  *k = 0;
  std::vector<uint64_t> ranges;
  for (int r = 0; r < nranks_; ++r) {
    if (!ownedRanges(mask, r, &ranges)) return false;
    for (size_t i = 0; i + 1 < ranges.size(); i += 2)
      for (size_t s = 0; s + 1 < offs.size(); ++s) {
        const uint64_t b = std::max(ranges[i], offs[s]), e = std::min(ranges[i + 1], offs[s + 1]);
        if (b < e) *k += pieceK(e - b, density);
      }
  }
  return true;
}

// Selects this rank's part of the next mask by top-k of its random statistic, synchronises it and
// makes it current.
bool Bench::selectMask(scapeMask_t mask, uint64_t count, double density, double* selectUs,
                       double* syncUs) {
  if (stat_.size() < count) stat_.resize(count);  // only the owned part is written and read
  std::vector<uint64_t> ranges;
  if (!ownedRanges(mask, rank_, &ranges)) return false;
  for (size_t i = 0; i + 1 < ranges.size(); i += 2)
    for (uint64_t j = ranges[i]; j < ranges[i + 1]; ++j) stat_[j] = statValue(rank_, j);
  const double t0 = nowSec();
  PERF_CHECK("scapeMaskSelectNextTopk", scapeMaskSelectNextTopk(mask, stat_.data(), density));
  const double t1 = nowSec();
  PERF_CHECK("scapeMaskSyncStart", scapeMaskSyncStart(mask));
  PERF_CHECK("scapeMaskSyncWait", scapeMaskSyncWait(mask));
  const double t2 = nowSec();
  PERF_CHECK("scapeMaskAdvance", scapeMaskAdvance(mask));
  beat();
  *selectUs = (t1 - t0) * 1e6;
  *syncUs = (t2 - t1) * 1e6;
  return true;
}

struct MaskHolder {
  std::vector<scapeMask_t> masks;
  ~MaskHolder() {
    for (scapeMask_t m : masks) scapeMaskDestroy(m);
  }
};

bool Bench::maskRow(uint64_t count, double density) {
  const int nseg = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(o_.segments), std::max<uint64_t>(count, 1))));
  const std::vector<uint64_t> offs = segmentOffsets(count, nseg);
  MaskHolder holder;
  scapeMask_t mask = nullptr;
  PERF_CHECK("scapeMaskCreate", scapeMaskCreate(&mask, count, nseg, offs.data(), nullptr,
                                                scapeOwnershipShards, o_.encoding, comm_));
  holder.masks.push_back(mask);
  Row row;
  row.mode = o_.mode;
  row.bytes = count * ts_;
  row.count = count;
  row.density = density;
  if (!selectMask(mask, count, density, &row.selectUs, &row.maskSyncUs)) return false;
  scapeMaskSyncInfo_t info{};
  PERF_CHECK("scapeMaskGetSyncInfo", scapeMaskGetSyncInfo(mask, &info));
  row.maskTotalBytes = info.totalBytes;
  row.sentEncoding = info.encoding;

  const size_t P = static_cast<size_t>(nranks_);
  uint64_t k = 0;
  PERF_CHECK("scapeMaskGetCount", scapeMaskGetCount(mask, &k));
  std::vector<uint64_t> kr(P), off(P);
  for (int r = 0; r < nranks_; ++r)
    PERF_CHECK("scapeMaskGetRankCount",
               scapeMaskGetRankCount(mask, r, &kr[static_cast<size_t>(r)],
                                     &off[static_cast<size_t>(r)]));
  std::vector<uint64_t> idx(k);
  PERF_CHECK("scapeMaskGetIndices", scapeMaskGetIndices(mask, idx.data(), idx.size()));

  // The mask itself: the documented k, every part strictly increasing and inside the buffer.
  int64_t maskWrong = 0;
  uint64_t expectK = 0;
  if (!expectedMaskK(mask, offs, density, &expectK)) return false;
  if (k != expectK) {
    maskWrong += static_cast<int64_t>(k > expectK ? k - expectK : expectK - k);
    if (rank_ == 0)
      std::fprintf(stderr, "%s: mask has k = %" PRIu64 " positions, the selection rule gives %" PRIu64
                           "\n", kProg, k, expectK);
  }
  for (size_t r = 0; r < P; ++r)
    for (uint64_t i = 0; i < kr[r]; ++i) {
      const uint64_t at = off[r] + i;
      if (at >= k || idx[at] >= count || (i > 0 && idx[at] <= idx[at - 1])) ++maskWrong;
    }
  // Sorted positions for the walk over the dense buffer (shard ownership: already sorted).
  std::vector<uint64_t> sorted;
  const std::vector<uint64_t>* walk = &idx;
  if (!std::is_sorted(idx.begin(), idx.end())) {
    sorted = idx;
    std::sort(sorted.begin(), sorted.end());
    walk = &sorted;
  }

  const double busF = o_.coll == Coll::kAllReduce ? 2.0 * (nranks_ - 1) / nranks_
                                                  : static_cast<double>(nranks_ - 1) / nranks_;
  row.k = k;
  row.wire = busF * static_cast<double>(k) * static_cast<double>(ts_);
  row.algBytes = static_cast<double>(k) * static_cast<double>(ts_);
  int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
  unsigned char* sb = send_.get();
  unsigned char* rb = recv_.get();
  const int warm = o_.warmup;

  if (o_.mode == Mode::kMaskPacked) {
    Buffer psend = allocBuffer(k * ts_), precv = allocBuffer(k * ts_);
    if (!psend || !precv) return failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
    for (int place = 0; place < 2; ++place) {
      if (place == 1 && !o_.inPlace) continue;
      const bool ip = place == 1;
      row.has[place] = true;
      auto init = [&](bool) {
        if (!ip) std::memset(precv.get(), kSentinelByte, k * ts_);
        withCodec(o_.dtype, [&](auto codec) {
          using C = decltype(codec);
          auto* out = reinterpret_cast<typename C::T*>(ip ? precv.get() : psend.get());
          for (uint64_t i = 0; i < k; ++i) out[i] = C::enc(pattern_.value(rank_, idx[i]));
        });
        return true;
      };
      auto go = [&]() {
        PERF_CHECK(ip ? "scapeMaskAllReducePacked(in place)" : "scapeMaskAllReducePacked",
                   scapeMaskAllReducePacked(ip ? precv.get() : psend.get(), precv.get(), o_.dtype,
                                            o_.op, mask, comm_, nullptr));
        beat();
        return true;
      };
      auto check = [&]() -> int64_t {
        if (inject_ && k > 0) corruptElement(precv.get() + (k / 2) * ts_);
        int64_t w = 0;
        withCodec(o_.dtype, [&](auto codec) {
          using C = decltype(codec);
          const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
          for (uint64_t i = 0; i < k; ++i) w += !C::eq(got[i], pattern_.reduced(idx[i]));
        });
        return w;
      };
      if (!timePlacement(true, place == 0 ? warm : 0, init, go, check, &ns[place], &wrong[place]))
        return false;
    }
  } else if (o_.coll == Coll::kAllReduce) {
    for (int place = 0; place < 2; ++place) {
      if (place == 1 && !o_.inPlace) continue;
      const bool ip = place == 1;
      row.has[place] = true;
      auto init = [&](bool) {
        unsigned char* in = ip ? rb : sb;
        if (!ip) std::memset(rb, kSentinelByte, count * ts_);
        withCodec(o_.dtype, [&](auto codec) {
          using C = decltype(codec);
          auto* out = reinterpret_cast<typename C::T*>(in);
          for (uint64_t j = 0; j < count; ++j) out[j] = C::enc(pattern_.value(rank_, j));
        });
        return true;
      };
      auto go = [&]() {
        PERF_CHECK(ip ? "scapeAllReduce(mask, in place)" : "scapeAllReduce(mask, out of place)",
                   scapeAllReduce(ip ? rb : sb, rb, count, o_.dtype, o_.op, mask, comm_, nullptr));
        beat();
        return true;
      };
      // Masked positions: the reduction; all others untouched (sentinel, or the in-place input).
      auto check = [&]() -> int64_t {
        if (inject_ && count > 0)
          corruptElement(rb + (k > 0 ? (*walk)[k / 2] : count / 2) * ts_);
        int64_t w = 0;
        withCodec(o_.dtype, [&](auto codec) {
          using C = decltype(codec);
          const auto* got = reinterpret_cast<const typename C::T*>(rb);
          size_t p = 0;
          for (uint64_t j = 0; j < count; ++j) {
            bool masked = false;
            while (p < walk->size() && (*walk)[p] < j) ++p;
            if (p < walk->size() && (*walk)[p] == j) masked = true;
            if (masked)
              w += !C::eq(got[j], pattern_.reduced(j));
            else if (ip)
              w += !C::eq(got[j], pattern_.value(rank_, j));
            else
              w += !isSentinel(reinterpret_cast<const unsigned char*>(got + j), ts_);
          }
        });
        return w;
      };
      if (!timePlacement(true, place == 0 ? warm : 0, init, go, check, &ns[place], &wrong[place]))
        return false;
    }
    // The local parts of the dense-in / dense-out form, alone: gather (pack) of the k values from
    // the dense buffer and scatter (unpack) back, as scapeAllReduce does around the exchange.
    Buffer packed = allocBuffer(k * ts_);
    if (!packed) return failMsg("cannot allocate the packed buffer (k = %" PRIu64 ")", k);
    const int reps = std::max(1, std::min(o_.iters, 5));
    std::memset(packed.get(), 0, k * ts_);
    int64_t t[2] = {0, 0};
    for (int r = 0; r < reps; ++r) {
      double t0 = nowSec();
      PERF_CHECK("scapeMaskPack", scapeMaskPack(mask, sb, packed.get(), o_.dtype));
      double t1 = nowSec();
      PERF_CHECK("scapeMaskUnpack", scapeMaskUnpack(mask, packed.get(), rb, o_.dtype));
      double t2 = nowSec();
      t[0] += static_cast<int64_t>((t1 - t0) * 1e9);
      t[1] += static_cast<int64_t>((t2 - t1) * 1e9);
    }
    if (!reduceI64(t, 2, scapeMax, "scapeAllReduce(pack times, int64, max)")) return false;
    row.packUs = static_cast<double>(t[0]) / reps / 1e3;
    row.unpackUs = static_cast<double>(t[1]) / reps / 1e3;
  } else if (o_.coll == Coll::kReduceScatter) {
    const uint64_t mine = kr[static_cast<size_t>(rank_)], myOff = off[static_cast<size_t>(rank_)];
    Buffer psend = allocBuffer(k * ts_), precv = allocBuffer(mine * ts_);
    if (!psend || !precv) return failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
    row.has[0] = true;
    auto init = [&](bool) {
      std::memset(precv.get(), kSentinelByte, mine * ts_);
      withCodec(o_.dtype, [&](auto codec) {
        using C = decltype(codec);
        auto* out = reinterpret_cast<typename C::T*>(psend.get());
        for (uint64_t i = 0; i < k; ++i) out[i] = C::enc(pattern_.value(rank_, idx[i]));
      });
      return true;
    };
    auto go = [&]() {
      PERF_CHECK("scapeMaskReduceScatter",
                 scapeMaskReduceScatter(psend.get(), precv.get(), o_.dtype, o_.op, mask, comm_,
                                        nullptr));
      beat();
      return true;
    };
    auto check = [&]() -> int64_t {
      if (inject_ && mine > 0) corruptElement(precv.get() + (mine / 2) * ts_);
      int64_t w = 0;
      withCodec(o_.dtype, [&](auto codec) {
        using C = decltype(codec);
        const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
        for (uint64_t i = 0; i < mine; ++i) w += !C::eq(got[i], pattern_.reduced(idx[myOff + i]));
      });
      return w;
    };
    if (!timePlacement(true, warm, init, go, check, &ns[0], &wrong[0])) return false;
  } else {  // all-gather
    const uint64_t mine = kr[static_cast<size_t>(rank_)], myOff = off[static_cast<size_t>(rank_)];
    Buffer psend = allocBuffer(mine * ts_), precv = allocBuffer(k * ts_);
    if (!psend || !precv) return failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
    row.has[0] = true;
    auto init = [&](bool) {
      std::memset(precv.get(), kSentinelByte, k * ts_);
      withCodec(o_.dtype, [&](auto codec) {
        using C = decltype(codec);
        auto* out = reinterpret_cast<typename C::T*>(psend.get());
        for (uint64_t i = 0; i < mine; ++i) out[i] = C::enc(pattern_.value(rank_, idx[myOff + i]));
      });
      return true;
    };
    auto go = [&]() {
      PERF_CHECK("scapeMaskAllGather", scapeMaskAllGather(psend.get(), precv.get(), o_.dtype, mask,
                                                          comm_, nullptr));
      beat();
      return true;
    };
    auto check = [&]() -> int64_t {
      if (inject_ && k > 0) corruptElement(precv.get() + (k / 2) * ts_);
      int64_t w = 0;
      withCodec(o_.dtype, [&](auto codec) {
        using C = decltype(codec);
        const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
        for (size_t r = 0; r < P; ++r)
          for (uint64_t i = 0; i < kr[r]; ++i)
            w += !C::eq(got[off[r] + i], pattern_.value(static_cast<int>(r), idx[off[r] + i]));
      });
      return w;
    };
    if (!timePlacement(true, warm, init, go, check, &ns[0], &wrong[0])) return false;
  }
  // A wrong mask is wrong in every placement that ran.
  if (o_.check) {
    for (int place = 0; place < 2; ++place)
      if (row.has[place]) wrong[place] += rank_ == 0 ? maskWrong : 0;
  }
  return finishRow(&row, ns, wrong);
}

int Bench::runMask() {
  const uint64_t maxCount = o_.maxBytes / ts_;
  const uint64_t denseBytes = o_.mode == Mode::kMaskPacked ? 64 : maxCount * ts_;
  if (!allocDense(denseBytes, denseBytes)) return kExitCallFailed;
  for (uint64_t size : sizes())
    for (double d : o_.densities)
      if (!maskRow(size / ts_, d)) return kExitCallFailed;
  return kExitOk;
}

// ---- coo -----------------------------------------------------------------------------------

bool Bench::cooRow(uint64_t count, double density) {
  const CooSelect sel(density);
  std::vector<uint64_t> idx;
  idx.reserve(static_cast<size_t>(density * static_cast<double>(count) * 1.01) + 64);
  for (uint64_t j = 0; j < count; ++j)
    if (sel(rank_, j)) idx.push_back(j);
  const size_t nnz = idx.size();
  Buffer vals = allocBuffer(nnz * ts_);
  if (!vals) return failMsg("cannot allocate %zu values", nnz);
  withCodec(o_.dtype, [&](auto codec) {
    using C = decltype(codec);
    auto* out = reinterpret_cast<typename C::T*>(vals.get());
    for (size_t i = 0; i < nnz; ++i) out[i] = C::enc(pattern_.nonzero(rank_, idx[i]));
  });
  int64_t total = static_cast<int64_t>(nnz);
  if (!reduceI64(&total, 1, scapeSum, "scapeAllReduce(nnz, int64, sum)")) return false;
  const uint64_t capacity = std::min<uint64_t>(count, static_cast<uint64_t>(total));
  Buffer outIdx, outVals, denseOut;
  if (o_.cooDenseOut) {
    denseOut = allocBuffer(count * ts_);
    if (!denseOut) return failMsg("cannot allocate the dense output (%" PRIu64 " elements)", count);
  } else {
    outIdx = allocBuffer(capacity * sizeof(uint64_t));
    outVals = allocBuffer(capacity * ts_);
    if (!outIdx || !outVals)
      return failMsg("cannot allocate the output list (capacity %" PRIu64 ")", capacity);
  }
  size_t outNnz = 0;
  uint64_t sent = 0;
  auto* oi = reinterpret_cast<uint64_t*>(outIdx.get());

  Row row;
  row.mode = Mode::kCoo;
  row.bytes = count * ts_;
  row.count = count;
  row.density = density;
  row.has[0] = true;
  int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
  auto init = [&](bool forCheck) {
    if (!forCheck) return true;
    if (o_.cooDenseOut) {
      std::memset(denseOut.get(), kSentinelByte, count * ts_);
    } else {
      std::memset(outIdx.get(), 0xff, capacity * sizeof(uint64_t));
      std::memset(outVals.get(), kSentinelByte, capacity * ts_);
    }
    return true;
  };
  auto go = [&]() {
    PERF_CHECK("scapeSparseAllReduce",
               scapeSparseAllReduce(idx.data(), vals.get(), nnz, count, o_.dtype, o_.op,
                                    o_.cooAlgo, o_.cooDenseOut ? denseOut.get() : nullptr,
                                    o_.cooDenseOut ? nullptr : oi,
                                    o_.cooDenseOut ? nullptr : outVals.get(), capacity, &outNnz,
                                    &sent, comm_));
    beat();
    return true;
  };
  auto check = [&]() -> int64_t {
    if (inject_) {
      if (o_.cooDenseOut && count > 0) corruptElement(denseOut.get() + (count / 2) * ts_);
      if (!o_.cooDenseOut && outNnz > 0) corruptElement(outVals.get() + (outNnz / 2) * ts_);
    }
    int64_t w = 0;
    withCodec(o_.dtype, [&](auto codec) {
      using C = decltype(codec);
      const auto* dv = reinterpret_cast<const typename C::T*>(
          o_.cooDenseOut ? denseOut.get() : outVals.get());
      size_t p = 0;
      for (uint64_t j = 0; j < count; ++j) {
        bool any = false;
        int64_t sum = 0;
        for (int r = 0; r < nranks_; ++r)
          if (sel(r, j)) {
            any = true;
            sum += pattern_.nonzero(r, j);
          }
        if (o_.op == scapeAvg) sum /= nranks_;
        if (o_.cooDenseOut) {
          w += !C::eq(dv[j], any ? sum : 0);
          continue;
        }
        while (p < outNnz && oi[p] < j) ++w, ++p;  // listed, but no rank brought it
        if (!any) continue;
        if (p < outNnz && oi[p] == j) {
          w += !C::eq(dv[p], sum);
          ++p;
        } else {
          ++w;  // missing from the union
        }
      }
      if (!o_.cooDenseOut) w += static_cast<int64_t>(outNnz - std::min<size_t>(p, outNnz));
    });
    return w;
  };
  if (!timePlacement(true, o_.warmup, init, go, check, &ns[0], &wrong[0])) return false;
  // Bytes on the wire: what the API says this rank sent (the last call), mean over ranks.
  int64_t sums[2] = {static_cast<int64_t>(sent), static_cast<int64_t>(nnz)};
  if (!reduceI64(sums, 2, scapeSum, "scapeAllReduce(bytesSent, int64, sum)")) return false;
  row.wire = static_cast<double>(sums[0]) / nranks_;
  row.k = static_cast<uint64_t>(sums[1] / nranks_);
  row.algBytes = static_cast<double>(sums[1]) / nranks_ * static_cast<double>(8 + ts_);
  return finishRow(&row, ns, wrong);
}

int Bench::runCoo() {
  for (uint64_t size : sizes())
    for (double d : o_.densities)
      if (!cooRow(size / ts_, d)) return kExitCallFailed;
  return kExitOk;
}

// ---- mask sync -----------------------------------------------------------------------------

bool Bench::syncRows(uint64_t count, double density, BusyCompute* compute) {
  std::vector<scapeMaskEncoding_t> encs = o_.encodings;
  if (encs.empty())
    encs = {scapeMaskEncodingBitmap, scapeMaskEncodingIndices, scapeMaskEncodingEliasFano,
            scapeMaskEncodingDeltaVarint, scapeMaskEncodingAuto};
  const int nseg = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(o_.segments), std::max<uint64_t>(count, 1))));
  const std::vector<uint64_t> offs = segmentOffsets(count, nseg);
  // One selection (top-k of this rank's statistic), shared by every encoding's mask. Masks are
  // created one at a time (at density 1 each holds several index arrays of the whole buffer);
  // the first encoding's mask is the one that selected.
  std::vector<uint64_t> idx, own;
  uint64_t k = 0, expectK = 0;
  MaskHolder holder;
  {
    scapeMask_t m = nullptr;
    PERF_CHECK("scapeMaskCreate", scapeMaskCreate(&m, count, nseg, offs.data(), nullptr,
                                                  scapeOwnershipShards, encs[0], comm_));
    holder.masks.push_back(m);
    double selUs = 0, syncUs = 0;
    if (!selectMask(m, count, density, &selUs, &syncUs)) return false;
    uint64_t kr = 0, off = 0;
    PERF_CHECK("scapeMaskGetCount", scapeMaskGetCount(m, &k));
    PERF_CHECK("scapeMaskGetRankCount", scapeMaskGetRankCount(m, rank_, &kr, &off));
    idx.assign(k, 0);
    PERF_CHECK("scapeMaskGetIndices", scapeMaskGetIndices(m, idx.data(), idx.size()));
    if (!expectedMaskK(m, offs, density, &expectK)) return false;
    own.assign(idx.begin() + static_cast<ptrdiff_t>(off),
               idx.begin() + static_cast<ptrdiff_t>(off + kr));
  }
  std::vector<uint64_t> got;

  for (size_t e = 0; e < encs.size(); ++e) {
    if (e > 0) {
      for (scapeMask_t old : holder.masks) scapeMaskDestroy(old);
      holder.masks.clear();
      scapeMask_t fresh = nullptr;
      PERF_CHECK("scapeMaskCreate", scapeMaskCreate(&fresh, count, nseg, offs.data(), nullptr,
                                                    scapeOwnershipShards, encs[e], comm_));
      holder.masks.push_back(fresh);
    }
    scapeMask_t m = holder.masks[0];
    PERF_CHECK("scapeMaskSetNextIndices", scapeMaskSetNextIndices(m, own.data(), own.size()));
    for (int i = 0; i < o_.warmup; ++i) {
      PERF_CHECK("scapeMaskSyncStart (warm-up)", scapeMaskSyncStart(m));
      PERF_CHECK("scapeMaskSyncWait (warm-up)", scapeMaskSyncWait(m));
    }
    // Calibration: T_sync alone (start + wait), median of -n syncs, slowest rank: the length
    // of the compute phases below. Also the CPU the sync costs outside the calling thread.
    std::vector<int64_t> alone, both, idle;
    const double cpu0 = processCpuSec(), self0 = threadCpuSec();
    for (int i = 0; i < o_.iters; ++i) {
      PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
      const double t0 = nowSec();
      PERF_CHECK("scapeMaskSyncStart", scapeMaskSyncStart(m));
      PERF_CHECK("scapeMaskSyncWait", scapeMaskSyncWait(m));
      alone.push_back(static_cast<int64_t>((nowSec() - t0) * 1e9));
      beat();
    }
    const double bgCpu = (processCpuSec() - cpu0) - (threadCpuSec() - self0);
    int64_t tcal = medianI64(alone);
    if (!reduceI64(&tcal, 1, scapeMax, "scapeAllReduce(sync time, int64, max)")) return false;
    scapeMaskSyncInfo_t info{};
    PERF_CHECK("scapeMaskGetSyncInfo", scapeMaskGetSyncInfo(m, &info));
    // The busy phase's work: the chunks that take T_c on this thread alone (each rank its own).
    const double tc = static_cast<double>(tcal) * 1e-9;
    const uint64_t work = compute->calibrate(tc);
    // Then -n rounds of five timings, each after a barrier: the sync alone again; the busy
    // phase alone; the busy phase overlapped (start, the busy work on this thread, wait); the
    // idle phase alone (a wait of T_c: the host thread of a GPU step mostly waits); the idle
    // phase overlapped. Each overlapped time is compared with the same phase alone from the
    // same rounds, so what the phase itself costs on this machine (a sleep that wakes late on
    // a virtual machine, the work's own speed) is not counted against the sync. Interleaved,
    // so drift in the machine's load hits all five alike; medians, so one stalled iteration
    // does not decide the row.
    std::vector<int64_t> busyAlone, idleAlone;
    // The idle phase: the host thread waits T_c for a device. By default it polls the clock
    // with sched_yield (CUDA's cudaDeviceScheduleYield), leaving the core to any other runnable
    // thread. With --idle-wait sleep it sleeps instead; on a VM where an idle vCPU takes its
    // timer interrupts late after a burst of work (perf/RESULTS.md), that mostly measures
    // the VM.
    const bool idleSleep = o_.idleSleep;
    auto idlePhase = [tc, idleSleep](double from) {
      if (!idleSleep) {
        while (nowSec() < from + tc) sched_yield();
        return;
      }
      for (double left = tc; left > 0; left = from + tc - nowSec()) {
        struct timespec ts {};
        ts.tv_sec = static_cast<time_t>(left);
        ts.tv_nsec = static_cast<long>((left - static_cast<double>(ts.tv_sec)) * 1e9);
        nanosleep(&ts, nullptr);
      }
    };
    auto since = [](double t0) { return static_cast<int64_t>((nowSec() - t0) * 1e9); };
    for (int i = 0; i < o_.iters; ++i) {
      PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
      double t0 = nowSec();
      PERF_CHECK("scapeMaskSyncStart", scapeMaskSyncStart(m));
      PERF_CHECK("scapeMaskSyncWait", scapeMaskSyncWait(m));
      alone.push_back(since(t0));
      PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
      t0 = nowSec();
      compute->run(work);
      busyAlone.push_back(since(t0));
      PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
      t0 = nowSec();
      PERF_CHECK("scapeMaskSyncStart", scapeMaskSyncStart(m));
      compute->run(work);
      PERF_CHECK("scapeMaskSyncWait", scapeMaskSyncWait(m));
      both.push_back(since(t0));
      if (o_.syncIdle) {
        PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
        t0 = nowSec();
        idlePhase(t0);
        idleAlone.push_back(since(t0));
        PERF_CHECK("scapeBarrier", scapeBarrier(comm_));
        t0 = nowSec();
        PERF_CHECK("scapeMaskSyncStart", scapeMaskSyncStart(m));
        idlePhase(t0);
        PERF_CHECK("scapeMaskSyncWait", scapeMaskSyncWait(m));
        idle.push_back(since(t0));
      }
      beat();
    }
    // The slowest rank's medians, in one reduction: sync alone, busy alone, busy overlapped,
    // idle alone, idle overlapped (-1: no idle phase).
    int64_t med[5] = {medianI64(alone), medianI64(busyAlone), medianI64(both),
                      o_.syncIdle ? medianI64(idleAlone) : -1, o_.syncIdle ? medianI64(idle) : -1};
    if (!reduceI64(med, 5, scapeMax, "scapeAllReduce(median times, int64, max)")) return false;
    const int64_t tsync = med[0], tboth = med[2], tidle = med[4];
    // The synchronised mask must be the one selected, whatever the encoding.
    int64_t wrong = 0;
    if (o_.check) {
      PERF_CHECK("scapeMaskAdvance", scapeMaskAdvance(m));
      uint64_t k2 = 0;
      PERF_CHECK("scapeMaskGetCount", scapeMaskGetCount(m, &k2));
      got.assign(k2, 0);
      PERF_CHECK("scapeMaskGetIndices", scapeMaskGetIndices(m, got.data(), got.size()));
      if (inject_ && !got.empty()) got[got.size() / 2] ^= 1u;
      for (uint64_t i = 0; i < std::min(k, k2); ++i) wrong += got[i] != idx[i];
      wrong += static_cast<int64_t>(k > k2 ? k - k2 : k2 - k);
      if (rank_ == 0) wrong += static_cast<int64_t>(k > expectK ? k - expectK : expectK - k);
    }
    int64_t sums[4] = {static_cast<int64_t>(info.sentBytes), wrong,
                       rank_ == 0 ? static_cast<int64_t>(info.encoding) : 0,
                       static_cast<int64_t>(std::max(0.0, bgCpu) / o_.iters * 1e9)};
    if (!reduceI64(sums, 4, scapeSum, "scapeAllReduce(sync info, int64, sum)")) return false;
    SyncRow w;
    w.count = count;
    w.density = density;
    w.requested = encs[e];
    w.sent = static_cast<scapeMaskEncoding_t>(sums[2]);
    w.k = k;
    w.sentBytes = static_cast<double>(sums[0]) / nranks_;
    w.totalBytes = info.totalBytes;
    w.syncUs = static_cast<double>(tsync) / 1e3;
    w.libSyncUs = info.syncSeconds * 1e6;
    w.syncCpuUs = static_cast<double>(sums[3]) / nranks_ / 1e3;
    w.bothUs = static_cast<double>(tboth) / 1e3;
    // What the overlapped round takes beyond the same compute phase alone is the part of the
    // sync that was not hidden.
    const double ts = static_cast<double>(tsync), tb = static_cast<double>(tboth);
    auto hiddenFrac = [ts](double overlapped, double phase) {
      return ts > 0 ? std::min(1.0, std::max(0.0, 1.0 - (overlapped - phase) / ts)) : 1.0;
    };
    w.busyAloneUs = static_cast<double>(med[1]) / 1e3;
    w.hidden = hiddenFrac(tb, static_cast<double>(med[1]));
    const double ti = static_cast<double>(tidle);
    w.idleUs = ti / 1e3;
    w.idleAloneUs = static_cast<double>(med[3]) / 1e3;
    w.hiddenIdle = tidle < 0 ? -1.0 : hiddenFrac(ti, static_cast<double>(med[3]));
    w.maskBpp = count ? static_cast<double>(info.totalBytes) / static_cast<double>(count) : 0.0;
    w.totalBpp = w.maskBpp + 8.0 * density;
    w.wrong = sums[1];
    wrongTotal_ += w.wrong;
    syncRows_.push_back(w);
    if (rank_ == 0) printSyncRow(w);
  }
  return true;
}

int Bench::runMaskSync() {
  BusyCompute compute;
  for (uint64_t size : sizes())
    for (double d : o_.densities)
      if (!syncRows(size / ts_, d, &compute)) return kExitCallFailed;
  if (compute.sink() == 12345.678f) std::printf("#\n");  // keep the compute observable
  return kExitOk;
}

// ---- memcpy --------------------------------------------------------------------------------

bool Bench::memcpyRow(uint64_t bytes) {
  unsigned char* src = send_.get();
  unsigned char* dst = recv_.get();
  Row row;
  row.mode = Mode::kMemcpy;
  row.bytes = bytes;
  row.count = bytes / ts_;
  row.k = row.count;
  row.wire = 0;
  row.algBytes = static_cast<double>(bytes);
  row.has[0] = true;
  int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
  auto init = [&](bool) {
    for (uint64_t i = 0; i < bytes; ++i) src[i] = static_cast<unsigned char>(i * 131u + 7u);
    std::memset(dst, 0, bytes);
    return true;
  };
  auto go = [&]() {
    std::memcpy(dst, src, bytes);
    beat();
    return true;
  };
  auto check = [&]() -> int64_t {
    if (inject_ && bytes > 0) corruptElement(dst + bytes / 2);
    int64_t w = 0;
    for (uint64_t i = 0; i < bytes; ++i) w += dst[i] != src[i];
    return w;
  };
  if (!timePlacement(true, o_.warmup, init, go, check, &ns[0], &wrong[0])) return false;
  return finishRow(&row, ns, wrong);
}

int Bench::runMemcpy() {
  if (!allocDense(o_.maxBytes, o_.maxBytes)) return kExitCallFailed;
  for (uint64_t size : sizes())
    if (!memcpyRow(size)) return kExitCallFailed;
  return kExitOk;
}

// ---- reporting -----------------------------------------------------------------------------

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
    if (row->mode == Mode::kMemcpy) row->busBw[k] = row->algBw[k];
    row->wrong[k] = o_.check ? wrong[k] : 0;
    bwSum_ += row->busBw[k];
    ++bwCount_;
    wrongTotal_ += row->wrong[k];
  }
  rows_.push_back(*row);
  if (rank_ == 0) printRow(*row);
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

void Bench::printHeader(const std::vector<int64_t>& pids, const std::vector<std::string>& hosts) {
  int version = 0;
  scapeGetVersion(&version);
  const std::string timeout = o_.timeoutMs == SCAPE_CONFIG_UNDEF_INT
                                  ? std::string("library default")
                                  : std::to_string(o_.timeoutMs) + " ms";
  std::printf("# %s: SCAPE comm %d.%d.%d, collective %s, mode %s, nranks %d, timeout %s\n", kProg,
              version / 10000, version / 100 % 100, version % 100, collName(o_.coll),
              modeName(o_.mode), nranks_, timeout.c_str());
  std::printf("# nRanks %d minBytes %" PRIu64 " maxBytes %" PRIu64 " step: %" PRIu64
              "(factor) warmup iters: %d iters: %d validation: %d\n",
              nranks_, o_.minBytes, o_.maxBytes, o_.stepFactor, o_.warmup, o_.iters, o_.check);
  if (o_.mode != Mode::kDense && o_.mode != Mode::kMemcpy) {
    std::printf("# densities:");
    for (double d : o_.densities) std::printf(" %g", d);
    if (o_.mode == Mode::kMask || o_.mode == Mode::kMaskPacked || o_.mode == Mode::kMaskSync) {
      std::string encs;
      for (scapeMaskEncoding_t e : o_.encodings) encs += std::string(encs.empty() ? "" : ",") + encodingName(e);
      if (encs.empty())
        encs = o_.mode == Mode::kMaskSync ? "bitmap,indices,eliasfano,deltavarint,auto" : "auto";
      std::printf("; segments %d (sizes 1:2:..:%d), shard ownership, encoding %s", o_.segments,
                  o_.segments, encs.c_str());
      if (o_.mode == Mode::kMaskSync && o_.syncIdle)
        std::printf("; idle phase %s", o_.idleSleep ? "sleeps" : "polls with sched_yield");
    }
    if (o_.mode == Mode::kCoo)
      std::printf("; algorithm %s, %s output", cooAlgoName(o_.cooAlgo),
                  o_.cooDenseOut ? "dense" : "list");
    std::printf("\n");
  }
  if (inject_) std::printf("# SCAPE_PERF_INJECT_ERROR: rank 0 corrupts one element of each result\n");
  std::printf("#\n# Using ranks\n");
  for (int r = 0; r < nranks_; ++r)
    std::printf("#  Rank %2d Pid %6" PRId64 " on %10s (host memory)\n", r, pids[r],
                hosts[r].c_str());
  std::printf("#\n");
  if (o_.mode == Mode::kMaskSync)
    printSyncColumns();
  else
    printColumns();
  std::fflush(stdout);
}

void Bench::printColumns() {
  std::printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place"
              "          %11s  %7s  %12s  %12s  %7s  %7s\n",
              "", "", "", "", "", "", "", "", "", "deqbw", "deqbw");
  std::printf("# %10s  %12s  %8s  %6s  %6s", "size", "count", "type", "redop", "root");
  std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
  std::printf("  %7s  %6s  %6s  %6s", "time", "algbw", "busbw", "#wrong");
  std::printf("  %11s  %7s  %12s  %12s  %7s  %7s\n", "mode", "density", "k", "wire", "oop", "ip");
  std::printf("# %10s  %12s  %8s  %6s  %6s", "(B)", "(elements)", "", "", "");
  std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
  std::printf("  %7s  %6s  %6s  %6s", "(us)", "(GB/s)", "(GB/s)", "");
  std::printf("  %11s  %7s  %12s  %12s  %7s  %7s\n", "", "", "(elements)", "(B/rank)", "(GB/s)",
              "(GB/s)");
}

void Bench::printRow(const Row& w) {
  std::printf("%12" PRIu64 "  %12" PRIu64 "  %8s  %6s  %6d", w.bytes, w.count,
              w.mode == Mode::kMemcpy ? "byte" : typeName(o_.dtype),
              hasOp() && w.mode != Mode::kMemcpy ? opName(o_.op) : "none", printedRoot());
  for (int k = 0; k < 2; ++k) {
    if (!w.has[k]) {
      std::printf("  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
      continue;
    }
    char t[32], wr[32];
    formatTime(t, sizeof(t), w.timeUs[k]);
    if (o_.check)
      std::snprintf(wr, sizeof(wr), "%" PRId64, w.wrong[k]);
    else
      std::snprintf(wr, sizeof(wr), "N/A");
    std::printf("  %7s  %6.2f  %6.2f  %6s", t, w.algBw[k], w.busBw[k], wr);
  }
  char ip[32];
  if (w.has[1])
    std::snprintf(ip, sizeof(ip), "%7.2f", w.deqBw[1]);
  else
    std::snprintf(ip, sizeof(ip), "%7s", "N/A");
  std::printf("  %11s  %7.4g  %12" PRIu64 "  %12.0f  %7.2f  %7s\n", modeName(w.mode), w.density, w.k,
              w.wire, w.deqBw[0], ip);
  if (w.mode == Mode::kMask || w.mode == Mode::kMaskPacked) {
    std::printf("#   mask: select %.1f us, sync %.1f us, %" PRIu64
                " mask bytes (%.4f B/param, sent as %s)",
                w.selectUs, w.maskSyncUs, w.maskTotalBytes,
                w.count ? static_cast<double>(w.maskTotalBytes) / static_cast<double>(w.count) : 0.0,
                encodingName(w.sentEncoding));
    if (w.packUs >= 0)
      std::printf("; scapeMaskPack %.1f us, scapeMaskUnpack %.1f us", w.packUs, w.unpackUs);
    std::printf("\n");
  }
  std::fflush(stdout);
}

void Bench::printSyncColumns() {
  std::printf("# %12s  %7s  %11s  %11s  %12s  %12s  %12s  %9s  %10s  %10s  %10s  %6s  %9s  %7s"
              "  %6s  %10s  %10s  %10s  %8s\n",
              "count", "density", "encoding", "sent-as", "k", "sent", "total", "mask", "sync",
              "busy", "overlapped", "hidden", "mask+pay", "dense", "#wrong", "sync-cpu", "idle",
              "idle-ovl", "hid-idle");
  std::printf("# %12s  %7s  %11s  %11s  %12s  %12s  %12s  %9s  %10s  %10s  %10s  %6s  %9s  %7s"
              "  %6s  %10s  %10s  %10s  %8s\n",
              "(elements)", "", "", "(rank 0)", "(elements)", "(B/rank)", "(B)", "(B/param)",
              "(us)", "(us)", "(us)", "", "(B/param)", "(B/param)", "", "(us)", "(us)", "(us)", "");
}

void Bench::printSyncRow(const SyncRow& w) {
  char wr[32], hi[32], ia[32], io[32];
  if (o_.check)
    std::snprintf(wr, sizeof(wr), "%" PRId64, w.wrong);
  else
    std::snprintf(wr, sizeof(wr), "N/A");
  if (w.hiddenIdle >= 0) {
    std::snprintf(hi, sizeof(hi), "%8.3f", w.hiddenIdle);
    std::snprintf(ia, sizeof(ia), "%10.1f", w.idleAloneUs);
    std::snprintf(io, sizeof(io), "%10.1f", w.idleUs);
  } else {
    std::snprintf(hi, sizeof(hi), "%8s", "N/A");
    std::snprintf(ia, sizeof(ia), "%10s", "N/A");
    std::snprintf(io, sizeof(io), "%10s", "N/A");
  }
  std::printf("  %12" PRIu64 "  %7.4g  %11s  %11s  %12" PRIu64 "  %12.0f  %12" PRIu64
              "  %9.4f  %10.1f  %10.1f  %10.1f  %6.3f  %9.4f  %7.1f  %6s  %10.1f  %s  %s  %s\n",
              w.count, w.density, encodingName(w.requested), encodingName(w.sent), w.k,
              w.sentBytes, w.totalBytes, w.maskBpp, w.syncUs, w.busyAloneUs, w.bothUs, w.hidden,
              w.totalBpp, 8.0, wr, w.syncCpuUs, ia, io, hi);
  std::fflush(stdout);
}

void Bench::printFooter() {
  if (o_.check)
    std::printf("# Out of bounds values : %" PRId64 " %s\n", wrongTotal_,
                wrongTotal_ ? "FAILED" : "OK");
  else
    std::printf("# Out of bounds values : N/A (-c 0)\n");
  if (o_.mode == Mode::kMaskSync) {
    double h = 0;
    for (const SyncRow& w : syncRows_) h += w.hidden;
    std::printf("# Avg hidden fraction  : %g \n", syncRows_.empty() ? 0.0 : h / syncRows_.size());
  } else {
    std::printf("# Avg bus bandwidth    : %g \n", bwCount_ ? bwSum_ / bwCount_ : 0.0);
  }
  CpuTicks t1;
  if (haveTicks_ && readCpuTicks(&t1) && t1.total() > ticks0_.total()) {
    const double d = static_cast<double>(t1.total() - ticks0_.total());
    std::printf("# Host CPU during run  : busy %.1f%%, idle %.1f%%, stolen by the hypervisor "
                "%.1f%% (/proc/stat)\n",
                100.0 * static_cast<double>((t1.user + t1.nice + t1.sys + t1.irq + t1.softirq) -
                                            (ticks0_.user + ticks0_.nice + ticks0_.sys +
                                             ticks0_.irq + ticks0_.softirq)) / d,
                100.0 * static_cast<double>((t1.idle + t1.iowait) - (ticks0_.idle + ticks0_.iowait)) / d,
                100.0 * static_cast<double>(t1.steal - ticks0_.steal) / d);
  }
  std::printf("#\n");
  std::fflush(stdout);
}

void Bench::writeJson() {
  if (json_ == nullptr) return;
  std::fprintf(json_, "[\n");
  const size_t total = rows_.size() + syncRows_.size();
  size_t written = 0;
  for (const Row& w : rows_) {
    std::fprintf(json_,
                 "  {\"impl\": \"scape\", \"collective\": \"%s\", \"mode\": \"%s\", \"nranks\": %d, "
                 "\"size\": %" PRIu64 ", \"count\": %" PRIu64
                 ", \"type\": \"%s\", \"redop\": \"%s\", \"root\": %d, \"density\": %.6g, \"k\": "
                 "%" PRIu64 ", \"wire_bytes\": %.0f",
                 collName(o_.coll), modeName(w.mode), nranks_, w.bytes, w.count,
                 w.mode == Mode::kMemcpy ? "byte" : typeName(o_.dtype),
                 hasOp() && w.mode != Mode::kMemcpy ? opName(o_.op) : "none", printedRoot(),
                 w.density, w.k, w.wire);
    if (w.mode == Mode::kMask || w.mode == Mode::kMaskPacked)
      std::fprintf(json_,
                   ", \"encoding\": \"%s\", \"sent_encoding\": \"%s\", \"mask_total_bytes\": %" PRIu64
                   ", \"select_us\": %.1f, \"mask_sync_us\": %.1f",
                   encodingName(o_.encoding), encodingName(w.sentEncoding), w.maskTotalBytes,
                   w.selectUs, w.maskSyncUs);
    if (w.packUs >= 0)
      std::fprintf(json_, ", \"pack_us\": %.1f, \"unpack_us\": %.1f", w.packUs, w.unpackUs);
    if (w.mode == Mode::kCoo)
      std::fprintf(json_, ", \"coo_algo\": \"%s\", \"coo_out\": \"%s\"", cooAlgoName(o_.cooAlgo),
                   o_.cooDenseOut ? "dense" : "list");
    static const char* kPlace[2] = {"out_of_place", "in_place"};
    for (int k = 0; k < 2; ++k) {
      if (!w.has[k]) {
        std::fprintf(json_, ", \"%s\": null", kPlace[k]);
        continue;
      }
      std::fprintf(json_,
                   ", \"%s\": {\"time_us\": %.3f, \"algbw_gbs\": %.4f, \"busbw_gbs\": %.4f, "
                   "\"deq_bw_gbs\": %.4f, ",
                   kPlace[k], w.timeUs[k], w.algBw[k], w.busBw[k], w.deqBw[k]);
      if (o_.check)
        std::fprintf(json_, "\"wrong\": %" PRId64 "}", w.wrong[k]);
      else
        std::fprintf(json_, "\"wrong\": null}");
    }
    std::fprintf(json_, "}%s\n", ++written < total ? "," : "");
  }
  for (const SyncRow& w : syncRows_) {
    char idleUs[32] = "null", hiddenIdle[32] = "null", idleAloneUs[32] = "null";
    if (w.hiddenIdle >= 0) {
      std::snprintf(idleUs, sizeof(idleUs), "%.1f", w.idleUs);
      std::snprintf(idleAloneUs, sizeof(idleAloneUs), "%.1f", w.idleAloneUs);
      std::snprintf(hiddenIdle, sizeof(hiddenIdle), "%.4f", w.hiddenIdle);
    }
    std::fprintf(json_,
                 "  {\"impl\": \"scape\", \"mode\": \"masksync\", \"nranks\": %d, \"count\": %" PRIu64
                 ", \"density\": %.6g, \"encoding\": \"%s\", \"sent_encoding\": \"%s\", \"k\": %" PRIu64
                 ", \"sent_bytes\": %.0f, \"total_bytes\": %" PRIu64
                 ", \"mask_bytes_per_param\": %.6f, \"sync_us\": %.1f, \"lib_sync_us\": %.1f, "
                 "\"busy_alone_us\": %.1f, \"overlapped_us\": %.1f, \"hidden\": %.4f, "
                 "\"sync_cpu_us\": %.1f, \"idle_alone_us\": %s, \"idle_overlapped_us\": %s, "
                 "\"hidden_idle\": %s, \"idle_wait\": \"%s\", "
                 "\"mask_plus_payload_bytes_per_param\": %.6f, \"dense_bytes_per_param\": 8, "
                 "\"wrong\": ",
                 nranks_, w.count, w.density, encodingName(w.requested), encodingName(w.sent), w.k,
                 w.sentBytes, w.totalBytes, w.maskBpp, w.syncUs, w.libSyncUs, w.busyAloneUs,
                 w.bothUs, w.hidden, w.syncCpuUs, idleAloneUs, idleUs, hiddenIdle,
                 o_.idleSleep ? "sleep" : "yield", w.totalBpp);
    if (o_.check)
      std::fprintf(json_, "%" PRId64 "}", w.wrong);
    else
      std::fprintf(json_, "null}");
    std::fprintf(json_, "%s\n", ++written < total ? "," : "");
  }
  std::fprintf(json_, "]\n");
}

int Bench::run() {
  if (o_.coll == Coll::kBroadcast && o_.root >= nranks_) {
    std::fprintf(stderr, "%s: rank %d: -r %d is not a rank (nranks is %d)\n", kProg, rank_, o_.root,
                 nranks_);
    return kExitUsage;
  }
  std::vector<int64_t> pids;
  std::vector<std::string> hosts;
  if (!exchangeRankInfo(&pids, &hosts)) return kExitCallFailed;
  if (rank_ == 0) printHeader(pids, hosts);
  haveTicks_ = readCpuTicks(&ticks0_);
  int code = kExitOk;
  switch (o_.mode) {
    case Mode::kDense:
      code = runDense();
      break;
    case Mode::kMask:
    case Mode::kMaskPacked:
      code = runMask();
      break;
    case Mode::kCoo:
      code = runCoo();
      break;
    case Mode::kMaskSync:
      code = runMaskSync();
      break;
    case Mode::kMemcpy:
      code = runMemcpy();
      break;
  }
  if (rank_ == 0) {
    writeJson();  // whatever was measured, also after a failure
    if (code == kExitOk) printFooter();
  }
  if (code != kExitOk) return code;
  return wrongTotal_ ? kExitWrong : kExitOk;
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

// -np N: the parent forks the ranks (rank 0 creates the unique id) and watches them.
int runForked(const Options& o, FILE* json) {
  const int n = o.localRanks;
  if (o.coll == Coll::kBroadcast && o.root >= n)
    usageError("-r %d is not a rank of -np %d", o.root, n);
  // Local ranks talk over loopback unless the user chose an interface.
  setenv("SCAPE_SOCKET_IFNAME", "lo", 0);

  // Shared with the ranks: the unique id and one heartbeat counter per rank. Rank 0 makes the id
  // after the fork: scapeGetUniqueId starts the rendezvous thread, and a process must not fork
  // while another of its threads may hold a lock (an allocator's, say) that the child then finds
  // held forever (seen as a hang under AddressSanitizer).
  struct IdSlot {
    std::atomic<int> state;  // 0 not yet, 1 ready, 2 rank 0 failed to make it
    scapeUniqueId id;
  };
  const size_t idBytes = (sizeof(IdSlot) + 63) / 64 * 64;
  const size_t shmBytes = idBytes + sizeof(std::atomic<uint64_t>) * n;
  void* shm = mmap(nullptr, shmBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) {
    std::fprintf(stderr, "%s: mmap of the shared page failed: %s\n", kProg, std::strerror(errno));
    return kExitCallFailed;
  }
  auto* slot = new (shm) IdSlot();
  slot->state.store(0);
  auto* beats = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(shm) + idBytes);
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
      scapeUniqueId id;
      if (rank == 0) {
        const scapeResult_t r = scapeGetUniqueId(&slot->id);
        slot->state.store(r == scapeSuccess ? 1 : 2, std::memory_order_release);
        if (r != scapeSuccess) {
          std::fprintf(stderr, "%s: scapeGetUniqueId failed: %s: %s\n", kProg,
                       scapeGetErrorString(r), scapeGetLastError(nullptr));
          finish(kExitCallFailed);
        }
      } else {
        const double deadline = nowSec() + effectiveTimeoutMs(o) / 1000.0;
        while (slot->state.load(std::memory_order_acquire) == 0) {
          if (nowSec() > deadline) {
            std::fprintf(stderr, "%s: rank %d: rank 0 did not publish the unique id in time\n",
                         kProg, rank);
            finish(kExitCallFailed);
          }
          usleep(1000);
        }
        if (slot->state.load(std::memory_order_acquire) != 1) finish(kExitCallFailed);
      }
      std::memcpy(&id, &slot->id, sizeof(id));
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
  munmap(shm, shmBytes);
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
