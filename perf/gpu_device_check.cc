// One rank of the device data-path check (perf/gpu_check.sh, step "device"): the library's
// collectives on CUDA device buffers and a CUDA stream, on both backends, checked and timed.
//
//   gpu_device_check RANK NRANKS DIR N ITERS TIMEOUT_S
//
// 1. UCX backend (scapeCommInitRank): device buffers staged through pinned host buffers on the
//    stream. Every collective (all-reduce, reduce-scatter, all-gather, broadcast) on random
//    fp32 values (integer-valued above 2 ranks, where chunking may reorder fp additions) must
//    give the same bits as the same collective on host buffers; the call
//    must return before its stream completes (it enqueues); then the staged all-reduce of N
//    floats is timed against the host all-reduce of the same bytes.
//    Masks on device buffers: top-k of a device statistic, the masked all-reduce, the packed
//    all-reduce and pack/unpack against the host calls, bit for bit; the masked all-reduce
//    enqueues.
// 2. NCCL backend (scapeCommInitNccl on a real ncclComm_t, NCCL going through whatever net
//    NCCL picked: the script forces our plugin with distinct NCCL_HOSTIDs): every collective
//    on integer-valued floats (exact in any order) checked element by element; then a dense
//    all-reduce of N floats and a values-only exchange of k = N/100 packed floats, timed.
// Rank 0 prints "RESULT key value" lines; the exit status is 0 only if every check passed.
// Ids travel through files in DIR (rank 0 writes, the others poll, within TIMEOUT_S).
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "scape/scape.h"

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
double g_deadline = 0;
int g_rank = 0;
int g_fail = 0;

#define CUDA_OK(x)                                                                     \
  do {                                                                                 \
    cudaError_t _e = (x);                                                              \
    if (_e != cudaSuccess) {                                                           \
      std::fprintf(stderr, "rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #x, \
                   cudaGetErrorString(_e));                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)
#define SCAPE_OK(x, comm)                                                                \
  do {                                                                                   \
    scapeResult_t _r = (x);                                                              \
    if (_r != scapeSuccess) {                                                            \
      std::fprintf(stderr, "rank %d: %s: %s: %s\n", g_rank, #x, scapeGetErrorString(_r), \
                   scapeGetLastError(comm));                                             \
      std::exit(3);                                                                      \
    }                                                                                    \
  } while (0)

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: CHECK FAILED: %s\n", g_rank, what);
    ++g_fail;
  } else if (g_rank == 0) {
    std::printf("ok: %s\n", what);
  }
}

template <typename T>
void PublishOrRead(const std::string& path, T* v) {
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
    if (Now() > g_deadline) {
      std::fprintf(stderr, "rank %d: nothing in %s\n", g_rank, path.c_str());
      std::exit(2);
    }
    usleep(10000);
  }
}

void StreamWait(cudaStream_t s, scapeComm_t comm, const char* what) {
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, what, cudaGetErrorString(e));
      std::exit(2);
    }
    scapeResult_t ae = scapeSuccess;
    scapeCommGetAsyncError(comm, &ae);
    if (ae != scapeSuccess) {
      std::fprintf(stderr, "rank %d: %s: %s: %s\n", g_rank, what, scapeGetErrorString(ae),
                   scapeGetLastError(comm));
      std::exit(2);
    }
    if (Now() > g_deadline) {
      std::fprintf(stderr, "rank %d: %s: timed out\n", g_rank, what);
      std::exit(2);
    }
    usleep(20);
  }
}

enum Coll { kAR, kRS, kAG, kBC };
const char* kNames[] = {"all-reduce", "reduce-scatter", "all-gather", "broadcast"};

scapeResult_t Run(Coll c, const void* s, void* r, size_t n, scapeComm_t comm, void* stream) {
  switch (c) {
    case kAR:
      return scapeAllReduce(s, r, n, scapeFloat32, scapeSum, nullptr, comm, stream);
    case kRS:
      return scapeReduceScatter(s, r, n, scapeFloat32, scapeSum, comm, stream);
    case kAG:
      return scapeAllGather(s, r, n, scapeFloat32, comm, stream);
    default:
      return scapeBroadcast(s, r, n, scapeFloat32, 0, comm, stream);
  }
}

// Device collective vs host collective (UCX) or vs the exact expectation (NCCL, integer values).
void CheckColl(Coll c, size_t n, int P, scapeComm_t comm, cudaStream_t stream, bool integer,
               bool compareWithHost, const char* backend) {
  const size_t sendN = c == kRS ? P * n : n, recvN = c == kAG ? P * n : n;
  std::mt19937 rng(1234u + 77u * static_cast<unsigned>(g_rank) + static_cast<unsigned>(c));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> in(sendN), ref(recvN, 0.f), got(recvN, -1.f);
  for (size_t i = 0; i < sendN; ++i)
    in[i] = integer ? static_cast<float>((i * 7 + static_cast<size_t>(g_rank) * 3) % 1001)
            : P > 2 ? std::round(nd(rng) * 1000.f)  // exact sums in any order (chunked staging)
                    : nd(rng);
  if (compareWithHost) {
    std::vector<float> hin = in;
    SCAPE_OK(Run(c, hin.data(), ref.data(), n, comm, nullptr), comm);
  } else {  // exact expectation of integer values
    for (size_t i = 0; i < recvN; ++i) {
      double v = 0;
      auto val = [&](int r, size_t j) {
        return static_cast<double>((j * 7 + static_cast<size_t>(r) * 3) % 1001);
      };
      if (c == kAR)
        for (int r = 0; r < P; ++r) v += val(r, i);
      if (c == kRS)
        for (int r = 0; r < P; ++r) v += val(r, static_cast<size_t>(g_rank) * n + i);
      if (c == kAG) v = val(static_cast<int>(i / n), i % n);
      if (c == kBC) v = val(0, i);
      ref[i] = static_cast<float>(v);
    }
  }
  float *ds = nullptr, *dr = nullptr;
  CUDA_OK(cudaMalloc(&ds, sendN * 4 + 4));
  CUDA_OK(cudaMalloc(&dr, recvN * 4 + 4));
  CUDA_OK(cudaMemcpy(ds, in.data(), sendN * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dr, 0xff, recvN * 4));
  CUDA_OK(cudaStreamSynchronize(stream));
  SCAPE_OK(Run(c, ds, dr, n, comm, stream), comm);
  StreamWait(stream, comm, kNames[c]);
  CUDA_OK(cudaMemcpy(got.data(), dr, recvN * 4, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(got.data(), ref.data(), recvN * 4) == 0;
  char what[160];
  std::snprintf(what, sizeof(what), "%s: %s of %zu fp32 on device buffers %s", backend, kNames[c],
                n, compareWithHost ? "gives the host collective's bits" : "is exact");
  Check(same, what);
  CUDA_OK(cudaFree(ds));
  CUDA_OK(cudaFree(dr));
}

// Masks on device buffers (UCX backend): top-k of a device statistic selects the host's mask;
// the masked all-reduce, the packed all-reduce and pack/unpack give the host calls' bits; the
// masked all-reduce enqueues (returns while its stream is held).
void CheckMasks(scapeComm_t comm, cudaStream_t stream) {
  const uint64_t n = 1000003;
  const uint64_t offs[] = {0, n / 3, n / 3 + 1, n};
  const uint8_t dense[] = {0, 1, 0};
  std::mt19937 rng(4321u);  // the same statistic on every rank
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> stat(n);
  for (auto& x : stat) x = nd(rng);
  float* dstat = nullptr;
  CUDA_OK(cudaMalloc(&dstat, n * 4));
  CUDA_OK(cudaMemcpy(dstat, stat.data(), n * 4, cudaMemcpyHostToDevice));
  scapeMask_t m[2] = {nullptr, nullptr};
  std::vector<uint64_t> idx[2];
  for (int which = 0; which < 2; ++which) {
    SCAPE_OK(scapeMaskCreate(&m[which], n, 3, offs, dense, scapeOwnershipShards,
                             scapeMaskEncodingAuto, comm),
             comm);
    SCAPE_OK(scapeMaskSelectNextTopk(m[which], which ? dstat : stat.data(), 0.01), comm);
    SCAPE_OK(scapeMaskSyncStart(m[which]), comm);
    SCAPE_OK(scapeMaskSyncWait(m[which]), comm);
    SCAPE_OK(scapeMaskAdvance(m[which]), comm);
    uint64_t k = 0;
    SCAPE_OK(scapeMaskGetCount(m[which], &k), comm);
    idx[which].resize(k);
    SCAPE_OK(scapeMaskGetIndices(m[which], idx[which].data(), k), comm);
  }
  Check(idx[0] == idx[1] && !idx[0].empty(),
        "UCX masks: top-k of a device statistic selects the host statistic's mask");
  SCAPE_OK(scapeMaskDestroy(m[0]), comm);
  scapeMask_t mask = m[1];
  const size_t k = idx[1].size();
  std::mt19937 vr(99u + static_cast<unsigned>(g_rank));
  std::vector<float> in(n), junk(n), hr(n), got(n);
  for (auto& x : in) x = nd(vr);
  for (auto& x : junk) x = nd(vr);
  float *ds = nullptr, *dr = nullptr, *dp = nullptr;
  CUDA_OK(cudaMalloc(&ds, n * 4));
  CUDA_OK(cudaMalloc(&dr, n * 4));
  CUDA_OK(cudaMalloc(&dp, k * 4 + 4));
  // The masked (dense-in/out) all-reduce: recvbuf starts as junk; outside the mask it stays.
  hr = junk;
  SCAPE_OK(scapeAllReduce(in.data(), hr.data(), n, scapeFloat32, scapeSum, mask, comm, nullptr),
           comm);
  CUDA_OK(cudaMemcpy(ds, in.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dr, junk.data(), n * 4, cudaMemcpyHostToDevice));
  SCAPE_OK(scapeAllReduce(ds, dr, n, scapeFloat32, scapeSum, mask, comm, stream), comm);
  StreamWait(stream, comm, "masked all-reduce");
  CUDA_OK(cudaMemcpy(got.data(), dr, n * 4, cudaMemcpyDeviceToHost));
  Check(std::memcmp(got.data(), hr.data(), n * 4) == 0,
        "UCX masks: masked all-reduce on device buffers gives the host call's bits");
  // The packed all-reduce of k values (the first k of `in`), in place.
  std::vector<float> hp(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(k)), gp(k);
  SCAPE_OK(
      scapeMaskAllReducePacked(hp.data(), hp.data(), scapeFloat32, scapeSum, mask, comm, nullptr),
      comm);
  CUDA_OK(cudaMemcpy(dp, in.data(), k * 4, cudaMemcpyHostToDevice));
  SCAPE_OK(scapeMaskAllReducePacked(dp, dp, scapeFloat32, scapeSum, mask, comm, stream), comm);
  StreamWait(stream, comm, "packed all-reduce");
  CUDA_OK(cudaMemcpy(gp.data(), dp, k * 4, cudaMemcpyDeviceToHost));
  Check(std::memcmp(gp.data(), hp.data(), k * 4) == 0,
        "UCX masks: packed all-reduce on device buffers gives the host call's bits");
  // Pack / unpack on the default stream (cudaMemcpy on the legacy stream waits for them).
  SCAPE_OK(scapeMaskPack(mask, in.data(), hp.data(), scapeFloat32), comm);
  SCAPE_OK(scapeMaskPack(mask, ds, dp, scapeFloat32), comm);
  CUDA_OK(cudaMemcpy(gp.data(), dp, k * 4, cudaMemcpyDeviceToHost));
  bool same = std::memcmp(gp.data(), hp.data(), k * 4) == 0;
  hr = junk;
  SCAPE_OK(scapeMaskUnpack(mask, hp.data(), hr.data(), scapeFloat32), comm);
  CUDA_OK(cudaMemcpy(dr, junk.data(), n * 4, cudaMemcpyHostToDevice));
  SCAPE_OK(scapeMaskUnpack(mask, dp, dr, scapeFloat32), comm);
  CUDA_OK(cudaMemcpy(got.data(), dr, n * 4, cudaMemcpyDeviceToHost));
  same = same && std::memcmp(got.data(), hr.data(), n * 4) == 0;
  Check(same, "UCX masks: pack / unpack on device buffers give the host calls' bits");
  // Enqueue and return: the masked all-reduce returns while a host function holds the stream.
  volatile int* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(const_cast<int**>(&flag)), 4, 0));
  *flag = 0;
  CUDA_OK(cudaLaunchHostFunc(
      stream,
      [](void* f) {
        while (!*static_cast<volatile int*>(f)) usleep(100);
      },
      const_cast<int*>(flag)));
  SCAPE_OK(scapeAllReduce(ds, dr, n, scapeFloat32, scapeSum, mask, comm, stream), comm);
  Check(cudaStreamQuery(stream) == cudaErrorNotReady,
        "UCX masks: a masked all-reduce on device buffers returns before its stream has run");
  *flag = 1;
  StreamWait(stream, comm, "held masked all-reduce");
  CUDA_OK(cudaFreeHost(const_cast<int*>(flag)));
  SCAPE_OK(scapeMaskDestroy(mask), comm);
  CUDA_OK(cudaFree(ds));
  CUDA_OK(cudaFree(dr));
  CUDA_OK(cudaFree(dp));
  CUDA_OK(cudaFree(dstat));
}

// Mean ms per call of `iters` calls enqueued back to back on the stream (device), or blocking
// calls (host).
double TimeColl(const void* s, void* r, size_t n, scapeComm_t comm, cudaStream_t stream, int iters,
                bool device) {
  SCAPE_OK(
      scapeAllReduce(s, r, n, scapeFloat32, scapeSum, nullptr, comm, device ? stream : nullptr),
      comm);
  if (device) StreamWait(stream, comm, "warm-up");
  SCAPE_OK(scapeBarrier(comm), comm);
  const double t0 = Now();
  for (int i = 0; i < iters; ++i)
    SCAPE_OK(
        scapeAllReduce(s, r, n, scapeFloat32, scapeSum, nullptr, comm, device ? stream : nullptr),
        comm);
  if (device) StreamWait(stream, comm, "timed all-reduce");
  return (Now() - t0) * 1e3 / iters;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s RANK NRANKS DIR N ITERS TIMEOUT_S\n", argv[0]);
    return 1;
  }
  g_rank = std::atoi(argv[1]);
  const int P = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const size_t N = std::strtoull(argv[4], nullptr, 0);
  const int iters = std::atoi(argv[5]);
  g_deadline = Now() + std::atof(argv[6]);
  int built = 0, avail = 0;
  SCAPE_OK(scapeGetDeviceSupport(&built, &avail), nullptr);
  if (!built || !avail) {
    std::fprintf(stderr, "rank %d: the library reports CUDA built=%d, device=%d\n", g_rank, built,
                 avail);
    return 4;
  }
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // ---- 1. UCX backend, staged -----------------------------------------------------------
  scapeUniqueId sid;
  if (g_rank == 0) SCAPE_OK(scapeGetUniqueId(&sid), nullptr);
  PublishOrRead(dir + "/scape_id", &sid);
  scapeComm_t ucx = nullptr;
  SCAPE_OK(scapeCommInitRank(&ucx, P, sid, g_rank), nullptr);
  for (Coll c : {kAR, kRS, kAG, kBC})
    for (size_t n : {size_t{1}, size_t{1000003}})
      CheckColl(c, n, P, ucx, stream, false, true, "UCX");
  CheckMasks(ucx, stream);
  {
    // The call enqueues: it returns while a long kernel-free wait holds the stream.
    float* d = nullptr;
    CUDA_OK(cudaMalloc(&d, N * 4));
    CUDA_OK(cudaMemset(d, 0, N * 4));
    volatile int* flag = nullptr;
    CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(const_cast<int**>(&flag)), 4, 0));
    *flag = 0;
    CUDA_OK(cudaLaunchHostFunc(
        stream,
        [](void* f) {
          while (!*static_cast<volatile int*>(f)) usleep(100);
        },
        const_cast<int*>(flag)));
    const double t0 = Now();
    SCAPE_OK(scapeAllReduce(d, d, N, scapeFloat32, scapeSum, nullptr, ucx, stream), ucx);
    const double callMs = (Now() - t0) * 1e3;
    Check(cudaStreamQuery(stream) == cudaErrorNotReady,
          "UCX: a device all-reduce returns before its stream has run (it enqueues)");
    *flag = 1;
    StreamWait(stream, ucx, "held all-reduce");
    if (g_rank == 0) std::printf("RESULT ucx_enqueue_ms %.3f\n", callMs);
    CUDA_OK(cudaFreeHost(const_cast<int*>(flag)));
    // Timing: staged all-reduce of N floats vs the host all-reduce of the same bytes.
    std::vector<float> h(N, 1.f), hr(N);
    float* dr = nullptr;
    CUDA_OK(cudaMalloc(&dr, N * 4));
    const double staged = TimeColl(d, dr, N, ucx, stream, iters, true);
    const double host = TimeColl(h.data(), hr.data(), N, ucx, stream, iters, false);
    if (g_rank == 0) {
      std::printf("RESULT ucx_staged_allreduce_ms %.3f\n", staged);
      std::printf("RESULT ucx_host_allreduce_ms %.3f\n", host);
      std::printf("RESULT ucx_staged_over_host %.3f\n", staged / host);
    }
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(dr));
  }
  SCAPE_OK(scapeCommDestroy(ucx), nullptr);

  // ---- 2. NCCL backend ------------------------------------------------------------------
  ncclUniqueId nid;
  if (g_rank == 0 && ncclGetUniqueId(&nid) != ncclSuccess) return 2;
  PublishOrRead(dir + "/nccl_id", &nid);
  ncclComm_t nc;
  if (ncclCommInitRank(&nc, P, nid, g_rank) != ncclSuccess) {
    std::fprintf(stderr, "rank %d: ncclCommInitRank failed\n", g_rank);
    return 2;
  }
  scapeComm_t sc = nullptr;
  SCAPE_OK(scapeCommInitNccl(&sc, nc, nullptr), nullptr);
  int backend = -1, n2 = 0, r2 = -1;
  SCAPE_OK(scapeCommGetBackend(sc, &backend), sc);
  SCAPE_OK(scapeCommCount(sc, &n2), sc);
  SCAPE_OK(scapeCommUserRank(sc, &r2), sc);
  Check(backend == scapeBackendNccl && n2 == P && r2 == g_rank, "NCCL: backend, size and rank");
  for (Coll c : {kAR, kRS, kAG, kBC})
    for (size_t n : {size_t{1}, size_t{1000003}})
      CheckColl(c, n, P, sc, stream, true, false, "NCCL");
  {
    float *d = nullptr, *dr = nullptr;
    CUDA_OK(cudaMalloc(&d, N * 4));
    CUDA_OK(cudaMalloc(&dr, N * 4));
    CUDA_OK(cudaMemset(d, 0, N * 4));
    auto timeIt = [&](size_t n) {
      SCAPE_OK(scapeAllReduce(d, dr, n, scapeFloat32, scapeSum, nullptr, sc, stream), sc);
      StreamWait(stream, sc, "NCCL warm-up");
      const double t0 = Now();
      for (int i = 0; i < iters; ++i)
        SCAPE_OK(scapeAllReduce(d, dr, n, scapeFloat32, scapeSum, nullptr, sc, stream), sc);
      StreamWait(stream, sc, "NCCL timed");
      return (Now() - t0) * 1e3 / iters;
    };
    const double dense = timeIt(N), packed = timeIt(N / 100 ? N / 100 : 1);
    if (g_rank == 0) {
      std::printf("RESULT nccl_dense_allreduce_ms %.3f\n", dense);
      std::printf("RESULT nccl_packed_1pct_allreduce_ms %.3f\n", packed);
      std::printf("RESULT nccl_packed_over_dense %.3f\n", packed / dense);
    }
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(dr));
  }
  SCAPE_OK(scapeCommDestroy(sc), nullptr);
  ncclCommDestroy(nc);
  CUDA_OK(cudaStreamDestroy(stream));
  if (g_rank == 0) std::printf("RESULT device_checks_failed %d\n", g_fail);
  return g_fail ? 5 : 0;
}
