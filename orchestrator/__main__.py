"""``python -m orchestrator``: the public GenerationService over a target and a draft service."""

from __future__ import annotations

import argparse
import logging
import sys

from dflash_grpc import serving
from dflash_grpc.v1 import draft_pb2, generation_pb2_grpc
from orchestrator.peers import DraftPeer, TargetPeer, drafter_mismatch
from orchestrator.scheduler import Scheduler
from orchestrator.servicer import GenerationServicer
from runtime.defaults import default_model_path
from runtime.tokenizer import GGUFTokenizer

log = logging.getLogger("orchestrator")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    p.add_argument("--target", required=True, help="target service address host:port")
    p.add_argument("--draft", default=None, help="draft service address host:port (omit: autoregressive only)")
    p.add_argument("--model", default=None, help="target GGUF, read for its tokenizer and chat template")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    # default: a DDTree of 15 draft nodes with 4 candidates per depth: with the root it fills the
    # 16-wide verify bucket of the GPU engine (16 draft nodes pad to 32: tok/s 1.27x the chain vs
    # 1.17x at qwen35 0.8B, benchmarks/gpu/RESULTS.md "Tree vs chain"); on the CPU a 16-node tree
    # ran 18.0 tokens/s vs 14.6 for the chain, 12.6 plain (benchmarks/tau-cpu.txt)
    p.add_argument("--tree-budget", type=int, default=15,
                   help="default draft tree budget (0: chain); 15 draft nodes + the root fill the 16-wide verify bucket")
    p.add_argument("--draft-top-k", type=int, default=4, help="default candidates per depth (1: chain)")
    p.add_argument("--max-depth", type=int, default=0, help="default draft depth (0: block_size - 1)")
    p.add_argument("--max-sessions", type=int, default=0,
                   help="most requests decoding at once (0: the target's session slots)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting for a session; beyond it RESOURCE_EXHAUSTED at once")
    p.add_argument("--step-nodes", type=int, default=0,
                   help="verify nodes per tick shared by the batch: trees shrink as the batch grows "
                   "(0: 512 on a CUDA target, 64 on a CPU one)")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds a Propose or Verify may take before the peer counts as failed")
    p.add_argument("--draft-history-mib", type=float, default=64.0,
                   help="feature history kept per request to resume drafting after a drafter restart (MiB)")
    p.add_argument("--target-wait", type=float, default=120.0, help="seconds to wait for the target at start")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics HTTP port (0: off)")
    p.add_argument("--max-workers", type=int, default=None,
                   help="gRPC worker threads (one per open Generate stream; default: max sessions + max queue + 16); "
                   "8 more are kept for unary calls")
    p.add_argument("--log-level", default=None)
    serving.add_tls_flags(p, peers=True)
    args = p.parse_args(argv)
    tls = serving.server_tls_from_args(args, p)
    serving.set_client_tls(serving.peer_tls_from_args(args, p))  # channels to the target and draft services
    serving.setup_logging(args.log_level)
    # The scheduler thread is on every request's critical path; handler threads (one per stream)
    # must not hold the GIL for the default 5 ms when it wakes (tools/orchestrator_overhead.py,
    # one stream: 0.87 -> 0.65 ms per tick).
    sys.setswitchinterval(0.001)
    target = TargetPeer(args.target)
    target.wait_info(args.target_wait)
    draft = DraftPeer(args.draft)
    tokenizer = GGUFTokenizer.from_gguf(args.model or default_model_path())
    tree = draft_pb2.TreeParams(budget=args.tree_budget, top_k=args.draft_top_k, max_depth=args.max_depth)
    info = target.info()
    max_sessions = min(args.max_sessions or info.max_sessions, info.max_sessions or args.max_sessions or 8)
    step_nodes = args.step_nodes or (512 if info.device.startswith("cuda") else 64)
    scheduler = Scheduler(target, draft, max_sessions=max_sessions, max_queue=args.max_queue, step_nodes=step_nodes,
                          step_timeout=args.step_timeout, history_bytes=int(args.draft_history_mib * (1 << 20)))
    servicer = GenerationServicer(target, draft, tokenizer, args.max_tokens, tree, scheduler)
    if draft.state() is not None and drafter_mismatch(draft.state(), info) is not None:
        log.error("drafter does not match the target; speculative requests will fail with FAILED_PRECONDITION",
                  extra={"why": drafter_mismatch(draft.state(), info)})
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    max_workers = args.max_workers or max_sessions + args.max_queue + 16
    server, health, port = serving.make_server(add, f"{args.host}:{args.port}", max_workers=max_workers, tls=tls)
    serving.serve_forever(server, health, "orchestrator", port)


if __name__ == "__main__":
    main()
