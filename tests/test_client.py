"""SDK (sync + asyncio), CLI and ServiceGroup against an in-process fake GenerationService."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import signal
import sys
import textwrap
import threading
import time

import grpc
import grpc.aio
import pytest
from dflash_grpc.serving import make_server
from dflash_grpc.transport import REASON_KEY
from dflash_grpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

import client
from client import (
    AcceptanceStats,
    AsyncClient,
    CancelledError,
    Client,
    DeadlineExceededError,
    DFlashError,
    FailedPreconditionError,
    GenerateRequest,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from client.cli import main
from client.launcher import Service, ServiceExited, ServiceGroup, dflash_services, free_ports

PIECES = [("Hel", [10, 11]), ("lo", [12]), (" world", [13, 14])]
TEXT = "Hello world"
IDS = [10, 11, 12, 13, 14]

REQ_STATS = generation_pb2.AcceptanceStats(
    requests=1,
    prompt_tokens=3,
    generated_tokens=5,
    drafts=2,
    draft_tokens=8,
    accepted_tokens=3,
    accepted_per_position=[2, 1, 0],
    drafted_per_position=[2, 2, 1],
    mean_acceptance_length=2.5,
    acceptance_length_histogram=[0, 0, 1, 1],
    target_forwards=2,
    wall_time_s=0.5,
    decode_time_s=0.25,
    tokens_per_second=20.0,
    draft_fallbacks=1,
    autoregressive_steps=0,
)
GLOBAL_STATS = generation_pb2.AcceptanceStats(requests=7, generated_tokens=700, mean_acceptance_length=3.25,
                                              tokens_per_second=123.5, drafted_per_position=[4], accepted_per_position=[3])  # fmt: skip

EXPECTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}
ALL_ERROR_CODES = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]


class FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Streams PIECES for any prompt; special prompts: ``error:<CODE>`` aborts with that code,
    ``reason:<CODE>:<REASON>`` too, with REASON as the ``dflash-reason`` trailing metadata,
    ``error-mid`` aborts after one chunk, ``slow`` sleeps 3 s, ``noend`` ends without a final message."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        prompt = request.prompt
        if prompt.startswith("error:"):
            code = grpc.StatusCode[prompt.split(":", 1)[1]]
            context.abort(code, f"boom {code.name}")
        if prompt.startswith("reason:"):
            _, code, reason = prompt.split(":", 2)
            context.set_trailing_metadata(((REASON_KEY, reason),))
            context.abort(grpc.StatusCode[code], "refused")
        if prompt == "slow":
            end = time.monotonic() + 3
            while time.monotonic() < end and context.is_active():
                time.sleep(0.02)
            return
        for i, (text, ids) in enumerate(PIECES):
            yield generation_pb2.GenerateResponse(text=text, token_ids=ids, prompt_tokens=3 if i == 0 else 0)
            if prompt == "error-mid":
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "context full")
        if prompt == "noend":
            return
        yield generation_pb2.GenerateResponse(finished=True, finish_reason=generation_pb2.FINISH_REASON_LENGTH, stats=REQ_STATS)

    def GetStats(self, request, context):
        return GLOBAL_STATS

    def Info(self, request, context):
        return generation_pb2.ServiceInfo(
            target=common_pb2.ModelInfo(model_name="smol", architecture="llama", vocab_size=49152, features=["tree-verify"]),
            drafter=generation_pb2.DrafterStatus(available=True, compatible=True, address="127.0.0.1:1", detail="ok"),
            version="9.9",
        )


def serve_fake_generation(servicer):
    """Serve ``servicer`` as the GenerationService on a free loopback port (sets
    ``servicer.address``); a generator for module fixtures: yields the servicer, then stops."""

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    server, _, port = make_server(add, "127.0.0.1:0")
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0)


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake_generation(FakeGeneration())


# --------------------------------------------------------------------------------------------
# Types


def test_stats_fields_match_proto():
    names = [f.name for f in generation_pb2.AcceptanceStats.DESCRIPTOR.fields]
    assert [f.name for f in dataclasses.fields(AcceptanceStats)] == names
    names = [f.name for f in common_pb2.ModelInfo.DESCRIPTOR.fields]
    assert [f.name for f in dataclasses.fields(client.ModelInfo)] == names


def test_stats_from_proto_and_format():
    s = AcceptanceStats.from_proto(REQ_STATS)
    assert s.accepted_per_position == [2, 1, 0] and isinstance(s.accepted_per_position, list)
    assert s.tau == 2.5 and s.draft_fallbacks == 1
    assert s.per_position_acceptance == [1.0, 0.5, 0.0]
    assert s.acceptance_rate == pytest.approx(3 / 8)
    text = s.format()
    for needle in ["2.500", "20.0", "target forwards:              2", "fallbacks 1", "d=1", "1.000  (2/2)",
                   "0.500  (1/2)", "3:       1"]:  # fmt: skip
        assert needle in text, (needle, text)
    assert AcceptanceStats().format()  # empty stats format too
    json.dumps(s.to_dict())


def test_request_building():
    req = client.build_request(tokens=[1, 2], seed=7, stop="x", speculative=False, tree_budget=5, top_k_draft=2, max_depth=3)
    assert list(req.prompt_tokens.ids) == [1, 2] and req.sampling.seed == 7 and list(req.stop) == ["x"]
    assert req.speculative.enabled is False and req.speculative.HasField("enabled")
    assert (req.speculative.tree_budget, req.speculative.top_k, req.speculative.max_depth) == (5, 2, 3)
    req = client.build_request("p")
    assert req.WhichOneof("input") == "prompt"
    assert not req.sampling.HasField("seed") and not req.HasField("speculative")
    req = client.build_request(messages=[{"role": "system", "content": "s"}, ("user", "u")])
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "s"), ("user", "u")]
    assert req.chat.add_generation_prompt
    for bad in [{}, {"prompt": "a", "tokens": [1]}, {"tokens": ["x"]}, {"prompt": "a", "seed": -1}]:
        with pytest.raises(InvalidArgumentError):
            client.build_request(**bad)


# The request builder of the SDK before GenerateRequest (build_request of client/__init__.py at
# 1042235, less its error handling): GenerateRequest.to_proto must send exactly what it sent.
def _legacy_chat_message(m):
    if isinstance(m, generation_pb2.ChatMessage):
        return m
    if isinstance(m, dict):
        return generation_pb2.ChatMessage(role=m["role"], content=m["content"])
    role, content = m
    return generation_pb2.ChatMessage(role=role, content=content)


def _legacy_build_request(prompt=None, *, tokens=None, messages=None, max_tokens=128, temperature=0.0, top_k=0, top_p=0.0,
                          seed=None, stop=(), ignore_eos=False, speculative=None, tree_budget=None, top_k_draft=None,
                          max_depth=None, request_id=None):
    if isinstance(stop, str):
        stop = [stop]
    req = generation_pb2.GenerateRequest(max_tokens=max_tokens,
                                         sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                                         stop=list(stop), ignore_eos=ignore_eos, request_id=request_id or "")
    if prompt is not None:
        req.prompt = prompt
    elif tokens is not None:
        req.prompt_tokens.ids.extend(tokens)
    else:
        req.chat.messages.extend(_legacy_chat_message(m) for m in messages)
        req.chat.add_generation_prompt = True
    if seed is not None:
        req.sampling.seed = seed
    spec = {"enabled": speculative, "tree_budget": tree_budget, "top_k": top_k_draft, "max_depth": max_depth}
    for name, value in spec.items():
        if value is not None:
            setattr(req.speculative, name, value)
    return req


OPTION_SETS = [
    dict(prompt="def f(x):"),
    dict(prompt="def f(x):", max_tokens=64),
    dict(prompt="", max_tokens=0, temperature=0.7, top_k=40, top_p=0.95, seed=0, stop="\n", ignore_eos=True),
    dict(tokens=[1, 2, 3], seed=2**64 - 1, stop=["a", "b"], speculative=False, request_id="r-1"),
    dict(tokens=[], speculative=True, tree_budget=0, top_k_draft=1, max_depth=4),
    dict(messages=[{"role": "system", "content": "s"}, ("user", "u"), generation_pb2.ChatMessage(role="a", content="c")],
         max_tokens=32, tree_budget=32, temperature=1, top_p=1),
    dict(messages=[], max_tokens=-5, temperature=-1.0, top_k=-1),  # the server judges meaning, not the client
]


def test_request_defaults():
    r = GenerateRequest()
    assert [f.name for f in dataclasses.fields(GenerateRequest)] == [
        "prompt", "tokens", "messages", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos",
        "speculative", "tree_budget", "top_k_draft", "max_depth", "request_id"]  # fmt: skip
    assert (r.prompt, r.tokens, r.messages) == (None, None, None)
    assert (r.max_tokens, r.temperature, r.top_k, r.top_p, r.seed, r.stop, r.ignore_eos) == (128, 0.0, 0, 0.0, None, (), False)
    assert (r.speculative, r.tree_budget, r.top_k_draft, r.max_depth, r.request_id) == (None, None, None, None, None)
    assert GenerateRequest("p") == GenerateRequest(prompt="p")  # only prompt is positional
    with pytest.raises(TypeError):
        GenerateRequest("p", [1])
    # normalised once: lists become tuples, messages (role, content) pairs; frozen and hashable
    r = GenerateRequest(tokens=[1, 2], stop="x", messages=None, temperature=1)
    assert r.tokens == (1, 2) and r.stop == ("x",) and type(r.temperature) is float
    m = GenerateRequest(messages=[{"role": "user", "content": "hi"}, ("assistant", "yo")])
    assert m.messages == (("user", "hi"), ("assistant", "yo"))
    assert hash(m) == hash(GenerateRequest(messages=[("user", "hi"), ("assistant", "yo")]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.seed = 3
    # replace: a checked copy
    assert r.replace(tokens=None, prompt="q").prompt == "q" and r.tokens == (1, 2)
    with pytest.raises(TypeError, match="'sede' .*'seed'"):
        r.replace(sede=1)


@pytest.mark.parametrize("options", [
    dict(prompt="a", tokens=[1]), dict(prompt="a", messages=[]), dict(tokens=[1], messages=[("u", "c")]),
    dict(prompt=b"bytes"), dict(tokens="abc"), dict(tokens=["x"]), dict(tokens=[2**31]), dict(tokens=[1.0]), dict(tokens=5),
    dict(messages="hi"), dict(messages=[{"role": "user"}]), dict(messages=[("user",)]), dict(messages=[("user", 3)]),
    dict(max_tokens="8"), dict(max_tokens=2**31), dict(max_tokens=1.5), dict(max_tokens=True), dict(temperature="hot"),
    dict(temperature=None), dict(top_k=0.5), dict(top_p=[1]), dict(seed=-1), dict(seed=2**64), dict(seed="1"),
    dict(stop=[1]), dict(stop=None), dict(ignore_eos="yes"), dict(ignore_eos=2), dict(speculative="no"),
    dict(tree_budget=-(2**31) - 1), dict(top_k_draft=1.0), dict(max_depth="3"), dict(request_id=7),
], ids=lambda o: ",".join(f"{k}={v!r}"[:24] for k, v in o.items()))
def test_request_validation(options):
    with pytest.raises(InvalidArgumentError, match="bad request argument|exactly one of"):
        GenerateRequest(**options)


def test_request_without_input_is_a_template():
    template = GenerateRequest(max_tokens=5, seed=1)  # fine to build ...
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        template.to_proto()  # ... not to send
    assert GenerateRequest.of("p", request=template) == GenerateRequest("p", max_tokens=5, seed=1)
    assert GenerateRequest.of(request=template) is template
    with pytest.raises(InvalidArgumentError, match="exactly one of"):
        GenerateRequest.of("p", request=GenerateRequest(tokens=[1]))


def test_request_options_errors():
    with pytest.raises(TypeError) as ei:
        GenerateRequest.of("p", max_tokns=3, temprature=0.5, bogus=1)
    msg = str(ei.value)
    assert "'max_tokns' (did you mean 'max_tokens'?)" in msg and "'temprature' (did you mean 'temperature'?)" in msg
    assert "'bogus'" in msg and msg.startswith("unknown generation options:")
    with pytest.raises(TypeError, match="not both"):
        GenerateRequest.of("p", request=GenerateRequest(), max_tokens=3)
    with pytest.raises(TypeError, match="must be a GenerateRequest"):
        GenerateRequest.of("p", request={"max_tokens": 3})


@pytest.mark.parametrize("options", OPTION_SETS, ids=range(len(OPTION_SETS)))
def test_request_to_proto_equals_legacy(options):
    new = GenerateRequest(**options).to_proto()
    old = _legacy_build_request(**options)
    assert new == old
    assert new.SerializeToString(deterministic=True) == old.SerializeToString(deterministic=True)
    assert client.build_request(**options) == old


# --------------------------------------------------------------------------------------------
# Sync client


def test_generate(fake):
    with Client(fake.address) as c:
        r = c.generate("hi", max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=1, stop=["\n"], ignore_eos=True)
    assert r.text == TEXT and r.token_ids == IDS
    assert r.finish_reason == "length" and r.prompt_tokens == 3
    assert r.stats == AcceptanceStats.from_proto(REQ_STATS)
    req = fake.requests[-1]
    assert req.prompt == "hi" and req.max_tokens == 5 and req.ignore_eos and list(req.stop) == ["\n"]
    assert req.sampling.top_k == 3 and req.sampling.seed == 1
    assert req.sampling.temperature == pytest.approx(0.5) and req.sampling.top_p == pytest.approx(0.9)


def test_generate_with_request_and_option_errors(fake):
    template = GenerateRequest(max_tokens=7, seed=3, stop="\n", speculative=False)
    with Client(fake.address) as c:
        assert c.generate("hi", request=template).text == TEXT
        assert fake.requests[-1] == GenerateRequest("hi", max_tokens=7, seed=3, stop="\n", speculative=False).to_proto()
        assert c.stream(request=template.replace(tokens=[4, 5])).collect().token_ids == IDS
        assert list(fake.requests[-1].prompt_tokens.ids) == [4, 5] and fake.requests[-1].max_tokens == 7
        n = len(fake.requests)
        with pytest.raises(TypeError, match="'max_token' \\(did you mean 'max_tokens'\\?\\), 'colour'"):
            c.generate("hi", max_token=3, colour="red")
        with pytest.raises(TypeError, match="unknown generation option"):
            c.stream("hi", bogus=1)
        with pytest.raises(TypeError, match="not both"):
            c.generate("hi", request=template, seed=4)
        with pytest.raises(InvalidArgumentError, match="seed=-1"):
            c.generate("hi", seed=-1)
        with pytest.raises(InvalidArgumentError, match="exactly one of"):
            c.stream()
        assert len(fake.requests) == n  # every one refused before a call


def test_stream(fake):
    with Client(fake.address) as c:
        stream = c.stream(messages=[{"role": "user", "content": "hi"}], speculative=True)
        chunks = list(stream)
    assert fake.requests[-1].chat.messages[0].content == "hi" and fake.requests[-1].speculative.enabled
    assert [ch.text for ch in chunks] == [p for p, _ in PIECES] + [""]
    assert [i for ch in chunks for i in ch.token_ids] == IDS
    assert not any(ch.finished for ch in chunks[:-1]) and chunks[-1].finished
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats.tau == 2.5
    assert chunks[0].prompt_tokens == 3
    assert stream.result.text == TEXT and stream.result.stats.generated_tokens == 5


def test_stream_errors_midway_and_unterminated(fake):
    with Client(fake.address) as c:
        stream = c.stream("error-mid")
        assert next(stream).text == "Hel"
        with pytest.raises(ResourceExhaustedError, match="context full"):
            next(stream)
        with pytest.raises(InternalError, match="without a final message"):
            c.generate("noend")


def test_stats_and_info(fake):
    with Client(fake.address) as c:
        s = c.stats()
        info = c.info()
    assert s.requests == 7 and s.tau == 3.25 and s.per_position_acceptance == [0.75]
    assert info.version == "9.9" and info.target.model_name == "smol" and info.target.features == ["tree-verify"]
    assert info.drafter.available and info.drafter.model is None
    assert "smol (llama)" in info.format()


@pytest.mark.parametrize("code", ALL_ERROR_CODES, ids=lambda c: c.name)
def test_status_codes_map_to_exceptions(fake, code):
    with Client(fake.address) as c:
        with pytest.raises(DFlashError) as ei:
            c.generate(f"error:{code.name}")
    err = ei.value
    assert type(err) is EXPECTED_CODES.get(code, DFlashError)
    assert err.code == code and err.message == f"boom {code.name}"
    assert str(err) == f"{code.name}: boom {code.name}"


def test_error_reason_from_trailing_metadata(fake):
    with Client(fake.address) as c:
        with pytest.raises(ResourceExhaustedError) as ei:
            c.generate("reason:RESOURCE_EXHAUSTED:NO_FREE_SLOT")
        assert ei.value.reason == "NO_FREE_SLOT" and ei.value.message == "refused"
        assert str(ei.value) == "RESOURCE_EXHAUSTED: refused"  # the reason is not in the text
        with pytest.raises(InvalidArgumentError) as ei:
            next(c.stream("error:INVALID_ARGUMENT"))  # no metadata: no reason
        assert ei.value.reason == ""

    async def run():
        async with AsyncClient(fake.address) as c:
            with pytest.raises(FailedPreconditionError) as ei:
                await c.generate("reason:FAILED_PRECONDITION:VOCAB_MISMATCH")
            return ei.value

    err = asyncio.run(run())
    assert err.reason == "VOCAB_MISMATCH" and err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert InvalidArgumentError("local").reason == ""  # raised by the client itself


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        if isinstance(self._trailing, Exception):
            raise self._trailing
        return self._trailing


@pytest.mark.parametrize("trailing,reason", [
    ((("x-other", "1"), (REASON_KEY, "NO_FREE_SLOT")), "NO_FREE_SLOT"),           # sync: tuple of pairs
    (grpc.aio.Metadata((REASON_KEY, "CONTEXT_FULL"), ("k", "v")), "CONTEXT_FULL"),  # grpc.aio.Metadata
    (((REASON_KEY, b"BYTES"),), "BYTES"),
    ((("x-other", "1"),), ""),
    ((), ""),
    (None, ""),
    (RuntimeError("no metadata yet"), ""),
])
def test_from_rpc_error_reason(trailing, reason):
    err = client.from_rpc_error(_FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", trailing))
    assert type(err) is ResourceExhaustedError and err.reason == reason and err.message == "full"
    bare = client.from_rpc_error(grpc.RpcError())  # no code, details nor metadata
    assert type(bare) is InternalError and bare.code == grpc.StatusCode.UNKNOWN and bare.reason == ""


def test_timeout(fake):
    with Client(fake.address) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            c.generate("slow", timeout=0.3)
        assert time.monotonic() - t0 < 2.5
    with Client(fake.address, timeout=0.3) as c:  # client-wide default
        with pytest.raises(DeadlineExceededError):
            c.generate("slow")
        assert c.generate("hi", timeout=10).text == TEXT


def test_unreachable_server():
    (port,) = free_ports(1)
    with Client(f"127.0.0.1:{port}") as c:
        with pytest.raises(UnavailableError):
            c.stats(timeout=5)


# --------------------------------------------------------------------------------------------
# Async client


def test_async_client(fake):
    async def run():
        async with AsyncClient(fake.address) as c:
            r = await c.generate(tokens=[1, 2, 3])
            assert (await c.generate(request=GenerateRequest(tokens=[1, 2, 3], seed=5))).text == TEXT
            assert fake.requests[-1].sampling.seed == 5 and list(fake.requests[-1].prompt_tokens.ids) == [1, 2, 3]
            with pytest.raises(TypeError, match="'tokenz'"):
                c.stream(tokenz=[1])
            stream = c.stream("hi")
            chunks = [ch async for ch in stream]
            s = await c.stats()
            info = await c.info()
            codes = {}
            for code in ALL_ERROR_CODES:
                try:
                    await c.generate(f"error:{code.name}")
                except DFlashError as e:
                    codes[code] = (type(e), e.code, e.message)
            with pytest.raises(DeadlineExceededError):
                await c.generate("slow", timeout=0.3)
            mid = c.stream("error-mid")
            first = await mid.__anext__()
            with pytest.raises(ResourceExhaustedError):
                await mid.__anext__()
        return r, chunks, stream.result, s, info, codes, first

    r, chunks, result, s, info, codes, first = asyncio.run(run())
    assert r.text == TEXT and r.token_ids == IDS and r.finish_reason == "length"
    assert r.stats == AcceptanceStats.from_proto(REQ_STATS)
    assert "".join(ch.text for ch in chunks) == TEXT and chunks[-1].finished
    assert result.text == TEXT and result.stats.tau == 2.5
    assert s.requests == 7 and info.version == "9.9"
    assert first.text == "Hel"
    for code in ALL_ERROR_CODES:
        assert codes[code] == (EXPECTED_CODES.get(code, DFlashError), code, f"boom {code.name}")


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_generate(fake, capsys):
    assert main(["generate", "--address", fake.address, "--max-tokens", "9", "--stop", "a", "--stop", "b",
                 "--no-speculative", "--draft-top-k", "4", "hi there"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out == TEXT + "\n"
    assert "finish reason: length" in err and "tau (mean acceptance length): 2.500" in err
    req = fake.requests[-1]
    assert req.prompt == "hi there" and req.max_tokens == 9 and list(req.stop) == ["a", "b"]
    assert req.speculative.HasField("enabled") and not req.speculative.enabled and req.speculative.top_k == 4


def test_cli_generate_chat_json(fake, capsys):
    assert main(["generate", "--address", fake.address, "--chat", "--json", "hi"]) == 0
    out, _ = capsys.readouterr()
    obj = json.loads(out)
    assert obj["text"] == TEXT and obj["tokens"] == IDS and obj["stats"]["mean_acceptance_length"] == 2.5
    assert fake.requests[-1].chat.messages[0].role == "user"


def test_cli_generate_prompt_file_and_stdin(fake, capsys, tmp_path, monkeypatch):
    path = tmp_path / "p.txt"
    path.write_text("from file")
    assert main(["generate", "--address", fake.address, "--prompt-file", str(path)]) == 0
    assert fake.requests[-1].prompt == "from file"
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert main(["generate", "--address", fake.address, "-"]) == 0
    assert fake.requests[-1].prompt == "from stdin"
    capsys.readouterr()
    assert main(["generate", "--address", fake.address]) == 1  # no prompt at all
    assert capsys.readouterr().err.startswith("error: ")


def test_cli_stats_and_info(fake, capsys):
    assert main(["stats", "--address", fake.address]) == 0
    out, _ = capsys.readouterr()
    assert "3.250" in out and "123.5" in out
    assert main(["stats", "--address", fake.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 7
    assert main(["info", "--address", fake.address]) == 0
    assert "9.9" in capsys.readouterr().out


def test_cli_generate_bad_option_is_refused_locally(fake, capsys):
    n = len(fake.requests)
    assert main(["generate", "--address", fake.address, "--seed", "-1", "hi"]) == 2
    assert capsys.readouterr().err == "error: INVALID_ARGUMENT: bad request argument: seed=-1 is not in [0, 18446744073709551615]\n"
    assert len(fake.requests) == n


def test_cli_errors(fake, capsys):
    assert main(["generate", "--address", fake.address, "error:INVALID_ARGUMENT"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: INVALID_ARGUMENT: boom INVALID_ARGUMENT\n"
    assert main(["generate", "--address", fake.address, "--timeout", "0.3", "slow"]) == 2
    assert capsys.readouterr().err.startswith("error: DEADLINE_EXCEEDED: ")
    (port,) = free_ports(1)
    assert main(["stats", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE: ") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["generate", "--address", fake.address, "--bogus", "x"])


def test_cli_demo_humaneval_prompt():
    from client.cli import _humaneval_prompt

    task, prompt = _humaneval_prompt("0")
    assert task == "HumanEval/0" and "def has_close_elements" in prompt


# --------------------------------------------------------------------------------------------
# ServiceGroup

# Child processes stand in for the services. They serve the standard health service like
# dflash_grpc.serving.make_server / serve_forever, without importing torch (which those do, via
# dflash_grpc.wire), so that they start in a fraction of a second.
MINI_SERVER = textwrap.dedent(
    """
    import signal, sys, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    def serve(name, port, add=lambda server: None):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add(server)
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(f"READY {name} port={port}", flush=True)
        while not stop.wait(0.1):  # wake up: a SIGTERM taken by a grpc thread sets no Event until
            pass                   # the main thread runs bytecode (a bare wait() can miss it)
        server.stop(grace=1).wait()
    """
)
DUMMY = MINI_SERVER + 'print("hello from dummy", flush=True)\nserve("dummy", sys.argv[1])\n'
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def _dummies(n: int) -> list[Service]:
    return [Service(f"svc{i}", [sys.executable, "-c", DUMMY, str(p)], f"127.0.0.1:{p}") for i, p in enumerate(free_ports(n))]


def test_service_group_healthy_kill_stop(capsys):
    group = ServiceGroup(_dummies(3), grace=5)
    ready = []
    with group:
        group.wait_healthy(timeout=30, on_ready=lambda s: ready.append(s.name))
        assert ready == ["svc0", "svc1", "svc2"] and group.poll() is None
        os.kill(group.procs["svc1"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.poll() == "svc1" and group.returncode("svc1") == -signal.SIGKILL
        codes = group.stop()
    assert all(p.poll() is not None for p in group.procs.values())
    assert codes["svc0"] == 0 and codes["svc2"] == 0  # SIGTERM -> graceful exit
    err = capsys.readouterr().err
    assert "hello from dummy" in err and "READY" not in err  # stdout forwarded, READY lines dropped


def test_service_group_child_exits_during_startup():
    services = _dummies(1) + [Service("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], "127.0.0.1:1")]
    with ServiceGroup(services) as group:
        with pytest.raises(ServiceExited, match="'broken' exited with code 3") as ei:
            group.wait_healthy(timeout=30)
        assert ei.value.name == "broken" and ei.value.returncode == 3
    assert all(p.poll() is not None for p in group.procs.values())


def test_service_group_kills_after_grace():
    group = ServiceGroup([Service("stubborn", [sys.executable, "-c", STUBBORN], "127.0.0.1:1")], grace=0.5)
    group.start()
    time.sleep(0.5)  # let it install its handler
    t0 = time.monotonic()
    codes = group.stop()
    assert codes["stubborn"] == -signal.SIGKILL and time.monotonic() - t0 < 5


def test_service_group_startup_timeout():
    (port,) = free_ports(1)
    with ServiceGroup([Service("sleepy", [sys.executable, "-c", "import time; time.sleep(60)"], f"127.0.0.1:{port}")], grace=2) as g:
        with pytest.raises(TimeoutError, match="sleepy"):
            g.wait_healthy(timeout=1.5)


def test_dflash_services_command_lines():
    svcs = dflash_services("m.gguf", "d.gguf", ports=(1, 2, 3), device="cpu", log_level="info", extra=["--x"],
                           orchestrator_args=["--y"])  # fmt: skip
    assert [s.name for s in svcs] == ["target", "draft", "orchestrator"]
    t, d, o = (s.argv[1:] for s in svcs)
    host = ["--host", "127.0.0.1"]
    assert t == ["-m", "target_service", "--model", "m.gguf", "--port", "1", "--device", "cpu", *host, "--x"]
    assert d == ["-m", "draft_service", "--drafter", "d.gguf", "--target", "m.gguf", "--port", "2", "--device", "cpu",
                 *host, "--x"]  # fmt: skip
    assert o == ["-m", "orchestrator", "--target", "127.0.0.1:1", "--draft", "127.0.0.1:2", "--model", "m.gguf",
                 "--port", "3", *host, "--x", "--y"]  # fmt: skip
    assert svcs[2].address == "127.0.0.1:3" and svcs[0].env == {"DFLASH_LOG_LEVEL": "INFO"}
    svcs = dflash_services("m.gguf", None, ports=(1, 2, 3))
    assert [s.name for s in svcs] == ["target", "orchestrator"] and "--draft" not in svcs[1].argv
    assert svcs[0].env == {}


def test_dflash_services_taps_the_drafters_layers_and_colocates(tiny_drafter):
    """The target starts with the drafter's feature layers (its graphs captured for them at start),
    unless --feature-layers is given; --colocate runs the target inside the orchestrator."""
    from draft_service.gguf_io import read_drafter_config

    ids = ",".join(map(str, read_drafter_config(tiny_drafter).target_layer_ids))
    t = dflash_services("m.gguf", tiny_drafter, ports=(1, 2, 3))[0].argv
    assert t[t.index("--feature-layers") + 1] == ids
    t = dflash_services("m.gguf", tiny_drafter, ports=(1, 2, 3), target_args=["--feature-layers", "0"])[0].argv
    assert t.count("--feature-layers") == 1 and t[t.index("--feature-layers") + 1] == "0"
    svcs = dflash_services("m.gguf", tiny_drafter, ports=(1, 2, 3), device="cpu", target_args=["--max-sessions", "2"],
                           colocate=True)
    assert [s.name for s in svcs] == ["draft", "orchestrator"]
    o = svcs[1].argv
    assert o[o.index("--target") + 1] == "in-process"
    assert f"--target-args=--model m.gguf --device cpu --feature-layers {ids} --max-sessions 2" in o


def _fake_mps_control(tmp_path, rc: int = 0):
    """A stand-in ``nvidia-cuda-mps-control`` on ``PATH``: appends its argv, its MPS pipe
    directory and its stdin to a log and exits ``rc``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "mps.log"
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(f"#!/bin/sh\nprintf '%s|%s|' \"$*\" \"$CUDA_MPS_PIPE_DIRECTORY\" >> {log}\n"
                   f"if [ -z \"$1\" ]; then cat >> {log}; else echo >> {log}; fi\nexit {rc}\n")
    exe.chmod(0o755)
    return bindir, log


def test_private_mps_starts_and_quits_a_daemon_of_its_own(tmp_path, monkeypatch):
    """private_mps runs ``nvidia-cuda-mps-control -d`` with a fresh private pipe directory, yields
    that environment for the services (and dflash_services gives it to every child), and sends
    ``quit`` to the same daemon at the end, removing the directory."""
    from client.launcher import private_mps

    bindir, log = _fake_mps_control(tmp_path)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    with private_mps() as env:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.isdir(pipe) and os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
        assert (os.stat(pipe).st_mode & 0o077) == 0
        assert log.read_text().splitlines() == [f"-d|{pipe}|"]
        svcs = dflash_services("m.gguf", "d.gguf", ports=(1, 2, 3), log_level="info", env=env)
        assert all(s.env == {**env, "DFLASH_LOG_LEVEL": "INFO"} for s in svcs)
    assert log.read_text().splitlines() == [f"-d|{pipe}|", f"|{pipe}|quit"]
    assert not os.path.exists(os.path.dirname(pipe))


def test_mps_flag_fails_clearly_where_mps_cannot_start(tmp_path, monkeypatch):
    """--mps without the control program, or with one that fails, is a clear error before any
    service starts; the library call raises MpsUnavailable."""
    from client.launcher import MpsUnavailable, private_mps

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(MpsUnavailable, match="not on PATH"):
        with private_mps():
            pass
    import argparse

    from client.cli import CommandError, _services_env

    with pytest.raises(CommandError, match="--mps: nvidia-cuda-mps-control is not on PATH"):
        with _services_env(argparse.Namespace(mps=True)):
            pass
    with _services_env(argparse.Namespace(mps=False)) as env:
        assert env == {}
    bindir, _ = _fake_mps_control(tmp_path, rc=3)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    with pytest.raises(MpsUnavailable, match="exited with 3"):
        with private_mps():
            pass


# --------------------------------------------------------------------------------------------
# serve / demo with stand-in services

FAKE_ORCHESTRATOR = MINI_SERVER + textwrap.dedent(
    """
    from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc

    class Fake(generation_pb2_grpc.GenerationServiceServicer):
        def Generate(self, request, context):
            spec = not request.speculative.HasField("enabled") or request.speculative.enabled
            yield generation_pb2.GenerateResponse(text="    return True", token_ids=[1, 2], prompt_tokens=5)
            stats = generation_pb2.AcceptanceStats(generated_tokens=2, mean_acceptance_length=2.0 if spec else 1.0,
                                                   tokens_per_second=50.0 if spec else 20.0)
            yield generation_pb2.GenerateResponse(finished=True, finish_reason=2, stats=stats)

    serve("orchestrator", sys.argv[1], lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(Fake(), s))
    """
)


def _stand_ins(monkeypatch, services):
    import client.cli as cli

    monkeypatch.setattr(cli, "_model_paths", lambda args: ("m.gguf", None if args.no_draft else "d.gguf"))
    monkeypatch.setattr(cli, "dflash_services", lambda model, drafter, **kw: services)


def test_cli_demo(monkeypatch, capsys):
    (port,) = free_ports(1)
    orch = Service("orchestrator", [sys.executable, "-c", FAKE_ORCHESTRATOR, str(port)], f"127.0.0.1:{port}")
    _stand_ins(monkeypatch, _dummies(1) + [orch])
    assert main(["demo", "--problem", "HumanEval/0", "--compare-ar", "--max-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("from typing import List") and out.endswith("    return True\n")
    assert "tau (mean acceptance length): 2.000" in err
    assert "speedup:        2.50x" in err and "token ids identical: yes" in err


def test_cli_serve_no_restart_stops_when_a_service_dies(monkeypatch, capsys):
    services = _dummies(2)
    _stand_ins(monkeypatch, services)
    groups = []
    real_wait = ServiceGroup.wait_healthy

    def wait_then_kill(self, *a, **kw):  # once all are healthy, kill one behind serve's back
        real_wait(self, *a, **kw)
        groups.append(self)
        threading.Timer(0.5, os.kill, (self.procs["svc1"].pid, signal.SIGKILL)).start()

    monkeypatch.setattr(ServiceGroup, "wait_healthy", wait_then_kill)
    assert main(["serve", "--grace", "5", "--no-restart"]) == 1
    out, err = capsys.readouterr()
    assert "svc0" in out and "svc1" in out and "ready:" in out
    assert "error: service 'svc1' was killed by signal 9" in err
    assert all(p.poll() is not None for p in groups[0].procs.values())
