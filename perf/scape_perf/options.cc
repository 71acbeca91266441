// scape-perf: the command line.
#include "perf/scape_perf/options.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "perf/scape_perf/mode.h"

namespace scape_perf {
namespace {

// The mode list of -h: "  -m, --mode MODE  dense, mask, ... [dense]" and each mode's lines.
void printModes(FILE* f) {
  std::string names;
  for (size_t i = 0; i < kModeCount; ++i) names += std::string(i ? ", " : "") + kModes[i]->name;
  std::fprintf(f, "  -m, --mode MODE         %s [%s]\n", names.c_str(), kModes[0]->name);
  for (size_t i = 0; i < kModeCount; ++i) {
    const char* h = kModes[i]->help;
    if (h == nullptr) continue;
    std::fprintf(f, "%28s%s: ", "", kModes[i]->name);
    for (bool first = true; *h != '\0'; first = false) {
      const char* nl = std::strchr(h, '\n');
      const size_t len = nl ? static_cast<size_t>(nl - h) : std::strlen(h);
      if (!first) std::fprintf(f, "%34s", "");
      std::fprintf(f, "%.*s\n", static_cast<int>(len), h);
      h += len + (nl ? 1 : 0);
    }
  }
}

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
      "  -d, --datatype TYPE     float, half, bfloat16, int32, int64, f8e4m3, f8e5m2 [float]\n"
      "  -o, --op OP             sum, avg, max, min [sum]\n"
      "  -t, --coll COLL         allreduce, reducescatter, allgather, broadcast [allreduce]\n"
      "  -r, --root N            broadcast root [0]\n"
      "  -I, --inplace 0|1       also time the in-place form (dense; mask all-reduce) [1]\n",
      kProg);
  printModes(f);
  std::fprintf(
      f,
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
      kDefaultTimeoutMs, kDefaultWatchdogS);
}

scapeDataType_t parseType(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects a datatype", opt);
  std::string v(s);
  if (v == "float" || v == "float32" || v == "fp32" || v == "f32") return scapeFloat32;
  if (v == "half" || v == "float16" || v == "fp16" || v == "f16") return scapeFloat16;
  if (v == "bfloat16" || v == "bf16") return scapeBfloat16;
  if (v == "int32" || v == "int") return scapeInt32;
  if (v == "int64") return scapeInt64;
  if (v == "f8e4m3" || v == "e4m3" || v == "float8_e4m3fn") return scapeFloat8E4M3;
  if (v == "f8e5m2" || v == "e5m2" || v == "float8_e5m2") return scapeFloat8E5M2;
  usageError(
      "%s: unknown datatype '%s' (expected float, half, bfloat16, int32, int64, f8e4m3 or "
      "f8e5m2)",
      opt, s);
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

const ModeDesc* parseMode(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects a mode", opt);
  if (const ModeDesc* m = findMode(s)) return m;
  std::string expected;
  for (size_t i = 0; i < kModeCount; ++i)
    expected += std::string(i == 0 ? "" : i + 1 == kModeCount ? " or " : ", ") + kModes[i]->name;
  usageError("%s: unknown mode '%s' (expected %s)", opt, s, expected.c_str());
}

scapeMaskEncoding_t parseEncoding(const char* opt, const char* s) {
  if (s == nullptr) usageError("%s expects an encoding", opt);
  std::string v(s);
  if (v == "auto") return scapeMaskEncodingAuto;
  if (v == "bitmap") return scapeMaskEncodingBitmap;
  if (v == "indices" || v == "idx32") return scapeMaskEncodingIndices;
  if (v == "eliasfano" || v == "elias-fano" || v == "ef") return scapeMaskEncodingEliasFano;
  if (v == "deltavarint" || v == "delta-varint" || v == "varint")
    return scapeMaskEncodingDeltaVarint;
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

// What parsing collects besides Options.
struct ParseState {
  Options o;
  perf_sweep sweep;
  bool sawMode = false;
};

void setMode(ParseState* st, const ModeDesc* m, const char* opt, const char* val) {
  if (st->sawMode && m != st->o.mode) {
    if (val != nullptr)
      usageError("%s %s conflicts with an earlier --mode %s / --mask-sync", opt, val,
                 st->o.mode->name);
    usageError("--mask-sync conflicts with --mode %s", st->o.mode->name);
  }
  st->o.mode = m;
  st->sawMode = true;
}

void parseEncodings(Options* o, const char* opt, const char* val) {
  o->encodings.clear();
  if (val == nullptr || *val == '\0') usageError("%s expects an encoding", opt);
  for (const char* p = val;;) {
    const char* comma = std::strchr(p, ',');
    const std::string item = comma ? std::string(p, static_cast<size_t>(comma - p)) : p;
    o->encodings.push_back(parseEncoding(opt, item.c_str()));
    if (!comma) break;
    p = comma + 1;
  }
  o->encoding = o->encodings.front();
  o->encodingSet = true;
}

// The options of one mode family (coo, masksync) with a word for a value.
void parseWordOption(Options* o, int key, const char* on, const char* val) {
  const std::string v = val ? val : "";
  if (key == 'O') {
    if (val == nullptr) usageError("%s expects list or dense", on);
    if (v == "list")
      o->cooDenseOut = false;
    else if (v == "dense")
      o->cooDenseOut = true;
    else
      usageError("%s: unknown output '%s' (expected list or dense)", on, val);
    o->cooOutSet = true;
  } else {  // 'Z': --idle-wait
    if (v == "yield")
      o->idleSleep = false;
    else if (v == "sleep")
      o->idleSleep = true;
    else
      usageError("%s: unknown wait '%s' (expected yield or sleep)", on, val);
    o->idleWaitSet = true;
  }
}

void onOption(void* ctx, int key, const char* on, const char* val) {
  auto* st = static_cast<ParseState*>(ctx);
  Options& o = st->o;
  if (perf_sweep_opt(&st->sweep, key, on, val)) return;
  switch (key) {
    case 'N':
      o.localRanks = perf_parse_int(on, val, 1, kMaxLocalRanks, "a rank count 1..1024");
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
      o.root = perf_parse_int(on, val, 0, 1 << 30, "a root rank >= 0");
      break;
    case 'T':
      o.timeoutMs = perf_parse_int(on, val, 1, 1 << 30, "a timeout in ms >= 1");
      break;
    case 'W':
      o.watchdogS = perf_parse_int(on, val, 1, 1 << 30, "a watchdog limit in seconds >= 1");
      break;
    case 'J':
      if (val == nullptr || *val == '\0') usageError("%s expects a file name", on);
      o.jsonPath = val;
      break;
    case 'm':
      setMode(st, parseMode(on, val), on, val);
      break;
    case 'S':
      setMode(st, &kModeMaskSync, on, nullptr);
      break;
    case 'D':
      o.densities = parseDensities(on, val);
      o.densitySet = true;
      break;
    case 's':
      o.segments = perf_parse_int(on, val, 1, 1 << 20, "a segment count 1..1048576");
      o.segmentsSet = true;
      break;
    case 'E':
      parseEncodings(&o, on, val);
      break;
    case 'A':
      o.cooAlgo = parseCooAlgo(on, val);
      o.cooAlgoSet = true;
      break;
    case 'O':
    case 'Z':
      parseWordOption(&o, key, on, val);
      break;
    case 'Y':
      o.syncIdle = perf_parse_int(on, val, 0, 1, "0 or 1");
      o.syncIdleSet = true;
      break;
    case 'h':
      usage(stdout);
      std::exit(PERF_EXIT_OK);
    default:
      usageError("internal: unhandled option '%s'", on);
  }
}

// Flags that belong to one mode.
void checkModeFlags(const Options& o) {
  const char* mn = o.mode->name;
  const unsigned fl = o.mode->flags;
  if (!(fl & kModeDensities)) {
    for (double d : o.densities)
      if (d != 1.0)
        usageError(
            "--density %g: --mode %s moves every element; densities apply to --mode "
            "mask, coo and masksync",
            d, mn);
  }
  if (o.cooAlgoSet && o.mode != &kModeCoo)
    usageError("--coo-algo applies to --mode coo only (this run is --mode %s)", mn);
  if (o.cooOutSet && o.mode != &kModeCoo)
    usageError("--coo-out applies to --mode coo only (this run is --mode %s)", mn);
  const bool maskLike = (fl & kModeMaskOptions) != 0;
  if (o.encodingSet && !maskLike)
    usageError("--encoding applies to the mask modes only (this run is --mode %s)", mn);
  const bool sync = o.mode == &kModeMaskSync;
  if (o.syncIdleSet && !sync)
    usageError("--sync-idle applies to --mode masksync only (this run is --mode %s)", mn);
  if (o.idleWaitSet && !sync)
    usageError("--idle-wait applies to --mode masksync only (this run is --mode %s)", mn);
  if (o.idleWaitSet && o.syncIdle == 0) usageError("--idle-wait has no effect with --sync-idle 0");
  if (o.encodings.size() > 1 && !sync)
    usageError("--encoding: a list of encodings applies to --mode masksync only");
  if (o.segmentsSet && !maskLike)
    usageError("--segments applies to the mask modes only (this run is --mode %s)", mn);
  if (o.mode == &kModeMask && o.coll == Coll::kBroadcast)
    usageError("--mode mask supports -t allreduce, reducescatter and allgather, not broadcast");
  if ((fl & kModeAllReduceOnly) && o.coll != Coll::kAllReduce)
    usageError("--mode %s measures its own operation; -t %s does not apply", mn, collName(o.coll));
  if (o.mode == &kModeCoo) {
    if (o.dtype == scapeInt32 || o.dtype == scapeInt64)
      usageError("--mode coo: scapeSparseAllReduce takes a floating-point type, not %s",
                 typeName(o.dtype));
    if (o.op != scapeSum && o.op != scapeAvg)
      usageError("--mode coo: scapeSparseAllReduce takes -o sum or avg, not %s", opName(o.op));
  }
}

}  // namespace

Options parseArgs(int argc, char** argv) {
  static const perf_opt_spec kSpecs[] = {
      {"-np", "--nranks", 'N', 1},  // before "-n" so "-np4" is not "-n p4"
      PERF_SWEEP_OPT_SPECS,         {"-d", "--datatype", 'd', 1}, {"-o", "--op", 'o', 1},
      {"-t", "--coll", 't', 1},     {"-r", "--root", 'r', 1},     {"-T", "--timeout", 'T', 1},
      {"-W", "--watchdog", 'W', 1}, {"-J", "--json", 'J', 1},     {"-h", "--help", 'h', 0},
      {"-m", "--mode", 'm', 1},     {"-D", "--density", 'D', 1},  {"", "--mask-sync", 'S', 0},
      {"", "--segments", 's', 1},   {"", "--encoding", 'E', 1},   {"", "--coo-algo", 'A', 1},
      {"", "--coo-out", 'O', 1},    {"", "--sync-idle", 'Y', 1},  {"", "--idle-wait", 'Z', 1},
  };
  perf_set_prog(kProg);
  ParseState st;
  st.o.mode = kModes[0];
  perf_sweep_init(&st.sweep);
  perf_parse_opts(argc, argv, kSpecs, sizeof(kSpecs) / sizeof(kSpecs[0]), onOption, &st);
  perf_sweep_finish(&st.sweep, 1);
  Options& o = st.o;
  o.minBytes = st.sweep.min_bytes;
  o.maxBytes = st.sweep.max_bytes;
  o.stepFactor = st.sweep.step_factor;
  o.iters = st.sweep.iters;
  o.warmup = st.sweep.warmup;
  o.check = st.sweep.check;
  o.inPlace = st.sweep.in_place;
  checkModeFlags(o);
  return o;
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
    case scapeFloat8E4M3:
      return "f8e4m3";
    case scapeFloat8E5M2:
      return "f8e5m2";
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

}  // namespace scape_perf
