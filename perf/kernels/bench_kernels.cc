// Google Benchmark for the CPU kernels at 64 Mi fp32 elements, with the memory limits measured
// in the same run:
//   BM_Memcpy      multi-threaded memcpy of 256 MiB (bytes counted: read + write)
//   BM_ReadPass    multi-threaded sum over 256 MiB with software prefetch (one read pass: the
//                  top-k reference)
// Kernel rows report counters:
//   must_move_GB   bytes the kernel must move (reads + writes, no cache effects)
//   limit_ms       must_move / memcpy bandwidth (fused kernels) or one read pass (top-k)
//   x_limit        measured time / limit_ms (the targets: <= 2 for the fused kernels, <= 3 for
//                  top-k)
// Naive top-k: |x| copied to a scratch vector, std::nth_element for the threshold, then a
// collection pass (ties broken by lower index), single-threaded like std::nth_element.
// Run: scape_kernels_bench [--benchmark_filter=...]; perf/RESULTS_kernels.md has the figures.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cpu/gather.h"
#include "kernels/cpu/mask_codec.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/topk.h"

namespace {

using namespace scape::kernels;  // NOLINT

constexpr size_t kN = size_t{64} << 20;  // 64 Mi elements
constexpr double kDensity = 0.01;

// ParallelRun reports a worker that threw; these workers do not throw, so a failure would mean
// a share of the data was not produced: stop rather than measure it.
template <typename F>
void RunOrDie(int nt, F&& f) {
  if (!detail::ParallelRun(nt, std::forward<F>(f))) {
    std::fprintf(stderr, "bench_kernels: a worker thread failed\n");
    std::abort();
  }
}

// A set-up kernel call must succeed, or the benchmark would time garbage.
bool SetupOk(benchmark::State& st, KernelStatus s, const char* what) {
  if (s == KernelStatus::kOk) return true;
  st.SkipWithError(what);
  return false;
}

// Fast deterministic approximately-normal data (sum of 4 uniforms, scaled).
std::vector<float> Normalish(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  const int nt = detail::KernelThreads(0);
  RunOrDie(nt, [&](int t) {
    uint64_t s =
        seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(t) * 0xbf58476d1ce4e5b9ull + 1;
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    for (size_t i = b; i < e; ++i) {
      float acc = 0;
      for (int q = 0; q < 4; ++q) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        acc += static_cast<float>(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
      }
      v[i] = acc * 1.7320508f;
    }
  });
  return v;
}

struct Data {
  std::vector<float> a, b, c, d;
  std::vector<uint32_t> mask;
  std::vector<float> payload;
  double memcpy_gbps = 0;  // (read + write) bytes per second / 1e9
  double read_pass_ms = 0;
};

void ParallelCopy(float* dst, const float* src, size_t n) {
  const int nt = detail::KernelThreads(0);
  RunOrDie(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    std::memcpy(dst + b, src + b, (e - b) * sizeof(float));
  });
}

double ParallelSum(const float* x, size_t n) {
  const int nt = detail::KernelThreads(0);
  std::vector<double> part(static_cast<size_t>(nt));
  RunOrDie(nt, [&](int t) {
    const size_t b = detail::ChunkBegin(n, nt, t), e = detail::ChunkBegin(n, nt, t + 1);
    float acc[16] = {};
    size_t i = b;
    for (; i + 16 <= e; i += 16) {
      __builtin_prefetch(x + i + 1024);  // as the kernels do: the fastest read pass here
      for (int q = 0; q < 16; ++q) acc[q] += x[i + q];
    }
    float s = 0;
    for (; i < e; ++i) s += x[i];
    for (float a : acc) s += a;
    part[static_cast<size_t>(t)] = s;
  });
  double s = 0;
  for (double p : part) s += p;
  return s;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

Data& D() {
  static Data* d = [] {
    Data* x = new Data;
    x->a = Normalish(kN, 1);
    x->b = Normalish(kN, 2);
    x->c = Normalish(kN, 3);
    x->d.assign(kN, 0.0f);
    std::mt19937_64 rng(7);
    std::bernoulli_distribution pick(kDensity);
    for (size_t i = 0; i < kN; ++i) {
      if (pick(rng)) x->mask.push_back(static_cast<uint32_t>(i));
    }
    x->payload.assign(x->mask.size(), 0.01f);
    // Limits, best of 5 (after a warm-up).
    double best_copy = 1e9, best_read = 1e9;
    volatile double sink = 0;
    for (int r = 0; r < 6; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      ParallelCopy(x->d.data(), x->a.data(), kN);
      auto t1 = std::chrono::steady_clock::now();
      sink = sink + ParallelSum(x->b.data(), kN);
      auto t2 = std::chrono::steady_clock::now();
      if (r > 0) {
        best_copy = std::min(best_copy, Seconds(t0, t1));
        best_read = std::min(best_read, Seconds(t1, t2));
      }
    }
    x->memcpy_gbps = 2.0 * kN * sizeof(float) / best_copy / 1e9;
    x->read_pass_ms = best_read * 1e3;
    return x;
  }();
  return *d;
}

void Report(benchmark::State& st, double must_move_bytes, double limit_ms) {
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * must_move_bytes));
  st.counters["must_move_GB"] = must_move_bytes / 1e9;
  st.counters["limit_ms"] = limit_ms;
}

// Time per iteration measured by the benchmark itself, as a ratio to the limit.
void Ratio(benchmark::State& st, double limit_ms, double total_s) {
  const double per_iter_ms = total_s * 1e3 / static_cast<double>(st.iterations());
  st.counters["x_limit"] = per_iter_ms / limit_ms;
}

void BM_Memcpy(benchmark::State& st) {
  Data& d = D();
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    ParallelCopy(d.d.data(), d.a.data(), kN);
    total += Seconds(t0, std::chrono::steady_clock::now());
  }
  const double bytes = 2.0 * kN * sizeof(float);
  Report(st, bytes, bytes / (d.memcpy_gbps * 1e9) * 1e3);
  Ratio(st, bytes / (d.memcpy_gbps * 1e9) * 1e3, total);
  st.counters["memcpy_GBps"] = d.memcpy_gbps;
}

void BM_ReadPass(benchmark::State& st) {
  Data& d = D();
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(ParallelSum(d.a.data(), kN));
    total += Seconds(t0, std::chrono::steady_clock::now());
  }
  Report(st, kN * sizeof(float), d.read_pass_ms);
  Ratio(st, d.read_pass_ms, total);
}

void BM_CandidatePackResidual(benchmark::State& st) {
  Data& d = D();
  const bool with_c = st.range(0) != 0;
  const size_t k = d.mask.size();
  std::vector<float> payload(k);
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    auto s = CandidatePackResidual(d.a.data(), d.b.data(), d.c.data(), kN, 0.9f, d.mask.data(), k,
                                   scapeFloat32, payload.data(), with_c ? d.d.data() : nullptr);
    total += Seconds(t0, std::chrono::steady_clock::now());
    if (s != KernelStatus::kOk) st.SkipWithError("kernel failed");
  }
  // Read m, g, e; write e (and c); read the mask, write the payload.
  const double bytes = (with_c ? 20.0 : 16.0) * kN + 8.0 * k;
  const double limit = bytes / (d.memcpy_gbps * 1e9) * 1e3;
  Report(st, bytes, limit);
  Ratio(st, limit, total);
}

void BM_UnpackAdamSUpdate(benchmark::State& st) {
  Data& d = D();
  const size_t k = d.mask.size();
  AdamSParams p;
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    auto s = UnpackAdamSUpdate(d.payload.data(), scapeFloat32, d.mask.data(), k, d.d.data(),
                               d.c.data(), kN, p);
    total += Seconds(t0, std::chrono::steady_clock::now());
    if (s != KernelStatus::kOk) st.SkipWithError("kernel failed");
  }
  // Read and write theta, write m (m_{t-1} read at the mask), read mask and payload.
  const double bytes = 12.0 * kN + 12.0 * k;
  const double limit = bytes / (d.memcpy_gbps * 1e9) * 1e3;
  Report(st, bytes, limit);
  Ratio(st, limit, total);
}

void BM_RecoveredGradSqNorm(benchmark::State& st) {
  Data& d = D();
  const size_t k = d.mask.size();
  double total = 0;
  for (auto _ : st) {
    double sq = 0;
    auto t0 = std::chrono::steady_clock::now();
    auto s = RecoveredGradSqNorm(d.payload.data(), scapeFloat32, d.mask.data(), k, d.c.data(), kN,
                                 0.9f, &sq);
    total += Seconds(t0, std::chrono::steady_clock::now());
    benchmark::DoNotOptimize(sq);
    if (s != KernelStatus::kOk) st.SkipWithError("kernel failed");
  }
  const double bytes = 12.0 * k;
  const double limit = bytes / (d.memcpy_gbps * 1e9) * 1e3;
  Report(st, bytes, limit);
  Ratio(st, limit, total);
}

// One segment of 64 Mi (arg 1) or 64 segments of 1 Mi (arg 64).
void BM_Topk(benchmark::State& st) {
  Data& d = D();
  const size_t nseg = static_cast<size_t>(st.range(0));
  const TopkMode mode = st.range(1) ? TopkMode::kSampled : TopkMode::kExact;
  std::vector<uint64_t> off(nseg + 1), k(nseg), oo(nseg + 1), counts(nseg);
  for (size_t s = 0; s <= nseg; ++s) off[s] = kN / nseg * s;
  if (!SetupOk(st, TopkKFromDensity(off.data(), nseg, kDensity, k.data()), "TopkKFromDensity"))
    return;
  std::vector<uint64_t> cap(k);
  if (mode == TopkMode::kSampled) {
    for (auto& c : cap) c *= 2;
  }
  TopkOutOffsets(cap.data(), nseg, oo.data());
  std::vector<uint32_t> out(oo.back());
  TopkSegments sg{off.data(), k.data(), oo.data(), nseg};
  TopkOptions opt;
  opt.mode = mode;
  TopkWorkspace ws;
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    auto s = TopkAbs(d.a.data(), sg, opt, out.data(), counts.data(), &ws);
    total += Seconds(t0, std::chrono::steady_clock::now());
    if (s != KernelStatus::kOk) st.SkipWithError("kernel failed");
  }
  Report(st, kN * sizeof(float), d.read_pass_ms);
  Ratio(st, d.read_pass_ms, total);
  uint64_t got = 0, want = 0;
  for (size_t s = 0; s < nseg; ++s) {
    got += counts[s];
    want += k[s];
  }
  st.counters["k"] = static_cast<double>(want);
  st.counters["k_out/k"] = static_cast<double>(got) / static_cast<double>(want);
}

// The naive baseline: |x| copy + std::nth_element + collection (lower index wins ties).
void BM_TopkNthElement(benchmark::State& st) {
  Data& d = D();
  const size_t k = static_cast<size_t>(std::max(1.0, std::floor(kDensity * kN)));
  std::vector<float> scratch(kN);
  std::vector<uint32_t> out(k);
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < kN; ++i) scratch[i] = std::fabs(d.a[i]);
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(),
                     std::greater<float>());
    const float T = scratch[k - 1];
    size_t gt = 0;
    for (size_t i = 0; i < k; ++i) gt += scratch[i] > T;
    size_t ties = k - gt, w = 0;
    for (size_t i = 0; i < kN && w < k; ++i) {
      const float a = std::fabs(d.a[i]);
      if (a > T || (a == T && ties > 0)) {
        if (a == T) --ties;
        out[w++] = static_cast<uint32_t>(i);
      }
    }
    total += Seconds(t0, std::chrono::steady_clock::now());
    benchmark::DoNotOptimize(out.data());
  }
  Report(st, kN * sizeof(float), d.read_pass_ms);
  Ratio(st, d.read_pass_ms, total);
}

// The pack and unpack of a dense-in/out masked collective (kernels/cpu/gather.h) over the
// 256 MiB buffer, at density 1/Arg(0) with uniformly random sorted indices, single-threaded
// as the library calls them (one rank's share). must_move_GB counts the whole cache line each
// masked element touches (64 bytes: below density 1/16 every element has a line of its own),
// read once for the pack, read and written back for the unpack; ns_per_line = time per
// distinct line touched. Lines at random addresses are bound by memory latency and the core's
// outstanding-miss limit, not by bandwidth, so the fair comparison is with the dense pass
// (BM_Memcpy moves every line, multi-threaded). This is the floor under scapeAllReduce with
// a mask and dense buffers, whatever the exchange costs.
struct IndexSet {
  std::vector<uint64_t> idx;
  std::vector<float> packed;
};
IndexSet& Indices(int inv_density) {
  static std::vector<std::pair<int, IndexSet*>> cache;
  for (auto& c : cache)
    if (c.first == inv_density) return *c.second;
  IndexSet* s = new IndexSet;
  std::mt19937_64 rng(11);
  std::bernoulli_distribution pick(1.0 / inv_density);
  for (size_t i = 0; i < kN; ++i)
    if (pick(rng)) s->idx.push_back(i);
  s->packed.assign(s->idx.size(), 0.5f);
  cache.emplace_back(inv_density, s);
  return *s;
}

double LinesTouched(const std::vector<uint64_t>& idx) {
  double lines = 0;
  uint64_t last = ~uint64_t{0};
  for (uint64_t i : idx) {
    const uint64_t line = i / 16;  // 16 floats per 64-byte line
    lines += line != last;
    last = line;
  }
  return lines * 64.0;
}

void BM_MaskGather(benchmark::State& st) {
  Data& d = D();
  IndexSet& s = Indices(static_cast<int>(st.range(0)));
  const double bytes = LinesTouched(s.idx);
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    GatherByIndex(d.a.data(), s.idx.data(), s.idx.size(), sizeof(float), s.packed.data());
    total += Seconds(t0, std::chrono::steady_clock::now());
    benchmark::DoNotOptimize(s.packed.data());
  }
  st.SetBytesProcessed(static_cast<int64_t>(static_cast<double>(st.iterations()) * bytes));
  st.counters["must_move_GB"] = bytes / 1e9;
  st.counters["k"] = static_cast<double>(s.idx.size());
  st.counters["ns_per_line"] =
      total * 1e9 / static_cast<double>(st.iterations()) / (LinesTouched(s.idx) / 64.0);
}

void BM_MaskScatter(benchmark::State& st) {
  Data& d = D();
  IndexSet& s = Indices(static_cast<int>(st.range(0)));
  const double bytes = 2 * LinesTouched(s.idx);
  double total = 0;
  for (auto _ : st) {
    auto t0 = std::chrono::steady_clock::now();
    ScatterByIndex(s.packed.data(), s.idx.data(), s.idx.size(), sizeof(float), d.d.data());
    total += Seconds(t0, std::chrono::steady_clock::now());
    benchmark::DoNotOptimize(d.d.data());
  }
  st.SetBytesProcessed(static_cast<int64_t>(static_cast<double>(st.iterations()) * bytes));
  st.counters["must_move_GB"] = bytes / 1e9;
  st.counters["k"] = static_cast<double>(s.idx.size());
  st.counters["ns_per_line"] =
      total * 1e9 / static_cast<double>(st.iterations()) / (LinesTouched(s.idx) / 64.0);
}

// The mask codecs (kernels/cpu/mask_codec.h) as the mask sync uses them: one rank's owned
// part of 16 Mi elements (a 64 Mi buffer over 4 ranks) at density 1/Arg(1), encoded with
// encoding Arg(0) (1 bitmap, 2 Elias-Fano, 3 delta+varint) and decoded with full validation.
// ns_per_index = time / k. BM_MaskVarintSize is the size query the auto encoding runs on
// every sync.
struct CodecData {
  std::vector<uint64_t> idx;
  std::vector<uint8_t> enc;
  std::vector<uint64_t> out;
};
constexpr uint64_t kOwned = uint64_t{16} << 20;
std::vector<uint64_t> OwnedIndices(int inv_density) {
  std::vector<uint64_t> idx;
  std::mt19937_64 rng(13);
  std::bernoulli_distribution pick(1.0 / inv_density);
  for (uint64_t i = 0; i < kOwned; ++i)
    if (pick(rng)) idx.push_back(i);
  return idx;
}

void BM_MaskEncode(benchmark::State& st) {
  const MaskEncoding enc = static_cast<MaskEncoding>(st.range(0));
  const std::vector<uint64_t> idx = OwnedIndices(static_cast<int>(st.range(1)));
  uint64_t bytes = 0;
  if (!SetupOk(st, MaskEncodedBytes(enc, idx.data(), idx.size(), kOwned, &bytes),
               "MaskEncodedBytes"))
    return;
  std::vector<uint8_t> buf(bytes);
  for (auto _ : st) {
    size_t w = 0;
    if (MaskEncode(enc, idx.data(), idx.size(), kOwned, buf.data(), buf.size(), &w) !=
        KernelStatus::kOk)
      st.SkipWithError("MaskEncode failed");
    benchmark::DoNotOptimize(buf.data());
  }
  st.counters["k"] = static_cast<double>(idx.size());
  st.counters["bytes"] = static_cast<double>(bytes);
  st.counters["ns_per_index"] = benchmark::Counter(
      static_cast<double>(idx.size()),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_MaskDecode(benchmark::State& st) {
  const MaskEncoding enc = static_cast<MaskEncoding>(st.range(0));
  const std::vector<uint64_t> idx = OwnedIndices(static_cast<int>(st.range(1)));
  uint64_t bytes = 0;
  if (!SetupOk(st, MaskEncodedBytes(enc, idx.data(), idx.size(), kOwned, &bytes),
               "MaskEncodedBytes"))
    return;
  std::vector<uint8_t> buf(bytes);
  size_t w = 0;
  if (!SetupOk(st, MaskEncode(enc, idx.data(), idx.size(), kOwned, buf.data(), buf.size(), &w),
               "MaskEncode"))
    return;
  std::vector<uint64_t> out(idx.size());
  for (auto _ : st) {
    size_t got = 0;
    if (MaskDecode(buf.data(), buf.size(), kOwned, out.data(), out.size(), &got) !=
            KernelStatus::kOk ||
        got != idx.size())
      st.SkipWithError("MaskDecode failed");
    benchmark::DoNotOptimize(out.data());
  }
  if (out != idx) st.SkipWithError("decoded indices differ");
  st.counters["k"] = static_cast<double>(idx.size());
  st.counters["ns_per_index"] = benchmark::Counter(
      static_cast<double>(idx.size()),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_MaskVarintSize(benchmark::State& st) {
  const std::vector<uint64_t> idx = OwnedIndices(static_cast<int>(st.range(0)));
  for (auto _ : st) benchmark::DoNotOptimize(DeltaVarintEncodedBytes(idx.data(), idx.size()));
  st.counters["k"] = static_cast<double>(idx.size());
  st.counters["ns_per_index"] = benchmark::Counter(
      static_cast<double>(idx.size()),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReadPass)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CandidatePackResidual)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_UnpackAdamSUpdate)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RecoveredGradSqNorm)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Topk)
    ->Args({1, 0})
    ->Args({64, 0})
    ->Args({1, 1})
    ->Args({64, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_TopkNthElement)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MaskGather)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MaskScatter)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MaskEncode)
    ->ArgsProduct({{1, 2, 3}, {10, 100}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_MaskDecode)
    ->ArgsProduct({{1, 2, 3}, {10, 100}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_MaskVarintSize)->Arg(10)->Arg(100)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
