// Dense collectives across P forked ranks over real UCX on loopback, against a double-precision
// reference on fresh random inputs: P in {1, 2, 3, 4, 8} x counts {0, 1, 7, 1000, 2^20 + 3} x
// dtypes x ops, in place and out of place; every rank must end with identical bits (so an
// all-reduce's result is checked against the reference once, each rank taking a slice).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/harness.h"
#include "tests/test_util.h"

namespace scape_test {
namespace {

const scapeDataType_t kTypes[] = {scapeFloat32, scapeFloat16, scapeBfloat16, scapeInt32,
                                  scapeInt64};
const scapeRedOp_t kOps[] = {scapeSum, scapeAvg, scapeMax, scapeMin};
const size_t kSmallCounts[] = {0, 1, 7, 1000};
const size_t kBigCount = (size_t{1} << 20) + 3;

std::string Name(scapeDataType_t t, scapeRedOp_t op, size_t n, bool inPlace) {
  static const char* tn[] = {"f32", "f16", "bf16", "i32", "i64"};
  static const char* on[] = {"sum", "avg", "max", "min"};
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s/%s/n=%zu/%s", tn[t], on[op], n,
                inPlace ? "inplace" : "outofplace");
  return buf;
}

// All ranks must hold identical bits: all-gather a hash of the result and compare.
bool SameOnAllRanks(RankCtx& c, const void* buf, size_t bytes, const std::string& what) {
  std::vector<int64_t> hashes(static_cast<size_t>(c.nranks));
  int64_t mine = static_cast<int64_t>(HashBytes(buf, bytes));
  scapeResult_t r = scapeAllGather(&mine, hashes.data(), 1, scapeInt64, c.comm, nullptr);
  EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(c.comm);
  for (int64_t h : hashes)
    if (h != mine) {
      ADD_FAILURE() << what << ": rank " << c.rank << " result differs from another rank's";
      return false;
    }
  return true;
}

size_t CountBad(RankCtx& c, scapeDataType_t t, scapeRedOp_t op, unsigned seed, const void* got,
                size_t n, size_t refOffset, const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    Ref ref = Reference(t, op, seed, c.nranks, refOffset + i);
    double v = Load(t, got, i);
    if (!(std::fabs(v - ref.value) <= ref.tol)) {
      if (bad == 0)
        ADD_FAILURE() << what << " rank " << c.rank << " element " << i << ": got " << v
                      << ", expected " << ref.value << " +- " << ref.tol;
      ++bad;
    }
  }
  return bad;
}

bool AllReduceCase(RankCtx& c, scapeDataType_t t, scapeRedOp_t op, size_t n, bool inPlace,
                   unsigned seed) {
  const std::string what = "allreduce " + Name(t, op, n, inPlace);
  const size_t esz = scapeTypeSize(t);
  std::vector<char> send(n * esz + 1), recv(n * esz + 1, 0x5a);
  for (size_t i = 0; i < n; ++i) Store(t, send.data(), i, InputValue(t, seed, c.rank, i));
  const uint64_t sendHash = HashBytes(send.data(), n * esz);
  scapeResult_t r;
  if (inPlace) {
    recv = send;
    r = scapeAllReduce(recv.data(), recv.data(), n, t, op, nullptr, c.comm, nullptr);
  } else {
    r = scapeAllReduce(send.data(), recv.data(), n, t, op, nullptr, c.comm, nullptr);
    EXPECT_EQ(HashBytes(send.data(), n * esz), sendHash) << what << ": sendbuf was modified";
  }
  EXPECT_EQ(r, scapeSuccess) << what << ": " << scapeGetLastError(c.comm);
  if (r != scapeSuccess) return false;
  EXPECT_EQ(recv[n * esz], inPlace ? send[n * esz] : 0x5a) << what << ": wrote past the end";
  // Every element against the reference once, split across the ranks (the reference costs
  // nranks inputs per element: 8 ranks each checking all 2^20 elements took ~40 s under ASan),
  // and every rank's result bit-identical to the others': together, every rank's every element.
  const size_t P = static_cast<size_t>(c.nranks), me = static_cast<size_t>(c.rank);
  const size_t lo = n * me / P, hi = n * (me + 1) / P;
  const std::string slice = what + " (elements " + std::to_string(lo) + ".." + std::to_string(hi) +
                            ", checked on rank " + std::to_string(me) + ")";
  EXPECT_EQ(CountBad(c, t, op, seed, recv.data() + lo * esz, hi - lo, lo, slice), 0u) << slice;
  return SameOnAllRanks(c, recv.data(), n * esz, what);
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceSweep) {
  const int P = GetParam();
  const unsigned seed = FreshSeed() + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    for (scapeDataType_t t : kTypes)
      for (scapeRedOp_t op : kOps)
        for (size_t n : kSmallCounts)
          for (bool inPlace : {false, true})
            if (!AllReduceCase(c, t, op, n, inPlace, seed)) return false;
    // The large count goes through the pipelined ring: every type once, both placements, and
    // every op on fp32.
    for (scapeDataType_t t : kTypes)
      if (!AllReduceCase(c, t, scapeSum, kBigCount, t == scapeFloat16, seed)) return false;
    for (scapeRedOp_t op : {scapeAvg, scapeMax, scapeMin})
      if (!AllReduceCase(c, scapeFloat32, op, kBigCount, op == scapeMax, seed)) return false;
    if (!AllReduceCase(c, scapeBfloat16, scapeAvg, kBigCount, true, seed)) return false;
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(Collectives, ReduceScatterSweep) {
  const int P = GetParam();
  const unsigned seed = FreshSeed() + 100u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    for (scapeDataType_t t : {scapeFloat32, scapeFloat16, scapeBfloat16, scapeInt64})
      for (scapeRedOp_t op : kOps)
        for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, kBigCount / 4})
          for (bool inPlace : {false, true}) {
            if (n == kBigCount / 4 && op != scapeSum && t != scapeFloat32) continue;
            const std::string what = "reducescatter " + Name(t, op, n, inPlace);
            const size_t esz = scapeTypeSize(t), total = n * static_cast<size_t>(c.nranks);
            std::vector<char> send(total * esz), recv(n * esz);
            for (size_t i = 0; i < total; ++i)
              Store(t, send.data(), i, InputValue(t, seed, c.rank, i));
            char* out = inPlace ? send.data() + static_cast<size_t>(c.rank) * n * esz : recv.data();
            scapeResult_t r = scapeReduceScatter(send.data(), out, n, t, op, c.comm, nullptr);
            EXPECT_EQ(r, scapeSuccess) << what << ": " << scapeGetLastError(c.comm);
            if (r != scapeSuccess) return false;
            EXPECT_EQ(CountBad(c, t, op, seed, out, n, static_cast<size_t>(c.rank) * n, what), 0u);
          }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(Collectives, AllGatherSweep) {
  const int P = GetParam();
  const unsigned seed = FreshSeed() + 200u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16, scapeInt32})
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, kBigCount / 4})
        for (bool inPlace : {false, true}) {
          const std::string what = "allgather " + Name(t, scapeSum, n, inPlace);
          const size_t esz = scapeTypeSize(t), total = n * static_cast<size_t>(c.nranks);
          std::vector<char> send(n * esz), recv(total * esz, 0x11);
          for (size_t i = 0; i < n; ++i) Store(t, send.data(), i, InputValue(t, seed, c.rank, i));
          const char* in = send.data();
          if (inPlace) {
            if (n > 0)
              std::memcpy(recv.data() + static_cast<size_t>(c.rank) * n * esz, send.data(),
                          n * esz);
            in = recv.data() + static_cast<size_t>(c.rank) * n * esz;
          }
          scapeResult_t r = scapeAllGather(in, recv.data(), n, t, c.comm, nullptr);
          EXPECT_EQ(r, scapeSuccess) << what << ": " << scapeGetLastError(c.comm);
          if (r != scapeSuccess) return false;
          size_t bad = 0;
          for (int src = 0; src < c.nranks; ++src)
            for (size_t i = 0; i < n; ++i)
              if (Load(t, recv.data(), static_cast<size_t>(src) * n + i) !=
                  InputValue(t, seed, src, i))
                ++bad;
          EXPECT_EQ(bad, 0u) << what << " rank " << c.rank;
        }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

TEST_P(Collectives, BroadcastAndBarrier) {
  const int P = GetParam();
  const unsigned seed = FreshSeed() + 300u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    for (int root : {0, c.nranks - 1, c.nranks / 2})
      for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, kBigCount}) {
        const std::string what =
            "broadcast root=" + std::to_string(root) + " n=" + std::to_string(n);
        std::vector<float> buf(n, -1.0f);
        if (c.rank == root)
          for (size_t i = 0; i < n; ++i)
            buf[i] = static_cast<float>(InputValue(scapeFloat32, seed, root, i));
        scapeResult_t r =
            scapeBroadcast(buf.data(), buf.data(), n, scapeFloat32, root, c.comm, nullptr);
        EXPECT_EQ(r, scapeSuccess) << what << ": " << scapeGetLastError(c.comm);
        if (r != scapeSuccess) return false;
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i)
          if (buf[i] != static_cast<float>(InputValue(scapeFloat32, seed, root, i))) ++bad;
        EXPECT_EQ(bad, 0u) << what << " rank " << c.rank;
        EXPECT_SCAPE_OK(scapeBarrier(c.comm), c.comm);
      }
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Non-blocking forms: several operations in flight, completed with scapeTest and scapeWait in
// a different order than they were issued.
TEST_P(Collectives, AsyncRequests) {
  const int P = GetParam();
  const unsigned seed = FreshSeed() + 400u + static_cast<unsigned>(P);
  RunResult res = RunRanks(P, [&](RankCtx& c) {
    const size_t sizes[] = {5, 100000, 3};
    std::vector<std::vector<float>> in(3), out(3);
    scapeRequest_t req[3];
    for (int k = 0; k < 3; ++k) {
      in[k].resize(sizes[k]);
      out[k].assign(sizes[k], 0.0f);
      for (size_t i = 0; i < sizes[k]; ++i)
        in[k][i] = static_cast<float>(
            InputValue(scapeFloat32, seed + static_cast<unsigned>(k), c.rank, i));
      EXPECT_SCAPE_OK(scapeAllReduceAsync(in[k].data(), out[k].data(), sizes[k], scapeFloat32,
                                          scapeSum, nullptr, c.comm, nullptr, &req[k]),
                      c.comm);
    }
    int done = 0;
    scapeResult_t tr;
    while ((tr = scapeTest(req[2], &done)) == scapeInProgress) EXPECT_EQ(done, 0);
    EXPECT_EQ(tr, scapeSuccess) << scapeGetLastError(c.comm);
    EXPECT_EQ(done, 1);
    EXPECT_SCAPE_OK(scapeWait(req[0]), c.comm);
    EXPECT_SCAPE_OK(scapeWait(req[1]), c.comm);
    for (int k = 0; k < 3; ++k)
      EXPECT_EQ(CountBad(c, scapeFloat32, scapeSum, seed + static_cast<unsigned>(k), out[k].data(),
                         sizes[k], 0, "async"),
                0u);
    scapeRequest_t b;
    EXPECT_SCAPE_OK(scapeBarrierAsync(c.comm, &b), c.comm);
    EXPECT_EQ(scapeCommDestroy(c.comm), scapeInvalidUsage) << "destroy with a live request";
    EXPECT_SCAPE_OK(scapeWait(b), c.comm);
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The same all-reduce over UCX's TCP transport only, the path ranks on different hosts take.
TEST(CollectivesOverTcp, AllReduceP3) {
  setenv("SCAPE_LOCAL_SHM", "0", 1);
  const unsigned seed = FreshSeed() + 500u;
  RunResult res = RunRanks(3, [&](RankCtx& c) {
    for (scapeDataType_t t : {scapeFloat32, scapeBfloat16})
      for (size_t n : {size_t{7}, kBigCount})
        if (!AllReduceCase(c, t, scapeSum, n, false, seed)) return false;
    return true;
  });
  unsetenv("SCAPE_LOCAL_SHM");
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace scape_test
