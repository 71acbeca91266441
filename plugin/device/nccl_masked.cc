// The masked all-reduce on the NCCL backend: see nccl_masked.h.
#include "plugin/device/nccl_masked.h"

#include <time.h>

#include "base/clock.h"
#include "base/log.h"

namespace scape {
namespace device {

NcclMaskCache::~NcclMaskCache() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : pos_) {
    kv.second.buf.host = kv.second.gen;
    Retire(std::move(kv.second.buf));
  }
  pos_.clear();
  // After an abort, what has finished is freed at once and the rest leaked, not waited for.
  const bool wait = !abandoned_.load();
  Sweep(GetRuntime(), wait, true);
}

size_t NcclMaskCache::BuffersHeld() {
  std::lock_guard<std::mutex> lk(mu_);
  Sweep(GetRuntime(), false, false);
  return pos_.size() + retired_.size();
}

void NcclMaskCache::Sweep(Runtime* rt, bool wait, bool freeDone) {
  Deadline dl = Deadline::AfterMs(wait ? timeoutMs_ : 0);
  for (;;) {
    std::vector<Buf> keep;
    for (Buf& b : retired_) {
      bool done = b.idle || b.done == nullptr;                         // no work was queued on it
      if (!done && !rt->EventQuery(b.done, &done).ok()) done = false;  // failed stream: keep
      if (done && freeDone) {
        if (b.done) rt->EventDestroy(b.done);
        rt->DeviceFree(b.d);
        continue;
      }
      if (done) {
        b.idle = true;
        b.host.reset();  // its upload has run
      }
      keep.push_back(std::move(b));
    }
    retired_.swap(keep);
    if (!wait || retired_.empty()) break;
    if (dl.Expired()) {
      SCAPE_WARN(
          "NCCL masked all-reduce: %zu device buffer(s) still in use by stream work after %d "
          "ms; leaked rather than freed under the device",
          retired_.size(), timeoutMs_);
      break;
    }
    struct timespec ts = {0, 500000};
    nanosleep(&ts, nullptr);
  }
  if (freeDone) return;
  // Keep the largest kMaxIdle idle buffers: the next calls' sizes are the recent ones.
  size_t idle = 0;
  for (const Buf& b : retired_) idle += b.idle;
  while (idle > kMaxIdle) {
    auto smallest = retired_.end();
    for (auto it = retired_.begin(); it != retired_.end(); ++it)
      if (it->idle && (smallest == retired_.end() || it->bytes < smallest->bytes)) smallest = it;
    if (smallest->done) rt->EventDestroy(smallest->done);
    rt->DeviceFree(smallest->d);
    retired_.erase(smallest);
    --idle;
  }
}

Status NcclMaskCache::Take(Runtime* rt, size_t bytes, Stream s, bool sameStreamOk, Buf* out) {
  auto best = retired_.end();
  for (auto it = retired_.begin(); it != retired_.end(); ++it) {
    const bool usable =
        it->idle || (sameStreamOk && s != nullptr && it->stream == s && it->host == nullptr);
    if (usable && it->bytes >= bytes && (best == retired_.end() || it->bytes < best->bytes))
      best = it;
  }
  if (best != retired_.end()) {
    *out = std::move(*best);
    retired_.erase(best);
    out->idle = false;
    return Status::Ok();
  }
  *out = Buf();
  out->bytes = bytes;
  return rt->DeviceAlloc(bytes, &out->d);
}

Status NcclMaskCache::Mark(Runtime* rt, Buf* b, Stream s) {
  b->stream = s;
  if (!b->done) SCAPE_RETURN_IF_ERROR(rt->EventCreate(&b->done));
  return rt->EventRecord(b->done, s);
}

Status NcclMaskCache::AllReduce(NcclBackend& b, const Mask& m, const coll::CollArgs& a,
                                Stream stream) {
  std::shared_ptr<const std::vector<uint64_t>> gen = m.CurrentShared();
  const size_t k = gen->size(), esz = scapeTypeSize(a.dtype);
  coll::CollArgs c;
  c.type = coll::CollType::kAllReduce;
  c.dtype = a.dtype;
  c.op = a.op;
  if (m.CurrentIsIdentity()) {
    // Mask order is the buffer's order: the dense buffers are the packed values.
    c.send = a.send;
    c.recv = a.recv;
    c.count = k;
    return b.Run(c, stream);
  }
  if (k == 0) return Status::Ok();  // every rank has the same (agreed) mask: nothing to do
  Runtime* rt = GetRuntime();
  std::lock_guard<std::mutex> lk(mu_);
  // Positions whose mask moved on (or was destroyed): only this cache still holds them.
  for (auto it = pos_.begin(); it != pos_.end();) {
    if (it->second.gen.use_count() == 1 && it->second.gen != gen) {
      it->second.buf.host = it->second.gen;
      Retire(std::move(it->second.buf));
      it = pos_.erase(it);
    } else {
      ++it;
    }
  }
  Sweep(rt, false, false);
  auto it = pos_.find(&m);
  if (it == pos_.end() || it->second.gen != gen) {
    if (it != pos_.end()) {
      it->second.buf.host = it->second.gen;
      Retire(std::move(it->second.buf));
      pos_.erase(it);
    }
    Positions p;
    p.gen = gen;
    // Only an idle buffer: one still in use may have an upload of its own waiting to run.
    Status st = Take(rt, k * sizeof(uint64_t), stream, false, &p.buf);
    if (!st.ok())
      return st.Prepend(
          StrFormat("rank %d: device memory for the mask's %zu positions", b.rank(), k));
    // The source is the mask's generation, held by p.gen (and by the retired buffer after
    // it) until the stream has passed the copy.
    st = rt->CopyAsync(p.buf.d, gen->data(), k * sizeof(uint64_t), stream);
    if (st.ok()) st = Mark(rt, &p.buf, stream);
    if (!st.ok()) {
      p.buf.host = gen;
      Retire(std::move(p.buf));
      return st.Prepend(StrFormat("rank %d: uploading the mask's positions", b.rank()));
    }
    it = pos_.emplace(&m, std::move(p)).first;
  }
  Positions& pos = it->second;
  const auto* dIdx = static_cast<const uint64_t*>(pos.buf.d);
  Buf tmp;
  Status st = Take(rt, k * esz, stream, true, &tmp);
  if (!st.ok())
    return st.Prepend(StrFormat("rank %d: device memory for %zu packed values", b.rank(), k));
  st = rt->Gather(a.send, dIdx, k, esz, tmp.d, stream);
  if (!st.ok()) st.Prepend(StrFormat("rank %d: gathering the mask's values", b.rank()));
  if (st.ok()) {
    c.send = tmp.d;
    c.recv = tmp.d;
    c.count = k;
    st = b.Run(c, stream);
  }
  if (st.ok()) {
    st = rt->Scatter(tmp.d, dIdx, k, esz, a.recv, stream);
    if (!st.ok()) st.Prepend(StrFormat("rank %d: scattering the reduced values", b.rank()));
  }
  // Whatever was queued, the buffers are freed only once the stream has passed it.
  Status m1 = Mark(rt, &pos.buf, stream), m2 = Mark(rt, &tmp, stream);
  Retire(std::move(tmp));
  if (st.ok()) st = m1.ok() ? m2 : m1;
  return st;
}

}  // namespace device
}  // namespace scape
