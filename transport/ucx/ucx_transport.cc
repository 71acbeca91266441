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

class UcxRequest final : public Request {
 public:
  UcxRequest(int peer, bool isRecv, ucx::Req ucxReq, ucx::Worker* worker)
      : Request(peer, isRecv), req_(ucxReq), worker_(worker) {}
  ~UcxRequest() override {
    if (req_) {
      // An incomplete receive is cancelled; UCX releases the request when it completes.
      if (isRecv() && ucx::Worker::Check(req_) == ucx::kUcsInProgress) worker_->Cancel(req_);
      ucx::Worker::Free(req_);
    }
  }
  ucx::Req req_;  // nullptr once complete (or completed immediately)
  ucx::Worker* worker_;
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
    auto ur = std::make_unique<UcxRequest>(peer, false, r, worker_.get());
    if (r == nullptr) ur->done_ = true;
    *req = std::move(ur);
    return Status::Ok();
  }

  Status Irecv(int peer, uint64_t tag, uint64_t tagMask, void* buf, size_t len,
               std::unique_ptr<Request>* req) override {
    auto ur = std::make_unique<UcxRequest>(peer, true, nullptr, worker_.get());
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

  bool Progress() override { return worker_->Progress(); }

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
      while (ucx::Worker::Check(r) == ucx::kUcsInProgress && !dl.Expired()) worker_->Progress();
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
  bool deviceMemory_ = false;  // the UCX context can move CUDA memory
};

}  // namespace

std::unique_ptr<Transport> CreateUcxTransport(const TransportOptions& opts, Status* st) {
  auto t = std::make_unique<UcxTransport>();
  *st = t->Init(opts);
  if (!st->ok()) return nullptr;
  return t;
}

}  // namespace transport
}  // namespace scape
