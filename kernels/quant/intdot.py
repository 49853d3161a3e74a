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
127``, ``h = round(x / s)``, ``l = round((x / s - h) * 254)``: ``|x - s (h + l / 254)| <= s /
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

import torch
import triton
import triton.language as tl

from kernels.quant.weight import QuantizedWeight

#: the second plane's scale: x = s * (h + l / L_SCALE)
L_SCALE = 254.0
#: rows per program of the several-row kernel (and per launch: more rows run in chunks of it)
MMA_ROWS = 64
#: output features per program: the one-row kernel (1 warp), the several-row kernel (2 warps)
DP4A_BLOCK_N, MMA_BLOCK_N = 16, 64


def split_k_for(n: int, k: int) -> int:
    """The ``K`` split of both kernels for an ``[N, K]`` Q4_K weight: the smallest power of two
    (at most 16, dividing ``K``'s super-blocks) giving the one-row launch at least 2048 programs of
    :data:`DP4A_BLOCK_N` features (``run9``'s best one-row launches: 4096 x 4096 split 8, 12288 x
    4096 split 4). Never depends on ``M``."""
    blocks = k // 256
    split = 1
    while triton.cdiv(n, DP4A_BLOCK_N) * split < 2048 and split < 16 and blocks % (split * 2) == 0:
        split *= 2
    return split


# ---------------------------------------------------------------------------------------------
# plain PyTorch: the split of x and the integer arithmetic (the oracles)

def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split of ``x`` ``[M, K]`` (any float dtype, ``K`` a multiple of 32), plain PyTorch (the
    reference of :func:`split_x`): ``(h, l, s, xsum)`` with ``h``, ``l`` int8 ``[M, K]``, ``s``
    float32 ``[M, K / 32]`` (``max |x| / 127`` of the group, 1 for an all-zero group) and ``xsum``
    float32 ``[M, K / 32]`` (the group's sum of ``x``), so that ``x ~= s * (h + l / 254)`` within
    ``s / 508`` per element (module docstring). Ties round half to even here, half up in
    :func:`split_x`: both represent the same value (``h + 1, l - 254`` is ``h, l``)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(dim=2)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    u = g / s[..., None]
    h = torch.round(u).clamp(-127, 127)
    lo = torch.round((u - h) * L_SCALE).clamp(-127, 127)
    return (h.to(torch.int8).reshape(m, k), lo.to(torch.int8).reshape(m, k), s.contiguous(),
            g.sum(dim=2).contiguous())


def reference(x: torch.Tensor, w: QuantizedWeight, planes=None) -> torch.Tensor:
    """The kernels' arithmetic in plain PyTorch (their oracle): ``x`` ``[M, K]`` split
    (:func:`quantize_x`, or ``planes``), a Q4_K weight ``[N, K]``; per sub-block the exact integer
    dots of the codes with both planes, then ``(d * sc) * s * (dot_h + dot_l / 254) - (dmin * m) *
    sum x`` summed over the sub-blocks (float64). Returns float32 ``[M, N]``. Codes and scales as
    gguf-py lays them out (``gguf.quants``: ``get_scale_min_k4``).

    Raises:
        ValueError: not a Q4_K weight, or ``K`` mismatch.
    """
    if w.qtype.name != "Q4_K" or x.shape[-1] != w.shape[1]:
        raise ValueError(f"a Q4_K weight [N, {x.shape[-1]}], got {w.qtype.name} {tuple(w.shape)}")
    h, lo, s, xsum = planes if planes is not None else quantize_x(x)
    m, k = x.shape
    n = w.shape[0]
    raw = w.data.cpu().reshape(n, k // 256, 144)
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
    qs = raw[:, :, 16:].to(torch.int64).reshape(n, k // 256, 4, 32)
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // 256, 8, 32)   # sub-block 2c: low nibbles
    hp = h.cpu().to(torch.int64).reshape(m, k // 256, 8, 32)
    lp = lo.cpu().to(torch.int64).reshape(m, k // 256, 8, 32)
    dot_h = torch.einsum("nbgi,mbgi->mnbg", codes, hp).double()
    dot_l = torch.einsum("nbgi,mbgi->mnbg", codes, lp).double()
    sx = s.cpu().reshape(m, 1, k // 256, 8).double()
    xs = xsum.cpu().reshape(m, 1, k // 256, 8).double()
    term = (d[..., None] * sc).double() * sx * (dot_h + dot_l / L_SCALE) - (dmin[..., None] * mn).double() * xs
    return term.sum(dim=(2, 3)).float()


# ---------------------------------------------------------------------------------------------
# Triton

@triton.jit
def _split_kernel(x_ptr, h_ptr, l_ptr, s_ptr, xs_ptr, K, sxm, GROUPS: tl.constexpr):
    """Row ``program_id(0)``, groups ``program_id(1) * GROUPS ...`` of 32 of ``x`` (any float
    dtype, row stride ``sxm``) into the planes (int8 ``[M, K]`` each, row-major) and the float32
    ``s`` and ``xsum`` ``[M, K / 32]`` (:func:`quantize_x`'s definition, ties rounded half up)."""
    m = tl.program_id(0)
    gi = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    ng = K // 32
    ok = gi < ng
    col = gi[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m.to(tl.int64) * sxm + col, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.where(amax > 0, amax / 127.0, 1.0)
    u = x / s[:, None]
    h = tl.minimum(tl.maximum(tl.floor(u + 0.5), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(tl.floor((u - h) * 254.0 + 0.5), -127.0), 127.0)
    out = m.to(tl.int64) * K + col
    tl.store(h_ptr + out, h.to(tl.int8), mask=ok[:, None])
    tl.store(l_ptr + out, lo.to(tl.int8), mask=ok[:, None])
    tl.store(s_ptr + m.to(tl.int64) * ng + gi, s, mask=ok)
    tl.store(xs_ptr + m.to(tl.int64) * ng + gi, tl.sum(x, axis=1), mask=ok)


def split_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_x` in one Triton launch (``x`` ``[M, K]`` on the device, ``K`` a multiple of
    32; any float dtype, unit stride along ``K``): ``(h, l, s, xsum)``, the planes int8 ``[M, K]``."""
    m, k = x.shape
    h = torch.empty(m, k, device=x.device, dtype=torch.int8)
    lo = torch.empty_like(h)
    s = torch.empty(m, k // 32, device=x.device, dtype=torch.float32)
    xs = torch.empty_like(s)
    if m and k:
        groups = 32
        _split_kernel[(m, triton.cdiv(k // 32, groups))](x, h, lo, s, xs, k, x.stride(0), GROUPS=groups, num_warps=4)
    return h, lo, s, xs


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
def _q4k_dp4a_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, w_ptr, y_ptr, N, K, swn,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr):
    """One row of ``x`` as its planes (``h_ptr``, ``l_ptr``: int8 ``[K]``, read as int32 words of
    four; ``s_ptr``, ``xs_ptr``: float32 ``[K / 32]``) times a Q4_K weight (uint8 ``[N, K / 256 *
    144]``): per program ``BLOCK_N`` weight rows over ``K / SPLIT_K``; per super-block the 128 code
    bytes as four ``[BLOCK_N, 8]`` tiles of 32-bit words, word ``i`` of tile ``c`` holding elements
    ``4 i .. 4 i + 3`` of sub-blocks ``2 c`` (low nibbles) and ``2 c + 1`` (high). ``y_ptr``: ``[N]``,
    or the float32 scratch ``[SPLIT_K, N]`` with ``SPLIT_K`` > 1."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    i8 = tl.arange(0, 8)
    hw = h_ptr.to(tl.pointer_type(tl.int32))
    lw = l_ptr.to(tl.pointer_type(tl.int32))
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * 144
        d = _f16(blk)
        dm = _f16(blk + 2)
        sw = (blk + 4).to(tl.pointer_type(tl.int32))
        w0, w1, w2 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for c in tl.static_range(4):
            words = tl.load((blk + 16 + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])   # [BLOCK_N, 8]
            for hi in tl.static_range(2):
                g = 2 * c + hi
                q = (words >> (4 * hi)) & 0x0F0F0F0F
                xw = b * 64 + g * 8 + i8       # the x words of the sub-block
                xh = tl.broadcast_to(tl.load(hw + xw)[None, :], (BLOCK_N, 8))
                xl = tl.broadcast_to(tl.load(lw + xw)[None, :], (BLOCK_N, 8))
                dh = tl.sum(_dp4a(q, xh, EMULATE), axis=1)
                dl = tl.sum(_dp4a(q, xl, EMULATE), axis=1)
                scale, bias = _scale_min(w0, w1, w2, g, d, dm)
                acc += _epilogue(dh, dl, scale, tl.load(s_ptr + b * 8 + g), bias, tl.load(xs_ptr + b * 8 + g))
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * N
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _q4k_mma_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, w_ptr, y_ptr, M, N, K, swn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """``M`` rows of ``x`` as their planes (int8 ``[M, K]`` each; ``s``, ``xsum`` float32 ``[M, K /
    32]``) times a Q4_K weight: per sub-block the integer dots of 32 codes with both planes as int8
    tensor-core dots (exact: the sums :func:`_q4k_dp4a_kernel` makes with ``dp4a``), then the same
    :func:`_epilogue` in the same order. ``y_ptr``: ``[M, N]``, or the float32 scratch ``[SPLIT_K,
    M, N]`` with ``SPLIT_K`` > 1."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    i8, i32 = tl.arange(0, 8), tl.arange(0, 32)
    mrow = rm < M
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * 144
        d = _f16(blk)
        dm = _f16(blk + 2)
        sw = (blk + 4).to(tl.pointer_type(tl.int32))
        w0, w1, w2 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for c in tl.static_range(4):
            words = tl.load((blk + 16 + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])   # [BLOCK_N, 8]
            for hi in tl.static_range(2):
                g = 2 * c + hi
                q = (words >> (4 * hi)) & 0x0F0F0F0F
                # the four codes of word i are elements 4 i .. 4 i + 3 of the sub-block
                codes = tl.reshape(tl.join(tl.join(q & 255, (q >> 16) & 255), tl.join((q >> 8) & 255, q >> 24)),
                                   (BLOCK_N, 32)).to(tl.int8)
                xo = rm[:, None].to(tl.int64) * K + (b * 256 + g * 32 + i32)[None, :]
                xh = tl.load(h_ptr + xo, mask=mrow[:, None], other=0)        # [BLOCK_M, 32] int8
                xl = tl.load(l_ptr + xo, mask=mrow[:, None], other=0)
                dh = tl.dot(codes, tl.trans(xh), out_dtype=tl.int32)    # [BLOCK_N, BLOCK_M], exact
                dl = tl.dot(codes, tl.trans(xl), out_dtype=tl.int32)
                sx = tl.load(s_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=1.0)
                xsum = tl.load(xs_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=0.0)
                scale, bias = _scale_min(w0, w1, w2, g, d, dm)
                acc += _epilogue(dh, dl, scale[:, None], sx[None, :], bias[:, None], xsum[None, :])
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * M * N
    out = y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rn[:, None] < N) & mrow[None, :])


def linear(x2: torch.Tensor, weight: QuantizedWeight, y: torch.Tensor, split_k: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, planes=None, mma: bool | None = None) -> torch.Tensor:
    """``y = x2 @ dequantize(weight)^T`` for a Q4_K weight ``[N, K]`` and ``x2`` ``[M, K]`` (``M`` >=
    1, unit stride along ``K``, on the weight's device), written into ``y`` ``[M, N]`` (its dtype;
    float32 accumulation, rounded once): one row on :func:`_q4k_dp4a_kernel`, more in chunks of
    :data:`MMA_ROWS` on :func:`_q4k_mma_kernel`, ``K`` split by :func:`split_k_for` (the launch
    arguments override the defaults: benchmarks and tests; ``planes``: :func:`split_x` of ``x2``
    when already made; ``mma``: the tensor-core kernel even for one row, or never). Returns ``y``.

    Raises:
        ValueError: not a Q4_K weight, or ``K`` not a multiple of ``256 * split_k``.
    """
    from kernels.quant.triton import _split_sum_kernel

    n, k = weight.shape
    m = x2.shape[0]
    split = split_k or split_k_for(n, k)
    if weight.qtype.name != "Q4_K" or k % (256 * split):
        raise ValueError(f"a Q4_K weight with K a multiple of {256 * split}, got {weight.qtype.name} {tuple(weight.shape)}")
    h, lo, s, xs = planes if planes is not None else split_x(x2)
    data = weight.data
    emulate = x2.device.type != "cuda"
    for at in range(0, m, MMA_ROWS):
        rows = min(MMA_ROWS, m - at)
        ya = y[at : at + rows]
        out = ya if split == 1 else torch.empty(split, rows, n, device=y.device, dtype=torch.float32)
        hs, ls, ss, xss = h[at : at + rows], lo[at : at + rows], s[at : at + rows], xs[at : at + rows]
        if (rows == 1) if mma is None else not mma:
            if rows != 1:
                raise ValueError("the dp4a kernel takes one row")
            bn = block_n or DP4A_BLOCK_N
            _q4k_dp4a_kernel[(triton.cdiv(n, bn), split)](hs, ls, ss, xss, data, out, n, k, data.stride(0), BLOCK_N=bn,
                                                          SPLIT_K=split, EMULATE=emulate, num_warps=num_warps or 1)
        else:
            bn = block_n or MMA_BLOCK_N
            _q4k_mma_kernel[(triton.cdiv(n, bn), split)](hs, ls, ss, xss, data, out, rows, n, k, data.stride(0),
                                                         BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=bn,
                                                         SPLIT_K=split, num_warps=num_warps or 2)
        if split > 1:
            _split_sum_kernel[(triton.cdiv(rows * n, 1024),)](out, ya, rows * n, SPLIT_K=split, BLOCK=1024, num_warps=4)
    return y


__all__ = ["DP4A_BLOCK_N", "L_SCALE", "MMA_BLOCK_N", "MMA_ROWS", "linear", "quantize_x", "reference", "split_k_for", "split_x"]
