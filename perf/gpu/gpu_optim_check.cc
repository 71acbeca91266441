// One rank of the optimizer-step check on a real GPU: scapeOptimStepStream (the SCAPE-AdamS
// step on CUDA device buffers, enqueued on a stream) against scapeOptimStep on host buffers.
//
//   gpu_optim_check RANK NRANKS DIR N [DENSITY [STEPS [TIMED [PAYLOAD [OWNERSHIP]]]]]
//
// OWNERSHIP: replicated (default) or sharded (the owners' (param, momentum) pairs all-gathered
// on the stream: the device runs the host step's sharded algorithm and must match its bits).
// PAYLOAD: the optimizers' payloadType, f32 (default), bf16, f16, e4m3 or e5m2 (issue 33: the
// scale agreed and the conversions run on the device); both parts use it. With
// bf16/f16 the device step keeps the payload's rounding error in the residual as the host step
// does, so the bits must match as for f32. Given, rank 0 also prints RESULT payload.
//
// 1. Bits: a host optimizer and a device optimizer with the same config take STEPS (default 20)
//    steps on the same fresh random gradients (per rank and step; params the same on every
//    rank); after each step the device params are copied back and compared with the host
//    params bit for bit, and at the end the whole checkpoints (momentum, residual, this rank's
//    current and next mask). Prints RESULT optim_bits_match 0|1 and optim_max_abs_diff.
// 2. Time: TIMED (default 20) device steps of the SCAPE step at DENSITY (default 0.01) and of a
//    dense AdamS step (the same call with every segment always dense: no top-k, every value
//    exchanged and updated), each timed to stream completion, and the dense all-reduce of the
//    n fp32 values alone. RESULT scape_step_ms, dense_step_ms, dense_allreduce_ms.
// Rank 0 prints the RESULT lines; exit status 0 only if the bits matched. Ids travel through
// files in DIR (rank 0 writes, the others poll, 60 s). Build (as perf/gpu/gpu_check.sh builds its
// checks):
//   g++ -std=c++17 -O2 -o gpu_optim_check perf/gpu/gpu_optim_check.cc -Iinclude -Ibuild/include
//     -I$CUDA/include -Lbuild/lib -lnccl-net-scape -L$CUDA/lib64 -lcudart -Wl,-rpath,build/lib
#include <cuda_runtime.h>
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

int g_payload = scapeFloat32;
int g_ownership = scapeOptimReplicated;

// allDense: every segment always dense (the dense AdamS step through the same call).
scapeOptim_t Create(scapeComm_t comm, uint64_t n, const std::vector<uint64_t>& offs, double density,
                    bool allDense = false) {
  scapeOptimConfig_t c;
  SCAPE_OK(scapeOptimConfigInit(&c), comm);
  c.n = n;
  c.nsegments = static_cast<int>(offs.size() - 1);
  c.segOffsets = offs.data();
  const std::vector<uint8_t> dense(offs.size() - 1, 1);
  if (allDense) c.denseFlags = dense.data();
  c.lr = 1e-3f;
  c.weightDecay = 0.1f;
  c.biasCorrection = scapeBiasCorrectionAdamS;
  c.density = density;
  c.payloadType = g_payload;
  c.ownership = g_ownership;
  scapeOptim_t o = nullptr;
  SCAPE_OK(scapeOptimCreate(&o, &c, comm), comm);
  return o;
}

std::vector<uint8_t> Save(scapeOptim_t o, scapeComm_t comm) {
  size_t bytes = 0, written = 0;
  SCAPE_OK(scapeOptimCheckpointSize(o, &bytes), comm);
  std::vector<uint8_t> b(bytes);
  SCAPE_OK(scapeOptimSave(o, b.data(), b.size(), &written), comm);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr,
                 "usage: %s RANK NRANKS DIR N [DENSITY [STEPS [TIMED [f32|bf16|f16|e4m3|e5m2 "
                 "[replicated|sharded]]]]]\n",
                 argv[0]);
    return 1;
  }
  g_rank = std::atoi(argv[1]);
  const int P = std::atoi(argv[2]);
  const std::string dir = argv[3];
  const uint64_t n = std::strtoull(argv[4], nullptr, 10);
  const double density = argc > 5 ? std::atof(argv[5]) : 0.01;
  const int steps = argc > 6 ? std::atoi(argv[6]) : 20;
  const int timed = argc > 7 ? std::atoi(argv[7]) : 20;
  const std::string payload = argc > 8 ? argv[8] : "f32";
  if (payload == "f32") {
    g_payload = scapeFloat32;
  } else if (payload == "bf16") {
    g_payload = scapeBfloat16;
  } else if (payload == "f16") {
    g_payload = scapeFloat16;
  } else if (payload == "e4m3") {
    g_payload = scapeFloat8E4M3;
  } else if (payload == "e5m2") {
    g_payload = scapeFloat8E5M2;
  } else {
    std::fprintf(stderr, "PAYLOAD %s: f32, bf16, f16, e4m3 or e5m2\n", payload.c_str());
    return 1;
  }
  const std::string own = argc > 9 ? argv[9] : "replicated";
  if (own == "replicated") {
    g_ownership = scapeOptimReplicated;
  } else if (own == "sharded") {
    g_ownership = scapeOptimSharded;
  } else {
    std::fprintf(stderr, "OWNERSHIP %s: replicated or sharded\n", own.c_str());
    return 1;
  }
  if (n == 0 || P < 1 || g_rank < 0 || g_rank >= P) return 1;

  CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  scapeUniqueId sid;
  if (g_rank == 0) SCAPE_OK(scapeGetUniqueId(&sid), nullptr);
  gpu_check::PublishOrRead(dir + "/scape_optim_id", &sid, Now() + 60);
  scapeComm_t comm = nullptr;
  SCAPE_OK(scapeCommInitRank(&comm, P, sid, g_rank), nullptr);

  // Four segments of uneven sizes.
  std::vector<uint64_t> offs{0, n / 7, n / 2, n - n / 5, n};

  // ---- 1. bits ----------------------------------------------------------------------------
  scapeOptim_t host = Create(comm, n, offs, density), dev = Create(comm, n, offs, density);
  std::vector<float> hp(n), g(n), back(n);
  std::mt19937 prng(12345);
  std::uniform_real_distribution<float> pu(-1.0f, 1.0f);
  for (float& x : hp) x = pu(prng);
  float *dp = nullptr, *dg = nullptr;
  CUDA_OK(cudaMalloc(&dp, 4 * n));
  CUDA_OK(cudaMalloc(&dg, 4 * n));
  CUDA_OK(cudaMemcpy(dp, hp.data(), 4 * n, cudaMemcpyHostToDevice));
  bool match = true;
  double maxDiff = 0.0;
  for (int t = 0; t < steps; ++t) {
    std::mt19937 rng(1000u * static_cast<unsigned>(t) + static_cast<unsigned>(g_rank));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& x : g) x = nd(rng);
    SCAPE_OK(scapeOptimStep(host, hp.data(), g.data(), n), comm);
    CUDA_OK(cudaMemcpyAsync(dg, g.data(), 4 * n, cudaMemcpyHostToDevice, stream));
    SCAPE_OK(scapeOptimStepStream(dev, dp, dg, n, stream), comm);
    CUDA_OK(cudaMemcpyAsync(back.data(), dp, 4 * n, cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    if (std::memcmp(back.data(), hp.data(), 4 * n) != 0) {
      if (match && g_rank == 0) std::printf("step %d: params differ\n", t);
      match = false;
    }
    for (uint64_t i = 0; i < n; ++i)
      maxDiff = std::max(maxDiff, std::fabs(static_cast<double>(back[i]) - hp[i]));
  }
  const bool stateMatch = Save(host, comm) == Save(dev, comm);
  match = match && stateMatch;
  if (g_rank == 0) {
    std::printf("RESULT optim_bits_match %d\n", match ? 1 : 0);
    std::printf("RESULT optim_state_match %d\n", stateMatch ? 1 : 0);
    std::printf("RESULT optim_max_abs_diff %.9g\n", maxDiff);
  }
  SCAPE_OK(scapeOptimDestroy(host), comm);
  SCAPE_OK(scapeOptimDestroy(dev), comm);

  // ---- 2. time: SCAPE step vs dense AdamS step (every segment dense), on device -------------
  // Rank 0 prints the median of `timed` calls of `call` (each to stream completion) after 3
  // untimed ones, as RESULT <name> in ms.
  auto median = [&](const char* name, auto&& call) {
    std::vector<double> ms;
    for (int i = 0; i < 3 + timed; ++i) {
      const double t0 = Now();
      call();
      CUDA_OK(cudaStreamSynchronize(stream));
      if (i >= 3) ms.push_back((Now() - t0) * 1e3);
    }
    std::sort(ms.begin(), ms.end());
    if (g_rank == 0) std::printf("RESULT %s %.4f\n", name, ms[ms.size() / 2]);
  };
  if (timed > 0) {  // TIMED 0: the bits only
    for (bool allDense : {false, true}) {
      scapeOptim_t o = Create(comm, n, offs, density, allDense);
      median(allDense ? "dense_step_ms" : "scape_step_ms",
             [&] { SCAPE_OK(scapeOptimStepStream(o, dp, dg, n, stream), comm); });
      SCAPE_OK(scapeOptimDestroy(o), comm);
    }
    // The dense exchange alone: an all-reduce (average) of the n fp32 values, as the dense
    // step's exchange moves them.
    float* dr = nullptr;
    CUDA_OK(cudaMalloc(&dr, 4 * n));
    median("dense_allreduce_ms", [&] {
      SCAPE_OK(scapeAllReduce(dg, dr, n, scapeFloat32, scapeAvg, nullptr, comm, stream), comm);
    });
    CUDA_OK(cudaFree(dr));
  }
  if (g_rank == 0) {
    std::printf("RESULT n %llu\nRESULT nranks %d\nRESULT density %g\n",
                static_cast<unsigned long long>(n), P, density);
    if (argc > 8) std::printf("RESULT payload %s\n", payload.c_str());
  }
  CUDA_OK(cudaFree(dp));
  CUDA_OK(cudaFree(dg));
  SCAPE_OK(scapeCommDestroy(comm), comm);
  return match ? 0 : 1;
}
