"""Clients of the target and draft services as the orchestrator uses them.

The scheduler (:mod:`orchestrator.scheduler`) keeps one bidirectional Verify stream and one
Propose stream open for the whole process; each tick sends one message carrying every active
request's item and reads one reply (:class:`StreamCall`, whose exchanges time out precisely).

The drafter is never waited on for long (docs/ARCHITECTURE.md, "Drafter deadlines and circuit
breaker"): each Propose gets a deadline of a few of its measured round trips
(:class:`DraftDeadline`), and a miss or a failed call opens the drafter's circuit
(:class:`CircuitBreaker`, held by :class:`DraftPeer`) until the drafter answers a probe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from orchestrator import metrics

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


class StreamCall:
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
    """

    def __init__(self, method, timeout: float | None = None):
        self._q: queue.Queue = queue.Queue()
        self._responses = method(iter(self._q.get, _END), timeout=timeout)
        self._cond = threading.Condition(threading.Lock())
        self._deadline: float | None = None  # of the exchange in flight (monotonic s)
        self._watching = float("inf")          # the deadline the watch thread sleeps toward
        self._closed = False
        self._expired = False                  # the watch thread cancelled the stream
        self._watchdog: threading.Thread | None = None

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
            self._responses.cancel()

    def exchange(self, request, timeout: float | None = None):
        """Send ``request`` and wait for its reply.

        Args:
            timeout: seconds to wait for the reply (None: no limit). Past it the stream is
                cancelled and :class:`ExchangeTimeout` raised, so a hung or stopped peer cannot
                hang the caller; the stream is then unusable (every later exchange raises).

        Raises:
            ExchangeTimeout: no reply within ``timeout``.
            grpc.RpcError: the stream failed (or was closed).
        """
        if timeout is not None:
            deadline = time.monotonic() + timeout
            self._deadline = deadline
            if deadline < self._watching:  # the watch thread sleeps past it (or idles): wake it
                with self._cond:
                    self._cond.notify()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="stream-watchdog", daemon=True)
                self._watchdog.start()
        self._q.put(request)
        try:
            return next(self._responses)
        except grpc.RpcError as e:
            if self._expired and timeout is not None:
                raise ExchangeTimeout(timeout) from e
            raise
        finally:
            if timeout is not None:
                self._deadline = None

    @property
    def broken(self) -> bool:
        """The stream was cancelled (closed, or a deadline passed: possibly just after an exchange
        got its reply in time), so the next exchange would fail: open a new one instead."""
        return self._expired or self._closed

    def close(self) -> None:
        """Half-close and cancel the stream (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._q.put(_END)
        self._responses.cancel()


class DraftDeadline:
    """How long one Propose exchange may take before the drafter counts as failed.

    ``timeout = clamp(factor x expected, min_s, max_s) + extra_rows x row_s``, at most ``cap_s``,
    where ``expected`` is the exponential moving average (weight ``alpha``) of the round trips
    of successful steady exchanges, scaled up by ``items / (their mean items)`` when an exchange
    carries more items than they did (the reference engine's step grows with the batch; the
    batched one barely does, so this only errs long). Before any measurement ``expected`` is
    unknown and the clamp gives ``max_s``. ``extra_rows`` are feature rows beyond a step's worth
    (new or re-created drafter sessions: a prompt or a whole history), each allowed ``row_s``
    more, as those exchanges take longer than a step and are not measured.

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

    def timeout(self, items: int = 1, extra_rows: int = 0) -> float | None:
        """Seconds the next exchange of ``items`` items carrying ``extra_rows`` extra feature rows
        may take (None: no limit)."""
        if self.factor <= 0:
            return self.cap_s
        if self.step_s is None:
            t = self.max_s
        else:
            t = min(self.max_s, max(self.min_s, self.factor * self.step_s * max(1.0, items / self.items)))
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

    def propose_stream(self, timeout: float | None) -> StreamCall:
        return StreamCall(self.stub.Propose, timeout)

    def close(self) -> None:
        self._closed.set()
        self._failed.set()
        if self.channel:
            self.channel.close()
