"""Skinny linear projection in Triton for the decode and small verify steps (``M <= 64`` rows):
one program per (block of output features, block of 16 rows) streams its rows of ``w``,
tensor-core dot against its 16 rows of ``x``, float32 accumulation, one rounding to the output
dtype. Each row's result is computed the same way whatever ``M`` is (same instruction shape,
same accumulation order), so a decode step and a verify step give the same projection of the
same row, which keeps speculative decoding token-identical to target-only decoding. At ``M = 1`` a projection is a pure read of the weight matrix; cuBLAS's general kernels
pay launch and ramp-up latency that dominates the small matrices of 0.1-1B models (the profile
in benchmarks/gpu/ counts it). Same contract as ``kernels.linear.reference.linear``; larger ``M``
goes to cuBLAS (``kernels.linear.linear``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 64


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """``y = x @ w^T`` for one block of output features; the result is rounded to ``x``'s dtype
    first (as ``F.linear`` rounds it) and then stored in ``y``'s dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    nm = rn < N
    mm = rm < M
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


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton version of ``kernels.linear.reference.linear`` for at most :data:`MAX_ROWS` rows
    (float32 inputs use IEEE float32 dots).

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, or ``weight`` without a contiguous last dim.
    """
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the skinny kernel takes at most {MAX_ROWS}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight must have a contiguous last dim")
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    ieee = x.dtype == torch.float32
    block_n = 16 if n <= 4096 else (32 if n <= 16384 else 64)
    block_k = 128 if ieee else 256
    _skinny_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, 16))](x2, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
                                                BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
                                                num_warps=4, num_stages=3)
    return y.reshape(*x.shape[:-1], n)
