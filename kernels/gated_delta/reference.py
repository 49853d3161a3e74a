"""Gated DeltaNet (GDN) recurrence and its causal conv, plain PyTorch: the oracle for fast paths.

Gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025; the recurrence of
``fla.ops.gated_delta_rule.naive`` and HF ``torch_recurrent_gated_delta_rule``), per value head,
with state ``S`` of shape ``[Dk, Dv]``::

    S   <- S * exp(g_t)                         # decay, g_t <= 0
    u_t  = beta_t * (v_t - S^T k_t)             # delta-rule correction
    S   <- S + k_t u_t^T
    o_t  = S^T (q_t / sqrt(Dk))

Token trees (DESIGN.md, "State and rollback"): each node's state is its *parent's* state updated
with the node's ``(k, v, g, beta)``; node 0's parent is the committed state. Each node's conv
window is its own input and its ancestors' (reaching into the committed conv state near the
root). Nothing here mutates the committed state.
"""

from __future__ import annotations

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
