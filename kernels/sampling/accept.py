"""The acceptance walk of a batch of verified token trees, on device tensors of fixed shape.

The batched, graph-safe form of :func:`kernels.sampling.reference.accept_path` (step 3 in
docs/ARCHITECTURE.md, "One speculative step"): no host reads, no data-dependent shapes, so it runs
inside the GPU engine's CUDA graphs. :func:`accept_trees_reference` is the walk in plain tensor
ops (the CPU path and the oracle); :func:`accept_trees` runs it as one Triton kernel on CUDA.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def accept_trees(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    choice: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`accept_trees_reference` (same arguments, results and values): on CUDA one Triton
    launch (``kernels.sampling.triton.accept_trees``, one program per batch row), where the
    reference's tensor ops are about 25 small kernels of every verify step, each a break in the
    chain of programmatic dependent launches (``kernels.pdl``); the reference otherwise."""
    if use_triton(tokens):
        from kernels.sampling import triton as _triton

        return _triton.accept_trees(tokens, parents, ancestors, depth, valid, choice)
    return accept_trees_reference(tokens, parents, ancestors, depth, valid, choice)


def accept_trees_reference(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    depth: torch.Tensor,
    valid: torch.Tensor,
    choice: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path of every row of a batch of trees.

    A non-root node matches when its token equals the target's choice at its parent; a node is on
    the accepted path when it and all its ancestors match; the path ends at the deepest such node
    (the lowest index among equally deep ones). The bonus token is the target's choice at the
    path's end.

    Args:
        tokens: ``[B, W]`` int64 node tokens (node 0 = the root).
        parents: ``[B, W]`` int64 (``-1`` for the root and padded nodes).
        ancestors: ``[B, W]`` int64 bit masks (bit ``j``: node ``j`` is the node or an ancestor;
            ``W <= 64``).
        depth: ``[B, W]`` int64.
        valid: ``[B, W]`` bool, false for padded nodes (never accepted).
        choice: ``[B, W]`` int64 the target's token at every node.

    Returns:
        ``(path [B, W] int64, n_accept [B] int64, bonus [B] int64)``: ``path[b, :n_accept[b]]``
        are the path's nodes root first (the rest is unspecified), ``n_accept = k + 1``.
    """
    bsz, w = tokens.shape
    idx = torch.arange(w, device=tokens.device)
    match = (tokens == choice.gather(1, parents.clamp(min=0))) & valid & (parents >= 0)
    match[:, 0] = True
    bit = torch.ones_like(idx) << idx                                  # 1 << j (bit 63 wraps negative)
    mismatch = torch.where(match, 0, bit).sum(1, keepdim=True)        # distinct bits: sum == or
    on_path = (ancestors & mismatch) == 0
    score = torch.where(on_path, depth * (w + 1) + (w - idx), -1)
    end = score.argmax(1, keepdim=True)
    in_path = ((ancestors.gather(1, end) >> idx) & 1).bool()
    n_accept = in_path.sum(1)
    slot = torch.where(in_path, depth, w)                              # path node at its depth
    path = torch.zeros(bsz, w + 1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, idx.expand(bsz, w))
    return path[:, :w].contiguous(), n_accept, choice.gather(1, end)[:, 0]
