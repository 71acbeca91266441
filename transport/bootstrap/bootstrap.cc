#include "transport/bootstrap/bootstrap.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "base/clock.h"
#include "base/log.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the bootstrap wire format assumes little-endian hosts");

namespace scape {
namespace bootstrap {
namespace {

constexpr uint64_t kIdMagic = 0x3144494550414353ull;     // "SCAPEID1"
constexpr uint64_t kHelloMagic = 0x3148455041435353ull;  // "SSCAPEH1"
constexpr uint64_t kReplyMagic = 0x3152455041435353ull;  // "SSCAPER1"
constexpr uint32_t kProtocolVersion = 1;
constexpr uint32_t kMaxMsgBytes = 1024;

struct IdLayout {
  uint64_t magic;
  uint8_t secret[16];
  uint16_t family;
  uint16_t port;
  uint8_t addr[16];
};
static_assert(sizeof(IdLayout) <= SCAPE_UNIQUE_ID_BYTES, "unique id too large");
static_assert(sizeof(Hello) == 56, "hello layout");

struct ReplyHeader {
  uint64_t magic;
  int32_t status;  // scapeResult_t
  int32_t nranks;
  uint32_t msgLen;
  uint32_t reserved;
};
static_assert(sizeof(ReplyHeader) == 24, "reply header layout");

struct EntryHeader {
  uint64_t hostHash;
  uint32_t blobLen;
  uint32_t pid;
};
static_assert(sizeof(EntryHeader) == 16, "entry header layout");

bool SecretEqual(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (int i = 0; i < 16; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

void Append(std::vector<uint8_t>* out, const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}

// ---- the root ------------------------------------------------------------------------------

// One connection to the root.
struct Conn {
  Socket sock;
  int64_t acceptedNs = 0;
  HelloReader reader;
  bool reading = true;       // still reading the hello / blob
  bool rank = false;         // an authenticated rank, stored in the table
  std::vector<uint8_t> out;  // answer to send, then close
  size_t outOff = 0;
  bool draining = false;  // answered: wait (briefly) for the peer to close first
  int64_t drainUntilNs = 0;
  bool dead = false;  // to be removed
};

class Root {
 public:
  Root(Socket listener, Secret secret, int timeoutMs)
      : listener_(std::move(listener)), secret_(secret), timeoutMs_(timeoutMs) {}
  void Run();

 private:
  void AcceptAll(int64_t now);
  void ReadFrom(Conn* c);
  void Arrive(Conn* c);
  void Finish(const Status& st);
  void WriteTo(Conn* c);
  std::string Missing() const;

  Socket listener_;
  Secret secret_;
  int timeoutMs_;
  int64_t formDeadlineNs_ = 0;
  int nranks_ = -1;
  int arrived_ = 0;
  std::vector<PeerEntry> table_;
  std::vector<Conn*> byRank_;
  std::vector<std::unique_ptr<Conn>> conns_;
  bool finished_ = false;
  Status fail_;             // why formation failed (finished_ && !ok)
  int64_t endNs_ = 0;       // finished: stop once the answers are out, at the latest then
  bool lingering_ = false;  // finished with a failure: keep answering late ranks
};

int HandshakeMs(int timeoutMs) { return timeoutMs < kHandshakeMs ? timeoutMs : kHandshakeMs; }

void Root::AcceptAll(int64_t now) {
  for (;;) {
    int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: drop the oldest connection still without a hello, so a rank
        // gets one at the next poll (instead of the listener staying readable forever).
        Conn* oldest = nullptr;
        for (auto& c : conns_)
          if (!c->dead && c->reading && (!oldest || c->acceptedNs < oldest->acceptedNs))
            oldest = c.get();
        if (oldest) {
          oldest->sock.Close();
          oldest->dead = true;
          continue;
        }
      }
      return;  // EAGAIN: nothing more now
    }
    size_t unauth = 0;
    Conn* oldest = nullptr;
    for (auto& c : conns_)
      if (!c->dead && c->reading) {
        ++unauth;
        if (!oldest || c->acceptedNs < oldest->acceptedNs) oldest = c.get();
      }
    if (unauth >= kMaxUnauthenticated && oldest) {
      // Make room: the oldest silent connection goes. A rank sends its hello at once, so it is
      // never the oldest for long.
      SCAPE_INFO(
          "bootstrap root: %zu connections have not presented the secret; dropping the "
          "oldest",
          unauth);
      oldest->dead = true;
    }
    auto c = std::make_unique<Conn>();
    c->sock = Socket(fd);
    c->acceptedNs = now;
    conns_.push_back(std::move(c));
  }
}

void Root::ReadFrom(Conn* c) {
  uint8_t buf[16384];
  for (;;) {
    ssize_t n = ::recv(c->sock.fd(), buf, sizeof(buf), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      c->dead = true;  // closed or broken before its hello was complete
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    size_t off = 0;
    while (off < static_cast<size_t>(n) && c->reading) {
      size_t used = 0;
      bool refuse = false;
      Status st = c->reader.Feed(buf + off, static_cast<size_t>(n) - off, secret_, &used, &refuse);
      off += used;
      if (!st.ok()) {
        SCAPE_WARN("bootstrap root: dropped a connection: %s", st.message().c_str());
        c->reading = false;
        if (refuse)
          c->out = EncodeReply(st, c->reader.hello().nranks, nullptr);
        else
          c->dead = true;
        return;
      }
      if (c->reader.complete()) {
        c->reading = false;
        Arrive(c);
        return;
      }
    }
    if (!c->reading) return;
  }
}

void Root::Arrive(Conn* c) {
  const Hello& h = c->reader.hello();
  if (finished_) {
    // Formation is over: tell the late rank why it cannot join.
    c->out = EncodeReply(
        fail_.ok() ? InvalidUsage(StrFormat("rank %d came after the communicator of this unique id "
                                            "had formed (a unique id forms one communicator; two "
                                            "processes may claim this rank)",
                                            h.rank))
                   : fail_,
        h.nranks, nullptr);
    return;
  }
  if (nranks_ < 0) {
    if (h.nranks < 1 || h.nranks > kMaxRanks) {
      c->out = EncodeReply(
          InvalidArgument(StrFormat("nranks %d out of range 1..%d", h.nranks, kMaxRanks)), h.nranks,
          nullptr);
      return;
    }
    nranks_ = h.nranks;
    byRank_.assign(static_cast<size_t>(nranks_), nullptr);
    table_.resize(static_cast<size_t>(nranks_));
    // The ranks give up after their own timeout: answer them before that.
    if (h.timeoutMs > 0 && h.timeoutMs < timeoutMs_) timeoutMs_ = h.timeoutMs;
    formDeadlineNs_ = NowNs() + static_cast<int64_t>(timeoutMs_) * 1000000;
  }
  c->rank = true;
  if (h.nranks != nranks_) {
    Finish(
        InvalidUsage(StrFormat("ranks disagree on nranks: rank %d passed %d, earlier ranks "
                               "passed %d",
                               h.rank, h.nranks, nranks_)));
    c->out = EncodeReply(fail_, h.nranks, nullptr);
    return;
  }
  if (h.rank < 0 || h.rank >= nranks_) {
    Finish(InvalidArgument(
        StrFormat("a process passed rank %d, expected 0..%d", h.rank, nranks_ - 1)));
    c->out = EncodeReply(fail_, h.nranks, nullptr);
    return;
  }
  if (byRank_[static_cast<size_t>(h.rank)]) {
    Finish(InvalidUsage(StrFormat("two processes claim rank %d", h.rank)));
    c->out = EncodeReply(fail_, h.nranks, nullptr);
    return;
  }
  PeerEntry& e = table_[static_cast<size_t>(h.rank)];
  e.hostHash = h.hostHash;
  e.pid = h.pid;
  e.blob = std::move(c->reader.blob());
  byRank_[static_cast<size_t>(h.rank)] = c;
  if (++arrived_ == nranks_) Finish(Status::Ok());
}

// Formation is over: queue the answer of every rank that came.
void Root::Finish(const Status& st) {
  if (finished_) return;
  finished_ = true;
  fail_ = st;
  if (!st.ok()) SCAPE_WARN("bootstrap root: %s", st.message().c_str());
  if (st.ok()) {
    std::vector<uint8_t> reply = EncodeReply(st, nranks_, &table_);
    for (Conn* c : byRank_) c->out = reply;
  } else {
    std::vector<uint8_t> reply = EncodeReply(st, nranks_, nullptr);
    for (Conn* c : byRank_)
      if (c) c->out = reply;
  }
  table_.clear();
  // Answers get a few seconds to leave. After a failure the root stays for the timeout once
  // more, so that ranks still on their way get the real cause rather than a refused connection.
  const int64_t now = NowNs();
  const int64_t sendMs = timeoutMs_ < 5000 ? timeoutMs_ : 5000;
  lingering_ = !st.ok();
  endNs_ = now + (lingering_ ? std::max<int64_t>(timeoutMs_, sendMs) : sendMs) * 1000000;
}

void Root::WriteTo(Conn* c) {
  while (c->outOff < c->out.size()) {
    ssize_t n =
        ::send(c->sock.fd(), c->out.data() + c->outOff, c->out.size() - c->outOff, MSG_NOSIGNAL);
    if (n > 0) {
      c->outOff += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c->dead = true;
    return;
  }
  // Answered. Closing now, with bytes of the peer still unread, would reset the connection
  // and could destroy the answer in flight: half-close, and let the peer close first.
  ::shutdown(c->sock.fd(), SHUT_WR);
  c->draining = true;
  c->drainUntilNs = NowNs() + 1000 * 1000000LL;
}

void Drain(Conn* c) {
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = ::recv(c->sock.fd(), buf, sizeof(buf), 0);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    c->dead = true;  // the peer closed (or the connection broke)
    return;
  }
}

std::string Root::Missing() const {
  std::string missing;
  int shown = 0;
  for (int r = 0; r < nranks_ && shown < 16; ++r)
    if (!byRank_[static_cast<size_t>(r)]) {
      missing += (shown ? "," : "") + std::to_string(r);
      ++shown;
    }
  if (nranks_ - arrived_ > shown) missing += ",...";
  return missing;
}

void Root::Run() {
  const int64_t firstDeadlineNs = NowNs() + static_cast<int64_t>(timeoutMs_) * 5 * 1000000;
  std::vector<pollfd> pfds;
  for (;;) {
    int64_t now = NowNs();
    if (!finished_) {
      if (nranks_ < 0 && now >= firstDeadlineNs) {
        Finish(TimeoutError("no rank arrived at the bootstrap root"));
      } else if (nranks_ >= 0 && now >= formDeadlineNs_) {
        Finish(
            TimeoutError(StrFormat("only %d of %d ranks arrived at the bootstrap root within "
                                   "%d ms; missing ranks: %s",
                                   arrived_, nranks_, timeoutMs_, Missing().c_str())));
      }
    }
    // Handshakes past their deadline go; so do answered connections.
    const int64_t hsNs = static_cast<int64_t>(HandshakeMs(timeoutMs_)) * 1000000;
    bool busy = false;
    for (auto& c : conns_) {
      if (c->reading && now - c->acceptedNs > hsNs) {
        SCAPE_INFO("bootstrap root: dropped a connection that sent no complete hello within %d ms",
                   HandshakeMs(timeoutMs_));
        c->dead = true;
      }
      if (c->draining && now > c->drainUntilNs) c->dead = true;
      if (!c->dead && !c->out.empty()) busy = true;
    }
    if (finished_) {
      if (now >= endNs_) break;
      if (!lingering_ && !busy) break;
    }
    // Stored ranks never die before formation ends (they are neither read nor evicted).
    conns_.erase(std::remove_if(conns_.begin(), conns_.end(),
                                [](const std::unique_ptr<Conn>& c) { return c->dead; }),
                 conns_.end());
    pfds.clear();
    pfds.push_back(pollfd{listener_.fd(), POLLIN, 0});
    for (auto& c : conns_) {
      short ev = 0;
      if (c->reading || c->draining)
        ev = POLLIN;
      else if (c->outOff < c->out.size())
        ev = POLLOUT;
      pfds.push_back(pollfd{c->sock.fd(), ev, 0});
    }
    (void)::poll(pfds.data(), static_cast<nfds_t>(pfds.size()), 50);
    now = NowNs();
    const size_t polled = conns_.size();
    if (pfds[0].revents & POLLIN) AcceptAll(now);
    for (size_t i = 0; i < polled; ++i) {
      Conn* c = conns_[i].get();
      if (c->dead) continue;
      if (c->reading && (pfds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) ReadFrom(c);
      if (c->draining && (pfds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) Drain(c);
    }
    // Answers (queued by an arrival or by Finish) go out as the sockets take them.
    for (auto& c : conns_)
      if (!c->dead && !c->reading && !c->draining && !c->out.empty()) WriteTo(c.get());
  }
}

void RootMain(Socket listener, Secret secret, int timeoutMs) {
  try {
    Root(std::move(listener), secret, timeoutMs).Run();
  } catch (const std::exception& e) {
    // Out of memory in the root: the ranks time out; nothing escapes the thread.
    SCAPE_WARN("bootstrap root stopped: %s", e.what());
  }
}

}  // namespace

// ---- wire ----------------------------------------------------------------------------------

Hello MakeHello(const Secret& secret, int rank, int nranks, uint32_t blobLen, uint64_t hostHash,
                int timeoutMs, uint32_t pid) {
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kProtocolVersion;
  h.rank = rank;
  h.nranks = nranks;
  h.blobLen = blobLen;
  h.hostHash = hostHash;
  h.timeoutMs = timeoutMs;
  h.pid = pid;
  std::memcpy(h.secret, secret.data(), 16);
  return h;
}

Status HelloReader::Feed(const uint8_t* data, size_t len, const Secret& secret, size_t* used,
                         bool* refuse) {
  *used = 0;
  *refuse = false;
  if (complete_) return Status::Ok();
  if (got_ < sizeof(Hello)) {
    size_t take = std::min(len, sizeof(Hello) - got_);
    std::memcpy(reinterpret_cast<uint8_t*>(&hello_) + got_, data, take);
    got_ += take;
    *used += take;
    if (got_ < sizeof(Hello)) return Status::Ok();
    if (hello_.magic != kHelloMagic || hello_.version != kProtocolVersion)
      return RemoteError(
          "a connection that does not speak the SCAPE bootstrap protocol (bad "
          "magic or version)");
    if (!SecretEqual(hello_.secret, secret.data())) {
      *refuse = true;
      return RemoteError(
          StrFormat("the bootstrap root refused a peer claiming rank %d: wrong "
                    "secret (the unique id does not match)",
                    hello_.rank));
    }
    authenticated_ = true;
    if (hello_.blobLen == 0 || hello_.blobLen > kMaxBlobBytes) {
      *refuse = true;
      return InvalidUsage(StrFormat("rank %d: transport address of %u bytes (expected 1..%u)",
                                    hello_.rank, hello_.blobLen, kMaxBlobBytes));
    }
    blob_.resize(hello_.blobLen);
    data += take;
    len -= take;
  }
  size_t take = std::min(len, blob_.size() - blobGot_);
  if (take) std::memcpy(blob_.data() + blobGot_, data, take);
  blobGot_ += take;
  *used += take;
  complete_ = blobGot_ == blob_.size();
  return Status::Ok();
}

std::vector<uint8_t> EncodeReply(const Status& st, int nranks,
                                 const std::vector<PeerEntry>* table) {
  std::vector<uint8_t> out;
  ReplyHeader h{};
  h.magic = kReplyMagic;
  h.status = st.code();
  h.nranks = nranks;
  std::string msg = st.message().substr(0, kMaxMsgBytes);
  h.msgLen = static_cast<uint32_t>(msg.size());
  Append(&out, &h, sizeof(h));
  Append(&out, msg.data(), msg.size());
  if (st.ok() && table) {
    for (const PeerEntry& e : *table) {
      EntryHeader eh{};
      eh.hostHash = e.hostHash;
      eh.pid = e.pid;
      eh.blobLen = static_cast<uint32_t>(e.blob.size());
      Append(&out, &eh, sizeof(eh));
      Append(&out, e.blob.data(), e.blob.size());
    }
  }
  return out;
}

Status ReplyReader::Take(const uint8_t* data, size_t len, size_t* used, void* dst, size_t want) {
  size_t take = std::min(len - *used, want - got_);
  if (take) std::memcpy(static_cast<uint8_t*>(dst) + got_, data + *used, take);
  got_ += take;
  *used += take;
  return Status::Ok();
}

Status ReplyReader::Feed(const uint8_t* data, size_t len, size_t* used) {
  *used = 0;
  while (!complete_ && *used < len) {
    switch (phase_) {
      case 0: {
        (void)Take(data, len, used, hdr_, sizeof(hdr_));
        if (got_ < sizeof(hdr_)) break;
        ReplyHeader h;
        std::memcpy(&h, hdr_, sizeof(h));
        if (h.magic != kReplyMagic) return RemoteError("bootstrap root sent a malformed reply");
        if (h.msgLen > kMaxMsgBytes)
          return RemoteError(StrFormat("bootstrap root sent a %u-byte message", h.msgLen));
        if (h.status != scapeSuccess) {
          verdict_ = Status((h.status > 0 && h.status < scapeNumResults)
                                ? static_cast<scapeResult_t>(h.status)
                                : scapeRemoteError,
                            "");
        } else if (h.nranks != nranks_) {
          return RemoteError(
              StrFormat("bootstrap root answered for %d ranks, expected %d", h.nranks, nranks_));
        }
        msg_.assign(h.msgLen, '\0');
        got_ = 0;
        phase_ = 1;
        if (h.msgLen == 0) goto message_done;
        break;
      }
      case 1:
        (void)Take(data, len, used, &msg_[0], msg_.size());
        if (got_ < msg_.size()) break;
      message_done:
        got_ = 0;
        if (!verdict_.ok()) {
          verdict_ = Status(verdict_.code(), "bootstrap: " + msg_);
          complete_ = true;
          break;
        }
        table_.assign(static_cast<size_t>(nranks_), PeerEntry());
        phase_ = 2;
        if (nranks_ == 0) complete_ = true;
        break;
      case 2: {
        (void)Take(data, len, used, ehdr_, sizeof(ehdr_));
        if (got_ < sizeof(ehdr_)) break;
        EntryHeader eh;
        std::memcpy(&eh, ehdr_, sizeof(eh));
        if (eh.blobLen == 0 || eh.blobLen > kMaxBlobBytes)
          return RemoteError(
              StrFormat("bootstrap table entry for rank %d has %u bytes", entry_, eh.blobLen));
        PeerEntry& e = table_[static_cast<size_t>(entry_)];
        e.hostHash = eh.hostHash;
        e.pid = eh.pid;
        e.blob.resize(eh.blobLen);
        got_ = 0;
        phase_ = 3;
        break;
      }
      case 3: {
        PeerEntry& e = table_[static_cast<size_t>(entry_)];
        (void)Take(data, len, used, e.blob.data(), e.blob.size());
        if (got_ < e.blob.size()) break;
        got_ = 0;
        phase_ = 2;
        if (++entry_ == nranks_) complete_ = true;
        break;
      }
    }
  }
  return Status::Ok();
}

// ---- unique id -------------------------------------------------------------------------------

void EncodeUniqueId(const RootAddress& root, scapeUniqueId* id) {
  IdLayout l{};
  l.magic = kIdMagic;
  std::memcpy(l.secret, root.secret.data(), 16);
  l.family = static_cast<uint16_t>(root.addr.ss.ss_family);
  l.port = root.addr.port();
  if (root.addr.ss.ss_family == AF_INET)
    std::memcpy(l.addr, &reinterpret_cast<const sockaddr_in*>(&root.addr.ss)->sin_addr, 4);
  else
    std::memcpy(l.addr, &reinterpret_cast<const sockaddr_in6*>(&root.addr.ss)->sin6_addr, 16);
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, &l, sizeof(l));
}

Status DecodeUniqueId(const scapeUniqueId& id, RootAddress* root) {
  IdLayout l;
  std::memcpy(&l, id.internal, sizeof(l));
  if (l.magic != kIdMagic)
    return InvalidArgument("uniqueId was not created by scapeGetUniqueId (bad magic)");
  RootAddress r;
  std::memcpy(r.secret.data(), l.secret, 16);
  if (l.family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&r.addr.ss);
    a->sin_family = AF_INET;
    std::memcpy(&a->sin_addr, l.addr, 4);
    r.addr.len = sizeof(sockaddr_in);
  } else if (l.family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&r.addr.ss);
    a->sin6_family = AF_INET6;
    std::memcpy(&a->sin6_addr, l.addr, 16);
    r.addr.len = sizeof(sockaddr_in6);
  } else {
    return InvalidArgument(StrFormat("uniqueId has an unknown address family %u", l.family));
  }
  if (l.port == 0) return InvalidArgument("uniqueId has port 0");
  r.addr.set_port(l.port);
  *root = r;
  return Status::Ok();
}

Status RandomSecret(Secret* secret) {
  size_t got = 0;
  while (got < secret->size()) {
    ssize_t n = getrandom(secret->data() + got, secret->size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status StartRoot(const SockAddr& bindAddr, const Secret& secret, int timeoutMs, RootAddress* root) {
  SockAddr addr = bindAddr;
  Socket listener;
  SCAPE_RETURN_IF_ERROR(Socket::Listen(&addr, &listener));
  root->addr = addr;
  root->secret = secret;
  try {
    std::thread(RootMain, std::move(listener), secret, timeoutMs).detach();
  } catch (const std::exception& e) {
    return SystemError(std::string("cannot start the bootstrap root thread: ") + e.what());
  }
  SCAPE_INFO("bootstrap root listening on %s", addr.ToString().c_str());
  return Status::Ok();
}

Status Rendezvous(const RootAddress& root, int rank, int nranks, uint64_t hostHash,
                  const std::vector<uint8_t>& blob, int timeoutMs, std::vector<PeerEntry>* table) {
  if (blob.empty() || blob.size() > kMaxBlobBytes)
    return InternalError(StrFormat("transport address of %zu bytes", blob.size()));
  Deadline dl = Deadline::AfterMs(static_cast<int64_t>(timeoutMs) + 5000);
  Socket s;
  Status cst = Socket::Connect(root.addr, Deadline::AfterMs(timeoutMs), &s);
  if (!cst.ok()) {
    if (cst.code() == scapeTimeout)
      return TimeoutError(
          StrFormat("no bootstrap root answered at %s within %d ms (%s): it is "
                    "not running there (not started yet, already finished with "
                    "this unique id, or a stale unique id)",
                    root.addr.ToString().c_str(), timeoutMs, cst.message().c_str()));
    return cst;
  }
  Hello h = MakeHello(root.secret, rank, nranks, static_cast<uint32_t>(blob.size()), hostHash,
                      timeoutMs, static_cast<uint32_t>(getpid()));
  SCAPE_RETURN_IF_ERROR(s.SendAll(&h, sizeof(h), dl));
  SCAPE_RETURN_IF_ERROR(s.SendAll(blob.data(), blob.size(), dl));

  ReplyReader rd(nranks);
  std::vector<uint8_t> buf(16384);
  while (!rd.complete()) {
    // One read at a time: whatever has arrived, at least one byte.
    Status st = s.RecvAll(buf.data(), 1, dl);
    if (!st.ok()) {
      if (st.code() == scapeTimeout)
        return TimeoutError(StrFormat("the bootstrap root at %s did not answer within %d ms",
                                      root.addr.ToString().c_str(), timeoutMs + 5000));
      return st.Prepend("bootstrap root " + root.addr.ToString());
    }
    size_t n = 1;
    ssize_t more = ::recv(s.fd(), buf.data() + 1, buf.size() - 1, MSG_DONTWAIT);
    if (more > 0) n += static_cast<size_t>(more);
    size_t off = 0;
    while (off < n && !rd.complete()) {
      size_t used = 0;
      SCAPE_RETURN_IF_ERROR(rd.Feed(buf.data() + off, n - off, &used));
      off += used;
    }
  }
  if (!rd.verdict().ok()) return rd.verdict();
  *table = std::move(rd.table());
  return Status::Ok();
}

}  // namespace bootstrap
}  // namespace scape
