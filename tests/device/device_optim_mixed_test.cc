// Mixed precision on device buffers (scapeOptimStepMixed with a stream) with the CPU fake device
// (tests/device/fake_device.h): real ranks over UCX, the library's device step with the device
// ops UnpackAdamSUpdateCopy (masters and 16-bit params in one pass) and
// CandidatePackResidualGrad (16-bit gradients). Every step is compared bit for bit with the
// host mixed step on the same inputs: the 16-bit params, and the whole checkpoint (momentum,
// residual, masters, masks). The host mixed step itself is checked against the fp32 step in
// tests/optim_mixed_test.cc.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

namespace kn = scape::kernels;
using fake_device::FakeRuntime;
using fake_device::Gate;
using scape_test::RankCtx;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

struct Layout {
  std::vector<uint64_t> offs{0, 0, 1, 400, 413, 1200, 2001};
  std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0};
  uint64_t n() const { return offs.back(); }
};

struct Cfg {
  int ownership = scapeOptimReplicated;
  float clip = 0.0f;
  int payload = scapeFloat32;
  float wd = 0.1f;
  int nonFinite = scapeOptimNonFiniteSkip;
  int clipNorm = scapeOptimClipNormRecovered;
};

scapeOptim_t Create(RankCtx& ctx, const Layout& l, const Cfg& k) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = l.n();
  c.nsegments = static_cast<int>(l.offs.size() - 1);
  c.segOffsets = l.offs.data();
  c.denseFlags = l.dense.data();
  c.ownership = k.ownership;
  c.lr = 1e-2f;
  c.weightDecay = k.wd;
  c.maxGradNorm = k.clip;
  c.biasCorrection = scapeBiasCorrectionAdamS;
  c.density = 0.05;
  c.warmupSteps = 4;
  c.payloadType = k.payload;
  c.nonFinite = k.nonFinite;
  c.clipNorm = k.clipNorm;
  scapeOptim_t o = nullptr;
  EXPECT_SCAPE_OK(scapeOptimCreate(&o, &c, ctx.comm), ctx.comm);
  return o;
}

std::vector<uint8_t> Save(scapeOptim_t o, scapeComm_t comm) {
  size_t bytes = 0, written = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(o, &bytes), comm);
  std::vector<uint8_t> b(bytes);
  EXPECT_SCAPE_OK(scapeOptimSave(o, b.data(), b.size(), &written), comm);
  EXPECT_EQ(written, bytes);
  return b;
}

uint16_t Round16(scapeDataType_t t, float x) {
  return t == scapeBfloat16 ? kn::FloatToBf16(x) : kn::FloatToFp16(x);
}

// Gradients of gradType as raw bytes (fresh per rank and step).
std::vector<uint8_t> Grads(unsigned seed, int rank, int step, size_t n, scapeDataType_t gt) {
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(rank) * 104729u +
                   static_cast<unsigned>(step));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint8_t> b(n * scapeTypeSize(gt));
  for (size_t i = 0; i < n; ++i) {
    const float x = d(rng);
    if (gt == scapeFloat32)
      std::memcpy(b.data() + 4 * i, &x, 4);
    else
      reinterpret_cast<uint16_t*>(b.data())[i] = Round16(gt, x);
  }
  return b;
}

std::vector<uint16_t> Params16(unsigned seed, size_t n, scapeDataType_t pt) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<uint16_t> p(n);
  for (uint16_t& x : p) x = Round16(pt, d(rng));
  return p;
}

// A host and a device mixed optimizer stepped side by side.
struct Pair {
  RankCtx& ctx;
  Layout l;
  size_t n;
  scapeDataType_t pt, gt;
  scapeOptim_t host = nullptr, dev = nullptr;
  std::vector<uint16_t> hp;
  uint16_t* dp = nullptr;
  void* dg = nullptr;
  void* s = nullptr;
  Pair(RankCtx& c, const Cfg& k, unsigned seed, scapeDataType_t p, scapeDataType_t g)
      : ctx(c), n(l.n()), pt(p), gt(g) {
    host = Create(ctx, l, k);
    dev = Create(ctx, l, k);
    hp = Params16(seed, n, pt);
    dp = static_cast<uint16_t*>(Fake().DeviceMalloc(2 * n));
    dg = Fake().DeviceMalloc(4 * n);
    std::memcpy(dp, hp.data(), 2 * n);
    s = Fake().NewStream();
  }
  ~Pair() {
    EXPECT_SCAPE_OK(scapeOptimDestroy(dev), ctx.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(host), ctx.comm);
    Fake().DeviceFree(dp);
    Fake().DeviceFree(dg);
  }
  bool Step(unsigned seed, int t, bool compareState) {
    std::vector<uint8_t> g = Grads(seed, ctx.rank, t, n, gt);
    EXPECT_SCAPE_OK(scapeOptimStepMixed(host, hp.data(), pt, g.data(), gt, n, nullptr), ctx.comm);
    std::memcpy(dg, g.data(), g.size());  // the last device step has finished (synchronised)
    EXPECT_SCAPE_OK(scapeOptimStepMixed(dev, dp, pt, dg, gt, n, s), ctx.comm);
    EXPECT_TRUE(Fake().StreamSynchronize(s).ok());
    bool ok = std::memcmp(dp, hp.data(), 2 * n) == 0;
    EXPECT_TRUE(ok) << "16-bit params differ after step " << t;
    if (compareState) {
      std::vector<uint8_t> a = Save(host, ctx.comm), b = Save(dev, ctx.comm);
      EXPECT_EQ(a, b) << "checkpoint (masters included) after step " << t;
      ok = ok && a == b;
    }
    return ok && !::testing::Test::HasFailure();
  }
};

class DeviceOptimMixed : public ::testing::TestWithParam<int> {};

// Twenty steps, both ownerships, clip off and on, bf16 and fp16 params with 16-bit and fp32
// gradients and bf16/fp32 payloads: the device gives the host's params and state bit for bit.
TEST_P(DeviceOptimMixed, TwentyStepsMatchTheHostMixedStep) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  struct Combo {
    int own;
    float clip;
    int payload;
    scapeDataType_t pt, gt;
    float wd;
    int clipNorm = scapeOptimClipNormRecovered;
  };
  const Combo combos[] = {
      {scapeOptimReplicated, 0.0f, scapeFloat32, scapeBfloat16, scapeBfloat16, 0.1f},
      {scapeOptimReplicated, 1.0f, scapeBfloat16, scapeFloat16, scapeFloat32, 0.1f},
      {scapeOptimReplicated, 0.0f, scapeFloat16, scapeBfloat16, scapeFloat16, 0.0f},
      {scapeOptimSharded, 0.0f, scapeBfloat16, scapeBfloat16, scapeFloat32, 0.1f},
      {scapeOptimSharded, 1.0f, scapeFloat32, scapeFloat16, scapeFloat16, 0.0f},
      // local clipping (issue 30): the 16-bit gradients' norm on the device, widened
      {scapeOptimReplicated, 1.0f, scapeFloat32, scapeBfloat16, scapeBfloat16, 0.1f,
       scapeOptimClipNormLocal},
      {scapeOptimSharded, 1.0f, scapeBfloat16, scapeFloat16, scapeFloat16, 0.1f,
       scapeOptimClipNormLocal},
  };
  for (const Combo& k : combos) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      Fake();
      Cfg c;
      c.ownership = k.own;
      c.clip = k.clip;
      c.payload = k.payload;
      c.wd = k.wd;
      c.clipNorm = k.clipNorm;
      Pair p(ctx, c, seed, k.pt, k.gt);
      const uint64_t updates = Fake().updates.load(), pairs = Fake().pairUpdates.load(),
                     unpacks = Fake().pairUnpacks.load();
      for (int t = 0; t < 20; ++t)
        if (!p.Step(seed, t, true)) return false;
      // One update op per step (with the 16-bit copy in the same pass); sharded: the owner's
      // pairs, then one unpack of the gathered pairs (which writes the copy).
      const bool sh = k.own == scapeOptimSharded;
      EXPECT_EQ(Fake().updates.load(), updates + (sh ? 0 : 20)) << "update ops";
      EXPECT_EQ(Fake().pairUpdates.load(), pairs + (sh ? 20 : 0)) << "pairs update ops";
      EXPECT_EQ(Fake().pairUnpacks.load(), unpacks + (sh ? 20 : 0)) << "pairs unpack ops";
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << " own=" << k.own << " clip=" << k.clip
                             << " payload=" << k.payload << " params=" << k.pt << " grads=" << k.gt
                             << " seed=" << seed << ": " << res.Describe();
  }
}

// A non-finite 16-bit gradient on one rank (at an even index: read as fp32 words, its exponent
// would sit in the low half of a word and look finite): the device step, like the host step,
// is skipped on every rank, and the runs stay bit-identical afterwards.
TEST_P(DeviceOptimMixed, NonFiniteSixteenBitGradientIsSkippedLikeOnTheHost) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  for (scapeDataType_t gt : {scapeBfloat16, scapeFloat16}) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      Fake();
      Pair p(ctx, Cfg(), seed, scapeBfloat16, gt);
      for (int t = 0; t < 8; ++t) {
        std::vector<uint8_t> g = Grads(seed, ctx.rank, t, p.n, gt);
        if (t == 4 && ctx.rank == P - 1)
          reinterpret_cast<uint16_t*>(g.data())[2] = gt == scapeBfloat16 ? 0x7f80 : 0x7c00;
        EXPECT_SCAPE_OK(scapeOptimStepMixed(p.host, p.hp.data(), p.pt, g.data(), gt, p.n, nullptr),
                        ctx.comm);
        std::memcpy(p.dg, g.data(), g.size());
        EXPECT_SCAPE_OK(scapeOptimStepMixed(p.dev, p.dp, p.pt, p.dg, gt, p.n, p.s), ctx.comm);
        EXPECT_TRUE(Fake().StreamSynchronize(p.s).ok());
        EXPECT_EQ(std::memcmp(p.dp, p.hp.data(), 2 * p.n), 0) << "params after step " << t;
        EXPECT_EQ(Save(p.host, ctx.comm), Save(p.dev, ctx.comm)) << "state after step " << t;
      }
      scapeOptimInfo_t hi = SCAPE_OPTIM_INFO_INITIALIZER, di = SCAPE_OPTIM_INFO_INITIALIZER;
      EXPECT_SCAPE_OK(scapeOptimGetInfo(p.host, &hi), ctx.comm);
      EXPECT_SCAPE_OK(scapeOptimGetInfo(p.dev, &di), ctx.comm);
      EXPECT_EQ(hi.skippedSteps, 1u);
      EXPECT_EQ(di.skippedSteps, 1u) << "the device step did not see the 16-bit inf";
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << " grads=" << gt << " seed=" << seed << ": "
                             << res.Describe();
  }
}

// Checkpoint at step 17 from the device state, loaded into a fresh optimizer that steps on the
// device: step 50 equals the uninterrupted device run and the host run; a device checkpoint
// loads into a host optimizer and the reverse.
TEST_P(DeviceOptimMixed, CheckpointResumeOnDeviceIsBitIdentical) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      FakeRuntime& rt = Fake();
      Cfg c;
      c.ownership = own;
      c.payload = scapeBfloat16;
      Pair p(ctx, c, seed, scapeBfloat16, scapeBfloat16);
      const size_t n = p.n;
      std::vector<uint8_t> ck;
      std::vector<uint16_t> p17;
      for (int t = 0; t < 50; ++t) {
        if (t == 17) {
          ck = Save(p.dev, ctx.comm);
          EXPECT_EQ(ck, Save(p.host, ctx.comm));
          p17 = p.hp;
        }
        if (!p.Step(seed, t, false)) return false;
      }
      // Resume on the device in a new optimizer (other hyperparameters: the checkpoint's win).
      Cfg c2 = c;
      c2.payload = scapeFloat32;
      scapeOptim_t d2 = Create(ctx, p.l, c2), h2 = Create(ctx, p.l, c2);
      uint16_t* dp2 = static_cast<uint16_t*>(rt.DeviceMalloc(2 * n));
      void* dg2 = rt.DeviceMalloc(2 * n);
      std::memcpy(dp2, p17.data(), 2 * n);
      std::vector<uint16_t> hp2 = p17;
      EXPECT_SCAPE_OK(scapeOptimLoad(d2, ck.data(), ck.size()), ctx.comm);
      EXPECT_SCAPE_OK(scapeOptimLoad(h2, ck.data(), ck.size()), ctx.comm);
      for (int t = 17; t < 50; ++t) {
        std::vector<uint8_t> g = Grads(seed, ctx.rank, t, n, scapeBfloat16);
        std::memcpy(dg2, g.data(), g.size());
        EXPECT_SCAPE_OK(scapeOptimStepMixed(d2, dp2, scapeBfloat16, dg2, scapeBfloat16, n, p.s),
                        ctx.comm);
        EXPECT_SCAPE_OK(
            scapeOptimStepMixed(h2, hp2.data(), scapeBfloat16, g.data(), scapeBfloat16, n, nullptr),
            ctx.comm);
        EXPECT_TRUE(rt.StreamSynchronize(p.s).ok());
      }
      EXPECT_EQ(std::memcmp(dp2, p.hp.data(), 2 * n), 0) << "device resume differs at step 50";
      EXPECT_EQ(hp2, p.hp) << "host resume of a device checkpoint differs at step 50";
      std::vector<uint8_t> end = Save(p.host, ctx.comm);
      EXPECT_EQ(Save(p.dev, ctx.comm), end);
      EXPECT_EQ(Save(d2, ctx.comm), end);
      EXPECT_EQ(Save(h2, ctx.comm), end);
      // d2 holds its state (masters included) on the device now: loading the step-17
      // checkpoint there restores the device masters, and a replay reaches the same bits.
      std::memcpy(dp2, p17.data(), 2 * n);
      EXPECT_SCAPE_OK(scapeOptimLoad(d2, ck.data(), ck.size()), ctx.comm);
      for (int t = 17; t < 50; ++t) {
        std::vector<uint8_t> g = Grads(seed, ctx.rank, t, n, scapeBfloat16);
        std::memcpy(dg2, g.data(), g.size());
        EXPECT_SCAPE_OK(scapeOptimStepMixed(d2, dp2, scapeBfloat16, dg2, scapeBfloat16, n, p.s),
                        ctx.comm);
        EXPECT_TRUE(rt.StreamSynchronize(p.s).ok());
      }
      EXPECT_EQ(std::memcmp(dp2, p.hp.data(), 2 * n), 0) << "replay after a load into device "
                                                            "state differs at step 50";
      EXPECT_EQ(Save(d2, ctx.comm), end);
      // Device state -> a host step (the masters come back to the host) and on.
      std::vector<uint16_t> dcopy(dp2, dp2 + n);
      for (int t = 50; t < 53; ++t) {
        std::vector<uint8_t> g = Grads(seed, ctx.rank, t, n, scapeBfloat16);
        EXPECT_SCAPE_OK(scapeOptimStepMixed(d2, dcopy.data(), scapeBfloat16, g.data(),
                                            scapeBfloat16, n, nullptr),
                        ctx.comm);
        EXPECT_SCAPE_OK(
            scapeOptimStepMixed(h2, hp2.data(), scapeBfloat16, g.data(), scapeBfloat16, n, nullptr),
            ctx.comm);
      }
      EXPECT_EQ(dcopy, hp2) << "device state moved to the host differs";
      EXPECT_EQ(Save(d2, ctx.comm), Save(h2, ctx.comm));
      EXPECT_SCAPE_OK(scapeOptimDestroy(d2), ctx.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(h2), ctx.comm);
      rt.DeviceFree(dp2);
      rt.DeviceFree(dg2);
      return !::testing::Test::HasFailure();
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << " own=" << own << ": " << res.Describe();
  }
}

// Host/device mixes and a held stream: the call refuses mixes, and otherwise enqueues and
// returns (nothing written until the stream runs) after the first step (whose master
// initialisation waits for the stream once).
TEST_P(DeviceOptimMixed, EnqueuesAndRefusesMixes) {
  const int P = GetParam();
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(P, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    // Without the non-finite check: with it, the call waits for the scan's result (scape.h),
    // which the held stream would not give.
    Cfg c;
    c.nonFinite = scapeOptimNonFiniteIgnore;
    Pair p(ctx, c, seed, scapeBfloat16, scapeFloat32);
    std::vector<float> hg(p.n, 0.0f);
    EXPECT_EQ(scapeOptimStepMixed(p.dev, p.dp, scapeBfloat16, hg.data(), scapeFloat32, p.n, p.s),
              scapeInvalidArgument);
    EXPECT_NE(std::string(scapeGetLastError(ctx.comm)).find("grads is host"), std::string::npos)
        << scapeGetLastError(ctx.comm);
    for (int t = 0; t < 2; ++t)
      if (!p.Step(seed, t, false)) return false;
    for (int t = 2; t < 4; ++t) {
      std::vector<uint8_t> g = Grads(seed, ctx.rank, t, p.n, scapeFloat32);
      EXPECT_SCAPE_OK(scapeOptimStepMixed(p.host, p.hp.data(), scapeBfloat16, g.data(),
                                          scapeFloat32, p.n, nullptr),
                      ctx.comm);
      std::memcpy(p.dg, g.data(), g.size());
      std::vector<uint16_t> before(p.dp, p.dp + p.n);
      Gate gate;
      rt.HoldStream(p.s, &gate);
      EXPECT_SCAPE_OK(scapeOptimStepMixed(p.dev, p.dp, scapeBfloat16, p.dg, scapeFloat32, p.n, p.s),
                      ctx.comm);
      EXPECT_EQ(std::memcmp(p.dp, before.data(), 2 * p.n), 0) << "written before the stream ran";
      gate.Open();
      EXPECT_TRUE(rt.StreamSynchronize(p.s).ok());
      EXPECT_EQ(std::memcmp(p.dp, p.hp.data(), 2 * p.n), 0) << "step " << t;
    }
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceOptimMixed, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

}  // namespace
