"""Building blocks of the target models.

* :func:`rms_norm` — ``x / sqrt(mean(x^2) + eps) * w`` (HF ``LlamaRMSNorm`` / ``Qwen3RMSNorm``),
  re-exported from ``kernels.norm.reference``.
* :func:`rope_cos_sin`, :func:`apply_rope`, :func:`apply_rope_rows`, :func:`rope_table` — rotary
  position embedding, re-exported from ``kernels.rope.reference`` (where the math is written).
* :func:`mlp_then_norm` — the SwiGLU MLP, residual add and the next norm.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_mul
from kernels.linear import linear
from kernels.norm import add_rms_norm
from kernels.norm.reference import rms_norm  # noqa: F401 (the reference; models call kernels.norm)
from kernels.rope.reference import apply_rope, apply_rope_rows, rope_cos_sin, rope_table  # noqa: F401 (re-exported)


def mlp_then_norm(x: torch.Tensor, h: torch.Tensor, lw: dict, next_norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU MLP of a decoder layer on its normed input ``h`` (``lw["gate_up"]`` ``[2F, H]``,
    ``lw["down"]`` ``[H, F]``), its residual add to ``x``, and the next norm (the next layer's
    input norm, or the output norm), fused: returns ``(x + mlp(h), next_norm(x + mlp(h)))``.

    ``silu(gate) * up`` runs as its own kernel (``kernels.activation.silu_mul``) before the down
    projection: a SwiGLU prologue fused into the skinny kernel saved the launch but measured 3-4x
    slower than the two kernels on an H200 (4B down projection: 100 vs 24 us at one row;
    ``benchmarks/gpu/sweep-linear.json``), so it was removed."""
    return add_rms_norm(x, linear(silu_mul(linear(h, lw["gate_up"])), lw["down"]), next_norm, eps)
