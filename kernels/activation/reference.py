"""SwiGLU activation, plain PyTorch (the oracle for ``triton.py``).

``silu_mul(gu) = silu(gate) * up`` with ``gu = [gate | up]`` along the last dim (the fused
``ffn_gate`` / ``ffn_up`` projection of llama-style MLPs; Shazeer, "GLU Variants Improve
Transformer", 2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``[..., 2F]`` -> ``[..., F]``: ``silu(gu[..., :F]) * gu[..., F:]`` in ``gu``'s dtype."""
    f = gu.shape[-1] // 2
    return F.silu(gu[..., :f]) * gu[..., f:]
