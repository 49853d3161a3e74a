"""DDTree builder: shape rules and best-first optimality against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from draft_service.tree import build_chain, build_tree
from runtime.tree import tree_depths as _depths, validate_tree


def test_chain_cases():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    chain = build_chain(7, logits)
    assert build_tree(7, logits, budget=0, top_k=4) == chain
    assert build_tree(7, logits, budget=0, top_k=1) == chain
    t, p = build_tree(7, logits, budget=3, top_k=1)
    assert (t, p) == (chain[0][:4], chain[1][:4])
    assert build_tree(7, logits[:0], budget=5, top_k=3) == ([7], [-1])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, 4), k=st.integers(2, 3), budget=st.integers(1, 20))
def test_best_first_takes_the_most_likely_nodes(seed, depth, k, budget):
    """The tree's nodes are the ``budget`` highest-scoring nodes (path log-prob sums) of the full
    k-ary candidate tree: the multiset of scores equals brute force's top ``budget``."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    logits = torch.randn(depth, vocab, generator=gen) * 2
    tokens, parents = build_tree(3, logits, budget, k)
    total = sum(k**d for d in range(1, depth + 1))
    assert len(tokens) == 1 + min(budget, total)
    validate_tree(tokens, parents, vocab_size=vocab, max_width=10**6, max_depth=depth)
    lp = torch.log_softmax(logits.double(), -1)
    top = torch.topk(lp, k, -1)
    # scores of the built tree's nodes
    dep = _depths(parents)
    score = [0.0] * len(tokens)
    for i in range(1, len(tokens)):
        score[i] = score[parents[i]] + lp[dep[i] - 1, tokens[i]].item()
        assert tokens[i] in top.indices[dep[i] - 1].tolist()
    # siblings are distinct
    for i in range(len(tokens)):
        kids = [tokens[j] for j in range(len(tokens)) if parents[j] == i]
        assert len(kids) == len(set(kids))
    # brute force over all rank paths
    all_scores = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            all_scores.append(sum(top.values[j, r].item() for j, r in enumerate(ranks)))
    best = sorted(all_scores, reverse=True)[: len(tokens) - 1]
    assert sorted(score[1:], reverse=True) == pytest.approx(best, abs=1e-9)


def test_confident_drafter_gives_the_chain_then_branches():
    """With peaked distributions the top-1 chain is taken whole before any sibling."""
    logits = torch.full((5, 30), -10.0)
    for d in range(5):
        logits[d, d + 1] = 10.0
        logits[d, 20 + d] = 0.0   # a distant second choice at every depth
    tokens, parents = build_tree(1, logits, budget=8, top_k=2)
    chain, _ = build_chain(1, logits)
    assert tokens[:6] == chain and parents[:6] == [-1, 0, 1, 2, 3, 4]
    assert tokens[6] == 20 and parents[6] == 0   # then the best sibling: depth 1's second choice
