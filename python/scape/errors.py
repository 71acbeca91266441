"""Exceptions raised by the binding.

Every failed library call raises a :class:`ScapeError` subclass chosen by its result code and
carrying the library's own message (``scapeGetLastError``), which names the function and the
argument or peer rank at fault. Arguments the binding checks itself before calling the library
(a non-contiguous tensor, a wrong dtype or device, mismatched sizes) raise
:class:`InvalidArgumentError` too, with ``argument`` set to the parameter's name.

The hierarchy also inherits from the matching built-in exceptions, so ``except ValueError``
catches argument errors and ``except TimeoutError`` catches library timeouts.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from . import _lib

# scapeResult_t values (stable across releases).
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
SYSTEM_ERROR = 3
REMOTE_ERROR = 4
TIMEOUT = 5
UNSUPPORTED = 6
INTERNAL_ERROR = 7
IN_PROGRESS = 8


class ScapeError(RuntimeError):
    """A failed SCAPE call.

    Attributes:
        code: the ``scapeResult_t`` value (for example 1 for scapeInvalidArgument).
        function: the C function (or binding method) that failed.
        message: the library's message, or the binding's for checks it does itself.
        argument: the name of the offending argument, when known.
    """

    code: int = -1

    def __init__(self, message: str, *, function: str = "", code: Optional[int] = None,
                 argument: Optional[str] = None) -> None:
        if code is not None:
            self.code = code
        self.function = function
        self.message = message
        self.argument = argument
        text = message if not function or message.startswith(function) else f"{function}: {message}"
        super().__init__(text)


class InvalidArgumentError(ScapeError, ValueError):
    """scapeInvalidArgument, or an argument the binding rejected before calling the library.
    Nothing was sent; the communicator stays usable (but see the C header: the other ranks are
    not told, so call :meth:`Communicator.abort` if they are waiting)."""

    code = INVALID_ARGUMENT


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type or dtype (also a ``TypeError``)."""


class InvalidUsageError(ScapeError):
    """scapeInvalidUsage: the call is not allowed now (communicator in error state, a sync in
    flight, ranks that disagree on a collective's arguments, ...)."""

    code = INVALID_USAGE


class ScapeSystemError(ScapeError, OSError):
    """scapeSystemError: the operating system or the network library refused something."""

    code = SYSTEM_ERROR


class RemoteError(ScapeError):
    """scapeRemoteError: a peer died, aborted, or sent data that failed validation."""

    code = REMOTE_ERROR


class ScapeTimeoutError(ScapeError, TimeoutError):
    """scapeTimeout: an operation made no progress for the communicator's timeout."""

    code = TIMEOUT


class UnsupportedError(ScapeError, NotImplementedError):
    """scapeUnsupported: valid but not supported by this build."""

    code = UNSUPPORTED


class InternalError(ScapeError):
    """scapeInternalError: a bug in the library; please report the message."""

    code = INTERNAL_ERROR


_BY_CODE: Dict[int, Type[ScapeError]] = {
    INVALID_ARGUMENT: InvalidArgumentError,
    INVALID_USAGE: InvalidUsageError,
    SYSTEM_ERROR: ScapeSystemError,
    REMOTE_ERROR: RemoteError,
    TIMEOUT: ScapeTimeoutError,
    UNSUPPORTED: UnsupportedError,
    INTERNAL_ERROR: InternalError,
}


def error_from_code(code: int, function: str, comm_handle: Optional[int]) -> ScapeError:
    """Builds the exception for a failed call, reading the library's last-error message."""
    msg = _lib.last_error(comm_handle)
    if not msg:
        msg = _lib.error_string(code)
    cls = _BY_CODE.get(code, ScapeError)
    return cls(msg, function=function, code=code)


def check(code: int, function: str, comm_handle: Optional[int] = None) -> None:
    """Raises the matching ScapeError unless `code` is scapeSuccess."""
    if code != SUCCESS:
        raise error_from_code(code, function, comm_handle)


def bad_arg(argument: str, what: str, *, type_error: bool = False) -> InvalidArgumentError:
    """An InvalidArgumentError (or ArgumentTypeError) naming `argument`."""
    cls = ArgumentTypeError if type_error else InvalidArgumentError
    return cls(f"{argument}: {what}", argument=argument)
