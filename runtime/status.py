"""Errors as gRPC statuses: the one place where an :class:`~runtime.errors.EngineError` (or an
exception that broke a step) becomes a status code and message, for a unary call or for one item
of a batched stream message (``dflash_grpc.v1.ItemStatus``). Both servicers use it.
"""

from __future__ import annotations

import logging

import grpc
import torch

from dflash_grpc.v1 import common_pb2
from runtime.errors import EngineError

log = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an exception raised while serving an item."""
    if isinstance(e, EngineError):
        return grpc.StatusCode[e.code.name], str(e)
    if isinstance(e, _OOM):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory: {e}"
    log.error("internal error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


def item_status(e: BaseException | None) -> common_pb2.ItemStatus:
    """``ItemStatus`` of an item: OK (0) for ``None``, else its mapped status."""
    if e is None:
        return common_pb2.ItemStatus(code=0)
    code, msg = status_of(e)
    return common_pb2.ItemStatus(code=code.value[0], message=msg)
