"""Gated DeltaNet (GDN) recurrence and its causal conv, plain PyTorch: the oracle for fast paths.

Gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025; the recurrence of
``fla.ops.gated_delta_rule.naive`` and HF ``torch_recurrent_gated_delta_rule``), per value head,
with state ``S`` of shape ``[Dk, Dv]``::

    S   <- S * exp(g_t)                         # decay, g_t <= 0
    u_t  = beta_t * (v_t - S^T k_t)             # delta-rule correction
    S   <- S + k_t u_t^T
    o_t  = S^T (q_t / sqrt(Dk))

Token trees (docs/ARCHITECTURE.md, "State and rollback"): each node's state is its *parent's* state updated
with the node's ``(k, v, g, beta)``; node 0's parent is the committed state. Each node's conv
window is its own input and its ancestors' (reaching into the committed conv state near the
root). Nothing here mutates the committed state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla / HF ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_update(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The state after one token: decay, delta-rule correction, rank-1 update (all heads).

    Args:
        state: ``[H, Dk, Dv]`` float32 (not modified).
        k: ``[H, Dk]`` L2-normalised; v: ``[H, Dv]``; g: ``[H]`` log-decay; beta: ``[H]``.

    Returns:
        ``[H, Dk, Dv]`` float32.
    """
    s = state * g.exp()[:, None, None]
    kv_mem = (s * k[:, :, None]).sum(1)                       # S^T k: [H, Dv]
    u = (v - kv_mem) * beta[:, None]
    return s + k[:, :, None] * u[:, None, :]


def gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: :func:`gdn_update`, then ``o = S^T q``.

    Args:
        q: ``[H, Dk]``, already L2-normalised and scaled by ``1/sqrt(Dk)``; others as :func:`gdn_update`.

    Returns:
        ``(o [H, Dv], new_state [H, Dk, Dv])``, float32.
    """
    s = gdn_update(state, k, v, g, beta)
    return (s * q[:, :, None]).sum(1), s


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``T`` tokens in order from ``state``.

    Args:
        q, k: ``[T, H, Dk]`` (q L2-normalised and scaled, k L2-normalised); v: ``[T, H, Dv]``;
        g, beta: ``[T, H]``; state: ``[H, Dk, Dv]``. All float32.

    Returns:
        ``(o [T, H, Dv], final_state [H, Dk, Dv])``.
    """
    outs = []
    s = state
    for t in range(q.shape[0]):
        o, s = gdn_step(s, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    return torch.stack(outs), s


def tree_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a token tree: node ``i`` starts from node ``parents[i]``'s state.

    Args:
        q, k, v, g, beta: per node, as :func:`recurrent_gated_delta_rule` (``T`` nodes).
        state: ``[H, Dk, Dv]`` committed state (the root's parent).
        parents: ``T`` ints, ``parents[0] == -1``, ``parents[i] < i``.

    Returns:
        ``(o [T, H, Dv], node_states [T, H, Dk, Dv])``: each node's output and its state after it.
    """
    outs, states = [], []
    for i, p in enumerate(parents):
        o, s = gdn_step(state if p < 0 else states[p], q[i], k[i], v[i], g[i], beta[i])
        outs.append(o)
        states.append(s)
    return torch.stack(outs), torch.stack(states)


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


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


# ------------------------------------------------------------------ pooled, batched (GPU engine)
# The functions below act on a batch of sessions whose committed state lives in a pool
# (``state_pool[slot]``, ``conv_pool[slot]``; docs/ARCHITECTURE.md, "The GPU path"). Every
# per-step value is a tensor, so :func:`conv_window_index`, :func:`pool_conv_tree` and
# :func:`pool_conv_commit` are graph-safe as they are; the conv + SiLU and the two recurrences
# have Triton versions in ``kernels/gated_delta/triton.py`` (these references loop on the host).


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head decay and write strength of a Qwen3.5 GDN layer from its raw projections
    (llama.cpp ``ssm_a`` = ``-exp(A_log)``, ``ssm_dt.bias``; HF ``Qwen3_5GatedDeltaNet``):
    ``g = A * softplus(a + dt_bias)`` (log-decay, <= 0) and ``beta = sigmoid(b)``.

    Args:
        a, b: ``[..., HV]`` any float dtype (``x @ ssm_alpha``, ``x @ ssm_beta``).
        A, dt_bias: ``[HV]`` float32.

    Returns:
        ``(g, beta)`` float32 ``[..., HV]``.
    """
    return A * F.softplus(a.float() + dt_bias), torch.sigmoid(b.float())


def gdn_qkv(conv_out: torch.Tensor, key_heads: int, head_k_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split an activated conv output ``[..., C]`` (``C = 2 * Hk * Dk + HV * Dv``, ``[q | k | v]``)
    into float32 ``q`` (L2-normalised, scaled by ``1/sqrt(Dk)``) and ``k`` (L2-normalised) per key
    head ``[..., Hk, Dk]``, and ``v`` per value head ``[..., HV, Dv]`` (``Dv = Dk``, as llama.cpp's
    qwen35 assumes)."""
    hk, dk = key_heads, head_k_dim
    x = conv_out.float()
    lead = x.shape[:-1]
    q = x[..., : hk * dk].reshape(*lead, hk, dk)
    k = x[..., hk * dk : 2 * hk * dk].reshape(*lead, hk, dk)
    v = x[..., 2 * hk * dk :].reshape(*lead, -1, dk)
    return l2norm(q) / math.sqrt(dk), l2norm(k), v


def pool_gdn_tree(conv_out, a, b, A, dt_bias, state_pool: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor,
                  ancestors: torch.Tensor | None, commit: bool, key_heads: int, head_k_dim: int) -> torch.Tensor:
    """Gated delta rule over a batch of token trees, from pooled committed states, starting from a
    layer's raw inputs.

    Per node: ``q, k, v = gdn_qkv(conv_out)``, ``g, beta = gdn_gates(a, b, A, dt_bias)``; node
    ``i`` of row ``b`` starts from node ``parents[b, i]``'s state (``-1``: the committed state
    ``state_pool[slots[b]]``). With ``commit`` each row's nodes form a chain (``parents[b, i] =
    i - 1``: a prefill chunk or an autoregressive step) committed whole: the state after the last
    node is written to the pool; otherwise the pool is not touched (the accepted path is
    committed later by :func:`pool_gdn_commit`). Value head ``j`` reads key head ``j mod Hk``
    (GGUF tiled order).

    Args:
        conv_out: ``[B, W, C]`` activated conv outputs (any float dtype).
        a, b: ``[B, W, HV]`` raw gate projections; A, dt_bias: ``[HV]`` float32.
        state_pool: ``[S, HV, Dk, Dv]`` float32, one layer of the pool.
        slots: ``[B]`` int64; parents: ``[B, W]`` int64 (topological: ``parents[b, i] < i``).
        ancestors: ``[B, W]`` int64 bit masks (unused here; the Triton version walks them).
        commit: see above. key_heads, head_k_dim: ``Hk``, ``Dk``.

    Returns:
        ``[B, W, HV, Dv]`` float32 outputs ``S_i^T q_i``.
    """
    q, k, v = gdn_qkv(conv_out, key_heads, head_k_dim)
    g, beta = gdn_gates(a, b, A, dt_bias)
    bsz, w, hk, _ = q.shape
    hv = v.shape[2]
    reps = hv // hk
    out = torch.empty(bsz, w, hv, v.shape[3], device=v.device, dtype=torch.float32)
    for r in range(bsz):
        s = int(slots[r])
        par = [int(p) for p in parents[r].tolist()]
        o, states = tree_gated_delta_rule(q[r].repeat(1, reps, 1), k[r].repeat(1, reps, 1), v[r], g[r], beta[r],
                                          state_pool[s], par)
        out[r] = o
        if commit:
            state_pool[s] = states[-1]
    return out


def pool_gdn_commit(state_pool: torch.Tensor, slots: torch.Tensor, conv_out, a, b, A, dt_bias, path: torch.Tensor,
                    n_accept: torch.Tensor, key_heads: int, head_k_dim: int) -> None:
    """Commit the accepted path of each row: recompute the recurrence from the committed state
    along ``path[r, :n_accept[r]]`` and write the result to ``state_pool[slots[r]]`` (one state
    write per row; docs/ARCHITECTURE.md, "State and rollback").

    Args:
        state_pool: ``[S, HV, Dk, Dv]`` float32 (modified in place).
        slots: ``[B]`` int64.
        conv_out, a, b, A, dt_bias, key_heads, head_k_dim: the layer's inputs of the tree forward
            (as :func:`pool_gdn_tree`).
        path: ``[B, W]`` int64 node indices, root first; entries at ``>= n_accept[r]`` ignored.
        n_accept: ``[B]`` int64 path lengths (``k + 1 >= 1``).
    """
    q, k, v = gdn_qkv(conv_out, key_heads, head_k_dim)
    g, beta = gdn_gates(a, b, A, dt_bias)
    reps = v.shape[2] // k.shape[2]
    for r in range(slots.shape[0]):
        s = int(slots[r])
        state = state_pool[s]
        for d in range(int(n_accept[r])):
            j = int(path[r, d])
            state = gdn_update(state, k[r, j].repeat(reps, 1), v[r, j], g[r, j], beta[r, j])
        state_pool[s] = state


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
        ``[B, W, C]`` in ``x``'s dtype (products summed in ``x``'s dtype, as
        :func:`causal_conv_tree`).
    """
    bsz, w, c = x.shape
    km1 = conv_pool.shape[1]
    buf = torch.cat([conv_pool[slots].to(x.dtype), x], dim=1)                      # [B, K-1+W, C]
    rows = torch.cat([window, (km1 + torch.arange(w, device=x.device)).expand(bsz, w)[..., None]], dim=-1)
    windows = buf.gather(1, rows.reshape(bsz, -1, 1).expand(-1, -1, c)).reshape(bsz, w, km1 + 1, c)
    return (windows * weight.t()).sum(2)


def pool_conv_silu(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor, commit: bool = False) -> torch.Tensor:
    """``silu(pool_conv_tree(...))``; with ``commit`` (each row a chain committed whole) the rows'
    conv states then become their last ``K - 1`` inputs (:func:`pool_conv_commit` with the last
    node). Returns ``[B, W, C]`` in ``x``'s dtype."""
    out = F.silu(pool_conv_tree(x, conv_pool, slots, window, weight))
    if commit:
        last = torch.full((x.shape[0],), x.shape[1] - 1, dtype=torch.long, device=x.device)
        pool_conv_commit(x, conv_pool, slots, window, last)
    return out


def pool_conv_commit(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                     last: torch.Tensor) -> None:
    """Set each row's committed conv state to the last ``K - 1`` inputs of its accepted path.

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
