"""``python -m draft_service``: serve ``dflash_grpc.v1.DraftService``.

    python -m draft_service [--drafter D.gguf] [--target T.gguf] [--port N] [--device cuda] ...

(every flag, its default and meaning: :class:`draft_service.config.DraftConfig`, docs/CONFIG.md).
``--target`` defaults to :func:`runtime.defaults.default_model_path`; ``--drafter`` to
:func:`draft_service.default_drafter_path` for that target (a cached random drafter when none is
shipped: it works but is untrained). On a CUDA device the batched engine
(:class:`draft_service.batched.BatchedDrafter`: context pool, batched steps, one CUDA graph per
batch bucket, captured at start behind a progress bar) serves; on the CPU the per-session
reference engine. Prints ``READY draft port=N`` once serving. ``--auth-token-file PATH`` (or
``$DFLASH_AUTH_TOKEN``) makes every call but health checks require the orchestrator's token
(UNAUTHENTICATED otherwise; :func:`dflash_grpc.serving.add_security_flags`); ``--reflection``
turns on gRPC server reflection.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from draft_service.config import DraftConfig
from runtime.config import add_flags, from_args, worker_threads

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

log = logging.getLogger("draft_service")


def build_parser() -> argparse.ArgumentParser:
    """The draft service's command line: one flag per :class:`DraftConfig` field, plus the TLS
    flags of :func:`dflash_grpc.serving.add_tls_flags` and the access flags of
    :func:`dflash_grpc.serving.add_security_flags`."""
    from dflash_grpc.serving import add_security_flags, add_tls_flags

    ap = argparse.ArgumentParser(prog="python -m draft_service", description="DFlash draft service (gRPC)")
    add_flags(ap, DraftConfig)
    add_tls_flags(ap)
    add_security_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m draft_service`` with ``argv`` (default: ``sys.argv[1:]``) until stopped."""
    from dflash_grpc import localhop
    from dflash_grpc.serving import (auth_token_from_args, local_endpoint, make_server, serve_forever,
                                     server_tls_from_args, setup_logging, streams_in_flight, tune_malloc)
    from runtime.step_loop import wait_drained

    ap = build_parser()
    args = ap.parse_args(argv)
    cfg = from_args(DraftConfig, args)
    tls = server_tls_from_args(args, ap)  # before loading: a bad flag fails at once

    setup_logging(cfg.log_level)
    tune_malloc()   # large messages every tick: reuse their memory
    token = auth_token_from_args(args, ap, warn_open=True)  # before loading: a bad file fails at once

    from draft_service import default_drafter_path
    from draft_service.drafter import DrafterError
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer, add_to_server
    from runtime.defaults import default_model_path

    target = cfg.target or default_model_path()
    drafter = cfg.drafter or default_drafter_path(target)
    t0 = time.monotonic()
    cfg = cfg.resolved()
    try:
        servicer = DraftServiceServicer.from_paths(
            drafter,
            target,
            device=cfg.device,
            dtype=_DTYPES[cfg.dtype],
            max_sessions=cfg.max_sessions,
            max_context=cfg.max_context,
            engine=cfg.engine,
            cuda_graphs=cfg.cuda_graphs,
            fused_step=cfg.fused_step,
            memory_budget=cfg.gpu_memory_bytes,
            batch_buckets=cfg.batch_buckets,
            max_top_k=cfg.max_top_k,
            prefill_chunk=cfg.prefill_chunk,
            weights=cfg.weights,
            progress=log.isEnabledFor(logging.INFO) or sys.stderr.isatty(),
        )
    except DrafterError as e:   # malformed, or does not fit the target: the message names the field
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("drafter ready", extra={"engine": type(servicer.engine).__name__, "graph_captures": servicer.engine.captures,
                                     "max_sessions": servicer.max_sessions, "asked": cfg.max_sessions,
                                     "batch_buckets": list(getattr(servicer.engine, "batch_buckets", ())),
                                     "seconds": round(time.monotonic() - t0, 2)})
    servicer.read_rings = cfg.feature_ring
    servicer.loop.idle_timeout = cfg.session_idle_timeout  # read by the loop thread at each look
    servicer.loop.owners.lease_s = cfg.lease_s

    if cfg.metrics_port:
        from dflash_grpc.service_metrics import serve_metrics

        serve_metrics(cfg.metrics_port, cfg.host, servicer.loop, "draft")

    def add(server):
        add_to_server(servicer, server)   # (Propose's rows read in place on the hop: parse_propose_request)
        return [SERVICE_NAME]

    max_workers = worker_threads(cfg.max_workers, servicer.max_sessions)
    server, health, port = make_server(add, f"{cfg.host}:{cfg.port}", max_workers=max_workers, tls=tls,
                                       auth_token=token, reflection=args.reflection, local_hop=cfg.local_hop)
    servicer.local_endpoint = local_endpoint(server)
    localhop.spin_for_device(str(servicer.drafter.device))   # the hop polls before it blocks on CUDA
    # SIGTERM: refuse new work; wait (--shutdown-timeout) until the clients released their sessions
    # or closed their streams; release what is left
    serve_forever(server, health, "draft", port, shutdown_timeout=cfg.shutdown_timeout,
                  drain=lambda left: wait_drained(servicer.loop, lambda: streams_in_flight(server), left))
    try:
        n = servicer.loop.release_all()
    except Exception:  # noqa: BLE001 - exiting anyway
        log.exception("releasing the sessions left failed")
        n = -1
    log.info("stopped; released the sessions left", extra={"sessions": n})
    servicer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
