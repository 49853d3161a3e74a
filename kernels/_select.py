"""Pick an op's implementation for its inputs (see :mod:`kernels.dispatch`)."""

from __future__ import annotations

import importlib

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
