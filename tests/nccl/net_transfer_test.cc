// Two processes on loopback, driven as NCCL 2.28 drives a net plugin: the receiver listens and
// hands its 128-byte handle to the sender over a pipe, both poll connect/accept, register
// buffers, and move data with isend/irecv/test. Every wait has a deadline; RunProcs kills both
// processes if they outlive the watchdog.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/nccl/fake_nccl.h"

namespace {

using namespace fake_nccl;

constexpr int kWatchdogMs = 90000;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Receiver side of connection setup: listen, hand the handle over, accept.
bool AcceptFrom(Env& e, const Pipe& handleOut, void** rc) {
  char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
  void* lc = nullptr;
  if (e.net->listen(e.ctx, 0, h, &lc) != ncclSuccess) return false;
  if (!handleOut.Write(h, sizeof(h), 20000)) return false;
  int r = PollAccept(e.net, lc, rc);
  EXPECT_EQ(r, ncclSuccess);
  return r == ncclSuccess && e.net->closeListen(lc) == ncclSuccess;
}

// Sender side: read the handle, connect.
bool ConnectTo(Env& e, const Pipe& handleIn, void** sc) {
  char h[NCCL_NET_HANDLE_MAXSIZE];
  if (!handleIn.Read(h, sizeof(h), 20000)) return false;
  int r = PollConnect(e.net, e.ctx, 0, h, sc);
  EXPECT_EQ(r, ncclSuccess);
  return r == ncclSuccess;
}

uint64_t Seed(uint64_t a, uint64_t b) { return a * 1000003ull + b + 17; }

// ---------------------------------------------------------------------------------------------

TEST(Transfer, SizesFromZeroTo64MiBWithDataAndSizeChecks) {
  const std::vector<size_t> sizes = {
      0, 1, 7, 8, 4095, 4096, 65536 + 13, 1u << 20, (4u << 20) + 1, 16u << 20, 64u << 20};
  const size_t kMax = (64u << 20) + 4096;
  Pipe handle;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        std::vector<uint8_t> buf(kMax);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (size_t k = 0; k < sizes.size(); ++k) {
          size_t size = sizes[k];
          size_t cap = (k % 2) ? size + 4096 : size;  // exact or larger capacity
          std::memset(buf.data(), 0xEE, std::min(cap + 16, kMax));
          void* d = buf.data();
          int tag = 7;
          void* req = nullptr;
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
          int got[64];
          std::fill(got, got + 64, -1);
          REQUIRE_OK(WaitReq(e.net, req, got));
          EXPECT_EQ(static_cast<size_t>(got[0]), size) << "size " << size;
          EXPECT_EQ(FirstMismatch(buf.data(), size, Seed(k, size)), size) << "size " << size;
          if (cap > size) {
            EXPECT_EQ(buf[size], 0xEE) << "wrote past the message, size " << size;
          }
        }
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(kMax);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (size_t k = 0; k < sizes.size(); ++k) {
          Fill(buf.data(), sizes[k], Seed(k, sizes[k]));
          void* req = nullptr;
          REQUIRE_OK(PostSend(e.net, sc, buf.data(), sizes[k], 7, mh, &req));
          int got = -1;
          REQUIRE_OK(WaitReq(e.net, req, &got));
          EXPECT_EQ(static_cast<size_t>(got), sizes[k]);
        }
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));
        return e.Down();
      });
}

// Grouped receives (n = maxRecvs) whose tags sit in shuffled positions, with the matching
// sends posted in another shuffled order, several groups in flight.
TEST(Transfer, GroupedReceivesMatchTagsSentInShuffledOrder) {
  const int kRounds = 24;
  const int kWindow = 4;
  auto sizeOf = [](int round, int tag) -> size_t {
    if ((round + tag) % 11 == 0) return (2u << 20) + static_cast<size_t>(tag - 100);  // rndv
    return static_cast<size_t>((tag * 997 + round * 131) % 70000);
  };
  auto tagsOf = [](int round, int n) {
    std::vector<int> t(static_cast<size_t>(n));
    std::iota(t.begin(), t.end(), 100);
    std::shuffle(t.begin(), t.end(), std::mt19937(static_cast<unsigned>(round) * 7 + 1));
    return t;
  };
  const size_t kSlot = (2u << 20) + 64;
  Pipe handle;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        const int n = e.MaxRecvs();
        REQUIRE(n >= 2);
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        std::vector<uint8_t> buf(kSlot * static_cast<size_t>(n * kWindow));
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        struct Group {
          int round;
          std::vector<int> tags;
          void* req;
        };
        std::vector<Group> inflight;
        auto slot = [&](int round, int i) {
          return buf.data() + kSlot * static_cast<size_t>((round % kWindow) * n + i);
        };
        auto complete = [&](Group& g) -> bool {
          int got[64];
          std::fill(got, got + 64, -1);
          REQUIRE_OK(WaitReq(e.net, g.req, got));
          for (int i = 0; i < n; ++i) {
            size_t want = sizeOf(g.round, g.tags[static_cast<size_t>(i)]);
            EXPECT_EQ(static_cast<size_t>(got[i]), want) << "round " << g.round << " buffer " << i;
            EXPECT_EQ(FirstMismatch(slot(g.round, i), want, Seed(g.round, g.tags[i])), want)
                << "round " << g.round << " buffer " << i << " tag " << g.tags[i];
          }
          for (int i = n; i < 64; ++i) EXPECT_EQ(got[i], -1);  // only n sizes written
          return true;
        };
        for (int round = 0; round < kRounds; ++round) {
          if (static_cast<int>(inflight.size()) == kWindow) {
            // Complete the window newest first: completion order is free.
            for (auto it = inflight.rbegin(); it != inflight.rend(); ++it) REQUIRE(complete(*it));
            inflight.clear();
          }
          Group g{round, tagsOf(round, n), nullptr};
          std::vector<void*> data(static_cast<size_t>(n)), mhs(static_cast<size_t>(n), mh);
          std::vector<size_t> caps(static_cast<size_t>(n), kSlot);
          for (int i = 0; i < n; ++i) data[static_cast<size_t>(i)] = slot(round, i);
          REQUIRE_OK(
              PostRecv(e.net, rc, n, data.data(), caps.data(), g.tags.data(), mhs.data(), &g.req));
          inflight.push_back(g);
        }
        for (auto it = inflight.rbegin(); it != inflight.rend(); ++it) REQUIRE(complete(*it));
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        const int n = e.MaxRecvs();
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(kSlot * static_cast<size_t>(n));
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (int round = 0; round < kRounds; ++round) {
          std::vector<int> order = tagsOf(round, n);
          std::shuffle(order.begin(), order.end(),
                       std::mt19937(static_cast<unsigned>(round) + 999));
          std::vector<void*> reqs;
          for (int i = 0; i < n; ++i) {
            int tag = order[static_cast<size_t>(i)];
            uint8_t* p = buf.data() + kSlot * static_cast<size_t>(i);
            size_t sz = sizeOf(round, tag);
            Fill(p, sz, Seed(round, tag));
            void* req = nullptr;
            REQUIRE_OK(PostSend(e.net, sc, p, sz, tag, mh, &req));
            reqs.push_back(req);
          }
          for (void* r : reqs) REQUIRE_OK(WaitReq(e.net, r, nullptr));
        }
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));
        return e.Down();
      });
}

// 32 receives in flight on a receive comm (the 33rd is refused with a NULL request), 32 x
// maxRecvs sends in flight on a send comm (one more is refused), completed out of order.
TEST(Transfer, FullRequestWindowsCompleteOutOfOrder) {
  const int kRecvWindow = NCCL_NET_MAX_REQUESTS;
  auto sizeOf = [](int j) -> size_t {
    return j % 37 == 5 ? (300u << 10) : static_cast<size_t>(64 + (j * 7919) % 20000);
  };
  const size_t kSlot = 300u << 10;
  Pipe handle, go;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        const int total = kRecvWindow * e.MaxRecvs();
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        uint64_t sent = 0;
        REQUIRE(go.ReadU64(&sent));  // the sender has all its sends posted
        REQUIRE_EQ(sent, static_cast<uint64_t>(total));
        std::vector<uint8_t> buf(kSlot * kRecvWindow);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        std::mt19937 rng(5);
        for (int base = 0; base < total; base += kRecvWindow) {
          std::vector<void*> reqs;
          for (int q = 0; q < kRecvWindow; ++q) {
            void* d = buf.data() + kSlot * static_cast<size_t>(q);
            size_t cap = kSlot;
            int tag = (base + q) % 4;
            void* req = nullptr;
            REQUIRE_OK(e.net->irecv(rc, 1, &d, &cap, &tag, &mh, nullptr, &req));
            REQUIRE(req != nullptr);
            reqs.push_back(req);
          }
          // The window is full: one more is refused ("try again"), not an error.
          void* d = buf.data();
          size_t cap = 8;
          int tag = 0;
          void* extra = reinterpret_cast<void*>(0x1);
          REQUIRE_OK(e.net->irecv(rc, 1, &d, &cap, &tag, &mh, nullptr, &extra));
          EXPECT_EQ(extra, nullptr);
          std::vector<int> order(reqs.size());
          std::iota(order.begin(), order.end(), 0);
          std::shuffle(order.begin(), order.end(), rng);
          for (int q : order) {
            int got[64];
            REQUIRE_OK(WaitReq(e.net, reqs[static_cast<size_t>(q)], got));
            int j = base + q;
            EXPECT_EQ(static_cast<size_t>(got[0]), sizeOf(j)) << "message " << j;
            EXPECT_EQ(
                FirstMismatch(buf.data() + kSlot * static_cast<size_t>(q), sizeOf(j), Seed(j, 3)),
                sizeOf(j))
                << "message " << j;
          }
        }
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        const int total = kRecvWindow * e.MaxRecvs();
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(kSlot * static_cast<size_t>(total));
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        std::vector<void*> reqs;
        for (int j = 0; j < total; ++j) {
          uint8_t* p = buf.data() + kSlot * static_cast<size_t>(j);
          Fill(p, sizeOf(j), Seed(j, 3));
          void* req = nullptr;
          REQUIRE_OK(e.net->isend(sc, p, sizeOf(j), j % 4, mh, nullptr, &req));
          REQUIRE(req != nullptr);
          reqs.push_back(req);
        }
        void* extra = reinterpret_cast<void*>(0x1);
        REQUIRE_OK(e.net->isend(sc, buf.data(), 8, 0, mh, nullptr, &extra));
        EXPECT_EQ(extra, nullptr);
        REQUIRE(go.WriteU64(static_cast<uint64_t>(total)));
        std::vector<int> order(reqs.size());
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), std::mt19937(9));
        for (int q : order) {
          int got = -1;
          REQUIRE_OK(WaitReq(e.net, reqs[static_cast<size_t>(q)], &got));
          EXPECT_EQ(static_cast<size_t>(got), sizeOf(q));
        }
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));
        return e.Down();
      });
}

// Sends (eager and rendezvous sizes) posted well before the receives exist.
TEST(Transfer, SendsRaceAheadOfReceives) {
  const std::vector<size_t> sizes = {1024, 65536, 1u << 20, 8u << 20, 0, 300, 4u << 20, 17};
  const size_t kSlot = 8u << 20;
  Pipe handle, posted;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        uint64_t v = 0;
        REQUIRE(posted.ReadU64(&v));
        usleep(300 * 1000);  // the sends have long been in flight
        std::vector<uint8_t> buf(kSlot * sizes.size());
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        std::vector<void*> reqs;
        for (size_t k = 0; k < sizes.size(); ++k) {
          void* d = buf.data() + kSlot * k;
          size_t cap = kSlot;
          int tag = 3;
          void* req = nullptr;
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
          reqs.push_back(req);
        }
        for (size_t k = 0; k < sizes.size(); ++k) {
          int got[64];
          REQUIRE_OK(WaitReq(e.net, reqs[k], got));
          EXPECT_EQ(static_cast<size_t>(got[0]), sizes[k]);
          EXPECT_EQ(FirstMismatch(buf.data() + kSlot * k, sizes[k], Seed(k, 11)), sizes[k]);
        }
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(kSlot * sizes.size());
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        std::vector<void*> reqs;
        for (size_t k = 0; k < sizes.size(); ++k) {
          Fill(buf.data() + kSlot * k, sizes[k], Seed(k, 11));
          void* req = nullptr;
          REQUIRE_OK(PostSend(e.net, sc, buf.data() + kSlot * k, sizes[k], 3, mh, &req));
          reqs.push_back(req);
        }
        std::vector<int> done(reqs.size(), 0);
        for (size_t k = 0; k < reqs.size(); ++k)  // progress a little: eager sends finish here
          REQUIRE_OK(e.net->test(reqs[k], &done[k], nullptr));
        REQUIRE(posted.WriteU64(1));
        for (size_t k = 0; k < reqs.size(); ++k)
          if (!done[k]) REQUIRE_OK(WaitReq(e.net, reqs[k], nullptr));
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));
        return e.Down();
      });
}

// The sender closes with rendezvous sends still in flight; the receiver asks for them later.
TEST(Close, SenderClosesWithSendsInFlight) {
  const size_t kSize = 8u << 20;
  const int kN = 6;
  Pipe handle, closed, finished;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        uint64_t v;
        REQUIRE(closed.ReadU64(&v));
        std::vector<uint8_t> buf(kSize * kN);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        int ok = 0, failed = 0;
        for (int k = 0; k < kN; ++k) {
          void* d = buf.data() + kSize * static_cast<size_t>(k);
          size_t cap = kSize;
          int tag = 1;
          void* req = nullptr;
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
          int got[64];
          int r = WaitReq(e.net, req, got, 15000);
          REQUIRE(r != kTimedOut);  // never hangs
          if (r == ncclSuccess) {
            // If the data still arrived it must be right.
            EXPECT_EQ(static_cast<size_t>(got[0]), kSize);
            EXPECT_EQ(FirstMismatch(d, kSize, Seed(k, 5)), kSize);
            ++ok;
          } else {
            EXPECT_EQ(r, ncclRemoteError);
            ++failed;
            break;  // the request stays with the plugin; closeRecv cleans it up
          }
        }
        std::printf("receiver: %d delivered, %d failed after the sender closed\n", ok, failed);
        REQUIRE(finished.WriteU64(1));
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(kSize * kN);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (int k = 0; k < kN; ++k) {
          Fill(buf.data() + kSize * static_cast<size_t>(k), kSize, Seed(k, 5));
          void* req = nullptr;
          REQUIRE_OK(
              PostSend(e.net, sc, buf.data() + kSize * static_cast<size_t>(k), kSize, 1, mh, &req));
          int d = 0;
          REQUIRE_OK(e.net->test(req, &d, nullptr));
        }
        REQUIRE_OK(e.net->deregMr(sc, mh));
        int64_t t0 = NowMs();
        REQUIRE_OK(e.net->closeSend(sc));
        int64_t took = NowMs() - t0;
        EXPECT_LT(took, 3000) << "closeSend with requests in flight took " << took << " ms";
        REQUIRE(closed.WriteU64(1));
        uint64_t v;
        REQUIRE(finished.ReadU64(&v, 60000));  // keep the buffers alive until the receiver is done
        return e.Down();
      });
}

// The receiver closes with receives in flight; then the sender's rendezvous send cannot
// complete and must fail (not hang), while an eager one completes locally.
TEST(Close, ReceiverClosesWithReceivesInFlight) {
  Pipe handle, closed, connected;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        std::vector<uint8_t> buf(1u << 20);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (int k = 0; k < 8; ++k) {
          void* d = buf.data() + 4096 * k;
          size_t cap = 4096;
          int tag = 9;
          void* req = nullptr;
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
        }
        REQUIRE_OK(e.net->deregMr(rc, mh));
        // Close only once the sender's side of the connection exists: tearing the worker down
        // while the sender is still creating its endpoint makes that connect fail instead.
        uint64_t up;
        REQUIRE(connected.ReadU64(&up));
        int64_t t0 = NowMs();
        REQUIRE_OK(e.net->closeRecv(rc));
        EXPECT_LT(NowMs() - t0, 3000);
        REQUIRE(closed.WriteU64(1));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        REQUIRE(connected.WriteU64(1));
        uint64_t v;
        REQUIRE(closed.ReadU64(&v));
        std::vector<uint8_t> buf(16u << 20);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        void* req = nullptr;
        REQUIRE_OK(PostSend(e.net, sc, buf.data(), 16u << 20, 9, mh, &req));
        int64_t t0 = NowMs();
        int r = WaitReq(e.net, req, nullptr, 20000);
        EXPECT_EQ(r, ncclRemoteError) << "a rendezvous send to a closed receiver";
        EXPECT_LT(NowMs() - t0, 10000);
        EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"test", "went away"}));
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));  // cleans up the failed request
        return e.Down();
      });
}

// The sender's process dies (no close): the receiver's pending receive fails with
// ncclRemoteError instead of hanging.
TEST(Close, PeerProcessDeathFailsPendingReceives) {
  Pipe handle, posted;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        std::vector<uint8_t> buf(4096);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        void* d = buf.data();
        size_t cap = buf.size();
        int tag = 2;
        void* req = nullptr;
        REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
        REQUIRE(posted.WriteU64(1));
        int64_t t0 = NowMs();
        int r = WaitReq(e.net, req, nullptr, 20000);
        EXPECT_EQ(r, ncclRemoteError);
        EXPECT_LT(NowMs() - t0, 10000);
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender: connects, then its process exits without closing anything
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        uint64_t v;
        REQUIRE(posted.ReadU64(&v));
        _exit(0);
        return true;
      });
}

// 1000 listen/connect/accept/transfer/close cycles: file descriptors and heap stay flat.
TEST(Cycles, ThousandConnectCloseCyclesWithoutLeaks) {
  const int kCycles =
      std::getenv("SCAPE_TEST_CYCLES") ? std::atoi(std::getenv("SCAPE_TEST_CYCLES")) : 1000;
  const int kWarm = 50;
  Pipe handle;
  auto body = [&](bool receiver) {
    return [&, receiver] {
      Env e;
      REQUIRE(e.Up());
      int fdsWarm = 0;
      size_t heapWarm = 0;
      int64_t t0 = NowMs();
      for (int c = 0; c < kCycles; ++c) {
        if (c == kWarm) {
          fdsWarm = CountFds();
          heapWarm = HeapInUse();
        }
        ClearLogs();  // the fake NCCL's own record of log lines must not count as growth
        uint64_t payload = 0;
        void* mh = nullptr;
        void* req = nullptr;
        if (receiver) {
          void* rc = nullptr;
          REQUIRE(AcceptFrom(e, handle, &rc));
          void* d = &payload;
          size_t cap = sizeof(payload);
          int tag = c;
          REQUIRE_OK(e.net->regMr(rc, &payload, sizeof(payload), NCCL_PTR_HOST, &mh));
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
          REQUIRE_OK(WaitReq(e.net, req, nullptr));
          REQUIRE_EQ(payload, Seed(c, 1));
          REQUIRE_OK(e.net->deregMr(rc, mh));
          REQUIRE_OK(e.net->closeRecv(rc));
        } else {
          void* sc = nullptr;
          REQUIRE(ConnectTo(e, handle, &sc));
          payload = Seed(c, 1);
          REQUIRE_OK(e.net->regMr(sc, &payload, sizeof(payload), NCCL_PTR_HOST, &mh));
          REQUIRE_OK(PostSend(e.net, sc, &payload, sizeof(payload), c, mh, &req));
          REQUIRE_OK(WaitReq(e.net, req, nullptr));
          REQUIRE_OK(e.net->deregMr(sc, mh));
          REQUIRE_OK(e.net->closeSend(sc));
        }
      }
      int fdsEnd = CountFds();
      size_t heapEnd = HeapInUse();
      std::printf("%s: %d cycles in %lld ms; fds %d -> %d; heap %zu -> %zu bytes\n",
                  receiver ? "receiver" : "sender", kCycles, static_cast<long long>(NowMs() - t0),
                  fdsWarm, fdsEnd, heapWarm, heapEnd);
      EXPECT_EQ(fdsEnd, fdsWarm) << "file descriptors leaked";
#if !defined(__SANITIZE_ADDRESS__)
      // (Under AddressSanitizer mallinfo does not see the heap; LeakSanitizer checks instead.)
      EXPECT_LT(heapEnd, heapWarm + (256u << 10))
          << "heap grew over " << kCycles - kWarm << " cycles";
#endif
      return e.Down();
    };
  };
  RUN_PROCS(kWatchdogMs, body(true), body(false));
}

// A send larger than the posted receive: the receiver gets a clean error; nobody hangs; the
// next transfer on the same comms still works.
TEST(Errors, SendLargerThanPostedReceive) {
  Pipe handle;
  const std::vector<std::pair<size_t, size_t>> cases = {{100, 10}, {1u << 20, 64u << 10}};
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Env e;
        REQUIRE(e.Up());
        void* rc = nullptr;
        REQUIRE(AcceptFrom(e, handle, &rc));
        std::vector<uint8_t> buf(2u << 20);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (size_t k = 0; k < cases.size(); ++k) {
          void* d = buf.data();
          size_t cap = cases[k].second;
          int tag = static_cast<int>(k);
          void* req = nullptr;
          REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
          int r = WaitReq(e.net, req, nullptr);
          EXPECT_EQ(r, ncclInternalError) << cases[k].first << " into " << cases[k].second;
        }
        EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"test", "bytes into a"}));
        // Still usable.
        void* d = buf.data();
        size_t cap = 1000;
        int tag = 77;
        void* req = nullptr;
        REQUIRE_OK(PostRecv(e.net, rc, 1, &d, &cap, &tag, &mh, &req));
        int got[64];
        REQUIRE_OK(WaitReq(e.net, req, got));
        EXPECT_EQ(got[0], 1000);
        EXPECT_EQ(FirstMismatch(buf.data(), 1000, 77), 1000u);
        REQUIRE_OK(e.net->deregMr(rc, mh));
        REQUIRE_OK(e.net->closeRecv(rc));
        return e.Down();
      },
      [&] {  // sender
        Env e;
        REQUIRE(e.Up());
        void* sc = nullptr;
        REQUIRE(ConnectTo(e, handle, &sc));
        std::vector<uint8_t> buf(2u << 20);
        void* mh = nullptr;
        REQUIRE_OK(e.net->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &mh));
        for (size_t k = 0; k < cases.size(); ++k) {
          void* req = nullptr;
          REQUIRE_OK(
              PostSend(e.net, sc, buf.data(), cases[k].first, static_cast<int>(k), mh, &req));
          int r = WaitReq(e.net, req, nullptr);
          EXPECT_NE(r, kTimedOut);
        }
        Fill(buf.data(), 1000, 77);
        void* req = nullptr;
        REQUIRE_OK(PostSend(e.net, sc, buf.data(), 1000, 77, mh, &req));
        REQUIRE_OK(WaitReq(e.net, req, nullptr));
        REQUIRE_OK(e.net->deregMr(sc, mh));
        REQUIRE_OK(e.net->closeSend(sc));
        return e.Down();
      });
}

// ---- the older ABIs, end to end -----------------------------------------------------------------

// One version's calls behind a common shape (n = 1 receives).
struct Ops {
  std::function<ncclResult_t()> init;
  std::function<ncclResult_t(void*, void**)> listen;
  std::function<ncclResult_t(void*, void**)> connect;
  std::function<ncclResult_t(void*, void**)> accept;
  std::function<ncclResult_t(void*, void*, size_t, void**)> regMr;
  std::function<ncclResult_t(void*, void*)> deregMr;
  std::function<ncclResult_t(void*, void*, size_t, int, void*, void**)> isend;
  std::function<ncclResult_t(void*, void*, size_t, int, void*, void**)> irecv;
  std::function<ncclResult_t(void*, int*, int*)> test;
  std::function<ncclResult_t(void*)> closeSend, closeRecv, closeListen;
};

template <typename N>
void CommonOps(N* n, Ops* o) {
  o->listen = [n](void* h, void** l) { return n->listen(0, h, l); };
  o->accept = [n](void* l, void** r) { return n->accept(l, r, nullptr); };
  o->regMr = [n](void* c, void* p, size_t s, void** m) {
    return n->regMr(c, p, s, NCCL_PTR_HOST, m);
  };
  o->deregMr = [n](void* c, void* m) { return n->deregMr(c, m); };
  o->test = [n](void* r, int* d, int* s) { return n->test(r, d, s); };
  o->closeSend = [n](void* c) { return n->closeSend(c); };
  o->closeRecv = [n](void* c) { return n->closeRecv(c); };
  o->closeListen = [n](void* c) { return n->closeListen(c); };
}

Ops OpsFor(const Plugin& p, int version) {
  Ops o;
  if (version == 10) {
    ncclNet_v10_t* n = p.v10;
    CommonOps(n, &o);
    o.init = [n] { return n->init(&Logger, nullptr); };
    o.connect = [n](void* h, void** s) {
      ncclNetCommConfig_v10_t cfg{3};
      return n->connect(0, &cfg, h, s, nullptr);
    };
    o.isend = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      return n->isend(c, d, s, t, m, nullptr, r);
    };
    o.irecv = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      return n->irecv(c, 1, &d, &s, &t, &m, nullptr, r);
    };
  } else if (version == 9) {
    ncclNet_v9_t* n = p.v9;
    CommonOps(n, &o);
    o.init = [n] { return n->init(&Logger); };
    o.connect = [n](void* h, void** s) { return n->connect(0, h, s, nullptr); };
    o.isend = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      return n->isend(c, d, s, t, m, r);
    };
    o.irecv = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      return n->irecv(c, 1, &d, &s, &t, &m, r);
    };
  } else {
    ncclNet_v8_t* n = p.v8;
    CommonOps(n, &o);
    o.init = [n] { return n->init(&Logger); };
    o.connect = [n](void* h, void** s) { return n->connect(0, h, s, nullptr); };
    o.isend = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      return n->isend(c, d, static_cast<int>(s), t, m, r);
    };
    o.irecv = [n](void* c, void* d, size_t s, int t, void* m, void** r) {
      int is = static_cast<int>(s);
      return n->irecv(c, 1, &d, &is, &t, &m, r);
    };
  }
  return o;
}

bool Retry(const std::function<ncclResult_t(void**)>& f, void** out) {
  int64_t deadline = NowMs() + 20000;
  *out = nullptr;
  while (!*out) {
    if (f(out) != ncclSuccess) return false;
    if (NowMs() > deadline) return false;
  }
  return true;
}

bool Wait(const Ops& o, void* req, int* sizes) {
  int64_t deadline = NowMs() + 20000;
  for (;;) {
    int done = 0;
    if (o.test(req, &done, sizes) != ncclSuccess) return false;
    if (done) return true;
    if (NowMs() > deadline) return false;
  }
}

class OlderAbi : public ::testing::TestWithParam<int> {};

TEST_P(OlderAbi, MovesDataBetweenProcesses) {
  const int version = GetParam();
  const std::vector<size_t> sizes = {0, 100, 70000, 3u << 20};
  Pipe handle;
  RUN_PROCS(
      kWatchdogMs,
      [&] {  // receiver
        Plugin p;
        std::string err;
        REQUIRE(LoadPlugin(&p, &err));
        Ops o = OpsFor(p, version);
        SkipLeakCheck();  // pre-v11 ABIs have no finalize: their context lives until exit
        REQUIRE_OK(o.init());
        char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
        void* lc = nullptr;
        REQUIRE_OK(o.listen(h, &lc));
        REQUIRE(handle.Write(h, sizeof(h), 20000));
        void* rc = nullptr;
        REQUIRE(Retry([&](void** out) { return o.accept(lc, out); }, &rc));
        REQUIRE_OK(o.closeListen(lc));
        std::vector<uint8_t> buf(3u << 20);
        void* mh = nullptr;
        REQUIRE_OK(o.regMr(rc, buf.data(), buf.size(), &mh));
        for (size_t k = 0; k < sizes.size(); ++k) {
          void* req = nullptr;
          REQUIRE(Retry([&](void** out) { return o.irecv(rc, buf.data(), buf.size(), 5, mh, out); },
                        &req));
          int got[64];
          REQUIRE(Wait(o, req, got));
          EXPECT_EQ(static_cast<size_t>(got[0]), sizes[k]);
          EXPECT_EQ(FirstMismatch(buf.data(), sizes[k], Seed(version, k)), sizes[k]);
        }
        REQUIRE_OK(o.deregMr(rc, mh));
        REQUIRE_OK(o.closeRecv(rc));
        return true;
      },
      [&] {  // sender
        Plugin p;
        std::string err;
        REQUIRE(LoadPlugin(&p, &err));
        Ops o = OpsFor(p, version);
        SkipLeakCheck();  // pre-v11 ABIs have no finalize: their context lives until exit
        REQUIRE_OK(o.init());
        char h[NCCL_NET_HANDLE_MAXSIZE];
        REQUIRE(handle.Read(h, sizeof(h), 20000));
        void* sc = nullptr;
        REQUIRE(Retry([&](void** out) { return o.connect(h, out); }, &sc));
        std::vector<uint8_t> buf(3u << 20);
        void* mh = nullptr;
        REQUIRE_OK(o.regMr(sc, buf.data(), buf.size(), &mh));
        for (size_t k = 0; k < sizes.size(); ++k) {
          Fill(buf.data(), sizes[k], Seed(version, k));
          void* req = nullptr;
          REQUIRE(Retry([&](void** out) { return o.isend(sc, buf.data(), sizes[k], 5, mh, out); },
                        &req));
          int got = -1;
          REQUIRE(Wait(o, req, &got));
          EXPECT_EQ(static_cast<size_t>(got), sizes[k]);
        }
        REQUIRE_OK(o.deregMr(sc, mh));
        REQUIRE_OK(o.closeSend(sc));
        return true;
      });
}

INSTANTIATE_TEST_SUITE_P(V10V9V8, OlderAbi, ::testing::Values(10, 9, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "v" + std::to_string(i.param);
                         });

}  // namespace
