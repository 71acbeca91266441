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
  Sweep(GetRuntime(), !abandoned_.load());
}

size_t NcclMaskCache::BuffersHeld() {
  std::lock_guard<std::mutex> lk(mu_);
  Sweep(GetRuntime(), false);
  return pos_.size() + retired_.size();
}

void NcclMaskCache::Sweep(Runtime* rt, bool all) {
  Deadline dl = Deadline::AfterMs(all ? timeoutMs_ : 0);
  for (;;) {
    std::vector<Buf> keep;
    for (Buf& b : retired_) {
      bool done = b.done == nullptr;                                   // no work was queued on it
      if (!done && !rt->EventQuery(b.done, &done).ok()) done = false;  // failed stream: keep
      if (done) {
        if (b.done) rt->EventDestroy(b.done);
        rt->DeviceFree(b.d);
      } else {
        keep.push_back(std::move(b));
      }
    }
    retired_.swap(keep);
    if (!all || retired_.empty()) break;
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
}

Status NcclMaskCache::Mark(Runtime* rt, Buf* b, Stream s) {
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
  Sweep(rt, false);
  auto it = pos_.find(&m);
  if (it == pos_.end() || it->second.gen != gen) {
    if (it != pos_.end()) {
      it->second.buf.host = it->second.gen;
      Retire(std::move(it->second.buf));
      pos_.erase(it);
    }
    Positions p;
    p.gen = gen;
    p.buf.bytes = k * sizeof(uint64_t);
    Status st = rt->DeviceAlloc(p.buf.bytes, &p.buf.d);
    if (!st.ok())
      return st.Prepend(
          StrFormat("rank %d: device memory for the mask's %zu positions", b.rank(), k));
    // The source is the mask's generation, held by p.gen (and by the retired buffer after
    // it) until the stream has passed the copy.
    st = rt->CopyAsync(p.buf.d, gen->data(), p.buf.bytes, stream);
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
  tmp.bytes = k * esz;
  Status st = rt->DeviceAlloc(tmp.bytes, &tmp.d);
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
