// scape-perf: what the mask modes share (see mask_util.h).
#include "perf/scape_perf/mask_util.h"

#include <algorithm>
#include <cmath>

#include "perf/scape_perf/bench.h"

namespace scape_perf {
namespace {

constexpr uint64_t kStatSalt = 0x5ca9e57a7u;

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t hashRJ(int r, uint64_t j, uint64_t salt) {
  return mix64(j * 0x9e3779b97f4a7c15ull + (static_cast<uint64_t>(r) + 1u) * 0xd1b54a32d192ed03ull +
               salt);
}

float statValue(int r, uint64_t j) {
  return static_cast<float>(static_cast<int32_t>(hashRJ(r, j, kStatSalt) >> 32)) *
         (1.0f / 2147483648.0f);
}

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

int segmentCount(const Options& o, uint64_t count) {
  return static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(o.segments), std::max<uint64_t>(count, 1))));
}

uint64_t pieceK(uint64_t len, double density) {
  if (len == 0) return 0;
  uint64_t k = static_cast<uint64_t>(std::floor(density * static_cast<double>(len)));
  return std::max<uint64_t>(1, std::min(k, len));
}

bool ownedRanges(Bench& b, scapeMask_t mask, int rank, std::vector<uint64_t>* ranges) {
  size_t n = 0;
  PERF_CHECK(b, "scapeMaskGetOwnedRanges", scapeMaskGetOwnedRanges(mask, rank, nullptr, 0, &n));
  ranges->assign(2 * n, 0);
  size_t got = 0;
  if (n > 0)
    PERF_CHECK(b, "scapeMaskGetOwnedRanges",
               scapeMaskGetOwnedRanges(mask, rank, ranges->data(), n, &got));
  return true;
}

bool expectedMaskK(Bench& b, scapeMask_t mask, const std::vector<uint64_t>& offs, double density,
                   uint64_t* k) {
  *k = 0;
  std::vector<uint64_t> ranges;
  for (int r = 0; r < b.nranks(); ++r) {
    if (!ownedRanges(b, mask, r, &ranges)) return false;
    for (size_t i = 0; i + 1 < ranges.size(); i += 2)
      for (size_t s = 0; s + 1 < offs.size(); ++s) {
        const uint64_t lo = std::max(ranges[i], offs[s]), hi = std::min(ranges[i + 1], offs[s + 1]);
        if (lo < hi) *k += pieceK(hi - lo, density);
      }
  }
  return true;
}

bool selectMask(Bench& b, scapeMask_t mask, uint64_t count, double density, double* selectUs,
                double* syncUs) {
  std::vector<float>& stat = b.statScratch();
  if (stat.size() < count) stat.resize(count);  // only the owned part is written and read
  std::vector<uint64_t> ranges;
  if (!ownedRanges(b, mask, b.rank(), &ranges)) return false;
  for (size_t i = 0; i + 1 < ranges.size(); i += 2)
    for (uint64_t j = ranges[i]; j < ranges[i + 1]; ++j) stat[j] = statValue(b.rank(), j);
  const double t0 = nowSec();
  PERF_CHECK(b, "scapeMaskSelectNextTopk", scapeMaskSelectNextTopk(mask, stat.data(), density));
  const double t1 = nowSec();
  PERF_CHECK(b, "scapeMaskSyncStart", scapeMaskSyncStart(mask));
  PERF_CHECK(b, "scapeMaskSyncWait", scapeMaskSyncWait(mask));
  const double t2 = nowSec();
  PERF_CHECK(b, "scapeMaskAdvance", scapeMaskAdvance(mask));
  beat();
  *selectUs = (t1 - t0) * 1e6;
  *syncUs = (t2 - t1) * 1e6;
  return true;
}

void describeMask(const Options& o, const char* defaults, std::string* line) {
  std::string encs;
  for (scapeMaskEncoding_t e : o.encodings)
    encs += std::string(encs.empty() ? "" : ",") + encodingName(e);
  if (encs.empty()) encs = defaults;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "; segments %d (sizes 1:2:..:%d), shard ownership, encoding ",
                o.segments, o.segments);
  *line += buf + encs;
}

}  // namespace scape_perf
