"""Fuzzing the public API: random ``GenerateRequest`` messages and random bytes sent to ``Generate``.

A target and a draft service run in this process on a tiny synthetic model (reference engines,
context 64); the orchestrator runs as a real process (``python -m orchestrator``), so a crash shows
as an exited process. Every answer must be a normal stream whose last message, and only that one,
has ``finished=True``, or a gRPC error whose status says the request was refused
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, OUT_OF_RANGE): never UNKNOWN or
INTERNAL (a server bug), never a hang. After each example the orchestrator must still answer.

Generated ``max_tokens`` are 0..8 (0: the server default, 8 here), or one of a few extreme values
that must be refused (negative) or end at the context (64 rows), so the module runs in well under
a minute on a 2-core CPU.
"""

from __future__ import annotations

import math

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dflash_grpc import serving  # noqa: E402
from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from tests.conftest import draft_in_process, module_service, target_in_process  # noqa: E402

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
GENERATE = "/dflash_grpc.v1.GenerationService/Generate"
VOCAB = 300
CONTEXT = 64
INT32 = (-(2**31), 2**31 - 1)
CALL_TIMEOUT = 60.0

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def files(tiny_llama, tiny_drafter):
    """The shared tiny target (vocab :data:`VOCAB`) and its random drafter (tests/conftest.py)."""
    assert tiny_llama.vocab == VOCAB
    return tiny_llama.path, tiny_drafter


@pytest.fixture(scope="module")
def services(files):
    """``(orchestrator address, ServiceGroup)``: target and draft in-process, the orchestrator a process."""
    from client.launcher import ServiceGroup, free_ports

    target_path, drafter_path = files
    with target_in_process(target_path, max_sessions=4, max_context=CONTEXT, max_workers=8, name="fuzz-target") as tport, \
            draft_in_process(drafter_path, target_path, max_sessions=4, max_context=CONTEXT, max_workers=8) as (_, dport):
        (oport,) = free_ports(1)
        orch = module_service("orchestrator", "orchestrator", oport, "--target", f"127.0.0.1:{tport}",
                              "--draft", f"127.0.0.1:{dport}", "--model", target_path, "--max-tokens", "8")
        with ServiceGroup([orch], grace=5.0) as group:
            group.wait_healthy(timeout=120)
            yield orch.address, group


@pytest.fixture(scope="module")
def channel(services):
    with serving.channel(services[0]) as ch:
        yield ch


# --------------------------------------------------------------------------------------------
# Strategies

int32 = st.integers(*INT32)
extreme = st.one_of(st.integers(-3, 100), st.sampled_from([INT32[0], INT32[1], 2**20, -(2**20)]), int32)
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, VOCAB + 10), st.integers(-5, -1), int32)
text = st.text(max_size=40)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
temperatures = floats32
roles = st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "", "USER", "<|im_start|>", "{{ x }}"]), text)
odd_max_tokens = st.sampled_from([-1, -(2**31), 2**31 - 1, 10**6])


def usually(draw, valid, odd):
    """A value from ``valid`` seven times in eight, else from ``odd`` (so that many requests get past
    validation and decode, and every field is sometimes out of range)."""
    return draw(odd) if draw(st.integers(0, 7)) == 0 else draw(valid)


@st.composite
def requests(draw) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_tokens=usually(draw, st.integers(0, 8), odd_max_tokens),
                                         ignore_eos=draw(st.booleans()))  # fmt: skip
    kind = usually(draw, st.sampled_from(["prompt", "tokens", "chat"]), st.sampled_from(["long_tokens", "none"]))
    if kind == "prompt":
        req.prompt = usually(draw, st.text(min_size=1, max_size=40), st.sampled_from(["", "\x00", "\ud7ff" * 30]))
    elif kind == "tokens":
        ids = usually(draw, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), st.lists(token_ids, max_size=20))
        req.prompt_tokens.ids.extend(ids)
    elif kind == "long_tokens":  # as long as the context, or longer
        req.prompt_tokens.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT - 2, max_size=CONTEXT + 8)))
    elif kind == "chat":
        req.chat.add_generation_prompt = draw(st.booleans())
        messages = usually(draw, st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), text), min_size=1, max_size=3),
                           st.lists(st.tuples(roles, text), max_size=4))  # fmt: skip
        for role, content in messages:
            req.chat.messages.add(role=role, content=content)
    s = req.sampling
    s.temperature = usually(draw, st.one_of(st.just(0.0), st.floats(0.1, 2.0)), temperatures)
    s.top_k = usually(draw, st.integers(0, 50), extreme)
    s.top_p = usually(draw, st.one_of(st.just(0.0), st.floats(0.05, 1.0)), floats32)
    seed = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    if seed is not None:
        s.seed = seed
    req.stop.extend(draw(st.lists(st.one_of(text, st.just(""), st.sampled_from([" ", "e", "\n"])), max_size=3)))
    if draw(st.booleans()):
        req.speculative.enabled = draw(st.booleans())
    for name, valid in (("tree_budget", st.integers(0, 32)), ("top_k", st.integers(0, 8)), ("max_depth", st.integers(0, 8))):
        if draw(st.booleans()):
            setattr(req.speculative, name, usually(draw, valid, extreme))
    req.request_id = usually(draw, st.one_of(st.just(""), text), st.text(min_size=100, max_size=400))
    return req


# --------------------------------------------------------------------------------------------
# Checks


def _check_answer(call, parse, what) -> None:
    """A finished stream (the last message only has finished=True) or an allowed refusal."""
    try:
        msgs = [parse(m) for m in call]
    except grpc.RpcError as e:
        hypothesis.event(f"refused: {e.code().name} {(e.details() or '')[:50]}")
        assert e.code() in ALLOWED, f"{e.code().name}: {e.details()!r} for {what}"
        return
    hypothesis.event(f"finished: {generation_pb2.FinishReason.Name(msgs[-1].finish_reason) if msgs else '-'}")
    assert msgs, f"empty stream for {what}"
    assert msgs[-1].finished and not any(m.finished for m in msgs[:-1]), f"bad stream end for {what}"
    assert msgs[-1].finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED, f"no finish reason for {what}"


def _still_serving(services, channel) -> None:
    _, group = services
    assert group.poll() is None, f"the orchestrator exited with {group.returncode('orchestrator')}"
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    stub.GetStats(generation_pb2.GetStatsRequest(), timeout=10)


@FUZZ
@given(req=requests())
def test_fuzz_generate_requests(services, channel, req):
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    _check_answer(stub.Generate(req, timeout=CALL_TIMEOUT), lambda m: m, req)
    _still_serving(services, channel)


@settings(FUZZ, max_examples=40)
@given(raw=st.one_of(st.binary(max_size=200), requests().map(lambda r: r.SerializeToString()[: len(r.SerializeToString()) // 2])))
def test_fuzz_raw_bytes(services, channel, raw):
    """Random bytes, and truncated valid requests, as the Generate request."""
    call = channel.unary_stream(GENERATE)(raw, timeout=CALL_TIMEOUT)  # no serializers: bytes in, bytes out
    _check_answer(call, generation_pb2.GenerateResponse.FromString, raw)
    _still_serving(services, channel)


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
                                         ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan), ("top_k", -1)])  # fmt: skip
def test_bad_sampling_is_invalid_argument(channel, field, value):
    req = generation_pb2.GenerateRequest(prompt="hello", max_tokens=2)
    setattr(req.sampling, field, value)
    with pytest.raises(grpc.RpcError) as ei:
        list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(req, timeout=CALL_TIMEOUT))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-5])
def test_tiny_temperature_is_invalid_argument(channel, temperature):
    """A positive temperature whose inverse would scale logits past float32 (found by this fuzzer)."""
    req = generation_pb2.GenerateRequest(prompt="hello", max_tokens=2)
    req.sampling.temperature = temperature
    with pytest.raises(grpc.RpcError) as ei:
        list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(req, timeout=CALL_TIMEOUT))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_still_generates_after_fuzzing(services, channel):
    req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=[5, 6, 7]), max_tokens=5, ignore_eos=True)
    msgs = list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(req, timeout=CALL_TIMEOUT))
    assert msgs[-1].finished and msgs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in msgs) == 5
