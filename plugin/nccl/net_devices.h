// Device discovery for the NCCL net plugin: RDMA ports through libibverbs when it is there and
// has active ports, else network interfaces. No UCX here: each device carries the route (UCX
// NET_DEVICES value, out-of-band interface) the UCX engine needs.
#ifndef SCAPE_PLUGIN_NCCL_NET_DEVICES_H_
#define SCAPE_PLUGIN_NCCL_NET_DEVICES_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "plugin/nccl/net_params.h"
#include "plugin/nccl/ucx_engine.h"

namespace scape {
namespace nccl {

struct NetDevice {
  std::string name;     // unique among the plugin's devices
  std::string pciPath;  // /sys path of the PCI device; empty if none
  uint64_t guid = 0;
  int port = 0;  // RDMA port number; 0 for a network interface
  int speedMbps = 10000;
  float latencyUs = 0;  // 0: NCCL's own model
  int maxComms = 65536;
  bool rdma = false;
  std::vector<int> children;  // physical devices merged into this one (itself if physical)
  ucxnet::DeviceRoute route;
};

// A device selection list in NCCL_IB_HCA syntax: "mlx5_0:1,eth", "=eth0", "^docker,lo".
class DeviceFilter {
 public:
  static DeviceFilter Parse(const std::string& spec);
  bool empty() const { return items_.empty(); }
  // `port` 0 for interfaces (an item with a port then never matches).
  bool Match(const std::string& name, int port) const;

 private:
  bool exclude_ = false;
  bool exact_ = false;
  std::vector<std::pair<std::string, int>> items_;  // (name, port or -1)
};

// Finds the devices to expose. `how` says where the list came from (for the INFO line).
Status DiscoverDevices(const PluginParams& params, std::vector<NetDevice>* out, std::string* how);

// A virtual device merging `children` (physical devices of `devs`, 2..4 distinct).
Status MergeDevices(const std::vector<NetDevice>& devs, int nPhysical,
                    const std::vector<int>& children, NetDevice* out);

// What the plugin can do with CUDA memory.
struct CudaCaps {
  bool ucxMovesCuda = false;  // the UCX context lists CUDA memory (e.g. only its cuda_copy)
  // GPUDirect RDMA: the NIC reads and writes GPU memory, which needs the memory registered with
  // it (regMr) and received data flushed to the GPU (iflush). This plugin's regMr registers
  // nothing and its iflush does nothing, so it is off.
  bool gpuDirect = false;
};
inline constexpr bool kPluginGpuDirect = false;
// ncclNetProperties_t.ptrSupport: NCCL_PTR_HOST, plus NCCL_PTR_CUDA only with GPUDirect.
// UCX's cuda_copy alone is not enough: UCX would then stage every transfer through host memory
// itself, behind NCCL's back and without the registration and flush NCCL expects of a plugin
// that takes CUDA pointers; with host only, NCCL stages through its own host buffers.
int PtrSupport(const CudaCaps& caps);

}  // namespace nccl
}  // namespace scape

#endif  // SCAPE_PLUGIN_NCCL_NET_DEVICES_H_
