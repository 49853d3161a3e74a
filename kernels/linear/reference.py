"""Linear projection ``y = x @ w^T``, plain PyTorch (the oracle for ``triton.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``, no bias), cast to
    ``out_dtype`` when given (the LM head asks for float32 logits)."""
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP's first half: ``silu(x @ gate^T) * (x @ up^T)`` with ``weight`` ``[2F, K]``
    = ``[gate; up]`` (llama-style ``ffn_gate`` / ``ffn_up`` fused; Shazeer, "GLU Variants Improve
    Transformer", 2020) -> ``[..., F]`` in ``x``'s dtype: :func:`linear`, then
    ``kernels.activation.reference.silu_mul``."""
    from kernels.activation.reference import silu_mul

    return silu_mul(linear(x, weight))
