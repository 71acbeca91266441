// CPU tests of kernels/cpu/scape_step.h against a double-precision reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scape_step.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

using testing_util::RandomMask;
using testing_util::RandomNormal;

const size_t kSizes[] = {0, 1, 2, 3, 17, 1000, 4099};
const size_t kLarge = (size_t{1} << 19) + 13;  // split across 2 threads
const double kDensities[] = {0.0, 0.01, 0.3, 1.0};

float Decode(const void* payload, scapeDataType_t t, size_t j) {
  switch (t) {
    case scapeFloat32:
      return static_cast<const float*>(payload)[j];
    case scapeBfloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(payload)[j]);
    default:
      return Fp16ToFloat(static_cast<const uint16_t*>(payload)[j]);
  }
}

// Relative precision of the payload type.
double TypeEps(scapeDataType_t t) {
  return t == scapeFloat32 ? 1.2e-7 : (t == scapeBfloat16 ? 1.0 / 256 : 1.0 / 2048);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

template <typename Index>
void CheckCandidate(size_t n, double density, scapeDataType_t type) {
  SCAPE_SEEDED_RNG(rng);
  SCOPED_TRACE(::testing::Message() << "n=" << n << " density=" << density << " type=" << type
                                    << " index bytes=" << sizeof(Index));
  const float b1 = 0.9f;
  std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 3.0f),
                     e = RandomNormal(rng, n, 0.1f);
  std::vector<Index> mask = RandomMask<Index>(rng, n, density);
  const size_t k = mask.size();
  const size_t esz = PayloadElementSize(type);
  std::vector<uint8_t> payload(k * esz + 1);
  std::vector<float> e1 = e, c1(n);
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), e1.data(), n, b1, mask.data(), k, type,
                                  payload.data(), c1.data()),
            KernelStatus::kOk);
  // Reference in double.
  std::vector<char> in_mask(n, 0);
  for (Index i : mask) in_mask[i] = 1;
  const double omb1 = 1.0 - static_cast<double>(b1);
  for (size_t i = 0; i < n; ++i) {
    const double c = static_cast<double>(b1) * m[i] + omb1 * g[i] + e[i];
    const double tol = 4e-7 * (std::fabs(b1 * m[i]) + std::fabs(omb1 * g[i]) + std::fabs(e[i]));
    if (!(std::fabs(c1[i] - c) <= tol)) FAIL() << "c at " << i << ": " << c1[i] << " vs " << c;
    if (in_mask[i] && (e1[i] != 0.0f || std::signbit(e1[i]))) {
      FAIL() << "residual inside the mask at " << i << ": " << e1[i];
    }
    if (!in_mask[i] && !(e1[i] == c1[i])) FAIL() << "residual outside the mask at " << i;
  }
  for (size_t j = 0; j < k; ++j) {
    const size_t i = mask[j];
    const double c = static_cast<double>(b1) * m[i] + omb1 * g[i] + e[i];
    const float got = Decode(payload.data(), type, j);
    if (!(std::fabs(got - c) <= TypeEps(type) * std::fabs(c) + 1e-6)) {
      FAIL() << "payload " << j << ": " << got << " vs " << c;
    }
  }
  // Same bits without c_out, with one thread, and with c_out aliasing g.
  std::vector<float> e2 = e;
  std::vector<uint8_t> payload2(k * esz + 1);
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), e2.data(), n, b1, mask.data(), k, type,
                                  payload2.data(), nullptr, 1),
            KernelStatus::kOk);
  EXPECT_TRUE(SameBits(e1, e2));
  EXPECT_EQ(payload, payload2);
  std::vector<float> e3 = e, g3 = g;
  std::vector<uint8_t> payload3(k * esz + 1);
  ASSERT_EQ(CandidatePackResidual(m.data(), g3.data(), e3.data(), n, b1, mask.data(), k, type,
                                  payload3.data(), g3.data(), 2),
            KernelStatus::kOk);
  EXPECT_TRUE(SameBits(e1, e3));
  EXPECT_TRUE(SameBits(c1, g3));
  EXPECT_EQ(payload, payload3);
}

TEST(CandidatePackResidual, MatchesDoubleReference) {
  for (size_t n : kSizes) {
    for (double d : kDensities) {
      CheckCandidate<uint32_t>(n, d, scapeFloat32);
      CheckCandidate<uint64_t>(n, d, scapeBfloat16);
    }
    CheckCandidate<uint32_t>(n, 0.05, scapeFloat16);
  }
}

TEST(CandidatePackResidual, LargeMultiThreaded) {
  CheckCandidate<uint32_t>(kLarge, 0.01, scapeFloat32);
  CheckCandidate<uint64_t>(kLarge, 0.5, scapeFloat16);
}

// keep_rounding: the residual inside the mask is the view kernel's (c - float(payload), +0 when
// that is not finite); at a sorted mask (one owned run) both forms give the same bits in e, the
// payload and the candidate. Some inputs overflow fp16 (a non-finite payload: residual +0) and
// some are NaN.
template <typename Index>
void CheckKeepRoundingMatchesView(size_t n, double density, scapeDataType_t type) {
  SCAPE_SEEDED_RNG(rng);
  SCOPED_TRACE(::testing::Message() << "n=" << n << " density=" << density << " type=" << type
                                    << " index bytes=" << sizeof(Index));
  const float b1 = 0.9f;
  std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 3.0f),
                     e = RandomNormal(rng, n, 0.1f);
  for (size_t i = 5; i < n; i += 97) g[i] = 2e6f;  // |c| > 65504: fp16 infinity
  for (size_t i = 11; i < n; i += 389) g[i] = std::numeric_limits<float>::quiet_NaN();
  std::vector<Index> mask = RandomMask<Index>(rng, n, density);
  const size_t k = mask.size();
  const size_t esz = PayloadElementSize(type);
  std::vector<uint64_t> idx(mask.begin(), mask.end());
  const MaskRun run{0, n, 0, k, kRunOwned};
  MaskView view;
  view.idx = idx.data();
  view.k = k;
  view.runs = &run;
  view.nruns = 1;
  std::vector<float> eV = e, cV(n);
  std::vector<uint8_t> pV(k * esz + 1);
  ASSERT_EQ(CandidatePackResidualView(m.data(), g.data(), eV.data(), n, b1, view, type, pV.data(),
                                      cV.data()),
            KernelStatus::kOk);
  for (int threads : {0, 1, 2}) {
    SCOPED_TRACE(::testing::Message() << "threads=" << threads);
    std::vector<float> eF = e, cF(n);
    std::vector<uint8_t> pF(k * esz + 1);
    ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), eF.data(), n, b1, mask.data(), k, type,
                                    pF.data(), cF.data(), threads, /*keep_rounding=*/true),
              KernelStatus::kOk);
    EXPECT_TRUE(SameBits(eF, eV));
    EXPECT_TRUE(SameBits(cF, cV));
    EXPECT_EQ(pF, pV);
  }
  // Without keep_rounding: the same except +0 inside the mask (for fp32 the same bits).
  std::vector<float> eZ = e;
  std::vector<uint8_t> pZ(k * esz + 1);
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), eZ.data(), n, b1, mask.data(), k, type,
                                  pZ.data(), nullptr),
            KernelStatus::kOk);
  EXPECT_EQ(pZ, pV);
  std::vector<float> eW = eV;
  for (Index i : mask) eW[i] = 0.0f;
  EXPECT_TRUE(SameBits(eZ, eW));
  if (type == scapeFloat32) {
    EXPECT_TRUE(SameBits(eZ, eV));
  } else if (k > 0) {
    // Some rounding error is fed back (a 16-bit payload rarely holds a random float exactly).
    size_t nonzero = 0;
    for (Index i : mask) nonzero += eV[i] != 0.0f;
    if (k >= 16) {
      EXPECT_GT(nonzero, 0u);
    }
  }
}

TEST(CandidatePackResidual, KeepRoundingMatchesViewKernel) {
  for (size_t n : kSizes) {
    for (double d : kDensities) {
      CheckKeepRoundingMatchesView<uint64_t>(n, d, scapeBfloat16);
      CheckKeepRoundingMatchesView<uint32_t>(n, d, scapeFloat16);
    }
    CheckKeepRoundingMatchesView<uint64_t>(n, 0.3, scapeFloat32);
  }
  CheckKeepRoundingMatchesView<uint64_t>(kLarge, 0.3, scapeBfloat16);
  CheckKeepRoundingMatchesView<uint32_t>(kLarge, 0.05, scapeFloat16);
}

TEST(CandidatePackResidual, RejectsBadArguments) {
  std::vector<float> m(10, 1.0f), g(10, 1.0f), e(10, 0.5f);
  std::vector<float> payload(10);
  const uint32_t unsorted[] = {3, 2};
  const uint32_t dup[] = {2, 2};
  const uint32_t range[] = {2, 10};
  for (const uint32_t* bad : {unsorted, dup, range}) {
    std::vector<float> e0 = e;
    EXPECT_EQ(CandidatePackResidual(m.data(), g.data(), e0.data(), 10, 0.9f, bad, 2, scapeFloat32,
                                    payload.data(), nullptr),
              KernelStatus::kInvalidArgument);
    EXPECT_EQ(e0, e) << "nothing may be written on error";
  }
  const uint32_t ok[] = {1, 4};
  EXPECT_EQ(CandidatePackResidual(m.data(), g.data(), e.data(), 10, 0.9f, ok, 2, scapeInt32,
                                  payload.data(), nullptr),
            KernelStatus::kUnsupported);
  EXPECT_EQ(CandidatePackResidual(nullptr, g.data(), e.data(), 10, 0.9f, ok, 2, scapeFloat32,
                                  payload.data(), nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidatePackResidual(m.data(), g.data(), e.data(), 10, 0.9f, ok, 2, scapeFloat32,
                                  nullptr, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(CandidatePackResidual(nullptr, nullptr, nullptr, 0, 0.9f,
                                  static_cast<const uint32_t*>(nullptr), 0, scapeFloat32, nullptr,
                                  nullptr),
            KernelStatus::kOk);
}

// ---------------------------------------------------------------------------------------------

struct RefState {
  std::vector<double> theta, m;
};

// Double-precision reference of UnpackAdamSUpdate from the formulas in scape_step.h, with the
// bias corrections computed from the parameters (not from AdamSScalars).
template <typename Index>
RefState ReferenceUpdate(const std::vector<float>& payload_f, const std::vector<Index>& mask,
                         const std::vector<float>& theta, const std::vector<float>& m,
                         const AdamSParams& p) {
  const size_t n = theta.size();
  RefState r;
  r.theta.resize(n);
  r.m.assign(n, 0.0);
  const double b1 = p.beta1, b2 = p.beta2, lr = p.lr, eps = p.eps, wd = p.weight_decay;
  double mscale = 1, pscale = 1, vscale = 1;
  const double t = static_cast<double>(p.step);
  if (p.bias_correction == BiasCorrection::kAdamSReference) {
    mscale = pscale = 1.0 / (1.0 - std::pow(b1, t));
  } else if (p.bias_correction == BiasCorrection::kScapeArtifact) {
    mscale = 1.0 / (1.0 - std::pow(b1, t));
    vscale = 1.0 / (1.0 - std::pow(b2, t));
  }
  for (size_t i = 0; i < n; ++i) r.theta[i] = theta[i] * (1.0 - lr * wd);
  for (size_t j = 0; j < mask.size(); ++j) {
    const size_t i = mask[j];
    const double mt = payload_f[j], mp = m[i];
    const double g = (mt - b1 * mp) / (1.0 - b1) * p.clip_scale;
    const double mn = (p.clip_momentum && p.clip_scale != 1.0f) ? b1 * mp + (1.0 - b1) * g : mt;
    const double v = b2 * (mp * pscale) * (mp * pscale) + (1.0 - b2) * g * g;
    r.theta[i] -= lr * mn * mscale / (std::sqrt(v * vscale) + eps);
    r.m[i] = mn;
  }
  return r;
}

template <typename Index>
void CheckUpdate(size_t n, double density, scapeDataType_t type, const AdamSParams& p) {
  SCAPE_SEEDED_RNG(rng);
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " density=" << density << " type=" << type
               << " bias=" << static_cast<int>(p.bias_correction) << " clip=" << p.clip_scale);
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  std::vector<Index> mask = RandomMask<Index>(rng, n, density);
  const size_t k = mask.size();
  // Payload: the new momentum, near b1*m + (1-b1)*g for a gradient of scale 0.03.
  std::vector<float> pf(k);
  std::normal_distribution<float> gd(0.0f, 0.03f);
  for (size_t j = 0; j < k; ++j) pf[j] = p.beta1 * m[mask[j]] + (1 - p.beta1) * gd(rng);
  std::vector<uint8_t> payload(k * PayloadElementSize(type) + 1);
  for (size_t j = 0; j < k; ++j) {
    if (type == scapeFloat32) {
      reinterpret_cast<float*>(payload.data())[j] = pf[j];
    } else {
      uint16_t h = type == scapeBfloat16 ? FloatToBf16(pf[j]) : FloatToFp16(pf[j]);
      std::memcpy(payload.data() + 2 * j, &h, 2);
      pf[j] = type == scapeBfloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
    }
  }
  // Squared norm first (it needs m_{t-1}).
  double sq = -1;
  ASSERT_EQ(RecoveredGradSqNorm(payload.data(), type, mask.data(), k, m.data(), n, p.beta1, &sq),
            KernelStatus::kOk);
  double sq_ref = 0, sq_abs = 0;
  for (size_t j = 0; j < k; ++j) {
    const double g = (pf[j] - static_cast<double>(p.beta1) * m[mask[j]]) / (1.0 - p.beta1);
    sq_ref += g * g;
    sq_abs += (std::fabs(pf[j]) + std::fabs(m[mask[j]])) * std::fabs(g) / (1.0 - p.beta1);
  }
  EXPECT_NEAR(sq, sq_ref, 1e-6 * sq_abs + 1e-300);
  double sq1 = -1;
  ASSERT_EQ(
      RecoveredGradSqNorm(payload.data(), type, mask.data(), k, m.data(), n, p.beta1, &sq1, 1),
      KernelStatus::kOk);
  EXPECT_EQ(std::memcmp(&sq, &sq1, sizeof sq), 0) << "thread count changed the bits";

  RefState ref = ReferenceUpdate(pf, mask, theta, m, p);
  std::vector<float> theta1 = theta, m1 = m;
  ASSERT_EQ(UnpackAdamSUpdate(payload.data(), type, mask.data(), k, theta1.data(), m1.data(), n, p),
            KernelStatus::kOk);
  std::vector<char> in_mask(n, 0);
  for (Index i : mask) in_mask[i] = 1;
  for (size_t i = 0; i < n; ++i) {
    const double step = std::fabs(ref.theta[i] - theta[i] * (1.0 - double(p.lr) * p.weight_decay));
    const double tol = 2e-7 * std::fabs(ref.theta[i]) + 2e-5 * step + 1e-12;
    if (!(std::fabs(theta1[i] - ref.theta[i]) <= tol)) {
      FAIL() << "theta at " << i << (in_mask[i] ? " (masked): " : ": ") << theta1[i] << " vs "
             << ref.theta[i];
    }
    if (in_mask[i] && !(std::fabs(m1[i] - ref.m[i]) <= 1e-6 * std::fabs(ref.m[i]) + 1e-9)) {
      FAIL() << "m at " << i << ": " << m1[i] << " vs " << ref.m[i];
    }
    if (!in_mask[i] && (m1[i] != 0.0f || std::signbit(m1[i]))) {
      FAIL() << "m outside the mask at " << i << ": " << m1[i];
    }
  }
  if (!(p.clip_momentum && p.clip_scale != 1.0f)) {
    for (size_t j = 0; j < k; ++j) ASSERT_EQ(m1[mask[j]], pf[j]) << "m_t must be the payload";
  }
  // Bits independent of the thread count.
  std::vector<float> theta2 = theta, m2 = m;
  ASSERT_EQ(
      UnpackAdamSUpdate(payload.data(), type, mask.data(), k, theta2.data(), m2.data(), n, p, 1),
      KernelStatus::kOk);
  EXPECT_TRUE(SameBits(theta1, theta2));
  EXPECT_TRUE(SameBits(m1, m2));
}

TEST(UnpackAdamSUpdate, MatchesDoubleReference) {
  AdamSParams p;
  for (size_t n : kSizes) {
    for (double d : kDensities) CheckUpdate<uint32_t>(n, d, scapeFloat32, p);
  }
}

TEST(UnpackAdamSUpdate, LargeMultiThreaded) {
  AdamSParams p;
  CheckUpdate<uint32_t>(kLarge, 0.01, scapeFloat32, p);
  CheckUpdate<uint64_t>(kLarge, 1.0, scapeBfloat16, p);
}

TEST(UnpackAdamSUpdate, OptionsAndPayloadTypes) {
  const size_t n = 20011;
  AdamSParams p;
  CheckUpdate<uint64_t>(n, 0.1, scapeBfloat16, p);
  CheckUpdate<uint32_t>(n, 0.1, scapeFloat16, p);
  p.bias_correction = BiasCorrection::kAdamSReference;
  p.step = 3;
  CheckUpdate<uint32_t>(n, 0.2, scapeFloat32, p);
  p.bias_correction = BiasCorrection::kScapeArtifact;
  p.step = 7;
  CheckUpdate<uint32_t>(n, 0.2, scapeFloat32, p);
  p.bias_correction = BiasCorrection::kNone;
  p.clip_scale = 0.37f;
  CheckUpdate<uint32_t>(n, 0.2, scapeFloat32, p);
  p.clip_momentum = false;
  CheckUpdate<uint32_t>(n, 0.2, scapeFloat32, p);
  p.clip_scale = 1.0f;
  p.weight_decay = 0.0f;  // the dense pass only zeroes m
  CheckUpdate<uint32_t>(n, 0.2, scapeFloat32, p);
}

TEST(UnpackAdamSUpdate, RejectsBadArguments) {
  std::vector<float> theta(8, 1.0f), m(8, 1.0f), payload(8, 0.5f);
  const uint32_t mask[] = {1, 5};
  AdamSParams p;
  AdamSParams bad = p;
  bad.beta1 = 1.0f;
  EXPECT_EQ(
      UnpackAdamSUpdate(payload.data(), scapeFloat32, mask, 2, theta.data(), m.data(), 8, bad),
      KernelStatus::kInvalidArgument);
  bad = p;
  bad.lr = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(
      UnpackAdamSUpdate(payload.data(), scapeFloat32, mask, 2, theta.data(), m.data(), 8, bad),
      KernelStatus::kInvalidArgument);
  bad = p;
  bad.bias_correction = BiasCorrection::kScapeArtifact;
  bad.step = 0;
  EXPECT_EQ(
      UnpackAdamSUpdate(payload.data(), scapeFloat32, mask, 2, theta.data(), m.data(), 8, bad),
      KernelStatus::kInvalidArgument);
  bad = p;
  bad.clip_scale = 0.0f;
  EXPECT_EQ(
      UnpackAdamSUpdate(payload.data(), scapeFloat32, mask, 2, theta.data(), m.data(), 8, bad),
      KernelStatus::kInvalidArgument);
  const uint32_t unsorted[] = {5, 1};
  EXPECT_EQ(
      UnpackAdamSUpdate(payload.data(), scapeFloat32, unsorted, 2, theta.data(), m.data(), 8, p),
      KernelStatus::kInvalidArgument);
  EXPECT_EQ(theta, std::vector<float>(8, 1.0f));
  EXPECT_EQ(m, std::vector<float>(8, 1.0f));
  double sq;
  EXPECT_EQ(RecoveredGradSqNorm(payload.data(), scapeFloat32, mask, 2, m.data(), 8, 1.5f, &sq),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(RecoveredGradSqNorm(payload.data(), scapeInt64, mask, 2, m.data(), 8, 0.9f, &sq),
            KernelStatus::kUnsupported);
  EXPECT_EQ(RecoveredGradSqNorm(payload.data(), scapeFloat32, mask, 0, m.data(), 8, 0.9f, &sq),
            KernelStatus::kOk);
  EXPECT_EQ(sq, 0.0);
}

TEST(RecoveredGradSqNorm, BlockedOrderIsExact) {
  // With values that make the summation order visible, the result must equal the documented
  // blocked order exactly.
  SCAPE_SEEDED_RNG(rng);
  const size_t n = 256 * 256 * 3 + 77;
  std::vector<float> m(n, 0.0f);
  std::vector<float> payload(n);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : payload) v = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  std::vector<uint32_t> mask(n);
  for (size_t i = 0; i < n; ++i) mask[i] = static_cast<uint32_t>(i);
  const float b1 = 0.5f;  // omb1 = 0.5: g = 2*payload exactly
  std::vector<double> level(n);
  for (size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>((payload[i] - b1 * 0.0f) / 0.5f);
    level[i] = g * g;
  }
  while (level.size() > 1) {
    std::vector<double> next;
    for (size_t lo = 0; lo < level.size(); lo += kSqNormBlock) {
      double acc = level[lo];
      for (size_t i = lo + 1; i < std::min(level.size(), lo + kSqNormBlock); ++i) acc += level[i];
      next.push_back(acc);
    }
    level.swap(next);
  }
  double sq = 0;
  ASSERT_EQ(RecoveredGradSqNorm(payload.data(), scapeFloat32, mask.data(), n, m.data(), n, b1, &sq),
            KernelStatus::kOk);
  EXPECT_EQ(std::memcmp(&sq, &level[0], sizeof sq), 0) << sq << " vs " << level[0];
}

// The local clipping's norm (GradSqNorm): a rank's own gradient of each type, widened, summed in
// the blocked order, at sizes around the block and level boundaries, the same bits on 1 and 2
// threads and against an independent blocked sum.
TEST(GradSqNorm, BlockedOrderEveryTypeAndSize) {
  SCAPE_SEEDED_RNG(rng);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (size_t n : {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{257},
                   size_t{256 * 256 + 1}, kLarge}) {
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " type=" << t);
      std::vector<float> wide(n);
      std::vector<uint16_t> narrow(n);
      for (size_t i = 0; i < n; ++i) {
        // Magnitudes spread over 2^-10..2^10 (fp16's range) so the order shows.
        const float x = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
        narrow[i] = t == scapeBfloat16 ? FloatToBf16(x) : FloatToFp16(x);
        wide[i] = t == scapeFloat32    ? x
                  : t == scapeBfloat16 ? Bf16ToFloat(narrow[i])
                                       : Fp16ToFloat(narrow[i]);
      }
      std::vector<double> level(n);
      for (size_t i = 0; i < n; ++i) level[i] = static_cast<double>(wide[i]) * wide[i];
      while (level.size() > 1) {
        std::vector<double> next;
        for (size_t lo = 0; lo < level.size(); lo += kSqNormBlock) {
          double acc = level[lo];
          for (size_t i = lo + 1; i < std::min(level.size(), lo + kSqNormBlock); ++i)
            acc += level[i];
          next.push_back(acc);
        }
        level.swap(next);
      }
      const double want = level.empty() ? 0.0 : level[0];
      const void* g = t == scapeFloat32 ? static_cast<const void*>(wide.data())
                                        : static_cast<const void*>(narrow.data());
      for (int threads : {1, 2}) {
        double sq = -1.0;
        ASSERT_EQ(GradSqNorm(g, t, n, &sq, threads), KernelStatus::kOk);
        EXPECT_EQ(std::memcmp(&sq, &want, sizeof sq), 0) << sq << " vs " << want;
      }
    }
  }
  double sq = 0.0;
  const float one = 1.0f;
  EXPECT_EQ(GradSqNorm(nullptr, scapeFloat32, 3, &sq), KernelStatus::kInvalidArgument);
  EXPECT_EQ(GradSqNorm(&one, scapeFloat32, 1, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(GradSqNorm(&one, scapeInt32, 1, &sq), KernelStatus::kUnsupported);
  EXPECT_EQ(GradSqNorm(nullptr, scapeFloat32, 0, &sq), KernelStatus::kOk);
  EXPECT_EQ(sq, 0.0);
}

// The candidate's grad_scale (local clipping): the gradient weighted by (1 - b1) * s rounded
// once, against an independent computation; s = 1 gives the unscaled kernel's bits; s outside
// (0, 1] is refused.
TEST(CandidatePackResidual, GradScaleWeighsTheGradient) {
  SCAPE_SEEDED_RNG(rng);
  const size_t n = 4099;
  const float b1 = 0.9f, s = 0.3712f;
  std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 3.0f),
                     e = RandomNormal(rng, n, 0.1f);
  std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.05);
  const size_t k = mask.size();
  std::vector<float> pay(k + 1), c(n), e1 = e;
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), e1.data(), n, b1, mask.data(), k,
                                  scapeFloat32, pay.data(), c.data(), 0, true, s),
            KernelStatus::kOk);
  const float w = (1.0f - b1) * s;
  for (size_t i = 0; i < n; ++i) {
    const float want = ((b1 * m[i]) + (w * g[i])) + e[i];
    ASSERT_EQ(std::memcmp(&c[i], &want, 4), 0) << i;
  }
  for (size_t j = 0; j < k; ++j) ASSERT_EQ(pay[j], c[mask[j]]) << j;
  std::vector<float> eA = e, eB = e, cA(n), cB(n);
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), eA.data(), n, b1, mask.data(), k,
                                  scapeFloat32, pay.data(), cA.data()),
            KernelStatus::kOk);
  ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), eB.data(), n, b1, mask.data(), k,
                                  scapeFloat32, pay.data(), cB.data(), 0, false, 1.0f),
            KernelStatus::kOk);
  EXPECT_TRUE(SameBits(cA, cB));
  EXPECT_TRUE(SameBits(eA, eB));
  for (float bad : {0.0f, -0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> eC = e;
    EXPECT_EQ(CandidatePackResidual(m.data(), g.data(), eC.data(), n, b1, mask.data(), k,
                                    scapeFloat32, pay.data(), nullptr, 0, false, bad),
              KernelStatus::kInvalidArgument)
        << bad;
    EXPECT_TRUE(SameBits(eC, e)) << "written on error";
  }
}

}  // namespace
}  // namespace kernels
}  // namespace scape
