"""The batched (GPU) engine on the CPU: same tokens as the reference engine, batching and padding
that change nothing, per-item refusals, slot reuse, and the step loop.

Everything here runs the engine's real step code (the reference kernels on CPU tensors, eagerly);
``pad_to_buckets=True`` makes it pad steps to the buckets exactly as on a GPU, so the padded rows
and nodes of a graph-shaped step are exercised in CI. tests/test_batched_engine_gpu.py runs the
same checks on CUDA with the Triton kernels and graphs.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling, TargetEngine
from runtime.errors import Code
from runtime.step_loop import StepLoop

LAYERS = [1, 7, 14]
SETTINGS = [(0.0, 0, 0.0), (0.8, 40, 0.9)]


def ar_stream(engine, sid, prompt, sampling, n, layers=LAYERS):
    """Target-only decoding: prefill, then root-only verifies."""
    out = engine.prefill(sid, prompt, sampling, layers)
    toks, feats = [out.first_token], [out.features]
    for _ in range(n - 1):
        v = engine.verify(sid, [toks[-1]], [-1])
        toks.append(v.bonus_token)
        feats.append(v.features)
    engine.release([sid])
    return toks, torch.cat(feats) if layers else None


def oracle_tree(rng: random.Random, root: int, truth: list[int], vocab: int, decoys: bool = True) -> tuple[list[int], list[int]]:
    """A draft from the true continuation, corrupted at random, with decoy siblings (or a chain)."""
    tokens, parents = [root], [-1]
    for d, tok in enumerate(truth):
        parent = len(tokens) - 1 if d else 0
        if decoys and rng.random() < 0.5:
            tokens.append(rng.randrange(vocab))
            parents.append(parent)
        tokens.append(tok if rng.random() > 0.2 else rng.randrange(vocab))
        parents.append(parent)
    return tokens, parents


def speculative_streams(engine, prompts, sampling, refs, n, seed=0, layers=LAYERS, decoys=True):
    """Decode every prompt at once, one batched verify per step, with oracle trees."""
    rng = random.Random(seed)
    got, feats = [], []
    for i, p in enumerate(prompts):
        out = engine.prefill(f"s{i}", p, sampling, layers)
        got.append([out.first_token])
        feats.append([out.features])
    while min(len(g) for g in got) < n:
        items = []
        for i, g in enumerate(got):
            truth = refs[i][len(g) : len(g) + rng.randint(0, 7)]
            items.append((f"s{i}", *oracle_tree(rng, g[-1], truth, engine.cfg.vocab_size, decoys)))
        for i, r in enumerate(engine.verify_batch(items)):
            assert not isinstance(r, Exception), r
            got[i] += r.accepted_tokens + [r.bonus_token]
            feats[i].append(r.features)
    engine.release([f"s{i}" for i in range(len(prompts))])
    return [g[:n] for g in got], [torch.cat(f) for f in feats] if layers else None


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer):
    return [smollm_tokenizer.encode(t) for t in ("def fibonacci(n):", "The capital of France is", "Once upon a time, in")]


@pytest.fixture(scope="module")
def reference(smollm_model):
    return TargetEngine(smollm_model, max_sessions=4, max_context=256, max_tree_width=32, max_tree_depth=8)


@pytest.fixture(scope="module")
def reference_streams(reference, prompts):
    """``streams(sampling, n)``: the reference engine's target-only streams (tokens, features) of
    ``prompts``, computed once per ``(sampling, n)`` for the module (the padded and unpadded cases
    compare with the same streams)."""
    cache = {}

    def streams(sampling, n):
        key = (dataclasses.astuple(sampling), n)
        if key not in cache:
            cache[key] = [ar_stream(reference, "r", p, sampling, n) for p in prompts]
        return cache[key]

    return streams


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("pad", [False, True])
def test_batched_equals_reference_llama(smollm_model, reference_streams, prompts, temperature, top_k, top_p, pad):
    """Three sessions verified together, trees padded to buckets or not: every stream and its
    drafter features equal the reference engine's target-only decoding."""
    engine = BatchedEngine(smollm_model, max_sessions=4, max_context=256, max_tree_width=32, max_tree_depth=8,
                           feature_layers=LAYERS, pad_to_buckets=pad)
    s = Sampling.checked(temperature, top_k, top_p, seed=99)
    n = 16
    refs = reference_streams(s, n)
    got, feats = speculative_streams(engine, prompts, s, [r[0] for r in refs], n)
    assert got == [r[0] for r in refs]
    for f, (_, rf) in zip(feats, refs):
        m = min(len(f), len(rf))
        torch.testing.assert_close(f[:m], rf[:m], atol=1e-3, rtol=1e-3)
    assert engine.pool.free == engine.max_sessions


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    from target_service.models.qwen35 import Qwen35Model
    from fixtures.synth import PRESETS, write_qwen35

    cfg = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=4)
    res = write_qwen35(str(tmp_path_factory.mktemp("q35") / "q.gguf"), cfg, seed=2, progress=False)
    return Qwen35Model.from_gguf(res.path)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_batched_equals_reference_qwen35(tiny_qwen35, temperature, top_k, top_p):
    """The hybrid: pooled recurrent and conv state, tree recurrence, commit by recompute along the
    accepted path, chunked prefill in odd chunk sizes, padded steps."""
    m = tiny_qwen35
    ref = TargetEngine(m, max_sessions=4, max_context=256, max_tree_width=32, max_tree_depth=10)
    engine = BatchedEngine(m, max_sessions=4, max_context=256, max_tree_width=32, max_tree_depth=10,
                           feature_layers=[1, 5], prefill_chunk=7, pad_to_buckets=True)
    s = Sampling.checked(temperature, top_k, top_p, seed=5)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, m.cfg.vocab_size, (k,), generator=gen).tolist() for k in (5, 17, 30)]
    n = 24
    refs = [ar_stream(ref, "r", p, s, n, [1, 5]) for p in prompts]
    got, feats = speculative_streams(engine, prompts, s, [r[0] for r in refs], n, layers=[1, 5])
    assert got == [r[0] for r in refs]
    for f, (_, rf) in zip(feats, refs):
        m_ = min(len(f), len(rf))
        torch.testing.assert_close(f[:m_], rf[:m_], atol=2e-3, rtol=2e-3)


def test_batch_composition_changes_nothing(smollm_model, prompts):
    """A session's tokens are the same alone, in a batch of three, and next to other sessions."""
    s = Sampling.checked(0.9, 0, 0.0, seed=3)
    engine = BatchedEngine(smollm_model, max_sessions=6, max_context=256, max_tree_width=16, max_tree_depth=8, pad_to_buckets=True)
    alone = [ar_stream(engine, "a", p, s, 12, [])[0] for p in prompts]
    for i, p in enumerate(prompts):
        engine.prefill(f"b{i}", p, s, [])
    got = [[engine.sessions[f"b{i}"].root] for i in range(3)]
    for step in range(11):
        order = list(range(3)) if step % 2 else [2, 0, 1]
        res = engine.verify_batch([(f"b{i}", [got[i][-1]], [-1]) for i in order])
        for i, r in zip(order, res):
            got[i].append(r.bonus_token)
    assert got == alone


def test_bad_items_get_their_status_and_spare_the_batch(smollm_model, prompts):
    engine = BatchedEngine(smollm_model, max_sessions=4, max_context=64, max_tree_width=8, max_tree_depth=4, pad_to_buckets=True)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    want = ar_stream(engine, "x", prompts[0], s, 3, [])[0]
    root = engine.prefill("a", prompts[0], s, []).first_token
    engine.prefill("full", list(range(1, 62)), s, [])
    full_root = engine.sessions["full"].root
    items = [
        ("nobody", [1], [-1]),                       # unknown session
        ("a", [root, 5], [-1, 1]),                   # malformed tree
        ("a", [root + 1, 5], [-1, 0]),              # wrong root
        ("full", [full_root, 5, 6, 7], [-1, 0, 1, 2]),  # context full (61 + depth 3 + 1 > 64)
        ("a", [root], [-1]),                         # the good item
        ("a", [root], [-1]),                         # the same session twice
        ("a", [root] * 9, [-1] + [0] * 8),           # too wide
    ]
    res = engine.verify_batch(items)
    codes = [r.code if isinstance(r, Exception) else None for r in res]
    assert codes == [Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, None,
                     Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT]
    assert res[4].bonus_token == want[1] and engine.sessions["full"].length == 61
    assert engine.verify("a", [want[1]], [-1]).bonus_token == want[2]


def _slot_state(engine, slot):
    p = engine.pool
    return [t[:, slot].clone() for t in (p.k, p.v, p.recurrent, p.conv) if t is not None]


def test_padding_and_other_sessions_untouched(tiny_qwen35):
    """A padded step writes only its sessions' slots and the spare: a session outside the step
    keeps every byte of its KV, recurrent and conv state."""
    engine = BatchedEngine(tiny_qwen35, max_sessions=3, max_context=64, max_tree_width=16, max_tree_depth=6, pad_to_buckets=True)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    ra = engine.prefill("a", [3, 4, 5, 6], s, []).first_token
    engine.prefill("c", [7, 8, 9], s, [])
    c = engine.sessions["c"]
    before = _slot_state(engine, c.slot)
    length_c = c.length
    free_slot = engine.pool._free[-1]
    free_before = _slot_state(engine, free_slot)
    engine.verify_batch([("a", [ra, 11, 12, 13, 14], [-1, 0, 1, 1, 0])])   # 5 nodes padded to 8, 1 row padded to 1
    for x, y in zip(before + free_before, _slot_state(engine, c.slot) + _slot_state(engine, free_slot)):
        assert torch.equal(x, y)
    assert c.length == length_c


def test_commit_refuses_a_forward_that_missed_gdn_layers_before_writing(tiny_qwen35):
    """The commit writes every GDN layer's state from inputs the forward stacked; if a layer's
    inputs are missing it raises before any state (K/V included) is written."""
    from bench.gpu import chain_forward

    engine = BatchedEngine(tiny_qwen35, max_sessions=2, max_context=64, max_tree_width=8, pad_to_buckets=True)
    w = 4
    backend = chain_forward(engine, w)
    assert backend.stack is not None and len(backend.saved) == engine.pool.recurrent.shape[0]
    backend.saved.pop(next(iter(backend.saved)))
    before = [t.clone() for t in (engine.pool.k, engine.pool.v, engine.pool.recurrent, engine.pool.conv)]
    with pytest.raises(RuntimeError, match="GDN layers"):
        backend.commit(torch.arange(w)[None], torch.full((1,), w))
    for x, y in zip(before, (engine.pool.k, engine.pool.v, engine.pool.recurrent, engine.pool.conv)):
        assert torch.equal(x, y)


def test_reused_slot_carries_nothing(tiny_qwen35):
    s = Sampling.checked(0.0, 0, 0.0, 0)
    fresh = BatchedEngine(tiny_qwen35, max_sessions=1, max_context=64, max_tree_width=8)
    want = ar_stream(fresh, "y", [9, 8, 7], s, 8, [])[0]
    engine = BatchedEngine(tiny_qwen35, max_sessions=1, max_context=64, max_tree_width=8)
    ar_stream(engine, "x", [1, 2, 3, 4, 5, 6], s, 10, [])          # leaves state in slot 0
    assert ar_stream(engine, "y", [9, 8, 7], s, 8, [])[0] == want


def test_memory_budget_sets_slots(smollm_model):
    from runtime.errors import ResourceExhausted
    from runtime.pool import PoolShape

    per = PoolShape.of(smollm_model.cfg, 128, 8).slot_bytes(smollm_model.dtype)
    engine = BatchedEngine(smollm_model, max_sessions=10, max_context=128, max_tree_width=8, memory_budget=4 * per + 1)
    assert engine.max_sessions == 3 and engine.pool.slots == 3
    with pytest.raises(ResourceExhausted):
        BatchedEngine(smollm_model, max_sessions=10, max_context=128, max_tree_width=8, memory_budget=2 * per - 1)


def test_step_loop_batches_concurrent_requests_and_interleaves_prefill(smollm_model, prompts):
    """Requests from several threads meet in one batched step; a long prompt prefilled in small
    chunks does not hold back other sessions' steps."""
    engine = BatchedEngine(smollm_model, max_sessions=4, max_context=512, max_tree_width=8, prefill_chunk=16)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    want = [ar_stream(engine, "w", p, s, 7, [])[0] for p in prompts]
    loop = StepLoop(engine, prefill_budget=16)      # from here on only the loop's thread touches the engine
    try:
        for i, p in enumerate(prompts):
            assert loop.prefill(f"t{i}", p, s, []).first_token == want[i][0]
        got = [[w[0]] for w in want]
        barrier = threading.Barrier(3)
        sizes = []

        def client(i):
            for _ in range(5):
                barrier.wait()
                r = loop.batch([(f"t{i}", [got[i][-1]], [-1])])
                sizes.append(r.batch_items)
                got[i].append(r.results[0].bonus_token)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [w[:6] for w in want]
        assert max(sizes) > 1, "concurrent requests should share steps"
        long_prompt = list(range(100, 200))                  # 100 tokens: 7 chunks of 16
        fut = loop.submit_prefill("long", long_prompt, s, [])
        r = loop.batch([("t0", [got[0][-1]], [-1])])
        assert not fut.done(), "a verify must not wait for the whole long prefill"
        assert r.results[0].bonus_token == want[0][6]
        assert fut.result(timeout=60).committed_length == 100
        assert loop.release(["long", "t0", "t1", "t2", "nobody"]) == 4
    finally:
        loop.stop()


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return [rng.randrange(vocab) for _ in range(n)], parents


def test_tree_shapes_kept_give_analyze_trees_answer_and_errors():
    """BatchedEngine._analyze (a shape's depths and ancestor bits kept per parent list) answers as
    runtime.tree.analyze_tree, its reference, for every tree: the first tree of a shape and each
    later one, well-formed or not (a bad token in a kept shape, a shape too wide or too deep, a
    broken parent list, tokens and parents of different lengths), and the memory starts again past
    TREE_SHAPES."""
    from target_service import batched_engine as be
    from runtime.tree import TreeError, analyze_tree

    eng = BatchedEngine.__new__(BatchedEngine)
    eng.cfg = type("Cfg", (), {"vocab_size": 50})()
    eng.max_tree_width, eng.max_tree_depth, eng._shapes = 16, 6, {}
    rng = random.Random(5)

    def outcome(fn, tokens, parents):
        try:
            depth, bits = fn(tokens, parents)[:2]
            return list(depth), list(bits)
        except TreeError as e:
            return str(e)

    reference = lambda t, p: analyze_tree(t, p, 50, 16, 6)   # noqa: E731
    shapes = [_random_tree(rng, n, 50)[1] for n in (1, 2, 5, 8, 8, 16, 17)]
    for _ in range(400):
        parents = list(rng.choice(shapes))
        tokens = [rng.randrange(50) for _ in parents]
        case = rng.randrange(6)
        if case == 0 and len(tokens) > 1:
            tokens[rng.randrange(len(tokens))] = rng.choice([-1, 50, 10**6])    # a token outside the vocabulary
        elif case == 1:
            tokens = tokens[:-1]                                                 # lengths differ
        elif case == 2 and len(parents) > 2:
            parents[2] = 5                                                       # not an earlier node
        assert outcome(eng._analyze, tokens, parents) == outcome(reference, tokens, parents), (tokens, parents)
    assert 0 < len(eng._shapes) <= len(shapes)
    deep = [-1, 0, 1, 2, 3, 4, 5, 6]                                             # depth 7 > 6: never kept
    assert "exceeds" in outcome(eng._analyze, [1] * 8, deep) and tuple(deep) not in eng._shapes
    old = be.TREE_SHAPES
    be.TREE_SHAPES = 2
    try:
        eng._shapes.clear()
        for n in (1, 2, 3):
            eng._analyze([1] * n, list(range(-1, n - 1)))
        assert list(eng._shapes) == [tuple(range(-1, 2))]   # two kept, then the memory started again
    finally:
        be.TREE_SHAPES = old
