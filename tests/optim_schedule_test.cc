// The density schedule (scapeOptimConfig_t.densitySchedule, warmupSteps; issue 42) over real
// UCX on loopback: the density of every step against an independent reference (long double,
// written from the formulas of scape.h, not from the library's code) on odd ramp lengths and
// both shapes, and the mask each step selects has that density's size; 0- and 1-step ramps
// are the same run; the default is today's geometric ramp bit for bit; a run resumed from a
// checkpoint in the middle of a ramp keeps its shape and ends with the uninterrupted bits;
// version-5 checkpoints load with the geometric shape; scapeOptimScheduleForBudget gives the
// longest ramp within an average density; bad arguments are refused with the field's name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/checkpoint_util.h"
#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

// Odd sizes, an empty segment, a 1-element segment and an always-dense segment.
const std::vector<uint64_t> kOffs{0, 0, 1, 700, 713, 2000, 3001, 3011};
const std::vector<uint8_t> kDense{0, 0, 0, 1, 0, 0, 0};
constexpr uint64_t kN = 3011;

scapeOptimConfig_t Config(int schedule, int64_t warmup, double density = 0.03,
                          int ownership = scapeOptimReplicated) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = kN;
  c.nsegments = static_cast<int>(kOffs.size() - 1);
  c.segOffsets = kOffs.data();
  c.denseFlags = kDense.data();
  c.ownership = ownership;
  c.lr = 1e-2f;
  c.maxGradNorm = 5.0f;
  c.density = density;
  c.warmupSteps = warmup;
  c.densitySchedule = schedule;
  return c;
}

// rho(t) from scape.h's definitions, in long double.
long double Reference(int schedule, long double rho, int64_t w, int64_t t) {
  if (t == 0) return 1.0L;
  if (t >= w) return rho;
  const long double x = static_cast<long double>(t) / static_cast<long double>(w);
  if (schedule == scapeDensityLinear) return 1.0L + (rho - 1.0L) * x;
  return std::exp(x * std::log(rho));
}

// The mask a density selects, with segment ownership on one rank: every sparse segment keeps
// max(1, floor(rho * len)) positions, always-dense ones all.
uint64_t MaskSize(double rho) {
  uint64_t k = 0;
  for (size_t s = 0; s + 1 < kOffs.size(); ++s) {
    const uint64_t len = kOffs[s + 1] - kOffs[s];
    if (!len) continue;
    if (kDense[s] || rho >= 1.0) {
      k += len;
      continue;
    }
    k += std::max<uint64_t>(1, static_cast<uint64_t>(std::floor(rho * static_cast<double>(len))));
  }
  return k;
}

std::vector<float> Grads(unsigned seed, int rank, int step) {
  std::vector<float> g(kN);
  for (uint64_t i = 0; i < kN; ++i)
    g[i] = 0.1f * static_cast<float>(InputValue(scapeFloat32, seed + 7919u * step, rank, i));
  return g;
}

std::vector<float> Theta0(unsigned seed) {
  std::vector<float> t(kN);
  for (uint64_t i = 0; i < kN; ++i)
    t[i] = static_cast<float>(InputValue(scapeFloat32, seed ^ 0x5151u, 0, i));
  return t;
}

std::vector<uint8_t> Save(scapeOptim_t opt, scapeComm_t comm) {
  size_t sz = 0, w = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), comm);
  std::vector<uint8_t> buf(sz);
  EXPECT_SCAPE_OK(scapeOptimSave(opt, buf.data(), buf.size(), &w), comm);
  return buf;
}

// Runs `steps` steps from theta and returns the final parameters.
std::vector<float> RunSteps(RankCtx& c, const scapeOptimConfig_t& cfg, unsigned seed, int steps) {
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfg, c.comm), c.comm);
  std::vector<float> t = Theta0(seed);
  if (!o) return t;
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> g = Grads(seed, c.rank, s);
    EXPECT_SCAPE_OK(scapeOptimStep(o, t.data(), g.data(), kN), c.comm);
  }
  EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
  return t;
}

TEST(Schedule, DefaultIsGeometric) {
  scapeOptimConfig_t c;
  ASSERT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  EXPECT_EQ(c.densitySchedule, scapeDensityGeometric);
  EXPECT_EQ(c.warmupSteps, 0);
}

// Every step's density (scapeOptimGetInfo) against the reference, and the mask it selected.
TEST(Schedule, DensityPerStepMatchesTheReference) {
  const unsigned seed = FreshSeed() + 4242u;
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    for (int sch : {scapeDensityGeometric, scapeDensityLinear})
      for (int64_t w : {0, 1, 2, 7, 13}) {
        const double rho = 0.03;
        scapeOptimConfig_t cfg = Config(sch, w, rho);
        scapeOptim_t o = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfg, c.comm), c.comm);
        if (!o) return false;
        std::vector<float> t = Theta0(seed);
        for (int s = 0; s < 18; ++s) {
          scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
          EXPECT_SCAPE_OK(scapeOptimGetInfo(o, &info), c.comm);
          EXPECT_EQ(info.step, s);
          const long double want = Reference(sch, rho, w, s);
          EXPECT_NEAR(static_cast<double>(info.nextDensity), static_cast<double>(want),
                      1e-14 * static_cast<double>(want))
              << "shape " << sch << " W " << w << " step " << s;
          if (s > 0) {  // the mask the last step used was selected at rho(s - 1)
            EXPECT_NEAR(info.density, static_cast<double>(Reference(sch, rho, w, s - 1)), 1e-14);
            EXPECT_EQ(info.maskCount, MaskSize(info.density))
                << "shape " << sch << " W " << w << " step " << s;
          }
          const std::vector<float> g = Grads(seed, c.rank, s);
          EXPECT_SCAPE_OK(scapeOptimStep(o, t.data(), g.data(), kN), c.comm);
        }
        EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
      }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// W = 0 and W = 1 are one schedule (step 0 is dense either way), in both shapes; a ramp that
// is not trivial changes the run, and the shapes differ.
TEST(Schedule, ZeroAndOneStepRampsAreTheSameRun) {
  const unsigned seed = FreshSeed() + 77u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    const int kSteps = 12;
    std::vector<float> g0 = RunSteps(c, Config(scapeDensityGeometric, 0), seed, kSteps);
    std::vector<float> g1 = RunSteps(c, Config(scapeDensityGeometric, 1), seed, kSteps);
    std::vector<float> l0 = RunSteps(c, Config(scapeDensityLinear, 0), seed, kSteps);
    std::vector<float> l1 = RunSteps(c, Config(scapeDensityLinear, 1), seed, kSteps);
    EXPECT_EQ(std::memcmp(g0.data(), g1.data(), 4 * kN), 0);
    EXPECT_EQ(std::memcmp(g0.data(), l0.data(), 4 * kN), 0);
    EXPECT_EQ(std::memcmp(g0.data(), l1.data(), 4 * kN), 0);
    std::vector<float> g9 = RunSteps(c, Config(scapeDensityGeometric, 9), seed, kSteps);
    std::vector<float> l9 = RunSteps(c, Config(scapeDensityLinear, 9), seed, kSteps);
    EXPECT_NE(std::memcmp(g0.data(), g9.data(), 4 * kN), 0);
    EXPECT_NE(std::memcmp(g9.data(), l9.data(), 4 * kN), 0);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Saved at step 7 of a 20-step linear ramp, loaded by an optimizer made with the geometric
// shape and another length: the checkpoint's schedule wins, and step 30 has the bits of the
// uninterrupted run (replicated and sharded).
TEST(Schedule, ResumeMidRampIsBitIdentical) {
  const unsigned seed = FreshSeed() + 1313u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
      scapeOptimConfig_t cfg = Config(scapeDensityLinear, 20, 0.03, own);
      scapeOptim_t a = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
      if (!a) return false;
      std::vector<float> ta = Theta0(seed), tb;
      std::vector<uint8_t> ck;
      for (int s = 0; s < 30; ++s) {
        if (s == 7) {
          ck = Save(a, c.comm);
          tb = ta;
        }
        const std::vector<float> g = Grads(seed, c.rank, s);
        EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), kN), c.comm);
      }
      uint32_t ver = 0;
      std::memcpy(&ver, ck.data() + 8, 4);
      EXPECT_EQ(ver, 6u);
      EXPECT_EQ(ck[105], scapeDensityLinear);
      scapeOptimConfig_t other = Config(scapeDensityGeometric, 5, 0.03, own);
      scapeOptim_t b = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&b, &other, c.comm), c.comm);
      if (!b) return false;
      EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
      for (int s = 7; s < 30; ++s) {
        scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
        EXPECT_SCAPE_OK(scapeOptimGetInfo(b, &info), c.comm);
        EXPECT_NEAR(info.nextDensity,
                    static_cast<double>(Reference(scapeDensityLinear, 0.03, 20, s)), 1e-14);
        const std::vector<float> g = Grads(seed, c.rank, s);
        EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), kN), c.comm);
      }
      EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * kN), 0)
          << "ownership " << own << ": the resumed run differs at step 30";
      EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A version-5 checkpoint (before the shape was a choice) loads with the geometric shape; one
// claiming another shape, or with the new padding not 0, is refused.
TEST(Schedule, Version5CheckpointsAreGeometric) {
  const unsigned seed = FreshSeed() + 555u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    scapeOptimConfig_t cfg = Config(scapeDensityGeometric, 15);
    scapeOptim_t a = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
    if (!a) return false;
    std::vector<float> ta = Theta0(seed);
    for (int s = 0; s < 5; ++s) {
      const std::vector<float> g = Grads(seed, c.rank, s);
      EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), kN), c.comm);
    }
    std::vector<uint8_t> ck = Save(a, c.comm);
    const uint32_t v5 = 5;
    std::memcpy(ck.data() + 8, &v5, 4);
    Reseal(&ck);
    scapeOptimConfig_t lin = Config(scapeDensityLinear, 15);
    scapeOptim_t b = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&b, &lin, c.comm), c.comm);
    if (!b) return false;
    EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
    std::vector<float> tb = ta;
    for (int s = 5; s < 20; ++s) {
      const std::vector<float> g = Grads(seed, c.rank, s);
      EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), kN), c.comm);
      EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), kN), c.comm);
    }
    EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * kN), 0)
        << "a version-5 checkpoint did not restore the geometric shape";
    ck[105] = scapeDensityLinear;
    Reseal(&ck);
    EXPECT_EQ(scapeOptimLoad(b, ck.data(), ck.size()), scapeInvalidArgument);
    ck[105] = 0;
    ck[106] = 1;
    Reseal(&ck);
    EXPECT_EQ(scapeOptimLoad(b, ck.data(), ck.size()), scapeInvalidArgument);
    EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

long double Average(int sch, long double rho, int64_t w, int64_t n) {
  long double s = 0;
  for (int64_t t = 0; t < n; ++t) s += Reference(sch, rho, w, t);
  return s / static_cast<long double>(n);
}

// The budget form gives the longest ramp whose average density (a plain sum of the reference)
// is within the budget, on odd lengths and both shapes.
TEST(Schedule, BudgetGivesTheLongestRampWithinIt) {
  for (int sch : {scapeDensityGeometric, scapeDensityLinear})
    for (int64_t n : {1, 2, 37, 1001})
      for (double rho : {0.01, 0.1, 1.0})
        for (double frac : {0.0, 0.013, 0.25, 0.5, 0.97, 1.0}) {
          const long double lo = Average(sch, rho, 0, n);
          const double budget = static_cast<double>(lo + (1.0L - lo) * frac);
          int64_t w = -1;
          ASSERT_EQ(scapeOptimScheduleForBudget(sch, rho, budget, n, &w), scapeSuccess)
              << scapeGetLastError(nullptr);
          ASSERT_GE(w, 0);
          ASSERT_LE(w, n);
          const long double tol = 1e-12L;
          EXPECT_LE(Average(sch, rho, w, n), budget + tol)
              << "shape " << sch << " n " << n << " rho " << rho << " budget " << budget;
          if (w < n && rho < 1.0) {
            EXPECT_GT(Average(sch, rho, w + 1, n), budget - tol)
                << "shape " << sch << " n " << n << " rho " << rho << " budget " << budget
                << ": W = " << w << " is not the longest";
          }
          if (frac == 1.0) {
            EXPECT_EQ(w, n);
          }
        }
  // The setting: 1000 steps at 0.01; a 100-step geometric ramp averages 0.0310.
  int64_t w = 0;
  const double avg100 = static_cast<double>(Average(scapeDensityGeometric, 0.01, 100, 1000));
  ASSERT_EQ(scapeOptimScheduleForBudget(scapeDensityGeometric, 0.01, avg100, 1000, &w),
            scapeSuccess);
  EXPECT_EQ(w, 100);
}

TEST(Schedule, BadArgumentsAreRefused) {
  int64_t w = 0;
  auto fails = [&](int sch, double rho, double avg, int64_t n, int64_t* out, const char* word) {
    EXPECT_EQ(scapeOptimScheduleForBudget(sch, rho, avg, n, out), scapeInvalidArgument) << word;
    EXPECT_NE(std::string(scapeGetLastError(nullptr)).find(word), std::string::npos)
        << word << ": " << scapeGetLastError(nullptr);
  };
  fails(scapeDensityGeometric, 0.01, 0.1, 100, nullptr, "warmupSteps");
  fails(2, 0.01, 0.1, 100, &w, "schedule = 2");
  fails(-1, 0.01, 0.1, 100, &w, "schedule = -1");
  fails(scapeDensityGeometric, 0.0, 0.1, 100, &w, "density = 0");
  fails(scapeDensityGeometric, 1.5, 0.1, 100, &w, "density = 1.5");
  fails(scapeDensityGeometric, NAN, 0.1, 100, &w, "density");
  fails(scapeDensityGeometric, 0.01, 0.1, 0, &w, "totalSteps = 0");
  fails(scapeDensityGeometric, 0.01, NAN, 100, &w, "averageDensity");
  fails(scapeDensityGeometric, 0.01, 1.01, 100, &w, "averageDensity = 1.01");
  // below a fixed density's (1 + 99 * 0.01) / 100 = 0.0199
  fails(scapeDensityLinear, 0.01, 0.019, 100, &w, "0.0199");
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    for (int bad : {-1, 2, 99}) {
      scapeOptimConfig_t cfg = Config(bad, 10);
      scapeOptim_t o = nullptr;
      EXPECT_EQ(scapeOptimCreate(&o, &cfg, c.comm), scapeInvalidArgument);
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("densitySchedule"), std::string::npos)
          << scapeGetLastError(c.comm);
      EXPECT_EQ(o, nullptr);
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
}  // namespace scape_test
