"""Linear projections: the skinny Triton kernel on CUDA for at most 64 rows (any number inside
:func:`batch_invariant`), PyTorch otherwise; GGUF block-quantized weights through :mod:`kernels.quant`;
:func:`linear_swiglu`, the gate-up projection with SwiGLU fused in the same way."""

import torch

from kernels._select import batch_invariant, impl, invariant


def linear(x, weight, out_dtype=None):
    """:func:`kernels.linear.reference.linear` (the Triton skinny kernel on CUDA for <= 64 rows).

    ``weight`` may also be a :class:`kernels.quant.QuantizedWeight` (:func:`kernels.quant.linear`:
    the fused dequantize-matmul) or a :class:`kernels.quant.PackedWeight` (each part's product,
    concatenated along the last dim)."""
    if not isinstance(weight, torch.Tensor):
        from kernels import quant

        if isinstance(weight, quant.PackedWeight):
            return torch.cat([linear(x, p, out_dtype) for p in weight.parts], dim=-1)
        return quant.linear(x, weight, out_dtype)
    skinny = _skinny(x, weight)
    if skinny is not None:
        mod, wide = skinny
        return mod.linear(x, weight, out_dtype, wide=wide)
    from kernels.linear import reference

    return reference.linear(x, weight, out_dtype)


def _skinny(x, weight):
    """``(kernels.linear.triton, wide)`` where the skinny Triton kernel takes ``x @ weight^T`` (at
    most 64 rows, or any number inside :func:`batch_invariant`: ``wide``), else None (the
    reference: cuBLAS on a GPU, the CPU)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows > 64 and not invariant():
        return None
    mod = impl("linear", x, weight)
    return (mod, rows > 64) if mod.__name__.endswith(".triton") else None


def linear_swiglu(x, weight):
    """``silu_mul(linear(x, weight))`` for a gate-up weight ``[2F, K]``
    (:func:`kernels.linear.reference.linear_swiglu`): one Triton launch where :func:`linear` would
    run the skinny kernel (its bits, then ``silu_mul``'s); otherwise (cuBLAS rows, quantized or
    packed weights, the CPU) :func:`linear` and then ``kernels.activation.silu_mul``."""
    skinny = _skinny(x, weight) if isinstance(weight, torch.Tensor) else None
    if skinny is not None:
        mod, wide = skinny
        return mod.linear_swiglu(x, weight, wide=wide)
    from kernels.activation import silu_mul

    return silu_mul(linear(x, weight))


__all__ = ["batch_invariant", "invariant", "linear", "linear_swiglu"]
