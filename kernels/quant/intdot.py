"""Q4_K products in exact integer arithmetic: the skinny path (``M <= 64`` rows) of
:func:`kernels.quant.triton.linear` for Q4_K weights and 16-bit ``x`` (issue 19;
docs/ARCHITECTURE.md, "Quantized weights").

**Why.** The generic skinny kernel turns every code into a tensor-core operand in ``x``'s dtype, a
few instructions per code; at one row it took 2.7-3.4x the time of copying the weight's bytes
(``benchmarks/gpu/quant/run7``). llama.cpp's ``mmvq`` spends about one instruction per four codes:
it rounds ``x`` to 8-bit integers per group of 32 (``q8_1``) and multiplies four codes at a time
with ``dp4a`` (four byte products summed into an int32). Its rounding costs ~0.3% relative error,
three times issue 19's 1e-3.

**The split of x** (:func:`split_x`, its plain-PyTorch reference :func:`quantize_x`): each group
of 32 values of a row becomes two 8-bit planes, ``x = s * (h + l / 254)``, with ``s = max|x| /
127`` (1 where that is zero or below float32's normals: :data:`S_MIN`), ``h = round(x / s)``, ``l = round((x / s - h) * 254)``: ``|x - s (h + l / 254)| <= s /
508``, about 2e-5 of the group's largest value. Per 32-code sub-block the two integer dots
``sum q h`` and ``sum q l`` (codes ``q`` 0..15) are exact in int32, and the sub-block's term is
gguf-py's factoring of the dequantized dot, ``(d * sc) * s * (sum q h + sum q l / 254) - (dmin *
m) * sum x`` (``sum x`` of the unrounded values, float32), its roundings spelled out
(:func:`_epilogue`: ``tl.fma``, nothing left to the compiler's contraction). Against gguf-py's
dequantization and a float32 product: ~2e-5 relative (``benchmarks/gpu/quant/run9``).

**Two kernels, the same bits.** One row (decode): :func:`_q4k_dp4a_kernel`, on the CUDA cores,
``dp4a`` in PTX on the code words (``w & 0x0F0F0F0F``: the four low-nibble codes of a word,
``(w >> 4) & 0x0F0F0F0F`` the high ones) against the planes' words. Several rows (verify, the
drafter's block, the LM head of a batch): :func:`_q4k_mma_kernel`, the same integer dots as int8
tensor-core dots (``tl.dot`` int8 x int8 -> int32). Integer sums are exact whatever their order,
the epilogue is the same expression in the same order, ``K`` is split by :func:`split_k_for` (a
function of ``N`` and ``K`` only) and the partials are added in a fixed order; so every row of an
``M``-row call has the bits of a one-row call, the engine's lossless rule (a verify's rows equal
the decode steps they replace). On an H200, 9B-shaped projections (``run9``): one row 9.9-19.8 us
against the generic kernel's 18.1-41.5 (1.2-1.9x the copy time of the bytes); 16 rows 19.9-44.1 us
against 19.2-48.5.

The Triton interpreter cannot run PTX: on the CPU (``TRITON_INTERPRET=1``, tests) ``dp4a`` is
spelled out in integer operations (``EMULATE``), the same sums.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.quant.partials import _split_sum_kernel, _store_split, tile_counters
from kernels.quant.weight import QuantizedWeight, int_setting

log = logging.getLogger(__name__)

#: the second plane's scale: x = s * (h + l / L_SCALE)
L_SCALE = 254.0
#: a group's scale below this (float32's smallest normal, 2^-126; zero included) is taken as 1
S_MIN = 2.0 ** -126
#: rows per program of the several-row kernel (a launch has a program per 16 rows and block of
#: features, as the generic skinny kernel has: more rows per program spilled registers at 64,
#: ``tools/intdot_compile.py``)
MMA_ROWS = 16
#: output features per program: the one-row kernel (1 warp), the several-row kernel (2 warps)
DP4A_BLOCK_N, MMA_BLOCK_N = 16, 64


def mma_launches(value: str | None) -> dict[str, tuple[int, int]]:
    """Per type, the several-row kernel's ``(BLOCK_N, warps)`` from ``DFLASH_QUANT_MMA_LAUNCH``
    (e.g. ``Q6_K:16:4,Q4_K:64:2``; types not named keep ``MMA_BLOCK_N`` and 2 warps). Neither
    changes a row's bits (each output's sum runs over the same ``K`` split in the same order), so
    this is a speed setting only.

    Raises:
        ValueError: an entry that is not ``TYPE:BLOCK_N:WARPS``, a type the integer kernels do not
            take (:data:`TYPES`), a ``BLOCK_N`` that is not a power of two from 16 to 256 (the
            int8 dots' smallest tile) or warps other than 1, 2, 4, 8.
    """
    out = {}
    for part in (value or "").replace(" ", "").split(","):
        if not part:
            continue
        try:
            name, bn, warps = part.split(":")
            name, bn, warps = name.upper(), int(bn), int(warps)
        except ValueError:
            raise ValueError(f"DFLASH_QUANT_MMA_LAUNCH entries are TYPE:BLOCK_N:WARPS, got {part!r}") from None
        if name not in TYPES or bn not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8):
            raise ValueError(f"DFLASH_QUANT_MMA_LAUNCH: {part!r} needs a type of {', '.join(TYPES)}, BLOCK_N a power "
                             "of two from 16 to 256 and 1, 2, 4 or 8 warps")
        out[name] = (bn, warps)
    return out


#: a split over ``K`` summed inside the product's kernel (:func:`kernels.quant.partials._store_split`:
#: one launch a product, the same bits) rather than by :func:`_split_sum_kernel` after it;
#: ``DFLASH_QUANT_FUSED_SUM=0`` keeps the second launch (A/B runs). Its tile counters are one buffer
#: per device (:func:`kernels.quant.partials.tile_counters`): products on one device must run in
#: stream order, never at once on two streams (the engine's rule: one compute stream a process)
FUSED_SUM = os.environ.get("DFLASH_QUANT_FUSED_SUM", "1").strip().lower() not in ("0", "false", "no", "off")


def split_k_for(n: int, k: int, block: int = 256) -> int:
    """The ``K`` split of both kernels for an ``[N, K]`` weight of ``block``-element blocks: the
    smallest power of two (at most 16, dividing ``K``'s blocks) giving the one-row launch at least
    2048 programs of :data:`DP4A_BLOCK_N` features (``run9``'s best one-row Q4_K launches: 4096 x
    4096 split 8, 12288 x 4096 split 4). Never depends on ``M``."""
    blocks = k // block
    split = 1
    while triton.cdiv(n, DP4A_BLOCK_N) * split < 2048 and split < 16 and blocks % (split * 2) == 0:
        split *= 2
    return split


# ---------------------------------------------------------------------------------------------
# plain PyTorch: the split of x and the integer arithmetic (the oracles)

class Planes(NamedTuple):
    """``x`` ``[M, K]`` split for the integer dots (module docstring): ``x ~= s * (h + l / 254)``.

    Attributes:
        h, l: int8 ``[M, K]``, the two planes.
        s: float32 ``[M, K / 32]``, ``max |x| / 127`` of each group of 32 (1 for an all-zero group).
        xsum: float32 ``[M, K / 32]``, each group's sum of ``x`` (the unrounded values).
        hsum, lsum: int32 ``[M, K / 16]``, each half-group's sum of ``h`` and of ``l`` (Q6_K's
            16-element groups: its codes' offset of 32 taken out of the integer dots).
    """

    h: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the plane's name in the module docstring
    s: torch.Tensor
    xsum: torch.Tensor
    hsum: torch.Tensor
    lsum: torch.Tensor

    def rows(self, at: int, n: int) -> "Planes":
        """Rows ``at .. at + n`` (views)."""
        return Planes(*(t[at : at + n] for t in self))


def quantize_x(x: torch.Tensor) -> Planes:
    """The split of ``x`` ``[M, K]`` (any float dtype, ``K`` a multiple of 32; any device), plain
    PyTorch (the reference of :func:`split_x`): :class:`Planes`, so that ``x ~= s * (h + l / 254)``
    within ``s / 508`` per element (module docstring). Ties round half to even, here and in
    :func:`split_x`, which computes the same IEEE operations: tensor-by-tensor divisions (on CUDA
    ATen turns a division by a scalar into a product with its reciprocal), a product and two
    roundings (on the GPU Triton's ``/`` is approximate and ptxas fuses a product with the next add:
    the first GPU run of the tests found planes one apart). A group whose ``max|x| / 127`` is zero
    or below float32's smallest normal (2^-126) gets ``s`` = 1, so its values, all below 2^-119,
    become zero planes (``sum x`` keeps them). A group holding a value that is not finite gets
    ``s`` = NaN, which makes every product it enters NaN (as the float kernels would give NaN or an
    infinity)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    finite = torch.isfinite(g).all(dim=2)
    g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
    amax = g.abs().amax(dim=2)
    s = torch.div(amax, torch.full_like(amax, 127.0))
    s = torch.where(s >= S_MIN, s, torch.ones_like(s))
    u = torch.div(g, s[..., None].expand_as(g))
    h = torch.round(u).clamp(-127, 127)
    lo = torch.round((u - h) * L_SCALE).clamp(-127, 127)
    h8, l8 = h.to(torch.int8).reshape(m, k), lo.to(torch.int8).reshape(m, k)
    half = lambda p: p.to(torch.int32).reshape(m, k // 16, 16).sum(dim=2, dtype=torch.int32)  # noqa: E731
    s = torch.where(finite, s, torch.full_like(s, float("nan")))   # (a value not finite: NaN products)
    return Planes(h8, l8, s.contiguous(), g.sum(dim=2).contiguous(), half(h8), half(l8))


#: the types the integer kernels take
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0")
#: the legacy types among them: blocks of 32 elements, one scale (and min) each
LEGACY = ("Q4_0", "Q4_1", "Q8_0")
#: the kernels' constexpr for each legacy type
_LEGACY_CODE = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def _mma_launch_setting() -> dict[str, tuple[int, int]]:
    """:func:`mma_launches` of the environment; a bad value is logged and left out (every type
    keeps its default launch), so that it cannot stop a service from starting."""
    try:
        return mma_launches(os.environ.get("DFLASH_QUANT_MMA_LAUNCH"))
    except ValueError as e:
        log.warning("%s: ignored", e)
        return {}


#: the several-row kernel's launch per type (:func:`mma_launches`)
MMA_LAUNCH = _mma_launch_setting()

#: the several-row kernels' software-pipelining stages (``num_stages``; ``None``: Triton's default,
#: 3): ``DFLASH_QUANT_MMA_STAGES`` for A/B runs (compiled for sm_90, the stages move the weight
#: loads into asynchronous copies through shared memory, ``LDGSTS``). The bits do not depend on it.
MMA_STAGES = int_setting("DFLASH_QUANT_MMA_STAGES", os.environ.get("DFLASH_QUANT_MMA_STAGES"), None, lambda v: 1 <= v <= 8)


def block_elems(name: str) -> int:
    """Elements per block of ``name`` (:data:`TYPES`): 256 for the k-quants, 32 for the legacy types."""
    return 32 if name in LEGACY else 256


def reference(x: torch.Tensor, w: QuantizedWeight, planes: Planes | None = None) -> torch.Tensor:
    """The kernels' arithmetic in plain PyTorch (their oracle): ``x`` ``[M, K]`` split
    (:func:`quantize_x`, or ``planes``), a weight ``[N, K]`` of :data:`TYPES`; per group sharing a
    scale the exact integer dots of the codes with both planes, then gguf-py's factoring of the
    group's dequantized dot: Q4_K and Q5_K ``(d * sc) * s * (dot_h + dot_l / 254) - (dmin * m) * sum
    x`` (32-element sub-blocks); the legacy types as :func:`_legacy_acc`; Q6_K ``(d * sc) * s * (dot_h + dot_l / 254)`` with the codes' offset of 32 taken
    out of the dots (``dot_h = sum q h - 32 sum h``; 16-element groups); summed over the groups in
    float64. Returns float32 ``[M, N]``. Codes and scales as gguf-py lays them out (``gguf.quants``).

    Raises:
        ValueError: another type, or ``K`` mismatch.
    """
    if w.qtype.name not in TYPES or x.shape[-1] != w.shape[1]:
        raise ValueError(f"a weight of {', '.join(TYPES)} [N, {x.shape[-1]}], got {w.qtype.name} {tuple(w.shape)}")
    p = planes if planes is not None else quantize_x(x)
    if w.qtype.name == "Q6_K":
        return _reference_q6k(x, w, p)
    if w.qtype.name in LEGACY:
        return _reference_legacy(x, w, p)
    h, lo, s, xsum = p.h, p.l, p.s, p.xsum
    m, k = x.shape
    n = w.shape[0]
    q5 = w.qtype.name == "Q5_K"
    raw = w.blocks().cpu()
    d = raw[:, :, 0:2].contiguous().view(torch.float16).float()[..., 0]
    dmin = raw[:, :, 2:4].contiguous().view(torch.float16).float()[..., 0]
    sc6 = raw[:, :, 4:16].to(torch.int64)
    sc = torch.empty(n, k // 256, 8, dtype=torch.int64)
    mn = torch.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = sc6[..., j] & 63, sc6[..., j + 4] & 63
        else:
            sc[..., j] = (sc6[..., j + 4] & 15) | ((sc6[..., j - 4] >> 6) << 4)
            mn[..., j] = (sc6[..., j + 4] >> 4) | ((sc6[..., j] >> 6) << 4)
    qs = raw[:, :, 48 if q5 else 16:].to(torch.int64).reshape(n, k // 256, 4, 32)
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // 256, 8, 32)   # sub-block 2c: low nibbles
    if q5:   # Q5_K: bit g of qh[l] is the fifth bit of element l of sub-block g
        qh = raw[:, :, 16:48].to(torch.int64)
        codes = codes | (((qh[:, :, None, :] >> torch.arange(8)[:, None]) & 1) << 4)
    hp = h.cpu().to(torch.int64).reshape(m, k // 256, 8, 32)
    lp = lo.cpu().to(torch.int64).reshape(m, k // 256, 8, 32)
    dot_h = torch.einsum("nbgi,mbgi->mnbg", codes, hp).double()
    dot_l = torch.einsum("nbgi,mbgi->mnbg", codes, lp).double()
    sx = s.cpu().reshape(m, 1, k // 256, 8).double()
    xs = xsum.cpu().reshape(m, 1, k // 256, 8).double()
    term = (d[..., None] * sc).double() * sx * (dot_h + dot_l / L_SCALE) - (dmin[..., None] * mn).double() * xs
    return term.sum(dim=(2, 3)).float()


def q6k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks ``[N, B, 210]`` (uint8) -> ``(codes, scales, d)``: the 6-bit codes int64 ``[N, B,
    256]`` (0..63, in element order; the value is ``d * scale * (code - 32)``), the 16 int8 scales
    int64 ``[N, B, 16]`` (element ``e``'s is ``e // 16``) and ``d`` float32 ``[N, B]``. gguf-py's
    layout: per half of 128 elements, 64 bytes of low nibbles ``ql`` and 32 of high pairs ``qh``;
    elements ``l``, ``l + 32``, ``l + 64``, ``l + 96`` of a half take ``ql[l]``'s low nibble,
    ``ql[l + 32]``'s low, ``ql[l]``'s high and ``ql[l + 32]``'s high, with bits 0-1, 2-3, 4-5, 6-7
    of ``qh[l]`` above them."""
    n, b, _ = raw.shape
    ql = raw[..., :128].to(torch.int64).reshape(n, b, 2, 2, 32)     # [half, a/b, l]
    qh = raw[..., 128:192].to(torch.int64).reshape(n, b, 2, 32)     # [half, l]
    runs = torch.stack([(ql[:, :, :, 0] & 15) | ((qh & 3) << 4), (ql[:, :, :, 1] & 15) | (((qh >> 2) & 3) << 4),
                        (ql[:, :, :, 0] >> 4) | (((qh >> 4) & 3) << 4), (ql[:, :, :, 1] >> 4) | (((qh >> 6) & 3) << 4)],
                       dim=3)                                        # [N, B, half, run, l]
    sc = raw[..., 192:208].contiguous().view(torch.int8).to(torch.int64)
    d = raw[..., 208:210].contiguous().view(torch.float16).float()[..., 0]
    return runs.reshape(n, b, 256), sc, d


def legacy_codes(name: str, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks ``[N, B, bytes]`` (uint8) of a legacy type -> ``(codes, d, m)``: the codes int64 ``[N, B,
    32]`` in element order as the dots see them (Q4_0, Q4_1: 0..15, the low nibbles of the 16 code
    bytes then the high ones; Q8_0: -128..127), ``d`` float32 ``[N, B]`` and ``m`` (Q4_1's min, else
    None). The value is ``d * (q - 8)`` (Q4_0), ``d * q + m`` (Q4_1), ``d * q`` (Q8_0): gguf-py's."""
    d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if name == "Q8_0":
        return raw[..., 2:34].contiguous().view(torch.int8).to(torch.int64), d, None
    at = 4 if name == "Q4_1" else 2
    qs = raw[..., at : at + 16].to(torch.int64)
    m = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if name == "Q4_1" else None
    return torch.cat([qs & 15, qs >> 4], dim=-1), d, m


def _reference_legacy(x: torch.Tensor, w: QuantizedWeight, p: Planes) -> torch.Tensor:
    m, k = x.shape
    name = w.qtype.name
    codes, d, mn = legacy_codes(name, w.blocks().cpu())
    hp = p.h.cpu().to(torch.int64).reshape(m, k // 32, 32)
    lp = p.l.cpu().to(torch.int64).reshape(m, k // 32, 32)
    dot_h = torch.einsum("nbi,mbi->mnb", codes, hp)
    dot_l = torch.einsum("nbi,mbi->mnb", codes, lp)
    if name == "Q4_0":   # the codes' offset of 8 out of the dots
        dot_h = dot_h - 8 * hp.sum(dim=2)[:, None]
        dot_l = dot_l - 8 * lp.sum(dim=2)[:, None]
    sx = p.s.cpu()[:, None].double()
    term = d.double() * sx * (dot_h.double() + dot_l.double() / L_SCALE)
    if mn is not None:
        term = term + mn.double() * p.xsum.cpu()[:, None].double()
    return term.sum(dim=2).float()


def _reference_q6k(x: torch.Tensor, w: QuantizedWeight, p: Planes) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    codes, sc, d = q6k_codes(w.blocks().cpu())
    codes = codes.reshape(n, k // 256, 16, 16)
    hp = p.h.cpu().to(torch.int64).reshape(m, k // 256, 16, 16)
    lp = p.l.cpu().to(torch.int64).reshape(m, k // 256, 16, 16)
    dot_h = (torch.einsum("nbgi,mbgi->mnbg", codes, hp) - 32 * hp.sum(dim=3)[:, None]).double()
    dot_l = (torch.einsum("nbgi,mbgi->mnbg", codes, lp) - 32 * lp.sum(dim=3)[:, None]).double()
    sx = p.s.cpu().reshape(m, 1, k // 256, 8).repeat_interleave(2, dim=3).double()
    term = (d[..., None] * sc).double() * sx * (dot_h + dot_l / L_SCALE)
    return term.sum(dim=(2, 3)).float()


# ---------------------------------------------------------------------------------------------
# Triton

@triton.jit
def _mul_rn(a, b, EMULATE: tl.constexpr):
    """``a * b`` (float32) rounded once and never contracted into an FMA with what follows (PTX
    ``mul.rn.f32``; ptxas otherwise fuses a product with the next add), as PyTorch computes it."""
    if EMULATE:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _round_even(v):
    """``v`` (float32, ``|v| < 2^22``) rounded to the nearest integer, ties to even (``torch.round``):
    two IEEE adds around ``1.5 * 2^23``, at whose magnitude float32 holds integers only."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _split_kernel(x_ptr, h_ptr, l_ptr, s_ptr, xs_ptr, hs_ptr, ls_ptr, K, sxm, GROUPS: tl.constexpr,
                  EMULATE: tl.constexpr):
    """Row ``program_id(0)``, groups ``program_id(1) * GROUPS ...`` of 32 of ``x`` (any float
    dtype, row stride ``sxm``) into :class:`Planes` (row-major), bit for bit :func:`quantize_x`: IEEE
    divisions (``tl.div_rn``: Triton's ``/`` is PTX's approximate ``div.full.f32``), an uncontracted
    product (:func:`_mul_rn`) and ties to even (:func:`_round_even`)."""
    m = tl.program_id(0)
    gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ng = K // 32
    ok = gi < ng
    col = gi[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m.to(tl.int64) * sxm + col, mask=ok[:, None], other=0.0).to(tl.float32)
    ok_x = tl.abs(x) < float("inf")             # (False for a NaN or an infinity)
    finite = tl.min(ok_x.to(tl.int32), axis=1)
    x = tl.where(ok_x, x, 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    s = tl.where(s >= 1.1754943508222875e-38, s, 1.0)    # (S_MIN: zero or below float32's normals)
    u = tl.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    h = tl.minimum(tl.maximum(_round_even(u), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(_round_even(_mul_rn(u - h, tl.full(u.shape, 254.0, tl.float32), EMULATE)), -127.0), 127.0)
    out = m.to(tl.int64) * K + col
    tl.store(h_ptr + out, h.to(tl.int8), mask=ok[:, None])
    tl.store(l_ptr + out, lo.to(tl.int8), mask=ok[:, None])
    tl.store(s_ptr + m.to(tl.int64) * ng + gi, tl.where(finite == 1, s, float("nan")), mask=ok)   # (NaN products)
    tl.store(xs_ptr + m.to(tl.int64) * ng + gi, tl.sum(x, axis=1), mask=ok)
    half = m.to(tl.int64) * (2 * ng) + gi[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(hs_ptr + half, tl.sum(tl.reshape(h.to(tl.int32), (GROUPS, 2, 16)), axis=2), mask=ok[:, None])
    tl.store(ls_ptr + half, tl.sum(tl.reshape(lo.to(tl.int32), (GROUPS, 2, 16)), axis=2), mask=ok[:, None])


def split_x(x: torch.Tensor) -> Planes:
    """:func:`quantize_x` in one Triton launch (``x`` ``[M, K]`` on the device, ``K`` a multiple of
    32; any float dtype, unit stride along ``K``): :class:`Planes`, the same planes and scales bit
    for bit (``xsum`` but for its float sum's order)."""
    m, k = x.shape
    h = torch.empty(m, k, device=x.device, dtype=torch.int8)
    lo = torch.empty_like(h)
    s = torch.empty(m, k // 32, device=x.device, dtype=torch.float32)
    xs = torch.empty_like(s)
    hs = torch.empty(m, k // 16, device=x.device, dtype=torch.int32)
    ls = torch.empty_like(hs)
    if m and k:
        groups = 32
        _split_kernel[(m, triton.cdiv(k // 32, groups))](x, h, lo, s, xs, hs, ls, k, x.stride(0), GROUPS=groups,
                                                          EMULATE=x.device.type != "cuda", num_warps=4)
    return Planes(h, lo, s, xs, hs, ls)


@triton.jit
def _dp4a(a, b, EMULATE: tl.constexpr):
    """Per element, the dot of the four unsigned bytes of ``a`` with the four signed bytes of ``b``
    (int32): PTX ``dp4a.u32.s32``, or the same in integer operations (``EMULATE``: the interpreter)."""
    if EMULATE:
        acc = tl.zeros(a.shape, tl.int32)
        for t in tl.static_range(4):
            acc += ((a >> (8 * t)) & 255) * ((b << (24 - 8 * t)) >> 24)   # (an arithmetic shift: the signed byte)
        return acc
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros(a.shape, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _epilogue(dh, dl, scale, sx, bias, xsum):
    """A sub-block's term ``(scale * s) * (dot_h + dot_l / 254) + bias * sum x`` (float32), its
    roundings spelled out (``tl.fma``), so that both kernels compute the same bits from the same
    integer dots (no contraction left to the compiler)."""
    return tl.fma(scale * sx, tl.fma(dl.to(tl.float32), 1.0 / 254.0, dh.to(tl.float32)), bias * xsum)


@triton.jit
def _f16(ptr):
    """The float16 at ``ptr`` (uint8 pointers, 2-byte aligned) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _scale_min(w0, w1, w2, g: tl.constexpr, d, m):
    """Sub-block ``g``'s ``(d * sc, -dmin * mn)`` (float32) from the 12 scale bytes read once per
    super-block as three 32-bit words ``w0``, ``w1``, ``w2`` (bytes 4-7, 8-11, 12-15 of the block;
    byte ``i`` of the 12 is byte ``i % 4`` of word ``i // 4``): ggml's ``get_scale_min_k4``."""
    if g < 4:
        sc = (w0 >> (8 * g)) & 63
        mn = (w1 >> (8 * g)) & 63
    else:
        q4 = (w2 >> (8 * (g - 4))) & 255             # byte g + 4
        sc = (q4 & 15) | ((((w0 >> (8 * (g - 4))) & 255) >> 6) << 4)
        mn = (q4 >> 4) | ((((w1 >> (8 * (g - 4))) & 255) >> 6) << 4)
    return d * sc.to(tl.float32), -(m * mn.to(tl.float32))


@triton.jit
def _program(w_ptr, N, K, swn, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's ``(rn, row, b0, nb)``: its ``BLOCK_N`` output features (``program_id(0)``),
    their weight rows' first bytes (``[BLOCK_N]`` pointers, the last row repeated past ``N``), and
    its super-blocks ``b0 .. b0 + nb`` of ``K``'s (``program_id(1)`` of ``SPLIT_K``)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nb = K // 256 // SPLIT_K
    return rn, w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn, tl.program_id(1) * nb, nb


@triton.jit
def _q4k_head(blk):
    """``(d, dmin, w0, w1, w2)`` of the Q4_K super-blocks at ``blk`` (``[R]`` uint8 pointers): the
    two float16 scales as float32 and the 12 scale bytes as three 32-bit words (:func:`_scale_min`)."""
    sw = (blk + 4).to(tl.pointer_type(tl.int32))
    return _f16(blk), _f16(blk + 2), tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)


@triton.jit
def _bytes_of(q):
    """Code words ``[R, 8]`` (four byte codes each, little-endian) as int8 ``[R, 32]``: word
    ``i``'s bytes are elements ``4 i .. 4 i + 3`` (an operand of the int8 tensor-core dots)."""
    return tl.reshape(tl.join(tl.join(q & 255, (q >> 16) & 255), tl.join((q >> 8) & 255, q >> 24)),
                      (q.shape[0], 32)).to(tl.int8)   # (int8 keeps the low byte: q >> 24 needs no mask)


@triton.jit
def _q4k_block(row, b, i8, Q5: tl.constexpr):
    """Super-block ``b`` of the Q4_K (Q5_K: ``Q5``) rows starting at ``row`` (``[R]`` uint8
    pointers): its first bytes ``blk``, :func:`_q4k_head`'s ``(d, dmin, w0, w1, w2)`` and, for
    Q5_K, the 32 high-bit bytes as words ``qh`` ``[R, 8]`` (0 for Q4_K): both kernels' walk."""
    blk = row + b * (176 if Q5 else 144)
    d, dm, w0, w1, w2 = _q4k_head(blk)
    qh = tl.load((blk + 16).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :]) if Q5 else 0
    return blk, d, dm, w0, w1, w2, qh


@triton.jit
def _q4k_words(blk, c: tl.constexpr, i8, Q5: tl.constexpr):
    """Chunk ``c`` (0..3) of the super-blocks at ``blk``: its 32 code bytes as words ``[R, 8]``
    (sub-blocks ``2 c`` and ``2 c + 1``: :func:`_q45_codes`)."""
    return tl.load((blk + (48 if Q5 else 16) + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])


@triton.jit
def _q45_codes(words, qh, c: tl.constexpr, hi: tl.constexpr, Q5: tl.constexpr):
    """Sub-block ``2 c + hi``'s code words ``[R, 8]`` (byte ``i`` of word ``t``: element ``4 t + i``):
    the low (``hi`` 0) or high nibbles of ``words`` (the chunk's 32 code bytes as words); Q5_K adds
    bit ``2 c + hi`` of each ``qh`` byte (the 32 high-bit bytes as words) as the fifth bit."""
    q = (words >> (4 * hi)) & 0x0F0F0F0F
    if Q5:
        q = q | (((qh >> (2 * c + hi)) & 0x01010101) << 4)
    return q


@triton.jit
def _q4k_dp4a_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, K, swn,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, Q5: tl.constexpr = False,
                     FUSED: tl.constexpr = False):
    """One row of ``x`` as its planes (``h_ptr``, ``l_ptr``: int8 ``[K]``, read as int32 words of
    four; ``s_ptr``, ``xs_ptr``: float32 ``[K / 32]``) times a Q4_K weight (uint8 ``[N, K / 256 *
    144]``): per program ``BLOCK_N`` weight rows over ``K / SPLIT_K``; per super-block the 128 code
    bytes as four ``[BLOCK_N, 8]`` tiles of 32-bit words, word ``i`` of tile ``c`` holding elements
    ``4 i .. 4 i + 3`` of sub-blocks ``2 c`` (low nibbles) and ``2 c + 1`` (high). ``y_ptr``: ``[N]``;
    with ``SPLIT_K`` > 1 ``part_ptr`` the float32 partials ``[SPLIT_K, N]`` and ``cnt_ptr`` the tile
    counters (:func:`kernels.quant.partials._store_split`: the last program sums them into ``y``)."""
    rn, row, b0, nb = _program(w_ptr, N, K, swn, BLOCK_N, SPLIT_K)
    i8 = tl.arange(0, 8)
    hw = h_ptr.to(tl.pointer_type(tl.int32))
    lw = l_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        blk, d, dm, w0, w1, w2, qh = _q4k_block(row, b, i8, Q5)
        for c in tl.static_range(4):
            words = _q4k_words(blk, c, i8, Q5)
            for hi in tl.static_range(2):
                g = 2 * c + hi
                q = _q45_codes(words, qh, c, hi, Q5)
                xw = b * 64 + g * 8 + i8       # the x words of the sub-block
                xh = tl.broadcast_to(tl.load(hw + xw)[None, :], (BLOCK_N, 8))
                xl = tl.broadcast_to(tl.load(lw + xw)[None, :], (BLOCK_N, 8))
                dh = tl.sum(_dp4a(q, xh, EMULATE), axis=1)
                dl = tl.sum(_dp4a(q, xl, EMULATE), axis=1)
                scale, bias = _scale_min(w0, w1, w2, g, d, dm)
                acc += _epilogue(dh, dl, scale, tl.load(s_ptr + b * 8 + g), bias, tl.load(xs_ptr + b * 8 + g))
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rn, rn < N, tl.program_id(0), N, SPLIT_K, FUSED)


@triton.jit
def _q4k_mma_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, swn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, Q5: tl.constexpr = False,
                    FUSED: tl.constexpr = False):
    """``M`` rows of ``x`` as their planes (int8 ``[M, K]`` each; ``s``, ``xsum`` float32 ``[M, K /
    32]``) times a Q4_K weight: per sub-block the integer dots of 32 codes with both planes as int8
    tensor-core dots (exact: the sums :func:`_q4k_dp4a_kernel` makes with ``dp4a``), then the same
    :func:`_epilogue` in the same order. ``y_ptr``: ``[M, N]``; ``part_ptr`` ``[SPLIT_K, M, N]``
    and ``cnt_ptr`` as in :func:`_q4k_dp4a_kernel`, one counter per ``(program_id(2), program_id(0))``."""
    rn, row, b0, nb = _program(w_ptr, N, K, swn, BLOCK_N, SPLIT_K)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    i8, i32 = tl.arange(0, 8), tl.arange(0, 32)
    mrow = rm < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for b in range(b0, b0 + nb):
        blk, d, dm, w0, w1, w2, qh = _q4k_block(row, b, i8, Q5)
        for c in tl.static_range(4):
            words = _q4k_words(blk, c, i8, Q5)
            for hi in tl.static_range(2):
                g = 2 * c + hi
                q = _q45_codes(words, qh, c, hi, Q5)
                codes = _bytes_of(q)
                xo = rm[:, None].to(tl.int64) * K + (b * 256 + g * 32 + i32)[None, :]
                xh = tl.load(h_ptr + xo, mask=mrow[:, None], other=0)        # [BLOCK_M, 32] int8
                xl = tl.load(l_ptr + xo, mask=mrow[:, None], other=0)
                dh = tl.dot(codes, tl.trans(xh), out_dtype=tl.int32)    # [BLOCK_N, BLOCK_M], exact
                dl = tl.dot(codes, tl.trans(xl), out_dtype=tl.int32)
                sx = tl.load(s_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=1.0)
                xsum = tl.load(xs_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=0.0)
                scale, bias = _scale_min(w0, w1, w2, g, d, dm)
                acc += _epilogue(dh, dl, scale[:, None], sx[None, :], bias[:, None], xsum[None, :])
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rm[None, :].to(tl.int64) * N + rn[:, None], (rn[:, None] < N) & mrow[None, :],
                 tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), M * N, SPLIT_K, FUSED)


@triton.jit
def _acc6(acc, dh, dl, scale, sx):
    """``acc`` plus a Q6_K (or Q4_0, Q8_0) group's term ``(scale * s) * (dot_h + dot_l / 254)``
    (float32; the dots with the codes' offset already taken out), every rounding spelled out
    (``tl.fma``, the accumulation included), so that both kernels compute the same bits from the
    same integer dots whatever the compiler would contract."""
    return tl.fma(scale * sx, tl.fma(dl.to(tl.float32), 1.0 / 254.0, dh.to(tl.float32)), acc)


@triton.jit
def _words16(ptr, NW: tl.constexpr):
    """``4 * NW`` bytes from ``ptr`` (``[R]`` uint8 pointers, 2-byte aligned: Q6_K's blocks of 210
    bytes) as ``NW`` little-endian 32-bit words per row, ``[R, NW]`` int32, read as 16-bit halves."""
    h = tl.load(ptr.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, 2 * NW)[None, :]).to(tl.int32) & 65535
    lo, hi = tl.split(tl.reshape(h, (h.shape[0], NW, 2)))
    return lo | (hi << 16)


@triton.jit
def _q6k_run(qa, qb, qh, r: tl.constexpr):
    """Run ``r`` (0..3) of a Q6_K half as code words: byte ``i`` of word ``t`` is element ``32 r +
    4 t + i``'s 6-bit code (0..63), from the words of ``ql[0:32]`` (``qa``), ``ql[32:64]`` (``qb``)
    and ``qh[0:32]`` (``qh``) of the half (:func:`q6k_codes`)."""
    if r == 0:
        return (qa & 0x0F0F0F0F) | ((qh & 0x03030303) << 4)
    elif r == 1:
        return (qb & 0x0F0F0F0F) | (((qh >> 2) & 0x03030303) << 4)
    elif r == 2:
        return ((qa >> 4) & 0x0F0F0F0F) | (((qh >> 4) & 0x03030303) << 4)
    else:
        return ((qb >> 4) & 0x0F0F0F0F) | (((qh >> 6) & 0x03030303) << 4)


@triton.jit
def _words(ptr, NW: tl.constexpr, STRIDE: tl.constexpr):
    """``4 * NW`` bytes from ``ptr`` (``[R]`` uint8 pointers into blocks of ``STRIDE`` bytes) as
    ``NW`` little-endian 32-bit words per row, ``[R, NW]`` int32: whole-word loads where the
    blocks are 4-byte aligned (a padded stride: ``kernels.quant.weight``, "Padded blocks"), else
    :func:`_words16`. ``ptr``'s offset inside its block must be a multiple of 4."""
    if STRIDE % 4 == 0:
        return tl.load(ptr.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, NW)[None, :])
    else:
        return _words16(ptr, NW)


@triton.jit
def _less32(q):
    """Code words (four 6-bit codes 0..63, one per byte) less 32 per byte, as signed bytes -32..31:
    flipping bit 5 gives ``code - 32`` as a 6-bit two's complement, whose sign bit is copied into
    bits 6 and 7 (no borrow crosses a byte)."""
    t = q ^ 0x20202020
    s = t & 0x20202020
    return t | (s << 1) | (s << 2)


@triton.jit
def _q6k_half(blk, nh: tl.constexpr, STRIDE: tl.constexpr):
    """The code words of half ``nh`` of the Q6_K super-blocks at ``blk`` (blocks of ``STRIDE``
    bytes): ``(ql[0:32], ql[32:64], qh[0:32])`` of the half, each ``[R, 8]`` int32
    (:func:`_q6k_run` assembles them)."""
    return (_words(blk + 64 * nh, 8, STRIDE), _words(blk + 64 * nh + 32, 8, STRIDE),
            _words(blk + 128 + 32 * nh, 8, STRIDE))


@triton.jit
def _q6k_dp4a_kernel(h_ptr, l_ptr, s_ptr, hs_ptr, ls_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, K, swn,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, FUSED: tl.constexpr = False,
                     STRIDE: tl.constexpr = 210):
    """As :func:`_q4k_dp4a_kernel` for a Q6_K weight (uint8 ``[N, K / 256 * STRIDE]``: super-blocks
    of 210 bytes, or padded: ``kernels.quant.weight``): per half
    super-block the 96 code bytes as three ``[BLOCK_N, 8]`` tiles of words (:func:`_words`), four
    runs of 32 codes (:func:`_q6k_run`), each two 16-element groups; per group ``dot - 32 * sum``
    of each plane (``hs_ptr``, ``ls_ptr``: :class:`Planes`' int32 half-group sums) and
    :func:`_acc6`."""
    rn, row, b0, nb = _program(w_ptr, N, K, swn, BLOCK_N, SPLIT_K)
    i8 = tl.arange(0, 8)
    hw = h_ptr.to(tl.pointer_type(tl.int32))
    lw = l_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * STRIDE
        d = _f16(blk + 208)
        for nh in tl.static_range(2):
            qa, qb, qh = _q6k_half(blk, nh, STRIDE)
            for r in tl.static_range(4):
                q = _q6k_run(qa, qb, qh, r)
                xw = b * 64 + 32 * nh + 8 * r + i8
                xh = tl.broadcast_to(tl.load(hw + xw)[None, :], (BLOCK_N, 8))
                xl = tl.broadcast_to(tl.load(lw + xw)[None, :], (BLOCK_N, 8))
                dh0, dh1 = tl.split(tl.sum(tl.reshape(_dp4a(q, xh, EMULATE), (BLOCK_N, 2, 4)), axis=2))
                dl0, dl1 = tl.split(tl.sum(tl.reshape(_dp4a(q, xl, EMULATE), (BLOCK_N, 2, 4)), axis=2))
                g = 8 * nh + 2 * r
                sx = tl.load(s_ptr + b * 8 + g // 2)
                sc0 = tl.load(blk + 192 + g).to(tl.int8, bitcast=True).to(tl.float32)
                sc1 = tl.load(blk + 193 + g).to(tl.int8, bitcast=True).to(tl.float32)
                acc = _acc6(acc, dh0 - 32 * tl.load(hs_ptr + b * 16 + g), dl0 - 32 * tl.load(ls_ptr + b * 16 + g), d * sc0, sx)
                acc = _acc6(acc, dh1 - 32 * tl.load(hs_ptr + b * 16 + g + 1), dl1 - 32 * tl.load(ls_ptr + b * 16 + g + 1),
                            d * sc1, sx)
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rn, rn < N, tl.program_id(0), N, SPLIT_K, FUSED)


@triton.jit
def _q6k_mma_kernel(h_ptr, l_ptr, s_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, swn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, FUSED: tl.constexpr = False,
                    STRIDE: tl.constexpr = 210):
    """As :func:`_q4k_mma_kernel` for a Q6_K weight: each run of 32 codes, less their offset of 32
    (signed int8 -32..31), as int8 tensor-core dots, one per 16-element group (``x``'s rows of the
    other group zeroed): exactly :func:`_q6k_dp4a_kernel`'s ``dot - 32 * sum`` per group and plane
    (no half-group sums needed), then its group terms in the same order."""
    rn, row, b0, nb = _program(w_ptr, N, K, swn, BLOCK_N, SPLIT_K)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    i32 = tl.arange(0, 32)
    first = (i32 < 16)[:, None]
    mrow = rm < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * STRIDE
        d = _f16(blk + 208)
        for nh in tl.static_range(2):
            qa, qb, qh = _q6k_half(blk, nh, STRIDE)
            for r in tl.static_range(4):
                codes = _bytes_of(_less32(_q6k_run(qa, qb, qh, r)))   # int8 -32..31: the offset inside the dots
                xo = rm[:, None].to(tl.int64) * K + (b * 256 + 128 * nh + 32 * r + i32)[None, :]
                xh = tl.trans(tl.load(h_ptr + xo, mask=mrow[:, None], other=0))   # [32, BLOCK_M] int8
                xl = tl.trans(tl.load(l_ptr + xo, mask=mrow[:, None], other=0))
                # each group's dot: the run's 32 codes against x with the other group's 16 rows zeroed
                # (the small operand masked; the same exact integer sums as masking the codes)
                xh0 = tl.where(first, xh, 0).to(tl.int8)
                xh1 = tl.where(first, 0, xh).to(tl.int8)
                xl0 = tl.where(first, xl, 0).to(tl.int8)
                xl1 = tl.where(first, 0, xl).to(tl.int8)
                g = 8 * nh + 2 * r
                sx = tl.load(s_ptr + rm * (K // 32) + b * 8 + g // 2, mask=mrow, other=1.0)[None, :]
                sc0 = tl.load(blk + 192 + g).to(tl.int8, bitcast=True).to(tl.float32)
                sc1 = tl.load(blk + 193 + g).to(tl.int8, bitcast=True).to(tl.float32)
                acc = _acc6(acc, tl.dot(codes, xh0, out_dtype=tl.int32), tl.dot(codes, xl0, out_dtype=tl.int32),
                            (d * sc0)[:, None], sx)
                acc = _acc6(acc, tl.dot(codes, xh1, out_dtype=tl.int32), tl.dot(codes, xl1, out_dtype=tl.int32),
                            (d * sc1)[:, None], sx)
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rm[None, :].to(tl.int64) * N + rn[:, None], (rn[:, None] < N) & mrow[None, :],
                 tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), M * N, SPLIT_K, FUSED)


@triton.jit
def _dp4a_ss(a, b, EMULATE: tl.constexpr):
    """As :func:`_dp4a` with signed bytes in ``a`` too (Q8_0's codes): PTX ``dp4a.s32.s32``."""
    if EMULATE:
        acc = tl.zeros(a.shape, tl.int32)
        for t in tl.static_range(4):
            acc += ((a << (24 - 8 * t)) >> 24) * ((b << (24 - 8 * t)) >> 24)
        return acc
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros(a.shape, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _legacy_block(blk, QT: tl.constexpr):
    """``(d, m, lo, hi)`` of the legacy blocks at ``blk`` (``[R]`` uint8 pointers, 2-byte aligned):
    ``d`` (and Q4_1's ``m``, else 0) as float32 ``[R]``; the code words ``[R, 4]`` of elements 0-15
    (``lo``) and 16-31 (``hi``), four codes per word (Q4_0 / Q4_1: the nibbles, 0..15; Q8_0: the
    signed bytes)."""
    d = _f16(blk)
    if QT == 2:      # Q8_0: d, 32 int8
        w = _words16(blk + 2, 8)
        lo, hi = tl.split(tl.permute(tl.reshape(w, (w.shape[0], 2, 4)), (0, 2, 1)))
        return d, 0.0, lo, hi
    else:            # Q4_0: d, 16 code bytes; Q4_1: d, m, 16 code bytes
        if QT == 1:
            m = _f16(blk + 2)
            w = _words16(blk + 4, 4)
        else:
            m = 0.0
            w = _words16(blk + 2, 4)
        return d, m, w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F


@triton.jit
def _legacy_acc(acc, dh, dl, d, m, sx, xsum, hs, ls, QT: tl.constexpr):
    """``acc`` plus a legacy block's term (float32) from its integer dots: Q4_0 ``(d * s) * ((dot_h -
    8 sum h) + (dot_l - 8 sum l) / 254)``, Q4_1 ``(d * s) * (dot_h + dot_l / 254) + m * sum x``, Q8_0
    ``(d * s) * (dot_h + dot_l / 254)``, every rounding spelled out (:func:`_acc6`, :func:`_epilogue`)."""
    if QT == 0:
        return _acc6(acc, dh - 8 * hs, dl - 8 * ls, d, sx)
    elif QT == 1:
        return acc + _epilogue(dh, dl, d, sx, m, xsum)
    else:
        return _acc6(acc, dh, dl, d, sx)


@triton.jit
def _legacy_dp4a_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, hs_ptr, ls_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, K, swn,
                        QT: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                        EMULATE: tl.constexpr, FUSED: tl.constexpr = False):
    """One row of ``x`` (:class:`Planes`) times a legacy weight (``QT``: 0 Q4_0, 1 Q4_1, 2 Q8_0;
    ``BS`` bytes per block of 32): per block the code words of elements 0-15 and 16-31
    (:func:`_legacy_block`) against the planes' words, ``dp4a`` (Q8_0: signed), then
    :func:`_legacy_acc`. ``y_ptr``, ``part_ptr``, ``cnt_ptr``: as
    :func:`_q4k_dp4a_kernel`'s."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    nb = K // 32 // SPLIT_K
    b0 = tl.program_id(1) * nb
    i4 = tl.arange(0, 4)
    hw = h_ptr.to(tl.pointer_type(tl.int32))
    lw = l_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        d, m, lo, hi = _legacy_block(row + b * BS, QT)
        dh = tl.zeros([BLOCK_N], tl.int32)
        dl = tl.zeros([BLOCK_N], tl.int32)
        for half in tl.static_range(2):
            q = lo if half == 0 else hi
            xw = b * 8 + 4 * half + i4
            xh = tl.broadcast_to(tl.load(hw + xw)[None, :], (BLOCK_N, 4))
            xl = tl.broadcast_to(tl.load(lw + xw)[None, :], (BLOCK_N, 4))
            if QT == 2:
                dh += tl.sum(_dp4a_ss(q, xh, EMULATE), axis=1)
                dl += tl.sum(_dp4a_ss(q, xl, EMULATE), axis=1)
            else:
                dh += tl.sum(_dp4a(q, xh, EMULATE), axis=1)
                dl += tl.sum(_dp4a(q, xl, EMULATE), axis=1)
        hs = tl.load(hs_ptr + 2 * b) + tl.load(hs_ptr + 2 * b + 1)
        ls = tl.load(ls_ptr + 2 * b) + tl.load(ls_ptr + 2 * b + 1)
        acc = _legacy_acc(acc, dh, dl, d, m, tl.load(s_ptr + b), tl.load(xs_ptr + b), hs, ls, QT)
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rn, rn < N, tl.program_id(0), N, SPLIT_K, FUSED)


@triton.jit
def _legacy_mma_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, hs_ptr, ls_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, swn,
                       QT: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT_K: tl.constexpr, FUSED: tl.constexpr = False):
    """As :func:`_legacy_dp4a_kernel` for ``M`` rows: each block's 32 codes as int8 tensor-core dots
    with both planes (exact), then :func:`_legacy_acc` in the same order."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    nb = K // 32 // SPLIT_K
    b0 = tl.program_id(1) * nb
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    i32 = tl.arange(0, 32)
    mrow = rm < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for b in range(b0, b0 + nb):
        d, m, lo, hi = _legacy_block(row + b * BS, QT)
        codes = _bytes_of(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 8)))   # elements 0-15, then 16-31
        xo = rm[:, None].to(tl.int64) * K + (b * 32 + i32)[None, :]
        xh = tl.trans(tl.load(h_ptr + xo, mask=mrow[:, None], other=0))      # [32, BLOCK_M] int8
        xl = tl.trans(tl.load(l_ptr + xo, mask=mrow[:, None], other=0))
        dh = tl.dot(codes, xh, out_dtype=tl.int32)
        dl = tl.dot(codes, xl, out_dtype=tl.int32)
        q = rm * (K // 16) + 2 * b
        hs = (tl.load(hs_ptr + q, mask=mrow, other=0) + tl.load(hs_ptr + q + 1, mask=mrow, other=0))[None, :]
        ls = (tl.load(ls_ptr + q, mask=mrow, other=0) + tl.load(ls_ptr + q + 1, mask=mrow, other=0))[None, :]
        sx = tl.load(s_ptr + rm * (K // 32) + b, mask=mrow, other=1.0)[None, :]
        xsum = tl.load(xs_ptr + rm * (K // 32) + b, mask=mrow, other=0.0)[None, :]
        acc = _legacy_acc(acc, dh, dl, d[:, None], m if QT != 1 else m[:, None], sx, xsum, hs, ls, QT)
    _store_split(acc, y_ptr, part_ptr, cnt_ptr, rm[None, :].to(tl.int64) * N + rn[:, None], (rn[:, None] < N) & mrow[None, :],
                 tl.program_id(2) * tl.num_programs(0) + tl.program_id(0), M * N, SPLIT_K, FUSED)


def linear(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor, split_k: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, planes: Planes | None = None,
           mma: bool | None = None) -> torch.Tensor:
    """``y = x2 @ dequantize(weight)^T`` for a weight ``[N, K]`` of :data:`TYPES` and ``x2`` ``[M,
    K]`` (``M`` >= 1, unit stride along ``K``, on the weight's device), written into ``y`` ``[M, N]``
    (contiguous; its dtype; float32 accumulation, rounded once): one row on the ``dp4a`` kernel,
    more on the int8 tensor-core kernel (:data:`MMA_ROWS` rows per program), ``K`` split by
    :func:`split_k_for` (the several-row launch per type: :data:`MMA_LAUNCH`; the launch
    arguments override the defaults: benchmarks and tests;
    ``planes``: :func:`split_x` of ``x2`` when already made; ``mma``: the tensor-core kernel even
    for one row, or never). Returns ``y``. With a split and :data:`FUSED_SUM`, the partial sums
    are added inside the kernel on tile counters shared by every product on the device: calls on
    one device must not run at the same time on two CUDA streams (use one compute stream, or
    ``DFLASH_QUANT_FUSED_SUM=0``).

    Raises:
        ValueError: another type; ``K`` not a multiple of the type's block times ``split_k``;
            ``x2`` not of unit stride along ``K``; ``y`` not a contiguous ``[M, N]``; ``mma=False``
            with more than one row; a padded Q6_K weight whose bytes do not start 4-byte aligned.
    """
    n, k = weight.shape
    m = x2.shape[0]
    name = weight.qtype.name
    blk = block_elems(name) if name in TYPES else 256
    split = split_k or split_k_for(n, k, blk)
    q6 = name == "Q6_K"
    legacy = name in LEGACY
    if name not in TYPES or k % (blk * split):
        raise ValueError(f"a weight of {', '.join(TYPES)} with K a multiple of {blk * split}, got {name} "
                         f"{tuple(weight.shape)}")
    if x2.dim() != 2 or x2.stride(-1) != 1 or tuple(y.shape) != (m, n) or not y.is_contiguous():
        raise ValueError(f"x2 [M, K] of unit stride along K and a contiguous y [M, N], got x2 {tuple(x2.shape)} "
                         f"strides {x2.stride()} and y {tuple(y.shape)}")
    p = planes if planes is not None else split_x(x2)
    data = weight.data
    stride = weight.block_stride   # bytes per stored block (a padded Q6_K's: kernels.quant.weight)
    if q6 and stride != 210 and data.data_ptr() % 4:
        raise ValueError("a padded Q6_K weight's bytes must start on a 4-byte boundary")
    emulate = x2.device.type != "cuda"
    one_row = (m == 1) if mma is None else not mma
    if one_row and m != 1:
        raise ValueError("the dp4a kernel takes one row")
    bn_mma, warps_mma = MMA_LAUNCH.get(name, (MMA_BLOCK_N, 2))
    bn = block_n or (DP4A_BLOCK_N if one_row else bn_mma)
    tiles = triton.cdiv(n, bn) * (1 if one_row else triton.cdiv(m, MMA_ROWS))
    part = torch.empty(split, m, n, device=y.device, dtype=torch.float32) if split > 1 else y
    cnt = tile_counters(y.device, tiles) if split > 1 and FUSED_SUM else None
    fused = cnt is not None            # the split's sum inside the kernel (partials._store_split)
    cnt = y if cnt is None else cnt
    xs = (p.h, p.l, p.s)
    if one_row:
        grid = (triton.cdiv(n, bn), split)
        if legacy:
            _legacy_dp4a_kernel[grid](*xs, p.xsum, p.hsum, p.lsum, data, y, part, cnt, n, k, data.stride(0),
                                      QT=_LEGACY_CODE[name], BS=stride, BLOCK_N=bn, SPLIT_K=split,
                                      EMULATE=emulate, FUSED=fused, num_warps=num_warps or 1)
        elif q6:
            _q6k_dp4a_kernel[grid](*xs, p.hsum, p.lsum, data, y, part, cnt, n, k, data.stride(0), BLOCK_N=bn,
                                   SPLIT_K=split, EMULATE=emulate, FUSED=fused, STRIDE=stride,
                                   num_warps=num_warps or 1)
        else:
            _q4k_dp4a_kernel[grid](*xs, p.xsum, data, y, part, cnt, n, k, data.stride(0), BLOCK_N=bn,
                                   SPLIT_K=split, EMULATE=emulate, Q5=name == "Q5_K", FUSED=fused, num_warps=num_warps or 1)
    else:
        grid = (triton.cdiv(n, bn), split, triton.cdiv(m, MMA_ROWS))
        stages = {} if MMA_STAGES is None else {"num_stages": MMA_STAGES}
        if legacy:
            _legacy_mma_kernel[grid](*xs, p.xsum, p.hsum, p.lsum, data, y, part, cnt, m, n, k, data.stride(0),
                                     QT=_LEGACY_CODE[name], BS=stride, BLOCK_M=MMA_ROWS, BLOCK_N=bn,
                                     SPLIT_K=split, FUSED=fused, num_warps=num_warps or warps_mma, **stages)
        elif q6:
            _q6k_mma_kernel[grid](*xs, data, y, part, cnt, m, n, k, data.stride(0), BLOCK_M=MMA_ROWS,
                                  BLOCK_N=bn, SPLIT_K=split, FUSED=fused, STRIDE=stride,
                                  num_warps=num_warps or warps_mma, **stages)
        else:
            _q4k_mma_kernel[grid](*xs, p.xsum, data, y, part, cnt, m, n, k, data.stride(0), BLOCK_M=MMA_ROWS,
                                  BLOCK_N=bn, SPLIT_K=split, Q5=name == "Q5_K", FUSED=fused, num_warps=num_warps or warps_mma, **stages)
    if split > 1 and not fused:
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](part, y, m * n, SPLIT_K=split, BLOCK=1024, num_warps=4)
    return y


__all__ = ["DP4A_BLOCK_N", "L_SCALE", "LEGACY", "MMA_BLOCK_N", "MMA_ROWS", "Planes", "TYPES", "block_elems", "legacy_codes",
           "linear", "mma_launches", "q6k_codes", "quantize_x", "reference", "split_k_for", "split_x"]
