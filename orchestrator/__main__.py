"""``python -m orchestrator``: the public GenerationService over a target and a draft service.

Every setting is a field of :class:`orchestrator.config.OrchestratorConfig` (docs/CONFIG.md).
``--auth-token-file PATH`` (or ``$DFLASH_AUTH_TOKEN``): the target and draft services' shared token,
sent on every call to them; the public GenerationService stays open to every client.
``--reflection`` turns on gRPC server reflection. ``--target in-process`` runs the target in this
process (``--target-args``: its flags; :mod:`orchestrator.local_target`): no gRPC between the
orchestrator and the target, the draft service still its own process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import socket
import sys
import time
import uuid

import grpc

from dflash_grpc import localhop, serving
from orchestrator import peers
from orchestrator.config import OrchestratorConfig
from orchestrator.local_target import LocalTargetPeer
from orchestrator.peers import DraftPeer, TargetPeer, drafter_mismatch
from orchestrator.scheduler import Scheduler
from orchestrator.servicer import GenerationServicer, default_tree, serve_generation
from runtime.config import add_flags, from_args, worker_threads
from runtime.defaults import default_model_path
from runtime.owners import EPOCH_KEY, OWNER_KEY
from runtime.tokenizer import GGUFTokenizer

log = logging.getLogger("orchestrator")


def build_parser() -> argparse.ArgumentParser:
    """The orchestrator's command line: one flag per :class:`OrchestratorConfig` field, plus the
    TLS flags of :func:`dflash_grpc.serving.add_tls_flags` (serving and peers) and the access
    flags of :func:`dflash_grpc.serving.add_security_flags` (the token it sends to its peers)."""
    p = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    add_flags(p, OrchestratorConfig)
    serving.add_tls_flags(p, peers=True)
    serving.add_security_flags(p, peers=True)
    return p


def _wait_target(target: TargetPeer, timeout: float) -> None:
    """Poll the target's Info until it answers, for at most ``timeout`` seconds; a refusal of our
    token (UNAUTHENTICATED) ends the wait at once, as waiting cannot mend it.

    Raises:
        grpc.RpcError: UNAUTHENTICATED at once, or the last error after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            target.info()
            return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def main(argv: list[str] | None = None) -> None:
    """Run ``python -m orchestrator`` with ``argv`` (default: ``sys.argv[1:]``) until stopped."""
    p = build_parser()
    args = p.parse_args(argv)
    cfg = from_args(OrchestratorConfig, args)
    tls = serving.server_tls_from_args(args, p)
    serving.set_client_tls(serving.peer_tls_from_args(args, p))  # channels to the target and draft services
    serving.setup_logging(cfg.log_level)
    serving.tune_malloc()   # large messages every tick: reuse their memory
    token = serving.auth_token_from_args(args, p)
    if token is not None:  # before the peers open their channels
        serving.add_client_metadata([(serving.AUTH_METADATA_KEY, serving.bearer(token))])
    # The scheduler thread is on every request's critical path; handler threads (one per stream)
    # must not hold the GIL for the default 5 ms when it wakes (tools/orchestrator_overhead.py,
    # one stream: 0.87 -> 0.65 ms per tick).
    sys.setswitchinterval(0.001)
    # Who we are to the target and draft services (every call of the peers' channels carries it): a
    # name kept across restarts and a new epoch per start, so that the first call (Info, below) frees
    # the sessions a predecessor of the same name left behind. Before the peers are created.
    serving.add_client_metadata([(OWNER_KEY, instance_name(cfg)), (EPOCH_KEY, uuid.uuid4().hex)])
    peers.LOCAL_HOP = cfg.local_hop
    local = None
    if cfg.target == OrchestratorConfig.IN_PROCESS:
        local = _local_target(cfg, p)
        target = local
    else:
        target = TargetPeer(cfg.target)
        try:
            _wait_target(target, cfg.target_wait)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise
            p.exit(2, f"{p.prog}: error: the target service at {cfg.target} refused this orchestrator's token "
                      "(UNAUTHENTICATED): give --auth-token-file with the token the target was started with\n")
    draft = DraftPeer(cfg.draft)
    tokenizer = GGUFTokenizer.from_gguf(cfg.model or default_model_path())
    info = target.info()
    asked = cfg.max_sessions
    cfg = cfg.resolved(info.device, info.max_sessions, info.max_context)
    localhop.spin_for_device(info.device)   # the hop to a CUDA target's services polls before it blocks
    if asked > cfg.max_sessions:
        log.warning("the target holds fewer sessions than --max-sessions: that many requests decode at once, the "
                    "rest queue", extra={"asked": asked, "max_sessions": cfg.max_sessions, "max_queue": cfg.max_queue})
    scheduler = Scheduler(target, draft, max_sessions=cfg.max_sessions, max_queue=cfg.max_queue, step_nodes=cfg.step_nodes,
                          step_timeout=cfg.step_timeout, history_bytes=cfg.history_bytes,
                          draft_deadline_factor=cfg.draft_deadline_factor, draft_deadline_min_ms=cfg.draft_deadline_min_ms,
                          draft_deadline_ms=cfg.draft_deadline_ms, draft_deadline_row_us=cfg.draft_deadline_row_us,
                          draft_policy=cfg.draft_policy, stream_interval_ms=cfg.stream_interval_ms,
                          stream_hold_max_ms=cfg.stream_hold_max_ms, stream_host_share=cfg.stream_host_share,
                          feature_ring=cfg.feature_ring)
    servicer = GenerationServicer(target, draft, tokenizer, cfg.max_tokens, default_tree(cfg), scheduler,
                                  max_prompt_chars=cfg.max_prompt_chars, max_request_bytes=cfg.max_request_bytes)
    if draft.state() is not None and drafter_mismatch(draft.state(), info) is not None:
        log.error("drafter does not match the target; speculative requests will fail with FAILED_PRECONDITION",
                  extra={"why": drafter_mismatch(draft.state(), info)})
    if cfg.metrics_port:
        from prometheus_client import REGISTRY, start_http_server

        if local is not None:   # the in-process target's step-loop metrics (service="target") on the same page
            from dflash_grpc.service_metrics import StepLoopCollector

            REGISTRY.register(StepLoopCollector(local.servicer.loop, "target"))
        start_http_server(cfg.metrics_port, addr=cfg.host)

    max_workers = worker_threads(cfg.max_workers, cfg.max_sessions + cfg.max_queue)
    http = _http_server(cfg, p, servicer, tls, max_workers) if cfg.http_port else None
    # grpc refuses a larger request before decoding it (RESOURCE_EXHAUSTED); --grpc-server aio: each
    # Generate stream a coroutine (AioGenerationServicer), at most max_workers at once
    server, health, port, close = serve_generation(servicer, f"{cfg.host}:{cfg.port}", cfg.grpc_server,
                                                   max_streams=max_workers, tls=tls,
                                                   max_receive_bytes=cfg.max_request_bytes, reflection=args.reflection)
    # SIGTERM: admit nothing new, let requests finish (--shutdown-timeout), end the rest
    # UNAVAILABLE / SHUTTING_DOWN, release every session on both services, exit
    serving.serve_forever(server, health, "orchestrator", port, shutdown_timeout=cfg.shutdown_timeout,
                          drain=scheduler.drain)
    if http is not None:
        http.stop()
    close()
    if local is not None:
        from target_service.__main__ import stop_servicer

        local.close()
        stop_servicer(local.servicer)


#: environment variable holding the HTTP API key when ``--api-key-file`` is not given
API_KEY_ENV = "DFLASH_API_KEY"


def _http_server(cfg: OrchestratorConfig, p: argparse.ArgumentParser, servicer: GenerationServicer, tls, max_streams: int):
    """``--http-port``: the OpenAI-compatible front door (:mod:`orchestrator.http`, imported here
    only) on ``--host``, with the gRPC side's TLS; started (listening) before the gRPC server, so
    it serves once ``READY`` is printed. Its API key: ``--api-key-file`` (owner-only), else
    ``$DFLASH_API_KEY``, else none. Exits through ``p.error`` when the key is refused."""
    from orchestrator.http import HttpServer

    key = None
    try:
        if cfg.api_key_file is not None:
            key = serving.read_token_file(cfg.api_key_file)
        elif os.environ.get(API_KEY_ENV):
            key = serving.check_token(os.environ[API_KEY_ENV].strip())
    except ValueError as e:
        p.error(f"--api-key-file / ${API_KEY_ENV}: {e}")
    http = HttpServer(servicer, cfg.host, cfg.http_port, tls=tls, model_name=cfg.served_model_name, api_key=key,
                      max_streams=max_streams)
    http.start()
    return http


def _local_target(cfg: OrchestratorConfig, p: argparse.ArgumentParser) -> LocalTargetPeer:
    """``--target in-process``: build the target service's servicer from ``--target-args`` (its
    ``--model`` defaulting to ``--model``) in this process and wrap it as the target peer. The
    target's modules (torch) are imported here only."""
    from target_service.__main__ import build_parser as target_parser
    from target_service.__main__ import build_servicer
    from target_service.config import TargetConfig

    tp = target_parser()
    try:
        targs = tp.parse_args(shlex.split(cfg.target_args))
    except SystemExit:
        p.exit(2, f"{p.prog}: error: bad --target-args {cfg.target_args!r} (flags of python -m target_service)\n")
    tcfg = from_args(TargetConfig, targs)
    if tcfg.model is None:
        tcfg = dataclasses.replace(tcfg, model=cfg.model)
    servicer = build_servicer(tcfg, progress=log.isEnabledFor(logging.INFO) or sys.stderr.isatty())
    return LocalTargetPeer(servicer)


def instance_name(cfg: OrchestratorConfig) -> str:
    """``--instance-name``, else ``orchestrator@<host name>:<port>`` (with port 0, which changes at
    each start, the process id instead: ``orchestrator@<host name>:pid<pid>``)."""
    if cfg.instance_name:
        return cfg.instance_name
    return f"orchestrator@{socket.gethostname()}:{cfg.port if cfg.port else f'pid{os.getpid()}'}"


if __name__ == "__main__":
    main()
