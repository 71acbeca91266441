#include "transport/bootstrap/bootstrap.h"

#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

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

struct Hello {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t nranks;
  uint32_t blobLen;
  uint64_t hostHash;
  uint8_t secret[16];
  int32_t timeoutMs;  // the rank's own timeout: the root waits no longer than the first rank's
  uint32_t pid;
};

struct ReplyHeader {
  uint64_t magic;
  int32_t status;  // scapeResult_t
  int32_t nranks;
  uint32_t msgLen;
  uint32_t reserved;
};

struct EntryHeader {
  uint64_t hostHash;
  uint32_t blobLen;
  uint32_t pid;
};

bool SecretEqual(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (int i = 0; i < 16; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

Status SendReply(const Socket& s, const Status& st, int nranks,
                 const std::vector<PeerEntry>* table, const Deadline& dl) {
  ReplyHeader h{};
  h.magic = kReplyMagic;
  h.status = st.code();
  h.nranks = nranks;
  std::string msg = st.message().substr(0, kMaxMsgBytes);
  h.msgLen = static_cast<uint32_t>(msg.size());
  SCAPE_RETURN_IF_ERROR(s.SendAll(&h, sizeof(h), dl));
  SCAPE_RETURN_IF_ERROR(s.SendAll(msg.data(), msg.size(), dl));
  if (st.ok() && table) {
    for (const PeerEntry& e : *table) {
      EntryHeader eh{};
      eh.hostHash = e.hostHash;
      eh.pid = e.pid;
      eh.blobLen = static_cast<uint32_t>(e.blob.size());
      SCAPE_RETURN_IF_ERROR(s.SendAll(&eh, sizeof(eh), dl));
      SCAPE_RETURN_IF_ERROR(s.SendAll(e.blob.data(), e.blob.size(), dl));
    }
  }
  return Status::Ok();
}

struct Arrival {
  Socket sock;
  bool present = false;
};

void RootMain(Socket listener, Secret secret, int timeoutMs) {
  Deadline dl = Deadline::AfterMs(static_cast<int64_t>(timeoutMs) * 5);
  int nranks = -1;
  int arrived = 0;
  std::vector<Arrival> ranks;
  std::vector<PeerEntry> table;
  std::vector<Socket> extra;  // sockets of peers involved in a failure but not stored
  Status fail;
  while (nranks < 0 || arrived < nranks) {
    Socket c;
    Status st = listener.Accept(dl, &c);
    if (!st.ok()) {
      if (st.code() == scapeTimeout) {
        std::string missing;
        int shown = 0;
        for (int r = 0; r < nranks && shown < 16; ++r)
          if (!ranks[static_cast<size_t>(r)].present) {
            missing += (shown ? "," : "") + std::to_string(r);
            ++shown;
          }
        fail = TimeoutError(
            nranks < 0 ? std::string("no rank arrived at the bootstrap root")
                       : StrFormat("only %d of %d ranks arrived at the bootstrap root within "
                                   "%d ms; missing ranks: %s%s",
                                   arrived, nranks, timeoutMs, missing.c_str(),
                                   nranks - arrived > shown ? ",..." : ""));
      } else {
        fail = st;
      }
      break;
    }
    // A slow or silent client must not stall the root for long.
    Deadline cdl = Deadline::AfterMs(timeoutMs < 5000 ? timeoutMs : 5000);
    Hello h{};
    st = c.RecvAll(&h, sizeof(h), cdl);
    if (!st.ok() || h.magic != kHelloMagic || h.version != kProtocolVersion) {
      SCAPE_WARN("bootstrap root: dropped a connection that did not speak the SCAPE bootstrap "
                 "protocol (%s)", st.ok() ? "bad magic or version" : st.message().c_str());
      continue;
    }
    if (!SecretEqual(h.secret, secret.data())) {
      SCAPE_WARN("bootstrap root: refused a peer claiming rank %d: wrong secret", h.rank);
      (void)SendReply(c, RemoteError("the bootstrap root refused this rank: wrong secret "
                                     "(the unique id does not match)"),
                      h.nranks, nullptr, cdl);
      continue;
    }
    if (h.blobLen == 0 || h.blobLen > kMaxBlobBytes) {
      (void)SendReply(c, InvalidUsage(StrFormat("rank %d: transport address of %u bytes "
                                                "(expected 1..%u)", h.rank, h.blobLen,
                                                kMaxBlobBytes)),
                      h.nranks, nullptr, cdl);
      continue;
    }
    PeerEntry e;
    e.hostHash = h.hostHash;
    e.pid = h.pid;
    e.blob.resize(h.blobLen);
    st = c.RecvAll(e.blob.data(), e.blob.size(), cdl);
    if (!st.ok()) {
      SCAPE_WARN("bootstrap root: rank %d: %s", h.rank, st.message().c_str());
      continue;
    }
    if (nranks < 0) {
      if (h.nranks < 1 || h.nranks > kMaxRanks) {
        (void)SendReply(c, InvalidArgument(StrFormat("nranks %d out of range 1..%d", h.nranks,
                                                     kMaxRanks)),
                        h.nranks, nullptr, cdl);
        continue;
      }
      nranks = h.nranks;
      ranks.resize(static_cast<size_t>(nranks));
      table.resize(static_cast<size_t>(nranks));
      // The ranks give up after their own timeout: answer them before that.
      if (h.timeoutMs > 0 && h.timeoutMs < timeoutMs) timeoutMs = h.timeoutMs;
      dl = Deadline::AfterMs(timeoutMs);
    }
    if (h.nranks != nranks) {
      fail = InvalidUsage(StrFormat("ranks disagree on nranks: rank %d passed %d, earlier ranks "
                                    "passed %d", h.rank, h.nranks, nranks));
      extra.push_back(std::move(c));
      break;
    }
    if (h.rank < 0 || h.rank >= nranks) {
      fail = InvalidArgument(StrFormat("a process passed rank %d, expected 0..%d", h.rank,
                                       nranks - 1));
      extra.push_back(std::move(c));
      break;
    }
    Arrival& a = ranks[static_cast<size_t>(h.rank)];
    if (a.present) {
      fail = InvalidUsage(StrFormat("two processes claim rank %d", h.rank));
      extra.push_back(std::move(c));
      break;
    }
    a.sock = std::move(c);
    a.present = true;
    table[static_cast<size_t>(h.rank)] = std::move(e);
    ++arrived;
  }
  Deadline sdl = Deadline::AfterMs(timeoutMs < 5000 ? timeoutMs : 5000);
  if (!fail.ok()) SCAPE_WARN("bootstrap root: %s", fail.message().c_str());
  for (Arrival& a : ranks)
    if (a.present) (void)SendReply(a.sock, fail, nranks, &table, sdl);
  for (Socket& s : extra) (void)SendReply(s, fail, nranks, nullptr, sdl);
}

}  // namespace

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

Status StartRoot(const SockAddr& bindAddr, const Secret& secret, int timeoutMs,
                 RootAddress* root) {
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
                  const std::vector<uint8_t>& blob, int timeoutMs,
                  std::vector<PeerEntry>* table) {
  if (blob.empty() || blob.size() > kMaxBlobBytes)
    return InternalError(StrFormat("transport address of %zu bytes", blob.size()));
  Deadline dl = Deadline::AfterMs(static_cast<int64_t>(timeoutMs) + 5000);
  Socket s;
  SCAPE_RETURN_IF_ERROR(Socket::Connect(root.addr, Deadline::AfterMs(timeoutMs), &s));
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kProtocolVersion;
  h.rank = rank;
  h.nranks = nranks;
  h.blobLen = static_cast<uint32_t>(blob.size());
  h.hostHash = hostHash;
  h.timeoutMs = timeoutMs;
  h.pid = static_cast<uint32_t>(getpid());
  std::memcpy(h.secret, root.secret.data(), 16);
  SCAPE_RETURN_IF_ERROR(s.SendAll(&h, sizeof(h), dl));
  SCAPE_RETURN_IF_ERROR(s.SendAll(blob.data(), blob.size(), dl));

  ReplyHeader rh{};
  Status st = s.RecvAll(&rh, sizeof(rh), dl);
  if (!st.ok()) {
    if (st.code() == scapeTimeout)
      return TimeoutError(StrFormat("the bootstrap root at %s did not answer within %d ms",
                                    root.addr.ToString().c_str(), timeoutMs + 5000));
    return st.Prepend("bootstrap root " + root.addr.ToString());
  }
  if (rh.magic != kReplyMagic) return RemoteError("bootstrap root sent a malformed reply");
  if (rh.msgLen > kMaxMsgBytes)
    return RemoteError(StrFormat("bootstrap root sent a %u-byte message", rh.msgLen));
  std::string msg(rh.msgLen, '\0');
  SCAPE_RETURN_IF_ERROR(s.RecvAll(&msg[0], msg.size(), dl));
  if (rh.status != scapeSuccess) {
    scapeResult_t code = (rh.status > 0 && rh.status < scapeNumResults)
                             ? static_cast<scapeResult_t>(rh.status)
                             : scapeRemoteError;
    return Status(code, "bootstrap: " + msg);
  }
  if (rh.nranks != nranks)
    return RemoteError(StrFormat("bootstrap root answered for %d ranks, expected %d", rh.nranks,
                                 nranks));
  std::vector<PeerEntry> t(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    EntryHeader eh{};
    SCAPE_RETURN_IF_ERROR(s.RecvAll(&eh, sizeof(eh), dl));
    if (eh.blobLen == 0 || eh.blobLen > kMaxBlobBytes)
      return RemoteError(StrFormat("bootstrap table entry for rank %d has %u bytes", r,
                                   eh.blobLen));
    t[static_cast<size_t>(r)].hostHash = eh.hostHash;
    t[static_cast<size_t>(r)].pid = eh.pid;
    t[static_cast<size_t>(r)].blob.resize(eh.blobLen);
    SCAPE_RETURN_IF_ERROR(s.RecvAll(t[static_cast<size_t>(r)].blob.data(), eh.blobLen, dl));
  }
  *table = std::move(t);
  return Status::Ok();
}

uint64_t HostHash() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string key = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  if (boot >> bootId) key += bootId;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace bootstrap
}  // namespace scape
