"""Skinny ``y = x @ w^T`` in Triton on GGUF block-quantized weights, dequantizing inside the matmul
loop (``M <= 64`` rows of ``x``: decode, verify, the drafter's block, the LM head).

One kernel for all eight types (:data:`kernels.quant.weight.QTYPES`), the type a ``tl.constexpr``
(each type compiles to its own binary). ``x`` ``[..., K]`` (float16 / bfloat16 / float32), the
weight a :class:`~kernels.quant.weight.QuantizedWeight` ``[N, K]`` (its ``uint8`` bytes, block
layouts in :mod:`kernels.quant.weight`), ``y`` ``[..., N]``.

**The loop.** One program per (block of ``BLOCK_N`` output features, block of :data:`BLOCK_M` = 16
rows of ``x``) walks ``K`` one quantization block at a time (32 elements for the legacy types, a
256-element super-block for the k-quants, unrolled over its sub-blocks). A *group* is a run of
elements sharing one scale (and min): the 32 of a legacy block, a 32-element sub-block of Q4_K /
Q5_K, a 16-element sub-block of Q6_K. For each group the program gathers the integer codes
``q`` ``[BLOCK_N, G]`` from the bytes (offsets folded in: ``q - 8``, ``q - 16``, ``q - 32``), and
accumulates, in float32::

    acc += scale[n] * dot(x[:, group], q[n, :]) + bias[n] * sum(x[:, group])

with ``scale = d`` (legacy) or ``d * sc`` (k-quants) and ``bias = m`` (Q4_1, Q5_1), ``-dmin * m``
(Q4_K, Q5_K), none otherwise: the per-element ``w = scale * q + bias`` of the layouts, factored as
llama.cpp's kernels factor it. The codes are small integers (|q| <= 128), exact in float16 /
bfloat16, so the dot runs on the tensor cores in ``x``'s dtype with exact products and a float32
sum (float32 ``x``: IEEE float32 dots); there is no rounding of a dequantized weight to 16 bits.
The result is rounded once to the output dtype. Against gguf-py's dequantization followed by a
float32 matmul the difference is the float32 summation order (tests: relative error <= 1e-3, in
practice ~1e-6 on float32 inputs).

**Bit-exactness across ``M``** (as in :mod:`kernels.linear.triton`, whose docstring gives the
reasons): the launch configuration is a function of ``(N, K, qtype)`` only, ``M`` is not
specialised, a row's accumulator sees the same groups in the same order whatever ``M`` is, and the
dots never mix rows; so a row of a 16-row verify gets the bits of a 1-row decode.

**Not yet tuned** (this is the correctness-first kernel; the GPU sweep comes with the engine
integration): every byte is gathered with a computed offset (two nibbles of a byte are two loads,
served by L1), scales are read per group, there is no split-K and no vectorised block loads. More
than 64 rows (prefill) use :func:`kernels.quant.reference.linear_dequantized` (dequantize to
``x``'s dtype by chunks, then cuBLAS) for now.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.linear.triton import MAX_ROWS, is_pow2, skinny_rows
from kernels.quant.weight import QuantizedWeight

#: Rows per program (the tensor-core tile height); fixed, so it can never depend on ``M``.
BLOCK_M = 16

# GGUF type numbers (GGMLQuantizationType), the kernel's QTYPE constexpr.
# tl.constexpr: a @triton.jit function may read a global only when it is a constexpr (compiled
# Triton refuses plain ints; the interpreter does not check)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = (tl.constexpr(v) for v in (2, 3, 6, 7, 8, 12, 13, 14))


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch configuration of :func:`_qlinear_kernel` for one ``(N, K, qtype)``.

    Attributes:
        block_n: output features per program (power of two, >= 16).
        num_warps: warps per program (power of two <= 32).
        num_stages: software-pipelining depth (>= 1).
    """

    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        pow2 = is_pow2
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.num_warps) and self.num_warps <= 32
                and isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"invalid quantized linear config {self}: BLOCK_N a power of two >= 16, "
                             "num_warps a power of two <= 32, num_stages >= 1")


def config_for(n: int, k: int, qtype) -> Config:
    """The launch config of an ``[N, K]`` weight of ``qtype``: ``BLOCK_N`` 16 / 32 / 64 for ``N`` <=
    4096 / <= 16384 / larger, 4 warps, 2 stages (an untuned rule). Never depends on ``M``."""
    return Config(16 if n <= 4096 else (32 if n <= 16384 else 64), 4, 2)


@triton.jit
def _u8(ptr):
    """Bytes at ``ptr`` as int32."""
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    """The little-endian float16 at ``ptr`` (uint8 pointers, any shape) as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(ptr):
    """Bytes at ``ptr`` as signed int8, widened to int32."""
    return tl.load(ptr).to(tl.int8, bitcast=True).to(tl.int32)


@triton.jit
def _group(acc, x_ptr, rm, mm, sxm, k0, q, scale, bias, HAS_BIAS: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr):
    """``acc += scale * dot(x[:, k0:k0+G], q^T) (+ bias * sum(x[:, k0:k0+G]))`` (module docstring)."""
    rk = k0 + tl.arange(0, G)
    x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=mm[:, None], other=0.0)
    qt = tl.trans(q.to(x_ptr.dtype.element_ty))
    if IEEE:
        part = tl.dot(x, qt, input_precision="ieee")
    else:
        part = tl.dot(x, qt)
    acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * bias[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _qlinear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                    QTYPE: tl.constexpr, QK: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """``y = x @ dequant(w)^T``, one quantization block of ``K`` per iteration (module docstring)."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < M
    # rows past N read row N - 1 (valid bytes, outputs discarded at the store): no masks on the weight
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn          # [BLOCK_N] pointers
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b in range(0, K // QK):
        blk = row + b * BS                                          # [BLOCK_N]: this block of each row
        k0 = b * QK
        if QK == 32:  # legacy: one group of 32
            c = tl.arange(0, 32)
            nib = (c // 16) * 4                                      # element j: nibble j // 16 of byte j % 16
            if QTYPE == _Q4_0:
                q = ((_u8(blk[:, None] + 2 + (c % 16)[None, :]) >> nib[None, :]) & 15) - 8
                acc = _group(acc, x_ptr, rm, mm, sxm, k0, q, _f16(blk), _f16(blk), False, 32, IEEE)
            elif QTYPE == _Q4_1:
                q = (_u8(blk[:, None] + 4 + (c % 16)[None, :]) >> nib[None, :]) & 15
                acc = _group(acc, x_ptr, rm, mm, sxm, k0, q, _f16(blk), _f16(blk + 2), True, 32, IEEE)
            elif QTYPE == _Q5_0:
                h = (_u8(blk[:, None] + 2 + (c // 8)[None, :]) >> (c % 8)[None, :]) & 1
                q = (((_u8(blk[:, None] + 6 + (c % 16)[None, :]) >> nib[None, :]) & 15) | (h << 4)) - 16
                acc = _group(acc, x_ptr, rm, mm, sxm, k0, q, _f16(blk), _f16(blk), False, 32, IEEE)
            elif QTYPE == _Q5_1:
                h = (_u8(blk[:, None] + 4 + (c // 8)[None, :]) >> (c % 8)[None, :]) & 1
                q = ((_u8(blk[:, None] + 8 + (c % 16)[None, :]) >> nib[None, :]) & 15) | (h << 4)
                acc = _group(acc, x_ptr, rm, mm, sxm, k0, q, _f16(blk), _f16(blk + 2), True, 32, IEEE)
            else:  # Q8_0
                q = _i8(blk[:, None] + 2 + c[None, :])
                acc = _group(acc, x_ptr, rm, mm, sxm, k0, q, _f16(blk), _f16(blk), False, 32, IEEE)
        elif QTYPE == _Q6_K:  # 16 groups of 16
            c = tl.arange(0, 16)
            d = _f16(blk + 208)
            for s in tl.static_range(16):
                hh = s // 8                                           # which half (128 elements)
                r = (s % 8) * 16                                      # first element within the half
                lo = (_u8(blk[:, None] + hh * 64 + (r % 64) + c[None, :]) >> (4 * (r // 64))) & 15
                hi = (_u8(blk[:, None] + 128 + hh * 32 + (r % 32) + c[None, :]) >> (2 * (r // 32))) & 3
                q = (lo | (hi << 4)) - 32
                scale = d * _i8(blk + 192 + s).to(tl.float32)
                acc = _group(acc, x_ptr, rm, mm, sxm, k0 + s * 16, q, scale, scale, False, 16, IEEE)
        else:  # Q4_K / Q5_K: 8 groups of 32
            c = tl.arange(0, 32)
            d = _f16(blk)
            dmin = _f16(blk + 2)
            for s in tl.static_range(8):
                if s < 4:
                    sc = _u8(blk + 4 + s) & 63
                    mn = _u8(blk + 8 + s) & 63
                else:
                    sc = (_u8(blk + 8 + s) & 15) | ((_u8(blk + s) >> 6) << 4)
                    mn = (_u8(blk + 8 + s) >> 4) | ((_u8(blk + 4 + s) >> 6) << 4)
                if QTYPE == _Q4_K:
                    q = (_u8(blk[:, None] + 16 + (s // 2) * 32 + c[None, :]) >> (4 * (s % 2))) & 15
                else:
                    q = (_u8(blk[:, None] + 48 + (s // 2) * 32 + c[None, :]) >> (4 * (s % 2))) & 15
                    q = q | (((_u8(blk[:, None] + 16 + c[None, :]) >> s) & 1) << 4)
                acc = _group(acc, x_ptr, rm, mm, sxm, k0 + s * 32, q, d * sc.to(tl.float32),
                             -(dmin * mn.to(tl.float32)), True, 32, IEEE)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & (rn < N)[None, :])


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None,
           config: Config | None = None) -> torch.Tensor:
    """Triton version of :func:`kernels.quant.reference.linear` for at most :data:`MAX_ROWS` rows.

    Args:
        x: ``[..., K]``, float16 / bfloat16 / float32 (float32: IEEE float32 dots).
        weight: a :class:`QuantizedWeight` ``[N, K]`` on ``x``'s device.
        out_dtype: dtype of ``y`` (default ``x``'s); the float32 accumulator is rounded once to it.
        config: launch config (default :func:`config_for`; benchmarks and tests only).

    Returns:
        ``[..., N]``.

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, ``K`` mismatch, ``x`` not float16 / bfloat16 /
            float32, or ``x`` and the weight on different devices.
        TypeError: ``weight`` is not a :class:`QuantizedWeight`.
    """
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the {weight.qtype.name} weight {weight.shape}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    x2 = skinny_rows(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    cfg = config or config_for(n, k, weight.qtype)
    if m and n and k:
        _launch(x2, weight, y, m, n, k, cfg)
    elif m and n:
        y.zero_()
    return y.reshape(*x.shape[:-1], n)


def _launch(x2, weight: QuantizedWeight, y, m, n, k, cfg: Config) -> None:
    _qlinear_kernel[(triton.cdiv(n, cfg.block_n) * triton.cdiv(m, BLOCK_M),)](
        x2, weight.data, y, m, n, k, x2.stride(0), weight.data.stride(0), y.stride(0),
        QTYPE=int(weight.qtype), QK=weight.block_elems, BS=weight.block_bytes,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, IEEE=x2.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
