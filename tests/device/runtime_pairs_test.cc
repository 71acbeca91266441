// The sharded step's two device ops of the runtime (plugin/device/runtime.h AdamSUpdatePairs and
// UnpackPairsDecay) on the tests' CPU fake: each against its host kernel (kernels/cpu/
// scape_step.h AdamSUpdatePairs, UnpackPairsDecayView at a one-run view) and against an
// independent reference (the pairs are what UnpackAdamSUpdate writes at those positions; the
// unpack written out element by element), and the two in a row against UnpackAdamSUpdate(Copy):
// the sharded algorithm's bits are the replicated one's. Fresh random inputs, odd sizes, n = 0,
// k = 0, k = n, weight decay 0 and > 0, with and without the 16-bit copy and the "segment_rms"
// enter table; the host-checked errors (an error Status, nothing enqueued), and a mask the host
// kernel refuses failing the stream. The ops are called through the Runtime interface.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/scape_step.h"
#include "tests/device/device_buffer.h"
#include "tests/device/fake_device.h"
#include "tests/kernels/kernel_test_util.h"

namespace {

using fake_device::FakeRuntime;
using scape::Status;
using scape::device::Runtime;
using scape::device::Stream;
namespace kn = scape::kernels;
using kn::testing_util::RandomNormal;

using fake_device::Dev;

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

std::vector<uint64_t> SortedMask(std::mt19937_64& rng, uint64_t n, size_t k) {
  std::vector<uint64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(k);
  std::sort(all.begin(), all.end());
  return all;
}

// k payload values of `type` (the bytes), from normal floats rounded to the type.
std::vector<uint8_t> RandomPayload(std::mt19937_64& rng, scapeDataType_t type, size_t k) {
  const auto f = RandomNormal(rng, k, 0.5f);
  std::vector<uint8_t> out(k * kn::PayloadElementSize(type));
  for (size_t j = 0; j < k; ++j) {
    if (type == scapeFloat32) {
      std::memcpy(out.data() + 4 * j, &f[j], 4);
    } else {
      const uint16_t h = type == scapeBfloat16 ? kn::FloatToBf16(f[j]) : kn::FloatToFp16(f[j]);
      std::memcpy(out.data() + 2 * j, &h, 2);
    }
  }
  return out;
}

// m_{t-1}: normal, with about a third of the positions +0 (entering coordinates).
std::vector<float> RandomMomentum(std::mt19937_64& rng, size_t n) {
  auto m = RandomNormal(rng, n, 0.3f);
  std::bernoulli_distribution zero(0.35);
  for (auto& x : m)
    if (zero(rng)) x = 0.0f;
  return m;
}

// A "segment_rms" table over [0, n): three segments (the middle one empty) and a fourth with no
// staying coordinate (-1: the paper's form there).
struct EnterTable {
  std::vector<uint64_t> off;
  std::vector<float> vs;
  EnterTable(size_t n) : off{0, n / 3, n / 3, n / 2, n}, vs{0.25f, 3.0f, -1.0f, 0.0625f} {}
  void Set(kn::AdamSParams* ap) const {
    ap->enter_offsets = off.data();
    ap->enter_vs = vs.data();
    ap->enter_nseg = vs.size();
  }
};

kn::AdamSParams Params(float wd, int variant) {
  kn::AdamSParams ap;
  ap.lr = 1e-2f;
  ap.weight_decay = wd;
  ap.step = 4;
  if (variant == 1) {
    ap.clip_scale = 0.5f;
    ap.bias_correction = kn::BiasCorrection::kScapeArtifact;
  }
  return ap;
}

const scapeDataType_t kPayloadTypes[] = {scapeFloat32, scapeBfloat16, scapeFloat16};
const size_t kSizes[] = {0, 1, 2, 777, 4099, 8192 * 2 + 13};

class FakePairs : public ::testing::Test {
 protected:
  FakeRuntime fake_;
  Runtime* rt_ = &fake_;
  Stream s_ = fake_.NewStream();
};

// AdamSUpdatePairs: the host kernel's bits; and the pairs are exactly what UnpackAdamSUpdate
// writes at those positions (the independent reference); theta and m are only read.
TEST_F(FakePairs, AdamSUpdatePairsMatchesTheHostKernel) {
  SCAPE_SEEDED_RNG(rng);
  for (scapeDataType_t t : kPayloadTypes) {
    for (size_t n : kSizes) {
      for (size_t k : {size_t{0}, n / 10 + (n > 0), n}) {
        for (float wd : {0.0f, 0.1f}) {
          for (bool enter : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "type " << t << " n " << n << " k " << k << " wd "
                                              << wd << " enter " << enter);
            const size_t esz = kn::PayloadElementSize(t);
            const auto theta = RandomNormal(rng, n);
            const auto m = RandomMomentum(rng, n);
            const auto idx = SortedMask(rng, n, k);
            const auto payload = RandomPayload(rng, t, k);
            kn::AdamSParams ap = Params(wd, static_cast<int>(k % 2));
            const EnterTable et(n);
            if (enter) et.Set(&ap);
            // Host kernel.
            std::vector<float> want(2 * k);
            ASSERT_EQ(kn::AdamSUpdatePairs(payload.data(), t, idx.data(), k, theta.data(), m.data(),
                                           n, ap, want.data()),
                      kn::KernelStatus::kOk);
            // Independent reference: UnpackAdamSUpdate's result at the positions.
            std::vector<float> thU = theta, mU = m;
            ASSERT_EQ(kn::UnpackAdamSUpdate(payload.data(), t, idx.data(), k, thU.data(), mU.data(),
                                            n, ap),
                      kn::KernelStatus::kOk);
            std::vector<float> fromUpdate(2 * k);
            for (size_t j = 0; j < k; ++j) {
              fromUpdate[2 * j] = thU[idx[j]];
              fromUpdate[2 * j + 1] = mU[idx[j]];
            }
            ASSERT_TRUE(SameBits(want, fromUpdate));
            // The fake, on the stream.
            Dev dth(rt_, theta), dm(rt_, m), didx(rt_, idx), dp(rt_, payload), dpairs(rt_, 8 * k);
            ASSERT_ST_OK(rt_->AdamSUpdatePairs(dp.get(), t, didx.get<uint64_t>(), k,
                                               dth.get<float>(), dm.get<float>(), n, ap,
                                               dpairs.get<float>(), s_));
            ASSERT_ST_OK(rt_->StreamSynchronize(s_));
            EXPECT_TRUE(SameBits(dpairs.Read<float>(2 * k), want));
            EXPECT_TRUE(SameBits(dth.Read<float>(n), theta));
            EXPECT_TRUE(SameBits(dm.Read<float>(n), m));
            // The same entries in a random order (position and payload value together): the
            // pairs in that order.
            std::vector<size_t> perm(k);
            std::iota(perm.begin(), perm.end(), size_t{0});
            std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<uint64_t> idx2(k);
            std::vector<uint8_t> pay2(k * esz);
            std::vector<float> want2(2 * k);
            for (size_t j = 0; j < k; ++j) {
              idx2[j] = idx[perm[j]];
              std::memcpy(pay2.data() + j * esz, payload.data() + perm[j] * esz, esz);
              want2[2 * j] = want[2 * perm[j]];
              want2[2 * j + 1] = want[2 * perm[j] + 1];
            }
            Dev didx2(rt_, idx2), dp2(rt_, pay2), dpairs2(rt_, 8 * k);
            ASSERT_ST_OK(rt_->AdamSUpdatePairs(dp2.get(), t, didx2.get<uint64_t>(), k,
                                               dth.get<float>(), dm.get<float>(), n, ap,
                                               dpairs2.get<float>(), s_));
            ASSERT_ST_OK(rt_->StreamSynchronize(s_));
            EXPECT_TRUE(SameBits(dpairs2.Read<float>(2 * k), want2));
          }
        }
      }
    }
  }
  EXPECT_GT(fake_.pairUpdates.load(), 0u);
  EXPECT_GT(fake_.enteringUpdates.load(), 0u);
}

// UnpackPairsDecay: the host kernel's bits (UnpackPairsDecayView, one run), and the contract
// written out element by element (the independent reference), with and without the copy.
TEST_F(FakePairs, UnpackPairsDecayMatchesTheHostKernel) {
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : kSizes) {
    for (size_t k : {size_t{0}, n / 10 + (n > 0), n}) {
      for (float wd : {0.0f, 0.1f}) {
        for (int copy : {0, 1, 2}) {  // none, bf16, fp16
          SCOPED_TRACE(::testing::Message()
                       << "n " << n << " k " << k << " wd " << wd << " copy " << copy);
          const scapeDataType_t ct = copy == 2 ? scapeFloat16 : scapeBfloat16;
          const auto theta = RandomNormal(rng, n);
          const auto m = RandomNormal(rng, n);  // nonzero outside the mask: must become +0
          const auto mask = SortedMask(rng, n, k);
          const auto pairs = RandomNormal(rng, 2 * k);
          const kn::AdamSParams ap = Params(wd, 0);
          const std::vector<uint16_t> copy0(n, 0x7e7e);
          // Host kernel at a one-run view.
          std::vector<float> thW = theta, mW = m;
          std::vector<uint16_t> cW = copy0;
          kn::MaskRun run{0, n, 0, k, 0};
          kn::MaskView view;
          view.idx = mask.data();
          view.k = k;
          view.runs = &run;
          view.nruns = 1;
          kn::ModelCopy mc;
          mc.p = cW.data();
          mc.type = ct;
          ASSERT_EQ(kn::UnpackPairsDecayView(pairs.data(), view, thW.data(), mW.data(), n, ap, 0,
                                             false, copy ? &mc : nullptr),
                    kn::KernelStatus::kOk);
          // Independent reference.
          kn::AdamSScalars sc;
          ASSERT_EQ(kn::MakeAdamSScalars(ap, &sc), kn::KernelStatus::kOk);
          std::vector<float> thR(n), mR(n, 0.0f);
          std::vector<uint16_t> cR = copy0;
          for (size_t i = 0; i < n; ++i) thR[i] = wd == 0.0f ? theta[i] : theta[i] * sc.decay;
          for (size_t j = 0; j < k; ++j) {
            thR[mask[j]] = pairs[2 * j];
            mR[mask[j]] = pairs[2 * j + 1];
          }
          if (copy) {
            for (size_t i = 0; i < n; ++i)
              cR[i] = ct == scapeBfloat16 ? kn::FloatToBf16(thR[i]) : kn::FloatToFp16(thR[i]);
          }
          ASSERT_TRUE(SameBits(thW, thR));
          ASSERT_TRUE(SameBits(mW, mR));
          ASSERT_TRUE(SameBits(cW, cR));
          // The fake.
          Dev dth(rt_, theta), dm(rt_, m), dmask(rt_, mask), dpairs(rt_, pairs), dc(rt_, copy0);
          ASSERT_ST_OK(rt_->UnpackPairsDecay(dpairs.get<float>(), dmask.get<uint64_t>(), k,
                                             dth.get<float>(), dm.get<float>(), n, ap,
                                             copy ? dc.get() : nullptr, ct, s_));
          ASSERT_ST_OK(rt_->StreamSynchronize(s_));
          EXPECT_TRUE(SameBits(dth.Read<float>(n), thW));
          EXPECT_TRUE(SameBits(dm.Read<float>(n), mW));
          EXPECT_TRUE(SameBits(dc.Read<uint16_t>(n), cW));  // untouched without the copy
        }
      }
    }
  }
  EXPECT_GT(fake_.pairUnpacks.load(), 0u);
}

// The sharded step on one rank: AdamSUpdatePairs then UnpackPairsDecay give UnpackAdamSUpdate's
// (UnpackAdamSUpdateCopy's) bits, "segment_rms" included.
TEST_F(FakePairs, PairsThenUnpackIsTheUpdate) {
  SCAPE_SEEDED_RNG(rng);
  for (scapeDataType_t t : kPayloadTypes) {
    for (size_t n : {size_t{0}, size_t{3}, size_t{1001}, size_t{8192 + 7}}) {
      for (size_t k : {size_t{0}, n / 7 + (n > 0), n}) {
        for (float wd : {0.0f, 0.1f}) {
          for (int copy : {0, 1, 2}) {
            SCOPED_TRACE(::testing::Message() << "type " << t << " n " << n << " k " << k << " wd "
                                              << wd << " copy " << copy);
            const scapeDataType_t ct = copy == 2 ? scapeFloat16 : scapeBfloat16;
            const auto theta = RandomNormal(rng, n);
            const auto m = RandomMomentum(rng, n);
            const auto mask = SortedMask(rng, n, k);
            const auto payload = RandomPayload(rng, t, k);
            kn::AdamSParams ap = Params(wd, copy % 2);
            const EnterTable et(n);
            if (copy != 1) et.Set(&ap);
            // The replicated update.
            Dev uth(rt_, theta), um(rt_, m), umask(rt_, mask), up(rt_, payload), uc(rt_, 2 * n);
            if (copy) {
              ASSERT_ST_OK(rt_->UnpackAdamSUpdateCopy(up.get(), t, umask.get<uint64_t>(), k,
                                                      uth.get<float>(), um.get<float>(), n, ap,
                                                      uc.get(), ct, s_));
            } else {
              ASSERT_ST_OK(rt_->UnpackAdamSUpdate(up.get(), t, umask.get<uint64_t>(), k,
                                                  uth.get<float>(), um.get<float>(), n, ap, s_));
            }
            // The sharded one.
            Dev sth(rt_, theta), sm(rt_, m), smask(rt_, mask), sp(rt_, payload), sc(rt_, 2 * n),
                spairs(rt_, 8 * k);
            ASSERT_ST_OK(rt_->AdamSUpdatePairs(sp.get(), t, smask.get<uint64_t>(), k,
                                               sth.get<float>(), sm.get<float>(), n, ap,
                                               spairs.get<float>(), s_));
            ASSERT_ST_OK(rt_->UnpackPairsDecay(spairs.get<float>(), smask.get<uint64_t>(), k,
                                               sth.get<float>(), sm.get<float>(), n, ap,
                                               copy ? sc.get() : nullptr, ct, s_));
            ASSERT_ST_OK(rt_->StreamSynchronize(s_));
            EXPECT_TRUE(SameBits(sth.Read<float>(n), uth.Read<float>(n)));
            EXPECT_TRUE(SameBits(sm.Read<float>(n), um.Read<float>(n)));
            if (copy) {
              EXPECT_TRUE(SameBits(sc.Read<uint16_t>(n), uc.Read<uint16_t>(n)));
            }
          }
        }
      }
    }
  }
}

// The "segment_rms" table is host memory that the runtime takes at the call (the CUDA runtime
// uploads it): the ops queued behind a held stream use the table as it was at the call, not as
// it is when the stream reaches them. (UnpackAdamSUpdateCopy read it when it ran.)
TEST_F(FakePairs, TheEnterTableIsTakenAtTheCall) {
  SCAPE_SEEDED_RNG(rng);
  const size_t n = 1001, k = 300;
  const scapeDataType_t t = scapeBfloat16;
  const auto theta = RandomNormal(rng, n);
  const auto m = RandomMomentum(rng, n);
  const auto mask = SortedMask(rng, n, k);
  const auto payload = RandomPayload(rng, t, k);
  EnterTable et(n);
  kn::AdamSParams ap = Params(0.1f, 0);
  et.Set(&ap);
  // References with the table as it is now.
  std::vector<float> pairsW(2 * k), thW = theta, mW = m;
  std::vector<uint16_t> cW(n);
  kn::ModelCopy mc;
  mc.p = cW.data();
  mc.type = scapeFloat16;
  ASSERT_EQ(kn::AdamSUpdatePairs(payload.data(), t, mask.data(), k, theta.data(), m.data(), n, ap,
                                 pairsW.data()),
            kn::KernelStatus::kOk);
  ASSERT_EQ(kn::UnpackAdamSUpdate(payload.data(), t, mask.data(), k, thW.data(), mW.data(), n, ap,
                                  0, &mc),
            kn::KernelStatus::kOk);
  Dev dth(rt_, theta), dm(rt_, m), dmask(rt_, mask), dp(rt_, payload), dpairs(rt_, 8 * k),
      dc(rt_, 2 * n);
  fake_device::Gate gate;
  fake_.HoldStream(s_, &gate);
  ASSERT_ST_OK(rt_->AdamSUpdatePairs(dp.get(), t, dmask.get<uint64_t>(), k, dth.get<float>(),
                                     dm.get<float>(), n, ap, dpairs.get<float>(), s_));
  ASSERT_ST_OK(rt_->UnpackAdamSUpdateCopy(dp.get(), t, dmask.get<uint64_t>(), k, dth.get<float>(),
                                          dm.get<float>(), n, ap, dc.get(), scapeFloat16, s_));
  // The caller's table changes before the stream runs the ops.
  std::fill(et.vs.begin(), et.vs.end(), 1e6f);
  et.off[1] = n;
  gate.Open();
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  EXPECT_TRUE(SameBits(dpairs.Read<float>(2 * k), pairsW));
  EXPECT_TRUE(SameBits(dth.Read<float>(n), thW));
  EXPECT_TRUE(SameBits(dm.Read<float>(n), mW));
  EXPECT_TRUE(SameBits(dc.Read<uint16_t>(n), cW));
}

TEST_F(FakePairs, HostCheckedErrors) {
  const size_t n = 10;
  Dev th(rt_, 4 * n), m(rt_, 4 * n), idx(rt_, 8 * n), p(rt_, 4 * n), pairs(rt_, 8 * n),
      c(rt_, 2 * n);
  for (size_t i = 0; i < n; ++i) idx.get<uint64_t>()[i] = i;
  const kn::AdamSParams ap;
  // Payload type.
  Status st = rt_->AdamSUpdatePairs(p.get(), scapeInt32, idx.get<uint64_t>(), 2, th.get<float>(),
                                    m.get<float>(), n, ap, pairs.get<float>(), s_);
  EXPECT_EQ(st.code(), scapeUnsupported);
  EXPECT_NE(st.message().find("AdamSUpdatePairs"), std::string::npos) << st.message();
  // k > n.
  EXPECT_EQ(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, idx.get<uint64_t>(), n + 1,
                                  th.get<float>(), m.get<float>(), n, ap, pairs.get<float>(), s_)
                .code(),
            scapeInvalidArgument);
  st = rt_->UnpackPairsDecay(pairs.get<float>(), idx.get<uint64_t>(), n + 1, th.get<float>(),
                             m.get<float>(), n, ap, nullptr, scapeBfloat16, s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("UnpackPairsDecay"), std::string::npos) << st.message();
  // Null pointers.
  EXPECT_EQ(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, nullptr, 2, th.get<float>(),
                                  m.get<float>(), n, ap, pairs.get<float>(), s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->AdamSUpdatePairs(nullptr, scapeFloat32, idx.get<uint64_t>(), 2, th.get<float>(),
                                  m.get<float>(), n, ap, pairs.get<float>(), s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, idx.get<uint64_t>(), 2, nullptr,
                                  m.get<float>(), n, ap, pairs.get<float>(), s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, idx.get<uint64_t>(), 2, th.get<float>(),
                                  m.get<float>(), n, ap, nullptr, s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->UnpackPairsDecay(nullptr, idx.get<uint64_t>(), 2, th.get<float>(), m.get<float>(),
                                  n, ap, nullptr, scapeBfloat16, s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->UnpackPairsDecay(pairs.get<float>(), nullptr, 2, th.get<float>(), m.get<float>(),
                                  n, ap, nullptr, scapeBfloat16, s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->UnpackPairsDecay(pairs.get<float>(), idx.get<uint64_t>(), 2, th.get<float>(),
                                  nullptr, n, ap, nullptr, scapeBfloat16, s_)
                .code(),
            scapeInvalidArgument);
  // A pairs buffer too small for 2k floats.
  EXPECT_EQ(
      rt_->UnpackPairsDecay(pairs.get<float>() + 2 * n - 1, idx.get<uint64_t>(), 1, th.get<float>(),
                            m.get<float>(), n, ap, nullptr, scapeBfloat16, s_)
          .code(),
      scapeInvalidArgument);
  // Copy type.
  EXPECT_EQ(rt_->UnpackPairsDecay(pairs.get<float>(), idx.get<uint64_t>(), 2, th.get<float>(),
                                  m.get<float>(), n, ap, c.get(), scapeFloat32, s_)
                .code(),
            scapeUnsupported);
  // Bad AdamS parameters.
  kn::AdamSParams bad;
  bad.beta2 = 1.0f;
  EXPECT_EQ(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, idx.get<uint64_t>(), 2, th.get<float>(),
                                  m.get<float>(), n, bad, pairs.get<float>(), s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->UnpackPairsDecay(pairs.get<float>(), idx.get<uint64_t>(), 2, th.get<float>(),
                                  m.get<float>(), n, bad, nullptr, scapeBfloat16, s_)
                .code(),
            scapeInvalidArgument);
  // Nothing was enqueued.
  EXPECT_EQ(fake_.pairUpdates.load(), 0u);
  EXPECT_EQ(fake_.pairUnpacks.load(), 0u);
  // n = 0 / k = 0 with null pointers are fine.
  ASSERT_ST_OK(rt_->AdamSUpdatePairs(nullptr, scapeBfloat16, nullptr, 0, nullptr, nullptr, 0, ap,
                                     nullptr, s_));
  ASSERT_ST_OK(rt_->AdamSUpdatePairs(nullptr, scapeFloat16, nullptr, 0, th.get<float>(),
                                     m.get<float>(), n, ap, nullptr, s_));
  ASSERT_ST_OK(rt_->UnpackPairsDecay(nullptr, nullptr, 0, nullptr, nullptr, 0, ap, nullptr,
                                     scapeBfloat16, s_));
  // Without a copy, copyType is not looked at (the optimizer passes scapeFloat32 then).
  ASSERT_ST_OK(rt_->UnpackPairsDecay(pairs.get<float>(), idx.get<uint64_t>(), 2, th.get<float>(),
                                     m.get<float>(), n, ap, nullptr, scapeFloat32, s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  EXPECT_EQ(fake_.pairUnpacks.load(), 1u);
}

// What only the data shows fails the stream: an unsorted mask for the unpack, a repeated
// position or one >= n for the pairs.
TEST_F(FakePairs, BadMasksFailTheStream) {
  const size_t n = 8;
  Dev th(rt_, std::vector<float>(n, 1.0f)), m(rt_, std::vector<float>(n, 0.5f)),
      unsorted(rt_, std::vector<uint64_t>{5, 2}), repeated(rt_, std::vector<uint64_t>{3, 1, 3}),
      outside(rt_, std::vector<uint64_t>{1, n}), p(rt_, 12), pairs(rt_, 24);
  ASSERT_ST_OK(rt_->UnpackPairsDecay(pairs.get<float>(), unsorted.get<uint64_t>(), 2,
                                     th.get<float>(), m.get<float>(), n, kn::AdamSParams(), nullptr,
                                     scapeBfloat16, s_));
  Status st = rt_->StreamSynchronize(s_);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("UnpackPairsDecay"), std::string::npos) << st.message();
  fake_.ClearStreamError(s_);
  for (const Dev* idx : {&repeated, &outside}) {
    const size_t k = idx == &repeated ? 3 : 2;
    ASSERT_ST_OK(rt_->AdamSUpdatePairs(p.get(), scapeFloat32, idx->get<uint64_t>(), k,
                                       th.get<float>(), m.get<float>(), n, kn::AdamSParams(),
                                       pairs.get<float>(), s_));
    st = rt_->StreamSynchronize(s_);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("AdamSUpdatePairs"), std::string::npos) << st.message();
    fake_.ClearStreamError(s_);
  }
}

// The "none" runtime has no device: both ops say scapeUnsupported.
TEST(NonePairs, DefaultsAreUnsupported) {
  Runtime* none = scape::device::NoneRuntime();
  kn::AdamSParams ap;
  EXPECT_EQ(none->AdamSUpdatePairs(nullptr, scapeFloat32, nullptr, 0, nullptr, nullptr, 0, ap,
                                   nullptr, nullptr)
                .code(),
            scapeUnsupported);
  EXPECT_EQ(none->UnpackPairsDecay(nullptr, nullptr, 0, nullptr, nullptr, 0, ap, nullptr,
                                   scapeBfloat16, nullptr)
                .code(),
            scapeUnsupported);
}

}  // namespace
