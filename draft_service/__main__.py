"""``python -m draft_service``: serve ``dflash_grpc.v1.DraftService``.

    python -m draft_service [--drafter D.gguf] [--target T.gguf] [--host 127.0.0.1] [--port 50053]
        [--device cpu] [--dtype auto] [--engine auto] [--no-cuda-graphs] [--gpu-memory-bytes N]
        [--batch-buckets 1,2,4,...] [--max-top-k 8] [--max-sessions 64] [--max-context N]
        [--max-workers N] [--session-idle-timeout 300] [--metrics-port 0] [--log-level WARNING]

``--target`` defaults to :func:`runtime.defaults.default_model_path`; ``--drafter`` to
:func:`draft_service.default_drafter_path` for that target (a cached random drafter when none is
shipped: it works but is untrained). On a CUDA device the batched engine
(:class:`draft_service.batched.BatchedDrafter`: context pool, batched steps, one CUDA graph per
batch bucket, captured at start behind a progress bar) serves; on the CPU the per-session
reference engine. Prints ``READY draft port=N`` once serving.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

log = logging.getLogger("draft_service")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draft_service", description="DFlash draft service (gRPC)")
    ap.add_argument("--drafter", help="drafter GGUF (default: the default drafter of the target)")
    ap.add_argument("--target", help="target GGUF the drafter was built for (default: the default model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50053, help="0 picks a free port")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=["auto", *_DTYPES], default="auto", help="auto: f32 on CPU, bf16 on CUDA")
    ap.add_argument("--engine", choices=["auto", "batched", "reference"], default="auto",
                    help="auto: the batched engine (context pool, CUDA graphs) on CUDA, the per-session reference on the CPU")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="batched engine: run the same steps eagerly")
    ap.add_argument("--gpu-memory-bytes", type=int, default=None,
                    help="batched engine: bytes for the context pool (fewer session slots if it holds fewer than --max-sessions)")
    ap.add_argument("--batch-buckets", type=_ints, default=None, help="batched engine: batch buckets (default 1,2,4,8,16,32,64)")
    ap.add_argument("--max-top-k", type=int, default=None,
                    help="batched engine: candidates per depth in the step's top-K table (default 8; larger top_k requests are cut to it)")
    ap.add_argument("--max-sessions", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=None,
                    help="rows per session (default: the target's context length; the batched engine caps that default at 4096)")
    ap.add_argument("--max-workers", type=int, default=None,
                    help="gRPC worker threads for streams (one per open Propose stream; default: session slots + 16); "
                    "8 more are kept for unary calls")
    ap.add_argument("--session-idle-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="release a session unused for this long (its Release was lost); 0 = never (default 300)")
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="Prometheus metrics HTTP port on --host: step time, batch size, pool use (0: off)")
    ap.add_argument("--log-level", default=None, help="default WARNING (or DFLASH_LOG_LEVEL)")
    from dflash_grpc.serving import add_tls_flags, make_server, serve_forever, server_tls_from_args, setup_logging

    add_tls_flags(ap)
    args = ap.parse_args(argv)
    tls = server_tls_from_args(args, ap)  # before loading: a bad flag fails at once

    setup_logging(args.log_level)

    from dflash_grpc.v1 import draft_pb2_grpc
    from draft_service import default_drafter_path
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer
    from runtime.defaults import default_model_path

    target = args.target or default_model_path()
    drafter = args.drafter or default_drafter_path(target)
    t0 = time.monotonic()
    servicer = DraftServiceServicer.from_paths(
        drafter,
        target,
        device=args.device,
        dtype=None if args.dtype == "auto" else _DTYPES[args.dtype],
        max_sessions=args.max_sessions,
        max_context=args.max_context,
        engine=args.engine,
        cuda_graphs=args.cuda_graphs,
        memory_budget=args.gpu_memory_bytes,
        batch_buckets=args.batch_buckets,
        max_top_k=args.max_top_k,
        progress=log.isEnabledFor(logging.INFO) or sys.stderr.isatty(),
    )
    log.info("drafter ready", extra={"engine": type(servicer.engine).__name__, "graph_captures": servicer.engine.captures,
                                     "max_sessions": servicer.max_sessions, "seconds": round(time.monotonic() - t0, 2)})
    servicer.loop.idle_timeout = args.session_idle_timeout  # read by the loop thread at each look

    if args.metrics_port:
        from dflash_grpc.service_metrics import serve_metrics

        serve_metrics(args.metrics_port, args.host, servicer.loop, "draft")

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    max_workers = args.max_workers or servicer.max_sessions + 16
    server, health, port = make_server(add, f"{args.host}:{args.port}", max_workers=max_workers, tls=tls)
    serve_forever(server, health, "draft", port)
    servicer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
