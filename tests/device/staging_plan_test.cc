// The staging plan (plugin/device/staging.h) on its own: for every collective, random sizes,
// rank counts and chunk sizes, P simulated ranks stage their buffers chunk by chunk as the
// plan says, a reference collective runs on each chunk's staged bytes, the results are copied
// back as the plan says, and the outcome must equal the reference collective on the whole
// buffers. Plus the plan's own invariants (every byte copied exactly once).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "plugin/device/staging.h"
#include "tests/harness.h"

namespace {

using scape::coll::CollArgs;
using scape::coll::CollType;
using scape::device::StagePlan;

// Reference collectives on int32 (exact sums), P ranks' buffers.
std::vector<std::vector<int32_t>> Reference(CollType t, const std::vector<std::vector<int32_t>>& in,
                                            size_t n, int root) {
  const size_t P = in.size();
  std::vector<std::vector<int32_t>> out(P);
  for (size_t r = 0; r < P; ++r) {
    switch (t) {
      case CollType::kAllReduce:
        out[r].assign(n, 0);
        for (size_t q = 0; q < P; ++q)
          for (size_t i = 0; i < n; ++i) out[r][i] += in[q][i];
        break;
      case CollType::kBroadcast:
        out[r].assign(in[static_cast<size_t>(root)].begin(),
                      in[static_cast<size_t>(root)].begin() + static_cast<std::ptrdiff_t>(n));
        break;
      case CollType::kReduceScatter:
        out[r].assign(n, 0);
        for (size_t q = 0; q < P; ++q)
          for (size_t i = 0; i < n; ++i) out[r][i] += in[q][r * n + i];
        break;
      default:  // all-gather
        out[r].resize(P * n);
        for (size_t q = 0; q < P; ++q)
          for (size_t i = 0; i < n; ++i) out[r][q * n + i] = in[q][i];
        break;
    }
  }
  return out;
}

void Apply(const std::vector<scape::device::StageCopy>& copies, char* dst, size_t dstBytes,
           const char* src, size_t srcBytes, std::vector<int>* dstCover) {
  for (const auto& c : copies) {
    ASSERT_LE(c.dst + c.bytes, dstBytes);
    ASSERT_LE(c.src + c.bytes, srcBytes);
    std::memcpy(dst + c.dst, src + c.src, c.bytes);
    for (size_t b = c.dst; b < c.dst + c.bytes; ++b) ++(*dstCover)[b];
  }
}

void CheckCase(CollType t, int P, size_t n, size_t chunkBytes, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << scape::coll::CollName(t) << " P=" << P << " n=" << n
                                    << " chunkBytes=" << chunkBytes);
  const size_t esz = 4, Pz = static_cast<size_t>(P);
  const int root = P > 1 ? static_cast<int>(rng() % static_cast<unsigned>(P)) : 0;
  const size_t sendN = t == CollType::kReduceScatter ? Pz * n : n;
  const size_t recvN = t == CollType::kAllGather ? Pz * n : n;
  std::vector<std::vector<int32_t>> send(Pz), recv(Pz);
  for (auto& v : send) {
    v.resize(sendN);
    for (auto& x : v) x = static_cast<int32_t>(rng() % 2001) - 1000;
  }
  for (auto& v : recv) v.assign(recvN, -7);
  std::vector<StagePlan> plans(Pz);
  CollArgs a;
  a.type = t;
  a.count = n;
  a.dtype = scapeInt32;
  a.op = scapeSum;
  a.root = root;
  for (int r = 0; r < P; ++r)
    ASSERT_TRUE(
        scape::device::MakeStagePlan(a, r, P, chunkBytes, &plans[static_cast<size_t>(r)]).ok());
  const size_t nchunks = plans[0].chunks.size();
  ASSERT_GE(nchunks, 1u);
  if (n > 0) {
    // About chunkBytes per chunk, at least one element per block.
    size_t per = std::max<size_t>(
        1,
        chunkBytes / esz / ((t == CollType::kReduceScatter || t == CollType::kAllGather) ? Pz : 1));
    // ... and at most kMaxStageChunks chunks (bigger chunks instead).
    per = std::max(per, (n + scape::device::kMaxStageChunks - 1) / scape::device::kMaxStageChunks);
    EXPECT_EQ(nchunks, (n + per - 1) / per);
    EXPECT_LE(nchunks, scape::device::kMaxStageChunks);
  }
  std::vector<std::vector<char>> sstage(Pz), rstage(Pz);
  std::vector<std::vector<int>> scover(Pz), rcover(Pz);
  for (size_t r = 0; r < Pz; ++r) {
    ASSERT_EQ(plans[r].chunks.size(), nchunks) << "ranks disagree on the chunks";
    sstage[r].assign(plans[r].sendStageBytes, 0);
    rstage[r].assign(plans[r].recvStageBytes, 0);
    scover[r].assign(plans[r].sendStageBytes, 0);
    rcover[r].assign(recvN * esz, 0);
  }
  for (size_t c = 0; c < nchunks; ++c) {
    // Stage, run the reference on the chunk's staged bytes, copy back.
    std::vector<std::vector<int32_t>> chunkIn(Pz);
    const size_t cn = plans[0].chunks[c].count;
    for (size_t r = 0; r < Pz; ++r) {
      const auto& ch = plans[r].chunks[c];
      ASSERT_EQ(ch.count, cn);
      Apply(ch.d2h, sstage[r].data(), sstage[r].size(),
            reinterpret_cast<const char*>(send[r].data()), sendN * esz, &scover[r]);
      const size_t inN = t == CollType::kReduceScatter ? Pz * cn : cn;
      chunkIn[r].resize(inN);
      if (ch.hasSend && inN)
        std::memcpy(chunkIn[r].data(), sstage[r].data() + ch.sendOff, inN * esz);
    }
    auto chunkOut = Reference(t, chunkIn, cn, root);
    for (size_t r = 0; r < Pz; ++r) {
      const auto& ch = plans[r].chunks[c];
      if (!chunkOut[r].empty())
        std::memcpy(rstage[r].data() + ch.recvOff, chunkOut[r].data(), chunkOut[r].size() * esz);
      Apply(ch.h2d, reinterpret_cast<char*>(recv[r].data()), recvN * esz, rstage[r].data(),
            rstage[r].size(), &rcover[r]);
    }
  }
  auto want = Reference(t, send, n, root);
  for (size_t r = 0; r < Pz; ++r) {
    EXPECT_EQ(recv[r], want[r]) << "rank " << r;
    for (size_t b = 0; b < rcover[r].size(); ++b)
      ASSERT_EQ(rcover[r][b], 1) << "rank " << r << ": receive byte " << b << " written "
                                 << rcover[r][b] << " times";
    const bool hasSend = t != CollType::kBroadcast || static_cast<int>(r) == root;
    for (size_t b = 0; b < scover[r].size(); ++b)
      ASSERT_EQ(scover[r][b], hasSend ? 1 : 0) << "rank " << r << ": send stage byte " << b;
  }
}

TEST(StagePlan, EveryCollectiveMatchesTheReferenceChunkByChunk) {
  std::mt19937 rng(scape_test::FreshSeed());
  for (CollType t :
       {CollType::kAllReduce, CollType::kReduceScatter, CollType::kAllGather, CollType::kBroadcast})
    for (int P : {1, 2, 3, 5})
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{4099}})
        for (size_t chunk : {size_t{4}, size_t{12}, size_t{4096}, size_t{1} << 22})
          CheckCase(t, P, n, chunk, rng);
}

// Per-rank blocks (the packed values of a mask): every rank's plan is one chunk whose host
// collective is the whole V collective; staging, a reference V collective on the stages and
// copying back must give the reference V collective on the whole buffers.
TEST(StagePlan, PerRankBlocksAreOneChunkAndMatchTheReference) {
  std::mt19937 rng(scape_test::FreshSeed());
  for (CollType t : {CollType::kAllReduce, CollType::kReduceScatter, CollType::kAllGather})
    for (int P : {1, 2, 3, 5})
      for (int trial = 0; trial < 6; ++trial) {
        const size_t Pz = static_cast<size_t>(P);
        std::vector<size_t> counts(Pz);
        size_t total = 0;
        for (auto& c : counts) total += (c = trial == 0 ? 0 : rng() % (trial == 1 ? 2 : 300));
        std::vector<size_t> off(Pz, 0);
        for (size_t r = 1; r < Pz; ++r) off[r] = off[r - 1] + counts[r - 1];
        SCOPED_TRACE(::testing::Message()
                     << scape::coll::CollName(t) << " P=" << P << " total=" << total);
        auto sendN = [&](size_t r) { return t == CollType::kAllGather ? counts[r] : total; };
        auto recvN = [&](size_t r) { return t == CollType::kReduceScatter ? counts[r] : total; };
        std::vector<std::vector<int32_t>> send(Pz), recv(Pz), want(Pz);
        for (size_t r = 0; r < Pz; ++r) {
          send[r].resize(sendN(r));
          for (auto& x : send[r]) x = static_cast<int32_t>(rng() % 2001) - 1000;
          recv[r].assign(recvN(r), -7);
        }
        // The reference V collective.
        for (size_t r = 0; r < Pz; ++r) {
          want[r].assign(recvN(r), 0);
          for (size_t q = 0; q < Pz; ++q)
            for (size_t i = 0; i < want[r].size(); ++i) {
              if (t == CollType::kAllReduce) want[r][i] += send[q][i];
              if (t == CollType::kReduceScatter) want[r][i] += send[q][off[r] + i];
            }
          if (t == CollType::kAllGather)
            for (size_t q = 0; q < Pz; ++q)
              for (size_t i = 0; i < counts[q]; ++i) want[r][off[q] + i] = send[q][i];
        }
        CollArgs a;
        a.type = t;
        a.count = 12345;  // ignored with counts
        a.counts = counts;
        a.dtype = scapeInt32;
        std::vector<StagePlan> plans(Pz);
        std::vector<std::vector<char>> sstage(Pz), rstage(Pz);
        for (size_t r = 0; r < Pz; ++r) {
          ASSERT_TRUE(
              scape::device::MakeStagePlan(a, static_cast<int>(r), P, 4096, &plans[r]).ok());
          ASSERT_EQ(plans[r].chunks.size(), 1u);
          ASSERT_EQ(plans[r].chunks[0].count, total);
          ASSERT_EQ(plans[r].sendStageBytes, sendN(r) * 4);
          ASSERT_EQ(plans[r].recvStageBytes, recvN(r) * 4);
          sstage[r].assign(plans[r].sendStageBytes, 0);
          rstage[r].assign(plans[r].recvStageBytes, 0);
          std::vector<int> cover(plans[r].sendStageBytes, 0);
          Apply(plans[r].chunks[0].d2h, sstage[r].data(), sstage[r].size(),
                reinterpret_cast<const char*>(send[r].data()), sendN(r) * 4, &cover);
          for (int c : cover) ASSERT_EQ(c, 1);
        }
        // The V collective on the stages (the reference again, on the staged bytes).
        for (size_t r = 0; r < Pz; ++r) {
          std::vector<int32_t> out(recvN(r), 0);
          for (size_t q = 0; q < Pz; ++q) {
            const auto* in = reinterpret_cast<const int32_t*>(sstage[q].data());
            for (size_t i = 0; i < out.size(); ++i) {
              if (t == CollType::kAllReduce) out[i] += in[i];
              if (t == CollType::kReduceScatter) out[i] += in[off[r] + i];
            }
            if (t == CollType::kAllGather)
              for (size_t i = 0; i < counts[q]; ++i) out[off[q] + i] = in[i];
          }
          if (!out.empty()) std::memcpy(rstage[r].data(), out.data(), out.size() * 4);
          std::vector<int> cover(recvN(r) * 4, 0);
          Apply(plans[r].chunks[0].h2d, reinterpret_cast<char*>(recv[r].data()), recvN(r) * 4,
                rstage[r].data(), rstage[r].size(), &cover);
          for (int c : cover) ASSERT_EQ(c, 1);
          EXPECT_EQ(recv[r], want[r]) << "rank " << r;
        }
      }
}

TEST(StagePlan, RejectsWhatItCannotStage) {
  StagePlan plan;
  CollArgs a;
  a.type = CollType::kBarrier;
  EXPECT_EQ(scape::device::MakeStagePlan(a, 0, 2, 4096, &plan).code(), scapeUnsupported);
  a.type = CollType::kAllReduce;
  a.counts = {1, 2, 3};  // three entries for two ranks
  EXPECT_EQ(scape::device::MakeStagePlan(a, 0, 2, 4096, &plan).code(), scapeInvalidArgument);
  a.type = CollType::kBroadcast;
  a.counts = {1, 2};
  EXPECT_EQ(scape::device::MakeStagePlan(a, 0, 2, 4096, &plan).code(), scapeInvalidArgument);
  a.type = CollType::kAllReduce;
  a.counts = {SIZE_MAX / 8, SIZE_MAX / 8};
  EXPECT_EQ(scape::device::MakeStagePlan(a, 0, 2, 4096, &plan).code(), scapeInvalidArgument);
  a.counts.clear();
  EXPECT_EQ(scape::device::MakeStagePlan(a, 2, 2, 4096, &plan).code(), scapeInvalidArgument);
  a.dtype = static_cast<scapeDataType_t>(99);
  EXPECT_EQ(scape::device::MakeStagePlan(a, 0, 2, 4096, &plan).code(), scapeInvalidArgument);
}

}  // namespace
