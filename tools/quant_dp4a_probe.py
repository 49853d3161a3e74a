"""Probe (issue 19): a one-row Q4_K product in exact integer arithmetic, ``dp4a`` on the CUDA cores.

    python tools/quant_dp4a_probe.py [--out FILE.json]      # on the GPU machine, ~1-2 min
    python tools/quant_dp4a_probe.py --smoke                # CPU self-test (TRITON_INTERPRET=1)

Why: the engine's skinny kernel (:mod:`kernels.quant.triton`) and a float32 GEMV on the CUDA cores
(``tools/quant_gemv_probe.py``, ``benchmarks/gpu/quant/run7``) both take 2.7-3.4x the time of
copying a Q4_K weight's bytes at one row: each code costs several instructions (bits out of a
word, an integer-to-float conversion, a multiply-add). llama.cpp's ``mmvq`` spends about one per
four codes: it rounds ``x`` to 8-bit integers per group of 32 (``q8_1``) and multiplies four
codes at a time with ``dp4a`` (a dot of four byte pairs into an int32). Its rounding of ``x``
costs about 0.3% relative error, three times issue 19's 1e-3.

What this probe does instead (:func:`quantize_x`): ``x`` split into two 8-bit planes per group of
32, ``x = s * (h + l / 254)`` with ``s = max|x| / 127``, ``h = round(x / s)`` and ``l =
round((x / s - h) * 254)``, which leaves ``|x - s (h + l / 254)| <= s / 508``: about 2e-5 of
the group's largest value, far inside 1e-3. Per sub-block of 32 codes ``q`` (0..15) the two
integer dots ``sum q h`` and ``sum q l`` are exact (``dp4a``, int32), and the group's term is
gguf-py's factoring of the dequantized dot, ``(d * sc) * s * (sum q h + sum q l / 254) - (dmin *
m) * sum x`` (``sum x`` of the unrounded ``x``, float32). Because the integer part is exact, a
row's result depends only on the order of the float32 epilogue, which is fixed per row: an
``M``-row version (int8 tensor-core dots give the same integer sums) would give every row the
bits of a one-row call, the engine's lossless rule.

The kernel (:func:`_q4k_dp4a_kernel`): per program ``BLOCK_N`` weight rows over ``K / SPLIT_K``;
per super-block the 128 code bytes read as four ``[BLOCK_N, 8]`` tiles of 32-bit words, each word
giving four low-nibble codes (``w & 0x0F0F0F0F``: sub-block ``2c``) and four high-nibble codes
(``(w >> 4) & 0x0F0F0F0F``: sub-block ``2c + 1``) that meet one 32-bit word of each ``x`` plane.
``dp4a`` is PTX (``tl.inline_asm_elementwise``); the Triton interpreter cannot run PTX, so
``--smoke`` runs the same kernel with ``dp4a`` spelled out in integer operations
(``EMULATE=True``). Nothing in the engine calls it: it is timed beside the engine's kernel
(:func:`kernels.quant.triton.linear`) and the float GEMV of ``tools/quant_gemv_probe.py`` on the
same weight copies (``tools/sweep_quant.Timer``), ``x``'s split timed apart (torch operations
here; one small kernel per activation in an engine), and checked against
``kernels.quant.reference.linear`` (float32) and :func:`reference_dp4a` (the same arithmetic in
torch, the oracle of the kernel's integer sums).
"""

from __future__ import annotations

import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.quant.triton import _f16w, _k_scale_min, _split_sum_kernel  # noqa: E402

#: bytes of a Q4_K super-block (256 elements): d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of codes
Q4K_BS = 144
#: the second plane's scale: x = s * (h + l / L_SCALE)
L_SCALE = 254.0


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (any float dtype, ``K`` a multiple of 32) as two 8-bit planes per group of 32:
    returns ``(h, l, s, xsum)`` with ``h``, ``l`` int32 ``[M, K / 4]`` (four int8 values per word,
    element ``4 i + b`` in byte ``b``), ``s`` float32 ``[M, K / 32]`` (``max |x| / 127`` of the group,
    1 for an all-zero group) and ``xsum`` float32 ``[M, K / 32]`` (the group's sum of ``x``), so that
    ``x ~= s * (h + l / 254)`` within ``s / 508`` per element (module docstring)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    amax = g.abs().amax(dim=2)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    u = g / s[..., None]
    h = torch.round(u).clamp(-127, 127)
    lo = torch.round((u - h) * L_SCALE).clamp(-127, 127)
    pack = lambda p: p.to(torch.int8).reshape(m, k).contiguous().view(torch.int32)  # noqa: E731
    return pack(h), pack(lo), s.contiguous(), g.sum(dim=2).contiguous()


def reference_dp4a(x: torch.Tensor, w) -> torch.Tensor:
    """The probe's arithmetic in torch (its oracle): ``x`` ``[M, K]`` split by :func:`quantize_x`, a
    Q4_K weight ``[N, K]``; per sub-block the exact integer dots of the codes with both planes, then
    ``(d * sc) * s * (dot_h + dot_l / 254) - (dmin * m) * sum x`` summed over the sub-blocks.
    Returns float32 ``[M, N]``. Codes and scales as gguf-py lays them out (``gguf.quants``)."""
    hw, lw, s, xsum = quantize_x(x)
    m, k = x.shape
    n = w.shape[0]
    raw = w.data.reshape(n, k // 256, Q4K_BS).to(torch.int64)
    d = raw[:, :, 0:2].to(torch.uint8).contiguous().view(torch.float16).float()[..., 0]
    dmin = raw[:, :, 2:4].to(torch.uint8).contiguous().view(torch.float16).float()[..., 0]
    sc6 = raw[:, :, 4:16]
    sc = torch.empty(n, k // 256, 8, dtype=torch.int64)
    mn = torch.empty_like(sc)
    for j in range(8):   # ggml's get_scale_min_k4
        if j < 4:
            sc[..., j], mn[..., j] = sc6[..., j] & 63, sc6[..., j + 4] & 63
        else:
            sc[..., j] = (sc6[..., j + 4] & 15) | ((sc6[..., j - 4] >> 6) << 4)
            mn[..., j] = (sc6[..., j + 4] >> 4) | ((sc6[..., j] >> 6) << 4)
    qs = raw[:, :, 16:].reshape(n, k // 256, 4, 32)
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, k // 256, 8, 32)   # sub-block 2c: low nibbles
    h = hw.view(torch.int8).reshape(m, k // 256, 8, 32).to(torch.int64)
    lo = lw.view(torch.int8).reshape(m, k // 256, 8, 32).to(torch.int64)
    dot_h = torch.einsum("nbgi,mbgi->mnbg", codes, h).double()
    dot_l = torch.einsum("nbgi,mbgi->mnbg", codes, lo).double()
    sx, xs = s.reshape(m, 1, k // 256, 8).double(), xsum.reshape(m, 1, k // 256, 8).double()
    term = (d[..., None] * sc).double() * sx * (dot_h + dot_l / L_SCALE) - (dmin[..., None] * mn).double() * xs
    return term.sum(dim=(2, 3)).float()


@triton.jit
def _dp4a(a, b, EMULATE: tl.constexpr):
    """Per element, the dot of the four unsigned bytes of ``a`` with the four signed bytes of ``b``
    (int32): PTX ``dp4a.u32.s32``, or the same in integer operations (``EMULATE``: the interpreter)."""
    if EMULATE:
        acc = tl.zeros(a.shape, tl.int32)
        for t in tl.static_range(4):
            ub = (a >> (8 * t)) & 255
            sb = ((b << (24 - 8 * t)) >> 24)   # arithmetic shift: the signed byte
            acc += ub * sb
        return acc
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros(a.shape, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _epilogue(dh, dl, scale, sx, bias, xsum):
    """A sub-block's term ``(scale * s) * (dot_h + dot_l / 254) + bias * sum x`` (float32), its
    roundings spelled out (``tl.fma``), so that every kernel shape computes the same bits from the
    same integer dots (no contraction left to the compiler)."""
    return tl.fma(scale * sx, tl.fma(dl.to(tl.float32), 1.0 / 254.0, dh.to(tl.float32)), bias * xsum)


@triton.jit
def _scale_min_words(w0, w1, w2, g: tl.constexpr, d, m):
    """As :func:`kernels.quant.triton._k_scale_min` for group ``g``, from the 12 scale bytes read
    once per super-block as three 32-bit words ``w0``, ``w1``, ``w2`` (bytes 4-7, 8-11, 12-15 of the
    block; byte ``i`` of the 12 is byte ``i % 4`` of word ``i // 4``): ggml's ``get_scale_min_k4``."""
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
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr,
                     SCALE_WORDS: tl.constexpr = True):
    """``y[n] = sum_k dequant(w)[n, k] * x[k]`` for one row of ``x`` given as :func:`quantize_x`'s
    planes (``h_ptr``, ``l_ptr``: int32 ``[K / 4]``; ``s_ptr``, ``xs_ptr``: float32 ``[K / 32]``)
    and a Q4_K weight (uint8 ``[N, K / 256 * 144]``); with ``SPLIT_K`` > 1, ``y_ptr`` is the float32
    scratch ``[SPLIT_K, N]`` of partial sums."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    i8 = tl.arange(0, 8)
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * 144          # (Q4K_BS: a global is no constant inside a jit function)
        d = _f16w(blk)
        dm = _f16w(blk + 2)
        if SCALE_WORDS:
            sw = (blk + 4).to(tl.pointer_type(tl.int32))
            w0, w1, w2 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for c in tl.static_range(4):
            words = tl.load((blk + 16 + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])   # [BLOCK_N, 8]
            for hi in tl.static_range(2):
                g = 2 * c + hi                 # sub-block: word i holds its elements 4 i .. 4 i + 3
                q = (words >> (4 * hi)) & 0x0F0F0F0F
                xw = b * 64 + g * 8 + i8       # the x words of the sub-block
                xh = tl.load(h_ptr + xw)
                xl = tl.load(l_ptr + xw)
                dh = tl.sum(_dp4a(q, tl.broadcast_to(xh[None, :], (BLOCK_N, 8)), EMULATE), axis=1)
                dl = tl.sum(_dp4a(q, tl.broadcast_to(xl[None, :], (BLOCK_N, 8)), EMULATE), axis=1)
                sx = tl.load(s_ptr + b * 8 + g)
                xsum = tl.load(xs_ptr + b * 8 + g)
                if SCALE_WORDS:
                    scale, bias = _scale_min_words(w0, w1, w2, g, d, dm)
                else:
                    scale, bias = _k_scale_min(blk, g, d, dm)
                acc += _epilogue(dh, dl, scale, sx, bias, xsum)
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * N
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def q4k_dp4a(x: torch.Tensor, w, block_n: int = 32, num_warps: int = 2, split_k: int = 1,
             out_dtype: torch.dtype | None = None, planes=None, scale_words: bool = True) -> torch.Tensor:
    """``x`` ``[1, K]`` times a Q4_K :class:`~kernels.quant.weight.QuantizedWeight` ``[N, K]`` ->
    ``[1, N]`` (``out_dtype``, default ``x``'s). ``planes``: :func:`quantize_x` of ``x`` when already
    made (the timing leaves the split out). ``scale_words``: the 12 scale bytes read as three words
    per super-block (:func:`_scale_min_words`), else byte by byte per group as the engine does.
    Raises ValueError for another type or shape."""
    n, k = w.shape
    if w.qtype.name != "Q4_K" or x.numel() != k or k % (256 * split_k):
        raise ValueError("a Q4_K weight, one row of K values, K / 256 a multiple of split_k")
    h, lo, s, xs = planes if planes is not None else quantize_x(x.reshape(1, k))
    y = torch.empty(1, n, device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    data, emulate = w.data, x.device.type != "cuda"
    if split_k > 1:
        part = torch.empty(split_k, n, device=x.device, dtype=torch.float32)
        _q4k_dp4a_kernel[grid](h, lo, s, xs, data, part, n, k, data.stride(0), BLOCK_N=block_n, SPLIT_K=split_k,
                               EMULATE=emulate, SCALE_WORDS=scale_words, num_warps=num_warps)
        _split_sum_kernel[(triton.cdiv(n, 1024),)](part, y, n, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    else:
        _q4k_dp4a_kernel[grid](h, lo, s, xs, data, y, n, k, data.stride(0), BLOCK_N=block_n, SPLIT_K=1,
                               EMULATE=emulate, SCALE_WORDS=scale_words, num_warps=num_warps)
    return y


@triton.jit
def _q4k_mma_kernel(h_ptr, l_ptr, s_ptr, xs_ptr, w_ptr, y_ptr, M, N, K, swn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """``M`` rows of ``x`` (:func:`quantize_x`'s planes, ``h_ptr`` and ``l_ptr`` read as int8
    ``[M, K]``) times a Q4_K weight: per sub-block the integer dots of 32 codes with both planes as
    int8 tensor-core dots (``tl.dot`` int8 x int8 -> int32, exact: the sums :func:`_q4k_dp4a_kernel`
    makes with ``dp4a``), then the same epilogue in the same order (:func:`_epilogue`), so each row
    has the bits of a one-row ``dp4a`` call with the same ``SPLIT_K``. ``y_ptr``: ``[M, N]``, or the
    float32 scratch ``[SPLIT_K, M, N]`` with ``SPLIT_K`` > 1."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    i8, i32 = tl.arange(0, 8), tl.arange(0, 32)
    mrow = rm < M
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    hp = h_ptr.to(tl.pointer_type(tl.int8))
    lp = l_ptr.to(tl.pointer_type(tl.int8))
    for b in range(b0, b0 + nb):
        blk = row + b * 144
        d = _f16w(blk)
        dm = _f16w(blk + 2)
        sw = (blk + 4).to(tl.pointer_type(tl.int32))
        w0, w1, w2 = tl.load(sw), tl.load(sw + 1), tl.load(sw + 2)
        for c in tl.static_range(4):
            words = tl.load((blk + 16 + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])   # [BLOCK_N, 8]
            for hi in tl.static_range(2):
                g = 2 * c + hi
                q = (words >> (4 * hi)) & 0x0F0F0F0F
                # the four codes of word i are elements 4 i .. 4 i + 3 of the sub-block (as _bytes_w lays them out)
                codes = tl.reshape(tl.join(tl.join(q & 255, (q >> 16) & 255), tl.join((q >> 8) & 255, q >> 24)),
                                   (BLOCK_N, 32)).to(tl.int8)
                xo = rm[:, None].to(tl.int64) * K + (b * 256 + g * 32 + i32)[None, :]
                xh = tl.load(hp + xo, mask=mrow[:, None], other=0)        # [BLOCK_M, 32] int8
                xl = tl.load(lp + xo, mask=mrow[:, None], other=0)
                dh = tl.dot(codes, tl.trans(xh), out_dtype=tl.int32)    # [BLOCK_N, BLOCK_M], exact
                dl = tl.dot(codes, tl.trans(xl), out_dtype=tl.int32)
                sx = tl.load(s_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=1.0)
                xsum = tl.load(xs_ptr + rm * (K // 32) + b * 8 + g, mask=mrow, other=0.0)
                scale, bias = _scale_min_words(w0, w1, w2, g, d, dm)
                acc += _epilogue(dh, dl, scale[:, None], sx[None, :], bias[:, None], xsum[None, :])
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * M * N
    out = y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rn[:, None] < N) & mrow[None, :])


def q4k_mma(x: torch.Tensor, w, block_n: int = 32, num_warps: int = 4, split_k: int = 1,
            out_dtype: torch.dtype | None = None, planes=None) -> torch.Tensor:
    """``x`` ``[M, K]`` (``M`` <= 64) times a Q4_K weight ``[N, K]`` -> ``[M, N]`` on the tensor cores
    (:func:`_q4k_mma_kernel`); with the ``split_k`` of a :func:`q4k_dp4a` call, each row equals that
    call's bits. Raises ValueError for another type or shape."""
    n, k = w.shape
    m = x.shape[0]
    if w.qtype.name != "Q4_K" or x.dim() != 2 or x.shape[1] != k or k % (256 * split_k) or not 1 <= m <= 64:
        raise ValueError("a Q4_K weight, 1 to 64 rows of K values, K / 256 a multiple of split_k")
    h, lo, s, xs = planes if planes is not None else quantize_x(x)
    bm = max(16, triton.next_power_of_2(m))
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    data = w.data
    if split_k > 1:
        part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
        _q4k_mma_kernel[grid](h, lo, s, xs, data, part, m, n, k, data.stride(0), BLOCK_M=bm, BLOCK_N=block_n,
                              SPLIT_K=split_k, num_warps=num_warps)
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](part, y, m * n, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    else:
        _q4k_mma_kernel[grid](h, lo, s, xs, data, y, m, n, k, data.stride(0), BLOCK_M=bm, BLOCK_N=block_n, SPLIT_K=1,
                              num_warps=num_warps)
    return y


#: (N, K): the 9B-shaped projections of tools/quant_config_ab.py's --quick Q4_K cases
CASES = [(4096, 4096), (12288, 4096), (4096, 12288)]


def configs(n: int, k: int) -> dict:
    """``(BLOCK_N, warps, split_k)`` tried: BLOCK_N 8-64, 1-4 warps, K split to about 512-2048 programs."""
    import sweep_quant as sq

    return sq.probe_launches(n, k, (8, 16, 32, 64), (1, 2, 4), (512, 1024, 2048))


def smoke() -> None:
    """CPU: the split's error bound, :func:`reference_dp4a` against gguf-py's dequantization, and
    the kernel (``dp4a`` emulated, interpreter) against :func:`reference_dp4a`."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import sweep_quant as sq

    from kernels.quant import reference as R

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, generator=g) * torch.logspace(-3, 1, 512)   # groups of very different size
    h, lo, s, _ = quantize_x(x)
    back = s.repeat_interleave(32, dim=1) * (h.view(torch.int8).float() + lo.view(torch.int8).float() / L_SCALE)
    bound = s.repeat_interleave(32, dim=1) / (2 * L_SCALE) * 1.001
    assert ((back - x).abs() <= bound).all(), float(((back - x).abs() / bound).max())
    w = sq.random_weight("Q4_K", 40, 512, torch.device("cpu"))
    ref = R.linear(x, w, torch.float32)
    err = sq.rel(reference_dp4a(x, w), ref)
    print(f"smoke reference_dp4a vs gguf-py dequantize + float32: rel err {err:.1e}")
    assert err < 1e-4, err
    for (bn, nw, split), words in zip(((16, 1, 1), (32, 2, 2), (16, 1, 2)), (True, True, False)):
        got = q4k_dp4a(x[:1], w, bn, nw, split, torch.float32, scale_words=words)
        e1, e2 = sq.rel(got, reference_dp4a(x[:1], w)), sq.rel(got, ref[:1])
        print(f"smoke kernel bn{bn} split{split} scale words {words}: rel err {e1:.1e} vs reference_dp4a, {e2:.1e} vs gguf-py")
        assert e1 < 1e-6 and e2 < 1e-4, (e1, e2)
    for split in (1, 2):
        rows = torch.randn(3, 512, generator=g)
        many = q4k_mma(rows, w, 16, 4, split, torch.float32)
        ones = torch.cat([q4k_dp4a(rows[i : i + 1], w, 16, 1, split, torch.float32) for i in range(3)])
        print(f"smoke mma 3 rows split{split}: rel err {sq.rel(many, reference_dp4a(rows, w)):.1e} vs reference_dp4a, "
              f"rows equal the dp4a kernel's one-row calls: {torch.equal(many, ones)}")
        assert torch.equal(many, ones)


def main() -> int:
    import sweep_quant as sq

    a = sq.probe_args(__doc__)
    if a.smoke:
        smoke()
        return 0

    from kernels.quant import reference as R
    from kernels.quant import triton as T
    from quant_gemv_probe import configs as gemv_configs
    from quant_gemv_probe import q4k_gemv

    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}: Q4_K, one row of x (bf16), us per call (weights from HBM)")
    print("| N x K | MiB | copy us | engine skinny us | float GEMV best us | dp4a, scale bytes best us | dp4a best us "
          "| best config | dp4a / engine | dp4a / copy | x split us | rel err vs gguf-py | rel err vs reference_dp4a |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, k in CASES:
        w0, ws, calls = sq.cold_weights("Q4_K", n, k, dev)
        copy = sq.copy_us(ws, timer, calls)
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        planes = quantize_x(x)
        engine = timer(lambda i: T.linear(x, ws[i % len(ws)]), calls)
        gemv = sq.time_launches(timer, calls, gemv_configs(n, k),
                                lambda i, bn, nw, split: q4k_gemv(x, ws[i % len(ws)], bn, nw, split), f"gemv {n}x{k}")
        got = sq.time_launches(timer, calls, configs(n, k),
                               lambda i, bn, nw, split: q4k_dp4a(x, ws[i % len(ws)], bn, nw, split, planes=planes),
                               f"dp4a {n}x{k}")
        bytewise = sq.time_launches(timer, calls, configs(n, k),
                                    lambda i, bn, nw, split: q4k_dp4a(x, ws[i % len(ws)], bn, nw, split, planes=planes,
                                                                      scale_words=False), f"dp4a-bytes {n}x{k}")
        split_us = timer(lambda i: quantize_x(x), calls)
        best = min(got, key=got.get)
        bn, nw, split = configs(n, k)[best]
        y = q4k_dp4a(x, w0, bn, nw, split, torch.float32)
        err = sq.rel(y, R.linear(x, w0, torch.float32))
        err_int = sq.rel(y, reference_dp4a(x.cpu(), _to_cpu(w0)).to(dev))
        gbest = min(gemv.values()) if gemv else float("nan")
        bbest = min(bytewise.values()) if bytewise else float("nan")
        print(f"| {n} x {k} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {engine:.1f} | {gbest:.1f} | {bbest:.1f} | {got[best]:.1f} | {best} | "
              f"{got[best] / engine:.2f}x | {got[best] / copy:.2f}x | {split_us:.1f} | {err:.1e} | {err_int:.1e} |", flush=True)
        rows.append(dict(n=n, k=k, mib=w0.nbytes / 2**20, copy_us=copy, engine_us=engine, gemv_us=gemv, dp4a_us=got,
                         dp4a_scale_bytes_us=bytewise,
                         split_us=split_us, rel_err=err, rel_err_reference_dp4a=err_int))
    print()
    print("Several rows on the tensor cores (int8 dots, the same integer sums and epilogue): us per call; rows compared "
          "bit for bit with one-row dp4a calls of the same split")
    print("| N x K | engine skinny M=16 us | mma M=1 us | mma M=4 us | mma M=16 us | best config at M=16 | M=16 / dp4a M=1 "
          "| rows bit-equal to dp4a | rel err M=16 vs gguf-py |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, k), r in zip(CASES, rows):
        w0, ws, calls = sq.cold_weights("Q4_K", n, k, dev)
        launches = sq.probe_launches(n, k, (16, 32, 64), (2, 4), (512, 1024))
        best_m = {}
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            planes = quantize_x(x)
            got = sq.time_launches(timer, calls, launches,
                                   lambda i, bn, nw, split: q4k_mma(x, ws[i % len(ws)], bn, nw, split, planes=planes),
                                   f"mma M={m} {n}x{k}")
            best_m[m] = (min(got, key=got.get), got)
        x16 = torch.randn(16, k, device=dev).to(torch.bfloat16)
        engine16 = timer(lambda i: T.linear(x16, ws[i % len(ws)]), calls)
        label = best_m[16][0]
        bn, nw, split = launches[label]
        many = q4k_mma(x16, w0, bn, nw, split, torch.float32)
        dbn, dnw, _ = configs(n, k)[min(r["dp4a_us"], key=r["dp4a_us"].get)]
        ones = torch.cat([q4k_dp4a(x16[i : i + 1], w0, dbn, dnw, split, torch.float32) for i in range(16)])
        equal = torch.equal(many, ones)
        err = sq.rel(many, R.linear(x16, w0, torch.float32))
        t = {m: best_m[m][1][best_m[m][0]] for m in best_m}
        print(f"| {n} x {k} | {engine16:.1f} | {t[1]:.1f} | {t[4]:.1f} | {t[16]:.1f} | {label} | "
              f"{t[16] / min(r['dp4a_us'].values()):.2f}x | {'yes' if equal else 'NO'} (split {split}) | {err:.1e} |", flush=True)
        r.update(mma_us={m: best_m[m][1] for m in best_m}, engine16_us=engine16, mma_rows_equal=equal, mma_rel_err=err)
    sq.write_rows(a.out, rows)
    return 0


def _to_cpu(w):
    """A CPU copy of a :class:`~kernels.quant.weight.QuantizedWeight`."""
    from kernels.quant import QuantizedWeight

    return QuantizedWeight(w.data.cpu(), w.qtype.name, tuple(w.shape))


if __name__ == "__main__":
    sys.exit(main())
