// The NCCL backend without NCCL: backend selection and its errors (no library, a library
// without an entry point, a too old one), and the dispatch of every collective to the right
// NCCL call with NCCL's enum values, the caller's communicator and stream - against a fake
// libnccl built by this test (fake_libnccl.cc) and "device" pointers of the CPU fake device.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "plugin/backend/backend.h"
#include "plugin/device/nccl_comm.h"
#include "plugin/device/runtime.h"
#include "scape/scape.h"
#include "tests/device/fake_device.h"

#if defined(SCAPE_TEST_HAVE_NCCL_H) && __has_include(<nccl.h>)
#include <nccl.h>
// The backend mirrors NCCL's ABI values without its header: check them against it.
#define SCAPE_SAME(ours, nccls) \
  static_assert(int{scape::device::ours} == static_cast<int>(nccls), #nccls)
SCAPE_SAME(kNcclFloat32, ncclFloat32);
SCAPE_SAME(kNcclFloat16, ncclFloat16);
SCAPE_SAME(kNcclBfloat16, ncclBfloat16);
SCAPE_SAME(kNcclInt32, ncclInt32);
SCAPE_SAME(kNcclInt64, ncclInt64);
SCAPE_SAME(kNcclSum, ncclSum);
SCAPE_SAME(kNcclAvg, ncclAvg);
SCAPE_SAME(kNcclMax, ncclMax);
SCAPE_SAME(kNcclMin, ncclMin);
SCAPE_SAME(kNcclSuccess, ncclSuccess);
SCAPE_SAME(kNcclUnhandledCudaError, ncclUnhandledCudaError);
SCAPE_SAME(kNcclSystemError, ncclSystemError);
SCAPE_SAME(kNcclInternalError, ncclInternalError);
SCAPE_SAME(kNcclInvalidArgument, ncclInvalidArgument);
SCAPE_SAME(kNcclInvalidUsage, ncclInvalidUsage);
SCAPE_SAME(kNcclRemoteError, ncclRemoteError);
SCAPE_SAME(kNcclInProgress, ncclInProgress);
#undef SCAPE_SAME
#define SCAPE_NCCL_ABI_CHECKED 1
#endif

namespace {

// fake_libnccl.cc's types (the same layout); shared = NULL: the one-process mode.
struct FakeNcclComm {
  int nranks, rank, failWith, asyncError;
  void* shared;
  uint64_t barriers;
  int barrierTimeoutMs, ops;
};
struct FakeNcclCall {
  char fn[32];
  const void* send;
  void* recv;
  size_t count;
  int dtype, op, root;
  void* comm;
  void* stream;
  int calls;
};

fake_device::FakeRuntime& Fake() { return fake_device::InstalledFake(); }

const FakeNcclCall* LastCall() {
  void* h = dlopen(FAKE_NCCL_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!h) return nullptr;
  auto fn = reinterpret_cast<const FakeNcclCall* (*)()>(dlsym(h, "fakeNcclLastCall"));
  return fn ? fn() : nullptr;
}

class NcclBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    Fake();
    setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_PATH, 1);
    // One process posing as rank 2 of 4: no host communicator (its peers do not exist); the
    // host communicator is tested on real ranks in nccl_ranks_test.cc.
    setenv("SCAPE_NCCL_HOST_COMM", "0", 1);
    fc_ = {4, 2, 0, 0, nullptr, 0, 0, 0};
    ASSERT_EQ(scapeCommInitNccl(&comm_, &fc_, nullptr), scapeSuccess) << scapeGetLastError(nullptr);
  }
  void TearDown() override {
    if (comm_) {
      EXPECT_EQ(scapeCommDestroy(comm_), scapeSuccess) << scapeGetLastError(comm_);
    }
  }
  FakeNcclComm fc_;
  scapeComm_t comm_ = nullptr;
};

TEST(NcclBackendLoad, MissingLibraryIsUnsupportedAndNamesIt) {
  setenv("SCAPE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  FakeNcclComm fc{2, 0, 0, 0, nullptr, 0, 0, 0};
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNccl(&comm, &fc, nullptr), scapeUnsupported);
  EXPECT_EQ(comm, nullptr);
  std::string m = scapeGetLastError(nullptr);
  EXPECT_NE(m.find("scapeCommInitNccl"), std::string::npos) << m;
  EXPECT_NE(m.find("/nonexistent/libnccl.so.2"), std::string::npos) << m;
  EXPECT_NE(m.find("SCAPE_NCCL_LIBRARY"), std::string::npos) << m;
}

TEST(NcclBackendLoad, ALibraryWithoutAnEntryPointIsASystemErrorNamingIt) {
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_NOAG_PATH, 1);
  FakeNcclComm fc{2, 0, 0, 0, nullptr, 0, 0, 0};
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNccl(&comm, &fc, nullptr), scapeSystemError);
  std::string m = scapeGetLastError(nullptr);
  EXPECT_NE(m.find("ncclAllGather"), std::string::npos) << m;
}

TEST(NcclBackendLoad, AnNcclOlderThan210IsRefused) {
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_OLD_PATH, 1);
  FakeNcclComm fc{2, 0, 0, 0, nullptr, 0, 0, 0};
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNccl(&comm, &fc, nullptr), scapeSystemError);
  std::string m = scapeGetLastError(nullptr);
  EXPECT_NE(m.find("2.10"), std::string::npos) << m;
}

TEST(NcclBackendLoad, ArgumentErrors) {
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_PATH, 1);
  FakeNcclComm fc{2, 0, 0, 0, nullptr, 0, 0, 0};
  scapeComm_t comm = nullptr;
  EXPECT_EQ(scapeCommInitNccl(nullptr, &fc, nullptr), scapeInvalidArgument);
  EXPECT_EQ(scapeCommInitNccl(&comm, nullptr, nullptr), scapeInvalidArgument);
  EXPECT_NE(std::string(scapeGetLastError(nullptr)).find("ncclComm is NULL"), std::string::npos);
  scapeConfig_t bad = SCAPE_CONFIG_INITIALIZER;
  bad.magic = 0;
  EXPECT_EQ(scapeCommInitNccl(&comm, &fc, &bad), scapeInvalidArgument);
  fc.rank = 5;  // NCCL reporting nonsense
  EXPECT_EQ(scapeCommInitNccl(&comm, &fc, nullptr), scapeInvalidArgument);
  EXPECT_EQ(comm, nullptr);
}

TEST_F(NcclBackend, RankSizeAndBackendAreNccls) {
  int n = 0, r = -1, b = -1;
  EXPECT_EQ(scapeCommCount(comm_, &n), scapeSuccess);
  EXPECT_EQ(scapeCommUserRank(comm_, &r), scapeSuccess);
  EXPECT_EQ(scapeCommGetBackend(comm_, &b), scapeSuccess);
  EXPECT_EQ(n, 4);
  EXPECT_EQ(r, 2);
  EXPECT_EQ(b, scapeBackendNccl);
#ifdef SCAPE_NCCL_ABI_CHECKED
  SUCCEED() << "NCCL enum values checked against nccl.h";
#endif
}

TEST_F(NcclBackend, EveryCollectiveGoesToItsNcclCallOnTheCallersStream) {
  auto& rt = Fake();
  const size_t n = 1001;
  char* s = static_cast<char*>(rt.DeviceMalloc(4 * n * 4));
  char* r = static_cast<char*>(rt.DeviceMalloc(4 * n * 4));
  void* stream = rt.NewStream();
  struct Case {
    scapeDataType_t t;
    int nt;
    scapeRedOp_t op;
    int nop;
  } cases[] = {{scapeFloat32, 7, scapeSum, 0},
               {scapeBfloat16, 9, scapeAvg, 4},
               {scapeFloat16, 6, scapeMax, 2},
               {scapeInt32, 2, scapeMin, 3},
               {scapeInt64, 4, scapeSum, 0}};
  for (const Case& c : cases) {
    ASSERT_EQ(scapeAllReduce(s, r, n, c.t, c.op, nullptr, comm_, stream), scapeSuccess)
        << scapeGetLastError(comm_);
    const FakeNcclCall* call = LastCall();
    ASSERT_NE(call, nullptr);
    EXPECT_STREQ(call->fn, "ncclAllReduce");
    EXPECT_EQ(call->send, s);
    EXPECT_EQ(call->recv, r);
    EXPECT_EQ(call->count, n);
    EXPECT_EQ(call->dtype, c.nt);
    EXPECT_EQ(call->op, c.nop);
    EXPECT_EQ(call->comm, &fc_);
    EXPECT_EQ(call->stream, stream);
  }
  ASSERT_EQ(scapeReduceScatter(s, r, n, scapeFloat32, scapeAvg, comm_, stream), scapeSuccess);
  EXPECT_STREQ(LastCall()->fn, "ncclReduceScatter");
  EXPECT_EQ(LastCall()->count, n);  // per-rank count, as in NCCL
  EXPECT_EQ(LastCall()->op, 4);
  ASSERT_EQ(scapeAllGather(s, r, n, scapeBfloat16, comm_, stream), scapeSuccess);
  EXPECT_STREQ(LastCall()->fn, "ncclAllGather");
  EXPECT_EQ(LastCall()->dtype, 9);
  // Broadcast: the root's buffer; a non-root may pass NULL.
  ASSERT_EQ(scapeBroadcast(nullptr, r, n, scapeInt32, 3, comm_, nullptr), scapeSuccess)
      << scapeGetLastError(comm_);
  EXPECT_STREQ(LastCall()->fn, "ncclBroadcast");
  EXPECT_EQ(LastCall()->root, 3);
  EXPECT_EQ(LastCall()->stream, nullptr);
  // count 0 is passed through (NCCL accepts it), buffers may be NULL.
  ASSERT_EQ(scapeAllReduce(nullptr, nullptr, 0, scapeFloat32, scapeSum, nullptr, comm_, stream),
            scapeSuccess);
  EXPECT_EQ(LastCall()->count, 0u);
  rt.DeviceFree(s);
  rt.DeviceFree(r);
}

// 8-bit floats on the NCCL backend (issue 44 item 5): an all-gather or a broadcast moves them as
// bytes (ncclUint8, any NCCL); a reduction goes to NCCL's fp8 types only where NCCL has them
// (2.24 or later, compute capability 9.0 or later), else scapeUnsupported naming the NCCL
// version, the device and what to use instead, with no NCCL call. Before: every fp8 call went
// to NCCL as ncclFloat8e4m3 / e5m2 (10, 11), which NCCL before 2.24 and sm_80 do not have.
void CheckFp8(scapeComm_t comm, void* fc, int version, int cc) {
  auto& rt = Fake();
  const int cc0 = rt.computeCapability.load();
  rt.computeCapability.store(cc);
  const size_t n = 257;
  char* s = static_cast<char*>(rt.DeviceMalloc(n * 4));
  char* r = static_cast<char*>(rt.DeviceMalloc(n * 4));
  void* stream = rt.NewStream();
  const bool hasFp8 = version >= 22400 && cc >= 90;
  for (scapeDataType_t t : {scapeFloat8E4M3, scapeFloat8E5M2}) {
    SCOPED_TRACE(testing::Message() << "type " << t << ", NCCL " << version << ", cc " << cc);
    ASSERT_EQ(scapeAllGather(s, r, n, t, comm, stream), scapeSuccess) << scapeGetLastError(comm);
    EXPECT_STREQ(LastCall()->fn, "ncclAllGather");
    EXPECT_EQ(LastCall()->dtype, 1) << "fp8 moved as ncclUint8";
    EXPECT_EQ(LastCall()->comm, fc);
    ASSERT_EQ(scapeBroadcast(s, r, n, t, 2, comm, stream), scapeSuccess) << scapeGetLastError(comm);
    EXPECT_STREQ(LastCall()->fn, "ncclBroadcast");
    EXPECT_EQ(LastCall()->dtype, 1);
    const int calls = LastCall()->calls;
    const scapeResult_t ar = scapeAllReduce(s, r, n, t, scapeSum, nullptr, comm, stream);
    const std::string msg = scapeGetLastError(comm);
    const scapeResult_t rs = scapeReduceScatter(s, r, n / 4, t, scapeAvg, comm, stream);
    if (hasFp8) {
      EXPECT_EQ(ar, scapeSuccess) << msg;
      EXPECT_EQ(rs, scapeSuccess) << scapeGetLastError(comm);
      EXPECT_EQ(LastCall()->dtype, t == scapeFloat8E4M3 ? 10 : 11);
    } else {
      EXPECT_EQ(ar, scapeUnsupported) << msg;
      EXPECT_EQ(rs, scapeUnsupported);
      EXPECT_EQ(LastCall()->calls, calls) << "a refused fp8 reduction reached NCCL";
      EXPECT_NE(msg.find("2.24"), std::string::npos) << msg;
      EXPECT_NE(
          msg.find("compute capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10)),
          std::string::npos)
          << msg;
      EXPECT_NE(msg.find("scapeBfloat16"), std::string::npos) << msg;
      EXPECT_NE(msg.find(t == scapeFloat8E4M3 ? "scapeFloat8E4M3" : "scapeFloat8E5M2"),
                std::string::npos)
          << msg;
    }
  }
  EXPECT_TRUE(rt.StreamSynchronize(stream).ok());
  rt.DeviceFree(s);
  rt.DeviceFree(r);
  rt.computeCapability.store(cc0);
}

TEST_F(NcclBackend, Fp8MovesAsBytesAndReducesOnlyWhereNcclHasTheType) {
  CheckFp8(comm_, &fc_, 22809, 90);  // NCCL 2.28 on sm_90: NCCL's fp8
  CheckFp8(comm_, &fc_, 22809, 80);  // sm_80 (an A100): refused
}

TEST(NcclBackendFp8, AnNcclBefore224RefusesFp8Reductions) {
  Fake();
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_222_PATH, 1);
  setenv("SCAPE_NCCL_HOST_COMM", "0", 1);
  FakeNcclComm fc = {4, 2, 0, 0, nullptr, 0, 0, 0};
  scapeComm_t comm = nullptr;
  ASSERT_EQ(scapeCommInitNccl(&comm, &fc, nullptr), scapeSuccess) << scapeGetLastError(nullptr);
  // LastCall() reads the default fake; this one's record is its own.
  void* h = dlopen(FAKE_NCCL_222_PATH, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  ASSERT_NE(h, nullptr);
  auto last = reinterpret_cast<const FakeNcclCall* (*)()>(dlsym(h, "fakeNcclLastCall"));
  ASSERT_NE(last, nullptr);
  auto& rt = Fake();
  char* s = static_cast<char*>(rt.DeviceMalloc(64));
  char* r = static_cast<char*>(rt.DeviceMalloc(64));
  const int calls = last()->calls;
  EXPECT_EQ(scapeAllReduce(s, r, 64, scapeFloat8E4M3, scapeSum, nullptr, comm, nullptr),
            scapeUnsupported);
  const std::string msg = scapeGetLastError(comm);
  EXPECT_NE(msg.find("NCCL 2.22.3"), std::string::npos) << msg;
  EXPECT_EQ(last()->calls, calls);
  EXPECT_EQ(scapeAllGather(s, r, 16, scapeFloat8E5M2, comm, nullptr), scapeSuccess)
      << scapeGetLastError(comm);
  EXPECT_EQ(last()->dtype, 1);
  EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
  rt.DeviceFree(s);
  rt.DeviceFree(r);
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_PATH, 1);
}

TEST_F(NcclBackend, HostBuffersMixesAndMissingFormsAreClearErrors) {
  auto& rt = Fake();
  const size_t n = 64;
  void* d = rt.DeviceMalloc(n * 4);
  std::vector<float> h(n);
  const int calls = LastCall() ? LastCall()->calls : 0;
  EXPECT_EQ(scapeAllReduce(h.data(), h.data(), n, scapeFloat32, scapeSum, nullptr, comm_, nullptr),
            scapeInvalidArgument);
  std::string m = scapeGetLastError(comm_);
  EXPECT_NE(m.find("host memory: the NCCL backend moves device memory only"), std::string::npos)
      << m;
  EXPECT_EQ(scapeAllReduce(d, h.data(), n, scapeFloat32, scapeSum, nullptr, comm_, nullptr),
            scapeInvalidArgument);
  m = scapeGetLastError(comm_);
  EXPECT_NE(m.find("sendbuf is device memory but recvbuf is host memory"), std::string::npos) << m;
  EXPECT_EQ(
      scapeAllReduce(d, d, n, static_cast<scapeDataType_t>(17), scapeSum, nullptr, comm_, nullptr),
      scapeInvalidArgument);
  EXPECT_EQ(
      scapeAllReduce(d, d, n, scapeFloat32, static_cast<scapeRedOp_t>(9), nullptr, comm_, nullptr),
      scapeInvalidArgument);
  EXPECT_EQ(scapeBroadcast(d, d, n, scapeFloat32, 4, comm_, nullptr), scapeInvalidArgument);
  EXPECT_EQ(scapeAllReduce(nullptr, d, n, scapeFloat32, scapeSum, nullptr, comm_, nullptr),
            scapeInvalidArgument);
  EXPECT_EQ(scapeBarrier(comm_), scapeUnsupported);
  scapeRequest_t req = nullptr;
  EXPECT_EQ(scapeAllReduceAsync(d, d, n, scapeFloat32, scapeSum, nullptr, comm_, nullptr, &req),
            scapeUnsupported);
  EXPECT_EQ(LastCall() ? LastCall()->calls : 0, calls) << "an erroneous call reached NCCL";
  rt.DeviceFree(d);
}

TEST_F(NcclBackend, NcclErrorsAreMappedWithNcclsMessage) {
  auto& rt = Fake();
  void* d = rt.DeviceMalloc(256);
  fc_.failWith = 6;  // ncclRemoteError
  EXPECT_EQ(scapeAllReduce(d, d, 64, scapeFloat32, scapeSum, nullptr, comm_, nullptr),
            scapeRemoteError);
  std::string m = scapeGetLastError(comm_);
  EXPECT_NE(m.find("ncclAllReduce returned 6"), std::string::npos) << m;
  EXPECT_NE(m.find("failed on purpose"), std::string::npos) << m;
  fc_.failWith = 1;  // ncclUnhandledCudaError
  EXPECT_EQ(scapeAllGather(d, d, 16, scapeFloat32, comm_, nullptr), scapeSystemError);
  fc_.failWith = 7;  // ncclInProgress (non-blocking communicator): enqueued, not an error
  EXPECT_EQ(scapeAllReduce(d, d, 64, scapeFloat32, scapeSum, nullptr, comm_, nullptr),
            scapeSuccess);
  fc_.failWith = 0;
  scapeResult_t ae = scapeInternalError;
  EXPECT_EQ(scapeCommGetAsyncError(comm_, &ae), scapeSuccess);
  EXPECT_EQ(ae, scapeSuccess);
  fc_.asyncError = 6;
  EXPECT_EQ(scapeCommGetAsyncError(comm_, &ae), scapeSuccess);
  EXPECT_EQ(ae, scapeRemoteError);
  fc_.asyncError = 0;
  rt.DeviceFree(d);
}

// After ncclCommAbort (scapeCommAbort: DataPath::Abort, possibly from another thread while a
// call is in progress) the NCCL communicator is gone: every later call of the backend is a
// clear scapeInvalidUsage and none reaches NCCL. The fake NCCL poisons an ended communicator
// and counts the calls made on it, as real NCCL would use freed memory there.
TEST(NcclBackendAbort, EveryCallAfterAbortIsAClearErrorAndNeverReachesNccl) {
  auto& rt = Fake();
  setenv("SCAPE_NCCL_LIBRARY", FAKE_NCCL_PATH, 1);
  void* h = dlopen(FAKE_NCCL_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  auto getId = reinterpret_cast<int (*)(scape::device::NcclUniqueId*)>(dlsym(h, "ncclGetUniqueId"));
  auto init = reinterpret_cast<int (*)(void**, int, scape::device::NcclUniqueId, int)>(
      dlsym(h, "ncclCommInitRank"));
  auto onEnded = reinterpret_cast<int (*)()>(dlsym(h, "fakeNcclCallsOnEndedComms"));
  ASSERT_TRUE(getId && init && onEnded);
  scape::device::NcclUniqueId id;
  ASSERT_EQ(getId(&id), 0);
  void* nc = nullptr;
  ASSERT_EQ(init(&nc, 1, id, 0), 0);
  std::unique_ptr<scape::device::NcclComm> nb;
  ASSERT_TRUE(scape::device::NcclComm::Create(nc, &nb, /*owned=*/true).ok());
  scape::device::NcclComm* raw = nb.get();
  scape::backend::NcclBackend b(std::move(nb), 2000, scapeDeviceAllocator_t{});
  const size_t n = 64;
  void* d = rt.DeviceMalloc(n * 4);
  scape::coll::CollArgs a;
  a.type = scape::coll::CollType::kAllReduce;
  a.send = d;
  a.recv = d;
  a.count = n;
  ASSERT_TRUE(b.Admit(a, nullptr, false).ok());
  ASSERT_TRUE(b.Run(a, nullptr, nullptr).ok());
  EXPECT_TRUE(b.AsyncError().ok());
  const int before = onEnded();
  b.Abort();  // ncclCommAbort
  auto refused = [&](const scape::Status& st, const char* what) {
    EXPECT_EQ(st.code(), scapeInvalidUsage) << what << ": " << st.message();
    EXPECT_NE(st.message().find("NCCL communicator was aborted"), std::string::npos)
        << what << ": " << st.message();
  };
  refused(b.Admit(a, nullptr, false), "Admit");
  refused(b.Run(a, nullptr, nullptr), "Run");
  refused(raw->Run(a, nullptr), "device::NcclComm::Run");
  a.counts = {n};  // the packed (V) form
  refused(raw->Run(a, nullptr), "device::NcclComm::Run (V)");
  a.counts.clear();
  refused(b.AsyncError(), "AsyncError");
  int32_t v = 1;
  refused(raw->BroadcastHostBytes(&v, sizeof(v), 0, 1000), "BroadcastHostBytes");
  b.Release(1000);  // no ncclCommDestroy after the abort
  EXPECT_EQ(onEnded(), before) << "a call reached NCCL after ncclCommAbort";
  rt.DeviceFree(d);
}

TEST(NcclBackendMapping, ResultsTypesAndOps) {
  using namespace scape::device;
  EXPECT_EQ(FromNccl(kNcclSuccess, "x", nullptr).code(), scapeSuccess);
  EXPECT_EQ(FromNccl(kNcclInvalidArgument, "x", nullptr).code(), scapeInvalidArgument);
  EXPECT_EQ(FromNccl(kNcclInvalidUsage, "x", nullptr).code(), scapeInvalidUsage);
  EXPECT_EQ(FromNccl(kNcclInternalError, "x", nullptr).code(), scapeInternalError);
  EXPECT_EQ(FromNccl(kNcclSystemError, "x", nullptr).code(), scapeSystemError);
  EXPECT_EQ(FromNccl(99, "x", nullptr).code(), scapeSystemError);
  EXPECT_EQ(NcclDataType(static_cast<scapeDataType_t>(scapeNumTypes)), -1);
  EXPECT_EQ(NcclRedOp(static_cast<scapeRedOp_t>(scapeNumOps)), -1);
}

}  // namespace
