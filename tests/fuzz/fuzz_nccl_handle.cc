// libFuzzer target: the NCCL plugin's 128-byte listen handle as a connecting peer receives it
// (NCCL copies it between ranks: a corrupted or foreign handle must be refused, never used).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "plugin/nccl/ucx_engine.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint8_t handle[scape::ucxnet::kHandleBytes];
  std::memset(handle, 0, sizeof(handle));
  std::memcpy(handle, data, size < sizeof(handle) ? size : sizeof(handle));
  std::string peer;
  if (scape::ucxnet::ValidateConnectHandle(handle, &peer).ok() && peer.empty()) std::abort();
  return 0;
}
