// Bootstrap: TCP rendezvous through a root, independent of the data transport.
//
// The unique id carries the root's address and port and a random 128-bit secret. Each rank
// connects to the root and presents (secret, rank, nranks, host hash, its transport address
// blob); the root refuses a peer without the right secret, checks every size before it
// allocates, and once all ranks have arrived sends everyone the table of blobs. Then the
// sockets close: the bootstrap gets out of the way.
//
// The root faces the network. It serves every connection at once (one poll loop, non-blocking
// sockets), gives a connection that has not yet presented the secret a short deadline
// (kHandshakeMs), and keeps at most kMaxUnauthenticated of them (the oldest is dropped to make
// room), so idle, slow or hostile connections cannot stop a communicator from forming.
#ifndef SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_
#define SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "scape/scape.h"
#include "transport/bootstrap/host.h"
#include "transport/bootstrap/socket.h"

namespace scape {
namespace bootstrap {

using Secret = std::array<uint8_t, 16>;

// Largest transport address a rank may publish, and largest rank count.
constexpr uint32_t kMaxBlobBytes = 64 * 1024;
constexpr int kMaxRanks = 1 << 20;
// A connection to the root must present a complete, authenticated hello within this long
// (or the communicator's timeout, if shorter).
constexpr int kHandshakeMs = 3000;
// Connections that have not presented the secret yet, kept at once by the root.
constexpr size_t kMaxUnauthenticated = 128;

struct RootAddress {
  SockAddr addr;
  Secret secret{};
};

// Serialises / parses the public unique id. Parse validates the magic and the address family.
void EncodeUniqueId(const RootAddress& root, scapeUniqueId* id);
Status DecodeUniqueId(const scapeUniqueId& id, RootAddress* root);

// Fills `secret` from the kernel's random source.
Status RandomSecret(Secret* secret);

// Starts the rendezvous root on `bindAddr` (port 0 picks a free port) in a detached thread.
// `root` receives the bound address. The root waits up to 5 * timeoutMs for the first rank,
// then, from the first arrival, up to the smaller of timeoutMs and that rank's own timeout for
// the rest; the ranks that came get scapeTimeout (naming the missing ranks) if the others do
// not. When formation fails (timeout, ranks disagreeing on nranks, two processes claiming one
// rank), the root keeps listening for that timeout once more and answers every rank that
// still arrives with the same error, so that late ranks learn the real cause.
Status StartRoot(const SockAddr& bindAddr, const Secret& secret, int timeoutMs, RootAddress* root);

struct PeerEntry {
  uint64_t hostHash = 0;
  uint32_t pid = 0;  // process id, meaningful on the same host only
  std::vector<uint8_t> blob;
};

// Joins the rendezvous. On success `table` has nranks entries (this rank's included).
Status Rendezvous(const RootAddress& root, int rank, int nranks, uint64_t hostHash,
                  const std::vector<uint8_t>& blob, int timeoutMs, std::vector<PeerEntry>* table);

// HostHash() (host.h): the hash identifying this host, for counting ranks per host.

// ---- wire format, exposed for the tests and the fuzz targets ---------------------------------

// What a rank presents to the root (followed by blobLen bytes of transport address).
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
Hello MakeHello(const Secret& secret, int rank, int nranks, uint32_t blobLen, uint64_t hostHash,
                int timeoutMs, uint32_t pid);

// The root's incremental reader of one incoming connection: a hello, then the blob. Bytes are
// fed as they arrive; nothing is allocated before the secret and the sizes are checked.
class HelloReader {
 public:
  // Consumes bytes from data[0, len) (*used of them). Fails for a connection that does not
  // speak the protocol (scapeRemoteError), a wrong secret (scapeRemoteError, *refuse set: the
  // peer deserves an answer) or a bad blob size (scapeInvalidUsage, *refuse set).
  Status Feed(const uint8_t* data, size_t len, const Secret& secret, size_t* used, bool* refuse);
  bool authenticated() const { return authenticated_; }
  bool complete() const { return complete_; }
  const Hello& hello() const { return hello_; }
  std::vector<uint8_t>& blob() { return blob_; }

 private:
  Hello hello_{};
  size_t got_ = 0;  // bytes of the hello received
  std::vector<uint8_t> blob_;
  size_t blobGot_ = 0;
  bool authenticated_ = false, complete_ = false;
};

// The root's answer: status and message, then (on success) nranks entries.
std::vector<uint8_t> EncodeReply(const Status& st, int nranks, const std::vector<PeerEntry>* table);

// A rank's incremental reader of the root's answer for a communicator of `nranks` ranks.
class ReplyReader {
 public:
  explicit ReplyReader(int nranks) : nranks_(nranks) {}
  // Consumes bytes (*used of them). A malformed answer is scapeRemoteError.
  Status Feed(const uint8_t* data, size_t len, size_t* used);
  bool complete() const { return complete_; }
  // Once complete: the root's verdict (an error it reported, or Ok with the table).
  const Status& verdict() const { return verdict_; }
  std::vector<PeerEntry>& table() { return table_; }

 private:
  Status Take(const uint8_t* data, size_t len, size_t* used, void* dst, size_t want);
  int nranks_;
  int phase_ = 0;  // 0 header, 1 message, 2 entry header, 3 entry blob
  uint8_t hdr_[24] = {0};
  size_t got_ = 0;
  std::string msg_;
  int entry_ = 0;
  uint8_t ehdr_[16] = {0};
  std::vector<PeerEntry> table_;
  Status verdict_;
  bool complete_ = false;
};

}  // namespace bootstrap
}  // namespace scape

#endif  // SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_
