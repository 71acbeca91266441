// ncclNetPlugin_v11: the NCCL net plugin's entry points. Every entry point checks its
// arguments, runs the UCX engine (plugin/nccl/ucx_engine.h), maps the internal Status to
// an ncclResult_t with one WARN line that names the function and what was wrong, and catches
// every exception so none crosses into NCCL. v10/v9/v8 are adapters onto this
// (net_adapters.cc).
//
// Result codes: ncclInternalError when NCCL passed something wrong (NULL pointer, bad device,
// unknown comm/request/handle, oversize transfer, too many receives); ncclSystemError for
// failures of the system or UCX; ncclInvalidUsage for a bad configuration (SCAPE_* knobs);
// ncclRemoteError when the peer failed, closed, refused or did not answer in time.
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "plugin/nccl/net_abi.h"
#include "plugin/nccl/net_devices.h"
#include "plugin/nccl/net_log.h"
#include "plugin/nccl/net_params.h"
#include "plugin/nccl/ucx_engine.h"

namespace {

using scape::Status;
using scape::StrFormat;
using scape::nccl::NetDevice;
namespace ucxnet = scape::ucxnet;

constexpr uint64_t kPluginCtxMagic = 0x5343415045504c47ull;  // "SCAPEPLG"
constexpr size_t kMaxP2pBytes = static_cast<size_t>(1) << 30;
constexpr size_t kMaxCollBytes = static_cast<size_t>(1) << 30;

// Per-communicator context returned by init.
struct PluginCtx {
  PluginCtx() { ucxnet::RegisterLive(this); }
  ~PluginCtx() { ucxnet::UnregisterLive(this); }
  PluginCtx(const PluginCtx&) = delete;
  PluginCtx& operator=(const PluginCtx&) = delete;
  uint64_t magic = kPluginCtxMagic;
  uint64_t commId = 0;
  int trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF;
  ncclProfilerCallback_t prof = nullptr;
  ucxnet::NetContext* net = nullptr;
  std::mutex mu;
  ncclNetAttr_v11_t attr{};  // latest setNetAttr hint (accepted, not acted on)
};

// Process-wide state: the device table (found once, stable for the life of the library;
// virtual devices are appended) and the configuration. Never destroyed: NCCL threads may call
// in until the process exits.
struct Global {
  std::mutex mu;
  bool discovered = false;
  Status discoverStatus;
  scape::nccl::PluginParams params;
  std::deque<NetDevice> devs;  // deque: names and paths keep their addresses
  int nPhysical = 0;
  bool cuda = false;
  int liveContexts = 0;
};

Global& G() {
  static Global* g = new Global();
  return *g;
}

// What the plugin does with CUDA memory (net_devices.h: NCCL_PTR_CUDA only with GPUDirect,
// which it does not implement, whatever UCX can copy).
scape::nccl::CudaCaps CudaCapsOf(const Global& g) {
  scape::nccl::CudaCaps c;
  c.ucxMovesCuda = g.cuda;
  c.gpuDirect = scape::nccl::kPluginGpuDirect;
  return c;
}

ncclResult_t ToNccl(scapeResult_t c) {
  switch (c) {
    case scapeSuccess:
      return ncclSuccess;
    case scapeSystemError:
      return ncclSystemError;
    case scapeRemoteError:
    case scapeTimeout:
      return ncclRemoteError;
    case scapeInvalidUsage:
      return ncclInvalidUsage;
    default:
      return ncclInternalError;  // invalid argument, unsupported, internal
  }
}

const char* ResultName(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    default:
      return "ncclResult?";
  }
}

// The WARN line names the entry point's own site (file and line of its Guard call), not this
// helper's: NCCL prints the location with every WARN.
ncclResult_t Report(const char* fn, const Status& st, const char* file, int line) {
  if (st.ok()) return ncclSuccess;
  ncclResult_t r = ToNccl(st.code());
  ::scape::nccl::NetLog(NCCL_LOG_WARN, NCCL_ALL, file, line, "%s: %s (%s)", fn,
                        st.message().c_str(), ResultName(r));
  return r;
}

// Runs an entry point's body: no exception leaves it. `file` and `line` default to the
// caller's location (the entry point), for the WARN line.
template <typename F>
ncclResult_t Guard(const char* fn, F&& body, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  try {
    return Report(fn, body(), file, line);
  } catch (const std::bad_alloc&) {
    ::scape::nccl::NetLog(NCCL_LOG_WARN, NCCL_ALL, file, line,
                          "%s: out of memory (ncclSystemError)", fn);
    return ncclSystemError;
  } catch (const std::exception& e) {
    ::scape::nccl::NetLog(NCCL_LOG_WARN, NCCL_ALL, file, line,
                          "%s: unexpected exception: %s (ncclInternalError)", fn, e.what());
    return ncclInternalError;
  } catch (...) {
    ::scape::nccl::NetLog(NCCL_LOG_WARN, NCCL_ALL, file, line,
                          "%s: unexpected exception (ncclInternalError)", fn);
    return ncclInternalError;
  }
}

Status BadArg(std::string what) { return scape::InternalError(std::move(what)); }

PluginCtx* AsCtx(void* p) {
  auto* c = static_cast<PluginCtx*>(p);
  // Looked up before it is read: a second finalize must not read the freed context.
  return ucxnet::IsLive(p) && c->magic == kPluginCtxMagic ? c : nullptr;
}

Status CheckDev(int dev, NetDevice* out) {
  Global& g = G();
  std::lock_guard<std::mutex> lk(g.mu);
  if (!g.discovered || !g.discoverStatus.ok())
    return scape::InternalError("called before a successful init");
  if (dev < 0 || dev >= static_cast<int>(g.devs.size()))
    return scape::InternalError(
        StrFormat("device %d does not exist (the plugin has %zu)", dev, g.devs.size()));
  if (out) *out = g.devs[static_cast<size_t>(dev)];
  return Status::Ok();
}

Status Discover() {
  Global& g = G();
  std::lock_guard<std::mutex> lk(g.mu);
  if (g.discovered) return g.discoverStatus;
  g.discovered = true;
  g.discoverStatus = scape::nccl::ReadPluginParams(&g.params);
  std::vector<NetDevice> found;
  std::string how;
  if (g.discoverStatus.ok())
    g.discoverStatus = scape::nccl::DiscoverDevices(g.params, &found, &how);
  if (!g.discoverStatus.ok()) return g.discoverStatus;
  for (NetDevice& d : found) g.devs.push_back(std::move(d));
  g.nPhysical = static_cast<int>(g.devs.size());
  std::string list;
  for (size_t i = 0; i < g.devs.size(); ++i)
    list += StrFormat("%s[%zu]%s/%s", i ? " " : "", i, g.devs[i].name.c_str(),
                      g.devs[i].rdma ? "RDMA" : "IP");
  NET_INFO(NCCL_INIT | NCCL_NET, "UCX %s, TLS %s, %zu device(s) (%s): %s", ucxnet::UcxVersion(),
           g.params.tls.empty() ? "<UCX default>" : g.params.tls.c_str(), g.devs.size(),
           how.c_str(), list.c_str());
  return Status::Ok();
}

ucxnet::Options EngineOptions() {
  ucxnet::Options o;
  const scape::nccl::PluginParams& p = G().params;
  o.tls = p.tls;
  o.setNetDevices = !p.userNetDevices;
  o.timeoutMs = p.timeoutMs;
  return o;
}

// ---- entry points -----------------------------------------------------------------------------

ncclResult_t Init(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                  ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction) {
  scape::nccl::SetNcclLogger(logFunction);
  return Guard("init", [&]() -> Status {
    if (!ctx) return BadArg("ctx (output) is NULL");
    *ctx = nullptr;  // also what a failed init leaves: finalize(NULL) is a no-op
    SCAPE_RETURN_IF_ERROR(Discover());
    NetDevice dev0;
    SCAPE_RETURN_IF_ERROR(CheckDev(0, &dev0));
    auto pc = std::make_unique<PluginCtx>();
    pc->commId = commId;
    pc->trafficClass = config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
    pc->prof = profFunction;  // may be NULL: profiling off (no events are emitted)
    Status st = ucxnet::NewNetContext(EngineOptions(), 0, dev0.route, &pc->net);
    if (!st.ok())
      return st.Prepend(StrFormat("cannot start UCX on device 0 (%s)", dev0.name.c_str()));
    bool first;
    {
      Global& g = G();
      std::lock_guard<std::mutex> lk(g.mu);
      first = g.liveContexts == 0;
      if (first) g.cuda = ucxnet::CudaSupported(pc->net, 0);
      ++g.liveContexts;
    }
    NET_INFO(NCCL_INIT | NCCL_NET, "init: comm 0x%llx, trafficClass %d%s, CUDA memory %s",
             static_cast<unsigned long long>(commId), pc->trafficClass,
             pc->trafficClass != NCCL_NET_TRAFFIC_CLASS_UNDEF ? " (not applied by UCX 1.13)" : "",
             G().cuda ? "copied by this UCX, not advertised (no GPUDirect RDMA: host only)"
                      : "not supported by this UCX (host only)");
    *ctx = pc.release();
    return Status::Ok();
  });
}

ncclResult_t Devices(int* ndev) {
  return Guard("devices", [&]() -> Status {
    if (!ndev) return BadArg("ndev is NULL");
    Global& g = G();
    std::lock_guard<std::mutex> lk(g.mu);
    if (!g.discovered || !g.discoverStatus.ok()) return BadArg("called before a successful init");
    *ndev = static_cast<int>(g.devs.size());
    return Status::Ok();
  });
}

ncclResult_t GetProperties(int dev, ncclNetProperties_v11_t* props) {
  return Guard("getProperties", [&]() -> Status {
    if (!props) return BadArg("props is NULL");
    SCAPE_RETURN_IF_ERROR(CheckDev(dev, nullptr));
    Global& g = G();
    std::lock_guard<std::mutex> lk(g.mu);
    const NetDevice& d = g.devs[static_cast<size_t>(dev)];
    std::memset(props, 0, sizeof(*props));
    props->name = const_cast<char*>(d.name.c_str());
    props->pciPath = d.pciPath.empty() ? nullptr : const_cast<char*>(d.pciPath.c_str());
    props->guid = d.guid;
    props->ptrSupport = scape::nccl::PtrSupport(CudaCapsOf(g));
    props->regIsGlobal = 0;
    props->forceFlush = 0;
    props->speed = d.speedMbps;
    props->port = d.port;
    props->latency = d.latencyUs;
    props->maxComms = d.maxComms;
    props->maxRecvs = ucxnet::kMaxRecvs;
    props->netDeviceType = NCCL_NET_DEVICE_HOST;
    props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
    props->vProps.ndevs = static_cast<int>(d.children.size());
    for (size_t i = 0; i < d.children.size() && i < NCCL_NET_MAX_DEVS_PER_NIC; ++i)
      props->vProps.devs[i] = d.children[i];
    props->maxP2pBytes = kMaxP2pBytes;
    props->maxCollBytes = kMaxCollBytes;
    props->maxMultiRequestSize = 1;
    return Status::Ok();
  });
}

// What listen and connect share: the context, the handle and the device `dev` (*d) checked in
// this order, then op(context) on the device, whose error names the device.
template <typename Op>
Status OnEndpointDevice(void* ctx, const void* handle, int dev, NetDevice* d, Op op) {
  PluginCtx* pc = AsCtx(ctx);
  if (!pc) return BadArg(ctx ? "ctx is not a context returned by init" : "ctx is NULL");
  if (!handle) return BadArg("handle is NULL");
  SCAPE_RETURN_IF_ERROR(CheckDev(dev, d));
  Status st = op(pc);
  if (!st.ok()) return st.Prepend(StrFormat("device %d (%s)", dev, d->name.c_str()));
  return Status::Ok();
}

ncclResult_t Listen(void* ctx, int dev, void* handle, void** listenComm) {
  return Guard("listen", [&]() -> Status {
    if (!listenComm) return BadArg("listenComm (output) is NULL");
    *listenComm = nullptr;
    NetDevice d;
    ucxnet::ListenComm* lc = nullptr;
    SCAPE_RETURN_IF_ERROR(OnEndpointDevice(ctx, handle, dev, &d, [&](PluginCtx* pc) {
      return ucxnet::Listen(pc->net, dev, d.route, handle, &lc);
    }));
    *listenComm = lc;
    return Status::Ok();
  });
}

ncclResult_t Connect(void* ctx, int dev, void* handle, void** sendComm,
                     ncclNetDeviceHandle_v11_t** sendDevComm) {
  return Guard("connect", [&]() -> Status {
    if (!sendComm) return BadArg("sendComm (output) is NULL");
    *sendComm = nullptr;
    if (sendDevComm) *sendDevComm = nullptr;  // host plugin: no device offload
    NetDevice d;
    ucxnet::SendComm* sc = nullptr;
    SCAPE_RETURN_IF_ERROR(OnEndpointDevice(ctx, handle, dev, &d, [&](PluginCtx* pc) {
      return ucxnet::Connect(pc->net, dev, d.route, handle, &sc);
    }));
    if (sc)
      NET_INFO(NCCL_NET, "connected on device %d (%s) %s", dev, d.name.c_str(),
               ucxnet::CommInfo(sc).c_str());
    *sendComm = sc;
    return Status::Ok();
  });
}

ncclResult_t Accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_v11_t** recvDevComm) {
  return Guard("accept", [&]() -> Status {
    if (!recvComm) return BadArg("recvComm (output) is NULL");
    *recvComm = nullptr;
    if (recvDevComm) *recvDevComm = nullptr;
    ucxnet::ListenComm* lc = ucxnet::AsListenComm(listenComm);
    if (!lc)
      return BadArg(listenComm ? "listenComm is not a live listen comm" : "listenComm is NULL");
    ucxnet::RecvComm* rc = nullptr;
    std::string note;
    SCAPE_RETURN_IF_ERROR(ucxnet::Accept(lc, &rc, &note));
    if (!note.empty())
      NET_WARN("accept: dropped an incoming connection (still listening): %s", note.c_str());
    if (rc) NET_INFO(NCCL_NET, "accepted a connection %s", ucxnet::CommInfo(rc).c_str());
    *recvComm = rc;
    return Status::Ok();
  });
}

Status CheckDataComm(void* comm) {
  if (!comm) return BadArg("comm is NULL");
  if (!ucxnet::AsSendComm(comm) && !ucxnet::AsRecvComm(comm))
    return BadArg("comm is not a live send or receive comm");
  return Status::Ok();
}

Status RegCommon(void* comm, void* data, size_t size, int type, void** mhandle) {
  if (!mhandle) return BadArg("mhandle (output) is NULL");
  *mhandle = nullptr;
  SCAPE_RETURN_IF_ERROR(CheckDataComm(comm));
  if (!data && size > 0) return BadArg("data is NULL");
  ucxnet::MemType mt;
  if (type == NCCL_PTR_HOST) {
    mt = ucxnet::MemType::kHost;
  } else if (type == NCCL_PTR_CUDA) {
    if (!(scape::nccl::PtrSupport(CudaCapsOf(G())) & NCCL_PTR_CUDA))
      return BadArg(
          "type NCCL_PTR_CUDA, but this plugin does not advertise CUDA memory (no GPUDirect "
          "RDMA: it registers no memory with the NIC and does not flush; NCCL stages device "
          "buffers through host memory)");
    mt = ucxnet::MemType::kCuda;
  } else {
    return BadArg(StrFormat("type %d is not NCCL_PTR_HOST (1) or NCCL_PTR_CUDA (2)", type));
  }
  ucxnet::MemRegion* mr = nullptr;
  SCAPE_RETURN_IF_ERROR(ucxnet::RegMr(comm, data, size, mt, &mr));
  *mhandle = mr;
  return Status::Ok();
}

ncclResult_t RegMr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return Guard("regMr", [&]() { return RegCommon(comm, data, size, type, mhandle); });
}

// DMABUF is not advertised (UCX 1.13 cannot import dma-bufs): NCCL does not call this. A call
// for host memory, or CUDA memory when UCX can move it, registers by address; the fd is not kept.
ncclResult_t RegMrDmaBuf(void* comm, void* data, size_t size, int type, uint64_t /*offset*/,
                         int /*fd*/, void** mhandle) {
  return Guard("regMrDmaBuf", [&]() { return RegCommon(comm, data, size, type, mhandle); });
}

ncclResult_t DeregMr(void* comm, void* mhandle) {
  return Guard("deregMr", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckDataComm(comm));
    ucxnet::MemRegion* mr = ucxnet::AsMemRegion(mhandle);
    if (!mr) return BadArg(mhandle ? "mhandle is not a live memory handle" : "mhandle is NULL");
    return ucxnet::DeregMr(comm, mr);
  });
}

Status CheckBuffer(const char* what, const void* data, size_t size, void* mhandle,
                   ucxnet::MemRegion** mrOut) {
  if (size > kMaxP2pBytes)
    return BadArg(StrFormat("%s: size %zu exceeds maxP2pBytes (%zu)", what, size, kMaxP2pBytes));
  if (!data && size > 0) return BadArg(StrFormat("%s: data is NULL", what));
  ucxnet::MemRegion* mr = ucxnet::AsMemRegion(mhandle);
  if (!mr)
    return BadArg(
        StrFormat("%s: mhandle is %s", what, mhandle ? "not a live memory handle" : "NULL"));
  uintptr_t base;
  size_t len;
  ucxnet::MemType type;
  ucxnet::MemRegionBounds(mr, &base, &len, &type);
  uintptr_t p = reinterpret_cast<uintptr_t>(data);
  if (size > 0 && (p < base || p - base > len || size > len - (p - base)))
    return BadArg(StrFormat("%s: [%p, +%zu) is outside the registered region [%p, +%zu)", what,
                            data, size, reinterpret_cast<void*>(base), len));
  *mrOut = mr;
  return Status::Ok();
}

ncclResult_t Isend(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                   void* /*phandle*/, void** request) {
  return Guard("isend", [&]() -> Status {
    if (!request) return BadArg("request (output) is NULL");
    *request = nullptr;
    ucxnet::SendComm* sc = ucxnet::AsSendComm(sendComm);
    if (!sc) return BadArg(sendComm ? "sendComm is not a live send comm" : "sendComm is NULL");
    ucxnet::MemRegion* mr = nullptr;
    SCAPE_RETURN_IF_ERROR(CheckBuffer("send buffer", data, size, mhandle, &mr));
    ucxnet::Request* r = nullptr;
    SCAPE_RETURN_IF_ERROR(ucxnet::Isend(sc, data, size, tag, mr, &r));
    *request = r;
    return Status::Ok();
  });
}

ncclResult_t Irecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                   void** /*phandles*/, void** request) {
  return Guard("irecv", [&]() -> Status {
    if (!request) return BadArg("request (output) is NULL");
    *request = nullptr;  // also replaces NCCL's optional-completion hint (0x1)
    ucxnet::RecvComm* rc = ucxnet::AsRecvComm(recvComm);
    if (!rc) return BadArg(recvComm ? "recvComm is not a live receive comm" : "recvComm is NULL");
    if (n < 1 || n > ucxnet::kMaxRecvs)
      return BadArg(StrFormat("n = %d: expected 1..%d (maxRecvs)", n, ucxnet::kMaxRecvs));
    if (!data || !sizes || !tags || !mhandles)
      return BadArg("data, sizes, tags or mhandles is NULL");
    ucxnet::MemRegion* mrs[ucxnet::kMaxRecvs];
    for (int i = 0; i < n; ++i) {
      std::string what = StrFormat("receive buffer %d", i);
      SCAPE_RETURN_IF_ERROR(CheckBuffer(what.c_str(), data[i], sizes[i], mhandles[i], &mrs[i]));
    }
    ucxnet::Request* r = nullptr;
    SCAPE_RETURN_IF_ERROR(ucxnet::Irecv(rc, n, data, sizes, tags, mrs, &r));
    *request = r;
    return Status::Ok();
  });
}

// Receives complete only once UCX has placed the data, and the plugin only advertises host
// memory unless UCX moves CUDA memory itself: there is nothing to flush (NULL request = done).
ncclResult_t Iflush(void* recvComm, int n, void** /*data*/, int* /*sizes*/, void** /*mhandles*/,
                    void** request) {
  return Guard("iflush", [&]() -> Status {
    if (!request) return BadArg("request (output) is NULL");
    *request = nullptr;
    if (!ucxnet::AsRecvComm(recvComm))
      return BadArg(recvComm ? "recvComm is not a live receive comm" : "recvComm is NULL");
    if (n < 1 || n > ucxnet::kMaxRecvs)
      return BadArg(StrFormat("n = %d: expected 1..%d", n, ucxnet::kMaxRecvs));
    return Status::Ok();
  });
}

ncclResult_t Test(void* request, int* done, int* sizes) {
  return Guard("test", [&]() -> Status {
    if (!done) return BadArg("done (output) is NULL");
    *done = 0;
    ucxnet::Request* r = ucxnet::AsRequest(request);
    if (!r)
      return BadArg(request ? "request is not in flight (unknown, or already reported done)"
                            : "request is NULL");
    bool fin = false;
    size_t got[ucxnet::kMaxRecvs];
    int n = 0;
    Status st = ucxnet::Test(r, &fin, got, &n);
    if (fin) {
      if (sizes)
        for (int i = 0; i < n; ++i) sizes[i] = static_cast<int>(got[i]);  // <= maxP2pBytes
      *done = 1;
    }
    return st;
  });
}

// closeSend / closeRecv: the comm checked (as() is null unless it is a live one), the requests
// still in flight logged, then closed. `file` and `line` are the entry point's, as in Guard.
template <typename C>
ncclResult_t CloseDataComm(const char* fn, void* comm, C* (*as)(void*), const char* notLive,
                           const char* isNull, Status (*close)(C*),
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return Guard(
      fn,
      [&]() -> Status {
        C* c = as(comm);
        if (!c) return BadArg(comm ? notLive : isNull);
        int pending = ucxnet::RequestsInFlight(c);
        if (pending > 0) NET_INFO(NCCL_NET, "%s: cancelling %d request(s) in flight", fn, pending);
        return close(c);
      },
      file, line);
}

ncclResult_t CloseSend(void* sendComm) {
  return CloseDataComm("closeSend", sendComm, ucxnet::AsSendComm,
                       "sendComm is not a live send comm", "sendComm is NULL", ucxnet::CloseSend);
}

ncclResult_t CloseRecv(void* recvComm) {
  return CloseDataComm("closeRecv", recvComm, ucxnet::AsRecvComm,
                       "recvComm is not a live receive comm", "recvComm is NULL",
                       ucxnet::CloseRecv);
}

ncclResult_t CloseListen(void* listenComm) {
  return Guard("closeListen", [&]() -> Status {
    ucxnet::ListenComm* lc = ucxnet::AsListenComm(listenComm);
    if (!lc)
      return BadArg(listenComm ? "listenComm is not a live listen comm" : "listenComm is NULL");
    ucxnet::CloseListen(lc);
    return Status::Ok();
  });
}

ncclResult_t MakeVDevice(int* d, ncclNetVDeviceProps_v11_t* props) {
  return Guard("makeVDevice", [&]() -> Status {
    if (!d || !props) return BadArg("d or props is NULL");
    if (props->ndevs < 2 || props->ndevs > NCCL_NET_MAX_DEVS_PER_NIC)
      return BadArg(StrFormat("props->ndevs = %d: expected 2..%d NICs to merge", props->ndevs,
                              NCCL_NET_MAX_DEVS_PER_NIC));
    Global& g = G();
    std::lock_guard<std::mutex> lk(g.mu);
    if (!g.discovered || !g.discoverStatus.ok()) return BadArg("called before a successful init");
    std::vector<int> children(props->devs, props->devs + props->ndevs);
    std::vector<NetDevice> phys(g.devs.begin(), g.devs.begin() + g.nPhysical);
    NetDevice v;
    SCAPE_RETURN_IF_ERROR(scape::nccl::MergeDevices(phys, g.nPhysical, children, &v));
    g.devs.push_back(v);
    *d = static_cast<int>(g.devs.size()) - 1;
    NET_INFO(NCCL_INIT | NCCL_NET, "virtual device %d = %s (%d Mbps, UCX_NET_DEVICES=%s)", *d,
             v.name.c_str(), v.speedMbps, v.route.ucxNetDevices.c_str());
    return Status::Ok();
  });
}

ncclResult_t Finalize(void* ctx) {
  return Guard("finalize", [&]() -> Status {
    if (!ctx) return Status::Ok();  // e.g. after a failed init
    PluginCtx* pc = AsCtx(ctx);
    if (!pc) return BadArg("ctx is not a live context returned by init");
    pc->magic = 0;
    ucxnet::DeleteNetContext(pc->net);
    delete pc;
    Global& g = G();
    std::lock_guard<std::mutex> lk(g.mu);
    --g.liveContexts;
    return Status::Ok();
  });
}

ncclResult_t SetNetAttr(void* ctx, ncclNetAttr_v11_t* netAttr) {
  return Guard("setNetAttr", [&]() -> Status {
    PluginCtx* pc = AsCtx(ctx);
    if (!pc) return BadArg(ctx ? "ctx is not a live context returned by init" : "ctx is NULL");
    if (!netAttr) return BadArg("netAttr is NULL");
    std::lock_guard<std::mutex> lk(pc->mu);
    pc->attr = *netAttr;  // a traffic-shape hint; UCX picks its own lanes, nothing to apply
    return Status::Ok();
  });
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) ncclNet_v11_t ncclNetPlugin_v11 = {
    "SCAPE",     Init,     Devices,     GetProperties, Listen,      Connect,
    Accept,      RegMr,    RegMrDmaBuf, DeregMr,       Isend,       Irecv,
    Iflush,      Test,     CloseSend,   CloseRecv,     CloseListen,
    nullptr,  // getDeviceMr: host plugin
    nullptr,  // irecvConsumed: host plugin
    MakeVDevice, Finalize, SetNetAttr,
};

}  // extern "C"
