// libFuzzer target: every mask decoder (kernels/cpu/mask_codec.h) on a part received from a
// peer: header, then bitmap, 32-bit indices, Elias-Fano and delta-varint bodies, decoded into
// 32-bit and 64-bit outputs and with a global offset, as the mask sync does. The first 4 bytes
// choose the expected owned size n and the output capacity. A successful decode must give
// strictly increasing indices below n.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/mask_codec.h"
#include "plugin/api/api_internal.h"

using scape::kernels::KernelStatus;

namespace {
// The library's own part decoder (plugin/mask: the 32-bit index encoding it adds, and the
// codecs above behind its size checks), on a mask of one rank over a layout of 1000 elements.
scapeComm_t g_comm = nullptr;
scapeMask_t g_mask = nullptr;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("SCAPE_SOCKET_IFNAME", "lo", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  scapeUniqueId id;
  if (scapeGetUniqueId(&id) != scapeSuccess) std::abort();
  if (scapeCommInitRank(&g_comm, 1, id, 0) != scapeSuccess) std::abort();
  static const uint64_t offs[] = {0, 10, 500, 1000};
  static const uint8_t dense[] = {1, 0, 0};
  if (scapeMaskCreate(&g_mask, 1000, 3, offs, dense, scapeOwnershipSegments, scapeMaskEncodingAuto,
                      g_comm) != scapeSuccess)
    std::abort();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint32_t nRaw;
  std::memcpy(&nRaw, data, 4);
  data += 4;
  size -= 4;
  {
    std::vector<uint64_t> pos;
    if (g_mask->impl->DecodePart(0, data, size, &pos).ok())
      for (size_t i = 0; i < pos.size(); ++i)
        if (pos[i] >= 1000 || (i && pos[i] <= pos[i - 1])) std::abort();
  }
  scape::kernels::MaskHeader h;
  if (scape::kernels::MaskReadHeader(data, size, &h) != KernelStatus::kOk) return 0;
  // The universe the receiver expects: the header's own n when small (so that the bodies are
  // reached), else one from the input (a mismatch the decoder must refuse). Bounded, so that
  // an execution stays cheap.
  constexpr uint64_t kMaxN = uint64_t{1} << 18;
  const uint64_t n = h.n <= kMaxN && (nRaw & 1) ? h.n : (nRaw >> 1) % kMaxN;
  const size_t cap = static_cast<size_t>(h.k < kMaxN ? h.k : kMaxN) + (nRaw >> 28);
  // Output buffers of the largest capacity, allocated once (zeroing megabytes per input would
  // cost more than the decoding).
  static std::vector<uint32_t> o32((kMaxN << 1) + 16);
  static std::vector<uint64_t> o64((kMaxN << 1) + 16);
  size_t got = 0;
  if (scape::kernels::MaskDecode(data, size, n, o32.data(), cap, &got) == KernelStatus::kOk) {
    if (got > cap) std::abort();
    for (size_t i = 0; i < got; ++i)
      if (o32[i] >= n || (i && o32[i] <= o32[i - 1])) std::abort();
  }
  got = 0;
  if (scape::kernels::MaskDecode(data, size, n, o64.data(), cap, &got) == KernelStatus::kOk) {
    if (got > cap) std::abort();
    for (size_t i = 0; i < got; ++i)
      if (o64[i] >= n || (i && o64[i] <= o64[i - 1])) std::abort();
  }
  got = 0;
  const uint64_t off = uint64_t{1} << 33;
  if (scape::kernels::MaskDecode(data, size, n, off, o64.data(), cap, &got) == KernelStatus::kOk) {
    if (got > cap) std::abort();
    for (size_t i = 0; i < got; ++i)
      if (o64[i] < off || o64[i] >= off + n || (i && o64[i] <= o64[i - 1])) std::abort();
  }
  // The raw bitmap decoder on the bytes as words.
  const size_t nwords = static_cast<size_t>(scape::kernels::BitmapWords(n));
  if (n > 0 && size / 8 >= nwords) {
    static std::vector<uint64_t> words;
    words.resize(nwords);
    std::memcpy(words.data(), data, nwords * 8);
    uint64_t k = 0;
    if (scape::kernels::BitmapCount(words.data(), nwords, n, &k) == KernelStatus::kOk && k <= cap) {
      got = 0;
      if (scape::kernels::BitmapToIndices(words.data(), nwords, n, o32.data(), cap, &got) !=
              KernelStatus::kOk ||
          got != k)
        std::abort();
    }
  }
  return 0;
}
