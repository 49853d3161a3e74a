"""Server and channel plumbing shared by the three services.

Every server gets the standard gRPC health service (``grpc.health.v1``), server reflection when
asked, the project's message-size limits (:data:`dflash_grpc.transport.GRPC_OPTIONS`: 256 MiB
per message both ways; larger: RESOURCE_EXHAUSTED), optional TLS / mutual TLS, an optional
shared token, and structured logging. Logs are quiet by default (WARNING); ``DFLASH_LOG_LEVEL``
or ``--log-level`` raises them.

TLS (:class:`TlsConfig`, PEM file paths): ``make_server(..., tls=TlsConfig(cert, key, ca))``
serves TLS, and with ``ca`` requires client certificates signed by it. Channels of this process
(:func:`channel`, :func:`wait_healthy`, the orchestrator's peers) follow one process-wide setting,
:func:`set_client_tls`. The services' flags (:func:`add_tls_flags`): ``--tls-cert``,
``--tls-key``, ``--tls-client-ca``, ``--insecure`` and, for a service that calls others,
``--peer-tls-ca``, ``--peer-tls-cert``, ``--peer-tls-key``, ``--peer-tls-server-name``. A
service refuses a non-loopback ``--host`` without TLS unless ``--insecure`` is given.

Who may call (:func:`add_security_flags`): ``make_server(..., auth_token=T)`` answers every call
that does not carry the metadata ``authorization: Bearer T`` with UNAUTHENTICATED (reason
``UNAUTHENTICATED``), the health service excepted; the method is never run, so no session or
slot is touched. The target and draft services take the token from ``--auth-token-file PATH``
(a file only its owner may read or write) or the environment variable ``DFLASH_AUTH_TOKEN``
(:func:`auth_token_from_args`); the orchestrator sends the same token on every call to them
(:func:`add_client_metadata`) and keeps its own public service open. Without a token a target or
draft service on a non-loopback ``--host`` logs a warning: anyone who reaches its port can drive
it (mutual TLS alone does not help when clients of the orchestrator hold certificates of the
same CA). The token is compared in constant time and never logged. Server reflection is off
unless ``--reflection`` (``make_server(..., reflection=True)``).

Graceful shutdown (:func:`serve_forever`, :func:`graceful_stop`; docs/ARCHITECTURE.md, "Owners,
leases and shutdown"): on SIGTERM or SIGINT every health name turns NOT_SERVING, new calls are
refused UNAVAILABLE with reason ``SHUTTING_DOWN`` (health, reflection and ``Release`` calls
excepted), the streams in flight may finish for up to ``shutdown_timeout`` seconds (or the
service's ``drain`` decides), then those left end UNAVAILABLE and the server stops.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import hmac
import json
import logging
import os
import signal
import stat
import sys
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as reflection_service

from dflash_grpc.transport import GRPC_OPTIONS, MAX_MESSAGE_BYTES, TlsConfig, TlsError, abort, is_loopback, open_channel

__all__ = [
    "AUTH_METADATA_KEY", "AUTH_TOKEN_ENV", "GRPC_OPTIONS", "MIN_TOKEN_CHARS", "TlsConfig", "TlsError",
    "add_client_metadata", "add_security_flags", "add_tls_flags", "auth_token_from_args", "bearer", "channel",
    "check_token", "client_metadata", "client_tls", "graceful_stop", "set_client_metadata", "is_loopback", "local_endpoint",
    "make_server", "server_options", "set_local_hop_spin", "stop_local_hop",
    "peer_tls_from_args", "read_token_file", "serve_forever", "server_tls_from_args", "set_client_tls", "setup_logging",
    "start_draining", "streams_in_flight", "wait_healthy",
]

log = logging.getLogger("dflash_grpc.serving")


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


#: :func:`tune_malloc`'s settings: blocks up to this size come from the heap rather than each from
#: its own fresh mapping (glibc's largest), and up to this much free heap is kept for reuse
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 256 << 20


def tune_malloc() -> bool:
    """Let glibc's malloc reuse memory for the large messages of every tick (a batch's feature
    rows: about 1.5 MB per message at 64 streams, built, serialised, sent, received and parsed
    several times per tick across the services).

    By default glibc maps each block of more than 128 KiB afresh and returns it on free (its
    dynamic threshold does not help when two such blocks are live at once: a message's bytes and
    their copy in the message), so every large message faults its pages in again: measured here,
    building and serialising a 1.5 MB message took 3 ms instead of 0.6 (``tools/host_per_item.py``
    issue 23). This raises the mapping threshold to :data:`MALLOC_MMAP_THRESHOLD` and keeps up to
    :data:`MALLOC_TRIM_THRESHOLD` of free heap (``mallopt``), so a process's resident memory stays
    near its peak. Called once at the start of each service's process; returns False where it
    cannot apply (not glibc; ``DFLASH_NO_MALLOC_TUNING`` set)."""
    if os.environ.get("DFLASH_NO_MALLOC_TUNING") or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


#: A garbage collection at least this long is logged by :func:`freeze_heap`'s watch (info), seconds ...
GC_PAUSE_LOG_S = 0.01
#: ... and at least this long, as a warning: the Propose deadline's floor (``--draft-deadline-min-ms``),
#: which a pause of the draft service this long can make a Propose miss
GC_PAUSE_WARN_S = 0.05


class GcPauses:
    """The cyclic garbage collector's pauses in this process, as ``gc.callbacks`` reports them:
    per generation (0, 1, 2) the collections and the longest, in seconds (a pause is the
    collection's wall time: other threads may run while finalisers release the GIL); each
    collection of at least :data:`GC_PAUSE_LOG_S` is logged, at info, or as a warning from
    :data:`GC_PAUSE_WARN_S` (the service's ``name``, generation, milliseconds, objects collected).
    ``clock`` is the time source (seconds; :func:`time.perf_counter`). The hook never raises (it
    may run while the interpreter shuts down)."""

    def __init__(self, name: str = "", clock: Callable[[], float] = time.perf_counter):
        self.name = name
        self.clock = clock
        self.count = [0, 0, 0]
        self.longest_s = [0.0, 0.0, 0.0]
        self._start: float | None = None
        self._log = logging.getLogger("dflash_grpc.gc")

    def __call__(self, phase: str, info: dict) -> None:
        """The ``gc.callbacks`` hook: ``phase`` "start" or "stop", ``info`` its ``generation`` and
        ``collected``."""
        if phase == "start":
            self._start = self.clock()
            return
        if self._start is None:
            return
        try:
            took, self._start = self.clock() - self._start, None
            gen = min(int(info.get("generation", 2)), 2)
            self.count[gen] += 1
            self.longest_s[gen] = max(self.longest_s[gen], took)
            if took >= GC_PAUSE_LOG_S:
                self._log.log(logging.WARNING if took >= GC_PAUSE_WARN_S else logging.INFO,
                              "garbage collection paused this process",
                              extra={"service": self.name, "generation": gen, "ms": round(took * 1e3, 2),
                                     "collected": info.get("collected", 0)})
        except Exception:  # noqa: BLE001 - a collector hook must not raise (logging may be gone at exit)
            pass


#: this process's :class:`GcPauses` once :func:`freeze_heap` has run
gc_pauses: GcPauses | None = None


def freeze_heap(name: str = "") -> bool:
    """Collect once, then move every object alive (the loaded modules, the model, the captured
    graphs' Python side) into the collector's permanent generation (``gc.freeze``), so that no
    later collection walks them; then watch the collector's pauses (:class:`GcPauses` of service
    ``name``, kept in :data:`gc_pauses`, removed at exit). Objects frozen here that later become
    cyclic garbage are never collected: start-up's objects live as long as the service anyway.

    Why: a full (generation 2) collection walks every tracked object, and a service's startup
    leaves a few hundred thousand (torch, triton, grpc, protobuf, the model): 63-99 ms a
    collection on this repo's CPU box after the imports alone (193,000 objects;
    ``benchmarks/cpu-gc``). Under load some young objects of the ticks survive into generation
    2, and now and then a full collection runs in the middle of a step:
    140-224 ms in the draft and target services and 38-58 ms in the orchestrator on an H200 host.
    At 128 streams one such pause in the draft service made a Propose miss its 50 ms deadline in
    most runs, which re-created every drafter session and left speculation at 0.6x plain decoding
    for the level (``benchmarks/gpu/concurrency/run29-128``, ``run29-gc``). With the heap frozen no
    draft or target collection reached 10 ms while serving, the orchestrator's longest was 14 ms,
    and no deadline was missed (``run29-gc``, where the watch also logged the start-up collection
    this function makes; it no longer watches that one). vLLM freezes its heap after capturing its
    graphs for the same reason. Called once by :func:`serve_forever`, when a service has started
    and before it prints ``READY`` (its server already answers by then);
    ``DFLASH_GC_FREEZE=0`` leaves the heap as it is (for measuring; the pauses are still
    watched). Returns whether it froze."""
    global gc_pauses
    froze = os.environ.get("DFLASH_GC_FREEZE", "1") != "0"
    if froze:
        gc.collect()
        gc.freeze()
    if gc_pauses is None:
        gc_pauses = GcPauses(name)
        gc.callbacks.append(gc_pauses)
        atexit.register(lambda hook=gc_pauses: hook in gc.callbacks and gc.callbacks.remove(hook))
    return froze


#: Worker threads :func:`make_server` keeps for unary calls on top of ``max_workers``.
UNARY_WORKERS = 8


class _StreamLimit(grpc.ServerInterceptor):
    """At most ``limit`` streaming RPCs at a time; one more is answered RESOURCE_EXHAUSTED at once
    (reason ``STREAMS_BUSY`` in the trailing metadata ``dflash-reason``).

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
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"{method}: all {self.limit} stream workers are busy; retry later", "STREAMS_BUSY")
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


#: Reason code of a call refused or ended because the server is shutting down
#: (``runtime.errors.Reason.SHUTTING_DOWN``; this package imports nothing of ours).
SHUTTING_DOWN = "SHUTTING_DOWN"

#: Calls a draining server still answers: health, reflection, and releases (they free work).
_ALWAYS_OPEN = ("/grpc.health.", "/grpc.reflection.")


class _DrainGate(grpc.ServerInterceptor):
    """The server's shutdown gate, outermost of :func:`make_server`'s interceptors.

    Counts the streaming calls in flight (:attr:`streams`). Once :attr:`draining`, a new call is
    refused UNAVAILABLE, reason ``SHUTTING_DOWN``, except health, reflection and methods named
    ``Release`` (a draining service must still let its clients free their sessions). Once
    :attr:`ending`, a request stream still open ends UNAVAILABLE / ``SHUTTING_DOWN`` when its next
    message arrives (one waiting for a message ends when the server stops).
    """

    def __init__(self):
        self.draining = False
        self.ending = False
        self._lock = threading.Lock()
        self.streams = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(_ALWAYS_OPEN):
            return handler
        keep_open = method.rsplit("/", 1)[-1] == "Release"
        rs, ss = handler.request_streaming, handler.response_streaming
        des, ser = handler.request_deserializer, handler.response_serializer
        if not rs and not ss:
            behavior = handler.unary_unary

            def unary_unary(request, context):
                self._admit(context, method, keep_open)
                return behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, des, ser)
        if rs and ss:
            behavior = handler.stream_stream

            def stream_stream(request_iterator, context):
                done = self._enter(context, method, keep_open)
                try:
                    yield from behavior(self._requests(request_iterator, context), context)
                finally:
                    done()

            return grpc.stream_stream_rpc_method_handler(stream_stream, des, ser)
        if ss:
            behavior = handler.unary_stream

            def unary_stream(request, context):
                done = self._enter(context, method, keep_open)
                try:
                    yield from behavior(request, context)
                finally:
                    done()

            return grpc.unary_stream_rpc_method_handler(unary_stream, des, ser)
        behavior = handler.stream_unary

        def stream_unary(request_iterator, context):
            done = self._enter(context, method, keep_open)
            try:
                return behavior(self._requests(request_iterator, context), context)
            finally:
                done()

        return grpc.stream_unary_rpc_method_handler(stream_unary, des, ser)

    def _admit(self, context, method: str, keep_open: bool) -> None:
        if self.draining and not keep_open:
            abort(context, grpc.StatusCode.UNAVAILABLE, f"{method}: the server is shutting down", SHUTTING_DOWN)

    def _enter(self, context, method: str, keep_open: bool) -> Callable[[], None]:
        self._admit(context, method, keep_open)
        with self._lock:
            self.streams += 1
        held = [True]

        def done() -> None:
            with self._lock:
                if held[0]:
                    held[0] = False
                    self.streams -= 1

        context.add_callback(done)   # however the call ends
        return done

    def _requests(self, request_iterator, context):
        for request in request_iterator:
            if self.ending:
                abort(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down: its shutdown timeout passed",
                      SHUTTING_DOWN)
            yield request


class _MalformedRequestIsInvalidArgument(grpc.ServerInterceptor):
    """Decode every request message inside the handler, so that bytes that are not the method's
    message end the call with INVALID_ARGUMENT, reason ``INVALID_ARGUMENT`` (grpcio's own decoding
    failure is INTERNAL, "Exception deserializing request!"). Unary requests are decoded before
    the method runs; the messages of a request stream one by one as the method reads them, so a
    malformed message ends its own call only (the server and its other streams go on)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        serialize = handler.response_serializer

        def decode(raw: bytes, context: grpc.ServicerContext):
            try:
                return parse(raw)
            except Exception as e:  # protobuf's DecodeError, or a UTF-8 error in a string field
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {e}", "INVALID_ARGUMENT")

        def decoded(raw_iterator, context: grpc.ServicerContext):
            for raw in raw_iterator:
                yield decode(raw, context)

        if handler.request_streaming and handler.response_streaming:
            behavior = handler.stream_stream

            def stream_stream(raw_iterator, context):
                yield from behavior(decoded(raw_iterator, context), context)

            return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)
        if handler.request_streaming:
            behavior = handler.stream_unary

            def stream_unary(raw_iterator, context):
                return behavior(decoded(raw_iterator, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)
        if handler.response_streaming:
            behavior = handler.unary_stream

            def unary_stream(raw, context):
                yield from behavior(decode(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)
        behavior = handler.unary_unary

        def unary_unary(raw, context):
            return behavior(decode(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)


#: Metadata key of the shared token (value ``Bearer <token>``), as in HTTP.
AUTH_METADATA_KEY = "authorization"

#: Methods every caller may use, token or not (prefix of the full method name).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer(token: str) -> str:
    """The ``authorization`` metadata value that carries ``token``: ``"Bearer <token>"``."""
    return f"Bearer {token}"


class _RequireToken(grpc.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>``; any other is answered
    UNAUTHENTICATED (reason ``UNAUTHENTICATED``) before the method runs. Methods under
    :data:`OPEN_METHOD_PREFIXES` (the health service) are open. The token is compared in
    constant time (``hmac.compare_digest``) and never logged."""

    def __init__(self, token: str):
        self._token = check_token(token).encode("ascii")

    def _allowed(self, metadata) -> tuple[bool, str]:
        values = [v for k, v in (metadata or ()) if k == AUTH_METADATA_KEY]
        if not values:
            return False, "no token"
        if len(values) > 1:
            return False, "more than one authorization value"
        value = values[0]
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
        scheme, _, given = raw.partition(b" ")
        # the scheme is no secret; the token part is compared in constant time whatever the scheme
        same = hmac.compare_digest(given.strip(), self._token)
        return (same and scheme.lower() == b"bearer"), "wrong token"

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        ok, why = self._allowed(handler_call_details.invocation_metadata)
        if ok:
            return handler

        def deny(context) -> None:
            log.info("unauthenticated call refused", extra={"method": method, "peer": context.peer(), "why": why})
            abort(context, grpc.StatusCode.UNAUTHENTICATED,
                  f"{method}: this service takes calls from its orchestrator only (metadata "
                  f"'{AUTH_METADATA_KEY}: Bearer <token>' missing or wrong)", "UNAUTHENTICATED")

        def refuse(request_iterator, context):
            deny(context)
            yield  # never reached: a generator, as a streaming response is

        # A request stream whatever the method's kind (the wire is the same): grpc then runs the
        # refusal without first decoding the request into Python, where a unary handler would
        # wait for the whole message (up to 256 MiB) and copy it. Measured with 96-200 MiB unary
        # requests: the server's peak memory 43-230 MiB instead of 330-940 MiB.
        return grpc.stream_stream_rpc_method_handler(refuse)


def server_options(max_receive_bytes: int | None = None) -> list[tuple[str, Any]]:
    """A server's grpc options: :data:`GRPC_OPTIONS`, with received messages limited to
    ``max_receive_bytes`` (at most :data:`MAX_MESSAGE_BYTES`; None: that limit)."""
    if max_receive_bytes is None:
        return list(GRPC_OPTIONS)
    limit = max(1, min(int(max_receive_bytes), MAX_MESSAGE_BYTES))
    return [*((k, v) for k, v in GRPC_OPTIONS if k != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", limit)]


def make_server(
    add_servicers: Callable[[grpc.Server], Iterable[str]],
    address: str,
    max_workers: int = 16,
    *,
    unary_workers: int = UNARY_WORKERS,
    tls: TlsConfig | None = None,
    max_receive_bytes: int | None = None,
    auth_token: str | None = None,
    reflection: bool = False,
    local_hop: bool = False,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Create, bind and start a gRPC server with health checking (and reflection if asked).

    Messages are limited to 256 MiB each way (:data:`GRPC_OPTIONS`; larger: RESOURCE_EXHAUSTED),
    received ones to ``max_receive_bytes`` when given. A request message (unary, or one of a
    request stream) that does not decode as its method's message ends its call with
    INVALID_ARGUMENT.

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
        tls: serve TLS with ``tls.cert`` / ``tls.key``; with ``tls.ca`` also require client
            certificates signed by it (mutual TLS). None: plaintext.
        max_receive_bytes: most bytes of one received message (at most :data:`MAX_MESSAGE_BYTES`);
            grpc refuses a larger one with RESOURCE_EXHAUSTED after reading its length prefix,
            before decoding it or calling the handler (the status carries no reason). None: 256 MiB.
        auth_token: require every call but the health service's to carry the metadata
            ``authorization: Bearer <auth_token>`` (:func:`bearer`); any other call is answered
            UNAUTHENTICATED, reason ``UNAUTHENTICATED``, before its method runs (and before it
            takes a stream worker). None: every caller may call (the default; the orchestrator's
            public service).
        reflection: also serve gRPC server reflection (``grpc.reflection.v1alpha``), which lists
            the services and their messages. Off by default.
        local_hop: also serve the streaming methods on a same-host Unix socket through the same
            interceptors (:class:`dflash_grpc.localhop.HopServer`; its endpoint:
            :func:`local_endpoint`). :func:`graceful_stop` ends it with the server.

    Returns:
        ``(server, health_servicer, bound_port)``; every service is marked SERVING.

    Raises:
        RuntimeError: the address could not be bound.
        TlsError: ``tls`` has no certificate, or a file cannot be read.
        ValueError: ``auth_token`` is not a usable token (:func:`check_token`).
    """
    interceptors: list[grpc.ServerInterceptor] = [] if auth_token is None else [_RequireToken(auth_token)]
    credentials = tls.server_credentials() if tls is not None else None
    max_workers, unary_workers = max(1, int(max_workers)), max(0, int(unary_workers))
    pool = max_workers + unary_workers
    options = server_options(max_receive_bytes)
    gate = _DrainGate()
    chain = [*interceptors, gate, _StreamLimit(max_workers), _MalformedRequestIsInvalidArgument()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=pool), options=options, interceptors=chain,
                         maximum_concurrent_rpcs=pool)
    server._dflash_gate = gate  # read by serve_forever / graceful_stop / streams_in_flight
    recorder = _Recorder(server)
    names = list(add_servicers(recorder))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection:
        reflection_service.enable_server_reflection([*names, health.SERVICE_NAME, reflection_service.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials is not None else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    server.start()
    if local_hop:
        from dflash_grpc.localhop import HopServer

        limit = dict(options).get("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)
        hop = HopServer(chain, recorder.handlers, max_receive_bytes=limit, max_connections=max_workers + 8)
        hop.start()
        server._dflash_hop = hop
        atexit.register(hop.stop)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


class _Recorder:
    """The server as ``add_servicers`` sees it: every call passes through, and the handlers
    registered are kept (the same-host hop serves them)."""

    def __init__(self, server: grpc.Server):
        self._server = server
        self.handlers: list = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers.extend(handlers)
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self.handlers.append(grpc.method_handlers_generic_handler(service_name, method_handlers))
        self._server.add_registered_method_handlers(service_name, method_handlers)

    def __getattr__(self, name):
        return getattr(self._server, name)


def local_endpoint(server: grpc.Server) -> str:
    """The same-host hop's endpoint of a server of :func:`make_server` (``local_hop=True``),
    for ``ModelInfo.local_endpoint``; ``""`` when it has none."""
    hop = getattr(server, "_dflash_hop", None)
    return hop.endpoint if hop is not None else ""


def set_local_hop_spin(server: grpc.Server, spin) -> None:
    """Set the polling window of the same-host hop's streams of a server of :func:`make_server`
    (:attr:`dflash_grpc.localhop.HopServer.spin`: None or a callable giving seconds); nothing
    where the server has no hop."""
    hop = getattr(server, "_dflash_hop", None)
    if hop is not None:
        hop.spin = spin


def stop_local_hop(server: grpc.Server) -> None:
    """End the same-host hop of a server of :func:`make_server` (if any): its connections
    close and its socket is removed (:func:`graceful_stop` does it after the drain)."""
    hop = getattr(server, "_dflash_hop", None)
    if hop is not None:
        hop.stop()


def streams_in_flight(server: grpc.Server) -> int:
    """Streaming calls in flight on a server of :func:`make_server` (health watches and
    reflection not counted); 0 for another server."""
    gate = getattr(server, "_dflash_gate", None)
    return gate.streams if gate is not None else 0


def start_draining(server: grpc.Server, health_servicer: health.HealthServicer | None = None) -> None:
    """First step of a graceful shutdown (:func:`graceful_stop` does it): every health name
    NOT_SERVING (for good), and new calls refused UNAVAILABLE / ``SHUTTING_DOWN`` (health,
    reflection and ``Release`` excepted; a server of :func:`make_server` only)."""
    if health_servicer is not None:
        health_servicer.enter_graceful_shutdown()
    gate = getattr(server, "_dflash_gate", None)
    if gate is not None:
        gate.draining = True


def graceful_stop(server: grpc.Server, health_servicer: health.HealthServicer, *, shutdown_timeout: float = 5.0,
                  drain: Callable[[float], Any] | None = None, name: str = "server") -> None:
    """Shut a server of :func:`make_server` down gracefully, like vLLM's ``--shutdown-timeout``.

    1. :func:`start_draining`: health NOT_SERVING for every name, new calls refused UNAVAILABLE /
       ``SHUTTING_DOWN``;
    2. ``drain(seconds_left)`` when given (the service's own wait, which decides when it is
       done: e.g. the orchestrator's scheduler finishing its requests and releasing their
       sessions; it should return within the seconds given), else wait until no stream is in
       flight; at most ``shutdown_timeout`` s;
    3. streams still open end UNAVAILABLE / ``SHUTTING_DOWN`` at their next request message
       (handlers the drain ended get 0.5 s to send their status), and the server stops: grpc
       cancels what is left (UNAVAILABLE, no reason), and the same-host hop's connections close.

    Args:
        shutdown_timeout: seconds streams in flight may take to finish (>= 0).
        drain: called with the seconds left; exceptions are logged, not raised.
    """
    log = logging.getLogger(name)
    t0 = time.monotonic()
    deadline = t0 + max(0.0, float(shutdown_timeout))
    start_draining(server, health_servicer)
    log.info("shutting down", extra={"shutdown_timeout_s": shutdown_timeout, "streams": streams_in_flight(server)})
    if drain is not None:
        try:
            drain(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - stop the server whatever the drain did
            log.exception("drain failed")
    else:
        _wait(lambda: streams_in_flight(server) == 0, deadline)
    gate = getattr(server, "_dflash_gate", None)
    if gate is not None:
        gate.ending = True
    # handlers the drain ended (e.g. Generate streams told SHUTTING_DOWN) send their status now
    _wait(lambda: streams_in_flight(server) == 0, time.monotonic() + 0.5)
    log.info("stopped", extra={"seconds": round(time.monotonic() - t0, 2), "streams_cut": streams_in_flight(server)})
    server.stop(grace=0.25).wait()
    stop_local_hop(server)   # its streams still open end as grpc's do: the connection closes


def _wait(done: Callable[[], bool], deadline: float, poll: float = 0.02) -> bool:
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def serve_forever(server: grpc.Server, health_servicer: health.HealthServicer, name: str, port: int, *,
                  shutdown_timeout: float = 5.0, drain: Callable[[float], Any] | None = None) -> None:
    """Freeze the heap (:func:`freeze_heap`), print ``READY <name> port=<port>``, block until SIGINT/SIGTERM, then
    :func:`graceful_stop` (``shutdown_timeout`` seconds for the streams in flight, ``drain``).
    A second signal during the shutdown changes nothing."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    freeze_heap(name)   # what start-up built is never walked by a collection again
    logging.getLogger(name).info("serving", extra={"port": port})
    # The parent (`dflash-grpc serve`) reads this line to learn the bound port.
    print(f"READY {name} port={port}", flush=True)
    while not stop.wait(0.5):
        pass
    graceful_stop(server, health_servicer, shutdown_timeout=shutdown_timeout, drain=drain, name=name)


_client_tls: TlsConfig | None = None
_client_metadata: tuple[tuple[str, str], ...] = ()
_UNSET: Any = object()


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Client interceptor that adds fixed metadata pairs to every call of a channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self.pairs = tuple(pairs)

    def _details(self, details):
        md = [*(details.metadata or ()), *self.pairs]
        return details._replace(metadata=md) if hasattr(details, "_replace") else _CallDetails(details, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def set_client_metadata(pairs: Iterable[tuple[str, str]]) -> None:
    """Set metadata that every channel this process opens with :func:`channel` adds to each of
    its calls (e.g. the shared token of the internal services, the orchestrator's identity).

    Call it at start, before channels are opened (open channels keep their setting). Keys are
    lower-case ASCII (gRPC's rule). Replaces any earlier setting; ``()`` clears it.
    """
    global _client_metadata
    _client_metadata = tuple((str(k).lower(), str(v)) for k, v in pairs)


def add_client_metadata(pairs: Iterable[tuple[str, str]]) -> None:
    """Add pairs to :func:`set_client_metadata`'s, replacing those with the same key."""
    new = {str(k).lower(): str(v) for k, v in pairs}
    set_client_metadata([*((k, v) for k, v in _client_metadata if k not in new), *new.items()])


def client_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata pairs :func:`channel` adds to every call (see :func:`set_client_metadata`)."""
    return _client_metadata


def set_client_tls(tls: TlsConfig | None) -> None:
    """Set the TLS of every channel this process opens with :func:`channel` (and so of
    :func:`wait_healthy` and the orchestrator's peers): None (the default) is plaintext.

    Call it once at start, before channels are opened (open channels keep their setting).

    Raises:
        TlsError: a file of ``tls`` cannot be read.
    """
    global _client_tls
    _client_tls = tls.check() if tls is not None else None


def client_tls() -> TlsConfig | None:
    """The process-wide channel TLS set by :func:`set_client_tls` (None: plaintext)."""
    return _client_tls


def channel(address: str, *, tls: TlsConfig | None = _UNSET) -> grpc.Channel:
    """Channel to ``address`` with the project's message-size limits (:data:`GRPC_OPTIONS`).

    TLS per ``tls`` if given (None: plaintext), else per :func:`set_client_tls`. Every call
    carries the metadata of :func:`set_client_metadata` (none by default).
    """
    ch = open_channel(address, _client_tls if tls is _UNSET else tls)
    return grpc.intercept_channel(ch, _AddMetadata(_client_metadata)) if _client_metadata else ch


def wait_healthy(address: str, timeout: float = 60.0, service: str = "", *, tls: TlsConfig | None = _UNSET) -> None:
    """Poll the standard health service at ``address`` until it reports SERVING.

    The channel is :func:`channel`'s (``tls`` as there).

    Raises:
        TimeoutError: not SERVING within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with channel(address, tls=tls) as ch:
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


# --------------------------------------------------------------------------------------------
# Command-line flags of the services


def add_tls_flags(parser: argparse.ArgumentParser, peers: bool = False) -> None:
    """Add the TLS flags of a service to ``parser`` (one argument group).

    Serving: ``--tls-cert``, ``--tls-key``, ``--tls-client-ca`` (mutual TLS) and ``--insecure``.
    With ``peers`` (a service that calls others): ``--peer-tls-ca``, ``--peer-tls-cert``,
    ``--peer-tls-key``, ``--peer-tls-server-name``. Read them back with
    :func:`server_tls_from_args` and :func:`peer_tls_from_args`.
    """
    g = parser.add_argument_group("TLS (plaintext by default, allowed on loopback only)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (chain)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: require client certificates signed by this CA")
    g.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback --host (anyone on the network can call and read it)")
    if peers:
        g.add_argument("--peer-tls-ca", default=None, metavar="PEM",
                       help="connect to the target/draft services over TLS, trusting this CA")
        g.add_argument("--peer-tls-cert", default=None, metavar="PEM",
                       help="client certificate presented to the services (mutual TLS)")
        g.add_argument("--peer-tls-key", default=None, metavar="PEM", help="private key of --peer-tls-cert")
        g.add_argument("--peer-tls-server-name", default=None, metavar="NAME",
                       help="name the services' certificates are checked against (default: the address's host)")


def server_tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsConfig | None:
    """The serving TLS of :func:`add_tls_flags`'s flags (None: plaintext), files read now.

    Exits through ``parser.error`` (status 2, a clear message) when the flags are incomplete, a
    file cannot be read, or ``args.host`` is not a loopback address while TLS is off and
    ``--insecure`` is not given.
    """
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            parser.error("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if not is_loopback(args.host) and not args.insecure:
            parser.error(
                f"--host {args.host} is not a loopback address: serve TLS there (--tls-cert and --tls-key, plus "
                "--tls-client-ca for mutual TLS) or pass --insecure to accept plaintext on the network"
            )
        return None
    if args.tls_cert is None or args.tls_key is None:
        parser.error("--tls-cert and --tls-key go together")
    try:
        return TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_client_ca).check()
    except TlsError as e:
        parser.error(str(e))


def peer_tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsConfig | None:
    """The peers' channel TLS of :func:`add_tls_flags`'s ``--peer-tls-*`` flags (None: plaintext).

    Any ``--peer-tls-*`` flag turns TLS on (without ``--peer-tls-ca``: the system's roots).
    Exits through ``parser.error`` when the flags are incomplete or a file cannot be read.
    """
    flags = (args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, args.peer_tls_server_name)
    if all(f is None for f in flags):
        return None
    if (args.peer_tls_cert is None) != (args.peer_tls_key is None):
        parser.error("--peer-tls-cert and --peer-tls-key go together")
    try:
        return TlsConfig(cert=args.peer_tls_cert, key=args.peer_tls_key, ca=args.peer_tls_ca,
                         server_name=args.peer_tls_server_name).check()
    except TlsError as e:
        parser.error(str(e))


# --------------------------------------------------------------------------------------------
# Who may call: the internal services' shared token

#: Environment variable a service reads its token from when ``--auth-token-file`` is not given.
AUTH_TOKEN_ENV = "DFLASH_AUTH_TOKEN"

#: Fewest characters of a token (``secrets.token_urlsafe(32)``, what ``dflash-grpc serve`` makes, has 43).
MIN_TOKEN_CHARS = 16


def check_token(token: str) -> str:
    """``token`` if it can serve as the shared token: at least :data:`MIN_TOKEN_CHARS` printable
    ASCII characters, no whitespace (it travels in gRPC metadata).

    Raises:
        ValueError: it cannot; the message never contains the token.
    """
    if not isinstance(token, str) or not token:
        raise ValueError("the token is empty")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("the token must be printable ASCII without whitespace")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token is too short ({len(token)} characters, at least {MIN_TOKEN_CHARS})")
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in file ``path``: its content, surrounding whitespace stripped.

    The file must be readable and writable by its owner only (``chmod 600``): one that group or
    others may read or write is refused, as ssh refuses such a private key.

    Raises:
        ValueError: the file cannot be read, is open to group or others, is empty, or holds no
            usable token (:func:`check_token`); the message names the file, never the token.
    """
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"cannot read token file {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)   # the file read, not whatever the name points to a moment later
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"token file {path} is not a regular file")
        if st.st_mode & 0o066:
            raise ValueError(f"token file {path} may be read or written by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"token file {path}: the token must be printable ASCII without whitespace") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    try:
        return check_token(token)
    except ValueError as e:
        raise ValueError(f"token file {path}: {e}") from None


def add_security_flags(parser: argparse.ArgumentParser, peers: bool = False) -> None:
    """Add the access flags of a service to ``parser`` (one argument group): ``--auth-token-file``
    and ``--reflection``. Read the token back with :func:`auth_token_from_args`.

    ``peers``: the service calls the others (the orchestrator): the token is what it sends to
    them, not what it asks of its own callers.
    """
    g = parser.add_argument_group("access (the internal services take calls from their orchestrator only)")
    if peers:
        help_ = (f"file holding the target and draft services' shared token, sent on every call to them "
                 f"(owner-only file, chmod 600; default: ${AUTH_TOKEN_ENV} if set). The public service stays open")
    else:
        help_ = (f"file holding the shared token every caller must send ('authorization: Bearer <token>'; "
                 f"owner-only file, chmod 600; default: ${AUTH_TOKEN_ENV} if set, else no token: anyone who "
                 f"reaches the port may call)")
    g.add_argument("--auth-token-file", default=None, metavar="PATH", help=help_)
    g.add_argument("--reflection", action="store_true",
                   help="serve gRPC server reflection (lists the services and their messages; off by default)")


def auth_token_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser, *, warn_open: bool = False) -> str | None:
    """The shared token of :func:`add_security_flags`'s ``--auth-token-file`` (:func:`read_token_file`),
    else of the environment variable :data:`AUTH_TOKEN_ENV` (stripped), else None.

    With ``warn_open`` (a target or draft service), no token and a non-loopback ``args.host``
    log a warning: anyone who reaches the port can open sessions and run steps. Call it after
    :func:`setup_logging`.

    Exits through ``parser.error`` (status 2) when the file is refused (unreadable, open to
    group or others, empty, not a usable token) or the variable is set but empty or unusable.
    The token appears in no message.
    """
    path = getattr(args, "auth_token_file", None)
    token: str | None = None
    if path is not None:
        try:
            token = read_token_file(path)
        except ValueError as e:
            parser.error(f"--auth-token-file: {e}")
    elif AUTH_TOKEN_ENV in os.environ:
        try:
            token = check_token(os.environ[AUTH_TOKEN_ENV].strip())
        except ValueError as e:
            parser.error(f"${AUTH_TOKEN_ENV}: {e} (unset it to run without a token)")
    if token is None and warn_open and not is_loopback(getattr(args, "host", "127.0.0.1")):
        log.warning("no auth token: anyone who can reach this port can call every method of this internal service; "
                    "give --auth-token-file (the orchestrator's token)", extra={"host": args.host})
    return token
