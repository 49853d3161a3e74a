"""``python -m target_service``: serve a GGUF target model over gRPC.

On a CUDA device the GPU engine (:class:`~target_service.batched_engine.BatchedEngine`: state
pool, batched fixed-shape steps, CUDA graphs captured at start behind a progress bar) serves;
on the CPU the plain-PyTorch reference engine (:class:`~target_service.engine.TargetEngine`).
``--engine`` picks one explicitly (the batched engine also runs on the CPU, eagerly).
Every setting is a field of :class:`target_service.config.TargetConfig` (docs/CONFIG.md).
``--auth-token-file PATH`` (or ``$DFLASH_AUTH_TOKEN``) makes every call but health checks require
the orchestrator's token (UNAUTHENTICATED otherwise; :func:`dflash_grpc.serving.add_security_flags`);
``--reflection`` turns on gRPC server reflection.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

import torch

from dflash_grpc import localhop, serving
from dflash_grpc.v1 import common_pb2, target_pb2_grpc
from runtime.config import add_flags, from_args, worker_threads
from runtime.defaults import default_model_path
from runtime.fingerprint import model_fingerprint, tokenizer_fingerprint
from runtime.gguf_loader import open_gguf
from runtime.owners import Owners
from runtime.step_loop import StepLoop, wait_drained
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.models import load_model
from target_service.models.weights import weight_bytes
from target_service.servicer import FEATURES, TargetServicer

log = logging.getLogger("target_service")

#: Most items of the last Verify step for the hop's streams to poll for the next request (with no
#: prefill in progress): one to eight streams, where a step's few milliseconds leave the GPU idle
#: during the hop (issue 18's one stream, goal 5's eight). Beyond it the hop blocks at once.
HOP_SPIN_ITEMS = 8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pool_budget(device: torch.device, fraction: float | None, nbytes: int | None, reserve: int) -> int | None:
    """Bytes the state pool may take: ``nbytes`` if given, else ``fraction`` of the device's
    memory minus what is allocated now (the weights) and ``reserve`` (step scratch and graph
    pools), and never more than the device has free now minus ``reserve`` (another process on
    the GPU, e.g. the draft service, keeps its memory); ``None`` on the CPU without ``nbytes``.
    The engine holds ``min(--max-sessions, budget / slot bytes - 1)`` slots
    (:func:`runtime.graphs.slots_for_budget`, which logs a cut)."""
    if nbytes:
        return int(nbytes)
    if device.type != "cuda" or fraction is None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(min(fraction * total - torch.cuda.memory_allocated(device), free) - reserve)


def build_engine(model_path: str, config: TargetConfig | None = None, *, progress: bool = False, **settings):
    """Load the target GGUF and build its engine plus ``ModelInfo``.

    Args:
        model_path: the target GGUF.
        config: the service's settings (default: :class:`TargetConfig`'s defaults); ``settings``
            (any of its fields, e.g. ``max_sessions=4``) override them. Its device-dependent
            defaults are decided by :meth:`TargetConfig.resolved`: ``engine`` ``auto`` is batched on
            CUDA and the reference on the CPU, ``dtype`` ``auto`` bfloat16 on CUDA and float32 on
            the CPU, ``weights`` ``auto`` bf16 (quantized is opt-in), ``max_sessions`` None 64 on CUDA and 8 on the CPU (the batched engine may hold
            fewer if the memory budget is smaller: logged, and ``ModelInfo.max_sessions`` is the real number).
        progress: show a progress bar while loading weights and capturing graphs.

    Raises:
        GGUFError: unsupported architecture or malformed file.
        runtime.errors.ResourceExhausted: the memory budget holds no session slot.
    """
    cfg = dataclasses.replace(config or TargetConfig(), **settings).resolved()
    device, dtype, engine, max_sessions = cfg.device, cfg.dtype, cfg.engine, cfg.max_sessions
    max_context, max_tree_width, max_tree_depth = cfg.max_context, cfg.max_tree_width, cfg.max_tree_depth
    dev = torch.device(device)
    g = open_gguf(model_path)
    model = load_model(g, device=device, dtype=_DTYPES[dtype], progress=progress, weights=cfg.weights)
    resident = weight_bytes(model)
    log.info("weights loaded", extra={"weights": cfg.weights, "weight_bytes": resident,
                                      "file_bytes": os.path.getsize(model_path)})
    if engine == "batched":
        from target_service.batched_engine import BatchedEngine

        reserve = cfg.max_step_tokens * model.cfg.vocab_size * 16 + (1 << 30)
        budget = pool_budget(dev, cfg.gpu_memory_fraction, cfg.gpu_memory_bytes, reserve)
        eng = BatchedEngine(model, max_sessions=max_sessions, max_context=max_context, max_tree_width=max_tree_width,
                            max_tree_depth=max_tree_depth, feature_layers=cfg.feature_layers, memory_budget=budget,
                            cuda_graphs=cfg.cuda_graphs, batch_buckets=cfg.batch_buckets or None,
                            width_buckets=cfg.width_buckets or TargetConfig.width_buckets,
                            max_step_tokens=cfg.max_step_tokens, prefill_chunk=cfg.prefill_chunk,
                            ring_rows=cfg.feature_ring_rows, ring_bytes=cfg.feature_ring_bytes)
        log.info("state pool", extra={"max_sessions": eng.max_sessions, "asked": max_sessions,
                                      "slot_bytes": eng.slot_bytes, "budget_bytes": budget,
                                      "batch_buckets": list(eng.batch_buckets)})
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
        weight_bytes=resident,
    )
    return eng, info


def build_parser() -> argparse.ArgumentParser:
    """The target service's command line: one flag per :class:`TargetConfig` field, plus the TLS
    flags of :func:`dflash_grpc.serving.add_tls_flags` and the access flags of
    :func:`dflash_grpc.serving.add_security_flags`."""
    p = argparse.ArgumentParser(prog="python -m target_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, TargetConfig)
    serving.add_tls_flags(p)
    serving.add_security_flags(p)
    return p


def build_servicer(cfg: TargetConfig, progress: bool = False) -> TargetServicer:
    """Load the target (``cfg.model``, else the default model), build its engine and step loop
    (started) and return the servicer: what ``main`` serves, and what ``python -m orchestrator
    --target in-process`` runs in its own process (:mod:`orchestrator.local_target`).
    ``progress``: progress bars while loading and capturing graphs. Raises as
    :func:`build_engine`."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.monotonic()
    engine, info = build_engine(cfg.model or default_model_path(), cfg, progress=progress)
    log.info("target loaded", extra={"model": info.model_name, "seconds": round(time.monotonic() - t0, 2)})
    loop = StepLoop(engine, prefill_budget=cfg.prefill_budget, name="target", idle_timeout=cfg.session_idle_timeout,
                    owners=Owners(lease_s=cfg.lease_s))
    return TargetServicer(loop, info)


def stop_servicer(servicer: TargetServicer) -> None:
    """Release every session left and stop the step loop (after serving ended)."""
    loop = servicer.loop
    try:
        n = loop.release_all()
    except Exception:  # noqa: BLE001 - exiting anyway
        log.exception("releasing the sessions left failed")
        n = -1
    log.info("stopped; released the sessions left", extra={"sessions": n})
    loop.stop()
    ring = getattr(loop.engine, "ring", None)
    if ring is not None:   # (a shared-file ring's directory goes with it)
        ring.close()


def main(argv: list[str] | None = None) -> None:
    """Run ``python -m target_service`` with ``argv`` (default: ``sys.argv[1:]``) until stopped."""
    p = build_parser()
    args = p.parse_args(argv)
    cfg = from_args(TargetConfig, args)
    tls = serving.server_tls_from_args(args, p)  # before loading: a bad flag fails at once
    serving.setup_logging(cfg.log_level)
    serving.tune_malloc()   # large messages every tick: reuse their memory
    token = serving.auth_token_from_args(args, p, warn_open=True)
    servicer = build_servicer(cfg, progress=log.isEnabledFor(logging.INFO) or sys.stderr.isatty())
    loop, engine = servicer.loop, servicer.loop.engine
    if cfg.metrics_port:
        from dflash_grpc.service_metrics import serve_metrics

        serve_metrics(cfg.metrics_port, cfg.host, loop, "target")

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    max_workers = worker_threads(cfg.max_workers, engine.max_sessions)
    server, health, port = serving.make_server(add, f"{cfg.host}:{cfg.port}", max_workers=max_workers, tls=tls,
                                                 auth_token=token, reflection=args.reflection, local_hop=cfg.local_hop)
    servicer.info.local_endpoint = serving.local_endpoint(server)
    # the hop's streams poll for their next request only under a light load on CUDA (no prefill in
    # progress, at most HOP_SPIN_ITEMS items a step): the step loop runs prefill chunks on another
    # thread, which a polling hop thread would keep from the GIL; DFLASH_HOP_SPIN_US wins
    serving.set_local_hop_spin(server, localhop.quiet_spin(servicer.info.device, lambda: loop.quiet(HOP_SPIN_ITEMS)))
    # SIGTERM: refuse new work; wait (--shutdown-timeout) until the clients released their sessions
    # or closed their streams; release what is left
    serving.serve_forever(server, health, "target", port, shutdown_timeout=cfg.shutdown_timeout,
                          drain=lambda left: wait_drained(loop, lambda: serving.streams_in_flight(server), left))
    stop_servicer(servicer)


if __name__ == "__main__":
    main()
