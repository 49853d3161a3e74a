"""Turning the drafter's per-depth distributions into a token tree.

A tree is two parallel lists (``dflash_grpc.v1.TokenTree``): node 0 is the root (the last emitted
token, parent -1); every other node ``i`` has a token and a parent ``0 <= parents[i] < i``; a node's
depth is one more than its parent's, and the node stands at position ``L + depth``.

* :func:`build_chain`: the greedy chain, one child per node (argmax of each depth).
* :func:`build_tree`: DDTree (docs/ARCHITECTURE.md, "Token trees"): best-first over the per-depth top-K
  candidates, scored by the summed log-probability of the path, seeded with the top-1 chain,
  stopped at a node budget. It takes the logits or a precomputed per-depth top-K table
  (:class:`TopK`: the batched drafter's one device-to-host copy per step).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np
import torch

from kernels.topk.reference import topk_log_softmax


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


@dataclasses.dataclass(frozen=True)
class TopK:
    """The per-depth top-K table a tree is built from (one host read of the drafter's output).

    Attributes:
        logprobs: ``[D, K]`` log-probabilities (log-softmax of the depth's logits, float32
            values), each row sorted descending; row ``d`` is depth ``d + 1``.
        tokens: ``[D, K]`` the token ids of those entries.

    Either numpy arrays or nested lists; :func:`build_tree` reads them as Python floats / ints.
    """

    logprobs: Any
    tokens: Any

    @property
    def depth(self) -> int:
        return len(self.tokens)

    @property
    def k(self) -> int:
        return len(self.tokens[0]) if len(self.tokens) else 0

    def head(self, depth: int) -> "TopK":
        """The first ``depth`` rows."""
        return TopK(self.logprobs[:depth], self.tokens[:depth])


def topk_table(logits: torch.Tensor, k: int) -> TopK:
    """:class:`TopK` of ``logits`` ``[D, V]``: ``torch.topk(log_softmax(logits.float()), min(k, V))``
    (what :func:`build_tree` computes), read to the host as lists."""
    values, indices = topk_log_softmax(logits, min(k, logits.shape[1]))
    return TopK(values.cpu().tolist(), indices.cpu().tolist())


def build_tree(root_token: int, logits: "torch.Tensor | TopK", budget: int, top_k: int) -> tuple[list[int], list[int]]:
    """DDTree: the ``budget`` most likely draft nodes under ``root_token``.

    The drafter gives one distribution per depth (block diffusion predicts every position of the
    block at once, so a depth's candidates do not depend on the parent's token). The candidates at
    depth ``d`` are that depth's top-``top_k`` tokens; a node's score is the sum of its path's
    log-probabilities. Best-first search (docs/ARCHITECTURE.md, "Token trees"): the heap is seeded with the
    top-1 chain; popping a node adds it to the tree and pushes its next sibling (the next-ranked
    token at its depth, same parent) and its first child (the top token one depth down); nodes
    are popped until the tree has ``budget`` non-root nodes. Scores only fall along a path, so a
    node is popped after its parent, and the tree is exactly the ``budget`` best-scoring nodes of
    the full candidate tree (ties: shallower first, then first pushed): under the drafter's
    distributions, the set that maximises the expected number of accepted tokens.

    Args:
        root_token: token of node 0.
        logits: ``[D, V]``: row ``d`` is the distribution at depth ``d + 1``; or the precomputed
            :class:`TopK` table of those rows (``D x K``, any ``K >= 1``: ``top_k`` is cut to
            ``K``; the chain is its first column). The table from :func:`topk_table` gives the
            same tree as the logits it was computed from.
        budget: most non-root nodes; ``budget <= 0`` gives the full chain (``D`` nodes).
        top_k: candidates per depth; ``top_k <= 1`` gives the chain (cut to ``budget`` nodes).

    Returns:
        ``(tokens, parents)`` in topological order (a node after its parent); siblings carry
        distinct tokens.
    """
    table = logits if isinstance(logits, TopK) else None
    if table is None and logits.dim() != 2:
        raise ValueError(f"logits must be [depth, vocab], got {tuple(logits.shape)}")
    depth = table.depth if table is not None else logits.shape[0]
    if budget <= 0 or top_k <= 1 or depth == 0:
        if table is None:
            tokens, parents = build_chain(root_token, logits)
        else:
            tokens = [int(root_token)] + [int(row[0]) for row in table.tokens]
            parents = [i - 1 for i in range(len(tokens))]
        if budget > 0:
            tokens, parents = tokens[: budget + 1], parents[: budget + 1]
        return tokens, parents
    # a node of rank r among its siblings comes after its r better siblings, so no tree of
    # ``budget`` nodes uses a rank past ``budget - 1``: a larger top_k reads nothing more
    top_k = min(top_k, budget)
    if table is None:
        table = topk_table(logits, top_k)  # the one host read
    k = min(top_k, table.k)
    return _best_first(int(root_token), table, budget, k)


def _best_first(root_token: int, table: TopK, budget: int, k: int) -> tuple[list[int], list[int]]:
    """The best-first search of :func:`build_tree` over the first ``k`` columns of ``table``.

    A candidate is (depth ``d``, rank ``r`` among its depth's top-``k``, parent). Heap entries are
    ``(-score, d, push order, r, parent score, parent tree index or -1 for "the chain node one
    depth up")``; the top-1 chain is seeded first (scores = prefix sums of the rank-0 log-probs),
    so a chain node's first child is never pushed again. Popping pushes the next sibling, then the
    first child, as in docs/ARCHITECTURE.md, "Token trees"; ties go to the shallower node, then
    the earlier push.
    """
    lp = _rows(table.logprobs, k, float)  # [D][k] Python floats
    tok = _rows(table.tokens, k, int)
    depth = len(tok)
    tokens, parents = [root_token], [-1]
    chain_at = [0] * (depth + 1)          # tree index of the chain node at depth d - 1 (root: 0)
    heap: list[tuple] = []
    push = heapq.heappush
    score = 0.0
    for d in range(depth):                # seed: the top-1 chain (parent: the chain node above)
        parent_score = score
        score = score + lp[d][0]
        heap.append((-score, d, d + 1, 0, parent_score, -1))
    order = depth
    heapq.heapify(heap)
    pop = heapq.heappop
    while len(tokens) <= budget and heap:
        neg, d, _, r, pscore, pidx = pop(heap)
        chain = pidx < 0
        if chain:
            pidx = chain_at[d]
        i = len(tokens)
        tokens.append(tok[d][r])
        parents.append(pidx)
        if chain and r == 0:
            chain_at[d + 1] = i
        if r + 1 < k:                      # next sibling
            order += 1
            push(heap, (-(pscore + lp[d][r + 1]), d, order, r + 1, pscore, pidx))
        if d + 1 < depth and not (chain and r == 0):   # first child (a chain node's is seeded)
            order += 1
            push(heap, (neg - lp[d + 1][0], d + 1, order, 0, -neg, i))
    return tokens, parents


def _rows(a: Any, k: int, cast: type) -> list[list]:
    """The first ``k`` columns of a ``[D, K]`` table (numpy array, tensor or nested lists) as
    nested Python lists of ``cast`` values."""
    if isinstance(a, torch.Tensor):
        a = a.cpu().numpy()
    if isinstance(a, np.ndarray):
        return a[:, :k].tolist() if a.size else [[] for _ in range(len(a))]
    return [[cast(x) for x in row[:k]] for row in a]


def bench(budgets: list[int], top_ks: list[int], depth: int = 15, vocab: int = 49152, trials: int = 200,
          seed: int = 0) -> list[dict[str, float]]:
    """Host time per item of a tree from the batched drafter's step, microseconds (median and 90th
    percentile over ``trials`` random tables: logits ``N(0, 3^2)`` over ``vocab`` tokens, ``depth``
    rows, table width ``max(top_ks)``):

    * ``median_us`` / ``p90_us``: :func:`build_tree` from the precomputed :class:`TopK` table
      (what the engine does per item with host trees);
    * ``read_us``: reading a tree the step built on the device (``BatchedDrafter(device_trees=True)``:
      the node count, two slices of the packed rows to lists, the item's :class:`TopK` views), the
      rows made here by ``kernels.ddtree.reference`` (the same trees: checked)."""
    import statistics
    import time

    from kernels.ddtree.reference import build_trees_batched

    gen = torch.Generator().manual_seed(seed)
    width = max(top_ks)
    lp_all, tok_all = topk_log_softmax(torch.randn(trials, depth, vocab, generator=gen) * 3, width)
    lp_all = lp_all.contiguous()
    lp_np, tok_np = lp_all.numpy(), tok_all.to(torch.int32).numpy()
    tables = [TopK(lp_np[i], tok_np[i]) for i in range(trials)]
    rows = []
    for budget in budgets:
        for k in top_ks:
            times, reads = [], []
            n_all = torch.full((trials,), 1, dtype=torch.long)
            t_dev, p_dev, c_dev = (x.numpy() for x in build_trees_batched(
                lp_all, tok_all, n_all, n_all * budget, n_all * k, None, max(budget, depth)))
            for i, t in enumerate(tables):
                t0 = time.perf_counter()
                want = build_tree(1, t, budget, k)
                times.append((time.perf_counter() - t0) * 1e6)
                t0 = time.perf_counter()
                n = int(c_dev[i])
                got = (t_dev[i, :n].tolist(), p_dev[i, :n].tolist())
                TopK(lp_np[i, :depth], tok_np[i, :depth])
                reads.append((time.perf_counter() - t0) * 1e6)
                assert got == want, (budget, k, i)
            times.sort()
            rows.append({"budget": budget, "top_k": k, "median_us": statistics.median(times),
                         "p90_us": times[int(0.9 * (len(times) - 1))], "read_us": statistics.median(reads)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m draft_service.tree``: print :func:`bench` (host time per item: DDTree built on the
    host, or read from the device's rows)."""
    import argparse

    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m draft_service.tree", description="host time of DDTree from a top-K table")
    ap.add_argument("--budgets", type=ints, default=[0, 16, 32, 64])
    ap.add_argument("--top-k", type=ints, default=[1, 4, 8])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--trials", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"{'budget':>6} {'top_k':>5} {'median us':>10} {'p90 us':>8} {'read us':>8}")
    for r in bench(args.budgets, args.top_k, args.depth, trials=args.trials):
        print(f"{r['budget']:>6} {r['top_k']:>5} {r['median_us']:>10.1f} {r['p90_us']:>8.1f} {r['read_us']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
