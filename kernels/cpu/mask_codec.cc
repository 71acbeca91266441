// CPU implementation of kernels/cpu/mask_codec.h.
#include "kernels/cpu/mask_codec.h"

#include <cstring>

#include "kernels/cpu/scape_step.h"  // MaskIsValid

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mask_codec.cc assumes a little-endian host"
#endif

namespace scape {
namespace kernels {
namespace {

using u128 = unsigned __int128;

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void Store64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

inline int Popcount(uint64_t w) { return __builtin_popcountll(w); }
inline int Ctz(uint64_t w) { return __builtin_ctzll(w); }

inline uint64_t LowMask(int l) { return l >= 64 ? ~uint64_t{0} : (uint64_t{1} << l) - 1; }

// Sizes of the Elias-Fano sections in 64-bit words (u128 so corrupt headers cannot overflow).
struct EfLayout {
  int l;
  u128 low_bits, high_bits, low_words, high_words;
};
EfLayout EfSections(uint64_t n, uint64_t k) {
  EfLayout f;
  f.l = EliasFanoLowBits(n, k);
  f.low_bits = static_cast<u128>(k) * static_cast<u128>(f.l);
  f.high_bits = k == 0 ? 0 : static_cast<u128>(k) + ((n - 1) >> f.l) + 1;
  f.low_words = (f.low_bits + 63) / 64;
  f.high_words = (f.high_bits + 63) / 64;
  return f;
}

void WriteHeader(uint8_t* buf, MaskEncoding enc, int param, uint64_t n, uint64_t k) {
  std::memset(buf, 0, kMaskHeaderBytes);
  buf[0] = static_cast<uint8_t>(enc);
  buf[1] = static_cast<uint8_t>(param);
  Store64(buf + 8, n);
  Store64(buf + 16, k);
}

// Appends values of `bits` bits to a little-endian word stream.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* p) : p_(p) {}
  void Put(uint64_t v, int bits) {
    if (bits == 0) return;
    acc_ |= v << fill_;
    if (fill_ + bits >= 64) {
      Store64(p_, acc_);
      p_ += 8;
      const int used = 64 - fill_;
      acc_ = used >= 64 ? 0 : v >> used;
      fill_ = fill_ + bits - 64;
    } else {
      fill_ += bits;
    }
  }
  void Flush() {
    if (fill_ > 0) {
      Store64(p_, acc_);
      p_ += 8;
    }
    acc_ = 0;
    fill_ = 0;
  }

 private:
  uint8_t* p_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Reads consecutive `bits`-bit values from a little-endian word stream (bounds are the
// caller's: it reads exactly the words the layout says exist).
class BitReader {
 public:
  explicit BitReader(const uint8_t* p) : p_(p) {}
  uint64_t Get(int bits) {
    if (bits == 0) return 0;
    if (avail_ == 0) {
      cur_ = Load64(p_);
      p_ += 8;
      avail_ = 64;
    }
    uint64_t v;
    if (bits <= avail_) {
      v = cur_ & LowMask(bits);
      cur_ = bits >= 64 ? 0 : cur_ >> bits;
      avail_ -= bits;
    } else {
      const int have = avail_;
      v = cur_;
      cur_ = Load64(p_);
      p_ += 8;
      const int rest = bits - have;
      v |= (cur_ & LowMask(rest)) << have;
      cur_ >>= rest;
      avail_ = 64 - rest;
    }
    return v;
  }
  // Bits of the current word not consumed yet (must be zero padding at the end).
  uint64_t Remaining() const { return avail_ == 0 ? 0 : cur_; }

 private:
  const uint8_t* p_;
  uint64_t cur_ = 0;
  int avail_ = 0;
};

// LEB128 length of v: one byte per started group of 7 significant bits (branch-free, so the
// size query over a whole mask vectorises).
inline int VarintBytes(uint64_t v) { return (63 - __builtin_clzll(v | 1)) / 7 + 1; }

template <typename Index>
uint64_t VarintBodyBytesExact(const Index* idx, size_t k) {
  uint64_t total = 0;
  uint64_t prev = 0;
  for (size_t i = 0; i < k; ++i) {
    const uint64_t x = idx[i];
    const uint64_t d = i == 0 ? x : x - prev - 1;
    total += static_cast<uint64_t>(VarintBytes(d));
    prev = x;
  }
  return total;
}

// The size query runs on every mask sync with the auto encoding. Gaps below 2^32 (every mask
// whose indices span less than 2^32) need at most 5 bytes, so the length is one byte plus one
// per 7-bit boundary the gap reaches: four compares on 32-bit lanes, which vectorise (about
// 2.5x faster than VarintBytes per gap here). Any larger gap falls back to the exact loop.
template <typename Index>
uint64_t VarintBodyBytes(const Index* idx, size_t k) {
  if (k == 0) return 0;
  uint64_t extra = 0, high = 0;
  for (size_t i = 1; i < k; ++i) {
    const uint64_t d = static_cast<uint64_t>(idx[i]) - static_cast<uint64_t>(idx[i - 1]) - 1;
    high |= d;
    const uint32_t d32 = static_cast<uint32_t>(d);
    extra += static_cast<uint64_t>((d32 >= (1u << 7)) + (d32 >= (1u << 14)) + (d32 >= (1u << 21)) +
                                   (d32 >= (1u << 28)));
  }
  if ((high >> 32) != 0) return VarintBodyBytesExact(idx, k);
  return static_cast<uint64_t>(VarintBytes(idx[0])) + (k - 1) + extra;
}

template <typename Index>
KernelStatus IndicesToBitmapImpl(const Index* idx, size_t k, uint64_t n, uint64_t* words,
                                 size_t nwords) {
  const uint64_t need = BitmapWords(n);
  if (nwords < need) return KernelStatus::kBufferTooSmall;
  if (need > 0 && words == nullptr) return KernelStatus::kInvalidArgument;
  if (!MaskIsValid(idx, k, n)) return KernelStatus::kInvalidArgument;
  if (need > 0) std::memset(words, 0, need * 8);
  for (size_t j = 0; j < k; ++j) {
    const uint64_t i = idx[j];
    words[i >> 6] |= uint64_t{1} << (i & 63);
  }
  return KernelStatus::kOk;
}

KernelStatus CheckBitmap(const uint64_t* words, size_t nwords, uint64_t n) {
  if (nwords != BitmapWords(n)) return KernelStatus::kInvalidArgument;
  if (nwords > 0 && words == nullptr) return KernelStatus::kInvalidArgument;
  if ((n & 63) != 0 && (words[nwords - 1] >> (n & 63)) != 0) return KernelStatus::kCorrupt;
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus BitmapToIndicesImpl(const uint64_t* words, size_t nwords, uint64_t n, Index* out,
                                 size_t capacity, size_t* k_out) {
  if (k_out == nullptr || (capacity > 0 && out == nullptr)) return KernelStatus::kInvalidArgument;
  if (sizeof(Index) == 4 && n > (uint64_t{1} << 32)) return KernelStatus::kInvalidArgument;
  KernelStatus st = CheckBitmap(words, nwords, n);
  if (st != KernelStatus::kOk) return st;
  size_t c = 0;
  for (size_t w = 0; w < nwords; ++w) {
    uint64_t bits = words[w];
    while (bits != 0) {
      if (c >= capacity) return KernelStatus::kBufferTooSmall;
      out[c++] = static_cast<Index>(w * 64 + static_cast<uint64_t>(Ctz(bits)));
      bits &= bits - 1;
    }
  }
  *k_out = c;
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus EncodedBytesImpl(MaskEncoding enc, const Index* idx, size_t k, uint64_t n,
                              uint64_t* bytes) {
  if (bytes == nullptr || k > n) return KernelStatus::kInvalidArgument;
  switch (enc) {
    case MaskEncoding::kBitmap:
      *bytes = BitmapEncodedBytes(n);
      return KernelStatus::kOk;
    case MaskEncoding::kEliasFano:
      *bytes = EliasFanoEncodedBytes(n, k);
      return KernelStatus::kOk;
    case MaskEncoding::kDeltaVarint:
      if (k > 0 && idx == nullptr) return KernelStatus::kInvalidArgument;
      *bytes = DeltaVarintEncodedBytes(idx, k);
      return KernelStatus::kOk;
  }
  return KernelStatus::kInvalidArgument;
}

template <typename Index>
MaskEncoding SmallestImpl(const Index* idx, size_t k, uint64_t n, uint64_t* bytes) {
  MaskEncoding best = MaskEncoding::kBitmap;
  uint64_t b = BitmapEncodedBytes(n);
  const uint64_t ef = EliasFanoEncodedBytes(n, k);
  if (ef < b) {
    best = MaskEncoding::kEliasFano;
    b = ef;
  }
  // The varint size needs a pass over the indices; skip it when it cannot win (every varint is
  // at least one byte).
  if (kMaskHeaderBytes + k < b && (k == 0 || idx != nullptr)) {
    const uint64_t dv = DeltaVarintEncodedBytes(idx, k);
    if (dv < b) {
      best = MaskEncoding::kDeltaVarint;
      b = dv;
    }
  }
  if (bytes) *bytes = b;
  return best;
}

template <typename Index>
KernelStatus EncodeImpl(MaskEncoding enc, const Index* idx, size_t k, uint64_t n, uint8_t* buf,
                        size_t capacity, size_t* written) {
  if (written == nullptr) return KernelStatus::kInvalidArgument;
  uint64_t size = 0;
  KernelStatus st = EncodedBytesImpl(enc, idx, k, n, &size);
  if (st != KernelStatus::kOk) return st;
  if (!MaskIsValid(idx, k, n)) return KernelStatus::kInvalidArgument;
  if (size > capacity) return KernelStatus::kBufferTooSmall;
  if (buf == nullptr) return KernelStatus::kInvalidArgument;
  uint8_t* body = buf + kMaskHeaderBytes;
  switch (enc) {
    case MaskEncoding::kBitmap: {
      WriteHeader(buf, enc, 0, n, k);
      const uint64_t nw = BitmapWords(n);
      if (nw > 0) std::memset(body, 0, nw * 8);
      for (size_t j = 0; j < k; ++j) {
        const uint64_t i = idx[j];
        body[i >> 3] = static_cast<uint8_t>(body[i >> 3] | (1u << (i & 7)));
      }
      break;
    }
    case MaskEncoding::kEliasFano: {
      const EfLayout f = EfSections(n, k);
      WriteHeader(buf, enc, f.l, n, k);
      BitWriter low(body);
      for (size_t j = 0; j < k; ++j) low.Put(static_cast<uint64_t>(idx[j]) & LowMask(f.l), f.l);
      low.Flush();
      uint8_t* high = body + static_cast<uint64_t>(f.low_words) * 8;
      const uint64_t hw = static_cast<uint64_t>(f.high_words);
      if (hw > 0) std::memset(high, 0, hw * 8);
      for (size_t j = 0; j < k; ++j) {
        const uint64_t pos = (static_cast<uint64_t>(idx[j]) >> f.l) + j;
        high[pos >> 3] = static_cast<uint8_t>(high[pos >> 3] | (1u << (pos & 7)));
      }
      break;
    }
    case MaskEncoding::kDeltaVarint: {
      WriteHeader(buf, enc, 0, n, k);
      uint8_t* p = body;
      uint64_t prev = 0;
      for (size_t j = 0; j < k; ++j) {
        const uint64_t x = idx[j];
        uint64_t d = j == 0 ? x : x - prev - 1;
        prev = x;
        while (d >= 0x80) {
          *p++ = static_cast<uint8_t>(d | 0x80);
          d >>= 7;
        }
        *p++ = static_cast<uint8_t>(d);
      }
      break;
    }
  }
  *written = static_cast<size_t>(size);
  return KernelStatus::kOk;
}

// Writes index + offset (indices are validated before the offset is added).
template <typename Index>
KernelStatus DecodeImpl(const uint8_t* buf, size_t size, uint64_t expected_n, uint64_t offset,
                        Index* out, size_t capacity, size_t* k_out) {
  if (k_out == nullptr || (capacity > 0 && out == nullptr) || (size > 0 && buf == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (sizeof(Index) == 4 && expected_n > (uint64_t{1} << 32)) {
    return KernelStatus::kInvalidArgument;
  }
  MaskHeader h;
  KernelStatus st = MaskReadHeader(buf, size, &h);
  if (st != KernelStatus::kOk) return st;
  if (h.n != expected_n) return KernelStatus::kCorrupt;
  const uint64_t n = h.n, k = h.k;
  const uint8_t* body = buf + kMaskHeaderBytes;
  const u128 body_size = size - kMaskHeaderBytes;

  switch (h.encoding) {
    case MaskEncoding::kBitmap: {
      const u128 need = static_cast<u128>(BitmapWords(n)) * 8;
      if (body_size < need) return KernelStatus::kTruncated;
      if (body_size > need) return KernelStatus::kCorrupt;
      if (k > capacity) return KernelStatus::kBufferTooSmall;
      const uint64_t nw = BitmapWords(n);
      if ((n & 63) != 0 && (Load64(body + (nw - 1) * 8) >> (n & 63)) != 0) {
        return KernelStatus::kCorrupt;
      }
      // One pass: a word's bits are written only if they fit in the k the header promised.
      uint64_t j = 0;
      for (uint64_t w = 0; w < nw; ++w) {
        uint64_t bits = Load64(body + w * 8);
        if (bits == 0) continue;
        if (static_cast<uint64_t>(Popcount(bits)) > k - j) return KernelStatus::kCorrupt;
        do {
          out[j++] = static_cast<Index>(w * 64 + static_cast<uint64_t>(Ctz(bits)) + offset);
          bits &= bits - 1;
        } while (bits != 0);
      }
      if (j != k) return KernelStatus::kCorrupt;
      break;
    }
    case MaskEncoding::kEliasFano: {
      const EfLayout f = EfSections(n, k);
      const u128 need = (f.low_words + f.high_words) * 8;
      if (body_size < need) return KernelStatus::kTruncated;
      if (body_size > need) return KernelStatus::kCorrupt;
      if (k > capacity) return KernelStatus::kBufferTooSmall;
      if (k == 0) break;
      const int l = f.l;
      const uint64_t low_words = static_cast<uint64_t>(f.low_words);
      const uint64_t high_words = static_cast<uint64_t>(f.high_words);
      const uint64_t max_high = (n - 1) >> l;
      // Low-part padding.
      const uint64_t low_tail = static_cast<uint64_t>(f.low_bits & 63);
      if (low_tail != 0 && (Load64(body + (low_words - 1) * 8) >> low_tail) != 0) {
        return KernelStatus::kCorrupt;
      }
      const uint64_t high_tail = static_cast<uint64_t>(f.high_bits & 63);
      const uint8_t* high = body + low_words * 8;
      if (high_tail != 0 && (Load64(high + (high_words - 1) * 8) >> high_tail) != 0) {
        return KernelStatus::kCorrupt;
      }
      BitReader low(body);
      uint64_t c = 0, prev = 0;
      for (uint64_t w = 0; w < high_words; ++w) {
        uint64_t bits = Load64(high + w * 8);
        while (bits != 0) {
          const uint64_t pos = w * 64 + static_cast<uint64_t>(Ctz(bits));
          bits &= bits - 1;
          if (c >= k) return KernelStatus::kCorrupt;  // more set bits than k
          const uint64_t hi = pos - c;
          if (hi > max_high) return KernelStatus::kCorrupt;
          const uint64_t v = (hi << l) | low.Get(l);
          if (v >= n || (c > 0 && v <= prev)) return KernelStatus::kCorrupt;
          out[c++] = static_cast<Index>(v + offset);
          prev = v;
        }
      }
      if (c != k) return KernelStatus::kCorrupt;
      break;
    }
    case MaskEncoding::kDeltaVarint: {
      if (static_cast<u128>(k) > body_size) return KernelStatus::kTruncated;  // >= 1 byte each
      if (k > capacity) return KernelStatus::kBufferTooSmall;
      const uint8_t* p = body;
      const uint8_t* end = buf + size;
      uint64_t prev = 0;
      for (uint64_t i = 0; i < k; ++i) {
        uint64_t v = 0;
        for (int b = 0;; ++b) {
          if (p >= end) return KernelStatus::kTruncated;
          const uint8_t byte = *p++;
          if (b == 9 && byte > 1) return KernelStatus::kCorrupt;  // beyond 64 bits
          v |= static_cast<uint64_t>(byte & 0x7f) << (7 * b);
          if ((byte & 0x80) == 0) {
            if (b > 0 && byte == 0) return KernelStatus::kCorrupt;  // overlong
            break;
          }
          if (b == 9) return KernelStatus::kCorrupt;
        }
        uint64_t x;
        if (i == 0) {
          if (v >= n) return KernelStatus::kCorrupt;
          x = v;
        } else {
          const uint64_t room = n - 1 - prev;  // prev < n
          if (room == 0 || v >= room) return KernelStatus::kCorrupt;
          x = prev + 1 + v;
        }
        out[i] = static_cast<Index>(x + offset);
        prev = x;
      }
      if (p != end) return KernelStatus::kCorrupt;  // trailing bytes
      break;
    }
  }
  *k_out = static_cast<size_t>(k);
  return KernelStatus::kOk;
}

}  // namespace

int EliasFanoLowBits(uint64_t n, uint64_t k) {
  if (k == 0 || n < k) return 0;
  const uint64_t q = n / k;  // >= 1
  return 63 - __builtin_clzll(q);
}

uint64_t BitmapEncodedBytes(uint64_t n) { return kMaskHeaderBytes + BitmapWords(n) * 8; }

uint64_t EliasFanoEncodedBytes(uint64_t n, uint64_t k) {
  const EfLayout f = EfSections(n, k);
  const u128 b = kMaskHeaderBytes + (f.low_words + f.high_words) * 8;
  return b > ~uint64_t{0} ? ~uint64_t{0} : static_cast<uint64_t>(b);
}

uint64_t DeltaVarintEncodedBytes(const uint32_t* idx, size_t k) {
  return kMaskHeaderBytes + VarintBodyBytes(idx, k);
}
uint64_t DeltaVarintEncodedBytes(const uint64_t* idx, size_t k) {
  return kMaskHeaderBytes + VarintBodyBytes(idx, k);
}

KernelStatus IndicesToBitmap(const uint32_t* idx, size_t k, uint64_t n, uint64_t* words,
                             size_t nwords) {
  return IndicesToBitmapImpl(idx, k, n, words, nwords);
}
KernelStatus IndicesToBitmap(const uint64_t* idx, size_t k, uint64_t n, uint64_t* words,
                             size_t nwords) {
  return IndicesToBitmapImpl(idx, k, n, words, nwords);
}

KernelStatus BitmapCount(const uint64_t* words, size_t nwords, uint64_t n, uint64_t* k) {
  if (k == nullptr) return KernelStatus::kInvalidArgument;
  KernelStatus st = CheckBitmap(words, nwords, n);
  if (st != KernelStatus::kOk) return st;
  uint64_t c = 0;
  for (size_t w = 0; w < nwords; ++w) c += static_cast<uint64_t>(Popcount(words[w]));
  *k = c;
  return KernelStatus::kOk;
}

KernelStatus BitmapToIndices(const uint64_t* words, size_t nwords, uint64_t n, uint32_t* out,
                             size_t capacity, size_t* k_out) {
  return BitmapToIndicesImpl(words, nwords, n, out, capacity, k_out);
}
KernelStatus BitmapToIndices(const uint64_t* words, size_t nwords, uint64_t n, uint64_t* out,
                             size_t capacity, size_t* k_out) {
  return BitmapToIndicesImpl(words, nwords, n, out, capacity, k_out);
}

KernelStatus MaskEncodedBytes(MaskEncoding enc, const uint32_t* idx, size_t k, uint64_t n,
                              uint64_t* bytes) {
  return EncodedBytesImpl(enc, idx, k, n, bytes);
}
KernelStatus MaskEncodedBytes(MaskEncoding enc, const uint64_t* idx, size_t k, uint64_t n,
                              uint64_t* bytes) {
  return EncodedBytesImpl(enc, idx, k, n, bytes);
}

MaskEncoding SmallestMaskEncoding(const uint32_t* idx, size_t k, uint64_t n, uint64_t* bytes) {
  return SmallestImpl(idx, k, n, bytes);
}
MaskEncoding SmallestMaskEncoding(const uint64_t* idx, size_t k, uint64_t n, uint64_t* bytes) {
  return SmallestImpl(idx, k, n, bytes);
}

KernelStatus MaskEncode(MaskEncoding enc, const uint32_t* idx, size_t k, uint64_t n, uint8_t* buf,
                        size_t capacity, size_t* written) {
  return EncodeImpl(enc, idx, k, n, buf, capacity, written);
}
KernelStatus MaskEncode(MaskEncoding enc, const uint64_t* idx, size_t k, uint64_t n, uint8_t* buf,
                        size_t capacity, size_t* written) {
  return EncodeImpl(enc, idx, k, n, buf, capacity, written);
}

KernelStatus MaskReadHeader(const uint8_t* buf, size_t size, MaskHeader* header) {
  if (header == nullptr || (size > 0 && buf == nullptr)) return KernelStatus::kInvalidArgument;
  if (size < kMaskHeaderBytes) return KernelStatus::kTruncated;
  const uint8_t enc = buf[0];
  if (enc < 1 || enc > 3) return KernelStatus::kCorrupt;
  for (int i = 2; i < 8; ++i) {
    if (buf[i] != 0) return KernelStatus::kCorrupt;
  }
  const uint64_t n = Load64(buf + 8), k = Load64(buf + 16);
  if (k > n) return KernelStatus::kCorrupt;
  const MaskEncoding e = static_cast<MaskEncoding>(enc);
  const int want = e == MaskEncoding::kEliasFano ? EliasFanoLowBits(n, k) : 0;
  if (buf[1] != want) return KernelStatus::kCorrupt;
  header->encoding = e;
  header->param = want;
  header->n = n;
  header->k = k;
  return KernelStatus::kOk;
}

KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint32_t* out,
                        size_t capacity, size_t* k_out) {
  return DecodeImpl(buf, size, expected_n, 0, out, capacity, k_out);
}
KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint64_t* out,
                        size_t capacity, size_t* k_out) {
  return DecodeImpl(buf, size, expected_n, 0, out, capacity, k_out);
}
KernelStatus MaskDecode(const uint8_t* buf, size_t size, uint64_t expected_n, uint64_t offset,
                        uint64_t* out, size_t capacity, size_t* k_out) {
  if (offset > ~uint64_t{0} - expected_n) return KernelStatus::kInvalidArgument;
  return DecodeImpl(buf, size, expected_n, offset, out, capacity, k_out);
}

}  // namespace kernels
}  // namespace scape
