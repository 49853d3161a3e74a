"""RMSNorm kernels in Triton, same contracts as ``kernels/norm/reference.py``: one program per
row, the row in registers; the residual add of :func:`add_rms_norm` and the SiLU gate of
:func:`gated_rms_norm` are fused in, so a layer pays one launch where the reference pays seven.
Roundings follow the reference (statistics in float32, normalised value rounded to the input
dtype before the weight, products rounded as PyTorch rounds them); the reduction order differs,
so results agree to float32 rounding of the statistics, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter


@triton.jit
def _rms_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, z_ptr, N, eps, sx, sd, ss, sy, sz, HX, sxh,
                HAS_DELTA: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    # x's row `row` = head `row % HX` of its outer row `row // HX` (HX = 1: plain rows)
    x = tl.load(x_ptr + (row // HX) * sx + (row % HX) * sxh + cols, mask=m, other=0.0)
    if GATED:
        x = x.to(z_ptr.dtype.element_ty)              # float32 recurrence output -> model dtype
    if HAS_DELTA:
        d = tl.load(d_ptr + row * sd + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * ss + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    out = (y.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty)
    if GATED:
        zf = tl.load(z_ptr + row * sz + cols, mask=m, other=0.0).to(tl.float32)
        gate = (zf / (1.0 + tl.exp(-zf))).to(y_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * gate.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, out, mask=m)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    r = t.reshape(-1, n)
    return r if r.stride(-1) == 1 else r.contiguous()


def _head_rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int, int, int]:
    """``t`` as rows of ``n`` for the kernel: ``(tensor, rows, outer stride, heads per outer row,
    head stride)``. A ``[A, heads, n]`` view whose heads are not one run of rows (the q or k heads
    of a packed ``[A, (hq + 2 hkv) * n]`` projection, sliced) is read in place, as ``heads`` rows
    per outer row, not copied first (a copy kernel per norm, and a break in the chain of
    dependent launches: :mod:`kernels.pdl`)."""
    if t.dim() == 3 and t.stride(-1) == 1 and t.shape[1] > 1:
        try:
            t.view(-1, n)
        except RuntimeError:
            return t, t.shape[0] * t.shape[1], t.stride(0), t.shape[1], t.stride(1)
    r = _rows(t, n)
    return r, r.shape[0], r.stride(0), 1, 0


def _launch(x, delta, weight, eps, z=None):
    n = x.shape[-1]
    if delta is None and z is None:
        xr, rows, sx, hx, sxh = _head_rows(x, n)
    else:
        xr = _rows(x, n)
        rows, sx, hx, sxh = xr.shape[0], xr.stride(0), 1, 0
    out_dtype = z.dtype if z is not None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(rows, n, device=x.device, dtype=out_dtype)
    s = torch.empty_like(y, dtype=x.dtype) if delta is not None else y
    dr = _rows(delta, n) if delta is not None else y
    zr = _rows(z, n) if z is not None else y
    block = triton.next_power_of_2(n)
    _rms_kernel[(rows,)](xr, dr, weight, s, y, zr, n, float(eps), sx, dr.stride(0), s.stride(0),
                         y.stride(0), zr.stride(0), hx, sxh, HAS_DELTA=delta is not None, GATED=z is not None,
                         BLOCK=block, num_warps=4 if block <= 1024 else 8, **pdl.launch(y))
    return s.reshape(x.shape), y.reshape(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of ``kernels.norm.reference.rms_norm``."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``kernels.norm.reference.add_rms_norm``."""
    return _launch(x, delta, weight, eps)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of ``kernels.norm.reference.gated_rms_norm``."""
    return _launch(o, None, weight, eps, z=z)[1]
