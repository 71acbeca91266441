// The "segment_rms" entering rule of kernels/cpu/scape_step.h (AdamSParams.enter_vs and
// StayingGradSqBlocks), against a double-precision reference written here from the contract's
// formulas (issue 23; docs/ALGORITHM.md 4.12), and the bit-equality of the kernels that apply it
// (flat, view, pairs; any thread count).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scape_step.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

using testing_util::RandomMask;
using testing_util::RandomNormal;

std::vector<uint8_t> Encode(const std::vector<float>& v, scapeDataType_t t) {
  const size_t esz = PayloadElementSize(t);
  std::vector<uint8_t> out(v.size() * esz + 1);
  for (size_t j = 0; j < v.size(); ++j) {
    if (t == scapeFloat32) {
      std::memcpy(out.data() + 4 * j, &v[j], 4);
    } else {
      const uint16_t h = t == scapeBfloat16 ? FloatToBf16(v[j]) : FloatToFp16(v[j]);
      std::memcpy(out.data() + 2 * j, &h, 2);
    }
  }
  return out;
}
double Decoded(const std::vector<uint8_t>& p, scapeDataType_t t, size_t j) {
  if (t == scapeFloat32) {
    float f;
    std::memcpy(&f, p.data() + 4 * j, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p.data() + 2 * j, 2);
  return t == scapeBfloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// Segments with odd sizes, empty ones, and (by the test) some with no staying coordinate.
std::vector<uint64_t> Segments(std::mt19937_64& rng, uint64_t n) {
  std::vector<uint64_t> off{0};
  while (off.back() < n) {
    const uint64_t len = rng() % 5 == 0 ? 0 : 1 + rng() % std::max<uint64_t>(1, n / 3 + 1);
    off.push_back(std::min(n, off.back() + len));
  }
  if (off.size() == 1) off.push_back(0);  // n == 0: one empty segment
  return off;
}

struct Case {
  uint64_t n;
  double density;
  scapeDataType_t type;
  float clip;
  BiasCorrection bias;
  bool mcap = false;  // AdamSParams.enter_momentum_cap (momentum factor masking)
};

struct Result {
  std::vector<float> theta, m, vs;
};

// The kernel path of one step: staying sums per segment (blocks + blocked order), the segment
// values, then the update.
Result RunKernels(const Case& cs, const std::vector<uint64_t>& off,
                  const std::vector<uint64_t>& mask, const std::vector<uint8_t>& payload,
                  const std::vector<float>& theta0, const std::vector<float>& m0,
                  const AdamSParams& base, int threads) {
  const size_t nseg = off.size() - 1, k = mask.size();
  // Pieces = the segments' entries of the sorted mask.
  std::vector<uint64_t> bounds{0};
  std::vector<size_t> first{0};
  size_t j = 0;
  for (size_t s = 0; s < nseg; ++s) {
    const size_t jb = j;
    while (j < k && mask[j] < off[s + 1]) ++j;
    const size_t nb = StayingBlockCount(j - jb);
    bounds.resize(bounds.size() + nb);
    EXPECT_EQ(StayingBlockBounds(jb, j, bounds.data() + bounds.size() - nb), nb);
    first.push_back(first.back() + nb);
  }
  const size_t nb = bounds.size() - 1;
  std::vector<double> sums(nb + 1);
  std::vector<uint64_t> counts(nb + 1);
  EXPECT_EQ(StayingGradSqBlocks(payload.data(), cs.type, mask.data(), m0.data(), cs.n, base.beta1,
                                bounds.data(), nb, sums.data(), counts.data(), threads),
            KernelStatus::kOk);
  Result r;
  r.vs.resize(nseg);
  for (size_t s = 0; s < nseg; ++s) {
    uint64_t c = 0;
    for (size_t b = first[s]; b < first[s + 1]; ++b) c += counts[b];
    const double sum = BlockedSum(sums.data() + first[s], first[s + 1] - first[s]);
    r.vs[s] = SegmentEnterVs(sum, c);
  }
  AdamSParams p = base;
  p.enter_offsets = off.data();
  p.enter_vs = r.vs.data();
  p.enter_nseg = nseg;
  r.theta = theta0;
  r.m = m0;
  EXPECT_EQ(UnpackAdamSUpdate(payload.data(), cs.type, mask.data(), k, r.theta.data(), r.m.data(),
                              cs.n, p, threads),
            KernelStatus::kOk);
  return r;
}

void CheckCase(const Case& cs) {
  SCAPE_SEEDED_RNG(rng);
  SCOPED_TRACE(::testing::Message()
               << "n=" << cs.n << " density=" << cs.density << " type=" << cs.type << " clip="
               << cs.clip << " bias=" << static_cast<int>(cs.bias) << " mcap=" << cs.mcap);
  const uint64_t n = cs.n;
  const std::vector<uint64_t> off = Segments(rng, n);
  const size_t nseg = off.size() - 1;
  const std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, cs.density);
  const size_t k = mask.size();
  // m_{t-1}: zero outside a random "previous mask"; inside it non-zero, except in every third
  // segment (no staying coordinate there) and at a few exact zeros.
  std::vector<float> m0 = RandomNormal(rng, n, 0.02f), theta0 = RandomNormal(rng, n);
  const std::vector<uint64_t> prev = RandomMask<uint64_t>(rng, n, 0.5);
  std::vector<uint8_t> inPrev(n, 0);
  for (uint64_t i : prev) inPrev[i] = 1;
  for (size_t s = 0; s < nseg; ++s)
    for (uint64_t i = off[s]; i < off[s + 1]; ++i)
      if (!inPrev[i] || s % 3 == 2 || rng() % 50 == 0) m0[i] = 0.0f;
  // Payload: staying ~ b1*m + (1-b1)*g; entering carry residuals up to 30 steps of gradient.
  const float b1 = 0.9f;
  std::vector<float> pv(k);
  for (size_t j = 0; j < k; ++j) {
    const float g = static_cast<float>(std::normal_distribution<double>(0, 0.03)(rng));
    const float e = m0[mask[j]] == 0.0f ? 0.1f * g * static_cast<float>(rng() % 30) : 0.0f;
    pv[j] = b1 * m0[mask[j]] + 0.1f * g + e;
  }
  // An entering coordinate far beyond its segment's scale (a segment with staying ones): the cap.
  bool capCase = false;
  {
    std::vector<uint64_t> stay(nseg, 0);
    auto seg = [&](uint64_t i) {
      return static_cast<size_t>(std::upper_bound(off.begin(), off.end(), i) - off.begin()) - 1;
    };
    for (size_t j = 0; j < k; ++j) stay[seg(mask[j])] += m0[mask[j]] != 0.0f;
    for (size_t j = 0; j < k && !capCase; ++j)
      if (m0[mask[j]] == 0.0f && stay[seg(mask[j])] > 0) {
        pv[j] = (j % 2 ? -50.0f : 50.0f);
        capCase = true;
      }
  }
  const std::vector<uint8_t> payload = Encode(pv, cs.type);

  AdamSParams base;
  base.lr = 1e-3f;
  base.beta1 = b1;
  base.beta2 = 0.95f;
  base.eps = 1e-8f;
  base.weight_decay = 0.1f;
  base.clip_scale = cs.clip;
  base.bias_correction = cs.bias;
  base.step = 7;
  base.enter_momentum_cap = cs.mcap;
  const Result r = RunKernels(cs, off, mask, payload, theta0, m0, base, 1);

  // The double reference, from the contract's formulas.
  const double db1 = b1, omb1 = 1.0 - db1, db2 = 0.95, omb2 = 1.0 - db2, lr = 1e-3, eps = 1e-8;
  const double decay = 1.0 - lr * 0.1, clip = cs.clip;
  double mscale = 1, pscale = 1, vscale = 1;
  if (cs.bias == BiasCorrection::kAdamSReference) {
    mscale = pscale = 1.0 / (1.0 - std::pow(db1, 7));
  } else if (cs.bias == BiasCorrection::kScapeArtifact) {
    mscale = 1.0 / (1.0 - std::pow(db1, 7));
    vscale = 1.0 / (1.0 - std::pow(db2, 7));
  }
  std::vector<double> S(nseg, 0.0), Serr(nseg, 0.0);
  std::vector<uint64_t> C(nseg, 0);
  auto segOf = [&](uint64_t i) {
    return static_cast<size_t>(std::upper_bound(off.begin(), off.end(), i) - off.begin()) - 1;
  };
  for (size_t j = 0; j < k; ++j) {
    const double mp = m0[mask[j]];
    if (mp == 0.0) continue;
    const double mt = Decoded(payload, cs.type, j), gh = (mt - db1 * mp) / omb1;
    S[segOf(mask[j])] += gh * gh;
    // The kernel forms g^ in fp32: mt - b1*mp cancels when the payload is close to b1*mp, so
    // its error scales with the terms (a few fp32 roundings of them), and g^2's with 2|g^| that.
    const double gerr = 8 * 0x1p-24 * (std::fabs(mt) + std::fabs(db1 * mp)) / omb1;
    Serr[segOf(mask[j])] += 2 * std::fabs(gh) * gerr + gerr * gerr;
    ++C[segOf(mask[j])];
  }
  size_t entering = 0, viaRms = 0, capped = 0, noStaying = 0, mClamped = 0;
  std::vector<uint8_t> masked(n, 0);
  for (size_t j = 0; j < k; ++j) {
    const uint64_t i = mask[j];
    masked[i] = 1;
    const size_t s = segOf(i);
    const double mp = m0[i], mt = Decoded(payload, cs.type, j);
    const double g = (mt - db1 * mp) / omb1 * clip;
    const double mn = clip != 1.0 ? db1 * mp + omb1 * g : mt;
    double u, mkeep = mn;
    const bool enter = mp == 0.0;
    entering += enter;
    if (enter && C[s] > 0 && S[s] > 0) {
      ++viaRms;
      const double vs = S[s] / static_cast<double>(C[s]);
      EXPECT_NEAR(r.vs[s], vs, 1e-5 * vs + Serr[s] / static_cast<double>(C[s])) << "segment " << s;
      u = lr * mn * mscale / (std::sqrt(clip * clip * vs * vscale) + eps);
      // Momentum factor masking: the kept momentum is at most one step's worth.
      const double bound = omb1 * std::sqrt(clip * clip * static_cast<double>(r.vs[s]));
      if (cs.mcap && std::fabs(mn) > bound) {
        mkeep = std::copysign(bound, mn);
        ++mClamped;
      }
      if (std::fabs(u) >= 100 * lr) {
        u = std::copysign(100 * lr, u);
        ++capped;
        EXPECT_NEAR(theta0[i] * decay - r.theta[i], u, 1e-6 * std::fabs(theta0[i]) + 1e-6)
            << "capped update at " << i;
      }
    } else {
      noStaying += enter;
      if (enter) {
        EXPECT_LT(r.vs[s], 0.0f) << "segment " << s << " has no staying coordinate";
      }
      const double mpc = mp * pscale;
      const double v = db2 * mpc * mpc + omb2 * g * g;
      u = lr * mn * mscale / (std::sqrt(v * vscale) + eps);
    }
    const double want = theta0[i] * decay - u;
    EXPECT_NEAR(r.theta[i], want, 1e-6 * std::fabs(theta0[i]) + 1e-4 * std::fabs(u) + 1e-12)
        << "position " << i << (enter ? " (entering)" : " (staying)");
    // fp32 against fp64: with clipping, mn = b1*mp + (1-b1)*g cancels when the payload is close
    // to b1*mp, so the error scales with the terms, not with mn.
    EXPECT_NEAR(r.m[i], mkeep,
                1e-5 * (std::fabs(mkeep) + std::fabs(db1 * mp) + std::fabs(mt)) + 1e-12)
        << "momentum at " << i;
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (masked[i]) continue;
    EXPECT_NEAR(r.theta[i], theta0[i] * decay, 1e-6 * std::fabs(theta0[i]));
    EXPECT_EQ(r.m[i], 0.0f);
  }
  if (k > 50 && cs.density > 0.2) {
    EXPECT_GT(viaRms, 0u) << "no entering coordinate used its segment's scale";
    // Every third segment has no staying coordinate; the random layout may give those no
    // masked position (empty or few segments): then there is nothing to exercise.
    size_t inNoStayingSeg = 0;
    for (size_t j = 0; j < k; ++j) inNoStayingSeg += segOf(mask[j]) % 3 == 2;
    if (inNoStayingSeg > 0) {
      EXPECT_GT(noStaying, 0u) << "no segment without staying coordinates was exercised";
    }
    EXPECT_TRUE(capCase);
    EXPECT_GT(capped, 0u) << "the cap was never reached";
    if (cs.mcap) {
      EXPECT_GT(mClamped, 0u) << "no kept momentum was clamped";
    }
  }

  // The same bits on more threads, through the view kernel and the sharded pairs kernel.
  if (n > 0) {
    const Result r4 = RunKernels(cs, off, mask, payload, theta0, m0, base, 4);
    EXPECT_EQ(std::memcmp(r.theta.data(), r4.theta.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(r.vs.data(), r4.vs.data(), 4 * nseg), 0);
    AdamSParams p = base;
    p.enter_offsets = off.data();
    p.enter_vs = r.vs.data();
    p.enter_nseg = nseg;
    MaskRun run{0, n, 0, k, kRunOwned};
    MaskView v;
    v.idx = mask.data();
    v.k = k;
    v.runs = &run;
    v.nruns = 1;
    std::vector<float> th = theta0, mm = m0;
    ASSERT_EQ(UnpackAdamSUpdateView(payload.data(), cs.type, v, th.data(), mm.data(), n, p, 2),
              KernelStatus::kOk);
    EXPECT_EQ(std::memcmp(r.theta.data(), th.data(), 4 * n), 0) << "view kernel";
    EXPECT_EQ(std::memcmp(r.m.data(), mm.data(), 4 * n), 0) << "view kernel";
    std::vector<float> pairs(2 * k + 2);
    ASSERT_EQ(AdamSUpdatePairs(payload.data(), cs.type, mask.data(), k, theta0.data(), m0.data(), n,
                               p, pairs.data(), 2),
              KernelStatus::kOk);
    for (size_t j = 0; j < k; ++j) {
      EXPECT_EQ(std::memcmp(&pairs[2 * j], &r.theta[mask[j]], 4), 0) << "pairs, entry " << j;
      EXPECT_EQ(std::memcmp(&pairs[2 * j + 1], &r.m[mask[j]], 4), 0) << "pairs, entry " << j;
    }
  }
}

TEST(SegmentRms, MatchesDoubleReference) {
  for (uint64_t n : {0, 1, 3, 17, 1001, 4099})
    for (double d : {0.0, 0.05, 0.5, 1.0})
      for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16})
        CheckCase({n, d, t, 1.0f, BiasCorrection::kNone});
}

TEST(SegmentRms, ClippingAndBiasCorrections) {
  for (BiasCorrection b :
       {BiasCorrection::kNone, BiasCorrection::kAdamSReference, BiasCorrection::kScapeArtifact})
    CheckCase({3001, 0.4, scapeBfloat16, 0.37f, b});
}

// Momentum factor masking (AdamSParams.enter_momentum_cap): the entering coordinates' kept
// momentum clamped, every other value as without it; every payload type, clipped or not.
TEST(SegmentRms, MomentumFactorMasking) {
  for (uint64_t n : {0, 1, 17, 4099})
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16})
      CheckCase({n, 0.5, t, 1.0f, BiasCorrection::kNone, true});
  CheckCase({3001, 0.4, scapeFloat32, 0.37f, BiasCorrection::kScapeArtifact, true});
  CheckCase({(uint64_t{1} << 19) + 13, 0.3, scapeFloat32, 1.0f, BiasCorrection::kNone, true});
}

TEST(SegmentRms, LargeMultiThreaded) {
  CheckCase({(uint64_t{1} << 19) + 13, 0.3, scapeFloat32, 1.0f, BiasCorrection::kNone});
}

// Without the table the update is the paper's, bit for bit; with a table whose every value is
// "no staying coordinate" too.
TEST(SegmentRms, OffOrNoStayingIsThePapersForm) {
  SCAPE_SEEDED_RNG(rng);
  const uint64_t n = 777;
  const std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.3);
  const std::vector<float> pv = RandomNormal(rng, mask.size(), 0.1f);
  const std::vector<uint8_t> payload = Encode(pv, scapeFloat32);
  std::vector<float> m0 = RandomNormal(rng, n, 0.1f), t0 = RandomNormal(rng, n);
  for (uint64_t i = 0; i < n; i += 2) m0[i] = 0.0f;
  AdamSParams p;
  std::vector<float> ta = t0, ma = m0, tb = t0, mb = m0;
  ASSERT_EQ(UnpackAdamSUpdate(payload.data(), scapeFloat32, mask.data(), mask.size(), ta.data(),
                              ma.data(), n, p),
            KernelStatus::kOk);
  const uint64_t off[] = {0, 100, 100, n};
  const float vs[] = {-1.0f, 5.0f, -1.0f};  // the empty segment's value is never used
  p.enter_offsets = off;
  p.enter_vs = vs;
  p.enter_nseg = 3;
  ASSERT_EQ(UnpackAdamSUpdate(payload.data(), scapeFloat32, mask.data(), mask.size(), tb.data(),
                              mb.data(), n, p),
            KernelStatus::kOk);
  EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp(ma.data(), mb.data(), 4 * n), 0);
}

TEST(SegmentRms, RejectsBadArguments) {
  const uint64_t n = 10, mask[] = {1, 4};
  const float pay[] = {0.5f, -0.5f};
  std::vector<float> t(n, 1.0f), m(n, 0.0f);
  const uint64_t off[] = {0, 5, n}, badOff[] = {0, 6, 5}, shortOff[] = {0, 5, 9};
  const float vs[] = {1.0f, 1.0f};
  AdamSParams p;
  p.enter_vs = vs;
  p.enter_nseg = 2;
  p.enter_offsets = nullptr;
  EXPECT_EQ(UnpackAdamSUpdate(pay, scapeFloat32, mask, 2, t.data(), m.data(), n, p),
            KernelStatus::kInvalidArgument);
  p.enter_offsets = badOff;
  EXPECT_EQ(UnpackAdamSUpdate(pay, scapeFloat32, mask, 2, t.data(), m.data(), n, p),
            KernelStatus::kInvalidArgument);
  p.enter_offsets = shortOff;
  EXPECT_EQ(UnpackAdamSUpdate(pay, scapeFloat32, mask, 2, t.data(), m.data(), n, p),
            KernelStatus::kInvalidArgument);
  p.enter_offsets = off;
  p.enter_cap = 0.0f;
  EXPECT_EQ(UnpackAdamSUpdate(pay, scapeFloat32, mask, 2, t.data(), m.data(), n, p),
            KernelStatus::kInvalidArgument);
  p.enter_cap = kEnterCap;
  EXPECT_EQ(UnpackAdamSUpdate(pay, scapeFloat32, mask, 2, t.data(), m.data(), n, p),
            KernelStatus::kOk);
  // Blocks: over kSqNormBlock slots, descending, an index >= n.
  std::vector<uint64_t> idx(300);
  for (size_t j = 0; j < idx.size(); ++j) idx[j] = j;
  std::vector<float> big(300, 0.1f), mm(300, 1.0f);
  double s[2];
  uint64_t c[2];
  const uint64_t tooLong[] = {0, 257}, desc[] = {5, 3}, ok[] = {0, 256, 300};
  EXPECT_EQ(StayingGradSqBlocks(big.data(), scapeFloat32, idx.data(), mm.data(), 300, 0.9f, tooLong,
                                1, s, c),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(StayingGradSqBlocks(big.data(), scapeFloat32, idx.data(), mm.data(), 300, 0.9f, desc, 1,
                                s, c),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(
      StayingGradSqBlocks(big.data(), scapeFloat32, idx.data(), mm.data(), 299, 0.9f, ok, 2, s, c),
      KernelStatus::kInvalidArgument);
  EXPECT_EQ(
      StayingGradSqBlocks(big.data(), scapeInt32, idx.data(), mm.data(), 300, 0.9f, ok, 2, s, c),
      KernelStatus::kUnsupported);
  ASSERT_EQ(
      StayingGradSqBlocks(big.data(), scapeFloat32, idx.data(), mm.data(), 300, 0.9f, ok, 2, s, c),
      KernelStatus::kOk);
  EXPECT_EQ(c[0], 256u);
  EXPECT_EQ(c[1], 44u);
  // k = 0: nothing to do.
  EXPECT_EQ(StayingGradSqBlocks(nullptr, scapeFloat32, nullptr, nullptr, 0, 0.9f, nullptr, 0,
                                nullptr, nullptr),
            KernelStatus::kOk);
  EXPECT_EQ(SegmentEnterVs(0.0, 0), -1.0f);
  EXPECT_EQ(SegmentEnterVs(0.0, 3), -1.0f);
  EXPECT_EQ(SegmentEnterVs(1e300, 1), -1.0f);
  EXPECT_EQ(SegmentEnterVs(6.0, 3), 2.0f);
}

}  // namespace
}  // namespace kernels
}  // namespace scape
