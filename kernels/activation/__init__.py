"""Activation ops (reference in ``reference.py``, Triton in ``triton.py``, picked per call)."""

from kernels._select import impl


def silu_mul(gu):
    """:func:`kernels.activation.reference.silu_mul` (Triton on CUDA)."""
    return impl("activation", gu).silu_mul(gu)


__all__ = ["silu_mul"]
