#include "plugin/coll/sparse.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/reduce.h"
#include "kernels/dtypes.h"
#include "plugin/coll/schedule.h"

namespace scape {
namespace coll {
namespace {

constexpr uint32_t kHdrMagic = 0x53505253u;  // "SRPS"

struct Header {
  uint32_t magic;
  uint32_t dense;
  uint64_t nnz;
};

// One value of a floating-point type (kernels/dtypes.h).
float LoadF(scapeDataType_t t, const char* p) { return dtypes::LoadAsFloat(t, p); }
void StoreF(scapeDataType_t t, char* p, float f) { dtypes::StoreFromFloat(t, p, f); }

// A rank's partial result during the algorithm.
struct Part {
  bool dense = false;
  std::vector<uint64_t> idx;
  std::vector<char> vals;
  size_t nnz() const { return idx.size(); }
};

void ToDenseInPlace(Part* p, uint64_t n, size_t esz) {
  if (p->dense) return;
  std::vector<char> d(n * esz, 0);  // all-zero bits are +0 in every float type
  for (size_t i = 0; i < p->idx.size(); ++i)
    std::memcpy(d.data() + p->idx[i] * esz, p->vals.data() + i * esz, esz);
  p->vals.swap(d);
  p->idx.clear();
  p->dense = true;
}

// Two sorted lists into out (capacity a + b); returns the merged length. Values of a common
// index add in fp32 with one rounding to the element type (commutative: the same bits
// whichever side computes it). ESZ is the element size, so the copies are fixed-size moves.
template <size_t ESZ>
size_t MergeLists(scapeDataType_t t, const uint64_t* ai, const char* av, size_t a,
                  const uint64_t* bi, const char* bv, size_t b, uint64_t* oi, char* ov) {
  size_t i = 0, j = 0, w = 0;
  while (i < a && j < b) {
    const uint64_t x = ai[i], y = bi[j];
    if (x < y) {
      oi[w] = x;
      std::memcpy(ov + w * ESZ, av + i * ESZ, ESZ);
      ++i;
    } else if (y < x) {
      oi[w] = y;
      std::memcpy(ov + w * ESZ, bv + j * ESZ, ESZ);
      ++j;
    } else {
      oi[w] = x;
      if constexpr (ESZ == 4) {
        float u, v;
        std::memcpy(&u, av + i * ESZ, 4);
        std::memcpy(&v, bv + j * ESZ, 4);
        u += v;
        std::memcpy(ov + w * ESZ, &u, 4);
      } else {
        StoreF(t, ov + w * ESZ, LoadF(t, av + i * ESZ) + LoadF(t, bv + j * ESZ));
      }
      ++i;
      ++j;
    }
    ++w;
  }
  if (i < a) {
    std::memcpy(oi + w, ai + i, (a - i) * 8);
    std::memcpy(ov + w * ESZ, av + i * ESZ, (a - i) * ESZ);
    w += a - i;
  }
  if (j < b) {
    std::memcpy(oi + w, bi + j, (b - j) * 8);
    std::memcpy(ov + w * ESZ, bv + j * ESZ, (b - j) * ESZ);
    w += b - j;
  }
  return w;
}

// mine := mine (+) theirs, the same bits whichever side computes it.
Status Merge(Part* mine, Part&& theirs, uint64_t n, scapeDataType_t t, size_t esz) {
  if (mine->dense || theirs.dense) {
    ToDenseInPlace(mine, n, esz);
    ToDenseInPlace(&theirs, n, esz);
    return kernels::ToStatus(kernels::ReduceInto(t, scapeSum, mine->vals.data(), mine->vals.data(),
                                                 theirs.vals.data(), n, 1),
                             "sparse merge (dense)");
  }
  const size_t a = mine->nnz(), b = theirs.nnz();
  Part out;
  out.idx.resize(a + b);
  out.vals.resize((a + b) * esz);
  const size_t w = esz == 4
                       ? MergeLists<4>(t, mine->idx.data(), mine->vals.data(), a, theirs.idx.data(),
                                       theirs.vals.data(), b, out.idx.data(), out.vals.data())
                       : MergeLists<2>(t, mine->idx.data(), mine->vals.data(), a, theirs.idx.data(),
                                       theirs.vals.data(), b, out.idx.data(), out.vals.data());
  out.idx.resize(w);
  out.vals.resize(w * esz);
  *mine = std::move(out);
  return Status::Ok();
}

// Serialises a part: sparse = indices then values; dense = values.
std::vector<char> Serialise(const Part& p, size_t esz) {
  if (p.dense) return p.vals;
  std::vector<char> out(p.nnz() * (8 + esz));
  if (p.nnz()) {
    std::memcpy(out.data(), p.idx.data(), p.nnz() * 8);
    std::memcpy(out.data() + p.nnz() * 8, p.vals.data(), p.nnz() * esz);
  }
  return out;
}

Status Deserialise(const Header& h, std::vector<char>&& buf, uint64_t n, size_t esz, int from,
                   Part* out) {
  out->dense = h.dense != 0;
  if (buf.size() != (out->dense ? n * esz : h.nnz * (8 + esz)))
    return RemoteError(StrFormat("rank %d sent %zu bytes for its sparse part", from, buf.size()));
  if (out->dense) {
    out->vals = std::move(buf);
    out->idx.clear();
    return Status::Ok();
  }
  out->idx.resize(h.nnz);
  if (h.nnz) std::memcpy(out->idx.data(), buf.data(), h.nnz * 8);
  out->vals.assign(buf.begin() + static_cast<ptrdiff_t>(h.nnz * 8), buf.end());
  for (size_t i = 0; i < h.nnz; ++i)
    if (out->idx[i] >= n || (i > 0 && out->idx[i] <= out->idx[i - 1]))
      return RemoteError(StrFormat("rank %d sent a sparse list with a bad index at %zu", from, i));
  return Status::Ok();
}

Status CheckHeader(const Header& h, uint64_t n, int from) {
  if (h.magic != kHdrMagic || h.dense > 1 || h.nnz > n)
    return RemoteError(StrFormat("rank %d sent a malformed sparse header", from));
  return Status::Ok();
}

// One exchange (all ranks call it; peers -1 make it a no-op for this rank).
Status Exchange(Runner* comm, int sendPeer, const void* sbuf, size_t slen, int recvPeer, void* rbuf,
                size_t rlen, uint64_t* bytesSent) {
  CollArgs a;
  a.type = CollType::kExchange;
  a.sendPeer = sendPeer;
  a.recvPeer = recvPeer;
  a.send = sbuf;
  a.recv = rbuf;
  a.sendBytes = slen;
  a.recvBytes = rlen;
  if (sendPeer >= 0) *bytesSent += slen;
  return comm->Run(a);
}

Header HeaderOf(const Part& p, uint64_t n) {
  return Header{kHdrMagic, p.dense ? 1u : 0u, p.dense ? n : p.nnz()};
}

Status RecursiveDoubling(Runner* comm, Part* part, uint64_t n, scapeDataType_t t, size_t esz,
                         uint64_t* bytesSent) {
  const int P = comm->nranks(), r = comm->rank();
  const RdLayout l = MakeRdLayout(P);
  const int vr = RdVirtualRank(l, r);
  auto bytesOf = [&](const Header& h) { return h.dense ? n * esz : h.nnz * (8 + esz); };
  // SparCML: go dense once the merged lists would be as large as the dense vector.
  auto goDense = [&](const Header& a, const Header& b) {
    return a.dense || b.dense || (a.nnz + b.nnz) * (8 + esz) >= n * esz;
  };

  // One-way transfer of a whole part (fold and final stages): header, then payload.
  auto oneWay = [&](int to, int from) -> Status {
    Header mine = HeaderOf(*part, n), theirs{};
    SCAPE_RETURN_IF_ERROR(Exchange(comm, to, &mine, sizeof(mine), from, &theirs,
                                   from >= 0 ? sizeof(theirs) : 0, bytesSent));
    if (from >= 0) SCAPE_RETURN_IF_ERROR(CheckHeader(theirs, n, from));
    std::vector<char> out = to >= 0 ? Serialise(*part, esz) : std::vector<char>();
    std::vector<char> in(from >= 0 ? bytesOf(theirs) : 0);
    SCAPE_RETURN_IF_ERROR(
        Exchange(comm, to, out.data(), out.size(), from, in.data(), in.size(), bytesSent));
    if (from >= 0) {
      Part p;
      SCAPE_RETURN_IF_ERROR(Deserialise(theirs, std::move(in), n, esz, from, &p));
      if (to < 0 && vr < 0) {
        *part = std::move(p);  // the final result replaces a folded rank's own data
      } else {
        SCAPE_RETURN_IF_ERROR(Merge(part, std::move(p), n, t, esz));
      }
    }
    return Status::Ok();
  };

  // Fold: the first 2*rem ranks pair up; even ranks hand their list to the odd rank above.
  const bool folds = r < 2 * l.rem;
  SCAPE_RETURN_IF_ERROR(oneWay(folds && vr < 0 ? r + 1 : -1, folds && vr >= 0 ? r - 1 : -1));

  for (int mask = 1; mask < l.pof2; mask <<= 1) {
    const int partner = vr >= 0 ? RdRealRank(l, vr ^ mask) : -1;
    Header mine = HeaderOf(*part, n), theirs{};
    SCAPE_RETURN_IF_ERROR(Exchange(comm, partner, &mine, sizeof(mine), partner, &theirs,
                                   partner >= 0 ? sizeof(theirs) : 0, bytesSent));
    std::vector<char> out, in;
    if (partner >= 0) {
      SCAPE_RETURN_IF_ERROR(CheckHeader(theirs, n, partner));
      if (goDense(mine, theirs)) {
        ToDenseInPlace(part, n, esz);
        theirs.dense = 1;
        theirs.nnz = n;
      }
      out = Serialise(*part, esz);
      in.resize(bytesOf(theirs));
    }
    SCAPE_RETURN_IF_ERROR(
        Exchange(comm, partner, out.data(), out.size(), partner, in.data(), in.size(), bytesSent));
    if (partner >= 0) {
      Part p;
      SCAPE_RETURN_IF_ERROR(Deserialise(theirs, std::move(in), n, esz, partner, &p));
      SCAPE_RETURN_IF_ERROR(Merge(part, std::move(p), n, t, esz));
    }
  }
  // Final: odd folding ranks send the result down to their even partner.
  return oneWay(folds && vr >= 0 ? r - 1 : -1, folds && vr < 0 ? r + 1 : -1);
}

Status ViaAllGather(Runner* comm, Part* part, uint64_t n, scapeDataType_t t, size_t esz,
                    uint64_t* bytesSent) {
  const size_t P = static_cast<size_t>(comm->nranks());
  const size_t r = static_cast<size_t>(comm->rank());
  std::vector<int64_t> counts(P);
  int64_t mine = static_cast<int64_t>(part->nnz());
  CollArgs ag = AllGatherArgs(&mine, counts.data(), 1, scapeInt64);
  SCAPE_RETURN_IF_ERROR(comm->Run(ag));
  std::vector<size_t> c(P);
  size_t total = 0;
  for (size_t i = 0; i < P; ++i) {
    if (counts[i] < 0 || static_cast<uint64_t>(counts[i]) > n)
      return RemoteError(StrFormat("rank %zu announced %lld entries for n = %llu", i,
                                   static_cast<long long>(counts[i]),
                                   static_cast<unsigned long long>(n)));
    c[i] = static_cast<size_t>(counts[i]);
    total += c[i];
  }
  // In a ring all-gather a rank forwards every block but its right neighbour's.
  *bytesSent += P > 1 ? (total - c[(r + 1) % P]) * (8 + esz) + (P - 1) * 8 : 0;
  std::vector<uint64_t> allIdx(total);
  std::vector<char> allVals(total * esz);
  ag.send = part->idx.data();
  ag.recv = allIdx.data();
  ag.dtype = scapeInt64;
  ag.counts = c;
  SCAPE_RETURN_IF_ERROR(comm->Run(ag));
  ag.send = part->vals.data();
  ag.recv = allVals.data();
  ag.dtype = t;
  SCAPE_RETURN_IF_ERROR(comm->Run(ag));
  // Reduce locally: every rank runs the same code on the same data, so all agree. Values add
  // in rank order in fp32 with one rounding at the end.
  std::vector<std::pair<uint64_t, size_t>> order(total);  // (index, position) sorted by index
  size_t off = 0;
  for (size_t i = 0; i < P; ++i)
    for (size_t k = 0; k < c[i]; ++k, ++off) {
      if (allIdx[off] >= n || (k > 0 && allIdx[off] <= allIdx[off - 1]))
        return RemoteError(StrFormat("rank %zu sent a bad index at entry %zu", i, k));
      order[off] = {allIdx[off], off};
    }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  Part out;
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    float sum = 0.0f;
    bool first = true;
    for (; j < order.size() && order[j].first == order[i].first; ++j) {
      float v = LoadF(t, allVals.data() + order[j].second * esz);
      sum = first ? v : sum + v;
      first = false;
    }
    char v[8];
    StoreF(t, v, sum);
    out.idx.push_back(order[i].first);
    out.vals.insert(out.vals.end(), v, v + esz);
    i = j;
  }
  *part = std::move(out);
  return Status::Ok();
}

}  // namespace

namespace {
// Whether element i of a dense vector is +0 bits (what the dense form holds where no rank had
// an entry), read as one 2- or 4-byte word.
inline bool ZeroAt(const char* v, size_t esz, uint64_t i) {
  if (esz == 4) {
    uint32_t w;
    std::memcpy(&w, v + i * 4, 4);
    return w == 0;
  }
  uint16_t h;
  std::memcpy(&h, v + i * 2, 2);
  return h == 0;
}
}  // namespace

size_t SparseResult::Nnz() const {
  if (!dense) return idx.size();
  const size_t esz = n ? vals.size() / n : 0;
  size_t c = 0;
  for (uint64_t i = 0; i < n; ++i) c += ZeroAt(vals.data(), esz, i) ? 0 : 1;
  return c;
}

void SparseResult::ToDense(void* out, size_t esz) const {
  if (dense) {
    std::memcpy(out, vals.data(), n * esz);
    return;
  }
  std::memset(out, 0, n * esz);
  for (size_t i = 0; i < idx.size(); ++i)
    std::memcpy(static_cast<char*>(out) + idx[i] * esz, vals.data() + i * esz, esz);
}

void SparseResult::ToList(uint64_t* idxOut, void* valsOut, size_t esz) const {
  if (!dense) {
    if (!idx.empty()) {
      std::memcpy(idxOut, idx.data(), idx.size() * 8);
      std::memcpy(valsOut, vals.data(), idx.size() * esz);
    }
    return;
  }
  // The dense form lists the positions whose value is not +0 bits.
  size_t w = 0;
  for (uint64_t i = 0; i < n; ++i) {
    if (ZeroAt(vals.data(), esz, i)) continue;
    idxOut[w] = i;
    std::memcpy(static_cast<char*>(valsOut) + w * esz, vals.data() + i * esz, esz);
    ++w;
  }
}

Status SparseAllReduce(Runner* comm, const uint64_t* idx, const void* vals, size_t nnz, uint64_t n,
                       scapeDataType_t dtype, scapeRedOp_t op, scapeSparseAlgo_t algo,
                       SparseResult* out) {
  const size_t esz = scapeTypeSize(dtype);
  Part part;
  part.idx.assign(idx, idx + nnz);
  part.vals.assign(static_cast<const char*>(vals), static_cast<const char*>(vals) + nnz * esz);
  uint64_t sent = 0;
  if (comm->nranks() > 1) {
    if (algo == scapeSparseAllGather) {
      SCAPE_RETURN_IF_ERROR(ViaAllGather(comm, &part, n, dtype, esz, &sent));
    } else {
      SCAPE_RETURN_IF_ERROR(RecursiveDoubling(comm, &part, n, dtype, esz, &sent));
    }
  }
  if (op == scapeAvg)
    SCAPE_RETURN_IF_ERROR(kernels::ToStatus(
        kernels::DivideInPlace(dtype, part.vals.data(), part.vals.size() / esz, comm->nranks()),
        "sparse average"));
  out->n = n;
  out->dense = part.dense;
  out->idx = std::move(part.idx);
  out->vals = std::move(part.vals);
  out->bytesSent = sent;
  return Status::Ok();
}

}  // namespace coll
}  // namespace scape
