"""``python -m orchestrator``: the public GenerationService over a target and a draft service."""

from __future__ import annotations

import argparse
import logging

from dflash_grpc import serving
from dflash_grpc.v1 import draft_pb2, generation_pb2_grpc
from orchestrator.peers import DraftPeer, TargetPeer
from orchestrator.servicer import GenerationServicer
from target_service import default_model_path
from target_service.tokenizer import GGUFTokenizer

log = logging.getLogger("orchestrator")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    p.add_argument("--target", required=True, help="target service address host:port")
    p.add_argument("--draft", default=None, help="draft service address host:port (omit: autoregressive only)")
    p.add_argument("--model", default=None, help="target GGUF, read for its tokenizer and chat template")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    # default: a 16-node DDTree with 4 candidates per depth, the fastest configuration measured with
    # the shipped drafter (benchmarks/tau-cpu.txt: 18.0 tokens/s vs 14.6 for the chain, 12.6 plain)
    p.add_argument("--tree-budget", type=int, default=16, help="default draft tree budget (0: chain)")
    p.add_argument("--draft-top-k", type=int, default=4, help="default candidates per depth (1: chain)")
    p.add_argument("--max-depth", type=int, default=0, help="default draft depth (0: block_size - 1)")
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
    target = TargetPeer(args.target)
    target.wait_info(args.target_wait)
    draft = DraftPeer(args.draft)
    tokenizer = GGUFTokenizer.from_gguf(args.model or default_model_path())
    tree = draft_pb2.TreeParams(budget=args.tree_budget, top_k=args.draft_top_k, max_depth=args.max_depth)
    servicer = GenerationServicer(target, draft, tokenizer, args.max_tokens, tree)
    if draft.state() is not None and draft.state().target_fingerprint != servicer.target_info.model_fingerprint:
        log.error("drafter does not match the target; speculative requests will fail with FAILED_PRECONDITION")
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.host)

    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.GenerationService"]

    max_workers = args.max_workers or (getattr(args, "max_sessions", 0) or 64) + getattr(args, "max_queue", 256) + 16
    server, health, port = serving.make_server(add, f"{args.host}:{args.port}", max_workers=max_workers, tls=tls)
    serving.serve_forever(server, health, "orchestrator", port)


if __name__ == "__main__":
    main()
