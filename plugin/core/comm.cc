#include "plugin/core/comm.h"

#include <sched.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/clock.h"
#include "base/log.h"
#include "base/param.h"

namespace scape {
namespace {

constexpr uint32_t kNoticeMagic = 0x5ca9ab07u;
constexpr size_t kNoticeMsgBytes = 240;
// How long the head operation waits without progress before the mismatch probe runs (and
// how often it runs while the wait lasts).
constexpr int64_t kProbeIdleNs = 50 * 1000 * 1000;

struct Notice {
  uint32_t magic;
  int32_t rank;
  int32_t code;
  uint32_t len;
  char msg[kNoticeMsgBytes];
};

int OnlineCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

// True when the caller's struct (cfg->size bytes) is large enough to hold `field`: a caller
// built against an older, smaller scapeConfig_t has not set the fields added after it.
#define SCAPE_CONFIG_HAS(cfg, field) \
  ((cfg)->size >= offsetof(scapeConfig_t, field) + sizeof((cfg)->field))

// Zero-byte dissemination rounds that end an operation on every rank only once every rank has
// reached them with the same signature: the confirmation of a collective whose own messages
// do not reach every rank (a broadcast: its root learns nothing from the others; a count-0
// collective: it moves nothing at all). Runs after `inner` (may be null), in the same
// operation (sequence number and signature), on steps above any the algorithms use. Ranks
// that disagree on the root or the count meet here, or in the probe of Comm::ProbeMismatch,
// instead of some returning success while the others wait for the timeout.
class ConfirmOp final : public coll::Op {
 public:
  static constexpr uint32_t kFirstStep = 0xffe0;
  ConfirmOp(std::unique_ptr<coll::Op> inner, int rank, int nranks)
      : inner_(std::move(inner)), r_(rank), p_(nranks) {}
  Status Start(coll::Ctx& ctx) override {
    if (inner_) return inner_->Start(ctx);
    return StartRound(ctx);
  }
  Status Progress(coll::Ctx& ctx, bool* done, bool* advanced) override {
    *done = false;
    if (inner_) {
      bool d = false;
      SCAPE_RETURN_IF_ERROR(inner_->Progress(ctx, &d, advanced));
      if (!d) return Status::Ok();
      inner_.reset();
      SCAPE_RETURN_IF_ERROR(StartRound(ctx));
    }
    while (dist_ < p_) {
      bool sd = false, rd = false;
      SCAPE_RETURN_IF_ERROR(ctx.Check(&send_, 0, &sd, advanced));
      SCAPE_RETURN_IF_ERROR(ctx.Check(&recv_, 0, &rd, advanced));
      if (!sd || !rd) return Status::Ok();
      dist_ <<= 1;
      ++round_;
      SCAPE_RETURN_IF_ERROR(StartRound(ctx));
    }
    *done = true;
    return Status::Ok();
  }

 private:
  Status StartRound(coll::Ctx& ctx) {
    if (dist_ >= p_) return Status::Ok();
    const uint32_t step = kFirstStep + round_;
    SCAPE_RETURN_IF_ERROR(ctx.Recv((r_ - dist_ % p_ + p_) % p_, step, dummy_, 0, &recv_));
    return ctx.Send((r_ + dist_) % p_, step, dummy_, 0, &send_);
  }
  std::unique_ptr<coll::Op> inner_;
  int r_, p_;
  int dist_ = 1;
  uint32_t round_ = 0;
  char dummy_[8] = {0};
  std::unique_ptr<transport::Request> send_, recv_;
};

}  // namespace

Status ResolveConfig(const scapeConfig_t* cfg, CommConfig* out) {
  CommConfig c;
  LogEffectiveParams("communicator");
  int64_t t = 0;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_TIMEOUT_MS", &t));
  c.timeoutMs = static_cast<int>(t);
  int progress = 0;  // the choices are declared in scapeProgressMode_t's order
  SCAPE_RETURN_IF_ERROR(ParamGetChoice("SCAPE_PROGRESS", &progress));
  c.progress = static_cast<scapeProgressMode_t>(progress);
  c.netIf = ParamString("SCAPE_SOCKET_IFNAME");
  if (cfg) {
    // Only the header (size, magic, version) is read before the size is known to cover it.
    constexpr size_t kHeader = offsetof(scapeConfig_t, version) + sizeof(unsigned);
    if (cfg->size < kHeader || cfg->magic != SCAPE_CONFIG_MAGIC)
      return InvalidArgument(
          StrFormat("config: not initialised with SCAPE_CONFIG_INITIALIZER "
                    "(size %zu, magic 0x%x)",
                    cfg->size, cfg->magic));
    constexpr unsigned kOurs = SCAPE_VERSION_CODE;
    if (cfg->version / 10000 != kOurs / 10000 ||
        (cfg->size > sizeof(scapeConfig_t) && cfg->version > kOurs))
      return Unsupported(
          StrFormat("config: built against SCAPE version code %u (struct of %zu "
                    "bytes); this library is %d (%zu bytes)",
                    cfg->version, cfg->size, SCAPE_VERSION_CODE, sizeof(scapeConfig_t)));
    if (SCAPE_CONFIG_HAS(cfg, timeoutMs) && cfg->timeoutMs != SCAPE_CONFIG_UNDEF_INT) {
      if (cfg->timeoutMs <= 0)
        return InvalidArgument(StrFormat("config->timeoutMs = %d: expected > 0", cfg->timeoutMs));
      c.timeoutMs = cfg->timeoutMs;
    }
    if (SCAPE_CONFIG_HAS(cfg, progressMode) && cfg->progressMode != SCAPE_CONFIG_UNDEF_INT) {
      if (cfg->progressMode < 0 || cfg->progressMode >= scapeNumProgressModes)
        return InvalidArgument(
            StrFormat("config->progressMode = %d: expected a "
                      "scapeProgressMode_t (0..%d)",
                      cfg->progressMode, scapeNumProgressModes - 1));
      c.progress = static_cast<scapeProgressMode_t>(cfg->progressMode);
    }
    if (SCAPE_CONFIG_HAS(cfg, netIf) && cfg->netIf) c.netIf = cfg->netIf;
    if (SCAPE_CONFIG_HAS(cfg, deviceAllocator)) {
      const scapeDeviceAllocator_t& a = cfg->deviceAllocator;
      if ((a.alloc == nullptr) != (a.free == nullptr))
        return InvalidArgument(
            "config->deviceAllocator: alloc and free must both be set (the caller's allocator) "
            "or both be NULL (the library's pool)");
      c.deviceAllocator = a;
    }
  }
  *out = c;
  return Status::Ok();
}

Status Comm::Create(int nranks, int rank, const bootstrap::RootAddress& root, const CommConfig& cfg,
                    std::unique_ptr<Comm>* out) {
  std::unique_ptr<Comm> c(new Comm());
  c->rank_ = rank;
  c->nranks_ = nranks;
  c->cfg_ = cfg;
  SCAPE_RETURN_IF_ERROR(c->Init(root));
  *out = std::move(c);
  return Status::Ok();
}

Status Comm::Init(const bootstrap::RootAddress& root) {
  SCAPE_RETURN_IF_ERROR(InitTransport());
  std::vector<bootstrap::PeerEntry> table;
  SCAPE_RETURN_IF_ERROR(bootstrap::Rendezvous(root, rank_, nranks_, hostHash_, tp_->LocalAddress(),
                                              cfg_.timeoutMs, &table));
  return Connect(table);
}

Status Comm::InitTransport() {
  int64_t threshold = 0, chunk = 0;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_RING_THRESHOLD", &threshold));
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_CHUNK_BYTES", &chunk));  // >= 4096 by declaration
  tuning_.ringThresholdBytes = static_cast<size_t>(threshold);
  tuning_.chunkBytes = static_cast<size_t>(chunk);
  tuning_.chunkSizeAware = !ParamIsSet("SCAPE_CHUNK_BYTES");
  // Declared as "auto,ring,rd": 0 auto, 1 ring, 2 recursive doubling, as allreduceAlgo counts.
  SCAPE_RETURN_IF_ERROR(ParamGetChoice("SCAPE_ALLREDUCE_ALGO", &tuning_.allreduceAlgo));

  transport::TransportOptions to;
  to.rank = rank_;
  to.nranks = nranks_;
  to.timeoutMs = cfg_.timeoutMs;
  to.wakeup = cfg_.progress == scapeProgressBlocking;
  to.tls = ParamString("SCAPE_UCX_TLS");
  // A communicator bootstrapped over loopback lives on one host: keep UCX's TCP on loopback
  // too, unless the user chose UCX's devices.
  bootstrap::SockAddr ifaddr;
  SCAPE_RETURN_IF_ERROR(bootstrap::InterfaceAddress(cfg_.netIf, &ifaddr, &ifname_));
  if (!ParamExternal("UCX_NET_DEVICES") && bootstrap::IsLoopback(ifaddr)) to.netDevices = ifname_;
  hostHash_ = bootstrap::HostHash();

  Status st;
  tp_ = transport::CreateUcxTransport(to, &st);
  if (!st.ok()) return st.Prepend("UCX initialisation");
  return Status::Ok();
}

Status Comm::Connect(const std::vector<bootstrap::PeerEntry>& table) {
  int64_t shm = 1;
  SCAPE_RETURN_IF_ERROR(ParamGetInt("SCAPE_LOCAL_SHM", &shm));
  const bool localShm = shm != 0;
  localRanks_ = 0;
  peers_.clear();
  for (int r = 0; r < nranks_; ++r) {
    const bootstrap::PeerEntry& e = table[static_cast<size_t>(r)];
    bootstrap::PeerEntry info;
    info.hostHash = e.hostHash;
    info.pid = e.pid;
    peers_.push_back(info);
    if (e.hostHash == hostHash_) ++localRanks_;
    if (r == rank_) continue;
    const bool sameHost = e.hostHash == hostHash_ && localShm;
    if (sameHost) localPeers_.push_back(LocalPeer{r, static_cast<pid_t>(e.pid)});
    SCAPE_RETURN_IF_ERROR(tp_->Connect(r, e.blob.data(), e.blob.size(), sameHost));
  }
  mode_ = cfg_.progress;
  if (mode_ == scapeProgressAuto)
    mode_ = localRanks_ > OnlineCpus() ? scapeProgressYield : scapeProgressSpin;
  SCAPE_INFO("rank %d/%d: %d ranks on this host, progress mode %d, interface %s", rank_, nranks_,
             localRanks_, static_cast<int>(mode_), ifname_.c_str());

  ctrlBuf_.resize(sizeof(Notice));
  SCAPE_RETURN_IF_ERROR(PostControlRecv());
  // Wire up every endpoint now, so that the first collective does not pay for it and a peer
  // that cannot be reached is an init error.
  coll::CollArgs barrier;
  barrier.type = coll::CollType::kBarrier;
  Status w = Run(barrier);
  if (!w.ok()) return w.Prepend("connecting the ranks");
  return Status::Ok();
}

Status Comm::Run(const coll::CollArgs& args) {
  std::shared_ptr<PendingOp> op;
  SCAPE_RETURN_IF_ERROR(Submit(args, &op));
  return Wait(op.get());
}

Status Comm::CreateChild(std::unique_ptr<Comm>* out) {
  if (!error_.ok()) return error_;
  std::unique_ptr<Comm> c(new Comm());
  c->rank_ = rank_;
  c->nranks_ = nranks_;
  c->cfg_ = cfg_;
  // A child is driven by a background thread beside the caller's computation: it must not
  // spin on a core the caller needs, so it sleeps on the transport's event descriptor while it
  // waits for peers (blocking progress). Measured with scape-perf --mode masksync: the
  // sync's overlap with an idle host thread went from 0.69-0.73 (yield) to 0.95-0.99 at 2
  // ranks, at the same sync time; a spinning waiter kept the host's cores busy past the end
  // of the sync, so the caller woke late.
  c->cfg_.progress = scapeProgressBlocking;
  c->parentAbort_ = &abortRequested_;  // children never outlive their parent (masks die first)
  SCAPE_RETURN_IF_ERROR(c->InitTransport());
  // Exchange the new worker addresses over this communicator: lengths, then padded blobs.
  const std::vector<uint8_t>& mine = c->tp_->LocalAddress();
  const size_t P = static_cast<size_t>(nranks_);
  std::vector<int64_t> lens(P);
  int64_t myLen = static_cast<int64_t>(mine.size());
  coll::CollArgs ag;
  ag.type = coll::CollType::kAllGather;
  ag.send = &myLen;
  ag.recv = lens.data();
  ag.count = 1;
  ag.dtype = scapeInt64;
  SCAPE_RETURN_IF_ERROR(Run(ag));
  size_t maxLen = 0;
  for (size_t r = 0; r < P; ++r) {
    if (lens[r] <= 0 || lens[r] > static_cast<int64_t>(bootstrap::kMaxBlobBytes))
      return RemoteError(
          StrFormat("rank %zu published a %lld-byte address", r, static_cast<long long>(lens[r])));
    maxLen = std::max(maxLen, static_cast<size_t>(lens[r]));
  }
  maxLen = (maxLen + 3) / 4 * 4;
  std::vector<uint8_t> padded(maxLen, 0), all(P * maxLen);
  std::copy(mine.begin(), mine.end(), padded.begin());
  ag.send = padded.data();
  ag.recv = all.data();
  ag.count = maxLen / 4;
  ag.dtype = scapeInt32;
  SCAPE_RETURN_IF_ERROR(Run(ag));
  std::vector<bootstrap::PeerEntry> table(P);
  for (size_t r = 0; r < P; ++r) {
    table[r].hostHash = peers_[r].hostHash;
    table[r].pid = peers_[r].pid;
    table[r].blob.assign(
        all.begin() + static_cast<ptrdiff_t>(r * maxLen),
        all.begin() + static_cast<ptrdiff_t>(r * maxLen + static_cast<size_t>(lens[r])));
  }
  SCAPE_RETURN_IF_ERROR(c->Connect(table));
  *out = std::move(c);
  return Status::Ok();
}

Comm::~Comm() {
  for (auto& p : queue_) p->op.reset();
  ctrlReq_.reset();
  if (tp_ && !error_.ok()) {
    // A dead process on this host may have left UCX state that its worker's destruction
    // asserts on (transport.h, LeakOnDestroy): look once more, and keep the worker if so.
    (void)WatchLocalPeers(/*force=*/true);
    for (const LocalPeer& p : localPeers_)
      if (tp_->PeerFailed(p.rank, nullptr)) {
        tp_->LeakOnDestroy();
        break;
      }
  }
  if (tp_) tp_->CloseAll(!error_.ok());
}

Status Comm::PostControlRecv() {
  const uint64_t tag = coll::MakeTag(coll::kKindControl, 0, 0, 0, 0);
  return tp_->Irecv(rank_, tag, coll::kKindMask, ctrlBuf_.data(), ctrlBuf_.size(), &ctrlReq_);
}

Status Comm::CheckControl() {
  if (!ctrlReq_) return Status::Ok();
  bool done = false;
  transport::RecvInfo info;
  Status st = tp_->Test(ctrlReq_.get(), &done, &info);
  if (!done && st.ok()) return Status::Ok();
  ctrlReq_.reset();
  if (!st.ok()) return st.Prepend("control channel");
  const int src = static_cast<int>((info.senderTag >> 42) & ((1u << coll::kSrcBits) - 1));
  Notice n;
  std::memcpy(&n, ctrlBuf_.data(), sizeof(n));
  if (info.length != sizeof(Notice) || n.magic != kNoticeMagic || n.rank != src || src >= nranks_ ||
      n.len > kNoticeMsgBytes || n.code <= 0 || n.code >= scapeNumResults)
    return RemoteError(
        StrFormat("rank %d sent a malformed control message (%zu bytes)", src, info.length));
  std::string msg(n.msg, n.len);
  Status remote = RemoteError(StrFormat("rank %d aborted the communicator: %s", src, msg.c_str()));
  error_ = remote;  // set first, so that Fail does not echo the notice back to everyone
  return remote;
}

Status Comm::Submit(const coll::CollArgs& args, std::shared_ptr<PendingOp>* out,
                    std::function<void()> onDone) {
  if (!error_.ok()) return error_;
  auto p = std::make_shared<PendingOp>();
  p->onDone = std::move(onDone);
  p->args = args;
  p->seq = nextSeq_++;
  p->op = coll::MakeOp(args, rank_, nranks_, tuning_);
  if (!p->op) return InternalError("no algorithm for this collective");
  if (nranks_ > 1 && args.counts.empty()) {
    const bool data =
        args.type == coll::CollType::kAllReduce || args.type == coll::CollType::kReduceScatter ||
        args.type == coll::CollType::kAllGather || args.type == coll::CollType::kBroadcast;
    // A count-0 collective still meets the other ranks (it is matched like any other, and a
    // rank that passed count 0 where the others passed 100 must hear of it); a broadcast ends
    // with the confirmation, so that its root does not return while the others disagree.
    if (data && args.count == 0)
      p->op = std::make_unique<ConfirmOp>(nullptr, rank_, nranks_);
    else if (args.type == coll::CollType::kBroadcast)
      p->op = std::make_unique<ConfirmOp>(std::move(p->op), rank_, nranks_);
  }
  queue_.push_back(p);
  *out = p;
  // Start at once when nothing is ahead of it, so that its first messages go out now.
  if (queue_.size() == 1) {
    bool adv = false;
    Status st = Poll(&adv);
    if (!st.ok()) return Fail(st);
  }
  return Status::Ok();
}

namespace {

// Whether process `pid` (on this host) has exited: gone, or a zombie (exited, not yet reaped by
// its parent).
bool ProcessGone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[256];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* rp = std::strrchr(buf, ')');
  return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

}  // namespace

Status Comm::WatchLocalPeers(bool force) {
  // A peer that sent its last message and exited cleanly is not a failure while that message
  // is still on its way (in a socket or a shared-memory FIFO): an exited process is declared
  // failed only after it has been seen gone for kExitGraceNs, during which this rank keeps
  // progressing the transport and so receives what the peer sent before it exited. A peer that
  // aborted sent a notice before it exited, possibly behind data this rank has not read yet:
  // when a peer is first seen gone, the transport is drained for up to kNoticeWaitMs so that
  // the notice is read before an operation can complete on the data in front of it. What an
  // exited peer sent is already in this rank's receive path (eager data in the shared-memory
  // FIFO or the socket; a rendezvous send completes only once the receiver has the data), so
  // the drain and the grace only need to outlast this rank's own progress loop, not the wire:
  // 100 ms keeps a dead peer's report on every survivor within about 200 ms (issue 33 item 4;
  // perf/stress/peer_death.sh).
  constexpr int64_t kExitGraceNs = 100 * 1000000LL;
  constexpr int kNoticeWaitMs = 50;
  const int64_t now = NowNs();
  if (!force && now - lastLivenessCheckNs_ < 50 * 1000000LL) return Status::Ok();
  lastLivenessCheckNs_ = now;
  for (LocalPeer& p : localPeers_) {
    if (p.pid <= 0 || tp_->PeerFailed(p.rank, nullptr)) continue;
    const bool dead = ProcessGone(p.pid);
    if (!dead) {
      p.exitedSinceNs = 0;
      continue;
    }
    if (p.exitedSinceNs == 0 && !force) {
      p.exitedSinceNs = now;
      Deadline notice = Deadline::AfterMs(kNoticeWaitMs);
      while (error_.ok() && ctrlReq_ && !notice.Expired()) {
        tp_->Progress();
        SCAPE_RETURN_IF_ERROR(CheckControl());
      }
    }
    if (force || now - p.exitedSinceNs >= kExitGraceNs) {
      if (p.exitedSinceNs != 0) deadPeerDrained_ = true;
      tp_->MarkPeerFailed(p.rank, StrFormat("its process (pid %d on this host) has exited",
                                            static_cast<int>(p.pid)));
    }
  }
  return Status::Ok();
}

Status Comm::Poll(bool* advanced) {
  if (AbortRequested())
    return InvalidUsage(
        StrFormat("rank %d: the communicator was aborted (scapeCommAbort was "
                  "called while this operation was in progress)",
                  rank_));
  tp_->Progress();
  SCAPE_RETURN_IF_ERROR(WatchLocalPeers());
  SCAPE_RETURN_IF_ERROR(CheckControl());
  const int64_t now = NowNs();
  if (!queue_.empty() && queue_.front()->started && now - lastAdvanceNs_ > kProbeIdleNs &&
      now - lastProbeNs_ > kProbeIdleNs) {
    lastProbeNs_ = now;
    Status m = ProbeMismatch(*queue_.front());
    if (!m.ok()) return m;
  }
  struct AdvanceStamp {
    bool* adv;
    int64_t* stamp;
    ~AdvanceStamp() {
      if (*adv) *stamp = NowNs();
    }
  } stamp{advanced, &lastAdvanceNs_};
  while (!queue_.empty()) {
    PendingOp* head = queue_.front().get();
    coll::Ctx ctx(tp_.get(), rank_, nranks_, head->seq, coll::Signature(head->args), tuning_,
                  &scratch_);
    if (!head->started) {
      head->started = true;
      *advanced = true;
      Status st = head->op->Start(ctx);
      if (!st.ok())
        return st.Prepend(StrFormat("%s #%u", coll::CollName(head->args.type), head->seq));
    }
    bool done = false;
    Status st = head->op->Progress(ctx, &done, advanced);
    if (!st.ok())
      return st.Prepend(StrFormat("%s #%u", coll::CollName(head->args.type), head->seq));
    if (!done) break;
    if (head->onDone) {
      head->onDone();
      head->onDone = nullptr;  // releases what it held (buffers, mask positions)
    }
    head->done = true;
    head->op.reset();
    queue_.pop_front();
    *advanced = true;
  }
  return Status::Ok();
}

// The head operation has waited a while: a peer that runs a different collective (other
// count, root, datatype or operation) under the same sequence number may have sent messages
// that match none of this rank's receives. Every message of one operation from one peer carries
// that peer's signature, so the first such message from each peer tells whether it agrees.
Status Comm::ProbeMismatch(const PendingOp& head) {
  const uint32_t sig = coll::Signature(head.args);
  const uint64_t srcMask = ((uint64_t{1} << coll::kSrcBits) - 1) << 42;
  const uint64_t seqMask = uint64_t{0x3ff} << 16;
  for (int q = 0; q < nranks_; ++q) {
    if (q == rank_) continue;
    uint64_t tag = 0;
    const uint64_t want = coll::MakeTag(coll::kKindData, q, 0, head.seq, 0);
    if (!tp_->Probe(want, coll::kKindMask | srcMask | seqMask, &tag)) continue;
    if (coll::TagSig(tag) != (sig & 0xffffu))
      return InvalidUsage(
          StrFormat("rank %d is in a different collective call than this rank "
                    "(operation, count, datatype, op or root differ; its %s #%u "
                    "carries signature %04x, this rank's %04x)",
                    q, coll::CollName(head.args.type), head.seq, coll::TagSig(tag), sig & 0xffffu));
  }
  return Status::Ok();
}

Status Comm::Test(PendingOp* op, bool* done) {
  if (!op->done && error_.ok()) {
    bool adv = false;
    Status st = Poll(&adv);
    if (!st.ok()) (void)Fail(st);
  }
  *done = op->done;
  return op->done ? op->result : Status::Ok();
}

Status Comm::Wait(PendingOp* op) {
  int64_t last = NowNs();
  int idle = 0;
  const int64_t limit = static_cast<int64_t>(cfg_.timeoutMs) * 1000000;
  while (!op->done) {
    if (!error_.ok()) return error_;
    bool adv = false;
    Status st = Poll(&adv);
    if (!st.ok()) return Fail(st);
    if (op->done) break;
    if (adv) {
      last = NowNs();
      idle = 0;
      continue;
    }
    if (NowNs() - last > limit) {
      const PendingOp* head = queue_.front().get();
      return Fail(
          TimeoutError(StrFormat("%s #%u made no progress for %d ms (a peer is dead, "
                                 "stuck, or not calling the same collective)",
                                 coll::CollName(head->args.type), head->seq, cfg_.timeoutMs)));
    }
    Backoff(++idle);
  }
  return op->result;
}

void Comm::Backoff(int idle) {
  switch (mode_) {
    case scapeProgressSpin:
      return;
    case scapeProgressBlocking:
      if (idle > 16 && tp_->WaitForEvent(20)) return;
      [[fallthrough]];
    default:
      if (idle < 32) return;
      if (idle < 2000) {
        sched_yield();
        return;
      }
      struct timespec ts = {0, 20000};
      nanosleep(&ts, nullptr);
  }
}

Status Comm::Fail(Status st) {
  if (error_.ok() && st.code() == scapeRemoteError && ctrlReq_ && !deadPeerDrained_) {
    // A peer's connection failed. If it failed because the peer aborted, its notice is
    // usually right behind: give it a moment, so every rank reports the root cause. (Not when
    // the process check found the peer gone: its notice had that chance there. A same-host
    // peer whose process is gone already sent all it will: its notice, if any, is in this
    // rank's receive path, and a short drain reads it.)
    bool localGone = false;
    for (const LocalPeer& p : localPeers_)
      localGone = localGone || (p.pid > 0 && ProcessGone(p.pid));
    Deadline grace = Deadline::AfterMs(localGone ? 50 : 200);
    while (error_.ok() && ctrlReq_ && !grace.Expired()) {
      tp_->Progress();
      (void)CheckControl();
    }
  }
  const bool fromPeer = !error_.ok();  // CheckControl recorded a peer's abort
  if (!fromPeer) error_ = st;
  SCAPE_WARN("rank %d: %s", rank_, error_.message().c_str());
  if (!fromPeer) Abort(error_.message());
  for (auto& p : queue_) {
    p->done = true;
    p->result = error_;
    p->op.reset();
  }
  queue_.clear();
  ctrlReq_.reset();
  if (tp_) tp_->CloseAll(true);
  return error_;
}

void Comm::Abort(const std::string& why) {
  if (!tp_ || closed_) return;
  closed_ = true;
  Notice n;
  std::memset(&n, 0, sizeof(n));
  n.magic = kNoticeMagic;
  n.rank = rank_;
  n.code = error_.ok() ? scapeRemoteError : error_.code();
  n.len = static_cast<uint32_t>(why.size() < kNoticeMsgBytes ? why.size() : kNoticeMsgBytes);
  std::memcpy(n.msg, why.data(), n.len);
  std::vector<std::unique_ptr<transport::Request>> sends;
  const uint64_t tag = coll::MakeTag(coll::kKindControl, rank_, 0, 0, 0);
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || tp_->PeerFailed(r, nullptr)) continue;
    std::unique_ptr<transport::Request> req;
    if (tp_->Isend(r, tag, &n, sizeof(n), &req).ok()) sends.push_back(std::move(req));
  }
  // Give the notices a moment to leave; never wait long for a peer that is gone.
  Deadline dl = Deadline::AfterMs(cfg_.timeoutMs < 1000 ? cfg_.timeoutMs : 1000);
  size_t left = sends.size();
  while (left > 0 && !dl.Expired()) {
    tp_->Progress();
    left = 0;
    for (auto& s : sends) {
      if (!s) continue;
      bool done = false;
      Status st = tp_->Test(s.get(), &done);
      if (done)
        s.reset();
      else
        ++left;
    }
  }
  tp_->CloseAll(true);
  for (auto& s : sends) s.reset();
  if (error_.ok()) error_ = InvalidUsage("the communicator was aborted by this rank");
}

}  // namespace scape
