// Helpers shared by the optimizer's source files (optim.cc, optim_checkpoint.cc,
// optim_device.cc). Internal.
#ifndef SCAPE_PLUGIN_OPTIM_OPTIM_INTERNAL_H_
#define SCAPE_PLUGIN_OPTIM_OPTIM_INTERNAL_H_

#include <cstdint>

namespace scape {
namespace optim_internal {

// FNV-1a over the 8 bytes of v (the configuration and layout fingerprints).
inline uint64_t Fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace optim_internal
}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_OPTIM_INTERNAL_H_
