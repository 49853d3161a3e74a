"""The KV commit of a verify step in Triton: :func:`pool_kv_commit`, same contract as
``kernels.attention.reference.pool_kv_commit`` (row ``L + d`` of each row's slot receives row
``L + path[d]``, K and V, every attention layer), in one launch, safe inside CUDA graphs (slots,
lengths and paths are read in the kernel).

Grid ``(A, B, cdiv(Hkv * D, BLOCK))``: one program per (attention layer, batch row, block of the
``Hkv * D`` elements of a pool row). It loads the source rows of all ``W`` path entries of its
block (K and V), waits at a barrier, then stores them. The copy is in place and a path entry's
source row may be another entry's destination (``path[d] >= d``: moving ``L + path[d]`` to
``L + d`` overwrites a row that a later entry may still read), so every read must land before any
write; the barrier orders them across the program's threads, and no other program touches the
same elements (distinct slots per batch row, except the spare slot of padded rows, whose contents
are garbage anyway). Entries with ``path[d] == d`` are skipped (a row onto itself). Rows are
copied, not recomputed: the result equals the reference bit for bit.

This lives beside ``triton.py`` (the attention kernel) as its own module so the two can change
independently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter


@triton.jit
def _kv_commit_kernel(k_ptr, v_ptr, slots_ptr, lengths_ptr, path_ptr, W, HD, s_layer, s_slot, s_row,
                      WP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    layer = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    L = tl.load(lengths_ptr + b).to(tl.int64)
    j = tl.arange(0, WP)
    jm = j < W
    src = tl.load(path_ptr + b.to(tl.int64) * W + j, mask=jm, other=0).to(tl.int64)
    m = (jm & (src != j))[:, None] & (e < HD)[None, :]
    base = layer.to(tl.int64) * s_layer + slot * s_slot
    src_off = base + (L + src)[:, None] * s_row + e[None, :]
    dst_off = base + (L + j)[:, None] * s_row + e[None, :]
    kt = tl.load(k_ptr + src_off, mask=m)
    vt = tl.load(v_ptr + src_off, mask=m)
    tl.debug_barrier()                      # all reads of the program before any write
    tl.store(k_ptr + dst_off, kt, mask=m)
    tl.store(v_ptr + dst_off, vt, mask=m)


def pool_kv_commit(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                   path: torch.Tensor, n_accept: torch.Tensor) -> None:
    """Triton version of ``kernels.attention.reference.pool_kv_commit`` (same arguments, same
    result bit for bit, rows past ``n_accept`` included); ``k_pool`` and ``v_pool``
    ``[A, S, R, Hkv, D]`` with the same strides and each pool row's ``Hkv * D`` elements
    contiguous. ``n_accept`` is not read (module docstring).

    Raises:
        ValueError: pools of other layouts.
    """
    del n_accept
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride() or k_pool.dtype != v_pool.dtype:
        raise ValueError("k_pool and v_pool must have the same shape, strides and dtype")
    a, _, _, hkv, d = k_pool.shape
    if k_pool.stride(4) != 1 or k_pool.stride(3) != d:
        raise ValueError("each pool row's [Hkv, D] must be contiguous")
    bsz, w = path.shape
    if a == 0 or bsz == 0 or w == 0:
        return
    hd = hkv * d
    wp = triton.next_power_of_2(w)
    block = min(triton.next_power_of_2(hd), max(16, 4096 // wp))
    _kv_commit_kernel[(a, bsz, triton.cdiv(hd, block))](
        k_pool, v_pool, slots.contiguous(), lengths.contiguous(), path.contiguous(), w, hd,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), WP=wp, BLOCK=block, num_warps=4,
        **pdl.launch(k_pool))
