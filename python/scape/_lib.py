"""Loading libnccl-net-scape.so and declaring the C API's prototypes for ctypes.

The library is found, in this order:

1. the environment variable ``SCAPE_LIBRARY`` (a path to the .so);
2. the copy inside the package (``scape/libnccl-net-scape.so``: a wheel installed by pip);
3. the path recorded when the package was staged by CMake (``_build_info.LIBRARY_PATH``:
   the build tree's ``lib/`` for a build, ``<prefix>/lib`` for ``cmake --install``);
4. ``scape/../lib/``;
5. the system loader (``LD_LIBRARY_PATH``, ``ld.so.cache``).

Nothing here imports torch or numpy.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_double, c_int, c_size_t,
                    c_uint, c_uint8, c_uint64, c_void_p)
from typing import List, Optional

LIBRARY_NAME = "libnccl-net-scape.so"

UNIQUE_ID_BYTES = 128
CONFIG_MAGIC = 0x5CA9E
CONFIG_UNDEF_INT = -2147483647 - 1
NUM_MASK_ENCODINGS = 5


class UniqueIdStruct(Structure):
    """``scapeUniqueId``: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", c_char * UNIQUE_ID_BYTES)]


# scapeDeviceAllocator_t's functions: alloc(user, bytes, device, stream, ptr) -> int and
# free(user, ptr, bytes, device, stream).
DEVICE_ALLOC_FN = CFUNCTYPE(c_int, c_void_p, c_size_t, c_int, c_void_p, POINTER(c_void_p))
DEVICE_FREE_FN = CFUNCTYPE(None, c_void_p, c_void_p, c_size_t, c_int, c_void_p)


class DeviceAllocatorStruct(Structure):
    """``scapeDeviceAllocator_t`` (see scape/allocator.py)."""

    _fields_ = [("alloc", DEVICE_ALLOC_FN), ("free", DEVICE_FREE_FN), ("user", c_void_p)]


class ConfigStruct(Structure):
    """``scapeConfig_t`` (initialise with :func:`make_config`)."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("timeoutMs", c_int),
        ("progressMode", c_int),
        ("netIf", c_char_p),
        ("deviceAllocator", DeviceAllocatorStruct),
    ]


class MaskSyncInfoStruct(Structure):
    """``scapeMaskSyncInfo_t``."""

    _fields_ = [
        ("encoding", c_int),
        ("sentBytes", c_uint64),
        ("totalBytes", c_uint64),
        ("bytesByEncoding", c_uint64 * NUM_MASK_ENCODINGS),
        ("syncSeconds", c_double),
    ]


def _candidates() -> List[str]:
    out: List[str] = []
    env = os.environ.get("SCAPE_LIBRARY")
    if env:
        out.append(env)
    here = os.path.dirname(os.path.abspath(__file__))
    out.append(os.path.join(here, LIBRARY_NAME))  # a wheel's own copy, before a stale record
    try:
        from . import _build_info  # written by CMake; absent in a bare source checkout

        path = getattr(_build_info, "LIBRARY_PATH", "")
        if path:
            out.append(path)
    except ImportError:
        pass
    out.append(os.path.join(os.path.dirname(here), "lib", LIBRARY_NAME))
    return out


_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def library_path() -> str:
    """The path of the library actually loaded (loads it if needed)."""
    lib()
    assert _lib_path is not None
    return _lib_path


def lib() -> ctypes.CDLL:
    """The loaded library, with every prototype declared. Raises OSError if none is found."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    tried = []
    env = os.environ.get("SCAPE_LIBRARY")
    for path in _candidates():
        if not os.path.exists(path):
            if path == env:
                raise OSError(f"SCAPE_LIBRARY={env!r}: no such file")
            tried.append(path)
            continue
        handle = ctypes.CDLL(path)
        _lib, _lib_path = handle, path
        break
    else:
        try:
            _lib = ctypes.CDLL(LIBRARY_NAME)
            _lib_path = LIBRARY_NAME + " (system loader)"
        except OSError as e:
            raise OSError(
                f"scape: cannot find {LIBRARY_NAME}: set SCAPE_LIBRARY to its path, build the "
                f"repository with CMake (which records the path), or put it on "
                f"LD_LIBRARY_PATH. Tried: {', '.join(tried) or '(nothing)'}; system loader: {e}"
            ) from None
    _declare(_lib)
    return _lib


def _declare(L: ctypes.CDLL) -> None:
    R = c_int  # scapeResult_t
    p = c_void_p
    u64p = POINTER(c_uint64)

    def d(name: str, restype, *argtypes) -> None:
        f = getattr(L, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    d("scapeGetErrorString", c_char_p, c_int)
    d("scapeGetVersion", R, POINTER(c_int))
    d("scapeTypeSize", c_size_t, c_int)
    d("scapeGetUniqueId", R, POINTER(UniqueIdStruct))
    d("scapeCommInitRank", R, POINTER(p), c_int, UniqueIdStruct, c_int)
    d("scapeCommInitRankConfig", R, POINTER(p), c_int, UniqueIdStruct, c_int,
      POINTER(ConfigStruct))
    d("scapeCommInitFromEnv", R, POINTER(p), POINTER(ConfigStruct))
    d("scapeCommInitNcclRank", R, POINTER(p), c_int, UniqueIdStruct, c_int, POINTER(ConfigStruct))
    d("scapeCommInitNcclFromEnv", R, POINTER(p), POINTER(ConfigStruct))
    d("scapeCommGetBackend", R, p, POINTER(c_int))
    d("scapeGetDeviceSupport", R, POINTER(c_int), POINTER(c_int))
    d("scapeCommDestroy", R, p)
    d("scapeCommAbort", R, p)
    d("scapeCommCount", R, p, POINTER(c_int))
    d("scapeCommUserRank", R, p, POINTER(c_int))
    d("scapeGetLastError", c_char_p, p)
    d("scapeCommGetAsyncError", R, p, POINTER(c_int))

    d("scapeAllReduce", R, p, p, c_size_t, c_int, c_int, p, p, p)
    d("scapeAllReduceAsync", R, p, p, c_size_t, c_int, c_int, p, p, p, POINTER(p))
    d("scapeReduceScatter", R, p, p, c_size_t, c_int, c_int, p, p)
    d("scapeReduceScatterAsync", R, p, p, c_size_t, c_int, c_int, p, p, POINTER(p))
    d("scapeAllGather", R, p, p, c_size_t, c_int, p, p)
    d("scapeAllGatherAsync", R, p, p, c_size_t, c_int, p, p, POINTER(p))
    d("scapeBroadcast", R, p, p, c_size_t, c_int, c_int, p, p)
    d("scapeBroadcastAsync", R, p, p, c_size_t, c_int, c_int, p, p, POINTER(p))
    d("scapeBarrier", R, p)
    d("scapeBarrierAsync", R, p, POINTER(p))
    d("scapeTest", R, p, POINTER(c_int))
    d("scapeWait", R, p)

    d("scapeMaskCreate", R, POINTER(p), c_uint64, c_int, u64p, POINTER(c_uint8), c_int, c_int, p)
    d("scapeMaskDestroy", R, p)
    d("scapeMaskGetOwnedRanges", R, p, c_int, u64p, c_size_t, POINTER(c_size_t))
    d("scapeMaskSetNextIndices", R, p, u64p, c_size_t)
    d("scapeMaskSelectNextTopk", R, p, p, c_double)
    d("scapeMaskSyncStart", R, p)
    d("scapeMaskSyncTest", R, p, POINTER(c_int))
    d("scapeMaskSyncWait", R, p)
    d("scapeMaskAdvance", R, p)
    d("scapeMaskGetCount", R, p, u64p)
    d("scapeMaskGetRankCount", R, p, c_int, u64p, u64p)
    d("scapeMaskGetIndices", R, p, u64p, c_size_t)
    d("scapeMaskGetSyncInfo", R, p, POINTER(MaskSyncInfoStruct))
    d("scapeMaskPack", R, p, p, p, c_int)
    d("scapeMaskUnpack", R, p, p, p, c_int)
    # The stream forms (device buffers on the caller's stream); absent from older libraries.
    for name, args in (("scapeMaskPackStream", (p, p, p, c_int, p)),
                       ("scapeMaskUnpackStream", (p, p, p, c_int, p)),
                       ("scapeMaskSelectNextTopkStream", (p, p, c_double, p))):
        if hasattr(L, name):
            d(name, R, *args)
    d("scapeMaskAllReducePacked", R, p, p, c_int, c_int, p, p, p)
    d("scapeMaskAllReducePackedAsync", R, p, p, c_int, c_int, p, p, p, POINTER(p))
    d("scapeMaskReduceScatter", R, p, p, c_int, c_int, p, p, p)
    d("scapeMaskReduceScatterAsync", R, p, p, c_int, c_int, p, p, p, POINTER(p))
    d("scapeMaskAllGather", R, p, p, c_int, p, p, p)
    d("scapeMaskAllGatherAsync", R, p, p, c_int, p, p, p, POINTER(p))

    d("scapeSparseAllReduce", R, u64p, p, c_size_t, c_uint64, c_int, c_int, c_int, p, u64p, p,
      c_size_t, POINTER(c_size_t), u64p, p)


def has_symbol(name: str) -> bool:
    """Whether the loaded library exports `name` (for features newer than this package)."""
    try:
        getattr(lib(), name)
        return True
    except AttributeError:
        return False


def last_error(comm: Optional[int]) -> str:
    """scapeGetLastError(comm) as a str (copied at once: the library reuses the buffer)."""
    msg = lib().scapeGetLastError(comm)
    return msg.decode("utf-8", "replace") if msg else ""


def error_string(code: int) -> str:
    s = lib().scapeGetErrorString(code)
    return s.decode() if s else "unknown result"
