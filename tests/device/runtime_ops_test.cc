// The device ops of the tests' CPU fake runtime (tests/device/fake_device.h): each op against
// the CPU kernel it stands for (fresh random inputs, odd sizes, k = 0, n = 0), the host-side
// argument errors, stream ordering behind a held gate, and the sticky failed-stream error.
// The ops are called through the Runtime interface, as the library calls them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/gather.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/topk.h"
#include "plugin/device/device_pool.h"
#include "tests/device/device_buffer.h"
#include "tests/device/fake_device.h"
#include "tests/kernels/kernel_test_util.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape::Status;
using scape::device::PtrKind;
using scape::device::Runtime;
using scape::device::Stream;
namespace kn = scape::kernels;
using kn::testing_util::RandomNormal;

using fake_device::Dev;

std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// k distinct positions in [0, n), in random order.
std::vector<uint64_t> RandomPositions(std::mt19937_64& rng, uint64_t n, size_t k) {
  std::vector<uint64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(k);
  return all;
}

std::vector<uint64_t> SortedMask(std::mt19937_64& rng, uint64_t n, size_t k) {
  auto m = RandomPositions(rng, n, k);
  std::sort(m.begin(), m.end());
  return m;
}

bool SameBits(const void* a, const void* b, size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

class FakeOps : public ::testing::Test {
 protected:
  FakeRuntime fake_;
  Runtime* rt_ = &fake_;
  Stream s_ = fake_.NewStream();
};

TEST_F(FakeOps, DeviceAllocIsDeviceMemoryUntilFreed) {
  void* p = nullptr;
  ASSERT_ST_OK(rt_->DeviceAlloc(100, &p));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(rt_->Kind(p), PtrKind::kDevice);
  EXPECT_EQ(rt_->Kind(static_cast<char*>(p) + 99), PtrKind::kDevice);
  EXPECT_EQ(rt_->Kind(static_cast<char*>(p) + 100), PtrKind::kHost);
  void* z = nullptr;
  ASSERT_ST_OK(rt_->DeviceAlloc(0, &z));  // 0 bytes: a valid, distinct pointer
  ASSERT_NE(z, nullptr);
  EXPECT_NE(z, p);
  EXPECT_EQ(rt_->Kind(z), PtrKind::kDevice);
  EXPECT_EQ(fake_.deviceLive.load(), 2u);
  rt_->DeviceFree(p);
  rt_->DeviceFree(z);
  rt_->DeviceFree(nullptr);  // a no-op
  EXPECT_EQ(fake_.deviceLive.load(), 0u);
  EXPECT_EQ(rt_->Kind(p), PtrKind::kHost);
  EXPECT_FALSE(rt_->DeviceAlloc(8, nullptr).ok());
}

TEST_F(FakeOps, MemsetIsStreamOrderedAndChecksItsRange) {
  Dev d(rt_, 37);
  ASSERT_ST_OK(rt_->Memset(d.get(), 0x3c, 37, s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  for (uint8_t b : d.Read<uint8_t>(37)) ASSERT_EQ(b, 0x3c);
  Status st = rt_->Memset(d.get(), 0, 38, s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("Memset"), std::string::npos) << st.message();
  std::vector<char> host(8);
  EXPECT_EQ(rt_->Memset(host.data(), 0, 8, s_).code(), scapeInvalidArgument);
  ASSERT_ST_OK(rt_->Memset(nullptr, 0, 0, s_));  // nothing to do
}

TEST_F(FakeOps, GatherAndScatterMatchTheCpuKernels) {
  SCAPE_SEEDED_RNG(rng);
  for (size_t esz : {1, 2, 4, 8}) {
    for (size_t n : {1, 2, 7, 1000, 4099}) {
      for (size_t k : {size_t{0}, size_t{1}, n / 3, n}) {
        SCOPED_TRACE(::testing::Message() << "esz " << esz << " n " << n << " k " << k);
        const auto dense = RandomBytes(rng, n * esz);  // raw bits: NaN payloads included
        const auto idx = RandomPositions(rng, n, k);
        Dev dd(rt_, dense), di(rt_, idx), dp(rt_, k * esz);
        ASSERT_ST_OK(rt_->Gather(dd.get(), di.get<uint64_t>(), k, esz, dp.get(), s_));
        // Scatter new values back (distinct positions: any order is well defined).
        const auto packed2 = RandomBytes(rng, k * esz);
        Dev dp2(rt_, packed2);
        ASSERT_ST_OK(rt_->Scatter(dp2.get(), di.get<uint64_t>(), k, esz, dd.get(), s_));
        ASSERT_ST_OK(rt_->StreamSynchronize(s_));

        std::vector<uint8_t> want(k * esz), wantDense = dense;
        kn::GatherByIndex(dense.data(), idx.data(), k, esz, want.data());
        kn::ScatterByIndex(packed2.data(), idx.data(), k, esz, wantDense.data());
        EXPECT_TRUE(SameBits(dp.Read<uint8_t>(k * esz).data(), want.data(), k * esz));
        EXPECT_TRUE(SameBits(dd.Read<uint8_t>(n * esz).data(), wantDense.data(), n * esz));
      }
    }
  }
  EXPECT_GT(fake_.gathers.load(), 0u);
  EXPECT_GT(fake_.scatters.load(), 0u);
}

TEST_F(FakeOps, GatherScatterHostCheckedErrors) {
  Dev dense(rt_, 64), idx(rt_, 8 * 4), packed(rt_, 16);
  std::vector<uint64_t> host(4);
  // Element size.
  Status st = rt_->Gather(dense.get(), idx.get<uint64_t>(), 4, 3, packed.get(), s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("esz"), std::string::npos) << st.message();
  // Host memory where device memory is required.
  st = rt_->Gather(dense.get(), host.data(), 4, 4, packed.get(), s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("dIdx"), std::string::npos) << st.message();
  // The packed side runs past its allocation (k * esz = 32 > 16).
  st = rt_->Scatter(packed.get(), idx.get<uint64_t>(), 4, 8, dense.get(), s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("dPacked"), std::string::npos) << st.message();
  // Misaligned.
  st = rt_->Gather(dense.get<char>() + 1, idx.get<uint64_t>(), 4, 4, packed.get(), s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  // k = 0: nothing is checked past the element size, nothing is queued.
  const uint64_t before = fake_.kernelLaunches.load();
  ASSERT_ST_OK(rt_->Gather(nullptr, nullptr, 0, 4, nullptr, s_));
  ASSERT_ST_OK(rt_->Scatter(nullptr, nullptr, 0, 8, nullptr, s_));
  EXPECT_EQ(fake_.kernelLaunches.load(), before);
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
}

// Segments with odd lengths, an empty one, k = 0 and k = len, in exact and sampled mode.
TEST_F(FakeOps, TopkAbsMatchesTheCpuKernel) {
  SCAPE_SEEDED_RNG(rng);
  for (kn::TopkMode mode : {kn::TopkMode::kExact, kn::TopkMode::kSampled}) {
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(::testing::Message() << "mode " << int(mode) << " round " << round);
      const std::vector<uint64_t> lens = {1, 0, 777, 4099, 33, round == 0 ? uint64_t{100003} : 0};
      const size_t nseg = lens.size();
      std::vector<uint64_t> off(nseg + 1), k(nseg), oo(nseg + 1);
      off[0] = 5;  // offsets[0] need not be 0
      for (size_t s = 0; s < nseg; ++s) off[s + 1] = off[s] + lens[s];
      ASSERT_EQ(kn::TopkKFromDensity(off.data(), nseg, 0.05 * (round + 1), k.data()),
                kn::KernelStatus::kOk);
      k[2] = 0;        // k = 0
      k[4] = lens[4];  // k = len
      // Sampled mode may select more than k: give every segment room for all of it.
      const uint64_t total =
          mode == kn::TopkMode::kExact ? kn::TopkOutOffsets(k.data(), nseg, oo.data()) : 0;
      if (mode == kn::TopkMode::kSampled) {
        oo[0] = 0;
        for (size_t s = 0; s < nseg; ++s) oo[s + 1] = oo[s] + lens[s];
      }
      const uint64_t cap = oo[nseg];
      (void)total;
      auto x = RandomNormal(rng, off[nseg]);
      for (size_t i = 0; i < x.size(); i += 17) x[i] = x[i / 2];  // ties
      kn::TopkSegments sg;
      sg.offsets = off.data();
      sg.k = k.data();
      sg.out_offsets = oo.data();
      sg.nseg = nseg;
      kn::TopkOptions opt;
      opt.mode = mode;
      opt.sample_size = 512;
      std::vector<uint64_t> want(cap, ~uint64_t{0}), wantCounts(nseg);
      ASSERT_EQ(kn::TopkAbs(x.data(), sg, opt, want.data(), wantCounts.data()),
                kn::KernelStatus::kOk);

      Dev dx(rt_, x), dout(rt_, std::vector<uint64_t>(cap, ~uint64_t{0})), dc(rt_, nseg * 8);
      // The table is host memory the caller may change right after the call.
      std::vector<uint64_t> offCopy = off;
      sg.offsets = offCopy.data();
      ASSERT_ST_OK(
          rt_->TopkAbs(dx.get<float>(), sg, opt, dout.get<uint64_t>(), dc.get<uint64_t>(), s_));
      std::fill(offCopy.begin(), offCopy.end(), 0);
      ASSERT_ST_OK(rt_->StreamSynchronize(s_));
      EXPECT_EQ(dout.Read<uint64_t>(cap), want);
      EXPECT_EQ(dc.Read<uint64_t>(nseg), wantCounts);
    }
  }
}

TEST_F(FakeOps, TopkAbsHostCheckedErrors) {
  std::vector<uint64_t> off = {0, 10, 5}, k = {1, 0}, oo = {0, 1, 1};
  kn::TopkSegments sg;
  sg.offsets = off.data();
  sg.k = k.data();
  sg.out_offsets = oo.data();
  sg.nseg = 2;
  Dev x(rt_, 40), out(rt_, 8), counts(rt_, 16);
  kn::TopkOptions opt;
  Status st =
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);  // offsets descend
  EXPECT_NE(st.message().find("TopkAbs"), std::string::npos) << st.message();
  off = {0, 10, 10};
  k = {11, 0};
  EXPECT_EQ(
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_).code(),
      scapeInvalidArgument);  // k > len
  k = {2, 0};
  EXPECT_EQ(
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_).code(),
      scapeInvalidArgument);  // capacity 1 < k = 2
  k = {1, 0};
  off = {0, 10, 11};  // x holds 10 floats: offsets[nseg] = 11 runs past it
  EXPECT_EQ(
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_).code(),
      scapeInvalidArgument);
  off = {0, 10, 10};
  EXPECT_EQ(rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), nullptr, s_).code(),
            scapeInvalidArgument);  // counts are required
  opt.mode = kn::TopkMode::kSampled;
  opt.sample_size = 0;
  EXPECT_EQ(
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_).code(),
      scapeInvalidArgument);
  opt = kn::TopkOptions();
  ASSERT_ST_OK(
      rt_->TopkAbs(x.get<float>(), sg, opt, out.get<uint64_t>(), counts.get<uint64_t>(), s_));
  // No output capacity at all (every k = 0): dOut may be null.
  k = {0, 0};
  oo = {0, 0, 0};
  ASSERT_ST_OK(rt_->TopkAbs(x.get<float>(), sg, opt, nullptr, counts.get<uint64_t>(), s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  EXPECT_EQ(counts.Read<uint64_t>(2), std::vector<uint64_t>(2, 0));
  sg.nseg = 0;  // no segments: nothing to do
  ASSERT_ST_OK(rt_->TopkAbs(nullptr, sg, opt, nullptr, nullptr, s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
}

const scapeDataType_t kPayloadTypes[] = {scapeFloat32, scapeBfloat16, scapeFloat16};

// CandidatePackResidual, RecoveredGradSqNorm and UnpackAdamSUpdate in the order of a step,
// against the CPU kernels on copies of the same inputs: the same bits.
TEST_F(FakeOps, StepKernelsMatchTheCpuKernels) {
  SCAPE_SEEDED_RNG(rng);
  for (scapeDataType_t t : kPayloadTypes) {
    const size_t esz = kn::PayloadElementSize(t);
    for (size_t n : {0, 1, 2, 777, 4099}) {
      for (size_t k : {size_t{0}, n / 10, n}) {
        for (bool withC : {false, true}) {
          // The op is the optimizer step's form: the rounding error kept in the residual.
          const bool keep = true;
          SCOPED_TRACE(::testing::Message()
                       << "type " << t << " n " << n << " k " << k << " c_out " << withC);
          const float beta1 = 0.9f;
          auto m = RandomNormal(rng, n), g = RandomNormal(rng, n), e = RandomNormal(rng, n, 0.1f);
          auto theta = RandomNormal(rng, n);
          const auto mask = SortedMask(rng, n, k);
          // CPU reference.
          std::vector<float> eW = e, cW(n), mW = m, thW = theta;
          std::vector<uint8_t> pW(k * esz);
          ASSERT_EQ(
              kn::CandidatePackResidual(m.data(), g.data(), eW.data(), n, beta1, mask.data(), k, t,
                                        pW.data(), withC ? cW.data() : nullptr, 0, keep),
              kn::KernelStatus::kOk);
          double normW = -1.0;
          ASSERT_EQ(
              kn::RecoveredGradSqNorm(pW.data(), t, mask.data(), k, m.data(), n, beta1, &normW),
              kn::KernelStatus::kOk);
          kn::AdamSParams ap;
          ap.beta1 = beta1;
          ap.clip_scale = withC ? 0.5f : 1.0f;
          ap.bias_correction =
              withC ? kn::BiasCorrection::kScapeArtifact : kn::BiasCorrection::kNone;
          ap.step = 3;
          ASSERT_EQ(
              kn::UnpackAdamSUpdate(pW.data(), t, mask.data(), k, thW.data(), mW.data(), n, ap),
              kn::KernelStatus::kOk);
          // The fake, on the stream.
          Dev dm(rt_, m), dg(rt_, g), de(rt_, e), dth(rt_, theta), dmask(rt_, mask), dc(rt_, n * 4),
              dp(rt_, k * esz), dnorm(rt_, 8);
          ASSERT_ST_OK(rt_->CandidatePackResidual(dm.get<float>(), dg.get<float>(), de.get<float>(),
                                                  n, beta1, dmask.get<uint64_t>(), k, t, dp.get(),
                                                  withC ? dc.get<float>() : nullptr, s_));
          ASSERT_ST_OK(rt_->RecoveredGradSqNorm(dp.get(), t, dmask.get<uint64_t>(), k,
                                                dm.get<float>(), n, beta1, dnorm.get<double>(),
                                                s_));
          ASSERT_ST_OK(rt_->UnpackAdamSUpdate(dp.get(), t, dmask.get<uint64_t>(), k,
                                              dth.get<float>(), dm.get<float>(), n, ap, s_));
          ASSERT_ST_OK(rt_->StreamSynchronize(s_));
          EXPECT_TRUE(SameBits(de.Read<float>(n).data(), eW.data(), n * 4));
          if (withC) {
            EXPECT_TRUE(SameBits(dc.Read<float>(n).data(), cW.data(), n * 4));
          }
          EXPECT_TRUE(SameBits(dp.Read<uint8_t>(k * esz).data(), pW.data(), k * esz));
          const double got = dnorm.Read<double>(1)[0];
          EXPECT_TRUE(SameBits(&got, &normW, 8)) << got << " vs " << normW;
          EXPECT_TRUE(SameBits(dth.Read<float>(n).data(), thW.data(), n * 4));
          EXPECT_TRUE(SameBits(dm.Read<float>(n).data(), mW.data(), n * 4));
        }
      }
    }
  }
  EXPECT_GT(fake_.candidates.load(), 0u);
  EXPECT_GT(fake_.updates.load(), 0u);
  EXPECT_GT(fake_.norms.load(), 0u);
}

TEST_F(FakeOps, StepKernelsHostCheckedErrors) {
  Dev m(rt_, 40), g(rt_, 40), e(rt_, 40), mask(rt_, 8 * 11), p(rt_, 44), norm(rt_, 8);
  // Payload type.
  Status st = rt_->CandidatePackResidual(m.get<float>(), g.get<float>(), e.get<float>(), 10, 0.9f,
                                         mask.get<uint64_t>(), 2, scapeInt32, p.get(), nullptr, s_);
  EXPECT_EQ(st.code(), scapeUnsupported);
  EXPECT_NE(st.message().find("CandidatePackResidual"), std::string::npos) << st.message();
  // k > n.
  EXPECT_EQ(rt_->CandidatePackResidual(m.get<float>(), g.get<float>(), e.get<float>(), 10, 0.9f,
                                       mask.get<uint64_t>(), 11, scapeFloat32, p.get(), nullptr, s_)
                .code(),
            scapeInvalidArgument);
  // n runs past dE.
  EXPECT_EQ(rt_->CandidatePackResidual(m.get<float>(), g.get<float>(), e.get<float>(), 11, 0.9f,
                                       mask.get<uint64_t>(), 1, scapeFloat32, p.get(), nullptr, s_)
                .code(),
            scapeInvalidArgument);
  // Bad AdamS parameters.
  kn::AdamSParams ap;
  ap.beta2 = 1.0f;
  st = rt_->UnpackAdamSUpdate(p.get(), scapeFloat32, mask.get<uint64_t>(), 2, e.get<float>(),
                              m.get<float>(), 10, ap, s_);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("UnpackAdamSUpdate"), std::string::npos) << st.message();
  // beta1 out of range; a null result pointer.
  EXPECT_EQ(rt_->RecoveredGradSqNorm(p.get(), scapeFloat32, mask.get<uint64_t>(), 2, m.get<float>(),
                                     10, 1.0f, norm.get<double>(), s_)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt_->RecoveredGradSqNorm(p.get(), scapeFloat32, mask.get<uint64_t>(), 2, m.get<float>(),
                                     10, 0.9f, nullptr, s_)
                .code(),
            scapeInvalidArgument);
  // n = 0 / k = 0 with null pointers are fine; the norm of nothing is written as 0.
  ASSERT_ST_OK(rt_->CandidatePackResidual(nullptr, nullptr, nullptr, 0, 0.9f, nullptr, 0,
                                          scapeFloat32, nullptr, nullptr, s_));
  ASSERT_ST_OK(
      rt_->UnpackAdamSUpdate(nullptr, scapeBfloat16, nullptr, 0, nullptr, nullptr, 0, ap = {}, s_));
  ASSERT_ST_OK(rt_->RecoveredGradSqNorm(nullptr, scapeFloat16, nullptr, 0, nullptr, 0, 0.9f,
                                        norm.get<double>(), s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  EXPECT_EQ(norm.Read<double>(1)[0], 0.0);
}

// An op queued behind a held gate does not run before the gate opens, and ops on one stream
// run in order (the gather sees the memset queued before it).
TEST_F(FakeOps, OpsFollowStreamOrder) {
  const size_t n = 1001;
  std::vector<uint32_t> dense(n);
  std::iota(dense.begin(), dense.end(), 1u);
  std::vector<uint64_t> idx = {1000, 0, 500, 7};
  Dev dd(rt_, dense), di(rt_, idx), dp(rt_, idx.size() * 4);
  std::memset(dp.get(), 0, idx.size() * 4);
  Gate gate;
  fake_.HoldStream(s_, &gate);
  ASSERT_ST_OK(rt_->Gather(dd.get(), di.get<uint64_t>(), idx.size(), 4, dp.get(), s_));
  ASSERT_ST_OK(rt_->Memset(dd.get(), 0, n * 4, s_));  // after the gather: must not affect it
  ASSERT_ST_OK(rt_->Gather(dd.get(), di.get<uint64_t>(), 2, 4, dp.get<uint32_t>() + 2, s_));
  scape::device::Event ev;
  ASSERT_ST_OK(rt_->EventCreate(&ev));
  ASSERT_ST_OK(rt_->EventRecord(ev, s_));
  // Give the stream thread every chance to run ahead of the gate.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  bool done = true;
  ASSERT_ST_OK(rt_->EventQuery(ev, &done));
  EXPECT_FALSE(done);
  EXPECT_EQ(dp.Read<uint32_t>(4), std::vector<uint32_t>(4, 0u)) << "an op ran before the gate";
  EXPECT_EQ(dd.Read<uint32_t>(n), dense);
  gate.Open();
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  ASSERT_ST_OK(rt_->EventQuery(ev, &done));
  EXPECT_TRUE(done);
  EXPECT_EQ(dp.Read<uint32_t>(4), (std::vector<uint32_t>{1001, 1, 0, 0}));
  rt_->EventDestroy(ev);
}

// A kernel that fails on the stream thread fails the stream: the call itself returned Ok, and
// the error (naming the op) sticks to EventQuery and StreamSynchronize; later ops are skipped;
// other streams are unaffected.
TEST_F(FakeOps, AFailedKernelFailsItsStreamStickily) {
  const size_t n = 64;
  Dev m(rt_, std::vector<float>(n, 1.0f)), g(rt_, std::vector<float>(n, 1.0f)),
      e(rt_, std::vector<float>(n, 0.0f)), p(rt_, 8);
  Dev badMask(rt_, std::vector<uint64_t>{5, 3});  // not increasing: only the data shows it
  scape::device::Event ev;
  ASSERT_ST_OK(rt_->EventCreate(&ev));
  ASSERT_ST_OK(rt_->CandidatePackResidual(m.get<float>(), g.get<float>(), e.get<float>(), n, 0.9f,
                                          badMask.get<uint64_t>(), 2, scapeFloat32, p.get(),
                                          nullptr, s_));
  ASSERT_ST_OK(rt_->EventRecord(ev, s_));
  Status st = rt_->StreamSynchronize(s_);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("CandidatePackResidual"), std::string::npos) << st.message();
  EXPECT_EQ(fake_.failedOps.load(), 1u);
  EXPECT_EQ(e.Read<float>(n), std::vector<float>(n, 0.0f)) << "the failed kernel wrote";
  bool done = true;
  EXPECT_FALSE(rt_->EventQuery(ev, &done).ok());
  // Sticky: a second sync, and a later op that is skipped (its output stays as it was).
  EXPECT_FALSE(rt_->StreamSynchronize(s_).ok());
  ASSERT_ST_OK(rt_->Memset(p.get(), 0x11, 8, s_));  // accepted at the call ...
  EXPECT_FALSE(rt_->StreamSynchronize(s_).ok());
  EXPECT_EQ(fake_.skippedOps.load(), 1u);  // ... and never run
  EXPECT_NE(p.Read<uint8_t>(8)[0], 0x11);
  // Another stream works.
  Stream other = fake_.NewStream();
  ASSERT_ST_OK(rt_->Memset(p.get(), 0x22, 8, other));
  ASSERT_ST_OK(rt_->StreamSynchronize(other));
  EXPECT_EQ(p.Read<uint8_t>(8)[0], 0x22);
  // The test hook resets it.
  fake_.ClearStreamError(s_);
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  ASSERT_ST_OK(rt_->EventQuery(ev, &done));
  rt_->EventDestroy(ev);
}

TEST_F(FakeOps, AnIndexOutsideTheDenseBufferFailsTheStream) {
  Dev dense(rt_, 4 * 10), idx(rt_, std::vector<uint64_t>{3, 10}), packed(rt_, 8);
  std::memset(packed.get(), 0x5a, 8);
  ASSERT_ST_OK(rt_->Gather(dense.get(), idx.get<uint64_t>(), 2, 4, packed.get(), s_));
  Status st = rt_->StreamSynchronize(s_);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("Gather"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("dIdx[1]"), std::string::npos) << st.message();
  EXPECT_EQ(packed.Read<uint8_t>(8), std::vector<uint8_t>(8, 0x5a));  // nothing written
  fake_.ClearStreamError(s_);
  ASSERT_ST_OK(rt_->Scatter(packed.get(), idx.get<uint64_t>(), 2, 4, dense.get(), s_));
  st = rt_->StreamSynchronize(s_);
  EXPECT_NE(st.message().find("Scatter"), std::string::npos) << st.message();
}

// A buffer freed while an op on it is still queued: the op fails its stream, nothing is touched.
TEST_F(FakeOps, ABufferFreedBeforeItsOpRunsFailsTheStream) {
  const size_t n = 16;
  Dev m(rt_, std::vector<float>(n, 1.0f)), e(rt_, std::vector<float>(n, 0.0f)),
      mask(rt_, std::vector<uint64_t>{1, 2}), p(rt_, 8);
  void* g = nullptr;
  ASSERT_ST_OK(rt_->DeviceAlloc(n * 4, &g));
  Gate gate;
  fake_.HoldStream(s_, &gate);
  ASSERT_ST_OK(rt_->CandidatePackResidual(m.get<float>(), static_cast<float*>(g), e.get<float>(), n,
                                          0.9f, mask.get<uint64_t>(), 2, scapeFloat32, p.get(),
                                          nullptr, s_));
  rt_->DeviceFree(g);
  gate.Open();
  Status st = rt_->StreamSynchronize(s_);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("dG"), std::string::npos) << st.message();
  EXPECT_EQ(e.Read<float>(n), std::vector<float>(n, 0.0f));
}

TEST_F(FakeOps, InjectedFaultsFailTheNextOps) {
  Dev d(rt_, 16);
  fake_.failNextOps = 1;
  ASSERT_ST_OK(rt_->Memset(d.get(), 1, 16, s_));
  Status st = rt_->StreamSynchronize(s_);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("Memset"), std::string::npos) << st.message();
  EXPECT_EQ(fake_.failNextOps.load(), 0);
  fake_.ClearStreamError(s_);
  ASSERT_ST_OK(rt_->Memset(d.get(), 2, 16, s_));
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  EXPECT_EQ(d.Read<uint8_t>(16), std::vector<uint8_t>(16, 2));
}

}  // namespace

// The device pool's Drop and exact sizes (plugin/device/device_pool.h), as the optimizer's
// scratch uses them: an exact block has no quarter to spare; a dropped block is never taken
// again and is freed once its stream has passed the drop (not before: the stream is held), by
// the next Sweep, without a host wait; a released block is taken again on its stream.
// Issue 31: the pool's same-stream reuse is keyed on the stream handle, and a runtime may hand
// a destroyed stream's handle to a new stream (the fake does, as CUDA may). A block released on
// the old stream while its work is still queued there, then taken on the new stream of the same
// handle, must not be written by the new stream's work before the old work has run: the reuse
// waits on the release's event (on the device, no host wait), whatever the handle.
TEST_F(FakeOps, PoolReuseOnTheHandleOfADestroyedStreamWaitsForItsWork) {
  scape::device::DevicePool pool(rt_, 5000);
  Stream s1 = nullptr, s2 = nullptr;
  ASSERT_ST_OK(rt_->StreamCreate(&s1));
  scape::device::DevicePool::Block a, b;
  ASSERT_ST_OK(pool.Acquire(1024, s1, &a, /*exact=*/true));
  Gate gate;
  fake_.HoldStream(s1, &gate);
  ASSERT_ST_OK(rt_->Memset(a.d, 1, a.bytes, s1));  // the old stream's work on the block, held
  scape::device::Event oldDone = nullptr;
  ASSERT_ST_OK(rt_->EventCreate(&oldDone));
  ASSERT_ST_OK(rt_->EventRecord(oldDone, s1));
  pool.Release(a, s1);
  rt_->StreamDestroy(s1);
  ASSERT_ST_OK(rt_->StreamCreate(&s2));
  ASSERT_EQ(s2, s1) << "the fake did not hand the destroyed stream's handle to the new stream";
  ASSERT_ST_OK(pool.Acquire(1024, s2, &b, /*exact=*/true));
  EXPECT_EQ(b.d, a.d) << "the block released on the handle is reused at once";
  ASSERT_ST_OK(rt_->Memset(b.d, 2, b.bytes, s2));  // the new owner's work
  (void)fake_.StreamOf(s2)->Sync(300);  // unordered, it would run now, before the old work
  gate.Open();
  for (bool done = false; !done;) ASSERT_ST_OK(rt_->EventQuery(oldDone, &done));
  ASSERT_TRUE(fake_.StreamOf(s2)->Sync());
  const std::vector<uint8_t> got(static_cast<uint8_t*>(b.d), static_cast<uint8_t*>(b.d) + b.bytes);
  EXPECT_EQ(got, std::vector<uint8_t>(b.bytes, 2)) << "the old stream's work ran after the reuse";
  rt_->EventDestroy(oldDone);
  pool.Release(b, s2);
  rt_->StreamDestroy(s2);
}

TEST_F(FakeOps, PoolDropFreesOnceTheStreamHasPassed) {
  scape::device::DevicePool pool(rt_, 5000);
  scape::device::DevicePool::Block a, b, c;
  ASSERT_ST_OK(pool.Acquire(1000, s_, &a, /*exact=*/true));
  EXPECT_EQ(a.bytes, 1024u);  // 1000 rounded to 256, no spare
  ASSERT_ST_OK(pool.Acquire(1000, s_, &b));
  EXPECT_EQ(b.bytes, 1280u);  // 1250 rounded to 256
  const uint64_t live = fake_.deviceLive.load();
  Gate gate;
  fake_.HoldStream(s_, &gate);
  pool.Drop(a, s_);  // returns at once although the stream is held
  pool.Sweep();
  EXPECT_EQ(fake_.deviceLive.load(), live) << "freed under the held stream";
  ASSERT_ST_OK(pool.Acquire(1000, s_, &c, /*exact=*/true));
  EXPECT_NE(c.d, a.d) << "a dropped block was taken again";
  gate.Open();
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  pool.Sweep();
  EXPECT_EQ(fake_.deviceLive.load(), live) << "a freed, c allocated";
  EXPECT_EQ(rt_->Kind(a.d), PtrKind::kHost) << "the dropped block is freed";
  pool.Release(b, s_);
  scape::device::DevicePool::Block d;
  ASSERT_ST_OK(pool.Acquire(1100, s_, &d));
  EXPECT_EQ(d.d, b.d) << "a released block is reused on its stream";
  pool.Drop(c, s_);
  pool.Drop(d, s_);
  ASSERT_ST_OK(rt_->StreamSynchronize(s_));
  pool.Sweep();
  EXPECT_EQ(pool.BlocksHeld(), 0u);
}
