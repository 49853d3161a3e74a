"""DDTree on the device: the drafter's token trees built from its per-depth top-K table inside the
step (``draft_service.batched``), the same trees as the host's ``draft_service.tree.build_tree``.

``build_trees_batched`` runs the Triton kernel (``kernels.ddtree.triton``, one launch) for CUDA
tensors when Triton imports (``kernels.dispatch.use_triton``), the plain-PyTorch reference
(``kernels.ddtree.reference``: the contract and the tie rules) otherwise. ``step_output`` writes
the trees and the table into one packed int32 row per batch row (:class:`PackedLayout`), what the
drafter's step copies to the host.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.dispatch import use_triton
from kernels.ddtree import reference as _reference


def build_trees_batched(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: torch.Tensor,
                        top_k: torch.Tensor, depth: torch.Tensor | None = None,
                        max_nodes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [b, N + 1] int32, parents [b, N + 1] int32, count [b] int32)``: every row's tree
    (``kernels.ddtree.reference.build_trees_batched`` documents the contract); Triton for CUDA
    tensors, the reference otherwise (the same results)."""
    if use_triton(lp):
        from kernels.ddtree import triton as _triton

        return _triton.build_trees_batched(lp, tok, roots, budget, top_k, depth, max_nodes)
    return _reference.build_trees_batched(lp, tok, roots, budget, top_k, depth, max_nodes)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The int32 row :func:`step_output` writes per batch row, for a ``[D, K]`` table and trees of
    at most ``nodes`` non-root nodes (``nodes >= D``; ``W = nodes + 1`` columns):

    * ``[0, 2DK)``: the table as ``[D, K, 2]``: the float32 log-prob's bits, the token id;
    * ``[2DK, 2DK + W)``: the tree's tokens (root first; ``-1`` past its nodes);
    * ``[2DK + W, 2DK + 2W)``: the parents (``-1`` for the root and past the nodes);
    * ``2DK + 2W``: the tree's node count, the root included.
    """

    depth: int
    k: int
    nodes: int

    @property
    def width(self) -> int:
        """``W``: columns of the tree arrays."""
        return self.nodes + 1

    @property
    def tokens_at(self) -> int:
        return 2 * self.depth * self.k

    @property
    def parents_at(self) -> int:
        return self.tokens_at + self.width

    @property
    def count_at(self) -> int:
        return self.parents_at + self.width

    @property
    def size(self) -> int:
        """int32 values per row."""
        return self.count_at + 1

    def views(self, out):
        """``(table [b, D, K, 2], tokens [b, W], parents [b, W], count [b])`` views of ``out`` ``[b,
        size]`` (a tensor or a numpy array)."""
        b = out.shape[0]
        table = out[:, : self.tokens_at].reshape(b, self.depth, self.k, 2)
        return (table, out[:, self.tokens_at : self.parents_at], out[:, self.parents_at : self.count_at],
                out[:, self.count_at])


def step_output(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: torch.Tensor, top_k: torch.Tensor,
                depth: torch.Tensor, layout: PackedLayout, out: torch.Tensor) -> None:
    """Write the step's table and every row's tree into ``out`` ``[b, layout.size]`` int32 (device,
    contiguous): one Triton launch for CUDA tensors (the kernel writes the table too), else the
    reference and one copy. Graph-safe.

    Args:
        lp: ``[b, D, K]`` float32 log-probs (rows sorted descending); tok: ``[b, D, K]`` integer ids.
        roots, budget, top_k, depth: ``[b]`` integer per-row root token and tree params
            (:func:`build_trees_batched`).
        layout: the row layout (``layout.depth == D``, ``layout.k == K``).
    """
    b, D, K = lp.shape
    if (D, K) != (layout.depth, layout.k) or tuple(out.shape) != (b, layout.size) or out.dtype != torch.int32:
        raise ValueError(f"layout {layout} / out {tuple(out.shape)} {out.dtype} do not fit a [{b}, {D}, {K}] table")
    table, tokens, parents, count = layout.views(out)
    if use_triton(lp):
        from kernels.ddtree import triton as _triton

        _triton.launch(lp.contiguous(), tok.contiguous(), roots, budget, top_k, depth, layout.nodes, tokens, parents,
                       count, table)
        return
    t, p, c = _reference.build_trees_batched(lp, tok, roots, budget, top_k, depth, layout.nodes)
    tab = torch.stack([lp.float().contiguous().view(torch.int32), tok.to(torch.int32)], dim=-1)
    out.copy_(torch.cat([tab.reshape(b, -1), t, p, c[:, None]], dim=1))


__all__ = ["PackedLayout", "build_trees_batched", "step_output"]
