"""Gated DeltaNet over pooled state in Triton: :func:`pool_conv_silu`, :func:`pool_gdn_tree` and
:func:`pool_gdn_commit`, same contracts as ``kernels.gated_delta.reference`` (the math is
documented there), safe inside CUDA graphs (slots, parents, windows, masks, path lengths are
tensors).

* :func:`pool_conv_silu`: one program per (batch row, block of channels) walks the row's nodes;
  each node's depthwise conv window is gathered from the pooled conv state or the new rows
  through the window table, SiLU applied; for a committed chain the same program then writes the
  row's new conv state (it alone touches those channels of that slot, so there is no race).
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

Rounding follows the reference where it is cheap to (the conv's products are rounded to the
input dtype before the sum, as PyTorch's bf16 ``mul`` then ``sum`` round them); reductions run
in another order, so results agree to float32 rounding, not bit for bit.
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


@triton.jit
def _conv_kernel(x_ptr, pool_ptr, slots_ptr, win_ptr, w_ptr, out_ptr, W, C, sxb, sx, sps, spr,
                 KM1: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr, COMMIT: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    base_pool = pool_ptr + slot * sps
    xb = x_ptr + b.to(tl.int64) * sxb
    for i in range(W):
        node = b * W + i
        acc = tl.zeros([BLOCK_C], tl.float32)
        for t in tl.static_range(KM1):
            r = tl.load(win_ptr + node * KM1 + t)
            old = tl.load(base_pool + r * spr + cols, mask=cm & (r < KM1), other=0.0)
            new = tl.load(xb + (r - KM1) * sx + cols, mask=cm & (r >= KM1), other=0.0)
            wt = tl.load(w_ptr + cols * (KM1 + 1) + t, mask=cm, other=0.0)
            acc += ((old + new).to(tl.float32) * wt.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        xi = tl.load(xb + i * sx + cols, mask=cm, other=0.0)
        wt = tl.load(w_ptr + cols * (KM1 + 1) + KM1, mask=cm, other=0.0)
        acc += (xi.to(tl.float32) * wt.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        pre = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + node * C + cols, (pre / (1.0 + tl.exp(-pre))).to(out_ptr.dtype.element_ty), mask=cm)  # out: contiguous
    if COMMIT:
        # new state rows 0..K-2 = the last node's window without its oldest row, then the node itself
        last = b * W + W - 1
        t = tl.arange(0, KP)
        tm = t < KM1 - 1
        r = tl.load(win_ptr + last * KM1 + 1 + t, mask=tm, other=0)
        m2 = tm[:, None] & cm[None, :]
        old = tl.load(base_pool + r[:, None] * spr + cols[None, :], mask=m2 & (r < KM1)[:, None], other=0.0)
        new = tl.load(xb + (r - KM1)[:, None] * sx + cols[None, :], mask=m2 & (r >= KM1)[:, None], other=0.0)
        xl = tl.load(xb + (W - 1) * sx + cols, mask=cm, other=0.0)
        # the rows just read may be the rows about to be written, by other threads of this program
        # (the 2-D and 1-D tensors are laid out differently): all reads land before any write
        tl.debug_barrier()
        tl.store(base_pool + t[:, None] * spr + cols[None, :], (old + new).to(pool_ptr.dtype.element_ty), mask=m2)
        tl.store(base_pool + (KM1 - 1) * spr + cols, xl.to(pool_ptr.dtype.element_ty), mask=cm)


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


def pool_conv_silu(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor, commit: bool = False) -> torch.Tensor:
    """Triton version of ``kernels.gated_delta.reference.pool_conv_silu`` (same arguments and
    result; ``x`` ``[B, W, C]`` with a contiguous last dim (a column slice of a projection is fine),
    ``weight`` ``[C, K]`` contiguous). Returns a contiguous ``[B, W, C]``."""
    bsz, w, c = x.shape
    km1 = conv_pool.shape[1]
    if not (x.stride(-1) == 1 and weight.is_contiguous() and window.is_contiguous() and conv_pool.stride(-1) == 1):
        raise ValueError("x rows, weight and window must be contiguous")
    out = torch.empty(bsz, w, c, device=x.device, dtype=x.dtype)
    block = 256
    _conv_kernel[(bsz, triton.cdiv(c, block))](x, conv_pool, slots, window, weight, out, w, c, x.stride(0), x.stride(1),
                                               conv_pool.stride(0), conv_pool.stride(1), KM1=km1,
                                               KP=max(2, triton.next_power_of_2(km1)), BLOCK_C=block,
                                               COMMIT=bool(commit), num_warps=4)
    return out
