// CPU implementation of kernels/cpu/scape_step.h. Built with -ffp-contract=off (see
// kernels/CMakeLists.txt): the bit-exact agreement with the CUDA kernels depends on it.
#include "kernels/cpu/scape_step.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <new>
#include <utility>
#include <vector>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scape_step_impl.h"

namespace scape {
namespace kernels {

using namespace step_impl;  // NOLINT: this file is its implementation

double BlockedSum(double* v, size_t count) { return BlockedReduce(v, count); }

size_t StayingBlockBounds(uint64_t jb, uint64_t je, uint64_t* out) {
  size_t nb = 0;
  for (uint64_t lo = jb; lo < je; lo += kSqNormBlock)
    out[nb++] = std::min<uint64_t>(je, lo + kSqNormBlock);
  return nb;
}

float SegmentEnterVs(double sum, uint64_t count) {
  if (count == 0) return -1.0f;
  const float vs = static_cast<float>(sum / static_cast<double>(count));
  return (vs > 0.0f && vs <= FLT_MAX) ? vs : -1.0f;
}

KernelStatus StayingGradSqBlocks(const void* payload, scapeDataType_t type, const uint64_t* idx,
                                 const float* m, size_t n, float beta1, const uint64_t* bounds,
                                 size_t nb, double* sums, uint64_t* counts, int max_threads) {
  const KernelStatus st = CheckStayingBlocks(type, beta1, bounds, nb, sums, counts);
  if (st != KernelStatus::kOk || nb == 0) return st;
  const uint64_t j0 = bounds[0], j1 = bounds[nb];
  if (j1 > j0 && (payload == nullptr || idx == nullptr || m == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  for (uint64_t j = j0; j < j1; ++j)
    if (idx[j] >= n) return KernelStatus::kInvalidArgument;
  return StayingCore(
      payload, type, [&](uint64_t j) { return m[idx[j]]; }, beta1, bounds, nb, sums, counts,
      max_threads);
}

KernelStatus StayingGradSqBlocksPacked(const void* payload, scapeDataType_t type, const float* m,
                                       float beta1, const uint64_t* bounds, size_t nb, double* sums,
                                       uint64_t* counts, int max_threads) {
  const KernelStatus st = CheckStayingBlocks(type, beta1, bounds, nb, sums, counts);
  if (st != KernelStatus::kOk || nb == 0) return st;
  if (bounds[nb] > bounds[0] && (payload == nullptr || m == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  return StayingCore(payload, type, MAtSlot{m}, beta1, bounds, nb, sums, counts, max_threads);
}

KernelStatus RecoveredGradSqNormPacked(const void* payload, scapeDataType_t type, const float* m,
                                       size_t k, float beta1, double* sq_norm, int max_threads) {
  if (PayloadElementSize(type) == 0) return KernelStatus::kUnsupported;
  if (sq_norm == nullptr) return KernelStatus::kInvalidArgument;
  if (!(beta1 >= 0.0f && beta1 < 1.0f)) return KernelStatus::kInvalidArgument;
  if (k > 0 && (payload == nullptr || m == nullptr)) return KernelStatus::kInvalidArgument;
  return SqNormCore(payload, type, MAtSlot{m}, k, beta1, sq_norm, max_threads);
}

// The local gradient's squared norm: RecoveredGradSqNorm's core with beta1 = 0 and m = +0, whose
// recovered value (g - (0 * +0)) / 1 is g itself, exactly.
KernelStatus GradSqNorm(const void* g, scapeDataType_t type, size_t n, double* sq_norm,
                        int max_threads) {
  if (type != scapeFloat32 && type != scapeBfloat16 && type != scapeFloat16)
    return KernelStatus::kUnsupported;
  if (sq_norm == nullptr || (n > 0 && g == nullptr)) return KernelStatus::kInvalidArgument;
  struct MZero {
    float operator()(size_t) const { return 0.0f; }
  };
  return SqNormCore(g, type, MZero{}, n, 0.0f, sq_norm, max_threads);
}

size_t PayloadElementSize(scapeDataType_t type) {
  // The payload types the kernels take directly (kernels/dtypes.h; a scaled one is fp32 here).
  return dtypes::IsPayload(type) && !dtypes::IsScaled(type) ? dtypes::Size(type) : 0;
}

bool MaskIsValid(const uint32_t* mask, size_t k, size_t n) { return ValidMask(mask, k, n); }
bool MaskIsValid(const uint64_t* mask, size_t k, size_t n) { return ValidMask(mask, k, n); }

KernelStatus MakeAdamSScalars(const AdamSParams& p, AdamSScalars* out) {
  if (out == nullptr) return KernelStatus::kInvalidArgument;
  const float fs[] = {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.clip_scale};
  for (float f : fs) {
    if (!std::isfinite(f)) return KernelStatus::kInvalidArgument;
  }
  if (!(p.beta1 >= 0.0f && p.beta1 < 1.0f) || !(p.beta2 >= 0.0f && p.beta2 < 1.0f)) {
    return KernelStatus::kInvalidArgument;
  }
  if (p.lr < 0.0f || p.eps < 0.0f || !(p.clip_scale > 0.0f)) {
    return KernelStatus::kInvalidArgument;
  }
  double bc1 = 1.0, bc2 = 1.0;
  switch (p.bias_correction) {
    case BiasCorrection::kNone:
      break;
    case BiasCorrection::kAdamSReference:
    case BiasCorrection::kScapeArtifact:
      if (p.step < 1) return KernelStatus::kInvalidArgument;
      bc1 = 1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step));
      bc2 = 1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step));
      if (!(bc1 > 0.0) || !(bc2 > 0.0)) return KernelStatus::kInvalidArgument;
      break;
    default:
      return KernelStatus::kInvalidArgument;
  }
  AdamSScalars s;
  s.b1 = p.beta1;
  s.omb1 = static_cast<float>(1.0 - static_cast<double>(p.beta1));
  s.b2 = p.beta2;
  s.omb2 = static_cast<float>(1.0 - static_cast<double>(p.beta2));
  s.eps = p.eps;
  s.lr = p.lr;
  s.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  s.clip = p.clip_scale;
  s.mscale = 1.0f;
  s.pscale = 1.0f;
  s.vscale = 1.0f;
  if (p.bias_correction == BiasCorrection::kAdamSReference) {
    s.mscale = static_cast<float>(1.0 / bc1);
    s.pscale = s.mscale;
  } else if (p.bias_correction == BiasCorrection::kScapeArtifact) {
    s.mscale = static_cast<float>(1.0 / bc1);
    s.vscale = static_cast<float>(1.0 / bc2);
  }
  s.rebuild_momentum = (p.clip_momentum && p.clip_scale != 1.0f) ? 1 : 0;
  if (!std::isfinite(s.mscale) || !std::isfinite(s.vscale) || !std::isfinite(s.decay)) {
    return KernelStatus::kInvalidArgument;
  }
  s.clip2 = s.clip * s.clip;
  s.cap_lr = s.lr * p.enter_cap;
  s.enter_mcap = p.enter_momentum_cap ? 1 : 0;
  if (p.enter_vs != nullptr &&
      !(std::isfinite(p.enter_cap) && p.enter_cap > 0.0f && std::isfinite(s.cap_lr))) {
    return KernelStatus::kInvalidArgument;
  }
  *out = s;
  return KernelStatus::kOk;
}

KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint32_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads, bool keep_rounding,
                                   float grad_scale) {
  return CandidateImpl(m, g, e, n, beta1, mask, k, payload_type, payload, c_out, max_threads,
                       keep_rounding, grad_scale);
}
KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint64_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads, bool keep_rounding,
                                   float grad_scale) {
  return CandidateImpl(m, g, e, n, beta1, mask, k, payload_type, payload, c_out, max_threads,
                       keep_rounding, grad_scale);
}

KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint32_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads, const ModelCopy* copy) {
  return UpdateImpl(payload, payload_type, mask, k, theta, m, n, params, max_threads, copy);
}
KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint64_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads, const ModelCopy* copy) {
  return UpdateImpl(payload, payload_type, mask, k, theta, m, n, params, max_threads, copy);
}

KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint32_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads) {
  return SqNormImpl(payload, payload_type, mask, k, m, n, beta1, sq_norm, max_threads);
}
KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint64_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads) {
  return SqNormImpl(payload, payload_type, mask, k, m, n, beta1, sq_norm, max_threads);
}
namespace {
// The dense baselines' scalars: params without bias correction or clipping.
KernelStatus DenseScalars(const AdamSParams& params, AdamSScalars* s) {
  AdamSParams p = params;
  p.bias_correction = BiasCorrection::kNone;
  p.clip_scale = 1.0f;
  return MakeAdamSScalars(p, s);
}
}  // namespace

KernelStatus DenseAdamSStep(const float* g, float* theta, float* m, size_t n,
                            const AdamSParams& params, int max_threads) {
  AdamSScalars s;
  KernelStatus st = DenseScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (g == nullptr || theta == nullptr || m == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const bool ok = ForChunks(n, max_threads, [&](size_t b, size_t end) {
    for (size_t i = b; i < end; ++i) {
      const float mp = m[i], gi = g[i];
      const float mn = (s.b1 * mp) + (s.omb1 * gi);
      const float v = (s.b2 * (mp * mp)) + (s.omb2 * (gi * gi));
      theta[i] = (theta[i] * s.decay) - ((s.lr * mn) / (std::sqrt(v) + s.eps));
      m[i] = mn;
    }
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

KernelStatus DenseAdamWStep(const float* g, float* theta, float* m, float* v, size_t n,
                            const AdamSParams& params, int max_threads) {
  AdamSScalars s;
  KernelStatus st = DenseScalars(params, &s);
  if (st != KernelStatus::kOk) return st;
  if (n > 0 && (g == nullptr || theta == nullptr || m == nullptr || v == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const bool ok = ForChunks(n, max_threads, [&](size_t b, size_t end) {
    for (size_t i = b; i < end; ++i) {
      const float gi = g[i];
      const float mn = (s.b1 * m[i]) + (s.omb1 * gi);
      const float vn = (s.b2 * v[i]) + (s.omb2 * (gi * gi));
      theta[i] = (theta[i] * s.decay) - ((s.lr * mn) / (std::sqrt(vn) + s.eps));
      m[i] = mn;
      v[i] = vn;
    }
  });
  return ok ? KernelStatus::kOk : KernelStatus::kOutOfMemory;
}

}  // namespace kernels
}  // namespace scape
