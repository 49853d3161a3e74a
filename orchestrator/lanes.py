"""Lanes: several schedulers over the same target and drafter, so that the three services work at
the same time (issue 23; docs/ARCHITECTURE.md, "Lanes").

One :class:`~orchestrator.scheduler.Scheduler` runs its tick as a chain: the orchestrator builds
the Propose, the drafter drafts, the orchestrator builds the Verify, the target verifies, the
orchestrator hands the tokens out. Each service waits for the others most of the tick. With
``lanes`` schedulers, each with its own requests and its own Propose and Verify streams, one lane's
Verify runs on the target while another lane's Propose runs on the drafter and the orchestrator
hands out a third's tokens: two micro-batches in flight. The services' step loops take whatever
is queued each tick (:mod:`runtime.step_loop`), so two lanes' exchanges that meet at a service
share its step, as any two requests would.

A request stays in the lane it was submitted to (the least loaded: fewest requests holding or
waiting for a session); each lane holds at most its share of ``max_sessions`` and ``max_queue``.
Lossless as one scheduler is: each request's steps are the same chain, only the order in which
the requests of different lanes reach a service changes.

Imports no torch.
"""

from __future__ import annotations

import threading

from dflash_grpc.v1 import generation_pb2
from orchestrator.scheduler import Failure, Request, Scheduler


def share(total: int, lanes: int, lane: int) -> int:
    """Lane ``lane``'s part of ``total`` (sessions or queue places) over ``lanes`` lanes: the parts
    differ by at most one and add up to ``total``; each at least 1 (a lane must hold a request)."""
    return max(1, total // lanes + (1 if lane < total % lanes else 0))


class Lanes:
    """``lanes`` :class:`Scheduler` s behind the one interface the servicer, the HTTP front door and
    ``main`` use (:meth:`submit`, :meth:`close`, :meth:`status`, :meth:`drain`, :meth:`stop`,
    :attr:`admitting`, :meth:`note_message`).

    Args:
        target, draft: the peers, shared by every lane (each lane opens its own streams).
        lanes: schedulers (>= 2; one is a plain :class:`Scheduler`: :func:`make_scheduler`).
        max_sessions, max_queue: totals over the lanes (:func:`share`).
        **kwargs: every other :class:`Scheduler` keyword, the same for each lane.

    Raises:
        ValueError: ``lanes`` < 2.
    """

    def __init__(self, target, draft, *, lanes: int, max_sessions: int, max_queue: int = 256, **kwargs):
        if lanes < 2:
            raise ValueError(f"Lanes needs at least 2 lanes, got {lanes}: one lane is a Scheduler")
        self.max_sessions, self.max_queue = max(1, int(max_sessions)), max(0, int(max_queue))
        self.lanes = [Scheduler(target, draft, max_sessions=share(self.max_sessions, lanes, i),
                                max_queue=share(self.max_queue, lanes, i) if self.max_queue else 0,
                                thread_name=f"scheduler-{i}", **kwargs) for i in range(lanes)]
        for lane in self.lanes:   # the adaptive hold shares the host among every lane's messages
            lane.lanes = lanes
        self._of: dict[int, Scheduler] = {}   # id(request) -> its lane, while the request lives
        self._lock = threading.Lock()

    def _load(self, lane: Scheduler) -> tuple[int, int]:
        with lane._lock:
            return lane._held() + len(lane._queue), -lane.max_sessions

    def submit(self, req: Request) -> None:
        """Queue ``req`` on the least loaded lane (:meth:`Scheduler.submit`; raises as it does,
        when that lane's queue is full)."""
        with self._lock:
            lane = min(self.lanes, key=self._load)
            self._of[id(req)] = lane
        try:
            lane.submit(req)
        except BaseException:
            with self._lock:
                self._of.pop(id(req), None)
            raise

    def close(self, req: Request, why: Failure | None = None) -> None:
        """:meth:`Scheduler.close` on ``req``'s lane (nothing for a request never submitted)."""
        with self._lock:
            lane = self._of.pop(id(req), None)
        if lane is not None:
            lane.close(req, why)

    @property
    def admitting(self) -> bool:
        """Whether :meth:`submit` takes new requests (False once draining or stopped)."""
        return all(lane.admitting for lane in self.lanes)

    def note_message(self, cpu_s: float) -> None:
        """:meth:`Scheduler.note_message` for every lane (a message costs what it costs whichever lane sent it)."""
        for lane in self.lanes:
            lane.note_message(cpu_s)

    @property
    def ticks(self) -> int:
        return sum(lane.ticks for lane in self.lanes)

    @property
    def batched_items(self) -> int:
        return sum(lane.batched_items for lane in self.lanes)

    @property
    def fallbacks(self) -> int:
        return sum(lane.fallbacks for lane in self.lanes)

    def status(self) -> generation_pb2.SchedulerStatus:
        """The lanes' :meth:`Scheduler.status` together: counts added, the mean batch over all
        ticks, the largest tree budget now, drafting if any lane is."""
        parts = [lane.status() for lane in self.lanes]
        ticks = sum(p.ticks for p in parts)
        items = sum(p.mean_batch * p.ticks for p in parts)
        return generation_pb2.SchedulerStatus(
            active_sessions=sum(p.active_sessions for p in parts), queued_requests=sum(p.queued_requests for p in parts),
            max_sessions=self.max_sessions, max_queue=self.max_queue, ticks=ticks,
            mean_batch=items / ticks if ticks else 0.0, tree_budget_now=max(p.tree_budget_now for p in parts),
            drafting=any(p.drafting for p in parts), draft_fallbacks=sum(p.draft_fallbacks for p in parts))

    def _all(self, method: str, *args) -> list:
        """``method(*args)`` on every lane at once (each may wait for its requests); their results."""
        out = [None] * len(self.lanes)

        def run(i):
            out[i] = getattr(self.lanes[i], method)(*args)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(self.lanes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def drain(self, timeout: float, release_timeout: float = 5.0) -> bool:
        """:meth:`Scheduler.drain` on every lane at once; True when every request of every lane
        had finished by itself."""
        return all(self._all("drain", timeout, release_timeout))

    def stop(self, timeout: float = 5.0, release_timeout: float = 5.0) -> None:
        """:meth:`Scheduler.stop` on every lane at once."""
        self._all("stop", timeout, release_timeout)


def make_scheduler(target, draft, *, lanes: int = 1, **kwargs) -> Scheduler | Lanes:
    """A :class:`Scheduler` for ``lanes`` <= 1, else :class:`Lanes` of ``lanes`` schedulers
    (``kwargs``: the :class:`Scheduler` keywords, ``max_sessions`` and ``max_queue`` as totals)."""
    if lanes <= 1:
        return Scheduler(target, draft, **kwargs)
    return Lanes(target, draft, lanes=lanes, **kwargs)
