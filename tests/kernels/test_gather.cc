// CPU tests of kernels/cpu/gather.h: every element size (including one the fast paths do not
// cover), k = 0, k shorter and longer than the scatter's prefetch distance, unsorted indices,
// and untouched positions left alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/gather.h"

namespace {

using scape::kernels::GatherByIndex;
using scape::kernels::ScatterByIndex;

std::vector<uint64_t> RandomIndices(std::mt19937_64& rng, uint64_t n, size_t k, bool sorted) {
  std::vector<uint64_t> all(n);
  for (uint64_t i = 0; i < n; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(k);
  if (sorted) std::sort(all.begin(), all.end());
  return all;
}

TEST(Gather, RoundTripsEveryElementSize) {
  std::mt19937_64 rng(std::random_device{}());
  for (size_t esz : {1, 2, 3, 4, 8, 12}) {
    for (size_t k : {0, 1, 31, 32, 33, 1000}) {
      for (bool sorted : {true, false}) {
        const uint64_t n = 2 * k + 7;
        std::vector<uint64_t> idx = RandomIndices(rng, n, k, sorted);
        std::vector<uint8_t> dense(n * esz);
        for (auto& b : dense) b = static_cast<uint8_t>(rng());
        std::vector<uint8_t> packed(k * esz + 1, 0xee);
        GatherByIndex(dense.data(), idx.data(), k, esz, packed.data());
        for (size_t i = 0; i < k; ++i)
          ASSERT_EQ(std::memcmp(packed.data() + i * esz, dense.data() + idx[i] * esz, esz), 0)
              << "gather esz " << esz << " k " << k << " i " << i;
        EXPECT_EQ(packed[k * esz], 0xee) << "gather wrote past k elements";

        // Scatter new values; every position not in idx keeps its old bytes.
        std::vector<uint8_t> fresh(k * esz);
        for (auto& b : fresh) b = static_cast<uint8_t>(rng());
        std::vector<uint8_t> out = dense, want = dense;
        for (size_t i = 0; i < k; ++i)
          std::memcpy(want.data() + idx[i] * esz, fresh.data() + i * esz, esz);
        ScatterByIndex(fresh.data(), idx.data(), k, esz, out.data());
        EXPECT_EQ(out, want) << "scatter esz " << esz << " k " << k << " sorted " << sorted;
      }
    }
  }
}

}  // namespace
