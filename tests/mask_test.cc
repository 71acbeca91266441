// Agreed masks and the values-only collectives, over real UCX on loopback.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

// A layout with the awkward cases: empty segments, a 1-element segment, a dense segment, odd n.
struct Layout {
  uint64_t n;
  std::vector<uint64_t> offs;
  std::vector<uint8_t> dense;
};
Layout MakeLayout() {
  Layout l;
  l.offs = {0, 0, 1, 1000, 1001, 1001, 4000, 7919, 10007};
  l.n = l.offs.back();
  l.dense = {0, 0, 0, 1, 0, 0, 0, 0};
  return l;
}

bool SameOnAllRanks(RankCtx& c, const void* buf, size_t bytes) {
  std::vector<int64_t> h(static_cast<size_t>(c.nranks));
  int64_t mine = static_cast<int64_t>(HashBytes(buf, bytes));
  EXPECT_SCAPE_OK(scapeAllGather(&mine, h.data(), 1, scapeInt64, c.comm, nullptr), c.comm);
  for (int64_t x : h)
    if (x != mine) return false;
  return true;
}

float Stat(unsigned seed, int rank, uint64_t i) {
  return static_cast<float>(InputValue(scapeFloat32, seed, rank + 100, i));
}

// Reference selection for one piece: top k of |x| with ties to the lower index.
std::vector<uint64_t> RefTopk(const std::vector<float>& x, uint64_t b, uint64_t e, uint64_t k) {
  std::vector<uint64_t> pos;
  for (uint64_t i = b; i < e; ++i) pos.push_back(i);
  std::stable_sort(pos.begin(), pos.end(),
                   [&](uint64_t p, uint64_t q) { return std::fabs(x[p]) > std::fabs(x[q]); });
  pos.resize(k);
  std::sort(pos.begin(), pos.end());
  return pos;
}

void MaskedAllReduceCase(int P, scapeOwnership_t own, double density, bool emptySelection) {
  const unsigned seed =
      FreshSeed() + static_cast<unsigned>(P * 31 + own * 7) + static_cast<unsigned>(density * 1000);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    Layout l = MakeLayout();
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeMaskCreate(&mask, l.n, static_cast<int>(l.offs.size() - 1), l.offs.data(),
                                    l.dense.data(), own, scapeMaskEncodingAuto, c.comm),
                    c.comm);
    if (!mask) return false;
    std::vector<float> stat(l.n);
    for (uint64_t i = 0; i < l.n; ++i) stat[i] = Stat(seed, c.rank, i);
    if (emptySelection) {
      EXPECT_SCAPE_OK(scapeMaskSetNextIndices(mask, nullptr, 0), c.comm);
    } else {
      EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(mask, stat.data(), density), c.comm);
    }
    EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
    EXPECT_EQ(scapeMaskSyncStart(mask), scapeInvalidUsage) << "second start while in flight";
    EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
    EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
    EXPECT_EQ(scapeMaskAdvance(mask), scapeInvalidUsage) << "advance twice without a sync";

    uint64_t k = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(mask, &k), c.comm);
    std::vector<uint64_t> idx(k);
    EXPECT_SCAPE_OK(scapeMaskGetIndices(mask, idx.data(), idx.size()), c.comm);
    EXPECT_TRUE(SameOnAllRanks(c, idx.data(), idx.size() * 8)) << "masks differ between ranks";

    // This rank's part must be exactly the reference top-k of its own statistic.
    uint64_t kr = 0, off = 0;
    EXPECT_SCAPE_OK(scapeMaskGetRankCount(mask, c.rank, &kr, &off), c.comm);
    size_t nr = 0;
    EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, c.rank, nullptr, 0, &nr), c.comm);
    std::vector<uint64_t> ranges(2 * nr);
    EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, c.rank, ranges.data(), nr, &nr), c.comm);
    std::vector<uint64_t> want;
    for (size_t q = 0; q < nr; ++q)
      for (size_t s = 0; s + 1 < l.offs.size(); ++s) {
        uint64_t b = std::max(ranges[2 * q], l.offs[s]),
                 e = std::min(ranges[2 * q + 1], l.offs[s + 1]);
        if (b >= e) continue;
        uint64_t kk =
            l.dense[s] ? e - b
            : emptySelection
                ? 0
                : std::max<uint64_t>(
                      1, static_cast<uint64_t>(std::floor(density * static_cast<double>(e - b))));
        auto sel = RefTopk(stat, b, e, kk);
        want.insert(want.end(), sel.begin(), sel.end());
      }
    std::sort(want.begin(), want.end());
    std::vector<uint64_t> got(idx.begin() + static_cast<ptrdiff_t>(off),
                              idx.begin() + static_cast<ptrdiff_t>(off + kr));
    EXPECT_EQ(got, want) << "rank " << c.rank << "'s selection";

    // Masked all-reduce (dense in/out) equals the dense all-reduce restricted to the mask.
    // Every payload type the issue names, with a different op each (the sentinel check and
    // the packed comparisons below hold for any op).
    const std::pair<scapeDataType_t, scapeRedOp_t> cases[] = {{scapeFloat32, scapeAvg},
                                                              {scapeBfloat16, scapeAvg},
                                                              {scapeFloat16, scapeMin},
                                                              {scapeFloat32, scapeMax}};
    for (const auto& tc : cases) {
      const scapeDataType_t t = tc.first;
      const scapeRedOp_t dop = tc.second;
      const size_t esz = scapeTypeSize(t);
      std::vector<char> send(l.n * esz), recv(l.n * esz), dense(l.n * esz);
      for (uint64_t i = 0; i < l.n; ++i) Store(t, send.data(), i, InputValue(t, seed, c.rank, i));
      for (uint64_t i = 0; i < l.n; ++i) Store(t, recv.data(), i, -7.0);  // sentinel
      EXPECT_SCAPE_OK(scapeAllReduce(send.data(), recv.data(), l.n, t, dop, mask, c.comm, nullptr),
                      c.comm);
      EXPECT_SCAPE_OK(
          scapeAllReduce(send.data(), dense.data(), l.n, t, dop, nullptr, c.comm, nullptr), c.comm);
      std::vector<char> inMask(l.n, 0);
      for (uint64_t i : idx) inMask[i] = 1;
      size_t bad = 0;
      for (uint64_t i = 0; i < l.n; ++i) {
        double v = Load(t, recv.data(), i);
        if (!inMask[i]) {
          bad += v != -7.0;
          continue;
        }
        Ref ref = Reference(t, dop, seed, c.nranks, i);
        bad += !(std::fabs(v - ref.value) <= ref.tol);
      }
      EXPECT_EQ(bad, 0u) << "rank " << c.rank << " dtype " << t << " op " << dop;
      EXPECT_TRUE(SameOnAllRanks(c, recv.data(), recv.size()));

      // Packed forms: reduce-scatter then all-gather gives the all-reduce's bits.
      std::vector<char> packed(k * esz + 1), ar(k * esz + 1), mine(kr * esz + 1), ag(k * esz + 1);
      EXPECT_SCAPE_OK(scapeMaskPack(mask, send.data(), packed.data(), t), c.comm);
      EXPECT_SCAPE_OK(
          scapeMaskAllReducePacked(packed.data(), ar.data(), t, scapeSum, mask, c.comm, nullptr),
          c.comm);
      EXPECT_SCAPE_OK(
          scapeMaskReduceScatter(packed.data(), mine.data(), t, scapeSum, mask, c.comm, nullptr),
          c.comm);
      EXPECT_EQ(std::memcmp(mine.data(), ar.data() + off * esz, kr * esz), 0)
          << "reduce-scatter part";
      EXPECT_SCAPE_OK(scapeMaskAllGather(mine.data(), ag.data(), t, mask, c.comm, nullptr), c.comm);
      EXPECT_EQ(std::memcmp(ag.data(), ar.data(), k * esz), 0)
          << "reduce-scatter + all-gather != all-reduce";
      // The dense-in/out form gives the packed form's bits (also on its full-mask fast path).
      std::vector<char> opPacked(k * esz + 1), recvPacked(k * esz + 1);
      EXPECT_SCAPE_OK(
          scapeMaskAllReducePacked(packed.data(), opPacked.data(), t, dop, mask, c.comm, nullptr),
          c.comm);
      EXPECT_SCAPE_OK(scapeMaskPack(mask, recv.data(), recvPacked.data(), t), c.comm);
      EXPECT_EQ(std::memcmp(recvPacked.data(), opPacked.data(), k * esz), 0)
          << "dense in/out != packed";
    }
    scapeMaskSyncInfo_t info;
    EXPECT_SCAPE_OK(scapeMaskGetSyncInfo(mask, &info), c.comm);
    EXPECT_GE(info.sentBytes, 24u);
    for (int e = 1; e < scapeNumMaskEncodings; ++e)
      EXPECT_LE(info.sentBytes, info.bytesByEncoding[e]);
    EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

class MaskSweep : public ::testing::TestWithParam<int> {};
TEST_P(MaskSweep, ShardsDensity01) {
  MaskedAllReduceCase(GetParam(), scapeOwnershipShards, 0.1, false);
}
TEST_P(MaskSweep, SegmentsDensity001) {
  MaskedAllReduceCase(GetParam(), scapeOwnershipSegments, 0.01, false);
}
TEST_P(MaskSweep, ShardsFullDensity) {
  MaskedAllReduceCase(GetParam(), scapeOwnershipShards, 1.0, false);
}
TEST_P(MaskSweep, EmptySelection) {
  MaskedAllReduceCase(GetParam(), scapeOwnershipSegments, 0.1, true);
}
INSTANTIATE_TEST_SUITE_P(Ranks, MaskSweep, ::testing::Values(1, 2, 3, 5, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// Many steps on one mask whose k changes every step (the mask keeps its buffers between steps
// and swaps them on advance): after every advance the mask is exactly the union of every
// rank's reference selection, for every encoding and both ownership modes, and the masked
// all-reduce matches the dense one on it.
TEST(Mask, RepeatedStepsWithChangingK) {
  const unsigned seed = FreshSeed() + 4242u;
  const double densities[] = {0.3, 0.01, 1.0, -1.0 /* nothing selected */, 0.05, 0.5, 0.002};
  for (scapeOwnership_t own : {scapeOwnershipShards, scapeOwnershipSegments}) {
    for (int e = 0; e < scapeNumMaskEncodings; ++e) {
      const scapeMaskEncoding_t enc = static_cast<scapeMaskEncoding_t>(e);
      RunResult res = RunRanks(3, [&](RankCtx& c) {
        Layout l = MakeLayout();
        const int nseg = static_cast<int>(l.offs.size() - 1);
        scapeMask_t mask = nullptr;
        EXPECT_SCAPE_OK(
            scapeMaskCreate(&mask, l.n, nseg, l.offs.data(), l.dense.data(), own, enc, c.comm),
            c.comm);
        if (!mask) return false;
        std::vector<float> send(l.n), recv(l.n), dense(l.n);
        for (size_t step = 0; step < sizeof(densities) / sizeof(densities[0]); ++step) {
          const double d = densities[step];
          const unsigned s = seed + static_cast<unsigned>(step) * 17u;
          std::vector<float> stat(l.n);
          for (uint64_t i = 0; i < l.n; ++i) stat[i] = Stat(s, c.rank, i);
          if (d < 0) {
            EXPECT_SCAPE_OK(scapeMaskSetNextIndices(mask, nullptr, 0), c.comm);
          } else {
            EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(mask, stat.data(), d), c.comm);
          }
          EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
          EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
          EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
          // Every rank's part from every rank's statistic: the whole mask, on every rank.
          std::vector<uint64_t> want;
          for (int r = 0; r < c.nranks; ++r) {
            std::vector<float> rs(l.n);
            for (uint64_t i = 0; i < l.n; ++i) rs[i] = Stat(s, r, i);
            size_t nr = 0;
            EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, r, nullptr, 0, &nr), c.comm);
            std::vector<uint64_t> ranges(2 * nr);
            EXPECT_SCAPE_OK(scapeMaskGetOwnedRanges(mask, r, ranges.data(), nr, &nr), c.comm);
            for (size_t q = 0; q < nr; ++q)
              for (size_t sg = 0; sg + 1 < l.offs.size(); ++sg) {
                const uint64_t b = std::max(ranges[2 * q], l.offs[sg]);
                const uint64_t en = std::min(ranges[2 * q + 1], l.offs[sg + 1]);
                if (b >= en) continue;
                const uint64_t kk =
                    l.dense[sg] ? en - b
                    : d < 0     ? 0
                                : std::max<uint64_t>(1, static_cast<uint64_t>(std::floor(
                                                            d * static_cast<double>(en - b))));
                auto sel = RefTopk(rs, b, en, kk);
                want.insert(want.end(), sel.begin(), sel.end());
              }
          }
          std::sort(want.begin(), want.end());
          uint64_t k = 0;
          EXPECT_SCAPE_OK(scapeMaskGetCount(mask, &k), c.comm);
          std::vector<uint64_t> got(k);
          EXPECT_SCAPE_OK(scapeMaskGetIndices(mask, got.data(), got.size()), c.comm);
          std::sort(got.begin(), got.end());  // mask order is owner order: compare as sets
          EXPECT_EQ(got, want) << "rank " << c.rank << " step " << step << " encoding " << e
                               << " ownership " << own;
          for (uint64_t i = 0; i < l.n; ++i)
            send[i] = static_cast<float>(InputValue(scapeFloat32, s, c.rank, i));
          std::fill(recv.begin(), recv.end(), -7.0f);
          EXPECT_SCAPE_OK(scapeAllReduce(send.data(), recv.data(), l.n, scapeFloat32, scapeSum,
                                         mask, c.comm, nullptr),
                          c.comm);
          EXPECT_SCAPE_OK(scapeAllReduce(send.data(), dense.data(), l.n, scapeFloat32, scapeSum,
                                         nullptr, c.comm, nullptr),
                          c.comm);
          std::vector<char> in(l.n, 0);
          for (uint64_t i : want) in[i] = 1;
          size_t bad = 0;
          for (uint64_t i = 0; i < l.n; ++i) {
            if (!in[i]) {
              bad += recv[i] != -7.0f;
              continue;
            }
            const Ref ref = Reference(scapeFloat32, scapeSum, s, c.nranks, i);
            bad += !(std::fabs(static_cast<double>(recv[i]) - ref.value) <= ref.tol);
          }
          EXPECT_EQ(bad, 0u) << "rank " << c.rank << " step " << step << " encoding " << e;
        }
        EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
        return true;
      });
      EXPECT_TRUE(res.AllOk()) << "encoding " << e << " ownership " << own << ": "
                               << res.Describe();
    }
  }
}

// The non-blocking forms give the blocking forms' bits. A dense-in/out request keeps the
// positions it packed: the mask is advanced to a different selection, and then destroyed,
// while requests are still in flight, and they still unpack at the old positions.
void AsyncCase(int P) {
  const unsigned seed = FreshSeed() + 3131u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    Layout l = MakeLayout();
    const int nseg = static_cast<int>(l.offs.size() - 1);
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeMaskCreate(&mask, l.n, nseg, l.offs.data(), l.dense.data(),
                                    scapeOwnershipShards, scapeMaskEncodingAuto, c.comm),
                    c.comm);
    if (!mask) return false;
    std::vector<float> stat(l.n), stat2(l.n);
    for (uint64_t i = 0; i < l.n; ++i) stat[i] = Stat(seed, c.rank, i);
    for (uint64_t i = 0; i < l.n; ++i) stat2[i] = Stat(seed + 1u, c.rank, i);
    auto step = [&](const std::vector<float>& st, double d) {
      EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(mask, st.data(), d), c.comm);
      EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
      EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
      EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
    };
    step(stat, 0.1);
    uint64_t k = 0, kr = 0, off = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(mask, &k), c.comm);
    EXPECT_SCAPE_OK(scapeMaskGetRankCount(mask, c.rank, &kr, &off), c.comm);
    std::vector<float> send(l.n), sendB(l.n);
    for (uint64_t i = 0; i < l.n; ++i)
      send[i] = static_cast<float>(InputValue(scapeFloat32, seed, c.rank, i));
    for (uint64_t i = 0; i < l.n; ++i)
      sendB[i] = static_cast<float>(InputValue(scapeFloat32, seed + 5u, c.rank, i));

    // Blocking references on the first mask.
    std::vector<float> refA(l.n, -7.0f), refB = sendB;  // refB: in place, as gotB below
    EXPECT_SCAPE_OK(scapeAllReduce(send.data(), refA.data(), l.n, scapeFloat32, scapeSum, mask,
                                   c.comm, nullptr),
                    c.comm);
    EXPECT_SCAPE_OK(scapeAllReduce(sendB.data(), refB.data(), l.n, scapeFloat32, scapeMax, mask,
                                   c.comm, nullptr),
                    c.comm);
    std::vector<float> packed(k + 1), ar(k + 1), rs(kr + 1), ag(k + 1);
    EXPECT_SCAPE_OK(scapeMaskPack(mask, send.data(), packed.data(), scapeFloat32), c.comm);
    EXPECT_SCAPE_OK(scapeMaskAllReducePacked(packed.data(), ar.data(), scapeFloat32, scapeAvg, mask,
                                             c.comm, nullptr),
                    c.comm);
    EXPECT_SCAPE_OK(scapeMaskReduceScatter(packed.data(), rs.data(), scapeFloat32, scapeAvg, mask,
                                           c.comm, nullptr),
                    c.comm);
    EXPECT_SCAPE_OK(scapeMaskAllGather(rs.data(), ag.data(), scapeFloat32, mask, c.comm, nullptr),
                    c.comm);

    // The same, non-blocking: two dense-in/out requests (one in place), then the packed ones.
    std::vector<float> gotA(l.n, -7.0f), gotB = sendB;
    scapeRequest_t qa = nullptr, qb = nullptr, qc = nullptr, qd = nullptr, qe = nullptr;
    EXPECT_SCAPE_OK(scapeAllReduceAsync(send.data(), gotA.data(), l.n, scapeFloat32, scapeSum, mask,
                                        c.comm, nullptr, &qa),
                    c.comm);
    EXPECT_SCAPE_OK(scapeAllReduceAsync(gotB.data(), gotB.data(), l.n, scapeFloat32, scapeMax, mask,
                                        c.comm, nullptr, &qb),
                    c.comm);
    std::vector<float> ar2(k + 1), rs2(kr + 1), ag2(k + 1);
    EXPECT_SCAPE_OK(scapeMaskAllReducePackedAsync(packed.data(), ar2.data(), scapeFloat32, scapeAvg,
                                                  mask, c.comm, nullptr, &qc),
                    c.comm);
    EXPECT_SCAPE_OK(scapeMaskReduceScatterAsync(packed.data(), rs2.data(), scapeFloat32, scapeAvg,
                                                mask, c.comm, nullptr, &qd),
                    c.comm);
    // The mask moves on twice (different selections and densities) while they are in flight:
    // the second sync would decode into the buffer the requests packed from, if the mask
    // reused it.
    step(stat2, 0.05);
    step(stat2, 0.3);
    uint64_t k2 = 0;
    EXPECT_SCAPE_OK(scapeMaskGetCount(mask, &k2), c.comm);
    EXPECT_NE(k2, k);
    EXPECT_SCAPE_OK(scapeWait(qd), c.comm);  // out of issue order: completes qa..qc on the way
    EXPECT_SCAPE_OK(scapeWait(qb), c.comm);
    int done = 0;
    EXPECT_SCAPE_OK(scapeTest(qa, &done), c.comm);
    EXPECT_EQ(done, 1) << "a request issued before a completed one must be complete";
    EXPECT_SCAPE_OK(scapeWait(qc), c.comm);
    EXPECT_EQ(std::memcmp(gotA.data(), refA.data(), l.n * 4), 0)
        << "rank " << c.rank << ": async dense in/out (sum)";
    EXPECT_EQ(std::memcmp(gotB.data(), refB.data(), l.n * 4), 0)
        << "rank " << c.rank << ": async dense in/out, in place (max)";
    EXPECT_EQ(std::memcmp(ar2.data(), ar.data(), k * 4), 0) << "async packed all-reduce";
    EXPECT_EQ(std::memcmp(rs2.data(), rs.data(), kr * 4), 0) << "async reduce-scatter";

    // The all-gather is taken on the second mask: sized for k2, then checked against blocking.
    uint64_t kr2 = 0, off2 = 0;
    EXPECT_SCAPE_OK(scapeMaskGetRankCount(mask, c.rank, &kr2, &off2), c.comm);
    std::vector<float> mine(kr2 + 1, 1.5f + static_cast<float>(c.rank)), agB(k2 + 1), agA(k2 + 1);
    EXPECT_SCAPE_OK(
        scapeMaskAllGather(mine.data(), agB.data(), scapeFloat32, mask, c.comm, nullptr), c.comm);
    EXPECT_SCAPE_OK(
        scapeMaskAllGatherAsync(mine.data(), agA.data(), scapeFloat32, mask, c.comm, nullptr, &qe),
        c.comm);
    EXPECT_SCAPE_OK(scapeWait(qe), c.comm);
    EXPECT_EQ(std::memcmp(agA.data(), agB.data(), k2 * 4), 0) << "async all-gather";

    // A dense-in/out request outlives its mask.
    std::vector<float> ref2(l.n, -7.0f), got2(l.n, -7.0f);
    EXPECT_SCAPE_OK(scapeAllReduce(send.data(), ref2.data(), l.n, scapeFloat32, scapeSum, mask,
                                   c.comm, nullptr),
                    c.comm);
    scapeRequest_t qf = nullptr;
    EXPECT_SCAPE_OK(scapeAllReduceAsync(send.data(), got2.data(), l.n, scapeFloat32, scapeSum, mask,
                                        c.comm, nullptr, &qf),
                    c.comm);
    EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
    EXPECT_SCAPE_OK(scapeWait(qf), c.comm);
    EXPECT_EQ(std::memcmp(got2.data(), ref2.data(), l.n * 4), 0)
        << "async request after its mask was destroyed";
    // The destroyed handle is refused, not used.
    scapeRequest_t qg = nullptr;
    EXPECT_EQ(scapeMaskAllReducePackedAsync(packed.data(), ar2.data(), scapeFloat32, scapeSum, mask,
                                            c.comm, nullptr, &qg),
              scapeInvalidArgument);
    EXPECT_EQ(qg, nullptr);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Mask, AsyncFormsP1) { AsyncCase(1); }
TEST(Mask, AsyncFormsP3) { AsyncCase(3); }

// The 32-bit index encoding cannot describe an owned part of more than 2^32 elements: the
// start refuses it at once (nothing is allocated for n here).
TEST(Mask, IndexEncodingRefusesHugeOwnedParts) {
  RunResult res = RunRanks(1, [&](RankCtx& c) {
    const uint64_t n = (uint64_t{1} << 32) + 5;
    const uint64_t offs[] = {0, n};
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeMaskCreate(&mask, n, 1, offs, nullptr, scapeOwnershipShards,
                                    scapeMaskEncodingIndices, c.comm),
                    c.comm);
    if (!mask) return false;
    const uint64_t idx[] = {3, n - 1};
    EXPECT_SCAPE_OK(scapeMaskSetNextIndices(mask, idx, 2), c.comm);
    EXPECT_EQ(scapeMaskSyncStart(mask), scapeInvalidUsage);
    EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommAbort takes the communicator's masks with it, even with a sync in flight.
TEST(Mask, AbortWithALiveMask) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l = MakeLayout();
    scapeMask_t mask = nullptr;
    EXPECT_SCAPE_OK(scapeMaskCreate(&mask, l.n, static_cast<int>(l.offs.size() - 1), l.offs.data(),
                                    nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, c.comm),
                    c.comm);
    EXPECT_SCAPE_OK(scapeMaskSetNextIndices(mask, nullptr, 0), c.comm);
    EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
    EXPECT_SCAPE_OK(scapeBarrier(c.comm), c.comm);
    EXPECT_EQ(scapeCommAbort(c.comm), scapeSuccess);
    c.comm = nullptr;
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Mask, DifferentLayoutsAreReportedOnEveryRank) {
  RunResult res = RunRanks(3, [&](RankCtx& c) {
    Layout l = MakeLayout();
    if (c.rank == 1) l.offs[3] += 1;
    scapeMask_t mask = nullptr;
    scapeResult_t r =
        scapeMaskCreate(&mask, l.n, static_cast<int>(l.offs.size() - 1), l.offs.data(),
                        l.dense.data(), scapeOwnershipShards, scapeMaskEncodingAuto, c.comm);
    EXPECT_EQ(r, scapeInvalidUsage) << scapeGetLastError(c.comm);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("different mask layout"),
              std::string::npos)
        << scapeGetLastError(c.comm);
    EXPECT_EQ(mask, nullptr);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(Mask, ArgumentErrors) {
  RunResult res = RunRanks(2, [&](RankCtx& c) {
    Layout l = MakeLayout();
    scapeMask_t mask = nullptr;
    const int ns = static_cast<int>(l.offs.size() - 1);
    EXPECT_EQ(scapeMaskCreate(&mask, l.n, ns, nullptr, nullptr, scapeOwnershipShards,
                              scapeMaskEncodingAuto, c.comm),
              scapeInvalidArgument);
    EXPECT_EQ(scapeMaskCreate(&mask, l.n + 1, ns, l.offs.data(), nullptr, scapeOwnershipShards,
                              scapeMaskEncodingAuto, c.comm),
              scapeInvalidArgument);
    EXPECT_EQ(scapeMaskCreate(&mask, l.n, ns, l.offs.data(), nullptr,
                              static_cast<scapeOwnership_t>(5), scapeMaskEncodingAuto, c.comm),
              scapeInvalidArgument);
    EXPECT_SCAPE_OK(scapeMaskCreate(&mask, l.n, ns, l.offs.data(), nullptr, scapeOwnershipShards,
                                    scapeMaskEncodingEliasFano, c.comm),
                    c.comm);
    if (!mask) return false;
    std::vector<float> stat(l.n, 1.0f);
    EXPECT_EQ(scapeMaskSelectNextTopk(mask, stat.data(), 0.0), scapeInvalidArgument);
    EXPECT_EQ(scapeMaskSelectNextTopk(mask, stat.data(), 1.5), scapeInvalidArgument);
    uint64_t notMine = c.rank == 0 ? l.n - 1 : 0;
    EXPECT_EQ(scapeMaskSetNextIndices(mask, &notMine, 1), scapeInvalidArgument);
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("owned part"), std::string::npos)
        << scapeGetLastError(c.comm);
    uint64_t unsorted[2] = {c.rank == 0 ? 5u : l.n - 2, c.rank == 0 ? 4u : l.n - 3};
    EXPECT_EQ(scapeMaskSetNextIndices(mask, unsorted, 2), scapeInvalidArgument);
    EXPECT_EQ(scapeMaskAdvance(mask), scapeInvalidUsage);
    std::vector<float> a(l.n), b(l.n);
    EXPECT_EQ(
        scapeAllReduce(a.data(), b.data(), l.n - 1, scapeFloat32, scapeSum, mask, c.comm, nullptr),
        scapeInvalidArgument);
    EXPECT_EQ(scapeCommDestroy(c.comm), scapeInvalidUsage) << "destroy with a live mask";
    EXPECT_NE(std::string(scapeGetLastError(c.comm)).find("mask"), std::string::npos);
    EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The SCAPE step of the design brief, driven by the test: candidate, next mask from the owned
// part, payload at the current mask, exchange, residual, momentum, AdamS update, weight decay,
// one-step-delayed mask. Parameters must stay bit-identical on every rank for 50 steps, and the
// sharded flow (reduce-scatter, owner update, values-only all-gather) must give exactly the
// replicated flow's parameters.
struct StepResult {
  std::vector<float> theta;
};

StepResult RunScape(RankCtx& c, scapeOwnership_t own, bool sharded, unsigned seed, int steps) {
  const float b1 = 0.9f, b2 = 0.95f, lr = 1e-2f, eps = 1e-8f, wd = 0.1f;
  const double density = 0.05;
  Layout l = MakeLayout();
  const uint64_t n = l.n;
  scapeMask_t mask = nullptr;
  EXPECT_SCAPE_OK(scapeMaskCreate(&mask, n, static_cast<int>(l.offs.size() - 1), l.offs.data(),
                                  l.dense.data(), own, scapeMaskEncodingAuto, c.comm),
                  c.comm);
  StepResult out;
  if (!mask) return out;
  std::vector<float> theta(n), m(n, 0.0f), e(n, 0.0f), g(n), cand(n);
  for (uint64_t i = 0; i < n; ++i)
    theta[i] = static_cast<float>(InputValue(scapeFloat32, seed, 0, i));
  auto gradient = [&](int t) {
    for (uint64_t i = 0; i < n; ++i)
      g[i] =
          0.1f * theta[i] + static_cast<float>(InputValue(
                                scapeFloat32, seed + 1000u + static_cast<unsigned>(t), c.rank, i));
  };
  auto candidate = [&]() {
    for (uint64_t i = 0; i < n; ++i) cand[i] = b1 * m[i] + (1.0f - b1) * g[i] + e[i];
  };
  // Step 0's mask: chosen from the first candidate, synchronised before the loop.
  gradient(0);
  candidate();
  EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(mask, cand.data(), density), c.comm);
  EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
  EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
  EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
  for (int t = 1; t <= steps; ++t) {
    gradient(t);
    candidate();
    // Next mask from this step's candidate, synchronised in the background.
    EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(mask, cand.data(), density), c.comm);
    EXPECT_SCAPE_OK(scapeMaskSyncStart(mask), c.comm);
    uint64_t k = 0, kr = 0, off = 0;
    scapeMaskGetCount(mask, &k);
    scapeMaskGetRankCount(mask, c.rank, &kr, &off);
    std::vector<uint64_t> idx(k);
    scapeMaskGetIndices(mask, idx.data(), k);
    std::vector<float> payload(k + 1), mt(k + 1);
    EXPECT_SCAPE_OK(scapeMaskPack(mask, cand.data(), payload.data(), scapeFloat32), c.comm);
    // Residual keeps what was not sent; momentum is zero outside the mask.
    std::vector<float> mPrev = m;
    for (uint64_t i = 0; i < n; ++i) {
      e[i] = cand[i];
      m[i] = 0.0f;
    }
    for (uint64_t q : idx) e[q] = 0.0f;
    for (uint64_t i = 0; i < n; ++i) theta[i] *= (1.0f - lr * wd);
    auto update = [&](uint64_t q, float mNew) {
      float gh = (mNew - b1 * mPrev[q]) / (1.0f - b1);
      float v = b2 * mPrev[q] * mPrev[q] + (1.0f - b2) * gh * gh;
      return theta[q] - lr * mNew / (std::sqrt(v) + eps);
    };
    if (!sharded) {
      EXPECT_SCAPE_OK(scapeMaskAllReducePacked(payload.data(), mt.data(), scapeFloat32, scapeAvg,
                                               mask, c.comm, nullptr),
                      c.comm);
      for (uint64_t j = 0; j < k; ++j) {
        theta[idx[j]] = update(idx[j], mt[j]);
        m[idx[j]] = mt[j];
      }
    } else {
      std::vector<float> mine(kr + 1), newTheta(kr + 1), allTheta(k + 1);
      EXPECT_SCAPE_OK(scapeMaskReduceScatter(payload.data(), mine.data(), scapeFloat32, scapeAvg,
                                             mask, c.comm, nullptr),
                      c.comm);
      for (uint64_t j = 0; j < kr; ++j) newTheta[j] = update(idx[off + j], mine[j]);
      EXPECT_SCAPE_OK(
          scapeMaskAllGather(newTheta.data(), allTheta.data(), scapeFloat32, mask, c.comm, nullptr),
          c.comm);
      EXPECT_SCAPE_OK(scapeMaskUnpack(mask, allTheta.data(), theta.data(), scapeFloat32), c.comm);
      // The owner's momentum is all a sharded optimizer keeps; the test tracks it everywhere
      // through the same all-gather to compare with the replicated flow.
      std::vector<float> allM(k + 1);
      EXPECT_SCAPE_OK(
          scapeMaskAllGather(mine.data(), allM.data(), scapeFloat32, mask, c.comm, nullptr),
          c.comm);
      for (uint64_t j = 0; j < k; ++j) m[idx[j]] = allM[j];
    }
    EXPECT_SCAPE_OK(scapeMaskSyncWait(mask), c.comm);
    EXPECT_SCAPE_OK(scapeMaskAdvance(mask), c.comm);
    if (!SameOnAllRanks(c, theta.data(), theta.size() * 4)) {
      ADD_FAILURE() << "parameters differ between ranks after step " << t;
      break;
    }
  }
  EXPECT_SCAPE_OK(scapeMaskDestroy(mask), c.comm);
  out.theta = std::move(theta);
  return out;
}

void ScapeStepCase(int P) {
  const unsigned seed = FreshSeed() + 77u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    StepResult rep = RunScape(c, scapeOwnershipShards, false, seed, 50);
    StepResult sh = RunScape(c, scapeOwnershipShards, true, seed, 50);
    EXPECT_EQ(rep.theta.size(), sh.theta.size());
    EXPECT_TRUE(rep.theta == sh.theta) << "sharded parameters differ from replicated ones";
    StepResult seg = RunScape(c, scapeOwnershipSegments, false, seed, 50);
    EXPECT_EQ(seg.theta.size(), rep.theta.size());
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST(ScapeStep, FiftyStepsP3) { ScapeStepCase(3); }
TEST(ScapeStep, FiftyStepsP4) { ScapeStepCase(4); }

// The generic sparse all-reduce (no agreed mask) against a dense reference, both methods.
TEST(SparseAllReduce, MatchesDense) {
  for (int P : {1, 2, 3, 5}) {
    const unsigned seed = FreshSeed() + 900u + static_cast<unsigned>(P);
    RunResult res = RunRanks(P, [&](RankCtx& c) {
      for (double density : {0.0, 0.001, 0.05, 0.6})
        for (scapeSparseAlgo_t algo : {scapeSparseAllGather, scapeSparseRecursiveDoubling})
          for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeFloat16}) {
            const uint64_t n = 4099;
            const size_t esz = scapeTypeSize(t);
            std::vector<uint64_t> idx;
            std::vector<char> vals;
            std::vector<double> mineDense(n, 0.0);
            for (uint64_t i = 0; i < n; ++i) {
              double u =
                  (SplitMix(seed * 7919ull + static_cast<uint64_t>(c.rank) * 1000003ull + i) >>
                   11) *
                  (1.0 / 9007199254740992.0);
              if (u >= density) continue;
              idx.push_back(i);
              vals.resize(vals.size() + esz);
              Store(t, vals.data() + vals.size() - esz, 0, InputValue(t, seed, c.rank, i));
            }
            std::vector<char> dense(n * esz);
            std::vector<uint64_t> outIdx(n);
            std::vector<char> outVals(n * esz);
            size_t outNnz = 0;
            uint64_t sent = 0;
            scapeResult_t r = scapeSparseAllReduce(idx.data(), vals.data(), idx.size(), n, t,
                                                   scapeSum, algo, dense.data(), outIdx.data(),
                                                   outVals.data(), n, &outNnz, &sent, c.comm);
            EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(c.comm);
            if (r != scapeSuccess) return false;
            // Reference: sum over ranks of each rank's entries (absent = 0).
            size_t bad = 0;
            for (uint64_t i = 0; i < n; ++i) {
              double ref = 0, abs = 0;
              for (int q = 0; q < c.nranks; ++q) {
                double u =
                    (SplitMix(seed * 7919ull + static_cast<uint64_t>(q) * 1000003ull + i) >> 11) *
                    (1.0 / 9007199254740992.0);
                if (u >= density) continue;
                double v = InputValue(t, seed, q, i);
                ref += v;
                abs += std::fabs(v);
              }
              double tol = (c.nranks + 1) * Eps(t) * abs + 1e-30;
              if (!(std::fabs(Load(t, dense.data(), i) - ref) <= tol)) ++bad;
            }
            EXPECT_EQ(bad, 0u) << "P=" << P << " density " << density << " algo " << algo
                               << " dtype " << t;
            EXPECT_TRUE(SameOnAllRanks(c, dense.data(), dense.size()));
            EXPECT_LE(outNnz, n);
            for (size_t j = 0; j < outNnz; ++j)
              EXPECT_EQ(std::memcmp(outVals.data() + j * esz, dense.data() + outIdx[j] * esz, esz),
                        0);
          }
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << " " << res.Describe();
  }
}

}  // namespace
}  // namespace scape_test
