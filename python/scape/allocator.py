"""Device memory from the caller's allocator (``scapeConfig_t.deviceAllocator``).

A communicator made with ``device_allocator=...`` takes every device buffer the library
allocates for it (the temporaries of the device collectives, the device top-k and the device
optimizer step, and the device optimizer state) from a Python allocator instead of
``cudaMalloc``. The default, ``"auto"``, is torch's caching allocator (:class:`TorchAllocator`)
when torch is imported and its CUDA is available, so the memory is cached between steps by
torch, counted in ``torch.cuda.memory_allocated()`` and released by
``torch.cuda.empty_cache()``; else the library's own pool (``"library"``).

An allocator is any object with

* ``alloc(nbytes, device, stream) -> int``: the address of at least `nbytes` of device memory
  on CUDA device `device` for work the library enqueues on `stream` (a ``cudaStream_t`` as an
  int, 0: the legacy default stream); raise to fail (the library call that needed the memory
  then fails with :class:`~scape.ScapeSystemError`);
* ``free(ptr, nbytes, device, stream) -> None``: `ptr` back, with the `nbytes`, `device` and
  `stream` of its alloc; work of the library that still uses it is queued on `stream` only
  (reuse for later work on that stream is safe: torch's caching allocator's rule).

The library calls them on the thread of the call that needs the memory (alloc) or of any
later library call on the communicator (free), never concurrently for one communicator and
never from a CUDA callback; they must not call the library. An allocator is kept alive for
the rest of the process: the library may free into it until the last of the communicator,
its masks and optimizers is gone. See ``scapeDeviceAllocator_t`` in ``scape.h``.
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Dict, Optional, Union

from . import _lib
from .errors import bad_arg

__all__ = ["TorchAllocator", "resolve"]


class TorchAllocator:
    """torch's CUDA caching allocator (``torch.cuda.caching_allocator_alloc`` /
    ``caching_allocator_delete``): the block is allocated for `stream` on `device`, so torch
    reuses it only for work ordered after the library's on that stream."""

    def alloc(self, nbytes: int, device: int, stream: int) -> int:
        import torch

        return int(torch.cuda.caching_allocator_alloc(nbytes, device, stream))

    def free(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        import torch

        torch.cuda.caching_allocator_delete(ptr)


# The allocators handed to the library, by key (the `user` pointer of the C hook): kept for
# the life of the process (see the module docstring).
_registry: Dict[int, Any] = {}
_torch_allocator = TorchAllocator()


def _c_alloc(user: Optional[int], nbytes: int, device: int, stream: Optional[int],
             out: Any) -> int:
    try:
        ptr = _registry[int(user or 0)].alloc(int(nbytes), int(device), int(stream or 0))
        if not ptr:
            return 1
        out[0] = ptr
        return 0
    except BaseException:  # out of memory, or anything: the library reports the failure
        return 1


def _c_free(user: Optional[int], ptr: Optional[int], nbytes: int, device: int,
            stream: Optional[int]) -> None:
    try:
        _registry[int(user or 0)].free(int(ptr or 0), int(nbytes), int(device), int(stream or 0))
    except BaseException:  # free cannot fail in C; torch torn down at exit, for one
        pass


# One pair of C trampolines for the process (never freed: the library may call them until its
# last communicator object is gone).
_C_ALLOC = _lib.DEVICE_ALLOC_FN(_c_alloc)
_C_FREE = _lib.DEVICE_FREE_FN(_c_free)


def _torch_cuda_available() -> bool:
    torch = sys.modules.get("torch")  # not imported here: the package does not need torch
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def resolve(device_allocator: Union[str, Any, None]) -> Optional[_lib.DeviceAllocatorStruct]:
    """The C hook for a communicator's `device_allocator` argument: ``"auto"`` (or None) is
    torch's caching allocator when torch's CUDA is available, else the library's pool;
    ``"torch"`` is torch's caching allocator; ``"library"`` the library's pool (no hook,
    returns None); any other object an allocator with alloc() and free() (module docstring)."""
    if device_allocator is None or device_allocator == "auto":
        device_allocator = "torch" if _torch_cuda_available() else "library"
    if isinstance(device_allocator, str):
        if device_allocator == "library":
            return None
        if device_allocator != "torch":
            raise bad_arg("device_allocator", f"{device_allocator!r}: expected 'auto', 'torch', "
                                              "'library' or an object with alloc() and free()")
        device_allocator = _torch_allocator
    if not callable(getattr(device_allocator, "alloc", None)) or \
            not callable(getattr(device_allocator, "free", None)):
        raise bad_arg("device_allocator", f"{type(device_allocator).__name__} has no alloc() "
                                          "and free()", type_error=True)
    key = id(device_allocator)
    _registry[key] = device_allocator
    hook = _lib.DeviceAllocatorStruct()
    hook.alloc = _C_ALLOC
    hook.free = _C_FREE
    hook.user = ctypes.c_void_p(key)
    return hook
