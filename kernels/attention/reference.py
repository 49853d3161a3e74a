"""Tree attention, plain PyTorch (the oracle for any fused or Triton version).

Each of ``T`` new tokens (tree nodes, or a prefill chunk) attends to the committed cache rows
``[0, L)`` and to the new tokens its mask allows (its ancestors and itself for a token tree; the
earlier tokens and itself for a prefill chunk). Grouped-query attention: query head ``h`` reads
key/value head ``h // (Hq // Hkv)`` (the layout of HF ``repeat_kv``).
"""

from __future__ import annotations

import torch


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of new tokens over ``cache + new`` with a boolean mask on the new part.

    Args:
        q: ``[Hq, T, D]`` queries of the new tokens (any float dtype).
        k_cache, v_cache: ``[Hkv, L, D]`` committed rows (``L`` may be 0); every query sees all of them.
        k_new, v_new: ``[Hkv, T, D]`` keys/values of the new tokens.
        mask: ``[T, T]`` bool, ``mask[i, j]`` = new token ``i`` may attend to new token ``j``.
            Every row must allow at least itself (``mask[i, i]``), so no row is empty.
        scale: softmax scale, usually ``1 / sqrt(D)``.

    Returns:
        ``[Hq, T, D]`` in ``q``'s dtype. Scores and softmax are computed in float32; masked
        entries are ``-inf`` before the softmax, so padded or foreign rows get exactly zero weight.

    Raises:
        ValueError: ``Hq`` is not a multiple of ``Hkv``.
    """
    hq, t, d = q.shape
    hkv = k_new.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    group = hq // hkv
    k = torch.cat([k_cache, k_new], dim=1).float()
    v = torch.cat([v_cache, v_new], dim=1).float()
    qg = q.float().reshape(hkv, group * t, d)                 # [Hkv, G*T, D], rows grouped by kv head
    scores = torch.matmul(qg, k.transpose(1, 2)) * scale        # [Hkv, G*T, L+T]
    full = torch.cat([torch.ones(t, k_cache.shape[1], dtype=torch.bool, device=mask.device), mask], dim=1)
    scores = scores.reshape(hkv, group, t, -1).masked_fill(~full, float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(hkv, group * t, -1)
    out = torch.matmul(probs, v)                                 # [Hkv, G*T, D]
    return out.reshape(hq, t, d).to(q.dtype)
