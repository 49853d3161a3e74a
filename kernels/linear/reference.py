"""Linear projection ``y = x @ w^T``, plain PyTorch (the oracle for ``triton.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``, no bias), cast to
    ``out_dtype`` when given (the LM head asks for float32 logits)."""
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)
