"""Dequantization of GGUF block-quantized weights and ``x @ w^T`` on them, plain PyTorch (any device;
the CPU path and the oracle of ``triton.py``).

:func:`dequantize` reproduces gguf-py's ``gguf.quants.dequantize`` bit for bit in float32 (the same
float32 operations in the same order: ``d * q``, ``d * q + m``, ``(d * sc) * q - dmin * m``;
tests/test_quant_kernels.py checks it on random blocks and on real files). The block layouts are
in :mod:`kernels.quant.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant.weight import QuantizedWeight


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The float16 at byte ``off`` of each block of ``b`` (``[..., BS]`` uint8) as float32 ``[..., 1]``."""
    return b[..., off:off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: the n low nibbles, then the n high nibbles (int32)."""
    qs = qs.to(torch.int32)
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` bytes (a little-endian uint32) -> ``[..., 32]`` bits, bit ``j`` at ``j`` (int32)."""
    sh = torch.arange(8, device=qh.device, dtype=torch.int32)
    return ((qh.to(torch.int32)[..., :, None] >> sh) & 1).flatten(-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K from their 12 bytes ``[..., 12]`` (int32 ``[..., 8]`` each)."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _blocks_f32(b: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks ``[..., nb, BS]`` uint8 -> float32 ``[..., nb, QK]``."""
    if name == "Q4_0":
        return _f16(b, 0) * (_nibbles(b[..., 2:18]) - 8).float()
    if name == "Q4_1":
        return _f16(b, 0) * _nibbles(b[..., 4:20]).float() + _f16(b, 2)
    if name == "Q5_0":
        q = _nibbles(b[..., 6:22]) | (_bits32(b[..., 2:6]) << 4)
        return _f16(b, 0) * (q - 16).float()
    if name == "Q5_1":
        q = _nibbles(b[..., 8:24]) | (_bits32(b[..., 4:8]) << 4)
        return _f16(b, 0) * q.float() + _f16(b, 2)
    if name == "Q8_0":
        return b[..., 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)
    lead = b.shape[:-1]
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        dl = (_f16(b, 0) * sc.float())[..., None]                  # [..., 8, 1]
        ml = (_f16(b, 2) * mn.float())[..., None]
        qoff = 16 if name == "Q4_K" else 48
        q = _nibbles(b[..., qoff:qoff + 128].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)  # sub-block 2i, 2i+1
        if name == "Q5_K":
            sh = torch.arange(8, device=b.device, dtype=torch.int32)[:, None]
            q = q | (((b[..., 16:48].to(torch.int32)[..., None, :] >> sh) & 1) << 4)
        return (dl * q.float() - ml).reshape(*lead, 256)
    if name == "Q6_K":
        ql = _nibbles(b[..., 0:128].reshape(*lead, 2, 64))         # [..., h, 128]: r -> nibble r // 64 of ql[r % 64]
        sh = torch.arange(0, 8, 2, device=b.device, dtype=torch.int32)[:, None]  # 0, 2, 4, 6 (arange: graph-safe, no host copy)
        qh = ((b[..., 128:192].reshape(*lead, 2, 1, 32).to(torch.int32) >> sh) & 3).reshape(*lead, 2, 128)
        q = ((ql | (qh << 4)) - 32).float().reshape(*lead, 16, 16)
        dl = (_f16(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float())[..., None]  # [..., 16, 1]
        return (dl * q).reshape(*lead, 256)
    raise ValueError(f"no dequantization for {name}")  # pragma: no cover - QuantizedWeight validates


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's values, ``[N, K]`` in ``dtype`` on the weight's device: computed in float32
    (equal bit for bit to ``gguf.quants.dequantize``), then cast once. Temporary memory: a few
    float32 / int32 copies of the whole matrix (dequantize big weights by :meth:`~QuantizedWeight.rows`)."""
    n, k = weight.shape
    out = _blocks_f32(weight.blocks(), weight.qtype.name).reshape(n, k)   # (a padded weight's blocks without the pad)
    return out if dtype == torch.float32 else out.to(dtype)


def _check(x: torch.Tensor, weight: QuantizedWeight) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight, got {type(weight).__name__}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the {weight.qtype.name} weight {weight.shape}")


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(weight)^T`` in float32 (the oracle): ``x`` ``[..., K]`` (any float dtype,
    widened to float32), ``weight`` ``[N, K]``; returns ``[..., N]`` rounded once to ``out_dtype``
    (default ``x``'s dtype).

    Raises:
        ValueError: ``x``'s last dim is not ``K``.
        TypeError: ``weight`` is not a :class:`QuantizedWeight`.
    """
    _check(x, weight)
    y = F.linear(x.float(), dequantize(weight, torch.float32))
    return y.to(out_dtype or x.dtype)


#: Elements of ``weight`` dequantized at a time by :func:`linear_dequantized` (bounds its temporaries).
CHUNK_ELEMS = 1 << 24


def linear_dequantized(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, x.dtype))`` (the weight rounded to ``x``'s dtype, as the
    loader's bf16 weights are, then the usual matmul: cuBLAS on CUDA), by chunks of output features
    of at most :data:`CHUNK_ELEMS` elements so the dequantized copy stays small. Not on a serving
    path (more than 64 rows on CUDA go to :func:`kernels.quant.triton.linear_tiled`): the baseline
    ``tools/sweep_quant.py`` times the tiled kernel against. Returns ``[..., N]`` in ``out_dtype``
    (default ``x``'s).

    Raises:
        ValueError / TypeError: as :func:`linear`.
    """
    _check(x, weight)
    n, k = weight.shape
    step = max(1, CHUNK_ELEMS // max(k, 1))
    if n <= step:
        y = F.linear(x, dequantize(weight, x.dtype))
    else:
        y = torch.cat([F.linear(x, dequantize(weight.rows(i, i + step), x.dtype)) for i in range(0, n, step)], dim=-1)
    return y if out_dtype is None else y.to(out_dtype)
