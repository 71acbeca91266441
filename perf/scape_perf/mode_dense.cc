// scape-perf --mode dense: the dense collective (-t allreduce, reducescatter, allgather,
// broadcast), measured as nccl-tests measures it.
#include <cinttypes>
#include <cstring>

#include "perf/scape_perf/bench.h"

namespace scape_perf {
namespace {

// Per size: the parameter count (per-rank count for reduce-scatter / all-gather), and the
// element counts of the send and receive buffers.
struct Shape {
  uint64_t count, sendElems, recvElems, bytes;
};

Shape shapeOf(const Bench& b, uint64_t sizeBytes) {
  Shape s{};
  const uint64_t n = static_cast<uint64_t>(b.nranks()), ts = b.typeSize();
  switch (b.opts().coll) {
    case Coll::kAllReduce:
    case Coll::kBroadcast:
      s.count = sizeBytes / ts;
      s.sendElems = s.recvElems = s.count;
      s.bytes = s.count * ts;
      break;
    case Coll::kReduceScatter:
      s.count = sizeBytes / ts / n;
      s.sendElems = s.count * n;
      s.recvElems = s.count;
      s.bytes = s.count * ts * n;
      break;
    case Coll::kAllGather:
      s.count = sizeBytes / ts / n;
      s.sendElems = s.count;
      s.recvElems = s.count * n;
      s.bytes = s.count * ts * n;
      break;
  }
  return s;
}

double busFactor(const Bench& b) {
  const double n = b.nranks();
  switch (b.opts().coll) {
    case Coll::kAllReduce:
      return 2.0 * (n - 1) / n;
    case Coll::kReduceScatter:
    case Coll::kAllGather:
      return (n - 1) / n;
    case Coll::kBroadcast:
      return 1.0;
  }
  return 1.0;
}

// The buffers of one placement.
struct Ptrs {
  const void* send;
  void* recv;
  unsigned char* fillBase;  // where this rank's input starts (null: no input)
  uint64_t fillElems;       // input elements, indexed from 0
};

Ptrs ptrsOf(Bench& b, const Shape& s, bool inPlace) {
  Ptrs p{};
  unsigned char* sb = b.send();
  unsigned char* rb = b.recv();
  const int rank = b.rank();
  const uint64_t rOff = static_cast<uint64_t>(rank) * s.count * b.typeSize();
  switch (b.opts().coll) {
    case Coll::kAllReduce:
      p.send = inPlace ? rb : sb;
      p.recv = rb;
      p.fillBase = inPlace ? rb : sb;
      p.fillElems = s.count;
      break;
    case Coll::kBroadcast:
      p.send = inPlace ? rb : sb;
      p.recv = rb;
      p.fillBase = (rank == b.opts().root) ? (inPlace ? rb : sb) : nullptr;
      p.fillElems = s.count;
      break;
    case Coll::kReduceScatter:  // in place: recvbuf == sendbuf + rank * recvcount
      p.send = sb;
      p.recv = inPlace ? sb + rOff : rb;
      p.fillBase = sb;
      p.fillElems = s.sendElems;
      break;
    case Coll::kAllGather:  // in place: sendbuf == recvbuf + rank * sendcount
      p.send = inPlace ? rb + rOff : sb;
      p.recv = rb;
      p.fillBase = inPlace ? rb + rOff : sb;
      p.fillElems = s.count;
      break;
  }
  return p;
}

void initInputs(Bench& b, const Shape& s, bool inPlace) {
  const Options& o = b.opts();
  const Ptrs p = ptrsOf(b, s, inPlace);
  // Receive side first (sentinel), then the input, which may lie inside the receive buffer.
  const bool recvIsInput =
      inPlace && (o.coll == Coll::kAllReduce || o.coll == Coll::kReduceScatter);
  if (!recvIsInput) std::memset(p.recv, kSentinelByte, s.recvElems * b.typeSize());
  if (p.fillBase == nullptr) return;
  const int r = (o.coll == Coll::kBroadcast) ? o.root : b.rank();
  const Pattern& pat = b.pattern();
  withCodec(o.dtype, [&](auto codec) {
    using C = decltype(codec);
    auto* out = reinterpret_cast<typename C::T*>(p.fillBase);
    for (uint64_t i = 0; i < p.fillElems; ++i) out[i] = C::enc(pat.value(r, i));
  });
}

int64_t countWrong(Bench& b, const Shape& s, bool inPlace) {
  const Options& o = b.opts();
  const Ptrs p = ptrsOf(b, s, inPlace);
  if (b.inject() && s.recvElems > 0)
    corruptElement(static_cast<unsigned char*>(p.recv) + (s.recvElems / 2) * b.typeSize());
  const Pattern& pat = b.pattern();
  int64_t wrong = 0;
  withCodec(o.dtype, [&](auto codec) {
    using C = decltype(codec);
    const auto* in = reinterpret_cast<const typename C::T*>(p.recv);
    switch (o.coll) {
      case Coll::kAllReduce:
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pat.reduced(i));
        break;
      case Coll::kReduceScatter: {
        const uint64_t base = static_cast<uint64_t>(b.rank()) * s.count;
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pat.reduced(base + i));
        break;
      }
      case Coll::kAllGather:
        for (int r = 0; r < b.nranks(); ++r)
          for (uint64_t i = 0; i < s.count; ++i)
            wrong += !C::eq(in[static_cast<uint64_t>(r) * s.count + i], pat.value(r, i));
        break;
      case Coll::kBroadcast:
        for (uint64_t i = 0; i < s.count; ++i) wrong += !C::eq(in[i], pat.value(o.root, i));
        break;
    }
  });
  return wrong;
}

bool launch(Bench& b, const Shape& s, bool inPlace) {
  const Options& o = b.opts();
  const Ptrs p = ptrsOf(b, s, inPlace);
  scapeResult_t r = scapeSuccess;
  const char* name = "";
  switch (o.coll) {
    case Coll::kAllReduce:
      name = "scapeAllReduce";
      r = scapeAllReduce(p.send, p.recv, s.count, o.dtype, o.op, nullptr, b.comm(), nullptr);
      break;
    case Coll::kReduceScatter:
      name = "scapeReduceScatter";
      r = scapeReduceScatter(p.send, p.recv, s.count, o.dtype, o.op, b.comm(), nullptr);
      break;
    case Coll::kAllGather:
      name = "scapeAllGather";
      r = scapeAllGather(p.send, p.recv, s.count, o.dtype, b.comm(), nullptr);
      break;
    case Coll::kBroadcast:
      name = "scapeBroadcast";
      r = scapeBroadcast(p.send, p.recv, s.count, o.dtype, o.root, b.comm(), nullptr);
      break;
  }
  if (r != scapeSuccess) {
    char what[192];
    std::snprintf(what, sizeof(what), "%s(%s, count %" PRIu64 ", %s%s%s, root %d)", name,
                  inPlace ? "in place" : "out of place", s.count, typeName(o.dtype),
                  b.hasOp() ? ", " : "", b.hasOp() ? opName(o.op) : "", b.printedRoot());
    return b.fail(what, r);
  }
  beat();
  return true;
}

int runDense(Bench& b) {
  const Options& o = b.opts();
  const size_t ts = b.typeSize();
  const Shape maxShape = shapeOf(b, o.maxBytes);
  if (!b.allocDense(maxShape.sendElems * ts, maxShape.recvElems * ts)) return PERF_EXIT_CALL_FAILED;
  // Warm-up at the largest and the smallest size, as nccl-tests does.
  for (uint64_t wsize : {o.maxBytes, o.minBytes}) {
    const Shape s = shapeOf(b, wsize);
    initInputs(b, s, false);
    for (int i = 0; i < o.warmup; ++i)
      if (!launch(b, s, false)) return PERF_EXIT_CALL_FAILED;
  }
  for (uint64_t size : b.sizes()) {
    const Shape s = shapeOf(b, size);
    Row row;
    row.mode = &kModeDense;
    row.bytes = s.bytes;
    row.count = s.count;
    row.density = 1.0;
    row.k = s.sendElems;
    row.wire = busFactor(b) * static_cast<double>(s.bytes);
    row.algBytes = static_cast<double>(s.bytes);
    int64_t ns[2] = {0, 0}, wrong[2] = {0, 0};
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !o.inPlace) continue;
      const bool ip = k == 1;
      row.has[k] = true;
      auto init = [&](bool) {
        initInputs(b, s, ip);
        return true;
      };
      auto go = [&]() { return launch(b, s, ip); };
      auto check = [&]() { return countWrong(b, s, ip); };
      if (!b.timePlacement(false, 0, init, go, check, &ns[k], &wrong[k]))
        return PERF_EXIT_CALL_FAILED;
    }
    if (!b.finishRow(&row, ns, wrong)) return PERF_EXIT_CALL_FAILED;
  }
  return PERF_EXIT_OK;
}

}  // namespace

const ModeDesc kModeDense = {
    "dense", nullptr, nullptr, 0, runDense, nullptr, nullptr, nullptr,
};

}  // namespace scape_perf
