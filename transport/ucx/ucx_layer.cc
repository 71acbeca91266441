// The shared UCX layer (see ucx_layer.h): the only file besides ucx_transport.cc that calls UCX.
#include "transport/ucx/ucx_layer.h"

#include <poll.h>

#include <ucp/api/ucp.h>

#include <cstring>

#include "base/clock.h"
#include "base/param.h"
#include "transport/ucx/ucx_status.h"

namespace scape {
namespace transport {
namespace ucx {

static_assert(kUcsOk == UCS_OK && kUcsInProgress == UCS_INPROGRESS, "UCX status codes");

namespace {

ucp_worker_h W(void* h) { return static_cast<ucp_worker_h>(h); }
ucp_ep_h E(Ep ep) { return reinterpret_cast<ucp_ep_h>(ep); }

void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* f = static_cast<EpFailure*>(arg);
  f->code.store(status);
  if (f->onFail) f->onFail(f, reinterpret_cast<Ep>(ep), status);
}

ucp_request_param_t Param(Mem mem) {
  ucp_request_param_t rp;
  std::memset(&rp, 0, sizeof(rp));
  if (mem != Mem::kAny) {
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    rp.memory_type = mem == Mem::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  }
  return rp;
}

}  // namespace

const char* CodeText(UcsCode code) { return ucs_status_string(static_cast<ucs_status_t>(code)); }

Status CodeError(const std::string& what, UcsCode code) {
  return UcxError(what, static_cast<ucs_status_t>(code));
}

bool IsTruncated(UcsCode code) { return code == UCS_ERR_MESSAGE_TRUNCATED; }

const char* Version() { return ucp_get_version_string(); }

std::string EffectiveTls(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = ParamExternal("UCX_TLS");
  return env ? env : "";
}

bool SharedMemoryPossible(const std::string& tls) {
  if (tls.empty() || tls == "all") return true;
  auto has = [&](const char* t) {
    const std::string s = "," + (tls[0] == '^' ? tls.substr(1) : tls) + ",";
    return s.find(std::string(",") + t + ",") != std::string::npos;
  };
  if (tls[0] == '^') return !has("sm") && !has("shm");
  return has("sm") || has("shm") || has("posix") || has("sysv") || has("xpmem") || has("all");
}

bool WantFailureReports(bool sameHost, const std::string& configuredTls) {
  return !(sameHost && SharedMemoryPossible(EffectiveTls(configuredTls)));
}

// ---- context
// ---------------------------------------------------------------------------------------

Status Context::Create(const ContextOptions& opts, std::shared_ptr<Context>* out) {
  // Creating a context fails only for local reasons (no device, bad settings, no memory), so
  // every failure here is a system error; peer failures are mapped where they happen.
  auto err = [](const std::string& what, ucs_status_t s) {
    return SystemError(what + ": " + ucs_status_string(s));
  };
  ucp_config_t* raw = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw);
  if (s != UCS_OK) return err("ucp_config_read", s);
  std::unique_ptr<ucp_config_t, void (*)(ucp_config_t*)> config(raw, ucp_config_release);
  for (const auto& kv : opts.settings) {
    if (kv.second.empty()) continue;
    ucs_status_t ms = ucp_config_modify(config.get(), kv.first.c_str(), kv.second.c_str());
    if (ms != UCS_OK)
      return err(std::string(ms == UCS_ERR_NO_ELEM ? "unknown UCX setting " : "bad UCX setting ") +
                     kv.first + "=" + kv.second,
                 ms);
  }
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | (opts.wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = opts.sharedByThreads ? 1 : 0;
  if (opts.name) {
    params.field_mask |= UCP_PARAM_FIELD_NAME;
    params.name = opts.name;
  }
  ucp_context_h ctx = nullptr;
  s = ucp_init(&params, config.get(), &ctx);
  if (s != UCS_OK) return err("ucp_init", s);
  std::shared_ptr<Context> c(new Context());
  c->h_ = ctx;
  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx, &attr) == UCS_OK)
    c->cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  *out = std::move(c);
  return Status::Ok();
}

Context::~Context() {
  if (h_) ucp_cleanup(static_cast<ucp_context_h>(h_));
}

// ---- worker
// ------------------------------------------------------------------------------------------

Status Worker::Create(std::shared_ptr<Context> ctx, Threads threads, bool eventFd,
                      std::unique_ptr<Worker>* out) {
  std::unique_ptr<Worker> w(new Worker());
  w->ctx_ = std::move(ctx);
  ucp_worker_params_t wp;
  std::memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode =
      threads == Threads::kSingle ? UCS_THREAD_MODE_SINGLE : UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h h = nullptr;
  ucs_status_t s = ucp_worker_create(static_cast<ucp_context_h>(w->ctx_->raw()), &wp, &h);
  if (s != UCS_OK) return UcxError("ucp_worker_create", s);
  w->h_ = h;
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  s = ucp_worker_get_address(h, &addr, &len);
  if (s != UCS_OK) return UcxError("ucp_worker_get_address", s);
  w->address_.assign(reinterpret_cast<uint8_t*>(addr), reinterpret_cast<uint8_t*>(addr) + len);
  ucp_worker_release_address(h, addr);
  if (eventFd) {
    if (ucp_worker_get_efd(h, &w->efd_) != UCS_OK) w->efd_ = -1;
  }
  *out = std::move(w);
  return Status::Ok();
}

Worker::~Worker() {
  if (leak_) {
    new std::shared_ptr<Context>(std::move(ctx_));  // never released: UCX keeps using it
    return;
  }
  if (h_) ucp_worker_destroy(W(h_));
}

bool Worker::Progress() { return ucp_worker_progress(W(h_)) != 0; }

bool Worker::WaitForEvent(int timeoutMs) {
  if (efd_ < 0) return false;
  ucs_status_t s = ucp_worker_arm(W(h_));
  if (s == UCS_ERR_BUSY) return true;  // events pending: go progress them
  if (s != UCS_OK) return false;
  struct pollfd pfd = {efd_, POLLIN, 0};
  (void)poll(&pfd, 1, timeoutMs);
  return true;
}

bool Worker::Probe(uint64_t wantedTag, uint64_t tagMask, uint64_t* senderTag) {
  ucp_tag_recv_info_t info;
  std::memset(&info, 0, sizeof(info));
  ucp_tag_message_h m = ucp_tag_probe_nb(W(h_), wantedTag, tagMask, /*remove=*/0, &info);
  if (!m) return false;
  *senderTag = info.sender_tag;
  return true;
}

UcsCode Worker::Connect(const uint8_t* addr, size_t len, bool failureReports, EpFailure* failure,
                        Ep* out) {
  (void)len;  // the address carries its own length; callers bound it
  ucp_ep_params_t ep;
  std::memset(&ep, 0, sizeof(ep));
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(addr);
  ep.err_mode = failureReports ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (failure) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = &OnEpError;
    ep.err_handler.arg = failure;
  }
  ucp_ep_h h = nullptr;
  ucs_status_t s = ucp_ep_create(W(h_), &ep, &h);
  *out = s == UCS_OK ? reinterpret_cast<Ep>(h) : nullptr;
  return s;
}

Req Worker::CloseEndpoint(Ep ep, bool force) {
  ucp_request_param_t rp;
  std::memset(&rp, 0, sizeof(rp));
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(E(ep), &rp);
  return UCS_PTR_IS_PTR(r) ? r : nullptr;
}

UcsCode Worker::Send(Ep ep, const void* buf, size_t len, uint64_t tag, Mem mem, bool sync,
                     Req* req) {
  *req = nullptr;
  ucp_request_param_t rp = Param(mem);
  ucs_status_ptr_t r = sync ? ucp_tag_send_sync_nbx(E(ep), buf, len, tag, &rp)
                            : ucp_tag_send_nbx(E(ep), buf, len, tag, &rp);
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  *req = r;
  return kUcsOk;
}

UcsCode Worker::Recv(void* buf, size_t len, uint64_t wantedTag, uint64_t tagMask, Mem mem,
                     Req* req) {
  *req = nullptr;
  ucp_request_param_t rp = Param(mem);
  rp.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  ucs_status_ptr_t r = ucp_tag_recv_nbx(W(h_), buf, len, wantedTag, tagMask, &rp);
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  *req = r;
  return kUcsOk;
}

UcsCode Worker::Check(Req r) { return ucp_request_check_status(r); }

UcsCode Worker::CheckRecv(Req r, size_t* length, uint64_t* senderTag) {
  ucp_tag_recv_info_t info;
  std::memset(&info, 0, sizeof(info));
  ucs_status_t s = ucp_tag_recv_request_test(r, &info);
  if (s != UCS_INPROGRESS) {
    if (length) *length = info.length;
    if (senderTag) *senderTag = info.sender_tag;
  }
  return s;
}

void Worker::Cancel(Req r) { ucp_request_cancel(W(h_), r); }

void Worker::Free(Req r) { ucp_request_free(r); }

bool Worker::Wait(Req r, int64_t deadlineNs) {
  while (ucp_request_check_status(r) == UCS_INPROGRESS) {
    if (NowNs() >= deadlineNs) return false;
    ucp_worker_progress(W(h_));
  }
  return true;
}

}  // namespace ucx
}  // namespace transport
}  // namespace scape
