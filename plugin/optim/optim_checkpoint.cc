// The optimizer's checkpoint (scapeOptimCheckpointSize / Save / Load): the format, its
// validation and the restore. Split from optim.cc (issue 24: no library source over 1,000
// lines); the code is unchanged.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/dtypes.h"
#include "plugin/coll/coll.h"
#include "plugin/optim/optim.h"
#include "plugin/optim/optim_device.h"
#include "plugin/optim/optim_internal.h"

namespace scape {
namespace {

using optim_internal::Fnv;

// Checkpoint format, version 1 (little-endian host layout, as written by Save):
//   0 magic "SCAPEOPT" | 8 u32 version | 12 u32 header bytes (144) | 16 u64 total bytes |
//   24 u64 checksum of bytes [32, total) | 32 u64 layout fingerprint | 40 i32 nranks |
//   44 i32 rank | 48 u64 n | 56 i64 steps completed | 64 f32 lr, beta1, beta2, eps,
//   weight decay, max grad norm | 88 i32 bias correction | 92 i32 payload type |
//   96 i32 ownership | 100 i32 mask ownership | 104 i32 next mask present | 108 i32 0 |
//   112 f64 density | 120 i64 warm-up steps | 128 u64 kc | 136 u64 kn |
//   144 momentum (n f32) | residual (n f32) | this rank's part of the current mask (kc u64) |
//   its part of the next mask (kn u64).
// Version 2 (mixed precision) is version 1 with: 108 i32 the type of the params the fp32
// master weights shadow (scapeBfloat16 or scapeFloat16; 0 = scapeFloat32: no masters), and with
// masters, n f32 master weights after the residual (before the mask parts).
// Version 3 is version 2 with 108 split: 108 u16 the master type, 110 u16 the entering rule
// (scapeOptimEntering_t; 0 = the paper's). Versions 1 and 2 load (their u16 at 110 is 0: the
// paper's rule).
// Version 4 (packed momentum, issue 24) has a 160-byte header: version 3's and
//   144 u64 km, the number of momentum values | 152 u64 own: 1 when the momentum has a mask of
//   its own (a step skipped after the mask advanced), 0 when it lies on the current mask,
// then residual (n f32) | master weights (n f32, with masters) | momentum (km f32): at the
// current mask's entries in mask order (every rank's part: the momentum is the same on every
// rank), or with own = 1 at the km positions that follow | those positions (km u64, own = 1
// only, increasing) | this rank's part of the current mask (kc u64) | of the next (kn u64).
// Versions 1 to 3 load: their dense momentum is packed at the restored current mask (values
// outside it, which only a skipped step leaves, keep a mask of their own).
// Version 5 (written now; issue 30) is version 4 with the u16 at 110 split: 110 u8 the entering
// rule, 111 u8 the clip norm (scapeOptimClipNorm_t). Earlier versions load with the
// recovered-gradient norm (their byte 111 is the high half of the entering rule: 0).
// Version 6 (written now; issue 42) is version 5 with the i32 at 104 split: 104 u8 next mask
// present (0 or 1), 105 u8 the density schedule's shape (scapeDensitySchedule_t), 106 u16 0.
// Earlier versions load with the geometric shape (their bytes 105-107 are the high bytes of a
// 0 or 1: 0), the only one they could have run.
constexpr char kMagic[8] = {'S', 'C', 'A', 'P', 'E', 'O', 'P', 'T'};
constexpr uint32_t kVersion = 6;
constexpr size_t kHeaderV3 = 144;  // versions 1 to 3
constexpr size_t kHeader = 160;    // versions 4 to 6

template <typename T>
void Put(uint8_t* b, size_t off, T v) {
  std::memcpy(b + off, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* b, size_t off) {
  T v;
  std::memcpy(&v, b + off, sizeof(T));
  return v;
}

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// 64-bit checksum, four lanes of 8-byte words (every step is a bijection of the lane state, so
// any change of one word is always detected), then the tail bytes and the length.
uint64_t Checksum(const uint8_t* p, size_t n) {
  constexpr uint64_t K1 = 0x9e3779b97f4a7c15ull, K2 = 0xc2b2ae3d27d4eb4full;
  uint64_t h[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                   0x082efa98ec4e6c89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      h[l] = Rotl(h[l] ^ (w * K1), 31) * K2;
    }
  for (; i < n; ++i) h[0] = (h[0] ^ p[i]) * 1099511628211ull;
  uint64_t x = static_cast<uint64_t>(n) * K1;
  for (int l = 0; l < 4; ++l) {
    x = (x ^ h[l]) * K2;
    x ^= x >> 29;
  }
  return x;
}

}  // namespace

uint64_t Optimizer::LayoutFingerprint() const {
  uint64_t h = 1469598103934665603ull;
  h = Fnv(h, layout_.n);
  h = Fnv(h, layout_.offsets.size());
  for (uint64_t o : layout_.offsets) h = Fnv(h, o);
  for (uint8_t d : layout_.dense) h = Fnv(h, d != 0);
  h = Fnv(h, static_cast<uint64_t>(layout_.ownership));
  h = Fnv(h, static_cast<uint64_t>(layout_.maskOwnership));
  h = Fnv(h, static_cast<uint64_t>(nranks_));
  return h;
}

Status Optimizer::CheckpointSize(size_t* bytes) {
  // The momentum's size is known on the host only (a host wait for a device step).
  if (dev_) SCAPE_RETURN_IF_ERROR(DevicePull().Prepend("copying the device state"));
  if (pending_ && mask_->SyncInFlight())
    SCAPE_RETURN_IF_ERROR(mask_->SyncWait().Prepend("mask sync of the last step"));
  const uint64_t kc = mask_->RankCount(rank_);
  const uint64_t kn = pending_ ? mask_->NextRankCount(rank_) : 0;
  const uint64_t masterBytes = masterType_ != scapeFloat32 ? 4 * layout_.n : 0;
  const uint64_t km = m_.size();
  *bytes = kHeader + 4 * layout_.n + masterBytes + 4 * km + (momOwn_ ? 8 * km : 0) + 8 * (kc + kn);
  return Status::Ok();
}

Status Optimizer::Save(void* buf, size_t capacity, size_t* written) {
  if (dev_) SCAPE_RETURN_IF_ERROR(DevicePull().Prepend("copying the device state"));
  SCAPE_RETURN_IF_ERROR(CheckMaskUse());
  size_t total = 0;
  SCAPE_RETURN_IF_ERROR(CheckpointSize(&total));
  if (capacity < total)
    return InvalidArgument(
        StrFormat("capacity = %zu: the checkpoint needs %zu bytes "
                  "(scapeOptimCheckpointSize)",
                  capacity, total));
  uint8_t* b = static_cast<uint8_t*>(buf);
  const uint64_t n = layout_.n;
  const uint64_t kc = mask_->RankCount(rank_);
  const uint64_t kn = pending_ ? mask_->NextRankCount(rank_) : 0;
  std::memset(b, 0, kHeader);
  std::memcpy(b, kMagic, 8);
  Put<uint32_t>(b, 8, kVersion);
  Put<uint32_t>(b, 12, static_cast<uint32_t>(kHeader));
  Put<uint64_t>(b, 16, total);
  Put<uint64_t>(b, 32, LayoutFingerprint());
  Put<int32_t>(b, 40, nranks_);
  Put<int32_t>(b, 44, rank_);
  Put<uint64_t>(b, 48, n);
  Put<int64_t>(b, 56, step_);
  Put<float>(b, 64, hyper_.lr);
  Put<float>(b, 68, hyper_.beta1);
  Put<float>(b, 72, hyper_.beta2);
  Put<float>(b, 76, hyper_.eps);
  Put<float>(b, 80, hyper_.weightDecay);
  Put<float>(b, 84, hyper_.maxGradNorm);
  Put<int32_t>(b, 88, static_cast<int32_t>(hyper_.bias));
  Put<int32_t>(b, 92, dtypes::Row(hyper_.payload)->checkpointCode);  // a validated payload type
  Put<int32_t>(b, 96, static_cast<int32_t>(layout_.ownership));
  Put<int32_t>(b, 100, static_cast<int32_t>(layout_.maskOwnership));
  Put<uint8_t>(b, 104, pending_ ? 1 : 0);
  Put<uint8_t>(b, 105, static_cast<uint8_t>(hyper_.schedule));  // version 6
  // Version 3: 108 u16 master type, 110 u16 entering rule (version 2 wrote an i32 master type
  // there, whose high half is 0: the paper's entering rule).
  Put<uint16_t>(b, 108, static_cast<uint16_t>(masterType_));
  Put<uint8_t>(b, 110, static_cast<uint8_t>(hyper_.entering));
  Put<uint8_t>(b, 111, static_cast<uint8_t>(hyper_.clipNorm));  // version 5
  Put<double>(b, 112, hyper_.density);
  Put<int64_t>(b, 120, hyper_.warmupSteps);
  Put<uint64_t>(b, 128, kc);
  Put<uint64_t>(b, 136, kn);
  const uint64_t km = m_.size();
  Put<uint64_t>(b, 144, km);
  Put<uint64_t>(b, 152, momOwn_ ? 1 : 0);
  size_t off = kHeader;
  if (n) std::memcpy(b + off, e_.data(), 4 * n);
  off += 4 * n;
  if (masterType_ != scapeFloat32) {
    if (n) std::memcpy(b + off, master_.data(), 4 * n);
    off += 4 * n;
  }
  if (!momOwn_) {
    if (km) std::memcpy(b + off, m_.data(), 4 * km);
    off += 4 * km;
  } else {
    // Its own mask, in position order (the runs in position order, each run's entries sorted).
    size_t w = 0;
    for (const kernels::MaskRun& r : momRuns_)
      for (uint64_t j = r.jb; j < r.je; ++j, ++w) {
        Put<float>(b, off + 4 * w, m_[j]);
        Put<uint64_t>(b, off + 4 * km + 8 * w, momIdx_[j]);
      }
    off += 12 * km;
  }
  if (kc) std::memcpy(b + off, mask_->Current().data() + mask_->RankOffset(rank_), 8 * kc);
  off += 8 * kc;
  if (kn) std::memcpy(b + off, mask_->Next().data() + mask_->NextRankOffset(rank_), 8 * kn);
  Put<uint64_t>(b, 24, Checksum(b + 32, total - 32));
  *written = total;
  return Status::Ok();
}

Status Optimizer::ValidateOwnIndices(const uint8_t* p, uint64_t k, const char* what) const {
  const std::vector<Mask::Piece>& mine = mask_->Owned(rank_);
  size_t pi = 0;
  uint64_t prev = 0;
  for (uint64_t j = 0; j < k; ++j) {
    const uint64_t x = Get<uint64_t>(p, 8 * j);
    if (j > 0 && x <= prev)
      return InvalidArgument(StrFormat("checkpoint: %s mask entry %llu is not above the one before",
                                       what, static_cast<unsigned long long>(j)));
    while (pi < mine.size() && x >= mine[pi].end) ++pi;
    if (pi == mine.size() || x < mine[pi].begin)
      return InvalidArgument(StrFormat(
          "checkpoint: %s mask entry %llu (position %llu) is not in "
          "rank %d's owned part",
          what, static_cast<unsigned long long>(j), static_cast<unsigned long long>(x), rank_));
    prev = x;
  }
  return Status::Ok();
}

Status Optimizer::ValidateCheckpoint(const uint8_t* b, size_t size, OptimHyper* hyper,
                                     int64_t* step, bool* hasNext, uint64_t* kc, uint64_t* kn,
                                     scapeDataType_t* masterType, CheckpointParts* parts) const {
  if (size < kHeaderV3)
    return InvalidArgument(
        StrFormat("checkpoint: size = %zu is below the %zu-byte header "
                  "(truncated?)",
                  size, kHeaderV3));
  if (std::memcmp(b, kMagic, 8) != 0)
    return InvalidArgument("checkpoint: bad magic: not a SCAPE optimizer checkpoint");
  const uint32_t ver = Get<uint32_t>(b, 8);
  const size_t header = ver >= 4 ? kHeader : kHeaderV3;
  if (ver < 1 || ver > kVersion || Get<uint32_t>(b, 12) != header)
    return InvalidArgument(
        StrFormat("checkpoint: version %u, this library reads versions 1 to %u", ver, kVersion));
  if (size < header)
    return InvalidArgument(
        StrFormat("checkpoint: size = %zu is below the %zu-byte header "
                  "(truncated?)",
                  size, header));
  const uint64_t total = Get<uint64_t>(b, 16);
  if (total != size)
    return InvalidArgument(
        StrFormat("checkpoint: size = %zu but the header says %llu bytes "
                  "(truncated or padded)",
                  size, static_cast<unsigned long long>(total)));
  if (Checksum(b + 32, size - 32) != Get<uint64_t>(b, 24))
    return InvalidArgument("checkpoint: checksum mismatch (the data is corrupted)");
  const int32_t np = Get<int32_t>(b, 40), rk = Get<int32_t>(b, 44);
  if (np != nranks_)
    return InvalidArgument(
        StrFormat("checkpoint: saved on %d ranks, this communicator has %d: "
                  "loading on another rank count (re-sharding) is not "
                  "supported",
                  np, nranks_));
  if (rk != rank_)
    return InvalidArgument(
        StrFormat("checkpoint: saved by rank %d, loaded on rank %d: each rank "
                  "loads its own checkpoint",
                  rk, rank_));
  if (Get<uint64_t>(b, 48) != layout_.n || Get<uint64_t>(b, 32) != LayoutFingerprint())
    return InvalidArgument(
        StrFormat("checkpoint: layout fingerprint %016llx (n = %llu) differs "
                  "from this optimizer's %016llx (n = %llu): the checkpoint "
                  "comes from another layout (segments, dense flags or "
                  "ownership)",
                  static_cast<unsigned long long>(Get<uint64_t>(b, 32)),
                  static_cast<unsigned long long>(Get<uint64_t>(b, 48)),
                  static_cast<unsigned long long>(LayoutFingerprint()),
                  static_cast<unsigned long long>(layout_.n)));
  OptimHyper h;
  h.lr = Get<float>(b, 64);
  h.beta1 = Get<float>(b, 68);
  h.beta2 = Get<float>(b, 72);
  h.eps = Get<float>(b, 76);
  h.weightDecay = Get<float>(b, 80);
  h.maxGradNorm = Get<float>(b, 84);
  h.bias = Get<int32_t>(b, 88);
  h.payload = dtypes::FromCheckpointCode(Get<int32_t>(b, 92));  // -1: refused as a payload
  h.density = Get<double>(b, 112);
  h.warmupSteps = Get<int64_t>(b, 120);
  h.entering = Get<uint8_t>(b, 110);
  h.clipNorm = Get<uint8_t>(b, 111);
  h.schedule = Get<uint8_t>(b, 105);
  SCAPE_RETURN_IF_ERROR(ValidateHyper(h).Prepend("checkpoint"));
  const int64_t st = Get<int64_t>(b, 56);
  const int32_t nx = Get<uint8_t>(b, 104);
  const uint16_t pad106 = Get<uint16_t>(b, 106);
  const int32_t mt = Get<uint16_t>(b, 108);
  if (st < 0 || (nx != 0 && nx != 1) ||
      (mt != scapeFloat32 && (ver < 2 || (mt != scapeBfloat16 && mt != scapeFloat16))) ||
      (ver < 3 && h.entering != 0) || (ver < 5 && h.clipNorm != 0) ||
      (ver < 6 && h.schedule != 0) || pad106 != 0)
    return InvalidArgument("checkpoint: bad step counter or flags");
  const uint64_t c = Get<uint64_t>(b, 128), x = Get<uint64_t>(b, 136);
  const uint64_t n = layout_.n;
  const uint64_t masterBytes = mt != scapeFloat32 ? 4 * n : 0;
  CheckpointParts q;
  if (ver < 4) {  // dense momentum, residual, masters
    q.mom = header;
    q.residual = header + 4 * n;
    q.master = header + 8 * n;
    q.idx = header + 8 * n + masterBytes;
  } else {  // residual, masters, packed momentum (and its own positions)
    q.km = Get<uint64_t>(b, 144);
    q.own = Get<uint64_t>(b, 152) == 1;
    if (q.km > n || Get<uint64_t>(b, 152) > 1)
      return InvalidArgument("checkpoint: mask part sizes do not match the checkpoint's size");
    q.residual = header;
    q.master = header + 4 * n;
    q.mom = header + 4 * n + masterBytes;
    q.momIdx = q.mom + 4 * q.km;
    q.idx = q.momIdx + (q.own ? 8 * q.km : 0);
  }
  if (c > n || x > n || (nx == 0 && x != 0) || size != q.idx + 8 * (c + x))
    return InvalidArgument("checkpoint: mask part sizes do not match the checkpoint's size");
  for (uint64_t j = 0; q.own && j < q.km; ++j) {
    const uint64_t p = Get<uint64_t>(b + q.momIdx, 8 * j);
    if (p >= n || (j > 0 && p <= Get<uint64_t>(b + q.momIdx, 8 * (j - 1))))
      return InvalidArgument(
          StrFormat("checkpoint: momentum position %llu (entry %llu) is not below n = %llu and "
                    "above the one before",
                    static_cast<unsigned long long>(p), static_cast<unsigned long long>(j),
                    static_cast<unsigned long long>(n)));
  }
  const uint8_t* idx = b + q.idx;
  SCAPE_RETURN_IF_ERROR(ValidateOwnIndices(idx, c, "current"));
  SCAPE_RETURN_IF_ERROR(ValidateOwnIndices(idx + 8 * c, x, "next"));
  *hyper = h;
  *step = st;
  *hasNext = nx != 0;
  *kc = c;
  *kn = x;
  *masterType = static_cast<scapeDataType_t>(mt);
  q.version = ver;
  *parts = q;
  return Status::Ok();
}

Status Optimizer::Load(const void* buf, size_t size) {
  // The device work of the last step finishes first (a host wait); the state is restored to
  // where it lives.
  if (dev_) SCAPE_RETURN_IF_ERROR(DevicePull().Prepend("finishing the device step"));
  const uint8_t* b = static_cast<const uint8_t*>(buf);
  OptimHyper h;
  int64_t st = 0;
  bool hasNext = false;
  uint64_t kc = 0, kn = 0;
  scapeDataType_t mt = scapeFloat32;
  CheckpointParts q;
  Status v = buf ? ValidateCheckpoint(b, size, &h, &st, &hasNext, &kc, &kn, &mt, &q)
                 : InvalidArgument("buf is NULL");
  // Every rank validates first; they agree on the outcome before anything changes. With it go
  // the part of the current mask each rank restores and its momentum's size: a version-4
  // momentum on the current mask has one value per entry of every rank's part.
  if (!comm_->error().ok()) return comm_->error();
  const bool onCur = v.ok() && q.version >= 4 && !q.own;
  int64_t mine[3] = {v.ok() ? 0 : 1, static_cast<int64_t>(kc),
                     onCur ? static_cast<int64_t>(q.km) : -1};
  std::vector<int64_t> all(3 * static_cast<size_t>(nranks_));
  coll::CollArgs ag;
  ag.type = coll::CollType::kAllGather;
  ag.send = mine;
  ag.recv = all.data();
  ag.count = 3;
  ag.dtype = scapeInt64;
  SCAPE_RETURN_IF_ERROR(comm_->Run(ag).Prepend("checkpoint agreement"));
  if (!v.ok()) return v;
  for (size_t r = 0; r < static_cast<size_t>(nranks_); ++r)
    if (all[3 * r] != 0)
      return InvalidUsage(
          StrFormat("rank %zu refused its checkpoint, so no rank loaded one "
                    "(this optimizer is unchanged)",
                    r));
  int64_t total = 0;
  for (size_t r = 0; r < static_cast<size_t>(nranks_); ++r) total += all[3 * r + 1];
  for (size_t r = 0; r < static_cast<size_t>(nranks_); ++r)
    if (all[3 * r + 2] >= 0 && all[3 * r + 2] != total)
      return InvalidArgument(
          StrFormat("checkpoint: rank %zu's momentum has %lld values but the ranks' parts of the "
                    "current mask add up to %lld entries (checkpoints of different saves?); no "
                    "rank loaded one (this optimizer is unchanged)",
                    r, static_cast<long long>(all[3 * r + 2]), static_cast<long long>(total)));
  const uint64_t n = layout_.n;
  const uint8_t* idx = b + q.idx;
  std::vector<uint64_t> cur(kc), next(kn);
  if (kc) std::memcpy(cur.data(), idx, 8 * kc);
  if (kn) std::memcpy(next.data(), idx + 8 * kc, 8 * kn);
  SCAPE_RETURN_IF_ERROR(SyncOwnPart(cur.data(), kc).Prepend("restoring the current mask"));
  if (hasNext) {
    SCAPE_RETURN_IF_ERROR(mask_->SetNextIndices(next.data(), kn));
    SCAPE_RETURN_IF_ERROR(mask_->SyncStart().Prepend("restoring the next mask"));
    pending_ = true;
    gen_ = mask_->Generation();
  }
  if (n) std::memcpy(e_.data(), b + q.residual, 4 * n);
  // The master weights are the checkpoint's (none in a checkpoint without: the next mixed step
  // initialises them from its params).
  masterType_ = mt;
  if (mt != scapeFloat32) {
    master_.resize(n);
    if (n) std::memcpy(master_.data(), b + q.master, 4 * n);
  } else {
    master_.clear();
    master_.shrink_to_fit();
  }
  step_ = st;
  hyper_ = h;
  maskBytes_ = payloadBytes_ = denseBytes_ = controlBytes_ = 0;
  // The checkpoint's momentum lives on its current mask (the mask of the step before the save;
  // the full mask of step 0 when no step ran), which is current again now, or on its own.
  BuildRuns();
  oldHold_.reset();
  if (q.version < 4) {
    std::vector<float> dense(n);
    if (n) std::memcpy(dense.data(), b + q.mom, 4 * n);
    PackMomentum(dense.data());
  } else if (!q.own) {
    m_.resize(q.km);
    if (q.km) std::memcpy(m_.data(), b + q.mom, 4 * q.km);
    momOwn_ = false;
    momIdx_.clear();
    momRuns_.clear();
  } else {
    m_.resize(q.km);
    momIdx_.resize(q.km);
    if (q.km) {
      std::memcpy(m_.data(), b + q.mom, 4 * q.km);
      std::memcpy(momIdx_.data(), b + q.momIdx, 8 * q.km);
    }
    momRuns_ = runs_;  // position order: each run's entries are one range of the sorted list
    for (kernels::MaskRun& r : momRuns_) {
      r.jb = static_cast<uint64_t>(std::lower_bound(momIdx_.begin(), momIdx_.end(), r.begin) -
                                   momIdx_.begin());
      r.je = static_cast<uint64_t>(std::lower_bound(momIdx_.begin(), momIdx_.end(), r.end) -
                                   momIdx_.begin());
    }
    momOwn_ = true;
  }
  if (dev_) SCAPE_RETURN_IF_ERROR(DevicePush().Prepend("restoring the device state"));
  return Status::Ok();
}

}  // namespace scape
