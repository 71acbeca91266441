// The NCCL plugin engine's connection model (see ucx_engine.h for the protocol): the 128-byte
// listen handle, the hello / reply exchange over the setup socket, the UCX handshake that
// finishes UCX's wire-up before a comm is handed out, and Listen / Connect / Accept. UCX is
// reached through the shared UCX layer (transport/ucx/ucx_layer.h) only.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <unordered_map>
#include <utility>

#include "plugin/nccl/engine_internal.h"
#include "plugin/nccl/ucx_engine.h"
#include "transport/bootstrap/host.h"

namespace scape {
namespace ucxnet {

namespace {

// Wire constants.
constexpr uint32_t kHandleMagic = 0x4e454353u;  // "SCEN"
constexpr uint32_t kHelloMagic = 0x4f4c4548u;   // "HELO"
constexpr uint32_t kReplyMagic = 0x594c5052u;   // "RPLY"
constexpr uint16_t kProtoVersion = 2;           // 2: the UCX handshake after the reply
constexpr uint16_t kHelloHandshake = 1;  // the sender sends the UCX handshake after the reply
constexpr uint16_t kReplyOk = 0;
constexpr uint16_t kReplyUnknownListener = 1;
constexpr size_t kMaxPendingAccepts = 64;  // half-open incoming connections kept

// The 128-byte listen handle. Bytes [0, kChecksummedBytes) are covered by the checksum.
struct WireHandle {
  uint32_t magic;
  uint16_t version;
  uint16_t addrLen;   // sockaddr length: sizeof(sockaddr_in) or sizeof(sockaddr_in6)
  uint8_t addr[28];   // the listener's TCP address
  uint32_t dev;       // listener's device (informational)
  uint64_t listenId;  // random, names the listen comm
  uint64_t hostId;    // bootstrap::HostHash(): same-host detection
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
// Its tag and payload: HandshakeTag, HandshakeWord (engine_internal.h, beside the data tags).

// A request slot of c for the handshake's one message (its 8-byte word). Called with the
// worker lock held.
Status AcquireHandshakeSlot(Comm* c, Request** r) {
  static_assert(sizeof(RecvComm::handshake) == sizeof(uint64_t) &&
                    sizeof(SendComm::handshake) == sizeof(uint64_t),
                "the handshake is one 8-byte word");
  *r = c->Acquire();
  if (!*r) return InternalError("no request slot for the handshake");
  (*r)->n = 1;
  (*r)->cap[0] = sizeof(uint64_t);
  return Status::Ok();
}

// Posts the receive of the handshake (before the reply goes out, so it never arrives
// unexpected). Called without the worker lock.
Status PostHandshakeRecv(RecvComm* rc, Request** out) {
  *out = nullptr;
  Worker* w = rc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  Request* r = nullptr;
  SCAPE_RETURN_IF_ERROR(AcquireHandshakeSlot(rc, &r));
  ucx::Req p = nullptr;
  ucx::UcsCode s = w->ucx->Recv(&rc->handshake, sizeof(rc->handshake), HandshakeTag(rc->id), ~0ull,
                                ucx::Mem::kHost, &p);
  if (p == nullptr || s != ucx::kUcsOk) {
    rc->Release(r);
    return s == ucx::kUcsOk ? InternalError("UCX completed the handshake receive without a request")
                            : ucx::CodeError("handshake receive", s);
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
  Request* r = nullptr;
  SCAPE_RETURN_IF_ERROR(AcquireHandshakeSlot(sc, &r));
  sc->handshake = HandshakeWord(listenId, sc->remoteId);
  ucx::Req p = nullptr;
  ucx::UcsCode s = w->ucx->Send(sc->ep, &sc->handshake, sizeof(sc->handshake),
                                HandshakeTag(sc->remoteId), ucx::Mem::kHost, /*sync=*/true, &p);
  if (s != ucx::kUcsOk) {
    sc->Release(r);
    return ucx::CodeError("handshake send", s);
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
  ucx::UcsCode s = ucx::kUcsOk;
  const size_t cap = r->cap[0];
  size_t len = cap;
  if (!r->subDone[0]) {
    if (c->isSend) {
      s = ucx::Worker::Check(r->ucx[0]);
    } else {
      len = 0;
      s = ucx::Worker::CheckRecv(r->ucx[0], &len, nullptr);
    }
    if (s == ucx::kUcsInProgress) return Status::Ok();
    ucx::Worker::Free(r->ucx[0]);
    r->ucx[0] = nullptr;
    r->subDone[0] = true;
  }
  c->Release(r);
  *req = nullptr;
  *done = true;
  if (s != ucx::kUcsOk) return ucx::CodeError("UCX handshake", s);
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
    rep.addrLen = static_cast<uint32_t>(lc->worker->ucx->Address().size());
    p->reply.resize(sizeof(rep) + lc->worker->ucx->Address().size());
    std::memcpy(p->reply.data(), &rep, sizeof(rep));
    std::memcpy(p->reply.data() + sizeof(rep), lc->worker->ucx->Address().data(),
                lc->worker->ucx->Address().size());
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
        sc->eps = new ucx::EpFailure();
        // Same-host peers where UCX may use shared memory go without failure reports (the
        // setup connection tells us when they are gone; ucx::WantFailureReports); the others
        // ask for them, and the UCX handshake runs (c->handshake).
        const bool reports = c->handshake;
        ucx::UcsCode s;
        {
          std::lock_guard<std::mutex> lk(c->worker->mu);
          s = c->worker->ucx->Connect(c->addr.data(), c->addr.size(), reports,
                                      reports ? sc->eps : nullptr, &sc->ep);
        }
        if (s != ucx::kUcsOk) {
          delete sc->eps;
          sc->eps = nullptr;
          return ucx::CodeError(StrFormat("ucp_ep_create to %s", c->peer.c_str()), s);
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
          int es = c->sc->eps->code.load();
          if (es != ucx::kUcsOk)
            return RemoteError(
                StrFormat("the endpoint failed during the UCX handshake: %s", ucx::CodeText(es)));
          return SetupPeerGone(c->sc->sock.fd());
        }
        *out = c->sc;
        c->sc = nullptr;
        return Status::Ok();
      }
    }
  }
}

}  // namespace

void AbandonConnects(NetContext* ctx) {
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
  h.hostId = bootstrap::HostHash();
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
    c->sameHost = h.hostId == bootstrap::HostHash();
    c->handshake = ucx::WantFailureReports(c->sameHost, ConfiguredTls());
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
                     bootstrap::HostHash()};
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

ListenComm* AsListenComm(void* p) { return AsLive<ListenComm>(p, kListenMagic); }

}  // namespace ucxnet
}  // namespace scape
