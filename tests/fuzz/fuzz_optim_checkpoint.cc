// libFuzzer target: the optimizer checkpoint loader (scapeOptimLoad) on a one-rank
// communicator, as a damaged or hostile checkpoint file would reach it. The optimizer must
// either load it or refuse it with an error, and stay usable (a save after a refused load
// must still succeed).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "scape/scape.h"

namespace {
scapeComm_t g_comm = nullptr;
scapeOptim_t g_optim = nullptr;
std::vector<uint8_t> g_buf;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("SCAPE_SOCKET_IFNAME", "lo", 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("SCAPE_LOG_LEVEL", "none", 0);
  scapeUniqueId id;
  if (scapeGetUniqueId(&id) != scapeSuccess) std::abort();
  if (scapeCommInitRank(&g_comm, 1, id, 0) != scapeSuccess) std::abort();
  scapeOptimConfig_t cfg;
  if (scapeOptimConfigInit(&cfg) != scapeSuccess) std::abort();
  static const uint64_t offs[] = {0, 64, 100, 1000};
  static const uint8_t dense[] = {1, 0, 0};
  cfg.n = 1000;
  cfg.nsegments = 3;
  cfg.segOffsets = offs;
  cfg.denseFlags = dense;
  if (scapeOptimCreate(&g_optim, &cfg, g_comm) != scapeSuccess) std::abort();
  size_t bytes = 0;
  if (scapeOptimCheckpointSize(g_optim, &bytes) != scapeSuccess) std::abort();
  g_buf.resize(bytes + 4096);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)scapeOptimLoad(g_optim, data, size);
  size_t written = 0;
  if (scapeOptimSave(g_optim, g_buf.data(), g_buf.size(), &written) != scapeSuccess) std::abort();
  return 0;
}
