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
* Trees walk as ``_tree_walk_kernel`` does: a node whose parent is not the node whose state the
  program holds continues from that state when it is an ancestor of the parent (replaying only the
  nodes between them), else restarts from the committed state; and right after a node, each of its
  *leaf* children is computed from a copy of its state, so the siblings a DDTree hangs off its
  main chain cost one update each instead of a replay of their ancestry (a 16-node tree of a chain
  of 8 with a leaf off each chain node: 16 updates instead of 52). Every node's state is still
  reached by the same updates in the same order, so its output has the same bits whatever the
  walk (``TREE_WALK`` = ``replay`` keeps the first kernel's walk for A/B runs).
* :func:`pool_gdn_commit`: the same programs replay the accepted path from the committed state
  and write the state once.
* :func:`pool_gdn_commit_layers`: the commit of every GDN layer of a verify step in one launch
  (grid ``(B, HV, layers x Dv / BV)``), from the layer-stacked conv outputs and the gates the tree
  forward stored (``pool_gdn_tree(..., gates_out=...)``): a 9B-shaped target's 24 commits were 24
  launches of 128 programs each, too few to fill the GPU.

Reductions run in another order than the reference's, so results agree to float32 rounding, not
bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter

#: how a tree (not a committed chain) is walked: ``leaves`` (``_tree_walk_kernel``) or ``replay``
#: (``_tree_kernel``, every restart replays from the committed state); ``DFLASH_GDN_TREE_WALK``
#: overrides it (A/B runs). Both give the same bits.
TREE_WALK = os.environ.get("DFLASH_GDN_TREE_WALK", "leaves")


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
def _update(S, x_ptr, node, kh, C, HKDK, dk, dv, gj, bj, DK: tl.constexpr):
    """State after node ``node`` with its gates ``(gj, bj)``: decay, delta-rule correction, rank-1
    update."""
    row = x_ptr + node * C
    kj = _l2(tl.load(row + HKDK + kh * DK + dk).to(tl.float32))
    vj = tl.load(row + 2 * HKDK + dv).to(tl.float32)
    S = S * tl.exp(gj)
    u = (vj - tl.sum(S * kj[:, None], 0)) * bj
    return S + kj[:, None] * u[None, :]


@triton.jit
def _update_raw(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK: tl.constexpr):
    """:func:`_update` with the gates computed from the raw projections."""
    gj, bj = _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab)
    return _update(S, x_ptr, node, kh, C, HKDK, dk, dv, gj, bj, DK)


@triton.jit
def _program(slots_ptr, HK, HV, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """What a program of grid ``(B, HV, Dv / BV)`` works on: ``(b, h, vb, kh, HKDK, dk, cols, dv,
    s_off)`` = its row, value head, column block, key head, ``Hk * Dk``, the key-dim and value
    column ranges, the value columns in the projection, and its state tile's offset in one layer of
    the pool (``slot * HV + h`` tiles of ``Dk x Dv``)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    return b, h, vb, kh, HK * DK, dk, cols, h * DV + cols, (slot * HV + h) * DK * DV


@triton.jit
def _node_out(S, x_ptr, o_ptr, node, h, kh, HV, C, dk, cols, q_scale, DK: tl.constexpr, DV: tl.constexpr):
    """Store node ``node``'s output ``S^T q`` (``q`` L2-normalised and scaled)."""
    qi = _l2(tl.load(x_ptr + node * C + kh * DK + dk).to(tl.float32)) * q_scale
    tl.store(o_ptr + (node * HV + h) * DV + cols, tl.sum(S * qi[:, None], 0))


@triton.jit
def _node_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, g_out_ptr, node, h, kh, HV, C, sab, HKDK, dk, dv, vb,
                 DK: tl.constexpr, GATES_OUT: tl.constexpr):
    """:func:`_update_raw` of a node visited for its own output, storing its gates when asked."""
    gi, bi = _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab)
    if GATES_OUT:
        if vb == 0:
            tl.store(g_out_ptr + (node * HV + h) * 2, gi)
            tl.store(g_out_ptr + (node * HV + h) * 2 + 1, bi)
    return _update(S, x_ptr, node, kh, C, HKDK, dk, dv, gi, bi, DK)


@triton.jit
def _tree_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, parents_ptr, anc_ptr, o_ptr, g_out_ptr,
                 W, HK, HV, C, sab, q_scale,
                 DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr,
                 GATES_OUT: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    b, h, vb, kh, HKDK, dk, cols, dv, s_off = _program(slots_ptr, HK, HV, DK, DV, BV)
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
                        S = _update_raw(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, b * W + j, h, kh, C, sab, HKDK, dk,
                                        dv, DK)
        S = _node_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, g_out_ptr, node, h, kh, HV, C, sab, HKDK, dk,
                         dv, vb, DK, GATES_OUT)
        _node_out(S, x_ptr, o_ptr, node, h, kh, HV, C, dk, cols, q_scale, DK, DV)
    if COMMIT:
        tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


@triton.jit
def _bit_index(low):
    """Index of the one set bit of the int64 ``low`` (a power of two, or ``-2**63`` for bit 63):
    the exponent of its exact float32 value."""
    e = low.to(tl.float32).to(tl.int32, bitcast=True)
    return ((e >> 23) & 255) - 127


@triton.jit
def _tree_walk_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, parents_ptr, anc_ptr, kids_ptr, o_ptr,
                      g_out_ptr, W, HK, HV, C, sab, q_scale,
                      DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, GATES_OUT: tl.constexpr, PDL: tl.constexpr = False):
    """The tree forward without most replays (module docstring): grid and results as
    :func:`_tree_kernel` without ``COMMIT``; ``kids_ptr``: per node the bit mask of its leaf
    children (:func:`leaf_children`)."""
    gdc_enter(PDL)   # (kernels.pdl)
    b, h, vb, kh, HKDK, dk, cols, dv, s_off = _program(slots_ptr, HK, HV, DK, DV, BV)
    S0 = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    S = S0
    row = b * W
    done = tl.load(kids_ptr + row) * 0                 # nodes already computed as leaf children
    cur = done - 1                                     # the node whose state S holds (-1: committed)
    for i in range(W):
        if ((done >> i) & 1) == 0:
            node = row + i
            p = tl.load(parents_ptr + node)
            m = tl.load(kids_ptr + node)
            if p != cur:
                # S -> the state after p: from S when cur is an ancestor of p (replay the nodes
                # between them), else from the committed state (replay p's whole ancestry)
                if p >= 0:
                    bits = tl.load(anc_ptr + row + p)
                    if cur >= 0:
                        if ((bits >> cur) & 1) != 0:
                            bits = bits & ~tl.load(anc_ptr + row + cur)
                        else:
                            S = S0
                    else:
                        S = S0
                    for j in range(0, p + 1):
                        if ((bits >> j) & 1) != 0:
                            S = _update_raw(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, row + j, h, kh, C, sab, HKDK,
                                            dk, dv, DK)
                else:
                    S = S0
            S = _node_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, g_out_ptr, node, h, kh, HV, C, sab, HKDK, dk,
                             dv, vb, DK, GATES_OUT)
            _node_out(S, x_ptr, o_ptr, node, h, kh, HV, C, dk, cols, q_scale, DK, DV)
            cur = p * 0 + i
            # the leaf children of node i, each from a copy of S
            done = done | m
            while m != 0:
                low = m & (-m)
                j = row + _bit_index(low)
                T = _node_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, g_out_ptr, j, h, kh, HV, C, sab, HKDK, dk,
                                 dv, vb, DK, GATES_OUT)
                _node_out(T, x_ptr, o_ptr, j, h, kh, HV, C, dk, cols, q_scale, DK, DV)
                m = m ^ low


@triton.jit
def _commit_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, path_ptr, n_ptr,
                   W, HK, HV, C, sab,
                   DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    b, h, vb, kh, HKDK, dk, cols, dv, s_off = _program(slots_ptr, HK, HV, DK, DV, BV)
    S = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    n = tl.load(n_ptr + b)
    for d in range(n):
        node = b * W + tl.load(path_ptr + b * W + d)
        S = _update_raw(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK)
    tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


@triton.jit
def _commit_layers_kernel(x_ptr, g_ptr, state_ptr, slots_ptr, path_ptr, n_ptr,
                          W, HK, HV, C, NVB, sxl, sgl, ssl,
                          DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(B, HV, L * NVB)``: program ``(b, h, l * NVB + vb)`` commits layer ``l``'s columns
    ``[vb * BV, (vb + 1) * BV)`` of value head ``h`` of row ``b``, with the gates the tree forward
    stored (``g_ptr``: ``[L, B * W, HV, 2]`` float32)."""
    gdc_enter(PDL)   # (kernels.pdl)
    b = tl.program_id(0)
    h = tl.program_id(1)
    lv = tl.program_id(2)
    layer = (lv // NVB).to(tl.int64)
    vb = lv % NVB
    kh = h % HK
    HKDK = HK * DK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    dv = h * DV + cols
    x_l = x_ptr + layer * sxl
    g_l = g_ptr + layer * sgl
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = layer * ssl + (slot * HV + h) * DK * DV
    S = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    n = tl.load(n_ptr + b)
    for d in range(n):
        node = b * W + tl.load(path_ptr + b * W + d)
        gj = tl.load(g_l + (node * HV + h) * 2)
        bj = tl.load(g_l + (node * HV + h) * 2 + 1)
        S = _update(S, x_l, node, kh, C, HKDK, dk, dv, gj, bj, DK)
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
                  ancestors: torch.Tensor | None, commit: bool, key_heads: int, head_k_dim: int,
                  gates_out: torch.Tensor | None = None, leaf_kids: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_tree`` (same arguments and
    result). ``ancestors`` is required unless ``commit`` (chains never restart); ``a`` and ``b``
    may be column slices of one projection (same strides). ``gates_out`` (``[B, W, HV, 2]``
    float32, contiguous) receives each node's ``(g, beta)`` as the kernel computed them;
    ``leaf_kids`` is :func:`leaf_children` of ``parents`` (computed here when not given: a step
    computes it once for all its layers).

    Raises:
        ValueError: a state pool that is not contiguous float32, head dims that are not powers of
            two, a tree without ``ancestors``, or a ``gates_out`` of another shape or layout.
    """
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    if not commit and ancestors is None:
        raise ValueError("a tree needs its ancestor bit masks")
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = _block_v(dv)
    out = torch.empty(bsz, w, hv, dv, device=conv_out.device, dtype=torch.float32)
    parents, slots = parents.to(torch.int64).contiguous(), slots.contiguous()   # (the walk's bit masks: int64)
    if bsz == 0 or w == 0:
        return out
    anc = ancestors.contiguous() if ancestors is not None else parents
    if gates_out is not None:
        _check_gates(gates_out, bsz, w, hv)
    if not commit and TREE_WALK == "leaves":
        kids = leaf_kids.to(torch.int64).contiguous() if leaf_kids is not None else leaf_children(parents)
        _tree_walk_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, parents, anc, kids, out,
                                                gates_out if gates_out is not None else out,
                                                w, key_heads, hv, c, a.stride(1), dk ** -0.5,
                                                DK=dk, DV=dv, BV=bv, GATES_OUT=gates_out is not None, num_warps=4, **pdl.launch(conv_out))
        return out
    _tree_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, parents, anc, out,
                                       gates_out if gates_out is not None else out,
                                       w, key_heads, hv, c, a.stride(1), dk ** -0.5,
                                       DK=dk, DV=dv, BV=bv, COMMIT=bool(commit), GATES_OUT=gates_out is not None,
                                       num_warps=4, **pdl.launch(conv_out))
    return out


@triton.jit
def _leaf_kids_kernel(par_ptr, out_ptr, W, WP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(B,)``: row ``b``'s :func:`leaf_children` in one program."""
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64) * W
    idx = tl.arange(0, WP)
    par = tl.load(par_ptr + row + idx, mask=idx < W, other=-2)
    leaf = (tl.max((par[:, None] == idx[None, :]).to(tl.int32), 0) == 0) & (idx < W)    # [j]: no child
    bit = tl.full([WP], 1, tl.int64) << idx.to(tl.int64)
    child = (par[None, :] == idx[:, None]) & leaf[None, :]                             # [i, j]
    tl.store(out_ptr + row + idx, tl.sum(tl.where(child, bit[None, :], 0), 1), mask=idx < W)


def leaf_children_reference(parents: torch.Tensor) -> torch.Tensor:
    """:func:`leaf_children` in PyTorch ops (its test oracle)."""
    w = parents.shape[1]
    ar = torch.arange(w, device=parents.device)
    child = parents[:, :, None] == ar                      # [B, j, i]: node j's parent is node i
    leaf = ~child.any(1)                                   # [B, j]: node j has no child
    bits = torch.ones(w, dtype=torch.int64, device=parents.device) << ar
    return ((child & leaf[:, :, None]).long() * bits[:, None]).sum(1)


def leaf_children(parents: torch.Tensor) -> torch.Tensor:
    """Per node, the bit mask of its children that have no child themselves (bit ``j`` = node
    ``j``), for the tree walk: one launch, graph-safe (no host reads).

    Args:
        parents: ``[B, W]`` int64, ``W <= 64`` (``-1``: the root or a padded node).

    Returns:
        ``[B, W]`` int64 (bit 63 as the sign bit).

    Raises:
        ValueError: ``W > 64``.
    """
    bsz, w = parents.shape
    if w > 64:
        raise ValueError(f"trees of at most 64 nodes, got {w}")
    parents = parents.to(torch.int64).contiguous()     # (the masks are int64 whatever the parents)
    out = torch.empty_like(parents)
    if bsz and w:
        _leaf_kids_kernel[(bsz,)](parents, out, w, WP=max(2, triton.next_power_of_2(w)), num_warps=1, **pdl.launch(parents))
    return out


def _check_gates(g: torch.Tensor, bsz: int, w: int, hv: int) -> None:
    if g.dtype != torch.float32 or not g.is_contiguous() or tuple(g.shape[-4:]) != (bsz, w, hv, 2):
        raise ValueError(f"gates must be contiguous float32 [..., B, W, HV, 2] = [..., {bsz}, {w}, {hv}, 2], "
                         f"got {tuple(g.shape)} {g.dtype}")


def pool_gdn_commit(state_pool: torch.Tensor, slots: torch.Tensor, conv_out, a, b, A, dt_bias, path: torch.Tensor,
                    n_accept: torch.Tensor, key_heads: int, head_k_dim: int) -> None:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_commit`` (same arguments)."""
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    path, n_accept = path.contiguous(), n_accept.contiguous()
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = _block_v(dv)
    _commit_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, path, n_accept,
                                         w, key_heads, hv, c, a.stride(1), DK=dk, DV=dv, BV=bv, num_warps=4, **pdl.launch(conv_out))


def pool_gdn_commit_layers(state_pools: torch.Tensor, slots: torch.Tensor, conv_outs: torch.Tensor, gates: torch.Tensor,
                           path: torch.Tensor, n_accept: torch.Tensor, key_heads: int, head_k_dim: int) -> None:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_commit_layers`` (same arguments):
    every layer's commit in one launch, grid ``(B, HV, L x Dv / BV)``.

    Raises:
        ValueError: layouts the kernel cannot read (non-contiguous pools or inputs, gates not
            ``[L, B, W, HV, 2]`` float32).
    """
    if state_pools.dtype != torch.float32 or not state_pools.is_contiguous():
        raise ValueError("state_pools must be contiguous float32")
    if not conv_outs.is_contiguous():
        raise ValueError("conv_outs must be contiguous")
    nl, bsz, w, c = conv_outs.shape
    hv, dk, dv = state_pools.shape[2], state_pools.shape[3], state_pools.shape[4]
    if head_k_dim & (head_k_dim - 1) or dv & (dv - 1):
        raise ValueError("head dims must be powers of two")
    _check_gates(gates, bsz, w, hv)
    if state_pools.shape[0] != nl or gates.shape[0] != nl:
        raise ValueError(f"layer counts differ: state {state_pools.shape[0]}, conv {nl}, gates {gates.shape[0]}")
    if dk != head_k_dim:
        raise ValueError(f"state pools hold Dk = {dk}, the layers' head_k_dim is {head_k_dim}")
    if bsz == 0 or nl == 0 or w == 0:
        return
    path, n_accept, slots = path.contiguous(), n_accept.contiguous(), slots.contiguous()
    bv = _block_v(dv)
    nvb = dv // bv
    _commit_layers_kernel[(bsz, hv, nl * nvb)](conv_outs, gates, state_pools, slots, path, n_accept,
                                               w, key_heads, hv, c, nvb, conv_outs.stride(0), gates.stride(0),
                                               state_pools.stride(0), DK=dk, DV=dv, BV=bv, num_warps=4, **pdl.launch(conv_outs))
