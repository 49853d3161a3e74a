"""The target service in the orchestrator's process: :class:`LocalTargetPeer`, a
:class:`orchestrator.peers.TargetPeer` without gRPC (``python -m orchestrator --target-in-process``,
``dflash-grpc serve --colocate``; docs/ARCHITECTURE.md, "The co-located target").

Why: a speculative step makes two exchanges, Propose with the draft service and Verify with the
target. Each costs a gRPC round trip plus two protobuf encodings and decodings, about 0.75 ms per
exchange on an H100 host (``benchmarks/gpu/step``): more than the verify itself on the shipped
SmolLM2 pair. With the target in this process the Verify exchange is a function call on the
scheduler's thread (the step loop's inline fast path runs the batch there when the loop is
idle); the draft service stays its own process, reached over streaming gRPC, from this host or
another.

What stays the same: the target's :class:`target_service.servicer.TargetServicer` serves the
calls (its checks, its step loop, its owners and leases; the calls carry this process's owner
metadata, :func:`dflash_grpc.serving.client_metadata`), with request and reply messages as on the
wire (not serialised). A refused call raises :class:`orchestrator.peers.StreamError` with the
code, message and reason trailing metadata the servicer set, so the scheduler handles it as it
handles a refusal over gRPC.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Iterator

import grpc

from dflash_grpc import serving
from dflash_grpc.localhop import HopAborted, LocalContext
from dflash_grpc.v1 import common_pb2, target_pb2
from orchestrator.peers import StreamError


def _error(e: HopAborted) -> StreamError:
    """The :class:`StreamError` of a call the servicer aborted."""
    return StreamError(e.code, e.details, e.trailing)


def _call(fn: Callable[[Any, LocalContext], Any], request, metadata) -> Any:
    """``fn(request, context)`` as a unary call: its reply, or :class:`StreamError` raised."""
    ctx = LocalContext(metadata)
    try:
        return fn(request, ctx)
    except HopAborted as e:
        raise _error(e) from None
    finally:
        ctx.end()


class _Future(concurrent.futures.Future):
    """A ``concurrent.futures.Future`` that times out as a gRPC future does
    (``grpc.FutureTimeoutError``), for the scheduler's code written against grpc futures."""

    def result(self, timeout: float | None = None):
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise grpc.FutureTimeoutError() from None


class _Unary:
    """One method of :class:`_Stub`: ``m(request, timeout=None)`` and
    ``m.future(request, timeout=None)`` (run on the peer's worker threads; ``timeout`` is
    accepted and not enforced: the servicer's own limits apply)."""

    def __init__(self, peer: "LocalTargetPeer", fn: Callable):
        self.peer, self.fn = peer, fn

    def __call__(self, request, timeout: float | None = None, metadata=None):
        return _call(self.fn, request, self.peer.metadata)

    def future(self, request, timeout: float | None = None, metadata=None) -> _Future:
        fut = _Future()

        def run():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(_call(self.fn, request, self.peer.metadata))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)

        self.peer.pool.submit(run)
        return fut


class _Stub:
    """The unary methods of a ``TargetServiceStub`` (Info, Prefill, Release), in process."""

    def __init__(self, peer: "LocalTargetPeer"):
        s = peer.servicer
        self.Info = _Unary(peer, s.Info)
        self.Prefill = _Unary(peer, s.Prefill)
        self.Release = _Unary(peer, s.Release)


class LocalVerifyStream:
    """A Verify stream to the in-process target: the interface of
    :class:`orchestrator.peers.StreamCall` (``exchange``, ``broken``, ``close``).

    The servicer's ``Verify`` generator runs on the caller's thread: :meth:`exchange` hands it
    one request and takes its one reply. The stream holds the owner's lease while open, as a gRPC
    stream does. A refusal of the whole call ends the stream (``broken``) and raises
    :class:`StreamError`; item refusals come back in the reply's results."""

    def __init__(self, servicer, metadata: tuple[tuple[str, str], ...]):
        self._ctx = LocalContext(metadata)
        self._next: Any = None
        self._gen: Iterator = servicer.Verify(self._requests(), self._ctx)
        self._lock = threading.Lock()
        self.broken = False

    def _requests(self) -> Iterator:
        while True:
            request, self._next = self._next, None
            if request is None:
                return
            yield request

    def exchange(self, request: target_pb2.VerifyRequest, timeout: float | None = None,
                 on_sent: Callable[[], None] | None = None) -> target_pb2.VerifyResponse:
        """Send one request and return its reply (``on_sent``: called first, as the streams of
        :mod:`orchestrator.peers` call it once the request is sent; here nothing overlaps it).

        Raises:
            StreamError: the call was refused (its code, message and reason), or the stream is
                closed (CANCELLED).
        """
        if on_sent is not None:
            on_sent()
        with self._lock:
            if self.broken:
                raise StreamError(grpc.StatusCode.CANCELLED, "the Verify stream is closed")
            self._next = request
            try:
                return next(self._gen)
            except HopAborted as e:
                self._end()
                raise _error(e) from None
            except StopIteration:
                self._end()
                raise StreamError(grpc.StatusCode.CANCELLED, "the Verify stream ended") from None
            except BaseException:
                self._end()
                raise

    def _end(self) -> None:
        self.broken = True
        self._gen.close()
        self._ctx.end()

    def close(self) -> None:
        """End the stream (releases the lease it held; idempotent)."""
        with self._lock:
            if not self.broken:
                self._end()


class LocalTargetPeer:
    """:class:`orchestrator.peers.TargetPeer` served by a
    :class:`target_service.servicer.TargetServicer` in this process (module docstring).

    Args:
        servicer: the target's servicer (its step loop running).
        metadata: the metadata each call carries (default: :func:`dflash_grpc.serving.client_metadata`
            at each call: the orchestrator's owner name and epoch).
        workers: threads that run ``future`` calls (Prefill and Release).
    """

    address = "in-process"

    def __init__(self, servicer, metadata: tuple[tuple[str, str], ...] | None = None, workers: int = 4):
        self.servicer = servicer
        self._metadata = metadata
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="local-target")
        self.stub = _Stub(self)
        self._info: common_pb2.ModelInfo | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata if self._metadata is not None else serving.client_metadata()

    def info(self, timeout: float = 5.0) -> common_pb2.ModelInfo:
        if self._info is None:
            self._info = self.stub.Info(target_pb2.TargetInfoRequest())
        return self._info

    def wait_info(self, timeout: float) -> common_pb2.ModelInfo:
        return self.info()

    def verify_stream(self, timeout: float | None) -> LocalVerifyStream:
        return LocalVerifyStream(self.servicer, self.metadata)

    def close(self) -> None:
        self.pool.shutdown(wait=False)


__all__ = ["LocalTargetPeer", "LocalVerifyStream"]
