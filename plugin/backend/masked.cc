// The mask operations over a Backend: see masked.h.
#include "plugin/backend/masked.h"

#include <utility>

#include "base/log.h"

namespace scape {
namespace backend {

Status MaskedAllReduce(Backend& b, Mask& m, const coll::CollArgs& dense, Stream s,
                       std::shared_ptr<PendingOp>* async) {
  SCAPE_RETURN_IF_ERROR(b.Admit(dense, s, async != nullptr));
  const int rank = b.rank();
  const size_t k = m.Current().size(), esz = scapeTypeSize(dense.dtype);
  coll::CollArgs a = dense;
  a.type = coll::CollType::kAllReduce;
  a.count = k;
  // Mask order is the buffer's order: the exchange runs on the dense buffers.
  if (m.CurrentIsIdentity()) return b.AllReducePacked(m, a, s, async, nullptr);
  Packed p;
  SCAPE_RETURN_IF_ERROR(b.AcquirePacked(m, k, esz, s, async != nullptr, &p));
  Status st;
  if (k > 0) {
    st = b.Gather(dense.send, p.pos, k, esz, p.buf, s);
    if (!st.ok())
      st.Prepend(StrFormat("rank %d: gathering the mask's positions on the device", rank));
  }
  a.send = a.recv = p.buf;  // reduced in place
  void* recv = dense.recv;
  if (st.ok() && async) {
    // The scatter runs when the exchange completes, with what the operation holds.
    std::function<void()> scatter;
    if (k > 0)
      scatter = [&b, p, k, esz, recv]() {
        // Host memory (the only *Async form): the host scatter cannot fail.
        (void)b.Scatter(p.buf, p.pos, k, esz, recv, nullptr);
      };
    st = b.AllReducePacked(m, a, s, async, std::move(scatter));
  } else if (st.ok()) {
    st = b.AllReducePacked(m, a, s, nullptr, nullptr);
    if (st.ok() && k > 0) {
      // Only the mask's positions of recvbuf are written: the others keep their values.
      st = b.Scatter(p.buf, p.pos, k, esz, recv, s);
      if (!st.ok())
        st.Prepend(StrFormat("rank %d: scattering the reduced values on the device", rank));
    }
  }
  // Whatever was queued, the temporaries go back only once the stream has passed them.
  b.ReleasePacked(&p, s);
  return st;
}

Status MaskPack(Backend& b, const Mask& m, const void* dense, void* packed, size_t esz, bool unpack,
                Stream s, int timeoutMs) {
  // Host buffers with a stream: what the caller queued there must finish first (within the
  // communicator's deadline).
  const bool ordered = b.StreamOrdered();
  if (s && !ordered)
    SCAPE_RETURN_IF_ERROR(device::StreamWaitFor(device::GetRuntime(), s, timeoutMs,
                                                "the work queued on the stream before the pack"));
  const size_t k = m.Current().size();
  if (k == 0) return Status::Ok();
  if (!dense || !packed) return InvalidArgument(dense ? "packed is NULL" : "dense is NULL");
  const Stream on = ordered ? s : nullptr;
  const uint64_t* pos = nullptr;
  Status st = b.Positions(m, on, &pos);
  if (st.ok())
    st = unpack ? b.Scatter(packed, pos, k, esz, const_cast<void*>(dense), on)
                : b.Gather(dense, pos, k, esz, packed, on);
  if (!st.ok()) st.Prepend(unpack ? "scattering on the device" : "gathering on the device");
  return st;
}

}  // namespace backend
}  // namespace scape
