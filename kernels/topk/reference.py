"""The drafter's top-K of the log-softmax in plain PyTorch: the CPU path and the test oracle of
``kernels.topk.triton``."""

from __future__ import annotations

import torch


def topk_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(torch.log_softmax(logits.float(), -1), k, -1)``, literally (the fused
    drafter step on the CPU gives the reference step's bits).

    Args:
        logits: ``[..., V]`` floating point (any device); computed in float32.
        k: candidates per row, ``0 <= k <= V``.

    Returns:
        ``(values [..., k] float32, indices [..., k] int64)``: the ``k`` largest log-probs of each
        row, sorted descending, and their columns. The order of exactly tied values is torch's
        (unspecified); a row with a NaN logit, or all ``-inf``, has NaN log-probs.

    Raises:
        RuntimeError: from torch, for ``k`` outside ``[0, V]``.
    """
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.values, top.indices
