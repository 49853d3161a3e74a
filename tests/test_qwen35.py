"""The qwen35 hybrid target: logits against transformers, tree verify and exact state rollback.

Models are synthetic (random weights, real Qwen3.5 layout) from ``fixtures.synth``; the
oracle is ``transformers.Qwen3_5ForCausalLM`` with the same weights.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from target_service.engine import Sampling, TargetEngine
from target_service.models.qwen35 import Qwen35Model
from fixtures.synth import PRESETS, write_qwen35
from runtime.tree import chain, tree_tensors

# float32 on both sides, same weights; differences are summation order (and transformers'
# chunked GDN vs our recurrence). Logits are O(1..10) for these random models; observed
# differences reach 2.3e-4 (ratio 3), so 1e-3 leaves room while a wrong head map or norm is O(1).
LOGIT_ATOL = 1e-3


def tiny_config(ratio: int, tied: bool, layers: int = 4):
    base = PRESETS["tiny"]
    return dataclasses.replace(base, num_hidden_layers=layers, linear_num_key_heads=2, linear_num_value_heads=2 * ratio,
                               tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory):
    """(ratio, tied) -> SynthResult, written once per module."""
    out = {}
    d = tmp_path_factory.mktemp("q35")
    for ratio, tied in [(1, False), (2, True), (3, False), (2, False)]:
        out[(ratio, tied)] = write_qwen35(str(d / f"q35-r{ratio}-{'tied' if tied else 'untied'}.gguf"), tiny_config(ratio, tied), seed=ratio)
    return out


def hf_model(res):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**res.hf_config()))
    model.load_state_dict(res.hf_model_state_dict(), strict=True)
    return model.eval()


@pytest.mark.parametrize("ratio,tied", [(1, False), (2, True), (3, False)])
def test_logits_match_transformers(synth_models, ratio, tied):
    res = synth_models[(ratio, tied)]
    ours = Qwen35Model.from_gguf(res.path)
    assert ours.cfg.tied_embeddings == tied
    assert ours.cfg.linear_num_value_heads == 2 * ratio
    hf = hf_model(res)
    ids = torch.randint(0, ours.cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(ratio))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    tr = chain(ids.tolist())
    out = ours.forward(tr.tokens, torch.arange(48), tr.ancestors, ours.new_cache(128))
    assert (out.logits - ref).abs().max().item() < LOGIT_ATOL


def test_transformers_gguf_loader_agrees(synth_models):
    """transformers loading the GGUF itself (its own conversion rules) gives our logits."""
    import os

    from transformers import AutoModelForCausalLM

    res = synth_models[(2, False)]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(res.path), gguf_file=os.path.basename(res.path), dtype=torch.float32).eval()
    ours = Qwen35Model.from_gguf(res.path)
    ids = torch.arange(5, 37)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    tr = chain(ids.tolist())
    out = ours.forward(tr.tokens, torch.arange(32), tr.ancestors, ours.new_cache(64))
    assert (out.logits - ref).abs().max().item() < LOGIT_ATOL


def test_chunked_prefill_crossing_chunk_boundaries(synth_models):
    """A 300-token prompt committed in chunks (the engine's 256 and odd sizes) continues exactly
    like transformers' single pass."""
    res = synth_models[(2, False)]
    ours = Qwen35Model.from_gguf(res.path)
    hf = hf_model(res)
    n = 300
    ids = torch.randint(0, ours.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    for cuts in ([0, 256, 300], [0, 1, 65, 129, 200, 300]):
        cache = ours.new_cache(512)
        got = []
        for a, b in zip(cuts, cuts[1:]):
            tr = chain(ids[a:b].tolist())
            out = ours.forward(tr.tokens, torch.arange(a, b), tr.ancestors, cache)
            ours.commit(cache, out, torch.arange(b - a))
            got.append(out.logits)
        assert (torch.cat(got) - ref).abs().max().item() < LOGIT_ATOL


def _state(cache):
    """Everything a session commits: KV rows, recurrent and conv states (cloned)."""
    L = cache.length
    kv = {i: (cache.k[i][:, :L].clone(), cache.v[i][:, :L].clone()) for i in cache.attn_layers}
    return kv, {i: s.clone() for i, s in cache.recurrent.items()}, {i: c.clone() for i, c in cache.conv.items()}


def _assert_same_state(a, b, tol=1e-4):
    """Equal within ``tol`` (absolute and relative): float32 batched vs one-token arithmetic
    differs by up to ~3e-5 here; a wrong row, path or state would be off by O(0.1..1)."""
    for (ka, va), (kb, vb) in zip(a[0].values(), b[0].values()):
        torch.testing.assert_close(ka, kb, atol=tol, rtol=tol)
        torch.testing.assert_close(va, vb, atol=tol, rtol=tol)
    for x, y in zip(a[1].values(), b[1].values()):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)
    for x, y in zip(a[2].values(), b[2].values()):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)


@pytest.fixture(scope="module", params=["gather", "recompute"])
def rollback_model(synth_models, request):
    return Qwen35Model.from_gguf(synth_models[(2, False)].path, rollback=request.param)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 5))
def test_rollback_equals_autoregressive(rollback_model, seed, steps):
    """After verify steps with random trees and random accepted paths, the committed KV,
    recurrent and conv state equal those of decoding the committed tokens autoregressively
    (float32, atol = rtol = 1e-4), and so do the next-token logits (atol 1e-3, as LOGIT_ATOL)."""
    m = rollback_model
    rng = random.Random(seed)
    vocab = m.cfg.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
    cache = m.new_cache(256)
    tr = chain(prompt)
    m.commit(cache, m.forward(tr.tokens, torch.arange(len(prompt)), tr.ancestors, cache), torch.arange(len(prompt)))
    committed = list(prompt)
    root = rng.randrange(vocab)
    for _ in range(steps):
        n = rng.randint(1, 10)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [root] + [rng.randrange(vocab) for _ in range(n - 1)]
        tree = tree_tensors(tokens, parents)
        before = _state(cache)
        out = m.forward(tree.tokens, cache.length + tree.depth, tree.ancestors, cache, parents=parents)
        _assert_same_state(before, _state(cache), tol=0)  # verify wrote nothing
        end = rng.randrange(n)
        path = torch.nonzero(tree.ancestors[end]).flatten()
        m.commit(cache, out, path)
        committed += [tokens[i] for i in path.tolist()]
        root = rng.randrange(vocab)
    # autoregressive reference over the same committed tokens, one token at a time
    ref = m.new_cache(256)
    for pos, tok in enumerate(committed):
        one = chain([tok])
        m.commit(ref, m.forward(one.tokens, torch.tensor([pos]), one.ancestors, ref), torch.arange(1))
    assert cache.length == ref.length == len(committed)
    _assert_same_state(_state(cache), _state(ref))
    nxt = chain([root])
    a = m.forward(nxt.tokens, torch.tensor([len(committed)]), nxt.ancestors, cache).logits
    b = m.forward(nxt.tokens, torch.tensor([len(committed)]), nxt.ancestors, ref).logits
    torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 14))
def test_tree_node_logits_equal_path_alone(rollback_model, seed, n):
    """Every node of one tree forward (random trees) has the logits of its root-to-node path run
    alone: GDN state from the parent, conv window along the ancestors, attention over ancestors."""
    m = rollback_model
    rng = random.Random(seed)
    vocab = m.cfg.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(9)]
    cache = m.new_cache(64)
    tr = chain(prompt)
    m.commit(cache, m.forward(tr.tokens, torch.arange(9), tr.ancestors, cache), torch.arange(9))
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in parents]
    tree = tree_tensors(tokens, parents)
    out = m.forward(tree.tokens, 9 + tree.depth, tree.ancestors, cache, parents=parents)
    for i in range(len(parents)):
        path = torch.nonzero(tree.ancestors[i]).flatten().tolist()
        alone = chain([tokens[j] for j in path])
        ref = m.forward(alone.tokens, 9 + torch.arange(len(path)), alone.ancestors, cache).logits[-1]
        torch.testing.assert_close(out.logits[i], ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_oracle_drafts_equal_autoregressive(synth_models, temperature):
    """Through the engine: corrupted drafts of the true continuation (chains with decoy siblings)
    emit exactly the autoregressive stream, with many tokens accepted."""
    model = Qwen35Model.from_gguf(synth_models[(3, False)].path)
    engine = TargetEngine(model, max_sessions=2, max_context=256, max_tree_width=32)
    s = Sampling.checked(temperature, 0, 0.0, 77)
    prompt = [3, 14, 15, 92, 65, 35]
    n = 40
    out = engine.prefill("ar", prompt, s, [1, 2])
    ref = [out.first_token]
    while len(ref) < n:
        ref.append(engine.verify("ar", [ref[-1]], [-1]).bonus_token)
    engine.release(["ar"])
    rng = random.Random(3)
    got = [engine.prefill("sp", prompt, s, [1, 2]).first_token]
    accepted = 0
    while len(got) < n:
        truth = ref[len(got) : len(got) + rng.randint(0, 7)]
        tokens, parents = [got[-1]], [-1]
        for d, tok in enumerate(truth):
            parent = len(tokens) - 1 if d else 0
            if rng.random() < 0.4:
                tokens.append(rng.randrange(model.cfg.vocab_size))
                parents.append(parent)
            tokens.append(tok if rng.random() > 0.15 else rng.randrange(model.cfg.vocab_size))
            parents.append(parent)
        v = engine.verify("sp", tokens, parents)
        accepted += len(v.accepted_tokens)
        got += v.accepted_tokens + [v.bonus_token]
    engine.release(["sp"])
    assert got[:n] == ref
    assert accepted >= 10


def test_gdn_prefill_in_fewer_exact_chunks_commits_the_same(synth_models):
    """A GDN model's prompt is never padded (its recurrent and conv state would take in the
    padding); its graph buckets (``prefill_sizes(..., padded=False)``) hold every size up to 32, so
    23 tokens with 16-token chunks run as 16 + 7 instead of 16 + 4 + 2 + 1, through the prefill
    runners (eager on the CPU) with the same first token, features, committed state (float32:
    within 1e-4) and the same tokens decoded after."""
    from target_service.batched_engine import BatchedEngine, prefill_sizes
    from runtime.sampling import Sampling

    model = Qwen35Model.from_gguf(synth_models[(2, False)].path)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    prompt = [(7 * j) % 200 + 3 for j in range(23)]
    runs = {}
    for fine in (False, True):
        eng = BatchedEngine(model, max_sessions=2, max_context=48, max_tree_width=8, max_tree_depth=6,
                            width_buckets=(1, 4, 8), prefill_chunk=16, pad_to_buckets=True)
        eng.prefill_buckets = prefill_sizes(16, False) if fine else (1, 2, 4, 8, 16)
        assert not eng.pad_prefill                      # GDN layers: never padded
        out = eng.prefill("a", prompt, s, [0, 1])
        sizes = list(out.chunks)
        slot = eng.sessions["a"].slot
        state = [t[slot].clone() for t in (*eng.pool.recurrent, *eng.pool.conv)]
        toks = [out.first_token]
        for _ in range(5):
            toks.append(eng.verify("a", [toks[-1]], [-1]).bonus_token)
        runs[fine] = (sizes, out, state, toks)
    (s0, o0, st0, t0), (s1, o1, st1, t1) = runs[False], runs[True]
    assert s0 == [16, 4, 2, 1] and s1 == [16, 7]
    assert o1.first_token == o0.first_token and t1 == t0
    torch.testing.assert_close(o1.features, o0.features, rtol=1e-4, atol=1e-4)
    for a, b in zip(st1, st0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
