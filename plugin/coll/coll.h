// Collective algorithms as non-blocking tasks (Start / Progress), written against the
// transport::Transport interface only (no UCX here).
#ifndef SCAPE_PLUGIN_COLL_COLL_H_
#define SCAPE_PLUGIN_COLL_COLL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plugin/coll/schedule.h"
#include "scape/scape.h"
#include "transport/transport.h"

namespace scape {
namespace coll {

// Tag layout (64 bits): kind(2) | source rank(20) | signature(16) | sequence(10) | step(16).
// Receives ignore the signature bits and check them on arrival, so that ranks that disagree on
// a collective's arguments are told so at once instead of waiting for a timeout.
constexpr int kStepBits = 16, kSeqBits = 10, kSigBits = 16, kSrcBits = 20;
constexpr uint64_t kKindData = 0, kKindControl = 1;
constexpr int kMaxRanks = 1 << kSrcBits;

inline uint64_t MakeTag(uint64_t kind, int src, uint32_t sig, uint32_t seq, uint32_t step) {
  return (kind << 62) | (static_cast<uint64_t>(src) << 42) |
         (static_cast<uint64_t>(sig & 0xffffu) << 26) |
         (static_cast<uint64_t>(seq & 0x3ffu) << 16) | (step & 0xffffu);
}
inline uint32_t TagSig(uint64_t tag) { return static_cast<uint32_t>((tag >> 26) & 0xffffu); }
constexpr uint64_t kSigMask = uint64_t{0xffff} << 26;
constexpr uint64_t kKindMask = uint64_t{3} << 62;

enum class CollType : uint32_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kBarrier,
  // Point-to-point building block of irregular algorithms (sparse all-reduce): send sendBytes
  // to sendPeer and/or receive recvBytes from recvPeer (-1: none). Every rank runs the same
  // sequence of exchanges, with no-ops where it has nothing to do, so operations stay matched.
  kExchange
};
const char* CollName(CollType t);

// What every rank must agree on; hashed into the tag signature.
struct CollArgs {
  CollType type = CollType::kBarrier;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // all-reduce, broadcast: elements; reduce-scatter: per-rank recvcount;
                     // all-gather: per-rank sendcount
  scapeDataType_t dtype = scapeFloat32;
  scapeRedOp_t op = scapeSum;
  int root = 0;
  // Reduce-scatter / all-gather / all-reduce with a different block per rank ("V" variants):
  // when non-empty, nranks entries; `count` is then ignored (all-reduce: their sum). Blocks lie
  // back to back in rank order; an all-reduce reduces block b at rank b, like reduce-scatter.
  std::vector<size_t> counts;
  // kExchange only (not part of the signature: the two sides' sizes differ).
  int sendPeer = -1, recvPeer = -1;
  size_t sendBytes = 0, recvBytes = 0;
};
uint32_t Signature(const CollArgs& a);

// An all-gather of count elements of dtype from every rank (recv holds nranks * count).
inline CollArgs AllGatherArgs(const void* send, void* recv, size_t count, scapeDataType_t dtype) {
  // In member order; op and root (unused by an all-gather) and counts as a default CollArgs has
  // them, and the members after counts keep their defaults.
  return CollArgs{CollType::kAllGather, send, recv, count, dtype, scapeSum, 0, {}};
}

// Tuning, read once per communicator.
struct Tuning {
  size_t ringThresholdBytes = 64 * 1024;
  size_t chunkBytes = 2 * 1024 * 1024;
  bool chunkSizeAware = true;  // SCAPE_CHUNK_BYTES unset: AutoChunkBytes (schedule.h)
  int allreduceAlgo = 0;       // 0 auto, 1 ring, 2 recursive doubling
  // The pipeline chunk for blocks of at most maxBlockBytes.
  size_t ChunkFor(size_t maxBlockBytes) const {
    return chunkSizeAware ? AutoChunkBytes(maxBlockBytes, chunkBytes) : chunkBytes;
  }
};

// Per-operation context handed to a task: the transport plus the identity of this call.
class Ctx {
 public:
  Ctx(transport::Transport* tp, int rank, int nranks, uint32_t seq, uint32_t sig,
      const Tuning& tuning, std::vector<char>* scratch)
      : tp_(tp),
        rank_(rank),
        nranks_(nranks),
        seq_(seq),
        sig_(sig),
        tuning_(tuning),
        scratch_(scratch) {}
  // Working memory for the running operation, kept by the communicator between operations
  // (only one operation runs at a time), so large collectives do not fault in fresh pages on
  // every call. Valid until the operation completes.
  char* Scratch(size_t bytes) {
    if (scratch_->size() < bytes) scratch_->resize(bytes);
    return scratch_->data();
  }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const Tuning& tuning() const { return tuning_; }

  Status Send(int peer, uint32_t step, const void* buf, size_t len,
              std::unique_ptr<transport::Request>* req);
  Status Recv(int peer, uint32_t step, void* buf, size_t len,
              std::unique_ptr<transport::Request>* req);
  // Tests `req` (null counts as complete). On completion releases it, and for receives checks
  // the sender's signature and that exactly `expectLen` bytes arrived. Sets *advanced when it
  // completes.
  Status Check(std::unique_ptr<transport::Request>* req, size_t expectLen, bool* done,
               bool* advanced);

 private:
  transport::Transport* tp_;
  int rank_, nranks_;
  uint32_t seq_, sig_;
  const Tuning& tuning_;
  std::vector<char>* scratch_;
};

class Op {
 public:
  virtual ~Op() = default;
  // Posts the first messages; called once, when the op becomes the oldest pending one.
  virtual Status Start(Ctx& ctx) = 0;
  // Advances without blocking. *done when finished; *advanced when any message completed.
  virtual Status Progress(Ctx& ctx, bool* done, bool* advanced) = 0;
};

// What an algorithm composed of whole collectives (the sparse all-reduce) needs of its
// communicator: who this rank is, and a way to run one validated collective to completion.
// plugin/core's Comm implements it, so such algorithms never see the communicator itself.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual int rank() const = 0;
  virtual int nranks() const = 0;
  virtual Status Run(const CollArgs& args) = 0;
};

// Builds the task for a validated call (buffers, dtype, op and root already checked).
std::unique_ptr<Op> MakeOp(const CollArgs& args, int rank, int nranks, const Tuning& tuning);

}  // namespace coll
}  // namespace scape

#endif  // SCAPE_PLUGIN_COLL_COLL_H_
