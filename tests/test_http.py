"""The OpenAI-compatible HTTP front door (orchestrator/http.py; docs/ARCHITECTURE.md, "HTTP front
door") against the three services as real processes on the CPU (the tiny llama target and a random
drafter: start-up in seconds), talked to with the official ``openai`` package (sync, async,
streaming, chat and completions, errors) and raw ``httpx``; the text equals the gRPC API's for the
same request; a client that goes away frees its slot; and every metric name the Grafana dashboard
(docs/grafana/dflash.json) queries is exported by a live ``/metrics``.

The services start once for the module (the expensive part); requests are short.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import client as sdk
from client.launcher import ServiceGroup, dflash_services, free_ports

openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key-" + "k" * 24
MAX_REQUEST_BYTES = 100_000
#: the HTTP body limit that follows (orchestrator.http.BODY_BYTES_PER_REQUEST_BYTE)
MAX_BODY = 3 * MAX_REQUEST_BYTES


@pytest.fixture(scope="module")
def svc(tiny_llama, tiny_drafter, tmp_path_factory):
    """The three services with the orchestrator's HTTP port (an API key from an owner-only file)
    and every service's metrics port. Yields a dict of addresses and ports."""
    d = tmp_path_factory.mktemp("http")
    key_file = d / "api-key"
    key_file.write_text(API_KEY)
    key_file.chmod(0o600)
    target, draft, orch, http, m_orch, m_target, m_draft = free_ports(7)
    services = dflash_services(
        tiny_llama.path, tiny_drafter, ports=(target, draft, orch), http_port=http,
        target_args=["--max-sessions", "2", "--max-context", "1024", "--metrics-port", str(m_target)],
        draft_args=["--metrics-port", str(m_draft)],
        orchestrator_args=["--metrics-port", str(m_orch), "--max-queue", "2", "--max-request-bytes", str(MAX_REQUEST_BYTES),
                           "--api-key-file", str(key_file)],
    )
    with ServiceGroup(services, grace=5.0) as group:
        group.wait_healthy(timeout=120)
        yield {"grpc": f"127.0.0.1:{orch}", "base": f"http://127.0.0.1:{http}", "http_port": http,
               "metrics": {"orchestrator": m_orch, "target": m_target, "draft": m_draft}}


@pytest.fixture(scope="module")
def oa(svc, api):
    """A sync ``openai.OpenAI`` client of the front door (no retries: errors show at once)."""
    with openai.OpenAI(base_url=svc["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def api(svc):
    """The gRPC SDK client of the same orchestrator, once it reaches the drafter (the
    orchestrator probes it in the background: until then requests decode plainly)."""
    with sdk.Client(svc["grpc"], timeout=60) as c:
        deadline = time.monotonic() + 30
        while not c.info().drafter.available:
            assert time.monotonic() < deadline, "the orchestrator never reached the draft service"
            time.sleep(0.1)
        yield c


@pytest.fixture(scope="module")
def model(oa):
    return oa.models.list().data[0].id


def _scheduler(api):
    s = api.info().scheduler
    return s.active_sessions, s.queued_requests


def _wait_idle(api, timeout: float = 20.0) -> None:
    """Until the scheduler holds no session and queues nothing (the slots are free)."""
    deadline = time.monotonic() + timeout
    while _scheduler(api) != (0, 0):
        assert time.monotonic() < deadline, f"slots still held: {_scheduler(api)}"
        time.sleep(0.05)


def test_models_health_and_auth(svc, oa, model):
    assert model == "tiny-llama"
    assert httpx.get(svc["base"] + "/health").json()["status"] == "ok"
    bad = openai.OpenAI(base_url=svc["base"] + "/v1", api_key="wrong-key-" + "x" * 20, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.post(svc["base"] + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completion_streamed_equals_grpc_and_whole(oa, api, model):
    """T=0: the streamed text, the whole response's and the gRPC API's are the same; the final
    chunk carries finish_reason and the dflash statistics, the usage chunk the token counts."""
    prompt = "The quick brown fox"
    ref = api.generate(prompt, max_tokens=12, ignore_eos=True)
    chunks = list(oa.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert final.choices[0].finish_reason == "length"
    stats = final.model_extra["dflash"]
    assert stats["target_forwards"] >= 1 and stats["tau"] >= 1.0
    assert stats["drafts"] > 0 and len(stats["drafted_per_position"]) >= 1   # the drafter was used
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    whole = oa.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == ref.text and whole.usage.total_tokens == ref.prompt_tokens + 12
    assert whole.choices[0].finish_reason == "length" and whole.model_extra["dflash"]["tau"] >= 1.0


def test_chat_streamed_equals_grpc(oa, api, model):
    """Chat uses the model's chat template (the gRPC chat input); stop strings and seeds pass."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    ref = api.generate(messages=messages, max_tokens=10, ignore_eos=True)
    stream = oa.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length" and "dflash" in chunks[-1].model_extra
    sampled = [oa.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.8, seed=7,
                                          top_p=0.9, extra_body={"top_k": 20}).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]   # seeded: reproducible
    if len(ref.text) > 2:   # a stop string cuts the text before it
        stop = ref.text[2:4] if ref.text[2:4].strip() else ref.text[2:3]
        cut = oa.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
        assert ref.text.startswith(cut.choices[0].message.content)


def test_async_client_concurrent(svc, api, model):
    """The async client, two requests at once (batched by the scheduler), each equal to gRPC's."""
    prompts = ["Hello, world!", "def add(a, b):"]
    refs = [api.generate(p, max_tokens=8, ignore_eos=True, speculative=False).text for p in prompts]

    async def main():
        async with openai.AsyncOpenAI(base_url=svc["base"] + "/v1", api_key=API_KEY, max_retries=0) as c:
            async def one(p):
                s = await c.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
                return "".join([ch.choices[0].text async for ch in s])
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == refs


def test_errors_in_openai_shape(svc, oa, model):
    with pytest.raises(openai.NotFoundError) as e:
        oa.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    cases = [  # (body, param or None, code or None)
        ({"prompt": "x", "n": 2}, "n", None),
        ({"prompt": "x", "logprobs": 2}, "logprobs", None),
        ({"prompt": "x", "temperature": -1}, None, "INVALID_SAMPLING"),
        ({"prompt": "x", "stop": 5}, "stop", None),
        ({"prompt": ["a", "b"]}, "prompt", None),
        ({"prompt": [1, 2, 100000]}, None, "INVALID_TOKEN"),
        ({"prompt": "x", "dflash": {"tree_budget": 99999}}, None, "INVALID_ARGUMENT"),
    ]
    for body, param, code in cases:
        r = httpx.post(svc["base"] + "/v1/completions", json={"model": model, "max_tokens": 1, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param), (body, err)
        assert code is None or err["code"] == code, (body, err)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert e.value.status_code == 400
    # more tokens than the context (1024): 400; more characters than --max-prompt-chars: 413
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=model, prompt="The quick brown fox. " * 300, max_tokens=1)
    assert e.value.body["code"] == "PROMPT_TOO_LONG" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "The quick brown fox. " * 300}],
                                   max_tokens=1)
    assert e.value.body["code"] == "PROMPT_TOO_LONG" and e.value.body["param"] == "messages"
    with pytest.raises(openai.APIStatusError) as e:
        oa.completions.create(model=model, prompt="x" * (MAX_REQUEST_BYTES + 10), max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "PROMPT_TOO_LONG"


def test_oversized_body_refused_before_it_is_read(svc):
    """A Content-Length past the body limit is answered 413 at once, with the body not sent."""
    with socket.create_connection(("127.0.0.1", svc["http_port"]), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                  b"Content-Length: " + str(MAX_BODY + 1).encode() + b"\r\n\r\n{\"prompt\": \"")
        data = b""
        while b"}}" not in data and (more := s.recv(4096)):
            data += more
    head, _, raw = data.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    body = json.loads(raw)
    assert body["error"]["code"] == "PROMPT_TOO_LONG"
    # chunked, no length: refused once the bytes read pass the limit
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"x" * 65536
    r = httpx.post(svc["base"] + "/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413


def _raw_post(port: int, body: dict) -> socket.socket:
    """POST ``body`` to /v1/completions on a raw socket, not reading the answer: closing the
    socket (on this thread) is a client going away."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(data)).encode()
              + b"\r\n\r\n" + data)
    return s


def test_queue_full_429_and_disconnect_frees_slots(svc, api, model):
    """Two streams decoding (the target's 2 slots), two queued (--max-queue 2, one streaming, one
    not): one more is 429 with Retry-After. Clients that go away (streaming, and queued before any
    output) cancel their requests: the scheduler soon holds no session and queues nothing, where
    each request would otherwise decode for 10 s or more."""
    _wait_idle(api)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    clients = [httpx.Client(base_url=svc["base"], headers=headers, timeout=60) for _ in range(2)]
    queued = []
    try:
        # the streams and their line iterators are kept: dropping one closes (disconnects) it
        opened = [c.stream("POST", "/v1/completions", json=body) for c in clients]
        lines = [cm.__enter__().iter_lines() for cm in opened]
        for it in lines:   # decoding: their first chunk came
            assert next(it).startswith("data: {")
        queued = [_raw_post(svc["http_port"], {**body, "stream": stream}) for stream in (True, False)]
        deadline = time.monotonic() + 10
        while _scheduler(api) != (2, 2):
            assert time.monotonic() < deadline, _scheduler(api)
            time.sleep(0.02)
        r = httpx.post(svc["base"] + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "QUEUE_FULL"
    finally:
        for s in queued:
            s.close()
        for c in clients:   # closing mid-stream disconnects
            c.close()
    _wait_idle(api, timeout=5.0)


def test_metrics_and_health_endpoints(svc):
    text = httpx.get(svc["base"] + "/metrics").text
    names = {m.name for m in text_string_to_metric_families(text)}
    assert "dflash_requests" in names and "dflash_spec_decode_num_drafts" in names


# ------------------------------------------------------------------------------ dashboard


def dashboard_queries(path: str) -> list[str]:
    """Every PromQL expression of a Grafana dashboard JSON (panels, rows' panels)."""
    with open(path, encoding="utf-8") as f:
        board = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(board["panels"])
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (ours all start with ``dflash_``); label
    matchers and strings are dropped first."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return set(re.findall(r"\bdflash_[a-zA-Z0-9_:]*", expr))


def test_dashboard_queries_use_exported_metric_names(svc):
    """Every name in every panel query of docs/grafana/dflash.json is a series of a live
    ``/metrics`` of the three services (parsed with prometheus_client's parser)."""
    samples, families = set(), set()
    for service, port in svc["metrics"].items():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            families.add(fam.name)
            samples.update(s.name for s in fam.samples)
    queries = dashboard_queries(os.path.join(ROOT, "docs", "grafana", "dflash.json"))
    assert len(queries) >= 10
    used = set().union(*(metric_names(q) for q in queries))
    suffix = re.compile(r"_(total|bucket|sum|count)$")
    # a labelled series with no child yet (e.g. fallbacks by reason) has its family but no sample
    missing = sorted(n for n in used if n not in samples and suffix.sub("", n) not in families)
    assert not missing, f"dashboard queries use names no service exports: {missing}"
    assert {"dflash_spec_decode_num_accepted_tokens_per_pos_total", "dflash_queue_depth",
            "dflash_engine_busy_seconds_total"} <= used
