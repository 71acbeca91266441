// scape-perf: the command line (scape-perf -h documents it).
#ifndef SCAPE_PERF_SCAPE_PERF_OPTIONS_H_
#define SCAPE_PERF_SCAPE_PERF_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "perf/common/perf_common.h"
#include "scape/scape.h"

namespace scape_perf {

struct ModeDesc;

constexpr const char* kProg = "scape-perf";
constexpr int kMaxLocalRanks = 1024;
constexpr int kDefaultTimeoutMs = 120000;  // the library's documented default
constexpr int kDefaultWatchdogS = 1800;

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

struct Options {
  uint64_t minBytes = 32ull << 20;
  uint64_t maxBytes = 32ull << 20;
  uint64_t stepFactor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  int inPlace = 1;
  scapeDataType_t dtype = scapeFloat32;
  scapeRedOp_t op = scapeSum;
  Coll coll = Coll::kAllReduce;
  int root = 0;
  int localRanks = 0;  // -np; 0: not forking
  int timeoutMs = SCAPE_CONFIG_UNDEF_INT;
  int watchdogS = kDefaultWatchdogS;
  std::string jsonPath;
  const ModeDesc* mode = nullptr;  // --mode (never null after parseArgs)
  // Sparse modes.
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
  bool syncIdleSet = false;
  bool idleSleep = false;  // masksync: the idle phase sleeps (else it polls with sched_yield)
  bool idleWaitSet = false;
};

// Parses and checks the command line; a usage error exits with status 64 (-h: 0).
Options parseArgs(int argc, char** argv);

const char* typeName(scapeDataType_t t);
const char* opName(scapeRedOp_t op);
const char* collName(Coll c);
const char* encodingName(scapeMaskEncoding_t e);
const char* cooAlgoName(scapeSparseAlgo_t a);

// Usage errors name the program and point at -h (perf/common).
#define usageError perf_usage_error

}  // namespace scape_perf

#endif  // SCAPE_PERF_SCAPE_PERF_OPTIONS_H_
