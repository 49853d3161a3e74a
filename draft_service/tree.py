"""Turning the drafter's per-depth distributions into a token tree.

A tree is two parallel lists (``dflash_grpc.v1.TokenTree``): node 0 is the root (the last emitted
token, parent -1); every other node ``i`` has a token and a parent ``0 <= parents[i] < i``; a node's
depth is one more than its parent's, and the node stands at position ``L + depth``.

* :func:`build_chain`: the greedy chain, one child per node (argmax of each depth).
* ``build_tree(root, logits, budget, top_k)`` (DDTree, DESIGN.md "Tree builder") is not
  implemented yet: the draft service proposes chains only (it advertises the feature "chain").
"""

from __future__ import annotations

import torch


def build_chain(root_token: int, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy chain below ``root_token``.

    Args:
        root_token: token of node 0.
        logits: ``[D, V]`` (any float dtype, any device): row ``d`` is the distribution at depth
            ``d + 1``. ``D`` may be 0.

    Returns:
        ``(tokens, parents)`` of ``D + 1`` nodes: ``tokens = [root, argmax(logits[0]), ...]``,
        ``parents = [-1, 0, 1, ..., D - 1]``. Ties go to the lowest token id (``torch.argmax``).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [depth, vocab], got {tuple(logits.shape)}")
    picks = torch.argmax(logits, dim=-1).tolist() if logits.shape[0] else []
    tokens = [int(root_token)] + [int(t) for t in picks]
    parents = [i - 1 for i in range(len(tokens))]
    return tokens, parents
