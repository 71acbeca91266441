// The staging pipeline: see staging.h.
#include "plugin/device/staging.h"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "base/clock.h"
#include "base/log.h"
#include "base/param.h"
#include "plugin/core/comm.h"

namespace scape {
namespace device {

size_t StageChunkBytes() {
  static const size_t v = [] {
    int64_t x = 0;
    Status st = ParamGetInt("SCAPE_DEVICE_CHUNK_BYTES", &x);
    if (!st.ok()) {
      x = ParamDefaultInt("SCAPE_DEVICE_CHUNK_BYTES");
      SCAPE_WARN("%s; using the default, %lld", st.message().c_str(), static_cast<long long>(x));
    }
    return static_cast<size_t>(x);
  }();
  return v;
}

namespace {

// Per-rank blocks ("V" collectives, the packed values of a mask): one chunk, the whole
// collective at once. Packed payloads are a few percent of the dense buffer, so they gain little
// from the pipeline, and one host collective keeps the V collective's reduction order (the
// same bits as the host call).
Status MakeStagePlanV(const coll::CollArgs& a, int rank, int nranks, size_t esz, StagePlan* out) {
  using coll::CollType;
  if (a.type == CollType::kBroadcast)
    return InvalidArgument("staging: a broadcast has no per-rank blocks");
  if (a.counts.size() != static_cast<size_t>(nranks))
    return InvalidArgument(
        StrFormat("staging: counts has %zu entries for %d ranks", a.counts.size(), nranks));
  size_t total = 0;
  for (size_t c : a.counts) {
    if (c > (SIZE_MAX / 2) / esz - total)
      return InvalidArgument("staging: the per-rank counts overflow");
    total += c;
  }
  const size_t mine = a.counts[static_cast<size_t>(rank)];
  StagePlan plan;
  StageChunk c;
  c.count = total;
  switch (a.type) {
    case CollType::kAllReduce:
      plan.sendStageBytes = plan.recvStageBytes = total * esz;
      if (total) c.d2h.push_back({0, 0, total * esz});
      if (total) c.h2d.push_back({0, 0, total * esz});
      break;
    case CollType::kReduceScatter:
      plan.sendStageBytes = total * esz;
      plan.recvStageBytes = mine * esz;
      if (total) c.d2h.push_back({0, 0, total * esz});
      if (mine) c.h2d.push_back({0, 0, mine * esz});
      break;
    default:  // all-gather
      plan.sendStageBytes = mine * esz;
      plan.recvStageBytes = total * esz;
      if (mine) c.d2h.push_back({0, 0, mine * esz});
      if (total) c.h2d.push_back({0, 0, total * esz});
      break;
  }
  plan.chunks.push_back(std::move(c));
  *out = std::move(plan);
  return Status::Ok();
}

}  // namespace

Status MakeStagePlan(const coll::CollArgs& a, int rank, int nranks, size_t chunkBytes,
                     StagePlan* out) {
  using coll::CollType;
  int dt;  // read as an integer: a caller's bad value must not be loaded as the enum
  std::memcpy(&dt, &a.dtype, sizeof dt);
  if (dt < 0 || dt >= scapeNumTypes) return InvalidArgument("staging: bad datatype");
  const size_t esz = scapeTypeSize(a.dtype);
  if (nranks < 1 || rank < 0 || rank >= nranks) return InvalidArgument("staging: bad rank");
  const size_t P = static_cast<size_t>(nranks), n = a.count;
  StagePlan plan;
  const bool blocks = a.type == CollType::kReduceScatter || a.type == CollType::kAllGather;
  if (a.type != CollType::kAllReduce && a.type != CollType::kBroadcast && !blocks)
    return Unsupported(StrFormat("staging: %s has no device form", coll::CollName(a.type)));
  if (!a.counts.empty()) return MakeStagePlanV(a, rank, nranks, esz, out);
  // Elements of the count dimension per chunk: about chunkBytes staged per chunk.
  size_t per = chunkBytes / esz / (blocks ? P : 1);
  if (per < 1) per = 1;
  // At most kMaxStageChunks chunks: each costs a few entries in the stream's bounded queue of
  // pending work, and a big buffer grows its chunks instead of its chunk count.
  per = std::max(per, (n + kMaxStageChunks - 1) / kMaxStageChunks);
  if (a.type == CollType::kAllReduce || a.type == CollType::kBroadcast) {
    plan.sendStageBytes = plan.recvStageBytes = n * esz;
  } else if (a.type == CollType::kReduceScatter) {
    plan.sendStageBytes = P * n * esz;
    plan.recvStageBytes = n * esz;
  } else {
    plan.sendStageBytes = n * esz;
    plan.recvStageBytes = P * n * esz;
  }
  const bool hasSend = a.type != CollType::kBroadcast || rank == a.root;
  size_t lo = 0;
  do {
    const size_t hi = std::min(n, lo + per), len = hi - lo, b = len * esz;
    StageChunk c;
    c.count = len;
    c.hasSend = hasSend;
    switch (a.type) {
      case CollType::kAllReduce:
      case CollType::kBroadcast:
        c.sendOff = c.recvOff = lo * esz;
        if (b && hasSend) c.d2h.push_back({lo * esz, lo * esz, b});
        if (b) c.h2d.push_back({lo * esz, lo * esz, b});
        break;
      case CollType::kReduceScatter:
        // Chunk c holds [lo, hi) of every rank's block, packed block after block.
        c.sendOff = P * lo * esz;
        c.recvOff = lo * esz;
        if (b)
          for (size_t r = 0; r < P; ++r)
            c.d2h.push_back({(P * lo + r * len) * esz, (r * n + lo) * esz, b});
        if (b) c.h2d.push_back({lo * esz, lo * esz, b});
        break;
      default:  // all-gather
        c.sendOff = lo * esz;
        c.recvOff = P * lo * esz;
        if (b) c.d2h.push_back({lo * esz, lo * esz, b});
        if (b)
          for (size_t r = 0; r < P; ++r)
            c.h2d.push_back({(r * n + lo) * esz, (P * lo + r * len) * esz, b});
        break;
    }
    plan.chunks.push_back(std::move(c));
    lo = hi;
  } while (lo < n);
  *out = std::move(plan);
  return Status::Ok();
}

Status MakeDirectPlan(const coll::CollArgs& a, int rank, int nranks, StagePlan* out) {
  using coll::CollType;
  int dt;  // read as an integer, as MakeStagePlan does
  std::memcpy(&dt, &a.dtype, sizeof dt);
  if (dt < 0 || dt >= scapeNumTypes) return InvalidArgument("staging: bad datatype");
  if (nranks < 1 || rank < 0 || rank >= nranks) return InvalidArgument("staging: bad rank");
  if (a.type != CollType::kAllGather && a.type != CollType::kBroadcast)
    return Unsupported(StrFormat("zero copy: %s reduces on the host", coll::CollName(a.type)));
  if (!a.counts.empty() && a.counts.size() != static_cast<size_t>(nranks))
    return InvalidArgument("staging: counts must have one entry per rank");
  const size_t esz = scapeTypeSize(a.dtype), r = static_cast<size_t>(rank);
  StageChunk c;
  size_t own = 0, ownBytes = 0;  // where this rank's block lies in recvbuf, and its size
  if (a.type == CollType::kBroadcast) {
    c.count = a.count;
    c.hasSend = rank == a.root;
    ownBytes = c.hasSend ? a.count * esz : 0;
  } else if (a.counts.empty()) {
    c.count = a.count;
    own = r * a.count * esz;
    ownBytes = a.count * esz;
  } else {
    for (size_t i = 0; i < a.counts.size(); ++i) {
      c.count += a.counts[i];
      if (i < r) own += a.counts[i] * esz;
    }
    ownBytes = a.counts[r] * esz;
  }
  c.sendOff = own;  // the in-place send buffer: the own block of recvbuf
  c.recvOff = 0;
  if (ownBytes && c.hasSend && a.send != static_cast<const char*>(a.recv) + own)
    c.d2h.push_back({own, 0, ownBytes});
  StagePlan plan;
  plan.chunks.push_back(std::move(c));
  *out = std::move(plan);
  return Status::Ok();
}

namespace {
std::atomic<int> g_zeroCopyForTesting{-1};
}  // namespace

void SetZeroCopyForTesting(int mode) { g_zeroCopyForTesting.store(mode); }

// ---- jobs ----------------------------------------------------------------------------------

struct StagingChannel::Job {
  coll::CollArgs args;
  StagePlan plan;
  char* sendStage = nullptr;
  size_t sendBytes = 0;
  char* recvStage = nullptr;
  size_t recvBytes = 0;
  std::vector<Event> events;
  // The channel's flag value before chunk 0: the stream's wait for chunk c lets go when the
  // worker has written seq0 + c + 1 (chunk c reduced, or the job over).
  uint32_t seq0 = 0;
  int device = 0;  // the caller's current device at the call
  // Zero copy: the "stages" are the caller's receive buffer (never freed or pooled here).
  bool direct = false;
  std::mutex m;
  std::condition_variable cv;
  size_t chunksDone = 0;
  bool failed = false;
  bool workerDone = false;  // the worker no longer touches the stages
  bool streamDone = false;  // the last host function ran: the stream no longer touches them
  bool doneFnQueued = false;
  bool enqueueFailed = false;  // Enqueue gave up part way: the worker leaves the job alone
  // Chunks whose event has been recorded on the stream: the worker queries no event before
  // (the job reaches the worker before its copies are on the stream; see Enqueue).
  std::atomic<size_t> recorded{0};
};

namespace {

// Host function at the end of a job: only signals (it never waits and calls no runtime: CUDA
// runs every host function of a context on one thread, and forbids CUDA calls there).
void JobDoneFn(void* arg) {
  auto* j = static_cast<StagingChannel::Job*>(arg);
  std::lock_guard<std::mutex> lk(j->m);
  j->streamDone = true;
  j->cv.notify_all();
}

}  // namespace

Status StagingChannel::Create(Comm* parent, Runtime* rt, std::unique_ptr<StagingChannel>* out) {
  std::unique_ptr<StagingChannel> ch(new StagingChannel());
  SCAPE_RETURN_IF_ERROR(parent->CreateChild(&ch->child_));
  ch->comm_ = ch->child_.get();
  ch->rt_ = rt;
  ch->timeoutMs_ = parent->config().timeoutMs;
  SCAPE_RETURN_IF_ERROR(ch->AgreeZeroCopy());
  SCAPE_RETURN_IF_ERROR(ch->Start());
  *out = std::move(ch);
  return Status::Ok();
}

Status StagingChannel::CreateOver(Comm* comm, Runtime* rt, int timeoutMs,
                                  std::unique_ptr<StagingChannel>* out) {
  std::unique_ptr<StagingChannel> ch(new StagingChannel());
  ch->comm_ = comm;
  ch->rt_ = rt;
  ch->timeoutMs_ = timeoutMs;
  ch->direct_ = g_zeroCopyForTesting.load() == 1;  // tests only: no collective agreement here
  SCAPE_RETURN_IF_ERROR(ch->Start());
  *out = std::move(ch);
  return Status::Ok();
}

Status StagingChannel::AgreeZeroCopy() {
  const int forced = g_zeroCopyForTesting.load();
  int64_t want = 1;
  if (forced < 0) {
    Status st = ParamGetInt("SCAPE_DEVICE_ZERO_COPY", &want);
    if (!st.ok()) {
      SCAPE_WARN("%s; staging every device collective", st.message().c_str());
      want = 0;
    }
  }
  // Every rank must take the same path (the paths chunk differently): the minimum of what each
  // rank can do, all-reduced over the channel's communicator.
  int32_t mine = forced >= 0 ? forced : (want && comm_->TransportMovesDeviceMemory() ? 1 : 0);
  int32_t all = 0;
  coll::CollArgs a;
  a.type = coll::CollType::kAllReduce;
  a.send = &mine;
  a.recv = &all;
  a.count = 1;
  a.dtype = scapeInt32;
  a.op = scapeMin;
  SCAPE_RETURN_IF_ERROR(comm_->Run(a).Prepend("agreeing on zero copy for device buffers"));
  direct_ = all == 1;
  SCAPE_INFO("rank %d: device all-gathers and broadcasts are %s", comm_->rank(),
             direct_ ? "zero copy (UCX moves CUDA memory on every rank)" : "staged");
  return Status::Ok();
}

Status StagingChannel::Start() {
  rank_ = comm_->rank();
  nranks_ = comm_->nranks();
  chunkBytes_ = StageChunkBytes();
  void* f = nullptr;
  SCAPE_RETURN_IF_ERROR(rt_->HostAlloc(sizeof(uint32_t), &f).Prepend("the staging flag"));
  flag_ = static_cast<uint32_t*>(f);
  __atomic_store_n(flag_, 0u, __ATOMIC_RELEASE);
  try {
    worker_ = std::thread([this] { WorkerMain(); });
  } catch (const std::exception& e) {
    return SystemError(std::string("cannot start the staging worker thread: ") + e.what());
  }
  return Status::Ok();
}

StagingChannel::~StagingChannel() {
  Status st = Drain(aborted() ? 1000 : timeoutMs_ + 1000);
  if (!st.ok()) SCAPE_WARN("device staging: %s", st.message().c_str());
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    if (!st.ok()) abort_.store(true);
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lk(mu_);
  // Every job has left the worker: no stream wait may be held past this.
  if (flag_) Signal(nextSeq_);
  // A stream that has not reached the end of its job still reads the flag, and its JobDoneFn
  // the job: both are kept (leaked) then, as the job's stages are.
  if (flag_ && live_.empty()) rt_->HostFree(flag_);
  flag_ = nullptr;
  for (const std::shared_ptr<Job>& j : live_) new std::shared_ptr<Job>(j);
  live_.clear();
  // Jobs whose streams never reached their end keep their stages (leaked, not freed under a
  // pending copy).
  for (Block& b : freeBlocks_) rt_->HostFree(b.p);
  for (Event e : freeEvents_) rt_->EventDestroy(e);
  freeBlocks_.clear();
  freeEvents_.clear();
  child_.reset();
}

Status StagingChannel::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

void StagingChannel::Abort() {
  abort_.store(true, std::memory_order_release);
  if (comm_) comm_->RequestAbort();
  cv_.notify_all();
}

Status StagingChannel::AcquireStage(size_t bytes, void** p) {
  if (bytes == 0) {
    *p = nullptr;
    return Status::Ok();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    size_t best = freeBlocks_.size();
    for (size_t i = 0; i < freeBlocks_.size(); ++i)
      if (freeBlocks_[i].bytes >= bytes &&
          (best == freeBlocks_.size() || freeBlocks_[i].bytes < freeBlocks_[best].bytes))
        best = i;
    if (best < freeBlocks_.size()) {
      *p = freeBlocks_[best].p;
      freeBlocks_.erase(freeBlocks_.begin() + static_cast<std::ptrdiff_t>(best));
      return Status::Ok();
    }
  }
  return rt_->HostAlloc(bytes, p);
}

void StagingChannel::Reap() {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < live_.size();) {
    Job* j = live_[i].get();
    bool done;
    {
      std::lock_guard<std::mutex> jl(j->m);
      done = j->workerDone && j->streamDone;
    }
    if (!done) {
      ++i;
      continue;
    }
    if (j->sendStage && !j->direct) freeBlocks_.push_back({j->sendStage, j->sendBytes});
    if (j->recvStage && !j->direct) freeBlocks_.push_back({j->recvStage, j->recvBytes});
    for (Event e : j->events) freeEvents_.push_back(e);
    j->sendStage = j->recvStage = nullptr;
    j->events.clear();
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

Status StagingChannel::Enqueue(const coll::CollArgs& a, Stream stream) {
  SCAPE_RETURN_IF_ERROR(error());
  // The stream waits for the host exchange on a flag the worker sets when it runs: a CUDA graph
  // replay would wait on a flag nobody sets for it. Refused before anything is enqueued.
  if (rt_->StreamCapturing(stream))
    return Unsupported(StrFormat(
        "rank %d: %s on device buffers: a staged device collective (UCX backend) cannot be "
        "captured in a CUDA graph (its stream waits for the host exchange, which a replay never "
        "runs); issue it outside the capture, or use the NCCL backend",
        rank_, coll::CollName(a.type)));
  Reap();
  auto job = std::make_shared<Job>();
  job->args = a;
  job->device = rt_->GetDevice();
  job->direct =
      direct_ && (a.type == coll::CollType::kAllGather || a.type == coll::CollType::kBroadcast);
  SCAPE_RETURN_IF_ERROR(job->direct ? MakeDirectPlan(a, rank_, nranks_, &job->plan)
                                    : MakeStagePlan(a, rank_, nranks_, chunkBytes_, &job->plan));
  const size_t n = job->plan.chunks.size();
  void* s = nullptr;
  void* r = nullptr;
  Status st;
  if (job->direct) {
    s = r = a.recv;  // the copies below then place the own block in recvbuf (device to device)
  } else {
    st = AcquireStage(job->plan.sendStageBytes, &s);
    if (st.ok()) st = AcquireStage(job->plan.recvStageBytes, &r);
  }
  job->sendStage = static_cast<char*>(s);
  job->sendBytes = job->plan.sendStageBytes;
  job->recvStage = static_cast<char*>(r);
  job->recvBytes = job->plan.recvStageBytes;
  for (size_t c = 0; st.ok() && c < n; ++c) {
    Event e = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!freeEvents_.empty()) {
        e = freeEvents_.back();
        freeEvents_.pop_back();
      }
    }
    if (!e) st = rt_->EventCreate(&e);
    if (st.ok()) job->events.push_back(e);
  }
  const char* src = static_cast<const char*>(a.send);
  char* dst = static_cast<char*>(a.recv);
  bool anyWait = false;
  // The worker gets the job before anything goes on the stream. Enqueueing can block: a
  // stream holds a bounded queue of pending work, and a long job fills it while the stream
  // waits for chunk 0's exchange, which only the worker can run. Handing the job over last,
  // as this once did, deadlocked on a real GPU with many chunks. The job's flag values are
  // taken in queue order, the order in which the worker runs (and signals) the jobs.
  if (st.ok()) {
    std::lock_guard<std::mutex> lk(mu_);
    job->seq0 = nextSeq_;
    nextSeq_ += static_cast<uint32_t>(n);
    live_.push_back(job);
    queue_.push_back(job);
  }
  cv_.notify_all();
  const bool queued = st.ok();
  for (size_t c = 0; st.ok() && c < n; ++c) {
    for (const StageCopy& cp : job->plan.chunks[c].d2h) {
      st = rt_->CopyAsync(job->sendStage + cp.dst, src + cp.src, cp.bytes, stream);
      if (!st.ok()) break;
    }
    if (st.ok()) st = rt_->EventRecord(job->events[c], stream);
    if (st.ok()) job->recorded.store(c + 1, std::memory_order_release);
  }
  // The stream waits for chunk c's exchange on the device (a wait on the channel's flag word),
  // never in a host function: a host function that blocks holds the context's one
  // host-function thread, and another stream's host function (or this job's own JobDoneFn
  // behind a second job) would then wait behind it.
  for (size_t c = 0; st.ok() && c < n; ++c) {
    st = rt_->StreamWaitValue(stream, flag_, job->seq0 + static_cast<uint32_t>(c) + 1);
    if (!st.ok()) break;
    anyWait = true;
    for (const StageCopy& cp : job->plan.chunks[c].h2d) {
      st = rt_->CopyAsync(dst + cp.dst, job->recvStage + cp.src, cp.bytes, stream);
      if (!st.ok()) break;
    }
  }
  if (st.ok() || anyWait) {
    Status d = rt_->LaunchHostFunc(stream, JobDoneFn, job.get());
    job->doneFnQueued = d.ok();
    if (st.ok()) st = d;
  }
  if (!st.ok()) {
    // The worker must not run the job: release the stream's waits at once. Without a host
    // function on the stream, copies into the stages may still be pending: wait for them
    // before the stages can be reused.
    // (With a deadline: a copy that has not run by then is the stream's, and the job is then
    // leaked below with its stages instead of freed under it.)
    bool copiesDone = true;
    if (!job->doneFnQueued && !anyWait)
      copiesDone =
          StreamWaitFor(rt_, stream, timeoutMs_, "the staged copies of a failed enqueue").ok();
    {
      std::lock_guard<std::mutex> jl(job->m);
      job->enqueueFailed = true;
      job->failed = true;
      if (!queued) job->workerDone = true;  // never handed over
      if (!job->doneFnQueued && !anyWait && copiesDone) job->streamDone = true;  // stream idle
      job->cv.notify_all();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (!job->doneFnQueued && !job->streamDone) {
      // Host functions may still run against the job, and nothing will say when they are
      // done: leak it rather than free it, and keep it out of what Drain waits for.
      for (size_t i = 0; i < live_.size(); ++i)
        if (live_[i] == job) {
          live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        }
      new std::shared_ptr<Job>(job);
    } else if (!queued) {
      live_.push_back(job);
    }
  }
  cv_.notify_all();
  if (!st.ok()) st.Prepend("enqueueing the staged copies on the stream");
  return st;
}

Status StagingChannel::Drain(int timeoutMs) {
  Deadline dl = Deadline::AfterMs(timeoutMs);
  for (;;) {
    Reap();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (live_.empty() && queue_.empty()) return error_;
    }
    if (dl.Expired())
      return TimeoutError(
          StrFormat("device collectives still in flight after %d ms: a stream "
                    "did not reach them (is it waiting on later work?)",
                    timeoutMs));
    struct timespec ts = {0, 200000};
    nanosleep(&ts, nullptr);
  }
}

void StagingChannel::FailJob(Job* job, const Status& st) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.ok()) error_ = st;
  }
  std::lock_guard<std::mutex> jl(job->m);
  job->failed = true;
  job->workerDone = true;
  job->cv.notify_all();
}

void StagingChannel::WorkerMain() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ with nothing left
      job = queue_.front();
    }
    RunJob(job.get());
    // However the job ended (done, failed, given up, enqueued only in part), every wait its
    // stream holds lets go: a failed job's receive buffer then gets its stage's bytes back.
    Signal(job->seq0 + static_cast<uint32_t>(job->plan.chunks.size()));
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.pop_front();
    }
  }
}

void StagingChannel::RunJob(Job* job) {
  Status prior = error();
  if (!prior.ok()) return FailJob(job, prior);
  rt_->SetDevice(job->device);
  const size_t n = job->plan.chunks.size();
  size_t next = 0;
  std::deque<std::pair<size_t, std::shared_ptr<PendingOp>>> inflight;
  int64_t last = NowNs();
  const int64_t limit = static_cast<int64_t>(timeoutMs_) * 1000000;
  int idle = 0;
  for (;;) {
    if (abort_.load(std::memory_order_acquire))
      return FailJob(job, InvalidUsage("device collective: the communicator was aborted"));
    bool enqueueFailed;
    {
      std::lock_guard<std::mutex> jl(job->m);
      enqueueFailed = job->enqueueFailed;
    }
    if (enqueueFailed) {
      // The caller got the error. Before any chunk went on the wire the channel stays usable;
      // after, the peers' matching chunks are left unmatched: fail the channel (sticky).
      if (next > 0)
        return FailJob(job, InternalError("device collective: enqueueing failed part way"));
      std::lock_guard<std::mutex> jl(job->m);
      job->workerDone = true;
      job->cv.notify_all();
      return;
    }
    bool progress = false;
    if (next < n && inflight.size() < 4 && next < job->recorded.load(std::memory_order_acquire)) {
      bool ready = false;
      Status st = rt_->EventQuery(job->events[next], &ready);
      if (!st.ok()) return FailJob(job, st);
      if (ready) {
        const StageChunk& c = job->plan.chunks[next];
        coll::CollArgs a = job->args;
        a.count = c.count;
        a.send = c.hasSend ? job->sendStage + c.sendOff : nullptr;
        a.recv = job->recvStage + c.recvOff;
        if (c.count == 0) a.send = a.recv = nullptr;
        std::shared_ptr<PendingOp> op;
        st = comm_->Submit(a, &op);
        if (!st.ok()) return FailJob(job, st);
        inflight.emplace_back(next, std::move(op));
        ++next;
        progress = true;
      }
    }
    if (!inflight.empty()) {
      bool fin = false;
      Status st = comm_->Test(inflight.front().second.get(), &fin);
      if (!st.ok()) return FailJob(job, st);
      if (!comm_->error().ok() && !fin) return FailJob(job, comm_->error());
      if (fin) {
        bool all;
        {
          std::lock_guard<std::mutex> jl(job->m);
          job->chunksDone = inflight.front().first + 1;
          all = job->chunksDone == n;
          if (all) job->workerDone = true;
          job->cv.notify_all();
        }
        Signal(job->seq0 + static_cast<uint32_t>(inflight.front().first) + 1);
        inflight.pop_front();
        progress = true;
        if (all) return;
      }
    }
    if (progress) {
      last = NowNs();
      idle = 0;
      continue;
    }
    if (NowNs() - last > limit)
      return FailJob(job, TimeoutError(StrFormat(
                              "device collective: no progress for %d ms (chunk %zu of %zu %s)",
                              timeoutMs_, next < n ? next : n - 1, n,
                              next < n && inflight.empty()
                                  ? "waiting for its copy from the device: the stream did not "
                                    "reach it"
                                  : "on the wire")));
    if (++idle < 64) {
      sched_yield();
    } else {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, nullptr);
    }
  }
}

}  // namespace device
}  // namespace scape
