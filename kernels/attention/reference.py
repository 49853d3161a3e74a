"""Tree attention, plain PyTorch (the oracle for any fused or Triton version).

Each of ``T`` new tokens (tree nodes, or a prefill chunk) attends to the committed cache rows
``[0, L)`` and to the new tokens its mask allows (its ancestors and itself for a token tree; the
earlier tokens and itself for a prefill chunk). Grouped-query attention: query head ``h`` reads
key/value head ``h // (Hq // Hkv)`` (the layout of HF ``repeat_kv``).
"""

from __future__ import annotations

import torch


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of new tokens over ``cache + new`` with a boolean mask on the new part.

    Args:
        q: ``[Hq, T, D]`` queries of the new tokens (any float dtype).
        k_cache, v_cache: ``[Hkv, L, D]`` committed rows (``L`` may be 0); every query sees all of them.
        k_new, v_new: ``[Hkv, T, D]`` keys/values of the new tokens.
        mask: ``[T, T]`` bool, ``mask[i, j]`` = new token ``i`` may attend to new token ``j``.
            Every row must allow at least itself (``mask[i, i]``), so no row is empty.
        scale: softmax scale, usually ``1 / sqrt(D)``.

    Returns:
        ``[Hq, T, D]`` in ``q``'s dtype. Scores and softmax are computed in float32; masked
        entries are ``-inf`` before the softmax, so padded or foreign rows get exactly zero weight.

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``.
    """
    hq, t, d = q.shape
    hkv = k_new.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    group = hq // hkv
    k = torch.cat([k_cache, k_new], dim=1).float()
    v = torch.cat([v_cache, v_new], dim=1).float()
    qg = q.float().reshape(hkv, group * t, d)                 # [Hkv, G*T, D], rows grouped by kv head
    scores = torch.matmul(qg, k.transpose(1, 2)) * scale        # [Hkv, G*T, L+T]
    full = torch.cat([torch.ones(t, k_cache.shape[1], dtype=torch.bool, device=mask.device), mask], dim=1)
    scores = scores.reshape(hkv, group, t, -1).masked_fill(~full, float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(hkv, group * t, -1)
    out = torch.matmul(probs, v)                                 # [Hkv, G*T, D]
    return out.reshape(hq, t, d).to(q.dtype)


def pool_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    ancestors: torch.Tensor | None,
    scale: float,
    causal: bool = False,
    window: int = 0,
) -> torch.Tensor:
    """Attention of a batch of token trees (or prefill chunks) over a pooled KV cache.

    Row ``b`` of the batch is one session: its committed K/V are rows ``[0, L_b)`` of pool slot
    ``slots[b]``, and the K/V of its ``W`` new tokens are already written at rows ``L_b + j``
    (``j < W``, the scratch rows past the committed length; docs/ARCHITECTURE.md, "The GPU
    path"). New token ``i`` attends to every committed row and to the new rows its mask allows:
    its ancestors and itself (bit ``j`` of ``ancestors[b, i]``) for a tree, rows ``j <= i`` for a
    causal prefill chunk. Grouped-query attention: query head ``h`` reads kv head
    ``h // (Hq // Hkv)`` (HF ``repeat_kv``).

    Args:
        q: ``[B, W, Hq, D]`` queries (rotary applied), any float dtype.
        k_pool, v_pool: ``[S, R, Hkv, D]`` one layer of the pool (``R >= L_b + W``).
        slots: ``[B]`` int64 pool slot of each row.
        lengths: ``[B]`` int64 committed rows ``L_b``.
        ancestors: ``[B, W]`` int64 bit masks (``W <= 64``; bit ``j`` set: node ``j`` is node
            ``i`` or one of its ancestors; bit ``i`` must be set); ignored when ``causal``.
        scale: softmax scale (``1 / sqrt(D)``).
        causal: new token ``i`` sees new rows ``j <= i`` (``W`` unbounded).
        window: a sliding window of ``window`` rows (0: none, the default): new token ``i``
            (row ``L_b + i``) also sees pool row ``r`` only when ``|L_b + i - r| <= window - 1``
            (flash-attn's ``window_size = (window-1, window-1)``). Rows are positions in the
            drafter's layout (context row ``r`` at position ``r``, block row ``i`` at ``L_b + i``,
            every ancestor bit set), the one caller (sliding drafter layers); for a tree whose
            rows are not its positions the window counts rows.

    Returns:
        ``[B, W, Hq, D]`` in ``q``'s dtype; scores, softmax and the weighted sum in float32
        (float64 for float64 inputs), masked entries ``-inf`` before the softmax.

    This reference reads each ``L_b`` on the host: it runs eagerly (CPU engine, tests), never
    inside a CUDA graph; ``kernels/attention/triton.py`` is the graph-safe version.
    """
    bsz, w, hq, d = q.shape
    hkv = k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    g = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    j = torch.arange(w, device=q.device)
    out = torch.empty_like(q)
    for b in range(bsz):
        n, s = int(lengths[b]), int(slots[b])
        k = k_pool[s, : n + w].to(acc)                                   # [n+W, Hkv, D]
        v = v_pool[s, : n + w].to(acc)
        if causal:
            new = j[None, :] <= j[:, None]
        else:
            new = ((ancestors[b][:, None] >> j[None, :]) & 1).bool()      # [W, W]
        mask = torch.cat([torch.ones(w, n, dtype=torch.bool, device=q.device), new], dim=1)
        if window:
            rows = torch.arange(n + w, device=q.device)
            mask = mask & ((n + j)[:, None] - rows[None, :]).abs().le(int(window) - 1)
        qb = q[b].to(acc).reshape(w, hkv, g, d)
        scores = torch.einsum("wkgd,nkd->kgwn", qb, k) * scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[b] = torch.einsum("kgwn,nkd->wkgd", probs, v).reshape(w, hq, d).to(q.dtype)
    return out


def pool_kv_commit(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                   path: torch.Tensor, n_accept: torch.Tensor) -> None:
    """Move each row's accepted path to the front of its scratch rows, in every attention layer.

    A verify step wrote node ``j`` of row ``b`` at pool row ``L_b + j`` (``L_b = lengths[b]``);
    after acceptance, row ``L_b + d`` must hold the path's ``d``-th node: ``row L_b + d <- row
    L_b + path[b, d]`` for **every** ``d < W``, K and V, all layers, slot ``slots[b]`` (all rows
    are read before any is written). Rows ``d >= n_accept[b]`` also receive ``path[b, d]``'s row
    (whatever the path holds there: :func:`kernels.sampling.accept.accept_trees` leaves ``0``, the
    root); they lie past the new committed length and are scratch again.

    Args:
        k_pool, v_pool: ``[A, S, R, Hkv, D]`` all attention layers of the pool (modified in place).
        slots, lengths: ``[B]`` int64.
        path: ``[B, W]`` int64 node indices, root first (``path[b, d] >= d`` on the accepted part).
        n_accept: ``[B]`` int64 (not needed by the move itself: see above).
    """
    s = slots[:, None]
    rows = lengths[:, None] + torch.arange(path.shape[1], device=path.device)
    src = lengths[:, None] + path
    for t in (k_pool, v_pool):
        t[:, s, rows] = t[:, s, src]
