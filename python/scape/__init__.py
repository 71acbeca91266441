"""SCAPE comm for Python: the communicator, collectives and agreed masks of
``libnccl-net-scape.so`` on torch CPU tensors and numpy arrays, zero-copy, through ctypes.

Quick start (under torchrun, mpirun or ``python3 -m scape.launch``)::

    import numpy as np, scape
    with scape.Communicator.from_env() as comm:
        x = np.full(1000, comm.rank, dtype=np.float32)
        comm.all_reduce(x, op="avg")            # in place, identical bits on every rank

``scape.optim.ScapeAdamS`` (needs torch) is the SCAPE optimizer step as a
``torch.optim.Optimizer``. Importing ``scape`` imports neither torch nor numpy; the library is
loaded at the first call (see ``scape.library_path()`` for where it came from).
"""
from __future__ import annotations

from ._lib import library_path
from .comm import (BINDING_VERSION_CODE, Communicator, Request, SparseResult, UniqueId,
                   find_nccl_library, get_unique_id, version)
from .errors import (ArgumentTypeError, InternalError, InvalidArgumentError, InvalidUsageError,
                     RemoteError, ScapeError, ScapeSystemError, ScapeTimeoutError,
                     UnsupportedError)
from .mask import Mask, SyncInfo
from .types import DataType, MaskEncoding, Ownership, ProgressMode, ReduceOp, SparseAlgo

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError", "BINDING_VERSION_CODE", "Communicator", "DataType", "InternalError",
    "InvalidArgumentError", "InvalidUsageError", "Mask", "MaskEncoding", "Ownership",
    "ProgressMode", "ReduceOp", "RemoteError", "Request", "ScapeError", "ScapeSystemError",
    "ScapeTimeoutError", "SparseAlgo", "SparseResult", "SyncInfo", "UniqueId",
    "UnsupportedError", "find_nccl_library", "get_unique_id", "library_path", "version",
]
