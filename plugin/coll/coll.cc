#include "plugin/coll/coll.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "kernels/cpu/reduce.h"
#include "plugin/coll/schedule.h"

namespace scape {
namespace coll {

using transport::Request;

const char* CollName(CollType t) {
  // One name per type, in the enum's order (kAllReduce is 1).
  static const char* const kNames[] = {"scapeAllReduce", "scapeReduceScatter", "scapeAllGather",
                                       "scapeBroadcast", "scapeBarrier",       "exchange"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(CollType::kExchange),
                "one name per CollType");
  const auto i = static_cast<uint32_t>(t);
  return i >= 1 && i <= static_cast<uint32_t>(CollType::kExchange) ? kNames[i - 1] : "collective";
}

uint32_t Signature(const CollArgs& a) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(a.type));
  mix(a.count);
  mix(static_cast<uint64_t>(a.dtype));
  mix(a.type == CollType::kAllReduce || a.type == CollType::kReduceScatter
          ? static_cast<uint64_t>(a.op)
          : 0);
  mix(a.type == CollType::kBroadcast ? static_cast<uint64_t>(a.root) : 0);
  for (size_t c : a.counts) mix(c);
  return static_cast<uint32_t>((h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) & 0xffffu);
}

Status Ctx::Send(int peer, uint32_t step, const void* buf, size_t len,
                 std::unique_ptr<Request>* req) {
  return tp_->Isend(peer, MakeTag(kKindData, rank_, sig_, seq_, step), buf, len, req);
}

Status Ctx::Recv(int peer, uint32_t step, void* buf, size_t len, std::unique_ptr<Request>* req) {
  return tp_->Irecv(peer, MakeTag(kKindData, peer, sig_, seq_, step), ~kSigMask, buf, len, req);
}

Status Ctx::Check(std::unique_ptr<Request>* req, size_t expectLen, bool* done, bool* advanced) {
  if (!*req) {
    *done = true;
    return Status::Ok();
  }
  transport::RecvInfo info;
  const int peer = (*req)->peer();
  const bool isRecv = (*req)->isRecv();
  Status st = tp_->Test(req->get(), done, &info);
  if (!st.ok()) {
    req->reset();
    if (st.code() == scapeInvalidUsage)  // truncated: the peer sent more than we expected
      return InvalidUsage(
          StrFormat("rank %d sent more data than this rank expects: the ranks "
                    "disagree on the count or datatype",
                    peer));
    return st;
  }
  if (!*done) {
    std::string why;
    if (tp_->PeerFailed(peer, &why)) {
      req->reset();
      return RemoteError(StrFormat("rank %d failed (%s)", peer, why.c_str()));
    }
    return Status::Ok();
  }
  req->reset();
  *advanced = true;
  if (isRecv) {
    if (TagSig(info.senderTag) != sig_)
      return InvalidUsage(
          StrFormat("rank %d is in a different collective call than this rank "
                    "(operation, count, datatype, op or root differ; "
                    "signature %04x, expected %04x)",
                    peer, TagSig(info.senderTag), sig_));
    if (info.length != expectLen)
      return InvalidUsage(
          StrFormat("rank %d sent %zu bytes where this rank expects %zu: the "
                    "ranks disagree on the count or datatype",
                    peer, info.length, expectLen));
  }
  return Status::Ok();
}

namespace {

inline char* Ptr(void* p, size_t off) { return static_cast<char*>(p) + off; }
inline const char* Ptr(const void* p, size_t off) { return static_cast<const char*>(p) + off; }

// ---------------------------------------------------------------------------------------------
// One rank, or nothing to move: local copy (and nothing else: the average of one is itself).
class LocalOp final : public Op {
 public:
  LocalOp(const CollArgs& a, int nranks) : a_(a), nranks_(nranks) {}
  Status Start(Ctx& ctx) override {
    const size_t esz = scapeTypeSize(a_.dtype);
    size_t bytes = (a_.counts.empty() ? a_.count : a_.counts[0]) * esz;
    const void* src = a_.send;
    void* dst = a_.recv;
    if (a_.type == CollType::kAllGather)
      dst = Ptr(a_.recv, static_cast<size_t>(ctx.rank()) * bytes);
    if (a_.type == CollType::kBarrier || bytes == 0 || nranks_ != 1) return Status::Ok();
    if (src && dst && src != dst) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status Progress(Ctx&, bool* done, bool*) override {
    *done = true;
    return Status::Ok();
  }

 private:
  CollArgs a_;
  int nranks_;
};

// ---------------------------------------------------------------------------------------------
// Pipelined ring: all-reduce (reduce-scatter + all-gather), reduce-scatter, all-gather.
// Each block is cut into `nch` chunks; every chunk column moves through the ring steps on its
// own, so the reduction of one chunk overlaps the transfer of the others. A column advances
// only when both its send and its receive of the current step completed, which is what makes
// the buffer reuse below safe.
class RingOp final : public Op {
 public:
  enum Mode { kAR, kRS, kAG };
  RingOp(Mode mode, const CollArgs& a, int rank, int p, const Tuning& tuning)
      : mode_(mode), a_(a), r_(rank), p_(p), esz_(scapeTypeSize(a.dtype)) {
    steps_ = mode == kAR ? 2 * (p - 1) : p - 1;
    first_ = mode == kAG ? p - 1 : 0;  // index into the all-reduce step numbering
    offs_.resize(static_cast<size_t>(p) + 1, 0);
    for (int b = 0; b < p; ++b) {
      size_t len = !a.counts.empty() ? a.counts[static_cast<size_t>(b)]
                   : mode == kAR     ? BlockLength(a.count, p, b)
                                     : a.count;
      offs_[static_cast<size_t>(b) + 1] = offs_[static_cast<size_t>(b)] + len;
    }
    size_t maxBlock = 0;
    for (int b = 0; b < p; ++b) maxBlock = std::max(maxBlock, BlockLen(b));
    nch_ = RingChunks(maxBlock * esz_, tuning.ChunkFor(maxBlock * esz_), steps_);
    maxChunk_ = maxBlock / nch_ + 1;
  }

  Status Start(Ctx& ctx) override {
    // Staging for received partial sums, and for a reduce-scatter two slots of partial
    // results per chunk column: scratch memory the communicator keeps between calls.
    const size_t slot = nch_ * maxChunk_ * esz_;
    const size_t need = (mode_ != kAG ? slot : 0) + (mode_ == kRS && p_ > 2 ? 2 * slot : 0);
    char* scratch = need ? ctx.Scratch(need) : nullptr;
    staging_ = scratch;
    work_ = mode_ == kRS && p_ > 2 ? scratch + slot : nullptr;
    if (mode_ == kAG && a_.send != BlockPtr(a_.recv, r_) && BlockLen(r_) > 0)
      std::memcpy(BlockPtr(a_.recv, r_), a_.send, BlockLen(r_) * esz_);
    cols_.resize(nch_);
    for (size_t c = 0; c < nch_; ++c) SCAPE_RETURN_IF_ERROR(Post(ctx, c));
    active_ = nch_;
    return Status::Ok();
  }

  Status Progress(Ctx& ctx, bool* done, bool* advanced) override {
    for (size_t c = 0; c < nch_ && active_ > 0; ++c) {
      Column& col = cols_[c];
      if (col.t >= steps_) continue;
      bool sd = false, rd = false;
      SCAPE_RETURN_IF_ERROR(ctx.Check(&col.send, 0, &sd, advanced));
      const int t = col.t + first_;
      const int rb = RingRecvBlock(r_, p_, t);
      SCAPE_RETURN_IF_ERROR(ctx.Check(&col.recv, ChunkLen(rb, c) * esz_, &rd, advanced));
      if (!sd || !rd) continue;
      if (t < p_ - 1) SCAPE_RETURN_IF_ERROR(Reduce(t, rb, c));
      if (++col.t >= steps_) {
        --active_;
        continue;
      }
      SCAPE_RETURN_IF_ERROR(Post(ctx, c));
    }
    *done = active_ == 0;
    return Status::Ok();
  }

 private:
  struct Column {
    int t = 0;
    std::unique_ptr<Request> send, recv;
  };

  size_t BlockOff(int b) const { return offs_[static_cast<size_t>(b)]; }
  size_t BlockLen(int b) const {
    return offs_[static_cast<size_t>(b) + 1] - offs_[static_cast<size_t>(b)];
  }
  size_t ChunkOff(int b, size_t c) const { return ChunkBegin(BlockLen(b), nch_, c); }
  size_t ChunkLen(int b, size_t c) const {
    return ChunkBegin(BlockLen(b), nch_, c + 1) - ChunkBegin(BlockLen(b), nch_, c);
  }
  char* BlockPtr(void* base, int b) const { return Ptr(base, BlockOff(b) * esz_); }
  char* Slot(char* base, size_t which, size_t c) const {
    return base + ((which * nch_ + c) * maxChunk_) * esz_;
  }
  // Where the partial sum of reduce-scatter step t lives (it is sent at step t + 1).
  char* PartialPtr(int t, int b, size_t c) {
    if (mode_ == kRS && t < p_ - 2) return Slot(work_, static_cast<size_t>(t % 2), c);
    return Ptr(BlockPtr(a_.recv, mode_ == kRS ? 0 : b), ChunkOff(b, c) * esz_);
  }

  Status Post(Ctx& ctx, size_t c) {
    Column& col = cols_[c];
    const int t = col.t + first_;
    const int sb = RingSendBlock(r_, p_, t), rb = RingRecvBlock(r_, p_, t);
    const uint32_t step = static_cast<uint32_t>(col.t * nch_ + c);
    const void* src;
    if (t == 0) {
      src = Ptr(a_.send, (BlockOff(sb) + ChunkOff(sb, c)) * esz_);
    } else if (t < p_ - 1) {
      src = PartialPtr(t - 1, sb, c);
    } else if (mode_ == kAG && t == first_) {
      src = Ptr(a_.send, ChunkOff(sb, c) * esz_);
    } else {
      src = Ptr(BlockPtr(a_.recv, sb), ChunkOff(sb, c) * esz_);
    }
    void* dst =
        t < p_ - 1 ? Slot(staging_, 0, c) : Ptr(BlockPtr(a_.recv, rb), ChunkOff(rb, c) * esz_);
    SCAPE_RETURN_IF_ERROR(ctx.Recv(Mod(r_ - 1, p_), step, dst, ChunkLen(rb, c) * esz_, &col.recv));
    return ctx.Send(Mod(r_ + 1, p_), step, src, ChunkLen(sb, c) * esz_, &col.send);
  }

  Status Reduce(int t, int b, size_t c) {
    const size_t n = ChunkLen(b, c);
    const void* local = Ptr(a_.send, (BlockOff(b) + ChunkOff(b, c)) * esz_);
    const bool last = t == p_ - 2;
    return kernels::ToStatus(
        kernels::ReduceInto(a_.dtype, a_.op, PartialPtr(t, b, c), Slot(staging_, 0, c), local, n,
                            last && a_.op == scapeAvg ? p_ : 1),
        "ring reduction");
  }

  Mode mode_;
  CollArgs a_;
  int r_, p_;
  size_t esz_;
  int steps_ = 0, first_ = 0;
  size_t nch_ = 1, maxChunk_ = 1, active_ = 0;
  std::vector<Column> cols_;
  char* staging_ = nullptr;   // scratch: received partial sums, one slot per chunk column
  char* work_ = nullptr;      // scratch: reduce-scatter partial results, two slots per column
  std::vector<size_t> offs_;  // block b is [offs_[b], offs_[b+1]) elements
};

// ---------------------------------------------------------------------------------------------
// A sequence of stages, each an optional send and an optional receive followed by an action.
// Used for the latency-bound algorithms (recursive doubling, barrier).
class StagedOp : public Op {
 public:
  struct Stage {
    int sendPeer = -1;
    const void* sbuf = nullptr;
    size_t slen = 0;
    int recvPeer = -1;
    void* rbuf = nullptr;
    size_t rlen = 0;
    uint32_t step = 0;
    std::function<Status()> after;  // runs when both halves are done (a reduction)
  };

  Status Start(Ctx& ctx) override { return PostCurrent(ctx); }

  Status Progress(Ctx& ctx, bool* done, bool* advanced) override {
    while (cur_ < stages_.size()) {
      bool sd = false, rd = false;
      SCAPE_RETURN_IF_ERROR(ctx.Check(&send_, 0, &sd, advanced));
      SCAPE_RETURN_IF_ERROR(ctx.Check(&recv_, stages_[cur_].rlen, &rd, advanced));
      if (!sd || !rd) break;
      if (stages_[cur_].after) SCAPE_RETURN_IF_ERROR(stages_[cur_].after());
      ++cur_;
      SCAPE_RETURN_IF_ERROR(PostCurrent(ctx));
    }
    *done = cur_ >= stages_.size();
    return Status::Ok();
  }

 protected:
  std::vector<Stage> stages_;

 private:
  Status PostCurrent(Ctx& ctx) {
    if (cur_ >= stages_.size()) return Status::Ok();
    const Stage& s = stages_[cur_];
    if (s.recvPeer >= 0)
      SCAPE_RETURN_IF_ERROR(ctx.Recv(s.recvPeer, s.step, s.rbuf, s.rlen, &recv_));
    if (s.sendPeer >= 0)
      SCAPE_RETURN_IF_ERROR(ctx.Send(s.sendPeer, s.step, s.sbuf, s.slen, &send_));
    return Status::Ok();
  }
  size_t cur_ = 0;
  std::unique_ptr<Request> send_, recv_;
};

// Recursive doubling all-reduce (latency-optimal: log2(P) rounds of full-size exchanges). Every
// participant computes op(own, partner) in the same bits as its partner computes
// op(partner, own), so all ranks end with identical results.
class RdAllReduceOp final : public StagedOp {
 public:
  RdAllReduceOp(const CollArgs& a, int rank, int p) : a_(a), rank_(rank), p_(p) {}

  Status Start(Ctx& ctx) override {
    const size_t bytes = a_.count * scapeTypeSize(a_.dtype);
    if (a_.send != a_.recv) std::memcpy(a_.recv, a_.send, bytes);
    tmp_ = ctx.Scratch(bytes);
    const RdLayout l = MakeRdLayout(p_);
    const int vr = RdVirtualRank(l, rank_);
    void* buf = a_.recv;
    auto reduce = [this, buf](int div) {
      return [this, buf, div] {
        return kernels::ToStatus(
            kernels::ReduceInto(a_.dtype, a_.op, buf, buf, tmp_, a_.count, div),
            "recursive-doubling reduction");
      };
    };
    const int avgDiv = a_.op == scapeAvg ? p_ : 1;
    if (vr < 0) {  // fold into rank + 1, then receive the result from it
      stages_.push_back(Stage{rank_ + 1, buf, bytes, -1, nullptr, 0, 0, nullptr});
      stages_.push_back(Stage{-1, nullptr, 0, rank_ + 1, buf, bytes, 1000, nullptr});
      return StagedOp::Start(ctx);
    }
    if (rank_ < 2 * l.rem)
      stages_.push_back(Stage{-1, nullptr, 0, rank_ - 1, tmp_, bytes, 0, reduce(1)});
    uint32_t round = 1;
    for (int mask = 1; mask < l.pof2; mask <<= 1, ++round) {
      const int partner = RdRealRank(l, vr ^ mask);
      const bool last = (mask << 1) >= l.pof2;
      stages_.push_back(
          Stage{partner, buf, bytes, partner, tmp_, bytes, round, reduce(last ? avgDiv : 1)});
    }
    if (rank_ < 2 * l.rem)
      stages_.push_back(Stage{rank_ - 1, buf, bytes, -1, nullptr, 0, 1000, nullptr});
    return StagedOp::Start(ctx);
  }

 private:
  CollArgs a_;
  int rank_, p_;
  char* tmp_ = nullptr;
};

// One send and/or one receive (the building block of the sparse all-reduce).
class ExchangeOp final : public StagedOp {
 public:
  explicit ExchangeOp(const CollArgs& a) {
    stages_.push_back(
        Stage{a.sendPeer, a.send, a.sendBytes, a.recvPeer, a.recv, a.recvBytes, 0, nullptr});
  }
};

// Dissemination barrier: ceil(log2 P) rounds of empty messages.
class BarrierOp final : public StagedOp {
 public:
  BarrierOp(int rank, int p) {
    uint32_t round = 0;
    for (int d = 1; d < p; d <<= 1, ++round)
      stages_.push_back(
          Stage{Mod(rank + d, p), nullptr, 0, Mod(rank - d, p), nullptr, 0, round, nullptr});
  }
};

// Pipelined binomial-tree broadcast: each chunk goes down the tree on its own.
class BcastOp final : public Op {
 public:
  BcastOp(const CollArgs& a, int rank, int p, const Tuning& tuning)
      : a_(a), r_(rank), p_(p), esz_(scapeTypeSize(a.dtype)) {
    const int vr = Mod(rank - a.root, p);
    int mask = 1;
    while (mask < p) {
      if (vr & mask) {
        parent_ = Mod(vr - mask + a.root, p);
        break;
      }
      mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1)
      if (vr + mask < p) children_.push_back(Mod(vr + mask + a.root, p));
    nch_ = RingChunks(a.count * esz_, tuning.ChunkFor(a.count * esz_), 1);
  }
  Status Start(Ctx& ctx) override {
    if (r_ == a_.root && a_.send != a_.recv) std::memcpy(a_.recv, a_.send, a_.count * esz_);
    cols_.resize(nch_);
    for (size_t c = 0; c < nch_; ++c) {
      if (parent_ >= 0) {
        SCAPE_RETURN_IF_ERROR(ctx.Recv(parent_, static_cast<uint32_t>(c), ChunkPtr(c),
                                       ChunkBytes(c), &cols_[c].recv));
      } else {
        SCAPE_RETURN_IF_ERROR(SendChildren(ctx, c));
      }
    }
    return Status::Ok();
  }
  Status Progress(Ctx& ctx, bool* done, bool* advanced) override {
    size_t finished = 0;
    for (size_t c = 0; c < nch_; ++c) {
      Column& col = cols_[c];
      if (!col.sent) {
        bool rd = false;
        SCAPE_RETURN_IF_ERROR(ctx.Check(&col.recv, ChunkBytes(c), &rd, advanced));
        if (!rd) continue;
        SCAPE_RETURN_IF_ERROR(SendChildren(ctx, c));
      }
      bool all = true;
      for (auto& s : col.sends) {
        bool sd = false;
        SCAPE_RETURN_IF_ERROR(ctx.Check(&s, 0, &sd, advanced));
        all = all && sd;
      }
      if (all) ++finished;
    }
    *done = finished == nch_;
    return Status::Ok();
  }

 private:
  struct Column {
    bool sent = false;
    std::unique_ptr<Request> recv;
    std::vector<std::unique_ptr<Request>> sends;
  };
  size_t ChunkOffElems(size_t c) const { return ChunkBegin(a_.count, nch_, c); }
  size_t ChunkBytes(size_t c) const { return (ChunkOffElems(c + 1) - ChunkOffElems(c)) * esz_; }
  char* ChunkPtr(size_t c) const { return Ptr(a_.recv, ChunkOffElems(c) * esz_); }
  Status SendChildren(Ctx& ctx, size_t c) {
    Column& col = cols_[c];
    col.sent = true;
    col.sends.resize(children_.size());
    for (size_t i = 0; i < children_.size(); ++i)
      SCAPE_RETURN_IF_ERROR(ctx.Send(children_[i], static_cast<uint32_t>(c), ChunkPtr(c),
                                     ChunkBytes(c), &col.sends[i]));
    return Status::Ok();
  }
  CollArgs a_;
  int r_, p_;
  size_t esz_;
  int parent_ = -1;
  std::vector<int> children_;
  size_t nch_ = 1;
  std::vector<Column> cols_;
};

}  // namespace

std::unique_ptr<Op> MakeOp(const CollArgs& a, int rank, int nranks, const Tuning& tuning) {
  if (a.type == CollType::kExchange) {
    if (a.sendPeer < 0 && a.recvPeer < 0) return std::make_unique<LocalOp>(a, 1);
    return std::make_unique<ExchangeOp>(a);
  }
  if (a.type == CollType::kBarrier)
    return nranks == 1 ? std::unique_ptr<Op>(new LocalOp(a, nranks))
                       : std::unique_ptr<Op>(new BarrierOp(rank, nranks));
  // V variants: the ring, even for tiny blocks. An all-reduce with counts reduces block b to
  // rank b exactly as the reduce-scatter does, so the two give the same bits.
  if (!a.counts.empty()) {
    if (nranks == 1) return std::make_unique<LocalOp>(a, nranks);
    RingOp::Mode mode = a.type == CollType::kReduceScatter ? RingOp::kRS
                        : a.type == CollType::kAllGather   ? RingOp::kAG
                                                           : RingOp::kAR;
    return std::make_unique<RingOp>(mode, a, rank, nranks, tuning);
  }
  if (nranks == 1 || a.count == 0) return std::make_unique<LocalOp>(a, nranks);
  switch (a.type) {
    case CollType::kAllReduce: {
      const size_t bytes = a.count * scapeTypeSize(a.dtype);
      bool ring = tuning.allreduceAlgo == 1 ||
                  (tuning.allreduceAlgo == 0 && bytes >= tuning.ringThresholdBytes &&
                   a.count >= static_cast<size_t>(nranks));
      if (ring) return std::make_unique<RingOp>(RingOp::kAR, a, rank, nranks, tuning);
      return std::make_unique<RdAllReduceOp>(a, rank, nranks);
    }
    case CollType::kReduceScatter:
      return std::make_unique<RingOp>(RingOp::kRS, a, rank, nranks, tuning);
    case CollType::kAllGather:
      return std::make_unique<RingOp>(RingOp::kAG, a, rank, nranks, tuning);
    case CollType::kBroadcast:
      return std::make_unique<BcastOp>(a, rank, nranks, tuning);
    default:
      return nullptr;
  }
}

}  // namespace coll
}  // namespace scape
