"""The step loop: one thread owns an engine (its model, pool and sessions); RPC handlers enqueue
work and wait for its result (docs/ARCHITECTURE.md, "Step loop").

Inline fast path (:meth:`StepLoop.batch`): when the loop is idle (no tick running, nothing
queued, no prefill in progress) a batch runs on the calling handler's thread instead, under the
engine lock the loop thread holds for every tick (with its reaping and lease checks), so the
engine is never run by two threads at once and a lone stream pays no thread hand-off.

Each tick the loop takes everything queued: calls (release, info, ...) run first, in order; then
every queued verify item, from every request, runs as one ``engine.verify_batch`` (continuous
batching: requests join and leave between ticks); then prefill chunks run under a token budget,
oldest prompt first, so a long prompt never stalls the other sessions for more than one chunk.

Idle sessions are reaped: with ``idle_timeout > 0`` the loop notes when each session id was last
used (a batch item or prefill naming it), and, at most every ``reap_interval`` seconds, releases
through ``engine.release`` the sessions unused for longer than ``idle_timeout`` (a client whose
Release was lost must not hold a slot forever). A session whose prefill is in progress is never
idle.

Owners and leases (:mod:`runtime.owners`; docs/ARCHITECTURE.md, "Owners, leases and shutdown"):
work submitted with an ``owner`` is checked on the loop thread against ``loop.owners``: an item
or a release naming a session of another owner is refused for that item
(:class:`~runtime.owners.NotOwner`) and never reaches the engine; a session an owner opened (a
prefill that finished, a first item that succeeded) is recorded as its. Every tick the loop also
releases the sessions of owners whose lease ran out (:meth:`Owners.expired`), and
:meth:`StepLoop.enter` releases at once the sessions of an owner's superseded epochs.

Used by both services: the target's engine (:class:`target_service.engine.TargetEngine` or
:class:`target_service.batched_engine.BatchedEngine`) and the draft service's engine, through the
``verify_batch`` / ``start_prefill`` / ``run_prefill`` methods (a draft engine has no prefill:
its batch method is ``propose_batch``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from runtime.device_time import device_seconds
from runtime.errors import EngineError, Reason, SessionNotFound, Unavailable
from runtime.owners import NotOwner, Owner, Owners

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Work:
    kind: str                      # "batch", "prefill" or "call"
    payload: Any
    future: Future | None          # None: an inline batch (its caller waits for nothing)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)
    owner: Owner | None = None     # None: an in-process caller, not checked


@dataclasses.dataclass
class BatchResult:
    """What a submitted batch gets back: one result (or error) per item, the seconds the step(s)
    that ran it took on the loop thread (``compute_s``), how many items shared them, the seconds
    they waited (``queue_s``) and the device seconds of those steps (``device_s``: CUDA events,
    :func:`runtime.device_time.device_seconds`; 0 off CUDA)."""

    results: list
    compute_s: float
    batch_items: int
    queue_s: float
    device_s: float = 0.0


class StepLoop:
    """Run ``engine`` on one thread.

    Args:
        engine: has a batch method (``verify_batch(items) -> list[result | EngineError]``) and, for prefills,
            ``start_prefill(...) -> job`` and ``run_prefill(job, budget) -> tokens done``
            (``job.outcome`` set when finished), optionally ``next_prefill_tokens(job)`` (the
            size of its next chunk, decided by the engine alone), and ``release(ids)``.
        prefill_budget: most prompt tokens prefilled per tick (a chunk that would pass it waits
            for the next tick, unless it is the tick's first).
        name: thread name prefix.
        batch_method: the engine method that runs a batch (``verify_batch`` for a target engine,
            ``propose_batch`` for a draft engine).
        idle_timeout: seconds after which an unused session is released (0 = never); may be
            changed later (``loop.idle_timeout = ...``).
        reap_interval: most seconds between two looks for idle sessions (at most ``idle_timeout``).
        clock: the monotonic clock of the idle times (tests inject a fake one).
        owners: the session owners and leases (default: a new :class:`~runtime.owners.Owners`
            without leases, on ``clock``); ``loop.owners.lease_s`` may be changed later.
        inline: run a batch on the calling thread when the loop is idle (:meth:`batch`); may be
            changed later (``loop.inline = ...``).
    """

    def __init__(self, engine, prefill_budget: int = 512, name: str = "engine", batch_method: str = "verify_batch",
                 idle_timeout: float = 0.0, reap_interval: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 owners: Owners | None = None, inline: bool = True):
        self.engine = engine
        self.name = name
        self._batch_fn = getattr(engine, batch_method)
        self.prefill_budget = max(1, int(prefill_budget))
        self._q: queue.Queue[_Work | None] = queue.Queue()
        self._prefills: collections.deque[tuple[Any, Future, Owner | None]] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
        #: ticks that ran a batch, batched items, seconds in batches, prefill tokens
        self.ticks = 0
        self.items = 0
        #: items of the last batched step (0 before any)
        self.last_items = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.idle_timeout = float(idle_timeout)
        self.reap_interval = float(reap_interval)
        self.clock = clock
        #: sessions released for being idle
        self.reaped = 0
        self._last_used: dict[str, float] = {}   # session id -> clock() of its last item / prefill
        self._next_reap: float | None = None
        self.owners = owners if owners is not None else Owners(clock=clock)
        self._next_lease_check = 0.0
        #: run a batch on the calling thread when the loop is idle (:meth:`batch`); may be changed later
        self.inline = bool(inline)
        #: batches run inline, on the caller's thread
        self.inline_batches = 0
        # held by whoever runs the engine: the loop thread for a tick (and its reaping and lease
        # checks), or a caller for an inline batch; never both at once
        self._engine_lock = threading.Lock()
        self._loop_waits = False   # the loop thread has queued work and waits for the engine lock
        self._thread.start()

    # ------------------------------------------------------------------ submitting
    def _submit(self, kind: str, payload, owner: Owner | None = None) -> Future:
        if self._stop.is_set():
            raise Unavailable("the step loop is stopped")
        fut: Future = Future()
        self._q.put(_Work(kind, payload, fut, owner=owner))
        return fut

    def quiet(self, most_items: int) -> bool:
        """Whether nothing waits for the loop (no prefill in progress, nothing queued, the loop
        thread not waiting for the engine) and its last batched step had at most ``most_items``
        items: a light load, where a hop thread may poll for the next request without keeping
        prefill chunks from the GIL (:func:`dflash_grpc.localhop.quiet_spin`). Read without the
        lock: a hint."""
        return not self._prefills and not self._loop_waits and self._q.empty() and self.last_items <= most_items

    def submit_batch(self, items: list, owner: Owner | None = None) -> Future:
        """Queue items for the next batched step; the future gives a :class:`BatchResult`.
        With ``owner``, an item naming a session of another owner gets
        :class:`~runtime.owners.NotOwner` as its result instead of running."""
        return self._submit("batch", list(items), owner)

    def batch(self, items: list, owner: Owner | None = None) -> BatchResult:
        """Run ``items`` as one batch and wait for its :class:`BatchResult` (as :meth:`submit_batch`).

        Inline fast path (``inline``): when the loop is idle (it holds no tick and waits for
        none, nothing is queued and no prefill is in progress) the batch runs here, on the
        calling thread, under the engine lock, with the same owner checks, idle-time notes,
        counters and timing as on the loop thread; this saves the two thread hand-offs of a
        queued batch (docs/ARCHITECTURE.md, "Step loop"). Otherwise it is queued and batched
        with the others on the loop thread (queued work is never overtaken by inline batches).

        Raises:
            Unavailable: the loop is stopped.
            BaseException: what the engine's batch method raised (the step failed).
        """
        if (self.inline and not self._loop_waits and not self._prefills and self._q.empty()
                and self._engine_lock.acquire(blocking=False)):
            try:
                if self._stop.is_set():
                    raise Unavailable("the step loop is stopped")
                if not self._prefills:   # stable under the lock: only a lock holder changes it
                    done = self._run_batches([_Work("batch", list(items), None, owner=owner)])[0]
                    self.inline_batches += 1
                    if isinstance(done, BaseException):
                        raise done
                    return done
            finally:
                self._engine_lock.release()
        return self.submit_batch(items, owner).result()

    def submit_prefill(self, *args, owner: Owner | None = None) -> Future:
        """Queue ``engine.start_prefill(*args)`` and its chunks; the future gives ``job.outcome``
        (or raises the engine's error). The session is recorded as ``owner``'s once it opened."""
        return self._submit("prefill", args, owner)

    def prefill(self, *args, owner: Owner | None = None) -> Any:
        """:meth:`submit_prefill` and wait."""
        return self.submit_prefill(*args, owner=owner).result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop thread (between steps) and return its result."""
        return self._submit("call", fn).result()

    def release(self, session_ids: list[str], owner: Owner | None = None) -> int:
        """``engine.release(session_ids)`` on the loop thread; returns how many existed. With
        ``owner``, the ids of sessions of another owner are skipped (not released, not
        counted)."""
        ids = list(session_ids)

        def release() -> int:
            mine = [sid for sid in ids if self.owners.may_touch(sid, owner)]
            if len(mine) < len(ids):
                log.info("release refused for sessions of another owner", extra={"owner": str(owner),
                                                                                  "refused": len(ids) - len(mine)})
            return self._release_ids(mine)

        return self.call(release)

    def stop_features(self, session_ids: list[str], owner: Owner | None = None) -> int:
        """From the next step on, return no feature rows for these sessions (on the loop thread:
        each engine session's ``feature_layers`` emptied; the batched engine still taps its layers
        for every row of a captured step, but no longer slices, copies or sends this session's);
        unknown ids, sessions whose prefill is still running (their chunks' rows must keep one
        width), sessions without feature layers, and with ``owner`` the ids of another owner's
        sessions are skipped. Returns how many sessions it changed. A client decoding a request
        plainly for the rest of its life (``VerifyRequest.stop_features``) no longer pays for
        rows no drafter reads.

        Raises:
            Unavailable: the loop is stopped.
        """
        ids = list(session_ids)

        def stop() -> int:
            sessions = getattr(self.engine, "sessions", {})
            n = 0
            for sid in ids:
                s = sessions.get(sid)
                if (s is None or not getattr(s, "feature_layers", None) or not getattr(s, "ready", True)
                        or not self.owners.may_touch(sid, owner)):
                    continue
                s.feature_layers = []
                if getattr(s, "ring", False):   # (no rows at all now: none into the feature ring either)
                    s.ring = False
                n += 1
            return n

        return self.call(stop)

    def ring_features(self, session_ids: list[str], owner: Owner | None = None, on: bool = True) -> int:
        """From the next step on, write these sessions' verified rows into the engine's feature
        ring instead of their outcomes, or with ``on`` False into the outcomes again (on the loop
        thread: ``engine.ring_features``; with ``owner``, another owner's sessions are skipped).
        Returns how many sessions changed; 0 for an engine without a ring.

        Raises:
            Unavailable: the loop is stopped.
        """
        fn = getattr(self.engine, "ring_features", None)
        if fn is None:
            return 0
        ids = [sid for sid in session_ids if self.owners.may_touch(sid, owner)] if owner is not None else list(session_ids)
        return self.call(lambda: fn(ids, on)) if ids else 0

    def release_all(self) -> int:
        """Release every session the engine holds (on the loop thread); returns how many."""
        return self.call(lambda: self._release_ids(list(getattr(self.engine, "sessions", ()))))

    def held(self) -> int:
        """Sessions the engine holds now (read without waiting for the loop: a snapshot)."""
        return len(getattr(self.engine, "sessions", ()))

    def enter(self, owner: Owner) -> "CallScope":
        """A call of ``owner`` begins (a unary call or a whole stream): it holds the owner's lease
        until the returned scope is closed (``with``, or ``scope.close()``; idempotent). A new
        epoch of a known owner name releases the sessions of its older epochs here, at once."""
        stale = self.owners.call_started(owner)
        scope = CallScope(self.owners, owner)
        if stale:
            try:
                n = self.call(lambda: self._release_ids(stale))
            except EngineError:  # the loop is stopping
                n = 0
            log.info("an owner restarted: released its predecessor's sessions",
                     extra={"loop": self.name, "owner": owner.name, "epoch": owner.epoch[:8], "sessions": len(stale),
                            "released": n})
        return scope

    def reap(self) -> list[str]:
        """Release the sessions idle for longer than ``idle_timeout`` now (on the loop thread, as
        the loop does by itself every ``reap_interval``); returns their ids."""
        return self.call(self._reap_idle)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after the current tick; queued work fails with
        :class:`~runtime.errors.Unavailable` (a RuntimeError; UNAVAILABLE, reason SHUTTING_DOWN)."""
        self._stop.set()
        self._q.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _wait(self) -> list[_Work]:
        """The first item queued, waiting for it (up to 0.5 s, less with short leases) only when
        no prefill is pending; empty when none came."""
        lease = self.owners.lease_s
        wait = min(0.5, max(0.02, lease / 4)) if lease > 0 else 0.5
        try:
            return [self._q.get(timeout=wait) if not self._prefills else self._q.get_nowait()]
        except queue.Empty:
            return []

    def _drain(self, work: list[_Work]) -> list[_Work]:
        """``work`` and everything queued now, the stop marks (None) left out."""
        try:
            while True:
                work.append(self._q.get_nowait())
        except queue.Empty:
            pass
        return [w for w in work if w is not None]

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._wait()
            self._loop_waits = bool(first)   # queued work goes first: no new inline batch meanwhile
            with self._engine_lock:   # an inline batch in progress finishes first
                self._loop_waits = False
                try:
                    self._tick(self._drain(first))   # what queued meanwhile joins this tick
                    self._maybe_reap()
                    self._expire_leases()
                except Exception:  # noqa: BLE001 - the loop must survive a bug in one tick
                    log.exception("step loop tick failed")
        for w in self._drain([]):
            w.future.set_exception(Unavailable("the step loop stopped"))

    def _tick(self, work: list[_Work]) -> None:
        batches = []
        now = self.clock() if work else 0.0
        for w in work:
            if w.kind == "batch":
                batches.append(w)
            elif w.kind == "call":
                _settle(w.future, w.payload)
            elif w.kind == "prefill":
                try:
                    job = self.engine.start_prefill(*w.payload)
                except BaseException as e:  # noqa: BLE001
                    w.future.set_exception(e)
                    continue
                self._prefills.append((job, w.future, w.owner))
                self._touch(_session_of(job) or _session_of(w.payload), now)
        if batches:
            for w, done in zip(batches, self._run_batches(batches)):
                if isinstance(done, BaseException):
                    w.future.set_exception(done)
                else:
                    w.future.set_result(done)
        self._run_prefills()

    def _run_batches(self, batches: list[_Work]) -> list[BatchResult | BaseException]:
        """Run the items of ``batches`` as one engine batch (engine lock held); one
        :class:`BatchResult` per work, or the exception of a failed step for each."""
        # items naming another owner's session are refused here, under the engine lock, untouched
        refused: dict[tuple[int, int], EngineError] = {}
        items: list = []
        sids_of: list[list[str | None]] = []
        last_used = self._last_used
        now = self.clock()
        for wi, w in enumerate(batches):
            payload = w.payload
            sids = [_session_of(item) for item in payload]
            sids_of.append(sids)
            foreign = self.owners.foreign([sid for sid in sids if sid], w.owner) if w.owner is not None else ()
            if not foreign:   # (the common case: every item runs)
                for sid in sids:
                    if sid:
                        last_used[sid] = now   # _touch
                items.extend(payload)
                continue
            for ii, sid in enumerate(sids):
                if sid in foreign:
                    refused[(wi, ii)] = NotOwner(f"session {sid!r} belongs to another owner")
                    continue
                if sid:
                    last_used[sid] = now   # _touch
                items.append(payload[ii])
        if refused:
            log.info("items refused for sessions of another owner", extra={"refused": len(refused)})
        t0 = time.perf_counter()
        d0 = device_seconds()
        try:
            results = self._batch_fn(items) if items else []
        except BaseException as e:  # noqa: BLE001 - a failed step fails its requests, not the loop
            log.exception("batched step failed", extra={"items": len(items)})
            return [e] * len(batches)
        dt = time.perf_counter() - t0
        ddev = device_seconds() - d0
        if items:
            self.ticks += 1
            self.items += len(items)
            self.last_items = len(items)
            self.busy_s += dt
        done: list[BatchResult | BaseException] = []
        pos = 0
        for wi, w in enumerate(batches):
            if refused:
                out = []
                for ii in range(len(w.payload)):
                    r = refused.get((wi, ii))
                    if r is None:
                        r = results[pos]
                        pos += 1
                    out.append(r)
            else:
                out = results[pos:pos + len(w.payload)]
                pos += len(w.payload)
            if w.owner is not None:   # a session it just opened (a drafter's first item) is its
                self.owners.claim([sid for sid, r in zip(sids_of[wi], out) if sid and not isinstance(r, BaseException)],
                                  w.owner)
            done.append(BatchResult(out, dt, len(items), t0 - w.enqueued, ddev))
        return done

    def _run_prefills(self) -> None:
        budget = self.prefill_budget
        size = getattr(self.engine, "next_prefill_tokens", None)
        while budget > 0 and self._prefills:
            job, fut, owner = self._prefills[0]
            # a chunk's size is the engine's (the prompt's alone: batch-invariant bits); the budget
            # only decides whether it runs this tick. The tick's first chunk always runs.
            if size is not None and budget < self.prefill_budget and size(job) > budget:
                break
            try:
                n = self.engine.run_prefill(job, budget)
            except BaseException as e:  # noqa: BLE001
                self._prefills.popleft()
                if getattr(e, "reason", None) is not Reason.SESSION_EXISTS:  # else the live session is another's
                    self.engine.release([job.session_id])
                    self._last_used.pop(job.session_id, None)
                    self.owners.forget([job.session_id])
                fut.set_exception(e)
                continue
            self.prefill_tokens += n
            budget -= max(n, 1)
            if job.outcome is not None or n == 0:
                self._prefills.popleft()
                self._touch(job.session_id, self.clock())
                if job.outcome is not None:
                    self.owners.record(job.session_id, owner)
                    fut.set_result(job.outcome)
                else:
                    fut.set_exception(SessionNotFound(f"session {job.session_id!r} was released during its prefill"))


    # ------------------------------------------------------------------ idle sessions
    def _touch(self, session_id: str | None, now: float) -> None:
        if session_id:
            self._last_used[session_id] = now

    def _maybe_reap(self) -> None:
        """:meth:`_reap_idle` when ``idle_timeout`` is set and ``reap_interval`` has passed."""
        timeout = self.idle_timeout
        if timeout <= 0:
            return
        now = self.clock()
        if self._next_reap is not None and now < self._next_reap:
            return
        self._next_reap = now + min(self.reap_interval, timeout)
        self._reap_idle()

    def _reap_idle(self) -> list[str]:
        """Release (``engine.release``) the sessions unused for more than ``idle_timeout``
        seconds; loop thread only. Sessions the engine holds but the loop has not seen (opened
        another way) start their idle time now; released ones are forgotten."""
        timeout = self.idle_timeout
        if timeout <= 0:
            return []
        now = self.clock()
        live = getattr(self.engine, "sessions", None)
        if live is not None:
            live = set(live)
            for sid in [s for s in self._last_used if s not in live]:
                del self._last_used[sid]
            for sid in live:
                self._last_used.setdefault(sid, now)
        for job, _, _ in self._prefills:  # a prefill in progress is use
            self._touch(job.session_id, now)
        idle = [(sid, now - t) for sid, t in self._last_used.items() if now - t > timeout]
        if not idle:
            return []
        ids = [sid for sid, _ in idle]
        for sid in ids:
            del self._last_used[sid]
        self.owners.forget(ids)
        try:
            self.engine.release(ids)
        except Exception:  # noqa: BLE001 - keep serving; the ids are forgotten either way
            log.exception("releasing idle sessions failed", extra={"sessions": len(ids)})
            return []
        for sid, idle_s in idle:
            self.reaped += 1
            log.info("reaped idle session", extra={"session_id": sid, "idle_s": round(idle_s, 1),
                                                   "idle_timeout_s": timeout})
        return ids


    # ------------------------------------------------------------------ owners and leases
    def _release_ids(self, ids: list[str]) -> int:
        """``engine.release(ids)`` and forget them (loop thread only); returns how many existed."""
        for sid in ids:
            self._last_used.pop(sid, None)
        self.owners.forget(ids)
        return self.engine.release(ids) if ids else 0

    def _expire_leases(self) -> None:
        """Release the sessions of owners whose lease ran out (:meth:`Owners.expired`), and
        forget the records of sessions the engine no longer holds; loop thread, at most every
        0.05 s."""
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + 0.05
        live = getattr(self.engine, "sessions", None)
        if live is not None:
            self.owners.keep_only(list(live))
        for owner, ids in self.owners.expired():
            try:
                n = self._release_ids(ids)
            except Exception:  # noqa: BLE001 - keep serving; the ids are forgotten either way
                log.exception("releasing the sessions of an expired lease failed", extra={"sessions": len(ids)})
                continue
            log.info("lease expired: released the owner's sessions",
                     extra={"loop": self.name, "owner": owner.name, "epoch": owner.epoch[:8], "sessions": len(ids),
                            "released": n, "lease_s": self.owners.lease_s})


class CallScope:
    """One call of an owner (:meth:`StepLoop.enter`): holds the owner's lease until closed."""

    def __init__(self, owners: Owners, owner: Owner):
        self.owners = owners
        self.owner = owner
        self._lock = threading.Lock()
        self._open = True

    def close(self) -> None:
        """End the call (idempotent: safe from both the handler and a gRPC done-callback)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        self.owners.call_ended(self.owner)

    def __enter__(self) -> "CallScope":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_drained(loop: StepLoop, streams_in_flight: Callable[[], int], timeout: float, poll: float = 0.05) -> bool:
    """Graceful shutdown of a target or draft service (docs/ARCHITECTURE.md, "Owners, leases and
    shutdown"): wait until the engine holds no session (its clients released them) or no stream
    is in flight (``streams_in_flight()``, e.g. :func:`dflash_grpc.serving.streams_in_flight`),
    at most ``timeout`` seconds. Returns True when drained before the timeout."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        if loop.held() == 0 or streams_in_flight() == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def _session_of(item) -> str | None:
    """The session id an item, prefill job or ``start_prefill`` arguments name: a
    ``session_id`` attribute (:class:`draft_service.batched.DraftItem`, prefill jobs) or the
    first field of a tuple (a verify item ``(session_id, tokens, parents)``)."""
    if type(item) is tuple:   # a verify item (the hot path: a plain tuple has no attribute to look for)
        sid = item[0] if item else None
    else:
        sid = getattr(item, "session_id", None)
        if sid is None and isinstance(item, (tuple, list)) and item and isinstance(item[0], str):
            sid = item[0]
    return sid if isinstance(sid, str) else None


def run_items(loop: "StepLoop", items: list, decode: Callable[[Any], Any],
              owner: Owner | None = None) -> tuple[list, BatchResult]:
    """What a servicer does with a stream message: ``decode`` each item (an
    :class:`EngineError` it raises becomes that item's outcome), run the decoded ones as one batch
    on ``loop`` for ``owner`` (:meth:`StepLoop.submit_batch`), and return ``(outcomes, batch)``:
    one outcome per item in order (a result or an exception; a failed step gives every batched
    item its exception) and the batch's timing."""
    decoded, outcomes = [], []
    for item in items:
        try:
            decoded.append(decode(item))
            outcomes.append(None)
        except EngineError as e:
            outcomes.append(e)
    done = BatchResult([], 0.0, 0, 0.0)
    if decoded:
        try:
            done = loop.batch(decoded, owner)
        except Exception as e:  # noqa: BLE001 - the step itself failed: each item says why
            done = BatchResult([e] * len(decoded), 0.0, len(decoded), 0.0)
    it = iter(done.results)
    return [o if o is not None else next(it) for o in outcomes], done


def _settle(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:  # noqa: BLE001
        fut.set_exception(e)


__all__ = ["BatchResult", "CallScope", "EngineError", "StepLoop", "run_items", "wait_drained"]
