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

ncclResult_t GetPropertiesV10(int dev, ncclNetProperties_v10_t* props) {
  if (!props) {
    NET_WARN("getProperties: props is NULL (ncclInternalError)");
    return ncclInternalError;
  }
  ncclNetProperties_v11_t p;
  ncclResult_t r = V11().getProperties(dev, &p);
  if (r != ncclSuccess) return r;
  std::memset(props, 0, sizeof(*props));
  CopyCommonProps(p, props);
  props->forceFlush = p.forceFlush;
  props->vProps = p.vProps;
  props->maxP2pBytes = p.maxP2pBytes;
  props->maxCollBytes = p.maxCollBytes;
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

ncclResult_t GetPropertiesV8(int dev, ncclNetProperties_v8_t* props) {
  if (!props) {
    NET_WARN("getProperties: props is NULL (ncclInternalError)");
    return ncclInternalError;
  }
  ncclNetProperties_v11_t p;
  ncclResult_t r = V11().getProperties(dev, &p);
  if (r != ncclSuccess) return r;
  std::memset(props, 0, sizeof(*props));
  CopyCommonProps(p, props);
  return ncclSuccess;
}

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

}  // namespace

extern "C" {

__attribute__((visibility("default"))) ncclNet_v10_t ncclNetPlugin_v10 = {
    "SCAPE",
    InitV10,
    [](int* ndev) { return V11().devices(ndev); },
    GetPropertiesV10,
    Listen,
    ConnectV10,
    [](void* l, void** r, ncclNetDeviceHandle_v10_t** d) { return V11().accept(l, r, d); },
    [](void* c, void* p, size_t s, int t, void** m) { return V11().regMr(c, p, s, t, m); },
    [](void* c, void* p, size_t s, int t, uint64_t o, int fd, void** m) {
      return V11().regMrDmaBuf(c, p, s, t, o, fd, m);
    },
    [](void* c, void* m) { return V11().deregMr(c, m); },
    [](void* c, void* p, size_t s, int t, void* m, void* ph, void** r) {
      return V11().isend(c, p, s, t, m, ph, r);
    },
    [](void* c, int n, void** p, size_t* s, int* t, void** m, void** ph, void** r) {
      return V11().irecv(c, n, p, s, t, m, ph, r);
    },
    [](void* c, int n, void** p, int* s, void** m, void** r) {
      return V11().iflush(c, n, p, s, m, r);
    },
    [](void* r, int* d, int* s) { return V11().test(r, d, s); },
    [](void* c) { return V11().closeSend(c); },
    [](void* c) { return V11().closeRecv(c); },
    [](void* c) { return V11().closeListen(c); },
    nullptr,
    nullptr,
    [](int* d, ncclNetVDeviceProps_v10_t* p) { return V11().makeVDevice(d, p); },
};

__attribute__((visibility("default"))) ncclNet_v9_t ncclNetPlugin_v9 = {
    "SCAPE",
    InitV9,
    [](int* ndev) { return V11().devices(ndev); },
    GetPropertiesV10,  // v9 and v10 properties have the same layout
    Listen,
    ConnectV9,
    [](void* l, void** r, ncclNetDeviceHandle_v9_t** d) { return V11().accept(l, r, d); },
    [](void* c, void* p, size_t s, int t, void** m) { return V11().regMr(c, p, s, t, m); },
    [](void* c, void* p, size_t s, int t, uint64_t o, int fd, void** m) {
      return V11().regMrDmaBuf(c, p, s, t, o, fd, m);
    },
    [](void* c, void* m) { return V11().deregMr(c, m); },
    IsendV9,
    IrecvV9,
    [](void* c, int n, void** p, int* s, void** m, void** r) {
      return V11().iflush(c, n, p, s, m, r);
    },
    [](void* r, int* d, int* s) { return V11().test(r, d, s); },
    [](void* c) { return V11().closeSend(c); },
    [](void* c) { return V11().closeRecv(c); },
    [](void* c) { return V11().closeListen(c); },
    nullptr,
    nullptr,
    [](int* d, ncclNetVDeviceProps_v9_t* p) { return V11().makeVDevice(d, p); },
};

__attribute__((visibility("default"))) ncclNet_v8_t ncclNetPlugin_v8 = {
    "SCAPE",
    InitV9,  // same signature: init(logger)
    [](int* ndev) { return V11().devices(ndev); },
    GetPropertiesV8,
    Listen,
    ConnectV9,
    [](void* l, void** r, ncclNetDeviceHandle_v8_t** d) { return V11().accept(l, r, d); },
    [](void* c, void* p, size_t s, int t, void** m) { return V11().regMr(c, p, s, t, m); },
    [](void* c, void* p, size_t s, int t, uint64_t o, int fd, void** m) {
      return V11().regMrDmaBuf(c, p, s, t, o, fd, m);
    },
    [](void* c, void* m) { return V11().deregMr(c, m); },
    IsendV8,
    IrecvV8,
    [](void* c, int n, void** p, int* s, void** m, void** r) {
      return V11().iflush(c, n, p, s, m, r);
    },
    [](void* r, int* d, int* s) { return V11().test(r, d, s); },
    [](void* c) { return V11().closeSend(c); },
    [](void* c) { return V11().closeRecv(c); },
    [](void* c) { return V11().closeListen(c); },
    nullptr,
    nullptr,
};

}  // extern "C"
