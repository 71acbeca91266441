// scape-perf: what the mask modes share (mask, mask-packed, masksync): the per-rank random
// statistic, the segment layout, the documented top-k count, and selecting a mask.
#ifndef SCAPE_PERF_SCAPE_PERF_MASK_UTIL_H_
#define SCAPE_PERF_SCAPE_PERF_MASK_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "scape/scape.h"

namespace scape_perf {

class Bench;
struct Options;

// A deterministic hash of (rank, index, salt) (splitmix64's finaliser over a mix of the three).
uint64_t hashRJ(int r, uint64_t j, uint64_t salt);

// Rank r's statistic (the SCAPE candidate |c| stands in) at index j: uniform in [-1, 1).
float statValue(int r, uint64_t j);

// Segment offsets of a flat buffer of n elements cut into `nseg` segments of sizes 1:2:..:nseg
// (uneven on purpose, so that segments and shards do not line up).
std::vector<uint64_t> segmentOffsets(uint64_t n, int nseg);

// --segments, but at most one segment per element (and at least one).
int segmentCount(const Options& o, uint64_t count);

// The documented top-k count of one piece (scapeMaskSelectNextTopk).
uint64_t pieceK(uint64_t len, double density);

// The half-open index ranges `rank` owns, flat: {begin0, end0, begin1, end1, ...}.
bool ownedRanges(Bench& b, scapeMask_t mask, int rank, std::vector<uint64_t>* ranges);

// The mask size the documented selection rule gives: every piece of a segment inside an owned
// part selects max(1, floor(density * length)) positions.
bool expectedMaskK(Bench& b, scapeMask_t mask, const std::vector<uint64_t>& offs, double density,
                   uint64_t* k);

// Selects this rank's part of the next mask by top-k of its random statistic, synchronises it
// and makes it current; the select and sync times in us.
bool selectMask(Bench& b, scapeMask_t mask, uint64_t count, double density, double* selectUs,
                double* syncUs);

// "; segments N (sizes 1:2:..:N), shard ownership, encoding E" of the header's densities line;
// `defaults` is the encoding list shown when --encoding is not given.
void describeMask(const Options& o, const char* defaults, std::string* line);

// Destroys the masks it holds.
struct MaskHolder {
  std::vector<scapeMask_t> masks;
  MaskHolder() = default;
  MaskHolder(const MaskHolder&) = delete;
  MaskHolder& operator=(const MaskHolder&) = delete;
  ~MaskHolder() {
    for (scapeMask_t m : masks) scapeMaskDestroy(m);
  }
};

}  // namespace scape_perf

#endif  // SCAPE_PERF_SCAPE_PERF_MASK_UTIL_H_
