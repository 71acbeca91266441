"""The communicator, its collectives and non-blocking requests."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import weakref
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

from . import _lib, allocator
from ._buffers import (Buf, as_buf, empty_like, expect_count, keepalive, overlaps, placement,
                       same_dtype)
from .errors import (INVALID_USAGE, SUCCESS, IN_PROGRESS, InvalidUsageError, ScapeError,
                     bad_arg, check, error_from_code)
from .types import DataType, ProgressMode, ReduceOp, SparseAlgo, to_enum

if TYPE_CHECKING:  # pragma: no cover
    from .mask import Mask

#: SCAPE_VERSION_CODE of the C header this binding was written against.
BINDING_VERSION_CODE = 100

OpLike = Union[ReduceOp, str, int]


def version() -> int:
    """SCAPE_VERSION_CODE of the library actually loaded (major*10000 + minor*100 + patch)."""
    v = c_int()
    check(_lib.lib().scapeGetVersion(byref(v)), "scapeGetVersion")
    return v.value


class UniqueId:
    """A rendezvous token (``scapeUniqueId``): create it on one process with
    :func:`get_unique_id`, send ``bytes(uid)`` to every rank (a file, a socket, torch's store,
    MPI), rebuild it there with ``UniqueId(data)``, and pass it to :class:`Communicator`.

    It holds the root's address and a random secret: treat it as a credential.
    """

    SIZE = _lib.UNIQUE_ID_BYTES

    def __init__(self, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise bad_arg("data", f"expected bytes, got {type(data).__name__}", type_error=True)
        data = bytes(data)
        if len(data) != self.SIZE:
            raise bad_arg("data", f"a unique id has {self.SIZE} bytes, got {len(data)}")
        self._data = data

    def __bytes__(self) -> bytes:
        return self._data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UniqueId) and other._data == self._data

    def __hash__(self) -> int:
        return hash(self._data)

    def __repr__(self) -> str:
        return "UniqueId(<128 bytes>)"

    def _struct(self) -> _lib.UniqueIdStruct:
        s = _lib.UniqueIdStruct()
        ctypes.memmove(byref(s), self._data, self.SIZE)
        return s


def get_unique_id() -> UniqueId:
    """Creates a rendezvous token (``scapeGetUniqueId``); call it on exactly one process per
    communicator. It starts the rendezvous root's listening socket in this process."""
    s = _lib.UniqueIdStruct()
    check(_lib.lib().scapeGetUniqueId(byref(s)), "scapeGetUniqueId", None)
    return UniqueId(ctypes.string_at(byref(s), _lib.UNIQUE_ID_BYTES))


def _config(timeout_ms: Optional[int], progress: Optional[Union[ProgressMode, str, int]],
            net_if: Optional[str], device_allocator: Any = "auto") -> Optional[_lib.ConfigStruct]:
    hook = allocator.resolve(device_allocator)
    if timeout_ms is None and progress is None and net_if is None and hook is None:
        return None
    cfg = _lib.ConfigStruct()
    cfg.size = ctypes.sizeof(_lib.ConfigStruct)
    cfg.magic = _lib.CONFIG_MAGIC
    cfg.version = BINDING_VERSION_CODE
    cfg.timeoutMs = _lib.CONFIG_UNDEF_INT
    cfg.progressMode = _lib.CONFIG_UNDEF_INT
    cfg.netIf = None
    if timeout_ms is not None:
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms <= 0:
            raise bad_arg("timeout_ms", f"expected a positive int, got {timeout_ms!r}")
        cfg.timeoutMs = timeout_ms
    if progress is not None:
        cfg.progressMode = int(to_enum(ProgressMode, progress, "progress"))
    if net_if is not None:
        if not isinstance(net_if, str) or not net_if:
            raise bad_arg("net_if", f"expected an interface name, got {net_if!r}")
        cfg.netIf = net_if.encode()
    if hook is not None:
        cfg.deviceAllocator = hook
    return cfg


BACKENDS = ("ucx", "nccl")


def _backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise bad_arg("backend", f"{backend!r}: expected 'ucx' or 'nccl'")
    return backend


@contextlib.contextmanager
def on_device(device: Optional[int]):
    """Makes `device` torch's current CUDA device for the duration of a call when torch's
    CUDA is in use and another device is current (the library allocates its device
    temporaries on the calling thread's current device); otherwise does nothing."""
    torch = sys.modules.get("torch")
    if device is None or device < 0 or torch is None:
        yield
        return
    try:
        switch = torch.cuda.is_initialized() and torch.cuda.current_device() != device
    except Exception:
        switch = False
    if not switch:
        yield
        return
    with torch.cuda.device(device):
        yield


def find_nccl_library() -> Optional[str]:
    """The NCCL library the NCCL backend will load when SCAPE_NCCL_LIBRARY is not set: an
    libnccl already loaded in this process (PyTorch's, once torch has used NCCL), else the one
    PyTorch's wheel brings (site-packages/nvidia/nccl/lib/libnccl.so.2), else None (the
    library then loads "libnccl.so.2" through the dynamic loader)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:
        pass
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for base in (list(spec.submodule_search_locations or []) if spec else []):
        cand = os.path.join(base, "lib", "libnccl.so.2")
        if os.path.exists(cand):
            return cand
    return None


def _prepare_nccl(device: Optional[int]) -> Optional[int]:
    """Before an NCCL-backend init: points SCAPE_NCCL_LIBRARY at PyTorch's NCCL when the user
    did not set it, and makes sure the CUDA device is set (with torch's CUDA: `device` if
    given, else the current device if torch's CUDA is already initialised, else LOCAL_RANK
    modulo the device count). Returns the device (None when torch's CUDA is not available)."""
    if not os.environ.get("SCAPE_NCCL_LIBRARY"):
        path = find_nccl_library()
        if path:
            os.environ["SCAPE_NCCL_LIBRARY"] = path
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)
                               or device < 0):
        raise bad_arg("device", f"expected a CUDA device index, got {device!r}")
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811
        except ImportError:
            return device
    try:
        if not torch.cuda.is_available():
            return device
    except Exception:
        return device
    if device is None:
        if torch.cuda.is_initialized():
            device = torch.cuda.current_device()
        else:
            local = os.environ.get("LOCAL_RANK")
            device = (int(local) % torch.cuda.device_count()) if local and local.isdigit() \
                else torch.cuda.current_device()
    torch.cuda.set_device(device)
    return device


@dataclass
class SparseResult:
    """Result of :meth:`Communicator.sparse_all_reduce`.

    Attributes:
        dense: the dense result (n elements) when requested, else None.
        indices: the union's sorted indices (numpy uint64) when ``as_list`` was set, else None.
        values: the union's reduced values (same kind and dtype as the input values) or None.
        nnz: size of the union.
        bytes_sent: bytes this rank sent.
    """

    dense: Any
    indices: Any
    values: Any
    nnz: int
    bytes_sent: int


class Request:
    """A non-blocking operation (``scapeRequest_t``). Complete it with :meth:`wait` (or poll
    :meth:`test`); the buffers passed to the call must stay untouched until then (the request
    keeps them alive). Progress is caller-driven: the operation advances only inside
    ``test``/``wait`` or another call on the same communicator. Every request must be completed
    before its communicator is destroyed (abort cancels them)."""

    def __init__(self, comm: "Communicator", handle: int, function: str, keep: Sequence[Any],
                 result: Any) -> None:
        self._comm = comm
        self._handle: Optional[int] = handle
        self._function = function
        self._keep = list(keep)
        self._result = result
        self._error: Optional[ScapeError] = None
        comm._requests.add(self)

    @property
    def completed(self) -> bool:
        """Whether the request has completed (successfully or not)."""
        return self._handle is None

    @property
    def result(self) -> Any:
        """The output buffer of the operation (valid once completed)."""
        return self._result

    def _finish(self, code: int) -> None:
        self._handle = None
        self._keep = []
        self._comm._requests.discard(self)
        if code != SUCCESS:
            self._error = self._comm._error(code, self._function)
            raise self._error

    def test(self) -> bool:
        """Advances the communicator; True once the operation has completed. Raises the
        operation's error (once) if it failed."""
        if self._handle is None:
            if self._error is not None:
                raise self._error
            return True
        self._comm._check_alive("Request.test")
        done = c_int(0)
        code = _lib.lib().scapeTest(self._handle, byref(done))
        if done.value:
            self._finish(code)
            return True
        if code not in (SUCCESS, IN_PROGRESS):
            raise self._comm._error(code, "scapeTest")
        return False

    def wait(self) -> Any:
        """Waits (within the communicator's timeout) and returns :attr:`result`. Raises the
        operation's error if it failed."""
        if self._handle is None:
            if self._error is not None:
                raise self._error
            return self._result
        self._comm._check_alive("Request.wait")
        code = _lib.lib().scapeWait(self._handle)
        self._finish(code)
        return self._result

    def _cancelled(self) -> None:  # the communicator was aborted: the handle is gone
        self._handle = None
        self._keep = []
        self._error = InvalidUsageError("the communicator was aborted before this request "
                                        "completed", function=self._function)

    def __repr__(self) -> str:
        return f"Request({self._function}, completed={self.completed})"


class Communicator:
    """A SCAPE communicator (``scapeComm_t``): a fixed group of ranks, one per process.

    Create it collectively, either from a unique id::

        uid = scape.get_unique_id()          # on one process; send bytes(uid) to the others
        comm = scape.Communicator(size, uid, rank)

    or from the launcher's environment (torchrun, mpirun, srun; see :meth:`from_env`).

    It is a context manager: leaving the block normally destroys it (local, does not wait for
    peers); leaving it with an exception aborts it, which tells every peer at once so that
    their pending operations fail instead of waiting for the timeout.

    Collectives take torch CPU tensors or numpy arrays, contiguous, of dtype float32, float16,
    bfloat16 (torch only), int32 or int64, and use their memory directly (zero-copy); and
    device memory the same way: torch CUDA tensors, objects with ``__cuda_array_interface__``
    (CuPy, Numba) or DLPack on a CUDA device, enqueued on the tensor's current stream (or the
    interface's) without a host wait (docs/python.md, "Device memory"). Every
    rank must issue the same collectives in the same order with the same sizes, dtypes and ops.
    A communicator is not thread-safe, except :meth:`abort`, which may be called from another
    thread to end a blocked call.

    Args:
        size: number of ranks (>= 1).
        unique_id: the token from :func:`get_unique_id`.
        rank: this process's rank, 0 <= rank < size.
        timeout_ms: deadline in ms for an operation that makes no progress (default:
            ``SCAPE_TIMEOUT_MS``, else 120000).
        progress: how ranks wait: "auto", "spin", "yield" or "blocking" (default:
            ``SCAPE_PROGRESS``).
        net_if: network interface for bootstrap and TCP, e.g. "lo" (default:
            ``SCAPE_SOCKET_IFNAME``).
        backend: "ucx" (default; ``scapeCommInitRankConfig``) or "nccl"
            (``scapeCommInitNcclRank``: the library also makes and owns an NCCL communicator
            of the same ranks; see :meth:`from_env`).
        device: the CUDA device index of this rank (see :meth:`from_env`).
        device_allocator: where the library's device memory comes from (its temporaries and
            the device optimizer state): "auto" (default: torch's caching allocator when
            torch is imported and its CUDA is available, else the library's pool), "torch",
            "library", or an object with ``alloc`` and ``free`` (:mod:`scape.allocator`).
    """

    def __init__(self, size: int, unique_id: UniqueId, rank: int, *,
                 backend: str = "ucx", device: Optional[int] = None,
                 timeout_ms: Optional[int] = None,
                 progress: Optional[Union[ProgressMode, str, int]] = None,
                 net_if: Optional[str] = None, device_allocator: Any = "auto") -> None:
        self._handle: Optional[int] = None
        self._masks: "weakref.WeakSet[Mask]" = weakref.WeakSet()
        self._requests: "weakref.WeakSet[Request]" = weakref.WeakSet()
        self._aborting = False
        self._device: Optional[int] = None
        self._backend = _backend(backend)
        if isinstance(size, bool) or not isinstance(size, int):
            raise bad_arg("size", f"expected an int, got {size!r}", type_error=True)
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise bad_arg("rank", f"expected an int, got {rank!r}", type_error=True)
        if not isinstance(unique_id, UniqueId):
            raise bad_arg("unique_id", f"expected a scape.UniqueId, got "
                                       f"{type(unique_id).__name__}", type_error=True)
        cfg = _config(timeout_ms, progress, net_if, device_allocator)
        h = c_void_p()
        L = _lib.lib()
        if self._backend == "nccl":
            self._device = _prepare_nccl(device)
            code = L.scapeCommInitNcclRank(byref(h), size, unique_id._struct(), rank,
                                           byref(cfg) if cfg is not None else None)
            check(code, "scapeCommInitNcclRank", None)
        elif cfg is None:
            code = L.scapeCommInitRank(byref(h), size, unique_id._struct(), rank)
            check(code, "scapeCommInitRank", None)
        else:
            code = L.scapeCommInitRankConfig(byref(h), size, unique_id._struct(), rank,
                                             byref(cfg))
            check(code, "scapeCommInitRank", None)
        self._handle = h.value
        if self._backend == "ucx" and device is not None:
            self._device = device
        self._init_queries()

    @classmethod
    def from_env(cls, *, backend: str = "ucx", device: Optional[int] = None,
                 timeout_ms: Optional[int] = None,
                 progress: Optional[Union[ProgressMode, str, int]] = None,
                 net_if: Optional[str] = None,
                 device_allocator: Any = "auto") -> "Communicator":
        """Joins the communicator described by the launcher's environment
        (``scapeCommInitFromEnv``; ``scapeCommInitNcclFromEnv`` for backend="nccl"): rank and
        size from RANK/WORLD_SIZE (torchrun), OMPI_COMM_WORLD_RANK/SIZE (mpirun),
        PMI_RANK/SIZE or SLURM_PROCID/NTASKS (srun). Rank 0 hosts the rendezvous at
        SCAPE_BOOTSTRAP_ADDR, else MASTER_ADDR with port MASTER_PORT + 1 (torchrun's store
        holds MASTER_PORT), else a local or Slurm default.

        Args:
            backend: "ucx" (the default: host buffers, device buffers staged through host
                memory) or "nccl" (the library makes an NCCL communicator of the same ranks
                and owns it: device buffers go to NCCL on their stream; host buffers, masks
                and barriers run on the host communicator it also joins). For "nccl" the CUDA
                device is set first (`device`, else torch's current device if its CUDA is in
                use, else LOCAL_RANK modulo the device count) and, when SCAPE_NCCL_LIBRARY is
                unset, it is pointed at the NCCL PyTorch uses (:func:`find_nccl_library`).
            device: the CUDA device index of this rank (see `backend`); for "ucx" it only
                fixes the device the communicator's device buffers must be on (else the first
                device buffer fixes it).
            timeout_ms, progress, net_if, device_allocator: as for the constructor.
        """
        self = cls.__new__(cls)
        self._handle = None
        self._masks = weakref.WeakSet()
        self._requests = weakref.WeakSet()
        self._aborting = False
        self._device = None
        self._backend = _backend(backend)
        cfg = _config(timeout_ms, progress, net_if, device_allocator)
        h = c_void_p()
        if self._backend == "nccl":
            self._device = _prepare_nccl(device)
            code = _lib.lib().scapeCommInitNcclFromEnv(byref(h), byref(cfg) if cfg is not None
                                                       else None)
            check(code, "scapeCommInitNcclFromEnv", None)
        else:
            code = _lib.lib().scapeCommInitFromEnv(byref(h), byref(cfg) if cfg is not None
                                                   else None)
            check(code, "scapeCommInitFromEnv", None)
            self._device = device
        self._handle = h.value
        self._init_queries()
        return self

    @classmethod
    def from_process_group(cls, pg: Any = None, *, backend: str = "ucx",
                           device: Optional[int] = None, timeout_ms: Optional[int] = None,
                           progress: Optional[Union[ProgressMode, str, int]] = None,
                           net_if: Optional[str] = None,
                           device_allocator: Any = "auto") -> "Communicator":
        """Makes a communicator of the ranks of a torch.distributed process group (`pg`, None
        for the default group; torch.distributed must be initialised): the group's rank 0
        makes a unique id (:func:`get_unique_id`) and it travels to the other ranks through
        the group (``torch.distributed.broadcast_object_list``), so no rendezvous variable
        is needed beyond the group's own. Collective over the group. Rank and size are the
        group's. Other arguments as for :meth:`from_env`."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise bad_arg("pg", "torch.distributed is not initialised (call "
                                "torch.distributed.init_process_group first)")
        _backend(backend)
        rank = dist.get_rank(pg)
        size = dist.get_world_size(pg)
        if rank < 0:
            raise bad_arg("pg", "this process is not a member of the group")
        if pg is None:
            src = 0
        elif hasattr(dist, "get_global_rank"):
            src = dist.get_global_rank(pg, 0)
        else:  # torch < 2.0
            from torch.distributed import distributed_c10d as c10d

            src = c10d._get_global_rank(pg, 0)
        if backend == "nccl":
            # An NCCL process group moves the object through the current CUDA device.
            device = _prepare_nccl(device)
        box = [bytes(get_unique_id()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=src, group=pg)
        if not isinstance(box[0], (bytes, bytearray)):
            raise InvalidUsageError("the unique id did not arrive through the process group",
                                    function="from_process_group")
        return cls(size, UniqueId(box[0]), rank, backend=backend, device=device,
                   timeout_ms=timeout_ms, progress=progress, net_if=net_if,
                   device_allocator=device_allocator)

    def _init_queries(self) -> None:
        n, r = c_int(), c_int()
        L = _lib.lib()
        check(L.scapeCommCount(self._handle, byref(n)), "scapeCommCount", self._handle)
        check(L.scapeCommUserRank(self._handle, byref(r)), "scapeCommUserRank", self._handle)
        self._size, self._rank = n.value, r.value

    # -- lifetime ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._size

    @property
    def backend(self) -> str:
        """"ucx" or "nccl" (``scapeCommGetBackend``)."""
        h = self._check_alive("scapeCommGetBackend")
        b = c_int()
        self._call("scapeCommGetBackend", h, byref(b))
        return BACKENDS[b.value]

    @property
    def device(self) -> Optional[int]:
        """The CUDA device this communicator's device buffers must be on: the device set at
        an NCCL-backend init, the `device` argument, or the device of the first device
        buffer passed to it; None while none is known."""
        return self._device

    @property
    def alive(self) -> bool:
        """False once destroyed or aborted (or while an abort is under way)."""
        return self._handle is not None and not self._aborting

    def _check_alive(self, what: str) -> int:
        if self._handle is None or self._aborting:
            raise InvalidUsageError("the communicator was destroyed or aborted", function=what)
        return self._handle

    def _error(self, code: int, function: str) -> ScapeError:
        if self._aborting:
            return InvalidUsageError("the communicator was aborted while this call was in "
                                     "progress", function=function, code=INVALID_USAGE)
        return error_from_code(code, function, self._handle)

    def _call(self, function: str, *args: Any) -> None:
        self._check_alive(function)
        code = getattr(_lib.lib(), function)(*args)
        if code != SUCCESS:
            raise self._error(code, function)

    def async_error(self) -> Optional[ScapeError]:
        """None while the communicator is usable, else the error that broke it (as an
        exception object, not raised). Does not communicate."""
        h = self._check_alive("scapeCommGetAsyncError")
        e = c_int()
        self._call("scapeCommGetAsyncError", h, byref(e))
        if e.value == SUCCESS:
            return None
        return error_from_code(e.value, "scapeCommGetAsyncError", h)

    def destroy(self) -> None:
        """Destroys the communicator (local; does not wait for peers). Masks still alive are
        destroyed first, and so are the library optimizers of :class:`scape.optim.ScapeAdamS`
        objects built on it. Raises InvalidUsageError while non-blocking requests are pending
        (complete them, or use :meth:`abort`). A second call, or a call after :meth:`abort`,
        is a no-op."""
        if self._handle is None or self._aborting:
            return
        for m in list(self._masks):
            m.destroy()
        pending = [r for r in self._requests if not r.completed]
        if pending:
            raise InvalidUsageError(f"{len(pending)} non-blocking request(s) are not complete; "
                                    f"wait for them or call abort()",
                                    function="scapeCommDestroy")
        code = _lib.lib().scapeCommDestroy(self._handle)
        if code != SUCCESS:
            raise self._error(code, "scapeCommDestroy")
        self._handle = None

    def abort(self) -> None:
        """Abandons the communicator at once from any state (``scapeCommAbort``): tells every
        peer, cancels pending requests and frees its masks and optimizers. Safe to call from another thread
        while a call on this communicator is blocked; that call raises InvalidUsageError.
        A second call is a no-op."""
        h = self._handle
        if h is None or self._aborting:
            return
        self._aborting = True
        _lib.lib().scapeCommAbort(h)
        self._handle = None
        for m in list(self._masks):
            m._forget()
        for r in list(self._requests):
            r._cancelled()

    close = destroy

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.destroy()
        else:
            self.abort()

    def __del__(self) -> None:
        # Best effort at garbage collection: destroy if possible, else abort (never raise).
        try:
            if self._handle is not None:
                try:
                    self.destroy()
                except Exception:
                    self.abort()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"Communicator(rank={getattr(self, '_rank', '?')}, " \
               f"size={getattr(self, '_size', '?')}, {state})"

    # -- collectives ---------------------------------------------------------------------

    def _issue(self, function: str, async_op: bool, keep: Sequence[Any], result: Any,
               *args: Any, device: Optional[int] = None) -> Any:
        self._check_alive(function)
        L = _lib.lib()
        with on_device(device):
            if async_op:
                req = c_void_p()
                code = getattr(L, function + "Async")(*args, byref(req))
                if code != SUCCESS:
                    raise self._error(code, function + "Async")
                return Request(self, req.value, function, keep, result)
            code = getattr(L, function)(*args)
        if code != SUCCESS:
            raise self._error(code, function)
        return result

    def all_reduce(self, send: Any, recv: Any = None, *, op: OpLike = ReduceOp.SUM,
                   mask: Optional["Mask"] = None, async_op: bool = False) -> Any:
        """All-reduce: ``recv[i] = op over ranks of send[i]``.

        Args:
            send: the input (torch CPU tensor or numpy array, contiguous).
            recv: the output, same kind, dtype and number of elements; None means in place
                (the result overwrites `send`).
            op: "sum", "avg", "max" or "min" (or a :class:`ReduceOp`).
            mask: an agreed :class:`~scape.Mask` of this communicator for the SCAPE sparse
                exchange (values only): `send` must have the mask's n elements; only the
                current mask's positions are reduced and written, every other element of
                `recv` is left untouched.
            async_op: return a :class:`Request` instead of waiting.

        Returns:
            `recv` (or `send` in place), or a Request whose ``result`` it is.
        """
        s = as_buf(send, "send", writable=recv is None)
        r = s if recv is None else as_buf(recv, "recv", writable=True)
        if r is not s:
            same_dtype(s, "send", r, "recv")
            expect_count(r, "recv", s.count, "the same as send")
            if r.ptr != s.ptr and overlaps(s, r):
                raise bad_arg("recv", "overlaps send without being the same buffer")
        o = to_enum(ReduceOp, op, "op")
        mh = None
        if mask is not None:
            from .mask import Mask

            if not isinstance(mask, Mask):
                raise bad_arg("mask", f"expected a scape.Mask or None, got "
                                      f"{type(mask).__name__}", type_error=True)
            if mask._comm is not self:
                raise bad_arg("mask", "was created on another communicator")
            mh = mask._check_alive("scapeAllReduce")
            expect_count(s, "send", mask.n, "the mask's n")
        dev, stream = placement([(s, "send"), (r, "recv")], self)
        out = recv if recv is not None else send
        return self._issue("scapeAllReduce", async_op, keepalive(s, r) + [mask], out, s.ptr,
                           r.ptr, s.count, int(s.dtype), int(o), mh, self._handle, stream,
                           device=dev)

    def reduce_scatter(self, send: Any, recv: Any = None, *, op: OpLike = ReduceOp.SUM,
                       async_op: bool = False) -> Any:
        """Reduce-scatter: `send` holds ``size * m`` elements; this rank receives in `recv`
        (m elements) the reduction over ranks of block ``rank`` (elements
        ``[rank*m, (rank+1)*m)``). `recv` None allocates it. Returns `recv` (or a Request)."""
        s = as_buf(send, "send")
        if recv is None:
            if s.count % self.size:
                raise bad_arg("send", f"has {s.count} elements, not a multiple of the "
                                      f"communicator size {self.size}")
            recv = empty_like(s, s.count // self.size)
        r = as_buf(recv, "recv", writable=True)
        same_dtype(s, "send", r, "recv")
        expect_count(s, "send", r.count * self.size, f"size ({self.size}) * len(recv)")
        o = to_enum(ReduceOp, op, "op")
        dev, stream = placement([(s, "send"), (r, "recv")], self)
        return self._issue("scapeReduceScatter", async_op, keepalive(s, r), recv, s.ptr, r.ptr,
                           r.count, int(s.dtype), int(o), self._handle, stream, device=dev)

    def all_gather(self, send: Any, recv: Any = None, *, async_op: bool = False) -> Any:
        """All-gather: every rank contributes `send` (m elements); `recv` (``size * m``
        elements, allocated when None) receives rank r's block at offset ``r * m`` on every
        rank. Returns `recv` (or a Request)."""
        s = as_buf(send, "send")
        if recv is None:
            recv = empty_like(s, s.count * self.size)
        r = as_buf(recv, "recv", writable=True)
        same_dtype(s, "send", r, "recv")
        expect_count(r, "recv", s.count * self.size, f"size ({self.size}) * len(send)")
        dev, stream = placement([(s, "send"), (r, "recv")], self)
        return self._issue("scapeAllGather", async_op, keepalive(s, r), recv, s.ptr, r.ptr,
                           s.count, int(s.dtype), self._handle, stream, device=dev)

    def broadcast(self, buf: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Broadcast in place: the root's `buf` is copied into `buf` on every other rank.
        Every rank passes a buffer of the same size and dtype. Returns `buf` (or a Request)."""
        b = as_buf(buf, "buf", writable=True)
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise bad_arg("root", f"{root!r} is not a rank of this communicator "
                                  f"(0..{self.size - 1})")
        dev, stream = placement([(b, "buf")], self)
        return self._issue("scapeBroadcast", async_op, keepalive(b), buf, b.ptr, b.ptr, b.count,
                           int(b.dtype), root, self._handle, stream, device=dev)

    def barrier(self, *, async_op: bool = False) -> Optional[Request]:
        """Returns once every rank has entered the barrier (or a Request)."""
        h = self._check_alive("scapeBarrier")
        L = _lib.lib()
        if async_op:
            req = c_void_p()
            code = L.scapeBarrierAsync(h, byref(req))
            if code != SUCCESS:
                raise self._error(code, "scapeBarrierAsync")
            return Request(self, req.value, "scapeBarrier", (), None)
        code = L.scapeBarrier(h)
        if code != SUCCESS:
            raise self._error(code, "scapeBarrier")
        return None

    def sparse_all_reduce(self, indices: Any, values: Any, n: int, *, op: OpLike = ReduceOp.SUM,
                          algo: Union[SparseAlgo, str, int] = SparseAlgo.AUTO,
                          out: Any = None, dense: bool = True,
                          as_list: bool = False) -> SparseResult:
        """Sparse all-reduce of (index, value) lists (``scapeSparseAllReduce``), no agreed
        mask: every rank brings sorted, distinct indices below `n` with their values; the
        result is the union with values reduced ("sum" or "avg"; a missing index counts as 0),
        identical on every rank.

        Args:
            indices: numpy uint64/int64 array or torch int64 tensor (nnz elements).
            values: float32, float16 or bfloat16 values (nnz elements).
            n: length of the dense vector.
            op: "sum" or "avg".
            algo: "auto", "all_gather" or "recursive_doubling".
            out: dense output (n elements, same dtype as values), allocated when None and
                `dense` is set; every element is written.
            dense: produce the dense result.
            as_list: also return the union as (indices, values).
        """
        import numpy as np

        ib = _index_buf(indices, "indices")
        vb = as_buf(values, "values", device_ok=False)
        if vb.dtype not in (DataType.FLOAT32, DataType.FLOAT16, DataType.BFLOAT16):
            raise bad_arg("values", f"dtype must be float32, float16 or bfloat16, got "
                                    f"{vb.dtype.label}", type_error=True)
        expect_count(vb, "values", ib.count, "the same as indices")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad_arg("n", f"expected a non-negative int, got {n!r}")
        o = to_enum(ReduceOp, op, "op")
        a = to_enum(SparseAlgo, algo, "algo")
        if not dense and not as_list:
            raise bad_arg("dense", "nothing requested: set dense or as_list")
        ob = None
        if dense:
            if out is None:
                out = empty_like(vb, n)
            ob = as_buf(out, "out", writable=True, device_ok=False)
            same_dtype(vb, "values", ob, "out")
            expect_count(ob, "out", n, "n")
        else:
            out = None
        oi = ov = None
        cap = 0
        if as_list:
            cap = min(n, ib.count * self.size)
            oi = np.empty(cap, dtype=np.uint64)
            ov = empty_like(vb, cap)
        ovb = as_buf(ov, "out_values") if ov is not None else None
        nnz = c_size_t(0)
        sent = c_uint64(0)
        u64p = ctypes.POINTER(c_uint64)
        ip = ctypes.cast(ib.ptr, u64p) if ib.ptr else None
        oip = oi.ctypes.data_as(u64p) if oi is not None and cap else None
        self._call("scapeSparseAllReduce", ip, vb.ptr, ib.count, n, int(vb.dtype), int(o),
                   int(a), ob.ptr if ob else None, oip, ovb.ptr if ovb else None, cap,
                   byref(nnz), byref(sent), self._check_alive("scapeSparseAllReduce"))
        k = nnz.value
        if as_list:
            oi = oi[:k]
            ov = ov[:k]
        return SparseResult(out, oi, ov, k, sent.value)

    def create_mask(self, segments: Sequence[int], *, dense: Optional[Sequence[bool]] = None,
                    ownership: Any = "shards", encoding: Any = "auto") -> "Mask":
        """Shorthand for ``scape.Mask(self, segments, ...)``."""
        from .mask import Mask

        return Mask(self, segments, dense=dense, ownership=ownership, encoding=encoding)


def _index_buf(obj: Any, name: str) -> Buf:
    """A contiguous 64-bit index buffer: numpy uint64/int64 or torch int64."""
    import sys

    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray) and obj.dtype == np.uint64:
        if not obj.flags["C_CONTIGUOUS"]:
            raise bad_arg(name, "array is not C-contiguous")
        return Buf(obj, obj.ctypes.data if obj.size else None, int(obj.size), DataType.INT64,
                   "numpy")
    b = as_buf(obj, name, device_ok=False)
    if b.dtype != DataType.INT64:
        raise bad_arg(name, f"indices must be uint64 or int64, got {b.dtype.label}",
                      type_error=True)
    return b


__all__: List[str] = ["Communicator", "Request", "UniqueId", "SparseResult", "get_unique_id",
                      "version", "find_nccl_library"]
