// Contract: the error code every kernel in kernels/ (CPU and CUDA host wrappers) returns.
//
// Kernels never throw and never abort on bad input. Argument errors are detected before any
// output is written unless a function's contract says otherwise. The communicator maps a
// KernelStatus to a scape::Status / scapeResult_t at its boundary (ToResult below).
#ifndef SCAPE_KERNELS_CPU_KERNEL_STATUS_H_
#define SCAPE_KERNELS_CPU_KERNEL_STATUS_H_

#include <string>

#include "base/status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {

// [[nodiscard]]: a kernel's result must be looked at (it is the only way a kernel reports an
// error). Every kernel in kernels/ that can fail returns this type; ones that cannot fail
// (conversions, gathers of validated indices) return nothing, and predicates (MaskIsValid)
// return bool.
enum class [[nodiscard]] KernelStatus : int{
    kOk = 0,
    kInvalidArgument = 1,  // null pointer with a non-zero count, bad size/parameter, unsorted mask
    kBufferTooSmall = 2,   // an output or temp-storage capacity is smaller than required
    kTruncated = 3,        // an encoded input ends before its header says it should
    kCorrupt = 4,          // an encoded input fails validation (header, range, order, padding)
    kOutOfMemory = 5,      // a CPU workspace allocation failed
    kCudaError = 6,        // a CUDA launch or runtime call failed (see cudaGetLastError)
    kUnsupported = 7,      // a data type / mode this kernel does not implement
};

// The names, one per enumerator in the enum's order (the value is the index).
constexpr const char* kKernelStatusNames[] = {
    "ok",
    "invalid argument",
    "buffer too small",
    "truncated input",
    "corrupt input",
    "out of memory",
    "CUDA error",
    "unsupported",
};
static_assert(sizeof(kKernelStatusNames) / sizeof(kKernelStatusNames[0]) ==
                  static_cast<size_t>(KernelStatus::kUnsupported) + 1,
              "one name per KernelStatus");

inline const char* KernelStatusString(KernelStatus s) {
  const auto i = static_cast<size_t>(s);
  return i <= static_cast<size_t>(KernelStatus::kUnsupported) ? kKernelStatusNames[i]
                                                              : "unknown kernel status";
}

// One mapping to the public result codes.
inline scapeResult_t ToResult(KernelStatus s) {
  switch (s) {
    case KernelStatus::kOk:
      return scapeSuccess;
    case KernelStatus::kInvalidArgument:
    case KernelStatus::kBufferTooSmall:
      return scapeInvalidArgument;
    case KernelStatus::kTruncated:
    case KernelStatus::kCorrupt:
      return scapeRemoteError;  // encoded data comes from peers
    case KernelStatus::kUnsupported:
      return scapeUnsupported;
    case KernelStatus::kOutOfMemory:
    case KernelStatus::kCudaError:
      return scapeSystemError;
  }
  return scapeInternalError;
}

// The Status a caller above kernels/ returns for a kernel result: ok, or ToResult's code with
// "<what>: <reason>".
inline Status ToStatus(KernelStatus s, const std::string& what) {
  if (s == KernelStatus::kOk) return Status::Ok();
  return Status(ToResult(s), what + ": " + KernelStatusString(s));
}

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_KERNEL_STATUS_H_
