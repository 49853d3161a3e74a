"""The hop: what one speculative step costs besides compute, on the real path (CPU benchmark).

    python tools/hop_overhead.py [--tokens N] [--rounds R] [--streams 1 4 16] [--modes ar spec]
                                 [--variant NAME:key=value,...] ...

The real :class:`target_service.servicer.TargetServicer` and
:class:`draft_service.servicer.DraftServiceServicer`, each in its own child process as in
production (a :class:`runtime.step_loop.StepLoop`, the services' gRPC server of
:func:`dflash_grpc.serving.make_server`, the switch interval their mains set), serve engines whose
batch methods return at once (:class:`InstantTargetEngine`, :class:`InstantDraftEngine`: results
of the right types, features of the right size). The real :class:`orchestrator.scheduler.Scheduler`
in this process (``sys.setswitchinterval(0.001)`` and owner metadata as the orchestrator's main)
drives ``S`` streams of ``N`` tokens each, autoregressive (``ar``: one Verify exchange per tick)
or speculative (``spec``: one Propose and one Verify per tick; the drafter proposes a chain of
``--depth`` nodes and the target accepts ``--accept`` of them). ``--compute-us`` makes every
engine step busy-wait that long holding the GIL (a model of a step's host-side work).

Per tick (milliseconds, as the scheduler's ``dflash_scheduler_step_seconds`` splits a tick):
``draft`` and ``verify`` are the two exchanges' round trips, ``orch`` the rest of the tick;
``dc`` and ``vc`` the engines' own compute seconds (the replies' ``compute_s``); ``hop`` =
``draft - dc + verify - vc``, the cost of gRPC and the queues (the figure issue 18 asks to bring
to <= 0.3 ms per step at one stream). Each round runs every (variant, mode, streams) once, in
alternating order; the per-round means are summarised as best and median over rounds (this
machine is shared and noisy: noise only ever adds, so the best round is the closest to the cost).

Variants run side by side (their own child processes), so a change can be compared with the
baseline in the same run: ``--variant queue:inline=0 --variant inline:inline=1`` (child settings:
``inline`` = the step loop's inline fast path on/off; ``switch`` = the services' switch interval
in seconds; ``hop`` = the services offer their same-host hop and the orchestrator uses it, 1 by
default: :mod:`dflash_grpc.localhop`) and of this process (``direct`` = the orchestrator's gRPC
streams are :class:`orchestrator.peers.DirectStreamCall` or grpcio's threaded ones; ``colocate=1``
with ``--model``: the target in this process, as ``--target in-process``). Without ``--variant``
one variant runs with the defaults.

``--model T.gguf --drafter D.gguf`` (CUDA): real engines instead of instant ones (the target
service's batched engine with the drafter's feature layers, the drafter's batched engine), the
same split; ``--budget N`` asks for trees of N nodes instead of chains.

``--trace`` splits each exchange (ms, means over the run; one variant and one case per run
make it readable): ``up`` = the orchestrator starts the exchange -> the servicer has the decoded
request, ``servicer`` = the servicer's own time (step loop and engine included), ``down`` = the
servicer gives its reply -> the orchestrator has it decoded (timestamps of ``time.perf_counter``,
one clock for every process of the host).

``--profile DIR`` profiles every thread of the three processes (``cProfile``, one profiler per
thread, merged per process) and writes ``DIR/orchestrator.prof``, ``DIR/target-NAME.prof`` and
``DIR/draft-NAME.prof`` (read them with ``python -m pstats``); profiled timings are inflated,
compare them only with each other.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path[:0] = [".", "proto"]

HIDDEN = 576                   # SmolLM2-135M's embedding width
LAYERS = [1, 8, 15, 22, 29]    # five tapped target layers: feature rows of 5 x 576 bf16 (5760 bytes)
VOCAB = 49152


# ---------------------------------------------------------------------------------- the engines
def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` holding the GIL (a model of a step's host-side Python work)."""
    if seconds > 0:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


class InstantTargetEngine:
    """A target engine whose steps take no time: prefill answers token 7 and ``[len(prompt),
    N*H]`` features; ``verify_batch`` accepts the first ``accept`` nodes of each chain (a node's
    parent the previous node), answers bonus token 9 and the committed rows' features (a slice of
    one preallocated bf16 buffer, as the batched engine's host buffers)."""

    def __init__(self, max_sessions: int = 64, accept: int = 2, hidden: int = HIDDEN, compute_s: float = 0.0):
        import torch

        from target_service.engine import PrefillJob, PrefillOutcome, VerifyOutcome

        self._job, self._prefill_out, self._out = PrefillJob, PrefillOutcome, VerifyOutcome
        self.max_sessions = max_sessions
        self.max_context = 1 << 20
        self.max_tree_width = 64
        self.accept = accept
        self.compute_s = compute_s
        self.cfg = type("Cfg", (), {"hidden_size": hidden, "vocab_size": VOCAB})()
        self.sessions: dict[str, list] = {}   # id -> [length, feature layers]
        self._rows = torch.zeros(4096, hidden * len(LAYERS), dtype=torch.bfloat16)

    def start_prefill(self, session_id, prompt, sampling, feature_layers):
        from runtime.errors import Reason, ResourceExhausted

        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted("no slot", reason=Reason.NO_FREE_SLOT)
        self.sessions[session_id] = [0, list(feature_layers)]
        return self._job(session_id, list(prompt), sampling, list(feature_layers))

    def run_prefill(self, job, budget):
        s = self.sessions[job.session_id]
        n = len(job.prompt)
        s[0] = n
        feats = self._rows[:n, : HIDDEN * len(s[1])].clone() if s[1] else None
        job.done, job.outcome = n, self._prefill_out(7, n, feats)
        return n

    def verify_batch(self, items):
        from runtime.errors import SessionNotFound

        spin(self.compute_s)
        out = []
        for sid, tokens, parents in items:
            s = self.sessions.get(sid)
            if s is None:
                out.append(SessionNotFound(sid))
                continue
            k = 0
            while k < self.accept and k + 1 < len(tokens) and parents[k + 1] == k:
                k += 1
            s[0] += k + 1
            feats = self._rows[: k + 1, : HIDDEN * len(s[1])] if s[1] else None
            out.append(self._out(list(range(k + 1)), list(tokens[1:k + 1]), 9, s[0], feats))
        return out

    def release(self, ids):
        return sum(self.sessions.pop(sid, None) is not None for sid in ids)


class InstantDraftEngine:
    """A drafter engine whose steps take no time: ``propose_batch`` answers, for each item, the
    chain ``root, 11, 12, ...`` of its ``max_depth`` (or ``budget``) nodes. Sessions count the
    feature rows they were sent (no check)."""

    def __init__(self, max_sessions: int = 64, block: int = 16, compute_s: float = 0.0):
        import torch

        from draft_service.batched import ProposeOutcome
        from draft_service.drafter import DrafterConfig

        self._out = ProposeOutcome
        self.compute_s = compute_s
        self.max_sessions = max_sessions
        self.max_context = 1 << 20
        cfg = DrafterConfig(hidden_size=HIDDEN, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                            intermediate_size=1536, rms_eps=1e-5, rope_theta=1e4, block_size=block,
                            target_layer_ids=list(LAYERS), mask_token_id=0, vocab_size=VOCAB,
                            target_fingerprint="hop-target", target_architecture="llama")
        self.drafter = type("Drafter", (), {"config": cfg, "device": torch.device("cuda:0")})()
        self.sessions: dict[str, int] = {}

    @property
    def free_slots(self) -> int:
        return self.max_sessions - len(self.sessions)

    def session_length(self, sid):
        return self.sessions.get(sid)

    def propose_batch(self, items):
        spin(self.compute_s)
        out = []
        for it in items:
            rows = 0 if it.features is None else int(it.features.shape[0])
            n = self.sessions.get(it.session_id, 0) + rows
            self.sessions[it.session_id] = n
            depth = it.max_depth or (self.drafter.config.block_size - 1)
            if it.budget:
                depth = min(depth, it.budget)
            out.append(self._out([it.root_token, *range(11, 11 + depth)], list(range(-1, depth)), n))
        return out

    def release(self, ids):
        return sum(self.sessions.pop(sid, None) is not None for sid in ids)


# ---------------------------------------------------------------------------------- profiling
_PROFILES: list = []


def profile_threads() -> None:
    """Profile every thread started from now on (and this one): one ``cProfile.Profile`` each."""
    import cProfile

    run = threading.Thread.run

    def profiled(self):
        p = cProfile.Profile()
        _PROFILES.append(p)
        p.enable()
        try:
            run(self)
        finally:
            p.disable()

    threading.Thread.run = profiled
    main = cProfile.Profile()
    _PROFILES.append(main)
    main.enable()


def dump_profiles(path: str) -> None:
    """Merge the profiles of :func:`profile_threads` into ``path``."""
    import pstats

    for p in _PROFILES:
        p.disable()   # this thread's; the others' stop being read here
    stats = None
    for p in _PROFILES:
        try:
            p.create_stats()
        except Exception:  # noqa: BLE001 - a profiler that never ran
            continue
        if not p.stats:
            continue
        stats = pstats.Stats(p) if stats is None else stats.add(p)
    if stats is not None:
        stats.dump_stats(path)


# ---------------------------------------------------------------------------------- tracing
def traced(handler, path: str):
    """A stream handler that appends, per message, the ``time.perf_counter()`` (one clock for
    every process of the host) when the servicer got the request (decoded) and when it gave
    its reply (before serialising) to ``path`` (lines ``in out``)."""
    def run(request_iterator, context):
        marks = []

        def requests():
            for r in request_iterator:
                marks.append(time.perf_counter())
                yield r

        try:
            for reply in handler(requests(), context):
                marks.append(time.perf_counter())
                yield reply
        finally:
            with open(path, "a") as f:
                f.writelines(f"{a!r} {b!r}\n" for a, b in zip(marks[::2], marks[1::2]))
    return run


def trace_split(sent: list[tuple[float, float]], path: str) -> tuple[float, float, float]:
    """Mean ``(up, handler, down)`` milliseconds of the exchanges ``sent`` (the parent's
    ``(before, after)`` of each, in order) against the servicer's marks in ``path`` (same order):
    up = request sent -> servicer has it, handler = the servicer's own time, down = reply
    given -> the parent has it decoded."""
    with open(path) as f:
        marks = [tuple(map(float, line.split())) for line in f if line.strip()]
    pairs = list(zip(sent, marks))[5:] or list(zip(sent, marks))
    n = len(pairs)
    return (sum(m[0] - s[0] for s, m in pairs) / n * 1e3, sum(m[1] - m[0] for s, m in pairs) / n * 1e3,
            sum(s[1] - m[1] for s, m in pairs) / n * 1e3)


# ---------------------------------------------------------------------------------- the children
def real_target(settings: dict[str, str]):
    """The target service's servicer over the real engine of ``settings["model"]`` on CUDA, with
    the drafter's feature layers (as ``python -m target_service --device cuda`` builds it)."""
    from client.launcher import drafter_feature_layers
    from target_service.__main__ import build_servicer
    from target_service.config import TargetConfig

    layers = drafter_feature_layers(settings["drafter"]) or []
    return build_servicer(TargetConfig(model=settings["model"], device=settings.get("device", "cuda"),
                                       feature_layers=tuple(layers), max_sessions=64))


def serve(kind: str, settings: dict[str, str]) -> None:
    """Child process: serve ``kind`` (target or draft) over an instant engine, as its main does;
    print the port; run until stdin closes."""
    from dflash_grpc import serving
    from dflash_grpc.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
    from runtime.config import worker_threads
    from runtime.owners import Owners
    from runtime.step_loop import StepLoop

    if settings.get("profile"):
        profile_threads()
    if "switch" in settings:   # the services' mains leave the default (5 ms)
        sys.setswitchinterval(float(settings["switch"]))
    extra = {"inline": settings["inline"] == "1"} if "inline" in settings else {}
    if kind == "target" and settings.get("model"):
        servicer = real_target(settings)
        loop, engine = servicer.loop, servicer.loop.engine
        if settings.get("trace"):
            servicer.Verify = traced(servicer.Verify, settings["trace"])

        def add(s):
            target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s)
            return ["dflash_grpc.v1.TargetService"]
    elif kind == "draft" and settings.get("model"):
        from draft_service.servicer import SERVICE_NAME, DraftServiceServicer

        servicer = DraftServiceServicer.from_paths(settings["drafter"], settings["model"], device=settings.get("device", "cuda"),
                                                    max_sessions=64)
        loop, engine = servicer.loop, servicer.engine
        loop.inline = extra.get("inline", True)
        if settings.get("trace"):
            servicer.Propose = traced(servicer.Propose, settings["trace"])

        def add(s):
            draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s)
            return [SERVICE_NAME]
    elif kind == "target":
        from target_service.servicer import FEATURES, TargetServicer

        engine = InstantTargetEngine(accept=int(settings.get("accept", 2)), compute_s=float(settings.get("compute", 0)))
        loop = StepLoop(engine, name="target", idle_timeout=300.0, owners=Owners(lease_s=5.0), **extra)
        info = common_pb2.ModelInfo(model_name="hop", architecture="llama", vocab_size=VOCAB, model_fingerprint="hop-target",
                                    tokenizer_fingerprint="hop-tok", max_context=engine.max_context, max_tree_width=64,
                                    max_tree_depth=32, max_sessions=engine.max_sessions, hidden_size=HIDDEN, num_layers=30,
                                    features=list(FEATURES), device="cuda:0")
        servicer = TargetServicer(loop, info)
        if settings.get("trace"):
            servicer.Verify = traced(servicer.Verify, settings["trace"])

        def add(s):
            target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s)
            return ["dflash_grpc.v1.TargetService"]
    else:
        from draft_service.servicer import SERVICE_NAME, DraftServiceServicer

        engine = InstantDraftEngine(compute_s=float(settings.get("compute", 0)))
        loop = StepLoop(engine, name="draft", batch_method="propose_batch", idle_timeout=300.0,
                        owners=Owners(lease_s=5.0), **extra)
        servicer = DraftServiceServicer(engine, loop=loop, tokenizer_fingerprint="hop-tok")
        if settings.get("trace"):
            servicer.Propose = traced(servicer.Propose, settings["trace"])

        def add(s):
            draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s)
            return [SERVICE_NAME]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=worker_threads(None, engine.max_sessions),
                                          local_hop=settings.get("hop") == "1")
    if kind == "target":
        servicer.info.local_endpoint = serving.local_endpoint(server)
    else:
        servicer.local_endpoint = serving.local_endpoint(server)
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(None)
    serving.stop_local_hop(server)
    loop.stop()
    if settings.get("profile"):
        dump_profiles(settings["profile"])


def spawn(kind: str, settings: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start a child serving ``kind``; returns it and its address."""
    arg = ",".join(f"{k}={v}" for k, v in settings.items())
    path = [os.getcwd(), os.path.join(os.getcwd(), "proto")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    p = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--settings", arg], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, text=True)
    line = p.stdout.readline()
    if not line.strip():
        raise SystemExit(f"the {kind} child did not start")
    return p, f"127.0.0.1:{int(line)}"


# ---------------------------------------------------------------------------------- the parent
class Recorder:
    """Collects every tick's split (``metrics.observe_tick``) and every exchange's ``compute_s``."""

    def __init__(self):
        self.ticks: list[tuple[float, float, float]] = []
        self.compute: dict[str, list[float]] = {"draft": [], "verify": []}
        self.on = False
        self.sent: dict[str, list[tuple[float, float]]] = {"draft": [], "verify": []}   # every exchange's (start, end)

    def install(self) -> None:
        from dflash_grpc.v1 import draft_pb2
        from orchestrator import metrics, peers

        real_tick = metrics.observe_tick
        rec = self

        def observe_tick(batch, draft_s, verify_s, overhead_s):
            if rec.on:
                rec.ticks.append((draft_s, verify_s, overhead_s))
            real_tick(batch, draft_s, verify_s, overhead_s)

        def recorded(real_exchange):
            def exchange(call, request, timeout=None, on_sent=None):
                t0 = time.perf_counter()
                reply = real_exchange(call, request, timeout, on_sent)
                rec.sent["draft" if isinstance(request, draft_pb2.ProposeRequest) else "verify"].append((t0, time.perf_counter()))
                if rec.on:
                    rec.compute["draft" if isinstance(request, draft_pb2.ProposeRequest) else "verify"].append(reply.compute_s)
                return reply
            return exchange

        metrics.observe_tick = observe_tick
        from orchestrator import local_target

        for cls in (getattr(peers, "StreamCall", None), getattr(peers, "DirectStreamCall", None),
                    getattr(peers, "LocalHopCall", None), getattr(local_target, "LocalVerifyStream", None)):
            if cls is not None:
                cls.exchange = recorded(cls.exchange)

    def reset(self) -> None:
        self.ticks = []
        self.compute = {"draft": [], "verify": []}


def run_once(sched, rec: Recorder, streams: int, tokens: int, speculative: bool, depth: int,
             budget: int = 0) -> dict[str, float]:
    """``streams`` requests of ``tokens`` tokens at once; the means per tick (ms)."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Failure, Request

    reqs = [Request(session_id=f"hop-{uuid.uuid4().hex[:12]}", prompt=list(range(100, 132)),
                    sampling=common_pb2.SamplingParams(), max_tokens=tokens,
                    tree=draft_pb2.TreeParams(max_depth=0 if budget else depth, budget=budget, top_k=4 if budget else 0),
                    speculative=speculative) for _ in range(streams)]
    rec.reset()
    rec.on = True
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    for r in reqs:
        while True:
            ev = r.events.get(timeout=60)
            if isinstance(ev, Failure):
                raise SystemExit(f"request failed: {ev}")
            if ev.finish is not None:
                break
    wall = time.perf_counter() - t0
    rec.on = False
    ticks = rec.ticks[2:] or rec.ticks   # the first ticks may share the loop with prefills
    n = len(ticks)
    d = sum(t[0] for t in ticks) / n
    v = sum(t[1] for t in ticks) / n
    o = sum(t[2] for t in ticks) / n
    # (exchanges per tick: a tick makes at most one of each; ticks without a Propose count 0)
    dc = sum(rec.compute["draft"][2:]) / n
    vc = sum(rec.compute["verify"][2:]) / n
    return {"tick": (d + v + o) * 1e3, "draft": d * 1e3, "dc": dc * 1e3, "verify": v * 1e3, "vc": vc * 1e3,
            "orch": o * 1e3, "hop": (d - dc + v - vc) * 1e3, "tok/s": streams * tokens / wall,
            "ticks": float(len(rec.ticks)), "fallbacks": float(sched.fallbacks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", choices=["target", "draft"], help=argparse.SUPPRESS)
    ap.add_argument("--settings", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream (default 200)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="+", default=["ar", "spec"], choices=["ar", "spec"])
    ap.add_argument("--depth", type=int, default=4, help="draft chain nodes (default 4)")
    ap.add_argument("--accept", type=int, default=2, help="chain nodes the target accepts (default 2)")
    ap.add_argument("--compute-us", type=float, default=0.0,
                    help="each engine step busy-waits this long holding the GIL (default 0: instant)")
    ap.add_argument("--trace", action="store_true",
                    help="split each exchange into up / servicer / down (ms; one variant, one case at a time)")
    ap.add_argument("--profile", metavar="DIR", help="cProfile every thread of the three processes into DIR/*.prof")
    ap.add_argument("--model", help="real engines on CUDA instead of instant ones: this target GGUF ...")
    ap.add_argument("--drafter", help="... and this drafter GGUF (both required together)")
    ap.add_argument("--device", default="cuda", help="with --model: cuda, or cpu for a smoke run")
    ap.add_argument("--budget", type=int, default=0, help="draft tree nodes (0: a chain of --depth nodes)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:key=value,... settings (inline=0|1, switch=SECONDS, direct=0|1, hop=0|1, "
                         "colocate=1 with --model); repeatable")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, dict(kv.split("=", 1) for kv in args.settings.split(",") if kv))
        return

    from dflash_grpc import serving
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Scheduler
    from runtime.owners import EPOCH_KEY, OWNER_KEY

    sys.setswitchinterval(0.001)   # as the orchestrator's main sets it
    serving.add_client_metadata([(OWNER_KEY, "hop-bench"), (EPOCH_KEY, uuid.uuid4().hex)])
    variants = []
    for spec in args.variant or ["default:"]:
        name, _, kvs = spec.partition(":")
        settings = dict(kv.split("=", 1) for kv in kvs.split(",") if kv)
        settings["accept"] = str(args.accept)
        settings["compute"] = str(args.compute_us / 1e6)
        settings.setdefault("hop", "1")
        if args.model:
            settings["model"], settings["drafter"], settings["device"] = args.model, args.drafter, args.device
        variants.append((name, settings))
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        profile_threads()
    rec = Recorder()
    rec.install()
    children, scheds = [], {}
    try:
        for name, settings in variants:
            prof = os.path.abspath(os.path.join(args.profile, "{}-" + name + ".prof")) if args.profile else ""
            traces = {k: f"/tmp/hop-trace-{os.getpid()}-{name}-{k}.txt" if args.trace else "" for k in ("target", "draft")}
            if settings.get("colocate") == "1":   # the target in this process (--target in-process)
                from orchestrator.local_target import LocalTargetPeer

                target = LocalTargetPeer(real_target(settings))
            else:
                tp, taddr = spawn("target", dict(settings, profile=prof.format("target"), trace=traces["target"]))
                children.append(tp)
                target = TargetPeer(taddr)
            dp, daddr = spawn("draft", dict(settings, profile=prof.format("draft"), trace=traces["draft"]))
            children.append(dp)
            draft = DraftPeer(daddr)
            if "direct" in settings:   # this process's side: DirectStreamCall or grpcio's threaded streams
                target.direct_streams = draft.direct_streams = settings["direct"] == "1"
            target.local_hop = draft.local_hop = settings.get("hop", "1") == "1"
            target.wait_info(300)
            deadline = time.monotonic() + 300
            while draft.state() is None and time.monotonic() < deadline:   # a real drafter loads and captures
                time.sleep(0.2)
            scheds[name] = Scheduler(target, draft, max_sessions=64, step_nodes=4096, draft_deadline_factor=0)
        cases = [(v, m, s) for s in args.streams for m in args.modes for v, _ in variants]
        results: dict[tuple, list[dict]] = {c: [] for c in cases}
        for c in cases:   # warm-up round, not counted
            run_once(scheds[c[0]], rec, c[2], min(args.tokens, 50), c[1] == "spec", args.depth, args.budget)
        for rnd in range(args.rounds):
            order = cases if rnd % 2 == 0 else cases[::-1]
            for c in order:
                results[c].append(run_once(scheds[c[0]], rec, c[2], args.tokens, c[1] == "spec", args.depth, args.budget))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        engines = f"engine steps spin {args.compute_us:g} us" if args.compute_us else "instant engines"
        if args.model:
            engines = f"real engines on CUDA ({os.path.basename(args.model)}, {os.path.basename(args.drafter)})"
        print(f"# hop_overhead: CPU ({os.cpu_count()} cores), {engines}, {args.tokens} tokens per stream, "
              f"{args.rounds} rounds; ms per tick, mean of a round: best / median over rounds")
        keys = ["tick", "draft", "dc", "verify", "vc", "orch", "hop"]
        print(f"{'variant':<10} {'mode':<4} {'S':>3} " + " ".join(f"{k:>13}" for k in keys) + f" {'tok/s':>13}")
        for c in cases:
            rows = results[c]
            cells = []
            for k in keys + ["tok/s"]:
                vals = [r[k] for r in rows]
                best = max(vals) if k == "tok/s" else min(vals)
                cells.append(f"{best:6.3f}/{statistics.median(vals):6.3f}" if k != "tok/s"
                             else f"{best:6.0f}/{statistics.median(vals):6.0f}")
            fb = rows[-1]["fallbacks"]
            print(f"{c[0]:<10} {c[1]:<4} {c[2]:>3} " + " ".join(f"{x:>13}" for x in cells)
                  + (f"  (draft fallbacks: {fb:.0f})" if fb else ""))
    finally:
        for s in scheds.values():
            s.stop(timeout=2.0, release_timeout=2.0)
        for p in children:
            p.stdin.close()
        for p in children:
            try:
                p.wait(30 if args.profile else 5)
            except subprocess.TimeoutExpired:
                p.kill()
        if args.profile:
            dump_profiles(os.path.join(args.profile, "orchestrator.prof"))
        if args.trace:
            for name, _ in variants:
                for kind, key in (("target", "verify"), ("draft", "draft")):
                    path = f"/tmp/hop-trace-{os.getpid()}-{name}-{kind}.txt"
                    if os.path.exists(path) and rec.sent[key]:
                        up, handler, down = trace_split(rec.sent[key], path)
                        print(f"# trace {name} {key}: up {up:.3f}  servicer {handler:.3f}  down {down:.3f} ms per exchange "
                              f"(mean of {len(rec.sent[key])})")
                    if os.path.exists(path):
                        os.remove(path)


if __name__ == "__main__":
    main()
