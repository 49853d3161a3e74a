"""The orchestrator's asyncio gRPC server (``--grpc-server aio``, the default): the event hand-over
from the scheduler thread to coroutines, the server's gate (stream limit, malformed requests,
draining) and the same Generate messages as the thread-per-stream server.

(The cancel storm, tests/test_cancel_storm.py, and the request limits, tests/test_request_limits.py,
run on both servers; tests/test_shutdown.py drains a real ``python -m orchestrator``, whose server
is this one.) No torch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from dflash_grpc import serving
from dflash_grpc.aio_serving import make_aio_server
from dflash_grpc.transport import GRPC_OPTIONS, reason_of
from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from orchestrator.events import Events, LoopWaker
from tests.test_request_limits import FakeTarget, SpyTokenizer, _orchestrator


# ------------------------------------------------------------------------------------------------
# the hand-over


def test_events_wake_their_coroutines_in_one_handover_per_batch():
    """64 coroutines wait on their requests' events; another thread puts one event into each while
    the loop is busy: every coroutine gets its event, through one ``call_soon_threadsafe``."""
    loop = asyncio.new_event_loop()
    waker = LoopWaker(loop)
    queues = [Events() for _ in range(64)]
    busy, release = threading.Event(), threading.Event()

    def hold_the_loop():
        busy.set()
        release.wait(10)

    def producer():
        busy.wait(10)
        for i, q in enumerate(queues):
            q.put(("event", i))
        release.set()

    async def main():
        waiters = [asyncio.ensure_future(q.next(waker)) for q in queues]
        await asyncio.sleep(0)   # every coroutine waits now
        loop.call_soon(hold_the_loop)
        thread = threading.Thread(target=producer)
        thread.start()
        got = await asyncio.wait_for(asyncio.gather(*waiters), 10)
        thread.join()
        return got

    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [("event", i) for i in range(64)]
    assert waker.handovers == 1


def test_a_put_switched_out_after_reading_the_waiter_loses_no_wake_up():
    """The interleaving of a lost wake-up, forced: the coroutine sets its waiter F1; the putting
    thread queues ``e1`` and reads F1, and is switched out there; the coroutine's re-check sees
    ``e1``, takes it and waits again on F2; then the putting thread goes on. It must not have
    cleared F2, or its next put (``end``) would wake nobody."""
    waiter_set, read, resume = threading.Event(), threading.Event(), threading.Event()
    putter: list[threading.Thread] = []

    class FirstEmptyLetsThePutterIn:   # the coroutine's re-check runs after the putter read F1
        def __init__(self):
            self.q, self.first = queue.SimpleQueue(), True

        def put(self, x):
            self.q.put(x)

        def get_nowait(self):
            return self.q.get_nowait()

        def empty(self):
            if self.first:
                self.first = False
                waiter_set.set()
                read.wait(5)
            return self.q.empty()

    class Paused(Events):   # the putting thread is switched out right after reading the waiter
        @property
        def _waiter(self):
            w = self.__dict__.get("w")
            if putter and threading.current_thread() is putter[0] and not read.is_set():
                read.set()
                resume.wait(5)
            return w

        @_waiter.setter
        def _waiter(self, value):
            self.__dict__["w"] = value

    async def main():
        loop = asyncio.get_running_loop()
        waker, ev, got = LoopWaker(loop), Paused(), []
        ev._queue = FirstEmptyLetsThePutterIn()

        async def consumer():
            while True:
                got.append(await ev.next(waker))
                if got[-1] == "end":
                    return

        def first_put():
            waiter_set.wait(5)
            ev.put("e1")

        putter.append(threading.Thread(target=first_put))
        putter[0].start()
        task = asyncio.ensure_future(consumer())
        await asyncio.sleep(0.1)   # the coroutine took e1 and waits on F2
        resume.set()
        await loop.run_in_executor(None, putter[0].join)
        await loop.run_in_executor(None, ev.put, "end")
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(main()) == ["e1", "end"]


def test_events_keep_order_and_serve_a_thread_too():
    q = Events()
    for i in range(3):
        q.put(i)
    assert not q.empty() and q.get_nowait() == 0 and q.get(timeout=1) == 1

    async def rest():
        return await q.next(LoopWaker(asyncio.get_running_loop()))

    assert asyncio.run(rest()) == 2 and q.empty()


# ------------------------------------------------------------------------------------------------
# the gate


class HeldStreams(generation_pb2_grpc.GenerationServiceServicer):
    """Generate sends one message, then holds its stream open until the client goes away."""

    def __init__(self):
        self.open = 0
        self.ended = 0

    async def Generate(self, request, context):
        self.open += 1
        try:
            yield generation_pb2.GenerateResponse(text=request.prompt)
            await asyncio.Event().wait()
        finally:
            self.ended += 1

    async def GetStats(self, request, context):
        return generation_pb2.AcceptanceStats()


@pytest.fixture()
def held():
    servicer = HeldStreams()

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    server, health, port = make_aio_server(add, "127.0.0.1:0", max_streams=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        yield servicer, server, health, channel
    finally:
        channel.close()
        server.stop(None).wait()


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_stream_limit_malformed_requests_and_the_count(held):
    servicer, server, _, channel = held
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    calls = [stub.Generate(generation_pb2.GenerateRequest(prompt=f"p{i}"), timeout=30) for i in range(2)]
    assert [next(c).text for c in calls] == ["p0", "p1"]
    assert serving.streams_in_flight(server) == 2
    with pytest.raises(grpc.RpcError) as ei:   # a third stream: past max_streams
        next(stub.Generate(generation_pb2.GenerateRequest(prompt="p2"), timeout=30))
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(ei.value) == "STREAMS_BUSY"
    assert stub.GetStats(generation_pb2.GetStatsRequest(), timeout=10) is not None   # unary calls still answered
    calls[0].cancel()
    _wait(lambda: servicer.ended == 1 and serving.streams_in_flight(server) == 1)
    # bytes that are not a GenerateRequest (a truncated field): INVALID_ARGUMENT, the slot given back
    raw = channel.unary_stream("/dflash_grpc.v1.GenerationService/Generate")
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as ei:
            list(raw(b"\x0a\x05ab", timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(ei.value) == "INVALID_ARGUMENT"
    _wait(lambda: serving.streams_in_flight(server) == 1)
    assert next(stub.Generate(generation_pb2.GenerateRequest(prompt="p3"), timeout=30)).text == "p3"   # a slot again
    assert servicer.open == 3


def test_draining_refuses_new_calls_and_turns_health_not_serving(held):
    _, server, health, channel = held
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    hstub = health_pb2_grpc.HealthStub(channel)
    first = stub.Generate(generation_pb2.GenerateRequest(prompt="a"), timeout=30)
    assert next(first).text == "a"
    assert hstub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    serving.start_draining(server, health)
    for call in (lambda: next(stub.Generate(generation_pb2.GenerateRequest(prompt="b"), timeout=10)),
                 lambda: stub.GetStats(generation_pb2.GetStatsRequest(), timeout=10)):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(ei.value) == "SHUTTING_DOWN"
    assert hstub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert serving.streams_in_flight(server) == 1   # the stream in flight goes on
    first.cancel()


class PlainMethods(generation_pb2_grpc.GenerationServiceServicer):
    """A thread server's servicer: methods that are not coroutines."""

    def Generate(self, request, context):
        yield generation_pb2.GenerateResponse(text="never")

    def GetStats(self, request, context):
        return generation_pb2.AcceptanceStats()


def test_plain_methods_are_refused_with_a_clear_status():
    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(PlainMethods(), server)
        return ["dflash_grpc.v1.GenerationService"]

    server, _, port = make_aio_server(add, "127.0.0.1:0", max_streams=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for call in (lambda: list(stub.Generate(generation_pb2.GenerateRequest(prompt="a"), timeout=10)),
                         lambda: stub.GetStats(generation_pb2.GetStatsRequest(), timeout=10)):
                with pytest.raises(grpc.RpcError) as ei:
                    call()
                assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED and "coroutine" in ei.value.details()
    finally:
        server.stop(None).wait()
        assert server.stop(None).wait(1)   # a second stop returns at once


class _OpenGate:
    """A servicer whose ``open()`` waits for the test (as tokenizing a large prompt would), then
    admits the request or refuses it as ``GenerationServicer.open`` does (counting its refusal)."""

    def __init__(self, refuse: bool):
        from orchestrator import metrics

        self.refuse, self.metrics = refuse, metrics
        self.started, self.go = threading.Event(), threading.Event()
        self.opened, self.closed = 0, []
        self.scheduler = self

    def open(self, request):
        from orchestrator.servicer import RequestError

        self.opened += 1
        self.started.set()
        self.go.wait(10)
        if self.refuse:
            self.metrics.REQUESTS.labels(outcome="RESOURCE_EXHAUSTED").inc()
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        return type("Opened", (), {"req": "the request"})()

    def close(self, req, why=None):
        self.closed.append((req, why))


@pytest.mark.parametrize("case", ["admitted", "refused", "not started"])
def test_a_client_that_leaves_while_its_request_opens(case):
    """The client goes away while ``open()`` runs on a worker thread (or before it starts): a request
    admitted meanwhile is closed without events and counted CANCELLED once; one refused is counted
    only as its refusal; a job that had not started never runs."""
    from orchestrator import metrics
    from orchestrator.servicer import AioGenerationServicer

    def count(outcome):
        return metrics.REQUESTS.labels(outcome=outcome)._value.get()

    svc = _OpenGate(refuse=case == "refused")
    aio = AioGenerationServicer(svc, open_workers=1)
    blocker = aio._pool.submit(svc.go.wait, 10) if case == "not started" else None

    async def main():
        task = asyncio.ensure_future(aio._open(generation_pb2.GenerateRequest(prompt="x")))
        if blocker is None:
            await asyncio.get_running_loop().run_in_executor(None, svc.started.wait, 10)
        else:
            await asyncio.sleep(0.05)   # queued behind the busy worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = {o: count(o) for o in ("CANCELLED", "RESOURCE_EXHAUSTED")}
    try:
        asyncio.run(main())
        svc.go.set()
        aio._pool.shutdown(wait=True)
    finally:
        svc.go.set()
        aio.close()
    got = {o: count(o) - before[o] for o in before}
    if case == "admitted":
        assert svc.closed == [("the request", None)] and got == {"CANCELLED": 1, "RESOURCE_EXHAUSTED": 0}
    elif case == "refused":
        assert svc.closed == [] and got == {"CANCELLED": 0, "RESOURCE_EXHAUSTED": 1}
    else:
        assert svc.opened == 0 and svc.closed == [] and got == {"CANCELLED": 1, "RESOURCE_EXHAUSTED": 0}


# ------------------------------------------------------------------------------------------------
# the same messages as the thread-per-stream server


def _messages(stub, req: generation_pb2.GenerateRequest) -> tuple:
    """What a client reads of a request: the text and token ids joined (how the tokens are cut
    into messages depends on timing, on either server), the prompt tokens of the first message,
    the last message's finish reason and generated tokens."""
    msgs = list(stub.Generate(req, timeout=30))
    assert msgs[-1].finished and not any(m.finished for m in msgs[:-1])
    return ("".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids], msgs[0].prompt_tokens,
            msgs[-1].finish_reason, msgs[-1].stats.generated_tokens)


def test_generate_sends_the_same_messages_on_both_servers():
    requests = []
    for max_tokens, stop, eos in ((1, [], True), (5, [], True), (12, [], False), (12, ["xxx"], True), (6, ["x"], True)):
        req = generation_pb2.GenerateRequest(prompt="hello", max_tokens=max_tokens, ignore_eos=eos)
        req.stop.extend(stop)
        requests.append(req)
    got = {}
    for kind in ("threads", "aio"):
        stub, _, stop = _orchestrator(SpyTokenizer(), FakeTarget(), kind)
        try:
            got[kind] = [_messages(stub, r) for r in requests]
        finally:
            stop()
    assert got["aio"] == got["threads"]
    assert got["aio"][3][3] == generation_pb2.FINISH_REASON_STOP
    assert [len(r[1]) for r in got["aio"]][:2] == [1, 5]
