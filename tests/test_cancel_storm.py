"""A cancel storm through the real scheduler (issue 22): 1,000 Generate requests, most of them
cancelled or expired at random phases, then nothing may be left behind.

The target and the draft service run in this process on a tiny model (reference engines, context
64; the drafter has fewer slots than the orchestrator's sessions); the orchestrator too
(``GenerationServicer`` and its ``Scheduler`` behind a real gRPC server), with fewer sessions than
clients and a short queue, so the queue is used and is sometimes full (QUEUE_FULL: the client
retries the same plan). :data:`CLIENTS` client threads send :data:`REQUESTS` requests (a few tokens
each, greedy, ``ignore_eos``; speculative or not), each with a plan drawn from a seeded RNG:

* ``complete``: read to the end;
* ``cancel_now``: cancel right after the call starts (the request is queued, or not yet admitted);
* ``cancel_after_delay``: cancel after a random delay of up to 120 ms (queued, prefilling or
  decoding, whichever it is by then);
* ``cancel_after_k``: cancel after ``k`` streamed messages (decoding);
* ``deadline``: a deadline of 1-400 ms (expires wherever the request is).

Every call ends OK, CANCELLED, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED / QUEUE_FULL, never
anything else; the tokens a client received are always a prefix of target-only greedy decoding of
its prompt (exactly its ``max_tokens`` of them when it completed). Afterwards the scheduler holds
no request (active, prefilling, queued, releasing) and every slot is free on the target and the
drafter (their ``Info.free_slots`` and the engines' session tables), and a last normal request
decodes exactly like target-only greedy decoding. Timing only decides at which phase a cancel
lands, never whether the test passes. (Counted once on a busy 2-core CPU: about 320 requests
ended while queued, 140 while decoding and 15 while their prefill ran; the module takes about
25 s.)
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
import uuid

import grpc
import pytest

from dflash_grpc.transport import GRPC_OPTIONS, reason_of
from dflash_grpc.v1 import draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from runtime.owners import EPOCH_KEY, OWNER_KEY
from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

REQUESTS = 1000
CLIENTS = 12
TARGET_SLOTS = 4
DRAFT_SLOTS = 3
MAX_SESSIONS = 4
MAX_QUEUE = 8
CONTEXT = 64
MAX_TOKENS = 6
PLANS = {"complete": 3, "cancel_now": 2, "cancel_after_delay": 3, "cancel_after_k": 3, "deadline": 2}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
TIMEOUT = 60.0


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding: the first ``n`` tokens after ``prompt``."""
    from runtime.sampling import Sampling

    sid = f"greedy-{uuid.uuid4().hex}"
    out = [engine.prefill(sid, list(prompt), Sampling.checked(0.0, 0, 0.0, 0), []).first_token]
    try:
        while len(out) < n:
            out.append(engine.verify(sid, [out[-1]], [-1]).bonus_token)
    finally:
        engine.release([sid])
    return out


@pytest.fixture(scope="module", params=["threads", "aio"])
def storm(request, tiny_llama, tiny_drafter):
    """``(GenerationService stub, servicer, target stub, draft stub, draft servicer)``; the
    orchestrator on either of its gRPC servers (``--grpc-server``)."""
    with target_in_process(tiny_llama.path, max_sessions=TARGET_SLOTS, max_context=CONTEXT, max_workers=8,
                           name="storm-target") as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=DRAFT_SLOTS, max_context=CONTEXT,
                             max_workers=8) as (dservicer, dport):
        md = [(OWNER_KEY, "storm-orchestrator"), (EPOCH_KEY, uuid.uuid4().hex)]
        with orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=MAX_SESSIONS, max_queue=MAX_QUEUE,
                                     metadata=md, step_timeout=30.0, max_workers=CLIENTS + 4,
                                     server_kind=request.param) as (servicer, oport), \
                grpc.insecure_channel(f"127.0.0.1:{oport}", options=GRPC_OPTIONS) as och, \
                grpc.insecure_channel(f"127.0.0.1:{tport}", options=GRPC_OPTIONS) as tch, \
                grpc.insecure_channel(f"127.0.0.1:{dport}", options=GRPC_OPTIONS) as dch:
            yield (generation_pb2_grpc.GenerationServiceStub(och), servicer, target_pb2_grpc.TargetServiceStub(tch),
                   draft_pb2_grpc.DraftServiceStub(dch), dservicer)


def _plan(i: int, prompts: list[list[int]]) -> dict:
    rng = random.Random(i)
    return {"i": i, "prompt": prompts[rng.randrange(len(prompts))], "max_tokens": rng.randint(1, MAX_TOKENS),
            "speculative": rng.random() < 0.7, "action": rng.choices(list(PLANS), weights=list(PLANS.values()))[0],
            "delay": rng.uniform(0.0, 0.12), "k": rng.randint(1, 3), "deadline": rng.uniform(0.001, 0.4)}


def _run(stub, plan: dict) -> tuple[grpc.StatusCode, str, list[int], list[generation_pb2.GenerateResponse]]:
    """One request as its plan says: ``(status, reason, tokens received, messages)``."""
    req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=plan["prompt"]),
                                         max_tokens=plan["max_tokens"], ignore_eos=True)
    req.speculative.enabled = plan["speculative"]
    action = plan["action"]
    call = stub.Generate(req, timeout=plan["deadline"] if action == "deadline" else TIMEOUT)
    if action == "cancel_now":
        call.cancel()
    elif action == "cancel_after_delay":
        time.sleep(plan["delay"])
        call.cancel()
    msgs = []
    try:
        for m in call:
            msgs.append(m)
            if action == "cancel_after_k" and len(msgs) == plan["k"]:
                call.cancel()
    except grpc.RpcError as e:
        return e.code(), reason_of(e), [t for m in msgs for t in m.token_ids], msgs
    return grpc.StatusCode.OK, "", [t for m in msgs for t in m.token_ids], msgs


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def test_cancel_storm_leaves_nothing_behind(storm, tiny_llama):
    from target_service.__main__ import build_engine

    stub, servicer, target, draft, dservicer = storm
    sched = servicer.scheduler
    ref, _ = build_engine(tiny_llama.path, max_sessions=1, max_context=CONTEXT)
    rng = random.Random(22)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 8))] for _ in range(8)]
    expected = {tuple(p): greedy(ref, p, MAX_TOKENS) for p in prompts}

    work: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(REQUESTS):
        work.put(_plan(i, prompts))
    outcomes: list[tuple[dict, grpc.StatusCode, str, list[int], list]] = []
    errors: list[BaseException] = []
    rejected: list[int] = []
    peak = {"queued": 0, "active": 0}
    done = threading.Event()

    def client():
        try:
            while True:
                try:
                    plan = work.get_nowait()
                except queue.Empty:
                    return
                for attempt in range(50):   # the queue was full (cancelled requests count until dropped): again
                    out = _run(stub, plan)
                    if out[0] != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        break
                    rejected.append(plan["i"])
                    time.sleep(0.01)
                outcomes.append((plan, *out))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def watch():   # the queue is used: more clients than sessions
        while not done.wait(0.005):
            s = sched.status()
            peak["queued"] = max(peak["queued"], s.queued_requests)
            peak["active"] = max(peak["active"], s.active_sessions)

    threads = [threading.Thread(target=client, name=f"storm-client-{i}") for i in range(CLIENTS)]
    watcher = threading.Thread(target=watch, name="storm-watch")
    watcher.start()
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    watcher.join()
    elapsed = time.monotonic() - t0
    assert not errors, errors
    assert len(outcomes) == REQUESTS

    seen = collections.Counter()
    for plan, code, reason, tokens, msgs in outcomes:
        seen[(plan["action"], code.name, "tokens" if tokens else "none")] += 1
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert reason == "QUEUE_FULL", (plan, code, reason)
        else:
            assert code in ALLOWED, (plan, code, reason)
        want = expected[tuple(plan["prompt"])][:plan["max_tokens"]]
        assert tokens == want[:len(tokens)], (plan, tokens, want)
        if code == grpc.StatusCode.OK:
            assert tokens == want, (plan, tokens, want)
            assert msgs[-1].finished and msgs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    print(f"\n{REQUESTS} requests in {elapsed:.1f} s; {len(rejected)} times QUEUE_FULL (retried); "
          f"peak queued {peak['queued']}, active {peak['active']}; "
          + ", ".join(f"{a}/{c}/{t}: {n}" for (a, c, t), n in sorted(seen.items())))
    # every kind of ending happened: completed, cancelled before any token, cancelled while decoding
    assert seen[("complete", "OK", "tokens")] > 50
    assert sum(n for (a, c, t), n in seen.items() if c == "CANCELLED" and t == "none") > 50
    assert sum(n for (a, c, t), n in seen.items() if c == "CANCELLED" and t == "tokens") > 50
    assert peak["queued"] > 0

    # nothing left behind: the scheduler, the target, the drafter
    def idle() -> bool:
        s = sched.status()
        return (s.active_sessions == 0 and s.queued_requests == 0 and not sched._active and not sched._prefilling  # noqa: SLF001
                and not any(sched._releasing.values()))  # noqa: SLF001
    _wait(idle, "the scheduler is idle")
    _wait(lambda: target.Info(target_pb2.TargetInfoRequest(), timeout=10).free_slots == TARGET_SLOTS,
          "every target slot is free")
    _wait(lambda: draft.Info(draft_pb2.DrafterInfoRequest(), timeout=10).model.free_slots == DRAFT_SLOTS,
          "every drafter slot is free")
    assert dservicer.num_sessions == 0

    # and a normal request after the storm decodes exactly like target-only greedy decoding
    _wait(lambda: servicer.draft.state() is not None, "the drafter is usable")
    prompt = [7, 42, 9, 100, 250]
    req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=prompt), max_tokens=24,
                                         ignore_eos=True)
    msgs = list(stub.Generate(req, timeout=TIMEOUT))
    assert [t for m in msgs for t in m.token_ids] == greedy(ref, prompt, 24)
    assert msgs[-1].finished and msgs[-1].stats.drafts > 0   # it drafted: the drafter is usable after the storm
    _wait(lambda: target.Info(target_pb2.TargetInfoRequest(), timeout=10).free_slots == TARGET_SLOTS,
          "every target slot is free after the last request")
