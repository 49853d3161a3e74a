"""Drafter deadlines and the circuit breaker (docs/ARCHITECTURE.md, "Drafter deadlines and circuit
breaker"): the deadline computation (:class:`orchestrator.peers.DraftDeadline`), the breaker's
states (:class:`orchestrator.peers.CircuitBreaker`), the precise exchange timeout of
:class:`orchestrator.peers.StreamCall`, and the scheduler against a fake drafter that stalls (its
connection open, no answer: what a stopped process does) while a fake target decodes a known
sequence. No model; a few seconds in all. The same with real services and SIGSTOP:
tests/test_draft_stall.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from orchestrator.peers import CircuitBreaker, DraftDeadline, DraftPeer, ExchangeTimeout, StreamCall, TargetPeer

VOCAB = 1000
BLOCK = 8


def seq(pos: int) -> int:
    """The token the fake target emits at position ``pos``."""
    return (pos * 7 + 3) % 97 + 10


# ------------------------------------------------------------------------------------------------
# the deadline


def test_deadline_before_any_measurement_is_the_maximum():
    d = DraftDeadline(factor=4, min_s=0.02, max_s=0.5, row_s=1e-4, cap_s=120)
    assert d.timeout() == 0.5
    assert d.timeout(8, extra_rows=1000) == pytest.approx(0.6)


def test_deadline_is_factor_times_the_moving_average_clamped():
    d = DraftDeadline(factor=4, min_s=0.02, max_s=0.5, alpha=0.5)
    d.observe(0.010)
    assert d.timeout() == pytest.approx(0.040)
    d.observe(0.020)                                    # average 0.015
    assert d.timeout() == pytest.approx(0.060)
    for _ in range(50):
        d.observe(0.001)
    assert d.timeout() == pytest.approx(0.02)           # the least
    for _ in range(50):
        d.observe(1.0)
    assert d.timeout() == pytest.approx(0.5)            # the most


def test_deadline_grows_with_more_items_and_extra_rows_and_is_capped():
    d = DraftDeadline(factor=4, min_s=0.001, max_s=10, row_s=0.001, cap_s=2.0)
    d.observe(0.010, items=2)
    assert d.timeout(2) == pytest.approx(0.040)
    assert d.timeout(1) == pytest.approx(0.040)         # fewer items: never shorter than measured
    assert d.timeout(8) == pytest.approx(0.160)         # 4x the items it was measured with
    assert d.timeout(2, extra_rows=100) == pytest.approx(0.140)
    assert d.timeout(2, extra_rows=10**6) == 2.0        # never past the cap (the step timeout)
    off = DraftDeadline(factor=0, min_s=0.02, max_s=0.5, cap_s=120.0)
    off.observe(0.01)
    assert off.timeout(3, 100) == 120.0                 # factor 0: no drafter deadline but the cap


def test_deadline_waits_as_long_as_a_miss_would_cost_to_recover_up_to_the_maximum():
    """A miss re-creates every asked session from recomputed rows: the deadline is at least the
    rows the drafter holds for them at the row allowance, never past the maximum; extra rows
    come on top, the cap bounds all."""
    d = DraftDeadline(factor=4, min_s=0.05, max_s=0.5, row_s=50e-6, cap_s=2.0)
    d.observe(0.006, items=64)
    assert d.timeout(64) == pytest.approx(0.05)                         # the floor: 4 x 6 ms < 50 ms
    assert d.timeout(64, held_rows=300) == pytest.approx(0.05)          # one stream's context: 15 ms
    assert d.timeout(64, held_rows=4000) == pytest.approx(0.2)          # 4,000 rows at 50 us
    assert d.timeout(64, held_rows=64 * 300) == pytest.approx(0.5)      # 64 sessions: up to the maximum
    assert d.timeout(64, extra_rows=1000, held_rows=4000) == pytest.approx(0.25)
    assert d.timeout(64, extra_rows=10**6, held_rows=4000) == 2.0       # the cap
    off = DraftDeadline(factor=0, min_s=0.05, max_s=0.5, row_s=50e-6, cap_s=120.0)
    assert off.timeout(64, held_rows=10**6) == 120.0                   # no deadline: the cap alone


def test_deadline_maximum_and_row_allowance_follow_the_drafter_device():
    from orchestrator.config import OrchestratorConfig as C

    assert C.draft_deadline_for("cuda:0") == (C.DRAFT_DEADLINE_MS_CUDA, C.DRAFT_ROW_US_CUDA) == (500, 50)
    assert C.draft_deadline_for("cpu") == C.draft_deadline_for("") == (C.DRAFT_DEADLINE_MS_CPU, C.DRAFT_ROW_US_CPU)
    assert C.draft_deadline_for("cuda:1", 200, 7) == C.draft_deadline_for("cpu", 200, 7) == (200, 7)


# ------------------------------------------------------------------------------------------------
# the circuit breaker


def test_breaker_opens_half_opens_on_a_probe_and_closes_on_success():
    b = CircuitBreaker(min_backoff_s=0.25, max_backoff_s=5.0, state=CircuitBreaker.CLOSED)
    assert b.allows()
    b.succeeded()
    assert b.state == "closed" and b.failures == 0
    b.failed("missed")
    assert b.state == "open" and not b.allows() and b.why == "missed"
    assert b.probe_delay() == 0.0                       # one failure: probe at once
    epoch = b.epoch
    assert b.probe_answered(epoch) and b.state == "half_open" and b.allows()
    b.failed("missed again")                             # the half-open Propose failed
    assert b.state == "open" and b.failures == 2
    assert b.probe_delay() == 0.25
    assert not b.probe_answered(epoch)                  # a probe begun before that failure: no
    assert b.probe_answered(b.epoch) and b.state == "half_open"
    b.succeeded()
    assert b.state == "closed" and b.failures == 0 and b.why == ""


def test_breaker_probe_delay_backs_off_to_the_maximum():
    b = CircuitBreaker(min_backoff_s=0.25, max_backoff_s=2.0)
    delays = []
    for _ in range(7):
        b.failed("x")
        delays.append(b.probe_delay())
    assert delays == [0.0, 0.25, 0.5, 1.0, 2.0, 2.0, 2.0]


# ------------------------------------------------------------------------------------------------
# StreamCall: a precise timeout; a late reply never read as a later exchange's


class HeldDrafter(draft_pb2_grpc.DraftServiceServicer):
    """Answers each Propose (``results`` = one per item, session id echoed) once ``gate`` is set."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def Propose(self, requests, context):
        for req in requests:
            self.gate.wait(30)
            yield draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(session_id=x.session_id) for x in req.items])


def _serve_draft(servicer):
    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.DraftService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=8)
    return server, port


def _request(sid: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(session_id=sid, root_token=1, committed_length=1)])


def test_stream_exchange_times_out_precisely_and_the_late_reply_is_never_read():
    fake = HeldDrafter()
    server, port = _serve_draft(fake)
    try:
        with serving.channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            call = StreamCall(stub.Propose)
            assert call.exchange(_request("a"), 5.0).results[0].session_id == "a"
            fake.gate.clear()
            for timeout in (0.05, 0.12):
                t0 = time.monotonic()
                with pytest.raises(ExchangeTimeout) as err:
                    call.exchange(_request("late"), timeout)
                waited = time.monotonic() - t0
                assert timeout <= waited < timeout + 0.05, waited  # not on a 0.25 s polling grain
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                with pytest.raises(grpc.RpcError):
                    call.exchange(_request("after"), 1.0)  # the timed-out stream is dead
                call.close()
                fake.gate.set()                            # the late reply is sent now ...
                call = StreamCall(stub.Propose)
                assert call.exchange(_request("b"), 5.0).results[0].session_id == "b"  # ... and never read
                fake.gate.clear()
            fake.gate.set()
            # a short deadline after a long one is still watched precisely (the watch thread is woken)
            assert call.exchange(_request("c"), 10.0).results[0].session_id == "c"
            fake.gate.clear()
            t0 = time.monotonic()
            with pytest.raises(ExchangeTimeout):
                call.exchange(_request("d"), 0.05)
            assert time.monotonic() - t0 < 0.1
            call.close()
    finally:
        fake.gate.set()
        server.stop(None)


# ------------------------------------------------------------------------------------------------
# the scheduler against a fake drafter that stalls


class SeqTarget(target_pb2_grpc.TargetServiceServicer):
    """A target whose greedy output is :func:`seq`: prefill of P tokens commits P rows and emits
    ``seq(P)``; a verify accepts the tree's path of ``seq`` tokens and returns one feature row per
    committed row (4 bf16 values)."""

    def __init__(self):
        self.length: dict[str, int] = {}
        self.prefilled: list[tuple[str, list[int], list[int]]] = []   # (session, prompt, feature layers)
        self.lock = threading.Lock()

    def Info(self, request, context):
        return common_pb2.ModelInfo(vocab_size=VOCAB, max_context=4096, max_tree_width=16, max_tree_depth=16,
                                    max_sessions=8, tokenizer_fingerprint="fp", model_fingerprint="m", device="cpu")

    @staticmethod
    def _features(rows: int) -> common_pb2.Tensor:
        return common_pb2.Tensor(dtype=common_pb2.DTYPE_BF16, shape=[rows, 4], data=bytes(8 * rows))

    def Prefill(self, request, context):
        it = request.items[0]
        n = len(it.prompt_tokens)
        with self.lock:
            self.length[it.session_id] = n
            self.prefilled.append((it.session_id, list(it.prompt_tokens), list(it.feature_layer_ids)))
        return target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(
            session_id=it.session_id, first_token=seq(n), committed_length=n, features=self._features(n))])

    def Verify(self, requests, context):
        for req in requests:
            out = []
            for x in req.items:
                with self.lock:
                    length = self.length[x.session_id]
                tokens, parents = list(x.tree.tokens), list(x.tree.parents)
                path, node = [], 0
                while True:
                    nxt = [i for i in range(len(tokens)) if parents[i] == node and i > 0
                           and tokens[i] == seq(length + 1 + len(path))]
                    if not nxt:
                        break
                    node = nxt[0]
                    path.append(tokens[node])
                k = len(path)
                with self.lock:
                    self.length[x.session_id] = length + k + 1
                out.append(target_pb2.VerifyResult(session_id=x.session_id, accepted_tokens=path,
                                                   bonus_token=seq(length + k + 1), committed_length=length + k + 1,
                                                   features=self._features(k + 1)))
            yield target_pb2.VerifyResponse(results=out)

    def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=len(request.session_ids))


class StallingDrafter(draft_pb2_grpc.DraftServiceServicer):
    """A drafter that drafts :func:`seq` perfectly (a chain of ``max_depth``), checks
    ``committed_length`` like the real one (LENGTH_MISMATCH, session left as it was), and while
    ``running`` is clear answers nothing at all, Info and Release included (a stopped process)."""

    def __init__(self):
        self.running = threading.Event()
        self.running.set()
        self.rows: dict[str, int] = {}
        self.proposes = 0
        self.ids_seen: set[str] = set()
        self.released: list[str] = []
        self.lock = threading.Lock()

    def Info(self, request, context):
        self.running.wait(60)
        return draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(vocab_size=VOCAB, block_size=BLOCK, max_sessions=64),
                                     target_fingerprint="m", target_layer_ids=[1])

    def Propose(self, requests, context):
        for req in requests:
            self.running.wait(60)
            results = []
            with self.lock:
                self.proposes += 1
                for x in req.items:
                    self.ids_seen.add(x.session_id)
                    rows = x.features.shape[0] if x.features.shape else 0
                    held = self.rows.get(x.session_id, 0)
                    if x.committed_length != held + rows:
                        results.append(draft_pb2.ProposeResult(session_id=x.session_id, status=common_pb2.ItemStatus(
                            code=grpc.StatusCode.FAILED_PRECONDITION.value[0], reason="LENGTH_MISMATCH")))
                        continue
                    self.rows[x.session_id] = held + rows
                    depth = x.tree.max_depth or BLOCK - 1
                    chain = [x.root_token] + [seq(x.committed_length + d) for d in range(1, depth + 1)]
                    results.append(draft_pb2.ProposeResult(session_id=x.session_id, tree=common_pb2.TokenTree(
                        tokens=chain, parents=list(range(-1, depth)))))
            yield draft_pb2.ProposeResponse(results=results)

    def Release(self, request, context):
        self.running.wait(60)
        with self.lock:
            self.released += list(request.session_ids)
            for sid in request.session_ids:
                self.rows.pop(sid, None)
        return common_pb2.ReleaseResponse(released=len(request.session_ids))


@pytest.fixture()
def stalling():
    """``(scheduler, fake drafter)`` over :class:`SeqTarget` and :class:`StallingDrafter`; the
    Propose deadline is at least 30 ms and at most 150 ms."""
    from orchestrator.scheduler import Scheduler

    target, drafter = SeqTarget(), StallingDrafter()

    def add_target(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(target, server)
        return ["dflash_grpc.v1.TargetService"]

    tserver, _, tport = serving.make_server(add_target, "127.0.0.1:0", max_workers=8)
    dserver, dport = _serve_draft(drafter)
    tpeer, dpeer = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(f"127.0.0.1:{dport}", min_backoff_s=0.05, probe_timeout_s=0.2)
    sched = Scheduler(tpeer, dpeer, max_sessions=4, step_nodes=64, step_timeout=60.0,
                      draft_deadline_min_ms=30, draft_deadline_ms=150)
    sched.fake_target = target
    try:
        yield sched, drafter
    finally:
        drafter.running.set()
        sched.stop()
        dpeer.close()
        tpeer.close()
        dserver.stop(None)
        tserver.stop(None)


def _run(sched, sid: str, n: int):
    """Submit a request of ``n`` tokens; returns ``(request, [(time, tokens) per event])`` filled
    by a thread (joined by the caller)."""
    from orchestrator.scheduler import Failure, Request

    req = Request(session_id=sid, prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=n,
                  tree=draft_pb2.TreeParams(max_depth=BLOCK - 1))
    events = []

    def read():
        while True:
            ev = req.events.get(timeout=30)
            assert not isinstance(ev, Failure), ev
            events.append((time.monotonic(), list(ev.tokens)))
            if ev.finish:
                return

    t = threading.Thread(target=read)
    sched.submit(req)
    t.start()
    return req, events, t


def test_stalled_drafter_costs_one_deadline_then_nothing_and_drafting_resumes(stalling):
    sched, drafter = stalling
    n = 4000  # left after the stall even at 0.1 ms per plain tick
    runs = [_run(sched, f"r{i}", n) for i in range(3)]
    deadline = time.monotonic() + 10
    while not all(len(ev) > 20 for _, ev, _ in runs):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sched.draft.breaker.state == "closed" and sched.deadline.step_s is not None
    misses = sched.deadline_misses                        # 0, unless a loaded machine was slower than 150 ms once
    wait_closed = time.monotonic() + 5
    while sched.draft.breaker.state != "closed":
        assert time.monotonic() < wait_closed
        time.sleep(0.005)
    drafter.running.clear()                               # stopped: connection open, no answer
    t_stop = time.monotonic()
    while sched.deadline_misses == misses:
        assert time.monotonic() - t_stop < 5
        time.sleep(0.005)
    proposes, ticks = drafter.proposes, sched.ticks
    time.sleep(0.3)
    assert sched.draft.breaker.state == "open" and sched.draft.state() is None
    assert "circuit open" in sched.draft.detail and "deadline" in sched.draft.detail
    assert drafter.proposes == proposes                   # no Propose while the circuit is open
    assert sched.ticks - ticks > 5                        # ... and ticks go on (about 1 ms each when idle)
    assert sched.deadline_misses == misses + 1
    drafter.running.set()                                 # resumed
    t_cont = time.monotonic()
    while sched.draft.breaker.state != "closed" or not any(r.on_drafter for r, _, _ in runs):
        assert time.monotonic() - t_cont < 5
        time.sleep(0.005)
    for t in [t for _, _, t in runs]:
        t.join(60)
    for req, events, _ in runs:
        tokens = [tok for _, toks in events for tok in toks]
        assert tokens == [seq(3 + i) for i in range(n)]   # lossless throughout
        gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
        assert max(gaps) < 1.0, max(gaps)                 # one deadline (<= 150 ms), never a freeze
        assert req.draft_gen >= 1                         # re-created (once per miss), under a new id
        assert f"{req.session_id}~{req.draft_gen}" in drafter.ids_seen
        assert req.session_id in drafter.released         # the old id released once it answered
        assert req.stats.accepted_tokens > 0
    assert sched.deadline_misses == misses + 1 and sched.draft.breaker.state == "closed"
    # the lost sessions' rows came from the target: a prefill of each one's committed tokens
    # (prompt, then the emitted ones) into a scratch session, with the drafter's layers
    scratch = [(sid, prompt, layers) for sid, prompt, layers in sched.fake_target.prefilled if "#f" in sid]
    assert sched.refeatures >= len(runs) and len(scratch) >= len(runs)
    for req, _, _ in runs:
        mine = [(p, layers) for sid, p, layers in scratch if sid.startswith(req.session_id + "#f")]
        assert mine and all(layers == [1] for _, layers in mine)
        assert all(len(p) > 3 and p == [1, 2, 3] + [seq(3 + i) for i in range(len(p) - 3)] for p, _ in mine)
    late = [ev for ev in runs[0][1] if ev[0] > t_cont]
    assert max(len(toks) for _, toks in late) > 1         # speculating again after the resume
