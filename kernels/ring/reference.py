"""The feature ring's copies in plain PyTorch (the target's store, the drafter's gather): the
oracles of ``triton.py``."""

from __future__ import annotations

import numpy as np
import torch


def store_rows(table: torch.Tensor, feats: torch.Tensor, items: torch.Tensor, counts: torch.Tensor,
               slot_rows: int, dump: int) -> None:
    """A verify step's committed rows into the ring (in place): for item ``i`` with ``(b, s, p) =
    items[:, i]``, row ``j`` of ``feats[b]`` goes to table row ``s * slot_rows + (p + j) % slot_rows``
    when ``j < counts[b]``, else to row ``dump`` (whose contents nobody reads).

    Args:
        table: ``[slots * slot_rows + 1, width]``.
        feats: ``[B, W, width]`` the step's tapped features, path rows first (``table``'s dtype).
        items: int64 ``[3, n]`` on the device: batch row, slot and first position of each stored item.
        counts: int64 ``[B]`` accepted rows per batch row (``k + 1``), on the device.
        slot_rows, dump: the ring's rows per slot and its dump row.
    """
    br, sl, st = items.unbind(0)
    j = torch.arange(feats.shape[1], device=table.device)
    dst = sl[:, None] * slot_rows + (st[:, None] + j) % slot_rows                        # [n, W]
    dst = torch.where(j < counts.index_select(0, br)[:, None], dst, dump)
    table.index_copy_(0, dst.reshape(-1), feats.index_select(0, br).reshape(-1, feats.shape[-1]))


#: int64 words of a gather's meta buffer before its row indices: the table's address, the rows to
#: copy, the table's row stride (elements)
META_HEAD = 3


def gather_meta(meta: np.ndarray, table: torch.Tensor | None, src: np.ndarray, dst: np.ndarray) -> None:
    """Fill a gather's meta buffer (in place) for :func:`gather_rows`: ``meta`` int64 ``[3 + 2 *
    M]`` = the table's address, the count ``m``, the table's row stride, then ``M`` source rows
    (``src``, rows of ``table``) and ``M`` destination rows (``dst``, rows of the flattened
    destination), the first ``m`` of each used. ``table`` None (or ``m = 0``): nothing to copy.

    Raises:
        ValueError: more rows than the buffer holds, ``src`` and ``dst`` of different lengths, a
            table that is not 2-D with contiguous rows (a closed ring's), or a source row outside
            it (the count is then 0: nothing is copied).
    """
    m = 0 if table is None else len(src)
    cap = (meta.shape[0] - META_HEAD) // 2
    meta[1] = 0
    if m > cap or len(src) != len(dst):
        raise ValueError(f"{len(src)} source and {len(dst)} destination rows for a buffer of {cap}")
    if not m:
        return
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError("the ring table must be 2-D with contiguous rows (a closed ring's is not)")
    if int(np.min(src)) < 0 or int(np.max(src)) >= table.shape[0]:
        raise ValueError(f"ring rows outside the table's {table.shape[0]}")
    meta[1] = m
    meta[0] = table.data_ptr()
    meta[2] = table.stride(0)
    meta[META_HEAD : META_HEAD + m] = src
    meta[META_HEAD + cap : META_HEAD + cap + m] = dst


def gather_rows(dst: torch.Tensor, meta: torch.Tensor, table: torch.Tensor | None) -> None:
    """Copy rows of the ring's ``table`` into ``dst`` (in place) as ``meta`` says
    (:func:`gather_meta`): ``dst[meta.dst[i]] = table[meta.src[i]]`` for ``i < meta.count``,
    converted to ``dst``'s dtype; the other rows of ``dst`` untouched.

    Args:
        dst: ``[R, width]`` destination rows (contiguous rows).
        meta: int64 ``[3 + 2 * M]`` (any device; read on the host here).
        table: ``[n, width]`` the ring's table (the rows ``meta`` names); None when the count is 0.
    """
    m = meta.detach().cpu()
    count = int(m[1])
    if not count:
        return
    cap = (m.shape[0] - META_HEAD) // 2
    src = m[META_HEAD : META_HEAD + count].to(table.device)
    to = m[META_HEAD + cap : META_HEAD + cap + count].to(dst.device)
    dst.index_copy_(0, to, table.index_select(0, src).to(device=dst.device, dtype=dst.dtype))
