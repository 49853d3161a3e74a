"""Clients of the target and draft services as the orchestrator uses them.

A request keeps one bidirectional Verify stream (and one Propose stream) open for its whole
life; each step sends one message and reads one reply (:class:`StreamCall`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

_END = object()


class ItemError(Exception):
    """A per-item failure reported inside a stream reply (``ItemStatus``)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def status_code(value: int) -> grpc.StatusCode:
    """``grpc.StatusCode`` of a numeric code (unknown numbers map to UNKNOWN)."""
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN


def check_item(status: common_pb2.ItemStatus) -> None:
    """Raise :class:`ItemError` when an item's status is not OK."""
    if status.code:
        raise ItemError(status_code(status.code), status.message)


class StreamCall:
    """One open bidirectional stream used as a sequence of request/reply exchanges.

    Raises ``grpc.RpcError`` from :meth:`exchange` when the stream fails.
    """

    def __init__(self, method, timeout: float | None = None):
        self._q: queue.Queue = queue.Queue()
        self._responses = method(iter(self._q.get, _END), timeout=timeout)

    def exchange(self, request):
        """Send ``request`` and wait for its reply."""
        self._q.put(request)
        return next(self._responses)

    def close(self) -> None:
        """Half-close and cancel the stream (idempotent)."""
        self._q.put(_END)
        self._responses.cancel()


class TargetPeer:
    """The target service: Info (cached), Prefill, a Verify stream per request, Release."""

    def __init__(self, address: str):
        self.address = address
        self.channel = serving.channel(address)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self._info: common_pb2.ModelInfo | None = None

    def info(self, timeout: float = 5.0) -> common_pb2.ModelInfo:
        if self._info is None:
            self._info = self.stub.Info(target_pb2.TargetInfoRequest(), timeout=timeout)
        return self._info

    def wait_info(self, timeout: float) -> common_pb2.ModelInfo:
        """Poll Info until the target answers (raises the last ``grpc.RpcError`` after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.info()
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def prefill(self, item: target_pb2.PrefillItem, timeout: float | None) -> target_pb2.PrefillResult:
        return self.stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=timeout).results[0]

    def verify_stream(self, timeout: float | None) -> StreamCall:
        return StreamCall(self.stub.Verify, timeout)

    def release(self, session_id: str) -> None:
        """Best-effort release (errors are logged, never raised)."""
        try:
            self.stub.Release(common_pb2.ReleaseRequest(session_ids=[session_id]), timeout=5.0)
        except grpc.RpcError as e:
            log.warning("target release failed", extra={"session": session_id, "code": str(e.code())})

    def close(self) -> None:
        self.channel.close()


class DraftPeer:
    """The draft service, whose absence or failure never fails a request.

    :meth:`state` re-reads Info at most every ``retry_s`` seconds while the drafter is
    unreachable, so a drafter started (or restarted) later is picked up.
    """

    def __init__(self, address: str | None, retry_s: float = 5.0):
        self.address = address
        self.retry_s = retry_s
        self.channel = serving.channel(address) if address else None
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel) if self.channel else None
        self._info: draft_pb2.DrafterInfo | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self.detail = "no draft service configured" if not address else "not contacted yet"

    def state(self) -> draft_pb2.DrafterInfo | None:
        """The drafter's Info if it is reachable now, else ``None``."""
        if self.stub is None:
            return None
        with self._lock:
            if self._info is None and time.monotonic() - self._checked >= self.retry_s:
                self._checked = time.monotonic()
                try:
                    self._info = self.stub.Info(draft_pb2.DrafterInfoRequest(), timeout=2.0)
                    self.detail = "ok"
                except grpc.RpcError as e:
                    self.detail = f"unreachable: {e.code().name}"
            return self._info

    def mark_failed(self, why: str) -> None:
        """Forget the cached Info after a failure, so the next request re-checks the drafter."""
        with self._lock:
            self._info = None
            self._checked = time.monotonic()
            self.detail = why

    def propose_stream(self, timeout: float | None) -> StreamCall:
        return StreamCall(self.stub.Propose, timeout)

    def release(self, session_id: str) -> None:
        if self.stub is None:
            return
        try:
            self.stub.Release(common_pb2.ReleaseRequest(session_ids=[session_id]), timeout=2.0)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        if self.channel:
            self.channel.close()
