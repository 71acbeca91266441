// UCX engine of the NCCL net plugin; see ucx_engine.h for the objects and the protocol.
#include "plugin/nccl/ucx_engine.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "transport/bootstrap/socket.h"
#include "transport/ucx/ucx_context.h"
#include "transport/ucx/ucx_status.h"

namespace scape {
namespace ucxnet {

namespace {

// Object magics (first member of every object handed out).
constexpr uint64_t kCtxMagic = 0x5343415045435458ull;      // "SCAPECTX"
constexpr uint64_t kListenMagic = 0x53434150454c5354ull;   // "SCAPELST"
constexpr uint64_t kSendMagic = 0x534341504553454eull;     // "SCAPESEN"
constexpr uint64_t kRecvMagic = 0x5343415045524356ull;     // "SCAPERCV"
constexpr uint64_t kMrMagic = 0x53434150454d5247ull;       // "SCAPEMRG"
constexpr uint64_t kReqMagic = 0x5343415045524551ull;      // "SCAPEREQ"
constexpr uint64_t kFreeReqMagic = 0x5343415045465245ull;  // "SCAPEFRE"
constexpr uint64_t kDeadMagic = 0xdeadbeefdeadbeefull;

// Wire constants.
constexpr uint32_t kHandleMagic = 0x4e454353u;  // "SCEN"
constexpr uint32_t kHelloMagic = 0x4f4c4548u;   // "HELO"
constexpr uint32_t kReplyMagic = 0x594c5052u;   // "RPLY"
constexpr uint16_t kProtoVersion = 2;           // 2: the UCX handshake after the reply
constexpr uint16_t kHelloHandshake = 1;  // the sender sends the UCX handshake after the reply
constexpr uint16_t kReplyOk = 0;
constexpr uint16_t kReplyUnknownListener = 1;
constexpr size_t kMaxAddressBytes = 64 * 1024;  // largest worker address we accept
constexpr size_t kMaxPendingAccepts = 64;       // half-open incoming connections kept
constexpr int64_t kLivenessCheckNs = 20 * 1000 * 1000;
constexpr int kCheckEvery = 64;
constexpr int64_t kCancelWaitNs = 1000ll * 1000 * 1000;

// The 128-byte listen handle. Bytes [0, kChecksummedBytes) are covered by the checksum.
struct WireHandle {
  uint32_t magic;
  uint16_t version;
  uint16_t addrLen;   // sockaddr length: sizeof(sockaddr_in) or sizeof(sockaddr_in6)
  uint8_t addr[28];   // the listener's TCP address
  uint32_t dev;       // listener's device (informational)
  uint64_t listenId;  // random, names the listen comm
  uint64_t hostId;    // boot id + host name hash: same-host detection
  uint32_t checksum;
  uint32_t reserved0;
  uint64_t connectToken;  // sender's scratch: its connect state machine (0 = not started)
  uint8_t reserved[kHandleBytes - 72];
};
constexpr size_t kChecksummedBytes = 56;
static_assert(sizeof(WireHandle) == kHandleBytes, "handle must be 128 bytes");
static_assert(offsetof(WireHandle, listenId) == 40 && offsetof(WireHandle, checksum) == 56 &&
                  offsetof(WireHandle, connectToken) == 64,
              "handle layout");
static_assert(sizeof(sockaddr_in6) <= 28 && sizeof(sockaddr_in) <= 28, "address field");

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;  // kHelloHandshake or 0
  uint32_t senderPid;
  uint32_t reserved2;
  uint64_t listenId;
  uint64_t hostId;
};
static_assert(sizeof(Hello) == 32, "hello layout");

struct Reply {
  uint32_t magic;
  uint16_t version;
  uint16_t status;
  uint32_t commId;   // tag prefix of the receive comm
  uint32_t addrLen;  // bytes of UCX worker address that follow
};
static_assert(sizeof(Reply) == 16, "reply layout");

uint32_t Fnv1a32(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 16777619u;
  return h;
}

uint64_t Fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t RandomU64() {
  static std::mutex mu;
  static std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{
        rd(), rd(), rd(), rd(), static_cast<unsigned>(getpid()), static_cast<unsigned>(NowNs())};
    return std::mt19937_64(seq);
  }();
  std::lock_guard<std::mutex> lk(mu);
  uint64_t v;
  do v = rng();
  while (v == 0);
  return v;
}

uint64_t HostId() {
  static const uint64_t id = [] {
    std::string s;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, s);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    return Fnv1a64(s + "|" + host);
  }();
  return id;
}

// The project's one UCX-to-result mapping (transport/ucx/ucx_status.h), shared with the
// communicator's transport.
Status UcsError(const std::string& what, ucs_status_t s) { return transport::UcxError(what, s); }

// ---- UCP contexts (one per device, shared by the process) and workers -------------------------

struct UcpCtx {
  ucp_context_h h = nullptr;
  bool cuda = false;
  ~UcpCtx() {
    if (h) ucp_cleanup(h);
  }
};

std::mutex g_ctxMu;
std::map<int, std::weak_ptr<UcpCtx>> g_ctxs;
Options g_opts;

// The TLS list UCX runs with: the plugin's own setting, else the user's UCX_TLS.
std::string EffectiveTls() {
  if (!g_opts.tls.empty()) return g_opts.tls;
  const char* env = std::getenv("UCX_TLS");
  return env ? env : "";
}
bool g_optsSet = false;

Status GetUcpCtx(int dev, const DeviceRoute& route, std::shared_ptr<UcpCtx>* out) {
  std::lock_guard<std::mutex> lk(g_ctxMu);
  if (auto sp = g_ctxs[dev].lock()) {
    *out = sp;
    return Status::Ok();
  }
  transport::UcpContextOptions co;
  co.settings.emplace_back("TLS", g_opts.tls);
  if (g_opts.setNetDevices) co.settings.emplace_back("NET_DEVICES", route.ucxNetDevices);
  if (route.rails > 1) co.settings.emplace_back("MAX_RNDV_RAILS", std::to_string(route.rails));
  co.sharedByThreads = true;  // workers of several NCCL proxy threads share it
  co.name = "scape-nccl-net";
  auto ctx = std::make_shared<UcpCtx>();
  Status st = transport::CreateUcpContext(co, &ctx->h, &ctx->cuda);
  if (!st.ok()) {
    ctx->h = nullptr;
    return st.Prepend(StrFormat("UCP context for device %d (UCX_NET_DEVICES=%s)", dev,
                                route.ucxNetDevices.c_str()));
  }
  g_ctxs[dev] = ctx;
  *out = ctx;
  return Status::Ok();
}

// Error-handler target of one send endpoint. Outlives the comm if the endpoint's close did not
// finish (then the worker keeps it until it is destroyed).
struct EpState {
  std::atomic<int> status{UCS_OK};
};

// An endpoint close still completing (its flush may need the peer's progress). The worker
// finishes it on later progress calls or, at the latest, when it is destroyed.
struct Closing {
  void* req;
  std::unique_ptr<EpState> eps;  // the endpoint's error-handler target outlives the endpoint
};

struct Worker {
  std::shared_ptr<UcpCtx> ctx;
  ucp_worker_h h = nullptr;
  std::vector<uint8_t> address;
  std::mutex mu;
  uint32_t nextCommId = 1;
  std::vector<Closing> closing;

  // Called with mu held.
  void Progress() {
    ucp_worker_progress(h);
    if (!closing.empty()) Reap();
  }
  void Reap() {
    for (size_t i = 0; i < closing.size();) {
      if (ucp_request_check_status(closing[i].req) != UCS_INPROGRESS) {
        ucp_request_free(closing[i].req);
        closing[i] = std::move(closing.back());
        closing.pop_back();
      } else {
        ++i;
      }
    }
  }
  ~Worker() {
    if (!h) return;
    // Give unfinished closes a moment, then let the worker's destruction end them.
    int64_t deadline = NowNs() + 200 * 1000 * 1000;
    while (!closing.empty() && NowNs() < deadline) Progress();
    for (Closing& c : closing) ucp_request_free(c.req);
    ucp_worker_destroy(h);
    closing.clear();  // after the destroy: no error handler can run any more
  }
};

Status NewWorker(const std::shared_ptr<UcpCtx>& ctx, std::shared_ptr<Worker>* out) {
  auto w = std::make_shared<Worker>();
  w->ctx = ctx;
  ucp_worker_params_t wp;
  std::memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialised by Worker::mu
  ucs_status_t s = ucp_worker_create(ctx->h, &wp, &w->h);
  if (s != UCS_OK) {
    w->h = nullptr;
    return UcsError("ucp_worker_create", s);
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = ucp_worker_get_address(w->h, &addr, &len);
  if (s != UCS_OK) return UcsError("ucp_worker_get_address", s);
  w->address.assign(reinterpret_cast<uint8_t*>(addr), reinterpret_cast<uint8_t*>(addr) + len);
  ucp_worker_release_address(w->h, addr);
  if (len == 0 || len > kMaxAddressBytes)
    return InternalError(StrFormat("UCX worker address of %zu bytes", len));
  *out = std::move(w);
  return Status::Ok();
}

// Progresses until `req` completes or the deadline passes. Returns true if it completed.
bool WaitRequest(Worker* w, void* req, int64_t deadlineNs) {
  while (ucp_request_check_status(req) == UCS_INPROGRESS) {
    if (NowNs() >= deadlineNs) return false;
    w->Progress();
  }
  return true;
}

// ---- non-blocking socket I/O ------------------------------------------------------------------

Status SendSome(int fd, const void* buf, size_t len, size_t* off) {
  while (*off < len) {
    ssize_t n =
        ::send(fd, static_cast<const char*>(buf) + *off, len - *off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      *off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
    return RemoteError(StrFormat("send on the setup connection: %s", std::strerror(errno)));
  }
  return Status::Ok();
}

Status RecvSome(int fd, void* buf, size_t len, size_t* off) {
  while (*off < len) {
    ssize_t n = ::recv(fd, static_cast<char*>(buf) + *off, len - *off, MSG_DONTWAIT);
    if (n > 0) {
      *off += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return RemoteError("the peer closed the setup connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Status::Ok();
    return RemoteError(StrFormat("receive on the setup connection: %s", std::strerror(errno)));
  }
  return Status::Ok();
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// ---- objects ----------------------------------------------------------------------------------

struct NetContext {
  NetContext() { RegisterLive(this); }
  ~NetContext() { UnregisterLive(this); }
  uint64_t magic = kCtxMagic;
  int timeoutMs = kDefaultTimeoutMs;
  int graceMs = 1000;
  std::mutex mu;
  std::map<int, std::shared_ptr<Worker>> workers;
};

struct Comm;

struct Request {
  uint64_t magic = kFreeReqMagic;
  Comm* comm = nullptr;
  int index = 0;
  int n = 0;
  int64_t postedNs = 0;
  void* ucx[kMaxRecvs];
  bool subDone[kMaxRecvs];
  ucs_status_t st[kMaxRecvs];
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

  Comm(uint64_t m, bool send, int nreq) : magic(m), isSend(send), reqs(static_cast<size_t>(nreq)) {
    freeList.reserve(static_cast<size_t>(nreq));
    for (int i = nreq - 1; i >= 0; --i) {
      reqs[static_cast<size_t>(i)].index = i;
      reqs[static_cast<size_t>(i)].comm = this;
      freeList.push_back(i);
      RegisterLive(&reqs[static_cast<size_t>(i)]);
    }
    RegisterLive(this);
  }
  ~Comm() {
    UnregisterLive(this);
    for (Request& r : reqs) UnregisterLive(&r);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  Request* Acquire() {
    if (freeList.empty()) return nullptr;
    Request* r = &reqs[static_cast<size_t>(freeList.back())];
    freeList.pop_back();
    r->magic = kReqMagic;
    r->postedNs = NowNs();
    for (int i = 0; i < kMaxRecvs; ++i) {
      r->ucx[i] = nullptr;
      r->subDone[i] = true;
      r->st[i] = UCS_OK;
      r->cap[i] = r->len[i] = 0;
    }
    ++inFlight;
    return r;
  }
  void Release(Request* r) {
    r->magic = kFreeReqMagic;
    freeList.push_back(r->index);
    --inFlight;
  }

  // Looks (at most every kLivenessCheckNs) at the setup connection: EOF or any byte means the
  // peer is gone (its process exited or it closed the comm).
  void CheckPeer(int64_t now) {
    if (goneNs != 0 || now < nextCheckNs) return;
    nextCheckNs = now + kLivenessCheckNs;
    char b;
    ssize_t n = ::recv(sock.fd(), &b, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    goneNs = now;
    goneWhy = n == 0  ? "it closed the connection (comm closed or process exited)"
              : n > 0 ? "it sent unexpected bytes on the control connection"
                      : StrFormat("control connection error: %s", std::strerror(errno));
  }
};

struct SendComm : Comm {
  SendComm() : Comm(kSendMagic, true, kSendRequests) {}
  bool sameHost = false;
  ucp_ep_h ep = nullptr;
  EpState* eps = nullptr;
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

namespace {

struct PendingAccept {
  bootstrap::Socket sock;
  int64_t deadlineNs = 0;
  Hello hello{};
  size_t got = 0;
  std::vector<uint8_t> reply;
  size_t sent = 0;
  std::unique_ptr<RecvComm> rc;  // created once the hello checked out
  Request* handshake = nullptr;  // rc's receive of the sender's handshake (null once done)
  PendingAccept() = default;
  PendingAccept(const PendingAccept&) = delete;
  PendingAccept& operator=(const PendingAccept&) = delete;
  // A connection dropped before it was handed out: CloseRecv cancels the handshake receive.
  ~PendingAccept() {
    if (rc) (void)CloseRecv(rc.release());
  }
};

}  // namespace

struct ListenComm {
  ListenComm() { RegisterLive(this); }
  ~ListenComm() { UnregisterLive(this); }
  uint64_t magic = kListenMagic;
  int dev = 0;
  std::shared_ptr<Worker> worker;
  bootstrap::Socket sock;
  uint64_t listenId = 0;
  std::string addr;
  int timeoutMs = 0;
  int graceMs = 0;
  std::mutex mu;
  std::vector<std::unique_ptr<PendingAccept>> pending;
};

namespace {

struct Connecting {
  NetContext* ctx = nullptr;
  int dev = 0;
  uint64_t listenId = 0;
  bool sameHost = false;
  std::shared_ptr<Worker> worker;
  bootstrap::Socket sock;
  std::string peer;
  int phase = 0;  // 0 TCP connect, 1 send hello, 2 read reply, 3 read address, 4 handshake
  int64_t deadlineNs = 0;
  int timeoutMs = 0;
  int graceMs = 0;
  Hello hello{};
  size_t sent = 0;
  Reply reply{};
  size_t got = 0;
  std::vector<uint8_t> addr;
  size_t addrGot = 0;
  // The endpoint asks for failure reports, and the UCX handshake runs (see PostHandshakeSend):
  // false only for a same-host peer when UCX may use shared memory.
  bool handshake = true;
  SendComm* sc = nullptr;    // from phase 4 on, until handed out
  Request* hsReq = nullptr;  // sc's handshake send (null once done)
  Connecting() = default;
  Connecting(const Connecting&) = delete;
  Connecting& operator=(const Connecting&) = delete;
  // A connect abandoned (error, timeout, context deleted) mid-handshake: CloseSend force-closes
  // the endpoint, which ends the handshake send.
  ~Connecting() {
    if (sc) (void)CloseSend(sc);
  }
};

std::mutex g_connMu;
std::unordered_map<uint64_t, std::unique_ptr<Connecting>> g_conns;

Status GetWorker(NetContext* ctx, int dev, const DeviceRoute& route, std::shared_ptr<Worker>* out) {
  std::lock_guard<std::mutex> lk(ctx->mu);
  auto it = ctx->workers.find(dev);
  if (it != ctx->workers.end()) {
    *out = it->second;
    return Status::Ok();
  }
  std::shared_ptr<UcpCtx> uctx;
  SCAPE_RETURN_IF_ERROR(GetUcpCtx(dev, route, &uctx));
  std::shared_ptr<Worker> w;
  SCAPE_RETURN_IF_ERROR(NewWorker(uctx, &w));
  ctx->workers[dev] = w;
  *out = std::move(w);
  return Status::Ok();
}

void OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  static_cast<EpState*>(arg)->status.store(status);
}

Status CheckHandle(const WireHandle* h) {
  if (h->magic != kHandleMagic)
    return InternalError(
        StrFormat("corrupted handle: bad magic 0x%08x (expected 0x%08x)", h->magic, kHandleMagic));
  if (h->version != kProtoVersion)
    return InternalError(StrFormat("handle of protocol version %u (this plugin speaks %u)",
                                   h->version, kProtoVersion));
  uint32_t sum = Fnv1a32(h, kChecksummedBytes);
  if (sum != h->checksum) return InternalError("corrupted handle: checksum mismatch");
  sockaddr_storage ss{};
  std::memcpy(&ss, h->addr, sizeof(h->addr));
  bool ok = (ss.ss_family == AF_INET && h->addrLen == sizeof(sockaddr_in)) ||
            (ss.ss_family == AF_INET6 && h->addrLen == sizeof(sockaddr_in6));
  if (!ok) return InternalError("corrupted handle: bad socket address");
  return Status::Ok();
}

ucp_request_param_t DataParam(MemType type) {
  ucp_request_param_t rp;
  std::memset(&rp, 0, sizeof(rp));
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  rp.memory_type = type == MemType::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  return rp;
}

// ---- the UCX handshake (defect 9) -------------------------------------------------------------
//
// UCX 1.13 resolves the remote endpoint id lazily (UCX_RESOLVE_REMOTE_EP_ID=n): the first
// operation that needs it (a rendezvous send, a synchronous send) makes the sender's endpoint
// send a wire-up REQ, and the receiving worker answers with a REP when it next progresses.
// UCX 1.13 aborts (ucp_request.c:684, "got REP message") when that REP is still queued on a
// TCP endpoint whose connection to the sender then fails (ucp_ep_set_failed purges the queue
// and ucp_request_send_state_ff does not expect a REP there): a sender that died right after
// posting its first rendezvous send did that, the receiver seeing the REQ in its first test().
// So neither side hands out its comm before wire-up finished: the sender sends one synchronous
// tagged message (UCX sends it only once the REP arrived, and completes it only when the
// receiver acknowledged the match), and Accept waits for that message. A peer that dies after
// that meets endpoints with no wire-up message in flight, and its death surfaces as an error.
//
// Only endpoints that ask for failure reports (UCP_ERR_HANDLING_MODE_PEER) run it: on the
// others (same host, shared memory possible) UCX never purges a failed endpoint's queue. The
// receiving worker keeps the endpoint UCX created for the REQ until the worker is destroyed
// (UCX 1.13 does not tell it when the sender closes): the handshake makes that happen for
// every such connection, where before only the first rendezvous transfer did.
//
// The UCX tag layout, in one place: data carries the receive comm's id in the high half and
// NCCL's tag in the low half; the handshake has 0 as its comm-id half, which data never has
// (comm ids start at 1), and the comm id in the low half. The handshake's payload ties it to
// the listener and the receive comm.
uint64_t DataTag(uint32_t commId, int tag) {
  return (static_cast<uint64_t>(commId) << 32) | static_cast<uint32_t>(tag);
}
uint64_t HandshakeTag(uint32_t commId) { return commId; }
uint64_t HandshakeWord(uint64_t listenId, uint32_t commId) {
  return listenId ^ (static_cast<uint64_t>(commId) * 0x9e3779b97f4a7c15ull);
}

// Posts the receive of the handshake (before the reply goes out, so it never arrives
// unexpected). Called without the worker lock.
Status PostHandshakeRecv(RecvComm* rc, Request** out) {
  *out = nullptr;
  Worker* w = rc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  Request* r = rc->Acquire();
  if (!r) return InternalError("no request slot for the handshake");
  r->n = 1;
  r->cap[0] = sizeof(rc->handshake);
  ucp_request_param_t rp = DataParam(MemType::kHost);
  rp.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  ucs_status_ptr_t p = ucp_tag_recv_nbx(w->h, &rc->handshake, sizeof(rc->handshake),
                                        HandshakeTag(rc->id), ~0ull, &rp);
  if (p == nullptr || UCS_PTR_IS_ERR(p)) {
    rc->Release(r);
    return p == nullptr ? InternalError("UCX completed the handshake receive without a request")
                        : UcsError("handshake receive", UCS_PTR_STATUS(p));
  }
  r->ucx[0] = p;
  r->subDone[0] = false;
  *out = r;
  return Status::Ok();
}

// Posts the handshake send on a new endpoint. Called without the worker lock.
Status PostHandshakeSend(SendComm* sc, uint64_t listenId, Request** out) {
  *out = nullptr;
  Worker* w = sc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  Request* r = sc->Acquire();
  if (!r) return InternalError("no request slot for the handshake");
  r->n = 1;
  r->cap[0] = sizeof(sc->handshake);
  sc->handshake = HandshakeWord(listenId, sc->remoteId);
  ucp_request_param_t rp = DataParam(MemType::kHost);
  ucs_status_ptr_t p = ucp_tag_send_sync_nbx(sc->ep, &sc->handshake, sizeof(sc->handshake),
                                             HandshakeTag(sc->remoteId), &rp);
  if (UCS_PTR_IS_ERR(p)) {
    sc->Release(r);
    return UcsError("handshake send", UCS_PTR_STATUS(p));
  }
  r->ucx[0] = p;  // null: completed at once (not expected of a synchronous send)
  r->subDone[0] = p == nullptr;
  *out = r;
  return Status::Ok();
}

// Looks at a handshake request: *done once it completed (the request is then released and
// *req cleared). Called without the worker lock.
Status PollHandshake(Comm* c, Request** req, bool* done) {
  *done = false;
  Request* r = *req;
  std::lock_guard<std::mutex> lk(c->worker->mu);
  ucs_status_t s = UCS_OK;
  const size_t cap = r->cap[0];
  size_t len = cap;
  if (!r->subDone[0]) {
    if (c->isSend) {
      s = ucp_request_check_status(r->ucx[0]);
    } else {
      ucp_tag_recv_info_t info;
      std::memset(&info, 0, sizeof(info));
      s = ucp_tag_recv_request_test(r->ucx[0], &info);
      len = info.length;
    }
    if (s == UCS_INPROGRESS) return Status::Ok();
    ucp_request_free(r->ucx[0]);
    r->ucx[0] = nullptr;
    r->subDone[0] = true;
  }
  c->Release(r);
  *req = nullptr;
  *done = true;
  if (s != UCS_OK) return UcsError("UCX handshake", s);
  if (len != cap)
    return RemoteError(StrFormat("UCX handshake of %zu bytes (expected %zu)", len, cap));
  return Status::Ok();
}

// EOF or any byte on a setup connection during the handshake: the peer is gone.
Status SetupPeerGone(int fd) {
  char b;
  ssize_t n = ::recv(fd, &b, 1, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Status::Ok();
  return RemoteError(n == 0  ? "the peer closed the setup connection during the UCX handshake"
                     : n > 0 ? "the peer sent unexpected bytes during the UCX handshake"
                             : StrFormat("setup connection error during the UCX handshake: %s",
                                         std::strerror(errno)));
}

// Advances one incoming connection. *ready when the reply went out and the sender's handshake
// arrived.
Status StepAccept(ListenComm* lc, PendingAccept* p, bool* ready) {
  *ready = false;
  if (!p->rc) {
    SCAPE_RETURN_IF_ERROR(RecvSome(p->sock.fd(), &p->hello, sizeof(p->hello), &p->got));
    if (p->got < sizeof(p->hello)) return Status::Ok();
    if (p->hello.magic != kHelloMagic || p->hello.version != kProtoVersion ||
        (p->hello.flags & ~kHelloHandshake) != 0)
      return RemoteError(StrFormat("bad hello (magic 0x%08x, version %u, flags 0x%x)",
                                   p->hello.magic, p->hello.version, p->hello.flags));
    Reply rep{kReplyMagic, kProtoVersion, kReplyOk, 0, 0};
    if (p->hello.listenId != lc->listenId) {
      // Tell the sender (best effort) and drop the connection.
      rep.status = kReplyUnknownListener;
      size_t off = 0;
      (void)SendSome(p->sock.fd(), &rep, sizeof(rep), &off);
      return RemoteError(
          "a sender presented a handle for another listener (stale or corrupted "
          "handle)");
    }
    auto rc = std::make_unique<RecvComm>();
    rc->dev = lc->dev;
    rc->worker = lc->worker;
    rc->graceMs = lc->graceMs;
    {
      std::lock_guard<std::mutex> lk(lc->worker->mu);
      rc->id = lc->worker->nextCommId++;
      if (lc->worker->nextCommId == 0) lc->worker->nextCommId = 1;
    }
    rep.commId = rc->id;
    rep.addrLen = static_cast<uint32_t>(lc->worker->address.size());
    p->reply.resize(sizeof(rep) + lc->worker->address.size());
    std::memcpy(p->reply.data(), &rep, sizeof(rep));
    std::memcpy(p->reply.data() + sizeof(rep), lc->worker->address.data(),
                lc->worker->address.size());
    RecvComm* raw = rc.get();
    p->rc = std::move(rc);  // from here on, dropping p cancels the handshake receive
    if (p->hello.flags & kHelloHandshake)
      SCAPE_RETURN_IF_ERROR(PostHandshakeRecv(raw, &p->handshake));
  }
  if (p->sent < p->reply.size()) {
    SCAPE_RETURN_IF_ERROR(SendSome(p->sock.fd(), p->reply.data(), p->reply.size(), &p->sent));
    if (p->sent < p->reply.size()) return Status::Ok();
  }
  if (!(p->hello.flags & kHelloHandshake)) {
    *ready = true;
    return Status::Ok();
  }
  bool done = false;
  Status st = PollHandshake(p->rc.get(), &p->handshake, &done);
  if (!st.ok()) return st.Prepend(StrFormat("sender pid %u", p->hello.senderPid));
  if (!done) return SetupPeerGone(p->sock.fd());
  if (p->rc->handshake != HandshakeWord(lc->listenId, p->rc->id))
    return RemoteError(StrFormat("sender pid %u sent a wrong UCX handshake", p->hello.senderPid));
  *ready = true;
  return Status::Ok();
}

// Advances a connect. *ready when the send comm exists (c->... moved to *out).
Status StepConnect(Connecting* c, SendComm** out) {
  for (;;) {
    switch (c->phase) {
      case 0: {
        struct pollfd pfd = {c->sock.fd(), POLLOUT, 0};
        int pr = ::poll(&pfd, 1, 0);
        if (pr < 0 && errno != EINTR)
          return SystemError(StrFormat("poll: %s", std::strerror(errno)));
        if (pr <= 0) return Status::Ok();
        int err = 0;
        socklen_t el = sizeof(err);
        getsockopt(c->sock.fd(), SOL_SOCKET, SO_ERROR, &err, &el);
        if (err != 0)
          return RemoteError(StrFormat("cannot reach the listener at %s: %s", c->peer.c_str(),
                                       std::strerror(err)));
        SetNoDelay(c->sock.fd());
        c->phase = 1;
        break;
      }
      case 1:
        SCAPE_RETURN_IF_ERROR(SendSome(c->sock.fd(), &c->hello, sizeof(c->hello), &c->sent));
        if (c->sent < sizeof(c->hello)) return Status::Ok();
        c->phase = 2;
        break;
      case 2:
        SCAPE_RETURN_IF_ERROR(RecvSome(c->sock.fd(), &c->reply, sizeof(c->reply), &c->got));
        if (c->got < sizeof(c->reply)) return Status::Ok();
        if (c->reply.magic != kReplyMagic || c->reply.version != kProtoVersion)
          return RemoteError(
              StrFormat("listener at %s sent a bad reply (magic 0x%08x, "
                        "version %u)",
                        c->peer.c_str(), c->reply.magic, c->reply.version));
        if (c->reply.status == kReplyUnknownListener)
          return RemoteError(
              StrFormat("listener at %s does not know this handle's listen id "
                        "(stale or corrupted handle)",
                        c->peer.c_str()));
        if (c->reply.status != kReplyOk)
          return RemoteError(StrFormat("listener at %s refused the connection (status %u)",
                                       c->peer.c_str(), c->reply.status));
        if (c->reply.addrLen == 0 || c->reply.addrLen > kMaxAddressBytes)
          return RemoteError(
              StrFormat("listener at %s announced a %u-byte worker address "
                        "(expected 1..%zu)",
                        c->peer.c_str(), c->reply.addrLen, kMaxAddressBytes));
        c->addr.resize(c->reply.addrLen);
        c->phase = 3;
        break;
      case 3: {
        SCAPE_RETURN_IF_ERROR(RecvSome(c->sock.fd(), c->addr.data(), c->addr.size(), &c->addrGot));
        if (c->addrGot < c->addr.size()) return Status::Ok();
        auto sc = std::make_unique<SendComm>();
        sc->dev = c->dev;
        sc->worker = c->worker;
        sc->peer = c->peer;
        sc->graceMs = c->graceMs;
        sc->remoteId = c->reply.commId;
        sc->sameHost = c->sameHost;
        sc->eps = new EpState();
        ucp_ep_params_t ep;
        std::memset(&ep, 0, sizeof(ep));
        ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        ep.address = reinterpret_cast<const ucp_address_t*>(c->addr.data());
        // UCX 1.13's shared-memory transports cannot report peer failures, so an endpoint that
        // asks for failure reports never uses them: same-host peers go without (the setup
        // connection tells us when they are gone).
        // The same goes only where UCX can use shared memory at all (not under UCX_TLS=tcp):
        // elsewhere the endpoint asks for failure reports (transport/ucx/ucx_status.h), and
        // the UCX handshake runs (c->handshake).
        const bool noReports = !c->handshake;
        ep.err_mode = noReports ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
        if (!noReports) {
          ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
          ep.err_handler.cb = &OnEpError;
          ep.err_handler.arg = sc->eps;
        }
        ucs_status_t s;
        {
          std::lock_guard<std::mutex> lk(c->worker->mu);
          s = ucp_ep_create(c->worker->h, &ep, &sc->ep);
        }
        if (s != UCS_OK) {
          delete sc->eps;
          sc->eps = nullptr;
          return UcsError(StrFormat("ucp_ep_create to %s", c->peer.c_str()), s);
        }
        sc->sock = std::move(c->sock);
        if (!c->handshake) {
          *out = sc.release();
          return Status::Ok();
        }
        c->sc = sc.release();  // from here on, dropping c closes the endpoint
        SCAPE_RETURN_IF_ERROR(PostHandshakeSend(c->sc, c->listenId, &c->hsReq));
        c->phase = 4;
        break;
      }
      case 4: {
        bool done = false;
        SCAPE_RETURN_IF_ERROR(PollHandshake(c->sc, &c->hsReq, &done));
        if (!done) {
          int es = c->sc->eps->status.load();
          if (es != UCS_OK)
            return RemoteError(StrFormat("the endpoint failed during the UCX handshake: %s",
                                         ucs_status_string(static_cast<ucs_status_t>(es))));
          return SetupPeerGone(c->sc->sock.fd());
        }
        *out = c->sc;
        c->sc = nullptr;
        return Status::Ok();
      }
    }
  }
}

// Frees the UCX side of every request still in flight on a comm (after cancelling or force
// closing). Called with the worker lock held.
void DrainRequests(Comm* c, bool cancelRecvs) {
  Worker* w = c->worker.get();
  int64_t deadline = NowNs() + kCancelWaitNs;
  for (Request& r : c->reqs) {
    if (r.magic != kReqMagic) continue;
    for (int i = 0; i < r.n; ++i) {
      if (!r.ucx[i]) continue;
      if (cancelRecvs && ucp_request_check_status(r.ucx[i]) == UCS_INPROGRESS)
        ucp_request_cancel(w->h, r.ucx[i]);
    }
  }
  for (Request& r : c->reqs) {
    if (r.magic != kReqMagic) continue;
    for (int i = 0; i < r.n; ++i) {
      if (!r.ucx[i]) continue;
      WaitRequest(w, r.ucx[i], deadline);
      ucp_request_free(r.ucx[i]);  // released by UCX when it completes, if it has not
      r.ucx[i] = nullptr;
    }
    c->Release(&r);
  }
}

}  // namespace

// ---- API --------------------------------------------------------------------------------------

const char* UcxVersion() { return ucp_get_version_string(); }

Status NewNetContext(const Options& options, int dev0, const DeviceRoute& route0,
                     NetContext** out) {
  *out = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_ctxMu);
    if (!g_optsSet) {
      g_opts = options;
      g_optsSet = true;
    }
  }
  auto ctx = std::make_unique<NetContext>();
  ctx->timeoutMs = options.timeoutMs;
  ctx->graceMs = options.peerGraceMs;
  std::shared_ptr<Worker> w;
  SCAPE_RETURN_IF_ERROR(GetWorker(ctx.get(), dev0, route0, &w));
  *out = ctx.release();
  return Status::Ok();
}

void DeleteNetContext(NetContext* ctx) {
  if (!ctx) return;
  std::vector<std::unique_ptr<Connecting>> dropped;
  {
    std::lock_guard<std::mutex> lk(g_connMu);
    for (auto it = g_conns.begin(); it != g_conns.end();) {
      if (it->second && it->second->ctx == ctx) {
        dropped.push_back(std::move(it->second));
        it = g_conns.erase(it);
      } else {
        ++it;
      }
    }
  }
  ctx->magic = kDeadMagic;
  delete ctx;
}

bool CudaSupported(const NetContext* ctx, int dev) {
  auto* c = const_cast<NetContext*>(ctx);
  std::lock_guard<std::mutex> lk(c->mu);
  auto it = c->workers.find(dev);
  return it != c->workers.end() && it->second->ctx->cuda;
}

Status Listen(NetContext* ctx, int dev, const DeviceRoute& route, void* handle, ListenComm** out) {
  *out = nullptr;
  auto lc = std::make_unique<ListenComm>();
  lc->dev = dev;
  lc->timeoutMs = ctx->timeoutMs;
  lc->graceMs = ctx->graceMs;
  SCAPE_RETURN_IF_ERROR(GetWorker(ctx, dev, route, &lc->worker));
  bootstrap::SockAddr addr;
  std::string chosen;
  SCAPE_RETURN_IF_ERROR(bootstrap::InterfaceAddress(route.oobIfname, &addr, &chosen));
  SCAPE_RETURN_IF_ERROR(bootstrap::Socket::Listen(&addr, &lc->sock));
  if (addr.len > sizeof(WireHandle::addr))
    return InternalError(StrFormat("socket address of %u bytes", static_cast<unsigned>(addr.len)));
  lc->listenId = RandomU64();
  lc->addr = addr.ToString();

  WireHandle h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kHandleMagic;
  h.version = kProtoVersion;
  h.addrLen = static_cast<uint16_t>(addr.len);
  std::memcpy(h.addr, &addr.ss, addr.len);
  h.dev = static_cast<uint32_t>(dev);
  h.listenId = lc->listenId;
  h.hostId = HostId();
  h.checksum = Fnv1a32(&h, kChecksummedBytes);
  std::memcpy(handle, &h, sizeof(h));
  *out = lc.release();
  return Status::Ok();
}

Status Connect(NetContext* ctx, int dev, const DeviceRoute& route, void* handle, SendComm** out) {
  *out = nullptr;
  WireHandle h;
  std::memcpy(&h, handle, sizeof(h));
  std::unique_ptr<Connecting> c;
  uint64_t token = h.connectToken;
  if (token == 0) {
    SCAPE_RETURN_IF_ERROR(CheckHandle(&h));
    c = std::make_unique<Connecting>();
    c->ctx = ctx;
    c->dev = dev;
    c->listenId = h.listenId;
    c->sameHost = h.hostId == HostId();
    c->handshake = !(c->sameHost && transport::SharedMemoryPossible(EffectiveTls()));
    c->timeoutMs = ctx->timeoutMs;
    c->graceMs = ctx->graceMs;
    c->deadlineNs = NowNs() + static_cast<int64_t>(ctx->timeoutMs) * 1000000;
    SCAPE_RETURN_IF_ERROR(GetWorker(ctx, dev, route, &c->worker));
    bootstrap::SockAddr sa;
    std::memcpy(&sa.ss, h.addr, h.addrLen);
    sa.len = h.addrLen;
    c->peer = sa.ToString();
    if (sa.port() == 0) return InternalError("corrupted handle: port 0");
    int fd = ::socket(sa.ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return ErrnoError("socket", errno);
    c->sock = bootstrap::Socket(fd);
    int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa.ss), sa.len);
    if (rc != 0 && errno != EINPROGRESS && errno != EINTR)
      return RemoteError(
          StrFormat("cannot reach the listener at %s: %s", c->peer.c_str(), std::strerror(errno)));
    c->hello = Hello{kHelloMagic,
                     kProtoVersion,
                     static_cast<uint16_t>(c->handshake ? kHelloHandshake : 0),
                     static_cast<uint32_t>(getpid()),
                     0,
                     h.listenId,
                     HostId()};
    token = RandomU64();
  } else {
    std::lock_guard<std::mutex> lk(g_connMu);
    auto it = g_conns.find(token);
    if (it == g_conns.end() || !it->second)
      return InternalError(
          "the handle names no connect in progress (corrupted handle, or "
          "connect called again after it failed or completed)");
    if (it->second->ctx != ctx || it->second->listenId != h.listenId)
      return InternalError("the handle's connect state belongs to another context or handle");
    c = std::move(it->second);
    g_conns.erase(it);
  }
  auto clearToken = [&] {
    uint64_t zero = 0;
    std::memcpy(static_cast<char*>(handle) + offsetof(WireHandle, connectToken), &zero,
                sizeof(zero));
  };
  {
    std::lock_guard<std::mutex> wl(c->worker->mu);
    c->worker->Progress();
  }
  Status st = StepConnect(c.get(), out);
  if (!st.ok()) {
    clearToken();
    return st.Prepend(StrFormat("connect to %s", c->peer.c_str()));
  }
  if (*out) {
    clearToken();
    return Status::Ok();
  }
  if (NowNs() > c->deadlineNs) {
    clearToken();
    return TimeoutError(
        StrFormat("connect to %s: no answer within %d ms", c->peer.c_str(), c->timeoutMs));
  }
  std::memcpy(static_cast<char*>(handle) + offsetof(WireHandle, connectToken), &token,
              sizeof(token));
  std::lock_guard<std::mutex> lk(g_connMu);
  g_conns[token] = std::move(c);
  return Status::Ok();
}

Status ValidateConnectHandle(const void* handle, std::string* peer) {
  WireHandle h;
  std::memcpy(&h, handle, sizeof(h));
  SCAPE_RETURN_IF_ERROR(CheckHandle(&h));
  bootstrap::SockAddr sa;
  std::memcpy(&sa.ss, h.addr, h.addrLen);
  sa.len = h.addrLen;
  if (sa.port() == 0) return InternalError("corrupted handle: port 0");
  if (peer) *peer = sa.ToString();
  return Status::Ok();
}

Status Accept(ListenComm* lc, RecvComm** out, std::string* note) {
  *out = nullptr;
  std::lock_guard<std::mutex> lk(lc->mu);
  int64_t now = NowNs();
  while (lc->pending.size() < kMaxPendingAccepts) {
    int fd = ::accept4(lc->sock.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return ErrnoError(StrFormat("accept on %s", lc->addr.c_str()), errno);
    }
    SetNoDelay(fd);
    auto p = std::make_unique<PendingAccept>();
    p->sock = bootstrap::Socket(fd);
    p->deadlineNs = now + static_cast<int64_t>(lc->timeoutMs) * 1000000;
    lc->pending.push_back(std::move(p));
  }
  {
    // NCCL polls accept on its service thread: progress the worker there too (a peer closing
    // an earlier connection may wait for us).
    std::lock_guard<std::mutex> wl(lc->worker->mu);
    lc->worker->Progress();
  }
  for (size_t i = 0; i < lc->pending.size();) {
    PendingAccept* p = lc->pending[i].get();
    bool ready = false;
    Status st = StepAccept(lc, p, &ready);
    if (st.ok() && !ready && now > p->deadlineNs)
      st = TimeoutError(StrFormat("incoming connection idle for %d ms", lc->timeoutMs));
    if (!st.ok()) {
      if (note) *note = st.message();
      lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
      continue;
    }
    if (ready) {
      RecvComm* rc = p->rc.release();
      rc->sock = std::move(p->sock);
      rc->peer = StrFormat("pid %u (connected to %s)", p->hello.senderPid, lc->addr.c_str());
      lc->pending.erase(lc->pending.begin() + static_cast<long>(i));
      *out = rc;
      return Status::Ok();
    }
    ++i;
  }
  return Status::Ok();
}

void CloseListen(ListenComm* lc) {
  lc->magic = kDeadMagic;
  delete lc;
}

Status CloseSend(SendComm* sc) {
  std::shared_ptr<Worker> w = sc->worker;
  {
    std::lock_guard<std::mutex> lk(w->mu);
    sc->magic = kDeadMagic;
    bool failed = sc->eps->status.load() != UCS_OK || sc->goneNs != 0;
    // Flush what was sent; with requests still in flight (an abort) cancel them instead.
    bool force = sc->inFlight > 0 || failed;
    ucp_request_param_t rp;
    std::memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(sc->ep, &rp);
    sc->ep = nullptr;
    std::unique_ptr<EpState> eps(sc->eps);
    sc->eps = nullptr;
    if (UCS_PTR_IS_PTR(r)) {
      // A forced close ends locally; a flushing one may wait for the peer, which need not be
      // progressing now (it may be closing too): do not block on it, finish it later.
      int64_t bound = force ? 2000 : 5;
      if (WaitRequest(w.get(), r, NowNs() + bound * 1000000))
        ucp_request_free(r);
      else
        w->closing.push_back(Closing{r, std::move(eps)});
    }
    DrainRequests(sc, /*cancelRecvs=*/false);
  }
  delete sc;
  return Status::Ok();
}

Status CloseRecv(RecvComm* rc) {
  std::shared_ptr<Worker> w = rc->worker;
  {
    std::lock_guard<std::mutex> lk(w->mu);
    rc->magic = kDeadMagic;
    DrainRequests(rc, /*cancelRecvs=*/true);
  }
  delete rc;
  return Status::Ok();
}

Status RegMr(void* comm, void* data, size_t size, MemType type, MemRegion** out) {
  *out = nullptr;
  Comm* c = static_cast<Comm*>(comm);
  if (type == MemType::kCuda && !c->worker->ctx->cuda)
    return Unsupported(
        "CUDA memory: this UCX cannot move CUDA memory (the plugin does not "
        "advertise NCCL_PTR_CUDA)");
  auto mr = std::make_unique<MemRegion>();
  mr->owner = comm;
  mr->base = reinterpret_cast<uintptr_t>(data);
  mr->len = size;
  mr->type = type;
  *out = mr.release();
  return Status::Ok();
}

Status DeregMr(void* /*comm*/, MemRegion* mr) {
  mr->magic = kDeadMagic;
  delete mr;
  return Status::Ok();
}

Status Isend(SendComm* sc, const void* data, size_t size, int tag, const MemRegion* mr,
             Request** req) {
  *req = nullptr;
  Worker* w = sc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  int es = sc->eps->status.load();
  if (es != UCS_OK)
    return RemoteError(StrFormat("connection to %s failed: %s", sc->peer.c_str(),
                                 ucs_status_string(static_cast<ucs_status_t>(es))));
  Request* r = sc->Acquire();
  if (!r) return Status::Ok();  // all slots busy: NCCL calls again later
  r->n = 1;
  r->cap[0] = size;
  ucp_request_param_t rp = DataParam(mr ? mr->type : MemType::kHost);
  const uint64_t utag = DataTag(sc->remoteId, tag);
  ucs_status_ptr_t p = ucp_tag_send_nbx(sc->ep, data, size, utag, &rp);
  if (UCS_PTR_IS_ERR(p)) {
    sc->Release(r);
    return UcsError(StrFormat("send of %zu bytes to %s", size, sc->peer.c_str()),
                    UCS_PTR_STATUS(p));
  }
  if (p == nullptr) {
    r->subDone[0] = true;
    r->len[0] = size;
  } else {
    r->ucx[0] = p;
    r->subDone[0] = false;
  }
  *req = r;
  return Status::Ok();
}

Status Irecv(RecvComm* rc, int n, void* const* data, const size_t* sizes, const int* tags,
             MemRegion* const* mrs, Request** req) {
  *req = nullptr;
  Worker* w = rc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  Request* r = rc->Acquire();
  if (!r) return Status::Ok();
  r->n = n;
  for (int i = 0; i < n; ++i) {
    ucp_request_param_t rp = DataParam(mrs[i] ? mrs[i]->type : MemType::kHost);
    // UCX 1.13 leaves recv_info unset for a receive that completes at once: always get a
    // request and read the length from it.
    rp.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    const uint64_t utag = DataTag(rc->id, tags[i]);
    ucs_status_ptr_t p = ucp_tag_recv_nbx(w->h, data[i], sizes[i], utag, ~0ull, &rp);
    r->cap[i] = sizes[i];
    if (UCS_PTR_IS_ERR(p) || p == nullptr) {
      for (int j = 0; j < i; ++j) {
        ucp_request_cancel(w->h, r->ucx[j]);
        WaitRequest(w, r->ucx[j], NowNs() + kCancelWaitNs);
        ucp_request_free(r->ucx[j]);
        r->ucx[j] = nullptr;
      }
      rc->Release(r);
      if (p == nullptr) return InternalError("UCX completed a receive without a request");
      return UcsError(StrFormat("receive %d of %d (%zu bytes)", i, n, sizes[i]), UCS_PTR_STATUS(p));
    }
    r->ucx[i] = p;
    r->subDone[i] = false;
  }
  *req = r;
  return Status::Ok();
}

Status Test(Request* r, bool* done, size_t* sizes, int* nOut) {
  *done = false;
  Comm* c = r->comm;
  Worker* w = c->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  if (r->magic != kReqMagic) return InternalError("request is not in flight");
  w->Progress();
  bool all = true;
  for (int i = 0; i < r->n; ++i) {
    if (r->subDone[i]) continue;
    ucs_status_t s;
    if (c->isSend) {
      s = ucp_request_check_status(r->ucx[i]);
      if (s != UCS_INPROGRESS) r->len[i] = r->cap[i];
    } else {
      ucp_tag_recv_info_t info;
      std::memset(&info, 0, sizeof(info));
      s = ucp_tag_recv_request_test(r->ucx[i], &info);
      if (s != UCS_INPROGRESS) r->len[i] = info.length;
    }
    if (s == UCS_INPROGRESS) {
      all = false;
      continue;
    }
    r->subDone[i] = true;
    r->st[i] = s;
    ucp_request_free(r->ucx[i]);
    r->ucx[i] = nullptr;
  }
  if (all) {
    Status st;
    for (int i = 0; i < r->n && st.ok(); ++i) {
      if (r->st[i] == UCS_OK) continue;
      if (r->st[i] == UCS_ERR_MESSAGE_TRUNCATED)
        st =
            InternalError(StrFormat("receive %d of %d: the sender sent %zu bytes into a "
                                    "%zu-byte buffer",
                                    i, r->n, r->len[i], r->cap[i]));
      else
        st = UcsError(StrFormat("%s %d of %d (%zu bytes) %s %s", c->isSend ? "send" : "receive", i,
                                r->n, r->cap[i], c->isSend ? "to" : "from", c->peer.c_str()),
                      r->st[i]);
    }
    if (!st.ok() && st.code() != scapeInternalError) {
      // A transfer failed: if the peer is gone, that is the reason (whatever UCX reported).
      c->nextCheckNs = 0;
      c->CheckPeer(NowNs());
      if (c->goneNs != 0)
        st = RemoteError(
            StrFormat("%s; the peer went away: %s", st.message().c_str(), c->goneWhy.c_str()));
    }
    if (sizes)
      for (int i = 0; i < r->n; ++i) sizes[i] = r->len[i];
    if (nOut) *nOut = r->n;
    c->Release(r);
    *done = true;
    return st;
  }
  if (c->isSend) {
    int es = static_cast<SendComm*>(c)->eps->status.load();
    if (es != UCS_OK)
      return RemoteError(StrFormat("connection to %s failed: %s", c->peer.c_str(),
                                   ucs_status_string(static_cast<ucs_status_t>(es))));
  }
  // Look at the clock (and the setup connection) only every kCheckEvery incomplete tests:
  // NCCL polls test in a tight loop.
  if (++c->testsSinceCheck < kCheckEvery && c->goneNs == 0) return Status::Ok();
  c->testsSinceCheck = 0;
  int64_t now = NowNs();
  c->CheckPeer(now);
  if (c->goneNs != 0 &&
      now - std::max(c->goneNs, r->postedNs) > static_cast<int64_t>(c->graceMs) * 1000000)
    return RemoteError(StrFormat("%s pending for %lld ms after the peer (%s) went away: %s",
                                 c->isSend ? "send" : "receive",
                                 static_cast<long long>((now - r->postedNs) / 1000000),
                                 c->peer.c_str(), c->goneWhy.c_str()));
  return Status::Ok();
}

std::string CommInfo(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  if (c->isSend) {
    auto* sc = static_cast<SendComm*>(c);
    return StrFormat("to %s, %s", sc->peer.c_str(),
                     sc->sameHost ? "same host (UCX may use shared memory; failures seen through "
                                    "the setup connection)"
                                  : "other host (UCX reports peer failures)");
  }
  return "from " + c->peer;
}

int RequestsInFlight(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  std::lock_guard<std::mutex> lk(c->worker->mu);
  return c->inFlight;
}

namespace {
struct LiveSet {
  std::mutex mu;
  std::unordered_map<const void*, int> live;  // address -> registrations
};
LiveSet& Live() {
  static LiveSet* s = new LiveSet();  // never destroyed: objects may die during exit
  return *s;
}
}  // namespace

void RegisterLive(const void* p) {
  std::lock_guard<std::mutex> lk(Live().mu);
  ++Live().live[p];
}
void UnregisterLive(const void* p) {
  std::lock_guard<std::mutex> lk(Live().mu);
  auto it = Live().live.find(p);
  if (it != Live().live.end() && --it->second <= 0) Live().live.erase(it);
}
bool IsLive(const void* p) {
  if (!p) return false;
  std::lock_guard<std::mutex> lk(Live().mu);
  return Live().live.count(p) != 0;
}

NetContext* AsNetContext(void* p) {
  auto* c = static_cast<NetContext*>(p);
  return IsLive(p) && c->magic == kCtxMagic ? c : nullptr;
}
ListenComm* AsListenComm(void* p) {
  auto* c = static_cast<ListenComm*>(p);
  return IsLive(p) && c->magic == kListenMagic ? c : nullptr;
}
SendComm* AsSendComm(void* p) {
  auto* c = static_cast<SendComm*>(p);
  return IsLive(p) && c->magic == kSendMagic ? c : nullptr;
}
RecvComm* AsRecvComm(void* p) {
  auto* c = static_cast<RecvComm*>(p);
  return IsLive(p) && c->magic == kRecvMagic ? c : nullptr;
}
MemRegion* AsMemRegion(void* p) {
  auto* m = static_cast<MemRegion*>(p);
  return IsLive(p) && m->magic == kMrMagic ? m : nullptr;
}
Request* AsRequest(void* p) {
  auto* r = static_cast<Request*>(p);
  return IsLive(p) && r->magic == kReqMagic ? r : nullptr;
}

void MemRegionBounds(const MemRegion* mr, uintptr_t* base, size_t* len, MemType* type) {
  *base = mr->base;
  *len = mr->len;
  *type = mr->type;
}

}  // namespace ucxnet
}  // namespace scape
