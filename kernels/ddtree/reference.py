"""DDTree for a batch of top-K tables in plain PyTorch (any device; the CPU path and the oracle of
``kernels.ddtree.triton``).

The drafter's step ends with a per-depth top-K table per batch row (``lp [b, D, K]`` float32
log-probabilities, each row sorted descending, and their ``tok [b, D, K]`` token ids). The tree of
a row is what the host's best-first search ``draft_service.tree.build_tree`` builds from the row's
table, and it is built here by the same search, run for all rows at once with fixed shapes: per
row a frontier (the host's heap) of ``N + 1`` slots; every round pops each row's best entry, the
entry with the largest score, then the smaller depth, then the earlier push (the host heap's order
``(-score, depth, push order)``); popping a node appends it and pushes its next sibling (into the
popped slot) and its first child (into a new slot), as the host does. Scores are float64 sums
along the path in depth order (root ``0.0``, then ``+ lp`` depth by depth), the same additions as
the host's, so every comparison is the host's and the trees are the same node for node, ties
included (``-0.0`` and ``0.0`` compare equal, as in Python).

One difference from the host code, not in the result: the host seeds the heap with the whole top-1
chain (push orders ``1..depth``); here the chain node of depth ``d + 1`` is pushed when the chain
node of depth ``d`` is popped, with its seed's push order ``d + 2``. It cannot be popped earlier
(its score is at most its parent's and it is deeper), so the pops are the same.

NaN log-probabilities: the tree is still topological (a node is pushed after its parent is popped)
and within the budget, but the host's comparisons of NaN differ from these, so the trees may
differ.
"""

from __future__ import annotations

import torch

#: Sort key of an empty frontier slot: below the key of every float64 score but one negative NaN.
INVALID = -0x7FFFFFFFFFFFFFFF
_LOW63 = 0x7FFFFFFFFFFFFFFF
#: A frontier entry's tie-break ``depth << DEPTH_SHIFT | push order`` (int32; push orders < 2**20).
DEPTH_SHIFT = 20


def score_key(score: torch.Tensor) -> torch.Tensor:
    """Order-preserving int64 key of float64 ``score``: ``a < b`` iff ``key(a) < key(b)`` for
    non-NaN values, ``-inf`` included; ``-0.0`` gets the key of ``0.0`` (key 0)."""
    bits = score.view(torch.int64)
    key = bits ^ ((bits >> 63) & _LOW63)
    return torch.where(score == 0, torch.zeros_like(key), key)


def row_params(budget: torch.Tensor, top_k: torch.Tensor, depth: torch.Tensor, D: int, K: int, max_nodes: int):
    """Per row (int64 ``[b]`` each, ``draft_service.tree.build_tree``'s rules):

    * ``n_depth``: table rows that are candidates, ``depth`` clamped to ``[0, D]``;
    * ``chain``: the tree is the top-1 chain (``budget <= 0``, ``top_k <= 1`` or ``n_depth == 0``)
      of ``n_chain`` nodes (``n_depth``, cut to ``budget`` when ``budget > 0``);
    * ``k``: candidates per depth of a DDTree, ``min(top_k, budget, K)``;
    * ``pops``: DDTree nodes to pop, ``min(budget, max_nodes)`` (0 for a chain).
    """
    n_depth = depth.clamp(0, D)
    chain = (budget <= 0) | (top_k <= 1) | (n_depth == 0)
    n_chain = torch.where(budget <= 0, n_depth, torch.minimum(budget, n_depth))
    k = torch.minimum(torch.minimum(top_k, budget), torch.full_like(top_k, K))
    pops = torch.where(chain, torch.zeros_like(budget), budget.clamp(max=max_nodes))
    return n_depth, chain, n_chain, k, pops


def build_trees_batched(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: torch.Tensor,
                        top_k: torch.Tensor, depth: torch.Tensor | None = None,
                        max_nodes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree of every row (module docstring): equal to ``draft_service.tree.build_tree(roots[r],
    TopK(lp[r, :depth[r]], tok[r, :depth[r]]), budget[r], top_k[r])`` when the row's tree has at
    most ``max_nodes`` non-root nodes (always for a chain); a DDTree row with ``budget[r] >
    max_nodes`` gets the host tree's first ``max_nodes`` nodes. On CUDA graph-safe (no host reads,
    no value-dependent shapes; ``N`` rounds), elsewhere it runs as many rounds as the rows need.

    Args:
        lp: ``[b, D, K]`` float log-probabilities, each ``[r, d]`` row sorted descending (row ``d``
            = depth ``d + 1``); read as float64 (exact for float32 values).
        tok: ``[b, D, K]`` integer token ids of those entries.
        roots: ``[b]`` integer root tokens.
        budget, top_k: ``[b]`` integer tree params: ``budget <= 0`` or ``top_k <= 1`` gives the chain
            (cut to ``budget`` nodes when ``budget > 0``), else the ``budget`` best nodes with ``top_k``
            candidates per depth (cut to ``K``).
        depth: ``[b]`` integer table rows to use per row (clamped to ``[0, D]``); default ``D``.
        max_nodes: ``N``, the most non-root nodes of a DDTree (``max(N, D)`` columns are returned, room
            for any chain); default ``max(D, budget.max())`` (a host read).

    Raises:
        ValueError: ``D`` or ``K`` is 0.

    Returns:
        ``(tokens [b, N + 1] int32, parents [b, N + 1] int32, count [b] int32)``: row ``r``'s tree is
        ``tokens[r, :count[r]]`` / ``parents[r, :count[r]]`` (node 0 = the root, parent -1; every
        other node after its parent, in the host's pop order); the rest of the row is ``-1``.
    """
    b, D, K = lp.shape
    if D < 1 or K < 1:
        raise ValueError(f"empty table [{b}, {D}, {K}]")
    dev = lp.device
    i64 = dict(dtype=torch.long, device=dev)
    budget, top_k, roots = budget.to(**i64), top_k.to(**i64), roots.to(**i64)
    depth = torch.full((b,), D, **i64) if depth is None else depth.to(**i64)
    N = max(D, int(budget.max()) if b else 0) if max_nodes is None else max(D, int(max_nodes))
    n_depth, chain, n_chain, k, pops = row_params(budget, top_k, depth, D, K, N)
    lp64 = lp.double()
    tok32 = tok.to(torch.int32)
    rows = torch.arange(b, device=dev)
    place = torch.arange(N + 1, device=dev)
    tokens = torch.full((b, N + 1), -1, dtype=torch.int32, device=dev)
    parents = torch.full((b, N + 1), -1, dtype=torch.int32, device=dev)
    tokens[:, 0] = roots.to(torch.int32)
    # chains: node i = the top-1 token of depth i, under node i - 1
    on_chain = chain[:, None] & (place >= 1) & (place <= n_chain[:, None])
    col0 = torch.cat([tok32[:, :, 0], torch.full((b, N + 1 - D), -1, dtype=torch.int32, device=dev)], 1)
    tokens = torch.where(on_chain, col0.roll(1, 1), tokens)
    parents = torch.where(on_chain, (place - 1).to(torch.int32), parents)
    count = torch.where(chain, n_chain + 1, torch.ones_like(n_chain))
    # DDTree rows: the frontier, N + 1 slots; slot 0 = the depth-1 chain node (push order 1)
    S = N + 1
    key = torch.full((b, S), INVALID, **i64)
    tb = torch.full((b, S), -1, dtype=torch.int32, device=dev)   # depth << DEPTH_SHIFT | push order
    r_of = torch.zeros(b, S, **i64)                                 # rank among siblings
    pscore = torch.zeros(b, S, dtype=torch.float64, device=dev)     # the parent's score
    pidx = torch.zeros(b, S, **i64)                                 # the parent's node index
    seed = ~chain
    key[:, 0] = torch.where(seed, score_key(lp64[:, 0, 0].clone()), key[:, 0])
    tb[:, 0] = 1
    is_chain = torch.zeros(b, S, dtype=torch.bool, device=dev)
    is_chain[:, 0] = True
    order = n_depth.clone()                                          # push orders used so far
    rounds = N if lp.is_cuda else int(pops.max()) if b else 0
    for i in range(1, rounds + 1):
        best = key.max(1, keepdim=True).values
        live = (i <= pops) & (best[:, 0] != INVALID)
        tie = torch.where(key == best, tb, torch.full_like(tb, 1 << 30))
        slot = tie.argmin(1)                                         # unique: push orders differ
        at = (rows, slot)
        d = (tb[at] >> DEPTH_SHIFT).long().clamp(min=0)            # (an empty slot: tb -1)
        r = r_of[at]
        # the popped node's score: its parent's score + its log-prob (the host's addition)
        score = pscore[at] + lp64[rows, d, r]
        node = count                                                 # its index in the tree
        cols = node.clamp(max=N)
        tokens[rows, cols] = torch.where(live, tok32[rows, d, r], tokens[rows, cols])
        parents[rows, cols] = torch.where(live, pidx[at].to(torch.int32), parents[rows, cols])
        count = count + live.long()
        # next sibling, into the popped slot (or the slot empties)
        sib = live & (r + 1 < k)
        r1 = (r + 1).clamp(max=K - 1)
        order = order + sib.long()
        key[at] = torch.where(sib, score_key(pscore[at] + lp64[rows, d, r1]), torch.where(live, INVALID, key[at]))
        tb[at] = torch.where(sib, (d << DEPTH_SHIFT | order).to(torch.int32), torch.where(live, -1, tb[at]))
        r_of[at] = torch.where(sib, r + 1, r)
        was_chain = is_chain[at]
        is_chain[at] = torch.where(live, False, was_chain)
        # first child, into slot i: a chain node's is the next chain node (its seed's push order)
        child = live & (d + 1 < n_depth)
        d1 = (d + 1).clamp(max=D - 1)
        order = order + (child & ~was_chain).long()
        corder = torch.where(was_chain, d + 2, order)
        new = (rows, torch.full_like(rows, i))
        key[new] = torch.where(child, score_key(score + lp64[rows, d1, 0]), INVALID)
        tb[new] = torch.where(child, (d1 << DEPTH_SHIFT | corder).to(torch.int32), -1)
        r_of[new] = 0
        pscore[new] = score
        pidx[new] = node
        is_chain[new] = child & was_chain
    return tokens, parents, count.to(torch.int32)
