// scape-perf --mode step: the whole SCAPE-AdamS optimizer step (scapeOptimStep) on one flat
// buffer of fp32 parameters, beside the dense AdamS step (dense all-reduce of g + one fused
// AdamS pass) and the dense AdamW step (the same with the second moment), in the same run.
//
// Per size (-b/-e: bytes of fp32 parameters, so 256M is 64 Mi parameters) and density (-D):
// three rows, "optimizer" scape / adams / adamw. The SCAPE row carries the library's phase
// times (scapeOptimInfo_t.phaseSeconds), the exchange alone (a values-only all-reduce of the
// same mask's payload), and the step's byte floor: the bytes its element-wise passes must move
// at the memcpy bandwidth measured in this run, plus the exchange alone. The payload type is -d
// (float, bfloat16 or half). Every time is the slowest rank's mean over -n steps, after -w
// (at least 2: the first step is dense by construction) untimed ones. With -c the parameters
// are checked to be identical on every rank after the timed steps (#wrong = ranks that differ).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "perf/scape_perf/bench.h"

namespace scape_perf {
namespace {

struct StepRow {
  const char* optimizer = "";
  uint64_t count = 0, k = 0;
  double density = 1.0;
  double timeUs = 0;      // the whole step
  double exchangeUs = 0;  // the collective alone (in the step, for the dense rows)
  double passUs = 0;      // the element-wise passes (dense rows: the fused update)
  double phaseUs[scapeOptimNumPhases] = {};
  double exchangeAloneUs = 0;  // scape: the values-only all-reduce on its own
  double passBytes = 0;        // bytes the passes must move
  double floorUs = 0;          // passBytes at the memcpy bandwidth + the exchange alone
  double stateBpp = 0;         // optimizer state, bytes per parameter
  uint64_t maskBytes = 0, payloadBytes = 0, denseBytes = 0;
  int64_t wrong = 0;
};

void printColumns(const Bench&) {
  std::printf("# %12s  %7s  %9s  %12s  %11s  %11s  %11s  %11s  %9s  %7s  %6s\n", "count", "density",
              "optimizer", "k", "step", "exchange", "passes", "floor", "state", "speedup",
              "#wrong");
  std::printf("# %12s  %7s  %9s  %12s  %11s  %11s  %11s  %11s  %9s  %7s  %6s\n", "(elements)", "",
              "", "(elements)", "(us)", "(us)", "(us)", "(us)", "(B/param)", "(vs-adams)", "");
}

void printRow(const Options& o, const StepRow& w, double adamsUs) {
  char wr[32];
  if (o.check)
    std::snprintf(wr, sizeof(wr), "%" PRId64, w.wrong);
  else
    std::snprintf(wr, sizeof(wr), "N/A");
  std::printf("  %12" PRIu64 "  %7.4g  %9s  %12" PRIu64
              "  %11.1f  %11.1f  %11.1f  %11.1f  %9.2f  %7.3f  %6s\n",
              w.count, w.density, w.optimizer, w.k, w.timeUs, w.exchangeUs, w.passUs, w.floorUs,
              w.stateBpp, adamsUs > 0 ? adamsUs / w.timeUs : 0.0, wr);
  std::fflush(stdout);
}

std::string jsonFields(const Bench& b, const StepRow& w, double memcpyGBs) {
  static const char* const kPhase[scapeOptimNumPhases] = {
      "sync_wait", "candidate", "select", "exchange", "norm", "update", "gather"};
  std::string s;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "\"mode\": \"step\", \"optimizer\": \"%s\", \"nranks\": %d, \"count\": %" PRIu64
                ", \"density\": %.6g, \"k\": %" PRIu64
                ", \"payload\": \"%s\", "
                "\"out_of_place\": {\"time_us\": %.3f}, \"exchange_us\": %.3f, \"passes_us\": %.3f",
                w.optimizer, b.nranks(), w.count, w.density, w.k, typeName(b.opts().dtype),
                w.timeUs, w.exchangeUs, w.passUs);
  s += buf;
  if (std::strcmp(w.optimizer, "scape") == 0) {
    s += ", \"phases_us\": {";
    for (int p = 0; p < scapeOptimNumPhases; ++p) {
      std::snprintf(buf, sizeof(buf), "%s\"%s\": %.3f", p ? ", " : "", kPhase[p], w.phaseUs[p]);
      s += buf;
    }
    s += "}";
    std::snprintf(buf, sizeof(buf),
                  ", \"bytes_sent\": {\"mask\": %" PRIu64 ", \"payload\": %" PRIu64
                  ", \"dense\": %" PRIu64
                  "}, \"wire_bytes_per_param\": %.5f, \"exchange_alone_us\": %.3f",
                  w.maskBytes, w.payloadBytes, w.denseBytes,
                  static_cast<double>(w.maskBytes + w.payloadBytes + w.denseBytes) /
                      static_cast<double>(std::max<uint64_t>(w.count, 1)),
                  w.exchangeAloneUs);
    s += buf;
  }
  std::snprintf(buf, sizeof(buf),
                ", \"floor\": {\"time_us\": %.3f, \"pass_bytes\": %.0f, \"memcpy_gbps\": %.3f}, "
                "\"state_bytes_per_param\": %.3f, \"wrong\": %" PRId64,
                w.floorUs, w.passBytes, memcpyGBs, w.stateBpp, w.wrong);
  s += buf;
  return s;
}

// Deterministic per-rank gradients and shared initial parameters (cheap to generate).
inline float patternValue(uint64_t x) {
  x = (x ^ (x >> 31)) * 0x7fb5d329728ea185ull;
  x = (x ^ (x >> 27)) * 0x81dadef4bc2dd44dull;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) *
         (1.0f / (1 << 23));
}
void fillGrads(std::vector<float>* g, int rank, int step) {
  const uint64_t salt = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(step) << 40);
  for (size_t i = 0; i < g->size(); ++i) (*g)[i] = 0.01f * patternValue(salt ^ i);
}

// The dense baselines' fused passes (the library's arithmetic order, AdamS without correction).
void adamsPass(const float* __restrict g, float* __restrict theta, float* __restrict m, size_t n,
               float lr, float b1, float b2, float eps, float decay) {
  const float omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  for (size_t i = 0; i < n; ++i) {
    const float mp = m[i], gi = g[i];
    const float mn = (b1 * mp) + (omb1 * gi);
    const float v = (b2 * (mp * mp)) + (omb2 * (gi * gi));
    theta[i] = (theta[i] * decay) - ((lr * mn) / (std::sqrt(v) + eps));
    m[i] = mn;
  }
}
void adamwPass(const float* __restrict g, float* __restrict theta, float* __restrict m,
               float* __restrict v, size_t n, float lr, float b1, float b2, float eps,
               float decay) {
  const float omb1 = 1.0f - b1, omb2 = 1.0f - b2;
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mn = (b1 * m[i]) + (omb1 * gi);
    const float vn = (b2 * v[i]) + (omb2 * (gi * gi));
    theta[i] = (theta[i] * decay) - ((lr * mn) / (std::sqrt(vn) + eps));
    m[i] = mn;
    v[i] = vn;
  }
}

constexpr float kLr = 1e-4f, kB1 = 0.9f, kB2 = 0.95f, kEps = 1e-8f, kWd = 0.1f;

bool sameOnAllRanks(Bench& b, const std::vector<float>& theta, int64_t* wrong) {
  uint64_t h = 1469598103934665603ull;
  for (float f : theta) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = (h ^ u) * 1099511628211ull;
  }
  std::vector<int64_t> all(static_cast<size_t>(b.nranks()));
  int64_t mine = static_cast<int64_t>(h);
  PERF_CHECK(b, "scapeAllGather(parameter hash)",
             scapeAllGather(&mine, all.data(), 1, scapeInt64, b.comm(), nullptr));
  *wrong = 0;
  for (int64_t x : all) *wrong += x != all[0];
  return true;
}

// Mean of the slowest rank: values are per-rank sums over `iters` in ns.
bool slowest(Bench& b, std::vector<int64_t>* ns, int iters) {
  if (!b.reduceI64(ns->data(), ns->size(), scapeMax, "scapeAllReduce(step times, int64, max)"))
    return false;
  for (int64_t& x : *ns) x /= iters;
  return true;
}

bool denseRow(Bench& b, bool adamw, uint64_t n, double memcpyBps, StepRow* w) {
  const Options& o = b.opts();
  const int iters = o.iters, warm = std::max(1, o.warmup);
  std::vector<float> theta(n), g(n), gavg(n), m(n, 0.0f), v;
  if (adamw) v.assign(n, 0.0f);
  for (size_t i = 0; i < n; ++i) theta[i] = patternValue(~uint64_t{0} ^ i);
  const float decay = static_cast<float>(1.0 - static_cast<double>(kLr) * kWd);
  std::vector<int64_t> ns(3, 0);  // step, exchange, pass
  for (int it = 0; it < warm + iters; ++it) {
    fillGrads(&g, b.rank(), it);
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(b.comm()));
    const double t0 = nowSec();
    PERF_CHECK(b, "scapeAllReduce(grads, float, avg)",
               scapeAllReduce(g.data(), gavg.data(), n, scapeFloat32, scapeAvg, nullptr, b.comm(),
                              nullptr));
    const double t1 = nowSec();
    if (adamw)
      adamwPass(gavg.data(), theta.data(), m.data(), v.data(), n, kLr, kB1, kB2, kEps, decay);
    else
      adamsPass(gavg.data(), theta.data(), m.data(), n, kLr, kB1, kB2, kEps, decay);
    const double t2 = nowSec();
    beat();
    if (it >= warm) {
      ns[0] += static_cast<int64_t>((t2 - t0) * 1e9);
      ns[1] += static_cast<int64_t>((t1 - t0) * 1e9);
      ns[2] += static_cast<int64_t>((t2 - t1) * 1e9);
    }
  }
  if (o.check && !sameOnAllRanks(b, theta, &w->wrong)) return false;
  if (!slowest(b, &ns, iters)) return false;
  w->optimizer = adamw ? "adamw" : "adams";
  w->count = n;
  w->k = n;
  w->timeUs = ns[0] / 1e3;
  w->exchangeUs = ns[1] / 1e3;
  w->passUs = ns[2] / 1e3;
  // Reads g, theta, m (AdamW: v), writes theta, m (v).
  w->passBytes = static_cast<double>(n) * (adamw ? 28.0 : 20.0);
  w->floorUs = w->passBytes / memcpyBps * 1e6 + w->exchangeUs;
  w->stateBpp = adamw ? 8.0 : 4.0;
  return true;
}

bool scapeRow(Bench& b, uint64_t n, double density, double memcpyBps, StepRow* w) {
  const Options& o = b.opts();
  const int iters = o.iters, warm = std::max(2, o.warmup);
  // Segments: -s equal sparse tensors and one always-dense tensor of 4096 (a norm) at the end.
  const int nsparse = std::max(1, o.segments);
  const uint64_t dense = std::min<uint64_t>(4096, n / 2);
  std::vector<uint64_t> offs{0};
  for (int s = 1; s <= nsparse; ++s)
    offs.push_back((n - dense) * static_cast<uint64_t>(s) / nsparse);
  offs.push_back(n);
  std::vector<uint8_t> flags(offs.size() - 1, 0);
  flags.back() = 1;
  scapeOptimConfig_t cfg;
  PERF_CHECK(b, "scapeOptimConfigInit", scapeOptimConfigInit(&cfg));
  cfg.n = n;
  cfg.nsegments = static_cast<int>(flags.size());
  cfg.segOffsets = offs.data();
  cfg.denseFlags = flags.data();
  cfg.lr = kLr;
  cfg.beta1 = kB1;
  cfg.beta2 = kB2;
  cfg.eps = kEps;
  cfg.weightDecay = kWd;
  cfg.maxGradNorm = 1.0f;
  cfg.density = density;
  cfg.payloadType = o.dtype;
  cfg.maskEncoding = o.encoding;
  scapeOptim_t opt = nullptr;
  PERF_CHECK(b, "scapeOptimCreate", scapeOptimCreate(&opt, &cfg, b.comm()));
  std::unique_ptr<scapeOptim, scapeResult_t (*)(scapeOptim_t)> guard(opt, scapeOptimDestroy);
  std::vector<float> theta(n), g(n);
  for (size_t i = 0; i < n; ++i) theta[i] = patternValue(~uint64_t{0} ^ i);
  std::vector<int64_t> ns(1 + scapeOptimNumPhases, 0);
  scapeOptimInfo_t info = SCAPE_OPTIM_INFO_INITIALIZER;
  for (int it = 0; it < warm + iters; ++it) {
    fillGrads(&g, b.rank(), it);
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(b.comm()));
    const double t0 = nowSec();
    PERF_CHECK(b, "scapeOptimStep", scapeOptimStep(opt, theta.data(), g.data(), n));
    const double t1 = nowSec();
    beat();
    PERF_CHECK(b, "scapeOptimGetInfo", scapeOptimGetInfo(opt, &info));
    if (it >= warm) {
      ns[0] += static_cast<int64_t>((t1 - t0) * 1e9);
      for (int p = 0; p < scapeOptimNumPhases; ++p)
        ns[1 + static_cast<size_t>(p)] += static_cast<int64_t>(info.phaseSeconds[p] * 1e9);
    }
  }
  if (o.check && !sameOnAllRanks(b, theta, &w->wrong)) return false;
  // The exchange alone: the values-only all-reduce of the same mask's k values.
  scapeMask_t mask = nullptr;
  PERF_CHECK(b, "scapeOptimGetMask", scapeOptimGetMask(opt, &mask));
  uint64_t k = 0;
  PERF_CHECK(b, "scapeMaskGetCount", scapeMaskGetCount(mask, &k));
  const size_t esz = scapeTypeSize(o.dtype);
  std::vector<unsigned char> ps(k * esz + 8, 0), pr(k * esz + 8);
  int64_t exNs = 0;
  for (int it = 0; it < 1 + iters; ++it) {
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(b.comm()));
    const double t0 = nowSec();
    PERF_CHECK(
        b, "scapeMaskAllReducePacked",
        scapeMaskAllReducePacked(ps.data(), pr.data(), o.dtype, scapeAvg, mask, b.comm(), nullptr));
    if (it > 0) exNs += static_cast<int64_t>((nowSec() - t0) * 1e9);
    beat();
  }
  if (!slowest(b, &ns, iters)) return false;
  if (!b.reduceI64(&exNs, 1, scapeMax, "scapeAllReduce(exchange time, int64, max)")) return false;
  w->optimizer = "scape";
  w->count = n;
  w->density = density;
  w->k = k;
  w->timeUs = ns[0] / 1e3;
  for (int p = 0; p < scapeOptimNumPhases; ++p)
    w->phaseUs[p] = ns[1 + static_cast<size_t>(p)] / 1e3;
  w->exchangeUs = w->phaseUs[scapeOptimPhaseExchange];
  w->passUs = w->phaseUs[scapeOptimPhaseCandidate] + w->phaseUs[scapeOptimPhaseUpdate];
  w->exchangeAloneUs = exNs / 1e3 / iters;
  // The passes: candidate reads g, e and writes e (12 B/param) and the owned statistic (4/P);
  // top-k reads the statistic (4/P); the update reads and writes theta (8). Per masked value:
  // the payload is written and read (2 esz), the mask is read twice (16), and the packed
  // momentum (plugin/optim) is read at the old mask, gathered to the new one and updated (12).
  const double P = b.nranks();
  w->passBytes =
      static_cast<double>(n) * (20.0 + 8.0 / P) + static_cast<double>(k) * (2.0 * esz + 28.0);
  w->floorUs = w->passBytes / memcpyBps * 1e6 + w->exchangeAloneUs;
  w->stateBpp = static_cast<double>(info.stateBytes) / static_cast<double>(n);
  w->maskBytes = info.maskBytes;
  w->payloadBytes = info.payloadBytes;
  w->denseBytes = info.denseBytes;
  return true;
}

// memcpy bandwidth of this run, in bytes moved (read + write) per second, slowest rank.
bool memcpyBandwidth(Bench& b, uint64_t n, double* bps) {
  std::vector<float> src(n, 1.0f), dst(n, 0.0f);
  int64_t best = INT64_MAX;
  for (int it = 0; it < 3; ++it) {
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(b.comm()));
    const double t0 = nowSec();
    std::memcpy(dst.data(), src.data(), 4 * n);
    best = std::min<int64_t>(best, static_cast<int64_t>((nowSec() - t0) * 1e9));
    beat();
  }
  if (!b.reduceI64(&best, 1, scapeMax, "scapeAllReduce(memcpy time, int64, max)")) return false;
  *bps = 8.0 * static_cast<double>(n) / (static_cast<double>(std::max<int64_t>(best, 1)) * 1e-9);
  return dst[n / 2] == 1.0f;
}

int runStep(Bench& b) {
  const Options& o = b.opts();
  if (o.dtype == scapeInt32 || o.dtype == scapeInt64) {
    if (b.rank() == 0)
      std::fprintf(stderr,
                   "%s: --mode step: -d must be float, bfloat16, half, f8e4m3 or f8e5m2 (the "
                   "payload)\n",
                   kProg);
    return PERF_EXIT_CALL_FAILED;
  }
  for (uint64_t size : b.sizes()) {
    const uint64_t n = size / 4;  // fp32 parameters
    if (n == 0) continue;
    double bps = 0;
    if (!memcpyBandwidth(b, n, &bps)) return PERF_EXIT_CALL_FAILED;
    StepRow adams, adamw;
    if (!denseRow(b, false, n, bps, &adams) || !denseRow(b, true, n, bps, &adamw))
      return PERF_EXIT_CALL_FAILED;
    b.addCustomRow(jsonFields(b, adams, bps / 1e9), adams.timeUs, adams.wrong);
    b.addCustomRow(jsonFields(b, adamw, bps / 1e9), adamw.timeUs, adamw.wrong);
    if (b.rank() == 0) {
      printRow(o, adams, adams.timeUs);
      printRow(o, adamw, adams.timeUs);
    }
    for (double d : o.densities) {
      StepRow w;
      if (!scapeRow(b, n, d, bps, &w)) return PERF_EXIT_CALL_FAILED;
      b.addCustomRow(jsonFields(b, w, bps / 1e9), w.timeUs, w.wrong);
      if (b.rank() == 0) printRow(o, w, adams.timeUs);
    }
    if (b.rank() == 0)
      std::printf(
          "#   memcpy %.2f GB/s (read+write) per rank; state: scape 4 B/param (residual) + 4 B "
          "per masked value (packed momentum), adams 4, adamw 8 (m, v)\n",
          bps / 1e9);
  }
  return PERF_EXIT_OK;
}

}  // namespace

const ModeDesc kModeStep = {
    "step",
    nullptr,
    "the whole SCAPE-AdamS optimizer step (scapeOptimStep) beside the dense AdamS and\n"
    "AdamW steps; -b/-e are bytes of fp32 parameters, -d the SCAPE payload type",
    kModeDensities | kModeMaskOptions | kModeAllReduceOnly,
    runStep,
    nullptr,
    printColumns,
    "Avg step time (us)",
};

}  // namespace scape_perf
