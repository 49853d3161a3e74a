"""Server and channel plumbing shared by the three services.

Every server gets the standard gRPC health service (``grpc.health.v1``), server reflection, the
project's message-size limits, and structured logging. Logs are quiet by default (WARNING);
``DFLASH_LOG_LEVEL`` or ``--log-level`` raises them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dflash_grpc.wire import GRPC_OPTIONS


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: ts, level, logger, msg, and any ``extra={...}`` fields."""

    _SKIP = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._SKIP:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str | None = None) -> None:
    """Configure root logging: JSON lines on stderr, level from ``level``, ``DFLASH_LOG_LEVEL`` or WARNING."""
    level = (level or os.environ.get("DFLASH_LOG_LEVEL") or "WARNING").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


#: Worker threads :func:`make_server` keeps for unary calls on top of ``max_workers``.
UNARY_WORKERS = 8


class _StreamLimit(grpc.ServerInterceptor):
    """At most ``limit`` streaming RPCs at a time; one more is answered RESOURCE_EXHAUSTED at once.

    A streaming RPC holds a worker thread for its whole life and grpc has no per-method pools,
    so without this cap long-lived streams could take every worker and leave unary calls
    (health checks, Info, Release) queued behind them.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._gen(handler.stream_stream, method),
                                                         handler.request_deserializer, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._gen(handler.unary_stream, method),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(self._call(handler.stream_unary, method),
                                                    handler.request_deserializer, handler.response_serializer)

    def _enter(self, context, method: str) -> Callable[[], None]:
        if not self._free.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{method}: all {self.limit} stream workers are busy; retry later")
        lock, held = threading.Lock(), [True]

        def release() -> None:
            with lock:
                if held[0]:
                    held[0] = False
                    self._free.release()

        context.add_callback(release)   # however the RPC ends
        return release

    def _gen(self, behavior, method):
        def run(request, context):
            release = self._enter(context, method)
            try:
                yield from behavior(request, context)
            finally:
                release()

        return run

    def _call(self, behavior, method):
        def run(request_iterator, context):
            release = self._enter(context, method)
            try:
                return behavior(request_iterator, context)
            finally:
                release()

        return run


def make_server(
    add_servicers: Callable[[grpc.Server], Iterable[str]],
    address: str,
    max_workers: int = 16,
    *,
    unary_workers: int = UNARY_WORKERS,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Create, bind and start a gRPC server with health checking and reflection.

    Args:
        add_servicers: called with the server; registers servicers and returns their full
            service names (e.g. ``"dflash_grpc.v1.TargetService"``).
        address: ``host:port``; port 0 picks a free port.
        max_workers: worker threads for RPCs, streams included; a streaming RPC holds one for
            its whole life, so size it for the streams expected at once (e.g. one per session).
            At most ``max_workers`` streaming RPCs run at a time; one more is refused with
            RESOURCE_EXHAUSTED.
        unary_workers: threads added to the pool that streams cannot take, so unary calls
            (health, Info, Release, ...) are answered however many streams are open. Beyond
            ``max_workers + unary_workers`` RPCs in flight the server answers
            RESOURCE_EXHAUSTED instead of queueing (``maximum_concurrent_rpcs``).

    Returns:
        ``(server, health_servicer, bound_port)``; every service is marked SERVING.

    Raises:
        RuntimeError: the address could not be bound.
    """
    max_workers, unary_workers = max(1, int(max_workers)), max(0, int(unary_workers))
    pool = max_workers + unary_workers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=pool), options=GRPC_OPTIONS,
                         interceptors=[_StreamLimit(max_workers)], maximum_concurrent_rpcs=pool)
    names = list(add_servicers(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def serve_forever(server: grpc.Server, health_servicer: health.HealthServicer, name: str, port: int) -> None:
    """Block until SIGINT/SIGTERM, then mark NOT_SERVING and stop the server (5 s grace)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger(name).info("serving", extra={"port": port})
    # The parent (`dflash-grpc serve`) reads this line to learn the bound port.
    print(f"READY {name} port={port}", flush=True)
    while not stop.wait(0.5):
        pass
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=5).wait()


def channel(address: str) -> grpc.Channel:
    """Insecure channel to ``address`` with the project's message-size limits."""
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def wait_healthy(address: str, timeout: float = 60.0, service: str = "") -> None:
    """Poll the standard health service at ``address`` until it reports SERVING.

    Raises:
        TimeoutError: not SERVING within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout:.0f} s")
            time.sleep(0.2)
