// CPU tests of kernels/cpu/mask_codec.h: round trips on random and adversarial masks, exact
// size queries, and truncated / corrupted encodings (each decode runs on an exactly-sized heap
// copy, so AddressSanitizer catches any read past the end).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <set>
#include <vector>

#include "kernels/cpu/mask_codec.h"
#include "tests/kernels/kernel_test_util.h"

namespace scape {
namespace kernels {
namespace {

using testing_util::RandomMask;

const MaskEncoding kEncodings[] = {MaskEncoding::kBitmap, MaskEncoding::kEliasFano,
                                   MaskEncoding::kDeltaVarint};

// Decodes from an exactly-sized heap copy of buf[0, size).
template <typename Index>
KernelStatus DecodeExact(const uint8_t* buf, size_t size, uint64_t n, std::vector<Index>* out,
                         size_t capacity) {
  std::unique_ptr<uint8_t[]> copy(new uint8_t[size == 0 ? 1 : size]);
  if (size) std::memcpy(copy.get(), buf, size);
  out->assign(capacity + 1, static_cast<Index>(0x5a5a5a5a));
  size_t k = 0;
  KernelStatus st = MaskDecode(copy.get(), size, n, out->data(), capacity, &k);
  EXPECT_EQ((*out)[capacity], static_cast<Index>(0x5a5a5a5a)) << "wrote beyond capacity";
  if (st == KernelStatus::kOk) out->resize(k);
  return st;
}

template <typename Index>
std::vector<uint8_t> Encode(MaskEncoding enc, const std::vector<Index>& idx, uint64_t n) {
  uint64_t size = 0;
  EXPECT_EQ(MaskEncodedBytes(enc, idx.data(), idx.size(), n, &size), KernelStatus::kOk);
  std::vector<uint8_t> buf(size, 0xa5);  // not zero: the encoder must write every byte
  size_t written = 0;
  EXPECT_EQ(MaskEncode(enc, idx.data(), idx.size(), n, buf.data(), buf.size(), &written),
            KernelStatus::kOk);
  EXPECT_EQ(written, size) << "size query must be exact";
  if (size > 0) {
    size_t w2 = 0;
    EXPECT_EQ(MaskEncode(enc, idx.data(), idx.size(), n, buf.data(), size - 1, &w2),
              KernelStatus::kBufferTooSmall);
  }
  return buf;
}

template <typename Index>
void RoundTrip(const std::vector<Index>& idx, uint64_t n) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " k=" << idx.size());
  // Raw bitmap.
  std::vector<uint64_t> words(BitmapWords(n) + 1, ~uint64_t{0});
  ASSERT_EQ(IndicesToBitmap(idx.data(), idx.size(), n, words.data(), BitmapWords(n)),
            KernelStatus::kOk);
  EXPECT_EQ(words.back(), ~uint64_t{0});
  for (uint64_t i = 0, j = 0; i < n; ++i) {
    const bool set = (words[i / 64] >> (i % 64)) & 1;
    const bool want = j < idx.size() && idx[j] == i;
    ASSERT_EQ(set, want) << "bit " << i;
    j += want;
  }
  uint64_t cnt = 0;
  ASSERT_EQ(BitmapCount(words.data(), BitmapWords(n), n, &cnt), KernelStatus::kOk);
  EXPECT_EQ(cnt, idx.size());
  std::vector<Index> back(idx.size() + 1);
  size_t k = 0;
  ASSERT_EQ(BitmapToIndices(words.data(), BitmapWords(n), n, back.data(), idx.size(), &k),
            KernelStatus::kOk);
  back.resize(k);
  EXPECT_EQ(back, idx);
  if (!idx.empty()) {
    EXPECT_EQ(BitmapToIndices(words.data(), BitmapWords(n), n, back.data(), idx.size() - 1, &k),
              KernelStatus::kBufferTooSmall);
  }
  // Encodings.
  uint64_t best_size = 0;
  const MaskEncoding best = SmallestMaskEncoding(idx.data(), idx.size(), n, &best_size);
  for (MaskEncoding enc : kEncodings) {
    SCOPED_TRACE(::testing::Message() << "encoding " << static_cast<int>(enc));
    std::vector<uint8_t> buf = Encode(enc, idx, n);
    EXPECT_GE(buf.size(), best_size);
    if (enc == best) {
      EXPECT_EQ(buf.size(), best_size);
    }
    std::vector<Index> dec;
    ASSERT_EQ(DecodeExact(buf.data(), buf.size(), n, &dec, idx.size()), KernelStatus::kOk);
    EXPECT_EQ(dec, idx);
    if (!idx.empty()) {
      EXPECT_EQ(DecodeExact(buf.data(), buf.size(), n, &dec, idx.size() - 1),
                KernelStatus::kBufferTooSmall);
    }
    EXPECT_EQ(DecodeExact(buf.data(), buf.size(), n + 1, &dec, idx.size()), KernelStatus::kCorrupt)
        << "universe mismatch";
  }
}

TEST(MaskCodec, RoundTripRandom) {
  SCAPE_SEEDED_RNG(rng);
  for (uint64_t n : {0ull, 1ull, 2ull, 63ull, 64ull, 65ull, 127ull, 1000ull, 4097ull, 100003ull}) {
    for (double d : {0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0}) {
      RoundTrip(RandomMask<uint32_t>(rng, n, d), n);
      RoundTrip(RandomMask<uint64_t>(rng, n, d), n);
    }
  }
}

TEST(MaskCodec, RoundTripAdversarial) {
  const uint64_t n = 1000003;
  RoundTrip(std::vector<uint32_t>{0}, n);
  RoundTrip(std::vector<uint32_t>{static_cast<uint32_t>(n - 1)}, n);
  RoundTrip(std::vector<uint32_t>{0, static_cast<uint32_t>(n - 1)}, n);
  std::vector<uint32_t> cluster, spread, front;
  for (uint32_t i = 500000; i < 510000; ++i) cluster.push_back(i);  // one dense run
  for (uint32_t i = 0; i < n; i += 997) spread.push_back(i);        // even gaps
  for (uint32_t i = 0; i < 64; ++i) front.push_back(i);
  RoundTrip(cluster, n);
  RoundTrip(spread, n);
  RoundTrip(front, n);
  // 64-bit universes beyond 2^32 (Elias-Fano and varint only; the bitmap would be huge).
  const uint64_t big = (uint64_t{1} << 40) + 7;
  std::vector<uint64_t> far = {0, 1, (uint64_t{1} << 33), big - 2, big - 1};
  for (MaskEncoding enc : {MaskEncoding::kEliasFano, MaskEncoding::kDeltaVarint}) {
    std::vector<uint8_t> buf = Encode(enc, far, big);
    std::vector<uint64_t> dec;
    ASSERT_EQ(DecodeExact(buf.data(), buf.size(), big, &dec, far.size()), KernelStatus::kOk);
    EXPECT_EQ(dec, far);
    std::vector<uint32_t> dec32;
    EXPECT_EQ(DecodeExact(buf.data(), buf.size(), big, &dec32, far.size()),
              KernelStatus::kInvalidArgument);
  }
}

// The encoders write words at a time; this builds the same bytes one bit at a time, straight
// from the format in mask_codec.h, so a faster encoder cannot drift from the documented format.
std::vector<uint8_t> SpecEncoding(MaskEncoding enc, const std::vector<uint64_t>& idx, uint64_t n) {
  const uint64_t k = idx.size();
  std::vector<uint8_t> out(kMaskHeaderBytes, 0);
  out[0] = static_cast<uint8_t>(enc);
  std::vector<uint8_t> bits;  // one entry per bit of the body, LSB-first within each byte
  auto put = [&bits](uint64_t v, int width) {
    for (int b = 0; b < width; ++b) bits.push_back(static_cast<uint8_t>((v >> b) & 1));
  };
  auto pad = [&bits] {
    while (bits.size() % 64 != 0) bits.push_back(0);
  };
  if (enc == MaskEncoding::kBitmap) {
    bits.assign(n, 0);
    for (uint64_t i : idx) bits[i] = 1;
    pad();
  } else if (enc == MaskEncoding::kEliasFano) {
    int l = 0;
    while (k > 0 && (uint64_t{2} << l) <= n / k) ++l;  // floor(log2(n / k))
    out[1] = static_cast<uint8_t>(l);
    for (uint64_t i : idx) put(i, l);
    pad();
    const uint64_t h = k == 0 ? 0 : k + ((n - 1) >> l) + 1;
    std::vector<uint8_t> high(h, 0);
    for (uint64_t j = 0; j < k; ++j) high[(idx[j] >> l) + j] = 1;
    bits.insert(bits.end(), high.begin(), high.end());
    pad();
  }
  for (int b = 0; b < 8; ++b) out[8 + b] = static_cast<uint8_t>(n >> (8 * b));
  for (int b = 0; b < 8; ++b) out[16 + b] = static_cast<uint8_t>(k >> (8 * b));
  if (enc == MaskEncoding::kDeltaVarint) {
    uint64_t prev = 0;
    for (uint64_t j = 0; j < k; ++j) {
      uint64_t d = j == 0 ? idx[0] : idx[j] - prev - 1;
      prev = idx[j];
      do {
        out.push_back(static_cast<uint8_t>((d & 0x7f) | (d >= 0x80 ? 0x80 : 0)));
        d >>= 7;
      } while (d != 0);
    }
    return out;
  }
  for (size_t i = 0; i < bits.size(); i += 8) {
    uint8_t byte = 0;
    for (int b = 0; b < 8; ++b) byte = static_cast<uint8_t>(byte | (bits[i + b] << b));
    out.push_back(byte);
  }
  return out;
}

TEST(MaskCodec, BytesMatchTheFormatBitByBit) {
  SCAPE_SEEDED_RNG(rng);
  for (uint64_t n : {1ull, 63ull, 64ull, 65ull, 200ull, 4097ull, 100003ull}) {
    for (double d : {0.0, 0.003, 0.01, 0.1, 0.5, 1.0}) {
      const std::vector<uint64_t> idx = RandomMask<uint64_t>(rng, n, d);
      for (MaskEncoding enc : kEncodings) {
        SCOPED_TRACE(::testing::Message()
                     << "n=" << n << " k=" << idx.size() << " encoding " << static_cast<int>(enc));
        EXPECT_EQ(Encode(enc, idx, n), SpecEncoding(enc, idx, n));
      }
    }
  }
  // Long gaps: zero words between set bits in every bit section.
  const std::vector<uint64_t> sparse = {3, 700, 701, 5000, 99999};
  for (MaskEncoding enc : kEncodings)
    EXPECT_EQ(Encode(enc, sparse, 100000), SpecEncoding(enc, sparse, 100000));
}

TEST(MaskCodec, VarintSizeAtEveryLengthBoundary) {
  // Gaps just below and at each 7-bit boundary, up to and past 2^32 (where the size query
  // leaves its 32-bit fast path) and 2^63.
  std::vector<uint64_t> gaps;
  for (int b = 7; b <= 63; b += 7) {
    gaps.push_back((uint64_t{1} << b) - 1);
    gaps.push_back(uint64_t{1} << b);
  }
  for (uint64_t g : {uint64_t{0}, uint64_t{1}, (uint64_t{1} << 32) - 1, uint64_t{1} << 32})
    gaps.push_back(g);
  const uint64_t n = ~uint64_t{0};
  for (uint64_t g : gaps) {
    for (uint64_t first : {uint64_t{0}, uint64_t{5}, uint64_t{1} << 40}) {
      std::vector<uint64_t> idx = {first, first + 1 + g, first + 2 + g};
      if (idx[1] <= idx[0] || idx[2] <= idx[1]) continue;  // wrapped past 2^64
      SCOPED_TRACE(::testing::Message() << "gap " << g << " first " << first);
      const std::vector<uint8_t> spec = SpecEncoding(MaskEncoding::kDeltaVarint, idx, n);
      EXPECT_EQ(DeltaVarintEncodedBytes(idx.data(), idx.size()), spec.size());
      EXPECT_EQ(Encode(MaskEncoding::kDeltaVarint, idx, n), spec);
      if (idx[2] < (uint64_t{1} << 32)) {
        const std::vector<uint32_t> idx32(idx.begin(), idx.end());
        EXPECT_EQ(DeltaVarintEncodedBytes(idx32.data(), idx32.size()), spec.size());
      }
    }
  }
}

TEST(MaskCodec, DecodeWithOffsetAddsItAfterValidation) {
  SCAPE_SEEDED_RNG(rng);
  const uint64_t n = 100003, offset = (uint64_t{1} << 40) + 3;
  const std::vector<uint64_t> idx = RandomMask<uint64_t>(rng, n, 0.02);
  for (MaskEncoding enc : kEncodings) {
    SCOPED_TRACE(::testing::Message() << "encoding " << static_cast<int>(enc));
    const std::vector<uint8_t> buf = Encode(enc, idx, n);
    std::vector<uint64_t> out(idx.size());
    size_t k = 0;
    ASSERT_EQ(MaskDecode(buf.data(), buf.size(), n, offset, out.data(), out.size(), &k),
              KernelStatus::kOk);
    ASSERT_EQ(k, idx.size());
    // offset >= n: had the decoder checked index + offset against n, every index would fail.
    for (size_t i = 0; i < k; ++i) ASSERT_EQ(out[i], idx[i] + offset) << i;
    // With an offset the input is still validated: one byte short, and a flipped body byte.
    EXPECT_EQ(MaskDecode(buf.data(), buf.size() - 1, n, offset, out.data(), out.size(), &k),
              KernelStatus::kTruncated);
    std::vector<uint64_t> junk;
    std::vector<uint8_t> bad = buf;
    bad[bad.size() - 1] ^= 0x80;  // the last body byte: padding, a varint's end, or a bitmap bit
    const KernelStatus plain = DecodeExact(bad.data(), bad.size(), n, &junk, idx.size());
    size_t k2 = 0;
    EXPECT_EQ(MaskDecode(bad.data(), bad.size(), n, offset, out.data(), out.size(), &k2), plain);
    // offset + n beyond 2^64 is refused.
    EXPECT_EQ(
        MaskDecode(buf.data(), buf.size(), n, ~uint64_t{0} - n + 1, out.data(), out.size(), &k),
        KernelStatus::kInvalidArgument);
  }
}

TEST(MaskCodec, SizesFollowTheDesign) {
  // Elias-Fano at density 0.01 costs about 2 + log2(100) = 8.6 bits per index.
  const uint64_t n = 1u << 22, k = n / 100;
  const double bits = 8.0 * (EliasFanoEncodedBytes(n, k) - kMaskHeaderBytes) / k;
  EXPECT_GT(bits, 8.0);
  EXPECT_LT(bits, 9.2);
  EXPECT_EQ(BitmapEncodedBytes(n), kMaskHeaderBytes + n / 8);
  std::mt19937_64 fixed(1);
  std::vector<uint32_t> idx = RandomMask<uint32_t>(fixed, n, 0.01);  // random gaps, mean 100
  uint64_t b = 0;
  EXPECT_EQ(SmallestMaskEncoding(idx.data(), idx.size(), n, &b), MaskEncoding::kEliasFano);
  std::vector<uint32_t> run;
  for (uint32_t i = 0; i < 10000; ++i) run.push_back(i);  // clustered: 1 byte each
  EXPECT_EQ(SmallestMaskEncoding(run.data(), run.size(), n, &b), MaskEncoding::kDeltaVarint);
  std::vector<uint32_t> dense = RandomMask<uint32_t>(fixed, 100000, 0.6);
  EXPECT_EQ(SmallestMaskEncoding(dense.data(), dense.size(), 100000, &b), MaskEncoding::kBitmap);
}

TEST(MaskCodec, RejectsInvalidMasksOnEncode) {
  std::vector<uint8_t> buf(1024);
  size_t w = 0;
  const uint32_t unsorted[] = {5, 3};
  const uint32_t dup[] = {3, 3};
  const uint32_t range[] = {3, 100};
  for (const uint32_t* bad : {unsorted, dup, range}) {
    for (MaskEncoding enc : kEncodings) {
      EXPECT_EQ(MaskEncode(enc, bad, 2, 100, buf.data(), buf.size(), &w),
                KernelStatus::kInvalidArgument);
    }
    std::vector<uint64_t> words(2);
    EXPECT_EQ(IndicesToBitmap(bad, 2, 100, words.data(), 2), KernelStatus::kInvalidArgument);
  }
  EXPECT_EQ(MaskEncode(static_cast<MaskEncoding>(9), unsorted, 0, 100, buf.data(), buf.size(), &w),
            KernelStatus::kInvalidArgument);
  std::vector<uint64_t> words = {0, uint64_t{1} << 40};  // bit 104 >= n = 100: padding
  uint64_t c;
  EXPECT_EQ(BitmapCount(words.data(), 2, 100, &c), KernelStatus::kCorrupt);
  std::vector<uint32_t> out(10);
  size_t k;
  EXPECT_EQ(BitmapToIndices(words.data(), 2, 100, out.data(), 10, &k), KernelStatus::kCorrupt);
  EXPECT_EQ(BitmapToIndices(words.data(), 1, 100, out.data(), 10, &k),
            KernelStatus::kInvalidArgument);
}

template <typename Index>
void CheckNoFalseAccept(const std::vector<uint8_t>& bad, uint64_t n, size_t capacity,
                        const char* what) {
  std::vector<Index> dec;
  KernelStatus st = DecodeExact(bad.data(), bad.size(), n, &dec, capacity);
  if (st == KernelStatus::kOk) {
    // A corruption may produce another valid encoding; then it must be the canonical encoding
    // of what it decodes to.
    MaskHeader h;
    ASSERT_EQ(MaskReadHeader(bad.data(), bad.size(), &h), KernelStatus::kOk);
    ASSERT_EQ(Encode(h.encoding, dec, n), bad) << what << ": accepted a non-canonical encoding";
  } else {
    EXPECT_TRUE(st == KernelStatus::kCorrupt || st == KernelStatus::kTruncated ||
                st == KernelStatus::kBufferTooSmall)
        << what << ": " << KernelStatusString(st);
  }
}

TEST(MaskCodec, TruncatedAndCorruptedInputs) {
  SCAPE_SEEDED_RNG(rng);
  for (uint64_t n : {1ull, 64ull, 130ull, 5000ull}) {
    for (double d : {0.0, 0.02, 0.3, 1.0}) {
      std::vector<uint32_t> idx = RandomMask<uint32_t>(rng, n, d);
      for (MaskEncoding enc : kEncodings) {
        SCOPED_TRACE(::testing::Message()
                     << "n=" << n << " k=" << idx.size() << " enc " << static_cast<int>(enc));
        const std::vector<uint8_t> good = Encode(enc, idx, n);
        // Every truncation fails cleanly.
        for (size_t len = 0; len < good.size(); ++len) {
          std::vector<uint32_t> dec;
          KernelStatus st = DecodeExact(good.data(), len, n, &dec, n);
          ASSERT_TRUE(st == KernelStatus::kTruncated || st == KernelStatus::kCorrupt)
              << "prefix " << len << " of " << good.size() << ": " << KernelStatusString(st);
        }
        // A trailing byte is rejected.
        std::vector<uint8_t> longer = good;
        longer.push_back(0);
        std::vector<uint32_t> dec;
        EXPECT_EQ(DecodeExact(longer.data(), longer.size(), n, &dec, n), KernelStatus::kCorrupt);
        // Random bit flips and byte overwrites (header included).
        for (int trial = 0; trial < 200; ++trial) {
          std::vector<uint8_t> bad = good;
          const size_t pos = rng() % bad.size();
          if (trial % 2) {
            bad[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
          } else {
            bad[pos] = static_cast<uint8_t>(rng());
          }
          CheckNoFalseAccept<uint32_t>(bad, n, n, "corruption");
        }
      }
    }
  }
}

TEST(MaskCodec, HeaderCorruptions) {
  std::vector<uint32_t> idx = {3, 9, 27, 81};
  const uint64_t n = 100;
  for (MaskEncoding enc : kEncodings) {
    const std::vector<uint8_t> good = Encode(enc, idx, n);
    std::vector<uint32_t> dec;
    auto with = [&](size_t off, const void* v, size_t len) {
      std::vector<uint8_t> b = good;
      std::memcpy(b.data() + off, v, len);
      return b;
    };
    const uint8_t zero = 0, nine = 9, one = 1;
    const uint64_t huge = ~uint64_t{0}, kbig = 101, n2 = 200;
    EXPECT_EQ(DecodeExact(with(0, &zero, 1).data(), good.size(), n, &dec, 10),
              KernelStatus::kCorrupt);  // unknown encoding
    EXPECT_EQ(DecodeExact(with(0, &nine, 1).data(), good.size(), n, &dec, 10),
              KernelStatus::kCorrupt);
    EXPECT_EQ(DecodeExact(with(5, &one, 1).data(), good.size(), n, &dec, 10),
              KernelStatus::kCorrupt);  // reserved byte
    EXPECT_EQ(DecodeExact(with(16, &kbig, 8).data(), good.size(), n, &dec, 1000),
              KernelStatus::kCorrupt);  // k > n
    EXPECT_NE(DecodeExact(with(16, &huge, 8).data(), good.size(), n, &dec, 1000),
              KernelStatus::kOk);
    EXPECT_NE(DecodeExact(with(8, &huge, 8).data(), good.size(), huge, &dec, 1000),
              KernelStatus::kOk);
    EXPECT_EQ(DecodeExact(with(8, &n2, 8).data(), good.size(), n, &dec, 10),
              KernelStatus::kCorrupt);  // n != expected
    const uint8_t l = static_cast<uint8_t>(good[1] + 1);
    EXPECT_EQ(DecodeExact(with(1, &l, 1).data(), good.size(), n, &dec, 10),
              KernelStatus::kCorrupt);  // non-canonical parameter
  }
  // Overlong and overflowing varints.
  std::vector<uint8_t> v = Encode(MaskEncoding::kDeltaVarint, std::vector<uint32_t>{5}, 1000);
  std::vector<uint8_t> overlong(v.begin(), v.begin() + kMaskHeaderBytes);
  overlong.push_back(0x85);
  overlong.push_back(0x00);
  std::vector<uint32_t> dec;
  EXPECT_EQ(DecodeExact(overlong.data(), overlong.size(), 1000, &dec, 10), KernelStatus::kCorrupt);
  std::vector<uint8_t> overflow(v.begin(), v.begin() + kMaskHeaderBytes);
  for (int i = 0; i < 10; ++i) overflow.push_back(0xff);
  overflow.push_back(0x01);
  std::vector<uint64_t> dec64;
  EXPECT_EQ(DecodeExact(overflow.data(), overflow.size(), 1000, &dec64, 10),
            KernelStatus::kCorrupt);
}

}  // namespace
}  // namespace kernels
}  // namespace scape
