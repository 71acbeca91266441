// This host's identity, the one hash both faces of the library use to tell same-host peers: the
// communicator's bootstrap (the rank table's host hash, docs/FORMATS.md) and the NCCL net
// plugin (the host id in its listen handle and hello). Nothing stores it: each process computes
// it and compares it with its peers' of the same run.
#ifndef SCAPE_TRANSPORT_BOOTSTRAP_HOST_H_
#define SCAPE_TRANSPORT_BOOTSTRAP_HOST_H_

#include <cstdint>

namespace scape {
namespace bootstrap {

// 64-bit FNV-1a of the host name followed by the kernel boot id
// (/proc/sys/kernel/random/boot_id): equal for two processes on the same host and boot.
uint64_t HostHash();

}  // namespace bootstrap
}  // namespace scape

#endif  // SCAPE_TRANSPORT_BOOTSTRAP_HOST_H_
