"""Rotary position embedding and the K/V write of the GPU engine, plain PyTorch (the oracle for
``triton.py``).

Rotary embedding (Su et al., "RoFormer", 2021) in the NeoX / HF ``rotate_half`` layout on the
first ``r`` dims of each head (partial rotary, as Qwen3.5's gated attention uses); the math is
:func:`target_service.models.layers.apply_rope`.
"""

from __future__ import annotations

import torch

from target_service.models.layers import apply_rope_rows


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write ``k`` and ``v`` into the pool, return the rotated ``q``.

    Args:
        q: ``[N, Hq, D]``; k, v: ``[N, Hkv, D]`` (``N = B * W`` rows, row ``n`` = node ``n % W``
            of batch row ``n // W``).
        cos, sin: ``[N, r]`` float32 rotary tables of the rows' positions (``r <= D``, even).
        k_pool, v_pool: ``[S, R, Hkv, D]`` one layer of the pool (written in place).
        slots: ``[B]`` int64; rows: ``[B, W]`` int64 pool rows of the nodes.

    Returns:
        ``[N, Hq, D]`` rotated queries in ``q``'s dtype.
    """
    b, w = rows.shape
    where = (slots[:, None], rows)
    k_pool[where] = apply_rope_rows(k, cos, sin).reshape(b, w, *k.shape[1:]).to(k_pool.dtype)
    v_pool[where] = v.reshape(b, w, *v.shape[1:]).to(v_pool.dtype)
    return apply_rope_rows(q, cos, sin)
