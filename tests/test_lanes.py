"""Lanes (orchestrator.lanes): several schedulers over one target and drafter.

The end-to-end test runs the real services (tiny llama pair, CPU) with two lanes: every stream's
tokens equal its plain decoding, both lanes ran ticks, and nothing is held afterwards.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from dflash_grpc.transport import GRPC_OPTIONS
from orchestrator.lanes import Lanes, make_scheduler, share
from orchestrator.scheduler import Scheduler


def test_share_splits_a_total_into_parts_that_add_up():
    for total in (1, 2, 7, 64, 256):
        for lanes in (2, 3, 4):
            parts = [share(total, lanes, i) for i in range(lanes)]
            assert max(parts) - min(parts) <= 1
            assert sum(parts) == max(total, lanes)   # (a lane holds at least one)
            assert min(parts) >= 1


def test_lanes_refuses_fewer_than_two():
    with pytest.raises(ValueError, match="at least 2"):
        Lanes(None, None, lanes=1, max_sessions=4)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def test_two_lanes_are_lossless_share_the_requests_and_release_everything(tiny_llama, tiny_drafter):
    """Eight speculative streams at once through two lanes: each stream's tokens are its plain
    decoding's; both lanes ticked; a stream cancelled mid-way and the finished ones leave no
    session on either service and no request in either lane."""
    from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc
    from runtime.owners import EPOCH_KEY, OWNER_KEY
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    prompts = [[1 + i, 7, 3 + 2 * i] for i in range(8)]
    md = [(OWNER_KEY, "lanes-orchestrator"), (EPOCH_KEY, uuid.uuid4().hex)]
    with target_in_process(tiny_llama.path, max_sessions=10, max_context=128) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=10, max_context=128) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=9, max_tokens=24, metadata=md,
                                    lanes=2) as (servicer, oport), \
            grpc.insecure_channel(f"127.0.0.1:{oport}", options=GRPC_OPTIONS) as ch:
        lanes = servicer.scheduler
        assert isinstance(lanes, Lanes) and [lane.max_sessions for lane in lanes.lanes] == [5, 4]
        stub = generation_pb2_grpc.GenerationServiceStub(ch)

        def request(prompt, spec, n=24):
            req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=prompt), max_tokens=n,
                                                 ignore_eos=True)
            req.speculative.enabled = spec
            return req

        def run(prompt, spec):
            return [t for m in stub.Generate(request(prompt, spec), timeout=120) for t in m.token_ids]

        plain = [run(p, False) for p in prompts]
        out = [None] * len(prompts)
        barrier = threading.Barrier(len(prompts) + 1)

        def one(i):
            barrier.wait()
            out[i] = run(prompts[i], True)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        barrier.wait()
        # a ninth stream, cancelled after its first message, while the others decode
        call = stub.Generate(request([5, 5, 5], True, 96), timeout=120)
        next(iter(call))
        call.cancel()
        for t in threads:
            t.join()
        assert out == plain
        assert all(lane.ticks > 0 for lane in lanes.lanes), [lane.ticks for lane in lanes.lanes]
        status = lanes.status()
        assert status.max_sessions == 9 and status.ticks == lanes.ticks > 0

        def idle():
            s = lanes.status()
            return s.active_sessions == 0 and s.queued_requests == 0 and not lanes._of  # noqa: SLF001

        _wait(idle, "every request out of its lane")
        assert lanes.admitting
        assert lanes.drain(5.0) is True and not lanes.admitting


def test_make_scheduler_gives_one_scheduler_for_one_lane(tiny_llama):
    from orchestrator.peers import DraftPeer, TargetPeer
    from tests.conftest import target_in_process

    with target_in_process(tiny_llama.path, max_sessions=2, max_context=64) as tport:
        target, draft = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(None)
        try:
            sched = make_scheduler(target, draft, lanes=1, max_sessions=2)
            try:
                assert type(sched) is Scheduler and sched._thread.name == "scheduler"  # noqa: SLF001
            finally:
                sched.stop()
            lanes = make_scheduler(target, draft, lanes=3, max_sessions=2)
            try:
                assert [lane.max_sessions for lane in lanes.lanes] == [1, 1, 1]
                assert [lane._thread.name for lane in lanes.lanes] == ["scheduler-0", "scheduler-1", "scheduler-2"]  # noqa: SLF001
                assert all(lane.lanes == 3 for lane in lanes.lanes)
                lanes.close(object())   # never submitted: nothing happens
            finally:
                lanes.stop()
        finally:
            draft.close()
            target.close()
