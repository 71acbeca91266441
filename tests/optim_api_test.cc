// The optimizer's API contract beyond the step's arithmetic (issues 22 and 24): handles in the
// registry (a destroyed, aborted or foreign optimizer is an argument error at every entry
// point, never a crash), the byte counters, the hyperparameter setters, and non-finite
// gradients. Over real UCX on loopback, like optim_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tests/harness.h"
#include "tests/optim_util.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

// Odd sizes, an empty segment, a 1-element segment and two always-dense segments (as
// optim_test.cc).
struct Layout {
  std::vector<uint64_t> offs{0, 0, 1, 700, 713, 713, 2000, 3001, 3011};
  std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0, 0, 1};
  uint64_t n() const { return offs.back(); }
  int nseg() const { return static_cast<int>(offs.size() - 1); }
};

scapeOptimConfig_t Config(const Layout& l, int ownership = scapeOptimReplicated,
                          scapeDataType_t payload = scapeFloat32) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = l.n();
  c.nsegments = l.nseg();
  c.segOffsets = l.offs.data();
  c.denseFlags = l.dense.data();
  c.ownership = ownership;
  c.lr = 1e-2f;
  c.weightDecay = 0.1f;
  c.maxGradNorm = 1.0f;
  c.density = 0.05;
  c.warmupSteps = 4;
  c.payloadType = payload;
  return c;
}

std::vector<float> Theta(uint64_t n) {
  std::vector<float> t(n);
  for (uint64_t i = 0; i < n; ++i)
    t[i] = static_cast<float>(InputValue(scapeFloat32, 0x1234u, 0, i));
  return t;
}

std::vector<float> Grads(unsigned seed, int rank, int64_t step, uint64_t n) {
  std::vector<float> g(n);
  for (uint64_t i = 0; i < n; ++i)
    g[i] = 0.05f * static_cast<float>(InputValue(
                       scapeFloat32, seed + static_cast<unsigned>(step) * 7919u, rank, i));
  return g;
}

bool LastErrorHas(const char* what) {
  return std::string(scapeGetLastError(nullptr)).find(what) != std::string::npos;
}

// Every optimizer entry point on a handle that is not a live optimizer: scapeInvalidArgument,
// a message naming optim, and nothing else happens. `h` may be a destroyed optimizer, one
// whose communicator was aborted, or something that is not an optimizer at all.
void ExpectEveryCallRefuses(scapeOptim_t h, uint64_t n, const char* what) {
  SCOPED_TRACE(what);
  std::vector<float> theta(n, 1.0f), g(n, 0.5f);
  const std::vector<float> before = theta;
  auto refused = [&](scapeResult_t r, const char* fn) {
    EXPECT_EQ(r, scapeInvalidArgument) << fn;
    EXPECT_TRUE(LastErrorHas(fn)) << fn << ": " << scapeGetLastError(nullptr);
    EXPECT_TRUE(LastErrorHas("optim is not a live optimizer"))
        << fn << ": " << scapeGetLastError(nullptr);
  };
  refused(scapeOptimSetLr(h, 0.5f), "scapeOptimSetLr");
  refused(scapeOptimSetBeta1(h, 0.5f), "scapeOptimSetBeta1");
  refused(scapeOptimSetBeta2(h, 0.5f), "scapeOptimSetBeta2");
  refused(scapeOptimSetEps(h, 1e-6f), "scapeOptimSetEps");
  refused(scapeOptimSetWeightDecay(h, 0.01f), "scapeOptimSetWeightDecay");
  refused(scapeOptimStep(h, theta.data(), g.data(), n), "scapeOptimStep");
  refused(scapeOptimStepStream(h, theta.data(), g.data(), n, nullptr), "scapeOptimStepStream");
  scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
  std::memset(&info, 0x5a, sizeof(info));
  refused(scapeOptimGetInfo(h, &info), "scapeOptimGetInfo");
  scapeMask_t mask = reinterpret_cast<scapeMask_t>(0x1);
  refused(scapeOptimGetMask(h, &mask), "scapeOptimGetMask");
  EXPECT_EQ(mask, reinterpret_cast<scapeMask_t>(0x1)) << "GetMask wrote a mask";
  size_t sz = 7;
  refused(scapeOptimCheckpointSize(h, &sz), "scapeOptimCheckpointSize");
  EXPECT_EQ(sz, 7u);
  std::vector<uint8_t> buf(64);
  size_t w = 0;
  refused(scapeOptimSave(h, buf.data(), buf.size(), &w), "scapeOptimSave");
  refused(scapeOptimLoad(h, buf.data(), buf.size()), "scapeOptimLoad");
  refused(scapeOptimDestroy(h), "scapeOptimDestroy");
  EXPECT_EQ(std::memcmp(theta.data(), before.data(), 4 * n), 0);
}

// A destroyed optimizer, a second destroy, an optimizer freed by scapeCommAbort and handles
// that were never optimizers: every call is an argument error (before this, GetInfo and SetLr
// crashed with SIGSEGV, a second destroy aborted, GetMask returned a dangling mask).
TEST(OptimHandles, DestroyedAbortedAndForeignHandlesAreRefused) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptimConfig_t cfg = Config(l);
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!opt) return false;
    std::vector<float> theta = Theta(n), g = Grads(5, c.rank, 0, n);
    EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeOptimGetMask(opt, &mask), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    ExpectEveryCallRefuses(opt, n, "destroyed");
    // The optimizer's mask went with it.
    uint64_t k = 0;
    EXPECT_EQ(scapeMaskGetCount(mask, &k), scapeInvalidArgument);

    // Foreign handles: a mask, a communicator and a heap block are not optimizers.
    scapeMask_t other = nullptr;
    EXPECT_SCAPE_OK(scapeMaskCreate(&other, n, l.nseg(), l.offs.data(), nullptr,
                                    scapeOwnershipShards, scapeMaskEncodingAuto, c.comm),
                    c.comm);
    ExpectEveryCallRefuses(reinterpret_cast<scapeOptim_t>(other), n, "a mask handle");
    ExpectEveryCallRefuses(reinterpret_cast<scapeOptim_t>(c.comm), n, "a communicator handle");
    std::vector<uint64_t> junk(64, 0);
    ExpectEveryCallRefuses(reinterpret_cast<scapeOptim_t>(junk.data()), n, "a heap block");
    // The real ones still work after all that.
    uint64_t count = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(other, &count), c.comm);
    EXPECT_SCAPE_OK(scapeMaskDestroy(other), c.comm);

    // An optimizer freed by scapeCommAbort (with a step and a mask sync behind it).
    scapeOptim_t o2 = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&o2, &cfg, c.comm), c.comm);
    if (!o2) return false;
    EXPECT_SCAPE_OK(scapeOptimStep(o2, theta.data(), g.data(), n), c.comm);
    scapeMask_t m2 = nullptr;
    EXPECT_SCAPE_OK(scapeOptimGetMask(o2, &m2), c.comm);
    EXPECT_SCAPE_OK(scapeBarrier(c.comm), c.comm);
    EXPECT_EQ(scapeCommAbort(c.comm), scapeSuccess);
    c.comm = nullptr;
    ExpectEveryCallRefuses(o2, n, "freed by scapeCommAbort");
    EXPECT_EQ(scapeMaskGetCount(m2, &k), scapeInvalidArgument);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// maskWaitSeconds is the part of the sync_wait phase spent blocked on the previous step's mask
// sync: 0 at the first step (no sync pending) and before it, never negative, never more than
// the phase it is part of.
TEST(OptimCounters, MaskWaitIsPartOfTheSyncWaitPhase) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptimConfig_t cfg = Config(l, scapeOptimReplicated, scapeFloat32);
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!opt) return false;
    scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
    std::memset(&info, 0x7f, sizeof(info));
    info.size = sizeof(info);
    info.magic = SCAPE_OPTIM_INFO_MAGIC;
    EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
    EXPECT_EQ(info.maskWaitSeconds, 0.0) << "before the first step";
    std::vector<float> theta = Theta(n);
    for (int step = 0; step < 5; ++step) {
      std::vector<float> g = Grads(3, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
      EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
      if (step == 0) {
        EXPECT_EQ(info.maskWaitSeconds, 0.0) << "the first step has no sync to wait for";
      }
      EXPECT_GE(info.maskWaitSeconds, 0.0) << "step " << step;
      EXPECT_LE(info.maskWaitSeconds, info.phaseSeconds[scapeOptimPhaseSyncWait])
          << "step " << step;
    }
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeOptimInfo_t is versioned through its size (issue 44 item 6): a caller built against an
// older header (here: the struct as it was before the appended controlBytes, skippedSteps and
// maskWaitSeconds) passes a smaller struct and gets the fields it knows, with nothing written
// past it and size set to what was filled; a struct that was never initialised (no magic) or
// too small to hold the size and magic fields is an argument error with nothing written.
TEST(OptimCounters, InfoIsVersionedBySize) {
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptimConfig_t cfg = Config(l, scapeOptimReplicated, scapeFloat32);
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!opt) return false;
    std::vector<float> theta = Theta(n);
    for (int step = 0; step < 2; ++step) {
      std::vector<float> g = Grads(5, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
    }
    scapeOptimInfo_t full = SCAPE_OPTIM_INFO_INITIALIZER;
    EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &full), c.comm);
    EXPECT_EQ(full.size, sizeof(scapeOptimInfo_t));
    EXPECT_EQ(full.step, 2);
    // The older caller's struct: everything before the appended fields, then a guard zone.
    const size_t oldSize = offsetof(scapeOptimInfo_t, controlBytes);
    std::vector<unsigned char> buf(sizeof(scapeOptimInfo_t) + 64, 0xA5);
    scapeOptimInfo_t head = SCAPE_OPTIM_INFO_INITIALIZER;
    head.size = oldSize;
    std::memcpy(buf.data(), &head, offsetof(scapeOptimInfo_t, step));
    EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, reinterpret_cast<scapeOptimInfo_t*>(buf.data())),
                    c.comm);
    for (size_t i = oldSize; i < buf.size(); ++i)
      if (buf[i] != 0xA5) {
        ADD_FAILURE() << "byte " << i << " past the caller's " << oldSize << "-byte struct written";
        break;
      }
    scapeOptimInfo_t got;
    std::memcpy(&got, buf.data(), sizeof(got));
    EXPECT_EQ(got.size, oldSize) << "size says what was filled";
    EXPECT_EQ(got.magic, SCAPE_OPTIM_INFO_MAGIC);
    EXPECT_EQ(got.step, full.step);
    EXPECT_EQ(got.maskCount, full.maskCount);
    EXPECT_EQ(got.payloadBytes, full.payloadBytes);
    EXPECT_EQ(std::memcmp(got.phaseSeconds, full.phaseSeconds, sizeof(got.phaseSeconds)), 0);
    // Not initialised (no magic), and too small for its own header: refused, nothing written.
    for (int bad = 0; bad < 2; ++bad) {
      std::vector<unsigned char> b2(sizeof(scapeOptimInfo_t), 0x3C);
      scapeOptimInfo_t h2 = SCAPE_OPTIM_INFO_INITIALIZER;
      if (bad == 0) h2.magic = 0;
      if (bad == 1) h2.size = sizeof(size_t);
      std::memcpy(b2.data(), &h2, offsetof(scapeOptimInfo_t, step));
      const std::vector<unsigned char> before = b2;
      EXPECT_EQ(scapeOptimGetInfo(opt, reinterpret_cast<scapeOptimInfo_t*>(b2.data())),
                scapeInvalidArgument)
          << (bad == 0 ? "no magic" : "size too small");
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("SCAPE_OPTIM_INFO_INITIALIZER"),
                std::string::npos)
          << scapeGetLastError(c.comm);
      EXPECT_TRUE(b2 == before) << "nothing written";
    }
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

uint64_t RingAllReduce(uint64_t bytes, int p) { return p <= 1 ? 0 : 2 * bytes * (p - 1) / p; }
uint64_t RingHalf(uint64_t bytes, int p) { return p <= 1 ? 0 : bytes * (p - 1) / p; }

// The byte counters say what they count: replicated, the payload all-reduce (sparse and dense
// positions apart); sharded, the reduce-scatter of the payload and the all-gather of the
// (param, momentum) pairs. controlBytes: the non-finite agreement (8(P-1)) and, sharded, the
// all-gather of the norm partials (8(P-1) more), not in payloadBytes.
TEST(OptimCounters, BytesByCategory) {
  for (int P : {1, 2, 3}) {
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      Layout l;
      const uint64_t n = l.n();
      for (int own : {scapeOptimReplicated, scapeOptimSharded})
        for (scapeDataType_t pt : {scapeFloat32, scapeBfloat16}) {
          scapeOptimConfig_t cfg = Config(l, own, pt);
          scapeOptim_t opt = nullptr;
          EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
          if (!opt) return false;
          scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
          EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
          EXPECT_EQ(info.controlBytes, 0u) << "before the first step";
          EXPECT_EQ(info.skippedSteps, 0);
          std::vector<float> theta = Theta(n);
          const uint64_t esz = pt == scapeFloat32 ? 4 : 2;
          for (int step = 0; step < 6; ++step) {
            std::vector<float> g = Grads(9, c.rank, step, n);
            EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
            EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
            const uint64_t k = info.maskCount, kd = info.denseCount, ks = k - kd;
            EXPECT_GT(ks, 0u);
            EXPECT_EQ(kd, 713u - 700u + 3011u - 3001u);
            if (own == scapeOptimReplicated) {
              EXPECT_EQ(info.payloadBytes, RingAllReduce(ks * esz, P));
              EXPECT_EQ(info.denseBytes, RingAllReduce(kd * esz, P));
              EXPECT_EQ(info.controlBytes, 8u * static_cast<uint64_t>(P - 1));  // agreement
            } else {
              EXPECT_EQ(info.payloadBytes, RingHalf(ks * esz, P) + RingHalf(ks * 8, P));
              EXPECT_EQ(info.denseBytes, RingHalf(kd * esz, P) + RingHalf(kd * 8, P));
              EXPECT_EQ(info.controlBytes, 16u * static_cast<uint64_t>(P - 1));  // + norms
            }
          }
          EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
        }
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// Runs `steps` steps of `opt` on rank `rank`'s gradients from `theta`; returns the parameters.
std::vector<float> Steps(scapeOptim_t opt, scapeComm_t comm, int rank, int first, int steps,
                         std::vector<float> theta) {
  const uint64_t n = theta.size();
  for (int s = first; s < first + steps; ++s) {
    std::vector<float> g = Grads(77, rank, s, n);
    EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), comm);
  }
  return theta;
}

// Each setter before the first step gives the bits of an optimizer configured with the value
// (an independent path: scapeOptimCreate's validation and copy); scapeOptimSetHyperparams
// equals the five single setters; a change mid-run changes the following steps (and only
// those), identically on every rank; a checkpoint carries the values set.
TEST(OptimHyper, SettersActLikeTheConfiguration) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    const scapeOptimConfig_t base = Config(l);
    struct Case {
      const char* name;
      std::function<scapeResult_t(scapeOptim_t)> set;
      std::function<void(scapeOptimConfig_t*)> cfg;
    };
    const std::vector<Case> cases = {
        {"beta1", [](scapeOptim_t o) { return scapeOptimSetBeta1(o, 0.8f); },
         [](scapeOptimConfig_t* x) { x->beta1 = 0.8f; }},
        {"beta2", [](scapeOptim_t o) { return scapeOptimSetBeta2(o, 0.99f); },
         [](scapeOptimConfig_t* x) { x->beta2 = 0.99f; }},
        {"eps", [](scapeOptim_t o) { return scapeOptimSetEps(o, 1e-3f); },
         [](scapeOptimConfig_t* x) { x->eps = 1e-3f; }},
        {"weightDecay", [](scapeOptim_t o) { return scapeOptimSetWeightDecay(o, 0.5f); },
         [](scapeOptimConfig_t* x) { x->weightDecay = 0.5f; }},
        {"all five",
         [](scapeOptim_t o) {
           return scapeOptimSetHyperparams(o, 3e-2f, 0.85f, 0.9f, 1e-6f, 0.2f);
         },
         [](scapeOptimConfig_t* x) {
           x->lr = 3e-2f;
           x->beta1 = 0.85f;
           x->beta2 = 0.9f;
           x->eps = 1e-6f;
           x->weightDecay = 0.2f;
         }},
    };
    const std::vector<float> theta0 = Theta(n);
    const std::vector<float> plain = [&] {
      scapeOptim_t o = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&o, &base, c.comm), c.comm);
      std::vector<float> t = Steps(o, c.comm, c.rank, 0, 6, theta0);
      EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
      return t;
    }();
    for (const Case& k : cases) {
      SCOPED_TRACE(k.name);
      scapeOptimConfig_t cfg = base;
      k.cfg(&cfg);
      scapeOptim_t configured = nullptr, set = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&configured, &cfg, c.comm), c.comm);
      EXPECT_SCAPE_OK(scapeOptimCreate(&set, &base, c.comm), c.comm);
      if (!configured || !set) return false;
      EXPECT_SCAPE_OK(k.set(set), c.comm);
      const std::vector<float> a = Steps(configured, c.comm, c.rank, 0, 6, theta0);
      const std::vector<float> b = Steps(set, c.comm, c.rank, 0, 6, theta0);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * n), 0) << "setter != configuration";
      EXPECT_NE(std::memcmp(a.data(), plain.data(), 4 * n), 0) << "the value had no effect";
      EXPECT_TRUE(SameOnAllRanks(c, b));
      EXPECT_SCAPE_OK(scapeOptimDestroy(configured), c.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(set), c.comm);
    }
    // The single setters together equal scapeOptimSetHyperparams.
    scapeOptim_t singles = nullptr, together = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&singles, &base, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimCreate(&together, &base, c.comm), c.comm);
    if (!singles || !together) return false;
    std::vector<float> t1 = Steps(singles, c.comm, c.rank, 0, 3, theta0);
    std::vector<float> t2 = Steps(together, c.comm, c.rank, 0, 3, theta0);
    EXPECT_SCAPE_OK(scapeOptimSetLr(singles, 2e-2f), c.comm);
    EXPECT_SCAPE_OK(scapeOptimSetBeta1(singles, 0.7f), c.comm);
    EXPECT_SCAPE_OK(scapeOptimSetBeta2(singles, 0.98f), c.comm);
    EXPECT_SCAPE_OK(scapeOptimSetEps(singles, 1e-5f), c.comm);
    EXPECT_SCAPE_OK(scapeOptimSetWeightDecay(singles, 0.3f), c.comm);
    EXPECT_SCAPE_OK(scapeOptimSetHyperparams(together, 2e-2f, 0.7f, 0.98f, 1e-5f, 0.3f), c.comm);
    // A checkpoint taken now carries the values: a fresh optimizer that loads it continues
    // with them.
    size_t sz = 0, w = 0;
    EXPECT_SCAPE_OK(scapeOptimCheckpointSize(together, &sz), c.comm);
    std::vector<uint8_t> ck(sz);
    EXPECT_SCAPE_OK(scapeOptimSave(together, ck.data(), ck.size(), &w), c.comm);
    scapeOptim_t loaded = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&loaded, &base, c.comm), c.comm);
    if (!loaded) return false;
    EXPECT_SCAPE_OK(scapeOptimLoad(loaded, ck.data(), w), c.comm);
    std::vector<float> t3 = t2;
    t1 = Steps(singles, c.comm, c.rank, 3, 5, t1);
    t2 = Steps(together, c.comm, c.rank, 3, 5, t2);
    t3 = Steps(loaded, c.comm, c.rank, 3, 5, t3);
    scapeOptim_t fixed = nullptr;  // never changed: 8 steps of the base values
    EXPECT_SCAPE_OK(scapeOptimCreate(&fixed, &base, c.comm), c.comm);
    if (!fixed) return false;
    const std::vector<float> unchanged = Steps(fixed, c.comm, c.rank, 0, 8, theta0);
    EXPECT_SCAPE_OK(scapeOptimDestroy(fixed), c.comm);
    EXPECT_EQ(std::memcmp(t1.data(), t2.data(), 4 * n), 0) << "single setters != SetHyperparams";
    EXPECT_EQ(std::memcmp(t2.data(), t3.data(), 4 * n), 0) << "the checkpoint lost the values";
    EXPECT_NE(std::memcmp(t2.data(), unchanged.data(), 4 * n), 0) << "the change had no effect";
    EXPECT_TRUE(SameOnAllRanks(c, t2));
    EXPECT_SCAPE_OK(scapeOptimDestroy(singles), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(together), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(loaded), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Out-of-range values are refused with a message naming the field, and change nothing.
TEST(OptimHyper, BadValuesAreRefusedAndChangeNothing) {
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    const scapeOptimConfig_t base = Config(l);
    scapeOptim_t ref = nullptr, opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&ref, &base, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &base, c.comm), c.comm);
    if (!ref || !opt) return false;
    auto refused = [&](scapeResult_t r, const char* what) {
      EXPECT_EQ(r, scapeInvalidArgument) << what;
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find(what), std::string::npos)
          << "wanted '" << what << "' in: " << scapeGetLastError(c.comm);
    };
    refused(scapeOptimSetBeta1(opt, 1.0f), "beta1 = 1");
    refused(scapeOptimSetBeta1(opt, -0.1f), "beta1");
    refused(scapeOptimSetBeta1(opt, NAN), "beta1");
    refused(scapeOptimSetBeta2(opt, 1.5f), "beta2");
    refused(scapeOptimSetBeta2(opt, NAN), "beta2");
    refused(scapeOptimSetEps(opt, -1e-8f), "eps");
    refused(scapeOptimSetEps(opt, INFINITY), "eps");
    refused(scapeOptimSetWeightDecay(opt, -0.1f), "weightDecay");
    refused(scapeOptimSetWeightDecay(opt, NAN), "weightDecay");
    refused(scapeOptimSetWeightDecay(opt, 200.0f), "lr * weightDecay");  // lr 1e-2
    refused(scapeOptimSetHyperparams(opt, 10.0f, 0.9f, 0.95f, 1e-8f, 0.2f), "lr * weightDecay");
    refused(scapeOptimSetHyperparams(opt, INFINITY, 0.9f, 0.95f, 1e-8f, 0.0f), "lr");
    refused(scapeOptimSetHyperparams(opt, 1e-3f, 0.9f, 1.0f, 1e-8f, 0.0f), "beta2");
    refused(scapeOptimSetHyperparams(opt, 1e-3f, 0.9f, 0.95f, 1e-8f, -1.0f), "weightDecay");
    // lr and weight decay that are fine together: both or neither.
    EXPECT_SCAPE_OK(scapeOptimSetHyperparams(opt, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f), c.comm);
    const std::vector<float> theta0 = Theta(n);
    const std::vector<float> a = Steps(ref, c.comm, c.rank, 0, 5, theta0);
    const std::vector<float> b = Steps(opt, c.comm, c.rank, 0, 5, theta0);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), 4 * n), 0) << "a refused value changed something";
    EXPECT_SCAPE_OK(scapeOptimDestroy(ref), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The current mask of `opt` (all ranks' parts).
std::vector<uint64_t> CurrentMask(scapeOptim_t opt, scapeComm_t comm) {
  scapeMask_t m = nullptr;
  EXPECT_SCAPE_OK(scapeOptimGetMask(opt, &m), comm);
  uint64_t k = 0;
  EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), comm);
  std::vector<uint64_t> idx(k);
  EXPECT_SCAPE_OK(scapeMaskGetIndices(m, idx.data(), k), comm);
  std::sort(idx.begin(), idx.end());
  return idx;
}

constexpr int kBadStep = 4, kSteps = 8;

// One inf or NaN in one rank's gradients (inside or outside the mask the step would use): the
// step is skipped on every rank, every byte of the parameters and of the checkpoint stays, the
// step counter stays, skippedSteps counts it, and the following finite steps give the bits of a
// run that never saw the bad step.
void NonFiniteCase(int P, int ownership) {
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    const int badRank = P - 1;
    for (scapeDataType_t pt : {scapeFloat32, scapeBfloat16}) {
      const scapeOptimConfig_t cfg = Config(l, ownership, pt);
      // The run that never sees the bad step, and the mask its step kBadStep used.
      scapeOptim_t ref = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&ref, &cfg, c.comm), c.comm);
      if (!ref) return false;
      std::vector<std::vector<float>> refTheta;
      std::vector<float> t = Theta(n);
      std::vector<uint64_t> maskAtBad;
      for (int s = 0; s < kSteps; ++s) {
        t = Steps(ref, c.comm, c.rank, s, 1, t);
        refTheta.push_back(t);
        if (s == kBadStep) maskAtBad = CurrentMask(ref, c.comm);
      }
      const std::vector<uint8_t> refEnd = Checkpoint(ref, c.comm);
      EXPECT_SCAPE_OK(scapeOptimDestroy(ref), c.comm);
      const uint64_t inside = 705;  // an always-dense segment: always in the mask
      uint64_t outside = 1000;      // a sparse position the mask of kBadStep left out
      while (std::binary_search(maskAtBad.begin(), maskAtBad.end(), outside)) ++outside;
      EXPECT_TRUE(std::binary_search(maskAtBad.begin(), maskAtBad.end(), inside));
      EXPECT_LT(maskAtBad.size(), n / 2) << "the mask is not sparse at the bad step";

      for (int where = 0; where < 2; ++where)
        for (float bad : {INFINITY, -INFINITY, NAN}) {
          const uint64_t pos = where == 0 ? inside : outside;
          SCOPED_TRACE(testing::Message() << "payload " << pt << (where ? " outside" : " inside")
                                          << " the mask, value " << bad);
          scapeOptim_t opt = nullptr;
          EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
          if (!opt) return false;
          std::vector<float> theta = Steps(opt, c.comm, c.rank, 0, kBadStep, Theta(n));
          EXPECT_EQ(std::memcmp(theta.data(), refTheta[kBadStep - 1].data(), 4 * n), 0);
          const std::vector<uint8_t> before = Checkpoint(opt, c.comm);
          const std::vector<float> thetaBefore = theta;
          // The bad step: rank badRank's gradient at pos is not finite, the rest as usual.
          std::vector<float> g = Grads(77, c.rank, kBadStep, n);
          if (c.rank == badRank) g[pos] = bad;
          EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
          EXPECT_EQ(std::memcmp(theta.data(), thetaBefore.data(), 4 * n), 0)
              << "the skipped step changed the parameters";
          EXPECT_TRUE(Checkpoint(opt, c.comm) == before)
              << "the skipped step changed the checkpointable state";
          scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
          EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
          EXPECT_EQ(info.step, kBadStep);
          EXPECT_EQ(info.skippedSteps, 1);
          EXPECT_TRUE(std::isnan(info.gradNorm));
          EXPECT_EQ(info.controlBytes, 8u * static_cast<uint64_t>(P - 1));
          EXPECT_EQ(info.payloadBytes, 0u);
          // The same step again with finite gradients, and the rest: the reference's bits.
          for (int s = kBadStep; s < kSteps; ++s) {
            theta = Steps(opt, c.comm, c.rank, s, 1, theta);
            EXPECT_EQ(std::memcmp(theta.data(), refTheta[static_cast<size_t>(s)].data(), 4 * n), 0)
                << "step " << s << " after the skip differs from the run without it";
          }
          EXPECT_TRUE(Checkpoint(opt, c.comm) == refEnd) << "the end state differs";
          EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
          EXPECT_EQ(info.step, kSteps);
          EXPECT_EQ(info.skippedSteps, 1);
          EXPECT_TRUE(SameOnAllRanks(c, theta));
          EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
        }
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
}

class OptimNonFinite : public ::testing::TestWithParam<int> {};
TEST_P(OptimNonFinite, ReplicatedSkipsOnEveryRank) {
  NonFiniteCase(GetParam(), scapeOptimReplicated);
}
TEST_P(OptimNonFinite, ShardedSkipsOnEveryRank) { NonFiniteCase(GetParam(), scapeOptimSharded); }
INSTANTIATE_TEST_SUITE_P(Ranks, OptimNonFinite, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// nonFinite = Error: every rank fails with scapeInvalidArgument naming the rank (and, on that
// rank, the position), and nothing changes; the run then continues as if the call never was.
TEST(OptimNonFiniteOptions, ErrorModeFailsOnEveryRankAndChangesNothing) {
  RunResult res = RunRanks(3, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptimConfig_t cfg = Config(l);
    cfg.nonFinite = scapeOptimNonFiniteError;
    scapeOptim_t ref = nullptr, opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&ref, &cfg, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!ref || !opt) return false;
    const std::vector<float> a = Steps(ref, c.comm, c.rank, 0, 6, Theta(n));
    std::vector<float> theta = Steps(opt, c.comm, c.rank, 0, 3, Theta(n));
    const std::vector<uint8_t> before = Checkpoint(opt, c.comm);
    const std::vector<float> thetaBefore = theta;
    std::vector<float> g = Grads(77, c.rank, 3, n);
    if (c.rank == 1) g[2345] = NAN;
    EXPECT_EQ(scapeOptimStep(opt, theta.data(), g.data(), n), scapeInvalidArgument);
    const std::string msg = scapeGetLastError(c.comm);
    EXPECT_NE(msg.find("rank 1 are not finite"), std::string::npos) << msg;
    EXPECT_NE(msg.find("scapeOptimNonFiniteError"), std::string::npos) << msg;
    if (c.rank == 1) {
      EXPECT_NE(msg.find("grads[2345] = nan"), std::string::npos) << msg;
    }
    EXPECT_EQ(std::memcmp(theta.data(), thetaBefore.data(), 4 * n), 0);
    EXPECT_TRUE(Checkpoint(opt, c.comm) == before);
    scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
    EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
    EXPECT_EQ(info.step, 3);
    EXPECT_EQ(info.skippedSteps, 0);
    theta = Steps(opt, c.comm, c.rank, 3, 3, theta);
    EXPECT_EQ(std::memcmp(theta.data(), a.data(), 4 * n), 0);
    // A bad value for nonFinite is refused at create.
    cfg.nonFinite = scapeNumOptimNonFinite;
    scapeOptim_t x = nullptr;
    EXPECT_EQ(scapeOptimCreate(&x, &cfg, c.comm), scapeInvalidArgument);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("nonFinite"), std::string::npos);
    EXPECT_SCAPE_OK(scapeOptimDestroy(ref), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The same agreement refuses per-step hyperparameters that differ between ranks, on every
// rank, before anything changes.
TEST(OptimNonFiniteOptions, RanksWithDifferentHyperparametersAreRefused) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    const scapeOptimConfig_t cfg = Config(l);
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!opt) return false;
    std::vector<float> theta = Steps(opt, c.comm, c.rank, 0, 2, Theta(n));
    const std::vector<uint8_t> before = Checkpoint(opt, c.comm);
    const std::vector<float> thetaBefore = theta;
    if (c.rank == 1) {
      EXPECT_SCAPE_OK(scapeOptimSetBeta1(opt, 0.8f), c.comm);
    }
    std::vector<float> g = Grads(77, c.rank, 2, n);
    EXPECT_EQ(scapeOptimStep(opt, theta.data(), g.data(), n), scapeInvalidUsage);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("per-step hyperparameters"),
              std::string::npos)
        << scapeGetLastError(c.comm);
    EXPECT_EQ(std::memcmp(theta.data(), thetaBefore.data(), 4 * n), 0);
    if (c.rank == 1) {
      EXPECT_SCAPE_OK(scapeOptimSetBeta1(opt, 0.9f), c.comm);
    }
    EXPECT_TRUE(Checkpoint(opt, c.comm) == before);  // (it holds the hyperparameters)
    theta = Steps(opt, c.comm, c.rank, 2, 2, theta);
    EXPECT_TRUE(SameOnAllRanks(c, theta));
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Finite gradients whose candidate overflows an fp16 payload (|c| > 65504) inside the mask: the
// reduced payload is not finite on every rank; the update is left out (parameters, momentum,
// step counter unchanged), counted as skipped; the run goes on with finite parameters.
TEST(OptimNonFiniteOptions, PayloadOverflowAfterTheExchangeIsSkipped) {
  for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
    RunResult res = RunRanks(2, [&](RankCtx& c) {
      Layout l;
      const uint64_t n = l.n();
      const scapeOptimConfig_t cfg = Config(l, own, scapeFloat16);
      scapeOptim_t opt = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
      if (!opt) return false;
      std::vector<float> theta = Steps(opt, c.comm, c.rank, 0, 3, Theta(n));
      const std::vector<float> thetaBefore = theta;
      std::vector<float> g = Grads(77, c.rank, 3, n);
      if (c.rank == 0) g[705] = 1e7f;  // finite; (1 - b1) * g = 1e6 > 65504
      EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
      EXPECT_EQ(std::memcmp(theta.data(), thetaBefore.data(), 4 * n), 0);
      scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
      EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
      EXPECT_EQ(info.step, 3);
      EXPECT_EQ(info.skippedSteps, 1);
      EXPECT_GT(info.payloadBytes, 0u);  // the exchange did run
      // The momentum stayed on the mask it was on (the mask moved on): a checkpoint taken now
      // (format version 4 with the momentum's own positions) resumes bit-identically.
      size_t sz = 0, w = 0;
      EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), c.comm);
      std::vector<uint8_t> ck(sz);
      EXPECT_SCAPE_OK(scapeOptimSave(opt, ck.data(), sz, &w), c.comm);
      uint64_t own = 0;
      if (w >= 160) std::memcpy(&own, ck.data() + 152, 8);
      EXPECT_EQ(own, 1u) << "the momentum has no mask of its own after the skip";
      scapeOptim_t resumed = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&resumed, &cfg, c.comm), c.comm);
      if (!resumed) return false;
      EXPECT_SCAPE_OK(scapeOptimLoad(resumed, ck.data(), w), c.comm);
      const std::vector<float> thetaResumed = Steps(resumed, c.comm, c.rank, 3, 4, theta);
      EXPECT_SCAPE_OK(scapeOptimDestroy(resumed), c.comm);
      theta = Steps(opt, c.comm, c.rank, 3, 4, theta);
      EXPECT_EQ(std::memcmp(theta.data(), thetaResumed.data(), 4 * n), 0)
          << "the resumed run differs";
      for (float x : theta) EXPECT_TRUE(std::isfinite(x));
      EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
      EXPECT_EQ(info.step, 7);
      EXPECT_EQ(info.skippedSteps, 1);
      EXPECT_TRUE(SameOnAllRanks(c, theta));
      EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "ownership " << own << ": " << res.Describe();
  }
}

}  // namespace
}  // namespace scape_test
