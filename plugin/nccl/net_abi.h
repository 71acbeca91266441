// The NCCL network-plugin ABI, versions 8 to 11, as NCCL 2.28 expects it. Written from a fact
// sheet of NCCL 2.28.9's plugin ABI (its user-facing facts are in docs/NCCL_PLUGIN.md), not
// copied from NCCL's headers. Every struct is checked below with static_assert on sizeof and
// offsetof against the layouts measured for that fact sheet (x86_64 / LP64, gcc 12).
//
// Plain C layout only: this header is included by the plugin (plugin/nccl/) and by the fake
// NCCL in tests/nccl/, never together with NCCL's own headers.
#ifndef SCAPE_PLUGIN_NCCL_NET_ABI_H_
#define SCAPE_PLUGIN_NCCL_NET_ABI_H_

#include <stddef.h>
#include <stdint.h>

extern "C" {

// ---- 3.2 result codes (4-byte enum) -----------------------------------------------------------
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,    // system, library, network or hardware failure
  ncclInternalError = 3,  // NCCL misused the plugin (bad argument, too many requests)
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,  // user or configuration error
  ncclRemoteError = 6,   // the remote peer failed
} ncclResult_t;

// ---- 3.3 logging -------------------------------------------------------------------------------
typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

enum : unsigned long {
  NCCL_INIT = 0x1,
  NCCL_NET = 0x10,
  NCCL_ENV = 0x80,
  NCCL_ALL = ~0ul,
};

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);

// ---- 3.4 profiler callback (v10, v11) ----------------------------------------------------------
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle,
                                               int64_t pluginId, void* extData);

// ---- 3.1 constants -----------------------------------------------------------------------------
enum : int {
  NCCL_NET_HANDLE_MAXSIZE = 128,
  NCCL_NET_MAX_REQUESTS = 32,
  NCCL_PTR_HOST = 0x1,
  NCCL_PTR_CUDA = 0x2,
  NCCL_PTR_DMABUF = 0x4,
  NCCL_NET_MAX_DEVS_PER_NIC = 4,
  NCCL_NET_TRAFFIC_CLASS_UNDEF = -1,
  NCCL_NET_DEVICE_INVALID_VERSION = 0,
};
#define NCCL_NET_OPTIONAL_RECV_COMPLETION_HINT ((void*)0x1)
static const size_t NCCL_MAX_NET_SIZE_BYTES = static_cast<size_t>(1) << 40;
static const size_t NCCL_V8_MAX_NET_SIZE = static_cast<size_t>(1) << 30;

// ---- 3.5 device types and handle ---------------------------------------------------------------
typedef enum { NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1 } ncclNetDeviceType;

typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v11_t;
typedef ncclNetDeviceHandle_v11_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v11_t ncclNetDeviceHandle_v9_t;
typedef ncclNetDeviceHandle_v11_t ncclNetDeviceHandle_v8_t;

// ---- section 4: v11 structs --------------------------------------------------------------------
typedef struct {
  int ndevs;
  int devs[NCCL_NET_MAX_DEVS_PER_NIC];
} ncclNetVDeviceProps_v11_t;
typedef ncclNetVDeviceProps_v11_t ncclNetVDeviceProps_v10_t;
typedef ncclNetVDeviceProps_v11_t ncclNetVDeviceProps_v9_t;

typedef struct {
  int trafficClass;
} ncclNetCommConfig_v11_t;
typedef ncclNetCommConfig_v11_t ncclNetCommConfig_v10_t;

typedef struct {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
} ncclNetCommAttr_v11_t;

typedef struct {
  ncclNetCommAttr_v11_t sendCommAttr;
  ncclNetCommAttr_v11_t recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
} ncclNetAttr_v11_t;

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v11_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v10_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
} ncclNetProperties_v10_t;
typedef ncclNetProperties_v10_t ncclNetProperties_v9_t;  // identical layout (type rename only)

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
} ncclNetProperties_v8_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                       ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v11_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v11_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm,
                         ncclNetDeviceHandle_v11_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v11_t* props);
  ncclResult_t (*finalize)(void* ctx);
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_v11_t* netAttr);
} ncclNet_v11_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v10_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm,
                         ncclNetDeviceHandle_v10_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v10_t* props);
} ncclNet_v10_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v9_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v9_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_v9_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v9_t* props);
} ncclNet_v9_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v8_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v8_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_v8_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, int size, int tag, void* mhandle,
                        void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                        void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
} ncclNet_v8_t;

}  // extern "C"

// ---- layout checks (fact sheet section 4, measured on x86_64 with gcc 12) ----------------------
static_assert(sizeof(ncclResult_t) == 4 && sizeof(ncclNetDeviceType) == 4 &&
                  sizeof(ncclDebugLogLevel) == 4,
              "enums are 4 bytes");

static_assert(sizeof(ncclNetVDeviceProps_v11_t) == 20 && alignof(ncclNetVDeviceProps_v11_t) == 4,
              "");
static_assert(offsetof(ncclNetVDeviceProps_v11_t, devs) == 4, "");
static_assert(sizeof(ncclNetCommConfig_v11_t) == 4, "");
static_assert(sizeof(ncclNetCommAttr_v11_t) == 16, "");
static_assert(offsetof(ncclNetCommAttr_v11_t, minFlowsPerPeer) == 12, "");
static_assert(sizeof(ncclNetAttr_v11_t) == 44 && alignof(ncclNetAttr_v11_t) == 4, "");
static_assert(offsetof(ncclNetAttr_v11_t, recvCommAttr) == 16 &&
                  offsetof(ncclNetAttr_v11_t, op) == 32 &&
                  offsetof(ncclNetAttr_v11_t, algo) == 36 &&
                  offsetof(ncclNetAttr_v11_t, proto) == 40,
              "");
static_assert(sizeof(ncclNetDeviceHandle_v11_t) == 32 && alignof(ncclNetDeviceHandle_v11_t) == 8,
              "");
static_assert(offsetof(ncclNetDeviceHandle_v11_t, netDeviceVersion) == 4 &&
                  offsetof(ncclNetDeviceHandle_v11_t, handle) == 8 &&
                  offsetof(ncclNetDeviceHandle_v11_t, size) == 16 &&
                  offsetof(ncclNetDeviceHandle_v11_t, needsProxyProgress) == 24,
              "");

static_assert(sizeof(ncclNetProperties_v8_t) == 64, "v8 properties are 64 bytes");
static_assert(offsetof(ncclNetProperties_v8_t, pciPath) == 8 &&
                  offsetof(ncclNetProperties_v8_t, guid) == 16 &&
                  offsetof(ncclNetProperties_v8_t, ptrSupport) == 24 &&
                  offsetof(ncclNetProperties_v8_t, regIsGlobal) == 28 &&
                  offsetof(ncclNetProperties_v8_t, speed) == 32 &&
                  offsetof(ncclNetProperties_v8_t, port) == 36 &&
                  offsetof(ncclNetProperties_v8_t, latency) == 40 &&
                  offsetof(ncclNetProperties_v8_t, maxComms) == 44 &&
                  offsetof(ncclNetProperties_v8_t, maxRecvs) == 48 &&
                  offsetof(ncclNetProperties_v8_t, netDeviceType) == 52 &&
                  offsetof(ncclNetProperties_v8_t, netDeviceVersion) == 56,
              "v8 properties layout");

static_assert(sizeof(ncclNetProperties_v10_t) == 104, "v9/v10 properties are 104 bytes");
static_assert(offsetof(ncclNetProperties_v10_t, ptrSupport) == 24 &&
                  offsetof(ncclNetProperties_v10_t, regIsGlobal) == 28 &&
                  offsetof(ncclNetProperties_v10_t, forceFlush) == 32 &&
                  offsetof(ncclNetProperties_v10_t, speed) == 36 &&
                  offsetof(ncclNetProperties_v10_t, port) == 40 &&
                  offsetof(ncclNetProperties_v10_t, latency) == 44 &&
                  offsetof(ncclNetProperties_v10_t, maxComms) == 48 &&
                  offsetof(ncclNetProperties_v10_t, maxRecvs) == 52 &&
                  offsetof(ncclNetProperties_v10_t, netDeviceType) == 56 &&
                  offsetof(ncclNetProperties_v10_t, netDeviceVersion) == 60 &&
                  offsetof(ncclNetProperties_v10_t, vProps) == 64 &&
                  offsetof(ncclNetProperties_v10_t, maxP2pBytes) == 88 &&
                  offsetof(ncclNetProperties_v10_t, maxCollBytes) == 96,
              "v9/v10 properties layout");

static_assert(sizeof(ncclNetProperties_v11_t) == 112, "v11 properties are 112 bytes");
static_assert(offsetof(ncclNetProperties_v11_t, ptrSupport) == 24 &&
                  offsetof(ncclNetProperties_v11_t, forceFlush) == 32 &&
                  offsetof(ncclNetProperties_v11_t, speed) == 36 &&
                  offsetof(ncclNetProperties_v11_t, latency) == 44 &&
                  offsetof(ncclNetProperties_v11_t, maxRecvs) == 52 &&
                  offsetof(ncclNetProperties_v11_t, netDeviceType) == 56 &&
                  offsetof(ncclNetProperties_v11_t, vProps) == 64 &&
                  offsetof(ncclNetProperties_v11_t, maxP2pBytes) == 88 &&
                  offsetof(ncclNetProperties_v11_t, maxCollBytes) == 96 &&
                  offsetof(ncclNetProperties_v11_t, maxMultiRequestSize) == 104,
              "v11 properties layout");

static_assert(sizeof(ncclNet_v8_t) == 152, "ncclNet_v8_t is 19 members");
static_assert(sizeof(ncclNet_v9_t) == 160, "ncclNet_v9_t is 20 members");
static_assert(sizeof(ncclNet_v10_t) == 160, "ncclNet_v10_t is 20 members");
static_assert(sizeof(ncclNet_v11_t) == 176, "ncclNet_v11_t is 22 members");
#define SCAPE_NET_CHECK_OFFSETS(T)                                                        \
  static_assert(offsetof(T, init) == 8 && offsetof(T, devices) == 16 &&                   \
                    offsetof(T, getProperties) == 24 && offsetof(T, listen) == 32 &&      \
                    offsetof(T, connect) == 40 && offsetof(T, accept) == 48 &&            \
                    offsetof(T, regMr) == 56 && offsetof(T, regMrDmaBuf) == 64 &&         \
                    offsetof(T, deregMr) == 72 && offsetof(T, isend) == 80 &&             \
                    offsetof(T, irecv) == 88 && offsetof(T, iflush) == 96 &&              \
                    offsetof(T, test) == 104 && offsetof(T, closeSend) == 112 &&          \
                    offsetof(T, closeRecv) == 120 && offsetof(T, closeListen) == 128 &&   \
                    offsetof(T, getDeviceMr) == 136 && offsetof(T, irecvConsumed) == 144, \
                #T " member offsets")
SCAPE_NET_CHECK_OFFSETS(ncclNet_v8_t);
SCAPE_NET_CHECK_OFFSETS(ncclNet_v9_t);
SCAPE_NET_CHECK_OFFSETS(ncclNet_v10_t);
SCAPE_NET_CHECK_OFFSETS(ncclNet_v11_t);
#undef SCAPE_NET_CHECK_OFFSETS
static_assert(offsetof(ncclNet_v9_t, makeVDevice) == 152 &&
                  offsetof(ncclNet_v10_t, makeVDevice) == 152 &&
                  offsetof(ncclNet_v11_t, makeVDevice) == 152 &&
                  offsetof(ncclNet_v11_t, finalize) == 160 &&
                  offsetof(ncclNet_v11_t, setNetAttr) == 168,
              "members added in v9 and v11");

#endif  // SCAPE_PLUGIN_NCCL_NET_ABI_H_
