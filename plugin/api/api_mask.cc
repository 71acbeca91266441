// SCAPE API entry points for agreed masks, the values-only collectives on them, and the
// generic sparse all-reduce.
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/dtypes.h"
#include "plugin/api/api_internal.h"
#include "plugin/backend/masked.h"
#include "plugin/coll/sparse.h"
#include "plugin/mask/mask.h"

namespace {

using scape::Status;
using scape::StrFormat;
using scape::api::CheckComm;
using scape::api::Guard;
using scape::api::ValidOp;
using scape::api::ValidType;

Status CheckMask(scapeMask* mask) {
  if (!mask) return scape::InvalidArgument("mask is NULL");
  // Looked up before anything is read through it: a destroyed mask is an error, not a crash.
  if (!scape::api::HandleLive(mask, scape::api::HandleKind::kMask) || !mask->impl)
    return scape::InvalidArgument(
        "mask is not a live mask (destroyed, or its communicator was "
        "aborted)");
  return Status::Ok();
}

Status CheckMaskComm(scapeMask* mask, scapeComm* comm) {
  SCAPE_RETURN_IF_ERROR(CheckComm(comm));
  if (!mask) return scape::InvalidArgument("mask is NULL");
  if (!scape::api::HandleLive(mask, scape::api::HandleKind::kMask))
    return scape::InvalidArgument(
        StrFormat("rank %d: mask is not a live mask (destroyed, or its "
                  "communicator was aborted)",
                  comm->impl->rank()));
  // Checked against the communicator's live masks before anything is dereferenced: a
  // destroyed mask or one of another communicator is an argument error, not a crash.
  if (comm->masks.count(mask) == 0)
    return scape::InvalidArgument(
        StrFormat("rank %d: mask is not a live mask of this "
                  "communicator (destroyed, or created on another "
                  "communicator)",
                  comm->impl->rank()));
  return CheckMask(mask);
}

Status CheckValues(int rank, scapeDataType_t dtype, const scapeRedOp_t* op) {
  if (!ValidType(dtype))
    return scape::InvalidArgument(
        StrFormat("rank %d: datatype %d is not a scapeDataType_t", rank, static_cast<int>(dtype)));
  if (op && !ValidOp(*op))
    return scape::InvalidArgument(
        StrFormat("rank %d: op %d is not a scapeRedOp_t", rank, static_cast<int>(*op)));
  return Status::Ok();
}

scapeComm* CommOf(scapeMask* m) {
  return scape::api::HandleLive(m, scape::api::HandleKind::kMask) && m->impl ? m->comm : nullptr;
}

// A mask of an NCCL-backend communicator (no UCX communicator: checked against its live masks).
Status CheckMaskNcclComm(scapeMask* mask, scapeComm* comm, int rank) {
  if (!mask) return scape::InvalidArgument("mask is NULL");
  if (!scape::api::HandleLive(mask, scape::api::HandleKind::kMask) ||
      comm->masks.count(mask) == 0 || !mask->impl)
    return scape::InvalidArgument(
        StrFormat("rank %d: mask is not a live mask of this communicator (destroyed, or created "
                  "on another communicator)",
                  rank));
  return Status::Ok();
}

// The packed values-only collectives; request NULL = blocking. Counts are copied from the
// current mask when the call is made, so advancing the mask afterwards does not affect an
// operation in flight (its buffers are the caller's, sized for the mask it was called with).
// Host buffers run on the host (a non-NULL stream is waited for first, as for the dense
// collectives); device buffers are staged on the stream on a UCX communicator, issued to NCCL
// on an NCCL-backend one.
Status RunPacked(scape::coll::CollType type, const void* sendbuf, void* recvbuf,
                 scapeDataType_t dtype, const scapeRedOp_t* op, scapeMask* mask, scapeComm* comm,
                 void* stream, scapeRequest_t* request) {
  using scape::coll::CollType;
  int rank = 0;
  scape::backend::RankSpace ranks;
  if (comm && comm->data->Topology(&ranks)) {
    rank = ranks.rank;
    SCAPE_RETURN_IF_ERROR(CheckMaskNcclComm(mask, comm, rank));
  } else {
    SCAPE_RETURN_IF_ERROR(CheckMaskComm(mask, comm));
    rank = comm->impl->rank();
  }
  SCAPE_RETURN_IF_ERROR(CheckValues(rank, dtype, op));
  const scape::Mask& m = *mask->impl;
  const size_t k = m.Current().size(), mine = m.RankCount(rank);
  // Which buffers must be non-NULL: all-reduce both (k > 0); reduce-scatter sendbuf (k > 0)
  // and recvbuf (own block); all-gather recvbuf (k > 0) and sendbuf (own block).
  const bool needSend = type == CollType::kAllGather ? mine > 0 : k > 0;
  const bool needRecv = type == CollType::kReduceScatter ? mine > 0 : k > 0;
  if (needSend && !sendbuf)
    return scape::InvalidArgument(StrFormat("rank %d: sendbuf is NULL", rank));
  if (needRecv && !recvbuf)
    return scape::InvalidArgument(StrFormat("rank %d: recvbuf is NULL", rank));
  scape::coll::CollArgs a;
  a.type = type;
  a.send = sendbuf;
  a.recv = recvbuf;
  a.count = type == CollType::kAllReduce ? k : 0;
  a.counts = m.RankCounts();
  a.dtype = dtype;
  if (op) a.op = *op;
  // Where the communicator's data path routes it: host buffers on the host (a non-NULL stream
  // is waited for first), device buffers staged on the stream (UCX) or issued to NCCL.
  return scape::api::RouteAndRun(comm, a, nullptr, stream, request);
}

Status PackedAllReduce(const void* sendbuf, void* recvbuf, scapeDataType_t dtype, scapeRedOp_t op,
                       scapeMask* mask, scapeComm* comm, void* stream, scapeRequest_t* request) {
  return RunPacked(scape::coll::CollType::kAllReduce, sendbuf, recvbuf, dtype, &op, mask, comm,
                   stream, request);
}

Status PackedReduceScatter(const void* sendbuf, void* recvbuf, scapeDataType_t dtype,
                           scapeRedOp_t op, scapeMask* mask, scapeComm* comm, void* stream,
                           scapeRequest_t* request) {
  return RunPacked(scape::coll::CollType::kReduceScatter, sendbuf, recvbuf, dtype, &op, mask, comm,
                   stream, request);
}

Status PackedAllGather(const void* sendbuf, void* recvbuf, scapeDataType_t dtype, scapeMask* mask,
                       scapeComm* comm, void* stream, scapeRequest_t* request) {
  return RunPacked(scape::coll::CollType::kAllGather, sendbuf, recvbuf, dtype, nullptr, mask, comm,
                   stream, request);
}

}  // namespace

namespace scape {
namespace api {

Status CheckMaskedAllReduce(scapeComm* comm, size_t count, scapeMask* mask, int rank) {
  // A UCX communicator, or an NCCL-backend one with or without a host communicator.
  SCAPE_RETURN_IF_ERROR(comm->impl ? CheckMaskComm(mask, comm)
                                   : CheckMaskNcclComm(mask, comm, rank));
  const Mask& m = *mask->impl;
  if (count != m.n())
    return InvalidArgument(StrFormat("rank %d: count %zu differs from the mask's n %llu", rank,
                                     count, static_cast<unsigned long long>(m.n())));
  return Status::Ok();
}

}  // namespace api
}  // namespace scape

extern "C" {

SCAPE_API scapeResult_t scapeMaskCreate(scapeMask_t* mask, uint64_t n, int nsegments,
                                        const uint64_t* segOffsets, const uint8_t* denseFlags,
                                        scapeOwnership_t ownership, scapeMaskEncoding_t encoding,
                                        scapeComm_t comm) {
  return Guard(comm, "scapeMaskCreate", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckComm(comm));
    const int rank = comm->impl->rank();
    if (!mask) return scape::InvalidArgument("mask is NULL");
    if (n >= (uint64_t{1} << 40))
      return scape::InvalidArgument(StrFormat("rank %d: n = %llu: expected below 2^40", rank,
                                              static_cast<unsigned long long>(n)));
    if (nsegments < 1)
      return scape::InvalidArgument(
          StrFormat("rank %d: nsegments = %d: expected >= 1", rank, nsegments));
    if (!segOffsets) return scape::InvalidArgument("segOffsets is NULL");
    if (static_cast<int>(ownership) < 0 || ownership >= scapeNumOwnerships)
      return scape::InvalidArgument(StrFormat("rank %d: ownership %d is not a scapeOwnership_t",
                                              rank, static_cast<int>(ownership)));
    if (static_cast<int>(encoding) < 0 || encoding >= scapeNumMaskEncodings)
      return scape::InvalidArgument(StrFormat("rank %d: encoding %d is not a scapeMaskEncoding_t",
                                              rank, static_cast<int>(encoding)));
    std::vector<uint64_t> offs(segOffsets, segOffsets + nsegments + 1);
    if (offs.front() != 0 || offs.back() != n)
      return scape::InvalidArgument(
          StrFormat("rank %d: segOffsets must start at 0 and end at n = %llu", rank,
                    static_cast<unsigned long long>(n)));
    for (int s = 0; s < nsegments; ++s)
      if (offs[static_cast<size_t>(s) + 1] < offs[static_cast<size_t>(s)])
        return scape::InvalidArgument(
            StrFormat("rank %d: segOffsets[%d] < segOffsets[%d]: offsets "
                      "must not decrease",
                      rank, s + 1, s));
    std::vector<uint8_t> dense;
    if (denseFlags) dense.assign(denseFlags, denseFlags + nsegments);
    std::unique_ptr<scape::Mask> impl;
    SCAPE_RETURN_IF_ERROR(
        scape::Mask::Create(comm->impl.get(), n, offs, dense, ownership, encoding, &impl));
    *mask = new scapeMask{std::move(impl), comm};
    comm->masks.insert(*mask);
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskDestroy(scapeMask_t mask) {
  if (!mask) return scapeSuccess;
  if (!scape::api::HandleLive(mask, scape::api::HandleKind::kMask))
    return scape::api::Report(
        nullptr, scape::InvalidArgument("scapeMaskDestroy: mask is not a live mask (destroyed "
                                        "twice, or its communicator was aborted)"));
  scapeComm* comm = mask->comm;
  return Guard(comm, "scapeMaskDestroy", [&]() -> Status {
    if (comm) comm->masks.erase(mask);
    delete mask;
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskGetOwnedRanges(scapeMask_t mask, int rank, uint64_t* ranges,
                                                size_t capacity, size_t* count) {
  return Guard(CommOf(mask), "scapeMaskGetOwnedRanges", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (!count) return scape::InvalidArgument("count is NULL");
    if (rank < 0 || rank >= mask->comm->impl->nranks())
      return scape::InvalidArgument(StrFormat("rank %d out of range", rank));
    const auto& pieces = mask->impl->Owned(rank);
    if (ranges) {
      // Adjacent pieces of different segments form one range.
      size_t w = 0;
      for (size_t i = 0; i < pieces.size(); ++i) {
        if (w > 0 && ranges[2 * (w - 1) + 1] == pieces[i].begin) {
          ranges[2 * (w - 1) + 1] = pieces[i].end;
          continue;
        }
        if (w >= capacity) break;
        ranges[2 * w] = pieces[i].begin;
        ranges[2 * w + 1] = pieces[i].end;
        ++w;
      }
    }
    size_t c = 0;
    uint64_t lastEnd = UINT64_MAX;
    for (const auto& p : pieces) {
      if (p.begin != lastEnd) ++c;
      lastEnd = p.end;
    }
    *count = c;
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskSetNextIndices(scapeMask_t mask, const uint64_t* indices,
                                                size_t k) {
  return Guard(CommOf(mask), "scapeMaskSetNextIndices", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (k > 0 && !indices) return scape::InvalidArgument("indices is NULL with k > 0");
    return mask->impl->SetNextIndices(indices, k);
  });
}

namespace {

Status SelectNextTopk(scapeMask_t mask, const float* statistic, double density, void* stream) {
  SCAPE_RETURN_IF_ERROR(CheckMask(mask));
  if (!(density > 0.0 && density <= 1.0))
    return scape::InvalidArgument(StrFormat("density = %g: expected 0 < density <= 1", density));
  if (!statistic && mask->impl->n() > 0) return scape::InvalidArgument("statistic is NULL");
  // A device statistic: top-k on the device (on `stream`), only the selected positions come
  // back.
  if (statistic && scape::device::GetRuntime()->Kind(statistic) != scape::device::PtrKind::kHost) {
    scape::backend::DeviceBackend* d = mask->comm->data->device();
    if (!d) return scape::InvalidUsage("the communicator's device data path has been released");
    return d->SelectTopk(*mask->impl, statistic, density, stream);
  }
  // A host statistic with a stream: what the caller queued there must finish first.
  if (stream)
    SCAPE_RETURN_IF_ERROR(scape::device::StreamWaitFor(
        scape::device::GetRuntime(), stream, mask->comm->impl->config().timeoutMs,
        "the work queued on the stream before the host statistic's top-k"));
  return mask->impl->SelectNextTopk(statistic, density);
}

}  // namespace

SCAPE_API scapeResult_t scapeMaskSelectNextTopk(scapeMask_t mask, const float* statistic,
                                                double density) {
  return Guard(CommOf(mask), "scapeMaskSelectNextTopk",
               [&]() -> Status { return SelectNextTopk(mask, statistic, density, nullptr); });
}

SCAPE_API scapeResult_t scapeMaskSelectNextTopkStream(scapeMask_t mask, const float* statistic,
                                                      double density, void* stream) {
  return Guard(CommOf(mask), "scapeMaskSelectNextTopkStream",
               [&]() -> Status { return SelectNextTopk(mask, statistic, density, stream); });
}

SCAPE_API scapeResult_t scapeMaskSyncStart(scapeMask_t mask) {
  return Guard(CommOf(mask), "scapeMaskSyncStart", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    return mask->impl->SyncStart();
  });
}

SCAPE_API scapeResult_t scapeMaskSyncTest(scapeMask_t mask, int* done) {
  bool fin = false;
  scapeResult_t r = Guard(CommOf(mask), "scapeMaskSyncTest", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (!done) return scape::InvalidArgument("done is NULL");
    return mask->impl->SyncTest(&fin);
  });
  if (done) *done = fin ? 1 : 0;
  if (r == scapeSuccess && !fin) return scapeInProgress;
  return r;
}

SCAPE_API scapeResult_t scapeMaskSyncWait(scapeMask_t mask) {
  return Guard(CommOf(mask), "scapeMaskSyncWait", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    return mask->impl->SyncWait();
  });
}

SCAPE_API scapeResult_t scapeMaskAdvance(scapeMask_t mask) {
  return Guard(CommOf(mask), "scapeMaskAdvance", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    Status st = mask->impl->Advance();
    if (scape::backend::DeviceBackend* d = mask->comm->data->device()) d->DropStale(*mask->impl);
    return st;
  });
}

SCAPE_API scapeResult_t scapeMaskGetCount(scapeMask_t mask, uint64_t* k) {
  return Guard(CommOf(mask), "scapeMaskGetCount", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (!k) return scape::InvalidArgument("k is NULL");
    *k = mask->impl->Current().size();
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskGetRankCount(scapeMask_t mask, int rank, uint64_t* k,
                                              uint64_t* offset) {
  return Guard(CommOf(mask), "scapeMaskGetRankCount", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (rank < 0 || rank >= mask->comm->impl->nranks())
      return scape::InvalidArgument(StrFormat("rank %d out of range", rank));
    if (k) *k = mask->impl->RankCount(rank);
    if (offset) *offset = mask->impl->RankOffset(rank);
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskGetIndices(scapeMask_t mask, uint64_t* indices, size_t capacity) {
  return Guard(CommOf(mask), "scapeMaskGetIndices", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    const auto& cur = mask->impl->Current();
    if (capacity < cur.size())
      return scape::InvalidArgument(
          StrFormat("capacity %zu is below the mask's k = %zu", capacity, cur.size()));
    if (!cur.empty() && !indices) return scape::InvalidArgument("indices is NULL");
    if (!cur.empty()) std::memcpy(indices, cur.data(), cur.size() * sizeof(uint64_t));
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeMaskGetSyncInfo(scapeMask_t mask, scapeMaskSyncInfo_t* info) {
  return Guard(CommOf(mask), "scapeMaskGetSyncInfo", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckMask(mask));
    if (!info) return scape::InvalidArgument("info is NULL");
    *info = mask->impl->Info();
    return Status::Ok();
  });
}

namespace {

// scapeMaskPack / scapeMaskUnpack and their *Stream forms.
Status PackOrUnpack(scapeMask_t mask, const void* dense, const void* packed, scapeDataType_t dtype,
                    bool unpack, void* stream) {
  SCAPE_RETURN_IF_ERROR(CheckMask(mask));
  if (!ValidType(dtype)) return scape::InvalidArgument("dtype is not a scapeDataType_t");
  scape::backend::Backend* b = nullptr;
  SCAPE_RETURN_IF_ERROR(mask->comm->data->RouteBuffers(dense, packed, &b));
  return scape::backend::MaskPack(*b, *mask->impl, dense, const_cast<void*>(packed),
                                  scapeTypeSize(dtype), unpack, stream,
                                  mask->comm->impl->config().timeoutMs);
}

}  // namespace

SCAPE_API scapeResult_t scapeMaskPack(scapeMask_t mask, const void* dense, void* packed,
                                      scapeDataType_t dtype) {
  return Guard(CommOf(mask), "scapeMaskPack", [&]() -> Status {
    return PackOrUnpack(mask, dense, packed, dtype, false, nullptr);
  });
}

SCAPE_API scapeResult_t scapeMaskUnpack(scapeMask_t mask, const void* packed, void* dense,
                                        scapeDataType_t dtype) {
  return Guard(CommOf(mask), "scapeMaskUnpack",
               [&]() -> Status { return PackOrUnpack(mask, dense, packed, dtype, true, nullptr); });
}

SCAPE_API scapeResult_t scapeMaskPackStream(scapeMask_t mask, const void* dense, void* packed,
                                            scapeDataType_t dtype, void* stream) {
  return Guard(CommOf(mask), "scapeMaskPackStream",
               [&]() -> Status { return PackOrUnpack(mask, dense, packed, dtype, false, stream); });
}

SCAPE_API scapeResult_t scapeMaskUnpackStream(scapeMask_t mask, const void* packed, void* dense,
                                              scapeDataType_t dtype, void* stream) {
  return Guard(CommOf(mask), "scapeMaskUnpackStream",
               [&]() -> Status { return PackOrUnpack(mask, dense, packed, dtype, true, stream); });
}

SCAPE_API scapeResult_t scapeMaskAllReducePacked(const void* sendbuf, void* recvbuf,
                                                 scapeDataType_t dtype, scapeRedOp_t op,
                                                 scapeMask_t mask, scapeComm_t comm, void* stream) {
  return Guard(comm, "scapeMaskAllReducePacked", [&]() -> Status {
    return PackedAllReduce(sendbuf, recvbuf, dtype, op, mask, comm, stream, nullptr);
  });
}

SCAPE_API scapeResult_t scapeMaskAllReducePackedAsync(const void* sendbuf, void* recvbuf,
                                                      scapeDataType_t dtype, scapeRedOp_t op,
                                                      scapeMask_t mask, scapeComm_t comm,
                                                      void* stream, scapeRequest_t* request) {
  return Guard(comm, "scapeMaskAllReducePackedAsync", [&]() -> Status {
    if (!request) return scape::InvalidArgument("request is NULL");
    return PackedAllReduce(sendbuf, recvbuf, dtype, op, mask, comm, stream, request);
  });
}

SCAPE_API scapeResult_t scapeMaskReduceScatter(const void* sendbuf, void* recvbuf,
                                               scapeDataType_t dtype, scapeRedOp_t op,
                                               scapeMask_t mask, scapeComm_t comm, void* stream) {
  return Guard(comm, "scapeMaskReduceScatter", [&]() -> Status {
    return PackedReduceScatter(sendbuf, recvbuf, dtype, op, mask, comm, stream, nullptr);
  });
}

SCAPE_API scapeResult_t scapeMaskReduceScatterAsync(const void* sendbuf, void* recvbuf,
                                                    scapeDataType_t dtype, scapeRedOp_t op,
                                                    scapeMask_t mask, scapeComm_t comm,
                                                    void* stream, scapeRequest_t* request) {
  return Guard(comm, "scapeMaskReduceScatterAsync", [&]() -> Status {
    if (!request) return scape::InvalidArgument("request is NULL");
    return PackedReduceScatter(sendbuf, recvbuf, dtype, op, mask, comm, stream, request);
  });
}

SCAPE_API scapeResult_t scapeMaskAllGather(const void* sendbuf, void* recvbuf,
                                           scapeDataType_t dtype, scapeMask_t mask,
                                           scapeComm_t comm, void* stream) {
  return Guard(comm, "scapeMaskAllGather", [&]() -> Status {
    return PackedAllGather(sendbuf, recvbuf, dtype, mask, comm, stream, nullptr);
  });
}

SCAPE_API scapeResult_t scapeMaskAllGatherAsync(const void* sendbuf, void* recvbuf,
                                                scapeDataType_t dtype, scapeMask_t mask,
                                                scapeComm_t comm, void* stream,
                                                scapeRequest_t* request) {
  return Guard(comm, "scapeMaskAllGatherAsync", [&]() -> Status {
    if (!request) return scape::InvalidArgument("request is NULL");
    return PackedAllGather(sendbuf, recvbuf, dtype, mask, comm, stream, request);
  });
}

SCAPE_API scapeResult_t scapeSparseAllReduce(const uint64_t* indices, const void* values,
                                             size_t nnz, uint64_t n, scapeDataType_t dtype,
                                             scapeRedOp_t op, scapeSparseAlgo_t algo,
                                             void* denseOut, uint64_t* outIndices, void* outValues,
                                             size_t capacity, size_t* outNnz, uint64_t* bytesSent,
                                             scapeComm_t comm) {
  return Guard(comm, "scapeSparseAllReduce", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckComm(comm));
    const int rank = comm->impl->rank();
    const scape::dtypes::TypeRow* row = scape::dtypes::Row(dtype);
    if (!row || !row->floating)
      return scape::InvalidArgument(
          StrFormat("rank %d: datatype %d: expected a floating-point type (fp32, fp16, bf16, "
                    "e4m3 or e5m2)",
                    rank, static_cast<int>(dtype)));
    if (op != scapeSum && op != scapeAvg)
      return scape::InvalidArgument(
          StrFormat("rank %d: op %d: expected scapeSum or scapeAvg", rank, static_cast<int>(op)));
    if (static_cast<int>(algo) < 0 || algo >= scapeNumSparseAlgos)
      return scape::InvalidArgument(
          StrFormat("rank %d: algo %d is not a scapeSparseAlgo_t", rank, static_cast<int>(algo)));
    if (nnz > 0 && (!indices || !values))
      return scape::InvalidArgument("indices or values is NULL with nnz > 0");
    if (!denseOut && !outIndices)
      return scape::InvalidArgument("no output: denseOut and outIndices are NULL");
    if (outIndices && (!outValues || !outNnz))
      return scape::InvalidArgument("outIndices needs outValues and outNnz");
    if (nnz > n) return scape::InvalidArgument("nnz > n");
    const size_t esz = scapeTypeSize(dtype);
    // Device buffers (any of them): the inputs are copied to the host and the outputs back,
    // on the default stream, with host waits: the result's size is only known at the end.
    std::vector<char> inIdx, inVal, outDense, outIdx, outVal;
    const void* idxView = nullptr;
    const void* valView = nullptr;
    const int tmo = comm->impl->config().timeoutMs;
    SCAPE_RETURN_IF_ERROR(scape::backend::StageIn(indices, nnz * 8, &inIdx, &idxView, tmo));
    SCAPE_RETURN_IF_ERROR(scape::backend::StageIn(values, nnz * esz, &inVal, &valView, tmo));
    indices = static_cast<const uint64_t*>(idxView);
    values = valView;
    void* denseDev = denseOut;
    void* outIdxDev = outIndices;
    void* outValDev = outValues;
    void* view = nullptr;
    scape::backend::StageOut(denseOut, n * esz, &outDense, &view);
    denseOut = view;
    const size_t listCap = static_cast<size_t>(std::min<uint64_t>(capacity, n));  // union <= n
    scape::backend::StageOut(outIndices, listCap * 8, &outIdx, &view);
    outIndices = static_cast<uint64_t*>(view);
    scape::backend::StageOut(outValues, listCap * esz, &outVal, &view);
    outValues = view;
    for (size_t i = 0; i < nnz; ++i)
      if (indices[i] >= n || (i > 0 && indices[i] <= indices[i - 1]))
        return scape::InvalidArgument(
            StrFormat("rank %d: indices[%zu] = %llu: indices must be "
                      "strictly increasing and below n = %llu",
                      rank, i, static_cast<unsigned long long>(indices[i]),
                      static_cast<unsigned long long>(n)));
    scape::coll::SparseResult res;
    scape::Comm& c = *comm->impl;
    Status st = scape::coll::SparseAllReduce(&c, indices, values, nnz, n, dtype, op, algo, &res);
    if (st.ok() && c.nranks() > 1) {
      // Every rank validates what it received; one that finds a peer's part malformed fails.
      // This last step keeps the others from returning before every rank has validated, so
      // the failure is reported on every rank (the failing rank's abort notice ends it there)
      // instead of on one.
      int32_t mine = 1, all = 0;
      scape::coll::CollArgs a;
      a.type = scape::coll::CollType::kAllReduce;
      a.send = &mine;
      a.recv = &all;
      a.count = 1;
      a.dtype = scapeInt32;
      a.op = scapeMin;
      st = c.Run(a);
    }
    // An error after communication started breaks the communicator (peers are told), as for
    // every collective: a validation failure found here is no exception.
    if (!st.ok()) return c.Abandon(st);
    // Outputs only on success: check the capacity before writing anything.
    if (outIndices && res.Nnz() > capacity)
      return scape::InvalidArgument(
          StrFormat("the union has %zu entries, more than capacity %zu "
                    "(nothing was written)",
                    res.Nnz(), capacity));
    if (denseOut) res.ToDense(denseOut, esz);
    if (outIndices) res.ToList(outIndices, outValues, esz);
    SCAPE_RETURN_IF_ERROR(scape::backend::FinishOut(denseDev, outDense, n * esz, tmo));
    SCAPE_RETURN_IF_ERROR(scape::backend::FinishOut(outIdxDev, outIdx, res.Nnz() * 8, tmo));
    SCAPE_RETURN_IF_ERROR(scape::backend::FinishOut(outValDev, outVal, res.Nnz() * esz, tmo));
    if (bytesSent) *bytesSent = res.bytesSent;
    if (outIndices) *outNnz = res.Nnz();
    return Status::Ok();
  });
}

}  // extern "C"
