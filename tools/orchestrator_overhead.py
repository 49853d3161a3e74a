"""Host cost of the orchestrator alone: its scheduler and gRPC path against an instant fake target.

    python tools/orchestrator_overhead.py [--draft] [STREAMS ...]   # default 1 16 32 64; 100 tokens each

The fake target answers Prefill and every Verify item at once (bonus token only), in this process,
as do the client streams, so the figures are an upper bound on the orchestrator's throughput on
this machine: tokens/s, ticks, milliseconds per tick and items per tick. Without ``--draft`` the
requests decode autoregressively (no draft service); with it an instant fake drafter (in this
process too) answers every tick's Propose with a one-token chain, which the target rejects, so each
tick is one Propose and one Verify exchange.
"""

from __future__ import annotations

import sys
import threading
import time

sys.path[:0] = [".", "proto"]

import client as sdk  # noqa: E402
from dflash_grpc import serving  # noqa: E402
from fixtures.fakes import FakeTokenizer  # noqa: E402
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402
from orchestrator.peers import DraftPeer, TargetPeer  # noqa: E402
from orchestrator.scheduler import Scheduler  # noqa: E402
from orchestrator.servicer import GenerationServicer  # noqa: E402


class InstantTarget(target_pb2_grpc.TargetServiceServicer):
    def Info(self, request, context):
        return common_pb2.ModelInfo(vocab_size=1000, max_context=4096, max_tree_width=64, max_tree_depth=32, max_sessions=64,
                                    tokenizer_fingerprint="fp", model_fingerprint="m", device="cuda:0")

    def Prefill(self, request, context):
        it = request.items[0]
        return target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(session_id=it.session_id, first_token=9,
                                                                            committed_length=len(it.prompt_tokens))])

    def Verify(self, requests, context):
        for req in requests:
            yield target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(session_id=x.session_id, bonus_token=9, committed_length=10)
                                                     for x in req.items])

    def Release(self, request, context):
        return common_pb2.ReleaseResponse()


class InstantDrafter(draft_pb2_grpc.DraftServiceServicer):
    def Info(self, request, context):
        return draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(vocab_size=1000, block_size=16, max_sessions=256, device="cuda:0"),
                                     target_fingerprint="m")

    def Propose(self, requests, context):
        for req in requests:
            yield draft_pb2.ProposeResponse(results=[draft_pb2.ProposeResult(
                session_id=x.session_id, tree=common_pb2.TokenTree(tokens=[x.root_token, 1], parents=[-1, 0])) for x in req.items])

    def Release(self, request, context):
        return common_pb2.ReleaseResponse()


def main() -> None:
    sys.setswitchinterval(0.001)  # as the orchestrator's main sets it
    args = sys.argv[1:]
    drafting = "--draft" in args
    levels = [int(a) for a in args if a != "--draft"] or [1, 16, 32, 64]
    tokens = 100

    def add_target(s):
        target_pb2_grpc.add_TargetServiceServicer_to_server(InstantTarget(), s)
        return ["dflash_grpc.v1.TargetService"]

    tsrv, _, tport = serving.make_server(add_target, "127.0.0.1:0", max_workers=8)
    dsrv, daddr = None, None
    if drafting:
        def add_draft(s):
            draft_pb2_grpc.add_DraftServiceServicer_to_server(InstantDrafter(), s)
            return ["dflash_grpc.v1.DraftService"]

        dsrv, _, dport = serving.make_server(add_draft, "127.0.0.1:0", max_workers=8)
        daddr = f"127.0.0.1:{dport}"
    target, draft = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(daddr)
    sched = Scheduler(target, draft, max_sessions=64, step_nodes=512)
    servicer = GenerationServicer(target, draft, FakeTokenizer(), 256, None, sched)

    def add_orch(s):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)
        return ["dflash_grpc.v1.GenerationService"]

    osrv, _, oport = serving.make_server(add_orch, "127.0.0.1:0", max_workers=200)
    for n in levels:
        barrier = threading.Barrier(n + 1)

        def one():
            with sdk.Client(f"127.0.0.1:{oport}", timeout=100) as c:
                barrier.wait()
                c.generate(prompt="a", max_tokens=tokens, ignore_eos=True, speculative=drafting, tree_budget=0, max_depth=1)

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        t0, ticks0 = time.perf_counter(), sched.ticks
        for t in threads:
            t.join()
        dt, ticks = time.perf_counter() - t0, sched.ticks - ticks0
        print(f"streams {n:3d}: {n * tokens / dt:7.0f} tok/s, {ticks} ticks, {dt / ticks * 1e3:.2f} ms/tick, "
              f"{n * tokens / ticks:.1f} items/tick", flush=True)
    sched.stop()
    osrv.stop(0)
    tsrv.stop(0)
    if dsrv is not None:
        dsrv.stop(0)
    target.close()


if __name__ == "__main__":
    main()
