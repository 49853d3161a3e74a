"""The SDK's exceptions: one :class:`DFlashError` subclass per gRPC status code of interest.

Every failed call is raised as a :class:`DFlashError` (:func:`from_rpc_error` picks the class from
the status code). Besides the status code and message, an error carries :attr:`DFlashError.reason`:
the server's structured reason code (e.g. ``"NO_FREE_SLOT"``), read from the trailing-metadata key
:data:`dflash_grpc.transport.REASON_KEY`; branch on it, never on the message text.
"""

from __future__ import annotations

from typing import Any

import grpc
from dflash_grpc.transport import REASON_KEY

__all__ = [
    "CancelledError",
    "DFlashError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
    "from_rpc_error",
]


class DFlashError(Exception):
    """A failed call.

    Attributes:
        message: the status details (human-readable; may change between versions).
        code: the :class:`grpc.StatusCode`.
        reason: the server's structured reason code (a ``runtime.errors.Reason`` name such as
            ``"NO_FREE_SLOT"``), from the trailing metadata key ``dflash-reason``; ``""`` when the
            server sent none, and for errors the client raises itself.

    ``str(err)`` is ``"<CODE>: <message>"``, e.g. ``"INVALID_ARGUMENT: empty prompt"``.
    """

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None, reason: str = ""):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(DFlashError, ValueError):
    """INVALID_ARGUMENT: bad prompt, token id out of vocabulary, bad sampling values, ...

    Also raised by the client itself, before any call, for arguments it can check locally
    (:class:`client.GenerateRequest`'s validation, TLS files).
    """

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(DFlashError):
    """NOT_FOUND: an unknown session or resource."""

    default_code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(DFlashError):
    """FAILED_PRECONDITION: e.g. a drafter built for another target or vocabulary."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(DFlashError):
    """RESOURCE_EXHAUSTED: no free session slot, context full, or message too large."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(DFlashError):
    """UNAVAILABLE: the server (or a service behind it) cannot be reached."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(DFlashError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's ``timeout`` passed before it finished."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(DFlashError):
    """CANCELLED: the call was cancelled (by the client or the server)."""

    default_code = grpc.StatusCode.CANCELLED


class InternalError(DFlashError):
    """INTERNAL (also UNKNOWN and DATA_LOSS): a server bug or a broken stream."""

    default_code = grpc.StatusCode.INTERNAL


_ERRORS: dict[grpc.StatusCode, type[DFlashError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,  # what grpcio sends for an unhandled server exception
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def _call(err: Any, name: str) -> Any:
    """``err.<name>()``, or None where ``err`` has no such method or it fails."""
    fn = getattr(err, name, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:  # a half-built or foreign RpcError: no metadata rather than a second error
        return None


def _reason(err: Any) -> str:
    """The value of :data:`REASON_KEY` in ``err``'s trailing metadata (``""`` when absent).

    Works for the sync (tuple of pairs / ``_Metadatum``) and ``grpc.aio`` (``Metadata``) forms.
    """
    for item in _call(err, "trailing_metadata") or ():
        try:
            key, value = item
        except (TypeError, ValueError):
            continue
        if key == REASON_KEY:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(err: grpc.RpcError) -> DFlashError:
    """Map a :class:`grpc.RpcError` (sync or ``grpc.aio``) to the matching :class:`DFlashError`.

    The error's ``reason`` is the ``dflash-reason`` trailing metadata (``""`` when absent). Codes
    without a class of their own (UNIMPLEMENTED, PERMISSION_DENIED, ...) give a plain
    :class:`DFlashError` that still carries the code.
    """
    code = _call(err, "code")
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = _call(err, "details")
    cls = _ERRORS.get(code, DFlashError)
    return cls(details or code.name.lower().replace("_", " "), code, _reason(err))
