// The packed-momentum kernels (kernels/cpu/scape_step.h, issue 24) against the kernels with a
// dense momentum on fresh random inputs: masks in owner order over several runs, the momentum
// +0 outside the old mask (and -0 inside it at places), every payload type, the options of the
// update (clipping with and without the momentum rebuilt, bias corrections, decay 1, the
// "segment_rms" entering rule, a 16-bit model copy), sizes 0, odd and multi-threaded. The bits
// must be the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/scape_step.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

using testing_util::FreshSeed;
using testing_util::RandomNormal;

// n == 0: empty vectors may hold null data(), which memcmp must not see.
bool Same(const float* a, const float* b, size_t n) {
  return n == 0 || std::memcmp(a, b, 4 * n) == 0;
}

// A mask over runs [bounds[r], bounds[r+1]) owned by rank r % P, in owner order (rank 0's runs'
// entries in position order, then rank 1's, ...), each position in with probability d.
struct OwnerView {
  std::vector<uint64_t> idx;
  std::vector<MaskRun> runs;
  MaskView View() const {
    MaskView v;
    v.idx = idx.data();
    v.k = idx.size();
    v.runs = runs.data();
    v.nruns = runs.size();
    return v;
  }
};

OwnerView MakeView(std::mt19937_64& rng, const std::vector<uint64_t>& bounds, int P, double d) {
  OwnerView o;
  std::bernoulli_distribution in(d);
  const size_t nr = bounds.size() - 1;
  o.runs.resize(nr);
  for (int r = 0; r < P; ++r)
    for (size_t q = static_cast<size_t>(r); q < nr; q += static_cast<size_t>(P)) {
      MaskRun& run = o.runs[q];
      run.begin = bounds[q];
      run.end = bounds[q + 1];
      run.jb = o.idx.size();
      for (uint64_t i = run.begin; i < run.end; ++i)
        if (in(rng)) o.idx.push_back(i);
      run.je = o.idx.size();
      run.flags = r == 0 ? kRunOwned : 0u;
    }
  return o;
}

struct Case {
  uint64_t n;
  int P;
  double dOld, dNew;
};

class Packed : public ::testing::TestWithParam<Case> {};

TEST_P(Packed, SameBitsAsDenseMomentum) {
  const Case cs = GetParam();
  const unsigned seed = FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " n " << cs.n << " P " << cs.P);
  std::mt19937_64 rng(seed);
  const uint64_t n = cs.n;
  std::vector<uint64_t> bounds{0};
  if (n > 0) {
    std::uniform_int_distribution<uint64_t> cut(0, n);
    std::vector<uint64_t> c;
    for (int i = 0; i < 2 * cs.P + 1; ++i) c.push_back(cut(rng));
    std::sort(c.begin(), c.end());
    for (uint64_t x : c)
      if (x > bounds.back() && x < n) bounds.push_back(x);
  }
  bounds.push_back(n);
  const OwnerView oldv = MakeView(rng, bounds, cs.P, cs.dOld);
  const OwnerView newv = MakeView(rng, bounds, cs.P, cs.dNew);
  const MaskView vo = oldv.View(), vn = newv.View();
  const size_t ko = vo.k, kn = vn.k;
  // m_{t-1}: +0 outside the old mask, random inside (-0 at some entries).
  std::vector<float> mDense(n, 0.0f), mOld = RandomNormal(rng, ko, 0.5f);
  for (size_t j = 0; j < ko; j += 13) mOld[j] = -0.0f;
  for (size_t j = 0; j < ko; ++j) mDense[vo.idx[j]] = mOld[j];
  const std::vector<float> g = RandomNormal(rng, n, 2.0f), e0 = RandomNormal(rng, n, 0.1f);
  const std::vector<float> theta0 = RandomNormal(rng, n);

  // The gather: m_{t-1} at the new mask, by the dense array.
  std::vector<float> mPrev(kn + 1, 7.0f);
  ASSERT_EQ(MomentumGather(vo, mOld.data(), vn, mPrev.data(), n), KernelStatus::kOk);
  for (size_t j = 0; j < kn; ++j) {
    ASSERT_TRUE(Same(&mPrev[j], &mDense[vn.idx[j]], 1)) << "gather, entry " << j;
  }

  for (scapeDataType_t pt : {scapeFloat32, scapeBfloat16, scapeFloat16}) {
    SCOPED_TRACE(::testing::Message() << "payload " << pt);
    const size_t esz = PayloadElementSize(pt);
    // Candidate: the dense momentum with the old mask as support, against the packed form.
    std::vector<float> eD = e0, eP = e0, sD(n, 1.0f), sP(n, 1.0f);
    std::vector<uint8_t> pD(kn * esz + 1, 0), pP(kn * esz + 1, 0);
    ASSERT_EQ(CandidatePackResidualView(mDense.data(), g.data(), eD.data(), n, 0.9f, vn, pt,
                                        pD.data(), sD.data(), 0, &vo),
              KernelStatus::kOk);
    ASSERT_EQ(CandidatePackResidualPacked(mPrev.data(), vo, mOld.data(), g.data(), eP.data(), n,
                                          0.9f, vn, pt, pP.data(), sP.data()),
              KernelStatus::kOk);
    EXPECT_TRUE(Same(eD.data(), eP.data(), n)) << "candidate residual";
    EXPECT_TRUE(Same(sD.data(), sP.data(), n)) << "candidate statistic";
    EXPECT_EQ(pD, pP) << "candidate payload";
    // The fused gather + candidate at views validated once: the same bits, and m_{t-1} at the
    // new mask as MomentumGather gives it.
    CheckedMaskView co, cn;
    ASSERT_TRUE(CheckMaskView(vo, n, &co));
    ASSERT_TRUE(CheckMaskView(vn, n, &cn));
    {
      std::vector<float> eF = e0, sF(n, 1.0f), mF(kn + 1, 7.0f);
      std::vector<uint8_t> pF(kn * esz + 1, 0);
      ASSERT_EQ(CandidateGatherPacked(co, mOld.data(), g.data(), eF.data(), n, 0.9f, cn, mF.data(),
                                      pt, pF.data(), sF.data()),
                KernelStatus::kOk);
      EXPECT_TRUE(Same(eD.data(), eF.data(), n)) << "fused candidate residual";
      EXPECT_TRUE(Same(sD.data(), sF.data(), n)) << "fused candidate statistic";
      EXPECT_EQ(pD, pF) << "fused candidate payload";
      EXPECT_TRUE(Same(mF.data(), mPrev.data(), kn)) << "fused gather";
      EXPECT_EQ(mF[kn], 7.0f) << "fused gather wrote past k";
      // The mask did not move: the same view on both sides, m read in place.
      std::vector<float> eS = e0, eR = e0, sS(n, 1.0f), sR(n, 1.0f), mS = mOld;
      std::vector<uint8_t> pS(ko * esz + 1, 0), pR(ko * esz + 1, 0);
      ASSERT_EQ(CandidatePackResidualPacked(mOld.data(), vo, mOld.data(), g.data(), eR.data(), n,
                                            0.9f, vo, pt, pR.data(), sR.data()),
                KernelStatus::kOk);
      ASSERT_EQ(CandidateGatherPacked(co, mS.data(), g.data(), eS.data(), n, 0.9f, co, mS.data(),
                                      pt, pS.data(), sS.data()),
                KernelStatus::kOk);
      EXPECT_TRUE(Same(eR.data(), eS.data(), n)) << "unmoved candidate residual";
      EXPECT_TRUE(Same(sR.data(), sS.data(), n)) << "unmoved candidate statistic";
      EXPECT_EQ(pR, pS) << "unmoved candidate payload";
      EXPECT_TRUE(Same(mS.data(), mOld.data(), ko)) << "unmoved m changed";
    }
    // The reduced payload: the packed candidate itself.
    const std::vector<uint8_t>& pay = pP;

    // Norm, per owner block (each block is sorted).
    for (int r = 0; r < cs.P; ++r) {
      uint64_t b = kn, e = 0;
      for (const MaskRun& run : newv.runs)
        if (static_cast<int>(&run - newv.runs.data()) % cs.P == r) {
          b = std::min<uint64_t>(b, run.jb);
          e = std::max<uint64_t>(e, run.je);
        }
      if (b >= e) continue;
      double sd = 0, sp = 0;
      ASSERT_EQ(RecoveredGradSqNorm(pay.data() + b * esz, pt, vn.idx + b, e - b, mDense.data(), n,
                                    0.9f, &sd),
                KernelStatus::kOk);
      ASSERT_EQ(
          RecoveredGradSqNormPacked(pay.data() + b * esz, pt, mPrev.data() + b, e - b, 0.9f, &sp),
          KernelStatus::kOk);
      EXPECT_TRUE(std::memcmp(&sd, &sp, 8) == 0) << "norm of rank " << r;
      // The staying sums of the block, in blocks of at most kSqNormBlock slots.
      std::vector<uint64_t> bnd(StayingBlockCount(e - b) + 1, 0);
      StayingBlockBounds(0, e - b, bnd.data() + 1);
      const size_t nb = bnd.size() - 1;
      std::vector<double> s1(nb), s2(nb);
      std::vector<uint64_t> c1(nb), c2(nb);
      ASSERT_EQ(StayingGradSqBlocks(pay.data() + b * esz, pt, vn.idx + b, mDense.data(), n, 0.9f,
                                    bnd.data(), nb, s1.data(), c1.data()),
                KernelStatus::kOk);
      ASSERT_EQ(StayingGradSqBlocksPacked(pay.data() + b * esz, pt, mPrev.data() + b, 0.9f,
                                          bnd.data(), nb, s2.data(), c2.data()),
                KernelStatus::kOk);
      EXPECT_EQ(std::memcmp(s1.data(), s2.data(), 8 * nb), 0) << "staying sums";
      EXPECT_EQ(c1, c2) << "staying counts";
      // The sharded owner's pairs.
      AdamSParams ap;
      ap.clip_scale = 0.5f;
      std::vector<float> q1(2 * (e - b) + 1), q2(2 * (e - b) + 1);
      ASSERT_EQ(AdamSUpdatePairs(pay.data() + b * esz, pt, vn.idx + b, e - b, theta0.data(),
                                 mDense.data(), n, ap, q1.data()),
                KernelStatus::kOk);
      ASSERT_EQ(AdamSUpdatePairsPacked(pay.data() + b * esz, pt, vn.idx + b, e - b, theta0.data(),
                                       mPrev.data() + b, n, ap, q2.data()),
                KernelStatus::kOk);
      EXPECT_TRUE(Same(q1.data(), q2.data(), 2 * (e - b))) << "pairs";
    }

    // The update under its options.
    const std::vector<float> enterVs{0.25f, -1.0f, 3.0f};
    const std::vector<uint64_t> enterOff{0, n / 3, n / 2, n};
    for (int opt = 0; opt < 7; ++opt) {
      SCOPED_TRACE(::testing::Message() << "option " << opt);
      AdamSParams ap;
      ap.weight_decay = opt == 1 ? 0.0f : 0.1f;  // decay 1: theta keeps its bits outside
      ap.clip_scale = opt == 2 || opt == 3 ? 0.37f : 1.0f;
      ap.clip_momentum = opt != 3;
      ap.bias_correction = opt == 4   ? BiasCorrection::kAdamSReference
                           : opt == 5 ? BiasCorrection::kScapeArtifact
                                      : BiasCorrection::kNone;
      ap.step = 3;
      if (opt == 6) {
        ap.enter_offsets = enterOff.data();
        ap.enter_vs = enterVs.data();
        ap.enter_nseg = enterVs.size();
      }
      for (bool copy : {false, true}) {
        if (copy && opt != 0 && opt != 1) continue;
        std::vector<float> tD = theta0, tP = theta0, mD = mDense;
        std::vector<float> mP(mPrev.begin(), mPrev.begin() + static_cast<ptrdiff_t>(kn));
        std::vector<uint16_t> cD(n + 1, 0), cP(n + 1, 1);
        ModelCopy mc1, mc2;
        mc1.p = cD.data();
        mc2.p = cP.data();
        ASSERT_EQ(UnpackAdamSUpdateView(pay.data(), pt, vn, tD.data(), mD.data(), n, ap, 0, false,
                                        copy ? &mc1 : nullptr),
                  KernelStatus::kOk);
        ASSERT_EQ(UnpackAdamSUpdatePacked(pay.data(), pt, vn, tP.data(), mP.data(), n, ap, 0,
                                          copy ? &mc2 : nullptr),
                  KernelStatus::kOk);
        EXPECT_TRUE(Same(tD.data(), tP.data(), n)) << "theta, copy " << copy;
        // The checked-view overload: the same bits.
        std::vector<float> tC = theta0;
        std::vector<float> mC(mPrev.begin(), mPrev.begin() + static_cast<ptrdiff_t>(kn));
        std::vector<uint16_t> cC(n + 1, 2);
        ModelCopy mc3;
        mc3.p = cC.data();
        ASSERT_EQ(UnpackAdamSUpdatePacked(pay.data(), pt, cn, tC.data(), mC.data(), n, ap, 0,
                                          copy ? &mc3 : nullptr),
                  KernelStatus::kOk);
        EXPECT_TRUE(Same(tP.data(), tC.data(), n)) << "checked theta, copy " << copy;
        EXPECT_TRUE(Same(mP.data(), mC.data(), kn)) << "checked m_t, copy " << copy;
        if (copy) {
          EXPECT_TRUE(std::equal(cP.begin(), cP.begin() + static_cast<ptrdiff_t>(n), cC.begin()))
              << "checked model copy";
        }
        for (size_t j = 0; j < kn; ++j)
          ASSERT_TRUE(Same(&mP[j], &mD[vn.idx[j]], 1)) << "m_t, entry " << j;
        if (copy) {
          EXPECT_TRUE(std::equal(cD.begin(), cD.begin() + static_cast<ptrdiff_t>(n), cP.begin()))
              << "model copy";
        }
      }
    }
    // The gathered pairs' unpack.
    std::vector<float> pairs = RandomNormal(rng, 2 * kn + 1);
    AdamSParams ap;
    std::vector<float> tD = theta0, tP = theta0, mD = mDense, mP(kn + 1, 5.0f);
    ASSERT_EQ(UnpackPairsDecayView(pairs.data(), vn, tD.data(), mD.data(), n, ap),
              KernelStatus::kOk);
    ASSERT_EQ(UnpackPairsDecayPacked(pairs.data(), vn, tP.data(), mP.data(), n, ap),
              KernelStatus::kOk);
    EXPECT_TRUE(Same(tD.data(), tP.data(), n)) << "unpack theta";
    std::vector<float> tC = theta0, mC(kn + 1, 5.0f);
    ASSERT_EQ(UnpackPairsDecayPacked(pairs.data(), cn, tC.data(), mC.data(), n, ap),
              KernelStatus::kOk);
    EXPECT_TRUE(Same(tP.data(), tC.data(), n)) << "checked unpack theta";
    EXPECT_TRUE(Same(mP.data(), mC.data(), kn)) << "checked unpack m";
    for (size_t j = 0; j < kn; ++j)
      ASSERT_TRUE(Same(&mP[j], &mD[vn.idx[j]], 1)) << "unpack m, entry " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, Packed,
                         ::testing::Values(Case{0, 1, 0.1, 0.1}, Case{1, 1, 1.0, 1.0},
                                           Case{7, 3, 0.5, 0.5}, Case{1001, 3, 0.1, 0.2},
                                           Case{4099, 4, 0.01, 0.3}, Case{4099, 2, 1.0, 0.05},
                                           Case{(1u << 20) + 3, 3, 0.1, 0.1}));

TEST(PackedKernels, RejectBadArguments) {
  const uint64_t idx[2] = {1, 3}, idx2[1] = {2};
  const MaskRun run{0, 4, 0, 2, kRunOwned}, run2{0, 4, 0, 1, kRunOwned}, other{0, 5, 0, 2, 0};
  MaskView a{idx, 2, &run, 1}, b{idx2, 1, &run2, 1}, bad{idx, 2, &other, 1};
  float m[2] = {1, 2}, out[2];
  EXPECT_EQ(MomentumGather(a, m, b, out, 4), KernelStatus::kOk);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(MomentumGather(a, nullptr, b, out, 4), KernelStatus::kInvalidArgument);
  EXPECT_EQ(MomentumGather(a, m, b, nullptr, 4), KernelStatus::kInvalidArgument);
  EXPECT_EQ(MomentumGather(a, m, bad, out, 4), KernelStatus::kInvalidArgument);
  float g[4] = {}, e[4] = {}, th[4] = {}, pay[2] = {};
  EXPECT_EQ(
      CandidatePackResidualPacked(nullptr, a, m, g, e, 4, 0.9f, a, scapeFloat32, pay, nullptr),
      KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidatePackResidualPacked(m, a, m, g, e, 4, 0.9f, a, scapeInt32, pay, nullptr),
            KernelStatus::kUnsupported);
  AdamSParams ap;
  EXPECT_EQ(UnpackAdamSUpdatePacked(pay, scapeFloat32, a, th, nullptr, 4, ap),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(UnpackAdamSUpdatePacked(pay, scapeFloat32, bad, th, m, 4, ap),
            KernelStatus::kInvalidArgument);
  double sq = 0;
  EXPECT_EQ(RecoveredGradSqNormPacked(pay, scapeFloat32, nullptr, 2, 0.9f, &sq),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(RecoveredGradSqNormPacked(pay, scapeFloat32, m, 0, 0.9f, &sq), KernelStatus::kOk);
  EXPECT_EQ(sq, 0.0);
}

// The validate-once tokens: only CheckMaskView makes a valid one; a bad view, an unchecked
// (default) token or a token for another n is refused by every kernel that takes one, and
// nothing is written.
TEST(PackedKernels, CheckedViewsRefuseWhatWasNotChecked) {
  const uint64_t idx[2] = {1, 3}, idx2[1] = {2}, unsorted[2] = {3, 1};
  const MaskRun run{0, 4, 0, 2, kRunOwned}, run2{0, 4, 0, 1, kRunOwned};
  const MaskRun split[2] = {{0, 2, 0, 1, kRunOwned}, {2, 4, 1, 2, 0}};
  const MaskView a{idx, 2, &run, 1}, b{idx2, 1, &run2, 1}, bad{unsorted, 2, &run, 1};
  const MaskView other{idx, 2, split, 2};  // valid, but its runs differ from a's
  CheckedMaskView ca, cb, cbad, cother, none;
  ASSERT_TRUE(CheckMaskView(a, 4, &ca));
  ASSERT_TRUE(CheckMaskView(b, 4, &cb));
  ASSERT_TRUE(CheckMaskView(other, 4, &cother));
  EXPECT_FALSE(CheckMaskView(bad, 4, &cbad));
  EXPECT_FALSE(cbad.valid());
  EXPECT_FALSE(none.valid());
  EXPECT_FALSE(CheckMaskView(a, 3, &cbad));  // index 3 out of range for n = 3
  EXPECT_FALSE(CheckMaskView(a, 4, nullptr));
  float m[2] = {1, 2}, mo[2] = {9, 9}, g[4] = {1, 1, 1, 1}, e[4] = {0, 0, 0, 0};
  float th[4] = {1, 1, 1, 1}, pay[2] = {0, 0}, pairs[4] = {1, 1, 1, 1};
  // Refused: unchecked tokens, a token for another n, runs that differ, aliasing rules.
  EXPECT_EQ(CandidateGatherPacked(none, m, g, e, 4, 0.9f, cb, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 0.9f, cbad, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 5, 0.9f, cb, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidateGatherPacked(cother, m, g, e, 4, 0.9f, cb, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 0.9f, ca, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);  // the same view needs m_mask == m_support
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 0.9f, cb, mo, scapeInt32, pay, nullptr),
            KernelStatus::kUnsupported);
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 0.9f, cb, nullptr, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 1.0f, cb, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kInvalidArgument);
  for (float x : e) EXPECT_EQ(x, 0.0f);
  EXPECT_EQ(mo[0], 9.0f);
  AdamSParams ap;
  EXPECT_EQ(UnpackAdamSUpdatePacked(pay, scapeFloat32, none, th, m, 4, ap),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(UnpackAdamSUpdatePacked(pay, scapeFloat32, ca, th, m, 5, ap),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(UnpackPairsDecayPacked(pairs, none, th, m, 4, ap), KernelStatus::kInvalidArgument);
  EXPECT_EQ(UnpackPairsDecayPacked(pairs, ca, th, m, 5, ap), KernelStatus::kInvalidArgument);
  for (float x : th) EXPECT_EQ(x, 1.0f);
  // Accepted: the gather writes m_{t-1} at b's entry (position 2: entering, +0).
  EXPECT_EQ(CandidateGatherPacked(ca, m, g, e, 4, 0.9f, cb, mo, scapeFloat32, pay, nullptr),
            KernelStatus::kOk);
  EXPECT_EQ(mo[0], 0.0f);
  EXPECT_FALSE(std::signbit(mo[0]));
  EXPECT_EQ(mo[1], 9.0f);
}

// MaskViewIsValid refuses every kind of bad entry list (the branch-free check of each run).
TEST(PackedKernels, MaskViewIsValidRefusesBadEntries) {
  const MaskRun run{0, 8, 0, 3, 0};
  const uint64_t ok[3] = {0, 4, 7}, dup[3] = {1, 4, 4}, desc[3] = {1, 5, 4}, low[3] = {5, 6, 7};
  const uint64_t high[3] = {1, 2, 8}, wrap[3] = {1, ~uint64_t{0}, 7};
  EXPECT_TRUE(MaskViewIsValid(MaskView{ok, 3, &run, 1}, 8));
  for (const uint64_t* x : {dup, desc, high, wrap})
    EXPECT_FALSE(MaskViewIsValid(MaskView{x, 3, &run, 1}, 8)) << x[0] << " " << x[1];
  const MaskRun two[2] = {{0, 5, 0, 3, 0}, {5, 8, 3, 3, 0}};
  EXPECT_FALSE(MaskViewIsValid(MaskView{low, 3, two, 2}, 8));  // entries beyond their run
  EXPECT_FALSE(MaskViewIsValid(MaskView{ok, 1, two, 2}, 8));   // a run past k
}

}  // namespace
}  // namespace kernels
}  // namespace scape
