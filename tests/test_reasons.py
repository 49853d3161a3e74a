"""Structured reason codes (``runtime.errors.Reason``) next to every refusal's status code.

* The mapping of :mod:`runtime.status` (engine errors, out of memory, anything else).
* Real in-process gRPC calls to the target service (both engines), the draft service and the
  server's stream limit: each refusal carries the right code AND reason, in ``ItemStatus.reason``
  for an item of a stream message, in the trailing metadata ``dflash-reason`` for a refused call.
* The orchestrator against a scripted fake target: its own refusals carry reasons (queue full,
  prompt too long, bad sampling, ...); the target's reasons drive the scheduler (a prefill refused
  with NO_FREE_SLOT waits in the queue and is retried; the same code with another reason, or the
  old message text without the reason, is not retried; CONTEXT_FULL finishes a request with
  finish reason CONTEXT, another RESOURCE_EXHAUSTED ends it with that status).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import torch

from dflash_grpc import serving
from dflash_grpc.transport import GRPC_OPTIONS, REASON_KEY, abort, reason_of
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from fixtures.fakes import FakeTokenizer
from runtime.errors import (Code, EngineError, FailedPrecondition, InvalidArgument, Reason, ResourceExhausted,
                            SessionNotFound, Unavailable)
from runtime.status import abort_with, item_status, status_with_reason

RE = grpc.StatusCode.RESOURCE_EXHAUSTED
IA = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 300
CONTEXT = 32


# ------------------------------------------------------------------------------------------------
# the enum and the mapping


def test_reason_values_are_their_names_and_str():
    for r in Reason:
        assert r.value == r.name and str(r) == r.name and r == r.name
    assert len({r.value for r in Reason}) == len(Reason)


def test_engine_errors_default_and_override_their_reason():
    assert InvalidArgument("x").reason is Reason.INVALID_ARGUMENT
    assert SessionNotFound("x").reason is Reason.SESSION_NOT_FOUND
    assert ResourceExhausted("x").reason is Reason.RESOURCE_EXHAUSTED
    assert FailedPrecondition("x").reason is Reason.FAILED_PRECONDITION
    assert EngineError("x").reason is Reason.INTERNAL
    e = ResourceExhausted("x", reason=Reason.NO_FREE_SLOT)
    assert e.reason is Reason.NO_FREE_SLOT and e.code is Code.RESOURCE_EXHAUSTED
    assert ResourceExhausted("x").reason is Reason.RESOURCE_EXHAUSTED  # the override is per raise
    u = Unavailable("stopping")
    assert isinstance(u, RuntimeError) and u.code is Code.UNAVAILABLE and u.reason is Reason.SHUTTING_DOWN


@pytest.mark.parametrize("error, code, reason", [
    (InvalidArgument("bad tree", reason=Reason.INVALID_TREE), IA, "INVALID_TREE"),
    (SessionNotFound("gone"), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
    (FailedPrecondition("len", reason=Reason.LENGTH_MISMATCH), grpc.StatusCode.FAILED_PRECONDITION, "LENGTH_MISMATCH"),
    (Unavailable("stopping"), grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory"), RE, "OUT_OF_MEMORY"),
    (ZeroDivisionError("bug"), grpc.StatusCode.INTERNAL, "INTERNAL"),
])
def test_status_and_item_status_carry_the_reason(error, code, reason):
    s = status_with_reason(error)
    assert (s.code, s.reason.value) == (code, reason) and s.message
    item = item_status(error)
    assert (item.code, item.reason) == (code.value[0], reason) and item.message
    ok = item_status(None)
    assert ok.code == 0 and ok.reason == ""


# ------------------------------------------------------------------------------------------------
# target service over gRPC


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fixtures.tiny_models import write_tiny_llama
    from draft_service.init_random import write_random_drafter

    d = tmp_path_factory.mktemp("reasons")
    target = write_tiny_llama(d / "target.gguf", vocab=VOCAB, seed=3)
    drafter = d / "drafter.gguf"
    write_random_drafter(target.path, drafter, block_size=4, num_target_layers=2, layers=1, dtype="f32", seed=1)
    return str(target.path), str(drafter)


def _serve(add):
    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=4)
    return server, grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)


@pytest.fixture(params=["reference", "batched"])
def target(request, tiny):
    """``(stub, channel, servicer)`` of a target with 2 slots and a context of 32, over gRPC."""
    from runtime.step_loop import StepLoop
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    engine, info = build_engine(tiny[0], max_sessions=2, max_context=CONTEXT, max_tree_width=8, max_tree_depth=8,
                                engine=request.param)
    loop = StepLoop(engine, name="reasons-target")
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, channel = _serve(add)
    try:
        yield target_pb2_grpc.TargetServiceStub(channel), channel, servicer
    finally:
        channel.close()
        server.stop(None)
        loop.stop()


def _prefill(stub, sid, prompt, **sampling):
    item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=prompt, sampling=common_pb2.SamplingParams(**sampling))
    return stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=60).results[0]


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), reason_of(ei.value)


def test_target_prefill_refusals_carry_their_reason(target):
    stub, _, _ = target
    assert _refused(lambda: _prefill(stub, "a", list(range(1, CONTEXT + 1)))) == (RE, "PROMPT_TOO_LONG")
    assert _refused(lambda: _prefill(stub, "a", [1, VOCAB + 5])) == (IA, "INVALID_TOKEN")
    assert _refused(lambda: _prefill(stub, "a", [1, 2], temperature=-1.0)) == (IA, "INVALID_SAMPLING")
    assert _refused(lambda: _prefill(stub, "a", [1, 2], top_p=2.0)) == (IA, "INVALID_SAMPLING")
    assert _refused(lambda: _prefill(stub, "", [1, 2])) == (IA, "INVALID_ARGUMENT")
    first = _prefill(stub, "a", [1, 2]).first_token
    assert _refused(lambda: _prefill(stub, "a", [1, 2])) == (IA, "SESSION_EXISTS")
    # the refused duplicate left the live session alone
    (res,) = stub.Verify(iter([target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
        session_id="a", tree=common_pb2.TokenTree(tokens=[first], parents=[-1]))])]), timeout=60)
    assert res.results[0].status.code == 0, res.results[0].status.message
    _prefill(stub, "b", [1, 2])
    assert _refused(lambda: _prefill(stub, "c", [1, 2])) == (RE, "NO_FREE_SLOT")   # 2 slots
    stub.Release(common_pb2.ReleaseRequest(session_ids=["b"]), timeout=30)
    _prefill(stub, "c", [1, 2])


def test_target_verify_items_carry_their_reason(target):
    stub, _, _ = target
    first = _prefill(stub, "s", list(range(1, CONTEXT - 2))).first_token      # 29 rows committed of 32
    items = [
        target_pb2.VerifyItem(session_id="nope", tree=common_pb2.TokenTree(tokens=[1], parents=[-1])),
        target_pb2.VerifyItem(session_id="s", tree=common_pb2.TokenTree(tokens=[first, 1], parents=[-1, 5])),
        target_pb2.VerifyItem(session_id="s"),                                   # no tree
        target_pb2.VerifyItem(session_id="s", tree=common_pb2.TokenTree(tokens=[(first + 1) % VOCAB], parents=[-1])),
        target_pb2.VerifyItem(session_id="s", tree=common_pb2.TokenTree(tokens=[first, 1, 2, 3], parents=[-1, 0, 1, 2])),
    ]
    want = [(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"), (IA, "INVALID_TREE"), (IA, "INVALID_TREE"),
            (IA, "INVALID_TREE"), (RE, "CONTEXT_FULL")]
    for it, (code, reason) in zip(items, want):    # one item per message: a session appears once per verify
        (res,) = stub.Verify(iter([target_pb2.VerifyRequest(items=[it])]), timeout=60)
        st = res.results[0].status
        assert (st.code, st.reason) == (code.value[0], reason), st.message
    (res,) = stub.Verify(iter([target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
        session_id="s", tree=common_pb2.TokenTree(tokens=[first], parents=[-1]))])]), timeout=60)
    assert res.results[0].status.code == 0 and res.results[0].status.reason == ""


def test_target_stops_feature_rows_for_sessions_decoded_plainly(target):
    """``VerifyRequest.stop_features``: from that request's step on, the named sessions' results
    carry no feature rows (a request the orchestrator decodes plainly for the rest of its life);
    other sessions keep theirs, unknown ids are ignored, and the tokens are unchanged."""
    stub, _, _ = target

    def prefill(sid):
        item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=[3, 4, 5], feature_layer_ids=[0])
        return stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=60).results[0].first_token

    roots = {"keep": prefill("keep"), "stop": prefill("stop")}

    def step(stop=()):
        req = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(session_id=sid, tree=common_pb2.TokenTree(
            tokens=[roots[sid]], parents=[-1])) for sid in ("keep", "stop")], stop_features=list(stop))
        (res,) = stub.Verify(iter([req]), timeout=60)
        out = {}
        for sid, r in zip(("keep", "stop"), res.results):
            assert r.status.code == 0, r.status.message
            roots[sid] = r.bonus_token
            out[sid] = (r.bonus_token, len(r.features.data))
        return out

    first = step()
    assert first["keep"][1] > 0 and first["stop"][1] > 0                  # both tap layer 0
    second = step(stop=["stop", "unknown"])
    assert second["keep"][1] == first["keep"][1] and second["stop"][1] == 0
    assert step()["stop"][1] == 0                                          # for the rest of its life
    stub.Release(common_pb2.ReleaseRequest(session_ids=["keep", "stop"]), timeout=30)
    # another owner's stop_features leaves a session's rows alone
    from runtime.owners import EPOCH_KEY, OWNER_KEY

    mine, other = ((OWNER_KEY, "mine"), (EPOCH_KEY, "1")), ((OWNER_KEY, "other"), (EPOCH_KEY, "1"))
    item = target_pb2.PrefillItem(session_id="owned", prompt_tokens=[3, 4, 5], feature_layer_ids=[0])
    root = stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=60, metadata=mine).results[0].first_token
    (res,) = stub.Verify(iter([target_pb2.VerifyRequest(stop_features=["owned"])]), timeout=60, metadata=other)
    (res,) = stub.Verify(iter([target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
        session_id="owned", tree=common_pb2.TokenTree(tokens=[root], parents=[-1]))])]), timeout=60, metadata=mine)
    assert res.results[0].status.code == 0 and len(res.results[0].features.data) > 0
    stub.Release(common_pb2.ReleaseRequest(session_ids=["owned"]), timeout=30, metadata=mine)


def test_target_out_of_memory_and_stopped_loop(target, monkeypatch):
    stub, _, servicer = target
    from concurrent.futures import Future

    def oom(*args, **kwargs):
        f = Future()
        f.set_exception(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
        return f

    monkeypatch.setattr(servicer.loop, "submit_prefill", oom)
    assert _refused(lambda: _prefill(stub, "m", [1, 2])) == (RE, "OUT_OF_MEMORY")
    monkeypatch.undo()
    servicer.loop.stop()
    assert _refused(lambda: _prefill(stub, "m", [1, 2])) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")


def test_malformed_request_carries_invalid_argument(target):
    _, channel, _ = target
    call = channel.unary_unary("/dflash_grpc.v1.TargetService/Prefill")  # raw bytes both ways
    assert _refused(lambda: call(b"\xff\xff\xff", timeout=30)) == (IA, "INVALID_ARGUMENT")


def _free_slots(stub) -> int:
    return stub.Info(target_pb2.TargetInfoRequest(), timeout=30).free_slots


def test_target_prefill_feature_layers_bounded_and_leave_no_session(target):
    """Feature layers named twice are refused (so at most the model's layer count), a reply that
    would pass the message limit is refused with RESOURCE_EXHAUSTED before any work, and neither
    refusal leaves a session behind."""
    stub, _, servicer = target
    engine = servicer.loop.engine
    layers = engine.cfg.num_layers

    def prefill(sid, prompt, feature_layers):
        item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=prompt, feature_layer_ids=feature_layers)
        return stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=60).results[0]

    free = _free_slots(stub)
    assert _refused(lambda: prefill("d", list(range(1, 21)), [0] * 1000)) == (IA, "INVALID_ARGUMENT")
    assert _refused(lambda: prefill("d", [1, 2], [0, layers - 1, 0])) == (IA, "INVALID_ARGUMENT")
    assert _refused(lambda: prefill("d", [1, 2], list(range(layers)) + [layers])) == (IA, "INVALID_ARGUMENT")
    assert _free_slots(stub) == free and "d" not in engine.sessions
    # a reply over the limit: rows x layers x hidden x 2 bytes (the limit lowered to fit the tiny model)
    rows, hidden = 20, engine.cfg.hidden_size
    servicer.max_reply_bytes = rows * layers * hidden * 2 - 1
    forwards = engine.forwards
    with pytest.raises(grpc.RpcError) as ei:
        prefill("big", list(range(1, rows + 1)), list(range(layers)))
    assert (ei.value.code(), reason_of(ei.value)) == (RE, "RESOURCE_EXHAUSTED")
    assert "message limit" in ei.value.details()
    assert engine.forwards == forwards and _free_slots(stub) == free and "big" not in engine.sessions   # no work, no session
    # duplicates are refused as such whatever their count (not as a reply too large)
    assert _refused(lambda: prefill("big", list(range(1, rows + 1)), [0] * 1000)) == (IA, "INVALID_ARGUMENT")
    assert engine.forwards == forwards and _free_slots(stub) == free
    # the same prompt with fewer layers fits; with the real limit the whole one does
    assert len(prefill("small", list(range(1, rows + 1)), [0]).features.data) == rows * hidden * 2
    servicer.max_reply_bytes = type(servicer).max_reply_bytes
    res = prefill("big", list(range(1, rows + 1)), list(range(layers)))
    assert list(res.features.shape) == [rows, layers * hidden] and _free_slots(stub) == free - 2


def test_malformed_stream_messages_carry_invalid_argument(target, drafter):
    """Bytes that are not a request message on the Verify and Propose streams end that stream with
    INVALID_ARGUMENT (reason INVALID_ARGUMENT), not INTERNAL; the server serves the next stream."""
    tstub, tchannel, _ = target
    dstub, _, dchannel = drafter
    for channel, method in ((tchannel, "/dflash_grpc.v1.TargetService/Verify"), (dchannel, "/dflash_grpc.v1.DraftService/Propose")):
        call = channel.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for garbage in ([b"\xff\xff\xff"], [b"\x0a\x05ab"], [b"", b"\xff\xff"]):  # bad tag; truncated; one good, one bad
            assert _refused(lambda: list(call(iter(garbage), timeout=30))) == (IA, "INVALID_ARGUMENT"), (method, garbage)
    # both servers still serve streams
    first = _prefill(tstub, "ok", [1, 2]).first_token
    (res,) = tstub.Verify(iter([target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
        session_id="ok", tree=common_pb2.TokenTree(tokens=[first], parents=[-1]))])]), timeout=60)
    assert res.results[0].status.code == 0, res.results[0].status.message
    (res,) = dstub.Propose(iter([draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(session_id="ok", root_token=1)])]),
                           timeout=60)
    assert res.results[0].status.code == 0, res.results[0].status.message


# ------------------------------------------------------------------------------------------------
# draft service over gRPC


@pytest.fixture()
def drafter(tiny):
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer

    servicer = DraftServiceServicer.from_paths(tiny[1], tiny[0], max_sessions=2, max_context=8)

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    server, channel = _serve(add)
    try:
        yield draft_pb2_grpc.DraftServiceStub(channel), servicer, channel
    finally:
        channel.close()
        server.stop(None)
        servicer.close()


def test_draft_items_carry_their_reason(drafter):
    from dflash_grpc.wire import tensor_to_proto

    stub, servicer, _ = drafter
    width = servicer.config.feature_size

    def item(sid, rows, committed, root=1, features=None, w=width):
        f = features if features is not None else tensor_to_proto(torch.randn(rows, w).to(torch.bfloat16))
        return draft_pb2.ProposeItem(session_id=sid, features=f, root_token=root, committed_length=committed)

    broken = tensor_to_proto(torch.randn(2, width).to(torch.bfloat16))
    broken.data = broken.data[:-2]
    cases = [
        ([item("a", 2, 2), item("b", 2, 2)], [(0, ""), (0, "")]),            # both slots taken
        ([item("c", 2, 2)], [(RE, "NO_FREE_SLOT")]),
        ([item("a", 2, 3)], [(grpc.StatusCode.FAILED_PRECONDITION, "LENGTH_MISMATCH")]),
        ([item("a", 7, 9)], [(RE, "CONTEXT_FULL")]),                          # 2 + 7 rows > 8
        ([item("a", 2, 4, w=width + 1)], [(IA, "INVALID_FEATURES")]),
        ([item("a", 2, 4, features=broken)], [(IA, "INVALID_FEATURES")]),
        ([item("a", 2, 4, root=VOCAB + 1)], [(IA, "INVALID_TOKEN")]),
        ([item("", 2, 2)], [(IA, "INVALID_ARGUMENT")]),
    ]
    for items, want in cases:
        (res,) = stub.Propose(iter([draft_pb2.ProposeRequest(items=items)]), timeout=60)
        got = [(r.status.code, r.status.reason) for r in res.results]
        assert got == [(c if c == 0 else c.value[0], r) for c, r in want], [r.status.message for r in res.results]


# ------------------------------------------------------------------------------------------------
# the helpers and the server's stream limit


class _Hold:
    """``test.Hold/Open``: a stream that stays open until released; ``test.Hold/Refuse`` aborts."""

    def __init__(self):
        self.release = threading.Event()

    def add(self, server):
        def hold(request_iterator, context):
            yield b"open"
            self.release.wait(30)

        def refuse(request, context):
            abort(context, RE, "all session slots are in use", "")       # no reason: the text is not one

        handlers = {"Open": grpc.stream_stream_rpc_method_handler(hold),
                    "Refuse": grpc.unary_unary_rpc_method_handler(refuse)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Hold", handlers),))
        return ["test.Hold"]


def test_stream_limit_carries_streams_busy_and_no_reason_is_empty():
    hold = _Hold()
    server, _, port = serving.make_server(hold.add, "127.0.0.1:0", max_workers=1)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        first = channel.stream_stream("/test.Hold/Open")(iter(()), timeout=30)
        assert next(first) == b"open"
        second = channel.stream_stream("/test.Hold/Open")(iter(()), timeout=30)
        with pytest.raises(grpc.RpcError) as ei:
            next(second)
        assert ei.value.code() == RE and reason_of(ei.value) == "STREAMS_BUSY"
        assert dict(ei.value.trailing_metadata())[REASON_KEY] == Reason.STREAMS_BUSY.value
        assert _refused(lambda: channel.unary_unary("/test.Hold/Refuse")(b"", timeout=30)) == (RE, "")
    finally:
        hold.release.set()
        channel.close()
        server.stop(None)
    assert reason_of(ValueError("no metadata")) == ""


def test_abort_with_sets_reason_metadata_then_aborts():
    class Ctx:
        md = None

        def set_trailing_metadata(self, md):
            self.md = md

        def abort(self, code, message):
            raise RuntimeError((code, message))

    ctx = Ctx()
    with pytest.raises(RuntimeError) as ei:
        abort_with(ctx, ResourceExhausted("all slots", reason=Reason.NO_FREE_SLOT))
    assert ctx.md == ((REASON_KEY, "NO_FREE_SLOT"),) and ei.value.args[0] == (RE, "all slots")


# ------------------------------------------------------------------------------------------------
# the orchestrator against a scripted fake target


class ScriptedTarget(target_pb2_grpc.TargetServiceServicer):
    """A target whose Prefill and Verify answers are scripted per call: ``prefill_script`` holds
    ``(code, reason, message)`` refusals served in order (then successes); ``verify_status`` is
    the ``ItemStatus`` of every verify item (None: accept, bonus token 9)."""

    def __init__(self, max_context=64):
        self.max_context = max_context
        self.prefill_script: queue.SimpleQueue = queue.SimpleQueue()
        self.prefills = 0
        self.verify_status: common_pb2.ItemStatus | None = None
        self.gate = threading.Event()
        self.gate.set()

    def Info(self, request, context):
        return common_pb2.ModelInfo(vocab_size=VOCAB, max_context=self.max_context, max_tree_width=8, max_tree_depth=8,
                                    max_sessions=4, tokenizer_fingerprint="fp", model_fingerprint="m", device="cpu")

    def Prefill(self, request, context):
        self.prefills += 1
        self.gate.wait(30)
        try:
            code, reason, message = self.prefill_script.get_nowait()
        except queue.Empty:
            it = request.items[0]
            return target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(
                session_id=it.session_id, first_token=9, committed_length=len(it.prompt_tokens))])
        abort(context, code, message, reason)

    def Verify(self, requests, context):
        for req in requests:
            out = []
            for x in req.items:
                if self.verify_status is not None:
                    out.append(target_pb2.VerifyResult(session_id=x.session_id, status=self.verify_status))
                else:
                    out.append(target_pb2.VerifyResult(session_id=x.session_id, bonus_token=9, committed_length=10))
            yield target_pb2.VerifyResponse(results=out)

    def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=len(request.session_ids))


@pytest.fixture()
def orch():
    """``(GenerationService stub, ScriptedTarget)``; the orchestrator holds 1 session, queues 0."""
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Scheduler
    from orchestrator.servicer import GenerationServicer

    fake = ScriptedTarget()

    def add_target(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(fake, server)
        return ["dflash_grpc.v1.TargetService"]

    tserver, _, tport = serving.make_server(add_target, "127.0.0.1:0", max_workers=4)
    peer, draft = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(None)
    sched = Scheduler(peer, draft, max_sessions=1, max_queue=0, step_timeout=10.0)
    servicer = GenerationServicer(peer, draft, FakeTokenizer(), 4, None, sched)

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    server, channel = _serve(add)
    try:
        yield generation_pb2_grpc.GenerationServiceStub(channel), fake
    finally:
        fake.gate.set()
        channel.close()
        server.stop(None)
        sched.stop()
        peer.close()
        tserver.stop(None)


def _generate(stub, ids=(1, 2, 3), max_tokens=2, **sampling) -> list[generation_pb2.GenerateResponse]:
    req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=list(ids)), max_tokens=max_tokens,
                                         sampling=common_pb2.SamplingParams(**sampling), ignore_eos=True)
    return list(stub.Generate(req, timeout=30))


def test_orchestrator_refusals_carry_their_reason(orch):
    stub, _ = orch
    assert _refused(lambda: _generate(stub, temperature=-1.0)) == (IA, "INVALID_SAMPLING")
    assert _refused(lambda: _generate(stub, top_k=-1)) == (IA, "INVALID_SAMPLING")
    assert _refused(lambda: _generate(stub, ids=[1, VOCAB])) == (IA, "INVALID_TOKEN")
    assert _refused(lambda: _generate(stub, ids=list(range(1, 65)))) == (RE, "PROMPT_TOO_LONG")
    assert _refused(lambda: _generate(stub, max_tokens=-1)) == (IA, "INVALID_ARGUMENT")
    assert _generate(stub)[-1].finished


def test_orchestrator_queue_full(orch):
    stub, fake = orch
    fake.gate.clear()                                 # the first request's prefill hangs: 1 of 1 held
    first = stub.Generate(generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=[1, 2]), max_tokens=2,
                                                         ignore_eos=True), timeout=30)
    deadline = time.monotonic() + 10
    while fake.prefills == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _refused(lambda: _generate(stub)) == (RE, "QUEUE_FULL")
    fake.gate.set()
    assert list(first)[-1].finished


def test_slot_refusal_by_reason_is_retried(orch):
    stub, fake = orch
    for _ in range(2):   # the message does not say "slot": only the reason tells
        fake.prefill_script.put((RE, "NO_FREE_SLOT", "busy, come back later"))
    out = _generate(stub)
    assert out[-1].finished and fake.prefills == 3


@pytest.mark.parametrize("reason", ["OUT_OF_MEMORY", "RESOURCE_EXHAUSTED", ""])
def test_same_code_other_reason_is_not_a_slot_refusal(orch, reason):
    stub, fake = orch
    fake.prefill_script.put((RE, reason, "all 4 session slots are in use"))   # the old text test would retry
    assert _refused(lambda: _generate(stub)) == (RE, reason)
    assert fake.prefills == 1


def test_target_unavailable_carries_target_unavailable(orch):
    stub, fake = orch
    fake.prefill_script.put((grpc.StatusCode.UNAVAILABLE, "", "down"))
    assert _refused(lambda: _generate(stub)) == (grpc.StatusCode.UNAVAILABLE, "TARGET_UNAVAILABLE")
    fake.prefill_script.put((IA, "SESSION_EXISTS", "exists"))                  # a target reason passes on
    assert _refused(lambda: _generate(stub)) == (IA, "SESSION_EXISTS")


def test_context_full_by_reason_finishes_with_context(orch):
    stub, fake = orch
    fake.verify_status = common_pb2.ItemStatus(code=RE.value[0], reason="CONTEXT_FULL", message="no room")
    out = _generate(stub, max_tokens=4)
    assert out[-1].finished and out[-1].finish_reason == generation_pb2.FINISH_REASON_CONTEXT
    assert [t for r in out for t in r.token_ids] == [9]                       # the prefill's token only


def test_other_verify_refusal_is_not_context_full(orch):
    stub, fake = orch
    fake.verify_status = common_pb2.ItemStatus(code=RE.value[0], reason="OUT_OF_MEMORY", message="context buffer: out of memory")
    assert _refused(lambda: _generate(stub, max_tokens=4)) == (RE, "OUT_OF_MEMORY")
    fake.verify_status = common_pb2.ItemStatus(code=grpc.StatusCode.NOT_FOUND.value[0], reason="SESSION_NOT_FOUND", message="gone")
    assert _refused(lambda: _generate(stub, max_tokens=4)) == (grpc.StatusCode.UNAVAILABLE, "TARGET_UNAVAILABLE")
