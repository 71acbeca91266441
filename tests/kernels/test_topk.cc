// CPU tests of kernels/cpu/topk.h: exact mode against a sorting reference (as sets with the
// lower-index tie rule), sampled mode against its documented definition and drift bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/topk.h"
#include "kernels/cpu/topk_common.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

using testing_util::RandomNormal;

uint32_t Key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b & 0x7fffffffu;
}

// Reference: sort (key desc, index asc), take k, sort by index. Positions are offsets into x.
std::vector<uint64_t> ReferenceTopk(const std::vector<float>& x, uint64_t begin, uint64_t len,
                                    uint64_t k) {
  std::vector<uint64_t> idx(len);
  std::iota(idx.begin(), idx.end(), begin);
  auto before = [&](uint64_t a, uint64_t b) {
    const uint32_t ka = Key(x[a]), kb = Key(x[b]);
    return ka != kb ? ka > kb : a < b;
  };
  if (k < len) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

enum class Dist { kNormal, kFewValues, kAllEqual, kSpecials, kSkewed };

std::vector<float> MakeData(std::mt19937_64& rng, size_t n, Dist d) {
  std::vector<float> x;
  switch (d) {
    case Dist::kNormal:
      return RandomNormal(rng, n);
    case Dist::kFewValues: {
      // Heavy ties, both signs (|x| ties across signs), +-0.
      const float vals[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f};
      x.resize(n);
      for (auto& v : x) v = vals[rng() % 7];
      return x;
    }
    case Dist::kAllEqual:
      return std::vector<float>(n, -3.25f);
    case Dist::kSpecials: {
      x = RandomNormal(rng, n);
      const float sp[] = {std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(),
                          0.0f,
                          -0.0f,
                          std::numeric_limits<float>::max()};
      for (size_t i = 0; i < n / 50 + 1 && n > 0; ++i) x[rng() % n] = sp[rng() % 7];
      return x;
    }
    case Dist::kSkewed: {
      // Large values concentrated in one region (hard for sampling).
      x = RandomNormal(rng, n, 1e-3f);
      for (size_t i = n / 3; i < n / 3 + n / 200; ++i) x[i] = 10.0f + static_cast<float>(i % 7);
      return x;
    }
  }
  return x;
}

struct Layout {
  std::vector<uint64_t> offsets, k, out_offsets;
};

Layout MakeLayout(const std::vector<uint64_t>& lens, uint64_t base, double density) {
  Layout L;
  L.offsets.push_back(base);
  for (uint64_t l : lens) L.offsets.push_back(L.offsets.back() + l);
  L.k.resize(lens.size());
  EXPECT_EQ(TopkKFromDensity(L.offsets.data(), lens.size(), density, L.k.data()),
            KernelStatus::kOk);
  L.out_offsets.resize(lens.size() + 1);
  TopkOutOffsets(L.k.data(), lens.size(), L.out_offsets.data());
  return L;
}

std::vector<std::vector<uint64_t>> ReferenceAll(const std::vector<float>& x, const Layout& L) {
  std::vector<std::vector<uint64_t>> r;
  for (size_t s = 0; s < L.k.size(); ++s) {
    r.push_back(ReferenceTopk(x, L.offsets[s], L.offsets[s + 1] - L.offsets[s], L.k[s]));
  }
  return r;
}

template <typename Index>
void CheckExact(const std::vector<float>& x, const Layout& L, int threads,
                TopkWorkspace* ws = nullptr,
                const std::vector<std::vector<uint64_t>>* reference = nullptr,
                uint64_t split_min = TopkOptions{}.split_min) {
  const size_t nseg = L.k.size();
  std::vector<std::vector<uint64_t>> own;
  if (reference == nullptr) {
    own = ReferenceAll(x, L);
    reference = &own;
  }
  TopkSegments sg{L.offsets.data(), L.k.data(), L.out_offsets.data(), nseg};
  TopkOptions opt;
  opt.max_threads = threads;
  opt.split_min = split_min;
  std::vector<Index> out(L.out_offsets.back() + 1, static_cast<Index>(0xdeadbeef));
  std::vector<uint64_t> counts(nseg, 12345);
  ASSERT_EQ(TopkAbs(x.data(), sg, opt, out.data(), counts.data(), ws), KernelStatus::kOk);
  for (size_t s = 0; s < nseg; ++s) {
    const uint64_t len = L.offsets[s + 1] - L.offsets[s];
    SCOPED_TRACE(::testing::Message()
                 << "segment " << s << " len " << len << " k " << L.k[s] << " threads " << threads);
    ASSERT_EQ(counts[s], L.k[s]);
    std::vector<uint64_t> got(out.begin() + L.out_offsets[s],
                              out.begin() + L.out_offsets[s] + L.k[s]);
    ASSERT_EQ(got, (*reference)[s]);
  }
  EXPECT_EQ(out.back(), static_cast<Index>(0xdeadbeef)) << "wrote past the last segment";
}

TEST(TopkExact, SmallAndOddSegments) {
  SCAPE_SEEDED_RNG(rng);
  const std::vector<uint64_t> lens = {0, 1, 2, 3, 0, 7, 64, 65, 1000, 1, 4099, 0, 33333};
  for (Dist d : {Dist::kNormal, Dist::kFewValues, Dist::kAllEqual, Dist::kSpecials}) {
    SCOPED_TRACE(::testing::Message() << "dist " << static_cast<int>(d));
    for (double density : {0.0, 0.001, 0.01, 0.1, 0.5, 0.99, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "density " << density);
      Layout L = MakeLayout(lens, 5, density);
      std::vector<float> x = MakeData(rng, L.offsets.back(), d);
      CheckExact<uint32_t>(x, L, 0);
    }
  }
}

TEST(TopkExact, ExplicitKZeroAndFull) {
  SCAPE_SEEDED_RNG(rng);
  const std::vector<uint64_t> lens = {5, 1, 100000, 17, 0, 70000};
  Layout L = MakeLayout(lens, 0, 0.1);
  std::vector<float> x = MakeData(rng, L.offsets.back(), Dist::kNormal);
  L.k = {0, 1, 100000, 0, 0, 3};  // k = 0 and k = len, including a large full segment
  TopkOutOffsets(L.k.data(), L.k.size(), L.out_offsets.data());
  CheckExact<uint64_t>(x, L, 0);
  L.k = {5, 0, 0, 17, 0, 70000};
  TopkOutOffsets(L.k.data(), L.k.size(), L.out_offsets.data());
  CheckExact<uint32_t>(x, L, 2);
}

TEST(TopkExact, MidSizeSegmentsUseTheBracket) {
  // 64 Ki .. 1 Mi: one thread per segment, sampled bracket plus exact resolution.
  SCAPE_SEEDED_RNG(rng);
  const std::vector<uint64_t> lens = {65536, 65537, 100003, 131071};
  TopkWorkspace ws;
  for (Dist d : {Dist::kNormal, Dist::kSkewed, Dist::kFewValues}) {
    for (double density : {0.001, 0.01, 0.25}) {
      SCOPED_TRACE(::testing::Message()
                   << "dist " << static_cast<int>(d) << " density " << density);
      Layout L = MakeLayout(lens, 0, density);
      std::vector<float> x = MakeData(rng, L.offsets.back(), d);
      CheckExact<uint32_t>(x, L, 0, &ws);
    }
  }
}

TEST(TopkExact, LargeSegmentMultiThreaded) {
  // Segments split across threads (split_min lowered to 256 Ki to keep the test small): normal
  // data (bracket hit), heavy ties (bracket miss -> parallel radix select) and NaN/inf. Thread
  // counts 1 and 3 (clamped to the machine's) must agree; so must the default split (each
  // segment whole on one thread, two segments at once).
  SCAPE_SEEDED_RNG(rng);
  const std::vector<uint64_t> lens = {(1u << 19) + 3, 1u << 19};
  TopkWorkspace ws;
  for (Dist d : {Dist::kNormal, Dist::kFewValues, Dist::kSpecials, Dist::kAllEqual}) {
    // 0.3 with kFewValues puts the threshold on a tie value below other keys, so the tie quota
    // must be split correctly between the threads' chunks.
    for (double density : {0.01, 0.3}) {
      SCOPED_TRACE(::testing::Message()
                   << "dist " << static_cast<int>(d) << " density " << density);
      Layout L = MakeLayout(lens, 1, density);
      std::vector<float> x = MakeData(rng, L.offsets.back(), d);
      const auto ref = ReferenceAll(x, L);
      for (int t : {1, 3}) CheckExact<uint32_t>(x, L, t, &ws, &ref, uint64_t{1} << 18);
      CheckExact<uint32_t>(x, L, 0, &ws, &ref);
    }
  }
}

TEST(TopkExact, RejectsBadArguments) {
  std::vector<float> x(100, 1.0f);
  std::vector<uint64_t> off = {0, 50, 100}, k = {10, 60}, oo = {0, 10, 70};
  std::vector<uint32_t> out(70);
  TopkSegments sg{off.data(), k.data(), oo.data(), 2};
  EXPECT_EQ(TopkAbs(x.data(), sg, TopkOptions{}, out.data(), nullptr),
            KernelStatus::kInvalidArgument);  // k > len
  k = {10, 50};
  oo = {0, 10, 40};
  EXPECT_EQ(TopkAbs(x.data(), sg, TopkOptions{}, out.data(), nullptr),
            KernelStatus::kBufferTooSmall);
  oo = {0, 10, 60};
  off = {0, 60, 50};
  EXPECT_EQ(TopkAbs(x.data(), sg, TopkOptions{}, out.data(), nullptr),
            KernelStatus::kInvalidArgument);  // offsets not ascending
  off = {0, 50, 100};
  EXPECT_EQ(TopkAbs(nullptr, sg, TopkOptions{}, out.data(), nullptr),
            KernelStatus::kInvalidArgument);
  TopkOptions so;
  so.mode = TopkMode::kSampled;
  std::vector<uint64_t> counts(2);
  EXPECT_EQ(TopkAbs(x.data(), sg, so, out.data(), nullptr), KernelStatus::kInvalidArgument);
  so.sample_size = 0;
  EXPECT_EQ(TopkAbs(x.data(), sg, so, out.data(), counts.data()), KernelStatus::kInvalidArgument);
  std::vector<uint64_t> kk(2);
  EXPECT_EQ(TopkKFromDensity(off.data(), 2, 1.5, kk.data()), KernelStatus::kInvalidArgument);
  EXPECT_EQ(TopkKFromDensity(off.data(), 2, std::nan(""), kk.data()),
            KernelStatus::kInvalidArgument);
  // uint32 output with positions beyond 2^32 (no data is read: validation comes first).
  std::vector<uint64_t> big = {0, (uint64_t{1} << 32) + 1};
  std::vector<uint64_t> k1 = {1}, o1 = {0, 1};
  TopkSegments bs{big.data(), k1.data(), o1.data(), 1};
  EXPECT_EQ(TopkAbs(x.data(), bs, TopkOptions{}, out.data(), nullptr),
            KernelStatus::kInvalidArgument);
}

TEST(TopkKFromDensity, Rule) {
  std::vector<uint64_t> off = {0, 0, 1, 11, 111, 1111};
  std::vector<uint64_t> k(5);
  ASSERT_EQ(TopkKFromDensity(off.data(), 5, 0.01, k.data()), KernelStatus::kOk);
  EXPECT_EQ(k, (std::vector<uint64_t>{0, 1, 1, 1, 10}));
  ASSERT_EQ(TopkKFromDensity(off.data(), 5, 1.0, k.data()), KernelStatus::kOk);
  EXPECT_EQ(k, (std::vector<uint64_t>{0, 1, 10, 100, 1000}));
  ASSERT_EQ(TopkKFromDensity(off.data(), 5, 0.0, k.data()), KernelStatus::kOk);
  EXPECT_EQ(k, (std::vector<uint64_t>{0, 1, 1, 1, 1}));
}

// ---------------------------------------------------------------------------------------------
// Sampled mode

// The documented definition, computed directly.
std::vector<uint64_t> ReferenceSampled(const std::vector<float>& x, uint64_t begin, uint64_t len,
                                       uint64_t k, uint64_t cap, uint32_t sample_size) {
  std::vector<uint64_t> r;
  if (k == 0 || len == 0) return r;
  if (k >= len) {
    for (uint64_t i = 0; i < std::min(len, cap); ++i) r.push_back(begin + i);
    return r;
  }
  const uint64_t s = std::min<uint64_t>(len, sample_size);
  std::vector<uint32_t> smp(s);
  for (uint64_t j = 0; j < s; ++j) smp[j] = Key(x[begin + topk::SamplePosition(len, s, j)]);
  std::sort(smp.begin(), smp.end(), std::greater<uint32_t>());
  const uint32_t T = smp[topk::SampleRank(k, len, s) - 1];
  uint64_t gt = 0, eq = 0;
  for (uint64_t i = 0; i < len; ++i) {
    gt += Key(x[begin + i]) > T;
    eq += Key(x[begin + i]) == T;
  }
  uint64_t take = topk::TiesTaken(k, gt, eq);
  for (uint64_t i = 0; i < len && r.size() < cap; ++i) {
    const uint32_t key = Key(x[begin + i]);
    if (key > T || (key == T && take > 0)) {
      if (key == T) --take;
      r.push_back(begin + i);
    }
  }
  return r;
}

// The sample positions come from StratumStart (no 64-bit division per sample): it must equal
// floor(len * j / s) exactly over the documented range (len < 2^43, s <= 2^20, j <= s), and
// each position must lie in its stratum.
TEST(TopkSampled, StratumStartIsExact) {
  SCAPE_SEEDED_RNG(rng);
  for (int it = 0; it < 200000; ++it) {
    uint64_t s = 1 + rng() % topk::kMaxSampleSize;
    if (it % 3 == 0) s = 1 + rng() % 64;
    if (it % 7 == 0) s = topk::kMaxSampleSize - rng() % 2;
    const uint64_t span = topk::kMaxSampledPosition - s;
    uint64_t len = s + rng() % (uint64_t{1} << (1 + rng() % 43)) % span;
    if (it % 11 == 0) len = topk::kMaxSampledPosition - 1;
    const uint64_t j = it % 5 == 0 ? s : rng() % (s + 1);
    const uint64_t want = static_cast<uint64_t>(static_cast<unsigned __int128>(len) * j / s);
    ASSERT_EQ(topk::StratumStart(len / s, len % s, s, j), want)
        << "len " << len << " s " << s << " j " << j;
    if (j < s) {
      const uint64_t hi = static_cast<uint64_t>(static_cast<unsigned __int128>(len) * (j + 1) / s);
      const uint64_t p = topk::SamplePosition(len, s, j);
      ASSERT_GE(p, want);
      ASSERT_LT(p, hi);
    }
  }
}

TEST(TopkSampled, MatchesDefinitionAndIsExactForShortSegments) {
  SCAPE_SEEDED_RNG(rng);
  const std::vector<uint64_t> lens = {0, 1, 3, 1000, 4096, 70001, (1u << 19) + 5};
  for (Dist d : {Dist::kNormal, Dist::kFewValues, Dist::kSpecials}) {
    for (uint64_t split : {uint64_t{1} << 18, TopkOptions{}.split_min}) {
      SCOPED_TRACE(::testing::Message() << "dist " << static_cast<int>(d));
      Layout L = MakeLayout(lens, 3, 0.02);
      std::vector<float> x = MakeData(rng, L.offsets.back(), d);
      // Capacity 2k per segment (at least 1).
      std::vector<uint64_t> caps(lens.size());
      for (size_t s = 0; s < lens.size(); ++s) caps[s] = std::max<uint64_t>(1, 2 * L.k[s]);
      TopkOutOffsets(caps.data(), caps.size(), L.out_offsets.data());
      TopkSegments sg{L.offsets.data(), L.k.data(), L.out_offsets.data(), lens.size()};
      TopkOptions opt;
      opt.mode = TopkMode::kSampled;
      opt.sample_size = 4096;
      opt.split_min = split;  // the 512 Ki segment split across threads, or whole
      std::vector<uint32_t> out(L.out_offsets.back());
      std::vector<uint64_t> counts(lens.size());
      ASSERT_EQ(TopkAbs(x.data(), sg, opt, out.data(), counts.data()), KernelStatus::kOk);
      for (size_t s = 0; s < lens.size(); ++s) {
        SCOPED_TRACE(::testing::Message() << "segment " << s);
        std::vector<uint64_t> ref =
            ReferenceSampled(x, L.offsets[s], lens[s], L.k[s], caps[s], opt.sample_size);
        std::vector<uint64_t> got(out.begin() + L.out_offsets[s],
                                  out.begin() + L.out_offsets[s] + counts[s]);
        ASSERT_EQ(got, ref);
        if (lens[s] <= opt.sample_size) {
          EXPECT_EQ(got, ReferenceTopk(x, L.offsets[s], lens[s], L.k[s])) << "must be exact";
        }
      }
    }
  }
}

TEST(TopkSampled, DriftWithinDocumentedBound) {
  SCAPE_SEEDED_RNG(rng);
  const uint64_t len = 1u << 21;
  std::vector<float> x = RandomNormal(rng, len);
  for (double p : {0.01, 0.1}) {
    Layout L = MakeLayout({len}, 0, p);
    std::vector<uint64_t> caps = {len};
    TopkOutOffsets(caps.data(), 1, L.out_offsets.data());
    TopkSegments sg{L.offsets.data(), L.k.data(), L.out_offsets.data(), 1};
    TopkOptions opt;
    opt.mode = TopkMode::kSampled;
    std::vector<uint32_t> out(len);
    uint64_t count = 0;
    ASSERT_EQ(TopkAbs(x.data(), sg, opt, out.data(), &count), KernelStatus::kOk);
    // 5 standard deviations of the documented binomial estimate.
    const double sd = std::sqrt((1 - p) / (p * opt.sample_size));
    const double rel = std::fabs(static_cast<double>(count) / L.k[0] - 1.0);
    EXPECT_LT(rel, 5 * sd) << "p=" << p << " k=" << L.k[0] << " k'=" << count;
    // Threshold property: every selected key >= every unselected key.
    std::vector<char> sel(len, 0);
    for (uint64_t j = 0; j < count; ++j) sel[out[j]] = 1;
    uint32_t min_sel = 0xffffffffu, max_unsel = 0;
    for (uint64_t i = 0; i < len; ++i) {
      if (sel[i])
        min_sel = std::min(min_sel, Key(x[i]));
      else
        max_unsel = std::max(max_unsel, Key(x[i]));
    }
    EXPECT_GE(min_sel, max_unsel);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace scape
