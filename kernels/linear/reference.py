"""Linear projection ``y = x @ w^T``, plain PyTorch (the oracle for ``triton.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
           prologue: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``, no bias), cast to
    ``out_dtype`` when given (the LM head asks for float32 logits). ``prologue="swiglu"``: ``x`` is
    ``[..., 2K]`` gate|up and the projection is of ``kernels.activation.reference.silu_mul(x)``."""
    if prologue == "swiglu":
        from kernels.activation.reference import silu_mul

        x = silu_mul(x)
    elif prologue is not None:
        raise ValueError(f"prologue {prologue!r}: expected None or 'swiglu'")
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)
