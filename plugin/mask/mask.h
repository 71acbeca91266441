// The agreed mask: layout (segments, owners), the current and next masks, and the background
// synchronisation of the next mask over a private child communicator.
#ifndef SCAPE_PLUGIN_MASK_MASK_H_
#define SCAPE_PLUGIN_MASK_MASK_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/topk.h"
#include "plugin/core/comm.h"
#include "scape/scape.h"

namespace scape {

class Mask {
 public:
  // A contiguous piece of one segment inside one rank's owned part.
  struct Piece {
    uint64_t begin, end;
    bool dense;
  };

  // Collective over `comm`. Arguments are already validated by the API layer.
  static Status Create(Comm* comm, uint64_t n, const std::vector<uint64_t>& segOffsets,
                       const std::vector<uint8_t>& dense, scapeOwnership_t ownership,
                       scapeMaskEncoding_t encoding, std::unique_ptr<Mask>* out);
  ~Mask();

  uint64_t n() const { return n_; }
  Comm* comm() const { return comm_; }
  const std::vector<Piece>& Owned(int rank) const { return owned_[static_cast<size_t>(rank)]; }

  Status SetNextIndices(const uint64_t* idx, size_t k);
  Status SelectNextTopk(const float* stat, double density);
  // SelectNextTopk in two halves, for a top-k run elsewhere (the device): the kernel's segment
  // table of this rank's owned pieces for `density` (kernels/cpu/topk.h), and the next mask
  // from the kernel's selected global positions (increasing). Always-dense pieces have k = 0
  // in the plan (no kernel work, no positions to copy back from a device); the mask adds them
  // whole. total == 0: nothing to select, no kernel to run.
  struct TopkTable {
    std::vector<uint64_t> offsets, k, outOffsets;
    uint64_t total = 0;  // selected positions in all (outOffsets' last entry)
    kernels::TopkSegments Segments() const;
  };
  void TopkPlan(double density, TopkTable* t) const;
  // SetNextIndices for positions a top-k produced: a failure is the library's (InternalError).
  Status SetNextFromTopk(const uint64_t* selected, size_t count);
  Status SyncStart();
  Status SyncTest(bool* done);
  Status SyncWait();
  Status Advance();
  // For the optimizer (plugin/optim): whether a sync is in flight, whether one completed since
  // the last advance, and a counter of successful SyncStart and Advance calls (so a caller
  // can tell that another user of the mask synchronised or advanced it).
  bool SyncInFlight() const { return inFlight_; }
  bool SyncCompleted() const { return synced_; }
  uint64_t Generation() const { return generation_; }
  // The next mask as the last completed sync decoded it (mask order), with rank r's part.
  const std::vector<uint64_t>& Next() const { return *next_; }
  uint64_t NextRankCount(int r) const { return nextCount_[static_cast<size_t>(r)]; }
  uint64_t NextRankOffset(int r) const { return nextOff_[static_cast<size_t>(r)]; }

  // The current mask, in mask order (owner rank, then index).
  const std::vector<uint64_t>& Current() const { return *cur_; }
  // The same list, shared: an operation still running after the caller advanced the mask keeps
  // the positions it was packed with (the mask then stops reusing that buffer).
  std::shared_ptr<const std::vector<uint64_t>> CurrentShared() const { return cur_; }
  uint64_t RankCount(int r) const { return curCount_[static_cast<size_t>(r)]; }
  uint64_t RankOffset(int r) const { return curOff_[static_cast<size_t>(r)]; }
  std::vector<size_t> RankCounts() const;
  // The current mask is every position in increasing order (shard ownership, k == n): packed
  // and dense layouts coincide, so a dense-in/out collective needs no pack or unpack.
  bool CurrentIsIdentity() const {
    return ownership_ == scapeOwnershipShards && cur_->size() == n_;
  }

  void Pack(const void* dense, void* packed, size_t esz) const;
  void Unpack(const void* packed, void* dense, size_t esz) const;
  // Working memory for the packed values of a dense-in/out masked collective, kept between
  // calls (caller thread only; valid until the next call).
  char* PackBuffer(size_t bytes);

  const scapeMaskSyncInfo_t& Info() const { return info_; }

  // What the sync does with rank r's received part (header, size and body checks, then the
  // indices as global positions into *out): for tests and the fuzz targets.
  Status DecodePart(int r, const uint8_t* buf, size_t size, std::vector<uint64_t>* out) const {
    uint64_t k = 0;
    SCAPE_RETURN_IF_ERROR(PartCount(r, buf, size, &k));
    out->assign(static_cast<size_t>(k), 0);
    return DecodeInto(r, buf, size, k, out->data());
  }

 private:
  Mask() = default;
  void BuildOwnership(const std::vector<uint64_t>& segOffsets, const std::vector<uint8_t>& dense,
                      scapeOwnership_t ownership);
  Status Encode(std::vector<uint8_t>* out);
  // Reads the header of rank r's part: its k (checked against its owned part).
  Status PartCount(int r, const uint8_t* buf, size_t size, uint64_t* k) const;
  // Decodes rank r's part (k indices, from PartCount) into global positions out[0, k);
  // validates everything.
  Status DecodeInto(int r, const uint8_t* buf, size_t size, uint64_t k, uint64_t* out) const;
  // Rank r's owned-space indices out[0, k) (valid, increasing) to global positions, in place.
  void ToGlobal(int r, uint64_t* out, uint64_t k) const;
  // Rank r's owned-space indices to global positions, from src into dst.
  void CopyToGlobal(int r, const uint64_t* src, uint64_t* dst, uint64_t k) const;
  void ThreadMain();
  Status RunSync();  // on the sync thread

  Comm* comm_ = nullptr;
  int rank_ = 0, nranks_ = 1;
  uint64_t n_ = 0;
  scapeMaskEncoding_t encoding_ = scapeMaskEncodingAuto;
  scapeOwnership_t ownership_ = scapeOwnershipShards;
  std::vector<std::vector<Piece>> owned_;  // per rank, increasing
  std::vector<uint64_t> ownedSize_;        // per rank
  // Per rank: the global position of owned-space index 0 when the rank's pieces are one
  // contiguous range (always with shards), so local -> global is one addition; else kNoBase.
  static constexpr uint64_t kNoBase = ~uint64_t{0};
  std::vector<uint64_t> base_;

  std::vector<uint64_t> nextLocal_;  // this rank's selection, local indices in its owned space
  kernels::TopkWorkspace topkWs_;    // top-k buffers kept between steps
  bool nextSet_ = false;

  // The current mask, and the next one as the last sync decoded it; Advance swaps them, so
  // both buffers are reused from step to step (no allocation, no page faults, no copy) unless
  // an asynchronous operation still holds one (CurrentShared).
  std::shared_ptr<std::vector<uint64_t>> cur_ = std::make_shared<std::vector<uint64_t>>();
  std::shared_ptr<std::vector<uint64_t>> next_ = std::make_shared<std::vector<uint64_t>>();
  std::shared_ptr<std::vector<uint64_t>> spare_;  // a buffer last held elsewhere (SyncStart)
  std::vector<uint64_t> curCount_, curOff_, nextCount_, nextOff_;
  std::vector<char> packBuf_;

  // Background sync.
  std::unique_ptr<Comm> child_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, requested_ = false, finished_ = false;  // guarded by mu_
  bool inFlight_ = false;                                     // caller thread only
  bool synced_ = false;      // a sync completed since the last Advance
  uint64_t generation_ = 0;  // successful SyncStart + Advance calls (caller thread only)
  Status syncStatus_;        // written by the thread before finished_
  // The sync thread's buffers (it alone touches them while a sync is in flight; nextLocal_ is
  // only read then: the caller may not change it during a sync).
  std::vector<uint8_t> sendEnc_;  // this rank's encoded part (padded to 4)
  std::vector<uint8_t> recvEnc_;  // every rank's part, back to back
  scapeMaskSyncInfo_t info_{};
  scapeMaskSyncInfo_t pendingInfo_{};
  int64_t startNs_ = 0;
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_MASK_MASK_H_
