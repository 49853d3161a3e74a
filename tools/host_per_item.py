"""Host time per item per tick of each service, on the CPU, with instant fake engines (issue 23, goal 3).

    python tools/host_per_item.py [--streams 1,16,64] [--modes ar,spec] [--tokens 128] [--repeats 1]
                                  [--stream-interval-ms MS] [--stream-hold-max-ms MS] [--no-local-hop] [--threads]
                                  [--grpc-server aio|threads] [--device-ms VERIFY,PROPOSE] [--hidden H] [--ring] [--cprofile DIR]
                                  [--scheduler-set NAME=VALUE ...] [--py-spy DIR] [--json FILE]
    python tools/host_per_item.py --summary LABEL=GLOB [LABEL=GLOB ...]   # median [min, max] of --json runs

Four processes, as in production: the target service, the draft service and the orchestrator,
each its own process built the way its ``__main__`` builds it (the real servicers, step loops,
``make_server`` with its interceptors, the same-host hop unless ``--no-local-hop``, the real
scheduler and ``GenerationServicer`` with the default model's real tokenizer, the services'
``serving.tune_malloc``), and this process as the clients (grpc.aio Generate streams, one event
loop: their CPU is not counted). Only the engines are fakes, and instant: the target's accepts
the first ``ACCEPT`` nodes of a tree's leading chain (the fake drafter's trees begin with a
chain) and returns their features as the batched engine does (a ``[k + 1, layers x hidden]``
bf16 CPU tensor, SmolLM2's 5 x 576); the drafter's answers each item with a tree of the asked
size. Each engine times itself (``time.thread_time``) and that time is subtracted: what is left
is the service's own host work.

Per level (streams) and mode (``ar``: plain decoding, ``spec``: the default tree), every stream
generates ``--tokens`` tokens (``ignore_eos``). Per service, ``us`` is the CPU seconds of its
process (``time.process_time()``: every thread, handlers, step loop, grpc's own threads) less its
fake engine's, divided by the items the ticks carried (the orchestrator's ticks x batch): one
Verify item, and one Propose item when drafting, per stream per tick. The main figures cover the
steady window, from the moment every stream has had its first message to the end of the first
stream (every stream decoding); "whole run" adds each request's start and end (Generate, Prefill,
Release, the last messages). ``tok/s`` and ``ms/tick`` are wall-clock figures on this machine (all
four processes share its cores: a bound, not the GPU host's). ``msgs/item``: Generate messages per
item (below 1 where ticks were coalesced into one message); ``gap p50/p99``: milliseconds between a
stream's messages in the steady window (its inter-token latency as streamed). ``--threads`` adds the CPU split by
thread name (``/proc/PID/task/*/schedstat``, fake engines included); ``--py-spy DIR`` records each
service with ``py-spy record -f raw --gil`` per level. Runs on older checkouts too (for
before/after: copy this file into one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict

sys.path[:0] = [".", "proto"]

ACCEPT = 3                  # draft tokens the fake target accepts per tree (at most the chain's depth)
HIDDEN, LAYERS = 576, (1, 8, 14, 20, 27)   # SmolLM2-135M and its shipped drafter's feature layers
VOCAB = 49152
BLOCK = 16
MAX_SESSIONS = 256
#: --device-ms: seconds each fake engine's step sleeps after its work (a GPU's device time, which
#: costs no CPU): [verify, propose]
DEVICE_S = [0.0, 0.0]
#: --ring: the fake target writes its feature rows into a feature ring (runtime.feature_ring, a
#: shared file: both fakes run on the CPU) and the fake drafter reads them from there, as the
#: batched engines do when the orchestrator asks; else the rows go in the messages
RING = [False]


def _one_thread() -> None:
    """--ring: torch's ops on one thread in a fake engine's process (the real engines' ring reads
    and writes run on the GPU; on the CPU, torch's worker threads' time would be counted as the
    service's host time, which only the calling thread's clock subtracts)."""
    import torch

    torch.set_num_threads(1)
#: --cprofile: whether profiling is on in this service process, and a cProfile.Profile per thread
#: that ran a profiled call (one profile is not safe across threads: its call stack is one)
_PROF: dict = {"on": False, "threads": {}}


def _thread_profile():
    """This thread's profile while --cprofile is on, else None."""
    if not _PROF["on"]:
        return None
    ident = threading.get_ident()
    p = _PROF["threads"].get(ident)
    if p is None:
        import cProfile

        p = _PROF["threads"].setdefault(ident, cProfile.Profile())
    return p


def _profiled(fn):
    """``fn`` (a plain function) profiled in its calling thread's profile while --cprofile is on."""
    def run(*a, **k):
        p = _thread_profile()
        if p is None:
            return fn(*a, **k)
        try:
            p.enable()
        except ValueError:   # (Python 3.12+: profiling is process-wide and another thread's is on)
            return fn(*a, **k)
        try:
            return fn(*a, **k)
        finally:
            p.disable()
    return run


def _profiled_gen(fn):
    """``fn`` (a generator function) profiled, each step, as :func:`_profiled`."""
    def run(*a, **k):
        gen = fn(*a, **k)
        while True:
            p = _thread_profile()
            on = False
            if p is not None:
                try:
                    p.enable()
                    on = True
                except ValueError:
                    pass
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                if on:
                    p.disable()
            yield item
    return run


# ---------------------------------------------------------------------------------------------
# thread names (so /proc shows what each thread is)

def _name_threads() -> None:
    """Give every Python thread of this process its name at the OS level (15 characters)."""
    import ctypes
    import threading

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return
    inner = threading.Thread._bootstrap_inner

    def named(self):
        name = self.name
        if name.startswith("ThreadPoolExecutor"):
            name = "pool-worker"
        elif name.startswith("Thread-") and "(" in name:
            name = name[name.index("(") + 1:].rstrip(")")
        try:
            libc.prctl(15, name[:15].encode(), 0, 0, 0)   # PR_SET_NAME
        except Exception:  # noqa: BLE001
            pass
        return inner(self)

    threading.Thread._bootstrap_inner = named


# ---------------------------------------------------------------------------------------------
# fake engines (instant; each times itself)

class _Clock:
    """Thread CPU seconds spent inside an engine's methods."""

    def __init__(self):
        self.s = 0.0


class _FakeSession(list):
    """A fake target session ``[length, feature columns or 0, ring slot or -1]`` with the two
    attributes :meth:`runtime.step_loop.StepLoop.stop_features` sets on an engine session
    (``feature_layers`` emptied, ``ring`` off: its slot back to ``free``)."""

    def __init__(self, values, free: list):
        super().__init__(values)
        self._free = free

    @property
    def feature_layers(self):
        return list(LAYERS) if self[1] else []

    @feature_layers.setter
    def feature_layers(self, layers):
        self[1] = len(layers) * HIDDEN

    @property
    def ring(self) -> bool:
        return self[2] >= 0

    @ring.setter
    def ring(self, on: bool) -> None:
        if not on and self[2] >= 0:
            self._free.append(self[2])
            self[2] = -1


class InstantTarget:
    """A target engine for :class:`runtime.step_loop.StepLoop` that answers at once."""

    def __init__(self):
        import torch
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB)
        self.max_sessions, self.max_context = MAX_SESSIONS, 8192
        self.max_tree_width, self.max_tree_depth = 64, 32
        self.sessions: dict[str, list] = {}     # id -> [length, feature columns or 0, ring slot or -1]
        self.clock = _Clock()
        self._feats = torch.randn(4096, len(LAYERS) * HIDDEN).to(torch.bfloat16)
        self._nodes = [list(range(k + 1)) for k in range(ACCEPT + 1)]
        #: --ring: the feature ring (made here, as the batched engine makes it on first use) and its free slots
        self.ring = None
        self._free = list(range(self.max_sessions))
        if RING[0]:
            from runtime.feature_ring import FeatureRing

            self.ring = FeatureRing.create(self.max_sessions, 128, len(LAYERS) * HIDDEN, torch.bfloat16, "cpu")
            _one_thread()

    def ring_features(self, session_ids, on=True):
        n = 0
        for sid in session_ids:
            s = self.sessions.get(sid)
            if s is None or self.ring is None or not s[1] or (s[2] >= 0) == on:
                continue
            if on:
                s[2] = self._free.pop()
            else:
                self._free.append(s[2])
                s[2] = -1
            n += 1
        return n

    def start_prefill(self, session_id, prompt, sampling, feature_layers):
        from runtime.errors import InvalidArgument, Reason, ResourceExhausted
        from target_service.engine import PrefillJob

        t0 = time.thread_time()
        try:
            if session_id in self.sessions:
                raise InvalidArgument(f"session {session_id!r} already exists", reason=Reason.SESSION_EXISTS)
            if len(self.sessions) >= self.max_sessions:
                raise ResourceExhausted("no free slot", reason=Reason.NO_FREE_SLOT)
            self.sessions[session_id] = _FakeSession([0, len(feature_layers) * HIDDEN, -1], self._free)
            return PrefillJob(session_id, list(prompt), sampling, list(feature_layers))
        finally:
            self.clock.s += time.thread_time() - t0

    def run_prefill(self, job, budget):
        from target_service.engine import PrefillOutcome

        t0 = time.thread_time()
        s = self.sessions.get(job.session_id)
        if s is None:
            return 0
        n = len(job.prompt)
        s[0] = n
        feats = self._feats[:n, :s[1]].clone() if s[1] else None
        job.outcome = PrefillOutcome(7 + n % 100, n, feats)
        self.clock.s += time.thread_time() - t0
        return n

    def verify_batch(self, items):
        import torch

        from runtime.errors import SessionNotFound
        from target_service.engine import VerifyOutcome

        t0 = time.thread_time()
        out = []
        sessions, feats, nodes_of = self.sessions, self._feats, self._nodes
        ringed = []   # (slot, committed length, rows) written to the ring after the loop, at once
        for sid, tokens, parents in items:
            s = sessions.get(sid)
            if s is None:
                out.append(SessionNotFound(f"unknown session {sid!r}"))
                continue
            k = 0   # the leading chain: node i's parent is i - 1
            while k < ACCEPT and k + 1 < len(parents) and parents[k + 1] == k:
                k += 1
            s[0] += k + 1
            if s[2] >= 0:   # (its rows into the ring, below)
                ringed.append((s[2], s[0], k + 1))
                out.append(VerifyOutcome(nodes_of[k], tokens[1:k + 1], 100 + s[0] % 1000, s[0], None, s[2]))
                continue
            out.append(VerifyOutcome(nodes_of[k], tokens[1:k + 1], 100 + s[0] % 1000, s[0],
                                     feats[:k + 1, :s[1]].clone() if s[1] else None))
        if ringed:   # one scatter for the step, as the batched engine's
            ring = self.ring
            slots, ends, counts = zip(*ringed)
            src = torch.cat([torch.arange(n) for n in counts])
            ring.table[torch.from_numpy(ring.rows_of(slots, ends, counts))] = feats[src]
        self.clock.s += time.thread_time() - t0
        if DEVICE_S[0]:
            time.sleep(DEVICE_S[0])
        return out

    def release(self, session_ids):
        n = 0
        for sid in session_ids:
            s = self.sessions.pop(sid, None)
            if s is not None:
                n += 1
                if s[2] >= 0:
                    self._free.append(s[2])
        return n


class InstantDrafter:
    """A drafter engine for :class:`draft_service.servicer.DraftServiceServicer` that answers at once:
    a tree of ``budget + 1`` nodes (a chain of ``max_depth``: DDTree's shape does not matter here)
    starting with a chain of ``ACCEPT + 1`` nodes."""

    def __init__(self, target_fingerprint: str):
        from types import SimpleNamespace

        self.drafter = SimpleNamespace(
            config=SimpleNamespace(vocab_size=VOCAB, block_size=BLOCK, hidden_size=HIDDEN, num_layers=3,
                                   target_fingerprint=target_fingerprint, target_layer_ids=list(LAYERS),
                                   mask_token_id=16),
            device="cpu" if RING[0] else "cuda:0")   # (a shared-file ring maps on the CPU only)
        self.max_sessions, self.max_context = MAX_SESSIONS, 8192
        self.sessions: dict[str, int] = {}
        self.clock = _Clock()
        self._parents: dict[tuple[int, int], list[int]] = {}
        if RING[0]:
            _one_thread()

    @property
    def free_slots(self) -> int:
        return self.max_sessions - len(self.sessions)

    def session_length(self, sid):
        return self.sessions.get(sid)

    def release(self, session_ids):
        return sum(self.sessions.pop(sid, None) is not None for sid in session_ids)

    def _shape(self, nodes: int, depth: int) -> list[int]:
        key = (nodes, depth)
        p = self._parents.get(key)
        if p is None:
            chain = min(depth, nodes - 1)
            p = [-1] + list(range(chain)) + [min(i % 3, chain - 1) for i in range(nodes - 1 - chain)]
            self._parents[key] = p
        return p

    def propose_batch(self, items):
        from draft_service.batched import ProposeOutcome
        from runtime.errors import FailedPrecondition, Reason, ResourceExhausted

        t0 = time.thread_time()
        out = []
        sessions = self.sessions
        reads = []   # (committed length, ring, slot, rows) of the ring items
        for it in items:
            rows = it.features.shape[0] if it.features is not None else 0
            ring = getattr(it, "ring", None)
            if ring is not None:   # (read below, all items' at once, as the batched engine's gather does)
                if ring[0] is None:
                    out.append(FailedPrecondition("no ring", reason=Reason.RING_UNAVAILABLE))
                    continue
                reads.append((it.committed_length,) + tuple(ring))
                rows += ring[2]
            held = sessions.get(it.session_id)
            if held is None and len(sessions) >= self.max_sessions:
                out.append(ResourceExhausted("no free slot", reason=Reason.NO_FREE_SLOT))
                continue
            if it.committed_length != (held or 0) + rows:
                out.append(FailedPrecondition("length mismatch", reason=Reason.LENGTH_MISMATCH))
                continue
            sessions[it.session_id] = it.committed_length
            depth = it.max_depth or BLOCK - 1
            nodes = it.budget + 1 if it.budget > 1 and it.top_k > 1 else depth + 1
            parents = self._shape(nodes, depth)
            root = it.root_token
            out.append(ProposeOutcome([root] + [(root + i) % VOCAB for i in range(1, nodes)], parents, it.committed_length))
        if reads:
            ring = reads[0][1]
            ring.gather(ring.rows_of([r[2] for r in reads], [r[0] for r in reads], [r[3] for r in reads]))
        self.clock.s += time.thread_time() - t0
        if DEVICE_S[1]:
            time.sleep(DEVICE_S[1])
        return out


# ---------------------------------------------------------------------------------------------
# the service processes

def _control(engine_clock: _Clock | None, extra=None, on_quit=None):
    """Serve ``engine`` (the fake engine's CPU seconds so far) and ``profile`` on stdin/stdout lines;
    ``on_quit`` runs before the process exits (``os._exit``: no atexit handlers)."""
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "engine":
            print(json.dumps({"engine_s": engine_clock.s if engine_clock else 0.0, "cpu_s": time.process_time(),
                              "sys_s": os.times().system,
                              **(extra() if extra else {})}), flush=True)
        elif cmd == "cprofile-start":
            _PROF["threads"] = {}
            _PROF["on"] = True
            print("{}", flush=True)
        elif cmd.startswith("cprofile-dump "):
            import pstats

            _PROF["on"] = False
            profiles, _PROF["threads"] = list(_PROF["threads"].values()), {}
            path = cmd.split(" ", 1)[1]
            stats = None
            for prof in profiles:   # (a call still running keeps its own thread's profile: left out)
                prof.create_stats()
                if prof.stats:
                    stats = pstats.Stats(prof) if stats is None else stats.add(prof)
            with open(path + ".txt", "w") as f:
                if stats is not None:
                    stats.dump_stats(path + ".prof")
                    stats.stream = f
                    stats.sort_stats("tottime").print_stats(30)
                else:   # (e.g. the drafter while every request decodes plainly)
                    f.write("no calls profiled\n")
            print("{}", flush=True)
        elif cmd == "quit":
            break
    if on_quit is not None:
        on_quit()
    os._exit(0)


def serve_target(local_hop: bool) -> None:
    from dflash_grpc import serving
    from dflash_grpc.v1 import common_pb2, target_pb2_grpc
    from runtime.config import worker_threads
    from runtime.fingerprint import tokenizer_fingerprint
    from runtime.gguf_loader import open_gguf
    from runtime.defaults import default_model_path
    from runtime.owners import Owners
    from runtime.step_loop import StepLoop
    from target_service.servicer import FEATURES, TargetServicer

    engine = InstantTarget()
    info = common_pb2.ModelInfo(model_name="instant", architecture="llama", vocab_size=VOCAB,
                                tokenizer_fingerprint=tokenizer_fingerprint(open_gguf(default_model_path())),
                                model_fingerprint="instant-target", max_context=engine.max_context,
                                max_tree_width=engine.max_tree_width, max_tree_depth=engine.max_tree_depth,
                                max_sessions=engine.max_sessions, hidden_size=HIDDEN, num_layers=30,
                                features=list(FEATURES), device="cuda:0")
    servicer = TargetServicer(StepLoop(engine, name="target", owners=Owners()), info)
    servicer._verify = _profiled_gen(servicer._verify)   # (--cprofile: a Verify stream's work per request)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=worker_threads(0, engine.max_sessions),
                                          local_hop=local_hop)
    servicer.info.local_endpoint = serving.local_endpoint(server)
    print(json.dumps({"port": port}), flush=True)
    _control(engine.clock, on_quit=lambda: engine.ring.close() if engine.ring is not None else None)   # (a shared file)


def serve_draft(local_hop: bool) -> None:
    from dflash_grpc import serving
    from dflash_grpc.v1 import draft_pb2_grpc
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer
    from runtime.config import worker_threads
    from runtime.fingerprint import tokenizer_fingerprint
    from runtime.gguf_loader import open_gguf
    from runtime.defaults import default_model_path

    engine = InstantDrafter("instant-target")
    servicer = DraftServiceServicer(engine, model_name="instant-drafter", model_fingerprint="instant-drafter",
                                    tokenizer_fingerprint=tokenizer_fingerprint(open_gguf(default_model_path())))
    servicer.propose = _profiled(servicer.propose)   # (--cprofile: a Propose's work)

    def add(server):
        # as the draft service's main registers it (older checkouts: the generated registration)
        import draft_service.servicer as ds

        getattr(ds, "add_to_server", draft_pb2_grpc.add_DraftServiceServicer_to_server)(servicer, server)
        return [SERVICE_NAME]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=worker_threads(0, engine.max_sessions),
                                          local_hop=local_hop)
    servicer.local_endpoint = serving.local_endpoint(server)
    print(json.dumps({"port": port}), flush=True)
    _control(engine.clock)


def serve_orchestrator(target: str, draft: str, local_hop: bool, stream_interval_ms: float,
                       stream_hold_max_ms: float | None = None, settings: list[str] | None = None,
                       grpc_server: str | None = None) -> None:
    """As ``python -m orchestrator --target TARGET --draft DRAFT`` (CUDA defaults: the target says cuda:0);
    ``grpc_server``: its ``--grpc-server`` (None: the checkout's default; older checkouts: threads,
    ``--grpc-server`` ignored)."""
    import uuid

    from dflash_grpc import serving
    from dflash_grpc.v1 import generation_pb2_grpc
    from orchestrator import peers
    from orchestrator.config import OrchestratorConfig
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Scheduler
    from orchestrator.servicer import GenerationServicer, default_tree
    from runtime.config import worker_threads
    from runtime.defaults import default_model_path
    from runtime.owners import EPOCH_KEY, OWNER_KEY
    from runtime.tokenizer import GGUFTokenizer

    sys.setswitchinterval(0.001)
    serving.add_client_metadata([(OWNER_KEY, f"orchestrator@pid{os.getpid()}"), (EPOCH_KEY, uuid.uuid4().hex)])
    peers.LOCAL_HOP = local_hop
    tpeer = TargetPeer(target)
    tpeer.wait_info(30)
    dpeer = DraftPeer(draft)
    info = tpeer.info()
    cfg = OrchestratorConfig(target=target, draft=draft).resolved(info.device, info.max_sessions, info.max_context)
    extra = {"stream_interval_ms": stream_interval_ms} if stream_interval_ms else {}   # (older checkouts: none)
    if stream_hold_max_ms is not None:
        extra["stream_hold_max_ms"] = stream_hold_max_ms
    for kv in settings or ():   # --scheduler-set NAME=VALUE: a Scheduler keyword (a number, else a string)
        name, _, value = kv.partition("=")
        try:
            extra[name] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:      # (e.g. draft_policy=measured)
            extra[name] = value
    kwargs = dict(max_sessions=cfg.max_sessions, max_queue=cfg.max_queue, step_nodes=cfg.step_nodes,
                  step_timeout=cfg.step_timeout, history_bytes=cfg.history_bytes)
    sched = Scheduler(tpeer, dpeer, **{**kwargs, **extra})
    sched._tick = _profiled(sched._tick)   # (--cprofile: the scheduler thread's ticks)
    servicer = GenerationServicer(tpeer, dpeer, GGUFTokenizer.from_gguf(default_model_path()), cfg.max_tokens,
                                  default_tree(cfg), sched)

    workers = worker_threads(0, cfg.max_sessions + cfg.max_queue)
    try:   # as python -m orchestrator serves it
        from orchestrator.servicer import serve_generation
    except ImportError:   # (an older checkout: the thread server only)
        def add(server):
            generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
            return ["dflash_grpc.v1.GenerationService"]

        server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=workers, max_receive_bytes=cfg.max_request_bytes)
    else:
        server, _, port, _ = serve_generation(servicer, "127.0.0.1:0", grpc_server or cfg.grpc_server,
                                              max_streams=workers, max_receive_bytes=cfg.max_request_bytes)
    print(json.dumps({"port": port}), flush=True)
    def policy() -> dict:   # the measured policy's ticks by mode and requests by start (--scheduler-set draft_policy=measured)
        pol = getattr(sched, "policy", None)
        if pol is None:
            return {}
        return {"policy_ticks": dict(pol.choices), "policy_admissions": dict(pol.admissions),
                "policy_demoted": getattr(sched, "demoted", 0)}

    _control(None, lambda: {"ticks": sched.ticks, "items": sched.batched_items, "fallbacks": sched.fallbacks,
                            "ring_rows": getattr(sched, "ring_rows_sent", 0), **policy()})


# ---------------------------------------------------------------------------------------------
# the driver (and the clients)

class Service:
    """A service process of this tool, with its control pipe."""

    def __init__(self, name: str, args: list[str]):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", name, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} failed to start")
        self.port = json.loads(line)["port"]

    def ask(self, cmd: str = "engine") -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def threads(self) -> dict[str, float]:
        """CPU seconds per thread name (live threads; ``/proc/PID/task/*/schedstat``)."""
        out: dict[str, float] = defaultdict(float)
        base = f"/proc/{self.proc.pid}/task"
        for tid in os.listdir(base):
            try:
                with open(f"{base}/{tid}/comm") as f:
                    name = re.sub(r"[-_]?\d+$", "", f.read().strip()) or "?"
                with open(f"{base}/{tid}/schedstat") as f:
                    out[name] += int(f.read().split()[0]) / 1e9
            except OSError:
                continue
        return out

    def stop(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _clients(port: int, n: int, tokens: int, spec: bool, on_started, on_first_done) -> dict:
    """``n`` Generate streams of ``tokens`` tokens at once; ``on_started()`` runs once every stream
    has had its first message, ``on_first_done()`` when the first stream ends (the steady window:
    every stream decoding). Returns the tokens and messages received, the messages of the
    window, and the gaps between a stream's messages within it (seconds)."""
    import grpc

    from dflash_grpc.transport import GRPC_OPTIONS
    from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc

    state = {"started": 0, "done": 0, "msgs": 0, "window_msgs": 0, "tokens": 0, "gaps": []}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        req = generation_pb2.GenerateRequest(prompt="def fibonacci(n):", max_tokens=tokens, ignore_eos=True)
        req.speculative.enabled = spec

        async def one() -> None:
            first, last = True, 0.0
            async for msg in stub.Generate(req, timeout=600):
                state["tokens"] += len(msg.token_ids)
                state["msgs"] += 1
                now = time.perf_counter()
                if state["started"] == n and not state["done"]:
                    state["window_msgs"] += 1
                    if not first and msg.token_ids:
                        state["gaps"].append(now - last)
                if msg.token_ids:
                    last = now
                if first:
                    first = False
                    state["started"] += 1
                    if state["started"] == n:
                        on_started()
            state["done"] += 1
            if state["done"] == 1 and state["started"] == n:   # (else no window: some stream had not begun)
                on_first_done()

        await asyncio.gather(*(one() for _ in range(n)))
    return state


def run_level(services: dict[str, Service], orch: Service, n: int, tokens: int, spec: bool, want_threads: bool,
              spy_dir: str | None, tag: str, prof_dir: str | None = None) -> dict:
    spies = []
    if prof_dir:
        os.makedirs(prof_dir, exist_ok=True)
        for s in services.values():
            s.ask("cprofile-start")
    if spy_dir:
        os.makedirs(spy_dir, exist_ok=True)
        for name, s in services.items():
            spies.append(subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-f", "raw", "--gil",
                                           "-r", "500", "--nonblocking", "-p", str(s.proc.pid),
                                           "-o", os.path.join(spy_dir, f"{name}-{tag}.txt")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)

    def snap() -> dict:
        return {k: (s.ask(), s.threads() if want_threads else {}, time.perf_counter()) for k, s in services.items()}

    marks = {}
    before = snap()
    t0 = time.perf_counter()
    state = asyncio.run(_clients(orch.port, n, tokens, spec, lambda: marks.setdefault("start", snap()),
                                 lambda: marks.setdefault("end", snap())))
    wall = time.perf_counter() - t0
    after = snap()
    for p in spies:
        p.send_signal(2)
        p.wait(30)
    if prof_dir:   # the whole level's profile of each service (its start and end too), then off
        for name, s in services.items():
            s.ask(f"cprofile-dump {os.path.join(os.path.abspath(prof_dir), f'{name}-{tag}')}")
    if state["tokens"] != n * tokens:
        raise RuntimeError(f"{n} streams received {state['tokens']} tokens, not {n * tokens}")

    def counts(a, b):
        o0, o1 = a["orchestrator"][0], b["orchestrator"][0]
        return o1["ticks"] - o0["ticks"], o1["items"] - o0["items"]

    ticks, items = counts(before, after)
    row = {"streams": n, "mode": "spec" if spec else "ar", "tok_s": state["tokens"] / wall, "wall_s": wall,
           "ticks": ticks, "items": items, "msgs_item_run": state["msgs"] / max(items, 1),
           "fallbacks": after["orchestrator"][0]["fallbacks"] - before["orchestrator"][0]["fallbacks"],
           "ring_rows": after["orchestrator"][0].get("ring_rows", 0) - before["orchestrator"][0].get("ring_rows", 0)}
    o0, o1 = before["orchestrator"][0], after["orchestrator"][0]
    for key in ("policy_ticks", "policy_admissions"):   # per mode, this level's
        if key in o1:
            row[key] = {m: v - o0.get(key, {}).get(m, 0) for m, v in o1[key].items()}
    if "policy_demoted" in o1:
        row["policy_demoted"] = o1["policy_demoted"] - o0.get("policy_demoted", 0)
    # the steady window (every stream decoding); the whole run (prefills, first and last messages too)
    start, end = (marks["start"], marks["end"]) if "end" in marks else (before, after)
    wticks, witems = counts(start, end)
    if witems < items / 4:   # the streams began too far apart for a steady window: the whole run
        start, end = before, after
        wticks, witems = counts(start, end)
    row["window"] = start is not before
    row.update(window_ticks=wticks, window_items=witems, items_tick=witems / max(wticks, 1),
               ms_tick=(end["orchestrator"][2] - start["orchestrator"][2]) / max(wticks, 1) * 1e3,
               msgs_item=state["window_msgs"] / max(witems, 1))
    gaps = sorted(state["gaps"])
    if gaps:   # between a stream's messages (with tokens) in the window: its inter-token latency as streamed
        row.update(gap_p50_ms=gaps[len(gaps) // 2] * 1e3, gap_p99_ms=gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3)
    for k in services:
        for suffix, (a, b, m) in (("", (start, end, witems)), ("_run", (before, after, items))):
            cpu = b[k][0]["cpu_s"] - a[k][0]["cpu_s"]
            eng = b[k][0]["engine_s"] - a[k][0]["engine_s"]
            row[f"{k}_us{suffix}"] = (cpu - eng) / max(m, 1) * 1e6
            row[f"{k}_engine_us{suffix}"] = eng / max(m, 1) * 1e6
            if "sys_s" in b[k][0] and "sys_s" in a[k][0]:   # the kernel's share (syscalls, wake-ups, page faults)
                row[f"{k}_sys_us{suffix}"] = (b[k][0]["sys_s"] - a[k][0]["sys_s"]) / max(m, 1) * 1e6
        if want_threads:
            t0s, t1s = start[k][1], end[k][1]
            row[f"{k}_threads"] = {name: round((t1s.get(name, 0) - t0s.get(name, 0)) / max(witems, 1) * 1e6, 1)
                                   for name in t1s if t1s.get(name, 0) - t0s.get(name, 0) > 1e-4}
    return row


def summarize(specs: list[str]) -> None:
    """Print median [min, max] of each service's us/item per mode and level, for each ``LABEL=GLOB``
    of ``--json`` files (one file per repeat), labels side by side."""
    import glob

    rows: dict[str, list[dict]] = {}
    for spec in specs:
        label, _, pattern = spec.partition("=")
        rows[label] = [json.loads(line) for path in sorted(glob.glob(pattern)) for line in open(path) if line.strip()]

    def cell(rs: list[dict], key: str) -> str:
        xs = [r[key] for r in rs if key in r]
        return f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]" if xs else "-"

    levels = sorted({(r["mode"], r["streams"]) for rs in rows.values() for r in rs}, key=lambda x: (x[0], x[1]))
    for window, suffix in (("steady window (every stream decoding)", ""), ("whole run", "_run")):
        print(f"\n## host us per item per tick, {window}: median [min, max] of {', '.join(f'{k}: {len(v)} rows' for k, v in rows.items())}")
        for svc in ("orchestrator", "target", "draft"):
            print(f"\n{svc}\n| mode | streams | " + " | ".join(rows) + " |\n|---|---|" + "---|" * len(rows))
            for mode, n in levels:
                print(f"| {mode} | {n} | " + " | ".join(cell([r for r in rs if r["mode"] == mode and r["streams"] == n],
                                                          f"{svc}_us{suffix}") for rs in rows.values()) + " |")
    print("\n## tokens/s, messages per item, ms between a stream's messages p50 / p99 (steady window)\n| mode | streams | "
          + " | ".join(f"{k} tok/s | {k} msgs/item | {k} gap p50 | {k} gap p99" for k in rows) + " |\n|---|---|"
          + "---|---|---|---|" * len(rows))
    for mode, n in levels:
        cells = []
        for rs in rows.values():
            sel = [r for r in rs if r["mode"] == mode and r["streams"] == n]
            cells += [cell(sel, "tok_s"), cell(sel, "msgs_item"), cell(sel, "gap_p50_ms"), cell(sel, "gap_p99_ms")]
        print(f"| {mode} | {n} | " + " | ".join(cells) + " |")
    # the orchestrator's threads (--threads): its gRPC server's (the thread server's handlers and its
    # _serve thread; the asyncio server's loop, grpc's poller and the tokenizing workers), the ticks
    groups = {"server": ("pool-worker", "_serve", "grpc-aio", "_poll_wrapper", "generate-open", "grpc-aio-sync"),
              "scheduler": ("scheduler",)}
    if any("orchestrator_threads" in r for rs in rows.values() for r in rs):
        print("\n## the orchestrator's us per item by thread (steady window; server: the gRPC server's threads, "
              "Generate handlers included; scheduler: the ticks)\n| mode | streams | "
              + " | ".join(f"{k} {t}" for k in rows for t in groups) + " |\n|---|---|" + "---|" * (len(rows) * len(groups)))
        for mode, n in levels:
            cells = []
            for rs in rows.values():
                sel = [r for r in rs if r["mode"] == mode and r["streams"] == n and "orchestrator_threads" in r]
                for names in groups.values():
                    xs = [sum(r["orchestrator_threads"].get(t, 0.0) for t in names) for r in sel]
                    cells.append(f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]" if xs else "-")
            print(f"| {mode} | {n} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("target", "draft", "orchestrator"), help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--draft", help=argparse.SUPPRESS)
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--modes", default="ar,spec")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-local-hop", action="store_true", help="gRPC between the services (default: the same-host hop)")
    ap.add_argument("--stream-interval-ms", type=float, default=0.0,
                    help="the orchestrator's --stream-interval-ms (tokens held up to this long go out as one message)")
    ap.add_argument("--stream-hold-max-ms", type=float, default=None,
                    help="the orchestrator's --stream-hold-max-ms (the adaptive hold's most; 0: off; default: its default)")
    ap.add_argument("--scheduler-set", action="append", default=[], metavar="NAME=VALUE",
                    help="a keyword of the orchestrator's Scheduler (a number, else a string), e.g. history_bytes=0, "
                         "stream_host_share=0.1 or draft_policy=measured (repeatable; default: the config's defaults)")
    ap.add_argument("--grpc-server", choices=("aio", "threads"), default=None,
                    help="the orchestrator's --grpc-server (default: the checkout's own default)")
    ap.add_argument("--device-ms", default="0,0", metavar="VERIFY,PROPOSE",
                    help="milliseconds each fake engine's step sleeps after its work, as a GPU's device time would "
                         "(no CPU; default 0,0: instant)")
    ap.add_argument("--ring", action="store_true",
                    help="feature rows through a feature ring (a shared file) instead of the messages")
    ap.add_argument("--hidden", type=int, default=HIDDEN,
                    help="hidden size of the fake pair: the width of each of the 5 feature layers' rows that the "
                         "target returns and the orchestrator passes on (default SmolLM2's 576; a small value "
                         "takes the feature bytes out of the services' host time)")
    ap.add_argument("--threads", action="store_true", help="CPU per item split by thread name")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="py-spy record -f raw of each service per level")
    ap.add_argument("--cprofile", default=None, metavar="DIR",
                    help="cProfile per level of the scheduler's ticks, the target's Verify stream and the drafter's "
                         "Propose (a profile per thread, merged; wall-clock time, so waits show as the calls that "
                         "wait: poll, readv, the fake device's sleep) -> DIR/<service>-<mode>-<streams>-<rep>.{prof,txt}")
    ap.add_argument("--json", default=None, metavar="FILE", help="every row as JSON lines")
    ap.add_argument("--summary", nargs="+", metavar="LABEL=GLOB",
                    help="no run: median [min, max] per level of the --json files of each label (repeats, checkouts)")
    args = ap.parse_args()
    if args.summary:
        summarize(args.summary)
        return 0
    hop = not args.no_local_hop
    DEVICE_S[:] = [float(x) / 1e3 for x in args.device_ms.split(",")]
    globals()["HIDDEN"] = args.hidden   # (read by the fake engines and configs of every role)
    RING[0] = args.ring
    if args.role:
        _name_threads()
        from dflash_grpc import serving

        if hasattr(serving, "tune_malloc"):   # as each service's main does (older checkouts: none)
            serving.tune_malloc()
        if args.role == "target":
            serve_target(hop)
        elif args.role == "draft":
            serve_draft(hop)
        else:
            serve_orchestrator(args.target, args.draft, hop, args.stream_interval_ms, args.stream_hold_max_ms,
                               args.scheduler_set, args.grpc_server)
        return 0

    flag = ([] if hop else ["--no-local-hop"]) + ["--device-ms", args.device_ms, "--hidden", str(args.hidden)] + \
        (["--ring"] if args.ring else [])
    target = Service("target", flag)
    draft = Service("draft", flag)
    hold = [] if args.stream_hold_max_ms is None else ["--stream-hold-max-ms", str(args.stream_hold_max_ms)]
    hold += [f"--scheduler-set={kv}" for kv in args.scheduler_set]
    hold += ["--grpc-server", args.grpc_server] if args.grpc_server else []
    orch = Service("orchestrator", [*flag, *hold, "--stream-interval-ms", str(args.stream_interval_ms), "--target", f"127.0.0.1:{target.port}", "--draft", f"127.0.0.1:{draft.port}"])
    services = {"orchestrator": orch, "target": target, "draft": draft}
    rows = []
    try:
        asyncio.run(_clients(orch.port, 2, 8, True, lambda: None, lambda: None))   # warm-up: streams opened, imports done
        print(f"# host_per_item: {args.tokens} tokens per stream, {'same-host hop' if hop else 'gRPC'} between services, "
              f"stream interval {args.stream_interval_ms:g} ms, device ms (verify, propose) {args.device_ms}, "
              f"{os.cpu_count()} CPUs; us/item = service CPU (less its fake engine's) / items verified", flush=True)
        print(f"{'':21} {'steady window: every stream decoding':^66} | {'whole run':^20}")
        print(f"{'mode':5} {'streams':>7} {'rep':>3} {'tok/s':>7} {'ms/tick':>8} {'items/tick':>10} "
              f"{'msgs/item':>9} {'orch us':>8} {'target us':>9} {'draft us':>8} | {'orch':>6} {'target':>6} {'draft':>6} | "
              f"{'gap p50/p99 ms':>14}",
              flush=True)
        for mode in args.modes.split(","):
            for n in (int(x) for x in args.streams.split(",")):
                for rep in range(args.repeats):
                    row = run_level(services, orch, n, args.tokens, mode == "spec", args.threads, args.py_spy,
                                    f"{mode}-{n}-{rep}", args.cprofile)
                    row["rep"] = rep
                    rows.append(row)
                    print(f"{mode:5} {n:7d} {rep:3d} {row['tok_s']:7.0f} {row['ms_tick']:8.2f} {row['items_tick']:10.1f} "
                          f"{row['msgs_item']:9.2f} {row['orchestrator_us']:8.1f} {row['target_us']:9.1f} "
                          f"{row['draft_us']:8.1f} | {row['orchestrator_us_run']:6.1f} {row['target_us_run']:6.1f} "
                          f"{row['draft_us_run']:6.1f} | {row.get('gap_p50_ms', 0):6.1f}/{row.get('gap_p99_ms', 0):<6.1f}",
                          flush=True)
                    if "policy_ticks" in row:
                        print(f"      draft policy: ticks {row['policy_ticks']}, requests started "
                              f"{row.get('policy_admissions')}, demoted {row.get('policy_demoted', 0)}", flush=True)
                    if args.threads:
                        for k in services:
                            sys_us = f" (of which in the kernel {row[f'{k}_sys_us']:.1f})" if f"{k}_sys_us" in row else ""
                            print(f"      {k}{sys_us}: " + ", ".join(f"{name} {v}" for name, v in
                                                          sorted(row[f"{k}_threads"].items(), key=lambda x: -x[1])),
                                  flush=True)
        if args.repeats > 1:
            print("\n# median [min, max] over repeats")
            for mode in args.modes.split(","):
                for n in (int(x) for x in args.streams.split(",")):
                    rs = [r for r in rows if r["mode"] == mode and r["streams"] == n]
                    cell = lambda key: (f"{statistics.median(r[key] for r in rs):.1f} "
                                        f"[{min(r[key] for r in rs):.1f}, {max(r[key] for r in rs):.1f}]")
                    print(f"{mode:5} {n:7d}  tok/s {cell('tok_s')}  orch {cell('orchestrator_us')}  "
                          f"target {cell('target_us')}  draft {cell('draft_us')}", flush=True)
    finally:
        for s in (orch, draft, target):
            s.stop()
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
