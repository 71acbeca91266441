"""Zero-copy views of torch CPU tensors and numpy arrays as (pointer, count, dtype).

Neither torch nor numpy is imported here unless the caller passed one of their objects: the
communicator works with numpy alone, and with torch alone.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

from .errors import bad_arg
from .types import DataType

# dtype -> DataType maps, built at first use (keyed by numpy's dtype number and by torch's
# dtype objects: the cheapest lookups, this runs on every collective call). numpy has no
# bfloat16: pass a torch tensor for bf16.
_NUMPY: dict = {}
_TORCH: dict = {}


def _numpy_map(np) -> dict:
    if not _NUMPY:
        kinds = {("f", 4): DataType.FLOAT32, ("f", 2): DataType.FLOAT16,
                 ("i", 4): DataType.INT32, ("i", 8): DataType.INT64}
        for t in (np.float32, np.float16, np.int32, np.int64, np.intc, np.int_, np.longlong):
            d = np.dtype(t)
            if (d.kind, d.itemsize) in kinds:
                _NUMPY[d.num] = kinds[(d.kind, d.itemsize)]
    return _NUMPY


def _torch_map(torch) -> dict:
    if not _TORCH:
        _TORCH.update({torch.float32: DataType.FLOAT32, torch.float16: DataType.FLOAT16,
                       torch.bfloat16: DataType.BFLOAT16, torch.int32: DataType.INT32,
                       torch.int64: DataType.INT64})
    return _TORCH


@dataclass
class Buf:
    """A buffer as the C API sees it. `obj` keeps the Python object alive."""

    obj: Any
    ptr: Optional[int]
    count: int
    dtype: DataType
    kind: str  # "torch" or "numpy"


def is_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_numpy(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def as_buf(obj: Any, name: str, *, writable: bool = False,
           dtype: Optional[DataType] = None) -> Buf:
    """Checks `obj` (named `name` in errors) and returns its Buf.

    Raises InvalidArgumentError / ArgumentTypeError naming `name` when obj is not a torch CPU
    tensor or numpy array, is not contiguous, has a dtype the library does not reduce, is not
    writable where it must be, or has not the dtype `dtype` (when given).
    """
    if is_torch(obj):
        torch = sys.modules["torch"]
        if obj.layout is not torch.strided:
            raise bad_arg(name, f"layout {obj.layout} is not supported (dense tensors only)",
                          type_error=True)
        if not obj.is_cpu:
            raise bad_arg(name, f"tensor is on device {obj.device}; the binding moves host "
                                f"memory only (use a CPU tensor)")
        dt = _torch_map(torch).get(obj.dtype)
        if dt is None:
            raise bad_arg(name, f"dtype {obj.dtype} is not supported (float32, float16, "
                                f"bfloat16, int32, int64)", type_error=True)
        if not obj.is_contiguous():
            raise bad_arg(name, "tensor is not contiguous (call .contiguous() and copy back, "
                                "or pass a contiguous buffer)")
        n = obj.numel()
        ptr = obj.data_ptr() if n else None
        kind = "torch"
    elif is_numpy(obj):
        dt = _numpy_map(sys.modules["numpy"]).get(obj.dtype.num)
        if dt is None:
            raise bad_arg(name, f"dtype {obj.dtype} is not supported (float32, float16, int32, "
                                f"int64; bfloat16 needs a torch tensor)", type_error=True)
        flags = obj.flags
        if not flags.c_contiguous:
            raise bad_arg(name, "array is not C-contiguous (use numpy.ascontiguousarray and "
                                "copy back, or pass a contiguous buffer)")
        if writable and not flags.writeable:
            raise bad_arg(name, "array is read-only but the call writes into it")
        n = int(obj.size)
        ptr = obj.ctypes.data if n else None
        kind = "numpy"
    else:
        raise bad_arg(name, f"expected a torch CPU tensor or a numpy array, got "
                            f"{type(obj).__name__}", type_error=True)
    if dtype is not None and dt != dtype:
        raise bad_arg(name, f"dtype must be {dtype.label} here, got {dt.label}",
                      type_error=True)
    return Buf(obj, ptr, n, dt, kind)


def same_dtype(a: Buf, an: str, b: Buf, bn: str) -> None:
    if a.dtype != b.dtype:
        raise bad_arg(bn, f"dtype {b.dtype.label} differs from {an}'s {a.dtype.label}",
                      type_error=True)


def expect_count(b: Buf, name: str, count: int, what: str) -> None:
    if b.count != count:
        raise bad_arg(name, f"has {b.count} elements, expected {count} ({what})")


def empty_like(b: Buf, count: int) -> Any:
    """A new contiguous buffer of the same kind and dtype as `b`, with `count` elements."""
    if b.kind == "torch":
        import torch

        return torch.empty(count, dtype=b.obj.dtype)
    import numpy as np

    return np.empty(count, dtype=b.obj.dtype)


def overlaps(a: Buf, b: Buf) -> bool:
    """Whether two buffers share any byte."""
    if not a.ptr or not b.ptr or not a.count or not b.count:
        return False
    sa = a.count * a.dtype.size
    sb = b.count * b.dtype.size
    return a.ptr < b.ptr + sb and b.ptr < a.ptr + sa
