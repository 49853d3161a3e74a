"""``python -m draft_service``: serve ``dflash_grpc.v1.DraftService``.

    python -m draft_service [--drafter D.gguf] [--target T.gguf] [--host 127.0.0.1] [--port 50053]
        [--device cpu] [--dtype auto] [--max-sessions 64] [--max-context N] [--log-level WARNING]

``--target`` defaults to :func:`target_service.default_model_path`; ``--drafter`` to
:func:`draft_service.default_drafter_path` for that target (a cached random drafter when none is
shipped: it works but is untrained). Prints ``READY draft port=N`` once serving.
"""

from __future__ import annotations

import argparse
import sys

import torch

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_service", description="DFlash draft service (gRPC)")
    ap.add_argument("--drafter", help="drafter GGUF (default: the default drafter of the target)")
    ap.add_argument("--target", help="target GGUF the drafter was built for (default: the default model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=["auto", *_DTYPES], default="auto", help="auto: f32 on CPU, bf16 on CUDA")
    ap.add_argument("--max-sessions", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=None, help="rows per session (default: the target's context length)")
    ap.add_argument("--max-workers", type=int, default=16, help="gRPC worker threads")
    ap.add_argument("--log-level", default=None, help="default WARNING (or DFLASH_LOG_LEVEL)")
    args = ap.parse_args(argv)

    from dflash_grpc.serving import make_server, serve_forever, setup_logging

    setup_logging(args.log_level)

    from dflash_grpc.v1 import draft_pb2_grpc
    from draft_service import default_drafter_path
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer
    from target_service import default_model_path

    target = args.target or default_model_path()
    drafter = args.drafter or default_drafter_path(target)
    servicer = DraftServiceServicer.from_paths(
        drafter,
        target,
        device=args.device,
        dtype=None if args.dtype == "auto" else _DTYPES[args.dtype],
        max_sessions=args.max_sessions,
        max_context=args.max_context,
    )

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    server, health, port = make_server(add, f"{args.host}:{args.port}", max_workers=args.max_workers)
    serve_forever(server, health, "draft", port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
