"""SwiGLU in Triton, same contract as ``kernels/activation/reference.py``: one pass over
``[gate | up]`` instead of two kernels; ``silu(gate)`` is rounded to the input dtype before the
product, as the reference rounds it.

Per element: float32 ``g / (1 + exp(-g))`` rounded to the output dtype, widened back, times
float32 ``u``, rounded to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, F, sgu, so, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    g = tl.load(gu_ptr + row * sgu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * sgu + F + cols, mask=m, other=0.0).to(tl.float32)
    # silu(g) rounded to the output dtype (as F.silu on such a tensor rounds it), then the product
    # in float32 rounded again (as the dtype's product rounds)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * so + cols, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """Triton version of ``kernels.activation.reference.silu_mul``."""
    f = gu.shape[-1] // 2
    r = gu.reshape(-1, 2 * f)
    if r.stride(-1) != 1:
        r = r.contiguous()
    out = torch.empty(r.shape[0], f, device=gu.device, dtype=gu.dtype)
    block = min(1024, triton.next_power_of_2(f))
    _silu_mul_kernel[(r.shape[0], triton.cdiv(f, block))](r, out, f, r.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl.launch(r))
    return out.reshape(*gu.shape[:-1], f)
