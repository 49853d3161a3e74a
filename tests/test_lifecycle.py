"""Admission and lifetime on the services' side, and restarts.

* The step loop releases sessions left idle (a lost Release) through the engine's own release:
  fake engines and the real ones (both target engines, the reference drafter) on tiny models.
* ``make_server`` keeps workers for unary calls: streams cannot starve health checks or Info,
  and past the pool the server answers RESOURCE_EXHAUSTED instead of queueing.
* ``ServiceGroup.supervise`` / ``dflash-grpc serve`` restart a crashed service, with backoff and
  a restart budget.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.launcher import RestartBudgetExhausted, RestartPolicy, Service, ServiceGroup, free_ports
from dflash_grpc.serving import make_server
from runtime.errors import ResourceExhausted, SessionNotFound
from runtime.step_loop import StepLoop
from tests.test_client import MINI_SERVER


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def wait_for(cond, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# Idle sessions: a fake engine


@dataclasses.dataclass
class FakeJob:
    session_id: str
    steps: int
    outcome: object = None


class FakeEngine:
    """Slots, sessions and both batch methods: verify items are ``(session_id, tokens, parents)``
    tuples; draft items anything with a ``session_id`` (a session is created on first sight)."""

    def __init__(self, max_sessions: int = 2):
        self.max_sessions = max_sessions
        self.sessions: dict[str, int] = {}
        self.released: list[str] = []
        self.hold_prefill = threading.Event()   # set: prefills finish

    def _open(self, sid: str) -> None:
        if sid not in self.sessions:
            if len(self.sessions) >= self.max_sessions:
                raise ResourceExhausted("no free session slot")
            self.sessions[sid] = 0

    def start_prefill(self, sid, prompt):
        if sid in self.sessions:
            raise ValueError("exists")
        self._open(sid)
        return FakeJob(sid, len(prompt))

    def run_prefill(self, job, budget):
        if not self.hold_prefill.is_set():
            time.sleep(0.005)
            return 1                            # still going
        job.outcome = f"prefilled {job.session_id}"
        return 1

    def verify_batch(self, items):
        out = []
        for sid, tokens, _ in items:
            if sid not in self.sessions:
                out.append(SessionNotFound(sid))
            else:
                self.sessions[sid] += len(tokens)
                out.append(self.sessions[sid])
        return out

    def propose_batch(self, items):
        out = []
        for item in items:
            try:
                self._open(item.session_id)
                out.append(item.session_id)
            except ResourceExhausted as e:
                out.append(e)
        return out

    def release(self, ids):
        n = 0
        for sid in ids:
            if self.sessions.pop(sid, None) is not None:
                self.released.append(sid)
                n += 1
        return n


@pytest.fixture()
def fake():
    engine, clock = FakeEngine(), FakeClock()
    engine.hold_prefill.set()
    loop = StepLoop(engine, idle_timeout=10, reap_interval=3600, clock=clock)   # reaps only when asked
    yield engine, clock, loop
    loop.stop()


def test_idle_session_is_reaped_and_its_slot_freed(fake, caplog):
    engine, clock, loop = fake
    assert loop.prefill("a", [1, 2, 3]) == "prefilled a"
    assert loop.prefill("b", [1]) == "prefilled b"
    with pytest.raises(ResourceExhausted):
        loop.prefill("c", [1])                                # both slots taken
    clock.advance(6)
    assert loop.batch([("a", [5], [-1])]).results == [1]     # a is in use, b is not
    clock.advance(6)                                          # a idle 6 s, b 12 s
    with caplog.at_level(logging.INFO, logger="runtime.step_loop"):
        assert loop.reap() == ["b"]
    assert engine.released == ["b"] and loop.reaped == 1 and set(engine.sessions) == {"a"}
    rec = next(r for r in caplog.records if r.getMessage() == "reaped idle session")
    assert rec.levelno == logging.INFO and rec.session_id == "b" and rec.idle_s == 12.0
    assert loop.prefill("c", [1]) == "prefilled c"           # the freed slot is taken again
    assert loop.reap() == []
    clock.advance(11)
    assert sorted(loop.reap()) == ["a", "c"] and loop.reaped == 3


def test_released_and_failed_sessions_are_forgotten(fake):
    engine, clock, loop = fake
    loop.prefill("a", [1])
    assert loop.release(["a"]) == 1
    r = loop.batch([("ghost", [1], [-1])])                    # unknown session: an error, not a session
    assert isinstance(r.results[0], SessionNotFound)
    clock.advance(100)
    assert loop.reap() == [] and loop.reaped == 0 and engine.released == ["a"]


def test_prefill_in_progress_is_not_idle():
    engine, clock = FakeEngine(), FakeClock()
    loop = StepLoop(engine, prefill_budget=1, idle_timeout=10, reap_interval=3600, clock=clock)
    try:
        fut = loop.submit_prefill("long", list(range(50)))
        wait_for(lambda: "long" in engine.sessions, what="the prefill to start")
        clock.advance(100)
        assert loop.reap() == [] and not fut.done()
        engine.hold_prefill.set()
        assert fut.result(timeout=5) == "prefilled long"
        clock.advance(9)                                      # idle since the prefill ended
        assert loop.reap() == []
        clock.advance(2)
        assert loop.reap() == ["long"]
    finally:
        loop.stop()


def test_the_loop_reaps_by_itself_and_timeout_zero_never_reaps():
    engine, clock = FakeEngine(), FakeClock()
    engine.hold_prefill.set()
    loop = StepLoop(engine, idle_timeout=0, reap_interval=0.01, clock=clock)
    try:
        loop.prefill("a", [1])
        clock.advance(1e6)
        time.sleep(0.7)                                       # the loop wakes every 0.5 s at most
        assert "a" in engine.sessions and loop.reaped == 0
        loop.idle_timeout = 5                                 # as draft_service/__main__ sets it
        wait_for(lambda: loop.reaped == 1, what="the loop to reap")
        assert engine.sessions == {}
    finally:
        loop.stop()


def test_draft_items_and_propose_batch(fake):
    from draft_service.batched import DraftItem

    engine, clock, _ = fake
    loop = StepLoop(engine, batch_method="propose_batch", idle_timeout=10, reap_interval=3600, clock=clock)
    try:
        item = lambda sid: DraftItem(sid, None, 1, 0)  # noqa: E731
        assert loop.batch([item("x"), item("y")]).results == ["x", "y"]
        assert isinstance(loop.batch([item("z")]).results[0], ResourceExhausted)
        clock.advance(8)
        loop.batch([item("y")])
        clock.advance(8)
        assert loop.reap() == ["x"]
        assert loop.batch([item("z")]).results == ["z"]
    finally:
        loop.stop()


# --------------------------------------------------------------------------------------------
# Idle sessions: the real engines on tiny models


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    """The shared tiny target (tests/conftest.py) and a small random drafter for it (block 4, one layer)."""
    from draft_service.init_random import write_random_drafter

    drafter = tmp_path_factory.mktemp("lifecycle") / "drafter.gguf"
    write_random_drafter(tiny_llama.path, drafter, block_size=4, num_target_layers=2, layers=1, dtype="f32", seed=1)
    return str(tiny_llama.path), str(drafter)


@pytest.mark.parametrize("kind", ["reference", "batched"])
def test_target_engines_reap_idle_sessions(tiny, kind):
    from target_service.engine import Sampling, TargetEngine
    from target_service.models import load_model

    model = load_model(tiny[0])
    if kind == "reference":
        engine = TargetEngine(model, max_sessions=1, max_context=64, max_tree_width=8)
    else:
        from target_service.batched_engine import BatchedEngine

        engine = BatchedEngine(model, max_sessions=1, max_context=64, max_tree_width=8, prefill_chunk=4)
    clock = FakeClock()
    loop = StepLoop(engine, prefill_budget=4, idle_timeout=30, reap_interval=3600, clock=clock)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    try:
        first = loop.prefill("old", [5, 6, 7, 8, 9], s, []).first_token
        with pytest.raises(ResourceExhausted):
            loop.prefill("new", [5, 6, 7], s, [])
        clock.advance(20)
        assert not isinstance(loop.batch([("old", [first], [-1])]).results[0], Exception)
        clock.advance(20)
        assert loop.reap() == []                              # used 20 s ago
        clock.advance(11)
        assert loop.reap() == ["old"] and loop.reaped == 1
        assert "old" not in engine.sessions
        loop.prefill("new", [5, 6, 7], s, [])                 # its slot is free again
        assert isinstance(loop.batch([("old", [first], [-1])]).results[0], SessionNotFound)
    finally:
        loop.stop()


def test_reference_drafter_reaps_idle_sessions(tiny):
    from draft_service.batched import DraftItem, ReferenceDrafterEngine
    from draft_service.drafter import DFlashDrafter
    from draft_service.gguf_io import load_drafter

    drafter = load_drafter(tiny[1], tiny[0])
    engine = ReferenceDrafterEngine(drafter, max_sessions=1, max_context=64)
    clock = FakeClock()
    loop = StepLoop(engine, name="draft", batch_method="propose_batch", idle_timeout=30, reap_interval=3600, clock=clock)
    feats = torch.randn(3, drafter.config.feature_size)
    try:
        assert not isinstance(loop.batch([DraftItem("a", feats, 5, 3)]).results[0], BaseException)
        assert isinstance(loop.batch([DraftItem("b", feats, 5, 3)]).results[0], ResourceExhausted)
        clock.advance(31)
        assert loop.reap() == ["a"] and engine.session_length("a") is None
        assert not isinstance(loop.batch([DraftItem("b", feats, 5, 3)]).results[0], BaseException)
    finally:
        loop.stop()


# --------------------------------------------------------------------------------------------
# Worker pools: streams never starve unary calls


def _stream_server(max_workers: int, **kw):
    """A server with one bidirectional method that answers one message, then holds its worker
    until the client half-closes (like a Verify or Propose stream between steps)."""

    def hold(request_iterator, context):
        yield b"open"
        for _ in request_iterator:
            pass

    handler = grpc.method_handlers_generic_handler("test.Streams", {"Hold": grpc.stream_stream_rpc_method_handler(hold)})

    def add(server):
        server.add_generic_rpc_handlers((handler,))
        return ["test.Streams"]

    server, _, port = make_server(add, "127.0.0.1:0", max_workers=max_workers, **kw)
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


class OpenStream:
    def __init__(self, channel):
        self.done = threading.Event()

        def requests():
            self.done.wait()
            return
            yield  # noqa: unreachable - a generator

        self.call = channel.stream_stream("/test.Streams/Hold")(requests(), timeout=30)

    def first(self):
        return next(self.call)

    def close(self):
        self.done.set()


def test_open_streams_leave_workers_for_unary_calls():
    server, channel = _stream_server(max_workers=2)
    health = health_pb2_grpc.HealthStub(channel)
    streams = [OpenStream(channel) for _ in range(2)]
    try:
        assert [s.first() for s in streams] == [b"open", b"open"]          # both hold a worker now
        for _ in range(20):                                                 # more unary calls than workers
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        extra = OpenStream(channel)
        with pytest.raises(grpc.RpcError) as ei:                            # a third stream: refused at once
            extra.first()
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        extra.close()
        streams[0].close()
        assert list(streams[0].call) == []
        streams.append(_open_when_free(channel))                            # its worker is free again
    finally:
        for s in streams:
            s.close()
        channel.close()
        server.stop(None)


def _open_when_free(channel, timeout: float = 5.0) -> OpenStream:
    """A new open stream, retried while the worker of a stream that just ended is not back yet."""
    deadline = time.monotonic() + timeout
    while True:
        stream = OpenStream(channel)
        try:
            assert stream.first() == b"open"
            return stream
        except grpc.RpcError as e:
            stream.close()
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)


def test_without_reserved_workers_a_full_pool_refuses_instead_of_queueing():
    """What the reserve prevents: with no unary workers, two streams fill the pool and a health
    check is refused at once (RESOURCE_EXHAUSTED), never queued behind the streams."""
    server, channel = _stream_server(max_workers=2, unary_workers=0)
    health = health_pb2_grpc.HealthStub(channel)
    streams = [OpenStream(channel) for _ in range(2)]
    try:
        assert [s.first() for s in streams] == [b"open", b"open"]
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - t0 < 5
    finally:
        for s in streams:
            s.close()
        channel.close()
        server.stop(None)


# --------------------------------------------------------------------------------------------
# Restarts: ServiceGroup.supervise and dflash-grpc serve

SLEEPER = "import time; print('READY sleeper port=0', flush=True); time.sleep(60)"
CRASHER = "import sys; sys.exit(3)"
FAST = RestartPolicy(backoff=0.05, max_backoff=0.2, max_restarts=3, window=60)


def test_restart_policy_backoff():
    p = RestartPolicy()
    assert [p.delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert (p.max_restarts, p.window) == (5, 60)


def _supervised(group: ServiceGroup, policy: RestartPolicy, restarted: list):
    stop, errors = threading.Event(), []

    def run():
        try:
            group.supervise(stop, policy=policy, on_restart=lambda svc, n: restarted.append((svc.name, n)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return stop, t, errors


def test_killed_service_is_restarted(capsys):
    services = [Service("steady", [sys.executable, "-c", SLEEPER], "127.0.0.1:1"),
                Service("draft", [sys.executable, "-c", SLEEPER], "127.0.0.1:2")]
    restarted = []
    with ServiceGroup(services, grace=2) as group:
        stop, t, errors = _supervised(group, FAST, restarted)
        first, steady = group.procs["draft"].pid, group.procs["steady"].pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: restarted == [("draft", 1)], what="the restart")
        assert group.procs["draft"].pid != first and group.procs["draft"].poll() is None
        assert group.procs["steady"].pid == steady and group.restarts == {"steady": 0, "draft": 1}
        os.kill(group.procs["draft"].pid, signal.SIGKILL)
        wait_for(lambda: len(restarted) == 2, what="the second restart")
        stop.set()
        t.join(5)
        assert not t.is_alive() and not errors
    assert all(p.poll() is not None for p in group.procs.values())
    err = capsys.readouterr().err
    assert "service 'draft' exited with code -9; restarting (restart 1)" in err
    assert "service 'draft' exited with code -9; restarting (restart 2)" in err


def test_crash_loop_exhausts_the_restart_budget(capsys):
    services = [Service("steady", [sys.executable, "-c", SLEEPER], "127.0.0.1:1"),
                Service("crashy", [sys.executable, "-c", CRASHER], "127.0.0.1:2")]
    group = ServiceGroup(services, grace=2)
    group.start()
    t0 = time.monotonic()
    with pytest.raises(RestartBudgetExhausted, match="'crashy' exited with code 3 and was restarted 3 times in the last 60 s; giving up") as ei:
        group.supervise(policy=FAST)
    assert time.monotonic() - t0 < 8 and ei.value.name == "crashy" and ei.value.restarts == 3
    assert all(p.poll() is not None for p in group.procs.values())       # everything stopped
    err = capsys.readouterr().err
    assert [f"restarting (restart {n})" in err for n in (1, 2, 3, 4)] == [True, True, True, False]


def test_stop_ends_supervision_without_restarts():
    restarted = []
    group = ServiceGroup([Service("s", [sys.executable, "-c", SLEEPER], "127.0.0.1:1")], grace=2)
    group.start()
    stop, t, errors = _supervised(group, FAST, restarted)
    time.sleep(0.3)
    group.stop()
    t.join(5)
    assert not t.is_alive() and not errors and restarted == []


# a child that serves the gRPC health service until SIGTERM (test_client's mini server)
HEALTH_SERVER = MINI_SERVER + 'serve("svc", sys.argv[1])\n'


def _health_services(n: int) -> list[Service]:
    return [Service(f"svc{i}", [sys.executable, "-c", HEALTH_SERVER, str(p)], f"127.0.0.1:{p}") for i, p in enumerate(free_ports(n))]


def test_cli_serve_restarts_a_dead_service(monkeypatch, capsys):
    import client.cli as cli
    from client.cli import main
    from dflash_grpc.serving import wait_healthy

    services = _health_services(2)
    monkeypatch.setattr(cli, "_model_paths", lambda args: ("m.gguf", "d.gguf"))
    monkeypatch.setattr(cli, "dflash_services", lambda model, drafter, **kw: services)
    real_wait = ServiceGroup.wait_healthy

    def wait_then_kill(self, *a, **kw):  # once all are healthy, kill one behind serve's back
        real_wait(self, *a, **kw)
        first = self.procs["svc1"].pid
        os.kill(first, signal.SIGKILL)

        def then_stop():  # once it is back and healthy, stop serve as a SIGTERM would
            wait_for(lambda: self.procs["svc1"].pid != first, timeout=8, what="the restart")
            wait_healthy(services[1].address, timeout=8)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=then_stop, daemon=True).start()

    monkeypatch.setattr(ServiceGroup, "wait_healthy", wait_then_kill)
    assert main(["serve", "--grace", "5"]) == 0
    out, err = capsys.readouterr()
    assert "ready:" in out
    assert "service 'svc1' exited with code -9; restarting (restart 1)" in err
    assert "service 'svc1' restarted (pid" in err and "stopped" in err
