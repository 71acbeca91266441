#include "base/param.h"

#include <strings.h>

#include <cassert>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "base/log.h"

#define SCAPE_PARAM_STR2(x) #x
#define SCAPE_PARAM_STR(x) SCAPE_PARAM_STR2(x)

namespace scape {
namespace {

// One declaration per knob. The "doc" strings are README.md's configuration table (regenerate
// it with `build/tests/scape_param_table --update README.md` after an edit here). Order: as the
// README lists them.
const ParamInfo kParams[] = {
    {"SCAPE_TIMEOUT_MS", SCAPE_PARAM_STR(SCAPE_PARAM_DEFAULT_TIMEOUT_MS),
     "ms an operation (or the bootstrap) may go without progress before `scapeTimeout` "
     "(`scapeConfig_t.timeoutMs`)",
     ParamType::kInt, 1, 86400000},
    {"SCAPE_PROGRESS", "auto",
     "how ranks wait: `spin`, `yield` (for more ranks than cores), `blocking` (sleep on network "
     "events), `auto` (spin unless this host has more ranks than cores) "
     "(`scapeConfig_t.progressMode`)",
     ParamType::kChoice, 0, 0, "auto,spin,yield,blocking"},  // order of scapeProgressMode_t
    {"SCAPE_SOCKET_IFNAME", "",
     "interface of the bootstrap socket (`scapeConfig_t.netIf`); when it is a loopback "
     "interface, UCX's network devices are limited to it too, unless `UCX_NET_DEVICES` is set",
     ParamType::kString, 0, 0, nullptr, "first up non-loopback interface, else `lo`"},
    {"SCAPE_UCX_TLS", "", "UCX transports (`UCX_TLS` syntax), e.g. `tcp`, `sm,self`, `rc,sm`",
     ParamType::kString, 0, 0, nullptr, "UCX default"},
    {"SCAPE_LOCAL_SHM", "1",
     "`1`: ranks on one host talk over shared memory, and a dead peer is found by watching its "
     "process; `0`: every peer goes over a network transport (TCP, RDMA) that reports failures "
     "itself",
     ParamType::kInt, 0, 1},
    {"SCAPE_ALLREDUCE_ALGO", "auto",
     "`ring` (bandwidth-optimal), `rd` (recursive doubling, latency-optimal) or `auto`",
     ParamType::kChoice, 0, 0, "auto,ring,rd"},
    {"SCAPE_RING_THRESHOLD", "65536", "bytes from which `auto` uses the ring", ParamType::kInt, 0,
     INT64_C(1) << 62},
    {"SCAPE_CHUNK_BYTES", "2097152",
     "pipeline chunk of the ring and broadcast (4096 .. 1 GiB). Unset, it is the largest chunk: a "
     "block smaller than 8 of them is cut into about 8 chunks of at least 64 KiB; set, every "
     "chunk is this size",
     ParamType::kInt, 4096, INT64_C(1) << 30},
    {"SCAPE_BOOTSTRAP_ADDR", "", "`host:port` of the rendezvous root for `scapeCommInitFromEnv`",
     ParamType::kString, 0, 0, nullptr, "-"},
    {"SCAPE_BOOTSTRAP_SECRET", "", "32 hex digits, the shared secret for `scapeCommInitFromEnv`",
     ParamType::kString, 0, 0, nullptr, "derived from the job id"},
    {"SCAPE_NCCL_DEVICES", "", "NICs the NCCL net plugin exposes (see \"NCCL net plugin\")",
     ParamType::kString, 0, 0, nullptr, "auto"},
    {"SCAPE_NCCL_UCX_TLS", "", "UCX transports of the NCCL net plugin", ParamType::kString, 0, 0,
     nullptr, "`SCAPE_UCX_TLS`"},
    {"SCAPE_DEVICE_CHUNK_BYTES", "4194304",
     "chunk of the pipeline that stages device (GPU) buffers through pinned host memory "
     "(4096 .. 1 GiB; chunks grow past it to keep a call within 16 chunks)",
     ParamType::kInt, 4096, INT64_C(1) << 30},
    {"SCAPE_DEVICE_ZERO_COPY", "1",
     "`1`: device buffers of all-gathers and broadcasts on a UCX communicator go to UCX "
     "directly, not staged, when every rank's UCX moves CUDA memory; `0`: always staged",
     ParamType::kInt, 0, 1},
    {"SCAPE_NCCL_LIBRARY", "libnccl.so.2",
     "the NCCL library (name or path) the NCCL backend loads (`scapeCommInitNccl*`); the "
     "Python package sets it to the NCCL PyTorch uses when it is unset and `backend=\"nccl\"`",
     ParamType::kString},
    {"SCAPE_NCCL_HOST_COMM", "1",
     "`1`: `scapeCommInitNccl` also joins a host (UCX) communicator of the same ranks, so masks, "
     "the optimizer and host buffers work on the NCCL communicator; `0`: none (dense device "
     "collectives only)",
     ParamType::kInt, 0, 1},
    {"SCAPE_DEBUG", "WARN", "log level: `NONE`, `WARN`, `INFO`, `TRACE`", ParamType::kChoice, 0, 0,
     "NONE,WARN,INFO,TRACE"},  // order of LogLevel
    {nullptr, nullptr, nullptr},
};

// The one getenv of the library. Empty reads as unset.
const char* RawEnv(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

const ParamInfo& Declared(const char* name) {
  static const ParamInfo kUndeclared = {"", "", ""};
  const ParamInfo* p = FindParam(name);
  assert(p && "parameter not declared in base/param.cc");
  return p ? *p : kUndeclared;
}

// A malformed knob: one message shape for every type.
Status Malformed(const ParamInfo& p, const std::string& value, const std::string& expected) {
  return InvalidUsage(
      StrFormat("%s='%s': expected %s (see the configuration table in "
                "README.md)",
                p.name, value.c_str(), expected.c_str()));
}

bool ParseInt64(const std::string& v, int64_t* out) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 0);
  if (errno != 0 || end == v.c_str() || *end != '\0') return false;
  *out = static_cast<int64_t>(x);
  return true;
}

}  // namespace

const ParamInfo* ParamTable() { return kParams; }

const ParamInfo* FindParam(const char* name) {
  if (!name) return nullptr;
  for (const ParamInfo* p = kParams; p->name; ++p)
    if (std::strcmp(p->name, name) == 0) return p;
  return nullptr;
}

std::string ParamString(const char* name) {
  const ParamInfo& info = Declared(name);
  if (!*info.name) return "";
  const char* v = RawEnv(name);
  return v ? std::string(v) : std::string(info.defaultValue);
}

const char* ParamCString(const char* name) {
  const ParamInfo& info = Declared(name);
  if (!*info.name) return nullptr;
  const char* v = RawEnv(name);
  return v ? v : (*info.defaultValue ? info.defaultValue : nullptr);
}

bool ParamIsSet(const char* name) {
  const ParamInfo& info = Declared(name);
  return *info.name && RawEnv(name) != nullptr;
}

Status ParamGetInt(const char* name, int64_t* out) {
  const ParamInfo& info = Declared(name);
  if (!*info.name || info.type != ParamType::kInt)
    return InternalError(StrFormat("%s is not declared as an integer knob", name));
  const std::string v = ParamString(name);
  int64_t x = 0;
  if (!ParseInt64(v, &x) || x < info.minValue || x > info.maxValue)
    return Malformed(info, v,
                     StrFormat("an integer in %lld..%lld", static_cast<long long>(info.minValue),
                               static_cast<long long>(info.maxValue)));
  *out = x;
  return Status::Ok();
}

Status ParamGetChoice(const char* name, int* out) {
  const ParamInfo& info = Declared(name);
  if (!*info.name || info.type != ParamType::kChoice || !info.choices)
    return InternalError(StrFormat("%s is not declared as a choice knob", name));
  const std::string v = ParamString(name);
  const std::string all = info.choices;
  int index = 0;
  for (size_t begin = 0; begin <= all.size(); ++index) {
    size_t end = all.find(',', begin);
    if (end == std::string::npos) end = all.size();
    if (strcasecmp(all.substr(begin, end - begin).c_str(), v.c_str()) == 0) {
      *out = index;
      return Status::Ok();
    }
    begin = end + 1;
  }
  std::string expected = "one of " + all;
  return Malformed(info, v, expected);
}

int64_t ParamDefaultInt(const char* name) {
  const ParamInfo& info = Declared(name);
  int64_t x = 0;
  return info.type == ParamType::kInt && ParseInt64(info.defaultValue, &x) ? x : 0;
}

const char* ParamExternal(const char* name) {
  assert(name && std::strncmp(name, "SCAPE_", 6) != 0 &&
         "SCAPE_* variables are knobs: declare them in base/param.cc");
  return name ? RawEnv(name) : nullptr;
}

void LogEffectiveParams(const char* who) {
  static std::once_flag once;
  if (static_cast<int>(CurrentLogLevel()) < static_cast<int>(LogLevel::kInfo)) return;
  std::call_once(once, [who] {
    SCAPE_INFO("knobs at %s init (value, then where it came from):", who ? who : "library");
    for (const ParamInfo* p = kParams; p->name; ++p) {
      const bool set = RawEnv(p->name) != nullptr;
      const std::string v = ParamString(p->name);
      SCAPE_INFO("  %s=%s (%s)", p->name,
                 v.empty() ? (p->defaultDoc ? p->defaultDoc : "<unset>") : v.c_str(),
                 set ? "env" : "default");
    }
  });
}

std::string ParamTableMarkdown() {
  std::string md = "| variable | default | meaning |\n|---|---|---|\n";
  for (const ParamInfo* p = kParams; p->name; ++p) {
    const char* def = p->defaultDoc ? p->defaultDoc : p->defaultValue;
    md += StrFormat("| `%s` | %s | %s |\n", p->name, *def ? def : "-", p->doc);
  }
  return md;
}

}  // namespace scape
