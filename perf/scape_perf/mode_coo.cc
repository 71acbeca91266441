// scape-perf --mode coo: the generic sparse all-reduce, scapeSparseAllReduce. Every rank brings a
// random sorted index list at the density (--coo-algo auto or allgather; --coo-out list or
// dense).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>

#include "perf/scape_perf/bench.h"
#include "perf/scape_perf/mask_util.h"

namespace scape_perf {
namespace {

constexpr uint64_t kCooSalt = 0xc00c00c00ull;

// Rank r lists index j with probability `density` (independently per rank and index).
struct CooSelect {
  bool all = false;
  uint64_t threshold = 0;  // on the top 32 bits of the hash
  explicit CooSelect(double density) {
    all = density >= 1.0;
    threshold = static_cast<uint64_t>(std::floor(density * 4294967296.0));
  }
  bool operator()(int r, uint64_t j) const {
    return all || (hashRJ(r, j, kCooSalt) >> 32) < threshold;
  }
};

// One row's input list and output buffers.
struct CooBuffers {
  std::vector<uint64_t> idx;
  Buffer vals;
  uint64_t capacity = 0;
  Buffer outIdx, outVals, denseOut;
  size_t outNnz = 0;
  uint64_t sent = 0;
};

bool makeBuffers(Bench& b, uint64_t count, const CooSelect& sel, double density, CooBuffers* c) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  c->idx.reserve(static_cast<size_t>(density * static_cast<double>(count) * 1.01) + 64);
  for (uint64_t j = 0; j < count; ++j)
    if (sel(b.rank(), j)) c->idx.push_back(j);
  const size_t nnz = c->idx.size();
  c->vals = allocBuffer(nnz * ts);
  if (!c->vals) return b.failMsg("cannot allocate %zu values", nnz);
  withCodec(o.dtype, [&](auto codec) {
    using C = decltype(codec);
    auto* out = reinterpret_cast<typename C::T*>(c->vals.get());
    for (size_t i = 0; i < nnz; ++i) out[i] = C::enc(b.pattern().nonzero(b.rank(), c->idx[i]));
  });
  int64_t total = static_cast<int64_t>(nnz);
  if (!b.reduceI64(&total, 1, scapeSum, "scapeAllReduce(nnz, int64, sum)")) return false;
  c->capacity = std::min<uint64_t>(count, static_cast<uint64_t>(total));
  if (o.cooDenseOut) {
    c->denseOut = allocBuffer(count * ts);
    if (!c->denseOut)
      return b.failMsg("cannot allocate the dense output (%" PRIu64 " elements)", count);
  } else {
    c->outIdx = allocBuffer(c->capacity * sizeof(uint64_t));
    c->outVals = allocBuffer(c->capacity * ts);
    if (!c->outIdx || !c->outVals)
      return b.failMsg("cannot allocate the output list (capacity %" PRIu64 ")", c->capacity);
  }
  return true;
}

// Wrong elements of the result: the union of the ranks' lists, each summed (or averaged).
int64_t countWrong(Bench& b, uint64_t count, const CooSelect& sel, CooBuffers* c) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const auto* oi = reinterpret_cast<const uint64_t*>(c->outIdx.get());
  const size_t outNnz = c->outNnz;
  if (b.inject()) {
    if (o.cooDenseOut && count > 0) corruptElement(c->denseOut.get() + (count / 2) * ts);
    if (!o.cooDenseOut && outNnz > 0) corruptElement(c->outVals.get() + (outNnz / 2) * ts);
  }
  int64_t w = 0;
  withCodec(o.dtype, [&](auto codec) {
    using C = decltype(codec);
    const auto* dv = reinterpret_cast<const typename C::T*>(o.cooDenseOut ? c->denseOut.get()
                                                                          : c->outVals.get());
    size_t p = 0;
    for (uint64_t j = 0; j < count; ++j) {
      bool any = false;
      int64_t sum = 0;
      for (int r = 0; r < b.nranks(); ++r)
        if (sel(r, j)) {
          any = true;
          sum += b.pattern().nonzero(r, j);
        }
      if (o.op == scapeAvg) sum /= b.nranks();
      if (o.cooDenseOut) {
        w += !C::eq(dv[j], any ? sum : 0);
        continue;
      }
      while (p < outNnz && oi[p] < j) ++w, ++p;  // listed, but no rank brought it
      if (!any) continue;
      if (p < outNnz && oi[p] == j) {
        w += !C::eq(dv[p], sum);
        ++p;
      } else {
        ++w;  // missing from the union
      }
    }
    if (!o.cooDenseOut) w += static_cast<int64_t>(outNnz - std::min<size_t>(p, outNnz));
  });
  return w;
}

bool cooRow(Bench& b, uint64_t count, double density) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const CooSelect sel(density);
  CooBuffers c;
  if (!makeBuffers(b, count, sel, density, &c)) return false;
  auto* oi = reinterpret_cast<uint64_t*>(c.outIdx.get());
  Row row;
  row.mode = &kModeCoo;
  row.bytes = count * ts;
  row.count = count;
  row.density = density;
  row.has[0] = true;
  int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
  auto init = [&](bool forCheck) {
    if (!forCheck) return true;
    if (o.cooDenseOut) {
      std::memset(c.denseOut.get(), kSentinelByte, count * ts);
    } else {
      std::memset(c.outIdx.get(), 0xff, c.capacity * sizeof(uint64_t));
      std::memset(c.outVals.get(), kSentinelByte, c.capacity * ts);
    }
    return true;
  };
  auto go = [&]() {
    PERF_CHECK(b, "scapeSparseAllReduce",
               scapeSparseAllReduce(c.idx.data(), c.vals.get(), c.idx.size(), count, o.dtype, o.op,
                                    o.cooAlgo, o.cooDenseOut ? c.denseOut.get() : nullptr,
                                    o.cooDenseOut ? nullptr : oi,
                                    o.cooDenseOut ? nullptr : c.outVals.get(), c.capacity,
                                    &c.outNnz, &c.sent, b.comm()));
    beat();
    return true;
  };
  auto check = [&]() -> int64_t { return countWrong(b, count, sel, &c); };
  if (!b.timePlacement(true, o.warmup, init, go, check, &ns[0], &wrong[0])) return false;
  // Bytes on the wire: what the API says this rank sent (the last call), mean over ranks.
  int64_t sums[2] = {static_cast<int64_t>(c.sent), static_cast<int64_t>(c.idx.size())};
  if (!b.reduceI64(sums, 2, scapeSum, "scapeAllReduce(bytesSent, int64, sum)")) return false;
  row.wire = static_cast<double>(sums[0]) / b.nranks();
  row.k = static_cast<uint64_t>(sums[1] / b.nranks());
  row.algBytes = static_cast<double>(sums[1]) / b.nranks() * static_cast<double>(8 + ts);
  char buf[96];
  std::snprintf(buf, sizeof(buf), ", \"coo_algo\": \"%s\", \"coo_out\": \"%s\"",
                cooAlgoName(o.cooAlgo), o.cooDenseOut ? "dense" : "list");
  row.jsonExtra = buf;
  return b.finishRow(&row, ns, wrong);
}

int runCoo(Bench& b) {
  for (uint64_t size : b.sizes())
    for (double d : b.opts().densities)
      if (!cooRow(b, size / b.typeSize(), d)) return PERF_EXIT_CALL_FAILED;
  return PERF_EXIT_OK;
}

void describe(const Options& o, std::string* line) {
  *line += std::string("; algorithm ") + cooAlgoName(o.cooAlgo) + ", " +
           (o.cooDenseOut ? "dense" : "list") + " output";
}

const char* const kCooAliases[] = {"sparse", nullptr};

}  // namespace

const ModeDesc kModeCoo = {
    "coo",
    kCooAliases,
    "scapeSparseAllReduce of random (index, value) lists",
    kModeDensities | kModeAllReduceOnly,
    runCoo,
    describe,
    nullptr,
    nullptr,
};

}  // namespace scape_perf
