// Device buffers on the UCX backend, with the CPU fake device (tests/device/fake_device.h):
// real ranks (forked), the real bootstrap and UCX on loopback, the library's real staging
// pipeline and stream bookkeeping; only the "device" is host memory behind a fake runtime.
// Every result is compared bit for bit with the same collective on host buffers.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "plugin/device/runtime.h"
#include "plugin/device/staging.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"
#include "tests/harness.h"

namespace {

using fake_device::FakeRuntime;
using fake_device::Gate;
using scape_test::RankCtx;
using scape_test::RunRanks;

FakeRuntime& Fake() { return fake_device::InstalledFake(); }

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast };
const char* Name(Coll c) {
  switch (c) {
    case Coll::kAllReduce:
      return "allreduce";
    case Coll::kReduceScatter:
      return "reducescatter";
    case Coll::kAllGather:
      return "allgather";
    default:
      return "broadcast";
  }
}

scapeResult_t Call(Coll c, const void* s, void* r, size_t n, scapeDataType_t t, scapeRedOp_t op,
                   int root, scapeComm_t comm, void* stream) {
  switch (c) {
    case Coll::kAllReduce:
      return scapeAllReduce(s, r, n, t, op, nullptr, comm, stream);
    case Coll::kReduceScatter:
      return scapeReduceScatter(s, r, n, t, op, comm, stream);
    case Coll::kAllGather:
      return scapeAllGather(s, r, n, t, comm, stream);
    default:
      return scapeBroadcast(s, r, n, t, root, comm, stream);
  }
}

// Random bytes that are valid values of the type (finite floats).
std::vector<char> RandomValues(std::mt19937& rng, size_t n, scapeDataType_t t) {
  const size_t esz = scapeTypeSize(t);
  std::vector<char> v(n * esz);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (size_t i = 0; i < n; ++i) {
    float f = nd(rng);
    switch (t) {
      case scapeFloat32:
        std::memcpy(&v[i * esz], &f, 4);
        break;
      case scapeBfloat16: {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(&v[i * esz], &h, 2);
        break;
      }
      case scapeInt64: {
        int64_t x = static_cast<int64_t>(rng()) - (1ll << 31);
        std::memcpy(&v[i * esz], &x, 8);
        break;
      }
      default: {
        int32_t x = static_cast<int32_t>(rng() % 200001) - 100000;
        std::memcpy(&v[i * esz], &x, 4);
      }
    }
  }
  return v;
}

// The host collective as the staging pipeline runs it: chunk by chunk, each chunk its own
// collective (MakeStagePlan's chunks), on host buffers through the public API.
std::vector<char> ChunkedHost(RankCtx& ctx, Coll c, const std::vector<char>& in, size_t n,
                              scapeDataType_t t, scapeRedOp_t op, int root) {
  const size_t P = static_cast<size_t>(ctx.nranks), esz = scapeTypeSize(t);
  scape::coll::CollArgs a;
  a.type = c == Coll::kAllReduce       ? scape::coll::CollType::kAllReduce
           : c == Coll::kReduceScatter ? scape::coll::CollType::kReduceScatter
           : c == Coll::kAllGather     ? scape::coll::CollType::kAllGather
                                       : scape::coll::CollType::kBroadcast;
  a.count = n;
  a.dtype = t;
  a.op = op;
  a.root = root;
  scape::device::StagePlan plan;
  EXPECT_TRUE(
      scape::device::MakeStagePlan(a, ctx.rank, ctx.nranks, scape::device::StageChunkBytes(), &plan)
          .ok());
  std::vector<char> ss(plan.sendStageBytes + 1), rs(plan.recvStageBytes + 1);
  std::vector<char> out((c == Coll::kAllGather ? P * n : n) * esz, 0x5a);
  for (const auto& ch : plan.chunks) {
    for (const auto& cp : ch.d2h) std::memcpy(ss.data() + cp.dst, in.data() + cp.src, cp.bytes);
    EXPECT_SCAPE_OK(Call(c, ch.hasSend ? ss.data() + ch.sendOff : nullptr, rs.data() + ch.recvOff,
                         ch.count, t, op, root, ctx.comm, nullptr),
                    ctx.comm);
    for (const auto& cp : ch.h2d) std::memcpy(out.data() + cp.dst, rs.data() + cp.src, cp.bytes);
  }
  return out;
}

// Floating-point element of either type as a double.
double AsDouble(const char* p, scapeDataType_t t) {
  if (t == scapeFloat32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One collective on device buffers (staged) against the same on host buffers: bit for bit
// against the host collective run chunk by chunk as the pipeline runs it; against one host
// collective on the whole buffer, bit for bit where the order of the additions cannot matter
// (integers, max/min, 2 ranks, no reduction) and within a stated tolerance otherwise.
bool DeviceMatchesHost(RankCtx& ctx, Coll c, size_t n, scapeDataType_t t, scapeRedOp_t op,
                       bool inPlace, unsigned seed) {
  FakeRuntime& rt = Fake();
  SCOPED_TRACE(::testing::Message() << Name(c) << " n=" << n << " type=" << t << " op=" << op
                                    << " inPlace=" << inPlace << " rank=" << ctx.rank);
  const size_t P = static_cast<size_t>(ctx.nranks), esz = scapeTypeSize(t);
  const int root = static_cast<int>(seed % P);
  const size_t sendN = c == Coll::kReduceScatter ? P * n : n;
  const size_t recvN = c == Coll::kAllGather ? P * n : n;
  std::mt19937 rng(seed * 7919u + static_cast<unsigned>(ctx.rank));
  std::vector<char> in = RandomValues(rng, sendN, t);
  std::vector<char> hostOut(recvN * esz, 0x5a);
  std::vector<char> hostIn = in;
  const void* hs = hostIn.data();
  void* hr = hostOut.data();
  if (c == Coll::kBroadcast && ctx.rank != root) hs = nullptr;
  EXPECT_SCAPE_OK(Call(c, hs, hr, n, t, op, root, ctx.comm, nullptr), ctx.comm);
  const std::vector<char> chunked = ChunkedHost(ctx, c, in, n, t, op, root);

  // The same on "device" buffers, in place where the layout allows it.
  char* dsend = static_cast<char*>(rt.DeviceMalloc(std::max(sendN, recvN) * esz));
  char* drecv = inPlace ? nullptr : static_cast<char*>(rt.DeviceMalloc(recvN * esz));
  void* stream = rt.NewStream();
  const void* ds = dsend;
  void* dr = drecv;
  if (inPlace) {
    // all-reduce/broadcast: the same buffer; all-gather: send at recv + rank*n; reduce-scatter:
    // recv at send + rank*n.
    dr = dsend;
    if (c == Coll::kAllGather) ds = dsend + static_cast<size_t>(ctx.rank) * n * esz;
    if (c == Coll::kReduceScatter) dr = dsend + static_cast<size_t>(ctx.rank) * n * esz;
  } else {
    std::memset(drecv, 0x5a, recvN * esz);
  }
  if (!in.empty()) std::memcpy(const_cast<void*>(ds), in.data(), in.size());
  if (c == Coll::kBroadcast && ctx.rank != root) ds = nullptr;
  const uint64_t d2h0 = rt.d2hCopies, h2d0 = rt.h2dCopies;
  scapeResult_t r = Call(c, ds, dr, n, t, op, root, ctx.comm, stream);
  EXPECT_EQ(r, scapeSuccess) << scapeGetLastError(ctx.comm);
  EXPECT_TRUE(rt.StreamOf(stream)->Sync());
  std::vector<char> got(recvN * esz);
  if (!got.empty()) std::memcpy(got.data(), dr, got.size());
  EXPECT_TRUE(got == chunked) << "device result differs from the chunked host collective";
  const bool orderFree = t == scapeInt32 || t == scapeInt64 || op == scapeMax || op == scapeMin ||
                         P <= 2 || c == Coll::kAllGather || c == Coll::kBroadcast;
  if (orderFree) {
    EXPECT_TRUE(got == hostOut) << "device result differs from the whole-buffer host collective";
  } else {
    // fp32: a few ulps of the sum of P values of |x| <= ~15; bf16 rounds once per hop.
    const double tol = t == scapeFloat32 ? 1e-5 : 0.07;
    for (size_t i = 0; i < recvN; ++i) {
      const double a = AsDouble(&got[i * esz], t), b = AsDouble(&hostOut[i * esz], t);
      if (!(std::fabs(a - b) <= tol * (1.0 + std::fabs(b)))) {
        ADD_FAILURE() << "element " << i << ": " << a << " vs host " << b;
        break;
      }
    }
  }
  if (n > 0) {
    EXPECT_GT(rt.h2dCopies.load(), h2d0) << "nothing was copied back to the device";
    if (c != Coll::kBroadcast || ctx.rank == root) {
      EXPECT_GT(rt.d2hCopies.load(), d2h0) << "nothing was staged from the device";
    }
  }
  rt.DeviceFree(dsend);
  rt.DeviceFree(drecv);
  return !::testing::Test::HasFailure();
}

class DeviceColl : public ::testing::TestWithParam<int> {};

TEST_P(DeviceColl, StagedResultsAreBitIdenticalToHost) {
  const int P = GetParam();
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "8192", 1);  // many chunks: the pipeline is exercised
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(P, [&](RankCtx& ctx) {
    unsigned s = seed;
    for (Coll c : {Coll::kAllReduce, Coll::kReduceScatter, Coll::kAllGather, Coll::kBroadcast})
      for (size_t n : {size_t{0}, size_t{1}, size_t{3}, size_t{2049}, size_t{100003}})
        for (bool inPlace : {false, true}) {
          scapeDataType_t t = (s % 3 == 0)   ? scapeFloat32
                              : (s % 3 == 1) ? scapeBfloat16
                                             : scapeInt32;
          scapeRedOp_t op = static_cast<scapeRedOp_t>(s % scapeNumOps);
          if (!DeviceMatchesHost(ctx, c, n, t, op, inPlace, s++)) return false;
        }
    // int64 and every op once more at an odd size.
    for (int op = 0; op < scapeNumOps; ++op)
      if (!DeviceMatchesHost(ctx, Coll::kAllReduce, 5003, scapeInt64, static_cast<scapeRedOp_t>(op),
                             false, s++))
        return false;
    return true;
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Default chunk size (4 MiB, so the stages move by UCX's rendezvous protocol), a small
// collective after each large one: the stages and events of a large job are reused by the
// next, small, job. (Written when the first GPU run showed wrong small-after-large results;
// the cause was the check program's missing stream ordering, not the staging, and this test
// passed before and after that fix: it guards stage and event reuse, nothing more.)
TEST(DeviceStream, SmallAfterLargeWithTheDefaultChunk) {
  unsetenv("SCAPE_DEVICE_CHUNK_BYTES");
  const unsigned seed = scape_test::FreshSeed();
  for (int P : {2, 3}) {
    auto res = RunRanks(P, [&](RankCtx& ctx) {
      unsigned s = seed;
      for (Coll c : {Coll::kAllReduce, Coll::kReduceScatter, Coll::kAllGather, Coll::kBroadcast})
        for (size_t n : {size_t{1}, size_t{1000003}, size_t{1}, size_t{5}})
          if (!DeviceMatchesHost(ctx, c, n, scapeInt32, scapeSum, false, s++)) return false;
      return true;
    });
    EXPECT_TRUE(res.AllOk()) << "P=" << P << ": " << res.Describe();
  }
}

// A stream's queue of pending work is bounded (CUDA blocks the enqueueing call when it is
// full). A job with many chunks fills it while the stream waits for chunk 0's exchange, which
// the staging worker runs: the worker must have the job before the enqueueing can block. With
// the job handed over last, this deadlocked on a real GPU (and here, with a depth of 8).
TEST(DeviceStream, ABoundedStreamQueueDoesNotDeadlockALongJob) {
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  setenv("SCAPE_TIMEOUT_MS", "20000", 1);
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    fake_device::FakeStream::SetQueueDepth(8);
    bool ok = true;
    unsigned s = seed;
    for (Coll c : {Coll::kAllReduce, Coll::kReduceScatter, Coll::kAllGather, Coll::kBroadcast})
      ok = ok && DeviceMatchesHost(ctx, c, 100003, scapeInt32, scapeSum, false, s++);
    fake_device::FakeStream::SetQueueDepth(0);
    return ok;
  });
  unsetenv("SCAPE_TIMEOUT_MS");
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceColl, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "P" + std::to_string(i.param);
                         });

// The call enqueues and returns while its stream is held; nothing is written until the
// stream runs; collectives queued back to back on a stream see each other's results.
TEST(DeviceStream, CallsEnqueueAndReturnAndFollowStreamOrder) {
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  auto res = RunRanks(3, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const size_t n = 10007;
    auto* d = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(i % 13) + ctx.rank;
    void* s = rt.NewStream();
    Gate gate;
    rt.HoldStream(s, &gate);
    // Three in-place sums queued behind the gate: each must see the previous one's result.
    for (int k = 0; k < 3; ++k)
      EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, s),
                      ctx.comm);
    // Nothing has run yet: the calls returned with the stream held.
    for (size_t i = 0; i < n; ++i)
      if (d[i] != static_cast<int32_t>(i % 13) + ctx.rank) {
        ADD_FAILURE() << "element " << i << " changed before the stream reached the call";
        break;
      }
    gate.Open();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    for (size_t i = 0; i < n; ++i) {
      // sum over ranks of (v + r) = 3v + 3; then x3 twice more.
      const int32_t v = static_cast<int32_t>(i % 13);
      const int32_t want = (3 * v + 3) * 9;
      if (d[i] != want) {
        ADD_FAILURE() << "element " << i << " = " << d[i] << ", want " << want;
        break;
      }
    }
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A job with as many chunks as the plan allows, behind a stream the caller holds, with a
// bounded stream queue (100 entries): the call must still enqueue and return. With up to 64
// chunks per job (~257 queue entries) it blocked in the enqueueing on a real GPU; the watchdog
// here opens the gate after 10 s so that a regression fails instead of hanging.
TEST(DeviceStream, ALongJobBehindAHeldStreamStillEnqueuesAndReturns) {
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    fake_device::FakeStream::SetQueueDepth(100);
    const size_t n = 400009;  // 4096-byte chunks would be ~98 of them: capped
    auto* d = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(i % 7) + ctx.rank;
    void* s = rt.NewStream();
    Gate gate;
    rt.HoldStream(s, &gate);
    std::atomic<bool> returned{false};
    std::thread watchdog([&] {
      for (int i = 0; i < 100 && !returned.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      gate.Open();
    });
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, s), ctx.comm);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    returned.store(true);
    EXPECT_LT(sec, 3.0) << "the call blocked until the held stream moved";
    watchdog.join();
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    for (size_t i = 0; i < n; ++i)
      if (d[i] != 2 * static_cast<int32_t>(i % 7) + 1) {
        ADD_FAILURE() << "element " << i << " = " << d[i];
        break;
      }
    fake_device::FakeStream::SetQueueDepth(0);
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// CUDA runs the host functions of every stream of a context on one thread (so does the fake).
// The stream of a staged job used to wait for its exchange inside a host function: a job on
// a second stream then held that thread while the worker, still on the first job, waited for
// the first stream to get past a host function of the caller's. Now a stream waits for the
// exchange on the device (a flag word) and no host function blocks.
TEST(DeviceStream, AHostFunctionOnOneStreamDoesNotHoldUpAJobOnAnother) {
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  scape_test::RankOptions opts;
  opts.timeoutMs = 4000;
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeRuntime& rt = Fake();
        const size_t n = 3001;
        auto* d1 = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
        auto* d2 = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
        for (size_t i = 0; i < n; ++i) {
          d1[i] = static_cast<int32_t>(i % 5) + ctx.rank;
          d2[i] = static_cast<int32_t>(i % 3) + ctx.rank;
        }
        void* s1 = rt.NewStream();
        void* s2 = rt.NewStream();
        Gate gate;
        rt.HoldStream(s1, &gate);  // the caller's earlier work on s1
        EXPECT_TRUE(rt.LaunchHostFunc(
                          s1, [](void*) {}, nullptr)
                        .ok());
        EXPECT_SCAPE_OK(scapeAllReduce(d1, d1, n, scapeInt32, scapeSum, nullptr, ctx.comm, s1),
                        ctx.comm);
        EXPECT_SCAPE_OK(scapeAllReduce(d2, d2, n, scapeInt32, scapeSum, nullptr, ctx.comm, s2),
                        ctx.comm);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // s2 reaches its wait
        gate.Open();
        EXPECT_TRUE(rt.StreamOf(s1)->Sync(20000));
        EXPECT_TRUE(rt.StreamOf(s2)->Sync(20000));
        scapeResult_t ae = scapeInternalError;
        EXPECT_SCAPE_OK(scapeCommGetAsyncError(ctx.comm, &ae), ctx.comm);
        EXPECT_EQ(ae, scapeSuccess) << scapeGetLastError(ctx.comm);
        for (size_t i = 0; i < n; ++i)
          if (d1[i] != 2 * static_cast<int32_t>(i % 5) + 1 ||
              d2[i] != 2 * static_cast<int32_t>(i % 3) + 1) {
            ADD_FAILURE() << "element " << i << ": " << d1[i] << ", " << d2[i];
            break;
          }
        EXPECT_EQ(rt.callsInHostFn.load(), 0u);
        rt.DeviceFree(d1);
        rt.DeviceFree(d2);
        return !::testing::Test::HasFailure();
      },
      opts);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Host buffers with a stream: the call waits for the stream first (with the deadline), so a copy
// queued on the stream before the call (device -> host send buffer) is what gets reduced.
TEST(DeviceStream, HostBuffersWithAStreamWaitForItFirst) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    rt.copyDelayUs = 20000;  // the queued copy is slow
    const size_t n = 1000;
    auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(i) + 0.5f * ctx.rank;
    // Page-locked: a copy into pageable memory would itself wait for the stream.
    void* hp = nullptr;
    EXPECT_TRUE(rt.HostAlloc(n * 4, &hp).ok());
    float* h = static_cast<float*>(hp);
    std::vector<float> out(n, 0.f);
    void* s = rt.NewStream();
    EXPECT_TRUE(rt.CopyAsync(h, d, n * 4, s).ok());
    const uint64_t syncs = rt.syncs;
    EXPECT_SCAPE_OK(scapeAllReduce(h, out.data(), n, scapeFloat32, scapeSum, nullptr, ctx.comm, s),
                    ctx.comm);
    // Waited for with the communicator's deadline (StreamWaitFor), not an unbounded
    // StreamSynchronize (issue 44 item 2).
    EXPECT_EQ(rt.syncs.load(), syncs);
    for (size_t i = 0; i < n; ++i)
      if (out[i] != 2.f * static_cast<float>(i) + 0.5f) {
        ADD_FAILURE() << "element " << i << " = " << out[i];
        break;
      }
    rt.copyDelayUs = 0;
    rt.HostFree(hp);
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Pointer-kind errors name the arguments; forms without a device path say so.
TEST(DeviceStream, MixesAndUnsupportedFormsAreClearErrors) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const size_t n = 64;
    void* d = rt.DeviceMalloc(n * 4 * 2);
    std::vector<float> h(n * 2);
    void* s = rt.NewStream();
    EXPECT_EQ(scapeAllReduce(d, h.data(), n, scapeFloat32, scapeSum, nullptr, ctx.comm, s),
              scapeInvalidArgument);
    std::string m = scapeGetLastError(ctx.comm);
    EXPECT_NE(m.find("sendbuf is device memory but recvbuf is host memory"), std::string::npos)
        << m;
    EXPECT_EQ(scapeAllGather(h.data(), d, n, scapeFloat32, ctx.comm, s), scapeInvalidArgument);
    m = scapeGetLastError(ctx.comm);
    EXPECT_NE(m.find("sendbuf is host memory but recvbuf is device memory"), std::string::npos)
        << m;
    scapeRequest_t req = nullptr;
    EXPECT_EQ(scapeAllReduceAsync(d, d, n, scapeFloat32, scapeSum, nullptr, ctx.comm, s, &req),
              scapeUnsupported);
    m = scapeGetLastError(ctx.comm);
    EXPECT_NE(m.find("blocking form"), std::string::npos) << m;
    EXPECT_EQ(req, nullptr);
    // Argument errors of the host path still come first (bad datatype).
    EXPECT_EQ(
        scapeAllReduce(d, d, n, static_cast<scapeDataType_t>(42), scapeSum, nullptr, ctx.comm, s),
        scapeInvalidArgument);
    // After the errors (local, nothing sent) the communicator still works, on both paths.
    EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, nullptr, ctx.comm, s),
                    ctx.comm);
    EXPECT_SCAPE_OK(
        scapeAllReduce(h.data(), h.data(), n, scapeFloat32, scapeSum, nullptr, ctx.comm, nullptr),
        ctx.comm);
    EXPECT_TRUE(rt.StreamOf(s)->Sync());
    scapeResult_t ae = scapeInternalError;
    EXPECT_SCAPE_OK(scapeCommGetAsyncError(ctx.comm, &ae), ctx.comm);
    EXPECT_EQ(ae, scapeSuccess);
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// A peer that never joins the device collective: the worker gives up after the timeout,
// releases the stream (the receive buffer keeps its bytes), and the error is sticky.
TEST(DeviceStream, APeerThatNeverComesTimesOutReleasesTheStreamAndSticks) {
  scape_test::RankOptions opts;
  opts.timeoutMs = 1500;
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeRuntime& rt = Fake();
        const size_t n = 4096;
        auto* d = static_cast<int32_t*>(rt.DeviceMalloc(n * 4));
        for (size_t i = 0; i < n; ++i) d[i] = 7;
        if (ctx.rank == 1) {
          // Make the device channel with rank 0 (first device call), then stay away.
          EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, nullptr),
                          ctx.comm);
          EXPECT_TRUE(rt.StreamOf(nullptr)->Sync());
          struct timespec ts = {4, 0};
          nanosleep(&ts, nullptr);
          return !::testing::Test::HasFailure();
        }
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, nullptr),
                        ctx.comm);
        EXPECT_TRUE(rt.StreamOf(nullptr)->Sync());
        EXPECT_EQ(d[0], 14);
        void* s = rt.NewStream();
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, s),
                        ctx.comm);
        EXPECT_TRUE(rt.StreamOf(s)->Sync(10000)) << "the stream was not released";
        EXPECT_EQ(d[0], 14) << "a failed collective must leave the receive buffer unchanged";
        scapeResult_t ae = scapeSuccess;
        EXPECT_SCAPE_OK(scapeCommGetAsyncError(ctx.comm, &ae), ctx.comm);
        EXPECT_EQ(ae, scapeTimeout);
        EXPECT_EQ(scapeAllReduce(d, d, n, scapeInt32, scapeSum, nullptr, ctx.comm, s),
                  scapeTimeout);
        std::string m = scapeGetLastError(ctx.comm);
        EXPECT_NE(m.find("no progress"), std::string::npos) << m;
        return !::testing::Test::HasFailure();
      },
      opts);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// scapeCommDestroy right after enqueueing: it waits for the work to reach the end of its
// stream, so the result is in place and nothing is freed under a pending copy.
TEST(DeviceStream, DestroyDrainsWorkInFlight) {
  scape_test::RankOptions opts;
  opts.initComm = false;
  setenv("SCAPE_DEVICE_CHUNK_BYTES", "4096", 1);
  auto res = RunRanks(
      2,
      [&](RankCtx& ctx) {
        FakeRuntime& rt = Fake();
        rt.copyDelayUs = 2000;
        scapeComm_t comm = nullptr;
        EXPECT_SCAPE_OK(scapeCommInitRank(&comm, ctx.nranks, ctx.id, ctx.rank), nullptr);
        if (!comm) return false;
        const size_t n = 50000;
        auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
        for (size_t i = 0; i < n; ++i) d[i] = 1.f;
        void* s = rt.NewStream();
        EXPECT_SCAPE_OK(scapeAllReduce(d, d, n, scapeFloat32, scapeSum, nullptr, comm, s), comm);
        EXPECT_SCAPE_OK(scapeCommDestroy(comm), nullptr);
        for (size_t i = 0; i < n; ++i)
          if (d[i] != 2.f) {
            ADD_FAILURE() << "element " << i << " = " << d[i] << " after destroy";
            break;
          }
        EXPECT_EQ(rt.pinnedLive.load(), 0u) << "staging buffers not freed";
        rt.copyDelayUs = 0;
        return !::testing::Test::HasFailure();
      },
      opts);
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Top-k selection from a device statistic: the same next mask as from the same values in host
// memory (the statistic is read through a host copy).
TEST(DeviceStream, TopkFromADeviceStatisticSelectsTheSameMask) {
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 30011;
    const uint64_t offs[] = {0, 1000, 1003, 20000, n};
    const uint8_t dense[] = {0, 1, 0, 0};
    std::mt19937 rng(seed);  // the same statistic on every rank (as a replicated optimizer has)
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> stat(n);
    for (auto& x : stat) x = nd(rng);
    auto* dstat = static_cast<float*>(rt.DeviceMalloc(n * 4));
    std::memcpy(dstat, stat.data(), n * 4);
    std::vector<uint64_t> got[2];
    for (int which = 0; which < 2; ++which) {
      scapeMask_t m = nullptr;
      EXPECT_SCAPE_OK(scapeMaskCreate(&m, n, 4, offs, dense, scapeOwnershipShards,
                                      scapeMaskEncodingAuto, ctx.comm),
                      ctx.comm);
      if (!m) return false;
      const uint64_t d2h = rt.d2hCopies;
      EXPECT_SCAPE_OK(scapeMaskSelectNextTopk(m, which ? dstat : stat.data(), 0.01), ctx.comm);
      if (which) {
        EXPECT_GT(rt.d2hCopies.load(), d2h) << "the device statistic was not copied";
      }
      EXPECT_SCAPE_OK(scapeMaskSyncStart(m), ctx.comm);
      EXPECT_SCAPE_OK(scapeMaskSyncWait(m), ctx.comm);
      EXPECT_SCAPE_OK(scapeMaskAdvance(m), ctx.comm);
      uint64_t k = 0;
      EXPECT_SCAPE_OK(scapeMaskGetCount(m, &k), ctx.comm);
      got[which].resize(k);
      EXPECT_SCAPE_OK(scapeMaskGetIndices(m, got[which].data(), k), ctx.comm);
      EXPECT_SCAPE_OK(scapeMaskDestroy(m), ctx.comm);
    }
    EXPECT_GT(got[0].size(), 3u);
    EXPECT_EQ(got[0], got[1]) << "device and host statistics selected different masks";
    rt.DeviceFree(dstat);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Calls that take host buffers only refuse device buffers with a message naming the argument
// (instead of the host dereferencing device memory).
// scapeSparseAllReduce (no stream) with device buffers, all of them or some: the same bits
// and the same union size as with host buffers.
TEST(DeviceStream, SparseAllReduceTakesDeviceBuffers) {
  const unsigned seed = scape_test::FreshSeed();
  auto res = RunRanks(3, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    std::mt19937 rng(seed + 31u * static_cast<unsigned>(ctx.rank));
    const uint64_t n = 1009;
    std::vector<uint64_t> idx;
    for (uint64_t i = 0; i < n; ++i)
      if (rng() % 20 == 0) idx.push_back(i);
    std::vector<float> val(idx.size());
    for (auto& v : val) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 8.f;
    const size_t nnz = idx.size(), cap = n;
    std::vector<float> hDense(n, -1.f), hVal(cap, -1.f);
    std::vector<uint64_t> hIdx(cap, 0);
    size_t hNnz = 0;
    EXPECT_SCAPE_OK(scapeSparseAllReduce(idx.data(), val.data(), nnz, n, scapeFloat32, scapeSum,
                                         scapeSparseAuto, hDense.data(), hIdx.data(), hVal.data(),
                                         cap, &hNnz, nullptr, ctx.comm),
                    ctx.comm);
    for (int variant = 0; variant < 2; ++variant) {
      // 0: every buffer on the device; 1: indices and the list output on the host.
      auto* dIdx = static_cast<uint64_t*>(rt.DeviceMalloc(nnz * 8 + 8));
      auto* dVal = static_cast<float*>(rt.DeviceMalloc(nnz * 4 + 4));
      auto* dDense = static_cast<float*>(rt.DeviceMalloc(n * 4));
      auto* dOutIdx = static_cast<uint64_t*>(rt.DeviceMalloc(cap * 8));
      auto* dOutVal = static_cast<float*>(rt.DeviceMalloc(cap * 4));
      std::memcpy(dIdx, idx.data(), nnz * 8);
      std::memcpy(dVal, val.data(), nnz * 4);
      std::vector<uint64_t> hostOutIdx(cap, 0);
      std::vector<float> hostOutVal(cap, -1.f);
      const bool all = variant == 0;
      size_t outNnz = 0;
      EXPECT_SCAPE_OK(
          scapeSparseAllReduce(all ? dIdx : idx.data(), dVal, nnz, n, scapeFloat32, scapeSum,
                               scapeSparseAuto, dDense, all ? dOutIdx : hostOutIdx.data(),
                               all ? static_cast<void*>(dOutVal) : hostOutVal.data(), cap, &outNnz,
                               nullptr, ctx.comm),
          ctx.comm);
      EXPECT_EQ(outNnz, hNnz);
      EXPECT_EQ(std::memcmp(dDense, hDense.data(), n * 4), 0)
          << "dense output, variant " << variant;
      const uint64_t* gotIdx = all ? dOutIdx : hostOutIdx.data();
      const float* gotVal = all ? dOutVal : hostOutVal.data();
      EXPECT_EQ(std::memcmp(gotIdx, hIdx.data(), hNnz * 8), 0) << "indices, variant " << variant;
      EXPECT_EQ(std::memcmp(gotVal, hVal.data(), hNnz * 4), 0) << "values, variant " << variant;
      for (void* p :
           {static_cast<void*>(dIdx), static_cast<void*>(dVal), static_cast<void*>(dDense),
            static_cast<void*>(dOutIdx), static_cast<void*>(dOutVal)})
        rt.DeviceFree(p);
    }
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// The optimizer step takes device buffers (device_optim_test.cc), as the mask calls do
// (device_mask_test.cc); a params/grads mix of host and device memory is refused, naming both.
TEST(DeviceStream, OptimizerStepRefusesAHostDeviceMix) {
  auto res = RunRanks(2, [&](RankCtx& ctx) {
    FakeRuntime& rt = Fake();
    const uint64_t n = 4096;
    const uint64_t offs[] = {0, n};
    auto* d = static_cast<float*>(rt.DeviceMalloc(n * 4));
    std::vector<float> h(n, 1.f);
    scapeOptimConfig_t cfg;
    EXPECT_SCAPE_OK(scapeOptimConfigInit(&cfg), ctx.comm);
    cfg.n = n;
    cfg.nsegments = 1;
    cfg.segOffsets = offs;
    scapeOptim_t opt = nullptr;
    EXPECT_SCAPE_OK(scapeOptimCreate(&opt, &cfg, ctx.comm), ctx.comm);
    if (opt) {
      EXPECT_EQ(scapeOptimStep(opt, d, h.data(), n), scapeInvalidArgument);
      std::string msg = scapeGetLastError(ctx.comm);
      EXPECT_NE(msg.find("params is device memory but grads is host memory"), std::string::npos)
          << msg;
      EXPECT_EQ(scapeOptimStep(opt, h.data(), d, n), scapeInvalidArgument);
      msg = scapeGetLastError(ctx.comm);
      EXPECT_NE(msg.find("params is host memory but grads is device memory"), std::string::npos)
          << msg;
      std::vector<float> g(n, 0.5f);
      EXPECT_SCAPE_OK(scapeOptimStep(opt, h.data(), g.data(), n), ctx.comm);  // host still works
      EXPECT_SCAPE_OK(scapeOptimDestroy(opt), ctx.comm);
    }
    rt.DeviceFree(d);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

// Without a device runtime (CPU build, or no driver: this machine), every pointer is host
// memory and a non-NULL stream cannot be honoured: a clear scapeUnsupported.
TEST(DeviceNone, AStreamWithoutCudaIsUnsupported) {
  int built = -1, avail = -1;
  ASSERT_EQ(scapeGetDeviceSupport(&built, &avail), scapeSuccess);
  if (avail) GTEST_SKIP() << "a CUDA device is present: the no-driver path cannot be reached here";
  auto res = RunRanks(1, [&](RankCtx& ctx) {
    std::vector<float> h(16, 1.f);
    int fakeStream = 0;
    EXPECT_EQ(scapeAllReduce(h.data(), h.data(), 16, scapeFloat32, scapeSum, nullptr, ctx.comm,
                             &fakeStream),
              scapeUnsupported);
    std::string m = scapeGetLastError(ctx.comm);
    EXPECT_NE(m.find("stream = NULL"), std::string::npos) << m;
    EXPECT_SCAPE_OK(
        scapeAllReduce(h.data(), h.data(), 16, scapeFloat32, scapeSum, nullptr, ctx.comm, nullptr),
        ctx.comm);
    int backend = -1;
    EXPECT_SCAPE_OK(scapeCommGetBackend(ctx.comm, &backend), ctx.comm);
    EXPECT_EQ(backend, scapeBackendUcx);
    return !::testing::Test::HasFailure();
  });
  EXPECT_TRUE(res.AllOk()) << res.Describe();
}

}  // namespace
