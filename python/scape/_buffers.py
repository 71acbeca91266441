"""Zero-copy views of buffers as (pointer, count, dtype): host memory (torch CPU tensors,
numpy arrays, CPU DLPack objects) and device memory (torch CUDA tensors, any object exposing
``__cuda_array_interface__`` such as CuPy or Numba arrays, and DLPack objects on a CUDA
device).

Neither torch nor numpy is imported here unless the caller passed one of their objects: the
communicator works with numpy alone, with torch alone, and with device objects alone.

Device buffers carry the device they live on (``Buf.device``, -1 when the object does not say)
and the stream the work must be enqueued on (``Buf.stream``: a cudaStream_t as an int, None for
the legacy default stream): a torch tensor's ``torch.cuda.current_stream(device)``, the
``stream`` entry of ``__cuda_array_interface__``, or for DLPack the stream this module picks
and hands to ``__dlpack__(stream=...)`` (torch's current stream when torch's CUDA is in use,
else the legacy default stream), so the producer orders its pending work before it.
"""
from __future__ import annotations

import sys
import ctypes
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

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
        # torch >= 2.1 has the 8-bit floats.
        for t in (DataType.FLOAT8_E4M3, DataType.FLOAT8_E5M2):
            if hasattr(torch, t.label):
                _TORCH[getattr(torch, t.label)] = t
    return _TORCH


@dataclass
class Buf:
    """A buffer as the C API sees it. `obj` keeps the Python object alive."""

    obj: Any
    ptr: Optional[int]
    count: int
    dtype: DataType
    kind: str  # "torch", "numpy", "cai" (__cuda_array_interface__) or "dlpack"
    device: Optional[int] = None  # None: host memory; else the CUDA device (-1: not known)
    stream: Optional[int] = None  # device memory: the stream to enqueue on (None: default)
    keep: Any = None  # what must stay alive besides obj (a DLPack capsule)

    @property
    def on_device(self) -> bool:
        return self.device is not None


def is_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_numpy(obj: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


# __cuda_array_interface__ typestr -> DataType (little-endian; "|" for 1-byte types).
_TYPESTR = {"<f4": DataType.FLOAT32, "<f2": DataType.FLOAT16, "<i4": DataType.INT32,
            "<i8": DataType.INT64}
# DLPack (type code, bits) -> DataType: kDLInt 0, kDLFloat 2, kDLBfloat 4.
_DLTYPE = {(2, 32): DataType.FLOAT32, (2, 16): DataType.FLOAT16, (4, 16): DataType.BFLOAT16,
           (0, 32): DataType.INT32, (0, 64): DataType.INT64}
# DLPack device types.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

_SUPPORTED = "float32, float16, bfloat16, int32, int64"


def _torch_cuda_stream(device: int) -> Optional[int]:
    """torch.cuda.current_stream(device) as an int (None: the legacy default stream)."""
    torch = sys.modules["torch"]
    s = torch.cuda.current_stream(device).cuda_stream
    return s or None


def _dlpack_stream(device: int) -> Tuple[int, Optional[int]]:
    """For a DLPack producer on `device`: (the value handed to __dlpack__(stream=...), the
    stream the work goes on). torch's current stream when torch's CUDA is initialised, else
    the legacy default stream (DLPack's 1)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            s = _torch_cuda_stream(device)
            return (s if s else 1), s
    except Exception:  # a CPU-only torch
        pass
    return 1, None


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _capsule_tensor(capsule: Any, name: str) -> _DLTensor:
    api = ctypes.pythonapi
    api.PyCapsule_IsValid.restype = ctypes.c_int
    api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    if not api.PyCapsule_IsValid(capsule, b"dltensor"):
        raise bad_arg(name, "__dlpack__() did not return a 'dltensor' capsule", type_error=True)
    # DLManagedTensor starts with its DLTensor.
    return _DLTensor.from_address(api.PyCapsule_GetPointer(capsule, b"dltensor"))


def _contiguous(shape: Sequence[int], strides: Optional[Sequence[int]], esz: int) -> bool:
    """Whether strides (in bytes; None: C-contiguous) describe a C-contiguous layout."""
    if strides is None:
        return True
    want = esz
    for dim, st in zip(reversed(list(shape)), reversed(list(strides))):
        if dim != 1 and st != want:
            return False
        want *= dim
    return True


def _object_device(obj: Any) -> int:
    """The CUDA device of a __cuda_array_interface__ object: CuPy's obj.device.id, an int
    obj.device, __dlpack_device__; -1 when it does not say."""
    dev = getattr(obj, "device", None)
    if isinstance(dev, int) and not isinstance(dev, bool):
        return dev
    did = getattr(dev, "id", None)
    if isinstance(did, int):
        return did
    if hasattr(obj, "__dlpack_device__"):
        try:
            return int(obj.__dlpack_device__()[1])
        except Exception:
            pass
    return -1


def _from_cai(obj: Any, name: str, writable: bool) -> Buf:
    cai = obj.__cuda_array_interface__
    if not isinstance(cai, dict):
        raise bad_arg(name, "__cuda_array_interface__ is not a dict", type_error=True)
    typestr = cai.get("typestr", "")
    dt = _TYPESTR.get(typestr)
    if dt is None:
        raise bad_arg(name, f"dtype {typestr!r} is not supported ({_SUPPORTED}; bfloat16 "
                            f"through DLPack or a torch tensor)", type_error=True)
    shape = tuple(int(d) for d in cai.get("shape", ()))
    n = 1
    for d in shape:
        n *= d
    if not _contiguous(shape, cai.get("strides"), dt.size):
        raise bad_arg(name, "device array is not C-contiguous (pass a contiguous copy and "
                            "copy back)")
    data = cai.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise bad_arg(name, "__cuda_array_interface__['data'] is not (pointer, read_only)",
                      type_error=True)
    ptr, readonly = data
    if writable and readonly:
        raise bad_arg(name, "device array is read-only but the call writes into it")
    stream = cai.get("stream")
    if stream is not None:
        if isinstance(stream, bool) or not isinstance(stream, int) or stream == 0:
            raise bad_arg(name, f"__cuda_array_interface__['stream'] = {stream!r}: expected "
                                f"None or a stream (1: legacy default, 2: per-thread "
                                f"default, else a cudaStream_t; 0 is not allowed)")
        if stream == 1:
            stream = None
    return Buf(obj, int(ptr) if n and ptr else None, n, dt, "cai", _object_device(obj),
               stream)


def _from_dlpack(obj: Any, name: str, writable: bool) -> Buf:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except Exception as e:
        raise bad_arg(name, f"__dlpack_device__() failed: {e}", type_error=True) from None
    dev_type, dev_id = int(dev_type), int(dev_id)
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        handed, stream = _dlpack_stream(dev_id)
        try:
            capsule = obj.__dlpack__(stream=handed)
        except TypeError:  # a producer without the stream argument (DLPack before 0.6)
            capsule = obj.__dlpack__()
        device: Optional[int] = dev_id
    elif dev_type in (_DL_CPU, _DL_CUDA_HOST):
        capsule = obj.__dlpack__()
        device, stream = None, None
    else:
        raise bad_arg(name, f"DLPack device type {dev_type} is neither the CPU nor a CUDA "
                            f"device")
    t = _capsule_tensor(capsule, name)
    dt = _DLTYPE.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dt is None:
        raise bad_arg(name, f"DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, "
                            f"{t.dtype.lanes} lanes) is not supported ({_SUPPORTED})",
                      type_error=True)
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = None
    if t.ndim and bool(t.strides):
        strides = [t.strides[i] * dt.size for i in range(t.ndim)]  # DLPack: in elements
    if not _contiguous(shape, strides, dt.size):
        raise bad_arg(name, "DLPack tensor is not C-contiguous (pass a contiguous copy and "
                            "copy back)")
    n = 1
    for d in shape:
        n *= d
    ptr = (t.data or 0) + int(t.byte_offset)
    return Buf(obj, ptr if n and ptr else None, n, dt, "dlpack", device, stream, keep=capsule)


def as_buf(obj: Any, name: str, *, writable: bool = False,
           dtype: Optional[DataType] = None, device_ok: bool = True) -> Buf:
    """Checks `obj` (named `name` in errors) and returns its Buf.

    Raises InvalidArgumentError / ArgumentTypeError naming `name` when obj is not a supported
    buffer (torch tensor on the CPU or a CUDA device, numpy array, __cuda_array_interface__
    or DLPack object), is not contiguous, has a dtype the library does not reduce, is not
    writable where it must be, or has not the dtype `dtype` (when given). device_ok=False:
    device memory is refused too (calls that take host memory only).
    """
    if is_torch(obj):
        torch = sys.modules["torch"]
        if obj.layout is not torch.strided:
            raise bad_arg(name, f"layout {obj.layout} is not supported (dense tensors only)",
                          type_error=True)
        dev = obj.device
        if dev.type == "cuda":
            if not device_ok:
                raise bad_arg(name, f"tensor is on device {dev}; this call takes host memory "
                                    f"only (use a CPU tensor)")
        elif not obj.is_cpu:
            raise bad_arg(name, f"tensor is on device {dev}; the binding moves CPU and CUDA "
                                f"memory only")
        dt = _torch_map(torch).get(obj.dtype)
        if dt is None:
            raise bad_arg(name, f"dtype {obj.dtype} is not supported ({_SUPPORTED})",
                          type_error=True)
        if not obj.is_contiguous():
            raise bad_arg(name, "tensor is not contiguous (call .contiguous() and copy back, "
                                "or pass a contiguous buffer)")
        n = obj.numel()
        ptr = obj.data_ptr() if n else None
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            b = Buf(obj, ptr, n, dt, "torch", index, _torch_cuda_stream(index))
        else:
            b = Buf(obj, ptr, n, dt, "torch")
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
        b = Buf(obj, obj.ctypes.data if n else None, n, dt, "numpy")
    elif hasattr(obj, "__cuda_array_interface__"):
        if not device_ok:
            raise bad_arg(name, "is device memory (__cuda_array_interface__); this call takes "
                                "host memory only")
        b = _from_cai(obj, name, writable)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        b = _from_dlpack(obj, name, writable)
        if b.on_device and not device_ok:
            raise bad_arg(name, "is device memory (DLPack); this call takes host memory only")
    else:
        raise bad_arg(name, f"expected a torch tensor, a numpy array, or an object with "
                            f"__cuda_array_interface__ or __dlpack__, got "
                            f"{type(obj).__name__}", type_error=True)
    if dtype is not None and b.dtype != dtype:
        raise bad_arg(name, f"dtype must be {dtype.label} here, got {b.dtype.label}",
                      type_error=True)
    return b


def placement(bufs: Sequence[Tuple[Buf, str]], comm: Any = None) -> Tuple[Optional[int], Any]:
    """For the buffers of one call (with their argument names): checks that they are all host
    memory or all device memory on one device (the communicator's, when it has one), with one
    stream; returns (device or None for host memory, the stream to pass to the C call).
    The first device buffer fixes a UCX communicator's device. Raises naming the argument that
    breaks the rule."""
    first: Optional[Tuple[Buf, str]] = None
    device: Optional[int] = None
    stream = None
    for b, name in bufs:
        if first is None:
            first = (b, name)
            if b.on_device:
                device, stream = b.device, b.stream
            continue
        fb, fname = first
        if b.on_device != fb.on_device:
            raise bad_arg(name, f"is {'device' if b.on_device else 'host'} memory but {fname} "
                                f"is {'device' if fb.on_device else 'host'} memory: a call's "
                                f"buffers must all be host memory or all device memory")
        if not b.on_device:
            continue
        if b.device is not None and b.device >= 0:
            if device is not None and device >= 0 and b.device != device:
                raise bad_arg(name, f"is on cuda:{b.device} but {fname} is on cuda:{device}")
            if device is None or device < 0:
                device = b.device
        if b.stream != stream and b.kind != "torch" and fb.kind != "torch":
            raise bad_arg(name, f"asks for stream {b.stream} but {fname} for stream {stream}: "
                                f"one call runs on one stream (synchronise them first)")
    if device is not None and comm is not None:
        have = getattr(comm, "_device", None)
        if device >= 0:
            if have is not None and have != device:
                raise bad_arg(first[1] if first else "buffer",
                              f"is on cuda:{device} but the communicator works on cuda:{have}")
            if have is None:
                comm._device = device
    return device, stream


def keepalive(*bufs: Buf) -> List[Any]:
    """What a call must keep alive for its buffers."""
    out: List[Any] = []
    for b in bufs:
        out.append(b.obj)
        if b.keep is not None:
            out.append(b.keep)
    return out


def same_dtype(a: Buf, an: str, b: Buf, bn: str) -> None:
    if a.dtype != b.dtype:
        raise bad_arg(bn, f"dtype {b.dtype.label} differs from {an}'s {a.dtype.label}",
                      type_error=True)


def expect_count(b: Buf, name: str, count: int, what: str) -> None:
    if b.count != count:
        raise bad_arg(name, f"has {b.count} elements, expected {count} ({what})")


def empty_like(b: Buf, count: int, name: str = "recv") -> Any:
    """A new contiguous buffer of the same kind, dtype and device as `b`, with `count`
    elements. Device buffers other than torch tensors cannot be made here: pass `name`."""
    if b.kind == "torch":
        import torch

        return torch.empty(count, dtype=b.obj.dtype, device=b.obj.device)
    if b.kind == "numpy" or not b.on_device:
        import numpy as np

        if b.dtype == DataType.BFLOAT16:
            raise bad_arg(name, "pass it (bfloat16 has no numpy type)")
        return np.empty(count, dtype=b.dtype.label)
    raise bad_arg(name, f"pass it: only torch tensors are allocated here, and the input is a "
                        f"{type(b.obj).__name__} in device memory")


def overlaps(a: Buf, b: Buf) -> bool:
    """Whether two buffers share any byte."""
    if not a.ptr or not b.ptr or not a.count or not b.count:
        return False
    sa = a.count * a.dtype.size
    sb = b.count * b.dtype.size
    return a.ptr < b.ptr + sb and b.ptr < a.ptr + sa
