"""``y = x @ w^T`` in Triton on GGUF block-quantized weights, dequantizing inside the matmul loop:
the skinny path (``M <= 64`` rows of ``x``: decode, verify, the drafter's block, the LM head;
:func:`linear`) and the tiled path (more rows: prefill; :func:`linear_tiled`).

One kernel for all eight types (:data:`kernels.quant.weight.QTYPES`) and both paths, the type a
``tl.constexpr`` (each type compiles to its own binary). ``x`` ``[..., K]`` (float16 / bfloat16 /
float32), the weight a :class:`~kernels.quant.weight.QuantizedWeight` ``[N, K]`` (its ``uint8``
bytes, block layouts in :mod:`kernels.quant.weight`), ``y`` ``[..., N]``.

**The loop.** One program per (block of ``BLOCK_N`` output features, block of ``BLOCK_M`` rows of
``x``) walks ``K`` one quantization block at a time (32 elements for the legacy types, a
256-element super-block for the k-quants, unrolled over its sub-blocks). A *group* is a run of
elements sharing one scale (and min): the 32 of a legacy block, a 32-element sub-block of Q4_K /
Q5_K, a 16-element sub-block of Q6_K. For each group :func:`_codes` (the one reader of the block
layouts) gathers the integer codes ``q`` ``[BLOCK_N, G]`` from the bytes (offsets folded in:
``q - 8``, ``q - 16``, ``q - 32``) and the group's float32 ``scale`` and ``bias`` per output
feature, so that ``w = scale * q + bias`` is the per-element value of the layouts (``scale = d``
(legacy) or ``d * sc`` (k-quants), ``bias = m`` (Q4_1, Q5_1), ``-dmin * m`` (Q4_K, Q5_K), none
otherwise). :func:`_group` then accumulates the group into the float32 ``[BLOCK_M, BLOCK_N]``
accumulator, in one of two ways:

* **skinny** (:data:`BLOCK_M` = 16, ``BLOCK_N`` 16-64): ``acc += scale[n] * dot(x[:, group],
  q[n, :]) + bias[n] * sum(x[:, group])``, the per-element formula factored as llama.cpp's kernels
  factor it. The codes are small integers (|q| <= 128), exact in float16 / bfloat16, so the dot
  runs on the tensor cores in ``x``'s dtype with exact products and a float32 sum (float32 ``x``:
  IEEE float32 dots); there is no rounding of a dequantized weight to 16 bits. Few ALU operations
  per weight byte: decode is a read of the weights.
* **tiled** (``BLOCK_M`` 128, ``BLOCK_N`` 64-128: :class:`TiledConfig`): the group's weights are
  dequantized in registers, ``w = scale * q + bias`` (float32, ``[BLOCK_N, G]``), rounded to
  ``x``'s dtype, and dotted into the accumulator (``acc = dot(x, w^T, acc)``: the tensor-core
  accumulation chains through the groups, no per-group rescaling of a product). bfloat16 keeps
  only 8 significant bits, which leaves a relative error of ~1.6e-3 on random weights (over the
  1e-3 of the tests), so for bfloat16 ``x`` the rounding error ``w - bf16(w)`` goes through a
  second dot (``split``): ``hi + lo`` carries ~16 bits, ~1e-6 relative. float16 (11 bits, ~2e-4)
  needs no split. Each weight byte is dequantized once per ``BLOCK_M`` rows of ``x`` (4 times for
  a 512-token prefill chunk), in registers: the dequantized weight never reaches memory.
  ``TiledConfig(dequant=False)`` runs the skinny arithmetic in large tiles instead (a sweep
  candidate).

Against gguf-py's dequantization followed by a float32 matmul the difference is the float32
summation order (and, tiled, the split's ~2^-16): the tests ask for relative error <= 1e-3 and
see ~1e-6 on float32 and bfloat16 inputs.

**Bit-exactness across ``M``** (as in :mod:`kernels.linear.triton`, whose docstring gives the
reasons), for the skinny path: the launch configuration is a function of ``(N, K, qtype)`` only,
``M`` is not specialised, a row's accumulator sees the same groups in the same order whatever
``M`` is, and the dots never mix rows; so a row of a 16-row verify gets the bits of a 1-row
decode. The tiled path (over 64 rows) has other arithmetic, as cuBLAS above 64 rows has for the
float weights.

**Small shapes** (SmolLM2: ``K`` = 576 or 1536, ``N`` = 576 ... 3072): a program's ``K`` loop
is a serial chain of memory round trips (the byte gathers do not look software-pipelined), so a
decode-sized call would cost about (blocks of ``K``) x (one memory latency) whatever its bytes; the
first GPU run (benchmarks/gpu/quant/run1) measured 2.9 ms per SmolLM2 AR step against 1.0 for bf16
weights. :attr:`Config.unroll` issues the loads of several blocks per iteration (bit for bit the
same result) and :attr:`Config.split_k` spreads ``K`` over more programs (a deterministic second
pass adds the partials): :func:`config_for` splits ``K`` until a launch has ~1024 programs;
``tools/sweep_quant.py --smollm`` times both at SmolLM2's shapes, ``tools/quant_config_ab.py`` the
rule against the previous one.

**Reads and dots** (:data:`WORD_LOADS`, :data:`SWAP_AB`; ``tools/quant_config_ab.py``,
``benchmarks/gpu/quant/run6``): the codes are read as whole words and split in registers
(:func:`_codes_w`), and the skinny dot is ``dot(q, x^T)`` into a transposed accumulator. Still
latency-bound: one program's groups are a chain of small dots at 25% occupancy (Nsight Compute:
103 registers per thread); scales are read per group; the tiled path's dots are one group (16 or
32 elements of ``K``) deep.

**Diagnostic rounding** (:data:`ROUND_WEIGHTS`, ``DFLASH_QUANT_ROUND_W=1``, off by default): each
dequantized weight rounded to ``x``'s dtype before its product, as the ``--weights bf16`` path
holds it, so ``tools/quant_diag.py`` can tell the bf16 engine's rounding from a kernel error.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES

from kernels import pdl
from kernels.linear.triton import MAX_ROWS, is_pow2, skinny_rows
from kernels.pdl import gdc_enter
from kernels.quant import intdot
from kernels.quant.partials import _split_sum_kernel
from kernels.quant.weight import QuantizedWeight, as_qtype, int_setting

log = logging.getLogger(__name__)

#: Rows per program of the skinny path (the tensor-core tile height); fixed, so it can never depend on ``M``.
BLOCK_M = 16

# GGUF type numbers (GGMLQuantizationType), the kernel's QTYPE constexpr.
# tl.constexpr: a @triton.jit function may read a global only when it is a constexpr (compiled
# Triton refuses plain ints; the interpreter does not check)
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = (tl.constexpr(v) for v in (2, 3, 6, 7, 8, 12, 13, 14))


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch configuration of the skinny path (:func:`linear`) for one ``(N, K, qtype)``.

    Attributes:
        block_n: output features per program (power of two, >= 16).
        num_warps: warps per program (power of two <= 32).
        num_stages: software-pipelining depth (>= 1).
        unroll: quantization blocks per iteration of the ``K`` loop, unrolled (>= 1): the loads of
            ``unroll`` blocks are issued before the first of their dots waits, so a program's serial
            chain of memory round trips is ``K / QK / unroll`` long instead of ``K / QK``. The
            groups are accumulated in the same order whatever ``unroll`` is: results are bit for
            bit those of ``unroll=1``. ``K / QK`` must be a multiple of ``unroll * split_k``.
        split_k: programs over ``K`` per output block (>= 1). Each writes the float32 partial sum
            of its ``K / split_k`` range to a scratch ``[split_k, M, N]``; a second kernel adds the
            partials in the order ``0 .. split_k - 1`` and rounds once to the output dtype
            (deterministic, and a row's bits still never depend on ``M``; the float32 summation
            order differs from ``split_k=1``). More programs for a small ``N`` (SmolLM2's 576
            features are 36 programs of 16 on 132 SMs) at the cost of a second launch.
        maxnreg: registers per thread the compiler may use (``None``: its choice), a launch
            option of Triton's NVIDIA backend: fewer registers, more programs resident per SM.

    Raises:
        ValueError: a field out of range.
    """

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    unroll: int = 1
    split_k: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        pow2 = is_pow2
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.num_warps) and self.num_warps <= 32
                and isinstance(self.num_stages, int) and self.num_stages >= 1
                and isinstance(self.unroll, int) and self.unroll >= 1
                and isinstance(self.split_k, int) and self.split_k >= 1
                and (self.maxnreg is None or (isinstance(self.maxnreg, int) and 24 <= self.maxnreg <= 255))):
            raise ValueError(f"invalid quantized linear config {self}: BLOCK_N a power of two >= 16, "
                             "num_warps a power of two <= 32, num_stages >= 1, unroll >= 1, split_k >= 1, maxnreg None or 24..255")

    def fits(self, k: int, qtype) -> bool:
        """Whether the config can run a weight of ``K`` columns of ``qtype``: ``K / QK`` blocks a
        multiple of ``unroll * split_k``."""
        qk = GGML_QUANT_SIZES[as_qtype(qtype)][0]
        return k % qk == 0 and (k // qk) % (self.unroll * self.split_k) == 0


#: the most elements of codes one program holds per iteration of the skinny loop
#: (``BLOCK_N * 32 * unroll``): 16 features x 8 legacy blocks, 32 x 4, 64 x 2
MAX_UNROLLED = 4096


def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is <= ``cap`` (1 for ``n`` <= 1)."""
    return max((d for d in range(1, max(1, min(cap, n)) + 1) if n % d == 0), default=1)


#: programs per launch :func:`config_for` aims at (output blocks x splits over ``K``): ~8 per SM of an H100
TARGET_PROGRAMS = 1024
#: the fewest elements of ``K`` a split-``K`` program walks: legacy types (32-element blocks), k-quants
MIN_SPLIT_ELEMS = {32: 192, 256: 512}
#: the most programs over ``K`` per output block
MAX_SPLIT_K = 16


def split_candidates(k: int, qtype, max_split: int = MAX_SPLIT_K) -> list[int]:
    """The splits ``s`` of ``K`` a launch may use, ascending: ``s`` divides ``K``'s blocks, is at
    most ``max_split`` and leaves each program at least :data:`MIN_SPLIT_ELEMS` of ``K`` (1 always)."""
    qk = GGML_QUANT_SIZES[as_qtype(qtype)][0]
    floor = MIN_SPLIT_ELEMS.get(qk, 512)
    return [s for s in range(1, max_split + 1) if (k // qk) % s == 0 and (s == 1 or k // s >= floor)]


def split_k_for(n: int, k: int, qtype, block_n: int) -> int:
    """:func:`config_for`'s split of ``K`` for programs of ``block_n`` features: the fewest of
    :func:`split_candidates` bringing the launch to :data:`TARGET_PROGRAMS` (``ceil(N / BLOCK_N)
    * s``), the largest when none does."""
    fits = split_candidates(k, qtype)
    outs = -(-n // block_n)
    return next((s for s in fits if outs * s >= TARGET_PROGRAMS), fits[-1])


def config_for(n: int, k: int, qtype, stride: int | None = None) -> Config:
    """The launch config of an ``[N, K]`` weight of ``qtype``: ``BLOCK_N`` 32 (16 below 32 features),
    2 warps (with :data:`SWAP_AB`: ``benchmarks/gpu/quant/run6``), 3 stages, no unroll, and ``K`` split over the fewest programs ``s`` that bring the launch
    to :data:`TARGET_PROGRAMS` (:func:`split_k_for`). A decode-sized call is latency-bound: one
    program walks its ``K`` range serially, so the launch needs many programs in flight (measured on
    an H200 with :data:`BIAS_DOT`, ``tools/quant_config_ab.py``, ``benchmarks/gpu/quant/run5``: Q4_K
    4096 x 4096 70.8 -> 21.2 us, 4096 x 12288 206 -> 50 us; Q8_0 4096 x 4096 71 -> 22 us; SmolLM2's
    Q4_1 3072 x 576 11.8 -> 7.4 us; still 1.5-2.4x the bf16 kernel on a bf16 weight of the shape). Never depends on ``M`` (the split's partials are added in a fixed order, so a
    row's bits do not either). ``stride``: the weight's bytes per stored block
    (:attr:`QuantizedWeight.block_stride`); a padded Q6_K takes :data:`PADDED_STAGES` stages."""
    bn = 32 if n >= 32 else 16
    stages = PADDED_STAGES if stride is not None and as_qtype(qtype).name == "Q6_K" and stride % 4 == 0 else 3
    return Config(bn, 2, stages, 1, split_k_for(n, k, qtype, bn))


#: :func:`config_for`'s pipeline stages for a padded Q6_K weight (``kernels.quant.weight``, "Padded
#: blocks"). Compiled for sm_90, the 16-byte aligned super-blocks let Triton's pipeliner move the
#: code loads into asynchronous copies through shared memory (``LDGSTS``), which made the 9B
#: Q4_K_M step slower on an H200 (4.28 -> 4.73 ms, ``benchmarks/gpu/quant/run11``); with one stage
#: they are direct 8-byte loads. The bits do not depend on it. ``DFLASH_QUANT_Q6K_STAGES``: A/B runs.
PADDED_STAGES = int_setting("DFLASH_QUANT_Q6K_STAGES", os.environ.get("DFLASH_QUANT_Q6K_STAGES"), 1, lambda v: 1 <= v <= 8)


#: Diagnostic only (``tools/quant_diag.py``): every dequantized weight rounded to ``x``'s dtype
#: before its product, as the ``--weights bf16`` path holds it (the skinny path runs the tiled
#: path's dequantize-then-dot arithmetic; the tiled path drops its ``split`` correction). Off by
#: default: the kernels' products are exact. Read once at import from ``DFLASH_QUANT_ROUND_W=1``;
#: the diagnostic sets it directly.
ROUND_WEIGHTS = os.environ.get("DFLASH_QUANT_ROUND_W", "") == "1"

#: The skinny path's sums of ``x`` over a group (the min / dmin term of Q4_1, Q5_1, Q4_K, Q5_K) as
#: a dot with ones on the tensor cores (every column of the product is the row sum) instead of a
#: cross-thread reduction per group: Q4_K 4096 x 4096 at M=1 26.3 -> 19.3 us on an H200 (same
#: config; ``benchmarks/gpu/quant/run5``). Exact products, float32 sums: the same tolerance, and a
#: row's bits still never depend on ``M``. False: the reduction (kept for A/B runs).
BIAS_DOT = True

#: Both paths read a block's codes as whole 32-bit words (16-bit for the blocks whose size is only
#: even: Q4_0, Q5_0, Q8_0, Q6_K) and split them into bytes in registers (:func:`_codes_w`), and each
#: float16 scale in one 16-bit load, instead of one load per byte (:func:`_codes`). The same codes;
#: the legacy 4- and 5-bit types' come interleaved and ``x`` is read to match. False: the byte
#: gathers (kept for A/B runs).
WORD_LOADS = True

#: The skinny path's dots with the codes as the left operand, ``dot(q, x^T)`` into a transposed
#: accumulator ``[BLOCK_N, BLOCK_M]`` (:func:`_group_t`), instead of ``dot(x, q^T)``. With
#: :func:`config_for`'s 2 warps, on an H200 (``tools/quant_config_ab.py --quick``,
#: ``benchmarks/gpu/quant/run6``), M = 1 against the byte gathers and ``dot(x, q^T)`` with 4 warps:
#: Q4_K 4096 x 4096 21.4 -> 18.2 us, 4096 x 12288 50.5 -> 38.9; Q6_K 4096 x 12288 66.1 -> 46.8;
#: Q8_0 4096 x 4096 22.4 -> 19.6, 49152 x 576 33.2 -> 22.7. False: ``dot(x, q^T)`` (A/B runs).
SWAP_AB = True

#: The weight types whose skinny products (16-bit ``x``) take the exact integer arithmetic of
#: :mod:`kernels.quant.intdot` (``x`` split into two 8-bit planes; ``dp4a`` at one row, int8
#: tensor-core dots at more, every row the bits of a one-row call). Q4_K: on an H200 a one-row
#: 9B-shaped projection 1.8-2.4x faster, 16 rows about as fast (``benchmarks/gpu/quant/run9``),
#: relative error against gguf-py's dequantization ~2e-5 (the tests' bound is 1e-3). Q5_K, Q6_K,
#: Q4_0, Q4_1 and Q8_0 have the same pair of kernels, tested on the CPU (the interpreter) but not yet
#: timed or checked on a GPU, so they are not in the default set. Read once at import from
#: ``DFLASH_QUANT_INT_DOTS``: ``1`` (default) Q4_K, ``0`` none (the generic kernel: A/B runs), or a
#: comma-separated list of :data:`kernels.quant.intdot.TYPES` (``Q4_K,Q5_K,Q6_K,Q4_0,Q4_1,Q8_0``).
def int_dot_types(value: str | None) -> tuple[str, ...]:
    """:data:`INT_DOTS` from the value of ``DFLASH_QUANT_INT_DOTS``: unset, ``1`` (or ``true``,
    ``yes``, ``on``) the default set (Q4_K); ``0`` (``false``, ``no``, ``off``, empty) none; else a
    comma-separated list of types, any case and spacing, names not in
    :data:`kernels.quant.intdot.TYPES` left out with a warning."""
    v = (value if value is not None else "1").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return ("Q4_K",)
    if v in ("0", "false", "no", "off", ""):
        return ()
    names = [t.strip().upper() for t in v.split(",") if t.strip()]
    bad = [t for t in names if t not in intdot.TYPES]
    if bad:
        log.warning("DFLASH_QUANT_INT_DOTS names types the integer kernels do not take: left out",
                    extra={"types": bad, "known": list(intdot.TYPES)})
    return tuple(dict.fromkeys(t for t in names if t in intdot.TYPES))


INT_DOTS = int_dot_types(os.environ.get("DFLASH_QUANT_INT_DOTS"))

#: The generic kernel reads a padded Q6_K's codes (``kernels.quant.weight``) as whole words
#: (``DFLASH_QUANT_Q6K_WORDS=1``); default off, the 16-bit halves (which the compiler merges into
#: 8-byte loads). On an H200 at three pipeline stages both reads of padded blocks gave the 9B
#: Q4_K_M step 4.73-4.74 ms against 4.29-4.31 unpadded (``benchmarks/gpu/quant/run11`` calls 2 and 4:
#: the stages, :data:`PADDED_STAGES`); the word reads at one stage are not measured.
Q6_WORDS = tl.constexpr(os.environ.get("DFLASH_QUANT_Q6K_WORDS", "") == "1")


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
def _head(blk, QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, WORDS: tl.constexpr = False):
    """The block-wide fields of the blocks at ``blk`` (``[BLOCK_N]`` pointers), float32
    ``[BLOCK_N]`` each: ``(d, m)`` with ``m`` = the min (Q4_1, Q5_1) or ``dmin`` (Q4_K, Q5_K): the
    ``HAS_BIAS`` types, whose second float16 is at byte 2; ``d`` again (unused) for the others.
    ``WORDS``: each float16 in one 16-bit load (:func:`_f16w`) instead of two byte loads."""
    if QTYPE == _Q6_K:
        d = _half(blk + 208, WORDS)
        m = d
    else:
        d = _half(blk, WORDS)
        if HAS_BIAS:
            m = _half(blk + 2, WORDS)
        else:
            m = d
    return d, m


@triton.jit
def _half(ptr, WORDS: tl.constexpr):
    """The float16 at ``ptr`` as float32: :func:`_f16w` (one 16-bit load) with ``WORDS``, else
    :func:`_f16` (two byte loads)."""
    if WORDS:
        return _f16w(ptr)
    else:
        return _f16(ptr)



@triton.jit
def _k_scale_min(blk, s: tl.constexpr, d, m):
    """Q4_K / Q5_K group ``s`` (of 8) of the blocks at ``blk``: ``(scale, bias)`` float32
    ``[BLOCK_N]`` = ``(d * sc, -dmin * mn)`` with the 6-bit ``sc`` and ``mn`` unpacked from the
    12 bytes at byte 4 (ggml's ``get_scale_min_k4``)."""
    if s < 4:
        sc = _u8(blk + 4 + s) & 63
        mn = _u8(blk + 8 + s) & 63
    else:
        sc = (_u8(blk + 8 + s) & 15) | ((_u8(blk + s) >> 6) << 4)
        mn = (_u8(blk + 8 + s) >> 4) | ((_u8(blk + 4 + s) >> 6) << 4)
    return d * sc.to(tl.float32), -(m * mn.to(tl.float32))

@triton.jit
def _codes(blk, s: tl.constexpr, d, m, QTYPE: tl.constexpr, G: tl.constexpr):
    """Group ``s`` of the blocks at ``blk`` (``[BLOCK_N]`` pointers; ``d``, ``m`` from
    :func:`_head`): ``(q, scale, bias)``, the integer codes ``[BLOCK_N, G]`` (int32, offsets folded
    in) and float32 ``[BLOCK_N]`` scale and bias (the bias meaningful only for the types with a min:
    ``HAS_BIAS``), so that element ``j`` of the group is ``scale * q[:, j] (+ bias)`` exactly as
    gguf-py computes it (layouts in :mod:`kernels.quant.weight`). The one place the kernels read
    the block layouts: the skinny and the tiled path both call it."""
    c = tl.arange(0, G)
    if QTYPE == _Q6_K:  # 16 groups of 16
        hh = s // 8                                               # which half (128 elements)
        r = (s % 8) * 16                                          # first element within the half
        lo = (_u8(blk[:, None] + hh * 64 + (r % 64) + c[None, :]) >> (4 * (r // 64))) & 15
        hi = (_u8(blk[:, None] + 128 + hh * 32 + (r % 32) + c[None, :]) >> (2 * (r // 32))) & 3
        q = (lo | (hi << 4)) - 32
        scale = d * _i8(blk + 192 + s).to(tl.float32)
        bias = scale
    elif QTYPE == _Q4_K or QTYPE == _Q5_K:  # 8 groups of 32
        if QTYPE == _Q4_K:
            q = (_u8(blk[:, None] + 16 + (s // 2) * 32 + c[None, :]) >> (4 * (s % 2))) & 15
        else:
            q = (_u8(blk[:, None] + 48 + (s // 2) * 32 + c[None, :]) >> (4 * (s % 2))) & 15
            q = q | (((_u8(blk[:, None] + 16 + c[None, :]) >> s) & 1) << 4)
        scale, bias = _k_scale_min(blk, s, d, m)
    else:  # legacy: one group of 32 per block
        nib = (c // 16) * 4                                       # element j: nibble j // 16 of byte j % 16
        scale = d
        bias = m
        if QTYPE == _Q4_0:
            q = ((_u8(blk[:, None] + 2 + (c % 16)[None, :]) >> nib[None, :]) & 15) - 8
        elif QTYPE == _Q4_1:
            q = (_u8(blk[:, None] + 4 + (c % 16)[None, :]) >> nib[None, :]) & 15
        elif QTYPE == _Q5_0:
            h = (_u8(blk[:, None] + 2 + (c // 8)[None, :]) >> (c % 8)[None, :]) & 1
            q = (((_u8(blk[:, None] + 6 + (c % 16)[None, :]) >> nib[None, :]) & 15) | (h << 4)) - 16
        elif QTYPE == _Q5_1:
            h = (_u8(blk[:, None] + 4 + (c // 8)[None, :]) >> (c % 8)[None, :]) & 1
            q = ((_u8(blk[:, None] + 8 + (c % 16)[None, :]) >> nib[None, :]) & 15) | (h << 4)
        else:  # Q8_0
            q = _i8(blk[:, None] + 2 + c[None, :])
    return q, scale, bias


@triton.jit
def _f16w(ptr):
    """The float16 at ``ptr`` (uint8 pointers, 2-byte aligned: every block's scale field is) as
    float32, in one 16-bit load."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _bytes_w(ptr, NW: tl.constexpr):
    """``4 * NW`` bytes from ``ptr`` (``[R]`` uint8 pointers, 4-byte aligned) as ``[R, 4 * NW]``
    int32 ``0..255`` in memory order, read as ``NW`` 32-bit words per row (a quarter of the load
    instructions of a byte gather): byte ``j`` of word ``i`` is byte ``4 i + j`` (little-endian)."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, NW)[None, :])
    q = tl.join(tl.join(w & 255, (w >> 16) & 255), tl.join((w >> 8) & 255, (w >> 24) & 255))  # [R, NW, 2, 2]: [.., a, b] = byte 2a + b
    return tl.reshape(q, (w.shape[0], 4 * NW))


@triton.jit
def _bytes_h(ptr, NH: tl.constexpr):
    """``2 * NH`` bytes from ``ptr`` (``[R]`` uint8 pointers, 2-byte aligned: the blocks of 18,
    22, 34 and 210 bytes) as ``[R, 2 * NH]`` int32 ``0..255`` in memory order, read as ``NH``
    16-bit words per row."""
    h = tl.load(ptr.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, NH)[None, :]).to(tl.int32) & 65535
    return tl.reshape(tl.join(h & 255, h >> 8), (h.shape[0], 2 * NH))


@triton.jit
def _nibbles_w(ptr, NW: tl.constexpr):
    """The ``8 * NW`` 4-bit codes of ``4 * NW`` bytes at ``ptr`` (legacy 4-bit layout: element ``j``
    is the low nibble of byte ``j`` and element ``16 + j`` the high one) as ``[R, 8 * NW]`` int32,
    in *interleaved* order: position ``2 j + h`` holds nibble ``h`` of byte ``j`` (element ``16 h +
    j``); :func:`_group` reads ``x`` in the same order (``XPERM``)."""
    b = _bytes_w(ptr, NW)
    return tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], 8 * NW))


@triton.jit
def _nibbles_h(ptr, NH: tl.constexpr):
    """:func:`_nibbles_w` over 16-bit words (2-byte aligned blocks)."""
    b = _bytes_h(ptr, NH)
    return tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], 4 * NH))


@triton.jit
def _codes_w(blk, s: tl.constexpr, d, m, QTYPE: tl.constexpr, G: tl.constexpr, BS: tl.constexpr):
    """:func:`_codes` with the codes read as whole 32-bit words (16-bit where a block's size is
    only even: Q4_0, Q5_0, Q8_0, Q6_K in the file's 210-byte layout; a padded Q6_K, ``BS`` a
    multiple of 4, takes words: ``kernels.quant.weight``, "Padded blocks") instead of one load per
    byte: the same integers, in the same positions except for the legacy 4- and 5-bit types, whose
    codes come in the interleaved order of :func:`_nibbles_w` (``x`` read to match:
    :func:`_group`'s ``XPERM``). ``BS``: the blocks' stride in bytes."""
    if QTYPE == _Q6_K:  # 16 groups of 16
        hh = s // 8
        r = (s % 8) * 16
        if Q6_WORDS and BS % 4 == 0:   # padded: every field 4-byte aligned (16-byte at a stride of 224)
            lo = (_bytes_w(blk + hh * 64 + (r % 64), 4) >> (4 * (r // 64))) & 15
            hi = (_bytes_w(blk + 128 + hh * 32 + (r % 32), 4) >> (2 * (r // 32))) & 3
        else:
            lo = (_bytes_h(blk + hh * 64 + (r % 64), 8) >> (4 * (r // 64))) & 15
            hi = (_bytes_h(blk + 128 + hh * 32 + (r % 32), 8) >> (2 * (r // 32))) & 3
        q = (lo | (hi << 4)) - 32
        scale = d * _i8(blk + 192 + s).to(tl.float32)
        bias = scale
    elif QTYPE == _Q4_K or QTYPE == _Q5_K:  # 8 groups of 32
        if QTYPE == _Q4_K:
            q = (_bytes_w(blk + 16 + (s // 2) * 32, 8) >> (4 * (s % 2))) & 15
        else:
            q = (_bytes_w(blk + 48 + (s // 2) * 32, 8) >> (4 * (s % 2))) & 15
            q = q | (((_bytes_w(blk + 16, 8) >> s) & 1) << 4)
        scale, bias = _k_scale_min(blk, s, d, m)
    else:  # legacy: one group of 32 per block
        scale = d
        bias = m
        if QTYPE == _Q8_0:
            q = _bytes_h(blk + 2, 16)
            q = q - ((q & 128) << 1)                                # two's complement byte
        else:
            p = tl.arange(0, G)
            e = (p % 2) * 16 + p // 2                               # interleaved position -> element
            if QTYPE == _Q4_0:
                q = _nibbles_h(blk + 2, 8) - 8
            elif QTYPE == _Q4_1:
                q = _nibbles_w(blk + 4, 4)
            elif QTYPE == _Q5_0:                                    # the 32 high bits: two 16-bit halves at byte 2
                h16 = (blk + 2).to(tl.pointer_type(tl.int16))
                qh = (tl.load(h16).to(tl.int32) & 65535) | (tl.load(h16 + 1).to(tl.int32) << 16)
                q = (_nibbles_h(blk + 6, 8) | (((qh[:, None] >> e[None, :]) & 1) << 4)) - 16
            else:  # Q5_1: the 32 high bits, one word at byte 4
                qh = tl.load((blk + 4).to(tl.pointer_type(tl.int32)))
                q = _nibbles_w(blk + 8, 4) | (((qh[:, None] >> e[None, :]) & 1) << 4)
    return q, scale, bias


@triton.jit
def _group_cols(k0, G: tl.constexpr, XPERM: tl.constexpr):
    """The ``G`` columns of ``x`` a group starting at ``k0`` reads, in its codes' order: ``k0 +
    p``, or with ``XPERM`` (:func:`_nibbles_w`'s interleaved codes) element ``(p % 2) * (G // 2)
    + p // 2`` of the group at position ``p``."""
    p = tl.arange(0, G)
    if XPERM:
        return k0 + (p % 2) * (G // 2) + p // 2
    else:
        return k0 + p


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``tl.dot(a, b)``: IEEE float32 products and sums for float32 inputs (``IEEE``), else the
    inputs' tensor-core dot with a float32 sum."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _group(acc, x_ptr, rm, mm, sxm, k0, q, scale, bias, HAS_BIAS: tl.constexpr, G: tl.constexpr,
           DEQUANT: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr = 16,
           BIAS_DOT: tl.constexpr = False, XPERM: tl.constexpr = False):
    """One group into the accumulator ``[BLOCK_M, BLOCK_N]``.

    ``DEQUANT`` off (the skinny path): ``acc += scale * dot(x[:, k0:k0+G], q^T) (+ bias *
    sum(x[:, k0:k0+G]))``, the codes exact in ``x``'s dtype (module docstring). ``DEQUANT`` on (the
    tiled path): the group's weights ``w = scale * q (+ bias)`` in float32, then ``acc +=
    dot(x, w^T)`` chained into the accumulator (no per-group rescaling of the product); ``w`` is
    rounded to ``x``'s dtype, and with ``SPLIT`` the rounding error ``w - hi`` goes through a
    second dot (``hi + lo`` carries ~16 significant bits: bfloat16 alone would leave a relative
    error of ~1.6e-3 on random weights, over the 1e-3 the tests ask). float32 ``x`` (``IEEE``):
    IEEE float32 dots, no rounding. ``XPERM``: the codes come in :func:`_nibbles_w`'s interleaved
    order (position ``p`` is element ``(p % 2) * 16 + p // 2`` of the group), and ``x`` is read in
    that order too (:func:`_group_cols`)."""
    rk = _group_cols(k0, G, XPERM)
    x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=mm[:, None], other=0.0)
    if DEQUANT:
        w = q.to(tl.float32) * scale[:, None]
        if HAS_BIAS:
            w = w + bias[:, None]
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            hi = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(hi), acc)
            if SPLIT:
                lo = (w - hi.to(tl.float32)).to(x_ptr.dtype.element_ty)
                acc = tl.dot(x, tl.trans(lo), acc)
    else:
        acc += _dot(x, tl.trans(q.to(x_ptr.dtype.element_ty)), IEEE) * scale[None, :]
        if HAS_BIAS:
            if BIAS_DOT:   # the group's row sums of x on the tensor cores, as every column of a dot with ones
                ones = tl.full([G, BLOCK_N], 1.0, x_ptr.dtype.element_ty)
                acc += _dot(x, ones, IEEE) * bias[None, :]
            else:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * bias[None, :]
    return acc


@triton.jit
def _group_t(acc, x_ptr, rm, mm, sxm, k0, q, scale, bias, HAS_BIAS: tl.constexpr, G: tl.constexpr,
             IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BIAS_DOT: tl.constexpr, XPERM: tl.constexpr):
    """:func:`_group`'s skinny arithmetic on the transposed accumulator ``[BLOCK_N, BLOCK_M]``
    (``SWAP``): ``acc += scale * dot(q, x[:, group]^T) (+ bias * sum)``, the codes the dot's left
    operand (on Hopper a warpgroup MMA reads it from registers) and ``x`` loaded transposed."""
    rk = _group_cols(k0, G, XPERM)
    xt = tl.load(x_ptr + rk[:, None] + rm[None, :] * sxm, mask=mm[None, :], other=0.0)    # [G, BLOCK_M]
    acc += _dot(q.to(x_ptr.dtype.element_ty), xt, IEEE) * scale[:, None]
    if HAS_BIAS:
        if BIAS_DOT:
            ones = tl.full([q.shape[0], G], 1.0, x_ptr.dtype.element_ty)
            acc += _dot(ones, xt, IEEE) * bias[:, None]
        else:
            acc += tl.sum(xt.to(tl.float32), axis=0)[None, :] * bias[:, None]
    return acc


@triton.jit(do_not_specialize=["M"])
def _qlinear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                    QTYPE: tl.constexpr, QK: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr, SPLIT: tl.constexpr,
                    IEEE: tl.constexpr, UNROLL: tl.constexpr, SPLIT_K: tl.constexpr, BIAS_DOT: tl.constexpr = False,
                    WORDS: tl.constexpr = False, SWAP: tl.constexpr = False, XPERM: tl.constexpr = False, PDL: tl.constexpr = False):
    """``y = x @ dequant(w)^T``, ``UNROLL`` quantization blocks of ``K`` per iteration (each
    block's ``QK // G`` groups unrolled; the groups accumulate in ``K`` order whatever ``UNROLL``
    is), over the ``K / SPLIT_K`` range of program ``(.., program_id(1))``; with ``SPLIT_K`` > 1
    ``y_ptr`` is the float32 scratch ``[SPLIT_K, M, N]`` of partial sums (:func:`_split_sum_kernel`
    adds them). The skinny path (``DEQUANT`` off, ``BLOCK_M`` 16) and the tiled one (``DEQUANT``
    on, large tiles) differ only in :func:`_group` (module docstring)."""
    gdc_enter(PDL)   # (kernels.pdl)
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < M
    # rows past N read row N - 1 (valid bytes, outputs discarded at the store): no masks on the weight
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn          # [BLOCK_N] pointers
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    nb = K // QK // SPLIT_K                                         # blocks of this program's K range
    b0 = tl.program_id(1) * nb
    for b in range(b0, b0 + nb, UNROLL):
        for u in tl.static_range(UNROLL):
            blk = row + (b + u) * BS                                # [BLOCK_N]: this block of each row
            d, m = _head(blk, QTYPE, HAS_BIAS, WORDS)
            for s in tl.static_range(QK // G):
                if WORDS:
                    q, scale, bias = _codes_w(blk, s, d, m, QTYPE, G, BS)
                else:
                    q, scale, bias = _codes(blk, s, d, m, QTYPE, G)
                if SWAP:
                    acc = _group_t(acc, x_ptr, rm, mm, sxm, (b + u) * QK + s * G, q, scale, bias, HAS_BIAS, G, IEEE,
                                   BLOCK_M, BIAS_DOT, XPERM)
                else:
                    acc = _group(acc, x_ptr, rm, mm, sxm, (b + u) * QK + s * G, q, scale, bias, HAS_BIAS, G, DEQUANT,
                                 SPLIT, IEEE, BLOCK_N, BIAS_DOT, XPERM)
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * M * sym
    if SWAP:
        tl.store(y_ptr + rm[None, :] * sym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[None, :] & (rn < N)[:, None])
    else:
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & (rn < N)[None, :])


def _check(x: torch.Tensor, weight: QuantizedWeight) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the {weight.qtype.name} weight {weight.shape}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None,
           config: Config | None = None, round_weights: bool | None = None, wide: bool = False) -> torch.Tensor:
    """Triton version of :func:`kernels.quant.reference.linear` for at most :data:`MAX_ROWS` rows
    (the skinny path).

    Args:
        x: ``[..., K]``, float16 / bfloat16 / float32 (float32: IEEE float32 dots).
        weight: a :class:`QuantizedWeight` ``[N, K]`` on ``x``'s device.
        out_dtype: dtype of ``y`` (default ``x``'s); the float32 accumulator is rounded once to it.
        config: launch config (default :func:`config_for`; benchmarks and tests only).
        round_weights: each dequantized weight rounded to ``x``'s dtype before its product (the
            values the ``--weights bf16`` path holds; diagnostics only); default
            :data:`ROUND_WEIGHTS` (off).
        wide: take any number of rows (16 per program, as ever: the batch-invariant steps of
            ``kernels.linear.batch_invariant``), not at most :data:`MAX_ROWS`.

    Returns:
        ``[..., N]``.

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, ``K`` mismatch, ``x`` not float16 / bfloat16 /
            float32, ``x`` and the weight on different devices, or a ``config`` whose ``unroll *
            split_k`` does not divide ``K``'s blocks (:meth:`Config.fits`).
        TypeError: ``weight`` is not a :class:`QuantizedWeight`.
    """
    _check(x, weight)
    n, k = weight.shape
    x2 = skinny_rows(x, k, None if wide else MAX_ROWS)
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    cfg = config or config_for(n, k, weight.qtype, weight.block_stride)
    if not cfg.fits(k, weight.qtype):
        raise ValueError(f"config {cfg} does not fit a {weight.qtype.name} weight of K = {k}: "
                         f"K / {weight.block_elems} blocks must be a multiple of unroll * split_k")
    rw = ROUND_WEIGHTS if round_weights is None else bool(round_weights)
    if (config is None and not rw and m and n and weight.qtype.name in INT_DOTS
            and x2.dtype in (torch.float16, torch.bfloat16) and k % intdot.block_elems(weight.qtype.name) == 0):
        intdot.linear(x2, weight, y)
        return y.reshape(*x.shape[:-1], n)
    if m and n and k:
        if cfg.split_k > 1:
            part = torch.empty(cfg.split_k, m, n, device=x.device, dtype=torch.float32)
            _launch(x2, weight, part, m, n, k, BLOCK_M, cfg.block_n, cfg.num_warps, cfg.num_stages, rw, False,
                    cfg.unroll, cfg.split_k, cfg.maxnreg)
            block = 1024
            _split_sum_kernel[(triton.cdiv(m * n, block),)](part, y, m * n, SPLIT_K=cfg.split_k, BLOCK=block,
                                                            num_warps=4, **pdl.launch(part))
        else:
            _launch(x2, weight, y, m, n, k, BLOCK_M, cfg.block_n, cfg.num_warps, cfg.num_stages, rw, False, cfg.unroll,
                    1, cfg.maxnreg)
    elif m and n:
        y.zero_()
    return y.reshape(*x.shape[:-1], n)


@dataclasses.dataclass(frozen=True)
class TiledConfig:
    """Launch configuration of the tiled path (:func:`linear_tiled`) for one ``(N, K, qtype)``.

    Attributes:
        block_m: rows of ``x`` per program (power of two, >= 16).
        block_n: output features per program (power of two, >= 16).
        num_warps: warps per program (power of two <= 32).
        num_stages: software-pipelining depth (>= 1).
        dequant: ``True``: each group's weights dequantized to ``x``'s dtype, then one dot chained
            into the accumulator (:func:`_group`); ``False``: the skinny path's arithmetic (codes
            dotted, the product scaled per group) in large tiles (exact products; for the sweep).
        split: with ``dequant`` and 16-bit ``x``, the rounding error of the weights goes through a
            second dot (:func:`_group`); ``None``: on for bfloat16, off for float16 (its 11-bit
            weights stay within ~2e-4 of the float32 result).

    Raises:
        ValueError: a field out of range.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    dequant: bool = True
    split: bool | None = None

    def __post_init__(self):
        pow2 = is_pow2
        if not (pow2(self.block_m) and self.block_m >= 16 and pow2(self.block_n) and self.block_n >= 16
                and pow2(self.num_warps) and self.num_warps <= 32 and isinstance(self.num_stages, int)
                and self.num_stages >= 1 and isinstance(self.dequant, bool) and self.split in (None, True, False)):
            raise ValueError(f"invalid tiled quantized linear config {self}: BLOCK_M and BLOCK_N powers of two >= 16, "
                             "num_warps a power of two <= 32, num_stages >= 1, dequant a bool, split None or a bool")


def tiled_config_for(n: int, k: int, qtype, dtype: torch.dtype = torch.bfloat16) -> TiledConfig:
    """The tiled path's config for an ``[N, K]`` weight of ``qtype`` and ``x`` of ``dtype``. 16-bit
    ``x``: 128 x 128 tiles, 8 warps, 2 stages, the factored arithmetic (``dequant=False``: on an
    H200 at 512 rows 1.14x (Q4_K) to 1.26x (Q6_K) faster than dequantize-then-dot with the split,
    ``tools/sweep_quant.py --tiled-only``, ``benchmarks/gpu/quant/run6``); for ``N`` <= 2048 (not
    measured there) 128 x 64 tiles (more programs on small projections), dequantize-then-dot. Compiled for sm_90, the k-quants' loop pipelines
    every group's loads: 3 stages of 128 x 128 would need 232 KB (Q4_K) of shared memory, over an
    H100's 227 KB; 2 stages need 152 KB. float32 ``x`` (IEEE dots on the CUDA cores, tests only):
    32 x 32 tiles, 4 warps, 1 stage (larger tiles spill registers and take ~1 minute to compile).
    Never depends on ``M``."""
    if dtype == torch.float32:
        return TiledConfig(32, 32, 4, 1, True, None)
    if n <= 2048:
        return TiledConfig(128, 64, 8, 2, True, None)
    return TiledConfig(128, 128, 8, 2, False, None)


def linear_tiled(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None,
                 config: TiledConfig | None = None) -> torch.Tensor:
    """``x @ dequantize(weight)^T`` for any number of rows (the prefill path: more than
    :data:`MAX_ROWS` rows), the weight dequantized group by group in registers inside the matmul
    (``TiledConfig.dequant``), float32 accumulation, one rounding to ``out_dtype``.

    Against gguf-py's dequantization and a float32 matmul: float32 ``x`` within the summation
    order (~1e-6 relative); bfloat16 ``x`` (``split`` on) ~1e-6; float16 ``x`` (``split`` off)
    ~2e-4. The weight is never materialised in memory.

    Args:
        x: ``[..., K]``, float16 / bfloat16 / float32 (float32: IEEE float32 dots).
        weight: a :class:`QuantizedWeight` ``[N, K]`` on ``x``'s device.
        out_dtype: dtype of ``y`` (default ``x``'s).
        config: launch config (default :func:`tiled_config_for`; benchmarks and tests only).

    Returns:
        ``[..., N]``.

    Raises:
        ValueError: ``K`` mismatch, ``x`` not float16 / bfloat16 / float32, or ``x`` and the
            weight on different devices.
        TypeError: ``weight`` is not a :class:`QuantizedWeight`.
    """
    _check(x, weight)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    cfg = config or tiled_config_for(n, k, weight.qtype, x2.dtype)
    split = (cfg.split if cfg.split is not None else x2.dtype == torch.bfloat16) and not ROUND_WEIGHTS
    if m and n and k:
        _launch(x2, weight, y, m, n, k, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.dequant, split)
    elif m and n:
        y.zero_()
    return y.reshape(*x.shape[:-1], n)


#: the types with a min / dmin (``w = scale * q + bias``)
_BIASED = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def kernel_constants(qtype, x_dtype: torch.dtype, block_m: int, block_n: int, dequant: bool, split: bool,
                     unroll: int = 1, split_k: int = 1, aligned: bool = True, stride: int | None = None) -> dict:
    """The ``tl.constexpr`` arguments of :func:`_qlinear_kernel` for a weight of ``qtype`` and ``x``
    of ``x_dtype`` (what a launch passes; ``tools/sweep_quant.py`` precompiles with them).
    ``aligned``: the weight's bytes start on a 4-byte boundary (its rows then all do: every row
    of the word-read types is a multiple of 4 bytes, of the others of 2), which
    :data:`WORD_LOADS` needs; a view that does not takes the byte gathers. ``stride``: bytes per
    stored block (:attr:`QuantizedWeight.block_stride`; default the GGUF block size)."""
    qt = as_qtype(qtype)
    qk, bs = GGML_QUANT_SIZES[qt]
    bs = int(stride or bs)
    words = bool(WORD_LOADS) and bool(aligned)
    return dict(QTYPE=int(qt), QK=qk, BS=bs, G=16 if qt.name == "Q6_K" else 32, HAS_BIAS=qt.name in _BIASED,
                BLOCK_M=block_m, BLOCK_N=block_n, DEQUANT=bool(dequant),
                SPLIT=bool(split) and x_dtype != torch.float32, IEEE=x_dtype == torch.float32,
                UNROLL=int(unroll), SPLIT_K=int(split_k), BIAS_DOT=bool(BIAS_DOT) and not dequant,
                WORDS=words, SWAP=bool(SWAP_AB) and not dequant,
                XPERM=words and qk == 32 and qt.name != "Q8_0")   # (_codes_w's interleaved legacy 4- / 5-bit codes)


def _launch(x2, weight: QuantizedWeight, y, m, n, k, block_m, block_n, num_warps, num_stages, dequant, split,
            unroll: int = 1, split_k: int = 1, maxnreg: int | None = None) -> None:
    opts = {} if maxnreg is None else {"maxnreg": maxnreg}
    _qlinear_kernel[(triton.cdiv(n, block_n) * triton.cdiv(m, block_m), split_k)](
        x2, weight.data, y, m, n, k, x2.stride(0), weight.data.stride(0), y.stride(-2),
        **kernel_constants(weight.qtype, x2.dtype, block_m, block_n, dequant, split, unroll, split_k,
                           weight.data.data_ptr() % 4 == 0, weight.block_stride),
        num_warps=num_warps, num_stages=num_stages, **opts, **pdl.launch(x2))
