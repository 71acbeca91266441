#include "plugin/nccl/net_params.h"

#include "base/param.h"

namespace scape {
namespace nccl {

Status ReadPluginParams(PluginParams* out) {
  LogEffectiveParams("NCCL net plugin");
  PluginParams p;
  p.devices = ParamString("SCAPE_NCCL_DEVICES");
  p.tls = ParamString("SCAPE_NCCL_UCX_TLS");
  if (p.tls.empty()) p.tls = ParamString("SCAPE_UCX_TLS");
  p.socketIfname = ParamString("SCAPE_SOCKET_IFNAME");
  p.userNetDevices = ParamExternal("UCX_NET_DEVICES") != nullptr;
  int64_t t = 0;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_TIMEOUT_MS", &t));
  p.timeoutMs = static_cast<int>(t);
  *out = p;
  return Status::Ok();
}

}  // namespace nccl
}  // namespace scape
