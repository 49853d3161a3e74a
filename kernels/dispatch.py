"""Choosing between an op's plain-PyTorch reference and its Triton version.

Every op in ``kernels/<op>/`` has ``reference.py`` (plain PyTorch, any device: the CPU path and
the test oracle) and, where speed matters, ``triton.py`` with the same signature. The package's
``__init__`` picks one per call with :func:`use_triton`: Triton for CUDA tensors when Triton
imports, the reference otherwise. ``DFLASH_KERNELS=reference`` forces the reference everywhere
(to bisect a numerical difference on a GPU); ``DFLASH_KERNELS=triton`` runs the Triton versions
on CPU tensors too, through Triton's interpreter.

Tests run the Triton versions on the CPU under ``TRITON_INTERPRET=1`` (``tests/conftest.py``
sets it on machines without CUDA) by calling ``kernels.<op>.triton`` directly.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works (the package is optional on CPU machines)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # not installed, or broken install
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` should run its Triton version: ``t`` is on CUDA, Triton imports and
    ``DFLASH_KERNELS`` is not ``reference``; ``DFLASH_KERNELS=triton`` also sends CPU tensors to
    Triton (its interpreter, ``TRITON_INTERPRET=1``: whole-engine runs of the kernels on a CPU)."""
    mode = os.environ.get("DFLASH_KERNELS", "")
    return (t.is_cuda or mode == "triton") and mode != "reference" and triton_available()
