"""The step loop's inline fast path (runtime/step_loop.py, ``StepLoop.batch``; docs/ARCHITECTURE.md,
"Step loop"): an idle loop runs a batch on the caller's thread, under the engine lock.

* idle: the batch runs on the calling thread, with the loop's owner checks, counters and timing;
  ``inline=False``, a prefill in progress or queued work send it through the loop thread;
* the engine is never run by two threads at once (callers inline, the loop thread for queued
  batches, calls, prefills, reaping), under a storm of concurrent work;
* a step that raises fails only its own batch's items; the loop and later batches go on;
* sessions are still reaped when idle, and a stopped loop refuses inline work (UNAVAILABLE).
"""

from __future__ import annotations

import threading
import time

import pytest

from runtime.errors import InvalidArgument, SessionNotFound, Unavailable
from runtime.owners import NotOwner, Owner, Owners
from runtime.step_loop import StepLoop, run_items
from tests.test_lifecycle import FakeEngine


class Job:
    def __init__(self, sid: str, n: int):
        self.session_id, self.left, self.outcome = sid, n, None


class GuardedEngine(FakeEngine):
    """A fake engine that records the thread of every batch and fails the test (``overlaps``)
    when two threads are inside it at once. ``boom`` in an item's tokens makes the step raise."""

    def __init__(self, step_s: float = 0.0):
        super().__init__()
        self.step_s = step_s
        self.sessions: dict[str, int] = {}
        self.threads: list[int] = []
        self.overlaps = 0
        self._inside = 0
        self._guard = threading.Lock()

    def _enter(self):
        with self._guard:
            self._inside += 1
            if self._inside > 1:
                self.overlaps += 1

    def _leave(self):
        with self._guard:
            self._inside -= 1

    def verify_batch(self, items):
        self._enter()
        try:
            self.threads.append(threading.get_ident())
            if self.step_s:
                time.sleep(self.step_s)
            if any("boom" in tokens for _, tokens, _ in items):
                raise RuntimeError("the step failed")
            return FakeEngine.verify_batch(self, items)   # the verify semantics of test_lifecycle's fake
        finally:
            self._leave()

    def start_prefill(self, sid, n):
        self._enter()
        try:
            self.sessions[sid] = 0
            return Job(sid, n)
        finally:
            self._leave()

    def run_prefill(self, job, budget):
        self._enter()
        try:
            time.sleep(0.001)
            done = min(job.left, budget)
            job.left -= done
            if job.left == 0:
                job.outcome = job.session_id
            return done
        finally:
            self._leave()

    def release(self, ids):
        self._enter()
        try:
            return sum(self.sessions.pop(sid, None) is not None for sid in ids)
        finally:
            self._leave()


@pytest.fixture()
def loop():
    engine = GuardedEngine()
    lp = StepLoop(engine, name="inline-test")
    yield lp
    lp.stop()


def test_idle_loop_runs_a_batch_on_the_callers_thread(loop):
    engine = loop.engine
    engine.sessions["a"] = 0
    r = loop.batch([("a", [1, 2], [-1, 0]), ("ghost", [1], [-1])])
    assert r.results[0] == 2 and isinstance(r.results[1], SessionNotFound)
    assert r.batch_items == 2 and r.compute_s >= 0 and 0 <= r.queue_s < 1
    assert engine.threads == [threading.get_ident()]
    assert loop.inline_batches == 1 and loop.ticks == 1 and loop.items == 2
    loop.inline = False                                     # off: through the loop thread
    assert loop.batch([("a", [1], [-1])]).results == [3]
    assert engine.threads[-1] != threading.get_ident() and loop.inline_batches == 1


def test_inline_batches_keep_owner_checks(loop):
    mine, theirs = Owner("orch-a", "e1"), Owner("orch-b", "e1")
    loop.engine.sessions["s"] = 0
    assert loop.batch([("s", [1], [-1])], owner=mine).results == [1]       # the first success claims it
    r = loop.batch([("s", [1], [-1])], owner=theirs)
    assert isinstance(r.results[0], NotOwner) and loop.engine.sessions["s"] == 1
    assert loop.inline_batches == 2


def test_a_prefill_in_progress_sends_batches_through_the_loop():
    engine = GuardedEngine()
    loop = StepLoop(engine, name="inline-prefill", prefill_budget=1)   # one token a tick: ~0.3 s of prefill
    try:
        engine.sessions["a"] = 0
        fut = loop.submit_prefill("long", 300)
        deadline = time.monotonic() + 5
        while not loop._prefills and time.monotonic() < deadline:
            time.sleep(0.001)
        assert loop.batch([("a", [1], [-1])]).results == [1]
        assert not fut.done(), "the batch should have been served between two prefill chunks"
        assert engine.threads[-1] != threading.get_ident() and loop.inline_batches == 0
        assert fut.result(timeout=10) == "long"
        assert loop.batch([("a", [1], [-1])]).results == [2] and loop.inline_batches == 1   # idle again
    finally:
        loop.stop()


def test_quiet_is_a_light_load_without_prefills():
    """StepLoop.quiet (the target's hop polls for the next request while it holds): nothing
    queued, no prefill in progress, and the last step had at most the given items."""
    engine = GuardedEngine()
    loop = StepLoop(engine, name="quiet", prefill_budget=1)
    try:
        assert loop.quiet(2) and loop.last_items == 0                  # nothing ran yet
        for sid in "abc":
            engine.sessions[sid] = 0
        loop.batch([(sid, [1], [-1]) for sid in "abc"])
        assert loop.last_items == 3 and loop.quiet(3) and not loop.quiet(2)
        fut = loop.submit_prefill("long", 300)                        # ~0.3 s of one-token chunks
        deadline = time.monotonic() + 5
        while not loop._prefills and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not loop.quiet(64)
        assert fut.result(timeout=10) == "long"
        loop.batch([("a", [1], [-1])])
        assert loop.quiet(1)
    finally:
        loop.stop()
    engine = GuardedEngine(step_s=0.2)                                # a step the loop thread is busy with
    loop = StepLoop(engine, name="quiet-queued")
    try:
        loop.inline = False
        engine.sessions["a"] = engine.sessions["b"] = 0
        first = loop.submit_batch([("a", [1], [-1])])
        deadline = time.monotonic() + 5
        while not engine.threads and time.monotonic() < deadline:    # the first step has begun
            time.sleep(0.001)
        second = loop.submit_batch([("b", [1], [-1])])               # queued behind it
        assert not loop.quiet(64)
        first.result(timeout=5), second.result(timeout=5)
        assert loop.quiet(64)
    finally:
        loop.stop()


def test_the_engine_never_runs_on_two_threads_at_once():
    engine = GuardedEngine(step_s=0.0005)
    loop = StepLoop(engine, name="inline-storm", prefill_budget=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def verifier(i):
        sid = f"v{i}"
        loop.prefill(sid, 3)
        n = 0
        while not stop.is_set():
            r = loop.batch([(sid, [1], [-1])])
            n += 1
            if r.results != [n]:
                errors.append(AssertionError(f"{sid}: {r.results} != [{n}]"))
                return

    def churn():
        k = 0
        while not stop.is_set():
            k += 1
            loop.prefill(f"p{k}", 20)                          # chunked: several loop ticks
            assert loop.release([f"p{k}"]) == 1
            loop.call(lambda: None)

    threads = [threading.Thread(target=verifier, args=(i,)) for i in range(4)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    loop.stop()
    assert not errors, errors[0]
    assert engine.overlaps == 0
    assert loop.inline_batches > 0, "some batches should have run inline"
    assert loop.inline_batches < loop.ticks, "some batches should have gone through the loop thread"


def _decode(item):
    if not item[0]:
        raise InvalidArgument("empty session id")
    return item


def test_a_failed_inline_step_fails_only_its_items(loop):
    engine = loop.engine
    engine.sessions.update(a=0, b=0)
    outs, done = run_items(loop, [("a", ["boom"], [-1]), ("", [1], [-1])], _decode)
    assert isinstance(outs[0], RuntimeError) and "the step failed" in str(outs[0])
    assert isinstance(outs[1], InvalidArgument)             # a decode error stays its own item's
    assert engine.sessions == {"a": 0, "b": 0} and engine.threads == [threading.get_ident()]
    outs, _ = run_items(loop, [("b", [1, 2], [-1, 0])], _decode)   # later batches go on, inline
    assert outs == [2] and loop.inline_batches == 2
    assert loop.call(lambda: "alive") == "alive"            # and so does the loop thread


def test_idle_sessions_are_reaped_while_batches_run_inline():
    engine = GuardedEngine()
    loop = StepLoop(engine, name="inline-reap", idle_timeout=0.3, reap_interval=0.05,
                    owners=Owners(lease_s=0.2))               # the loop wakes every 0.05 s
    try:
        engine.sessions.update(busy=0, idle=0)
        deadline = time.monotonic() + 5
        while "idle" in engine.sessions and time.monotonic() < deadline:
            loop.batch([("busy", [1], [-1])])                 # inline, keeps "busy" in use
            time.sleep(0.01)
        assert "idle" not in engine.sessions and "busy" in engine.sessions
        assert loop.reaped == 1 and loop.inline_batches > 0 and engine.overlaps == 0
    finally:
        loop.stop()


def test_a_stopped_loop_refuses_inline_work(loop):
    loop.engine.sessions["a"] = 0
    loop.stop()
    with pytest.raises(Unavailable):
        loop.batch([("a", [1], [-1])])
    assert loop.engine.sessions["a"] == 0 and loop.inline_batches == 0
