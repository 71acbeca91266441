#include "plugin/nccl/net_params.h"

#include <cstdlib>

#include "base/param.h"

namespace scape {
namespace nccl {

namespace {
std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}
}  // namespace

Status ReadPluginParams(PluginParams* out) {
  PluginParams p;
  p.devices = Env("SCAPE_NCCL_DEVICES");
  p.tls = Env("SCAPE_NCCL_UCX_TLS");
  if (p.tls.empty()) p.tls = ParamString("SCAPE_UCX_TLS");
  p.socketIfname = ParamString("SCAPE_SOCKET_IFNAME");
  p.userNetDevices = !Env("UCX_NET_DEVICES").empty();
  bool ok = true;
  int64_t t = ParamInt("SCAPE_TIMEOUT_MS", 120000, &ok);
  if (!ok || t <= 0 || t > 24LL * 3600 * 1000)
    return InvalidUsage(StrFormat("SCAPE_TIMEOUT_MS='%s': expected milliseconds in 1..86400000",
                                  ParamString("SCAPE_TIMEOUT_MS").c_str()));
  p.timeoutMs = static_cast<int>(t);
  *out = p;
  return Status::Ok();
}

}  // namespace nccl
}  // namespace scape
