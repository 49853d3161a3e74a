"""The feature ring's store in Triton: one launch, a program per (item, node) row (its columns in
blocks). Same contract and bits as ``reference.py`` (a copy); indices are read on the device, so
nothing waits for the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ring.reference import META_HEAD


@triton.jit(do_not_specialize=["n_items", "nodes"], do_not_specialize_on_alignment=["feats_ptr", "counts_ptr"])
def _store_rows_kernel(table_ptr, feats_ptr, items_ptr, counts_ptr, n_items, nodes, width, s_t, s_fb, s_fw,
                       slot_rows, dump, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    i = p // nodes
    j = p % nodes
    b = tl.load(items_ptr + i).to(tl.int64)
    s = tl.load(items_ptr + n_items + i).to(tl.int64)
    start = tl.load(items_ptr + 2 * n_items + i).to(tl.int64)
    keep = j < tl.load(counts_ptr + b)
    dst = tl.where(keep, s * slot_rows + (start + j) % slot_rows, dump)
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < width
        x = tl.load(feats_ptr + b * s_fb + j * s_fw + cols, mask=m)
        tl.store(table_ptr + dst * s_t + cols, x, mask=m)


def _block(width: int) -> int:
    return min(1024, triton.next_power_of_2(max(1, width)))


def store_rows(table: torch.Tensor, feats: torch.Tensor, items: torch.Tensor, counts: torch.Tensor,
               slot_rows: int, dump: int) -> None:
    """Triton version of ``kernels.ring.reference.store_rows``. Neither the item and node counts
    (Triton would compile a variant for a count of 1 and for multiples of 16) nor the alignment of
    the features and counts (views at offsets into the step's output buffer: a one-row step's are
    not 16-byte aligned) are specialised on: the kernel runs outside the captured step, so each
    variant compiled the first time a step had it, inside a request
    (:meth:`runtime.feature_ring.FeatureRing.warm` compiles the one variant when the ring is made).

    Raises:
        ValueError: rows that are not contiguous, widths or dtypes that differ.
    """
    if (table.stride(-1) != 1 or feats.stride(-1) != 1 or table.shape[-1] != feats.shape[-1]
            or table.dtype != feats.dtype):
        raise ValueError("store_rows needs a table and features of one width and dtype with contiguous rows")
    items = items.contiguous()
    n, nodes = items.shape[1], feats.shape[1]
    if n and nodes:
        _store_rows_kernel[(n * nodes,)](table, feats, items, counts.contiguous(), n, nodes, table.shape[-1],
                                         table.stride(0), feats.stride(0), feats.stride(1), int(slot_rows), int(dump),
                                         BLOCK=_block(table.shape[-1]), num_warps=4)


_POINTER = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _gather_rows_kernel(meta_ptr, dst_ptr, width, s_d, cap, DTYPE: tl.constexpr, HEAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    p = tl.program_id(0)
    if p < tl.load(meta_ptr + 1):
        table = tl.load(meta_ptr).to(tl.pointer_type(DTYPE))   # (the ring's address, set per step)
        s_t = tl.load(meta_ptr + 2)
        src = tl.load(meta_ptr + HEAD + p)
        dst = tl.load(meta_ptr + HEAD + cap + p)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < width
            x = tl.load(table + src * s_t + cols, mask=m)
            tl.store(dst_ptr + dst * s_d + cols, x, mask=m)


def gather_rows(dst: torch.Tensor, meta: torch.Tensor, table: torch.Tensor | None = None) -> None:
    """Triton version of ``kernels.ring.reference.gather_rows``: one launch of ``M`` programs
    (those past the count return at once); the table is read at the address in ``meta`` (``table``
    is not read), so a captured graph reads whichever table the step's meta names. The table must
    be of ``dst``'s dtype (a copy, no conversion). Device work only.

    Raises:
        ValueError: ``dst`` rows not contiguous, ``meta`` not int64 on ``dst``'s device, or
            ``dst`` not bf16, f16 or f32.
    """
    dtype = dst.dtype
    if dst.stride(-1) != 1 or meta.dtype != torch.int64 or meta.device != dst.device or dtype not in _POINTER:
        raise ValueError("gather_rows needs contiguous bf16 / f16 / f32 destination rows and an int64 meta "
                         "on their device")
    cap = (meta.shape[0] - META_HEAD) // 2
    if cap:
        _gather_rows_kernel[(cap,)](meta, dst, dst.shape[-1], dst.stride(0), cap, DTYPE=_POINTER[dtype],
                                    HEAD=META_HEAD, BLOCK=_block(dst.shape[-1]), num_warps=4)
