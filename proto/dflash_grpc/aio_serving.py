"""gRPC's asyncio server behind the same interface as :func:`dflash_grpc.serving.make_server`.

The orchestrator's public GenerationService streams one message per request every tick or
every few ticks. gRPC's thread-per-stream server spends about 200 us of host time per streamed
message on the CPU box (a handler thread's wake, the send, its completion on the server's
thread); its asyncio server about half of that (``tools/grpc_stream_cost.py``,
docs/ARCHITECTURE.md, "Serving many sessions"). :func:`make_aio_server` runs a ``grpc.aio``
server on an event loop of its own thread and returns an :class:`AioServer`, which the sync code
of a service's ``main`` drives as it drives a server of ``make_server``:
:func:`dflash_grpc.serving.serve_forever`, :func:`~dflash_grpc.serving.graceful_stop`,
:func:`~dflash_grpc.serving.start_draining` and :func:`~dflash_grpc.serving.streams_in_flight`
take it as they are.

What the thread-per-stream server's interceptors do, :class:`AioGate` does for methods that take
one request message (unary and server-streaming, the GenerationService's kinds), which must be
coroutines (unary) or async generators (streaming; any other method is answered UNIMPLEMENTED):
refuse new calls
once draining (UNAVAILABLE, ``SHUTTING_DOWN``; health, reflection and ``Release`` excepted),
count the streams in flight, refuse a stream past ``max_streams`` (RESOURCE_EXHAUSTED,
``STREAMS_BUSY``) and answer a request message that does not decode INVALID_ARGUMENT. Methods
that read a request stream pass through ungated (none of the orchestrator's but reflection's).
There is no shared token here (the orchestrator's public service takes none) and no same-host hop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from typing import Any, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as reflection_service

from dflash_grpc.serving import _ALWAYS_OPEN, SHUTTING_DOWN, UNARY_WORKERS, server_options
from dflash_grpc.transport import TlsConfig, abort

__all__ = ["AioGate", "AioServer", "make_aio_server"]

log = logging.getLogger("dflash_grpc.serving")

#: seconds a call from another thread into the server's loop may take before it is given up
LOOP_CALL_S = 30.0


class AioGate(grpc.aio.ServerInterceptor):
    """The asyncio server's one interceptor: shutdown gate, stream limit and request decoding.

    Attributes read by :mod:`dflash_grpc.serving`'s shutdown helpers, as on ``_DrainGate``:
    :attr:`draining` (new calls refused UNAVAILABLE / ``SHUTTING_DOWN``), :attr:`ending` (no
    request stream to end here: the methods gated take one message) and :attr:`streams` (the
    server-streaming calls in flight). Every attribute is touched on the server's loop or is a
    flag set from another thread.

    Args:
        max_streams: most server-streaming calls at a time; one more is answered
            RESOURCE_EXHAUSTED, reason ``STREAMS_BUSY``.
    """

    def __init__(self, max_streams: int):
        self.limit = max(1, int(max_streams))
        self.draining = False
        self.ending = False
        self.streams = 0
        self._busy = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(_ALWAYS_OPEN) or handler.request_streaming:
            return handler
        keep_open = method.rsplit("/", 1)[-1] == "Release"
        parse, serialize = handler.request_deserializer, handler.response_serializer
        gate = self
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.isasyncgenfunction(behavior) if handler.response_streaming else inspect.iscoroutinefunction(behavior)):
            # a thread server's method would run on the loop and get the asyncio context, whose
            # abort it would not await (and a streaming method must be an async generator, a unary
            # one a coroutine): refused, with a status that says why
            async def plain(raw, context):
                await abort(context, grpc.StatusCode.UNIMPLEMENTED,
                            f"{method}: not a coroutine (unary) or async generator (streaming); the asyncio "
                            "server serves only those")

            if handler.response_streaming:
                async def plain_stream(raw, context):
                    await plain(raw, context)
                    yield  # never reached: an async generator, as a streaming response is

                return grpc.unary_stream_rpc_method_handler(plain_stream, response_serializer=serialize)
            return grpc.unary_unary_rpc_method_handler(plain, response_serializer=serialize)

        async def decode(raw, context):
            if parse is None:
                return raw
            try:
                return parse(raw)
            except Exception as e:  # protobuf's DecodeError, or a UTF-8 error in a string field
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {e}", "INVALID_ARGUMENT")

        async def admit(context):
            if gate.draining and not keep_open:
                await abort(context, grpc.StatusCode.UNAVAILABLE, f"{method}: the server is shutting down", SHUTTING_DOWN)

        if not handler.response_streaming:
            async def unary_unary(raw, context):
                await admit(context)
                return await behavior(await decode(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)

        async def unary_stream(raw, context):
            await admit(context)
            gate.streams += 1
            try:
                if gate._busy >= gate.limit:
                    await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{method}: all {gate.limit} streams are busy; retry later", "STREAMS_BUSY")
                gate._busy += 1
                try:
                    responses = behavior(await decode(raw, context), context)
                    try:
                        async for message in responses:
                            yield message
                    finally:
                        await responses.aclose()
                finally:
                    gate._busy -= 1
            finally:
                gate.streams -= 1

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)


class _Health:
    """The asyncio health servicer as :mod:`dflash_grpc.serving` drives the thread-per-stream one:
    ``set`` and ``enter_graceful_shutdown`` callable from any thread but the loop's."""

    def __init__(self, servicer: Any, loop: asyncio.AbstractEventLoop):
        self.servicer = servicer
        self._loop = loop

    def set(self, service: str, status: int) -> None:
        asyncio.run_coroutine_threadsafe(self.servicer.set(service, status), self._loop).result(LOOP_CALL_S)

    def enter_graceful_shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self.servicer.enter_graceful_shutdown(), self._loop).result(LOOP_CALL_S)


class _Stopping:
    """What :meth:`AioServer.stop` returns: ``wait()`` until the server has stopped and its loop ended."""

    def __init__(self, future: concurrent.futures.Future, server: "AioServer"):
        self._future = future
        self._server = server

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        self._server._end_loop()
        return True


class AioServer:
    """A started ``grpc.aio`` server on an event loop of its own thread (:func:`make_aio_server`).

    Attributes:
        loop: the server's event loop (its thread is named ``grpc-aio``).
        server: the ``grpc.aio.Server``.
    """

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 gate: AioGate, pool: concurrent.futures.ThreadPoolExecutor):
        self.server = server
        self.loop = loop
        self._thread = thread
        self._dflash_gate = gate   # read by serving.serve_forever / graceful_stop / streams_in_flight
        self._pool = pool
        self._ended = False

    def stop(self, grace: float | None) -> _Stopping:
        """Stop the server: calls in flight get ``grace`` seconds (None: none), then are cancelled.
        Returns an object whose ``wait()`` blocks until it has stopped (as ``grpc.Server.stop``;
        again after the stop: at once)."""
        if self._ended:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return _Stopping(done, self)
        return _Stopping(asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop), self)

    def _end_loop(self) -> None:
        if not self._ended:
            self._ended = True
            _end_loop(self.loop, self._thread, self._pool)


def _end_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    """Stop ``loop``, wait for its ``thread`` to end, give up ``pool``'s threads."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join(LOOP_CALL_S)
    pool.shutdown(wait=False, cancel_futures=True)


def make_aio_server(
    add_servicers: Callable[[grpc.aio.Server], Iterable[str]],
    address: str,
    max_streams: int = 16,
    *,
    unary_workers: int = UNARY_WORKERS,
    tls: TlsConfig | None = None,
    max_receive_bytes: int | None = None,
    reflection: bool = False,
) -> tuple[AioServer, _Health, int]:
    """Create, bind and start a ``grpc.aio`` server on a new event loop thread, with health
    checking (and reflection if asked): :func:`dflash_grpc.serving.make_server`'s options and
    limits for services whose methods take one request message (:class:`AioGate`).

    Args:
        add_servicers: called on the loop with the ``grpc.aio.Server``; registers servicers
            whose unary methods are coroutines and streaming ones async generators (run on the
            loop; :class:`AioGate` answers any other UNIMPLEMENTED) and returns their full
            service names.
        address: ``host:port``; port 0 picks a free port.
        max_streams: most server-streaming calls at a time (RESOURCE_EXHAUSTED beyond).
        unary_workers: threads grpc keeps for handlers that are not coroutines and that
            :class:`AioGate` does not gate (none of the services registered here: health and
            reflection are asyncio servicers); with ``max_streams`` also grpc's
            ``maximum_concurrent_rpcs``.
        tls: serve TLS with ``tls.cert`` / ``tls.key``; with ``tls.ca`` also require client
            certificates signed by it. None: plaintext.
        max_receive_bytes: most bytes of one received message (at most
            :data:`~dflash_grpc.transport.MAX_MESSAGE_BYTES`; larger: RESOURCE_EXHAUSTED before
            decoding). None: 256 MiB.
        reflection: also serve gRPC server reflection.

    Returns:
        ``(server, health, bound_port)``: the :class:`AioServer`, its health servicer (``set``
        and ``enter_graceful_shutdown`` callable from other threads), every service SERVING.

    Raises:
        RuntimeError: the address could not be bound.
        TlsError: ``tls`` has no certificate, or a file cannot be read.
    """
    credentials = tls.server_credentials() if tls is not None else None
    options = server_options(max_receive_bytes)
    max_streams, unary_workers = max(1, int(max_streams)), max(1, int(unary_workers))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True)
    thread.start()
    pool = concurrent.futures.ThreadPoolExecutor(unary_workers, thread_name_prefix="grpc-aio-sync")
    gate = AioGate(max_streams)

    async def build():
        server = grpc.aio.server(migration_thread_pool=pool, options=options, interceptors=[gate],
                                 maximum_concurrent_rpcs=max_streams + unary_workers)
        names = list(add_servicers(server))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if reflection:
            reflection_service.enable_server_reflection([*names, health.SERVICE_NAME, reflection_service.SERVICE_NAME],
                                                        server)
        port = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"could not bind {address}")
        await server.start()
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server, health_servicer, port

    try:
        server, health_servicer, port = asyncio.run_coroutine_threadsafe(build(), loop).result(LOOP_CALL_S)
    except BaseException:
        _end_loop(loop, thread, pool)
        raise
    return AioServer(server, loop, thread, gate, pool), _Health(health_servicer, loop), port
