// The SCAPE-AdamS optimizer step (scapeOptim*), over real UCX on loopback, against a reference
// written here from SCAPE.md with plain loops.
//
// The reference simulates every rank in every process (each rank's gradients are a function of
// the seed, the rank and the step), follows the operation order the kernel contracts document
// (kernels/cpu/scape_step.h: fp32, every operation rounded separately; the owner-block ring
// average of the collectives: block b summed from rank b+1 around to rank b, rounded to the
// payload type once per hop; the blocked double sum of the squared norm), and must match the
// library's parameters and momentum bit for bit after every step. The mask is selected by the
// reference itself (top-k per owned segment piece, ties to the lower index); only the owned
// ranges are read from the library.
//
// This file is built with -ffp-contract=off (tests/CMakeLists.txt): the reference relies on it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scape_step.h"
#include "tests/checkpoint_util.h"
#include "tests/fp8_ref.h"
#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {
using scape::testing::Fp8Round;
using scape::testing::Fp8Value;

using scape::kernels::Bf16ToFloat;
using scape::kernels::FloatToBf16;
using scape::kernels::FloatToFp16;
using scape::kernels::Fp16ToFloat;

// Odd sizes, an empty segment, a 1-element segment and two always-dense segments.
struct Layout {
  std::vector<uint64_t> offs{0, 0, 1, 700, 713, 713, 2000, 3001, 3011};
  std::vector<uint8_t> dense{0, 0, 0, 1, 0, 0, 0, 1};
  uint64_t n() const { return offs.back(); }
  int nseg() const { return static_cast<int>(offs.size() - 1); }
};

struct Hyper {
  float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, clip = 5.0f;
  int bias = scapeBiasCorrectionNone;
  double density = 0.05;
  int64_t warmup = 20;
  scapeDataType_t payload = scapeFloat32;
  int ownership = scapeOptimReplicated;
  int maskOwnership = -1;
  int clipNorm = scapeOptimClipNormRecovered;
};

scapeOptimConfig_t MakeConfig(const Layout& l, const Hyper& h) {
  scapeOptimConfig_t c;
  EXPECT_EQ(scapeOptimConfigInit(&c), scapeSuccess);
  c.n = l.n();
  c.nsegments = l.nseg();
  c.segOffsets = l.offs.data();
  c.denseFlags = l.dense.data();
  c.ownership = h.ownership;
  c.maskOwnership = h.maskOwnership;
  c.lr = h.lr;
  c.beta1 = h.b1;
  c.beta2 = h.b2;
  c.eps = h.eps;
  c.weightDecay = h.wd;
  c.maxGradNorm = h.clip;
  c.biasCorrection = h.bias;
  c.density = h.density;
  c.warmupSteps = h.warmup;
  c.payloadType = h.payload;
  c.clipNorm = h.clipNorm;
  return c;
}

// Every fourth step's gradients are 5x larger: clipping (maxGradNorm 5) acts on those only.
float Grad(unsigned seed, int rank, int64_t step, uint64_t i) {
  return (step % 4 == 0 ? 0.25f : 0.05f) *
         static_cast<float>(
             InputValue(scapeFloat32, seed + static_cast<unsigned>(step) * 7919u, rank, i));
}

// The 8-bit payloads (a shared power-of-two scale, from the format's definition:
// tests/fp8_ref.h) and their largest finite values.
bool Scaled(scapeDataType_t t) { return t == scapeFloat8E4M3 || t == scapeFloat8E5M2; }
const scape::testing::Fp8Format& Fmt(scapeDataType_t t) {
  return t == scapeFloat8E4M3 ? scape::testing::kE4m3 : scape::testing::kE5m2;
}
double MaxFinite(scapeDataType_t t) { return t == scapeFloat8E4M3 ? 448.0 : 57344.0; }

float Quant(scapeDataType_t t, float x) {
  if (t == scapeBfloat16) return Bf16ToFloat(FloatToBf16(x));
  if (t == scapeFloat16) return Fp16ToFloat(FloatToFp16(x));
  if (Scaled(t)) return static_cast<float>(Fp8Value(Fmt(t), Fp8Round(Fmt(t), x)));
  return x;
}

double Density(const Hyper& h, int64_t t) {
  if (t <= 0) return 1.0;
  if (h.warmup > 0 && t < h.warmup)
    return std::pow(h.density, static_cast<double>(t) / static_cast<double>(h.warmup));
  return h.density;
}

// Blocked sum of kernels/cpu/scape_step.h (RecoveredGradSqNorm).
double BlockedSum(std::vector<double> v) {
  size_t count = v.size();
  while (count > 1) {
    const size_t out = (count + 255) / 256;
    for (size_t b = 0; b < out; ++b) {
      double acc = v[b * 256];
      for (size_t i = b * 256 + 1; i < std::min(count, b * 256 + 256); ++i) acc = acc + v[i];
      v[b] = acc;
    }
    count = out;
  }
  return count == 1 ? v[0] : 0.0;
}

// The whole data-parallel step of SCAPE.md section 2 for P simulated ranks.
class Reference {
 public:
  struct Piece {
    uint64_t b, e;
    bool dense;
  };
  Reference(const Layout& l, const Hyper& h, int P, const std::vector<std::vector<Piece>>& owned,
            const std::vector<float>& theta0)
      : l_(l),
        h_(h),
        P_(P),
        owned_(owned),
        theta(theta0),
        m(l.n(), 0.0f),
        e_(static_cast<size_t>(P), std::vector<float>(l.n(), 0.0f)) {
    // Step 0: the full mask.
    for (int r = 0; r < P_; ++r) {
      std::vector<uint64_t> blk;
      for (const Piece& p : owned_[static_cast<size_t>(r)])
        for (uint64_t i = p.b; i < p.e; ++i) blk.push_back(i);
      mask_.push_back(blk);
    }
  }

  // libClip: the clip factor the library reported for this step. With clipNorm = staying the
  // reference sums the staying g^2 in its own order (a plain double sum), so its factor may
  // differ from the library's blocked sums in the last bits: it must agree within 1e-6
  // (counted in clipMismatch), and the library's factor is then used so that the rest of the
  // step is still compared bit for bit.
  void Step(unsigned seed, float libClip = -1.0f) {
    const uint64_t n = l_.n();
    const scapeDataType_t T = h_.payload;
    const float b1 = h_.b1, omb1c = 1.0f - b1;
    std::vector<char> in(n, 0);
    for (const auto& blk : mask_)
      for (uint64_t i : blk) in[i] = 1;
    // Candidate, payload (mask order), residual with error feedback.
    std::vector<std::vector<float>> c(static_cast<size_t>(P_), std::vector<float>(n));
    std::vector<std::vector<float>> pay(static_cast<size_t>(P_));
    const bool local = h_.clipNorm == scapeOptimClipNormLocal;
    localScale.assign(static_cast<size_t>(P_), 1.0f);
    bool anyLocal = false;
    for (int r = 0; r < P_; ++r) {
      std::vector<float>& e = e_[static_cast<size_t>(r)];
      // clipNorm = local: the rank's own gradient norm (blocked order), its factor weighs g.
      float wg = omb1c;
      if (local && h_.clip > 0.0f) {
        std::vector<double> sq(n);
        for (uint64_t i = 0; i < n; ++i) {
          const double g = static_cast<double>(Grad(seed, r, step, i));
          sq[i] = g * g;
        }
        const double norm = std::sqrt(BlockedSum(sq));
        const double cc = static_cast<double>(h_.clip) / (norm + 1e-6);
        if (cc < 1.0)
          localScale[static_cast<size_t>(r)] = std::max(static_cast<float>(cc), FLT_MIN);
        wg = omb1c * localScale[static_cast<size_t>(r)];
        anyLocal = anyLocal || localScale[static_cast<size_t>(r)] < 1.0f;
      }
      for (uint64_t i = 0; i < n; ++i) {
        const float g = Grad(seed, r, step, i);
        const float ci = ((b1 * m[i]) + (wg * g)) + e[i];
        c[static_cast<size_t>(r)][i] = ci;
        if (!in[i]) {
          e[i] = ci;
        } else {
          const float q = Scaled(T) ? ci : Quant(T, ci);
          e[i] = (T == scapeFloat32 || Scaled(T) || !std::isfinite(q)) ? 0.0f : ci - q;
        }
      }
      for (const auto& blk : mask_)
        for (uint64_t i : blk)
          pay[static_cast<size_t>(r)].push_back(Scaled(T) ? c[static_cast<size_t>(r)][i]
                                                          : Quant(T, c[static_cast<size_t>(r)][i]));
    }
    // An 8-bit payload: the scale 2^es from the largest |value| of every rank (the smallest es
    // with amax * P / 2^es <= the largest finite value), each value rounded at that scale, its
    // rounding error back into the residual; the ring below then adds the scaled values.
    int es = 0;
    if (Scaled(T)) {
      double amax = 0.0;
      for (const auto& pr : pay)
        for (float v : pr) amax = std::max(amax, std::fabs(static_cast<double>(v)));
      if (amax > 0.0) {
        es = -400;
        while (amax * P_ / std::ldexp(1.0, es) > MaxFinite(T)) ++es;
      }
      for (int r = 0; r < P_; ++r) {
        size_t j = 0;
        for (const auto& blk : mask_)
          for (uint64_t i : blk) {
            float& v = pay[static_cast<size_t>(r)][j++];
            const double q =
                Fp8Value(Fmt(T), Fp8Round(Fmt(T), std::ldexp(static_cast<double>(v), -es)));
            const float err = v - static_cast<float>(std::ldexp(q, es));
            e_[static_cast<size_t>(r)][i] = std::isfinite(err) ? err : 0.0f;
            v = static_cast<float>(q);
          }
      }
    }
    // The next mask: each rank's top-k of |c| over the pieces it owns.
    const double rho = Density(h_, step + 1);
    std::vector<std::vector<uint64_t>> next(static_cast<size_t>(P_));
    for (int r = 0; r < P_; ++r) {
      const std::vector<float>& cr = c[static_cast<size_t>(r)];
      for (const Piece& p : owned_[static_cast<size_t>(r)]) {
        const uint64_t len = p.e - p.b;
        uint64_t k =
            p.dense ? len : static_cast<uint64_t>(std::floor(rho * static_cast<double>(len)));
        if (!p.dense) k = std::max<uint64_t>(1, std::min(k, len));
        std::vector<uint64_t> pos;
        for (uint64_t i = p.b; i < p.e; ++i) pos.push_back(i);
        std::stable_sort(pos.begin(), pos.end(), [&](uint64_t x, uint64_t y) {
          return std::fabs(cr[x]) > std::fabs(cr[y]);
        });
        pos.resize(k);
        std::sort(pos.begin(), pos.end());
        next[static_cast<size_t>(r)].insert(next[static_cast<size_t>(r)].end(), pos.begin(),
                                            pos.end());
      }
      std::sort(next[static_cast<size_t>(r)].begin(), next[static_cast<size_t>(r)].end());
    }
    // Average over ranks, owner block by owner block, in the ring's order.
    std::vector<float> mt;
    std::vector<double> partial;
    size_t off = 0;
    for (int b = 0; b < P_; ++b) {
      std::vector<double> sq;
      for (size_t jj = 0; jj < mask_[static_cast<size_t>(b)].size(); ++jj) {
        const size_t j = off + jj;
        float acc;
        if (P_ == 1) {
          acc = pay[0][j];
        } else {
          acc = pay[static_cast<size_t>((b + 1) % P_)][j];
          for (int s = 2; s < P_; ++s)
            acc = Quant(T, acc + pay[static_cast<size_t>((b + s) % P_)][j]);
          acc = Quant(T, (acc + pay[static_cast<size_t>(b)][j]) / static_cast<float>(P_));
        }
        if (Scaled(T)) acc = std::ldexp(acc, es);
        mt.push_back(acc);
        const float mp = m[mask_[static_cast<size_t>(b)][jj]];
        const double gh = static_cast<double>((acc - (b1 * mp)) / omb1c);
        sq.push_back(gh * gh);
      }
      partial.push_back(BlockedSum(sq));
      off += mask_[static_cast<size_t>(b)].size();
    }
    double total = 0.0;
    for (double p : partial) total += p;
    if (h_.clipNorm == scapeOptimClipNormStaying) {
      // Only the staying coordinates: masked, previous momentum non-zero.
      total = 0.0;
      size_t o = 0;
      for (int b = 0; b < P_; ++b)
        for (uint64_t i : mask_[static_cast<size_t>(b)]) {
          const float mp = m[i];
          const double gh = static_cast<double>((mt[o++] - (b1 * mp)) / omb1c);
          if (mp != 0.0f) total += gh * gh;
        }
    }
    const double norm = std::sqrt(total);
    float clip = 1.0f;
    if (h_.clip > 0.0f && !local && std::isfinite(norm)) {
      const double cc = static_cast<double>(h_.clip) / (norm + 1e-6);
      if (cc < 1.0) clip = std::max(static_cast<float>(cc), FLT_MIN);
    }
    if (h_.clipNorm == scapeOptimClipNormStaying && libClip >= 0.0f) {
      if (std::fabs(libClip - clip) > 1e-6f * clip) ++clipMismatch;
      clip = libClip;
    }
    clipped += clip < 1.0f || anyLocal;
    lastClip = clip;
    // AdamS at the mask; decoupled decay and m = 0 elsewhere.
    const int64_t t = step + 1;
    const double bc1 = 1.0 - std::pow(static_cast<double>(h_.b1), static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(static_cast<double>(h_.b2), static_cast<double>(t));
    float mscale = 1.0f, pscale = 1.0f, vscale = 1.0f;
    if (h_.bias == scapeBiasCorrectionAdamS) mscale = pscale = static_cast<float>(1.0 / bc1);
    if (h_.bias == scapeBiasCorrectionArtifact) {
      mscale = static_cast<float>(1.0 / bc1);
      vscale = static_cast<float>(1.0 / bc2);
    }
    const float omb1 = static_cast<float>(1.0 - static_cast<double>(h_.b1));
    const float omb2 = static_cast<float>(1.0 - static_cast<double>(h_.b2));
    const float decay = static_cast<float>(1.0 - static_cast<double>(h_.lr) * h_.wd);
    std::vector<float> newTheta = theta, newM(n, 0.0f);
    for (uint64_t i = 0; i < n; ++i)
      if (!in[i] && decay != 1.0f) newTheta[i] = theta[i] * decay;
    off = 0;
    for (int b = 0; b < P_; ++b)
      for (uint64_t i : mask_[static_cast<size_t>(b)]) {
        const float mtj = mt[off++], mp = m[i];
        const float g = ((mtj - (h_.b1 * mp)) / omb1) * clip;
        const float mn = clip != 1.0f ? ((h_.b1 * mp) + (omb1 * g)) : mtj;
        const float mpc = mp * pscale;
        const float v = (h_.b2 * (mpc * mpc)) + (omb2 * (g * g));
        const float den = std::sqrt(v * vscale) + h_.eps;
        newTheta[i] = (theta[i] * decay) - ((h_.lr * (mn * mscale)) / den);
        newM[i] = mn;
      }
    theta.swap(newTheta);
    m.swap(newM);
    mask_ = next;
    ++step;
  }

  const Layout& l_;
  Hyper h_;
  int P_;
  std::vector<std::vector<Piece>> owned_;
  std::vector<float> theta, m;
  std::vector<std::vector<float>> e_;
  std::vector<std::vector<uint64_t>> mask_;  // per owner, increasing
  int64_t step = 0;
  int clipped = 0;
  int clipMismatch = 0;
  float lastClip = 1.0f;
  std::vector<float> localScale;  // clipNorm = local: each rank's factor in the last step
};

std::vector<std::vector<Reference::Piece>> OwnedPieces(scapeOptim_t opt, const Layout& l, int P,
                                                       scapeComm_t comm) {
  scapeMask_t mask = nullptr;
  EXPECT_SCAPE_OK(scapeOptimGetMask(opt, &mask), comm);
  std::vector<std::vector<Reference::Piece>> out(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    size_t nr = 0;
    EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, r, nullptr, 0, &nr), comm);
    std::vector<uint64_t> rg(2 * nr + 2);
    EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, r, rg.data(), nr, &nr), comm);
    for (size_t q = 0; q < nr; ++q)
      for (int s = 0; s < l.nseg(); ++s) {
        const uint64_t b = std::max(rg[2 * q], l.offs[static_cast<size_t>(s)]);
        const uint64_t e = std::min(rg[2 * q + 1], l.offs[static_cast<size_t>(s) + 1]);
        if (b < e)
          out[static_cast<size_t>(r)].push_back({b, e, l.dense[static_cast<size_t>(s)] != 0});
      }
  }
  return out;
}

std::vector<float> InitialTheta(unsigned seed, uint64_t n) {
  std::vector<float> t(n);
  for (uint64_t i = 0; i < n; ++i)
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

std::vector<float> Grads(unsigned seed, int rank, int64_t step, uint64_t n) {
  std::vector<float> g(n);
  for (uint64_t i = 0; i < n; ++i) g[i] = Grad(seed, rank, step, i);
  return g;
}

constexpr int kSteps = 50;

// 50 steps against the reference, every payload type (one optimizer each, in turn); with
// clipNorm = staying or local (issue 30) fp32 only.
void ReferenceCase(int P, int ownership, int clipNorm = scapeOptimClipNormRecovered) {
  const unsigned seed = FreshSeed() + static_cast<unsigned>(P * 101 + ownership * 13);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    const scapeDataType_t types[] = {scapeFloat32, scapeBfloat16, scapeFloat16, scapeFloat8E4M3,
                                     scapeFloat8E5M2};
    for (int ti = 0; ti < (clipNorm == scapeOptimClipNormRecovered ? 5 : 1); ++ti) {
      Hyper h;
      h.payload = types[ti];
      h.ownership = ownership;
      h.clipNorm = clipNorm;
      // The staying coordinates are a few per cent of the layout and their g^ is averaged over
      // the ranks: at 4 ranks their norm rarely reached 5 (clipping never ran for 2 seeds in
      // 100). At 1 it is reached on the 5x steps only, at every rank count.
      if (clipNorm == scapeOptimClipNormStaying) h.clip = 1.0f;
      h.bias = ti % 3;  // none, AdamS reference, SCAPE artifact
      scapeOptimConfig_t cfg = MakeConfig(l, h);
      scapeOptim_t opt = nullptr;
      EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
      if (!opt) return false;
      std::vector<float> theta = InitialTheta(seed, n);
      Reference ref(l, h, P, OwnedPieces(opt, l, P, c.comm), theta);
      bool sawTarget = false;
      for (int step = 0; step < kSteps; ++step) {
        std::vector<float> g = Grads(seed, c.rank, step, n);
        EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
        scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
        EXPECT_SCAPE_OK(scapeOptimGetInfo(opt, &info), c.comm);
        ref.Step(seed, info.clipScale);
        const bool sameTheta = std::memcmp(theta.data(), ref.theta.data(), 4 * n) == 0;
        size_t firstBad = 0;
        while (!sameTheta && firstBad < n &&
               std::memcmp(&theta[firstBad], &ref.theta[firstBad], 4) == 0)
          ++firstBad;
        EXPECT_TRUE(sameTheta) << "rank " << c.rank << " payload " << h.payload << " step " << step
                               << ": parameters differ from the reference first at " << firstBad
                               << " (" << (firstBad < n ? theta[firstBad] : 0.f) << " vs "
                               << (firstBad < n ? ref.theta[firstBad] : 0.f) << ")";
        EXPECT_TRUE(SameOnAllRanks(c, theta.data(), 4 * n)) << "parameters differ between ranks";
        EXPECT_EQ(info.step, step + 1);
        EXPECT_EQ(info.clipScale, clipNorm == scapeOptimClipNormLocal
                                      ? ref.localScale[static_cast<size_t>(c.rank)]
                                      : ref.lastClip)
            << "step " << step;
        // The residual (n floats) and the momentum packed at the mask (one float per entry).
        EXPECT_EQ(info.stateBytes, 4 * n + 4 * info.maskCount);
        if (P > 1) {
          EXPECT_GT(info.payloadBytes + info.denseBytes, 0u);
        }
        if (info.density == h.density) sawTarget = true;
        if (!sameTheta) break;
      }
      EXPECT_TRUE(sawTarget) << "the warm-up never reached the target density";
      EXPECT_GT(ref.clipped, 0) << "clipping was never active";
      EXPECT_LT(ref.clipped, kSteps) << "clipping was always active";
      EXPECT_EQ(ref.clipMismatch, 0) << "the staying clip factor differs from the reference's";
      EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

class OptimRanks : public ::testing::TestWithParam<int> {};
TEST_P(OptimRanks, ReplicatedMatchesReference) { ReferenceCase(GetParam(), scapeOptimReplicated); }
TEST_P(OptimRanks, ShardedMatchesReference) { ReferenceCase(GetParam(), scapeOptimSharded); }
// Issue 30: the clipping norm over the staying coordinates only.
TEST_P(OptimRanks, StayingClipNormMatchesReference) {
  ReferenceCase(GetParam(), scapeOptimReplicated, scapeOptimClipNormStaying);
  ReferenceCase(GetParam(), scapeOptimSharded, scapeOptimClipNormStaying);
}
// Issue 30: Deep Gradient Compression's local clipping (each rank's own gradient, before error
// feedback; g^ is not clipped).
TEST_P(OptimRanks, LocalClipNormMatchesReference) {
  ReferenceCase(GetParam(), scapeOptimReplicated, scapeOptimClipNormLocal);
  ReferenceCase(GetParam(), scapeOptimSharded, scapeOptimClipNormLocal);
}
INSTANTIATE_TEST_SUITE_P(Ranks, OptimRanks, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// Sharded and replicated state with the same mask ownership give the same bits, every step.
TEST(Optim, ShardedEqualsReplicated) {
  const unsigned seed = FreshSeed() + 555u;
  for (int P : {3, 4}) {
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      Layout l;
      const uint64_t n = l.n();
      for (int mo : {scapeOwnershipShards, scapeOwnershipSegments}) {
        Hyper h;
        h.payload = scapeBfloat16;
        h.maskOwnership = mo;
        h.ownership = scapeOptimReplicated;
        scapeOptimConfig_t c1 = MakeConfig(l, h);
        h.ownership = scapeOptimSharded;
        scapeOptimConfig_t c2 = MakeConfig(l, h);
        scapeOptim_t rep = nullptr, sh = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&rep, &c1, c.comm), c.comm);
        EXPECT_SCAPE_OK(scapeOptimCreate(&sh, &c2, c.comm), c.comm);
        if (!rep || !sh) return false;
        std::vector<float> t1 = InitialTheta(seed, n), t2 = t1;
        for (int step = 0; step < kSteps; ++step) {
          std::vector<float> g = Grads(seed, c.rank, step, n);
          EXPECT_SCAPE_OK(scapeOptimStep(rep, t1.data(), g.data(), n), c.comm);
          EXPECT_SCAPE_OK(scapeOptimStep(sh, t2.data(), g.data(), n), c.comm);
          EXPECT_EQ(std::memcmp(t1.data(), t2.data(), 4 * n), 0)
              << "sharded != replicated at step " << step << " (mask ownership " << mo << ")";
          if (std::memcmp(t1.data(), t2.data(), 4 * n) != 0) break;
        }
        scapeOptimInfo_t i1 = SCAPE_OPTIM_INFO_INITIALIZER, i2 = SCAPE_OPTIM_INFO_INITIALIZER;
        EXPECT_SCAPE_OK(scapeOptimGetInfo(rep, &i1), c.comm);
        EXPECT_SCAPE_OK(scapeOptimGetInfo(sh, &i2), c.comm);
        EXPECT_EQ(i1.gradNorm, i2.gradNorm);
        EXPECT_EQ(i1.maskCount, i2.maskCount);
        EXPECT_SCAPE_OK(scapeOptimDestroy(rep), c.comm);
        EXPECT_SCAPE_OK(scapeOptimDestroy(sh), c.comm);
      }
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

std::vector<uint8_t> Save(scapeOptim_t opt, scapeComm_t comm) {
  size_t sz = 0, w = 0;
  EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), comm);
  std::vector<uint8_t> buf(sz);
  EXPECT_SCAPE_OK(scapeOptimSave(opt, buf.data(), buf.size(), &w), comm);
  EXPECT_EQ(w, sz);
  return buf;
}

// Checkpoint at step 17, a fresh optimizer loads it, and step 50 has the uninterrupted bits.
TEST(Optim, CheckpointResumeIsBitIdentical) {
  const unsigned seed = FreshSeed() + 1717u;
  for (int P : {2, 3}) {
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      Layout l;
      const uint64_t n = l.n();
      for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
        Hyper h;
        h.ownership = own;
        h.payload = own == scapeOptimSharded ? scapeFloat16 : scapeBfloat16;
        h.bias = scapeBiasCorrectionArtifact;
        // the clipping norm is in the checkpoint (version 5): the resumed optimizer is made with
        // the other one
        if (own == scapeOptimSharded) h.clipNorm = scapeOptimClipNormStaying;
        scapeOptimConfig_t cfg = MakeConfig(l, h);
        scapeOptim_t a = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
        if (!a) return false;
        std::vector<float> ta = InitialTheta(seed, n), tb;
        std::vector<uint8_t> ck;
        for (int step = 0; step < kSteps; ++step) {
          if (step == 17) {
            ck = Save(a, c.comm);
            tb = ta;
          }
          std::vector<float> g = Grads(seed, c.rank, step, n);
          EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), n), c.comm);
        }
        // Resume from the checkpoint in a new optimizer created with other hyperparameters
        // (the checkpoint's win).
        Hyper h2 = h;
        h2.lr = 0.5f;
        h2.density = 0.5;
        h2.clipNorm = 1 - h.clipNorm;
        scapeOptimConfig_t cfg2 = MakeConfig(l, h2);
        scapeOptim_t b = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&b, &cfg2, c.comm), c.comm);
        if (!b) return false;
        EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
        scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
        EXPECT_SCAPE_OK(scapeOptimGetInfo(b, &info), c.comm);
        EXPECT_EQ(info.step, 17);
        for (int step = 17; step < kSteps; ++step) {
          std::vector<float> g = Grads(seed, c.rank, step, n);
          EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), n), c.comm);
        }
        EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * n), 0)
            << "resumed run differs from the uninterrupted one at step 50 (ownership " << own
            << ")";
        // A checkpoint of a fresh optimizer (no next mask yet) loads too.
        scapeOptim_t f = nullptr;
        EXPECT_SCAPE_OK(scapeOptimCreate(&f, &cfg, c.comm), c.comm);
        std::vector<uint8_t> ck0 = Save(f, c.comm);
        EXPECT_SCAPE_OK(scapeOptimLoad(b, ck0.data(), ck0.size()), c.comm);
        EXPECT_SCAPE_OK(scapeOptimGetInfo(b, &info), c.comm);
        EXPECT_EQ(info.step, 0);
        EXPECT_SCAPE_OK(scapeOptimDestroy(f), c.comm);
        EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
        EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
      }
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// Version 4 checkpoints (before the clipping norm was a choice) load with the recovered-gradient
// norm; a version-4 checkpoint claiming another is refused.
TEST(Optim, Version4CheckpointsClipByTheRecoveredNorm) {
  const unsigned seed = FreshSeed() + 4444u;
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    Hyper h;
    scapeOptimConfig_t cfg = MakeConfig(l, h);
    scapeOptim_t a = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
    std::vector<float> ta = InitialTheta(seed, n);
    for (int step = 0; step < 6; ++step) {
      std::vector<float> g = Grads(seed, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), n), c.comm);
    }
    std::vector<uint8_t> ck = Save(a, c.comm);
    uint32_t ver = 0;
    std::memcpy(&ver, ck.data() + 8, 4);
    EXPECT_EQ(ver, 6u);  // version 6: the density schedule's shape (issue 42)
    EXPECT_EQ(ck[111], scapeOptimClipNormRecovered);
    const uint32_t v4 = 4;
    std::memcpy(ck.data() + 8, &v4, 4);
    Reseal(&ck);
    Hyper hs = h;
    hs.clipNorm = scapeOptimClipNormStaying;
    scapeOptimConfig_t cfgs = MakeConfig(l, hs);
    scapeOptim_t b = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&b, &cfgs, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimLoad(b, ck.data(), ck.size()), c.comm);
    std::vector<float> tb = ta;
    for (int step = 6; step < 20; ++step) {
      std::vector<float> g = Grads(seed, c.rank, step, n);
      EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), n), c.comm);
      EXPECT_SCAPE_OK(scapeOptimStep(b, tb.data(), g.data(), n), c.comm);
    }
    EXPECT_EQ(std::memcmp(ta.data(), tb.data(), 4 * n), 0)
        << "a version-4 checkpoint did not restore the recovered-gradient clipping norm";
    ck[111] = scapeOptimClipNormStaying;
    Reseal(&ck);
    EXPECT_EQ(scapeOptimLoad(b, ck.data(), ck.size()), scapeInvalidArgument);
    EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(b), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Every bad checkpoint is refused on every rank with a message, and the optimizer goes on
// exactly as if the load had not been tried.
TEST(Optim, CorruptCheckpointsAreRefused) {
  const unsigned seed = FreshSeed() + 4040u;
  char path[] = "/tmp/scape_optim_test_XXXXXX";
  ASSERT_NE(mkdtemp(path), nullptr);
  const std::string dir = path;
  // A checkpoint saved on 1 rank, for the rank-count case.
  RunResult r1 = RunRanks(1, [&](RankCtx& c) {
    Layout l;
    scapeOptimConfig_t cfg = MakeConfig(l, Hyper());
    scapeOptim_t o = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfg, c.comm), c.comm);
    if (!o) return false;
    std::vector<uint8_t> ck = Save(o, c.comm);
    FILE* f = std::fopen((dir + "/p1").c_str(), "wb");
    if (!f) return false;
    std::fwrite(ck.data(), 1, ck.size(), f);
    std::fclose(f);
    EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
    return true;
  });
  ASSERT_TRUE(r1.AllOk()) << r1.Describe();

  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    Hyper h;
    h.payload = scapeBfloat16;
    scapeOptimConfig_t cfg = MakeConfig(l, h);
    scapeOptim_t a = nullptr, twin = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&a, &cfg, c.comm), c.comm);
    EXPECT_SCAPE_OK(scapeOptimCreate(&twin, &cfg, c.comm), c.comm);
    if (!a || !twin) return false;
    std::vector<float> ta = InitialTheta(seed, n), tt = ta;
    int step = 0;
    auto advance = [&](int steps) {
      for (int s = 0; s < steps; ++s, ++step) {
        std::vector<float> g = Grads(seed, c.rank, step, n);
        EXPECT_SCAPE_OK(scapeOptimStep(a, ta.data(), g.data(), n), c.comm);
        EXPECT_SCAPE_OK(scapeOptimStep(twin, tt.data(), g.data(), n), c.comm);
      }
    };
    advance(5);
    std::vector<uint8_t> good = Save(a, c.comm);
    // Another layout (same n, other segments), saved by another optimizer.
    Layout other;
    other.offs = {0, 1500, 3011};
    other.dense = {0, 0};
    scapeOptimConfig_t cfgO = MakeConfig(other, h);
    scapeOptim_t o = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&o, &cfgO, c.comm), c.comm);
    std::vector<uint8_t> otherLayout = o ? Save(o, c.comm) : std::vector<uint8_t>();
    if (o) {
      EXPECT_SCAPE_OK(scapeOptimDestroy(o), c.comm);
    }
    // The other rank's checkpoint, through a file.
    {
      FILE* f = std::fopen((dir + "/r" + std::to_string(c.rank)).c_str(), "wb");
      if (!f) return false;
      std::fwrite(good.data(), 1, good.size(), f);
      std::fclose(f);
    }
    EXPECT_SCAPE_OK(scapeBarrier(c.comm), c.comm);
    auto readFile = [](const std::string& p) {
      std::vector<uint8_t> v;
      FILE* f = std::fopen(p.c_str(), "rb");
      if (!f) return v;
      int ch;
      while ((ch = std::fgetc(f)) != EOF) v.push_back(static_cast<uint8_t>(ch));
      std::fclose(f);
      return v;
    };
    std::vector<uint8_t> peer = readFile(dir + "/r" + std::to_string(1 - c.rank));
    std::vector<uint8_t> p1 = readFile(dir + "/p1");

    struct Case {
      const char* name;
      std::vector<uint8_t> buf;
      const char* expect;  // in the message
      bool onlyRank1;      // only rank 1's checkpoint is bad
    };
    std::vector<Case> cases;
    {
      std::vector<uint8_t> b(good.begin(), good.end() - 1);
      cases.push_back({"truncated", b, "size", false});
    }
    cases.push_back(
        {"header only", std::vector<uint8_t>(good.begin(), good.begin() + 100), "header", false});
    {
      std::vector<uint8_t> b = good;
      b[b.size() / 2] ^= 0x10;
      cases.push_back({"flipped bit", b, "checksum", false});
    }
    {
      std::vector<uint8_t> b = good;
      b[200] ^= 1;
      cases.push_back({"flipped bit on rank 1 only", b, "checksum", true});
    }
    {
      std::vector<uint8_t> b = good;
      b[0] = 'X';
      cases.push_back({"bad magic", b, "magic", false});
    }
    {
      std::vector<uint8_t> b = good;
      b[8] = 99;
      cases.push_back({"wrong version", b, "version", false});
    }
    cases.push_back({"another layout", otherLayout, "layout", false});
    cases.push_back({"another rank's", peer, "rank", false});
    cases.push_back({"saved on 1 rank", p1, "ranks", false});
    for (const Case& k : cases) {
      const bool mineBad = !k.onlyRank1 || c.rank == 1;
      const std::vector<uint8_t>& buf = mineBad ? k.buf : good;
      scapeResult_t r = scapeOptimLoad(a, buf.data(), buf.size());
      if (mineBad) {
        EXPECT_EQ(r, scapeInvalidArgument) << k.name;
        EXPECT_NE(std::string(scapeGetLastError(c.comm)).find(k.expect), std::string::npos)
            << k.name << ": " << scapeGetLastError(c.comm);
        EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("scapeOptimLoad"), std::string::npos);
      } else {
        EXPECT_EQ(r, scapeInvalidUsage) << k.name << " (the other rank's checkpoint was bad)";
        EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("rank 1"), std::string::npos)
            << scapeGetLastError(c.comm);
      }
      advance(1);  // untouched: the twin and the optimizer agree
      EXPECT_EQ(std::memcmp(ta.data(), tt.data(), 4 * n), 0) << "after the refused " << k.name;
    }
    // NULL buffer: refused everywhere too.
    EXPECT_EQ(scapeOptimLoad(a, nullptr, 0), scapeInvalidArgument);
    advance(2);
    EXPECT_EQ(std::memcmp(ta.data(), tt.data(), 4 * n), 0);
    // A good load still works afterwards, and the run goes on from it.
    EXPECT_SCAPE_OK(scapeOptimLoad(a, good.data(), good.size()), c.comm);
    scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
    EXPECT_SCAPE_OK(scapeOptimGetInfo(a, &info), c.comm);
    EXPECT_EQ(info.step, 5);
    EXPECT_SCAPE_OK(scapeOptimDestroy(a), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(twin), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
  for (const char* f : {"/p1", "/r0", "/r1"}) std::remove((dir + f).c_str());
  rmdir(dir.c_str());
}

// Bad arguments: a clear error naming the argument, nothing changed.
TEST(Optim, BadInput) {
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    auto createFails = [&](scapeOptimConfig_t cfg, const char* expect) {
      scapeOptim_t o = nullptr;
      EXPECT_EQ(scapeOptimCreate(&o, &cfg, c.comm), scapeInvalidArgument) << expect;
      EXPECT_EQ(o, nullptr);
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find(expect), std::string::npos)
          << "wanted '" << expect << "' in: " << scapeGetLastError(c.comm);
    };
    const scapeOptimConfig_t good = MakeConfig(l, Hyper());
    scapeOptimConfig_t x = good;
    EXPECT_EQ(scapeOptimCreate(nullptr, &x, c.comm), scapeInvalidArgument);
    scapeOptim_t tmp = nullptr;
    EXPECT_EQ(scapeOptimCreate(&tmp, nullptr, c.comm), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimCreate(&tmp, &x, nullptr), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimConfigInit(nullptr), scapeInvalidArgument);
    x.magic = 0;
    createFails(x, "scapeOptimConfigInit");
    x = good;
    x.n = 0;
    createFails(x, "n = 0");
    x = good;
    x.segOffsets = nullptr;
    createFails(x, "segOffsets is NULL");
    std::vector<uint64_t> overlap = l.offs;
    overlap[3] = 2500;  // above offs[4] = 713
    x = good;
    x.segOffsets = overlap.data();
    createFails(x, "overlap");
    std::vector<uint64_t> shortCover = l.offs;
    shortCover.back() = n - 1;
    x = good;
    x.segOffsets = shortCover.data();
    createFails(x, "cover");
    x = good;
    x.nsegments = 0;
    createFails(x, "nsegments");
    x = good;
    x.lr = -1.0f;
    createFails(x, "lr = -1");
    x = good;
    x.beta1 = NAN;
    createFails(x, "beta1");
    x = good;
    x.beta2 = 1.0f;
    createFails(x, "beta2");
    x = good;
    x.eps = -1e-8f;
    createFails(x, "eps");
    x = good;
    x.weightDecay = -0.1f;
    createFails(x, "weightDecay");
    x = good;
    x.maxGradNorm = NAN;
    createFails(x, "maxGradNorm");
    x = good;
    x.density = 0.0;
    createFails(x, "density = 0");
    x = good;
    x.density = 1.5;
    createFails(x, "density = 1.5");
    x = good;
    x.density = NAN;
    createFails(x, "density");
    x = good;
    x.warmupSteps = -3;
    createFails(x, "warmupSteps");
    x = good;
    x.payloadType = scapeInt32;
    createFails(x, "payloadType");
    x = good;
    x.ownership = 7;
    createFails(x, "ownership");
    x = good;
    x.biasCorrection = 9;
    createFails(x, "biasCorrection");

    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &good, c.comm), c.comm);
    if (!opt) return false;
    std::vector<float> theta = InitialTheta(1, n), g = Grads(2, 0, 0, n);
    const std::vector<float> before = theta;
    auto stepFails = [&](float* p, const float* gr, uint64_t cnt, scapeResult_t want,
                         const char* expect) {
      EXPECT_EQ(scapeOptimStep(opt, p, gr, cnt), want) << expect;
      EXPECT_NE(std::string(scapeGetLastError(c.comm)).find(expect), std::string::npos)
          << "wanted '" << expect << "' in: " << scapeGetLastError(c.comm);
      EXPECT_EQ(std::memcmp(theta.data(), before.data(), 4 * n), 0) << "changed by a failed step";
    };
    stepFails(nullptr, g.data(), n, scapeInvalidArgument, "params is NULL");
    stepFails(theta.data(), nullptr, n, scapeInvalidArgument, "grads is NULL");
    stepFails(theta.data(), g.data(), n - 1, scapeInvalidArgument, "count");
    std::vector<float> big(2 * n + 2);
    stepFails(reinterpret_cast<float*>(reinterpret_cast<char*>(big.data()) + 1), g.data(), n,
              scapeInvalidArgument, "params");
    stepFails(theta.data(),
              reinterpret_cast<const float*>(reinterpret_cast<const char*>(big.data()) + 2), n,
              scapeInvalidArgument, "grads");
    stepFails(big.data(), big.data() + 5, n, scapeInvalidArgument, "overlap");
    EXPECT_EQ(scapeOptimStep(nullptr, theta.data(), g.data(), n), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimSetLr(opt, NAN), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimSetLr(opt, -1.0f), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimGetInfo(opt, nullptr), scapeInvalidArgument);
    EXPECT_EQ(scapeOptimGetMask(opt, nullptr), scapeInvalidArgument);
    size_t sz = 0, w = 0;
    EXPECT_SCAPE_OK(scapeOptimCheckpointSize(opt, &sz), c.comm);
    std::vector<uint8_t> buf(sz);
    EXPECT_EQ(scapeOptimSave(opt, buf.data(), sz - 1, &w), scapeInvalidArgument);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("capacity"), std::string::npos);
    // The optimizer still steps after all that.
    EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    EXPECT_SCAPE_OK(scapeOptimDestroy(nullptr), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Another user of the optimizer's mask syncs or advances it: the step refuses, unchanged.
TEST(Optim, ForeignMaskUseIsRefused) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l;
    const uint64_t n = l.n();
    scapeOptimConfig_t cfg = MakeConfig(l, Hyper());
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, c.comm), c.comm);
    if (!opt) return false;
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeOptimGetMask(opt, &mask), c.comm);
    std::vector<float> theta = InitialTheta(3, n), g = Grads(4, c.rank, 0, n);
    EXPECT_SCAPE_OK(scapeOptimStep(opt, theta.data(), g.data(), n), c.comm);
    // Queries through the mask are fine.
    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(mask, &k), c.comm);
    EXPECT_EQ(k, n);  // step 0 used the full mask
    // Someone else waits for the optimizer's sync, advances, and starts a sync of their own.
    EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
    EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
    EXPECT_SCAPE_OK(scapeMaskSetNextIndices(mask, nullptr, 0), c.comm);
    EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
    const std::vector<float> before = theta;
    EXPECT_EQ(scapeOptimStep(opt, theta.data(), g.data(), n), scapeInvalidUsage);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("another user"), std::string::npos)
        << scapeGetLastError(c.comm);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("in flight"), std::string::npos)
        << scapeGetLastError(c.comm);
    EXPECT_EQ(std::memcmp(theta.data(), before.data(), 4 * n), 0);
    EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
    EXPECT_EQ(scapeOptimStep(opt, theta.data(), g.data(), n), scapeInvalidUsage);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("advanced"), std::string::npos)
        << scapeGetLastError(c.comm);
    EXPECT_EQ(std::memcmp(theta.data(), before.data(), 4 * n), 0);
    // The communicator cannot be destroyed under a live optimizer (its mask is live).
    EXPECT_EQ(scapeCommDestroy(c.comm), scapeInvalidUsage);
    EXPECT_SCAPE_OK(scapeOptimDestroy(opt), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
}  // namespace scape_test

namespace scape_test {
namespace {

// The fused passes at a mask in owner-major order, large enough to run on several threads
// (chunk boundaries fall inside runs), give the bits of one thread and of the sorted-mask
// kernels.
TEST(OptimKernels, OwnerMajorViewsOnThreadsMatchSortedKernels) {
  namespace k = scape::kernels;
  const size_t n = (size_t{1} << 20) + 4099;
  // Four "owners" take alternating stretches of the buffer (segment ownership interleaves).
  std::vector<uint64_t> cuts{0};
  for (size_t b = 0; cuts.back() < n; ++b)
    cuts.push_back(std::min<uint64_t>(n, cuts.back() + 50000 + 977 * (b % 7)));
  const int P = 4;
  std::vector<std::vector<uint64_t>> blocks(P);
  std::vector<k::MaskRun> runs;
  unsigned seed = FreshSeed();
  for (size_t r = 0; r + 1 < cuts.size(); ++r)
    for (uint64_t i = cuts[r]; i < cuts[r + 1]; ++i)
      if (SplitMix(seed ^ i) % 37 == 0) blocks[r % P].push_back(i);
  std::vector<uint64_t> idx, sorted;
  std::vector<uint64_t> boff(P + 1, 0);
  for (int b = 0; b < P; ++b) {
    boff[b + 1] = boff[b] + blocks[b].size();
    idx.insert(idx.end(), blocks[b].begin(), blocks[b].end());
  }
  std::vector<size_t> cursor(P, 0);
  for (size_t r = 0; r + 1 < cuts.size(); ++r) {
    const int b = static_cast<int>(r % P);
    const uint64_t jb = boff[b] + cursor[b];
    while (cursor[b] < blocks[b].size() && blocks[b][cursor[b]] < cuts[r + 1]) ++cursor[b];
    runs.push_back({cuts[r], cuts[r + 1], jb, boff[b] + cursor[b], b == 1 ? k::kRunOwned : 0u});
  }
  sorted = idx;
  std::sort(sorted.begin(), sorted.end());
  k::MaskView v;
  v.idx = idx.data();
  v.k = idx.size();
  v.runs = runs.data();
  v.nruns = runs.size();
  ASSERT_TRUE(k::MaskViewIsValid(v, n));
  // Slot of each sorted entry in mask order.
  std::vector<size_t> slot(sorted.size());
  {
    std::vector<std::pair<uint64_t, size_t>> ps;
    for (size_t j = 0; j < idx.size(); ++j) ps.push_back({idx[j], j});
    std::sort(ps.begin(), ps.end());
    for (size_t q = 0; q < ps.size(); ++q) slot[q] = ps[q].second;
  }
  std::vector<float> m(n), g(n), e(n), theta(n);
  for (size_t i = 0; i < n; ++i) {
    m[i] = static_cast<float>(InputValue(scapeFloat32, seed, 1, i));
    g[i] = static_cast<float>(InputValue(scapeFloat32, seed, 2, i));
    e[i] = static_cast<float>(InputValue(scapeFloat32, seed, 3, i)) * 0.1f;
    theta[i] = static_cast<float>(InputValue(scapeFloat32, seed, 4, i));
  }
  for (scapeDataType_t t : {scapeFloat32, scapeBfloat16}) {
    const size_t esz = scapeTypeSize(t);
    std::vector<float> e1 = e, e2 = e, stat1(n, 7.0f), stat2(n, 7.0f);
    std::vector<char> p1(idx.size() * esz), p2(idx.size() * esz);
    ASSERT_EQ(k::CandidatePackResidualView(m.data(), g.data(), e1.data(), n, 0.9f, v, t, p1.data(),
                                           stat1.data(), 1),
              k::KernelStatus::kOk);
    ASSERT_EQ(k::CandidatePackResidualView(m.data(), g.data(), e2.data(), n, 0.9f, v, t, p2.data(),
                                           stat2.data(), 4),
              k::KernelStatus::kOk);
    EXPECT_EQ(std::memcmp(e1.data(), e2.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(p1.data(), p2.data(), p1.size()), 0);
    EXPECT_EQ(std::memcmp(stat1.data(), stat2.data(), 4 * n), 0);
    // The statistic is written on the owned runs only; the fp32 payload equals the sorted kernel's.
    size_t owned = 0, ownedLen = 0, untouched = 0, otherLen = 0;
    for (const auto& r : runs)
      for (uint64_t i = r.begin; i < r.end; ++i) {
        if (r.flags & k::kRunOwned) {
          owned += stat1[i] != 7.0f;
          ++ownedLen;
        } else {
          untouched += stat1[i] == 7.0f;
          ++otherLen;
        }
      }
    EXPECT_EQ(owned, ownedLen);
    EXPECT_EQ(untouched, otherLen);
    if (t == scapeFloat32) {
      std::vector<float> e3 = e, ps(sorted.size());
      ASSERT_EQ(k::CandidatePackResidual(m.data(), g.data(), e3.data(), n, 0.9f, sorted.data(),
                                         sorted.size(), t, ps.data(), nullptr, 1),
                k::KernelStatus::kOk);
      EXPECT_EQ(std::memcmp(e3.data(), e1.data(), 4 * n), 0);
      size_t bad = 0;
      for (size_t q = 0; q < sorted.size(); ++q)
        bad += std::memcmp(&ps[q], p1.data() + 4 * slot[q], 4) != 0;
      EXPECT_EQ(bad, 0u);
      // The update at the view equals the sorted update with the payload in sorted order.
      k::AdamSParams ap;
      ap.clip_scale = 0.7f;
      ap.bias_correction = k::BiasCorrection::kScapeArtifact;
      ap.step = 3;
      std::vector<float> th1 = theta, m1 = m, th2 = theta, m2 = m, th3 = theta, m3 = m;
      ASSERT_EQ(k::UnpackAdamSUpdateView(p1.data(), t, v, th1.data(), m1.data(), n, ap, 4),
                k::KernelStatus::kOk);
      ASSERT_EQ(k::UnpackAdamSUpdate(ps.data(), t, sorted.data(), sorted.size(), th2.data(),
                                     m2.data(), n, ap, 1),
                k::KernelStatus::kOk);
      EXPECT_EQ(std::memcmp(th1.data(), th2.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(m1.data(), m2.data(), 4 * n), 0);
      // Pairs per owner block, then the unpack of the gathered pairs: the same bits again.
      std::vector<float> pairs(2 * idx.size());
      for (int b = 0; b < P; ++b)
        ASSERT_EQ(
            k::AdamSUpdatePairs(p1.data() + 4 * boff[b], t, idx.data() + boff[b], blocks[b].size(),
                                theta.data(), m.data(), n, ap, pairs.data() + 2 * boff[b], 2),
            k::KernelStatus::kOk);
      ASSERT_EQ(k::UnpackPairsDecayView(pairs.data(), v, th3.data(), m3.data(), n, ap, 4),
                k::KernelStatus::kOk);
      EXPECT_EQ(std::memcmp(th3.data(), th2.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(m3.data(), m2.data(), 4 * n), 0);
    }
  }
  // With m's support given (m +0 outside it): the same bits, and m is zero outside the mask
  // after the update + ZeroOutsideMask.
  {
    std::vector<uint64_t> sidx;
    std::vector<k::MaskRun> sruns = runs;
    for (size_t r = 0; r < runs.size(); ++r) {
      sruns[r].jb = sidx.size();
      for (uint64_t i = runs[r].begin; i < runs[r].end; ++i)
        if (SplitMix(seed * 3 + i) % 29 == 0) sidx.push_back(i);
      sruns[r].je = sidx.size();
    }
    // Mask order is run order here, which is a valid view too.
    k::MaskView sv;
    sv.idx = sidx.data();
    sv.k = sidx.size();
    sv.runs = sruns.data();
    sv.nruns = sruns.size();
    ASSERT_TRUE(k::MaskViewIsValid(sv, n));
    std::vector<float> ms(n, 0.0f);
    for (uint64_t i : sidx) ms[i] = m[i];
    ms[sidx[3]] = -0.0f;  // signed zeros and -0 gradients keep their bits too
    g[5] = -0.0f;
    std::vector<float> e1 = e, e2 = e, st1(n, 7.0f), st2(n, 7.0f);
    std::vector<char> p1(idx.size() * 2), p2(idx.size() * 2);
    ASSERT_EQ(k::CandidatePackResidualView(ms.data(), g.data(), e1.data(), n, 0.9f, v, scapeFloat16,
                                           p1.data(), st1.data(), 4),
              k::KernelStatus::kOk);
    ASSERT_EQ(k::CandidatePackResidualView(ms.data(), g.data(), e2.data(), n, 0.9f, v, scapeFloat16,
                                           p2.data(), st2.data(), 4, &sv),
              k::KernelStatus::kOk);
    EXPECT_EQ(std::memcmp(e1.data(), e2.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(p1.data(), p2.data(), p1.size()), 0);
    EXPECT_EQ(std::memcmp(st1.data(), st2.data(), 4 * n), 0);
    k::AdamSParams ap;
    std::vector<float> th1 = theta, m1 = ms, th2 = theta, m2 = ms;
    ASSERT_EQ(k::UnpackAdamSUpdateView(p1.data(), scapeFloat16, v, th1.data(), m1.data(), n, ap, 4),
              k::KernelStatus::kOk);
    ASSERT_EQ(
        k::UnpackAdamSUpdateView(p1.data(), scapeFloat16, v, th2.data(), m2.data(), n, ap, 4, true),
        k::KernelStatus::kOk);
    ASSERT_EQ(k::ZeroOutsideMask(m2.data(), n, sv, v), k::KernelStatus::kOk);
    EXPECT_EQ(std::memcmp(th1.data(), th2.data(), 4 * n), 0);
    EXPECT_EQ(std::memcmp(m1.data(), m2.data(), 4 * n), 0);
    std::vector<k::MaskRun> other = sruns;
    other[0].end -= 1;
    other[1].begin -= 1;
    sv.runs = other.data();
    EXPECT_EQ(k::CandidatePackResidualView(ms.data(), g.data(), e2.data(), n, 0.9f, v, scapeFloat16,
                                           p2.data(), st2.data(), 4, &sv),
              k::KernelStatus::kInvalidArgument);
  }
  // A view whose runs do not tile the buffer, or whose entries leave their run, is refused.
  std::vector<k::MaskRun> bad = runs;
  bad[1].begin += 1;
  k::MaskView bv = v;
  bv.runs = bad.data();
  EXPECT_FALSE(k::MaskViewIsValid(bv, n));
  bad = runs;
  std::swap(bad[0].je, bad[P].je);
  bv.runs = bad.data();
  EXPECT_FALSE(k::MaskViewIsValid(bv, n));
}

}  // namespace
}  // namespace scape_test
