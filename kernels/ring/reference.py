"""The feature ring's store in plain PyTorch: the oracle of ``triton.py``."""

from __future__ import annotations

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
