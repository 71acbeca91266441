// libFuzzer target: a rank's reader of the bootstrap root's answer (status, message, table of
// nranks address blobs), as a malicious or broken root could send it. The first byte picks
// nranks (1..64), the second the piece size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "transport/bootstrap/bootstrap.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int nranks = 1 + data[0] % 64;
  const uint8_t step = data[1];
  data += 2;
  size -= 2;
  scape::bootstrap::ReplyReader rd(nranks);
  size_t off = 0;
  while (off < size && !rd.complete()) {
    size_t piece = step ? std::min<size_t>(step, size - off) : size - off;
    size_t used = 0;
    scape::Status st = rd.Feed(data + off, piece, &used);
    if (used > piece) std::abort();
    off += used;
    if (!st.ok()) return 0;
    if (used == 0 && !rd.complete()) std::abort();
  }
  if (rd.complete() && rd.verdict().ok()) {
    if (rd.table().size() != static_cast<size_t>(nranks)) std::abort();
    for (const auto& e : rd.table())
      if (e.blob.empty() || e.blob.size() > scape::bootstrap::kMaxBlobBytes) std::abort();
  }
  return 0;
}
