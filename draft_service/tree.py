"""Turning the drafter's per-depth distributions into a token tree.

A tree is two parallel lists (``dflash_grpc.v1.TokenTree``): node 0 is the root (the last emitted
token, parent -1); every other node ``i`` has a token and a parent ``0 <= parents[i] < i``; a node's
depth is one more than its parent's, and the node stands at position ``L + depth``.

* :func:`build_chain`: the greedy chain, one child per node (argmax of each depth).
* :func:`build_tree`: DDTree (DESIGN.md "Tree builder"): best-first over the per-depth top-K
  candidates, scored by the summed log-probability of the path, seeded with the top-1 chain,
  stopped at a node budget.
"""

from __future__ import annotations

import heapq

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


def build_tree(root_token: int, logits: torch.Tensor, budget: int, top_k: int) -> tuple[list[int], list[int]]:
    """DDTree: the ``budget`` most likely draft nodes under ``root_token``.

    The drafter gives one distribution per depth (block diffusion predicts every position of the
    block at once, so a depth's candidates do not depend on the parent's token). The candidates at
    depth ``d`` are that depth's top-``top_k`` tokens; a node's score is the sum of its path's
    log-probabilities. Best-first search (DESIGN.md, "Tree builder"): the heap is seeded with the
    top-1 chain; popping a node adds it to the tree and pushes its next sibling (the next-ranked
    token at its depth, same parent) and its first child (the top token one depth down); nodes
    are popped until the tree has ``budget`` non-root nodes. Scores only fall along a path, so a
    node is popped after its parent, and the tree is exactly the ``budget`` best-scoring nodes of
    the full candidate tree (ties: shallower first, then first pushed): under the drafter's
    distributions, the set that maximises the expected number of accepted tokens.

    Args:
        root_token: token of node 0.
        logits: ``[D, V]``: row ``d`` is the distribution at depth ``d + 1``.
        budget: most non-root nodes; ``budget <= 0`` gives the full chain (``D`` nodes).
        top_k: candidates per depth; ``top_k <= 1`` gives the chain (cut to ``budget`` nodes).

    Returns:
        ``(tokens, parents)`` in topological order (a node after its parent); siblings carry
        distinct tokens.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [depth, vocab], got {tuple(logits.shape)}")
    depth = logits.shape[0]
    if budget <= 0 or top_k <= 1 or depth == 0:
        tokens, parents = build_chain(root_token, logits)
        if budget > 0:
            tokens, parents = tokens[: budget + 1], parents[: budget + 1]
        return tokens, parents
    k = min(top_k, logits.shape[1])
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    lp = top.values.cpu().tolist()        # [D][k]: the one host read
    tok = top.indices.cpu().tolist()
    tokens, parents = [int(root_token)], [-1]
    index = {(): 0}                       # node id (its ranks from the root) -> tree index
    heap: list[tuple[float, int, int, tuple[int, ...]]] = []  # (-score, depth, push order, id)
    pushed: set[tuple[int, ...]] = set()
    scores = {(): 0.0}

    def push(node: tuple[int, ...]) -> None:
        d = len(node) - 1
        if d >= depth or node[-1] >= k or node in pushed:
            return
        pushed.add(node)
        score = scores[node[:-1]] + lp[d][node[-1]] if node[:-1] in scores else None
        if score is None:  # a seeded chain node whose parent is not scored yet: score from the chain
            score = sum(lp[j][0] for j in range(d + 1))
        heapq.heappush(heap, (-score, d, len(pushed), node))

    for d in range(depth):                # seed: the top-1 chain
        push((0,) * (d + 1))
    while len(tokens) - 1 < budget and heap:
        neg, d, _, node = heapq.heappop(heap)
        scores[node] = -neg
        index[node] = len(tokens)
        tokens.append(tok[d][node[-1]])
        parents.append(index[node[:-1]])
        push(node[:-1] + (node[-1] + 1,))  # next sibling
        push(node + (0,))                  # first child
    return tokens, parents
