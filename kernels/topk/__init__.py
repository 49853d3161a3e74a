"""The top-``k`` of the log-softmax per row (the drafter step's candidate table):
``kernels.topk.triton`` (two launches) for CUDA tensors when Triton imports
(``kernels.dispatch.use_triton``), ``kernels.topk.reference`` (torch's ``topk(log_softmax)``,
literally) otherwise."""

from __future__ import annotations

import torch

from kernels._select import impl


def topk_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [..., k] float32, indices [..., k] int64)``: the ``k`` largest log-probs of each
    row of ``logits`` ``[..., V]`` and their columns, descending
    (``kernels.topk.reference.topk_log_softmax``; the Triton version breaks ties in the logits by
    the lower column, ``kernels.topk.triton`` documents it and the non-finite cases).

    Raises:
        ValueError: ``k`` outside ``[0, V]`` (both paths).
    """
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"k={k} outside [0, {logits.shape[-1]}] (the row length)")
    return impl("topk", logits).topk_log_softmax(logits, k)


__all__ = ["topk_log_softmax"]
