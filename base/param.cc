#include "base/param.h"

#include <cassert>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace scape {
namespace {

const ParamInfo kParams[] = {
    {"SCAPE_DEBUG", "WARN", "log level: NONE, WARN, INFO, TRACE"},
    {"SCAPE_TIMEOUT_MS", "120000",
     "milliseconds an operation (or the bootstrap) may go without progress before scapeTimeout"},
    {"SCAPE_PROGRESS", "auto", "how ranks wait: auto, spin, yield, blocking"},
    {"SCAPE_SOCKET_IFNAME", "",
     "network interface for the bootstrap and UCX TCP (default: first up non-loopback, else lo)"},
    {"SCAPE_UCX_TLS", "", "UCX transports to use (UCX_TLS syntax); empty: UCX's default"},
    {"SCAPE_LOCAL_SHM", "1",
     "1: ranks on one host use shared memory (a dead peer is found by watching its process); "
     "0: every peer goes over a network transport that reports failures itself"},
    {"SCAPE_ALLREDUCE_ALGO", "auto", "all-reduce algorithm: auto, ring, rd (recursive doubling)"},
    {"SCAPE_RING_THRESHOLD", "65536",
     "bytes from which auto all-reduce uses the ring instead of recursive doubling"},
    {"SCAPE_CHUNK_BYTES", "2097152", "pipeline chunk size of ring algorithms, in bytes"},
    {"SCAPE_BOOTSTRAP_ADDR", "", "host:port of the rendezvous root for scapeCommInitFromEnv"},
    {"SCAPE_BOOTSTRAP_SECRET", "",
     "32 hex digits: the shared secret for scapeCommInitFromEnv (default: derived from job id)"},
    {"SCAPE_NCCL_DEVICES", "",
     "NICs the NCCL net plugin exposes (names, prefix match; '=' exact, '^' exclude); empty: auto"},
    {"SCAPE_NCCL_UCX_TLS", "", "UCX transports for the NCCL net plugin; empty: SCAPE_UCX_TLS"},
    {nullptr, nullptr, nullptr},
};

const ParamInfo* Find(const char* name) {
  for (const ParamInfo* p = kParams; p->name; ++p)
    if (std::strcmp(p->name, name) == 0) return p;
  return nullptr;
}

}  // namespace

const ParamInfo* ParamTable() { return kParams; }

std::string ParamString(const char* name) {
  const ParamInfo* info = Find(name);
  assert(info && "parameter not declared in param.cc");
  const char* v = std::getenv(name);
  if (v && *v) return v;
  return info ? info->defaultValue : "";
}

int64_t ParamInt(const char* name, int64_t fallback, bool* ok) {
  if (ok) *ok = true;
  std::string v = ParamString(name);
  if (v.empty()) return fallback;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 0);
  if (errno != 0 || end == v.c_str() || *end != '\0') {
    if (ok) *ok = false;
    return fallback;
  }
  return static_cast<int64_t>(x);
}

}  // namespace scape
