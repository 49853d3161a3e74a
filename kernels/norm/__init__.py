"""RMSNorm ops (reference in ``reference.py``, Triton in ``triton.py``, picked per call)."""

from kernels._select import impl


def rms_norm(x, weight, eps):
    """:func:`kernels.norm.reference.rms_norm` (Triton on CUDA)."""
    return impl("norm", x, weight).rms_norm(x, weight, eps)


def add_rms_norm(x, delta, weight, eps):
    """:func:`kernels.norm.reference.add_rms_norm` (Triton on CUDA)."""
    return impl("norm", x, delta, weight).add_rms_norm(x, delta, weight, eps)


def gated_rms_norm(o, z, weight, eps):
    """:func:`kernels.norm.reference.gated_rms_norm` (Triton on CUDA)."""
    return impl("norm", z, o, weight).gated_rms_norm(o, z, weight, eps)


__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]
