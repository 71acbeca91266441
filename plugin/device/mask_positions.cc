// The device copies of mask positions: see mask_positions.h.
#include "plugin/device/mask_positions.h"

#include "base/log.h"

namespace scape {
namespace device {

void MaskPositions::ReleaseLocked(const Key& key, Entry* e) {
  // The list is held until the upload (and every use queued so far) has run.
  pool_->Release(e->blk, key.second, std::move(e->gen));
  e->blk = DevicePool::Block();
  if (e->uploaded) pool_->runtime()->EventDestroy(e->uploaded);  // waits on it stay queued
  e->uploaded = nullptr;
}

// Work about to be enqueued on `s` reads e's copy: ordered after its upload, which may have
// been enqueued on another stream at the same handle.
Status MaskPositions::OrderAfterUpload(Entry* e, Stream s) {
  if (!e->uploaded) return Status::Ok();
  Runtime* rt = pool_->runtime();
  bool done = false;
  SCAPE_RETURN_IF_ERROR(rt->EventQuery(e->uploaded, &done));
  if (!done) return rt->StreamWaitEvent(s, e->uploaded);
  rt->EventDestroy(e->uploaded);
  e->uploaded = nullptr;
  return Status::Ok();
}

Status MaskPositions::Get(const Mask& m, Stream s, const uint64_t** dPos) {
  std::shared_ptr<const std::vector<uint64_t>> cur = m.CurrentShared();
  const size_t bytes = cur->size() * sizeof(uint64_t);
  std::lock_guard<std::mutex> lk(mu_);
  const Key key(&m, s);
  Entry& e = entries_[key];
  if (e.gen != cur) {
    if (e.gen) ReleaseLocked(key, &e);
    Runtime* rt = pool_->runtime();
    Status st = pool_->Acquire(bytes, s, &e.blk);
    // The source is the generation's own list, held (never changed) until the upload has run.
    // Staged through page-locked memory (no host wait: a pageable source may make the copy
    // wait for the stream); the list stays held too, for a runtime whose UploadStaged is a
    // plain copy.
    if (st.ok() && bytes) st = rt->UploadStaged(e.blk.d, cur->data(), bytes, s);
    if (st.ok()) st = rt->EventCreate(&e.uploaded);
    if (st.ok()) st = rt->EventRecord(e.uploaded, s);
    if (!st.ok()) {
      ReleaseLocked(key, &e);
      entries_.erase(key);
      return st.Prepend("uploading the mask's positions to the device");
    }
    e.gen = std::move(cur);
  } else {
    Status st = OrderAfterUpload(&e, s);
    if (!st.ok()) return st.Prepend("ordering after the mask's positions upload");
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

}  // namespace device
}  // namespace scape
