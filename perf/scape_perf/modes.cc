// scape-perf: the list of modes (see mode.h for how to add one).
#include <cstring>

#include "perf/scape_perf/mode.h"

namespace scape_perf {

const ModeDesc* const kModes[] = {
    &kModeDense, &kModeMask, &kModeMaskPacked, &kModeCoo, &kModeMaskSync, &kModeMemcpy, &kModeStep,
};
const size_t kModeCount = sizeof(kModes) / sizeof(kModes[0]);

const ModeDesc* findMode(const char* s) {
  for (const ModeDesc* m : kModes) {
    if (std::strcmp(s, m->name) == 0) return m;
    for (const char* const* a = m->aliases; a != nullptr && *a != nullptr; ++a)
      if (std::strcmp(s, *a) == 0) return m;
  }
  return nullptr;
}

}  // namespace scape_perf
