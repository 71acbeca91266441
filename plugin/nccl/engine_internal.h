// The NCCL plugin engine's objects, shared by its two halves: ucx_engine.cc (contexts, workers,
// the data path: memory handles, Isend / Irecv / Test, close, the live-object registry) and
// net_connect.cc (NCCL's connection model: listen handles, connect, accept, the UCX handshake).
// Everything UCX goes through the shared UCX layer (transport/ucx/ucx_layer.h); no UCX header
// here. Not for use outside plugin/nccl/.
#ifndef SCAPE_PLUGIN_NCCL_ENGINE_INTERNAL_H_
#define SCAPE_PLUGIN_NCCL_ENGINE_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "plugin/nccl/ucx_engine.h"
#include "transport/bootstrap/socket.h"
#include "transport/ucx/ucx_layer.h"

namespace scape {
namespace ucxnet {

namespace ucx = transport::ucx;

// Object magics (first member of every object handed out).
constexpr uint64_t kCtxMagic = 0x5343415045435458ull;      // "SCAPECTX"
constexpr uint64_t kListenMagic = 0x53434150454c5354ull;   // "SCAPELST"
constexpr uint64_t kSendMagic = 0x534341504553454eull;     // "SCAPESEN"
constexpr uint64_t kRecvMagic = 0x5343415045524356ull;     // "SCAPERCV"
constexpr uint64_t kMrMagic = 0x53434150454d5247ull;       // "SCAPEMRG"
constexpr uint64_t kReqMagic = 0x5343415045524551ull;      // "SCAPEREQ"
constexpr uint64_t kFreeReqMagic = 0x5343415045465245ull;  // "SCAPEFRE"
constexpr uint64_t kDeadMagic = 0xdeadbeefdeadbeefull;

// What every As* function (ucx_engine.h) does: p as a live object of type T with the given
// magic, else nullptr (the magic is read only once p is known to be live).
template <typename T>
T* AsLive(void* p, uint64_t magic) {
  auto* c = static_cast<T*>(p);
  return IsLive(p) && c->magic == magic ? c : nullptr;
}

constexpr size_t kMaxAddressBytes = 64 * 1024;  // largest worker address we accept
constexpr int64_t kLivenessCheckNs = 20 * 1000 * 1000;

// The UCX tag layout of the plugin, in one place: data carries the receive comm's id in the high
// half and NCCL's tag in the low half; the UCX handshake (net_connect.cc) has 0 as its comm-id
// half, which data never has (comm ids start at 1), and the comm id in the low half. The
// handshake's payload ties it to the listener and the receive comm.
inline uint64_t DataTag(uint32_t commId, int tag) {
  return (static_cast<uint64_t>(commId) << 32) | static_cast<uint32_t>(tag);
}
inline uint64_t HandshakeTag(uint32_t commId) { return commId; }
inline uint64_t HandshakeWord(uint64_t listenId, uint32_t commId) {
  return listenId ^ (static_cast<uint64_t>(commId) * 0x9e3779b97f4a7c15ull);
}

inline ucx::Mem ToMem(MemType type) {
  return type == MemType::kCuda ? ucx::Mem::kCuda : ucx::Mem::kHost;
}

// An endpoint close still completing (its flush may need the peer's progress). The worker
// finishes it on later progress calls or, at the latest, when it is destroyed.
struct Closing {
  ucx::Req req;
  std::unique_ptr<ucx::EpFailure> eps;  // the endpoint's failure target outlives the endpoint
};

// One UCP worker of a device (shared by the comms on it), serialised by `mu`.
struct Worker {
  std::unique_ptr<ucx::Worker> ucx;  // keeps its device's UCP context alive
  std::mutex mu;
  uint32_t nextCommId = 1;
  std::vector<Closing> closing;

  // Called with mu held.
  void Progress() {
    ucx->Progress();
    if (!closing.empty()) Reap();
  }
  void Reap();
  ~Worker();
};

// Progresses until `req` completes or the deadline passes. Returns true if it completed. Called
// with the worker lock held.
bool WaitRequest(Worker* w, ucx::Req req, int64_t deadlineNs);

struct NetContext {
  NetContext() { RegisterLive(this); }
  ~NetContext() { UnregisterLive(this); }
  uint64_t magic = kCtxMagic;
  int timeoutMs = kDefaultTimeoutMs;
  int graceMs = 1000;
  std::mutex mu;
  std::map<int, std::shared_ptr<Worker>> workers;
};

// Device `dev`'s worker of the context (created, with the device's UCP context, on first use).
Status GetWorker(NetContext* ctx, int dev, const DeviceRoute& route, std::shared_ptr<Worker>* out);
// The TLS knob the contexts were created with (Options::tls, fixed by the first NewNetContext).
const std::string& ConfiguredTls();

struct Comm;

struct Request {
  uint64_t magic = kFreeReqMagic;
  Comm* comm = nullptr;
  int index = 0;
  int n = 0;
  int64_t postedNs = 0;
  ucx::Req ucx[kMaxRecvs];
  bool subDone[kMaxRecvs];
  ucx::UcsCode st[kMaxRecvs];
  size_t cap[kMaxRecvs];
  size_t len[kMaxRecvs];
};

struct Comm {
  uint64_t magic;
  bool isSend;
  int dev;
  std::shared_ptr<Worker> worker;
  bootstrap::Socket sock;  // the setup connection, kept as a liveness channel
  std::string peer;        // for messages
  int graceMs = 1000;
  int64_t nextCheckNs = 0;
  int64_t goneNs = 0;  // when the peer was found gone (0: alive)
  std::string goneWhy;
  std::vector<Request> reqs;
  std::vector<int> freeList;
  int inFlight = 0;
  int testsSinceCheck = 0;

  Comm(uint64_t m, bool send, int nreq);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  Request* Acquire();
  void Release(Request* r);
  // Looks (at most every kLivenessCheckNs) at the setup connection: EOF or any byte means the
  // peer is gone (its process exited or it closed the comm).
  void CheckPeer(int64_t now);
};

struct SendComm : Comm {
  SendComm() : Comm(kSendMagic, true, kSendRequests) {}
  bool sameHost = false;
  ucx::Ep ep = nullptr;
  ucx::EpFailure* eps = nullptr;  // UCX's failure reports for ep (code stays kUcsOk without)
  uint32_t remoteId = 0;
  uint64_t handshake = 0;  // the handshake message's payload (HandshakeWord)
};

struct RecvComm : Comm {
  RecvComm() : Comm(kRecvMagic, false, kRecvRequests) {}
  uint32_t id = 0;
  uint64_t handshake = 0;  // receives the handshake message
};

struct MemRegion {
  MemRegion() { RegisterLive(this); }
  ~MemRegion() { UnregisterLive(this); }
  uint64_t magic = kMrMagic;
  const void* owner = nullptr;
  uintptr_t base = 0;
  size_t len = 0;
  MemType type = MemType::kHost;
};

// net_connect.cc: abandons the context's unfinished Connects (DeleteNetContext).
void AbandonConnects(NetContext* ctx);

}  // namespace ucxnet
}  // namespace scape

#endif  // SCAPE_PLUGIN_NCCL_ENGINE_INTERNAL_H_
