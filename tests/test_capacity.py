"""Capacity (issue 23, goal 4): more than 64 sessions batched end to end.

* the batch buckets follow the session slots (``runtime.config.batch_buckets_for``) in both batched
  engines, so a step of more than 64 sessions runs in one bucket (128, 130, 256) instead of being
  split at 64, and gives the tokens (trees) of one session decoded alone;
* the target's steps never exceed ``max_step_tokens`` (a big batch bucket is built only with the
  widths it can hold, and a batch of wide trees is split);
* the pool grants ``max_sessions`` or fewer with a warning, and the engine reports the real number;
  the target's budget also respects the memory the device has free;
* the orchestrator follows the target's slots and warns when the drafter holds fewer;
* ``dflash-grpc bench --concurrency ...,256`` starts the services with ``--max-sessions 256``.

CPU, tiny models (tests/conftest.py), eager steps padded to the buckets as on a GPU.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from runtime.config import BATCH_BUCKETS, batch_buckets_for
from runtime.sampling import Sampling

GREEDY = Sampling.checked(0.0, 0, 0.0, 0)


# ------------------------------------------------------------------------------------------------ buckets


def test_batch_buckets_follow_the_session_slots():
    assert batch_buckets_for(64) == BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets_for(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert batch_buckets_for(130) == (1, 2, 4, 8, 16, 32, 64, 128, 130)
    assert batch_buckets_for(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert batch_buckets_for(1) == (1,) and batch_buckets_for(3) == (1, 2, 3)
    with pytest.raises(ValueError):
        batch_buckets_for(0)


def test_configs_leave_the_buckets_to_the_slots():
    from draft_service.config import DraftConfig
    from orchestrator.config import OrchestratorConfig
    from runtime.config import worker_threads
    from target_service.config import TargetConfig

    assert TargetConfig().batch_buckets is None and DraftConfig().batch_buckets is None
    # the orchestrator runs as many requests as the target holds, 256 more may wait, and its
    # gRPC pool holds a thread for each of them
    cfg = OrchestratorConfig(target="x").resolved("cuda:0", 256, 4096)
    assert (cfg.max_sessions, cfg.max_queue) == (256, 256)
    assert worker_threads(cfg.max_workers, cfg.max_sessions + cfg.max_queue) >= 512
    assert worker_threads(None, 256) > 256   # the target's and drafter's: a thread per stream and more


# ------------------------------------------------------------------------------------------------ target


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    from target_service.models import load_model

    return load_model(tiny_llama.path)


def _engine(model, **kw):
    from target_service.batched_engine import BatchedEngine

    kw.setdefault("max_context", 24)
    kw.setdefault("max_tree_width", 8)
    kw.setdefault("max_tree_depth", 6)
    kw.setdefault("width_buckets", (1, 4, 8))
    return BatchedEngine(model, **kw)


def test_target_steps_past_64_sessions_run_in_one_bucket(tiny_model):
    """130 slots: the buckets end 64, 128, 130; a tick of 130 sessions is one step in the 130
    bucket, one of 70 one step padded to 128; every session's tokens are those of target-only
    decoding of its prompt alone (the reference engine)."""
    from target_service.engine import TargetEngine

    eng = _engine(tiny_model, max_sessions=130, pad_to_buckets=True)
    assert eng.batch_buckets == (1, 2, 4, 8, 16, 32, 64, 128, 130)
    assert {(128, 8), (130, 4)} <= set(eng.buckets()) and (130, 8) not in eng.buckets()   # 1040 > 1024 nodes
    vocab = eng.cfg.vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))] for _ in range(130)]
    n = 6
    ref = TargetEngine(tiny_model, max_sessions=1, max_context=24, max_tree_width=8, max_tree_depth=6)
    want = []
    for p in prompts:
        toks = [ref.prefill("r", p, GREEDY, []).first_token]
        while len(toks) < n:
            toks.append(ref.verify("r", [toks[-1]], [-1]).bonus_token)
        ref.release(["r"])
        want.append(toks)

    got = [[eng.prefill(f"s{i}", p, GREEDY, []).first_token] for i, p in enumerate(prompts)]
    for _ in range(2):   # plain ticks of all 130: one step each, in the 130 bucket
        steps = eng.steps
        outs = eng.verify_batch([(f"s{i}", [g[-1]], [-1]) for i, g in enumerate(got)])
        assert eng.steps == steps + 1
        for g, o in zip(got, outs):
            g.append(o.bonus_token)
    eng.release([f"s{i}" for i in range(70, 130)])
    live = got[:70]
    while min(len(g) for g in live) < n:   # 70 sessions with chains of the truth: one step in (128, 4)
        steps = eng.steps
        items = [(f"s{i}", [g[-1], *want[i][len(g) : len(g) + 2]], [-1, 0, 1][: 1 + len(want[i][len(g) : len(g) + 2])])
                 for i, g in enumerate(live)]
        outs = eng.verify_batch(items)
        assert eng.steps == steps + 1
        for g, o in zip(live, outs):
            g += o.accepted_tokens + [o.bonus_token]
    assert {(130, 1), (128, 4)} <= {(b, w) for b, w, _ in eng._runners}
    assert max(b for b, _, _ in eng._runners) == 130
    assert [g[:n] for g in got[:70]] == want[:70] and got[70:] == [w[:3] for w in want[70:]]
    eng.release([f"s{i}" for i in range(70)])
    assert eng.pool.free == 130


@pytest.mark.parametrize("sessions,step_tokens,width,rows", [
    (256, 1024, 1, [256]), (256, 1024, 4, [256]), (256, 1024, 8, [128, 128]), (256, 1024, 16, [64] * 4),
    (130, 256, 5, [32] * 4 + [2]), (130, 1024, 3, [130]),
])
def test_target_is_never_asked_for_a_step_it_cannot_hold(tiny_model, sessions, step_tokens, width, rows):
    """A batch is split so that every step's bucketed shape is one the engine builds (within
    ``max_step_tokens`` nodes): 256 trees of 16 nodes (4096 nodes) run as four steps of 64."""
    eng = _engine(tiny_model, max_sessions=sessions, max_tree_width=16, width_buckets=(1, 4, 8, 16),
                  max_step_tokens=step_tokens, pad_to_buckets=True, max_context=8)
    items = [(i, None, [0] * width) for i in range(sessions)]
    groups = eng._plan(items)
    assert [len(g) for g in groups] == rows
    shapes = set(eng.buckets())
    for g in groups:
        b, w = eng._bucket(len(g), eng.batch_buckets), eng._bucket(width, eng.width_buckets)
        assert (b, w) in shapes and b * w <= step_tokens


def test_target_pool_grants_what_the_budget_holds(tiny_model, caplog):
    """256 slots asked, a budget of 100 (plus the spare): 100 granted, logged, buckets from 100."""
    probe = _engine(tiny_model, max_sessions=1)
    caplog.set_level(logging.WARNING, logger="runtime.graphs")
    eng = _engine(tiny_model, max_sessions=256, memory_budget=probe.slot_bytes * 101 + 7)
    assert eng.max_sessions == eng.pool.free == 100
    assert eng.batch_buckets == (1, 2, 4, 8, 16, 32, 64, 100)
    rec = [r for r in caplog.records if r.name == "runtime.graphs"]
    assert len(rec) == 1 and (rec[0].asked, rec[0].granted) == (256, 100)
    caplog.clear()
    assert _engine(tiny_model, max_sessions=256, memory_budget=probe.slot_bytes * 257).max_sessions == 256
    assert not [r for r in caplog.records if r.name == "runtime.graphs"]   # granted in full: no warning


def test_target_budget_respects_free_memory(monkeypatch):
    """The pool's budget is the fraction of the device's memory less the weights, and never more
    than the device has free (another process on the GPU), less the scratch reserve."""
    from target_service.__main__ import pool_budget

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    assert pool_budget(cuda, 0.5, None, 2 * gib) == 37 * gib          # 40 - 1 (weights) - 2
    assert pool_budget(cuda, 0.9, None, 2 * gib) == 58 * gib          # free 60 - 2, under 72 - 1 - 2
    assert pool_budget(cuda, 0.9, 5 * gib, 2 * gib) == 5 * gib        # --gpu-memory-bytes wins
    assert pool_budget(torch.device("cpu"), 0.9, None, 2 * gib) is None


# ------------------------------------------------------------------------------------------------ drafter


@pytest.fixture(scope="module")
def drafter(tiny_llama, tiny_drafter):
    from draft_service.gguf_io import load_drafter

    return load_drafter(tiny_drafter, tiny_llama.path)


def test_drafter_steps_past_64_sessions_run_in_one_bucket(drafter, caplog):
    """130 drafter slots: buckets up to 128, 130; 70 sessions propose in one step padded to 128,
    each tree that of the session alone (the reference engine); a budget cut is logged."""
    from draft_service.batched import BatchedDrafter, DraftItem, ReferenceDrafterEngine

    eng = BatchedDrafter(drafter, max_sessions=130, max_context=32, prefill_chunk=8, pad_batches=True)
    assert eng.batch_buckets == (1, 2, 4, 8, 16, 32, 64, 128, 130) and eng.buckets()[-2:] == [128, 130]
    c = drafter.config
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    ref = ReferenceDrafterEngine(drafter, max_sessions=70, max_context=32)
    held = [0] * 70
    for step in range(2):
        batch = []
        for i in range(70):
            rows = rng.randint(1, c.block_size)
            held[i] += rows
            batch.append(DraftItem(f"d{i}", torch.randn(rows, c.feature_size, generator=g), rng.randrange(c.vocab_size),
                                   held[i], *[(0, 0, 0), (6, 3, 0), (4, 1, 0)][i % 3]))
        steps = eng.steps
        got = eng.propose_batch(batch)
        assert eng.steps == steps + 1   # one step for the 70 sessions
        want = ref.propose_batch(batch)
        assert [(o.tokens, o.parents) for o in got] == [(o.tokens, o.parents) for o in want]
    assert {b for b, _, _ in eng.graphs} == {128}
    caplog.set_level(logging.WARNING, logger="runtime.graphs")
    slot = eng.pool.shape.slot_bytes(eng.dtype)
    cut = BatchedDrafter(drafter, max_sessions=256, max_context=32, memory_budget=slot * 41)
    assert cut.max_sessions == 40 and cut.batch_buckets == (1, 2, 4, 8, 16, 32, 40)
    assert [(r.what, r.asked, r.granted) for r in caplog.records if r.name == "runtime.graphs"] == [
        ("drafter session", 256, 40)]


# ------------------------------------------------------------------------------------------------ orchestrator


def test_orchestrator_warns_once_when_the_drafter_holds_fewer_sessions(caplog):
    """A drafter of 64 sessions under an orchestrator of 256: one warning (requests past its
    slots decode plainly), not one per tick; none for a drafter as large as the orchestrator."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Scheduler

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cuda:0", max_sessions=256, max_context=64, max_tree_width=16)

    class NoDraft:
        address = None

    sched = Scheduler(Target(), NoDraft(), max_sessions=256)
    try:
        caplog.set_level(logging.WARNING, logger="orchestrator.scheduler")

        def drafter(n):
            return draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(max_sessions=n, block_size=16, device="cuda:0"))

        for _ in range(3):
            assert sched._propose_trees([], drafter(64))[0] == {}
        sched._propose_trees([], drafter(256))
        warned = [r for r in caplog.records if "drafter holds fewer" in r.getMessage()]
        assert [(r.drafter_sessions, r.max_sessions) for r in warned] == [(64, 256)]
    finally:
        sched.stop(timeout=1.0, release_timeout=0.1)


# ------------------------------------------------------------------------------------------------ bench


def test_bench_gives_the_services_the_sessions_of_its_largest_level():
    from client.cli import bench_session_args

    levels = [1, 4, 8, 16, 32, 64, 128, 256]
    assert bench_session_args(levels, "cuda", [], [], []) == (["--max-sessions", "256"], ["--max-sessions", "256"])
    # at most 64 streams on CUDA: the services' defaults stand (the graphs of earlier runs)
    assert bench_session_args([1, 4, 64], "cuda:0", [], ["--x"], []) == (["--x"], [])
    # the CPU target holds 8 by default, the drafter 64
    assert bench_session_args([1, 16], None, [], [], []) == (["--max-sessions", "16"], [])
    # the user's flag wins: for every service, or for one
    assert bench_session_args(levels, "cuda", ["--max-sessions", "300"], [], []) == ([], [])
    assert bench_session_args(levels, "cuda", [], ["--max-sessions=200"], []) == (
        ["--max-sessions=200"], ["--max-sessions", "256"])
    assert bench_session_args([], "cuda", [], [], []) == ([], [])


def test_one_propose_carries_a_bounded_amount_of_history(monkeypatch):
    """Past ``RESYNC_BYTES`` of rows beyond a step's in one Propose, the other new drafter sessions wait
    for a later tick (decoding plainly now); the first always goes, and a synced request's step
    rows are never held back."""
    from dflash_grpc.columns import Rows
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator import scheduler as sched_mod
    from orchestrator.scheduler import Request, Scheduler

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cuda:0", max_sessions=256, max_context=4096, max_tree_width=16)

    class NoDraft:
        address = None

    class Sent(Exception):
        pass

    class Call:
        broken = False

        def exchange(self, request, timeout, flush):
            self.request = request
            raise Sent

        def close(self):
            pass

    def request(name, rows, synced):
        r = Request(session_id=name, prompt=[1], sampling=common_pb2.SamplingParams(), max_tokens=100,
                    tree=draft_pb2.TreeParams(budget=3, top_k=2))
        r.root, r.length, r.on_target = 5, 40, True
        r.history = [Rows(common_pb2.DTYPE_F16, 8, rows, bytes(rows * 16))]
        r.rows_from = r.length - rows if synced else 0   # the rows the drafter lacks: [rows_from, length)
        r.on_drafter = r.draft_synced = synced
        return r

    monkeypatch.setattr(sched_mod, "RESYNC_BYTES", 1000)
    sched = Scheduler(Target(), NoDraft(), max_sessions=256)
    try:
        sched._propose = call = Call()
        batch = [request("new1", 40, False), request("new2", 40, False), request("step", 4, True),
                 request("new3", 20, False)]
        sched._active = list(batch)
        drafter = draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(max_sessions=256, block_size=16, device="cuda:0"))
        with pytest.raises(Sent):
            sched._propose_trees(batch, drafter)
        sent = [it.session_id for it in call.request.items] or list(call.request.columns.session_ids)
        # 640 bytes go; 640 more would pass 1000: new2 waits; the step rows go; new3's 320 fit
        assert sent == ["new1", "step", "new3"]
    finally:
        sched._active, sched._propose = [], None   # nothing to release on the fake peers
        sched.stop(timeout=1.0, release_timeout=0.1)


def test_prefill_chunks_do_not_depend_on_the_load(tiny_model):
    """A prompt is cut into the same chunks (so the same GEMM shapes and bits) whether it is
    prefilled alone or beside others under a tick budget that is not a multiple of the chunk:
    the chunk size is the engine's (``next_prefill_tokens``), the budget only decides when a chunk
    runs. Before, a chunk took the budget's remainder (16 tokens of budget left -> a 16-token chunk
    instead of 20), so under load a request's prompt ran other GEMM shapes than alone."""
    from runtime.step_loop import StepLoop
    from target_service.engine import Sampling

    s = Sampling.checked(0.0, 0, 0.0, 0)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(23)] for i in range(3)]
    alone = _engine(tiny_model, max_sessions=4, prefill_chunk=20)
    want = [alone.prefill(f"a{i}", p, s, []).first_token for i, p in enumerate(prompts)]
    eng = _engine(tiny_model, max_sessions=4, prefill_chunk=20)
    loop = StepLoop(eng, prefill_budget=36)   # 20 + 16: the second chunk of a tick would have been cut to 16
    try:
        futs = [loop.submit_prefill(f"t{i}", p, s, []) for i, p in enumerate(prompts)]
        outs = [f.result(timeout=60) for f in futs]
    finally:
        loop.stop()
    assert [o.chunks for o in outs] == [(20, 3)] * 3
    assert [o.first_token for o in outs] == want


def _chunked(engine, pad: bool, sizes: tuple[int, ...] | None = None):
    """``engine`` prefilling as on CUDA graphs (chunks replayed through the prefill runners, here
    eagerly on the CPU): power-of-two buckets up to its ``prefill_chunk`` (or ``sizes``), the last
    chunk padded or not."""
    engine.prefill_buckets = sizes or tuple(1 << i for i in range(engine.prefill_chunk.bit_length()))
    engine.pad_prefill = pad
    return engine


def test_padded_prefill_chunk_commits_what_exact_chunks_commit(tiny_model):
    """A prompt's remainder run as one chunk padded to the next bucket (``pad_prefill``: 23 tokens
    with 16-token chunks -> 16 + 7 in a width-8 step, not 16 + 4 + 2 + 1) commits the same K/V
    rows, taps the same features and chooses the same first token as chunks of exactly the
    buckets (float32 on the CPU: equal within 1e-5; the GEMM shapes differ), and decoding goes on
    with the same tokens. Padding never reaches the slot's committed rows: the rows past the
    prompt are rewritten by the next tokens before anything reads them."""
    s = Sampling.checked(0.0, 0, 0.0, 0)
    prompt = [(5 * j) % 90 + 3 for j in range(23)]
    layers = [0, 1]
    runs = {}
    for pad in (False, True):
        eng = _chunked(_engine(tiny_model, max_sessions=2, max_context=40, prefill_chunk=16, pad_to_buckets=True), pad)
        out = eng.prefill("a", prompt, s, layers)
        sizes = list(out.chunks)
        slot = eng.sessions["a"].slot
        kv = (eng.pool.k[0][slot, : len(prompt)].clone(), eng.pool.v[-1][slot, : len(prompt)].clone())
        toks = [out.first_token]
        for _ in range(5):
            toks.append(eng.verify("a", [toks[-1]], [-1]).bonus_token)
        runs[pad] = (sizes, out, kv, toks, sorted(w for w in eng._prefill_runners))
    (sizes0, out0, kv0, toks0, w0), (sizes1, out1, kv1, toks1, w1) = runs[False], runs[True]
    assert sizes0 == [16, 4, 2, 1] and sizes1 == [16, 7]
    assert w0 == [1, 2, 4, 16] and w1 == [8, 16]
    assert out1.first_token == out0.first_token and out1.committed_length == out0.committed_length == len(prompt)
    torch.testing.assert_close(out1.features, out0.features, rtol=1e-5, atol=1e-5)
    for a, b in zip(kv1, kv0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert toks1 == toks0


def test_padded_prefill_stays_inside_the_slot(tiny_model):
    """A padded chunk's scratch rows must fit the slot (``max_context + max_tree_width`` rows and
    rotary positions): near the end of the context the remainder runs as exact buckets instead."""
    eng = _chunked(_engine(tiny_model, max_sessions=1, max_context=24, max_tree_width=8, prefill_chunk=16,
                           pad_to_buckets=True), True)
    assert eng._prefill_width(0, 7) == 8          # rows 0..7 of 32
    assert eng._prefill_width(16, 7) == 8         # rows 16..23
    assert eng._prefill_width(20, 9) == 9         # 16 rows from 20 would pass 32: not padded
    eng.pad_prefill = False
    assert eng._prefill_width(0, 7) == 7


def test_padded_prefill_only_into_captured_buckets(tiny_model):
    """A ``prefill_chunk`` that is not a power of two (12: buckets 1, 2, 4, 8) never pads past its
    buckets (a 12-token chunk in an uncaptured width-16 graph): full chunks round down to 8, the
    remainder pads up to a bucket; and every prefill runner writes into one shared pair of output
    buffers (sized for the widest bucket), not one per chunk size."""
    eng = _chunked(_engine(tiny_model, max_sessions=1, max_context=40, max_tree_width=8, prefill_chunk=12,
                           pad_to_buckets=True), True, sizes=(1, 2, 4, 8))
    assert eng._prefill_width(0, 12) == 12 and eng._prefill_width(0, 7) == 8 and eng._prefill_width(0, 3) == 4
    job = eng.start_prefill("a", [(3 * j) % 90 + 3 for j in range(23)], Sampling.checked(0.0, 0, 0.0, 0), [0])
    sizes = []
    while job.outcome is None:
        sizes.append(eng.run_prefill(job, 64))
    assert sizes == [8, 8, 7]              # 8 + 8, then 7 padded to 8
    runners = eng._prefill_runners
    assert sorted(runners) == [8]
    host, dev = eng._prefill_bufs
    for r in runners.values():
        assert r.out_host.data_ptr() == host.data_ptr() and r.out_dev.data_ptr() == dev.data_ptr()


def test_prefill_sizes():
    """The graph buckets of prefill chunks: powers of two when the last chunk runs padded; else
    also 1..32 and the multiples of 32, so a remainder takes at most two chunks."""
    from target_service.batched_engine import prefill_sizes

    assert prefill_sizes(512, True) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    fine = prefill_sizes(512, False)
    assert fine == tuple(range(1, 33)) + tuple(range(64, 513, 32))
    assert prefill_sizes(16, False) == tuple(range(1, 17)) and prefill_sizes(1, False) == (1,)
    for n in range(1, 513):     # largest bucket <= n, then the rest: at most two chunks, exact sizes
        a = max(w for w in fine if w <= n)
        assert a == n or (n - a) in fine


def test_prefill_chunking_stays_in_its_graphs_and_its_slot(tiny_model):
    """For any ``prefill_chunk``, context and prompt length, the chunks the engine would run as
    graphs (``next_prefill_tokens`` and ``_prefill_width``, both ways: padded for a model without
    GDN layers, the finer exact sizes for one with them) cover the prompt in order, each chunk's
    graph is a captured bucket (or the chunk runs in its exact size), no graph is wider than the
    chunk limit, no scratch row passes the slot (``max_context + max_tree_width``), and a padded
    chunk is only ever a prompt's last."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from target_service.batched_engine import prefill_sizes
    from target_service.engine import PrefillJob

    eng = _engine(tiny_model, max_sessions=1, max_context=24, max_tree_width=8, prefill_chunk=16, pad_to_buckets=True)

    @settings(max_examples=300, deadline=None)
    @given(chunk=st.integers(1, 3000), context=st.integers(2, 2048), width=st.sampled_from([1, 8, 16, 64]),
           padded=st.booleans(), data=st.data())
    def check(chunk, context, width, padded, data):
        eng.prefill_chunk, eng.max_context, eng.max_tree_width = chunk, context, width
        eng.pad_prefill = padded
        eng.prefill_buckets = prefill_sizes(min(chunk, context), padded)
        n = data.draw(st.integers(1, context - 1))
        job = PrefillJob("p", [3] * n, None, [])
        while job.done < n:
            k = eng.next_prefill_tokens(job)
            w = eng._prefill_width(job.done, k)
            assert 1 <= k <= min(chunk, n - job.done) and w >= k
            assert w == k or (padded and w in eng.prefill_buckets and job.done + k == n)
            assert w in eng.prefill_buckets and w <= max(eng.prefill_buckets) <= min(chunk, context)
            assert job.done + w <= context + width
            job.done += k

    check()
