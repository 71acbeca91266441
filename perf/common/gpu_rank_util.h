// perf/common: what the GPU check programs (perf/gpu/gpu_device_check.cc,
// perf/gpu/gpu_optim_check.cc) share. Each runs as one process per rank on one GPU, started by
// perf/gpu/gpu_check.sh; rank 0 publishes ids (scapeUniqueId, ncclUniqueId) as files in a directory
// the others poll.
//
// CUDA_OK(x) and SCAPE_OK(x, comm) end the process (exit 2 and 3) with the rank, the call and
// the error (the communicator's last error for SCAPE_OK); they name gpu_check::g_rank, which
// main sets first.
#ifndef SCAPE_PERF_COMMON_GPU_RANK_UTIL_H_
#define SCAPE_PERF_COMMON_GPU_RANK_UTIL_H_

#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "scape/scape.h"

namespace gpu_check {

inline int g_rank = 0;

// Seconds on a monotonic clock.
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Rank 0 writes *v to `path` (through a temp file and a rename, so a reader never sees half of
// it); the other ranks poll for it until `deadline` (a Now() value), then exit 2.
template <typename T>
void PublishOrRead(const std::string& path, T* v, double deadline) {
  if (g_rank == 0) {
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f || std::fwrite(v, sizeof(T), 1, f) != 1 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      std::exit(2);
    }
    return;
  }
  for (;;) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f) {
      const size_t got = std::fread(v, sizeof(T), 1, f);
      std::fclose(f);
      if (got == 1) return;
    }
    if (Now() > deadline) {
      std::fprintf(stderr, "rank %d: nothing in %s\n", g_rank, path.c_str());
      std::exit(2);
    }
    usleep(10000);
  }
}

}  // namespace gpu_check

#define CUDA_OK(x)                                                                                \
  do {                                                                                            \
    cudaError_t _e = (x);                                                                         \
    if (_e != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "rank %d: %s:%d: %s: %s\n", gpu_check::g_rank, __FILE__, __LINE__, #x, \
                   cudaGetErrorString(_e));                                                       \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
#define SCAPE_OK(x, comm)                                                  \
  do {                                                                     \
    scapeResult_t _r = (x);                                                \
    if (_r != scapeSuccess) {                                              \
      std::fprintf(stderr, "rank %d: %s: %s: %s\n", gpu_check::g_rank, #x, \
                   scapeGetErrorString(_r), scapeGetLastError(comm));      \
      std::exit(3);                                                        \
    }                                                                      \
  } while (0)

#endif  // SCAPE_PERF_COMMON_GPU_RANK_UTIL_H_
