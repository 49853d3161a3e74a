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


def batch_reply(response_cls, items, outs, done, fill):
    """A Verify / Propose reply for one batch, built in place (each result added to the reply,
    not built and copied in: this runs per item of every step, tools/hop_overhead.py).

    Args:
        response_cls: the reply message class (``VerifyResponse``, ``ProposeResponse``): its
            ``results`` field and the batch timing fields ``compute_s``, ``batch_items``,
            ``queue_s``, ``device_s`` (from ``done``, a :class:`runtime.step_loop.BatchResult`).
        items, outs: the request's items and their outcomes, in order (an outcome, or the
            exception that refused the item).
        fill: ``fill(result, outcome)`` writes an accepted item's fields into its result.

    Returns:
        The reply: per item its ``session_id`` and, when refused, the mapped status
        (:func:`item_status`); otherwise an OK status, present (code 0), and what ``fill`` wrote.
    """
    response = response_cls(compute_s=done.compute_s, batch_items=done.batch_items, queue_s=done.queue_s,
                            device_s=done.device_s)
    add = response.results.add
    for item, out in zip(items, outs):
        if isinstance(out, BaseException):
            add(session_id=item.session_id, status=item_status(out))
            continue
        r = add(session_id=item.session_id)
        r.status.SetInParent()
        fill(r, out)
    return response

