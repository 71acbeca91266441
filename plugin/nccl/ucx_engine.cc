// UCX engine of the NCCL net plugin, its data half: UCP contexts and workers (through the shared
// UCX layer, transport/ucx/ucx_layer.h), memory handles, Isend / Irecv / Test, close, and the
// live-object registry. The connection model (listen / connect / accept) is in net_connect.cc;
// see ucx_engine.h for the objects and the protocol.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "plugin/nccl/engine_internal.h"
#include "plugin/nccl/ucx_engine.h"

namespace scape {
namespace ucxnet {

namespace {

constexpr int kCheckEvery = 64;
constexpr int64_t kCancelWaitNs = 1000ll * 1000 * 1000;

// ---- UCP contexts (one per device, shared by the process) and workers -------------------------

std::mutex g_ctxMu;
std::map<int, std::weak_ptr<ucx::Context>> g_ctxs;
Options g_opts;
bool g_optsSet = false;

Status GetUcpCtx(int dev, const DeviceRoute& route, std::shared_ptr<ucx::Context>* out) {
  std::lock_guard<std::mutex> lk(g_ctxMu);
  if (auto sp = g_ctxs[dev].lock()) {
    *out = sp;
    return Status::Ok();
  }
  ucx::ContextOptions co;
  co.settings.emplace_back("TLS", g_opts.tls);
  if (g_opts.setNetDevices) co.settings.emplace_back("NET_DEVICES", route.ucxNetDevices);
  if (route.rails > 1) co.settings.emplace_back("MAX_RNDV_RAILS", std::to_string(route.rails));
  co.sharedByThreads = true;  // workers of several NCCL proxy threads share it
  co.name = "scape-nccl-net";
  std::shared_ptr<ucx::Context> ctx;
  Status st = ucx::Context::Create(co, &ctx);
  if (!st.ok())
    return st.Prepend(StrFormat("UCP context for device %d (UCX_NET_DEVICES=%s)", dev,
                                route.ucxNetDevices.c_str()));
  g_ctxs[dev] = ctx;
  *out = std::move(ctx);
  return Status::Ok();
}

Status NewWorker(std::shared_ptr<ucx::Context> ctx, std::shared_ptr<Worker>* out) {
  auto w = std::make_shared<Worker>();
  // Serialised by Worker::mu.
  SCAPE_RETURN_IF_ERROR(
      ucx::Worker::Create(std::move(ctx), ucx::Worker::Threads::kSerialized, false, &w->ucx));
  const size_t len = w->ucx->Address().size();
  if (len == 0 || len > kMaxAddressBytes)
    return InternalError(StrFormat("UCX worker address of %zu bytes", len));
  *out = std::move(w);
  return Status::Ok();
}

// Frees the UCX side of every request still in flight on a comm (after cancelling or force
// closing). Called with the worker lock held.
void DrainRequests(Comm* c, bool cancelRecvs) {
  Worker* w = c->worker.get();
  int64_t deadline = NowNs() + kCancelWaitNs;
  for (Request& r : c->reqs) {
    if (r.magic != kReqMagic) continue;
    for (int i = 0; i < r.n; ++i) {
      if (!r.ucx[i]) continue;
      if (cancelRecvs && ucx::Worker::Check(r.ucx[i]) == ucx::kUcsInProgress)
        w->ucx->Cancel(r.ucx[i]);
    }
  }
  for (Request& r : c->reqs) {
    if (r.magic != kReqMagic) continue;
    for (int i = 0; i < r.n; ++i) {
      if (!r.ucx[i]) continue;
      WaitRequest(w, r.ucx[i], deadline);
      ucx::Worker::Free(r.ucx[i]);  // released by UCX when it completes, if it has not
      r.ucx[i] = nullptr;
    }
    c->Release(&r);
  }
}

}  // namespace

const std::string& ConfiguredTls() { return g_opts.tls; }

void Worker::Reap() {
  for (size_t i = 0; i < closing.size();) {
    if (ucx::Worker::Check(closing[i].req) != ucx::kUcsInProgress) {
      ucx::Worker::Free(closing[i].req);
      closing[i] = std::move(closing.back());
      closing.pop_back();
    } else {
      ++i;
    }
  }
}

Worker::~Worker() {
  if (!ucx) return;
  // Give unfinished closes a moment, then let the worker's destruction end them.
  int64_t deadline = NowNs() + 200 * 1000 * 1000;
  while (!closing.empty() && NowNs() < deadline) Progress();
  for (Closing& c : closing) ucx::Worker::Free(c.req);
  ucx.reset();
  closing.clear();  // after the destroy: no error handler can run any more
}

bool WaitRequest(Worker* w, ucx::Req req, int64_t deadlineNs) {
  while (ucx::Worker::Check(req) == ucx::kUcsInProgress) {
    if (NowNs() >= deadlineNs) return false;
    w->Progress();
  }
  return true;
}

// ---- objects ----------------------------------------------------------------------------------

Comm::Comm(uint64_t m, bool send, int nreq)
    : magic(m), isSend(send), reqs(static_cast<size_t>(nreq)) {
  freeList.reserve(static_cast<size_t>(nreq));
  for (int i = nreq - 1; i >= 0; --i) {
    reqs[static_cast<size_t>(i)].index = i;
    reqs[static_cast<size_t>(i)].comm = this;
    freeList.push_back(i);
    RegisterLive(&reqs[static_cast<size_t>(i)]);
  }
  RegisterLive(this);
}

Comm::~Comm() {
  UnregisterLive(this);
  for (Request& r : reqs) UnregisterLive(&r);
}

Request* Comm::Acquire() {
  if (freeList.empty()) return nullptr;
  Request* r = &reqs[static_cast<size_t>(freeList.back())];
  freeList.pop_back();
  r->magic = kReqMagic;
  r->postedNs = NowNs();
  for (int i = 0; i < kMaxRecvs; ++i) {
    r->ucx[i] = nullptr;
    r->subDone[i] = true;
    r->st[i] = ucx::kUcsOk;
    r->cap[i] = r->len[i] = 0;
  }
  ++inFlight;
  return r;
}

void Comm::Release(Request* r) {
  r->magic = kFreeReqMagic;
  freeList.push_back(r->index);
  --inFlight;
}

void Comm::CheckPeer(int64_t now) {
  if (goneNs != 0 || now < nextCheckNs) return;
  nextCheckNs = now + kLivenessCheckNs;
  char b;
  ssize_t n = ::recv(sock.fd(), &b, 1, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  goneNs = now;
  goneWhy = n == 0  ? "it closed the connection (comm closed or process exited)"
            : n > 0 ? "it sent unexpected bytes on the control connection"
                    : StrFormat("control connection error: %s", std::strerror(errno));
}

Status GetWorker(NetContext* ctx, int dev, const DeviceRoute& route, std::shared_ptr<Worker>* out) {
  std::lock_guard<std::mutex> lk(ctx->mu);
  auto it = ctx->workers.find(dev);
  if (it != ctx->workers.end()) {
    *out = it->second;
    return Status::Ok();
  }
  std::shared_ptr<ucx::Context> uctx;
  SCAPE_RETURN_IF_ERROR(GetUcpCtx(dev, route, &uctx));
  std::shared_ptr<Worker> w;
  SCAPE_RETURN_IF_ERROR(NewWorker(std::move(uctx), &w));
  ctx->workers[dev] = w;
  *out = std::move(w);
  return Status::Ok();
}

// ---- API --------------------------------------------------------------------------------------

const char* UcxVersion() { return ucx::Version(); }

Status NewNetContext(const Options& options, int dev0, const DeviceRoute& route0,
                     NetContext** out) {
  *out = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_ctxMu);
    if (!g_optsSet) {
      g_opts = options;
      g_optsSet = true;
    }
  }
  auto ctx = std::make_unique<NetContext>();
  ctx->timeoutMs = options.timeoutMs;
  ctx->graceMs = options.peerGraceMs;
  std::shared_ptr<Worker> w;
  SCAPE_RETURN_IF_ERROR(GetWorker(ctx.get(), dev0, route0, &w));
  *out = ctx.release();
  return Status::Ok();
}

void DeleteNetContext(NetContext* ctx) {
  if (!ctx) return;
  AbandonConnects(ctx);
  ctx->magic = kDeadMagic;
  delete ctx;
}

bool CudaSupported(const NetContext* ctx, int dev) {
  auto* c = const_cast<NetContext*>(ctx);
  std::lock_guard<std::mutex> lk(c->mu);
  auto it = c->workers.find(dev);
  return it != c->workers.end() && it->second->ucx->context().CudaMemory();
}

Status CloseSend(SendComm* sc) {
  std::shared_ptr<Worker> w = sc->worker;
  {
    std::lock_guard<std::mutex> lk(w->mu);
    sc->magic = kDeadMagic;
    bool failed = sc->eps->code.load() != ucx::kUcsOk || sc->goneNs != 0;
    // Flush what was sent; with requests still in flight (an abort) cancel them instead.
    bool force = sc->inFlight > 0 || failed;
    ucx::Req r = w->ucx->CloseEndpoint(sc->ep, force);
    sc->ep = nullptr;
    std::unique_ptr<ucx::EpFailure> eps(sc->eps);
    sc->eps = nullptr;
    if (r) {
      // A forced close ends locally; a flushing one may wait for the peer, which need not be
      // progressing now (it may be closing too): do not block on it, finish it later.
      int64_t bound = force ? 2000 : 5;
      if (WaitRequest(w.get(), r, NowNs() + bound * 1000000))
        ucx::Worker::Free(r);
      else
        w->closing.push_back(Closing{r, std::move(eps)});
    }
    DrainRequests(sc, /*cancelRecvs=*/false);
  }
  delete sc;
  return Status::Ok();
}

Status CloseRecv(RecvComm* rc) {
  std::shared_ptr<Worker> w = rc->worker;
  {
    std::lock_guard<std::mutex> lk(w->mu);
    rc->magic = kDeadMagic;
    DrainRequests(rc, /*cancelRecvs=*/true);
  }
  delete rc;
  return Status::Ok();
}

Status RegMr(void* comm, void* data, size_t size, MemType type, MemRegion** out) {
  *out = nullptr;
  Comm* c = static_cast<Comm*>(comm);
  if (type == MemType::kCuda && !c->worker->ucx->context().CudaMemory())
    return Unsupported(
        "CUDA memory: this UCX cannot move CUDA memory (the plugin does not "
        "advertise NCCL_PTR_CUDA)");
  auto mr = std::make_unique<MemRegion>();
  mr->owner = comm;
  mr->base = reinterpret_cast<uintptr_t>(data);
  mr->len = size;
  mr->type = type;
  *out = mr.release();
  return Status::Ok();
}

Status DeregMr(void* /*comm*/, MemRegion* mr) {
  mr->magic = kDeadMagic;
  delete mr;
  return Status::Ok();
}

Status Isend(SendComm* sc, const void* data, size_t size, int tag, const MemRegion* mr,
             Request** req) {
  *req = nullptr;
  Worker* w = sc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  int es = sc->eps->code.load();
  if (es != ucx::kUcsOk)
    return RemoteError(
        StrFormat("connection to %s failed: %s", sc->peer.c_str(), ucx::CodeText(es)));
  Request* r = sc->Acquire();
  if (!r) return Status::Ok();  // all slots busy: NCCL calls again later
  r->n = 1;
  r->cap[0] = size;
  const uint64_t utag = DataTag(sc->remoteId, tag);
  ucx::Req p = nullptr;
  ucx::UcsCode s =
      w->ucx->Send(sc->ep, data, size, utag, ToMem(mr ? mr->type : MemType::kHost), false, &p);
  if (s != ucx::kUcsOk) {
    sc->Release(r);
    return ucx::CodeError(StrFormat("send of %zu bytes to %s", size, sc->peer.c_str()), s);
  }
  if (p == nullptr) {
    r->subDone[0] = true;
    r->len[0] = size;
  } else {
    r->ucx[0] = p;
    r->subDone[0] = false;
  }
  *req = r;
  return Status::Ok();
}

Status Irecv(RecvComm* rc, int n, void* const* data, const size_t* sizes, const int* tags,
             MemRegion* const* mrs, Request** req) {
  *req = nullptr;
  Worker* w = rc->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  Request* r = rc->Acquire();
  if (!r) return Status::Ok();
  r->n = n;
  for (int i = 0; i < n; ++i) {
    // Always a request (ucx::Worker::Recv): the length is read from it.
    const uint64_t utag = DataTag(rc->id, tags[i]);
    ucx::Req p = nullptr;
    ucx::UcsCode s = w->ucx->Recv(data[i], sizes[i], utag, ~0ull,
                                  ToMem(mrs[i] ? mrs[i]->type : MemType::kHost), &p);
    r->cap[i] = sizes[i];
    if (s != ucx::kUcsOk || p == nullptr) {
      for (int j = 0; j < i; ++j) {
        w->ucx->Cancel(r->ucx[j]);
        WaitRequest(w, r->ucx[j], NowNs() + kCancelWaitNs);
        ucx::Worker::Free(r->ucx[j]);
        r->ucx[j] = nullptr;
      }
      rc->Release(r);
      if (s == ucx::kUcsOk) return InternalError("UCX completed a receive without a request");
      return ucx::CodeError(StrFormat("receive %d of %d (%zu bytes)", i, n, sizes[i]), s);
    }
    r->ucx[i] = p;
    r->subDone[i] = false;
  }
  *req = r;
  return Status::Ok();
}

Status Test(Request* r, bool* done, size_t* sizes, int* nOut) {
  *done = false;
  Comm* c = r->comm;
  Worker* w = c->worker.get();
  std::lock_guard<std::mutex> lk(w->mu);
  if (r->magic != kReqMagic) return InternalError("request is not in flight");
  w->Progress();
  bool all = true;
  for (int i = 0; i < r->n; ++i) {
    if (r->subDone[i]) continue;
    ucx::UcsCode s;
    if (c->isSend) {
      s = ucx::Worker::Check(r->ucx[i]);
      if (s != ucx::kUcsInProgress) r->len[i] = r->cap[i];
    } else {
      s = ucx::Worker::CheckRecv(r->ucx[i], &r->len[i], nullptr);
    }
    if (s == ucx::kUcsInProgress) {
      all = false;
      continue;
    }
    r->subDone[i] = true;
    r->st[i] = s;
    ucx::Worker::Free(r->ucx[i]);
    r->ucx[i] = nullptr;
  }
  if (all) {
    Status st;
    for (int i = 0; i < r->n && st.ok(); ++i) {
      if (r->st[i] == ucx::kUcsOk) continue;
      if (ucx::IsTruncated(r->st[i]))
        st =
            InternalError(StrFormat("receive %d of %d: the sender sent %zu bytes into a "
                                    "%zu-byte buffer",
                                    i, r->n, r->len[i], r->cap[i]));
      else
        st = ucx::CodeError(
            StrFormat("%s %d of %d (%zu bytes) %s %s", c->isSend ? "send" : "receive", i, r->n,
                      r->cap[i], c->isSend ? "to" : "from", c->peer.c_str()),
            r->st[i]);
    }
    if (!st.ok() && st.code() != scapeInternalError) {
      // A transfer failed: if the peer is gone, that is the reason (whatever UCX reported).
      c->nextCheckNs = 0;
      c->CheckPeer(NowNs());
      if (c->goneNs != 0)
        st = RemoteError(
            StrFormat("%s; the peer went away: %s", st.message().c_str(), c->goneWhy.c_str()));
    }
    if (sizes)
      for (int i = 0; i < r->n; ++i) sizes[i] = r->len[i];
    if (nOut) *nOut = r->n;
    c->Release(r);
    *done = true;
    return st;
  }
  if (c->isSend) {
    int es = static_cast<SendComm*>(c)->eps->code.load();
    if (es != ucx::kUcsOk)
      return RemoteError(
          StrFormat("connection to %s failed: %s", c->peer.c_str(), ucx::CodeText(es)));
  }
  // Look at the clock (and the setup connection) only every kCheckEvery incomplete tests:
  // NCCL polls test in a tight loop.
  if (++c->testsSinceCheck < kCheckEvery && c->goneNs == 0) return Status::Ok();
  c->testsSinceCheck = 0;
  int64_t now = NowNs();
  c->CheckPeer(now);
  if (c->goneNs != 0 &&
      now - std::max(c->goneNs, r->postedNs) > static_cast<int64_t>(c->graceMs) * 1000000)
    return RemoteError(StrFormat("%s pending for %lld ms after the peer (%s) went away: %s",
                                 c->isSend ? "send" : "receive",
                                 static_cast<long long>((now - r->postedNs) / 1000000),
                                 c->peer.c_str(), c->goneWhy.c_str()));
  return Status::Ok();
}

std::string CommInfo(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  if (c->isSend) {
    auto* sc = static_cast<SendComm*>(c);
    return StrFormat("to %s, %s", sc->peer.c_str(),
                     sc->sameHost ? "same host (UCX may use shared memory; failures seen through "
                                    "the setup connection)"
                                  : "other host (UCX reports peer failures)");
  }
  return "from " + c->peer;
}

int RequestsInFlight(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  std::lock_guard<std::mutex> lk(c->worker->mu);
  return c->inFlight;
}

namespace {
struct LiveSet {
  std::mutex mu;
  std::unordered_map<const void*, int> live;  // address -> registrations
};
LiveSet& Live() {
  static LiveSet* s = new LiveSet();  // never destroyed: objects may die during exit
  return *s;
}
}  // namespace

void RegisterLive(const void* p) {
  std::lock_guard<std::mutex> lk(Live().mu);
  ++Live().live[p];
}
void UnregisterLive(const void* p) {
  std::lock_guard<std::mutex> lk(Live().mu);
  auto it = Live().live.find(p);
  if (it != Live().live.end() && --it->second <= 0) Live().live.erase(it);
}
bool IsLive(const void* p) {
  if (!p) return false;
  std::lock_guard<std::mutex> lk(Live().mu);
  return Live().live.count(p) != 0;
}

NetContext* AsNetContext(void* p) { return AsLive<NetContext>(p, kCtxMagic); }
SendComm* AsSendComm(void* p) { return AsLive<SendComm>(p, kSendMagic); }
RecvComm* AsRecvComm(void* p) { return AsLive<RecvComm>(p, kRecvMagic); }
MemRegion* AsMemRegion(void* p) { return AsLive<MemRegion>(p, kMrMagic); }
Request* AsRequest(void* p) { return AsLive<Request>(p, kReqMagic); }

void MemRegionBounds(const MemRegion* mr, uintptr_t* base, size_t* len, MemType* type) {
  *base = mr->base;
  *len = mr->len;
  *type = mr->type;
}

}  // namespace ucxnet
}  // namespace scape
