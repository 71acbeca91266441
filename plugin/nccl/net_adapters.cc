// ncclNetPlugin_v10, _v9 and _v8: thin adapters onto ncclNetPlugin_v11 (net_v11.cc), for NCCL
// releases older than 2.28.3 (NCCL 2.28 itself uses v11 when it is there).
//
// What the older ABIs lack is filled in here:
// - no per-communicator context: init creates one shared context on its first success (later
//   calls return success at once); it lives until the library is unloaded (these ABIs have no
//   finalize; the library is linked -z nodelete);
// - v10's per-connect config (traffic class) is accepted and not applied, as in v11's init;
// - v9 and v8 have no profiler handles;
// - v8 sizes are int: negative sizes and sizes above 1 GiB (NCCL's limit for v8 plugins) are
//   refused with ncclInternalError;
// - properties are copied field by field into the older layouts.
#include <cstring>
#include <mutex>
#include <type_traits>

#include "plugin/nccl/net_abi.h"
#include "plugin/nccl/net_log.h"

extern "C" ncclNet_v11_t ncclNetPlugin_v11;

namespace {

const ncclNet_v11_t& V11() { return ncclNetPlugin_v11; }

std::mutex g_mu;
void* g_ctx = nullptr;  // the shared context of the pre-v11 ABIs

ncclResult_t LegacyInit(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  try {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_ctx) return ncclSuccess;
    ncclNetCommConfig_v11_t cfg{NCCL_NET_TRAFFIC_CLASS_UNDEF};
    return V11().init(&g_ctx, 0, &cfg, log, prof);
  } catch (...) {  // std::mutex::lock may throw
    NET_WARN("init: unexpected exception (ncclInternalError)");
    return ncclInternalError;
  }
}

void* LegacyCtx() {
  try {
    std::lock_guard<std::mutex> lk(g_mu);
    return g_ctx;
  } catch (...) {
    return nullptr;
  }
}

ncclResult_t NotInitialised(const char* fn) {
  NET_WARN("%s: called before a successful init (ncclInternalError)", fn);
  return ncclInternalError;
}

ncclResult_t Listen(int dev, void* handle, void** listenComm) {
  void* ctx = LegacyCtx();
  if (!ctx) return NotInitialised("listen");
  return V11().listen(ctx, dev, handle, listenComm);
}

ncclResult_t ConnectV9(int dev, void* handle, void** sendComm,
                       ncclNetDeviceHandle_v9_t** sendDevComm) {
  void* ctx = LegacyCtx();
  if (!ctx) return NotInitialised("connect");
  return V11().connect(ctx, dev, handle, sendComm, sendDevComm);
}

template <typename P>
void CopyCommonProps(const ncclNetProperties_v11_t& s, P* d) {
  d->name = s.name;
  d->pciPath = s.pciPath;
  d->guid = s.guid;
  d->ptrSupport = s.ptrSupport;
  d->regIsGlobal = s.regIsGlobal;
  d->speed = s.speed;
  d->port = s.port;
  d->latency = s.latency;
  d->maxComms = s.maxComms;
  d->maxRecvs = s.maxRecvs;
  d->netDeviceType = s.netDeviceType;
  d->netDeviceVersion = s.netDeviceVersion;
}

// ---- v10 ----------------------------------------------------------------------------------------

ncclResult_t InitV10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  return LegacyInit(log, prof);
}

// getProperties of v10 and v9 (the same layout) and of v8: the v11 properties copied into the
// older layout field by field.
template <typename P>
ncclResult_t GetLegacyProperties(int dev, P* props) {
  if (!props) {
    NET_WARN("getProperties: props is NULL (ncclInternalError)");
    return ncclInternalError;
  }
  ncclNetProperties_v11_t p;
  ncclResult_t r = V11().getProperties(dev, &p);
  if (r != ncclSuccess) return r;
  std::memset(props, 0, sizeof(*props));
  CopyCommonProps(p, props);
  if constexpr (std::is_same<P, ncclNetProperties_v10_t>::value) {
    props->forceFlush = p.forceFlush;
    props->vProps = p.vProps;
    props->maxP2pBytes = p.maxP2pBytes;
    props->maxCollBytes = p.maxCollBytes;
  }
  return ncclSuccess;
}

ncclResult_t ConnectV10(int dev, ncclNetCommConfig_v10_t* /*config*/, void* handle, void** sendComm,
                        ncclNetDeviceHandle_v10_t** sendDevComm) {
  return ConnectV9(dev, handle, sendComm, sendDevComm);
}

// ---- v9 -----------------------------------------------------------------------------------------

ncclResult_t InitV9(ncclDebugLogger_t log) { return LegacyInit(log, nullptr); }

ncclResult_t IsendV9(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                     void** request) {
  return V11().isend(sendComm, data, size, tag, mhandle, nullptr, request);
}

ncclResult_t IrecvV9(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                     void** request) {
  return V11().irecv(recvComm, n, data, sizes, tags, mhandles, nullptr, request);
}

// ---- v8 -----------------------------------------------------------------------------------------

bool V8SizeOk(const char* fn, long long size) {
  if (size >= 0 && static_cast<unsigned long long>(size) <= NCCL_V8_MAX_NET_SIZE) return true;
  NET_WARN("%s: size %lld outside 0..%zu, the v8 ABI's limit (ncclInternalError)", fn, size,
           NCCL_V8_MAX_NET_SIZE);
  return false;
}

ncclResult_t IsendV8(void* sendComm, void* data, int size, int tag, void* mhandle, void** request) {
  if (request) *request = nullptr;
  if (!V8SizeOk("isend", size)) return ncclInternalError;
  return V11().isend(sendComm, data, static_cast<size_t>(size), tag, mhandle, nullptr, request);
}

ncclResult_t IrecvV8(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                     void** request) {
  if (request) *request = nullptr;
  if (!sizes || n < 1 || n > 8) {  // the v11 irecv reports the exact problem
    return V11().irecv(recvComm, n, data, nullptr, tags, mhandles, nullptr, request);
  }
  size_t wide[8];
  for (int i = 0; i < n; ++i) {
    if (!V8SizeOk("irecv", sizes[i])) return ncclInternalError;
    wide[i] = static_cast<size_t>(sizes[i]);
  }
  return V11().irecv(recvComm, n, data, wide, tags, mhandles, nullptr, request);
}

// ---- the members every version forwards unchanged (the handle and vProps types of v8..v10 are
// v11's) ---------------------------------------------------------------------------------------

ncclResult_t Devices(int* ndev) { return V11().devices(ndev); }
ncclResult_t Accept(void* l, void** r, ncclNetDeviceHandle_v11_t** d) {
  return V11().accept(l, r, d);
}
ncclResult_t RegMr(void* c, void* p, size_t s, int t, void** m) {
  return V11().regMr(c, p, s, t, m);
}
ncclResult_t RegMrDmaBuf(void* c, void* p, size_t s, int t, uint64_t o, int fd, void** m) {
  return V11().regMrDmaBuf(c, p, s, t, o, fd, m);
}
ncclResult_t DeregMr(void* c, void* m) { return V11().deregMr(c, m); }
ncclResult_t IsendV10(void* c, void* p, size_t s, int t, void* m, void* ph, void** r) {
  return V11().isend(c, p, s, t, m, ph, r);
}
ncclResult_t IrecvV10(void* c, int n, void** p, size_t* s, int* t, void** m, void** ph, void** r) {
  return V11().irecv(c, n, p, s, t, m, ph, r);
}
ncclResult_t Iflush(void* c, int n, void** p, int* s, void** m, void** r) {
  return V11().iflush(c, n, p, s, m, r);
}
ncclResult_t Test(void* r, int* d, int* s) { return V11().test(r, d, s); }
ncclResult_t CloseSend(void* c) { return V11().closeSend(c); }
ncclResult_t CloseRecv(void* c) { return V11().closeRecv(c); }
ncclResult_t CloseListen(void* c) { return V11().closeListen(c); }
ncclResult_t MakeVDevice(int* d, ncclNetVDeviceProps_v11_t* p) { return V11().makeVDevice(d, p); }

// One pre-v11 table: the version's own init, getProperties, connect, isend and irecv, the rest
// forwarded as above; getDeviceMr and irecvConsumed are not offered (null), makeVDevice from v9
// on. constexpr, so that each exported table is constant-initialised.
template <typename Net, typename Init, typename Props, typename Connect, typename Isend,
          typename Irecv>
constexpr Net LegacyNet(Init init, Props getProperties, Connect connect, Isend isend, Irecv irecv) {
  Net n{};
  n.name = "SCAPE";
  n.init = init;
  n.devices = Devices;
  n.getProperties = getProperties;
  n.listen = Listen;
  n.connect = connect;
  n.accept = Accept;
  n.regMr = RegMr;
  n.regMrDmaBuf = RegMrDmaBuf;
  n.deregMr = DeregMr;
  n.isend = isend;
  n.irecv = irecv;
  n.iflush = Iflush;
  n.test = Test;
  n.closeSend = CloseSend;
  n.closeRecv = CloseRecv;
  n.closeListen = CloseListen;
  if constexpr (!std::is_same<Net, ncclNet_v8_t>::value) n.makeVDevice = MakeVDevice;
  return n;
}

constexpr ncclNet_v10_t kV10 = LegacyNet<ncclNet_v10_t>(
    InitV10, GetLegacyProperties<ncclNetProperties_v10_t>, ConnectV10, IsendV10, IrecvV10);
// v9 properties have v10's layout; v8's init has v9's signature, init(logger).
constexpr ncclNet_v9_t kV9 = LegacyNet<ncclNet_v9_t>(
    InitV9, GetLegacyProperties<ncclNetProperties_v9_t>, ConnectV9, IsendV9, IrecvV9);
constexpr ncclNet_v8_t kV8 = LegacyNet<ncclNet_v8_t>(
    InitV9, GetLegacyProperties<ncclNetProperties_v8_t>, ConnectV9, IsendV8, IrecvV8);

}  // namespace

extern "C" {

__attribute__((visibility("default"))) ncclNet_v10_t ncclNetPlugin_v10 = kV10;
__attribute__((visibility("default"))) ncclNet_v9_t ncclNetPlugin_v9 = kV9;
__attribute__((visibility("default"))) ncclNet_v8_t ncclNetPlugin_v8 = kV8;

}  // extern "C"
