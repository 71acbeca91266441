"""The device path of the binding without a GPU: the C tests' CPU fake device runtime, loaded
from the test-only library tests/python/fakedev_shim.cc (path in SCAPE_TEST_FAKEDEV) and
installed into the loaded libnccl-net-scape.so, and two stand-ins for CUDA arrays over its
"device" memory: one exposing ``__cuda_array_interface__`` (as CuPy / Numba do) and one
exposing DLPack (``__dlpack__`` / ``__dlpack_device__`` on a CUDA device).
"""
from __future__ import annotations

import ctypes
import os
from ctypes import c_char_p, c_int, c_size_t, c_uint64, c_void_p
from typing import Any, List, Optional

import numpy as np

import scape
from scape import _lib

_shim: Optional[ctypes.CDLL] = None


def available() -> bool:
    path = os.environ.get("SCAPE_TEST_FAKEDEV", "")
    return bool(path) and os.path.exists(path)


def install(nccl: Optional[str] = None) -> ctypes.CDLL:
    """Loads the shim and installs the fake device into the library (once per process);
    nccl: the fake libnccl whose work runs on the fake streams."""
    global _shim
    if _shim is not None:
        return _shim
    L = ctypes.CDLL(os.environ["SCAPE_TEST_FAKEDEV"])
    for name, res, args in (
            ("fakedev_error", c_char_p, []), ("fakedev_install", c_int, [c_char_p, c_char_p]),
            ("fakedev_alloc", c_void_p, [c_size_t]), ("fakedev_free", None, [c_void_p]),
            ("fakedev_new_stream", c_void_p, []), ("fakedev_is_device", c_int, [c_void_p]),
            ("fakedev_sync", c_int, [c_void_p]),
            ("fakedev_copy", c_int, [c_void_p, c_void_p, c_size_t]),
            ("fakedev_hold", c_void_p, [c_void_p]), ("fakedev_open", None, [c_void_p]),
            ("fakedev_counter", c_uint64, [c_char_p])):
        f = getattr(L, name)
        f.restype = res
        f.argtypes = args
    _lib.lib()  # the library is loaded (the shim finds it with RTLD_NOLOAD)
    path = _lib.library_path().encode()
    if L.fakedev_install(path, nccl.encode() if nccl else None) != 0:
        raise RuntimeError("fakedev_install: " + L.fakedev_error().decode())
    _shim = L
    return L


def new_stream() -> int:
    return _shim.fakedev_new_stream()


def sync(stream: Optional[int]) -> None:
    if _shim.fakedev_sync(stream) != 0:
        raise RuntimeError("stream failed: " + _shim.fakedev_error().decode())


def counter(name: str) -> int:
    return int(_shim.fakedev_counter(name.encode()))


class Gate:
    """Holds a stream until open(): work queued on it after the gate waits."""

    def __init__(self, stream: Optional[int]) -> None:
        self._g = _shim.fakedev_hold(stream)

    def open(self) -> None:
        _shim.fakedev_open(self._g)


class _DevMem:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = _shim.fakedev_alloc(max(nbytes, 1))
        assert _shim.fakedev_is_device(self.ptr) == 1

    def __del__(self) -> None:
        try:
            _shim.fakedev_free(self.ptr)
        except Exception:
            pass


class FakeCudaArray:
    """A 1-D (or `shape`) array in fake device memory exposing __cuda_array_interface__
    (version 3) with the given stream (None: no 'stream' entry), device id and strides."""

    def __init__(self, data: Any, *, device: int = 0, stream: Optional[int] = None,
                 strides: Any = None, readonly: bool = False, typestr: Optional[str] = None,
                 shape: Any = None) -> None:
        a = np.ascontiguousarray(data)
        self.dtype = a.dtype
        self.shape = tuple(shape) if shape is not None else a.shape
        self._mem = _DevMem(a.nbytes)
        self._typestr = typestr or a.dtype.str
        self._strides = strides
        self._readonly = readonly
        self._stream = stream
        self.device = type("Device", (), {"id": device})()
        if a.nbytes:
            assert _shim.fakedev_copy(self._mem.ptr, a.ctypes.data, a.nbytes) == 0

    @property
    def __cuda_array_interface__(self) -> dict:
        d = {"shape": self.shape, "typestr": self._typestr, "data": (self._mem.ptr,
             self._readonly), "version": 3, "strides": self._strides}
        if self._stream is not None:
            d["stream"] = self._stream
        return d

    @property
    def ptr(self) -> int:
        return self._mem.ptr

    def numpy(self, stream: Optional[int] = None) -> np.ndarray:
        """A host copy, after the stream (default: this array's) has finished."""
        sync(stream if stream is not None else self._stream)
        out = np.empty(int(np.prod(self.shape)) if self.shape else 1, dtype=self.dtype)
        if out.nbytes:
            assert _shim.fakedev_copy(out.ctypes.data, self._mem.ptr, out.nbytes) == 0
        return out


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", c_uint64)]


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p),
                             ("deleter", _DELETER)]

_NO_DELETE = _DELETER()  # NULL deleter: the object owns everything

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, c_char_p, c_void_p]


class FakeDLPack:
    """Fake device memory exposing DLPack on a CUDA device (type 2). `code`/`bits`: the
    DLPack dtype (bfloat16 is code 4, 16 bits). Records the stream each __dlpack__ call got."""

    def __init__(self, raw: bytes, n: int, *, code: int, bits: int, device: int = 0,
                 strides: Optional[List[int]] = None, shape: Optional[List[int]] = None) -> None:
        self._mem = _DevMem(len(raw))
        if raw:
            buf = ctypes.create_string_buffer(raw, len(raw))
            assert _shim.fakedev_copy(self._mem.ptr, ctypes.addressof(buf), len(raw)) == 0
        self.n = n
        self._shape_list = shape if shape is not None else [n]
        self._shape = (ctypes.c_int64 * len(self._shape_list))(*self._shape_list)
        self._strides = (ctypes.c_int64 * len(strides))(*strides) if strides else None
        self._code, self._bits, self._device = code, bits, device
        self.streams_seen: List[Any] = []
        self._managed: List[_DLManagedTensor] = []

    def __dlpack_device__(self):
        return (2, self._device)

    def __dlpack__(self, stream: Any = None):
        self.streams_seen.append(stream)
        m = _DLManagedTensor()
        t = m.dl_tensor
        t.data = self._mem.ptr
        t.device = _DLDevice(2, self._device)
        t.ndim = len(self._shape_list)
        t.dtype = _DLDataType(self._code, self._bits, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = (ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                     if self._strides is not None else None)
        t.byte_offset = 0
        m.deleter = _NO_DELETE
        self._managed.append(m)  # alive as long as this object
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)

    @property
    def ptr(self) -> int:
        return self._mem.ptr

    def raw(self, stream: Optional[int] = None) -> bytes:
        sync(stream)
        buf = ctypes.create_string_buffer(self._mem.nbytes)
        if self._mem.nbytes:
            assert _shim.fakedev_copy(ctypes.addressof(buf), self._mem.ptr, self._mem.nbytes) == 0
        return buf.raw


__all__ = ["available", "install", "new_stream", "sync", "counter", "Gate", "FakeCudaArray",
           "FakeDLPack", "scape"]
