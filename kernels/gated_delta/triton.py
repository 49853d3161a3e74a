"""Gated DeltaNet recurrences over pooled state in Triton: :func:`pool_gdn_tree` and
:func:`pool_gdn_commit`, same contracts as ``kernels.gated_delta.reference`` (the recurrence is
documented there), safe inside CUDA graphs (slots, parents, masks, path lengths are tensors).

One program per (batch row, value head, block of ``BV`` value columns) keeps its ``[Dk, BV]``
slice of the state in registers (float32) and walks the row's nodes in index order. A node whose
parent is the previous node continues from the state in registers; any other node (the first
child of a branch that is not the previous node) *restarts*: it reloads the committed state and
replays its parent's ancestry (walked through the parent's ancestor bit mask). No per-node state
is ever written to memory, so the scratch of a verify step is nothing but the per-node
``(k, v, g, beta)`` the commit needs (docs/ARCHITECTURE.md, "State and rollback"); the cost is the
replayed updates, zero for a chain and small for the shallow siblings of a DDTree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _update(S, k_ptr, v_ptr, g_ptr, b_ptr, off_k, off_v, off_g, dk, dv):
    """State after one token: ``S*exp(g)``, then ``S += k (beta (v - S^T k))^T``."""
    kj = tl.load(k_ptr + off_k + dk)
    vj = tl.load(v_ptr + off_v + dv)
    gj = tl.load(g_ptr + off_g)
    bj = tl.load(b_ptr + off_g)
    S = S * tl.exp(gj)
    u = (vj - tl.sum(S * kj[:, None], 0)) * bj
    return S + kj[:, None] * u[None, :]


@triton.jit
def _tree_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, state_ptr, slots_ptr, parents_ptr, anc_ptr, o_ptr,
    W, HK, HV,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S0 = tl.load(state_ptr + s_off + dk[:, None] * DV + dv[None, :])
    S = S0
    for i in range(W):
        node = b * W + i
        p = tl.load(parents_ptr + node)
        if p != i - 1:
            S = S0
            if p >= 0:
                bits = tl.load(anc_ptr + b * W + p)
                for j in range(0, p + 1):
                    if ((bits >> j) & 1) != 0:
                        nj = b * W + j
                        S = _update(S, k_ptr, v_ptr, g_ptr, b_ptr, (nj * HK + kh) * DK, (nj * HV + h) * DV,
                                    nj * HV + h, dk, dv)
        S = _update(S, k_ptr, v_ptr, g_ptr, b_ptr, (node * HK + kh) * DK, (node * HV + h) * DV, node * HV + h, dk, dv)
        qi = tl.load(q_ptr + (node * HK + kh) * DK + dk)
        tl.store(o_ptr + (node * HV + h) * DV + dv, tl.sum(S * qi[:, None], 0))
    if COMMIT:
        tl.store(state_ptr + s_off + dk[:, None] * DV + dv[None, :], S)


@triton.jit
def _commit_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, state_ptr, slots_ptr, path_ptr, n_ptr,
    W, HK, HV,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    dk = tl.arange(0, DK)
    dv = vb * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S = tl.load(state_ptr + s_off + dk[:, None] * DV + dv[None, :])
    n = tl.load(n_ptr + b)
    for d in range(n):
        nj = b * W + tl.load(path_ptr + b * W + d)
        S = _update(S, k_ptr, v_ptr, g_ptr, b_ptr, (nj * HK + kh) * DK, (nj * HV + h) * DV, nj * HV + h, dk, dv)
    tl.store(state_ptr + s_off + dk[:, None] * DV + dv[None, :], S)


def _block_v(dv: int) -> int:
    return min(32, triton.next_power_of_2(dv))


def _check(q, k, v, g, beta, state_pool):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32")
    dk, dv = k.shape[-1], v.shape[-1]
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"head dims {dk}, {dv} must be powers of two")


def pool_gdn_tree(q, k, v, g, beta, state_pool: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor,
                  ancestors: torch.Tensor | None = None, commit: bool = False) -> torch.Tensor:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_tree`` (same arguments and
    result). ``ancestors`` (``[B, W]`` int64 bit masks) is required unless ``commit`` (chains
    never restart).

    Raises:
        ValueError: non-contiguous or non-float32 inputs, head dims not powers of two, or a tree
            (not ``commit``) without ``ancestors``.
    """
    _check(q, k, v, g, beta, state_pool)
    if not commit and ancestors is None:
        raise ValueError("a tree needs its ancestor bit masks")
    bsz, w, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    bv = _block_v(dv)
    out = torch.empty(bsz, w, hv, dv, device=v.device, dtype=torch.float32)
    anc = ancestors if ancestors is not None else parents
    _tree_kernel[(bsz, hv, dv // bv)](q, k, v, g, beta, state_pool, slots, parents, anc, out, w, hk, hv,
                                       DK=dk, DV=dv, BV=bv, COMMIT=bool(commit), num_warps=4)
    return out


def pool_gdn_commit(state_pool: torch.Tensor, slots: torch.Tensor, k, v, g, beta, path: torch.Tensor,
                    n_accept: torch.Tensor) -> None:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_commit`` (same arguments)."""
    _check(k, k, v, g, beta, state_pool)
    bsz, w, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    bv = _block_v(dv)
    _commit_kernel[(bsz, hv, dv // bv)](k, v, g, beta, state_pool, slots, path, n_accept, w, hk, hv,
                                         DK=dk, DV=dv, BV=bv, num_warps=4)
