// The element-type table (kernels/dtypes.h) and the scaled-payload kernels (kernels/cpu/scaled.h)
// against an independent reference (tests/fp8_ref.h: the OCP 8-bit formats from their
// definition, rounding by searching every code): every fp8 code decoded, fresh random and edge
// values encoded, the fp8 reductions, the scale rule, quantize / dequantize with error feedback;
// and the table's consistency with the public API (scapeTypeSize, every type a row).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/reduce.h"
#include "kernels/cpu/scaled.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/dtypes.h"
#include "tests/fp8_ref.h"
#include "tests/kernels/kernel_test_util.h"

namespace {

namespace dt = scape::dtypes;
namespace kn = scape::kernels;
using scape::testing::Fp8Format;
using scape::testing::Fp8Round;
using scape::testing::Fp8Value;

struct Fp8Case {
  scapeDataType_t type;
  Fp8Format fmt;
  float (*toF)(uint8_t);
  uint8_t (*fromF)(float);
};
const Fp8Case kFp8[] = {
    {scapeFloat8E4M3, scape::testing::kE4m3, dt::E4m3ToFloat, dt::FloatToE4m3},
    {scapeFloat8E5M2, scape::testing::kE5m2, dt::E5m2ToFloat, dt::FloatToE5m2},
};

bool SameValue(double want, float got) {
  if (std::isnan(want)) return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(want) == std::signbit(got);
}

TEST(DTypes, EveryTypeIsOneRowAndMatchesThePublicApi) {
  std::set<std::string> names, shorts;
  for (int t = 0; t < scapeNumTypes; ++t) {
    const dt::TypeRow* r = dt::Row(t);
    ASSERT_NE(r, nullptr) << "type " << t;
    EXPECT_EQ(r->type, t);
    EXPECT_EQ(r->size, scapeTypeSize(static_cast<scapeDataType_t>(t))) << r->cName;
    EXPECT_TRUE(names.insert(r->cName).second) << r->cName;
    EXPECT_TRUE(shorts.insert(r->shortName).second) << r->shortName;
    if (r->payload) {
      EXPECT_TRUE(r->floating) << r->cName;
      EXPECT_EQ(r->checkpointCode, t) << "checkpoints store the type's value: " << r->cName;
    }
    if (r->floating) {
      // Every floating type converts through the one visitor, and its largest finite value
      // survives the round trip.
      std::vector<unsigned char> buf(r->size);
      dt::StoreFromFloat(t, buf.data(), r->maxFinite);
      EXPECT_EQ(dt::LoadAsFloat(t, buf.data()), r->maxFinite) << r->cName;
      bool visited = false;
      EXPECT_TRUE(dt::VisitFloat(
          t, [&](auto tr) { visited = sizeof(typename decltype(tr)::Storage) == r->size; }));
      EXPECT_TRUE(visited) << r->cName;
    } else {
      EXPECT_FALSE(dt::VisitFloat(t, [](auto) {})) << r->cName;
    }
  }
  EXPECT_EQ(dt::Row(scapeNumTypes), nullptr);
  EXPECT_EQ(dt::Row(-1), nullptr);
  EXPECT_EQ(scapeTypeSize(static_cast<scapeDataType_t>(scapeNumTypes)), 0u);
  EXPECT_EQ(std::string(dt::PayloadNames()),
            "scapeFloat32, scapeFloat16, scapeBfloat16, scapeFloat8E4M3 or scapeFloat8E5M2");
}

TEST(DTypes, Fp8DecodesEveryCodeAsTheFormatDefines) {
  for (const Fp8Case& c : kFp8)
    for (int code = 0; code < 256; ++code) {
      const double want = Fp8Value(c.fmt, static_cast<uint8_t>(code));
      EXPECT_TRUE(SameValue(want, c.toF(static_cast<uint8_t>(code))))
          << dt::Name(c.type) << " code 0x" << std::hex << code;
    }
  EXPECT_EQ(dt::E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(dt::E5m2ToFloat(0x7b), 57344.0f);
  EXPECT_EQ(dt::E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(dt::E5m2ToFloat(0x01), std::ldexp(1.0f, -16));
}

TEST(DTypes, Fp8EncodesToNearestEven) {
  SCAPE_SEEDED_RNG(rng);
  for (const Fp8Case& c : kFp8) {
    std::vector<float> xs = {0.0f, -0.0f,   INFINITY, -INFINITY,
                             NAN,  FLT_MAX, FLT_MIN,  std::ldexp(1.0f, -140)};  // an fp32 subnormal
    // Every code's value, the midpoints between neighbours (ties) and just beside them.
    for (int code = 0; code < 127; ++code) {
      const double v = Fp8Value(c.fmt, static_cast<uint8_t>(code));
      const double w = Fp8Value(c.fmt, static_cast<uint8_t>(code + 1));
      if (!std::isfinite(v)) continue;
      xs.push_back(static_cast<float>(v));
      xs.push_back(-static_cast<float>(v));
      if (std::isfinite(w)) {
        const float mid = static_cast<float>((v + w) / 2);
        xs.push_back(mid);
        xs.push_back(std::nextafter(mid, 0.0f));
        xs.push_back(std::nextafter(mid, INFINITY));
      }
    }
    // Beyond the largest finite value: the overflow midpoint and around it.
    const double top = Fp8Value(c.fmt, scape::testing::Fp8MaxCode(c.fmt));
    const double ulp = top - Fp8Value(c.fmt, scape::testing::Fp8MaxCode(c.fmt) - 1);
    xs.push_back(static_cast<float>(top + ulp / 2));
    xs.push_back(std::nextafter(static_cast<float>(top + ulp / 2), 0.0f));
    xs.push_back(static_cast<float>(top * 4));
    // Fresh random values over the whole range (log-uniform magnitudes, both signs).
    std::uniform_real_distribution<double> lg(-22.0, 20.0);
    for (int i = 0; i < 20000; ++i) {
      const double mag = std::exp2(lg(rng));
      xs.push_back(static_cast<float>(rng() & 1 ? -mag : mag));
    }
    for (float x : xs) {
      const uint8_t want = Fp8Round(c.fmt, x);
      const uint8_t got = c.fromF(x);
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(c.toF(got))) << dt::Name(c.type);
        continue;
      }
      EXPECT_EQ(static_cast<int>(got), static_cast<int>(want))
          << dt::Name(c.type) << " x = " << x << " (" << std::hexfloat << x << ")";
    }
  }
}

TEST(DTypes, Fp8ReductionsRoundOncePerHop) {
  SCAPE_SEEDED_RNG(rng);
  for (const Fp8Case& c : kFp8) {
    for (size_t n : {0, 1, 7, 33, 1000}) {
      std::vector<uint8_t> a(n), b(n), out(n);
      for (size_t i = 0; i < n; ++i) {
        a[i] = static_cast<uint8_t>(rng());
        b[i] = static_cast<uint8_t>(rng());
      }
      for (int div : {1, 3}) {
        for (scapeRedOp_t op : {scapeSum, scapeMax, scapeMin}) {
          ASSERT_EQ(kn::ReduceInto(c.type, op, out.data(), a.data(), b.data(), n, div),
                    kn::KernelStatus::kOk);
          for (size_t i = 0; i < n; ++i) {
            const double x = Fp8Value(c.fmt, a[i]), y = Fp8Value(c.fmt, b[i]);
            double r = op == scapeSum
                           ? static_cast<double>(static_cast<float>(x) + static_cast<float>(y))
                       : op == scapeMax ? std::fmax(x, y)
                                        : std::fmin(x, y);
            if (div > 1) r = static_cast<double>(static_cast<float>(r) / static_cast<float>(div));
            if (op == scapeMax && x == 0 && y == 0)
              r = (std::signbit(x) && std::signbit(y)) ? -0.0 : 0.0;
            if (op == scapeMin && x == 0 && y == 0)
              r = (std::signbit(x) || std::signbit(y)) ? -0.0 : 0.0;
            const uint8_t want = std::isnan(r) ? (c.fmt.ieee ? 0x7e : 0x7f) : Fp8Round(c.fmt, r);
            ASSERT_EQ(static_cast<int>(out[i]), static_cast<int>(want))
                << dt::Name(c.type) << " op " << op << " div " << div << " a 0x" << std::hex
                << static_cast<int>(a[i]) << " b 0x" << static_cast<int>(b[i]);
          }
        }
      }
    }
  }
}

// The scale rule from its definition: the smallest e with amax * P / 2^e <= maxFinite.
int RefExponent(double amax, int P, double maxF) {
  if (!(amax > 0) || !std::isfinite(amax)) return 0;
  int e = -400;
  while (amax * P / std::ldexp(1.0, e) > maxF) ++e;
  return e;
}

TEST(DTypes, ScaleExponentIsTheSmallestThatFits) {
  SCAPE_SEEDED_RNG(rng);
  std::uniform_real_distribution<double> lg(-120.0, 120.0);
  for (const Fp8Case& c : kFp8) {
    const float mf = dt::Row(c.type)->maxFinite;
    std::vector<float> amaxes = {0.0f,    -0.0f, NAN,    INFINITY, FLT_MAX,
                                 FLT_MIN, mf,    mf / 2, mf * 2,   std::ldexp(1.0f, -149)};
    for (int i = 0; i < 2000; ++i) amaxes.push_back(static_cast<float>(std::exp2(lg(rng))));
    for (float a : amaxes)
      for (int P : {1, 2, 3, 4, 7, 64})
        EXPECT_EQ(dt::ScaleExponent(a, P, mf), RefExponent(a, P, mf))
            << dt::Name(c.type) << " amax " << a << " P " << P;
  }
}

TEST(DTypes, QuantizeKeepsWhatRoundingLosesAndDequantizeIsExact) {
  SCAPE_SEEDED_RNG(rng);
  for (const Fp8Case& c : kFp8) {
    const float mf = dt::Row(c.type)->maxFinite;
    for (size_t k : {0, 1, 5, 257}) {
      for (int P : {1, 3, 4}) {
        std::vector<float> x = kn::testing_util::RandomNormal(rng, k, 1e-3f);
        if (k > 3) {
          x[1] = 0.0f;
          x[2] = -1e-30f;  // far below the scaled type's smallest subnormal
        }
        float amax = -1.0f;
        ASSERT_EQ(kn::PayloadAmax(x.data(), k, &amax), kn::KernelStatus::kOk);
        float refMax = 0.0f;
        for (float v : x) refMax = std::max(refMax, std::fabs(v));
        EXPECT_EQ(amax, refMax);
        // The residual lives at scattered positions of a longer buffer; the rest is untouched.
        const size_t n = 3 * k + 2;
        std::vector<uint64_t> pos(k);
        for (size_t j = 0; j < k; ++j) pos[j] = 3 * j + 1;
        std::vector<float> res(n, 7.0f);
        std::vector<uint8_t> q(k + 1, 0xAA);
        ASSERT_EQ(
            kn::QuantizeScaled(x.data(), k, c.type, amax, P, q.data(), pos.data(), res.data()),
            kn::KernelStatus::kOk);
        const int e = RefExponent(amax, P, mf);
        std::vector<float> back(k);
        ASSERT_EQ(kn::DequantizeScaled(q.data(), k, c.type, amax, P, back.data()),
                  kn::KernelStatus::kOk);
        for (size_t j = 0; j < k; ++j) {
          const uint8_t want = Fp8Round(c.fmt, std::ldexp(static_cast<double>(x[j]), -e));
          ASSERT_EQ(static_cast<int>(q[j]), static_cast<int>(want)) << "j " << j;
          const double v = std::ldexp(Fp8Value(c.fmt, q[j]), e);
          EXPECT_EQ(static_cast<double>(back[j]), v) << "j " << j;
          EXPECT_EQ(res[pos[j]], x[j] - static_cast<float>(v)) << "j " << j;
          // The scaled values of P ranks cannot overflow: |x| * P / 2^e <= maxFinite.
          EXPECT_LE(std::fabs(std::ldexp(static_cast<double>(x[j]), -e)) * P, mf);
        }
        for (size_t i = 0; i < n; ++i) {
          if (i % 3 != 1 || i / 3 >= k) {
            EXPECT_EQ(res[i], 7.0f) << "untouched " << i;
          }
        }
        EXPECT_EQ(q[k], 0xAA) << "wrote past k";
      }
    }
  }
  // Errors: a type without the scale rule, null buffers, no ranks.
  float x = 1.0f, r = 0.0f;
  uint8_t q = 0;
  uint64_t p = 0;
  EXPECT_EQ(kn::QuantizeScaled(&x, 1, scapeBfloat16, 1.0f, 2, &q, &p, &r),
            kn::KernelStatus::kUnsupported);
  EXPECT_EQ(kn::DequantizeScaled(&q, 1, scapeFloat32, 1.0f, 2, &x), kn::KernelStatus::kUnsupported);
  EXPECT_EQ(kn::QuantizeScaled(&x, 1, scapeFloat8E4M3, 1.0f, 0, &q, &p, &r),
            kn::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kn::QuantizeScaled(&x, 1, scapeFloat8E4M3, 1.0f, 2, &q, nullptr, &r),
            kn::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kn::DequantizeScaled(nullptr, 1, scapeFloat8E5M2, 1.0f, 2, &x),
            kn::KernelStatus::kInvalidArgument);
  // The step kernels take scaled types only as fp32 (converted around the exchange).
  EXPECT_EQ(kn::PayloadElementSize(scapeFloat8E4M3), 0u);
  EXPECT_EQ(kn::PayloadElementSize(scapeFloat8E5M2), 0u);
}

}  // namespace
