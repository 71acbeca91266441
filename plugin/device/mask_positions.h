// The device copies of mask positions, for the masked operations on device buffers
// (plugin/backend/masked.h) and scapeMaskPack / scapeMaskUnpack.
//
// MaskPositions keeps, per (mask, stream), the device copy of a mask's current positions: it
// is uploaded on that stream from the mask's own host list when the mask's generation changes,
// and reused by every later call of that generation on that stream. Holding the host list also
// keeps the mask from decoding a later mask into it (Mask::SyncStart replaces a list someone
// still holds); DropStale lets go of old generations (scapeMaskAdvance), Drop of a destroyed
// mask. Device memory comes from the communicator's DevicePool and goes back to it once the
// work that reads it is enqueued.
//
// The key's stream is a raw handle, and a runtime may hand a destroyed stream's handle to a
// new stream: a copy found under the key is then not ordered after its upload by stream order.
// So an upload records an event, and a later Get waits for it on the device
// (StreamWaitEvent, no host wait) until a query has seen it complete.
#ifndef SCAPE_PLUGIN_DEVICE_MASK_POSITIONS_H_
#define SCAPE_PLUGIN_DEVICE_MASK_POSITIONS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "base/status.h"
#include "plugin/device/device_pool.h"
#include "plugin/device/runtime.h"
#include "plugin/mask/mask.h"

namespace scape {
namespace device {

class MaskPositions {
 public:
  explicit MaskPositions(DevicePool* pool) : pool_(pool) {}
  ~MaskPositions() { Drop(nullptr); }

  // The positions of m's current generation on the device, for work about to be enqueued on
  // `s` (uploaded on `s` first when they changed). *dPos stays valid until Drop/DropStale.
  Status Get(const Mask& m, Stream s, const uint64_t** dPos);
  // Lets go of the copies of `m` (all masks when null): their blocks go back to the pool once
  // the work enqueued so far on their streams has run.
  void Drop(const Mask* m);
  // Lets go of the copies of `m` that are not its current generation.
  void DropStale(const Mask& m);

 private:
  struct Entry {
    std::shared_ptr<const std::vector<uint64_t>> gen;  // the list in `blk`
    DevicePool::Block blk;
    Event uploaded = nullptr;  // recorded after the upload; null once it has completed
  };
  using Key = std::pair<const Mask*, Stream>;
  void ReleaseLocked(const Key& key, Entry* e);
  Status OrderAfterUpload(Entry* e, Stream s);

  DevicePool* const pool_;
  std::mutex mu_;
  std::map<Key, Entry> entries_;
};

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_MASK_POSITIONS_H_
