#include "plugin/mask/mask.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/clock.h"
#include "base/log.h"
#include "kernels/cpu/gather.h"
#include "kernels/cpu/mask_codec.h"
#include "kernels/cpu/topk.h"
#include "plugin/coll/schedule.h"

namespace scape {
namespace {

// The 32-bit local index encoding (the kernels' codec has the other three): the same 24-byte
// header as the kernels' encodings, encoding byte 4, then k little-endian uint32.
constexpr uint8_t kIndices32 = 4;
constexpr size_t kHeader = kernels::kMaskHeaderBytes;

uint64_t Fingerprint(uint64_t n, const std::vector<uint64_t>& offs,
                     const std::vector<uint8_t>& dense, scapeOwnership_t own, int nranks) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(n);
  mix(offs.size());
  for (uint64_t o : offs) mix(o);
  for (uint8_t d : dense) mix(d != 0);
  mix(static_cast<uint64_t>(own));
  mix(static_cast<uint64_t>(nranks));
  return h;
}

kernels::MaskEncoding KernelEncoding(scapeMaskEncoding_t e) {
  switch (e) {
    case scapeMaskEncodingBitmap:
      return kernels::MaskEncoding::kBitmap;
    case scapeMaskEncodingEliasFano:
      return kernels::MaskEncoding::kEliasFano;
    default:
      return kernels::MaskEncoding::kDeltaVarint;
  }
}

}  // namespace

void Mask::BuildOwnership(const std::vector<uint64_t>& offs, const std::vector<uint8_t>& dense,
                          scapeOwnership_t ownership) {
  const size_t nseg = offs.size() - 1;
  owned_.assign(static_cast<size_t>(nranks_), {});
  ownedSize_.assign(static_cast<size_t>(nranks_), 0);
  auto isDense = [&](size_t s) { return !dense.empty() && dense[s] != 0; };
  if (ownership == scapeOwnershipShards) {
    for (int r = 0; r < nranks_; ++r) {
      const uint64_t b = coll::BlockOffset(n_, nranks_, r),
                     e = coll::BlockOffset(n_, nranks_, r + 1);
      // Segments overlapping [b, e): binary search the first one.
      size_t s = static_cast<size_t>(std::upper_bound(offs.begin(), offs.end(), b) - offs.begin());
      s = s == 0 ? 0 : s - 1;
      for (; s < nseg && offs[s] < e; ++s) {
        uint64_t pb = std::max(b, offs[s]), pe = std::min(e, offs[s + 1]);
        if (pb < pe) owned_[static_cast<size_t>(r)].push_back(Piece{pb, pe, isDense(s)});
      }
    }
  } else {
    // Largest segment first, each to the least-loaded rank (ties: lower segment, lower rank).
    std::vector<size_t> order(nseg);
    for (size_t s = 0; s < nseg; ++s) order[s] = s;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return offs[x + 1] - offs[x] > offs[y + 1] - offs[y];
    });
    std::vector<uint64_t> load(static_cast<size_t>(nranks_), 0);
    for (size_t s : order) {
      if (offs[s + 1] == offs[s]) continue;
      size_t best = 0;
      for (size_t r = 1; r < load.size(); ++r)
        if (load[r] < load[best]) best = r;
      load[best] += offs[s + 1] - offs[s];
      owned_[best].push_back(Piece{offs[s], offs[s + 1], isDense(s)});
    }
    for (auto& v : owned_)
      std::sort(v.begin(), v.end(),
                [](const Piece& x, const Piece& y) { return x.begin < y.begin; });
  }
  base_.assign(static_cast<size_t>(nranks_), 0);
  for (int r = 0; r < nranks_; ++r) {
    const std::vector<Piece>& mine = owned_[static_cast<size_t>(r)];
    for (size_t i = 0; i < mine.size(); ++i) {
      ownedSize_[static_cast<size_t>(r)] += mine[i].end - mine[i].begin;
      if (i > 0 && mine[i].begin != mine[i - 1].end) base_[static_cast<size_t>(r)] = kNoBase;
    }
    if (!mine.empty() && base_[static_cast<size_t>(r)] != kNoBase)
      base_[static_cast<size_t>(r)] = mine[0].begin;
  }
}

Status Mask::Create(Comm* comm, uint64_t n, const std::vector<uint64_t>& segOffsets,
                    const std::vector<uint8_t>& dense, scapeOwnership_t ownership,
                    scapeMaskEncoding_t encoding, std::unique_ptr<Mask>* out) {
  std::unique_ptr<Mask> m(new Mask());
  m->comm_ = comm;
  m->rank_ = comm->rank();
  m->nranks_ = comm->nranks();
  m->n_ = n;
  m->encoding_ = encoding;
  m->ownership_ = ownership;
  const size_t P = static_cast<size_t>(m->nranks_);

  // Every rank must have built the same layout: compare fingerprints on every rank.
  int64_t fp = static_cast<int64_t>(Fingerprint(n, segOffsets, dense, ownership, m->nranks_));
  std::vector<int64_t> fps(P);
  coll::CollArgs ag = coll::AllGatherArgs(&fp, fps.data(), 1, scapeInt64);
  SCAPE_RETURN_IF_ERROR(comm->Run(ag));
  for (size_t r = 0; r < P; ++r)
    if (fps[r] != fp)
      return InvalidUsage(
          StrFormat("rank %zu built a different mask layout than rank %d (layout "
                    "fingerprints %016llx and %016llx): every rank must pass the "
                    "same n, segments, dense flags and ownership",
                    r, m->rank_, static_cast<unsigned long long>(fps[r]),
                    static_cast<unsigned long long>(fp)));

  m->BuildOwnership(segOffsets, dense, ownership);
  m->curCount_.assign(P, 0);
  m->curOff_.assign(P, 0);
  m->nextCount_.assign(P, 0);
  m->nextOff_.assign(P, 0);
  SCAPE_RETURN_IF_ERROR(comm->CreateChild(&m->child_));
  m->thread_ = std::thread(&Mask::ThreadMain, m.get());
  *out = std::move(m);
  return Status::Ok();
}

Mask::~Mask() {
  if (thread_.joinable()) {
    if (inFlight_) (void)SyncWait();
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  child_.reset();
}

Status Mask::SetNextIndices(const uint64_t* idx, size_t k) {
  if (inFlight_) return InvalidUsage("a mask sync is in flight: wait for it first");
  const std::vector<Piece>& mine = owned_[static_cast<size_t>(rank_)];
  // Strictly increasing indices inside the owned part: never more than its size. Checked
  // before anything is allocated for them.
  const uint64_t nown = ownedSize_[static_cast<size_t>(rank_)];
  if (k > nown)
    return InvalidArgument(
        StrFormat("k = %zu indices, but rank %d owns only %llu elements "
                  "(indices must be distinct positions of its owned part)",
                  k, rank_, static_cast<unsigned long long>(nown)));
  std::vector<uint64_t> local;
  local.reserve(k);
  size_t i = 0;
  uint64_t base = 0;
  for (const Piece& p : mine) {
    if (p.dense) {
      for (uint64_t x = p.begin; x < p.end; ++x) local.push_back(base + (x - p.begin));
      while (i < k && idx[i] < p.end) {  // listing dense positions is allowed: skip them
        if (idx[i] < p.begin) break;
        if (i > 0 && idx[i] <= idx[i - 1]) break;
        ++i;
      }
    } else {
      while (i < k && idx[i] >= p.begin && idx[i] < p.end) {
        if (i > 0 && idx[i] <= idx[i - 1])
          return InvalidArgument(
              StrFormat("indices[%zu] = %llu is not above indices[%zu]: "
                        "indices must be strictly increasing",
                        i, static_cast<unsigned long long>(idx[i]), i - 1));
        local.push_back(base + (idx[i] - p.begin));
        ++i;
      }
    }
    base += p.end - p.begin;
  }
  if (i < k)
    return InvalidArgument(
        StrFormat("indices[%zu] = %llu is not in rank %d's owned part (or the "
                  "indices are not strictly increasing)",
                  i, static_cast<unsigned long long>(idx[i]), rank_));
  nextLocal_ = std::move(local);
  nextSet_ = true;
  return Status::Ok();
}

void Mask::TopkPlan(double density, TopkTable* t) const {
  const std::vector<Piece>& mine = owned_[static_cast<size_t>(rank_)];
  // One kernel call over this rank's pieces; the gaps between them are segments with k = 0.
  std::vector<uint64_t>& offs = t->offsets;
  offs.clear();
  t->k.clear();
  for (const Piece& p : mine) {
    if (!offs.empty() && offs.back() < p.begin) {
      t->k.push_back(0);
      offs.push_back(p.begin);
    }
    if (offs.empty()) offs.push_back(p.begin);
    // An always-dense piece selects nothing here: SetNextIndices adds all of it.
    const uint64_t len = p.end - p.begin;
    uint64_t kk =
        p.dense ? 0 : static_cast<uint64_t>(std::floor(density * static_cast<double>(len)));
    if (!p.dense && len > 0) kk = std::max<uint64_t>(1, std::min(kk, len));
    t->k.push_back(kk);
    offs.push_back(p.end);
  }
  t->outOffsets.assign(t->k.size() + 1, 0);
  t->total =
      t->k.empty() ? 0 : kernels::TopkOutOffsets(t->k.data(), t->k.size(), t->outOffsets.data());
}

kernels::TopkSegments Mask::TopkTable::Segments() const {
  kernels::TopkSegments s;
  s.offsets = offsets.data();
  s.k = k.data();
  s.out_offsets = outOffsets.data();
  s.nseg = k.size();
  return s;
}

Status Mask::SetNextFromTopk(const uint64_t* sel, size_t total) {
  Status st = SetNextIndices(sel, total);
  if (!st.ok() && st.code() == scapeInvalidArgument)
    return InternalError(StrFormat("top-k selection: %s", st.message().c_str()));
  return st;
}

Status Mask::SelectNextTopk(const float* stat, double density) {
  if (inFlight_) return InvalidUsage("a mask sync is in flight: wait for it first");
  TopkTable t;
  TopkPlan(density, &t);
  std::vector<uint64_t> sel(t.total);
  if (t.total > 0) {
    kernels::KernelStatus ks =
        kernels::TopkAbs(stat, t.Segments(), kernels::TopkOptions(), sel.data(), nullptr, &topkWs_);
    if (ks != kernels::KernelStatus::kOk)
      return Status(kernels::ToResult(ks),
                    StrFormat("top-k selection failed: %s", kernels::KernelStatusString(ks)));
  }
  return SetNextFromTopk(sel.data(), sel.size());
}

Status Mask::Encode(std::vector<uint8_t>* out) {
  const uint64_t nown = ownedSize_[static_cast<size_t>(rank_)];
  const uint64_t k = nextLocal_.size();
  const uint64_t* idx = nextLocal_.data();
  uint64_t sizes[scapeNumMaskEncodings] = {0};
  sizes[scapeMaskEncodingBitmap] = kernels::BitmapEncodedBytes(nown);
  sizes[scapeMaskEncodingEliasFano] = kernels::EliasFanoEncodedBytes(nown, k);
  sizes[scapeMaskEncodingDeltaVarint] = kernels::DeltaVarintEncodedBytes(idx, k);
  const bool idx32ok = nown <= (uint64_t{1} << 32);
  sizes[scapeMaskEncodingIndices] = idx32ok ? kHeader + 4 * k : UINT64_MAX;
  scapeMaskEncoding_t enc = encoding_;
  if (enc == scapeMaskEncodingAuto) {
    enc = scapeMaskEncodingBitmap;
    for (int e = 2; e < scapeNumMaskEncodings; ++e)
      if (sizes[e] < sizes[enc]) enc = static_cast<scapeMaskEncoding_t>(e);
  }
  // A forced 32-bit encoding with an owned part above 2^32 was refused by SyncStart; auto never
  // picks it then (its size is UINT64_MAX).
  const uint64_t bytes = sizes[enc];
  // Every byte below `bytes` is written below; only the header's reserved bytes (32-bit
  // encoding) and the padding to 4 bytes need zeros. The buffer is kept between syncs.
  out->resize((bytes + 3) / 4 * 4);
  std::fill(out->begin() + static_cast<ptrdiff_t>(bytes), out->end(), uint8_t{0});
  if (enc == scapeMaskEncodingIndices) {
    std::fill(out->begin(), out->begin() + static_cast<ptrdiff_t>(kHeader), uint8_t{0});
    (*out)[0] = kIndices32;
    std::memcpy(out->data() + 8, &nown, 8);
    std::memcpy(out->data() + 16, &k, 8);
    for (uint64_t i = 0; i < k; ++i) {
      uint32_t v = static_cast<uint32_t>(idx[i]);
      std::memcpy(out->data() + kHeader + 4 * i, &v, 4);
    }
  } else {
    size_t written = 0;
    kernels::KernelStatus ks =
        kernels::MaskEncode(KernelEncoding(enc), idx, k, nown, out->data(), bytes, &written);
    if (ks != kernels::KernelStatus::kOk || written != bytes)
      return InternalError(StrFormat("mask encoding failed: %s", kernels::KernelStatusString(ks)));
  }
  pendingInfo_ = scapeMaskSyncInfo_t{};
  pendingInfo_.encoding = enc;
  pendingInfo_.sentBytes = bytes;
  for (int e = 1; e < scapeNumMaskEncodings; ++e) pendingInfo_.bytesByEncoding[e] = sizes[e];
  return Status::Ok();
}

Status Mask::PartCount(int r, const uint8_t* buf, size_t size, uint64_t* k) const {
  const uint64_t nown = ownedSize_[static_cast<size_t>(r)];
  if (size >= 1 && buf[0] == kIndices32) {
    uint64_t hn, hk;
    if (size < kHeader) return RemoteError(StrFormat("rank %d's mask part is truncated", r));
    std::memcpy(&hn, buf + 8, 8);
    std::memcpy(&hk, buf + 16, 8);
    for (size_t i = 1; i < 8; ++i)
      if (buf[i] != 0) return RemoteError(StrFormat("rank %d's mask part has a bad header", r));
    if (hn != nown || hk > nown || (size - kHeader) / 4 != hk || (size - kHeader) % 4 != 0)
      return RemoteError(
          StrFormat("rank %d's mask part does not match its owned part "
                    "(n %llu, k %llu, %zu bytes; it owns %llu elements)",
                    r, static_cast<unsigned long long>(hn), static_cast<unsigned long long>(hk),
                    size, static_cast<unsigned long long>(nown)));
    *k = hk;
    return Status::Ok();
  }
  kernels::MaskHeader h;
  kernels::KernelStatus ks = kernels::MaskReadHeader(buf, size, &h);
  if (ks == kernels::KernelStatus::kOk && h.n != nown) ks = kernels::KernelStatus::kCorrupt;
  if (ks != kernels::KernelStatus::kOk)
    return RemoteError(
        StrFormat("rank %d's mask part failed validation: %s", r, kernels::KernelStatusString(ks)));
  *k = h.k;  // MaskReadHeader checked k <= n
  return Status::Ok();
}

Status Mask::DecodeInto(int r, const uint8_t* buf, size_t size, uint64_t k, uint64_t* out) const {
  const uint64_t nown = ownedSize_[static_cast<size_t>(r)];
  // A contiguous owned range decodes straight into global positions (one addition per
  // index); otherwise into owned-space indices, mapped piece by piece afterwards.
  const uint64_t base = base_[static_cast<size_t>(r)];
  const uint64_t add = base == kNoBase ? 0 : base;
  if (buf[0] == kIndices32) {  // PartCount checked the header and the size
    uint32_t prev = 0;
    for (uint64_t i = 0; i < k; ++i) {
      uint32_t v;
      std::memcpy(&v, buf + kHeader + 4 * i, 4);
      if (v >= nown || (i > 0 && v <= prev))
        return RemoteError(
            StrFormat("rank %d's mask part has an index out of range or out of "
                      "order at position %llu",
                      r, static_cast<unsigned long long>(i)));
      out[i] = v + add;
      prev = v;
    }
  } else {
    size_t got = 0;
    kernels::KernelStatus ks = kernels::MaskDecode(buf, size, nown, add, out, k, &got);
    if (ks == kernels::KernelStatus::kOk && got != k) ks = kernels::KernelStatus::kCorrupt;
    if (ks != kernels::KernelStatus::kOk)
      return RemoteError(StrFormat("rank %d's mask part failed validation: %s", r,
                                   kernels::KernelStatusString(ks)));
  }
  if (base == kNoBase) ToGlobal(r, out, k);
  return Status::Ok();
}

void Mask::CopyToGlobal(int r, const uint64_t* src, uint64_t* dst, uint64_t k) const {
  const uint64_t base = base_[static_cast<size_t>(r)];
  if (base == kNoBase) {
    std::copy(src, src + k, dst);
    ToGlobal(r, dst, k);
    return;
  }
  for (uint64_t i = 0; i < k; ++i) dst[i] = src[i] + base;
}

void Mask::ToGlobal(int r, uint64_t* out, uint64_t k) const {
  // Owned-space local indices (validated: increasing, below rank r's owned size) to global
  // positions, in place: each piece's run of indices moves by the same offset.
  uint64_t* p = out;
  uint64_t* const end = out + k;
  uint64_t base = 0;
  for (const Piece& pc : owned_[static_cast<size_t>(r)]) {
    if (p == end) break;
    const uint64_t len = pc.end - pc.begin;
    uint64_t* q = std::lower_bound(p, end, base + len);
    const uint64_t delta = pc.begin - base;  // pieces increase, so begin >= the local base
    for (; p < q; ++p) *p += delta;
    base += len;
  }
}

Status Mask::SyncStart() {
  if (inFlight_) return InvalidUsage("a mask sync is already in flight");
  if (!comm_->error().ok()) return comm_->error();
  // Nothing selected since the last advance: the part holds the always-dense segments only
  // (as scapeMaskSetNextIndices with k = 0 would).
  if (!nextSet_) SCAPE_RETURN_IF_ERROR(SetNextIndices(nullptr, 0));
  if (encoding_ == scapeMaskEncodingIndices &&
      ownedSize_[static_cast<size_t>(rank_)] > (uint64_t{1} << 32))
    return InvalidUsage("32-bit index encoding chosen but this rank owns more than 2^32 elements");
  // The sync thread decodes into next_: if an operation still holds that buffer (it was
  // current before the last advance), decode into a fresh one instead.
  // A buffer such a holder gave back since (spare_) is reused, so a holder that keeps the old
  // current mask through every step (the optimizer, for its packed momentum) costs no
  // allocation and no page faults after the first steps.
  if (next_.use_count() > 1) {
    if (spare_ && spare_.use_count() == 1) {
      next_.swap(spare_);
    } else {
      spare_ = std::move(next_);
      next_ = std::make_shared<std::vector<uint64_t>>();
    }
  }
  // The encoding, the exchange and the decoding all run on the sync thread.
  startNs_ = NowNs();
  {
    std::lock_guard<std::mutex> g(mu_);
    requested_ = true;
    finished_ = false;
  }
  cv_.notify_all();
  inFlight_ = true;
  ++generation_;
  return Status::Ok();
}

Status Mask::SyncTest(bool* done) {
  if (!inFlight_) {
    *done = true;
    return Status::Ok();
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    *done = finished_;
  }
  if (!*done) return Status::Ok();
  inFlight_ = false;
  if (syncStatus_.ok()) {
    synced_ = true;
    info_ = pendingInfo_;
  }
  return syncStatus_;
}

Status Mask::SyncWait() {
  if (!inFlight_) return Status::Ok();
  {
    std::unique_lock<std::mutex> lk(mu_);
    // The thread's own collectives carry the communicator's timeout; this is a backstop.
    const auto limit =
        std::chrono::milliseconds(static_cast<int64_t>(comm_->config().timeoutMs) * 3 + 5000);
    if (!cv_.wait_for(lk, limit, [this] { return finished_; }))
      return TimeoutError("the mask sync thread did not finish in time");
  }
  bool done = false;
  return SyncTest(&done);
}

Status Mask::Advance() {
  if (inFlight_) return InvalidUsage("a mask sync is in flight: wait for it before advancing");
  if (!synced_) return InvalidUsage("no mask sync completed since the last advance");
  cur_.swap(next_);
  curCount_.swap(nextCount_);
  curOff_.swap(nextOff_);
  synced_ = false;
  nextSet_ = false;
  ++generation_;
  return Status::Ok();
}

std::vector<size_t> Mask::RankCounts() const {
  return std::vector<size_t>(curCount_.begin(), curCount_.end());
}

void Mask::ThreadMain() {
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    cv_.wait(lk, [this] { return stop_ || requested_; });
    if (stop_) return;
    requested_ = false;
    lk.unlock();
    Status st = RunSync();
    lk.lock();
    syncStatus_ = st;
    finished_ = true;
    cv_.notify_all();
  }
}

Status Mask::RunSync() {
  const size_t P = static_cast<size_t>(nranks_);
  SCAPE_RETURN_IF_ERROR(Encode(&sendEnc_).Prepend("mask sync"));
  // Exact sizes first, then the parts (each padded to 4 bytes), back to back in rank order.
  std::vector<int64_t> sizes(P);
  int64_t mine = static_cast<int64_t>(pendingInfo_.sentBytes);
  coll::CollArgs ag = coll::AllGatherArgs(&mine, sizes.data(), 1, scapeInt64);
  SCAPE_RETURN_IF_ERROR(child_->Run(ag).Prepend("mask sync"));
  std::vector<size_t> counts(P);
  size_t totalWords = 0;
  for (size_t r = 0; r < P; ++r) {
    // A part can never exceed the largest encoding of its owned part (the bitmap, or the
    // varint code of every element): refuse anything bigger before allocating.
    const uint64_t cap = kHeader + 10 * ownedSize_[r] + 64;
    if (sizes[r] < static_cast<int64_t>(kHeader) || static_cast<uint64_t>(sizes[r]) > cap)
      return RemoteError(StrFormat(
          "mask sync: rank %zu announced a %lld-byte part (expected "
          "%zu..%llu for its owned part)",
          r, static_cast<long long>(sizes[r]), kHeader, static_cast<unsigned long long>(cap)));
    counts[r] = (static_cast<size_t>(sizes[r]) + 3) / 4;
    totalWords += counts[r];
  }
  recvEnc_.resize(totalWords * 4);  // kept between syncs: grows only
  ag.send = sendEnc_.data();
  ag.recv = recvEnc_.data();
  ag.dtype = scapeInt32;
  ag.counts = counts;
  SCAPE_RETURN_IF_ERROR(child_->Run(ag).Prepend("mask sync"));
  // Headers first, so every part decodes straight into its place in next_.
  nextCount_.assign(P, 0);
  nextOff_.assign(P, 0);
  uint64_t total = 0, totalBytes = 0;
  size_t off = 0;
  for (size_t r = 0; r < P; ++r) {
    SCAPE_RETURN_IF_ERROR(PartCount(static_cast<int>(r), recvEnc_.data() + off * 4,
                                    static_cast<size_t>(sizes[r]), &nextCount_[r])
                              .Prepend("mask sync"));
    nextOff_[r] = total;
    total += nextCount_[r];
    off += counts[r];
    totalBytes += static_cast<uint64_t>(sizes[r]);
  }
  next_->resize(total);  // the buffer of the mask before the last advance: no allocation
  off = 0;
  for (size_t r = 0; r < P; ++r) {
    if (static_cast<int>(r) == rank_ && nextCount_[r] == nextLocal_.size()) {
      // Our own part: the indices we encoded are at hand, no need to decode them.
      CopyToGlobal(rank_, nextLocal_.data(), next_->data() + nextOff_[r], nextCount_[r]);
      off += counts[r];
      continue;
    }
    SCAPE_RETURN_IF_ERROR(DecodeInto(static_cast<int>(r), recvEnc_.data() + off * 4,
                                     static_cast<size_t>(sizes[r]), nextCount_[r],
                                     next_->data() + nextOff_[r])
                              .Prepend("mask sync"));
    off += counts[r];
  }
  pendingInfo_.totalBytes = totalBytes;
  pendingInfo_.syncSeconds = static_cast<double>(NowNs() - startNs_) * 1e-9;
  return Status::Ok();
}

void Mask::Pack(const void* dense, void* packed, size_t esz) const {
  kernels::GatherByIndex(dense, cur_->data(), cur_->size(), esz, packed);
}

void Mask::Unpack(const void* packed, void* dense, size_t esz) const {
  kernels::ScatterByIndex(packed, cur_->data(), cur_->size(), esz, dense);
}

char* Mask::PackBuffer(size_t bytes) {
  if (packBuf_.size() < bytes) packBuf_.resize(bytes);
  return packBuf_.data();
}

}  // namespace scape
