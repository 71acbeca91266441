// Helpers of the optimizer tests over several ranks: an optimizer's checkpoint bytes, and
// whether a buffer is the same on every rank.
#ifndef SCAPE_TESTS_OPTIM_UTIL_H_
#define SCAPE_TESTS_OPTIM_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "scape/scape.h"
#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {

// scapeOptimSave's bytes (failures are test failures).
inline std::vector<uint8_t> Checkpoint(scapeOptim_t opt, scapeComm_t comm) {
  size_t sz = 0, w = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), comm);
  std::vector<uint8_t> b(sz);
  EXPECT_SCAPE_OK(scapeOptimSave(opt, b.data(), b.size(), &w), comm);
  b.resize(w);
  return b;
}

// Every rank's v hashes the same (collective).
inline bool SameOnAllRanks(RankCtx& c, const std::vector<float>& v) {
  std::vector<int64_t> h(static_cast<size_t>(c.nranks));
  int64_t mine = static_cast<int64_t>(HashBytes(v.data(), 4 * v.size()));
  EXPECT_SCAPE_OK(scapeAllGather(&mine, h.data(), 1, scapeInt64, c.comm, nullptr), c.comm);
  for (int64_t x : h)
    if (x != mine) return false;
  return true;
}

}  // namespace scape_test

#endif  // SCAPE_TESTS_OPTIM_UTIL_H_
