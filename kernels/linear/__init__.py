"""Linear projections: the skinny Triton kernel on CUDA for at most 64 rows (any number inside
:func:`batch_invariant`), PyTorch otherwise; GGUF block-quantized weights through :mod:`kernels.quant`."""

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
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= 64:
        return impl("linear", x, weight).linear(x, weight, out_dtype)
    if invariant():
        mod = impl("linear", x, weight)
        if mod.__name__.endswith(".triton"):
            return mod.linear(x, weight, out_dtype, wide=True)
    from kernels.linear import reference

    return reference.linear(x, weight, out_dtype)


__all__ = ["batch_invariant", "invariant", "linear"]
