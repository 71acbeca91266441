// UCX implementation of transport::Transport over the UCP tag API. UCX headers appear only here,
// in the rest of transport/ucx/, and in the NCCL plugin's engine (plugin/nccl/ucx_engine.cc).
#include <poll.h>

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/log.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_context.h"
#include "transport/ucx/ucx_status.h"

namespace scape {
namespace transport {
namespace {

// Upper bound on a worker address we accept from the network.
constexpr size_t kMaxAddressBytes = 64 * 1024;

class UcxRequest final : public Request {
 public:
  UcxRequest(int peer, bool isRecv, void* ucxReq, ucp_worker_h worker)
      : Request(peer, isRecv), req_(ucxReq), worker_(worker) {}
  ~UcxRequest() override {
    if (req_) {
      // An incomplete receive is cancelled; UCX releases the request when it completes.
      if (isRecv() && ucp_request_check_status(req_) == UCS_INPROGRESS)
        ucp_request_cancel(worker_, req_);
      ucp_request_free(req_);
    }
  }
  void* req_;  // nullptr once complete (or completed immediately)
  ucp_worker_h worker_;
  bool done_ = false;
  ucs_status_t status_ = UCS_OK;
  ucp_tag_recv_info_t info_{};
};

class UcxTransport final : public Transport {
 public:
  ~UcxTransport() override {
    CloseAll(/*force=*/true);
    if (address_) ucp_worker_release_address(worker_, address_);
    if (leak_) {
      // Destroying a worker whose shared-memory (CMA) lanes still hold a dead peer's pending
      // operations trips an assertion inside UCX 1.13 (ucs_arbiter_group_is_empty): keep it.
      SCAPE_INFO(
          "rank %d: a peer on this host died mid-transfer; leaving its UCX worker in "
          "place instead of destroying it",
          opts_.rank);
      return;
    }
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
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
    UcpContextOptions co;
    co.settings = {{"NET_DEVICES", opts.netDevices},
                   {"TLS", opts.tls},
                   {"KEEPALIVE_INTERVAL", StrFormat("%dms", ka)}};
    co.wakeup = opts.wakeup;
    SCAPE_RETURN_IF_ERROR(CreateUcpContext(co, &context_, &deviceMemory_));
    ucs_status_t s;

    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return UcxError("ucp_worker_create", s);

    size_t len = 0;
    s = ucp_worker_get_address(worker_, &address_, &len);
    if (s != UCS_OK) return UcxError("ucp_worker_get_address", s);
    localAddress_.assign(reinterpret_cast<uint8_t*>(address_),
                         reinterpret_cast<uint8_t*>(address_) + len);
    if (opts.wakeup) {
      if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
    }
    return Status::Ok();
  }

  const std::vector<uint8_t>& LocalAddress() const override { return localAddress_; }

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
    ucp_ep_params_t ep;
    std::memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(blob);
    // UCX 1.13's shared-memory transports cannot report a peer failure, so an endpoint that
    // asks for failure reports never uses them. On one host we take shared memory and let
    // the communicator watch the peer's process instead.
    // Only where shared memory can be used at all (not under UCX_TLS=tcp, say): over TCP an
    // endpoint without failure reports lets UCX 1.13 abort the survivor of a peer's death.
    const char* envTls = std::getenv("UCX_TLS");
    const std::string tls = !opts_.tls.empty() ? opts_.tls : (envTls ? envTls : "");
    const bool noReports = sameHost && SharedMemoryPossible(tls);
    ep.err_mode = noReports ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxTransport::OnEpError;
    ep.err_handler.arg = &p;
    ucs_status_t s = ucp_ep_create(worker_, &ep, &p.ep);
    if (s != UCS_OK) {
      p.ep = nullptr;
      return UcxError(StrFormat("connect to rank %d", peer), s);
    }
    return Status::Ok();
  }

  Status Isend(int peer, uint64_t tag, const void* buf, size_t len,
               std::unique_ptr<Request>* req) override {
    Peer& p = peers_[static_cast<size_t>(peer)];
    if (p.failed.load()) return RemoteError(StrFormat("rank %d: %s", peer, p.why.c_str()));
    if (!p.ep) return InternalError(StrFormat("no endpoint to rank %d", peer));
    ucp_request_param_t rp;
    std::memset(&rp, 0, sizeof(rp));
    ucs_status_ptr_t r = ucp_tag_send_nbx(p.ep, buf, len, tag, &rp);
    if (UCS_PTR_IS_ERR(r)) return UcxError(StrFormat("send to rank %d", peer), UCS_PTR_STATUS(r));
    auto ur = std::make_unique<UcxRequest>(peer, false, r, worker_);
    if (r == nullptr) ur->done_ = true;
    *req = std::move(ur);
    return Status::Ok();
  }

  Status Irecv(int peer, uint64_t tag, uint64_t tagMask, void* buf, size_t len,
               std::unique_ptr<Request>* req) override {
    auto ur = std::make_unique<UcxRequest>(peer, true, nullptr, worker_);
    ucp_request_param_t rp;
    std::memset(&rp, 0, sizeof(rp));
    // UCX 1.13 does not report the sender tag of a receive that completes at once, so always
    // ask for a request and read the tag from it.
    rp.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_, buf, len, tag, tagMask, &rp);
    if (UCS_PTR_IS_ERR(r))
      return UcxError(StrFormat("receive from rank %d", peer), UCS_PTR_STATUS(r));
    ur->req_ = r;
    if (r == nullptr) return InternalError("UCX completed a receive without a request");
    *req = std::move(ur);
    return Status::Ok();
  }

  Status Test(Request* base, bool* done, RecvInfo* info) override {
    auto* r = static_cast<UcxRequest*>(base);
    if (!r->done_) {
      ucs_status_t s = r->isRecv() ? ucp_tag_recv_request_test(r->req_, &r->info_)
                                   : ucp_request_check_status(r->req_);
      if (s == UCS_INPROGRESS) {
        *done = false;
        return Status::Ok();
      }
      r->done_ = true;
      r->status_ = s;
      ucp_request_free(r->req_);
      r->req_ = nullptr;
    }
    *done = true;
    if (info) {
      info->senderTag = r->info_.sender_tag;
      info->length = r->info_.length;
    }
    if (r->status_ != UCS_OK) {
      const Peer& p = peers_[static_cast<size_t>(r->peer())];
      if (p.failed.load())
        return RemoteError(StrFormat("rank %d failed: %s", r->peer(), p.why.c_str()));
      return UcxError(StrFormat("%s rank %d", r->isRecv() ? "receive from" : "send to", r->peer()),
                      r->status_);
    }
    return Status::Ok();
  }

  bool Progress() override { return ucp_worker_progress(worker_) != 0; }

  bool Probe(uint64_t wantedTag, uint64_t tagMask, uint64_t* senderTag) override {
    ucp_tag_recv_info_t info;
    std::memset(&info, 0, sizeof(info));
    ucp_tag_message_h m = ucp_tag_probe_nb(worker_, wantedTag, tagMask, /*remove=*/0, &info);
    if (!m) return false;
    *senderTag = info.sender_tag;
    return true;
  }

  bool WaitForEvent(int timeoutMs) override {
    if (efd_ < 0) return false;
    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) return true;  // events pending: go progress them
    if (s != UCS_OK) return false;
    struct pollfd pfd = {efd_, POLLIN, 0};
    (void)poll(&pfd, 1, timeoutMs);
    return true;
  }

  bool PeerFailed(int peer, std::string* why) const override {
    const Peer& p = peers_[static_cast<size_t>(peer)];
    if (!p.failed.load()) return false;
    if (why) *why = p.why;
    return true;
  }

  void CloseAll(bool force) override {
    if (!worker_) return;
    std::vector<void*> pending;
    for (Peer& p : peers_) {
      if (!p.ep) continue;
      ucp_request_param_t rp;
      std::memset(&rp, 0, sizeof(rp));
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = (force || p.failed.load()) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &rp);
      if (UCS_PTR_IS_PTR(r)) pending.push_back(r);
      p.ep = nullptr;
    }
    // Bounded: a flush toward a peer that is gone must not hang us.
    Deadline dl = Deadline::AfterMs(force ? 2000 : opts_.timeoutMs);
    for (void* r : pending) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && !dl.Expired())
        ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
  }

 private:
  struct Peer {
    UcxTransport* owner = nullptr;
    int rank = -1;
    ucp_ep_h ep = nullptr;
    std::atomic<bool> failed{false};
    std::string why;
    Peer() = default;
    Peer(Peer&& o) noexcept : owner(o.owner), rank(o.rank), ep(o.ep), why(o.why) {}
  };

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    if (!p->failed.load()) {
      p->why = std::string("connection failed: ") + ucs_status_string(status);
      p->failed.store(true);
      SCAPE_INFO("rank %d: connection to rank %d failed: %s", p->owner->opts_.rank, p->rank,
                 ucs_status_string(status));
    }
    // UCX requires the failed endpoint to be closed (force) by the user.
    if (p->ep == ep) {
      ucp_request_param_t rp;
      std::memset(&rp, 0, sizeof(rp));
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
      if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
      p->ep = nullptr;
    }
  }

  TransportOptions opts_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* address_ = nullptr;
  std::vector<uint8_t> localAddress_;
  std::vector<Peer> peers_;
  int efd_ = -1;
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
