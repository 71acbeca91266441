// Device buffers on the UCX backend, staged through page-locked host buffers.
//
// A collective on device memory with a stream becomes, at the call (nothing waits on the
// host):
//   on the stream:  for each chunk c: copy D2H (device send -> host send stage); record ev[c]
//                   for each chunk c: wait on the device until the channel's flag word (in
//                                     page-locked host memory) says chunk c is reduced
//                                     (Runtime::StreamWaitValue);
//                                     copy H2D (host recv stage -> device recv)
//                   host function "job done" (only signals: the stages go back to the pool)
//   on the worker:  for each chunk c, in order: when ev[c] has completed, start the host
//                   collective of chunk c on the staged bytes; when it completes, write the
//                   flag to release the stream's wait for chunk c (and, however the job ends,
//                   past its last chunk).
// No host function blocks and none calls the runtime: CUDA runs the host functions of every
// stream of a context on one thread, so a host function that waited for the worker (as this
// pipeline's once did) held up every other stream's host functions, the worker's own
// dependencies among them.
// So the D2H copy of chunk c+1 overlaps the wire of chunk c, and the H2D copy of chunk c
// overlaps the wire of chunk c+1. The worker drives a child communicator of its own (its own
// UCX worker and endpoints, made once, collectively, at the first device collective), so the
// caller's thread stays free and host collectives on the parent communicator are not blocked
// by device ones.
//
// The plan (which bytes move where, chunk by chunk) is a pure function, tested on its own.
#ifndef SCAPE_PLUGIN_DEVICE_STAGING_H_
#define SCAPE_PLUGIN_DEVICE_STAGING_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/param.h"
#include "base/status.h"
#include "plugin/coll/coll.h"
#include "plugin/device/runtime.h"

namespace scape {
class Comm;
namespace device {

// One contiguous copy: `bytes` from offset `src` to offset `dst`. For D2H, src is an offset in
// the caller's send buffer and dst one in the host send stage; for H2D, src is an offset in
// the host receive stage and dst one in the caller's receive buffer.
struct StageCopy {
  size_t dst = 0, src = 0, bytes = 0;
};

struct StageChunk {
  std::vector<StageCopy> d2h;
  // The host collective of this chunk on the stages: count, and where its send and receive
  // buffers start in the send and receive stages (bytes). hasSend: false on a broadcast's
  // non-root ranks.
  size_t count = 0, sendOff = 0, recvOff = 0;
  bool hasSend = true;
  std::vector<StageCopy> h2d;
};

struct StagePlan {
  size_t sendStageBytes = 0, recvStageBytes = 0;
  std::vector<StageChunk> chunks;  // at least one (a count-0 collective still takes part)
};

// Cuts collective `a` (all-reduce, reduce-scatter, all-gather, broadcast; count per the
// coll::CollArgs conventions) into chunks of about chunkBytes staged bytes each (at least one
// element per rank block). Every rank gets the same chunk boundaries, so chunk c of every
// rank is the same host collective. Per-rank blocks (a.counts, the packed values of a mask:
// all-reduce, reduce-scatter, all-gather) are one chunk: the V collective runs whole on the
// stages, so its bits are those of the same call on host buffers.
// At most this many chunks per collective: chunks grow past chunkBytes to stay within it. A
// chunk costs about 4 entries in the stream's queue of pending work (copies, an event, a host
// function) and a CUDA stream's queue is bounded: on an H200, a job of 64 chunks (~257
// entries) behind a stream held by the caller blocked the enqueueing call, while 16 chunks
// (~65 entries) returned at once.
constexpr size_t kMaxStageChunks = 16;
Status MakeStagePlan(const coll::CollArgs& a, int rank, int nranks, size_t chunkBytes,
                     StagePlan* out);

// The zero-copy plan of an all-gather or broadcast (see SetZeroCopyForTesting): one chunk, the
// whole collective in place on the caller's receive buffer; its d2h copies are device-to-device
// copies from the send buffer to the own block (offsets: dst in recvbuf, src in sendbuf), none
// when the call is in place (a.send is the own block of a.recv).
Status MakeDirectPlan(const coll::CollArgs& a, int rank, int nranks, StagePlan* out);

// Chunk size of the staging pipeline: SCAPE_DEVICE_CHUNK_BYTES, default 4 MiB (>= 4 KiB).
size_t StageChunkBytes();

// Zero copy: when every rank's transport moves device memory itself (UCX built with CUDA) and
// SCAPE_DEVICE_ZERO_COPY is 1, the collectives that reduce nothing on the host (all-gather,
// broadcast) run on the caller's device buffers directly, ordered on the stream like a staged
// job (the stream waits for the exchange; the worker waits for the stream's earlier work), with
// the own block placed by a device-to-device copy when the call is not in place. Reductions
// stay staged (the host reduces). Tests: force it on (1) or off (0), or back to auto (-1).
void SetZeroCopyForTesting(int mode);

// The staging pipeline of one UCX communicator.
class StagingChannel {
 public:
  // Collective over `parent` (the child communicator is created here).
  static Status Create(Comm* parent, Runtime* rt, std::unique_ptr<StagingChannel>* out);
  // For tests of the pipeline alone: a channel over an existing communicator that this
  // channel then drives exclusively from its worker (not owned).
  static Status CreateOver(Comm* comm, Runtime* rt, int timeoutMs,
                           std::unique_ptr<StagingChannel>* out);
  // Drains (within the timeout) and stops the worker.
  ~StagingChannel();

  // Enqueues collective `a` (send/recv are device pointers; validated by the caller) on
  // `stream`. Returns once everything is enqueued; errors found later are sticky (error()).
  Status Enqueue(const coll::CollArgs& a, Stream stream);
  // Waits until every enqueued job has finished on its stream too (host wait).
  Status Drain(int timeoutMs);
  // The first error of a job (ok while none failed). After an error every later job fails at
  // once: its stream waits are released and its receive buffers are left unchanged.
  Status error();
  // Thread-safe: makes the worker give up (its jobs fail with scapeInvalidUsage).
  void Abort();
  // All-gathers and broadcasts go to the transport without staging (see SetZeroCopyForTesting).
  bool zeroCopy() const { return direct_; }
  bool aborted() const { return abort_.load(std::memory_order_acquire); }
  Runtime* runtime() const { return rt_; }

  struct Job;  // internal

 private:
  StagingChannel() = default;
  Status Start();
  // Collective over comm_: zero copy only if every rank can (and wants to).
  Status AgreeZeroCopy();
  Status EnqueueDirect(const coll::CollArgs& a, Stream stream);
  Status EnqueueJob(std::shared_ptr<Job> job, Stream stream, bool stagedCopies);
  void WorkerMain();
  void RunJob(Job* job);
  void FailJob(Job* job, const Status& st);
  void Reap();  // frees the stages and events of jobs whose streams are done
  // Lets the stream waits up to flag value v go (the worker, in job order; teardown).
  void Signal(uint32_t v) { __atomic_store_n(flag_, v, __ATOMIC_RELEASE); }
  Status AcquireStage(size_t bytes, void** p);

  Runtime* rt_ = nullptr;
  Comm* comm_ = nullptr;         // the communicator the worker drives
  std::unique_ptr<Comm> child_;  // owned when made by Create
  int timeoutMs_ = kDefaultTimeoutMs;
  int rank_ = 0, nranks_ = 1;
  size_t chunkBytes_ = 4 << 20;
  bool direct_ = false;  // zero copy for all-gathers and broadcasts (agreed by every rank)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;  // waiting for the worker
  std::vector<std::shared_ptr<Job>> live_;  // enqueued and not yet done on their streams
  struct Block {
    void* p;
    size_t bytes;
  };
  std::vector<Block> freeBlocks_;
  std::vector<Event> freeEvents_;
  uint32_t* flag_ = nullptr;  // HostAlloc'd; the streams' waits read it (StreamWaitValue)
  uint32_t nextSeq_ = 0;      // flag values handed to jobs so far (under mu_)
  Status error_;
  bool stop_ = false;
  std::atomic<bool> abort_{false};
  std::thread worker_;
};

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_STAGING_H_
