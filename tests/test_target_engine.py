"""Target engine: verify + commit/rollback against autoregressive decoding, and refusals."""

from __future__ import annotations

import random

import pytest
import torch

from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling, TargetEngine
from runtime.errors import Code

ENGINES = {"reference": TargetEngine, "batched": BatchedEngine}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(smollm_model, request):
    """The reference engine and the batched (GPU) engine, here on the CPU: same contract."""
    return ENGINES[request.param](smollm_model, max_sessions=4, max_context=512, max_tree_width=32, max_tree_depth=8)


PROMPT_TEXT = "def add(a, b):\n    "
LAYERS = [1, 7, 14]


def _ar(engine, prompt, sampling, n, sid="ar"):
    out = engine.prefill(sid, prompt, sampling, LAYERS)
    toks, feats = [out.first_token], [out.features]
    for _ in range(n - 1):
        v = engine.verify(sid, [toks[-1]], [-1])
        assert v.accepted_tokens == [] and v.accepted_nodes == [0]
        toks.append(v.bonus_token)
        feats.append(v.features)
    engine.release([sid])
    return toks, torch.cat(feats)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 0.0), (0.9, 50, 0.95)])
def test_corrupted_oracle_chains_and_trees_equal_autoregressive(engine, smollm_tokenizer, temperature, top_k, top_p):
    """Drafts built from the true continuation, randomly corrupted, arranged as chains or trees with
    decoy siblings: the emitted stream, the committed length and the drafter features equal
    autoregressive decoding (same seed at temperature > 0)."""
    prompt = smollm_tokenizer.encode(PROMPT_TEXT)
    sampling = Sampling.checked(temperature, top_k, top_p, seed=1234)
    n = 24
    ref, ref_feats = _ar(engine, prompt, sampling, n)
    rng = random.Random(7)
    out = engine.prefill("sp", prompt, sampling, LAYERS)
    got, feats = [out.first_token], [out.features]
    accepted_total = 0
    while len(got) < n:
        i = len(got) - 1
        depth = rng.randint(0, 8)
        truth = ref[i + 1 : i + 1 + depth]
        draft = [t if rng.random() > 0.2 else rng.randrange(engine.cfg.vocab_size) for t in truth]
        tokens, parents = [got[-1]], [-1]
        for d, tok in enumerate(draft):
            parent = len(tokens) - 1 if d else 0
            if rng.random() < 0.5:  # a decoy sibling before the real node
                tokens.append(rng.randrange(engine.cfg.vocab_size))
                parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
        v = engine.verify("sp", tokens, parents)
        assert v.committed_length == len(prompt) + len(got) + len(v.accepted_tokens)
        assert [tokens[j] for j in v.accepted_nodes[1:]] == v.accepted_tokens
        accepted_total += len(v.accepted_tokens)
        got += v.accepted_tokens + [v.bonus_token]
        feats.append(v.features)
    engine.release(["sp"])
    assert got[:n] == ref
    assert accepted_total > 5, "the oracle drafts should be accepted often"
    m = min(len(ref_feats), sum(f.shape[0] for f in feats))
    torch.testing.assert_close(torch.cat(feats)[:m], ref_feats[:m], atol=1e-3, rtol=1e-3)
    assert ref_feats.shape[1] == len(LAYERS) * engine.cfg.hidden_size


BAD_TREES = {
    "wrong root": lambda root, v: ([root + 1 if root + 1 < v else 0, 5], [-1, 0]),
    "parent not earlier": lambda root, v: ([root, 5, 6], [-1, 2, 0]),
    "root parent not -1": lambda root, v: ([root, 5], [0, 0]),
    "token out of vocabulary": lambda root, v: ([root, v], [-1, 0]),
    "negative token": lambda root, v: ([root, -3], [-1, 0]),
    "too wide": lambda root, v: ([root] * 40, [-1] + [0] * 39),
    "too deep": lambda root, v: ([root] + [5] * 9, list(range(-1, 9))),
    "empty": lambda root, v: ([], []),
    "length mismatch": lambda root, v: ([root, 5, 6], [-1, 0]),
}


@pytest.fixture(scope="module")
def victim_ref(engine, smollm_tokenizer):
    """``(prompt, its first 4 greedy tokens)`` on ``engine``, for the rejected-tree tests (one
    autoregressive run per engine, not one per tree)."""
    prompt = smollm_tokenizer.encode("The capital of France is")
    return prompt, _ar(engine, prompt, Sampling.checked(0.0, 0, 0.0, 0), 4, sid="ref")[0]


@pytest.mark.parametrize("name", sorted(BAD_TREES))
def test_rejected_tree_leaves_session_unchanged(engine, victim_ref, name):
    prompt, ref = victim_ref
    s = Sampling.checked(0.0, 0, 0.0, 0)
    out = engine.prefill("victim", prompt, s, [])
    tokens, parents = BAD_TREES[name](out.first_token, engine.cfg.vocab_size)
    with pytest.raises(Exception) as exc:
        engine.verify("victim", tokens, parents)
    assert exc.value.code == Code.INVALID_ARGUMENT
    assert engine.session("victim").length == len(prompt)
    toks = [out.first_token]
    for _ in range(3):
        toks.append(engine.verify("victim", [toks[-1]], [-1]).bonus_token)
    engine.release(["victim"])
    assert toks == ref


def test_refusals(engine):
    s = Sampling.checked(0.0, 0, 0.0, 0)
    with pytest.raises(Exception) as e:
        engine.verify("nobody", [1], [-1])
    assert e.value.code == Code.NOT_FOUND
    for bad_prompt in ([], [engine.cfg.vocab_size]):
        with pytest.raises(Exception) as e:
            engine.prefill("x", bad_prompt, s, [])
        assert e.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(Exception) as e:
        engine.prefill("x", [1] * engine.max_context, s, [])
    assert e.value.code == Code.RESOURCE_EXHAUSTED
    with pytest.raises(Exception) as e:
        engine.prefill("x", [1, 2], s, [engine.cfg.num_layers])
    assert e.value.code == Code.INVALID_ARGUMENT
    for bad in [(-1.0, 0, 0.0), (float("nan"), 0, 0.0), (1.0, -1, 0.0), (1.0, 0, 1.5)]:
        with pytest.raises(Exception) as e:
            Sampling.checked(*bad, seed=None)
        assert e.value.code == Code.INVALID_ARGUMENT
    ids = [f"s{i}" for i in range(engine.max_sessions)]
    try:
        for sid in ids:
            engine.prefill(sid, [1, 2, 3], s, [])
        with pytest.raises(Exception) as e:
            engine.prefill("one-too-many", [1, 2, 3], s, [])
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        with pytest.raises(Exception) as e:
            engine.prefill(ids[0], [1, 2, 3], s, [])
        assert e.value.code == Code.INVALID_ARGUMENT
    finally:
        assert engine.release(ids + ["unknown"]) == len(ids)
    assert not engine.sessions


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_context_full(smollm_model, kind):
    engine = ENGINES[kind](smollm_model, max_sessions=1, max_context=12, max_tree_width=8)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    root = engine.prefill("c", list(range(1, 10)), s, []).first_token
    # L = 9: a chain of depth 3 reaches position 12 -> refused; depth 2 fits.
    with pytest.raises(Exception) as e:
        engine.verify("c", [root, 5, 6, 7], [-1, 0, 1, 2])
    assert e.value.code == Code.RESOURCE_EXHAUSTED
    assert engine.session("c").length == 9
    v = engine.verify("c", [root, 5, 6], [-1, 0, 1])
    assert v.committed_length <= 12
