// A ring all-reduce over P = 4 processes written only against the net plugin's ABI, the way
// NCCL's proxy uses it: each rank listens for its predecessor and connects to its successor
// (connect and accept polled together on one thread), registers its buffers, and runs a chunked
// reduce-scatter + all-gather with several sends and receives in flight (like NCCL's 8 steps).
// The result is checked exactly against a reference computed from every rank's inputs.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "tests/nccl/fake_nccl.h"

namespace {

using namespace fake_nccl;

constexpr int kRanks = 4;
constexpr int kWindow = 8;             // transfers in flight per direction
constexpr size_t kChunkElems = 16384;  // 64 KiB chunks of float

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Input element i of rank r: a small integer, so float sums are exact in any order.
float Input(int r, size_t i, int iter) {
  return static_cast<float>(
      static_cast<int>((i * 131 + static_cast<size_t>(r) * 7919 + static_cast<size_t>(iter) * 17) %
                       201) -
      100);
}

size_t SegBegin(size_t n, int seg) { return n * static_cast<size_t>(seg) / kRanks; }

struct Ring {
  const ncclNet_v11_t* net;
  int rank;
  void* sc;  // to rank + 1
  void* rc;  // from rank - 1
};

struct Xfer {
  void* req;
  size_t off;  // element offset of the chunk
  size_t len;  // elements
};

// One ring step: send [sendSeg] to the next rank, receive [recvSeg] from the previous one into
// `recvBuf` (tmp for the reduce-scatter, data for the all-gather), chunk by chunk with up to
// kWindow transfers in flight each way. `reduce`: add received chunks into data.
bool Step(Ring& ring, float* data, float* tmp, void* smh, void* rmhData, void* rmhTmp, size_t n,
          int sendSeg, int recvSeg, bool reduce) {
  const ncclNet_v11_t* net = ring.net;
  size_t sb = SegBegin(n, sendSeg), se = SegBegin(n, sendSeg + 1);
  size_t rb = SegBegin(n, recvSeg), re = SegBegin(n, recvSeg + 1);
  auto chunks = [](size_t len) {
    return std::max<size_t>(1, (len + kChunkElems - 1) / kChunkElems);
  };
  size_t nSend = chunks(se - sb), nRecv = chunks(re - rb);
  size_t postedS = 0, postedR = 0, doneS = 0, doneR = 0;
  std::deque<Xfer> sends, recvs;
  int prev = (ring.rank + kRanks - 1) % kRanks;
  int64_t deadline = NowMs() + 30000;
  while (doneS < nSend || doneR < nRecv) {
    if (NowMs() > deadline) {
      ADD_FAILURE() << "rank " << ring.rank << ": ring step timed out";
      return false;
    }
    // Post (NULL request: try again later).
    while (postedR < nRecv && recvs.size() < kWindow) {
      size_t off = rb + postedR * kChunkElems;
      size_t len = std::min(kChunkElems, re - std::min(re, off));
      float* dst = reduce ? tmp + (off - rb) : data + off;
      void* d = dst;
      size_t bytes = len * sizeof(float);
      int tag = prev;  // NCCL tags a transfer with the sender's rank
      void* mh = reduce ? rmhTmp : rmhData;
      void* req = nullptr;
      if (net->irecv(ring.rc, 1, &d, &bytes, &tag, &mh, nullptr, &req) != ncclSuccess) {
        ADD_FAILURE() << "irecv failed";
        return false;
      }
      if (!req) break;
      recvs.push_back({req, off, len});
      ++postedR;
    }
    while (postedS < nSend && sends.size() < kWindow) {
      size_t off = sb + postedS * kChunkElems;
      size_t len = std::min(kChunkElems, se - std::min(se, off));
      void* req = nullptr;
      if (net->isend(ring.sc, data + off, len * sizeof(float), ring.rank, smh, nullptr, &req) !=
          ncclSuccess) {
        ADD_FAILURE() << "isend failed";
        return false;
      }
      if (!req) break;
      sends.push_back({req, off, len});
      ++postedS;
    }
    // Test the oldest of each (the proxy completes steps in order).
    if (!sends.empty()) {
      int done = 0, size = -1;
      if (net->test(sends.front().req, &done, &size) != ncclSuccess) {
        ADD_FAILURE() << "send test failed";
        return false;
      }
      if (done) {
        if (static_cast<size_t>(size) != sends.front().len * sizeof(float)) {
          ADD_FAILURE() << "send size " << size;
          return false;
        }
        sends.pop_front();
        ++doneS;
      }
    }
    if (!recvs.empty()) {
      int done = 0;
      int sizes[64] = {0};
      if (net->test(recvs.front().req, &done, sizes) != ncclSuccess) {
        ADD_FAILURE() << "recv test failed";
        return false;
      }
      if (done) {
        const Xfer& x = recvs.front();
        if (static_cast<size_t>(sizes[0]) != x.len * sizeof(float)) {
          ADD_FAILURE() << "rank " << ring.rank << " received " << sizes[0] << " bytes, expected "
                        << x.len * sizeof(float);
          return false;
        }
        if (reduce)
          for (size_t i = 0; i < x.len; ++i) data[x.off + i] += tmp[x.off - rb + i];
        recvs.pop_front();
        ++doneR;
      }
    }
  }
  return true;
}

// In-place all-reduce (sum) of data[0, n), tmp[0, n) as scratch; both registered.
bool AllReduce(Ring& ring, float* data, float* tmp, size_t n, void* smh, void* rmhData,
               void* rmhTmp) {
  int r = ring.rank;
  for (int s = 0; s < kRanks - 1; ++s)  // reduce-scatter: segment r+1 ends complete on rank r
    if (!Step(ring, data, tmp, smh, rmhData, rmhTmp, n, (r - s + 2 * kRanks) % kRanks,
              (r - s - 1 + 2 * kRanks) % kRanks, true))
      return false;
  for (int s = 0; s < kRanks - 1; ++s)  // all-gather
    if (!Step(ring, data, tmp, smh, rmhData, rmhTmp, n, (r - s + 1 + 2 * kRanks) % kRanks,
              (r - s + 2 * kRanks) % kRanks, false))
      return false;
  return true;
}

TEST(Ring, AllReduceOverFourProcessesMatchesReference) {
  // Element counts: fewer than ranks (empty segments: 0-byte messages), odd sizes, one chunk,
  // many chunks (16 MiB of float).
  const std::vector<size_t> counts = {1, 3, 1000, 16384 * 3 + 5, 262147, (4u << 20) + 3};
  const int kIters = 2;
  std::vector<Pipe> handles(kRanks);  // handles[r]: rank r's listen handle, read by rank r-1
  std::vector<std::function<bool()>> bodies;
  for (int rank = 0; rank < kRanks; ++rank) {
    bodies.push_back([&, rank] {
      Plugin p;
      std::string err;
      REQUIRE(LoadPlugin(&p, &err));
      const ncclNet_v11_t* net = p.v11;
      void* ctx = nullptr;
      REQUIRE_OK(InitCtx(net, &ctx, 0xabcdef));
      char mine[NCCL_NET_HANDLE_MAXSIZE] = {0};
      char next[NCCL_NET_HANDLE_MAXSIZE];
      void* lc = nullptr;
      REQUIRE_OK(net->listen(ctx, 0, mine, &lc));
      REQUIRE(handles[static_cast<size_t>(rank)].Write(mine, sizeof(mine), 20000));
      REQUIRE(handles[static_cast<size_t>((rank + 1) % kRanks)].Read(next, sizeof(next), 20000));
      Ring ring{net, rank, nullptr, nullptr};
      int64_t deadline = NowMs() + 20000;
      while (!ring.sc || !ring.rc) {  // one proxy thread: connect and accept interleaved
        if (!ring.sc) REQUIRE_OK(net->connect(ctx, 0, next, &ring.sc, nullptr));
        if (!ring.rc) REQUIRE_OK(net->accept(lc, &ring.rc, nullptr));
        REQUIRE(NowMs() < deadline);
      }
      REQUIRE_OK(net->closeListen(lc));
      size_t maxN = counts.back();
      std::vector<float> data(maxN), tmp(maxN);
      void *smh, *rmhData, *rmhTmp;
      REQUIRE_OK(net->regMr(ring.sc, data.data(), maxN * sizeof(float), NCCL_PTR_HOST, &smh));
      REQUIRE_OK(net->regMr(ring.rc, data.data(), maxN * sizeof(float), NCCL_PTR_HOST, &rmhData));
      REQUIRE_OK(net->regMr(ring.rc, tmp.data(), maxN * sizeof(float), NCCL_PTR_HOST, &rmhTmp));
      for (size_t n : counts) {
        for (int it = 0; it < kIters; ++it) {
          for (size_t i = 0; i < n; ++i) data[i] = Input(rank, i, it);
          int64_t t0 = NowMs();
          REQUIRE(AllReduce(ring, data.data(), tmp.data(), n, smh, rmhData, rmhTmp));
          size_t bad = n;
          for (size_t i = 0; i < n && bad == n; ++i) {
            float want = 0;
            for (int r = 0; r < kRanks; ++r) want += Input(r, i, it);
            if (data[i] != want) bad = i;
          }
          EXPECT_EQ(bad, n) << "rank " << rank << " n " << n << ": element " << bad << " = "
                            << (bad < n ? data[bad] : 0.0f);
          if (rank == 0 && it == kIters - 1)
            std::printf("ring all-reduce, %d ranks, %zu floats: %lld ms\n", kRanks, n,
                        static_cast<long long>(NowMs() - t0));
        }
      }
      REQUIRE_OK(net->deregMr(ring.sc, smh));
      REQUIRE_OK(net->deregMr(ring.rc, rmhData));
      REQUIRE_OK(net->deregMr(ring.rc, rmhTmp));
      REQUIRE_OK(net->closeSend(ring.sc));
      REQUIRE_OK(net->closeRecv(ring.rc));
      REQUIRE_OK(net->finalize(ctx));
      return true;
    });
  }
  std::string report;
  EXPECT_TRUE(RunProcs(bodies, 100000, &report)) << report;
}

}  // namespace
