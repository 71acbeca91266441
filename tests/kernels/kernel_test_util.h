// Shared helpers for the kernel tests: seeded random inputs whose seed is printed on failure.
#ifndef SCAPE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define SCAPE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace scape {
namespace kernels {
namespace testing_util {

// A fresh seed per call, unless SCAPE_TEST_SEED pins it (to replay a failure).
inline uint64_t FreshSeed() {
  if (const char* s = std::getenv("SCAPE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Sorted random mask of about density*n indices in [0, n).
template <typename Index>
std::vector<Index> RandomMask(std::mt19937_64& rng, uint64_t n, double density) {
  std::vector<Index> m;
  std::bernoulli_distribution pick(density);
  for (uint64_t i = 0; i < n; ++i) {
    if (pick(rng)) m.push_back(static_cast<Index>(i));
  }
  return m;
}

inline std::vector<float> RandomNormal(std::mt19937_64& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace testing_util
}  // namespace kernels
}  // namespace scape

// Every test body that uses random data starts with this: the seed shows up in every failure.
#define SCAPE_SEEDED_RNG(rng)                                                                    \
  const uint64_t scape_seed_ = ::scape::kernels::testing_util::FreshSeed();                      \
  SCOPED_TRACE(::testing::Message()                                                              \
               << "seed " << scape_seed_ << " (replay: SCAPE_TEST_SEED=" << scape_seed_ << ")"); \
  std::mt19937_64 rng(scape_seed_)

#endif  // SCAPE_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
