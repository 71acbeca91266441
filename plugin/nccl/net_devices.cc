#include "plugin/nccl/net_devices.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>

#include "plugin/nccl/net_abi.h"
#include "scape_config.h"

#if SCAPE_HAVE_IBVERBS
#include <dirent.h>
#include <infiniband/verbs.h>
#endif

namespace scape {
namespace nccl {
namespace {

std::string RealPath(const std::string& p) {
  char buf[PATH_MAX];
  if (!realpath(p.c_str(), buf)) return std::string();
  return buf;
}

int ReadInt(const std::string& path, int fallback) {
  std::ifstream f(path);
  long v = 0;
  if (!(f >> v)) return fallback;
  return static_cast<int>(v);
}

// Interfaces that are up and have a usable address (IPv4, or IPv6 other than link-local).
std::vector<std::pair<std::string, bool>> UpInterfaces() {  // (name, loopback)
  std::vector<std::pair<std::string, bool>> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  std::set<std::string> seen;
  for (const ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
    int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    if (fam == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr))
      continue;
    if (seen.insert(i->ifa_name).second)
      out.emplace_back(i->ifa_name, (i->ifa_flags & IFF_LOOPBACK) != 0);
  }
  freeifaddrs(list);
  return out;
}

NetDevice InterfaceDevice(const std::string& ifname, uint64_t index) {
  NetDevice d;
  d.name = ifname;
  d.pciPath = RealPath("/sys/class/net/" + ifname + "/device");
  d.guid = index;
  d.port = 0;
  int speed = ReadInt("/sys/class/net/" + ifname + "/speed", -1);
  d.speedMbps = speed > 0 ? speed : 10000;  // virtual or unknown links: NCCL's default
  d.latencyUs = 0;
  d.maxComms = 65536;
  d.rdma = false;
  d.route.ucxNetDevices = ifname;
  d.route.oobIfname = ifname;
  return d;
}

#if SCAPE_HAVE_IBVERBS
int IbWidth(uint8_t w) {
  switch (w) {
    case 1:
      return 1;
    case 2:
      return 4;
    case 4:
      return 8;
    case 8:
      return 12;
    case 16:
      return 2;
    default:
      return 1;
  }
}
int IbSpeedPerLane(uint8_t s) {  // Mbps per lane
  switch (s) {
    case 1:
      return 2500;
    case 2:
      return 5000;
    case 4:
      return 10000;
    case 8:
      return 10000;
    case 16:
      return 14000;
    case 32:
      return 25000;
    case 64:
      return 50000;
    case 128:
      return 100000;
    default:
      return 10000;
  }
}

// An IP interface of an RDMA device (IPoIB or the RoCE netdev), if it has an address.
std::string RdmaNetdev(const std::string& ibdev,
                       const std::vector<std::pair<std::string, bool>>& ups) {
  std::string dir = "/sys/class/infiniband/" + ibdev + "/device/net";
  DIR* d = opendir(dir.c_str());
  if (!d) return std::string();
  std::string found;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    for (const auto& u : ups)
      if (u.first == e->d_name) found = u.first;
    if (!found.empty()) break;
  }
  closedir(d);
  return found;
}

void RdmaDevices(const DeviceFilter& filter, const std::string& oobFallback,
                 const std::vector<std::pair<std::string, bool>>& ups,
                 std::vector<NetDevice>* out) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return;
  for (int i = 0; i < n; ++i) {
    const char* name = ibv_get_device_name(list[i]);
    ibv_context* ctx = ibv_open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr attr;
    if (ibv_query_device(ctx, &attr) != 0) {
      ibv_close_device(ctx);
      continue;
    }
    std::vector<NetDevice> ports;
    for (int p = 1; p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr pa;
      if (ibv_query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) continue;
      if (pa.link_layer != IBV_LINK_LAYER_INFINIBAND && pa.link_layer != IBV_LINK_LAYER_ETHERNET)
        continue;
      if (!filter.empty() && !filter.Match(name, p)) continue;
      NetDevice d;
      d.name = name;
      d.pciPath = RealPath(std::string("/sys/class/infiniband/") + name + "/device");
      d.guid = attr.node_guid;
      d.port = p;
      d.speedMbps = IbWidth(pa.active_width) * IbSpeedPerLane(pa.active_speed);
      d.latencyUs = 0;
      d.maxComms = attr.max_qp > 0 ? attr.max_qp : 65536;
      d.rdma = true;
      d.route.ucxNetDevices = std::string(name) + ":" + std::to_string(p);
      std::string nd = RdmaNetdev(name, ups);
      d.route.oobIfname = nd.empty() ? oobFallback : nd;
      ports.push_back(d);
    }
    // Several active ports of one device: name them "dev:port" so names stay unique.
    if (ports.size() > 1)
      for (NetDevice& d : ports) d.name += ":" + std::to_string(d.port);
    for (NetDevice& d : ports) out->push_back(std::move(d));
    ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
}
#endif

}  // namespace

DeviceFilter DeviceFilter::Parse(const std::string& spec) {
  DeviceFilter f;
  std::string s = spec;
  size_t pos = 0;
  while (pos < s.size() && (s[pos] == '^' || s[pos] == '=')) {
    if (s[pos] == '^')
      f.exclude_ = true;
    else
      f.exact_ = true;
    ++pos;
  }
  s = s.substr(pos);
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    std::string item =
        s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) {
      int port = -1;
      size_t colon = item.rfind(':');
      if (colon != std::string::npos && colon + 1 < item.size()) {
        char* end = nullptr;
        long p = std::strtol(item.c_str() + colon + 1, &end, 10);
        if (end && *end == '\0' && p > 0) {
          port = static_cast<int>(p);
          item = item.substr(0, colon);
        }
      }
      f.items_.emplace_back(item, port);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return f;
}

bool DeviceFilter::Match(const std::string& name, int port) const {
  bool hit = false;
  for (const auto& it : items_) {
    bool nameOk = exact_ ? name == it.first : name.compare(0, it.first.size(), it.first) == 0;
    bool portOk = it.second < 0 || it.second == port;
    if (nameOk && portOk) {
      hit = true;
      break;
    }
  }
  return exclude_ ? !hit : hit;
}

namespace {

Status FindDevices(const PluginParams& params, std::vector<NetDevice>* out, std::string* how) {
  out->clear();
  auto ups = UpInterfaces();
  DeviceFilter filter = DeviceFilter::Parse(params.devices);
  if (!params.devices.empty() && filter.empty())
    return InvalidUsage(
        StrFormat("SCAPE_NCCL_DEVICES='%s' names no device", params.devices.c_str()));
#if SCAPE_HAVE_IBVERBS
  RdmaDevices(filter, params.socketIfname, ups, out);
#endif
  if (!out->empty()) {
    *how = params.devices.empty() ? "active RDMA ports" : "RDMA ports matching SCAPE_NCCL_DEVICES";
  }
  if (!params.devices.empty()) {
    // The filter also selects interfaces (loopback only when listed explicitly).
    for (const auto& u : ups) {
      if (!filter.Match(u.first, 0)) continue;
      if (u.second) {
        DeviceFilter explicitOnly = DeviceFilter::Parse("=" + params.devices);
        if (params.devices[0] == '^' || !explicitOnly.Match(u.first, 0)) continue;
      }
      out->push_back(InterfaceDevice(u.first, out->size()));
    }
    *how = "SCAPE_NCCL_DEVICES=" + params.devices;
    if (out->empty())
      return SystemError(
          StrFormat("SCAPE_NCCL_DEVICES='%s' matches no active RDMA port and no "
                    "interface that is up with an address",
                    params.devices.c_str()));
    return Status::Ok();
  }
  if (!out->empty()) return Status::Ok();
  if (!params.socketIfname.empty()) {
    for (const auto& u : ups)
      if (u.first == params.socketIfname) out->push_back(InterfaceDevice(u.first, 0));
    *how = "SCAPE_SOCKET_IFNAME=" + params.socketIfname;
    if (out->empty())
      return SystemError(StrFormat("SCAPE_SOCKET_IFNAME='%s' is not up or has no address",
                                   params.socketIfname.c_str()));
    return Status::Ok();
  }
  for (const auto& u : ups) {
    if (u.second || u.first.compare(0, 6, "docker") == 0) continue;
    out->push_back(InterfaceDevice(u.first, out->size()));
  }
  *how = "network interfaces that are up";
  if (out->empty())
    return SystemError(
        "no RDMA port is active and no network interface other than loopback is "
        "up (set SCAPE_NCCL_DEVICES=lo to use loopback)");
  return Status::Ok();
}

}  // namespace

Status DiscoverDevices(const PluginParams& params, std::vector<NetDevice>* out, std::string* how) {
  Status st = FindDevices(params, out, how);
  if (!st.ok()) {
    out->clear();
    return st;
  }
  for (size_t i = 0; i < out->size(); ++i) (*out)[i].children = {static_cast<int>(i)};
  return st;
}

Status MergeDevices(const std::vector<NetDevice>& devs, int nPhysical,
                    const std::vector<int>& children, NetDevice* out) {
  if (children.size() < 2 || children.size() > 4)
    return InternalError(
        StrFormat("a virtual device merges 2..4 devices, not %zu", children.size()));
  std::set<int> seen;
  NetDevice v;
  v.speedMbps = 0;
  v.maxComms = INT_MAX;
  v.route.rails = static_cast<int>(children.size());
  for (size_t i = 0; i < children.size(); ++i) {
    int c = children[i];
    if (c < 0 || c >= nPhysical)
      return InternalError(
          StrFormat("device %d is not a physical device (0..%d)", c, nPhysical - 1));
    if (!seen.insert(c).second) return InternalError(StrFormat("device %d is listed twice", c));
    const NetDevice& d = devs[static_cast<size_t>(c)];
    v.name += (i ? "+" : "") + d.name;
    v.route.ucxNetDevices += (i ? "," : "") + d.route.ucxNetDevices;
    if (i == 0) {
      v.pciPath = d.pciPath;
      v.guid = d.guid;
      v.port = d.port;
      v.rdma = d.rdma;
      v.route.oobIfname = d.route.oobIfname;
    }
    v.speedMbps += d.speedMbps;
    if (d.latencyUs > v.latencyUs) v.latencyUs = d.latencyUs;
    if (d.maxComms < v.maxComms) v.maxComms = d.maxComms;
    v.children.push_back(c);
  }
  *out = v;
  return Status::Ok();
}

int PtrSupport(const CudaCaps& caps) {
  return NCCL_PTR_HOST | (caps.gpuDirect ? NCCL_PTR_CUDA : 0);
}

}  // namespace nccl
}  // namespace scape
