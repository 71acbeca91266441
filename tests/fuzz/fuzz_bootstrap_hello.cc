// libFuzzer target: the bootstrap root's reader of an incoming connection (hello + address
// blob), fed the input in pieces whose sizes come from the input itself, as a hostile client
// on the root's port could send it. Nothing may crash, leak or read out of bounds; a complete
// hello must carry the right secret and a blob of the announced size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "transport/bootstrap/bootstrap.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  scape::bootstrap::Secret secret{};
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(0xa5 ^ i);
  if (size < 1) return 0;
  const uint8_t step = data[0];  // piece size (0: all at once)
  ++data;
  --size;
  scape::bootstrap::HelloReader rd;
  size_t off = 0;
  while (off < size && !rd.complete()) {
    size_t piece = step ? std::min<size_t>(step, size - off) : size - off;
    size_t used = 0;
    bool refuse = false;
    scape::Status st = rd.Feed(data + off, piece, secret, &used, &refuse);
    if (used > piece) std::abort();
    off += used;
    if (!st.ok()) return 0;
    if (used == 0 && !rd.complete()) std::abort();  // no progress on non-empty input
  }
  if (rd.complete()) {
    if (!rd.authenticated()) std::abort();
    if (std::memcmp(rd.hello().secret, secret.data(), 16) != 0) std::abort();
    if (rd.blob().size() != rd.hello().blobLen || rd.blob().empty() ||
        rd.blob().size() > scape::bootstrap::kMaxBlobBytes)
      std::abort();
  }
  return 0;
}
