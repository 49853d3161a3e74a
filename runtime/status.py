"""Errors as gRPC statuses: the one place where an :class:`~runtime.errors.EngineError` (or an
exception that broke a step) becomes a status code, a reason code (:class:`~runtime.errors.Reason`)
and a message, for a unary call (:func:`abort_with`: the reason in trailing metadata
``dflash-reason``) or for one item of a batched stream message (:func:`item_status`:
``dflash_grpc.v1.ItemStatus``). Both servicers use it.

* :class:`~runtime.errors.EngineError`: its ``code`` and ``reason``;
* out of device memory: RESOURCE_EXHAUSTED, ``OUT_OF_MEMORY``;
* anything else: INTERNAL, ``INTERNAL`` (logged with its traceback).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import grpc
import torch

from dflash_grpc.transport import abort
from dflash_grpc.v1 import common_pb2
from runtime.errors import EngineError, Reason

log = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Status(NamedTuple):
    """A refusal as it goes on the wire."""

    code: grpc.StatusCode
    reason: Reason
    message: str


def status_with_reason(e: BaseException) -> Status:
    """The gRPC status, reason code and message for an exception raised while serving an item
    (the mapping of the module docstring; an unexpected exception is logged here)."""
    if isinstance(e, EngineError):
        return Status(grpc.StatusCode[e.code.name], Reason(e.reason), str(e))
    if isinstance(e, _OOM):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.OUT_OF_MEMORY, f"out of device memory: {e}")
    log.error("internal error", exc_info=e)
    return Status(grpc.StatusCode.INTERNAL, Reason.INTERNAL, f"{type(e).__name__}: {e}")


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message of :func:`status_with_reason` (without the reason)."""
    s = status_with_reason(e)
    return s.code, s.message


def item_status(e: BaseException | None) -> common_pb2.ItemStatus:
    """``ItemStatus`` of an item: OK (code 0, no reason) for ``None``, else its mapped status
    with ``reason`` set."""
    if e is None:
        return common_pb2.ItemStatus(code=0)
    s = status_with_reason(e)
    return common_pb2.ItemStatus(code=s.code.value[0], message=s.message, reason=s.reason.value)


def abort_with(context: grpc.ServicerContext, e: BaseException):
    """End a call with the mapped status of ``e``: code, message, and the reason in trailing
    metadata (:func:`dflash_grpc.transport.abort`). Raises (a sync servicer context); with a
    ``grpc.aio`` context it returns the abort's coroutine, to be awaited."""
    s = status_with_reason(e)
    return abort(context, s.code, s.message, s.reason.value)
