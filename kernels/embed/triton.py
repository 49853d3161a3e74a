"""Embedding lookups in Triton: one program per output row copies its table row (cast once to
the result's dtype). Same contracts as ``reference.py``; graph-safe (ids are read on the device)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter


@triton.jit
def _embed_kernel(w_ptr, ids_ptr, out_ptr, H, sw, so, BLOCK_ROWS, MASK_ID,
                  BLOCK_MODE: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    r = tl.program_id(0).to(tl.int64)
    if BLOCK_MODE:   # a drafter block: the root at each block's first row, the mask token after it
        tok = tl.load(ids_ptr + r // BLOCK_ROWS).to(tl.int64)
        tok = tl.where(r % BLOCK_ROWS == 0, tok, MASK_ID)
    else:
        tok = tl.load(ids_ptr + r).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = cols < H
        x = tl.load(w_ptr + tok * sw + cols, mask=m, other=0.0)
        tl.store(out_ptr + r * so + cols, x.to(out_ptr.dtype.element_ty), mask=m)


def _launch(weight: torch.Tensor, ids: torch.Tensor, rows: int, dtype, block_rows: int, mask_id: int,
            block_mode: bool) -> torch.Tensor:
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError("the table must be [V, H] with contiguous rows")
    h = weight.shape[1]
    out = torch.empty(rows, h, device=weight.device, dtype=dtype or weight.dtype)
    if rows:
        _embed_kernel[(rows,)](weight, ids.reshape(-1).contiguous(), out, h, weight.stride(0), out.stride(0),
                               block_rows, mask_id, BLOCK_MODE=block_mode,
                               BLOCK_H=min(1024, triton.next_power_of_2(h)), num_warps=4, **pdl.launch(out))
    return out


def embed_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton version of ``kernels.embed.reference.embed_rows``.

    Raises:
        ValueError: a table that is not ``[V, H]`` with contiguous rows.
    """
    return _launch(weight, ids, ids.numel(), dtype, 1, 0, False).reshape(*ids.shape, weight.shape[1])


def embed_block(weight: torch.Tensor, roots: torch.Tensor, mask_id: int, block: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton version of ``kernels.embed.reference.embed_block``.

    Raises:
        ValueError: a table that is not ``[V, H]`` with contiguous rows.
    """
    return _launch(weight, roots, roots.shape[0] * int(block), dtype, int(block), int(mask_id), True)
