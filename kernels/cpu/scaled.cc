#include "kernels/cpu/scaled.h"

#include <cmath>

#include "kernels/dtypes.h"

namespace scape {
namespace kernels {
KernelStatus PayloadAmax(const float* x, size_t k, float* amax) {
  if (!amax || (k > 0 && !x)) return KernelStatus::kInvalidArgument;
  float m = 0.0f;
  for (size_t j = 0; j < k; ++j) m = std::fmax(m, std::fabs(x[j]));
  *amax = m;
  return KernelStatus::kOk;
}

KernelStatus QuantizeScaled(const float* x, size_t k, scapeDataType_t type, float amax, int nranks,
                            void* q, const uint64_t* pos, float* residual) {
  if (!dtypes::IsScaled(type)) return KernelStatus::kUnsupported;
  if (nranks < 1 || (k > 0 && (!x || !q || (residual && !pos))))
    return KernelStatus::kInvalidArgument;
  const int e = dtypes::ScaleExponent(amax, nranks, dtypes::Row(type)->maxFinite);
  dtypes::VisitFloat(type, [&](auto tr) {
    using T = decltype(tr);
    auto* out = static_cast<typename T::Storage*>(q);
    for (size_t j = 0; j < k; ++j) {
      out[j] = T::Store(std::ldexp(x[j], -e));
      if (residual) {
        const float back = std::ldexp(T::Load(out[j]), e);
        const float err = x[j] - back;
        residual[pos[j]] = std::isfinite(err) ? err : 0.0f;
      }
    }
  });
  return KernelStatus::kOk;
}

KernelStatus DequantizeScaled(const void* q, size_t k, scapeDataType_t type, float amax, int nranks,
                              float* out) {
  if (!dtypes::IsScaled(type)) return KernelStatus::kUnsupported;
  if (nranks < 1 || (k > 0 && (!q || !out))) return KernelStatus::kInvalidArgument;
  const int e = dtypes::ScaleExponent(amax, nranks, dtypes::Row(type)->maxFinite);
  dtypes::VisitFloat(type, [&](auto tr) {
    using T = decltype(tr);
    const auto* in = static_cast<const typename T::Storage*>(q);
    for (size_t j = 0; j < k; ++j) out[j] = std::ldexp(T::Load(in[j]), e);
  });
  return KernelStatus::kOk;
}

}  // namespace kernels
}  // namespace scape
