// scapeOptimStepJoint (issue 32 item 1): several optimizers (a framework's parameter groups)
// stepped as one, clipped by one global norm. Over real UCX on loopback, like optim_test.cc.
//   - one member is the plain step, bit for bit;
//   - without clipping the members are independent: bit for bit their own steps;
//   - with clipping the joint norm is sqrt of the members' squared norms (each member's own
//     norm measured by a twin stepped on its own from the same state), every member reports
//     it and the joint clip factor, and each member's update is bit for bit its own step with
//     a threshold that gives it that factor (a checkpoint with maxGradNorm edited);
//   - with local clipping (issue 30) every member weighs this rank's gradients by one factor
//     from their norm over every member; a member without it is refused;
//   - a non-finite gradient in one member skips every member on every rank;
//   - the argument errors name the member.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/checkpoint_util.h"
#include "tests/harness.h"
#include "tests/optim_util.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

// Three groups of different shapes (odd sizes, an always-dense segment in one).
struct Member {
  std::vector<uint64_t> offs;
  std::vector<uint8_t> dense;
  float lr, wd;
  uint64_t n() const { return offs.back(); }
};

std::vector<Member> Members() {
  return {{{0, 700, 713, 2000}, {0, 1, 0}, 1e-2f, 0.1f},
          {{0, 1, 1500}, {1, 0}, 3e-3f, 0.0f},
          {{0, 333, 999, 1001}, {0, 0, 1}, 2e-2f, 0.05f}};
}

scapeOptimConfig_t Config(const Member& m, float maxNorm, int ownership,
                          int clipNorm = scapeOptimClipNormRecovered) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = m.n();
  c.nsegments = static_cast<int>(m.offs.size() - 1);
  c.segOffsets = m.offs.data();
  c.denseFlags = m.dense.data();
  c.ownership = ownership;
  c.lr = m.lr;
  c.weightDecay = m.wd;
  c.maxGradNorm = maxNorm;
  c.density = 0.05;
  c.warmupSteps = 2;
  c.clipNorm = clipNorm;
  return c;
}

std::vector<float> Values(unsigned seed, int rank, uint64_t n, float scale) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i)
    v[i] = scale * static_cast<float>(InputValue(scapeFloat32, seed, rank, i));
  return v;
}

struct Set {
  std::vector<scapeOptim_t> opt;
  std::vector<std::vector<float>> theta;
};

Set Make(RankCtx& c, const std::vector<Member>& ms, const std::vector<float>& maxNorm,
         int ownership, unsigned seed, int clipNorm = scapeOptimClipNormRecovered) {
  Set s;
  for (size_t i = 0; i < ms.size(); ++i) {
    const scapeOptimConfig_t cfg = Config(ms[i], maxNorm[i], ownership, clipNorm);
    scapeOptim_t o = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfg, c.comm), c.comm);
    s.opt.push_back(o);
    s.theta.push_back(Values(seed + 17 * static_cast<unsigned>(i), 0, ms[i].n(), 1.0f));
  }
  return s;
}

void Destroy(RankCtx& c, Set& s) {
  for (scapeOptim_t o : s.opt) EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
}

// The gradients of member i at step t on this rank (large enough that a norm of 1 clips).
std::vector<float> Grad(unsigned seed, int rank, size_t i, int t, uint64_t n) {
  return Values(seed * 31u + 1000u * static_cast<unsigned>(t) + static_cast<unsigned>(i), rank, n,
                0.5f);
}

scapeResult_t JointStep(Set& s, std::vector<std::vector<float>>& g) {
  std::vector<scapeOptimStepArgs_t> a(s.opt.size());
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = {s.opt[i],    s.theta[i].data(), scapeFloat32,
            g[i].data(), scapeFloat32,      s.theta[i].size()};
  return scapeOptimStepJoint(a.data(), static_cast<int>(a.size()), nullptr);
}

std::vector<std::vector<float>> Grads(unsigned seed, int rank, int t, const Set& s) {
  std::vector<std::vector<float>> g;
  for (size_t i = 0; i < s.opt.size(); ++i) g.push_back(Grad(seed, rank, i, t, s.theta[i].size()));
  return g;
}

scapeOptimInfo_t Info(scapeOptim_t o, scapeComm_t comm) {
  scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
  EXPECT_SCAPE_OK(scapeOptimGetInfo(o, &info), comm);
  return info;
}

bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

class OptimJoint : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(OptimJoint, OneMemberIsThePlainStep) {
  const int P = std::get<0>(GetParam()), own = std::get<1>(GetParam());
  const unsigned seed = FreshSeed();
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    std::vector<Member> ms = {Members()[0]};
    Set joint = Make(c, ms, {1.0f}, own, seed), plain = Make(c, ms, {1.0f}, own, seed);
    for (int t = 0; t < 5; ++t) {
      std::vector<std::vector<float>> g = Grads(seed, c.rank, t, joint);
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
      EXPECT_SCAPE_OK(scapeOptimStep(plain.opt[0], plain.theta[0].data(), g[0].data(), ms[0].n()),
                      c.comm);
      EXPECT_TRUE(Same(joint.theta[0], plain.theta[0])) << "step " << t;
      EXPECT_EQ(Info(joint.opt[0], c.comm).gradNorm, Info(plain.opt[0], c.comm).gradNorm);
    }
    Destroy(c, joint);
    Destroy(c, plain);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(OptimJoint, WithoutClippingTheMembersAreTheirOwnSteps) {
  const int P = std::get<0>(GetParam()), own = std::get<1>(GetParam());
  const unsigned seed = FreshSeed();
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const std::vector<Member> ms = Members();
    const std::vector<float> off(ms.size(), 0.0f);
    Set joint = Make(c, ms, off, own, seed), own1 = Make(c, ms, off, own, seed);
    for (int t = 0; t < 6; ++t) {
      std::vector<std::vector<float>> g = Grads(seed, c.rank, t, joint);
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
      double sq = 0.0;
      for (size_t i = 0; i < ms.size(); ++i) {
        EXPECT_SCAPE_OK(scapeOptimStep(own1.opt[i], own1.theta[i].data(), g[i].data(), ms[i].n()),
                        c.comm);
        EXPECT_TRUE(Same(joint.theta[i], own1.theta[i])) << "member " << i << " step " << t;
        const double gi = Info(own1.opt[i], c.comm).gradNorm;
        sq += gi * gi;
      }
      for (size_t i = 0; i < ms.size(); ++i) {
        const scapeOptimInfo_t ji = Info(joint.opt[i], c.comm);
        EXPECT_NEAR(ji.gradNorm, std::sqrt(sq), 1e-12 * std::sqrt(sq)) << "member " << i;
        EXPECT_EQ(ji.clipScale, 1.0f);
      }
    }
    Destroy(c, joint);
    Destroy(c, own1);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(OptimJoint, ClipsEveryMemberByTheJointNorm) {
  const int P = std::get<0>(GetParam()), own = std::get<1>(GetParam());
  const unsigned seed = FreshSeed();
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const std::vector<Member> ms = Members();
    const float maxNorm = 1.0f;
    const std::vector<float> clip(ms.size(), maxNorm);
    Set joint = Make(c, ms, clip, own, seed);
    for (int t = 0; t < 4; ++t) {
      // Twins from the joint members' state (checkpoints carry the hyperparameters), stepped on
      // their own: each member's own pre-clip norm, and its update clipped by its own norm.
      Set twin = Make(c, ms, clip, own, seed);
      std::vector<std::vector<uint8_t>> ck(ms.size());
      const std::vector<std::vector<float>> thetaBefore = joint.theta;
      for (size_t i = 0; i < ms.size(); ++i) {
        ck[i] = Checkpoint(joint.opt[i], c.comm);
        EXPECT_SCAPE_OK(scapeOptimLoad(twin.opt[i], ck[i].data(), ck[i].size()), c.comm);
        twin.theta[i] = joint.theta[i];
      }
      std::vector<std::vector<float>> g = Grads(seed, c.rank, t, joint);
      double sq = 0.0;
      for (size_t i = 0; i < ms.size(); ++i) {
        EXPECT_SCAPE_OK(scapeOptimStep(twin.opt[i], twin.theta[i].data(), g[i].data(), ms[i].n()),
                        c.comm);
        const double ni = Info(twin.opt[i], c.comm).gradNorm;
        sq += ni * ni;
      }
      const double norm = std::sqrt(sq);
      EXPECT_GT(norm, 2.0 * maxNorm) << "the test's gradients do not clip";
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
      const float scale = static_cast<float>(maxNorm / (norm + 1e-6));
      for (size_t i = 0; i < ms.size(); ++i) {
        const scapeOptimInfo_t ji = Info(joint.opt[i], c.comm), ti = Info(twin.opt[i], c.comm);
        EXPECT_NEAR(ji.gradNorm, norm, 1e-12 * norm) << "member " << i << " step " << t;
        EXPECT_NEAR(ji.clipScale, scale, 1e-6f * scale) << "member " << i << " step " << t;
        EXPECT_LT(ji.clipScale, ti.clipScale) << "member " << i << ": the joint norm clips more";
        EXPECT_EQ(ji.payloadBytes, ti.payloadBytes) << "member " << i;
        EXPECT_EQ(ji.step, t + 1);
        // From step 1 on (step 0's update is nearly scale-free: m and v start from the same
        // g^), the update clipped by the joint factor is not the one clipped by its own.
        if (t > 0) {
          EXPECT_FALSE(Same(joint.theta[i], twin.theta[i])) << "member " << i;
        }
        EXPECT_TRUE(SameOnAllRanks(c, joint.theta[i]));
        // The member's own step with a threshold that gives its own norm the joint factor
        // (the checkpoint's maxGradNorm edited): the joint member's parameters, bit for bit
        // where a float threshold gives the factor's exact bits, else within 1e-6.
        const double ni = ti.gradNorm;
        auto factor = [&](float m) {
          return static_cast<float>(static_cast<double>(m) / (ni + 1e-6));
        };
        const float m0 = static_cast<float>(ji.clipScale * (ni + 1e-6));
        float mi = m0;
        bool exact = false;
        for (float lo = m0, hi = m0; !exact && hi < m0 * 1.0001f;) {
          if (factor(lo) == ji.clipScale)
            mi = lo, exact = true;
          else if (factor(hi) == ji.clipScale)
            mi = hi, exact = true;
          lo = std::nextafter(lo, 0.0f);
          hi = std::nextafter(hi, FLT_MAX);
        }
        std::vector<uint8_t> edited = ck[i];
        std::memcpy(edited.data() + 84, &mi, 4);  // OptimHyper.maxGradNorm (docs/FORMATS.md)
        Reseal(&edited);
        scapeOptim_t alone = nullptr;
        const scapeOptimConfig_t cfg = Config(ms[i], maxNorm, own);
        EXPECT_SCAPE_OK(scapeOptimCreate(&alone, &cfg, c.comm), c.comm);
        EXPECT_SCAPE_OK(scapeOptimLoad(alone, edited.data(), edited.size()), c.comm);
        std::vector<float> th = thetaBefore[i];
        EXPECT_SCAPE_OK(scapeOptimStep(alone, th.data(), g[i].data(), ms[i].n()), c.comm);
        if (exact) {
          EXPECT_EQ(Info(alone, c.comm).clipScale, ji.clipScale);
          EXPECT_TRUE(Same(th, joint.theta[i]))
              << "member " << i << " step " << t << ": not its own step with the joint factor";
        } else {
          float worst = 0.0f;
          for (size_t q = 0; q < th.size(); ++q)
            worst = std::max(
                worst, std::fabs(th[q] - joint.theta[i][q]) / std::max(1.0f, std::fabs(th[q])));
          EXPECT_LT(worst, 1e-6f) << "member " << i << " step " << t
                                  << ": not its own step with the joint factor";
        }
        EXPECT_SCAPE_OK(scapeOptimDestroy(alone), c.comm);
      }
      Destroy(c, twin);
    }
    Destroy(c, joint);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// clipNorm = local: each rank's own gradients, over every member (as clip_grad_norm_ over every
// group before the step), one factor for every member of this rank; the parameters still the
// same on every rank. Mixing it with a member that clips g^ is refused, naming the member.
TEST_P(OptimJoint, LocalClipTakesThisRanksNormOverEveryMember) {
  const int P = std::get<0>(GetParam()), own = std::get<1>(GetParam());
  const unsigned seed = FreshSeed();
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const std::vector<Member> ms = Members();
    const float maxNorm = 1.0f;
    Set joint =
        Make(c, ms, std::vector<float>(ms.size(), maxNorm), own, seed, scapeOptimClipNormLocal);
    for (int t = 0; t < 4; ++t) {
      std::vector<std::vector<float>> g = Grads(seed, c.rank, t, joint);
      double sq = 0.0;  // the members' gradients of this rank, a plain double sum
      for (const auto& gi : g)
        for (float x : gi) sq += static_cast<double>(x) * x;
      const double norm = std::sqrt(sq);
      EXPECT_GT(norm, 2.0 * maxNorm) << "the test's gradients do not clip";
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
      const float scale = static_cast<float>(maxNorm / (norm + 1e-6));
      for (size_t i = 0; i < ms.size(); ++i) {
        const scapeOptimInfo_t ji = Info(joint.opt[i], c.comm);
        EXPECT_NEAR(ji.gradNorm, norm, 1e-12 * norm) << "member " << i << " step " << t;
        EXPECT_NEAR(ji.clipScale, scale, 1e-6f * scale) << "member " << i << " step " << t;
        EXPECT_EQ(ji.step, t + 1);
        EXPECT_TRUE(SameOnAllRanks(c, joint.theta[i]));
      }
    }
    // One member clipping g^ among local ones.
    const scapeOptimConfig_t cfg = Config(ms[1], maxNorm, own);
    scapeOptim_t other = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&other, &cfg, c.comm), c.comm);
    std::swap(other, joint.opt[1]);
    std::vector<std::vector<float>> g = Grads(seed, c.rank, 9, joint);
    EXPECT_EQ(JointStep(joint, g), scapeInvalidArgument);
    const std::string err = scapeGetLastError(c.comm);
    EXPECT_NE(err.find("steps[1].optim has clipNorm"), std::string::npos) << err;
    std::swap(other, joint.opt[1]);
    EXPECT_SCAPE_OK(scapeOptimDestroy(other), c.comm);
    Destroy(c, joint);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(OptimJoint, ANonFiniteGradientInOneMemberSkipsEveryMember) {
  const int P = std::get<0>(GetParam()), own = std::get<1>(GetParam());
  const unsigned seed = FreshSeed();
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const std::vector<Member> ms = Members();
    Set joint = Make(c, ms, std::vector<float>(ms.size(), 1.0f), own, seed);
    for (int t = 0; t < 2; ++t) {
      std::vector<std::vector<float>> g = Grads(seed, c.rank, t, joint);
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
    }
    for (size_t bad = 0; bad < ms.size(); ++bad) {
      std::vector<std::vector<uint8_t>> before;
      for (scapeOptim_t o : joint.opt) before.push_back(Checkpoint(o, c.comm));
      const std::vector<std::vector<float>> thetaBefore = joint.theta;
      std::vector<std::vector<float>> g = Grads(seed, c.rank, 2, joint);
      if (c.rank == P - 1) g[bad][g[bad].size() / 2] = NAN;
      EXPECT_SCAPE_OK(JointStep(joint, g), c.comm);
      for (size_t i = 0; i < ms.size(); ++i) {
        const scapeOptimInfo_t ji = Info(joint.opt[i], c.comm);
        EXPECT_EQ(ji.step, 2) << "member " << i << ", bad member " << bad;
        EXPECT_EQ(ji.skippedSteps, static_cast<int64_t>(bad + 1)) << "member " << i;
        EXPECT_TRUE(std::isnan(ji.gradNorm));
        EXPECT_TRUE(Same(joint.theta[i], thetaBefore[i])) << "member " << i << " moved";
        // Members before the bad one got past their agreement: their residual and masks moved
        // on (a skip after the exchange); the others changed nothing.
        if (i >= bad) {
          EXPECT_TRUE(Checkpoint(joint.opt[i], c.comm) == before[i]) << "member " << i;
        }
      }
    }
    Destroy(c, joint);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, OptimJoint,
    ::testing::Combine(::testing::Values(1, 3),
                       ::testing::Values(static_cast<int>(scapeOptimReplicated),
                                         static_cast<int>(scapeOptimSharded))));

}  // namespace
}  // namespace scape_test
