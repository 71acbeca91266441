// The mask operations, written once over a Backend whatever the memory kind (host, UCX staged
// device memory, NCCL): the masked (dense-in/dense-out) all-reduce and the pack / unpack.
//
// The masked all-reduce: the backend's checks (Admit), the identity-mask shortcut (a full mask
// with shard ownership: mask order is the buffer's order, so the exchange runs on the dense
// buffers directly, same blocks and bits as the packed path, nothing gathered or scattered),
// the gather of the mask's positions into a packed temporary, the backend's exchange of the k
// packed values (AllReducePacked), the scatter into recvbuf. Positions outside the mask keep
// recvbuf's values, in place or not.
#ifndef SCAPE_PLUGIN_BACKEND_MASKED_H_
#define SCAPE_PLUGIN_BACKEND_MASKED_H_

#include <cstddef>
#include <memory>

#include "base/status.h"
#include "plugin/backend/backend.h"
#include "plugin/coll/coll.h"
#include "plugin/core/comm.h"
#include "plugin/mask/mask.h"

namespace scape {
namespace backend {

// The masked all-reduce of `dense` (validated: all-reduce, count = m.n(); routed to `b` by
// DataPath::Route) on stream `s`. async non-null (the *Async form; the host backend only, the
// device ones refuse it in Admit): *async receives the queued exchange, which owns its packed
// buffer and the positions it packed (the caller may advance or destroy the mask before it
// completes); the scatter runs when the exchange completes. Otherwise blocking (host: the
// mask's pack buffer, kept between calls) or enqueued on `s` (device: a temporary from the
// communicator's pool, back to it once the scatter is enqueued).
Status MaskedAllReduce(Backend& b, Mask& m, const coll::CollArgs& dense, Stream s,
                       std::shared_ptr<PendingOp>* async);

// scapeMaskPack[Stream] (unpack = false: dense -> packed) and scapeMaskUnpack[Stream] (packed ->
// dense) of m's current positions, on `b` (DataPath::RouteBuffers), on stream `s` (NULL: the
// default stream; host buffers with a stream wait for it first, at most timeoutMs, the
// communicator's: scapeTimeout past it): nothing when the mask is empty; a NULL buffer
// otherwise is scapeInvalidArgument naming it.
Status MaskPack(Backend& b, const Mask& m, const void* dense, void* packed, size_t esz, bool unpack,
                Stream s, int timeoutMs);

}  // namespace backend
}  // namespace scape

#endif  // SCAPE_PLUGIN_BACKEND_MASKED_H_
