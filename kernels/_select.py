"""Pick an op's implementation for its inputs (see :mod:`kernels.dispatch`)."""

from __future__ import annotations

import contextlib
import importlib
import threading

import torch

from kernels.dispatch import use_triton


def impl(package: str, *tensors: torch.Tensor):
    """``kernels.<package>.triton`` when the first tensor is on CUDA (and Triton is usable), no
    gradient is being recorded through these tensors, and it is not float64; else
    ``kernels.<package>.reference``."""
    t = tensors[0]
    fast = use_triton(t) and t.dtype != torch.float64 and not (
        torch.is_grad_enabled() and any(x.requires_grad for x in tensors))
    return importlib.import_module(f"kernels.{package}.{'triton' if fast else 'reference'}")


class _Invariant(threading.local):
    depth = 0


_INVARIANT = _Invariant()


@contextlib.contextmanager
def batch_invariant():
    """Within it (on this thread), :func:`kernels.linear.linear` keeps every row's bits independent of how many
    rows the call has: past 64 rows the Triton kernel runs in larger tiles with the same
    reduction order (``kernels.linear.triton.wide_config``) instead of cuBLAS, whose kernel choice
    depends on ``M``; quantized weights stay on their skinny path (:func:`kernels.quant.linear`).
    The batched engines' decode and verify steps run in it, so a request's tokens do not depend on
    what else is in its batch or on its tree's width (docs/ARCHITECTURE.md, "Width invariance");
    prefill chunks (cut the same way whatever the load) keep cuBLAS. Where the Triton kernels do
    not run (the CPU), it changes nothing."""
    _INVARIANT.depth += 1
    try:
        yield
    finally:
        _INVARIANT.depth -= 1


def invariant() -> bool:
    """Whether this thread is inside :func:`batch_invariant`."""
    return _INVARIANT.depth > 0
