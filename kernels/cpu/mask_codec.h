// Contract: mask codecs (design brief sections 3 and 4): bitmap <-> sorted indices, and three
// self-describing encodings of a sorted index set for the mask all-gather, with exact size
// queries so a caller can send the smallest.
//
// A mask is a strictly increasing list of k indices in [0, n) (uint32_t or uint64_t; uint32_t
// outputs require n <= 2^32).
//
// Raw bitmap: ceil(n/64) uint64_t words; index i is bit (i % 64) of word i / 64 (on a
// little-endian machine this is the byte-wise LSB-first bitmap). Bits at positions >= n
// ("padding") are written as 0 and must be 0 on input.
//
// Encoded mask (a byte string, no alignment required, little-endian):
//   bytes 0..23: header
//     [0]      encoding: 1 = bitmap, 2 = Elias-Fano, 3 = delta + varint
//     [1]      parameter: Elias-Fano low-bit count l; 0 for the others
//     [2..7]   zero
//     [8..15]  n (uint64)
//     [16..23] k (uint64)
//   then the body:
//     bitmap:      the raw bitmap, ceil(n/64) words of 8 bytes.
//     Elias-Fano:  l = k == 0 ? 0 : floor(log2(n / k)) (this exact value is required);
//                  low part: bits [i*l, (i+1)*l) hold index_i mod 2^l, LSB-first, in
//                  ceil(k*l/64) words; high part: bit (index_i >> l) + i is set, in
//                  ceil(H/64) words, H = k == 0 ? 0 : k + ((n - 1) >> l) + 1.
//                  Size 24 + 8*(ceil(k*l/64) + ceil(H/64)) bytes: about k*(2 + log2(n/k)) bits.
//     delta+varint: k LEB128 varints (7 bits per byte, low groups first, 0x80 = more):
//                  index_0, then index_i - index_{i-1} - 1. Shortest form required.
//   Unused bits of the last word of every bit section must be 0.
// Every decoder validates everything before trusting it and never reads outside
// [buf, buf + size) or writes outside [out, out + capacity): bad header, n different from the
// expected n, k > n, sizes that do not match exactly, indices >= n, not strictly increasing,
// non-zero padding, overlong or overflowing varints. A byte string that decodes successfully
// is the unique encoding of its index set (re-encoding gives the same bytes).
// On error, *k_out is not written and out[0, capacity) may hold partial results.
//
// The CUDA versions of IndicesToBitmap, BitmapToIndices and the Elias-Fano codec live in
// kernels/cuda/scape_kernels.cuh and produce the same bytes / indices.
#ifndef SCAPE_KERNELS_CPU_MASK_CODEC_H_
#define SCAPE_KERNELS_CPU_MASK_CODEC_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"

namespace scape {
namespace kernels {

enum class MaskEncoding : uint8_t { kBitmap = 1, kEliasFano = 2, kDeltaVarint = 3 };

constexpr size_t kMaskHeaderBytes = 24;

// ---- raw bitmap -------------------------------------------------------------------------------

inline uint64_t BitmapWords(uint64_t n) { return (n + 63) / 64; }

// Writes all BitmapWords(n) words (nwords must be at least that: else kBufferTooSmall).
// kInvalidArgument: null pointers, indices not strictly increasing or >= n.
KernelStatus IndicesToBitmap(const uint32_t* idx, size_t k, uint64_t n, uint64_t* words,
                             size_t nwords);
KernelStatus IndicesToBitmap(const uint64_t* idx, size_t k, uint64_t n, uint64_t* words,
                             size_t nwords);

// Number of set bits. kCorrupt: non-zero padding; kInvalidArgument: nwords != BitmapWords(n).
KernelStatus BitmapCount(const uint64_t* words, size_t nwords, uint64_t n, uint64_t* k);

// Sorted indices of the set bits into out[0, capacity); *k_out = count.
// kBufferTooSmall if more than capacity bits are set (nothing beyond capacity is written);
// kCorrupt: non-zero padding; kInvalidArgument: nwords != BitmapWords(n), null pointers,
// uint32_t output with n > 2^32.
KernelStatus BitmapToIndices(const uint64_t* words, size_t nwords, uint64_t n, uint32_t* out,
                             size_t capacity, size_t* k_out);
KernelStatus BitmapToIndices(const uint64_t* words, size_t nwords, uint64_t n, uint64_t* out,
                             size_t capacity, size_t* k_out);

// ---- encoded masks ----------------------------------------------------------------------------

// Size queries. Bitmap and Elias-Fano depend only on (n, k); delta+varint needs the indices
// (they are not validated here; MaskEncode does). All are exact.
uint64_t BitmapEncodedBytes(uint64_t n);
uint64_t EliasFanoEncodedBytes(uint64_t n, uint64_t k);
uint64_t DeltaVarintEncodedBytes(const uint32_t* idx, size_t k);
uint64_t DeltaVarintEncodedBytes(const uint64_t* idx, size_t k);
// Elias-Fano's l for (n, k).
int EliasFanoLowBits(uint64_t n, uint64_t k);

// Exact encoded size of idx under `enc`; kInvalidArgument for an unknown encoding or k > n.
KernelStatus MaskEncodedBytes(MaskEncoding enc, const uint32_t* idx, size_t k, uint64_t n,
                              uint64_t* bytes);
KernelStatus MaskEncodedBytes(MaskEncoding enc, const uint64_t* idx, size_t k, uint64_t n,
                              uint64_t* bytes);

// The encoding with the fewest bytes for this mask (ties: bitmap, then Elias-Fano, then
// varint), and its size.
MaskEncoding SmallestMaskEncoding(const uint32_t* idx, size_t k, uint64_t n, uint64_t* bytes);
MaskEncoding SmallestMaskEncoding(const uint64_t* idx, size_t k, uint64_t n, uint64_t* bytes);

// Encodes; *written = the exact size. kBufferTooSmall if capacity is below it (nothing
// written); kInvalidArgument: unknown encoding, null pointers, invalid mask.
KernelStatus MaskEncode(MaskEncoding enc, const uint32_t* idx, size_t k, uint64_t n, uint8_t* buf,
                        size_t capacity, size_t* written);
KernelStatus MaskEncode(MaskEncoding enc, const uint64_t* idx, size_t k, uint64_t n, uint8_t* buf,
                        size_t capacity, size_t* written);

struct MaskHeader {
  MaskEncoding encoding;
  int param;
  uint64_t n;
  uint64_t k;
};

// Parses and checks the header only (encoding known, reserved bytes zero, k <= n, the
// Elias-Fano l canonical). kTruncated if size < kMaskHeaderBytes; kCorrupt otherwise.
KernelStatus MaskReadHeader(const uint8_t* buf, size_t size, MaskHeader* header);

// Decodes a whole encoded mask whose universe must be expected_n. On success out[0, k) holds
// the indices and *k_out = k. kTruncated: the input ends early; kCorrupt: anything else
// invalid (including trailing bytes and n != expected_n); kBufferTooSmall: k > capacity;
// kInvalidArgument: null pointers, uint32_t output with expected_n > 2^32.
KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint32_t* out,
                        size_t capacity, size_t* k_out);
KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint64_t* out,
                        size_t capacity, size_t* k_out);
// The same, writing index + offset for every index (validated against expected_n first): a
// part of a larger universe decodes straight into its positions there, with no second pass.
// kInvalidArgument if offset + expected_n exceeds 2^64.
KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint64_t offset,
                        uint64_t* out, size_t capacity, size_t* k_out);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_MASK_CODEC_H_
