"""Skinny linear projection in Triton for the decode and small verify steps (``M <= 64`` rows).

``y = x @ w^T`` with ``x`` ``[..., K]`` (``M`` rows in all), ``w`` ``[N, K]`` (contiguous last
dim), ``y`` ``[..., N]``; float16 / bfloat16 (tensor-core dots) or float32 (IEEE float32 dots, no
tf32). One program per (block of ``BLOCK_N`` output features, block of :data:`BLOCK_M` = 16 rows)
streams its ``BLOCK_N`` rows of ``w`` in ``BLOCK_K`` slices, tensor-core dot against its 16 rows of
``x``, float32 accumulation in ``K`` order, one rounding to ``x``'s dtype (as ``F.linear`` rounds)
and then to the output dtype. At ``M = 1`` a projection is a pure read of the weight matrix;
cuBLAS's general kernels pay launch and ramp-up latency that dominates the small matrices of
0.1-1B models (the profile in benchmarks/gpu/ counts it). Same contract as
``kernels.linear.reference.linear``; larger ``M`` goes to cuBLAS (``kernels.linear.linear``).

**Bit-exactness across ``M``** (speculative decoding relies on it: verifying a width-16 tree must
give, row for row, the bits a width-1 decode step gives, or greedy speculative decoding would not
be token-identical to target-only decoding). A row's result depends only on its own values and on
the kernel's tiling, never on the other rows or on ``M``:

* the launch configuration (``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``; ``BLOCK_M`` is
  always 16) is a function of ``(N, K, dtype)`` only (:func:`config_for`), never of ``M``;
* ``M`` is not specialised (``do_not_specialize``), so ``M = 1`` and ``M = 16`` run the same
  compiled binary (Triton does specialise on 16-byte alignment of the pointers and strides; that
  only changes how tiles are loaded, not the arithmetic);
* each output element is one row of ``x`` against one row of ``w``: the dot instructions never
  mix rows, padded rows are zeros that only reach their own (discarded) outputs, and the float32
  accumulator of an element sees the same ``BLOCK_K`` slices in the same order whatever ``M`` is;
  which program handles a row (the 1-D grid puts the row blocks of a weight block side by side,
  so a 17-64-row call reads each weight byte from HBM once) changes nothing in that arithmetic.

No split-K: splitting the ``K`` loop across programs would change the accumulation order with the
number of splits and need atomics or a second pass; long-``K`` weights get bigger ``BLOCK_K`` /
more stages / more warps from the config table instead.

Changing a shape's config changes its rounding (a different ``BLOCK_K`` or warp split reorders the
float32 sum); that is fine as long as every ``M`` uses the same one, which the rule above ensures
within one process (all services of a deployment should share ``DFLASH_LINEAR_CONFIG``).

**Config table.** :data:`CONFIGS` maps ``(N, K)`` to a :class:`Config` for 16-bit dtypes (fill it
from ``tools/sweep_linear.py``'s JSON: it prints the lines to paste); shapes not in it get
:func:`default_config` (the rule this kernel always used: ``BLOCK_N`` 16 / 32 / 64 for ``N`` up to
4096 / 16384 / beyond, ``BLOCK_K`` 256, 4 warps, 3 stages). float32 always uses the rule with
``BLOCK_K`` 128 (IEEE dots). ``DFLASH_LINEAR_CONFIG=path.json`` (the sweep's output, or any JSON
with a ``"configs"`` list of ``{"N", "K", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}``)
overrides the table entry by entry; a bad file raises at the first projection.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter

MAX_ROWS = 64
#: Rows per program (the tensor-core tile height); fixed, so it can never depend on ``M``.
BLOCK_M = 16
#: Environment variable naming a JSON file of configs that override :data:`CONFIGS`.
CONFIG_ENV = "DFLASH_LINEAR_CONFIG"


def is_pow2(v) -> bool:
    """Whether ``v`` is a positive int power of two (launch-config checks of the Triton kernels)."""
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def skinny_rows(x: torch.Tensor, k: int, max_rows: int | None = MAX_ROWS) -> torch.Tensor:
    """``x`` ``[..., K]`` as the ``[M, K]`` rows a skinny kernel reads (a view when it can be,
    last dim contiguous). Raises ValueError for more than ``max_rows`` rows (None: any)."""
    x2 = x.reshape(-1, k)
    if max_rows is not None and x2.shape[0] > max_rows:
        raise ValueError(f"{x2.shape[0]} rows: the skinny kernel takes at most {max_rows}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch configuration of :func:`_skinny_kernel` for one ``(N, K, dtype)``.

    Attributes:
        block_n: output features per program (power of two, >= 16).
        block_k: reduction slice per loop iteration (power of two, >= 16).
        num_warps: warps per program (power of two).
        num_stages: software-pipelining depth of the loads (>= 1).
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        pow2 = is_pow2
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.block_k) and self.block_k >= 16
                and pow2(self.num_warps) and self.num_warps <= 32 and isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"invalid linear config {self}: BLOCK_N, BLOCK_K powers of two >= 16, "
                             "num_warps a power of two <= 32, num_stages >= 1")


#: Tuned configs for 16-bit dtypes, ``(N, K) -> Config``, from an H200 run of
#: ``tools/sweep_linear.py`` (``bash tools/gpu_run.sh sweep``; ``benchmarks/gpu/sweep-linear.json``);
#: missing shapes use :func:`default_config`.
CONFIGS: dict[tuple[int, int], Config] = {
    (24576, 4096): Config(64, 128, 2, 3),  # qwen35-9b:gate_upx32
    (4096, 12288): Config(16, 128, 2, 4),  # qwen35-9b:downx32
    (18432, 2560): Config(64, 128, 2, 3),  # qwen35-4b:gate_upx32
    (12352, 4096): Config(64, 128, 2, 4),  # qwen35-9b:in_projx24
    (248320, 4096): Config(128, 128, 4, 4),  # qwen35-9b:lm_headx1
    (12352, 2560): Config(64, 128, 2, 4),  # qwen35-4b:in_projx24
    (2560, 9216): Config(16, 128, 2, 4),  # qwen35-4b:downx32
    (4096, 4096): Config(16, 256, 2, 5),  # qwen35-9b:ox8, qwen35-9b:outx24
    (2560, 4096): Config(16, 512, 2, 3),  # qwen35-4b:ox8, qwen35-4b:outx24
    (10240, 4096): Config(32, 128, 2, 4),  # qwen35-9b:qkvx8
    (248320, 1024): Config(64, 128, 2, 3),  # qwen35-0.8b:lm_headx1
    (10240, 2560): Config(64, 128, 2, 4),  # qwen35-4b:qkvx8
    (7168, 1024): Config(32, 128, 2, 5),  # qwen35-0.8b:gate_upx24
    (8224, 1024): Config(32, 128, 2, 5),  # qwen35-0.8b:in_projx18
    (3072, 576): Config(16, 128, 2, 4),  # smollm2:gate_upx30
    (1024, 2048): Config(16, 512, 2, 3),  # qwen35-0.8b:ox6, qwen35-0.8b:outx18
    (5120, 1024): Config(32, 128, 2, 4),  # qwen35-0.8b:qkvx6
    (49152, 576): Config(128, 64, 2, 3),  # smollm2:lm_headx1
    (960, 576): Config(16, 128, 2, 5),  # smollm2:qkvx30
    (576, 576): Config(16, 128, 2, 5),  # smollm2:ox30
}


def default_config(n: int, k: int, dtype: torch.dtype) -> Config:
    """The fallback rule: ``BLOCK_N`` 16 / 32 / 64 for ``N`` <= 4096 / <= 16384 / larger (enough
    programs for 132 SMs on small ``N``, fewer re-reads of ``x`` on the vocabulary projection),
    ``BLOCK_K`` 256 (128 for float32), 4 warps, 3 stages."""
    return Config(16 if n <= 4096 else (32 if n <= 16384 else 64), 128 if dtype == torch.float32 else 256, 4, 3)


def _entry_config(e: dict, where: str) -> tuple[tuple[int, int], Config]:
    try:
        key = (int(e["N"]), int(e["K"]))
        dt = str(e.get("dtype", "bfloat16")).replace("torch.", "")
        if dt not in ("bfloat16", "float16", "bf16", "fp16", "16bit"):
            raise ValueError(f"dtype {dt!r}: the table holds 16-bit configs only (float32 uses the rule)")
        return key, Config(int(e["BLOCK_N"]), int(e["BLOCK_K"]), int(e["num_warps"]), int(e["num_stages"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad linear config entry {e!r}: {exc}") from exc


@functools.lru_cache(maxsize=8)
def load_config_file(path: str) -> dict[tuple[int, int], Config]:
    """``(N, K) -> Config`` from a JSON file: an object with a ``"configs"`` list (the format
    ``tools/sweep_linear.py --out`` writes), or the list itself. Cached per path.

    Raises:
        ValueError: unreadable file, bad JSON, or an entry missing a field / with invalid values.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{CONFIG_ENV}={path}: {exc}") from exc
    entries = data.get("configs") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{CONFIG_ENV}={path}: expected a list of configs or an object with a 'configs' list")
    return dict(_entry_config(e, path) for e in entries)


def config_for(n: int, k: int, dtype: torch.dtype) -> Config:
    """The launch config of an ``[N, K]`` weight in ``dtype``: float32 -> :func:`default_config`;
    16-bit -> the ``DFLASH_LINEAR_CONFIG`` file's entry, else :data:`CONFIGS`' entry, else
    :func:`default_config`. Never depends on the number of rows (module docstring)."""
    if dtype == torch.float32:
        return default_config(n, k, dtype)
    path = os.environ.get(CONFIG_ENV)
    if path:
        cfg = load_config_file(path).get((n, k))
        if cfg is not None:
            return cfg
    return CONFIGS.get((n, k)) or default_config(n, k, dtype)


#: shared memory one program of :func:`wide_config` may use for its pipelined tiles (bytes; an
#: H100 / H200 SM has 227 KiB)
WIDE_SMEM = 200 << 10


def wide_config(cfg: Config, dtype: torch.dtype, weight_tiles: int = 1) -> tuple[int, Config]:
    """``(BLOCK_M, config)`` for more than :data:`MAX_ROWS` rows with the bits of ``cfg``: 64 x
    ``max(64, BLOCK_N)`` tiles, 4 warps, ``cfg``'s ``BLOCK_K`` (the one field that orders a row's
    float32 sum) and as many of its stages as fit :data:`WIDE_SMEM`. Measured on an H200
    (``benchmarks/gpu/invariant``): every row equal, bit for bit, to a 1-row call with ``cfg``,
    for SmolLM2's and a 9B's projections, and 2-5x faster than ``cfg``'s 16-row tiles at 128-1024
    rows (about 1.7x cuBLAS). ``weight_tiles``: weight tiles per stage (2 for
    :func:`linear_swiglu`'s gate and up)."""
    bn = max(64, cfg.block_n)
    return 64, Config(bn, cfg.block_k, 4, _stages_fitting(cfg.num_stages, 64, bn, cfg.block_k, dtype, weight_tiles))


def _stages_fitting(stages: int, block_m: int, block_n: int, block_k: int, dtype: torch.dtype,
                    weight_tiles: int = 1) -> int:
    """At most ``stages`` pipeline stages of a ``block_m`` x ``block_k`` input tile and
    ``weight_tiles`` ``block_n`` x ``block_k`` weight tiles that fit :data:`WIDE_SMEM` (at least
    one). The order of a row's sums does not depend on the stages."""
    per_stage = (block_m + weight_tiles * block_n) * block_k * torch.finfo(dtype).bits // 8
    return max(1, min(stages, WIDE_SMEM // per_stage))


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output columns and rows and their masks: a 1-D grid, row blocks fastest, so
    the (up to 4) programs that share a weight block run side by side and a 17..64-row call reads
    each weight byte from HBM once (the others hit L2)."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rn, rm, rn < N, rm < M


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``y = x @ w^T`` for one block of output features; the result is rounded to ``x``'s dtype
    first (as ``F.linear`` rounds it) and then stored in ``y``'s dtype. ``PDL``: launched with
    programmatic dependent launch (:mod:`kernels.pdl`)."""
    gdc_enter(PDL)
    rn, rm, nm, mm = _tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * swn + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], out, mask=mm[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["M"])
def _skinny_swiglu_kernel(x_ptr, w_ptr, y_ptr, M, F, K, sxm, swn, sym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                          PDL: tl.constexpr = False):
    """``y = silu(x @ w[:F]^T) * (x @ w[F:]^T)`` for one block of ``BLOCK_N`` output features: the
    gate and up tiles of :func:`_skinny_kernel` side by side (same slices, same order, each rounded
    to ``x``'s dtype), then ``kernels.activation.triton``'s arithmetic."""
    gdc_enter(PDL)
    rn, rm, nm, mm = _tile(M, F, BLOCK_M, BLOCK_N)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        wm = nm[:, None] & km[None, :]
        wg = tl.load(w_ptr + rn[:, None].to(tl.int64) * swn + rk[None, :], mask=wm, other=0.0)
        wu = tl.load(w_ptr + (rn[:, None] + F).to(tl.int64) * swn + rk[None, :], mask=wm, other=0.0)
        if IEEE:
            acc_g += tl.dot(x, tl.trans(wg), input_precision="ieee")
            acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty)
    out = (act.to(tl.float32) * u).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], out, mask=mm[:, None] & nm[None, :])


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None, wide: bool = False) -> torch.Tensor:
    """Triton version of ``kernels.linear.reference.linear_swiglu``: the gate-up projection and
    SwiGLU in one launch, bit for bit :func:`linear` (with the config of the whole ``[2F, K]``
    weight) followed by ``kernels.activation.triton.silu_mul`` (each output element sees the same
    ``BLOCK_K`` slices in the same order and the same roundings), for the same rows as
    :func:`linear` (``wide``: any number, in :func:`wide_config`'s tiles).

    Args:
        x: ``[..., K]`` float16 / bfloat16 / float32.
        weight: ``[2F, K]`` (gate rows, then up rows), same dtype, contiguous last dim.
        config: launch config (default :func:`config_for` ``(2F, K, dtype)``).

    Returns:
        ``[..., F]`` in ``x``'s dtype.

    Raises:
        ValueError: as :func:`linear`, or an odd number of weight rows.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[-1] != k or n % 2:
        raise ValueError(f"x [..., {k}] does not match a gate-up weight {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("weight must have a contiguous last dim")
    x2 = skinny_rows(x, k, None if wide else MAX_ROWS)
    m, f = x2.shape[0], n // 2
    y = torch.empty(m, f, device=x.device, dtype=x.dtype)
    cfg = config or config_for(n, k, x.dtype)
    block_m = BLOCK_M
    if m > MAX_ROWS:
        block_m, cfg = wide_config(cfg, x.dtype, weight_tiles=2)
    else:   # two weight tiles a stage: fewer stages where they would not fit
        cfg = dataclasses.replace(cfg, num_stages=_stages_fitting(cfg.num_stages, BLOCK_M, cfg.block_n, cfg.block_k,
                                                                  x.dtype, 2))
    if m and f:
        _skinny_swiglu_kernel[(triton.cdiv(f, cfg.block_n) * triton.cdiv(m, block_m),)](
            x2, weight, y, m, f, k, x2.stride(0), weight.stride(0), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x2.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(x2))
    return y.reshape(*x.shape[:-1], f)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           config: Config | None = None, wide: bool = False) -> torch.Tensor:
    """Triton version of ``kernels.linear.reference.linear`` for at most :data:`MAX_ROWS` rows
    (float32 inputs use IEEE float32 dots); with ``wide``, any number of rows, those past
    :data:`MAX_ROWS` in the larger tiles of :func:`wide_config`, whose rows have the bits of a
    1-row call (the batch-invariant steps: ``kernels.linear.batch_invariant``).

    Args:
        x: ``[..., K]``, float16 / bfloat16 / float32.
        weight: ``[N, K]``, same dtype, contiguous last dim.
        out_dtype: dtype of ``y`` (default ``x``'s); the value is ``x``'s dtype result widened.
        config: launch config (default :func:`config_for` ``(N, K, dtype)``; benchmarks and tests only).

    Returns:
        ``[..., N]``.

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, mismatched ``K``, or
            ``weight`` without a contiguous last dim.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[-1] != k:
        raise ValueError(f"x [..., {k}] does not match weight {tuple(weight.shape)}")
    x2 = skinny_rows(x, k, None if wide else MAX_ROWS)
    m = x2.shape[0]
    if weight.stride(-1) != 1:
        raise ValueError("weight must have a contiguous last dim")
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    cfg = config or config_for(n, k, x.dtype)
    block_m = BLOCK_M
    if m > MAX_ROWS:
        block_m, cfg = wide_config(cfg, x.dtype)
    if m and n:
        _launch(x2, weight, y, m, n, k, cfg, block_m)
    return y.reshape(*x.shape[:-1], n)


def _launch(x2, weight, y, m, n, k, cfg: Config, block_m: int = BLOCK_M) -> None:
    _skinny_kernel[(triton.cdiv(n, cfg.block_n) * triton.cdiv(m, block_m),)](
        x2, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=x2.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch(x2))
