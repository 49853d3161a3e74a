"""RMSNorm, plain PyTorch (the oracle for ``triton.py``).

``rms_norm(x) = weight * (x / sqrt(mean(x^2) + eps))`` over the last dim (HF ``LlamaRMSNorm`` /
``Qwen3RMSNorm``): statistics in float32 (float64 for float64 ``x``), the normalised value cast to
``x``'s dtype, then multiplied by ``weight`` as stored (a GGUF ``1 + w`` norm is folded in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of ``x`` ``[..., N]`` with ``weight`` ``[N]``; result in ``x``'s dtype (times
    ``weight``, promoted as PyTorch promotes)."""
    xf = x.to(_acc(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: ``s = x + delta`` (in ``x``'s dtype) and
    ``rms_norm(s, weight, eps)``. Returns ``(s, normed)``."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated output norm of a Gated DeltaNet layer: ``rms_norm(o) * silu(z)`` per value
    head (``o`` float32 ``[..., HV, Dv]`` cast to ``z``'s dtype first, ``z`` ``[..., HV, Dv]``,
    ``weight`` ``[Dv]``; llama.cpp ``ssm_norm``, HF ``Qwen3_5RMSNormGated``)."""
    return rms_norm(o.to(z.dtype), weight, eps) * F.silu(z)
