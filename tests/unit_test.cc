// Network-free unit tests: schedule math, dtype conversion and reduction kernels, unique id
// encoding, launcher environment parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>

#include "kernels/cpu/dtype.h"
#include "kernels/cpu/reduce.h"
#include "plugin/coll/coll.h"
#include "plugin/coll/schedule.h"
#include "tests/harness.h"
#include "tests/test_util.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/bootstrap/launcher_env.h"

namespace scape {
namespace {

TEST(Schedule, BlocksCoverCountExactly) {
  for (size_t count : {0ul, 1ul, 7ul, 1000ul, 1048579ul})
    for (int p : {1, 2, 3, 4, 5, 8}) {
      size_t sum = 0;
      for (int i = 0; i < p; ++i) {
        EXPECT_EQ(coll::BlockOffset(count, p, i), sum);
        size_t len = coll::BlockLength(count, p, i);
        EXPECT_LE(len, count / static_cast<size_t>(p) + 1);
        sum += len;
      }
      EXPECT_EQ(sum, count);
    }
}

TEST(Schedule, ChunksPartitionABlock) {
  for (size_t len : {0ul, 1ul, 13ul, 100000ul})
    for (size_t n : {1ul, 3ul, 64ul}) {
      EXPECT_EQ(coll::ChunkBegin(len, n, 0), 0u);
      EXPECT_EQ(coll::ChunkBegin(len, n, n), len);
      for (size_t c = 0; c < n; ++c)
        EXPECT_LE(coll::ChunkBegin(len, n, c), coll::ChunkBegin(len, n, c + 1));
    }
  // The tag's 16-bit step field bounds steps * chunks.
  for (int steps : {2, 14, 30}) {
    size_t n = coll::RingChunks(size_t{1} << 40, 4096, steps);
    EXPECT_LE(n * static_cast<size_t>(steps), size_t{1} << 16);
    EXPECT_GE(n, 1u);
  }
  EXPECT_EQ(coll::RingChunks(0, 4096, 4), 1u);
}

// SCAPE_CHUNK_BYTES unset: a block under 8 chunks of the cap is cut into about 8 chunks of at
// least 64 KiB; large blocks keep the cap; a set value is every chunk's size.
TEST(Schedule, SizeAwareChunk) {
  const size_t cap = size_t{2} << 20, floor = size_t{64} << 10;
  EXPECT_EQ(coll::AutoChunkBytes(0, cap), floor);
  EXPECT_EQ(coll::AutoChunkBytes(100, cap), floor);
  EXPECT_EQ(coll::AutoChunkBytes(8 * floor, cap), floor);
  EXPECT_EQ(coll::AutoChunkBytes(8 * floor + 1, cap), floor + 1);
  EXPECT_EQ(coll::AutoChunkBytes(8 * cap, cap), cap);
  EXPECT_EQ(coll::AutoChunkBytes(size_t{1} << 40, cap), cap);
  EXPECT_EQ(coll::AutoChunkBytes(size_t{1} << 20, 4096), 4096u);  // never above the cap
  // The cluster run's cases: a 3.3 MB fp32 all-reduce on 2 ranks, 1.67 MB blocks: 8 chunks
  // instead of one of 2 MiB; SCAPE 0.1's 389 kB payload, 195 kB blocks: 3 of 64 KiB.
  const size_t block = 834432 / 2 * 4;
  EXPECT_EQ(coll::RingChunks(block, coll::AutoChunkBytes(block, cap), 2), 8u);
  EXPECT_EQ(coll::RingChunks(block, cap, 2), 1u);
  EXPECT_EQ(coll::RingChunks(194500, coll::AutoChunkBytes(194500, cap), 2), 3u);
  coll::Tuning t;
  EXPECT_EQ(t.ChunkFor(block), block / 8);
  t.chunkSizeAware = false;
  EXPECT_EQ(t.ChunkFor(block), cap);
  // Whatever the size, the chunks of a block stay within the tag's step field.
  for (size_t b : {size_t{0}, size_t{1}, block, size_t{1} << 36})
    EXPECT_LE(coll::RingChunks(b, coll::AutoChunkBytes(b, cap), 30) * 30, size_t{1} << 16);
}

// Simulates the ring on block ids: after reduce-scatter rank r must have accumulated block r
// from every rank exactly once, and after the all-gather every rank holds every block.
TEST(Schedule, RingReducesEveryBlockOnceAndGathersAll) {
  for (int p : {2, 3, 4, 5, 8}) {
    // contrib[r][b] = set of ranks whose data is folded into rank r's copy of block b
    std::vector<std::vector<std::set<int>>> contrib(p, std::vector<std::set<int>>(p));
    for (int r = 0; r < p; ++r)
      for (int b = 0; b < p; ++b) contrib[r][b] = {r};
    for (int t = 0; t < p - 1; ++t) {
      auto next = contrib;
      for (int r = 0; r < p; ++r) {
        int left = coll::Mod(r - 1, p);
        int rb = coll::RingRecvBlock(r, p, t);
        EXPECT_EQ(coll::RingSendBlock(left, p, t), rb) << "p=" << p << " t=" << t;
        for (int x : contrib[left][rb]) next[r][rb].insert(x);
      }
      contrib = next;
    }
    for (int r = 0; r < p; ++r)
      EXPECT_EQ(contrib[r][r].size(), static_cast<size_t>(p)) << "p=" << p;
    std::vector<std::set<int>> have(p);
    for (int r = 0; r < p; ++r) have[r] = {r};
    for (int t = p - 1; t < 2 * (p - 1); ++t) {
      auto next = have;
      for (int r = 0; r < p; ++r) {
        int left = coll::Mod(r - 1, p);
        EXPECT_EQ(coll::RingSendBlock(left, p, t), coll::RingRecvBlock(r, p, t));
        EXPECT_TRUE(have[left].count(coll::RingSendBlock(left, p, t))) << "sends a block it lacks";
        next[r].insert(coll::RingRecvBlock(r, p, t));
      }
      have = next;
    }
    for (int r = 0; r < p; ++r) EXPECT_EQ(have[r].size(), static_cast<size_t>(p));
  }
}

TEST(Schedule, RecursiveDoublingLayout) {
  for (int p = 1; p <= 17; ++p) {
    coll::RdLayout l = coll::MakeRdLayout(p);
    EXPECT_EQ(l.pof2 + l.rem, p);
    EXPECT_LE(l.pof2, p);
    EXPECT_GT(l.pof2 * 2, p);
    std::set<int> v;
    for (int r = 0; r < p; ++r) {
      int vr = coll::RdVirtualRank(l, r);
      if (vr < 0) continue;
      EXPECT_EQ(coll::RdRealRank(l, vr), r);
      v.insert(vr);
    }
    EXPECT_EQ(v.size(), static_cast<size_t>(l.pof2));
  }
}

TEST(Tags, FieldsDoNotOverlap) {
  uint64_t t = coll::MakeTag(coll::kKindData, (1 << 20) - 1, 0xffff, 0x3ff, 0xffff);
  EXPECT_EQ(coll::TagSig(t), 0xffffu);
  EXPECT_EQ(t & coll::kKindMask, 0u);
  EXPECT_EQ(coll::MakeTag(coll::kKindControl, 0, 0, 0, 0) & coll::kKindMask, uint64_t{1} << 62);
  EXPECT_EQ(coll::MakeTag(0, 0, 0xabcd, 0, 0) & ~coll::kSigMask, 0u);
}

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(kernels::FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(kernels::FloatToBf16(1.00390625f), 0x3f80);
  EXPECT_EQ(kernels::FloatToBf16(1.01171875f), 0x3f82);  // halfway, rounds up to even
  EXPECT_TRUE(std::isnan(kernels::Bf16ToFloat(kernels::FloatToBf16(NAN))));
  EXPECT_EQ(kernels::FloatToBf16(INFINITY), 0x7f80);
  std::mt19937 g(scape_test::FreshSeed());
  for (int i = 0; i < 100000; ++i) {
    float f = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(g),
                         static_cast<int>(g() % 60) - 30);
    float back = kernels::Bf16ToFloat(kernels::FloatToBf16(f));
    // Nearest: no bf16 value is closer than the one chosen.
    float ulp = std::ldexp(1.0f, std::ilogb(back == 0 ? f : back) - 7);
    EXPECT_LE(std::fabs(back - f), ulp / 2) << f;
  }
}

TEST(Dtype, Fp16MatchesHardwareConversion) {
#if defined(__FLT16_MAX__)
  std::mt19937 g(scape_test::FreshSeed());
  for (uint32_t h = 0; h < 65536; ++h) {  // every half value converts exactly to float and back
    float f = kernels::Fp16ToFloat(static_cast<uint16_t>(h));
    _Float16 ref;
    uint16_t hb = static_cast<uint16_t>(h);
    std::memcpy(&ref, &hb, 2);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f, static_cast<float>(ref)) << h;
    ASSERT_EQ(kernels::FloatToFp16(f), h) << h;
  }
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = g();
    float f;
    std::memcpy(&f, &bits, 4);
    _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(kernels::FloatToFp16(f), rb) << "f=" << f << " bits=" << bits;
  }
#else
  GTEST_SKIP() << "compiler has no _Float16 to compare against";
#endif
}

TEST(Reduce, CommutativeBitForBitAndDividesOnce) {
  std::mt19937 g(scape_test::FreshSeed());
  const size_t n = 1001;
  for (scapeDataType_t t : {scapeFloat32, scapeFloat16, scapeBfloat16, scapeInt32, scapeInt64})
    for (scapeRedOp_t op : {scapeSum, scapeAvg, scapeMax, scapeMin}) {
      const size_t esz = scapeTypeSize(t);
      std::vector<char> a(n * esz), b(n * esz), ab(n * esz), ba(n * esz);
      for (size_t i = 0; i < n; ++i) {
        scape_test::Store(t, a.data(), i, scape_test::InputValue(t, g(), 0, i));
        scape_test::Store(t, b.data(), i, scape_test::InputValue(t, g(), 1, i));
      }
      ASSERT_EQ(
          kernels::ReduceInto(t, op, ab.data(), a.data(), b.data(), n, op == scapeAvg ? 2 : 1),
          kernels::KernelStatus::kOk);
      ASSERT_EQ(
          kernels::ReduceInto(t, op, ba.data(), b.data(), a.data(), n, op == scapeAvg ? 2 : 1),
          kernels::KernelStatus::kOk);
      EXPECT_EQ(ab, ba) << "dtype " << t << " op " << op;
      for (size_t i = 0; i < n; ++i) {
        double x = scape_test::Load(t, a.data(), i), y = scape_test::Load(t, b.data(), i);
        double want = op == scapeMax ? std::max(x, y) : op == scapeMin ? std::min(x, y) : x + y;
        if (op == scapeAvg)
          want = (t == scapeInt32 || t == scapeInt64) ? std::trunc(want / 2) : want / 2;
        double got = scape_test::Load(t, ab.data(), i);
        EXPECT_LE(std::fabs(got - want), scape_test::Eps(t) * std::fabs(want) * 1.01) << i;
      }
    }
  // The vector paths (AVX2/F16C) must give exactly the bits of one fp32 add (and divide)
  // and one round-to-nearest-even, element by element, tails included.
  for (scapeDataType_t t : {scapeFloat16, scapeBfloat16})
    for (int div : {1, 3}) {
      std::vector<uint16_t> a(1003), b(1003), out(1003);
      for (size_t i = 0; i < a.size(); ++i) {
        a[i] = static_cast<uint16_t>(g());
        b[i] = static_cast<uint16_t>(g());
      }
      ASSERT_EQ(kernels::ReduceInto(t, scapeSum, out.data(), a.data(), b.data(), a.size(), div),
                kernels::KernelStatus::kOk);
      for (size_t i = 0; i < a.size(); ++i) {
        float x = t == scapeFloat16 ? kernels::Fp16ToFloat(a[i]) : kernels::Bf16ToFloat(a[i]);
        float y = t == scapeFloat16 ? kernels::Fp16ToFloat(b[i]) : kernels::Bf16ToFloat(b[i]);
        float r = x + y;
        if (div > 1) r = r / static_cast<float>(div);
        if (r != r) r = std::numeric_limits<float>::quiet_NaN();  // canonical: 0x7fc00000
        uint16_t want = t == scapeFloat16 ? kernels::FloatToFp16(r) : kernels::FloatToBf16(r);
        ASSERT_EQ(out[i], want) << "dtype " << t << " element " << i << " a=" << a[i]
                                << " b=" << b[i];
      }
    }
  // +0 against -0 (and equal values) under max and min: the same bits in either operand order,
  // max(+0, -0) = +0 and min(+0, -0) = -0 (x86's maxss returns its second operand on equal
  // inputs, so a plain fmax gives -0 one way and +0 the other). 17 elements: vector and tail.
  for (scapeDataType_t t : {scapeFloat32, scapeFloat16, scapeBfloat16})
    for (scapeRedOp_t op : {scapeMax, scapeMin}) {
      const size_t esz = scapeTypeSize(t), n0 = 17;
      std::vector<char> a(n0 * esz), b(n0 * esz), ab(n0 * esz), ba(n0 * esz);
      for (size_t i = 0; i < n0; ++i) {
        const double x = i % 3 == 2 ? 1.5 : 0.0, y = i % 3 == 2 ? 1.5 : -0.0;
        scape_test::Store(t, a.data(), i, i % 2 ? y : x);
        scape_test::Store(t, b.data(), i, i % 2 ? x : y);
      }
      ASSERT_EQ(kernels::ReduceInto(t, op, ab.data(), a.data(), b.data(), n0, 1),
                kernels::KernelStatus::kOk);
      ASSERT_EQ(kernels::ReduceInto(t, op, ba.data(), b.data(), a.data(), n0, 1),
                kernels::KernelStatus::kOk);
      EXPECT_EQ(ab, ba) << "dtype " << t << " op " << op;
      for (size_t i = 0; i < n0; ++i) {
        const double got = scape_test::Load(t, ab.data(), i);
        if (i % 3 == 2) {
          EXPECT_EQ(got, 1.5) << i;
        } else {
          EXPECT_EQ(got, 0.0) << i;
          EXPECT_EQ(std::signbit(got), op == scapeMin) << "dtype " << t << " op " << op << " " << i;
        }
      }
    }
  // Two NaNs of different payloads (and signs): the same bits in either operand order, the
  // canonical NaN (x86 keeps one operand's payload, which depends on the operand order; a
  // random 16-bit pair above made that differ between the vector and scalar paths in about 1
  // run of 100).
  {
    const uint32_t fa = 0xffc01234u, fb = 0x7fa05678u;
    float f[2];
    std::memcpy(&f[0], &fa, 4);
    std::memcpy(&f[1], &fb, 4);
    for (scapeRedOp_t op : {scapeSum, scapeMax, scapeMin, scapeAvg})
      for (int div : {1, 2}) {
        std::vector<float> a(17, f[0]), b(17, f[1]), ab(17), ba(17);
        ASSERT_EQ(kernels::ReduceInto(scapeFloat32, op, ab.data(), a.data(), b.data(), 17, div),
                  kernels::KernelStatus::kOk);
        ASSERT_EQ(kernels::ReduceInto(scapeFloat32, op, ba.data(), b.data(), a.data(), 17, div),
                  kernels::KernelStatus::kOk);
        uint32_t u;
        std::memcpy(&u, &ab[16], 4);
        EXPECT_EQ(u, 0x7fc00000u) << "op " << op;
        EXPECT_EQ(std::memcmp(ab.data(), ba.data(), 4 * 17), 0) << "op " << op;
      }
    for (scapeDataType_t t : {scapeFloat16, scapeBfloat16}) {
      // 17 elements: the 8-wide vector path and the scalar tail.
      const uint16_t na = t == scapeFloat16 ? 0xfe13 : 0xffc3,
                     nb = t == scapeFloat16 ? 0x7d55 : 0x7f91;
      std::vector<uint16_t> a(17, na), b(17, nb), ab(17), ba(17);
      ASSERT_EQ(kernels::ReduceInto(t, scapeSum, ab.data(), a.data(), b.data(), 17, 1),
                kernels::KernelStatus::kOk);
      ASSERT_EQ(kernels::ReduceInto(t, scapeSum, ba.data(), b.data(), a.data(), 17, 1),
                kernels::KernelStatus::kOk);
      EXPECT_EQ(ab, ba) << "dtype " << t;
      EXPECT_EQ(ab[0], t == scapeFloat16 ? 0x7e00 : 0x7fc0) << "dtype " << t << " (vector path)";
      EXPECT_EQ(ab[16], t == scapeFloat16 ? 0x7e00 : 0x7fc0) << "dtype " << t << " (tail)";
    }
  }
  EXPECT_EQ(kernels::ReduceInto(static_cast<scapeDataType_t>(9), scapeSum, nullptr, nullptr,
                                nullptr, 0, 1),
            kernels::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kernels::ReduceInto(scapeFloat32, static_cast<scapeRedOp_t>(9), nullptr, nullptr,
                                nullptr, 0, 1),
            kernels::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kernels::ReduceInto(scapeFloat32, scapeSum, nullptr, nullptr, nullptr, 4, 1),
            kernels::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kernels::ReduceInto(scapeFloat32, scapeSum, nullptr, nullptr, nullptr, 0, 1),
            kernels::KernelStatus::kOk);
  std::vector<int32_t> q = {7, -7, 9};
  EXPECT_EQ(kernels::DivideInPlace(scapeInt32, q.data(), q.size(), 2), kernels::KernelStatus::kOk);
  EXPECT_EQ(q, (std::vector<int32_t>{3, -3, 4}));
  EXPECT_EQ(kernels::DivideInPlace(static_cast<scapeDataType_t>(9), q.data(), q.size(), 2),
            kernels::KernelStatus::kInvalidArgument);
  EXPECT_EQ(kernels::DivideInPlace(scapeFloat32, nullptr, 3, 2),
            kernels::KernelStatus::kInvalidArgument);
  // A status is turned into a Status once, with the kernel's reason.
  Status st = kernels::ToStatus(kernels::KernelStatus::kCorrupt, "decode");
  EXPECT_EQ(st.code(), scapeRemoteError);
  EXPECT_EQ(st.message(), "decode: corrupt input");
  EXPECT_TRUE(kernels::ToStatus(kernels::KernelStatus::kOk, "x").ok());
}

TEST(Bootstrap, UniqueIdRoundTripAndValidation) {
  bootstrap::RootAddress r;
  ASSERT_TRUE(bootstrap::ResolveHost("127.0.0.1", 4242, &r.addr).ok());
  ASSERT_TRUE(bootstrap::RandomSecret(&r.secret).ok());
  scapeUniqueId id;
  bootstrap::EncodeUniqueId(r, &id);
  bootstrap::RootAddress back;
  ASSERT_TRUE(bootstrap::DecodeUniqueId(id, &back).ok());
  EXPECT_EQ(back.addr.ToString(), "127.0.0.1:4242");
  EXPECT_EQ(back.secret, r.secret);
  scapeUniqueId bad = id;
  bad.internal[0] ^= 1;
  EXPECT_EQ(bootstrap::DecodeUniqueId(bad, &back).code(), scapeInvalidArgument);
  bad = id;
  bad.internal[24] = 77;  // address family
  EXPECT_EQ(bootstrap::DecodeUniqueId(bad, &back).code(), scapeInvalidArgument);
}

bootstrap::EnvLookup FakeEnv(const std::map<std::string, std::string>& m) {
  return [m](const char* k) -> const char* {
    auto it = m.find(k);
    return it == m.end() ? nullptr : it->second.c_str();
  };
}

TEST(LauncherEnv, TorchrunUsesMasterPortPlusOne) {
  bootstrap::LauncherInfo li;
  ASSERT_TRUE(bootstrap::ReadLauncherEnv(FakeEnv({{"RANK", "3"},
                                                  {"WORLD_SIZE", "8"},
                                                  {"MASTER_ADDR", "node7"},
                                                  {"MASTER_PORT", "29500"}}),
                                         &li)
                  .ok());
  EXPECT_EQ(li.launcher, "torchrun");
  EXPECT_EQ(li.rank, 3);
  EXPECT_EQ(li.nranks, 8);
  EXPECT_EQ(li.rootHost, "node7");
  EXPECT_EQ(li.rootPort, 29501);
  EXPECT_FALSE(li.secretFromEnv);
}

TEST(LauncherEnv, ExplicitAddressAndSecret) {
  bootstrap::LauncherInfo li;
  ASSERT_TRUE(bootstrap::ReadLauncherEnv(
                  FakeEnv({{"OMPI_COMM_WORLD_RANK", "0"},
                           {"OMPI_COMM_WORLD_SIZE", "2"},
                           {"SCAPE_BOOTSTRAP_ADDR", "[::1]:7000"},
                           {"SCAPE_BOOTSTRAP_SECRET", "00112233445566778899aabbccddeeff"}}),
                  &li)
                  .ok());
  EXPECT_EQ(li.launcher, "openmpi");
  EXPECT_EQ(li.rootHost, "::1");
  EXPECT_EQ(li.rootPort, 7000);
  EXPECT_TRUE(li.secretFromEnv);
  EXPECT_EQ(li.secret[15], 0xff);
  Status st = bootstrap::ReadLauncherEnv(FakeEnv({{"RANK", "0"},
                                                  {"WORLD_SIZE", "2"},
                                                  {"SCAPE_BOOTSTRAP_ADDR", "h:1"},
                                                  {"SCAPE_BOOTSTRAP_SECRET", "xyz"}}),
                                         &li);
  EXPECT_EQ(st.code(), scapeInvalidArgument);
  EXPECT_NE(st.message().find("SCAPE_BOOTSTRAP_SECRET"), std::string::npos);
}

TEST(LauncherEnv, SlurmAndErrors) {
  bootstrap::LauncherInfo li;
  ASSERT_TRUE(bootstrap::ReadLauncherEnv(FakeEnv({{"SLURM_PROCID", "5"},
                                                  {"SLURM_NTASKS", "16"},
                                                  {"SLURM_NNODES", "4"},
                                                  {"SLURM_JOB_ID", "991"},
                                                  {"SLURM_STEP_NODELIST", "gpu[017-020]"}}),
                                         &li)
                  .ok());
  EXPECT_EQ(li.launcher, "slurm");
  EXPECT_EQ(li.rootHost, "gpu017");
  EXPECT_GE(li.rootPort, 20000);
  EXPECT_LT(li.rootPort, 50000);
  EXPECT_EQ(bootstrap::FirstSlurmHost("a,b"), "a");
  EXPECT_EQ(bootstrap::FirstSlurmHost("n[3,5-7],m1"), "n3");
  EXPECT_EQ(bootstrap::FirstSlurmHost("solo"), "solo");
  EXPECT_EQ(bootstrap::ReadLauncherEnv(FakeEnv({{"RANK", "4"}, {"WORLD_SIZE", "4"}}), &li).code(),
            scapeInvalidArgument);
  EXPECT_EQ(bootstrap::ReadLauncherEnv(FakeEnv({{"RANK", "x"}, {"WORLD_SIZE", "4"}}), &li).code(),
            scapeInvalidArgument);
  EXPECT_EQ(bootstrap::ReadLauncherEnv(FakeEnv({}), &li).code(), scapeInvalidUsage);
  // Several hosts and no way to find the root.
  EXPECT_EQ(bootstrap::ReadLauncherEnv(FakeEnv({{"PMI_RANK", "0"}, {"PMI_SIZE", "4"}}), &li).code(),
            scapeInvalidUsage);
}

}  // namespace
}  // namespace scape
