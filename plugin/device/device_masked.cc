// The masked all-reduce on device buffers, and the device copies of mask positions: see
// device_masked.h.
#include "plugin/device/device_masked.h"

#include "base/log.h"

namespace scape {
namespace device {

void MaskPositions::ReleaseLocked(const Key& key, Entry* e) {
  // The list is held until the upload (and every use queued so far) has run.
  pool_->Release(e->blk, key.second, std::move(e->gen));
  e->blk = DevicePool::Block();
}

Status MaskPositions::Get(const Mask& m, Stream s, const uint64_t** dPos) {
  std::shared_ptr<const std::vector<uint64_t>> cur = m.CurrentShared();
  const size_t bytes = cur->size() * sizeof(uint64_t);
  std::lock_guard<std::mutex> lk(mu_);
  const Key key(&m, s);
  Entry& e = entries_[key];
  if (e.gen != cur) {
    if (e.gen) ReleaseLocked(key, &e);
    Status st = pool_->Acquire(bytes, s, &e.blk);
    if (st.ok() && bytes) st = pool_->runtime()->CopyAsync(e.blk.d, cur->data(), bytes, s);
    if (!st.ok()) {
      ReleaseLocked(key, &e);
      entries_.erase(key);
      return st.Prepend("uploading the mask's positions to the device");
    }
    e.gen = std::move(cur);
  }
  *dPos = static_cast<const uint64_t*>(e.blk.d);
  return Status::Ok();
}

void MaskPositions::Drop(const Mask* m) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (m == nullptr || it->first.first == m) {
      ReleaseLocked(it->first, &it->second);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void MaskPositions::DropStale(const Mask& m) {
  std::shared_ptr<const std::vector<uint64_t>> cur = m.CurrentShared();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == &m && it->second.gen != cur) {
      ReleaseLocked(it->first, &it->second);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

Status MaskedAllReduce(DevicePool& pool, MaskPositions& positions, const Mask& m,
                       const coll::CollArgs& dense, Stream s, int rank,
                       const PackedExchange& exchange) {
  Runtime* rt = pool.runtime();
  const size_t k = m.Current().size(), esz = scapeTypeSize(dense.dtype);
  coll::CollArgs a = dense;
  a.type = coll::CollType::kAllReduce;
  a.count = k;
  if (m.CurrentIsIdentity()) return exchange(a);  // mask order is the buffer's order
  if (k == 0) {
    a.send = a.recv = nullptr;  // every rank has the same (agreed) mask: no values move
    return exchange(a);
  }
  const uint64_t* dPos = nullptr;
  Status st = positions.Get(m, s, &dPos);
  if (!st.ok()) return st.Prepend(StrFormat("rank %d", rank));
  DevicePool::Block tmp;
  st = pool.Acquire(k * esz, s, &tmp);
  if (!st.ok())
    return st.Prepend(StrFormat("rank %d: device memory for %zu packed values", rank, k));
  st = rt->Gather(dense.send, dPos, k, esz, tmp.d, s);
  if (!st.ok()) {
    st.Prepend(StrFormat("rank %d: gathering the mask's positions on the device", rank));
  } else {
    a.send = a.recv = tmp.d;
    st = exchange(a);
    if (st.ok()) {
      // Only the mask's positions of recvbuf are written: the others keep their values.
      st = rt->Scatter(tmp.d, dPos, k, esz, dense.recv, s);
      if (!st.ok())
        st.Prepend(StrFormat("rank %d: scattering the reduced values on the device", rank));
    }
  }
  // Whatever was queued, the block goes back only once the stream has passed it.
  pool.Release(tmp, s);
  return st;
}

}  // namespace device
}  // namespace scape
