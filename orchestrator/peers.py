"""Clients of the target and draft services as the orchestrator uses them.

The scheduler (:mod:`orchestrator.scheduler`) keeps one bidirectional Verify stream and one
Propose stream open for the whole process; each tick sends one message carrying every active
request's item and reads one reply (:class:`StreamCall`).
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


def status_code(value: int) -> grpc.StatusCode:
    """``grpc.StatusCode`` of a numeric code (unknown numbers map to UNKNOWN)."""
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return grpc.StatusCode.UNKNOWN


def drafter_mismatch(info: draft_pb2.DrafterInfo, target: common_pb2.ModelInfo, address: str | None = None) -> str | None:
    """Why the drafter of ``info`` cannot draft for ``target`` (None: it can): it was built for
    another target (fingerprints differ) or its vocabulary differs."""
    if info.target_fingerprint != target.model_fingerprint:
        at = f" at {address}" if address else ""
        return (f"the drafter{at} was built for target {info.target_fingerprint[:12]}, "
                f"not for the served target {target.model_fingerprint[:12]}")
    if info.model.vocab_size != target.vocab_size:
        return "drafter vocabulary differs from the target's"
    return None


class StreamCall:
    """One open bidirectional stream used as a sequence of request/reply exchanges.

    Raises ``grpc.RpcError`` from :meth:`exchange` when the stream fails.
    """

    def __init__(self, method, timeout: float | None = None):
        self._q: queue.Queue = queue.Queue()
        self._responses = method(iter(self._q.get, _END), timeout=timeout)
        self._deadline = float("inf")  # of the exchange in flight (monotonic s), watched by one thread
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def _watch(self) -> None:
        while not self._closed.wait(0.25):
            if time.monotonic() > self._deadline:
                self._responses.cancel()
                return

    def exchange(self, request, timeout: float | None = None):
        """Send ``request`` and wait for its reply.

        Args:
            timeout: seconds to wait for the reply; past it (checked every 0.25 s) the stream is
                cancelled and the ``grpc.RpcError`` (CANCELLED) raised, so a hung peer cannot hang
                the caller.
        """
        if timeout is not None:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
                self._watchdog.start()
            self._deadline = time.monotonic() + timeout
        self._q.put(request)
        try:
            return next(self._responses)
        finally:
            self._deadline = float("inf")

    def close(self) -> None:
        """Half-close and cancel the stream (idempotent)."""
        self._closed.set()
        self._q.put(_END)
        self._responses.cancel()


class TargetPeer:
    """The target service: Info (cached), the Verify stream, Prefill and Release stubs."""

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

    def verify_stream(self, timeout: float | None) -> StreamCall:
        return StreamCall(self.stub.Verify, timeout)

    def close(self) -> None:
        self.channel.close()


class DraftPeer:
    """The draft service, whose absence or failure never fails a request.

    :meth:`state` answers from a cache. While the drafter is unreachable (never reached, or
    :meth:`mark_failed` after a failure) a background thread probes its Info with exponential
    backoff, from ``min_backoff_s`` doubling up to ``max_backoff_s``, so a drafter started or
    restarted later is picked up within that time.
    """

    def __init__(self, address: str | None, max_backoff_s: float = 5.0, min_backoff_s: float = 0.25):
        self.address = address
        self.max_backoff_s = max_backoff_s
        self.min_backoff_s = min_backoff_s
        self.channel = serving.channel(address) if address else None
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel) if self.channel else None
        self._info: draft_pb2.DrafterInfo | None = None
        self._layers: list[int] | None = None
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._probing: threading.Thread | None = None
        self._closed = threading.Event()
        self.detail = "no draft service configured" if not address else "not contacted yet"
        if self.stub is not None:
            self._probe()  # one synchronous look at start, then the background thread
            self._probing = threading.Thread(target=self._watch, name="draft-probe", daemon=True)
            self._probing.start()

    def _probe(self) -> bool:
        try:
            info = self.stub.Info(draft_pb2.DrafterInfoRequest(), timeout=2.0)
        except grpc.RpcError as e:
            self.detail = f"unreachable: {e.code().name}"
            return False
        with self._lock:
            self._info = info
            self._layers = list(info.target_layer_ids)
            self.detail = "ok"
        return True

    def _watch(self) -> None:
        backoff = self.min_backoff_s
        while not self._closed.is_set():
            if self._info is None:
                if self._probe():
                    log.warning("draft service reachable again", extra={"address": self.address})
                    backoff = self.min_backoff_s
                    continue
                self._closed.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
            else:
                self._failed.wait(1.0)
                self._failed.clear()

    def state(self) -> draft_pb2.DrafterInfo | None:
        """The drafter's Info if it is reachable now (cached), else ``None``; never blocks."""
        return self._info

    def layers(self) -> list[int] | None:
        """The target layers the drafter reads (from its last Info), or None if never reached."""
        return self._layers

    def mark_failed(self, why: str) -> None:
        """Forget the cached Info after a failure; the background thread probes again."""
        with self._lock:
            self._info = None
            self.detail = why
        self._failed.set()

    def propose_stream(self, timeout: float | None) -> StreamCall:
        return StreamCall(self.stub.Propose, timeout)

    def close(self) -> None:
        self._closed.set()
        self._failed.set()
        if self.channel:
            self.channel.close()
