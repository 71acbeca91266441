// The plugin's configuration, read from the environment in one place (ReadPluginParams).
//
// Plugin-specific knobs (declared, like every knob, in base/param.cc):
//   SCAPE_NCCL_DEVICES  which NICs the plugin exposes; default: every active RDMA port, else
//                       the interface named by SCAPE_SOCKET_IFNAME, else every interface that is
//                       up, has an address and is not loopback or docker*. Syntax as
//                       NCCL_IB_HCA: comma-separated names, "name:port" for an RDMA port,
//                       prefix match by default, a leading "=" for exact names, a leading "^"
//                       to exclude the listed names instead.
//   SCAPE_NCCL_UCX_TLS  UCX transports for the plugin (UCX_TLS syntax); default: SCAPE_UCX_TLS,
//                       else UCX's default.
// Shared project knobs it also reads: SCAPE_SOCKET_IFNAME (default device list without RDMA;
// the out-of-band interface of RDMA devices that have no IP interface of their own),
// SCAPE_UCX_TLS, SCAPE_TIMEOUT_MS (connection setup deadline). UCX_NET_DEVICES, when set,
// is left to UCX instead of being set per device.
#ifndef SCAPE_PLUGIN_NCCL_NET_PARAMS_H_
#define SCAPE_PLUGIN_NCCL_NET_PARAMS_H_

#include <string>

#include "base/param.h"
#include "base/status.h"

namespace scape {
namespace nccl {

struct PluginParams {
  std::string devices;                // SCAPE_NCCL_DEVICES
  std::string tls;                    // SCAPE_NCCL_UCX_TLS, else SCAPE_UCX_TLS
  std::string socketIfname;           // SCAPE_SOCKET_IFNAME
  bool userNetDevices = false;        // UCX_NET_DEVICES is set
  int timeoutMs = kDefaultTimeoutMs;  // SCAPE_TIMEOUT_MS
};

Status ReadPluginParams(PluginParams* out);

}  // namespace nccl
}  // namespace scape

#endif  // SCAPE_PLUGIN_NCCL_NET_PARAMS_H_
