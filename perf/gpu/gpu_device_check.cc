// One rank of the device data-path check (perf/gpu/gpu_check.sh, step "device"): the library's
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
// 2. NCCL backend (scapeCommInitNccl on a real ncclComm_t, NCCL going through whatever net
//    NCCL picked: the script forces our plugin with distinct NCCL_HOSTIDs): every collective
//    on integer-valued floats (exact in any order) checked element by element; then a dense
//    all-reduce of N floats and a values-only exchange of k = N/100 packed floats, timed.
// 3. On both backends, the mask calls with device buffers (CheckMasked): top-k from a device
//    statistic, pack/unpack, the packed collectives and the masked dense-in/out all-reduce,
//    each against the same call on host buffers; the masked all-reduce at density 0.01 timed
//    against the dense one.
// 4. On both backends, the optimizer step on device buffers against the host step
//    (CheckOptim): bit for bit (NCCL: up to 2 ranks; the same params on every rank above);
//    the SCAPE step timed (NCCL: also the density-1.0 step).
// Rank 0 prints "RESULT key value" lines; the exit status is 0 only if every check passed.
// Ids travel through files in DIR (rank 0 writes, the others poll, within TIMEOUT_S).
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../common/gpu_rank_util.h"
#include "scape/scape.h"

namespace {

using gpu_check::g_rank;
using gpu_check::Now;
double g_deadline = 0;  // PublishOrRead waits until then
// The fixed sizes of the collective and optimizer checks. The dry run (perf/gpu/run.sh
// --dry-run: this source linked against perf/gpu/fake_cudart.cc and the fake libnccl, whose
// messages are at most 1 MiB a rank) sets GPU_CHECK_DRY=1 for smaller ones.
size_t g_collN = 1000003;
uint64_t g_optimN = (uint64_t{1} << 20) + 3;
int g_fail = 0;
void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "rank %d: CHECK FAILED: %s\n", g_rank, what);
    ++g_fail;
  } else if (g_rank == 0) {
    std::printf("ok: %s\n", what);
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
  // cudaMemcpy from pageable memory may return before its DMA has landed, and cudaMemset is
  // asynchronous: both run on the legacy default stream, which a non-blocking stream does not
  // wait for. Without a device-wide sync here the collective read stale device memory (seen
  // on the first GPU run: wrong results whenever no pinned allocation happened to sync).
  CUDA_OK(cudaDeviceSynchronize());
  SCAPE_OK(Run(c, ds, dr, n, comm, stream), comm);
  StreamWait(stream, comm, kNames[c]);
  CUDA_OK(cudaMemcpy(got.data(), dr, recvN * 4, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(got.data(), ref.data(), recvN * 4) == 0;
  if (!same) {
    size_t first = 0;
    while (first < recvN && std::memcmp(&got[first], &ref[first], 4) == 0) ++first;
    std::fprintf(stderr, "rank %d: %s n=%zu: first difference at %zu of %zu: got %.9g, want %.9g\n",
                 g_rank, kNames[c], n, first, recvN, got[first], ref[first]);
  }
  if (n == 1) {
    // Every rank (collective): the same call again, with the device idle before it. Tells a
    // result that depends on what ran before (stages, events) from one that is always wrong.
    CUDA_OK(cudaMemset(dr, 0xff, recvN * 4));
    CUDA_OK(cudaDeviceSynchronize());
    SCAPE_OK(Run(c, ds, dr, n, comm, stream), comm);
    StreamWait(stream, comm, kNames[c]);
    std::vector<float> again(recvN);
    CUDA_OK(cudaMemcpy(again.data(), dr, recvN * 4, cudaMemcpyDeviceToHost));
    if (!same || std::memcmp(again.data(), ref.data(), recvN * 4) != 0)
      std::fprintf(stderr, "rank %d: %s n=%zu: first call %s, the same call again %s\n", g_rank,
                   kNames[c], n, same ? "right" : "wrong",
                   std::memcmp(again.data(), ref.data(), recvN * 4) == 0 ? "right" : "wrong");
  }
  char what[160];
  std::snprintf(what, sizeof(what), "%s: %s of %zu fp32 on device buffers %s", backend, kNames[c],
                n, compareWithHost ? "gives the host collective's bits" : "is exact");
  Check(same, what);
  CUDA_OK(cudaFree(ds));
  CUDA_OK(cudaFree(dr));
}

// In CheckMasked: a failing call fails the check and ends the section (on every rank alike:
// what fails here is the same on every rank), instead of exiting and leaving peers waiting.
#define SOFT_OK(x, comm)                                                      \
  do {                                                                        \
    scapeResult_t _r = (x);                                                   \
    if (_r != scapeSuccess) {                                                 \
      std::fprintf(stderr, "rank %d: CHECK FAILED: %s: %s: %s\n", g_rank, #x, \
                   scapeGetErrorString(_r), scapeGetLastError(comm));         \
      ++g_fail;                                                               \
      return;                                                                 \
    }                                                                         \
  } while (0)

// Device buffers and a device statistic through the mask calls, against the same calls on host
// buffers of the same communicator: top-k selection from a device statistic (same mask),
// pack/unpack, the packed all-reduce / reduce-scatter / all-gather and the masked dense-in/out
// all-reduce (same bits). Integer-valued floats, so any reduction order gives the same sums
// (the NCCL backend reduces in NCCL's order). Then the masked all-reduce at density 0.01 is
// timed against the dense all-reduce on device buffers.
void CheckMasked(scapeComm_t comm, cudaStream_t stream, int P, size_t n, int iters,
                 const char* backend) {
  const uint64_t offs[4] = {0, n / 3, n / 3 + n / 4 + 1, n};
  scapeMask_t mh = nullptr, md = nullptr;  // selected from a host / a device statistic
  // Destroyed on every way out (a failed check returns early; the communicator's destroy
  // refuses while masks exist).
  struct MaskGuard {
    scapeMask_t* a;
    scapeMask_t* b;
    ~MaskGuard() {
      if (*a) scapeMaskDestroy(*a);
      if (*b) scapeMaskDestroy(*b);
    }
  } guard{&mh, &md};
  SOFT_OK(
      scapeMaskCreate(&mh, n, 3, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, comm),
      comm);
  SOFT_OK(
      scapeMaskCreate(&md, n, 3, offs, nullptr, scapeOwnershipShards, scapeMaskEncodingAuto, comm),
      comm);
  std::mt19937 rng(4321u + 7u * static_cast<unsigned>(g_rank));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> stat(n);
  for (auto& x : stat) x = nd(rng);
  float* dstat = nullptr;
  CUDA_OK(cudaMalloc(&dstat, n * 4));
  CUDA_OK(cudaMemcpy(dstat, stat.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());
  SOFT_OK(scapeMaskSelectNextTopk(mh, stat.data(), 0.01), comm);
  SOFT_OK(scapeMaskSelectNextTopk(md, dstat, 0.01), comm);
  for (scapeMask_t m : {mh, md}) {
    SOFT_OK(scapeMaskSyncStart(m), comm);
    SOFT_OK(scapeMaskSyncWait(m), comm);
    SOFT_OK(scapeMaskAdvance(m), comm);
  }
  uint64_t k = 0, kd = 0, kr = 0, off = 0;
  SOFT_OK(scapeMaskGetCount(mh, &k), comm);
  SOFT_OK(scapeMaskGetCount(md, &kd), comm);
  SOFT_OK(scapeMaskGetRankCount(mh, g_rank, &kr, &off), comm);
  std::vector<uint64_t> ih(k), id(kd);
  SOFT_OK(scapeMaskGetIndices(mh, ih.data(), k), comm);
  SOFT_OK(scapeMaskGetIndices(md, id.data(), kd), comm);
  char what[200];
  std::snprintf(what, sizeof what, "%s: top-k from a device statistic selects the host's mask",
                backend);
  Check(ih == id, what);

  // Inputs: integer-valued floats; dense buffers of n, packed ones of k.
  auto vals = [&](size_t count, unsigned salt) {
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i)
      v[i] =
          static_cast<float>((i * 13 + salt * 7 + static_cast<size_t>(g_rank) * 5) % 2001) - 1000.f;
    return v;
  };
  const std::vector<float> dense = vals(n, 1), packed = vals(k, 2), part = vals(kr, 3);
  float *dd = nullptr, *dd2 = nullptr, *dp = nullptr, *dp2 = nullptr;
  CUDA_OK(cudaMalloc(&dd, n * 4 + 4));
  CUDA_OK(cudaMalloc(&dd2, n * 4 + 4));
  CUDA_OK(cudaMalloc(&dp, k * 4 + 4));
  CUDA_OK(cudaMalloc(&dp2, k * 4 + 4));
  auto up = [&](float* d, const std::vector<float>& h) {
    if (!h.empty()) CUDA_OK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  };
  auto down = [&](const float* d, size_t count) {
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<float> h(count);
    if (count) CUDA_OK(cudaMemcpy(h.data(), d, count * 4, cudaMemcpyDeviceToHost));
    return h;
  };
  auto fill = [&](float* d, size_t count) {
    CUDA_OK(cudaMemset(d, 0x7f, count * 4));
    CUDA_OK(cudaDeviceSynchronize());
  };
  // Pack / unpack (default stream).
  {
    std::vector<float> hp(k, -1.f);
    SOFT_OK(scapeMaskPack(mh, dense.data(), hp.data(), scapeFloat32), comm);
    up(dd, dense);
    fill(dp, k);
    SOFT_OK(scapeMaskPack(mh, dd, dp, scapeFloat32), comm);
    CUDA_OK(cudaDeviceSynchronize());
    std::snprintf(what, sizeof what, "%s: scapeMaskPack on device buffers gives the host's bits",
                  backend);
    Check(down(dp, k) == hp, what);
    std::vector<float> hu = vals(n, 4);
    std::vector<float> du = hu;
    SOFT_OK(scapeMaskUnpack(mh, packed.data(), hu.data(), scapeFloat32), comm);
    up(dd2, du);
    up(dp, packed);
    CUDA_OK(cudaDeviceSynchronize());
    SOFT_OK(scapeMaskUnpack(mh, dp, dd2, scapeFloat32), comm);
    CUDA_OK(cudaDeviceSynchronize());
    std::snprintf(what, sizeof what, "%s: scapeMaskUnpack on device buffers gives the host's bits",
                  backend);
    Check(down(dd2, n) == hu, what);
  }
  // Packed collectives.
  {
    std::vector<float> ha(k), hr(kr), hg(k);
    SOFT_OK(scapeMaskAllReducePacked(packed.data(), ha.data(), scapeFloat32, scapeSum, mh, comm,
                                     nullptr),
            comm);
    SOFT_OK(
        scapeMaskReduceScatter(packed.data(), hr.data(), scapeFloat32, scapeSum, mh, comm, nullptr),
        comm);
    SOFT_OK(scapeMaskAllGather(part.data(), hg.data(), scapeFloat32, mh, comm, nullptr), comm);
    up(dp, packed);
    fill(dp2, k);
    SOFT_OK(scapeMaskAllReducePacked(dp, dp2, scapeFloat32, scapeSum, mh, comm, stream), comm);
    StreamWait(stream, comm, "packed all-reduce");
    std::snprintf(what, sizeof what,
                  "%s: packed all-reduce on device buffers gives the host's bits", backend);
    Check(down(dp2, k) == ha, what);
    fill(dp2, k);
    SOFT_OK(scapeMaskReduceScatter(dp, dp2, scapeFloat32, scapeSum, mh, comm, stream), comm);
    StreamWait(stream, comm, "packed reduce-scatter");
    std::snprintf(what, sizeof what,
                  "%s: packed reduce-scatter on device buffers gives the host's bits", backend);
    Check(down(dp2, kr) == hr, what);
    up(dp, part);
    fill(dp2, k);
    SOFT_OK(scapeMaskAllGather(dp, dp2, scapeFloat32, mh, comm, stream), comm);
    StreamWait(stream, comm, "packed all-gather");
    std::snprintf(what, sizeof what,
                  "%s: packed all-gather on device buffers gives the host's bits", backend);
    Check(down(dp2, k) == hg, what);
  }
  // Masked dense-in/out all-reduce.
  {
    std::vector<float> hout = vals(n, 5);
    std::vector<float> dout0 = hout;
    SOFT_OK(scapeAllReduce(dense.data(), hout.data(), n, scapeFloat32, scapeSum, mh, comm, nullptr),
            comm);
    up(dd, dense);
    up(dd2, dout0);
    CUDA_OK(cudaDeviceSynchronize());
    SOFT_OK(scapeAllReduce(dd, dd2, n, scapeFloat32, scapeSum, mh, comm, stream), comm);
    StreamWait(stream, comm, "masked all-reduce");
    std::snprintf(what, sizeof what,
                  "%s: masked (dense-in/out) all-reduce on device buffers gives the host's bits",
                  backend);
    Check(down(dd2, n) == hout, what);
    // Timing: masked all-reduce (density 0.01) vs dense all-reduce, both on device buffers.
    auto timeIt = [&](scapeMask_t m) -> double {
      if (scapeAllReduce(dd, dd2, n, scapeFloat32, scapeSum, m, comm, stream) != scapeSuccess)
        return -1;
      StreamWait(stream, comm, "warm-up");
      const double t0 = Now();
      for (int i = 0; i < iters; ++i)
        if (scapeAllReduce(dd, dd2, n, scapeFloat32, scapeSum, m, comm, stream) != scapeSuccess)
          return -1;
      StreamWait(stream, comm, "timed");
      return (Now() - t0) * 1e3 / iters;
    };
    const double masked = timeIt(mh), full = timeIt(nullptr);
    if (g_rank == 0) {
      std::printf("RESULT %s_masked_allreduce_d0.01_ms %.3f\n", backend, masked);
      std::printf("RESULT %s_dense_allreduce_ms %.3f\n", backend, full);
      std::printf("RESULT %s_masked_over_dense %.3f\n", backend, masked / full);
    }
  }
  CUDA_OK(cudaFree(dd));
  CUDA_OK(cudaFree(dd2));
  CUDA_OK(cudaFree(dp));
  CUDA_OK(cudaFree(dp2));
  CUDA_OK(cudaFree(dstat));
  (void)P;
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

// The optimizer step on device buffers (scapeOptimStepStream) against the host step
// (scapeOptimStep) on the same communicator, both ownerships, 10 steps of fresh gradients on
// n = 2^20 + 3 floats in four segments (one dense). Up to 2 ranks the device params and the
// whole checkpoint must be the host step's bits after every step (UCX at any rank count; NCCL
// up to 2 ranks: a sum of two values does not depend on its order, and NCCL's fp average of
// two is exact scaling); with more ranks NCCL's reduction order differs from the host ring's,
// so there the check is that every rank holds the same params. Then the SCAPE step (density
// 0.01) on N floats, timed to stream completion (median of up to 5), and on NCCL the
// density-1.0 step (step 6 of gpu_check.sh times it on UCX).
void CheckOptim(scapeComm_t comm, cudaStream_t stream, int P, size_t N, int iters,
                const char* label, bool nccl) {
  const bool exact = !nccl || P <= 2;
  iters = std::min(iters, 5);
  char what[160];
  auto make = [&](uint64_t n, const std::vector<uint64_t>& offs, const std::vector<uint8_t>& dense,
                  int own, double density) {
    scapeOptimConfig_t c;
    SCAPE_OK(scapeOptimConfigInit(&c), comm);
    c.n = n;
    c.nsegments = static_cast<int>(offs.size() - 1);
    c.segOffsets = offs.data();
    c.denseFlags = dense.empty() ? nullptr : dense.data();
    c.ownership = own;
    c.lr = 1e-3f;
    c.weightDecay = 0.1f;
    c.biasCorrection = scapeBiasCorrectionAdamS;
    c.density = density;
    scapeOptim_t o = nullptr;
    SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
    return o;
  };
  auto save = [&](scapeOptim_t o) {
    size_t bytes = 0, written = 0;
    SCAPE_OK(scapeOptimCheckpointSize(o, &bytes), comm);
    std::vector<uint8_t> b(bytes);
    SCAPE_OK(scapeOptimSave(o, b.data(), b.size(), &written), comm);
    return b;
  };
  const uint64_t n = g_optimN;
  const std::vector<uint64_t> offs{0, n / 7, n / 7 + 4099, n / 2, n};
  const std::vector<uint8_t> dense{0, 1, 0, 0};
  float *dp = nullptr, *dg = nullptr;
  CUDA_OK(cudaMalloc(&dp, 4 * std::max<size_t>(n, N)));
  CUDA_OK(cudaMalloc(&dg, 4 * std::max<size_t>(n, N)));
  for (int own : {scapeOptimReplicated, scapeOptimSharded}) {
    scapeOptim_t host = make(n, offs, dense, own, 0.01), dev = make(n, offs, dense, own, 0.01);
    std::vector<float> hp(n), g(n), back(n), all(exact ? 0 : n * P);
    std::mt19937 prng(4242);
    std::uniform_real_distribution<float> pu(-1.0f, 1.0f);
    for (float& x : hp) x = pu(prng);
    CUDA_OK(cudaMemcpy(dp, hp.data(), 4 * n, cudaMemcpyHostToDevice));
    bool ok = true;
    for (int t = 0; t < 10 && ok; ++t) {
      std::mt19937 rng(977u * static_cast<unsigned>(t) + static_cast<unsigned>(g_rank));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (float& x : g) x = nd(rng);
      SCAPE_OK(scapeOptimStep(host, hp.data(), g.data(), n), comm);
      CUDA_OK(cudaMemcpyAsync(dg, g.data(), 4 * n, cudaMemcpyHostToDevice, stream));
      SCAPE_OK(scapeOptimStepStream(dev, dp, dg, n, stream), comm);
      CUDA_OK(cudaMemcpyAsync(back.data(), dp, 4 * n, cudaMemcpyDeviceToHost, stream));
      StreamWait(stream, comm, "optimizer step");
      if (exact) {
        ok = std::memcmp(back.data(), hp.data(), 4 * n) == 0 && save(dev) == save(host);
      } else {
        SCAPE_OK(scapeAllGather(back.data(), all.data(), n, scapeFloat32, comm, nullptr), comm);
        for (int r = 1; r < P; ++r)
          ok = ok && std::memcmp(all.data(), all.data() + n * r, 4 * n) == 0;
      }
    }
    std::snprintf(what, sizeof(what), "%s: optimizer step on device, %s, 10 steps: %s", label,
                  own == scapeOptimReplicated ? "replicated" : "sharded",
                  exact ? "the host step's params and checkpoint, bit for bit"
                        : "the same params on every rank");
    Check(ok, what);
    SCAPE_OK(scapeOptimDestroy(host), comm);
    SCAPE_OK(scapeOptimDestroy(dev), comm);
  }
  // Timing on N floats: the SCAPE step against the density-1.0 step (the same kernels on every
  // element and a dense exchange; an upper bound for a dense AdamS step).
  CUDA_OK(cudaMemset(dg, 0, 4 * N));
  CUDA_OK(cudaMemset(dp, 0, 4 * N));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint64_t> offsN{0, N / 7, N / 2, N - N / 5, N};
  for (double d : {0.01, 1.0}) {
    if (d == 1.0 && !nccl) break;
    scapeOptim_t o = make(N, offsN, {}, scapeOptimReplicated, d);
    for (int w = 0; w < 3; ++w) SCAPE_OK(scapeOptimStepStream(o, dp, dg, N, stream), comm);
    StreamWait(stream, comm, "optimizer warm-up");
    std::vector<double> ms;
    for (int i = 0; i < iters; ++i) {
      const double t0 = Now();
      SCAPE_OK(scapeOptimStepStream(o, dp, dg, N, stream), comm);
      StreamWait(stream, comm, "optimizer timed");
      ms.push_back((Now() - t0) * 1e3);
    }
    std::sort(ms.begin(), ms.end());
    if (g_rank == 0 && !ms.empty())
      std::printf("RESULT %s_optim_%s_step_ms %.4f\n", label, d < 1.0 ? "scape_d0.01" : "d1.0",
                  ms[ms.size() / 2]);
    SCAPE_OK(scapeOptimDestroy(o), comm);
  }
  CUDA_OK(cudaFree(dp));
  CUDA_OK(cudaFree(dg));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s RANK NRANKS DIR N ITERS TIMEOUT_S\n", argv[0]);
    return 1;
  }
  g_rank = std::atoi(argv[1]);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines survive a kill by the script's timeout
  const int P = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const size_t N = std::strtoull(argv[4], nullptr, 0);
  const int iters = std::atoi(argv[5]);
  g_deadline = Now() + std::atof(argv[6]);
  if (const char* dry = std::getenv("GPU_CHECK_DRY"); dry && *dry == '1') {
    g_collN = 50021;
    g_optimN = 65539;
  }
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
  gpu_check::PublishOrRead(dir + "/scape_id", &sid, g_deadline);
  scapeComm_t ucx = nullptr;
  SCAPE_OK(scapeCommInitRank(&ucx, P, sid, g_rank), nullptr);
  for (Coll c : {kAR, kRS, kAG, kBC})
    for (size_t n : {size_t{1}, g_collN}) CheckColl(c, n, P, ucx, stream, false, true, "UCX");
  CheckColl(kAR, 1, P, ucx, stream, false, true, "UCX (after a large broadcast)");
  {
    // The call enqueues: it returns while a long kernel-free wait holds the stream.
    float* d = nullptr;
    CUDA_OK(cudaMalloc(&d, N * 4));
    CUDA_OK(cudaMemset(d, 0, N * 4));
    CUDA_OK(cudaDeviceSynchronize());  // the legacy-stream memset, before the stream uses d
    // A first call of this size allocates its pinned stages (cudaHostAlloc: milliseconds per
    // 64 MB); the enqueue time is that of a warm call, as in a training loop.
    SCAPE_OK(scapeAllReduce(d, d, N, scapeFloat32, scapeSum, nullptr, ucx, stream), ucx);
    StreamWait(stream, ucx, "warm-up all-reduce");
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
  CheckMasked(ucx, stream, P, N, iters, "UCX");
  CheckOptim(ucx, stream, P, N, iters, "UCX", false);
  SCAPE_OK(scapeCommDestroy(ucx), ucx);

  // ---- 2. NCCL backend ------------------------------------------------------------------
  ncclUniqueId nid;
  if (g_rank == 0 && ncclGetUniqueId(&nid) != ncclSuccess) return 2;
  gpu_check::PublishOrRead(dir + "/nccl_id", &nid, g_deadline);
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
    for (size_t n : {size_t{1}, g_collN}) CheckColl(c, n, P, sc, stream, true, false, "NCCL");
  CheckMasked(sc, stream, P, N, iters, "NCCL");
  CheckOptim(sc, stream, P, N, iters, "NCCL", true);
  {
    float *d = nullptr, *dr = nullptr;
    CUDA_OK(cudaMalloc(&d, N * 4));
    CUDA_OK(cudaMalloc(&dr, N * 4));
    CUDA_OK(cudaMemset(d, 0, N * 4));
    CUDA_OK(cudaDeviceSynchronize());  // the legacy-stream memset, before the stream uses d
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
  SCAPE_OK(scapeCommDestroy(sc), sc);
  ncclCommDestroy(nc);
  CUDA_OK(cudaStreamDestroy(stream));
  if (g_rank == 0) std::printf("RESULT device_checks_failed %d\n", g_fail);
  return g_fail ? 5 : 0;
}
