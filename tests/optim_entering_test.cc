// The optimizer's "segment_rms" entering rule (scapeOptimConfig_t.entering, issue 23) over real
// UCX on loopback, 1-4 forked ranks: every rank ends every step with the same bits, sharded
// equals replicated, every payload type, checkpoints resume bit for bit and keep the rule, and
// the rule is the paper's form where it must be (always-dense layouts). The arithmetic of the
// rule itself is checked against a double reference in tests/kernels/test_entering.cc.
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

scapeOptimConfig_t Config(int entering, int ownership, int maskOwnership, scapeDataType_t pt,
                          double density = 0.05, int64_t warmup = 10) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  EXPECT_EQ(c.entering, scapeOptimEnteringPayload);  // the default: the paper's form
  c.n = kN;
  c.nsegments = static_cast<int>(kOffs.size() - 1);
  c.segOffsets = kOffs.data();
  c.denseFlags = kDense.data();
  c.ownership = ownership;
  c.maskOwnership = maskOwnership;
  c.lr = 1e-2f;
  c.weightDecay = 0.1f;
  c.maxGradNorm = 5.0f;
  c.density = density;
  c.warmupSteps = warmup;
  c.payloadType = pt;
  c.entering = entering;
  return c;
}

std::vector<float> Grads(unsigned seed, int rank, int step) {
  std::vector<float> g(kN);
  for (uint64_t i = 0; i < kN; ++i)
    g[i] = (step % 4 == 0 ? 0.25f : 0.05f) *
           static_cast<float>(InputValue(scapeFloat32, seed + 7919u * step, rank, i));
  return g;
}

std::vector<float> Theta0(unsigned seed) {
  std::vector<float> t(kN);
  for (uint64_t i = 0; i < kN; ++i)
    t[i] = static_cast<float>(InputValue(scapeFloat32, seed ^ 0x7777u, 0, i));
  return t;
}

bool SameOnAllRanks(RankCtx& c, const void* buf, size_t bytes) {
  std::vector<int64_t> h(static_cast<size_t>(c.nranks));
  int64_t mine = static_cast<int64_t>(HashBytes(buf, bytes));
  EXPECT_SCAPE_OK(scapeAllGather(&mine, h.data(), 1, scapeInt64, c.comm, nullptr), c.comm);
  for (int64_t x : h)
    if (x != mine) return false;
  return true;
}

std::vector<uint8_t> Save(scapeOptim_t opt, scapeComm_t comm) {
  size_t sz = 0, w = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), comm);
  std::vector<uint8_t> buf(sz);
  EXPECT_SCAPE_OK(scapeOptimSave(opt, buf.data(), buf.size(), &w), comm);
  return buf;
}

constexpr int kSteps = 40;

// Replicated and sharded with segment_rms, side by side with the paper's form: identical on
// every rank, sharded == replicated every step, and different from the paper's form (the rule
// acts) once masks turn over.
void RanksCase(int P) {
  const unsigned seed = FreshSeed() + 31u * static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const scapeDataType_t types[] = {scapeFloat32, scapeBfloat16, scapeFloat16};
    for (int ti = 0; ti < 3; ++ti) {
      const int mo = ti == 1 ? scapeOwnershipSegments : scapeOwnershipShards;
      scapeOptimConfig_t cr =
          Config(scapeOptimEnteringSegmentRms, scapeOptimReplicated, mo, types[ti]);
      scapeOptimConfig_t cs =
          Config(scapeOptimEnteringSegmentRms, scapeOptimSharded, mo, types[ti]);
      scapeOptimConfig_t cp =
          Config(scapeOptimEnteringPayload, scapeOptimReplicated, mo, types[ti]);
      scapeOptim_t rep = nullptr, sh = nullptr, pap = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&rep, &cr, c.comm), c.comm);
      EXPECT_SCAPE_OK(scapeOptimCreate(&sh, &cs, c.comm), c.comm);
      EXPECT_SCAPE_OK(scapeOptimCreate(&pap, &cp, c.comm), c.comm);
      if (!rep || !sh || !pap) return false;
      std::vector<float> tr = Theta0(seed), ts = tr, tp = tr;
      int firstDiff = -1;
      for (int step = 0; step < kSteps; ++step) {
        const std::vector<float> g = Grads(seed, c.rank, step);
        EXPECT_SCAPE_OK(scapeOptimStep(rep, tr.data(), g.data(), kN), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStep(sh, ts.data(), g.data(), kN), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStep(pap, tp.data(), g.data(), kN), c.comm);
        const bool same = std::memcmp(tr.data(), ts.data(), 4 * kN) == 0;
        EXPECT_TRUE(same) << "payload " << types[ti] << " step " << step
                          << ": sharded != replicated";
        EXPECT_TRUE(SameOnAllRanks(c, tr.data(), 4 * kN))
            << "payload " << types[ti] << " step " << step << ": ranks differ";
        if (firstDiff < 0 && std::memcmp(tr.data(), tp.data(), 4 * kN) != 0) firstDiff = step;
        if (!same) break;
      }
      // Step 0 has no staying coordinate anywhere (every momentum is 0): the paper's form.
      // (From step 1 on a coordinate whose averaged momentum came out exactly 0, which these
      // exactly-summing test inputs make happen, counts as entering.)
      EXPECT_GE(firstDiff, 1) << "segment_rms differs from the paper's form at step 0";
      EXPECT_GT(firstDiff, -1) << "segment_rms never changed anything";
      scapeOptimInfo_t ir = SCAPE_OPTIM_INFO_INITIALIZER, is = SCAPE_OPTIM_INFO_INITIALIZER;
      EXPECT_SCAPE_OK(scapeOptimGetInfo(rep, &ir), c.comm);
      EXPECT_SCAPE_OK(scapeOptimGetInfo(sh, &is), c.comm);
      EXPECT_EQ(ir.gradNorm, is.gradNorm);
      EXPECT_EQ(ir.maskCount, is.maskCount);
      for (scapeOptim_t o : {rep, sh, pap}) EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

class EnteringRanks : public ::testing::TestWithParam<int> {};
TEST_P(EnteringRanks, IdenticalOnRanksAndShardedEqualsReplicated) { RanksCase(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Ranks, EnteringRanks, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// At density 1 every coordinate stays after step 0 (always-dense): the rule changes nothing.
TEST(Entering, DenseIsThePapersForm) {
  const unsigned seed = FreshSeed() + 99u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    scapeOptimConfig_t a =
        Config(scapeOptimEnteringSegmentRms, scapeOptimReplicated, -1, scapeFloat32, 1.0, 0);
    scapeOptimConfig_t b =
        Config(scapeOptimEnteringPayload, scapeOptimReplicated, -1, scapeFloat32, 1.0, 0);
    scapeOptim_t oa = nullptr, ob = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&oa, &a, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimCreate(&ob, &b, c.comm), c.comm);
    if (!oa || !ob) return false;
    std::vector<float> ta = Theta0(seed), tb = ta;
    for (int step = 0; step < 10; ++step) {
      // Positive gradients: no momentum can come out exactly 0 (which would count as entering).
      std::vector<float> g = Grads(seed, c.rank, step);
      for (float& x : g) x = 0.01f + std::fabs(x);
      EXPECT_SCAPE_OK(scapeOptimStep(oa, ta.data(), g.data(), kN), c.comm);
      EXPECT_SCAPE_OK(scapeOptimStep(ob, tb.data(), g.data(), kN), c.comm);
      EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * kN), 0) << "step " << step;
    }
    EXPECT_SCAPE_OK(scapeOptimDestroy(oa), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(ob), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Checkpoint at step 13, a fresh optimizer created with the paper's form loads it (the
// checkpoint's rule wins) and ends at the uninterrupted bits; the field sits at offset 110 (u16,
// version 3).
TEST(Entering, CheckpointResumeIsBitIdentical) {
  const unsigned seed = FreshSeed() + 1313u;
  for (int P : {2, 3}) {
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
        const scapeDataType_t pt = own == scapeOptimSharded ? scapeFloat16 : scapeBfloat16;
        scapeOptimConfig_t cfg = Config(scapeOptimEnteringSegmentRms, own, -1, pt);
        scapeOptim_t a = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
        if (!a) return false;
        std::vector<float> ta = Theta0(seed), tb;
        std::vector<uint8_t> ck;
        for (int step = 0; step < kSteps; ++step) {
          if (step == 13) {
            ck = Save(a, c.comm);
            tb = ta;
          }
          const std::vector<float> g = Grads(seed, c.rank, step);
          EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), kN), c.comm);
        }
        uint16_t field = 0;
        std::memcpy(&field, ck.data() + 110, 2);
        EXPECT_EQ(field, scapeOptimEnteringSegmentRms);
        {
          // A version-2 checkpoint cannot hold the rule: one that claims it is refused.
          std::vector<uint8_t> v2 = ck;
          const uint32_t ver = 2;
          std::memcpy(v2.data() + 8, &ver, 4);
          Reseal(&v2);
          EXPECT_EQ(scapeOptimLoad(a, v2.data(), v2.size()), scapeInvalidArgument);
        }
        scapeOptimConfig_t cfg2 = Config(scapeOptimEnteringPayload, own, -1, pt);
        scapeOptim_t b = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&b, &cfg2, c.comm), c.comm);
        if (!b) return false;
        EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
        for (int step = 13; step < kSteps; ++step) {
          const std::vector<float> g = Grads(seed, c.rank, step);
          EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), kN), c.comm);
        }
        EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * kN), 0)
            << "resumed run differs from the uninterrupted one (ownership " << own << ")";
        // A checkpoint of the paper's form keeps 0 there, as every checkpoint written before
        // the field existed: such a checkpoint loads and runs the paper's form.
        std::vector<uint8_t> ckp = Save(b, c.comm);
        scapeOptim_t f = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&f, &cfg2, c.comm), c.comm);
        std::vector<uint8_t> ck0 = Save(f, c.comm);
        std::memcpy(&field, ck0.data() + 110, 2);
        EXPECT_EQ(field, 0);
        EXPECT_SCAPE_OK(scapeOptimLoad(b, ck0.data(), ck0.size()), c.comm);
        for (scapeOptim_t o : {a, b, f}) EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
      }
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// "segment_rms_masked" (momentum factor masking on top of segment_rms): identical on every rank,
// sharded == replicated, different from segment_rms once a kept momentum is clamped, and a
// checkpoint (byte 110 = 2) resumes it bit for bit on an optimizer created with another rule.
TEST(Entering, MomentumFactorMaskingOverRanks) {
  for (int P : {1, 3}) {
    const unsigned seed = FreshSeed() + 97u * static_cast<unsigned>(P);
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      const int mo = scapeOwnershipShards;
      scapeOptimConfig_t cm =
          Config(scapeOptimEnteringSegmentRmsMasked, scapeOptimReplicated, mo, scapeFloat32);
      scapeOptimConfig_t cs =
          Config(scapeOptimEnteringSegmentRmsMasked, scapeOptimSharded, mo, scapeFloat32);
      scapeOptimConfig_t cr =
          Config(scapeOptimEnteringSegmentRms, scapeOptimReplicated, mo, scapeFloat32);
      scapeOptim_t rep = nullptr, sh = nullptr, rms = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&rep, &cm, c.comm), c.comm);
      EXPECT_SCAPE_OK(scapeOptimCreate(&sh, &cs, c.comm), c.comm);
      EXPECT_SCAPE_OK(scapeOptimCreate(&rms, &cr, c.comm), c.comm);
      if (!rep || !sh || !rms) return false;
      std::vector<float> tm = Theta0(seed), ts = tm, tr = tm, tb;
      std::vector<uint8_t> ck;
      int firstDiff = -1;
      for (int step = 0; step < kSteps; ++step) {
        if (step == 13) {
          ck = Save(rep, c.comm);
          tb = tm;
        }
        const std::vector<float> g = Grads(seed, c.rank, step);
        EXPECT_SCAPE_OK(scapeOptimStep(rep, tm.data(), g.data(), kN), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStep(sh, ts.data(), g.data(), kN), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStep(rms, tr.data(), g.data(), kN), c.comm);
        const bool same = std::memcmp(tm.data(), ts.data(), 4 * kN) == 0;
        EXPECT_TRUE(same) << "step " << step << ": sharded != replicated";
        EXPECT_TRUE(SameOnAllRanks(c, tm.data(), 4 * kN)) << "step " << step << ": ranks differ";
        if (firstDiff < 0 && std::memcmp(tm.data(), tr.data(), 4 * kN) != 0) firstDiff = step;
        if (!same) break;
      }
      // The clamp acts on the momentum, which moves theta from the next step on.
      EXPECT_GE(firstDiff, 2) << "momentum factor masking changed theta before any kept momentum";
      EXPECT_GT(firstDiff, -1) << "momentum factor masking never changed anything";
      uint16_t field = 0;
      std::memcpy(&field, ck.data() + 110, 2);
      EXPECT_EQ(field, scapeOptimEnteringSegmentRmsMasked);
      scapeOptimConfig_t cp =
          Config(scapeOptimEnteringPayload, scapeOptimReplicated, mo, scapeFloat32);
      scapeOptim_t b = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&b, &cp, c.comm), c.comm);
      if (!b) return false;
      EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
      for (int step = 13; step < kSteps; ++step) {
        const std::vector<float> g = Grads(seed, c.rank, step);
        EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), kN), c.comm);
      }
      EXPECT_EQ(std::memcmp(tm.data(), tb.data(), 4 * kN), 0)
          << "resumed run differs from the uninterrupted one";
      for (scapeOptim_t o : {rep, sh, rms, b}) EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

TEST(Entering, BadConfigIsRefused) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    for (int bad : {-1, static_cast<int>(scapeNumOptimEnterings), 7}) {
      scapeOptimConfig_t cfg = Config(bad, scapeOptimReplicated, -1, scapeFloat32);
      scapeOptim_t o = nullptr;
      EXPECT_EQ(scapeOptimCreate(&o, &cfg, c.comm), scapeInvalidArgument) << bad;
      EXPECT_EQ(o, nullptr);
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("entering"), std::string::npos)
          << scapeGetLastError(c.comm);
    }
    // Ranks that disagree on the rule: refused on every rank.
    scapeOptimConfig_t cfg =
        Config(c.rank == 0 ? scapeOptimEnteringSegmentRms : scapeOptimEnteringPayload,
               scapeOptimReplicated, -1, scapeFloat32);
    scapeOptim_t o = nullptr;
    EXPECT_EQ(scapeOptimCreate(&o, &cfg, c.comm), scapeInvalidUsage);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
}  // namespace scape_test
