// Mixed precision (scapeOptimStepMixed): 16-bit params with fp32 master weights held by the
// optimizer, over real UCX on loopback with forked ranks.
//
// The oracle: the fp32 step (scapeOptimStep), which tests/optim_test.cc checks bit for bit
// against an independent reference, run on the widened initial params and on the widened
// gradients. The mixed step's masters must be that run's params bit for bit (read from the
// checkpoint, whose layout scape.h and plugin/optim/optim.cc document), and its 16-bit params
// must be those masters rounded to nearest even (computed here with the conversion of
// kernels/cpu/dtype.h) at every position after every step.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scape_step.h"
#include "tests/checkpoint_util.h"
#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

namespace kn = scape::kernels;

// Odd sizes, an empty segment, a 1-element segment and two always-dense segments.
struct Layout {
  std::vector<uint64_t> offs{0, 0, 1, 700, 713, 713, 2000, 3001, 3011};
  std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0, 0, 1};
  uint64_t n() const { return offs.back(); }
  int nseg() const { return static_cast<int>(offs.size() - 1); }
};

struct Cfg {
  int ownership = scapeOptimReplicated;
  int payload = scapeFloat32;
  float wd = 0.1f;
  float clip = 5.0f;
};

scapeOptim_t Create(RankCtx& c, const Layout& l, const Cfg& k) {
  scapeOptimConfig_t cfg;
  EXPECT_EQ(scapeOptimConfigInit(&cfg), scapeSuccess);
  cfg.n = l.n();
  cfg.nsegments = l.nseg();
  cfg.segOffsets = l.offs.data();
  cfg.denseFlags = l.dense.data();
  cfg.ownership = k.ownership;
  cfg.lr = 1e-2f;
  cfg.weightDecay = k.wd;
  cfg.maxGradNorm = k.clip;
  cfg.biasCorrection = scapeBiasCorrectionArtifact;
  cfg.density = 0.05;
  cfg.warmupSteps = 10;
  cfg.payloadType = k.payload;
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfg, c.comm), c.comm);
  return o;
}

std::vector<uint8_t> Save(scapeOptim_t o, scapeComm_t comm) {
  size_t sz = 0, w = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(o, &sz), comm);
  std::vector<uint8_t> b(sz);
  EXPECT_SCAPE_OK(scapeOptimSave(o, b.data(), b.size(), &w), comm);
  EXPECT_EQ(w, sz);
  return b;
}

// Checkpoint layout (plugin/optim/optim_checkpoint.cc): the header's size is the u32 at byte 12,
// its version the u32 at 8; the u16 at 108 (version 3; an i32 in version 2) is the type the
// masters shadow. Versions 1-3: m, e (n f32 each), then the masters (n f32); version 4: e, then
// the masters (then the packed momentum).
int32_t CkMasterType(const std::vector<uint8_t>& ck) {
  uint16_t t;
  std::memcpy(&t, ck.data() + 108, 2);
  return t;
}
std::vector<float> CkMasters(const std::vector<uint8_t>& ck, uint64_t n) {
  std::vector<float> m(n);
  uint32_t ver = 0, header = 0;
  std::memcpy(&ver, ck.data() + 8, 4);
  std::memcpy(&header, ck.data() + 12, 4);
  const size_t at = header + (ver >= 4 ? 4 : 8) * n;
  if (ck.size() >= at + 4 * n) std::memcpy(m.data(), ck.data() + at, 4 * n);
  return m;
}

uint16_t Round16(scapeDataType_t t, float x) {
  return t == scapeBfloat16 ? kn::FloatToBf16(x) : kn::FloatToFp16(x);
}
float Widen16(scapeDataType_t t, uint16_t h) {
  return t == scapeBfloat16 ? kn::Bf16ToFloat(h) : kn::Fp16ToFloat(h);
}

// Params identical on every rank (a fixed seed), as 16-bit values.
std::vector<uint16_t> InitialParams16(unsigned seed, uint64_t n, scapeDataType_t t) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<uint16_t> p(n);
  for (uint16_t& x : p) x = Round16(t, d(rng));
  return p;
}

// Per-rank gradients; every fourth step 5x larger (clipping acts on those).
std::vector<float> Grads(unsigned seed, int rank, int step, uint64_t n) {
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank) * 104729u +
                   static_cast<unsigned>(step));
  std::normal_distribution<float> d(0.0f, step % 4 == 0 ? 0.25f : 0.05f);
  std::vector<float> g(n);
  for (float& x : g) x = d(rng);
  return g;
}

// The gradients as gradType (16-bit: rounded), and their widened fp32 values.
struct GradBufs {
  std::vector<uint8_t> raw;
  std::vector<float> wide;
};
GradBufs MakeGrads(const std::vector<float>& g, scapeDataType_t gt) {
  GradBufs b;
  const size_t n = g.size();
  b.wide.resize(n);
  if (gt == scapeFloat32) {
    b.raw.resize(4 * n);
    std::memcpy(b.raw.data(), g.data(), 4 * n);
    b.wide = g;
  } else {
    b.raw.resize(2 * n);
    uint16_t* h = reinterpret_cast<uint16_t*>(b.raw.data());
    for (size_t i = 0; i < n; ++i) {
      h[i] = Round16(gt, g[i]);
      b.wide[i] = Widen16(gt, h[i]);
    }
  }
  return b;
}

// params16 == round(ref) at every position; reports the first difference.
bool IsRounded(const std::vector<uint16_t>& p16, const std::vector<float>& ref, scapeDataType_t t,
               const std::string& what) {
  for (size_t i = 0; i < ref.size(); ++i)
    if (p16[i] != Round16(t, ref[i])) {
      ADD_FAILURE() << what << ": position " << i << ": params16 " << p16[i] << " != round(master "
                    << ref[i] << ") = " << Round16(t, ref[i]);
      return false;
    }
  return true;
}

bool SameOnAllRanks(RankCtx& c, const void* buf, size_t bytes) {
  std::vector<int64_t> h(static_cast<size_t>(c.nranks));
  int64_t mine = static_cast<int64_t>(HashBytes(buf, bytes));
  EXPECT_SCAPE_OK(scapeAllGather(&mine, h.data(), 1, scapeInt64, c.comm, nullptr), c.comm);
  for (int64_t x : h)
    if (x != mine) return false;
  return true;
}

constexpr int kSteps = 50;

// 50 steps of a mixed optimizer beside the fp32 oracle: after every step the params are the
// rounded masters and the masters the oracle's params; identical on every rank.
void FiftySteps(int P) {
  const unsigned seed = FreshSeed() + 2222u;
  struct Combo {
    int own, payload;
    scapeDataType_t pt, gt;
  };
  const Combo combos[] = {
      {scapeOptimReplicated, scapeFloat32, scapeBfloat16, scapeFloat32},
      {scapeOptimReplicated, scapeBfloat16, scapeBfloat16, scapeBfloat16},
      {scapeOptimReplicated, scapeFloat16, scapeFloat16, scapeFloat16},
      {scapeOptimSharded, scapeFloat32, scapeFloat16, scapeFloat32},
      {scapeOptimSharded, scapeBfloat16, scapeBfloat16, scapeBfloat16},
      {scapeOptimSharded, scapeFloat16, scapeBfloat16, scapeFloat16},
  };
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    for (const Combo& k : combos) {
      Cfg cfg;
      cfg.ownership = k.own;
      cfg.payload = k.payload;
      scapeOptim_t ref = Create(c, l, cfg), mix = Create(c, l, cfg);
      if (!ref || !mix) return false;
      std::vector<uint16_t> p16 = InitialParams16(seed, n, k.pt);
      std::vector<float> theta(n);
      for (uint64_t i = 0; i < n; ++i) theta[i] = Widen16(k.pt, p16[i]);
      const std::string tag = "own " + std::to_string(k.own) + " payload " +
                              std::to_string(k.payload) + " params " + std::to_string(k.pt) +
                              " grads " + std::to_string(k.gt);
      for (int step = 0; step < kSteps; ++step) {
        GradBufs g = MakeGrads(Grads(seed, c.rank, step, n), k.gt);
        EXPECT_SCAPE_OK(scapeOptimStep(ref, theta.data(), g.wide.data(), n), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStepMixed(mix, p16.data(), k.pt, g.raw.data(), k.gt, n, nullptr),
                        c.comm);
        const std::string at = tag + ", step " + std::to_string(step);
        if (!IsRounded(p16, theta, k.pt, at)) return false;
        if (step % 7 == 0 || step == kSteps - 1) {
          std::vector<uint8_t> ck = Save(mix, c.comm);
          EXPECT_EQ(CkMasterType(ck), static_cast<int32_t>(k.pt)) << at;
          std::vector<float> master = CkMasters(ck, n);
          EXPECT_EQ(std::memcmp(master.data(), theta.data(), 4 * n), 0)
              << at << ": masters differ from the fp32 step";
          EXPECT_TRUE(SameOnAllRanks(c, p16.data(), 2 * n)) << at << ": params differ";
          EXPECT_TRUE(SameOnAllRanks(c, master.data(), 4 * n)) << at << ": masters differ";
        }
        if (::testing::Test::HasFailure()) return false;
      }
      scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
      EXPECT_SCAPE_OK(scapeOptimGetInfo(mix, &info), c.comm);
      // Residual and masters (n floats each), the momentum packed at the mask.
      EXPECT_EQ(info.stateBytes, 8 * n + 4 * info.maskCount);
      EXPECT_SCAPE_OK(scapeOptimGetInfo(ref, &info), c.comm);
      EXPECT_EQ(info.stateBytes, 4 * n + 4 * info.maskCount);
      EXPECT_SCAPE_OK(scapeOptimDestroy(ref), c.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(mix), c.comm);
    }
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << "P=" << P << " seed=" << seed << ": " << res.Describe();
}

class OptimMixedRanks : public ::testing::TestWithParam<int> {};
TEST_P(OptimMixedRanks, FiftyStepsParamsAreRoundedMastersOnEveryRank) { FiftySteps(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Ranks, OptimMixedRanks, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// Weight decay 0 (the update leaves theta untouched outside the mask): the 16-bit copy is still
// written at every position, so params the caller changed between steps become the rounded
// masters again at the next step.
TEST(OptimMixed, EveryPositionIsWrittenWithoutWeightDecay) {
  const unsigned seed = FreshSeed() + 3333u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
      Cfg cfg;
      cfg.ownership = own;
      cfg.wd = 0.0f;
      cfg.payload = scapeBfloat16;
      scapeOptim_t ref = Create(c, l, cfg), mix = Create(c, l, cfg);
      if (!ref || !mix) return false;
      std::vector<uint16_t> p16 = InitialParams16(seed, n, scapeBfloat16);
      std::vector<float> theta(n);
      for (uint64_t i = 0; i < n; ++i) theta[i] = kn::Bf16ToFloat(p16[i]);
      for (int step = 0; step < 12; ++step) {
        // Scribble over every param: the masters are the truth.
        if (step >= 3)
          for (uint64_t i = 0; i < n; ++i) p16[i] = static_cast<uint16_t>(0x7fc0u ^ i);
        std::vector<float> g = Grads(seed, c.rank, step, n);
        EXPECT_SCAPE_OK(scapeOptimStep(ref, theta.data(), g.data(), n), c.comm);
        EXPECT_SCAPE_OK(
            scapeOptimStepMixed(mix, p16.data(), scapeBfloat16, g.data(), scapeFloat32, n, nullptr),
            c.comm);
        if (!IsRounded(p16, theta, scapeBfloat16, "wd 0, step " + std::to_string(step)))
          return false;
      }
      EXPECT_SCAPE_OK(scapeOptimDestroy(ref), c.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(mix), c.comm);
    }
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Checkpoint at step 17 (masters included), a fresh optimizer loads it: step 50 has the
// uninterrupted run's params and masters, bit for bit.
TEST(OptimMixed, CheckpointResumeIsBitIdentical) {
  const unsigned seed = FreshSeed() + 1717u;
  for (int P : {2, 3}) {
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      Layout l;
      const uint64_t n = l.n();
      for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
        const scapeDataType_t pt = own == scapeOptimSharded ? scapeFloat16 : scapeBfloat16;
        Cfg cfg;
        cfg.ownership = own;
        cfg.payload = scapeBfloat16;
        scapeOptim_t a = Create(c, l, cfg);
        if (!a) return false;
        std::vector<uint16_t> pa = InitialParams16(seed, n, pt), pb;
        std::vector<uint8_t> ck;
        for (int step = 0; step < kSteps; ++step) {
          if (step == 17) {
            ck = Save(a, c.comm);
            pb = pa;
          }
          GradBufs g = MakeGrads(Grads(seed, c.rank, step, n), pt);
          EXPECT_SCAPE_OK(scapeOptimStepMixed(a, pa.data(), pt, g.raw.data(), pt, n, nullptr),
                          c.comm);
        }
        EXPECT_EQ(CkMasterType(ck), static_cast<int32_t>(pt));
        // A new optimizer with other hyperparameters: the checkpoint's win.
        cfg.payload = scapeFloat32;
        cfg.wd = 0.0f;
        scapeOptim_t b = Create(c, l, cfg);
        if (!b) return false;
        EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
        for (int step = 17; step < kSteps; ++step) {
          GradBufs g = MakeGrads(Grads(seed, c.rank, step, n), pt);
          EXPECT_SCAPE_OK(scapeOptimStepMixed(b, pb.data(), pt, g.raw.data(), pt, n, nullptr),
                          c.comm);
        }
        EXPECT_EQ(pa, pb) << "params of the resumed run differ at step 50 (ownership " << own
                          << ")";
        std::vector<uint8_t> ca = Save(a, c.comm), cb = Save(b, c.comm);
        EXPECT_EQ(ca, cb) << "state (masters included) differs at step 50";
        EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
        EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
      }
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// A version-1 checkpoint (what the library wrote before mixed precision: no masters) still
// loads and resumes bit-identically; the next mixed step then makes masters from its params.
// A version-1 checkpoint claiming masters is refused.
TEST(OptimMixed, VersionOneCheckpointsStillLoad) {
  const unsigned seed = FreshSeed() + 111u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    Cfg cfg;
    cfg.payload = scapeBfloat16;
    scapeOptim_t a = Create(c, l, cfg);
    if (!a) return false;
    std::vector<float> ta(n), tb;
    {
      std::vector<uint16_t> p = InitialParams16(seed, n, scapeBfloat16);
      for (uint64_t i = 0; i < n; ++i) ta[i] = kn::Bf16ToFloat(p[i]);
    }
    std::vector<uint8_t> v1;
    for (int step = 0; step < 30; ++step) {
      if (step == 9) {
        // Written as a version-3 library wrote it (dense momentum), from the packed one and the
        // current mask it lies on.
        scapeMask_t mk = nullptr;
        uint64_t km = 0;
        EXPECT_SCAPE_OK(scapeOptimGetMask(a, &mk), c.comm);
        EXPECT_SCAPE_OK(scapeMaskGetCount(mk, &km), c.comm);
        std::vector<uint64_t> idx(km);
        EXPECT_SCAPE_OK(scapeMaskGetIndices(mk, idx.data(), km), c.comm);
        v1 = scape_test::ToVersion3(Save(a, c.comm), idx, n);
        EXPECT_FALSE(v1.empty()) << "not a version-4 checkpoint on the current mask";
        tb = ta;
      }
      std::vector<float> g = Grads(seed, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), n), c.comm);
    }
    uint32_t ver = 0;
    std::memcpy(&ver, v1.data() + 8, 4);
    EXPECT_EQ(ver, 3u);
    EXPECT_EQ(CkMasterType(v1), 0);
    ver = 1;
    std::memcpy(v1.data() + 8, &ver, 4);
    Reseal(&v1);
    scapeOptim_t b = Create(c, l, cfg);
    if (!b) return false;
    EXPECT_SCAPE_OK(scapeOptimLoad(b, v1.data(), v1.size()), c.comm);
    for (int step = 9; step < 30; ++step) {
      std::vector<float> g = Grads(seed, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), n), c.comm);
    }
    EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * n), 0) << "v1 resume differs";

    // The same v1 checkpoint into an optimizer that then steps mixed: the masters start from
    // the params given at that step (the fp32 run's params at step 9, rounded to bf16), and
    // follow the fp32 oracle started from those params widened.
    scapeOptim_t m = Create(c, l, cfg), r = Create(c, l, cfg);
    EXPECT_SCAPE_OK(scapeOptimLoad(m, v1.data(), v1.size()), c.comm);
    EXPECT_SCAPE_OK(scapeOptimLoad(r, v1.data(), v1.size()), c.comm);
    std::vector<uint16_t> p16(n);
    std::vector<float> theta(n);
    for (uint64_t i = 0; i < n; ++i) {
      p16[i] = kn::FloatToBf16(tb[i]);
      theta[i] = kn::Bf16ToFloat(p16[i]);
    }
    for (int step = 9; step < 15; ++step) {
      std::vector<float> g = Grads(seed, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(r, theta.data(), g.data(), n), c.comm);
      EXPECT_SCAPE_OK(
          scapeOptimStepMixed(m, p16.data(), scapeBfloat16, g.data(), scapeFloat32, n, nullptr),
          c.comm);
      if (!IsRounded(p16, theta, scapeBfloat16, "after a v1 load, step " + std::to_string(step)))
        return false;
    }

    // Version 1 with a master type set: refused on every rank, nothing changes.
    std::vector<uint8_t> bad = v1;
    const int32_t bt = scapeBfloat16;
    std::memcpy(bad.data() + 108, &bt, 4);
    Reseal(&bad);
    EXPECT_EQ(scapeOptimLoad(b, bad.data(), bad.size()), scapeInvalidArgument);
    EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(m), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(r), c.comm);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Refusals name the argument and change nothing.
TEST(OptimMixed, BadArgumentsAreRefused) {
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptim_t o = Create(c, l, Cfg());
    if (!o) return false;
    std::vector<uint16_t> p16 = InitialParams16(5, n, scapeBfloat16);
    std::vector<float> g(n, 0.01f);
    auto last = [&]() { return std::string(scapeGetLastError(c.comm)); };
    EXPECT_EQ(scapeOptimStepMixed(o, p16.data(), scapeInt32, g.data(), scapeFloat32, n, nullptr),
              scapeInvalidArgument);
    EXPECT_NE(last().find("paramType"), std::string::npos) << last();
    EXPECT_EQ(scapeOptimStepMixed(o, p16.data(), scapeBfloat16, g.data(), scapeInt64, n, nullptr),
              scapeInvalidArgument);
    EXPECT_NE(last().find("gradType"), std::string::npos) << last();
    EXPECT_EQ(
        scapeOptimStepMixed(o, p16.data(), scapeBfloat16, g.data(), scapeFloat32, n + 1, nullptr),
        scapeInvalidArgument);
    EXPECT_NE(last().find("count"), std::string::npos) << last();
    EXPECT_EQ(scapeOptimStepMixed(o, nullptr, scapeBfloat16, g.data(), scapeFloat32, n, nullptr),
              scapeInvalidArgument);
    EXPECT_NE(last().find("params"), std::string::npos) << last();
    EXPECT_EQ(scapeOptimStepMixed(o, reinterpret_cast<uint8_t*>(p16.data()) + 1, scapeBfloat16,
                                  g.data(), scapeFloat32, n, nullptr),
              scapeInvalidArgument);
    EXPECT_NE(last().find("aligned"), std::string::npos) << last();
    EXPECT_EQ(
        scapeOptimStepMixed(o, p16.data(), scapeBfloat16, p16.data(), scapeBfloat16, n, nullptr),
        scapeInvalidArgument);
    EXPECT_NE(last().find("overlap"), std::string::npos) << last();
    int dummy = 0;
    EXPECT_EQ(scapeOptimStepMixed(o, p16.data(), scapeBfloat16, g.data(), scapeFloat32, n, &dummy),
              scapeInvalidArgument);
    EXPECT_NE(last().find("stream"), std::string::npos) << last();
    scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
    EXPECT_SCAPE_OK(scapeOptimGetInfo(o, &info), c.comm);
    EXPECT_EQ(info.step, 0) << "a refused call changed the optimizer";
    EXPECT_EQ(info.stateBytes, 4 * n + 4 * info.maskCount) << "a refused call made masters";
    // One mixed step: the masters exist, the param type is fixed, fp32 steps are refused.
    EXPECT_SCAPE_OK(
        scapeOptimStepMixed(o, p16.data(), scapeBfloat16, g.data(), scapeFloat32, n, nullptr),
        c.comm);
    EXPECT_EQ(scapeOptimStepMixed(o, p16.data(), scapeFloat16, g.data(), scapeFloat32, n, nullptr),
              scapeInvalidArgument);
    EXPECT_NE(last().find("paramType"), std::string::npos) << last();
    std::vector<float> t(n, 0.0f);
    EXPECT_EQ(scapeOptimStep(o, t.data(), g.data(), n), scapeInvalidUsage);
    EXPECT_NE(last().find("scapeOptimStepMixed"), std::string::npos) << last();
    EXPECT_SCAPE_OK(scapeOptimGetInfo(o, &info), c.comm);
    EXPECT_EQ(info.step, 1);
    EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The kernels' ModelCopy (kernels/cpu/scape_step.h): each update kernel with a copy leaves
// theta and m exactly as without, and the copy is round(theta) at every position, whatever it
// held before; bad copies are refused.
TEST(OptimMixed, KernelsWriteTheCopyEverywhere) {
  std::mt19937 rng(FreshSeed());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t n : {size_t{0}, size_t{1}, size_t{37}, size_t{5000}})
    for (scapeDataType_t ct : {scapeBfloat16, scapeFloat16})
      for (float wd : {0.0f, 0.1f}) {
        std::vector<uint64_t> mask;
        for (uint64_t i = 0; i < n; ++i)
          if (rng() % 5 == 0) mask.push_back(i);
        const size_t k = mask.size();
        std::vector<float> theta(n), m(n), pay(k), pairs(2 * k);
        for (float& x : theta) x = u(rng);
        for (uint64_t i : mask) m[i] = 0.1f * u(rng);
        for (float& x : pay) x = 0.1f * u(rng);
        for (float& x : pairs) x = u(rng);
        kn::AdamSParams ap;
        ap.lr = 1e-2f;
        ap.weight_decay = wd;
        std::vector<kn::MaskRun> runs{{0, n, 0, k, kn::kRunOwned}};
        kn::MaskView v;
        v.idx = mask.data();
        v.k = k;
        v.runs = runs.data();
        v.nruns = 1;
        for (int form = 0; form < 3; ++form) {
          std::vector<float> t1 = theta, m1 = m, t2 = theta, m2 = m;
          std::vector<uint16_t> cp(n, 0x7fc1);
          kn::ModelCopy c;
          c.p = cp.data();
          c.type = ct;
          kn::KernelStatus s1, s2;
          if (form == 0) {
            s1 = kn::UnpackAdamSUpdate(pay.data(), scapeFloat32, mask.data(), k, t1.data(),
                                       m1.data(), n, ap, 2);
            s2 = kn::UnpackAdamSUpdate(pay.data(), scapeFloat32, mask.data(), k, t2.data(),
                                       m2.data(), n, ap, 2, &c);
          } else if (form == 1) {
            s1 = kn::UnpackAdamSUpdateView(pay.data(), scapeFloat32, v, t1.data(), m1.data(), n, ap,
                                           2);
            s2 = kn::UnpackAdamSUpdateView(pay.data(), scapeFloat32, v, t2.data(), m2.data(), n, ap,
                                           2, false, &c);
          } else {
            s1 = kn::UnpackPairsDecayView(pairs.data(), v, t1.data(), m1.data(), n, ap, 2);
            s2 = kn::UnpackPairsDecayView(pairs.data(), v, t2.data(), m2.data(), n, ap, 2, false,
                                          &c);
          }
          ASSERT_EQ(s1, kn::KernelStatus::kOk);
          ASSERT_EQ(s2, kn::KernelStatus::kOk);
          if (n > 0) {  // memcmp of empty vectors: their data() may be null
            ASSERT_EQ(std::memcmp(t1.data(), t2.data(), 4 * n), 0) << "form " << form;
            ASSERT_EQ(std::memcmp(m1.data(), m2.data(), 4 * n), 0) << "form " << form;
          }
          for (size_t i = 0; i < n; ++i)
            ASSERT_EQ(cp[i], Round16(ct, t2[i]))
                << "form " << form << " n " << n << " wd " << wd << " at " << i;
        }
      }
  std::vector<float> t(4, 1.0f), m(4, 0.0f);
  uint64_t mask[1] = {1};
  float pay[1] = {0.1f};
  kn::AdamSParams ap;
  kn::ModelCopy bad;
  bad.p = nullptr;
  EXPECT_EQ(kn::UnpackAdamSUpdate(pay, scapeFloat32, mask, 1, t.data(), m.data(), 4, ap, 1, &bad),
            kn::KernelStatus::kInvalidArgument);
  uint16_t cp[4];
  bad.p = cp;
  bad.type = scapeFloat32;
  EXPECT_EQ(kn::UnpackAdamSUpdate(pay, scapeFloat32, mask, 1, t.data(), m.data(), 4, ap, 1, &bad),
            kn::KernelStatus::kUnsupported);
}

}  // namespace
}  // namespace scape_test
