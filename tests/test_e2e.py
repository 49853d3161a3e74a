"""End to end: the three services as real processes on loopback, talked to over gRPC.

Covers the lossless checks of the end-to-end issue (speculative output == target-only output ==
transformers greedy decoding of the same GGUF), seeded sampling, the statuses of docs/ARCHITECTURE.md,
"Errors" that the public API can produce (each followed by a correct request), a drafter built
for another target (FAILED_PRECONDITION), and the draft service dying mid-request (fallback).
The module's tests run in file order; the last ones stop services on purpose.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
import torch

import client as sdk
from client.launcher import ServiceGroup, dflash_services, free_ports
from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.conftest import PROMPTS, module_service

pytestmark = pytest.mark.slow

#: Tokens of each lossless greedy request (also the tree tests' and the draft service's death's
#: reference): several draft rounds per request with the trained drafter (block 16).
N_TOKENS = 16
#: Prompts of the lossless greedy test: code, prose, code with a blank line and the chat
#: template's special tokens (also the tree tests' prompts, 2 per tree shape; tests/test_serving.py
#: checks every prompt of ``PROMPTS`` under load).
LOSSLESS_PROMPTS = [PROMPTS[i] for i in (0, 1, 3, 19)]


@pytest.fixture(scope="module")
def drafter_path(smollm_path):
    """The shipped, trained drafter of the default model (draft_service/data/)."""
    from draft_service import default_drafter_path, shipped_drafter
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import open_gguf

    path = default_drafter_path(smollm_path)
    assert path == shipped_drafter(model_fingerprint(open_gguf(smollm_path))), "no trained drafter shipped"
    return path


@pytest.fixture(scope="module")
def services(smollm_path, drafter_path, request):
    ports = free_ports(3)
    group = ServiceGroup(
        dflash_services(smollm_path, drafter_path, ports=ports, target_args=["--max-sessions", "3", "--max-context", "1024"]),
        grace=5.0,
    )
    with group:
        # meanwhile transformers' model (the lossless test's oracle) loads in this process: later,
        # beside the requests, it would slow the draft service and the orchestrator
        try:
            request.getfixturevalue("hf_smollm")
        except pytest.skip.Exception:   # no transformers: the lossless test skips itself, not the others
            pass
        group.wait_healthy(timeout=300)
        yield group, {"target": f"127.0.0.1:{ports[0]}", "draft": f"127.0.0.1:{ports[1]}", "orchestrator": f"127.0.0.1:{ports[2]}"}


@pytest.fixture(scope="module")
def api(services):
    with sdk.Client(services[1]["orchestrator"], timeout=300) as c:
        yield c


def _hf_greedy_mismatch(hf, ids: list[int], out: list[int]) -> int | None:
    """Whether ``out`` is transformers' greedy continuation of ``ids`` (EOS ignored), from one
    teacher-forced forward of ``ids + out``: greedy decoding emits ``out`` iff the argmax after
    ``ids + out[:i]`` is ``out[i]`` for every ``i`` (by induction on ``i``). Returns the first ``i``
    where it is not, or None."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1 : len(ids) + len(out) - 1]
    bad = (logits.argmax(-1) != torch.tensor(out)).nonzero()
    return int(bad[0]) if bad.numel() else None


def test_info_reports_both_services(api):
    info = api.info()
    assert info.target.architecture == "llama"
    assert info.target.vocab_size == 49152
    # the weights as the CPU target holds them: the Q4_1 file (98 MB) dequantized to float32
    assert 400 << 20 < info.target.weight_bytes < 700 << 20, info.target.weight_bytes
    assert f"weights {info.target.weight_bytes / 2**20:.0f} MiB" in info.target.format()
    assert info.drafter.available and info.drafter.compatible
    assert info.drafter.model.block_size == 16


@pytest.fixture(scope="module")
def greedy(api, smollm_tokenizer):
    """``{prompt: (speculative, target-only)}`` results of ``LOSSLESS_PROMPTS``, ``N_TOKENS`` each,
    greedy, every request at once: the orchestrator batches and queues them (3 target slots) with
    speculative and target-only requests mixed, and a request's tokens must not depend on what else
    is in its batch. The target-only results are also the references of the tree tests and of
    the draft service's death."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        calls = {}
        for text in LOSSLESS_PROMPTS:
            ids = smollm_tokenizer.encode(text)
            calls[text] = (pool.submit(api.generate, tokens=ids, max_tokens=N_TOKENS, ignore_eos=True),
                           pool.submit(api.generate, tokens=ids, max_tokens=N_TOKENS, ignore_eos=True, speculative=False))
        return {text: (spec.result(), ar.result()) for text, (spec, ar) in calls.items()}


def test_lossless_greedy_against_target_only_and_transformers(greedy, smollm_tokenizer, hf_smollm):
    mismatches = []
    drafted = accepted = 0
    for text in LOSSLESS_PROMPTS:
        spec, ar = greedy[text]
        assert len(spec.token_ids) == N_TOKENS and spec.finish_reason == "length"
        assert spec.token_ids == ar.token_ids, f"speculative != target-only for {text!r}"
        assert ar.stats.drafts == 0 and ar.stats.autoregressive_steps == N_TOKENS - 1
        drafted += spec.stats.drafts
        accepted += spec.stats.accepted_tokens
        at = _hf_greedy_mismatch(hf_smollm, smollm_tokenizer.encode(text), ar.token_ids)
        if at is not None:
            mismatches.append((text, at))
        assert spec.text == smollm_tokenizer.decode(spec.token_ids)
    assert not mismatches, f"differs from transformers greedy (prompt, first token): {mismatches}"
    assert drafted > 0, "the drafter was never used"
    assert accepted > 0, "the trained drafter should have tokens accepted (commit paths exercised)"


@pytest.mark.parametrize("budget,top_k,prompts", [pytest.param(24, 4, slice(0, 2), id="24-4"),
                                                   pytest.param(8, 2, slice(2, 4), id="8-2")])
def test_lossless_with_trees(api, smollm_tokenizer, greedy, budget, top_k, prompts):
    """DDTree proposals (not chains) through the three services equal target-only decoding (two
    tree shapes, two prompts each)."""
    for text in LOSSLESS_PROMPTS[prompts]:
        ids = smollm_tokenizer.encode(text)
        tree = api.generate(tokens=ids, max_tokens=N_TOKENS, ignore_eos=True, tree_budget=budget, top_k_draft=top_k)
        assert tree.token_ids == greedy[text][1].token_ids  # target-only
        s = tree.stats
        assert s.drafts > 0 and s.draft_tokens <= s.drafts * budget
        # branching: more nodes than (drafts x depths reached), i.e. some depth held siblings
        assert s.draft_tokens > sum(s.drafted_per_position)
        assert len(s.drafted_per_position) <= 15


def test_seeded_sampling_reproduces_and_matches_target_only(api):
    kw = dict(prompt="Once upon a time", max_tokens=8, temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)
    a = api.generate(seed=1234, **kw)
    b = api.generate(seed=1234, **kw)
    c = api.generate(seed=1234, speculative=False, **kw)
    d = api.generate(seed=99, **kw)
    assert a.token_ids == b.token_ids == c.token_ids
    assert d.token_ids != a.token_ids


def test_stop_strings_and_eos(api):
    res = api.generate(prompt="def add(a, b):\n", max_tokens=40, stop=["\n"], ignore_eos=True)
    assert res.finish_reason in ("stop", "length")
    assert "\n" not in res.text
    chat = api.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=200)
    assert chat.finish_reason in ("eos", "length")
    assert 2 not in chat.token_ids  # <|im_end|> is EOS and never emitted


def test_statistics(api):
    before = api.stats()
    res = api.generate(prompt="for i in range(10):", max_tokens=20, ignore_eos=True)
    s = res.stats
    assert s.generated_tokens == 20 and s.requests == 1
    assert s.target_forwards == sum(s.acceptance_length_histogram)
    assert s.accepted_tokens == sum(s.accepted_per_position)
    assert s.draft_tokens >= s.accepted_tokens
    assert abs(s.mean_acceptance_length - sum(t * c for t, c in enumerate(s.acceptance_length_histogram)) / s.target_forwards) < 1e-9
    after = api.stats()
    assert after.requests == before.requests + 1
    assert after.generated_tokens == before.generated_tokens + 20


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(prompt=""), sdk.InvalidArgumentError),
        (dict(tokens=[1, 2, 49152]), sdk.InvalidArgumentError),
        (dict(tokens=[-1]), sdk.InvalidArgumentError),
        (dict(prompt="hi", temperature=-1.0), sdk.InvalidArgumentError),
        (dict(prompt="hi", top_p=2.0), sdk.InvalidArgumentError),
        (dict(prompt="hi", max_tokens=-5), sdk.InvalidArgumentError),
        (dict(tokens=[1] * 1100), sdk.ResourceExhaustedError),
    ],
)
def test_bad_requests_get_clear_status_and_service_goes_on(api, kwargs, error):
    with pytest.raises(error):
        api.generate(**kwargs)
    ok = api.generate(prompt="The capital of France is", max_tokens=2, ignore_eos=True)
    assert len(ok.token_ids) == 2


def test_target_statuses_directly(services):
    """NOT_FOUND for an unknown session, INVALID_ARGUMENT for a malformed tree (per item)."""
    with serving.channel(services[1]["target"]) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        reqs = [
            target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(session_id="nope", tree=common_pb2.TokenTree(tokens=[1], parents=[-1]))]),
        ]
        (resp,) = list(stub.Verify(iter(reqs), timeout=30))
        assert resp.results[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(session_id="s", prompt_tokens=[])]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(session_id="s", prompt_tokens=[1, 2, 3])]), timeout=30).results[0]
        bad = target_pb2.VerifyItem(session_id="s", tree=common_pb2.TokenTree(tokens=[first.first_token, 7], parents=[-1, 5]))
        good = target_pb2.VerifyItem(session_id="s", tree=common_pb2.TokenTree(tokens=[first.first_token], parents=[-1]))
        r_bad, r_good = list(stub.Verify(iter([target_pb2.VerifyRequest(items=[bad]), target_pb2.VerifyRequest(items=[good])]), timeout=30))
        assert r_bad.results[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert r_good.results[0].status.code == 0 and r_good.results[0].committed_length == 4
        stub.Release(common_pb2.ReleaseRequest(session_ids=["s"]), timeout=30)


def test_deadline_and_cancel_free_the_slot(api, services):
    """The target has 3 slots: more cancelled/expired requests than that must not leak any."""
    for _ in range(4):
        with pytest.raises(sdk.DeadlineExceededError):
            api.generate(prompt="Write a long story about dragons.", max_tokens=400, ignore_eos=True, timeout=0.8)
    for _ in range(4):
        stream = api.stream(prompt="Count to one hundred:", max_tokens=400, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
    time.sleep(1.0)
    res = api.generate(prompt="The capital of France is", max_tokens=5, ignore_eos=True)
    assert len(res.token_ids) == 5


def test_no_free_slot_waits_in_the_queue(services, smollm_path):
    """Slots held by another client: a request waits in the queue (no error) and runs once they free."""
    import threading

    with serving.channel(services[1]["target"]) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        ids = [f"hog{i}" for i in range(3)]
        for sid in ids:
            stub.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(session_id=sid, prompt_tokens=[1, 2])]), timeout=30)
        out = {}
        with sdk.Client(services[1]["orchestrator"], timeout=120) as c:
            t = threading.Thread(target=lambda: out.setdefault("r", c.generate(prompt="hello", max_tokens=3, ignore_eos=True)))
            t.start()
            time.sleep(1.5)
            assert "r" not in out, "ran although every target slot was held"
            stub.Release(common_pb2.ReleaseRequest(session_ids=ids), timeout=30)
            t.join(60)
        assert len(out["r"].token_ids) == 3


def test_mismatched_drafter_is_failed_precondition(services, smollm_path, tmp_path, tiny_llama_factory):
    """A drafter built for another target: the orchestrator refuses speculative requests."""
    from draft_service.init_random import write_random_drafter

    tiny = str(tiny_llama_factory().path)
    other = str(tmp_path / "other-drafter.gguf")
    write_random_drafter(tiny, other, layers=1)
    dport, oport = free_ports(2)
    group = ServiceGroup(
        [
            module_service("draft", "draft_service", dport, "--drafter", other, "--target", tiny),
            module_service("orchestrator", "orchestrator", oport, "--target", services[1]["target"], "--draft", f"127.0.0.1:{dport}",
                           "--model", smollm_path),
        ],
        grace=5.0,
    )
    with group:
        group.wait_healthy(timeout=180)
        with sdk.Client(f"127.0.0.1:{oport}", timeout=60) as c:
            # the orchestrator may be up before the draft service (it probes it with a backoff):
            # until the drafter is reached, a speculative request decodes plainly
            deadline = time.monotonic() + 60
            while not (info := c.info()).drafter.available and time.monotonic() < deadline:
                time.sleep(0.25)
            assert info.drafter.available and not info.drafter.compatible
            with pytest.raises(sdk.FailedPreconditionError):
                c.generate(prompt="hello", max_tokens=4)
            assert len(c.generate(prompt="hello", max_tokens=4, ignore_eos=True, speculative=False).token_ids) == 4


def test_draft_service_dies_mid_request(api, services, smollm_tokenizer, greedy):
    """Kill the draft service during a request: no error, no token lost, same output as target-only."""
    group, _ = services
    text = LOSSLESS_PROMPTS[0]
    ids = smollm_tokenizer.encode(text)
    ref = greedy[text][1].token_ids   # target-only, N_TOKENS
    stream = api.stream(tokens=ids, max_tokens=N_TOKENS, ignore_eos=True)
    chunks = iter(stream)
    got = list(next(chunks).token_ids)
    os.killpg(group.procs["draft"].pid, 9)
    for chunk in chunks:
        got += chunk.token_ids
    assert got == ref
    assert stream.result.stats.draft_fallbacks == 1
    after = api.generate(tokens=ids, max_tokens=8, ignore_eos=True)  # drafter gone: plain AR
    assert after.token_ids == ref[:8]
    assert after.stats.drafts == 0


def test_target_down_is_unavailable(api, services):
    group, _ = services
    os.killpg(group.procs["target"].pid, 9)
    group.procs["target"].wait()
    with pytest.raises(sdk.UnavailableError):
        api.generate(prompt="hello", max_tokens=3)
