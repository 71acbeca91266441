#include "transport/bootstrap/host.h"

#include <unistd.h>

#include <fstream>
#include <string>

namespace scape {
namespace bootstrap {

uint64_t HostHash() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string key = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  if (boot >> bootId) key += bootId;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace bootstrap
}  // namespace scape
