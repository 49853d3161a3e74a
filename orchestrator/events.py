"""A request's events on their way from the scheduler thread to the request's handler.

The scheduler (:mod:`orchestrator.scheduler`) puts a request's events (``Tokens``, ``Failure``)
from its own thread; the handler that streams them to the client reads them either on a thread of
its own (the gRPC thread-per-stream server, the HTTP front door: :meth:`Events.get`, blocking) or
as a coroutine of the asyncio gRPC server (:meth:`Events.next`, awaited on the server's event
loop). A waiting coroutine is woken through a :class:`LoopWaker`, which hands every wake-up due
at once to its loop in one ``call_soon_threadsafe``: the wake-ups of one scheduler tick's events
cost the loop one hand-over, not one per stream (docs/ARCHITECTURE.md, "Serving many sessions").
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any


class LoopWaker:
    """Sets asyncio futures of ``loop`` from any thread, batching the hand-overs.

    :meth:`wake` from another thread queues the future; the first wake-up since the loop last ran
    the batch schedules one callback (``loop.call_soon_threadsafe``, one write to the loop's
    self-pipe), and the wake-ups queued until it runs go with it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Future] = []
        self._scheduled = False
        self.handovers = 0   # batches handed to the loop (a counter for tests and tools)

    def wake(self, future: asyncio.Future) -> None:
        """Set ``future``'s result to None on the loop, soon (any thread; a done future is left)."""
        with self._lock:
            self._due.append(future)
            if self._scheduled:
                return
            self._scheduled = True
            self.handovers += 1
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:   # the loop is closed: nobody waits any more
            with self._lock:
                self._due.clear()
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
            self._scheduled = False
        for future in due:
            if not future.done():
                future.set_result(None)


class Events:
    """A request's events in order: put by the scheduler (any thread), taken by one handler.

    The interface of ``queue.SimpleQueue`` (:meth:`put`, :meth:`get`, :meth:`get_nowait`,
    :meth:`empty`) for a handler on a thread of its own, and :meth:`next` for one that is a
    coroutine: it awaits a future that :meth:`put` sets through the handler's :class:`LoopWaker`.
    """

    __slots__ = ("_queue", "_waiter", "_waker")

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter: asyncio.Future | None = None
        self._waker: LoopWaker | None = None

    def put(self, event: Any) -> None:
        """Queue ``event`` and wake the coroutine waiting in :meth:`next`, if one is (any thread).

        Only :meth:`next` sets or clears the waiter: a put that cleared it could, switched out
        between reading and clearing it, wipe the next wait's future, and every later put would
        find no waiter (a lost wake-up). Waking a future twice, or one whose wait was given up,
        does nothing (:meth:`LoopWaker.wake` leaves done futures alone)."""
        self._queue.put(event)
        waiter = self._waiter
        if waiter is not None:
            self._waker.wake(waiter)

    def get(self, timeout: float | None = None) -> Any:
        """The next event, waiting for it (at most ``timeout`` seconds; then ``queue.Empty``)."""
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> Any:
        """The next event if one is queued, else ``queue.Empty``."""
        return self._queue.get_nowait()

    def empty(self) -> bool:
        return self._queue.empty()

    async def next(self, waker: LoopWaker) -> Any:
        """The next event, awaited on ``waker``'s loop (the running one). One coroutine at a time."""
        q = self._queue
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            future = waker.loop.create_future()
            self._waker, self._waiter = waker, future
            # a put between the get above and the waiter's setting did not see the waiter
            if not q.empty():
                self._waiter = None
                continue
            try:
                await future
            finally:
                self._waiter = None
