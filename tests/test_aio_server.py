"""The orchestrator's asyncio gRPC server (``--grpc-server aio``, the default): the event hand-over
from the scheduler thread to coroutines, the server's gate (stream limit, malformed requests,
draining) and the same Generate messages as the thread-per-stream server.

(The cancel storm, tests/test_cancel_storm.py, and the request limits, tests/test_request_limits.py,
run on both servers; tests/test_shutdown.py drains a real ``python -m orchestrator``, whose server
is this one.) No torch.
"""

from __future__ import annotations

import asyncio
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


# ------------------------------------------------------------------------------------------------
# the same messages as the thread-per-stream server


def _messages(stub, req: generation_pb2.GenerateRequest) -> list[tuple]:
    out = []
    for m in stub.Generate(req, timeout=30):
        out.append((m.text, tuple(m.token_ids), m.prompt_tokens, m.finished, m.finish_reason,
                    m.stats.generated_tokens if m.finished else 0))
    return out


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
    assert all(msgs[-1][3] for msgs in got["aio"])   # every request finished
    assert got["aio"][3][-1][4] == generation_pb2.FINISH_REASON_STOP
