"""Enumerations of the C API (values are the C enum values, stable across releases)."""
from __future__ import annotations

import enum
from typing import Union


class DataType(enum.IntEnum):
    """``scapeDataType_t`` (the library's type table, kernels/dtypes.h: the same rows, checked
    by tests/python/test_dtypes.py). fp16/bf16/fp8 reductions accumulate in fp32 and round once
    per hop. The 8-bit floats (OCP E4M3 "fn" and E5M2) may be the optimizer's payload
    (``ScapeAdamS(payload_dtype="e4m3")``), where they carry a shared power-of-two scale."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    INT32 = 3
    INT64 = 4
    FLOAT8_E4M3 = 5
    FLOAT8_E5M2 = 6

    @property
    def size(self) -> int:
        """Bytes per element."""
        return (4, 2, 2, 4, 8, 1, 1)[self.value]

    @property
    def label(self) -> str:
        """The torch dtype's name."""
        return ("float32", "float16", "bfloat16", "int32", "int64", "float8_e4m3fn",
                "float8_e5m2")[self.value]

    @property
    def short(self) -> str:
        """The short name (scape-perf's -d, ``payload_dtype`` strings)."""
        return ("fp32", "fp16", "bf16", "int32", "int64", "e4m3", "e5m2")[self.value]

    @property
    def is_payload(self) -> bool:
        """May be the optimizer's payload type."""
        return self.value in (0, 1, 2, 5, 6)


class ReduceOp(enum.IntEnum):
    """``scapeRedOp_t``. AVG is the sum divided by the number of ranks."""

    SUM = 0
    AVG = 1
    MAX = 2
    MIN = 3


class Ownership(enum.IntEnum):
    """``scapeOwnership_t``: how a mask's flat buffer is split between owner ranks."""

    SHARDS = 0    #: nranks contiguous equal shards (ZeRO-1 / distributed optimizer)
    SEGMENTS = 1  #: whole segments, balanced by size (replicated optimizer)


class MaskEncoding(enum.IntEnum):
    """``scapeMaskEncoding_t``: wire encoding of a rank's part of the next mask."""

    AUTO = 0
    BITMAP = 1
    INDICES = 2
    ELIAS_FANO = 3
    DELTA_VARINT = 4


class SparseAlgo(enum.IntEnum):
    """``scapeSparseAlgo_t``: algorithm of :meth:`Communicator.sparse_all_reduce`."""

    AUTO = 0
    ALL_GATHER = 1
    RECURSIVE_DOUBLING = 2


class ProgressMode(enum.IntEnum):
    """``scapeProgressMode_t``: how a rank waits for the network."""

    AUTO = 0
    SPIN = 1
    YIELD = 2
    BLOCKING = 3


def to_enum(cls, value: Union[int, str, enum.IntEnum], name: str):
    """`value` as a member of `cls`: a member, its int value, or its name in any case
    ("avg", "AVG", "elias_fano", "elias-fano"). Raises InvalidArgumentError naming `name`."""
    from .errors import bad_arg

    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
        if key in cls.__members__:
            return cls[key]
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return cls(value)
        except ValueError:
            pass
    choices = ", ".join(m.lower() for m in cls.__members__)
    raise bad_arg(name, f"{value!r} is not a {cls.__name__} ({choices})")
