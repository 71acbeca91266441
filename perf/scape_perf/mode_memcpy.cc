// scape-perf --mode memcpy: memcpy bandwidth of one rank (the memory-copy limit that
// perf/compare_all.sh puts beside the collectives).
#include <cstring>

#include "perf/scape_perf/bench.h"

namespace scape_perf {
namespace {

bool memcpyRow(Bench& b, uint64_t bytes) {
  unsigned char* src = b.send();
  unsigned char* dst = b.recv();
  Row row;
  row.mode = &kModeMemcpy;
  row.bytes = bytes;
  row.count = bytes / b.typeSize();
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
    if (b.inject() && bytes > 0) corruptElement(dst + bytes / 2);
    int64_t w = 0;
    for (uint64_t i = 0; i < bytes; ++i) w += dst[i] != src[i];
    return w;
  };
  if (!b.timePlacement(true, b.opts().warmup, init, go, check, &ns[0], &wrong[0])) return false;
  return b.finishRow(&row, ns, wrong);
}

int runMemcpy(Bench& b) {
  if (!b.allocDense(b.opts().maxBytes, b.opts().maxBytes)) return PERF_EXIT_CALL_FAILED;
  for (uint64_t size : b.sizes())
    if (!memcpyRow(b, size)) return PERF_EXIT_CALL_FAILED;
  return PERF_EXIT_OK;
}

}  // namespace

const ModeDesc kModeMemcpy = {
    "memcpy",
    nullptr,
    "memcpy bandwidth of each rank",
    kModeAllReduceOnly | kModeBytes,
    runMemcpy,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace scape_perf
