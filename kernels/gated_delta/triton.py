"""Gated DeltaNet recurrence over pooled state in Triton: :func:`pool_gdn_tree` and
:func:`pool_gdn_commit`, same contracts as ``kernels.gated_delta.reference`` (the math is
documented there), safe inside CUDA graphs (slots, parents, masks, path lengths are tensors). The
layers' causal conv is ``kernels.conv``.

* :func:`pool_gdn_tree`: one program per (batch row, value head, block of ``BV`` value columns)
  keeps its ``[Dk, BV]`` slice of the state in registers (float32) and walks the row's nodes in
  index order. Each node's ``q`` and ``k`` are L2-normalised, ``q`` scaled, and its gates
  ``g = A * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` computed in the kernel from the raw
  projections. A node whose parent is the previous node continues from the state in registers;
  any other node *restarts*: it reloads the committed state and replays its parent's ancestry
  (walked through the parent's ancestor bit mask). No per-node state is ever written to memory,
  so a verify step keeps only the layer's raw inputs for the commit (docs/ARCHITECTURE.md,
  "State and rollback"); the cost is the replayed updates, zero for a chain and small for the
  shallow siblings of a DDTree.
* :func:`pool_gdn_commit`: the same programs replay the accepted path from the committed state
  and write the state once.

Reductions run in another order than the reference's, so results agree to float32 rounding, not
bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab):
    """``g = A * softplus(a + dt_bias)`` (PyTorch's softplus: identity above 20), ``beta = sigmoid(b)``."""
    xa = tl.load(a_ptr + node * sab + h).to(tl.float32) + tl.load(dtb_ptr + h)
    sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
    xb = tl.load(b_ptr + node * sab + h).to(tl.float32)
    return tl.load(A_ptr + h) * sp, 1.0 / (1.0 + tl.exp(-xb))


@triton.jit
def _l2(x):
    return x * tl.math.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK: tl.constexpr):
    """State after node ``node``: decay, delta-rule correction, rank-1 update."""
    row = x_ptr + node * C
    kj = _l2(tl.load(row + HKDK + kh * DK + dk).to(tl.float32))
    vj = tl.load(row + 2 * HKDK + dv).to(tl.float32)
    gj, bj = _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab)
    S = S * tl.exp(gj)
    u = (vj - tl.sum(S * kj[:, None], 0)) * bj
    return S + kj[:, None] * u[None, :]


@triton.jit
def _tree_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, parents_ptr, anc_ptr, o_ptr,
                 W, HK, HV, C, sab, q_scale,
                 DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    HKDK = HK * DK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    dv = h * DV + cols
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S0 = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
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
                        S = _update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, b * W + j, h, kh, C, sab, HKDK, dk, dv, DK)
        S = _update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK)
        qi = _l2(tl.load(x_ptr + node * C + kh * DK + dk).to(tl.float32)) * q_scale
        tl.store(o_ptr + (node * HV + h) * DV + cols, tl.sum(S * qi[:, None], 0))
    if COMMIT:
        tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


@triton.jit
def _commit_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, path_ptr, n_ptr,
                   W, HK, HV, C, sab,
                   DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    HKDK = HK * DK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    dv = h * DV + cols
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    n = tl.load(n_ptr + b)
    for d in range(n):
        node = b * W + tl.load(path_ptr + b * W + d)
        S = _update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK)
    tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


def _block_v(dv: int) -> int:
    return min(32, triton.next_power_of_2(dv))


def _layout(conv_out, a, b, state_pool, head_k_dim):
    """The kernels read ``conv_out`` contiguous and ``a`` / ``b`` with a shared node stride
    (column slices of one projection qualify); other layouts are copied once."""
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous float32")
    if head_k_dim & (head_k_dim - 1) or state_pool.shape[-1] & (state_pool.shape[-1] - 1):
        raise ValueError("head dims must be powers of two")
    conv_out = conv_out.contiguous()
    if a.stride() != b.stride() or a.stride(-1) != 1 or a.stride(0) != a.shape[1] * a.stride(1):
        a, b = a.contiguous(), b.contiguous()
    return conv_out, a, b


def pool_gdn_tree(conv_out, a, b, A, dt_bias, state_pool: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor,
                  ancestors: torch.Tensor | None, commit: bool, key_heads: int, head_k_dim: int) -> torch.Tensor:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_tree`` (same arguments and
    result). ``ancestors`` is required unless ``commit`` (chains never restart); ``a`` and ``b``
    may be column slices of one projection (same strides).

    Raises:
        ValueError: a state pool that is not contiguous float32, head dims that are not powers of
            two, or a tree without ``ancestors``.
    """
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    if not commit and ancestors is None:
        raise ValueError("a tree needs its ancestor bit masks")
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = _block_v(dv)
    out = torch.empty(bsz, w, hv, dv, device=conv_out.device, dtype=torch.float32)
    parents, slots = parents.contiguous(), slots.contiguous()
    anc = ancestors.contiguous() if ancestors is not None else parents
    _tree_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, parents, anc, out,
                                       w, key_heads, hv, c, a.stride(1), dk ** -0.5,
                                       DK=dk, DV=dv, BV=bv, COMMIT=bool(commit), num_warps=4)
    return out


def pool_gdn_commit(state_pool: torch.Tensor, slots: torch.Tensor, conv_out, a, b, A, dt_bias, path: torch.Tensor,
                    n_accept: torch.Tensor, key_heads: int, head_k_dim: int) -> None:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_commit`` (same arguments)."""
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    path, n_accept = path.contiguous(), n_accept.contiguous()
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = _block_v(dv)
    _commit_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, path, n_accept,
                                         w, key_heads, hv, c, a.stride(1), DK=dk, DV=dv, BV=bv, num_warps=4)
