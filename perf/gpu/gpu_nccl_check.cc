// One rank of the GPU check (perf/gpu/gpu_nccl_check.sh): a real NCCL all-reduce through whatever
// net plugin NCCL loaded, checked exactly and timed. Host code only (CUDA runtime + NCCL).
//
//   gpu_nccl_check RANK NRANKS ID_FILE BYTES[,BYTES...] [ITERS] [TIMEOUT_S]
//
// Rank 0 writes NCCL's unique id to ID_FILE; the others wait for it. Every NCCL call runs
// non-blocking and is polled with a deadline (ncclCommGetAsyncError), so a hang becomes an
// error and an ncclCommAbort. Prints one "RESULT" line per size (rank 0) and exits non-zero on
// any error or wrong element.
#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double g_deadline = 0;

#define CUDA_OK(x)                                                                             \
  do {                                                                                         \
    cudaError_t _e = (x);                                                                      \
    if (_e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(_e)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

// Waits for a non-blocking NCCL call (or the comm's pending work) to finish.
bool NcclWait(ncclComm_t comm, ncclResult_t r, const char* what) {
  while (r == ncclInProgress || r == ncclSuccess) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &st);
    if (q != ncclSuccess) {
      r = q;
      break;
    }
    if (st == ncclSuccess) return true;
    if (st != ncclInProgress) {
      r = st;
      break;
    }
    if (Now() > g_deadline) {
      std::fprintf(stderr, "%s: timed out\n", what);
      return false;
    }
    usleep(100);
  }
  std::fprintf(stderr, "%s: %s (%s)\n", what, ncclGetErrorString(r), ncclGetLastError(comm));
  return false;
}

// Waits for the stream with a deadline, watching the comm for asynchronous errors.
bool StreamWait(ncclComm_t comm, cudaStream_t s, const char* what) {
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
      return false;
    }
    ncclResult_t st = ncclSuccess;
    ncclCommGetAsyncError(comm, &st);
    if (st != ncclSuccess && st != ncclInProgress) {
      std::fprintf(stderr, "%s: %s (%s)\n", what, ncclGetErrorString(st), ncclGetLastError(comm));
      return false;
    }
    if (Now() > g_deadline) {
      std::fprintf(stderr, "%s: timed out\n", what);
      return false;
    }
    usleep(50);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s RANK NRANKS ID_FILE BYTES[,BYTES...] [ITERS] [TIMEOUT_S]\n",
                 argv[0]);
    return 1;
  }
  const int rank = std::atoi(argv[1]);
  const int nranks = std::atoi(argv[2]);
  const std::string idFile = argv[3];
  std::vector<size_t> sizes;
  for (char* tok = std::strtok(argv[4], ","); tok; tok = std::strtok(nullptr, ","))
    sizes.push_back(std::strtoull(tok, nullptr, 0));
  const int iters = argc > 5 ? std::atoi(argv[5]) : 20;
  const double timeoutS = argc > 6 ? std::atof(argv[6]) : 240;
  g_deadline = Now() + timeoutS;
  if (rank < 0 || rank >= nranks || nranks < 1 || sizes.empty() || iters < 1) {
    std::fprintf(stderr, "bad arguments\n");
    return 1;
  }

  int dev = 0;
  if (const char* d = std::getenv("GPU_CHECK_DEVICE")) dev = std::atoi(d);
  CUDA_OK(cudaSetDevice(dev));

  ncclUniqueId id;
  if (rank == 0) {
    if (ncclGetUniqueId(&id) != ncclSuccess) return 2;
    std::string tmp = idFile + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f || std::fwrite(&id, sizeof(id), 1, f) != 1 || std::fclose(f) != 0) return 2;
    if (std::rename(tmp.c_str(), idFile.c_str()) != 0) return 2;
  } else {
    for (;;) {
      FILE* f = std::fopen(idFile.c_str(), "rb");
      if (f) {
        size_t got = std::fread(&id, sizeof(id), 1, f);
        std::fclose(f);
        if (got == 1) break;
      }
      if (Now() > g_deadline) {
        std::fprintf(stderr, "rank %d: no unique id in %s\n", rank, idFile.c_str());
        return 2;
      }
      usleep(10000);
    }
  }

  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, id, rank, &cfg);
  if (!comm || !NcclWait(comm, r, "ncclCommInitRankConfig")) {
    if (comm) ncclCommAbort(comm);
    return 3;
  }

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  size_t maxBytes = 0;
  for (size_t b : sizes) maxBytes = b > maxBytes ? b : maxBytes;
  size_t maxCount = maxBytes / sizeof(float);
  float *dSend = nullptr, *dRecv = nullptr;
  CUDA_OK(cudaMalloc(&dSend, maxCount * sizeof(float) + 16));
  CUDA_OK(cudaMalloc(&dRecv, maxCount * sizeof(float) + 16));
  std::vector<float> host(maxCount);
  // Small integers: the float sum is exact whatever order NCCL reduces in.
  for (size_t i = 0; i < maxCount; ++i)
    host[i] = static_cast<float>((rank + 1) * static_cast<int>(i % 7 + 1));
  CUDA_OK(cudaMemcpy(dSend, host.data(), maxCount * sizeof(float), cudaMemcpyHostToDevice));
  const float rankSum = static_cast<float>(nranks * (nranks + 1) / 2);

  int failures = 0;
  for (size_t bytes : sizes) {
    size_t count = bytes / sizeof(float);
    CUDA_OK(cudaMemset(dRecv, 0, maxCount * sizeof(float)));
    // Warm-up (also the correctness run).
    r = ncclAllReduce(dSend, dRecv, count, ncclFloat, ncclSum, comm, stream);
    if (!NcclWait(comm, r, "ncclAllReduce") || !StreamWait(comm, stream, "warm-up")) {
      ncclCommAbort(comm);
      return 4;
    }
    CUDA_OK(cudaMemcpy(host.data(), dRecv, count * sizeof(float), cudaMemcpyDeviceToHost));
    size_t bad = 0, firstBad = count;
    for (size_t i = 0; i < count; ++i) {
      float want = rankSum * static_cast<float>(i % 7 + 1);
      if (host[i] != want) {
        if (firstBad == count) firstBad = i;
        ++bad;
      }
    }
    if (bad) {
      std::fprintf(stderr, "rank %d: %zu of %zu elements wrong (first at %zu: %g)\n", rank, bad,
                   count, firstBad, host[firstBad]);
      ++failures;
    }
    cudaEvent_t t0, t1;
    CUDA_OK(cudaEventCreate(&t0));
    CUDA_OK(cudaEventCreate(&t1));
    CUDA_OK(cudaEventRecord(t0, stream));
    for (int it = 0; it < iters; ++it) {
      r = ncclAllReduce(dSend, dRecv, count, ncclFloat, ncclSum, comm, stream);
      if (!NcclWait(comm, r, "ncclAllReduce")) {
        ncclCommAbort(comm);
        return 4;
      }
    }
    CUDA_OK(cudaEventRecord(t1, stream));
    if (!StreamWait(comm, stream, "timed all-reduce")) {
      ncclCommAbort(comm);
      return 4;
    }
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
    double sec = ms / 1000.0 / iters;
    double algbw = static_cast<double>(count * sizeof(float)) / sec / 1e9;
    double busbw = algbw * 2.0 * (nranks - 1) / nranks;
    if (rank == 0)
      std::printf(
          "RESULT bytes=%zu iters=%d time_us=%.1f algbw_GBps=%.3f busbw_GBps=%.3f "
          "wrong_elements=%zu\n",
          count * sizeof(float), iters, sec * 1e6, algbw, busbw, bad);
    std::fflush(stdout);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
  }
  CUDA_OK(cudaFree(dSend));
  CUDA_OK(cudaFree(dRecv));
  r = ncclCommFinalize(comm);
  if (!NcclWait(comm, r, "ncclCommFinalize")) {
    ncclCommAbort(comm);
    return 5;
  }
  ncclCommDestroy(comm);
  cudaStreamDestroy(stream);
  return failures ? 6 : 0;
}
