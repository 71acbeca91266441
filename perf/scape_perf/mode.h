// scape-perf: one descriptor per --mode (nccl-tests style: each mode is a small table of
// what it is and how it runs; the driver does the rest).
//
// A mode lives in its own file, perf/scape_perf/mode_<name>.cc, which defines
//     const ModeDesc kModeFoo = {"foo", kFooAliases, "what it measures", flags, runFoo,
//                                describeFoo, nullptr, nullptr};
// Add its declaration below and its address to kModes in modes.cc (the order there is the order
// of -h and of the "expected ..." error), and the file to scape-perf's sources in
// perf/CMakeLists.txt. run() measures every row (sizes x densities) through the Bench it gets:
// collective rows go through Bench::timePlacement and Bench::finishRow (the columns and JSON of
// scape-perf -h); a mode with a table of its own prints it (printColumns, then its rows on rank
// 0) and hands each row's JSON object to Bench::addCustomRow.
#ifndef SCAPE_PERF_SCAPE_PERF_MODE_H_
#define SCAPE_PERF_SCAPE_PERF_MODE_H_

#include <cstddef>
#include <string>

namespace scape_perf {

class Bench;
struct Options;

enum ModeFlags : unsigned {
  kModeDensities = 1u << 0,      // -D applies (other modes accept density 1 only)
  kModeMaskOptions = 1u << 1,    // --encoding and --segments apply
  kModeAllReduceOnly = 1u << 2,  // measures its own operation: -t must stay allreduce
  kModeBytes = 1u << 3,          // rows count bytes: type "byte", redop "none", busbw = algbw
};

struct ModeDesc {
  const char* name;            // --mode NAME, the "mode" column and JSON "mode"
  const char* const* aliases;  // other spellings --mode accepts, null-terminated; may be null
  // Its lines under "-m, --mode" in -h ("\n" between lines, no indentation); may be null.
  const char* help;
  unsigned flags;            // ModeFlags
  int (*run)(Bench& bench);  // every row; returns an exit code (0, or 1: a call failed)
  // Appends to the header's "# densities: ..." line (modes with kModeDensities); may be null.
  void (*describe)(const Options& o, std::string* line);
  // Prints the column header of a mode with a table of its own; null: scape-perf's columns.
  void (*printColumns)(const Bench& bench);
  // The footer's summary of a mode with a table of its own: the mean of the values given to
  // Bench::addCustomRow, under this label; null: "Avg bus bandwidth" of the collective rows.
  const char* summaryLabel;
};

extern const ModeDesc kModeDense;       // mode_dense.cc
extern const ModeDesc kModeMask;        // mode_mask.cc
extern const ModeDesc kModeMaskPacked;  // mode_mask.cc
extern const ModeDesc kModeCoo;         // mode_coo.cc
extern const ModeDesc kModeMaskSync;    // mode_masksync.cc
extern const ModeDesc kModeMemcpy;      // mode_memcpy.cc
extern const ModeDesc kModeStep;        // mode_step.cc

// Every mode, in the order of -h (modes.cc).
extern const ModeDesc* const kModes[];
extern const size_t kModeCount;

// The mode named (or aliased) `s`; null if none.
const ModeDesc* findMode(const char* s);

}  // namespace scape_perf

#endif  // SCAPE_PERF_SCAPE_PERF_MODE_H_
