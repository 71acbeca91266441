// Bootstrap: TCP rendezvous through a root, independent of the data transport.
//
// The unique id carries the root's address and port and a random 128-bit secret. Each rank
// connects to the root and presents (secret, rank, nranks, host hash, its transport address
// blob); the root refuses a peer without the right secret, checks every size before it
// allocates, and once all ranks have arrived sends everyone the table of blobs. Then the
// sockets close: the bootstrap gets out of the way.
#ifndef SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_
#define SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "scape/scape.h"
#include "base/status.h"
#include "transport/bootstrap/socket.h"

namespace scape {
namespace bootstrap {

using Secret = std::array<uint8_t, 16>;

// Largest transport address a rank may publish, and largest rank count.
constexpr uint32_t kMaxBlobBytes = 64 * 1024;
constexpr int kMaxRanks = 1 << 20;

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
// not.
Status StartRoot(const SockAddr& bindAddr, const Secret& secret, int timeoutMs,
                 RootAddress* root);

struct PeerEntry {
  uint64_t hostHash = 0;
  uint32_t pid = 0;  // process id, meaningful on the same host only
  std::vector<uint8_t> blob;
};

// Joins the rendezvous. On success `table` has nranks entries (this rank's included).
Status Rendezvous(const RootAddress& root, int rank, int nranks, uint64_t hostHash,
                  const std::vector<uint8_t>& blob, int timeoutMs, std::vector<PeerEntry>* table);

// A hash identifying this host (hostname and boot id), for counting ranks per host.
uint64_t HostHash();

}  // namespace bootstrap
}  // namespace scape

#endif  // SCAPE_TRANSPORT_BOOTSTRAP_BOOTSTRAP_H_
