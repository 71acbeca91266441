// libFuzzer target: decoding a scapeUniqueId (128 bytes copied by the caller from anywhere).
// A decoded id must re-encode to an id that decodes to the same root.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "transport/bootstrap/bootstrap.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  scapeUniqueId id;
  std::memset(&id, 0, sizeof(id));
  std::memcpy(id.internal, data, size < sizeof(id) ? size : sizeof(id));
  scape::bootstrap::RootAddress root;
  if (!scape::bootstrap::DecodeUniqueId(id, &root).ok()) return 0;
  (void)root.addr.ToString();
  scapeUniqueId again;
  scape::bootstrap::EncodeUniqueId(root, &again);
  scape::bootstrap::RootAddress root2;
  if (!scape::bootstrap::DecodeUniqueId(again, &root2).ok()) std::abort();
  if (root2.addr.port() != root.addr.port() || root2.secret != root.secret) std::abort();
  return 0;
}
