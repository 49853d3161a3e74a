"""Building blocks of the target models.

* :func:`rms_norm` — ``x / sqrt(mean(x^2) + eps) * w`` (HF ``LlamaRMSNorm`` / ``Qwen3RMSNorm``),
  re-exported from ``kernels.norm.reference``.
* :func:`rope_cos_sin`, :func:`apply_rope`, :func:`apply_rope_rows`, :func:`rope_table` — rotary
  position embedding, re-exported from ``kernels.rope.reference`` (where the math is written).
* :func:`mlp_then_norm` — the SwiGLU MLP, residual add and the next norm.
* :func:`moe_ffn`, :func:`moe_then_norm` — the sparse mixture-of-experts FFN of ``qwen3moe``
  (router softmax, top-k, SwiGLU experts), alone and with the residual add and the next norm.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_mul
from kernels.linear import linear, linear_swiglu
from kernels.norm import add_rms_norm
from kernels.norm.reference import rms_norm  # noqa: F401 (the reference; models call kernels.norm)
from kernels.rope.reference import apply_rope, apply_rope_rows, rope_cos_sin, rope_table  # noqa: F401 (re-exported)


def mlp_then_norm(x: torch.Tensor, h: torch.Tensor, lw: dict, next_norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU MLP of a decoder layer on its normed input ``h`` (``lw["gate_up"]`` ``[2F, H]``,
    ``lw["down"]`` ``[H, F]``), its residual add to ``x``, and the next norm (the next layer's
    input norm, or the output norm), fused: returns ``(x + mlp(h), next_norm(x + mlp(h)))``.

    ``silu(gate) * up`` is the gate-up projection's epilogue (``kernels.linear.linear_swiglu``: one
    launch, the bits of the projection then ``silu_mul``). A SwiGLU *prologue* of the down
    projection instead (each program recomputing the activation of its input) measured 3-4x slower
    than the two kernels on an H200 (4B down projection: 100 vs 24 us at one row;
    ``benchmarks/gpu/sweep-linear.json``) and was removed."""
    return add_rms_norm(x, linear(linear_swiglu(h, lw["gate_up"]), lw["down"]), next_norm, eps)


def moe_ffn(h: torch.Tensor, lw: dict, top_k: int, norm_topk: bool = True) -> torch.Tensor:
    """The sparse MoE FFN of a ``qwen3moe`` layer on its normed input ``h`` ``[N, H]`` -> ``[N, H]``.

    Routing (transformers' ``Qwen3MoeTopKRouter`` / ``Qwen3MoeSparseMoeBlock``; llama.cpp's
    ``build_moe_ffn`` with softmax gating and ``norm_w``): ``p = softmax(h @ router^T)`` in float32
    over the ``E`` experts, the ``top_k`` largest ``p`` chosen, divided by their sum when
    ``norm_topk``; the output is ``sum_j p_j * down_j(silu(gate_j h) * up_j h)`` over the chosen
    experts.

    Computed densely, as two projections over all experts (no host read, no data-dependent shape,
    so it is graph-safe, and each row is computed as the skinny linear kernel computes it whatever
    the number of rows, so the step stays width-invariant):

    * ``lw["gate_up_exps"]`` ``[E * 2F, H]`` (expert ``e``'s gate rows then its up rows at
      ``[2F e, 2F (e + 1))``): one projection gives every expert's ``[gate | up]``, then
      ``silu_mul`` per expert -> ``a`` ``[N, E, F]``;
    * each expert's activations are scaled by its routing weight (0 for the experts not chosen,
      which therefore add exactly nothing), and ``lw["down_exps"]`` ``[H, E * F]`` (expert ``e``'s
      down matrix in columns ``[F e, F (e + 1))``) sums ``down_e(w_e a_e)`` over ``e`` in one
      projection (the down projection is linear, so ``sum_e w_e down_e(a_e) = down(w a)``).

    Cost: every expert is computed for every row (``E / top_k`` times the FLOPs of the chosen
    experts) and every expert weight is read once per call: a step costs what a dense model of the
    MoE's total size costs, not of its active size (docs/ARCHITECTURE.md, "Models").

    Args:
        h: ``[N, H]`` normed hidden rows (the model dtype).
        lw: the layer's weights: ``router`` ``[E, H]`` (float32 for 16-bit models), ``gate_up_exps``,
            ``down_exps`` as above.
        top_k: experts per token (``expert_used_count``), ``1 <= top_k <= E``.
        norm_topk: renormalise the chosen probabilities to sum 1 (Qwen3-MoE: true).
    """
    router = lw["router"]
    n, e = h.shape[0], router.shape[0]
    f = lw["down_exps"].shape[1] // e
    probs = torch.softmax(linear(h.to(router.dtype), router), dim=-1, dtype=torch.float32)   # [N, E]
    top_p, top_i = torch.topk(probs, top_k, dim=-1)                                          # [N, k]
    if norm_topk:
        total = top_p[:, 0]
        for j in range(1, top_k):               # a fixed order per row (no reduction config)
            total = total + top_p[:, j]
        top_p = top_p / total[:, None]
    weights = torch.zeros_like(probs).scatter_(1, top_i, top_p)                              # [N, E]
    a = silu_mul(linear(h, lw["gate_up_exps"]).view(n, e, 2 * f))                           # [N, E, F]
    a = (a.float() * weights[:, :, None]).to(a.dtype).view(n, e * f)                     # one rounding
    return linear(a, lw["down_exps"])


def moe_then_norm(x: torch.Tensor, h: torch.Tensor, lw: dict, next_norm: torch.Tensor, eps: float, top_k: int,
                  norm_topk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlp_then_norm`'s contract with :func:`moe_ffn` for the MLP: returns
    ``(x + moe(h), next_norm(x + moe(h)))``."""
    return add_rms_norm(x, moe_ffn(h, lw, top_k, norm_topk), next_norm, eps)
