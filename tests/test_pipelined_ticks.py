"""Two groups in flight (docs/ARCHITECTURE.md, "Two groups in flight"): from ``pipeline_from``
requests the scheduler splits the batch into two groups whose ticks alternate, one group's Verify
in flight (sent from the verify thread) while the other group's Propose runs.

The target and the draft service run in this process on the tiny model (reference engines), the
orchestrator too (``Scheduler`` behind a real gRPC server). Concurrent streams decode with the
two groups and must give exactly what target-only decoding gives: greedy, and seeded sampling
(each item is verified against its own session, so the grouping cannot change a token). The
groups really alternate (``Scheduler.pipelined_ticks``), every slot is free afterwards, and a
request cancelled while its group's Verify may be in flight leaves nothing behind.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from dflash_grpc.transport import GRPC_OPTIONS
from dflash_grpc.v1 import draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

SESSIONS = 8
CONTEXT = 256
TOKENS = 20


@pytest.fixture(scope="module")
def stack(tiny_llama, tiny_drafter):
    """``(Generation stub, scheduler, target stub, draft stub)``; two groups from 2 requests."""
    with target_in_process(tiny_llama.path, max_sessions=SESSIONS, max_context=CONTEXT, max_workers=8,
                           name="pipe-target") as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=SESSIONS, max_context=CONTEXT,
                             max_workers=8) as (_dservicer, dport):
        with orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=SESSIONS, max_tokens=TOKENS,
                                     step_timeout=30.0, pipeline_from=2, max_workers=SESSIONS + 8) as (servicer, oport), \
                grpc.insecure_channel(f"127.0.0.1:{oport}", options=GRPC_OPTIONS) as och, \
                grpc.insecure_channel(f"127.0.0.1:{tport}", options=GRPC_OPTIONS) as tch, \
                grpc.insecure_channel(f"127.0.0.1:{dport}", options=GRPC_OPTIONS) as dch:
            yield (generation_pb2_grpc.GenerationServiceStub(och), servicer.scheduler,
                   target_pb2_grpc.TargetServiceStub(tch), draft_pb2_grpc.DraftServiceStub(dch))


def _request(prompt: list[int], speculative: bool, temperature: float = 0.0, seed: int = 0,
             max_tokens: int = TOKENS) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=prompt), max_tokens=max_tokens,
                                         ignore_eos=True)
    req.speculative.enabled = speculative
    if temperature:
        req.sampling.temperature = temperature
        req.sampling.seed = seed
    return req


def _tokens(stub, req) -> tuple[list[int], int]:
    """A whole Generate: its tokens and the drafted steps of its stats."""
    msgs = list(stub.Generate(req, timeout=60))
    return [t for m in msgs for t in m.token_ids], msgs[-1].stats.drafts


def _concurrently(fn, args: list) -> list:
    out: list = [None] * len(args)
    errors: list[BaseException] = []

    def run(i):
        try:
            out[i] = fn(*args[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def _idle(sched, target, draft) -> None:
    deadline = time.monotonic() + 30
    while True:
        s = sched.status()
        free_t = target.Info(target_pb2.TargetInfoRequest(), timeout=10).free_slots
        free_d = draft.Info(draft_pb2.DrafterInfoRequest(), timeout=10).model.free_slots
        if (s.active_sessions == 0 and not sched._flight and not any(sched._releasing.values())  # noqa: SLF001
                and free_t == SESSIONS and free_d == SESSIONS):
            return
        assert time.monotonic() < deadline, (s, free_t, free_d)
        time.sleep(0.02)


PROMPTS = [[7, 42, 9, 100, 250], [3, 5, 8, 13, 21, 34], [11, 12], [200, 17, 4, 4, 90, 91, 92], [55, 66, 77],
           [101, 102, 103, 104], [9, 8, 7, 6, 5, 4, 3], [250, 1, 250]]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_two_groups_decode_what_the_target_alone_decodes(stack, temperature):
    stub, sched, target, draft = stack
    before = sched.pipelined_ticks
    want = _concurrently(lambda p, s: _tokens(stub, _request(p, False, temperature, s))[0],
                         [(p, 17 + i) for i, p in enumerate(PROMPTS)])
    got = _concurrently(lambda p, s: _tokens(stub, _request(p, True, temperature, s)),
                        [(p, 17 + i) for i, p in enumerate(PROMPTS)])
    for prompt, w, (g, drafts) in zip(PROMPTS, want, got):
        assert len(w) == TOKENS and g == w, (prompt, g, w)
    assert sum(d for _, d in got) > 0            # they drafted
    assert sched.pipelined_ticks - before > 10   # in two alternating groups
    _idle(sched, target, draft)


def test_cancel_while_in_flight_leaves_nothing_behind(stack):
    stub, sched, target, draft = stack
    want = _tokens(stub, _request(PROMPTS[0], False, max_tokens=TOKENS))[0]

    def cancelled(prompt, k):
        call = stub.Generate(_request(prompt, True, max_tokens=TOKENS), timeout=60)
        n = 0
        try:
            for m in call:
                n += 1
                if n == k:
                    call.cancel()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED
        return n

    def whole(prompt, _k):
        return _tokens(stub, _request(prompt, True, max_tokens=TOKENS))[0]

    before = sched.pipelined_ticks
    out = _concurrently(lambda f, p, k: f(p, k),
                        [(cancelled if i % 2 else whole, PROMPTS[0] if i % 2 == 0 else p, 1 + i % 3)
                         for i, p in enumerate(PROMPTS)])
    for i, o in enumerate(out):
        if i % 2 == 0:
            assert o == want
    assert sched.pipelined_ticks > before
    _idle(sched, target, draft)
