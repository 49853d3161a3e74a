"""Building blocks shared by the target models and the DFlash drafter (plain PyTorch references).

* :func:`rms_norm` — ``x / sqrt(mean(x^2) + eps) * w`` (HF ``LlamaRMSNorm`` / ``Qwen3RMSNorm``),
  re-exported from ``kernels.norm.reference``.
* :func:`rope_cos_sin`, :func:`apply_rope` (and :func:`apply_rope_rows`, :func:`rope_table` for
  the GPU engine's rows-first layout and per-position tables) — rotary position embedding in the NeoX / HF
  "rotate_half" layout, optionally on the first ``rope_dim`` dims of a head only (partial rotary,
  as Qwen3.5's gated attention uses). Angles in float64 so large positions keep their precision.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_mul
from kernels.linear import linear
from kernels.norm import add_rms_norm
from kernels.norm.reference import rms_norm  # noqa: F401 (the reference; models call kernels.norm)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``cos, sin`` of shape ``[*positions.shape, rope_dim]``: the ``rope_dim / 2``
    frequencies ``theta^(-2i / rope_dim)`` repeated twice (NeoX layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float64) / rope_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``r = cos.shape[-1]`` dims of each head;
    the remaining ``D - r`` dims pass through. Computed in float32 (float64 for float64 ``x``),
    returned in ``x``'s dtype.

    Args:
        x: ``[..., heads, rows, D]``.
        cos, sin: ``[..., rows, r]`` from :func:`rope_cos_sin` (broadcast over heads), ``r <= D`` even.
    """
    acc = _acc(x.dtype)
    r = cos.shape[-1]
    xf = x[..., :r].to(acc)
    half = r // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    out = (xf * cos.to(acc).unsqueeze(-3) + rot * sin.to(acc).unsqueeze(-3)).to(x.dtype)
    return torch.cat([out, x[..., r:]], dim=-1) if r < x.shape[-1] else out


def apply_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for rows-first tensors: ``x`` ``[N, heads, D]``, ``cos``/``sin``
    ``[N, r]`` (one position per row) -> ``[N, heads, D]``."""
    return apply_rope(x.transpose(0, 1), cos, sin).transpose(0, 1)


def rope_table(max_positions: int, rope_dim: int, theta: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` ``[max_positions, rope_dim]``: :func:`rope_cos_sin` of positions
    ``0..max_positions-1`` computed in float64 and rounded once, so indexing the table by position
    gives exactly what :func:`apply_rope` uses (it computes in float32)."""
    cos, sin = rope_cos_sin(torch.arange(max_positions, device=device), rope_dim, theta)
    return cos.float(), sin.float()


def mlp_then_norm(x: torch.Tensor, h: torch.Tensor, lw: dict, next_norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU MLP of a decoder layer on its normed input ``h`` (``lw["gate_up"]`` ``[2F, H]``,
    ``lw["down"]`` ``[H, F]``), its residual add to ``x``, and the next norm (the next layer's
    input norm, or the output norm), fused: returns ``(x + mlp(h), next_norm(x + mlp(h)))``.

    ``silu(gate) * up`` runs as its own kernel (``kernels.activation.silu_mul``) before the down
    projection: the skinny kernel's fused ``swiglu`` prologue saves the launch but measured 3-4x
    slower than the two kernels on an H200 (4B down projection: 100 vs 24 us at one row;
    ``benchmarks/gpu/sweep-linear.json``), so it is not used here."""
    return add_rms_norm(x, linear(silu_mul(linear(h, lw["gate_up"])), lw["down"]), next_norm, eps)
