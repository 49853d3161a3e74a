"""Host cost of the orchestrator alone: its scheduler and gRPC path against an instant fake target.

    python tools/orchestrator_overhead.py [STREAMS ...]   # default 1 16 32 64; 100 tokens each, AR

The fake target answers Prefill and every Verify item at once (bonus token only), in this process,
as do the client streams, so the figures are an upper bound on the orchestrator's throughput on
this machine: tokens/s, ticks, milliseconds per tick and items per tick.
"""

from __future__ import annotations

import sys
import threading
import time

sys.path[:0] = [".", "proto"]

import client as sdk  # noqa: E402
from dflash_grpc import serving  # noqa: E402
from fixtures.fakes import FakeTokenizer  # noqa: E402
from dflash_grpc.v1 import common_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402
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


def main() -> None:
    sys.setswitchinterval(0.001)  # as the orchestrator's main sets it
    levels = [int(a) for a in sys.argv[1:]] or [1, 16, 32, 64]
    tokens = 100

    def add_target(s):
        target_pb2_grpc.add_TargetServiceServicer_to_server(InstantTarget(), s)
        return ["dflash_grpc.v1.TargetService"]

    tsrv, _, tport = serving.make_server(add_target, "127.0.0.1:0", max_workers=8)
    target, draft = TargetPeer(f"127.0.0.1:{tport}"), DraftPeer(None)
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
                c.generate(prompt="a", max_tokens=tokens, ignore_eos=True, speculative=False)

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
    target.close()


if __name__ == "__main__":
    main()
