"""Agreed masks: the SCAPE sparse exchange (``scapeMask_t``)."""
from __future__ import annotations

import ctypes
from ctypes import byref, c_int, c_size_t, c_uint8, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._buffers import as_buf, empty_like, expect_count, keepalive, placement, same_dtype
from .comm import Communicator, OpLike, Request
from .errors import SUCCESS, IN_PROGRESS, InvalidUsageError, bad_arg
from .types import DataType, MaskEncoding, Ownership, ReduceOp, to_enum

_u64p = ctypes.POINTER(c_uint64)


def _stream_form(function: str) -> str:
    """The *Stream form of a mask call that otherwise runs on the default stream (device
    buffers must go on their own stream); a library without it is refused, not silently run on
    the default stream."""
    name = function + "Stream"
    if not _lib.has_symbol(name):
        raise InvalidUsageError(f"the loaded library {_lib.library_path()} has no {name}: "
                                f"rebuild it (device buffers must run on their stream)",
                                function=function)
    return name


@dataclass
class SyncInfo:
    """What the last completed mask sync cost this rank (``scapeMaskGetSyncInfo``).

    Attributes:
        encoding: the encoding this rank sent.
        sent_bytes: encoded bytes of this rank's part.
        total_bytes: encoded bytes of all parts (what each rank received).
        bytes_by_encoding: this rank's part in each encoding (keys: MaskEncoding members
            other than AUTO).
        sync_seconds: from sync_start to completion, in the background.
    """

    encoding: MaskEncoding
    sent_bytes: int
    total_bytes: int
    bytes_by_encoding: Dict[MaskEncoding, int]
    sync_seconds: float


class Mask:
    """An agreed mask over a flat buffer of ``n = sum(segments)`` elements.

    It holds two masks: the *current* one, used by the values-only collectives of this step,
    and the *next* one, which each rank sets for the part it owns (:meth:`select_next_topk` or
    :meth:`set_next_indices`) and all-gathers in the background (:meth:`sync_start` ..
    :meth:`sync_wait`). :meth:`advance` makes next current, so the mask chosen at step t is
    used at step t + 1. Both start empty.

    Creation is collective over `comm`: every rank passes the same layout (checked).

    Args:
        comm: the communicator whose ranks share the mask.
        segments: the segment lengths (tensors of the flat buffer), at least one.
        dense: optional flags, one per segment: True marks a segment that is always fully
            selected (norms, biases).
        ownership: "shards" (size contiguous equal shards, for a sharded optimizer) or
            "segments" (whole segments balanced by size, for a replicated one).
        encoding: wire encoding of each sync: "auto" (smallest per rank and sync), "bitmap",
            "indices", "elias_fano" or "delta_varint".

    Use it as a context manager, or call :meth:`destroy`; the communicator destroys masks
    still alive when it is destroyed, and :meth:`Communicator.abort` frees them.
    """

    def __init__(self, comm: Communicator, segments: Sequence[int], *,
                 dense: Optional[Sequence[bool]] = None,
                 ownership: Union[Ownership, str, int] = Ownership.SHARDS,
                 encoding: Union[MaskEncoding, str, int] = MaskEncoding.AUTO) -> None:
        self._handle: Optional[int] = None
        if not isinstance(comm, Communicator):
            raise bad_arg("comm", f"expected a scape.Communicator, got {type(comm).__name__}",
                          type_error=True)
        try:
            lengths = [int(x) for x in segments]
        except (TypeError, ValueError):
            raise bad_arg("segments", "expected a sequence of segment lengths",
                          type_error=True) from None
        if not lengths:
            raise bad_arg("segments", "needs at least one segment")
        if any(x < 0 for x in lengths):
            raise bad_arg("segments", "segment lengths must be >= 0")
        offsets = [0]
        for x in lengths:
            offsets.append(offsets[-1] + x)
        flags = None
        if dense is not None:
            dense = list(dense)
            if len(dense) != len(lengths):
                raise bad_arg("dense", f"has {len(dense)} flags for {len(lengths)} segments")
            flags = (c_uint8 * len(dense))(*[1 if d else 0 for d in dense])
        own = to_enum(Ownership, ownership, "ownership")
        enc = to_enum(MaskEncoding, encoding, "encoding")
        offs = (c_uint64 * len(offsets))(*offsets)
        h = c_void_p()
        comm._call("scapeMaskCreate", byref(h), offsets[-1], len(lengths), offs, flags, int(own),
                   int(enc), comm._check_alive("scapeMaskCreate"))
        self._handle = h.value
        self._comm = comm
        self._n = offsets[-1]
        self._offsets = offsets
        self._dense = [bool(d) for d in dense] if dense is not None else [False] * len(lengths)
        self._ownership = own
        self._encoding = enc
        comm._masks.add(self)

    # -- lifetime ------------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Length of the flat buffer."""
        return self._n

    @property
    def offsets(self) -> List[int]:
        """Segment offsets (nsegments + 1 values)."""
        return list(self._offsets)

    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def alive(self) -> bool:
        return self._handle is not None

    def _check_alive(self, what: str) -> int:
        if self._handle is None:
            raise InvalidUsageError("the mask was destroyed (or its communicator aborted)",
                                    function=what)
        return self._handle

    def _call(self, function: str, *args: Any) -> None:
        self._check_alive(function)
        self._comm._call(function, *args)

    def destroy(self) -> None:
        """Destroys the mask (waits, within the timeout, for a sync in flight)."""
        if self._handle is None:
            return
        h, self._handle = self._handle, None
        self._comm._masks.discard(self)
        if self._comm.alive:
            self._comm._call("scapeMaskDestroy", h)

    def _forget(self) -> None:  # the communicator was aborted: the library freed the mask
        self._handle = None

    def __enter__(self) -> "Mask":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Mask(n={self._n}, segments={len(self._offsets) - 1}, " \
               f"ownership={self._ownership.name.lower()}, alive={self.alive})"

    # -- the next mask -------------------------------------------------------------------

    def owned_ranges(self, rank: Optional[int] = None) -> List[Tuple[int, int]]:
        """The [begin, end) ranges of the flat buffer that `rank` (default: this rank) owns."""
        r = self._comm.rank if rank is None else rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._comm.size:
            raise bad_arg("rank", f"{rank!r} is not a rank of the communicator")
        h = self._check_alive("scapeMaskGetOwnedRanges")
        cnt = c_size_t(0)
        self._call("scapeMaskGetOwnedRanges", h, r, None, 0, byref(cnt))
        buf = (c_uint64 * (2 * max(cnt.value, 1)))()
        self._call("scapeMaskGetOwnedRanges", h, r, buf, cnt.value, byref(cnt))
        return [(int(buf[2 * i]), int(buf[2 * i + 1])) for i in range(cnt.value)]

    def set_next_indices(self, indices: Any) -> None:
        """Sets this rank's owned part of the next mask from sorted, strictly increasing global
        indices inside its owned ranges (a sequence, numpy array or torch tensor). Positions
        of always-dense segments are added by the library. Local."""
        import numpy as np

        if hasattr(indices, "numpy") and hasattr(indices, "device"):
            indices = indices.cpu().numpy()
        try:
            arr = np.ascontiguousarray(indices, dtype=np.uint64)
        except (TypeError, ValueError, OverflowError):
            raise bad_arg("indices", "expected non-negative integers", type_error=True) from None
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        h = self._check_alive("scapeMaskSetNextIndices")
        self._call("scapeMaskSetNextIndices", h,
                   arr.ctypes.data_as(_u64p) if arr.size else None, int(arr.size))

    def select_next_topk(self, statistic: Any, density: float) -> None:
        """Selects this rank's owned part of the next mask by top-k of ``|statistic|`` per
        segment piece: ``k = max(1, floor(density * length))``; always-dense segments entirely.
        `statistic` is the full flat float32 buffer (n elements; only the owned part is read).
        Deterministic and local."""
        s = as_buf(statistic, "statistic", dtype=DataType.FLOAT32)
        expect_count(s, "statistic", self._n, "the mask's n")
        try:
            d = float(density)
        except (TypeError, ValueError):
            raise bad_arg("density", f"expected a float, got {density!r}",
                          type_error=True) from None
        if not 0.0 < d <= 1.0:
            raise bad_arg("density", f"{density!r} is outside (0, 1]")
        dev, stream = placement([(s, "statistic")], self._comm)
        h = self._check_alive("scapeMaskSelectNextTopk")
        from .comm import on_device

        with on_device(dev):
            if dev is not None:
                # On the statistic's stream (torch's current one for a torch tensor), after the
                # work that wrote it: the default stream is not ordered with a non-blocking one.
                self._call(_stream_form("scapeMaskSelectNextTopk"), h, s.ptr, d, stream)
            else:
                self._call("scapeMaskSelectNextTopk", h, s.ptr, d)

    def sync_start(self) -> None:
        """Starts the background all-gather of every rank's part of the next mask.
        Collective: all ranks start their syncs in the same order. Returns at once."""
        self._call("scapeMaskSyncStart", self._check_alive("scapeMaskSyncStart"))

    def sync_test(self) -> bool:
        """True when the sync started last has completed (raises its error if it failed)."""
        h = self._check_alive("scapeMaskSyncTest")
        done = c_int(0)
        code = _lib.lib().scapeMaskSyncTest(h, byref(done))
        if done.value:
            if code != SUCCESS:
                raise self._comm._error(code, "scapeMaskSyncTest")
            return True
        if code not in (SUCCESS, IN_PROGRESS):
            raise self._comm._error(code, "scapeMaskSyncTest")
        return False

    def sync_wait(self) -> None:
        """Waits (within the timeout) for the sync in flight; returns at once if none."""
        self._call("scapeMaskSyncWait", self._check_alive("scapeMaskSyncWait"))

    def advance(self) -> None:
        """Makes the synchronised next mask current (local, O(1))."""
        self._call("scapeMaskAdvance", self._check_alive("scapeMaskAdvance"))

    # -- the current mask ----------------------------------------------------------------

    @property
    def count(self) -> int:
        """Number of positions in the current mask (all ranks' parts)."""
        k = c_uint64()
        self._call("scapeMaskGetCount", self._check_alive("scapeMaskGetCount"), byref(k))
        return int(k.value)

    def rank_count(self, rank: Optional[int] = None) -> Tuple[int, int]:
        """(count, offset) of `rank`'s part (default: this rank) of the current mask in mask
        order."""
        r = self._comm.rank if rank is None else rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._comm.size:
            raise bad_arg("rank", f"{rank!r} is not a rank of the communicator")
        k, off = c_uint64(), c_uint64()
        self._call("scapeMaskGetRankCount", self._check_alive("scapeMaskGetRankCount"), r,
                   byref(k), byref(off))
        return int(k.value), int(off.value)

    def indices(self) -> Any:
        """The current mask's global indices in mask order (numpy uint64 array)."""
        import numpy as np

        k = self.count
        out = np.empty(k, dtype=np.uint64)
        self._call("scapeMaskGetIndices", self._check_alive("scapeMaskGetIndices"),
                   out.ctypes.data_as(_u64p) if k else None, k)
        return out

    def sync_info(self) -> SyncInfo:
        """What the last completed sync cost this rank."""
        info = _lib.MaskSyncInfoStruct()
        self._call("scapeMaskGetSyncInfo", self._check_alive("scapeMaskGetSyncInfo"),
                   byref(info))
        by = {MaskEncoding(i): int(info.bytesByEncoding[i])
              for i in range(1, _lib.NUM_MASK_ENCODINGS)}
        return SyncInfo(MaskEncoding(info.encoding), int(info.sentBytes), int(info.totalBytes),
                        by, float(info.syncSeconds))

    # -- pack / unpack and values-only collectives ---------------------------------------

    def pack(self, dense: Any, packed: Any = None) -> Any:
        """Gathers `dense` (n elements) at the current mask's positions into `packed` (count
        elements, mask order; allocated when None). Returns `packed`. Local."""
        d = as_buf(dense, "dense")
        expect_count(d, "dense", self._n, "the mask's n")
        k = self.count
        if packed is None:
            packed = empty_like(d, k)
        p = as_buf(packed, "packed", writable=True)
        same_dtype(d, "dense", p, "packed")
        expect_count(p, "packed", k, "the current mask's count")
        dev, stream = placement([(d, "dense"), (p, "packed")], self._comm)
        from .comm import on_device

        h = self._check_alive("scapeMaskPack")
        with on_device(dev):
            if dev is not None:  # on the buffers' stream (torch: the current stream)
                self._call(_stream_form("scapeMaskPack"), h, d.ptr, p.ptr, int(d.dtype), stream)
            else:
                self._call("scapeMaskPack", h, d.ptr, p.ptr, int(d.dtype))
        return packed

    def unpack(self, packed: Any, dense: Any) -> Any:
        """Writes `packed` (count elements, mask order) back to their positions in `dense`
        (n elements); every other element is untouched. Returns `dense`. Local."""
        p = as_buf(packed, "packed")
        d = as_buf(dense, "dense", writable=True)
        same_dtype(p, "packed", d, "dense")
        expect_count(d, "dense", self._n, "the mask's n")
        expect_count(p, "packed", self.count, "the current mask's count")
        dev, stream = placement([(p, "packed"), (d, "dense")], self._comm)
        from .comm import on_device

        h = self._check_alive("scapeMaskUnpack")
        with on_device(dev):
            if dev is not None:  # on the buffers' stream (torch: the current stream)
                self._call(_stream_form("scapeMaskUnpack"), h, p.ptr, d.ptr, int(d.dtype), stream)
            else:
                self._call("scapeMaskUnpack", h, p.ptr, d.ptr, int(d.dtype))
        return dense

    def _coll(self, function: str, async_op: bool, bufs: Sequence[Any], result: Any,
              *args: Any) -> Any:
        """bufs: (Buf, argument name) pairs: checked for placement, kept alive."""
        from .comm import on_device

        h = self._check_alive(function)
        L = _lib.lib()
        c = self._comm
        ch = c._check_alive(function)
        dev, stream = placement(bufs, c)
        keep = keepalive(*(b for b, _ in bufs))
        with on_device(dev):
            if async_op:
                req = c_void_p()
                code = getattr(L, function + "Async")(*args, h, ch, stream, byref(req))
                if code != SUCCESS:
                    raise c._error(code, function + "Async")
                return Request(c, req.value, function, tuple(keep) + (self,), result)
            code = getattr(L, function)(*args, h, ch, stream)
        if code != SUCCESS:
            raise c._error(code, function)
        return result

    def all_reduce_packed(self, send: Any, recv: Any = None, *, op: OpLike = ReduceOp.AVG,
                          async_op: bool = False) -> Any:
        """All-reduce of the current mask's count packed values (mask order); `recv` None
        means in place. Gives the same bits as reduce_scatter + all_gather. Returns `recv`
        (or a Request)."""
        s = as_buf(send, "send", writable=recv is None)
        r = s if recv is None else as_buf(recv, "recv", writable=True)
        k = self.count
        expect_count(s, "send", k, "the current mask's count")
        if r is not s:
            same_dtype(s, "send", r, "recv")
            expect_count(r, "recv", k, "the current mask's count")
        o = to_enum(ReduceOp, op, "op")
        out = send if recv is None else recv
        return self._coll("scapeMaskAllReducePacked", async_op, [(s, "send"), (r, "recv")],
                          out, s.ptr, r.ptr, int(s.dtype), int(o))

    def reduce_scatter(self, send: Any, recv: Any = None, *, op: OpLike = ReduceOp.AVG,
                       async_op: bool = False) -> Any:
        """`send` holds the count packed values (mask order); this rank receives in `recv`
        its own part (``rank_count()[0]`` values, allocated when None) reduced over all
        ranks. Returns `recv` (or a Request)."""
        s = as_buf(send, "send")
        expect_count(s, "send", self.count, "the current mask's count")
        kr, _ = self.rank_count()
        if recv is None:
            recv = empty_like(s, kr)
        r = as_buf(recv, "recv", writable=True)
        same_dtype(s, "send", r, "recv")
        expect_count(r, "recv", kr, "this rank's part of the current mask")
        o = to_enum(ReduceOp, op, "op")
        return self._coll("scapeMaskReduceScatter", async_op, [(s, "send"), (r, "recv")],
                          recv, s.ptr, r.ptr, int(s.dtype), int(o))

    def all_gather(self, send: Any, recv: Any = None, *, async_op: bool = False) -> Any:
        """This rank contributes its part (``rank_count()[0]`` values); every rank receives
        all count values in mask order in `recv` (allocated when None). Returns `recv` (or a
        Request)."""
        s = as_buf(send, "send")
        kr, _ = self.rank_count()
        expect_count(s, "send", kr, "this rank's part of the current mask")
        k = self.count
        if recv is None:
            recv = empty_like(s, k)
        r = as_buf(recv, "recv", writable=True)
        same_dtype(s, "send", r, "recv")
        expect_count(r, "recv", k, "the current mask's count")
        return self._coll("scapeMaskAllGather", async_op, [(s, "send"), (r, "recv")], recv,
                          s.ptr, r.ptr, int(s.dtype))
