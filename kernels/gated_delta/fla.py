"""Chunked Gated DeltaNet prefill through ``fla-core`` (flash-linear-attention's Triton kernels).

Optional: used on CUDA when ``fla`` imports, otherwise :func:`available` is False and callers use
the reference recurrence. Same contract as
:func:`kernels.gated_delta.reference.recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no Triton / GPU support
        return None
    return chunk_gated_delta_rule


def available(device: torch.device) -> bool:
    """Whether the fla chunked kernel can run on ``device`` (CUDA with ``fla-core`` installed)."""
    return device.type == "cuda" and _fla_chunk() is not None


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``T`` tokens from ``state`` with fla's chunked algorithm (chunks of 64 tokens).

    Args:
        q, k: ``[T, H, Dk]`` (q L2-normalised and already scaled, k L2-normalised), one key per
            value head (tiled heads are expanded by the caller); v: ``[T, H, Dv]``;
            g: ``[T, H]`` log-decay; beta: ``[T, H]``; state: ``[H, Dk, Dv]`` float32.

    Returns:
        ``(o [T, H, Dv] float32, final_state [H, Dk, Dv] float32)``.

    Raises:
        RuntimeError: fla-core is not installed.
    """
    fn = _fla_chunk()
    if fn is None:
        raise RuntimeError("fla-core is not installed")
    o, final = fn(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=1.0, initial_state=state.unsqueeze(0).contiguous(), output_final_state=True,
    )
    return o[0].float(), final[0].float()
