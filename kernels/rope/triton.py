"""Rotary embedding fused with the K/V write, in Triton: one launch rotates every query and key
head of every row, writes the keys and values into their pool rows, and returns the queries.
Same contract as ``kernels.rope.reference.rope_store``; graph-safe (slots and rows are tensors)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kp_ptr, vp_ptr, slots_ptr, rows_ptr, pos_ptr, qo_ptr,
                       W, HQ, HKV, R_DIM, sqn, sqh, skn, skh, svn, svh, scn, sps, spr, sph, son, soh,
                       D: tl.constexpr, ROWS_BASE: tl.constexpr = False, TABLE: tl.constexpr = False,
                       HAS_POS: tl.constexpr = False, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half = R_DIM // 2
    rot = d < R_DIM
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    b = n // W
    if ROWS_BASE:   # rows_ptr: each batch row's first pool row, its nodes consecutive
        row = tl.load(rows_ptr + b).to(tl.int64) + n % W
    else:
        row = tl.load(rows_ptr + n).to(tl.int64)
    if TABLE:       # cos / sin: tables read at the node's position (its pool row without positions)
        if HAS_POS:
            at = tl.load(pos_ptr + n).to(tl.int64)
        else:
            at = row
    else:
        at = n
    c = tl.load(cos_ptr + at * scn + d, mask=rot, other=1.0)
    s = tl.load(sin_ptr + at * scn + d, mask=rot, other=0.0)
    if h < HQ:
        base = q_ptr + n * sqn + h * sqh
        x = tl.load(base + d)
        xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(rot, x.to(tl.float32) * c + sign * xp * s, x.to(tl.float32))
        tl.store(qo_ptr + n * son + h * soh + d, y.to(qo_ptr.dtype.element_ty))
    else:
        kh = h - HQ
        slot = tl.load(slots_ptr + b).to(tl.int64)
        dst = slot * sps + row * spr + kh * sph + d
        base = k_ptr + n * skn + kh * skh
        x = tl.load(base + d)
        xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(rot, x.to(tl.float32) * c + sign * xp * s, x.to(tl.float32))
        tl.store(kp_ptr + dst, y.to(kp_ptr.dtype.element_ty))
        tl.store(vp_ptr + dst, tl.load(v_ptr + n * svn + kh * svh + d).to(vp_ptr.dtype.element_ty))


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor | None = None, table: bool = False) -> torch.Tensor:
    """Triton version of ``kernels.rope.reference.rope_store`` (same arguments: ``rows`` may be
    each batch row's first row, ``table`` reads ``cos`` / ``sin`` at the nodes' positions inside
    the launch).

    Raises:
        ValueError: head_dim not a power of two, or a last dim that is not contiguous.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two")
    for t in (q, k, v, cos, k_pool):
        if t.stride(-1) != 1:
            raise ValueError("last dims must be contiguous")
    assert k_pool.stride() == v_pool.stride() and cos.stride() == sin.stride()
    out = torch.empty(n, hq, d, device=q.device, dtype=q.dtype)
    if n == 0:   # (an empty batch: nothing to rotate or write)
        return out
    w = rows.shape[1] if rows.dim() == 2 else n // slots.shape[0]
    rows_flat = rows.reshape(-1).contiguous()
    pos = positions.reshape(-1).contiguous() if table and positions is not None else rows_flat
    _rope_store_kernel[(n, hq + hkv)](
        q, k, v, cos, sin, k_pool, v_pool, slots, rows_flat, pos, out,
        w, hq, hkv, cos.shape[-1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), out.stride(0), out.stride(1),
        D=d, ROWS_BASE=rows.dim() == 1, TABLE=bool(table), HAS_POS=bool(table) and positions is not None,
        num_warps=1 if d <= 64 else 2, **pdl.launch(q),
    )
    return out
