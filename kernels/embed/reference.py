"""Embedding lookups in plain PyTorch (the oracle for ``triton.py``)."""

from __future__ import annotations

import torch


def embed_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``ids`` of a float table.

    Args:
        weight: ``[V, H]`` float.
        ids: int64 ids of any shape, each in ``[0, V)``.
        dtype: the result's dtype (None: ``weight``'s), one rounding of each value.

    Returns:
        ``[*ids.shape, H]``.
    """
    rows = weight[ids]
    return rows if dtype is None else rows.to(dtype)


def embed_block(weight: torch.Tensor, roots: torch.Tensor, mask_id: int, block: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The embeddings of a DFlash drafter's blocks ``[root, mask x (block - 1)]``, one per root.

    Args:
        weight: ``[V, H]`` float.
        roots: ``[B]`` int64 root tokens.
        mask_id: the drafter's mask token id (``DrafterConfig.mask_token_id``).
        block: block size ``B`` (rows per root).
        dtype: the result's dtype (None: ``weight``'s).

    Returns:
        ``[B * block, H]``: row ``b * block`` is ``weight[roots[b]]``, the others ``weight[mask_id]``.
    """
    return embed_rows(weight, block_tokens(roots, mask_id, block).reshape(-1), dtype)


def block_tokens(roots: torch.Tensor, mask_id: int, block: int) -> torch.Tensor:
    """``[B, block]`` int64 tokens of the blocks: each root, then ``block - 1`` mask tokens."""
    tokens = torch.full((roots.shape[0], block), int(mask_id), dtype=torch.long, device=roots.device)
    tokens[:, 0] = roots
    return tokens
