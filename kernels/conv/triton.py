"""The GDN layers' tree causal conv over the pooled conv state in Triton: :func:`pool_conv_tree`,
:func:`pool_conv_silu` and :func:`pool_conv_commit`, same contracts as
``kernels.conv.reference`` (the math is documented there), safe inside CUDA graphs (slots,
windows and the committed path's last nodes are read from tensors in the kernels; no host reads).

* :func:`pool_conv_silu` / :func:`pool_conv_tree` (``_conv_kernel``): one program per (batch row,
  block of ``BLOCK_W`` nodes, block of ``BLOCK_C`` channels). Each node's window rows come from
  the window table (:func:`kernels.conv.reference.conv_window_index`): a row ``r < K - 1`` is row
  ``r`` of the slot's committed conv state, a row ``r >= K - 1`` is node ``r - (K - 1)`` of the
  step's inputs. Nodes are independent, so a width-16 verify step or a 512-node prefill chunk is
  spread over many programs instead of one program walking the row's nodes in order.
* :func:`pool_conv_commit` / :func:`pool_conv_commit_layers` (``_conv_commit_kernel``): one program
  per (batch row, block of channels, layer) writes the row's new conv state: the window of the row's last accepted node without its oldest
  row, then that node's own input. All the rows it reads are loaded before any is stored (the
  rows read may be the rows written).
* ``commit=True`` (a chain committed whole: ``W = 1`` decode steps, prefill chunks): when a row is
  one node block (``W <= BLOCK_W``, the decode step) the conv program itself writes the state after
  computing the outputs (it alone reads and writes those channels of that slot: no race, and one
  launch saved). With several node blocks per row, one block writing the state while another still
  reads it would race, so the outputs come first and :func:`pool_conv_commit` follows as a second
  launch.

Bit-exactness: every output element is computed by the same operations in the same order whatever
the width ``W`` and the block shape: each tap's product in float32 of the float32-widened input and
weight, rounded to the input dtype, accumulated in float32 in tap order (oldest window row first,
the node's own input last), the sum rounded to the input dtype, then SiLU in float32. Nothing
depends on which program computes an element or on its neighbours, and FMA contraction is
disabled (``enable_fp_fusion=False``: in float32 the product would otherwise be fused into the
sum), so a chain node verified at width 16 gives bit for bit what the width-1 step at the same
position gives (speculative decoding relies on it). The conv before SiLU (:func:`pool_conv_tree`)
also equals the PyTorch reference bit for bit where PyTorch sums the ``K`` rounded products in tap
order in float32 (as it does on CPU); SiLU's ``exp`` is Triton's, so :func:`pool_conv_silu` agrees
with ``F.silu`` to the output dtype's rounding. The state copies are exact (rows are moved, not
recomputed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter

#: channels per program
BLOCK_C = 256
#: nodes per program (at most; fewer for narrower steps)
BLOCK_W = 4


@triton.jit
def _window_rows(pool, xb, r, cols, m, spr, sxw, KM1: tl.constexpr):
    """Rows ``r`` (``[N]``) of ``[committed state (K-1 rows) ; step inputs]`` at ``cols``, masked by
    ``m`` (``[N, BLOCK_C]``), in the inputs' dtype: committed rows widened or narrowed to it as the
    reference's ``conv_pool[slots].to(x.dtype)``. A select, not a sum, so ``-0.0`` stays ``-0.0``."""
    is_old = (r < KM1)[:, None]
    old = tl.load(pool + r[:, None] * spr + cols[None, :], mask=m & is_old, other=0.0)
    new = tl.load(xb + (r - KM1)[:, None] * sxw + cols[None, :], mask=m & (r >= KM1)[:, None], other=0.0)
    return tl.where(is_old, old.to(xb.dtype.element_ty), new)


@triton.jit
def _write_state(pool, xb, win_last, last, cols, cm, spr, sxw, KM1: tl.constexpr, KP: tl.constexpr):
    """New committed state of one slot at ``cols``: rows ``0..K-3`` = the window of node ``last``
    (its table row at ``win_last``) without its oldest row, row ``K-2`` = node ``last``'s input.
    Everything is loaded before anything is stored (the rows read may be rows written, by other
    threads of this program: the 2-D and 1-D tensors are laid out differently)."""
    t = tl.arange(0, KP)
    tm = t < KM1 - 1
    r = tl.load(win_last + 1 + t, mask=tm, other=0)
    m2 = tm[:, None] & cm[None, :]
    rows = _window_rows(pool, xb, r, cols, m2, spr, sxw, KM1)
    xl = tl.load(xb + last * sxw + cols, mask=cm, other=0.0)
    tl.debug_barrier()
    tl.store(pool + t[:, None] * spr + cols[None, :], rows.to(pool.dtype.element_ty), mask=m2)
    tl.store(pool + (KM1 - 1) * spr + cols, xl.to(pool.dtype.element_ty), mask=cm)


@triton.jit
def _conv_kernel(x_ptr, pool_ptr, slots_ptr, win_ptr, w_ptr, out_ptr, xs_ptr, W, C, sxb, sxw, sps, spr,
                 KM1: tl.constexpr, KP: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
                 SILU: tl.constexpr, COMMIT: tl.constexpr, SAVE_X: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(B, cdiv(W, BLOCK_W), cdiv(C, BLOCK_C))``. ``COMMIT`` only when ``W <= BLOCK_W``;
    ``SAVE_X``: the nodes' inputs are also copied to ``xs_ptr`` (``[B * W, C]`` contiguous)."""
    gdc_enter(PDL)   # (kernels.pdl)
    b = tl.program_id(0)
    nodes = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    nm = nodes < W
    cm = cols < C
    m = nm[:, None] & cm[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pool = pool_ptr + slot * sps
    xb = x_ptr + b.to(tl.int64) * sxb
    flat = b.to(tl.int64) * W + nodes                               # node index in [B * W]
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_W, BLOCK_C], tl.float32)
    for t in tl.static_range(KM1):
        r = tl.load(win_ptr + flat * KM1 + t, mask=nm, other=KM1)
        v = _window_rows(pool, xb, r, cols, m, spr, sxw, KM1)
        wt = tl.load(w_ptr + cols * (KM1 + 1) + t, mask=cm, other=0.0)
        acc += (v.to(tl.float32) * wt.to(tl.float32)[None, :]).to(xdt).to(tl.float32)
    xi = tl.load(xb + nodes[:, None] * sxw + cols[None, :], mask=m, other=0.0)
    if SAVE_X:
        tl.store(xs_ptr + flat[:, None] * C + cols[None, :], xi, mask=m)
    wt = tl.load(w_ptr + cols * (KM1 + 1) + KM1, mask=cm, other=0.0)
    acc += (xi.to(tl.float32) * wt.to(tl.float32)[None, :]).to(xdt).to(tl.float32)
    pre = acc.to(xdt).to(tl.float32)
    if SILU:
        pre = pre / (1.0 + tl.exp(-pre))
    tl.store(out_ptr + flat[:, None] * C + cols[None, :], pre.to(out_ptr.dtype.element_ty), mask=m)  # out: contiguous
    if COMMIT:
        last = W - 1
        _write_state(pool, xb, win_ptr + (b.to(tl.int64) * W + last) * KM1, last, cols, cm, spr, sxw, KM1, KP)


@triton.jit
def _conv_commit_kernel(x_ptr, pool_ptr, slots_ptr, win_ptr, last_ptr, W, C, sxb, sxw, sps, spr, sxl, spl,
                   KM1: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr, HAS_LAST: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(B, cdiv(C, BLOCK_C), L)``; the last node is ``last_ptr[b]``, or ``W - 1`` without it;
    layer ``l`` reads ``x_ptr + l * sxl`` and writes ``pool_ptr + l * spl``."""
    gdc_enter(PDL)   # (kernels.pdl)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    layer = tl.program_id(2).to(tl.int64)
    x_ptr += layer * sxl
    pool_ptr += layer * spl
    cm = cols < C
    if HAS_LAST:
        last = tl.load(last_ptr + b).to(tl.int64)
    else:
        last = b.to(tl.int64) * 0 + (W - 1)                     # W may be specialised to a constant
    slot = tl.load(slots_ptr + b).to(tl.int64)
    xb = x_ptr + b.to(tl.int64) * sxb
    _write_state(pool_ptr + slot * sps, xb, win_ptr + (b.to(tl.int64) * W + last) * KM1, last, cols, cm, spr, sxw,
                 KM1, KP)


def _check(x: torch.Tensor, conv_pool: torch.Tensor, window: torch.Tensor, weight: torch.Tensor | None = None) -> None:
    bsz, w, _ = x.shape
    km1 = conv_pool.shape[1]
    if x.stride(-1) != 1 or conv_pool.stride(-1) != 1 or not window.is_contiguous() or (
            weight is not None and not weight.is_contiguous()):
        raise ValueError("x rows, conv_pool rows, weight and window must be contiguous")
    if tuple(window.shape) != (bsz, w, km1):
        raise ValueError(f"window {tuple(window.shape)} is not [B, W, K-1] = {(bsz, w, km1)}")


def _commit(xs: torch.Tensor, pools: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
            last: torch.Tensor | None) -> None:
    """The conv commit of ``L`` layers in one launch: ``xs`` ``[L, B, W, C]``, ``pools``
    ``[L, S, K-1, C]`` (one layer: ``x[None]``, ``conv_pool[None]``)."""
    nl, bsz, w, c = xs.shape
    km1 = pools.shape[2]
    if km1 == 0 or bsz == 0 or nl == 0:
        return
    _conv_commit_kernel[(bsz, triton.cdiv(c, BLOCK_C), nl)](
        xs, pools, slots, window, last if last is not None else slots, w, c, xs.stride(1), xs.stride(2),
        pools.stride(1), pools.stride(2), xs.stride(0), pools.stride(0), KM1=km1,
        KP=max(2, triton.next_power_of_2(km1)), BLOCK_C=BLOCK_C, HAS_LAST=last is not None, num_warps=4, **pdl.launch(xs))


def _conv(x, conv_pool, slots, window, weight, commit: bool, silu: bool, block_w: int | None,
          block_c: int | None, out: torch.Tensor | None = None, x_save: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, conv_pool, window, weight)
    bsz, w, c = x.shape
    km1 = conv_pool.shape[1]
    if tuple(weight.shape) != (c, km1 + 1):
        raise ValueError(f"weight {tuple(weight.shape)} is not [C, K] = {(c, km1 + 1)}")
    bw = block_w or min(BLOCK_W, triton.next_power_of_2(max(w, 1)))
    bc = block_c or BLOCK_C
    for name, t in (("out", out), ("x_save", x_save)):
        if t is not None and (tuple(t.shape) != (bsz, w, c) or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {x.dtype} [B, W, C] = {(bsz, w, c)}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if out is None:
        out = torch.empty(bsz, w, c, device=x.device, dtype=x.dtype)
    if bsz == 0 or w == 0:
        return out
    fused = bool(commit) and w <= bw and km1 > 0
    _conv_kernel[(bsz, triton.cdiv(w, bw), triton.cdiv(c, bc))](
        x, conv_pool, slots, window, weight, out, x_save if x_save is not None else out, w, c, x.stride(0),
        x.stride(1), conv_pool.stride(0), conv_pool.stride(1), KM1=km1, KP=max(2, triton.next_power_of_2(km1)),
        BLOCK_W=bw, BLOCK_C=bc, SILU=silu, COMMIT=fused, SAVE_X=x_save is not None, num_warps=4,
        enable_fp_fusion=False, **pdl.launch(x))
    if commit and not fused:
        _commit(x[None], conv_pool[None], slots, window, None)
    return out


def pool_conv_tree(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor, block_w: int | None = None, block_c: int | None = None) -> torch.Tensor:
    """Triton version of ``kernels.conv.reference.pool_conv_tree`` (the conv before SiLU; same
    arguments and result, bit for bit where PyTorch sums in tap order). ``block_w`` /
    ``block_c``: override the block shape (tests; the result does not depend on it)."""
    return _conv(x, conv_pool, slots, window, weight, False, False, block_w, block_c)


def pool_conv_silu(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                   weight: torch.Tensor, commit: bool = False, block_w: int | None = None,
                   block_c: int | None = None, out: torch.Tensor | None = None,
                   x_save: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``kernels.conv.reference.pool_conv_silu``: conv + SiLU of every node and,
    with ``commit``, the rows' new conv states (fused into the same launch when a row is one node
    block, else a :func:`pool_conv_commit` launch after it; module docstring).

    Args:
        x: ``[B, W, C]`` pre-conv inputs, any float dtype, last dim contiguous (a column slice of a
            projection is fine).
        conv_pool: ``[S, K-1, C]`` one layer's committed conv states, last dim contiguous.
        slots: ``[B]`` int64 (distinct, except a spare slot shared by padded rows whose state is
            garbage anyway); window: ``[B, W, K-1]`` int64 contiguous
            (:func:`kernels.conv.reference.conv_window_index`); weight: ``[C, K]`` contiguous.
        commit: each row is a chain committed whole (its last node is ``W - 1``).
        block_w, block_c: override the block shape (tests; the result does not depend on it).
        out: optional ``[B, W, C]`` contiguous tensor of ``x``'s dtype to write the result into.
        x_save: optional ``[B, W, C]`` contiguous tensor of ``x``'s dtype that receives a copy of
            ``x`` (for :func:`pool_conv_commit_layers`).

    Returns:
        ``[B, W, C]`` contiguous, in ``x``'s dtype (``out`` when given).

    Raises:
        ValueError: layouts or shapes the kernel cannot read.
    """
    return _conv(x, conv_pool, slots, window, weight, commit, True, block_w, block_c, out, x_save)


def pool_conv_commit(x: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                     last: torch.Tensor) -> None:
    """Triton version of ``kernels.conv.reference.pool_conv_commit`` (same arguments): one launch
    for the batch, grid ``(B, cdiv(C, BLOCK_C))``; ``last`` ``[B]`` int64 is read in the kernel
    (graph-safe). The rows are copied, so the new state equals the reference's bit for bit."""
    _check(x, conv_pool, window)
    _commit(x[None], conv_pool[None], slots, window, last.contiguous())


def pool_conv_commit_layers(xs: torch.Tensor, conv_pools: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                            last: torch.Tensor) -> None:
    """Triton version of ``kernels.conv.reference.pool_conv_commit_layers`` (same arguments): every
    layer in one launch, grid ``(B, cdiv(C, BLOCK_C), L)``; bit for bit the reference's rows.

    Raises:
        ValueError: layouts the kernel cannot read, or layer counts that differ.
    """
    if xs.dim() != 4 or conv_pools.dim() != 4 or xs.shape[0] != conv_pools.shape[0]:
        raise ValueError(f"xs [L, B, W, C] and conv_pools [L, S, K-1, C] disagree: {tuple(xs.shape)}, "
                         f"{tuple(conv_pools.shape)}")
    _check(xs[0], conv_pools[0], window)
    _commit(xs, conv_pools, slots, window, last.contiguous())
