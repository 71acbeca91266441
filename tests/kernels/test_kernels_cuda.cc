// CUDA kernels against the CPU implementation (bit for bit / same sets / same status codes).
// Compiled whenever the build has CUDA; every test skips itself when no device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/gather.h"
#include "kernels/cpu/mask_codec.h"
#include "kernels/cpu/scaled.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/scaled.cuh"
#include "kernels/cuda/scape_kernels.cuh"
#include "plugin/device/runtime.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

namespace kc = ::scape::kernels::cuda;
using testing_util::RandomMask;
using testing_util::RandomNormal;

#define SKIP_WITHOUT_GPU()                                                                      \
  do {                                                                                          \
    if (kc::DeviceCount() == 0)                                                                 \
      GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount found none (no GPU, no driver, or "   \
                      "CUDA_VISIBLE_DEVICES hides them); this test compares the CUDA kernel "   \
                      "with the CPU one and needs a GPU (perf/gpu/gpu_check.sh runs it there)"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), KernelStatus::kOk) << #expr << ": " << kc::LastCudaError()

// Owning device buffer.
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (kc::DeviceMalloc(&p_, bytes) != KernelStatus::kOk) p_ = nullptr;
  }
  template <typename T>
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size() * sizeof(T)) {
    if (p_ && !v.empty()) {
      EXPECT_EQ(kc::CopyToDevice(p_, v.data(), v.size() * sizeof(T)), KernelStatus::kOk);
    }
  }
  ~DevBuf() {
    if (p_) (void)kc::DeviceFree(p_);  // a failed free cannot be acted on in a destructor
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  template <typename T>
  std::vector<T> Read(size_t count) const {
    std::vector<T> v(count);
    if (count) {
      EXPECT_EQ(kc::CopyToHost(v.data(), p_, count * sizeof(T)), KernelStatus::kOk);
    }
    return v;
  }
  bool ok() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Bit for bit, except that two NaNs match whatever their bits: arithmetic on a NaN input gives
// the GPU's canonical NaN but keeps the input's payload on x86, and a 16-bit payload's NaN
// follows its float. `type`: scapeFloat32 (floats), scapeBfloat16 or scapeFloat16 (words).
bool SameBitsNaNAsOne(const void* a, const void* b, size_t count, scapeDataType_t type) {
  const size_t esz = type == scapeFloat32 ? 4 : 2;
  auto is_nan = [&](const char* p) {
    if (esz == 4) {
      uint32_t u;
      std::memcpy(&u, p, 4);
      return (u & 0x7fffffffu) > 0x7f800000u;
    }
    uint16_t u;
    std::memcpy(&u, p, 2);
    return type == scapeBfloat16 ? (u & 0x7fffu) > 0x7f80u : (u & 0x7fffu) > 0x7c00u;
  };
  for (size_t i = 0; i < count; ++i) {
    const char* pa = static_cast<const char*>(a) + i * esz;
    const char* pb = static_cast<const char*>(b) + i * esz;
    if (std::memcmp(pa, pb, esz) != 0 && !(is_nan(pa) && is_nan(pb))) return false;
  }
  return true;
}

const size_t kSizes[] = {0, 1, 3, 4095, 4096, 4097, 100003, (size_t{1} << 22) + 5};

// keep: keep_rounding (the rounding error stays in the residual inside the mask); then some
// inputs overflow fp16 (a non-finite payload: residual +0) and some are NaN.
template <typename Index>
void CandidateCase(std::mt19937_64& rng, size_t n, double density, scapeDataType_t type,
                   int c_mode /*0 none, 1 separate, 2 alias g*/, bool keep = false) {
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " density=" << density << " type=" << type << " c_mode=" << c_mode
               << " index=" << sizeof(Index) << " keep_rounding=" << keep);
  const float b1 = 0.9f;
  std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 2.0f),
                     e = RandomNormal(rng, n, 0.1f);
  if (keep) {
    for (size_t i = 5; i < n; i += 97) g[i] = 2e6f;  // |c| > 65504: fp16 infinity
    for (size_t i = 11; i < n; i += 389) g[i] = std::numeric_limits<float>::quiet_NaN();
  }
  std::vector<Index> mask = RandomMask<Index>(rng, n, density);
  const size_t k = mask.size(), esz = PayloadElementSize(type);
  // CPU.
  std::vector<float> e_cpu = e, g_cpu = g, c_cpu(n);
  std::vector<uint8_t> p_cpu(k * esz);
  float* c_out_cpu = c_mode == 0 ? nullptr : (c_mode == 1 ? c_cpu.data() : g_cpu.data());
  ASSERT_EQ(CandidatePackResidual(m.data(), g_cpu.data(), e_cpu.data(), n, b1, mask.data(), k, type,
                                  p_cpu.data(), c_out_cpu, 0, keep),
            KernelStatus::kOk);
  // GPU.
  DevBuf dm(m), dg(g), de(e), dmask(mask), dp(k * esz), dc(n * sizeof(float));
  ASSERT_TRUE(dm.ok() && dg.ok() && de.ok() && dmask.ok() && dp.ok() && dc.ok());
  float* c_out_gpu = c_mode == 0 ? nullptr : (c_mode == 1 ? dc.get<float>() : dg.get<float>());
  CUDA_OK(kc::CandidatePackResidualCuda(dm.get<float>(), dg.get<float>(), de.get<float>(), n, b1,
                                        dmask.get<Index>(), k, type, dp.get(), c_out_gpu, nullptr,
                                        keep));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  if (!keep) {
    EXPECT_TRUE(SameBytes(de.Read<float>(n), e_cpu)) << "residual differs";
    EXPECT_TRUE(SameBytes(dp.Read<uint8_t>(k * esz), p_cpu)) << "payload differs";
    if (c_mode == 1) {
      EXPECT_TRUE(SameBytes(dc.Read<float>(n), c_cpu)) << "c differs";
    }
    if (c_mode == 2) {
      EXPECT_TRUE(SameBytes(dg.Read<float>(n), g_cpu)) << "c (in g) differs";
    }
    return;
  }
  // keep: NaN inputs were planted (their bits differ between CPU and GPU; see SameBitsNaNAsOne).
  EXPECT_TRUE(SameBitsNaNAsOne(de.Read<float>(n).data(), e_cpu.data(), n, scapeFloat32))
      << "residual differs";
  EXPECT_TRUE(SameBitsNaNAsOne(dp.Read<uint8_t>(k * esz).data(), p_cpu.data(), k, type))
      << "payload differs";
  if (c_mode == 1) {
    EXPECT_TRUE(SameBitsNaNAsOne(dc.Read<float>(n).data(), c_cpu.data(), n, scapeFloat32))
        << "c differs";
  }
  if (c_mode == 2) {
    EXPECT_TRUE(SameBitsNaNAsOne(dg.Read<float>(n).data(), g_cpu.data(), n, scapeFloat32))
        << "c (in g) differs";
  }
}

TEST(CudaCandidatePackResidual, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : kSizes) {
    for (double d : {0.0, 0.01, 0.5, 1.0}) CandidateCase<uint32_t>(rng, n, d, scapeFloat32, 0);
    CandidateCase<uint64_t>(rng, n, 0.05, scapeBfloat16, 1);
    CandidateCase<uint32_t>(rng, n, 0.05, scapeFloat16, 2);
  }
}

// keep_rounding (the device optimizer step's form, for bf16/fp16 payloads): the same bits as
// the CPU kernel with keep_rounding, which equals the host step's view kernel
// (scape_kernels_cpu_test, CandidatePackResidual.KeepRoundingMatchesViewKernel).
TEST(CudaCandidatePackResidual, KeepRoundingMatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : kSizes) {
    for (double d : {0.0, 0.05, 1.0}) {
      CandidateCase<uint64_t>(rng, n, d, scapeBfloat16, 1, true);
      CandidateCase<uint32_t>(rng, n, d, scapeFloat16, 0, true);
    }
    CandidateCase<uint64_t>(rng, n, 0.3, scapeBfloat16, 2, true);
    CandidateCase<uint64_t>(rng, n, 0.3, scapeFloat32, 1, true);
  }
}

template <typename Index>
void UpdateCase(std::mt19937_64& rng, size_t n, double density, scapeDataType_t type,
                const AdamSParams& p) {
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " density=" << density << " type=" << type
               << " bias=" << static_cast<int>(p.bias_correction) << " clip=" << p.clip_scale);
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  std::vector<Index> mask = RandomMask<Index>(rng, n, density);
  const size_t k = mask.size(), esz = PayloadElementSize(type);
  std::vector<float> pf = RandomNormal(rng, k, 0.01f);
  std::vector<uint8_t> payload(k * esz);
  for (size_t j = 0; j < k; ++j) {
    if (type == scapeFloat32) {
      std::memcpy(payload.data() + 4 * j, &pf[j], 4);
    } else {
      const uint16_t h = type == scapeBfloat16 ? FloatToBf16(pf[j]) : FloatToFp16(pf[j]);
      std::memcpy(payload.data() + 2 * j, &h, 2);
    }
  }
  double sq_cpu = 0;
  ASSERT_EQ(
      RecoveredGradSqNorm(payload.data(), type, mask.data(), k, m.data(), n, p.beta1, &sq_cpu),
      KernelStatus::kOk);
  std::vector<float> theta_cpu = theta, m_cpu = m;
  ASSERT_EQ(
      UnpackAdamSUpdate(payload.data(), type, mask.data(), k, theta_cpu.data(), m_cpu.data(), n, p),
      KernelStatus::kOk);

  DevBuf dtheta(theta), dm(m), dmask(mask), dp(payload), dsq(sizeof(double));
  size_t temp_bytes = 0;
  CUDA_OK(kc::RecoveredGradSqNormCuda(dp.get(), type, dmask.get<Index>(), k, dm.get<float>(), n,
                                      p.beta1, dsq.get<double>(), nullptr, &temp_bytes, nullptr));
  DevBuf dtemp(temp_bytes);
  CUDA_OK(kc::RecoveredGradSqNormCuda(dp.get(), type, dmask.get<Index>(), k, dm.get<float>(), n,
                                      p.beta1, dsq.get<double>(), dtemp.get(), &temp_bytes,
                                      nullptr));
  CUDA_OK(kc::UnpackAdamSUpdateCuda(dp.get(), type, dmask.get<Index>(), k, dtheta.get<float>(),
                                    dm.get<float>(), n, p, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  const double sq_gpu = dsq.Read<double>(1)[0];
  EXPECT_EQ(std::memcmp(&sq_gpu, &sq_cpu, sizeof(double)), 0) << sq_gpu << " vs " << sq_cpu;
  EXPECT_TRUE(SameBytes(dtheta.Read<float>(n), theta_cpu)) << "theta differs";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m_cpu)) << "m differs";
}

TEST(CudaUnpackAdamSUpdate, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  AdamSParams p;
  for (size_t n : kSizes) {
    for (double d : {0.0, 0.01, 1.0}) UpdateCase<uint32_t>(rng, n, d, scapeFloat32, p);
  }
  UpdateCase<uint64_t>(rng, 300007, 0.1, scapeBfloat16, p);
  UpdateCase<uint32_t>(rng, 300007, 0.1, scapeFloat16, p);
  p.bias_correction = BiasCorrection::kAdamSReference;
  p.step = 5;
  UpdateCase<uint32_t>(rng, 300007, 0.1, scapeFloat32, p);
  p.bias_correction = BiasCorrection::kScapeArtifact;
  UpdateCase<uint32_t>(rng, 300007, 0.1, scapeFloat32, p);
  p.clip_scale = 0.3f;
  UpdateCase<uint32_t>(rng, 300007, 0.1, scapeFloat32, p);
  p.weight_decay = 0.0f;
  p.clip_momentum = false;
  UpdateCase<uint32_t>(rng, 300007, 0.1, scapeFloat32, p);
  // A long mask exercises every level of the blocked norm.
  UpdateCase<uint32_t>(rng, (size_t{1} << 24) + 1, 1.0, scapeFloat32, AdamSParams{});
}

// ---- mixed precision: the 16-bit model copy and 16-bit gradients ------------------------------

// UnpackAdamSUpdateCopyCuda against the CPU kernel with a ModelCopy: theta, m and the copy bit
// for bit; the copy starts as garbage and must be round(theta) at every element (decay 1 too).
void UpdateCopyCase(std::mt19937_64& rng, size_t n, double density, scapeDataType_t ctype,
                    float wd) {
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " density=" << density << " copy=" << ctype << " wd=" << wd);
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, density);
  const size_t k = mask.size();
  std::vector<float> payload = RandomNormal(rng, k, 0.01f);
  AdamSParams p;
  p.weight_decay = wd;
  std::vector<float> theta_cpu = theta, m_cpu = m;
  std::vector<uint16_t> copy_cpu(n, 0x7fc1), copy0(n, 0x7fc1);
  ModelCopy c;
  c.p = copy_cpu.data();
  c.type = ctype;
  ASSERT_EQ(UnpackAdamSUpdate(payload.data(), scapeFloat32, mask.data(), k, theta_cpu.data(),
                              m_cpu.data(), n, p, 0, &c),
            KernelStatus::kOk);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(copy_cpu[i],
              ctype == scapeBfloat16 ? FloatToBf16(theta_cpu[i]) : FloatToFp16(theta_cpu[i]));
  DevBuf dtheta(theta), dm(m), dmask(mask), dp(payload), dcopy(copy0);
  ModelCopy dc;
  dc.p = dcopy.get();
  dc.type = ctype;
  CUDA_OK(kc::UnpackAdamSUpdateCopyCuda(dp.get(), scapeFloat32, dmask.get<uint64_t>(), k,
                                        dtheta.get<float>(), dm.get<float>(), n, p, dc, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  EXPECT_TRUE(SameBytes(dtheta.Read<float>(n), theta_cpu)) << "theta differs";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m_cpu)) << "m differs";
  EXPECT_TRUE(SameBytes(dcopy.Read<uint16_t>(n), copy_cpu)) << "16-bit copy differs";
}

TEST(CudaUnpackAdamSUpdateCopy, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : kSizes)
    for (float wd : {0.0f, 0.1f}) {
      UpdateCopyCase(rng, n, 0.05, scapeBfloat16, wd);
      UpdateCopyCase(rng, n, 1.0, scapeFloat16, wd);
    }
  UpdateCopyCase(rng, 300007, 0.01, scapeBfloat16, 0.1f);  // vectorised full tiles
}

// CandidatePackResidualGradCuda with bf16/fp16 gradients: the CPU kernel on the widened
// gradients, bit for bit.
TEST(CudaCandidatePackResidualGrad, MatchesCpuOnWidenedGradients) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : kSizes)
    for (scapeDataType_t gt : {scapeBfloat16, scapeFloat16}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " grad=" << gt);
      std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 2.0f),
                         e = RandomNormal(rng, n, 0.1f);
      std::vector<uint16_t> g16(n);
      for (size_t i = 0; i < n; ++i) {
        g16[i] = gt == scapeBfloat16 ? FloatToBf16(g[i]) : FloatToFp16(g[i]);
        g[i] = gt == scapeBfloat16 ? Bf16ToFloat(g16[i]) : Fp16ToFloat(g16[i]);
      }
      std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.05);
      const size_t k = mask.size();
      std::vector<float> e_cpu = e, c_cpu(n);
      std::vector<uint16_t> p_cpu(k);
      ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), e_cpu.data(), n, 0.9f, mask.data(), k,
                                      scapeBfloat16, p_cpu.data(), c_cpu.data(), 0, true),
                KernelStatus::kOk);
      DevBuf dm(m), dg(g16), de(e), dmask(mask), dp(k * 2 + 2), dc(n * sizeof(float) + 4);
      CUDA_OK(kc::CandidatePackResidualGradCuda(dm.get<float>(), dg.get(), gt, de.get<float>(), n,
                                                0.9f, dmask.get<uint64_t>(), k, scapeBfloat16,
                                                dp.get(), dc.get<float>(), nullptr, true));
      CUDA_OK(kc::StreamSynchronize(nullptr));
      EXPECT_TRUE(SameBytes(de.Read<float>(n), e_cpu)) << "residual differs";
      EXPECT_TRUE(SameBytes(dp.Read<uint16_t>(k), p_cpu)) << "payload differs";
      EXPECT_TRUE(SameBytes(dc.Read<float>(n), c_cpu)) << "candidate differs";
    }
}

// Local clipping (issue 30): GradSqNormCuda over fp32 / bf16 / fp16 gradients and the candidate
// with a grad_scale, the same bits as the CPU kernels (sizes across the block and level edges).
TEST(CudaLocalClip, GradSqNormAndScaledCandidateMatchCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : {size_t{0}, size_t{1}, size_t{257}, size_t{256 * 256 + 3}, size_t{1} << 20})
    for (scapeDataType_t gt : {scapeFloat32, scapeBfloat16, scapeFloat16}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " grad=" << gt);
      std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n, 2.0f),
                         e = RandomNormal(rng, n, 0.1f);
      std::vector<uint16_t> g16(n);
      if (gt != scapeFloat32)
        for (size_t i = 0; i < n; ++i) {
          g16[i] = gt == scapeBfloat16 ? FloatToBf16(g[i]) : FloatToFp16(g[i]);
          g[i] = gt == scapeBfloat16 ? Bf16ToFloat(g16[i]) : Fp16ToFloat(g16[i]);
        }
      const void* gh = gt == scapeFloat32 ? static_cast<const void*>(g.data())
                                          : static_cast<const void*>(g16.data());
      double sq_cpu = -1.0;
      ASSERT_EQ(GradSqNorm(gh, gt, n, &sq_cpu), KernelStatus::kOk);
      DevBuf dg(gt == scapeFloat32 ? n * 4 + 4 : n * 2 + 2), dsq(sizeof(double));
      if (n) {
        CUDA_OK(kc::CopyToDevice(dg.get(), gh, gt == scapeFloat32 ? n * 4 : n * 2));
      }
      size_t temp_bytes = 0;
      CUDA_OK(
          kc::GradSqNormCuda(dg.get(), gt, n, dsq.get<double>(), nullptr, &temp_bytes, nullptr));
      DevBuf dtemp(temp_bytes);
      CUDA_OK(kc::GradSqNormCuda(dg.get(), gt, n, dsq.get<double>(), dtemp.get(), &temp_bytes,
                                 nullptr));
      CUDA_OK(kc::StreamSynchronize(nullptr));
      const double sq_gpu = dsq.Read<double>(1)[0];
      EXPECT_EQ(std::memcmp(&sq_gpu, &sq_cpu, sizeof(double)), 0) << sq_gpu << " vs " << sq_cpu;
      // The candidate with the factor that norm gives against a threshold of 1.
      const float s = sq_cpu > 1.0 ? static_cast<float>(1.0 / (std::sqrt(sq_cpu) + 1e-6)) : 0.5f;
      std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.05);
      const size_t k = mask.size();
      std::vector<float> e_cpu = e, c_cpu(n), p_cpu(k + 1);
      ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), e_cpu.data(), n, 0.9f, mask.data(), k,
                                      scapeFloat32, p_cpu.data(), c_cpu.data(), 0, true, s),
                KernelStatus::kOk);
      DevBuf dm(m), de(e), dmask(mask), dp(k * 4 + 4), dc(n * sizeof(float) + 4);
      CUDA_OK(kc::CandidatePackResidualGradCuda(dm.get<float>(), dg.get(), gt, de.get<float>(), n,
                                                0.9f, dmask.get<uint64_t>(), k, scapeFloat32,
                                                dp.get(), dc.get<float>(), nullptr, true, s));
      CUDA_OK(kc::StreamSynchronize(nullptr));
      p_cpu.resize(k);
      EXPECT_TRUE(SameBytes(de.Read<float>(n), e_cpu)) << "residual differs";
      EXPECT_TRUE(SameBytes(dp.Read<float>(k), p_cpu)) << "payload differs";
      EXPECT_TRUE(SameBytes(dc.Read<float>(n), c_cpu)) << "candidate differs";
    }
}

// "segment_rms" (issue 23): the staying block sums and the update with a segment table, every
// payload type, the same bits as the CPU kernels.
void SegmentRmsCase(std::mt19937_64& rng, size_t n, scapeDataType_t type, float clip,
                    bool mcap = false) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " type=" << type << " clip=" << clip);
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  for (size_t i = 0; i < n; i += 3) m[i] = 0.0f;  // a third enters
  std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.3);
  const size_t k = mask.size(), esz = PayloadElementSize(type);
  std::vector<float> pf = RandomNormal(rng, k, 0.01f);
  std::vector<uint8_t> payload(k * esz + 1);
  for (size_t j = 0; j < k; ++j) {
    if (type == scapeFloat32) {
      std::memcpy(payload.data() + 4 * j, &pf[j], 4);
    } else {
      const uint16_t h = type == scapeBfloat16 ? FloatToBf16(pf[j]) : FloatToFp16(pf[j]);
      std::memcpy(payload.data() + 2 * j, &h, 2);
    }
  }
  // Three segments (the last with no staying entry: m zeroed there), cut into blocks.
  const std::vector<uint64_t> off{0, n / 3, n / 2, n};
  for (uint64_t i = n / 2; i < n; ++i) m[i] = 0.0f;
  std::vector<uint64_t> bounds{0};
  size_t j = 0;
  for (size_t s = 0; s + 1 < off.size(); ++s) {
    const size_t jb = j;
    while (j < k && mask[j] < off[s + 1]) ++j;
    const size_t nb = StayingBlockCount(j - jb);
    bounds.resize(bounds.size() + nb);
    StayingBlockBounds(jb, j, bounds.data() + bounds.size() - nb);
  }
  const size_t nb = bounds.size() - 1;
  std::vector<double> sums(nb + 1);
  std::vector<uint64_t> counts(nb + 1);
  ASSERT_EQ(StayingGradSqBlocks(payload.data(), type, mask.data(), m.data(), n, 0.9f, bounds.data(),
                                nb, sums.data(), counts.data()),
            KernelStatus::kOk);
  DevBuf dtheta(theta), dm(m), dmask(mask), dp(payload), dbounds(bounds), dsums(8 * (nb + 1)),
      dcounts(8 * (nb + 1));
  CUDA_OK(kc::StayingGradSqBlocksCuda(dp.get(), type, dmask.get<uint64_t>(), dm.get<float>(), n,
                                      0.9f, dbounds.get<uint64_t>(), nb, dsums.get<double>(),
                                      dcounts.get<uint64_t>(), nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  std::vector<double> gs = dsums.Read<double>(nb);
  std::vector<uint64_t> gc = dcounts.Read<uint64_t>(nb);
  sums.resize(nb);
  counts.resize(nb);
  EXPECT_TRUE(SameBytes(gs, sums)) << "block sums differ";
  EXPECT_TRUE(SameBytes(gc, counts)) << "block counts differ";
  const std::vector<float> vs{n > 10 ? 1e-4f : -1.0f, 2.5e-5f, -1.0f};
  AdamSParams p;
  p.clip_scale = clip;
  p.enter_offsets = off.data();
  p.enter_vs = vs.data();
  p.enter_nseg = 3;
  p.enter_momentum_cap = mcap;
  std::vector<float> theta_cpu = theta, m_cpu = m;
  ASSERT_EQ(
      UnpackAdamSUpdate(payload.data(), type, mask.data(), k, theta_cpu.data(), m_cpu.data(), n, p),
      KernelStatus::kOk);
  DevBuf doff(off), dvs(vs);
  p.enter_offsets = doff.get<uint64_t>();
  p.enter_vs = dvs.get<float>();
  CUDA_OK(kc::UnpackAdamSUpdateCuda(dp.get(), type, dmask.get<uint64_t>(), k, dtheta.get<float>(),
                                    dm.get<float>(), n, p, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  EXPECT_TRUE(SameBytes(dtheta.Read<float>(n), theta_cpu)) << "theta differs";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m_cpu)) << "m differs";
}

TEST(CudaSegmentRms, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : {size_t{7}, size_t{4099}, size_t{300007}})
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16})
      SegmentRmsCase(rng, n, t, n == 4099 ? 0.3f : 1.0f);
}

// Momentum factor masking (AdamSParams.enter_momentum_cap): the CUDA clamp gives the CPU's bits.
TEST(CudaSegmentRms, MomentumFactorMaskingMatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t n : {size_t{7}, size_t{4099}, size_t{300007}})
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16})
      SegmentRmsCase(rng, n, t, n == 4099 ? 0.3f : 1.0f, true);
}

// ---- top-k ------------------------------------------------------------------------------------

template <typename Index>
void TopkCase(const std::vector<float>& x, const std::vector<uint64_t>& offsets,
              const std::vector<uint64_t>& k, const std::vector<uint64_t>& out_offsets,
              const TopkOptions& opt) {
  const size_t nseg = k.size();
  TopkSegments sg{offsets.data(), k.data(), out_offsets.data(), nseg};
  std::vector<Index> out_cpu(out_offsets.back() + 1, 0);
  std::vector<uint64_t> counts_cpu(nseg);
  ASSERT_EQ(TopkAbs(x.data(), sg, opt, out_cpu.data(), counts_cpu.data()), KernelStatus::kOk);
  DevBuf dx(x), doff(offsets), dk(k), doo(out_offsets),
      dout((out_offsets.back() + 1) * sizeof(Index)), dcounts(nseg * sizeof(uint64_t));
  CUDA_OK(kc::DeviceMemset(dout.get(), 0, (out_offsets.back() + 1) * sizeof(Index), nullptr));
  kc::TopkCudaSegments cs;
  cs.d_offsets = doff.get<uint64_t>();
  cs.d_k = dk.get<uint64_t>();
  cs.d_out_offsets = doo.get<uint64_t>();
  cs.nseg = nseg;
  cs.max_elements = offsets.back() - offsets.front();
  size_t temp_bytes = 0;
  CUDA_OK(kc::TopkAbsCuda(dx.get<float>(), cs, opt, dout.get<Index>(), dcounts.get<uint64_t>(),
                          nullptr, &temp_bytes, nullptr));
  DevBuf dtemp(temp_bytes);
  CUDA_OK(kc::TopkAbsCuda(dx.get<float>(), cs, opt, dout.get<Index>(), dcounts.get<uint64_t>(),
                          dtemp.get(), &temp_bytes, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  std::vector<uint64_t> counts_gpu = dcounts.Read<uint64_t>(nseg);
  std::vector<Index> out_gpu = dout.Read<Index>(out_offsets.back() + 1);
  ASSERT_EQ(counts_gpu, counts_cpu);
  for (size_t s = 0; s < nseg; ++s) {
    std::vector<Index> a(out_cpu.begin() + out_offsets[s],
                         out_cpu.begin() + out_offsets[s] + counts_cpu[s]);
    std::vector<Index> b(out_gpu.begin() + out_offsets[s],
                         out_gpu.begin() + out_offsets[s] + counts_cpu[s]);
    ASSERT_EQ(a, b) << "segment " << s;
  }
}

std::vector<float> TopkData(std::mt19937_64& rng, size_t n, int dist) {
  std::vector<float> x = RandomNormal(rng, n);
  if (dist == 1) {
    const float vals[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f};
    for (auto& v : x) v = vals[rng() % 5];
  } else if (dist == 3) {
    // All keys equal (both signs): exact mode's threshold bin holds the whole segment, so only
    // segments of up to ~4.7k elements fit the candidate buffer (len/8 + 4096), the others use
    // the histogram passes over x; the ties are taken in index order either way.
    for (auto& v : x) v = (rng() & 1) ? 0.75f : -0.75f;
  } else if (dist == 2) {
    for (size_t i = 0; i < n / 50; ++i) {
      const float sp[] = {std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), -0.0f,
                          std::numeric_limits<float>::denorm_min()};
      x[rng() % n] = sp[rng() % 4];
    }
  }
  return x;
}

TEST(CudaTopk, ExactAndSampledMatchCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  const std::vector<std::vector<uint64_t>> layouts = {
      {0, 1, 2, 3, 7, 8191, 8192, 8193, 100000, 0, 1},
      {(1u << 22) + 3},
      std::vector<uint64_t>(300, 5000),
  };
  for (const auto& lens : layouts) {
    // dist 0: smooth keys (exact mode's candidate path); 1: five values (heavy ties: candidate
    // path for the first segments, histogram passes over x once the buffer is full); 2: NaN,
    // inf, -0 and denormals mixed in; 3: all keys equal.
    for (int dist : {0, 1, 2, 3}) {
      for (double density : {0.001, 0.01, 0.3, 1.0}) {
        SCOPED_TRACE(::testing::Message()
                     << "segments " << lens.size() << " dist " << dist << " density " << density);
        std::vector<uint64_t> off = {11};
        for (uint64_t l : lens) off.push_back(off.back() + l);
        std::vector<float> x = TopkData(rng, off.back(), dist);
        std::vector<uint64_t> k(lens.size()), oo(lens.size() + 1);
        ASSERT_EQ(TopkKFromDensity(off.data(), lens.size(), density, k.data()), KernelStatus::kOk);
        TopkOutOffsets(k.data(), k.size(), oo.data());
        TopkOptions opt;
        TopkCase<uint32_t>(x, off, k, oo, opt);
        // Sampled mode with capacity 2k (at least 1) and a small sample.
        std::vector<uint64_t> caps(k.size());
        for (size_t s = 0; s < k.size(); ++s) caps[s] = std::max<uint64_t>(1, 2 * k[s]);
        TopkOutOffsets(caps.data(), caps.size(), oo.data());
        opt.mode = TopkMode::kSampled;
        opt.sample_size = 2048;
        TopkCase<uint64_t>(x, off, k, oo, opt);
      }
    }
  }
}

// Enough tiles (8192 elements each) that a histogram block takes a run of several tiles
// (the grid is ~6 blocks per SM): runs inside one long segment and runs crossing segment
// boundaries; candidate path (smooth keys) and fallback (five values, buffer overflow).
TEST(CudaTopk, LongTileRuns) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  const std::vector<std::vector<uint64_t>> layouts = {
      std::vector<uint64_t>(1000, 20000),
      {(uint64_t{1} << 24) + 5},
  };
  for (const auto& lens : layouts) {
    for (int dist : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "segments " << lens.size() << " dist " << dist);
      std::vector<uint64_t> off = {3};
      for (uint64_t l : lens) off.push_back(off.back() + l);
      std::vector<float> x = TopkData(rng, off.back(), dist);
      std::vector<uint64_t> k(lens.size()), oo(lens.size() + 1);
      ASSERT_EQ(TopkKFromDensity(off.data(), lens.size(), 0.01, k.data()), KernelStatus::kOk);
      TopkOutOffsets(k.data(), k.size(), oo.data());
      TopkOptions opt;
      TopkCase<uint32_t>(x, off, k, oo, opt);
      opt.mode = TopkMode::kSampled;
      TopkCase<uint32_t>(x, off, k, oo, opt);
      // More samples than the sampled select keeps in registers (16 per thread): reread per digit.
      opt.sample_size = 1u << 15;
      TopkCase<uint32_t>(x, off, k, oo, opt);
    }
  }
}

TEST(CudaTopk, ExplicitKAndBadTables) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  std::vector<uint64_t> off = {0, 10, 10, 20000, 20001};
  std::vector<float> x = TopkData(rng, off.back(), 0);
  std::vector<uint64_t> k = {0, 0, 19990, 1}, oo(5);
  TopkOutOffsets(k.data(), 4, oo.data());
  TopkCase<uint32_t>(x, off, k, oo, TopkOptions{});
  k = {10, 0, 1, 0};
  TopkOutOffsets(k.data(), 4, oo.data());
  TopkCase<uint32_t>(x, off, k, oo, TopkOptions{});
  // Descending offsets: nothing selected, counts flag the error.
  std::vector<uint64_t> bad = {0, 100, 50};
  std::vector<uint64_t> bk = {1, 1}, boo = {0, 1, 2};
  DevBuf dx(x), doff(bad), dk(bk), doo(boo), dout(16), dcounts(16);
  kc::TopkCudaSegments cs;
  cs.d_offsets = doff.get<uint64_t>();
  cs.d_k = dk.get<uint64_t>();
  cs.d_out_offsets = doo.get<uint64_t>();
  cs.nseg = 2;
  cs.max_elements = 100;
  size_t tb = 0;
  CUDA_OK(kc::TopkAbsCuda(dx.get<float>(), cs, TopkOptions{}, dout.get<uint32_t>(),
                          dcounts.get<uint64_t>(), nullptr, &tb, nullptr));
  DevBuf dtemp(tb);
  size_t small = tb - 1;
  EXPECT_EQ(kc::TopkAbsCuda(dx.get<float>(), cs, TopkOptions{}, dout.get<uint32_t>(),
                            dcounts.get<uint64_t>(), dtemp.get(), &small, nullptr),
            KernelStatus::kBufferTooSmall);
  CUDA_OK(kc::TopkAbsCuda(dx.get<float>(), cs, TopkOptions{}, dout.get<uint32_t>(),
                          dcounts.get<uint64_t>(), dtemp.get(), &tb, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  EXPECT_EQ(dcounts.Read<uint64_t>(2), (std::vector<uint64_t>{~0ull, ~0ull}));
}

// ---- codecs -------------------------------------------------------------------------------

template <typename Index>
void CodecCase(std::mt19937_64& rng, uint64_t n, double density) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " density=" << density);
  std::vector<Index> idx = RandomMask<Index>(rng, n, density);
  const size_t k = idx.size();
  DevBuf didx(idx);
  // Indices -> bitmap.
  const uint64_t nw = BitmapWords(n);
  std::vector<uint64_t> words_cpu(nw);
  ASSERT_EQ(IndicesToBitmap(idx.data(), k, n, words_cpu.data(), nw), KernelStatus::kOk);
  DevBuf dwords(nw * 8);
  CUDA_OK(kc::IndicesToBitmapCuda(didx.get<Index>(), k, n, dwords.get<uint64_t>(), nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  ASSERT_EQ(dwords.Read<uint64_t>(nw), words_cpu);
  // Bitmap -> indices.
  DevBuf dout((k + 1) * sizeof(Index)), dcount(8), dstatus(4);
  size_t tb = 0;
  CUDA_OK(kc::BitmapToIndicesCuda(dwords.get<uint64_t>(), n, dout.get<Index>(), k,
                                  dcount.get<uint64_t>(), dstatus.get<uint32_t>(), nullptr, &tb,
                                  nullptr));
  DevBuf dtemp(tb);
  CUDA_OK(kc::BitmapToIndicesCuda(dwords.get<uint64_t>(), n, dout.get<Index>(), k,
                                  dcount.get<uint64_t>(), dstatus.get<uint32_t>(), dtemp.get(), &tb,
                                  nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  EXPECT_EQ(dstatus.Read<uint32_t>(1)[0], 0u);
  EXPECT_EQ(dcount.Read<uint64_t>(1)[0], k);
  EXPECT_EQ(dout.Read<Index>(k), idx);
  // Elias-Fano: same bytes as the CPU encoder, and the decoder round-trips.
  uint64_t ef_size = 0;
  ASSERT_EQ(MaskEncodedBytes(MaskEncoding::kEliasFano, idx.data(), k, n, &ef_size),
            KernelStatus::kOk);
  std::vector<uint8_t> ef_cpu(ef_size);
  size_t written = 0;
  ASSERT_EQ(
      MaskEncode(MaskEncoding::kEliasFano, idx.data(), k, n, ef_cpu.data(), ef_size, &written),
      KernelStatus::kOk);
  DevBuf dbuf(ef_size);
  size_t gw = 0;
  CUDA_OK(
      kc::EliasFanoEncodeCuda(didx.get<Index>(), k, n, dbuf.get<uint8_t>(), ef_size, &gw, nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  EXPECT_EQ(gw, ef_size);
  ASSERT_EQ(dbuf.Read<uint8_t>(ef_size), ef_cpu);
}

template <typename Index>
uint32_t GpuEfDecode(const std::vector<uint8_t>& enc, uint64_t n, size_t capacity,
                     std::vector<Index>* out) {
  // Round the device copy up to 8 bytes (alignment); only `size` bytes are declared.
  DevBuf dbuf(enc.size() + 8), dout((capacity + 1) * sizeof(Index)), dcount(8), dstatus(4);
  if (!enc.empty()) {
    EXPECT_EQ(kc::CopyToDevice(dbuf.get(), enc.data(), enc.size()), KernelStatus::kOk);
  }
  size_t tb = 0;
  EXPECT_EQ(kc::EliasFanoDecodeCuda(dbuf.get<uint8_t>(), enc.size(), n, dout.get<Index>(), capacity,
                                    dcount.get<uint64_t>(), dstatus.get<uint32_t>(), nullptr, &tb,
                                    nullptr),
            KernelStatus::kOk);
  DevBuf dtemp(tb);
  EXPECT_EQ(kc::EliasFanoDecodeCuda(dbuf.get<uint8_t>(), enc.size(), n, dout.get<Index>(), capacity,
                                    dcount.get<uint64_t>(), dstatus.get<uint32_t>(), dtemp.get(),
                                    &tb, nullptr),
            KernelStatus::kOk);
  EXPECT_EQ(kc::StreamSynchronize(nullptr), KernelStatus::kOk);
  const uint32_t st = dstatus.Read<uint32_t>(1)[0];
  if (st == 0) *out = dout.Read<Index>(dcount.Read<uint64_t>(1)[0]);
  return st;
}

TEST(CudaMaskCodec, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (uint64_t n : {0ull, 1ull, 63ull, 64ull, 65ull, 1000ull, 100003ull, (1ull << 22) + 9}) {
    for (double d : {0.0, 0.01, 0.3, 1.0}) {
      CodecCase<uint32_t>(rng, n, d);
      CodecCase<uint64_t>(rng, n, d);
    }
  }
}

TEST(CudaMaskCodec, EliasFanoDecodeValidatesLikeCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (uint64_t n : {1ull, 130ull, 5000ull, 1000003ull}) {
    for (double d : {0.0, 0.01, 0.5}) {
      std::vector<uint32_t> idx = RandomMask<uint32_t>(rng, n, d);
      uint64_t size = 0;
      ASSERT_EQ(MaskEncodedBytes(MaskEncoding::kEliasFano, idx.data(), idx.size(), n, &size),
                KernelStatus::kOk);
      std::vector<uint8_t> good(size);
      size_t w;
      ASSERT_EQ(
          MaskEncode(MaskEncoding::kEliasFano, idx.data(), idx.size(), n, good.data(), size, &w),
          KernelStatus::kOk);
      std::vector<uint32_t> dec;
      ASSERT_EQ(GpuEfDecode(good, n, idx.size(), &dec), 0u);
      EXPECT_EQ(dec, idx);
      std::vector<std::vector<uint8_t>> bads;
      for (size_t cut : {size_t{0}, size_t{23}, size / 2, size - 1}) {
        if (cut < size) bads.emplace_back(good.begin(), good.begin() + cut);
      }
      std::vector<uint8_t> longer = good;
      longer.insert(longer.end(), 8, 0);
      bads.push_back(longer);
      for (int t = 0; t < 40; ++t) {
        std::vector<uint8_t> b = good;
        b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        bads.push_back(b);
      }
      for (const auto& b : bads) {
        std::vector<uint32_t> cpu_out(idx.size() + 1), gpu_out;
        size_t kk = 0;
        const KernelStatus cs = MaskDecode(b.data(), b.size(), n, cpu_out.data(), idx.size(), &kk);
        const uint32_t gs = GpuEfDecode(b, n, idx.size(), &gpu_out);
        if (b.size() >= kMaskHeaderBytes && b[0] != 2) {
          // The GPU decoder reads Elias-Fano only: another encoding byte is corrupt there.
          EXPECT_EQ(gs, static_cast<uint32_t>(KernelStatus::kCorrupt));
          continue;
        }
        ASSERT_EQ(gs, static_cast<uint32_t>(cs)) << "size " << b.size();
        if (gs == 0) {
          cpu_out.resize(kk);
          EXPECT_EQ(gpu_out, cpu_out);
        }
      }
    }
  }
}

// ---- gather / scatter by index -----------------------------------------------------------------

// k distinct positions in [0, n): sorted (the mask case) or in random order.
std::vector<uint64_t> GatherPositions(std::mt19937_64& rng, uint64_t n, size_t k, bool sorted) {
  std::vector<uint64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(k);
  if (sorted) std::sort(all.begin(), all.end());
  return all;
}

void GatherCase(std::mt19937_64& rng, size_t n, size_t k, size_t esz, bool sorted) {
  SCOPED_TRACE(::testing::Message()
               << "n=" << n << " k=" << k << " esz=" << esz << " sorted=" << sorted);
  std::vector<uint8_t> dense(n * esz), packed2(k * esz);
  for (auto& b : dense) b = static_cast<uint8_t>(rng());  // raw bits: NaN payloads included
  for (auto& b : packed2) b = static_cast<uint8_t>(rng());
  const std::vector<uint64_t> idx = GatherPositions(rng, n, k, sorted);
  std::vector<uint8_t> want(k * esz), wantDense = dense;
  GatherByIndex(dense.data(), idx.data(), k, esz, want.data());
  ScatterByIndex(packed2.data(), idx.data(), k, esz, wantDense.data());
  // A guard element after the packed output: nothing may be written past k.
  DevBuf dd(dense), di(idx), dp(std::vector<uint8_t>((k + 1) * esz, 0xee)), dp2(packed2);
  ASSERT_TRUE(dd.ok() && di.ok() && dp.ok() && dp2.ok());
  CUDA_OK(kc::GatherByIndexCuda(dd.get(), di.get<uint64_t>(), k, esz, dp.get(), nullptr));
  CUDA_OK(kc::ScatterByIndexCuda(dp2.get(), di.get<uint64_t>(), k, esz, dd.get(), nullptr));
  CUDA_OK(kc::StreamSynchronize(nullptr));
  std::vector<uint8_t> got = dp.Read<uint8_t>((k + 1) * esz);
  EXPECT_EQ(std::vector<uint8_t>(got.begin() + k * esz, got.end()), std::vector<uint8_t>(esz, 0xee))
      << "written past k";
  got.resize(k * esz);
  EXPECT_TRUE(SameBytes(got, want)) << "gather differs";
  EXPECT_TRUE(SameBytes(dd.Read<uint8_t>(n * esz), wantDense)) << "scatter differs";
}

TEST(CudaGather, GatherAndScatterMatchCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (size_t esz : {1, 2, 4, 8}) {
    for (size_t n : {1, 3, 4097, 100003}) {
      for (size_t k : {size_t{0}, size_t{1}, n / 7, n}) {
        GatherCase(rng, n, k, esz, true);
        GatherCase(rng, n, k, esz, false);
      }
    }
  }
  // Larger than one pass of the grid's first iteration, at the densities of a masked step.
  const size_t big = (size_t{1} << 22) + 5;
  for (double density : {0.01, 0.1, 1.0}) {
    GatherCase(rng, big, static_cast<size_t>(density * big), 4, true);
  }
  GatherCase(rng, big, big / 3, 2, false);
}

// The host checks need no device: nothing is launched.
TEST(CudaGather, BadArgumentsAreRejectedOnTheHost) {
  uint64_t idx[1] = {0};
  char buf[16] = {};
  EXPECT_EQ(kc::GatherByIndexCuda(buf, idx, 1, 3, buf, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(kc::ScatterByIndexCuda(buf, idx, 1, 16, buf, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(kc::GatherByIndexCuda(nullptr, idx, 1, 4, buf, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(kc::ScatterByIndexCuda(buf, nullptr, 1, 4, buf, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(kc::GatherByIndexCuda(nullptr, nullptr, 0, 8, nullptr, nullptr), KernelStatus::kOk);
  EXPECT_EQ(kc::ScatterByIndexCuda(nullptr, nullptr, 0, 1, nullptr, nullptr), KernelStatus::kOk);
}

// ---- the CUDA device runtime's kernel ops (plugin/device/runtime_cuda.cc) -----------------------
// The same ops the library calls: the top-k's host table uploaded per call, stream-ordered
// temporaries, and the host-side argument checks.
TEST(CudaRuntimeOps, MatchCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  device::Runtime* rt = device::CudaRuntime();
  ASSERT_TRUE(rt != nullptr && rt->Available());
  void* probe = nullptr;
  ASSERT_TRUE(rt->DeviceAlloc(0, &probe).ok());
  EXPECT_EQ(rt->Kind(probe), device::PtrKind::kDevice);
  rt->DeviceFree(probe);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    // Top-k over odd segments (an empty one, k = 0, k = len).
    const std::vector<uint64_t> lens = {1, 0, 777, 100003, 33};
    std::vector<uint64_t> off = {3}, k(lens.size()), oo(lens.size() + 1);
    for (uint64_t l : lens) off.push_back(off.back() + l);
    ASSERT_EQ(TopkKFromDensity(off.data(), lens.size(), 0.01 * (round + 1), k.data()),
              KernelStatus::kOk);
    k[2] = 0;
    k[4] = lens[4];
    const uint64_t total = TopkOutOffsets(k.data(), k.size(), oo.data());
    std::vector<float> x = RandomNormal(rng, off.back());
    TopkSegments sg;
    sg.offsets = off.data();
    sg.k = k.data();
    sg.out_offsets = oo.data();
    sg.nseg = lens.size();
    std::vector<uint64_t> want(total), wantCounts(lens.size());
    ASSERT_EQ(TopkAbs(x.data(), sg, TopkOptions{}, want.data(), wantCounts.data()),
              KernelStatus::kOk);
    DevBuf dx(x), dout(total * 8), dc(lens.size() * 8);
    ASSERT_TRUE(rt->TopkAbs(dx.get<float>(), sg, TopkOptions{}, dout.get<uint64_t>(),
                            dc.get<uint64_t>(), nullptr)
                    .ok());
    // The gathered values of the selection, and a step's kernels at that mask.
    const size_t n = x.size(), kk = total;
    DevBuf dsel(kk * 4);
    ASSERT_TRUE(rt->Gather(dx.get(), dout.get<uint64_t>(), kk, 4, dsel.get(), nullptr).ok());
    std::vector<float> m = RandomNormal(rng, n), g = RandomNormal(rng, n),
                       e = RandomNormal(rng, n, 0.1f), theta = RandomNormal(rng, n);
    DevBuf dm(m), dg(g), de(e), dth(theta), dp(kk * 2), dnorm(8);
    std::vector<uint64_t> mask(want);
    std::sort(mask.begin(), mask.end());  // segments ascend: already sorted
    // The device optimizer step's form (the rounding error kept) for a bf16 payload.
    ASSERT_TRUE(rt->CandidatePackResidual(dm.get<float>(), dg.get<float>(), de.get<float>(), n,
                                          0.9f, dout.get<uint64_t>(), kk, scapeBfloat16, dp.get(),
                                          nullptr, nullptr)
                    .ok());
    ASSERT_TRUE(rt->RecoveredGradSqNorm(dp.get(), scapeBfloat16, dout.get<uint64_t>(), kk,
                                        dm.get<float>(), n, 0.9f, dnorm.get<double>(), nullptr)
                    .ok());
    AdamSParams ap;
    ap.clip_scale = 0.7f;
    ASSERT_TRUE(rt->UnpackAdamSUpdate(dp.get(), scapeBfloat16, dout.get<uint64_t>(), kk,
                                      dth.get<float>(), dm.get<float>(), n, ap, nullptr)
                    .ok());
    ASSERT_TRUE(rt->StreamSynchronize(nullptr).ok());
    EXPECT_EQ(dout.Read<uint64_t>(total), want);
    EXPECT_EQ(dc.Read<uint64_t>(lens.size()), wantCounts);
    std::vector<float> sel(kk);
    GatherByIndex(x.data(), want.data(), kk, 4, sel.data());
    EXPECT_TRUE(SameBytes(dsel.Read<float>(kk), sel));
    std::vector<float> eC = e, mC = m, thC = theta;
    std::vector<uint8_t> pC(kk * 2);
    ASSERT_EQ(CandidatePackResidual(m.data(), g.data(), eC.data(), n, 0.9f, mask.data(), kk,
                                    scapeBfloat16, pC.data(), nullptr, 0, /*keep_rounding=*/true),
              KernelStatus::kOk);
    double normC = -1;
    ASSERT_EQ(
        RecoveredGradSqNorm(pC.data(), scapeBfloat16, mask.data(), kk, m.data(), n, 0.9f, &normC),
        KernelStatus::kOk);
    ASSERT_EQ(
        UnpackAdamSUpdate(pC.data(), scapeBfloat16, mask.data(), kk, thC.data(), mC.data(), n, ap),
        KernelStatus::kOk);
    EXPECT_TRUE(SameBytes(de.Read<float>(n), eC));
    EXPECT_TRUE(SameBytes(dp.Read<uint8_t>(kk * 2), pC));
    const double normG = dnorm.Read<double>(1)[0];
    EXPECT_EQ(std::memcmp(&normG, &normC, 8), 0) << normG << " vs " << normC;
    EXPECT_TRUE(SameBytes(dth.Read<float>(n), thC));
    EXPECT_TRUE(SameBytes(dm.Read<float>(n), mC));
  }
  // Host-checked arguments: errors at the call, naming the op.
  std::vector<uint64_t> off = {0, 10, 5}, k = {1, 1}, oo = {0, 1, 2};
  TopkSegments bad;
  bad.offsets = off.data();
  bad.k = k.data();
  bad.out_offsets = oo.data();
  bad.nseg = 2;
  DevBuf dx(64), dout(16), dc(16);
  Status st = rt->TopkAbs(dx.get<float>(), bad, TopkOptions{}, dout.get<uint64_t>(),
                          dc.get<uint64_t>(), nullptr);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("top-k"), std::string::npos) << st.message();
  st = rt->Gather(dx.get(), dout.get<uint64_t>(), 2, 3, dc.get(), nullptr);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("gather"), std::string::npos) << st.message();
  EXPECT_EQ(
      rt->CandidatePackResidual(dx.get<float>(), dx.get<float>(), dx.get<float>(), 4, 0.9f,
                                dout.get<uint64_t>(), 5, scapeFloat32, dc.get(), nullptr, nullptr)
          .code(),
      scapeInvalidArgument);
  EXPECT_EQ(rt->RecoveredGradSqNorm(dc.get(), scapeInt32, dout.get<uint64_t>(), 1, dx.get<float>(),
                                    4, 0.9f, dc.get<double>(), nullptr)
                .code(),
            scapeUnsupported);
  EXPECT_TRUE(rt->StreamSynchronize(nullptr).ok());
}

// The sharded step's halves through the CUDA runtime (AdamSUpdatePairs, UnpackPairsDecay):
// the CPU kernels' bits (AdamSUpdatePairs; UnpackPairsDecayView at a one-run view), entries in
// any order for the pairs, with and without "segment_rms" (the host table uploaded per call)
// and the 16-bit copy, full vectorised tiles, an unaligned theta (the scalar path), wd 0 and > 0.
void PairsCase(std::mt19937_64& rng, device::Runtime* rt, size_t n, double density,
               scapeDataType_t type, float wd, bool enter, int copy /*0 none, 1 bf16, 2 fp16*/,
               bool shuffle, size_t theta_shift) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " density=" << density << " type=" << type
                                    << " wd=" << wd << " enter=" << enter << " copy=" << copy
                                    << " shuffle=" << shuffle << " theta_shift=" << theta_shift);
  const scapeDataType_t ctype = copy == 2 ? scapeFloat16 : scapeBfloat16;
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  for (size_t i = 0; i < n; i += 3) m[i] = 0.0f;  // entering coordinates
  std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, density);
  const size_t k = mask.size(), esz = PayloadElementSize(type);
  std::vector<float> pf = RandomNormal(rng, k, 0.01f);
  std::vector<uint8_t> payload(k * esz);
  for (size_t j = 0; j < k; ++j) {
    if (type == scapeFloat32) {
      std::memcpy(payload.data() + 4 * j, &pf[j], 4);
    } else {
      const uint16_t h = type == scapeBfloat16 ? FloatToBf16(pf[j]) : FloatToFp16(pf[j]);
      std::memcpy(payload.data() + 2 * j, &h, 2);
    }
  }
  AdamSParams p;
  p.weight_decay = wd;
  p.clip_scale = 0.8f;
  const std::vector<uint64_t> eoff = {0, n / 4, n / 4, n};
  const std::vector<float> evs = {2.5e-5f, 1.0f, -1.0f};
  if (enter) {
    p.enter_offsets = eoff.data();
    p.enter_vs = evs.data();
    p.enter_nseg = evs.size();
  }
  // CPU: the pairs at the sorted mask, then the unpack of pairs made up at random.
  std::vector<float> pairs_cpu(2 * k);
  ASSERT_EQ(AdamSUpdatePairs(payload.data(), type, mask.data(), k, theta.data(), m.data(), n, p,
                             pairs_cpu.data()),
            KernelStatus::kOk);
  std::vector<float> in_pairs = RandomNormal(rng, 2 * k);
  std::vector<float> theta_cpu = theta, m_cpu = m;
  std::vector<uint16_t> copy0(n, 0x7fc1), copy_cpu = copy0;
  MaskRun run{0, n, 0, k, 0};
  MaskView view;
  view.idx = mask.data();
  view.k = k;
  view.runs = &run;
  view.nruns = 1;
  ModelCopy c;
  c.p = copy_cpu.data();
  c.type = ctype;
  ASSERT_EQ(UnpackPairsDecayView(in_pairs.data(), view, theta_cpu.data(), m_cpu.data(), n, p, 0,
                                 false, copy ? &c : nullptr),
            KernelStatus::kOk);
  // The pairs' entries in a random order (position with its payload value).
  std::vector<uint64_t> idx = mask;
  std::vector<uint8_t> pay = payload;
  std::vector<float> pairs_want = pairs_cpu;
  if (shuffle) {
    std::vector<size_t> perm(k);
    std::iota(perm.begin(), perm.end(), size_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t j = 0; j < k; ++j) {
      idx[j] = mask[perm[j]];
      std::memcpy(pay.data() + j * esz, payload.data() + perm[j] * esz, esz);
      pairs_want[2 * j] = pairs_cpu[2 * perm[j]];
      pairs_want[2 * j + 1] = pairs_cpu[2 * perm[j] + 1];
    }
  }
  // GPU, through the runtime (theta at an offset of theta_shift floats).
  std::vector<float> theta_buf(theta_shift, 0.0f);
  theta_buf.insert(theta_buf.end(), theta.begin(), theta.end());
  DevBuf dtheta(theta_buf), dm(m), didx(idx), dmask(mask), dp(pay), dpairs(2 * k * 4),
      din(in_pairs), dcopy(copy0);
  float* th = dtheta.get<float>() + theta_shift;
  ASSERT_TRUE(rt->AdamSUpdatePairs(dp.get(), type, didx.get<uint64_t>(), k, th, dm.get<float>(), n,
                                   p, dpairs.get<float>(), nullptr)
                  .ok());
  ASSERT_TRUE(rt->StreamSynchronize(nullptr).ok());
  EXPECT_TRUE(SameBytes(dpairs.Read<float>(2 * k), pairs_want)) << "pairs differ";
  std::vector<float> theta_gpu = dtheta.Read<float>(theta_shift + n);
  theta_gpu.erase(theta_gpu.begin(), theta_gpu.begin() + theta_shift);
  EXPECT_TRUE(SameBytes(theta_gpu, theta)) << "theta was written";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m)) << "m was written";
  ASSERT_TRUE(rt->UnpackPairsDecay(din.get<float>(), dmask.get<uint64_t>(), k, th, dm.get<float>(),
                                   n, p, copy ? dcopy.get() : nullptr, ctype, nullptr)
                  .ok());
  ASSERT_TRUE(rt->StreamSynchronize(nullptr).ok());
  theta_gpu = dtheta.Read<float>(theta_shift + n);
  theta_gpu.erase(theta_gpu.begin(), theta_gpu.begin() + theta_shift);
  EXPECT_TRUE(SameBytes(theta_gpu, theta_cpu)) << "unpacked theta differs";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m_cpu)) << "unpacked m differs";
  EXPECT_TRUE(SameBytes(dcopy.Read<uint16_t>(n), copy_cpu)) << "16-bit copy differs";
}

TEST(CudaRuntimeOps, PairsMatchCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  device::Runtime* rt = device::CudaRuntime();
  ASSERT_TRUE(rt != nullptr && rt->Available());
  for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{4097}, size_t{100003}})
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16})
      for (float wd : {0.0f, 0.1f}) {
        PairsCase(rng, rt, n, 0.05, t, wd, false, 0, false, 0);
        PairsCase(rng, rt, n, 1.0, t, wd, true, 1, true, 0);
        PairsCase(rng, rt, n, 0.3, t, wd, true, 2, true, 1);
        PairsCase(rng, rt, n, 0.0, t, wd, false, 2, false, 0);
      }
  PairsCase(rng, rt, (size_t{1} << 22) + 5, 0.01, scapeBfloat16, 0.1f, true, 1, true, 0);
  // Host-checked arguments: errors at the call, naming the op.
  DevBuf d(256);
  AdamSParams p;
  Status st = rt->AdamSUpdatePairs(d.get(), scapeInt32, d.get<uint64_t>(), 1, d.get<float>(),
                                   d.get<float>(), 4, p, d.get<float>(), nullptr);
  EXPECT_EQ(st.code(), scapeUnsupported);
  EXPECT_NE(st.message().find("pairs"), std::string::npos) << st.message();
  EXPECT_EQ(rt->AdamSUpdatePairs(d.get(), scapeFloat32, d.get<uint64_t>(), 5, d.get<float>(),
                                 d.get<float>(), 4, p, d.get<float>(), nullptr)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt->AdamSUpdatePairs(d.get(), scapeFloat32, nullptr, 1, d.get<float>(), d.get<float>(),
                                 4, p, d.get<float>(), nullptr)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt->UnpackPairsDecay(d.get<float>(), d.get<uint64_t>(), 5, d.get<float>(),
                                 d.get<float>(), 4, p, nullptr, scapeFloat32, nullptr)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt->UnpackPairsDecay(nullptr, d.get<uint64_t>(), 1, d.get<float>(), d.get<float>(), 4,
                                 p, nullptr, scapeFloat32, nullptr)
                .code(),
            scapeInvalidArgument);
  EXPECT_EQ(rt->UnpackPairsDecay(d.get<float>(), d.get<uint64_t>(), 1, d.get<float>(),
                                 d.get<float>(), 4, p, d.get(), scapeFloat32, nullptr)
                .code(),
            scapeUnsupported);
  EXPECT_TRUE(rt->StreamSynchronize(nullptr).ok());
}

// UnpackAdamSUpdateCopy through the CUDA runtime with a "segment_rms" table: the runtime uploads
// the host table (it passed the host pointers to the kernel before), the CPU kernel's bits.
TEST(CudaRuntimeOps, UpdateCopyWithEnterTableMatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  device::Runtime* rt = device::CudaRuntime();
  ASSERT_TRUE(rt != nullptr && rt->Available());
  const size_t n = 100003;
  std::vector<float> theta = RandomNormal(rng, n), m = RandomNormal(rng, n, 0.01f);
  for (size_t i = 0; i < n; i += 3) m[i] = 0.0f;
  std::vector<uint64_t> mask = RandomMask<uint64_t>(rng, n, 0.2);
  const size_t k = mask.size();
  std::vector<float> payload = RandomNormal(rng, k, 0.01f);
  AdamSParams p;
  const std::vector<uint64_t> eoff = {0, n / 3, n};
  const std::vector<float> evs = {2.5e-5f, 4.0f};
  p.enter_offsets = eoff.data();
  p.enter_vs = evs.data();
  p.enter_nseg = evs.size();
  std::vector<float> theta_cpu = theta, m_cpu = m;
  std::vector<uint16_t> copy_cpu(n, 0x7fc1), copy0(n, 0x7fc1);
  ModelCopy c;
  c.p = copy_cpu.data();
  c.type = scapeBfloat16;
  ASSERT_EQ(UnpackAdamSUpdate(payload.data(), scapeFloat32, mask.data(), k, theta_cpu.data(),
                              m_cpu.data(), n, p, 0, &c),
            KernelStatus::kOk);
  DevBuf dtheta(theta), dm(m), dmask(mask), dp(payload), dcopy(copy0);
  ASSERT_TRUE(rt->UnpackAdamSUpdateCopy(dp.get(), scapeFloat32, dmask.get<uint64_t>(), k,
                                        dtheta.get<float>(), dm.get<float>(), n, p, dcopy.get(),
                                        scapeBfloat16, nullptr)
                  .ok());
  ASSERT_TRUE(rt->StreamSynchronize(nullptr).ok());
  EXPECT_TRUE(SameBytes(dtheta.Read<float>(n), theta_cpu)) << "theta differs";
  EXPECT_TRUE(SameBytes(dm.Read<float>(n), m_cpu)) << "m differs";
  EXPECT_TRUE(SameBytes(dcopy.Read<uint16_t>(n), copy_cpu)) << "16-bit copy differs";
}

// Issue 33: the 8-bit payloads' kernels (kernels/cuda/scaled.cu) against the CPU ones
// (kernels/cpu/scaled.h): the amax, the codes, the residual at scattered positions and the
// values read back, bit for bit, both formats, odd sizes, 1 and 3 ranks' scales.
TEST(CudaScaledPayload, MatchesCpu) {
  SKIP_WITHOUT_GPU();
  SCAPE_SEEDED_RNG(rng);
  for (scapeDataType_t t : {scapeFloat8E4M3, scapeFloat8E5M2}) {
    for (size_t k : {size_t{1}, size_t{1000}, size_t{70001}}) {
      for (int P : {1, 3}) {
        std::vector<float> x = RandomNormal(rng, k, 1e-3f);
        x[k / 2] = std::numeric_limits<float>::quiet_NaN();  // skipped by the amax
        if (k > 2) x[1] = 1e-30f;                            // far below the smallest subnormal
        std::vector<uint64_t> pos(k);
        for (size_t j = 0; j < k; ++j) pos[j] = 2 * j + 1;
        std::vector<float> res(2 * k + 1, 7.0f);
        float amax = 0.0f;
        ASSERT_EQ(PayloadAmax(x.data(), k, &amax), KernelStatus::kOk);
        std::vector<uint8_t> q(k);
        ASSERT_EQ(QuantizeScaled(x.data(), k, t, amax, P, q.data(), pos.data(), res.data()),
                  KernelStatus::kOk);
        std::vector<float> back(k);
        ASSERT_EQ(DequantizeScaled(q.data(), k, t, amax, P, back.data()), KernelStatus::kOk);

        DevBuf dx(x), dpos(pos), dres(std::vector<float>(2 * k + 1, 7.0f)), damax(4), dq(k),
            dback(4 * k);
        ASSERT_TRUE(dx.ok() && dpos.ok() && dres.ok() && damax.ok() && dq.ok() && dback.ok());
        CUDA_OK(kc::PayloadAmaxCuda(dx.get<float>(), k, damax.get<float>(), nullptr));
        CUDA_OK(kc::QuantizeScaledCuda(dx.get<float>(), k, t, damax.get<float>(), P, dq.get(),
                                       dpos.get<uint64_t>(), dres.get<float>(), nullptr));
        CUDA_OK(kc::DequantizeScaledCuda(dq.get(), k, t, damax.get<float>(), P, dback.get<float>(),
                                         nullptr));
        CUDA_OK(kc::StreamSynchronize(nullptr));
        EXPECT_TRUE(SameBytes(damax.Read<float>(1), std::vector<float>{amax}));
        EXPECT_TRUE(SameBytes(dq.Read<uint8_t>(k), q)) << "type " << t << " k " << k;
        EXPECT_TRUE(SameBytes(dres.Read<float>(2 * k + 1), res)) << "type " << t << " k " << k;
        EXPECT_TRUE(SameBytes(dback.Read<float>(k), back)) << "type " << t << " k " << k;
      }
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace scape
