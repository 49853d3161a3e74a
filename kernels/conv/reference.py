"""Depthwise causal conv of the Gated DeltaNet layers along a token tree, plain PyTorch: the
oracle for ``kernels/conv/triton.py`` and the CPU path.

A GDN layer (Qwen3.5, docs/ARCHITECTURE.md, "Models") runs a depthwise causal conv of kernel ``K`` over
its pre-conv inputs, then SiLU. Over a token tree each node's window is its own input and its
``K - 1`` predecessors *along its ancestry*, reaching into the committed conv state (the
committed sequence's last ``K - 1`` inputs, oldest first) past the root. Nothing here mutates
the committed state except the explicit commits (:func:`pool_conv_commit`, ``commit=True``).

Rounding: each tap's product is rounded to the input dtype, then the ``K`` products are summed in
tap order (oldest first, the node's own input last) and the sum rounded to the input dtype, as
PyTorch's ``(windows * weight).sum(-1)`` does in a reduced-precision dtype. The Triton kernels do
exactly these operations per element.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_tree(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, parents: list[int] | None) -> torch.Tensor:
    """Depthwise causal conv (kernel ``K``) of new rows along their ancestry, before the activation.

    Row ``i``'s window is ``[..., grandparent, parent, i]`` (``K`` rows), reaching into
    ``conv_state`` (the committed sequence's last ``K-1`` inputs, oldest first) once the
    ancestry runs out. ``parents=None`` means a chain (row ``i-1`` is the parent of ``i``), which
    is HF ``causal_conv1d_update`` / ``causal_conv1d_fn`` with a cached state.

    Args:
        x: ``[T, C]`` new pre-conv inputs; conv_state: ``[K-1, C]``; weight: ``[C, K]``.

    Returns:
        ``[T, C]`` conv outputs (apply SiLU after).
    """
    t, c = x.shape
    km1 = conv_state.shape[0]
    buf = torch.cat([conv_state.to(x.dtype), x])               # rows: committed (K-1), then new
    if parents is None:
        windows = buf.unfold(0, km1 + 1, 1)                      # [T, C, K]
        return (windows * weight).sum(-1)
    idx = torch.empty(t, km1 + 1, dtype=torch.long)
    for i in range(t):
        j, filled = i, km1
        row = [0] * (km1 + 1)
        # walk up the ancestry of node i, then into the committed rows
        while filled >= 0 and j >= 0:
            row[filled] = km1 + j
            j = parents[j]
            filled -= 1
        back = km1 - 1
        while filled >= 0:
            row[filled] = back
            back -= 1
            filled -= 1
        idx[i] = torch.tensor(row)
    windows = buf[idx.to(x.device)]                              # [T, K, C]
    return torch.einsum("tkc,ck->tc", windows, weight)


def conv_state_after(conv_state: torch.Tensor, x_path: torch.Tensor) -> torch.Tensor:
    """The last ``K-1`` pre-conv inputs after appending ``x_path`` (``[n, C]``) to the sequence."""
    km1 = conv_state.shape[0]
    return torch.cat([conv_state, x_path.to(conv_state.dtype)])[-km1:] if km1 else conv_state


# ------------------------------------------------------------------ pooled, batched (GPU engine)
# A batch of sessions whose committed conv states live in a pool (``conv_pool[slot]``;
# docs/ARCHITECTURE.md, "The GPU path"). Every per-step value is a tensor, so these are graph-safe
# as they are (no host reads); ``kernels/conv/triton.py`` fuses each into one launch.


def conv_window_index(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """Where each node's conv window lies in ``[committed conv state ; new rows]``.

    Node ``i``'s window is its ``K - 1`` predecessors along its ancestry, oldest first, reaching
    into the committed state (its last ``K - 1`` inputs, oldest first) past the root. In the
    concatenated buffer ``buf = [conv_state (K-1 rows) ; x (W rows)]`` node ``j`` is row
    ``K - 1 + j`` and the committed row ``r`` is row ``r``; walking up from a node, a pointer
    ``p >= 0`` moves to ``parents[p]`` and a pointer ``p < 0`` (a committed row, ``-1`` the
    newest) to ``p - 1``, and every pointer sits at buffer row ``K - 1 + p``.

    Args:
        parents: ``[B, W]`` int64 (``-1`` for the root and for padded nodes).
        kernel: ``K``.

    Returns:
        ``[B, W, K - 1]`` int64 buffer rows (graph-safe: ``K - 1`` gathers, no host reads).
    """
    bsz, w = parents.shape
    p = torch.arange(w, device=parents.device).expand(bsz, w)
    cols = []
    for _ in range(kernel - 1):
        up = parents.gather(1, p.clamp(min=0))
        p = torch.where(p >= 0, up, p - 1)
        cols.append(kernel - 1 + p)
    if not cols:
        return torch.empty(bsz, w, 0, dtype=torch.long, device=parents.device)
    return torch.stack(cols[::-1], dim=-1)


def pool_conv_tree(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of a batch of trees along each node's ancestry (before the SiLU).

    Args:
        x: ``[B, W, C]`` new pre-conv inputs.
        conv_pool: ``[S, K-1, C]`` one layer's committed conv states (oldest row first).
        slots: ``[B]`` int64; window: ``[B, W, K-1]`` from :func:`conv_window_index`.
        weight: ``[C, K]``.

    Returns:
        ``[B, W, C]`` in ``x``'s dtype (products rounded to ``x``'s dtype, summed in tap order;
        module docstring).
    """
    bsz, w, c = x.shape
    km1 = conv_pool.shape[1]
    buf = torch.cat([conv_pool[slots].to(x.dtype), x], dim=1)                      # [B, K-1+W, C]
    rows = torch.cat([window, (km1 + torch.arange(w, device=x.device)).expand(bsz, w)[..., None]], dim=-1)
    windows = buf.gather(1, rows.reshape(bsz, -1, 1).expand(-1, -1, c)).reshape(bsz, w, km1 + 1, c)
    return (windows * weight.t()).sum(2)


def pool_conv_silu(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor, commit: bool = False, out: torch.Tensor | None = None,
                   x_save: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(pool_conv_tree(...))``; with ``commit`` (each row a chain committed whole) the rows'
    conv states then become their last ``K - 1`` inputs (:func:`pool_conv_commit` with the last
    node). Returns ``[B, W, C]`` in ``x``'s dtype, written into ``out`` when given; ``x_save``
    (``[B, W, C]``), when given, receives a copy of ``x`` (for :func:`pool_conv_commit_layers`)."""
    if x_save is not None:
        x_save.copy_(x)
    res = F.silu(pool_conv_tree(x, conv_pool, slots, window, weight))
    if out is not None:
        res = out.copy_(res)
    if commit:
        last = torch.full((x.shape[0],), x.shape[1] - 1, dtype=torch.long, device=x.device)
        pool_conv_commit(x, conv_pool, slots, window, last)
    return res


def pool_conv_commit(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                     last: torch.Tensor) -> None:
    """Set each row's committed conv state to the last ``K - 1`` inputs of its accepted path: the
    window of the path's last node without its oldest row, then that node's own input.

    Args:
        x: ``[B, W, C]`` the step's pre-conv inputs; conv_pool, slots, window: as
            :func:`pool_conv_tree`.
        last: ``[B]`` int64 the accepted path's last node (``W - 1`` for a committed chain).
    """
    bsz, w, c = x.shape
    km1 = conv_pool.shape[1]
    if km1 == 0:
        return
    buf = torch.cat([conv_pool[slots].to(x.dtype), x], dim=1)
    win = window.gather(1, last[:, None, None].expand(bsz, 1, km1))[:, 0]           # [B, K-1]
    rows = torch.cat([win[:, 1:], (km1 + last)[:, None]], dim=1)
    conv_pool[slots] = buf.gather(1, rows[..., None].expand(-1, -1, c)).to(conv_pool.dtype)


def pool_conv_commit_layers(xs: torch.Tensor, conv_pools: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                            last: torch.Tensor) -> None:
    """:func:`pool_conv_commit` for every GDN layer of a verify step at once (one launch in the
    Triton version).

    Args:
        xs: ``[L, B, W, C]`` the layers' pre-conv inputs (``pool_conv_silu(..., x_save=...)``).
        conv_pools: ``[L, S, K-1, C]`` every layer's committed conv states (modified in place).
        slots, window, last: as :func:`pool_conv_commit`.
    """
    for layer in range(xs.shape[0]):
        pool_conv_commit(xs[layer], conv_pools[layer], slots, window, last)
