"""The feature ring's row copies in Triton: one launch each, a program per copied row (its
columns in blocks). Same contracts and bits as ``reference.py`` (copies and one cast); indices are
read on the device, so nothing waits for the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, width, s_src, s_dst, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    sr = tl.load(src_rows_ptr + i).to(tl.int64)
    dr = tl.load(dst_rows_ptr + i).to(tl.int64)
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < width
        x = tl.load(src_ptr + sr * s_src + cols, mask=m)
        tl.store(dst_ptr + dr * s_dst + cols, x.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
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


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Triton version of ``kernels.ring.reference.copy_rows``.

    Raises:
        ValueError: rows that are not contiguous, or widths that differ.
    """
    if src.stride(-1) != 1 or dst.stride(-1) != 1 or src.shape[-1] != dst.shape[-1]:
        raise ValueError("copy_rows needs [*, width] tensors of one width with contiguous rows")
    m = src_rows.numel()
    if m:
        _copy_rows_kernel[(m,)](src, src_rows.contiguous(), dst, dst_rows.contiguous(), src.shape[-1], src.stride(0),
                                dst.stride(0), BLOCK=_block(src.shape[-1]), num_warps=4)


def store_rows(table: torch.Tensor, feats: torch.Tensor, items: torch.Tensor, counts: torch.Tensor,
               slot_rows: int, dump: int) -> None:
    """Triton version of ``kernels.ring.reference.store_rows``.

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
