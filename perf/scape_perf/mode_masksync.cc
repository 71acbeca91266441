// scape-perf --mode masksync (also --mask-sync): the mask synchronisation alone. Per density and
// encoding: encoded bytes, sync time, and the fraction hidden behind an equal compute phase
// (busy: memory work on the calling thread; idle: the thread waits, as a GPU step's host
// thread does). Its own table (scape-perf -h, "masksync columns").
#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <cinttypes>
#include <ctime>

#include "perf/scape_perf/bench.h"
#include "perf/scape_perf/mask_util.h"

namespace scape_perf {
namespace {

// CPU seconds of this process (all threads) and of the calling thread.
double processCpuSec() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}
double threadCpuSec() {
  struct timespec ts {};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Median of a non-empty list (the mean of the middle two for an even count).
int64_t medianI64(std::vector<int64_t> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// Memory work on this thread (the busy compute phase the mask sync hides behind):
// y = 0.999 y + x over two buffers larger than the caches. The phase is a fixed amount of
// work, calibrated to last `sec` when it runs alone, so that CPU the sync takes from it makes
// the phase longer (a phase of fixed length would instead just do less work).
class BusyCompute {
 public:
  BusyCompute() : x_(kElems, 1.0f), y_(kElems, 0.0f) {}
  // Chunks that take `sec` on this thread now (measured by running for `sec`).
  uint64_t calibrate(double sec) {
    const double end = nowSec() + sec;
    uint64_t n = 0;
    do {
      chunk();
      ++n;
    } while (nowSec() < end);
    sink_ += y_[pos_];
    return n;
  }
  void run(uint64_t chunks) {
    for (uint64_t c = 0; c < chunks; ++c) chunk();
    sink_ += y_[pos_];
  }
  float sink() const { return sink_; }

 private:
  static constexpr size_t kElems = size_t{8} << 20;  // 32 MiB per buffer
  static constexpr size_t kChunk = 16384;
  void chunk() {
    float* y = y_.data() + pos_;
    const float* x = x_.data() + pos_;
    for (size_t i = 0; i < kChunk; ++i) y[i] = 0.999f * y[i] + x[i];
    pos_ = (pos_ + kChunk) % kElems;
  }
  std::vector<float> x_, y_;
  size_t pos_ = 0;
  float sink_ = 0;
};

struct SyncRow {
  uint64_t count = 0;
  double density = 0;
  scapeMaskEncoding_t requested = scapeMaskEncodingAuto, sent = scapeMaskEncodingAuto;
  uint64_t k = 0;
  double sentBytes = 0;  // mean over ranks
  uint64_t totalBytes = 0;
  double syncUs = 0, libSyncUs = 0, bothUs = 0, hidden = 0, maskBpp = 0, totalBpp = 0;
  double syncCpuUs = 0;  // CPU time of the background sync (other threads than the caller's)
  double idleUs = 0, hiddenIdle = 0;        // the same overlap with an idle compute phase
  double busyAloneUs = 0, idleAloneUs = 0;  // the compute phases alone, same rounds
  int64_t wrong = 0;
};

void printColumns(const Bench&) {
  std::printf(
      "# %12s  %7s  %11s  %11s  %12s  %12s  %12s  %9s  %10s  %10s  %10s  %6s  %9s  %7s"
      "  %6s  %10s  %10s  %10s  %8s\n",
      "count", "density", "encoding", "sent-as", "k", "sent", "total", "mask", "sync", "busy",
      "overlapped", "hidden", "mask+pay", "dense", "#wrong", "sync-cpu", "idle", "idle-ovl",
      "hid-idle");
  std::printf(
      "# %12s  %7s  %11s  %11s  %12s  %12s  %12s  %9s  %10s  %10s  %10s  %6s  %9s  %7s"
      "  %6s  %10s  %10s  %10s  %8s\n",
      "(elements)", "", "", "(rank 0)", "(elements)", "(B/rank)", "(B)", "(B/param)", "(us)",
      "(us)", "(us)", "", "(B/param)", "(B/param)", "", "(us)", "(us)", "(us)", "");
}

void printRow(const Options& o, const SyncRow& w) {
  char wr[32], hi[32], ia[32], io[32];
  if (o.check)
    std::snprintf(wr, sizeof(wr), "%" PRId64, w.wrong);
  else
    std::snprintf(wr, sizeof(wr), "N/A");
  if (w.hiddenIdle >= 0) {
    std::snprintf(hi, sizeof(hi), "%8.3f", w.hiddenIdle);
    std::snprintf(ia, sizeof(ia), "%10.1f", w.idleAloneUs);
    std::snprintf(io, sizeof(io), "%10.1f", w.idleUs);
  } else {
    std::snprintf(hi, sizeof(hi), "%8s", "N/A");
    std::snprintf(ia, sizeof(ia), "%10s", "N/A");
    std::snprintf(io, sizeof(io), "%10s", "N/A");
  }
  std::printf("  %12" PRIu64 "  %7.4g  %11s  %11s  %12" PRIu64 "  %12.0f  %12" PRIu64
              "  %9.4f  %10.1f  %10.1f  %10.1f  %6.3f  %9.4f  %7.1f  %6s  %10.1f  %s  %s  %s\n",
              w.count, w.density, encodingName(w.requested), encodingName(w.sent), w.k, w.sentBytes,
              w.totalBytes, w.maskBpp, w.syncUs, w.busyAloneUs, w.bothUs, w.hidden, w.totalBpp, 8.0,
              wr, w.syncCpuUs, ia, io, hi);
  std::fflush(stdout);
}

// The row's JSON fields (without the braces).
std::string jsonFields(const Options& o, int nranks, const SyncRow& w) {
  char idleUs[32] = "null", hiddenIdle[32] = "null", idleAloneUs[32] = "null", wrong[32] = "null";
  if (w.hiddenIdle >= 0) {
    std::snprintf(idleUs, sizeof(idleUs), "%.1f", w.idleUs);
    std::snprintf(idleAloneUs, sizeof(idleAloneUs), "%.1f", w.idleAloneUs);
    std::snprintf(hiddenIdle, sizeof(hiddenIdle), "%.4f", w.hiddenIdle);
  }
  if (o.check) std::snprintf(wrong, sizeof(wrong), "%" PRId64, w.wrong);
  char buf[1536];
  std::snprintf(
      buf, sizeof(buf),
      "\"impl\": \"scape\", \"mode\": \"masksync\", \"nranks\": %d, \"count\": %" PRIu64
      ", \"density\": %.6g, \"encoding\": \"%s\", \"sent_encoding\": \"%s\", \"k\": %" PRIu64
      ", \"sent_bytes\": %.0f, \"total_bytes\": %" PRIu64
      ", \"mask_bytes_per_param\": %.6f, \"sync_us\": %.1f, \"lib_sync_us\": %.1f, "
      "\"busy_alone_us\": %.1f, \"overlapped_us\": %.1f, \"hidden\": %.4f, "
      "\"sync_cpu_us\": %.1f, \"idle_alone_us\": %s, \"idle_overlapped_us\": %s, "
      "\"hidden_idle\": %s, \"idle_wait\": \"%s\", "
      "\"mask_plus_payload_bytes_per_param\": %.6f, \"dense_bytes_per_param\": 8, "
      "\"wrong\": %s",
      nranks, w.count, w.density, encodingName(w.requested), encodingName(w.sent), w.k, w.sentBytes,
      w.totalBytes, w.maskBpp, w.syncUs, w.libSyncUs, w.busyAloneUs, w.bothUs, w.hidden,
      w.syncCpuUs, idleAloneUs, idleUs, hiddenIdle, o.idleSleep ? "sleep" : "yield", w.totalBpp,
      wrong);
  return buf;
}

// One selection (top-k of this rank's statistic), shared by every encoding's mask.
struct Selection {
  int nseg = 1;
  std::vector<uint64_t> offs, idx, own;
  uint64_t k = 0, expectK = 0;
};

// Masks are created one at a time (at density 1 each holds several index arrays of the whole
// buffer); the first encoding's mask is the one that selects.
bool selectOnce(Bench& b, uint64_t count, double density, scapeMaskEncoding_t enc,
                MaskHolder* holder, Selection* s) {
  s->nseg = segmentCount(b.opts(), count);
  s->offs = segmentOffsets(count, s->nseg);
  scapeMask_t m = nullptr;
  PERF_CHECK(b, "scapeMaskCreate",
             scapeMaskCreate(&m, count, s->nseg, s->offs.data(), nullptr, scapeOwnershipShards, enc,
                             b.comm()));
  holder->masks.push_back(m);
  double selUs = 0, syncUs = 0;
  if (!selectMask(b, m, count, density, &selUs, &syncUs)) return false;
  uint64_t kr = 0, off = 0;
  PERF_CHECK(b, "scapeMaskGetCount", scapeMaskGetCount(m, &s->k));
  PERF_CHECK(b, "scapeMaskGetRankCount", scapeMaskGetRankCount(m, b.rank(), &kr, &off));
  s->idx.assign(s->k, 0);
  PERF_CHECK(b, "scapeMaskGetIndices", scapeMaskGetIndices(m, s->idx.data(), s->idx.size()));
  if (!expectedMaskK(b, m, s->offs, density, &s->expectK)) return false;
  s->own.assign(s->idx.begin() + static_cast<ptrdiff_t>(off),
                s->idx.begin() + static_cast<ptrdiff_t>(off + kr));
  return true;
}

// The timings of one encoding, per rank: -n rounds of each phase.
struct Rounds {
  std::vector<int64_t> alone, busyAlone, both, idleAlone, idle;
  double bgCpu = 0;  // CPU seconds outside the calling thread during the calibration syncs
  int64_t tcal = 0;  // the calibrated T_sync, slowest rank (ns)
};

// Calibration: T_sync alone (start + wait), median of -n syncs, slowest rank: the length of the
// compute phases. Also the CPU the sync costs outside the calling thread.
bool calibrate(Bench& b, scapeMask_t m, Rounds* r) {
  const Options& o = b.opts();
  const double cpu0 = processCpuSec(), self0 = threadCpuSec();
  for (int i = 0; i < o.iters; ++i) {
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(b.comm()));
    const double t0 = nowSec();
    PERF_CHECK(b, "scapeMaskSyncStart", scapeMaskSyncStart(m));
    PERF_CHECK(b, "scapeMaskSyncWait", scapeMaskSyncWait(m));
    r->alone.push_back(static_cast<int64_t>((nowSec() - t0) * 1e9));
    beat();
  }
  r->bgCpu = (processCpuSec() - cpu0) - (threadCpuSec() - self0);
  r->tcal = medianI64(r->alone);
  return b.reduceI64(&r->tcal, 1, scapeMax, "scapeAllReduce(sync time, int64, max)");
}

// -n rounds of five timings, each after a barrier: the sync alone again; the busy phase alone;
// the busy phase overlapped (start, the busy work on this thread, wait); the idle phase alone
// (a wait of T_c: the host thread of a GPU step mostly waits); the idle phase overlapped. Each
// overlapped time is compared with the same phase alone from the same rounds, so what the
// phase itself costs on this machine (a sleep that wakes late on a virtual machine, the work's
// own speed) is not counted against the sync. Interleaved, so drift in the machine's load hits
// all five alike; medians, so one stalled iteration does not decide the row.
bool timeRounds(Bench& b, scapeMask_t m, BusyCompute* compute, uint64_t work, double tc,
                Rounds* r) {
  const Options& o = b.opts();
  // The idle phase: the host thread waits T_c for a device. By default it polls the clock
  // with sched_yield (CUDA's cudaDeviceScheduleYield), leaving the core to any other runnable
  // thread. With --idle-wait sleep it sleeps instead; on a VM where an idle vCPU takes its
  // timer interrupts late after a burst of work (perf/RESULTS.md), that mostly measures
  // the VM.
  const bool idleSleep = o.idleSleep;
  auto idlePhase = [tc, idleSleep](double from) {
    if (!idleSleep) {
      while (nowSec() < from + tc) sched_yield();
      return;
    }
    for (double left = tc; left > 0; left = from + tc - nowSec()) {
      struct timespec ts {};
      ts.tv_sec = static_cast<time_t>(left);
      ts.tv_nsec = static_cast<long>((left - static_cast<double>(ts.tv_sec)) * 1e9);
      nanosleep(&ts, nullptr);
    }
  };
  auto since = [](double t0) { return static_cast<int64_t>((nowSec() - t0) * 1e9); };
  scapeComm_t comm = b.comm();
  for (int i = 0; i < o.iters; ++i) {
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(comm));
    double t0 = nowSec();
    PERF_CHECK(b, "scapeMaskSyncStart", scapeMaskSyncStart(m));
    PERF_CHECK(b, "scapeMaskSyncWait", scapeMaskSyncWait(m));
    r->alone.push_back(since(t0));
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(comm));
    t0 = nowSec();
    compute->run(work);
    r->busyAlone.push_back(since(t0));
    PERF_CHECK(b, "scapeBarrier", scapeBarrier(comm));
    t0 = nowSec();
    PERF_CHECK(b, "scapeMaskSyncStart", scapeMaskSyncStart(m));
    compute->run(work);
    PERF_CHECK(b, "scapeMaskSyncWait", scapeMaskSyncWait(m));
    r->both.push_back(since(t0));
    if (o.syncIdle) {
      PERF_CHECK(b, "scapeBarrier", scapeBarrier(comm));
      t0 = nowSec();
      idlePhase(t0);
      r->idleAlone.push_back(since(t0));
      PERF_CHECK(b, "scapeBarrier", scapeBarrier(comm));
      t0 = nowSec();
      PERF_CHECK(b, "scapeMaskSyncStart", scapeMaskSyncStart(m));
      idlePhase(t0);
      PERF_CHECK(b, "scapeMaskSyncWait", scapeMaskSyncWait(m));
      r->idle.push_back(since(t0));
    }
    beat();
  }
  return true;
}

// The synchronised mask must be the one selected, whatever the encoding.
bool checkMask(Bench& b, scapeMask_t m, const Selection& s, int64_t* wrong) {
  *wrong = 0;
  if (!b.opts().check) return true;
  PERF_CHECK(b, "scapeMaskAdvance", scapeMaskAdvance(m));
  uint64_t k2 = 0;
  PERF_CHECK(b, "scapeMaskGetCount", scapeMaskGetCount(m, &k2));
  std::vector<uint64_t> got(k2, 0);
  PERF_CHECK(b, "scapeMaskGetIndices", scapeMaskGetIndices(m, got.data(), got.size()));
  if (b.inject() && !got.empty()) got[got.size() / 2] ^= 1u;
  const uint64_t k = s.k;
  for (uint64_t i = 0; i < std::min(k, k2); ++i) *wrong += got[i] != s.idx[i];
  *wrong += static_cast<int64_t>(k > k2 ? k - k2 : k2 - k);
  if (b.rank() == 0) *wrong += static_cast<int64_t>(k > s.expectK ? k - s.expectK : s.expectK - k);
  return true;
}

// One encoding's row: the mask for it (the selecting one for the first), timed and checked.
bool encodingRow(Bench& b, uint64_t count, double density, const Selection& s,
                 scapeMaskEncoding_t enc, MaskHolder* holder, BusyCompute* compute) {
  const Options& o = b.opts();
  scapeMask_t m = holder->masks[0];
  PERF_CHECK(b, "scapeMaskSetNextIndices", scapeMaskSetNextIndices(m, s.own.data(), s.own.size()));
  for (int i = 0; i < o.warmup; ++i) {
    PERF_CHECK(b, "scapeMaskSyncStart (warm-up)", scapeMaskSyncStart(m));
    PERF_CHECK(b, "scapeMaskSyncWait (warm-up)", scapeMaskSyncWait(m));
  }
  Rounds r;
  if (!calibrate(b, m, &r)) return false;
  scapeMaskSyncInfo_t info{};
  PERF_CHECK(b, "scapeMaskGetSyncInfo", scapeMaskGetSyncInfo(m, &info));
  // The busy phase's work: the chunks that take T_c on this thread alone (each rank its own).
  const double tc = static_cast<double>(r.tcal) * 1e-9;
  const uint64_t work = compute->calibrate(tc);
  if (!timeRounds(b, m, compute, work, tc, &r)) return false;
  // The slowest rank's medians, in one reduction: sync alone, busy alone, busy overlapped,
  // idle alone, idle overlapped (-1: no idle phase).
  int64_t med[5] = {medianI64(r.alone), medianI64(r.busyAlone), medianI64(r.both),
                    o.syncIdle ? medianI64(r.idleAlone) : -1, o.syncIdle ? medianI64(r.idle) : -1};
  if (!b.reduceI64(med, 5, scapeMax, "scapeAllReduce(median times, int64, max)")) return false;
  int64_t wrong = 0;
  if (!checkMask(b, m, s, &wrong)) return false;
  int64_t sums[4] = {static_cast<int64_t>(info.sentBytes), wrong,
                     b.rank() == 0 ? static_cast<int64_t>(info.encoding) : 0,
                     static_cast<int64_t>(std::max(0.0, r.bgCpu) / o.iters * 1e9)};
  if (!b.reduceI64(sums, 4, scapeSum, "scapeAllReduce(sync info, int64, sum)")) return false;
  SyncRow w;
  w.count = count;
  w.density = density;
  w.requested = enc;
  w.sent = static_cast<scapeMaskEncoding_t>(sums[2]);
  w.k = s.k;
  w.sentBytes = static_cast<double>(sums[0]) / b.nranks();
  w.totalBytes = info.totalBytes;
  w.syncUs = static_cast<double>(med[0]) / 1e3;
  w.libSyncUs = info.syncSeconds * 1e6;
  w.syncCpuUs = static_cast<double>(sums[3]) / b.nranks() / 1e3;
  w.bothUs = static_cast<double>(med[2]) / 1e3;
  // What the overlapped round takes beyond the same compute phase alone is the part of the
  // sync that was not hidden.
  const double ts = static_cast<double>(med[0]);
  auto hiddenFrac = [ts](double overlapped, double phase) {
    return ts > 0 ? std::min(1.0, std::max(0.0, 1.0 - (overlapped - phase) / ts)) : 1.0;
  };
  w.busyAloneUs = static_cast<double>(med[1]) / 1e3;
  w.hidden = hiddenFrac(static_cast<double>(med[2]), static_cast<double>(med[1]));
  w.idleUs = static_cast<double>(med[4]) / 1e3;
  w.idleAloneUs = static_cast<double>(med[3]) / 1e3;
  w.hiddenIdle =
      med[4] < 0 ? -1.0 : hiddenFrac(static_cast<double>(med[4]), static_cast<double>(med[3]));
  w.maskBpp = count ? static_cast<double>(info.totalBytes) / static_cast<double>(count) : 0.0;
  w.totalBpp = w.maskBpp + 8.0 * density;
  w.wrong = sums[1];
  b.addCustomRow(jsonFields(o, b.nranks(), w), w.hidden, w.wrong);
  if (b.rank() == 0) printRow(o, w);
  return true;
}

bool syncRows(Bench& b, uint64_t count, double density, BusyCompute* compute) {
  const Options& o = b.opts();
  std::vector<scapeMaskEncoding_t> encs = o.encodings;
  if (encs.empty())
    encs = {scapeMaskEncodingBitmap, scapeMaskEncodingIndices, scapeMaskEncodingEliasFano,
            scapeMaskEncodingDeltaVarint, scapeMaskEncodingAuto};
  MaskHolder holder;
  Selection s;
  if (!selectOnce(b, count, density, encs[0], &holder, &s)) return false;
  for (size_t e = 0; e < encs.size(); ++e) {
    if (e > 0) {
      for (scapeMask_t old : holder.masks) scapeMaskDestroy(old);
      holder.masks.clear();
      scapeMask_t fresh = nullptr;
      PERF_CHECK(b, "scapeMaskCreate",
                 scapeMaskCreate(&fresh, count, s.nseg, s.offs.data(), nullptr,
                                 scapeOwnershipShards, encs[e], b.comm()));
      holder.masks.push_back(fresh);
    }
    if (!encodingRow(b, count, density, s, encs[e], &holder, compute)) return false;
  }
  return true;
}

int runMaskSync(Bench& b) {
  BusyCompute compute;
  for (uint64_t size : b.sizes())
    for (double d : b.opts().densities)
      if (!syncRows(b, size / b.typeSize(), d, &compute)) return PERF_EXIT_CALL_FAILED;
  if (compute.sink() == 12345.678f) std::printf("#\n");  // keep the compute observable
  return PERF_EXIT_OK;
}

void describe(const Options& o, std::string* line) {
  describeMask(o, "bitmap,indices,eliasfano,deltavarint,auto", line);
  if (o.syncIdle)
    *line += std::string("; idle phase ") + (o.idleSleep ? "sleeps" : "polls with sched_yield");
}

const char* const kSyncAliases[] = {"mask-sync", "mask_sync", nullptr};

}  // namespace

const ModeDesc kModeMaskSync = {
    "masksync",
    kSyncAliases,
    "mask encoding size, sync time, hidden fraction",
    kModeDensities | kModeMaskOptions | kModeAllReduceOnly,
    runMaskSync,
    describe,
    printColumns,
    "Avg hidden fraction",
};

}  // namespace scape_perf
