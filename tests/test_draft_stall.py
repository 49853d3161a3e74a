"""A stopped (not dead) draft service never freezes the streams (docs/ARCHITECTURE.md, "Drafter
deadlines and circuit breaker").

The draft service runs as a real process (``python -m draft_service`` on the tiny random drafter)
so that it can be stopped with SIGSTOP: its connections stay open and nothing answers, the case
where only a deadline helps. The target (tiny llama, reference engine) and the orchestrator (a
:class:`~orchestrator.scheduler.Scheduler` with the default deadline settings behind a gRPC
server) run in this process. Three concurrent greedy streams are stopped mid-way: the largest gap
between consecutive messages of each stream stays far below ``--step-timeout`` (one Propose
deadline, then plain decoding at full speed), every stream's tokens equal target-only decoding,
and after SIGCONT speculation resumes within seconds. The target has one slot more than the streams:
the orchestrator keeps no history of the rows it sent the drafter, so after the stall the target
recomputes each lost drafter session's rows in a scratch session (docs/ARCHITECTURE.md, "Drafter
faults"), which needs a free slot (a full target resumes drafting as its requests end).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch

import client as sdk
from tests.conftest import module_service, target_in_process

STREAMS = 3
CONTEXT = 2048
STOPPED_S = 1.5
DEADLINE_MS = 500
MAX_GAP_S = 1.0  # one deadline (at most DEADLINE_MS) and a tick; --step-timeout, what a stopped
#                  drafter cost before, is 120 s


@pytest.fixture(scope="module")
def stack(tiny_llama, tiny_drafter):
    """``(client, draft process, scheduler)``."""
    from client.launcher import ServiceGroup, free_ports
    from dflash_grpc import serving
    from dflash_grpc.v1 import generation_pb2_grpc
    from orchestrator.config import OrchestratorConfig
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Scheduler
    from orchestrator.servicer import GenerationServicer, default_tree
    from runtime.tokenizer import GGUFTokenizer

    (dport,) = free_ports(1)
    draft = module_service("draft", "draft_service", dport, "--drafter", tiny_drafter, "--target", tiny_llama.path,
                           "--max-sessions", "16", "--max-context", str(CONTEXT))
    # one torch thread per process: on a busy 2-core machine two threads spin against each other
    # (a tiny linear took 7 ms instead of 0.03 ms), which only makes the timings noisy
    draft.env["OMP_NUM_THREADS"] = "1"
    switch, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(0.001)  # as the orchestrator's main sets it
    torch.set_num_threads(1)
    with target_in_process(tiny_llama.path, max_sessions=STREAMS + 1, max_context=CONTEXT, max_workers=8, name="stall-target") as tport, \
            ServiceGroup([draft], grace=5.0) as group:
        group.wait_healthy(timeout=120)
        target, drafter = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(draft.address)
        info = target.info()
        cfg = OrchestratorConfig(target=f"127.0.0.1:{tport}", draft=draft.address).resolved(
            info.device, info.max_sessions, info.max_context)
        # the deadline settings are the defaults but the maximum: a CPU drafter's default (10 s,
        # for real models on a busy CPU) would let a slow moment of this machine stretch the gap
        sched = Scheduler(target, drafter, max_sessions=cfg.max_sessions, step_nodes=cfg.step_nodes,
                          step_timeout=cfg.step_timeout, draft_deadline_ms=DEADLINE_MS)
        servicer = GenerationServicer(target, drafter, GGUFTokenizer.from_gguf(tiny_llama.path), 256, default_tree(cfg), sched)

        def add(server):
            generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
            return ["dflash_grpc.v1.GenerationService"]

        server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=16)
        proc = group.procs["draft"]
        try:
            with sdk.Client(f"127.0.0.1:{port}", timeout=120) as c:
                yield c, proc, sched
        finally:
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped child would not stop on SIGTERM
            server.stop(None)
            sched.stop()
            drafter.close()
            target.close()
            sys.setswitchinterval(switch)
            torch.set_num_threads(threads)


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_stopped_drafter_never_freezes_the_streams_and_speculation_resumes(stack):
    from prometheus_client import REGISTRY

    c, proc, sched = stack
    prompts = [[20 + i, 40 + 3 * i, 60, 80 + i] for i in range(STREAMS)]
    chunks: list[list[tuple[float, list[int]]]] = [[] for _ in prompts]
    streams = [c.stream(tokens=ids, max_tokens=CONTEXT - 16, ignore_eos=True) for ids in prompts]

    def read(i):
        try:
            for ch in streams[i]:
                chunks[i].append((time.monotonic(), list(ch.token_ids)))
        except sdk.DFlashError:
            pass  # cancelled by the test

    readers = [threading.Thread(target=read, args=(i,)) for i in range(STREAMS)]
    for t in readers:
        t.start()
    def drafts():
        return REGISTRY.get_sample_value("dflash_spec_decode_num_drafts_total") or 0

    start = drafts()
    try:
        _wait(lambda: all(len(ch) >= 10 for ch in chunks) and drafts() > start + 10
              and sched.draft.breaker.state == "closed", 30, "streams drafting")
        misses = sched.deadline_misses  # 0 unless this machine stalled the drafter for 4 round trips
        os.killpg(proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        _wait(lambda: sched.draft.breaker.state == "open", 5, "circuit opens")
        time.sleep(STOPPED_S)
        stopped_drafts = drafts()
        # one deadline missed, then no Propose at all while it is stopped (its probes fail)
        assert sched.deadline_misses == misses + 1 and sched.draft.breaker.state == "open"
        os.killpg(proc.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        _wait(lambda: drafts() > stopped_drafts + 10 and sched.draft.breaker.state == "closed", 10, "speculation resumes")
        resumed_s = time.monotonic() - t_cont
        time.sleep(0.2)
    finally:
        for s in streams:
            s.cancel()
        for t in readers:
            t.join(30)
    n_stopped = [sum(len(toks) for t, toks in ch if t_stop < t < t_cont) for ch in chunks]
    assert all(n > 20 for n in n_stopped), n_stopped    # decoding went on while it was stopped
    gaps = [max(b[0] - a[0] for a, b in zip(ch, ch[1:])) for ch in chunks]
    print(f"largest gaps {[round(g, 3) for g in gaps]} s, tokens while stopped {n_stopped}, "
          f"drafting again {resumed_s:.2f} s after SIGCONT, Propose round trip {sched.deadline.step_s * 1e3:.0f} ms "
          f"(average), deadline misses before the stop {misses}")
    assert max(gaps) < MAX_GAP_S, (gaps, sched.step_timeout)
    assert resumed_s < 5
    # the same tokens as target-only decoding
    got = [[tok for _, toks in ch for tok in toks] for ch in chunks]
    refs = [None] * STREAMS

    def ref(i):
        refs[i] = c.generate(tokens=prompts[i], max_tokens=len(got[i]), ignore_eos=True, speculative=False).token_ids

    threads = [threading.Thread(target=ref, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g, r in zip(got, refs):
        assert g == r
