// scape-perf --mode mask and --mode mask-packed: SCAPE's values-only exchange on an agreed mask.
//   mask         a scapeMask over the buffer (count elements, --segments segments, shard
//                ownership), selected by scapeMaskSelectNextTopk on a per-rank random statistic
//                at each --density, synchronised and advanced, then timed:
//                scapeAllReduce(send, recv, count, dtype, op, mask, comm, NULL) (dense in /
//                dense out), or scapeMaskReduceScatter / scapeMaskAllGather on the packed
//                values (-t reducescatter / allgather).
//   mask-packed  the same exchange on packed values (scapeMaskAllReducePacked: k values in and
//                out), i.e. without the gather from / scatter to the dense buffer.
#include <algorithm>
#include <cinttypes>
#include <cstring>

#include "perf/scape_perf/bench.h"
#include "perf/scape_perf/mask_util.h"

namespace scape_perf {
namespace {

// A selected, synchronised mask and what the row checks against.
struct MaskSetup {
  scapeMask_t mask = nullptr;
  uint64_t count = 0, k = 0;
  std::vector<uint64_t> kr, off;  // per rank: its count and offset in the packed values
  std::vector<uint64_t> idx;      // the k positions, in packed order
  std::vector<uint64_t> sorted;   // the same, sorted, when idx is not
  const std::vector<uint64_t>* walk = nullptr;  // sorted positions (idx or sorted)
  int64_t maskWrong = 0;                        // wrong k or positions (rank 0 reports the k)
  double selectUs = 0, syncUs = 0;
  scapeMaskSyncInfo_t info{};
};

bool setupMask(Bench& b, uint64_t count, double density, MaskHolder* holder, MaskSetup* m) {
  const Options& o = b.opts();
  const int nseg = segmentCount(o, count);
  const std::vector<uint64_t> offs = segmentOffsets(count, nseg);
  m->count = count;
  PERF_CHECK(b, "scapeMaskCreate",
             scapeMaskCreate(&m->mask, count, nseg, offs.data(), nullptr, scapeOwnershipShards,
                             o.encoding, b.comm()));
  holder->masks.push_back(m->mask);
  if (!selectMask(b, m->mask, count, density, &m->selectUs, &m->syncUs)) return false;
  PERF_CHECK(b, "scapeMaskGetSyncInfo", scapeMaskGetSyncInfo(m->mask, &m->info));
  const size_t P = static_cast<size_t>(b.nranks());
  PERF_CHECK(b, "scapeMaskGetCount", scapeMaskGetCount(m->mask, &m->k));
  m->kr.assign(P, 0);
  m->off.assign(P, 0);
  for (size_t r = 0; r < P; ++r)
    PERF_CHECK(b, "scapeMaskGetRankCount",
               scapeMaskGetRankCount(m->mask, static_cast<int>(r), &m->kr[r], &m->off[r]));
  m->idx.assign(m->k, 0);
  PERF_CHECK(b, "scapeMaskGetIndices", scapeMaskGetIndices(m->mask, m->idx.data(), m->idx.size()));

  // The mask itself: the documented k, every part strictly increasing and inside the buffer.
  uint64_t expectK = 0;
  const uint64_t k = m->k;
  if (!expectedMaskK(b, m->mask, offs, density, &expectK)) return false;
  if (k != expectK) {
    m->maskWrong += static_cast<int64_t>(k > expectK ? k - expectK : expectK - k);
    if (b.rank() == 0)
      std::fprintf(stderr,
                   "%s: mask has k = %" PRIu64 " positions, the selection rule gives %" PRIu64 "\n",
                   kProg, k, expectK);
  }
  for (size_t r = 0; r < P; ++r)
    for (uint64_t i = 0; i < m->kr[r]; ++i) {
      const uint64_t at = m->off[r] + i;
      if (at >= k || m->idx[at] >= count || (i > 0 && m->idx[at] <= m->idx[at - 1])) ++m->maskWrong;
    }
  // Sorted positions for the walk over the dense buffer (shard ownership: already sorted).
  m->walk = &m->idx;
  if (!std::is_sorted(m->idx.begin(), m->idx.end())) {
    m->sorted = m->idx;
    std::sort(m->sorted.begin(), m->sorted.end());
    m->walk = &m->sorted;
  }
  return true;
}

// Fills `elems` packed values: rank's value at idx[first + i].
void fillPacked(Bench& b, unsigned char* dst, const std::vector<uint64_t>& idx, uint64_t first,
                uint64_t elems) {
  const Pattern& pat = b.pattern();
  const int rank = b.rank();
  withCodec(b.opts().dtype, [&](auto codec) {
    using C = decltype(codec);
    auto* out = reinterpret_cast<typename C::T*>(dst);
    for (uint64_t i = 0; i < elems; ++i) out[i] = C::enc(pat.value(rank, idx[first + i]));
  });
}

// --mode mask-packed: scapeMaskAllReducePacked, out of place and in place.
bool timePacked(Bench& b, const MaskSetup& m, Row* row, int64_t ns[2], int64_t wrong[2]) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const uint64_t k = m.k;
  Buffer psend = allocBuffer(k * ts), precv = allocBuffer(k * ts);
  if (!psend || !precv) return b.failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
  for (int place = 0; place < 2; ++place) {
    if (place == 1 && !o.inPlace) continue;
    const bool ip = place == 1;
    row->has[place] = true;
    auto init = [&](bool) {
      if (!ip) std::memset(precv.get(), kSentinelByte, k * ts);
      fillPacked(b, ip ? precv.get() : psend.get(), m.idx, 0, k);
      return true;
    };
    auto go = [&]() {
      PERF_CHECK(b, ip ? "scapeMaskAllReducePacked(in place)" : "scapeMaskAllReducePacked",
                 scapeMaskAllReducePacked(ip ? precv.get() : psend.get(), precv.get(), o.dtype,
                                          o.op, m.mask, b.comm(), nullptr));
      beat();
      return true;
    };
    auto check = [&]() -> int64_t {
      if (b.inject() && k > 0) corruptElement(precv.get() + (k / 2) * ts);
      int64_t w = 0;
      withCodec(o.dtype, [&](auto codec) {
        using C = decltype(codec);
        const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
        for (uint64_t i = 0; i < k; ++i) w += !C::eq(got[i], b.pattern().reduced(m.idx[i]));
      });
      return w;
    };
    if (!b.timePlacement(true, place == 0 ? o.warmup : 0, init, go, check, &ns[place],
                         &wrong[place]))
      return false;
  }
  return true;
}

// Masked positions: the reduction; all others untouched (sentinel, or the in-place input).
int64_t countDenseWrong(Bench& b, const MaskSetup& m, bool ip) {
  unsigned char* rb = b.recv();
  const size_t ts = b.typeSize();
  const uint64_t count = m.count, k = m.k;
  const std::vector<uint64_t>& walk = *m.walk;
  if (b.inject() && count > 0) corruptElement(rb + (k > 0 ? walk[k / 2] : count / 2) * ts);
  const Pattern& pat = b.pattern();
  const int rank = b.rank();
  int64_t w = 0;
  withCodec(b.opts().dtype, [&](auto codec) {
    using C = decltype(codec);
    const auto* got = reinterpret_cast<const typename C::T*>(rb);
    size_t p = 0;
    for (uint64_t j = 0; j < count; ++j) {
      bool masked = false;
      while (p < walk.size() && walk[p] < j) ++p;
      if (p < walk.size() && walk[p] == j) masked = true;
      if (masked)
        w += !C::eq(got[j], pat.reduced(j));
      else if (ip)
        w += !C::eq(got[j], pat.value(rank, j));
      else
        w += !isSentinel(reinterpret_cast<const unsigned char*>(got + j), ts);
    }
  });
  return w;
}

// --mode mask, -t allreduce: scapeAllReduce with the mask, dense in and out.
bool timeDenseAllReduce(Bench& b, const MaskSetup& m, Row* row, int64_t ns[2], int64_t wrong[2]) {
  const Options& o = b.opts();
  unsigned char* sb = b.send();
  unsigned char* rb = b.recv();
  const uint64_t count = m.count;
  for (int place = 0; place < 2; ++place) {
    if (place == 1 && !o.inPlace) continue;
    const bool ip = place == 1;
    row->has[place] = true;
    auto init = [&](bool) {
      unsigned char* in = ip ? rb : sb;
      if (!ip) std::memset(rb, kSentinelByte, count * b.typeSize());
      withCodec(o.dtype, [&](auto codec) {
        using C = decltype(codec);
        auto* out = reinterpret_cast<typename C::T*>(in);
        for (uint64_t j = 0; j < count; ++j) out[j] = C::enc(b.pattern().value(b.rank(), j));
      });
      return true;
    };
    auto go = [&]() {
      PERF_CHECK(b, ip ? "scapeAllReduce(mask, in place)" : "scapeAllReduce(mask, out of place)",
                 scapeAllReduce(ip ? rb : sb, rb, count, o.dtype, o.op, m.mask, b.comm(), nullptr));
      beat();
      return true;
    };
    auto check = [&]() -> int64_t { return countDenseWrong(b, m, ip); };
    if (!b.timePlacement(true, place == 0 ? o.warmup : 0, init, go, check, &ns[place],
                         &wrong[place]))
      return false;
  }
  return true;
}

// The local parts of the dense-in / dense-out form, alone: gather (pack) of the k values from
// the dense buffer and scatter (unpack) back, as scapeAllReduce does around the exchange.
bool timePackUnpack(Bench& b, const MaskSetup& m, double* packUs, double* unpackUs) {
  const Options& o = b.opts();
  Buffer packed = allocBuffer(m.k * b.typeSize());
  if (!packed) return b.failMsg("cannot allocate the packed buffer (k = %" PRIu64 ")", m.k);
  const int reps = std::max(1, std::min(o.iters, 5));
  std::memset(packed.get(), 0, m.k * b.typeSize());
  int64_t t[2] = {0, 0};
  for (int r = 0; r < reps; ++r) {
    const double t0 = nowSec();
    PERF_CHECK(b, "scapeMaskPack", scapeMaskPack(m.mask, b.send(), packed.get(), o.dtype));
    const double t1 = nowSec();
    PERF_CHECK(b, "scapeMaskUnpack", scapeMaskUnpack(m.mask, packed.get(), b.recv(), o.dtype));
    const double t2 = nowSec();
    t[0] += static_cast<int64_t>((t1 - t0) * 1e9);
    t[1] += static_cast<int64_t>((t2 - t1) * 1e9);
  }
  if (!b.reduceI64(t, 2, scapeMax, "scapeAllReduce(pack times, int64, max)")) return false;
  *packUs = static_cast<double>(t[0]) / reps / 1e3;
  *unpackUs = static_cast<double>(t[1]) / reps / 1e3;
  return true;
}

// --mode mask, -t reducescatter: scapeMaskReduceScatter on the packed values (out of place).
bool timeReduceScatter(Bench& b, const MaskSetup& m, Row* row, int64_t ns[2], int64_t wrong[2]) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const size_t me = static_cast<size_t>(b.rank());
  const uint64_t k = m.k, mine = m.kr[me], myOff = m.off[me];
  Buffer psend = allocBuffer(k * ts), precv = allocBuffer(mine * ts);
  if (!psend || !precv) return b.failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
  row->has[0] = true;
  auto init = [&](bool) {
    std::memset(precv.get(), kSentinelByte, mine * ts);
    fillPacked(b, psend.get(), m.idx, 0, k);
    return true;
  };
  auto go = [&]() {
    PERF_CHECK(
        b, "scapeMaskReduceScatter",
        scapeMaskReduceScatter(psend.get(), precv.get(), o.dtype, o.op, m.mask, b.comm(), nullptr));
    beat();
    return true;
  };
  auto check = [&]() -> int64_t {
    if (b.inject() && mine > 0) corruptElement(precv.get() + (mine / 2) * ts);
    int64_t w = 0;
    withCodec(o.dtype, [&](auto codec) {
      using C = decltype(codec);
      const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
      for (uint64_t i = 0; i < mine; ++i)
        w += !C::eq(got[i], b.pattern().reduced(m.idx[myOff + i]));
    });
    return w;
  };
  return b.timePlacement(true, o.warmup, init, go, check, &ns[0], &wrong[0]);
}

// --mode mask, -t allgather: scapeMaskAllGather on the packed values (out of place).
bool timeAllGather(Bench& b, const MaskSetup& m, Row* row, int64_t ns[2], int64_t wrong[2]) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const size_t me = static_cast<size_t>(b.rank());
  const uint64_t k = m.k, mine = m.kr[me], myOff = m.off[me];
  Buffer psend = allocBuffer(mine * ts), precv = allocBuffer(k * ts);
  if (!psend || !precv) return b.failMsg("cannot allocate the packed buffers (k = %" PRIu64 ")", k);
  row->has[0] = true;
  auto init = [&](bool) {
    std::memset(precv.get(), kSentinelByte, k * ts);
    fillPacked(b, psend.get(), m.idx, myOff, mine);
    return true;
  };
  auto go = [&]() {
    PERF_CHECK(b, "scapeMaskAllGather",
               scapeMaskAllGather(psend.get(), precv.get(), o.dtype, m.mask, b.comm(), nullptr));
    beat();
    return true;
  };
  auto check = [&]() -> int64_t {
    if (b.inject() && k > 0) corruptElement(precv.get() + (k / 2) * ts);
    int64_t w = 0;
    withCodec(o.dtype, [&](auto codec) {
      using C = decltype(codec);
      const auto* got = reinterpret_cast<const typename C::T*>(precv.get());
      for (size_t r = 0; r < m.kr.size(); ++r)
        for (uint64_t i = 0; i < m.kr[r]; ++i)
          w += !C::eq(got[m.off[r] + i],
                      b.pattern().value(static_cast<int>(r), m.idx[m.off[r] + i]));
    });
    return w;
  };
  return b.timePlacement(true, o.warmup, init, go, check, &ns[0], &wrong[0]);
}

// The row's mask line and its JSON fields.
void describeRow(const Bench& b, const MaskSetup& m, double packUs, double unpackUs, Row* row) {
  const double bpp =
      m.count ? static_cast<double>(m.info.totalBytes) / static_cast<double>(m.count) : 0.0;
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "#   mask: select %.1f us, sync %.1f us, %" PRIu64
                " mask bytes (%.4f B/param, sent as %s)",
                m.selectUs, m.syncUs, static_cast<uint64_t>(m.info.totalBytes), bpp,
                encodingName(m.info.encoding));
  row->note = buf;
  std::snprintf(buf, sizeof(buf),
                ", \"encoding\": \"%s\", \"sent_encoding\": \"%s\", \"mask_total_bytes\": %" PRIu64
                ", \"select_us\": %.1f, \"mask_sync_us\": %.1f",
                encodingName(b.opts().encoding), encodingName(m.info.encoding),
                static_cast<uint64_t>(m.info.totalBytes), m.selectUs, m.syncUs);
  row->jsonExtra = buf;
  if (packUs >= 0) {
    std::snprintf(buf, sizeof(buf), "; scapeMaskPack %.1f us, scapeMaskUnpack %.1f us", packUs,
                  unpackUs);
    row->note += buf;
    std::snprintf(buf, sizeof(buf), ", \"pack_us\": %.1f, \"unpack_us\": %.1f", packUs, unpackUs);
    row->jsonExtra += buf;
  }
  row->note += "\n";
}

bool maskRow(Bench& b, uint64_t count, double density) {
  const Options& o = b.opts();
  MaskHolder holder;
  MaskSetup m;
  if (!setupMask(b, count, density, &holder, &m)) return false;
  Row row;
  row.mode = o.mode;
  row.bytes = count * b.typeSize();
  row.count = count;
  row.density = density;
  const double nr = b.nranks();
  const double busF = o.coll == Coll::kAllReduce ? 2.0 * (nr - 1) / nr : (nr - 1) / nr;
  row.k = m.k;
  row.wire = busF * static_cast<double>(m.k) * static_cast<double>(b.typeSize());
  row.algBytes = static_cast<double>(m.k) * static_cast<double>(b.typeSize());
  int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
  double packUs = -1, unpackUs = -1;
  bool ok;
  if (o.mode == &kModeMaskPacked)
    ok = timePacked(b, m, &row, ns, wrong);
  else if (o.coll == Coll::kAllReduce)
    ok = timeDenseAllReduce(b, m, &row, ns, wrong) && timePackUnpack(b, m, &packUs, &unpackUs);
  else if (o.coll == Coll::kReduceScatter)
    ok = timeReduceScatter(b, m, &row, ns, wrong);
  else
    ok = timeAllGather(b, m, &row, ns, wrong);
  if (!ok) return false;
  // A wrong mask is wrong in every placement that ran.
  if (o.check) {
    for (int place = 0; place < 2; ++place)
      if (row.has[place]) wrong[place] += b.rank() == 0 ? m.maskWrong : 0;
  }
  describeRow(b, m, packUs, unpackUs, &row);
  return b.finishRow(&row, ns, wrong);
}

int runMask(Bench& b) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const uint64_t maxCount = o.maxBytes / ts;
  const uint64_t denseBytes = o.mode == &kModeMaskPacked ? 64 : maxCount * ts;
  if (!b.allocDense(denseBytes, denseBytes)) return PERF_EXIT_CALL_FAILED;
  for (uint64_t size : b.sizes())
    for (double d : o.densities)
      if (!maskRow(b, size / ts, d)) return PERF_EXIT_CALL_FAILED;
  return PERF_EXIT_OK;
}

void describe(const Options& o, std::string* line) { describeMask(o, "auto", line); }

const char* const kMaskAliases[] = {"masked", nullptr};
const char* const kPackedAliases[] = {"maskpacked", "packed", nullptr};

}  // namespace

const ModeDesc kModeMask = {
    "mask",
    kMaskAliases,
    "scapeAllReduce with an agreed mask, dense in and out\n"
    "(or, with -t, scapeMaskReduceScatter /\n"
    "scapeMaskAllGather on the packed values)",
    kModeDensities | kModeMaskOptions,
    runMask,
    describe,
    nullptr,
    nullptr,
};

const ModeDesc kModeMaskPacked = {
    "mask-packed",
    kPackedAliases,
    "scapeMaskAllReducePacked (k packed values in\n"
    "and out: the exchange without the gather/scatter)",
    kModeDensities | kModeMaskOptions | kModeAllReduceOnly,
    runMask,
    describe,
    nullptr,
    nullptr,
};

}  // namespace scape_perf
