"""Serving many clients under ``dflash-grpc serve``, as users run it (issue: serving for real).

* Load: ``DFLASH_LOAD_CLIENTS`` concurrent clients (default 16: twice the slots) on loopback for
  ``DFLASH_LOAD_SECONDS`` (default 20 s; the issue's "few minutes" with ``DFLASH_LOAD_SECONDS=180``
  and 32 clients) against 8 target slots: every stream equals its
  own target-only reference at temperature 0; the queue absorbs the clients beyond the slots;
  sessions and slots back to zero at the end; the services' RSS flat over the second half.
* Faults: the draft service killed under load (every stream completes, lossless, the fallback
  counted; ``serve`` restarts it and decoding is speculative again); the target killed under load
  (every stream ends UNAVAILABLE within 5 s, after a prefix of its reference; ``serve`` restarts
  it and new requests succeed).

The module's tests share one ``serve`` process and run in file order.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest

import client as sdk
from client.launcher import free_ports
from dflash_grpc import serving
from dflash_grpc.v1 import target_pb2, target_pb2_grpc
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow

SLOTS = 8
CLIENTS = int(os.environ.get("DFLASH_LOAD_CLIENTS", "16"))
N_TOKENS = 8
LOAD_SECONDS = float(os.environ.get("DFLASH_LOAD_SECONDS", "20"))


class Serve:
    """A ``dflash-grpc serve`` process and the addresses of its services."""

    def __init__(self, smollm_path: str):
        self.ports = free_ports(3)
        self.addr = {name: f"127.0.0.1:{p}" for name, p in zip(("orchestrator", "target", "draft"), self.ports)}
        self.stderr = open(os.devnull, "w") if os.environ.get("DFLASH_QUIET_SERVE") else None
        self.log_path = f"/tmp/dflash-serve-{os.getpid()}.log"
        self.log = open(self.log_path, "w+")
        # our own token, so that the test can look at the target (serve's own is private)
        self.token = secrets.token_urlsafe(32)
        self.token_file = f"/tmp/dflash-serve-{os.getpid()}.token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "client.cli", "serve", "--model", smollm_path, "--port", str(self.ports[0]),
             "--auth-token-file", self.token_file,
             "--target-port", str(self.ports[1]), "--draft-port", str(self.ports[2]),
             "--target-args", f"--max-sessions {SLOTS} --max-context 512",
             "--orchestrator-args", "--max-queue 64"],
            stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)

    def child(self, module: str) -> psutil.Process:
        """The live child process running ``python -m <module>``."""
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if module in c.cmdline() and c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                    return c
            except psutil.NoSuchProcess:
                continue
        raise LookupError(module)

    def rss(self) -> int:
        """Resident bytes of the three services together."""
        return sum(self.child(m).memory_info().rss for m in ("target_service", "draft_service", "orchestrator"))

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        os.unlink(self.token_file)


@pytest.fixture(scope="module")
def serve(smollm_path, request):
    s = Serve(smollm_path)
    try:
        # meanwhile the references (``refs``, ~10 s of one core) are decoded in this process: the
        # three services take ~8 s to start and leave part of the two cores idle while they do
        request.getfixturevalue("refs")
        serving.wait_healthy(s.addr["orchestrator"], timeout=300)
        with sdk.Client(s.addr["orchestrator"], timeout=120) as c:
            deadline = time.monotonic() + 60
            while not c.info().drafter.available:  # the orchestrator may have started first
                assert time.monotonic() < deadline, "drafter never became available"
                time.sleep(0.5)
        yield s
    finally:
        s.stop()


#: tokens of the target-only references that the fault tests compare with (their first SLOTS prompts)
FAULT_TOKENS = 16


@pytest.fixture(scope="module")
def refs(smollm_model, smollm_tokenizer):
    """Target-only greedy tokens of each prompt: ``FAULT_TOKENS`` for the first ``SLOTS`` prompts
    (the fault tests' streams), ``N_TOKENS`` for the others (the load test's). Decoded in this
    process, independently of the services under test, by the batched engine with every prompt
    in each step (on the CPU ~2.5x faster than one prompt at a time through ``serve``'s
    reference engine; tests/test_batched_engine.py shows the two engines' tokens equal)."""
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling

    prompts = [smollm_tokenizer.encode(p) for p in PROMPTS]
    lengths = [FAULT_TOKENS if i < SLOTS else N_TOKENS for i in range(len(prompts))]
    engine = BatchedEngine(smollm_model, max_sessions=len(prompts), max_context=128, max_tree_width=1, max_tree_depth=1)
    greedy = Sampling.checked(0.0, 0, 0.0, 0)
    outs = [[engine.prefill(f"r{i}", ids, greedy, []).first_token] for i, ids in enumerate(prompts)]
    while live := [i for i, out in enumerate(outs) if len(out) < lengths[i]]:
        for i, r in zip(live, engine.verify_batch([(f"r{i}", [outs[i][-1]], [-1]) for i in live])):
            outs[i].append(r.bonus_token)
    engine.release([f"r{i}" for i in range(len(prompts))])
    return list(zip(prompts, outs))


def _target_free_slots(serve: Serve) -> int:
    with serving.channel(serve.addr["target"]) as ch:  # the target takes calls with serve's token only
        return target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.TargetInfoRequest(), timeout=10,
                                                          metadata=[("authorization", serving.bearer(serve.token))]).free_slots


def test_many_clients_lossless_and_nothing_leaks(serve, refs):
    errors: list[str] = []
    done = [0] * CLIENTS
    rss: list[tuple[float, int]] = []
    stop = time.monotonic() + LOAD_SECONDS

    def client(i: int) -> None:
        with sdk.Client(serve.addr["orchestrator"], timeout=600) as c:
            n = 0
            while time.monotonic() < stop:
                ids, ref = refs[(i + n) % len(refs)]
                n += 1
                try:
                    got = c.generate(tokens=ids, max_tokens=N_TOKENS, ignore_eos=True).token_ids
                except sdk.DFlashError as e:
                    errors.append(f"client {i}: {e}")
                    return
                if got != ref[:N_TOKENS]:
                    errors.append(f"client {i}: {got} != {ref[:N_TOKENS]}")
                done[i] += 1

    with sdk.Client(serve.addr["orchestrator"], timeout=30) as c:
        s0 = c.info().scheduler
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    with sdk.Client(serve.addr["orchestrator"], timeout=30) as c:
        peak_queue = 0
        while any(t.is_alive() for t in threads):
            peak_queue = max(peak_queue, c.info().scheduler.queued_requests)
            rss.append((time.monotonic() - t0, serve.rss()))
            time.sleep(1.0)
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert min(done) >= 1, done
        assert peak_queue > 0, f"{CLIENTS} clients on {SLOTS} slots never queued"
        time.sleep(0.5)
        sched = c.info().scheduler
        assert sched.active_sessions == 0 and sched.queued_requests == 0
        ticks = sched.ticks - s0.ticks
        mean_batch = (sched.mean_batch * sched.ticks - s0.mean_batch * s0.ticks) / ticks
        assert mean_batch > SLOTS / 2, f"requests were not batched: {mean_batch:.2f} per tick"
    assert _target_free_slots(serve) == SLOTS
    half = [r for t, r in rss if t >= LOAD_SECONDS / 2]
    growth = (max(half[len(half) // 2:]) - half[0]) / half[0]
    print(f"requests {sum(done)} in {LOAD_SECONDS:.0f} s, {mean_batch:.2f} per tick, peak queue {peak_queue}, RSS {half[0] >> 20} -> "
          f"{max(half[len(half) // 2:]) >> 20} MiB over the second half ({growth:+.1%})")
    assert growth < 0.05


def _run_streams(addr: str, refs, n: int, max_tokens: int, started: threading.Event | None = None):
    """``n`` concurrent streams; returns per stream (tokens received, error or None, end time)."""
    out = [None] * n
    first = [threading.Event() for _ in range(n)]

    def one(i: int) -> None:
        ids, _ = refs[i % len(refs)]
        got, err = [], None
        try:
            with sdk.Client(addr, timeout=300) as c:
                for chunk in c.stream(tokens=ids, max_tokens=max_tokens, ignore_eos=True):
                    got += chunk.token_ids
                    first[i].set()
        except sdk.DFlashError as e:
            err = e
        first[i].set()
        out[i] = (got, err, time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for e in first:
        e.wait(300)
    return threads, out


def test_draft_service_killed_under_load(serve, refs):
    with sdk.Client(serve.addr["orchestrator"], timeout=60) as c:
        before = c.stats().draft_fallbacks
        threads, out = _run_streams(serve.addr["orchestrator"], refs, SLOTS, FAULT_TOKENS)
        serve.child("draft_service").send_signal(signal.SIGKILL)
        for t in threads:
            t.join(300)
        for i, (got, err, _) in enumerate(out):
            assert err is None, err
            assert got == refs[i % len(refs)][1][:FAULT_TOKENS]
        assert c.stats().draft_fallbacks > before
        # `serve` restarts the drafter; decoding is speculative again once it is back
        deadline = time.monotonic() + 120
        while not c.info().drafter.available:
            assert time.monotonic() < deadline, serve.output()[-2000:]
            time.sleep(0.5)
        assert "service 'draft' exited" in serve.output() and "restarting" in serve.output()
        ids, ref = refs[0]
        res = c.generate(tokens=ids, max_tokens=FAULT_TOKENS, ignore_eos=True)
        assert res.token_ids == ref[:FAULT_TOKENS] and res.stats.drafts > 0


def test_target_killed_under_load(serve, refs):
    addr = serve.addr["orchestrator"]
    threads, out = _run_streams(addr, refs, SLOTS, FAULT_TOKENS)
    killed = time.monotonic()
    serve.child("target_service").send_signal(signal.SIGKILL)
    for t in threads:
        t.join(30)
    for i, (got, err, ended) in enumerate(out):
        ref = refs[i % len(refs)][1]
        assert got == ref[:len(got)], "tokens before the failure must be the target's"
        if err is not None:  # a stream may have finished before the kill
            assert err.code == grpc.StatusCode.UNAVAILABLE, err
            # promptly, not at its deadline (5 s: a loaded 2-core runner has taken 2-4 s)
            assert ended - killed < 5.0, f"stream {i} ended {ended - killed:.1f} s after the kill"
    assert any(err is not None for _, err, _ in out)
    # `serve` restarts the target; new requests succeed once it is back
    with sdk.Client(addr, timeout=60) as c:
        deadline = time.monotonic() + 180
        while True:
            try:
                res = c.generate(tokens=refs[1][0], max_tokens=8, ignore_eos=True)
                break
            except sdk.UnavailableError:
                assert time.monotonic() < deadline, serve.output()[-2000:]
                time.sleep(1.0)
        assert res.token_ids == refs[1][1][:8]


# ------------------------------------------------------------------------------------------------ the heap


def test_gc_pauses_counts_each_generation_and_logs_long_ones(caplog):
    """serving.GcPauses, the gc.callbacks hook freeze_heap installs: per generation the collections
    and the longest pause; a pause of at least GC_PAUSE_LOG_S is logged (info, with its
    generation and milliseconds), a shorter one is not; a stop without a start is ignored."""
    import logging

    from dflash_grpc import serving

    now = [0.0]
    pauses = serving.GcPauses("draft", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="dflash_grpc.gc")
    for gen, took in ((0, 0.0001), (2, serving.GC_PAUSE_WARN_S), (2, 0.02), (1, serving.GC_PAUSE_LOG_S / 2)):
        pauses("start", {"generation": gen})
        now[0] += took
        pauses("stop", {"generation": gen, "collected": 7})
    pauses("stop", {"generation": 0, "collected": 0})   # (no start: not counted)
    assert pauses.count == [1, 1, 2]
    assert pauses.longest_s == [pytest.approx(0.0001), pytest.approx(serving.GC_PAUSE_LOG_S / 2), pytest.approx(0.05)]
    logged = [(r.levelname, r.service, r.generation, r.ms) for r in caplog.records if r.name == "dflash_grpc.gc"]
    assert logged == [("WARNING", "draft", 2, serving.GC_PAUSE_WARN_S * 1e3), ("INFO", "draft", 2, 20.0)]
    # a hook that cannot log (the interpreter shutting down) does not raise
    pauses._log = None
    pauses("start", {"generation": 2})
    now[0] += 1.0
    pauses("stop", {"generation": 2, "collected": 0})
    assert pauses.count[2] == 3


def test_freeze_heap_freezes_once_started_and_can_be_turned_off():
    """serving.freeze_heap (called by serve_forever before a service serves): every object alive
    is moved to the permanent generation and the pause watch is installed once; with
    DFLASH_GC_FREEZE=0 nothing is frozen, and the pauses are still watched. Run in a child
    process: freezing is process-wide."""
    code = ("import gc; from dflash_grpc import serving as s; r = s.freeze_heap(); s.freeze_heap(); "
            "print(r, gc.get_freeze_count() > 0, gc.callbacks.count(s.gc_pauses) if s.gc_pauses else 0)")
    for env, want in (({"DFLASH_GC_FREEZE": "1"}, "True True 1"), ({"DFLASH_GC_FREEZE": "0"}, "False False 1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == want
