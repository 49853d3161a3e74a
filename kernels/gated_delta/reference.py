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


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


# ------------------------------------------------------------------ pooled, batched (GPU engine)
# The functions below act on a batch of sessions whose committed state lives in a pool
# (``state_pool[slot]``; docs/ARCHITECTURE.md, "The GPU path"). The two recurrences have Triton
# versions in ``kernels/gated_delta/triton.py`` (these references loop on the host); the pooled
# conv (``conv_pool[slot]``) is in ``kernels/conv``.


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
                  ancestors: torch.Tensor | None, commit: bool, key_heads: int, head_k_dim: int,
                  gates_out: torch.Tensor | None = None, leaf_kids: torch.Tensor | None = None) -> torch.Tensor:
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
        gates_out: optional ``[B, W, HV, 2]`` float32, receives each node's ``(g, beta)`` (for
            :func:`pool_gdn_commit_layers`).
        leaf_kids: the Triton version's walk order hint (``kernels.gated_delta.triton.leaf_children``;
            unused here).

    Returns:
        ``[B, W, HV, Dv]`` float32 outputs ``S_i^T q_i``.
    """
    q, k, v = gdn_qkv(conv_out, key_heads, head_k_dim)
    g, beta = gdn_gates(a, b, A, dt_bias)
    if gates_out is not None:
        gates_out.copy_(torch.stack([g, beta], dim=-1))
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
    _, k, v = gdn_qkv(conv_out, key_heads, head_k_dim)
    _commit_paths(state_pool, slots, k, v, *gdn_gates(a, b, A, dt_bias), path, n_accept)


def _commit_paths(state_pool, slots, k, v, g, beta, path, n_accept) -> None:
    """:func:`gdn_update` along each row's accepted path from ``state_pool[slots[r]]``, written back."""
    reps = v.shape[2] // k.shape[2]
    for r in range(slots.shape[0]):
        s = int(slots[r])
        state = state_pool[s]
        for d in range(int(n_accept[r])):
            j = int(path[r, d])
            state = gdn_update(state, k[r, j].repeat(reps, 1), v[r, j], g[r, j], beta[r, j])
        state_pool[s] = state


def pool_gdn_commit_layers(state_pools: torch.Tensor, slots: torch.Tensor, conv_outs: torch.Tensor, gates: torch.Tensor,
                           path: torch.Tensor, n_accept: torch.Tensor, key_heads: int, head_k_dim: int) -> None:
    """:func:`pool_gdn_commit` for every GDN layer of a verify step at once, from the layers'
    stacked conv outputs and the gates their tree forward stored (``pool_gdn_tree(...,
    gates_out=...)``), so the Triton version is one launch for all layers
    (docs/ARCHITECTURE.md, "State and rollback").

    Args:
        state_pools: ``[L, S, HV, Dk, Dv]`` float32, every GDN layer's pool (modified in place).
        slots: ``[B]`` int64.
        conv_outs: ``[L, B, W, C]`` the layers' activated conv outputs.
        gates: ``[L, B, W, HV, 2]`` float32 ``(g, beta)`` per node (:func:`gdn_gates`).
        path, n_accept: as :func:`pool_gdn_commit`. key_heads, head_k_dim: ``Hk``, ``Dk``.
    """
    for layer in range(conv_outs.shape[0]):
        _, k, v = gdn_qkv(conv_outs[layer], key_heads, head_k_dim)
        _commit_paths(state_pools[layer], slots, k, v, gates[layer, ..., 0], gates[layer, ..., 1], path, n_accept)
