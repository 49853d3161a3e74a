"""The llama reference model against transformers, and tree forward against path-alone forwards."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from runtime.tree import chain, tree_tensors

# transformers and our model both dequantize the same GGUF to float32 and compute in float32;
# differences are summation order only. Logits of SmolLM2 are O(10..40).
LOGIT_ATOL = 2e-3


def _forward_all(model, ids, cache=None):
    cache = cache or model.new_cache(1024)
    tr = chain(ids)
    return model.forward(tr.tokens, torch.arange(len(ids)), tr.ancestors, cache).logits


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "The capital of France is", "Once upon a time, there was a tiny robot who"])
def test_logits_match_transformers(smollm_model, hf_smollm, smollm_tokenizer, prompt):
    ids = smollm_tokenizer.encode(prompt)
    ours = _forward_all(smollm_model, ids)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < LOGIT_ATOL, f"max |logit diff| {err}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_cache_equals_one_pass(smollm_model, smollm_tokenizer):
    """Committing a prompt in pieces and continuing from the cache gives the one-pass logits."""
    ids = smollm_tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it sleeps.")
    full = _forward_all(smollm_model, ids)
    cache = smollm_model.new_cache(1024)
    outs = []
    for a, b in [(0, 5), (5, 6), (6, len(ids))]:
        tr = chain(ids[a:b])
        out = smollm_model.forward(tr.tokens, torch.arange(a, b), tr.ancestors, cache)
        smollm_model.commit(cache, out, torch.arange(b - a))
        outs.append(out.logits)
    assert cache.length == len(ids)
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-3, rtol=0)


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return tokens, parents


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), prefix=st.integers(1, 6))
def test_tree_node_logits_equal_path_alone(smollm_model, seed, n, prefix):
    """Every node of one tree forward has the logits of its root-to-node path run alone."""
    rng = random.Random(seed)
    vocab = smollm_model.cfg.vocab_size
    ctx = [rng.randrange(vocab) for _ in range(prefix)]
    cache = smollm_model.new_cache(256)
    tr = chain(ctx)
    none = torch.empty(0, dtype=torch.long)  # the prefix's logits are not needed
    smollm_model.commit(cache, smollm_model.forward(tr.tokens, torch.arange(prefix), tr.ancestors, cache, logits_rows=none),
                        torch.arange(prefix))
    tokens, parents = _random_tree(rng, n, vocab)
    tree = tree_tensors(tokens, parents)
    out = smollm_model.forward(tree.tokens, prefix + tree.depth, tree.ancestors, cache)
    assert cache.length == prefix  # verify writes nothing
    # One causal forward per leaf's root-to-leaf path: its row d is the path to the path's node at
    # depth d run alone (row d attends to rows 0..d only), so every node is checked against a
    # forward of its own path without one forward per node.
    checked = set()
    for leaf in sorted(set(range(n)) - set(parents)):
        path = torch.nonzero(tree.ancestors[leaf]).flatten().tolist()  # root first (parents precede children)
        alone = chain([tokens[j] for j in path])
        ref = smollm_model.forward(alone.tokens, prefix + torch.arange(len(path)), alone.ancestors, cache).logits
        for d, i in enumerate(path):
            # fp32 through 30 layers; the two forwards differ only in matmul shapes (summation
            # order): observed differences reach ~4e-3 on logits of magnitude ~20-40.
            torch.testing.assert_close(out.logits[i], ref[d], atol=1e-2, rtol=0)
            checked.add(i)
    assert checked == set(range(n))
