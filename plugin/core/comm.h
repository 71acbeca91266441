// The communicator: owns the transport, the queue of collective tasks and the error state.
// Internal; the public handle (struct scapeComm) wraps it in plugin/api/api.cc.
#ifndef SCAPE_PLUGIN_CORE_COMM_H_
#define SCAPE_PLUGIN_CORE_COMM_H_

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "base/param.h"
#include "base/status.h"
#include "plugin/coll/coll.h"
#include "scape/scape.h"
#include "transport/bootstrap/bootstrap.h"
#include "transport/transport.h"

namespace scape {

struct CommConfig {
  int timeoutMs = kDefaultTimeoutMs;
  scapeProgressMode_t progress = scapeProgressAuto;
  std::string netIf;  // empty: default interface
  // The caller's device allocator (scapeConfig_t.deviceAllocator); alloc NULL: none.
  scapeDeviceAllocator_t deviceAllocator{};
};

// Resolves a public config (NULL allowed) against SCAPE_* variables and defaults.
Status ResolveConfig(const scapeConfig_t* cfg, CommConfig* out);

// A pending or finished operation. Owned by the caller's request handle once returned.
struct PendingOp {
  coll::CollArgs args;
  std::unique_ptr<coll::Op> op;
  uint32_t seq = 0;
  bool started = false;
  bool done = false;
  Status result;
  // Runs once, on the thread that drives the communicator, when the operation has completed
  // successfully and before it is reported done (the unpack of an asynchronous masked
  // all-reduce). Must not fail and must not call into the communicator.
  std::function<void()> onDone;
};

class Comm final : public coll::Runner {
 public:
  // Collective over all ranks: rendezvous, connect, wire up. Fails on every rank that came if
  // one does not.
  static Status Create(int nranks, int rank, const bootstrap::RootAddress& root,
                       const CommConfig& cfg, std::unique_ptr<Comm>* out);
  ~Comm() override;

  int rank() const override { return rank_; }
  int nranks() const override { return nranks_; }
  const CommConfig& config() const { return cfg_; }
  // The error that broke the communicator (ok while usable).
  const Status& error() const { return error_; }
  size_t pending() const { return queue_.size(); }
  // This rank's transport moves device (CUDA) memory itself (transport::Transport::DeviceMemory).
  bool TransportMovesDeviceMemory() const { return tp_ && tp_->DeviceMemory(); }

  // Queues a validated collective; it starts when every earlier one has finished. onDone
  // (optional) becomes the operation's PendingOp::onDone.
  Status Submit(const coll::CollArgs& args, std::shared_ptr<PendingOp>* out,
                std::function<void()> onDone = nullptr);
  // Drives the queue until `op` is done (or the timeout / an error ends it).
  Status Wait(PendingOp* op);
  // One non-blocking pass; *done reports whether `op` has finished.
  Status Test(PendingOp* op, bool* done);

  // Best effort: tells every peer we are aborting, then closes all endpoints. Once only.
  void Abort(const std::string& why);

  // Puts the communicator in error state with `st` (peers are told, queued operations fail),
  // for an error found by a caller after communication started (a sparse all-reduce that
  // received a malformed part). Returns the communicator's error.
  Status Abandon(Status st) { return Fail(std::move(st)); }

  // Thread-safe: asks the thread that is driving this communicator (and every child made from
  // it) to give up: its wait ends within one poll with scapeInvalidUsage, the peers are told,
  // and the communicator is in error state. Used by scapeCommAbort from another thread.
  void RequestAbort() { abortRequested_.store(true, std::memory_order_release); }
  bool AbortRequested() const {
    return abortRequested_.load(std::memory_order_acquire) ||
           (parentAbort_ && parentAbort_->load(std::memory_order_acquire));
  }

  // Submit + Wait: runs one collective to completion (internal callers).
  Status Run(const coll::CollArgs& args) override;

  // Collective: a new communicator over the same ranks with its own transport (its own UCX
  // worker and endpoints), wired up through this one. Used for channels that a background
  // thread drives while the caller uses this communicator.
  Status CreateChild(std::unique_ptr<Comm>* out);

 private:
  Comm() = default;
  Status Init(const bootstrap::RootAddress& root);
  // Everything after the address exchange: endpoints, control channel, wire-up barrier.
  Status Connect(const std::vector<bootstrap::PeerEntry>& table);
  // Tuning and the transport (before any address exchange).
  Status InitTransport();
  std::string ifname_;
  std::vector<bootstrap::PeerEntry> peers_;  // hostHash and pid of every rank (blobs dropped)
  uint64_t hostHash_ = 0;
  // One pass over the network and the head of the queue.
  Status Poll(bool* advanced);
  Status PostControlRecv();
  Status CheckControl();
  // Records a fatal error: peers are told, queued operations fail, endpoints close.
  Status Fail(Status st);
  void Backoff(int idle);
  // Shared-memory channels cannot report a dead peer: look at the processes of the ranks on
  // this host (at most every 50 ms) and mark the ones that are gone.
  // force: declare an exited peer failed at once (teardown), without the grace period.
  // Returns a peer's abort notice that arrived while waiting for it (see comm.cc).
  Status WatchLocalPeers(bool force = false);

  int rank_ = 0, nranks_ = 1, localRanks_ = 1;
  CommConfig cfg_;
  scapeProgressMode_t mode_ = scapeProgressSpin;
  coll::Tuning tuning_;
  std::unique_ptr<transport::Transport> tp_;
  struct LocalPeer {
    int rank;
    pid_t pid;
    int64_t exitedSinceNs = 0;  // when this rank first saw the process gone (0: alive)
  };
  std::vector<LocalPeer> localPeers_;
  int64_t lastLivenessCheckNs_ = 0;
  // A same-host peer was declared failed by the process check (WatchLocalPeers), after its
  // notice had its chance to arrive: Fail need not wait for one.
  bool deadPeerDrained_ = false;
  // Cross-rank mismatch detection while the head operation waits (ProbeMismatch).
  int64_t lastAdvanceNs_ = 0;
  int64_t lastProbeNs_ = 0;
  Status ProbeMismatch(const PendingOp& head);
  std::deque<std::shared_ptr<PendingOp>> queue_;
  uint32_t nextSeq_ = 0;
  Status error_;
  // Control channel: abort notices from peers.
  std::vector<char> scratch_;  // working memory of the running operation (coll::Ctx::Scratch)
  std::unique_ptr<transport::Request> ctrlReq_;
  std::vector<char> ctrlBuf_;
  bool closed_ = false;  // Abort ran: endpoints are closed
  std::atomic<bool> abortRequested_{false};
  const std::atomic<bool>* parentAbort_ = nullptr;  // a child's link to its parent's flag
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_CORE_COMM_H_
