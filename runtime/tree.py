"""Token trees as they arrive over gRPC: depths, validation and the tensors verify needs
(docs/ARCHITECTURE.md, "Token trees" and "One speculative step").

A tree is two parallel lists: ``tokens[i]`` and ``parents[i]``; node 0 is the root (parent -1),
every other node's parent is an earlier node (topological order). The depth of a node is the
number of edges to the root; its position is ``L + depth``. :func:`tree_depths` is the one place
depths are computed (the engines, the orchestrator's trimming and statistics).

Importing this module imports no torch (the orchestrator stands on it): the functions that build
tensors (:func:`tree_tensors`, :func:`chain`) import it when called.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch


class TreeError(ValueError):
    """A malformed token tree (mapped to INVALID_ARGUMENT)."""


@dataclasses.dataclass
class TreeTensors:
    """Tensors of one validated tree on a device.

    Attributes:
        tokens: ``[T]`` int64.
        parents: ``[T]`` int64 (root: -1).
        depth: ``[T]`` int64.
        ancestors: ``[T, T]`` bool, ``ancestors[i, j]`` = ``j`` is ``i`` or one of its ancestors
            (the attention mask of the tree part; docs/ARCHITECTURE.md, "One speculative step", step 2).
        max_depth: deepest node's depth (host int, known before the forward).
        depth_host: the depths as host ints (positions for the sampler need no device read).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int
    depth_host: list[int]


def tree_depths(parents: Sequence[int]) -> list[int]:
    """The depth of every node of a tree given by its parent indices: 0 for the root, a node's
    parent's depth + 1 for the others.

    Args:
        parents: ``parents[0] == -1``, ``0 <= parents[i] < i`` for ``i >= 1`` (topological order).

    Returns:
        ``[len(parents)]`` host ints.

    Raises:
        TreeError: empty list, root's parent not -1, or a parent that is not an earlier node.
    """
    n = len(parents)
    if n == 0:
        raise TreeError("empty tree: node 0 (the root) is required")
    if parents[0] != -1:
        raise TreeError(f"root's parent must be -1, got {parents[0]}")
    depth = [0] * n
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise TreeError(f"node {i}: parent {p} is not an earlier node")
        depth[i] = depth[p] + 1
    return depth


def analyze_tree(tokens: list[int], parents: list[int], vocab_size: int, max_width: int,
                 max_depth: int | None = None) -> tuple[list[int], list[int]]:
    """Validate a tree and return each node's depth (:func:`tree_depths`) and ancestor bit mask.

    Rules: at least the root; ``len(tokens) == len(parents)``; ``parents[0] == -1``;
    ``0 <= parents[i] < i`` for ``i >= 1``; every token in ``[0, vocab_size)``; at most
    ``max_width`` nodes; depth at most ``max_depth`` (when given).

    Returns:
        ``(depth, bits)``: ``bits[i]`` has bit ``j`` set when node ``j`` is ``i`` or one of its
        ancestors, as a signed 64-bit value (two's complement; only for trees of at most 64
        nodes, else ``bits`` is empty).

    Raises:
        TreeError: the first rule broken (the structure's rules, then the depth, then the tokens).
    """
    n = len(tokens)
    if n == 0:
        raise TreeError("empty tree: node 0 (the root) is required")
    if len(parents) != n:
        raise TreeError(f"tokens ({n}) and parents ({len(parents)}) differ in length")
    if n > max_width:
        raise TreeError(f"tree of {n} nodes exceeds the maximum width {max_width}")
    depth = tree_depths(parents)
    if max_depth is not None and max(depth) > max_depth:
        i = next(i for i, d in enumerate(depth) if d > max_depth)
        raise TreeError(f"node {i}: depth {depth[i]} exceeds {max_depth}")
    bits = [1] * n if n <= 64 else []
    for i in range(1, len(bits)):
        bits[i] = bits[parents[i]] | (1 << i)
    for i, tok in enumerate(tokens):
        if not 0 <= tok < vocab_size:
            raise TreeError(f"node {i}: token {tok} outside the vocabulary [0, {vocab_size})")
    if n == 64 and bits:
        bits = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]
    return depth, bits


def validate_tree(tokens: list[int], parents: list[int], vocab_size: int, max_width: int, max_depth: int | None = None) -> None:
    """Check a tree's structure (the rules of :func:`analyze_tree`); raise :class:`TreeError`
    with the first problem found."""
    analyze_tree(tokens, parents, vocab_size, max_width, max_depth)


def tree_tensors(tokens: list[int], parents: list[int], device: torch.device | str = "cpu") -> TreeTensors:
    """Depths and ancestor mask of a validated tree (host loop over ``T`` nodes, then one copy).

    Raises:
        TreeError: a malformed parent list (:func:`tree_depths`).
    """
    import torch

    n = len(tokens)
    depth = tree_depths(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n):
        anc[i] = anc[parents[i]]
        anc[i, i] = True
    return TreeTensors(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depth=torch.tensor(depth, dtype=torch.long, device=device),
        ancestors=anc.to(device),
        max_depth=max(depth),
        depth_host=depth,
    )


def chain(tokens: list[int], device: torch.device | str = "cpu") -> TreeTensors:
    """Tree tensors of a chain (each node the parent of the next): a causal mask."""
    return tree_tensors(tokens, [i - 1 for i in range(len(tokens))], device)
