"""Rotary position embedding and the K/V write of the GPU engine, plain PyTorch (the oracle for
``triton.py``).

Rotary embedding (Su et al., "RoFormer", 2021) in the NeoX / HF ``rotate_half`` layout on the
first ``r`` dims of each head (partial rotary, as Qwen3.5's gated attention uses):
:func:`rope_cos_sin` and :func:`apply_rope` are the math (angles in float64 so large positions keep
their precision), shared by the target models and the DFlash drafter; :func:`apply_rope_rows` and
:func:`rope_table` are the GPU engine's rows-first layout and per-position tables.
"""

from __future__ import annotations

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``cos, sin`` of shape ``[*positions.shape, rope_dim]``: the ``rope_dim / 2``
    frequencies ``theta^(-2i / rope_dim)`` repeated twice (NeoX layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float64) / rope_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``r = cos.shape[-1]`` dims of each head;
    the remaining ``D - r`` dims pass through. Computed in float32 (float64 for float64 ``x``),
    returned in ``x``'s dtype.

    Args:
        x: ``[..., heads, rows, D]``.
        cos, sin: ``[..., rows, r]`` from :func:`rope_cos_sin` (broadcast over heads), ``r <= D`` even.
    """
    acc = _acc(x.dtype)
    r = cos.shape[-1]
    xf = x[..., :r].to(acc)
    half = r // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    out = (xf * cos.to(acc).unsqueeze(-3) + rot * sin.to(acc).unsqueeze(-3)).to(x.dtype)
    return torch.cat([out, x[..., r:]], dim=-1) if r < x.shape[-1] else out


def apply_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for rows-first tensors: ``x`` ``[N, heads, D]``, ``cos``/``sin``
    ``[N, r]`` (one position per row) -> ``[N, heads, D]``."""
    return apply_rope(x.transpose(0, 1), cos, sin).transpose(0, 1)


def rope_table(max_positions: int, rope_dim: int, theta: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` ``[max_positions, rope_dim]``: :func:`rope_cos_sin` of positions
    ``0..max_positions-1`` computed in float64 and rounded once, so indexing the table by position
    gives exactly what :func:`apply_rope` uses (it computes in float32)."""
    cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), rope_dim, theta)
    return cos.float(), sin.float()



def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor | None = None, table: bool = False) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write ``k`` and ``v`` into the pool, return the rotated ``q``.

    Args:
        q: ``[N, Hq, D]``; k, v: ``[N, Hkv, D]`` (``N = B * W`` rows, row ``n`` = node ``n % W``
            of batch row ``n // W``).
        cos, sin: ``[N, r]`` float32 rotary tables of the rows' positions (``r <= D``, even); with
            ``table``, ``[P, r]`` tables of positions ``0..P-1`` (:func:`rope_table`) read at each
            node's position.
        k_pool, v_pool: ``[S, R, Hkv, D]`` one layer of the pool (written in place).
        slots: ``[B]`` int64; rows: ``[B, W]`` int64 pool rows of the nodes, or ``[B]``: each batch
            row's first pool row, its nodes at ``rows[b] + j`` (consecutive rows).
        positions: with ``table``, ``[B, W]`` (or ``[N]``) int64 positions of the nodes; None: a
            node's position is its pool row (a drafter's context and block rows).
        table: ``cos`` / ``sin`` are tables read at the positions (one launch, no gather kernels
            before it on the GPU path).

    Returns:
        ``[N, Hq, D]`` rotated queries in ``q``'s dtype.
    """
    b = slots.shape[0]
    w = rows.shape[1] if rows.dim() == 2 else (q.shape[0] // b if b else 0)
    if rows.dim() == 1:
        rows = rows[:, None] + torch.arange(w, device=rows.device)
    if table:
        p = (rows if positions is None else positions).reshape(-1)
        cos, sin = cos[p], sin[p]
    where = (slots[:, None], rows)
    k_pool[where] = apply_rope_rows(k, cos, sin).reshape(b, w, *k.shape[1:]).to(k_pool.dtype)
    v_pool[where] = v.reshape(b, w, *v.shape[1:]).to(v_pool.dtype)
    return apply_rope_rows(q, cos, sin)
