// UCX implementation of transport::Transport over the shared UCX layer (ucx_layer.h): one
// worker, one endpoint per peer, the UCP tag API. UCX headers appear only in transport/ucx/.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/log.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_layer.h"

namespace scape {
namespace transport {
namespace {

// Upper bound on a worker address we accept from the network.
constexpr size_t kMaxAddressBytes = 64 * 1024;

// How long destroying an incomplete receive waits for UCX to give its buffer back.
constexpr int64_t kCancelWaitNs = 1000ll * 1000 * 1000;

class UcxTransport;

class UcxRequest final : public Request {
 public:
  UcxRequest(int peer, bool isRecv, ucx::Req ucxReq, UcxTransport* owner)
      : Request(peer, isRecv), req_(ucxReq), owner_(owner) {}
  ~UcxRequest() override;
  ucx::Req req_;  // nullptr once complete (or completed immediately)
  UcxTransport* owner_;
  bool done_ = false;
  ucx::UcsCode status_ = ucx::kUcsOk;
  size_t length_ = 0;
  uint64_t senderTag_ = 0;
};

class UcxTransport final : public Transport {
 public:
  ~UcxTransport() override {
    CloseAll(/*force=*/true);
    if (leak_ && worker_) {
      // Destroying a worker whose shared-memory (CMA) lanes still hold a dead peer's pending
      // operations trips an assertion inside UCX 1.13 (ucs_arbiter_group_is_empty): keep it.
      SCAPE_INFO(
          "rank %d: a peer on this host died mid-transfer; leaving its UCX worker in "
          "place instead of destroying it",
          opts_.rank);
      worker_->Leak();
    }
  }

  void LeakOnDestroy() override { leak_ = true; }

  // Destroys the UCX side of a receive that has not completed. UCX owns the receive's buffer
  // until the request completes, and cancelling does not stop a copy already under way (a
  // matched rendezvous: on one host, a shared-memory copy done in later progress calls): wait
  // for it, bounded, so that the caller may free the buffer. A receive still not complete then
  // can write into freed memory on any later progress: the worker is never progressed again,
  // and kept instead of destroyed.
  void EndReceive(ucx::Req r) {
    if (!abandoned_) {
      worker_->Cancel(r);
      if (!worker_->Wait(r, NowNs() + kCancelWaitNs)) {
        SCAPE_WARN(
            "rank %d: a cancelled receive did not end within %lld ms; this rank's UCX "
            "worker is no longer progressed",
            opts_.rank, static_cast<long long>(kCancelWaitNs / 1000000));
        abandoned_ = true;
        leak_ = true;
      }
    }
    ucx::Worker::Free(r);
  }
  bool DeviceMemory() const override { return deviceMemory_; }

  Status Init(const TransportOptions& opts) {
    opts_ = opts;
    peers_.resize(static_cast<size_t>(opts.nranks));
    // Detect dead peers on every transport within a fraction of the operation timeout.
    int ka = opts.timeoutMs / 4;
    if (ka < 200) ka = 200;
    if (ka > 5000) ka = 5000;
    ucx::ContextOptions co;
    co.settings = {{"NET_DEVICES", opts.netDevices},
                   {"TLS", opts.tls},
                   {"KEEPALIVE_INTERVAL", StrFormat("%dms", ka)}};
    co.wakeup = opts.wakeup;
    std::shared_ptr<ucx::Context> context;
    SCAPE_RETURN_IF_ERROR(ucx::Context::Create(co, &context));
    deviceMemory_ = context->CudaMemory();
    return ucx::Worker::Create(std::move(context), ucx::Worker::Threads::kSingle, opts.wakeup,
                               &worker_);
  }

  const std::vector<uint8_t>& LocalAddress() const override { return worker_->Address(); }

  void MarkPeerFailed(int peer, const std::string& why) override {
    Peer& p = peers_[static_cast<size_t>(peer)];
    if (p.failed.load()) return;
    p.why = why;
    p.failed.store(true);
  }

  Status Connect(int peer, const uint8_t* blob, size_t len, bool sameHost) override {
    if (peer < 0 || peer >= opts_.nranks) return InternalError(StrFormat("bad peer %d", peer));
    if (len == 0 || len > kMaxAddressBytes)
      return RemoteError(StrFormat("rank %d published a %zu-byte address (expected 1..%zu)", peer,
                                   len, kMaxAddressBytes));
    Peer& p = peers_[static_cast<size_t>(peer)];
    p.owner = this;
    p.rank = peer;
    // On one host we take shared memory where UCX may use it and let the communicator watch the
    // peer's process instead of UCX (the UCX 1.13 rule: ucx::WantFailureReports).
    const bool reports = ucx::WantFailureReports(sameHost, opts_.tls);
    ucx::UcsCode s = worker_->Connect(blob, len, reports, &p, &p.ep);
    if (s != ucx::kUcsOk) return ucx::CodeError(StrFormat("connect to rank %d", peer), s);
    return Status::Ok();
  }

  Status Isend(int peer, uint64_t tag, const void* buf, size_t len,
               std::unique_ptr<Request>* req) override {
    Peer& p = peers_[static_cast<size_t>(peer)];
    if (p.failed.load()) return RemoteError(StrFormat("rank %d: %s", peer, p.why.c_str()));
    if (!p.ep) return InternalError(StrFormat("no endpoint to rank %d", peer));
    ucx::Req r = nullptr;
    ucx::UcsCode s = worker_->Send(p.ep, buf, len, tag, ucx::Mem::kAny, /*sync=*/false, &r);
    if (s != ucx::kUcsOk) return ucx::CodeError(StrFormat("send to rank %d", peer), s);
    auto ur = std::make_unique<UcxRequest>(peer, false, r, this);
    if (r == nullptr) ur->done_ = true;
    *req = std::move(ur);
    return Status::Ok();
  }

  Status Irecv(int peer, uint64_t tag, uint64_t tagMask, void* buf, size_t len,
               std::unique_ptr<Request>* req) override {
    auto ur = std::make_unique<UcxRequest>(peer, true, nullptr, this);
    // Always a request (ucx::Worker::Recv): the sender tag is read from it.
    ucx::Req r = nullptr;
    ucx::UcsCode s = worker_->Recv(buf, len, tag, tagMask, ucx::Mem::kAny, &r);
    if (s != ucx::kUcsOk) return ucx::CodeError(StrFormat("receive from rank %d", peer), s);
    ur->req_ = r;
    if (r == nullptr) return InternalError("UCX completed a receive without a request");
    *req = std::move(ur);
    return Status::Ok();
  }

  Status Test(Request* base, bool* done, RecvInfo* info) override {
    auto* r = static_cast<UcxRequest*>(base);
    if (!r->done_) {
      ucx::UcsCode s = r->isRecv() ? ucx::Worker::CheckRecv(r->req_, &r->length_, &r->senderTag_)
                                   : ucx::Worker::Check(r->req_);
      if (s == ucx::kUcsInProgress) {
        *done = false;
        return Status::Ok();
      }
      r->done_ = true;
      r->status_ = s;
      ucx::Worker::Free(r->req_);
      r->req_ = nullptr;
    }
    *done = true;
    if (info) {
      info->senderTag = r->senderTag_;
      info->length = r->length_;
    }
    if (r->status_ != ucx::kUcsOk) {
      const Peer& p = peers_[static_cast<size_t>(r->peer())];
      if (p.failed.load())
        return RemoteError(StrFormat("rank %d failed: %s", r->peer(), p.why.c_str()));
      return ucx::CodeError(
          StrFormat("%s rank %d", r->isRecv() ? "receive from" : "send to", r->peer()), r->status_);
    }
    return Status::Ok();
  }

  bool Progress() override { return !abandoned_ && worker_->Progress(); }

  bool Probe(uint64_t wantedTag, uint64_t tagMask, uint64_t* senderTag) override {
    return worker_->Probe(wantedTag, tagMask, senderTag);
  }

  bool WaitForEvent(int timeoutMs) override { return worker_->WaitForEvent(timeoutMs); }

  bool PeerFailed(int peer, std::string* why) const override {
    const Peer& p = peers_[static_cast<size_t>(peer)];
    if (!p.failed.load()) return false;
    if (why) *why = p.why;
    return true;
  }

  void CloseAll(bool force) override {
    if (!worker_) return;
    std::vector<ucx::Req> pending;
    for (Peer& p : peers_) {
      if (!p.ep) continue;
      ucx::Req r = worker_->CloseEndpoint(p.ep, force || p.failed.load());
      if (r) pending.push_back(r);
      p.ep = nullptr;
    }
    // Bounded: a flush toward a peer that is gone must not hang us.
    Deadline dl = Deadline::AfterMs(force ? 2000 : opts_.timeoutMs);
    for (ucx::Req r : pending) {
      while (!abandoned_ && ucx::Worker::Check(r) == ucx::kUcsInProgress && !dl.Expired())
        worker_->Progress();
      ucx::Worker::Free(r);
    }
  }

 private:
  // A peer's endpoint; UCX reports its failure to the peer itself (ucx::EpFailure).
  struct Peer : ucx::EpFailure {
    UcxTransport* owner = nullptr;
    int rank = -1;
    ucx::Ep ep = nullptr;
    std::atomic<bool> failed{false};
    std::string why;
    Peer() { onFail = &UcxTransport::OnEpError; }
    Peer(Peer&& o) noexcept : owner(o.owner), rank(o.rank), ep(o.ep), why(o.why) {
      onFail = &UcxTransport::OnEpError;
    }
  };

  static void OnEpError(ucx::EpFailure* self, ucx::Ep ep, ucx::UcsCode status) {
    auto* p = static_cast<Peer*>(self);
    if (!p->failed.load()) {
      p->why = std::string("connection failed: ") + ucx::CodeText(status);
      p->failed.store(true);
      SCAPE_INFO("rank %d: connection to rank %d failed: %s", p->owner->opts_.rank, p->rank,
                 ucx::CodeText(status));
    }
    // UCX requires the failed endpoint to be closed (force) by the user.
    if (p->ep == ep) {
      ucx::Req r = p->owner->worker_->CloseEndpoint(ep, /*force=*/true);
      if (r) ucx::Worker::Free(r);
      p->ep = nullptr;
    }
  }

  TransportOptions opts_;
  std::vector<Peer> peers_;  // UCX's failure reports target them: destroyed after the worker
  std::unique_ptr<ucx::Worker> worker_;  // owns the UCP context
  bool leak_ = false;
  bool abandoned_ = false;     // a receive outlived its buffer: never progress the worker again
  bool deviceMemory_ = false;  // the UCX context can move CUDA memory
};

UcxRequest::~UcxRequest() {
  if (!req_) return;
  if (isRecv() && ucx::Worker::Check(req_) == ucx::kUcsInProgress)
    owner_->EndReceive(req_);
  else
    ucx::Worker::Free(req_);  // a send: UCX releases it when it completes
}

}  // namespace

std::unique_ptr<Transport> CreateUcxTransport(const TransportOptions& opts, Status* st) {
  auto t = std::make_unique<UcxTransport>();
  *st = t->Init(opts);
  if (!st->ok()) return nullptr;
  return t;
}

}  // namespace transport
}  // namespace scape
