"""Sampling on the device in Triton: :func:`filter_thresholds` and :func:`sample_tokens`, the same
contracts as ``kernels.sampling.reference`` and equal to it bit for bit (thresholds, noise words,
Gumbel values, chosen tokens).

Both are safe inside CUDA graphs: every per-row setting (inverse temperature, top-k, top-p,
seed, position, threshold) is read from tensors in the kernels; launch shapes depend only on
``logits.shape``; no host synchronisation.

* :func:`sample_tokens` is one fused pass over the logits: per element, scale, keep test,
  Philox-4x32-10 of ``(token, position, seed)`` in 32-bit integer ops (``tl.umulhi``), the
  Gumbel transform and a running (max, argmax). The vocabulary is split in chunks so that one
  row still fills many SMs: grid ``(rows, chunks)``, each program writes its chunk's best
  (order-preserving int32 key of the score, lowest token id), then ``_reduce_kernel`` takes the
  largest key and the lowest id among equals (torch.argmax's tie rule, across chunks too).
  Blocks with no kept token skip Philox. Greedy rows (``inv_temperature == 0``) only take the
  argmax of the raw logits.
* :func:`filter_thresholds` runs one program per row. Rows that keep everything (greedy, or
  top-k and top-p off) store ``-inf`` and end at once. Otherwise the thresholds are found exactly
  by bisection over the order-preserving integer encoding of float32 (as uint32): 32 passes
  counting ``x >= t`` for the k-th largest value, then one pass for the row max, one for the
  mass of the top-k set and up to 32 passes for the top-p mass (integer weights, exact sums;
  only the bits below the highest bit where the top-k threshold and the row max differ are
  searched). The result is always a data value, equal to the sort-based reference.

Floating point: kernels are launched with ``enable_fp_fusion=False`` so that no multiply-add is
contracted into an FMA (the reference rounds each operation); logarithms and exponentials are
the reference's fixed polynomials, not libdevice calls; no division is used.

NaN policy (as the reference): greedy rows follow torch.argmax (a NaN logit is the largest value,
the first NaN wins); for sampling rows and for the thresholds a NaN logit counts as ``-inf``
(never sampled while some kept logit is larger; a row whose kept logits are all ``-inf`` returns
token 0). ``-0.0`` and ``+0.0`` are one value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter
from kernels.sampling import reference as _ref

#: Elements per block and warps per program of the sampling kernel and of the threshold kernel.
BLOCK_V = 1024
SAMPLE_WARPS = 4
FILTER_BLOCK = 4096
FILTER_WARPS = 16
#: The sampling grid aims at about this many programs (chunks per row = programs / rows).
TARGET_PROGRAMS = 1024

_LC0 = tl.constexpr(_ref.LOG_POLY[0])
_LC1 = tl.constexpr(_ref.LOG_POLY[1])
_LC2 = tl.constexpr(_ref.LOG_POLY[2])
_LC3 = tl.constexpr(_ref.LOG_POLY[3])
_LC4 = tl.constexpr(_ref.LOG_POLY[4])
_LC5 = tl.constexpr(_ref.LOG_POLY[5])
_LC6 = tl.constexpr(_ref.LOG_POLY[6])
_LC7 = tl.constexpr(_ref.LOG_POLY[7])
_LC8 = tl.constexpr(_ref.LOG_POLY[8])
_EC1 = tl.constexpr(_ref.EXP_POLY[1])
_EC2 = tl.constexpr(_ref.EXP_POLY[2])
_EC3 = tl.constexpr(_ref.EXP_POLY[3])
_EC4 = tl.constexpr(_ref.EXP_POLY[4])
_EC5 = tl.constexpr(_ref.EXP_POLY[5])
_EC6 = tl.constexpr(_ref.EXP_POLY[6])
_EC7 = tl.constexpr(_ref.EXP_POLY[7])
_LN2_HI = tl.constexpr(_ref.LN2_HI)
_LN2_LO = tl.constexpr(_ref.LN2_LO)
_LOG2E = tl.constexpr(_ref.LOG2E)
_EXP_MIN = tl.constexpr(_ref.EXP_MIN)
_SQRT2_BITS = tl.constexpr(_ref.SQRT2_BITS)
_UNIFORM_SHIFT = tl.constexpr(_ref.UNIFORM_SHIFT)
_UNIFORM_SCALE = tl.constexpr(_ref.UNIFORM_SCALE)
_MASS_SCALE = tl.constexpr(_ref.MASS_SCALE)


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on uint32 values (reference.philox4x32_10)."""
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _noise_word(tokens, seed, pos):
    """Output word 0 (uint32) of Philox at counter (token, pos lo, pos hi, 0), key (seed lo, hi);
    ``seed`` and ``pos`` are int64 scalars, ``tokens`` int32."""
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    p0 = pos.to(tl.uint32)
    p1 = (pos >> 32).to(tl.uint32)
    zero = tl.zeros_like(tokens).to(tl.uint32)
    x0, _, _, _ = _philox(tokens.to(tl.uint32), p0 + zero, p1 + zero, zero, k0, k1)
    return x0


@triton.jit
def _log_f32(x):
    """reference._log_f32, operation for operation."""
    b = x.to(tl.int32, bitcast=True)
    e = (b >> 23) - 127
    mb = (b & 0x7FFFFF) | 0x3F800000
    big = mb > _SQRT2_BITS
    mb = tl.where(big, mb - 0x800000, mb)
    e = tl.where(big, e + 1, e)
    f = mb.to(tl.float32, bitcast=True) - 1.0
    z = f * f
    p = f * _LC8
    p = p + _LC7
    p = p * f
    p = p + _LC6
    p = p * f
    p = p + _LC5
    p = p * f
    p = p + _LC4
    p = p * f
    p = p + _LC3
    p = p * f
    p = p + _LC2
    p = p * f
    p = p + _LC1
    p = p * f
    p = p + _LC0
    y = p * f
    y = y * z
    ef = e.to(tl.float32)
    y = y + ef * _LN2_LO
    y = y - z * 0.5
    r = f + y
    return r + ef * _LN2_HI


@triton.jit
def _gumbel(bits):
    """reference.gumbel_from_bits of uint32 noise words."""
    u = ((bits >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    v = 0.0 - _log_f32(u)
    return 0.0 - _log_f32(v)


@triton.jit
def _mass_weight(x, m):
    """reference.mass_weights(x - m) (``x == m`` gives weight 2**40), int64."""
    d = tl.where(x == m, 0.0, x - m)
    d = tl.maximum(d, _EXP_MIN)
    t = d * _LOG2E
    n = tl.floor(t + 0.5)
    r = d - n * _LN2_HI
    r = r - n * _LN2_LO
    p = r * _EC7
    p = p + _EC6
    p = p * r
    p = p + _EC5
    p = p * r
    p = p + _EC4
    p = p * r
    p = p + _EC3
    p = p * r
    p = p + _EC2
    p = p * r
    p = p + _EC1
    p = p * r
    p = p + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    w = p * scale
    return (w * _MASS_SCALE).to(tl.int64)


@triton.jit
def _order_key(v):
    """Order-preserving int32 key of float32 ``v`` (-0.0 -> key of +0.0, NaN -> INT32_MAX)."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(v != v, 2147483647, k)


@triton.jit
def _ukey(x):
    """Order-preserving key of NaN-free float32 ``x`` as int64 in [0, 2**32)."""
    return _order_key(x).to(tl.int64) + 2147483648


@triton.jit
def _from_ukey(t):
    """Inverse of ``_ukey``: the float32 whose key is ``t``."""
    k = (t - 2147483648).to(tl.int32)
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(base, offs, mask, inv_t):
    """reference.scaled_logits on one block (NaN -> -inf)."""
    lg = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x = lg * inv_t
    return tl.where(x != x, float("-inf"), x)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _sample_kernel(
    logits_ptr, stride_r, inv_t_ptr, thr_ptr, seed_ptr, pos_ptr, key_ptr, idx_ptr,
    V, n_chunks, iters, WIDTH,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    # a request's settings are shared by its WIDTH rows (float64 settings rounded once, as .float())
    inv_t = tl.load(inv_t_ptr + row // WIDTH).to(tl.float32)
    thr = tl.load(thr_ptr + row)
    seed = tl.load(seed_ptr + row // WIDTH)
    pos = tl.load(pos_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_r
    lanes = tl.arange(0, BLOCK)
    start = chunk * iters * BLOCK
    best_key = tl.full([BLOCK], -2147483648, tl.int32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    if inv_t == 0.0:
        for it in range(iters):
            offs = start + it * BLOCK + lanes
            mask = offs < V
            lg = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            key = tl.where(mask, _order_key(lg), -2147483648)
            better = key > best_key
            best_key = tl.where(better, key, best_key)
            best_idx = tl.where(better, offs, best_idx)
    else:
        for it in range(iters):
            offs = start + it * BLOCK + lanes
            mask = offs < V
            x = _scaled(base, offs, mask, inv_t)
            kept = mask & (x >= thr)
            if tl.max(kept.to(tl.int32), axis=0) > 0:
                g = _gumbel(_noise_word(offs, seed, pos))
                score = tl.where(kept, x + g, float("-inf"))
            else:
                score = tl.full([BLOCK], float("-inf"), tl.float32)
            key = tl.where(mask, _order_key(score), -2147483648)
            better = key > best_key
            best_key = tl.where(better, key, best_key)
            best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_key, axis=0)
    idx = tl.min(tl.where(best_key == top, best_idx, 2147483647), axis=0)
    tl.store(key_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, idx)


@triton.jit
def _reduce_kernel(key_ptr, idx_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < n_chunks
    keys = tl.load(key_ptr + row * n_chunks + offs, mask=mask, other=-2147483648)
    idx = tl.load(idx_ptr + row * n_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(keys, axis=0)
    tok = tl.min(tl.where(mask & (keys == top), idx, 2147483647), axis=0)
    tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _thresholds_kernel(
    logits_ptr, stride_r, inv_t_ptr, top_k_ptr, top_p_ptr, out_ptr, V, WIDTH,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0)
    # a request's settings are shared by its WIDTH rows (float64 settings rounded once, as .float())
    inv_t = tl.load(inv_t_ptr + row // WIDTH).to(tl.float32)
    k = tl.load(top_k_ptr + row // WIDTH)
    p = tl.load(top_p_ptr + row // WIDTH).to(tl.float32)
    k_on = (inv_t != 0.0) & (k > 0) & (k < V)
    p_on = (inv_t != 0.0) & (p > 0.0) & (p < 1.0)
    thr = tl.full([], float("-inf"), tl.float32)
    if k_on | p_on:
        base = logits_ptr + row.to(tl.int64) * stride_r
        lanes = tl.arange(0, BLOCK)
        # top-k: the largest t with #{key >= t} >= k, one bit per pass from the top.
        t_k = tl.full([], 0, tl.int64)
        if k_on:
            bit = tl.full([], 2147483648, tl.int64)
            for _ in range(32):
                cand = t_k | bit
                cnt = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    mask = offs < V
                    x = _scaled(base, offs, mask, inv_t)
                    cnt += (mask & (_ukey(x) >= cand)).to(tl.int32)
                t_k = tl.where(tl.sum(cnt, axis=0) >= k, cand, t_k)
                bit = bit >> 1
        t = t_k
        if p_on:
            mx = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + lanes
                mask = offs < V
                x = _scaled(base, offs, mask, inv_t)
                mx = tl.maximum(mx, tl.where(mask, x, float("-inf")))
            m = tl.max(mx, axis=0)
            zacc = tl.zeros([BLOCK], tl.int64)
            for start in range(0, V, BLOCK):
                offs = start + lanes
                mask = offs < V
                x = _scaled(base, offs, mask, inv_t)
                sel = mask & (_ukey(x) >= t_k)
                if tl.max(sel.to(tl.int32), axis=0) > 0:  # skip the exponentials of blocks outside the top-k set
                    zacc += tl.where(sel, _mass_weight(x, m), 0)
            target = p.to(tl.float64) * tl.sum(zacc, axis=0).to(tl.float64)
            # top-p: the largest t with mass{key >= max(t, t_k)} >= p. It lies in [t_k, key(max)]
            # (the mass at t_k is everything, above the max it is 0), so the bits above the
            # highest bit where t_k and key(max) differ are known: bisect only below it.
            diff = t_k ^ _ukey(m)
            bit = tl.full([], 2147483648, tl.int64)
            for _ in range(32):
                bit = tl.where(bit > diff, bit >> 1, bit)
            t_p = t_k - (t_k & tl.where(bit > 0, 2 * bit - 1, 0))
            while bit > 0:
                cand = t_p | bit
                lower = tl.maximum(cand, t_k)
                acc = tl.zeros([BLOCK], tl.int64)
                for start in range(0, V, BLOCK):
                    offs = start + lanes
                    mask = offs < V
                    x = _scaled(base, offs, mask, inv_t)
                    sel = mask & (_ukey(x) >= lower)
                    if tl.max(sel.to(tl.int32), axis=0) > 0:
                        acc += tl.where(sel, _mass_weight(x, m), 0)
                t_p = tl.where(tl.sum(acc, axis=0).to(tl.float64) >= target, cand, t_p)
                bit = bit >> 1
            t = t_p
        thr = _from_ukey(t)
    tl.store(out_ptr + row, thr)


@triton.jit
def _noise_kernel(seed_ptr, pos_ptr, bits_ptr, gumbel_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    bits = _noise_word(offs, tl.load(seed_ptr + row), tl.load(pos_ptr + row))
    out = row.to(tl.int64) * V + offs
    tl.store(bits_ptr + out, bits.to(tl.int64), mask=mask)
    tl.store(gumbel_ptr + out, _gumbel(bits), mask=mask)


@triton.jit
def _gumbel_kernel(bits_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    bits = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, _gumbel(bits), mask=mask)


@triton.jit
def _philox_kernel(c0_ptr, c1_ptr, c2_ptr, c3_ptr, k0_ptr, k1_ptr, out_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    c0 = tl.load(c0_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c1 = tl.load(c1_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c2 = tl.load(c2_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c3 = tl.load(c3_ptr + offs, mask=mask, other=0).to(tl.uint32)
    k0 = tl.load(k0_ptr + offs, mask=mask, other=0).to(tl.uint32)
    k1 = tl.load(k1_ptr + offs, mask=mask, other=0).to(tl.uint32)
    x0, x1, x2, x3 = _philox(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + offs, x0.to(tl.int64), mask=mask)
    tl.store(out_ptr + N + offs, x1.to(tl.int64), mask=mask)
    tl.store(out_ptr + 2 * N + offs, x2.to(tl.int64), mask=mask)
    tl.store(out_ptr + 3 * N + offs, x3.to(tl.int64), mask=mask)


# ------------------------------------------------------------------------------ wrappers
def _rows(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype, width: int = 1,
          keep_f64: bool = False) -> torch.Tensor:
    """``t`` ``[rows // width]`` as the kernels read it: contiguous, in ``dtype``. ``keep_f64``
    (only for the settings the kernels round as they load them: ``inv_temperature``, ``top_p``):
    a float64 ``t`` stays float64, the same values as ``t.float()`` without a conversion kernel
    before the launch."""
    if width < 1 or rows % width:
        raise ValueError(f"{rows} rows are not a whole number of requests of {width} rows ({name})")
    if t.dim() != 1 or t.shape[0] != rows // width:
        raise ValueError(f"{name} must have shape [{rows // width}], got {list(t.shape)}")
    if keep_f64 and dtype == torch.float32 and t.dtype == torch.float64:
        return t.contiguous()
    return t.to(dtype).contiguous()


def _logits2d(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got {list(logits.shape)}")
    if logits.shape[1] >= 2**31:
        raise ValueError("vocabulary too large for int32 token offsets")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def filter_thresholds(
    logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    width: int = 1,
) -> torch.Tensor:
    """Per-row keep threshold of top-k / top-p filtering (``kernels.sampling.reference.
    filter_thresholds``, equal bit for bit), one Triton program per row.

    Args:
        logits: ``[R, V]`` float16 / bfloat16 / float32 (CUDA; CPU under ``TRITON_INTERPRET=1``),
            last dimension contiguous (copied otherwise), ``V <= 2**23``.
        inv_temperature: ``[R]`` float32 ``float32(1 / T)``, 0 = greedy.
        top_k: ``[R]`` int64, 0 or >= V = off.
        top_p: ``[R]`` float32, 0 or >= 1 = off.
        width: rows per setting: ``inv_temperature``, ``top_k`` and ``top_p`` are ``[R / width]``,
            each shared by ``width`` consecutive rows (a request's tree nodes); float64 settings
            are rounded to float32 as they are read.

    Returns:
        ``[R]`` float32 thresholds in the scaled domain ``x = float32(logits) * inv_temperature``
        (keep ``x >= threshold``); ``-inf`` for greedy rows and rows with both filters off.

    Raises:
        ValueError: bad shapes or ``V > 2**23``.

    Cost: nothing for rows that keep everything; otherwise 32 passes over the row for top-k and
    2 + at most 32 for top-p, all in the row's one program (measured on an H100, bf16, top-k 50
    + top-p 0.9 on every row: about 0.6 ms at V = 49152 and 3 ms at V = 248320 for 1 to 16 rows,
    6 ms for 256 rows at V = 248320).
    """
    logits = _logits2d(logits)
    rows, vocab = logits.shape
    if vocab > _ref.MAX_VOCAB:
        raise ValueError(f"vocabulary {vocab} exceeds {_ref.MAX_VOCAB} (exact top-p mass in int64)")
    inv_t = _rows("inv_temperature", inv_temperature, rows, torch.float32, width, keep_f64=True)
    k = _rows("top_k", top_k, rows, torch.int64, width)
    p = _rows("top_p", top_p, rows, torch.float32, width, keep_f64=True)
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _thresholds_kernel[(rows,)](
            logits, logits.stride(0), inv_t, k, p, out, vocab, width,
            BLOCK=FILTER_BLOCK, num_warps=FILTER_WARPS, enable_fp_fusion=False, **pdl.launch(logits)
        )
    return out


def sample_tokens(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    width: int = 1,
) -> torch.Tensor:
    """Choose one token per row (``kernels.sampling.reference.sample_tokens``, equal token for
    token): greedy argmax where ``inv_temperature == 0``, else the lowest id maximising
    ``x + G(seed, position, token)`` over ``x >= threshold``.

    Args:
        logits: ``[R, V]`` float16 / bfloat16 / float32, last dimension contiguous (copied
            otherwise).
        inv_temperature: ``[R]`` float32; threshold: ``[R]`` float32 (from
            :func:`filter_thresholds`); seeds: ``[R]`` int64 (uint64 bit patterns); positions:
            ``[R]`` int64 absolute positions of the chosen tokens.
        width: rows per setting: ``inv_temperature`` and ``seeds`` are ``[R / width]``, each
            shared by ``width`` consecutive rows (float64 ``inv_temperature``: rounded as read).

    Returns:
        ``[R]`` int64 token ids.

    Raises:
        ValueError: bad shapes.

    Two launches: ``(R, chunks)`` programs of ``iters`` blocks of ``BLOCK_V`` tokens (chunks chosen
    from the shape for about ``TARGET_PROGRAMS`` programs), then one tiny program per row.
    """
    logits = _logits2d(logits)
    rows, vocab = logits.shape
    inv_t = _rows("inv_temperature", inv_temperature, rows, torch.float32, width, keep_f64=True)
    thr = _rows("threshold", threshold, rows, torch.float32)
    seeds = _rows("seeds", seeds, rows, torch.int64, width)
    positions = _rows("positions", positions, rows, torch.int64)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0 or vocab == 0:
        return out.zero_()
    blocks = triton.cdiv(vocab, BLOCK_V)
    iters = max(1, min(blocks, triton.cdiv(blocks * rows, TARGET_PROGRAMS)))
    n_chunks = triton.cdiv(blocks, iters)
    keys = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    idx = torch.empty((rows, n_chunks), dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows, n_chunks)](
        logits, logits.stride(0), inv_t, thr, seeds, positions, keys, idx, vocab, n_chunks, iters, width,
        BLOCK=BLOCK_V, num_warps=SAMPLE_WARPS, enable_fp_fusion=False, **pdl.launch(logits)
    )
    _reduce_kernel[(rows,)](keys, idx, out, n_chunks, BLOCK_C=triton.next_power_of_2(n_chunks), num_warps=1, **pdl.launch(keys))
    return out


def noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-kernel noise of every (row, token), for tests: ``(bits, gumbel)``, ``[R, vocab]``
    int64 noise words (``reference.noise_bits``) and float32 Gumbel values
    (``reference.gumbel_noise``), computed by the same Triton helpers as :func:`sample_tokens`."""
    rows = seeds.shape[0]
    seeds = _rows("seeds", seeds, rows, torch.int64)
    positions = _rows("positions", positions, rows, torch.int64)
    bits = torch.empty((rows, vocab), dtype=torch.int64, device=seeds.device)
    gumbel = torch.empty((rows, vocab), dtype=torch.float32, device=seeds.device)
    if rows and vocab:
        _noise_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
            seeds, positions, bits, gumbel, vocab, BLOCK=BLOCK_V, enable_fp_fusion=False, **pdl.launch(seeds)
        )
    return bits, gumbel


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` int64 noise words computed in-kernel (``reference.noise_bits``)."""
    return noise(seeds, positions, vocab)[0]


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The in-kernel Gumbel transform of noise words (int64 tensor of uint32 values), for tests:
    float32 of the same shape (``reference.gumbel_from_bits``)."""
    flat = bits.to(torch.int64).reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    block = 1024 if flat.is_cuda else 1 << 16  # big blocks: few programs under the interpreter
    if flat.numel():
        _gumbel_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, out, flat.numel(), BLOCK=block, enable_fp_fusion=False, **pdl.launch(flat)
        )
    return out.reshape(bits.shape)


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-kernel Philox-4x32-10 (``reference.philox4x32_10``) on broadcastable int64 tensors
    holding uint32 values, for tests; returns the four output words as int64 tensors."""
    words = torch.broadcast_tensors(*(torch.as_tensor(w, dtype=torch.int64) for w in (c0, c1, c2, c3, k0, k1)))
    shape = words[0].shape
    flat = [w.reshape(-1).contiguous() for w in words]
    n = flat[0].numel()
    out = torch.empty((4, n), dtype=torch.int64, device=flat[0].device)
    if n:
        _philox_kernel[(triton.cdiv(n, 256),)](*flat, out, n, BLOCK=256, **pdl.launch(flat[0]))
    return tuple(o.reshape(shape) for o in out)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# The acceptance walk of a batch of trees (kernels.sampling.accept.accept_trees_reference)


@triton.jit
def _accept_kernel(tok_ptr, par_ptr, anc_ptr, dep_ptr, val_ptr, ch_ptr, path_ptr, n_ptr, bonus_ptr, W,
                   s_tok, s_par, s_anc, s_dep, s_val, s_ch, s_path, BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    """One batch row's accepted path (``accept_trees_reference``'s arithmetic, all of it int64
    and exact): the mismatching nodes' bits summed (distinct bits: the sum is their OR), the nodes
    none of whose ancestors mismatch, the deepest of them (lowest index among equals), its
    ancestors laid out by depth (0 where none), their count and the choice at the end."""
    gdc_enter(PDL)   # (kernels.pdl)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    live = j < W
    tok = tl.load(tok_ptr + b * s_tok + j, mask=live, other=0)
    par = tl.load(par_ptr + b * s_par + j, mask=live, other=-1)
    anc = tl.load(anc_ptr + b * s_anc + j, mask=live, other=0)
    dep = tl.load(dep_ptr + b * s_dep + j, mask=live, other=0)
    val = tl.load(val_ptr + b * s_val + j, mask=live, other=0) != 0
    ch = tl.load(ch_ptr + b * s_ch + j, mask=live, other=0)
    at_parent = tl.load(ch_ptr + b * s_ch + tl.maximum(par, 0), mask=live, other=0)
    match = ((tok == at_parent) & val & (par >= 0)) | (j == 0)
    bit = tl.full([BLOCK_W], 1, tl.int64) << j.to(tl.int64)
    mismatch = tl.sum(tl.where(match | (j >= W), 0, bit), axis=0)
    score = tl.where(((anc & mismatch) == 0) & live, dep * (W + 1) + (W - j), -1)
    end = tl.argmax(score, axis=0)
    anc_end = tl.sum(tl.where(j == end, anc, 0), axis=0)
    in_path = (((anc_end >> j.to(tl.int64)) & 1) != 0) & live
    tl.store(n_ptr + b, tl.sum(in_path.to(tl.int64), axis=0))
    tl.store(bonus_ptr + b, tl.sum(tl.where(j == end, ch, 0), axis=0))
    p = tl.arange(0, BLOCK_W)
    hit = in_path[None, :] & (dep[None, :] == p[:, None])
    tl.store(path_ptr + b * s_path + p, tl.sum(tl.where(hit, j[None, :].to(tl.int64), 0), axis=1), mask=p < W)


def accept_trees(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor,
                 valid: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of ``kernels.sampling.accept.accept_trees_reference`` (same arguments and
    results, the same values: the path's unused positions hold 0 as there): one launch, one
    program per batch row, where the reference runs about 25 small tensor ops.

    Raises:
        ValueError: no nodes or more than 64 per tree (the ancestor bit masks hold 64), or inputs
            of different shapes.
    """
    bsz, w = tokens.shape
    if w > 64 or (bsz and not w):
        raise ValueError(f"trees of {w} nodes: 1 to 64 (the root; the ancestor bit masks hold 64)")
    ins = (tokens, parents, ancestors, depth, valid, choice)
    if any(t.shape != (bsz, w) for t in ins):
        raise ValueError("tokens, parents, ancestors, depth, valid and choice must all be [B, W]")
    ins = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ins)
    path = torch.empty(bsz, w, dtype=torch.long, device=tokens.device)
    n_accept = torch.empty(bsz, dtype=torch.long, device=tokens.device)
    bonus = torch.empty(bsz, dtype=torch.long, device=tokens.device)
    if bsz:   # (w >= 1 then: checked above)
        _accept_kernel[(bsz,)](*ins, path, n_accept, bonus, w, *(t.stride(0) for t in ins), path.stride(0),
                               BLOCK_W=max(2, triton.next_power_of_2(w)), num_warps=1 if w <= 32 else 2,
                               **pdl.launch(tokens))
    return path, n_accept, bonus


@triton.jit
def _step_nodes_kernel(len_ptr, depth_ptr, n_ptr, pos_ptr, next_ptr, valid_ptr, W,
                       BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    m = j < W
    p = tl.load(len_ptr + b) + tl.load(depth_ptr + b * W + j, mask=m, other=0)
    tl.store(pos_ptr + b * W + j, p, mask=m)
    tl.store(next_ptr + b * W + j, p + 1, mask=m)
    tl.store(valid_ptr + b * W + j, (j < tl.load(n_ptr + b)).to(tl.int8), mask=m)


def step_nodes(lengths: torch.Tensor, depth: torch.Tensor, n_nodes: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of ``kernels.sampling.reference.step_nodes``: one launch (one program per
    batch row) where the tensor ops are four kernels."""
    b, w = depth.shape
    lengths, depth, n_nodes = lengths.contiguous(), depth.contiguous(), n_nodes.contiguous()
    positions = torch.empty(b, w, dtype=torch.int64, device=depth.device)
    nxt = torch.empty_like(positions)
    valid = torch.empty(b, w, dtype=torch.int8, device=depth.device)
    if b and w:
        _step_nodes_kernel[(b,)](lengths, depth, n_nodes, positions, nxt, valid, w,
                                 BLOCK_W=triton.next_power_of_2(w), num_warps=1, **pdl.launch(depth))
    return positions, nxt, valid.view(torch.bool)
