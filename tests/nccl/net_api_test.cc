// The net plugin through its ABI, in one process per test: symbols, init/finalize, device
// properties, argument checking and error codes, logging, corrupted handles, connecting a
// process to itself, virtual devices, unload/reload, concurrent registration.
#include <dlfcn.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/nccl/fake_nccl.h"

namespace {

using namespace fake_nccl;

constexpr int kWatchdogMs = 60000;

// A send/recv comm pair of one process connected to itself, with a registered buffer each.
struct SelfPair {
  void* lc = nullptr;
  void* sc = nullptr;
  void* rc = nullptr;
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  bool Open(const ncclNet_v11_t* net, void* ctx) {
    std::memset(handle, 0, sizeof(handle));
    if (net->listen(ctx, 0, handle, &lc) != ncclSuccess || !lc) return false;
    int r = PollConnectAccept(net, ctx, 0, handle, lc, &sc, &rc);
    if (r != ncclSuccess) {
      ADD_FAILURE() << "connect/accept: " << r;
      return false;
    }
    return net->closeListen(lc) == ncclSuccess;
  }
  bool Close(const ncclNet_v11_t* net) {
    return net->closeSend(sc) == ncclSuccess && net->closeRecv(rc) == ncclSuccess;
  }
};

// Does this machine's UCX move CUDA memory? Asked of UCX directly, independently of the plugin.
bool UcxMovesCuda() {
  ucp_config_t* cfg = nullptr;
  if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) return false;
  ucp_params_t prm;
  std::memset(&prm, 0, sizeof(prm));
  prm.field_mask = UCP_PARAM_FIELD_FEATURES;
  prm.features = UCP_FEATURE_TAG;
  ucp_context_h ctx = nullptr;
  ucs_status_t s = ucp_init(&prm, cfg, &ctx);
  ucp_config_release(cfg);
  if (s != UCS_OK) return false;
  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  bool cuda = ucp_context_query(ctx, &attr) == UCS_OK &&
              (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
  ucp_cleanup(ctx);
  return cuda;
}

// ---------------------------------------------------------------------------------------------

TEST(Abi, ExportsEveryVersionTheWayNcclLooksThemUp) {
  RUN_PROCS(kWatchdogMs, [] {
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    const ncclNet_v11_t* n = p.v11;
    REQUIRE(n->name != nullptr);
    EXPECT_STREQ(n->name, "SCAPE");
    EXPECT_STREQ(p.v10->name, "SCAPE");
    EXPECT_STREQ(p.v9->name, "SCAPE");
    EXPECT_STREQ(p.v8->name, "SCAPE");
    // Members NCCL 2.28 calls without a NULL check (fact sheet 5.14).
    for (const void* f :
         {(const void*)n->init, (const void*)n->devices, (const void*)n->getProperties,
          (const void*)n->listen, (const void*)n->connect, (const void*)n->accept,
          (const void*)n->regMr, (const void*)n->deregMr, (const void*)n->isend,
          (const void*)n->irecv, (const void*)n->iflush, (const void*)n->test,
          (const void*)n->closeSend, (const void*)n->closeRecv, (const void*)n->closeListen,
          (const void*)n->finalize})
      EXPECT_NE(f, nullptr);
    EXPECT_EQ(n->getDeviceMr, nullptr);    // host plugin
    EXPECT_EQ(n->irecvConsumed, nullptr);  // host plugin
    EXPECT_NE(n->makeVDevice, nullptr);
    EXPECT_NE(n->setNetAttr, nullptr);
    EXPECT_NE(p.v8->isend, nullptr);
    EXPECT_NE(p.v9->makeVDevice, nullptr);
    // Versions 2.28 would also accept but we do not export, and names it must not find.
    for (const char* s :
         {"ncclNetPlugin_v7", "ncclNetPlugin_v6", "ncclCollNetPlugin_v11", "ncclGinPlugin_v11",
          "ncclTunerPlugin_v5", "ncclTunerPlugin_v4", "ncclProfiler_v5", "ncclProfiler_v4"})
      EXPECT_EQ(dlsym(p.lib, s), nullptr) << s;
    return true;
  });
}

TEST(Init, ContextPerCommunicatorConfigCopiedNullProfiler) {
  RUN_PROCS(kWatchdogMs, [] {
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    const ncclNet_v11_t* n = p.v11;
    void* a = nullptr;
    void* b = nullptr;
    {
      ncclNetCommConfig_v11_t cfg{5};  // a stack config, as NCCL passes it
      REQUIRE_OK(n->init(&a, 0x11, &cfg, &Logger, nullptr));
      cfg.trafficClass = 99;  // the plugin must have copied it
    }
    REQUIRE_OK(n->init(&b, 0x11, nullptr, &Logger, nullptr));  // same commId: legal
    REQUIRE(a != nullptr && b != nullptr && a != b);
    int n1 = 0, n2 = 0;
    REQUIRE_OK(n->devices(&n1));
    REQUIRE_OK(n->devices(&n2));
    EXPECT_GT(n1, 0);
    EXPECT_EQ(n1, n2);
    EXPECT_TRUE(Logged(NCCL_LOG_INFO, {"trafficClass 5"}));
    // setNetAttr is accepted (a hint).
    ncclNetAttr_v11_t attr;
    std::memset(&attr, 0xff, sizeof(attr));
    EXPECT_EQ(n->setNetAttr(a, &attr), ncclSuccess);
    REQUIRE_OK(n->finalize(a));
    REQUIRE_OK(n->finalize(b));
    EXPECT_EQ(n->finalize(nullptr), ncclSuccess);
    // init / finalize again after everything was released.
    void* c = nullptr;
    REQUIRE_OK(InitCtx(n, &c));
    REQUIRE_OK(n->finalize(c));
    return true;
  });
}

TEST(Init, FailsCleanlyWithoutAUsableDevice) {
  RUN_PROCS(kWatchdogMs, [] {
    setenv("SCAPE_NCCL_DEVICES", "=no_such_nic0", 1);
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    void* ctx = reinterpret_cast<void*>(0x1);
    ncclResult_t r = InitCtx(p.v11, &ctx);
    EXPECT_EQ(r, ncclSystemError);
    EXPECT_EQ(ctx, nullptr);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"init", "no_such_nic0"}));
    // NCCL 2.28 calls finalize even after a failed init.
    EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
    int nd = -1;
    EXPECT_EQ(p.v11->devices(&nd), ncclInternalError);
    // The older ABIs fail the same way.
    EXPECT_EQ(p.v10->init(&Logger, nullptr), ncclSystemError);
    EXPECT_EQ(p.v8->init(&Logger), ncclSystemError);
    char h[NCCL_NET_HANDLE_MAXSIZE];
    void* lc = nullptr;
    EXPECT_EQ(p.v8->listen(0, h, &lc), ncclInternalError);
    return true;
  });
}

TEST(Init, MalformedKnobIsInvalidUsage) {
  RUN_PROCS(kWatchdogMs, [] {
    setenv("SCAPE_TIMEOUT_MS", "soon", 1);
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    void* ctx = nullptr;
    EXPECT_EQ(InitCtx(p.v11, &ctx), ncclInvalidUsage);
    EXPECT_EQ(ctx, nullptr);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"SCAPE_TIMEOUT_MS"}));
    EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
    return true;
  });
}

TEST(Properties, DescribeTheRealDevices) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    int nd = 0;
    REQUIRE_OK(e.net->devices(&nd));
    REQUIRE(nd > 0);
    const bool cuda = UcxMovesCuda();  // whatever it is, the plugin advertises host memory
    std::set<std::string> names;
    for (int d = 0; d < nd; ++d) {
      ncclNetProperties_v11_t pr;
      std::memset(&pr, 0xab, sizeof(pr));
      REQUIRE_OK(e.net->getProperties(d, &pr));
      REQUIRE(pr.name != nullptr);
      EXPECT_TRUE(names.insert(pr.name).second) << "duplicate device name " << pr.name;
      if (pr.pciPath) {
        struct stat st;
        EXPECT_EQ(stat(pr.pciPath, &st), 0) << pr.pciPath;
      }
      // Host memory only, whatever this UCX can copy: the plugin has no GPUDirect RDMA (it
      // registers nothing with the NIC and does not flush), so NCCL stages device buffers.
      EXPECT_EQ(pr.ptrSupport & (NCCL_PTR_HOST | NCCL_PTR_CUDA), NCCL_PTR_HOST)
          << "this UCX " << (cuda ? "lists" : "does not list") << " CUDA memory";
      EXPECT_EQ(pr.ptrSupport & NCCL_PTR_DMABUF, 0);
      EXPECT_GT(pr.speed, 0);
      EXPECT_GE(pr.latency, 0.0f);
      EXPECT_GT(pr.maxComms, 0);
      EXPECT_GE(pr.maxRecvs, 2);
      EXPECT_LE(pr.maxRecvs, 64);
      EXPECT_EQ(pr.netDeviceType, NCCL_NET_DEVICE_HOST);
      EXPECT_EQ(pr.netDeviceVersion, 0);
      EXPECT_EQ(pr.vProps.ndevs, 1);
      EXPECT_EQ(pr.vProps.devs[0], d);
      EXPECT_GT(pr.maxP2pBytes, 0u);
      EXPECT_LE(pr.maxP2pBytes, NCCL_MAX_NET_SIZE_BYTES);
      EXPECT_LE(pr.maxP2pBytes, static_cast<size_t>(INT_MAX));  // test() reports int sizes
      EXPECT_GT(pr.maxCollBytes, 0u);
      EXPECT_LE(pr.maxCollBytes, NCCL_MAX_NET_SIZE_BYTES);
      EXPECT_EQ(pr.maxMultiRequestSize, 1);
      // An interface device reports the kernel's link speed when it has one.
      std::ifstream sp(std::string("/sys/class/net/") + pr.name + "/speed");
      int mbps = 0;
      if (sp >> mbps && mbps > 0) {
        EXPECT_EQ(pr.speed, mbps);
      }
      // The older layouts carry the same values.
      ncclNetProperties_v10_t p10;
      REQUIRE_OK(e.p.v10->getProperties(d, &p10));
      EXPECT_STREQ(p10.name, pr.name);
      EXPECT_EQ(p10.speed, pr.speed);
      EXPECT_EQ(p10.maxRecvs, pr.maxRecvs);
      EXPECT_EQ(p10.vProps.ndevs, 1);
      EXPECT_EQ(p10.maxP2pBytes, pr.maxP2pBytes);
      ncclNetProperties_v8_t p8;
      REQUIRE_OK(e.p.v8->getProperties(d, &p8));
      EXPECT_STREQ(p8.name, pr.name);
      EXPECT_EQ(p8.speed, pr.speed);
      EXPECT_EQ(p8.ptrSupport, pr.ptrSupport);
      EXPECT_EQ(p8.maxComms, pr.maxComms);
    }
    // Without RDMA ports, the test environment exposes exactly the interface named by
    // SCAPE_SOCKET_IFNAME.
    const char* ifn = std::getenv("SCAPE_SOCKET_IFNAME");
    struct stat ib;
    bool rdma = stat("/sys/class/infiniband", &ib) == 0;
    if (ifn && !std::getenv("SCAPE_NCCL_DEVICES") && !rdma) {
      EXPECT_EQ(nd, 1);
      EXPECT_EQ(*names.begin(), ifn);
    }
    ncclNetProperties_v11_t pr;
    EXPECT_EQ(e.net->getProperties(nd, &pr), ncclInternalError);
    EXPECT_EQ(e.net->getProperties(-1, &pr), ncclInternalError);
    EXPECT_EQ(e.net->getProperties(0, nullptr), ncclInternalError);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"getProperties", "device -1"}));
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Args, EveryEntryPointRejectsBadArguments) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    const ncclNet_v11_t* n = e.net;
    const ncclResult_t kInt = ncclInternalError;
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void* out = reinterpret_cast<void*>(0x1);
    int nd = 0;
    REQUIRE_OK(n->devices(&nd));

    EXPECT_EQ(n->init(nullptr, 0, nullptr, &Logger, nullptr), kInt);
    EXPECT_EQ(n->devices(nullptr), kInt);
    EXPECT_EQ(n->listen(nullptr, 0, handle, &out), kInt);
    EXPECT_EQ(out, nullptr);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"listen", "ctx is NULL"}));
    EXPECT_EQ(n->listen(handle, 0, handle, &out), kInt);  // not a context
    EXPECT_EQ(n->listen(e.ctx, nd, handle, &out), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"listen", "does not exist"}));
    EXPECT_EQ(n->listen(e.ctx, -3, handle, &out), kInt);
    EXPECT_EQ(n->listen(e.ctx, 0, nullptr, &out), kInt);
    EXPECT_EQ(n->listen(e.ctx, 0, handle, nullptr), kInt);
    EXPECT_EQ(n->connect(e.ctx, 0, nullptr, &out, nullptr), kInt);
    EXPECT_EQ(n->connect(e.ctx, 0, handle, nullptr, nullptr), kInt);
    EXPECT_EQ(n->connect(e.ctx, nd, handle, &out, nullptr), kInt);
    EXPECT_EQ(n->connect(nullptr, 0, handle, &out, nullptr), kInt);
    EXPECT_EQ(n->accept(nullptr, &out, nullptr), kInt);
    EXPECT_EQ(n->accept(handle, &out, nullptr), kInt);
    EXPECT_EQ(n->closeListen(nullptr), kInt);
    EXPECT_EQ(n->closeSend(nullptr), kInt);
    EXPECT_EQ(n->closeRecv(handle), kInt);
    EXPECT_EQ(n->test(nullptr, reinterpret_cast<int*>(handle), nullptr), kInt);
    int done = 7;
    EXPECT_EQ(n->test(handle, &done, nullptr), kInt);
    EXPECT_EQ(done, 0);
    EXPECT_EQ(n->finalize(handle), kInt);
    EXPECT_EQ(n->setNetAttr(e.ctx, nullptr), kInt);
    EXPECT_EQ(n->setNetAttr(nullptr, nullptr), kInt);

    SelfPair sp;
    REQUIRE(sp.Open(n, e.ctx));
    std::vector<char> buf(4096);
    void* mh = nullptr;
    EXPECT_EQ(n->regMr(sp.sc, buf.data(), buf.size(), 0x40, &mh), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"regMr", "type 64"}));
    EXPECT_EQ(n->regMr(sp.sc, buf.data(), buf.size(), NCCL_PTR_HOST, nullptr), kInt);
    EXPECT_EQ(n->regMr(nullptr, buf.data(), buf.size(), NCCL_PTR_HOST, &mh), kInt);
    EXPECT_EQ(n->regMr(sp.sc, nullptr, 64, NCCL_PTR_HOST, &mh), kInt);
    // CUDA memory is not advertised (whatever UCX can copy): refused, naming why.
    EXPECT_EQ(n->regMr(sp.sc, buf.data(), 64, NCCL_PTR_CUDA, &mh), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"regMr", "NCCL_PTR_CUDA", "GPUDirect"}));
    void* smh = nullptr;
    void* rmh = nullptr;
    REQUIRE_OK(n->regMr(sp.sc, buf.data(), buf.size(), NCCL_PTR_HOST, &smh));
    REQUIRE_OK(n->regMr(sp.rc, buf.data(), buf.size(), NCCL_PTR_HOST, &rmh));
    void* req = reinterpret_cast<void*>(0x1);
    // isend
    EXPECT_EQ(n->isend(nullptr, buf.data(), 8, 0, smh, nullptr, &req), kInt);
    EXPECT_EQ(req, nullptr);
    EXPECT_EQ(n->isend(sp.rc, buf.data(), 8, 0, smh, nullptr, &req), kInt);  // a recv comm
    EXPECT_EQ(n->isend(sp.sc, buf.data(), 8, 0, nullptr, nullptr, &req), kInt);
    EXPECT_EQ(n->isend(sp.sc, buf.data(), 8, 0, smh, nullptr, nullptr), kInt);
    EXPECT_EQ(n->isend(sp.sc, buf.data() + 4000, 200, 0, smh, nullptr, &req), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"isend", "outside the registered region"}));
    ncclNetProperties_v11_t pr;
    REQUIRE_OK(n->getProperties(0, &pr));
    EXPECT_EQ(n->isend(sp.sc, buf.data(), pr.maxP2pBytes + 1, 0, smh, nullptr, &req), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"isend", "exceeds maxP2pBytes"}));
    // irecv
    void* data[9];
    size_t sizes[9];
    int tags[9];
    void* mhs[9];
    for (int i = 0; i < 9; ++i) {
      data[i] = buf.data();
      sizes[i] = 16;
      tags[i] = i;
      mhs[i] = rmh;
    }
    EXPECT_EQ(n->irecv(sp.rc, 0, data, sizes, tags, mhs, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.rc, pr.maxRecvs + 1, data, sizes, tags, mhs, nullptr, &req), kInt);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"irecv", "maxRecvs"}));
    EXPECT_EQ(n->irecv(sp.rc, 1, nullptr, sizes, tags, mhs, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.rc, 1, data, nullptr, tags, mhs, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.rc, 1, data, sizes, nullptr, mhs, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.rc, 1, data, sizes, tags, nullptr, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.sc, 1, data, sizes, tags, mhs, nullptr, &req), kInt);
    EXPECT_EQ(n->irecv(sp.rc, 1, data, sizes, tags, mhs, nullptr, nullptr), kInt);
    sizes[0] = pr.maxP2pBytes + 1;
    EXPECT_EQ(n->irecv(sp.rc, 1, data, sizes, tags, mhs, nullptr, &req), kInt);
    sizes[0] = 16;
    EXPECT_EQ(n->iflush(sp.rc, 0, data, nullptr, mhs, &req), kInt);
    EXPECT_EQ(n->iflush(sp.sc, 1, data, nullptr, mhs, &req), kInt);
    EXPECT_EQ(n->deregMr(sp.sc, nullptr), kInt);
    EXPECT_EQ(n->deregMr(nullptr, smh), kInt);
    EXPECT_EQ(n->deregMr(sp.sc, buf.data()), kInt);
    // The comm is still usable after all that: NCCL's optional-completion hint in *request is
    // replaced, and a 0-byte message goes through.
    req = NCCL_NET_OPTIONAL_RECV_COMPLETION_HINT;
    REQUIRE_OK(PostRecv(n, sp.rc, 1, data, sizes, tags, mhs, &req));
    REQUIRE(req != NCCL_NET_OPTIONAL_RECV_COMPLETION_HINT);
    void* sreq = nullptr;
    REQUIRE_OK(PostSend(n, sp.sc, buf.data(), 0, 0, smh, &sreq));
    int got[64] = {0};
    got[0] = -5;
    REQUIRE_OK(WaitReq(n, req, got));
    EXPECT_EQ(got[0], 0);
    int sgot = -5;
    REQUIRE_OK(WaitReq(n, sreq, &sgot));
    EXPECT_EQ(sgot, 0);
    // A request reported done is the plugin's again: testing it once more is an error.
    EXPECT_EQ(n->test(req, &done, nullptr), kInt);
    // iflush on host memory: nothing to flush.
    req = reinterpret_cast<void*>(0x1);
    int isz = 16;
    EXPECT_EQ(n->iflush(sp.rc, 1, data, &isz, mhs, &req), ncclSuccess);
    EXPECT_EQ(req, nullptr);
    REQUIRE_OK(n->deregMr(sp.sc, smh));
    REQUIRE_OK(n->deregMr(sp.rc, rmh));
    REQUIRE(sp.Close(n));
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Loopback, ProcessConnectsToItselfAndMovesData) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    const ncclNet_v11_t* n = e.net;
    SelfPair sp;
    REQUIRE(sp.Open(n, e.ctx));
    for (size_t size : {size_t(1), size_t(100), size_t(65536 + 7), size_t(3) << 20}) {
      std::vector<char> sb(size), rb(size + 64, 0);
      Fill(sb.data(), size, size);
      void *smh, *rmh, *sreq, *rreq;
      REQUIRE_OK(n->regMr(sp.sc, sb.data(), sb.size(), NCCL_PTR_HOST, &smh));
      REQUIRE_OK(n->regMr(sp.rc, rb.data(), rb.size(), NCCL_PTR_HOST, &rmh));
      void* d = rb.data();
      size_t cap = rb.size();
      int tag = 42;
      REQUIRE_OK(PostRecv(n, sp.rc, 1, &d, &cap, &tag, &rmh, &rreq));
      REQUIRE_OK(PostSend(n, sp.sc, sb.data(), size, 42, smh, &sreq));
      int rs[64] = {0}, ss = 0;
      REQUIRE_OK(WaitReq(n, sreq, &ss));
      REQUIRE_OK(WaitReq(n, rreq, rs));
      EXPECT_EQ(static_cast<size_t>(rs[0]), size);
      EXPECT_EQ(static_cast<size_t>(ss), size);
      EXPECT_EQ(FirstMismatch(rb.data(), size, size), size);
      REQUIRE_OK(n->deregMr(sp.sc, smh));
      REQUIRE_OK(n->deregMr(sp.rc, rmh));
    }
    REQUIRE(sp.Close(n));
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Handle, CorruptedHandlesAreRefusedCleanly) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    const ncclNet_v11_t* n = e.net;
    char good[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void* lc = nullptr;
    REQUIRE_OK(n->listen(e.ctx, 0, good, &lc));
    std::mt19937 rng(1234);
    int refused = 0;
    // Every byte NCCL would carry that names the listener, flipped one at a time.
    for (int i = 0; i < 56; ++i) {
      char h[NCCL_NET_HANDLE_MAXSIZE];
      std::memcpy(h, good, sizeof(h));
      h[i] ^= static_cast<char>(1 + rng() % 255);
      void* sc = nullptr;
      int r = PollConnect(n, e.ctx, 0, h, &sc, 5000);
      EXPECT_NE(r, ncclSuccess) << "byte " << i;
      EXPECT_NE(r, kTimedOut) << "byte " << i;
      EXPECT_EQ(sc, nullptr);
      if (r == ncclInternalError) ++refused;
    }
    EXPECT_EQ(refused, 56);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"connect", "corrupted handle"}));
    // All zeros and random garbage.
    for (int k = 0; k < 20; ++k) {
      char h[NCCL_NET_HANDLE_MAXSIZE];
      for (char& c : h) c = static_cast<char>(k == 0 ? 0 : rng());
      void* sc = nullptr;
      EXPECT_EQ(PollConnect(n, e.ctx, 0, h, &sc, 5000), ncclInternalError);
    }
    // Garbage in the sender's scratch area names no connect in progress.
    {
      char h[NCCL_NET_HANDLE_MAXSIZE];
      std::memcpy(h, good, sizeof(h));
      for (int i = 64; i < 72; ++i) h[i] = static_cast<char>(0x5a);
      void* sc = nullptr;
      EXPECT_EQ(PollConnect(n, e.ctx, 0, h, &sc, 5000), ncclInternalError);
    }
    // The listener survived all that: a good handle still connects.
    void* sc = nullptr;
    void* rc = nullptr;
    REQUIRE_OK(PollConnectAccept(n, e.ctx, 0, good, lc, &sc, &rc));
    REQUIRE_OK(n->closeListen(lc));
    REQUIRE_OK(n->closeSend(sc));
    REQUIRE_OK(n->closeRecv(rc));
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Handle, ClosedListenerGivesRemoteError) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void* lc = nullptr;
    REQUIRE_OK(e.net->listen(e.ctx, 0, h, &lc));
    REQUIRE_OK(e.net->closeListen(lc));
    void* sc = nullptr;
    EXPECT_EQ(PollConnect(e.net, e.ctx, 0, h, &sc, 10000), ncclRemoteError);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"connect", "cannot reach the listener"}));
    REQUIRE(e.Down());
    return true;
  });
}

// Another interface that is up with an address, besides loopback (for merging devices).
std::string OtherInterface() {
  ifaddrs* list = nullptr;
  std::string out;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next)
    if (i->ifa_addr && (i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK) &&
        i->ifa_addr->sa_family == AF_INET) {
      out = i->ifa_name;
      break;
    }
  freeifaddrs(list);
  return out;
}

TEST(VirtualDevice, RefusesBadMergesAndMergesTwoNics) {
  std::string other = OtherInterface();
  RUN_PROCS(kWatchdogMs, [other] {
    if (!other.empty()) setenv("SCAPE_NCCL_DEVICES", ("=lo," + other).c_str(), 1);
    Env e;
    REQUIRE(e.Up());
    const ncclNet_v11_t* n = e.net;
    int nd = 0;
    REQUIRE_OK(n->devices(&nd));
    int d = -1;
    ncclNetVDeviceProps_v11_t vp{};
    EXPECT_EQ(n->makeVDevice(nullptr, &vp), ncclInternalError);
    EXPECT_EQ(n->makeVDevice(&d, nullptr), ncclInternalError);
    vp.ndevs = 5;
    EXPECT_EQ(n->makeVDevice(&d, &vp), ncclInternalError);
    vp.ndevs = 1;
    vp.devs[0] = 0;
    EXPECT_EQ(n->makeVDevice(&d, &vp), ncclInternalError);  // one NIC: nothing to merge
    vp.ndevs = 2;
    vp.devs[0] = 0;
    vp.devs[1] = 0;
    EXPECT_EQ(n->makeVDevice(&d, &vp), ncclInternalError);  // twice the same
    vp.devs[1] = nd;
    EXPECT_EQ(n->makeVDevice(&d, &vp), ncclInternalError);  // no such device
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"makeVDevice"}));
    int nd2 = 0;
    REQUIRE_OK(n->devices(&nd2));
    EXPECT_EQ(nd2, nd);
    if (nd >= 2) {
      vp.devs[0] = 0;
      vp.devs[1] = 1;
      REQUIRE_OK(n->makeVDevice(&d, &vp));
      EXPECT_EQ(d, nd);
      REQUIRE_OK(n->devices(&nd2));
      EXPECT_EQ(nd2, nd + 1);
      ncclNetProperties_v11_t a, b, v;
      REQUIRE_OK(n->getProperties(0, &a));
      REQUIRE_OK(n->getProperties(1, &b));
      REQUIRE_OK(n->getProperties(d, &v));
      EXPECT_EQ(v.vProps.ndevs, 2);
      EXPECT_EQ(v.vProps.devs[0], 0);
      EXPECT_EQ(v.vProps.devs[1], 1);
      EXPECT_EQ(v.speed, a.speed + b.speed);
      EXPECT_EQ(std::string(v.name), std::string(a.name) + "+" + b.name);
      // A virtual device cannot be merged again.
      vp.devs[0] = d;
      EXPECT_EQ(n->makeVDevice(&d, &vp), ncclInternalError);
    }
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Logging, WarnAndInfoGoThroughNcclLoggerWithTheRightFlags) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    bool sawInfoNet = false;
    for (const LogLine& l : Logs())
      if (l.level == NCCL_LOG_INFO && (l.flags & NCCL_NET) && l.text.find("NET/SCAPE") == 0)
        sawInfoNet = true;
    EXPECT_TRUE(sawInfoNet);
    ClearLogs();
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    EXPECT_EQ(e.net->listen(e.ctx, 77, h, &lc), ncclInternalError);
    std::vector<LogLine> logs = Logs();
    REQUIRE_EQ(logs.size(), size_t(1));
    EXPECT_EQ(logs[0].level, NCCL_LOG_WARN);
    EXPECT_EQ(logs[0].flags, static_cast<unsigned long>(NCCL_ALL));
    EXPECT_NE(logs[0].text.find("listen"), std::string::npos);
    EXPECT_NE(logs[0].text.find("device 77"), std::string::npos);
    EXPECT_NE(logs[0].text.find("ncclInternalError"), std::string::npos);
    REQUIRE(e.Down());
    return true;
  });
}

TEST(Logging, StandaloneWarningsGoToStderr) {
  char path[] = "/tmp/scape_nccl_stderr_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  RUN_PROCS(kWatchdogMs, [fd] {
    dup2(fd, 2);
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    void* ctx = nullptr;
    ncclNetCommConfig_v11_t cfg{-1};
    REQUIRE_OK(p.v11->init(&ctx, 1, &cfg, nullptr, nullptr));  // no logger
    void* lc = nullptr;
    char h[NCCL_NET_HANDLE_MAXSIZE];
    EXPECT_EQ(p.v11->listen(ctx, -9, h, &lc), ncclInternalError);
    REQUIRE_OK(p.v11->finalize(ctx));
    return true;
  });
  close(fd);
  std::ifstream f(path);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  unlink(path);
  EXPECT_NE(all.find("NET/SCAPE : listen: device -9 does not exist"), std::string::npos) << all;
}

TEST(Reload, DlcloseAndReopenAsNcclDoes) {
  RUN_PROCS(kWatchdogMs, [] {
    for (int round = 0; round < 3; ++round) {
      Env e;
      REQUIRE(e.Up());
      SelfPair sp;
      REQUIRE(sp.Open(e.net, e.ctx));
      REQUIRE(sp.Close(e.net));
      REQUIRE(e.Down());
      REQUIRE_EQ(dlclose(e.p.lib), 0);
    }
    return true;
  });
}

TEST(Adapters, V8RefusesSizesBeyondOneGiB) {
  RUN_PROCS(kWatchdogMs, [] {
    Plugin p;
    std::string err;
    REQUIRE(LoadPlugin(&p, &err));
    SkipLeakCheck();  // v8 has no finalize: its context lives until exit
    REQUIRE_OK(p.v8->init(&Logger));
    REQUIRE_OK(p.v8->init(&Logger));  // again: fine
    int nd = 0;
    REQUIRE_OK(p.v8->devices(&nd));
    char h[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void *lc, *sc = nullptr, *rc = nullptr;
    REQUIRE_OK(p.v8->listen(0, h, &lc));
    for (int i = 0; i < 200000 && (!sc || !rc); ++i) {
      if (!sc) REQUIRE_OK(p.v8->connect(0, h, &sc, nullptr));
      if (!rc) REQUIRE_OK(p.v8->accept(lc, &rc, nullptr));
    }
    REQUIRE(sc && rc);
    REQUIRE_OK(p.v8->closeListen(lc));
    std::vector<char> buf(1024);
    void *smh, *rmh;
    REQUIRE_OK(p.v8->regMr(sc, buf.data(), buf.size(), NCCL_PTR_HOST, &smh));
    REQUIRE_OK(p.v8->regMr(rc, buf.data(), buf.size(), NCCL_PTR_HOST, &rmh));
    void* req = reinterpret_cast<void*>(0x1);
    EXPECT_EQ(p.v8->isend(sc, buf.data(), (1 << 30) + 1, 0, smh, &req), ncclInternalError);
    EXPECT_EQ(req, nullptr);
    EXPECT_EQ(p.v8->isend(sc, buf.data(), -1, 0, smh, &req), ncclInternalError);
    EXPECT_TRUE(Logged(NCCL_LOG_WARN, {"isend", "v8"}));
    void* d = buf.data();
    int sz = (1 << 30) + 1, tag = 0;
    EXPECT_EQ(p.v8->irecv(rc, 1, &d, &sz, &tag, &rmh, &req), ncclInternalError);
    // Within the limit it works.
    sz = 512;
    void* rreq = nullptr;
    for (int i = 0; i < 1000 && !rreq; ++i)
      REQUIRE_OK(p.v8->irecv(rc, 1, &d, &sz, &tag, &rmh, &rreq));
    void* sreq = nullptr;
    for (int i = 0; i < 1000 && !sreq; ++i)
      REQUIRE_OK(p.v8->isend(sc, buf.data(), 100, 0, smh, &sreq));
    REQUIRE(rreq && sreq);
    int done = 0, got = -1;
    for (int i = 0; i < 10000000 && !done; ++i) REQUIRE_OK(p.v8->test(rreq, &done, &got));
    EXPECT_EQ(done, 1);
    EXPECT_EQ(got, 100);
    done = 0;
    for (int i = 0; i < 10000000 && !done; ++i) REQUIRE_OK(p.v8->test(sreq, &done, nullptr));
    EXPECT_EQ(done, 1);
    REQUIRE_OK(p.v8->deregMr(sc, smh));
    REQUIRE_OK(p.v8->deregMr(rc, rmh));
    REQUIRE_OK(p.v8->closeSend(sc));
    REQUIRE_OK(p.v8->closeRecv(rc));
    return true;
  });
}

// Registration on a "service" thread while a "progress" thread moves data on the same comms,
// as NCCL's proxy threads do.
TEST(Threads, RegistrationWhileAnotherThreadProgresses) {
  RUN_PROCS(kWatchdogMs, [] {
    Env e;
    REQUIRE(e.Up());
    const ncclNet_v11_t* n = e.net;
    SelfPair sp;
    REQUIRE(sp.Open(n, e.ctx));
    std::atomic<bool> stop{false};
    std::atomic<int> regErrors{0};
    std::thread service([&] {
      std::vector<char> b(1 << 16);
      while (!stop.load()) {
        void* mh = nullptr;
        void* comm = (b[0]++ & 1) ? sp.sc : sp.rc;
        if (n->regMr(comm, b.data(), b.size(), NCCL_PTR_HOST, &mh) != ncclSuccess ||
            n->deregMr(comm, mh) != ncclSuccess)
          regErrors++;
      }
    });
    std::vector<char> sb(8192), rb(8192);
    void *smh, *rmh;
    bool ok = n->regMr(sp.sc, sb.data(), sb.size(), NCCL_PTR_HOST, &smh) == ncclSuccess &&
              n->regMr(sp.rc, rb.data(), rb.size(), NCCL_PTR_HOST, &rmh) == ncclSuccess;
    for (int i = 0; ok && i < 300; ++i) {
      Fill(sb.data(), sb.size(), static_cast<uint64_t>(i));
      void* d = rb.data();
      size_t cap = rb.size();
      int tag = 1;
      void *rreq, *sreq;
      int rs[64], ss;
      ok = PostRecv(n, sp.rc, 1, &d, &cap, &tag, &rmh, &rreq) == ncclSuccess &&
           PostSend(n, sp.sc, sb.data(), sb.size(), 1, smh, &sreq) == ncclSuccess &&
           WaitReq(n, sreq, &ss) == ncclSuccess && WaitReq(n, rreq, rs) == ncclSuccess &&
           FirstMismatch(rb.data(), rb.size(), static_cast<uint64_t>(i)) == rb.size();
    }
    stop.store(true);
    service.join();
    EXPECT_TRUE(ok);
    EXPECT_EQ(regErrors.load(), 0);
    REQUIRE_OK(n->deregMr(sp.sc, smh));
    REQUIRE_OK(n->deregMr(sp.rc, rmh));
    REQUIRE(sp.Close(n));
    REQUIRE(e.Down());
    return true;
  });
}

}  // namespace
