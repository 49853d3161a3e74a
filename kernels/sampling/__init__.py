"""Token selection (greedy / Gumbel-max sampling with top-k / top-p) and the tree acceptance walk.

``filter_thresholds`` and ``sample_tokens`` run the Triton kernels (``kernels.sampling.triton``)
for CUDA tensors when Triton imports (``kernels.dispatch.use_triton``), the plain-PyTorch
reference otherwise; both give the same bits. ``select_tokens`` is the engine's per-request API
on top of them. The rest comes from ``kernels.sampling.reference``.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.sampling import reference as _reference
from kernels.sampling.reference import accept_path, filtered_logprobs, gumbel_noise, philox4x32_10


def _per_row(t: torch.Tensor, width: int) -> torch.Tensor:
    """A per-request setting ``[R / width]`` repeated for each of its ``width`` rows -> ``[R]``."""
    return t if width == 1 else t.repeat_interleave(width)


def filter_thresholds(
    logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    width: int = 1,
) -> torch.Tensor:
    """Per-row keep threshold ``[R]`` float32 of top-k / top-p filtering in the scaled domain
    (``kernels.sampling.reference.filter_thresholds`` documents the contract); Triton for CUDA
    tensors, the reference otherwise. ``width``: rows per setting (the settings are ``[R /
    width]``, each shared by ``width`` consecutive rows; the Triton kernel reads them so, without
    a kernel that repeats them first); float64 settings are rounded to float32 as read."""
    if use_triton(logits):
        from kernels.sampling import triton as _triton

        return _triton.filter_thresholds(logits, inv_temperature, top_k, top_p, width)
    return _reference.filter_thresholds(logits, *(_per_row(t, width) for t in (inv_temperature, top_k, top_p)))


def sample_tokens(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    width: int = 1,
) -> torch.Tensor:
    """One token per row ``[R]`` int64: greedy argmax or a seeded Gumbel-max sample of the kept
    tokens (``kernels.sampling.reference.sample_tokens`` documents the contract); Triton for CUDA
    tensors, the reference otherwise. ``width``: rows per setting, as :func:`filter_thresholds`
    (``inv_temperature`` and ``seeds`` are ``[R / width]``; ``threshold`` and ``positions`` per row)."""
    if use_triton(logits):
        from kernels.sampling import triton as _triton

        return _triton.sample_tokens(logits, inv_temperature, threshold, seeds, positions, width)
    return _reference.sample_tokens(logits, _per_row(inv_temperature, width), threshold, _per_row(seeds, width),
                                    positions)


def step_nodes(lengths: torch.Tensor, depth: torch.Tensor, n_nodes: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify step's node positions, the next positions and node validity
    (``kernels.sampling.reference.step_nodes`` documents the contract); one Triton launch for
    CUDA tensors, the reference otherwise."""
    if use_triton(depth):
        from kernels.sampling import triton as _triton

        return _triton.step_nodes(lengths, depth, n_nodes)
    return _reference.step_nodes(lengths, depth, n_nodes)


def select_tokens(
    logits: torch.Tensor,
    next_positions: list[int],
    temperature: float,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """The target's token choice at each row ``[T]`` int64: argmax at temperature 0, else a
    Gumbel-max sample with one request's settings (``kernels.sampling.reference.select_tokens``
    documents the arguments); the kernels are chosen as in :func:`filter_thresholds`."""
    return _reference.select_with(
        filter_thresholds, sample_tokens, logits, next_positions, temperature, top_k, top_p, seed
    )


__all__ = [
    "accept_path",
    "filter_thresholds",
    "filtered_logprobs",
    "gumbel_noise",
    "philox4x32_10",
    "sample_tokens",
    "select_tokens",
    "step_nodes",
]
