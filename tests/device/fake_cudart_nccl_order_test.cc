// The dry run's fake pair (perf/gpu/fake_cudart.cc + tests/device/fake_libnccl.cc) when the
// fake libnccl is loaded after the fake runtime, as the library loads NCCL (dlopen, RTLD_LOCAL,
// at scapeCommInitNcclRank / FromEnv) and as gpu_extra_check gets it (it calls no NCCL entry
// point, so the linker's --as-needed leaves fake_libnccl out of its NEEDED). A collective must
// still run in the order of its stream, as real NCCL's: after the copies queued before it, not
// at the call. Here the stream is held by a host function until everything is issued; an
// all-reduce run at the call reads the send buffer before the queued copy fills it (the
// symptom: device optimizer steps on a scapeCommInitNcclRank communicator exchanged stale
// gradients in the dry run).
//
//   fake_cudart_nccl_order_test PATH_TO_FAKE_LIBNCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {

std::atomic<bool> g_release{false};

void CUDART_CB Gate(void*) {  // holds the stream until released (at most 10 s)
  const auto t0 = std::chrono::steady_clock::now();
  while (!g_release.load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

#define OK(x)                                                       \
  do {                                                              \
    if (!(x)) {                                                     \
      std::fprintf(stderr, "FAILED: %s (line %d)\n", #x, __LINE__); \
      return 1;                                                     \
    }                                                               \
  } while (0)

}  // namespace

struct Id {  // ncclUniqueId's layout
  char internal[128];
};

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PATH_TO_FAKE_LIBNCCL\n", argv[0]);
    return 2;
  }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);  // as plugin/device/nccl_comm.cc does
  OK(h != nullptr);
  auto getId = reinterpret_cast<int (*)(Id*)>(dlsym(h, "ncclGetUniqueId"));
  auto init = reinterpret_cast<int (*)(void**, int, Id, int)>(dlsym(h, "ncclCommInitRank"));
  auto allReduce = reinterpret_cast<int (*)(const void*, void*, size_t, int, int, void*, void*)>(
      dlsym(h, "ncclAllReduce"));
  auto destroy = reinterpret_cast<int (*)(void*)>(dlsym(h, "ncclCommDestroy"));
  OK(getId && init && allReduce && destroy);
  Id id;
  void* comm = nullptr;
  OK(getId(&id) == 0);
  OK(init(&comm, 1, id, 0) == 0);  // the shared mode: the work goes where the enqueue hook says

  const size_t n = 4096;
  cudaStream_t s;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  float *dSend = nullptr, *dRecv = nullptr, *src = nullptr, *out = nullptr;
  OK(cudaMalloc(reinterpret_cast<void**>(&dSend), 4 * n) == cudaSuccess);
  OK(cudaMalloc(reinterpret_cast<void**>(&dRecv), 4 * n) == cudaSuccess);
  OK(cudaMallocHost(reinterpret_cast<void**>(&src), 4 * n) == cudaSuccess);
  OK(cudaMallocHost(reinterpret_cast<void**>(&out), 4 * n) == cudaSuccess);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i % 977) + 1.0f;
  std::memset(out, 0, 4 * n);
  OK(cudaMemset(dSend, 0, 4 * n) == cudaSuccess);
  OK(cudaMemset(dRecv, 0, 4 * n) == cudaSuccess);
  OK(cudaDeviceSynchronize() == cudaSuccess);

  OK(cudaLaunchHostFunc(s, Gate, nullptr) == cudaSuccess);
  OK(cudaMemcpyAsync(dSend, src, 4 * n, cudaMemcpyHostToDevice, s) == cudaSuccess);
  OK(allReduce(dSend, dRecv, n, /*ncclFloat32*/ 7, /*ncclSum*/ 0, comm, s) == 0);
  OK(cudaMemcpyAsync(out, dRecv, 4 * n, cudaMemcpyDeviceToHost, s) == cudaSuccess);
  g_release.store(true);
  OK(cudaStreamSynchronize(s) == cudaSuccess);

  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += out[i] != src[i];
  if (bad) {
    std::fprintf(stderr,
                 "FAILED: the all-reduce did not run in stream order (%zu of %zu elements are "
                 "not the values copied before it; out[1] = %g, expected %g): the fake NCCL, "
                 "loaded after the fake runtime, ran it at the call\n",
                 bad, n, out[1], src[1]);
    return 1;
  }
  OK(destroy(comm) == 0);
  cudaFreeHost(src);
  cudaFreeHost(out);
  cudaFree(dSend);
  cudaFree(dRecv);
  std::printf(
      "ok: an all-reduce of the fake NCCL loaded after the fake runtime ran in stream "
      "order\n");
  return 0;
}
