"""Clients of the target and draft services as the orchestrator uses them.

The scheduler (:mod:`orchestrator.scheduler`) keeps one bidirectional Verify stream and one
Propose stream open for the whole process; each tick sends one message carrying every active
request's item and reads one reply (:func:`open_stream`: a :class:`DirectStreamCall`, whose
exchanges run wholly on the scheduler's thread, or grpcio's threaded :class:`StreamCall`; both
time out precisely).

The drafter is never waited on for long (docs/ARCHITECTURE.md, "Drafter deadlines and circuit
breaker"): each Propose gets a deadline of a few of its measured round trips
(:class:`DraftDeadline`), and a miss or a failed call opens the drafter's circuit
(:class:`CircuitBreaker`, held by :class:`DraftPeer`) until the drafter answers a probe.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import queue
import select
import socket
import struct
import threading
import time
from multiprocessing.connection import Client
from typing import Any, Callable

import grpc

from dflash_grpc import localhop, serving
from dflash_grpc.localhop import REPLY, endpoint_path, on_socket, parse_status, recv_frame, send_buffers, widen
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from orchestrator import metrics
from orchestrator.messages import parse_verify_reply

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
    another target (fingerprints differ), or a field does not fit the target (``vocab_size``,
    ``hidden_size``, ``target_layer_ids`` beyond its layers, ``mask_token_id`` outside its
    vocabulary; fields the target leaves 0 are not checked)."""
    if info.target_fingerprint != target.model_fingerprint:
        at = f" at {address}" if address else ""
        return (f"the drafter{at} was built for target {info.target_fingerprint[:12]}, "
                f"not for the served target {target.model_fingerprint[:12]}")
    if info.model.vocab_size != target.vocab_size:
        return "drafter vocabulary differs from the target's"
    if target.hidden_size and info.model.hidden_size != target.hidden_size:
        return f"drafter hidden_size {info.model.hidden_size} differs from the target's {target.hidden_size}"
    if target.num_layers and any(not 0 <= i < target.num_layers for i in info.target_layer_ids):
        return f"drafter target_layer_ids {list(info.target_layer_ids)} beyond the target's {target.num_layers} layers"
    if target.vocab_size and not 0 <= info.mask_token_id < target.vocab_size:
        return f"drafter mask_token_id {info.mask_token_id} outside the target vocabulary [0, {target.vocab_size})"
    return None


class ExchangeTimeout(grpc.RpcError):
    """No reply within an exchange's timeout: the stream was cancelled (:meth:`StreamCall.exchange`).

    A ``grpc.RpcError`` whose :meth:`code` is DEADLINE_EXCEEDED, so callers that handle failed
    calls handle it too; ``timeout`` is the timeout that passed (seconds)."""

    def __init__(self, timeout: float):
        super().__init__(f"no reply within {timeout * 1e3:.0f} ms")
        self.timeout = timeout

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple:
        return ()


class _Watched:
    """What both stream kinds share: the per-exchange deadline watch (a thread per stream that
    sleeps until the deadline of the exchange in flight and then cancels the stream), and the
    ``broken`` / ``close`` bookkeeping. A subclass provides :meth:`_cancel`."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._deadline: float | None = None  # of the exchange in flight (monotonic s)
        self._watching = float("inf")          # the deadline the watch thread sleeps toward
        self._closed = False
        self._expired = False                  # the watch thread cancelled the stream
        self._watchdog: threading.Thread | None = None

    def _cancel(self) -> None:
        raise NotImplementedError

    def _watch(self) -> None:
        # ``_deadline`` is written by the caller without the lock (one attribute store); the caller
        # notifies (under the lock) only when its deadline is earlier than ``_watching``, which is
        # therefore set to infinity before ``_deadline`` is read: a deadline stored after that read
        # sees infinity and notifies, one stored before it is read here.
        with self._cond:
            while not self._closed:
                self._watching = float("inf")
                deadline = self._deadline
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._watching = deadline
                    self._cond.wait(left)
                    continue
                self._expired = True
                break
            self._watching = float("inf")
            expired = self._expired
        if expired:
            self._cancel()

    def _timed(self, timeout: float, exchange: Callable[[], Any]) -> Any:
        """``exchange()`` under a deadline of ``timeout`` seconds (:meth:`_arm`): its reply, or
        :class:`ExchangeTimeout` when the watch cancelled the stream first."""
        self._arm(timeout)
        try:
            return exchange()
        except grpc.RpcError as e:
            if self._expired:
                raise ExchangeTimeout(timeout) from e
            raise
        finally:
            self._deadline = None

    def _arm(self, timeout: float) -> None:
        """Watch the exchange about to start: cancel the stream ``timeout`` seconds from now."""
        deadline = time.monotonic() + timeout
        self._deadline = deadline
        if deadline < self._watching:  # the watch thread sleeps past it (or idles): wake it
            with self._cond:
                self._cond.notify()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def broken(self) -> bool:
        """The stream was cancelled (closed, or a deadline passed: possibly just after an exchange
        got its reply in time), so the next exchange would fail: open a new one instead."""
        return self._expired or self._closed

    def _stop_watch(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class StreamCall(_Watched):
    """One open bidirectional stream used as a sequence of request/reply exchanges.

    Raises ``grpc.RpcError`` from :meth:`exchange` when the stream fails, and
    :class:`ExchangeTimeout` (a ``grpc.RpcError`` too) when a reply is later than the exchange's
    timeout. A timed-out stream is cancelled, so its late reply can never be read as a later
    exchange's: the caller opens a new ``StreamCall``.

    The timeout is watched by one thread per stream that sleeps until the deadline of the
    exchange in flight (``threading.Condition.wait`` with the exact time left, so a timeout fires
    within a millisecond or so of its deadline, not on a polling grain). The caller's thread reads
    the reply itself, as without a timeout, so the happy path gains no thread hand-off; the watch
    thread is woken only when an exchange's deadline is earlier than the one it sleeps toward
    (in steady ticks it wakes about once per timeout, not once per exchange).

    grpcio's own streaming path: a request reaches the wire through grpcio's request-iterator
    thread and the reply through its channel thread. :class:`DirectStreamCall` keeps the same
    contract without either (:func:`open_stream` picks it where it can).
    """

    def __init__(self, method, timeout: float | None = None):
        super().__init__()
        self._q: queue.Queue = queue.Queue()
        self._responses = method(iter(self._q.get, _END), timeout=timeout)

    def _cancel(self) -> None:
        self._responses.cancel()

    def exchange(self, request, timeout: float | None = None, on_sent: Callable[[], None] | None = None):
        """Send ``request`` and wait for its reply.

        Args:
            timeout: seconds to wait for the reply (None: no limit). Past it the stream is
                cancelled and :class:`ExchangeTimeout` raised, so a hung or stopped peer cannot
                hang the caller; the stream is then unusable (every later exchange raises).
            on_sent: called once the request is on its way, before the wait (work that may
                overlap the peer's: the scheduler hands the last tick's tokens to their
                handlers there). Every stream kind calls it exactly once per exchange.

        Raises:
            ExchangeTimeout: no reply within ``timeout``.
            grpc.RpcError: the stream failed (or was closed).
        """
        def send_and_read():
            self._q.put(request)
            if on_sent is not None:
                on_sent()
            return next(self._responses)

        return send_and_read() if timeout is None else self._timed(timeout, send_and_read)

    def close(self) -> None:
        """Half-close and cancel the stream (idempotent)."""
        self._stop_watch()
        self._q.put(_END)
        self._responses.cancel()


class StreamError(grpc.RpcError):
    """A :class:`DirectStreamCall` that failed: the stream's status (``code``, ``details``) and
    trailing metadata (where the peer's reason code is: :func:`dflash_grpc.transport.reason_of`),
    as a ``grpc.RpcError`` raised from a failed grpcio call carries them."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, tuple(trailing or ())

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


try:  # grpcio's internals that DirectStreamCall drives (absent or changed: StreamCall serves)
    from grpc import _channel as _grpc_channel
    from grpc import _interceptor as _grpc_interceptor
    from grpc._cython import cygrpc as _cygrpc

    _OP = _cygrpc.OperationType
    _RECV_MESSAGE, _RECV_STATUS = _OP.receive_message, _OP.receive_status_on_client
except (ImportError, AttributeError):  # pragma: no cover - another grpcio
    _cygrpc = None

#: Use :class:`DirectStreamCall` where the channel allows it (:func:`open_stream`); False: always
#: grpcio's threaded path (:class:`StreamCall`).
DIRECT_STREAMS = True

_EXCHANGE, _STATUS, _OTHER = "exchange", "status", "other"


def _direct_target(channel) -> tuple[object, tuple] | None:
    """The core channel under ``channel`` and the metadata its interceptors add to every call, or
    None when that cannot be known: a channel of :func:`dflash_grpc.serving.channel` (plain, or
    intercepted only to add fixed metadata pairs) qualifies."""
    if _cygrpc is None:
        return None
    pairs: list = []
    while isinstance(channel, _grpc_interceptor._Channel):
        extra = getattr(channel._interceptor, "pairs", None)   # serving's metadata interceptor
        if extra is None:
            return None                                         # an interceptor we cannot replay
        pairs.extend(extra)
        channel = channel._channel
    if not isinstance(channel, _grpc_channel.Channel):
        return None
    core = getattr(channel, "_channel", None)
    if core is None or not hasattr(core, "segregated_call"):
        return None
    return core, tuple((str(k), v) for k, v in pairs)


def _call_metadata(channel) -> tuple:
    """The metadata a call on ``channel`` carries (its interceptors' pairs, :func:`_direct_target`;
    else :func:`dflash_grpc.serving.client_metadata`): what a same-host hop call sends in its hello."""
    target = _direct_target(channel)
    return target[1] if target is not None else serving.client_metadata()


class DirectStreamCall(_Watched):
    """:class:`StreamCall`'s contract (exchanges, a precise timeout per exchange, ``broken``,
    ``close``) with every exchange run on the caller's thread.

    grpcio's streaming API hands each request to a thread of its own (the request iterator's)
    and each reply back from another (the channel's); on a loaded host each hand-off costs a
    thread wake-up, a large part of a step's round trip (tools/hop_overhead.py). Here the stream
    is one grpcio "segregated" call (the kind grpcio's blocking unary calls use), with its own
    completion queue: an exchange starts one batch (send the request, receive the reply) and the
    caller's thread waits on that queue itself. The deadline watch thread cancels the call as
    :class:`StreamCall`'s does. Built by :func:`open_stream` (which falls back to
    :class:`StreamCall` where grpcio's internals differ); not for use by several threads at once
    (the scheduler's thread alone exchanges, as with :class:`StreamCall`).

    Args:
        core: the core channel (:func:`_direct_target`).
        method: the full method name, e.g. ``/dflash_grpc.v1.TargetService/Verify``.
        deserialize: bytes -> reply message.
        metadata: the call's metadata pairs.
        timeout: seconds the whole stream may live (None: no limit).

    Raises:
        StreamError: UNAVAILABLE, the channel is closed.
    """

    def __init__(self, core, method: str, deserialize, metadata: tuple = (), timeout: float | None = None):
        super().__init__()
        self._deserialize = deserialize
        self._lock = threading.Lock()     # held while the call's queue is read
        self._due = 0                     # batches started and not yet seen on the queue
        self._reply: bytes | None = None
        self._status: StreamError | None = None   # the stream's end, once known
        self._error: grpc.RpcError | None = None  # what every later exchange raises
        deadline = None if timeout is None else time.time() + timeout
        c = _cygrpc
        ops = (((c.SendInitialMetadataOperation(metadata, 0),), _OTHER),
               ((c.ReceiveInitialMetadataOperation(0),), _OTHER),
               ((c.ReceiveStatusOnClientOperation(0),), _STATUS))
        try:
            self._call = core.segregated_call(c.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method.encode(), None,
                                              deadline, metadata, None, ops, None, None)
        except ValueError as e:   # the channel is closed
            raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot open the stream: {e}") from None
        self._due = len(ops)

    # ---- the call's completion queue (caller's thread, ``_lock`` held)
    def _pump(self) -> str:
        """Wait for the next completed batch; note a reply or the stream's status; its tag."""
        event = self._call.next_event()   # the GIL is released while it waits
        self._due -= 1
        for op in event.batch_operations:
            kind = op.type()
            if kind == _RECV_MESSAGE:
                self._reply = op.message()
            elif kind == _RECV_STATUS:
                details = op.details()
                details = details.decode("utf-8", "replace") if isinstance(details, bytes) else str(details or "")
                self._status = StreamError(status_code(op.code()), details, op.trailing_metadata())
        return event.tag

    def _finish(self) -> grpc.RpcError:
        """The stream ended: read its status and every batch still due (the call is then freed;
        the queue must never be read again), and keep the error later exchanges raise."""
        if self._error is None:
            while self._due and self._status is None:
                self._pump()
            while self._due:
                self._pump()
            status = self._status or StreamError(grpc.StatusCode.UNAVAILABLE, "the stream ended")
            if status.code() == grpc.StatusCode.OK:   # ended by the peer without an error: still unusable
                status = StreamError(grpc.StatusCode.UNAVAILABLE, "the peer ended the stream", status.trailing_metadata())
            self._error = status
        return self._error

    def _cancel(self, details: str = "Locally cancelled by application!") -> None:
        if self._error is None:
            try:
                self._call.cancel(_cygrpc.StatusCode.cancelled, details)
            except ValueError:   # grpcio refused the cancel: the call is over already
                pass

    # ---- the contract
    def exchange(self, request, timeout: float | None = None, on_sent: Callable[[], None] | None = None):
        """Send ``request`` and wait for its reply (as :meth:`StreamCall.exchange`).

        Raises:
            ExchangeTimeout: no reply within ``timeout`` (the stream is cancelled).
            grpc.RpcError: the stream failed, ended or was closed (:class:`StreamError`).
        """
        with self._lock:
            if self._error is not None:
                if on_sent is not None:
                    on_sent()
                raise self._error
            if timeout is None:
                return self._exchange(request, on_sent)
            return self._timed(timeout, lambda: self._exchange(request, on_sent))

    def _exchange(self, request, on_sent=None):
        c = _cygrpc
        self._reply = None
        started = self._call.operate((c.SendMessageOperation(request.SerializeToString(), 0),
                                      c.ReceiveMessageOperation(0)), _EXCHANGE)
        if on_sent is not None:
            on_sent()
        if not started:
            raise self._finish()
        self._due += 1
        while self._pump() != _EXCHANGE:
            pass
        reply = self._reply
        if reply is None:            # no reply: the stream ended (or was cancelled)
            raise self._finish()
        try:
            return self._deserialize(reply)
        except Exception as e:  # noqa: BLE001 - a reply that does not decode ends the stream
            self._cancel("the reply did not decode")
            self._finish()
            self._error = StreamError(grpc.StatusCode.INTERNAL, f"the reply did not decode: {e}")
            raise self._error from None

    def close(self) -> None:
        """Cancel the stream (idempotent) and, unless an exchange is reading it now (that one
        then does), read what is left of it so the call is freed."""
        self._stop_watch()
        self._cancel()
        if self._lock.acquire(blocking=False):
            try:
                self._finish()
            finally:
                self._lock.release()


def open_stream(channel, method: str, multicallable, deserialize, timeout: float | None = None,
                direct: bool | None = None):
    """A stream of exchanges on ``channel``: a :class:`DirectStreamCall` where ``direct`` (None:
    :data:`DIRECT_STREAMS`) and the channel allow it (:func:`_direct_target`), else a
    :class:`StreamCall` over ``multicallable`` (the stub's method)."""
    target = _direct_target(channel) if (DIRECT_STREAMS if direct is None else direct) else None
    if target is not None:
        return DirectStreamCall(target[0], method, deserialize, target[1], timeout)
    return StreamCall(multicallable, timeout)


class LocalHopCall:
    """:class:`StreamCall`'s contract (exchanges, a precise timeout per exchange, ``broken``,
    ``close``) over a service's same-host hop (:mod:`dflash_grpc.localhop`): a Unix socket
    instead of gRPC, the same messages, the same handlers and interceptors on the service's side.

    An exchange sends the request's bytes and waits on the socket (``poll(timeout)``, the GIL
    released) for the answer: no thread besides the caller's, no watchdog. A missed deadline
    closes the connection (the service's call then ends as a cancelled gRPC stream does) and
    raises :class:`ExchangeTimeout`; a status answer raises :class:`StreamError` with the
    service's code, details and reason. Made by :func:`open_local` (the hello and the nonce check);
    not for use by several threads at once.
    """

    def __init__(self, conn, deserialize):
        self._conn = conn
        self._deserialize = deserialize
        self._error: grpc.RpcError | None = None
        self._closed = False
        self._poller = None   # a poll object on the connection, made once (conn.poll makes a selector per call)
        #: seconds to poll for the reply before blocking (None: :data:`dflash_grpc.localhop.SPIN_S`);
        #: the scheduler sets it per exchange (``Scheduler.hop_spin``)
        self.spin_s: float | None = None

    def _ready(self, timeout: float) -> bool:
        """Whether the reply (or the connection's end) arrives within ``timeout`` seconds, as
        ``conn.poll(timeout)`` tells, without its ~10 us of making a selector per call; polled
        without blocking for the first :attr:`spin_s` seconds (default
        :data:`dflash_grpc.localhop.SPIN_S`), if set."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._conn.fileno(), select.POLLIN)
        spin = localhop.SPIN_S if self.spin_s is None else self.spin_s
        if spin > 0:
            t0 = time.perf_counter()
            if localhop.spin_wait(poller, min(spin, timeout)):
                return True
            timeout -= time.perf_counter() - t0
        return bool(poller.poll(math.ceil(max(0.0, timeout) * 1e3)))

    @property
    def broken(self) -> bool:
        """The stream is over (closed, failed or timed out): open a new one."""
        return self._closed or self._error is not None

    def _fail(self, error: grpc.RpcError) -> grpc.RpcError:
        self._error = error
        self._shut()
        return error

    def _shut(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass

    def exchange(self, request, timeout: float | None = None, on_sent: Callable[[], None] | None = None):
        """Send ``request`` and wait for its reply (as :meth:`StreamCall.exchange`, ``on_sent``
        included).

        Raises:
            ExchangeTimeout: no reply within ``timeout`` (the stream is closed).
            grpc.RpcError: the service ended the call (:class:`StreamError`, its code and
                reason), the connection was lost (UNAVAILABLE) or the stream was closed.
        """
        if self._error is not None or self._closed:
            if on_sent is not None:
                on_sent()
            if self._error is not None:
                raise self._error
            raise StreamError(grpc.StatusCode.CANCELLED, "the stream is closed")
        conn = self._conn
        try:
            try:
                pieces = getattr(request, "pieces", None)   # (wire bytes in pieces: orchestrator.messages.Serialized)
                if pieces is not None:
                    send_buffers(conn, pieces)
                else:
                    conn.send_bytes(request.SerializeToString())
            finally:
                if on_sent is not None:
                    on_sent()
            if timeout is not None and not self._ready(timeout):
                raise self._fail(ExchangeTimeout(timeout))
            answer = recv_frame(conn)   # (into one buffer of the reply's size: issue 23)
        except (OSError, EOFError) as e:
            if self._error is not None:
                raise self._error from None
            answer = self._last_word()   # the service ended the call (its status) before our send
            if answer is None:
                raise self._fail(StreamError(grpc.StatusCode.UNAVAILABLE, f"the local hop connection was lost: {e}")) from None
        if answer[:1] == REPLY:
            try:
                return self._deserialize(answer[1:])   # (a view: no copy of the reply's bytes)
            except Exception as e:  # noqa: BLE001 - a reply that does not decode ends the stream
                raise self._fail(StreamError(grpc.StatusCode.INTERNAL, f"the reply did not decode: {e}")) from None
        try:
            code, details, trailing = parse_status(bytes(answer[1:]))
        except (ValueError, UnicodeDecodeError) as e:
            raise self._fail(StreamError(grpc.StatusCode.INTERNAL, f"malformed status from the local hop: {e}")) from None
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.UNAVAILABLE, "the peer ended the stream"
        raise self._fail(StreamError(code, details, trailing))

    def _last_word(self) -> bytes | None:
        """An answer the service sent before the connection broke (its final status), if any."""
        try:
            return self._conn.recv_bytes() if self._conn.poll(0) else None
        except (OSError, EOFError):
            return None

    def close(self) -> None:
        """End the stream (idempotent)."""
        if not self._closed:
            self._closed = True
            self._shut()

    def interrupt(self) -> None:
        """End the call from another thread: the socket is shut down both ways, so a thread
        waiting for the reply wakes (its exchange fails) and the service sees the call end; the
        waiting thread closes the connection (closing alone would not wake its ``poll``)."""
        on_socket(self._conn, lambda s: s.shutdown(socket.SHUT_RDWR))


#: Use a peer's same-host hop (:class:`LocalHopCall`) when it offers one (:func:`open_local`);
#: False: always gRPC. The orchestrator's ``--no-local-hop`` sets it.
LOCAL_HOP = True

#: Send Prefill over the target's hop too (:meth:`TargetPeer.prefill_future`) where the Verify
#: stream may go; ``DFLASH_PREFILL_HOP=0`` in the environment: over gRPC (an A/B switch for
#: benchmarks).
PREFILL_HOP = os.environ.get("DFLASH_PREFILL_HOP", "1") not in ("0", "false", "no")


def open_local(endpoint: str, method: str, deserialize, metadata: tuple = (), timeout: float = 5.0) -> "LocalHopCall | None":
    """A :class:`LocalHopCall` for ``method`` on the hop at ``endpoint`` (a peer's
    ``ModelInfo.local_endpoint``), or None when there is none to use: empty, or its socket is not
    on this host (:func:`dflash_grpc.localhop.endpoint_path`).

    Raises:
        StreamError: the socket exists but the hop refused the call (its code: e.g.
            UNAUTHENTICATED, RESOURCE_EXHAUSTED), did not answer the hello within ``timeout``
            seconds, or answered with another nonce (another service now owns the path): the
            caller falls back to gRPC or reports it.
    """
    where = endpoint_path(endpoint)
    if where is None:
        return None
    path, nonce = where
    try:
        conn = Client(path, family="AF_UNIX")
    except OSError as e:
        raise StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot reach the local hop: {e}") from None
    widen(conn)   # (a tick's feature rows in one write, not in pieces)
    try:
        try:
            conn.send_bytes(json.dumps({"method": method, "metadata": [[str(k), str(v)] for k, v in metadata]}).encode())
        except OSError:
            if not conn.poll(0):   # no answer (a refusal sent before it closed) to read either
                raise
        if not conn.poll(timeout):
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the local hop did not answer its hello")
        answer = conn.recv_bytes()
        if answer[:1] != REPLY:
            raise StreamError(*parse_status(answer[1:]))
        if json.loads(answer[1:].decode("utf-8")).get("nonce") != nonce:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the local hop belongs to another service")
    except (OSError, EOFError, ValueError) as e:
        conn.close()
        raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the local hop failed its hello: {e}") from None
    except BaseException:
        conn.close()
        raise
    return LocalHopCall(conn, deserialize)


def _stream(channel, endpoint: str, method: str, multicallable, deserialize, timeout: float | None,
            direct: bool | None, local: bool | None, kind: str):
    """The fastest stream a peer offers: its same-host hop (``local``, None: :data:`LOCAL_HOP`),
    else :func:`open_stream`. A hop that refuses the hello is logged and gRPC used instead."""
    if (LOCAL_HOP if local is None else local) and endpoint:
        metadata = _call_metadata(channel)
        try:
            call = open_local(endpoint, method, deserialize, metadata)
        except StreamError as e:
            log.info("same-host hop refused; using gRPC", extra={"peer": kind, "code": e.code().name, "error": e.details()[:200]})
            call = None
        if call is not None:
            return call
    return open_stream(channel, method, multicallable, deserialize, timeout, direct)


class HopRefused(Exception):
    """:func:`hop_unary`: the hop did not take the call (its hello refused: ``code``), so the
    caller uses gRPC; UNIMPLEMENTED means a service whose hop serves no unary method (an older
    one), worth not asking again."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


def _receive_timeout(call: "LocalHopCall", seconds: float) -> None:
    """Bound every blocking read of ``call``'s socket by ``seconds`` (``SO_RCVTIMEO``): a reply
    that stops halfway then fails the read (UNAVAILABLE) instead of blocking its thread forever."""
    sec = max(0.001, float(seconds))
    on_socket(call._conn, lambda s: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                                  struct.pack("ll", int(sec), int((sec % 1) * 1e6))))


def hop_unary(endpoint: str, method: str, request, deserialize, timeout: float, metadata: tuple = (),
              on_open: Callable[["LocalHopCall"], None] | None = None):
    """One unary call over a peer's same-host hop (:mod:`dflash_grpc.localhop`: a connection for
    the call, its hello, the request, the answer), all within ``timeout`` seconds; None when the
    hop is not on this host. ``on_open`` gets the open call first (to close it from another
    thread: :meth:`HopFuture.cancel`).

    Raises:
        HopRefused: the hop refused the hello (e.g. every connection busy, or no unary methods):
            the caller uses gRPC.
        ExchangeTimeout: no answer within the time left (the connection is closed, which the
            service's call sees as its end: the target's Prefill then releases what it opened).
        grpc.RpcError: the service's status (:class:`StreamError`: its code, details and reason),
            a lost connection or an answer that stopped halfway (UNAVAILABLE).
    """
    deadline = time.monotonic() + timeout
    try:
        call = open_local(endpoint, method, deserialize, metadata, timeout=min(5.0, max(0.05, timeout)))
    except StreamError as e:
        raise HopRefused(e.code(), e.details()) from None
    if call is None:
        return None
    call.spin_s = 0.0   # (a worker thread: block in the kernel at once, never spin beside the scheduler)
    try:
        if on_open is not None:
            on_open(call)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExchangeTimeout(timeout)
        _receive_timeout(call, left)
        return call.exchange(request, left)
    finally:
        call.close()


class HopFuture:
    """A unary call over the same-host hop on a thread of its own, with the part of
    ``grpc.Future`` the scheduler uses (``done``, ``result``, ``add_done_callback``, ``cancel``),
    so that a Prefill goes over the hop exactly where it went over gRPC
    (:meth:`TargetPeer.prefill_future`). ``call(deadline, on_open)`` makes the call (returning
    None where the hop turns out not to be on this host, raising :class:`HopRefused` where it
    refuses), ``fallback(deadline)`` the same over gRPC, blocking; ``deadline`` is
    ``time.monotonic()`` seconds fixed when the future is made, as gRPC's is.

    As gRPC's: calls run at once, each on its own thread (they wait in ``poll``), not in waves of a
    pool; the threads are daemons, so a process that exits does not wait for them; :meth:`cancel`
    shuts the call's connection down (:meth:`LocalHopCall.interrupt`: the service sees its call
    end, as a cancelled gRPC call, and the target's Prefill releases the sessions it opened) and
    the result is CANCELLED. Whatever the call raises reaches :meth:`result` as a
    ``grpc.RpcError``.
    """

    def __init__(self, call: Callable[[float, Callable], Any], fallback: Callable[[float], Any], timeout: float):
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._call: LocalHopCall | None = None
        self._cancelled = False
        deadline = time.monotonic() + timeout

        def opened(c: "LocalHopCall") -> None:
            with self._lock:
                self._call = c
                cancelled = self._cancelled
            if cancelled:
                c.interrupt()

        def run() -> None:
            try:
                try:
                    reply = call(deadline, opened)
                except HopRefused:
                    reply = None
                if reply is None:
                    if self._cancelled:
                        raise StreamError(grpc.StatusCode.CANCELLED, "the call was cancelled")
                    reply = fallback(deadline)
            except BaseException as e:  # noqa: BLE001 - every failure as an RpcError, as gRPC's futures
                if self._cancelled:
                    e = StreamError(grpc.StatusCode.CANCELLED, "the call was cancelled")
                elif not isinstance(e, grpc.RpcError):
                    e = StreamError(grpc.StatusCode.UNAVAILABLE, f"the call failed: {type(e).__name__}: {e}")
                self._future.set_exception(e)
                return
            self._future.set_result(reply)

        try:
            threading.Thread(target=run, name="hop-unary", daemon=True).start()
        except RuntimeError as e:   # (the interpreter is shutting down)
            self._future.set_exception(StreamError(grpc.StatusCode.UNAVAILABLE, f"cannot start the call: {e}"))

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None):
        """The reply; raises ``grpc.RpcError`` (the call's status), or
        ``concurrent.futures.TimeoutError`` when ``timeout`` passes first."""
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """End the call if it has not ended: its connection is shut down and the result becomes
        CANCELLED. Returns whether it was still running."""
        with self._lock:
            if self._future.done():
                return False
            self._cancelled = True
            call = self._call
        if call is not None:
            call.interrupt()
        return True

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))


class DraftDeadline:
    """How long one Propose exchange may take before the drafter counts as failed.

    ``timeout = max(clamp(factor x expected, min_s, max_s), min(held_rows x row_s, max_s)) +
    extra_rows x row_s``, at most ``cap_s``, where ``expected`` is the exponential moving average (weight ``alpha``) of the round trips
    of successful steady exchanges, scaled up by ``items / (their mean items)`` when an exchange
    carries more items than they did (the reference engine's step grows with the batch; the
    batched one barely does, so this only errs long). Before any measurement ``expected`` is
    unknown and the clamp gives ``max_s``. ``extra_rows`` are feature rows beyond a step's worth
    (new or re-created drafter sessions: a prompt or recomputed rows), each allowed ``row_s``
    more, as those exchanges take longer than a step and are not measured. ``held_rows`` are the
    rows the drafter already holds for the exchange's sessions: a miss re-creates every one of
    them from rows the target recomputes (docs/ARCHITECTURE.md, "Drafter deadlines and circuit
    breaker"), so the deadline waits as long as that recovery would take at ``row_s`` a row (up to
    ``max_s``) before it calls the drafter failed: under load a pause shorter than the recovery
    no longer sets it off.

    Args:
        factor: deadline in measured round trips; 0 turns the deadline off (``cap_s`` only).
        min_s, max_s: bounds of the clamp, seconds.
        row_s: seconds allowed per extra feature row.
        cap_s: the most any exchange may take (the step timeout); None: no cap.
        alpha: weight of a new round trip in the moving averages (0 < alpha <= 1).

    Not thread-safe: the scheduler thread alone uses it.
    """

    def __init__(self, factor: float, min_s: float, max_s: float, row_s: float = 0.0, cap_s: float | None = None,
                 alpha: float = 0.2):
        self.factor, self.min_s, self.max_s, self.row_s, self.cap_s, self.alpha = factor, min_s, max_s, row_s, cap_s, alpha
        self.step_s: float | None = None  # moving average of steady round trips, seconds
        self.items = 1.0                  # moving average of their items

    def timeout(self, items: int = 1, extra_rows: int = 0, held_rows: int = 0) -> float | None:
        """Seconds the next exchange of ``items`` items carrying ``extra_rows`` extra feature rows,
        for sessions holding ``held_rows`` rows on the drafter, may take (None: no limit)."""
        if self.factor <= 0:
            return self.cap_s
        if self.step_s is None:
            t = self.max_s
        else:
            t = min(self.max_s, max(self.min_s, self.factor * self.step_s * max(1.0, items / self.items)))
        t = max(t, min(self.max_s, held_rows * self.row_s))   # (never a recovery dearer than the wait)
        t += extra_rows * self.row_s
        return t if self.cap_s is None else min(t, self.cap_s)

    def observe(self, seconds: float, items: int = 1) -> None:
        """Count a successful steady exchange of ``items`` items that took ``seconds``."""
        if self.step_s is None:
            self.step_s, self.items = seconds, float(items)
        else:
            self.step_s += self.alpha * (seconds - self.step_s)
            self.items += self.alpha * (items - self.items)


class CircuitBreaker:
    """The drafter's circuit, as the scheduler sees it.

    * ``closed``: Propose calls are sent (each with its :class:`DraftDeadline`).
    * ``open``: after a missed deadline or a failed call (:meth:`failed`): no Propose is sent;
      ticks decode plainly at full speed. The drafter's Info is probed in the background.
    * ``half_open``: a probe was answered (:meth:`probe_answered`): the next tick sends one
      Propose; :meth:`succeeded` closes the circuit, :meth:`failed` opens it again.

    ``failures`` counts failures since the last success; :meth:`probe_delay` spaces the probes
    after repeated failures (a drafter that answers Info but keeps missing Propose deadlines
    then costs one deadline per probe delay, growing to ``max_backoff_s``). A probe started
    before the latest failure does not count (``epoch``). Thread-safe.
    """

    CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"

    def __init__(self, min_backoff_s: float = 0.25, max_backoff_s: float = 5.0, state: str = OPEN):
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self.state = state
        self.failures = 0
        self.epoch = 0
        self.why = ""
        metrics.set_draft_circuit(state)

    def allows(self) -> bool:
        """Whether a Propose may be sent now (closed or half-open)."""
        return self.state != self.OPEN

    def failed(self, why: str) -> None:
        """A Propose missed its deadline or failed: open the circuit."""
        with self._lock:
            self.state = self.OPEN
            self.failures += 1
            self.epoch += 1
            self.why = why
        metrics.set_draft_circuit(self.OPEN)

    def probe_answered(self, epoch: int) -> bool:
        """The drafter answered a probe started at ``epoch``: half-open the circuit if it is open
        and no failure came since. Returns whether the circuit now lets a Propose through."""
        with self._lock:
            if self.state == self.OPEN and epoch == self.epoch:
                self.state = self.HALF_OPEN
                metrics.set_draft_circuit(self.HALF_OPEN)
            return self.state != self.OPEN

    def succeeded(self) -> None:
        """A Propose was answered in time: close the circuit."""
        if self.state == self.CLOSED and not self.failures:
            return
        with self._lock:
            self.state = self.CLOSED
            self.failures = 0
            self.why = ""
        metrics.set_draft_circuit(self.CLOSED)

    def probe_delay(self) -> float:
        """Seconds to wait before the first probe after the latest failure: none after a single
        failure (a drafter that was only slow once is back at once), then ``min_backoff_s``
        doubling per further failure, at most ``max_backoff_s``."""
        if self.failures <= 1:
            return 0.0
        return min(self.max_backoff_s, self.min_backoff_s * 2 ** (self.failures - 2))


class TargetPeer:
    """The target service: Info (cached), the Verify stream, Prefill and Release stubs."""

    def __init__(self, address: str):
        self.address = address
        self.channel = serving.channel(address)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self._info: common_pb2.ModelInfo | None = None
        self.direct_streams: bool | None = None   # Verify streams: DirectStreamCall (None: DIRECT_STREAMS)
        self.local_hop: bool | None = None        # the target's same-host hop when offered (None: LOCAL_HOP)
        self._unary_hop_refused = False           # its hop serves no unary method (prefill_future)

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

    def prefill_future(self, request: target_pb2.PrefillRequest, timeout: float) -> "grpc.Future | HopFuture":
        """A Prefill, answered later: over the target's same-host hop when it offers one on this
        host (``local_hop``, None: :data:`LOCAL_HOP`, and :data:`PREFILL_HOP`), where the target
        honours ``feature_ring`` (a prompt's rows then reach a drafter on this host through the
        ring, not through this process: docs/ARCHITECTURE.md, "The feature ring"); else gRPC's
        ``Prefill.future``. Either way ``done()``, ``result()`` (raising ``grpc.RpcError``),
        ``add_done_callback`` and ``cancel``; ``timeout`` runs from now. A hop that answers
        UNIMPLEMENTED (an older target's, serving no unary method) is not asked again."""
        endpoint = self.info().local_endpoint
        if (PREFILL_HOP and not self._unary_hop_refused and (LOCAL_HOP if self.local_hop is None else self.local_hop)
                and endpoint_path(endpoint)):
            metadata = _call_metadata(self.channel)

            def call(deadline: float, on_open):
                try:
                    return hop_unary(endpoint, "/dflash_grpc.v1.TargetService/Prefill", request,
                                     target_pb2.PrefillResponse.FromString, deadline - time.monotonic(), metadata, on_open)
                except HopRefused as e:
                    if e.code == grpc.StatusCode.UNIMPLEMENTED:
                        self._unary_hop_refused = True
                    log.info("the target's same-host hop refused a Prefill; using gRPC",
                             extra={"code": e.code.name, "error": str(e)[:200]})
                    raise

            return HopFuture(call, lambda deadline: self.stub.Prefill(request, timeout=max(0.0, deadline - time.monotonic())),
                             timeout)
        return self.stub.Prefill.future(request, timeout=timeout)

    def verify_stream(self, timeout: float | None) -> "StreamCall | DirectStreamCall | LocalHopCall":
        """A Verify stream: the target's same-host hop when it offers one here (``local_hop``,
        None: :data:`LOCAL_HOP`), else :func:`open_stream` (``direct_streams`` None:
        :data:`DIRECT_STREAMS`)."""
        return _stream(self.channel, self.info().local_endpoint, "/dflash_grpc.v1.TargetService/Verify", self.stub.Verify,
                       parse_verify_reply, timeout, self.direct_streams, self.local_hop, "target")

    def close(self) -> None:
        self.channel.close()


class DraftPeer:
    """The draft service, whose absence or failure never fails a request.

    :meth:`state` answers from a cache and says whether a Propose may be sent now: the drafter's
    Info while its :class:`CircuitBreaker` (``breaker``) is closed or half-open, else None.
    While the circuit is open (never reached, or :meth:`mark_failed` after a missed deadline or a
    failed call) a background thread probes the drafter's Info (timeout ``probe_timeout_s``):
    after :meth:`CircuitBreaker.probe_delay`, then with exponential backoff from
    ``min_backoff_s`` doubling up to ``max_backoff_s``, so a drafter started, restarted or
    resumed later is picked up within that time. An answer half-opens the circuit; the
    scheduler's next Propose closes it (:meth:`mark_ok`) or opens it again.
    """

    def __init__(self, address: str | None, max_backoff_s: float = 5.0, min_backoff_s: float = 0.25,
                 probe_timeout_s: float = 1.0):
        self.address = address
        self.max_backoff_s = max_backoff_s
        self.min_backoff_s = min_backoff_s
        self.probe_timeout_s = probe_timeout_s
        self.channel = serving.channel(address) if address else None
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel) if self.channel else None
        self.breaker = CircuitBreaker(min_backoff_s, max_backoff_s)
        self.direct_streams: bool | None = None   # Propose streams: DirectStreamCall (None: DIRECT_STREAMS)
        self.local_hop: bool | None = None        # the drafter's same-host hop when offered (None: LOCAL_HOP)
        self._info: draft_pb2.DrafterInfo | None = None
        self._layers: list[int] | None = None
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._probing: threading.Thread | None = None
        self._closed = threading.Event()
        self.detail = "no draft service configured" if not address else "not contacted yet"
        if self.stub is not None:
            if self._probe(self.breaker.epoch):  # one synchronous look at start, then the background thread
                self.breaker.succeeded()
                self.detail = "ok"
            self._probing = threading.Thread(target=self._watch, name="draft-probe", daemon=True)
            self._probing.start()

    def _probe(self, epoch: int) -> bool:
        """Ask the drafter's Info; on an answer (and no failure since ``epoch``) cache it and
        half-open the circuit. Returns whether it answered."""
        try:
            info = self.stub.Info(draft_pb2.DrafterInfoRequest(), timeout=self.probe_timeout_s)
        except grpc.RpcError as e:
            if not self.breaker.allows():
                why = self.breaker.why
                self.detail = f"circuit open: {why}; probe: {e.code().name}" if why else f"unreachable: {e.code().name}"
            return False
        with self._lock:
            self._layers = list(info.target_layer_ids)
            if self.breaker.probe_answered(epoch):
                self._info = info
                self.detail = "half-open: the drafter answered a probe; the next Propose decides"
        return True

    def _watch(self) -> None:
        while not self._closed.is_set():
            if self.breaker.allows():
                self._failed.wait(1.0)
                self._failed.clear()
                continue
            epoch, backoff = self.breaker.epoch, self.min_backoff_s
            delay = self.breaker.probe_delay()
            if delay and self._closed.wait(delay):
                return
            while not self._closed.is_set() and epoch == self.breaker.epoch:
                if self._probe(epoch):
                    log.warning("draft service answers again", extra={"address": self.address, "failures": self.breaker.failures})
                    break
                self._closed.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)

    def state(self) -> draft_pb2.DrafterInfo | None:
        """The drafter's Info if a Propose may be sent now (cached), else ``None``; never blocks."""
        return self._info

    def layers(self) -> list[int] | None:
        """The target layers the drafter reads (from its last Info), or None if never reached."""
        return self._layers

    def mark_failed(self, why: str) -> None:
        """A Propose missed its deadline or failed (``why``, for the status): open the circuit and
        forget the cached Info; the background thread probes again."""
        with self._lock:
            self.breaker.failed(why)
            self._info = None
            self.detail = f"circuit open: {why}; probing"
        self._failed.set()

    def mark_ok(self) -> None:
        """A Propose was answered in time: close the circuit (cheap when it is closed)."""
        if self.breaker.state != CircuitBreaker.CLOSED:
            self.breaker.succeeded()
            self.detail = "ok"

    def propose_stream(self, timeout: float | None) -> "StreamCall | DirectStreamCall | LocalHopCall":
        """A Propose stream: the drafter's same-host hop when it offers one here (``local_hop``,
        None: :data:`LOCAL_HOP`), else :func:`open_stream` (``direct_streams`` None:
        :data:`DIRECT_STREAMS`)."""
        info = self.state()
        endpoint = info.model.local_endpoint if info is not None else ""
        return _stream(self.channel, endpoint, "/dflash_grpc.v1.DraftService/Propose", self.stub.Propose,
                       draft_pb2.ProposeResponse.FromString, timeout, self.direct_streams, self.local_hop, "draft")

    def close(self) -> None:
        self._closed.set()
        self._failed.set()
        if self.channel:
            self.channel.close()
